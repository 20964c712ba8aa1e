"""`evolving-infra up`'s liveness watch on real processes: a service or nats-server that hangs without exiting
(SIGSTOP) is SIGKILLed once silent for ``--liveness-timeout-s`` and restarted as after a crash, with one warning line
naming it, its pid and its silence. Before, nothing watched them: a SIGSTOPped router made a client wait its whole
hang, and ``up`` printed nothing (an SRE newcomer walk's drills, session 51)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e._up import read_ready
from tests.e2e._up import stop as _stop

pytestmark = pytest.mark.timeout(240)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _up(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], dict[str, object], list[str]]:
    """``up`` on a free port with ``extra`` flags, once READY: the process, the READY line's JSON, and the list its
    output lines keep being appended to (a thread reads them)."""

    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--split", "1P1D", "--profile", "tiny",
           "--port", "0", "--policy", "static", "--speedup", "50", "--log-dir", str(tmp_path / "logs"), *extra]  # fmt: skip
    env = {**os.environ, "EI_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        ready = read_ready(proc, lines)
    except AssertionError as e:
        _stop(proc)
        pytest.fail(f"up never READY: {e}")
    lines[:] = [ANSI.sub("", x) for x in lines]
    out = proc.stdout
    assert out is not None
    threading.Thread(target=lambda: [lines.append(ANSI.sub("", x)) for x in out], daemon=True).start()
    return proc, ready, lines


def _gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (``up`` reaps its children: a killed one disappears)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_gone(pid: int, within_s: float) -> float:
    t0 = time.monotonic()
    while not _gone(pid):
        assert time.monotonic() - t0 < within_s, f"pid {pid} still there {within_s:g} s after its SIGSTOP"
        time.sleep(0.1)
    return time.monotonic() - t0


def _completion(url: str, timeout_s: float) -> httpx.Response:
    """One completion, retried on a refused/reset connection or a 503 until ``timeout_s`` (a restart's gap)."""
    model = "evolving-infra-sim"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4}, timeout=30)
            if r.status_code != 503 or time.monotonic() > deadline:
                return r
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def test_a_stopped_router_is_killed_and_restarted(tmp_path):
    proc, ready, lines = _up(tmp_path, "--liveness-timeout-s", "10")  # the least up accepts (LIVENESS_MIN_S)
    try:
        url = str(ready["router_url"])
        pid = int(ready["pids"]["router"])  # type: ignore[index]
        assert _completion(url, 30).status_code == 200
        os.kill(pid, signal.SIGSTOP)
        # 10 s of silence since its last beat (<= 1 s before the stop), a 0.2-s pass, 1-s probes: well within 25 s
        took = _wait_gone(pid, 25.0)
        r = _completion(url, 60.0)  # waits in the accept queue up holds until the next router serves it
        assert r.status_code == 200, r.text
        text = "".join(lines)
        assert re.search(rf"router silent for \d+ s \(no heartbeat\); killing it to restart.*pid={pid}", text), text[-3000:]
        assert "service restarted" in text and proc.poll() is None
        assert 8.0 < took < 25.0
    finally:
        _stop(proc)


def test_a_stopped_nats_server_is_killed_and_restarted_and_no_service_is_blamed(tmp_path):
    """While nats-server is stopped no heartbeat comes, but the launcher's own PING gets no answer either: the
    services are not judged silent, only nats-server is killed; then everything reconnects and serves."""
    proc, ready, lines = _up(tmp_path, "--liveness-timeout-s", "10")
    try:
        url = str(ready["router_url"])
        pid = int(ready["pids"]["nats-server"])  # type: ignore[index]
        assert _completion(url, 30).status_code == 200
        os.kill(pid, signal.SIGSTOP)
        _wait_gone(pid, 35.0)  # judged up to its latest probe that came to an end: 10 s and a probe round or two
        time.sleep(12.0)  # the services reconnect and beat again; past their own 10 s, none may have been killed
        r = _completion(url, 60.0)
        assert r.status_code == 200, r.text
        text = "".join(lines)
        assert re.search(rf"nats-server silent for \d+ s \(no INFO on its port\); killing it to restart.*pid={pid}", text), text[-3000:]
        assert "nats-server restarted" in text
        assert not re.search(r"(router|planner|kvdirectory|worker-w\d) silent for", text), text[-3000:]
        assert proc.poll() is None
    finally:
        _stop(proc)
