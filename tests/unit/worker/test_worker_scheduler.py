"""EngineScheduler: chunking, running-first budget, cap, collocated and PD flows,
decode KV arrival, abort, Eq. 1/2 durations, skip-ahead equivalence, state and records."""

from __future__ import annotations

import pytest

from shared.messages import BlockStored, QueuedWork
from services.worker.plan import HandOff, SchedulerError, TokensOut, WorkRejected
from services.worker.scheduler import EngineScheduler


def tokens(outs, rid=None):
    return [o for o in outs if isinstance(o, TokensOut) and (rid is None or o.rid == rid)]


def finish(s: EngineScheduler, plan):
    return s.finish_iteration(plan, plan.end)


# --------------------------------------------------------------------------- #
# chunked prefill and the token budget
# --------------------------------------------------------------------------- #


def test_chunked_prefill_at_8192_tokens(b):
    p = b.profile("gb300-glm52")
    s = b.sched(p)
    s.add_prefill(b.prefill("a", list(range(312)), tail=32, bs=64), 0.0)  # 20,000 tokens
    chunks = []
    now = 0.0
    for _ in range(3):
        plan = s.schedule(now)
        chunks += [(c.tokens, c.cached_before, c.completes) for c in plan.prefill]
        assert plan.decode == []
        now = plan.end
        finish(s, plan)
    assert chunks == [(8192, 0, False), (8192, 8192, False), (3616, 16384, True)]
    assert s.state(now).decoding == 1


def test_running_requests_get_budget_before_waiting_ones(b):
    s = b.sched(b.profile("gb300-glm52"))
    s.add_prefill(b.prefill("a", list(range(312)), tail=32, bs=64, max_tokens=8), 0.0)  # 20,000
    s.add_prefill(b.prefill("b", list(range(1000, 1078)), tail=8, bs=64, max_tokens=8), 0.0)  # 5,000
    seen = []
    now = 0.0
    for _ in range(4):
        plan = s.schedule(now)
        seen.append(([(c.rid, c.tokens) for c in plan.prefill], plan.decode))
        now = plan.end
        finish(s, plan)
    assert seen[0] == ([("a", 8192)], [])
    assert seen[1] == ([("a", 8192)], [])
    assert seen[2] == ([("a", 3616), ("b", 8192 - 3616)], [])
    # a decodes now: it takes ceil(t_fwd) = 4 tokens of budget first, b's rest follows
    assert seen[3] == ([("b", 5000 - 4576)], ["a"])


def test_decoding_requests_consume_budget(b):
    s = b.sched()  # tiny: chunk 32, t_fwd 2
    for i in range(3):
        s.add_prefill(b.prefill(f"d{i}", [10 * i + 1], max_tokens=50), 0.0)
    now = 0.0
    plan = s.schedule(now)
    assert len(plan.prefill) == 3
    now = plan.end
    finish(s, plan)
    s.add_prefill(b.prefill("big", list(range(100, 110))), now)  # 40 tokens
    plan = s.schedule(now)
    assert plan.decode == ["d0", "d1", "d2"]
    assert [(c.rid, c.tokens) for c in plan.prefill] == [("big", 32 - 3 * 2)]


def test_cap_on_running_requests(b):
    s = b.sched(b.profile(scheduler__max_running=3, scheduler__chunk_tokens=64))
    for i in range(5):
        s.add_prefill(b.prefill(f"r{i}", [i + 1], max_tokens=3), 0.0)
    plan = s.schedule(0.0)
    assert [c.rid for c in plan.prefill] == ["r0", "r1", "r2"]
    st = s.state(0.0)
    assert (st.running, st.waiting) == (3, 2)
    outs, plans, _ = _drain(s, plan)
    assert max(len(p.prefill) + len(p.decode) for p in plans) <= 3
    assert {o.rid for o in tokens(outs) if o.finished} == {f"r{i}" for i in range(5)}
    first = {o.rid: o for o in tokens(outs) if o.index == 0}
    assert first["r0"].queue_s == 0.0
    r3_start = min(p_.start for p_ in plans if any(c.rid == "r3" for c in p_.prefill))
    assert first["r3"].queue_s == r3_start > 0, "queue time = arrival → first chunk launch"


def _drain(s, plan):
    outs = finish(s, plan)
    plans = [plan]
    now = plan.end
    while (plan := s.schedule(now)) is not None:
        plans.append(plan)
        now = plan.end
        outs += finish(s, plan)
    return outs, plans, now


