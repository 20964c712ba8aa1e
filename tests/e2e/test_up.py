"""`evolving-infra up` as a user runs it: ready line, healthy router, Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
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


def _logged(path, event: str) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if f'"{event}"' in x]


def _up(tmp_path, *flags: str):
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--profile", "tiny", "--block-size", str(BS),
           "--port", "0", "--speedup", "20", "--log-dir", str(logs), *flags]  # fmt: skip
    env = {**os.environ, "EI_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc, logs, env


def test_the_evolving_planner_s_cluster_starts_collocated_and_a_static_one_in_its_split(tmp_path):
    """Session 59: `up` launched the workers in --split's phases and the evolving planner's first tick switched every
    node to both for its warm-up: the demo's split timeline began [0, "2P2D"], and half its "node phase switches" were
    that flip. Now the workers start as the warm-up serves them (both), the planner's first split is collocated at
    epoch 1 and nothing switches before the warm-up's end, while READY still names the split served after it. A
    static split (no warm-up) starts in that split at once, as before."""
    proc, logs, env = _up(tmp_path / "evolving", "--split", "1P1D")
    try:
        info = read_ready(proc, timeout_s=90)
        assert (info["split"], info["serving"], info["split_after_warmup"]) == ("1P1D", "collocated", "1P1D")
        assert [e["phase"] for n in ("w0", "w1") for e in _logged(logs / f"worker-{n}.log", "worker started")] == ["both", "both"]
        got = subprocess.run([sys.executable, "-m", "evolving_infra.cli", "split", "get", "--json", "--timeout", "10"],
                             capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
        assert got.returncode == 0, got.stdout + got.stderr
        now = json.loads(got.stdout)
        assert (now["split"], now["epoch"]) == ("collocated", 1) and now["reason"].startswith("warm-up: every node"), now
        announced = _logged(logs / "planner.log", "split announced")
        assert announced and all((e["split"], e["epoch"]) == ("collocated", 1) for e in announced), announced
        assert info["warmup_end_s"] > 1800  # the 1800-s warm-up, 90 s wall at --speedup 20: nothing switched so far
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    proc, logs, _ = _up(tmp_path / "static", "--policy", "static:1P1D")
    try:
        info = read_ready(proc, timeout_s=90)
        assert (info["split"], info["serving"]) == ("1P1D", "1P1D") and "split_after_warmup" not in info
        assert [e["phase"] for n in ("w0", "w1") for e in _logged(logs / f"worker-{n}.log", "worker started")] == ["prefill", "decode"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
