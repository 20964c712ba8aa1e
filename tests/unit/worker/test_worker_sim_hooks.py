"""The engine hooks the simulator drives: decode reservation at enqueue, gated prefill,
decode binding at prefill start, taking queued work back, emptying the caches."""

from __future__ import annotations

import pytest

from shared.messages import AllBlocksCleared, BlockStored
from services.worker.plan import HandOff, SchedulerError, TokensOut, WorkRejected


def test_reserve_then_handoff_uses_the_reservation(b, run):
    p = b.profile()
    dec = b.sched(p, phase="decode", node="w1")
    assert dec.reserve("a", 12, 4, 0.0) is True  # ceil(16/4) = 4 blocks
    st = dec.state(0.0)
    assert st.gpu_free_blocks == p.gpu_blocks - 4 and st.waiting == 1
    assert not dec.idle
    w = b.decode("a", [1, 2, 3], max_tokens=4, ready=0.5)
    dec.add_decode(w, 0.2)
    assert dec.schedule(0.2) is None and dec.next_deadline() == 0.5
    outs, _, _ = run(dec, 0.5)
    assert sum(o.count for o in outs if isinstance(o, TokensOut)) == 3
    assert dec.idle and dec.kv.gpu.available == dec.kv.gpu.capacity


def test_reservation_queues_fifo_and_is_granted_when_room_frees(b, run):
    p = b.profile()
    dec = b.sched(p, phase="decode", node="w1")
    assert dec.reserve("a", 200, 40, 0.0) is True  # 60 of 64 blocks
    assert dec.reserve("b", 20, 4, 0.0) is False  # 6 blocks: no room, queued
    assert dec.take_granted() == []
    assert dec.state(0.0).waiting == 2
    dec.add_decode(b.decode("a", list(range(50)), max_tokens=40, ready=0.0), 0.0)
    outs, _, t = run(dec, 0.0)
    assert any(o.finished for o in outs if isinstance(o, TokensOut))
    # a finished and freed its blocks; the queued reservation was granted by a schedule() call
    assert dec.take_granted() == ["b"]
    assert dec.requests["b"].state == "reserved"
    dec.add_decode(b.decode("b", [1, 2, 3, 4, 5], max_tokens=4, ready=t + 0.1), t)
    run(dec, t)
    assert dec.idle


def test_handoff_before_the_queued_reservation_waits_then_transfers(b, run):
    p = b.profile()
    dec = b.sched(p, phase="decode", node="w1")
    dec.reserve("a", 200, 40, 0.0)
    assert dec.reserve("b", 20, 4, 0.0) is False
    wb = b.decode("b", [1, 2, 3, 4, 5], max_tokens=4, ready=0.0)
    dec.add_decode(wb, 0.0)  # arrives while still queued: attaches, keeps its place
    assert dec.requests["b"].state == "decode_queued" and not dec.requests["b"].awaiting_handoff
    dec.add_decode(b.decode("a", list(range(50)), max_tokens=40, ready=0.0), 0.0)
    outs, _, _ = run(dec, 0.0)
    finished = [o.rid for o in outs if isinstance(o, TokensOut) and o.finished]
    assert finished == ["a", "b"]
    assert dec.take_granted() == []  # b was a full hand-off when room came: no grant event


def test_reservation_mismatch_and_refusals(b):
    p = b.profile()
    dec = b.sched(p, phase="decode", node="w1")
    dec.reserve("a", 12, 4, 0.0)
    with pytest.raises(WorkRejected, match="does not match the reservation"):
        dec.add_decode(b.decode("a", [1, 2, 3], max_tokens=5), 0.0)
    with pytest.raises(WorkRejected, match="already on node"):
        dec.reserve("a", 12, 4, 0.0)
    with pytest.raises(WorkRejected, match="KV blocks"):
        dec.reserve("huge", 1000, 4, 0.0)
    pre = b.sched(p, phase="prefill", node="w0")
    with pytest.raises(WorkRejected, match="serves prefill"):
        pre.reserve("x", 12, 4, 0.0)
    assert dec.abort("a", 0.0) and dec.kv.gpu.available == dec.kv.gpu.capacity


