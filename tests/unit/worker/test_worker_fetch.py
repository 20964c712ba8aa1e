"""Peer fetch into L2 while a request waits (paper §4.2): the shared link, the exposed part,
decode nodes never fetching, real-bytes completion, cancellation. Explicit ``now``, no clock."""

from __future__ import annotations

import msgspec
import pytest

from shared.messages import BlockStored, FetchRange
from services.worker.fetch import FetchLink
from services.worker.plan import TokensOut, WorkRejected

BS = 4
BYTES_PER_BLOCK = BS * 1000  # tiny profile: 1000 B per token


def with_fetch(work, *ranges):
    return msgspec.structs.replace(work, fetch=[FetchRange(node=n, start=a, end=e) for n, a, e in ranges])


def first_token(outs, rid) -> TokensOut:
    return next(o for o in outs if isinstance(o, TokensOut) and o.rid == rid and o.index == 0)


# --------------------------------------------------------------------------- #
# the link model
# --------------------------------------------------------------------------- #


def test_link_processor_sharing_with_staggered_starts_and_cancel():
    link = FetchLink(100.0, latency_s=0.5)
    link.start("a", 100.0, 0.0)  # alone: 1 s of bytes
    assert link.next_completion() == pytest.approx(1.5)
    link.start("b", 100.0, 0.5)  # a has 50 B left; both at 50 B/s from 0.5
    assert link.next_completion() == pytest.approx(0.5 + 1.0 + 0.5)  # a drains at 1.5
    assert link.pop_done(1.9) == []
    done = link.pop_done(2.0)
    assert [k for k, _ in done] == ["a"] and done[0][1] == pytest.approx(2.0)
    # b: 50 B moved by 1.5, alone from 1.5 → 50 B more at 100 B/s → drained 2.0, done 2.5
    assert link.next_completion() == pytest.approx(2.5)
    link.start("c", 1000.0, 2.0)
    assert link.cancel("c", 2.0) and link.next_completion() == pytest.approx(2.5)
    assert [k for k, _ in link.pop_done(3.0)] == ["b"] and len(link) == 0


def test_link_equal_fetches_drain_together_and_zero_bytes_pay_latency_only():
    link = FetchLink(10.0, latency_s=0.1)
    for k in "xyz":
        link.start(k, 10.0, 0.0)
    link.start("empty", 0.0, 0.0)
    got = link.pop_done(10.0)
    assert [k for k, _ in got] == ["empty", "x", "y", "z"]
    assert [t for _, t in got] == pytest.approx([0.1, 3.1, 3.1, 3.1])
    with pytest.raises(ValueError):
        FetchLink(0.0)


# --------------------------------------------------------------------------- #
# only the part of the fetch that outlasts the queue wait is exposed
# --------------------------------------------------------------------------- #


def _queued_behind_a_long_prefill(b, run, latency_s: float, fetch: bool):
    """A: a 30-page prompt (4 chunks of 32 tokens) ahead of B, whose 10 pages a peer holds."""
    p = b.profile(links__peer_fetch_latency_s=latency_s)
    s = b.sched(p, phase="both")
    s.add_prefill(b.prefill("A", list(range(100, 130)), max_tokens=2), 0.0)
    wb = b.prefill("B", list(range(1, 11)), tail=1, max_tokens=2)
    if fetch:
        wb = with_fetch(wb, ("w9", 0, 10))
    s.add_prefill(wb, 0.0)
    outs, _, _ = run(s, 0.0)
    return s, first_token(outs, "B")


def test_a_fetch_shorter_than_the_queue_wait_adds_nothing(b, run):
    _, base = _queued_behind_a_long_prefill(b, run, 0.001, fetch=False)
    s, tok = _queued_behind_a_long_prefill(b, run, 0.001, fetch=True)
    fetch_s = 0.001 + 10 * BYTES_PER_BLOCK / 1e8
    assert tok.fetch_s == pytest.approx(fetch_s)
    assert fetch_s < base.queue_s
    assert tok.exposed_fetch_s == 0.0
    assert tok.queue_s == pytest.approx(base.queue_s)
    # the fetched pages came from L2 (restored), the baseline computed them
    assert tok.fetched_tokens == 40 and tok.cached_tokens == 40 and base.cached_tokens == 0
    assert s.fetch_counters == {"started": 1, "blocks": 10, "completed": 1}


