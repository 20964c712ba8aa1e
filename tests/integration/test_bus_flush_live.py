"""``Bus.flush`` returns only once the server has every command the bus queued before it (real nats-server).

nats-py 2.16's ``Client.flush`` writes its PING straight to the socket, ahead of the SUBs still queued
for its flusher task (``subscribe`` only queues its SUB), so its PONG can come back before the server
has registered them. The credentials test of ``test_bus_every_subject_live`` lost messages that way in
7 runs of 40 under CPU load: 5 times the planner got none of its 16 (its subscriptions are all core, so
no JetStream round trip flushes them on the way; the server trace had its flush PING 13 ms before its
SUBs, another connection's publishes in between), twice the directory missed exactly the 5 core
subscriptions it made after its last JetStream consumer. A relay between the client and the
server records the bytes the client sends: what the bus subscribed before ``flush`` must precede the
PING that ``flush`` waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from shared.bus import Bus, BusUnavailable
from shared.subjects import ALL, Subjects


class _Relay:
    """A TCP relay on a loopback port to ``127.0.0.1:<port>``; ``sent`` holds what clients wrote, in order."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sent = bytearray()
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> "_Relay":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, record: bool) -> None:
            while data := await r.read(65536):
                if record:
                    self.sent += data
                w.write(data)
                await w.drain()
            w.close()

        for t in (pipe(cr, sw, True), pipe(sr, cw, False)):
            task = asyncio.create_task(t)
            self._tasks.add(task)


@pytest.mark.timeout(30)
async def test_flush_returns_after_the_server_got_every_subscription_queued_before_it(nats_server):
    async with _Relay(nats_server.port) as relay:
        bus = await Bus.connect(relay.url, Subjects("p0"), service="test", instance="sub")
        got: list[Any] = []

        async def on(msg: Any, _subject: str) -> None:
            got.append(msg)

        try:
            core = [s for s in ALL if not s.reliable and s.reply_type is None]
            for s in core:  # core subscriptions, as the planner makes them: nothing on the way flushes them
                await bus.subscribe(s, on)
            await bus.flush()
            wire = bytes(relay.sent)
            answered = wire.rfind(b"PING\r\n")  # the last PING the relay passed on: the one flush got a PONG for
            assert wire.count(b"\r\nSUB ", 0, answered) == len(core), wire.decode(errors="replace")
        finally:
            await bus.close()


async def test_flush_of_a_closed_bus_or_a_bad_timeout_is_a_clear_error(nats_url):
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="closed")
    with pytest.raises(ValueError, match="positive"):
        await bus.flush(0)
    await bus.flush()
    await bus.close()
    with pytest.raises(BusUnavailable, match="no answer from NATS"):
        await bus.flush()


