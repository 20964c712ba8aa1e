"""What a newcomer from vLLM / SGLang met on the router's OpenAI API against a torch-engine cluster of a tiny model
(``max_model_len`` 1024), each answered now as vLLM answers it:

1. an oversized ``max_tokens`` got the router's ``max_tokens=1000000 exceeds the limit 131072`` (a limit the client
   cannot see) instead of the context's message, and ``max_completion_tokens`` was named ``max_tokens``;
2. with no ``max_tokens``, a prompt that fills the context was told "you requested 1040 tokens (1024 in the prompt,
   16 in the completion)" for 16 tokens it never asked for (vLLM: "your request has 1024 input tokens");
3. ``temperature`` 2.5 was a 400 (vLLM / SGLang take any temperature >= 0);
4. completions ``logprobs: true`` was a 400 (vLLM's pydantic ``int`` reads it as 1);
5. a 3 MB text prompt was tokenized (5.8 s) before it was refused: a lower bound on its tokens now refuses it first;
6. a user message with ``content: null`` was served (vLLM: 400); one with no ``content`` key is an empty turn, as in vLLM.

``RouterService._prepare_body`` runs here on a service holding only what it reads (no bus, no HTTP)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from services.router import api
from services.router.service import RouterService
from shared.tokenizer import HFTokenizer, SimTokenizer, max_token_chars, min_prompt_tokens
from tests.unit.router.helpers import write_bpe_tokenizer

CTX = 1024


def _service(tokenizer: Any = None, **cfg: Any) -> Any:
    """A RouterService with only what ``_prepare_body`` reads (the router's defaults for the limits)."""
    svc = RouterService.__new__(RouterService)
    base = {"chat_default_max_tokens": 256, "max_output_tokens": 131_072, "max_prompt_tokens": 1_048_576, "block_size": 16,
            "enable_auto_tool_choice": False, "trust_request_chat_template": False}
    svc.cfg = SimpleNamespace(**{**base, **cfg})  # type: ignore[assignment]
    svc.tokenizer = tokenizer or SimTokenizer()
    svc.vocab_size = svc.tokenizer.vocab_size
    svc._vocab_what = "the vocabulary"
    svc._model_names = frozenset({"tiny"})
    svc._served_names = ("tiny",)
    return svc


def _refusal(svc: Any, body: dict[str, Any], ctx: int = CTX) -> api.ApiError:
    chat = "messages" in body
    with pytest.raises(api.ApiError) as e:
        svc._prepare_body(msgspec.json.encode(body), chat, ctx)
    assert e.value.status == 400
    return e.value


def _max_tokens(svc: Any, body: dict[str, Any], ctx: int = CTX) -> int:
    return int(svc._prepare_body(msgspec.json.encode(body), "messages" in body, ctx)[2])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    pytest.importorskip("tokenizers")
    return HFTokenizer(write_bpe_tokenizer(tmp_path_factory.mktemp("bpe")))


@pytest.mark.parametrize("asked", [2000, 1_000_000])
def test_an_oversized_max_tokens_gets_the_contexts_message_whatever_its_size(asked: int) -> None:
    # before: 2000 got the context's message, 1000000 "max_tokens=1000000 exceeds the limit 131072"
    e = _refusal(_service(), {"prompt": "hi", "max_tokens": asked})
    assert e.reason == (
        f"This model's maximum context length is {CTX} tokens. However, you requested {asked + 1} tokens "
        f"(1 in the prompt, {asked} in the completion). Please reduce the length of the prompt or completion."
    )
    assert e.param == "max_tokens"


def test_the_errors_name_max_completion_tokens_when_the_client_sent_it() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    e = _refusal(_service(), {"messages": msgs, "max_completion_tokens": 1_000_000})
    assert e.param == "max_completion_tokens" and "maximum context length is 1024 tokens" in e.reason
    # without a model context the router's own limit applies, under the field's own name
    e = _refusal(_service(), {"messages": msgs, "max_completion_tokens": 1_000_000}, ctx=0)
    assert (e.reason, e.param) == ("max_completion_tokens=1000000 exceeds the limit 131072", "max_completion_tokens")
    e = _refusal(_service(), {"prompt": "hi", "max_tokens": 1_000_000}, ctx=0)
    assert (e.reason, e.param) == ("max_tokens=1000000 exceeds the limit 131072", "max_tokens")
    # the router's limit below the context: still refused, after the context check
    e = _refusal(_service(max_output_tokens=100), {"prompt": "hi", "max_tokens": 500})
    assert (e.reason, e.param) == ("max_tokens=500 exceeds the limit 100", "max_tokens")


@pytest.mark.parametrize("extra", [{}, {"max_tokens": 1}])
def test_a_prompt_that_fills_the_context_gets_vllms_input_message(extra: dict[str, Any]) -> None:
    # before (no max_tokens): "you requested 1040 tokens (1024 in the prompt, 16 in the completion)"
    e = _refusal(_service(), {"prompt": list(range(1, CTX + 1)), **extra})
    assert e.reason == (
        "This model's maximum context length is 1024 tokens. However, your request has 1024 input tokens. "
        "Please reduce the length of the input messages."
    )
    assert e.param == "prompt"
    words = " ".join(["word"] * CTX)
    e = _refusal(_service(), {"messages": [{"role": "user", "content": words}], **extra})
    assert e.param == "messages" and "However, your request has" in e.reason and "input tokens" in e.reason


def test_a_prompt_one_short_of_the_context_is_cut_to_the_room_left() -> None:
    assert _max_tokens(_service(), {"prompt": list(range(1, CTX - 3))}) == 4  # 1020 tokens: 4 left of the default 16
    assert _max_tokens(_service(), {"prompt": list(range(1, CTX))}) == 1


def test_a_hopeless_text_prompt_is_refused_before_it_is_tokenized(bpe: HFTokenizer) -> None:
    calls: list[int] = []
    encode = bpe.encode

    def counting(text: str, **kw: Any) -> list[int]:
        calls.append(len(text))
        return encode(text, **kw)

    svc = _service(bpe)
    svc.tokenizer = SimpleNamespace(encode=counting, vocab_size=bpe.vocab_size, max_token_chars=bpe.max_token_chars)
    most = bpe.max_token_chars
    assert most is not None
    e = _refusal(svc, {"prompt": "x" * (most * CTX)})  # at least 1024 tokens whatever the text
    assert calls == []  # before: tokenized first
    assert e.reason == (
        "This model's maximum context length is 1024 tokens. However, your request has 1024 input tokens. "
        "Please reduce the length of the input messages. (1024 is a lower bound: the prompt was refused before it was tokenized.)"
    )
    # vLLM's sentence as clients parse it (review: "has at least 1024 input tokens" matched no such pattern)
    found = re.search(r"your request has (\d+) input tokens", e.reason)
    assert found is not None and found.group(1) == "1024"
    assert e.param == "prompt"
    # against --max-prompt-tokens (no context): the router's own message, with the bound
    svc.cfg.max_prompt_tokens = 10
    e = _refusal(svc, {"prompt": "x" * (most * 11)}, ctx=0)
    assert (e.reason, calls) == ("prompt has at least 11 tokens; at most 10 allowed", [])
    # a text whose bound is below the limits is tokenized and served (its count is what counts)
    svc.cfg.max_prompt_tokens = 1_048_576
    assert _max_tokens(svc, {"prompt": "x" * (most * 8)}) == 16
    assert calls == [most * 8]


def test_a_hopeless_chat_is_refused_after_its_template_before_it_is_tokenized(bpe: HFTokenizer) -> None:
    """A chat's prompt had no bound before tokenizing (a 3 MB message was rendered and tokenized, seconds of a core,
    only to be refused by its count). The bound is taken on the rendered prompt, the string that is tokenized (a
    template may drop text, so the messages' size bounds nothing): refused at once with vLLM's message; one whose
    rendering fits is tokenized and served."""
    import time

    calls: list[int] = []

    def counting(text: str, **kw: Any) -> list[int]:
        calls.append(len(text))
        return bpe.encode(text, **kw)

    svc = _service(bpe)
    svc.tokenizer = SimpleNamespace(encode=counting, render_chat=bpe.render_chat, vocab_size=bpe.vocab_size, max_token_chars=bpe.max_token_chars)
    most = bpe.max_token_chars
    assert most is not None
    big = {"messages": [{"role": "user", "content": "x" * 3_000_000}]}
    t0 = time.perf_counter()
    e = _refusal(svc, big)
    took = time.perf_counter() - t0
    assert calls == [], calls  # before: the 3 MB rendering was tokenized first
    bound = -(-len(bpe.render_chat(big["messages"])) // most)
    assert e.param == "messages" and e.reason == (
        f"This model's maximum context length is 1024 tokens. However, your request has {bound} input tokens. Please reduce the "
        f"length of the input messages. ({bound} is a lower bound: the prompt was refused before it was tokenized.)"
    )
    assert took < 1.0, took  # rendering only (tokenizing it took seconds)
    # a chat whose rendering fits is tokenized once (the rendered text) and served
    fits = {"messages": [{"role": "user", "content": "x" * (most * 8)}], "max_tokens": 4}
    req, ids, max_tokens, *_ = svc._prepare_body(msgspec.json.encode(fits), True, CTX)
    rendered = bpe.render_chat(fits["messages"])
    assert calls == [len(rendered)] and list(ids) == bpe.encode(rendered, add_special_tokens=False) and max_tokens == 4
    assert list(ids) == bpe.apply_chat_template(fits["messages"])  # the same ids as the template's own call
    # the bound is the rendered text's: a template that drops the message leaves nothing to refuse
    calls.clear()
    svc.tokenizer.render_chat = lambda messages, tools=None, **flags: "<|im_start|>user\n<|im_end|>\n"
    assert svc._prepare_body(msgspec.json.encode(big), True, CTX)[2] > 0 and len(calls) == 1


def test_the_bound_never_exceeds_the_count(bpe: HFTokenizer) -> None:
    """Texts made to be few tokens (the longest vocabulary tokens, added tokens, spaces, multi-byte characters)."""
    vocab = bpe._tok.get_vocab()
    longest = sorted(vocab, key=len)[-20:]
    texts = [
        "".join(bpe.decode([vocab[t]], skip_special_tokens=False) for t in longest) * 3,
        "<|im_start|><|im_end|>" * 50, " " * 5000, "é中😀" * 300, "".join(map(chr, range(1, 0x800))),
        Path(__file__).read_text(),
    ]
    for text in texts:
        n = len(bpe.encode(text, add_special_tokens=False))
        assert min_prompt_tokens(bpe, text) <= n, (text[:40], n)


def test_tokenizers_without_a_bound_have_none() -> None:
    assert min_prompt_tokens(SimTokenizer(), "x" * 10_000_000) == 0  # the sim tokenizer's words have no length bound
    plain = {"type": "BPE", "vocab": {chr(b): b for b in range(256)} | {"abc": 300}, "byte_fallback": False}
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())  # the 256 symbols of GPT-2's byte-level alphabet
    full = {"type": "BPE", "vocab": {c: i for i, c in enumerate(alphabet)} | {"abcd": 300}}
    ok = {"model": full, "pre_tokenizer": {"type": "ByteLevel"}, "normalizer": None, "truncation": None, "added_tokens": []}
    assert max_token_chars(ok) == 4
    isolated = {"type": "Sequence", "pretokenizers": [{"type": "Punctuation", "behavior": "Isolated"}, {"type": "ByteLevel"}]}
    assert max_token_chars({**ok, "pre_tokenizer": isolated}) == 4  # keeps every character
    assert max_token_chars({**ok, "model": {**full, "continuing_subword_prefix": None, "end_of_word_suffix": None}}) == 4
    assert max_token_chars({**ok, "added_tokens": [{"content": "<|a-long-added-token|>", "lstrip": False, "rstrip": False}]}) == 22
    for bad in (
        {**ok, "normalizer": {"type": "NFC"}},  # composes characters: fewer than the text's
        {**ok, "normalizer": {"type": "Lowercase"}},
        {**ok, "pre_tokenizer": {"type": "Whitespace"}},  # drops the spaces
        {**ok, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Removed"}, {"type": "ByteLevel"}]}},
        # review: Punctuation drops what it matches too when it removes (2 tokens were bounded at 1336)
        {**ok, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Punctuation", "behavior": "Removed"}, {"type": "ByteLevel"}]}},
        {**ok, "pre_tokenizer": {"type": "CharDelimiterSplit", "delimiter": "x"}},  # drops the delimiter
        # review: a piece after a word's first needs '##x' / 'x</w>', which the vocabulary lacks: dropped
        {**ok, "model": {**full, "continuing_subword_prefix": "##"}},
        {**ok, "model": {**full, "end_of_word_suffix": "</w>"}},
        {**ok, "model": {k: v for k, v in full.items() if k != "type"}},  # review: tokenizers may load it as WordPiece
        {**ok, "truncation": {"max_length": 10}},
        {**ok, "added_tokens": [{"content": "<mask>", "lstrip": True, "rstrip": False}]},  # takes the spaces before it
        {**ok, "model": {**full, "vocab": {"abcd": 1}}},  # a byte it cannot spell is dropped
        {**ok, "model": {**full, "type": "WordPiece"}},  # one [UNK] for a whole word
        {**ok, "pre_tokenizer": None, "model": plain},  # no byte fallback: an unknown character is dropped
    ):
        assert max_token_chars(bad) is None, json.dumps(bad)[:120]
    fallback = {**plain, "byte_fallback": True, "vocab": {f"<0x{b:02X}>": b for b in range(256)} | {"▁the": 300}}
    sp = {**ok, "model": fallback, "pre_tokenizer": {"type": "Metaspace"},
          "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                             {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}}
    assert max_token_chars(sp) == 6  # "<0x41>": longer than anything one token stands for, so still a bound


@pytest.mark.parametrize("value", [2.5, 100])
def test_a_temperature_past_openais_2_is_taken_as_vllm_takes_it(value: float) -> None:
    req, _ = api.parse_completion(msgspec.json.encode({"prompt": "x", "temperature": value}))  # before: "Expected `float` <= 2.0"
    sp = api.sampling(req)
    assert sp is not None and sp.temperature == value
    req2 = api.parse_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], "temperature": value}))
    assert req2.temperature == value


