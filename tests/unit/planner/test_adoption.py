"""PlannerCore adoption: a (re)started planner takes over the split the nodes serve (their
phases, the epoch a majority of them holds) instead of announcing its configured split, and a
node state's epoch never moves the planner's epoch on its own (``core.py``, README "Restart")."""

from __future__ import annotations

import msgspec
import pytest

from shared.messages import IterationRecords, NodeState, SplitCommand
from shared.profile import load_profile
from shared.split import split_name, split_phases
from shared.validate import MAX_EPOCH_STEP, epoch_step_ok
from services.planner.core import PlannerCore
from services.planner.policy import make_planner

from .helpers import records

GB = load_profile("gb300-glm52")
NODES = ["w0", "w1", "w2", "w3"]
OPERATOR = split_phases("3P1D", NODES)
"""The operator's `split set 3P1D` before the crash; the planner is configured 2P2D."""


def st(node: str, phase: str, epoch: int, *, accepting: bool = True) -> NodeState:
    return NodeState(node=node, phase=phase, epoch=epoch, accepting=accepting)  # type: ignore[arg-type]


def restarted(grace_until: float = 3.0, **kw) -> PlannerCore:
    return PlannerCore(NODES, "2P2D", adopt_until=grace_until, **kw)


def test_a_restarted_planner_adopts_the_operators_split_and_epoch_without_a_switch():
    core = restarted()
    assert core.adopting and core.next_tick() == 3.0
    with pytest.raises(ValueError, match="starting"):
        core.set_split("2P2D", 0.1)  # below the nodes' epoch it would be ignored: refused until adopted
    assert core.on_foreign_command(SplitCommand(epoch=9, phases=split_phases("1P3D", NODES)), 0.1, MAX_EPOCH_STEP) is None
    for i, n in enumerate(NODES[:3]):
        core.on_node_state(st(n, OPERATOR[n], 5), 0.2 + i / 10)
        assert not core.adopt_due() and core.tick(0.5) is None  # not every node yet, grace not over
    core.on_node_state(st("w3", OPERATOR["w3"], 5), 0.6)
    assert core.adopt_due() and core.next_tick() == 0.0  # every node reported: no need to wait out the grace
    cmd = core.tick(0.7)
    assert cmd is not None and cmd.epoch == 5 and cmd.phases == OPERATOR and core.command is cmd
    assert not core.adopting and core.switches == 0 and core.busy(0.7) == set() and core.adoptions == 1
    (ev,) = core.take_decisions()
    assert ev.action == "adopt" and ev.split_before == "2P2D" and ev.split_after == "3P1D" and ev.epoch == 5
    assert core.tick(10.0) is None and core.command is cmd  # the static policy plans onward: nothing
    op = core.set_split("2P2D", 11.0)
    assert op.epoch == 6  # the operator's next split is above every node's epoch: they follow it


def test_a_fresh_cluster_gets_the_configured_split_at_epoch_1():
    core = restarted()
    for n in NODES:
        core.on_node_state(st(n, "both", 0), 0.5)  # just started: no split yet
    cmd = core.tick(0.5)
    assert cmd is not None and cmd.epoch == 1 and split_name(cmd.phases) == "2P2D" and cmd.reason == "initial"
    assert core.take_decisions() == [] and core.adoptions == 0
    silent = restarted()
    assert silent.tick(2.9) is None
    cmd = silent.tick(3.0)  # no node reported within the grace: the configured split too
    assert cmd is not None and cmd.epoch == 1 and split_name(cmd.phases) == "2P2D"


def test_the_grace_is_a_timeout_and_nodes_that_did_not_report_keep_the_planners_phase():
    core = restarted()
    core.on_node_state(st("w2", "prefill", 7), 0.1)
    core.on_node_state(st("w3", "decode", 7), 0.2)
    assert core.tick(2.99) is None
    cmd = core.tick(3.0)
    assert cmd is not None and cmd.epoch == 7
    assert cmd.phases == {"w0": "prefill", "w1": "prefill", "w2": "prefill", "w3": "decode"}


