"""Whose silence: :class:`DeliveryWitness` counts a node's silence only over the time the bus delivered, and
:meth:`NodeLoadView.check_fences` leaves a node unfenced while it holds (``services/router/silence.py``)."""

from __future__ import annotations

import pytest

from services.router.nodes import NodeLoadView
from services.router.silence import DeliveryWitness, Held
from shared.messages import NodeState

FENCE = 3.0
GAP = FENCE / 3  # the router's max_gap_s


def beat(w: DeliveryWitness, nodes: list[str], t0: float, t1: float, every: float) -> float:
    """``nodes`` report every ``every`` s from ``t0`` to ``t1`` (inclusive); returns the last time."""
    t = t0
    while t <= t1 + 1e-9:
        for n in nodes:
            w.node_heard(n, t)
        last = t
        t += every
    return last


def test_a_node_silent_while_others_keep_reporting_over_a_slow_bus_is_due():
    """The loaded host of session 54: PONGs late by 1.2 s (the old rule called the bus stalled at each, fencing
    suspended for good); the other node's states keep coming every 0.9 s, so the dead node's silence is its own."""
    w = DeliveryWitness(GAP)
    beat(w, ["a", "b"], 0.0, 2.0, 0.5)  # both alive to 2.0
    t = 2.0
    while t < 2.0 + FENCE:
        t += 0.9
        w.node_heard("a", t)  # a goes on, b is dead
        w.heard(t + 0.3)  # the PONG of a PING sent at t - 0.9: 1.2 s late
    assert w.silent_s("a") == pytest.approx(0.3)
    assert w.silent_s("b") == pytest.approx(t + 0.3 - 2.0)  # every gap (1.2, 0.3) under the cap counted
    assert w.hold("b", FENCE) is None and w.hold("a", FENCE) == Held("a", pytest.approx(0.3), pytest.approx(FENCE - 0.3))


def test_gaps_longer_than_the_cap_count_the_cap_so_a_dead_node_is_fenced_on_a_very_slow_bus_too():
    """PONGs 2 s apart, the only deliveries (one router, its one node dead): each gap counts GAP (1 s), so the node is
    due after FENCE / GAP gaps, later than on the clock but not never."""
    w = DeliveryWitness(GAP)
    w.node_heard("b", 0.0)
    for k in range(1, 3):
        w.heard(2.0 * k)
    assert w.silent_s("b") == pytest.approx(2 * GAP) and w.hold("b", FENCE) == Held("b", 2 * GAP, FENCE - 2 * GAP)
    w.heard(6.0)
    assert w.hold("b", FENCE) is None and w.gaps_capped == 3


def test_an_eight_second_hang_of_nats_server_is_no_nodes_silence():
    """tests/e2e/test_faults.py's fault: nats-server SIGSTOPped 8 s. Nothing is delivered in the hang; when it goes on,
    every node's held-back states come in a burst. Whatever comes first of the burst, no node's counted silence
    reaches FENCE before its own state is read: at most its state interval (1 s, a worker's idle one) + GAP."""
    w = DeliveryWitness(GAP)
    nodes = ["p0", "p1", "d0", "d1"]
    for k in range(40):  # staggered 1-s state intervals, as workers' are: p0 at 0.0, 1.0 ..; d1 at 0.75, 1.75 .. 9.75
        w.node_heard(nodes[k % 4], 0.25 * k)
    w.heard(10.4)  # a PONG; the last states were at 10.0 .. 9.75 (d1)
    # hung from 10.5 to 18.5: nothing; then the burst, d1's state last of it
    for n in ["p0", "p1", "d0"]:
        w.node_heard(n, 18.5)
        for m in nodes:
            assert w.hold(m, FENCE) is not None or m != "d1", m
    assert w.silent_s("d1") == pytest.approx(0.65 + GAP)  # 9.75 → 10.4 delivered, the hang's gap capped
    assert w.hold("d1", FENCE) is not None
    w.node_heard("d1", 18.51)
    assert all(w.silent_s(n) <= 0.02 for n in nodes)


def test_the_trailing_silence_counts_only_once_the_next_delivery_closes_it():
    """From the last delivery on nothing is known of the bus (it may have just hung): counted only once a later
    delivery closes the gap, so a node is due at the first delivery after FENCE of delivered silence."""
    w = DeliveryWitness(GAP)
    w.node_heard("b", 0.0)
    beat(w, ["a"], 0.5, 2.5, 0.5)
    assert w.silent_s("b") == pytest.approx(2.5)
    w.heard(2.9)
    assert w.hold("b", FENCE) is not None
    w.heard(3.2)
    assert w.hold("b", FENCE) is None


def test_time_going_back_and_unknown_and_forgotten_nodes():
    w = DeliveryWitness(GAP)
    assert w.silent_s("x") is None and w.hold("x", FENCE) is None  # never heard: nothing to doubt
    w.node_heard("x", 5.0)
    w.heard(4.0)  # earlier than the last: counts as the last (no negative gap)
    w.heard(5.5)
    assert w.silent_s("x") == pytest.approx(0.5)
    w.forget("x")
    assert w.silent_s("x") is None
    with pytest.raises(ValueError, match="max_gap_s must be > 0"):
        DeliveryWitness(0.0)


def state(node: str, seq: int = 0) -> NodeState:
    return NodeState(node=node, phase="decode", epoch=1, block_size=16, gpu_free_blocks=10, gpu_total_blocks=10, seq=seq)


def test_check_fences_leaves_a_held_silent_node_unfenced_and_fences_it_once_released():
    """The view asks ``hold`` only of silent nodes; a restarted node (its sequence went back) is fenced regardless."""
    v = NodeLoadView(fence_after=FENCE)
    v.apply_state(state("a", 5), 0.0)
    v.apply_state(state("b", 5), 0.0)
    v.apply_state(state("a", 1), 1.0)  # a restarted
    asked: list[str] = []

    def hold(node: str) -> bool:
        asked.append(node)
        return True

    assert [(f.node, f.cause) for f in v.check_fences(1.5, hold)] == [("a", "restarted")] and asked == []
    assert v.check_fences(3.5, hold) == [] and asked == ["b"] and not v.nodes["b"].fenced
    assert [(f.node, f.cause) for f in v.check_fences(3.6, lambda _n: False)] == [("b", "silent")]
