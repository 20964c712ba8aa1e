"""A phase left on dead nodes only with one live node to take it: that node serves both phases (the outage
rule, ``PlannerCore._dead_swap``/``_rescue``; session 48), and the split before comes back once the dead nodes do.

Before, the liveness swap needed two or more live nodes of the other phase: the README's smallest stack (2 workers,
1P1D after the warm-up) with the only prefill node stopped served nothing (``/health`` 503 "no live prefill node")
until an operator ran ``split set collocated``; every tick the evolving planner logged "the live nodes' split is not
a PD split (live nodes only; dead: w0)". The core runs before any policy, so the rule is every policy's (static
included); the simulator never loses a node (it drives the policies, not the core).
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.messages import NodeState, SplitApplied
from services.planner.core import PlannerCore
from services.planner.policy import PolicyBase, make_planner

from .test_policy_dead_nodes import TINY

PD = ["w0", "w1"]


def _states(core: PlannerCore, t: float, *nodes: str) -> None:
    for n in nodes:
        core.on_node_state(NodeState(node=n, phase=core.command.phases[n], epoch=core.command.epoch), t)


def _run(core: PlannerCore, t0: float, t1: float, alive: Iterable[str]) -> list[tuple[float, dict[str, str], str]]:
    """Every 0.5 s from ``t0`` to ``t1`` the ``alive`` nodes report; the core ticks when due (at most once per
    step, as the service's loop); a live node confirms a command at once. The commands issued, with their times."""
    cmds = []
    alive = list(alive)
    for k in range(int(round((t1 - t0) * 2)) + 1):
        t = t0 + k * 0.5
        _states(core, t, *alive)
        nxt = core.next_tick()
        if nxt is not None and nxt <= t:
            cmd = core.tick(t)
            if cmd is not None:
                cmds.append((t, dict(cmd.phases), cmd.reason))
                for n in alive:
                    core.on_split_applied(SplitApplied(node=n, epoch=cmd.epoch, phase=cmd.phases[n], status="serving"), t)
    return cmds


def _static(split: str = "1P1D", nodes: list[str] = PD) -> PlannerCore:
    core = PlannerCore(nodes, split, silent_after=3.0)
    assert core.policy.name == "static"
    return core


def test_one_live_node_left_serves_both_phases_at_once() -> None:
    """1P1D, the only prefill node w0 dead at t=10: at 13 (its last state + 3 s) w1 serves both; the reason and
    a decision (policy ``liveness``) name w0. Nothing else is issued while w0 stays dead (no busy loop)."""
    core = _static()
    _run(core, 0.0, 10.0, PD)
    cmds = _run(core, 10.5, 60.0, ["w1"])
    assert cmds == [(13.0, {"w0": "prefill", "w1": "both"},
                     "prefill was left on silent nodes only (w0 silent 3.0 s): w1 serves both phases until they are back")]  # fmt: skip
    (d,) = [d for d in core.take_decisions() if d.action == "switch"]
    assert (d.policy, d.split_before, d.split_after, d.epoch) == ("liveness", "1P1D", "1P0D+1B", 2)
    assert core.outage is not None and core.outage[3] == ("w0",)
    assert core.next_tick() is not None and core.next_tick() > 60.0  # type: ignore[operator]


def test_the_only_decode_node_dead_makes_the_prefill_node_serve_both() -> None:
    core = _static()
    _run(core, 0.0, 10.0, PD)
    cmds = _run(core, 10.5, 20.0, ["w0"])
    assert [(t, ph) for t, ph, _ in cmds] == [(13.0, {"w0": "both", "w1": "decode"})]
    assert "decode was left on silent nodes only (w1 silent 3.0 s)" in cmds[0][2]


def test_the_split_comes_back_once_the_dead_node_has_reported_for_silent_after() -> None:
    """w0 back at t=30 (a restart): the outage split stays until w0 has been live and steady for 3 s (a state
    or two of a flapping node move nothing), then 1P1D is issued again; the policy is told it as its own."""
    core = _static()
    placed: list[dict[str, str]] = []
    core.policy.on_placed = lambda phases, now: placed.append(dict(phases))  # type: ignore[method-assign]
    _run(core, 0.0, 10.0, PD)
    _run(core, 10.5, 29.5, ["w1"])
    assert dict(core.command.phases) == {"w0": "prefill", "w1": "both"}
    # a flap: w0 reports at 30 and 30.5 only, then is silent again: nothing is restored
    assert _run(core, 30.0, 30.5, PD) == []
    assert _run(core, 31.0, 40.0, ["w1"]) == []
    # back for good at 40.5: restored at 43.5 (3 s of states), not before
    cmds = _run(core, 40.5, 60.0, PD)
    assert [(t, ph) for t, ph, _ in cmds] == [(43.5, {"w0": "prefill", "w1": "decode"})]
    assert cmds[0][2] == "w0 serving again (3 s of states; dead at t=13.0 s): the split before the outage restored"
    assert core.outage is None and placed[-1] == {"w0": "prefill", "w1": "decode"}
    assert core.command.epoch == 3


def test_the_restore_is_scheduled_for_a_policy_that_never_ticks() -> None:
    """``static`` has no ticks of its own: the core's ``next_tick`` names the state that may undo the outage split
    (w0's comeback, the state its run of states reaches 3 s with); not the steady states between (w1's, and w0's
    at 21: no tick per state during an outage)."""
    core = _static()
    _run(core, 0.0, 10.0, PD)
    _run(core, 10.5, 20.0, ["w1"])
    _states(core, 20.5, *PD)
    assert core.next_tick() == 20.5 and core.tick(20.5) is None  # w0's comeback: checked, too early
    assert core.next_tick() == 23.5  # nothing due before w1 is silent 3 s (or a state that may change something)
    _states(core, 21.0, *PD)
    assert core.next_tick() == 24.0  # w1's silence, moved by its state
    _states(core, 23.5, *PD)
    assert core.next_tick() == 23.5  # w0's run of states reaches 3 s
    cmd = core.tick(23.5)
    assert cmd is not None and dict(cmd.phases) == {"w0": "prefill", "w1": "decode"}


def test_two_live_nodes_of_one_phase_keep_a_pd_split() -> None:
    """1P2D, w0 dead: two live decode nodes, so the swap keeps the split count (w1 takes prefill), no node
    serves both and there is nothing to undo."""
    nodes = ["w0", "w1", "w2"]
    core = _static("1P2D", nodes)
    _run(core, 0.0, 10.0, nodes)
    cmds = _run(core, 10.5, 20.0, ["w1", "w2"])
    assert [(t, ph) for t, ph, _ in cmds] == [(13.0, {"w0": "decode", "w1": "prefill", "w2": "decode"})]
    assert core.outage is None


def test_a_dead_node_serving_both_counts_for_both_phases() -> None:
    """{w0 prefill, w1 both} (an outage split) and w1 dies: no node serves decode; before, a split with a
    ``both`` node was left alone. Now w0 serves both."""
    core = _static()
    _run(core, 0.0, 10.0, PD)
    _run(core, 10.5, 20.0, ["w1"])  # w1 both
    _run(core, 20.5, 30.0, PD)  # w0 back: 1P1D restored at 23.5
    assert dict(core.command.phases) == {"w0": "prefill", "w1": "decode"}
    core.set_split("collocated", 30.0)
    _run(core, 30.5, 31.0, PD)
    core.set_split("1P1D", 31.0)
    _run(core, 31.5, 32.0, PD)
    # a split with a both node, its only decode-capable node dead
    from shared.messages import SplitCommand

    core.command = SplitCommand(epoch=core.command.epoch + 1, phases={"w0": "prefill", "w1": "both"}, reason="t", decided_at=32.0)
    _run(core, 32.5, 33.0, PD)
    cmds = _run(core, 33.5, 40.0, ["w0"])
    assert [(t, ph) for t, ph, _ in cmds] == [(36.0, {"w0": "both", "w1": "both"})]


def test_a_later_command_replaces_the_outage_split_and_nothing_is_restored() -> None:
    core = _static()
    _run(core, 0.0, 10.0, PD)
    _run(core, 10.5, 20.0, ["w1"])
    core.set_split("collocated", 20.0)  # the operator's
    assert core.outage is None
    cmds = _run(core, 20.5, 40.0, PD)
    assert cmds == [] and core.outage is None and core.split == "collocated"


def test_a_policy_ticks_over_the_outage_split_without_switching() -> None:
    """Dynamo during the outage: the live nodes' split is no PD split, so it skips (a node serving both); once
    w0 is back it plans over the restored 1P1D."""
    core = PlannerCore(PD, "1P1D", policy=make_planner("dynamo", PD, TINY), silent_after=3.0)
    assert isinstance(core.policy, PolicyBase)
    _run(core, 0.0, 10.0, PD)
    cmds = _run(core, 10.5, 200.0, ["w1"])
    assert [(t, ph) for t, ph, _ in cmds] == [(13.0, {"w0": "prefill", "w1": "both"})]
    skips = [d.reason for d in core.take_decisions() if d.policy == "dynamo"]
    assert skips and all(r.startswith("not a PD split") for r in skips), skips
    cmds = _run(core, 200.5, 210.0, PD)
    assert [(t, ph) for t, ph, _ in cmds] == [(203.5, {"w0": "prefill", "w1": "decode"})]


def test_the_evolving_planner_past_its_warm_up_resumes_its_windows_after_the_outage() -> None:
    """The issue's stack: the evolving planner serving 1P1D (past its warm-up), w0 dead at t=200. Before, each
    window logged ``skip`` "the live nodes' split is not a PD split (live nodes only; dead: w0)" and nothing was
    issued; now w1 serves both at 203, the windows skip the outage split, and once w0 is back 1P1D returns as the
    planner's own (no "split changed externally", which would restart its cooldown)."""
    core = PlannerCore(PD, "1P1D", policy=make_planner("evolving", PD, TINY, t_learn_s=0.0), silent_after=3.0)
    assert _run(core, 0.0, 200.0, PD) == [] and core.split == "1P1D"
    core.take_decisions()
    cmds = _run(core, 200.5, 700.0, ["w1"])  # a window at 600 (every 600 s)
    assert [(t, ph) for t, ph, _ in cmds] == [(203.0, {"w0": "prefill", "w1": "both"})]
    windows = [d for d in core.take_decisions() if d.policy == "evolving"]
    assert windows and all(d.action == "skip" and "is not a PD split" in d.reason for d in windows), windows
    cmds = _run(core, 700.5, 1300.0, PD)  # a window at 1200
    assert [(t, ph) for t, ph, _ in cmds] == [(703.5, {"w0": "prefill", "w1": "decode"})]
    after = [d for d in core.take_decisions() if d.policy == "evolving"]
    assert after and not [d for d in after if "externally" in d.reason or "not a PD split" in d.reason], after


# -- the review of the outage rule (session 48): each test failed before its fix --------------------------------- #

N3 = ["w0", "w1", "w2"]


def test_the_split_comes_back_once_its_phases_have_live_nodes_though_a_dead_node_never_returns() -> None:
    """1P2D, w1 dead at 10, w2 at 20: w0 serves both at 23. w1 back at 40, w2 never. Before, the outage split
    stayed until every node it found dead was back ({w0: both, w1: decode, w2: decode} for good: w1 idle, dynamo
    skipping "not a PD split" forever); now 1P2D is issued again once w1 has reported for 3 s (decode has a live
    node), the reason naming w2 still silent."""
    core = _static("1P2D", N3)
    _run(core, 0.0, 10.0, N3)
    _run(core, 10.5, 20.0, ["w0", "w2"])
    assert [(t, ph) for t, ph, _ in _run(core, 20.5, 40.0, ["w0"])] == [(23.0, {"w0": "both", "w1": "decode", "w2": "decode"})]
    cmds = _run(core, 40.5, 200.0, ["w0", "w1"])
    assert [(t, ph) for t, ph, _ in cmds] == [(43.5, {"w0": "prefill", "w1": "decode", "w2": "decode"})]
    assert cmds[0][2].startswith("w1 serving again (3 s of states; dead at t=23.0 s): the split before the outage restored")
    assert "w2 still silent" in cmds[0][2]
    assert core.outage is None


def test_dynamo_plans_again_once_the_split_is_restored_though_a_dead_node_never_returns() -> None:
    core = PlannerCore(N3, "1P2D", policy=make_planner("dynamo", N3, TINY), silent_after=3.0)
    _run(core, 0.0, 10.0, N3)
    _run(core, 10.5, 20.0, ["w0", "w2"])
    _run(core, 20.5, 40.0, ["w0"])
    core.take_decisions()
    _run(core, 40.5, 1000.0, ["w0", "w1"])
    assert core.split == "1P2D"
    skips = [d.reason for d in core.take_decisions() if d.policy == "dynamo" and d.reason.startswith("not a PD split")]
    assert skips == [], skips


def test_the_restore_gives_no_phase_to_a_silent_node_and_the_lone_survivor_serves_both() -> None:
    """1P1D: w0 dies at 10 (w1 both at 13), w1 dies at 20, w0 back at 40, w1 never. Before, at 43.5 the core
    issued {w0: prefill, w1: decode} with w1 silent 23.5 s (decode on a dead node only), and w0 never took both:
    its run of states began after w1 went silent. Now w0, steady for 3 s, serves both at 43.5 and nothing is
    restored while w1 stays silent."""
    core = _static()
    _run(core, 0.0, 10.0, PD)
    _run(core, 10.5, 20.0, ["w1"])
    assert _run(core, 20.5, 40.0, []) == []
    cmds = _run(core, 40.5, 400.0, ["w0"])
    assert [(t, ph) for t, ph, _ in cmds] == [(43.5, {"w0": "both", "w1": "both"})]
    assert "decode was left on silent nodes only (w1 silent 23.5 s): w0 serves both phases" in cmds[0][2]
    assert core.dead(400.0) == {"w1"}
    # w1 back: the split before the first outage is restored once it has reported for 3 s
    cmds = _run(core, 400.5, 420.0, PD)
    assert [(t, ph) for t, ph, _ in cmds] == [(403.5, {"w0": "prefill", "w1": "decode"})]
    assert core.outage is None


def test_a_node_silent_for_half_of_silent_after_gets_no_restore_so_the_only_live_node_switches_once() -> None:
    """w0 dies (w1 both at 13), w0 back at 20.5, w1's last state at 21. At 23.5 w0 has reported for 3 s but w1 is
    silent 2.5 s: before, 1P1D was restored onto w1 and 0.5 s later w0 switched to both; now nothing is restored
    onto a node silent for half of ``silent_after`` or more: one command, w0 serving both at 24."""
    core = _static()
    _run(core, 0.0, 10.0, PD)
    _run(core, 10.5, 20.0, ["w1"])
    cmds = _run(core, 20.5, 21.0, PD) + _run(core, 21.5, 40.0, ["w0"])
    assert [(t, ph) for t, ph, _ in cmds] == [(24.0, {"w0": "both", "w1": "both"})]
    cmds = _run(core, 40.5, 60.0, PD)
    assert [(t, ph) for t, ph, _ in cmds] == [(43.5, {"w0": "prefill", "w1": "decode"})]
    assert cmds[0][2].startswith("w1 serving again (3 s of states; dead at t=24.0 s)"), cmds[0][2]


def test_a_single_state_of_a_returning_node_ends_no_outage() -> None:
    """1P2D, w2 dead at 5, w0 dead at 10: w1 serves both at 13. w2 sends one state at 30 and is silent again.
    Before, that state ended the outage with a swap ({w0: D, w1: P, w2: D} at 30: decode on w2 alone) and w1
    served both again at 33; now the swap waits until w2 has reported for 3 s, as the restore does."""
    core = PlannerCore(N3, "1P2D", silent_after=3.0)
    _run(core, 0.0, 5.0, N3)
    _run(core, 5.5, 10.0, ["w0", "w1"])
    assert [(t, ph) for t, ph, _ in _run(core, 10.5, 29.5, ["w1"])] == [(13.0, {"w0": "prefill", "w1": "both", "w2": "decode"})]
    assert _run(core, 30.0, 30.0, ["w1", "w2"]) == []
    assert _run(core, 30.5, 60.0, ["w1"]) == []
    # w2 back for good: the swap ends the outage once w2 has reported for 3 s
    cmds = _run(core, 60.5, 80.0, ["w1", "w2"])
    assert [(t, ph) for t, ph, _ in cmds] == [(63.5, {"w0": "decode", "w1": "prefill", "w2": "decode"})]
    assert core.outage is None


def _restarted_during_the_outage(split: str) -> tuple[PlannerCore, int]:
    """A 1P1D cluster in the outage split ({w0: prefill, w1: both}, epoch 2); a planner started with ``--split``
    ``split`` adopts it at 21 (w0 back at 20.5, w1 live)."""
    core = _static()
    _run(core, 0.0, 10.0, PD)
    _run(core, 10.5, 20.0, ["w1"])
    epoch, phases = core.command.epoch, dict(core.command.phases)
    assert phases == {"w0": "prefill", "w1": "both"}
    new = PlannerCore(PD, split, silent_after=3.0, adopt_until=25.0)
    for t in (20.5, 21.0):
        for n in PD:
            new.on_node_state(NodeState(node=n, phase=phases[n], epoch=epoch), t)
    cmd = new.tick(21.0)
    assert cmd is not None and dict(cmd.phases) == phases and cmd.epoch == epoch
    return new, epoch


def test_a_planner_restarted_during_the_outage_restores_its_split_once_the_nodes_are_back() -> None:
    """Before, the outage split was in the old planner's memory only: the restarted one adopted {w0: prefill,
    w1: both} and kept it for good (w0 back, the policies skipping "not a PD split"). A split with a ``both`` node
    beside single-phase ones comes from the outage rule only, so the adoption takes it as one, the split it
    replaced being ``--split`` laid over the live nodes: 1P1D once w0 has reported for 3 s."""
    new, epoch = _restarted_during_the_outage("1P1D")
    assert new.outage is not None and new.outage[1] == {"w0": "prefill", "w1": "decode"}
    cmds = _run(new, 21.5, 80.0, PD)
    assert [(t, ph) for t, ph, _ in cmds] == [(23.5, {"w0": "prefill", "w1": "decode"})]
    assert "the planner's --split 1P1D laid over the live nodes restored" in cmds[0][2], cmds[0][2]
    assert new.command.epoch == epoch + 1 and new.outage is None


def test_a_planner_restarted_during_the_outage_with_a_collocated_split_keeps_the_split_served() -> None:
    """``--split collocated`` (the default) says nothing of the PD split before the outage: the adopted split stays."""
    new, _ = _restarted_during_the_outage("collocated")
    assert new.outage is None
    assert _run(new, 21.5, 80.0, PD) == []


def test_an_outage_on_an_adopted_outage_split_still_restores_the_planner_s_split() -> None:
    """The restarted planner's adopted outage split, then w1 (serving both) dies before w0 has reported for 3 s:
    w0 serves both; once w1 is back the planner's --split comes back, named as such."""
    new, _ = _restarted_during_the_outage("1P1D")
    cmds = _run(new, 21.5, 22.0, PD) + _run(new, 22.5, 40.0, ["w0"])
    assert [(t, ph) for t, ph, _ in cmds] == [(25.0, {"w0": "both", "w1": "both"})]
    cmds = _run(new, 40.5, 60.0, PD)
    assert [(t, ph) for t, ph, _ in cmds] == [(43.5, {"w0": "prefill", "w1": "decode"})]
    assert "the planner's --split 1P1D laid over the live nodes restored" in cmds[0][2], cmds[0][2]
