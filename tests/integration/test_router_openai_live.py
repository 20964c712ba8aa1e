"""The router's HTTP API as an OpenAI / vLLM client uses it: nullable fields, the model context,
405 / model retrieval, and the error's ``param``.

Real router (in-process uvicorn on a free port) over a real nats-server, with the fake cluster
of ``test_router_live`` answering on the bus (its engine always produces ``max_tokens`` tokens).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from shared.tokenizer import SimTokenizer, load_tokenizer
from tests.integration.test_router_live import _wait_for, output_token, router_env, sse_events

USER = [{"role": "user", "content": "hello there"}]


async def test_explicit_nulls_are_defaults_as_in_vllm(nats_url, tmp_path):
    """``"stream": null``, ``"n": null``, ``"logprobs": null``, ``"stream_options": {"include_usage": null}``:
    OpenAI's spec marks them nullable and vLLM serves them; they were a 400."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        r = await env.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": None, "n": None, "logprobs": None})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "echo": None, "n": None, "stream": None})
        assert r.status_code == 200, r.text
        body = {"messages": USER, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": None}}
        r = await env.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])  # no usage chunk: null is false


async def test_the_model_context_limits_the_default_max_tokens_not_the_request(nats_url, tmp_path):
    """With a model context (``--max-context-tokens``, the torch engine's), a request that leaves ``max_tokens``
    unset gets the rest of the context (at most the default), as vLLM; it was a 400 blaming ``max_tokens``
    it never sent. Asked-for tokens beyond the context, or a prompt that fills it, are a 400 with OpenAI's /
    vLLM's "maximum context length" message (clients such as litellm detect context overflow by it)
    naming in ``param`` the field sent (``max_tokens`` / ``max_completion_tokens``) or the part to shorten."""
    ctx = 100
    async with router_env(nats_url, tmp_path, {"c0": "both"}, max_context_tokens=ctx, chat_default_max_tokens=256) as env:
        prompt = list(range(1, 91))  # 90 tokens: 10 left; the completions default is 16
        r = await env.http.post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["usage"] == {"prompt_tokens": 90, "completion_tokens": 10, "total_tokens": 100, "prompt_tokens_details": {"cached_tokens": 0}}
        assert b["choices"][0]["finish_reason"] == "length"
        assert env.cluster.works[-1].max_tokens == 10
        chat_tokens = len(SimTokenizer().apply_chat_template(USER))
        r = await env.http.post("/v1/chat/completions", json={"messages": USER})  # default 256 > the context left
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == ctx - chat_tokens
        # asked for more than fits: 400 naming the field sent (max_completion_tokens was named max_tokens)
        for path, body, asked, field in (
            ("/v1/completions", {"prompt": prompt, "max_tokens": 11}, 11, "max_tokens"),
            ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": ctx}, ctx, "max_completion_tokens"),
        ):
            r = await env.http.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and err["type"] == "invalid_request_error"
            assert err["message"].startswith(f"This model's maximum context length is {ctx} tokens."), err
            assert f"{asked} in the completion" in err["message"]
        # the prompt alone fills the context: 400 naming the prompt / the messages, with or without max_tokens, in
        # vLLM's words (without max_tokens it said "you requested 116 tokens (100 in the prompt, 16 in the completion)")
        for body in ({"prompt": list(range(1, ctx + 1))}, {"prompt": list(range(1, ctx + 1)), "max_tokens": 1}):
            r = await env.http.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert r.json()["error"]["message"] == (f"This model's maximum context length is {ctx} tokens. However, your request has "
                                                    f"{ctx} input tokens. Please reduce the length of the input messages.")
        long_chat = [{"role": "user", "content": "word " * ctx}]
        r = await env.http.post("/v1/chat/completions", json={"messages": long_chat})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "maximum context length" in r.json()["error"]["message"]
        # no max_tokens sent: the message counts the messages only, as vLLM's does; it said "(N in the messages,
        # 256 in the completion). Please reduce the length of the messages or completion" (session 42)
        n = len(SimTokenizer().apply_chat_template(long_chat))
        assert f"However, your request has {n} input tokens." in r.json()["error"]["message"], r.text
        assert "in the completion" not in r.json()["error"]["message"], r.text
        # one token left: served with max_tokens 1
        r = await env.http.post("/v1/completions", json={"prompt": list(range(1, ctx)), "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert env.cluster.works[-1].max_tokens == 1
        assert env.service.counters.get("http_status.500", 0) == 0


async def test_405_carries_allow_and_a_model_is_retrievable(nats_url, tmp_path):
    """A 405 names the allowed methods (``Allow``, RFC 9110 §15.5.6); ``GET /v1/models/{id}`` (OpenAI's
    ``models.retrieve``, SGLang's) answers the served model, another id is a 404 naming ``model``."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, model="org/test-model") as env:
        r = await env.http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = await env.http.delete("/v1/models")
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
        r = await env.http.get("/v1/models/org/test-model")
        assert r.status_code == 200, r.text
        listed = (await env.http.get("/v1/models")).json()["data"][0]
        assert r.json() == listed and listed["id"] == "org/test-model" and listed["object"] == "model"
        r = await env.http.get("/v1/models/gpt-4")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
        assert "gpt-4" in r.json()["error"]["message"]


async def test_a_bad_field_is_named_in_the_errors_param(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        for body, param in (
            ({"messages": USER, "temperature": -1}, "temperature"),
            ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
            ({"messages": USER, "max_tokens": "8"}, "max_tokens"),
            ({}, "messages"),
        ):
            r = await env.http.post("/v1/chat/completions", content=msgspec.json.encode(body), headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert env.cluster.works == []


async def test_an_empty_model_name_is_the_served_model_as_in_vllm(nats_url, tmp_path):
    """vLLM's ``_is_model_supported``: an empty (or absent / null) ``model`` means the served model; it was a 404."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        for model in ("", None):
            r = await env.http.post("/v1/chat/completions", json={"model": model, "messages": USER, "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "test-model", r.text
        r = await env.http.post("/v1/completions", json={"model": "", "prompt": [1], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "test-model", r.text
        r = await env.http.post("/v1/completions", json={"model": "other", "prompt": [1], "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


async def test_an_unset_max_tokens_is_cut_to_the_output_limit_not_refused(nats_url, tmp_path):
    """A default max_tokens (chat's --chat-default-max-tokens, completions' 16) above
    --max-output-tokens is cut to that limit, like the context cut: it was a 400
    'max_tokens=256 exceeds the limit 100' blaming a field the client never sent. An asked-for
    max_tokens above the limit stays a 400."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, max_output_tokens=10, chat_default_max_tokens=256) as env:
        r = await env.http.post("/v1/chat/completions", json={"messages": USER})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 10 and env.cluster.works[-1].max_tokens == 10
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": None})
        assert r.status_code == 200 and env.cluster.works[-1].max_tokens == 10, r.text
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 11})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


async def test_min_tokens_above_the_max_tokens_a_request_gets_is_a_400(nats_url, tmp_path):
    """min_tokens is checked against the max_tokens the request gets (vLLM's SamplingParams check runs
    on its defaulted, context-cut max_tokens too): completions' default 16, a chat's default cut to
    --max-output-tokens, a default cut to the context. It was sent on, and the output ended (length)
    before its min_tokens."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, max_output_tokens=10, max_context_tokens=20) as env:
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "min_tokens": 11})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        r = await env.http.post("/v1/chat/completions", json={"messages": USER, "min_tokens": 11})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        r = await env.http.post("/v1/completions", json={"prompt": list(range(1, 16)), "min_tokens": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        r = await env.http.post("/v1/completions", json={"prompt": list(range(1, 16)), "min_tokens": 5})
        assert r.status_code == 200 and env.cluster.works[-1].max_tokens == 5, r.text
        assert env.cluster.works[-1].sampling.min_tokens == 5


async def test_logprobs_on_a_cluster_of_sim_engines_is_a_400(nats_url, tmp_path):
    """Every node reports the ``sim`` engine (``NodeState.engine``, the fake cluster's default): no node
    has logits, so asking for logprobs is the request's fault, a 400 naming ``logprobs`` before anything
    is dispatched (it was dispatched and came back as a 500 engine error from the sim node). The same
    request without logprobs is served."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        sent = len(env.cluster.works)
        for path, body in (
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}),
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logprobs": True}),
            ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "logprobs": 0}),
        ):
            r = await env.http.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "logprobs" and "sim engine" in err["message"], err
        assert len(env.cluster.works) == sent  # nothing dispatched
        r = await env.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "logprobs": False})
        assert r.status_code == 200, r.text


async def test_logit_bias_is_checked_and_refused_on_sim_engines_and_carried_to_torch_nodes(nats_url, tmp_path):
    """``logit_bias`` was accepted and dropped: ``{"abc": -100}``, ``{"99999": 5}``, ``{"284": -1000}`` got a
    200 and no node saw a bias. Now: a malformed key, an id outside the router's vocabulary (the sim
    tokenizer's here) or a value outside [-100, 100] is a 400 naming ``logit_bias``; on a cluster of sim
    engines (no logits) a well-formed one is a 400 too, nothing dispatched; once every node runs torch it
    reaches the nodes in ``Sampling.logit_bias`` as int ids."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        vocab = env.service.tokenizer.vocab_size
        sent = len(env.cluster.works)
        for bias, fragment in (
            ({"abc": -100}, "'abc' is not a token id"),
            ({str(vocab): 5}, f"token id {vocab} is outside the vocabulary [0, {vocab})"),
            ({"284": -1000}, "outside [-100, 100]"),
            ({"284": -100}, "sim engine"),
        ):
            for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": [1, 2]})):
                r = await env.http.post(path, json={**body, "max_tokens": 2, "logit_bias": bias})
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == "logit_bias" and fragment in err["message"], err
        assert len(env.cluster.works) == sent  # nothing dispatched
        env.cluster.engines = {"c0": "torch"}
        await env.cluster.publish_states()
        await _wait_for(lambda: env.service.core.view.engines() == {"torch"}, what="states applied")
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "logit_bias": {"284": -100, "3": 2}})
        assert r.status_code == 200, r.text
        assert env.cluster.works[-1].sampling.logit_bias == {284: -100.0, 3: 2.0}


def _ask(env, path: str, body: dict, stream: bool):
    """POST ``body`` (streamed or not); returns (status, text, finish_reason, the last choice, chunks)."""

    async def go() -> tuple[int, str, Any, dict, list]:
        r = await env.http.post(path, json={**body, "stream": stream})
        if r.status_code != 200:
            return r.status_code, r.text, None, {}, []
        chat = path.endswith("chat/completions")
        if not stream:
            choice = r.json()["choices"][0]
            return 200, choice["message"]["content"] if chat else choice["text"], choice["finish_reason"], choice, []
        chunks = [e for e in sse_events(r.text)[:-1] if e["choices"]]
        text = "".join((c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"] for c in chunks)
        return 200, text, chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0], chunks

    return go()


async def test_stop_reason_and_include_stop_str_in_output_as_in_vllm(nats_url, tmp_path):
    """vLLM's ``stop_reason`` is in every choice: null when the output ended at ``max_tokens`` (or EOS),
    the stop string or the stop token id that ended it otherwise (it was left out when null); every
    completions stream chunk carries it, a chat stream only on its last chunk (vLLM's). With
    ``include_stop_str_in_output`` (vLLM's extra; it was ignored) the stop string, or the stop token
    id's text, stays in the text; ``finish_reason`` and ``usage`` are the same either way."""
    tok = SimTokenizer()
    words = [tok.word(output_token(i)) for i in range(8)]  # the fake engine's output: these words, space-joined
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        for path, base in (("/v1/completions", {"prompt": [1, 2, 3]}), ("/v1/chat/completions", {"messages": USER})):
            base = {**base, "max_tokens": 8}
            for stream in (False, True):
                cases = (
                    ({}, " ".join(words), "length", None, 8),
                    ({"stop": words[3]}, " ".join(words[:3]) + " ", "stop", words[3], 4),
                    ({"stop": [words[3]], "include_stop_str_in_output": True}, " ".join(words[:4]), "stop", words[3], 4),
                    ({"stop_token_ids": [output_token(2)]}, " ".join(words[:2]), "stop", output_token(2), 3),
                    ({"stop_token_ids": [output_token(2)], "include_stop_str_in_output": True}, " ".join(words[:3]), "stop", output_token(2), 3),
                )
                for extra, text, finish, reason, _n_out in cases:
                    status, got, fin, choice, chunks = await _ask(env, path, {**base, **extra}, stream)
                    where = (path, stream, extra)
                    assert status == 200, (where, got)
                    assert (got, fin) == (text, finish), where
                    assert "stop_reason" in choice and choice["stop_reason"] == reason, (where, choice)
                    if stream and path == "/v1/completions":
                        assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1]), (where, chunks)
                    elif stream:
                        assert all("stop_reason" not in c["choices"][0] for c in chunks[:-1]), (where, chunks)
                    assert env.cluster.works[-1].max_tokens == 8
                # usage counts the tokens up to the stopping one, kept or not
                for keep in (False, True):
                    r = await env.http.post(path, json={**base, "stop": words[3], "include_stop_str_in_output": keep})
                    assert r.json()["usage"]["completion_tokens"] == 4, r.text
        r = await env.http.post("/v1/completions", json={"prompt": [1], "include_stop_str_in_output": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "include_stop_str_in_output", r.text


async def test_completions_echo_puts_the_prompt_before_the_text(nats_url, tmp_path):
    """Legacy completions ``echo`` (it was a 400): the choice's text is the prompt's text and then the
    output (vLLM / OpenAI), a token-id prompt detokenized; streamed, the first chunk starts with it.
    ``usage`` is unchanged. With ``logprobs`` vLLM also returns the prompt's logprobs, which no engine
    here computes: a 400 naming ``echo``, nothing dispatched."""
    tok = SimTokenizer()
    out = " ".join(tok.word(output_token(i)) for i in range(4))
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        for prompt, echoed in (("hello there", "hello there"), ([1, 2, 3], tok.decode([1, 2, 3])), ([[5, 6]], tok.decode([5, 6]))):
            body = {"prompt": prompt, "max_tokens": 4, "echo": True}
            for stream in (False, True):
                status, got, fin, _, chunks = await _ask(env, "/v1/completions", body, stream)
                assert status == 200 and (got, fin) == (echoed + out, "length"), (prompt, stream, got)
                if stream:
                    assert chunks[0]["choices"][0]["text"].startswith(echoed + tok.word(output_token(0)))
            r = await env.http.post("/v1/completions", json=body)
            n_prompt = len(tok.encode(prompt)) if isinstance(prompt, str) else len(prompt if isinstance(prompt[0], int) else prompt[0])
            assert r.json()["usage"]["prompt_tokens"] == n_prompt and r.json()["usage"]["completion_tokens"] == 4
            # echo false / null: the output alone
            for off in (False, None):
                r = await env.http.post("/v1/completions", json={**body, "echo": off})
                assert r.json()["choices"][0]["text"] == out, r.text
        # echo with a stop string: the stop applies to the output only
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "echo": True, "stop": tok.word(output_token(1))})
        assert r.json()["choices"][0]["text"] == tok.decode([1, 2, 3]) + tok.word(output_token(0)) + " ", r.text
        sent = len(env.cluster.works)
        for lp in (0, 2):
            r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "echo": True, "logprobs": lp})
            assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
            assert "logprobs" in r.json()["error"]["message"]
        assert len(env.cluster.works) == sent


async def test_logprobs_on_a_cluster_that_mixes_sim_and_torch_engines_is_a_400_naming_the_sim_nodes(nats_url, tmp_path):
    """One prefill node runs the torch engine, the other and the decode node the sim engine: the router may
    place the request (or re-place it after a failure) on a sim node, which has no logits. Before, it was
    dispatched and the sim node's refusal came back as a 500 ``engine error``; now a 400 naming ``logprobs``
    and the sim nodes, nothing dispatched. Once every live node runs torch, logprobs are dispatched."""
    phases = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    async with router_env(nats_url, tmp_path, phases) as env:
        env.cluster.engines = {"p0": "torch"}
        await env.cluster.publish_states()
        await _wait_for(lambda: env.service.core.view.engines() == {"sim", "torch"}, what="states applied")  # else a race
        sent = len(env.cluster.works)
        for body in ({"prompt": [1, 2], "max_tokens": 2, "logprobs": 1}, {"prompt": [1, 2], "max_tokens": 2, "logprobs": 1, "stream": True}):
            r = await env.http.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "logprobs" and "p1, d0" not in err["message"] and "d0, p1" in err["message"], err
            assert "sim engine" in err["message"] and "p0" not in err["message"], err
        assert len(env.cluster.works) == sent  # nothing dispatched
        env.cluster.engines = {"p0": "torch", "p1": "torch", "d0": "torch"}
        await env.cluster.publish_states()
        await _wait_for(lambda: env.service.core.view.engines() == {"torch"}, what="states applied")
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "logprobs": 1})
        assert r.status_code == 200, r.text
        assert env.cluster.works[-1].sampling.logprobs == 1
        st = await env.stats()
        assert st.counters["logprobs_refused_sim"] == 2


async def test_echo_of_a_token_id_prompt_keeps_its_special_tokens_as_vllm(nats_url, tmp_path):
    """vLLM echoes a token-id prompt as its tokenizer's ``batch_decode`` gives it (``skip_special_tokens``
    False: BOS, ``<|im_start|>``, ... are shown; the renderer's ``_create_prompt_from_token_ids``); the
    router decoded it as output text, special tokens skipped, so ``[<|im_start|>, user, hello, <|im_end|>]``
    echoed ``user hello``. A text prompt is echoed as sent; the output's text still skips them."""
    pytest.importorskip("tokenizers")
    from tests.unit.router.helpers import write_bpe_tokenizer

    folder = write_bpe_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(f"hf:{folder}")
    text = "<|im_start|>user hello<|im_end|>"
    ids = tok._tok.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]
    special = {tok._tok.token_to_id(s) for s in ("<|im_start|>", "<|im_end|>")}  # type: ignore[attr-defined]
    assert ids[0] in special and ids[-1] in special and tok.decode(ids) != text
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}") as env:
        for prompt in (ids, text, [ids]):
            for stream in (False, True):
                status, got, fin, _, _ = await _ask(env, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True}, stream)
                assert status == 200 and got.startswith(text) and fin == "length", (prompt, stream, got)
                assert got == text + tok.decode([output_token(0), output_token(1)]), (prompt, stream, got)


