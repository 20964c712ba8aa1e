"""The policies value the live nodes' capacity only (``PolicyBase.on_liveness``: the core says which nodes are dead
before each tick; session 44).

Before, a node dead for ``--silent-after-s`` (fenced by the routers) still counted in every policy's capacity terms:
the evolving planner's Θ (Eq. 5) and predicted latency summed its μP or μD and spread q̄ over it (its last decode
batch counted in q̄ for good), and its candidates were splits of every node; Dynamo averaged its last prefill queue
and KV load and counted it toward ``min_endpoint``; Arrow read its last state as a live node's.
"""

from __future__ import annotations

import msgspec

from shared.split import split_name
from services.planner.core import PlannerCore
from services.planner.evolving import EvolvingPlanner
from services.planner.policy import make_planner

from .helpers import state
from .test_evolving import GB, feed
from .test_policy_dead_nodes import NODES as FOUR, TINY, _drive

NODES = [f"w{i}" for i in range(9)]


def test_dynamo_averages_the_prefill_queue_over_the_live_prefill_nodes() -> None:
    """Dynamo, 2P2D, prefill w0 dead since t=100 with an empty queue in its last state; the live prefill w1 holds
    8 queued requests, KV load 0.7 (no decode vote). Before: queue (0 + 8) / 2 = 4 per node, under the 5.0
    threshold: no switch. Now 8 per live prefill node once w0 is dead (its mean over the interval 5.68): one
    decode node goes to prefill at the 180-s adjustment
    (w2, the first decode node: live 2P1D), and the decision names the dead node."""
    core = PlannerCore(FOUR, "2P2D", policy=make_planner("dynamo", FOUR, TINY), silent_after=3.0)
    cmds = _drive(core, 230.0, {"w0": 100.0}, kv_used=0.7, queue=lambda n: 0 if n == "w0" else 8)
    assert [(t, ph) for t, ph, _ in cmds] == [(180.0, {"w0": "prefill", "w1": "prefill", "w2": "prefill", "w3": "decode"})]
    # the mean over the samples since t=0: 4 per node while w0 lived, 8 per live node after
    assert cmds[0][2].startswith("prefill queue 5.68/node (up > 5.0)") and cmds[0][2].endswith("(live nodes only; dead: w0)")


def test_dynamo_does_not_count_a_dead_node_toward_min_endpoint() -> None:
    """Dynamo, 2P2D, prefill w0 dead since t=100, decode KV load 0.95 (a vote for prefill → decode). Live, prefill
    has one node (w1), at ``min_endpoint``: no switch. Before, w0 counted: dynamo moved w1, the only live prefill
    node, to decode and the core laid the split over the live nodes (w0 → decode): a command that changed only a
    dead node's phase."""
    core = PlannerCore(FOUR, "2P2D", policy=make_planner("dynamo", FOUR, TINY), silent_after=3.0)
    assert _drive(core, 230.0, {"w0": 100.0}, kv_used=0.95) == []
    ev = [d for d in core.take_decisions() if d.policy == "dynamo" and d.ts == 180.0]
    assert len(ev) == 1 and ev[0].action == "no_switch", ev
    assert ev[0].reason.endswith("a phase is at min_endpoint (live nodes only; dead: w0)")


class _Feed:
    """``feed``'s target: node states through the core (liveness), finished requests to its policy."""

    def __init__(self, core: PlannerCore) -> None:
        self.core = core

    def on_node_state(self, st, t: float) -> None:
        self.core.on_node_state(msgspec.structs.replace(st, epoch=self.core.command.epoch), t)

    def on_request_done(self, d, t: float) -> None:
        self.core.policy.on_request_done(d, t)


