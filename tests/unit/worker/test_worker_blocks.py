"""L1/L2 block pools: prefix match, L2 restore, leaf-first LRU eviction, write-through, events."""

from __future__ import annotations

import pytest

from shared.messages import AllBlocksCleared, BlockRemoved, BlockStored
from services.worker.blocks import KvBlockManager, KvInvariantError
from services.worker.eviction import BranchCountPolicy, LruPolicy, get_policy
from tests.unit.worker.ref_blocks import EvictionQueue


def P(*hashes: int) -> list[int]:
    """A block path given by its (synthetic) hashes, parent first."""
    return list(hashes)


def compute(kv: KvBlockManager, path: list[int], extra_slots: int = 0) -> None:
    """A request computes ``path`` from scratch (plus extra reserved slots) and leaves."""
    n_gpu, _ = kv.match(path, len(path))
    assert kv.admit(path, n_gpu, len(path) - n_gpu + extra_slots)
    kv.fill(path, n_gpu, len(path))
    kv.release(path, len(path), extra_slots)


def holders_none(kv: KvBlockManager) -> None:
    kv.check([])


def removed(events, tier):
    return [h for e in events if isinstance(e, BlockRemoved) and e.tier == tier for h in e.block_hashes]


def stored(events, tier):
    return [e for e in events if isinstance(e, BlockStored) and e.tier == tier]


def test_fresh_manager_announces_clear_and_rejects_small_host():
    kv = KvBlockManager(8, 32, 4)
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.take_events() == []
    with pytest.raises(ValueError, match="at least as large"):
        KvBlockManager(8, 4, 4)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        KvBlockManager(8, 32, 4, "fifo")


def test_prefix_match_l1_then_l2_extension():
    kv = KvBlockManager(4, 16, 4)
    a = P(1, 2, 3, 4)
    compute(kv, a)
    assert kv.match(a, 4) == (4, 0)
    assert kv.match(P(1, 2, 9), 3) == (2, 0)
    assert kv.match(a, 2) == (2, 0), "limit caps the match"
    # a new path fills L1: a's blocks are evicted from L1 but stay in L2
    compute(kv, P(5, 6, 7, 8))
    assert kv.match(a, 4) == (0, 4)
    assert kv.match(a, 4, use_host=False) == (0, 0)
    holders_none(kv)


def test_l2_restore_moves_blocks_back_to_l1_without_host_events():
    kv = KvBlockManager(4, 16, 4)
    a = P(1, 2, 3)
    compute(kv, a)
    compute(kv, P(5, 6, 7, 8))
    kv.take_events()
    n_gpu, n_host = kv.match(a, 3)
    assert (n_gpu, n_host) == (0, 3)
    assert kv.admit(a, n_gpu, 3)
    kv.fill(a, 0, 3)  # restore
    ev = kv.take_events()
    assert [e.block_hashes for e in stored(ev, "gpu")] == [[1, 2, 3]]
    assert stored(ev, "host") == [], "restored blocks are already in L2"
    assert kv.host.blocks[1].pinned and kv.host.blocks[3].pinned
    kv.check([(a, 3, 0)])


def test_lru_eviction_is_leaf_first_and_lru_across_paths():
    kv = KvBlockManager(6, 64, 4)
    old = P(1, 2, 3)
    new = P(4, 5, 6)
    compute(kv, old)
    compute(kv, new)
    kv.take_events()
    assert kv.reserve(6)
    ev = kv.take_events()
    assert removed(ev, "gpu") == [3, 2, 1, 6, 5, 4], "oldest path first, its leaf before its parents"
    kv.gpu.unreserve(6)
    kv.check([])


def test_shared_prefix_never_cut_in_the_middle():
    kv = KvBlockManager(5, 64, 4)
    a = P(1, 2, 3)
    b_ = P(1, 2, 4)  # shares blocks 1, 2 with a
    compute(kv, a)
    n_gpu, _ = kv.match(b_, 3)
    assert n_gpu == 2
    assert kv.admit(b_, 2, 1)
    kv.fill(b_, 2, 3)
    # while b holds 1, 2, 4 only block 3 (a's leaf) is evictable
    assert kv.gpu.available == 1 + 1  # one free slot + block 3
    kv.take_events()
    assert kv.reserve(2)
    assert removed(kv.take_events(), "gpu") == [3]
    kv.gpu.unreserve(2)
    kv.release(b_, 3, 0)
    assert kv.reserve(5)
    assert removed(kv.take_events(), "gpu") == [4, 2, 1]
    kv.gpu.unreserve(5)
    kv.check([])