async def test_chat_echo_starts_the_reply_with_the_last_assistant_message_as_vllm(nats_url, tmp_path):
    """vLLM's chat ``echo`` (it was ignored: the reply had no echo): a conversation ending with an
    assistant message gets that message's content before the reply, non-streamed in ``content``,
    streamed as its own chunk right after the role's (vLLM's); ``usage`` counts the output only;
    a conversation ending with the user's gets nothing; stop strings apply to the output only."""
    tok = SimTokenizer()
    words = [tok.word(output_token(i)) for i in range(3)]
    out = " ".join(words)
    start = [*USER, {"role": "assistant", "content": f"Sure: {words[1]}"}]
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        for stream in (False, True):
            body = {"messages": start, "max_tokens": 3, "echo": True, "stream_options": {"include_usage": True} if stream else None}
            status, got, fin, _, chunks = await _ask(env, "/v1/chat/completions", body, stream)
            assert status == 200 and (got, fin) == (f"Sure: {words[1]}" + out, "length"), (stream, got)
            if stream:
                assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                assert chunks[1]["choices"][0]["delta"] == {"content": f"Sure: {words[1]}"}, chunks[1]
            status, got, _, _, _ = await _ask(env, "/v1/chat/completions", {**body, "messages": USER}, stream)
            assert got == out, (stream, got)
            status, got, fin, choice, _ = await _ask(env, "/v1/chat/completions", {**body, "stop": words[1]}, stream)
            assert (got, fin, choice["stop_reason"]) == (f"Sure: {words[1]}" + words[0] + " ", "stop", words[1]), (stream, got)
        r = await env.http.post("/v1/chat/completions", json={"messages": start, "max_tokens": 3, "echo": True})
        assert r.json()["usage"]["completion_tokens"] == 3, r.text


