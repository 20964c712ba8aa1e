"""The worker's step watchdog (``services/worker/watchdog.py``, ``--watchdog-timeout-s``).

A forward that hangs without raising (a stuck CUDA kernel) left the node heartbeating and routed
forever. Here a fake step blocks on an ``Event`` in a thread of its own (as the torch engine's
execute thread): the watchdog, on its own thread, reports it once past the timeout with the step's
requests and the hung thread's stack, then ends the process (an exit recorder in place of
``os._exit``) at once when the service says it has stopped, or after its grace when it never does.
"""

from __future__ import annotations

import threading
import time

import pytest

from services.worker.plan import IterationPlan, PrefillChunk
from services.worker.watchdog import EXIT_CODE, StepHung, StepInfo, StepWatchdog, overdue

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
        self.hangs: list[tuple[StepHung, str, float]] = []
        self.exits: list[tuple[int, float]] = []
        self.exited = threading.Event()

    def on_hang(self, e: StepHung, stacks: str) -> None:
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
