"""The simulator on a compact trace (``traces.compact``, what ``simulate --trace`` reads) gives the
same report as on the full list of requests."""

from __future__ import annotations

import msgspec

from evolving_infra.cli import main
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import simulate
from evolving_infra.traces.compact import compact_requests
from evolving_infra.traces.io import write_trace
from evolving_infra.traces.schema import FORMAT, TraceHeader

from .conftest import BS, small_trace, strip_wall


def _trace():
    """Agents sharing a system prompt (ids 7, 8), with pauses to cap and a sub-agent fork."""
    reqs = [msgspec.structs.replace(r, blocks=[7, 8] + r.blocks, input_tokens=r.input_tokens + 2 * BS,
                                    pause_s=r.pause_s + (40.0 if r.id.endswith("r2") else 0.5))
            for r in small_trace(5, 6)]
    fork = msgspec.structs.replace(reqs[2], id="a0-f0", branch="a0-sub", kind="subagent", parent_branch="a0-main",
                                   after=["a0-r1"], ends_branch=True, blocks=reqs[2].blocks + [99], input_tokens=reqs[2].input_tokens + BS)
    return reqs[:3] + [fork] + reqs[3:]


def test_simulate_compact_equals_list() -> None:
    reqs = _trace()
    for cfg, trace_bs in (
        (SimConfig(nodes=3, profile="tiny", policy="evolving", concurrency=3, max_pause_s=30), BS),
        (SimConfig(nodes=3, profile="tiny", policy="static:1P2D", concurrency=4, tile=2, eviction="branch-count"), BS),
        (SimConfig(nodes=4, profile="tiny", policy="dynamo", concurrency=5, partitions=2), BS),
    ):
        want = simulate(cfg, reqs, trace_bs)
        got = simulate(cfg, compact_requests(TraceHeader(format=FORMAT, block_size=trace_bs), reqs), trace_bs)
        assert strip_wall(got.report) == strip_wall(want.report), cfg
        assert got.records == want.records
        assert want.report["requests_completed"] > 0


def test_simulate_compact_at_another_block_size() -> None:
    """A trace at 2-token blocks simulated at the profile's 4: converted the same way."""
    fine = [msgspec.structs.replace(r, blocks=[x for b in r.blocks for x in (2 * b, 2 * b + 1)]) for r in _trace()]
    cfg = SimConfig(nodes=3, profile="tiny", policy="static:1P2D", concurrency=4)
    want = simulate(cfg, fine, 2)
    got = simulate(cfg, compact_requests(TraceHeader(format=FORMAT, block_size=2), fine), 2)
    assert strip_wall(got.report) == strip_wall(want.report)
    assert got.report["meta"]["block_size"] == BS and want.report["kv_hit_rate"] > 0


def test_cli_reads_the_trace_compactly(tmp_path) -> None:
    import json

    reqs = _trace()
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, TraceHeader(format=FORMAT, block_size=BS, source="test"), reqs)
    rc = main(["simulate", "--trace", str(path), "--out", str(tmp_path / "cli"), "--profile", "tiny", "--nodes", "3",
               "--policy", "static:1P2D", "--concurrency", "4", "--max-pause", "30", "--no-plots"])
    assert rc == 0
    got = json.loads((tmp_path / "cli" / "report.json").read_text())
    want = simulate(SimConfig(nodes=3, profile="tiny", policy="static:1P2D", concurrency=4, max_pause_s=30), reqs, BS).report
    keys = ("requests_completed", "ttft_mean_s", "e2e_mean_s", "kv_hit_rate", "throughput_rps", "kv_directory_size")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