def test_hit_takes_block_out_of_eviction_and_release_makes_it_newest():
    kv = KvBlockManager(4, 64, 4)
    compute(kv, P(1, 2))
    compute(kv, P(3, 4))
    assert kv.admit(P(1, 2), 2, 0)  # hit on the older path
    kv.release(P(1, 2), 2, 0)  # now newer than 3, 4
    kv.take_events()
    assert kv.reserve(4)
    assert removed(kv.take_events(), "gpu") == [4, 3, 2, 1]


def test_admission_never_over_commits_and_changes_nothing_on_failure():
    kv = KvBlockManager(4, 16, 4)
    a = P(1, 2, 3)
    assert kv.admit(a, 0, 3)
    kv.fill(a, 0, 3)
    before = (dict(kv.gpu.blocks), kv.gpu.reserved, len(kv.gpu.evictable))
    assert not kv.admit(P(7, 8), 0, 2), "only one slot is free and nothing is evictable"
    assert (dict(kv.gpu.blocks), kv.gpu.reserved, len(kv.gpu.evictable)) == before
    assert not kv.reserve(2)
    # a hit whose blocks are evictable does not count them as room
    kv.release(a, 3, 0)
    assert kv.gpu.available == 4
    assert not kv.admit(a, 3, 2), "3 hits are evictable: only 1 slot left for 2 new ones"
    assert kv.admit(a, 3, 1)
    kv.check([(a, 3, 1)])


def test_write_through_stores_every_l1_block_in_l2_with_events():
    kv = KvBlockManager(4, 16, 4)
    kv.take_events()
    a = P(11, 12, 13)
    assert kv.admit(a, 0, 4)
    kv.fill(a, 0, 2)
    kv.fill(a, 2, 3)
    ev = kv.take_events()
    g = stored(ev, "gpu")
    h = stored(ev, "host")
    assert [(e.block_hashes, e.parent_block_hash) for e in g] == [([11, 12], None), ([13], 12)]
    assert [(e.block_hashes, e.parent_block_hash) for e in h] == [([11, 12], None), ([13], 12)]
    assert all(e.block_size == 4 for e in g + h)
    # events come in order: gpu store before its host write-through
    assert ev.index(g[0]) < ev.index(h[0]) < ev.index(g[1])
    assert set(kv.gpu.blocks) <= set(kv.host.blocks)
    kv.check([(a, 3, 1)])


def test_l2_evicts_lru_unpinned_blocks_when_full():
    kv = KvBlockManager(2, 4, 4)
    compute(kv, P(1, 2))
    compute(kv, P(3, 4))  # evicts 1, 2 from L1 (leaf first): L2 holds 1..4
    kv.take_events()
    compute(kv, P(5, 6))  # L1 evicts 3, 4; L2 must evict 2, 1 (unpinned in that order)
    ev = kv.take_events()
    assert removed(ev, "gpu") == [4, 3]
    assert removed(ev, "host") == [2, 1]
    assert sorted(kv.host.blocks) == [3, 4, 5, 6]
    kv.check([])


def test_fill_dedupes_a_page_computed_meanwhile():
    kv = KvBlockManager(8, 32, 4)
    a = P(1, 2)
    assert kv.admit(a, 0, 2)
    assert kv.admit(a, 0, 2)  # second request, same prompt, admitted before the first computed it
    kv.fill(a, 0, 2)
    kv.take_events()
    kv.fill(a, 0, 2)
    assert kv.take_events() == [], "no event for pages already resident"
    assert kv.gpu.blocks[1].ref == 2 and kv.gpu.reserved == 0
    kv.check([(a, 2, 0), (a, 2, 0)])