def test_a_fetch_longer_than_the_queue_wait_adds_exactly_the_excess(b, run):
    _, base = _queued_behind_a_long_prefill(b, run, 0.05, fetch=False)
    _, tok = _queued_behind_a_long_prefill(b, run, 0.05, fetch=True)
    fetch_s = 0.05 + 10 * BYTES_PER_BLOCK / 1e8
    assert tok.fetch_s == pytest.approx(fetch_s) and fetch_s > base.queue_s
    assert tok.exposed_fetch_s == pytest.approx(fetch_s - base.queue_s)
    assert tok.queue_s == pytest.approx(base.queue_s + tok.exposed_fetch_s)


def test_a_fetching_request_keeps_its_place_but_later_ones_may_start(b, run):
    p = b.profile(links__peer_fetch_latency_s=0.05)
    s = b.sched(p, phase="both")
    s.add_prefill(with_fetch(b.prefill("F", list(range(1, 11)), tail=1, max_tokens=2), ("w9", 0, 10)), 0.0)
    s.add_prefill(b.prefill("L", [50, 51], tail=1, max_tokens=2), 0.0)
    plan = s.schedule(0.0)
    assert plan.admitted == ["L"] and s.fetching == 1
    st = s.state(0.0)
    assert [q.rid for q in st.queue] == ["F"] and st.queue[0].restore_tokens == 40  # fetch counted as restore
    s.finish_iteration(plan, plan.end)
    assert s.next_deadline() == pytest.approx(0.05 + 10 * BYTES_PER_BLOCK / 1e8)
    outs, _, _ = run(s, plan.end)
    assert first_token(outs, "F").exposed_fetch_s == pytest.approx(0.05 + 0.0004)


# --------------------------------------------------------------------------- #
# the link is shared
# --------------------------------------------------------------------------- #


def test_two_concurrent_fetches_share_the_inbound_link(b, run):
    p = b.profile(links__peer_fetch_latency_s=0.0, links__peer_fetch_bytes_per_s=1e6)
    alone = b.sched(p, phase="both")
    alone.add_prefill(with_fetch(b.prefill("a", list(range(1, 11)), tail=1, max_tokens=2), ("w9", 0, 10)), 0.0)
    t_alone = first_token(run(alone, 0.0)[0], "a").fetch_s
    assert t_alone == pytest.approx(10 * BYTES_PER_BLOCK / 1e6)

    s = b.sched(p, phase="both")
    s.add_prefill(with_fetch(b.prefill("a", list(range(1, 11)), tail=1, max_tokens=2), ("w9", 0, 10)), 0.0)
    s.add_prefill(with_fetch(b.prefill("b", list(range(21, 31)), tail=1, max_tokens=2), ("w8", 0, 10)), 0.0)
    outs, _, _ = run(s, 0.0)
    assert first_token(outs, "a").fetch_s == pytest.approx(2 * t_alone)
    assert first_token(outs, "b").fetch_s == pytest.approx(2 * t_alone)


def test_cancelled_fetch_frees_the_link_for_the_others(b, run):
    p = b.profile(links__peer_fetch_latency_s=0.0, links__peer_fetch_bytes_per_s=1e6)
    s = b.sched(p, phase="both")
    s.add_prefill(with_fetch(b.prefill("a", list(range(1, 11)), tail=1, max_tokens=2), ("w9", 0, 10)), 0.0)
    s.add_prefill(with_fetch(b.prefill("b", list(range(21, 31)), tail=1, max_tokens=2), ("w9", 0, 10)), 0.0)
    one = 10 * BYTES_PER_BLOCK / 1e6
    assert s.abort("b", one / 2)  # a got one/4 of its bytes by then, then the whole link
    outs, _, _ = run(s, one / 2)
    assert first_token(outs, "a").fetch_s == pytest.approx(one / 2 + 0.75 * one)
    assert s.fetch_counters["cancelled"] == 1 and len(s.link) == 0
    # taking queued work back (phase switch) cancels fetches too
    s.add_prefill(with_fetch(b.prefill("c", list(range(41, 51)), tail=1, max_tokens=2), ("w9", 0, 10)), 1.0)
    assert [w.rid for w in s.take_queued(1.0)] == ["c"] and len(s.link) == 0 and s.fetching == 0
    s.check()


# --------------------------------------------------------------------------- #
# what is fetched, where it lands
# --------------------------------------------------------------------------- #


