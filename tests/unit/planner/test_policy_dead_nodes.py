"""A policy's split is laid over the live nodes as the core applies it (``PlannerCore.tick``; session 43).

Before, the core applied a policy's phases as the policy placed them (``assign_min_change``, which knows
nothing of liveness): a decision could leave a phase on dead nodes only, and the liveness swap
(``_rescue``) corrected it at a later tick — a second switch, with a live node drained there and back.
Now the core applies the decision with its dead phase swapped as ``_rescue`` would (same dead/steady
rules), choosing the pair that switches the fewest live nodes: one command, the policy's split count.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from shared.messages import NodeState, SplitApplied
from shared.profile import load_profile
from shared.split import assign_min_change
from services.planner.core import PlannerCore
from services.planner.policy import PolicyBase, make_planner

from .helpers import state

NODES = ["w0", "w1", "w2", "w3"]
TINY = load_profile("tiny")


def _drive(
    core: PlannerCore, t_end: float, dead: dict[str, float], *, kv_used: float = 0.3, queue: int | Callable[[str], int] = 0
):
    """Every 0.5 s each live node reports (a node in ``dead`` stops after its time): a prefill node ``queue`` waiting
    and queued requests (or ``queue(node)``), a decode node 10 decoding at KV use ``kv_used``; the core ticks when
    due; a live node confirms a switch at once. Returns the commands issued, with their times."""
    cmds = []
    for k in range(int(t_end * 2) + 1):
        t = k * 0.5
        phases = core.command.phases
        for n in NODES:
            if n in dead and t > dead[n]:
                continue
            if phases[n] == "prefill":
                q = queue(n) if callable(queue) else queue
                st = state(n, "prefill", waiting=q, queue=q)
            else:
                used = int(round(kv_used * 100))
                st = state(n, "decode", decoding=10, free=100 - used, total=100)
            core.on_node_state(msgspec.structs.replace(st, epoch=core.command.epoch), t)
        nxt = core.next_tick()
        if nxt is not None and nxt <= t:
            cmd = core.tick(t)
            if cmd is not None:
                cmds.append((t, dict(cmd.phases), cmd.reason))
                for n in NODES:
                    if n not in dead or t <= dead[n]:
                        core.on_split_applied(SplitApplied(node=n, epoch=cmd.epoch, phase=cmd.phases[n], status="serving"), t)
    return cmds


# Dynamo, 2P2D, prefill w0 dead, a decode vote: before session 44 dynamo counted w0 and moved w1, the only live
# prefill node, and the core laid that switch over the live nodes (w0 -> decode). Dynamo now counts the live nodes
# only (PolicyBase.on_liveness) and keeps w1 (min_endpoint): test_policy_live_capacity.py. The core's placement of a
# policy's switch is checked below with a policy that places a phase on dead nodes (_Once).


class _Once(PolicyBase):
    """Switches to ``count`` prefill nodes (``assign_min_change``, as every policy) at ``at``."""

    name = "once"

    def __init__(self, count: int, at: float) -> None:
        super().__init__(NODES, TINY)
        self.count, self.at, self.placed = count, at, []

    def next_tick(self) -> float | None:
        return self.at

    def tick(self, now, phases, busy):
        if now < self.at:
            return None
        self.at = now + 1000.0
        return self._decide(now, "switch", phases, assign_min_change(phases, self.count), "once")

    def on_placed(self, phases, now) -> None:
        self.placed.append((now, dict(phases)))


def _core(count: int, at: float = 10.0) -> PlannerCore:
    return PlannerCore(NODES, "2P2D", policy=_Once(count, at), silent_after=3.0)


def _states(core: PlannerCore, t: float, *nodes: str) -> None:
    for n in nodes:
        core.on_node_state(NodeState(node=n, phase=core.command.phases[n], epoch=core.command.epoch), t)


def test_decode_left_on_a_dead_node_goes_to_the_live_node_the_policy_moved() -> None:
    """3P1D from 2P2D takes w2 (first decode node) to prefill, leaving decode on the dead w3: w2 keeps
    decode and the dead w3 takes the prefill place (no live node switches); the policy is told."""
    core = _core(3)
    for t in (1.0, 2.0):
        _states(core, t, *NODES)
    for t in (4.0, 6.0, 8.0, 10.0):
        _states(core, t, "w0", "w1", "w2")
    cmd = core.tick(10.0)
    assert cmd is not None and dict(cmd.phases) == {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "prefill"}
    assert core.policy.placed == [(10.0, dict(cmd.phases))]  # type: ignore[attr-defined]
    assert core.tick(10.5) is None and core.switches == 1


def test_the_policys_placement_stands_when_no_node_is_dead_or_the_swap_rules_say_no() -> None:
    live = _core(1)
    _states(live, 9.0, *NODES)
    assert dict(live.tick(10.0).phases) == assign_min_change(dict(live.command.phases), 1) == {  # type: ignore[union-attr]
        "w0": "prefill", "w1": "decode", "w2": "decode", "w3": "decode"}
    never = _core(1)  # w0 never reported (a cold start: it may only be late)
    _states(never, 9.0, "w1", "w2", "w3")
    assert dict(never.tick(10.0).phases)["w0"] == "prefill"  # type: ignore[union-attr]
    stall = _core(1, at=6.1)  # a bus stall: w2, w3 back first (steady by 6.05) were not live when w0 fell silent
    _states(stall, 1.0, *NODES)
    _states(stall, 2.0, *NODES)
    _states(stall, 6.0, "w1", "w2", "w3")
    _states(stall, 6.05, "w1", "w2", "w3")
    cmd = stall.tick(6.1)
    assert cmd is not None and dict(cmd.phases)["w0"] == "prefill" and stall.policy.placed == []  # type: ignore[attr-defined]


def test_the_evolving_planner_sees_the_placed_split_as_its_own() -> None:
    """The evolving planner compares the phases with the ones it decided (``expected``): without being told
    of the placement it took the core's swap for an operator's change ("split changed externally",
    its cooldown restarted). Its freeze (no warm-up) goes to 1P3D with w0, the first node, dead."""
    pol = make_planner("evolving", NODES, TINY, t_learn_s=0.0, initial_split="1P3D")
    core = PlannerCore(NODES, "2P2D", policy=pol, silent_after=3.0)
    for t in (1.0, 2.0):
        _states(core, t, *NODES)
    for t in (4.0, 6.0):
        _states(core, t, "w1", "w2", "w3")
    cmd = core.tick(6.0)
    assert cmd is not None and dict(cmd.phases) == {"w0": "decode", "w1": "prefill", "w2": "decode", "w3": "decode"}
    core.take_decisions()
    _states(core, 10.0, "w1", "w2", "w3")
    assert core.tick(10.0) is None
    assert not [d.reason for d in core.take_decisions() if "externally" in d.reason]


def test_a_liveness_swap_does_not_hold_dynamos_adjustments_back() -> None:
    """Dynamo adjusts every 180 s and restarts that interval while a node is busy (switching). The
    liveness swap at t=103 (prefill w0, w1 dead since 100: w0 → decode, w3 → prefill) gave the dead w0
    a phase it never confirms: it counted as busy until ``busy_timeout_s`` (900 s), and dynamo's next
    adjustment came at t=1180 instead of 180. A dead node is not switching: now it does not count as busy,
    and dynamo adjusts at 180 and 360 as scheduled (w3 confirmed before its next tick). A tick at a deadline
    of the swap between dynamo's own (decode dead, one live prefill node left: the outage rule makes it serve
    both, session 48; before, nothing was swapped and every request failed) leaves the schedule alone:
    dynamo's interval restarts only at an adjustment or while a node is busy."""
    core = PlannerCore(NODES, "2P2D", policy=make_planner("dynamo", NODES, TINY), silent_after=3.0)
    cmds = _drive(core, 400.0, {"w0": 100.0, "w1": 100.0}, kv_used=0.6)
    assert [(t, r.split(" (")[0]) for t, _, r in cmds] == [(103.0, "prefill was left on silent nodes only")]
    adjusted = [d.ts for d in core.take_decisions() if d.policy == "dynamo" and d.action != "skip"]
    assert adjusted == [180.0, 360.0]
    early = PlannerCore(NODES, "2P2D", policy=make_planner("dynamo", NODES, TINY), silent_after=3.0)
    ticks = []
    tick = early.tick
    early.tick = lambda now: ticks.append(now) or tick(now)  # type: ignore[method-assign]
    cmds = _drive(early, 400.0, {"w1": 95.0, "w2": 100.0, "w3": 100.0}, kv_used=0.7, queue=1)  # one live node
    assert [(t, ph) for t, ph, _ in cmds] == [(103.0, {"w0": "both", "w1": "prefill", "w2": "decode", "w3": "decode"})]
    assert 103.0 in ticks  # decode's deadline: a tick between dynamo's own (every 10 s)
    adjusted = [d for d in early.take_decisions() if d.policy == "dynamo" and "relaunching" not in d.reason]
    assert [d.ts for d in adjusted] == [180.0, 360.0]  # on schedule; with w0 the only live node, no PD split to adjust
    assert all(d.reason == "not a PD split (live nodes only; dead: w1, w2, w3)" for d in adjusted), adjusted


