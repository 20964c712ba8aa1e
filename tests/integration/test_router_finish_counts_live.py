"""Every request the router accepted is counted once in ``ei_router_requests_finished_total{reason}``,
under the ``finish_reason`` its client saw, also when the router ends it itself (real nats-server, the
router's service, nodes played by ``FakeCluster`` of ``test_router_live``; counts read from ``GET /metrics``).

Before: a request whose decode node died after its last token (the router ended it, ``length``), one whose
continuation could not be exact (503), one whose parked work expired (503), one that timed out (504) and
one whose client went away were in no ``reason``; one whose stop string or stop token id came in its last
chunk was counted ``length`` while its client got ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.router.nodes import FencedNode
from shared import messages as m
from shared.subjects import REQ_OUT
from shared.tokenizer import SimTokenizer
from tests.integration.test_router_live import _wait_for, output_token, router_env, sse_events

pytestmark = pytest.mark.timeout(60)

PD2 = {"p0": "prefill", "d0": "decode", "d1": "decode"}


async def finished(env) -> dict[str, float]:
    """``ei_router_requests_finished_total`` by ``reason`` as scraped from the router's ``/metrics``."""
    r = await env.http.get("/metrics")
    assert r.status_code == 200
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        if fam.name == "ei_router_requests_finished":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] = s.value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


async def test_a_request_whose_decode_node_died_after_its_last_token_counts_once_as_length(nats_url, tmp_path):
    """Every output token reached the router, only the end was lost with its decode node: the router ends
    the request itself (``redispatch.ended_at_router``), finish reason ``length``."""
    async with router_env(nats_url, tmp_path, PD2) as env:
        env.cluster.answering.clear()
        before = await finished(env)
        req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [5] * 70, "max_tokens": 4}))
        await _wait_for(lambda: len(env.cluster.works) == 1, what="work on p0")
        w = env.cluster.works[0]
        ids = [output_token(i) for i in range(4)]
        out = lambda c: env.bus.publish(REQ_OUT, c, rid=w.rid, node=c.node)  # noqa: E731
        await out(m.TokenChunk(rid=w.rid, node="p0", index=0, token_ids=ids[:1], prompt_tokens=70, attempt=0))
        await out(m.TokenChunk(rid=w.rid, node=w.decode_node, index=1, token_ids=ids[1:], attempt=0))  # no end
        await _wait_for(lambda: len(env.service._pending[w.rid].tokens) == 4, what="all tokens at the router")
        env.cluster.alive.discard(w.decode_node)  # its decode node dies before the last chunk's end
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        st = await env.stats()
        assert st.counters["redispatch.ended_at_router"] == 1
        assert delta(await finished(env), before) == {"length": 1.0}


async def test_a_continuation_that_cannot_be_exact_counts_once_as_error(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, PD2, max_prompt_tokens=70) as env:
        env.cluster.stall_after_first.add("p0")
        before = await finished(env)
        async with env.http.stream("POST", "/v1/completions", json={"prompt": [5] * 70, "max_tokens": 6, "stream": True}) as r:
            lines = r.aiter_lines()
            await anext(lines)
            env.cluster.alive.discard(env.cluster.works[0].decode_node)
            rest = "".join([line + "\n" async for line in lines])
        assert sse_events(rest)[-2]["error"]["code"] == 503
        assert (await env.stats()).counters["redispatch.decode_failed"] == 1
        assert delta(await finished(env), before) == {"error": 1.0}


async def test_parked_work_that_expires_counts_once_as_error(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, requeue_wait_s=1.0, no_route_wait_s=0.5) as env:
        env.cluster.stall_after_first.add("p0")
        before = await finished(env)
        async with env.http.stream("POST", "/v1/completions", json={"prompt": [6] * 70, "max_tokens": 6, "stream": True}) as r:
            lines = r.aiter_lines()
            await anext(lines)
            env.cluster.alive.discard("d0")  # the only decode node: the re-dispatch is parked, then expires
            rest = "".join([line + "\n" async for line in lines])
        assert sse_events(rest)[-2]["error"]["code"] == 503
        assert (await env.stats()).counters["requeue.parked_expired"] == 1
        assert delta(await finished(env), before) == {"error": 1.0}


