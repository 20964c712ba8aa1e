"""vLLM's utility endpoints in ``api.py`` (sans-IO): ``/version``, ``/tokenize``, ``/detokenize`` bodies,
``max_model_len`` in ``/v1/models``, and the router's CORS settings (vLLM's ``--allowed-origins`` ...)."""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

import pytest

from services.router import api
from services.router.config import RouterConfig
from shared.config import ConfigError, load_config

USER = [{"role": "user", "content": "hello there"}]


def _err(fn, body: object) -> api.ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(api.ApiError) as ei:
        fn(raw)
    return ei.value


def test_version_is_the_package_metadata_version():
    assert api.version_response() == {"version": importlib.metadata.version("evolving-infra")}


def test_tokenize_picks_chat_by_messages_as_vllm_and_keeps_its_fields():
    req = api.parse_tokenize(json.dumps({"model": "m", "messages": USER, "return_token_strs": True}).encode())
    assert isinstance(req, api.TokenizeChatRequest)
    assert req.add_generation_prompt and not req.add_special_tokens and req.return_token_strs
    assert api.chat_messages(req) == [{"role": "user", "content": "hello there"}]
    req = api.parse_tokenize(b'{"prompt": "hi", "vendor_extension": 1}')  # unknown fields ignored, as elsewhere
    assert isinstance(req, api.TokenizeCompletionRequest) and req.prompt == "hi" and req.add_special_tokens
    assert req.model is None and not req.return_token_strs


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": 3}, "prompt"),
        ({"prompt": ["a"]}, "prompt"),
        ({}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
        ({"messages": USER, "add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"prompt": "x", "add_special_tokens": 0}, "add_special_tokens"),
        ({"prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    ],
)
def test_tokenize_bad_input_is_a_400_naming_the_field(body, param):
    e = _err(api.parse_tokenize, body)
    assert e.status == 400 and e.param == param, (e.reason, e.param)


def test_tokenize_refuses_both_generation_prompt_and_continue_with_vllms_message():
    e = _err(api.parse_tokenize, {"messages": USER, "continue_final_message": True})
    assert e.reason == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


def test_tokenize_and_chat_take_vllms_chat_template_options():
    """``add_generation_prompt`` false, ``continue_final_message`` (with it false) and ``add_special_tokens``
    either way are the router's options on /tokenize and /v1/chat/completions (they were 400s on
    /tokenize and silently ignored on chat); the chat's reply role follows vLLM's ``get_chat_request_role``."""
    opened = [*USER, {"role": "assistant", "content": "Once"}]
    body = {"messages": opened, "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True}
    req = api.parse_tokenize(json.dumps(body).encode())
    assert isinstance(req, api.TokenizeChatRequest) and req.continue_final_message and not req.add_generation_prompt and req.add_special_tokens
    req = api.parse_tokenize(b'{"prompt": "x", "add_special_tokens": false}')
    assert isinstance(req, api.TokenizeCompletionRequest) and not req.add_special_tokens
    chat = api.parse_chat(json.dumps({**body, "echo": True}).encode())
    assert chat.continue_final_message and not chat.add_generation_prompt and chat.add_special_tokens
    assert api.reply_role(chat) == "assistant" and api.chat_echo(chat) == "Once"
    as_user = api.parse_chat(json.dumps({"messages": USER, "add_generation_prompt": False, "echo": True}).encode())
    assert api.reply_role(as_user) == "user" and api.chat_echo(as_user) == "hello there"  # vLLM: the last message's role
    assert api.reply_role(api.parse_chat(json.dumps({"messages": USER}).encode())) == "assistant"
    assert not api.parse_completion(b'{"prompt": "x", "add_special_tokens": false}')[0].add_special_tokens
    e = _err(api.parse_chat, {"messages": opened, "continue_final_message": True})
    assert e.param == "continue_final_message" and e.reason.startswith("Cannot set both")


@pytest.mark.parametrize("tokens", [[99999999999], [2**70], [-1], [1, -(2**70)]])
def test_detokenize_ids_of_any_size_get_the_vocabulary_message(tokens):
    """An id past 2^32 (or below 0) is the documented ``outside the vocabulary`` 400 naming ``tokens[i]``, not
    msgspec's ``Expected `int` <= 4294967295`` (the decoder's bound answered first)."""
    req = api.parse_detokenize(json.dumps({"tokens": tokens}).encode())
    with pytest.raises(api.ApiError) as e:
        api.check_token_ids(req.tokens, 1000)
    bad = len(tokens) - 1
    assert e.value.reason == f"token id {tokens[bad]} is outside the vocabulary [0, 1000)" and e.value.param == f"tokens[{bad}]"


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b"[" * 100_000 + b"]" * 100_000])
def test_tokenize_body_not_an_object_is_a_400(raw):
    assert _err(api.parse_tokenize, raw).status == 400
    assert _err(api.parse_detokenize, raw).status == 400


def test_detokenize_body_and_vocabulary_check():
    req = api.parse_detokenize(b'{"model": "m", "tokens": [0, 5, 7]}')
    assert req.tokens == [0, 5, 7] and req.model == "m"
    assert api.parse_detokenize(b'{"tokens": []}').tokens == []
    for body, param in (({"tokens": "1 2"}, "tokens"), ({}, "tokens"), ({"tokens": [1.5]}, "tokens[0]")):
        e = _err(api.parse_detokenize, body)
        assert e.status == 400 and e.param == param, (body, e.reason, e.param)
    api.check_token_ids([0, 9], 10)
    with pytest.raises(api.ApiError) as ei:
        api.check_token_ids([0, 9, 10, 11], 10)
    assert ei.value.status == 400 and ei.value.param == "tokens[2]" and "[0, 10)" in ei.value.reason


def _tokenize_response(ids: list[int], max_model_len: int, token_strs: list[str] | None = None) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse``: what ``api.tokenize_response_json`` encodes (the reference it is checked against)."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


def test_tokenize_response_is_vllms_shape():
    import msgspec

    assert msgspec.json.decode(api.tokenize_response_json([4, 5], 100)) == _tokenize_response([4, 5], 100)
    assert msgspec.json.decode(api.tokenize_response_json([4], 100, ["a"]))["token_strs"] == ["a"]


def test_tokenize_answer_is_encoded_a_piece_at_a_time_as_the_one_call_encodes_it():
    """``/tokenize`` of a 60 MB prompt (31M ids) encoded its 189 MB answer on the event loop in one ``msgspec`` call,
    which holds the GIL: every other request waited 1-2.5 s. The answer is now encoded in the worker thread a piece
    at a time: the same bytes, and a thread waking every 1 ms waits a small part of the call (one call: most of it)."""
    import msgspec

    from services.router import api as router_api
    from tests.unit.shared.test_tokenizer import _longest_stall_s

    piece = router_api._JSON_PIECE
    for ids, strs in (([], None), ([4, 5], ["a", 'q"\\ é\n']), (list(range(2 * piece + 3)), None),
                      (list(range(piece + 1)), [f"<{i}>\u2028" for i in range(piece + 1)])):
        want = msgspec.json.encode(_tokenize_response(ids, 100, strs))
        assert api.tokenize_response_json(ids, 100, strs) == want
    ids = [92928] * 12_000_000
    stall, wall = _longest_stall_s(api.tokenize_response_json, ids, 256)
    assert wall > 0.05 and stall < 0.3 * wall, (stall, wall)


def test_models_entry_has_max_model_len_when_given():
    entry = api.models_response(("m",), 7, 4096)["data"][0]
    assert entry == {"id": "m", "object": "model", "created": 7, "owned_by": "evolving-infra", "max_model_len": 4096}
    assert "max_model_len" not in api.models_response(["m"], 7)["data"][0]


def test_models_lists_every_served_name_in_order():
    """vLLM's /v1/models has one ModelCard per --served-model-name; a str (one name's letters) is refused."""
    assert [e["id"] for e in api.models_response(("a", "b"), 7, 64)["data"]] == ["a", "b"]
    with pytest.raises(TypeError, match="sequence of names"):
        api.models_response("ab", 7)


def test_cors_flags_follow_the_config_rules_and_default_to_off():
    cfg = load_config(RouterConfig, [], prog="router", env={})
    assert cfg.allowed_origins == [] and cfg.allowed_methods == ["*"] and cfg.allowed_headers == ["*"] and not cfg.allow_credentials
    cfg = load_config(
        RouterConfig, ["--allowed-origins", "https://b.example,https://app.example:8443", "--allowed-methods", "GET,POST", "--allow-credentials"],
        prog="router", env={"EI_ALLOWED_HEADERS": "authorization,content-type"},
    )
    assert cfg.allowed_origins == ["https://b.example", "https://app.example:8443"] and cfg.allowed_methods == ["GET", "POST"]
    assert cfg.allowed_headers == ["authorization", "content-type"] and cfg.allow_credentials
    with pytest.raises(ConfigError, match="allowed_origins"):  # vLLM's JSON-list spelling is refused, not half-read
        load_config(RouterConfig, ["--allowed-origins", '["*"]'], prog="router", env={})
    with pytest.raises(ConfigError, match="allowed_origins"):
        load_config(RouterConfig, ["--allowed-origins", "https://app.example/path"], prog="router", env={})


def test_cors_credentials_with_any_origin_is_refused():
    """``--allow-credentials`` with ``--allowed-origins '*'``: Starlette's middleware answers such a
    config by echoing every request's Origin with ``Access-Control-Allow-Credentials: true`` (browsers
    refuse a literal ``*`` with credentials, so it reflects instead), which lets any web page send a
    visitor's credentials. Refused at start, naming the flags; '*' alone and listed origins with
    credentials still load."""
    for argv in (["--allowed-origins", "*", "--allow-credentials"], ["--allowed-origins", "https://a.example,*", "--allow-credentials"]):
        with pytest.raises(ConfigError, match="allow_credentials"):
            load_config(RouterConfig, argv, prog="router", env={})
    assert load_config(RouterConfig, ["--allowed-origins", "*"], prog="router", env={}).allowed_origins == ["*"]
    cfg = load_config(RouterConfig, ["--allowed-origins", "https://a.example"], prog="router", env={"EI_ALLOW_CREDENTIALS": "1"})
    assert cfg.allow_credentials
