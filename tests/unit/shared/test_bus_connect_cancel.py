"""A service stopped during its start (SIGTERM: ``shared.service.until_stopped`` cancels the start) stops, even
when a cancel is lost: here while its NATS connect is being refused (``Bus.connect`` cancelled) and the cancel
meets a refusal in one event-loop turn.

Python 3.11's ``asyncio.wait_for`` (nats-py's transport connect runs in one) returns the inner future's outcome when
a cancel comes after that future finished: the refusal (``ConnectionRefusedError``), which nats-py's connect loop
retries every ``reconnect_time_wait``, so that one cancel is lost. ``Bus.connect``'s cancel of nats-py's connect
was that one cancel, then an unbounded wait for it: the service logged "nats error" every 0.25 s and never exited,
and a second SIGTERM changed nothing. Seen in the Slurm job's stop (tests/deploy/test_slurm_supervision.py
READY_TIMEOUT test; NATS stopped with the others) under load: the job's ``stop_all`` never ended (3 of 4 runs with
the job on one busy core). Here the refusal and the cancel are put in one turn on purpose: the cancel of the
caller comes from inside the refused connection attempt, before ``wait_for`` sees the refusal.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from shared.bus import Bus
from shared.subjects import Subjects


def _refused_url() -> str:
    with socket.socket() as s:  # bound, never listening: a connection to it is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"nats://127.0.0.1:{port}"


@pytest.mark.timeout(60)
async def test_a_connect_cancelled_as_its_attempt_is_refused_ends(monkeypatch):
    real_open = asyncio.open_connection
    attempts = 0
    caller: asyncio.Task | None = None

    async def open_refused_and_cancel_the_caller(*args, **kwargs):
        nonlocal attempts
        attempts += 1
        try:
            return await real_open(*args, **kwargs)
        finally:
            if attempts == 1:
                assert caller is not None
                caller.cancel()  # the stop, in the turn the refusal is known

    monkeypatch.setattr(asyncio, "open_connection", open_refused_and_cancel_the_caller)
    connect = Bus.connect(_refused_url(), Subjects("p0"), service="kvdirectory", instance="kvdirectory")
    caller = asyncio.ensure_future(connect)
    done, _ = await asyncio.wait({caller}, timeout=10)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in leftover:  # before the fix: nats-py's connect, retrying forever
        t.cancel()
    assert caller in done, f"Bus.connect still running 10 s after its cancel ({attempts} connection attempts)"
    assert caller.cancelled()
    seen = attempts
    await asyncio.sleep(0.6)  # nats-py retries every 0.25 s: an attempt more would be a connect left running
    assert attempts == seen and not leftover, (attempts, seen, leftover)


@pytest.mark.timeout(60)
async def test_until_stopped_ends_a_start_that_lost_its_first_cancel():
    """``shared.service.until_stopped`` (a service's start-up, stopped by SIGTERM) cancels the start again until it
    ends: a start inside a nats-py call can lose one cancel the same way (a request's reply, a flush's PONG read in
    the turn the cancel comes, then a retry). Before, one cancel and an unbounded wait: the process never exited."""
    from shared.service import until_stopped

    cancels = 0

    async def start_that_retries_past_one_cancel():
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise
                # the lost cancel: retried, as nats-py's connect retries a refusal wait_for handed back

    stop = asyncio.Event()
    run = asyncio.ensure_future(until_stopped(start_that_retries_past_one_cancel(), stop))
    await asyncio.sleep(0.05)
    stop.set()
    done, _ = await asyncio.wait({run}, timeout=5)
    for t in asyncio.all_tasks():
        if t is not asyncio.current_task():
            t.cancel()
    assert run in done, f"until_stopped still waiting 5 s after the stop ({cancels} cancel(s) reached the start)"
    assert run.result() is None and cancels == 2
