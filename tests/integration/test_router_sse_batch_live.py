"""Token chunks that reach the router together (a node's step that folded several decode iterations publishes one
chunk per token at once) go to the client in one body message, one socket write, not one each: the same events, in
the same order; the first token still goes out alone and at once, and nothing waits for a chunk still to come.
Before, each event was its own message: a write syscall per output token, ~13% of the router's CPU in the demo.
The chunks are handed to the router's chunk handler directly (the fake cluster answers nothing), on a real
nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.router.service import SSE_BATCH_EVENTS
from tests.integration.polling import until
from tests.integration.test_router_chunk_gap_live import _chunk, _dispatched
from tests.integration.test_router_live import router_env, sse_events


def _count_messages(svc: Any) -> list[bytes]:
    """Wrap ``svc._stream`` so that each body message it yields is recorded; returns the record."""
    sent: list[bytes] = []
    make = svc._stream

    def counted(*args: Any, **kwargs: Any) -> AsyncIterator[bytes]:
        async def gen() -> AsyncIterator[bytes]:
            async for part in make(*args, **kwargs):
                sent.append(part)
                yield part

        return gen()

    svc._stream = counted
    return sent


@pytest.mark.timeout(60)
async def test_chunks_queued_together_go_out_in_one_message(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        sent = _count_messages(svc)
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": 12, "stream": True})
        await svc._on_chunk(_chunk(w, 0), "")
        await until(lambda: len(sent) == 1, what="the first token sent alone")
        for i in range(1, 11):  # ten chunks at once, as from one node step: no await between them suspends
            await svc._on_chunk(_chunk(w, i), "")
        await until(lambda: len(sent) == 2, what="the ten sent")
        await svc._on_chunk(_chunk(w, 11, last=True), "")
        r = await req
        assert r.status_code == 200, r.text[:300]
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and len(events) == 13, events
        assert [len(sse_events(part.decode())) for part in sent] == [1, 10, 1, 1], sent
        assert b"".join(sent).decode() == r.text  # the same bytes, in order
        assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.timeout(60)
async def test_a_long_run_of_queued_chunks_is_cut_at_the_batch_bound(nats_url, tmp_path):
    """A stream whose client reads nothing must leave its output in the router's queue (counted against
    ``--max-buffered-output-tokens``): one message takes at most SSE_BATCH_EVENTS events."""
    n = 2 * SSE_BATCH_EVENTS + 5
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        sent = _count_messages(svc)
        req, w = await _dispatched(env, {"prompt": [1, 2, 3], "max_tokens": n + 2, "stream": True})
        await svc._on_chunk(_chunk(w, 0), "")
        await until(lambda: len(sent) == 1, what="the first token sent")
        for i in range(1, n + 1):
            await svc._on_chunk(_chunk(w, i), "")
        await svc._on_chunk(_chunk(w, n + 1, last=True), "")
        r = await req
        assert r.status_code == 200, r.text[:300]
        sizes = [len(sse_events(part.decode())) for part in sent]
        assert sizes == [1, SSE_BATCH_EVENTS, SSE_BATCH_EVENTS, 6, 1], sizes  # the last 5 go with the final event
        assert b"".join(sent).decode() == r.text
