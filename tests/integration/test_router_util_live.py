"""vLLM's small server endpoints on the router: ``/version``, ``/tokenize`` / ``/detokenize``, ``max_model_len``
in ``/v1/models``, CORS (``--allowed-origins`` ...), and API keys on all of them.

Real router over a real nats-server: in-process (uvicorn on a free port) with the fake cluster of
``test_router_live`` answering on the bus, and once as a ``python -m services.router`` process with
the CORS flags and ``EI_API_KEYS``.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from shared.tokenizer import SimTokenizer
from tests.integration.test_router_live import _wait_for, router_env, sse_events

REPO = Path(__file__).resolve().parents[2]
USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there, how are you?"}]
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}


async def test_tokenize_counts_what_a_served_request_uses_and_detokenize_round_trips(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        # chat: count == usage.prompt_tokens of the same chat request served by the cluster
        r = await env.http.post("/tokenize", json={"model": "test-model", "messages": USER, "tools": TOOLS})
        assert r.status_code == 200, r.text
        tok = r.json()
        assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"} and tok["token_strs"] is None
        served = await env.http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
        assert served.status_code == 200, served.text
        assert tok["count"] == len(tok["tokens"]) == served.json()["usage"]["prompt_tokens"] > 0
        work = env.cluster.works[-1]  # the ids the node got are the ones /tokenize returned
        assert work.prompt_tokens == tok["count"] and np.frombuffer(work.token_ids, "<u4").tolist() == tok["tokens"]
        # a prompt: the same count as /v1/completions with that text
        r = await env.http.post("/tokenize", json={"prompt": "The quick brown fox, again.", "return_token_strs": True})
        assert r.status_code == 200, r.text
        tok = r.json()
        served = await env.http.post("/v1/completions", json={"prompt": "The quick brown fox, again.", "max_tokens": 1})
        assert tok["count"] == served.json()["usage"]["prompt_tokens"] == len(SimTokenizer().encode("The quick brown fox, again."))
        # no context: the prompt limit (1,048,576), lowered to what the node's KV holds (the fake's 100 blocks of 64)
        assert len(tok["token_strs"]) == tok["count"] and tok["max_model_len"] == 6400
        # round trip: detokenize → the text that re-tokenizes to the same ids (the sim tokenizer's placeholder words)
        r = await env.http.post("/detokenize", json={"model": "test-model", "tokens": tok["tokens"]})
        assert r.status_code == 200, r.text
        text = r.json()["prompt"]
        assert text == " ".join(tok["token_strs"])
        again = await env.http.post("/tokenize", json={"prompt": text})
        assert again.json()["tokens"] == tok["tokens"]
        assert (await env.http.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
        # errors: OpenAI's shape, 400 with param; another model → 404
        vocab = SimTokenizer().vocab_size
        for path, body, status, param in (
            ("/detokenize", {"tokens": [1, vocab]}, 400, "tokens[1]"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
            ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model"),
            ("/tokenize", {"prompt": 5}, 400, "prompt"),
            ("/tokenize", {"messages": USER, "continue_final_message": True}, 400, "continue_final_message"),
            ("/detokenize", {"tokens": [1, 99999999999]}, 400, "tokens[1]"),
            ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]"),
            ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ):
            r = await env.http.post(path, json=body)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == status and err["type"], (body, err)
        r = await env.http.post("/tokenize", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        assert (await env.http.get("/tokenize")).status_code == 405
        assert env.service.counters.get("http_status.500", 0) == 0


async def test_chat_template_options_are_served_as_tokenize_counts_them(nats_url, tmp_path):
    """``add_generation_prompt`` false and ``continue_final_message`` change the prompt /v1/chat/completions sends
    (they were silently ignored: the prompt of a fresh assistant turn) and /tokenize counts the same ids (it
    refused them with a 400); the reply's role is vLLM's; an id past 2^32 in /detokenize gets the vocabulary's
    message (msgspec's ``Expected `int` <= 4294967295`` before)."""
    opened = [*USER, {"role": "assistant", "content": "Well, I am"}]
    tok = SimTokenizer()
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        counts = {}
        for name, flags in (
            ("turn", {}), ("no_prompt", {"add_generation_prompt": False}),
            ("open", {"add_generation_prompt": False, "continue_final_message": True}),
        ):
            t = await env.http.post("/tokenize", json={"messages": opened, **flags})
            assert t.status_code == 200, (name, t.text)
            served = await env.http.post("/v1/chat/completions", json={"messages": opened, "max_tokens": 1, **flags})
            assert served.status_code == 200, (name, served.text)
            assert served.json()["usage"]["prompt_tokens"] == t.json()["count"], name
            assert np.frombuffer(env.cluster.works[-1].token_ids, "<u4").tolist() == t.json()["tokens"], name
            assert served.json()["choices"][0]["message"]["role"] == "assistant"
            counts[name] = t.json()["tokens"]
        assert counts["turn"] == tok.apply_chat_template(opened)
        gen_prompt, end_of_turn = len(tok.encode("<|im_start|>assistant\n")), len(tok.encode("<|im_end|>"))
        assert counts["no_prompt"] == counts["turn"][:-gen_prompt]  # no "<|im_start|>assistant\n"
        assert counts["open"] == counts["no_prompt"][:-end_of_turn]  # no "<|im_end|>": the turn is left open
        # without a generation prompt the reply is the last message's role's (vLLM's get_chat_request_role)
        r = await env.http.post("/v1/chat/completions", json={"messages": USER, "add_generation_prompt": False, "max_tokens": 1})
        assert r.json()["choices"][0]["message"]["role"] == "user"
        r = await env.http.post(
            "/v1/chat/completions",
            json={"messages": opened, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 1, "stream": True},
        )
        assert r.status_code == 200 and '"delta":{"role":"assistant"' in r.text.replace(" ", "")
        r = await env.http.post("/v1/chat/completions", json={"messages": opened, "continue_final_message": True, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        p = await env.http.post("/tokenize", json={"prompt": "hi there", "add_special_tokens": False})  # the sim vocabulary has none
        assert p.status_code == 200 and p.json()["tokens"] == tok.encode("hi there")
        d = await env.http.post("/detokenize", json={"tokens": [99999999999]})
        assert d.status_code == 400
        assert d.json()["error"]["message"] == f"token id 99999999999 is outside the vocabulary [0, {tok.vocab_size})"


async def test_version_and_max_model_len(nats_url, tmp_path):
    """``max_model_len`` is the model's context (``--max-context-tokens``) lowered to what the largest GPU KV memory
    of a node holds: before, ``/v1/models`` said 8192 (the model's context) while the node's KV held 6400 tokens,
    so a 7000-token prompt got a 400 about KV blocks, and an unset max_tokens was cut to the context, not the KV,
    so a 6000-token prompt that a node could serve with 400 output tokens was refused. vLLM lowers its
    ``max_model_len`` to what its KV cache holds; the context check uses it (message and cut); the router logs it."""
    async with router_env(nats_url, tmp_path, {"c0": "both", "c1": "both"}, max_context_tokens=8192) as env:
        view = env.service.core.view
        r = await env.http.get("/version")
        assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("evolving-infra")}
        # the fake nodes hold 100 blocks of 64 tokens each: 6400 < 8192
        listed = (await env.http.get("/v1/models")).json()["data"][0]
        assert listed["max_model_len"] == 6400
        assert (await env.http.get("/v1/models/test-model")).json()["max_model_len"] == 6400
        assert (await env.http.post("/tokenize", json={"prompt": "hi"})).json()["max_model_len"] == 6400
        assert env.service._context_logged == 6400  # logged once, when the nodes reported their capacity
        # max_tokens unset: the default 16 is cut to the 10 tokens the KV has left (was: a 400, 101 KV blocks)
        r = await env.http.post("/v1/completions", json={"prompt": [1] * 6390})
        assert r.status_code == 200 and env.cluster.works[-1].max_tokens == 10, r.text
        r = await env.http.post("/v1/completions", json={"prompt": [1] * 6000, "max_tokens": 401})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert r.json()["error"]["message"].startswith("This model's maximum context length is 6400 tokens. However, you requested 6401")
        r = await env.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a " * 6500}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "maximum context length is 6400 tokens" in r.json()["error"]["message"]
        # the largest node's KV counts (a request may be placed there): 200 blocks hold 12800 > 8192, the model's context
        env.cluster.gpu_blocks = {"c0": 50, "c1": 200}
        await env.cluster.publish_states()
        await _wait_for(lambda: view.nodes["c1"].state.gpu_total_blocks == 200, what="states applied")
        assert (await env.http.get("/v1/models")).json()["data"][0]["max_model_len"] == 8192
        assert env.service._context_logged == 8192
        env.cluster.gpu_blocks = {"c0": 120, "c1": 120}  # 7680 tokens
        await env.cluster.publish_states()
        await _wait_for(lambda: view.nodes["c1"].state.gpu_total_blocks == 120, what="states applied")
        assert (await env.http.get("/v1/models")).json()["data"][0]["max_model_len"] == 7680
        r = await env.http.post("/v1/completions", json={"prompt": [1] * 7600, "max_tokens": 80})
        assert r.status_code == 200, r.text


async def test_max_model_len_follows_the_nodes_that_have_not_left_for_good(nats_url, tmp_path):
    """A node fenced and silent past ``--forget-node-after-s`` has left: its KV no longer counts toward
    ``max_model_len``, nor does its 0 (an older worker's unknown capacity) turn the cap off, so a prompt only a
    departed node could hold gets the 400 of ``/v1/models``' limit at once; back, a node counts again. Before,
    every node that ever reported counted for the router's lifetime: here ``/v1/models`` kept the model's 8192
    and the 4000-token prompt waited ``--no-route-wait-s`` for a node that holds it, then got a 503. A departed
    node holding no request is then forgotten: ``/v1/cluster`` and the router's tables no longer list it (before,
    they kept every node id ever seen, so node ids new at each restart grew them without end); back, it is listed
    again."""
    phases = {"c0": "both", "c1": "both", "c2": "both"}
    async with router_env(nats_url, tmp_path, phases, max_context_tokens=8192, forget_node_after_s=0.5, no_route_wait_s=0.2) as env:
        svc, view = env.service, env.service.core.view
        models = lambda: env.http.get("/v1/models")  # noqa: E731
        env.cluster.gpu_blocks = {"c0": 50, "c1": 200, "c2": 0}  # c2: an older worker, no capacity reported
        await env.cluster.publish_states()
        await _wait_for(lambda: view.nodes["c2"].state.gpu_total_blocks == 0, what="states applied")
        assert (await models()).json()["data"][0]["max_model_len"] == 8192
        listed = lambda: env.http.get("/v1/cluster")  # noqa: E731
        assert [n["node"] for n in (await listed()).json()["nodes"]] == ["c0", "c1", "c2"]
        env.cluster.alive -= {"c1", "c2"}  # both leave for good
        await _wait_for(lambda: not {"c1", "c2"} & view.nodes.keys(), what="c1, c2 fenced and forgotten")
        await _wait_for(lambda: svc._context_logged == 3200, what="the cap lowered (fence loop)")
        assert svc.counters["fenced"] == 2 and svc.counters["nodes.forgotten"] == 2
        assert [n["node"] for n in (await listed()).json()["nodes"]] == ["c0"]
        assert not {"c1", "c2"} & view._tokens
        assert (await models()).json()["data"][0]["max_model_len"] == 3200  # c0's 50 blocks of 64 tokens
        r = await env.http.post("/v1/completions", json={"prompt": [1] * 4000, "max_tokens": 16})
        assert r.status_code == 400 and "maximum context length is 3200 tokens" in r.json()["error"]["message"], r.text
        env.cluster.alive.add("c1")  # back (a restarted worker): counted at once
        await env.cluster.publish_states()
        await _wait_for(lambda: "c1" in view.nodes and view.nodes["c1"].state is not None, what="c1 back")
        assert [n["node"] for n in (await listed()).json()["nodes"]] == ["c0", "c1"]
        assert (await models()).json()["data"][0]["max_model_len"] == 8192
        r = await env.http.post("/v1/completions", json={"prompt": [1] * 4000, "max_tokens": 16})
        assert r.status_code == 200 and r.headers["x-ei-prefill-node"] == "c1", r.text


async def test_cors_is_off_by_default_and_answers_preflights_when_set(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        r = await env.http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers  # today's behaviour
        r = await env.http.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    async with router_env(nats_url, tmp_path, {"c0": "both"}, allowed_origins=["*"], api_keys="k1") as env:
        r = await env.http.options("/v1/chat/completions", headers=PREFLIGHT)  # no key: a preflight carries none
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"].lower() == "authorization"
        r = await env.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}, headers={"Origin": "https://app.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"  # the page can read the 401
        r = await env.http.post(
            "/v1/chat/completions", json={"messages": USER, "max_tokens": 1},
            headers={"Origin": "https://app.example", "Authorization": "Bearer k1"},
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        # the page may read the router's headers (before: no access-control-expose-headers, so x-request-id was hidden)
        exposed = {h.strip() for h in r.headers["access-control-expose-headers"].lower().split(",")}
        assert {"x-request-id", "x-ei-prefill-node", "retry-after"} <= exposed, exposed
        assert r.headers["x-request-id"] and r.headers["x-ei-prefill-node"] == "c0"
    async with router_env(nats_url, tmp_path, {"c0": "both"}, allowed_origins=["https://app.example"], allow_credentials=True) as env:
        r = await env.http.options("/tokenize", headers=PREFLIGHT)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        r = await env.http.options("/tokenize", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        # the API's JSON error body naming the header at fault (before: Starlette's text/plain "Disallowed CORS origin")
        assert r.headers["content-type"] == "application/json", r.text
        assert r.json() == {"error": {"message": "CORS preflight refused: Disallowed CORS origin", "type": "invalid_request_error",
                                      "param": "Origin", "code": 400}}, r.text  # fmt: skip


async def test_api_keys_guard_the_new_paths(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys="k1") as env:
        for method, path, body in (("GET", "/version", None), ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]})):
            r = await env.http.request(method, path, json=body)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), (path, r.text)
            r = await env.http.request(method, path, json=body, headers={"Authorization": "Bearer k2"})
            assert r.status_code == 401, path
            r = await env.http.request(method, path, json=body, headers={"Authorization": "Bearer k1"})
            assert r.status_code == 200, (path, r.text)


@pytest.mark.timeout(60)
def test_router_process_with_cors_flags_and_keys(nats_url, tmp_path):
    """``python -m services.router --allowed-origins '*' ...`` with ``EI_API_KEYS``: the flags reach the app."""
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    env.update(PYTHONPATH=str(REPO), EI_API_KEYS="k1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.router", "--nats-url", nats_url, "--port", "0", "--port-file", str(port_file),
         "--model", "m1", "--split-get-timeout-s", "0.5", "--max-context-tokens", "4096",
         "--allowed-origins", "*", "--allowed-methods", "GET,POST", "--log-format", "json"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "router did not write its port file"
            time.sleep(0.05)
        port = int(port_file.read_text())
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            r = http.options("/tokenize", headers=PREFLIGHT)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
            assert r.headers["access-control-allow-methods"] == "GET, POST"
            assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 401
            auth = {"Authorization": "Bearer k1"}
            r = http.post("/tokenize", json={"messages": USER}, headers=auth)
            assert r.status_code == 200 and r.json()["max_model_len"] == 4096
            assert r.json()["count"] == len(SimTokenizer().apply_chat_template(USER))
            r = http.post("/detokenize", json={"tokens": r.json()["tokens"][:3]}, headers=auth)
            assert r.status_code == 200 and len(r.json()["prompt"].split()) == 3
            assert http.get("/version", headers=auth).json() == {"version": importlib.metadata.version("evolving-infra")}
            assert http.get("/v1/models", headers=auth).json()["data"][0]["max_model_len"] == 4096
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_tokenize_with_a_real_bpe_tokenizer(nats_url, tmp_path):
    """``--tokenizer hf:<folder>`` (byte-level BPE, ChatML template): a chat's count is its usage, a prompt's ids
    are the ones the node gets, and /detokenize gives the text back byte for byte."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tests.unit.router.helpers import write_bpe_tokenizer

    folder = write_bpe_tokenizer(tmp_path / "tok")
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}") as env:
        tok = (await env.http.post("/tokenize", json={"messages": USER})).json()
        served = await env.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
        assert served.status_code == 200, served.text
        assert tok["count"] == served.json()["usage"]["prompt_tokens"] > 0
        assert np.frombuffer(env.cluster.works[-1].token_ids, "<u4").tolist() == tok["tokens"]
        # the chat's ids come back with their ChatML markers (special tokens; vLLM's /detokenize shows them) and
        # re-tokenize to themselves; they were skipped ("system\nBe brief.\nuser\n..." re-tokenized to other ids)
        chat = (await env.http.post("/detokenize", json={"tokens": tok["tokens"]})).json()["prompt"]
        assert chat.startswith("<|im_start|>system\nBe brief.<|im_end|>") and chat.endswith("<|im_start|>assistant\n"), chat
        assert (await env.http.post("/tokenize", json={"prompt": chat})).json()["tokens"] == tok["tokens"]
        text = "Évolving infra: a router, a KV directory — and 3 planners!"
        tok = (await env.http.post("/tokenize", json={"prompt": text, "return_token_strs": True})).json()
        served = await env.http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
        assert tok["count"] == served.json()["usage"]["prompt_tokens"]
        assert np.frombuffer(env.cluster.works[-1].token_ids, "<u4").tolist() == tok["tokens"]
        assert (await env.http.post("/detokenize", json={"tokens": tok["tokens"]})).json() == {"prompt": text}
        assert len(tok["token_strs"]) == tok["count"]
        r = await env.http.post("/detokenize", json={"tokens": [env.service.tokenizer.vocab_size]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[0]"


async def test_token_strs_of_a_big_prompt_are_made_off_the_event_loop(nats_url, tmp_path):
    """``return_token_strs`` lists every id's piece (one decode per id took 1.2 s for the 1M ids of a 5.5 MB prompt,
    the body limit is 64 MB): for a big prompt that runs in a worker thread, as its tokenization does, so the
    router's event loop (every stream, the bus) does not stop for it. Before, the decodes ran on the loop."""
    import threading

    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        real = env.service.tokenizer
        loop_thread = threading.get_ident()  # the router runs in this test's event loop
        on_loop: list[int] = []

        class Recording:
            def __getattr__(self, name):
                return getattr(real, name)

            def convert_ids_to_tokens(self, ids):
                if threading.get_ident() == loop_thread:
                    on_loop.append(len(ids))
                return real.convert_ids_to_tokens(ids)

        env.service.tokenizer = Recording()
        prompt = "alpha beta gamma delta " * 4000  # 92,000 characters: above the router's _BIG_TEXT
        r = await env.http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["token_strs"]) == len(real.encode(prompt)) > 10_000
        assert body["token_strs"] == [real.decode([t]) for t in body["tokens"]]  # the sim's pieces are its words
        assert on_loop == [], f"{len(on_loop)} piece lists were made on the event loop"
        small = await env.http.post("/tokenize", json={"prompt": "alpha beta", "return_token_strs": True})
        assert small.json()["token_strs"] == [real.decode([t]) for t in small.json()["tokens"]]
        assert on_loop == [2]  # a small one on the loop: the check above can see one


