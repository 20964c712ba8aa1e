"""Reference model for differential tests: the per-block L1/L2 pools as they were before the
run-based rewrite of ``services/worker/blocks.py`` (commit c85adc1), kept verbatim apart from
this docstring and the move rule of ``HostBlockPool.update_counts`` (issue 23: chains of moved
blocks in message order, each deepest first, instead of one deepest-first sort of the whole
message, so that how the directory cuts a drain into messages cannot change the order), with
``EvictionQueue`` (one ``OrderedDict`` per group) moved here from ``services/worker/eviction.py``
when the production pools stopped using it. Every operation of the production pools must give
the same results and the same KV events, in the same order, as this model
(``tests/property/test_worker_blocks_model.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from shared.messages import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Tier
from services.worker.eviction import Evictable, EvictionPolicy, LruPolicy, get_policy


class EvictionQueue:
    """Evictable blocks in ascending ``(group, last_access)`` order, O(1) per operation.

    The caller stamps ``block.last_access`` with a value larger than every stamp
    already queued before :meth:`push` (or :meth:`regroup`); the queue stores the
    group it filed the block under in ``block.group``.
    """

    __slots__ = ("policy", "groups", "single")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.groups: list[OrderedDict[int, Evictable]] = [OrderedDict() for _ in range(policy.groups)]
        """One ordered dict (hash → block) per group, evicted from group 0's head first.
        Hot loops of the block pools use it directly; everyone else uses the methods."""
        self.single = policy.groups == 1
        """True when every block is in group 0 (``lru``): pools skip the key call."""

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)

    def __contains__(self, block_hash: int) -> bool:
        return any(block_hash in g for g in self.groups)

    def push(self, block: Evictable) -> None:
        """Append ``block`` to the tail of its group (it must carry the newest stamp)."""
        g = self.policy.group(block)
        block.group = g
        self.groups[g][block.hash] = block

    def remove(self, block: Evictable) -> None:
        """Take ``block`` out of the queue. Raises KeyError if it is not queued."""
        del self.groups[block.group][block.hash]

    def pop(self) -> Evictable | None:
        """Remove and return the block with the lowest key, or None when empty."""
        for g in self.groups:
            if g:
                return g.popitem(last=False)[1]
        return None

    def regroup(self, block: Evictable) -> bool:
        """Move a queued block whose group changed to the tail of its new group.

        The caller stamps ``block.last_access`` first. Returns True if it moved.
        """
        g = self.policy.group(block)
        if g == block.group:
            return False
        del self.groups[block.group][block.hash]
        block.group = g
        self.groups[g][block.hash] = block
        return True

    def touch(self, block: Evictable) -> None:
        """Move a queued block to the tail of its group (the caller stamps it newest)."""
        self.groups[block.group].move_to_end(block.hash)

    def ordered(self) -> list[Evictable]:
        """Every queued block in eviction order (O(n); for checks and tests)."""
        return [b for g in self.groups for b in g.values()]


class KvInvariantError(AssertionError):
    """A block-pool invariant does not hold (a bug in the worker, never bad input)."""


class GpuBlock:
    """A hashed L1 block."""

    __slots__ = ("hash", "parent", "ref", "last_access", "count", "group")

    def __init__(self, h: int, parent: int | None, stamp: int) -> None:
        self.hash = h
        self.parent = parent
        """Hash of the preceding page; None at a sequence start."""
        self.ref = 1
        """Running requests of this node that use the block."""
        self.last_access = stamp
        """Logical stamp (per-pool counter) of the last release; orders eviction."""
        self.count = 0
        self.group = 0


class HostBlock:
    """An L2 block."""

    __slots__ = ("hash", "parent", "depth", "pinned", "last_access", "count", "group")

    def __init__(self, h: int, parent: int | None, depth: int, stamp: int) -> None:
        self.hash = h
        self.parent = parent
        self.depth = depth
        """Position of the page in its sequence (0 = first page)."""
        self.pinned = True
        """True while the page is also in L1 (then it is not evictable)."""
        self.last_access = stamp
        self.count = 0
        """Branch count R[b, node] pushed by the KV directory (kv.counts)."""
        self.group = 0


def _stored(run: list[int], parent: int | None, tier: Tier, block_size: int) -> BlockStored:
    return BlockStored(block_hashes=run, parent_block_hash=parent, tier=tier, block_size=block_size)


class GpuBlockPool:
    """L1: ``capacity`` slots of ``block_size`` tokens, LRU eviction of unreferenced blocks.

    Args:
        capacity: slots (``profile.gpu_blocks``).
        block_size: tokens per block.
        events: the shared outbox KV events are appended to.
    """

    tier: Tier = "gpu"

    def __init__(self, capacity: int, block_size: int, events: list[KvEvent], policy: EvictionPolicy | None = None) -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("capacity and block_size must be > 0")
        self.capacity = capacity
        self.block_size = block_size
        self.events = events
        self.blocks: dict[int, GpuBlock] = {}
        self.evictable = EvictionQueue(policy or LruPolicy())
        self.reserved = 0
        """Slots owned by requests that hold no hashed page (yet)."""
        self._stamp = 0

    # -- sizes (O(1)) ----------------------------------------------------- #

    @property
    def free(self) -> int:
        """Slots neither hashed nor reserved."""
        return self.capacity - len(self.blocks) - self.reserved

    @property
    def available(self) -> int:
        """Slots a reservation can get: free plus unreferenced hashed blocks."""
        return self.free + len(self.evictable)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    # -- queries ---------------------------------------------------------- #

    def match_prefix(self, path: Sequence[int], limit: int) -> int:
        """Number of leading blocks of ``path[:limit]`` resident in L1. O(matched)."""
        blocks = self.blocks
        n = 0
        for i in range(min(limit, len(path))):
            if path[i] not in blocks:
                break
            n += 1
        return n

    def unreferenced_among(self, path: Sequence[int], n: int) -> int:
        """How many of the resident blocks ``path[:n]`` have ``ref == 0``. O(n)."""
        blocks = self.blocks
        k = 0
        for i in range(n):
            if blocks[path[i]].ref == 0:
                k += 1
        return k

    # -- mutations ------------------------------------------------------- #

    def acquire(self, path: Sequence[int], n: int) -> None:
        """Reference the resident blocks ``path[:n]`` (a prefix hit). O(n)."""
        blocks = self.blocks
        groups = self.evictable.groups
        for i in range(n):
            b = blocks[path[i]]
            if b.ref == 0:
                del groups[b.group][b.hash]
            b.ref += 1

    def reserve(self, n: int) -> list[int] | None:
        """Reserve ``n`` slots, evicting unreferenced blocks in eviction order.

        Returns the evicted hashes (possibly empty), or None — with nothing
        changed — when fewer than ``n`` slots are available. Emits one
        ``BlockRemoved(gpu)`` for the evictions.
        """
        if n > self.available:
            return None
        need = n - self.free
        evicted: list[int] = []
        if need > 0:
            blocks = self.blocks
            for od in self.evictable.groups:
                while need > 0 and od:
                    h = od.popitem(last=False)[0]
                    del blocks[h]
                    evicted.append(h)
                    need -= 1
            self.events.append(BlockRemoved(block_hashes=evicted, tier="gpu"))
        self.reserved += n
        return evicted

    def unreserve(self, n: int) -> None:
        """Give back ``n`` reserved slots."""
        if n > self.reserved:
            raise KvInvariantError(f"unreserve {n} > reserved {self.reserved}")
        self.reserved -= n

    def fill(self, path: Sequence[int], lo: int, hi: int) -> list[tuple[int, int]]:
        """Turn ``hi - lo`` reserved slots into the pages ``path[lo:hi]``, referenced once.

        A page already resident (computed meanwhile by another request) is
        referenced instead and its reserved slot freed. Emits one
        ``BlockStored(gpu)`` per run of new pages and returns those runs as
        ``(start, end)`` index ranges into ``path``. O(hi - lo).
        """
        if hi - lo > self.reserved:
            raise KvInvariantError(f"fill {hi - lo} blocks with {self.reserved} reserved")
        self.reserved -= hi - lo
        blocks = self.blocks
        groups = self.evictable.groups
        stamp = self._stamp
        runs: list[tuple[int, int]] = []
        start = -1
        parent = path[lo - 1] if lo else None
        for i in range(lo, hi):
            h = path[i]
            b = blocks.get(h)
            if b is None:
                blocks[h] = GpuBlock(h, parent, stamp)
                if start < 0:
                    start = i
            else:
                if b.ref == 0:
                    del groups[b.group][h]
                b.ref += 1
                if start >= 0:
                    runs.append((start, i))
                    start = -1
            parent = h
        if start >= 0:
            runs.append((start, hi))
        for s, e in runs:
            self.events.append(_stored(list(path[s:e]), path[s - 1] if s else None, "gpu", self.block_size))
        return runs

    def release(self, path: Sequence[int], n: int) -> None:
        """Drop one reference from each of ``path[:n]``, last block first. O(n).

        Blocks reaching ``ref == 0`` become evictable with a fresh stamp, so
        the path's parents end up newer than its children.
        """
        if n <= 0:
            return
        blocks = self.blocks
        q = self.evictable
        od0 = q.groups[0]
        single = q.single
        stamp = self._stamp
        for h in path[n - 1 :: -1]:
            b = blocks[h]
            r = b.ref - 1
            b.ref = r
            if r == 0:
                stamp += 1
                b.last_access = stamp
                if single:
                    od0[h] = b
                else:
                    q.push(b)
            elif r < 0:
                self._stamp = stamp
                raise KvInvariantError(f"block {h} released below zero")
        self._stamp = stamp

    def snapshot(self) -> list[int]:
        """Hashes of every hashed block. O(n)."""
        return list(self.blocks)

    def snapshot_parents(self) -> tuple[list[int], list[int | None]]:
        return list(self.blocks), [b.parent for b in self.blocks.values()]


class HostBlockPool:
    """L2: ``capacity`` blocks, written through from L1, evicted by a policy key.

    Args:
        capacity: blocks (``profile.host_blocks``).
        block_size: tokens per block.
        events: the shared outbox.
        policy: eviction key function (``lru`` or ``branch-count``).
    """

    tier: Tier = "host"

    def __init__(self, capacity: int, block_size: int, events: list[KvEvent], policy: EvictionPolicy | None = None) -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("capacity and block_size must be > 0")
        self.capacity = capacity
        self.block_size = block_size
        self.events = events
        self.blocks: dict[int, HostBlock] = {}
        self.evictable = EvictionQueue(policy or LruPolicy())
        self._stamp = 0
        self.holds: dict[int, int] = {}
        self.broken: dict[int, int] = {}

    @property
    def used(self) -> int:
        return len(self.blocks)

    def hold(self, hashes: Sequence[int]) -> list[int]:
        out = []
        for h in hashes:
            if h not in self.blocks:
                break
            self.holds[h] = self.holds.get(h, 0) + 1
            out.append(h)
        return out

    def unhold(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            if self.broken.get(h):  # a broken hold's unhold settles the broken count first
                self.broken[h] -= 1
                if not self.broken[h]:
                    del self.broken[h]
            elif h in self.holds:
                self.holds[h] -= 1
                if not self.holds[h]:
                    del self.holds[h]

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def match_from(self, path: Sequence[int], start: int, limit: int) -> int:
        """Number of consecutive blocks ``path[start:limit]`` present in L2. O(matched)."""
        blocks = self.blocks
        n = 0
        for i in range(start, min(limit, len(path))):
            if path[i] not in blocks:
                break
            n += 1
        return n

    def store(self, path: Sequence[int], lo: int, hi: int) -> None:
        """Write through the pages ``path[lo:hi]`` that just became resident in L1.

        Present pages are pinned; missing ones are inserted pinned, evicting
        the lowest-key unpinned blocks when full. Emits ``BlockRemoved(host)``
        for the evictions and one ``BlockStored(host)`` per run of new pages.
        """
        blocks = self.blocks
        groups = self.evictable.groups
        capacity = self.capacity
        evicted: list[int] = []
        runs: list[tuple[int, int]] = []
        start = -1
        stamp = self._stamp
        parent = path[lo - 1] if lo else None
        for i in range(lo, hi):
            h = path[i]
            b = blocks.get(h)
            if b is not None:
                if not b.pinned:
                    del groups[b.group][h]
                    b.pinned = True
                if start >= 0:
                    runs.append((start, i))
                    start = -1
            else:
                if len(blocks) >= capacity:
                    queued = [x for od in groups for x in od]
                    if not queued:
                        raise KvInvariantError("host pool full of pinned blocks (host capacity < GPU capacity?)")
                    free = [x for x in queued if x not in self.holds]
                    victim = free[0] if free else queued[0]  # all held: the hold is broken
                    del groups[blocks[victim].group][victim]
                    if victim in self.holds:
                        self.broken[victim] = self.broken.get(victim, 0) + self.holds.pop(victim)
                    del blocks[victim]
                    evicted.append(victim)
                stamp += 1
                blocks[h] = HostBlock(h, parent, i, stamp)
                if start < 0:
                    start = i
            parent = h
        self._stamp = stamp
        if start >= 0:
            runs.append((start, hi))
        if evicted:
            self.events.append(BlockRemoved(block_hashes=evicted, tier="host"))
        for s, e in runs:
            self.events.append(_stored(list(path[s:e]), path[s - 1] if s else None, "host", self.block_size))

    def unpin(self, hashes: Sequence[int]) -> None:
        """The pages ``hashes`` left L1 (in this order): they become evictable here."""
        blocks = self.blocks
        q = self.evictable
        od0 = q.groups[0]
        single = q.single
        stamp = self._stamp
        for h in hashes:
            b = blocks[h]
            b.pinned = False
            stamp += 1
            b.last_access = stamp
            if single:
                od0[h] = b
            else:
                q.push(b)
        self._stamp = stamp

    def store_fetched(self, path: Sequence[int], lo: int, hi: int) -> int:
        """Insert pages ``path[lo:hi]`` pulled from a peer's L2 (not in L1: unpinned).

        Pages already present are left as they are. Room is made by evicting
        the lowest-key unpinned blocks other than the pages of ``path[:hi]``
        (the request's own prefix); if too few are left, the deepest new pages
        are not stored (the request recomputes them). New pages are stamped deepest first and
        their queued ancestors restamped after them, so eviction stays leaf-first.
        Emits ``BlockRemoved(host)`` for evictions and one ``BlockStored(host)``
        per run of new pages. Returns the pages stored. O(hi + evicted).
        """
        blocks = self.blocks
        new = [i for i in range(lo, min(hi, len(path))) if path[i] not in blocks]
        if not new:
            return 0
        q = self.evictable
        protected = set(path[:hi]) | set(self.holds)
        need = len(blocks) + len(new) - self.capacity
        evicted: list[int] = []
        if need > 0:
            for od in q.groups:
                for h in od:
                    if h not in protected:
                        evicted.append(h)
                        if len(evicted) == need:
                            break
                if len(evicted) == need:
                    break
            for h in evicted:
                q.remove(blocks.pop(h))
            need -= len(evicted)
        if need > 0:
            new = new[: len(new) - need]
        if evicted:
            self.events.append(BlockRemoved(block_hashes=evicted, tier="host"))
        if not new:
            return 0
        made: list[HostBlock] = []
        for i in reversed(new):
            self._stamp += 1
            b = HostBlock(path[i], path[i - 1] if i else None, i, self._stamp)
            b.pinned = False
            blocks[b.hash] = b
            q.push(b)
            made.append(b)
        for b in made:  # deepest first: each lift leaves the shallower pages newest
            if b.parent is not None and b.parent in blocks and blocks[b.parent].last_access < b.last_access:
                self._lift_ancestors(b)
        start = prev = new[0]
        for i in new[1:] + [-1]:
            if i != prev + 1:
                self.events.append(_stored(list(path[start : prev + 1]), path[start - 1] if start else None, "host", self.block_size))
                start = i
            prev = i
        return len(new)

    def update_counts(self, hashes: Sequence[int], counts: Sequence[int]) -> int:
        """Apply branch counts R[b, node] from the KV directory (``CountUpdates``).

        A block named twice counts once, with its last count, at its first place. Unknown
        hashes are ignored (the block is not, or no longer, here). Under ``lru`` the counts
        are stored but move nothing. Under ``branch-count`` the queued blocks whose group
        changes (the *moved* blocks, in message order) are cut into *chains*: a moved block
        continues the chain of the moved block before it when it is that block's child and
        goes to the same group. Chain by chain, in message order, each chain's blocks move to
        the tail of their new group deepest first (stamped like an access), and the queued
        ancestors in the new group that are older than a moved block are stamped newer too,
        nearest first (a fork's shared prefix stays behind its new pages; a parent is never
        evicted before its child). Returns the number of blocks moved.

        Raises:
            ValueError: if ``hashes`` and ``counts`` differ in length.
        """
        if len(hashes) != len(counts):
            raise ValueError(f"{len(hashes)} hashes but {len(counts)} counts")
        last = dict(zip(hashes, counts))
        blocks = self.blocks
        group = self.evictable.policy.group
        moving: list[HostBlock] = []
        for h, c in last.items():
            b = blocks.get(h)
            if b is None:
                continue
            b.count = c
            if not b.pinned and group(b) != b.group:
                moving.append(b)
        chains: list[list[HostBlock]] = []
        for b in moving:
            if chains and b.parent == chains[-1][-1].hash and group(b) == group(chains[-1][-1]):
                chains[-1].append(b)
            else:
                chains.append([b])
        for chain in chains:
            for b in reversed(chain):
                self._stamp += 1
                b.last_access = self._stamp
                self.evictable.regroup(b)
                self._lift_ancestors(b)
        return len(moving)

    def _lift_ancestors(self, b: HostBlock) -> None:
        """Stamp the queued ancestors of ``b`` in its group newer than ``b``, nearest first,
        so eviction inside the group stays leaf-first."""
        blocks = self.blocks
        touch = self.evictable.touch
        child = b
        p = b.parent
        while p is not None:
            pb = blocks.get(p)
            if pb is None or pb.pinned or pb.group != b.group or pb.last_access > child.last_access:
                break
            self._stamp += 1
            pb.last_access = self._stamp
            touch(pb)
            child = pb
            p = pb.parent

    def snapshot(self) -> list[int]:
        return list(self.blocks)

    def snapshot_parents(self) -> tuple[list[int], list[int | None]]:
        return list(self.blocks), [b.parent for b in self.blocks.values()]


class KvBlockManager:
    """L1 + L2 of one node with write-through and one shared event outbox.

    Args:
        gpu_blocks: L1 capacity (blocks).
        host_blocks: L2 capacity (blocks); must be ≥ ``gpu_blocks`` (L2 ⊇ L1).
        block_size: tokens per block.
        host_policy: host eviction policy name (``lru`` or ``branch-count``).

    Raises:
        ValueError: on non-positive sizes, ``host_blocks < gpu_blocks`` or an unknown policy.

    The outbox starts with ``AllBlocksCleared()``: a fresh manager holds nothing,
    so a consumer drops whatever an earlier incarnation of the node reported.
    """

    def __init__(self, gpu_blocks: int, host_blocks: int, block_size: int, host_policy: str = "lru") -> None:
        if host_blocks < gpu_blocks:
            raise ValueError(
                f"host pool ({host_blocks} blocks) must be at least as large as the GPU pool ({gpu_blocks}): "
                "L2 is written through and keeps every L1 block"
            )
        self.block_size = block_size
        self.events: list[KvEvent] = [AllBlocksCleared()]
        self.gpu = GpuBlockPool(gpu_blocks, block_size, self.events)
        self.host = HostBlockPool(host_blocks, block_size, self.events, get_policy(host_policy))

    # -- queries ---------------------------------------------------------- #

    def match(self, path: Sequence[int], limit: int, *, use_host: bool = True) -> tuple[int, int]:
        """Longest prefix of ``path[:limit]`` in L1, then how far L2 extends it.

        Returns ``(gpu_blocks, host_blocks)``: the first ``gpu_blocks`` pages are
        in L1 and the next ``host_blocks`` must be restored from L2.
        """
        n_gpu = self.gpu.match_prefix(path, limit)
        n_host = self.host.match_from(path, n_gpu, limit) if use_host else 0
        return n_gpu, n_host

    # -- request lifecycle ------------------------------------------------ #

    def admit(self, path: Sequence[int], n_hit: int, new_slots: int) -> bool:
        """Reference the L1 hit ``path[:n_hit]`` and reserve ``new_slots`` more slots.

        Returns False, changing nothing, when L1 cannot make room (never over-commits).
        """
        gpu = self.gpu
        if gpu.available - gpu.unreferenced_among(path, n_hit) < new_slots:
            return False
        gpu.acquire(path, n_hit)
        evicted = gpu.reserve(new_slots)
        assert evicted is not None
        if evicted:
            self.host.unpin(evicted)
        return True

    def reserve(self, n: int) -> bool:
        """Reserve ``n`` slots (a decode request's footprint); False if no room."""
        evicted = self.gpu.reserve(n)
        if evicted is None:
            return False
        if evicted:
            self.host.unpin(evicted)
        return True

    def fill(self, path: Sequence[int], lo: int, hi: int) -> None:
        """Pages ``path[lo:hi]`` became resident in L1 (computed, received or restored):
        convert reserved slots, then write them through to L2."""
        for s, e in self.gpu.fill(path, lo, hi):
            self.host.store(path, s, e)

    def store_fetched(self, path: Sequence[int], lo: int, hi: int) -> int:
        """Pages ``path[lo:hi]`` arrived from a peer's L2 into this node's L2 (not L1);
        see :meth:`HostBlockPool.store_fetched`. Returns the pages stored."""
        return self.host.store_fetched(path, lo, hi)

    def hold(self, path: Sequence[int], n: int) -> list[int]:
        return self.host.hold(path[:n])

    def unhold(self, hashes: Sequence[int]) -> None:
        self.host.unhold(hashes)

    def release(self, path: Sequence[int], n_held: int, reserved: int) -> None:
        """A request leaves: unreference ``path[:n_held]`` (tail first), free ``reserved`` slots."""
        self.gpu.release(path, n_held)
        self.gpu.unreserve(reserved)

    def update_counts(self, hashes: Sequence[int], counts: Sequence[int]) -> int:
        """Branch counts for host eviction; see :meth:`HostBlockPool.update_counts`."""
        return self.host.update_counts(hashes, counts)

    def take_events(self) -> list[KvEvent]:
        """Drain the outbox (events in the order they happened)."""
        out = list(self.events)
        self.events.clear()
        return out

    def snapshot(self) -> tuple[list[int], list[int]]:
        """``(gpu hashes, host hashes)`` for a resync reply. O(n)."""
        return self.gpu.snapshot(), self.host.snapshot()

    def snapshot_parents(self) -> tuple[list[int], list[int | None], list[int], list[int | None]]:
        g, gp = self.gpu.snapshot_parents()
        h, hp = self.host.snapshot_parents()
        return g, gp, h, hp

    # -- checks ------------------------------------------------------------ #

    def check(self, holders: Sequence[tuple[Sequence[int], int, int]]) -> None:
        """Full invariant check, O(blocks + held pages); for tests and debug runs.

        Args:
            holders: for every live request, ``(path, pages held, reserved slots)``.

        Raises:
            KvInvariantError: naming the first invariant that fails.
        """
        gpu, host = self.gpu, self.host

        def fail(msg: str) -> None:
            raise KvInvariantError(msg)

        if gpu.free < 0:
            fail(f"L1 over-committed: {len(gpu.blocks)} hashed + {gpu.reserved} reserved > {gpu.capacity}")
        refs: dict[int, int] = {}
        reserved = 0
        for path, held, res in holders:
            reserved += res
            for i in range(held):
                refs[path[i]] = refs.get(path[i], 0) + 1
        if reserved != gpu.reserved:
            fail(f"reserved slots: requests hold {reserved}, pool counts {gpu.reserved}")
        for h, b in gpu.blocks.items():
            if b.ref != refs.get(h, 0):
                fail(f"L1 block {h}: ref {b.ref} but {refs.get(h, 0)} holders")
            if (b.ref == 0) != (h in gpu.evictable):
                fail(f"L1 block {h}: ref {b.ref} but evictable={h in gpu.evictable}")
            if h not in host.blocks or not host.blocks[h].pinned:
                fail(f"L1 block {h} not pinned in L2 (write-through broken)")
            if b.parent is not None and b.parent not in gpu.blocks:
                fail(f"L1 block {h} resident without its parent {b.parent} (prefix cut)")
        if set(refs) - set(gpu.blocks):
            fail("a request holds a page that is not resident in L1")
        if len(host.blocks) > host.capacity:
            fail(f"L2 over capacity: {len(host.blocks)} > {host.capacity}")
        n_unpinned = 0
        for h, hb in host.blocks.items():
            if hb.pinned != (h in gpu.blocks):
                fail(f"L2 block {h}: pinned={hb.pinned} but in L1={h in gpu.blocks}")
            n_unpinned += not hb.pinned
        if n_unpinned != len(host.evictable):
            fail(f"L2 evictable queue has {len(host.evictable)} blocks, {n_unpinned} unpinned")
        for pool in (gpu, host):
            queue = pool.evictable.ordered()
            for a, b in zip(queue, queue[1:]):
                if (a.group, a.last_access) >= (b.group, b.last_access):
                    fail(f"{pool.tier} eviction queue out of key order at {a.hash}, {b.hash}")
            pos = {b.hash: i for i, b in enumerate(queue)}
            for b in queue:
                p = b.parent
                if p is not None and p in pos and pos[p] < pos[b.hash] and queue[pos[p]].group == b.group:
                    fail(f"{pool.tier}: parent {p} would be evicted before its child {b.hash}")
