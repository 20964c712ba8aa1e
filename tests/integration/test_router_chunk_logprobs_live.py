"""A token chunk carrying more log-probabilities than its request asked for (``Sampling.logprobs``: none when it
asked none, else at most that many top entries a token) is malformed: dropped and counted (``chunks_bad_logprobs``),
whether it comes in order or is held past a gap, on a real nats-server (the router's service; nodes played by
``FakeCluster`` of ``test_router_live``, the chunks handed to the router's chunk handler). Before, one in order was
taken (its response cut each top list to what was asked, the rest kept in its queue until read) and one held kept
all its entries until the gap filled: held bytes were bounded only by message validation (20 a token)."""

from __future__ import annotations

import asyncio

import pytest

from shared import messages as m
from tests.integration.test_router_chunk_gap_live import _dispatched
from tests.integration.test_router_live import _wait_for, output_token, router_env

pytestmark = pytest.mark.timeout(60)


def _lp_chunk(w: m.PrefillWork, i: int, top: int | None, *, last: bool = False) -> m.TokenChunk:
    """Output position ``i`` of ``w`` from c0 with ``top`` top entries (None: no log-probabilities at all)."""
    lp = {} if top is None else {"logprobs": [-0.5], "top_ids": [[output_token(i) + j for j in range(top)]],
                                 "top_logprobs": [[-0.5 - j for j in range(top)]]}  # fmt: skip
    return m.TokenChunk(rid=w.rid, node="c0", index=i, token_ids=[output_token(i)], prompt_tokens=3 if i == 0 else 0,
                        finished=last, finish_reason="length" if last else None, attempt=w.attempt, **lp)  # fmt: skip


async def _torch(env) -> None:
    env.cluster.engines = {"c0": "torch"}  # logprobs are refused (400) by a cluster of sim nodes
    await env.cluster.publish_states()
    await _wait_for(lambda: env.service.core.view.engines() == {"torch"}, what="states applied")


async def test_a_chunk_with_more_top_logprobs_than_asked_is_dropped_in_order_or_held(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        await _torch(env)
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2})
        assert w.sampling is not None and w.sampling.logprobs == 2
        p = svc._pending[w.rid]
        await svc._on_chunk(_lp_chunk(w, 0, 2), "")
        await svc._on_chunk(_lp_chunk(w, 1, 3, last=True), "")  # in order, 3 > 2 top entries: would end it
        await svc._on_chunk(_lp_chunk(w, 3, 20, last=True), "")  # past a gap: would be held with its 20
        assert p.next_index == 1 and not p.held and not p.done, (p.next_index, p.held, p.done)
        assert svc.counters["chunks_bad_logprobs"] == 2 and svc.counters.get("chunks_held", 0) == 0, dict(svc.counters)
        await svc._on_chunk(_lp_chunk(w, 3, 2, last=True), "")  # held
        for i in (1, 2):
            await svc._on_chunk(_lp_chunk(w, i, 1 if i == 2 else 0), "")  # fewer than asked: a node's vocabulary
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length", body
        tops = body["choices"][0]["logprobs"]["top_logprobs"]
        assert len(tops) == 4 and all(len(t) <= 3 for t in tops), tops  # the asked 2 and the chosen token's


async def test_a_chunk_with_logprobs_for_a_request_that_asked_none_is_dropped(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 2})
        p = svc._pending[w.rid]
        await svc._on_chunk(_lp_chunk(w, 0, 0), "")  # logprobs, no top lists
        await svc._on_chunk(_lp_chunk(w, 1, 5, last=True), "")  # past a gap
        assert p.next_index == 0 and not p.held, (p.next_index, p.held)
        assert svc.counters["chunks_bad_logprobs"] == 2, dict(svc.counters)
        for i in (0, 1):
            await svc._on_chunk(_lp_chunk(w, i, None, last=i == 1), "")
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert r.json()["choices"][0]["logprobs"] is None, r.text
