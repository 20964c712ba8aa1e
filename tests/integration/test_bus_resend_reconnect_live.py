"""The resend window of a bus on JetStream reaches the stream, in publish order, across the reconnects that are cut.

The bus connects through a loopback TCP proxy the test controls (to a real nats-server that keeps its store): the
proxy stops forwarding what the bus writes (``Link.forward_up`` false: two reliable messages die in the socket, as in
a server killed under the bus), then cuts the connection and refuses the reconnects longer than ``RESEND_WINDOW_S``
(made 0.5 s here), so nothing published later than the window's messages remains in the bus's recent publishes.

- A reconnect cut during nats-py's own flush, before the reconnected callback ran (no stream check took the window):
  the second disconnect replaced the window with the recent publishes (by then none). Now it merges them.
- A reconnect's stream check outlived by a later disconnect (its lookup answered as the connection dropped again):
  it put its window in the publishes kept since the disconnect, which the next check, finding the same stream,
  dropped (they were sent, it assumed). Now it leaves the window to the next check.
"""

from __future__ import annotations

import asyncio
import contextlib
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

WINDOW = ["w1-a", "w1-b"]
"""Reliable publishes that die in the socket before the first disconnect: only the resend window brings them."""


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


async def _outage(
    monkeypatch: pytest.MonkeyPatch,
    *,
    during: list[str],
    patch: Callable[[Bus], None] = lambda _bus: None,
    flap: Callable[[Bus, NatsProxy], Any],
) -> tuple[list[str], Bus]:
    """Publish ``stored0`` (stored), then :data:`WINDOW` into a dead socket, cut the connection, publish ``during``
    while it is down (reconnects refused 1 s: longer than the window), run ``flap(bus, proxy)`` (it lets the reconnect
    through and cuts it as the test needs), wait until the bus is connected with its stream check over; returns
    the stream's branch ids in stream order and the bus (its counters)."""
    monkeypatch.setattr(bus_module, "RESEND_WINDOW_S", 0.5)
    srv = EmbeddedNatsServer(jetstream=True).start()
    proxy = NatsProxy(srv.port)  # type: ignore[arg-type]
    subjects = Subjects("p0")
    bus: Bus | None = None
    try:
        bus = await Bus.connect(await proxy.start(), subjects, service="router", instance="router")
        patch(bus)
        assert await bus.ensure_stream()
        await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="stored0"))
        await bus.flush()
        first = proxy.links[-1]
        first.forward_up = False  # what the bus writes now dies in the socket (a server killed under it)
        for b in WINDOW:
            await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=b))
        await until(lambda: first.sent.count(b"w1-b") == 1, what="the window's publishes to be written")
        proxy.refusing = True
        first.cut()
        await until(lambda: bus.counters["nats.disconnects"] == 1, what="the first disconnect")
        for b in during:
            await bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=b))
        await asyncio.sleep(1.0)  # an outage longer than RESEND_WINDOW_S: the window is no longer recent
        await flap(bus, proxy)
        await until(lambda: bus.nc.is_connected and not bus.stream_waiting and not bus._holding, timeout=15.0,
                    what="the bus to reconnect and its stream check to end")  # fmt: skip
        await bus.flush()
        await asyncio.sleep(0.2)  # the stream stores what the flush's PONG followed
        return await _stored(srv.url, subjects), bus
    finally:
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        await proxy.close()
        srv.stop()


async def _plain_reconnect(_bus: Bus, proxy: NatsProxy) -> None:
    proxy.refusing = False


@pytest.mark.timeout(60)
async def test_a_reconnect_cut_before_its_callback_keeps_the_first_outage_window(monkeypatch):
    async def flap(bus: Bus, proxy: NatsProxy) -> None:
        proxy.next_hold_after_pongs = 1  # the reconnect's CONNECT is answered, the PONG of nats-py's flush is held
        proxy.refusing = False
        await until(lambda: len(proxy.links) == 2 and proxy.links[1].sent.count(b"PING\r\n") >= 2,
                    what="the reconnect's flush PING")  # fmt: skip
        assert bus.counters["nats.reconnects"] == 0  # reconnected_cb has not run: no check took the window
        proxy.links[1].cut()
        await until(lambda: bus.counters["nats.disconnects"] == 2, what="the second disconnect")

    ids, bus = await _outage(monkeypatch, during=[], flap=flap)
    assert bus.counters["nats.disconnects"] == 2
    assert ids == ["stored0", *WINDOW], f"the first outage's window was lost with the cut reconnect: stored {ids}"


@pytest.mark.timeout(60)
async def test_a_check_outlived_by_a_disconnect_leaves_its_window_to_the_next_check(monkeypatch):
    in_lookup = asyncio.Event()
    calls: list[int] = []

    def patch(bus: Bus) -> None:
        real = bus._stream_after_reconnect

        async def lookup_answered_as_it_drops(go_on: Callable[[], bool]) -> Any:
            info = await real(go_on)
            calls.append(1)
            if len(calls) == 1:  # the first reconnect's check: its answer comes as the connection drops again
                in_lookup.set()
                await until(lambda: bus.counters["nats.disconnects"] == 2, what="the second disconnect (in the lookup)")
            return info

        bus._stream_after_reconnect = lookup_answered_as_it_drops  # type: ignore[method-assign]

    async def flap(bus: Bus, proxy: NatsProxy) -> None:
        proxy.refusing = False
        await asyncio.wait_for(in_lookup.wait(), 10.0)
        proxy.refusing = True
        proxy.links[-1].cut()
        await until(lambda: bus.counters["nats.disconnects"] == 2, what="the second disconnect")
        await asyncio.sleep(0.2)  # the first check ends, outlived; reconnects refused meanwhile
        proxy.refusing = False
        await until(lambda: bus.counters["nats.reconnects"] == 2, what="the second reconnect")

    ids, bus = await _outage(monkeypatch, during=[], patch=patch, flap=flap)
    assert len(calls) == 2, f"stream checks: {len(calls)}"
    assert ids == ["stored0", *WINDOW], f"the window of a check a disconnect outlived was dropped: stored {ids}"


@pytest.mark.timeout(60)
async def test_a_plain_reconnect_publishes_the_window_again(monkeypatch):
    """Control of the two above: one outage, nothing cut, nothing published during it."""
    ids, bus = await _outage(monkeypatch, during=[], flap=_plain_reconnect)
    assert bus.counters["resent"] >= len(WINDOW)
    assert ids == ["stored0", *WINDOW]
