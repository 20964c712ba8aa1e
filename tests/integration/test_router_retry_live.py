"""A client that goes away and retries with the same ``X-Request-ID`` (real nats-server, the
router's service; nodes played by ``FakeCluster`` of ``test_router_live``).

The first request's node may still hold it, or still be ending it, when the retry arrives: its
late ``abort`` chunk must not end the retry's stream, and the retry's work must be told apart
from the first one's on the node (before: both were attempt 0; on a live cluster the first
one's abort chunk reached the router while a retry of the same id was in flight in 1 of 30
tries and was dropped only because the retry had been placed on another node)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from shared import messages as m
from shared.subjects import REQ_OUT
from tests.integration.test_router_live import _wait_for, router_env

pytestmark = pytest.mark.timeout(60)


async def test_a_retry_with_the_same_request_id_is_not_ended_by_the_first_ones_late_abort(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        env.cluster.answering.clear()  # the node only records work; the test plays its output
        hdr = {"X-Request-ID": "retry-7"}
        body = {"prompt": [1, 2, 3], "max_tokens": 3}
        first = asyncio.create_task(env.http.post("/v1/completions", json=body, headers=hdr))
        await _wait_for(lambda: len(env.cluster.works) == 1, what="first dispatched")
        first.cancel()  # the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await _wait_for(lambda: "retry-7" not in env.service._pending, what="first forgotten")
        retry = asyncio.create_task(env.http.post("/v1/completions", json=body, headers=hdr))
        await _wait_for(lambda: len(env.cluster.works) == 2, what="retry dispatched")
        old, new = env.cluster.works
        assert new.attempt > old.attempt  # the node serves the newest attempt and drops the other
        out = lambda c: env.bus.publish(REQ_OUT, c, rid="retry-7", node=c.node)  # noqa: E731
        # the first request's node ends it only now (its abort arrived late): an abort chunk of its attempt
        await out(m.TokenChunk(rid="retry-7", node="c0", index=0, finished=True, finish_reason="abort", error="client gone",
                               attempt=old.attempt))  # fmt: skip
        await asyncio.sleep(0.2)
        assert not retry.done()
        await out(m.TokenChunk(rid="retry-7", node="c0", index=0, token_ids=[5], prompt_tokens=3, attempt=new.attempt))
        await out(m.TokenChunk(rid="retry-7", node="c0", index=1, token_ids=[6, 7], finished=True, finish_reason="length",
                               attempt=new.attempt))  # fmt: skip
        r = await retry
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["ei"]["redispatches"] == 0
        st = await env.stats()
        assert st.counters["chunks_stale_attempt"] == 1
        # a third request with that id starts past the retry's attempt too
        third = asyncio.create_task(env.http.post("/v1/completions", json=body, headers=hdr))
        await _wait_for(lambda: len(env.cluster.works) == 3, what="third dispatched")
        assert env.cluster.works[2].attempt > new.attempt
        third.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await third


async def test_a_retry_sent_just_before_the_first_ones_close_is_served_not_409(nats_url, tmp_path):
    """The retry reaches the router before the close of the request it replaces (a client that
    gives up and retries at once): it waits up to _DUPLICATE_GRACE_S for that one to end instead
    of a 409. A real duplicate (the first still in flight after the grace) is still refused."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        env.cluster.answering.clear()  # the node only records work: the first stays in flight
        hdr = {"X-Request-ID": "again-1"}
        body = {"prompt": [1, 2, 3], "max_tokens": 3}
        first = asyncio.create_task(env.http.post("/v1/completions", json=body, headers=hdr))
        await _wait_for(lambda: len(env.cluster.works) == 1, what="first dispatched")
        retry = asyncio.create_task(env.http.post("/v1/completions", json=body, headers=hdr))
        await asyncio.sleep(0.15)
        assert not retry.done()  # waiting for the first one, not refused
        env.cluster.answering.add("c0")  # the retry, dispatched once the first has ended, is answered
        first.cancel()  # now the first one's client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await first
        r = await retry
        assert r.status_code == 200, r.text  # served past the first's attempt (the fake node answers it in full)
        assert env.cluster.works[1].attempt > env.cluster.works[0].attempt
        # a duplicate of a request that stays in flight: 409 after the grace
        env.cluster.answering.clear()
        third = asyncio.create_task(env.http.post("/v1/completions", json=body, headers={"X-Request-ID": "again-2"}))
        await _wait_for(lambda: len(env.cluster.works) == 3, what="third dispatched")
        t0 = asyncio.get_running_loop().time()
        dup = await env.http.post("/v1/completions", json=body, headers={"X-Request-ID": "again-2"})
        assert dup.status_code == 409 and "already in flight" in dup.json()["error"]["message"]
        assert asyncio.get_running_loop().time() - t0 >= 0.45
        third.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await third


async def test_two_requests_with_one_request_id_waiting_for_a_node_are_not_both_dispatched(nats_url, tmp_path):
    """A request waits up to --no-route-wait-s for an eligible node before it is pending; a second
    one with its X-Request-ID arriving meanwhile (the client gave up and retried) must not pass the
    in-flight check too: before, both were routed and dispatched under one rid and one attempt,
    the later one's _Pending replaced the earlier's, and the earlier client hung until its timeout."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, no_route_wait_s=5.0, request_timeout_s=3.0) as env:
        env.cluster.alive.clear()
        await _wait_for(lambda: not env.service.ready(), timeout=5, what="node fenced")
        hdr = {"X-Request-ID": "wait-1"}
        body = {"prompt": [1, 2, 3], "max_tokens": 3}
        first = asyncio.create_task(env.http.post("/v1/completions", json=body, headers=hdr))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(env.http.post("/v1/completions", json=body, headers=hdr))
        await asyncio.sleep(0.8)  # the second is past its grace while the first still waits for a node
        env.cluster.alive.add("c0")
        r1, r2 = await asyncio.gather(first, second)
        assert (r1.status_code, r2.status_code) == (200, 409), (r1.text, r2.text)
        assert "already in flight" in r2.json()["error"]["message"]
        assert [w.rid for w in env.cluster.works] == ["wait-1"]
