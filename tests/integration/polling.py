"""Polling for live integration tests: wait until a condition over real services holds, or until
a service has started (answers ``svc.stats``; a service process: logs ``service started``)."""

from __future__ import annotations

import asyncio
import inspect
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from shared import messages as m
from shared.bus import Bus, BusError
from shared.subjects import SVC_STATS


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


async def answering(bus: Bus, instance: str, tasks: Iterable[asyncio.Task[Any]] = (), tries: int = 200) -> None:
    """Return once service ``instance`` answers ``svc.stats`` (it has started), asking up to
    ``tries`` times (0.2 s timeout each, 0.02 s apart).

    ``tasks``: the tasks serving it (``serve_until_stopped``); one that has ended is awaited for
    its error, so a service that failed to start raises its own exception, not a timeout.

    Raises:
        AssertionError: no answer after ``tries`` requests ("``instance`` did not start").
    """
    for _ in range(tries):
        try:
            await bus.request(SVC_STATS, m.StatsRequest(), instance=instance, timeout=0.2)
            return
        except BusError:
            for t in tasks:
                if t.done():
                    t.result()
            await asyncio.sleep(0.02)
    raise AssertionError(f"{instance} did not start")


REPO = Path(__file__).resolve().parents[2]


def run_until_started(args: list[str], env: dict[str, str], log: Path) -> str:
    """Run ``python <args>`` in the repository (``env``, its output to ``log``) until its log says
    ``service started`` (60 s at most, or until it exits), then SIGTERM it; its log.

    Raises:
        AssertionError: it did not exit 0 within 30 s of the SIGTERM (the message is its log); it is
            killed if it still runs.
    """
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "service started" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    return log.read_text()