def test_fill_and_release_after_a_held_prefix_start_at_its_last_run():
    """``fill`` from a held prefix and ``release`` start at the run that ends the prefix
    (``GpuBlockPool.ends``) instead of walking from L1's root; the cases they hand to the walk
    (pages computed meanwhile below the prefix; a prefix ending inside a run, which a request's
    held prefix never does) come out the same."""
    kv = KvBlockManager(16, 64, 4)
    a = P(1, 2, 3, 4, 5, 6)
    # A and B share the prompt; both hold the first two pages (computed by an earlier request)
    compute(kv, P(1, 2))
    for _ in range(2):
        n_gpu, _ = kv.match(a, 6)
        assert n_gpu == 2 and kv.admit(a, 2, 4)
    kv.take_events()
    kv.fill(a, 2, 4)  # B's chunk: new pages below the held run [1, 2]
    assert [e.block_hashes for e in stored(kv.take_events(), "gpu")] == [[3, 4]]
    kv.fill(a, 2, 4)  # A's chunk: pages 3, 4 were computed meanwhile: referenced, nothing stored
    assert kv.take_events() == []
    assert kv.gpu.blocks[3].ref == 2 and kv.gpu.blocks[4].ref == 2
    kv.fill(a, 4, 6)  # B goes on alone: its held prefix [1..4] ends a run
    assert [e.block_hashes for e in stored(kv.take_events(), "gpu")] == [[5, 6]]
    kv.check([(a, 6, 0), (a, 4, 2)])
    kv.release(a, 6, 0)  # B leaves: walked up from the run ending at page 6
    kv.check([(a, 4, 2)])
    assert kv.gpu.blocks[6].ref == 0 and kv.gpu.blocks[4].ref == 1
    # a prefix that ends inside a run (page 2 is inside A's run [1..4], merged at B's release): cut there
    kv.gpu.release(a, 2)
    assert kv.gpu.blocks[2].ref == 0 and kv.gpu.blocks[3].ref == 1
    kv.gpu.acquire(a, 2)
    kv.check([(a, 4, 2)])
    kv.fill(a, 4, 6)  # A: pages 5, 6 still resident (unreferenced): referenced again, not stored
    assert kv.take_events() == []
    kv.release(a, 6, 0)
    kv.check([])
    assert all(b.ref == 0 for b in kv.gpu.blocks.values())


def test_snapshot_lists_both_tiers():
    kv = KvBlockManager(2, 8, 4)
    compute(kv, P(1, 2))
    compute(kv, P(3))
    gpu, host = kv.snapshot()
    assert sorted(gpu) == [1, 3] and sorted(host) == [1, 2, 3]


def test_eviction_queue_orders_by_group_then_stamp():
    class Blk:
        def __init__(self, h, stamp, count=0):
            self.hash, self.last_access, self.count, self.group = h, stamp, count, 0

    q = EvictionQueue(BranchCountPolicy())
    a, b_, c = Blk(1, 1, count=2), Blk(2, 2), Blk(3, 3, count=1)
    for x in (a, b_, c):
        q.push(x)
    assert [x.hash for x in q.ordered()] == [2, 1, 3]
    c.count, c.last_access = 0, 4
    assert q.regroup(c)
    assert [x.hash for x in q.ordered()] == [2, 3, 1]
    assert q.pop().hash == 2 and len(q) == 2 and 3 in q
    q.remove(c)
    assert q.pop() is a and q.pop() is None
    assert get_policy("lru").name == "lru" and isinstance(get_policy("lru"), LruPolicy)


def test_branch_count_evicts_zero_count_host_blocks_first():
    kv = KvBlockManager(2, 4, 4, host_policy="branch-count")
    compute(kv, P(1, 2))
    compute(kv, P(3, 4))  # L2: 1, 2 unpinned (older), 3, 4 pinned
    # the directory says an active branch still references 1, 2
    assert kv.update_counts([1, 2, 99], [1, 1, 5]) == 2
    compute(kv, P(7, 8))  # L1 evicts 3, 4 → unpinned with count 0; L2 must drop two blocks
    ev = kv.take_events()
    assert removed(ev, "host") == [4, 3], "zero-count blocks go first although 1, 2 are older"
    kv.check([])
    with pytest.raises(ValueError):
        kv.update_counts([1], [1, 2])


def test_lru_ignores_counts_for_ordering():
    kv = KvBlockManager(2, 4, 4, host_policy="lru")
    compute(kv, P(1, 2))
    compute(kv, P(3, 4))
    assert kv.update_counts([1, 2], [1, 1]) == 0
    kv.take_events()
    compute(kv, P(7, 8))
    assert removed(kv.take_events(), "host") == [2, 1]


def test_check_catches_a_pool_that_loses_a_release():
    kv = KvBlockManager(4, 16, 4)
    a = P(1, 2)
    assert kv.admit(a, 0, 2)
    kv.fill(a, 0, 2)
    kv.release(a, 1, 0)  # a release that forgot the last block: block 2 stays referenced
    with pytest.raises(KvInvariantError, match="ref"):
        kv.check([])