def test_request_that_does_not_fit_waits_fcfs(b):
    s = b.sched()  # L1 = 64 blocks of 4 tokens
    s.add_prefill(b.prefill("big", list(range(40)), max_tokens=60), 0.0)  # 40 + 15 = 55 blocks
    s.add_prefill(b.prefill("next", [500, 501], max_tokens=40), 0.0)  # 2 + 10 = 12 blocks: must wait
    s.add_prefill(b.prefill("small", [600], max_tokens=2), 0.0)  # would fit, but FCFS keeps it behind
    plan = s.schedule(0.0)
    assert [c.rid for c in plan.prefill] == ["big"]
    assert s.state(0.0).waiting == 2
    outs, plans, _ = _drain(s, plan)
    admitted = {}
    for p_ in plans:
        for c in p_.prefill:
            admitted.setdefault(c.rid, p_.start)
    assert admitted["big"] < admitted["next"] <= admitted["small"]
    assert {o.rid for o in tokens(outs) if o.finished} == {"big", "next", "small"}


# --------------------------------------------------------------------------- #
# collocated decode, PD hand-off, decode side
# --------------------------------------------------------------------------- #


def test_collocated_prefill_then_local_decode_with_fractional_t_acc(b, run):
    s = b.sched()  # t_acc = 1.5
    s.add_prefill(b.prefill("a", [1, 2], tail=1, max_tokens=6), 0.0)
    outs, plans, _ = run(s)
    got = [(o.index, o.count, o.finished) for o in tokens(outs)]
    assert got == [(0, 1, False), (1, 1, False), (2, 2, False), (4, 1, False), (5, 1, True)]
    assert tokens(outs)[0].prompt_tokens == 9 and tokens(outs)[-1].finish_reason == "length"
    assert [p.phase for p in plans] == ["prefill", "decode", "decode", "decode", "decode"]
    assert not any(isinstance(o, HandOff) for o in outs)
    assert s.kv.gpu.available == s.kv.gpu.capacity


def test_max_tokens_one_finishes_at_prefill(b, run):
    s = b.sched()
    s.add_prefill(b.prefill("a", [1], tail=2, max_tokens=1), 0.0)
    outs, plans, _ = run(s)
    assert [(o.index, o.count, o.finished) for o in tokens(outs)] == [(0, 1, True)]
    assert len(plans) == 1


def test_pd_handoff_then_decode_after_kv_ready(b, run):
    p = b.profile()
    pre = b.sched(p, phase="prefill", node="w0")
    dec = b.sched(p, phase="decode", node="w1")
    w = b.prefill("a", [1, 2, 3], tail=2, max_tokens=5, decode_node="w1")
    pre.add_prefill(w, 0.0)
    outs, _, t_done = run(pre)
    first = tokens(outs)
    assert [(o.index, o.count, o.finished) for o in first] == [(0, 1, False)]
    (h,) = [o for o in outs if isinstance(o, HandOff)]
    assert h.decode_node == "w1"
    assert h.work.kv_ready_at == pytest.approx(t_done + p.kv_transfer_s(14))
    assert (h.work.generated, h.work.prefill_node, h.work.block_hashes) == (1, "w0", w.block_hashes)
    assert h.work.kv_bytes == 14 * p.kv_bytes_per_token
    # the prefill node keeps the pages cached, unreferenced
    assert pre.kv.match(w.block_hashes, 3) == (3, 0)
    assert pre.kv.gpu.available == pre.kv.gpu.capacity
    assert "a" not in pre.requests

    dec.take_kv_events()
    dec.add_decode(h.work, t_done)
    assert dec.schedule(t_done) is None, "KV not there yet"
    assert dec.next_deadline() == h.work.kv_ready_at
    assert dec.state(t_done).waiting == 1
    outs2, plans2, _ = run(dec, h.work.kv_ready_at)
    assert plans2[0].start == h.work.kv_ready_at and plans2[0].phase == "decode"
    got = [(o.index, o.count) for o in tokens(outs2)]
    assert got[0][0] == 1 and sum(c for _, c in got) == 4 and tokens(outs2)[-1].finished
    ev = dec.take_kv_events()
    assert [e.block_hashes for e in ev if isinstance(e, BlockStored)] == [w.block_hashes] * 2, "L1 then L2 write-through"


