"""Request body validation (400 reasons), agent header validation, response shapes."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from services.router import api
from shared.messages import Sampling


def bad(fn, body: dict | bytes, match: str, status: int = 400) -> None:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    with pytest.raises(api.ApiError, match=match) as ei:
        fn(raw)
    assert ei.value.status == status


def test_completion_prompt_forms():
    req, prompt = api.parse_completion(b'{"prompt": [1, 2, 3], "max_tokens": 4, "stream": true, "temperature": 0.5}')
    assert prompt == [1, 2, 3] and req.max_tokens == 4 and req.stream
    assert api.parse_completion(b'{"prompt": "hi"}')[1] == "hi"
    assert api.parse_completion(b'{"prompt": ["hi"]}')[1] == "hi"
    assert api.parse_completion(b'{"prompt": [[5, 6]], "max_tokens": 2}')[1] == [5, 6]
    req, _ = api.parse_completion(b'{"prompt": "x", "ignore_eos": true, "stop": ["\\n"], "seed": 3, "unknown_vendor_field": {"a": 1}}')
    assert req.ignore_eos and req.stop == ["\n"]


def test_large_token_prompt_parses():
    ids = list(range(300_000))
    _, prompt = api.parse_completion(msgspec.json.encode({"prompt": ids, "max_tokens": 1}))
    assert prompt == ids


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        (b"[" + b"9" * 5000 + b"]", "prompt[0]"),  # msgspec: Integer value out of range (an uncaught ValidationError: a 500)
        (b"[[1, " + b"9" * 5000 + b"]]", "prompt[0][1]"),
        (b"[[1, null]]", "prompt[0][1]"),  # was prompt[0], the message '... - at `$[1]` - at `$.prompt[0]`'
        (b"[[1, 2.5]]", "prompt[0][1]"),
        (b"[[1, true]]", "prompt[0][1]"),
        (b'[[1], "x"]', "prompt"),
    ],
)
def test_a_token_id_prompt_msgspec_cannot_decode_is_a_400_naming_the_id(prompt, param):
    """Ids msgspec refuses in a ``[ids]`` / ``[[ids]]`` prompt (an integer of over 4300 digits, null, a float, a
    bool) are a 400 whose param and message name the id's place; none escapes as msgspec's own error."""
    with pytest.raises(api.ApiError) as e:
        api.parse_completion(b'{"prompt": ' + prompt + b', "max_tokens": 2}')
    assert e.value.status == 400 and e.value.param == param, e.value.reason
    if param != "prompt":
        assert e.value.reason.endswith(f"- at `$.{param}`") and e.value.reason.count(" - at ") == 1


def test_a_field_msgspec_cannot_decode_beside_a_nested_prompt_is_a_400_naming_it():
    """Beside a ``[[ids]]`` prompt the other fields were checked by an untyped decode of the whole body: an
    integer msgspec cannot hold (``seed`` of 5000 digits) escaped as msgspec's error naming ``$[...]`` (a 500)."""
    with pytest.raises(api.ApiError) as e:
        api.parse_completion(b'{"prompt": [[1, 2]], "seed": ' + b"9" * 5000 + b"}")
    assert e.value.status == 400 and e.value.param == "seed"
    req, prompt = api.parse_completion(b'{"prompt": [[1, 2]], "max_tokens": 3, "add_special_tokens": false}')
    assert prompt == [1, 2] and req.max_tokens == 3 and not req.add_special_tokens and isinstance(req, api.CompletionRequest)


def test_completion_400_reasons():
    bad(api.parse_completion, b"{not json", "not valid JSON \\(JSON is malformed")
    bad(api.parse_completion, b'{"prompt": "x"', r"not valid JSON \(Input data was truncated\)")
    for empty in (b"", b" \n"):  # msgspec says "Input data was truncated": name it
        bad(api.parse_completion, empty, "^request body is empty: expected a JSON object$")
        bad(api.parse_chat, empty, "^request body is empty: expected a JSON object$")
    bad(api.parse_chat, b"{not json", "not valid JSON")
    bad(api.parse_completion, b"[1, 2]", "Expected `object`")
    bad(api.parse_completion, {"max_tokens": 3}, "missing required field `prompt`")
    bad(api.parse_completion, {"prompt": 3}, r"\$.prompt")
    # ids of any size are decoded; the router's vocabulary check names the first outside (not msgspec's bound)
    for ids in ([1, -1], [1, 2**32]):
        assert api.parse_completion(msgspec.json.encode({"prompt": ids}))[1] == ids
        with pytest.raises(api.ApiError, match=rf"token id {ids[1]} is outside the vocabulary \[0, 100\)") as e:
            api.check_token_ids(ids, 100, "prompt")
        assert e.value.param == "prompt[1]"
    bad(api.parse_completion, {"prompt": [[1], [2]]}, "batched prompts")
    bad(api.parse_completion, {"prompt": ["a", "b"]}, "batched prompts")
    bad(api.parse_completion, {"prompt": [["a"]]}, r"\$.prompt\[0\]")
    bad(api.parse_completion, {"prompt": ""}, "prompt is empty")
    bad(api.parse_completion, {"prompt": []}, "empty token list")
    bad(api.parse_completion, {"prompt": "x", "max_tokens": 0}, r">= 1 - at `\$.max_tokens`")
    bad(api.parse_completion, {"prompt": "x", "max_tokens": "5"}, r"Expected `int \| null`, got `str` - at `\$.max_tokens`")
    bad(api.parse_completion, {"prompt": "x", "temperature": 101}, r"\$.temperature")
    bad(api.parse_completion, {"prompt": "x", "top_p": 1.5}, r"\$.top_p")
    bad(api.parse_completion, {"prompt": "x", "stream": "yes"}, r"\$.stream")
    bad(api.parse_completion, {"prompt": "x", "n": 2}, "n > 1")
    bad(api.parse_completion, {"prompt": "x", "logprobs": 21}, "logprobs must be in")
    bad(api.parse_completion, {"prompt": "x", "logprobs": -1}, "logprobs must be in")
    bad(api.parse_completion, {"prompt": "x", "logprobs": 1, "echo": True}, "echo with logprobs")
    bad(api.parse_completion, {"prompt": "x", "logprobs": 0, "echo": True}, "echo with logprobs")
    bad(api.parse_completion, {"prompt": "x", "best_of": 3}, "best_of")
    bad(api.parse_completion, {"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed when stream")
    bad(api.parse_completion, {"prompt": ["a"], "max_tokens": -2}, r"\$.max_tokens")


def test_chat_body():
    req = api.parse_chat(
        msgspec.json.encode(
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "content": "out", "tool_call_id": "t1"},
                ],
                "max_completion_tokens": 7,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    )
    assert req.max_completion_tokens == 7 and req.stream_options.include_usage
    msgs = api.chat_messages(req)
    # text parts joined by newlines, as vLLM's _parse_chat_message_content_parts ("\n".join(texts); was "ab")
    assert msgs[1]["content"] == "a\nb" and msgs[2]["content"] == "" and msgs[3]["tool_call_id"] == "t1"


