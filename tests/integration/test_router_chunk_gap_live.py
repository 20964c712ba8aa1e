"""A token chunk that starts past the next output position of its request (the chunks between never came: a reliable
message a bus dropped past its bounds, or one core NATS lost) fails the request with a 502 naming the missing
positions, counted ``chunks_gap``; before, the router appended the later tokens and the client got HTTP 200 with
tokens missing (reviewer rr-bus2, /tmp/rr-bus2/test_rrbus2_scratch.py test B). The chunks are handed to the router's
chunk handler directly (the fake cluster answers nothing), on a real nats-server."""

from __future__ import annotations

import asyncio

import pytest

from shared import messages as m
from tests.integration.test_router_live import _wait_for, output_token, router_env, sse_events


async def _gap(env, body: dict) -> asyncio.Task:
    """Send ``body``; feed its work index 0, then 5..7 (1..4 lost, the last ends it); return the response task."""
    env.cluster.answering.clear()
    svc = env.service
    req = asyncio.create_task(env.http.post("/v1/completions", json=body))
    await _wait_for(lambda: len(env.cluster.works) == 1, what="work dispatched")
    w = env.cluster.works[0]
    ids = [output_token(i) for i in range(8)]
    await svc._on_chunk(m.TokenChunk(rid=w.rid, node="c0", index=0, token_ids=ids[:1], prompt_tokens=3, attempt=w.attempt), "")
    for i in range(5, 8):
        await svc._on_chunk(m.TokenChunk(rid=w.rid, node="c0", index=i, token_ids=ids[i : i + 1], finished=i == 7,
                                         finish_reason="length" if i == 7 else None, attempt=w.attempt), "")  # fmt: skip
    return req


@pytest.mark.timeout(60)
async def test_a_chunk_index_gap_fails_the_request_not_a_200_with_tokens_missing(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        r = await (await _gap(env, {"prompt": [1, 2, 3], "max_tokens": 8}))
        assert r.status_code == 502, (r.status_code, r.text[:300])
        msg = r.json()["error"]["message"]
        assert "output lost: tokens 1..4" in msg and "starts at 5" in msg, msg
        assert env.service.counters["chunks_gap"] == 1 and env.service.counters["aborts.chunks_gap"] == 1, dict(env.service.counters)
        assert not env.service._pending or all(p.done for p in env.service._pending.values())


@pytest.mark.timeout(60)
async def test_a_chunk_index_gap_ends_a_stream_with_an_error_event(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        r = await (await _gap(env, {"prompt": [1, 2, 3], "max_tokens": 8, "stream": True}))
        assert r.status_code == 200  # a stream's status went out at acceptance
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 502, events
        assert "output lost: tokens 1..4" in events[-2]["error"]["message"], events[-2]
        texts = [e for e in events[:-2] if isinstance(e, dict) and "choices" in e]
        assert len(texts) == 1, events  # token 0 only: none of 5..7 was sent after the hole
