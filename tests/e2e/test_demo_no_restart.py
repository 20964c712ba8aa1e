"""``demo --no-restart`` whose cluster ends during the replay (a service exits: nothing restarts it) says so as
``up`` does and writes no report. Before, the check after the replay raised its ``ClusterError`` out of ``demo``:
a Python traceback (``cli`` catches only usage errors and a closed stdout), status 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 3), (signal.SIGKILL, 1)])
def test_a_service_that_exits_during_the_replay_ends_the_demo_in_one_line(tmp_path, sig, status):
    """The planner SIGTERMed (it exits 0: no crash, status 3, a calm line on stdout, as ``up --no-restart``) or
    SIGKILLed (a crash: "error: planner was killed by signal 9 (SIGKILL) ..." and its log's tail, status 1) while the demo
    replays: the replay ends (the router serves on), then the cluster stops, no report, one line naming the logs."""
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {"EI_STATE_DIR": str(state_dir)}
    out_dir = tmp_path / "demo"
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--no-restart", "--sessions", "2", "--concurrency", "2",
           "--speedup", "25", "--nodes", "1", "--out", str(out_dir)]  # fmt: skip
    # speed-up 25: the replay takes ~15 wall s (7 s at 50, measured quiet), so the SIGTERMed planner's exit (its drain,
    # ~0.5 s; up to Bus.close's 5-s bound) lands well inside it on a loaded box, where the check after the replay sees it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(state_dir.glob("up-*.json")):  # written once the cluster is ready, before the replay
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.05)
        pids = json.loads(next(state_dir.glob("up-*.json")).read_text())["pids"]
        os.kill(int(pids["planner"]), sig)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, (proc.returncode, out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    logs = out_dir / "logs"
    assert err.splitlines()[-1] == f"demo: no report written (the cluster ended during the replay); logs in {logs}", err
    if status == 3:
        assert f"planner exited cleanly (code 0); log {logs / 'planner.log'}; --no-restart: stopped the cluster" in out
        assert "error:" not in err, err[-3000:]
    else:
        assert sum(line.startswith("error: ") for line in err.splitlines()) == 1, err[-3000:]
        assert f"error: planner was killed by signal 9 (SIGKILL); log {logs / 'planner.log'}:" in err, err[-3000:]
    assert not (out_dir / "report.json").exists() and not list(state_dir.glob("up-*.json"))
