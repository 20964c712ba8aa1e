"""Why ``kv.counts`` stays per block (issue 23; kvdirectory README): the worker applies each
``CountUpdates`` message's group moves as one batch sorted deepest first, so how the directory cuts
a node's drained count changes into messages of ``max_updates_per_msg`` decides the stamps."""

from __future__ import annotations

from services.worker.blocks import HostBlockPool
from services.worker.eviction import get_policy


def test_how_a_drain_is_cut_into_messages_decides_the_order():
    """Why ``kv.counts`` stays per block (kvdirectory README, issue 23): the same count changes
    cut into messages differently give a different eviction order, so a run form of the
    messages would have to reproduce the directory's cut, which follows its frozensets' order.
    Two forks' tails (A, B: three blocks each after a shared pinned page) go from count 0 to 1."""

    def pool():
        host = HostBlockPool(32, 4, [], get_policy("branch-count"))
        host.store([1, 10, 11, 12], 0, 4)
        host.store([1, 20, 21, 22], 0, 4)
        host.unpin([12, 11, 10, 22, 21, 20])  # the tails leave L1; the shared page stays pinned
        return host

    tails = [10, 11, 12, 20, 21, 22]
    one = pool()
    assert one.update_counts(tails, [1] * 6) == 6
    cut = pool()
    assert cut.update_counts(tails[:3], [1] * 3) == 3
    assert cut.update_counts(tails[3:], [1] * 3) == 3
    order = lambda host: [b.hash for b in host.evictable.ordered() if b.group == 1]  # noqa: E731
    assert order(one) == [12, 22, 11, 21, 10, 20]  # one message: deepest first, ties in message order
    assert order(cut) == [12, 11, 10, 22, 21, 20]  # two messages: A's tail, then B's
