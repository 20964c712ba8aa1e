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
        out = lambda c: env.bus.publish(REQ_OUT, c, rid="retry-7")  # noqa: E731
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