def test_branch_count_keeps_a_forks_shared_prefix_behind_its_new_page():
    kv = KvBlockManager(3, 16, 4, host_policy="branch-count")
    compute(kv, P(1, 2, 3))
    compute(kv, P(5, 6, 7))  # 1, 2, 3 leave L1
    kv.update_counts([1, 2, 3], [1, 1, 1])
    compute(kv, P(1, 2, 4))  # fork: restores 1, 2, computes 4
    compute(kv, P(8, 9, 10))  # 1, 2, 4 leave L1 (4 first)
    kv.update_counts([4], [1])  # the fork branch now references 4
    order = [x.hash for x in kv.host.evictable.ordered() if x.group == 1]
    assert order == [3, 4, 2, 1], "4 must go before its parents 2, 1"
    kv.check([])


@pytest.mark.parametrize("policy", ["lru", "branch-count"])
def test_resync_snapshot_rebuilds_the_nodes_prefixes_in_the_kv_directory(policy):
    # a directory that missed a node's events resyncs from this snapshot: with the parents
    # every block joins its prefix again (without them none would: lookups would miss)
    from services.kvdirectory.core import KvDirectory
    from shared.messages import KvSnapshot

    kv = KvBlockManager(6, 16, 4, policy)
    compute(kv, P(1, 2, 3))
    compute(kv, P(1, 2, 7, 8))
    compute(kv, P(20, 21, 22, 23, 24))  # L1 holds 6: older blocks stay in L2 only
    g, gp, h, hp = kv.snapshot_parents()
    d = KvDirectory(4)
    d.apply_snapshot(KvSnapshot(node="w0", seq=3, block_size=4, gpu=g, gpu_parents=gp, host=h, host_parents=hp), 0.0)
    for path in (P(1, 2, 3), P(1, 2, 7, 8), P(20, 21, 22, 23, 24)):
        got = d.lookup(path).node("w0")
        assert got.host_blocks == len(path) and got.local_blocks == len(path)
    assert d.lookup(P(20, 21, 22, 23, 24)).node("w0").gpu_blocks == sum(1 for x in (20, 21, 22, 23, 24) if x in g)
    bare = KvDirectory(4)  # the same snapshot without parents: the blocks are known, no prefix is
    bare.apply_snapshot(KvSnapshot(node="w0", seq=3, block_size=4, gpu=g, host=h), 0.0)
    assert bare.lookup(P(1, 2, 3)).node("w0").local_blocks == 0


@pytest.mark.parametrize("policy", ["lru", "branch-count"])
def test_a_broken_hold_is_settled_without_dropping_a_later_holders_hold(policy):
    """A write-through breaks A's hold on pages 1–4 (every queued L2 page is held); the
    pages come back and B holds them. A's unhold, owed since the break, must not drop
    B's hold: before, the break forgot A's count and A's unhold took B's."""
    kv = KvBlockManager(4, 8, 4, policy)
    compute(kv, P(1, 2, 3, 4))
    compute(kv, P(5, 6, 7, 8))  # 1–4 leave L1: unpinned in L2, which is full
    held_a = kv.hold(P(1, 2, 3, 4), 4)
    held_a2 = kv.hold(P(5, 6, 7, 8), 4)
    compute(kv, P(9, 10, 11, 12))  # 5–8 leave L1: every queued L2 page is held, 4 must go
    again = [h for h in (1, 2, 3, 4, 5, 6, 7, 8) if h not in kv.host]
    assert len(again) == 4 and all(kv.host.holds.get(h) is None for h in again)
    compute(kv, again)  # the broken pages are computed again (a prefix: 1–4 or 5–8)
    held_b = kv.hold(again, 4)
    assert held_b == again and all(kv.host.holds[h] == 1 for h in again)
    kv.unhold(held_a if again[0] == 1 else held_a2)  # the holder whose hold broke leaves
    assert all(kv.host.holds.get(h) == 1 for h in again), "B's hold must survive A's late unhold"
    assert kv.host.broken == {}
    kv.unhold(held_b)
    kv.unhold(held_a2 if again[0] == 1 else held_a)
    assert kv.host.holds == {} and kv.host.broken == {}
    holders_none(kv)


