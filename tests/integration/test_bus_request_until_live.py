"""``Bus.request_until``: the retrying request a service makes at start (``split.get``), shared by
the router and the worker. Real nats-server; the responder comes up late, never, or the state
arrives another way."""

from __future__ import annotations

import asyncio
import time

from shared import messages as m
from shared.bus import Bus, BusError
from shared.subjects import SPLIT_GET, Subjects


async def test_reply_from_a_responder_that_comes_up_late(nats_url):
    subj = Subjects("p0")
    asker = await Bus.connect(nats_url, subj, service="test", instance="asker")
    planner = await Bus.connect(nats_url, subj, service="test", instance="planner")
    retries: list[int] = []

    async def late() -> None:
        await asyncio.sleep(1.2)

        async def answer(_q: m.SplitQuery, _s: str) -> m.SplitCommand:
            return m.SplitCommand(epoch=7, phases={"n0": "prefill", "n1": "decode"})

        await planner.serve(SPLIT_GET, answer)

    try:
        task = asyncio.create_task(late())
        reply, attempts, err = await asker.request_until(
            SPLIT_GET, m.SplitQuery(), deadline_s=10.0, attempt_timeout_s=0.2, retry_every_s=0.1,
            on_retry=lambda a, e: retries.append(a),
        )
        await task
        assert err is None and reply is not None and reply.epoch == 7
        assert attempts >= 2 and retries == list(range(1, attempts))  # every failed try reported, in order
    finally:
        await asker.close()
        await planner.close()


async def test_gives_up_at_the_deadline_with_the_last_error(nats_url):
    asker = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="asker")
    try:
        t0 = time.monotonic()
        reply, attempts, err = await asker.request_until(
            SPLIT_GET, m.SplitQuery(), deadline_s=0.6, attempt_timeout_s=0.1, retry_every_s=0.1
        )
        waited = time.monotonic() - t0
        assert reply is None and isinstance(err, BusError) and attempts >= 2
        assert 0.6 <= waited < 3.0  # bounded by the deadline plus one try, not forever
    finally:
        await asker.close()


async def test_done_ends_the_wait_without_a_reply(nats_url):
    asker = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="asker")
    state = {"have": False}

    async def arrives_another_way() -> None:
        await asyncio.sleep(0.3)
        state["have"] = True

    try:
        task = asyncio.create_task(arrives_another_way())
        reply, attempts, err = await asker.request_until(
            SPLIT_GET, m.SplitQuery(), deadline_s=30.0, attempt_timeout_s=0.1, retry_every_s=0.1,
            done=lambda: state["have"],
        )
        await task
        assert reply is None and err is None and attempts >= 1
    finally:
        await asker.close()