def test_chat_400_reasons():
    bad(api.parse_chat, {"messages": []}, "length >= 1")
    bad(api.parse_chat, {}, "missing required field `messages`")
    bad(api.parse_chat, {"messages": [{"role": "wizard", "content": "x"}]}, r"\$.messages\[0\].role")
    bad(api.parse_chat, {"messages": [{"role": "user", "content": 5}]}, r"\$.messages\[0\].content")
    bad(api.parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text only")
    bad(api.parse_chat, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens")
    bad(api.parse_chat, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs must be in")


def test_branch_headers():
    h = api.parse_branch_headers({"x-branch-id": "b1", "x-parent-branch-id": "b0", "x-branch-kind": "fork", "x-agent-id": "ag"}, 16)
    assert (h.branch_id, h.parent_branch_id, h.kind, h.agent_id) == ("b1", "b0", "fork", "ag")
    assert api.parse_branch_headers({}, 16) == api.BranchHeaders()
    assert api.parse_branch_headers({"x-branch-id": "any thing/with.dots:ok"}, 64).kind == "main"
    for headers, match in [
        ({"x-branch-id": "x" * 17}, "at most 16"),
        ({"x-branch-id": "a\tb"}, "control character"),
        ({"x-branch-id": "a\x7fb"}, "control character"),
        ({"x-branch-id": ""}, "empty"),
        ({"x-branch-id": "b", "x-branch-kind": "child"}, "fork, subagent, main"),
        ({"x-branch-kind": "fork"}, "need an X-Branch-Id"),
        ({"x-parent-branch-id": "p"}, "need an X-Branch-Id"),
        ({"x-branch-id": "b", "x-parent-branch-id": "b"}, "own parent"),
        ({"x-branch-id": "b", "x-agent-id": "\x01"}, "X-Agent-Id"),
    ]:
        with pytest.raises(api.ApiError, match=match) as ei:
            api.parse_branch_headers(headers, 16)
        assert ei.value.status == 400


def test_an_agent_header_repeated_with_another_value_is_a_400():
    """Two ``X-Branch-Id`` values (a client's default header and its per-call one) were served as the first's
    branch, silently; each agent header repeated with another value is now a 400 naming it. The same value
    twice (a proxy's copy) is one value."""
    from starlette.datastructures import Headers

    for name, values in (("x-branch-id", ("main", "b7")), ("x-parent-branch-id", ("p1", "p2")),
                         ("x-branch-kind", ("fork", "subagent")), ("x-agent-id", ("a", "b"))):
        raw = [(b"x-branch-id", b"b1")] if name != "x-branch-id" else []
        raw += [(name.encode(), v.encode()) for v in values]
        with pytest.raises(api.ApiError, match="sent 2 times with different values") as ei:
            api.parse_branch_headers(Headers(raw=raw), 16)
        assert ei.value.status == 400 and ei.value.param.lower() == name, ei.value.param
    same = Headers(raw=[(b"x-branch-id", b"b1"), (b"x-branch-id", b"b1"), (b"x-branch-kind", b"fork"), (b"x-branch-kind", b"fork")])
    assert api.parse_branch_headers(same, 16) == api.BranchHeaders(branch_id="b1", kind="fork")


def test_agent_headers_are_read_as_utf8_text():
    """Ids may hold any character but control characters (services/router/README.md). The headers' bytes were
    read as latin-1 (Starlette's str), so ``X-Branch-Id: zweig-ä`` (UTF-8) became ``zweig-Ã¤``: not the id of
    ``/v1/branches/zweig-%C3%A4/end`` (a 404: the harness could not end its branch), and ``task…1`` was refused
    for a control character U+0080 (the middle byte of ``…``). Now the bytes are UTF-8 text; bytes that are
    not UTF-8 are a 400 saying so; the control-character rule applies to the text (a UTF-8 C1 control still
    refused)."""
    from starlette.datastructures import Headers

    raw = [(b"x-branch-id", "zweig-ä".encode()), (b"x-parent-branch-id", "haupt-ß".encode()),
           (b"x-agent-id", "agent-ü".encode()), (b"x-branch-kind", b"fork")]
    h = api.parse_branch_headers(Headers(raw=raw), 16)
    assert (h.branch_id, h.parent_branch_id, h.agent_id, h.kind) == ("zweig-ä", "haupt-ß", "agent-ü", "fork")
    assert api.parse_branch_headers(Headers(raw=[(b"x-branch-id", "task…1".encode())]), 16).branch_id == "task…1"
    assert api.parse_branch_headers(Headers(raw=[(b"x-branch-id", "枝".encode() * 16)]), 16).branch_id == "枝" * 16  # characters
    for value, match in [
        (b"a\xc2\x80b", r"control character \(U\+0080\)"),
        (b"a\x85b", r"control character \(U\+0085\)"),  # a latin-1 C1 control (not UTF-8: read as latin-1)
        ("枝".encode() * 17, "at most 16"),
    ]:
        with pytest.raises(api.ApiError, match=match) as ei:
            api.parse_branch_headers(Headers(raw=[(b"x-branch-id", value)]), 16)
        assert ei.value.status == 400 and ei.value.param == "X-Branch-Id"
    assert api.header_text("plain") == "plain"


def test_latin1_header_bytes_name_the_same_id_as_utf8_ones():
    """Python's ``requests`` / ``http.client`` and Node's ``fetch`` send ``X-Branch-Id: zweig-ä`` as the latin-1
    bytes ``zweig-\\xe4``; curl, aiohttp and Go send UTF-8. Both name ``zweig-ä``, the id those clients put in
    ``/v1/branches/zweig-%C3%A4/end``. Before, the latin-1 bytes were a 400 "not valid UTF-8 (byte 0xE4 ...)"."""
    from starlette.datastructures import Headers

    for enc in ("utf-8", "latin-1"):
        raw = [(b"x-branch-id", "zweig-ä".encode(enc)), (b"x-parent-branch-id", "haupt-ß".encode(enc)),
               (b"x-agent-id", "agent-ÿ".encode(enc)), (b"x-branch-kind", b"subagent")]  # fmt: skip
        h = api.parse_branch_headers(Headers(raw=raw), 16)
        assert (h.branch_id, h.parent_branch_id, h.agent_id, h.kind) == ("zweig-ä", "haupt-ß", "agent-ÿ", "subagent"), enc
    assert api.header_text("zweig-\xe4") == "zweig-ä"  # as Starlette hands the latin-1 bytes on
    assert api.header_text("zweig-\xc3\xa4") == "zweig-ä"  # ... and the UTF-8 ones


def test_path_branch_id_refuses_escapes_that_are_not_utf8():
    assert api.path_branch_id("zweig-ä", b"/v1/branches/zweig-%C3%A4/end", 16) == "zweig-ä"
    assert api.path_branch_id("ok-\ufffd", b"/v1/branches/ok-%EF%BF%BD/end", 16) == "ok-\ufffd"  # a real U+FFFD
    with pytest.raises(api.ApiError, match="not valid UTF-8") as ei:
        api.path_branch_id("zweig-\ufffd", b"/v1/branches/zweig-%E4/end", 16)
    assert ei.value.status == 400 and ei.value.param == "branch_id"
    with pytest.raises(api.ApiError, match=r"control character \(U\+0080\)"):
        api.path_branch_id("a\x80b", b"/v1/branches/a%C2%80b/end", 16)


def test_response_shapes():
    use = api.usage(10, 3, 4)
    assert use == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 4}}
    r = api.chat_response("id", 1, "m", "t", "length", use)
    assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant", "content": "t"}
    c = api.completion_chunk("id", 1, "m", "t", None, True)
    assert c["usage"] is None and c["choices"][0]["text"] == "t"
    assert api.error_body(404, "nope")["error"] == {"message": "nope", "type": "invalid_request_error", "param": None, "code": 404}


def test_response_id_is_vllms_prefix_on_the_bare_request_id():
    """vLLM's OpenAI server: ``chatcmpl-<X-Request-Id>`` / ``cmpl-<X-Request-Id>``."""
    assert api.response_id("abc_1", chat=True) == "chatcmpl-abc_1"
    assert api.response_id("abc_1", chat=False) == "cmpl-abc_1"


def test_any_visible_ascii_request_id_is_taken_and_its_rid_is_one_nats_subject_token():
    """The client's ``X-Request-ID`` is taken when it is 1 to 256 visible ASCII characters (vLLM takes any
    value; gateways' ids hold ``.``, ``:``, ``/``), else a 400 naming the header; its rid
    (:func:`api.request_rid`, the token of ``req.<rid>.out`` and of every log line) always passes
    ``shared.subjects.check_token`` within 128 characters, and is the id itself when that already does."""
    import random

    from shared.subjects import check_token

    rng = random.Random(5)
    alphabet = [chr(i) for i in range(0x20, 0x7F)] + ["\t", "\n", "\x7f", "\u00e9", "\u0663", "\uff11"]
    values = ["a.b", "a*", ">", "x y", "id\n", "\u0663", "abc/def:ghi.jkl", "a" * 128, "a" * 129, "a" * 256, "a" * 257]
    values += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6))) for _ in range(3000)]
    for v in values:
        visible = 1 <= len(v) <= api.REQUEST_ID_MAX_LEN and all(0x21 <= ord(c) <= 0x7E for c in v)
        try:
            got = api.parse_request_id(v)
        except api.ApiError as e:
            assert e.status == 400 and e.param == "X-Request-ID" and not visible, v
            continue
        assert visible and got == v, v
        rid = api.request_rid(v)
        assert check_token(rid) == rid and len(rid) <= api.RID_MAX_LEN and api.request_rid(v) == rid, v
        token_ok = True
        try:
            check_token(v)
        except ValueError:
            token_ok = False
        assert (rid == v) == (token_ok and len(v) <= api.RID_MAX_LEN), v  # a safe id is its own rid
    assert api.parse_request_id(None) is None
    assert api.REQUEST_ID_MAX_LEN == 256 and api.RID_MAX_LEN == 128
    with pytest.raises(api.ApiError, match="at most 256"):
        api.parse_request_id("a" * 257)
    with pytest.raises(api.ApiError, match="not byte 0x20$"):
        api.parse_request_id("id with space")
    # a header's bytes come one latin-1 character each: a UTF-8 'é' (0xC3 0xA9) is named by its first byte,
    # not as the character U+00C3 it was never sent as
    with pytest.raises(api.ApiError, match=r"not byte 0xC3 \(non-ASCII"):
        api.parse_request_id("caf\xc3\xa9")


