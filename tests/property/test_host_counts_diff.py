"""Differential test: the host pool's branch-count updates against the per-block loop they replaced.

``HostBlockPool._update_counts_two`` sets the counts and finds the queued blocks among the named
ones with C-level passes over the message; :class:`OldCounts` below is the Python loop per named
block it replaced (verbatim). Two ``branch-count`` L1 + L2 managers get the same random
operation streams, weighted towards count updates shaped like the directory's ``CountUpdates``
(whole paths and tails of several branches in set order, blocks at equal depths on different
forks, pinned and absent blocks, a block named twice, unknown hashes), and after every operation
every block's pinning, stamp, count and group, both groups' order, the pool's clock, the return
values and the KV events must be equal. Seeds: ``EI_HOST_COUNTS_SEEDS`` (default 16 fixed seeds),
``EI_HOST_COUNTS_OPS`` (default 400).
"""

from __future__ import annotations

import os
import random
import types
from operator import and_, attrgetter, eq

import pytest

from services.worker import blocks
from services.worker.blocks import HostBlock, KvBlockManager
from services.worker.eviction import get_policy

SEEDS = [int(x) for x in os.environ.get("EI_HOST_COUNTS_SEEDS", ",".join(str(s) for s in range(1, 17))).split(",")]
OPS = int(os.environ.get("EI_HOST_COUNTS_OPS", "400"))

_COUNT, _DEPTH, _HASH = attrgetter("count"), attrgetter("depth"), attrgetter("hash")
_GROUP, _PARENT = attrgetter("group"), attrgetter("parent")


def old_update_counts_two(self, hashes, counts):
    """The per-block loop ``HostBlockPool._update_counts_two`` had before (the reference)."""
    get = self.blocks.get
    moving: list[HostBlock] = []
    add = moving.append
    for h, c in zip(hashes, counts):
        b = get(h)
        if b is not None:
            b.count = c
            if not b.pinned and (c > 0) != b.group:
                add(b)
    if not moving:
        return 0
    moving.sort(key=_DEPTH, reverse=True)
    mh = list(map(_HASH, moving))
    mg = list(map(bool, map(_COUNT, moving)))
    if True in map(eq, mg, map(_GROUP, moving)) or len(set(mh)) != len(mh):
        return self._update_counts_blocks(hashes, counts)
    link = list(map(and_, map(eq, map(_PARENT, moving), mh[1:]), map(eq, mg, mg[1:])))
    link.append(False)
    groups = self.evictable.groups
    stamp = self._stamp
    for b, up, linked in zip(moving, mg, link):
        stamp += 1
        b.last_access = stamp
        h = b.hash
        if up:
            g = 1
            del groups[0][h]
        else:
            g = 0
            del groups[1][h]
        b.group = g
        od = groups[g]
        od[h] = b
        if linked:
            continue
        child = b
        p = b.parent
        while p is not None:
            pb = get(p)
            if pb is None or pb.pinned or pb.group != g or pb.last_access > child.last_access:
                break
            stamp += 1
            pb.last_access = stamp
            od.move_to_end(p)
            child = pb
            p = pb.parent
    self._stamp = stamp
    return len(moving)


class Divergence(AssertionError):
    pass


def _host_state(kv: KvBlockManager):
    host = kv.host
    per_block = {h: (b.pinned, b.last_access, b.count, b.group, b.depth, b.parent) for h, b in host.blocks.items()}
    queues = [list(g) for g in host.evictable.groups]
    return per_block, queues, host._stamp