def test_a_node_draining_at_restart_is_waited_for_then_corrected_when_it_serves():
    core = restarted()
    for n in ("w0", "w1", "w3"):
        core.on_node_state(st(n, OPERATOR[n], 5), 0.1)
    core.on_node_state(st("w2", "decode", 5, accepting=False), 0.1)  # 2P2D → 3P1D: draining decode → ? (not in the state)
    assert not core.adopt_due()  # its new phase is unknown yet: wait for it within the grace
    cmd = core.tick(3.0)
    assert cmd is not None and cmd.epoch == 5 and cmd.phases["w2"] == "decode" and core.busy(3.0) == {"w2"}
    core.on_node_state(st("w2", "prefill", 5), 4.0)  # drained: serves the phase the operator gave it
    assert core.command.epoch == 5 and core.command.phases == OPERATOR and core.busy(4.0) == set()
    core.on_node_state(st("w2", "decode", 5), 5.0)  # corrected once only: later states do not edit the command
    assert core.command.phases == OPERATOR and core.switches == 0
    assert core.on_foreign_command(cmd, 5.5, MAX_EPOCH_STEP) is None and core.foreign_commands == 0  # an earlier announcement


def test_a_draining_node_whose_old_phase_leaves_no_split_is_both_until_it_serves():
    core = restarted()
    for n in ("w0", "w1", "w2"):
        core.on_node_state(st(n, "prefill", 5), 0.1)
    core.on_node_state(st("w3", "prefill", 5, accepting=False), 0.1)  # the only node that can be going to decode
    cmd = core.tick(3.0)
    assert cmd is not None and cmd.epoch == 5 and cmd.phases["w3"] == "both" and core.busy(3.0) == {"w3"}
    core.on_node_state(st("w3", "decode", 5), 4.0)
    assert core.command.epoch == 5 and split_name(core.command.phases) == "3P1D"


@pytest.mark.parametrize("forged", [6, 1000, MAX_EPOCH_STEP, 2**53])
def test_a_forged_state_epoch_does_not_move_the_adopted_epoch(forged):
    core = restarted()
    core.on_node_state(st("w0", "prefill", forged), 0.1)
    for n in NODES[1:]:
        core.on_node_state(st(n, OPERATOR[n], 5), 0.2)
    cmd = core.tick(0.3)
    assert cmd is not None and cmd.epoch == 5 and cmd.phases == OPERATOR


def test_two_of_four_nodes_restarted_while_the_planner_was_down_still_give_the_epoch():
    core = restarted()
    core.on_node_state(st("w0", "prefill", 5), 0.1)
    core.on_node_state(st("w3", "decode", 5), 0.1)
    core.on_node_state(st("w1", "both", 0), 0.1)  # restarted without a planner: serves its --phase at epoch 0
    core.on_node_state(st("w2", "both", 0), 0.1)
    cmd = core.tick(0.2)
    assert cmd is not None and cmd.epoch == 5
    assert cmd.phases == {"w0": "prefill", "w1": "both", "w2": "both", "w3": "decode"}  # what each serves: no switch


def test_a_lone_forger_among_fresh_nodes_cannot_lift_the_epoch_past_what_they_accept():
    core = restarted()
    core.on_node_state(st("w0", "prefill", 2**40), 0.1)
    for n in NODES[1:]:
        core.on_node_state(st(n, "both", 0), 0.1)
    cmd = core.tick(0.2)
    assert cmd is not None and cmd.epoch == MAX_EPOCH_STEP - 1
    nxt = core.set_split("2P2D", 1.0)
    assert epoch_step_ok(0, nxt.epoch)  # the honest nodes (epoch 0) accept the next command


def test_after_the_start_a_state_alone_never_raises_the_epoch_but_a_majority_does():
    """Issue 2: before, a forged state above the planner's epoch made it re-issue its split above
    that epoch (up to 2^20 per state, one command per state: 2^33 states exhaust 2^53). Now one
    node's state is counted only; a majority of the nodes above the planner's epoch means the
    planner's commands are being ignored (its grace ended before they were back), so it adopts."""
    core = restarted()
    cmd = core.tick(3.0)
    assert cmd is not None and cmd.epoch == 1
    for k in range(1, 50):
        core.on_node_state(st("w0", "prefill", 1 + k * MAX_EPOCH_STEP), 3.0 + k)
        assert not core.adopt_due() and core.tick(4.0 + k) is None
    assert core.command.epoch == 1 and core.states_epoch_ahead == 49 and core.foreign_commands == 0
    core.on_node_state(st("w1", "prefill", 5), 60.0)
    assert not core.adopt_due()  # 2 of 4: not a strict majority
    core.on_node_state(st("w2", "prefill", 5), 61.0)
    assert core.adopt_due() and core.next_tick() == 0.0
    late = core.tick(61.0)
    assert late is not None and late.epoch == 5  # the lower median of (49·2^20+1, 5, 5): not the forger's
    assert late.phases == {"w0": "prefill", "w1": "prefill", "w2": "prefill", "w3": "decode"}
    assert [e.action for e in core.take_decisions()] == ["adopt"]
    core.on_node_state(st("w3", "decode", 5), 62.0)
    assert not core.adopt_due() and core.tick(63.0) is None and core.command is late