def test_a_node_that_dies_while_draining_or_switching_stops_counting_as_busy() -> None:
    """``draining`` has no timeout (a node's next state or ``split.applied`` ends it): a node killed during
    its drain held every policy back (dynamo's adjustments, the evolving planner's windows) until it came
    back, and one killed before it confirmed a switch for ``busy_timeout_s``. Busy now leaves out a silent
    node; a live one, and one never heard (a cold start), still count."""
    core = PlannerCore(NODES, "2P2D", silent_after=3.0)
    _states(core, 50.0, *NODES)
    core.on_split_applied(SplitApplied(node="w1", epoch=2, phase="decode", status="draining"), 50.0)
    core.pending["w2"] = (2, 50.0)
    _states(core, 51.0, "w0", "w3")
    _states(core, 52.0, "w0", "w3")
    assert core.busy(52.0) == {"w1", "w2"}
    _states(core, 53.0, "w0", "w3")  # w0, w3 reported all along: witnesses (a silence of every node is a stall)
    assert core.busy(53.0) == set()
    _states(core, 54.0, "w2")  # back (restarted, or its bus returned): busy again until it reports serving
    core.on_node_state(NodeState(node="w1", phase="prefill", epoch=1, accepting=False), 54.0)  # still draining
    assert core.busy(54.0) == {"w1", "w2"}
    cold = PlannerCore(NODES, "2P2D", silent_after=3.0)
    cold.pending["w0"] = (2, 0.0)
    assert cold.busy(10.0) == {"w0"}
    assert PlannerCore(NODES, "2P2D").busy(0.0) == set()