def drive(seed: int, ops: int, *, old=old_update_counts_two) -> dict[str, int]:
    """Random streams on a new and an old-counts manager; returns work counters."""
    rng = random.Random(seed)
    gpu = rng.randint(8, 40)
    host = gpu + rng.randint(gpu, 4 * gpu)
    new = KvBlockManager(gpu, host, 4, "branch-count")
    ref = KvBlockManager(gpu, host, 4, "branch-count")
    ref.host._update_counts_two = types.MethodType(old, ref.host)
    paths: list[list[int]] = []
    next_id = [1]
    stats = {"counts": 0, "moved": 0, "admitted": 0, "fetched": 0}

    def call(name, *args):
        a, b = getattr(new, name)(*args), getattr(ref, name)(*args)
        if a != b:
            raise Divergence(f"{name}: new {a!r}, old {b!r}")
        if new.take_events() != ref.take_events():
            raise Divergence(f"{name}: events differ")
        sa, sb = _host_state(new), _host_state(ref)
        if sa != sb:
            raise Divergence(f"{name}{args}: host state differs")
        return a

    def new_path() -> list[int]:
        p = list(rng.choice(paths)[: rng.randint(0, 12)]) if paths and rng.random() < 0.8 else []
        for _ in range(rng.choice([1, 2, 3, 5, 8, 13])):
            p.append(next_id[0])
            next_id[0] += 1
        paths.append(p)
        return p

    live: list[list] = []
    for _ in range(ops):
        op = rng.random()
        if op < 0.3:  # a request: match, admit, restore from L2, compute the rest
            path = new_path() if rng.random() < 0.5 or not paths else rng.choice(paths)
            n_gpu, n_host = call("match", path, len(path))
            if len(path) > gpu:
                continue
            if call("admit", path, n_gpu, len(path) - n_gpu):
                if n_host:
                    call("fill", path, n_gpu, n_gpu + n_host)
                if n_gpu + n_host < len(path):
                    call("fill", path, n_gpu + n_host, len(path))
                live.append(path)
                stats["admitted"] += 1
        elif op < 0.5 and live:  # a request leaves: its blocks become queued in L2
            path = live.pop(rng.randrange(len(live)))
            call("release", path, len(path), 0)
        elif op < 0.58 and paths:  # a peer fetch into L2
            path = rng.choice(paths)
            n_gpu, n_host = call("match", path, len(path))
            stats["fetched"] += call("store_fetched", path, n_gpu + n_host, len(path))
        elif paths:  # counts, as the directory sends them
            named: list[int] = []
            for _k in range(rng.choice([1, 1, 2, 3, 5])):  # several branches' paths or tails
                p = rng.choice(paths)
                named.extend(p[rng.randint(0, len(p) - 1) :] if rng.random() < 0.5 else p)
            named = list(dict.fromkeys(named))
            rng.shuffle(named)  # the directory's set order
            if rng.random() < 0.1:
                named.append(10**9 + rng.randint(0, 9))  # not here: ignored
            if rng.random() < 0.08 and named:
                named.insert(rng.randrange(len(named) + 1), rng.choice(named))  # named twice
            value = rng.choice([0, 1, 2])
            counts = [value if rng.random() < 0.8 else rng.choice([0, 1, 3]) for _ in named]
            stats["moved"] += call("update_counts", named, counts)
            stats["counts"] += 1
    return stats


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed={s}" for s in SEEDS])
def test_host_counts_equal_per_block_loop(seed):
    stats = drive(seed, OPS)
    assert stats["counts"] > 50 and stats["moved"] > 20 and stats["admitted"] > 10, stats


def test_harness_catches_a_wrong_tie_order():
    """Self-test: a reference that breaks equal-depth ties the other way must be caught."""

    def reversed_ties(self, hashes, counts):
        return old_update_counts_two(self, hashes[::-1], counts[::-1])

    with pytest.raises(Divergence):
        for seed in SEEDS:
            drive(seed, OPS, old=reversed_ties)


def test_uses_the_new_update():
    """The pool under test is not the reference (the test would compare a loop with itself)."""
    assert blocks.HostBlockPool._update_counts_two.__code__ is not old_update_counts_two.__code__


def test_how_a_drain_is_cut_into_messages_decides_the_order():
    """Why ``kv.counts`` stays per block (kvdirectory README, issue 23): the same count changes
    cut into messages differently give a different eviction order, so a run form of the
    messages would have to reproduce the directory's cut, which follows its frozensets' order.
    Two forks' tails (A, B: three blocks each after a shared pinned page) go from count 0 to 1."""

    def pool():
        host = blocks.HostBlockPool(32, 4, [], get_policy("branch-count"))
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
