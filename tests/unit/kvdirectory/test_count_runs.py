"""Branch counts in runs (``BranchTable`` with ``chained``, issue 23 deliverable 3): a Count walks the
runs of the counted-block forest its slice spans, so a move costs O(runs of the path), and every
count, outbox entry, drain and counter is the one the per-block dicts give."""

from __future__ import annotations

import random

import pytest

from services.kvdirectory.core import KvDirectory
from tests.unit.kvdirectory.helpers import BS, drained, store


def _runs(d: KvDirectory) -> list[tuple[int, int, dict[int, int]]]:
    """The forest's counted runs as ``(depth, blocks, counts per node)``, in depth order (a run
    counted nowhere stays in ``where`` with no counts: not listed)."""
    seen = {id(r): r for r in d.branches.runs.where.values() if r.cnt}
    return sorted((r.depth, len(r.keys), dict(r.cnt)) for r in seen.values())


def test_a_move_of_a_long_path_changes_one_count_per_run() -> None:
    """A 2,000-block path placed on p0 and moved to p1: one run, its counts {p0: 1} → {p0: 1, p1: 1}
    (the move's count-up) → {p1: 1} (p0 released once p1 holds the path); the messages are the
    per-block ones (every block listed with its count)."""
    path = list(range(10_000, 12_000))
    d = KvDirectory(BS, chained=True)
    p0, p1 = d.node_id("p0"), d.node_id("p1")
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", path, 1.0)
    assert _runs(d) == [(0, 2000, {p0: 1})]
    assert drained(d) == [("p0", path, [1] * 2000)]
    d.place("b", "p1", "prefill", path, 2.0)  # a move: p0 released once p1 holds the last block
    assert _runs(d) == [(0, 2000, {p0: 1, p1: 1})]
    store(d, "p1", path, "host")
    assert _runs(d) == [(0, 2000, {p1: 1})]
    assert drained(d) == [("p0", path, [0] * 2000), ("p1", path, [1] * 2000)]
    assert len(d.branches.R[p0]) == 0 and len(d.branches.R[p1]) == 2000
    d.branch_end("b", 3.0)
    assert _runs(d) == [] and not d.branches.runs.runs  # counted nowhere: no run listed
    assert drained(d) == [("p1", path, [0] * 2000)]
    d.branches.check()


def test_a_run_counted_nowhere_keeps_its_blocks_and_is_walked_again() -> None:
    """A release that leaves a run counted nowhere does not pop its blocks from ``where`` (a pop
    per block was most of a release's C-level work): the run stays there with no counts, out of
    the listed runs, every probe of R reading 0; a later count-up walks that same run (no new run
    made for blocks ever counted) and lists it again."""
    path = list(range(40, 60))
    d = KvDirectory(BS, chained=True)
    p0, p1 = d.node_id("p0"), d.node_id("p1")
    runs = d.branches.runs
    d.branch_start("a", 0.0)
    d.place("a", "p0", "prefill", path, 1.0)
    (r,) = runs.runs
    d.branch_end("a", 2.0)
    assert not runs.runs and set(runs.where) == set(path) and all(runs.where[h] is r for h in path)
    assert r.cnt == {} and len(d.branches.R[p0]) == 0 and d.count("p0", path[0]) == 0
    assert d.branches.R[p0].get(path[-1]) is None and path[3] not in d.branches.R[p0]
    with pytest.raises(KeyError):
        d.branches.R[p0].counts_of(path[:2])
    d.branches.check()
    d.branch_start("b", 3.0)
    d.place("b", "p1", "prefill", path[:12] + [900, 901], 3.0)  # the run's head again (cut at 12), a new tail
    # the old run cut at 12, its head counted again and joined with the new tail (counted alike)
    assert list(runs.runs) == [r] and r.keys == path[:12] + [900, 901] and r.cnt == {p1: 1}
    assert _runs(d) == [(0, 14, {p1: 1})]
    assert runs.where[path[12]].cnt == {}  # the rest of the old run: still counted nowhere
    assert [d.count("p1", h) for h in path] == [1] * 12 + [0] * 8
    assert drained(d)[-1] == ("p1", path[:12] + [900, 901], [1] * 14)
    d.branches.check()


