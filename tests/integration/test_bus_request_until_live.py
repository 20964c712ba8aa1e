"""``Bus.request_until``: the retrying request a service makes at start (``split.get``), shared by
the router and the worker. Real nats-server; the responder comes up late, never, or the state
arrives another way."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import messages as m
from shared.bus import REFUSED_HEADER, Bus, BusError, RequestRefused
from shared.metrics import make_registry, metrics_payload
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
        # the start-up wait's unanswered tries are retries, not failed requests (an alert on
        # ei_bus_requests_failed_total fired on every clean start: the router asks before the planner is up)
        assert asker.counters["request_retried.split.get"] == attempts - 1
        assert asker.counters["request_failed.split.get"] == 0
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
        # a wait that gave up is one failed request; each of its tries a retry
        assert asker.counters["request_failed.split.get"] == 1
        assert asker.counters["request_retried.split.get"] == attempts
        with pytest.raises(BusError):  # a plain request without a reply is still a failure
            await asker.request(SPLIT_GET, m.SplitQuery(), timeout=0.1)
        assert asker.counters["request_failed.split.get"] == 2
        text = metrics_payload(make_registry(asker)).decode()
        assert 'ei_bus_requests_failed_total{subject="split.get"} 2.0' in text
        assert f'ei_bus_request_retries_total{{subject="split.get"}} {float(attempts)}' in text
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


async def test_a_refusal_ends_the_wait_at_once(nats_url):
    """A responder that refuses the request as malformed or invalid (its empty reply's ``Ei-Refused`` header, what
    ``Bus.serve`` answers to a request it cannot decode) refuses it again on every try: the wait ends at the first
    refusal with :class:`RequestRefused`. Before, it was retried until the deadline (here 5 s)."""
    asker = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="asker")
    planner = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="planner")
    try:

        async def refuse(msg) -> None:  # as Bus.serve refuses a request that does not decode
            await planner.nc.publish(msg.reply, b"", headers={REFUSED_HEADER: "malformed: expected `object`"})

        await planner.nc.subscribe(Subjects("p0").format(SPLIT_GET), cb=refuse)
        await planner.flush()  # Bus.flush: nats-py's writes its PING ahead of the queued SUB (a first try NoResponders)
        t0 = time.monotonic()
        reply, attempts, err = await asker.request_until(
            SPLIT_GET, m.SplitQuery(), deadline_s=5.0, attempt_timeout_s=0.5, retry_every_s=0.1
        )
        assert reply is None and isinstance(err, RequestRefused) and "malformed" in str(err), err
        assert attempts == 1 and time.monotonic() - t0 < 1.0
        assert asker.counters["request_refused.split.get"] == 1
        assert asker.counters["request_failed.split.get"] == 0 and asker.counters["request_retried.split.get"] == 0
    finally:
        await asker.close()
        await planner.close()
