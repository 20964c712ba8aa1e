"""The branch-count host pool's queued-page set is filled lazily (``BranchRunHostPool._lazy``):
a run L1 evicts enters the set only when the set is next read, so pages restored to L1 (or
evicted) before that never enter or leave it; what a read sees is every queued page, and the
pool moves pages as the per-block reference model does."""

from __future__ import annotations

from services.worker.blocks import BranchRunHostPool, KvBlockManager
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


def test_the_lazy_list_stays_bounded_in_pages_too():
    """Runs of many pages, restored to L1 before a read: the lazy list's runs keep their keys,
    so it is bounded by pages too (flushed past twice L2's capacity), not only by runs (1,028
    runs here; at 64-token blocks 1,534 lazy runs held 91,050 page refs with 40,000 in L2)."""
    kv = KvBlockManager(8, 40, 4, "branch-count")
    host = kv.host
    a, b = list(range(1, 9)), list(range(11, 19))
    most = 0
    for _ in range(200):  # each path evicts the other from L1 (8 pages) and is restored: no read
        compute(kv, a)
        compute(kv, b)
        most = max(most, sum(len(r.keys) for r in host._lazy))
    assert most <= 2 * 40 + 8
    assert host.queued == set(a)
    kv.check([])


SUFFIX_MESSAGES = {
    # L1 pages from mid-path to the end of their run: answered from L1, the set is not read
    "l1-tail": ([3, 4], [1, 1], False),
    # a queued page, then L1 pages ending the run: the run matches from the end, not the first entry
    "queued-then-l1-tail": ([52, 3, 4], [1, 1, 1], True),
    # a queued page amid the L1 stretch (not a path): every entry is compared
    "queued-inside-l1-tail": ([2, 53, 4], [1, 1, 1], True),
    # across two L1 runs (a split one), upward from the last
    "across-runs": ([3, 4, 5, 6], [1, 1, 1, 1], False),
}


def test_a_message_of_l1_pages_ending_a_run_reads_no_set_and_moves_as_the_model():
    for name, (hashes, counts, reads) in SUFFIX_MESSAGES.items():

        def run(impl):
            kv = impl(8, 40, 4, "branch-count")
            compute(kv, [50, 51, 52, 53])
            compute(kv, [1, 2, 3, 4])
            compute(kv, [1, 2, 3, 4, 5, 6])
            compute(kv, [1, 2, 3, 4, 7, 8])  # [50..53] leaves L1 (lazily queued); L1: [1 2 3 4] over [5 6], [7 8]
            moved = kv.update_counts(hashes, counts)
            return kv, moved, order(kv)

        kv, moved, got = run(KvBlockManager)
        assert sorted(r.keys for r in kv.gpu.ends.values()) == [[1, 2, 3, 4], [5, 6], [7, 8]], name
        assert (not kv.host._lazy) == reads, name  # a read puts the lazy run in the set
        _, want_moved, want = run(ref_blocks.KvBlockManager)
        assert (moved, got) == (want_moved, want), name
        assert moved == (1 if reads else 0), name
        kv.check([])


def test_a_lazy_run_evicted_around_a_held_page_puts_the_pages_left_in_the_set(monkeypatch):
    """A write-through that evicts around a held page (``_evict_holes``: a broken hold's page
    stored again above a held one) cuts the run it evicts from into pieces, new runs. When
    that run is still lazy (queued since the set was last read), its pages are put in the set
    first (``BranchRunHostPool._evict_holes``' flush): else the pieces, no longer lazy nor
    named by the lazy list, never enter it, and a later count message naming one of their
    pages finds it unqueued and moves nothing (here 3 stays in group 1; the model moves it to
    group 0). No set is read between the eviction and the message (``check`` reads it)."""
    holes = BranchRunHostPool._evict_holes
    lazy_cut: list[list[int]] = []

    def spy(self, r, c, lim, out):
        if r.lazy:
            lazy_cut.append(list(r.keys))
        return holes(self, r, c, lim, out)

    monkeypatch.setattr(BranchRunHostPool, "_evict_holes", spy)

    def run(impl):
        kv = impl(4, 6, 4, "branch-count")
        compute(kv, [1, 2, 3])
        kv.hold([1, 2, 3], 3)  # a queued request holds [1 2 3] (never unheld here)
        kv.update_counts([3], [1])  # 3 counted: queued in group 1, [1 2] in group 0
        # L1 evicts [1 2 3]; the write-through of [7..10] finds every queued page held and
        # takes 2 (group 0's deep end): its hold breaks (owed by the holder), 1 and 3 stay held
        compute(kv, [7, 8, 9, 10])
        compute(kv, [1, 2, 3])  # 2 stored again, unheld, between held 1 and 3
        kv.update_counts([2], [1])  # 2 counted too: [2 3] will be one group-1 run
        # L1 evicts [1 2 3] and 7: lazy runs [1] and [2 3]; the write-through of [20..23]
        # evicts 9, 8, 7 (unheld), then 2 from around held 3 (the run's held deep end)
        compute(kv, [20, 21, 22, 23])
        moved = kv.update_counts([3], [0])  # 3 (queued) back to count 0: to group 0
        return kv, moved, order(kv)

    kv, moved, got = run(KvBlockManager)
    assert lazy_cut == [[2, 3]]  # the eviction did cut a lazy run around a held page
    _, want_moved, want = run(ref_blocks.KvBlockManager)
    assert (moved, got) == (want_moved, want) == (1, [(1, 0), (3, 0)])
    kv.check([])
