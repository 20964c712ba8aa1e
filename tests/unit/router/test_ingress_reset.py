"""The router's per-request connection reset hook (``ingress.RESET_EXTENSION``) on a connection that
carries more than one request (keep-alive, pipelining): it resets the connection only while its own
request's response is on."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from services.router.ingress import RESET_EXTENSION, guarded_h11


class _Transport(asyncio.Transport):
    """An in-memory transport: what is written, and whether it was aborted."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.aborted = False
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def abort(self) -> None:
        self.aborted = self.closing = True

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_a_requests_reset_hook_spares_the_next_request_on_its_connection():
    """The router calls a stream's hook ``--slow-client-grace-s`` after it aborted it as too slow, unless its
    response ended first (before 9ff3e38 a ``_Pending.http_closed``, set once the response's ASGI call had
    returned, said so; now the hook itself). Its response is complete a little before that call returns (Starlette's stream ends its disconnect listener
    first), and uvicorn starts a pipelined next request on the same connection at the completion: a hook
    that is the connection's ``transport.abort`` then killed that other request. Now a hook resets only while
    its own request's response is on (it is the connection's current one, not complete)."""
    started: list[dict[str, Any]] = []
    release: dict[str, asyncio.Event] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        started.append(scope)
        ev = release[scope["path"]] = asyncio.Event()
        await ev.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> None:
        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        config.load()
        proto = guarded_h11(30.0, Counter())(config=config, server_state=ServerState(), app_state={})
        transport = _Transport()
        proto.connection_made(transport)
        # two pipelined requests: the second starts when the first's response is complete
        proto.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(5):
            await asyncio.sleep(0)
        assert [s["path"] for s in started] == ["/a"]
        reset_a = started[0]["extensions"][RESET_EXTENSION]
        release["/a"].set()
        for _ in range(10):
            await asyncio.sleep(0)
        assert [s["path"] for s in started] == ["/a", "/b"]  # /a answered, /b running on the same connection
        assert not reset_a()  # /a's hook after its response: the connection now carries /b
        assert not transport.aborted
        assert started[1]["extensions"][RESET_EXTENSION]()  # /b's own hook, its response not sent: resets
        assert transport.aborted
        release["/b"].set()
        for _ in range(5):
            await asyncio.sleep(0)
        proto.connection_lost(None)

    asyncio.run(main())
