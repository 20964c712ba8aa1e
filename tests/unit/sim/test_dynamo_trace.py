"""``bench/sim_speed.py``'s conversion of our trace to Dynamo's ``agentic_mooncake`` v2 format
(the input of the side-by-side with Dynamo's offline replay, issue 23), and, when a Dynamo venv
is given (``$EI_DYNAMO_PYTHON``), Dynamo's replay accepting it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from evolving_infra.traces.io import write_trace
from evolving_infra.traces.schema import TraceHeader, TraceRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import sim_speed  # noqa: E402

BS = 4


def _trace(path: Path) -> Path:
    """Agent a: main r0 → r1 (pause 50 s), a sub-agent s0 after r0, r2 joins r1 and s0; agent b: one request."""
    reqs = [
        TraceRequest(id="a:0", agent="a", branch="a:main", kind="main", input_tokens=10, output_tokens=3, blocks=[11, 12],
                     pause_s=2.0),
        TraceRequest(id="a:1", agent="a", branch="a:main", input_tokens=13, output_tokens=0, blocks=[11, 12, 13],
                     after=["a:0"], pause_s=50.0),
        TraceRequest(id="a:s0", agent="a", branch="a:sub", kind="subagent", parent_branch="a:main", input_tokens=8,
                     output_tokens=2, blocks=[21, 22], after=["a:0"], pause_s=1.0, ends_branch=True),
        TraceRequest(id="a:2", agent="a", branch="a:main", input_tokens=16, output_tokens=1, blocks=[11, 12, 13, 14],
                     after=["a:1", "a:s0"], ends_branch=True),
        TraceRequest(id="b:0", agent="b", branch="b:main", kind="main", input_tokens=9, output_tokens=5, blocks=[11, 12],
                     ends_branch=True),
    ]
    write_trace(path, TraceHeader(format="evolving-infra-trace", block_size=BS), reqs)
    return path


def _rows(path: Path) -> tuple[dict, dict[str, dict]]:
    header, *rows = (json.loads(x) for x in path.read_text().splitlines())
    return header, {r["request_id"]: r for r in rows}


def test_agents_become_plays_branches_sessions_and_after_completion_dependencies(tmp_path):
    out = tmp_path / "t.agentic.jsonl"
    assert sim_speed.dynamo_trace(_trace(tmp_path / "t.jsonl"), out, BS, max_pause_s=30.0) == {"requests": 5, "agents": 2}
    header, rows = _rows(out)
    assert header["schema"] == "dynamo.agentic_mooncake" and header["version"] == 2
    assert header["block_size"] == BS and header["hash_id_scope"] == "local" and header["source"]["format"]
    a0, a1, s0, a2, b0 = (rows[i] for i in ("a:0", "a:1", "a:s0", "a:2", "b:0"))
    assert {r["play_id"] for r in (a0, a1, s0, a2)} == {"a"} and b0["play_id"] == "b"
    assert (a0["source_play_ordinal"], b0["source_play_ordinal"]) == (0, 1), "plays start in the trace's agent order"
    assert a0["session_id"] == a1["session_id"] == a2["session_id"] == "a:main" and s0["session_id"] == "a:sub"
    # full blocks keep their (chained, shared) ids; a partial last block gets a fresh private id
    assert a0["hash_ids"][:2] == [11, 12] and len(a0["hash_ids"]) == 3 and a0["hash_ids"][2] not in (11, 12)
    assert a2["hash_ids"] == [11, 12, 13, 14], "16 tokens = 4 full blocks: no tail id"
    assert b0["hash_ids"][:2] == [11, 12], "one id namespace for the file: b shares a's prefix blocks"
    tails = [r["hash_ids"][-1] for r in (a0, a1, s0, b0) if r["input_length"] % BS]
    assert len(set(tails)) == len(tails) == 3, "tail ids are private to each request"
    assert a1["output_length"] == 1, "a recorded 0 asks for 1 token, as the simulator does"
    # roots wait their pause from the play's start; the others depend on completions
    assert (a0["not_before_ms"], a0["dependencies"]) == (2000.0, [])
    assert a1["not_before_ms"] == 0.0
    assert a1["dependencies"] == [{"request_id": "a:0", "trigger": "completion", "delay_ms": 30000.0, "relation": "sequence"}]
    assert s0["dependencies"] == [{"request_id": "a:0", "trigger": "completion", "delay_ms": 1000.0, "relation": "spawn"}]
    assert [(d["request_id"], d["relation"]) for d in a2["dependencies"]] == [("a:1", "sequence"), ("a:s0", "join")]


def test_coarser_blocks_convert_as_the_simulator_does(tmp_path):
    out = tmp_path / "t8.agentic.jsonl"
    sim_speed.dynamo_trace(_trace(tmp_path / "t.jsonl"), out, 2 * BS)
    _, rows = _rows(out)
    assert rows["a:2"]["hash_ids"] == [12, 14], "coarse block j takes its last fine block's id (chained)"
    assert rows["a:1"]["hash_ids"][0] == 12 and len(rows["a:1"]["hash_ids"]) == 2, "13 tokens: 1 full + a tail"


def test_dynamo_replays_the_converted_trace(tmp_path):
    dyn, why = sim_speed.DynamoReplay.find(os.environ.get("EI_DYNAMO_PYTHON"))
    if dyn is None:
        pytest.skip(why)
    trace = tmp_path / "t.agentic.jsonl"
    sim_speed.dynamo_trace(_trace(tmp_path / "t.jsonl"), trace, BS)
    job = {"trace": str(trace), "block_size": BS, "prefill": 1, "decode": 1, "lanes": 2, "duration_s": 600.0,
           "engine": {"num_gpu_blocks": 1000, "max_num_batched_tokens": 64, "max_num_seqs": 8}}
    out = dyn.run(job, tmp_path)
    assert out["completed_requests"] == 5 and out["total_output_tokens"] == 3 + 1 + 2 + 1 + 5
    assert out["completed_trajectories"] == out["total_trajectories"] == 2


def test_our_input_converted_ahead_to_the_block_size_simulates_the_same(tmp_path):
    """The side-by-side gives our simulator its input at the block size ahead of the timed runs
    (``sim_speed.at_block_size``), as Dynamo reads its converted file: simulating that file must be
    the very run ``simulate --block-size`` makes from the 64-token trace (report and requests equal
    apart from wall-clock keys), and no request may keep a 64-token id list."""
    import subprocess

    import sim_ab

    from evolving_infra.traces.io import iter_requests

    src = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    header, _ = iter_requests(src)
    assert header.block_size == 64
    coarse = sim_speed.at_block_size(src, tmp_path / "at512.jsonl.gz", 512)
    h2, reqs = iter_requests(coarse)
    assert h2.block_size == 512
    assert all(len(r.blocks) <= -(-r.input_tokens // 512) for r in reqs)
    outs = []
    for trace in (src, coarse):
        out = tmp_path / f"out-{trace.stem}"
        subprocess.run([sys.executable, "-m", "evolving_infra.cli", "simulate", "--trace", str(trace), "--block-size", "512",
                        "--nodes", "4", "--concurrency", "6", "--max-pause", "30", "--duration", "240", "--policy", "evolving",
                        "--out", str(out), "--no-plots"], check=True, capture_output=True,
                       cwd=Path(__file__).resolve().parents[3])
        outs.append(out)
    rep = [json.loads((o / "report.json").read_text()) for o in outs]
    assert (rep[0]["meta"]["trace_block_size"], rep[1]["meta"]["trace_block_size"]) == (64, 512)
    for k in ("trace", "trace_block_size"):  # what the input was, not what ran
        rep[1]["meta"][k] = rep[0]["meta"][k]
    (outs[1] / "report.json").write_text(json.dumps(rep[1]))
    assert sim_ab.differences(*outs) == []
    assert json.loads((outs[0] / "report.json").read_text())["requests_completed"] > 0


def test_our_input_packed_ahead_is_cached_and_packed_again_when_the_source_changes(tmp_path):
    """``sim_speed.packed`` (``--ours-packed``): the pack reads back as the trace's compact form, is
    reused while it is newer than its source, and rebuilt when the source changes."""
    import os

    from evolving_infra.traces.compact import read_trace_compact

    src = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    copy = tmp_path / "t.jsonl.gz"
    copy.write_bytes(src.read_bytes())
    dst = sim_speed.packed(copy, tmp_path / "t.eipack")
    want = read_trace_compact(copy)
    got = read_trace_compact(dst)
    assert (got.header, got.requests, got.index) == (want.header, want.requests, want.index)
    assert got.requests_with_blocks() == want.requests_with_blocks()
    dst.write_bytes(b"stale")  # newer than its source: reused as it is
    assert sim_speed.packed(copy, dst).read_bytes() == b"stale"
    os.utime(copy, (dst.stat().st_mtime + 10, dst.stat().st_mtime + 10))
    assert read_trace_compact(sim_speed.packed(copy, dst)).requests == want.requests