def test_request_rid_never_maps_two_client_ids_to_one_rid():
    """Two different ``X-Request-ID`` values never share a rid (they would share ``req.<rid>.out`` and be
    taken for duplicates): ids of the same safe characters (``a.b``, ``a:b``, ``a/b`` and the safe ``a_b``),
    a safe id spelled as another's mapped rid (kept apart: it ends like a mapped one, so it is mapped too),
    long ids that differ past the kept prefix; a safe id is its own rid, the rest are mapped the same every time."""
    a_dot = api.request_rid("a.b")
    assert a_dot.startswith("a_b--") and len(a_dot) == 3 + 2 + 20
    tricky = ["a.b", "a:b", "a/b", "a_b", "a-b", a_dot, a_dot + ".", "abc/def:ghi.jkl", "abc_def_ghi_jkl",
              "x" * 200 + "1", "x" * 200 + "2", "x" * 129, "x" * 128, "x" * 127 + ".", "x" * 127 + "_", "x" * 256]  # fmt: skip
    tricky += [api.request_rid(t) for t in list(tricky)]  # every mapped rid sent back as a client id
    ids = set(tricky) | {"".join(chr(c) for c in (0x21 + i % 94, 0x21 + i // 94 % 94, 0x21 + i // 8836)) for i in range(20000)}
    rids = {api.request_rid(i) for i in ids}
    assert len(rids) == len(ids)
    assert api.request_rid("a_b") == "a_b" and api.request_rid("x" * 128) == "x" * 128
    assert api.request_rid("0b0f8c3e-5a1d-4f6e-9c7a-1234567890ab") == "0b0f8c3e-5a1d-4f6e-9c7a-1234567890ab"
    assert api.request_rid(a_dot) != a_dot  # safe, but ends like a mapped rid: mapped too
    assert api.request_rid("abc/def:ghi.jkl") == "abc_def_ghi_jkl--" + hashlib.sha256(b"abc/def:ghi.jkl").hexdigest()[:20]
    with pytest.raises(ValueError):
        api.request_rid("")


def test_explicit_null_is_the_default_for_openais_nullable_fields():
    """OpenAI's spec marks ``stream``, ``n``, ``logprobs``, ``echo`` and ``stream_options.*`` nullable and vLLM
    (``Optional[...]``) takes ``null`` as the default; clients built on typed models (LangChain, litellm) send it."""
    req, _ = api.parse_completion(b'{"prompt": "x", "stream": null, "n": null, "echo": null, "logprobs": null, "best_of": null}')
    assert not req.stream and not req.echo
    req = api.parse_chat(b'{"messages": [{"role": "user", "content": "x"}], "stream": null, "n": null, "logprobs": null}')
    assert not req.stream and not req.logprobs
    req = api.parse_chat(
        b'{"messages": [{"role": "user", "content": "x"}], "stream": true,'
        b' "stream_options": {"include_usage": null, "continuous_usage_stats": null}}'
    )
    assert req.stream and not req.stream_options.include_usage and not req.stream_options.continuous_usage_stats
    bad(api.parse_chat, {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n > 1")  # still refused
    bad(api.parse_chat, {"messages": [{"role": "user", "content": "x"}], "ignore_eos": None}, r"\$.ignore_eos")  # vLLM: bool


def test_a_bad_field_is_named_in_param():
    """OpenAI's error ``param`` names the field (vLLM leaves it null; clients show it next to the message)."""

    def param(fn, body: dict) -> str | None:
        with pytest.raises(api.ApiError) as ei:
            fn(msgspec.json.encode(body))
        return ei.value.param

    assert param(api.parse_chat, {"messages": [{"role": "user", "content": "x"}], "temperature": -1}) == "temperature"
    assert param(api.parse_chat, {"messages": [{"role": "user", "content": 5}]}) == "messages[0].content"
    assert param(api.parse_chat, {"messages": [{"content": "x"}]}) == "messages[0].role"
    assert param(api.parse_chat, {}) == "messages"
    assert param(api.parse_completion, {"prompt": "x", "max_tokens": "5"}) == "max_tokens"
    assert param(api.parse_completion, {"max_tokens": 3}) == "prompt"
    opts = {"prompt": "x", "stream_options": {"include_usage": 3}, "stream": True}
    assert param(api.parse_completion, opts) == "stream_options.include_usage"
    assert param(api.parse_chat, {"messages": "hi"}) == "messages"


def test_refusal_content_part_of_an_assistant_message_is_text():
    """OpenAI's assistant content parts are ``text`` and ``refusal``; a conversation sent back with one is valid."""
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                         {"role": "user", "content": "b"}]}
    req = api.parse_chat(msgspec.json.encode(body))
    assert api.chat_messages(req)[1]["content"] == "no"
    bad(api.parse_chat, {"messages": [{"role": "user", "content": [{"type": "refusal"}]}]}, "only allowed in an assistant message")


def test_a_content_part_missing_its_text_or_a_malformed_tool_is_a_400_saying_so():
    """A text part without ``text`` was told "content part type 'text' is not supported" (it is; its field is
    missing); ``tools`` of any shape (``[{}]``, a numeric name) were served, rendered into the prompt as sent,
    where vLLM answers 400. Each now names the field."""
    def says(body: dict, match: str, param: str) -> None:
        with pytest.raises(api.ApiError, match=match) as ei:
            api.parse_chat(msgspec.json.encode(body))
        assert ei.value.status == 400 and ei.value.param == param, ei.value.param
        if "tools" in body:  # /tokenize of the same chat is refused the same way
            with pytest.raises(api.ApiError, match=match):
                api.parse_tokenize(msgspec.json.encode(body))

    user = [{"role": "user", "content": "x"}]
    says({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "needs a 'text' string", "messages[0].content[0].text")
    says({"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": None}]}]}, "needs a 'refusal' string",
         "messages[0].content[0].refusal")
    says({"messages": user, "tools": [{}]}, r"tools\[0\]\.function must be an object", "tools[0].function")
    says({"messages": user, "tools": [{"type": "function", "function": {"name": 1}}]}, "name must be a non-empty string",
         "tools[0].function.name")
    says({"messages": user, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "must be 'function'", "tools[0].type")
    says({"messages": user, "tools": [{"function": {"name": "f", "parameters": "x"}}]}, "must be an object", "tools[0].function.parameters")
    ok = {"messages": user, "tools": [{"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}},
                                      {"function": {"name": "g"}}]}
    assert len(api.parse_chat(msgspec.json.encode(ok)).tools) == 2


def test_a_malformed_tool_call_of_a_message_is_a_400_naming_the_message():
    """``tool_calls`` of a message (OpenAI's ``ChatCompletionMessageToolCallParam``, vLLM takes the same: ``id``
    string, ``type`` ``"function"``, ``function`` ``{name, arguments}`` with ``arguments`` a string of JSON text)
    were not checked: ``[{}]``, a call without a function or with its arguments as an object were served 200
    with the sim tokenizer (rendered into the prompt as sent) and failed an HF chat template with a 400 that
    named only ``messages``. Each is now a 400 naming the message, the call and the field, on
    ``/v1/chat/completions`` and ``/tokenize`` alike. ``arguments`` as an object is served (vLLM's ``_postprocess_messages``
    takes one; its server's request model refuses it: ``api._check_tool_calls``); another type (array, number,
    boolean, null) is a 400, as vLLM's server answers it."""
    def says(calls: object, match: str, param: str) -> None:
        msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "content": "out", "tool_call_id": "c1"}]
        for parse in (api.parse_chat, api.parse_tokenize):
            with pytest.raises(api.ApiError, match=match) as ei:
                parse(msgspec.json.encode({"messages": msgs}))
            assert ei.value.status == 400 and ei.value.param == param, (parse, ei.value.param)
            assert "messages[1]" in ei.value.reason, ei.value.reason

    good = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \"/\"}"}}
    says([{}], r"messages\[1\]\.tool_calls\[0\]\.id must be a string", "messages[1].tool_calls[0].id")
    says([good, {**good, "id": 7}], "id must be a string", "messages[1].tool_calls[1].id")
    says([{**good, "type": None}], "type must be 'function'", "messages[1].tool_calls[0].type")
    says([{k: v for k, v in good.items() if k != "type"}], "type must be 'function'", "messages[1].tool_calls[0].type")
    says([{**good, "type": "retrieval"}], "type must be 'function'", "messages[1].tool_calls[0].type")
    says([{"id": "c1", "type": "function"}], "function must be an object", "messages[1].tool_calls[0].function")
    says([{**good, "function": "ls"}], "function must be an object", "messages[1].tool_calls[0].function")
    says([{**good, "function": {"arguments": "{}"}}], "name must be a non-empty string", "messages[1].tool_calls[0].function.name")
    says([{**good, "function": {"name": 3, "arguments": "{}"}}], "name must be a non-empty string", "messages[1].tool_calls[0].function.name")
    says([{**good, "function": {"name": "ls"}}], "arguments must be a string .* or an object, got null", "messages[1].tool_calls[0].function.arguments")
    for other, kind in ((["/"], "array"), (3, "number"), (True, "boolean")):
        says([{**good, "function": {"name": "ls", "arguments": other}}], f"arguments must be a string .* or an object, got {kind}",
             "messages[1].tool_calls[0].function.arguments")
    # the OpenAI shape is served (unknown keys too, as vLLM's TypedDicts ignore them); arguments are not parsed
    # (OpenAI: "the model does not always generate valid JSON"); an empty list is no call; arguments as an object
    # are served as newer vLLM serves them (they were a 400 here)
    obj = {**good, "function": {"name": "ls", "arguments": {"path": "/"}}}
    for calls in ([good], [good, {**good, "id": "", "extra": 1, "function": {"name": "f", "arguments": "not json"}}], [], [obj], [good, obj]):
        body = msgspec.json.encode({"messages": [{"role": "assistant", "content": None, "tool_calls": calls}]})
        assert api.parse_chat(body).messages[0].tool_calls == calls
        assert api.parse_tokenize(body).messages[0].tool_calls == calls


