"""A close whose drain lasts (a core handler busy) leaves no new JetStream consumer behind.

A reliable subscription is an ordered JetStream consumer whose idle heartbeats nats-py checks in a background task
(two missed ones reset it: a new subscription and a new consumer on the server). ``Bus.close`` drains the subscription
(UNSUB), which nats-py's drain does not stop that task for: the drained consumer's silence read as missed heartbeats,
and during a drain longer than two heartbeats (``CONSUMER_HEARTBEAT_S``) nats-py made a new consumer, which the close
left on the stream (2 consumers after a 3-s drain). Now the close cancels those tasks as its drain begins
(``Bus._stop_consumer_checks``, nats-py's private attributes ``shared.bus.CONSUMER_CHECK_TASKS``: this test fails if
nats-py renames them).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats
import pytest

import shared.bus as bus_module
from shared import messages as m
from shared.bus import Bus, stream_name
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import BRANCH_EVENTS, Subjects

DRAIN_S = 2.5
"""How long a core handler keeps the close's drain going: past two missed heartbeats (2 x 0.5 s) with room."""


@pytest.mark.timeout(60)
async def test_a_long_close_drain_makes_no_new_consumer():
    srv = EmbeddedNatsServer(jetstream=True).start()
    subjects = Subjects("p0")
    bus = pub = obs = None
    try:
        bus = await Bus.connect(srv.url, subjects, service="router", instance="closing")
        pub = await Bus.connect(srv.url, subjects, service="router", instance="publisher")
        obs = await nats.connect(srv.url, connect_timeout=5, max_reconnect_attempts=2)
        got: list[str] = []

        async def on_event(msg: Any, _subject: str) -> None:
            got.append(msg.branch_id)

        await bus.subscribe(BRANCH_EVENTS, on_event)
        assert bus.jetstream and len(bus._js_subs) == 1
        jsi = bus_module._ordered_state(bus._js_subs[0][0])
        for name in bus_module.CONSUMER_CHECK_TASKS:  # nats-py still names them so (private attributes)
            task = getattr(jsi, name, None)
            assert isinstance(task, asyncio.Task) and not task.done(), f"nats-py's ordered consumer has no task {name}"
        busy = asyncio.Event()

        async def slow(_msg: nats.aio.msg.Msg) -> None:
            busy.set()
            await asyncio.sleep(DRAIN_S)

        await bus.nc.subscribe("test.slow", cb=slow)
        await bus.flush()
        await pub.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="before-close"))
        await pub.flush()
        js = obs.jetstream(timeout=5)
        name = stream_name(subjects)
        before = [c.name for c in await js.consumers_info(name)]
        assert len(before) == 1, before
        await obs.publish("test.slow", b"1")
        await obs.flush()
        await asyncio.wait_for(busy.wait(), 5.0)

        closing = asyncio.ensure_future(bus.close())
        for i in range(int(DRAIN_S / 0.2)):  # the stream goes on taking messages during the drain
            await pub.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=f"after-close-{i}"))
            await asyncio.sleep(0.2)
        await asyncio.wait_for(closing, 15.0)
        after = [c.name for c in await js.consumers_info(name)]
        assert after == before, f"the close's drain left consumers {after} (before it: {before})"
        for name_ in bus_module.CONSUMER_CHECK_TASKS:
            task = getattr(jsi, name_)
            assert task.done(), f"{name_} still running after the close"
        assert got[:1] == ["before-close"]  # (one published as the close began may be handled too: sent before the UNSUB)
    finally:
        for b in (bus, pub):
            if b is not None and not b.nc.is_closed:
                with contextlib.suppress(Exception):
                    await b.close()
        if obs is not None:
            with contextlib.suppress(Exception):
                await obs.close()
        srv.stop()