@pytest.mark.parametrize("value", [-0.5, 100.5, "1e400"])
def test_a_negative_or_past_the_nodes_bound_temperature_is_refused(value: Any) -> None:
    body = b'{"prompt": "x", "temperature": %s}' % str(value).encode()
    with pytest.raises(api.ApiError) as e:
        api.parse_completion(body)
    assert e.value.status == 400 and e.value.param == "temperature"


@pytest.mark.parametrize(("sent", "read"), [(True, 1), (False, 0), (3, 3)])
def test_completions_logprobs_true_and_false_are_vllms_1_and_0(sent: Any, read: int) -> None:
    for prompt in ("x", ["x"]):  # the body's prompt decoded apart too
        req, _ = api.parse_completion(msgspec.json.encode({"prompt": prompt, "logprobs": sent}))  # before: 400
        assert req.logprobs == read and type(req.logprobs) is int
        assert api.logprobs_asked(req) == read


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_a_null_content_is_refused_but_in_an_assistant_message(role: str) -> None:
    with pytest.raises(api.ApiError) as e:  # before: served as an empty turn
        api.parse_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}, {"role": role, "content": None}]}))
    assert e.value.status == 400 and e.value.param == "messages[1].content", e.value.reason
    assert f"a {role!r} message's content may not be null" in e.value.reason
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    api.parse_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": None, "tool_calls": calls}]}))


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool", "assistant"])
def test_a_message_without_content_is_an_empty_turn_as_vllm_serves_it(role: str) -> None:
    # vLLM's CustomChatCompletionMessageParam is total=False: no content key validates, and renders as an empty
    # turn (review of 27ff433: it had made this a 400, unlike vLLM); the same prompt as content ""
    req = api.parse_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}, {"role": role}]}))
    same = api.parse_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}, {"role": role, "content": ""}]}))
    assert api.chat_messages(req) == api.chat_messages(same) and api.chat_messages(req)[1]["content"] == ""
    tok = SimTokenizer()
    assert api.render_chat(tok, req) == api.render_chat(tok, same)
    if role == "assistant":  # echo of an absent content is "", as of a null one
        echoed = api.parse_chat(msgspec.json.encode({"messages": [{"role": role}], "echo": True, "add_generation_prompt": False}))
        assert api.chat_echo(echoed) == ""