def test_chat_top_logprobs_zero_without_logprobs_is_the_default():
    """vLLM's ``top_logprobs`` defaults to 0 and clients that fill every field send it: no logprobs are asked for.
    ``top_logprobs`` > 0 without ``logprobs: true`` is vLLM's 400."""
    req = api.parse_chat(b'{"messages": [{"role": "user", "content": "x"}], "logprobs": false, "top_logprobs": 0}')
    assert req.top_logprobs == 0 and api.logprobs_asked(req) is None and api.sampling(req) is None
    bad(api.parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs")


def test_logprobs_ask_reaches_the_nodes_sampling():
    """Chat ``logprobs: true`` → ``Sampling.logprobs`` = ``top_logprobs`` (0 unset); completions ``logprobs`` N → N;
    a greedy request that asks is sent a Sampling (else it would be None = nothing asked)."""
    chat = api.parse_chat(b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 3}')
    assert api.logprobs_asked(chat) == 3 and api.sampling(chat) == Sampling(logprobs=3)
    chat0 = api.parse_chat(b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true}')
    assert api.sampling(chat0) == Sampling(logprobs=0)
    comp, _ = api.parse_completion(b'{"prompt": "x", "logprobs": 0, "temperature": 0.5}')
    assert api.sampling(comp) == Sampling(temperature=0.5, logprobs=0)
    comp5, _ = api.parse_completion(b'{"prompt": "x", "logprobs": 5}')
    assert api.logprobs_asked(comp5) == 5
    plain, _ = api.parse_completion(b'{"prompt": "x"}')
    assert api.logprobs_asked(plain) is None and api.sampling(plain) is None


TEXT = {1: "He", 2: "llo", 3: " wor", 4: "é"}


def test_chat_logprobs_shape():
    """OpenAI's / vLLM's ``ChatCompletionLogProbs``: ``content`` items ``token``, ``logprob``, ``bytes``
    (UTF-8), ``top_logprobs`` cut at ``top``; -inf is vLLM's -9999.0, NaN (not computed) null."""
    entries = [(1, -0.5, [1, 3, 2], [-0.5, -1.0, -2.0]), (4, -float("inf"), [2, 4], [-0.1, -float("inf")])]
    out = api.chat_logprobs(entries, 2, TEXT.__getitem__)
    assert out == {"content": [
        {"token": "He", "logprob": -0.5, "bytes": [72, 101], "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]}, {"token": " wor", "logprob": -1.0, "bytes": [32, 119, 111, 114]}]},
        {"token": "é", "logprob": -9999.0, "bytes": [195, 169], "top_logprobs": [
            {"token": "llo", "logprob": -0.1, "bytes": [108, 108, 111]}, {"token": "é", "logprob": -9999.0, "bytes": [195, 169]}]},
    ]}  # fmt: skip
    assert api.chat_logprobs([(1, float("nan"), [], [])], 0, TEXT.__getitem__)["content"][0]["logprob"] is None
    body = api.chat_response("chatcmpl-x", 1, "m", "Hé", "length", api.usage(1, 2, 0), logprobs=out)
    assert body["choices"][0]["logprobs"] is out
    chunk = api.chat_chunk("chatcmpl-x", 1, "m", {"content": "He"}, None, False, logprobs=out)
    assert chunk["choices"][0]["logprobs"] is out
    assert api.chat_chunk("chatcmpl-x", 1, "m", {}, None, False)["choices"][0]["logprobs"] is None


def test_completion_logprobs_shape():
    """vLLM's ``CompletionLogProbs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per token of
    the ``top`` most likely and the chosen token), ``text_offset`` (characters, from ``offset``)."""
    entries = [(1, -0.5, [3, 1], [-0.4, -0.5]), (2, -2.0, [3, 1], [-0.2, -0.3]), (4, -1.0, [], [])]
    out = api.completion_logprobs(entries, 1, TEXT.__getitem__, offset=7)
    assert out == {
        "tokens": ["He", "llo", "é"],
        "token_logprobs": [-0.5, -2.0, -1.0],
        "top_logprobs": [{" wor": -0.4, "He": -0.5}, {" wor": -0.2, "llo": -2.0}, {"é": -1.0}],
        "text_offset": [7, 9, 12],
    }
    body = api.completion_response("cmpl-x", 1, "m", "Hello", "length", api.usage(1, 3, 0), logprobs=out)
    assert body["choices"][0]["logprobs"] is out
    assert api.completion_chunk("cmpl-x", 1, "m", "He", None, False, logprobs=out)["choices"][0]["logprobs"] is out


def test_completion_logprobs_ids_with_one_text_keep_the_likeliest():
    """Byte pieces of one character each decode alone to U+FFFD: in the legacy dict (keyed by text)
    they share one key, which keeps the likeliest one's logprob, so a greedy token's entry is its own
    (the last one's used to win: a live torch run answered a greedy token's entry with a less likely
    piece's logprob)."""
    text = {5: "\ufffd", 6: "\ufffd", 7: "\ufffd", 1: "He"}
    entries = [(5, -0.3, [5, 6, 1, 7], [-0.3, -0.9, -1.1, -2.0])]
    out = api.completion_logprobs(entries, 4, text.__getitem__)
    assert out["top_logprobs"] == [{"\ufffd": -0.3, "He": -1.1}]
    assert out["tokens"] == ["\ufffd"] and out["token_logprobs"] == [-0.3]


def test_sampling_parameters_go_to_the_nodes_and_bad_ones_are_named():
    """``temperature`` / ``top_p`` / ``top_k`` / ``min_p`` / ``seed`` / ``stop_token_ids`` become the work's
    ``Sampling`` (None = greedy: the default, and any request with temperature 0 and no stop token ids);
    ``stop`` stays at the router (``stop_strings``). Out-of-range values are 400s naming the field."""
    from shared.messages import Sampling

    def parse(**kw):
        return api.parse_completion(msgspec.json.encode({"prompt": "x", **kw}))[0]

    assert api.sampling(parse()) is None
    assert api.sampling(parse(temperature=0, top_k=5, seed=3)) is None
    sp = api.sampling(parse(temperature=0.8, top_p=0.9, top_k=-1, min_p=0.1, seed=-7, stop_token_ids=[5, 5, 9]))
    assert sp == Sampling(temperature=0.8, top_p=0.9, top_k=0, min_p=0.1, seed=-7, stop_token_ids=[5, 9])
    assert api.sampling(parse(stop_token_ids=[2])) == Sampling(stop_token_ids=[2])  # greedy, but must stop at 2
    chat = api.parse_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], "temperature": 1, "top_k": 4}))
    assert api.sampling(chat) == Sampling(temperature=1.0, top_k=4)
    assert api.stop_strings(parse(stop="END")) == ["END"]
    assert api.stop_strings(parse(stop=["a", "b", "a"])) == ["a", "b"]
    assert api.stop_strings(parse(stop=[])) == []
    assert api.stop_strings(parse()) == []

    def param(**kw) -> str | None:
        with pytest.raises(api.ApiError) as ei:
            parse(**kw)
        assert ei.value.status == 400
        return ei.value.param

    assert param(temperature=-0.5) == "temperature"
    assert param(top_p=0) == "top_p"
    assert param(top_p=1.01) == "top_p"
    assert param(top_p=-1) == "top_p"
    assert param(top_k=-2) == "top_k"
    assert param(min_p=1.5) == "min_p"
    assert param(seed=2**63) == "seed"
    assert param(stop_token_ids=[-1]) == "stop_token_ids[0]"
    assert param(stop=["x"] * (api.MAX_STOP + 1)) == "stop"
    assert param(stop="y" * (api.MAX_STOP_LEN + 1)) == "stop"
    assert param(stop=3) == "stop"
    # an empty stop string is a 400 (vLLM's SamplingParams: "stop cannot contain an empty string."); it used to be
    # dropped silently, and this test pinned that, on a wrong claim that vLLM drops it too
    for stop in ("", [""], ["a", ""]):
        assert param(stop=stop) == "stop", stop
        with pytest.raises(api.ApiError, match="empty string"):
            api.parse_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], "stop": stop}))


