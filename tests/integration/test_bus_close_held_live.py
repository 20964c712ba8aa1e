"""Reliable publishes a bus keeps from a disconnect until its reconnect's stream check ends (``Bus._held``) reach the
stream when ``Bus.close`` cancels that check.

The bus is on JetStream with the partition's stream. nats-server is killed and restarted without its store (a new
container without a volume): three reliable messages published while it is down wait in nats-py's buffer and are
kept (``_held``); the reconnect flushes them into a server without the stream, where they go nowhere. The launcher
then makes the stream again (here an observer, with the bus's own config) while the bus's check still looks it up (the
lookup is made slow: ``_stream_after_reconnect`` sleeps first), and the service stops: ``close()`` cancels the check.
Before, the close published only the resend window again (``pre``) and the kept publishes were dropped with the check;
now it publishes them too, in publish order (message ids drop any copy the stream has).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

import msgspec
import nats
import pytest

import shared.bus as bus_module
from shared import messages as m
from shared.bus import Bus, stream_name
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import BRANCH_EVENTS, Subjects
from tests.integration.nats_proxy import NatsProxy
from tests.integration.polling import until

HELD = ["down0", "down1", "down2"]
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
        if not info.state.messages:  # an empty stream reports first_seq 0
            return ids
        for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
            raw = await js.get_msg(name, seq)
            ids.append(msgspec.msgpack.decode(raw.data, type=m.BranchEnd).branch_id)
        return ids
    finally:
        await obs.close()


@pytest.mark.timeout(90)
async def test_a_close_that_cancels_the_reconnect_check_publishes_what_the_bus_kept_since_the_disconnect():
    srv = EmbeddedNatsServer(jetstream=True).start()
    subjects = Subjects("p0")
    bus = None
    try:
        bus = await Bus.connect(srv.url, subjects, service="router", instance="router")
        await bus.ensure_stream()
        assert bus.jetstream
        await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="pre"))
        await bus.flush()

        looking_up = asyncio.Event()
        cancelled: list[bool] = []

        async def slow_lookup(_go_on: Callable[[], bool]) -> Any:  # the check's stream lookup, slow
            looking_up.set()
            try:
                await asyncio.sleep(LOOKUP_DELAY_S)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
            return None

        bus._stream_after_reconnect = slow_lookup  # type: ignore[method-assign]
        assert srv.pid is not None and srv._tmp is not None
        os.kill(srv.pid, signal.SIGKILL)
        # its disconnected callback ran (nats-py reports the connection down before it calls it): publishes are kept
        await until(lambda: bus.counters["nats.disconnects"] == 1, what="the bus to see the server die")
        for branch in HELD:  # in nats-py's reconnect buffer, and kept by the bus
            await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=branch))
        assert len(bus._held) == len(HELD), f"the bus kept {len(bus._held)} of the publishes made while disconnected"
        srv.proc.wait()  # type: ignore[union-attr]
        shutil.rmtree(Path(srv._tmp) / "js")  # the server comes back without its store: the stream is gone
        await asyncio.to_thread(srv.restart)
        await asyncio.wait_for(looking_up.wait(), 20.0)  # reconnected: nats-py flushed its buffer into no stream
        # the launcher makes the stream again (as `evolving-infra auth stream` would), the bus's check still looking
        maker = await nats.connect(srv.url, connect_timeout=5, max_reconnect_attempts=2)
        try:
            for _ in range(100):  # JetStream of a server just restarted may not answer yet ("no responders")
                try:
                    await maker.jetstream(timeout=5).add_stream(bus._stream_config())
                    break
                except nats.errors.NoRespondersError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("JetStream of the restarted server never answered")
        finally:
            await maker.close()
        assert await _stored(srv.url, subjects) == [], "the buffered publishes reached the new stream: nothing tested"
        await bus.close()
        assert cancelled, "the close did not cancel the check during its lookup: nothing tested"
        assert bus.nc.is_closed
        ids = await _stored(srv.url, subjects)
        assert ids == ["pre", *HELD], (
            f"stored {ids}; the publishes kept since the disconnect were dropped with the cancelled check "
            f"(resent {bus.counters['resent']})"
        )
    finally:
        if bus is not None and not bus.nc.is_closed:
            with contextlib.suppress(Exception):
                await bus.nc.close()
        srv.stop()


@pytest.mark.timeout(90)
async def test_a_reconnect_during_the_close_publishes_what_the_bus_only_kept(monkeypatch):
    """The reconnect comes during the close (``reconnected_cb``'s close path): what the bus only kept while the
    stream was lost (:attr:`Bus._stream_lost`: never sent) goes out with the resend window.

    The stream is lost (deleted) and its create refused meanwhile (another stream takes one of its subjects), so the
    reconnect's check waits for another to make it and three reliable publishes are only kept. The connection is then
    cut (a loopback proxy the test controls, refusing the reconnects), the service stops while it is down (a handler
    busy keeps the close's drain going), the launcher makes the stream, and the bus reconnects during the close.
    Before, that path published only the resend window again (cut to 0.2 s here, so the kept ones are older than it):
    the kept publishes were dropped with the cancelled check though the stream was back."""
    monkeypatch.setattr(bus_module, "RESEND_WINDOW_S", 0.2)
    srv = EmbeddedNatsServer(jetstream=True).start()
    proxy = NatsProxy(srv.port)  # type: ignore[arg-type]
    subjects = Subjects("p0")
    bus = obs = None
    try:
        bus = await Bus.connect(await proxy.start(), subjects, service="router", instance="router")
        await bus.ensure_stream()
        assert bus.jetstream
        obs = await nats.connect(srv.url, connect_timeout=5, max_reconnect_attempts=2)
        js = obs.jetstream(timeout=5)
        await js.delete_stream(stream_name(subjects))  # the stream is lost ...
        await js.add_stream(name="BLOCK", subjects=[subjects.wildcard(BRANCH_EVENTS)])  # ... and cannot be made again
        proxy.links[-1].cut()  # a reconnect: its check finds the stream lost and waits for it, keeping publishes
        await until(lambda: bus._stream_lost, what="the reconnect's check to find the stream lost")
        for branch in HELD:  # only kept: sent once the stream is back
            await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=branch))
        assert len(bus._held) == len(HELD) and bus._held_unsent
        await asyncio.sleep(0.3)  # older than the resend window the next disconnect takes

        finish = asyncio.Event()
        busy = asyncio.Event()

        async def slow(_msg: nats.aio.msg.Msg) -> None:  # keeps the close's drain going until the bus is back
            busy.set()
            await asyncio.wait_for(finish.wait(), 20.0)

        await bus.nc.subscribe("test.held.busy", cb=slow)
        await bus.flush()
        await obs.publish("test.held.busy", b"1")
        await asyncio.wait_for(busy.wait(), 10.0)
        proxy.refusing = True
        proxy.links[-1].cut()
        await until(lambda: bus.counters["nats.disconnects"] == 2, what="the bus to see its connection cut")
        closing = asyncio.ensure_future(bus.close())
        await until(lambda: bus._closing and not bus._tasks, what="the close to cancel the reconnect's check")
        await js.delete_stream("BLOCK")  # the launcher makes the stream again
        await js.add_stream(bus._stream_config())
        proxy.refusing = False
        await until(lambda: bus.counters["nats.reconnects"] == 2, what="the bus to reconnect during the close")
        finish.set()
        await asyncio.wait_for(closing, 15.0)
        assert bus.nc.is_closed
        ids = await _stored(srv.url, subjects)
        assert ids == HELD, (
            f"stored {ids}; the publishes only kept while the stream was lost were dropped at the close "
            f"(resent {bus.counters['resent']})"
        )
    finally:
        for nc in ([bus.nc] if bus is not None else []) + ([obs] if obs is not None else []):
            if not nc.is_closed:
                with contextlib.suppress(Exception):
                    await nc.close()
        await proxy.close()
        srv.stop()
