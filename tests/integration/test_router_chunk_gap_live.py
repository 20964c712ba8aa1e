"""Token chunks that reach the router out of order (one past the next output position of its request) are held for
the output before them, and sent in order once it comes; a gap that does not fill within ``chunk_gap_wait_s``
(``CHUNK_GAP_WAIT_S``: a NATS reconnect's resend, 7 s) fails the request with a 502 naming the missing positions, counted ``chunks_gap``. Before 4da5861 the router appended the later tokens
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

from services.router.service import CHUNK_GAP_WAIT_S
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
    assert CHUNK_GAP_WAIT_S == RESEND_WINDOW_S + STREAM_LOOKUP_TIMEOUT_S == 7.0


@pytest.mark.timeout(60)
async def test_a_chunk_index_gap_not_filled_in_time_fails_the_request_not_a_200_with_tokens_missing(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        env.service.chunk_gap_wait_s = 1.0  # the check below comes 0.2 s in: 0.8 s to spare on a loaded box
        t0 = time.monotonic()
        req = await _gap(env, {"prompt": [1, 2, 3], "max_tokens": 8})
        await asyncio.sleep(0.2)
        assert not req.done() and env.service.counters["chunks_held"] == 3  # held, not failed at once
        r = await req
        waited = time.monotonic() - t0
        assert r.status_code == 502, (r.status_code, r.text[:300])
        msg = r.json()["error"]["message"]
        assert "output lost: tokens 1..4" in msg and "never arrived within 1 s" in msg and "starts at 5" in msg, msg
        # failed by the fence loop's sweep (no chunk came after the wait): at most one round (0.5 s) late
        assert 1.0 <= waited < 1.0 + 0.5 + 1.0, waited
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
    """The deadline is checked when a chunk comes too, not only by the fence loop's sweep (turned off here: only the
    arrival can fail the request); not while this router's own bus settles (the missing chunk cannot reach it yet)."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        sweeps: list[float] = []
        svc._expire_held = lambda mono, *, settling=False: sweeps.append(mono)  # type: ignore[method-assign]
        svc.chunk_gap_wait_s = 0.0
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 8})
        await svc._on_chunk(_chunk(w, 0), "")
        await svc._on_chunk(_chunk(w, 3), "")
        await asyncio.sleep(0.001)
        svc._resumed_at, svc._resumed_why = time.monotonic(), "a test's freeze"  # settling for fence_after_s + 1 s
        assert svc._bus_settling()
        await svc._on_chunk(_chunk(w, 4), "")  # past the wait, but settling: held
        p = svc._pending[w.rid]
        assert not p.done and sorted(p.held) == [3, 4] and svc.counters.get("chunks_gap", 0) == 0
        svc._resumed_at = 0.0
        assert not svc._bus_settling()
        await _wait_for(lambda: len(sweeps) >= 2, what="fence rounds")  # the sweep ran (a no-op) and failed nothing
        assert not p.done
        await svc._on_chunk(_chunk(w, 5), "")
        assert svc.counters["chunks_gap"] == 1 and p.done  # failed in the handler: the sweep is off
        r = await req
        assert r.status_code == 502
        assert ("tokens 1..2 of the request's output never arrived within 0 s (2 later chunks held, the next from node "
                "c0 starts at 3); request failed") in r.json()["error"]["message"], r.text


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
async def test_held_chunks_are_bounded_by_the_requests_max_tokens_not_a_chunk_count(nats_url, tmp_path):
    """rr-gapfix: 256 chunks held failed the request, though an outage of 2.6 s at 100 tok/s (one token a chunk)
    brings more; and 256 chunks of any size could be held. Now 600 one-token chunks are held and sent once the gap
    fills; a chunk that ends past the request's max_tokens, or whose tokens with those held pass what the request has
    left (held chunks that overlap), is dropped (``chunks_over_max_tokens``), never held."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 602})
        await svc._on_chunk(_chunk(w, 0), "")
        p = svc._pending[w.rid]
        await svc._on_chunk(_chunk(w, 600, n=3), "")  # ends at 603 > 602
        for i in range(601, 1, -1):  # 600 chunks held, the last first
            await svc._on_chunk(_chunk(w, i, last=i == 601), "")
            if i == 600:
                # ends at 602 (fits alone), but it overlaps the two held: its 600 tokens + 2 held > 602 - 1 left
                await svc._on_chunk(_chunk(w, 2, n=600), "")
        assert len(p.held) == 600 and p.held_tokens == 600 and not p.done, (len(p.held), p.held_tokens)
        assert svc.counters["chunks_over_max_tokens"] == 2 and svc.counters["chunks_held"] == 600, dict(svc.counters)
        await svc._on_chunk(_chunk(w, 1), "")
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == 602
        assert r.json()["choices"][0]["text"] == svc.tokenizer.decode([output_token(i) for i in range(602)])
        assert svc.counters.get("chunks_gap", 0) == 0 and not svc._holding and not p.held_order and p.held_tokens == 0


@pytest.mark.timeout(60)
async def test_a_prefill_nodes_chunk_after_the_hand_off_is_not_held_in_the_decode_nodes_place(nats_url, tmp_path):
    """rr-gapfix: held chunks are keyed by index: a prefill-node chunk past the next position after the decode node's
    output came was held, so the decode node's real chunk at that index was a duplicate, and the held one was dropped
    when taken (``chunks_prefill_after_handoff``): the gap never filled and the request failed."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        svc = env.service
        svc.chunk_gap_wait_s = 0.5
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 4})
        await svc._on_chunk(_chunk(w, 0, node="p0"), "")
        await svc._on_chunk(_chunk(w, 1, node="d0"), "")  # the hand-off reached the router
        await svc._on_chunk(_chunk(w, 3, node="p0"), "")  # forged: dropped, not held
        assert svc.counters["chunks_prefill_after_handoff"] == 1 and not svc._pending[w.rid].held
        await svc._on_chunk(_chunk(w, 3, last=True, node="d0"), "")
        await svc._on_chunk(_chunk(w, 2, node="d0"), "")
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["choices"][0]["text"] == svc.tokenizer.decode([output_token(i) for i in range(4)])
        assert svc.counters.get("chunks_duplicate", 0) == 0 and svc.counters.get("chunks_gap", 0) == 0


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