@pytest.mark.timeout(30)
async def test_a_flush_that_timed_out_leaves_the_bus_able_to_receive(nats_server):
    """nats-server hangs (SIGSTOP) during a flush: BusUnavailable at its timeout; once the server goes on
    the bus still receives. Before, nats-py's ``flush`` cancelled the PONG's future at its timeout and the
    PONG that came later ended the client's read loop (``InvalidStateError`` in ``_process_pong``): the bus
    stayed connected and received nothing for good."""
    import os
    import signal

    from shared import messages as m
    from shared.subjects import SVC_HEARTBEAT

    bus = await Bus.connect(nats_server.url, Subjects("p0"), service="test", instance="hung")
    got: list[Any] = []

    async def on(msg: Any, _subject: str) -> None:
        got.append(msg)

    try:
        await bus.subscribe(SVC_HEARTBEAT, on, service="x")
        await bus.flush()
        assert nats_server.pid is not None
        os.kill(nats_server.pid, signal.SIGSTOP)
        try:
            for _ in range(200):  # stopped ('T'), not still answering on another core
                with open(f"/proc/{nats_server.pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "T":
                        break
                await asyncio.sleep(0.01)
            with pytest.raises(BusUnavailable, match="no answer from NATS"):
                await bus.flush(0.3)
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        await bus.publish(SVC_HEARTBEAT, m.Heartbeat(service="x", instance="hung"), service="x")
        for _ in range(60):
            if got:
                break
            await asyncio.sleep(0.05)
        assert got, "the bus received nothing after the server went on"
        await bus.flush(2.0)  # and its flushes are answered again
    finally:
        await bus.close()


async def _until(cond: Any, limit_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"not within {limit_s} s: {what}"
        await asyncio.sleep(0.02)


@pytest.mark.timeout(60)
async def test_a_flush_while_disconnected_waits_for_the_reconnect_without_spinning(nats_server):
    """While the client reconnects nats-py's ``flush`` returns at once (its read loop ended with the connection).
    Before, ``Bus.flush`` took that for an answer: with nothing queued it returned at once, as if the server had
    everything; with a publish queued it spun until its deadline (1.6 CPU-s in a 2-s flush, review rr-ping53). Now it
    waits for the reconnect (BusUnavailable at its deadline, naming why) and PINGs the new connection."""
    import resource

    from tests.integration.nats_proxy import NatsProxy

    proxy = NatsProxy(nats_server.port)
    bus = await Bus.connect(await proxy.start(), Subjects("p0"), service="test", instance="down")
    loop = asyncio.get_running_loop()

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    try:
        proxy.refusing = True  # the server stays away
        proxy.links[0].cut()
        await _until(lambda: not bus.nc.is_connected, 10, "the disconnect")
        t0 = loop.time()
        with pytest.raises(BusUnavailable, match=r"within 0\.6 s: not connected"):
            await bus.flush(0.59999999)  # the number rounded in the message
        assert loop.time() - t0 >= 0.55, "a flush while disconnected returned before its deadline"
        await bus.nc.publish("x.y", b"queued while down")
        assert bus.nc.pending_data_size > 0
        c0, t0 = cpu_s(), loop.time()
        with pytest.raises(BusUnavailable, match="not connected"):
            await bus.flush(1.5)
        spent, took = cpu_s() - c0, loop.time() - t0
        assert took >= 1.45 and spent < 0.4, f"{spent:.2f} CPU-s in a {took:.2f}-s flush while disconnected"
        # a flush begun while disconnected returns once the reconnect's connection answered its PING
        flushing = asyncio.ensure_future(bus.flush(10))
        await asyncio.sleep(0.3)
        assert not flushing.done()
        proxy.refusing = False
        await asyncio.wait_for(flushing, 10)
        assert bus.nc.is_connected and len(proxy.links) == 2 and b"PING\r\n" in proxy.links[1].sent
    finally:
        await bus.close()
        await proxy.close()


@pytest.mark.timeout(60)
async def test_a_flush_whose_ping_a_reconnect_lost_pings_the_new_connection(nats_server):
    """A flush's PING is on a connection that is cut; the client reconnects. Before, the flush failed "TimeoutError":
    at its deadline (8 s in the review's run) or at once when another PING of the bus cancelled the lost one (0.36 s),
    where a PING on the new connection is answered in milliseconds. Now it sends that fresh PING and returns."""
    from tests.integration.nats_proxy import NatsProxy

    proxy = NatsProxy(nats_server.port)
    bus = await Bus.connect(await proxy.start(), Subjects("p0"), service="test", instance="lost")
    loop = asyncio.get_running_loop()
    try:
        for sweep in (False, True):
            proxy.links[-1].flowing.clear()  # the server's PONG waits in the proxy
            reconnects = bus.counters["nats.reconnects"]
            flushing = asyncio.ensure_future(bus.flush(6))
            await asyncio.sleep(0.3)
            assert not flushing.done()
            proxy.links[-1].cut()
            await _until(lambda: bus.counters["nats.reconnects"] > reconnects and bus.nc.is_connected, 10, "the reconnect")
            back = loop.time()
            if sweep:  # another user of the bus (the router's probe, the confirm loop) PINGs now
                assert await bus.ping().wait(5) is True
            await asyncio.wait_for(flushing, 10)
            assert loop.time() - back < 2.0, f"flush returned {loop.time() - back:.2f} s after the reconnect"
    finally:
        await bus.close()
        await proxy.close()


async def test_a_flush_on_a_deaf_client_says_so_at_once(nats_url):
    """A client whose read loop ended answers no PING: the flush fails at once, saying so. Before it said ``no answer
    from NATS within 4.999966950000271 s: DeafClient`` (the close's drain log line)."""
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="deaf")
    try:
        reading = bus.nc._reading_task
        reading.cancel()
        await asyncio.wait({reading}, timeout=5)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(BusUnavailable, match="the NATS client is deaf, its read loop has ended") as e:
            await bus.flush(4.999966950000271)
        assert asyncio.get_running_loop().time() - t0 < 0.5 and "4.9999" not in str(e.value)
    finally:
        await bus.close()