def test_decode_waits_for_l1_room_then_transfers(b, run):
    p = b.profile()
    dec = b.sched(p, phase="decode")
    first = b.decode("x", list(range(30)), max_tokens=40, ready=0.0)  # 30 + 10 = 40 blocks
    second = b.decode("y", list(range(100, 120)), max_tokens=40, ready=0.0)  # 20 + 10 = 30 blocks
    dec.add_decode(first, 0.0)
    dec.add_decode(second, 0.0)
    assert dec.state(0.0).waiting == 2 and "y" in dec.decode_queue
    outs, plans, _ = run(dec, 0.0)
    x_done = next(o.at for o in tokens(outs, "x") if o.finished)
    y_first = min(p_.start for p_ in plans if "y" in p_.decode)
    assert y_first == pytest.approx(x_done + p.kv_transfer_s(80))
    assert any(o.finished for o in tokens(outs, "y"))


def test_decode_node_never_reads_host_memory(b, run):
    dec = b.sched(phase="decode")
    w = b.decode("x", [1, 2, 3], max_tokens=2)
    dec.add_decode(w, 0.0)
    run(dec)
    assert all(r.sum_restored == 0 for r in dec.take_records())


# --------------------------------------------------------------------------- #
# prefix reuse and restore inside the node
# --------------------------------------------------------------------------- #


def test_l1_hit_is_capped_so_one_token_is_computed(b, run):
    s = b.sched()
    s.add_prefill(b.prefill("a", [1, 2, 3], max_tokens=1), 0.0)
    run(s)
    s.take_kv_events()
    s.add_prefill(b.prefill("b", [1, 2, 3], max_tokens=1), 1.0)
    plan = s.schedule(1.0)
    (c,) = plan.prefill
    assert (c.cached_before, c.tokens, c.restored) == (8, 4, 0)
    outs = finish(s, plan)
    assert tokens(outs)[0].cached_tokens == 8
    assert not any(isinstance(e, BlockStored) for e in s.take_kv_events()), "recomputed page already cached"


def test_l2_restore_counts_as_t_rst(b, run):
    p = b.profile()
    s = b.sched(p)
    s.add_prefill(b.prefill("a", [1, 2, 3, 4, 5], tail=1, max_tokens=1), 0.0)
    _, _, now = run(s)
    # push a's pages out of L1 (64 blocks) with other prompts
    for i in range(4):
        s.add_prefill(b.prefill(f"f{i}", list(range(100 * (i + 1), 100 * (i + 1) + 16)), max_tokens=1), now)
    _, _, now = run(s, now)
    assert s.kv.match(b.path([1, 2, 3, 4, 5]), 5) == (0, 5)
    s.add_prefill(b.prefill("a2", [1, 2, 3, 4, 5, 6], tail=3, max_tokens=1), now)
    plan = s.schedule(now)
    (c,) = plan.prefill
    assert (c.cached_before, c.restored, c.tokens) == (20, 20, 7)
    assert plan.sum_restored == 20
    assert plan.prefill_s == pytest.approx(p.prefill.c0 + p.prefill.c1 * 7 + p.prefill.c2 * (7 * 20 + 7 * 8 / 2) + p.prefill.c3 * 20)
    assert tokens(finish(s, plan))[0].cached_tokens == 20


# --------------------------------------------------------------------------- #
# durations by hand (Eq. 1 / Eq. 2)
# --------------------------------------------------------------------------- #


def test_durations_match_eq1_eq2_by_hand(b):
    p = b.profile(prefill__c0=0.01, prefill__c1=1e-4, prefill__c2=1e-6, prefill__c3=0.0,
                  decode__d0=0.003, decode__d1=0.02, decode__d2=0.001,
                  decode__active_experts=2, decode__experts=8, decode__tokens_per_forward=2.0)
    s = b.sched(p)
    s.add_prefill(b.prefill("a", [1, 2, 3], tail=2, max_tokens=10), 0.0)  # 14 tokens
    s.add_prefill(b.prefill("b", [7, 8], max_tokens=10), 0.0)  # 8 tokens
    plan = s.schedule(0.0)
    # chunk a: 14 tokens at t_c 0; chunk b: 8 tokens at t_c 0 (budget 32)
    A = 14 * 15 / 2 + 8 * 9 / 2
    assert plan.sum_qk_pairs == A
    assert plan.iteration_s == pytest.approx(0.01 + 1e-4 * 22 + 1e-6 * A)
    finish(s, plan)
    plan = s.schedule(plan.end)  # pure decode, B = 2
    phi = 1 - (1 - 2 / 8) ** (2 * 2)
    assert plan.phase == "decode"
    assert plan.iteration_s == pytest.approx(0.003 + 0.02 * phi + 0.001 * 2)
    finish(s, plan)
    s.add_prefill(b.prefill("c", [20, 21], tail=1, max_tokens=3), plan.end)  # 9 tokens
    plan = s.schedule(plan.end)
    assert plan.phase == "mixed"
    t_p = 0.01 + 1e-4 * 9 + 1e-6 * (9 * 10 / 2)
    t_d = 0.003 + 0.02 * phi + 0.001 * 2
    assert plan.iteration_s == pytest.approx(t_p + t_d - 0.003)
    assert (plan.prefill_s, plan.decode_s) == (pytest.approx(t_p), pytest.approx(t_d))


