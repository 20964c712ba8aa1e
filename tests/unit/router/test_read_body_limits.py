"""The router's 413 and 408 of a request body name what the operator sets: the flag (``--max-body-bytes``,
``--body-timeout-s``) and the variable (``EI_MAX_BODY_BYTES``, ``EI_BODY_TIMEOUT_S``: ``up`` and ``demo`` have no such
flag), and the limit in its unit. Before, they named the config fields (``max_body_bytes=1024``, ``body_timeout_s=1``),
then only the router's flags, which ``up --max-body-bytes`` refuses (unrecognized arguments)."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from services.router.api import ApiError
from services.router.service import RouterService


def _request(chunks: list[bytes], content_length: int | None, stall: bool = False) -> Request:
    """A POST whose body arrives as ``chunks`` (then, with ``stall``, nothing more), with that Content-Length."""
    parts = list(chunks)

    async def receive() -> dict[str, Any]:
        if parts:
            return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts) or stall}
        await asyncio.Event().wait()  # the client sends nothing more
        raise AssertionError("unreachable")

    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive)


def _router(limit: int = 1024, timeout_s: float = 0.05) -> Any:
    """What ``RouterService._read_body`` reads of its service: the two limits and the counters."""
    return SimpleNamespace(cfg=SimpleNamespace(max_body_bytes=limit, body_timeout_s=timeout_s), counters=Counter())


async def _read(router: Any, request: Request) -> bytes:
    return await RouterService._read_body(router, request)


async def test_a_body_within_the_limit_is_read_whole():
    assert await _read(_router(), _request([b"a" * 1000, b"b" * 24], None)) == b"a" * 1000 + b"b" * 24


async def test_the_413_of_a_declared_length_names_the_flag_and_the_limit_in_bytes():
    with pytest.raises(ApiError) as e:
        await _read(_router(limit=1024), _request([b"x"], 2000))
    assert e.value.status == 413
    assert str(e.value) == "request body of 2000 bytes exceeds the router's limit of 1024 bytes (--max-body-bytes / EI_MAX_BODY_BYTES)"


async def test_the_413_of_a_streamed_body_names_the_flag_and_the_limit_in_bytes():
    with pytest.raises(ApiError) as e:
        await _read(_router(limit=1024), _request([b"a" * 1000, b"b" * 1000], None))
    assert e.value.status == 413
    assert str(e.value) == "request body exceeds the router's limit of 1024 bytes (--max-body-bytes / EI_MAX_BODY_BYTES)"


async def test_the_408_names_the_flag_and_the_limit_in_seconds():
    router = _router(timeout_s=0.05)
    with pytest.raises(ApiError) as e:
        await _read(router, _request([b"a" * 10], 1000, stall=True))
    assert e.value.status == 408
    assert str(e.value) == "request body not received within the router's limit of 0.05 s (--body-timeout-s / EI_BODY_TIMEOUT_S)"
    assert router.counters["http.body_timeouts"] == 1


def test_the_named_variables_set_the_routers_limits_and_up_has_no_such_flags(tmp_path):
    """What the 413/408 name works where it is named: the router reads ``EI_MAX_BODY_BYTES`` and
    ``EI_BODY_TIMEOUT_S`` (the router ``up`` starts inherits its environment); ``up`` has neither flag."""
    from evolving_infra.cli import build_parser
    from services.router.config import RouterConfig
    from shared.config import resolve_config

    cfg = resolve_config(RouterConfig, {}, env={"EI_MAX_BODY_BYTES": "2048", "EI_BODY_TIMEOUT_S": "7.5"})
    assert (cfg.max_body_bytes, cfg.body_timeout_s) == (2048, 7.5)
    for flag in ("--max-body-bytes", "--body-timeout-s"):
        with pytest.raises(SystemExit):
            build_parser("up").parse_args(["up", "--log-dir", str(tmp_path), flag, "5"])
