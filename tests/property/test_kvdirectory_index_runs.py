"""Differential test: the run-based ``BlockIndex`` against the per-block model it replaced.

``services/kvdirectory/index.py`` stores runs of blocks (consecutive blocks of one
sequence with the same presence bits); ``tests/unit/kvdirectory/ref_index.py`` is the
per-block index it replaced (one tuple per block, per-(node, tier) held sets). Both get
the same random operation streams on 3 nodes — stores of path segments (parents right,
missing, wrong or unknown; a hash repeated inside one store, also inside a new chain
written through), removals deepest first,
parent first, in random order and with unknown hashes (the spans ``remove`` reports are
checked against their definition), clears of one or both tiers,
snapshots with and without parents — some under a small ``max_blocks`` cap, and after
every operation:

* the return values are equal (newly stored, removed, snapshot added/removed);
* the counters, the entry count, every block's presence bits and the whole
  completeness dict (``negcomp``) are equal; copies per (node, tier) equal the held sets;
* ``prefix_drops`` of the paths agree (what lookups read);
* the run index passes its own ``check`` (runs maximal, ``where`` / ``negcomp`` in sync).

Paths are chained (a tree of fresh ids with shared prefixes and forks). Inputs that
would link a block below its own descendant (only inconsistent parent reports can) are
not drawn: the per-block model's behaviour on such cycles is not a specification.
Seeds: ``EI_INDEX_DIFF_SEEDS`` (default 30), ``EI_INDEX_DIFF_OPS`` (default 300).
"""

from __future__ import annotations

import os
import random

import pytest

from services.kvdirectory import index as run_index
from tests.unit.kvdirectory import ref_index

SEEDS = int(os.environ.get("EI_INDEX_DIFF_SEEDS", "30"))
OPS = int(os.environ.get("EI_INDEX_DIFF_OPS", "300"))
NODES = 3


