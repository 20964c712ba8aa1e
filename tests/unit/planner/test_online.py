"""OnlineModels and PlannerCore: a planner without models of its own still publishes refitted
per-node models for the router (issue 21)."""

from __future__ import annotations

import msgspec
import pytest

from shared.messages import IterationRecords
from shared.profile import load_profile
from services.planner.core import PlannerCore
from services.planner.online import OnlineModels
from services.planner.policy import make_planner

from .helpers import records

GB = load_profile("gb300-glm52")
NODES = ["w0", "w1", "w2", "w3"]


def slow(factor: float):
    pre = msgspec.structs.replace(GB.prefill, **{k: getattr(GB.prefill, k) * factor for k in ("c0", "c1", "c2", "c3")})
    dec = msgspec.structs.replace(GB.decode, **{k: getattr(GB.decode, k) * factor for k in ("d0", "d1", "d2")})
    return pre, dec


@pytest.mark.parametrize("policy", ["static", "dynamo", "arrow"])
def test_a_planner_without_models_publishes_online_refits(policy):
    core = PlannerCore(NODES, "2P2D", policy=make_planner(policy, NODES, GB), online=OnlineModels(NODES, GB, refit_interval_s=60.0))
    pre5, dec5 = slow(5.0)
    core.add_records(IterationRecords(node="w0", records=records(200, pre5, dec5, seed=1)), 10.0)
    core.add_records(IterationRecords(node="w1", records=records(200, GB.prefill, GB.decode, seed=2)), 10.0)
    assert core.take_models(30.0) is None  # not due yet
    msg = core.take_models(60.0)
    assert msg is not None and not msg.frozen and {m.node for m in msg.models} == {"w0", "w1"}
    w0 = next(m for m in msg.models if m.node == "w0")
    assert w0.source == "fitted" and w0.prefill.c1 == pytest.approx(5 * GB.prefill.c1, rel=0.05)
    assert core.take_models(61.0) is None  # nothing new, nothing due
    assert core.current_models() is msg  # re-announced to late joiners
    core.add_records(IterationRecords(node="w1", records=records(50, GB.prefill, GB.decode, seed=3)), 100.0)
    again = core.take_models(120.0)
    assert again is not None and [m.node for m in again.models] == ["w1"]  # only nodes with new records


def test_the_evolving_planner_keeps_its_own_models():
    core = PlannerCore(NODES, "2P2D", policy=make_planner("evolving", NODES, GB, t_learn_s=0.0), online=OnlineModels(NODES, GB))
    assert core.online is None


def test_online_models_reject_bad_settings():
    with pytest.raises(ValueError):
        OnlineModels(NODES, GB, refit_interval_s=0.0)