def test_phases_that_are_no_split_are_not_adopted_the_planners_split_goes_above():
    core = restarted()
    for n in NODES:
        core.on_node_state(st(n, "decode", 4), 0.1)
    cmd = core.tick(0.1)
    assert cmd is not None and cmd.epoch == 5 and split_name(cmd.phases) == "2P2D"
    assert core.busy(0.2) == {"w0", "w1"}  # they switch: there was no prefill node
    assert core.take_decisions()[0].action == "adopt"


def test_a_fresh_cluster_under_the_evolving_planner_starts_collocated_and_gets_its_split_after_the_warm_up():
    """Session 59: up launched the workers in --split 2P2D, the fresh planner announced 2P2D at epoch 1 and its
    first tick switched every node to both at epoch 2, so the demo's split timeline began [0, "2P2D"] and half its
    switches were that flip into the warm-up. Now the first command is the warm-up's (every node both, epoch 1: the
    phases up launches the workers in), nothing switches before the warm-up's end, and the freeze goes to --split."""
    for grace in (3.0, None):  # the start-up adoption finds no split held; no adoption at all (--adopt-grace-s 0)
        pol = make_planner("evolving", NODES, GB, t_learn_s=60.0, window_s=600.0, sample_interval_s=0.0)
        core = PlannerCore(NODES, "2P2D", policy=pol, adopt_until=grace)
        if grace is not None:
            for n in NODES:
                core.on_node_state(st(n, "both", 0), 0.5)  # launched both, no split held yet
            cmd = core.tick(0.5)
        else:
            cmd = core.command
        assert cmd is not None and cmd.epoch == 1 and split_name(cmd.phases) == "collocated" and cmd.reason == "initial"
        assert core.tick(0.5) is None and core.command.epoch == 1 and core.switches == 0  # the warm-up: no switch
        (ev,) = core.take_decisions()
        assert ev.action == "warmup" and ev.split_before == ev.split_after == "collocated" and ev.metrics["warmup_end"] >= 60.0
        for i, n in enumerate(NODES):
            core.add_records(IterationRecords(node=n, records=records(100, GB.prefill, GB.decode, seed=i)), 30.0)
        cmd = core.tick(core.next_tick())
        assert cmd is not None and cmd.epoch == 2 and split_name(cmd.phases) == "2P2D"  # --split after the warm-up


def test_a_fresh_cluster_under_a_planner_without_a_warm_up_starts_in_its_split():
    for pol in (make_planner("evolving", NODES, GB, t_learn_s=0.0), make_planner("dynamo", NODES, GB), None):
        core = PlannerCore(NODES, "2P2D", policy=pol, adopt_until=3.0)
        for n in NODES:
            core.on_node_state(st(n, split_phases("2P2D", NODES)[n], 0), 0.5)
        cmd = core.tick(0.5)
        assert cmd is not None and cmd.epoch == 1 and split_name(cmd.phases) == "2P2D"


def test_a_restarted_evolving_planner_warms_up_in_the_adopted_split_and_keeps_it():
    pol = make_planner("evolving", NODES, GB, t_learn_s=60.0, window_s=600.0, sample_interval_s=0.0)
    core = PlannerCore(NODES, "2P2D", policy=pol, adopt_until=3.0)
    for n in NODES:
        core.on_node_state(st(n, OPERATOR[n], 5), 0.5)
    assert core.tick(0.5).phases == OPERATOR
    assert core.next_tick() == 0.0 and core.tick(0.5) is None  # warm-up, no switch to collocated
    for i, n in enumerate(NODES):
        core.add_records(IterationRecords(node=n, records=records(100, GB.prefill, GB.decode, seed=i)), 30.0)
    nxt = core.next_tick()
    assert nxt is not None and nxt >= 60.0
    assert core.tick(nxt) is None and core.command.epoch == 5 and core.command.phases == OPERATOR
    evs = core.take_decisions()
    assert [e.action for e in evs] == ["adopt", "warmup", "no_switch"]  # the freeze keeps the adopted split
    assert all(e.split_after == "3P1D" for e in evs) and core.switches == 0
    models = core.take_models()
    assert models is not None and models.frozen