def test_second_chunk_counts_first_chunk_as_cached(b):
    p = b.profile()
    s = b.sched(p)
    s.add_prefill(b.prefill("a", list(range(1, 13)), max_tokens=1), 0.0)  # 48 tokens, chunks 32 + 16
    plan = s.schedule(0.0)
    finish(s, plan)
    plan = s.schedule(plan.end)
    (c,) = plan.prefill
    assert (c.tokens, c.cached_before) == (16, 32)
    assert plan.sum_qk_pairs == 16 * 32 + 16 * 17 // 2


# --------------------------------------------------------------------------- #
# abort
# --------------------------------------------------------------------------- #


def test_abort_releases_blocks_in_every_state(b):
    s = b.sched(b.profile(scheduler__max_running=1, scheduler__chunk_tokens=32))
    s.add_prefill(b.prefill("run", list(range(1, 13)), max_tokens=4), 0.0)
    s.add_prefill(b.prefill("wait", [50], max_tokens=4), 0.0)
    plan = s.schedule(0.0)
    assert s.kv.gpu.reserved > 0
    assert s.abort("wait", 0.0) and not s.abort("wait", 0.0)
    assert s.abort("run", 0.001), "abort while its chunk is in flight"
    assert finish(s, plan) == []
    assert s.kv.gpu.reserved == 0 and s.kv.gpu.available == s.kv.gpu.capacity
    assert s.schedule(plan.end) is None
    assert not s.abort("nope", 1.0)


def test_abort_decoding_and_transferring(b, run):
    dec = b.sched(phase="decode")
    dec.add_decode(b.decode("x", [1, 2], max_tokens=50), 0.0)
    dec.add_decode(b.decode("y", [3, 4], max_tokens=50, ready=10.0), 0.0)
    plan = dec.schedule(0.0)
    finish(dec, plan)
    assert dec.abort("x", plan.end) and dec.abort("y", plan.end)
    assert dec.kv.gpu.available == dec.kv.gpu.capacity
    assert dec.next_deadline() is None and dec.schedule(plan.end) is None


# --------------------------------------------------------------------------- #
# bad input and phases
# --------------------------------------------------------------------------- #


def test_rejections(b):
    s = b.sched(phase="decode")
    with pytest.raises(WorkRejected, match="serves decode"):
        s.add_prefill(b.prefill("a", [1]), 0.0)
    p = b.sched(phase="prefill")
    with pytest.raises(WorkRejected, match="serves prefill"):
        p.add_decode(b.decode("a", [1]), 0.0)
    with pytest.raises(WorkRejected, match="must name a decode node"):
        p.add_prefill(b.prefill("a", [1]), 0.0)
    c = b.sched()
    with pytest.raises(WorkRejected, match="block size mismatch"):
        c.add_prefill(b.prefill("a", [1], bs=8), 0.0)
    w = b.prefill("a", [1, 2])
    import msgspec

    with pytest.raises(WorkRejected, match="block hashes"):
        c.add_prefill(msgspec.structs.replace(w, block_hashes=w.block_hashes[:1]), 0.0)
    with pytest.raises(WorkRejected, match="KV blocks"):
        c.add_prefill(b.prefill("big", list(range(60)), max_tokens=40), 0.0)
    c.add_prefill(w, 0.0)
    with pytest.raises(WorkRejected, match="already"):
        c.add_prefill(w, 0.0)
    with pytest.raises(WorkRejected, match="nothing to decode"):
        c.add_decode(b.decode("d", [1], max_tokens=1), 0.0)
    assert set(c.requests) == {"a"}


