"""The router's h11 protocol during a drain on a held socket (``ingress.guarded_h11``'s ``closing``,
``close_after_response``, ``idle``, ``close_if_idle``): a request read while ``closing()`` is answered with
``Connection: close`` and its connection closed right after; a connection is idle only with no request on and no
byte of the next one read; ``close_if_idle`` closes only such a one."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from services.router.ingress import guarded_h11
from tests.unit.router.test_ingress_reset import _Transport


def _proto(app: Any, closing: list[bool], counters: Counter[str]) -> tuple[Any, _Transport]:
    config = uvicorn.Config(app, lifespan="off", log_level="warning")
    config.load()
    proto = guarded_h11(30.0, counters, closing=lambda: closing[0])(config=config, server_state=ServerState(), app_state={})
    transport = _Transport()
    proto.connection_made(transport)
    return proto, transport


async def _turns(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _released_app(release: dict[str, asyncio.Event]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        ev = release.setdefault(scope["path"], asyncio.Event())
        await ev.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def test_a_request_read_while_closing_is_answered_with_connection_close_and_its_connection_closed():
    release: dict[str, asyncio.Event] = {}
    closing = [False]
    counters: Counter[str] = Counter()

    async def main() -> None:
        proto, transport = _proto(_released_app(release), closing, counters)
        assert proto.idle()  # connected, nothing sent
        proto.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        await _turns()
        assert not proto.idle()  # a request on
        release["/a"].set()
        await _turns()
        assert b"connection: close" not in transport.out.lower() and not transport.is_closing()  # keep-alive as ever
        assert proto.idle()
        proto.data_received(b"GET /b HTTP/1.1\r\nHo")  # the next request's head, partly read
        assert not proto.idle() and not proto.close_if_idle() and not transport.is_closing()
        closing[0] = True  # the drain starts before the rest of that head comes
        transport.out.clear()
        proto.data_received(b"st: x\r\n\r\n")
        await _turns()
        release["/b"].set()
        await _turns()
        assert transport.out.lower().startswith(b"http/1.1 200 ok\r\n") and b"connection: close\r\n" in transport.out.lower()
        assert transport.is_closing()  # right after the response that said so
        assert counters["http.closed_after_response"] == 1

    asyncio.run(main())


def test_close_after_response_marks_the_request_on_unless_its_response_started():
    """The drain's start marks each connection: a request whose response has not started gets the header; one whose
    head is out keeps its connection open (closing it right after would race the client's next request, which had
    no word of it), and that next request, read while closing, gets it."""
    closing = [False]
    gate: dict[str, asyncio.Event] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        ev = gate.setdefault(scope["path"], asyncio.Event())
        await ev.wait()
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> None:
        proto, transport = _proto(app, closing, Counter())
        assert not proto.close_after_response()  # no request on
        proto.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        await _turns()
        closing[0] = True
        assert not proto.close_after_response()  # its head is out
        gate["/a"].set()
        await _turns()
        assert b"connection: close" not in transport.out.lower() and not transport.is_closing() and proto.idle()
        proto.data_received(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        await _turns()
        gate["/b"].set()
        await _turns()
        assert transport.out.lower().count(b"connection: close") == 1 and transport.is_closing()

    asyncio.run(main())


def test_close_if_idle_closes_an_idle_connection_only():
    release: dict[str, asyncio.Event] = {}

    async def main() -> None:
        proto, transport = _proto(_released_app(release), [False], Counter())
        proto.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        await _turns()
        assert not proto.close_if_idle() and not transport.is_closing()  # its request is on
        release["/a"].set()
        await _turns()
        assert proto.close_if_idle() and transport.is_closing()
        assert proto.idle() and not proto.close_if_idle()  # closing: nothing more to close

    asyncio.run(main())


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append(("info", event, kw))

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append(("warning", event, kw))


class _Unreadable:
    """A connection whose state cannot be read: ``idle`` reads attributes a future uvicorn renamed."""

    def idle(self) -> bool:
        raise AttributeError("'H11Protocol' object has no attribute 'cycle'")


def _drain_shell(conns: list[Any], grace_s: float) -> Any:
    """A RouterService with only what :meth:`RouterService.drain` reads on a held socket (no bus, no HTTP server)."""
    from types import SimpleNamespace

    from services.router.config import RouterConfig
    from services.router.service import RouterService

    svc = RouterService.__new__(RouterService)
    svc.cfg = RouterConfig(shutdown_grace_s=grace_s, listen_fd=3)
    svc.counters = Counter()
    svc.log = _Log()
    svc.fatal = asyncio.Event()
    svc._pending, svc._handling = {}, 0
    svc._draining = svc._handing_over = False
    svc._server = SimpleNamespace(server_state=SimpleNamespace(connections=set(conns)), servers=())
    return svc


def test_a_drain_whose_grace_runs_out_on_a_busy_connection_says_grace_over():
    """On a held socket the drain waits for a connection with a request partly read (a slow head or body); when the
    grace runs out on it the "router drained" line says "grace over" with ``busy_connections`` 1 (counted
    ``drain_left_busy_connections``). Before, it said "all done" (no generation request was open). Seen failing
    before the fix."""

    async def main() -> None:
        proto, transport = _proto(_released_app({}), [False], Counter())
        proto.data_received(b"POST /v1/completions HTTP/1.1\r\nHo")  # a head partly read: a request on
        svc = _drain_shell([proto], grace_s=0.3)
        t0 = asyncio.get_running_loop().time()
        await svc.drain(asyncio.Event())
        assert asyncio.get_running_loop().time() - t0 >= 0.3  # waited the grace for the busy connection
        (drained,) = [kw for level, ev, kw in svc.log.lines if ev == "router drained"]
        assert drained["why"] == "grace over" and drained["busy_connections"] == 1, drained
        assert svc.counters["drain_left_busy_connections"] == 1
        assert not transport.is_closing()  # busy: left to the stop

    asyncio.run(main())


def test_a_drain_survives_a_connection_it_cannot_read():
    """A connection whose ``idle`` raises (a uvicorn that renamed what it reads) is counted
    (``drain_conn_state_errors``), logged once and not waited for; the drain goes on for the others. Before, it made
    the drain raise (the service then exited non-zero, skipping the drain). Seen failing before the fix
    (AttributeError from the drain)."""

    async def main() -> None:
        proto, _ = _proto(_released_app({}), [False], Counter())
        proto.data_received(b"POST /v1/completions HTTP/1.1\r\nHo")
        svc = _drain_shell([proto, _Unreadable()], grace_s=0.3)
        await svc.drain(asyncio.Event())
        (drained,) = [kw for level, ev, kw in svc.log.lines if ev == "router drained"]
        assert drained["busy_connections"] == 1 and svc.counters["drain_conn_state_errors"] >= 2, drained
        warned = [ev for level, ev, kw in svc.log.lines if level == "warning"]
        assert warned == ["connection state not readable; the drain does not wait for it"], svc.log.lines

    asyncio.run(main())


def test_a_drain_ends_at_once_when_the_only_connection_cannot_be_read():
    """Nothing open but a connection whose state cannot be read: no drain (it is not waited for), no error."""
    svc = _drain_shell([_Unreadable()], grace_s=5.0)
    asyncio.run(asyncio.wait_for(svc.drain(asyncio.Event()), 2.0))
    assert not svc._draining and svc.counters["drain_conn_state_errors"] == 1
