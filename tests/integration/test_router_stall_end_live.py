"""Which send of a stream stalls does not change how its request is counted (``--stream-stall-timeout-s``), live.

Real nats-server and router (``router_env``: workers played by ``FakeCluster``, which sends a request's whole
output at once); the stream's ASGI ``send`` is the test's, modelled on uvicorn's (0.55, ``h11_impl.py``
``send``): a send first waits for the socket to drain (its predecessor's bytes still in the write buffer) and only
then writes its own message; so a send that waits until the router resets the connection (``transport.abort``
drops the buffer) means its predecessor never reached the client either. The reset makes it return, and the
connection's ``receive`` then says ``http.disconnect``, as uvicorn's.

Every stall before the response is complete (the empty last send included) aborts the request as too slow
(``slow_client_aborts``, ``finish.abort``): its client did not get the message before the stalled one, for a
stall on the usage chunk or ``[DONE]`` the finish chunk. A request that had already failed (its timeout) stays
counted once as ``error``; one the router ended at a stop counted ``finished.stop`` stays so, and
``slow_client_aborts`` says its client was cut. Before (2c62a96), a stall after the finish chunk was handed to
the connection only reset it and counted the request ``finished.length`` (the test's send then treated the
stalled message's predecessors as delivered, the opposite of uvicorn); ``test_router_slow_clients_live``
checks the same with real uvicorn and a client that reads nothing.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from services.router.ingress import RESET_EXTENSION
from services.router.service import RouterService
from tests.integration.test_router_live import _wait_for, output_token, router_env

pytestmark = pytest.mark.timeout(60)

STALL_S = 0.3
"""--stream-stall-timeout-s of the test's router."""


def _body(message: dict[str, Any]) -> bytes:
    return bytes(message.get("body", b"")) if message["type"] == "http.response.body" else b""


STALLS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "finish-chunk": lambda msg: b'"finish_reason":"length"' in _body(msg),
    "usage-chunk": lambda msg: b'"choices":[]' in _body(msg),
    "done": lambda msg: _body(msg) == b"data: [DONE]\n\n",
    "final-empty-send": lambda msg: msg["type"] == "http.response.body" and not msg.get("more_body", False),
    "error-event": lambda msg: b'"error"' in _body(msg),
}
"""Which message's send waits (the first one it matches)."""


async def _stalled_at(svc: RouterService, rid: str, stall: str, **extra: Any) -> list[bytes]:
    """One stream (5 tokens, usage asked; ``extra``: more request fields) through the router's ASGI app whose send
    of the ``stall`` message waits until the router resets the connection. Returns the bodies its client got: those
    handed over before the stalled one's predecessor (which the reset dropped from the write buffer)."""
    reset, gone = asyncio.Event(), asyncio.Event()
    sent: list[bytes] = []
    body = msgspec.json.encode(
        {"prompt": [1, 2, 3], "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}, **extra}
    )
    stalled = False

    def reset_hook() -> bool:
        reset.set()
        gone.set()
        return True

    async def send(message: dict[str, Any]) -> None:
        nonlocal stalled
        if not stalled and STALLS[stall](message):
            stalled = True
            if sent:
                sent.pop()  # uvicorn waits for the drain before writing: the previous message is still buffered
            await asyncio.wait_for(reset.wait(), timeout=10)  # the socket never drains; uvicorn's send returns once reset
            return
        if message["type"] == "http.response.body" and not reset.is_set():  # uvicorn's send returns once disconnected
            sent.append(_body(message))

    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"x-request-id", rid.encode()),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", svc.port), "extensions": {RESET_EXTENSION: reset_hook},
    }  # fmt: skip
    await asyncio.wait_for(svc.app(scope, receive, send), timeout=15)
    assert stalled and reset.is_set(), (stall, sent)
    await _wait_for(lambda: rid not in svc._pending, what=f"{rid} forgotten")
    return sent


def _ends(svc: RouterService) -> dict[str, int]:
    """The router's counters of how requests ended (what an assertion's message shows)."""
    return {k: v for k, v in svc.counters.items() if k.startswith(("finish", "slow_client", "aborts"))}


@pytest.mark.parametrize("stall", ["finish-chunk", "usage-chunk", "done", "final-empty-send"])
async def test_a_stall_before_the_response_is_complete_aborts_the_request_as_too_slow(nats_url, tmp_path, stall):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, stream_stall_timeout_s=STALL_S, slow_client_grace_s=30.0) as env:
        svc = env.service
        t0 = time.monotonic()
        sent = await _stalled_at(svc, f"stall-{stall}", stall)
        assert time.monotonic() - t0 < 5 * STALL_S + 2
        assert not any(b"[DONE]" in b for b in sent), sent  # the stalled message's predecessor never went out
        if stall in ("finish-chunk", "usage-chunk"):
            assert not any(b'"finish_reason":"length"' in b for b in sent), sent  # its client never saw its end
        c = _ends(svc)
        assert c.get("finish.abort") == 1 and "finished.length" not in c, c
        assert c.get("slow_client_aborts") == 1 and c.get("slow_client_resets") == 1, c
        assert svc.buffered_output_tokens == 0, c


async def test_a_stop_counted_by_the_router_stays_counted_once_when_its_done_stalls(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, stream_stall_timeout_s=STALL_S, slow_client_grace_s=30.0) as env:
        svc = env.service
        await _stalled_at(svc, "stall-stop", "done", stop_token_ids=[output_token(2)])
        c = _ends(svc)
        # its end was counted when the router matched the stop; the stall says its client was cut
        assert c.get("finished.stop") == 1 and "finish.abort" not in c and "finished.length" not in c, c
        assert c.get("slow_client_aborts") == 1 and c.get("slow_client_resets") == 1, c


async def test_a_request_ended_by_its_timeout_whose_error_event_stalls_stays_an_error_counted_once(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, stream_stall_timeout_s=STALL_S, slow_client_grace_s=30.0,
                          request_timeout_s=0.5) as env:  # fmt: skip
        svc = env.service
        env.cluster.answering.clear()  # no output: the request times out, its 504 error event is what stalls
        await _stalled_at(svc, "stall-timeout", "error-event")
        c = _ends(svc)
        assert c.get("finish.error") == 1 and "finish.abort" not in c, c
        assert c.get("aborts.timeout") == 1 and "aborts.slow_client" not in c, c
        assert c.get("slow_client_aborts", 0) == 0 and c.get("slow_client_resets") == 1, c
