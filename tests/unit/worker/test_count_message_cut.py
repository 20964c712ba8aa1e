"""How the KV directory cuts a node's drained count changes into ``CountUpdates`` messages of
``max_updates_per_msg`` must not change the worker's host eviction order (issue 23; the
kvdirectory README, "Why counts and kv.counts stay per block").

The worker's move rule (``update_counts``): the moved blocks of a message are cut into chains
(a moved block continues the previous moved block's chain when it is its child, bound for the
same group); chain by chain, in message order, deepest first, then the lift of the older queued
ancestors in the new group. A cut splits at most one chain, and the lift of the second part
restamps the first part behind it, so every cut gives the order of the uncut message. The rule
it replaced sorted a whole message deepest first, so the cut decided the stamps.
"""

from __future__ import annotations

import random

import pytest

from services.worker.blocks import KvBlockManager
from tests.unit.worker import ref_blocks


def compute(kv, path: list[int]) -> None:
    n_gpu, _ = kv.match(path, len(path))
    assert kv.admit(path, n_gpu, len(path) - n_gpu)
    kv.fill(path, n_gpu, len(path))
    kv.release(path, len(path), 0)


def order(kv) -> list[tuple[int, int]]:
    return [(b.hash, b.group) for b in kv.host.evictable.ordered()]


def send(kv, hashes: list[int], counts: list[int], cap: int) -> int:
    """The drain as the directory sends it: cut into messages of at most ``cap`` entries."""
    return sum(kv.update_counts(hashes[i : i + cap], counts[i : i + cap]) for i in range(0, len(hashes), cap))


@pytest.mark.parametrize("impl", [KvBlockManager, ref_blocks.KvBlockManager], ids=["pool", "model"])
def test_two_forks_tails_move_the_same_in_one_message_or_cut_in_two(impl):
    """Two forks' tails (A, B: three blocks each after a shared pinned page) go from count 0 to
    1. Before, one message interleaved them by depth (12 22 11 21 10 20) and two messages put
    A's before B's (12 11 10 22 21 20)."""

    def pool():
        kv = impl(4, 32, 4, "branch-count")
        compute(kv, [1, 10, 11, 12])
        compute(kv, [1, 20, 21, 22])
        compute(kv, [1])
        compute(kv, [30, 31, 32])  # both tails leave L1 (unpinned in L2); the shared page stays
        return kv

    tails = [10, 11, 12, 20, 21, 22]
    one, cut = pool(), pool()
    assert send(one, tails, [1] * 6, 6) == 6
    assert send(cut, tails, [1] * 6, 3) == 6
    want = [(12, 1), (11, 1), (10, 1), (22, 1), (21, 1), (20, 1)]
    assert [x for x in order(one) if x[1] == 1] == want
    assert [x for x in order(cut) if x[1] == 1] == want
    one.check([])
    cut.check([])


def _forest(rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """Chained paths with shared prefixes (forks), and the paths to compute (L1: 20 pages) so
    that most of their pages end up unpinned in L2, a few pinned."""
    paths: list[list[int]] = []
    nxt = 1
    for _ in range(rng.randint(3, 9)):
        base = rng.choice(paths)[: rng.randint(1, 8)] if paths and rng.random() < 0.7 else []
        p = base + list(range(nxt, nxt + rng.randint(1, 10)))
        nxt += len(p) - len(base)
        paths.append(p)
    filler = list(range(10_000, 10_020))  # pushes every page out of L1
    return paths, paths + [filler] + [rng.choice(paths)[: rng.randint(1, 4)] for _ in range(2)]


def _drain(rng: random.Random, paths: list[list[int]], path_order: bool) -> tuple[list[int], list[int]]:
    """One node's drained changes: stretches of paths (parent first), each block once (the
    directory's outbox is a dict), in path order or shuffled."""
    out: dict[int, int] = {}
    for _ in range(rng.randint(1, 5)):
        p = rng.choice(paths)
        lo = rng.randint(0, len(p) - 1)
        hi = rng.randint(lo + 1, len(p))
        c = rng.choice([0, 1, 2])
        for h in p[lo:hi]:
            out.setdefault(h, c if rng.random() < 0.85 else rng.choice([0, 1]))
    hashes = list(out)
    if not path_order:
        rng.shuffle(hashes)
    return hashes, [out[h] for h in hashes]


@pytest.mark.parametrize("impl", [KvBlockManager, ref_blocks.KvBlockManager], ids=["pool", "model"])
@pytest.mark.parametrize("path_order", [True, False], ids=["path order", "any order"])
def test_every_cut_of_a_drain_gives_the_order_of_one_message(impl, path_order):
    """Random forests of paths, random earlier counts, random drains: each cut of the drain
    into messages (every size, and random cut points) ends in the same eviction order and
    moves as the drain sent whole."""
    moves = 0
    for seed in range(60):
        rng = random.Random(seed)
        paths, script = _forest(rng)
        before = [_drain(rng, paths, path_order) for _ in range(2)]
        hashes, counts = _drain(rng, paths, path_order)
        n = len(hashes)
        cuts = [[n]] + [[k] for k in range(1, n)] + [sorted(rng.sample(range(1, n), rng.randint(1, n - 1))) + [n] for _ in range(3) if n > 1]

        def run(points: list[int]):
            kv = impl(20, 400, 4, "branch-count")
            for p in script:
                compute(kv, p)
            for h, c in before:
                kv.update_counts(h, c)
            if len(points) == 1:  # messages of at most points[0] entries
                moved = send(kv, hashes, counts, points[0])
            else:  # messages ending at the given points
                moved, lo = 0, 0
                for hi in points:
                    moved += kv.update_counts(hashes[lo:hi], counts[lo:hi])
                    lo = hi
            kv.check([])
            return moved, order(kv)

        whole = run(cuts[0])
        for points in cuts[1:]:
            assert run(points) == whole, f"seed {seed}: cut {points} of {n} entries moves differently"
        moves += whole[0]
    assert moves > 100  # the drains did move blocks