@pytest.mark.timeout(60)
async def test_an_outage_of_300_chunks_is_held_for_the_resent_one(nats_server, tmp_path):
    """rr-gapfix (/tmp/rr-gapfix/rrmany_test.py): as the rr-gap test below, but 300 chunks are published during the
    outage (3 s at 100 tok/s, one token a chunk): all reach the router before the resent chunk 1. With at most 256
    chunks held the request failed with a 502 'while 256 later chunks came' though chunk 1 was on its way; held by
    tokens (at most max_tokens), the client gets all 302 tokens with a 200."""
    async with router_env(nats_server.url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        proxy = NatsProxy(nats_server.port)
        wbus = await Bus.connect(await proxy.start(), Subjects("p0"), service="worker", instance="c0")
        try:
            assert await wbus.ensure_stream()
            req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 302})
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
            for i in range(2, 302):  # 300 chunks during the outage (~3 s at 100 tok/s, stream_interval 1)
                await wbus.publish(REQ_OUT, _chunk(w, i, last=i == 301), rid=w.rid, node="c0")
            await asyncio.sleep(0.5)
            proxy.refusing = False
            r = await asyncio.wait_for(req, 20)
            assert r.status_code == 200, (r.status_code, r.text[:300])
            assert r.json()["choices"][0]["text"] == svc.tokenizer.decode([output_token(i) for i in range(302)])
            assert wbus.counters["resent"] >= 1
            assert svc.counters["chunks_held"] >= 257 and svc.counters.get("chunks_gap", 0) == 0, dict(svc.counters)
        finally:
            await wbus.close()
            await proxy.close()
