"""A small HTTP/1.1 server that answers what the live replayer sends, as the router does.

``GET /health``, ``POST /v1/completions`` (an SSE stream of one token and the usage) and
``POST /v1/branches/{id}/end``; ``GET /v1/cluster`` with a ``speedup`` only when given one (an older
router's answer has none). Branch ids go through the router's own
:class:`services.router.branches.BranchTable`: a request for a branch that was ended is
answered with the router's status (400) and message, an end of an unknown branch 404, an end of an ended one
200 with ``"already": true`` (idempotent, as the router's).
Every request's path and agent headers are kept in ``seen``. ``faults`` scripts how the next completions
are refused or broken (a retrying client's cases).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import unquote

from services.router import api
from services.router.branches import BranchAlreadyEnded, BranchEnded, BranchTable, UnknownBranch


class StubRouter:
    """Serve on ``127.0.0.1`` (a free port) in the running event loop (:meth:`start`).

    Args:
        speedup: reported by ``GET /v1/cluster`` when given (simulated s per wall s).
        hold: when given, a completion is answered only once it is set (``received`` is set
            when the first completion arrives).
        faults: what the next completions get instead of their answer, one per completion in order (the
            ones after are answered): ``"503"`` (a draining router's refusal, ``Retry-After: 0.05``),
            ``"503-bare"`` (no Retry-After), ``"429"`` (``Retry-After: 0.05``), ``"drop"`` (the connection
            closed before any byte of the answer), ``"break"`` (200 and the first token, then the
            connection closed mid-stream).
        hold_ends: when given, a branch end (``POST /v1/branches/{id}/end``) is answered only once it is set (a
            router whose bus is gone); ``ends_received`` counts those that arrived.
        end_faults: what the next branch ends get instead of their answer, one per end in order, as ``faults``:
            ``"503"`` (``Retry-After: 0.05``: a router that could not ask the KV directory), ``"drop"``, ``"500"``.
    """

    def __init__(self, hold: asyncio.Event | None = None, speedup: float | None = None,
                 faults: list[str] | None = None, hold_ends: asyncio.Event | None = None,
                 end_faults: list[str] | None = None) -> None:
        self.speedup = speedup
        self.end_faults = list(end_faults or ())
        self.hold_ends = hold_ends
        self.ends_received = 0
        self.faults = list(faults or ())
        self.branches = BranchTable()
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.hold = hold
        self.received = asyncio.Event() if hold is not None else None
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, port: int = 0) -> str:
        """Listen on ``port`` (0: a free one); returns the base URL."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):  # keep-alive connections the client left open
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, v = h.decode().split(":", 1)
                    headers[k.strip().lower()] = v.strip()
                n = int(headers.get("content-length", "0"))
                body = await reader.readexactly(n) if n else b""
                is_end = target.startswith("/v1/branches/") and target.endswith("/end")
                if (target == "/v1/completions" and self.faults) or (is_end and self.end_faults):
                    fault = (self.end_faults if is_end else self.faults).pop(0)
                    self.seen.append((target, {k: v for k, v in headers.items() if k.startswith("x-")}))
                    if fault == "drop":
                        return
                    if fault == "break":
                        sse = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
                        writer.write(b"HTTP/1.1 200 X\r\nContent-Type: text/event-stream\r\nContent-Length: 1000\r\n\r\n" + sse)
                        await writer.drain()
                        return
                    code, after = {"503": (503, "0.05"), "503-bare": (503, None), "429": (429, "0.05"), "500": (500, None)}[fault]
                    msg = b'{"error": {"message": "router draining; retry on another router"}}'
                    writer.write(f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\n".encode()
                                 + (f"Retry-After: {after}\r\n".encode() if after else b"")
                                 + f"Content-Length: {len(msg)}\r\n\r\n".encode() + msg)
                    await writer.drain()
                    continue
                status, ctype, payload = await self._answer(method, target, headers, body)
                rid = headers.get("x-request-id")  # the router keeps a valid X-Request-ID as the rid and echoes it
                extra = f"x-request-id: {rid}\r\n" if rid and status == 200 and target == "/v1/completions" else ""
                writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\n{extra}Content-Length: {len(payload)}\r\n\r\n".encode()
                             + payload)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return
        finally:
            self._conns.discard(task)
            writer.close()

    async def _answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        self.seen.append((target, {k: v for k, v in headers.items() if k.startswith("x-")}))
        if method == "GET" and target == "/health":
            return 200, "application/json", b"{}"
        if method == "GET" and target == "/v1/cluster":
            cluster = {"policy": "stub", "nodes": []} | ({} if self.speedup is None else {"speedup": self.speedup})
            return 200, "application/json", json.dumps(cluster).encode()
        if target.startswith("/v1/branches/") and target.endswith("/end"):
            self.ends_received += 1
            if self.hold_ends is not None:
                await self.hold_ends.wait()
            try:
                self.branches.end(unquote(target[len("/v1/branches/"):-len("/end")]), 0.0)
            except UnknownBranch as e:
                return 404, "application/json", json.dumps({"error": {"message": str(e)}}).encode()
            except BranchAlreadyEnded:
                return 200, "application/json", b'{"already": true}'
            return 200, "application/json", b"{}"
        if target == "/v1/completions":
            try:
                api.parse_request_id(headers.get("x-request-id"))
            except api.ApiError as e:
                return e.status, "application/json", json.dumps({"error": {"message": e.reason}}).encode()
            try:
                self.branches.observe(headers["x-branch-id"], 0.0, kind=headers.get("x-branch-kind", "main"),  # type: ignore[arg-type]
                                      parent=headers.get("x-parent-branch-id"), agent_id=headers.get("x-agent-id"))
            except BranchEnded as e:
                return e.status, "application/json", json.dumps({"error": {"message": str(e)}}).encode()
            if self.hold is not None:
                assert self.received is not None
                self.received.set()
                await self.hold.wait()
            prompt = len(json.loads(body)["prompt"])
            events = [{"choices": [{"index": 0, "text": "a"}]},
                      {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                       "usage": {"prompt_tokens": prompt, "completion_tokens": 1}}]
            sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return 200, "text/event-stream", sse.encode()
        return 404, "application/json", b'{"error": {"message": "not found"}}'


@contextmanager
def stub_router_thread(speedup: float | None = None, faults: list[str] | None = None,
                       hold: bool = False) -> Iterator[tuple[str, StubRouter]]:
    """A :class:`StubRouter` served by its own event loop in a thread (for code that runs ``asyncio.run``
    itself, such as the ``replay`` command); yields ``(base URL, stub)``. ``speedup``, ``faults``: as :class:`StubRouter`'s;
    ``hold``: no completion is ever answered (a run that stays in flight until it is stopped)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        stub = StubRouter(speedup=speedup, faults=faults, hold=asyncio.Event() if hold else None)
        box["stub"] = stub
        box["url"] = loop.run_until_complete(stub.start())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(stub.close())
        loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10), "the stub router did not start"
    try:
        yield str(box["url"]), box["stub"]  # type: ignore[misc]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
