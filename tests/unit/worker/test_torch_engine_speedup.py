"""The torch engine's durations are cluster seconds: at ``--speedup N`` the measured wall time x N.

``TorchEngine.execute`` returned the wall seconds of its forwards, and the worker shell took them as
cluster seconds (the clock that runs ``--speedup`` x wall): at ``--speedup 50`` a prefill
``IterationRecord`` read 4.4 ms against a 261-ms node TTFT, and the planner's Eq. 1/2 fits read
those records. The engine the worker makes (``make_torch_engine``) now scales what it measures
by the speed-up; at speed-up 1 nothing changes. Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("torch")

from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.engines.torch_engine.engine import TorchEngine  # noqa: E402
from services.worker.scheduler import EngineScheduler  # noqa: E402
from services.worker.service import make_torch_engine  # noqa: E402
from tests.unit.worker import torch_tiny  # noqa: E402
from tests.unit.worker.torch_tiny import PROFILE  # noqa: E402

TICK = 0.003
"""Seconds the test's engine clock moves at each reading: every plan measures exactly this."""


def _records(engine, n: int = 4) -> list:
    """Serve one request of ``n`` output tokens on ``engine`` (as ``LocalNode`` drives it); its iteration records."""
    core = EngineScheduler("w0", PROFILE, "both", check_invariants=True)

    def drain() -> None:
        engine.on_kv_events(core.take_kv_events(), core.requests, core.snapshot)

    w = torch_tiny.work("r0", torch_tiny.prompt(1), n=n)
    engine.accept_prefill(w)
    core.add_prefill(w, 0.0)
    now, records = 0.0, []
    while (plan := core.schedule(now)) is not None:
        drain()
        engine.execute(plan)
        now = plan.end
        core.finish_iteration(plan, now, engine.take_stopped())
        records.extend(core.take_records())
        drain()
    return records


@pytest.mark.parametrize("speedup", [20.0, 1.0])
def test_records_of_the_workers_torch_engine_are_the_measured_time_times_the_speedup(tiny_llama, speedup):
    cfg = WorkerConfig(engine="torch", model=tiny_llama, profile="torch-tiny-cpu", speedup=speedup)
    engine = make_torch_engine(cfg, PROFILE)
    engine.clock = itertools.count(0.0, TICK).__next__  # type: ignore[attr-defined]  # each execute measures TICK
    records = _records(engine)
    assert {r.phase for r in records} >= {"prefill", "decode"}, records
    for r in records:
        assert r.duration_s * r.repeat == pytest.approx(TICK * speedup), r
    # the shell's own clock wins over the config's (the worker passes its SimClock's speedup)
    assert make_torch_engine(cfg, PROFILE, 7.0).speedup == 7.0  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_speedup_no_clock_has_is_refused_before_the_model_loads(bad):
    with pytest.raises(ValueError, match="speedup must be a positive finite number"):
        TorchEngine(PROFILE, "/nonexistent", speedup=bad)
