"""`evolving-infra up` serves on while its control plane crash-loops: the planner and the KV directory, each killed
(SIGKILL) past ``--max-restarts`` within ``--restart-window-s``, are left down (one line saying what no longer adapts,
``left_down`` in ``LOG_DIR/cluster.json`` and the state file) and every request is still answered: the routers route
by the phases the workers report, and without cache information once ``kv.lookup`` has no responder. The router's
``GET /v1/cluster`` says how long ago the planner's split last came (``split_heard_s``), ``split get`` that ``up`` left
the planner down. A worker restarted while the
planner is down comes back in the phase its node last applied (``both`` in the evolving planner's warm-up, which
is also its launch ``--phase`` since session 59). Before (session 58), the planner's second exit stopped the whole cluster: status 1, every
healthy worker's requests with it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e._up import read_ready
from tests.e2e._up import stop as _stop

pytestmark = pytest.mark.timeout(240)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _completion(url: str) -> int:
    r = httpx.post(url + "/v1/completions", json={"model": "evolving-infra-sim", "prompt": "hello " * 30, "max_tokens": 4},
                   timeout=30)  # fmt: skip
    return r.status_code


def _wait(what: str, cond, within_s: float, proc: subprocess.Popen[str], lines: list[str]) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert proc.poll() is None, f"up exited ({proc.returncode}) waiting for {what}:\n{''.join(lines)[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {within_s:g} s:\n{''.join(lines)[-3000:]}"
        time.sleep(0.1)


def test_a_crash_looping_planner_and_kv_directory_are_left_down_and_requests_are_answered(tmp_path):
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--split", "1P1D", "--profile", "tiny",
           "--port", "0", "--speedup", "20", "--log-dir", str(logs), "--max-restarts", "1", "--restart-window-s", "300"]  # fmt: skip
    env = {**os.environ, "EI_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader: threading.Thread | None = None
    try:
        try:
            ready = read_ready(proc, lines)
        except AssertionError as e:
            pytest.fail(f"up never READY: {e}")
        out = proc.stdout
        assert out is not None
        reader = threading.Thread(target=lambda: [lines.append(ANSI.sub("", x)) for x in out], daemon=True)
        reader.start()
        url = str(ready["router_url"])
        assert _completion(url) == 200

        def cluster() -> dict:
            return json.loads((logs / "cluster.json").read_text()) if (logs / "cluster.json").exists() else {}

        def crash_loop(name: str) -> None:
            """SIGKILL ``name`` twice (``--max-restarts 1``): its second exit is past the limit."""
            first = int(cluster().get("pids", ready["pids"])[name])
            os.kill(first, signal.SIGKILL)
            _wait(f"{name} restarted", lambda: cluster().get("pids", {}).get(name) not in (None, first), 30, proc, lines)
            os.kill(int(cluster()["pids"][name]), signal.SIGKILL)
            _wait(f"{name} left down", lambda: name in cluster().get("left_down", []), 30, proc, lines)

        crash_loop("planner")
        assert "planner" not in cluster()["pids"]
        state = json.loads(next((tmp_path / "state").glob("up-*.json")).read_text())
        assert state["left_down"] == ["planner"]
        text = "".join(lines)
        assert re.search(r"left planner down after a crash loop \(over --max-restarts 1 exits within --restart-window-s 300\); "
                         r"the split is frozen at collocated .*trying it again in 300 s", text), text[-3000:]  # fmt: skip
        assert [_completion(url) for _ in range(5)] == [200] * 5
        # `split get` says why no planner answers (before: "try again once it is up")
        got = subprocess.run([sys.executable, "-m", "evolving_infra.cli", "split", "get", "--timeout", "2"], env=env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert got.returncode == 1 and "`up` left the planner down after a crash loop" in got.stderr, got.stderr
        # the planner repeats its split every 5 s: the router says it has not heard it since
        _wait("split_heard_s past 6 s", lambda: (httpx.get(url + "/v1/cluster", timeout=5).json()["split_heard_s"] or 0) > 6.0,
              30, proc, lines)  # fmt: skip

        # a worker restarted meanwhile serves its node's last phase (both, the warm-up's; since session 59 its launch
        # --phase too: test_supervise_control_plane has a launch phase that differs)
        w1 = int(cluster()["pids"]["worker-w1"])
        os.kill(w1, signal.SIGKILL)
        _wait("worker-w1 restarted", lambda: cluster().get("pids", {}).get("worker-w1") not in (None, w1), 30, proc, lines)

        def started_phases() -> list[str]:
            return [json.loads(x)["phase"] for x in (logs / "worker-w1.log").read_text().splitlines()
                    if '"worker started"' in x]  # fmt: skip

        _wait("worker-w1's second start", lambda: len(started_phases()) == 2, 30, proc, lines)
        assert started_phases() == ["both", "both"]

        def w1_back() -> bool:
            nodes = {n["node"]: n for n in httpx.get(url + "/v1/cluster", timeout=5).json()["nodes"]}
            return not nodes["w1"]["fenced"]

        _wait("w1 let back in", w1_back, 30, proc, lines)
        assert [_completion(url) for _ in range(5)] == [200] * 5

        crash_loop("kvdirectory")
        assert sorted(cluster()["left_down"]) == ["kvdirectory", "planner"]
        assert "left kvdirectory down after a crash loop" in "".join(lines)
        t0 = time.monotonic()
        assert [_completion(url) for _ in range(5)] == [200] * 5
        assert time.monotonic() - t0 < 20.0
        metrics = httpx.get(url + "/metrics", timeout=5).text
        failed = [float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines()
                  if x.startswith('ei_bus_requests_failed_total{subject="kv.lookup"}')]  # fmt: skip
        assert failed and failed[0] >= 5, failed  # each lookup failed (no responders) and the request was routed anyway
        assert proc.poll() is None
    finally:
        _stop(proc)
    if reader is not None:
        reader.join(10.0)  # up has exited: its stdout ends
    assert proc.returncode == 0
    assert "stopping with kvdirectory, planner left down after a crash loop" in "".join(lines), "".join(lines)[-3000:]