def test_echo_is_accepted_alone_and_include_stop_str_in_output_is_a_strict_bool():
    """``echo`` was a 400; now it is served (the shell prepends the prompt's text) unless logprobs
    are asked too (they would need the prompt's). ``include_stop_str_in_output`` is vLLM's bool."""
    req, prompt = api.parse_completion(b'{"prompt": [[5, 6]], "echo": true}')
    assert req.echo and prompt == [5, 6] and not req.include_stop_str_in_output
    req = api.parse_chat(b'{"messages": [{"role": "user", "content": "x"}], "include_stop_str_in_output": true}')
    assert req.include_stop_str_in_output
    bad(api.parse_completion, {"prompt": "x", "include_stop_str_in_output": "yes"}, r"\$.include_stop_str_in_output")


def test_chat_echo_is_the_last_assistant_messages_content_as_in_vllm():
    """vLLM's chat ``echo`` (it was ignored as an unknown field): the reply starts with the last
    message's content when that message is the assistant's (the reply's role), text parts joined by
    newlines (vLLM's conversation parsing); nothing for another role, no content, or echo off. A plain
    bool, as vLLM's (null or a string is a 400 naming it)."""

    def echo(messages: list, on: object = True) -> str:
        return api.chat_echo(api.parse_chat(msgspec.json.encode({"messages": messages, "echo": on})))

    user = {"role": "user", "content": "q"}
    assert echo([user, {"role": "assistant", "content": "The answer is"}]) == "The answer is"
    parts = [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]
    assert echo([user, {"role": "assistant", "content": parts}]) == "a\nb"
    assert echo([user]) == "" and echo([user, {"role": "assistant", "content": None, "tool_calls": []}]) == ""
    assert echo([user, {"role": "assistant", "content": "x"}], on=False) == ""
    assert api.chat_echo(api.parse_chat(b'{"messages": [{"role": "assistant", "content": "x"}]}')) == ""  # off by default
    for on in (None, "true", 1):
        bad(api.parse_chat, {"messages": [user], "echo": on}, r"\$.echo")


