"""``Bus.close``'s drain against a real nats-server: what an in-flight handler still needs from the connection.

A handler of the closing bus that waits on a request needs the reply: nats-py's request-reply subscription (the one
``_INBOX.<nuid>.*`` whose callback is ``Client._request_sub_callback``) is drained only after the others have ended.
Before, it was drained with them: the reply came after it was gone and the handler waited out its request's whole
timeout, then failed (a read-only review's reproduction: close 1.95 s, the handler's request ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats
import pytest

from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects


@pytest.mark.timeout(60)
async def test_a_handlers_request_in_flight_at_close_gets_its_reply():
    srv = EmbeddedNatsServer(jetstream=False).start()
    other = None
    try:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="router", instance="router")
        other = await nats.connect(srv.url)

        async def responder(msg: nats.aio.msg.Msg) -> None:
            await asyncio.sleep(0.3)  # answers after the close began
            await msg.respond(b"answer")

        await other.subscribe("test.close.svc", cb=responder)
        await other.flush()
        await bus.nc.request("test.close.svc", b"warm", timeout=5)  # nats-py's reply subscription exists before
        results: list[object] = []
        started = asyncio.Event()

        async def handler(_msg: object) -> None:
            started.set()
            try:
                results.append((await bus.nc.request("test.close.svc", b"x", timeout=3)).data)
            except Exception as e:  # the assertion below names it
                results.append(repr(e))

        await bus.nc.subscribe("test.close.in", cb=handler)
        await bus.flush()
        await other.publish("test.close.in", b"1")
        await other.flush()
        await asyncio.wait_for(started.wait(), 5.0)
        t0 = time.monotonic()
        await bus.close()
        took = time.monotonic() - t0
        assert results == [b"answer"], f"the handler's request at close: {results} (close took {took:.2f} s)"
        assert took < 2.5, f"Bus.close took {took:.2f} s; the reply came 0.3 s after the request"
        assert bus.nc.is_closed
    finally:
        if other is not None:
            with contextlib.suppress(Exception):
                await other.close()
        srv.stop()
