"""A queue-group request that reaches a closing bus after a NATS reconnect is answered, not dropped.

``Bus.close`` drains every subscription (nats-py ``Subscription.drain``: UNSUB, a PING round trip, the queue handled).
nats-py forgets the PINGs it waits on when it reconnects, so those drains never end, and it subscribes the draining
subscriptions again on the new connection (they are still in ``Client._subs``): the server delivers to them again,
a queue group's share of the requests included. Before, the drain ended them, once no handler was busy, by
unsubscribing them (nats-py drops the subscription at once, its UNSUB follows): a request the server had routed to
this member before that UNSUB reached it was dropped on arrival, unanswered, though the group had another member. Now
the drains are made again on the new connection (UNSUB, PING, queue handled): what the server sent before the UNSUB
comes before the PONG and is handled.

The bus connects through a loopback TCP proxy the test controls (to a real nats-server): the proxy cuts the bus's
connection during the drain (a reconnect with the server up), and after the reconnect holds the bus's UNSUB of the queue
subscription on its way to the server (the server goes on routing to the closing bus meanwhile) and what the server
sends the bus until the requests are routed, so some are in flight to the closing bus when its UNSUB reaches the
server, as on a loaded network. Before, the UNSUB could reach the server before the requests were sent (1 run in 14):
all went to the other member and the test passed without testing anything; now it asserts the closing bus answered.
"""

from __future__ import annotations

import asyncio
import contextlib

import nats
import pytest

from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects
from tests.integration.nats_proxy import NatsProxy
from tests.integration.polling import until

REQUESTS = 20
"""Requests sent to the queue group after the reconnect: the server routes each to either member (before, about half
went to the closing bus and were dropped)."""


@pytest.mark.timeout(60)
async def test_a_queue_request_routed_to_a_closing_bus_after_a_reconnect_is_answered():
    srv = EmbeddedNatsServer(jetstream=False).start()
    proxy = NatsProxy(srv.port)  # type: ignore[arg-type]
    a = b = c = None
    try:
        a = await Bus.connect(await proxy.start(), Subjects("p0"), service="planner", instance="planner-a")
        b = await Bus.connect(srv.url, Subjects("p0"), service="planner", instance="planner-b")
        c = await nats.connect(srv.url)
        finish = asyncio.Event()
        busy = asyncio.Event()

        async def answer_a(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"a")

        async def answer_b(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"b")

        async def slow(_msg: nats.aio.msg.Msg) -> None:  # keeps the close's drain going across the reconnect
            busy.set()
            await asyncio.wait_for(finish.wait(), 20.0)

        queue_sub = await a.nc.subscribe("test.queue", queue="g", cb=answer_a)
        await a.nc.subscribe("test.slow", cb=slow)
        await b.nc.subscribe("test.queue", queue="g", cb=answer_b)
        await a.flush()
        await b.flush()
        unsub = b"UNSUB %d " % queue_sub._id
        await c.publish("test.slow", b"1")
        await asyncio.wait_for(busy.wait(), 10.0)

        first = proxy.links[-1]
        first.flowing.clear()  # the drains' PONGs never come on this connection
        closing = asyncio.ensure_future(a.close())
        await until(lambda: unsub in first.sent, what="the close's drain to send its UNSUB")
        proxy.next_hold_up_at = unsub  # on the new connection the UNSUB waits in the proxy until the requests are routed
        first.cut()
        await until(lambda: a.counters["nats.reconnects"] == 1 and a.nc.is_connected, what="the bus to reconnect")
        second = proxy.links[-1]
        assert second is not first
        second.flowing.clear()  # what the server sends the closing bus now waits in the proxy
        asks = [asyncio.ensure_future(c.request("test.queue", b"r", timeout=3.0)) for _ in range(REQUESTS)]
        await c.flush()  # the server has routed them all: to b, or to a (held in the proxy)
        finish.set()  # the slow handler ends: no handler of the closing bus is busy now
        await until(lambda: unsub in second.sent, what="the closing bus to unsubscribe its queue subscription again")
        second.up_flowing.set()
        second.flowing.set()
        replies = await asyncio.gather(*asks, return_exceptions=True)
        lost = [r for r in replies if isinstance(r, BaseException)]
        by_a = sum(1 for r in replies if getattr(r, "data", b"") == b"a")
        await asyncio.wait_for(closing, 15.0)
        assert a.nc.is_closed
        assert not lost, (
            f"{len(lost)} of {REQUESTS} queue-group requests routed to the closing bus after its reconnect got no reply "
            f"({lost[0]!r}); answered by a: {by_a}"
        )
        # the server routed each to either member while the closing bus's UNSUB waited: all 20 to b has odds 2**-20
        assert by_a >= 1, "no request reached the closing bus: nothing was tested"
    finally:
        for bus in (a, b):
            if bus is not None and not bus.nc.is_closed:
                with contextlib.suppress(Exception):
                    await bus.close()
        if c is not None:
            with contextlib.suppress(Exception):
                await c.close()
        await proxy.close()
        srv.stop()
