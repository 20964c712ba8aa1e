"""Trace I/O: round trip, deterministic bytes, and line-numbered validation of malformed files."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from evolving_infra.traces.io import TraceError, iter_requests, iter_validate, read_trace, write_trace
from evolving_infra.traces.schema import FORMAT, TraceHeader, TraceRequest

REPO = Path(__file__).resolve().parents[3]
HEADER = {"format": FORMAT, "block_size": 4}


def _req(rid: str, **kw) -> dict:
    d = {"id": rid, "agent": "a", "branch": "a:main", "input_tokens": 9, "output_tokens": 3, "blocks": [1, 2]}
    d.update(kw)
    return d


def _write_lines(path: Path, lines: list[object]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def _good_lines() -> list[object]:
    return [
        HEADER,
        _req("r0", kind="main"),
        _req("s0", branch="a:sub", kind="subagent", parent_branch="a:main", after=["r0"], blocks=[7, 8], ends_branch=True),
        _req("r1", after=["r0", "s0"], pause_s=1.5, input_tokens=13, blocks=[1, 2, 3], ends_branch=True),
    ]


def test_round_trip_and_deterministic_bytes(tmp_path: Path) -> None:
    src = _write_lines(tmp_path / "in.jsonl", _good_lines())
    t = read_trace(src)
    assert [r.id for r in t.requests] == ["r0", "s0", "r1"]
    assert t.requests[2].after == ["r0", "s0"] and t.requests[2].pause_s == 1.5
    assert t.agents() == ["a"]
    for name in ("a.jsonl", "b.jsonl.gz"):
        out = tmp_path / name
        write_trace(out, t.header, t.requests)
        assert read_trace(out).requests == t.requests
    first = (tmp_path / "b.jsonl.gz").read_bytes()
    write_trace(tmp_path / "b.jsonl.gz", t.header, iter(t.requests))
    assert (tmp_path / "b.jsonl.gz").read_bytes() == first  # gzip with mtime 0: same bytes
    assert gzip.decompress(first) == (tmp_path / "a.jsonl").read_bytes()


def test_header_meta_keys_sorted(tmp_path: Path) -> None:
    h = TraceHeader(format=FORMAT, block_size=4, meta={"z": 1, "a": {"y": 2, "b": 3}})
    write_trace(tmp_path / "t.jsonl", h, [])
    line = (tmp_path / "t.jsonl").read_text().splitlines()[0]
    assert line.index('"a"') < line.index('"z"') and line.index('"b"') < line.index('"y"')


def test_malformed_lines_reported_with_numbers_and_nothing_lost(tmp_path: Path) -> None:
    lines = [
        HEADER,  # 1
        _req("r0", kind="main"),  # 2 ok
        '{"id": "broken", "agent": ',  # 3 bad JSON
        {k: v for k, v in _req("r1", after=["r0"]).items() if k != "agent"},  # 4 missing field
        _req("r2", after=["r0"], input_tokens=-5, blocks=[]),  # 5 negative length
        _req("o0", branch="a:orphan", kind="subagent", parent_branch="a:nope", after=["r0"], ends_branch=True),  # 6 orphan sub-agent
        _req("r3", after=["r0"], blocks=[1]),  # 7 wrong number of blocks
        _req("r4", after=["ghost"]),  # 8 unknown predecessor
        _req("r0", after=["r3"]),  # 9 duplicate id
        _req("r5", after=["r4"], ends_branch=True),  # 10 ok: depends on line 8's request (no cascade)
        _req("x0", agent="b", branch="b:main", after=["r5"], kind="main", ends_branch=True),  # 11 after of another agent
    ]
    path = _write_lines(tmp_path / "bad.jsonl", lines)
    problems = list(iter_validate(path))
    by_line = {}
    for p in problems:
        by_line.setdefault(p.line, []).append(p.reason)
    assert sorted(by_line) == [3, 4, 5, 6, 7, 8, 9, 11], problems
    assert "invalid JSON" in by_line[3][0]
    assert "agent" in by_line[4][0]
    assert "input_tokens" in by_line[5][0] and ">= 1" in by_line[5][0]
    assert any("parent branch 'a:nope'" in r and "does not exist" in r for r in by_line[6])
    assert any("len(blocks) = 1" in r for r in by_line[7])
    assert any("unknown request 'ghost'" in r for r in by_line[8])
    assert any("duplicate request id 'r0'" in r and "line 2" in r for r in by_line[9])
    assert any("another agent" in r for r in by_line[11])
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    msg = str(ei.value)
    for n in (3, 4, 5, 6, 7, 8, 9, 11):
        assert re.search(rf"^line {n}: ", msg, re.M), msg
    assert ei.value.problems == problems


def test_branch_rules(tmp_path: Path) -> None:
    lines = [
        HEADER,
        _req("r0"),  # 2 first request of a branch without kind
        _req("r1", after=["r0"], kind="main"),  # 3 kind on a later request
        _req("f0", branch="a:f", kind="fork", after=["r0"]),  # 4 fork without parent
        _req("r2", after=["r1"], ends_branch=True),  # 5 ok
        _req("r3", after=["r2"]),  # 6 after the branch ended
        _req("m0", branch="a:m2", kind="main", parent_branch="a:main", ends_branch=True),  # 7 main with a parent
    ]
    problems = list(iter_validate(_write_lines(tmp_path / "b.jsonl", lines)))
    lines_with = {p.line for p in problems}
    assert {2, 3, 4, 6, 7} <= lines_with and 5 not in lines_with
    # the fork branch never ends: reported on its last line
    assert any(p.line == 4 and "never ends" in p.reason for p in problems)


def test_header_problems(tmp_path: Path) -> None:
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    assert [p.line for p in iter_validate(empty)] == [1]
    no_header = _write_lines(tmp_path / "n.jsonl", [_req("r0", kind="main", ends_branch=True)])
    problems = list(iter_validate(no_header))
    assert len(problems) == 1 and "missing trace header" in problems[0].reason
    newer = _write_lines(tmp_path / "v.jsonl", [{**HEADER, "version": 99}])
    assert "unsupported" in next(iter(iter_validate(newer))).reason


def test_a_raw_public_trace_is_told_to_be_converted(tmp_path: Path) -> None:
    """``simulate --trace`` of a raw WEKA Claude Code file said only 'invalid trace header: Object missing
    required field `format`'; a line 1 that is no header and no canonical header with a bad field now names
    the cause and the command. A canonical header with a bad field gets no such hint."""
    from evolving_infra.traces.io import read_header

    weka = tmp_path / "trace_0001.json"
    weka.write_text(json.dumps({"id": "trace_0001", "block_size": 64, "requests": [{"t": 0.0, "type": "n"}]}) + "\n")
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    for path in (weka, csv):
        (problem,) = list(iter_validate(path))
        assert problem.line == 1 and "not a canonical trace" in problem.reason and "trace convert --from" in problem.reason
        with pytest.raises(TraceError, match="trace convert --from"):
            read_header(path)
    bad_field = _write_lines(tmp_path / "b.jsonl", [{**HEADER, "block_size": "sixty-four"}])
    (problem,) = list(iter_validate(bad_field))[:1]
    assert problem.reason.startswith("invalid trace header: ") and "not a canonical trace" not in problem.reason


def test_a_headerless_trace_whose_first_request_is_bad_is_told_its_header_is_missing(tmp_path: Path) -> None:
    """A trace without its header whose line 1 is itself a bad request read 'invalid trace header: ...;
    not a canonical trace ... convert it', naming neither the missing header nor the request's fault
    (and ``trace stats`` said so even of a good request there). Every reader now says the header is
    missing and what is wrong with the request, as it did of a good request on line 1."""
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.io import read_header

    no_agent = {k: v for k, v in _req("r0", kind="main", ends_branch=True).items() if k != "agent"}
    cases = {"no_agent": (no_agent, "invalid request: Object missing required field `agent`"),
             "negative": (_req("r0", kind="main", ends_branch=True, input_tokens=-1), "invalid request: Expected `int` >= 1"),
             "good": (_req("r0", kind="main", ends_branch=True), None)}
    for name, (line1, fault) in cases.items():
        path = _write_lines(tmp_path / f"{name}.jsonl", [line1])
        want = ["missing trace header"] + ([fault] if fault else [])
        problems = list(iter_validate(path))
        assert [p.line for p in problems] == [1] * len(want), (name, problems)
        assert all(p.reason.startswith(w) for p, w in zip(problems, want)), (name, problems)
        for read in (read_trace, read_trace_compact, read_header):  # stats reads the header first
            with pytest.raises(TraceError) as ei:
                read(path)
            assert ei.value.problems == problems and "not a canonical trace" not in str(ei.value), (name, read, str(ei.value))


def test_a_runs_requests_jsonl_is_no_trace_not_a_headerless_one(tmp_path: Path) -> None:
    """A run's ``requests.jsonl`` given as a trace: its records have ``id``, ``agent`` and ``branch``
    (3 of a request's required fields) among keys of their own, and every reader took it for a
    headerless trace: 'missing trace header' and 'invalid request: ... `input_tokens`' on line 1, and
    the loading readers read on through every record. It is no trace: line 1's one problem, saying what the
    file is (it read 'invalid trace header ...; a raw public trace is converted first', a wrong lead)."""
    from evolving_infra.report.records import RequestRecord, write_records
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.io import read_header

    path = tmp_path / "requests.jsonl"
    failed = RequestRecord(id="t:0", agent="t", branch="t:main", sent_at=1.0, ok=False, status=503, error="no route")
    done = RequestRecord(id="t:1", agent="t", branch="t:main", sent_at=2.0, ttft_s=0.4, prompt_tokens=900,
                         completion_tokens=20, expected_prompt_tokens=900, expected_completion_tokens=20, prefill_node="w0")
    for first in (failed, done):
        write_records(path, [first, done, failed])
        for read in (read_trace, read_trace_compact, read_header):
            with pytest.raises(TraceError) as ei:
                read(path)
            (problem,) = ei.value.problems
            assert problem.line == 1 and problem.reason.startswith(RUN_RECORDS), (read, str(ei.value))
        problems = list(iter_validate(path))
        assert problems[0].line == 1 and problems[0].reason.startswith(RUN_RECORDS), problems
        assert not any("missing trace header" in p.reason for p in problems), problems


RUN_RECORDS = "this is a run's requests.jsonl (one record per request served: ttft_s, e2e_s ...), not a trace"


def test_a_runs_report_json_is_named_as_no_trace(tmp_path: Path) -> None:
    """``--trace report.json`` (a run's report: JSON over several lines, line 1 '{') read 'invalid trace header:
    Input data was truncated; ... a raw public trace is converted first'."""
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.io import read_header

    path = tmp_path / "report.json"
    path.write_text(json.dumps({"meta": {"trace": "cc.jsonl.gz"}, "requests": 3}, indent=2) + "\n")
    for read in (read_trace, read_trace_compact, read_header):
        with pytest.raises(TraceError) as ei:
            read(path)
        (problem,) = ei.value.problems
        assert problem.line == 1 and problem.reason.startswith("'{' alone: a JSON document over several lines, such as a "
                                                              "run's report.json, not a trace"), (read, str(ei.value))
        assert "truncated" not in problem.reason and "trace convert" not in problem.reason


def test_a_dynamo_agentic_mooncake_trace_is_named_with_what_to_do(tmp_path: Path) -> None:
    """A Dynamo ``agentic_mooncake`` trace (``bench/sim_speed.py`` ``dynamo_trace`` writes one) given as a trace
    read 'invalid trace header ...; a raw public trace is converted first: trace convert --from {...,mooncake}',
    and that converter then refused every row. It is named, with the trace it was written from."""
    import sys

    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.io import read_header

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import sim_speed

    src = tmp_path / "ours.jsonl"
    write_trace(src, TraceHeader(format=FORMAT, block_size=4), [TraceRequest(**_req("r0", kind="main", ends_branch=True))])
    dyn = tmp_path / "dynamo.jsonl"
    sim_speed.dynamo_trace(src, dyn, 4)
    for read in (read_trace, read_trace_compact, read_header):
        with pytest.raises(TraceError) as ei:
            read(dyn)
        (problem,) = ei.value.problems
        assert problem.line == 1 and problem.reason.startswith(
            "a Dynamo agentic_mooncake trace (header schema 'dynamo.agentic_mooncake', version 2), not a canonical trace "
            "nor a Mooncake FAST'25 trace"), problem.reason
        assert problem.reason.endswith("written from this project's trace 'ours.jsonl' (bench/sim_speed.py dynamo_trace): "
                                       "give that file instead"), problem.reason


def test_iter_requests_streams_then_raises(tmp_path: Path) -> None:
    lines = _good_lines() + ['{"nope"']
    header, it = iter_requests(_write_lines(tmp_path / "s.jsonl", lines))
    assert header.block_size == 4
    got = []
    with pytest.raises(TraceError) as ei:
        for r in it:
            got.append(r.id)
    assert got == ["r0", "s0", "r1"]
    assert [p.line for p in ei.value.problems] == [5]


def test_block_id_range(tmp_path: Path) -> None:
    lines = [HEADER, _req("r0", kind="main", blocks=[1, 2**48], ends_branch=True)]
    problems = list(iter_validate(_write_lines(tmp_path / "r.jsonl", lines)))
    assert [p.line for p in problems] == [2] and "2**48" in problems[0].reason


def test_spec_example_is_valid(tmp_path: Path) -> None:
    """The example in docs/trace-format.md §9 validates and has the h* the spec states."""
    from evolving_infra.traces.stats import trace_stats

    text = (REPO / "docs" / "trace-format.md").read_text()
    block = text.split("## 9. Example", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    path = tmp_path / "example.jsonl"
    path.write_text(block.strip() + "\n")
    t = read_trace(path)
    s = trace_stats(t)
    assert s["requests"] == 4 and s["subagent_branches"] == 1 and s["compactions"] == 1
    assert s["ideal_kv_hit_rate"] == pytest.approx(256 / 780)


def test_write_request_fields_omit_defaults(tmp_path: Path) -> None:
    r = TraceRequest(id="x", agent="a", branch="b", input_tokens=1, output_tokens=1, kind="main", ends_branch=True)
    write_trace(tmp_path / "o.jsonl", TraceHeader(format=FORMAT, block_size=64), [r])
    line = (tmp_path / "o.jsonl").read_text().splitlines()[1]
    assert json.loads(line) == {"id": "x", "agent": "a", "branch": "b", "input_tokens": 1, "output_tokens": 1, "kind": "main", "ends_branch": True}


def test_a_utf8_bom_before_the_header_is_skipped_by_every_reader(tmp_path: Path) -> None:
    """Editors on Windows write a UTF-8 byte order mark before the first line; every reader refused
    such a trace at line 1 ('invalid character (byte 0)'). Plain, one gzip member (the fast
    reader), two members (``gzip``'s own), and a first line longer than a read chunk."""
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.io import CHUNK
    from evolving_infra.traces.stats import trace_stats_file

    lines = _good_lines()
    lines[0] = {**HEADER, "meta": {"pad": "x" * CHUNK}}  # the header crosses the first chunk's end
    for big in (False, True):
        text = _write_lines(tmp_path / "src.jsonl", lines if big else _good_lines()).read_bytes()
        want = read_trace(tmp_path / "src.jsonl")
        bom = b"\xef\xbb\xbf" + text
        half = len(bom) // 2
        files = {"plain.jsonl": bom, "one.jsonl.gz": gzip.compress(bom, mtime=0),
                 "two.jsonl.gz": gzip.compress(bom[:half], mtime=0) + gzip.compress(bom[half:], mtime=0)}
        for name, data in files.items():
            path = tmp_path / name
            path.write_bytes(data)
            assert list(iter_validate(path)) == [], (name, big)
            got = read_trace(path)
            assert (got.header, got.requests) == (want.header, want.requests), (name, big)
            assert read_trace_compact(path).requests_with_blocks() == want.requests, (name, big)
            assert trace_stats_file(path)["requests"] == 3, (name, big)
    # only a leading mark: one before a later line is still that line's problem
    path = _write_lines(tmp_path / "mid.jsonl", _good_lines())
    path.write_bytes(path.read_bytes().replace(b'{"id": "s0"', b'\xef\xbb\xbf{"id": "s0"'))
    assert [p.line for p in iter_validate(path)][:1] == [3]


def test_a_line_cut_short_names_its_request_so_nothing_cascades(tmp_path: Path) -> None:
    """One line that is not JSON (a request cut short) is one problem: the lines after it that name its id as their
    predecessor, or continue the branch it opened, report nothing of their own (a newcomer's truncated line 61 gave
    '62: after references unknown request' and '62: first request of branch ... must set kind' besides)."""
    sub = _req("s0", branch="a:sub", kind="subagent", parent_branch="a:main", after=["r0"])
    cut = json.dumps(sub)[:-25]  # the line cut inside its last fields: its "id", "agent" and "branch" are still there
    lines = [
        HEADER,  # 1
        _req("r0", kind="main"),  # 2
        cut,  # 3 bad JSON, opening branch a:sub
        _req("s1", branch="a:sub", after=["s0"], ends_branch=True),  # 4 continues a:sub after s0: no problem of its own
        _req("r1", after=["r0"], ends_branch=True),  # 5
    ]
    assert '"id": "s0"' in cut and '"branch": "a:sub"' in cut and '"agent": "a"' in cut, cut
    problems = list(iter_validate(_write_lines(tmp_path / "cut.jsonl", lines)))
    assert [(p.line, p.reason.split(":")[0]) for p in problems] == [(3, "invalid JSON")], problems
