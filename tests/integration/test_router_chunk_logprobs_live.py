"""A token chunk carrying more log-probabilities than its request asked for (``Sampling.logprobs``: none when it
asked none, else at most that many top entries a token; fewer is fine) is malformed: the request fails at once with
a 502 naming the node and the reason, its nodes are told to drop it, counted (``chunks_bad_logprobs``,
``aborts.bad_logprobs``), whether the chunk comes in order, is the stream's last or would be held past a gap; on a
real nats-server (the router's service; nodes played by ``FakeCluster`` of ``test_router_live``, the chunks handed
to the router's chunk handler). Before 90e76c0, one in order was taken (its response cut each top list to what was
asked, the rest kept in its queue until read) and one held kept all its entries until the gap filled; from 90e76c0 it
was dropped silently, so a bad LAST chunk (no later chunk held, so no gap wait) left its client waiting the whole
``request_timeout_s`` (600 s) for a 504 (reviewer rr-sec)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import messages as m
from tests.integration.test_router_chunk_gap_live import _dispatched
from tests.integration.test_router_live import _wait_for, output_token, router_env, sse_events

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 10.0
"""The router's ``request_timeout_s`` here: a request the bad chunk left waiting would end with a 504 only then."""


def _lp_chunk(w: m.PrefillWork, i: int, top: int | None, *, last: bool = False, node: str = "c0") -> m.TokenChunk:
    """Output position ``i`` of ``w`` from ``node`` with ``top`` top entries (None: no log-probabilities at all)."""
    lp = {} if top is None else {"logprobs": [-0.5], "top_ids": [[output_token(i) + j for j in range(top)]],
                                 "top_logprobs": [[-0.5 - j for j in range(top)]]}  # fmt: skip
    return m.TokenChunk(rid=w.rid, node=node, index=i, token_ids=[output_token(i)], prompt_tokens=3 if i == 0 else 0,
                        finished=last, finish_reason="length" if last else None, attempt=w.attempt, **lp)  # fmt: skip


async def _torch(env, nodes: tuple[str, ...] = ("c0",)) -> None:
    env.cluster.engines = dict.fromkeys(nodes, "torch")  # logprobs are refused (400) by a cluster of sim nodes
    await env.cluster.publish_states()
    await _wait_for(lambda: env.service.core.view.engines() == {"torch"}, what="states applied")


def _failed_fast(svc, w: m.PrefillWork, r, t0: float, *, asked: str, top: int) -> None:
    """``r`` (the non-stream response to ``w``) is the bad chunk's 502, well before ``TIMEOUT_S``; counted, told."""
    waited = time.monotonic() - t0
    assert r.status_code == 502, (r.status_code, r.text[:300], waited)
    assert waited < 3.0, waited
    msg = r.json()["error"]["message"]
    assert "node c0" in msg and f"asked {asked}" in msg and f"{top} top entries" in msg, msg
    c = svc.counters
    assert c["chunks_bad_logprobs"] == 1 and c["aborts.bad_logprobs"] == 1 and c.get("aborts.timeout", 0) == 0, dict(c)
    assert c["finish.error"] == 1, dict(c)
    p = svc._pending.get(w.rid)
    assert p is None or (p.done and not p.held), p
    assert not svc._holding


