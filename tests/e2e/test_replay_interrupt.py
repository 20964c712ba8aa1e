"""``evolving-infra replay`` stopped by SIGINT / SIGTERM keeps what it measured (issue 22, part 8):
requests appended to the run's own ``requests.partial-<run_id>.jsonl`` as they complete, report.json and
requests.jsonl written on interruption, an earlier run's outputs moved aside then, never read as this run's.

A real cluster (``evolving-infra up``: NATS + every service as its own process) serves the
shipped Claude Code sample; the replay runs as its own process, as a user runs it (~40 s).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import bench_faults

REPO = Path(__file__).resolve().parents[2]


def _partial_lines(out: Path) -> int:
    """Records appended so far to the running replay's ``OUT/requests.partial-<run_id>.jsonl`` (0 when none)."""
    found = list(out.glob("requests.partial-*.jsonl"))
    return len(found[0].read_text().splitlines()) if len(found) == 1 else 0


def _replay_until(router_url: str, out: Path, sig: int, after_records: int) -> tuple[int, str]:
    """Run a replay, send ``sig`` once it has appended ``after_records`` to its own records file."""
    from evolving_infra.launcher import demo_trace_path

    cmd = [sys.executable, "-m", "evolving_infra.cli", "replay", str(demo_trace_path()), "--router-url", router_url,
           "--speedup", "50", "--concurrency", "6", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if _partial_lines(out) >= after_records:
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the replay appended no records")
    proc.send_signal(sig)
    text, _ = proc.communicate(timeout=60)
    return proc.returncode, text


def start_small_cluster(tmp_path: Path):
    """``evolving-infra up`` at speedup 50, 2 nodes 1P1D, logs under ``tmp_path/logs``; returns
    ``(bench/faults.py module, its FaultRun)`` (stop it with ``faults.stop_up(run)``)."""
    faults = bench_faults()
    logs = tmp_path / "logs"
    logs.mkdir()
    return faults, faults.start_up(logs, speedup=50.0, nodes=2, split="1P1D")


@pytest.mark.timeout(400)
def test_sigint_and_sigterm_write_partial_results_and_set_aside_the_previous_run(tmp_path):
    faults, run = start_small_cluster(tmp_path)
    out = tmp_path / "out"
    try:
        rc, text = _replay_until(run.router_url, out, signal.SIGINT, after_records=3)
        assert rc == 130, text
        first = json.loads((out / "report.json").read_text())
        lines = (out / "requests.jsonl").read_text().splitlines()
        assert first["meta"]["interrupted"]["signal"] == "SIGINT"
        assert first["requests_sent"] == len(lines) >= 3
        assert "interrupted by SIGINT" in " ".join(first["meta"]["notes"])
        # throughput over the replay's own window (wall x speedup 50), not the span of the answered requests
        assert first["duration_s"] == pytest.approx(50 * first["meta"]["wall_s"], rel=0.05)
        assert first["throughput_rps"] == pytest.approx(first["requests_completed"] / first["duration_s"])

        assert not list(out.glob("requests.partial-*"))  # the same records are in requests.jsonl now
        rc, text = _replay_until(run.router_url, out, signal.SIGTERM, after_records=2)
        assert rc == 143, text
        assert "moved to" in text and "previous" in text  # once the replay has ended, before its report
        second = json.loads((out / "report.json").read_text())
        assert second["meta"]["interrupted"]["signal"] == "SIGTERM"
        assert second["meta"]["run_id"] != first["meta"]["run_id"]
        assert second["requests_sent"] == len((out / "requests.jsonl").read_text().splitlines())
        # the first run's files are kept aside, not mixed into this run's
        kept = json.loads((out / "previous" / "report.json").read_text())
        assert kept["meta"]["run_id"] == first["meta"]["run_id"]
        assert len((out / "previous" / "requests.jsonl").read_text().splitlines()) == len(lines)
        assert not list(out.glob("*.tmp"))
    finally:
        faults.stop_up(run)