async def test_a_chat_with_big_tools_is_rendered_off_the_event_loop(nats_url, tmp_path):
    """A chat whose ``tools`` are big and contents small (5.9 MB of tools: 0.5 s of rendering and
    tokenizing) is rendered in a worker thread, on /v1/chat/completions and on /tokenize: the router
    measured only the messages' contents to decide, so it ran on the event loop."""
    import threading

    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        real = env.service.tokenizer
        loop_thread = threading.get_ident()
        on_loop: list[str] = []
        rendered: list[int] = []

        class Recording:
            def __getattr__(self, name):
                return getattr(real, name)

            def render_chat(self, messages, tools=None, **flags):
                if threading.get_ident() == loop_thread:
                    on_loop.append("render_chat")
                rendered.append(threading.get_ident())
                return real.render_chat(messages, tools, **flags)

        env.service.tokenizer = Recording()
        env.cluster.gpu_blocks = {"c0": 1000}  # room for the ~24k-token prompt (else a 400 before dispatch)
        await env.cluster.publish_states()
        # applied before the request (under the full suite's load the request came first: a 400, 100 blocks)
        await _wait_for(lambda: env.service.core.view.nodes["c0"].state.gpu_total_blocks == 1000, what="states applied")
        tools = [{"type": "function", "function": {"name": f"f{i}", "description": "does a thing " * 10}} for i in range(400)]
        tok = await env.http.post("/tokenize", json={"messages": USER, "tools": tools})
        assert tok.status_code == 200, tok.text
        served = await env.http.post("/v1/chat/completions", json={"messages": USER, "tools": tools, "tool_choice": "none", "max_tokens": 1})
        assert served.status_code == 200, served.text
        assert tok.json()["count"] == served.json()["usage"]["prompt_tokens"] == len(real.apply_chat_template(USER, tools))
        assert on_loop == [] and len(rendered) == 2, (on_loop, rendered)
        small = await env.http.post("/tokenize", json={"messages": USER})
        assert small.json()["count"] == len(real.apply_chat_template(USER))