def test_fetched_pages_become_host_blocks_beyond_the_local_prefix(b, run):
    s = b.sched(phase="both")
    s.add_prefill(b.prefill("warm", [1, 2, 3], tail=1, max_tokens=1), 0.0)
    _, _, t = run(s, 0.0)
    s.take_kv_events()
    path = b.path(list(range(1, 11)))
    w = with_fetch(b.prefill("r", list(range(1, 11)), tail=1, max_tokens=1), ("w9", 0, 6), ("w8", 6, 10))
    s.add_prefill(w, t)
    assert (s.requests["r"].fetch.lo, s.requests["r"].fetch.hi) == (3, 10)  # own 3 pages are not fetched
    outs, _, _ = run(s, t)
    stored = [e for e in s.take_kv_events() if isinstance(e, BlockStored) and e.tier == "host"]
    assert stored[0].block_hashes == path[3:10] and stored[0].parent_block_hash == path[2]
    tok = first_token(outs, "r")
    assert tok.fetched_tokens == 28 and tok.cached_tokens == 40


def test_plan_is_cut_at_a_gap_a_self_range_and_the_cache_cap(b):
    s = b.sched(phase="both")
    s.add_prefill(with_fetch(b.prefill("gap", list(range(1, 11)), tail=1), ("w9", 0, 4), ("w8", 5, 10)), 0.0)
    assert (s.requests["gap"].fetch.lo, s.requests["gap"].fetch.hi) == (0, 4)
    s.add_prefill(with_fetch(b.prefill("self", list(range(21, 31)), tail=1), ("w9", 0, 4), ("w0", 4, 10)), 0.0)
    assert s.requests["self"].fetch.hi == 4
    s.add_prefill(with_fetch(b.prefill("cap", list(range(41, 51)), tail=0), ("w9", 0, 10)), 0.0)
    assert s.requests["cap"].fetch.hi == 9  # (40 − 1) // 4: one token is always computed
    s.add_prefill(with_fetch(b.prefill("none", list(range(61, 71)), tail=1), ("w0", 0, 10)), 0.0)
    assert s.requests["none"].fetch is None and s.fetch_counters["nothing"] == 1
    s.check()


def test_a_decode_node_never_fetches(b):
    dec = b.sched(phase="decode", node="w1")
    w = with_fetch(b.prefill("r", list(range(1, 11)), tail=1, decode_node="w1"), ("w9", 0, 10))
    with pytest.raises(WorkRejected):
        dec.add_prefill(w, 0.0)
    assert dec.fetch_counters == {"ignored_decode": 1}
    assert len(dec.link) == 0 and dec.kv.host.used == 0


# --------------------------------------------------------------------------- #
# real-bytes mode: the simulated completion waits for the transfer
# --------------------------------------------------------------------------- #


def test_external_fetch_completes_at_the_later_of_link_and_transfer(b, run):
    s = b.sched(phase="both", external_fetch=True)
    w = with_fetch(b.prefill("r", list(range(1, 11)), tail=1, max_tokens=2), ("w9", 0, 6), ("w8", 6, 10))
    s.add_prefill(w, 0.0)
    (started,) = s.take_fetch_starts()
    path = b.path(list(range(1, 11)))
    assert started.rid == "r" and started.sources == [("w9", path[:6]), ("w8", path[6:10])]
    link_done = s.next_deadline()
    assert s.schedule(link_done) is None  # link done, transfer not reported: still waiting
    assert s.next_deadline() is None and s.fetching == 1
    assert s.fetch_done("r", [path[7]], 0.5)  # page 7 failed its checksum: pages 7.. are recomputed
    assert not s.fetch_done("r", [], 0.6)
    outs, _, _ = run(s, 0.5)
    tok = first_token(outs, "r")
    assert tok.fetch_s == pytest.approx(0.5) and tok.fetched_tokens == 28 and tok.cached_tokens == 28
    assert s.fetch_counters["missing"] == 3


def test_external_fetch_reported_early_completes_with_the_link(b, run):
    s = b.sched(phase="both", external_fetch=True)
    s.add_prefill(with_fetch(b.prefill("r", list(range(1, 11)), tail=1, max_tokens=2), ("w9", 0, 10)), 0.0)
    s.take_fetch_starts()
    link_done = s.next_deadline()
    assert s.fetch_done("r", [], 0.0)
    outs, _, _ = run(s, 0.0)
    assert first_token(outs, "r").fetch_s == pytest.approx(link_done)


def test_skip_ahead_stops_at_a_fetch_completion(b, run):
    p = b.profile(links__peer_fetch_latency_s=0.05)
    s = b.sched(p, phase="both")
    s.add_prefill(b.prefill("d", [1], tail=1, max_tokens=200), 0.0)
    t = 0.0
    plan = s.schedule(t)
    s.finish_iteration(plan, plan.end)
    t = plan.end
    s.add_prefill(with_fetch(b.prefill("f", list(range(10, 20)), tail=1, max_tokens=2), ("w9", 0, 10)), t)
    done_at = s.next_deadline()
    plan = s.schedule(t, horizon=1e9)
    assert plan.iterations > 1 and plan.start + (plan.iterations - 1) * plan.iteration_s < done_at <= plan.end


