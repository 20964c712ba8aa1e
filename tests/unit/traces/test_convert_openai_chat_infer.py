"""`trace convert --from openai-chat`: the cases of the review of the converter (session 52) —
a chat template's raise_exception, LiteLLM's real StandardLoggingPayload, concurrent
sub-agents, logs without session ids, ``cache_control`` moved every turn, rotated files,
non-finite and millisecond times, ``session_id: 0`` — and the placement's cost being linear."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from evolving_infra.traces.convert import ConvertError
from evolving_infra.traces.tokens import chained_prefix_len
from shared.tokenizer import load_tokenizer
from tests.unit.traces.openai_chat_log import SYS, a, conv, row, u, write

def test_a_templates_raise_exception_skips_its_line_and_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model's template raising (roles must alternate) killed the whole batch with a traceback."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    vocab = {"[UNK]": 0, **{chr(97 + i): i + 1 for i in range(26)}}
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
    tpl = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
           "{% endif %}{{ m['role'] }} {{ m['content'] }} {% endfor %}")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    src = write(tmp_path / "tpl.jsonl", [row(0, [u("a b c")]), row(1, [u("a b c"), u("d")]),
                                         row(2, [u("a b c"), a("d"), u("e")])])
    reqs, meta = conv(src, tokenizer=f"hf:{tmp_path / 'tok'}")
    assert sorted(reqs) == ["s:0", "s:1"] and meta["skipped"]["rows_count"] == 1
    assert "line 2: the chat template cannot render the messages: TemplateError: Conversation roles must alternate" \
        in capsys.readouterr().err
    with pytest.raises(ConvertError, match="tpl.jsonl: line 2: the chat template cannot render"):
        conv(src, tokenizer=f"hf:{tmp_path / 'tok'}", strict=True)


def litellm(t: float, sess: str, msgs: list[Any], out: int = 10, status: str = "success", **kw: object) -> dict[str, object]:
    """LiteLLM's StandardLoggingPayload (litellm/types/utils.py): the session is ``trace_id`` (from
    ``litellm_session_id``), tools and max_tokens in ``model_parameters``, the user in ``end_user``."""
    return {"id": f"call-{t}", "trace_id": sess, "call_type": "acompletion", "stream": False, "status": status,
            "startTime": t, "endTime": t + 1, "completionStartTime": t + 0.5, "model": "m", "messages": msgs,
            "response": {"usage": {"prompt_tokens": 5, "completion_tokens": out}} if status == "success" else None,
            "prompt_tokens": 5, "completion_tokens": out, "total_tokens": out + 5, "end_user": "",
            "metadata": {"user_api_key_hash": "h"}, "error_str": None if status == "success" else "429 rate limited",
            "model_parameters": {"tools": TOOLS, "max_tokens": 100}, **kw}


TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def test_litellms_standard_logging_payload(tmp_path: Path) -> None:
    ma = [SYS, u("task A")]
    mb = [SYS, u("task B")]
    mb2 = [*mb, a("ok"), u("go on B")]
    rows = [litellm(0, "sessA", ma), litellm(1, "sessB", mb), litellm(4, "sessA", [*ma, a("ok"), u("go on A")], status="failure", out=0),
            litellm(5, "sessA", [*ma, a("ok"), u("go on A")]), litellm(6, "sessB", mb2)]
    p = litellm(7, "", [*mb2, a("ok"), u("more")], end_user="bob")
    del p["completion_tokens"], p["response"]  # no usage: the request's max_tokens in model_parameters
    rows.append(p)
    reqs, meta = conv(write(tmp_path / "litellm.jsonl", rows))
    tok = load_tokenizer("sim")
    assert sorted(reqs) == ["bob:0", "sessA:0", "sessA:1", "sessB:0", "sessB:1"]
    assert reqs["sessA:0"].input_tokens == len(tok.apply_chat_template(ma, TOOLS))  # tools from model_parameters
    assert reqs["sessA:1"].after == ["sessA:0"] and reqs["sessA:1"].pause_s == 4.0  # the failed call is no request
    assert reqs["sessB:1"].after == ["sessB:0"] and not reqs["sessB:1"].compaction
    assert reqs["bob:0"].output_tokens == 100  # max_tokens of model_parameters
    assert meta["counts"]["failed_calls_skipped"] == 1 and meta["counts"]["output_tokens_from_max_tokens"] == 1
    assert meta["counts"]["sessions"] == 3 and not meta["skipped"].get("rows_count")


@pytest.mark.parametrize("callers", [("sub1", "sub2"), ("sub", "sub"), (None, None)])
def test_two_sub_agents_at_once_are_children_of_main_and_main_joins_both(tmp_path: Path, callers: tuple[Any, Any]) -> None:
    """The second sub-agent took the first's branch as parent (or, sharing the caller, was called its compaction)."""
    m1 = [SYS, u("task")]
    s1, s2 = [SYS, u("sub one")], [SYS, u("sub two")]
    kw1 = {"agent_id": callers[0]} if callers[0] else {}
    kw2 = {"agent_id": callers[1]} if callers[1] else {}
    rows = [row(0, m1, end_time=1), row(2, s1, **kw1), row(2.1, s2, **kw2), row(4, [*s1, a("x"), u("y")], **kw1),
            row(4.1, [*s2, a("x"), u("y")], **kw2), row(8, [*m1, a("spawn two"), u("results?")])]
    reqs, meta = conv(write(tmp_path / "twosub.jsonl", rows))
    r = [reqs[f"s:{i}"] for i in range(6)]
    assert [q.kind for q in r] == ["main", "subagent", "subagent", None, None, None]
    assert r[1].parent_branch == r[2].parent_branch == "s:main" and r[1].branch != r[2].branch
    assert r[1].after == r[2].after == ["s:0"] and r[3].branch == r[1].branch and r[4].branch == r[2].branch
    assert r[5].branch == "s:main" and r[5].after == ["s:0", "s:3", "s:4"]  # main resumes after both
    assert meta["counts"]["compactions"] == 0


