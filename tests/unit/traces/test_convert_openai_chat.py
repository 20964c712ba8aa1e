"""`trace convert --from openai-chat`: a hand-written 3-session request log (a sub-agent, a
compaction, branch headers, LiteLLM-style fields) → convert → validate → simulate, with the
reuse a reader checks by hand: a branch's next request reuses its previous full blocks, the
sub-agent reuses the shared system prompt, the compaction drops reuse to the system prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evolving_infra.cli import main as top_main
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import simulate
from evolving_infra.traces.convert import ConvertError, convert_inputs, convert_to_file
from evolving_infra.traces.io import iter_validate, read_trace
from evolving_infra.traces.tokens import PRIVATE_ID_BASE, blocks_from_tokens, chained_prefix_len
from shared.tokenizer import load_tokenizer

BS = 16
SYS = {"role": "system", "content": "You are a careful coding agent. " + " ".join(f"rule{i} applies here" for i in range(60))}
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


def u(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def tool(text: str) -> dict[str, str]:
    return {"role": "tool", "content": text, "tool_call_id": "c1"}


def line(t: float, session: str, messages: list[dict[str, str]], out: int = 20, **kw: object) -> dict[str, object]:
    return {"timestamp": t, "end_time": t + 2.0, "session_id": session,
            "request": {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 999},
            "response": {"usage": {"prompt_tokens": 1, "completion_tokens": out}}, **kw}


M1 = [SYS, u("fix the failing test in parser.py please")]
M2 = [*M1, a("let me look at the parser first"), tool("def parse(x): return x " * 60)]
SUB1 = [SYS, u("explore: list every caller of parse in the repository")]
SUB2 = [*SUB1, a("searching the tree"), tool("a.py b.py c.py")]
M3 = [*M2, a("I asked a helper to explore"), tool("the helper found a.py b.py c.py")]
M4 = [SYS, u("summary of the work so far: the parser bug is in parse, callers are a.py b.py c.py")]  # compacted
M5 = [*M4, a("now I fix it"), tool("tests pass")]


def log() -> list[dict[str, object]]:
    s1 = [line(0, "s1", M1), line(10, "s1", M2), line(20, "s1", SUB1, agent_id="explore"),
          line(30, "s1", SUB2, agent_id="explore"), line(40, "s1", M3), line(50, "s1", M4), line(60, "s1", M5)]
    # s2: the harness sends our branch headers (a fork of main opened at its first request)
    h = {"X-Branch-Id": "main", "X-Branch-Kind": "main"}
    s2 = [line(5, "s2", M1, headers=h),
          line(15, "s2", M2, headers=h),
          line(16, "s2", [*M1, a("other idea")], headers={"X-Branch-Id": "alt", "X-Parent-Branch-Id": "main",
                                                             "X-Branch-Kind": "fork"})]
    # s3: LiteLLM-style standard logging payload: ISO times, messages and token counts at the top level
    s3 = [{"startTime": "2026-12-06T10:00:07Z", "endTime": "2026-12-06T10:00:09Z", "session_id": "s3", "model": "m",
           "messages": [u("hello")], "prompt_tokens": 5, "completion_tokens": 3}]
    return s1 + s2 + s3


def write_log(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shared_tokens(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def test_convert_validate_and_reuse_by_hand(tmp_path: Path) -> None:
    src = write_log(tmp_path / "chat.jsonl", log())
    out = tmp_path / "t.jsonl"
    header, n = convert_to_file("openai-chat", [src], out, block_size=BS)
    assert n == 11 and header.block_size == BS and list(iter_validate(out)) == []
    reqs = {r.id: r for r in read_trace(out).requests}
    tok = load_tokenizer("sim")
    toks = {k: tok.apply_chat_template(m, TOOLS) for k, m in
            {"m1": M1, "m2": M2, "sub1": SUB1, "m3": M3, "m4": M4}.items()}
    r = [reqs[f"s1:{i}"] for i in range(7)]
    assert [q.branch for q in r] == ["s1:main", "s1:main", "s1:b1", "s1:b1", "s1:main", "s1:main", "s1:main"]
    assert r[0].kind == "main" and r[2].kind == "subagent" and r[2].parent_branch == "s1:main"
    assert r[1].after == ["s1:0"] and r[2].after == ["s1:1"] and r[3].after == ["s1:2"]
    assert r[4].after == ["s1:1", "s1:3"]  # main resumes after the sub-agent's last request (a join)
    assert r[5].compaction and r[5].after == ["s1:4"] and not r[4].compaction
    assert r[3].ends_branch and r[6].ends_branch and not r[5].ends_branch
    assert r[1].pause_s == 8.0 and r[1].t_s == 10.0 and r[0].arrival_s == 0.0  # sent 10 s in, 2 s after r0 ended
    assert r[0].input_tokens == len(toks["m1"]) and r[0].blocks == blocks_from_tokens(toks["m1"], BS)
    assert all(0 <= b < PRIVATE_ID_BASE for q in reqs.values() for b in q.blocks)
    # a branch's next request reuses its previous request's full blocks
    assert chained_prefix_len(r[0].blocks, r[1].blocks) == len(r[0].blocks) > 0
    assert chained_prefix_len(r[1].blocks, r[4].blocks) == len(r[1].blocks)
    # the sub-agent reuses the shared prompt (system prompt + tools), no more
    shared = shared_tokens(toks["m1"], toks["sub1"])
    assert shared > 3 * BS and chained_prefix_len(r[0].blocks, r[2].blocks) == shared // BS
    # the compaction drops reuse to the system prompt
    kept = shared_tokens(toks["m3"], toks["m4"])
    assert chained_prefix_len(r[4].blocks, r[5].blocks) == kept // BS < len(r[4].blocks) // 2
    assert kept == shared  # the same system prompt and tools that the sub-agent shared
    # headers: the fork of s2's main branch
    s2 = [reqs[f"s2:{i}"] for i in range(3)]
    assert [q.branch for q in s2] == ["s2:main", "s2:main", "s2:alt"]
    assert s2[2].kind == "fork" and s2[2].parent_branch == "s2:main" and s2[2].after == ["s2:1"]
    (s3,) = (q for q in reqs.values() if q.agent == "s3")
    assert s3.output_tokens == 3 and s3.arrival_s == pytest.approx(1796551207.0)
    assert header.meta["counts"]["compactions"] == 1 and header.meta["counts"]["sessions"] == 3


def test_simulate_the_converted_trace_at_a_finer_block_size(tmp_path: Path) -> None:
    """The trace's 47-bit ids at 16-token blocks split into 4-token blocks (b*4+k would leave the range)."""
    src = write_log(tmp_path / "chat.jsonl", log())
    trace = convert_inputs("openai-chat", [src], block_size=BS)
    res = simulate(SimConfig(nodes=2, policy="static:1P1D", concurrency=4, block_size=4), trace.requests, BS)
    recs = {x.id: x for x in res.records}
    assert len(recs) == 11 and all(x.ok for x in recs.values())
    assert recs["s1:1"].cached_tokens >= len(trace.requests[0].blocks) * BS - 4  # reuses r0's blocks
    assert top_main(["trace", "convert", "--from", "openai-chat", str(src), "-o", str(tmp_path / "c.jsonl"), "--no-progress",
                     "--block-size", "16"]) == 0
    assert top_main(["trace", "validate", "-q", str(tmp_path / "c.jsonl")]) == 0
    assert top_main(["trace", "convert", "--from", "azure", str(src), "-o", str(tmp_path / "d.jsonl"), "--no-progress",
                     "--tokenizer", "sim"]) == 2  # --tokenizer is openai-chat's