def test_a_tick_finds_the_dead_nodes_once_for_the_policy_and_for_busy() -> None:
    """One policy tick reads the nodes' silences once (``PlannerCore.dead``, O(N)): the policy is told the dead
    nodes (``on_liveness``) and ``busy`` leaves the same ones out. Before, a tick with a node switching or draining
    computed them twice."""
    seen: list[tuple[frozenset[str], frozenset[str]]] = []

    class Spy(PolicyBase):
        name = "spy"

        def tick(self, now, phases, busy):
            seen.append((self.dead, busy))
            return None

        def next_tick(self):
            return 0.0

    core = PlannerCore(NODES, "2P2D", policy=Spy(NODES, TINY), silent_after=3.0)
    _states(core, 49.0, *NODES)
    _states(core, 50.0, *NODES)
    core.pending.update({"w1": (2, 50.0), "w2": (2, 50.0)})  # switching: busy while live
    _states(core, 52.0, "w0", "w1", "w3")
    _states(core, 53.0, "w0", "w1", "w3")  # w2 silent since 50: dead at 53
    dead, calls = core.dead, []
    core.dead = lambda now: calls.append(now) or dead(now)  # type: ignore[method-assign]
    assert core.tick(53.0) is None
    assert calls == [53.0] and seen == [(frozenset({"w2"}), frozenset({"w1"}))]