def test_gated_prefill_waits_for_open_gate(b, run):
    p = b.profile()
    pre = b.sched(p, phase="prefill", node="w0")
    pre.add_prefill(b.prefill("a", [1, 2], max_tokens=3, decode_node="w1"), 0.0, gated=True)
    assert pre.schedule(0.0) is None
    st = pre.state(0.0)
    assert st.waiting == 1 and [q.rid for q in st.queue] == ["a"]
    assert pre.open_gate("a", 1.0) and not pre.open_gate("a", 1.0)
    plan = pre.schedule(1.0)
    assert plan is not None and plan.admitted == ["a"]
    outs = pre.finish_iteration(plan, plan.end)
    assert [type(o) for o in outs] == [TokensOut, HandOff]
    assert outs[0].queue_s == pytest.approx(1.0), "the bootstrap wait counts as prefill queueing"


def test_decode_later_binds_at_prefill_start(b):
    p = b.profile()
    pre = b.sched(p, phase="prefill", node="w0")
    with pytest.raises(WorkRejected, match="decode_later"):
        pre.add_prefill(b.prefill("z", [1], decode_node="w1"), 0.0, decode_later=True)
    pre.add_prefill(b.prefill("a", [1, 2], max_tokens=3), 0.0, decode_later=True)
    pre.add_prefill(b.prefill("c", [5, 6], max_tokens=3), 0.0, decode_later=True)
    plan = pre.schedule(0.0)
    assert plan.admitted == ["a", "c"]
    assert pre.bind_decode("a", "w1", 0.0) == []  # bound while its prefill runs: the plan hands it off
    with pytest.raises(SchedulerError, match="not waiting"):
        pre.bind_decode("a", "w2", 0.0)
    with pytest.raises(SchedulerError, match="another node"):
        pre.bind_decode("c", "w0", 0.0)
    outs = pre.finish_iteration(plan, plan.end)
    assert [(type(o), o.rid) for o in outs] == [(TokensOut, "a"), (HandOff, "a"), (TokensOut, "c")]  # c parked: its first token only
    assert list(pre.parked) == ["c"] and "c" in pre.requests


def test_decode_later_full_cycle(b, run):
    p = b.profile()
    pre = b.sched(p, phase="prefill", node="w0")
    pre.add_prefill(b.prefill("a", [1, 2], max_tokens=3), 0.0, decode_later=True)
    plan = pre.schedule(0.0)
    pre.bind_decode("a", "w1", 0.0)
    (tok, h) = pre.finish_iteration(plan, plan.end)
    assert isinstance(h, HandOff) and h.decode_node == "w1"
    assert pre.idle


def test_take_queued_returns_unstarted_work_only(b):
    p = b.profile(scheduler__chunk_tokens=32, scheduler__max_running=8)
    pre = b.sched(p, phase="prefill", node="w0")
    w1 = b.prefill("a", list(range(1, 11)), max_tokens=3, decode_node="w1")  # 40 tokens: 2 chunks
    w2 = b.prefill("b", [20, 21], max_tokens=3, decode_node="w1")
    w3 = b.prefill("c", [30, 31], max_tokens=3, decode_node="w1")
    pre.add_prefill(w1, 0.0)
    pre.add_prefill(w3, 0.0, gated=True)
    plan = pre.schedule(0.0)  # a starts (32 tokens), budget exhausted
    pre.add_prefill(w2, 0.0)
    got = pre.take_queued(0.0)
    assert [w.rid for w in got] == ["c", "b"], "gated first, then waiting, each in arrival order"
    assert set(pre.requests) == {"a"}
    pre.finish_iteration(plan, plan.end)
    assert not pre.idle