def test_bad_lines_are_named_and_skipped_or_stop_with_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = log()[:2] + [{"timestamp": 3, "session_id": "s1"}, {"session_id": "s9", "messages": [u("x")], "usage": {"completion_tokens": 1}}]
    src = write_log(tmp_path / "bad.jsonl", rows)
    t = convert_inputs("openai-chat", [src], block_size=BS)
    assert len(t.requests) == 2 and t.header.meta["skipped"]["rows_count"] == 2
    err = capsys.readouterr().err
    assert "line 3: no 'messages' list" in err and "line 4: no send time" in err
    with pytest.raises(ConvertError, match="line 3"):
        convert_inputs("openai-chat", [src], block_size=BS, strict=True)
    with pytest.raises(ConvertError, match="--tokenizer hf:"):
        convert_inputs("openai-chat", [src], tokenizer=f"hf:{tmp_path / 'nothing'}")


def test_blocks_from_tokens_chain_and_range() -> None:
    a = blocks_from_tokens(list(range(40)), 8)
    b = blocks_from_tokens([*range(20), 99, *range(21, 40)], 8)
    assert len(a) == 5 and a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]  # a change alters its block and all after
    assert blocks_from_tokens(list(range(7)), 8) == [] and all(0 <= x < PRIVATE_ID_BASE for x in a)
    with pytest.raises(ValueError):
        blocks_from_tokens([1, -2], 1)


def test_mini_swe_agent_errors_name_the_full_path_of_the_missing_field(tmp_path: Path) -> None:
    """The error named ``usage.prompt_tokens``; the field lives at ``messages[].extra.response.usage``."""
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "extra": {}}]
    f = tmp_path / "x.traj.json"
    f.write_text(json.dumps({"instance_id": "x", "messages": msgs}))
    with pytest.raises(ConvertError, match=r"lacks extra\.response\.usage\.prompt_tokens / extra\.response\.usage\.completion_tokens"):
        convert_inputs("mini-swe-agent", [f], strict=True)
    msgs[2]["extra"] = {"response": {"usage": {"prompt_tokens": 5, "completion_tokens": 1}}}
    f.write_text(json.dumps({"instance_id": "x", "messages": msgs}))
    with pytest.raises(ConvertError, match=r"lacks extra\.timestamp or extra\.response\.created"):
        convert_inputs("mini-swe-agent", [f], strict=True)
