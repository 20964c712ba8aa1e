"""Counts kept in L1's runs (issue 23 deliverable 3, the worker's half): once count messages come
with their chains, the host pool keeps no counted-page set; an L1 page's count lives in its run's
counted intervals (``_GpuRun.counted``), carried through L1's splits, merges, evictions and
restores, and an eviction pushes the run's pieces by them. The counts must be those of the set
the pool kept before: the groups pages enter L2 in, and ``counted`` on L2's pages."""

from __future__ import annotations

import random

import pytest

from services.worker.blocks import BranchRunHostPool, KvBlockManager, KvInvariantError
from tests.unit.worker import ref_blocks
from tests.unit.worker.test_count_chains import _message
from tests.unit.worker.test_count_message_cut import _forest, compute, order


def _l2(kv) -> set[int]:
    return set(kv.host.snapshot())


def _admit(kv, path: list[int]) -> bool:
    g, _ = kv.match(path, len(path))
    if not kv.admit(path, g, len(path) - g):
        return False
    kv.fill(path, g, len(path))
    return True


def _lockstep(seed: int) -> int:
    """Random traffic (requests held across count messages, so L1's runs split and merge under
    counted intervals; evictions, restores) on a pool given chains, a pool given the same messages
    without them (the counted-page set) and the per-block model; after each step the orders agree,
    the chained pool's ``counted`` is the set's on L2's pages, and both pass ``check``. Returns the
    pages the messages moved."""
    rng = random.Random(seed)
    paths, script = _forest(rng)
    kvs = [KvBlockManager(20, 400, 4, "branch-count"), KvBlockManager(20, 400, 4, "branch-count"), ref_blocks.KvBlockManager(20, 400, 4, "branch-count")]
    live: list[list[int]] = []
    moved = 0
    for _step in range(80):
        x = rng.random()
        if x < 0.35:
            p = rng.choice(script)
            path = p[: rng.randint(1, len(p))]
            done = {_admit(kv, path) for kv in kvs}
            assert len(done) == 1
            if done.pop():
                live.append(path)
        elif x < 0.55 and live:
            path = live.pop(rng.randrange(len(live)))
            for kv in kvs:
                kv.release(path, len(path), 0)
        else:
            h, c, ch = _message(rng, paths + [p[: rng.randint(1, len(p))] for p in live])
            if not h:
                continue
            got = [kvs[0].update_counts(h, c, ch), kvs[1].update_counts(h, c), kvs[2].update_counts(h, c)]
            assert got[0] == got[1] == got[2], f"seed {seed}"
            moved += got[0]
        assert order(kvs[0]) == order(kvs[1]) == order(kvs[2]), f"seed {seed}"
        assert kvs[0].host.counted == kvs[1].host.counted & _l2(kvs[1]), f"seed {seed}"
        for kv in kvs[:2]:
            kv.check([(p, len(p), 0) for p in live])
    assert kvs[0].host._counted is None and kvs[1].host._counted is not None
    return moved


def test_intervals_count_as_the_set_did_under_random_traffic():
    moved = sum(_lockstep(seed) for seed in range(80))
    assert moved > 150  # the messages did move pages


def _chained_pool() -> KvBlockManager:
    """L1 (8 pages) holds the run 1..8, counts kept in L1's runs (a first chained message)."""
    kv = KvBlockManager(8, 64, 4, "branch-count")
    assert kv.update_counts([99], [1], [(0, 1)]) == 0
    compute(kv, [1, 2, 3, 4, 5, 6, 7, 8])
    return kv


