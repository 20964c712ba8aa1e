"""Tool calls in chat replies (``--enable-auto-tool-choice --tool-call-parser hermes``, vLLM's flags), through the
real router over a real nats-server with the fake cluster of ``test_router_live`` scripted to write a Hermes call
(the ids of the text in a real byte-level BPE tokenizer): ``message.tool_calls`` / ``delta.tool_calls``,
``finish_reason`` ``tool_calls``; and vLLM's 400 for ``auto`` without the flags."""

from __future__ import annotations

import json

import pytest

from shared.tokenizer import load_tokenizer
from tests.integration.test_router_live import router_env, sse_events

pytest.importorskip("tokenizers")

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
SAID = "I will look it up.\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _folder(tmp_path):
    from tests.unit.router.helpers import write_bpe_tokenizer

    return write_bpe_tokenizer(tmp_path / "tok")


async def _chat(env, body: dict) -> tuple[int, dict]:
    """(status, the answer) of a chat request; a stream's chunks folded into one choice as a client does."""
    r = await env.http.post("/v1/chat/completions", json=body)
    if r.status_code != 200 or not body.get("stream"):
        return r.status_code, r.json()
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    content, calls, finish, usage = "", [], None, None
    for e in events:
        usage = e.get("usage") or usage
        for ch in e["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            calls += d.get("tool_calls", [])
            finish = ch["finish_reason"] or finish
    return 200, {"content": content, "deltas": calls, "finish_reason": finish, "usage": usage, "events": events}


async def test_a_hermes_call_is_answered_as_tool_calls_streamed_or_not(nats_url, tmp_path):
    folder = _folder(tmp_path)
    tok = load_tokenizer(f"hf:{folder}")
    ids = tok.encode(SAID + CALL, add_special_tokens=False)
    assert tok.decode(ids) == SAID + CALL  # the fake node writes exactly this text
    flags = {"tokenizer": f"hf:{folder}", "enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    async with router_env(nats_url, tmp_path, {"c0": "both"}, **flags) as env:
        env.cluster.script = ids
        # tools without tool_choice are "auto" (vLLM), as is tool_choice "auto"
        for extra in ({}, {"tool_choice": "auto"}):
            status, body = await _chat(env, {"messages": USER, "tools": TOOLS, "max_tokens": 200, **extra})
            assert status == 200, body
            choice = body["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and choice["stop_reason"] is None, choice
            msg = choice["message"]
            assert msg["role"] == "assistant" and msg["content"] == SAID
            (call,) = msg["tool_calls"]
            assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
            assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
            assert body["usage"]["completion_tokens"] == len(ids)  # usage unaffected
        # streamed: the text before the call as content, the call whole in one delta, then tool_calls
        status, got = await _chat(env, {"messages": USER, "tools": TOOLS, "max_tokens": 200, "stream": True,
                                        "stream_options": {"include_usage": True}})
        assert status == 200 and got["content"] == SAID and got["finish_reason"] == "tool_calls", got
        (delta,) = got["deltas"]
        assert delta["index"] == 0 and delta["type"] == "function" and delta["id"].startswith("chatcmpl-tool-")
        assert delta["function"]["name"] == "get_weather" and json.loads(delta["function"]["arguments"]) == {"city": "Paris"}
        assert got["usage"]["completion_tokens"] == len(ids)
        assert not any("<tool" in (ch["delta"].get("content") or "") for e in got["events"] for ch in e["choices"])
        # tool_choice none: the text as the model wrote it (vLLM)
        for stream in (False, True):
            status, body = await _chat(env, {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 200, "stream": stream})
            content = body["content"] if stream else body["choices"][0]["message"]["content"]
            finish = body["finish_reason"] if stream else body["choices"][0]["finish_reason"]
            assert status == 200 and content == SAID + CALL and finish == "stop", body
            assert (body["deltas"] if stream else body["choices"][0]["message"].get("tool_calls")) in ([], None)
        # tools [] with tool_choice "auto": nothing to call, text as written (vLLM parses only with tools sent)
        for stream in (False, True):
            status, body = await _chat(env, {"messages": USER, "tools": [], "tool_choice": "auto", "max_tokens": 200, "stream": stream})
            content = body["content"] if stream else body["choices"][0]["message"]["content"]
            finish = body["finish_reason"] if stream else body["choices"][0]["finish_reason"]
            assert status == 200 and content == SAID + CALL and finish == "stop", body
            assert (body["deltas"] if stream else body["choices"][0]["message"].get("tool_calls")) in ([], None)
        # cut by max_tokens inside the call: no call (its JSON is incomplete), the text as written, "length"
        cut = len(tok.encode(SAID + CALL[:30], add_special_tokens=False))
        for stream in (False, True):
            status, body = await _chat(env, {"messages": USER, "tools": TOOLS, "max_tokens": cut, "stream": stream})
            content = body["content"] if stream else body["choices"][0]["message"]["content"]
            finish = body["finish_reason"] if stream else body["choices"][0]["finish_reason"]
            assert status == 200 and finish == "length" and content == tok.decode(ids[:cut]), body
            assert (body["deltas"] if stream else body["choices"][0]["message"].get("tool_calls")) in ([], None)
        assert env.service.counters.get("http_status.500", 0) == 0


async def test_auto_without_the_flags_is_vllms_400(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        for extra in ({}, {"tool_choice": "auto"}):
            r = await env.http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 2, **extra})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "tool_choice"
            assert err["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        for extra in ({"tool_choice": "none"}, {"tool_choice": None}):
            r = await env.http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 2, **extra})
            assert r.status_code == 200, r.text
        r = await env.http.post("/v1/chat/completions", json={"messages": USER, "tool_choice": "auto", "max_tokens": 2})
        assert r.status_code == 400 and "`tools` must be set" in r.json()["error"]["message"], r.text
        assert not env.cluster.works[2:]  # the refused ones never reached a node


async def test_a_deeply_nested_call_is_text_and_any_error_in_a_streams_output_ends_it_as_a_router_error(
    nats_url, tmp_path, monkeypatch
):
    """A call body nested past the JSON decoder's recursion limit is not a call: the text as written, streamed or
    not (before: a 500 "internal error ... RecursionError", and a stream cut with no error event and no [DONE],
    its end counted as a client disconnect). And whatever raises in a stream's output path ends that stream with
    the API's 500 error event and [DONE], counted ``stream_errors_500``, not as a client's disconnect (``abort``)."""
    from services.router import toolcalls

    folder = _folder(tmp_path)
    tok = load_tokenizer(f"hf:{folder}")
    deep = "ok <tool_call>" + "[" * 1500 + "</tool_call> after"
    ids = tok.encode(deep, add_special_tokens=False)
    assert tok.decode(ids) == deep
    flags = {"tokenizer": f"hf:{folder}", "enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    async with router_env(nats_url, tmp_path, {"c0": "both"}, **flags) as env:
        env.cluster.script = ids
        for stream in (False, True):
            status, body = await _chat(env, {"messages": USER, "tools": TOOLS, "max_tokens": 4000, "stream": stream})
            content = body["content"] if stream else body["choices"][0]["message"]["content"]
            finish = body["finish_reason"] if stream else body["choices"][0]["finish_reason"]
            assert status == 200 and content == deep and finish == "stop", body
        assert env.service.counters.get("http_status.500", 0) == 0

        def broken(self, text):
            raise RuntimeError("a bug in the output path")

        monkeypatch.setattr(toolcalls.HermesStream, "push", broken)
        before = dict(env.service.counters)
        r = await env.http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 4000, "stream": True})
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]", events[-3:]
        err = events[-2]["error"]
        assert err["code"] == 500 and err["message"] == "internal error in the router: RuntimeError", err
        got = {k: v - before.get(k, 0) for k, v in env.service.counters.items() if v != before.get(k, 0)}
        # finished "error", also when its node's end came first (it was counted "stop" then: what the node said)
        assert got.get("stream_errors_500") == 1 and got.get("finish.error", 0) == 1 and "finished.stop" not in got, got
        assert "finish.abort" not in got and "aborts.client_disconnect" not in got, got