async def test_a_big_detokenize_body_is_parsed_and_checked_off_the_event_loop(nats_url, tmp_path, monkeypatch):
    """/detokenize of a big body (59 MB, 10M ids: 0.63 s to parse, 0.37 s to check the ids against the
    vocabulary) runs in a worker thread; only the decode did before, the parse and check ran on the loop.
    A small body and the 400s are as before."""
    import threading

    from services.router import api

    loop_thread = threading.get_ident()
    on_loop: list[str] = []
    real_parse, real_check = api.parse_detokenize, api.check_token_ids

    def parse(body):
        if threading.get_ident() == loop_thread:
            on_loop.append("parse")
        return real_parse(body)

    def check(ids, vocab_size, param="tokens"):
        if threading.get_ident() == loop_thread:
            on_loop.append("check")
        return real_check(ids, vocab_size, param)

    monkeypatch.setattr(api, "parse_detokenize", parse)
    monkeypatch.setattr(api, "check_token_ids", check)
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        tok = env.service.tokenizer
        ids = [(i * 7919) % tok.vocab_size for i in range(20_000)]
        r = await env.http.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
        assert on_loop == [], on_loop
        r = await env.http.post("/detokenize", json={"tokens": ids + [tok.vocab_size]})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"tokens[{len(ids)}]"
        r = await env.http.post("/detokenize", json={"tokens": [1, 2], "model": "other"})
        assert r.status_code == 404
        assert (await env.http.post("/detokenize", json={"tokens": ids[:3]})).json() == {"prompt": tok.decode(ids[:3])}


