"""A ``CountUpdates`` message that a consistent directory never sends (a child gains a count
that its parent loses in the same message: hostile, or stale after a directory restart) must
move the worker's L2 pages as the per-block reference model does and leave the run pool
whole. Before the fix, the lift of the first chain (the child's queued ancestors restamped
into its new group) cut the run in which a later stretch of the message had been found, and
applying that stretch raised IndexError half way through, leaving the pool corrupt."""

from __future__ import annotations

import pytest

from services.worker.blocks import KvBlockManager
from tests.unit.worker import ref_blocks
from tests.unit.worker.test_count_message_cut import compute


def run(impl, paths: list[list[int]], first: tuple[list[int], list[int]], second: tuple[list[int], list[int]]):
    kv = impl(8, 40, 4, "branch-count")
    for p in paths:
        compute(kv, p)
    for i in range(2):  # every path leaves L1: its pages are queued in L2
        compute(kv, [100 + 10 * i + j for j in range(8)])
    moved = kv.update_counts(*first), kv.update_counts(*second)
    return kv, moved, [(b.hash, b.group) for b in kv.host.evictable.ordered()]


CASES = {
    # run [1 2 3 4] counted, 5 (child of 2) not; then 5 gains a count while 2 and 3 lose theirs
    "one-stretch": ([[1, 2, 3, 4], [1, 2, 5]], ([1, 2, 3, 4, 5], [1, 1, 1, 1, 0]), ([5, 2, 3], [1, 0, 0])),
    # the same, the later chain running on into the next run ([2 3 4] then 6 7)
    "chain-of-stretches": (
        [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6, 7]],
        ([1, 2, 3, 4, 5, 6, 7], [1, 1, 1, 1, 0, 1, 1]),
        ([5, 2, 3, 4, 6, 7], [1, 0, 0, 0, 0, 0]),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_child_counted_as_its_parent_loses_its_count_moves_as_the_model(case):
    paths, first, second = CASES[case]
    kv, moved, order = run(KvBlockManager, paths, first, second)
    _, want_moved, want_order = run(ref_blocks.KvBlockManager, paths, first, second)
    assert (moved, order) == (want_moved, want_order)
    kv.check([])