async def test_a_timeout_counts_as_error_and_a_client_disconnect_as_abort(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, request_timeout_s=0.5) as env:
        env.cluster.answering.clear()
        before = await finished(env)
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 504, r.text
        assert delta(await finished(env), before) == {"error": 1.0}
        for stream in (False, True):
            n = len(env.cluster.works)
            req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": stream}))
            await _wait_for(lambda n=n: len(env.cluster.works) == n + 1, what="work dispatched")
            req.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await req
            await _wait_for(lambda: env.service.core.view.inflight_total == 0, what="request forgotten")
        assert (await env.stats()).counters["aborts.client_disconnect"] == 2
        assert delta(await finished(env), before) == {"error": 1.0, "abort": 2.0}


async def test_a_stop_matched_at_the_router_counts_once_as_stop_also_in_the_last_chunk(nats_url, tmp_path):
    """The fake engine sends output positions 0, 1–3, 4–6, 7 (the last chunk ends it, ``length``)."""
    words = [SimTokenizer().word(output_token(i)) for i in range(8)]
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        base = {"prompt": [1, 2, 3], "max_tokens": 8}
        cases = (
            ({}, "length"), ({"stop": words[4]}, "stop"), ({"stop": words[7]}, "stop"), ({"stop_token_ids": [output_token(7)]}, "stop"),
        )  # fmt: skip
        for stream in (False, True):
            for extra, reason in cases:
                before = await finished(env)
                r = await env.http.post("/v1/completions", json={**base, **extra, "stream": stream})
                assert r.status_code == 200, r.text
                last = sse_events(r.text)[-2] if stream else r.json()
                assert last["choices"][0]["finish_reason"] == reason, (extra, stream)
                await _wait_for(lambda: env.service.core.view.inflight_total == 0, what="request ended")
                assert delta(await finished(env), before) == {reason: 1.0}, (extra, stream)


async def test_a_stop_the_client_gets_is_counted_stop_also_when_an_end_decided_outside_the_response_is_queued_behind_it(nats_url, tmp_path):
    """The chunk that completes a stop string is queued for the response, and before the response reads it
    the router decides another end: its node's ``error`` / ``abort`` chunk came in the same bus read, or the
    node was fenced (every token there: ``length``; a continuation that cannot be exact: 503). The response
    still ends at the stop (it reads its queue in order and stops there), so the request is counted ``stop``.
    Before: counted ``error`` / ``abort`` / ``length`` at that decision, and ``_end_at_stop`` was a no-op.
    The chunks are given to the router's chunk handler (what the bus calls) back to back, with no await
    between them that lets the response run, as when they arrive in one read."""
    words = [SimTokenizer().word(output_token(i)) for i in range(8)]
    async with router_env(nats_url, tmp_path, {"c0": "both"}, max_prompt_tokens=70) as env:
        env.cluster.answering.clear()
        svc = env.service
        ends = ("error", "abort", "fenced_all_tokens", "fenced_cannot_continue")
        for stream in (False, True):
            for end in ends:
                before = await finished(env)
                n = len(env.cluster.works)
                max_tokens = 4 if end == "fenced_all_tokens" else 8
                body = {"prompt": [5] * 70, "max_tokens": max_tokens, "stop": words[2], "stream": stream}
                req = asyncio.create_task(env.http.post("/v1/completions", json=body))
                await _wait_for(lambda n=n: len(env.cluster.works) == n + 1, what="work dispatched")
                w = env.cluster.works[-1]
                ids = [output_token(i) for i in range(4)]
                await svc._on_chunk(m.TokenChunk(rid=w.rid, node="c0", index=0, token_ids=ids[:1], prompt_tokens=70, attempt=w.attempt), "")
                await svc._on_chunk(m.TokenChunk(rid=w.rid, node="c0", index=1, token_ids=ids[1:4], attempt=w.attempt), "")  # the stop
                if end in ("error", "abort"):
                    await svc._on_chunk(m.TokenChunk(rid=w.rid, node="c0", finished=True, finish_reason=end, error="x", attempt=w.attempt), "")
                else:
                    svc._fence(FencedNode("c0", 0.0, (w.rid,), cause="restarted"))
                r = await asyncio.wait_for(req, 10)
                assert r.status_code == 200, (end, stream, r.text)
                last = sse_events(r.text)[-2] if stream else r.json()
                assert last["choices"][0]["finish_reason"] == "stop", (end, stream, r.text)
                await _wait_for(lambda: env.service.core.view.inflight_total == 0, what="request ended")
                assert delta(await finished(env), before) == {"stop": 1.0}, (end, stream)