@pytest.mark.parametrize("where", ["last", "middle", "held"])
async def test_a_chunk_with_more_top_logprobs_than_asked_fails_the_request_at_once(nats_url, tmp_path, where):
    """rr-sec: the bad chunk was the stream's last (dropped, nothing held, no gap wait): 504 after the request
    timeout. Now a 502 at once wherever it comes: the last, in order before more, or past a gap (held before)."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, request_timeout_s=TIMEOUT_S) as env:
        await _torch(env)
        svc = env.service
        assert "\nei_router_chunks_bad_logprobs_total 0.0\n" in (await env.http.get("/metrics")).text
        t0 = time.monotonic()
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2})
        assert w.sampling is not None and w.sampling.logprobs == 2
        await svc._on_chunk(_lp_chunk(w, 0, 2), "")
        if where == "last":
            await svc._on_chunk(_lp_chunk(w, 1, 3, last=True), "")
        elif where == "middle":
            await svc._on_chunk(_lp_chunk(w, 1, 3), "")
        else:
            await svc._on_chunk(_lp_chunk(w, 3, 3, last=True), "")  # past a gap: it would be held
        r = await asyncio.wait_for(req, TIMEOUT_S + 5)
        _failed_fast(svc, w, r, t0, asked="2", top=3)
        await _wait_for(lambda: [n for n, a in env.cluster.aborts if a.rid == w.rid] == ["c0"], what="work.abort to c0")
        await svc._on_chunk(_lp_chunk(w, 2, 3, last=True), "")  # another bad one, late: the request is over
        assert svc.counters["chunks_bad_logprobs"] == 1 and svc.counters["aborts"] == 1, dict(svc.counters)
        # exported (it was a counter with no metric): at 0 from the first scrape (test_metrics_e2e), 1 here
        assert "\nei_router_chunks_bad_logprobs_total 1.0\n" in (await env.http.get("/metrics")).text


async def test_a_bad_chunk_ends_a_stream_with_an_error_event_after_what_it_had(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, request_timeout_s=TIMEOUT_S) as env:
        await _torch(env)
        svc = env.service
        t0 = time.monotonic()
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 1, "stream": True})
        await svc._on_chunk(_lp_chunk(w, 0, 1), "")
        await svc._on_chunk(_lp_chunk(w, 1, 5, last=True), "")
        r = await asyncio.wait_for(req, TIMEOUT_S + 5)
        assert time.monotonic() - t0 < 3.0
        assert r.status_code == 200  # a stream's status went out at acceptance
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 502, events
        assert "node c0" in events[-2]["error"]["message"], events[-2]
        texts = [e for e in events[:-2] if isinstance(e, dict) and e.get("choices")]
        assert len(texts) == 1, events  # token 0, then the failure


async def test_a_chunk_with_logprobs_for_a_request_that_asked_none_fails_it(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, request_timeout_s=TIMEOUT_S) as env:
        svc = env.service
        t0 = time.monotonic()
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 2})
        await svc._on_chunk(_lp_chunk(w, 0, None), "")
        await svc._on_chunk(_lp_chunk(w, 1, 0, last=True), "")  # logprobs, no top lists: the last chunk
        r = await asyncio.wait_for(req, TIMEOUT_S + 5)
        _failed_fast(svc, w, r, t0, asked="none", top=0)


async def test_fewer_top_logprobs_than_asked_are_fine_in_order_or_held(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, request_timeout_s=TIMEOUT_S) as env:
        await _torch(env)
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2})
        await svc._on_chunk(_lp_chunk(w, 0, 2), "")
        await svc._on_chunk(_lp_chunk(w, 3, 2, last=True), "")  # held
        for i in (1, 2):
            await svc._on_chunk(_lp_chunk(w, i, 1 if i == 2 else 0), "")  # fewer than asked: a node's vocabulary
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length", body
        tops = body["choices"][0]["logprobs"]["top_logprobs"]
        assert len(tops) == 4 and all(len(t) <= 3 for t in tops), tops  # the asked 2 and the chosen token's
        assert svc.counters.get("chunks_bad_logprobs", 0) == 0 and svc.counters["chunks_held"] == 1, dict(svc.counters)


async def test_a_bad_chunk_of_a_node_that_no_longer_serves_the_stream_does_not_fail_it(nats_url, tmp_path):
    """The prefill node after the hand-off reached the decode node holds nothing of the request: its chunk (a forged
    one, on its own subject) is dropped (``chunks_prefill_after_handoff``) whatever it carries; it must not end the
    stream, malformed log-probabilities included."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, request_timeout_s=TIMEOUT_S) as env:
        await _torch(env, ("p0", "d0"))
        svc = env.service
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 1})
        await svc._on_chunk(_lp_chunk(w, 0, 1, node="p0"), "")
        await svc._on_chunk(_lp_chunk(w, 1, 1, node="d0"), "")  # the hand-off reached the router
        await svc._on_chunk(_lp_chunk(w, 2, 9, last=True, node="p0"), "")  # forged, malformed: dropped
        await svc._on_chunk(_lp_chunk(w, 3, 9, last=True, node="p0"), "")  # and past a gap
        assert svc.counters["chunks_prefill_after_handoff"] == 2 and svc.counters.get("chunks_bad_logprobs", 0) == 0
        assert not svc._pending[w.rid].done and not svc._pending[w.rid].held
        await svc._on_chunk(_lp_chunk(w, 2, 1, last=True, node="d0"), "")
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
