"""``Bus.close``'s final flush across a NATS reconnect ends once the flush can complete on the new connection.

The drain's last step is :meth:`Bus.flush` (a PING after everything queued; done at its PONG). nats-py forgets the
PINGs it waits on when it reconnects (``Client._pongs = []``, nats-py 2.16): a flush whose PING was sent on a
connection that was then lost never ends, and the connection is up again, so the lost-connection grace
(``CLOSE_LOST_GRACE_S``) does not end the wait either. The bus connects through a loopback TCP proxy the test controls
(to a real nats-server): the proxy holds the server's PONG to the close's flush, then cuts the connection; the bus
reconnects at once, the server up. The grace is made longer than the whole drain so that only the reconnect can end
the wait. Before, the close waited out the whole rest of its bound (``CLOSE_DRAIN_S``, made 8 s here: 7.7 s after the
reconnect); now it flushes again on the new connection and ends a PING round trip after the reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

import shared.bus as bus_module
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects
from tests.integration.nats_proxy import NatsProxy
from tests.integration.polling import until

DRAIN_S = 8.0
"""The close's drain bound in this test (``CLOSE_DRAIN_S``): far longer than the reconnect takes."""


@pytest.mark.timeout(60)
async def test_a_reconnect_during_the_close_flush_ends_the_close_once_the_flush_can_complete(monkeypatch):
    monkeypatch.setattr(bus_module, "CLOSE_DRAIN_S", DRAIN_S)
    monkeypatch.setattr(bus_module, "CLOSE_LOST_GRACE_S", 2 * DRAIN_S)  # only the reconnect may end the wait
    srv = EmbeddedNatsServer(jetstream=False).start()
    proxy = NatsProxy(srv.port)  # type: ignore[arg-type]
    bus = None
    try:
        bus = await Bus.connect(await proxy.start(), Subjects("p0"), service="router", instance="router")
        await bus.flush()
        link = proxy.links[-1]
        pings = link.sent.count(b"PING\r\n")
        link.flowing.clear()  # the close's flush gets no PONG on this connection
        t0 = time.monotonic()
        closing = asyncio.ensure_future(bus.close())
        # the drain (no subscriptions) goes straight to its flush: its PING is out, its PONG held
        await until(lambda: link.sent.count(b"PING\r\n") > pings, what="the close's flush to send its PING")
        assert not closing.done()
        link.cut()
        await asyncio.wait_for(closing, DRAIN_S + 5.0)
        ended = time.monotonic()
        assert bus.counters["nats.reconnects"] == 1, "the bus did not reconnect during the close: nothing tested"
        assert bus.reconnected_at is not None
        assert bus.reconnected_at - t0 < DRAIN_S - 4.0, (
            f"the bus reconnected {bus.reconnected_at - t0:.2f} s into the close: too late to tell (nothing tested)"
        )
        assert bus.nc.is_closed
        after = ended - bus.reconnected_at
        assert after < 2.0, (
            f"Bus.close ended {after:.2f} s after the reconnect ({ended - t0:.2f} s in all, CLOSE_DRAIN_S {DRAIN_S}): "
            "its flush waited on a PING the reconnect forgot"
        )
    finally:
        if bus is not None and not bus.nc.is_closed:
            with contextlib.suppress(Exception):
                await bus.nc.close()
        await proxy.close()
        srv.stop()
