"""The 503 reason "no live prefill ... node" says a node's silence when its state is overdue but not yet fenced.

Session 51's SIGSTOP drill froze every worker: a request's 503 named ``w1: switching decode->both``, the planner's
split for it, though w1 was frozen too (its last state under the fence time old, so not fenced yet). The reason now
adds how long the node has been silent once that passes half the fence time (a node reports at least every
``--idle-state-interval-s``, 1 s), and when it is fenced if none comes."""

from __future__ import annotations

from shared.messages import SplitCommand

from services.router.nodes import NodeLoadView

from .helpers import state


def _frozen_pair(wall_per_s: float | None = None) -> NodeLoadView:
    """w0 (prefill) fenced long ago, w1 (decode) asked by the split to serve both, its last state at t=10."""
    v = NodeLoadView(fence_after=3.0, wall_per_s=wall_per_s)
    v.apply_state(state("w0", "prefill"), 0.0)
    v.apply_state(state("w1", "decode"), 10.0)
    v.apply_split(SplitCommand(epoch=1, phases={"w0": "prefill", "w1": "both"}, reason="w0 fenced"))
    return v


def test_a_switching_node_silent_past_half_the_fence_time_is_said_silent():
    v = _frozen_pair()
    why = v.no_candidate_reason("prefill", 12.4)
    # in parentheses: "; " separates nodes (before, the silence after it read like another node)
    assert "w1: switching decode->both;" not in why, why
    assert "w0: fenced (no state for 12.4 s, past the fence time of 3.0 s); w1: switching decode->both (no state for 2.4 s; fenced at 3.0 s if none comes)" in why, why
    assert "w0: fenced (no state for 12.4 s" in why, why
    # in wall seconds on a live router (its clock runs at a speedup: wall_per_s wall s a state-clock s)
    live = _frozen_pair(2.0).no_candidate_reason("prefill", 12.4)
    assert live.endswith("w0: fenced (no state for 24.8 wall s, past the fence time of 6.0 wall s); "
                         "w1: switching decode->both (no state for 4.8 wall s; fenced at 6.0 wall s if none comes)"), live
    assert " s)" not in live.replace("wall s)", ""), live  # one unit: wall s throughout (the fence time was "s")


def test_a_node_that_reported_lately_is_not_said_silent():
    why = _frozen_pair().no_candidate_reason("prefill", 11.0)
    assert "w1: switching decode->both" in why and "w1: switching decode->both;" not in why, why
