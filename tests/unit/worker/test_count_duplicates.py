"""A count message that names a page twice moves L2's pages as the per-block reference model
does (each page counts once: its last count, at its first place).

``BranchRunHostPool.update_counts`` de-duplicates a message only when a *queued* page is named
twice (found as two overlapping stretches of one run); a page named twice that is pinned, or
not in L2, moves nothing and is left as named. These streams name both kinds, next to the
messages the directory sends (whole paths, parent first), on pools small enough that L1 and L2
evict all the time, and compare every return value and both eviction queues with the model.
"""

from __future__ import annotations

import random

import pytest

from services.worker.blocks import KvBlockManager
from tests.unit.worker import ref_blocks


def _compute(kv, path: list[int]) -> None:
    n_gpu, n_host = kv.match(path, len(path))
    assert kv.admit(path, n_gpu, len(path) - n_gpu)
    kv.fill(path, n_gpu, len(path))
    kv.release(path, len(path), 0)


def _paths(rng: random.Random, n: int) -> list[list[int]]:
    """Chained paths: each a prefix of an earlier one (or of nothing) plus fresh pages."""
    out: list[list[int]] = []
    nxt = 1
    for _ in range(n):
        base = rng.choice(out)[: rng.randint(0, 6)] if out and rng.random() < 0.7 else []
        k = rng.randint(1, 6)
        out.append(base + list(range(nxt, nxt + k)))
        nxt += k
    return out


def _message(rng: random.Random, known: list[int], paths: list[list[int]]) -> list[int]:
    if rng.random() < 0.5:
        hs = list(rng.choice(paths))  # a whole path, as the directory sends them
    else:
        hs = rng.sample(known, min(len(known), rng.randint(1, 6)))
    for _ in range(rng.randint(1, 3)):  # some named again, anywhere
        hs.insert(rng.randint(0, len(hs)), rng.choice(hs + [10**9]))
    return hs


@pytest.mark.parametrize("seed", range(1, 31))
def test_messages_naming_pages_twice_move_as_the_model(seed):
    rng = random.Random(seed)
    paths = _paths(rng, 14)
    pools = [KvBlockManager(12, 40, 4, "branch-count"), ref_blocks.KvBlockManager(12, 40, 4, "branch-count")]
    for _ in range(120):
        if rng.random() < 0.5:
            path = rng.choice(paths)
            for kv in pools:
                _compute(kv, path)
        else:
            known = sorted(pools[1].host.blocks) + [10**9]
            hs = _message(rng, known, paths)
            counts = [rng.choice([0, 0, 1, 2]) for _ in hs]
            got, want = (kv.update_counts(hs, counts) for kv in pools)
            assert got == want, (hs, counts)
        got, want = ([(b.hash, b.group) for b in kv.host.evictable.ordered()] for kv in pools)
        assert got == want
        pools[0].check([])


@pytest.mark.parametrize("seed", range(1, 21))
def test_resent_counts_of_a_write_through_move_as_the_model(seed):
    """The directory re-sends a host store's counts at once, in the store's order: the pool
    takes such a message (equal to a run it just wrote through, L1 having evicted nothing
    since) as naming only pinned pages and drops the discard it owed them. Re-sends with
    positive, zero and mixed counts, alone, after other messages or after an L1 eviction,
    must leave both pools alike."""
    rng = random.Random(seed)
    paths = _paths(rng, 14)
    pools = [KvBlockManager(12, 40, 4, "branch-count"), ref_blocks.KvBlockManager(12, 40, 4, "branch-count")]
    hits = 0
    for _ in range(150):
        path = rng.choice(paths)
        stored = []
        for kv in pools:
            kv.take_events()
            _compute(kv, path)
            stored.append([e.block_hashes for e in kv.take_events() if type(e).__name__ == "BlockStored" and e.tier == "host"])
        assert stored[0] == stored[1]
        if rng.random() < 0.2:  # another path first: L1 may evict the pages just written
            other = rng.choice(paths)
            for kv in pools:
                _compute(kv, other)
        if rng.random() < 0.2:  # an unrelated message first
            known = sorted(pools[1].host.blocks)
            hs = rng.sample(known, min(len(known), 3))
            for kv in pools:
                kv.update_counts(hs, [1] * len(hs))
        for run in stored[0]:
            counts = rng.choice([[1] * len(run), [0] * len(run), [rng.choice([0, 1, 2]) for _ in run]])
            hits += pools[0].host._fresh.count(run) > 0
            got, want = (kv.update_counts(list(run), counts) for kv in pools)
            assert got == want
        got, want = ([(b.hash, b.group) for b in kv.host.evictable.ordered()] for kv in pools)
        assert got == want
        pools[0].check([])
    assert hits  # the path under test was taken
