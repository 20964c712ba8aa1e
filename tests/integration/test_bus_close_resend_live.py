"""Reliable publishes that died unstored in a nats-server killed around a ``Bus.close`` reach the stream when the server
comes back during the close's drain (a handler still running).

The server is stopped (SIGSTOP), five reliable messages are published (nats-py writes them into its socket: they are
never stored), then it is killed (SIGKILL) and restarted with its store while the close drains. The bus's resend window
(the reliable publishes of the last ``RESEND_WINDOW_S`` before the disconnect) must be published again on the
reconnect, as outside a close; message ids drop any copy. Two orders:

* killed before the close began: since 7591e94 the reconnect during the close returned early and resent nothing
  (a read-only review's s1.py: 2 of 7 messages stored, ``pre`` and the handler's; 7 before that commit);
* killed after the close began: the disconnect during the close did not take the window at all (s2.py: 2 stored).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import msgspec
import nats
import pytest

from shared import messages as m
from shared.bus import CLOSE_DRAIN_S, Bus, stream_name
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import BRANCH_EVENTS, Subjects

EXPECTED = ["pre", "lost0", "lost1", "lost2", "lost3", "lost4", "from-handler"]


async def _stored(url: str, subjects: Subjects) -> list[str]:
    """The branch ids of the BranchEnd messages in the partition's stream, in stream order."""
    obs = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=2)
    try:
        js = obs.jetstream(timeout=5)
        name = stream_name(subjects)
        info = await js.stream_info(name)
        ids: list[str] = []
        for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
            raw = await js.get_msg(name, seq)
            ids.append(msgspec.msgpack.decode(raw.data, type=m.BranchEnd).branch_id)
        return ids
    finally:
        await obs.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("killed", ["before_close", "during_close"])
async def test_reliable_publishes_lost_in_a_killed_server_are_resent_when_it_returns_during_the_close(killed: str):
    srv = EmbeddedNatsServer(jetstream=True).start()
    subjects = Subjects("p0")
    try:
        bus = await Bus.connect(srv.url, subjects, service="router", instance="router")
        await bus.ensure_stream()
        await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="pre"))
        await bus.flush()
        started = asyncio.Event()
        done: list[float] = []

        async def busy(_msg: object) -> None:  # still running when the server comes back
            started.set()
            await asyncio.sleep(1.0)
            await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="from-handler"))
            done.append(time.monotonic())

        await bus.nc.subscribe("test.close.resend.busy", cb=busy)
        await bus.flush()
        await bus.nc.publish("test.close.resend.busy", b"")
        await asyncio.wait_for(started.wait(), 5.0)
        assert srv.pid is not None
        os.kill(srv.pid, signal.SIGSTOP)
        for i in range(5):
            await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=f"lost{i}"))
        await asyncio.sleep(0.1)  # nats-py's flusher writes them into the stopped server's socket: never stored
        closing: asyncio.Future[None] | None = None
        t0 = time.monotonic()
        if killed == "during_close":
            closing = asyncio.ensure_future(bus.close())
            await asyncio.sleep(0.05)
        os.kill(srv.pid, signal.SIGKILL)
        for _ in range(200):
            if not bus.nc.is_connected:
                break
            await asyncio.sleep(0.01)

        async def restart() -> None:
            await asyncio.sleep(0.2)
            await asyncio.to_thread(srv.restart)

        restarting = asyncio.ensure_future(restart())
        if closing is None:
            closing = asyncio.ensure_future(bus.close())
        await closing
        took = time.monotonic() - t0
        await restarting
        assert bus.counters["nats.reconnects"] == 1, "the bus did not reconnect during the close: nothing tested"
        assert done, "the handler was cancelled by the close"
        assert bus.nc.is_closed
        assert took < CLOSE_DRAIN_S, f"Bus.close took {took:.2f} s (CLOSE_DRAIN_S {CLOSE_DRAIN_S})"
        ids = await _stored(srv.url, subjects)
        assert sorted(ids) == sorted(EXPECTED), (  # once each: the message ids drop a copy the stream has
            f"stored {ids}; the reliable publishes the killed server never stored were not published again "
            f"(resent {bus.counters['resent']})"
        )
    finally:
        if srv.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(srv.pid, signal.SIGCONT)
        srv.stop()
