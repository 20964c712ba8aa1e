"""The router's error bodies over real HTTP (a real router over a real nats-server, the fake cluster of
``test_router_live`` answering on the bus): each status the API answers with a body has OpenAI's shape with
the ``type`` and ``code`` pinned here, whichever layer answers it (the API-key guard, the API, Starlette's
404 / 405, the drain's 503). The unit test of ``api.error_body`` is ``tests/unit/router/test_error_bodies.py``.

Before: the 401 was ``authentication_error``, the 429 ``rate_limit_error`` / ``too_many_requests``, a 404
``not_found_error``, a 503 ``service_unavailable`` (OpenAI: ``invalid_request_error`` / ``invalid_api_key``,
``requests`` / ``rate_limit_exceeded``, ``invalid_request_error``, ``server_error``)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import structlog

from tests.integration.test_router_live import _wait_for, router_env

KEY = {"Authorization": "Bearer k1"}


def _is(r: httpx.Response, status: int, kind: str, code: int | str, param: str | None, fragment: str) -> dict[str, Any]:
    """Assert ``r`` is ``status`` with exactly the body ``{"error": {message, kind, param, code}}``, its message holding
    ``fragment``; returns the error."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert r.json() == {"error": {"message": err["message"], "type": kind, "param": param, "code": code}}, r.text
    assert fragment in err["message"], err
    return err


async def test_each_status_has_openais_body_over_http(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys="k1", api_key_max_inflight=1) as env:
        svc = env.service
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{svc.port}", timeout=30.0) as http:
            _is(await http.post("/v1/completions", json={"prompt": [1]}), 401, "invalid_request_error", "invalid_api_key", None,
                "missing or invalid API key")  # fmt: skip
            _is(await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 10_000_000}, headers=KEY), 400,
                "invalid_request_error", 400, "max_tokens", "exceeds the limit")  # fmt: skip
            _is(await http.post("/v1/completions", json={"prompt": [1], "model": "gpt-4"}, headers=KEY), 404,
                "invalid_request_error", 404, "model", "not found")  # fmt: skip
            _is(await http.get("/v1/models/gpt-4", headers=KEY), 404, "invalid_request_error", 404, "model", "gpt-4")
            _is(await http.get("/v1/nothing", headers=KEY), 404, "invalid_request_error", 404, None, "GET /v1/nothing: not found")
            r = await http.get("/v1/completions", headers=KEY)
            _is(r, 405, "invalid_request_error", 405, None, "method not allowed")
            assert r.headers["allow"] == "POST"

            env.cluster.answering.discard("c0")  # c0 records the work and never answers: the key's one slot stays taken
            held = asyncio.create_task(http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}, headers=KEY))
            try:
                await _wait_for(lambda: env.cluster.works, what="the first request dispatched")
                r = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}, headers=KEY)
                _is(r, 429, "requests", "rate_limit_exceeded", None, "1 request in flight, its limit; retry when it ends")
                assert r.headers["retry-after"] == "1"
            finally:
                held.cancel()
                await asyncio.gather(held, return_exceptions=True)
            await _wait_for(lambda: not svc._pending, what="the held request dropped")

            svc._draining = True  # a SIGTERM's drain (test_router_drain_live drives the real signal)
            try:
                r = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}, headers=KEY)
                _is(r, 503, "server_error", 503, None, "router draining")
                assert r.headers["retry-after"] == "1"
            finally:
                svc._draining = False


async def test_an_unexpected_exception_is_the_apis_json_500_logged_and_counted(nats_url, tmp_path, monkeypatch):
    """A bug no handler catches (here ``GET /v1/models`` raising) is answered with the API's body
    (``server_error``, 500), counted ``http_errors_500`` and logged at error with the traceback; the router
    serves on. Before, Starlette answered a text/plain ``Internal Server Error``."""
    from services.router import api

    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("a bug")

    with structlog.testing.capture_logs() as logs:
        async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
            svc = env.service
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{svc.port}", timeout=30.0) as http:
                monkeypatch.setattr(api, "models_response", broken)
                r = await http.get("/v1/models")
                assert r.headers["content-type"] == "application/json", r.text
                _is(r, 500, "server_error", 500, None, "internal error in the router: RuntimeError")
                assert svc.counters["http_errors_500"] == 1
                monkeypatch.undo()
                assert (await http.get("/v1/models")).status_code == 200  # it serves on
    [line] = [e for e in logs if e.get("event") == "unexpected error answered as 500"]
    assert line["log_level"] == "error" and line["path"] == "/v1/models" and isinstance(line["exc_info"], RuntimeError), line
