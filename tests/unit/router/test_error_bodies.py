"""Every error body of the router's HTTP API comes from ``api.error_body``, one shape for every status: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with OpenAI's ``type``, vLLM's int ``code`` (the HTTP status),
and OpenAI's string ``code`` where vLLM sends no such body (401 ``invalid_api_key``, 429 ``rate_limit_exceeded``).

Before: the API-key guard wrote its own 401 / 429 (``type`` ``authentication_error`` / ``rate_limit_error``, ``code``
``too_many_requests``: neither OpenAI's nor vLLM's), and ``error_body`` gave made-up types (``not_found_error``,
``service_unavailable``, ``timeout_error``, ``conflict_error``, ``internal_error``). The live proof over real HTTP is
``tests/integration/test_router_error_bodies_live.py``."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest

from services.router.api import error_body
from services.router.ingress import IngressGuard, key_id

# status -> (type, code): the router sends each of these statuses with an error body
BODIES = {
    400: ("invalid_request_error", 400),  # OpenAI's type; vLLM's code
    401: ("invalid_request_error", "invalid_api_key"),  # OpenAI's 401 (an unknown or missing key)
    404: ("invalid_request_error", 404),  # OpenAI's unknown model / "Invalid URL"; vLLM's code
    405: ("invalid_request_error", 405),
    408: ("invalid_request_error", 408),
    409: ("invalid_request_error", 409),
    413: ("invalid_request_error", 413),
    429: ("requests", "rate_limit_exceeded"),  # OpenAI's requests-per-minute limit
    499: ("invalid_request_error", 499),
    500: ("server_error", 500),  # OpenAI's 5xx type
    503: ("server_error", 503),
    504: ("server_error", 504),
}


@pytest.mark.parametrize("status", sorted(BODIES))
def test_each_status_has_one_pinned_body(status):
    kind, code = BODIES[status]
    assert error_body(status, "why") == {"error": {"message": "why", "type": kind, "param": None, "code": code}}
    assert error_body(status, "why", "model")["error"]["param"] == "model"


@pytest.mark.parametrize("status", [0, 200, 302, 399, 600])
def test_a_status_that_is_no_error_is_refused(status):
    with pytest.raises(ValueError, match="4xx or 5xx"):
        error_body(status, "why")


async def _call(guard: IngressGuard, key: str | None) -> tuple[int, dict[str, Any], dict[bytes, bytes]]:
    """One request through ``guard`` with ``Authorization: Bearer <key>`` (none when None): (status, body, headers)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    await guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive, send)
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], json.loads(body), dict(sent[0].get("headers", []))


async def _until_in_flight(guard: IngressGuard, key: str, n: int) -> None:
    """Yield to the loop until ``key`` has ``n`` requests in flight; fail after 10,000 turns instead of spinning to
    pytest's timeout (the counts were re-keyed from ``"key0"`` to :func:`key_id` and these waits hung for 300 s)."""
    for _ in range(10_000):
        if guard.inflight[key_id(key)] >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{key!r} never had {n} requests in flight: {dict(guard.inflight)}")


async def test_the_key_guards_401_and_429_are_openais_bodies():
    release = asyncio.Event()

    async def held(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = IngressGuard(held, ["k1"], max_inflight=1, counters=Counter())
    for key in (None, "nope"):
        status, body, head = await _call(guard, key)
        assert status == 401 and head[b"www-authenticate"].startswith(b"Bearer")
        assert body == {"error": {"message": "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                  "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}  # fmt: skip
        assert body == error_body(401, body["error"]["message"])
    first = asyncio.create_task(_call(guard, "k1"))
    await _until_in_flight(guard, "k1", 1)
    status, body, head = await _call(guard, "k1")
    assert status == 429 and head[b"retry-after"] == b"1"
    assert body == {"error": {"message": "this API key has 1 request in flight, its limit; retry when it ends",
                              "type": "requests", "param": None, "code": "rate_limit_exceeded"}}  # fmt: skip
    release.set()
    assert (await first)[0] == 200


async def test_the_429_says_request_for_one_and_requests_for_more():
    """The limit in words: "1 request ... when it ends", "2 requests ... when one ends" (it said "1 requests")."""
    release = asyncio.Event()

    async def held(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = IngressGuard(held, ["k1"], max_inflight=2, counters=Counter())
    first = [asyncio.create_task(_call(guard, "k1")) for _ in range(2)]
    await _until_in_flight(guard, "k1", 2)
    status, body, _ = await _call(guard, "k1")
    assert status == 429
    assert body == error_body(429, "this API key has 2 requests in flight, its limit; retry when one ends")
    release.set()
    assert [(await f)[0] for f in first] == [200, 200]
