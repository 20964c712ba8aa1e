"""Which nodes may publish a request's output after its decode node hands the decode work back (``work.requeue``, a
phase switch), on a real nats-server (the router's service; nodes played by ``FakeCluster`` of ``test_router_live``,
the chunks handed to the router's chunk handler, the hand-back sent on the bus).

The rule (``RouterService._handed_off``), for the current attempt with prefill node P: once the hand-off reached a
decode node (its output came, or it handed the decode work back: it had it), P's chunks are dropped
(``chunks_prefill_after_handoff``) once the attempt's first token is in; a decode node that handed the work back
forgot it, so its chunks are dropped (``chunks_wrong_node``), parked or not; the decode node bound again serves the
stream. Before (session 49's rule: P dropped only once the current decode node's output came), after a hand-back
to d1 a chunk forged by P (its key publishing on its own ``req.<rid>.out.p0``) ended the stream until d1's first
output, and while the work was parked (no other decode node) a chunk of the node that handed it back ended it too."""

from __future__ import annotations

import asyncio

import pytest

from shared import messages as m
from shared.subjects import WORK_REQUEUE
from tests.integration.test_router_chunk_gap_live import _dispatched
from tests.integration.test_router_live import _wait_for, output_token, router_env

pytestmark = pytest.mark.timeout(60)

PDD = {"p0": "prefill", "d0": "decode", "d1": "decode"}
PD = {"p0": "prefill", "d0": "decode"}


def _out(w: m.PrefillWork, node: str, i: int, *, last: bool = False, reason: str = "length") -> m.TokenChunk:
    """Output position ``i`` of work ``w`` from ``node`` (the fake engine's token); ``last`` ends it with ``reason``."""
    return m.TokenChunk(rid=w.rid, node=node, index=i, token_ids=[output_token(i)], prompt_tokens=3 if i == 0 else 0,
                        finished=last, finish_reason=reason if last else None, attempt=w.attempt, router="router")  # fmt: skip


async def _hand_back(env, w: m.PrefillWork, node: str) -> None:
    """``node``, the request's decode node, hands its decode work back (a phase switch); the router takes it."""
    work = m.DecodeWork(rid=w.rid, prompt_tokens=w.prompt_tokens, max_tokens=w.max_tokens, block_size=w.block_size,
                        block_hashes=list(w.block_hashes), prefill_node="p0", attempt=w.attempt, router="router")  # fmt: skip
    back = m.WorkRequeue(rid=w.rid, node=node, reason="phase switch", decode=work, attempt=w.attempt)
    rep = await env.bus.request(WORK_REQUEUE, back, timeout=5.0, router="router")
    assert rep.accepted, rep


async def test_after_a_decode_hand_back_the_prefill_and_the_old_decode_node_cannot_end_the_stream(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, PDD, request_timeout_s=30.0) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 6})
        old = w.decode_node
        assert old in ("d0", "d1"), w
        new = "d1" if old == "d0" else "d0"
        p = svc._pending[w.rid]
        await svc._on_chunk(_out(w, "p0", 0), "")
        await svc._on_chunk(_out(w, old, 1), "")  # the decode node's output: the hand-off reached it
        await _hand_back(env, w, old)
        await _wait_for(lambda: p.decode_node == new, what="the decode work bound again")
        # forged: the prefill node ends the stream, the old decode node fills and ends it
        await svc._on_chunk(_out(w, "p0", 2, last=True, reason="stop"), "")
        await svc._on_chunk(_out(w, old, 2, last=True, reason="stop"), "")
        assert not p.done and p.next_index == 2, (p.done, p.next_index, p.tokens)
        assert svc.counters["chunks_prefill_after_handoff"] == 1 and svc.counters["chunks_wrong_node"] == 1, dict(svc.counters)
        for i in range(2, 6):
            await svc._on_chunk(_out(w, new, i, last=i == 5), "")
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length", body
        assert p.tokens == [output_token(i) for i in range(6)]


async def test_while_handed_back_work_is_parked_the_node_that_handed_it_back_cannot_end_the_stream(nats_url, tmp_path):
    """The only decode node hands the work back: no other can take it, it is parked (``--requeue-wait-s``) with that
    node still recorded as its decode node; its chunks (and the prefill node's) are dropped, so the request fails at
    the bound (503) instead of ending as a 200 ``stop`` of the forged chunk."""
    async with router_env(nats_url, tmp_path, PD, request_timeout_s=30.0, requeue_wait_s=1.0) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 6})
        assert w.decode_node == "d0", w
        p = svc._pending[w.rid]
        await svc._on_chunk(_out(w, "p0", 0), "")
        await svc._on_chunk(_out(w, "d0", 1), "")
        await _hand_back(env, w, "d0")
        await _wait_for(lambda: w.rid in svc._parked, what="the handed-back work parked")
        assert p.decode_node == "d0"
        await svc._on_chunk(_out(w, "d0", 2, last=True, reason="stop"), "")
        await svc._on_chunk(_out(w, "d0", 3), "")  # past the next position: dropped, not held
        await svc._on_chunk(_out(w, "p0", 2, last=True, reason="stop"), "")
        assert not p.done and p.next_index == 2 and not p.held, (p.done, p.next_index, p.held)
        assert svc.counters["chunks_wrong_node"] == 2 and svc.counters["chunks_prefill_after_handoff"] == 1, dict(svc.counters)
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 503 and "requeue_wait_s" in r.json()["error"]["message"], r.text


async def test_a_prefill_nodes_first_token_that_a_hand_back_overtook_is_taken_its_later_chunks_are_not(nats_url, tmp_path):
    """The decode node hands the work back before the prefill node's first token reached the router (another
    publisher, another path): that first token is still taken (the new decode node's output waits for it); a later
    chunk of the prefill node is dropped though the new decode node's output has not come yet (before, it ended the
    stream: a 200 ``stop`` of 2 tokens), and the new decode node serves the rest."""
    async with router_env(nats_url, tmp_path, PDD, request_timeout_s=30.0) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 4})
        old = w.decode_node
        new = "d1" if old == "d0" else "d0"
        p = svc._pending[w.rid]
        await _hand_back(env, w, old)
        await _wait_for(lambda: p.decode_node == new, what="the decode work bound again")
        await svc._on_chunk(_out(w, new, 2), "")  # held: the output before it is not in
        await svc._on_chunk(_out(w, "p0", 0), "")  # the first token: taken
        assert p.next_index == 1 and sorted(p.held) == [2], (p.next_index, p.held)
        await svc._on_chunk(_out(w, "p0", 1, last=True, reason="stop"), "")  # forged, before the new node's output
        assert not p.done and svc.counters["chunks_prefill_after_handoff"] == 1, dict(svc.counters)
        for i in (1, 3):
            await svc._on_chunk(_out(w, new, i, last=i == 3), "")
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert p.tokens == [output_token(i) for i in range(4)]
