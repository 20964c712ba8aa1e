"""``simulate(..., leave_for_exit=True)`` (``evolving-infra simulate``): the partition's ``ClusterSim`` is
left as cyclic garbage when its run returns, not freed object by object, and a collection frees it; the
report is the same either way."""

from __future__ import annotations

import gc
import weakref

import pytest

import evolving_infra.sim.run as sim_run
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import simulate

from .conftest import BS, small_trace, strip_wall


@pytest.fixture
def made(monkeypatch) -> list[weakref.ref]:
    """Weak references to every ``ClusterSim`` the runs make."""
    refs: list[weakref.ref] = []

    class Watched(sim_run.ClusterSim):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            refs.append(weakref.ref(self))

    monkeypatch.setattr(sim_run, "ClusterSim", Watched)
    return refs


@pytest.mark.parametrize("partitions", [1, 2])
def test_leave_for_exit_keeps_the_run_until_a_collection_and_changes_no_output(made, partitions) -> None:
    reqs = small_trace(8, 6, pause=0.05)
    cfg = SimConfig(nodes=4, profile="tiny", policy="arrow", concurrency=5, seed=3, partitions=partitions,
                    planner_options={"interval_s": 0.02})
    was = gc.isenabled()
    gc.disable()  # as evolving-infra simulate runs it (cli.GC_PAUSED_COMMANDS)
    try:
        plain = simulate(cfg, reqs, BS)
        assert len(made) == partitions and all(r() is None for r in made), "freed when its partition returns"
        made.clear()
        left = simulate(cfg, reqs, BS, leave_for_exit=True)
        # only the last partition is left: an earlier one, left too, would be held through the next one's
        # loop (its quiet_gc freezes the garbage), peak memory the sum of the partitions
        assert len(made) == partitions and made[-1]() is not None, "left for the process's exit"
        assert all(r() is None for r in made[:-1]), "earlier partitions freed when they return"
        gc.collect()
        assert all(r() is None for r in made), "a collection frees it"
        assert gc.get_freeze_count() == 0, "nothing left frozen"
    finally:
        if was:
            gc.enable()
    assert gc.isenabled() == was
    assert strip_wall(left.report) == strip_wall(plain.report)
    assert left.records == plain.records