# --------------------------------------------------------------------------- #
# a queued request keeps what it fetched until it is admitted
# --------------------------------------------------------------------------- #


def _fetch_race(b, run, host_eviction: str):
    """L2 of 80 pages, 40 of them pinned (W's prompt, left in L1). A (W's prompt + 1 token)
    occupies the node for one 1-s iteration; r's 30 fetched pages land at 0.12 s while it
    queues behind A; at 0.2 s s fetches 30 more pages, which need 20 evictions and find no
    unpinned page but r's."""
    p = b.profile(
        links__peer_fetch_latency_s=0.0,
        links__peer_fetch_bytes_per_s=1e6,
        memory__host_kv_tokens=320,
        prefill__c0=1.0,
    )
    s = b.sched(p, phase="both", host_eviction=host_eviction)
    s.add_prefill(b.prefill("W", list(range(100, 140)), tail=1, max_tokens=1), 0.0)
    outs, _, t0 = run(s, 0.0)
    assert s.kv.host.used == 40
    s.add_prefill(b.prefill("A", list(range(100, 140)), tail=1, max_tokens=1), t0)  # cached: 1 token to compute
    s.add_prefill(with_fetch(b.prefill("r", list(range(1, 31)), tail=1, max_tokens=1), ("w9", 0, 30)), t0)
    plan = s.schedule(t0)
    assert plan is not None and [c.rid for c in plan.prefill] == ["A"] and plan.end - t0 > 0.5
    # while A's iteration runs, r's fetch completes (0.12 s) and s's starts (0.2 s)
    s.add_prefill(with_fetch(b.prefill("s", list(range(41, 71)), tail=1, max_tokens=1), ("w8", 0, 30)), t0 + 0.2)
    now = plan.end
    outs.extend(s.finish_iteration(plan, now))
    more, _, _ = run(s, now)
    return s, outs + more


@pytest.mark.parametrize("host_eviction", ["lru", "branch-count"])
def test_fetched_pages_are_held_until_the_request_is_admitted(b, run, host_eviction):
    s, outs = _fetch_race(b, run, host_eviction)
    r, later = first_token(outs, "r"), first_token(outs, "s")
    assert r.fetched_tokens == 120 and r.cached_tokens == 120  # nothing r fetched was evicted before it ran
    assert later.fetched_tokens == 40 and later.cached_tokens == 40  # s kept only what fit beside the held pages (10 of 30)
    assert s.kv.host.holds == {}  # admission dropped the hold
    s.check()


def test_without_the_hold_the_fetch_would_be_lost(b, run, monkeypatch):
    """The same race with holds disabled: s's fetch evicts 20 of r's fetched pages, which r
    recomputes (the failure the hold removes; shows the race above is a real one)."""
    from services.worker.blocks import KvBlockManager

    monkeypatch.setattr(KvBlockManager, "hold", lambda self, path, n: [])
    # the scheduler's other way in: a match, then the hold of what it found (none here)
    monkeypatch.setattr(KvBlockManager, "match_hold", lambda self, path, limit: (*self.match(path, limit), None))
    _, outs = _fetch_race(b, run, "lru")
    r = first_token(outs, "r")
    assert r.fetched_tokens == 40 and r.cached_tokens == 40  # 30 pages fetched, 10 left to restore


def _local_prefix_race(b, run, host_eviction: str):
    """L2 of 80 pages. X's 30 pages were computed and pushed out of L1 by W's 40 (7 of them
    are left only in L2); r, queued behind A (W's prompt again, one 1-s iteration), has X's
    30 pages as its local prefix, no fetch; at 0.2 s s's fetch of 30 new pages needs room."""
    p = b.profile(links__peer_fetch_latency_s=0.0, links__peer_fetch_bytes_per_s=1e6, memory__host_kv_tokens=320, prefill__c0=1.0)
    s = b.sched(p, phase="both", host_eviction=host_eviction)
    s.add_prefill(b.prefill("X", list(range(1, 31)), tail=1, max_tokens=1), 0.0)
    _, _, t = run(s, 0.0)
    s.add_prefill(b.prefill("W", list(range(100, 140)), tail=1, max_tokens=1), t)
    _, _, t = run(s, t)
    s.add_prefill(b.prefill("A", list(range(100, 140)), tail=1, max_tokens=1), t)
    s.add_prefill(b.prefill("r", list(range(1, 31)), tail=1, max_tokens=1), t)
    assert (s.requests["r"].q_gpu, s.requests["r"].q_host) == (23, 7)
    plan = s.schedule(t)
    assert [c.rid for c in plan.prefill] == ["A"] and plan.end - t > 0.5
    s.add_prefill(with_fetch(b.prefill("s", list(range(41, 71)), tail=1, max_tokens=1), ("w8", 0, 30)), t + 0.2)
    outs = s.finish_iteration(plan, plan.end)
    more, _, _ = run(s, plan.end)
    return s, outs + more