class Forest:
    """Chained paths: fresh ids, each path a prefix of another plus new blocks."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.parent: dict[int, int | None] = {}
        self.next = 100
        self.paths = [self.fresh(rng.randint(1, 12), []) for _ in range(4)]

    def fresh(self, k: int, after: list[int]) -> list[int]:
        out = list(after)
        prev = after[-1] if after else None
        for _ in range(k):
            self.next += 1
            self.parent[self.next] = prev
            prev = self.next
            out.append(prev)
        return out

    def grow(self) -> None:
        base = self.rng.choice(self.paths)
        self.paths.append(self.fresh(self.rng.randint(1, 8), base[: self.rng.randint(0, len(base))]))

    def segment(self) -> tuple[list[int], int]:
        p = self.rng.choice(self.paths)
        a = self.rng.randrange(len(p))
        return p[a : self.rng.randint(a + 1, len(p))], a


def _compare(a: ref_index.BlockIndex, b: run_index.BlockIndex, paths: list[list[int]], where: str) -> None:
    b.check()
    assert len(a) == len(b), where
    assert set(a.entries) == set(b.where), where
    assert dict(a.negcomp) == dict(b.negcomp), where
    assert all(a.presence(h) == b.presence(h) for h in a.entries), where
    assert a.counters == b.counters, where
    assert [[len(s) for s in held] for held in a.held] == b.copies, where
    for p in paths:
        assert a.prefix_drops(p) == b.prefix_drops(p), where


def _check_spans(removed: list[int], spans: list[tuple[int, int, bool]], links: dict[int, object], where: str) -> None:
    """``BlockIndex.remove``'s spans, by their definition: they cut the returned list into
    consecutive stretches, in order (every removed block is in one), and each stretch is a
    chain of the parent links the per-block model holds (``links``: hash → parent, read
    before the removal): parent first, or deepest first when flagged."""
    pos = 0
    for s0, s1, down in spans:
        assert s0 == pos and s1 > s0, (where, spans, removed)
        chain = removed[s0:s1][::-1] if down else removed[s0:s1]
        assert all(links[y] == x for x, y in zip(chain, chain[1:])), (where, spans, removed)
        pos = s1
    assert pos == len(removed), (where, spans, removed)


def _run(seed: int, ops: int, written_through: bool = False) -> None:
    rng = random.Random(seed)
    cap = {"max_blocks": 30} if seed % 5 == 0 else {}
    relink_free = seed % 2 == 1  # odd seeds: snapshots always carry parents, hashes repeat in stores
    a, b = ref_index.BlockIndex(**cap), run_index.BlockIndex(**cap)
    for n in range(NODES):
        a.ensure_node(n)
        b.ensure_node(n)
    f = Forest(rng)
    for step in range(ops):
        op = rng.random()
        node, tier = rng.randrange(NODES), rng.randrange(2)
        where = f"seed {seed} step {step}"
        if op < 0.1:
            f.grow()
            continue
        if op < 0.5 and written_through and rng.random() < 0.5:
            # an engine's write-through: fresh blocks below a stored path (or repeated ones), GPU then host
            base = rng.choice(f.paths)
            base = base[: rng.randint(0, len(base))]
            hs = f.fresh(rng.randint(1, 6), base)[len(base) :]
            f.paths.append(base + hs)
            repeated = False
            if rng.random() < 0.2:
                hs = rng.choice(f.paths)[: len(hs)]  # blocks indexed already: the two stores are made
            elif relink_free and len(hs) > 1 and rng.random() < 0.15:
                hs = hs + [hs[rng.randrange(len(hs) - 1)]]  # a hash repeated in a new chain: declined
                repeated = True
            parent = f.parent[hs[0]]
            if rng.random() < 0.1:
                parent = rng.choice([None, 99_999])
            got = b.store_written_through(node, hs, parent)
            assert not (repeated and got is not None), where
            if got is None:  # declined: the two stores
                assert b.store(node, 0, hs, parent) == a.store(node, 0, hs, parent), where
                assert b.store(node, 1, hs, parent) == a.store(node, 1, hs, parent), where
            else:
                assert got == a.store(node, 0, hs, parent), where
                assert got == a.store(node, 1, hs, parent), where
        elif op < 0.5:
            hs, at = f.segment()
            parent = f.parent[hs[0]] if at else None
            if rng.random() < 0.05:
                parent = rng.choice([None, 99_999])  # missing or wrong parent
            if relink_free and len(hs) > 2 and rng.random() < 0.05:
                hs = hs + [hs[0]]  # a hash repeated inside one store
            assert a.store(node, tier, hs, parent) == b.store(node, tier, hs, parent), where
        elif op < 0.85:
            hs, _ = f.segment()
            mode = rng.random()
            if mode < 0.6:
                hs = hs[::-1]  # deepest first, as engines evict
            elif mode < 0.7:
                hs = rng.sample(hs, len(hs))
            if rng.random() < 0.1:
                hs = hs + [424_242] + hs[:1]  # an unknown hash and a repeated one
            if rng.random() < 0.1:
                hs = [424_243] + hs  # unknown first: every span starts after it
            links = {h: a.entries[h][1] for h in hs if h in a.entries}  # before the removal drops entries
            spans: list[tuple[int, int, bool]] = []
            removed = b.remove(node, tier, hs, spans)
            assert a.remove(node, tier, hs) == removed, where
            _check_spans(removed, spans, links, where)
        elif op < 0.9:
            t = rng.choice([None, 0, 1])
            ra, rb = a.clear(node, t), b.clear(node, t)
            assert [(t, sorted(x)) for t, x in ra] == [(t, sorted(x)) for t, x in rb], where
        else:
            p = rng.choice(f.paths)
            hs = rng.sample(p, rng.randint(0, len(p)))
            parents = {h: f.parent[h] for h in hs} if relink_free or rng.random() < 0.7 else None
            ra, rb = a.replace(node, tier, hs, parents), b.replace(node, tier, hs, parents)
            assert (sorted(ra[0]), sorted(ra[1])) == (sorted(rb[0]), sorted(rb[1])), where
        _compare(a, b, f.paths[:8], where)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_run_index_matches_the_per_block_index(seed: int) -> None:
    _run(seed, OPS)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_written_through_store_equals_the_two_stores(seed: int) -> None:
    """``store_written_through`` (a brand-new chain on GPU and host at once) leaves the index,
    copies and counters as the per-block model's GPU store then host store (and returns
    what each returns); it declines, changing nothing, when the chain is not brand-new."""
    _run(1000 + seed, OPS, written_through=True)


def test_engine_like_stream_stays_in_few_runs() -> None:
    """A chain stored 64 blocks at a time on GPU then host, and evicted deepest first, is one
    run per distinct presence, not one entry object per block."""
    b = run_index.BlockIndex()
    b.ensure_node(0)
    chain = list(range(1, 2001))
    for s in range(0, 2000, 64):
        for tier in (0, 1):
            b.store(0, tier, chain[s : s + 64], chain[s - 1] if s else None)
    assert b.run_count() == 1 and len(b) == 2000
    b.remove(0, 0, chain[:1000:-1])  # L1 evicts the deep end
    assert b.run_count() == 2
    b.remove(0, 1, chain[:1000:-1])
    assert b.run_count() == 1 and len(b) == 1001
    b.check()


@pytest.mark.parametrize("seed", range(SEEDS))
def test_walked_lookups_match_bisection(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefix_drops`` walking run by run after its first drop (``_WALK_GAP`` forced huge)
    answers as the per-block model's bisection, also where inconsistent parents make
    completeness grow along a path (the walk declines and bisection goes on)."""
    monkeypatch.setattr(run_index, "_WALK_GAP", 10**9)
    walked = run_index.BlockIndex._walk_drops
    seen = {"walked": 0, "declined": 0}

    def spy(self: run_index.BlockIndex, path: list[int], i: int, r: object) -> object:
        out = walked(self, path, i, r)  # type: ignore[arg-type]
        seen["walked" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(run_index.BlockIndex, "_walk_drops", spy)
    _run(2000 + seed, OPS)
    assert seen["walked"] > 0


def test_walk_declines_where_completeness_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain whose second half was first reported as a sequence start (parent None) on
    another node: its completeness grows there, the walk declines, and the bisection's
    answer (the per-block model's) stands."""
    path = list(range(1, 41))
    a, b = ref_index.BlockIndex(), run_index.BlockIndex()
    for ix in (a, b):
        for n in range(3):
            ix.ensure_node(n)
        ix.store(0, 0, path[:10], None)
        ix.store(2, 1, path[:5], None)
        ix.store(1, 0, path[10:], None)  # parent None: first report wins
        ix.store(2, 0, path[10:30], path[9])
    monkeypatch.setattr(run_index, "_WALK_GAP", 10**9)
    r = b.where[path[5]]
    assert b._walk_drops(path, 5, r) is None
    assert a.prefix_drops(path) == b.prefix_drops(path)
    b.check()


def test_deeper_eviction_moves_the_tail_into_the_child_run() -> None:
    """GPU evictions deepest first below a host copy, in two steps: the second step's blocks
    join the run the first step left (host only) directly, keeping two runs."""
    b = run_index.BlockIndex()
    b.ensure_node(0)
    chain = list(range(1, 2001))
    b.store(0, 0, chain, None)
    b.store(0, 1, chain, None)
    b.remove(0, 0, chain[:1499:-1])  # blocks 1501..2000 leave the GPU
    child = b.where[chain[-1]]
    b.remove(0, 0, chain[1499:1299:-1])  # then 1301..1500: the child run takes them
    assert b.run_count() == 2 and b.where[chain[1300]] is child and child.keys == chain[1300:]
    assert b.prefix_drops(chain) == [(1300, run_index.tier_bit(0, 0)), (2000, b.complete_bits(chain[-1]))]
    b.check()
