"""The README's `replay` run twice against one running `up` cluster (NATS + every service as its
own process): the first run ends its branches and the router refuses an ended branch id (a 409
then, a 400 now: 'X-Branch-Id ... names a branch that was ended; start a new branch id'), which failed every request of the second run.
Each run now sends its own ids ('<run id>:' before the trace's); `--branch-prefix ''` sends
the trace's ids, once per cluster (~30 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_replay_interrupt import REPO, start_small_cluster


def _replay(router_url: str, out: Path, *extra: str) -> tuple[int, dict, str]:
    from evolving_infra.launcher import demo_trace_path

    cmd = [sys.executable, "-m", "evolving_infra.cli", "replay", str(demo_trace_path()), "--router-url", router_url,
           "--speedup", "50", "--sessions", "1", "--max-requests-per-branch", "2", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads((out / "report.json").read_text()), proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_the_same_trace_replayed_twice_against_one_cluster(tmp_path):
    faults, run = start_small_cluster(tmp_path)
    try:
        rc1, first, text1 = _replay(run.router_url, tmp_path / "a")
        rc2, second, text2 = _replay(run.router_url, tmp_path / "b")
        assert rc1 == 0 and first["requests_failed"] == 0, text1
        assert rc2 == 0 and second["requests_failed"] == 0, text2
        assert second["requests_completed"] == first["requests_completed"] > 0
        assert first["meta"]["branch_prefix"] != second["meta"]["branch_prefix"]
        # the trace's own ids: the first such run is served, the second refused (its branches were ended)
        rc3, exact, text3 = _replay(run.router_url, tmp_path / "c", "--branch-prefix", "")
        rc4, again, _ = _replay(run.router_url, tmp_path / "d", "--branch-prefix", "")
        assert rc3 == 0 and exact["requests_failed"] == 0, text3
        assert rc4 == 1 and again["requests_failed"] == again["requests_sent"] > 0
        rows = [json.loads(line) for line in (tmp_path / "d" / "requests.jsonl").read_text().splitlines()]
        assert all(r["status"] == 400 and "was ended" in r["error"] for r in rows)
    finally:
        faults.stop_up(run)