def test_a_compaction_is_shorter_and_after_the_answer(tmp_path: Path) -> None:
    m1 = [SYS, u("task " * 30)]
    m2 = [*m1, a("done " * 30), u("next " * 30)]
    summary = [SYS, u("summary: the task is done")]
    # sent while m2 was still being answered: a sub-agent, not a compaction
    rows = [row(0, m1, end_time=1), row(2, m2, end_time=10), row(5, summary), row(12, [SYS, u("summary: all done")])]
    reqs, meta = conv(write(tmp_path / "c.jsonl", rows))
    assert reqs["s:2"].kind == "subagent" and not reqs["s:2"].compaction
    assert reqs["s:3"].compaction and reqs["s:3"].branch == "s:main" and reqs["s:3"].after == ["s:1", "s:2"]
    assert meta["counts"]["compactions"] == 1


def test_a_log_without_session_ids_has_an_agent_per_conversation(tmp_path: Path) -> None:
    """4,000 separate chats became one agent with 3,999 compactions in one serial chain."""
    rows = [row(i * 0.1, [SYS, u(f"question number {i} about things")], session=None) for i in range(50)]
    q = [SYS, u("question number 7 about things")]
    rows += [row(10, [*q, a("answer"), u("and more?")], session=None),  # continues chat 7
             row(11, [*q, a("other answer"), u("why?")], session=None),  # a fork of chat 7 after its first request
             row(12, [SYS, u("question number 7 about things"), a("answer"), u("and more?"), a("x"), u("y")], session=None)]
    reqs, meta = conv(write(tmp_path / "proxy.jsonl", rows))
    assert meta["counts"]["sessions"] == 50 and meta["counts"]["compactions"] == 0
    assert {r.agent for r in reqs.values()} == {f"proxy.{i}" for i in range(1, 51)}
    c7 = sorted((r for r in reqs.values() if r.agent == "proxy.8"), key=lambda r: r.id)
    assert [(r.kind, r.after) for r in c7] == [("main", []), (None, ["proxy.8:0"]), ("fork", ["proxy.8:0"]),
                                               (None, ["proxy.8:1", "proxy.8:2"])]
    assert c7[2].parent_branch == "proxy.8:main" and c7[3].branch == "proxy.8:main"  # (joins the fork: §7.5)


