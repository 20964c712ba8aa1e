"""vLLM's chat-template request fields on the router's HTTP API, live (a real nats-server, the router in-process
with the fake cluster of ``test_router_live``, a real byte-level BPE ``--tokenizer hf:``):

- ``chat_template_kwargs`` reach the chat template as variables (``{"enable_thinking": false}``, how Qwen3 users
  turn thinking off in vLLM); before, they were accepted and ignored (200, the prompt unchanged);
- a request's own ``chat_template`` is refused with vLLM's 400 unless the router runs with
  ``--trust-request-chat-template`` (then it is rendered); before, it was accepted and ignored;
- a model whose template uses ``{% continue %}`` is served (before, the router refused to start: "Encountered
  unknown tag 'continue'").

``/tokenize`` renders as ``/v1/chat/completions`` does, so its ids are the ones the node gets."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from services.router import api
from tests.integration.test_router_live import router_env

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there, how are you?"}]
THINKING_TEMPLATE = (  # Qwen3's switch; the system turn skipped with {% continue %} (loop controls)
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
REQUEST_TEMPLATE = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"


def _folder(tmp_path: Any) -> Any:
    from tests.unit.router.helpers import write_bpe_tokenizer

    folder = write_bpe_tokenizer(tmp_path / "tok")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


async def _served_ids(env: Any, body: dict[str, Any]) -> list[int]:
    """The prompt ids the node got for ``body`` (a chat completion of 1 token), checked against the usage and
    against ``/tokenize`` of the same messages and template fields."""
    r = await env.http.post("/v1/chat/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    ids: list[int] = np.frombuffer(env.cluster.works[-1].token_ids, "<u4").tolist()
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    tok = await env.http.post("/tokenize", json=body)
    assert tok.status_code == 200 and tok.json()["tokens"] == ids, tok.text
    return ids


async def test_chat_template_kwargs_reach_the_template_as_vllm(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{_folder(tmp_path)}") as env:
        tok = env.service.tokenizer
        plain = await _served_ids(env, {"messages": USER})
        assert tok.decode(plain, skip_special_tokens=False) == "<|im_start|>user\nhello there, how are you?<|im_end|>\n<|im_start|>assistant\n"
        off = await _served_ids(env, {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
        assert tok.decode(off, skip_special_tokens=False) == tok.decode(plain, skip_special_tokens=False) + "<think>\n\n</think>\n\n"
        # a variable the template does not read changes nothing (vLLM drops it); the request's own
        # add_generation_prompt wins over one in chat_template_kwargs (vLLM's merge)
        assert await _served_ids(env, {"messages": USER, "chat_template_kwargs": {"enable_thinking": True, "other": [1]}}) == plain
        assert await _served_ids(env, {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}) == plain
        for path in ("/v1/chat/completions", "/tokenize"):
            for key, value in (("tools", []), ("messages", []), ("tokenize", True), ("documents", "text")):
                r = await env.http.post(path, json={"messages": USER, "max_tokens": 1, "chat_template_kwargs": {key: value}})
                assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}", (path, r.text)
            r = await env.http.post(path, json={"messages": USER, "chat_template_kwargs": ["enable_thinking"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", (path, r.text)


async def test_a_requests_chat_template_needs_the_trust_flag_as_vllm(nats_url, tmp_path):
    folder = _folder(tmp_path)
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}") as env:
        n = len(env.cluster.works)
        for path in ("/v1/chat/completions", "/tokenize"):
            for body, param in (({"chat_template": REQUEST_TEMPLATE}, "chat_template"),
                                ({"chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE}}, "chat_template_kwargs.chat_template")):
                r = await env.http.post(path, json={"messages": USER, "max_tokens": 1, **body})
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["message"] == api.UNTRUSTED_CHAT_TEMPLATE and r.json()["error"]["param"] == param
        assert len(env.cluster.works) == n  # nothing dispatched
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}", trust_request_chat_template=True) as env:
        tok = env.service.tokenizer
        want = "[SYSTEM] Be brief.\n[USER] hello there, how are you?\n[ASSISTANT]"
        assert await _served_ids(env, {"messages": USER, "chat_template": REQUEST_TEMPLATE}) == tok.encode(want, add_special_tokens=False)
        assert await _served_ids(env, {"messages": USER, "chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE}}) == tok.encode(want, add_special_tokens=False)
        for path in ("/v1/chat/completions", "/tokenize"):
            r = await env.http.post(path, json={"messages": USER, "max_tokens": 1, "chat_template": "{% for %}"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
            assert "invalid chat template" in r.json()["error"]["message"]
            r = await env.http.post(path, json={"messages": USER, "max_tokens": 1, "chat_template": "{{ raise_exception('no system turns') }}"})
            assert r.status_code == 400 and "no system turns" in r.json()["error"]["message"], r.text
            r = await env.http.post(path, json={"messages": USER, "max_tokens": 1, "chat_template": "{{ ''.__class__.__mro__ }}"})
            assert r.status_code == 400, r.text  # the sandbox holds
