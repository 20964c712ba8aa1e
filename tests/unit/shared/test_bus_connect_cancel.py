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


@pytest.mark.timeout(60)
async def test_until_stopped_lets_a_cancelled_start_finish_its_clean_up():
    """A start whose cancel was delivered runs its clean-up to its end (``RouterService.start``'s ``await
    self.stop()``, ``Bus.connect``'s close of the abandoned client, ``LocalCluster.start``'s stop of what it
    started): ``until_stopped`` cancels again only after its grace. Before, the re-cancel every 0.05 s (0277de5)
    cut a 0.2-s clean-up short at 0.05 s; with one cancel (before 0277de5) it finished."""
    from shared.service import until_stopped

    cleaned: list[str] = []

    async def start_with_a_clean_up():
        try:
            await asyncio.sleep(3600)
        except BaseException:
            cleaned.append("begun")
            await asyncio.sleep(0.2)  # e.g. a service's stop after a half-done start
            cleaned.append("done")
            raise

    stop = asyncio.Event()
    run = asyncio.ensure_future(until_stopped(start_with_a_clean_up(), stop))
    await asyncio.sleep(0.1)
    stop.set()
    done, _ = await asyncio.wait({run}, timeout=5)
    assert run in done and run.result() is None
    assert cleaned == ["begun", "done"], cleaned


@pytest.mark.timeout(60)
async def test_until_stopped_cancels_again_a_clean_up_past_its_grace():
    """The grace is a bound: a start still running ``grace_s`` after the cancel is cancelled again until it ends."""
    from shared.service import until_stopped

    loop = asyncio.get_running_loop()
    cancels = 0

    async def start_with_an_endless_clean_up():
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise

    stop = asyncio.Event()
    run = asyncio.ensure_future(until_stopped(start_with_an_endless_clean_up(), stop, grace_s=0.3))
    await asyncio.sleep(0.05)
    stop.set()
    t0 = loop.time()
    done, _ = await asyncio.wait({run}, timeout=5)
    assert run in done and run.result() is None and cancels == 2
    assert 0.25 <= loop.time() - t0 < 3.0, loop.time() - t0  # the second cancel waited for the grace


async def test_until_stopped_refuses_a_negative_grace():
    from shared.service import until_stopped

    async def start():
        return 1

    with pytest.raises(ValueError, match="grace_s"):
        await until_stopped(start(), asyncio.Event(), grace_s=-1.0)
    with pytest.raises(ValueError, match="grace_s"):
        await until_stopped(start(), asyncio.Event(), grace_s=float("nan"))


@pytest.mark.timeout(60)
async def test_until_stopped_cancelled_while_stopping_waits_for_the_clean_up_then_raises():
    """until_stopped's own cancel during the start's clean-up does not cut that clean-up short; it is raised once
    the start has ended (shared.cancel.cancel_until_done's rule: not swallowed)."""
    from shared.service import until_stopped

    cleaned: list[str] = []

    async def start_with_a_clean_up():
        try:
            await asyncio.sleep(3600)
        except BaseException:
            await asyncio.sleep(0.3)
            cleaned.append("done")
            raise

    stop = asyncio.Event()
    run = asyncio.ensure_future(until_stopped(start_with_a_clean_up(), stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.sleep(0.1)  # the start is cleaning up
    run.cancel()
    done, _ = await asyncio.wait({run}, timeout=5)
    assert run in done and run.cancelled()
    assert cleaned == ["done"]


async def test_until_stopped_discards_a_start_that_finished_despite_its_cancel():
    """A start whose one cancel was lost and that then finished: its result goes to ``discard`` (what it started
    is stopped) and None is returned. Before, the result was dropped with nothing stopped (/tmp/rr-h/a2.py)."""
    from shared.service import until_stopped

    discarded: list[object] = []

    async def start_that_loses_its_cancel():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # the cancel a nats-py wait_for swallowed
        await asyncio.sleep(0.1)
        return "cluster"

    async def discard(result):
        discarded.append(result)

    stop = asyncio.Event()
    run = asyncio.ensure_future(until_stopped(start_that_loses_its_cancel(), stop, grace_s=5, discard=discard))
    await asyncio.sleep(0.05)
    stop.set()
    assert await asyncio.wait_for(run, 5) is None
    assert discarded == ["cluster"]


async def test_until_stopped_reraises_the_callers_cancel_with_its_message():
    from shared.service import until_stopped

    async def start_with_a_clean_up():
        try:
            await asyncio.sleep(3600)
        except BaseException:
            await asyncio.sleep(0.2)
            raise

    raised: list[tuple] = []

    async def caller(stop):
        try:
            await until_stopped(start_with_a_clean_up(), stop)
        except asyncio.CancelledError as e:  # what until_stopped raised, as its caller sees it
            raised.append(e.args)
            raise

    stop = asyncio.Event()
    run = asyncio.ensure_future(caller(stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.sleep(0.05)
    run.cancel("second signal")
    await asyncio.wait({run}, timeout=5)
    assert run.cancelled()
    assert raised == [("second signal",)]