def test_set_phase_changes_what_is_accepted_only(b, run):
    s = b.sched()
    s.add_prefill(b.prefill("a", [1], max_tokens=3), 0.0)
    s.set_phase("decode", 0.0)
    with pytest.raises(WorkRejected):
        s.add_prefill(b.prefill("b", [2]), 0.0)
    outs, _, _ = run(s)
    assert tokens(outs)[-1].finished, "queued work still runs"
    with pytest.raises(ValueError):
        s.set_phase("sideways", 0.0)  # type: ignore[arg-type]


def test_misuse_of_the_step_contract(b):
    s = b.sched()
    s.add_prefill(b.prefill("a", [1]), 0.0)
    plan = s.schedule(0.0)
    with pytest.raises(SchedulerError):
        s.schedule(0.0)
    other = b.sched()
    other.add_prefill(b.prefill("a", [1]), 0.0)
    with pytest.raises(SchedulerError):
        s.finish_iteration(other.schedule(0.0), 1.0)
    finish(s, plan)


def test_profile_with_too_small_budget_is_refused(b):
    with pytest.raises(ValueError, match="chunk_tokens"):
        EngineScheduler("w0", b.profile(scheduler__chunk_tokens=16), "both")


# --------------------------------------------------------------------------- #
# skip-ahead
# --------------------------------------------------------------------------- #


def _decode_scenario(b):
    dec = b.sched(phase="decode")
    for i, mt in enumerate((7, 19, 33, 34)):
        dec.add_decode(b.decode(f"r{i}", [10 * i + 1, 10 * i + 2], max_tokens=mt), 0.0)
    dec.add_decode(b.decode("late", [90, 91], max_tokens=12, ready=0.05), 0.0)
    return dec


def _timeline(outs):
    per: dict[str, list[tuple[int, int]]] = {}
    done: dict[str, float] = {}
    for o in tokens(outs):
        per.setdefault(o.rid, []).append((o.index, o.count))
        if o.finished:
            done[o.rid] = o.at
    return per, done


def test_skip_ahead_equals_single_steps(b, run):
    single = _decode_scenario(b)
    outs1, plans1, end1 = run(single, 0.0, None)
    multi = _decode_scenario(b)
    outs2, plans2, end2 = run(multi, 0.0, 1e9)
    assert all(p.iterations == 1 for p in plans1)
    assert any(p.iterations > 1 for p in plans2), "skip-ahead must fold iterations"
    assert len(plans2) < len(plans1)
    assert sum(p.iterations for p in plans2) == len(plans1) == single.iterations == multi.iterations
    per1, done1 = _timeline(outs1)
    per2, done2 = _timeline(outs2)
    for rid in per1:
        total1 = sum(c for _, c in per1[rid])
        total2 = sum(c for _, c in per2[rid])
        assert total1 == total2
        # ranges are contiguous in both runs
        for per in (per1, per2):
            idx = [i for i, _ in per[rid]]
            cnt = [c for _, c in per[rid]]
            assert all(idx[j] + cnt[j] == idx[j + 1] for j in range(len(idx) - 1))
        assert done1[rid] == pytest.approx(done2[rid], rel=1e-9)
    assert end1 == pytest.approx(end2, rel=1e-9)
    r1 = single.take_records()
    r2 = multi.take_records()
    assert sum(r.repeat for r in r2) == len(r1)
    # the late arrival joins at the first iteration boundary at or after its kv_ready_at
    join1 = min(p.start for p in plans1 if "late" in p.decode)
    join2 = min(p.start for p in plans2 if "late" in p.decode)
    assert join1 == pytest.approx(join2, rel=1e-9) and join1 >= 0.05


def test_skip_ahead_stops_before_the_horizon(b):
    s = b.sched(phase="decode")
    s.add_decode(b.decode("r", [1, 2], max_tokens=200), 0.0)
    plan = s.schedule(0.0, horizon=0.05)
    assert plan.iterations > 1
    assert plan.start + (plan.iterations - 1) * plan.iteration_s < 0.05 <= plan.end
    assert s.take_records() == []
    finish(s, plan)
    (rec,) = s.take_records()
    assert rec.repeat == plan.iterations and rec.phase == "decode" and rec.decode_batch == 1