def test_without_a_context_an_oversized_max_tokens_is_refused_before_the_prompt_is_tokenized(bpe: HFTokenizer) -> None:
    # review of 27ff433: with no model context the --max-output-tokens check ran after tokenizing (1 MB: 1.18 s)
    calls: list[int] = []
    encode = bpe.encode

    def counting(text: str, **kw: Any) -> list[int]:
        calls.append(len(text))
        return encode(text, **kw)

    svc = _service(bpe)
    svc.tokenizer = SimpleNamespace(encode=counting, vocab_size=bpe.vocab_size, max_token_chars=None)
    e = _refusal(svc, {"prompt": "hello world " * 1000, "max_tokens": 10_000_000}, ctx=0)
    assert (e.reason, e.param, calls) == ("max_tokens=10000000 exceeds the limit 131072", "max_tokens", [])
    # with a context, that is checked first (vLLM's order), after the prompt is counted
    e = _refusal(svc, {"prompt": "hello world " * 10, "max_tokens": 10_000_000})
    assert "maximum context length is 1024 tokens" in e.reason and e.param == "max_tokens" and len(calls) == 1


def test_a_chat_over_max_prompt_tokens_names_messages() -> None:
    # review of 27ff433: the router's own prompt limit named param "prompt" for a chat too
    svc = _service(max_prompt_tokens=10)
    e = _refusal(svc, {"messages": [{"role": "user", "content": " ".join(["word"] * 50)}]}, ctx=0)
    assert e.param == "messages" and e.reason.startswith("prompt has ") and e.reason.endswith("tokens; at most 10 allowed")
    e = _refusal(svc, {"prompt": " ".join(["word"] * 50)}, ctx=0)
    assert e.param == "prompt"