def test_a_walk_joins_runs_counted_alike() -> None:
    """Each request's new blocks enter as a run of their own (3 placements: 3 runs); the move's
    count-up walks them and leaves one run, as every block of the path is counted alike."""
    path = list(range(500, 530))
    d = KvDirectory(BS, chained=True)
    p0, p1 = d.node_id("p0"), d.node_id("p1")
    d.branch_start("b", 0.0)
    for k in (10, 20, 30):
        d.place("b", "p0", "prefill", path[:k], 1.0)
    assert _runs(d) == [(0, 10, {p0: 1}), (10, 10, {p0: 1}), (20, 10, {p0: 1})]
    d.place("b", "p1", "prefill", path, 2.0)
    assert _runs(d) == [(0, 30, {p0: 1, p1: 1})]
    assert [d.count("p1", h) for h in path] == [1] * 30
    d.branches.check()


def test_a_fork_cuts_the_run_where_the_paths_part() -> None:
    """Two branches sharing 5 blocks: the shared head and each tail are runs of their own, the head
    counted 2 on the node; a version bump cuts at the common prefix."""
    a = list(range(100, 110))
    b = a[:5] + list(range(200, 205))
    d = KvDirectory(BS, chained=True)
    n = d.node_id("p0")
    d.branch_start("a", 0.0)
    d.branch_start("b", 0.0)
    d.place("a", "p0", "prefill", a, 1.0)
    d.place("b", "p0", "prefill", b, 1.0)
    assert _runs(d) == [(0, 5, {n: 2}), (5, 5, {n: 1}), (5, 5, {n: 1})]
    assert drained(d) == [("p0", a[:5] + a[5:] + b[5:], [2] * 5 + [1] * 10)]
    d.place("a", "p0", "prefill", a[:3] + [300, 301], 2.0)  # a rewrite: C_a cut to a[:3], then the new tail
    assert _runs(d) == [(0, 3, {n: 2}), (3, 2, {n: 1}), (3, 2, {n: 1}), (5, 5, {n: 1})]
    assert [d.count("p0", h) for h in a] == [2, 2, 2, 1, 1, 0, 0, 0, 0, 0]
    d.branches.check()


def test_a_path_that_is_not_a_chain_is_refused() -> None:
    """``chained`` promises that a hash names its whole prefix: a path naming a counted block at
    another position is refused with a clear error, not miscounted."""
    d = KvDirectory(BS, chained=True)
    d.branch_start("a", 0.0)
    d.branch_start("b", 0.0)
    d.place("a", "p0", "prefill", [1, 2, 3, 4], 1.0)
    with pytest.raises(ValueError, match="not chains"):
        d.place("b", "p0", "prefill", [7, 3, 9], 1.0)


@pytest.mark.parametrize(
    ("first", "second"),
    [([1, 2, 3], [1, 3]), ([1, 2, 3], [1, 3, 4]), ([1, 2, 3, 4, 5], [1, 2, 4, 6, 7])],
    ids=["fork-then-foreign", "foreign-then-new-tail", "longer-head"],
)
def test_a_path_refused_mid_walk_changes_no_count(first: list[int], second: list[int]) -> None:
    """A path that is not a chain found only after the walk changed counts (its head follows a
    counted run, a later block lies elsewhere in it): those counts are taken back, and the new
    tail's run is taken out of the forest, so R and the branch table still agree (``check``)."""
    d = KvDirectory(BS, chained=True)
    n = d.node_id("p0")
    d.branch_start("a", 0.0)
    d.branch_start("b", 0.0)
    d.place("a", "p0", "prefill", first, 1.0)
    before = dict(d.branches.R[n])
    with pytest.raises(ValueError, match="not chains"):
        d.place("b", "p0", "prefill", second, 2.0)
    assert dict(d.branches.R[n]) == before == {h: 1 for h in first}
    assert d.branches.branches["b"].counted == {}
    assert set(d.branches.runs.where) == set(first)
    d.branches.check()


