"""A password in the NATS URL (``nats://user:pass@host``, which nats-py authenticates with) stays out of logs
and error messages, against a real nats-server that requires it.

Before, every service logged its URL whole at start (``service started nats=nats://ei:<password>@...``) and
a refused connection's error (``BusError``, printed by ``split`` / ``tap``) carried it too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.bus import Bus, BusError
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects
from tests.integration.polling import run_until_started

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "pw-6f1c0e9a4b7d"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def password_server():
    with EmbeddedNatsServer(auth_block=f'authorization {{ user: "ei", password: "{PASSWORD}" }}') as srv:
        yield srv


def test_service_log_shows_the_url_without_its_password(password_server, tmp_path):
    url = password_server.url.replace("nats://", f"nats://ei:{PASSWORD}@")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    env["PYTHONPATH"] = str(REPO)
    text = run_until_started(["-m", "services.kvdirectory", "--nats-url", url], env, tmp_path / "kvdirectory.log")
    assert "service started" in text, text  # it connected with the URL's password
    assert PASSWORD not in text, [ln for ln in text.splitlines() if PASSWORD in ln]
    assert f"nats://ei:***@127.0.0.1:{password_server.port}" in text


async def test_refused_password_is_not_in_the_error(password_server):
    url = password_server.url.replace("nats://", "nats://ei:wrong-secret-9@")
    with pytest.raises(BusError) as e:
        await Bus.connect(url, Subjects("p0"), service="operator", instance="operator", max_reconnect_attempts=0)
    assert "wrong-secret-9" not in str(e.value) and "ei:***@" in str(e.value), str(e.value)


def test_auth_stream_takes_the_url_from_the_environment_and_prints_it_without_its_password(password_server, tmp_path):
    """``auth stream`` needed ``--nats-url`` (the compose entrypoint and the Slurm job passed ``$EI_NATS_URL``
    there, in every local user's ``ps``) and printed the URL whole: ``JetStream stream EI_p0 on
    nats://ei:<password>@...`` in the job's log. Now it reads ``EI_NATS_URL`` when the flag is absent and
    prints the URL with ``***`` for the password; no URL at all is a usage error (2)."""
    url = password_server.url.replace("nats://", f"nats://ei:{PASSWORD}@")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    env["PYTHONPATH"] = str(REPO)

    def auth_stream(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "evolving_infra.cli", "auth", "stream", "--timeout", "10", *args],
                              cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True, timeout=60)  # fmt: skip

    r = auth_stream(EI_NATS_URL=url)
    assert r.returncode == 0, r
    assert r.stdout.strip() == f"JetStream stream EI_p0 on nats://ei:***@127.0.0.1:{password_server.port}", r
    r = auth_stream("--nats-url", url.replace(PASSWORD, "wrong-secret-9"))  # the flag still works; refused
    assert r.returncode == 1 and "wrong-secret-9" not in r.stderr + r.stdout and "ei:***@" in r.stderr, r
    r = auth_stream()
    assert r.returncode == 2 and "EI_NATS_URL" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r


def test_up_children_connect_with_a_password_url_that_is_not_on_their_command_line(password_server, tmp_path, monkeypatch):
    """``up --nats-url nats://ei:<password>@...``: a service ``up`` starts (and the supervisor restarts) has the URL in
    its environment, not in ``/proc/<pid>/cmdline`` (every local user's ``ps``), and connects with it. Before, each
    got ``--nats-url <the URL>`` on its command line."""
    from evolving_infra.cluster import ClusterSpec, LocalCluster

    for k in [k for k in os.environ if k.startswith("EI_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    url = password_server.url.replace("nats://", f"nats://ei:{PASSWORD}@")
    c = LocalCluster(ClusterSpec(nodes=1, split="collocated", nats_url=url, log_dir=str(tmp_path)))
    c.log_dir, c.nats_url = tmp_path, url
    c.children = [k for k in c._plan_children() if k.name == "kvdirectory"]
    c._wire_children()
    kv = c.children[0]

    def started(times: int) -> None:
        deadline = time.monotonic() + 60
        while kv.log_path.read_text().count("service started") < times and kv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kv.log_path.read_text().count("service started") == times, kv.log_path.read_text()  # connected
        cmdline = Path(f"/proc/{kv.proc.pid}/cmdline").read_bytes().decode()
        assert PASSWORD not in cmdline and "--nats-url" not in cmdline, cmdline

    try:
        c._spawn(kv)
        started(1)
        kv.proc.kill()
        kv.proc.wait(timeout=10)
        now = time.monotonic()
        assert c.supervise_once(now) == [] and c.supervise_once(now + 60) == ["kvdirectory"]  # the supervisor's restart
        started(2)
    finally:
        if kv.proc is not None and kv.proc.poll() is None:
            kv.proc.terminate()
            kv.proc.wait(timeout=30)
        kv.log_file.close()  # type: ignore[attr-defined]
    assert PASSWORD not in kv.log_path.read_text()
