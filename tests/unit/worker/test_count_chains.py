"""Count messages handed over with their chains (``update_counts(hashes, counts, chains)``: the
simulator's in-process directory, issue 23 deliverable 3) move the host pool's pages exactly as
the same messages without them, though the pool then keeps no queued-page set: the queued pages
of a chain are found run by run (its first entry by depth, later ones as run starts)."""

from __future__ import annotations

import random

import pytest

from services.worker.blocks import BranchRunHostPool, KvBlockManager
from tests.unit.worker import ref_blocks
from tests.unit.worker.test_count_message_cut import _forest, compute, order


@pytest.fixture
def fallbacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``[chained messages, of them gone the per-entry way]``: counts each call of the pool's
    ``_chain_moves`` and each None it returns (the fallback gives the same moves, so only the
    count tells that the chains were used)."""
    seen = [0, 0]
    real = BranchRunHostPool._chain_moves

    def spy(self, *a, **k):
        found = real(self, *a, **k)
        seen[0] += 1
        seen[1] += found is None
        return found

    monkeypatch.setattr(BranchRunHostPool, "_chain_moves", spy)
    return seen


def _message(rng: random.Random, paths: list[list[int]]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """A drain as chains: slices of paths (parent first), each with its path position, blocks
    distinct across the message (the drain hands chains only then); counts along a slice never
    grow, as a directory's do."""
    hashes: list[int] = []
    counts: list[int] = []
    chains: list[tuple[int, int]] = []
    seen: set[int] = set()
    for _ in range(rng.randint(1, 5)):
        p = rng.choice(paths)
        lo = rng.randint(0, len(p) - 1)
        hi = rng.randint(lo + 1, len(p))
        while lo < hi and p[lo] in seen:
            lo += 1
        k = lo
        while k < hi and p[k] not in seen:
            k += 1
        if k == lo:
            continue
        c = rng.choice([0, 1, 2])
        z = rng.randint(lo, k)  # a tail of zeros (a release) or none
        hashes += p[lo:k]
        counts += [c if i < z else 0 for i in range(lo, k)]
        chains.append((lo, k - lo))
        seen.update(p[lo:k])
    return hashes, counts, chains


def _run(seed: int, with_chains: bool, impl=KvBlockManager):
    rng = random.Random(seed)
    paths, script = _forest(rng)
    kv = impl(20, 400, 4, "branch-count")
    moved = []
    for step in range(4):  # computes and count messages interleaved: the pool keeps working with no set
        for p in script if step == 0 else rng.sample(script, min(3, len(script))):
            compute(kv, p)
        for _ in range(3):
            h, c, ch = _message(rng, paths)
            if h:
                moved.append(kv.update_counts(h, c, ch) if with_chains else kv.update_counts(h, c))
        kv.check([])
    return moved, order(kv), kv.host.snapshot()


def test_chains_move_as_the_plain_message_and_as_the_model(fallbacks: list[int]):
    moves = 0
    for seed in range(80):
        want = _run(seed, False)
        assert _run(seed, True) == want, f"seed {seed}"
        model = _run(seed, False, ref_blocks.KvBlockManager)
        assert model[:2] == want[:2], f"seed {seed}: pool and model differ"
        moves += sum(want[0])
    assert moves > 200  # the messages did move pages
    assert fallbacks[0] > 200 and fallbacks[1] == 0  # every chained message found its moves run by run


def test_the_pool_drops_its_queued_page_set_with_the_first_chained_message():
    kv = KvBlockManager(4, 32, 4, "branch-count")
    compute(kv, [1, 2, 3, 4])
    compute(kv, [10, 11, 12, 13])  # 1..4 unpinned in L2
    assert kv.host._queued is not None
    assert kv.update_counts([2, 3, 4], [1, 1, 1], [(1, 3)]) == 3
    assert kv.host._queued is None
    assert kv.host.queued == {1, 2, 3, 4}  # built when read
    assert [b.hash for b in kv.host.evictable.ordered() if b.group == 1] == [4, 3, 2]
    kv.check([])


def test_chains_that_do_not_fit_the_pool_go_the_per_entry_way(fallbacks: list[int]):
    """A depth that is not that of the run an entry starts, or a queued page named twice: the
    per-entry rule, as without chains. (A wrong depth of a chain's first entry inside a run is
    not seen: the chains must be right, as the directory's are.)"""
    def pool():
        kv = KvBlockManager(4, 32, 4, "branch-count")
        compute(kv, [1, 2, 3, 4])
        compute(kv, [1, 2, 7, 8])
        compute(kv, [10, 11, 12, 13])
        return kv

    for hashes, counts, chains in (
        ([1, 2], [1, 1], [(3, 2)]),  # 1 starts a run at depth 0, not 3
        ([3, 4, 3], [1, 1, 0], [(2, 2), (2, 1)]),  # 3 twice: its last count, at its first place
    ):
        a, b = pool(), pool()
        assert a.update_counts(hashes, counts, chains) == b.update_counts(hashes, counts)
        assert order(a) == order(b)
        a.check([])
    assert fallbacks == [2, 2]


def test_chains_must_cover_the_message():
    kv = KvBlockManager(4, 32, 4, "branch-count")
    with pytest.raises(ValueError, match="chains cover 1 entries of 2"):
        kv.update_counts([1, 2], [1, 1], [(0, 1)])
    with pytest.raises(ValueError, match="chains cover 2 entries of 3"):  # several chains: their lengths summed
        kv.update_counts([1, 2, 3], [1, 1, 1], [(0, 1), (1, 1)])
    with pytest.raises(ValueError, match="chains cover 0 entries of 2"):
        kv.update_counts([1, 2], [1, 1], [])
    assert kv.update_counts([1, 2], [1, 1], [(0, 1), (None, 1)]) == 0  # covered: nothing held, nothing moves


def test_a_stores_resent_counts_take_the_stores_position(fallbacks: list[int]):
    """A chain at position None (the directory's re-send of a host store's counts) is placed where
    the pool stored it (found through its record, no fallback); one the pool does not know (not a
    store's first page, or longer than the store) goes the per-entry way. Same moves either way."""
    def pool():
        kv = KvBlockManager(8, 64, 4, "branch-count")
        assert kv.update_counts([99], [1], [(0, 1)]) == 0  # chains from here on: stores keep their positions
        compute(kv, [1, 2, 3, 4])
        compute(kv, [1, 2, 3, 4, 5, 6, 7])  # 5, 6, 7 written through at positions 4..6
        compute(kv, list(range(10, 18)))  # all of it unpinned in L2
        assert kv.host._stored[5] == (4, 3)  # position and length, no page list
        return kv

    cases = (
        ([5, 6, 7], [(None, 3)], 0),
        ([5, 6], [(None, 2)], 0),  # a head shorter than the store
        ([2, 3, 5, 6, 7], [(1, 2), (None, 3)], 0),
        ([6, 7], [(None, 2)], 1),  # 6 starts no store
        ([5, 6, 7, 16], [(None, 4)], 1),  # longer than the store
    )
    for hashes, chains, fell in cases:
        a, b = pool(), pool()
        before = list(fallbacks)
        assert a.update_counts(hashes, [1] * len(hashes), chains) == b.update_counts(hashes, [1] * len(hashes)) > 0
        assert order(a) == order(b)
        a.check([])
        assert [fallbacks[0] - before[0], fallbacks[1] - before[1]] == [1, fell], hashes
