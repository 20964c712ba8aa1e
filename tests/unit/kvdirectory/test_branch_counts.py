"""Branch counts as path prefixes (issue 23): C_{β,n} = π_β[:k], a Count is one path slice, and a
node's count changes are drained in path order (parent first, in the order the changes happened),
also when a drain is cut into messages of ``max_updates_per_msg``."""

from __future__ import annotations

import random

import pytest

from services.kvdirectory.core import KvDirectory
from services.kvdirectory.index import GPU, HOST
from shared.messages import BlockStored, KvEventBatch
from tests.unit.kvdirectory.helpers import BS, H, drained, store

A = [5_000_003 * i % 1_000_003 for i in range(1, 7)]
B = [7_000_009 * i % 1_000_033 for i in range(1, 7)]


def test_the_path_order_is_not_the_set_order():
    assert list(frozenset(H)) != H and list(frozenset(A + B)) != A + B  # else the tests below prove nothing


def test_a_placement_is_drained_in_path_order():
    d = KvDirectory(BS)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H, 1.0)
    assert drained(d) == [("p0", H, [1] * len(H))]
    d.place("b", "p0", "prefill", H + A, 2.0)  # an extension counts the new tail only
    assert drained(d) == [("p0", A, [1] * len(A))]
    d.branch_end("b", 3.0)
    assert drained(d) == [("p0", H + A, [0] * (len(H) + len(A)))]
    d.branches.check()


def test_a_cut_drain_keeps_path_order_and_each_block_once():
    """Two forks' tails move up on p1 in one drain: the shared prefix (changed by both) is listed
    where it first changed, then A's tail, then B's, cut every 4 blocks."""
    d = KvDirectory(BS, max_updates_per_msg=4)
    d.branch_start("main", 0.0)
    d.place("main", "p0", "prefill", H[:4], 1.0)
    drained(d)
    d.branch_start("a", 1.0, kind="fork", parent="main")
    d.branch_start("b", 1.0, kind="fork", parent="main")
    d.place("a", "p1", "prefill", H[:4] + A, 2.0)
    d.place("b", "p1", "prefill", H[:4] + B, 2.0)
    msgs = d.take_count_updates()
    assert [u.seq for u in msgs] == [1, 2, 3, 4] and all(u.node == "p1" for u in msgs)
    assert [u.hashes for u in msgs] == [H[:4], A[:4], A[4:] + B[:2], B[2:]]
    assert sum((u.counts for u in msgs), []) == [2] * 4 + [1] * 12
    d.branches.check()


def test_changes_to_a_block_within_one_drain_are_merged():
    """A block changed twice is sent once, with its count now, where it first changed; a change
    undone before the drain is not sent."""
    d = KvDirectory(BS)
    d.branch_start("a", 0.0)
    d.place("a", "p0", "prefill", H[:3], 1.0)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:5], 1.0)
    d.branch_start("tmp", 0.0)
    d.place("tmp", "p0", "prefill", A, 1.0)
    d.branch_end("tmp", 1.0)  # 0 → 1 → 0 before the drain: not sent
    d.branch_end("a", 1.0)
    assert d.pending_count_updates() == 3 + 5 + 2 * len(A) + 3  # changes listed, a block changed twice twice
    assert drained(d) == [("p0", H[:5], [1] * 5)]
    assert d.pending_count_updates() == 0 and drained(d) == []
    d.branches.check()


@pytest.mark.parametrize("keep", [False, True])
def test_a_host_store_re_sends_counts_in_the_stores_order(keep: bool):
    d = KvDirectory(BS, keep_counted_copies=keep)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H, 1.0)
    d.branch_start("c", 0.0)
    d.place("c", "p0", "prefill", H[:4], 1.0)
    drained(d)
    store(d, "p0", H[2:9], "host", parent=H[1])
    assert drained(d) == [("p0", H[2:9], [2, 2] + [1] * 5)]
    store(d, "p0", H[:2], "gpu")  # a GPU store re-sends nothing
    assert drained(d) == []
    assert d.branches.counted_copies[d.node_id("p0")] == [2, 7]
    d.branches.check()


