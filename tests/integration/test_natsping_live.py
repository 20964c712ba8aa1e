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


async def test_a_client_whose_flusher_ended_gets_no_ping_and_no_false_answer():
    """nats-py's ``flush`` sends no PING and returns at once when its flusher task has ended too (its own test reads
    both tasks): before, only the read loop was looked at, and such a PING "was answered" at once."""
    with EmbeddedNatsServer() as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="router", instance="r")
        try:
            flusher = bus.nc._flusher_task
            flusher.cancel()
            await asyncio.wait({flusher}, timeout=5)
            assert bus.nc.is_connected and nc_reading(bus) and natsping.deaf(bus.nc)
            ping = bus.ping()
            assert await ping.wait(1) is False and isinstance(ping.future.exception(), natsping.DeafClient)
            assert "flusher" in str(ping.future.exception())
        finally:
            await bus.close()


async def test_a_ping_while_disconnected_is_no_answer_and_one_after_the_reconnect_is():
    """nats-py's ``flush`` returns at once while the client reconnects (its read loop ended with the connection): before,
    such a PING "was answered"."""
    with EmbeddedNatsServer() as srv:
        proxy = NatsProxy(int(srv.url.rsplit(":", 1)[1]))
        bus = await Bus.connect(await proxy.start(), Subjects("p0"), service="router", instance="r")
        try:
            proxy.refusing = True
            proxy.links[0].cut()
            await _until(lambda: not bus.nc.is_connected, 10, "the disconnect")
            ping = bus.ping()
            assert await ping.wait(1) is False and isinstance(ping.future.exception(), natsping.NotConnected)
            proxy.refusing = False
            await _until(lambda: bus.nc.is_connected, 20, "the reconnect")
            assert await bus.ping().wait(5) is True
        finally:
            await bus.close()
            await proxy.close()


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
            # reconnects: a PING is lost by the bus's reconnected_at, left to its PONG (which never comes) while the
            # caller sends a fresh one; once that one is answered (PONGs come in order: nats-py does not hold the lost
            # one) the lost one is cancelled. Before, each reconnect left one per pinger in the bus until the close
            for n in (1, 2, 3):
                proxy.links[-1].flowing.clear()
                lost = bus.ping()
                assert await lost.wait(0.3) is None
                proxy.links[-1].cut()
                await _until(lambda: bus.counters["nats.reconnects"] >= n and bus.nc.is_connected, 20, "the reconnect")
                assert lost.lost() and not lost.forgotten()
                assert await lost.wait(0.1) is False and not lost.future.done(), "a lost PING cancelled before an answer"
                fresh = bus.ping()
                assert not lost.future.done() and lost in bus._pings
                assert await fresh.wait(5) is True
                await asyncio.wait({lost.future}, timeout=1)
                assert lost.future.cancelled() and lost not in bus._pings, f"reconnect {n}: {len(bus._pings)} kept"
                assert not bus._pings
            await _still_reads(bus, srv.url)
            # one the server never answers is left to the close
            proxy.links[-1].flowing.clear()
            left = bus.ping()
            assert await left.wait(0.3) is None
            left.drop()
            assert not left.future.done() and left in bus._pings
            proxy.refusing = True
            proxy.links[-1].cut()  # and the server stays away: the close's drain ends at once
        finally:
            await bus.close()
            await proxy.close()
        await asyncio.wait({left.future}, timeout=1)
        assert left.future.cancelled(), "the close cancels what is left (the client reads no more)"


async def test_a_ping_made_one_step_before_a_reconnect_is_judged_by_the_list_it_went_into():
    """A PING went out on the connection of its send step, one event-loop step after the ``Ping`` was made; a reconnect's
    new connection (nats-py's ``_process_connect_init``: a new ``_pongs`` list, a new read loop) can come in between.
    Before, the ``Ping`` took the list at construction (the old one): it counted as forgotten while nats-py held its PONG
    future in the new list, a give-up (``drop``, another PING's sweep) cancelled it, and the PONG ended nats-py's read loop
    (``InvalidStateError``): connected, deaf. ``Bus.flush`` called during a reconnect (it made thousands of PINGs while
    disconnected) hit that step in 4 reconnects of 5 (review rr-ping53, race2.py). Here the step is hit every time: the
    PING is made the moment nats-py replaces its list (a subclass's ``__setattr__`` sees the assignment), the real
    reconnect goes on unchanged."""
    with EmbeddedNatsServer() as srv:
        proxy = NatsProxy(int(srv.url.rsplit(":", 1)[1]))
        bus = await Bus.connect(await proxy.start(), Subjects("p0"), service="router", instance="r")
        nc = bus.nc
        real = type(nc)
        made: list[natsping.Ping] = []

        class _MadeAtTheSwap(real):  # type: ignore[misc, valid-type]
            def __setattr__(self, name: str, value: object) -> None:
                if name == natsping.PONGS_ATTR and not made:
                    made.append(bus.ping())  # nats-py still has the old connection's list; the new one is set next
                super().__setattr__(name, value)

        try:
            proxy.next_hold_after_pongs = 1  # the new connection's CONNECT is answered, its PINGs' PONGs wait
            nc.__class__ = _MadeAtTheSwap
            proxy.links[0].cut()
            await _until(lambda: bool(made) and len(proxy.links) == 2 and proxy.links[1].sent.count(b"PING\r\n") >= 2,
                         20, "the PING made at the reconnect's swap sent on the new connection")  # fmt: skip
            nc.__class__ = real
            ping = made[0]
            assert not ping.forgotten(), "a PING that went out on the new connection counted as forgotten"
            assert await ping.wait(0.3) is None
            ping.drop()
            bus.ping().drop()  # another PING's sweep of the bus's kept ones
            await asyncio.sleep(0.1)
            assert not ping.future.done(), "a PING nats-py holds (in its new list) was cancelled"
            link = proxy.links[1]
            link.hold_after_pongs = None
            link.flowing.set()  # the late PONGs
            await _until(lambda: ping.future.done(), 5, "the late PONG")
            assert ping.answered
            await _until(lambda: bus.counters["nats.reconnects"] >= 1, 15, "the reconnected callback")
            assert nc_reading(bus), "the client's read loop ended (deaf)"
            await _still_reads(bus, srv.url)
        finally:
            nc.__class__ = real
            await bus.close()
            await proxy.close()
