"""``Bus.close`` is bounded when the server stops answering: at most ``CLOSE_DRAIN_S`` for the drain, not 15 s.

nats-py 2.16's ``Client.drain`` swallows the cancel that ``asyncio.wait_for`` sends at its timeout, then flushes
with its own 10-s timeout, and ``wait_for`` waits for the cancelled drain to end. A server that stopped answering
during the close (frozen here by SIGSTOP; in the field a nats-server dying under a loaded box while every service
of a killed ``FaultCluster`` owner stops at once, test_no_orphan_nats_live) held each service's close 15 s: a
fresh clone's ``make test`` saw one outlive its killed owner by more than 15 s. Measured before the fix: 15.3 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from shared.bus import CLOSE_DRAIN_S, Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects


@pytest.mark.timeout(60)
async def test_close_with_a_server_that_stopped_answering_takes_the_drain_bound_not_15_s():
    srv = EmbeddedNatsServer().start()
    try:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="kvdirectory", instance="kvdirectory")

        async def on_msg(_msg: object) -> None:
            pass

        await bus.nc.subscribe("test.close.stalled", cb=on_msg)  # a subscription: the drain waits on its flush
        os.kill(srv.pid, signal.SIGSTOP)  # alive, connected, silent: no PONG ever comes
        t0 = time.monotonic()
        await bus.close()
        took = time.monotonic() - t0
        assert bus.nc.is_closed
        # CLOSE_DRAIN_S, the cancel (0.05 s) and the close; room for a loaded box, far under the 15 s it took before
        assert took < CLOSE_DRAIN_S + 4.0, f"Bus.close took {took:.1f} s with a silent server"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(srv.pid, signal.SIGKILL)
            os.kill(srv.pid, signal.SIGCONT)
        srv.stop()


@pytest.mark.timeout(60)
async def test_close_with_a_server_that_dies_during_the_drain_ends_without_waiting_out_the_drain_bound():
    """All of a killed owner's services and its nats-server get SIGTERM at once: the server dies while a service's
    drain waits for its PONG. nats-py drops that wait on reconnect without an answer, so the close waited out
    ``CLOSE_DRAIN_S`` (5.0 s measured before) though nothing could be delivered any more."""
    srv = EmbeddedNatsServer().start()
    try:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="kvdirectory", instance="kvdirectory")

        async def on_msg(_msg: object) -> None:
            pass

        await bus.nc.subscribe("test.close.dies", cb=on_msg)
        os.kill(srv.pid, signal.SIGSTOP)  # the drain's PING stays unanswered ...
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, os.kill, srv.pid, signal.SIGKILL)  # ... then the server dies under it
        t0 = time.monotonic()
        await bus.close()
        took = time.monotonic() - t0
        assert bus.nc.is_closed
        assert took < CLOSE_DRAIN_S - 2.0, f"Bus.close took {took:.1f} s though the connection was lost at 0.3 s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(srv.pid, signal.SIGKILL)
            os.kill(srv.pid, signal.SIGCONT)
        srv.stop()