async def test_a_big_tokenize_body_is_parsed_off_the_event_loop(nats_url, tmp_path, monkeypatch):
    """/tokenize of a big body is parsed (and tokenized, and its token strings made) in a worker
    thread, as /detokenize; its parse ran on the loop. The results and the 400 for a bad chat are as before."""
    import threading

    from services.router import api

    loop_thread = threading.get_ident()
    on_loop: list[str] = []
    real_parse = api.parse_tokenize

    def parse(body):
        if threading.get_ident() == loop_thread:
            on_loop.append("parse")
        return real_parse(body)

    monkeypatch.setattr(api, "parse_tokenize", parse)
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        tok = env.service.tokenizer
        prompt = "alpha beta gamma delta " * 2000
        r = await env.http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True})
        assert r.status_code == 200 and r.json()["tokens"] == tok.encode(prompt)
        assert r.json()["token_strs"] == [tok.decode([t]) for t in tok.encode(prompt)]
        assert on_loop == [], on_loop
        r = await env.http.post("/tokenize", json={"messages": USER, "model": "other", "tools": TOOLS * 400})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = await env.http.post("/tokenize", json={"prompt": "alpha", "return_token_strs": False})
        assert r.json()["tokens"] == tok.encode("alpha") and r.json()["token_strs"] is None


