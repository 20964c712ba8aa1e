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