def test_stop_reason_is_in_every_choice_as_in_vllm():
    """vLLM's choices always carry ``stop_reason`` (null unless a stop string / stop token id ended the
    output), every completions stream chunk too; a chat stream chunk only with its ``finish_reason``
    (vLLM sets it only there and serializes with ``exclude_unset``). It was left out when null."""
    use = api.usage(1, 1, 0)
    for body in (
        api.completion_response("id", 1, "m", "t", "stop", use),
        api.chat_response("id", 1, "m", "t", "length", use),
        api.completion_chunk("id", 1, "m", "t", None, False),
        api.completion_chunk("id", 1, "m", "t", "length", False),
        api.chat_chunk("id", 1, "m", {}, "stop", False),
    ):
        choice = body["choices"][0]
        assert "stop_reason" in choice and choice["stop_reason"] is None, body
    assert "stop_reason" not in api.chat_chunk("id", 1, "m", {"content": "t"}, None, False)["choices"][0]
    assert api.completion_response("id", 1, "m", "t", "stop", use, stop_reason="\n")["choices"][0]["stop_reason"] == "\n"
    assert api.chat_response("id", 1, "m", "t", "stop", use, stop_reason=7)["choices"][0]["stop_reason"] == 7
    assert api.chat_chunk("id", 1, "m", {}, "stop", False, stop_reason="x")["choices"][0]["stop_reason"] == "x"
    assert api.completion_chunk("id", 1, "m", "", "stop", False, stop_reason="x")["choices"][0]["stop_reason"] == "x"