async def test_a_node_that_ends_a_request_with_abort_counts_as_error_not_as_a_client_abort(nats_url, tmp_path):
    """A prefill node that found no decode node to bind within its ``--bind-timeout-s`` ends the request with
    an ``abort`` chunk; its client gets a 503 (``request aborted by node p0: no decode node ...``), the same
    failure as parked work that expired (counted ``error``). Counted ``error``; ``abort`` stays the requests
    whose client went away (or a router shutting down). Before, ``abort``: since the bind timeout's chunk became
    an abort (it was an ``error``, a 500), those 503s were counted with the client disconnects."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        env.cluster.abort_nodes.add("p0")
        before = await finished(env)
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 503 and "no decode node" in r.json()["error"]["message"], r.text
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True})
        assert sse_events(r.text)[-2]["error"]["code"] == 503, r.text
        assert delta(await finished(env), before) == {"error": 2.0}
        st = await env.stats()
        assert st.counters["finish.error"] == 2 and "finish.abort" not in st.counters, st.counters


@pytest.mark.parametrize("stream", [True, False])
async def test_a_response_that_fails_after_its_nodes_end_counts_as_the_error_its_client_got(nats_url, tmp_path, monkeypatch, stream):
    """A bug in the output path after the node's last chunk came (here: making the last chunk's / the body's ``ei``
    object, which is made only once that end was read): the client gets a 500 (a stream's error event after its 200),
    and the request is counted ``error``, once. Before, the node's end had been counted first, ``length``, and the
    500 counted nothing more: the count said served. Nothing is left on a node to abort (aborts unchanged)."""
    from services.router.service import RouterService

    def broken(p):
        raise RuntimeError("a bug in the output path")

    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        before, counters = await finished(env), dict(env.service.counters)
        monkeypatch.setattr(RouterService, "_ei", staticmethod(broken))
        r = await env.http.post("/v1/completions", json={"prompt": [5] * 20, "max_tokens": 4, "stream": stream})
        if stream:
            assert r.status_code == 200
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500, events[-3:]
        else:
            assert r.status_code == 500 and r.json()["error"]["message"] == "internal error in the router: RuntimeError", r.text
        monkeypatch.undo()
        assert delta(await finished(env), before) == {"error": 1.0}
        c = env.service.counters
        assert c.get("stream_errors_500", 0) - counters.get("stream_errors_500", 0) == (1 if stream else 0)
        assert c.get("aborts", 0) == counters.get("aborts", 0) and not env.service._pending, dict(c)


async def test_a_response_that_fails_to_build_counts_once_as_error(nats_url, tmp_path):
    """A non-streamed body that cannot be encoded (a router bug) is a 500 counted ``error``: its end was handed to the
    response's close (``response_on``) before the body was encoded, so the request was counted nowhere."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        before = await finished(env)
        real_ei = env.service._ei
        env.service._ei = lambda p: {"bad": object()}  # type: ignore[method-assign]  # msgspec cannot encode it
        try:
            r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        finally:
            env.service._ei = real_ei  # type: ignore[method-assign]
        assert r.status_code == 500 and "TypeError" in r.text, r.text
        await _wait_for(lambda: env.service.core.view.inflight_total == 0, what="request ended")
        assert delta(await finished(env), before) == {"error": 1.0}
