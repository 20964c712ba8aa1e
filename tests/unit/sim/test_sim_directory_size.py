"""report.json carries the KV directory's size over time (issue 23): blocks indexed, runs,
copies per tier and estimated bytes, one row per sampled minute."""

from __future__ import annotations

from evolving_infra.sim.cluster import DIRECTORY_SAMPLE_S
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import simulate

from .conftest import BS, small_trace


def test_report_has_the_directory_size_over_time():
    reqs = small_trace(4, 6, pause=50.0)  # ~5 simulated minutes: several samples
    res = simulate(SimConfig(nodes=2, profile="tiny", policy="static:1P1D", concurrency=4), reqs, BS)
    rows = res.report["kv_directory_size"]
    assert len(rows) >= 3
    ts = [r["t"] for r in rows]
    assert ts == sorted(set(ts)) and all(t % DIRECTORY_SAMPLE_S == 0 for t in ts)
    last = rows[-1]
    assert last["blocks"] > 0 and last["runs"] >= 1 and last["host_copies"] > 0
    assert last["blocks"] >= last["runs"]  # runs of blocks, not one object per block
    assert all(r["bytes"] > 40 * r["blocks"] for r in rows)
    assert res.report["kv_directory_peak_bytes"] == max(r["bytes"] for r in rows)
    # the last sample equals the directory at that moment: later blocks only grow the prompts
    assert max(r["blocks"] for r in rows) <= 4 * (4 + 5 * 2) + 4