async def test_a_request_larger_than_any_nodes_kv_memory_is_a_400_before_dispatch(nats_url, tmp_path):
    """A node reserves a request's whole KV footprint (prompt + max_tokens) and refuses one larger than
    its GPU KV memory. Before, the router dispatched it and the refusal came back as a 500 ``engine error
    on node c0: request needs 102 KV blocks but node c0 has 100 in GPU memory``; now a 400 before dispatch
    naming both sizes and the node that holds most (``param`` ``max_tokens``, or the prompt when it alone
    does not fit), as vLLM refuses a prompt longer than it can hold. What fits the largest node is served."""
    async with router_env(nats_url, tmp_path, {"c0": "both", "c1": "both"}) as env:
        view = env.service.core.view
        env.cluster.gpu_blocks = {"c0": 100, "c1": 50}  # 64-token blocks: 6400 and 3200 tokens
        await env.cluster.publish_states()
        await _wait_for(lambda: view.nodes["c1"].state.gpu_total_blocks == 50, what="states applied")
        sent = len(env.cluster.works)
        for body, param in (
            ({"prompt": [1] * 6000, "max_tokens": 500}, "max_tokens"),  # 6500 tokens: 102 blocks
            ({"prompt": [1] * 6000, "max_tokens": 500, "stream": True}, "max_tokens"),
            ({"prompt": [1] * 6450, "max_tokens": 1}, "prompt"),  # the prompt alone needs 101
        ):
            r = await env.http.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and "KV blocks" in err["message"] and "(c0) holds 100 (6400 tokens)" in err["message"], err
        r = await env.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a " * 7000}], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert len(env.cluster.works) == sent  # nothing dispatched
        st = await env.stats()
        assert st.counters["kv_room_refused"] == 4
        # exactly a node's memory: served
        env.cluster.gpu_blocks = {"c0": 100, "c1": 100}
        await env.cluster.publish_states()
        await _wait_for(lambda: view.nodes["c1"].state.gpu_total_blocks == 100, what="states applied")
        r = await env.http.post("/v1/completions", json={"prompt": [1] * 6000, "max_tokens": 400})
        assert r.status_code == 200, r.text
        # a node that reports no capacity (an older version): nothing is promised, the request is dispatched
        env.cluster.gpu_blocks = {"c0": 100, "c1": 0}
        await env.cluster.publish_states()
        await _wait_for(lambda: view.largest_gpu_kv() is None, what="states applied")
        r = await env.http.post("/v1/completions", json={"prompt": [1] * 6000, "max_tokens": 500})
        assert r.status_code == 500 and "needs 102 KV blocks" in r.text, r.text


