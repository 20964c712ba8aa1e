"""``reset_counts``: what a worker does when the KV directory restarts (``CountUpdates.epoch``
changes). The new directory starts from empty counts and sends only changes, so the counts the
old one set must go back to 0 here, or their pages stay in the protected group for good."""

from __future__ import annotations

from services.worker.blocks import KvBlockManager
from tests.unit.worker.test_count_message_cut import compute, order


def pool() -> KvBlockManager:
    kv = KvBlockManager(4, 32, 4, "branch-count")
    compute(kv, [1, 10, 11, 12])
    compute(kv, [1, 20, 21, 22])
    compute(kv, [40, 41, 42, 43])  # both forks leave L1 (queued in L2); 40..43 stay pinned
    return kv


def test_reset_counts_is_the_zero_count_message_of_the_counted_queue():
    kv, twin = pool(), pool()
    for p in (kv, twin):
        assert p.update_counts([1, 10, 11, 12, 20, 21, 40], [3, 1, 1, 1, 2, 2, 1]) > 0
    counted = [h for h, g in order(kv) if g == 1]
    assert set(counted) == {1, 10, 11, 12, 20, 21} and 40 in kv.host.counted  # 40 is pinned: counted, not queued
    queue_order = [h for r in twin.host.queues[1] for h in r.keys]
    moved = kv.reset_counts()  # the manager's call (EngineScheduler.reset_counts goes through it)
    assert moved == 6 and not kv.host.counted and all(g == 0 for _, g in order(kv))
    assert twin.update_counts(queue_order, [0] * len(queue_order)) == 6
    assert order(kv) == order(twin)  # the same eviction order as that message
    kv.check([])
    assert kv.reset_counts() == 0  # nothing counted: nothing moves
    assert kv.update_counts([20], [1]) == 1 and [h for h, g in order(kv) if g == 1] == [20]  # counts apply again


def test_a_one_group_pool_has_no_counts_to_reset():
    kv = KvBlockManager(4, 32, 4, "lru")
    compute(kv, [1, 2, 3])
    assert kv.reset_counts() == 0
