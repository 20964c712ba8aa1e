"""Token chunks that reach the router out of order (one past the next output position of its request) are held for
the output before them, and sent in order once it comes; a gap that does not fill within ``chunk_gap_wait_s``
(``CHUNK_GAP_WAIT_S``: a NATS reconnect's resend, 7 s) or with ``CHUNK_GAP_MAX_HELD`` chunks held fails the request
with a 502 naming the missing positions, counted ``chunks_gap``. Before 4da5861 the router appended the later tokens
and the client got HTTP 200 with tokens missing (reviewer rr-bus2); from 4da5861 until the hold, a chunk k + 1 stored
ahead of a resent chunk k after a NATS reconnect failed the request at once, though chunk k was on its way (reviewer
rr-gap, /tmp/rr-gap/test_rrgap_reorder.py: :func:`test_a_resent_chunk_stored_after_a_later_one_is_waited_for`).
Most chunks are handed to the router's chunk handler directly (the fake cluster answers nothing), on a real
nats-server; the reconnect test publishes them through a worker's bus behind a proxy."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from services.router.service import CHUNK_GAP_MAX_HELD, CHUNK_GAP_WAIT_S
from shared import messages as m
from shared.bus import RESEND_WINDOW_S, STREAM_LOOKUP_TIMEOUT_S, Bus
from shared.subjects import REQ_OUT, Subjects
from tests.integration.nats_proxy import NatsProxy
from tests.integration.polling import until
from tests.integration.test_router_live import _wait_for, output_token, router_env, sse_events


def _chunk(w: m.PrefillWork, i: int, *, n: int = 1, last: bool = False, node: str = "c0") -> m.TokenChunk:
    """Output positions ``i .. i + n - 1`` of work ``w`` from ``node`` (the fake engine's tokens); ``last`` ends it."""
    return m.TokenChunk(rid=w.rid, node=node, index=i, token_ids=[output_token(j) for j in range(i, i + n)],
                        prompt_tokens=3 if i == 0 else 0, finished=last, finish_reason="length" if last else None,
                        attempt=w.attempt)  # fmt: skip


async def _dispatched(env, body: dict) -> tuple[asyncio.Task, m.PrefillWork]:
    """Send ``body`` (the fake cluster answers nothing); return the response task and its work."""
    env.cluster.answering.clear()
    n = len(env.cluster.works)
    req = asyncio.create_task(env.http.post("/v1/completions", json=body))
    await _wait_for(lambda: len(env.cluster.works) == n + 1, what="work dispatched")
    return req, env.cluster.works[-1]


async def _gap(env, body: dict) -> asyncio.Task:
    """Send ``body``; feed its work index 0, then 5..7 (1..4 lost, the last ends it); return the response task."""
    svc = env.service
    req, w = await _dispatched(env, body)
    await svc._on_chunk(_chunk(w, 0), "")
    for i in range(5, 8):
        await svc._on_chunk(_chunk(w, i, last=i == 7), "")
    return req


def test_the_wait_covers_a_reconnects_resend():
    """The wait is the bus's resend window plus its stream lookup's timeout: after a reconnect the window's chunks
    are published again only once the lookup is answered."""
    assert CHUNK_GAP_WAIT_S == RESEND_WINDOW_S + STREAM_LOOKUP_TIMEOUT_S == 7.0 and CHUNK_GAP_MAX_HELD == 256


@pytest.mark.timeout(60)
async def test_a_chunk_index_gap_not_filled_in_time_fails_the_request_not_a_200_with_tokens_missing(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        env.service.chunk_gap_wait_s = 0.4
        t0 = time.monotonic()
        req = await _gap(env, {"prompt": [1, 2, 3], "max_tokens": 8})
        await asyncio.sleep(0.2)
        assert not req.done() and env.service.counters["chunks_held"] == 3  # held, not failed at once
        r = await req
        waited = time.monotonic() - t0
        assert r.status_code == 502, (r.status_code, r.text[:300])
        msg = r.json()["error"]["message"]
        assert "output lost: tokens 1..4" in msg and "never arrived within 0.4 s" in msg and "starts at 5" in msg, msg
        # failed by the fence loop's sweep (no chunk came after the wait): at most one round (0.5 s) late
        assert 0.4 <= waited < 0.4 + 0.5 + 1.0, waited
        assert env.service.counters["chunks_gap"] == 1 and env.service.counters["aborts.chunks_gap"] == 1, dict(env.service.counters)
        assert not env.service._pending or all(p.done for p in env.service._pending.values())
        assert not env.service._holding
        metrics = (await env.http.get("/metrics")).text
        assert "ei_router_chunks_gap_total 1.0" in metrics


@pytest.mark.timeout(60)
async def test_a_chunk_index_gap_ends_a_stream_with_an_error_event(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        env.service.chunk_gap_wait_s = 0.3
        r = await (await _gap(env, {"prompt": [1, 2, 3], "max_tokens": 8, "stream": True}))
        assert r.status_code == 200  # a stream's status went out at acceptance
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 502, events
        assert "output lost: tokens 1..4" in events[-2]["error"]["message"], events[-2]
        texts = [e for e in events[:-2] if isinstance(e, dict) and "choices" in e]
        assert len(texts) == 1, events  # token 0 only: none of 5..7 was sent after the hole


@pytest.mark.timeout(60)
async def test_the_wait_does_not_run_out_while_the_routers_own_bus_settles(nats_url, tmp_path):
    """This router's NATS connection just came back (or it was frozen): the missing chunks cannot have reached it
    yet, so the wait runs from when it settles, not from the first chunk held."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        svc.chunk_gap_wait_s = 0.3
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 3})
        await svc._on_chunk(_chunk(w, 0), "")
        svc._resumed_at, svc._resumed_why = time.monotonic(), "a test's freeze"  # settling for fence_after_s + 1 s
        assert svc._bus_settling()
        await svc._on_chunk(_chunk(w, 2, last=True), "")
        await asyncio.sleep(1.2)  # 4 waits, while settling
        assert not req.done() and svc.counters.get("chunks_gap", 0) == 0
        await svc._on_chunk(_chunk(w, 1), "")
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.timeout(60)
async def test_a_later_chunk_after_the_wait_fails_the_request_on_arrival(nats_url, tmp_path):
    """The deadline is checked when a chunk comes too, not only by the fence loop's sweep."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        svc.chunk_gap_wait_s = 0.0
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 8})
        await svc._on_chunk(_chunk(w, 0), "")
        await svc._on_chunk(_chunk(w, 3), "")
        await asyncio.sleep(0.001)
        await svc._on_chunk(_chunk(w, 4), "")
        assert svc.counters["chunks_gap"] == 1 and svc._pending[w.rid].done  # failed in the handler, no sweep needed
        r = await req
        assert r.status_code == 502 and "tokens 1..2 of the request's output never arrived within 0 s" in r.json()["error"]["message"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
async def test_chunks_out_of_order_are_sent_in_order_and_the_end_waits_for_the_gap(nats_url, tmp_path, stream):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 7, "stream": stream})
        await svc._on_chunk(_chunk(w, 0), "")
        await svc._on_chunk(_chunk(w, 5, n=2, last=True), "")  # the end, held
        await svc._on_chunk(_chunk(w, 3, n=2), "")
        await svc._on_chunk(_chunk(w, 3, n=2), "")  # a duplicate of a held chunk
        await svc._on_chunk(_chunk(w, 2, n=2), "")  # overlaps the held 3..4
        await asyncio.sleep(0.2)
        p = svc._pending[w.rid]
        assert not req.done() and not p.done and p.next_index == 1 and sorted(p.held) == [2, 3, 5]
        assert svc._holding == {w.rid}
        await svc._on_chunk(_chunk(w, 1), "")  # the gap fills: 1, 2..3, 4 (of 3..4), 5..6 and the end
        assert p.done and not p.held and not svc._holding
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200, r.text
        ids = [output_token(i) for i in range(7)]
        if stream:
            events = sse_events(r.text)
            text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events
        else:
            text = r.json()["choices"][0]["text"]
            assert r.json()["usage"]["completion_tokens"] == 7
        assert text == svc.tokenizer.decode(ids)
        assert p.tokens == ids
        c = svc.counters
        assert c["chunks_held"] == 3 and c["chunks_duplicate"] == 1 and c.get("chunks_gap", 0) == 0, dict(c)
        assert c["finished.length"] == 1