def _moves_and_stores(d: KvDirectory, batches: list[list[BlockStored]]) -> list[tuple[str, list[int], list[int]]]:
    """Branches a and b counted on p0 (prefill), then moved to p1 (prefill: the move waits for
    their last blocks A[-1] and B[-1] on p1), c counted on p1 for H[:3]; then ``batches``."""
    for bid, path in (("a", H[:4] + A), ("b", H[:4] + B)):
        d.branch_start(bid, 0.0)
        d.place(bid, "p0", "prefill", path, 1.0)
        d.place(bid, "p1", "prefill", path, 2.0)
    d.branch_start("c", 0.0)
    d.place("c", "p1", "prefill", H[:3], 2.0)
    assert {h for w in d.branches.watch for h in w} == {A[-1], B[-1]}
    drained(d)
    for events in batches:
        seq = d._streams[d.node_id("p1")].next_seq  # noqa: SLF001 - the batch it awaits
        d.apply_kv_batch(KvEventBatch(node="p1", seq=seq, ts=3.0, events=events), 3.0)
    d.branches.check()
    return drained(d)


@pytest.mark.parametrize("keep", [False, True])
def test_a_store_and_its_write_through_act_as_the_two_stores(keep: bool):
    """A GPU store followed by its host write-through in one batch (``on_stored_through``, one
    pass over the blocks) changes counts, counted copies, moves and messages exactly as the two
    stores in two batches (``on_stored`` twice): here with uncounted blocks among them and a
    move that the store finishes."""
    chain = H[:6]  # H[:4] counted by a and b on p1, H[:3] by c too; H[4:6] by nobody

    def ev(tier: str) -> BlockStored:
        return BlockStored(block_hashes=list(chain), parent_block_hash=None, tier=tier, block_size=BS)

    seen = []
    for batches in ([[ev("gpu"), ev("host")]], [[ev("gpu")], [ev("host")]]):
        d = KvDirectory(BS, keep_counted_copies=keep)
        seen.append((_moves_and_stores(d, batches), d.branches.counted_copies, dict(d.counters)))
    paired, apart = seen
    assert paired[0] == apart[0] == [("p1", H[:4], [3, 3, 3, 2])]  # the host store re-sends its counted blocks
    assert paired[1] == apart[1] and paired[1][1] == [4, 4]
    assert {k: v for k, v in paired[2].items() if not k.startswith("kv.batches")} == {
        k: v for k, v in apart[2].items() if not k.startswith("kv.batches")
    }
    seen = []
    for batches in ([[BlockStored(block_hashes=A, parent_block_hash=H[3], tier=t, block_size=BS) for t in ("gpu", "host")]],
                    [[BlockStored(block_hashes=A, parent_block_hash=H[3], tier=t, block_size=BS)] for t in ("gpu", "host")]):
        d = KvDirectory(BS, keep_counted_copies=keep)
        seen.append((_moves_and_stores(d, batches), d.branches.counted_copies, d.branch("a").counted))
    assert seen[0] == seen[1]
    assert seen[0][2] == {KvDirectory(BS).node_id("p1") + 1: 4 + len(A)}  # a's move finished: released on p0
    assert ("p0", H[:4] + A, [1] * 4 + [0] * len(A)) in seen[0][0]


def test_moves_finished_by_one_store_release_in_the_order_of_the_watched_set():
    """A store that brings the watched blocks of several moves finishes them in the order of
    the set of watched blocks among the stored ones (built in the store's order), as when the
    hook intersected the watch with every stored block: the sources' releases are drained in
    that order (for one of the two store orders it is not the store's)."""
    assert list({A[-1], B[-1]}) == list({B[-1], A[-1]})  # else the test below proves less
    for stored in ([A[-1], B[-1]], [B[-1], A[-1]]):
        d = KvDirectory(BS)
        got = _moves_and_stores(d, [[BlockStored(block_hashes=stored, parent_block_hash=None, tier="host", block_size=BS)]])
        order = list({A[-1]: "a", B[-1]: "b"}.keys() & stored)
        tails = {A[-1]: A, B[-1]: B}
        p0 = [(hs, c) for n, hs, c in got if n == "p0"]
        assert p0 == [(H[:4] + tails[order[0]] + tails[order[1]], [0] * (4 + 2 * len(A)))]  # one drain, merged
        assert not any(d.branches.watch) and d.branch("a").counted.keys() == d.branch("b").counted.keys() == {d.node_id("p1")}
        assert d.counters["moves.released_sources"] == 2