@pytest.mark.parametrize(
    "hashes,counts",
    [
        ([3, 3], [1, 0]),  # named twice: the last count (0) stands, nothing moves
        ([3, 3], [1, 2]),  # named twice, both positive: moved once
        ([3, 2, 3], [1, 1, 1]),  # all positive, one named twice among others
        ([1, 2, 1], [0, 0, 0]),  # all zero, one named twice among others
        ([1, 1], [1, 0]),  # named twice, already in group 1: moved back to group 0
        ([2, 12, 1, 11, 3], [1, 1, 1, 1, 1]),  # two paths alternating: a chain per block, lifts
        ([3, 2, 1, 13], [1, 1, 1, 1]),  # deepest first: a chain per block, then another path's
        ([11, 12, 13, 3], [1, 1, 1, 1]),  # parent first: one chain of three, then 3 (lifts 2, 1)
    ],
)
def test_branch_count_update_counts_equals_the_per_block_model(hashes, counts):
    # the pool's chains and lifts make the same moves and stamps as the per-block model
    from tests.unit.worker import ref_blocks

    pools = [KvBlockManager(3, 16, 4, host_policy="branch-count"), ref_blocks.KvBlockManager(3, 16, 4, host_policy="branch-count")]
    for kv in pools:
        compute(kv, P(1, 2, 3))
        compute(kv, P(11, 12, 13))
        compute(kv, P(5, 6, 7))  # 1, 2, 3 and 11, 12, 13 are unpinned in L2
        kv.update_counts([2, 1], [1, 1])  # 1, 2 in group 1 first: later moves lift or pass them
    moved = [kv.update_counts(hashes, counts) for kv in pools]
    assert moved[0] == moved[1]
    got, want = ([(x.hash, x.group) for x in kv.host.evictable.ordered()] for kv in pools)
    assert got == want
    pools[0].check([])


@pytest.mark.parametrize("policy", ["lru", "branch-count"])
def test_l2_membership_and_absent_cover_pinned_queued_and_evicted_pages(policy):
    """``h in kv.host`` and ``kv.host.absent`` (the real-bytes fetch path's question): pinned
    (L1) pages and queued ones are in L2, evicted and never stored ones are not, in order.
    Under branch-count L2 keeps no set of every page: the answer comes from its queued pages
    and L1's runs."""
    kv = KvBlockManager(4, 8, 4, policy)
    compute(kv, P(1, 2, 3, 4))
    compute(kv, P(5, 6, 7, 8))  # 1–4 leave L1: queued in L2; 5–8 pinned
    compute(kv, P(9, 10, 11, 12))  # L2 full: 1–4 evicted, 5–8 queued, 9–12 pinned
    present = {5, 6, 7, 8, 9, 10, 11, 12}
    for h in range(1, 15):
        assert (h in kv.host) == (h in present)
    ask = [13, 9, 1, 5, 14, 12, 2]
    assert kv.host.absent(ask) == [13, 1, 14, 2]
    assert kv.host.absent(iter([9, 5])) == []
    assert kv.host._members() == present
    holders_none(kv)


def test_branch_count_counted_trim_keeps_l2_pages_only():
    """Counts naming pages L2 does not hold pile up in ``counted`` until they outnumber twice
    L2's pages + 1024; then the set is cut to L2's pages (pinned and queued), and a counted
    queued page keeps its group."""
    kv = KvBlockManager(4, 8, 4, "branch-count")
    compute(kv, P(1, 2, 3, 4))
    compute(kv, P(5, 6, 7, 8))  # 1–4 queued, 5–8 pinned
    kv.update_counts([1, 2, 5], [1, 1, 1])
    assert kv.host.counted == {1, 2, 5}
    stray = list(range(100, 100 + 2 * 8 + 1024 - 3))
    kv.update_counts(stray, [1] * len(stray))  # exactly at the limit: kept
    assert len(kv.host.counted) == 2 * 8 + 1024
    kv.update_counts([99], [1])  # one past it: cut to L2's pages
    assert kv.host.counted == {1, 2, 5}
    assert [(x.hash, x.group) for x in kv.host.evictable.ordered()] == [(4, 0), (3, 0), (2, 1), (1, 1)]
    holders_none(kv)