def test_truncate_cuts_a_folded_plan_at_the_next_boundary(b):
    folded = b.sched(phase="decode")
    folded.add_decode(b.decode("r", [1, 2], max_tokens=200), 0.0)
    plan = folded.schedule(0.0, horizon=1e9)
    k = plan.iterations
    assert k > 3
    cut_at = plan.start + 2.5 * plan.iteration_s
    end = folded.truncate(plan, cut_at)
    assert plan.iterations == 3 and end == pytest.approx(plan.start + 3 * plan.iteration_s)
    assert folded.truncate(plan, plan.start + 10 * plan.iteration_s) == end  # a later cut never grows it back
    outs = finish(folded, plan)
    single = b.sched(phase="decode")
    single.add_decode(b.decode("r", [1, 2], max_tokens=200), 0.0)
    got = []
    t = 0.0
    for _ in range(3):
        p = single.schedule(t)
        got += finish(single, p)
        t = p.end
    assert sum(o.count for o in tokens(outs)) == sum(o.count for o in tokens(got))
    assert t == pytest.approx(end)


def test_no_skip_ahead_while_prefill_runs(b):
    s = b.sched()
    s.add_prefill(b.prefill("a", [1], max_tokens=30), 0.0)
    plan = s.schedule(0.0, horizon=100.0)
    finish(s, plan)
    s.add_prefill(b.prefill("b", list(range(10, 20)), max_tokens=30), plan.end)
    plan = s.schedule(plan.end, horizon=100.0)
    assert plan.phase == "mixed" and plan.iterations == 1


# --------------------------------------------------------------------------- #
# state and records
# --------------------------------------------------------------------------- #


def test_state_reports_queue_kv_and_remaining_time(b):
    s = b.sched(b.profile(scheduler__max_running=1))
    s.add_prefill(b.prefill("a", list(range(1, 13)), max_tokens=2), 0.0)  # 48 tokens → 2 chunks
    s.add_prefill(b.prefill("b", [1, 2, 3, 40], tail=1, max_tokens=2), 0.0)
    plan = s.schedule(0.0)
    st = s.state(plan.start + plan.iteration_s / 4)
    assert st.remaining_s == pytest.approx(plan.iteration_s * 3 / 4)
    assert (st.running, st.waiting, st.decoding, st.phase, st.block_size) == (1, 1, 0, "both", 4)
    assert [q.rid for q in st.queue] == ["a", "b"]
    # the chunk in flight (32 tokens) is covered by remaining_s, not listed again
    assert (st.queue[0].uncached_tokens, st.queue[0].cached_tokens) == (16, 32)
    assert st.gpu_total_blocks == 64 and st.gpu_free_blocks == 64 - 13
    finish(s, plan)
    st = s.state(plan.end)
    assert (st.queue[0].uncached_tokens, st.queue[0].cached_tokens) == (16, 32)
    assert st.host_used_blocks == 8 and st.host_total_blocks == 256
    assert st.remaining_s == 0.0
    plan = s.schedule(plan.end)  # the last chunk of "a" is in flight: "a" leaves the queue
    st = s.state(plan.start)
    assert [q.rid for q in st.queue] == ["b"]


def test_state_sizes_are_the_pools_at_every_step_with_two_host_groups(b):
    """``state()`` reads L1's free + evictable slots and L2's used pages without the pools'
    ``available`` / ``used`` properties (inline, one per state): the same numbers at every step,
    also with ``branch-count``'s two L2 queues both non-empty (counted pages moved to group 1)."""
    s = b.sched(b.profile(memory__gpu_kv_tokens=48, memory__host_kv_tokens=160), host_eviction="branch-count")  # 12 and 40 pages
    gpu, host = s.kv.gpu, s.kv.host
    now = 0.0
    seen_groups = False
    for i in range(8):
        ids = [100 * i + j for j in range(1, 5)]
        s.add_prefill(b.prefill(f"r{i}", ids, tail=1, max_tokens=3), now)
        if i >= 2 and i % 2 == 0:  # a count on an earlier prompt: its L2 pages (queued once L1 drops them) go to the counted group
            old = b.path([100 * (i - 2) + j for j in range(1, 5)])
            s.update_counts(old, [1] * len(old))
        while True:
            st = s.state(now)
            assert (st.gpu_free_blocks, st.host_used_blocks) == (gpu.available, host.used)
            seen_groups = seen_groups or all(q.blocks for q in host.queues)
            plan = s.schedule(now)
            if plan is None:
                break
            now = plan.end
            s.finish_iteration(plan, now)
    assert len(host.queues) == 2 and seen_groups


