"""SeenIds (evolving_infra/sim/seen.py) answers exactly as a Python set: leading runs and
membership, across merges, for ids anywhere in int64 and beyond (plain-set fallback)."""

from __future__ import annotations

import random
from itertools import takewhile

import pytest

from evolving_infra.sim import seen as seen_mod
from evolving_infra.sim.seen import SeenIds


def _leading(ref: set[int], blocks: list[int], start: int) -> int:
    return len(list(takewhile(ref.__contains__, blocks[start:])))


@pytest.mark.parametrize("seed", range(6))
def test_matches_a_set_across_merges(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seen_mod, "MERGE_MIN", 16)  # merge often
    rng = random.Random(seed)
    lo, hi = (-(1 << 63), (1 << 63) - 1) if seed % 2 else (0, 5000)
    pool = [rng.randint(lo, hi) for _ in range(3000)]
    s, ref = SeenIds(), set()
    for step in range(400):
        blocks = rng.sample(pool, rng.randint(0, 40))
        if ref and rng.random() < 0.5:  # a known prefix, then others
            blocks = rng.sample(sorted(ref), min(len(ref), rng.randint(1, 30))) + blocks
        start = rng.randint(0, len(blocks))
        assert s.leading(blocks, start) == _leading(ref, blocks, start), step
        hit = start + s.leading(blocks, start)
        s.update(blocks[hit:])
        ref.update(blocks[hit:])
        probe = rng.choice(pool)
        assert (probe in s) == (probe in ref)
        assert len(s) >= len(ref)
    assert len(s._arr) > 0  # merges happened


@pytest.mark.parametrize("first", [1, 3, 8])
def test_leading_runs_across_chunk_boundaries(first: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``leading`` looks the path up in growing chunks: a known run ending anywhere (inside a
    chunk, on its last id, on the first id of the next) counts exactly as a set does."""
    monkeypatch.setattr(seen_mod, "MERGE_MIN", 64)
    monkeypatch.setattr(seen_mod, "FIRST_CHUNK", first)
    rng = random.Random(first)
    known = rng.sample(range(1, 1 << 40), 3000)
    s, ref = SeenIds(), set(known)
    s.update(known[:2000])
    s.update(known[2000:])  # part merged into the array, part among the recent ids
    for run in [*range(0, 90), 127, 128, 129, 511, 512, 513, 700]:
        path = rng.sample(known, run) + [rng.randrange(1 << 41, 1 << 42)] + rng.sample(known, 5)
        for start in (0, 1, run // 2):
            assert s.leading(path, start) == _leading(ref, path, start), (run, start)
        assert s.leading(path[:run], 0) == run


def test_a_path_whose_first_block_is_new_costs_one_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most sends continue their branch with new blocks: ``leading`` answers 0 from the first
    block alone (no numpy chunk); a known first block still walks the chunks."""
    monkeypatch.setattr(seen_mod, "MERGE_MIN", 4)
    s = SeenIds()
    s.update(range(0, 100, 2))  # merged into the array
    s.update([1001])  # among the recent ids
    chunks: list[int] = []
    chunk = SeenIds._leading_chunk
    monkeypatch.setattr(SeenIds, "_leading_chunk", lambda self, b, i, m: chunks.append(m) or chunk(self, b, i, m))
    assert s.leading([1, 2, 4], 0) == 0 and s.leading([2, 9], 1) == 0 and s.leading([2, 1 << 70], 1) == 0
    assert chunks == []
    assert s.leading([2, 4, 1001, 6, 5], 0) == 4 and s.leading([7, 1001], 1) == 1
    assert chunks


def test_ids_beyond_int64_fall_back_to_a_plain_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seen_mod, "MERGE_MIN", 2)
    s = SeenIds()
    s.update([1, 2, 3, 4])
    assert s.leading([1, 2, 9], 0) == 2
    big = 1 << 70
    assert s.leading([1, big, 2], 0) == 1
    s.update([big, 5, 6])
    assert s.leading([1, 2, big, 5, 7], 0) == 4 and big in s and 7 not in s
    s.update(range(100, 200))
    assert s.leading([150, big, 3, 199], 0) == 4 and s.leading([150, 200], 0) == 1


def test_a_600s_run_at_512_token_blocks_keeps_its_ids_in_the_set() -> None:
    """The side-by-side's 600-s 9-node run at 512-token blocks sends ~74,000 distinct ids: held in the set alone
    (a set probe per send), not merged into the array (then a numpy searchsorted per send as well)."""
    s = SeenIds()
    ids = range(7, 8 * 74_436, 8)  # coarse ids at 512 are the fine ids 8j + 7
    for i in range(0, len(ids), 235):
        s.update(ids[i : i + 235])
    assert s._arr is None or not len(s._arr)
    assert len(s) == 74_436 and s.leading([7, 15, 23, 8 * 74_436 + 7], 0) == 3


def test_merge_is_union1d() -> None:
    import numpy as np

    from evolving_infra.sim.seen import _merge_sorted_unique

    rng = np.random.default_rng(0)
    for i in range(300):
        lo, hi = (-(1 << 63), (1 << 63) - 1) if i % 3 == 0 else (-50, 50)
        a = np.unique(rng.integers(lo, hi, rng.integers(0, 80), dtype=np.int64, endpoint=True))
        b = np.array(sorted(set(rng.integers(lo, hi, rng.integers(0, 80), dtype=np.int64, endpoint=True).tolist()),
                            key=lambda _: rng.random()), dtype=np.int64)  # distinct, any order
        got = _merge_sorted_unique(a, b)
        assert got.dtype == np.int64 and np.array_equal(got, np.union1d(a, b)), i
