"""A service's stop ends its background loops even when a loop loses its cancel.

Python 3.11's ``asyncio.wait_for`` (nats-py's request, flush, JetStream calls run in one) answers a cancel that comes
in the loop turn its inner future finished with that future's outcome, not ``CancelledError``: a loop cancelled as its
request's reply came (a kvdirectory resync, a worker's requeue, the bus's stream lookups, any ``while True`` over a
nats-py call) goes on round after round. The stops cancelled each task once and then awaited it without bound:
``BackgroundTasks.stop`` (router, planner, KV directory), ``Bus.close`` (heartbeats, reconnect checks) and the
worker's ``stop`` waited forever, and the process outlived its SIGTERM. 0277de5 found the same loss in
``Bus.connect``; these cases are the stop side of it. Here the reply and the cancel are put in one turn on purpose:
the reply is set, and the stop called, before the loop runs again.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import structlog

from shared.cancel import cancel_until_done


class LossyLoop:
    """A loop over a request made with ``asyncio.wait_for`` (as nats-py's), whose reply is answered by the test
    (:meth:`reply`): the cancel that the stop sends in that same turn is lost, and the loop goes on."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.reply_to: asyncio.Future | None = None
        self.rounds = 0

    async def run(self) -> None:
        while True:
            self.reply_to = asyncio.get_running_loop().create_future()
            self.waiting.set()
            await asyncio.wait_for(self.reply_to, 3600)  # nats-py's request
            self.waiting.clear()
            self.rounds += 1
            await asyncio.sleep(0.01)  # the next round

    async def reply_with(self, stop) -> asyncio.Task:
        """Wait until the loop waits for a reply; then answer it and start ``stop()`` in one turn."""
        await self.waiting.wait()
        assert self.reply_to is not None
        self.reply_to.set_result(b"reply")
        stopping = asyncio.ensure_future(stop())
        await asyncio.sleep(0)
        return stopping


async def _ends(stopping: asyncio.Future, loop: LossyLoop, what: str) -> None:
    done, _ = await asyncio.wait({stopping}, timeout=5)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    for t in leftover:  # before the fix: the loop, going on, and the stop awaiting it
        t.cancel()
    assert stopping in done, f"{what} still waiting 5 s after the stop ({loop.rounds} rounds after the lost cancel)"
    stopping.result()


async def test_a_cancel_in_the_turn_of_a_reply_is_lost_on_this_python():
    """The premise (Python 3.11's wait_for): if this fails, the Python in use no longer loses such a cancel."""
    loop = LossyLoop()
    task = asyncio.ensure_future(loop.run())

    async def cancel_once() -> None:
        task.cancel()

    await loop.reply_with(cancel_once)
    await asyncio.sleep(0.1)
    lost = not task.done()
    task.cancel()
    await asyncio.wait({task}, timeout=1)
    if not lost:
        pytest.skip("this Python's asyncio.wait_for does not lose a cancel that comes with the reply")
    assert loop.rounds >= 1


@pytest.mark.timeout(60)
async def test_background_tasks_stop_ends_a_loop_that_lost_its_cancel():
    from shared.service import BackgroundTasks

    bg = BackgroundTasks(structlog.get_logger("test"), Counter())
    loop = LossyLoop()
    bg.start(loop.run(), name="lossy-loop")
    stopping = await loop.reply_with(bg.stop)
    await _ends(stopping, loop, "BackgroundTasks.stop")
    assert not bg.fatal.is_set()


@pytest.mark.timeout(60)
async def test_bus_close_ends_a_task_that_lost_its_cancel():
    from nats.aio.client import Client as NatsClient

    from shared.bus import Bus
    from shared.subjects import Subjects

    bus = Bus(NatsClient(), Subjects("p0"), service="router", instance="router")
    loop = LossyLoop()
    bus._tasks.append(asyncio.ensure_future(loop.run()))
    stopping = await loop.reply_with(bus.close)
    await _ends(stopping, loop, "Bus.close")


@pytest.mark.timeout(60)
async def test_worker_stop_ends_a_task_that_lost_its_cancel():
    from services.worker.service import WorkerService

    worker = object.__new__(WorkerService)  # only what stop() reads before its final publishes
    worker.accepting = True
    worker._stopped = False
    worker.watchdog = None
    worker.kvpool = None
    worker._executor = None
    worker.fatal_error = None
    worker._binds, worker._handing_off, worker._spawned = {}, {}, set()
    worker._kv_timer = None
    worker.log = structlog.get_logger("test")

    async def no_publish(*_a, **_k) -> None:
        return None

    worker._flush_iters = no_publish
    worker._publish_state = no_publish
    worker._publish_kv = no_publish
    worker.kv_seq = 0
    worker.clock = type("Clock", (), {"local_now": staticmethod(lambda: 0.0)})()
    loop = LossyLoop()
    worker._tasks = [asyncio.ensure_future(loop.run())]
    stopping = await loop.reply_with(worker.stop)
    await _ends(stopping, loop, "WorkerService.stop")


@pytest.mark.timeout(60)
async def test_cancel_until_done_ends_what_one_cancel_does_not():
    loop = LossyLoop()
    task = asyncio.ensure_future(loop.run())
    stopping = await loop.reply_with(lambda: cancel_until_done([task]))
    await _ends(stopping, loop, "cancel_until_done")
    assert task.cancelled()


@pytest.mark.timeout(60)
async def test_cancel_until_done_gives_up_at_its_limit_and_keeps_the_callers_cancel():
    deafness = True

    async def deaf() -> None:  # does not end on a cancel while deafness lasts
        while deafness:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    task = asyncio.ensure_future(deaf())
    await asyncio.sleep(0)
    left = await cancel_until_done([task], limit_s=0.2)
    assert left == {task}

    waiting = asyncio.ensure_future(cancel_until_done([task], limit_s=0.3))
    await asyncio.sleep(0.05)
    waiting.cancel()  # the caller's own cancel: the wait goes on, then the cancel is raised
    done, _ = await asyncio.wait({waiting}, timeout=5)
    assert waiting in done and waiting.cancelled()
    with pytest.raises(ValueError):
        await cancel_until_done([task], every_s=0)
    deafness = False
    assert await cancel_until_done([task], limit_s=5) == set()


class _RecordingNats:
    """nats-py's client as ``Bus.close`` uses it: no subscriptions (``_subs``) to drain, its ``flush`` (what was
    published goes out) and ``close`` recorded, ``is_connected`` and ``pending_data_size`` read."""

    def __init__(self) -> None:
        self.is_closed = False
        self.is_connected = True
        self.pending_data_size = 0
        self._subs: dict[int, object] = {}
        self.calls: list[str] = []

    async def flush(self, timeout: float) -> None:
        self.calls.append("flush")

    async def close(self) -> None:
        self.calls.append("close")
        self.is_closed = True


@pytest.mark.timeout(60)
async def test_bus_close_cancelled_while_its_tasks_end_still_closes_the_connection():
    """The caller's cancel while a task's clean-up runs: before, it escaped close() before the drain and nc.close()
    (the connection left open); now the connection is drained (flushed) and closed, then the cancel is raised."""
    from shared.bus import Bus
    from shared.subjects import Subjects

    nc = _RecordingNats()
    bus = Bus(nc, Subjects("p0"), service="router", instance="router")  # type: ignore[arg-type]

    async def slow_to_end() -> None:  # deaf to cancels for 0.3 s (cancel_until_done cancels it every 0.05 s)
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.3
        while loop.time() < until:
            try:
                await asyncio.sleep(until - loop.time())
            except asyncio.CancelledError:
                pass

    bus._tasks.append(asyncio.ensure_future(slow_to_end()))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(bus.close())
    await asyncio.sleep(0.1)
    closing.cancel()
    done, _ = await asyncio.wait({closing}, timeout=5)
    assert closing in done and closing.cancelled()
    assert nc.calls == ["flush", "close"] and nc.is_closed


@pytest.mark.timeout(60)
async def test_bus_close_cancels_a_task_added_while_it_waits():
    """A bus-reconnect task added (reconnected_cb) while close() waits for the tasks it had: before, it was cleared
    from the list still running, never cancelled; now it is cancelled and ended too."""
    from shared.bus import Bus
    from shared.subjects import Subjects

    nc = _RecordingNats()
    bus = Bus(nc, Subjects("p0"), service="router", instance="router")  # type: ignore[arg-type]
    added: list[asyncio.Task] = []

    async def after_reconnect() -> None:
        await asyncio.sleep(3600)

    async def heartbeat() -> None:
        try:
            await asyncio.sleep(3600)
        finally:  # the reconnect came while this task ended
            added.append(asyncio.ensure_future(after_reconnect()))
            bus._tasks.append(added[-1])
            await asyncio.sleep(0.1)

    bus._tasks.append(asyncio.ensure_future(heartbeat()))
    await asyncio.sleep(0)
    await asyncio.wait_for(bus.close(), 5)
    assert len(added) == 1
    done = added[0].done()
    added[0].cancel()
    assert done, "the task added during close() is still running after it"
    assert bus._tasks == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit_s", [0.0, -1.0])
async def test_cancel_until_done_cancels_at_least_once_whatever_its_limit(limit_s):
    """limit_s <= 0: before, the loop gave up before its first cancel and the tasks were never cancelled."""
    task = asyncio.ensure_future(asyncio.sleep(3600))
    await asyncio.sleep(0)
    left = await cancel_until_done([task], limit_s=limit_s)
    await asyncio.sleep(0)
    ended = task.done()
    task.cancel()
    assert ended and task.cancelled(), f"not cancelled (left: {left})"


@pytest.mark.timeout(60)
async def test_cancel_until_done_raises_the_callers_own_cancel():
    """The caller's cancel is raised after the wait as it came (its message kept), not as a fresh CancelledError."""
    raised: list[tuple] = []

    async def slow() -> None:  # deaf to cancels for 0.2 s
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.2
        while loop.time() < until:
            try:
                await asyncio.sleep(until - loop.time())
            except asyncio.CancelledError:
                pass

    async def caller(task) -> None:
        try:
            await cancel_until_done([task])
        except asyncio.CancelledError as e:
            raised.append(e.args)
            raise

    task = asyncio.ensure_future(slow())
    waiting = asyncio.ensure_future(caller(task))
    await asyncio.sleep(0.05)
    waiting.cancel("stop now")
    await asyncio.wait({waiting}, timeout=5)
    assert waiting.cancelled() and task.done()
    assert raised == [("stop now",)]