def test_an_interval_is_carried_through_a_split_a_merge_and_an_eviction():
    """Pages 3..6 of an L1 run counted; a request holding 1..3 splits the run there and its release
    merges it again; then two evictions cut it deepest first: 8, 7 leave uncounted (group 0), 6, 5,
    4 counted, then 3 counted and 2, 1 not. A split, merge or eviction that dropped or misplaced an
    interval would put a page in the other group."""
    kv = _chained_pool()
    assert kv.update_counts([3, 4, 5, 6], [1, 1, 1, 1], [(2, 4)]) == 0  # pinned: nothing moves
    (run,) = kv.gpu.ends.values()
    assert list(run.counted) == [(2, 6)]
    assert _admit(kv, [1, 2, 3])  # split after 3: [1, 2, 3] held, [4..8] not
    up, down = sorted(kv.gpu.ends.values(), key=lambda r: r.depth)
    assert (up.keys, list(up.counted), down.keys, list(down.counted)) == ([1, 2, 3], [(2, 3)], [4, 5, 6, 7, 8], [(0, 3)])
    kv.check([([1, 2, 3], 3, 0)])
    kv.release([1, 2, 3], 3, 0)  # one run again
    (run,) = kv.gpu.ends.values()
    assert (run.keys, list(run.counted)) == ([1, 2, 3, 4, 5, 6, 7, 8], [(2, 6)])
    assert kv.reserve(5)  # evicts 8..4
    assert list(run.counted) == [(2, 3)]
    assert sorted(order(kv)) == [(4, 1), (5, 1), (6, 1), (7, 0), (8, 0)]
    kv.gpu.unreserve(5)
    assert kv.reserve(8)  # and the rest
    assert sorted(order(kv)) == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1), (7, 0), (8, 0)]
    kv.gpu.unreserve(8)
    kv.check([])


def test_a_restored_page_keeps_its_count_in_l1():
    """Counted pages evicted to L2 (group 1) and restored to L1 stay counted there: evicted again,
    they go back to group 1; an uncounted one stays in group 0."""
    kv = _chained_pool()
    assert kv.update_counts([1, 2, 3], [1, 1, 1], [(0, 3)]) == 0
    compute(kv, list(range(20, 28)))  # 1..8 leave L1
    assert sorted(order(kv))[:8] == [(1, 1), (2, 1), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0), (8, 0)]
    compute(kv, [1, 2, 3, 4])  # restored from L2
    assert [list(r.counted) for r in kv.gpu.ends.values() if r.keys[0] == 1] == [[(0, 3)]]
    assert {1, 2, 3} <= kv.host.counted and 4 not in kv.host.counted
    compute(kv, list(range(30, 38)))
    assert sorted(x for x in order(kv) if x[0] < 10) == [(1, 1), (2, 1), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0), (8, 0)]
    kv.check([])


def test_check_catches_an_interval_out_of_place():
    kv = _chained_pool()
    (run,) = kv.gpu.ends.values()
    run.counted = [(2, 4), (4, 6)]  # touching: not joined
    with pytest.raises(KvInvariantError, match="counted intervals"):
        kv.check([])
    run.counted = [(5, 9)]  # past the run's end
    with pytest.raises(KvInvariantError, match="counted intervals"):
        kv.check([])


def test_the_first_chained_message_turns_the_set_into_intervals():
    """Counts taken without chains (the set) carry over into L1's intervals when chains begin."""
    kv = KvBlockManager(8, 64, 4, "branch-count")
    compute(kv, [1, 2, 3, 4, 5, 6])
    assert kv.update_counts([2, 3, 5], [1, 1, 1]) == 0
    assert kv.host._counted is not None
    assert kv.update_counts([99], [1], [(0, 1)]) == 0
    assert kv.host._counted is None
    (run,) = kv.gpu.ends.values()
    assert list(run.counted) == [(1, 3), (4, 5)]
    assert kv.host.counted == {2, 3, 5}
    kv.check([])


def test_a_reset_clears_the_intervals():
    """``reset_counts`` once counts are kept in L1's runs: every L1 page forgets its count (an
    eviction then queues it in group 0) and the counted queued pages move to group 0."""
    kv = _chained_pool()
    assert kv.update_counts([1, 2, 3, 4], [1, 1, 1, 1], [(0, 4)]) == 0
    compute(kv, [20, 21])  # evicts 8, 7: uncounted, group 0
    assert order(kv) == [(8, 0), (7, 0)]
    assert kv.update_counts([5, 6, 7, 8], [1] * 4, [(4, 4)]) == 2  # 7, 8 move to group 1; 5, 6 counted in L1
    assert kv.host.counted == {1, 2, 3, 4, 5, 6, 7, 8}
    assert kv.reset_counts() == 2
    assert not kv.host.counted and all(g == 0 for _, g in order(kv))
    compute(kv, list(range(30, 38)))
    assert len(order(kv)) == 10 and all(g == 0 for _, g in order(kv))  # 1..8, 20, 21
    kv.check([])