def test_a_release_refused_mid_walk_is_taken_back() -> None:
    """The same for a -1 walk (``_CountRuns.count``, step -1; a release names the slice its branch
    counted, so only a caller's error meets this): blocks the walk took to 0 everywhere (left in
    ``where`` with no counts) get their counts back."""
    from services.kvdirectory.branches import _CountRuns

    runs = _CountRuns()
    runs.total = [0, 0]
    runs.count(0, [1, 2, 3], 0, 3, 1)
    runs.count(1, [1, 2, 3], 0, 2, 1)
    with pytest.raises(ValueError, match="not chains"):
        runs.count(0, [1, 3], 0, 2, -1)
    assert {h: dict(r.cnt) for h, r in runs.where.items()} == {1: {0: 1, 1: 1}, 2: {0: 1, 1: 1}, 3: {0: 1}}
    assert runs.total == [3, 2]
    runs.check()
    runs.total = [0]
    runs.where.clear()
    runs.runs.clear()
    runs.count(0, [1, 2, 3], 0, 3, 1)
    with pytest.raises(ValueError, match="not chains"):
        runs.count(0, [1, 3], 0, 2, -1)  # block 1 went to 0 everywhere before the error
    assert {h: dict(r.cnt) for h, r in runs.where.items()} == {1: {0: 1}, 2: {0: 1}, 3: {0: 1}}
    assert runs.total == [3]
    runs.check()


def test_counts_after_are_written_by_stretch_around_refusals() -> None:
    """``_CountRuns.count`` writes ``after`` a stretch of equal counts at a time (runs walked in a
    row that differ only on other nodes are one stretch): the counts after are still one per
    changed block, in path order, up to a refused stretch (a -1 where the node counts nothing, or
    on a block counted nowhere), which is left out."""
    from services.kvdirectory.branches import _CountRuns

    runs = _CountRuns()
    runs.total = [0, 0, 0]
    path = [1, 2, 3, 4, 5, 6]
    assert runs.count(0, path, 0, 6, 1) == ([1] * 6, [0, 6], [])
    runs.count(1, path, 0, 2, 1)  # node 1 cuts the run at 2 and 4: node 0's counts stay one stretch
    runs.count(2, path, 0, 4, 1)
    assert runs.count(0, path, 0, 6, 1) == ([2] * 6, [], [])
    runs.count(1, path, 0, 2, -1)
    assert runs.count(1, path, 0, 4, 1) == ([1] * 4, [0, 2, 2, 4], [])
    # node 1 counts path[:4]: a -1 over the whole path refuses path[4:]
    assert runs.count(1, path, 0, 6, -1) == ([0] * 4, [0, 4], [4, 6])
    # a block never counted (7) after the path: refused, the stretch before it written whole
    assert runs.count(0, [*path, 7], 0, 7, -1) == ([1] * 6, [], [6, 7])
    assert runs.count(0, [*path, 7], 2, 7, -1) == ([0] * 4, [2, 4, 4, 6], [6, 7])
    runs.check()