@pytest.mark.timeout(60)
async def test_more_chunks_held_than_the_bound_fails_the_request_at_once(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 400})
        await svc._on_chunk(_chunk(w, 0), "")
        for i in range(2, 2 + CHUNK_GAP_MAX_HELD):
            await svc._on_chunk(_chunk(w, i), "")
        assert len(svc._pending[w.rid].held) == CHUNK_GAP_MAX_HELD and not svc._pending[w.rid].done
        await svc._on_chunk(_chunk(w, 2 + CHUNK_GAP_MAX_HELD), "")
        r = await asyncio.wait_for(req, 10)  # long before the 7-s wait
        assert r.status_code == 502
        msg = r.json()["error"]["message"]
        assert "tokens 1..1 of the request's output never arrived while 256 later chunks came" in msg, msg
        assert svc.counters["chunks_gap"] == 1 and not svc._holding


@pytest.mark.timeout(60)
async def test_a_decode_chunk_ahead_of_the_prefill_nodes_first_token_is_held_not_a_hand_off(nats_url, tmp_path):
    """PD: the decode node's chunk 1 reaches the router before the prefill node's chunk 0 (another connection). Held,
    it does not mark the hand-off: the prefill node's chunk 0 is still taken (not dropped as
    ``chunks_prefill_after_handoff``, which would leave the gap unfilled and fail the request)."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 4})
        await svc._on_chunk(_chunk(w, 1, n=3, last=True, node="d0"), "")
        await svc._on_chunk(_chunk(w, 0, node="p0"), "")
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == svc.tokenizer.decode([output_token(i) for i in range(4)])
        assert svc.counters.get("chunks_prefill_after_handoff", 0) == 0 and svc.counters["chunks_held"] == 1
        # once the decode node's output was taken, a later prefill-node chunk is dropped as before
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 6})
        await svc._on_chunk(_chunk(w, 0, node="p0"), "")
        await svc._on_chunk(_chunk(w, 1, node="d0"), "")
        await svc._on_chunk(_chunk(w, 2, node="p0"), "")
        assert svc.counters["chunks_prefill_after_handoff"] == 1
        await svc._on_chunk(_chunk(w, 2, n=4, last=True, node="d0"), "")
        assert (await asyncio.wait_for(req, 10)).status_code == 200


@pytest.mark.timeout(60)
async def test_a_redispatch_drops_the_old_attempts_held_chunks(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "p1": "prefill", "d0": "decode"}) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 4})
        node0 = svc.core.view.placement(w.rid)[0]
        await svc._on_chunk(_chunk(w, 2, node="d0"), "")  # attempt 0's output past a gap: held
        assert svc._holding == {w.rid}
        env.cluster.alive.discard(node0)  # its prefill node dies: fenced, re-dispatched (attempt 1)
        await _wait_for(lambda: len(env.cluster.works) == 2, what="re-dispatch")
        p = svc._pending[w.rid]
        assert p.attempt == 1 and not p.held and not svc._holding
        w1 = env.cluster.works[1]
        other = svc.core.view.placement(w.rid)[0]
        await svc._on_chunk(_chunk(w1, 0, node=other), "")
        await svc._on_chunk(_chunk(w1, 1, n=3, last=True, node="d0"), "")
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == svc.tokenizer.decode([output_token(i) for i in range(4)])
        assert svc.counters.get("chunks_gap", 0) == 0


@pytest.mark.timeout(60)
async def test_a_client_gone_while_chunks_are_held_frees_them(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 8, "stream": True})
        await svc._on_chunk(_chunk(w, 0), "")
        await svc._on_chunk(_chunk(w, 3), "")
        p = svc._pending[w.rid]
        assert p.held
        req.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await req
        await _wait_for(lambda: svc.counters["aborts.client_disconnect"] == 1, what="client gone")
        assert p.done and not p.held and not svc._holding
        await svc._on_chunk(_chunk(w, 1, n=2), "")  # the gap's chunks come late: nothing is sent, nothing held
        assert not p.held and svc.counters.get("chunks_gap", 0) == 0


@pytest.mark.timeout(60)
async def test_a_resent_chunk_stored_after_a_later_one_is_waited_for(nats_server, tmp_path):
    """rr-gap: a worker's chunk 1 dies unstored with its connection (a nats-server killed under it; its bus keeps it
    in the resend window), chunk 2 is published during the outage (nats-py's reconnect buffer). On reconnect nats-py
    flushes chunk 2 before the bus publishes its window again: chunk 1 reaches the router after chunk 2. The router
    holds chunk 2 and the client gets all 3 tokens with a 200; it failed the request at once with a 502 before."""
    async with router_env(nats_server.url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        proxy = NatsProxy(nats_server.port)
        wbus = await Bus.connect(await proxy.start(), Subjects("p0"), service="worker", instance="c0")
        try:
            assert await wbus.ensure_stream()
            req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 3})
            await wbus.publish(REQ_OUT, _chunk(w, 0), rid=w.rid, node="c0")
            await wbus.flush()
            await until(lambda: svc._pending[w.rid].next_index == 1, what="token 0 at the router")
            link = proxy.links[-1]
            link.forward_up = False  # what the worker writes now dies in the socket (a server killed under it)
            await wbus.publish(REQ_OUT, _chunk(w, 1), rid=w.rid, node="c0")
            await asyncio.sleep(0.3)
            proxy.refusing = True
            link.cut()
            await until(lambda: wbus.counters["nats.disconnects"] == 1, what="disconnect")
            await wbus.publish(REQ_OUT, _chunk(w, 2, last=True), rid=w.rid, node="c0")  # during the outage
            await asyncio.sleep(0.5)
            proxy.refusing = False
            r = await asyncio.wait_for(req, 20)
            assert r.status_code == 200, (r.status_code, r.text[:300])
            assert r.json()["choices"][0]["text"] == svc.tokenizer.decode([output_token(i) for i in range(3)])
            assert wbus.counters["resent"] >= 1
            assert svc.counters["chunks_held"] == 1 and svc.counters.get("chunks_gap", 0) == 0, dict(svc.counters)
        finally:
            await wbus.close()
            await proxy.close()
