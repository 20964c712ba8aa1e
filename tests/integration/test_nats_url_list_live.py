"""A NATS URL list (``nats://h1:4222,nats://h2:4222``, the NATS Go client's and ``nats`` CLI's form for a
cluster) and percent-encoded credentials, against real nats-servers.

Before, every connect passed the string to nats-py, which takes a string as ONE server: a list failed at
once ("nats: invalid connect url option"), and nats-py does not percent-decode a URL's user part, so a
password with ``,`` ``/`` ``@`` ``:`` written as the URL form asks (``nats://ei:p%2Cw@h``) was refused
("Authorization Violation"). The first server of each list here is a free loopback port with nothing
listening (a cluster node that is down).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from evolving_infra.cli import main as cli_main
from services.worker.kvpool.demo import main as demo_main
from shared.auth import bcrypt_hash
from shared.bus import Bus, BusError, NoCredentials
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects
from tests.integration.polling import run_until_started

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "p,w/x@y:z%41-7c2e"
"""Every character a URL's user part must escape (and a ``%`` that is no escape once encoded)."""
ENCODED = quote(PASSWORD, safe="")

pytestmark = pytest.mark.timeout(120)


def _down() -> str:
    """A loopback URL with nothing listening (a free port, closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without its ``EI_*`` settings, plus ``extra``; the state folder is the test's own (no
    ``up`` cluster of another process is found, which ``tap`` would name in a note)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    return env | {"PYTHONPATH": str(REPO), "EI_STATE_DIR": str(tmp_path / "state"), **extra}


@pytest.fixture
def password_server():
    """A nats-server whose one user ``ei`` has ``PASSWORD``, bcrypt-hashed in its config (as ``up --nats-auth password``)."""
    with EmbeddedNatsServer(jetstream=False, auth_block=f'authorization {{ user: "ei", password: "{bcrypt_hash(PASSWORD)}" }}') as srv:
        yield srv


async def _connected_port(url: str) -> int:
    bus = await Bus.connect(url, Subjects("p0"), service="operator", instance="operator", connect_timeout=2)
    try:
        await bus.flush(5)
        return bus.nc.connected_url.port
    finally:
        await bus.close()


async def test_a_url_list_whose_first_server_is_down_connects_to_the_next(nats_server):
    assert await _connected_port(f"{_down()},{nats_server.url}") == nats_server.port
    assert await _connected_port(f"{_down()}, {nats_server.url.removeprefix('nats://')}") == nats_server.port  # as Go reads it


async def test_percent_encoded_password_connects_alone_and_in_a_list(password_server):
    port = password_server.port
    assert await _connected_port(f"nats://ei:{ENCODED}@127.0.0.1:{port}") == port
    each = f"{_down().replace('nats://', f'nats://ei:{ENCODED}@')},nats://ei:{ENCODED}@127.0.0.1:{port}"
    assert await _connected_port(each) == port  # every server with its own (same) credentials
    assert await _connected_port(f"nats://ei:{ENCODED}@{_down().removeprefix('nats://')},127.0.0.1:{port}") == port


async def test_a_refused_url_password_is_called_refused_not_missing(password_server):
    """Wrong credentials in the URL (the only ones given): the error said "requires credentials and none
    were given" (``NoCredentials``, which ``split`` follows with how to give credentials)."""
    url = f"nats://ei:{quote('wrong/pw', safe='')}@127.0.0.1:{password_server.port}"
    with pytest.raises(BusError) as e:
        await Bus.connect(url, Subjects("p0"), service="operator", instance="operator", max_reconnect_attempts=0)
    assert not isinstance(e.value, NoCredentials) and "refused the credentials in the URL" in str(e.value), str(e.value)
    assert "wrong" not in str(e.value)


def test_a_service_comes_up_with_a_url_list_in_ei_nats_url(password_server, tmp_path):
    url = f"{_down()},nats://ei:{ENCODED}@127.0.0.1:{password_server.port}"
    text = run_until_started(["-m", "services.kvdirectory"], _env(tmp_path, EI_NATS_URL=url), tmp_path / "kvdirectory.log")
    assert "service started" in text, text
    assert PASSWORD not in text and ENCODED not in text, [ln for ln in text.splitlines() if ENCODED in ln or PASSWORD in ln]
    assert f"nats://ei:***@127.0.0.1:{password_server.port}" in text


async def test_kvpool_demo_takes_the_url_from_ei_nats_url(password_server, tmp_path, monkeypatch, capsys):
    """``demo`` required ``--nats-url`` (a password there is in every local user's ``ps``); now it reads
    ``EI_NATS_URL`` as the services do, and without either it is a usage error (2)."""
    monkeypatch.delenv("EI_NATS_URL", raising=False)
    assert await asyncio.to_thread(demo_main, ["hold", "--node", "a", "--blocks", "1"]) == 2
    assert "EI_NATS_URL" in capsys.readouterr().err
    demo = [sys.executable, "-m", "services.worker.kvpool.demo", "hold", "--node", "a", "--blocks", "1"]
    env = _env(tmp_path, EI_NATS_URL=f"{_down()},nats://ei:{ENCODED}@127.0.0.1:{password_server.port}")
    proc = await asyncio.create_subprocess_exec(*demo, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)  # type: ignore[union-attr]
        if not line:
            err = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
            if await proc.wait() == 3:  # connected, then no Mooncake for the pool (the order of hold)
                pytest.skip(f"mooncake.engine does not import: {err[-300:]}")
            raise AssertionError(f"demo exited ({proc.returncode}) without output:\n{err[-3000:]}")
        assert json.loads(line)["event"] == "ready"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_tap_connects_through_a_url_list_with_a_percent_encoded_password(password_server, tmp_path, monkeypatch, capsys):
    """``tap`` (its own nats-py client, not the bus) reads the list and the encoded password too: it
    subscribes and prints its banner, the URL without the password."""
    env = _env(tmp_path, EI_NATS_URL=f"{_down()},nats://ei:{ENCODED}@127.0.0.1:{password_server.port}")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "evolving_infra.cli", "tap", cwd=REPO, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        banner = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()  # type: ignore[union-attr]
        assert banner.startswith("tapping ") and f"nats://ei:***@127.0.0.1:{password_server.port}" in banner, banner
        assert ENCODED not in banner and PASSWORD not in banner
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    for k in [k for k in os.environ if k.startswith("EI_NATS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("EI_NATS_URL", f"nats://ei:wrong-9f@127.0.0.1:{password_server.port}")  # said "none were given"
    assert await asyncio.to_thread(cli_main, ["tap"]) == 2
    err = capsys.readouterr().err
    assert "refused the credentials in the URL" in err and "wrong-9f" not in err, err