def test_a_version_bump_keeps_the_common_prefix_counted_everywhere():
    """C ∩ π_new is the common prefix of π_old and π_new (chained hashes), on every node."""
    d = KvDirectory(BS)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:10], 1.0)
    d.place("b", "d0", "decode", H[:12], 2.0)
    drained(d)
    r = d.place("b", "p0", "prefill", H[:6] + A, 3.0)  # compaction: keeps H[:6]
    assert r.bumped and r.version == 2
    assert d.branch("b").counted == {d.node_id("p0"): 6 + len(A), d.node_id("d0"): 6}
    assert sorted(drained(d)) == [("d0", H[6:12], [0] * 6), ("p0", H[6:10] + A, [0] * 4 + [1] * len(A))]
    d.branches.check()


@pytest.mark.parametrize("keep", [False, True])
def test_crossings_are_counted_per_index_run_with_a_tail_stored_nowhere(keep: bool):
    """Counts crossing 0 are a tail of the slice; present copies (kept on crossings, run by run
    of the index, or counted when read) and the not-yet-stored rest of the path adds none."""
    d = KvDirectory(BS, keep_counted_copies=keep)
    store(d, "p0", H[:6], "gpu")
    store(d, "p0", H[:3], "host")
    store(d, "p0", H[6:8], "host", parent=H[5])  # three runs: presence gh, g, h
    d.branch_start("x", 0.0)
    d.place("x", "p0", "prefill", H[:2], 1.0)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H, 1.0)  # H[2:] cross 0; H[8:] are stored nowhere
    assert d.branches.counted_copies[d.node_id("p0")] == [6, 5]
    d.branch_end("b", 2.0)
    assert d.branches.counted_copies[d.node_id("p0")] == [2, 2]
    d.branches.check()


def test_a_count_table_that_lost_an_entry_neither_crashes_nor_miscounts_the_rest():
    """Tampered R (the zero is not a tail of the slice): the per-block path counts the crossing."""
    d = KvDirectory(BS)
    store(d, "p0", H[:3], "host")
    d.branch_start("a", 0.0)
    d.place("a", "p0", "prefill", H[:3], 1.0)
    n = d.node_id("p0")
    del d.branches.R[n][H[0]]  # corrupt the state on purpose
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:3], 1.0)
    assert [d.count("p0", h) for h in H[:3]] == [1, 2, 2]
    assert d.branches.counted_copies[n][HOST] == 3  # counted when asked: the 3 present and counted
    d.branch_end("a", 2.0)
    assert [d.count("p0", h) for h in H[:3]] == [0, 1, 1]
    # the 2 present and counted (counted copies were once kept on crossings: the corruption's drift stayed)
    assert d.branches.counted_copies[n][HOST] == 2 and d.counters["count.negative_prevented"] == 0
    d.branch_start("c", 0.0)
    d.place("c", "p0", "prefill", H[:4], 1.0)  # H[0] uncounted, H[1:3] counted, H[3] new: not a tail
    assert [d.count("p0", h) for h in H[:4]] == [1, 2, 2, 1]
    d.branch_end("b", 2.0)  # b's slice starts with a 1 (H[0]) but is not all ones: put back, per block
    assert [d.count("p0", h) for h in H[:4]] == [0, 1, 1, 1] and d.counters["count.negative_prevented"] == 0


def test_a_release_of_another_shape_is_put_back_and_counted_per_block():
    """A release whose slice is not a head above 1 and a tail of 1s (only a tampered R makes one)
    is popped, found out, put back and counted block by block."""
    cases = (
        ({1: 1, 3: 1, 5: 1}, [1, 0, 1, 0, 1, 0]),  # the head found by bisection holds a 1
        ({2: 1, 5: 1}, [1, 1, 0, 1, 1, 0]),  # the popped tail is not all 1s: put back
        ({2: None, 5: 1}, [1, 1, 0, 1, 1, 0]),  # ... nor all there: put back, one refused
    )
    for tamper, want in cases:
        d = KvDirectory(BS)
        for bid in ("a", "b"):
            d.branch_start(bid, 0.0)
            d.place(bid, "p0", "prefill", H[:6], 1.0)
        R = d.branches.R[d.node_id("p0")]
        for i, v in tamper.items():  # corrupt the state on purpose: [2] * 6 -> tamper
            if v is None:
                del R[H[i]]
            else:
                R[H[i]] = v
        d.branch_end("b", 2.0)
        assert [d.count("p0", h) for h in H[:6]] == want, tamper
        assert d.counters["count.negative_prevented"] == (1 if None in tamper.values() else 0)