@pytest.mark.parametrize("policy", ["lru", "branch-count"])
def test_match_hold_equals_match_then_hold(policy):
    """``match_hold`` (the scheduler's enqueue and fetch completion) answers and holds as
    ``match`` then ``hold`` of the L1 + L2 prefix found: two pools fed the same random stream
    (computed prefixes, L1 evictions, peer fetches into L2, holds taken and dropped), one
    taking its holds through ``match_hold``, the other through the two calls."""
    import random

    rng = random.Random(23)
    a, b = KvBlockManager(10, 30, 4, policy), KvBlockManager(10, 30, 4, policy)
    paths: list[list[int]] = []
    holds: list[tuple[list[int], list[int]]] = []
    seen = {"l2": 0, "l1": 0, "none": 0}
    nxt = 1
    for _ in range(600):
        op = rng.random()
        if op < 0.3 or not paths:  # a prefix computed (a fork of an earlier one, or new)
            base = rng.choice(paths)[: rng.randint(0, 6)] if paths and rng.random() < 0.7 else []
            k = rng.randint(1, 6)
            path = base + list(range(nxt, nxt + k))
            nxt += k
            if len(path) > 8:
                continue
            paths.append(path)
            for kv in (a, b):
                compute(kv, path)
        elif op < 0.45:  # a peer fetch lands in L2
            path = rng.choice(paths)
            lo = rng.randint(0, len(path))
            assert a.store_fetched(path, lo, len(path)) == b.store_fetched(path, lo, len(path))
        elif op < 0.85:  # a queued request's prefix: matched and held
            path = rng.choice(paths)
            limit = rng.randint(0, len(path))
            got = a.match_hold(path, limit)
            n_gpu, n_host = b.match(path, limit)
            want = (n_gpu, n_host, b.hold(path, n_gpu + n_host) if n_host else None)
            assert got == want
            seen["l2" if n_host else "l1" if n_gpu else "none"] += 1
            if n_host:
                holds.append((got[2], want[2]))  # type: ignore[arg-type]
        elif holds:  # ... and admitted or gone
            ha, hb = holds.pop(rng.randrange(len(holds)))
            a.unhold(ha)
            b.unhold(hb)
        assert a.host.holds == b.host.holds
        assert a.take_events() == b.take_events()
    assert min(seen.values()) > 20, seen


@pytest.mark.parametrize("policy", ["lru", "branch-count"])
def test_match_admit_equals_match_then_admit(policy):
    """``match_admit`` (the scheduler's admission) answers and changes the pools as ``match``
    then ``admit`` of the L1 hit found: two pools fed the same random stream (admissions with
    L2 restores, chunks computed, requests leaving, peer fetches into L2), one admitting
    through ``match_admit``, the other through the two calls; small pools, so admissions
    are refused and L1 evicts."""
    import random

    from tests.property.test_worker_blocks_model import _state

    rng = random.Random(41)
    a, b = KvBlockManager(12, 30, 4, policy), KvBlockManager(12, 30, 4, policy)
    paths: list[list[int]] = []
    live: list[list] = []  # [path, held, reserved]
    seen = {"admitted": 0, "refused": 0, "hit": 0}
    nxt = 1
    for _ in range(800):
        op = rng.random()
        if op < 0.35 or not paths:  # a request is admitted (or refused) with its L1 hit and L2 restore
            if paths and rng.random() < 0.7:
                path = rng.choice(paths)[:]
                if rng.random() < 0.5:
                    path = path[: rng.randint(0, len(path))] + list(range(nxt, nxt + 3))
                    nxt += 3
            else:
                path = list(range(nxt, nxt + rng.randint(1, 6)))
                nxt += len(path)
            if not path or len(path) > 9:
                continue
            paths.append(path)
            limit = rng.randint(max(0, len(path) - 1), len(path))
            footprint = len(path) + rng.randint(0, 3)
            got = a.match_admit(path, limit, footprint)
            n_gpu, n_host = b.match(path, limit)
            want = (n_gpu, n_host, b.admit(path, n_gpu, footprint - n_gpu))
            assert got == want
            seen["admitted" if got[2] else "refused"] += 1
            seen["hit"] += bool(got[2] and n_gpu)
            if got[2]:
                held, res = n_gpu, footprint - n_gpu
                if n_host:
                    for kv in (a, b):
                        kv.fill(path, n_gpu, n_gpu + n_host)
                    held, res = held + n_host, res - n_host
                live.append([path, held, res])
        elif op < 0.6 and live:  # a chunk computed
            r = rng.choice(live)
            path, held, res = r
            if held < len(path) and res:
                k = rng.randint(1, min(len(path) - held, res))
                for kv in (a, b):
                    kv.fill(path, held, held + k)
                r[1], r[2] = held + k, res - k
        elif op < 0.85 and live:  # a request leaves
            path, held, res = live.pop(rng.randrange(len(live)))
            for kv in (a, b):
                kv.release(path, held, res)
        elif paths:  # a peer fetch lands in L2
            path = rng.choice(paths)
            lo = rng.randint(0, len(path))
            assert a.store_fetched(path, lo, len(path)) == b.store_fetched(path, lo, len(path))
        assert a.take_events() == b.take_events()
        assert _state(a) == _state(b)
    a.check([(p, h, r) for p, h, r in live])
    assert min(seen.values()) > 20, seen
