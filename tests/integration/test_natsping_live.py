"""``shared.natsping.Ping`` (``Bus.ping``) on a real nats-server, through a loopback proxy that holds the server's bytes
(a server that hangs a few seconds) or cuts the connection (a reconnect): a PING given up on is never cancelled while
nats-py holds its PONG future (a cancelled one that nats-py answers later ends its read loop: connected, deaf), one a
reconnect made nats-py forget is cancelled, and a client whose read loop ended gets no PING at all.

The fallback for a nats-py without the internals read (``_pongs``, ``_reading_task``) is played by pointing
``natsping.PONGS_ATTR`` / ``READING_ATTR`` at names nats-py does not have: one warning naming the version at the
connect, nothing ever cancelled, a PING lost to a reconnect (by ``Bus.reconnected_at``) left to the close.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog

from shared import messages as m
from shared import natsping
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import SVC_HEARTBEAT, Subjects
from tests.integration.nats_proxy import NatsProxy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fallback(monkeypatch) -> None:
    """This nats-py seen as one without the internals natsping reads (the real ones still work underneath)."""
    monkeypatch.setattr(natsping, "PONGS_ATTR", "_pongs_not_in_this_nats_py")
    monkeypatch.setattr(natsping, "READING_ATTR", "_reading_task_not_in_this_nats_py")
    monkeypatch.setattr(natsping, "_warned", False)


async def _until(cond, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {limit_s} s: {what}"
        await asyncio.sleep(0.05)


async def _still_reads(bus: Bus, srv_url: str) -> None:
    """The bus's client reads: a heartbeat published by another client reaches it, and a PING is answered."""
    got: list[m.Heartbeat] = []

    async def on_beat(hb: m.Heartbeat, _subject: str) -> None:
        got.append(hb)

    await bus.subscribe(SVC_HEARTBEAT, on_beat)
    await bus.flush(5)
    other = await Bus.connect(srv_url, Subjects("p0"), service="router", instance="other")
    try:
        await other.publish(SVC_HEARTBEAT, m.Heartbeat(service="router", instance="other", pid=1), service="router")
        await _until(lambda: bool(got), 5, "a heartbeat heard")
    finally:
        await other.close()
    assert nc_reading(bus) and await bus.ping().wait(5) is True


def nc_reading(bus: Bus) -> bool:
    reading = bus.nc._reading_task  # the real attribute (in the fallback too)
    return reading is not None and not reading.done()


async def test_a_ping_given_up_on_is_not_cancelled_and_its_late_pong_leaves_the_client_reading():
    with EmbeddedNatsServer() as srv:
        proxy = NatsProxy(int(srv.url.rsplit(":", 1)[1]))
        bus = await Bus.connect(await proxy.start(), Subjects("p0"), service="router", instance="r")
        try:
            assert natsping.privates_ok(bus.nc)
            proxy.links[0].flowing.clear()  # the server's PONG waits in the proxy
            ping = bus.ping()
            assert await ping.wait(0.5) is None and not ping.lost()
            ping.drop()
            assert not ping.future.done() and ping in bus._pings, "a PING nats-py holds was cancelled"
            proxy.links[0].flowing.set()  # the late PONG
            await _until(lambda: ping.future.done(), 5, "the late PONG")
            assert ping.answered and ping not in bus._pings
            await _still_reads(bus, srv.url)
        finally:
            await bus.close()
            await proxy.close()


async def test_a_ping_a_reconnect_made_nats_py_forget_is_cancelled_and_a_fresh_one_answered():
    with EmbeddedNatsServer() as srv:
        proxy = NatsProxy(int(srv.url.rsplit(":", 1)[1]))
        bus = await Bus.connect(await proxy.start(), Subjects("p0"), service="router", instance="r")
        try:
            proxy.links[0].flowing.clear()
            waited, left = bus.ping(), bus.ping()
            assert await waited.wait(0.3) is None
            left.drop()  # given up on, held: kept in the bus
            assert left in bus._pings and not left.future.done()
            proxy.links[0].cut()  # the client reconnects through the proxy: nats-py forgets both PINGs
            await _until(lambda: bus.counters["nats.reconnects"] >= 1 and bus.nc.is_connected, 20, "the reconnect")
            assert waited.forgotten() and waited.lost()
            assert await waited.wait(0.1) is False  # lost: cancelled (a cancel the task takes at its next step)
            fresh = bus.ping()  # and the one left in the bus is cancelled now (forgotten), not at the close
            await asyncio.wait({waited.future, left.future}, timeout=1)
            assert waited.future.cancelled() and left.future.cancelled()
            assert await fresh.wait(5) is True and left not in bus._pings
            await _still_reads(bus, srv.url)
        finally:
            await bus.close()
            await proxy.close()


async def test_a_client_whose_read_loop_ended_gets_no_ping_and_no_false_answer():
    """nats-py's ``flush`` on such a client sends no PING and returns at once: a probe built on it saw a healthy bus."""
    with EmbeddedNatsServer() as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="router", instance="r")
        try:
            reading = bus.nc._reading_task
            reading.cancel()  # its read loop ends (as an InvalidStateError ends it); the client stays connected
            await asyncio.wait({reading}, timeout=5)
            assert bus.nc.is_connected and natsping.deaf(bus.nc)
            await asyncio.wait_for(bus.nc.flush(timeout=1), 1)  # nats-py's own: "answered" at once (what it was)
            ping = bus.ping()
            assert await ping.wait(1) is False and isinstance(ping.future.exception(), natsping.DeafClient)
        finally:
            await bus.close()


async def test_without_the_internals_one_warning_names_the_version_and_nothing_is_ever_cancelled(fallback):
    with EmbeddedNatsServer() as srv:
        proxy = NatsProxy(int(srv.url.rsplit(":", 1)[1]))
        url = await proxy.start()
        with structlog.testing.capture_logs() as logs:
            bus = await Bus.connect(url, Subjects("p0"), service="router", instance="r")
            again = await Bus.connect(srv.url, Subjects("p0"), service="router", instance="r2")
        await again.close()
        warned = [e for e in logs if "nats-py lacks" in e["event"]]
        assert len(warned) == 1 and warned[0]["nats_py"] == natsping.nats_py_version() != "unknown", logs
        assert warned[0]["log_level"] == "warning"
        try:
            assert not natsping.privates_ok(bus.nc)
            # a late PONG: waited for, given up on, never cancelled; the client reads on
            proxy.links[0].flowing.clear()
            late = bus.ping()
            assert await late.wait(0.5) is None and not late.lost()
            late.drop()
            assert not late.future.done()
            proxy.links[0].flowing.set()
            await _until(lambda: late.future.done(), 5, "the late PONG")
            assert late.answered
            # a reconnect: the PING is lost by the bus's reconnected_at, left to its PONG (which never comes) until
            # the close; a fresh one is answered
            proxy.links[-1].flowing.clear()
            lost = bus.ping()
            assert await lost.wait(0.3) is None
            proxy.links[-1].cut()
            await _until(lambda: bus.counters["nats.reconnects"] >= 1 and bus.nc.is_connected, 20, "the reconnect")
            assert lost.lost() and not lost.forgotten()
            assert await lost.wait(0.1) is False and not lost.future.done(), "a PING was cancelled without the internals"
            assert await bus.ping().wait(5) is True
            assert not lost.future.done() and lost in bus._pings
            await _still_reads(bus, srv.url)
        finally:
            await bus.close()
            await proxy.close()
        await asyncio.wait({lost.future}, timeout=1)
        assert lost.future.cancelled(), "the close cancels what is left (the client reads no more)"
