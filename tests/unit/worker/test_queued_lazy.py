"""The branch-count host pool's queued-page set is filled lazily (``BranchRunHostPool._lazy``):
a run L1 evicts enters the set only when the set is next read, so pages restored to L1 (or
evicted) before that never enter or leave it; what a read sees is every queued page, and the
pool moves pages as the per-block reference model does."""

from __future__ import annotations

from services.worker.blocks import KvBlockManager
from tests.unit.worker import ref_blocks
from tests.unit.worker.test_count_message_cut import compute, order


def test_pages_restored_before_a_read_never_enter_the_set():
    kv = KvBlockManager(8, 40, 4, "branch-count")
    host = kv.host
    compute(kv, [50, 51, 52, 53])
    compute(kv, [70, 71, 72, 73])
    compute(kv, [1, 2, 3, 4])  # [50..53] leaves L1: queued in L2, not yet in the set
    assert host._queued == set() and [r.keys for r in host._lazy] == [[50, 51, 52, 53]]
    compute(kv, [50, 51, 52, 53])  # restored before any read; [70..73] leaves L1
    assert host._queued == set()
    assert host.queued == {70, 71, 72, 73}  # a read: the runs still queued enter the set
    assert host._queued == {70, 71, 72, 73} and not host._lazy
    kv.check([])


def test_a_count_message_after_lazy_runs_moves_as_the_model():
    def run(impl):
        kv = impl(8, 40, 4, "branch-count")
        compute(kv, [50, 51, 52, 53])
        compute(kv, [70, 71, 72, 73])
        compute(kv, [1, 2, 3, 4])
        compute(kv, [60, 61, 62, 63])  # [70..73] leaves L1 too: two lazy runs
        moved = kv.update_counts([52, 53, 70, 2], [1, 1, 1, 1])  # queued pages of both, then an L1 page
        return moved, order(kv)

    got = run(KvBlockManager)
    assert got == run(ref_blocks.KvBlockManager)
    assert got[0] == 3


def test_the_lazy_list_stays_bounded_while_the_set_goes_unread():
    kv = KvBlockManager(4, 40, 4, "branch-count")
    host = kv.host
    for _ in range(1500):  # each path evicts the other from L1 and is restored from L2: no read
        compute(kv, [1, 2, 3, 4])
        compute(kv, [9, 8, 7, 6])
    assert len(host._lazy) <= 2 * len(host.first) + 1025
    assert host.queued == {1, 2, 3, 4}
    kv.check([])
