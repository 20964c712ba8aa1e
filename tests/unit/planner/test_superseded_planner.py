"""Two planners at once: one restarted (or started by a supervisor) while the other was frozen (SIGSTOP, a paused
VM), then the frozen one resumed holding another split. Each took the other's command for a forged one and
re-issued its own split one epoch up (``PlannerCore.on_foreign_command``): a war without end, the epoch climbing
each round trip and the contested node switching phase each time (two cores, 2P2D against an operator's 3P1D:
epochs 2, 3, ... 13 in 12 rounds, w2 prefill/decode/prefill ...). ``SplitCommand.boot`` orders the planner
processes: the earlier one stops when it hears a later one's command, so the war lasts one round."""

from __future__ import annotations

from services.planner.core import PlannerCore
from shared.messages import SplitCommand, new_boot
from shared.split import split_name

NODES = ["w0", "w1", "w2", "w3"]
EARLY = new_boot(1_000_000_000_000_000_000, b"\x00")
LATE = new_boot(1_000_000_000_900_000_000, b"\x00")


def _bus(cores: list[PlannerCore], first: SplitCommand, sender: PlannerCore, rounds: int = 12) -> list[tuple[int, str]]:
    """Deliver ``first`` (issued by ``sender``) and every command answered to it to the other cores (a bus), in
    order; the splits seen."""
    queue, seen = [(first, sender)], []
    for i in range(rounds):
        if not queue:
            break
        cmd, src = queue.pop(0)
        seen.append((cmd.epoch, split_name(cmd.phases)))
        for core in cores:
            if core is src or core.superseded_by is not None:
                continue  # its own command is its echo; a stopped planner hears nothing
            again = core.on_foreign_command(cmd, 2.0 + i, 1 << 20)
            if again is not None:
                queue.append((SplitCommand(epoch=again.epoch, phases=dict(again.phases), reason=again.reason, boot=core.boot), core))
    return seen


def test_a_resumed_planner_stops_at_the_later_planners_command_instead_of_a_war():
    early = PlannerCore(NODES, "2P2D", boot=EARLY)  # frozen at 2P2D, epoch 1
    late = PlannerCore(NODES, "2P2D", boot=LATE)
    cmd = late.set_split("3P1D", 1.0)  # the replacement took an operator's split meanwhile
    seen = _bus([early, late], SplitCommand(epoch=cmd.epoch, phases=dict(cmd.phases), boot=LATE), late)
    assert seen == [(2, "3P1D")]  # the earlier planner stops at once: nothing re-issued
    assert early.superseded_by == LATE and late.superseded_by is None


def test_an_earlier_planners_command_is_answered_and_that_planner_stops_at_the_answer():
    early = PlannerCore(NODES, "2P2D", boot=EARLY)
    late = PlannerCore(NODES, "2P2D", boot=LATE)
    late.set_split("3P1D", 1.0)
    stale = early.set_split("1P3D", 1.5)  # the earlier one, resumed, acts before it heard the later one
    seen = _bus([early, late], SplitCommand(epoch=stale.epoch, phases=dict(stale.phases), boot=EARLY), early)
    assert seen == [(2, "1P3D"), (3, "3P1D")]  # one answer, then quiet
    assert early.superseded_by == LATE and late.command.epoch == 3 and split_name(late.command.phases) == "3P1D"


def test_without_boots_two_planners_still_answer_each_other():
    """An older planner (no boot) is never taken for a later one: the forged-command rule applies as before."""
    a, b = PlannerCore(NODES, "2P2D"), PlannerCore(NODES, "2P2D")
    cmd = b.set_split("3P1D", 1.0)
    seen = _bus([a, b], SplitCommand(epoch=cmd.epoch, phases=dict(cmd.phases)), b, rounds=6)
    assert [e for e, _ in seen] == [2, 3, 4, 5, 6, 7] and a.superseded_by is None