def test_cache_control_moved_every_turn_is_no_compaction(tmp_path: Path) -> None:
    """Cline / Roo Code mark the last user message's part with cache_control; the template never renders it."""
    users = ["task one", "result one", "result two", "result three"]
    rows = []
    for i in range(len(users)):
        msgs: list[Any] = [SYS]
        for j in range(i + 1):
            part: dict[str, Any] = {"type": "text", "text": users[j]}
            if j == i:
                part["cache_control"] = {"type": "ephemeral"}
            msgs.append({"role": "user", "content": [part]})
            if j < i:
                msgs.append(a(f"reply {j}"))
        rows.append(row(i * 10, msgs))
    reqs, meta = conv(write(tmp_path / "cachectl.jsonl", rows))
    r = [reqs[f"s:{i}"] for i in range(4)]
    assert meta["counts"]["compactions"] == 0 and [q.branch for q in r] == ["s:main"] * 4
    assert [q.after for q in r[1:]] == [["s:0"], ["s:1"], ["s:2"]]
    # the tokens differ only after the previous request's messages: reuse = all but the partial last block
    assert all(chained_prefix_len(r[i - 1].blocks, r[i].blocks) >= len(r[i - 1].blocks) - 1 for i in range(1, 4))


def test_a_session_across_rotated_files_stays_one_agent(tmp_path: Path) -> None:
    m1 = [SYS, u("task")]
    m2 = [*m1, a("r1"), u("t1")]
    d1 = write(tmp_path / "day1.jsonl", [row(0, m1), row(5, m2)])
    d2 = write(tmp_path / "day2.jsonl", [row(9, [*m2, a("r2"), u("t2")])])
    reqs, meta = conv([d2, d1])  # in any order
    assert sorted(reqs) == ["s:0", "s:1", "s:2"] and reqs["s:2"].after == ["s:1"] and reqs["s:2"].branch == "s:main"
    assert meta["counts"]["sessions"] == 1 and "sessions_renamed_duplicate_id" not in meta["counts"]


def test_non_finite_times_are_bad_rows_and_milliseconds_are_warned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m1 = [SYS, u("task")]
    rows = [row(0, m1), row("nan", [*m1, a("x"), u("y")]), '{"timestamp": Infinity, "session_id": "s", "messages": []}',
            row(3, [*m1, a("x"), u("z")], end_time="inf"), row(1733475610000, m1, session="ms"), row(0, m1, session=0)]
    reqs, meta = conv(write(tmp_path / "nan.jsonl", rows))
    err = capsys.readouterr().err
    assert "line 2: send time 'nan' is not a finite time" in err and "line 4: end time 'inf' is not a finite time" in err
    assert meta["skipped"]["rows_count"] == 3 and "1 send time(s) are over 1e11 s" in err
    assert {r.agent for r in reqs.values()} == {"s", "ms", "0"}  # session_id 0 is an id


def test_placement_is_linear_in_the_log(tmp_path: Path) -> None:
    """Each request was compared with every branch and request before it (4,000 flat chats 2.1 s, 16,000: 61 s)."""
    import evolving_infra.traces.convert.openai_chat as oc

    rows = [row(i * 0.01, [SYS, u(f"q {i}")], session=None) for i in range(2000)]
    rows += [row(100 + i, [SYS, *[u(f"m {j}") for j in range(i + 1)]], session="long") for i in range(100)]
    src = write(tmp_path / "flat.jsonl", rows)
    lookups = {"n": 0}

    class CountingDict(dict):  # type: ignore[type-arg]
        def get(self, *args: Any) -> Any:
            lookups["n"] += 1
            return super().get(*args)

    mp = pytest.MonkeyPatch()
    try:
        orig_init = oc._Session.__init__

        def init(self: Any, agent: str) -> None:
            orig_init(self, agent)
            self.by_last, self.by_req = CountingDict(), CountingDict()

        mp.setattr(oc._Session, "__init__", init)
        reqs, meta = conv(src)
    finally:
        mp.undo()
    assert len(reqs) == 2100 and meta["counts"]["sessions"] == 2001
    # one lookup per message of each request (twice: continuation, fork), not per earlier request
    n_msgs = 2 * 2000 + sum(i + 2 for i in range(100))
    assert lookups["n"] <= 2 * n_msgs
