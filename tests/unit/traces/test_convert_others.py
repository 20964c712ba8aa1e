"""mooncake, mini-swe-agent and azure converters on the real files in ../shared/traces."""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
from pathlib import Path

import pytest

from evolving_infra.traces.convert import ConvertError, convert_inputs, convert_to_file
from evolving_infra.traces.convert.azure import parse_timestamp
from evolving_infra.traces.io import iter_validate, validate_requests
from evolving_infra.traces.stats import trace_stats
from tests.conftest import shared_traces_or_skip


def _mooncake_raw_hit_rate(path: Path) -> tuple[int, float]:
    """Independent h* of the raw Mooncake rows (full 512-token blocks, prefix semantics, timestamp order)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        full = r["hash_ids"][: r["input_length"] // 512]
        n = 0
        while n < len(full) and full[n] in seen:
            n += 1
        seen.update(full)
        hit += n * 512
        total += r["input_length"]
    return len(rows), hit / total


def test_mooncake_plain_and_sessions(tmp_path: Path) -> None:
    src = shared_traces_or_skip("mooncake", "conversation_trace.jsonl")
    n_rows, h_raw = _mooncake_raw_hit_rate(src)
    out = tmp_path / "mc.jsonl"
    header, n = convert_to_file("mooncake", [src], out)
    assert n == n_rows and header.block_size == 512
    assert list(iter_validate(out)) == []
    from evolving_infra.traces.stats import trace_stats_file

    s = trace_stats_file(out)
    assert s["sessions"] == n_rows and s["ideal_kv_hit_rate"] == pytest.approx(h_raw)
    arrivals = [json.loads(line).get("arrival_s") for line in out.read_text().splitlines()[1:]]
    assert arrivals == sorted(arrivals)

    sess = convert_inputs("mooncake", [src], infer_sessions=True)
    assert validate_requests(sess.header, sess.requests) == []
    ss = trace_stats(sess)
    assert ss["requests"] == n_rows and ss["sessions"] < n_rows
    assert ss["ideal_kv_hit_rate"] == pytest.approx(h_raw)  # same order, same blocks
    by_id = {r.id: r for r in sess.requests}
    for r in sess.requests:  # a linked row extends its predecessor's whole full-block path
        if r.after:
            (p,) = r.after
            prev = by_id[p]
            assert len(prev.blocks) >= 2 and r.blocks[: len(prev.blocks)] == prev.blocks
    assert sess.header.meta["options"]["infer_sessions"] is True


def test_mooncake_block_size_64() -> None:
    src = shared_traces_or_skip("mooncake", "conversation_trace.jsonl")
    t = convert_inputs("mooncake", [src], block_size=64)
    assert validate_requests(t.header, t.requests) == []
    first = json.loads(src.read_text().splitlines()[0])
    r0 = t.requests[0]
    assert r0.input_tokens == first["input_length"] and len(r0.blocks) == first["input_length"] // 64
    assert r0.blocks[:8] == [first["hash_ids"][0] * 8 + k for k in range(8)]
    assert trace_stats(t)["ideal_kv_hit_rate"] >= _mooncake_raw_hit_rate(src)[1] - 1e-9
    with pytest.raises(ConvertError):
        convert_inputs("mooncake", [src], block_size=100)


def _swe_files(n: int = 3) -> list[Path]:
    folder = shared_traces_or_skip("mini-swe-agent")
    return sorted(folder.rglob("*.traj.json.gz"))[:n]


def test_mini_swe_agent_counts_timing_and_prefix_ids() -> None:
    paths = _swe_files(3)
    t = convert_inputs("mini-swe-agent", paths)
    assert validate_requests(t.header, t.requests) == []
    s = trace_stats(t)
    calls = prompt = completion = 0
    gaps = []
    for p in paths:
        d = json.loads(gzip.decompress(p.read_bytes()))
        prev_recv = None
        last_tool_ts = None
        for m in d["messages"]:
            if m["role"] == "assistant":
                u = m["extra"]["response"]["usage"]
                calls += 1
                prompt += u["prompt_tokens"]
                completion += max(1, u["completion_tokens"])
                if prev_recv is not None and last_tool_ts is not None:
                    gaps.append(max(0.0, last_tool_ts - prev_recv))
                prev_recv, last_tool_ts = m["extra"]["timestamp"], None
            elif m["role"] == "tool":
                last_tool_ts = m["extra"]["timestamp"]
    assert (s["requests"], s["sessions"], s["input_tokens_total"], s["output_tokens_total"]) == (calls, len(paths), prompt, completion)
    assert s["branches_by_kind"] == {"main": len(paths), "fork": 0, "subagent": 0}
    assert sorted(r.pause_s for r in t.requests if r.after) == pytest.approx(sorted(gaps), abs=1e-5)
    # append-only history: each call's blocks extend the previous call's blocks
    by_agent = t.by_agent()
    for reqs in by_agent.values():
        reqs.sort(key=lambda r: int(r.id.rsplit(":", 1)[1]))
        for a, b in zip(reqs, reqs[1:]):
            assert b.blocks[: len(a.blocks)] == a.blocks
    # tool definitions + system prompt + task template head: the same first 5 blocks (320 tokens,
    # what DeepSeek reports as cached on each task's first call) in every task, then the task differs
    firsts = [reqs[0].blocks for reqs in by_agent.values()]
    assert firsts[0][:5] == firsts[1][:5] == firsts[2][:5]
    assert firsts[0][5] != firsts[1][5]
    assert 0.9 < s["ideal_kv_hit_rate"] < 1.0


def test_mini_swe_agent_ids_depend_on_content_only() -> None:
    paths = _swe_files(2)
    a = convert_inputs("mini-swe-agent", paths)
    b = convert_inputs("mini-swe-agent", list(reversed(paths)))
    key = {r.id: r.blocks for r in a.requests}
    assert all(key[r.id] == r.blocks for r in b.requests)


def test_azure(tmp_path: Path) -> None:
    folder = shared_traces_or_skip("azure-llm-2023")
    files = sorted(folder.glob("*.csv"))
    rows = []
    for f in files:
        with f.open() as fh:
            rows += [(parse_timestamp(r["TIMESTAMP"]), int(r["ContextTokens"]), max(1, int(r["GeneratedTokens"]))) for r in csv.DictReader(fh)]
    out = tmp_path / "az.jsonl.gz"
    header, n = convert_to_file("azure", [folder], out)
    assert n == len(rows)
    assert list(iter_validate(out)) == []
    from evolving_infra.traces.stats import trace_stats_file

    s = trace_stats_file(out)
    assert s["input_tokens_total"] == sum(r[1] for r in rows) and s["output_tokens_total"] == sum(r[2] for r in rows)
    assert s["ideal_kv_hit_rate"] == 0.0 and s["sessions"] == len(rows)
    t0 = min(r[0] for r in rows)
    first = json.loads(gzip.decompress(out.read_bytes()).splitlines()[1])
    assert first["arrival_s"] == 0.0 and header.meta["clock"]["origin_unix_s"] == pytest.approx(t0)
    assert parse_timestamp("2023-11-16 18:17:03.9799600") == pytest.approx(1700158623.97996)


def test_missing_input_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConvertError, match="no such file"):
        convert_inputs("azure", [tmp_path / "nope.csv"])
    bad = tmp_path / "t.json"
    bad.write_text('{"requests": "x"}')
    with pytest.raises(ConvertError, match="t.json"):
        convert_inputs("claude-code-weka", [bad])
    with pytest.raises(ConvertError, match="unknown trace kind"):
        convert_inputs("nope", [bad])


@pytest.mark.slow
def test_all_mini_swe_agent_trajectories_convert_and_validate(tmp_path: Path) -> None:
    folder = shared_traces_or_skip("mini-swe-agent")
    files = sorted(folder.rglob("*.traj.json.gz"))
    out = tmp_path / "msa.jsonl"
    header, n = convert_to_file("mini-swe-agent", [folder], out)
    assert list(iter_validate(out)) == []
    assert header.meta["counts"]["agents"] == len(files)
    calls = sum(sum(1 for m in json.loads(gzip.decompress(f.read_bytes()))["messages"] if m["role"] == "assistant") for f in files)
    assert n == calls


def test_mooncake_bad_rows_are_named_skipped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({**good, "input_length": -3}),
        json.dumps({**good, "input_length": 2048}),  # 2 hash_ids for 4 full blocks
        json.dumps({**good, "timestamp": 1000, "hash_ids": [1, 3]}),
    ]
    src = tmp_path / "mc.jsonl"
    src.write_text("\n".join(lines) + "\n")
    bad_gz = tmp_path / "broken.jsonl.gz"
    bad_gz.write_bytes(b"\x1f\x8b not gzip")
    out = tmp_path / "out.jsonl"
    header, n = convert_to_file("mooncake", [src, bad_gz], out)
    assert n == 2 and list(iter_validate(out)) == []
    sk = header.meta["skipped"]
    assert sk["count"] == 1 and sk["files"][0]["file"] == str(bad_gz)
    assert sk["rows_count"] == 3 and [r["line"] for r in sk["rows"]] == [2, 3, 4]
    err = capsys.readouterr().err
    assert f"{src}: line 2:" in err and f"{src}: line 4: 2 hash_ids for 2048 tokens" in err and str(bad_gz) in err
    with pytest.raises(ConvertError, match=r"mc.jsonl: line 2"):
        convert_inputs("mooncake", [src], strict=True)
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_text("{not json\n")
    with pytest.raises(ConvertError, match=r"no row .* first: .*only_bad.jsonl: line 1"):
        convert_inputs("mooncake", [only_bad])


def test_azure_bad_rows_are_named_skipped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "az.csv"
    src.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.1,100,5\n"
        "yesterday,100,5\n"
        "2023-11-16 18:17:04.0,0,5\n"
        "2023-11-16 18:17:05.0,70,x\n"
        "2023-11-16 18:17:06.0,200,7\n"
    )
    nocols = tmp_path / "nocols.csv"
    nocols.write_text("a,b\n1,2\n")
    out = tmp_path / "out.jsonl"
    header, n = convert_to_file("azure", [src, nocols], out)
    assert n == 2 and list(iter_validate(out)) == []
    sk = header.meta["skipped"]
    assert sk["count"] == 1 and "expected columns" in sk["files"][0]["reason"]
    assert sk["rows_count"] == 3 and [r["line"] for r in sk["rows"]] == [3, 4, 5]
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()[1:]] == ["az:2", "az:6"]
    assert f"{src}: line 3:" in capsys.readouterr().err
    with pytest.raises(ConvertError, match=r"az.csv: line 3"):
        convert_inputs("azure", [src], strict=True)


def test_header_of_many_inputs_stays_under_the_readers_line_1_bound(tmp_path: Path) -> None:
    """200,000 input names (46 bytes each, 9.6 MB listed whole) were one header line over the
    readers' 8 MiB bound (MAX_FIRST_LINE): a trace no reader accepts. Bounded, it reads back."""
    from evolving_infra.traces.convert.common import MAX_HEADER_NAMES, inputs_meta, make_header, source_line
    from evolving_infra.traces.io import MAX_FIRST_LINE, encode_line, read_header

    names = [f"session-{i:07d}-0123456789abcdef0123.json.gz" for i in range(200_000)]
    assert len(json.dumps(names)) > MAX_FIRST_LINE  # the list whole would not fit
    header = make_header(block_size=64, source=source_line("azure", names), description="d", meta=inputs_meta(names))
    line = encode_line(header)
    assert len(line) < 200_000
    p = tmp_path / "h.jsonl"
    p.write_bytes(line + b"\n")
    back = read_header(p).meta
    assert back["inputs"] == names[:MAX_HEADER_NAMES] and back["inputs_count"] == 200_000
    assert back["inputs_last"] == names[-1]
    assert back["inputs_sha256"] == hashlib.sha256("".join(n + "\n" for n in names).encode()).hexdigest()
    assert header.source.endswith(f"{names[MAX_HEADER_NAMES - 1]}, ... (200,000 inputs in all)")


