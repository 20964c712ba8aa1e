"""PlannerCore (epochs, busy bookkeeping, operator split, decision and model outboxes) and RequestTracker."""

from __future__ import annotations

import pytest

from shared.messages import IterationRecords, SplitApplied, TokenChunk
from shared.profile import load_profile
from shared.split import SplitError, split_name
from services.planner.core import PlannerCore, RequestTracker
from services.planner.policy import make_planner

from .helpers import records, state

GB = load_profile("gb300-glm52")
NODES = ["w0", "w1", "w2", "w3"]


def test_request_tracker_builds_request_done_from_token_streams():
    t = RequestTracker()
    assert t.on_chunk(TokenChunk(rid="a", node="w0", index=0, token_ids=[1], prompt_tokens=100, cached_tokens=60, ts=10.0, queue_s=2.0), 10.0) is None
    assert t.on_chunk(TokenChunk(rid="a", node="w2", index=1, token_ids=[2, 3], ts=10.5), 10.5) is None
    d = t.on_chunk(TokenChunk(rid="a", node="w2", index=3, token_ids=[4, 5], finished=True, finish_reason="length", ts=11.0), 11.0)
    assert d is not None
    assert (d.prefill_node, d.decode_node, d.prompt_tokens, d.cached_tokens, d.output_tokens) == ("w0", "w2", 100, 60, 5)
    assert d.arrived_at + d.ttft_s == pytest.approx(10.0)  # first-token time
    assert d.e2e_s == pytest.approx(3.0)
    # a one-token request finishes on its first chunk
    one = t.on_chunk(TokenChunk(rid="b", node="w1", index=0, token_ids=[9], prompt_tokens=8, finished=True, finish_reason="length", ts=5.0), 5.0)
    assert one is not None and one.output_tokens == 1
    # aborted and unknown streams give nothing
    t.on_chunk(TokenChunk(rid="c", node="w1", index=0, token_ids=[1], prompt_tokens=8, ts=1.0), 1.0)
    assert t.on_chunk(TokenChunk(rid="c", node="w1", index=1, finished=True, finish_reason="abort"), 2.0) is None
    assert t.on_chunk(TokenChunk(rid="zz", index=4, finished=True), 2.0) is None
    assert (t.completed, t.dropped, len(t)) == (2, 1, 0)


def test_request_tracker_is_bounded():
    t = RequestTracker(max_inflight=2)
    for i in range(3):
        t.on_chunk(TokenChunk(rid=f"r{i}", index=0, token_ids=[1], prompt_tokens=4), 0.0)
    assert len(t) == 2 and t.dropped == 1


def test_static_core_keeps_split_and_counts_unknown_nodes():
    core = PlannerCore(NODES, "2P2D")
    assert core.split == "2P2D" and core.next_tick() is None
    assert core.tick(5.0) is None and core.command.epoch == 1
    assert core.add_records(IterationRecords(node="wx", records=records(2, GB.prefill, GB.decode))) == 0
    assert not core.on_node_state(state("wx", "decode"), 0.0)
    assert core.records_unknown_node == 1 and core.states_unknown_node == 1
    assert core.take_models() is None


def test_operator_split_new_epoch_pending_until_applied():
    core = PlannerCore(NODES, "2P2D")
    cmd = core.set_split("3P1D", 7.0)
    assert cmd.epoch == 2 and split_name(cmd.phases) == "3P1D" and cmd.decided_at == 7.0
    assert core.busy(8.0) == {"w2"}  # the only node whose phase changed
    core.on_split_applied(SplitApplied(epoch=2, node="w2", phase="prefill", status="serving"), 9.0)
    assert core.busy(9.0) == set()
    ev = core.take_decisions()
    assert ev[0].policy == "operator" and ev[0].split_after == "3P1D" and ev[0].epoch == 2
    with pytest.raises(SplitError):
        core.set_split("3P3D", 10.0)
    with pytest.raises(SplitError):
        core.set_split("banana", 10.0)
    assert core.command.epoch == 2


def test_busy_times_out_and_follows_draining_states():
    core = PlannerCore(NODES, "2P2D", busy_timeout_s=100.0)
    core.set_split("1P3D", 0.0)
    assert core.busy(50.0) == {"w1"}
    assert core.busy(101.0) == set()
    core.on_node_state(state("w0", "prefill", accepting=False), 102.0)
    assert core.busy(102.0) == {"w0"}
    core.on_node_state(state("w0", "prefill"), 103.0)
    assert core.busy(103.0) == set()