def _queue_from_scratch(s: EngineScheduler) -> list[QueuedWork]:
    """``NodeState.queue`` with every entry made anew (what ``state()`` built before it kept them)."""
    bs = s.block_size
    fly = {c.rid: c.tokens for c in s.inflight.prefill} if s.inflight is not None else {}
    out = []
    for r in s.running.values():
        if r.state == "prefilling":
            done = r.cached + r.computed + fly.get(r.rid, 0)
            if done < r.prompt_tokens:
                out.append(QueuedWork(rid=r.rid, uncached_tokens=r.prompt_tokens - done, cached_tokens=done))
    for r in (*s.waiting.values(), *s.bootstrap.values()):
        cached = (r.q_gpu + r.q_host) * bs
        out.append(QueuedWork(rid=r.rid, uncached_tokens=r.prompt_tokens - cached, cached_tokens=cached, restore_tokens=r.q_host * bs))
    return out


def test_state_keeps_a_queued_entry_until_its_prefix_match_changes(b):
    """A waiting request's ``queue`` entry is made once and shared by the states that follow (the
    entries are immutable) until its prefix match changes (a failed admission re-matches it after
    other prompts' pages were cached): every state still lists what a build from scratch lists,
    the prefilling requests (:attr:`EngineScheduler.prefilling`) in the running batch's order."""
    s = b.sched(b.profile(memory__gpu_kv_tokens=64, scheduler__max_running=3))  # 16 pages: admissions wait for room
    now = 0.0
    for i in range(6):  # prompts sharing their first pages, so a re-match finds more cached
        s.add_prefill(b.prefill(f"r{i}", [1, 2, 3] + [10 * i + j for j in range(4, 7)], tail=1, max_tokens=3), now)
    last: dict[str, QueuedWork] = {}
    kept = changed = 0
    while True:
        st = s.state(now)
        assert st.queue == _queue_from_scratch(s)
        n_queued = len(s.waiting) + len(s.bootstrap)  # the queue's last entries; the same objects in the next state
        again = s.state(now).queue
        assert all(x is y for x, y in zip(st.queue[len(st.queue) - n_queued :], again[len(again) - n_queued :]))
        for w in st.queue:
            if w.rid in s.waiting and w.rid in last:
                kept += w is last[w.rid]
                changed += w != last[w.rid]
            last[w.rid] = w
        assert list(s.prefilling.values()) == [r for r in s.running.values() if r.state == "prefilling"]
        plan = s.schedule(now)
        if plan is None:
            break
        now = plan.end
        s.finish_iteration(plan, now)
    assert kept and changed and not s.requests


def test_records_match_plans(b, run):
    s = b.sched()
    s.add_prefill(b.prefill("a", list(range(1, 13)), max_tokens=3), 0.0)
    _, plans, _ = run(s)
    recs = s.take_records()
    assert len(recs) == len(plans)
    for r, p in zip(recs, plans):
        assert (r.start, r.duration_s, r.phase) == (p.start, p.iteration_s, p.phase)
        assert (r.sum_uncached, r.sum_qk_pairs, r.sum_cached, r.decode_batch) == (
            p.sum_uncached, p.sum_qk_pairs, p.sum_cached, len(p.decode))
    assert s.take_records() == []


def test_without_partial_outputs_only_first_tokens_and_ends_are_emitted(b, run):
    """``partial_outputs=False`` (the simulator): a request's first token and its last output,
    nothing in between; plans, KV and finish times are those of the full run."""
    full, lean = b.sched(), b.sched()
    lean.partial_outputs = False
    for s in (full, lean):
        s.add_prefill(b.prefill("a", [1, 2], tail=1, max_tokens=6), 0.0)
        s.add_prefill(b.prefill("b", [5, 6], tail=1, max_tokens=1), 0.0)
    outs1, plans1, end1 = run(full)
    outs2, plans2, end2 = run(lean)
    got = [(o.rid, o.index, o.count, o.finished) for o in tokens(outs2)]
    assert got == [("a", 0, 1, False), ("b", 0, 1, True), ("a", 5, 1, True)]
    kept = [o for o in tokens(outs1) if o.index == 0 or o.finished]
    assert [(o.rid, o.index, o.count, o.finished, o.at) for o in kept] == [
        (o.rid, o.index, o.count, o.finished, o.at) for o in tokens(outs2)]
    assert len(tokens(outs1)) > len(tokens(outs2))
    assert [(p.start, p.end, p.decode) for p in plans1] == [(p.start, p.end, p.decode) for p in plans2]
    assert end1 == end2 and full.take_records() == lean.take_records()


