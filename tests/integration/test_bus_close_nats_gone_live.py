"""``Bus.close`` with the nats-server gone for good: it ends at once, not after ``CLOSE_DRAIN_S``, and leaves no
unretrieved exception behind.

Before: a server SIGKILLed just before the close (an operator's Ctrl-C reaching the whole process group, ``up``
stopping a cluster whose nats-server died, compose/k8s stopping everything at once) held every service's close 5.0 s
(``CLOSE_DRAIN_S``): nats-py's drain sends a PING per subscription, the connection is lost before the PONG, a reconnect
that never succeeds never answers it, and the close waited out its bound. Cancelling nats-py's drain then left its
``asyncio.gather`` of the subscriptions' drains with an exception nobody retrieved, printed at the loop's end as
"_GatheringFuture exception was never retrieved" (nats-py 2.16 ``Client.drain`` awaits it in ``wait_for``, which drops
the cancelled inner future's outcome). Measured before: 5.00 s and that message, every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time
from typing import Any

import pytest

from shared.bus import CLOSE_DRAIN_S, Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects


def _collect_loop_errors() -> list[dict[str, Any]]:
    """The event loop's exception-handler calls from now on (an unretrieved future's exception is one)."""
    seen: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("jetstream", [True, False])
@pytest.mark.parametrize("noticed", [False, True], ids=["at-once", "after-the-client-noticed"])
async def test_close_after_the_server_was_killed_returns_at_once_and_leaves_no_unretrieved_error(jetstream: bool, noticed: bool):
    """At once: the close begins before the client has read the lost connection (it is still "connected"); the drain
    ends ``CLOSE_LOST_GRACE_S`` after the loss. After the client noticed (reconnecting): the grace counts from the
    loss, so the close takes next to nothing (as nats-py's drain, which refuses a reconnecting client, did)."""
    srv = EmbeddedNatsServer(jetstream=jetstream).start()
    try:
        errors = _collect_loop_errors()
        bus = await Bus.connect(srv.url, Subjects("p0"), service="kvdirectory", instance="kvdirectory")

        async def on_msg(_msg: object) -> None:
            pass

        await bus.nc.subscribe("test.close.gone.a", cb=on_msg)  # subscriptions: the drain sends a PING for each
        await bus.nc.subscribe("test.close.gone.b", cb=on_msg)
        await bus.flush()
        os.kill(srv.pid, signal.SIGKILL)  # gone for good; the client has not noticed yet (still "connected")
        for _ in range(100 if noticed else 0):
            if bus.nc.is_reconnecting:
                break
            await asyncio.sleep(0.02)
        assert bus.nc.is_reconnecting == noticed
        t0 = time.monotonic()
        await bus.close()
        took = time.monotonic() - t0
        assert bus.nc.is_closed
        assert took < 1.0, f"Bus.close took {took:.2f} s after the server was killed (CLOSE_DRAIN_S is {CLOSE_DRAIN_S})"
        gc.collect()  # an unretrieved future's exception is reported when the future is collected
        await asyncio.sleep(0.05)
        unretrieved = [c.get("message", "") for c in errors if "never retrieved" in str(c.get("message", ""))]
        assert not unretrieved, unretrieved
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(srv.pid, signal.SIGKILL)
        srv.stop()


@pytest.mark.timeout(60)
async def test_a_handler_running_when_the_server_dies_for_good_finishes_then_the_close_ends():
    """The drain still lets an in-flight handler finish with the server gone (it runs locally), and ends as soon as
    it has, not at ``CLOSE_DRAIN_S``."""
    srv = EmbeddedNatsServer(jetstream=False).start()
    try:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="kvdirectory", instance="kvdirectory")
        done: list[float] = []
        started = asyncio.Event()

        async def on_msg(_msg: object) -> None:
            started.set()
            await asyncio.sleep(1.0)  # still running when the server dies
            done.append(time.monotonic())
            with contextlib.suppress(Exception):
                await bus.nc.publish("test.close.gone.out", b"x")  # into the reconnect buffer; dropped at close

        await bus.nc.subscribe("test.close.gone.in", cb=on_msg)
        await bus.nc.publish("test.close.gone.in", b"1")
        await asyncio.wait_for(started.wait(), 5.0)
        t0 = time.monotonic()
        os.kill(srv.pid, signal.SIGKILL)
        await bus.close()
        took = time.monotonic() - t0
        assert done, "the handler was cancelled by the close"
        assert bus.nc.is_closed
        assert took < 2.0, f"Bus.close took {took:.2f} s: the handler ended at {done[0] - t0:.2f} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(srv.pid, signal.SIGKILL)
        srv.stop()
