"""`up`'s READY JSON gives the warm-up end the planner announced (review 55 M1).

At ``--speedup 50`` READY said ``"warmup_end_s": 1860.0`` (an estimate for a first tick 0.2 s after the start)
while the planner, whose first tick comes when its start-up adoption ends (seconds of wall time after the start,
each 50 simulated s), announced ``until t=1980s``, which ``split get`` says. At ``--speedup 100`` any first tick
later than 0.6 wall s moves the end past 1860.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time


def test_ready_gives_the_warmup_end_split_get_says(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "EI_NATS_URL"}, "EI_STATE_DIR": str(tmp_path / "state")}
    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--split", "1P1D", "--profile", "tiny",
           "--block-size", "4", "--speedup", "100", "--port", "0", "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        info, lines = None, []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("READY "):
                info = json.loads(line[len("READY "):])
                break
        assert info is not None, "".join(lines)
        got = subprocess.run([sys.executable, "-m", "evolving_infra.cli", "split", "get", "--json", "--timeout", "30"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert got.returncode == 0, got.stderr
        reason = json.loads(got.stdout)["reason"]
        said = re.search(r"until t=(\d+)s", reason)
        assert said is not None, reason
        assert info["warmup_end_s"] == float(said.group(1)), (info, reason)
        assert info["warmup_end_source"] == "planner"
        assert abs(info["warmup_end_wall_s"] - info["warmup_end_s"] / 100) < 1e-9
        assert abs(info["cluster_start_unix"] - time.time()) < 120  # the wall figure counts from it
        ready_line = next(ln for ln in lines if ln.startswith("cluster ready:"))
        assert f"until t={said.group(1)} s" in ready_line and "as the planner announced" in ready_line, ready_line
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