async def test_tool_call_tags_that_are_special_tokens_reach_the_parser_and_other_specials_stay_out(nats_url, tmp_path):
    """A tokenizer that marks ``<tool_call>`` / ``</tool_call>`` special (Hermes-2-Pro / Hermes-3 added them so): the
    output is decoded with special tokens skipped (vLLM's default), so the tags vanished before the parser and the
    call came back as bare JSON in ``content``. vLLM's hermes parser sets ``skip_special_tokens=False`` for a request
    it parses (PR #25281); here, for such a request, only the tags are kept: the other special tokens (``<|im_end|>``,
    the model's EOS, which a node sends as its last token) stay out of the text, streamed or not, as before.
    ``tool_choice`` ``none``: decoded as before, tags skipped (vLLM's parser does not touch that request)."""
    from tokenizers import Tokenizer

    folder = _folder(tmp_path)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    raw.add_special_tokens(["<tool_call>", "</tool_call>"])
    raw.save(str(folder / "tokenizer.json"))
    tok = load_tokenizer(f"hf:{folder}")
    ids = tok.encode(SAID + CALL + "<|im_end|>", add_special_tokens=False)
    assert len([i for i in ids if tok.decode([i]) == ""]) == 3  # the two tags and <|im_end|>: special, skipped by default
    assert tok.decode(ids, skip_special_tokens=False) == SAID + CALL + "<|im_end|>"
    flags = {"tokenizer": f"hf:{folder}", "enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    async with router_env(nats_url, tmp_path, {"c0": "both"}, **flags) as env:
        env.cluster.script = ids
        for stream in (False, True):
            for extra in ({}, {"stop": ["never"]}):  # without and with stop strings (the two decode paths)
                status, body = await _chat(env, {"messages": USER, "tools": TOOLS, "max_tokens": 200, "stream": stream, **extra})
                assert status == 200, body
                if stream:
                    content, calls, finish = body["content"], body["deltas"], body["finish_reason"]
                else:
                    msg = body["choices"][0]["message"]
                    content, calls, finish = msg["content"], msg.get("tool_calls") or [], body["choices"][0]["finish_reason"]
                assert content == SAID and finish == "tool_calls", (stream, extra, body)
                (call,) = calls
                assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        for stream in (False, True):
            status, body = await _chat(env, {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 200, "stream": stream})
            content = body["content"] if stream else body["choices"][0]["message"]["content"]
            assert status == 200 and content == tok.decode(ids) and "<tool_call>" not in content, body