def test_evolving_core_publishes_epochs_decisions_and_models():
    pol = make_planner("evolving", NODES, GB, t_learn_s=60.0, window_s=600.0, sample_interval_s=0.0)
    core = PlannerCore(NODES, "2P2D", policy=pol)
    assert core.take_models() is not None  # profile models before the fit
    assert core.next_tick() == 0.0
    # a fresh cluster starts in the warm-up's phases, as up launches the workers (session 59: 2P2D at epoch 1, then
    # every node switched to both at epoch 2 by the first tick)
    assert core.command.epoch == 1 and split_name(core.command.phases) == "collocated"
    assert core.tick(0.0) is None and core.command.epoch == 1 and "until t=60s" in core.command.reason
    assert core.busy(1.0) == set() and core.switches == 0
    for n in NODES:
        core.add_records(IterationRecords(node=n, records=records(100, GB.prefill, GB.decode, seed=1)), 30.0)
    assert core.next_tick() == 60.0
    cmd = core.tick(60.0)
    assert cmd is not None and cmd.epoch == 2 and split_name(cmd.phases) == "2P2D"
    models = core.take_models()
    assert models is not None and models.frozen and all(m.source == "fitted" for m in models.models)
    assert core.take_models() is None  # unchanged since
    evs = core.take_decisions()
    assert [e.action for e in evs] == ["warmup", "switch"] and [e.epoch for e in evs] == [1, 2]


def test_a_warm_up_extended_for_want_of_data_says_so_in_the_split_the_planner_answers():
    """`up`, then nothing sent for a while: the warm-up's end came with no iteration records, the planner extended
    it (its log: "warm-up extended to t=780s"), yet `split get` and the router's /v1/cluster kept saying "until
    t=60s" (the command's reason), long past t=60. The core's current command, same epoch and phases, now carries
    the extended end; nothing switches and no split change is counted."""
    pol = make_planner("evolving", NODES, GB, t_learn_s=60.0, window_s=600.0, sample_interval_s=0.0)
    core = PlannerCore(NODES, "2P2D", policy=pol)
    assert core.tick(0.0) is None  # launched collocated: the warm-up switches nothing, its reason is the split's
    cmd = core.command
    assert cmd.epoch == 1 and "until t=60s" in cmd.reason
    switches = core.switches
    assert core.tick(60.0) is None  # no records: not frozen, no new command
    now = core.command
    assert (now.epoch, split_name(now.phases), core.switches) == (1, "collocated", switches)
    end = pol.warmup_end
    assert end > 60.0 and f"until t={end:.0f}s" in now.reason and "extended: no data" in now.reason, now.reason
    assert now.reason.startswith("warm-up: every node serves both phases")
    assert core.on_foreign_command(cmd, 61.0, 1000) is None  # the old text's echo is still its own
    for n in NODES:  # data arrives: the warm-up restarts at the first record (test_warmup_first_record), and says so
        core.add_records(IterationRecords(node=n, records=records(100, GB.prefill, GB.decode, seed=1)), end - 1.0)
    assert core.tick(end) is None
    now = core.command
    assert now.epoch == 1 and pol.warmup_end == 720.0, pol.warmup_end  # 659 + 60 s, to the slice boundary
    assert "until t=720s" in now.reason and "restarted at the first iteration record" in now.reason, now.reason
    cmd = core.tick(pol.warmup_end)  # its end freezes and serves 2P2D, with its own reason
    assert cmd is not None and cmd.epoch == 2 and split_name(cmd.phases) == "2P2D"
    assert "extended" not in cmd.reason and "restarted" not in cmd.reason


def test_foreign_split_command_is_overridden_above_its_epoch():
    """The planner alone issues epochs: a forged command at an epoch ≥ the planner's is
    answered by the planner's own split one epoch above it; the operator's next split is
    newer still, so it always takes effect (issue 18)."""
    from shared.messages import SplitCommand

    core = PlannerCore(NODES, "2P2D")
    own = core.command
    assert core.on_foreign_command(own, 1.0, 1000) is None  # our own echo
    assert core.foreign_commands == 0
    stale = SplitCommand(epoch=0, phases={n: "decode" for n in NODES})
    assert core.on_foreign_command(stale, 1.0, 1000) is None and core.foreign_commands == 1
    huge = SplitCommand(epoch=10**15, phases={n: "both" for n in NODES})
    assert core.on_foreign_command(huge, 1.0, 1000) is None  # refused by every receiver too
    assert core.command == own
    forged = SplitCommand(epoch=own.epoch + 50, phases={"w0": "prefill", "w1": "decode", "w2": "decode", "w3": "decode"})
    again = core.on_foreign_command(forged, 2.0, 1000)
    assert again is not None and again.epoch == own.epoch + 51 and again.phases == own.phases
    assert core.command is again and core.foreign_commands == 3
    assert set(core.pending) == {"w1"}  # the node the forged command moved must switch back
    op = core.set_split("3P1D", 3.0)
    assert op.epoch == again.epoch + 1 and split_name(op.phases) == "3P1D"
