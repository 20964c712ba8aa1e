"""`split` and `tap` find the running `up` cluster through its state file, or fail within
seconds with a clear message (no endless reconnecting to a default port)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e._up import read_ready

pytestmark = pytest.mark.timeout(180)


def _cli(state: Path, *args: str, timeout: float = 60) -> tuple[int, str, float]:
    env = {**{k: v for k, v in os.environ.items() if k != "EI_NATS_URL"}, "EI_STATE_DIR": str(state)}  # a URL there wins
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "evolving_infra.cli", *args], capture_output=True, text=True, env=env, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_split_get_without_a_cluster_fails_within_10_s(tmp_path):
    rc, out, wall = _cli(tmp_path / "state", "split", "get")
    assert rc != 0 and wall < 10, (rc, wall, out)
    assert "no running local cluster" in out and "evolving-infra up" in out and "--nats-url" in out
    # the other cases: bounded too (they used to retry forever); looser bounds for a loaded 2-core VM
    rc, out, wall = _cli(tmp_path / "state", "tap")
    assert rc != 0 and wall < 20 and "no running local cluster" in out
    # an explicit URL where nothing listens: refused at once, not retried
    url = f"nats://127.0.0.1:{_free_port()}"
    for args in (("split", "get", "--nats-url", url), ("split", "set", "2P2D", "--nats-url", url), ("tap", "--nats-url", url)):
        rc, out, wall = _cli(tmp_path / "state", *args)
        assert rc == 2 and wall < 20 and f"cannot connect to NATS at {url}" in out, (args, wall, out)


def test_replay_to_a_router_that_is_not_there_fails_within_seconds(tmp_path):
    """It used to send every request of the trace, each failing to connect (a minute and more), then exit 1."""
    from evolving_infra.launcher import demo_trace_path

    url = f"http://127.0.0.1:{_free_port()}"
    rc, out, wall = _cli(tmp_path / "state", "replay", str(demo_trace_path()), "--router-url", url, "--out", str(tmp_path / "out"))
    assert rc == 2 and wall < 30 and f"no router answers at {url}" in out and "evolving-infra up" in out, (rc, wall, out)
    assert not (tmp_path / "out").exists()


def test_stale_state_file_is_removed_and_said(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = state / f"up-{dead.pid}.json"
    stale.write_text(json.dumps({"pid": dead.pid, "nats_url": "nats://127.0.0.1:1", "router_url": "http://127.0.0.1:1"}))
    (state / "up-garbage.json").write_text("{not json")
    rc, out, wall = _cli(state, "split", "get")
    assert rc != 0 and wall < 20 and "removed a stale cluster state file" in out and "no running local cluster" in out
    assert list(state.iterdir()) == []


def test_up_writes_the_state_file_split_and_tap_use_it_and_it_is_removed(tmp_path):
    state = tmp_path / "state"
    env = {**{k: v for k, v in os.environ.items() if k != "EI_NATS_URL"}, "EI_STATE_DIR": str(state)}  # a URL there wins
    cmd = [
        sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--split", "1P1D", "--profile", "tiny",
        "--block-size", "4", "--port", "0", "--log-dir", str(tmp_path / "logs"),
        "--policy", "static",  # a fixed split: the default (evolving) serves collocated during its warm-up
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        info = read_ready(proc)
        (path,) = state.glob("up-*.json")
        saved = json.loads(path.read_text())
        assert saved["pid"] == proc.pid and saved["nats_url"] == info["nats_url"] and saved["router_url"] == info["router_url"]
        assert saved["partition"] == "p0" and saved["pids"] == info["pids"] and saved["tokenizer"] == "sim"
        assert saved["model"] == "evolving-infra-sim"  # what `replay` sends (the folder's name with --engine torch)
        rc, out, _ = _cli(state, "split", "get", "--json", "--timeout", "30")
        assert rc == 0, out
        (line,) = [x for x in out.splitlines() if x.startswith('{"epoch"')]
        assert json.loads(line)["split"] == "1P1D"
        assert "debug" not in out, out  # the bus client's "nats connection closed" was printed
        rc, out, _ = _cli(state, "tap", "--max", "1", "node.state.*")
        assert rc == 0 and "NodeState" in out and "debug" not in out, out
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert not path.exists()  # removed on a clean exit


def test_up_on_a_busy_port_says_so_in_one_line(tmp_path):
    """It used to start NATS and every service, then print the router's traceback ending in EADDRINUSE."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rc, out, wall = _cli(tmp_path / "state", "up", "--port", str(port), "--log-dir", str(tmp_path / "logs"))
    assert rc == 1 and wall < 30, (rc, wall, out)
    assert f"error: the router cannot listen on 127.0.0.1:{port}: Address already in use" in out and "--port" in out, out
    assert "Traceback" not in out and not (tmp_path / "logs").exists(), out