def _lazy_lockstep(b, seed: int, phase: str) -> None:
    """One random run on three schedulers fed the same inputs: per-request decode progress
    (``partial_outputs=False``, the eager walk) and :meth:`set_lazy_decode` with and without the
    full invariant check after every step (which syncs ``generated`` / ``acc``)."""
    import random

    rng = random.Random(seed)
    prof = b.profile(scheduler__max_running=4, scheduler__chunk_tokens=48, memory__gpu_kv_tokens=256)
    eager = b.sched(prof, phase)
    eager.partial_outputs = False
    lazy = b.sched(prof, phase)
    lazy.set_lazy_decode()
    bare = b.sched(prof, phase, check_invariants=False)
    bare.set_lazy_decode()
    scheds = (eager, lazy, bare)
    now, rid, live = 0.0, 0, []
    for _step in range(160):
        for _ in range(rng.choice((0, 0, 1, 2))):  # arrivals: prompts sharing prefixes, decode hand-offs
            rid += 1
            ids = [rng.randrange(1, 4)] + [100 * rid + j for j in range(rng.randrange(0, 4))]
            mt = rng.choice((2, 3, 7, 20, 41) if phase == "decode" else (1, 2, 3, 7, 20, 41))
            tail, ready = rng.randrange(0, 4), now + rng.random() * 0.01
            for s in scheds:
                if phase == "decode":
                    s.add_decode(b.decode(f"r{rid}", ids, tail=tail, max_tokens=mt, ready=ready), now)
                else:
                    s.add_prefill(b.prefill(f"r{rid}", ids, tail=tail, max_tokens=mt), now)
            live.append(f"r{rid}")
        horizon = rng.choice((None, now + 0.05, now + 1e9))
        plans = [s.schedule(now, horizon) for s in scheds]
        if plans[0] is None:
            assert plans == [None, None, None]
            nxt = eager.next_deadline()
            now = nxt if nxt is not None and nxt > now else now + 0.01
            continue
        assert [(p.start, p.iterations, p.end, p.decode, [c.rid for c in p.prefill]) for p in plans[1:]] == [
            (plans[0].start, plans[0].iterations, plans[0].end, plans[0].decode, [c.rid for c in plans[0].prefill])] * 2
        if live and rng.random() < 0.15:  # an abort while the plan is in flight (the request may be decoding)
            victim = rng.choice(live)
            assert len({s.abort(victim, now) for s in scheds}) == 1
        end = plans[0].end
        if plans[0].iterations > 1 and rng.random() < 0.3:  # new work cuts a folded decode plan
            cut = plans[0].start + (end - plans[0].start) * rng.random()
            end = eager.truncate(plans[0], cut)
            assert lazy.truncate(plans[1], cut) == end == bare.truncate(plans[2], cut)
        outs = [s.finish_iteration(p, end) for s, p in zip(scheds, plans)]
        assert outs[1] == outs[0] and outs[2] == outs[0]
        assert lazy.take_records() == eager.take_records() == bare.take_records()
        now = end
    bare.check()  # syncs generated / acc: the same numbers as the eager walk's
    assert sorted((r.rid, r.generated, r.acc, r.state) for r in bare.requests.values()) == sorted(
        (r.rid, r.generated, r.acc, r.state) for r in eager.requests.values())


@pytest.mark.parametrize("seed", range(6))
def test_lazy_decode_is_the_per_request_walk(b, seed):
    """:meth:`EngineScheduler.set_lazy_decode` (the simulator's engines): outputs, plans (skip-ahead
    lengths included), records and, once synced, each decoding request's progress are those of the
    walk of the decode batch at every plan end: collocated (prompts then decode) and decode-only
    nodes, requests aborted mid-plan, folded plans cut by ``truncate``."""
    _lazy_lockstep(b, seed, "both" if seed % 2 == 0 else "decode")


def test_lazy_decode_refuses_stopped_and_a_busy_scheduler(b):
    s = b.sched()
    s.set_lazy_decode()
    s.add_prefill(b.prefill("a", [1, 2], tail=1, max_tokens=5), 0.0)
    with pytest.raises(SchedulerError, match="holds requests"):
        s.set_lazy_decode()
    plan = s.schedule(0.0)
    with pytest.raises(SchedulerError, match="lazy decode takes no stopped"):
        s.finish_iteration(plan, plan.end, {"a": 1})


def test_without_records_none_are_kept(b, run):
    s = b.sched()
    s.keep_records = False
    s.add_prefill(b.prefill("a", list(range(1, 13)), max_tokens=3), 0.0)
    _, plans, _ = run(s)
    assert plans and s.take_records() == []
