"""The bus's resend-window confirmation (``Bus._confirm_loop``, real nats-server) after its review (rr-bus52):

* a PING sent on a new connection before nats-py called the bus's ``reconnected_cb`` (nats-py sets connected, then
  awaits its own flush, then calls it) was cancelled as "of the old connection" once ``CONFIRM_PING_S`` passed with no
  PONG; its late PONG then ended nats-py's read loop (``InvalidStateError`` in ``_process_pong``): the bus stayed
  connected and read nothing for minutes. Here a proxy delays the server's bytes by 1.5 s right after a reconnect.
* a publisher that keeps the client's queue busy (back-to-back publishes) never let a round find it empty, so nothing
  was confirmed and its window grew to ``RESEND_MAX_MSGS`` with a healthy server.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import messages as m
from shared.bus import CONFIRM_PING_S, RESEND_WINDOW_S, Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import REQ_OUT, Subjects

pytestmark = pytest.mark.timeout(60)


def _chunk(i: int) -> m.TokenChunk:
    return m.TokenChunk(rid="r", node="w0", index=i, token_ids=[i])


async def test_a_slow_pong_right_after_a_reconnect_leaves_the_client_reading():
    delay = {"s2c": 0.0}
    conns: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
    later_tasks: set[asyncio.Future[None]] = set()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, delayed: bool) -> None:
        try:
            while data := await r.read(65536):
                if delayed and delay["s2c"]:
                    async def later(data: bytes = data, d: float = delay["s2c"]) -> None:  # one delay for all: in order
                        await asyncio.sleep(d)
                        w.write(data)
                    t = asyncio.ensure_future(later())
                    later_tasks.add(t)
                    t.add_done_callback(later_tasks.discard)
                else:
                    w.write(data)
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    with EmbeddedNatsServer() as srv:
        host, port = srv.url.removeprefix("nats://").rsplit(":", 1)

        async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            sr, sw = await asyncio.open_connection(host, int(port))
            conns.append((cw, sw))
            await asyncio.gather(pipe(cr, sw, False), pipe(sr, cw, True))

        proxy = await asyncio.start_server(handle, "127.0.0.1", 0)
        pport = proxy.sockets[0].getsockname()[1]
        pub = await Bus.connect(f"nats://127.0.0.1:{pport}", Subjects("p0"), service="worker", instance="w0")
        try:
            assert await pub.ensure_stream()
            await pub.publish(REQ_OUT, _chunk(0), rid="r", node="w0")  # starts the confirm loop
            await asyncio.sleep(2 * CONFIRM_PING_S + 0.2)
            delay["s2c"] = 1.5  # the server answers slowly just after the reconnect
            for cw, sw in conns:
                cw.transport.abort()
                sw.transport.abort()
            deadline = time.monotonic() + 20
            while pub.counters["nats.reconnects"] < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert pub.counters["nats.reconnects"] >= 1, dict(pub.counters)
            await asyncio.sleep(4 * CONFIRM_PING_S + 2)  # several rounds, each PONG 1.5 s late
            delay["s2c"] = 0.0
            reading = pub.nc._reading_task
            assert reading is not None and not reading.done(), f"nats-py's read loop ended: {reading!r}"
            await asyncio.wait_for(pub.nc.flush(timeout=3), 5)  # a PING answered: the client still reads
        finally:
            await pub.close()
            proxy.close()


async def test_a_publisher_that_keeps_the_queue_busy_still_gets_its_window_confirmed():
    with EmbeddedNatsServer() as srv:
        pub = await Bus.connect(srv.url, Subjects("p0"), service="worker", instance="w0")
        try:
            assert await pub.ensure_stream()
            n, t_end = 0, time.monotonic() + 7.0
            while time.monotonic() < t_end:  # back to back: a yield between publishes, never a pause
                await pub.publish(REQ_OUT, _chunk(n), rid="r", node="w0")
                n += 1
                await asyncio.sleep(0)
            oldest = time.monotonic() - pub._recent[0][0]
            assert pub._confirms, f"no PING confirmed anything in 7 s of {n} publishes"
            assert time.monotonic() - pub._confirms[-1][1] < 3 * CONFIRM_PING_S, (pub._confirms, n)
            # the window is its last ~3 s (or RESEND_MAX_MSGS of them, counted as dropped, past ~16k publishes a second)
            assert oldest < RESEND_WINDOW_S + 3 * CONFIRM_PING_S, (oldest, len(pub._recent), n, dict(pub.counters))
        finally:
            await pub.close()