def test_azure_header_lists_bounded_inputs_and_skipped_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_HEADER_NAMES (lowered to 3 here) a conversion's header lists the first names, the
    count, the last name and the digest of all; skipped files likewise (all counted)."""
    from evolving_infra.traces.convert import common

    monkeypatch.setattr(common, "MAX_HEADER_NAMES", 3)
    monkeypatch.setattr(common.Skipped, "META_FILES", 3)
    good = []
    for i in range(7):
        f = tmp_path / f"a{i}.csv"
        f.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:0{i}.0,100,5\n")
        good.append(f)
    bad = []
    for i in range(5):
        f = tmp_path / f"b{i}.csv"
        f.write_text("a,b\n1,2\n")
        bad.append(f)
    out = tmp_path / "out.jsonl"
    header, n = convert_to_file("azure", good + bad, out)
    assert n == 7 and list(iter_validate(out)) == []
    meta = header.meta
    names = [p.name for p in good + bad]
    assert meta["inputs"] == names[:3] and meta["inputs_count"] == 12 and meta["inputs_last"] == "b4.csv"
    assert meta["inputs_sha256"] == hashlib.sha256("".join(x + "\n" for x in names).encode()).hexdigest()
    assert header.source == f"azure: {good[0]}, {good[1]}, {good[2]}, ... (12 inputs in all)"
    assert meta["skipped"]["count"] == 5 and [s["file"] for s in meta["skipped"]["files"]] == [str(p) for p in bad[:3]]
    # at or under the bound: listed whole, nothing added (headers of up to 1,000 files unchanged)
    header, _ = convert_to_file("azure", good[:3], tmp_path / "few.jsonl")
    assert header.meta["inputs"] == ["a0.csv", "a1.csv", "a2.csv"] and "inputs_count" not in header.meta
    assert header.source == f"azure: {good[0]}, {good[1]}, {good[2]}"


def test_mooncake_refuses_a_dynamo_agentic_trace_and_names_multi_turn_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Dynamo ``agentic_mooncake`` trace (``bench/sim_speed.py`` ``dynamo_trace``) given to ``--from mooncake``
    had every row refused ('Object missing required field `timestamp`'); it is now named at its header. aiperf /
    Dynamo multi-turn rows with a ``timestamp`` had ``session_id`` / ``delay`` dropped unsaid: they are counted and
    a note says they are not used."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import sim_speed

    sample = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    dyn = tmp_path / "dynamo.jsonl"
    sim_speed.dynamo_trace(sample, dyn, 64)
    with pytest.raises(ConvertError, match=r"dynamo\.jsonl: a Dynamo agentic_mooncake trace \(header schema "
                                           r"'dynamo\.agentic_mooncake', version 2\).*written from this project's trace "
                                           r"'claude-code-sample\.jsonl\.gz'"):
        convert_inputs("mooncake", [dyn], strict=True)
    with pytest.raises(ConvertError, match="none of the input files could be converted"):
        convert_inputs("mooncake", [dyn])
    assert "timestamp" not in capsys.readouterr().err
    multi = tmp_path / "multi.jsonl"
    rows = [{"session_id": "s1", "timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
            {"session_id": "s1", "timestamp": 100, "delay": 50, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}]
    multi.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = convert_inputs("mooncake", [multi])
    assert len(t.requests) == 2
    counts = t.header.meta["counts"]
    assert counts["rows_with_session_id_unused"] == 2 and counts["rows_with_delay_unused"] == 1, counts
    err = capsys.readouterr().err
    assert "2 row(s) carry 'session_id' (aiperf/Dynamo multi-turn Mooncake rows): not used" in err, err
    assert "1 row(s) carry 'delay'" in err, err