def test_the_evolving_window_decides_over_the_live_nodes_as_a_planner_of_those_nodes_would() -> None:
    """9 nodes at 6P3D, w0 (prefill) and w8 (decode) dead from the start on (one state each, w8 with a batch of
    80 that never ends); the 7 live nodes serve the traffic. The window decision through the core equals that of
    a planner of the 7 live nodes alone: the same candidates (splits of 7 nodes), the same switch; the dead nodes
    keep their phases. Before, Θ and latency summed the dead nodes' rates, q̄ held w8's 80 for good, and the
    candidates were splits of 9 nodes."""
    live = NODES[1:8]
    pl = make_planner("evolving", NODES, GB, t_learn_s=0.0)
    ref = make_planner("evolving", live, GB, t_learn_s=0.0)
    assert isinstance(pl, EvolvingPlanner) and isinstance(ref, EvolvingPlanner)
    core = PlannerCore(NODES, "6P3D", policy=pl, silent_after=3.0)
    core.on_node_state(state("w0", "prefill", queue=40), 0.0)
    core.on_node_state(state("w8", "decode", decoding=80), 0.0)
    full = dict(core.command.phases)
    mine = {n: full[n] for n in live}
    traffic = dict(rate=3.0, t_uc=3000, t_c=97_000, t_out=2000, q=70)
    got, want, last = [], [], 0.0
    for t in sorted({0.0, *(float(k) for k in range(60, 661, 60))}):
        if t > last:
            feed(_Feed(core), mine, last, t, **traffic)
            feed(ref, mine, last, t, **traffic)
        last = t
        cmd = core.tick(t)
        if cmd is not None:
            got.append((t, dict(cmd.phases)))
        d = ref.tick(t, dict(want[-1][1]) if want else mine, set())
        if d is not None:
            want.append((t, dict(d.phases)))
    assert want and want[0][0] == 600.0, want  # the reference switches at the window's end
    assert [(t, {n: ph[n] for n in live}) for t, ph in got] == want
    assert all(ph["w0"] == "prefill" and ph["w8"] == "decode" for _, ph in got)
    ev = [e for e in core.take_decisions() if e.action == "switch" and e.ts == 600.0]
    ev_ref = [e for e in ref.take_decisions() if e.action == "switch" and e.ts == 600.0]
    assert [c.split for c in ev[0].candidates] == [c.split for c in ev_ref[0].candidates]
    assert len(ev[0].candidates) == 5  # p = 1..6 of 7 live nodes, less the current 5
    assert ev[0].split_before == "6P3D" and ev[0].reason.endswith("(live nodes only; dead: w0, w8)")
    assert split_name({n: got[0][1][n] for n in NODES}) == ev[0].split_after
    assert core.dead(600.0) == {"w0", "w8"}


def test_a_node_newly_dead_leaves_the_observer_of_every_policy_that_keeps_one() -> None:
    """``PolicyBase.on_liveness`` (one copy for every policy; the evolving planner and Arrow had one each): a node
    newly dead leaves the populations of the policy's observer (its last decode batch and prefill queue counted
    in q̄ and the queue for good otherwise), once; its next state counts again. A policy without an observer
    (static, dynamo) only learns who is dead."""
    for name in ("evolving", "arrow"):
        pl = make_planner(name, FOUR, TINY)
        pl.on_node_state(state("w0", "prefill", queue=40), 0.0)
        pl.on_node_state(state("w1", "prefill", queue=2), 0.0)
        pl.on_node_state(state("w3", "decode", decoding=80), 0.0)
        pl.on_node_state(state("w2", "decode", decoding=5), 0.0)
        obs = pl.obs  # type: ignore[attr-defined]
        assert (obs.decode_now, obs.queue_now) == (85.0, 42.0), name
        pl.on_liveness(frozenset({"w0", "w3"}), 10.0)
        assert pl.dead == {"w0", "w3"} and (obs.decode_now, obs.queue_now) == (5.0, 2.0), name
        pl.on_node_state(state("w3", "decode", decoding=7), 20.0)  # back: counts again; still dead to the core
        pl.on_liveness(frozenset({"w0", "w3"}), 25.0)  # not newly dead: its new state stays
        assert (obs.decode_now, obs.queue_now) == (12.0, 2.0), name
        pl.on_liveness(frozenset(), 30.0)
        assert pl.dead == frozenset() and (obs.decode_now, obs.queue_now) == (12.0, 2.0), name
    for name in ("static", "dynamo"):
        pl = make_planner(name, FOUR, TINY)
        assert getattr(pl, "obs", None) is None, name
        pl.on_liveness(frozenset({"w0", "x9"}), 10.0)  # an unknown node is left out
        assert pl.dead == {"w0"}, name
