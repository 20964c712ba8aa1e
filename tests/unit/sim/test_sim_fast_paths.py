"""The simulation loop's shortcuts leave every result as it was without them.

The simulator tells the engines to build no partial token outputs, to keep decode progress by one
clock (``EngineScheduler.set_lazy_decode``) and (without a planner or an online refit reading them)
no iteration records, and with routing policies that read no node
state (``cluster.STATE_BLIND_ROUTERS``) it applies a node's state to the router only when its
phase changed. Each run here is made once with the shortcuts and once with them undone; the
records and reports must be equal.
"""

from __future__ import annotations

import pytest

from evolving_infra.sim import cluster
from evolving_infra.sim.config import ForcedSwitch, SimConfig
from evolving_infra.sim.run import simulate

from .conftest import BS, small_trace, strip_wall


def _without_shortcuts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node state applied, every output and record built, decode walked request by request
    (the loop before the shortcuts)."""
    monkeypatch.setattr(cluster, "STATE_BLIND_ROUTERS", frozenset())
    init = cluster.ClusterSim.__init__

    def full(self: cluster.ClusterSim, *a: object, **k: object) -> None:
        init(self, *a, **k)  # type: ignore[arg-type]
        self._take_records = True
        for n in self.nodes.values():
            n.sched.set_lazy_decode(False)
            n.sched.partial_outputs = True
            n.sched.keep_records = True

    monkeypatch.setattr(cluster.ClusterSim, "__init__", full)


@pytest.mark.parametrize(
    "cfg",
    [
        SimConfig(nodes=3, profile="tiny", policy="static:2P1D", concurrency=5, seed=2),
        # forced switches: the router must learn the new phases (state applied on a phase change)
        SimConfig(nodes=3, profile="tiny", policy="dynamo", concurrency=5, seed=2, relaunch_s=0.05,
                  forced_switches=(ForcedSwitch(0.3, "w0", "decode"), ForcedSwitch(0.9, "w0", "prefill"))),
        SimConfig(nodes=3, profile="tiny", policy="arrow", concurrency=5, seed=3, planner_options={"interval_s": 0.02}),
        SimConfig(nodes=3, profile="tiny", policy="evolving", concurrency=5, seed=1),
    ],
    ids=["static", "dynamo-forced", "arrow", "evolving"],
)
def test_shortcuts_change_no_result(cfg: SimConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = small_trace(8, 6, pause=0.05)
    fast = simulate(cfg, reqs, BS)
    with monkeypatch.context() as m:
        _without_shortcuts(m)
        slow = simulate(cfg, reqs, BS)
    assert [r for r in fast.records] == [r for r in slow.records]
    assert strip_wall(fast.report) == strip_wall(slow.report)
    assert fast.report["requests_completed"] == len(reqs)


def test_state_blind_routing_applies_states_only_on_a_phase_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """With cache-aware routing and round-robin decode binding the router gets one state per node,
    then one more for each phase change; the policy's decisions are those of the full loop."""
    applied: list[tuple[str, str]] = []
    orig = cluster.RouterCore.apply_state

    def spy(self: cluster.RouterCore, state: object, now: float) -> bool:
        applied.append((state.node, state.phase))  # type: ignore[attr-defined]
        return orig(self, state, now)  # type: ignore[arg-type]

    monkeypatch.setattr(cluster.RouterCore, "apply_state", spy)
    cfg = SimConfig(nodes=3, profile="tiny", policy="dynamo", concurrency=5, seed=2, relaunch_s=0.05,
                    forced_switches=(ForcedSwitch(0.3, "w0", "decode"),))
    res = simulate(cfg, small_trace(8, 6, pause=0.05), BS)
    assert res.report["requests_completed"] == 48
    w0 = [p for n, p in applied if n == "w0"]
    assert w0 == ["prefill", "decode"], w0
    assert len(applied) == 4  # w1, w2 once each