async def test_a_request_only_the_large_node_holds_is_placed_there(nats_url, tmp_path):
    """Nodes of 50 and 120 KV blocks: a request of 96 blocks fits the cluster (no 400) and goes to the
    120-block node. Before, routing placed it on the 50-block node (the first by id on a tie), which
    refused it: a 500 ``engine error ... request needs 96 KV blocks but node c0 has 50``."""
    async with router_env(nats_url, tmp_path, {"c0": "both", "c1": "both"}) as env:
        view = env.service.core.view
        env.cluster.gpu_blocks = {"c0": 50, "c1": 120}
        await env.cluster.publish_states()
        await _wait_for(lambda: view.largest_gpu_kv() == (120, "c1") and view.nodes["c0"].state.gpu_total_blocks == 50, what="states applied")
        for stream in (False, True, False):
            r = await env.http.post("/v1/completions", json={"prompt": [1] * 6000, "max_tokens": 100, "stream": stream})
            assert r.status_code == 200 and "error" not in r.text, r.text
        st = await env.stats()
        assert st.counters["routed.prefill.c1"] == 3 and not st.counters.get("routed.prefill.c0"), st.counters
        r = await env.http.post("/v1/completions", json={"prompt": [1] * 64, "max_tokens": 4})  # fits both
        assert r.status_code == 200, r.text
