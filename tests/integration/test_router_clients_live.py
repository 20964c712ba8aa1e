"""The router's HTTP API as benchmark clients (NVIDIA AIPerf, guidellm, vLLM's bench) use it.

Real nats-server; workers, planner and directory played by ``FakeCluster`` of
``test_router_live`` (same fixtures). Each test is a gap a client run found:
``/health``; ``X-Request-ID`` kept as the request's id (a gateway's, with ``/:.``, too); usage in every chunk with
``stream_options.continuous_usage_stats``; a stream's status and headers sent at
acceptance, before the first token.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from services.router import api
from shared.subjects import check_token
from tests.integration.test_router_live import _wait_for, router_env, sse_events
from tests.integration.test_router_log_requests_live import logs  # noqa: F401 (fixture)
from tests.integration.test_router_spans_live import _roots, spans  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


async def test_health_alias_answers_like_healthz(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        for path in ("/health", "/healthz"):
            r = await env.http.get(path)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, path
        env.cluster.alive.clear()
        await _wait_for(lambda: not env.service.ready(), timeout=5, what="node fenced")
        r = await env.http.get("/health")
        assert r.status_code == 503 and "c0: fenced" in r.json()["error"]["message"]


async def test_client_request_id_is_the_rid_everywhere(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        rid = "0b0f8c3e-5a1d-4f6e-9c7a-1234567890ab"
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, headers={"X-Request-ID": rid})
        assert r.status_code == 200, r.text
        # the header comes back as sent; the body's id is vLLM's cmpl-<X-Request-ID>
        assert r.headers["x-request-id"] == rid and r.json()["id"] == "cmpl-" + rid
        assert env.cluster.works[-1].rid == rid  # the nodes (and their logs) see the client's id
        payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await env.http.post("/v1/chat/completions", json=payload, headers={"x-request-id": "chat_41"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "chat_41" and r.json()["id"] == "chatcmpl-chat_41"
        bodies = {"/v1/chat/completions": ("chatcmpl-", payload), "/v1/completions": ("cmpl-", {"prompt": [1, 2], "max_tokens": 2})}
        for path, (prefix, body) in bodies.items():
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            r = await env.http.post(path, json=streamed, headers={"x-request-id": "s_42"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "s_42"
            events = sse_events(r.text)[:-1]  # every chunk, the usage chunk too; then [DONE]
            assert events[-1]["usage"] is not None and {e["id"] for e in events} == {prefix + "s_42"}, path
            assert env.cluster.works[-1].rid == "s_42"
            # without the header the router makes one (a hex uuid, as vLLM's random_uuid) and says which
            r = await env.http.post(path, json=body)
            made = r.headers["x-request-id"]
            assert r.json()["id"] == prefix + made and len(made) == 32 and env.cluster.works[-1].rid == made, r.text
        # unusable ids (not a visible-ASCII header value of 1-256 characters): 400 with the reason, nothing dispatched
        n = len(env.cluster.works)
        for value, frag in [("x" * 257, "at most 256"), ("id with space", "visible ASCII"), ("", "empty")]:
            r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Request-ID": value})
            assert r.status_code == 400 and frag in r.json()["error"]["message"], (value, r.text)
            assert r.json()["error"]["param"] == "X-Request-ID"
        assert len(env.cluster.works) == n
        # the same id twice at once: the second is refused, the first is served
        env.cluster.answering.clear()
        first = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Request-ID": "dup"}))
        await _wait_for(lambda: len(env.cluster.works) == n + 1, what="first dispatched")
        r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Request-ID": "dup"})
        assert r.status_code == 409 and "already in flight" in r.json()["error"]["message"]
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first


async def test_a_gateway_request_id_is_taken_echoed_as_sent_and_told_apart_by_the_id_as_sent(nats_url, tmp_path, logs, spans):  # noqa: F811
    """A vLLM/Dynamo user's gateway sent ids with ``/``, ``:``, ``.`` (Envoy's, AWS's): each was a 400
    (only ``[A-Za-z0-9_-]`` was taken; vLLM takes any value). Now it is served, its response carries it as
    sent (``x-request-id``, ``cmpl-``/``chatcmpl-<id>``), the nodes see its NATS-safe rid
    (``api.request_rid``), ``--log-requests`` lines and the root span carry both; the same id twice at once
    is a 409 naming it, while an id of the same safe characters (``abc:def/ghi.jkl``, ``abc_def_ghi_jkl``) is not."""
    gw = "abc/def:ghi.jkl"
    rid = api.request_rid(gw)
    assert check_token(rid) == rid and rid != gw
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, log_requests=True, log_level="info") as env:
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, headers={"X-Request-ID": gw})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == gw and r.json()["id"] == "cmpl-" + gw
        assert env.cluster.works[-1].rid == rid
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        r = await env.http.post("/v1/chat/completions", json=chat, headers={"X-Request-ID": gw})  # the first ended: not a duplicate
        assert r.status_code == 200 and r.headers["x-request-id"] == gw, r.text
        assert {e["id"] for e in sse_events(r.text)[:-1]} == {"chatcmpl-" + gw}
        # in flight: the same id again is a 409; ids of the same safe characters are other requests
        env.cluster.answering.clear()
        n = len(env.cluster.works)
        body = {"prompt": [1], "max_tokens": 1}
        held = [asyncio.create_task(env.http.post("/v1/completions", json=body, headers={"X-Request-ID": gw}))]
        await _wait_for(lambda: len(env.cluster.works) == n + 1, what="first dispatched")
        r = await env.http.post("/v1/completions", json=body, headers={"X-Request-ID": gw})
        assert r.status_code == 409 and r.json()["error"]["message"] == f"X-Request-ID {gw!r} is already in flight"
        for i, other in enumerate(["abc:def/ghi.jkl", "abc_def_ghi_jkl"], 2):
            held.append(asyncio.create_task(env.http.post("/v1/completions", json=body, headers={"X-Request-ID": other})))
            await _wait_for(lambda i=i: len(env.cluster.works) == n + i, what=f"{other} dispatched")
        assert [w.rid for w in env.cluster.works[n:]] == [rid, api.request_rid("abc:def/ghi.jkl"), "abc_def_ghi_jkl"]
        for t in held:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await _wait_for(lambda: len([e for e in logs if e["event"] == "request finished"]) == 5, what="finished lines")
        await _wait_for(lambda: len(_roots(spans)) == 6, what="6 router.request spans")
    # log lines: the rid, and the id as sent when it is not the rid
    accepted = [(e["rid"], e.get("client_request_id")) for e in logs if e["event"] == "request accepted"]
    assert accepted == [(rid, gw), (rid, gw), (rid, gw), (api.request_rid("abc:def/ghi.jkl"), "abc:def/ghi.jkl"), ("abc_def_ghi_jkl", None)]
    (rej,) = [e for e in logs if e["event"] == "request rejected"]
    assert (rej["rid"], rej["client_request_id"], rej["status"]) == (rid, gw, 409)
    roots = [(s.attributes.get("ei.rid"), s.attributes.get("ei.client_request_id")) for s in _roots(spans)]
    assert sorted(roots, key=str) == sorted([(rid, gw)] * 4 + [(api.request_rid("abc:def/ghi.jkl"), "abc:def/ghi.jkl"), ("abc_def_ghi_jkl", None)], key=str)


async def test_continuous_usage_stats_puts_usage_in_every_chunk(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        for chat in (True, False):
            body: dict = {"max_tokens": 7, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            if chat:
                body["messages"] = [{"role": "user", "content": "hello there"}]
            else:
                body["prompt"] = [5, 6, 7, 8]
            r = await env.http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            chunks = sse_events(r.text)[:-1]
            assert all(c.get("usage") for c in chunks), chunks
            done = [c["usage"]["completion_tokens"] for c in chunks]
            assert done == sorted(done) and done[-1] == 7  # tokens so far, never going back
            prompt = chunks[0]["usage"]["prompt_tokens"]
            assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
            assert chunks[-1]["choices"] == []  # include_usage's final chunk is still there
        # without it, data chunks carry no usage (include_usage: null until the last)
        r = await env.http.post("/v1/completions", json={"prompt": [5], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}})
        chunks = sse_events(r.text)[:-1]
        assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_stream_status_and_headers_go_out_before_the_first_token(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        env.cluster.answering.clear()  # the node takes the work and produces nothing yet
        payload = {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True}
        async with env.http.stream("POST", "/v1/completions", json=payload, headers={"X-Request-ID": "early"}) as r:
            # this returned without any token: status and headers came at acceptance
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-request-id"] == "early" and r.headers["x-ei-prefill-node"] == "p0"
            await _wait_for(lambda: [w.rid for w in env.cluster.works] == ["early"], what="work dispatched")
        # leaving before the first token aborts the work on its nodes
        await _wait_for(lambda: {n for n, a in env.cluster.aborts if a.rid == "early"} == {"p0", "d0"}, what="aborts")
        await _wait_for(lambda: env.service.core.view.inflight_total == 0 and not env.service._pending, what="forgotten")
        # a node that answers later streams normally on the response already started
        env.cluster.answering.add("p0")
        async with env.http.stream("POST", "/v1/completions", json=payload) as r:
            assert r.status_code == 200
            events = sse_events((await r.aread()).decode())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


async def test_stream_with_no_output_ends_with_an_error_event(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, request_timeout_s=1.0) as env:
        env.cluster.answering.clear()
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True})
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 504
        assert isinstance(r, httpx.Response)
