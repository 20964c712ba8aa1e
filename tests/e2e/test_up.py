"""`evolving-infra up` as a user runs it: ready line, healthy router, Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.e2e._up import read_ready

BS = 4


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_up_stops_cleanly_without_orphans(tmp_path):
    cmd = [
        sys.executable, "-m", "evolving_infra.cli", "up",
        "--nodes", "2", "--split", "1P1D", "--profile", "tiny", "--block-size", str(BS),
        "--port", "0", "--log-dir", str(tmp_path / "logs"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    info = read_ready(proc, timeout_s=90)
    # the default (evolving) planner serves collocated for its warm-up: "split" alone named the split after it
    assert (info["split"], info["serving"], info["split_after_warmup"]) == ("1P1D", "collocated", "1P1D")
    pids = info["pids"]
    assert {"kvdirectory", "planner", "router", "worker-w0", "worker-w1", "nats-server"} <= set(pids)
    assert all(_alive(p) for p in pids.values())
    r = httpx.get(info["router_url"] + "/healthz", timeout=5)
    assert r.status_code == 200
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
        time.sleep(0.1)
    assert not [n for n, p in pids.items() if _alive(p)]
