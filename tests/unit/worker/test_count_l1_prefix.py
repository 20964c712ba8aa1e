"""A count message that starts at an L1 root names L1's pages first; the host pool looks up only
the entries past them (``BranchRunHostPool._l1_prefix``). A message is any list of hashes, not a
path: an entry in the middle of an L1 run's stretch may be a queued page even when the entries
around it, and the run's last page, line up with the run, so every entry of the L1 prefix is
compared, and the queued pages after it or inside it move as in the per-block reference model."""

from __future__ import annotations

import pytest

from services.worker.blocks import KvBlockManager
from tests.unit.worker import ref_blocks
from tests.unit.worker.test_count_message_cut import compute, order

MESSAGES = {
    # the L1 path [1 2 3 4], then two queued pages
    "queued-after-the-l1-path": ([1, 2, 3, 4, 50, 51], [1, 1, 1, 1, 1, 1]),
    # a queued page where the L1 run has 2; the run's last page 4 at its place (not a path)
    "queued-inside-the-l1-stretch": ([1, 52, 3, 4], [1, 1, 1, 1]),
    # the L1 path alone: nothing moves
    "the-l1-path-only": ([1, 2, 3, 4], [1, 1, 1, 1]),
    # the L1 path, then a queued page losing a count it never had, then one gaining it
    "l1-path-then-mixed": ([1, 2, 3, 4, 50, 53], [1, 1, 1, 1, 0, 2]),
}


def run(impl, hashes: list[int], counts: list[int]):
    kv = impl(8, 40, 4, "branch-count")
    compute(kv, [50, 51, 52, 53])  # leaves L1 below: queued in L2
    compute(kv, [70, 71, 72, 73])
    compute(kv, [1, 2, 3, 4])  # L1: [70..73] and [1 2 3 4]
    moved = kv.update_counts(hashes, counts)
    return kv, moved, order(kv)


@pytest.mark.parametrize("name", list(MESSAGES))
def test_a_message_from_an_l1_root_moves_as_the_model(name):
    hashes, counts = MESSAGES[name]
    kv, moved, got = run(KvBlockManager, hashes, counts)
    assert kv.gpu.roots[1].keys == [1, 2, 3, 4]  # one L1 run, so the walk meets 4 at the message's 4th entry
    assert {50, 51, 52, 53} <= kv.host.queued  # [50..53] left L1: queued in L2
    _, want_moved, want = run(ref_blocks.KvBlockManager, hashes, counts)
    assert (moved, got) == (want_moved, want)
    if name != "the-l1-path-only":
        assert moved > 0
    kv.check([])
