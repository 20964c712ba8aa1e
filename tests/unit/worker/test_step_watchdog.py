"""The worker's step watchdog (``services/worker/watchdog.py``, ``--watchdog-timeout-s``).

A forward that hangs without raising (a stuck CUDA kernel) left the node heartbeating and routed
forever. Here a fake step blocks on an ``Event`` in a thread of its own (as the torch engine's
execute thread): the watchdog, on its own thread, reports it once past the timeout with the step's
requests and the hung thread's stack, then ends the process (an exit recorder in place of
``os._exit``) at once when the service says it has stopped, or after its grace when it never does.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.worker.plan import IterationPlan, PrefillChunk
from services.worker.watchdog import EXIT_CODE, LoopBlocked, StepHung, StepInfo, StepWatchdog, overdue

TIMEOUT = 0.3


def plan() -> IterationPlan:
    return IterationPlan(
        start=0.0, iterations=2, iteration_s=0.01, end=0.02,
        prefill=[PrefillChunk(rid="r-pre", tokens=96, cached_before=0, restored=0, completes=True)],
        decode=["r-dec1", "r-dec2"], prefill_s=0.0, decode_s=0.0, sum_uncached=96, sum_qk_pairs=0, sum_restored=0,
        sum_cached=0, reqs=[], admitted=["r-pre"],
    )  # fmt: skip


class Recorder:
    def __init__(self) -> None:
        self.hangs: list[tuple[StepHung | LoopBlocked, str, float]] = []
        self.exits: list[tuple[int, float]] = []
        self.exited = threading.Event()

    def on_hang(self, e: StepHung | LoopBlocked, stacks: str) -> None:
        self.hangs.append((e, stacks, time.monotonic()))

    def exit(self, code: int) -> None:
        self.exits.append((code, time.monotonic()))
        self.exited.set()


def forward_stuck_in_a_kernel(release: threading.Event) -> None:
    release.wait()


@pytest.mark.parametrize("ready", [True, False], ids=["service stopped", "loop wedged: grace"])
def test_a_hung_step_is_reported_with_its_requests_and_stacks_then_the_process_exits(ready):
    rec = Recorder()
    wd = StepWatchdog(TIMEOUT, rec.on_hang, grace_s=0.5, exit=rec.exit)
    release = threading.Event()
    hung = threading.Thread(target=forward_stuck_in_a_kernel, args=(release,), name="asyncio_0", daemon=True)
    wd.start()
    try:
        t0 = time.monotonic()
        wd.begin(StepInfo.of(plan(), 7))
        hung.start()
        if ready:  # the service stops as soon as it is told (its last messages out): exit at once
            while not rec.hangs and time.monotonic() - t0 < 5:
                time.sleep(0.01)
            wd.exit_ready()
        assert rec.exited.wait(5.0), "the watchdog did not end the process"
    finally:
        release.set()
        wd.stop()
    [(e, stacks, at)] = rec.hangs
    [(code, exited_at)] = rec.exits
    assert code == EXIT_CODE == 1
    assert TIMEOUT <= at - t0 <= TIMEOUT + 0.5, at - t0  # polls every timeout/8
    assert e.info.seq == 7 and e.info.rids == ("r-pre", "r-dec1", "r-dec2")
    assert (e.info.prefill_tokens, e.info.decode_rows, e.info.iterations) == (96, 2, 2)
    assert "engine step 7 (3 requests, 96 prefill tokens, 2 decode rows × 2 iterations)" in str(e)
    assert "forward_stuck_in_a_kernel" in stacks and "Thread 0x" in stacks, stacks  # the hung thread's frame
    waited = exited_at - at
    assert (waited < 0.3) if ready else (0.45 <= waited < 1.5), waited
    assert wd.fired is e


def test_steps_that_end_in_time_never_fire_and_a_stopped_watchdog_never_exits():
    rec = Recorder()
    wd = StepWatchdog(TIMEOUT, rec.on_hang, grace_s=0.1, exit=rec.exit)
    wd.start()
    info = StepInfo.of(plan(), 1)
    deadline = time.monotonic() + 3 * TIMEOUT
    while time.monotonic() < deadline:  # many steps, each well under the timeout
        wd.begin(info)
        assert wd.running_s() < TIMEOUT
        time.sleep(TIMEOUT / 4)
        wd.end()
        assert wd.running_s() == 0.0
    time.sleep(2 * TIMEOUT)  # idle between steps is not a step
    wd.stop()
    time.sleep(0.2)
    assert not rec.hangs and not rec.exits and wd.fired is None


def test_overdue_and_bad_settings():
    assert not overdue(None, 100.0, 1.0)
    assert not overdue(10.0, 11.0, 1.0) and overdue(10.0, 11.01, 1.0)
    with pytest.raises(ValueError, match="positive"):
        StepWatchdog(0.0, lambda e, s: None)


def handler_blocking_the_loop(release: threading.Event) -> None:
    release.wait(10.0)  # a synchronous call that does not return (on the loop's thread)


def test_a_loop_blocked_outside_a_step_is_reported_with_its_stacks_then_the_process_exits():
    """No step in flight, a handler blocks the event loop (a real loop, in a thread of its own as
    the worker's main thread): before, only steps were watched, so the process lived on."""
    rec = Recorder()
    release = threading.Event()
    wd = StepWatchdog(TIMEOUT, rec.on_hang, grace_s=0.2, exit=lambda code: (rec.exit(code), release.set()))
    blocked_at: list[float] = []

    async def serve() -> None:
        wd.start(asyncio.get_running_loop())
        for _ in range(3):  # steps that end in time, then an idle loop: not hangs
            wd.begin(StepInfo.of(plan(), 1))
            await asyncio.sleep(TIMEOUT / 3)
            wd.end()
        await asyncio.sleep(2 * TIMEOUT)
        assert not rec.hangs
        blocked_at.append(time.monotonic())
        handler_blocking_the_loop(release)

    loop_thread = threading.Thread(target=asyncio.run, args=(serve(),), name="loop", daemon=True)
    loop_thread.start()
    try:
        assert rec.exited.wait(5.0), "the watchdog did not end the process"
    finally:
        release.set()
        wd.stop()
        loop_thread.join(5.0)
    [(e, stacks, at)] = rec.hangs
    assert isinstance(e, LoopBlocked) and wd.fired is e and rec.exits[0][0] == EXIT_CODE
    assert TIMEOUT - wd.poll_s <= at - blocked_at[0] <= TIMEOUT + 0.5, at - blocked_at[0]  # its last tick: up to a poll before
    assert e.elapsed_s > TIMEOUT and "event loop has run nothing" in str(e)
    assert "handler_blocking_the_loop" in stacks, stacks


def test_a_loop_not_running_is_not_blocked():
    """A loop stopped between runs (or never run) runs no tick, and is not a hang."""
    rec = Recorder()
    loop = asyncio.new_event_loop()
    wd = StepWatchdog(TIMEOUT, rec.on_hang, grace_s=0.1, exit=rec.exit)
    try:
        wd.start(loop)
        time.sleep(3 * TIMEOUT)
        assert wd.loop_idle_s() == 0.0
    finally:
        wd.stop()
        loop.close()
    assert not rec.hangs and not rec.exits


def test_a_hang_is_reported_with_stacks_where_no_temporary_file_can_be_made(tmp_path, monkeypatch):
    """A read-only root file system without a writable /tmp (a hardened container): faulthandler's
    temporary file cannot be made. Before, that OSError skipped ``on_hang`` (no error line, no stop,
    the node still said accepting) and the process only exited after the grace."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-dir"))
    rec = Recorder()
    wd = StepWatchdog(TIMEOUT, rec.on_hang, grace_s=0.2, exit=rec.exit)
    release = threading.Event()
    hung = threading.Thread(target=forward_stuck_in_a_kernel, args=(release,), daemon=True)
    wd.start()
    try:
        wd.begin(StepInfo.of(plan(), 1))
        hung.start()
        assert rec.exited.wait(5.0), "the watchdog did not end the process"
    finally:
        release.set()
        wd.stop()
    [(e, stacks, _)] = rec.hangs
    assert e.info.seq == 1
    assert "forward_stuck_in_a_kernel" in stacks and "Thread 0x" in stacks and "temporary file" in stacks, stacks