async def test_a_big_completion_body_is_parsed_tokenized_and_hashed_off_the_event_loop(nats_url, tmp_path, monkeypatch):
    """/v1/completions (and /v1/chat/completions) of a body over _BIG_TEXT bytes is parsed, tokenized, made an
    array, packed and block-hashed in a worker thread: only a chat's rendering and a big text's encoding were,
    so a prompt of 1M ids (6.2 MB) held the event loop 90-140 ms (parse 44 ms, array 24 ms, hashes 17-68 ms
    at block_size 64-16). The work sent, its hashes and the answers are as before; a small body stays on the loop."""
    import threading

    from services.router import api
    from services.router import service as router_service
    from shared.hashing import block_hashes_packed

    loop_thread = threading.get_ident()
    calls: list[tuple[str, bool]] = []  # (what, ran on the event loop)

    def recording(name, real):
        def call(*args, **kw):
            calls.append((name, threading.get_ident() == loop_thread))
            return real(*args, **kw)

        return call

    monkeypatch.setattr(api, "parse_completion", recording("parse_completion", api.parse_completion))
    monkeypatch.setattr(api, "parse_chat", recording("parse_chat", api.parse_chat))
    monkeypatch.setattr(router_service, "block_hashes_packed", recording("hash", router_service.block_hashes_packed))
    async with router_env(nats_url, tmp_path, {"c0": "both"}, max_prompt_tokens=30_000) as env:
        tok = env.service.tokenizer
        bs = env.service.cfg.block_size
        env.cluster.gpu_blocks = {"c0": 1000}  # room for the 20k-token prompts (else a 400 before dispatch)
        await env.cluster.publish_states()
        # applied before the request (under the full suite's load the request came first: a 400, 100 blocks)
        await _wait_for(lambda: env.service.core.view.nodes["c0"].state.gpu_total_blocks == 1000, what="states applied")
        ids = [(i * 7919) % tok.vocab_size for i in range(20_000)]  # ~120 KB of body
        text = "alpha beta gamma delta " * 2000  # 46 KB, 8000 tokens
        for prompt, want in ((ids, ids), ([ids], ids), (text, tok.encode(text))):
            calls.clear()
            r = await env.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(want)
            packed = np.asarray(want, dtype="<u4").tobytes()
            work = env.cluster.works[-1]
            assert work.token_ids == packed and work.block_hashes == block_hashes_packed(packed, bs)
            assert calls == [("parse_completion", False), ("hash", False)], calls
        calls.clear()
        r = await env.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert calls == [("parse_chat", False), ("hash", False)], calls
        # the 400s of a big body are as before (the count is checked before the array is made)
        r = await env.http.post("/v1/completions", json={"prompt": ids * 2, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["message"] == "prompt has 40000 tokens; at most 30000 allowed"
        r = await env.http.post("/v1/completions", json={"prompt": ids + [tok.vocab_size], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"prompt[{len(ids)}]"  # the id, as /detokenize names tokens[i]
        r = await env.http.post("/v1/completions", json={"prompt": ids, "model": "other"})
        assert r.status_code == 404
        calls.clear()
        r = await env.http.post("/v1/completions", json={"prompt": ids[:100], "max_tokens": 1})  # small: no thread hop
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
        assert calls == [("parse_completion", True), ("hash", True)], calls


async def test_a_request_may_name_the_model_by_an_alias(nats_url, tmp_path):
    """vLLM lists every --served-model-name in /v1/models (``show_available_models``, a ``ModelCard`` each), accepts
    any of them, and names the first in every response (its --served-model-name help; vllm-project/vllm#24663).
    ``up`` passes the others as ``--model-names`` and, without --served-model-name, the --model folder path (vLLM's
    served name then) as ``--model-aliases``: accepted, not listed. Before: only ``--model`` was listed."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, model_names=["b"], model_aliases=["/models/tiny", "tiny/"]) as env:
        assert [m["id"] for m in (await env.http.get("/v1/models")).json()["data"]] == ["test-model", "b"]
        for name in ("test-model", "b", "/models/tiny", "tiny/", None):
            r = await env.http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "test-model", (name, r.text)
            if name is not None:
                r = await env.http.get(f"/v1/models/{name}")
                assert r.status_code == 200 and r.json()["id"] == (name if name in ("test-model", "b") else "test-model"), r.text
        r = await env.http.post("/v1/chat/completions", json={"model": "/models/tiny", "messages": USER, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "test-model", r.text
        for chat in (False, True):
            body = {"model": "b", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
                    **({"messages": USER} if chat else {"prompt": "hi"})}
            r = await env.http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
            chunks = [c for c in sse_events(r.text) if c != "[DONE]"]
            assert r.status_code == 200 and len(chunks) >= 2 and {c["model"] for c in chunks} == {"test-model"}, r.text
        r = await env.http.post("/v1/completions", json={"model": "/models/other", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert r.json()["error"]["message"] == "model '/models/other' not found; this router serves 'test-model', 'b'"


async def test_prompt_ids_past_the_models_vocabulary_are_a_400(nats_url, tmp_path):
    """A token-id prompt ``[600, 601]`` on a 512-token model passed the router's check (the tokenizer's vocabulary
    was the limit) and came back a 500 from the engine ("token id 600 outside the model's vocabulary (512)");
    vLLM answers 400. With ``--model-vocab-size`` (up passes the torch model's) the router refuses any prompt or
    logit_bias id at or past it, naming the id and the model's vocabulary."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, model_vocab_size=512) as env:
        sent = len(env.cluster.works)
        for path, body, param in (
            ("/v1/completions", {"prompt": [600, 601], "max_tokens": 1}, "prompt[0]"),
            ("/v1/completions", {"prompt": [1, 511, 512], "max_tokens": 1, "stream": True}, "prompt[2]"),
        ):
            r = await env.http.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and err["message"] == (
                f"token id {body['prompt'][int(param[7])]} is outside the model's vocabulary [0, 512)"), err
        r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1, "logit_bias": {"512": 1}})
        assert r.status_code == 400 and "logit_bias token id 512 is outside the model's vocabulary [0, 512)" in r.text
        r = await env.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})  # sim ids past 512
        assert r.status_code == 400 and "outside the model's vocabulary [0, 512)" in r.json()["error"]["message"]
        assert len(env.cluster.works) == sent  # nothing dispatched
        r = await env.http.post("/v1/completions", json={"prompt": [0, 511], "max_tokens": 1})
        assert r.status_code == 200, r.text
