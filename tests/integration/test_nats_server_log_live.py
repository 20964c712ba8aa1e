"""The embedded nats-server's own log (failed logins, permission violations) is kept in the cluster's log folder,
and its config says which identity each nkey is.

A newcomer found "authentication error" and "Publish Violation" lines only in ``/tmp/ei-nats-*/nats.log``, which
``up`` deleted when it stopped, naming the client by its nkey alone (``$G/nkey:U...``) while nothing said whose key
that was. Now the log and the config go to the log folder (``up --log-dir``, or its kept ``ei-logs-*`` folder) and
each user of the config follows a ``# identity: <name>`` comment.
"""

from __future__ import annotations

import asyncio
import re
import stat
import time

import nats
import nats.errors
import pytest

from evolving_infra.cluster import ClusterSpec, LocalCluster
from shared.auth import generate, new_nkey_seed
from shared.natsserver import EmbeddedNatsServer
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(60)


def _public_key(conf: str, name: str) -> str:
    """The nkey that follows ``# identity: name`` in a server config."""
    match = re.search(rf'# identity: {re.escape(name)}\n\s*\{{ nkey: "(U[A-Z0-9]+)"', conf)
    assert match, f"no '# identity: {name}' comment before an nkey in:\n{conf[:600]}"
    return match.group(1)


async def test_failed_logins_and_violations_stay_in_log_dir_naming_a_key_the_config_names(tmp_path):
    creds = generate(tmp_path / "creds", ["router"])
    logs = tmp_path / "logs"
    with EmbeddedNatsServer(auth_block=creds.server_block, log_dir=logs) as srv:
        router = await nats.connect(srv.url, **creds.auth_for("router").connect_options(), allow_reconnect=False)
        try:
            await router.publish("ei.p0.split.commands", b"{}")  # only the planner may: a Publish Violation
            await router.flush(timeout=5)
        finally:
            await router.close()
        stranger = tmp_path / "stranger.nk"
        stranger.write_bytes(new_nkey_seed()[0] + b"\n")
        with pytest.raises(nats.errors.Error):  # an nkey the server does not know: refused
            await nats.connect(srv.url, nkeys_seed=str(stranger), allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
        log_file = logs / "nats.log"
        await until(lambda: "authentication error" in log_file.read_text() and "Publish Violation" in log_file.read_text(),
                    10.0, "the server logged both")
    assert log_file.exists(), "nats.log removed with the server"  # kept after the stop
    conf = (logs / "nats.conf").read_text()
    assert stat.S_IMODE((logs / "nats.conf").stat().st_mode) == 0o600
    key = _public_key(conf, "router")
    violation = next(line for line in log_file.read_text().splitlines() if "Publish Violation" in line)
    assert key in violation and "ei.p0.split.commands" in violation, violation
    for name in ("operator", "launcher", "admin"):
        _public_key(conf, name)
    # a second server on the same folder appends and still finds its own listen line (not the first one's port)
    first = log_file.read_text()
    with EmbeddedNatsServer(auth_block=creds.server_block, log_dir=logs) as again:
        assert again.log_path == log_file.resolve()
        assert log_file.read_text().startswith(first)
        nc = await nats.connect(again.url, **creds.auth_for("router").connect_options(), allow_reconnect=False)
        await nc.close()


async def test_cluster_writes_the_nats_log_into_its_log_dir(tmp_path):
    """``up --log-dir D``: the embedded server logs to ``D/nats.log``, which outlives the cluster."""
    logs = tmp_path / "logs"
    cluster = LocalCluster(ClusterSpec(nodes=1, split="collocated", profile="tiny", port=0, log_dir=str(logs)))
    start = asyncio.create_task(cluster.start())
    deadline = time.monotonic() + 40
    try:
        while cluster.nats is None:
            assert not start.done(), start
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        assert cluster.nats.log_path == (logs / "nats.log").resolve()
    finally:
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
    assert cluster.nats is None
    assert "Server is ready" in (logs / "nats.log").read_text()
    _public_key((logs / "nats.conf").read_text(), "router")


def test_the_log_is_rotated_at_its_limit_and_a_server_still_finds_its_listen_line(tmp_path, monkeypatch):
    """``nats.log`` in the log folder was appended to without bound (every restart and run, every refused login). The
    generated config caps it (``logfile_size_limit``, ``logfile_max_num``); a server whose first write rotates the
    log (a full one left by an earlier run) or whose listen line lands in the backup still reads its port."""
    import shared.natsserver as natsserver

    logs = tmp_path / "logs"
    with EmbeddedNatsServer(log_dir=logs, jetstream=False):
        pass
    conf = (logs / "nats.conf").read_text()
    assert f"logfile_size_limit: {natsserver.LOG_MAX_BYTES}\n" in conf and f"logfile_max_num: {natsserver.LOG_MAX_FILES}\n" in conf
    assert natsserver.LOG_MAX_BYTES == 10 * 1024 * 1024 and natsserver.LOG_MAX_FILES == 5
    monkeypatch.setattr(natsserver, "LOG_MAX_BYTES", 4000)
    monkeypatch.setattr(natsserver, "LOG_MAX_FILES", 3)
    log_file = logs / "nats.log"
    with open(log_file, "a") as f:
        f.write("x" * 5000 + "\n")  # full: the next server's first write rotates it
    ports = []
    for fill in (0, 3000, 3400, 3600, 3800):  # the limit crossed at the start's first lines, or in its middle
        if fill:
            with open(log_file, "a") as f:
                f.write("y" * max(0, fill - log_file.stat().st_size) + "\n")
        with EmbeddedNatsServer(log_dir=logs, jetstream=False, startup_timeout_s=10.0) as srv:
            ports.append(srv.port)
    assert all(ports), ports
    assert len(list(logs.glob("nats.log*"))) <= 3, sorted(p.name for p in logs.glob("nats.log*"))
    assert "Rotated log, backup saved as" in log_file.read_text()