def test_a_restarted_evolving_planner_that_finds_the_warm_up_continues_it():
    pol = make_planner("evolving", NODES, GB, t_learn_s=60.0, window_s=600.0, sample_interval_s=0.0)
    core = PlannerCore(NODES, "2P2D", policy=pol, adopt_until=3.0)
    for n in NODES:
        core.on_node_state(st(n, "both", 2), 0.5)
    assert split_name(core.tick(0.5).phases) == "collocated"
    assert core.tick(0.5) is None  # already collocated
    for i, n in enumerate(NODES):
        core.add_records(IterationRecords(node=n, records=records(100, GB.prefill, GB.decode, seed=i)), 30.0)
    cmd = core.tick(core.next_tick())
    assert cmd is not None and cmd.epoch == 3 and split_name(cmd.phases) not in ("collocated",)  # freeze chooses


def test_the_command_object_is_still_a_struct_after_a_correction():
    core = restarted()
    for n in ("w0", "w1", "w3"):
        core.on_node_state(st(n, OPERATOR[n], 5), 0.1)
    core.on_node_state(st("w2", "decode", 5, accepting=False), 0.1)
    core.tick(3.0)
    core.on_node_state(st("w2", "prefill", 5), 4.0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(core.command), type=SplitCommand) == core.command


def test_a_node_silent_during_the_grace_is_corrected_to_the_phase_it_reports():
    """Review of the adoption: w2 (prefill since the operator's 3P1D at epoch 5) sends no state
    within the grace; its entry is the planner's --split phase (decode). At epoch 5 w2 ignores
    that command, but the routers apply a command at their epoch and exclude a node whose
    reported phase differs from the split's: w2 stayed out of every placement, and split.get
    said 2P2D, until the planner's next command (never, with the static policy). Now its first
    state corrects its entry under the same epoch, as for a node adopted while draining."""
    core = restarted()
    for n in ("w0", "w1", "w3"):
        core.on_node_state(st(n, OPERATOR[n], 5), 0.1)
    cmd = core.tick(3.0)
    assert cmd is not None and cmd.epoch == 5 and cmd.phases["w2"] == "decode"  # the planner's guess
    core.on_node_state(st("w2", "prefill", 5), 4.0)
    assert core.command.epoch == 5 and core.command.phases == OPERATOR and core.switches == 0
    core.on_node_state(st("w2", "decode", 5), 5.0)  # corrected once only
    assert core.command.phases == OPERATOR
    assert core.on_foreign_command(cmd, 5.5, MAX_EPOCH_STEP) is None and core.foreign_commands == 0  # an earlier announcement


def test_every_command_a_correction_replaced_echoes_back_as_the_planners_own():
    core = restarted()
    core.on_node_state(st("w0", "prefill", 5), 0.1)
    core.on_node_state(st("w3", "decode", 5), 0.1)
    first = core.tick(3.0)  # w1, w2 silent: w1 prefill, w2 decode (--split)
    assert first is not None and first.phases == {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "decode"}
    core.on_node_state(st("w2", "prefill", 5), 4.0)
    second = core.command
    core.on_node_state(st("w1", "decode", 5), 4.0)
    assert core.command.phases == {"w0": "prefill", "w1": "decode", "w2": "prefill", "w3": "decode"}
    for echo in (first, second):  # both still on the bus when the second correction came
        assert core.on_foreign_command(echo, 4.1, MAX_EPOCH_STEP) is None
    assert core.foreign_commands == 0 and core.command.epoch == 5


@pytest.mark.parametrize("forged", [MAX_EPOCH_STEP, 2**40, 2**53])
def test_a_lone_state_within_the_grace_cannot_put_the_epoch_out_of_the_silent_nodes_reach(forged):
    """Review of the adoption: the cap was taken above the lowest *reported* epoch, so a state
    alone within the grace (the other workers not up yet at a cold start, or cut off) set the
    planner's epoch to its number, up to 2^53: every other node and router then refused each
    of its commands (a jump above MAX_EPOCH_STEP), and their states, below the planner's epoch,
    never made it adopt again. A node that has not reported may hold no split: the cap is then
    above 0."""
    core = restarted()
    core.on_node_state(st("w0", "prefill", forged), 0.1)
    cmd = core.tick(3.0)
    assert cmd is not None and cmd.epoch == MAX_EPOCH_STEP - 1
    assert epoch_step_ok(0, cmd.epoch) and epoch_step_ok(5, core.set_split("2P2D", 4.0).epoch)
