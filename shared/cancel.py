"""Cancelling tasks so that they end, when one cancel can be lost.

Python 3.11's ``asyncio.wait_for`` answers a cancel that comes in the loop turn its inner future finished with that
future's outcome (a reply, a refusal, a timeout), not with ``CancelledError``: nats-py runs its requests, flushes,
JetStream calls and connect attempts in ``wait_for``, so a task cancelled at that moment goes on (its retry loop, its
``while True``), and whoever cancelled it once and then awaited it without bound waited forever (a service's connect
during the Slurm job's stop, 0277de5; a background loop at a service's stop). :func:`cancel_until_done` cancels again
every ``every_s`` until the tasks end: a lost cancel is followed by one that lands at the task's next await.

Its users: ``BackgroundTasks.stop`` (router, planner, KV directory), ``Bus.close``, the worker's stop and
``Bus.connect``'s abandon (ABANDON_S limit) cancel every ``CANCEL_EVERY_S`` from the first cancel on;
``shared.service.until_stopped`` first lets a cancelled start run its clean-up for a grace (``STOP_GRACE_S``, 3 s,
for a service; ``CLUSTER_STOP_GRACE_S``, 15 s, for ``up`` and ``demo``) and only then cancels it every 0.05 s here.
Being cancelled again, a task's clean-up on cancellation (its ``except CancelledError``/``finally`` awaits) is cut
short at its first await past 0.05 s: the tasks stopped here have no such clean-up today; one that gets one must be
stopped with a grace first, as until_stopped does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

CANCEL_EVERY_S = 0.05
"""Seconds between the cancels of :func:`cancel_until_done` (a lost cancel costs at most this much; a clean-up on
cancellation longer than this is cut short). ``until_stopped`` starts these cancels only after its grace (module
docstring)."""


async def cancel_until_done(
    tasks: Iterable[asyncio.Future[Any]], *, every_s: float = CANCEL_EVERY_S, limit_s: float | None = None,
    grace_s: float = 0.0,
) -> set[asyncio.Future[Any]]:
    """Cancel ``tasks`` and wait until each has ended, cancelling those still running again every ``every_s``
    seconds (one cancel can be lost: module docstring), the first time ``grace_s`` after the first cancel. Each
    ended task's outcome (its exception, a cancel) is retrieved and dropped: the caller is stopping them.

    A cancel of the caller itself while it waits does not stop the wait (the tasks are cancelled all the same, and
    they must end first: the caller's cancel is stopping anyway); it is raised once they have ended (or ``limit_s``
    passed), so it is not lost here either.

    Args:
        tasks: the tasks (futures) to end; ones already done are only retrieved.
        every_s: seconds between cancels (positive).
        limit_s: give up after this many seconds (None: wait until all ended); each task is cancelled at least
            once even when it is 0 or less.
        grace_s: seconds the tasks may take to end after the first cancel (their clean-up on cancellation runs to
            its end) before they are cancelled again (>= 0; ``until_stopped``'s grace).

    Returns:
        The tasks still running when ``limit_s`` passed (empty when all ended).

    Raises:
        ValueError: ``every_s`` not positive, or ``grace_s`` negative.
        asyncio.CancelledError: the caller was cancelled meanwhile (after the wait).
    """
    if not every_s > 0:
        raise ValueError(f"every_s must be positive seconds, got {every_s!r}")
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be seconds >= 0, got {grace_s!r}")
    every = list(tasks)
    pending = set(every)
    deadline = None if limit_s is None else time.monotonic() + limit_s
    caller_cancel: asyncio.CancelledError | None = None
    first = True
    while True:
        pending = {t for t in pending if not t.done()}
        # each task is cancelled at least once, whatever limit_s (one <= 0: one cancel, one loop turn to end in)
        if not pending or (not first and deadline is not None and time.monotonic() >= deadline):
            break
        for t in pending:
            t.cancel()
        until = time.monotonic() + (grace_s if first else every_s)
        if deadline is not None:
            until = min(until, deadline)
        first = False
        # the wait to the next cancel (one loop turn at least, for the cancel to land): the tasks ending end it
        # sooner; a cancel of the caller does not (below)
        while True:
            try:
                await asyncio.wait(pending, timeout=max(0.0, until - time.monotonic()))
            except asyncio.CancelledError as e:
                caller_cancel = e
            pending = {t for t in pending if not t.done()}
            if not pending or time.monotonic() >= until:
                break
    for t in every:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: no "exception was never retrieved" at garbage collection
    if caller_cancel is not None:
        raise caller_cancel  # the caller's own, its message kept
    return pending


def raise_if_cancel_lost() -> None:
    """Raise ``CancelledError`` in a task that was cancelled and goes on all the same: a cancel lost in a
    ``wait_for`` (module docstring) leaves the task's :meth:`asyncio.Task.cancelling` above 0 (``wait_for`` does
    not uncancel it). For a retry loop whose one cancel is all that ends it (a task cancelled once, then not
    awaited): called at the top of each round, the round after a lost cancel raises it. No-op outside a task.

    Raises:
        asyncio.CancelledError: the running task was cancelled and has not ended."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        raise asyncio.CancelledError()
