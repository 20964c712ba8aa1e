"""A loopback TCP proxy between one NATS client and a real nats-server, for live tests of what a client does
when its connection is cut or slow: :meth:`NatsProxy.start` gives the URL to connect to; each client connection is a
:class:`Link`, whose bytes from the client are recorded (``sent``: which commands went out) and whose bytes from the
server can be held (``flowing`` cleared: the server's PONGs and messages wait in the proxy) or cut (the client sees
its connection lost and reconnects through the proxy, a new link, with the server up, unless the proxy is
``refusing``), or delayed (:attr:`NatsProxy.down_delay_s`: a slow path, a loaded host's late PONGs).
"""

from __future__ import annotations

import asyncio
import contextlib


class Link:
    """One client connection through :class:`NatsProxy`.

    Attributes:
        sent: every byte the client sent on it, in order.
        flowing: set while the server's bytes go on to the client; cleared, they wait in the proxy (in order).
        forward_up: True while the client's bytes go on to the server; False, they are recorded (``sent``) and dropped,
            as a server killed under the client drops what its socket buffered.
        hold_after_pongs: None, or a count of the server's PONGs after which ``flowing`` is cleared (before the next
            bytes from the server go on), e.g. 1: a reconnect's CONNECT is answered, its flush's PING is not (to let
            them go on: set it to None, then set ``flowing``).
        pongs: the server's PONGs passed on to the client so far.
        up_flowing: set while the client's bytes go on to the server; cleared, they wait (in order): the chunk read
            last is recorded in ``sent``, the rest is not read meanwhile.
        hold_up_at: None, or bytes whose first appearance in what the client sends clears ``up_flowing`` (that chunk
            waits too), e.g. a subscription's ``UNSUB <sid> ``: the server goes on delivering to it meanwhile.
    """

    def __init__(self, hold_after_pongs: int | None = None, hold_up_at: bytes | None = None) -> None:
        self.sent = bytearray()
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.forward_up = True
        self.hold_after_pongs = hold_after_pongs
        self.pongs = 0
        self.up_flowing = asyncio.Event()
        self.up_flowing.set()
        self.hold_up_at = hold_up_at
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Future[None]] = []

    def cut(self) -> None:
        """Close both sides: the client sees its connection lost; what the proxy held is dropped."""
        for w in self.writers:
            w.close()
        for t in self.tasks:
            t.cancel()


class NatsProxy:
    """A loopback TCP proxy to a nats-server listening on 127.0.0.1:``upstream_port``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.links: list[Link] = []
        """The client connections so far, oldest first."""
        self.server: asyncio.AbstractServer | None = None
        self.refusing = False
        """True: a new client connection is closed at once (the client's connect fails, as to a server down)."""
        self.next_hold_after_pongs: int | None = None
        """Given to the next client connection as its :attr:`Link.hold_after_pongs` (then None again)."""
        self.next_hold_up_at: bytes | None = None
        """Given to the next client connection as its :attr:`Link.hold_up_at` (then None again)."""
        self.down_delay_s = 0.0
        """Wall seconds every byte from the server waits in the proxy before it goes on to the client (each chunk from
        when it was read; order and spacing kept, so PONGs and messages come late, not bunched). Read at each chunk:
        set it at any time; once a chunk was delayed, the link's later chunks go through the same queue."""

    async def start(self) -> str:
        """Listen on a free loopback port; returns the URL a client connects to (``nats://127.0.0.1:<port>``)."""
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.refusing:
            cw.close()
            return
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # the server is down: the client sees a refused connect
            cw.close()
            return
        link = Link(self.next_hold_after_pongs, self.next_hold_up_at)
        self.next_hold_after_pongs = self.next_hold_up_at = None
        link.writers = [cw, uw]

        async def up() -> None:
            with contextlib.suppress(OSError):
                while data := await cr.read(65536):
                    link.sent += data
                    if link.hold_up_at is not None and link.hold_up_at in link.sent:
                        link.hold_up_at = None
                        link.up_flowing.clear()
                    await link.up_flowing.wait()
                    if link.forward_up:
                        uw.write(data)
                        await uw.drain()
            uw.close()

        late: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def forward_late() -> None:
            with contextlib.suppress(OSError):
                while (item := await late.get()) is not None:
                    await asyncio.sleep(max(0.0, item[0] - loop.time()))
                    cw.write(item[1])
                    await cw.drain()
            cw.close()

        async def down() -> None:
            delaying = False
            with contextlib.suppress(OSError):
                while data := await ur.read(65536):
                    if link.hold_after_pongs is not None and link.pongs >= link.hold_after_pongs:
                        link.flowing.clear()
                    await link.flowing.wait()
                    link.pongs += data.count(b"PONG\r\n")
                    if delaying or self.down_delay_s > 0:
                        if not delaying:
                            delaying = True
                            link.tasks.append(asyncio.ensure_future(forward_late()))
                        late.put_nowait((loop.time() + self.down_delay_s, data))
                        continue
                    cw.write(data)
                    await cw.drain()
            if delaying:
                late.put_nowait(None)  # the forwarder closes the client's side once the queue is out
            else:
                cw.close()

        link.tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        self.links.append(link)

    async def close(self) -> None:
        """Cut every link and stop listening."""
        for link in self.links:
            link.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