def test_a_store_chains_cut_tail_is_placed_by_l1(monkeypatch: pytest.MonkeyPatch):
    """A chain of position None that starts no store the pool knows (the directory cut a store's
    re-sent chain into messages: the tail's position is nobody's to give) is placed where L1 holds
    it, by a run end among its entries or else by its first entry, without the per-page way; its
    counts are those of the same message without chains."""
    walks: list[int] = []
    real = BranchRunHostPool._count_l1_entries
    monkeypatch.setattr(BranchRunHostPool, "_count_l1_entries", lambda self, *a: walks.append(1) or real(self, *a))
    for hashes, chains, want in (
        ([5, 6, 7], [(None, 3)], [(4, 7)]),  # inside the run: placed by its first entry
        ([6, 7, 8], [(None, 3)], [(5, 8)]),  # ends the run: placed by its last
        ([2, 3, 6, 7, 8], [(1, 2), (None, 3)], [(1, 3), (5, 8)]),
    ):
        a, b = _chained_pool(), _chained_pool()
        plain = KvBlockManager(8, 64, 4, "branch-count")
        compute(plain, [1, 2, 3, 4, 5, 6, 7, 8])
        assert a.update_counts(hashes, [1] * len(hashes), chains) == plain.update_counts(hashes, [1] * len(hashes)) == 0
        (run,) = a.gpu.ends.values()
        assert list(run.counted) == want
        assert a.host.counted == plain.host.counted
        b.update_counts(hashes, [1] * len(hashes))  # a message without chains: the per-page way
        assert [list(r.counted) for r in b.gpu.ends.values()] == [want]
        a.check([])
    assert len(walks) == 3  # only the messages without chains


def test_interval_set_matches_offsets_set_by_set():
    """``_ivl_set`` (a run's counted intervals with ``[s, e)`` counted or not) gives the offsets a
    set would, sorted, disjoint and touching ones joined, whatever the shape: no interval, one
    (its fast path: one overlapping or touching ``[s, e)`` counted, or all of it uncounted: no
    lists, no sort), several, apart, touching, inside, around."""
    from services.worker.blocks import _ivl_set

    def norm(offsets: set[int]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for x in sorted(offsets):
            if out and out[-1][1] == x:
                out[-1] = (out[-1][0], x + 1)
            else:
                out.append((x, x + 1))
        return out

    rng = random.Random(7)
    for _ in range(3000):
        offs = {x for x in range(12) if rng.random() < rng.choice((0.2, 0.5, 0.9))}
        iv = norm(offs)
        s = rng.randrange(12)
        e = rng.randrange(s + 1, 13)
        on = rng.random() < 0.5
        want = norm(offs | set(range(s, e)) if on else offs - set(range(s, e)))
        got = _ivl_set(tuple(iv) if rng.random() < 0.5 else iv, s, e, on)
        assert list(got) == want, (iv, s, e, on)
    assert list(_ivl_set([(2, 5)], 5, 7, True)) == [(2, 7)]  # touching below
    assert list(_ivl_set([(2, 5)], 0, 2, True)) == [(0, 5)]  # touching above
    assert list(_ivl_set([(2, 5)], 6, 7, True)) == [(2, 5), (6, 7)]  # apart: the general path
    assert list(_ivl_set([(2, 5)], 1, 6, False)) == []
    assert list(_ivl_set([(2, 5)], 3, 4, False)) == [(2, 3), (4, 5)]


def test_a_lift_stops_at_an_l1_parent_without_scanning_the_queue():
    """A count message moves queued pages to the counted group; their run's lift
    (``_lift_above``) stops at its parent when that is an L1 page (a run of L1 ends with it:
    pinned, so queued in no group), without a scan of the group's queued runs (``_run_at``: one
    per such lift before, ~35 runs each at 512-token blocks, that found nothing); the pool ends
    the same."""
    kv = _chained_pool()
    assert kv.reserve(4)  # evicts 8..5: queued uncounted (group 0), their parent 4 ends L1's run
    kv.gpu.unreserve(4)
    calls = []
    run_at = kv.host._run_at

    def counted(*a):
        calls.append(a)
        return run_at(*a)

    kv.host._run_at = counted
    assert kv.update_counts([5, 6, 7, 8], [1, 1, 1, 1], [(4, 4)]) == 4  # moved to the counted group, lifted
    assert calls == [(5, 4)]  # the move's own: 5 starts a run (a dict probe); before, also (4, 3, 1), the lift's scan
    assert sorted(x for x in order(kv) if x[0] < 10) == [(5, 1), (6, 1), (7, 1), (8, 1)]
    kv.check([])
