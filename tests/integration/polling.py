"""Polling for live integration tests: wait until a condition over real services holds."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def until(
    pred: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = "condition", every: float = 0.01
) -> None:
    """Return once ``pred()`` is true, polling every ``every`` seconds (wall, monotonic).

    ``pred`` may be a plain function or a coroutine function (awaited at each poll).

    Raises:
        AssertionError: ``pred()`` stayed false for ``timeout`` seconds ("timed out waiting for
            ``what``").
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = pred()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        await asyncio.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