def test_clear_caches_empties_l1_and_l2_and_announces_it(b, run):
    p = b.profile()
    s = b.sched(p, phase="both")
    s.add_prefill(b.prefill("a", [1, 2, 3], max_tokens=2), 0.0)
    with pytest.raises(SchedulerError, match="clear_caches"):
        s.clear_caches(0.0)
    run(s, 0.0)
    assert s.idle and s.kv.gpu.blocks and s.kv.host.blocks
    s.take_kv_events()
    s.clear_caches(1.0)
    assert not s.kv.gpu.blocks and not s.kv.host.blocks
    assert s.take_kv_events() == [AllBlocksCleared()]
    assert s.kv.host.evictable.policy.name == "lru"
    # the node keeps working after the relaunch
    s.add_prefill(b.prefill("b", [1, 2, 3], max_tokens=2), 1.0)
    outs, _, _ = run(s, 1.0)
    first = [o for o in outs if isinstance(o, TokensOut) and o.index == 0]
    assert first[0].cached_tokens == 0, "nothing cached survives"
    assert any(isinstance(e, BlockStored) for e in s.take_kv_events())


def test_branch_count_policy_survives_clear(b):
    s = b.sched(b.profile(), phase="both", host_eviction="branch-count")
    s.clear_caches(0.0)
    assert s.kv.host.evictable.policy.name == "branch-count"


def test_state_without_queue_keeps_the_counts(b):
    s = b.sched(b.profile(), phase="prefill", node="w0")
    for i in range(3):
        s.add_prefill(b.prefill(f"r{i}", [10 * i + 1, 10 * i + 2], max_tokens=3, decode_node="w1"), 0.0)
    full, light = s.state(0.0), s.state(0.0, with_queue=False)
    assert len(full.queue) == 3 and light.queue == []
    assert (light.waiting, light.running, light.gpu_free_blocks) == (full.waiting, full.running, full.gpu_free_blocks)


def test_a_prefill_that_finishes_before_its_binding_is_parked_with_its_kv_held(b):
    """A ``decode_later`` request whose prompt completes before ``bind_decode`` (its route.bind is still
    under way) gives its first token at once and leaves the running batch but keeps its prompt pages: they
    count against L1, so a request that needs them waits; ``bind_decode`` then returns its hand-off at the
    binding's time and frees them. An abort of a parked request frees them too. Before 77f120e,
    ``finish_iteration`` raised ``SchedulerError`` (the live shell waited for the binding inside its step
    loop instead); then the first token waited for ``bind_decode`` too (the router's round trip in TTFT)."""
    p = b.profile(memory__gpu_kv_tokens=64, scheduler__chunk_tokens=64)  # 16 pages of 4 tokens; a prompt in one chunk
    pre = b.sched(p, phase="prefill", node="w0")
    pre.add_prefill(b.prefill("a", list(range(1, 11)), max_tokens=3), 0.0, decode_later=True)  # 10 pages
    plan = pre.schedule(0.0)
    assert plan.admitted == ["a"] and plan.prefill[0].completes
    (tok,) = pre.finish_iteration(plan, plan.end)  # its first token at its prompt's end: it needs no decode node
    assert isinstance(tok, TokensOut) and (tok.rid, tok.index, tok.count, tok.finished, tok.at) == ("a", 0, 1, False, plan.end)
    assert list(pre.parked) == ["a"] and not pre.running and not pre.idle
    st = pre.state(plan.end)
    assert (st.running, st.waiting, st.decoding) == (0, 0, 0) and st.gpu_free_blocks == 6  # its 10 pages stay held
    pre.add_prefill(b.prefill("x", list(range(20, 28)), max_tokens=3), 1.0, decode_later=True)  # 8 pages: no room
    assert pre.schedule(1.0) is None and list(pre.waiting) == ["x"]
    (h,) = pre.bind_decode("a", "w1", 2.0)  # the hand-off only: its first token is out
    assert isinstance(h, HandOff) and (h.decode_node, h.at, h.work.generated) == ("w1", 2.0, 1)
    assert h.work.kv_ready_at == pytest.approx(2.0 + p.kv_transfer_s(40))  # the transfer starts at the binding
    assert "a" not in pre.requests and not pre.parked
    plan = pre.schedule(2.0)  # a's pages are unreferenced now: x fits
    assert plan is not None and plan.admitted == ["x"]
    assert [(o.rid, o.index) for o in pre.finish_iteration(plan, plan.end)] == [("x", 0)] and list(pre.parked) == ["x"]
    assert pre.abort("x", 3.0) and pre.idle and pre.state(3.0).gpu_free_blocks == 16
    pre.check()
