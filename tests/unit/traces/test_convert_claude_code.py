"""claude-code-weka converter on real sessions from ../shared/traces/claude-code-weka.

Totals are computed independently from the raw JSON (stdlib json) and compared
with ``trace stats`` of the converted trace.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from evolving_infra.traces.convert import convert_inputs, convert_to_file
from evolving_infra.traces.convert.claude_code import FILE_ID_STRIDE, SHARED_NS_STRIDE, split_stream
from evolving_infra.traces.io import iter_validate, validate_requests
from evolving_infra.traces.stats import trace_stats, trace_stats_file
from tests.conftest import shared_traces_or_skip

# sub-agents (0003: sequential, 0010 and 0254: parallel fan-out), compactions (0003), a changed system prompt (0011)
FILES = ("trace_0001", "trace_0003", "trace_0010", "trace_0011", "trace_0254")


def _files(names=FILES) -> list[Path]:
    folder = shared_traces_or_skip("claude-code-weka")
    return [folder / f"{n}.json.gz" for n in names]


def raw_totals(paths: list[Path]) -> dict[str, int]:
    """Independent totals straight from the raw session files."""
    t = {"requests": 0, "subagents": 0, "input": 0, "output_raw": 0, "zero_outputs": 0}

    def req(e: dict) -> None:
        t["requests"] += 1
        t["input"] += e["in"]
        t["output_raw"] += e["out"]
        t["zero_outputs"] += e["out"] < 1

    for p in paths:
        d = json.loads(gzip.decompress(p.read_bytes()))
        for e in d["requests"]:
            if e["type"] == "subagent":
                t["subagents"] += 1
                for q in e["requests"]:
                    req(q)
            else:
                req(e)
    return t


def test_totals_match_raw_files() -> None:
    paths = _files()
    trace = convert_inputs("claude-code-weka", paths)
    assert validate_requests(trace.header, trace.requests) == []
    s = trace_stats(trace)
    raw = raw_totals(paths)
    assert s["sessions"] == len(paths)
    assert s["requests"] == raw["requests"]
    assert s["subagent_branches"] == raw["subagents"] > 0
    assert s["input_tokens_total"] == raw["input"]
    assert s["output_tokens_total"] == raw["output_raw"]
    assert raw["zero_outputs"] == trace.header.meta["counts"].get("output_tokens_zero", 0)


def test_subagent_timing_and_join_rule() -> None:
    paths = _files(("trace_0003", "trace_0010", "trace_0254"))
    trace = convert_inputs("claude-code-weka", paths)
    by_id = {r.id: r for r in trace.requests}
    pos = {r.id: i for i, r in enumerate(trace.requests)}
    for p in paths:
        d = json.loads(gzip.decompress(p.read_bytes()))
        agent = d["id"]
        main = [e for e in d["requests"] if e["type"] != "subagent"]
        main_i = 0
        pending_joins: list[str] = []
        for e in d["requests"]:
            if e["type"] != "subagent":
                rid = f"{agent}:{main_i}"
                for last in pending_joins:  # the first parent request after the marker joins
                    assert last in by_id[rid].after, (rid, last)
                pending_joins = []
                main_i += 1
                continue
            start = e["t"] - e["duration_ms"] / 1000.0
            first = by_id[f"{agent}:{e['agent_id']}:0"]
            assert first.kind == "subagent" and first.parent_branch == f"{agent}:main"
            assert first.t_s == pytest.approx(start + e["requests"][0]["t"], abs=1e-3)
            sent_before = [i for i in range(main_i) if main[i]["t"] <= start + 1.0]
            assert first.after == [f"{agent}:{sent_before[-1]}"]
            last = f"{agent}:{e['agent_id']}:{len(e['requests']) - 1}"
            assert by_id[last].ends_branch
            pending_joins.append(last)
            for j, q in enumerate(e["requests"]):  # nested t counts from the start
                assert by_id[f"{agent}:{e['agent_id']}:{j}"].t_s == pytest.approx(start + q["t"], abs=1e-3)
    for r in trace.requests:  # file order never puts a request before what it waits for
        assert all(pos[a] < pos[r.id] for a in r.after)
    fan = trace_stats(trace)["subagent_fanout"]
    assert fan["max"] == 3  # trace_0010 / trace_0254 spawn three parallel sub-agents


def test_pause_rule() -> None:
    (path,) = _files(("trace_0003",))
    d = json.loads(gzip.decompress(path.read_bytes()))
    trace = convert_inputs("claude-code-weka", [path])
    by_id = {r.id: r for r in trace.requests}
    main = [e for e in d["requests"] if e["type"] != "subagent"]
    assert by_id["trace_0003:0"].pause_s == 0.0
    # a request that waits only on its stream predecessor pauses for the recorded think_time
    assert by_id["trace_0003:2"].after == ["trace_0003:1"]
    assert by_id["trace_0003:2"].pause_s == pytest.approx(main[2]["think_time"])
    # request 1 joins sub-agent agent_001: the gap from the latest completion among its predecessors
    sub = next(e for e in d["requests"] if e["type"] == "subagent")
    start = sub["t"] - sub["duration_ms"] / 1000
    last = sub["requests"][-1]
    expected = main[1]["t"] - max(main[0]["t"] + main[0]["api_time"], start + last["t"] + last["api_time"])
    joined = by_id["trace_0003:1"]
    assert joined.after == ["trace_0003:0", "trace_0003:agent_001:9"]
    assert joined.pause_s == pytest.approx(expected, abs=1e-3)
    assert expected < main[1]["think_time"]  # think_time counts from before the sub-agent ran
    # the sub-agent's first request: the gap from the spawning request's completion to the start
    first = by_id["trace_0003:agent_001:0"]
    assert first.pause_s == pytest.approx(start + sub["requests"][0]["t"] - (main[0]["t"] + main[0]["api_time"]), abs=1e-3)


def test_shared_prefix_ids_and_file_ids() -> None:
    paths = _files(("trace_0001", "trace_0003"))
    on = convert_inputs("claude-code-weka", paths)
    off = convert_inputs("claude-code-weka", paths, shared_prefix=False)
    first = {r.agent: r for r in on.requests if r.id.endswith(":0") and r.kind == "main"}
    a, b = first["trace_0001"], first["trace_0003"]
    d1 = json.loads(gzip.decompress(paths[0].read_bytes()))
    d3 = json.loads(gzip.decompress(paths[1].read_bytes()))
    k1 = (d1["tool_tokens"] + d1["system_tokens"]) // 64
    k3 = (d3["tool_tokens"] + d3["system_tokens"]) // 64
    assert a.blocks[: min(k1, k3)] == b.blocks[: min(k1, k3)] == list(range(min(k1, k3)))  # namespace 0
    assert all(x >= FILE_ID_STRIDE for x in a.blocks[k1:])
    assert on.header.meta["block_ids"]["namespaces"]["main"] == 0
    sub = next(r for r in on.requests if r.kind == "subagent")
    ns = on.header.meta["block_ids"]["namespaces"]["Explore"]
    assert sub.blocks[0] == ns * SHARED_NS_STRIDE
    # without the option every id is file-local: trace_0001 ids are 1e6 + local, trace_0003 ids 3e6 + local
    fa = next(r for r in off.requests if r.id == "trace_0001:0")
    assert fa.blocks[0] == 1 * FILE_ID_STRIDE + d1["requests"][0]["hash_ids"][0]
    assert trace_stats(on)["ideal_kv_hit_rate"] > trace_stats(off)["ideal_kv_hit_rate"]
    assert on.header.meta["options"] == {"shared_prefix": True, "block_size": 64}


def test_compaction_and_side_branches() -> None:
    paths = _files(("trace_0003",))
    trace = convert_inputs("claude-code-weka", paths)
    comp = [r for r in trace.requests if r.compaction]
    assert comp, "trace_0003 has context rewrites"
    prev_in: dict[str, int] = {}
    shrinking = 0
    for r in trace.requests:
        if r.compaction:
            shrinking += r.input_tokens < 0.7 * prev_in[r.branch]
        prev_in[r.branch] = r.input_tokens
    assert shrinking >= 2  # 154,792 -> 74,678 and 164,094 -> 55,212 tokens
    by_id = {r.id: r for r in trace.requests}
    # the compaction summary call (main request 78, fresh context) is a one-request side branch
    side = by_id["trace_0003:78"]
    assert side.kind == "fork" and side.parent_branch == "trace_0003:main" and side.ends_branch
    assert by_id["trace_0003:79"].compaction and by_id["trace_0003:79"].branch == "trace_0003:main"


def test_split_stream_rules() -> None:
    k = 2
    base = [1, 2, 3, 4, 5, 6]
    paths = [
        base,
        base + [7],  # extends
        [1, 2, 3, 4, 5, 99, 100],  # tail rewrite of one block: continues (lcp 5 > k, 2*5 >= 7)
        [1, 2, 50, 51],  # break: new chain
        [1, 2, 3, 4, 5, 99, 100, 101],  # back to the first chain: so chain 2 was a side call
    ]
    chain_of, creators, created = split_stream(paths, k)
    assert chain_of == [0, 0, 0, 1, 0]
    assert creators == [None, 0] and created == [0, 3]


def test_block_size_512_and_validation(tmp_path: Path) -> None:
    paths = _files(("trace_0001",))
    out = tmp_path / "cc512.jsonl.gz"
    header, n = convert_to_file("claude-code-weka", paths, out, block_size=512)
    assert header.block_size == 512 and n == raw_totals(paths)["requests"]
    assert list(iter_validate(out)) == []
    s64 = trace_stats(convert_inputs("claude-code-weka", paths))
    s512 = trace_stats_file(out)
    assert s512["input_tokens_total"] == s64["input_tokens_total"]
    assert abs(s512["ideal_kv_hit_rate"] - s64["ideal_kv_hit_rate"]) < 0.02


@pytest.mark.slow
def test_all_sessions_convert_validate_and_match_raw_totals(tmp_path: Path) -> None:
    """Every shared session converts and validates; trace stats equals the raw totals (about a minute)."""
    folder = shared_traces_or_skip("claude-code-weka")
    paths = sorted(folder.glob("trace_*.json.gz"))
    out = tmp_path / "all.jsonl"
    header, n = convert_to_file("claude-code-weka", [folder], out)
    assert header.meta["files"] == len(paths)
    problems = list(iter_validate(out))
    assert problems == []
    s = trace_stats_file(out)
    raw = raw_totals(paths)
    assert (s["requests"], s["subagent_branches"], s["input_tokens_total"], s["output_tokens_total"]) == (
        raw["requests"],
        raw["subagents"],
        raw["input"],
        raw["output_raw"],
    )
    assert s["sessions"] == len(paths)
    # the Claude-Code generator's targets are these real stats
    from evolving_infra.traces.generate.claude_code import load_fit
    from evolving_infra.traces.generate.common import stat_at

    for key, value in load_fit()["targets"].items():
        assert stat_at(s, key) == pytest.approx(value), key
    # ids are chained (docs/trace-format.md): an id always follows the same id; the engines'
    # radix pools rely on it (session 256 once put a shared main-prefix id after a sub-agent's prefix)
    from evolving_infra.traces.io import read_trace
    from evolving_infra.traces.tokens import rechain_blocks

    assert rechain_blocks(read_trace(out).requests)[1] == 0