@pytest.mark.parametrize("seed", range(6))
def test_runs_give_the_per_block_counts_messages_and_counters(seed: int) -> None:
    """Random chained paths (forks, extensions, rewrites), placements on 4 nodes of two phases,
    stores that finish moves, ends, expiry, D→P switches and a node taken over: a directory
    counting in runs and one counting per block (``chained`` off) give the same R, drains,
    counters and branch rows after every step."""
    rng = random.Random(seed)
    worlds = [KvDirectory(BS, chained=True, branch_ttl_s=8.0), KvDirectory(BS, branch_ttl_s=8.0)]
    nodes = ["p0", "p1", "p2", "d0"]
    for w in worlds:
        for nm in nodes:
            w.node_id(nm)
    fresh = iter(range(1_000_000, 2_000_000))
    paths: dict[str, list[int]] = {}
    last: dict[str, str] = {}
    t = 0.0
    for step in range(400):
        t += rng.random()
        op = rng.random()
        bid = f"b{rng.randrange(12)}"
        calls: list[tuple[str, tuple[object, ...]]] = []
        if op < 0.55:
            old = paths.get(bid) or paths.get(f"b{rng.randrange(12)}") or []
            keep = rng.randrange(len(old) + 1) if old and rng.random() < 0.3 else len(old)  # a rewrite or a fork
            path = old[:keep] + [next(fresh) for _ in range(rng.randrange(1, 40))]
            paths[bid] = path
            nm = last[bid] = rng.choice(nodes)
            calls.append(("place", (bid, nm, "decode" if nm == "d0" else "prefill", path, t)))
        elif op < 0.75 and paths:
            bid = rng.choice(sorted(paths))
            p = paths[bid]
            if rng.random() < 0.5:  # the whole path where it was placed last: a move there finishes
                calls.append(("_store", (last[bid], p)))
            else:
                calls.append(("_store", (rng.choice(nodes), p[: rng.randrange(1, len(p) + 1)])))
        elif op < 0.85:
            calls.append(("branch_end", (bid, t)))
            paths.pop(bid, None)
        elif op < 0.93:
            calls.append(("expire", (t,)))
        elif op < 0.96:
            calls.append(("node_phase_changed", (rng.choice(nodes[:3]), rng.choice(["prefill", "decode"]))))
        elif op < 0.97:
            calls.append(("reset_node", ("p2",)))  # the slot taken over by a new node (KvDirectory._take_over)
        else:
            calls.append(("drain", ()))
        got = []
        for w in worlds:
            out: list[object] = []
            for name, args in calls:
                if name == "_store":
                    node, hashes = args
                    store(w, node, hashes, "host")  # type: ignore[arg-type]
                    out.append(len(w.index.where))
                elif name == "drain":
                    out.append(drained(w))
                elif name == "node_phase_changed":
                    node, new = args
                    out.append(w.node_phase_changed(node, w.branches.phase_of(w.node_id(node)), new, t))  # type: ignore[arg-type]
                elif name == "reset_node":
                    w.branches.reset_node(w.node_id("p2"), "p2")
                elif name == "expire":
                    out.append(w.expire(*args))  # type: ignore[arg-type]
                else:
                    getattr(w, name)(*args)
            w.branches.check()
            tb = w.branches
            got.append((
                out, [dict(R) for R in tb.R], dict(tb.counters), tb.out_len, tb.out_seq,
                {b.bid: (b.version, b.path, dict(b.counted), {k: sorted(v) for k, v in b.pending.items()}) for b in tb.branches.values()},
                [[(list(c[0]), c[1], list(c[2])) for c in o] for o in tb.outbox],
            ))
        assert got[0] == got[1], f"step {step}: {calls}"
    assert drained(worlds[0]) == drained(worlds[1])
    c = worlds[0].counters
    assert c["branch.version_bumps"] and c["moves.released_sources"] and c["branch.expired"]  # the test's reach


@pytest.mark.parametrize("seed", range(4))
def test_node_counts_probes_match_the_mapping_functions(seed: int) -> None:
    """``_NodeCounts``' own probes (``counts_of``, ``head``, ``tail``, ``chain_values``: a ``where``
    lookup and a test on the run's counts, no ``__getitem__`` / ``__contains__`` call per block,
    as the directory's store and eviction hooks use them) answer what the module's functions
    over the mapping do, KeyError included, on random chains counted on 3 nodes."""
    from services.kvdirectory.branches import _chain_values, _counted_head, _counted_tail, _CountRuns, _NodeCounts, _values

    rng = random.Random(seed)
    runs = _CountRuns()
    runs.total = [0, 0, 0]
    fresh = iter(range(10_000, 100_000))
    chains: list[list[int]] = []
    for _ in range(60):
        base = rng.choice(chains) if chains and rng.random() < 0.7 else []
        path = base[: rng.randrange(len(base) + 1)] + [next(fresh) for _ in range(rng.randrange(1, 12))]
        chains.append(path)
        n = rng.randrange(3)
        a = 0
        k = rng.randrange(1, len(path) + 1)
        runs.count(n, path, a, k, 1)
        if rng.random() < 0.3:
            runs.count(n, path, rng.randrange(k), k, -1)
    runs.check()
    for n in range(3):
        R = _NodeCounts(runs, n)
        for path in chains:
            L = len(path)
            lo = rng.randrange(L)
            hi = rng.randrange(lo + 1, L + 1)
            assert R.head(path, lo, hi) == _counted_head(R, path, lo, hi)
            down = path[::-1]
            assert R.tail(down, lo, hi) == _counted_tail(R, down, lo, hi)  # type: ignore[arg-type]
            for keys in (path, path[lo:hi], path[:1]):
                try:
                    want: object = _values(R, keys)  # type: ignore[arg-type]
                except KeyError:
                    want = KeyError
                try:
                    got: object = R.counts_of(keys)
                except KeyError:
                    got = KeyError
                assert got == want
            j = R.head(path, 0, L)
            if j:
                assert R.chain_values(path[:j]) == _chain_values(R, path[:j]) == [R[h] for h in path[:j]]  # type: ignore[arg-type]
            if j < L:
                with pytest.raises(KeyError):
                    R.chain_values(path)
