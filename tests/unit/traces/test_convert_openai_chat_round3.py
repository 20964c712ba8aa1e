"""`trace convert --from openai-chat`: the third review of the converter (session 52) — content
shapes that render alike, Anthropic-format bodies, identical one-shot prompts, LiteLLM's random
trace ids, deeply nested lines, sub-agents without ``agent_id``, bad counts, session keys in the
stored body, branch headers across rotated files, ties in send time, lines dropped once placed."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from evolving_infra.traces.convert import ConvertError
from shared.tokenizer import load_tokenizer
from tests.unit.traces.openai_chat_log import BS, SYS, a, conv, row, u, write

def test_a_string_and_its_text_part_list_are_one_message(tmp_path: Path) -> None:
    """Cline / Roo via OpenRouter turn the last user messages into text parts and back: every turn from
    the third on was a new sub-agent; content None resent as "" opened a fork."""
    users = ["task one", "result one", "result two", "result three", "result four"]
    rows = []
    for i in range(len(users)):
        msgs: list[Any] = [SYS]
        for j in range(i + 1):
            c: Any = users[j]
            if j >= i - 1:
                c = [{"type": "text", "text": c, "cache_control": {"type": "ephemeral"}}]
            msgs.append({"role": "user", "content": c})
            if j < i:
                msgs.append(a(f"reply {j}"))
        rows.append(row(i * 10, msgs, end=i * 10 + 2))
    reqs, meta = conv(write(tmp_path / "cline.jsonl", rows))
    assert [reqs[f"s:{i}"].branch for i in range(5)] == ["s:main"] * 5 and meta["counts"]["branches_main"] == 1
    tc = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
    m1 = [SYS, u("go")]
    m2 = [*m1, {"role": "assistant", "content": None, "tool_calls": tc}, {"role": "tool", "tool_call_id": "c1", "content": "a"}]
    m3 = [*m1, {"role": "assistant", "content": "", "tool_calls": tc}, {"role": "tool", "tool_call_id": "c1", "content": "a"},
          a("done"), u("next")]
    reqs, meta = conv(write(tmp_path / "nonestr.jsonl", [row(0, m1, end=1), row(2, m2, end=3), row(4, m3, end=5)]))
    assert reqs["s:2"].branch == "s:main" and reqs["s:2"].after == ["s:1"] and "branches_fork" not in meta["counts"]


def test_anthropic_blocks_and_top_level_system_count_their_tokens(tmp_path: Path) -> None:
    """tool_use / tool_result / thinking blocks counted 0 tokens and a top-level system was ignored (20/42/64
    tokens against 116/603/1090 for the same conversation in OpenAI format)."""
    big = "file contents " * 200
    sysp = "You are an agent. " + "rule " * 80
    ant: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]
    oai: list[Any] = [{"role": "system", "content": sysp}, u("fix the bug")]
    rows_a, rows_o = [], []
    for i in range(3):
        rows_a.append(row(i * 10, list(ant), end=i * 10 + 3, system=[{"type": "text", "text": sysp}]))
        rows_o.append(row(i * 10, list(oai), end=i * 10 + 3))
        ant = ant + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "I should read a.py", "signature": "x"},
                                                       {"type": "tool_use", "id": f"t{i}", "name": "read", "input": {"path": "a.py"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": big}]}]
        oai = oai + [{"role": "assistant", "content": "I should read a.py", "tool_calls": [
            {"id": f"t{i}", "type": "function", "function": {"name": "read", "arguments": "{\"path\":\"a.py\"}"}}]},
            {"role": "tool", "tool_call_id": f"t{i}", "content": big}]
    ra, _ = conv(write(tmp_path / "anthropic.jsonl", rows_a))
    ro, _ = conv(write(tmp_path / "oai.jsonl", rows_o))
    tok = load_tokenizer("sim")
    assert ra["s:0"].input_tokens == ro["s:0"].input_tokens == len(tok.apply_chat_template(oai[:2], None))
    for i in (1, 2):  # the tool input and result count (the shapes differ by a few tokens of markup)
        assert abs(ra[f"s:{i}"].input_tokens - ro[f"s:{i}"].input_tokens) <= 0.1 * ro[f"s:{i}"].input_tokens
        assert ra[f"s:{i}"].branch == "s:main" and ra[f"s:{i}"].after == [f"s:{i - 1}"]


def test_identical_one_shot_prompts_without_session_are_separate_agents(tmp_path: Path) -> None:
    """A benchmark through a proxy sent the same prompt 6 times: one serial agent of 6 requests."""
    rows = [row(i, [SYS, u("What is 2+2?")], session=None, end=i + 0.5) for i in range(6)]
    rows.append(row(7, [SYS, u("What is 2+2?"), a("4"), u("and 3+3?")], session=None))
    reqs, meta = conv(write(tmp_path / "same.jsonl", rows))
    assert meta["counts"]["sessions"] == 6 and sorted(r.agent for r in reqs.values() if r.kind == "main") == [
        f"same.{i}" for i in range(1, 7)]
    assert reqs["same.6:1"].after == ["same.6:0"]  # the longer one continues (the latest of the equal ones)


def test_a_session_id_of_one_line_is_no_session(tmp_path: Path) -> None:
    """LiteLLM without litellm_session_id logs a random trace_id per call: a growing conversation was 3 agents."""
    m: list[Any] = [SYS, u("go")]
    rows = []
    for i in range(3):
        rows.append({"trace_id": str(uuid.UUID(int=i + 1)), "status": "success", "startTime": i * 10, "endTime": i * 10 + 2,
                     "messages": list(m), "completion_tokens": 5, "model": "m"})
        m = m + [a(f"r{i}"), u(f"u{i}")]
    rows.append(row(40, [SYS, u("alone")], session="solo"))
    reqs, meta = conv(write(tmp_path / "litellm.jsonl", rows))
    first = str(uuid.UUID(int=1))
    assert sorted(reqs) == [f"{first}:0", f"{first}:1", f"{first}:2", "solo:0"] and meta["counts"]["sessions"] == 2
    assert reqs[f"{first}:2"].after == [f"{first}:1"] and reqs[f"{first}:2"].pause_s == 8.0


@pytest.mark.parametrize("kind", ["openai-chat", "mooncake"])
def test_a_deeply_nested_line_is_a_bad_row(tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """msgspec's RecursionError on `[` x 3000 killed the run."""
    good = (row(0, [SYS, u("go")]) if kind == "openai-chat"
            else {"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]})
    src = write(tmp_path / "deep.jsonl", [good, "{\"a\":" * 3000, "[" * 3000])
    reqs, meta = conv(src, kind)
    assert len(reqs) == 1 and meta["skipped"]["rows_count"] == 2
    assert "line 2: JSON nested too deeply" in capsys.readouterr().err
    with pytest.raises(ConvertError, match="line 2: JSON nested too deeply"):
        conv(src, kind, strict=True)


@pytest.mark.parametrize("kind", ["claude-code-weka", "mini-swe-agent"])
def test_a_deeply_nested_file_is_a_convert_error(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "deep.json"
    src.write_text("{\"a\":" * 3000)
    with pytest.raises(ConvertError, match="nested too deeply"):
        conv(src, kind, strict=True)


def test_a_sub_agent_without_agent_id_is_no_compaction(tmp_path: Path) -> None:
    """The common sub-agent (same system prompt, no agent_id, after main's answer, shorter) was called a
    compaction; without end times too."""
    m1 = [SYS, u("task " + "details " * 50)]
    m2 = [*m1, a("let me look"), {"role": "tool", "tool_call_id": "c", "content": "x " * 100}]
    m3 = [*m2, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "T", "type": "function", "function": {"name": "Task", "arguments": "{}"}}]}]
    s1 = [SYS, u("sub task: find the file")]
    rows = [row(0, m1, end=2), row(3, m2, end=5), row(6, s1, end=7),
            row(8, [*s1, a("ls"), {"role": "tool", "tool_call_id": "q", "content": "a b"}], end=9),
            row(10, [*m3, {"role": "tool", "tool_call_id": "T", "content": "found it"}], end=12)]
    reqs, meta = conv(write(tmp_path / "subnoid.jsonl", rows))  # look-ahead: main later extends m2
    assert reqs["s:2"].kind == "subagent" and reqs["s:2"].parent_branch == "s:main" and meta["counts"]["compactions"] == 0
    assert reqs["s:4"].branch == "s:main" and reqs["s:4"].after == ["s:1", "s:3"]
    m1 = [SYS, u("task " + "x " * 40)]
    reqs, meta = conv(write(tmp_path / "noend.jsonl", [row(0, m1), row(0.2, [SYS, u("subtask")]), row(3, [*m1, a("r"), u("t")])]))
    assert reqs["s:1"].kind == "subagent" and meta["counts"]["compactions"] == 0  # no end time: no compaction
    # a real one: after the logged answer, and the history is never extended again
    reqs, meta = conv(write(tmp_path / "comp.jsonl", [row(0, m1, end=1), row(3, [SYS, u("summary")], end=4),
                                                      row(5, [SYS, u("summary"), a("ok"), u("go on")])]))
    assert reqs["s:1"].compaction and reqs["s:1"].branch == "s:main" and meta["counts"]["compactions"] == 1