@pytest.mark.parametrize(
    "counted, tamper, want",
    [
        (0, {5: 1}, [1, 1, 1, 1, 1, 2, 1, 1]),  # first and last uncounted, one inside counted
        (3, {5: 1}, [2, 2, 2, 1, 1, 2, 1, 1]),  # a counted head, one inside the new tail counted
        (3, {6: 3}, [2, 2, 2, 1, 1, 1, 4, 1]),
    ],
)
def test_a_count_up_of_another_shape_is_taken_back_and_counted_per_block(counted, tamper, want):
    """A placement whose slice is not a counted head and a tail of new blocks (only a tampered
    R makes one): the tail's +1s are taken back and every block gets its count + 1, as the
    per-block path reads them; the drained message says the same."""
    d = KvDirectory(BS)
    if counted:
        d.branch_start("a", 0.0)
        d.place("a", "p0", "prefill", H[:counted], 1.0)
    R = d.branches.R[d.node_id("p0")]
    for i, v in tamper.items():  # corrupt the state on purpose
        R[H[i]] = v
    drained(d)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:8], 1.0)
    assert [d.count("p0", h) for h in H[:8]] == want
    assert drained(d) == [("p0", H[:8], want)]
    assert len(R) == 8 and d.counters["count.negative_prevented"] == 0


def test_a_count_up_of_a_path_repeating_a_hash_counts_it_once():
    """A slice that repeats a new hash (not a chain): its +1s are taken back and the per-block
    path counts the hash once, as before the slices were counted in C."""
    d = KvDirectory(BS)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", [5, 6, 7, 5], 1.0)
    assert [d.count("p0", h) for h in (5, 6, 7)] == [1, 1, 1]
    assert drained(d) == [("p0", [5, 6, 7, 5], [1, 1, 1, 1])]
    d.branch_start("c", 0.0)
    d.place("c", "p0", "prefill", [5, 6, 8, 9, 8], 1.0)  # a counted head, a tail repeating a new hash
    assert [d.count("p0", h) for h in (5, 6, 7, 8, 9)] == [2, 2, 1, 1, 1]
    assert drained(d) == [("p0", [5, 6, 8, 9, 8], [2, 2, 1, 1, 1])]


def test_a_path_with_a_repeated_hash_does_not_break_the_table():
    """Not a chain (``shared.validate`` refuses such a RoutePlaced at the edge): given directly,
    counts stay non-negative and nothing raises; the repeated hash may keep a count."""
    d = KvDirectory(BS)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", [5, 6, 5, 7], 1.0)
    d.place("b", "p0", "prefill", [5, 6, 5, 7, 5], 2.0)
    d.branch_end("b", 3.0)
    assert d.count("p0", 6) == d.count("p0", 7) == 0 and d.count("p0", 5) >= 0
    assert d.counters["count.negative_prevented"] == 0


