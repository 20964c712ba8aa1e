"""Differential test: the host pool's counted intervals per L1 run (count messages with chains, the
simulator's) against its counted-page set (messages without chains, the live worker's) and the per-block
model, in lockstep under traffic.

Four ``branch-count`` managers get the same random stream — admissions and releases (L1: 20 pages, so
most pages go to L2), peer fetches into L2 with holds, ``reset_counts``, and count messages whose slices
start anywhere in a path, some cut, some naming a block twice (``dup``), their chains at a position or
at None — as:

* ``chained``: every message with its chains (a few without, in ``mixed`` streams);
* ``plain``: no chains (the counted-page set throughout);
* ``switched``: no chains until a random step, then chains (the set converted under traffic);
* ``model``: ``tests/unit/worker/ref_blocks.py`` without chains, until the first ``reset_counts``.

After every operation: the pages each message moved are equal, the L2 eviction queues list the same pages
in the same order and groups, the counted pages in L2 are equal, and the three pools pass
``KvBlockManager.check``. ``tests/property/test_worker_blocks_model.py`` sends no chains, so it checks the
set mode only. Seeds: ``EI_COUNT_CHAINS_SEEDS`` (default 24) at two L2 sizes (400 pages and 40, where L2
evicts all the time).
"""

from __future__ import annotations

import os
import random

import pytest

from services.worker.blocks import KvBlockManager
from tests.unit.worker import ref_blocks
from tests.unit.worker.test_count_intervals import _admit
from tests.unit.worker.test_count_message_cut import _forest, order

SEEDS = range(int(os.environ.get("EI_COUNT_CHAINS_SEEDS", "24")))
L1_PAGES = 20
STEPS = 120


def _message(rng: random.Random, paths: list[list[int]], dup: bool, none_pos: bool) -> tuple[list[int], list[int], list]:
    """A count message of 1-5 slices of ``paths`` (each from any start; counts dropping to 0 past a random
    point) and its chains (position, length): positions None half the time when ``none_pos``; without ``dup``
    no block is named twice."""
    hashes: list[int] = []
    counts: list[int] = []
    chains: list[tuple[int | None, int]] = []
    seen: set[int] = set()
    for _ in range(rng.randint(1, 5)):
        p = rng.choice(paths)
        lo = rng.randint(0, len(p) - 1)
        hi = rng.randint(lo + 1, len(p))
        k = hi
        if not dup:
            while lo < hi and p[lo] in seen:
                lo += 1
            k = lo
            while k < hi and p[k] not in seen:
                k += 1
        if k == lo:
            continue
        c, z = rng.choice([0, 1, 2]), rng.randint(lo, k)
        hashes += p[lo:k]
        counts += [c if i < z else 0 for i in range(lo, k)]
        chains.append((None if none_pos and rng.random() < 0.5 else lo, k - lo))
        seen.update(p[lo:k])
    return hashes, counts, chains


def _run(seed: int, l2_pages: int) -> dict[str, int]:
    rng = random.Random(seed)
    paths, script = _forest(rng)
    dup, none_pos, mixed = rng.random() < 0.3, rng.random() < 0.5, rng.random() < 0.5
    switch_at = rng.randint(0, STEPS)
    chained, plain, switched = (KvBlockManager(L1_PAGES, l2_pages, 4, "branch-count") for _ in range(3))
    model: ref_blocks.KvBlockManager | None = ref_blocks.KvBlockManager(L1_PAGES, l2_pages, 4, "branch-count")
    live: list[list[int]] = []
    holds: list[list] = []
    stats: dict[str, int] = {}

    def pools() -> list:
        return [chained, plain, switched] + ([model] if model is not None else [])

    for step in range(STEPS):
        where = (seed, l2_pages, step)
        x = rng.random()
        if x < 0.35:
            kind = "admit"
            p = rng.choice(script)
            path = p[: rng.randint(1, len(p))]
            done = {_admit(kv, path) for kv in pools()}
            assert len(done) == 1, where
            if done.pop():
                live.append(path)
        elif x < 0.42:
            kind = "fetch"
            p = rng.choice(paths)
            path = p[: rng.randint(1, len(p))]
            found = {kv.match(path, len(path)) for kv in pools()}
            assert len(found) == 1, (where, found)
            g, h = found.pop()
            if g + h < len(path):
                stored = {kv.store_fetched(path, g + h, len(path)) for kv in pools()}
                assert len(stored) == 1, (where, stored)
            if rng.random() < 0.5:
                holds.append([kv.hold(path, len(path)) for kv in pools()])
        elif x < 0.45 and holds:
            kind = "unhold"
            for kv, hold in zip(pools(), holds.pop(rng.randrange(len(holds)))):
                kv.unhold(hold)
        elif 0.45 <= x < 0.55 and live:
            kind = "release"
            path = live.pop(rng.randrange(len(live)))
            for kv in pools():
                kv.release(path, len(path), 0)
        elif x < 0.58:
            kind = "reset"
            moved = {kv.reset_counts() for kv in (chained, plain, switched)}
            assert len(moved) == 1, (where, moved)
            model = None  # the per-block model has no reset: compared up to the first one
            holds = [hold[:3] for hold in holds]
        else:
            kind = "counts"
            hashes, counts, chains = _message(rng, paths + [p[: rng.randint(1, len(p))] for p in live], dup, none_pos)
            if not hashes:
                continue
            a = chained.update_counts(hashes, counts, None if mixed and rng.random() < 0.3 else chains)
            b = plain.update_counts(hashes, counts)
            c = switched.update_counts(hashes, counts, chains if step >= switch_at else None)
            d = model.update_counts(hashes, counts) if model is not None else b
            assert a == b == c == d, (where, "pages moved", a, b, c, d, hashes, counts, chains)
        queues = [order(kv) for kv in pools()]
        assert all(q == queues[1] for q in queues), (where, kind, "L2 order")
        in_l2 = set(plain.host.snapshot())
        want = plain.host.counted & in_l2
        assert chained.host.counted & in_l2 == want, (where, kind, "counted in L2", sorted(chained.host.counted & in_l2 ^ want))
        assert switched.host.counted & in_l2 == want, (where, kind, "counted in L2 (switched)")
        for kv in (chained, plain, switched):
            kv.check([(p, len(p), 0) for p in live])
        stats[kind] = stats.get(kind, 0) + 1
    return stats


@pytest.mark.parametrize("l2_pages", [400, 40])
@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed={s}" for s in SEEDS])
def test_counted_intervals_equal_the_counted_set_and_the_model_in_lockstep(seed, l2_pages):
    stats = _run(seed, l2_pages)
    assert stats.get("counts", 0) > 10 and stats.get("admit", 0) > 10, stats