def test_a_stall_that_silences_every_node_does_not_free_a_switching_node_from_busy() -> None:
    """Dead needs a witness: a node that kept reporting across the silence (live, steady, its run of
    states begun before the silent node went quiet), as for the liveness swap's takers. When every node is
    silent at once (a stall of the planner's bus or loop, a step of its clock) nothing is known: before,
    ``busy`` dropped every silent node, so a node still draining or switching stopped holding the policies
    back, and dynamo (2P2D, w1 draining from t=100, no state from any node after t=150) switched at t=330
    mid-stall on the states of t=150 while w1 still drained. Nodes back first after the stall (not steady
    yet) do not witness the others either."""
    core = PlannerCore(NODES, "2P2D", silent_after=3.0)
    _states(core, 49.0, *NODES)
    _states(core, 50.0, *NODES)
    core.on_split_applied(SplitApplied(node="w1", epoch=2, phase="decode", status="draining"), 50.0)
    core.pending["w2"] = (2, 50.0)
    assert core.busy(60.0) == {"w1", "w2"}  # every node silent: nothing is known
    _states(core, 60.0, "w0", "w3")  # back first after the stall: not steady, no witness
    assert core.busy(60.0) == {"w1", "w2"}
    dyn = PlannerCore(NODES, "2P2D", policy=make_planner("dynamo", NODES, TINY), silent_after=3.0)
    for k in range(801):
        t = k * 0.5
        if t <= 150.0:
            for n in NODES:
                if dyn.command.phases[n] == "prefill":
                    st = state(n, "prefill")
                else:
                    st = state(n, "decode", decoding=10, free=5, total=100)
                draining = n == "w1" and t >= 100.0
                dyn.on_node_state(msgspec.structs.replace(st, epoch=dyn.command.epoch, accepting=not draining), t)
        nxt = dyn.next_tick()
        assert nxt is None or nxt > t or dyn.tick(t) is None, f"switched at t={t} during the stall"


def test_a_switch_the_placement_turns_into_the_split_served_is_logged_as_no_switch() -> None:
    """The evolving planner without warm-up freezes into its initial split by position (2P2D: w0, w1 prefill).
    Both died before its first tick, and the liveness swap already gave prefill to w2 (w0 -> decode): laid over
    the live nodes, the freeze's 2P2D is the split served, so no command is issued. Before, its decision still
    read ``switch`` 2P2D -> 2P2D under the current epoch, a switch that never happened; now ``no_switch``,
    with the reason saying the placement is the split served."""
    pol = make_planner("evolving", NODES, TINY, t_learn_s=0.0, initial_split="2P2D")
    core = PlannerCore(NODES, "2P2D", policy=pol, silent_after=3.0)
    for t in (1.0, 2.0):
        _states(core, t, *NODES)
    for t in (3.0, 4.0, 5.0):
        _states(core, t, "w2", "w3")
    rescue = core.tick(5.0)
    assert rescue is not None and dict(rescue.phases) == {"w0": "decode", "w1": "prefill", "w2": "prefill", "w3": "decode"}
    core.take_decisions()
    _states(core, 5.5, "w2", "w3")
    assert core.tick(5.5) is None and core.command.epoch == rescue.epoch
    [freeze] = [d for d in core.take_decisions() if d.policy == "evolving"]
    assert (freeze.action, freeze.split_before, freeze.split_after) == ("no_switch", "2P2D", "2P2D"), freeze
    assert freeze.reason.endswith("w2 takes it from w0: the split served)"), freeze.reason
    _states(core, 6.0, "w2", "w3")
    assert core.tick(6.0) is None
    assert not [d.reason for d in core.take_decisions() if "externally" in d.reason]


def test_the_evolving_planner_sees_a_liveness_swap_as_the_planners_own() -> None:
    """The liveness swap (``_rescue``: prefill w0, w1 dead, w2 takes it from w0) is the planner's own change,
    as a policy's switch laid over the live nodes: the policy is told (``on_placed``). Before, the evolving
    planner's next tick took it for an operator's: 'split changed externally to 2P2D; cooldown restarts' (and,
    in a restarted planner's warm-up in the adopted split, 'split changed externally during warm-up': models
    frozen early). Its cooldown still runs from w2's switch (``on_switch_done``)."""
    pol = make_planner("evolving", NODES, TINY, t_learn_s=0.0)
    core = PlannerCore(NODES, "2P2D", policy=pol, silent_after=3.0)
    for t in (1.0, 2.0):
        _states(core, t, *NODES)
    assert core.tick(2.0) is None
    for t in (3.0, 4.0, 5.0):
        _states(core, t, "w2", "w3")
    rescue = core.tick(5.0)
    assert rescue is not None and rescue.reason.startswith("prefill was left on silent nodes only")
    assert pol.expected == dict(rescue.phases)  # type: ignore[attr-defined]
    core.on_split_applied(SplitApplied(node="w2", epoch=rescue.epoch, phase="prefill", status="serving"), 5.2)
    _states(core, 5.5, "w2", "w3")
    assert core.tick(5.5) is None
    assert not [d.reason for d in core.take_decisions() if "externally" in d.reason]
    assert pol.last_switch_at == 5.2  # type: ignore[attr-defined]