@pytest.mark.parametrize("keep", [False, True])
def test_random_operations_keep_counts_a_function_of_prefixes(keep: bool):
    """Placements (extend, compact, repeat), forks, moves, ends, phase switches and stores, checked
    after every step by ``BranchTable.check`` (counts recomputed from the prefixes, no zero
    entries, counts never growing along a prefix; with ``keep``, the counted copies kept on every
    change equal to the ones counted from scratch)."""
    rng = random.Random(23)
    d = KvDirectory(BS, branch_ttl_s=400.0, max_updates_per_msg=7, keep_counted_copies=keep)
    nodes = ["a", "b", "c"]
    for n in nodes:
        d.node_id(n)
    paths: dict[str, list[int]] = {}
    parent: dict[int, int | None] = {}
    nxt = [1000]

    def fresh(k: int, after: list[int]) -> list[int]:
        out = list(after)
        for _ in range(k):
            nxt[0] += 1
            parent[nxt[0]] = out[-1] if out else None
            out.append(nxt[0])
        return out

    known: dict[str, dict[int, int]] = {n: {} for n in nodes}  # what the workers were sent
    for step in range(1500):
        now = float(step)
        op = rng.random()
        if op < 0.1 or not paths:
            bid = f"b{step}"
            par = rng.choice(sorted(paths)) if paths and rng.random() < 0.5 else None
            d.branch_start(bid, now, kind="fork" if par else "main", parent=par)
            paths[bid] = list(paths[par]) if par else []
        elif op < 0.65:
            bid = rng.choice(sorted(paths))
            old = paths[bid]
            how = rng.choice(["extend", "extend", "compact", "same"])
            if how == "extend" or not old:
                new = fresh(rng.randint(1, 12), old)
            elif how == "compact":
                new = fresh(rng.randint(1, 4), old[: rng.randint(0, len(old) - 1)])
            else:
                new = old
            paths[bid] = new
            n = rng.choice(nodes)
            d.place(bid, n, rng.choice(["prefill", "decode", "both"]), new, now)
            if rng.random() < 0.6:
                a = rng.randrange(len(new))
                store(d, n, new[a:], rng.choice(["gpu", "host"]), parent=parent[new[a]])
        elif op < 0.75:
            bid = rng.choice(sorted(paths))
            d.branch_end(bid, now)
            del paths[bid]
        elif op < 0.82:
            n = rng.choice(nodes)
            d.node_phase_changed(n, d.node_phase(n), rng.choice(["prefill", "decode"]), now)
        elif op < 0.85:
            for bid in d.expire(now + rng.choice([0.0, 500.0])):
                paths.pop(bid, None)
        else:
            for u in d.take_count_updates():
                assert len(u.hashes) <= 7
                for h, c in zip(u.hashes, u.counts):
                    known[u.node][h] = c
        d.branches.check()
    for u in d.take_count_updates():
        for h, c in zip(u.hashes, u.counts):
            known[u.node][h] = c
    for n in nodes:  # the workers' view of the counts converges to R
        assert {h: c for h, c in known[n].items() if c} == d.branches.R[d.node_id(n)]
    assert d.counters["count.negative_prevented"] == 0


def test_check_catches_a_count_that_is_not_a_prefix_count():
    d = KvDirectory(BS)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:4], 1.0)
    d.branches.R[d.node_id("p0")][H[3]] = 2  # a count the branch table does not explain
    try:
        d.branches.check()
    except AssertionError as e:
        assert "R[0]" in str(e)
    else:
        raise AssertionError("check() missed a wrong count")
    assert GPU == 0


@pytest.mark.parametrize("chained", [False, True])
def test_a_same_length_rewrite_rewatches_a_pending_move(chained: bool):
    """A placement whose path has the old one's length but another last hash (a rewrite: a version
    bump) makes a pending move wait for the new last block; with ``chained`` (the simulator) the
    placement tells a rewrite from the last hash alone, not by comparing whole paths: the same
    messages and counts either way, and the move to p1 completes once p1 stores the new path."""
    d = KvDirectory(BS, chained=chained)
    p2 = H[:6]
    p3 = H[:5] + [H[19] + 1]  # same length as p2, another last block (a sibling of H[5])
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:5], 1.0)
    d.place("b", "p1", "prefill", p2, 2.0)  # a move: p0 released once p1 holds p2's last block
    assert drained(d) == [("p0", H[:5], [1] * 5), ("p1", p2, [1] * 6)]
    d.place("b", "d0", "decode", p3, 3.0)  # rewrite; the pending move to p1 now waits for p3[-1]
    assert d.branches.counters["branch.version_bumps"] == 1
    assert drained(d) == [("p1", p2[5:], [0]), ("d0", p3, [1] * 6)]
    store(d, "p1", p2, "host")  # the old last block: not the version the move waits for
    assert d.branches.R[d.node_id("p0")]  # p0 still counted: the move waits
    store(d, "p1", p3[5:], "host", parent=p3[4])
    assert not d.branches.R[d.node_id("p0")]  # p0 released: p1 holds the branch's version
    d.branches.check()
