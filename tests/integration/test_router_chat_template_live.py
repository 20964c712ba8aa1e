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


LOOPING_TEMPLATE = "{% for i in range(20000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x"
"""2e8 empty loop turns: ~20 s of a core in-process (1e6 took 0.11 s here); the review's version (three nested
range(100000)) never ends."""


async def _poll_healthz(env: Any, stop: Any, latencies: list[float]) -> None:
    import asyncio
    import time

    while not stop.is_set():
        t0 = time.monotonic()
        r = await env.http.get("/healthz")
        assert r.status_code == 200, r.text
        latencies.append(time.monotonic() - t0)
        await asyncio.sleep(0.05)


async def test_a_request_template_that_loops_is_cut_at_the_deadline_in_a_child_process(nats_url, tmp_path):
    """A request template is rendered in a child process with a deadline: a template that loops gets a 400 naming
    ``chat_template`` ("took longer than 2 s to render") within the deadline, while /healthz and other requests
    are answered as usual. Before, it rendered on the router's event loop (or in a worker thread that never ended):
    the router stopped answering anything for its length (the review: 26 s for 181 bytes; a never-ending one got
    the router killed by ``up``'s liveness watch)."""
    import asyncio
    import time

    from services.router import template_pool

    folder = _folder(tmp_path)
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}", trust_request_chat_template=True) as env:
        pool = env.service._templates
        assert pool is not None
        pids = [c.proc.pid for c in pool._all]
        assert len(pids) == template_pool.POOL_SIZE
        stop, latencies = asyncio.Event(), []
        poller = asyncio.create_task(_poll_healthz(env, stop, latencies))
        try:
            for path in ("/v1/chat/completions", "/tokenize"):
                t0 = time.monotonic()
                slow = asyncio.create_task(env.http.post(path, json={"messages": USER, "max_tokens": 1, "chat_template": LOOPING_TEMPLATE}))
                await asyncio.sleep(0.3)
                # meanwhile: a chat with the model's template, and one with a request template that renders at once
                t1 = time.monotonic()
                assert (await env.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})).status_code == 200
                assert await _served_ids(env, {"messages": USER, "chat_template": REQUEST_TEMPLATE}) == env.service.tokenizer.encode(
                    "[SYSTEM] Be brief.\n[USER] hello there, how are you?\n[ASSISTANT]", add_special_tokens=False)
                assert time.monotonic() - t1 < 1.5
                r = await slow
                took = time.monotonic() - t0
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == "chat_template" and err["message"] == "chat_template: took longer than 2 s to render", err
                assert template_pool.RENDER_DEADLINE_S <= took < template_pool.RENDER_DEADLINE_S + 2.0, took
        finally:
            stop.set()
            await poller
        assert len(latencies) > 20 and max(latencies) < 0.5, max(latencies)
        assert pool.killed == 2
        await asyncio.sleep(0)
        # the killed children are replaced: a request after renders
        assert await _served_ids(env, {"messages": USER, "chat_template": REQUEST_TEMPLATE})
        pids += [c.proc.pid for c in pool._all]
    import os

    for pid in pids:  # every child is gone with the router
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split()[2] == "Z", pid  # a zombie at most (reaped by the loop's child watcher)