@pytest.mark.parametrize("bad", [1e30, 3.5, 2**31 + 1, -1])
def test_a_completion_count_not_an_integer_up_to_2_31_is_a_bad_row(tmp_path: Path, bad: float,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    r = row(1, [SYS, u("q")])
    r["usage"] = {"completion_tokens": bad}
    reqs, meta = conv(write(tmp_path / "n.jsonl", [row(0, [SYS, u("q")], usage={"completion_tokens": 7.0}), r]))
    assert list(reqs) == ["s:0"] and reqs["s:0"].output_tokens == 7 and meta["skipped"]["rows_count"] == 1
    assert "is not an integer in 0..2**31" in capsys.readouterr().err


def test_session_keys_of_the_stored_body_count(tmp_path: Path) -> None:
    """OpenAI's `user` and `metadata.session_id` are request-body fields: a proxy log keeps them in `request`."""
    rows = []
    m: list[Any] = [SYS, u("go")]
    for i in range(3):
        rows.append({"timestamp": i * 10, "request": {"model": "m", "messages": list(m), "metadata": {"session_id": "S1"}},
                     "response": {"usage": {"completion_tokens": 4}}})
        rows.append({"timestamp": i * 10 + 1, "request": {"model": "m", "messages": list(m), "user": "bob"},
                     "response": {"usage": {"completion_tokens": 4}}})
        m = m + [a(f"r{i}"), u(f"u{i}")]
    reqs, meta = conv(write(tmp_path / "body.jsonl", rows))
    assert sorted(reqs) == ["S1:0", "S1:1", "S1:2", "bob:0", "bob:1", "bob:2"] and meta["counts"]["sessions"] == 2


def test_branch_headers_without_session_across_rotated_files_are_one_session(tmp_path: Path) -> None:
    m1 = [SYS, u("task")]
    m2 = [*m1, a("r1"), u("t1")]
    hdr = {"X-Branch-Id": "main"}
    d1 = write(tmp_path / "day1.jsonl", [row(0, m1, session=None, headers=hdr), row(5, m2, session=None, headers=hdr)])
    d2 = write(tmp_path / "day2.jsonl", [row(9, [*m2, a("r2"), u("t2")], session=None, headers=hdr)])
    for files in ([d1, d2], [d2, d1]):
        reqs, meta = conv(files)
        assert sorted(reqs) == ["day1:0", "day1:1", "day1:2"] and reqs["day1:2"].after == ["day1:1"]
        assert meta["counts"]["sessions"] == 1


def test_ties_in_send_time_do_not_depend_on_the_input_order(tmp_path: Path) -> None:
    A = write(tmp_path / "a.jsonl", [row(100, [SYS, u("q1")], session=None),
                                     row(101, [SYS, u("q1"), a("r"), u("more")], session=None)])
    B = write(tmp_path / "b.jsonl", [row(100, [SYS, u("q1")], session=None)])
    ab, _ = conv([A, B])
    ba, _ = conv([B, A])
    assert ab == ba


def test_placed_lines_drop_their_messages(tmp_path: Path) -> None:
    from collections import Counter

    import evolving_infra.traces.convert.openai_chat as oc
    from evolving_infra.traces.convert.common import Skipped

    src = write(tmp_path / "m.jsonl", [row(i, [SYS, u(f"q{i}")], session=None) for i in range(3)])
    lines: list[Any] = []
    oc._read_file(src, 0, Counter(), Skipped(False), lines, "m")
    reqs, _ = oc._convert_lines(lines, load_tokenizer("sim"), BS, Counter(), Skipped(False))
    assert len(reqs) == 3 and not any(hasattr(ln, "raw") or hasattr(ln, "ph") for ln in lines)


def test_a_system_prompt_with_a_clock_keeps_the_branch(tmp_path: Path) -> None:
    """The current time in the system prompt made every turn a parallel sub-agent."""
    rows = []
    m: list[Any] = [u("fix the bug")]
    for i in range(4):
        s = {"role": "system", "content": f"You are an agent. Current time: 2026-12-06 10:0{i}:00. " + "rule " * 80}
        rows.append(row(i * 10, [s, *m], end=i * 10 + 3))
        m = m + [a(f"step {i}"), {"role": "tool", "tool_call_id": "x", "content": f"result {i}"}]
    rows.append(row(50, [SYS, u("another task")], end=51))  # only the system prompt in common: a sub-agent
    reqs, meta = conv(write(tmp_path / "sysclock.jsonl", rows))
    assert [reqs[f"s:{i}"].branch for i in range(4)] == ["s:main"] * 4
    assert [reqs[f"s:{i}"].after for i in range(1, 4)] == [["s:0"], ["s:1"], ["s:2"]]
    assert meta["counts"]["system_prompt_changed"] == 3 and reqs["s:4"].kind == "subagent"