def test_a_huge_top_k_is_off_and_the_work_passes_the_nodes_check():
    """``top_k`` above any vocabulary (the API takes any int ≥ -1, up to 2^64 and past it) keeps every
    token, so it goes out as 0 (off): sent as is, the nodes' message check (``top_k`` ≤ 2^32) dropped
    the work and the request waited for a node that never saw it."""
    from shared import validate
    from shared.messages import PrefillWork, Sampling

    for k in (2**32 + 1, 2**63, 2**64 - 1, 2**64, 10**30):
        req = api.parse_completion(msgspec.json.encode({"prompt": "x", "temperature": 1.0, "top_k": k}))[0]
        sp = api.sampling(req)
        assert sp == Sampling(temperature=1.0), (k, sp)
        work = PrefillWork(rid="r1", prompt_tokens=1, max_tokens=1, block_size=16, block_hashes=[], sampling=sp)
        assert validate.check(msgspec.msgpack.decode(msgspec.msgpack.encode(work), type=PrefillWork)) is None
    sp = api.sampling(api.parse_completion(msgspec.json.encode({"prompt": "x", "temperature": 1.0, "top_k": 2**32}))[0])
    assert sp is not None and sp.top_k == 2**32  # the largest the nodes take: sent as is


def test_vllm_extras_no_engine_honours_are_a_400_naming_the_field():
    """vLLM's guided-decoding extras and prompt_logprobs were unknown fields, ignored: a 200 with free text (or no
    prompt logprobs), while response_format json_object and suffix got a 400. Each is now a 400 naming it, on both
    endpoints (the [text] prompt form too); null, their default, is accepted."""
    msgs = [{"role": "user", "content": "x"}]
    for field, value in (
        ("guided_json", {"type": "object"}), ("guided_regex", "[0-9]+"), ("guided_choice", ["yes", "no"]),
        ("guided_grammar", "root ::= 'a'"), ("structured_outputs", {"json": {"type": "object"}}), ("prompt_logprobs", 0),
        ("guided_choice", []),
    ):
        for parse, body in ((api.parse_chat, {"messages": msgs}), (api.parse_completion, {"prompt": "hi"}),
                            (api.parse_completion, {"prompt": ["hi"]})):
            with pytest.raises(api.ApiError) as e:
                parse(msgspec.json.encode({**body, field: value}))
            assert e.value.status == 400 and e.value.param == field, (field, value, parse)
            assert str(e.value).startswith(f"{field} is not supported") and f"omit {field}" in str(e.value)
        assert api.parse_chat(msgspec.json.encode({"messages": msgs, field: None})).messages
        assert api.parse_completion(msgspec.json.encode({"prompt": "hi", field: None}))[1] == "hi"
    assert "guided decoding" in _reason(api.parse_chat, {"messages": msgs, "guided_regex": "a"})
    assert "prompt's logprobs" in _reason(api.parse_completion, {"prompt": "hi", "prompt_logprobs": 1})
    assert api.parse_chat(msgspec.json.encode({"messages": msgs, "guided_decoding_backend": "xgrammar"})).messages  # no effect alone


