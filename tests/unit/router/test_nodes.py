"""Node view: eligibility, phases from the split, fencing by state age, in-flight counts."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as hs

from shared.messages import SplitCommand

from services.router.nodes import DECODE_PHASES, PREFILL_PHASES, NodeLoadView

from .helpers import state


def view(**kw) -> NodeLoadView:
    return NodeLoadView(fence_after=kw.pop("fence_after", 3.0))


def test_candidates_by_phase_sorted():
    v = view()
    v.apply_state(state("p2", "prefill"), 0.0)
    v.apply_state(state("c1", "both"), 0.0)
    v.apply_state(state("d1", "decode", running=3), 0.0)
    v.apply_state(state("p1", "prefill"), 0.0)
    assert [n.node for n in v.prefill_candidates(1.0)] == ["c1", "p1", "p2"]
    d = v.decode_candidates(1.0)
    assert [n.node for n in d] == ["d1"] and d[0].running == 3 and d[0].state_age(1.0) == 1.0


def test_a_node_load_carries_each_number_in_its_field():
    """``_load`` builds the NodeLoad positionally (in field order): every field holds its number."""
    from services.router.nodes import NodeLoad

    v = view()
    st = state("p1", "prefill", running=3, waiting=4, decoding=5, gpu_free_blocks=6, gpu_total_blocks=7)
    v.apply_state(st, 1.5)
    v.on_dispatch("r1", "p1", None)
    v.on_dispatch("r2", "p1", None)
    v.on_first_token("r2")
    ld = v.prefill_candidates(2.0)[0]
    assert ld == NodeLoad(
        node="p1", phase="prefill", inflight=2, inflight_prefill=1, inflight_decode=0, running=3, waiting=4,
        decoding=5, gpu_free_blocks=6, gpu_total_blocks=7, last_seen=1.5, state=st,
    )


def test_all_usable_with_no_fence_age_follows_fences_new_nodes_and_stale_kv_views():
    """With ``fence_after = inf`` the answer is kept between eligibility changes; a fence (a
    restarted node), its readmission, a new node and a stale KV view still change it."""
    v = NodeLoadView(fence_after=float("inf"))
    v.apply_state(state("a", seq=5), 0.0)
    v.apply_state(state("b"), 0.0)
    assert v.all_usable(1e9) and v.all_usable(2e9)
    v.apply_state(state("a", seq=1), 1.0)  # sequence went back: a new process
    assert v.all_usable(1.0)  # not fenced until check_fences
    assert [f.node for f in v.check_fences(1.0)] == ["a"]
    assert not v.all_usable(1.0) and not v.all_usable(2.0)
    v.apply_state(state("a", seq=2), 2.0)  # let back in
    assert v.all_usable(2.0)
    v.on_dispatch("r", "c", None)  # a node known only from a dispatch: usable
    assert v.all_usable(2.0)
    v.kv_stale = frozenset({"b"})
    assert not v.all_usable(2.0)
    v.kv_stale = frozenset()
    assert v.all_usable(2.0)


def test_fencing_by_state_age_and_readmission():
    v = view(fence_after=3.0)
    v.apply_state(state("a"), 0.0)
    v.apply_state(state("b"), 2.0)
    v.on_dispatch("r1", "a", None)
    v.on_dispatch("r2", "b", None)
    assert v.check_fences(3.0) == []  # age 3.0 is not > 3.0
    assert v.next_deadline() == 3.0
    # a is stale before check_fences runs: already not a candidate
    assert [n.node for n in v.prefill_candidates(3.5)] == ["b"]
    fenced = v.check_fences(3.5)
    assert [(f.node, f.age, f.rids) for f in fenced] == [("a", 3.5, ("r1",))]
    assert v.check_fences(4.0) == []  # fenced only once
    assert v.fenced_count() == 1
    assert v.next_deadline() == 5.0  # b's
    assert v.apply_state(state("a"), 4.0) is True  # let back in
    assert v.apply_state(state("a"), 4.1) is False
    assert [n.node for n in v.prefill_candidates(4.2)] == ["a", "b"]
    assert v.nodes["a"].fence_events == 1


def test_not_accepting_and_split_phase_mismatch_are_not_eligible():
    v = view()
    v.apply_state(state("a", "prefill", accepting=False), 0.0)
    v.apply_state(state("b", "prefill"), 0.0)
    v.apply_state(state("c", "decode"), 0.0)
    assert [n.node for n in v.prefill_candidates(0.0)] == ["b"]
    # the planner turns b into a decode node: b is skipped until it reports decode
    assert v.apply_split(SplitCommand(epoch=2, phases={"b": "decode", "c": "decode"}))
    assert v.prefill_candidates(0.0) == []
    assert [n.node for n in v.decode_candidates(0.0)] == ["c"]
    v.apply_state(state("b", "decode"), 0.1)
    assert [n.node for n in v.decode_candidates(0.2)] == ["b", "c"]
    assert v.nodes["b"].phase == "decode"
    ok, reason = v.routable(0.2)
    assert not ok and "prefill" in reason and "a: not accepting" in reason


def test_stale_split_is_ignored_same_epoch_replaces():
    v = view()
    assert v.apply_split(SplitCommand(epoch=3, phases={"a": "prefill"}))
    assert not v.apply_split(SplitCommand(epoch=2, phases={"a": "decode"}))
    assert v.nodes["a"].split_phase == "prefill"
    assert v.apply_split(SplitCommand(epoch=3, phases={"b": "decode"}))
    assert v.nodes["a"].split_phase is None and v.nodes["b"].split_phase == "decode"


def test_bad_node_ids_are_refused():
    v = view()
    with pytest.raises(ValueError):
        v.apply_state(state("a.b"), 0.0)
    with pytest.raises(ValueError):
        v.apply_split(SplitCommand(epoch=1, phases={"x y": "prefill"}))
    assert v.nodes == {} and v.epoch == -1


def test_inflight_bookkeeping():
    v = view()
    v.apply_state(state("p"), 0.0)
    v.apply_state(state("d", "decode"), 0.0)
    v.on_dispatch("r1", "p", "d")
    v.on_dispatch("r2", "p", "d")
    with pytest.raises(ValueError):
        v.on_dispatch("r1", "p", "d")
    p, d = v.nodes["p"], v.nodes["d"]
    assert (p.inflight, p.inflight_prefill, d.inflight, d.inflight_decode) == (2, 2, 2, 2)
    v.on_first_token("r1")
    v.on_first_token("r1")  # idempotent
    assert p.inflight_prefill == 1
    assert v.on_finish("r1") == ("p", "d")
    assert v.on_finish("r1") is None
    assert (p.inflight, p.inflight_prefill, d.inflight) == (1, 1, 1)
    assert v.on_finish("r2") == ("p", "d")
    assert (p.inflight, p.inflight_prefill, d.inflight, d.inflight_decode) == (0, 0, 0, 0)
    assert v.inflight_total == 0


def test_routable_reasons():
    v = view()
    assert v.routable(0.0) == (False, "no live prefill (phase prefill or both) node: no such node known")
    v.apply_state(state("p"), 0.0)
    ok, reason = v.routable(0.0)
    assert not ok and "decode" in reason
    v.apply_state(state("c", "both"), 0.0)
    assert v.routable(0.0) == (True, "")
    ok, reason = v.routable(10.0)
    assert not ok and "fenced" in reason
    snap = v.snapshot(10.0)
    assert [s["node"] for s in snap] == ["c", "p"] and snap[0]["fenced"] is True


def test_a_fenced_node_s_reason_says_restarted_or_silent_with_the_fence_time_in_the_same_unit():
    """After ``kill -9`` of a worker ``up`` restarted, /health said "w1: fenced (last state 41.6s ago)" 0.9 wall s
    after the kill, beside ``fence_after_s: 3.0`` in /v1/cluster: the age was simulated s (speedup 50), the fence
    time wall s, and the node was fenced for its restart, not its silence. The reason now says which, and gives
    the age with the fence time on the same clock."""
    v = view(fence_after=150.0)  # a router at --speedup 50: 3 wall s
    v.apply_state(state("d", "decode", seq=9), 0.0)
    v.apply_state(state("p", "prefill", seq=9), 0.0)
    v.apply_state(state("d", "decode", seq=1), 40.0)  # a new process under d's id
    assert [f.node for f in v.check_fences(41.6)] == ["d"]
    ok, reason = v.routable(41.6)
    assert not ok and "d: fenced (restarted" in reason and "41.6" not in reason, reason
    v.apply_state(state("d", "decode", seq=2), 42.0)  # back in at its next state
    assert v.routable(42.0) == (True, "")
    v.apply_state(state("p", "prefill", seq=10), 199.0)
    ok, reason = v.routable(200.0)  # d silent since 42
    assert not ok and "d: fenced (no state for 158.0 s, past the fence time of 150.0 s)" in reason, reason
    v.wall_per_s = 1 / 50  # the live router's: wall s, as /v1/cluster's fence_after_s (3.0)
    assert "d: fenced (no state for 3.2 wall s, past the fence time of 3.0 wall s)" in v.routable(200.0)[1]


def test_fence_after_must_be_positive():
    with pytest.raises(ValueError):
        NodeLoadView(fence_after=0)


# --------------------------------------------------------------------------- #
# cached candidate lists == recomputed from eligible() after any change
# --------------------------------------------------------------------------- #

_NODES = ["a", "b", "c", "d"]
_op = hs.one_of(
    hs.tuples(hs.just("state"), hs.sampled_from(_NODES), hs.sampled_from(["prefill", "decode", "both"]), hs.booleans(), hs.integers(0, 5)),
    hs.tuples(hs.just("split"), hs.dictionaries(hs.sampled_from(_NODES), hs.sampled_from(["prefill", "decode"]), max_size=4)),
    hs.tuples(hs.just("dispatch"), hs.sampled_from(_NODES), hs.sampled_from([None, *_NODES])),
    hs.tuples(hs.just("first"), hs.integers(0, 20)),
    hs.tuples(hs.just("finish"), hs.integers(0, 20)),
    hs.tuples(hs.just("rebind"), hs.integers(0, 20), hs.sampled_from(_NODES)),
    hs.tuples(hs.just("fences")),
    hs.tuples(hs.just("time"), hs.floats(-0.5, 2.5)),
)


def _expected(v: NodeLoadView, phases: frozenset[str], now: float) -> list[tuple]:
    out = []
    for rec in sorted(v.nodes.values(), key=lambda r: r.node):
        if v.eligible(rec, now) and rec.state is not None and rec.state.phase in phases:
            st = rec.state
            out.append((rec.node, st.phase, rec.inflight, rec.inflight_prefill, rec.inflight_decode, st.running, rec.last_seen, st))
    return out


@settings(max_examples=300, deadline=None)
@given(ops=hs.lists(_op, max_size=40))
def test_cached_candidates_match_a_fresh_computation(ops):
    v = view(fence_after=1.0)
    now, epoch, rid = 0.0, 0, 0
    for op in ops:
        kind = op[0]
        if kind == "state":
            v.apply_state(state(op[1], op[2], running=op[4], accepting=op[3]), now)
        elif kind == "split":
            epoch += 1
            v.apply_split(SplitCommand(epoch=epoch, phases=op[1]))
        elif kind == "dispatch":
            if op[2] != op[1]:
                v.on_dispatch(f"r{rid}", op[1], op[2])
                rid += 1
        elif kind == "first":
            v.on_first_token(f"r{op[1]}")
        elif kind == "finish":
            v.on_finish(f"r{op[1]}")
        elif kind == "rebind":
            v.rebind(f"r{op[1]}", op[2])
        elif kind == "fences":
            v.check_fences(now)
        else:
            now += op[1]
        for phases in (PREFILL_PHASES, DECODE_PHASES):
            got = [(n.node, n.phase, n.inflight, n.inflight_prefill, n.inflight_decode, n.running, n.last_seen, n.state) for n in v.candidates(phases, now)]
            assert got == _expected(v, phases, now), (kind, now)
        assert v.all_usable(now) == all(v.usable(n, now) for n in v.nodes), (kind, now)


_state_op = hs.one_of(
    hs.tuples(
        hs.just("state"), hs.sampled_from(_NODES[:2]), hs.sampled_from(["prefill", "both"]), hs.booleans(),
        hs.integers(0, 3), hs.sampled_from(["", "b1", "b2"]), hs.sampled_from([100, 200]),
    ),
    hs.tuples(hs.just("down"), hs.sampled_from(_NODES[:2]), hs.sampled_from([0, 7, 8])),
    hs.tuples(hs.just("fences")),
    hs.tuples(hs.just("time"), hs.floats(0.0, 1.5)),
)


@settings(max_examples=500, deadline=None)
@given(ops=hs.lists(_state_op, max_size=40))
@example(ops=[("state", "a", "both", True, 1, "b2", 100), ("state", "a", "both", True, 1, "b1", 100)])  # an older process
@example(ops=[("state", "a", "both", True, 2, "b1", 100), ("state", "a", "both", True, 1, "b1", 100)])  # a restart
@example(ops=[("state", "a", "both", True, 0, "", 100), ("down", "a", 7), ("state", "a", "both", True, 0, "", 100)])
@example(ops=[("state", "a", "both", True, 0, "", 100), ("time", 1.5), ("fences",), ("state", "a", "both", True, 0, "", 100)])
def test_the_usual_states_short_way_leaves_what_the_checks_leave(ops):
    """``apply_state`` takes the usual state (the same process's next, nothing to act on) without its
    checks: the same records, counters, candidate lists and answers as the full checks give (a view
    that knows a forgotten node, here one never seen, takes the full checks for every state)."""
    fast, full = view(fence_after=1.0), view(fence_after=1.0)
    full._forgotten.add("zz")
    answers: dict[int, list] = {id(fast): [], id(full): []}
    now = 0.0
    for op in ops:
        kind = op[0]
        for v in (fast, full):
            if kind == "state":
                _, node, phase, acc, seq, boot, total = op
                got = v.apply_state(state(node, phase, accepting=acc, seq=seq, boot=boot, gpu_total_blocks=total, pid=7), now)
                answers[id(v)].append(got)
            elif kind == "down":  # its supervisor saw pid op[2] exit (0: unknown pid, by wall time)
                answers[id(v)].append(v.fence_exited(op[1], 1, now, pid=op[2])[1])
            elif kind == "fences":
                v.check_fences(now)
        if kind == "time":
            now += op[1]
        for attr in ("state", "last_seen", "fenced", "restarted", "down"):
            assert {n: getattr(r, attr) for n, r in fast.nodes.items()} == {n: getattr(r, attr) for n, r in full.nodes.items()}, (attr, kind)
        assert (fast.superseded_states, fast.reported_alive, fast._gen, fast.kv_bounds() if fast.nodes else None) == (
            full.superseded_states, full.reported_alive, full._gen, full.kv_bounds() if full.nodes else None
        )
        assert answers[id(fast)] == answers[id(full)]
        for phases in (PREFILL_PHASES, DECODE_PHASES):
            assert fast.candidates(phases, now) == full.candidates(phases, now)


def test_a_node_restarted_faster_than_the_fence_is_fenced_at_once_and_let_back_in():
    """A supervisor restarts a killed worker within ~1 s, before its state goes silent for
    fence_after: the new process reports a state sequence that went back, and the requests the
    old process held must be re-dispatched all the same (issue #22), not left to time out."""
    v = view(fence_after=3.0)
    v.apply_state(state("a", seq=40), 0.0)
    v.apply_state(state("b", seq=7), 0.0)
    v.on_dispatch("r1", "a", "b")
    v.on_dispatch("r2", "b", "a")
    v.apply_state(state("a", seq=41), 0.5)
    assert v.check_fences(0.6) == []  # sequence went forward: same process
    v.apply_state(state("a", seq=1), 1.0)  # the restarted process
    fenced = v.check_fences(1.1)  # age 0.1 s, far below fence_after
    assert [(f.node, sorted(f.rids)) for f in fenced] == [("a", ["r1", "r2"])]
    assert v.check_fences(1.2) == []  # fenced once
    assert v.apply_state(state("a", seq=2), 1.5) is True  # its next state lets it back in
    assert v.check_fences(1.6) == []
