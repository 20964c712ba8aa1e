"""An operator's split set during the evolving planner's warm-up is kept when the warm-up had no
data yet: the warm-up is extended, and its end freezes the models in the operator's split instead
of switching to the planner's initial split (seen on `up --speedup 50`: `split set 3P1D` 20 s into
the warm-up, 'warm-up extended ... (split changed externally during warm-up (3P1D))', then at the
extended end 'warm-up over: models frozen, serving 2P2D' undid the operator's split)."""

from __future__ import annotations

from shared.profile import load_profile
from shared.split import split_name, split_phases
from services.planner.evolving import EvolvingPlanner
from services.planner.policy import make_planner

from .helpers import records
from .test_evolving import NODES, feed

GB = load_profile("gb300-glm52")


def test_operator_split_during_a_warmup_without_data_survives_the_extended_warmup():
    pl = make_planner("evolving", NODES, GB, t_learn_s=600.0, sample_interval_s=0.0)
    assert isinstance(pl, EvolvingPlanner)
    both = pl.tick(0.0, split_phases("6P3D", NODES), set()).phases  # warm-up: collocated
    feed(pl, both, 0.0, 300.0, rate=3.0)  # node states, completions; no iteration records yet
    operator = split_phases("5P4D", NODES)  # split set 5P4D
    assert pl.tick(300.0, operator, set()) is None
    ev = pl.take_decisions()[-1]
    assert ev.action == "no_switch" and "externally" in ev.reason and not pl.frozen
    # t=300 + no_data_retry_s 600 = 900, past the first end (600): extended
    assert "warm-up extended to t=900s" in ev.reason, ev.reason
    for k, n in enumerate(NODES):  # data arrives; the extended warm-up ends
        pl.on_iterations(n, records(100, GB.prefill, GB.decode, seed=k), 600.0)
    end = pl.next_tick()
    assert end is not None and end > 300.0
    assert pl.tick(end, operator, set()) is None  # the operator's split is kept, not 6P3D
    assert pl.frozen
    ev = pl.take_decisions()[-1]
    assert ev.action == "no_switch" and "externally" in ev.reason and split_name(operator) in ev.reason


def test_a_freeze_retry_before_the_first_end_is_not_called_an_extension():
    """up's 1,800-s warm-up, split set 23 s (1,150 simulated s) into it: the planner logged 'warm-up extended to
    t=1950s' of a warm-up that was to end at t=2040s."""
    pl = make_planner("evolving", NODES, GB, t_learn_s=1800.0, sample_interval_s=0.0)
    both = pl.tick(0.0, split_phases("6P3D", NODES), set()).phases
    feed(pl, both, 0.0, 300.0, rate=3.0)
    assert pl.tick(300.0, split_phases("5P4D", NODES), set()) is None
    ev = pl.take_decisions()[-1]
    assert "warm-up brought forward to t=900s" in ev.reason and "extended" not in ev.reason, ev.reason
