"""Reliable publishes that died unstored in a killed nats-server reach the stream when ``Bus.close`` cancels the
post-reconnect stream check (``Bus._after_reconnect``) while its stream lookup is still running.

The server is stopped (SIGSTOP), five reliable messages are published (nats-py writes them into its socket: they are
never stored), then it is killed (SIGKILL) and restarted with its store. The bus reconnects and its check takes the
resend window, then looks the stream up; the lookup is made slow here (the bus's ``_stream_after_reconnect`` sleeps
first), so ``close()`` cancels the check before it published the window again. Before, the check took the window off
the bus (``_resend`` cleared) before its lookup and the cancel dropped it: 1 of 6 messages stored (``pre``). Now the
cancelled check puts the window back and the close publishes it (message ids drop any copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any, Callable

import msgspec
import nats
import pytest

from shared import messages as m
from shared.bus import CLOSE_DRAIN_S, Bus, stream_name
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import BRANCH_EVENTS, Subjects

EXPECTED = ["pre", "lost0", "lost1", "lost2", "lost3", "lost4"]
LOOKUP_DELAY_S = 30.0
"""How long the patched stream lookup sleeps first: far longer than the test waits, so only the close's cancel ends it."""


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
async def test_a_close_that_cancels_the_reconnect_check_still_publishes_the_resend_window():
    srv = EmbeddedNatsServer(jetstream=True).start()
    subjects = Subjects("p0")
    try:
        bus = await Bus.connect(srv.url, subjects, service="router", instance="router")
        await bus.ensure_stream()
        await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="pre"))
        await bus.flush()

        looking_up = asyncio.Event()
        lookup = bus._stream_after_reconnect
        cancelled: list[bool] = []

        async def slow_lookup(go_on: Callable[[], bool]) -> Any:  # the check's stream lookup, slow
            looking_up.set()
            try:
                await asyncio.sleep(LOOKUP_DELAY_S)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
            return await lookup(go_on)

        bus._stream_after_reconnect = slow_lookup  # type: ignore[method-assign]
        assert srv.pid is not None
        os.kill(srv.pid, signal.SIGSTOP)
        for i in range(5):
            await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=f"lost{i}"))
        for _ in range(500):  # nats-py's flusher writes them into the stopped server's socket: never stored
            if bus.nc.pending_data_size == 0:
                break
            await asyncio.sleep(0.01)
        # still in nats-py's buffer, they would go out on the reconnect by themselves (no resend needed)
        assert bus.nc.pending_data_size == 0, "the publishes were not written to the stopped server: nothing tested"
        await asyncio.sleep(0.1)
        os.kill(srv.pid, signal.SIGKILL)
        for _ in range(200):
            if not bus.nc.is_connected:
                break
            await asyncio.sleep(0.01)
        assert not bus.nc.is_connected, "the bus did not see the server die: nothing tested"
        await asyncio.to_thread(srv.restart)
        await asyncio.wait_for(looking_up.wait(), 20.0)  # reconnected; the check took the window and looks the stream up
        assert bus.counters["nats.reconnects"] == 1
        t0 = time.monotonic()
        await bus.close()
        took = time.monotonic() - t0
        assert cancelled, "the close did not cancel the check during its lookup: nothing tested"
        assert bus.nc.is_closed
        assert took < CLOSE_DRAIN_S, f"Bus.close took {took:.2f} s (CLOSE_DRAIN_S {CLOSE_DRAIN_S})"
        ids = await _stored(srv.url, subjects)
        assert sorted(ids) == sorted(EXPECTED), (  # once each: the message ids drop a copy the stream has
            f"stored {ids}; the resend window taken by the cancelled reconnect check was not published again "
            f"(resent {bus.counters['resent']})"
        )
    finally:
        if srv.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(srv.pid, signal.SIGCONT)
        srv.stop()
