"""The Hermes tool-call parser (services.router.toolcalls): whole responses, streams split anywhere, the flags'
names and the finish reason."""

from __future__ import annotations

import json
import re
import time

import pytest

from services.router import toolcalls as tc

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
TWO = CALL + "\n" + '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def _shape(calls: list[tc.ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_one_call_alone_is_no_content_and_json_arguments() -> None:
    content, calls = tc.extract(CALL)
    assert content is None
    assert _shape(calls) == [("get_weather", {"city": "Paris", "unit": "°C"})]
    assert calls[0].arguments == '{"city": "Paris", "unit": "°C"}'  # json.dumps, non-ASCII kept (vLLM)
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", calls[0].id)
    assert calls[0].message() == {"id": calls[0].id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": calls[0].arguments}}
    assert calls[0].delta(3) == {"index": 3, **calls[0].message()}


def test_text_before_between_and_after_calls() -> None:
    content, calls = tc.extract("Let me check.\n" + TWO + "\n\nDone.")
    assert content == "Let me check.\nDone."  # the whitespace right after each call dropped; the rest kept
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert calls[0].id != calls[1].id
    assert tc.extract(TWO + "\n  \n")[0] is None


def test_no_call_leaves_the_text_exactly() -> None:
    for text in ("", "plain", "a <tool_ca b", "<tool_call", "x </tool_call> y", "<tool_call>{not json}</tool_call>\n"):
        assert tc.extract(text) == (text, [])


def test_a_body_that_is_no_call_stays_text_as_written() -> None:
    bad = '<tool_call>\n{"name": "f", "arguments": {</tool_call>'
    content, calls = tc.extract("a " + bad + "\n" + CALL + " b")
    assert content == "a " + bad + "\n" + "b"
    assert [c.name for c in calls] == ["get_weather"]
    for body in ('[1]', '{"arguments": {}}', '{"name": ""}', '{"name": 3}', '"x"', "{'name': 'f'}"):
        assert tc.parse_body(body) is None, body
    assert tc.parse_body(' {"name": "f", "arguments": {}} ').arguments == "{}"  # type: ignore[union-attr]
    assert tc.parse_body('{"name": "f", "arguments": "{\\"a\\": 1}"}').arguments == '"{\\"a\\": 1}"'  # type: ignore[union-attr]


def test_a_body_without_arguments_is_text_as_vllms() -> None:
    """vLLM's whole-response hermes parser reads ``call["arguments"]``: a body without that key (a model that wrote
    ``parameters``, or none) is a KeyError there and the text stays content. Before, it became a call with
    ``arguments`` ``{}``: the model's parameters silently dropped."""
    for body in ('{"name": "f", "parameters": {"a": 1}}', '{"name": "f"}'):
        assert tc.parse_body(body) is None, body
        text = "<tool_call>" + body + "</tool_call>"
        assert tc.extract(text) == (text, [])
    assert tc.parse_body('{"name": "f", "arguments": null}').arguments == "null"  # type: ignore[union-attr]


def test_a_deeply_nested_body_is_text_not_an_error() -> None:
    """json.loads raises RecursionError (not a ValueError) at ~1,000 nesting levels: before, it escaped parse_body
    (a 500 "internal error", or a stream cut without an error event); vLLM catches it and keeps the text."""
    for body in ("[" * 1500, "[" * 100_000, '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"):
        assert tc.parse_body(body) is None
        text = "ok <tool_call>" + body + "</tool_call> after"
        assert tc.extract(text) == (text, [])
        assert "".join(t for t, _ in _streamed([text[:20], text[20:]])[2]) == text


def test_a_long_call_streamed_in_small_pieces_costs_linear_time() -> None:
    """A call's body held across many pushes is searched only where the closing tag may be: before, each push
    joined and searched the whole body again, 17.9 s of CPU (on the router's event loop) for a 100k-token call in
    4-character pieces; the bound here is ~100x what the linear parser takes and ~1/6 of what that took."""
    body = json.dumps({"name": "write_file", "arguments": {"path": "a.py", "content": "x = 1\n" * 66_000}})
    text = "<tool_call>\n" + body + "\n</tool_call>"
    p = tc.HermesStream()
    t0 = time.process_time()
    outs = [p.push(text[i:i + 4]) for i in range(0, len(text), 4)] + [p.finish()]
    spent = time.process_time() - t0
    content, calls = "".join(t for t, _ in outs), [c for _, cs in outs for c in cs]
    assert content == "" and [c.name for c in calls] == ["write_file"]
    assert json.loads(calls[0].arguments)["content"] == "x = 1\n" * 66_000
    assert spent < 3.0, spent


def test_an_unclosed_call_at_the_end_is_parsed() -> None:
    content, calls = tc.extract('ok <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert content == "ok " and _shape(calls) == [("f", {"x": 1})]
    assert tc.extract('<tool_call>{"name": "f", "argu') == ('<tool_call>{"name": "f", "argu', [])


def _streamed(pieces: list[str]) -> tuple[str, list[tc.ToolCall], list[tuple[str, list[tc.ToolCall]]]]:
    p = tc.HermesStream()
    outs = [p.push(x) for x in pieces] + [p.finish()]
    assert p.calls == sum(len(c) for _, c in outs)
    return "".join(t for t, _ in outs), [c for _, cs in outs for c in cs], outs


TEXTS = [
    "Let me check.\n" + TWO + "\n\nDone.",
    "a <tool_call>\n{\"name\": \"f\", \"arguments\": {</tool_call>\n" + CALL + " b",
    "x < y <tool_ and <tool_call> too" ,
    'pre <tool_call>{"name": "f", "arguments": {"s": "</tool"}}',
    "no calls at all, <b>bold</b>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_split_at_every_position_gives_the_whole_response(text: str) -> None:
    want_content, want_calls = tc.extract(text)
    for i in range(len(text) + 1):
        for pieces in ([text[:i], text[i:]], [text[:i], text[i:i + 3], text[i + 3:]]):
            content, calls, _ = _streamed(pieces)
            assert (content or None if want_calls else content) == want_content, (i, pieces)
            assert _shape(calls) == _shape(want_calls), (i, pieces)
    content, calls, _ = _streamed(list(text))  # one character at a time
    assert (content or None if want_calls else content) == want_content
    assert _shape(calls) == _shape(want_calls)


def test_a_stream_sends_text_at_once_and_holds_only_a_possible_tag() -> None:
    p = tc.HermesStream()
    assert p.push("Let me") == ("Let me", [])
    assert p.push(" check <tool") == (" check ", [])  # "<tool" may start <tool_call>
    assert p.push("box> ok") == ("<toolbox> ok", [])  # it did not
    assert p.push("<tool_call>\n{\"name\": \"f\",") == ("", [])  # inside a call: held
    text, calls = p.push(' "arguments": {"a": 1}}\n</tool_call>\n')
    assert text == "" and _shape(calls) == [("f", {"a": 1})] and p.calls == 1
    assert p.push("\n") == ("", [])  # whitespace after a call: dropped
    assert p.push(" more") == ("more", [])
    assert p.finish() == ("", [])


def test_finish_reason_tool_calls_only_when_the_model_stopped() -> None:
    assert tc.finish_reason("stop", 1) == "tool_calls"
    assert tc.finish_reason("stop", 0) == "stop"
    assert tc.finish_reason("length", 2) == "length"  # cut: the calls may be incomplete (vLLM says tool_calls)
    assert tc.finish_reason(None, 1) is None


def test_check_parser_names_the_known_ones() -> None:
    tc.check_parser("")
    tc.check_parser("hermes")
    with pytest.raises(ValueError, match=r"--tool-call-parser 'qwen3_xml' is not known; known: hermes"):
        tc.check_parser("qwen3_xml")


def test_keep_tags_only_for_a_tokenizer_that_marks_a_tag_special(tmp_path) -> None:
    """``keep_tags``: None for the sim tokenizer, one without ``special_tokens``, and a real one whose tags are plain
    text or absent (Qwen2.5's added tokens are not special); a view when a tag is special, whose decode leaves out
    the other special tokens only (and shows all with ``skip_special_tokens=False``)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from shared.tokenizer import SimTokenizer, load_tokenizer
    from tests.unit.router.helpers import write_bpe_tokenizer

    assert tc.keep_tags(SimTokenizer()) is None and tc.keep_tags(object()) is None
    folder = write_bpe_tokenizer(tmp_path / "tok")
    assert tc.keep_tags(load_tokenizer(f"hf:{folder}")) is None  # no tags at all
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    raw.add_tokens(["<tool_call>", "</tool_call>"])  # plain added tokens, as Qwen2.5's
    raw.save(str(folder / "tokenizer.json"))
    tok = load_tokenizer(f"hf:{folder}")
    assert tc.keep_tags(tok) is None
    text = '<|im_start|>x<tool_call>{"name": "f", "arguments": {}}</tool_call><|im_end|>'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == 'x<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    raw.add_special_tokens(["<tool_call>", "</tool_call>"])
    raw.save(str(folder / "tokenizer.json"))
    tok = load_tokenizer(f"hf:{folder}")
    view = tc.keep_tags(tok)
    assert view is not None and view.vocab_size == tok.vocab_size
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == 'x{"name": "f", "arguments": {}}'  # the usual decode loses the tags
    assert view.decode(ids) == 'x<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert view.decode(ids, skip_special_tokens=False) == text