@pytest.mark.parametrize("host_eviction", ["lru", "branch-count"])
def test_a_queued_request_holds_its_local_l2_prefix_from_arrival(b, run, host_eviction):
    s, outs = _local_prefix_race(b, run, host_eviction)
    assert first_token(outs, "r").cached_tokens == 120  # its whole prefix was still there at admission
    assert first_token(outs, "s").fetched_tokens == 40  # s stored what fit beside r's held pages
    assert s.kv.host.holds == {}
    s.check()


def test_without_the_arrival_hold_the_local_prefix_would_be_lost(b, run, monkeypatch):
    from services.worker.blocks import KvBlockManager

    monkeypatch.setattr(KvBlockManager, "hold", lambda self, path, n: [])
    # the scheduler's other way in: a match, then the hold of what it found (none here)
    monkeypatch.setattr(KvBlockManager, "match_hold", lambda self, path, limit: (*self.match(path, limit), None))
    _, outs = _local_prefix_race(b, run, "lru")
    assert first_token(outs, "r").cached_tokens < 120


def test_an_aborted_or_rerouted_request_drops_its_hold(b, run):
    p = b.profile(links__peer_fetch_latency_s=0.0, links__peer_fetch_bytes_per_s=1e6, prefill__c1=0.01)
    s = b.sched(p, phase="both")
    s.add_prefill(b.prefill("A", list(range(100, 130)), tail=1, max_tokens=1), 0.0)
    for rid, base in (("x", 1), ("y", 41)):
        s.add_prefill(with_fetch(b.prefill(rid, list(range(base, base + 10)), tail=1, max_tokens=1), ("w9", 0, 10)), 0.0)
    plan = s.schedule(0.0)
    s.finish_iteration(plan, plan.end)
    s.schedule(plan.end)  # the fetches (80 ms) completed during A's first iteration
    assert s.requests["x"].l2_hold and len(s.kv.host.holds) == 20
    assert s.abort("x", plan.end)
    assert len(s.kv.host.holds) == 10
    s.finish_iteration(s.inflight, s.inflight.end)
    assert [w.rid for w in s.take_queued(s.inflight.end if s.inflight else 1.0)] == ["y"]
    assert s.kv.host.holds == {}
    s.check()


def test_a_request_overtaken_while_fetching_takes_its_place_back(b, run):
    """F fetches while L, a long prompt behind it, starts (F is skipped). Once F's
    fetch is in, F is admitted ahead of L's next chunk and shares L's iterations,
    instead of waiting for L's whole prefill."""
    p = b.profile(links__peer_fetch_latency_s=0.005)
    s = b.sched(p, phase="both")
    s.add_prefill(with_fetch(b.prefill("F", list(range(1, 11)), tail=1, max_tokens=2), ("w9", 0, 10)), 0.0)
    s.add_prefill(b.prefill("L", list(range(100, 148)), tail=1, max_tokens=2), 0.0)
    outs, plans, _ = run(s, 0.0)
    fetched_at = 0.005 + 10 * BYTES_PER_BLOCK / 1e8
    first_l = plans[0]
    assert first_l.admitted == ["L"]
    l_prefill = [pl for pl in plans if any(c.rid == "L" for c in pl.prefill)]
    assert l_prefill[-1].end > fetched_at + 2 * first_l.iteration_s  # L outlasts F's fetch by far
    # F starts in the first iteration launched after its fetch completed, sharing it with L
    f_start = next(pl for pl in plans if "F" in pl.admitted)
    assert f_start.start == min(pl.start for pl in plans if pl.start >= fetched_at)
    assert [c.rid for c in f_start.prefill] == ["F", "L"]
    tf, tl = first_token(outs, "F"), first_token(outs, "L")
    assert tf.exposed_fetch_s == pytest.approx(fetched_at)
    assert tf.at < tl.at and tf.queue_s < first_l.iteration_s + fetched_at