async def test_request_template_limits_length_memory_and_busy_children(nats_url, tmp_path):
    """A request template over 64 KiB is refused before it is compiled (a 683 KB one compiled 10 s in the router);
    one that allocates past the child's memory cap is a 400, not the router's memory; big bodies (rendered off the
    event loop) with looping templates no longer pin worker threads: when every child is busy the rest get a 503
    at once and a big /tokenize is answered meanwhile (before: 7 such requests took every thread of
    ``asyncio.to_thread``'s pool, and every big body hung)."""
    import asyncio
    import time

    from services.router import template_pool

    folder = _folder(tmp_path)
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}", trust_request_chat_template=True) as env:
        big = "{# " + "x" * template_pool.MAX_TEMPLATE_CHARS + " #}"
        r = await env.http.post("/tokenize", json={"messages": USER, "chat_template": big})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template" and "at most 65536" in r.text, r.text
        r = await env.http.post("/tokenize", json={"messages": USER, "chat_template_kwargs": {"chat_template": big}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.chat_template", r.text
        # an empty template is none (the model's), as vLLM
        assert (await env.http.post("/tokenize", json={"messages": USER, "chat_template": ""})).json()["tokens"] == \
            (await env.http.post("/tokenize", json={"messages": USER})).json()["tokens"]
        hog = "{% set ns = namespace(s='x' * 1000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"
        r = await env.http.post("/tokenize", json={"messages": USER, "chat_template": hog})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert "memory" in r.json()["error"]["message"] or "took longer" in r.json()["error"]["message"], r.text
        await asyncio.sleep(1.0)  # the child replaced
        pad = [{"role": "user", "content": "word " * 8000}]  # a 40 KB body: parsed and rendered off the event loop
        t0 = time.monotonic()
        slow = [asyncio.create_task(env.http.post("/tokenize", json={"messages": pad, "chat_template": LOOPING_TEMPLATE})) for _ in range(7)]
        await asyncio.sleep(0.5)
        t1 = time.monotonic()
        r = await env.http.post("/tokenize", json={"messages": pad})
        assert r.status_code == 200 and time.monotonic() - t1 < 1.5, (r.text[:200], time.monotonic() - t1)
        codes = sorted([(x.status_code, x.json()["error"]["message"]) for x in await asyncio.gather(*slow)])
        assert time.monotonic() - t0 < template_pool.RENDER_DEADLINE_S + template_pool.QUEUE_DEADLINE_S + 3.0
        assert all(c in (400, 503) for c, _ in codes), codes
        assert any(c == 503 and "busy" in m for c, m in codes), codes


async def test_a_models_named_templates_are_picked_as_transformers(nats_url, tmp_path):
    """A model with named templates (``tokenizer_config.json`` ``chat_template`` as a list): a chat with tools
    renders ``tool_use``, one without ``default``, and a trusted request's ``chat_template`` that is a name selects
    that template of the model (rendered by the router itself: it is the operator's, as transformers'
    ``get_chat_template``, which vLLM goes through). Before, ``default`` always, and a name rendered as the literal
    word."""
    from tests.unit.router.helpers import write_bpe_tokenizer

    folder = write_bpe_tokenizer(tmp_path / "named")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"},
        {"name": "tool_use", "template": "[tools]{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "rag", "template": "[rag]{% for m in messages %}{{ m.content }}{% endfor %}"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}", trust_request_chat_template=True) as env:
        tok = env.service.tokenizer
        assert tok.decode(await _served_ids(env, {"messages": USER}), skip_special_tokens=False).startswith("<|im_start|>system")
        got = (await env.http.post("/tokenize", json={"messages": USER, "tools": tools})).json()["tokens"]
        assert tok.decode(got, skip_special_tokens=False) == "[tools]Be brief.hello there, how are you?"
        rag = await _served_ids(env, {"messages": USER, "chat_template": "rag"})
        assert tok.decode(rag, skip_special_tokens=False) == "[rag]Be brief.hello there, how are you?"
        assert env.service._templates is not None and env.service._templates.killed == 0


async def test_documents_and_reasoning_effort_reach_the_template_as_vllm(nats_url, tmp_path):
    """vLLM's ``documents`` (over ``chat_template_kwargs.documents`` unless null) and ``reasoning_effort`` (the
    template's ``reasoning_effort``, and ``enable_thinking`` = effort != "none" unless ``chat_template_kwargs`` sets
    it: vLLM's ``build_chat_params``) reach the template; a value outside vLLM's is a 400 naming the field. Before,
    both were accepted and ignored (a 200 without what was asked)."""
    folder = _folder(tmp_path)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% if documents %}{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}{% endif %}"
        "{% if reasoning_effort is defined %}[effort {{ reasoning_effort }}]{% endif %}" + THINKING_TEMPLATE
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}") as env:
        tok = env.service.tokenizer

        async def text(body: dict[str, Any]) -> str:
            return str(tok.decode(await _served_ids(env, {"messages": USER, **body}), skip_special_tokens=False))

        plain = await text({})
        assert "[effort" not in plain and "<think>" not in plain and "[doc" not in plain
        docs = [{"title": "a", "text": "first"}]
        assert (await text({"documents": docs})).startswith("[doc a: first]<|im_start|>user")
        assert (await text({"documents": docs, "chat_template_kwargs": {"documents": [{"title": "b", "text": "x"}]}})).startswith("[doc a: first]<|im_")
        assert (await text({"documents": None, "chat_template_kwargs": {"documents": docs}})).startswith("[doc a: first]<|im_")
        off = await text({"reasoning_effort": "none"})
        assert off.startswith("[effort none]") and off.endswith("<think>\n\n</think>\n\n")
        on = await text({"reasoning_effort": "high"})
        assert on.startswith("[effort high]") and "<think>" not in on
        kept = await text({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
        assert kept.startswith("[effort none]") and "<think>" not in kept
        for path in ("/v1/chat/completions", "/tokenize"):
            for body, param in (({"reasoning_effort": "extreme"}, "reasoning_effort"), ({"documents": ["text"]}, "documents")):
                r = await env.http.post(path, json={"messages": USER, "max_tokens": 1, **body})
                assert r.status_code == 400 and param in r.json()["error"]["message"] + str(r.json()["error"]["param"]), (path, r.text)