def _reason(parse, body: dict) -> str:
    with pytest.raises(api.ApiError) as e:
        parse(msgspec.json.encode(body))
    return str(e.value)


def test_an_output_constraint_no_engine_enforces_is_a_400_naming_the_field():
    """vLLM enforces response_format json_object / json_schema and a forced tool_choice by guided decoding; no
    engine here does, so they are refused (were validated and ignored: a JSON-mode client got free text).
    What the output is anyway (type text; tool_choice none / auto) is still accepted."""
    msgs = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for field, value in (
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}),
        ("response_format", {}),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("tool_choice", "sometimes"),
    ):
        with pytest.raises(api.ApiError) as e:
            api.parse_chat(msgspec.json.encode({"messages": msgs, "tools": [tool], field: value}))
        assert e.value.status == 400 and e.value.param == field, (field, value)
        assert field in str(e.value) and ("not supported" in str(e.value) or value == "sometimes")
    for extra in ({"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"tool_choice": None}):
        assert api.parse_chat(msgspec.json.encode({"messages": msgs, "tools": [tool], **extra})).messages


def test_tool_choice_is_what_vllm_serves():
    """vLLM's check_tool_usage: tools without tool_choice are 'auto'; an explicit null or no tools is 'none'; a
    tool_choice other than none without tools is a 400 (it was accepted, and 'auto' served as text)."""
    msgs = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f"}}

    def choice(**extra: object) -> object:
        return api.tool_choice(api.parse_chat(msgspec.json.encode({"messages": msgs, **extra})))

    assert choice() == "none"
    assert choice(tools=[tool]) == "auto"
    assert choice(tools=[]) == "none"
    assert choice(tools=[tool], tool_choice=None) == "none"
    assert choice(tools=[tool], tool_choice="none") == "none"
    assert choice(tools=[tool], tool_choice="auto") == "auto"
    assert choice(tool_choice="none") == "none" and choice(tool_choice=None) == "none"
    for value in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(api.ApiError, match="When using `tool_choice`, `tools` must be set") as e:
            api.parse_chat(msgspec.json.encode({"messages": msgs, "tool_choice": value}))
        assert e.value.status == 400 and e.value.param == "tool_choice"


QWEN_TOOL_TEMPLATE = (  # Qwen2.5's assistant turn with tool calls, as its chat template writes it
    "{%- for message in messages %}{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}"
    "{%- endif %}{%- for tool_call in message.tool_calls or [] %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_chat_messages_give_a_template_an_assistant_calls_arguments_as_an_object_as_vllm(tmp_path):
    """vLLM's ``_postprocess_messages``: an assistant message's ``tool_calls[i].function.arguments`` (JSON text in the
    request) reaches the chat template as the decoded object: empty → ``{}``; not valid JSON, or not an object
    (``[1]``, ``42``) → ``{}`` (vLLM coerces it so that a conversation with one bad call in its history can go on);
    an empty ``tool_calls`` list is dropped. Before, the text went as it was: Qwen2.5's ``arguments | tojson``
    rendered it as a JSON string, double-encoded (``"arguments": "{\\"city\\": ..."``), unlike what the model wrote.
    The request's own messages are not changed; other roles' calls are passed as before."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    import json

    from shared.tokenizer import load_tokenizer
    from tests.unit.router.helpers import write_bpe_tokenizer

    def call(args: str, name: str = "get_weather") -> dict:
        return {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}

    calls = [call('{"city": "Paris", "unit": "°C"}'), call(""), call("{not json"), call("[1]"), call("42"), call("[" * 3000)]
    body = {"messages": [
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}, {"role": "assistant", "content": "ok", "tool_calls": []},
    ]}
    req = api.parse_chat(msgspec.json.encode(body))
    msgs = api.chat_messages(req)
    assert [c["function"]["arguments"] for c in msgs[1]["tool_calls"]] == [{"city": "Paris", "unit": "°C"}, {}, {}, {}, {}, {}]
    # arguments sent as an object reach the template as they are (vLLM's), an empty one too
    as_obj = {"messages": [body["messages"][0], {"role": "assistant", "content": None, "tool_calls": [
        {**calls[0], "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}},
        {**calls[0], "function": {"name": "f", "arguments": {}}}]}]}  # fmt: skip
    got = api.chat_messages(api.parse_chat(msgspec.json.encode(as_obj)))[1]["tool_calls"]
    assert [c["function"]["arguments"] for c in got] == [{"city": "Paris", "unit": "°C"}, {}]
    assert msgs[1]["tool_calls"][0] == {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}
    assert "tool_calls" not in msgs[3]
    assert req.messages[1].tool_calls == calls and req.messages[3].tool_calls == []  # the request as sent

    folder = write_bpe_tokenizer(tmp_path / "tok")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_TOOL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(f"hf:{folder}")
    one = {"messages": [body["messages"][0], {"role": "assistant", "content": None, "tool_calls": calls[:1]}]}
    text = tok.decode(api.render_chat(tok, api.parse_chat(msgspec.json.encode(one))), skip_special_tokens=False)
    # what the model wrote for the call (toolcalls.parse_body's json.dumps of it), not a JSON string of it
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>' in text, text
    one_obj = {"messages": as_obj["messages"][:1] + [{**as_obj["messages"][1], "tool_calls": as_obj["messages"][1]["tool_calls"][:1]}]}
    assert tok.decode(api.render_chat(tok, api.parse_chat(msgspec.json.encode(one_obj))), skip_special_tokens=False) == text
