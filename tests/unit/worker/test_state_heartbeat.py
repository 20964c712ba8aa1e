"""The worker's ``node.state`` heartbeat (``WorkerService._state_heartbeat``) under the services' loop.

uvloop (``shared.service``) rounds a sleep to whole ms from its cached ms clock, so a sleep until
the next heartbeat woke up to ~1 ms early and the loop went round without waiting (a sleep under
0.5 ms is no wait there) until the heartbeat was due: a spin of up to ~1 ms per heartbeat (commit
4c88d96 found the same in the worker's count sync).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import structlog


class _HeartbeatShell:
    """What ``WorkerService._state_heartbeat`` touches; counts the loop's passes (reads of
    ``_last_state_mono``) and stops the loop after ``beats`` states."""

    def __init__(self, interval: float, beats: int) -> None:
        self.cfg = SimpleNamespace(idle_state_interval_s=interval)
        self.clock = SimpleNamespace(now=lambda: 0.0, local_now=lambda: 0.0)
        self.log = structlog.get_logger()
        self.reads = 0
        self._last = time.monotonic()
        self.sent: list[tuple[float, float]] = []
        """(when due, when sent) per state, monotonic s."""
        self.beats = beats
        self.done = asyncio.Event()

    @property
    def _last_state_mono(self) -> float:
        self.reads += 1
        return self._last

    def _check_reconnect(self) -> None:
        pass

    async def _publish_state(self, now: float) -> None:
        t = time.monotonic()
        self.sent.append((self._last + self.cfg.idle_state_interval_s, t))
        self._last = t
        if len(self.sent) == self.beats:
            self.done.set()
            await asyncio.Event().wait()  # the test cancels the loop here


@pytest.mark.parametrize("interval", [0.0022, 0.0302, 0.1003])
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_state_heartbeat_waits_for_each_beat_without_spinning(loop, interval):
    """Each heartbeat goes out when due (not before), after one pass that waits and one that
    sends: at most 2 passes per beat. Before the fix uvloop went round once per early wake."""
    from services.worker.service import WorkerService

    run = pytest.importorskip("uvloop").run if loop == "uvloop" else asyncio.run
    beats = 8

    async def heartbeat() -> _HeartbeatShell:
        shell = _HeartbeatShell(interval, beats)
        task = asyncio.create_task(WorkerService._state_heartbeat(shell))  # type: ignore[arg-type]
        await shell.done.wait()
        task.cancel()
        return shell

    shell = run(heartbeat())
    assert len(shell.sent) == beats and all(t >= due for due, t in shell.sent), shell.sent
    assert shell.reads <= 2 * beats, (shell.reads, beats)


@pytest.mark.parametrize("step_s", [-3600.0, 3600.0])
def test_the_heartbeat_keeps_its_beat_when_the_wall_clock_steps(monkeypatch, step_s):
    """The wall clock stepped (NTP, an admin) by an hour: the heartbeat still beats every interval.
    It counted from ``time.time()``: stepped back, no state went out for an hour (an idle worker
    then looks dead to a router on another host, and a busy one's states stopped too)."""
    from services.worker.service import WorkerService

    interval, beats = 0.02, 6

    async def heartbeat() -> _HeartbeatShell:
        shell = _HeartbeatShell(interval, beats)
        task = asyncio.create_task(WorkerService._state_heartbeat(shell))  # type: ignore[arg-type]
        while len(shell.sent) < 2:
            await asyncio.sleep(0.001)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + step_s)
        try:
            await asyncio.wait_for(shell.done.wait(), 2.0)
        finally:
            task.cancel()
        return shell

    shell = pytest.importorskip("uvloop").run(heartbeat())
    gaps = [b[1] - a[1] for a, b in zip(shell.sent, shell.sent[1:])]
    assert len(shell.sent) == beats and max(gaps) < 0.5, gaps


@pytest.mark.parametrize(("counts", "interval", "since", "due"), [
    ((1, 0, 1), 1.0, 0.25, 0.75),  # decoding: due an interval after the last batch
    ((0, 2, 0), 1.0, 3.0, 0.0),  # its work waits (for its KV): overdue, at once
    ((0, 0, 0), 1.0, 3.0, None),  # idle: none
    ((1, 1, 0), float("inf"), 3.0, None),  # EI_KV_ALIVE_INTERVAL_S=inf: never (no infinite timer for the step loop)
])  # fmt: skip
def test_when_the_next_alive_kv_batch_is_due(counts, interval, since, due):
    """``WorkerService._alive_due_s``: the step loop's idle wait ends then, so a node whose work all waits still
    sends its alive batch (``tests/integration/test_worker_live.py`` shows it live)."""
    from services.worker.service import WorkerService

    now = time.monotonic()
    shell = SimpleNamespace(_last_state_counts=counts, _last_kv_mono=now - since, cfg=SimpleNamespace(kv_alive_interval_s=interval))
    got = WorkerService._alive_due_s(shell)  # type: ignore[arg-type]
    assert got == due if due is None or due == 0.0 else got == pytest.approx(due, abs=0.05)


@pytest.mark.parametrize(("text", "taken"), [("0.001", None), ("0.0099", None), ("0", None), ("0.01", 0.01), ("1", 1.0),
                                             ("inf", float("inf"))])  # fmt: skip
def test_an_alive_interval_below_the_step_loops_early_margin_is_refused(text, taken):
    """``--kv-alive-interval-s`` at least 0.01 s: below ``ALIVE_EARLY_S`` (2 ms) every pass of the step loop found the
    alive batch due (``_flush_kv`` sends it that early), so 0.001 (which ``gt=0`` took) published ~1,000 a second."""
    from services.worker.config import WorkerConfig
    from services.worker.service import ALIVE_EARLY_S
    from shared.config import ConfigError, resolve_config

    assert 0.01 >= 5 * ALIVE_EARLY_S
    if taken is None:
        with pytest.raises(ConfigError, match=r"Expected `float` >= 0.01 - at `\$.kv_alive_interval_s`"):
            resolve_config(WorkerConfig, {}, env={"EI_KV_ALIVE_INTERVAL_S": text})
    else:
        assert resolve_config(WorkerConfig, {}, env={"EI_KV_ALIVE_INTERVAL_S": text}).kv_alive_interval_s == taken
