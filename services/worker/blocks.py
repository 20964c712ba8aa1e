"""Paged KV block managers of one node: GPU memory (L1) and host memory (L2).

Contains zero I/O: no clock, no asyncio, no logging setup (DESIGN §2). The
pools never publish; they append KV events to an outbox that the owner drains
with :meth:`KvBlockManager.take_events` (vLLM ``block_pool.py``, STYLE §1.4).

Block identity is the chained SGLang page hash of ``shared.hashing`` (signed
int64). A request's *block path* is the list of hashes of its full prompt
pages, parent first; the page before ``path[0]`` is the sequence start. Equal
hashes name equal prefixes, so a hash determines its position and ancestors.

L1 (``GpuBlockPool``) holds slots. A slot is either *hashed* (it caches a full
page whose hash is known; ``ref`` running requests use it) or *reserved* (owned
by one request for pages not computed yet, a partial last page, or decode
output). Hashed blocks with ``ref == 0`` stay findable and are evicted lazily,
only when a reservation needs their slot (vLLM's lazy eviction). Requests
release their path from the last block back to the first, each release taking
a newer stamp, so a parent is always newer than its children and LRU evicts
leaves before parents: a cached prefix is never cut in the middle.

L2 (``RunHostPool`` / ``BranchRunHostPool``) is written through: every page that
becomes resident in L1 (computed, received from a prefill node, or restored)
is also stored in L2. A host block whose page is in L1 is *pinned* (not
evictable), as in SGLang HiCache, whose ``evict_host`` only frees the host copy
of nodes already evicted from the device
(``python/sglang/srt/mem_cache/hiradix_cache.py``). L2 therefore always
contains L1 (it must be at least as large), and host blocks become evictable
in the order L1 evicts them, leaves first. A queued request *holds* the L2
prefix its peer fetch brought in until it is admitted (``KvBlockManager.hold``):
held pages keep their place in the eviction queue and are skipped.

Representation (runs of blocks, SGLang ``radix_cache.py`` style compressed
edges): a Claude Code prompt is ~240 blocks of 512 tokens (~1,900 of 64) and
consecutive requests of a branch share almost all of them, so the pools store
*runs* — consecutive pages of one sequence — instead of one object per block:

* L1 is a radix tree of runs (``_GpuRun``): children keyed by their first
  hash, split where paths diverge or where a request's held prefix ends, and
  merged again when a parent and its only child end up with the same ``ref``.
  Every block of a run has the run's ``ref``. The unreferenced runs form the
  eviction queue (oldest first; inside a run the deepest block goes first),
  and eviction cuts whole runs or the deep end of the oldest one. Prefix
  match, acquire, fill, release and eviction are O(runs on the path), not
  O(blocks); the block hashes an event lists are taken by list slicing.
* L2 under a one-group policy (``lru``) is ``RunHostPool``: the pinned blocks
  are exactly L1's (counted, not stored twice), the unpinned ones are runs in
  an LRU queue indexed by first hash. Pinning (an L1 restore) takes the
  shallow end of a run; eviction takes the deep end of the oldest.
* L2 under ``branch-count`` is ``BranchRunHostPool``: the same runs in two
  queues, one per group (count 0 first). The set of queued pages and the set
  of counted pages let a count message move whole stretches: a message is cut
  into stretches (consecutive entries that are consecutive pages of one run,
  each found as the run its first entry starts, else by a scan of the runs)
  and chains, each chain leaves its runs by slicing and is queued as one new
  run, and its lift restamps whole runs; a message naming no queued page (most
  of them) is one set update per same-sign stretch and one set probe per
  entry. Python steps per message, per unpin and per fetch are O(runs
  touched); per named hash there is C-level work only (set probes and
  updates, slice compares). Pages that move between runs stay in the queued
  set untouched; a page enters it only when the set is read after the page
  entered the queue (a run queued since the last read is flagged ``lazy``), so
  a page that leaves the queue before that (an L1 restore, an eviction) costs
  the set nothing, and one set insert and one delete otherwise. Once count
  messages come with their chains (the simulator's in-process directory), the
  pool keeps neither set: a queued page's count is its group, an L1 page's is
  kept in its L1 run as counted offset intervals (``_GpuRun.counted``, carried
  through L1's splits, merges, evictions and restores), set chain by chain
  along L1's runs, and an eviction queues a run's pieces by them: O(runs
  changed) per message and per unpin, not O(pages).
* Holds (both pools) are kept whole: a held path prefix under its last hash,
  counted per page only around a broken hold (``RunHostPool.prefixes``).

Both keep exactly the per-block semantics (same results, same KV events in
the same order; ``tests/property/test_worker_blocks_model.py`` checks them
against the per-block model on random operation streams).
"""

from __future__ import annotations

from collections import _count_elements, deque  # type: ignore[attr-defined]
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, compress, count, islice
from operator import itemgetter, ne
from typing import Any

from shared.messages import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Tier
from services.worker.eviction import BranchCountPolicy, EvictionPolicy, LruPolicy, get_policy


class KvInvariantError(AssertionError):
    """A block-pool invariant does not hold (a bug in the worker, never bad input)."""




def _drain(it: Iterable[object]) -> None:
    """Run an iterator (of side effects) to its end in C."""
    deque(it, maxlen=0)


def _unhold(holds: dict[int, int], broken: dict[int, int], hashes: Sequence[int]) -> None:
    """Remove one hold from each of ``hashes``.

    A hold a write-through broke (:func:`_break_hold`) is still owed an unhold by its
    holder; that unhold is taken from ``broken`` first, so it never drops the hold a
    later holder took on the same page once it was stored again. Holders are not told
    apart: if the later holder unholds first, the page stays held until the earlier one
    does (a page kept a little longer, never one released early).

    The common case, no broken hold and one hold per page, is three passes in C."""
    if not broken:
        held = list(map(holds.get, hashes))
        if held.count(1) == len(held):
            _drain(map(holds.__delitem__, hashes))
            return
    for h in hashes:
        b = broken.get(h)
        if b is not None:
            if b > 1:
                broken[h] = b - 1
            else:
                del broken[h]
            continue
        c = holds.get(h)
        if c is None:
            continue
        if c > 1:
            holds[h] = c - 1
        else:
            del holds[h]


def _break_hold(holds: dict[int, int], broken: dict[int, int], h: int) -> None:
    """Page ``h`` leaves L2 although held (every queued page was held): its holds move to
    ``broken``, where their holders' unholds are taken from (see :func:`_unhold`)."""
    c = holds.pop(h, None)
    if c:
        broken[h] = broken.get(h, 0) + c


def _common(keys: list[int], path: Sequence[int], pos: int, n: int) -> int:
    """Length of the common prefix of ``keys`` (a run: consecutive pages of one sequence) and
    ``path[pos:n]``, given ``keys[0] == path[pos]``. Chained hashes: two pages with the same
    hash have the same prefix, so equal last pages mean equal runs (O(1)); where they diverge
    the split point is found by bisection over slices, O(len) in C."""
    size = len(keys)
    end = pos + size
    if end <= n:
        if path[end - 1] == keys[-1]:
            return size
        hi = size
    else:
        hi = n - pos
        if path[n - 1] == keys[hi - 1]:
            return hi
    lo = 1  # keys[:lo] matches, keys[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if path[pos + lo : pos + mid] == keys[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------- #
# intrusive FIFO of runs
# --------------------------------------------------------------------------- #


class _Link:
    __slots__ = ("prev", "next")

    def __init__(self) -> None:
        self.prev: Any = None
        self.next: Any = None


class _RunQueue:
    """Doubly linked list of runs, oldest first; ``blocks`` counts the blocks queued.
    Append, insert after, unlink and head are O(1)."""

    __slots__ = ("head", "blocks")

    def __init__(self) -> None:
        h = _Link()
        h.prev = h.next = h
        self.head = h
        self.blocks = 0

    def append(self, r: Any) -> None:
        h = self.head
        t = h.prev
        r.prev = t
        r.next = h
        t.next = r
        h.prev = r

    def insert_after(self, a: Any, r: Any) -> None:
        b = a.next
        r.prev = a
        r.next = b
        a.next = r
        b.prev = r

    def unlink(self, r: Any) -> None:
        p, n = r.prev, r.next
        p.next = n
        n.prev = p
        r.prev = r.next = None

    def first(self) -> Any:
        n = self.head.next
        return None if n is self.head else n

    def last(self) -> Any:
        p = self.head.prev
        return None if p is self.head else p

    def __iter__(self) -> Iterator[Any]:
        h = self.head
        r = h.next
        while r is not h:
            nxt = r.next
            yield r
            r = nxt


class _BlockView:
    """One block of a run pool as the per-block pools show it (for checks and tests; a copy)."""

    __slots__ = ("hash", "parent", "ref", "pinned", "last_access", "count", "group", "depth")

    def __init__(self, h: int, parent: int | None, **kw: Any) -> None:
        self.hash = h
        self.parent = parent
        self.ref = kw.get("ref", 0)
        self.pinned = kw.get("pinned", True)
        self.last_access = kw.get("last_access", 0)
        self.count = kw.get("count", 0)
        self.group = kw.get("group", 0)
        self.depth = kw.get("depth", 0)

    def _key(self) -> tuple[Any, ...]:
        return (self.hash, self.parent, self.ref, self.pinned, self.last_access, self.count, self.group, self.depth)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BlockView) and self._key() == other._key()

    def __repr__(self) -> str:
        return f"_BlockView(hash={self.hash}, parent={self.parent}, ref={self.ref}, pinned={self.pinned})"


# --------------------------------------------------------------------------- #
# L1
# --------------------------------------------------------------------------- #


_NONE: tuple[tuple[int, int], ...] = ()
"""No counted interval (:attr:`_GpuRun.counted`): one shared empty tuple, replaced, never changed."""

_new = object.__new__
"""``_new(C)``: an instance of a ``__slots__`` class ``C`` with no slot set (C-level, no ``__init__``
frame): the hot sites that make :class:`_GpuRun` / :class:`_HostRun` (~10,000 a 600-s simulated run) set
every slot themselves."""

_SECOND = itemgetter(1)
"""A chain's length (``(position, length)``), C-level."""
_ONES: tuple[int, ...] = ()
"""The counts passed where every count is > 0 (``on`` True: :meth:`BranchRunHostPool._mark` reads none)."""


def _ivl_cut(iv: Sequence[tuple[int, int]], k: int) -> tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]]:
    """Counted intervals ``iv`` of a run cut after its first ``k`` pages: those of the shallow
    part and those of the deep part (offsets from its own first page). O(intervals)."""
    up: list[tuple[int, int]] = []
    down: list[tuple[int, int]] = []
    for a, b in iv:
        if b <= k:
            up.append((a, b))
        elif a >= k:
            down.append((a - k, b - k))
        else:
            up.append((a, k))
            down.append((0, b - k))
    return up or _NONE, down or _NONE


def _ivl_join(up: Sequence[tuple[int, int]], n: int, down: Sequence[tuple[int, int]]) -> Sequence[tuple[int, int]]:
    """Counted intervals of a run of ``n`` pages (``up``) with a run (``down``) appended below it,
    touching intervals joined. O(intervals)."""
    if not down:
        return up
    out = list(up)
    for a, b in down:
        a += n
        b += n
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _ivl_set(iv: Sequence[tuple[int, int]], s: int, e: int, on: bool) -> Sequence[tuple[int, int]]:
    """Counted intervals ``iv`` with the offsets ``[s, e)`` counted (``on``) or not, as a new
    sequence (``iv`` is not changed): sorted, disjoint, touching ones joined. O(intervals)."""
    if not iv:
        return ((s, e),) if on else _NONE
    if len(iv) == 1:  # the usual (17,062 of 21,255 calls per 600 s at 512): no lists, no sort
        a, b = iv[0]
        if on:
            if s <= b and a <= e:  # overlapping or touching: one interval
                return ((a if a < s else s, b if b > e else e),)
        elif s <= a and b <= e:  # all of it uncounted
            return _NONE
    out: list[tuple[int, int]] = []
    for a, b in iv:
        if b <= s or a >= e:
            out.append((a, b))
        else:
            if a < s:
                out.append((a, s))
            if b > e:
                out.append((e, b))
    if on:
        out.append((s, e))
        out.sort()
        joined: list[tuple[int, int]] = []
        for a, b in out:
            if joined and joined[-1][1] >= a:
                if b > joined[-1][1]:
                    joined[-1] = (joined[-1][0], b)
            else:
                joined.append((a, b))
        out = joined
    return out or _NONE


class _GpuRun:
    """A radix-tree node of L1: consecutive resident pages, one ``ref`` for all of them."""

    __slots__ = ("keys", "depth", "parent", "children", "ref", "prev", "next", "counted")

    def __init__(self, keys: list[int], depth: int, parent: _GpuRun | None, ref: int) -> None:
        self.keys = keys
        """Block hashes, parent first (``keys[i]`` is the parent of ``keys[i + 1]``)."""
        self.depth = depth
        """Position of ``keys[0]`` in its sequence (0 = first page)."""
        self.parent = parent
        """Run holding the parent of ``keys[0]``; None at a sequence start."""
        self.children: dict[int, _GpuRun] | None = None
        """Child runs by first hash (they all hang below ``keys[-1]``)."""
        self.ref = ref
        self.prev: Any = None
        self.next: Any = None
        """Eviction-queue links (queued ⇔ ``ref == 0``)."""
        self.counted: Sequence[tuple[int, int]] = _NONE
        """The run's pages whose last branch count is > 0, as sorted disjoint ``[start, end)``
        offset intervals, touching ones joined (usually none or the whole run); kept only once the
        node's :class:`BranchRunHostPool` takes count messages with chains (else always empty).
        Carried through splits, merges and evictions (:attr:`GpuBlockPool.evicted_runs`)."""


class _RunQueueView:
    """A pool's eviction queue of runs seen block by block (read only): size and membership;
    subclasses list the blocks (``ordered``)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self.policy: EvictionPolicy = pool.policy

    def __len__(self) -> int:
        return self._pool.queue.blocks

    def __contains__(self, h: int) -> bool:
        return any(h in r.keys for r in self._pool.queue)


class _GpuQueueView(_RunQueueView):
    """``GpuBlockPool.evictable``: the unreferenced blocks in eviction order (read only)."""

    def ordered(self) -> list[_BlockView]:
        """Every queued block in eviction order (O(n); for checks and tests)."""
        out = []
        for r in self._pool.queue:
            keys = r.keys
            for i in range(len(keys) - 1, -1, -1):
                p = keys[i - 1] if i else (r.parent.keys[-1] if r.parent is not None else None)
                out.append(_BlockView(keys[i], p, ref=0, depth=r.depth + i))
        return out


class GpuBlockPool:
    """L1: ``capacity`` slots of ``block_size`` tokens, LRU eviction of unreferenced blocks.

    Args:
        capacity: slots (``profile.gpu_blocks``).
        block_size: tokens per block.
        events: the shared outbox KV events are appended to.
        policy: eviction key; L1 supports one-group policies only (``lru``).

    Raises:
        ValueError: on non-positive sizes or a policy with more than one group.

    Paths given to the mutating methods must respect the pool's protocol: a
    request fills pages only below pages it holds, and holds a prefix of its path.
    """

    tier: Tier = "gpu"

    def __init__(self, capacity: int, block_size: int, events: list[KvEvent], policy: EvictionPolicy | None = None) -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("capacity and block_size must be > 0")
        self.policy: EvictionPolicy = policy or LruPolicy()
        if self.policy.groups != 1:
            raise ValueError("the GPU pool evicts in LRU order (one-group policies only)")
        self.capacity = capacity
        self.block_size = block_size
        self.events = events
        self.roots: dict[int, _GpuRun] = {}
        """Runs that start a sequence, by first hash."""
        self.ends: dict[int, _GpuRun] = {}
        """Every run by its last hash (a page is resident once, so each names one run): a list
        of hashes that ends a run can be matched against L1 from its end, run by run up the
        tree (``BranchRunHostPool._l1_suffix``). O(1) per run change."""
        self.queue = _RunQueue()
        """Unreferenced runs, oldest first."""
        self.hashed = 0
        """Hashed (resident) blocks."""
        self.reserved = 0
        """Slots owned by requests that hold no hashed page (yet)."""
        self.evicted_runs: list[tuple[list[int], int, int | None, Sequence[tuple[int, int]]]] = []
        """Runs evicted by the last :meth:`reserve`, in eviction order: ``(hashes parent first,
        depth of the first, its parent, its counted intervals)`` (:attr:`_GpuRun.counted`); each
        run's pages left deepest first."""

    # -- sizes (O(1)) ----------------------------------------------------- #

    @property
    def free(self) -> int:
        """Slots neither hashed nor reserved."""
        return self.capacity - self.hashed - self.reserved

    @property
    def available(self) -> int:
        """Slots a reservation can get: free plus unreferenced hashed blocks. (:meth:`reserve` and
        ``EngineScheduler.state`` compute it inline, as this and :attr:`free`: in 3.11 a property
        read is a non-inlined Python call, ~700 instructions.)"""
        return self.capacity - self.hashed - self.reserved + self.queue.blocks

    @property
    def evictable(self) -> _GpuQueueView:
        """The eviction queue, block by block (a read-only view)."""
        return _GpuQueueView(self)

    def __contains__(self, h: int) -> bool:
        """O(blocks); for checks and tests."""
        return any(h in r.keys for r in self._runs())

    def pages(self) -> set[int]:
        """Every hashed block in L1, as a new set. O(blocks)."""
        out: set[int] = set()
        for r in self._runs():
            out.update(r.keys)
        return out

    # -- walks ------------------------------------------------------------ #

    def _runs(self) -> Iterator[_GpuRun]:
        """Every run, parents before children (deterministic)."""
        stack = list(reversed(self.roots.values()))
        while stack:
            r = stack.pop()
            yield r
            if r.children:
                stack.extend(reversed(r.children.values()))

    def _cover(self, path: Sequence[int], n: int) -> tuple[list[_GpuRun], int]:
        """Runs covering ``path[:n]`` (all resident), root first, and where the last one ends
        (≥ n). Inside a run every block has one resident child, so only first hashes are looked up."""
        runs: list[_GpuRun] = []
        pos = 0
        children: dict[int, _GpuRun] | None = self.roots
        while pos < n:
            r = children.get(path[pos]) if children is not None else None
            if r is None:
                raise KvInvariantError(f"block {path[pos]} (position {pos}) is not resident in L1")
            runs.append(r)
            pos += len(r.keys)
            children = r.children
        return runs, pos

    def _split(self, r: _GpuRun, k: int) -> _GpuRun:
        """Split ``r`` after its first ``k`` blocks. ``r`` keeps the deep part (its children and
        its queue place); the new shallow run is returned (queued right after ``r`` if ``r`` is:
        its blocks are newer)."""
        keys = r.keys
        up = _GpuRun(keys[:k], r.depth, r.parent, r.ref)
        up.children = {keys[k]: r}
        if r.counted:
            up.counted, r.counted = _ivl_cut(r.counted, k)
        self.ends[keys[k - 1]] = up
        if r.parent is None:
            self.roots[keys[0]] = up
        else:
            r.parent.children[keys[0]] = up  # type: ignore[index]
        del keys[:k]
        r.depth += k
        r.parent = up
        if r.prev is not None:
            self.queue.insert_after(r, up)
        return up

    def _cover_range(self, path: Sequence[int], lo: int, hi: int) -> list[_GpuRun]:
        """Runs covering exactly ``path[lo:hi]`` (resident), splitting at ``lo`` and ``hi``."""
        runs, end = self._cover(path, hi)
        if end > hi:
            last = runs[-1]
            runs[-1] = self._split(last, hi - last.depth)
        i = 0
        while runs[i].depth + len(runs[i].keys) <= lo:
            i += 1
        if i:
            runs = runs[i:]
        r0 = runs[0]
        if r0.depth < lo:
            self._split(r0, lo - r0.depth)  # r0 keeps [lo, ...)
        return runs

    def _merge(self, r: _GpuRun, c: _GpuRun) -> None:
        """Absorb ``r``'s only child ``c`` (same ref) into ``r``; ``c`` leaves the queue."""
        ends = self.ends
        del ends[r.keys[-1]]
        ends[c.keys[-1]] = r
        if c.counted:
            r.counted = _ivl_join(r.counted, len(r.keys), c.counted)
        r.keys.extend(c.keys)
        r.children = c.children
        if c.children:
            for g in c.children.values():
                g.parent = r
        if c.prev is not None:
            self.queue.unlink(c)
            self.queue.blocks -= len(c.keys)

    # -- queries ---------------------------------------------------------- #

    def match_prefix(self, path: Sequence[int], limit: int) -> int:
        """Number of leading blocks of ``path[:limit]`` resident in L1. O(runs on the path)."""
        n = len(path)
        if limit < n:
            n = limit
        pos = 0
        children: dict[int, _GpuRun] | None = self.roots
        while pos < n and children:
            r = children.get(path[pos])
            if r is None:
                break
            keys = r.keys
            end = pos + len(keys)
            if end <= n and path[end - 1] == keys[-1]:  # chained: same last page, same run
                pos = end
                children = r.children
                continue
            return pos + _common(keys, path, pos, n)
        return pos

    def unreferenced_among(self, path: Sequence[int], n: int) -> int:
        """How many of the resident blocks ``path[:n]`` have ``ref == 0``. O(runs)."""
        if n <= 0:
            return 0
        runs, end = self._cover(path, n)
        k = 0
        for r in runs:
            if r.ref == 0:
                k += len(r.keys)
        if runs[-1].ref == 0:
            k -= end - n
        return k

    # -- mutations ------------------------------------------------------- #

    def acquire(self, path: Sequence[int], n: int) -> None:
        """Reference the resident blocks ``path[:n]`` (a prefix hit). O(runs)."""
        if n <= 0:
            return
        q = self.queue
        for r in self._cover_range(path, 0, n):
            if r.ref == 0:
                q.unlink(r)
                q.blocks -= len(r.keys)
            r.ref += 1

    def acquire_if_room(self, path: Sequence[int], n: int, room: int) -> bool:
        """:meth:`acquire` ``path[:n]`` if ``room`` slots are still available after it (the hit's
        unreferenced blocks leave the eviction queue, so they no longer count as available);
        else return False, changing nothing. The same as :meth:`unreferenced_among`, the test,
        then :meth:`acquire`, in one walk of the path's runs instead of two (an admission's;
        ~4,000 per 600 s of the ``evolving`` side-by-side). O(runs).
        """
        if n <= 0:
            return self.capacity - self.hashed - self.reserved + self.queue.blocks >= room  # available
        return self._acquire_runs_if_room(self._cover(path, n)[0], n, room)

    def match_runs(self, path: Sequence[int], limit: int) -> tuple[list[_GpuRun], int]:
        """:meth:`match_prefix` and the runs that hold the match, root first (the last may go
        on past it), for :meth:`_acquire_runs_if_room` before L1 changes. O(runs on the path)."""
        n = len(path)
        if limit < n:
            n = limit
        pos = 0
        runs: list[_GpuRun] = []
        children: dict[int, _GpuRun] | None = self.roots
        while pos < n and children:
            r = children.get(path[pos])
            if r is None:
                break
            runs.append(r)
            keys = r.keys
            end = pos + len(keys)
            if end <= n and path[end - 1] == keys[-1]:  # chained: same last page, same run
                pos = end
                children = r.children
                continue
            return runs, pos + _common(keys, path, pos, n)
        return runs, pos

    def _acquire_runs_if_room(self, runs: list[_GpuRun], n: int, room: int) -> bool:
        """:meth:`acquire_if_room` of ``path[:n]``, ``runs`` the runs that hold it, root first
        (:meth:`_cover`'s or :meth:`match_runs`' list, taken since L1 last changed)."""
        if n <= 0:
            return self.capacity - self.hashed - self.reserved + self.queue.blocks >= room  # available
        k = 0  # unreferenced_among(path, n), inline
        for r in runs:
            if r.ref == 0:
                k += len(r.keys)
        last = runs[-1]
        end = last.depth + len(last.keys)
        if last.ref == 0:
            k -= end - n
        if self.capacity - self.hashed - self.reserved + self.queue.blocks - k < room:
            return False
        if end > n:  # _cover_range(path, 0, n): only the last run can go on past n
            runs[-1] = self._split(last, n - last.depth)
        q = self.queue
        for r in runs:
            if r.ref == 0:  # q.unlink(r), inline (one per run a hit takes out of the queue)
                p, nx = r.prev, r.next
                p.next = nx
                nx.prev = p
                r.prev = r.next = None
                q.blocks -= len(r.keys)
            r.ref += 1
        return True

    def reserve(self, n: int) -> list[int] | None:
        """Reserve ``n`` slots, evicting unreferenced blocks in eviction order.

        Returns the evicted hashes (possibly empty), or None — with nothing
        changed — when fewer than ``n`` slots are available. Emits one
        ``BlockRemoved(gpu)`` for the evictions; :attr:`evicted_runs` lists them
        as runs. O(runs evicted + hashes).
        """
        free = self.capacity - self.hashed - self.reserved  # self.free, without the property call
        if n > free + self.queue.blocks:  # self.available
            return None
        need = n - free
        evicted: list[int] = []
        out: list[tuple[list[int], int, int | None, Sequence[tuple[int, int]]]] = []
        self.evicted_runs = out
        if need > 0:
            q = self.queue
            roots = self.roots
            ends = self.ends
            while need > 0:
                r = q.head.next
                keys = r.keys
                if r.children:
                    raise KvInvariantError(f"L1 would evict block {keys[-1]} before its child")
                size = len(keys)
                p = r.parent
                if size <= need:
                    q.unlink(r)
                    del ends[keys[-1]]
                    if p is None:
                        del roots[keys[0]]
                    else:
                        ch = p.children
                        del ch[keys[0]]
                        if not ch:
                            p.children = None
                    evicted.extend(reversed(keys))
                    out.append((keys, r.depth, p.keys[-1] if p is not None else None, r.counted))
                    need -= size
                    q.blocks -= size
                    self.hashed -= size
                else:
                    cut = size - need
                    piece = keys[cut:]
                    del ends[keys[-1]]
                    del keys[cut:]
                    ends[keys[-1]] = r
                    evicted.extend(reversed(piece))
                    iv: Sequence[tuple[int, int]] = _NONE
                    if r.counted:
                        r.counted, iv = _ivl_cut(r.counted, cut)
                    out.append((piece, r.depth + cut, keys[-1], iv))
                    q.blocks -= need
                    self.hashed -= need
                    need = 0
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
        ``(start, end)`` index ranges into ``path`` (L1 is prefix-closed, so the
        new pages are one run: the resident ones come first). The caller holds
        ``path[:lo]``. O(runs on the path + new pages).
        """
        if hi - lo > self.reserved:
            raise KvInvariantError(f"fill {hi - lo} blocks with {self.reserved} reserved")
        self.reserved -= hi - lo
        if hi <= lo:
            return []
        p = self.ends.get(path[lo - 1]) if lo else None
        if p is not None and (p.children is None or path[lo] not in p.children):
            # the usual case (a prefill chunk's pages after the prefix its request holds): a run ends
            # at path[lo - 1] (chained hashes: the held prefix's last run) and path[lo] is not resident
            # below it, so the resident prefix of path[:hi] is path[:lo], that run its last: no walk
            m = lo
        else:
            runs, m = self.match_runs(path, hi)  # one walk: the runs holding the resident prefix path[:m] of path[:hi]
            if m < lo:
                raise KvInvariantError(f"fill from {lo} but only {m} pages of the path are resident")
            if runs:
                last = runs[-1]
                if last.depth + len(last.keys) > m:  # the last run goes on past m: cut it there
                    runs[-1] = self._split(last, m - last.depth)
                p = runs[-1]
            if m > lo:  # pages computed meanwhile by another request: referenced, not stored
                i = len(runs) - 1
                while runs[i].depth > lo:
                    i -= 1
                r0 = runs[i]
                if r0.depth < lo:
                    self._split(r0, lo - r0.depth)  # r0 keeps [lo, ...)
                q = self.queue
                for r in runs[i:]:
                    if r.ref == 0:
                        q.unlink(r)
                        q.blocks -= len(r.keys)
                    r.ref += 1
        if m == hi:
            return []
        new = path[m:hi]
        if type(new) is not list:
            new = list(new)
        ends = self.ends
        if m == 0:
            parent = None
            run = _new(_GpuRun)  # _GpuRun(new[:], 0, None, 1) without its __init__ frame: every slot set here
            run.keys = new[:]  # the event keeps its own list
            run.depth = 0
            run.parent = None
            run.children = None
            run.ref = 1
            run.prev = run.next = None
            run.counted = _NONE
            self.roots[new[0]] = run
            ends[new[-1]] = run
        else:
            assert p is not None  # the run holding path[m - 1]
            parent = path[m - 1]
            if not p.children and p.ref == 1:
                del ends[p.keys[-1]]
                p.keys.extend(new)  # the filling request is the run's only holder: extend it
                ends[new[-1]] = p
            else:
                run = _new(_GpuRun)  # _GpuRun(new[:], m, p, 1) without its __init__ frame: every slot set here
                run.keys = new[:]
                run.depth = m
                run.parent = p
                run.children = None
                run.ref = 1
                run.prev = run.next = None
                run.counted = _NONE
                ends[new[-1]] = run
                if p.children is None:
                    p.children = {new[0]: run}
                else:
                    p.children[new[0]] = run
        self.hashed += hi - m
        self.events.append(BlockStored(block_hashes=new, parent_block_hash=parent, tier="gpu", block_size=self.block_size))
        return [(m, hi)]

    def release(self, path: Sequence[int], n: int) -> None:
        """Drop one reference from each of ``path[:n]``, last block first. O(runs).

        Blocks reaching ``ref == 0`` become evictable at the queue's tail (deepest
        first), so the path's parents end up newer than its children.

        Raises:
            KvInvariantError: a block would be released below zero.
        """
        if n <= 0:
            return
        q = self.queue
        r = self.ends.get(path[n - 1])
        if r is None:  # path[n - 1] inside a run: cut it there (a request's held prefix ends a run, usually)
            r = self._cover_range(path, 0, n)[-1]
        # path[:n] is the run ending at path[n - 1] and its ancestors (chained hashes): walked up by
        # parent links, deepest first, not down from the root (a merge folds a run's child into
        # it, its parent stays)
        while r is not None:
            ref = r.ref - 1
            if ref < 0:
                raise KvInvariantError(f"block {r.keys[-1]} released below zero")
            r.ref = ref
            ch = r.children
            if ch is not None and len(ch) == 1:
                for c in ch.values():
                    if c.ref == ref and (ref > 0 or q.head.prev is c):
                        self._merge(r, c)  # same holders: one run again
            if ref == 0:  # q.append(r), inline (one per run released: ~10,000 a 600-s run at 512)
                h = q.head
                t = h.prev
                r.prev = t
                r.next = h
                t.next = r
                h.prev = r
                q.blocks += len(r.keys)
            r = r.parent

    def snapshot(self) -> list[int]:
        """Hashes of every hashed block, parents first. O(n)."""
        return self.snapshot_parents()[0]

    def snapshot_parents(self) -> tuple[list[int], list[int | None]]:
        """:meth:`snapshot` and each block's parent hash (None at a sequence start). O(n)."""
        hashes: list[int] = []
        parents: list[int | None] = []
        for r in self._runs():
            hashes.extend(r.keys)
            parents.append(r.parent.keys[-1] if r.parent is not None else None)
            parents.extend(r.keys[:-1])
        return hashes, parents

    # -- views for checks and tests ------------------------------------- #

    @property
    def blocks(self) -> dict[int, _BlockView]:
        """Every hashed block as ``hash → view`` (hash, parent, ref, depth). A copy, O(n)."""
        out: dict[int, _BlockView] = {}
        for r in self._runs():
            p = r.parent.keys[-1] if r.parent is not None else None
            for i, h in enumerate(r.keys):
                out[h] = _BlockView(h, p, ref=r.ref, depth=r.depth + i)
                p = h
        return out

    def check_structure(self) -> None:
        """Radix-tree invariants (O(n)): links, first-hash keys, depths, queue ⇔ ref 0, counts.

        Raises:
            KvInvariantError: naming the first one that fails.
        """
        seen: set[int] = set()
        total = 0
        queued = 0
        n_runs = 0
        for r in self._runs():
            n_runs += 1
            if not r.keys:
                raise KvInvariantError("empty L1 run")
            if r.ref < 0:
                raise KvInvariantError(f"L1 run at {r.keys[0]} has ref {r.ref}")
            p = r.parent
            if p is None:
                if r.depth != 0 or self.roots.get(r.keys[0]) is not r:
                    raise KvInvariantError(f"L1 root run {r.keys[0]} misfiled (depth {r.depth})")
            else:
                if not p.children or p.children.get(r.keys[0]) is not r or r.depth != p.depth + len(p.keys):
                    raise KvInvariantError(f"L1 run {r.keys[0]} misfiled under {p.keys[-1]}")
                if r.ref > p.ref:
                    raise KvInvariantError(f"L1 run {r.keys[0]} has ref {r.ref} > its parent's {p.ref}")
            if r.children is not None and not r.children:
                raise KvInvariantError(f"L1 run {r.keys[0]}: empty children dict")
            for h in r.keys:
                if h in seen:
                    raise KvInvariantError(f"L1 block {h} in two runs")
                seen.add(h)
            total += len(r.keys)
            if self.ends.get(r.keys[-1]) is not r:
                raise KvInvariantError(f"L1 run {r.keys[0]} not indexed by its last hash {r.keys[-1]}")
            if (r.ref == 0) != (r.prev is not None):
                raise KvInvariantError(f"L1 run {r.keys[0]}: ref {r.ref} but queued={r.prev is not None}")
            end = -1
            for a, b in r.counted:
                if not end < a < b <= len(r.keys):
                    raise KvInvariantError(f"L1 run {r.keys[0]}: counted intervals {list(r.counted)} (size {len(r.keys)})")
                end = b
            queued += len(r.keys) if r.ref == 0 else 0
        if total != self.hashed:
            raise KvInvariantError(f"L1 counts {self.hashed} hashed blocks, runs hold {total}")
        if len(self.ends) != n_runs:
            raise KvInvariantError(f"L1 last-hash index has {len(self.ends)} runs, the tree {n_runs}")
        if queued != self.queue.blocks or sum(len(r.keys) for r in self.queue) != queued:
            raise KvInvariantError(f"L1 queue counts {self.queue.blocks} blocks, {queued} unreferenced")


# --------------------------------------------------------------------------- #
# L2, runs (one-group policies)
# --------------------------------------------------------------------------- #


class _HostRun:
    """Consecutive unpinned L2 pages of one sequence, queued together (in one group)."""

    __slots__ = ("keys", "depth", "parent", "stamp", "group", "prev", "next", "lazy")

    def __init__(self, keys: list[int], depth: int, parent: int | None, stamp: int, group: int = 0) -> None:
        self.keys = keys
        """Block hashes, parent first."""
        self.depth = depth
        """Position of ``keys[0]`` in its sequence."""
        self.parent = parent
        """Hash of the page before ``keys[0]`` (None at a sequence start)."""
        self.stamp = stamp
        """Stamp of ``keys[-1]`` (evicted first); ``keys[i]`` has ``stamp + len(keys) - 1 - i``."""
        self.group = group
        """Eviction group of every page of the run (the pool's ``queues[group]`` holds it)."""
        self.prev: Any = None
        self.next: Any = None
        self.lazy = False
        """:class:`BranchRunHostPool`: the run's pages are not yet in its queued-page set
        (``_queued``): they entered the queue since the set was last read."""


_PINNED, _RUN, _MISSING = 0, 1, 2


class _HostQueueView(_RunQueueView):
    """``RunHostPool.evictable``: the unpinned blocks in eviction order (read only)."""

    def __len__(self) -> int:
        return self._pool.used - self._pool.pinned

    def __contains__(self, h: int) -> bool:
        return any(h in r.keys for q in self._pool.queues for r in q)

    def ordered(self) -> list[_BlockView]:
        """Every queued block in eviction order, group 0 first (O(n); for checks and tests)."""
        out = []
        for q in self._pool.queues:
            for r in q:
                keys = r.keys
                last = len(keys) - 1
                g = r.group
                for i in range(last, -1, -1):
                    p = keys[i - 1] if i else r.parent
                    out.append(_BlockView(keys[i], p, pinned=False, last_access=r.stamp + last - i, depth=r.depth + i, count=g, group=g))
        return out


class RunHostPool:
    """L2 for one-group policies (``lru``), stored as runs: pinned pages are L1's pages
    (counted here, kept by L1), unpinned pages are runs in one LRU queue.

    Args:
        capacity: blocks (``profile.host_blocks``).
        block_size: tokens per block.
        events: the shared outbox.
        gpu: the node's L1 (pinned ⇔ in L1).
        policy: a one-group eviction policy (``lru``).

    Raises:
        ValueError: on non-positive sizes or a policy with more than one group.

    The operations, stamps and events of the per-block pool of the reference
    model (``tests/unit/worker/ref_blocks.py``, checked by
    ``tests/property/test_worker_blocks_model.py``) under ``lru``.
    ``update_counts`` only validates (under one group, counts move nothing and
    nothing else reads them).
    """

    tier: Tier = "host"

    def __init__(
        self, capacity: int, block_size: int, events: list[KvEvent], gpu: GpuBlockPool, policy: EvictionPolicy | None = None
    ) -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("capacity and block_size must be > 0")
        self.policy: EvictionPolicy = policy or LruPolicy()
        if self.policy.groups != 1 and type(self) is RunHostPool:
            raise ValueError("RunHostPool serves one-group policies; use BranchRunHostPool")
        self.capacity = capacity
        self.block_size = block_size
        self.events = events
        self.gpu = gpu
        self.first: dict[int, _HostRun] = {}
        """Unpinned runs by first hash. The run holding an unpinned page whose parent is not in
        the same run starts with that page, so a path is matched run by run."""
        self.members: set[int] = set()
        """Every L2 hash (pinned or not); changes only when a page enters or leaves L2. Not kept
        by :class:`BranchRunHostPool` (its L2 pages are its queued-page set and L1's pages)."""
        self.queues = [_RunQueue() for _ in range(self.policy.groups)]
        """Unpinned runs per eviction group, oldest first; group 0 is evicted first."""
        self.queue = self.queues[0]
        self.pinned = 0
        """Pinned pages (= L1 pages once a fill has been written through)."""
        self._stamp = 0
        self.prefixes: dict[int, list[Any]] = {}
        """Holds kept whole: last hash → ``[held pages (a path prefix, root first), number of
        holds]``. A page is held if it is held here or in :attr:`held`; eviction skips held
        pages in place. Holds are path prefixes, so inside a run the held pages are its shallow
        end (but see :meth:`_evict_free`). Empty while a broken hold is owed (:attr:`broken`)."""
        self.held: dict[int, int] = {}
        """Holds kept per page (hash → number of holds): those taken while a broken hold was
        owed, and the whole ones spread here (:meth:`_spread`) before a hold breaks or an
        unhold names other pages than a whole hold, as the per-page model counts them."""
        self.broken: dict[int, int] = {}
        """Holds broken by a write-through (hash → unholds still owed by their holders)."""
        self._stored_at: dict[int, tuple[int, int]] | None = None
        """Where :meth:`_written` only records a write-through's run as first hash → (path
        position, length), at most :data:`_STORES_KEPT` (``BranchRunHostPool._stored``, once
        its counts are kept in L1's runs): :meth:`store` records it there itself, without the
        call. None: :meth:`store` calls :meth:`_written`."""

    @property
    def used(self) -> int:
        """Pages in L2: pinned (L1's) plus queued. (:meth:`store`, :meth:`store_fetched` and
        ``EngineScheduler.state`` compute it inline: a property read costs a Python call.)"""
        n = self.pinned
        for q in self.queues:
            n += q.blocks
        return n

    @property
    def holds(self) -> dict[int, int]:
        """Every held page → its number of holds (whole and per page), as the per-block
        model counts them. A copy, O(held pages); for checks and tests."""
        out = dict(self.held)
        for keys, c in self.prefixes.values():
            for h in keys:
                out[h] = out.get(h, 0) + c
        return out

    def hold(self, hashes: Sequence[int], limit: int | None = None) -> list[int]:
        """Hold the present leading pages of ``hashes[:limit]`` (a path prefix, parent first;
        the whole of ``hashes`` when ``limit`` is None); returns them (stops at the first absent
        page) as a new list that the pool keeps too: the caller must not change it. They are
        found as L1's prefix and the runs after it, O(runs), and the hold is kept whole, under
        its last hash (chained hashes: the last page names the prefix), O(1) beyond the one
        list copy returned (the same list, so :meth:`unhold` of it is O(1)). While a broken
        hold is owed, holds are counted per page instead, in C (``collections.Counter``'s
        counting loop, on the plain dict)."""
        n = len(hashes) if limit is None else min(limit, len(hashes))
        return self._hold(hashes, self._match_runs(hashes, self.gpu.match_prefix(hashes, n), n))

    def _hold(self, hashes: Sequence[int], m: int) -> list[int]:
        """:meth:`hold` of ``hashes[:m]``, every one of them present (the caller just found them:
        :meth:`KvBlockManager.match_hold`), without the walk that finds them."""
        out = hashes[:m]
        if type(out) is not list:
            out = list(out)
        if not m:
            return out
        if self.broken:
            _count_elements(self.held, out)
            return out
        rec = self.prefixes.get(out[-1])
        if rec is None:
            self.prefixes[out[-1]] = [out, 1]  # the list returned: never changed, by the pool or the caller
        elif len(rec[0]) == m:
            rec[1] += 1
        else:  # not a chain (the last page names another prefix): per page
            _count_elements(self.held, out)
        return out

    def unhold(self, hashes: Sequence[int]) -> None:
        """Drop one hold of each of ``hashes`` (as :meth:`hold` returned them); a hold that
        was broken meanwhile is settled without touching a later holder's. O(1) for a hold
        kept whole (the list :meth:`hold` returned, or an equal one: O(pages) in C); else
        O(pages), after spreading the whole holds per page."""
        if not hashes:
            return
        prefixes = self.prefixes
        if prefixes:
            rec = prefixes.get(hashes[-1])
            if rec is not None and (rec[0] is hashes or rec[0] == hashes):
                if rec[1] > 1:
                    rec[1] -= 1
                else:
                    del prefixes[hashes[-1]]
                return
            self._spread()
        _unhold(self.held, self.broken, hashes)

    def _spread(self) -> None:
        """Count every whole hold per page in :attr:`held` (before a hold breaks, or an unhold
        that names other pages). O(pages of the whole holds), in C."""
        held = self.held
        for keys, c in self.prefixes.values():
            for _ in range(c):
                _count_elements(held, keys)
        self.prefixes.clear()

    def _whole_held(self, r: _HostRun) -> int:
        """How many shallow pages of queued run ``r`` a whole hold covers (a held prefix holding
        a page of ``r`` holds the pages above it too). O(whole holds)."""
        keys = r.keys
        d = r.depth
        h0 = keys[0]
        best = 0
        for p, _c in self.prefixes.values():
            m = len(p)
            if m > d and p[d] == h0:
                k = _common(keys, p, d, m)
                if k > best:
                    best = k
        return best

    def _free_tail(self, r: _HostRun, lim: int) -> int:
        """How many of the deepest pages of ``r`` (at most ``lim``) are not held."""
        keys = r.keys
        size = len(keys)
        if self.prefixes:
            lim = min(lim, size - self._whole_held(r))
        held = self.held
        t = 0
        while t < lim and keys[size - 1 - t] not in held:
            t += 1
        return t

    def _evict_free(self, r: _HostRun, c: int, lim: int, out: list[int]) -> int:
        """Evict up to ``lim`` pages of ``r.keys[c:]`` that are not held, deepest first, into
        ``out``; returns how many. Held pages are a path prefix, so inside a run they are its
        shallow end and the unheld ones its deep end (cut in one step), except where a broken
        hold's page was stored again: it is unheld above held pages (:meth:`_evict_holes`)."""
        keys = r.keys
        size = len(keys)
        t = self._free_tail(r, min(size - c, lim))
        if t:
            self._cut_tail(r, t, out)
        if t == lim or t == size or not self.broken or self.broken.keys().isdisjoint(keys[c:]):
            return t
        return t + self._evict_holes(r, c, lim - t, out)

    def _evict_holes(self, r: _HostRun, c: int, lim: int, out: list[int]) -> int:
        """:meth:`_evict_free` past held pages: up to ``lim`` unheld pages of ``r.keys[c:]``
        deepest first; the pages left stay in place as runs, with their stamps. O(run). Only
        reached while a broken hold is owed, so every hold is counted per page."""
        keys = r.keys
        holds = self.held
        size = len(keys)
        gone: list[int] = []
        for i in range(size - 1, c - 1, -1):
            if keys[i] not in holds:
                gone.append(i)
                if len(gone) == lim:
                    break
        if not gone:
            return 0
        out.extend(keys[i] for i in gone)
        q = self.queues[r.group]
        prev = r.prev
        q.unlink(r)
        del self.first[keys[0]]
        q.blocks -= len(gone)
        cuts = [size, *gone, -1]  # the pieces left lie between the evicted pages, deepest first
        for b, a in zip(cuts, cuts[1:]):
            a += 1
            if a < b:
                piece = _HostRun(keys[a:b], r.depth + a, keys[a - 1] if a else r.parent, r.stamp + size - b, r.group)
                q.insert_after(prev, piece)
                prev = piece
                self.first[keys[a]] = piece
        return len(gone)

    def _index(self, r: _HostRun) -> None:
        """The pages of run ``r`` entered the queue (a subclass records them)."""

    def _evicted(self, evicted: list[int]) -> None:
        """The pages ``evicted`` left L2."""
        self.members.difference_update(evicted)

    def _added(self, run: list[int], depth: int) -> None:
        """The pages ``run`` (new, parent first, the first at path position ``depth``) entered L2."""
        self.members.update(run)

    def _written(self, run: list[int], depth: int) -> None:
        """The pages ``run`` (new, parent first, the first at path position ``depth``) entered L2
        by a write-through (pinned); the list is the one the ``BlockStored(host)`` event carries."""
        self._added(run, depth)

    def _members(self) -> set[int]:
        """Every L2 page (pinned or not): :attr:`members` itself, O(1); not to be changed."""
        return self.members

    @property
    def evictable(self) -> _HostQueueView:
        return _HostQueueView(self)

    def __contains__(self, h: int) -> bool:
        return h in self.members

    def absent(self, hashes: Iterable[int]) -> list[int]:
        """The pages of ``hashes`` not in L2 (pinned or not), in their order. O(pages), one set
        probe each."""
        members = self.members
        return [h for h in hashes if h not in members]

    # -- walks ------------------------------------------------------------ #

    def _next_start(self, path: Sequence[int], pos: int, n: int) -> int:
        """Smallest ``j`` in ``(pos, n)`` where an unpinned run starts with ``path[j]``, else n."""
        first = self.first
        if not first or pos + 1 >= n or first.keys().isdisjoint(path[pos + 1 : n]):
            return n
        j = pos + 1
        while path[j] not in first:
            j += 1
        return j

    def _match_runs(self, path: Sequence[int], pos: int, n: int) -> int:
        """End of the consecutive unpinned pages of ``path`` from ``pos`` (below ``n``)."""
        first = self.first
        while pos < n:
            r = first.get(path[pos])
            if r is None:
                break
            keys = r.keys
            end = pos + len(keys)
            if end <= n and path[end - 1] == keys[-1]:  # _common's O(1) case, inline: the whole run
                pos = end
                continue
            pos += _common(keys, path, pos, n)
        return pos

    def _locate(self, path: Sequence[int], n: int) -> list[tuple[int, int, int, _HostRun | None]]:
        """``path[:n]`` as pieces ``(start, end, kind, run)``: the L1 prefix (pinned), unpinned
        runs (each piece is the leading part of its run) and missing stretches."""
        g = self.gpu.match_prefix(path, n)
        out: list[tuple[int, int, int, _HostRun | None]] = [(0, g, _PINNED, None)] if g else []
        first = self.first
        pos = g
        while pos < n:
            r = first.get(path[pos])
            if r is not None:
                e = pos + _common(r.keys, path, pos, n)
                out.append((pos, e, _RUN, r))
            else:
                e = self._next_start(path, pos, n)
                out.append((pos, e, _MISSING, None))
            pos = e
        return out

    def _take_shallow(self, r: _HostRun, c: int) -> None:
        """Remove the first ``c`` pages of ``r`` from the queue (pinned, or moved)."""
        keys = r.keys
        first = self.first
        del first[keys[0]]
        q = self.queues[r.group]
        q.blocks -= c
        if c >= len(keys):  # q.unlink(r), inline
            p, nx = r.prev, r.next
            p.next = nx
            nx.prev = p
            r.prev = r.next = None
            return
        r.parent = keys[c - 1]
        del keys[:c]
        r.depth += c
        first[keys[0]] = r

    def _cut_tail(self, r: _HostRun, t: int, out: list[int]) -> None:
        """Evict the ``t`` deepest pages of run ``r`` (0 < t ≤ its size) into ``out``, deepest first."""
        keys = r.keys
        size = len(keys)
        out.extend(reversed(keys[size - t :]))
        q = self.queues[r.group]
        q.blocks -= t
        if t == size:
            q.unlink(r)
            del self.first[keys[0]]
        else:
            del keys[size - t :]
            r.stamp += t

    def _evict(self, e: int, out: list[int]) -> None:
        """Evict ``e`` pages from the head of the queue (group 0 first; deepest first inside a
        run), skipping held pages; if only held pages are left, from the head regardless (holds
        broken)."""
        if self.held or self.prefixes:
            for q in self.queues:
                r = q.first()
                while r is not None and e > 0:
                    nxt = r.next if r.next is not q.head else None
                    e -= self._evict_free(r, 0, e, out)
                    r = nxt
            if e > 0:
                n0 = len(out)
                self._evict_head(e, out)
                self._spread()
                for h in out[n0:]:
                    _break_hold(self.held, self.broken, h)
            return
        self._evict_head(e, out)

    def _evict_head(self, e: int, out: list[int]) -> None:
        for q in self.queues:
            while e > 0:
                r = q.first()
                if r is None:
                    break
                t = len(r.keys)
                if e < t:
                    t = e
                self._cut_tail(r, t, out)
                e -= t
        if e > 0:
            raise KvInvariantError("host pool full of pinned blocks (host capacity < GPU capacity?)")

    def _push(self, keys: list[int], depth: int, parent: int | None, group: int = 0, entering: bool = True) -> _HostRun:
        """Queue ``keys`` (parent first) as the newest run of ``group``, stamped deepest first.
        ``entering``: the pages were not queued (False: they move, already queued)."""
        r = _new(_HostRun)  # _HostRun(...) without its __init__ frame (one per run queued): every slot set here
        r.keys = keys
        r.depth = depth
        r.parent = parent
        r.stamp = self._stamp + 1
        r.group = group
        r.lazy = False
        self._stamp += len(keys)
        q = self.queues[group]
        h = q.head  # q.append(r), inline (one per run queued)
        t = h.prev
        r.prev = t
        r.next = h
        t.next = r
        h.prev = r
        q.blocks += len(keys)
        self.first[keys[0]] = r
        if entering:
            self._index(r)
        return r

    # -- queries ---------------------------------------------------------- #

    def match_from(self, path: Sequence[int], start: int, limit: int) -> int:
        """Number of consecutive blocks ``path[start:limit]`` present in L2. O(runs)."""
        n = len(path)
        if limit < n:
            n = limit
        if start >= n:
            return 0
        g = self.gpu.match_prefix(path, n)
        if start <= g:
            return self._match_runs(path, g, n) - start
        for s, e, kind, _ in self._locate(path, n):
            if s <= start < e:
                return 0 if kind == _MISSING else self._match_runs(path, e, n) - start
        return 0

    def match_after_l1(self, path: Sequence[int], start: int, limit: int) -> int:
        """:meth:`match_from` where ``start`` is the end of the path's L1 prefix. O(runs)."""
        n = len(path)
        if limit < n:
            n = limit
        if start >= n:
            return 0
        return self._match_runs(path, start, n) - start

    # -- mutations -------------------------------------------------------- #

    def store(self, path: Sequence[int], lo: int, hi: int) -> None:
        """Write through the pages ``path[lo:hi]`` that just became resident in L1.

        Present (unpinned) pages are pinned; missing ones are inserted pinned,
        evicting the oldest unpinned blocks when full. Emits ``BlockRemoved(host)``
        for the evictions and one ``BlockStored(host)`` per run of new pages.
        O(runs + new pages).
        """
        first = self.first
        evicted: list[int] = []
        runs: list[tuple[int, int]] = []
        start = -1
        pos = lo
        new = 0
        while pos < hi:
            r = first.get(path[pos]) if first else None
            if r is not None:
                c = _common(r.keys, path, pos, hi)
                if r.group:
                    self._restored(path, pos, pos + c, hi)
                self._take_shallow(r, c)
                self.pinned += c
                if start >= 0:
                    runs.append((start, pos))
                    start = -1
                pos += c
                continue
            # _next_start(path, pos, hi), its usual answer without the frame: no unpinned run starts
            # after pos on the path (the write-through of pages just computed)
            if not first or pos + 1 >= hi or first.keys().isdisjoint(path[pos + 1 : hi]):
                nxt = hi
            else:
                nxt = self._next_start(path, pos, hi)
            k = nxt - pos
            e = self.pinned + k - self.capacity  # self.used + k - capacity, without the property call
            for q in self.queues:
                e += q.blocks
            if e > 0:
                self._evict(e, evicted)
            self.pinned += k
            new += k
            if start < 0:
                start = pos
            pos = nxt
        if start >= 0:
            runs.append((start, hi))
        if evicted:
            self._evicted(evicted)
            self.events.append(BlockRemoved(block_hashes=evicted, tier="host"))
        bs = self.block_size
        at = self._stored_at
        for s, e in runs:
            run = path[s:e]
            if type(run) is not list:
                run = list(run)
            if at is not None:  # self._written(run, s) without its frame (one per write-through)
                if len(at) >= _STORES_KEPT:
                    at.clear()
                at[run[0]] = (s, len(run))
            else:
                self._written(run, s)
            self.events.append(BlockStored(block_hashes=run, parent_block_hash=path[s - 1] if s else None, tier="host", block_size=bs))

    def _restored(self, path: Sequence[int], lo: int, e: int, hi: int) -> None:
        """The queued pages ``path[lo:e]`` of a counted group (> 0) are restored to L1 (its pages
        ``path[:hi]`` resident): a subclass that keeps counts in L1's runs records them."""

    def unpin_runs(self, runs: Sequence[tuple[list[int], int, int | None, Sequence[tuple[int, int]]]]) -> None:
        """The runs L1 evicted (``GpuBlockPool.evicted_runs``, each deepest first) become
        evictable here, in that order. O(runs)."""
        for keys, depth, parent, _ in runs:
            self.pinned -= len(keys)
            self._push(keys, depth, parent)

    def store_fetched(self, path: Sequence[int], lo: int, hi: int) -> int:
        """Insert pages ``path[lo:hi]`` pulled from a peer's L2 (not in L1: unpinned).

        Pages already present are left as they are. Room is made by evicting
        the lowest-key unpinned blocks other than the pages of ``path[:hi]``
        (the request's own prefix) and held pages (another queued request's
        fetched prefix: a fetch never breaks a hold); if too few are left, the
        deepest new pages are not stored (the request recomputes them). New pages
        (count 0: group 0) are stamped deepest first and their queued ancestors in
        their group restamped after them, so eviction stays leaf-first. Emits
        ``BlockRemoved(host)`` for evictions and one ``BlockStored(host)`` per run
        of new pages. Returns the pages stored. O(runs + pages of the path).
        """
        n = len(path)
        if hi < n:
            n = hi
        if lo >= n:
            return 0
        ranges = [(max(s, lo), e) for s, e, kind, _ in self._locate(path, n) if kind == _MISSING and e > lo]
        n_new = sum(e - s for s, e in ranges)
        if not n_new:
            return 0
        need = self.pinned + n_new - self.capacity  # self.used + n_new - capacity, without the property call
        for q in self.queues:
            need += q.blocks
        evicted: list[int] = []
        holds = self.held or self.prefixes
        for q in self.queues:  # group 0 first
            r = q.first()
            while r is not None and need > 0:
                nxt = r.next if r.next is not q.head else None
                keys = r.keys
                d = r.depth
                c = _common(keys, path, d, n) if d < n and path[d] == keys[0] else 0
                t = len(keys) - c
                if need < t:
                    t = need
                if t > 0 and holds:
                    need -= self._evict_free(r, c, t, evicted)
                elif t > 0:
                    self._cut_tail(r, t, evicted)
                    need -= t
                r = nxt
        if need > 0:  # not enough room: the deepest new pages are not stored
            while need > 0:
                s, e = ranges[-1]
                if e - s <= need:
                    ranges.pop()
                    need -= e - s
                else:
                    ranges[-1] = (s, e - need)
                    need = 0
        if evicted:
            self._evicted(evicted)
            self.events.append(BlockRemoved(block_hashes=evicted, tier="host"))
        if not ranges:
            return 0
        stored = 0
        for s, e in reversed(ranges):  # deepest run first, each stamped deepest first
            self._push(list(path[s:e]), s, path[s - 1] if s else None)
            stored += e - s
        for x, _e in reversed(ranges):  # lifts, deepest first
            if x:
                self._lift(path, x)
        bs = self.block_size
        for s, e in ranges:
            run = list(path[s:e])
            self._added(run, s)
            self.events.append(BlockStored(block_hashes=run, parent_block_hash=path[s - 1] if s else None, tier="host", block_size=bs))
        return stored

    def _lift(self, path: Sequence[int], x: int) -> None:
        """If ``path[x - 1]`` is unpinned, in the group of ``path[x]`` and older, move the
        unpinned chain of that group above ``x`` to its queue's tail, nearest first (each
        stamped newer than the page below it: eviction inside a group stays leaf-first)."""
        pieces = self._locate(path, x + 1)
        cs, _ce, _ck, child = pieces[-1]  # path[x]: unpinned (stored or lifted in this call)
        if cs < x or len(pieces) < 2 or pieces[-2][2] != _RUN:
            return  # same run as its parent (a lift made the parent newer), parent pinned or not in L2
        assert child is not None
        del pieces[-1]
        s, e, _, r = pieces[-1]
        assert r is not None
        g = child.group
        if r.group != g or r.stamp + len(r.keys) - 1 - (x - 1 - s) >= child.stamp + len(child.keys) - 1:
            return
        i = len(pieces) - 1
        while i > 0 and pieces[i - 1][2] == _RUN and pieces[i - 1][3].group == g:  # type: ignore[union-attr]
            i -= 1
        y = pieces[i][0]
        for s, e, _, r in pieces[i:]:
            self._take_shallow(r, e - s)  # type: ignore[arg-type]
        self._push(list(path[y:x]), y, path[y - 1] if y else None, g)

    def update_counts(self, hashes: Sequence[int], counts: Sequence[int], chains: Sequence[tuple[int | None, int]] | None = None) -> int:
        """Branch counts from the KV directory: under a one-group policy they move nothing
        (and nothing reads them), so they are only validated (``chains`` is not read). Returns 0.

        Raises:
            ValueError: if ``hashes`` and ``counts`` differ in length.
        """
        if len(hashes) != len(counts):
            raise ValueError(f"{len(hashes)} hashes but {len(counts)} counts")
        return 0

    def reset_counts(self) -> int:
        """Every count back to 0: under a one-group policy there are none. Returns 0."""
        return 0

    def snapshot(self) -> list[int]:
        """Every L2 hash: the pinned (L1) ones, then the unpinned ones in eviction order. O(n)."""
        return self.snapshot_parents()[0]

    def snapshot_parents(self) -> tuple[list[int], list[int | None]]:
        """:meth:`snapshot` and each block's parent hash (None at a sequence start). O(n)."""
        hashes, parents = self.gpu.snapshot_parents()
        for q in self.queues:
            for r in q:
                hashes.extend(r.keys)
                parents.append(r.parent)
                parents.extend(r.keys[:-1])
        return hashes, parents

    # -- views for checks and tests ------------------------------------- #

    @property
    def blocks(self) -> dict[int, _BlockView]:
        """Every L2 block as ``hash → view`` (pinned ones from L1). A copy, O(n)."""
        out: dict[int, _BlockView] = {}
        for h, v in self.gpu.blocks.items():
            out[h] = _BlockView(h, v.parent, pinned=True, depth=v.depth)
        for v in self.evictable.ordered():
            out[v.hash] = v
        return out

    def view(self) -> tuple[dict[int, Any], list[Any]]:
        """``(hash → block, queued blocks in eviction order)`` for checks."""
        return self.blocks, self.evictable.ordered()

    def check_structure(self) -> None:
        """Run invariants (O(n)): first-hash index, stamps, counts, membership (:meth:`_members`).

        Raises:
            KvInvariantError: naming the first one that fails.
        """
        seen: set[int] = set()
        n_runs = 0
        r: _HostRun  # what the queues hold (they iterate as Any)
        for g, q in enumerate(self.queues):
            total = 0
            last_stamp = 0
            for r in q:
                n_runs += 1
                if not r.keys:
                    raise KvInvariantError("empty L2 run")
                if r.group != g:
                    raise KvInvariantError(f"L2 run {r.keys[0]} of group {r.group} queued in group {g}")
                if self.first.get(r.keys[0]) is not r:
                    raise KvInvariantError(f"L2 run {r.keys[0]} not indexed by its first hash")
                if r.stamp <= last_stamp:
                    raise KvInvariantError(f"L2 run {r.keys[0]} stamped {r.stamp} after {last_stamp}")
                last_stamp = r.stamp + len(r.keys) - 1
                for h in r.keys:
                    if h in seen:
                        raise KvInvariantError(f"L2 block {h} in two runs")
                    seen.add(h)
                total += len(r.keys)
            if total != q.blocks:
                raise KvInvariantError(f"L2 queue {g} counts {q.blocks} blocks, runs hold {total}")
        if len(self.first) != n_runs:
            raise KvInvariantError(f"L2 first-hash index has {len(self.first)} runs")
        if self.pinned != self.gpu.hashed:
            raise KvInvariantError(f"L2 counts {self.pinned} pinned blocks, L1 holds {self.gpu.hashed}")
        gpu = set(self.gpu.snapshot())
        if seen & gpu:
            raise KvInvariantError(f"L2 blocks both pinned and queued: {sorted(seen & gpu)[:5]}")
        if self._members() != seen | gpu:
            raise KvInvariantError("L2 membership set out of sync")


# --------------------------------------------------------------------------- #
# L2, runs (branch-count: two groups)
# --------------------------------------------------------------------------- #


def _agree(keys: list[int], off: int, seq: Sequence[int], i: int, n: int) -> int:
    """Length of the common prefix of ``keys[off:]`` and ``seq[i:n]``, given ``keys[off] ==
    seq[i]``. ``seq`` is any list of hashes (a count message, not a path), so equal last
    pages do not imply equal stretches: slices of doubling length are compared, O(length)
    in C and O(log length) Python steps (a message in no order costs O(1) per entry)."""
    size = len(keys) - off
    if n - i < size:
        size = n - i
    k = 1
    step = 4
    while k < size:
        e = k + step
        if size < e:
            e = size
        a = keys[off + k : off + e]
        b = seq[i + k : i + e]
        if a != b:
            return k + next(compress(count(), map(ne, a, b)))
        k = e
        step += step
    return size


def _along(keys: list[int], off: int, chain: Sequence[int], i: int, n: int) -> int:
    """Length of the common prefix of ``keys[off:]`` and ``chain[i:n]``, given ``keys[off] ==
    chain[i]``, where both are consecutive pages of one sequence with chained ids (a page's id
    names its ancestors, so once they differ they differ to the end): a binary search, O(log
    length) compares."""
    lo = 1
    hi = len(keys) - off
    if n - i < hi:
        hi = n - i
    if keys[off + hi - 1] == chain[i + hi - 1]:
        return hi
    while hi - lo > 1:  # keys[off + lo - 1] agrees, keys[off + hi - 1] does not
        mid = (lo + hi) // 2
        if keys[off + mid - 1] == chain[i + mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


def _stretches(flags: list[bool]) -> Iterator[tuple[int, int, bool]]:
    """``(i, j, flag)`` for each maximal stretch ``flags[i:j]`` of one value, in order; one
    C-level ``list.index`` per stretch."""
    n = len(flags)
    i = 0
    while i < n:
        g = flags[i]
        try:
            j = flags.index(not g, i)
        except ValueError:
            j = n
        yield i, j, g
        i = j


_STORES_KEPT = 4096
"""Stored runs :class:`BranchRunHostPool` keeps the path positions and lengths of (then forgets them
all; no page list is kept, so the record is O(this) whatever the runs' lengths): the
directory re-sends a store's counts in the drain right after it (``ClusterSim._flush_kv``), so a
few are enough; a re-send found in none goes the per-entry way."""

_RESTART = 24
"""A queued stretch of a count message at least this long is skipped by restarting the lookup
after it (O(1), a list iterator set to its end) instead of looking its entries up (~45 ns each)."""


class BranchRunHostPool(RunHostPool):
    """L2 under ``branch-count`` (paper §5.3: group ``1[R_b > 0]`` first, LRU inside each),
    stored as runs: :class:`RunHostPool` with two queues of runs, one per group.

    Args:
        capacity: blocks (``profile.host_blocks``).
        block_size: tokens per block.
        events: the shared outbox.
        gpu: the node's L1 (pinned ⇔ in L1).
        policy: the ``branch-count`` policy.

    Raises:
        ValueError: on non-positive sizes or another policy.

    Same operations, stamps and events as the per-block pool of the reference model
    (``tests/unit/worker/ref_blocks.py``). Every page of a queued run is in the run's group;
    a page's count matters only as 0 vs > 0, kept for every L2 page (pinned ones too) in
    :attr:`counted`. :attr:`queued` tells the queued pages of a count message apart, and each
    stretch of them (consecutive entries that are consecutive pages of one run) is found as a
    run by its first hash (:meth:`_run_of`), so a count message is applied stretch by stretch,
    not block by block. From the first count message with chains on, neither set is kept: the
    L1 pages' counts are their runs' counted intervals (:attr:`_counted`).
    """

    def __init__(
        self, capacity: int, block_size: int, events: list[KvEvent], gpu: GpuBlockPool, policy: EvictionPolicy | None = None
    ) -> None:
        policy = policy or BranchCountPolicy()
        if not isinstance(policy, BranchCountPolicy):
            raise ValueError(f"BranchRunHostPool serves the branch-count policy, not {policy.name!r}")
        super().__init__(capacity, block_size, events, gpu, policy)
        self._queued: set[int] | None = set()
        """Every queued (unpinned) page but those of the runs in :attr:`_lazy` (:attr:`queued`
        is the whole set); None once count messages come with their chains (:meth:`update_counts`:
        no set kept, a count message's queued pages are found run by run). A set, not a page → run map: a page moving between runs (a count
        message's moves, a lift, a cut run) stays in it untouched; a run is found by its first
        hash (most stretches of a directory message start one), else by a scan of the runs
        (:meth:`_run_of`, :meth:`_run_at`)."""
        self._lazy: list[_HostRun] = []
        """Runs queued since the set was last read (each flagged ``lazy``), whose pages are not
        in :attr:`_queued` yet: they enter it when it is next read (:meth:`_flush`), so the
        pages that leave the queue before that (restored to L1, evicted) never enter or leave
        it. The pages L1 evicts and later restores are most queued pages (at 64-token blocks
        ~4.2M of 5.5M in a 600-s evolving run); the set is read by a count message that may
        name a queued page, ~4 s apart per node there (1,438 in 600 s on 9 nodes)."""
        self._lazy_pages = 0
        """Pages of the runs in :attr:`_lazy` when each was queued: the list is flushed once
        they pass twice L2's capacity (:meth:`_index`), as the runs that left the queue keep
        their keys until then."""
        self._counted: set[int] | None = set()
        """:attr:`counted`, less the discards still owed to :attr:`_fresh` (read it through
        :attr:`counted` or after :meth:`_settle`). None once count messages come with chains
        (:meth:`_to_intervals`): then an L1 page's count is kept in its run's counted intervals
        (:attr:`_GpuRun.counted`, set per chain and carried by L1's splits, merges and evictions:
        O(runs changed) per message and per unpin, not O(pages)), a queued page's is its group,
        and a page in neither tier has none (it is never read: a page entering L2 counts 0)."""
        self._fresh: list[list[int]] = []
        """Runs written through since the last count message or L1 eviction, whose pages still
        owe their discard from :attr:`_counted` (a page stored counts 0). The directory
        re-sends a host store's counts at once, in the store's order (``BranchTable._resend``),
        so the next count message is often one such run with every page named: it decides
        those pages' counts itself, and the discard is dropped (:meth:`_settle`); all its pages
        are pinned (L1 evicted nothing since), so it names no queued page either. In a 300-s
        evolving run at 64-token blocks, 4,118 of 8,027 messages (384K of 4.38M entries; 1.02M
        pages written through) were such a run."""
        self._stored: dict[int, tuple[int, int]] = {}
        """Once count messages come with chains (no queued-page set): the runs stored in L2 lately
        (written through or fetched) as first hash → (path position, length) (:meth:`_store_depth`);
        no page list is kept, so a record holds no evicted page's id alive."""
        del self.members  # not kept: L2's pages are :attr:`queued` and L1's (:meth:`_members`)

    # -- run bookkeeping with the queued-page set -------------------------- #

    def _take_shallow(self, r: _HostRun, c: int) -> None:
        queued = self._queued
        if queued is not None and not r.lazy:
            keys = r.keys
            queued.difference_update(keys if c >= len(keys) else islice(keys, c))
        super()._take_shallow(r, c)

    def _index(self, r: _HostRun) -> None:
        if self._queued is None:
            return
        lazy = self._lazy
        n = self._lazy_pages + len(r.keys)
        # bounded while the set goes unread: in runs (dead ones) and in the pages they keep
        if n > 2 * self.capacity or len(lazy) > 2 * len(self.first) + 1024:
            self._flush()
            n = len(r.keys)
        self._lazy_pages = n
        r.lazy = True
        lazy.append(r)

    def _evicted(self, evicted: list[int]) -> None:
        if self._queued is not None:
            self._queued.difference_update(evicted)  # a page of a lazy run is not in it: no change

    def _evict_holes(self, r: _HostRun, c: int, lim: int, out: list[int]) -> int:
        if r.lazy:  # the pieces left are new runs: give them their pages in the set first
            self._flush()
        return super()._evict_holes(r, c, lim, out)

    def _flush(self) -> None:
        """Put the pages of the runs in :attr:`_lazy` that are still queued into
        :attr:`_queued` (a run left the queue when its first hash no longer names it: its keys
        are those it had when it left). O(their pages) in C."""
        first = self.first
        queued = self._queued
        assert queued is not None  # runs are listed lazy only while the set is kept
        for r in self._lazy:
            if r.lazy:
                r.lazy = False
                keys = r.keys
                if keys and first.get(keys[0]) is r:
                    queued.update(keys)
        self._lazy.clear()
        self._lazy_pages = 0

    @property
    def queued(self) -> set[int]:
        """Every queued (unpinned) page: the set itself, once the runs queued since it was
        last read are put in (:meth:`_flush`); not to be changed. Where no set is kept (count
        messages come with chains): a new set of the queued runs' pages, O(queued pages)."""
        queued = self._queued
        if queued is None:
            return {h for q in self.queues for r in q for h in r.keys}
        if self._lazy:
            self._flush()
        return queued

    def _added(self, run: list[int], depth: int) -> None:
        counted = self._counted
        if counted is None:  # counts in L1's runs and in groups: a page entering L2 counts 0 there
            self._store_depth(run, depth)
        else:
            counted.difference_update(run)  # fetched pages: none is in a run of :attr:`_fresh` (pinned)

    def _written(self, run: list[int], depth: int) -> None:
        if self._counted is None:  # the new L1 pages start with no counted interval (GpuBlockPool.fill)
            stored = self._stored  # _store_depth(run, depth) without its frame (one per write-through)
            if len(stored) >= _STORES_KEPT:
                stored.clear()
            stored[run[0]] = (depth, len(run))
        else:
            self._fresh.append(run[:])  # a copy: the event's list is the consumers' too

    def _restored(self, path: Sequence[int], lo: int, e: int, hi: int) -> None:
        """:meth:`RunHostPool._restored`: once counts are kept in L1's runs, the pages ``path[lo:e]``
        are counted there (their run of L1 holds ``path[hi - 1]`` last, as :meth:`GpuBlockPool.fill`
        just made it; else the path's runs are walked from the root). O(runs holding them)."""
        if self._counted is not None:  # the set keeps them (a queued page of group 1 is in it)
            return
        gpu = self.gpu
        r = gpu.ends.get(path[hi - 1])
        if r is None or r.depth + len(r.keys) != hi:
            runs, _ = gpu._cover(path, hi)
            r = runs[-1]
        while r is not None and r.depth + len(r.keys) > lo:
            d = r.depth
            a = lo - d if lo > d else 0
            b = e - d
            if b > len(r.keys):
                b = len(r.keys)
            if a < b:
                r.counted = _ivl_set(r.counted, a, b, True)
            r = r.parent

    def _store_depth(self, run: list[int], depth: int) -> None:
        """Keep the path position and length of a run just stored, by its first hash, for the
        directory's re-send of its counts (a chain of unknown position in a count message's chains,
        :meth:`_chain_moves`); at most :data:`_STORES_KEPT` kept (O(1) space each). The pages
        themselves are not kept: the chains come only from a directory with chained ids, where a
        page's id fixes its whole path, so a chain starting at the run's first page lies at the
        run's position."""
        stored = self._stored
        if len(stored) >= _STORES_KEPT:
            stored.clear()
        stored[run[0]] = (depth, len(run))

    @property
    def counted(self) -> set[int]:
        """Pages whose last count from the directory is > 0: every such L2 page (pinned or
        not), and maybe pages not in L2 (a count is taken as sent, without a membership
        test). A page entering L2 leaves this set (a page stored counts 0 until the directory
        re-sends), so only L2 pages' entries are ever read; the others are dropped when they
        outnumber L2's pages (:meth:`_count`). The set itself, once the discards owed to
        :attr:`_fresh` are made (O(their pages)). Once counts are kept in L1's runs (count
        messages with chains): a new set of the counted L1 pages and the queued pages of group 1
        (L2 pages only), O(L2 pages); changing it changes nothing."""
        counted = self._counted
        if counted is None:
            out = {h for r in self.queues[1] for h in r.keys}
            for r in self.gpu.ends.values():
                for a, b in r.counted:
                    out.update(r.keys[a:b])
            return out
        self._settle()
        return counted

    def _settle(self, message: Sequence[int] | None = None) -> bool:
        """Make the discards owed to the runs of :attr:`_fresh` and empty it, except for a run
        equal to ``message`` (a count message about to be applied: it names each of the run's
        pages, so their counts are its own). Returns whether one was (O(1) per run of another
        length, a list compare else: identity per entry for the directory's re-send)."""
        fresh = self._fresh
        if not fresh:
            return False
        hit = False
        counted = self._counted
        assert counted is not None  # runs are owed discards only while the set is kept
        for run in fresh:
            if message is not None and len(run) == len(message) and run == message:
                hit = True
            else:
                counted.difference_update(run)
        fresh.clear()
        return hit

    def _members(self) -> set[int]:
        """Every L2 page: the queued ones and L1's (pinned). A new set, O(pages): L2 keeps no set
        of every page (the one :class:`RunHostPool` keeps cost one set insert and one delete per
        page entering and leaving L2, ~1.5% of a 64-token ``evolving`` run, for reads that are
        rare here: a :attr:`counted` trim, checks, and a failed real-bytes fetch)."""
        return self.queued | self.gpu.pages()

    def __contains__(self, h: int) -> bool:
        """O(1) for a queued page while the queued-page set is kept, else O(queued pages) (once
        count messages come with chains, :attr:`queued` is built per read); plus O(L1 pages) for a
        page not queued (a walk of L1's runs)."""
        return h in self.queued or h in self.gpu

    def absent(self, hashes: Iterable[int]) -> list[int]:
        """The pages of ``hashes`` not in L2 (pinned or not), in their order. O(pages) set probes,
        plus O(queued pages) once where no queued-page set is kept (count messages with chains:
        :attr:`queued` is built), plus O(L1 pages) once if any is not queued (L1's pages gathered
        into a set)."""
        queued = self.queued
        rest = [h for h in hashes if h not in queued]
        if rest:
            l1 = self.gpu.pages()
            rest = [h for h in rest if h not in l1]
        return rest

    def _run_of(self, h: int) -> _HostRun:
        """The run holding queued page ``h``: the run it starts (a dict probe), else the run it
        ends (O(runs) Python steps), else a scan of the runs (O(queued pages) in C). In a 600-s
        evolving run at 64-token blocks, of ~4,900 stretches of count messages 180 did not
        start a run, and 132 of those ended one."""
        r = self.first.get(h)
        if r is not None:
            return r
        for q in self.queues:
            for r in q:
                if r.keys[-1] == h:
                    return r
        for q in self.queues:
            for r in q:
                if h in r.keys:
                    return r
        raise KvInvariantError(f"L2 page {h} is queued in no run")

    def _run_at(self, h: int, d: int, g: int | None = None) -> _HostRun | None:
        """The run holding queued page ``h`` at depth ``d``: the run it starts, else the run of
        group ``g`` (any group when None) covering depth ``d`` with ``h`` there; None if no run
        of group ``g`` holds it. O(runs) Python steps past the dict probe."""
        r = self.first.get(h)
        if r is not None:
            return r if g is None or r.group == g else None
        for q in self.queues if g is None else (self.queues[g],):
            end = q.head  # the queue's links walked here, not by its generator (a resume per run)
            r = end.next
            while r is not end:
                o = d - r.depth
                if 0 <= o < len(r.keys) and r.keys[o] == h:
                    return r
                r = r.next
        if g is None:
            raise KvInvariantError(f"L2 page {h} (depth {d}) is queued in no run")
        return None

    def _count(self, hashes: Sequence[int], counts: Sequence[int]) -> None:
        """Set :attr:`counted` from a count message, in message order (a page named twice
        ends with its last count): one C-level set update per stretch of entries on one side
        of 0 (a message from the directory has at most a few: each change's zeros are a tail).
        A message with no 0 (most of them) is told by ``all(counts)``, a truth test per count
        (~51 instructions each, against ~111 for the equality test of ``list.count(0)`` on a
        positive count; a 0 is the cached int, which ``list.count`` and ``list.index`` match by
        identity, ~10). Pages not in L2 are not filtered out here; once :attr:`counted` holds
        more than twice L2's pages (+ 1024; L2's pages are the pinned ones and the queued ones),
        it is cut to L2's pages (:meth:`_members`: O(its size + L2's), amortised O(1) per entry)."""
        counted = self._counted
        assert counted is not None  # (a pool keeping counts in L1's runs: :meth:`_count_l1`)
        if all(counts):  # counts are >= 0 (shared.validate refuses a negative one)
            counted.update(hashes)
        else:
            n = len(hashes)
            zeros = counts.count(0)
            if zeros == n:
                counted.difference_update(hashes)
            else:
                z = counts.index(0)
                e = z + zeros
                if e == n or counts[z:e].count(0) == zeros:  # one block of zeros (the usual mixed message)
                    counted.update(hashes[:z])
                    counted.difference_update(hashes[z:e])
                    counted.update(hashes[e:])
                else:
                    for i, j, g in _stretches(list(map(bool, counts))):
                        (counted.update if g else counted.difference_update)(islice(hashes, i, j))
        if len(counted) > 2 * self.used + 1024:
            counted.intersection_update(self._members())

    def _excise(self, r: _HostRun, o: int, k: int) -> None:
        """Take ``r.keys[o:o + k]`` out of ``r``'s queue (they move: the caller queues them again,
        so they stay in :attr:`queued`). The pages left keep their stamps and queue place: a
        deep rest and a shallow rest stay two runs, the smaller one new."""
        keys = r.keys
        size = len(keys)
        if o == 0:
            RunHostPool._take_shallow(self, r, k)
            return
        q = self.queues[r.group]
        q.blocks -= k
        end = o + k
        if end == size:  # the deep end: r keeps the shallow rest, whose stamps follow its deep end's
            del keys[o:]
            r.stamp += k
            return
        first = self.first
        if o <= size - end:  # the shallow rest becomes a new run, just newer than r
            up = _HostRun(keys[:o], r.depth, r.parent, r.stamp + size - o, r.group)
            first[keys[0]] = up
            r.parent = keys[end - 1]
            r.depth += end
            del keys[:end]
            first[keys[0]] = r
            q.insert_after(r, up)
        else:  # the deep rest becomes a new run, just older than r
            down = _HostRun(keys[end:], r.depth + end, keys[end - 1], r.stamp, r.group)
            first[down.keys[0]] = down
            del keys[o:]
            r.stamp += size - o
            q.insert_after(r.prev, down)

    def _lift_above(self, run: _HostRun) -> None:
        """Stamp the queued ancestors of ``run`` (just pushed: the newest) in its group newer,
        nearest first, up to the first one that is pinned, absent or in the other group
        (every such ancestor is older than ``run``). O(runs)."""
        g = run.group
        queued = self._queued  # read after :meth:`_flush` (:meth:`update_counts`); None: no set, runs scanned
        p = run.parent
        d = run.depth - 1
        pieces: list[tuple[_HostRun, int]] = []
        ends = self.gpu.ends if queued is None else None
        while p is not None and (queued is None or p in queued):
            if ends is not None and p in ends:  # an L1 page (a run of L1 ends with it): pinned, queued in no group
                break  # (1,311 of the 1,573 ancestors not found, each a scan of the group's runs, per 600 s at 512)
            r = self._run_at(p, d, g)
            if r is None:
                break
            pieces.append((r, d - r.depth + 1))
            p = r.parent
            d = r.depth - 1
        if pieces:
            self._requeue([(r, 0, c) for r, c in reversed(pieces)], d + 1, p, g)

    def _requeue(self, pieces: list[tuple[_HostRun, int, int]], depth: int, parent: int | None, g: int) -> _HostRun:
        """Queue the pages ``r.keys[o:o + k]`` of ``pieces`` (distinct runs; consecutive pages
        of one sequence, root side first) as the newest run of group ``g``, stamped deepest
        first. The largest piece that is a whole run keeps its run object and keys list, so only
        the other pieces' pages are copied (a lift of a long stretch moves O(runs), and repeated
        lifts copy each page O(log) times, as union by size); no page's queued-set entry changes."""
        best = -1
        size = 0
        for x, (r, o, k) in enumerate(pieces):
            if k > size and o == 0 and k == len(r.keys):
                best, size = x, k
        if best < 0:
            keys: list[int] = []
            for r, o, k in pieces:
                keys.extend(r.keys[o : o + k])
                self._excise(r, o, k)
            return self._push(keys, depth, parent, g, entering=False)
        keep = pieces[best][0]
        left: list[int] = []
        right: list[int] = []
        for x, (r, o, k) in enumerate(pieces):
            if x != best:
                (left if x < best else right).extend(r.keys[o : o + k])
                self._excise(r, o, k)
        q = self.queues[keep.group]
        q.unlink(keep)
        q.blocks -= size
        first = self.first
        keys = keep.keys
        del first[keys[0]]
        if left:
            keys[:0] = left
        if right:
            keys.extend(right)
        keep.depth = depth
        keep.parent = parent
        keep.group = g
        keep.stamp = self._stamp + 1
        self._stamp += len(keys)
        q = self.queues[g]
        q.append(keep)
        q.blocks += len(keys)
        first[keys[0]] = keep
        return keep

    # -- mutations -------------------------------------------------------- #

    def unpin_runs(self, runs: Sequence[tuple[list[int], int, int | None, Sequence[tuple[int, int]]]]) -> None:
        """The runs L1 evicted (``GpuBlockPool.evicted_runs``, each deepest first) become
        evictable here, in that order, each page in the group of its count: a run is pushed
        whole, or in pieces where the counts cross 0. O(runs + pieces), membership in C; once
        counts are kept in L1's runs, the pieces are the run's counted intervals and the gaps
        between them (no page looked up)."""
        counted = self._counted
        if counted is None:
            for keys, depth, parent, iv in runs:
                size = len(keys)
                self.pinned -= size
                if not iv:
                    self._push(keys, depth, parent, 0)
                    continue
                if iv[0][0] == 0 and iv[0][1] == size:
                    self._push(keys, depth, parent, 1)
                    continue
                pos = size  # pieces deepest first: each interval, after the gap below it
                for a, b in reversed(iv):
                    if b < pos:
                        self._push(keys[b:pos], depth + b, keys[b - 1], 0)
                    self._push(keys[a:b], depth + a, keys[a - 1] if a else parent, 1)
                    pos = a
                if pos:
                    self._push(keys[:pos], depth, parent, 0)
            return
        if self._fresh:
            self._settle()
        for keys, depth, parent, _ in runs:
            self.pinned -= len(keys)
            if not counted or counted.isdisjoint(keys):
                self._push(keys, depth, parent, 0)
                continue
            if counted.issuperset(keys):
                self._push(keys, depth, parent, 1)
                continue
            size = len(keys)
            for i, j, g in _stretches(list(map(counted.__contains__, reversed(keys)))):  # deepest first
                s, e = size - j, size - i  # keys[s:e], pushed deepest piece first
                self._push(keys[s:e], depth + s, keys[s - 1] if s else parent, 1 if g else 0)

    def reset_counts(self) -> int:
        """Every L2 page's count back to 0, as when the KV directory restarts (``CountUpdates.epoch``
        changes): its counts start empty and it sends only changes, so a count it sent before would
        never come back as 0 and would keep its pages in the protected group for good.

        The counted group's queued pages move to the other group as one count message naming them in
        queue order (oldest run first, each run root side first) with count 0 would
        (:meth:`update_counts`); pinned pages forget their count. O(pages counted). Returns the
        blocks moved.
        """
        hashes = [h for r in self.queues[1] for h in r.keys]
        moved = self.update_counts(hashes, [0] * len(hashes)) if hashes else 0
        if self._counted is None:
            for r in self.gpu.ends.values():
                r.counted = _NONE
        else:
            self.counted.clear()
        return moved

    def update_counts(self, hashes: Sequence[int], counts: Sequence[int], chains: Sequence[tuple[int | None, int]] | None = None) -> int:
        """Apply branch counts R[b, node] from the KV directory (``CountUpdates``).

        The move rule (worker README; the reference model's ``HostBlockPool.update_counts``
        is its per-block definition): a block named twice counts once (its last count, at
        its first place); unknown hashes are ignored; the queued blocks whose group changes
        (count crossing 0) are cut into chains (a moved block continues the chain of the
        moved block before it in the message when it is that block's child and goes to the
        same group); chain by chain, in message order, each chain moves to the tail of its
        new group deepest first (stamped like an access), then its older queued ancestors in
        that group are restamped newer, nearest first (a parent is never evicted before its
        child). A drain cut into messages anywhere moves as in one message: a cut splits at
        most one chain, and the lift of the second part restamps the first part behind it.
        Returns the blocks moved.

        O(stretches + chains + runs lifted) Python steps; per named block only C-level work
        (an index lookup, set updates, slice compares).

        ``chains`` (an in-process directory with chained ids: the simulator, ``ClusterSim._flush_counts``):
        the message as chains ``[(path position of the first entry, length), ...]`` end to end, each
        consecutive pages of one sequence, parent first. Then a chain's queued pages are found run by
        run (:meth:`_chain_moves`: its first entry by the run it starts or a scan of the runs by
        depth, each later one as a run start, since a queued page whose parent is the entry before it
        continues that entry's run), so the pool keeps no queued-page set from the first such message
        on (:attr:`queued` is built when read), and no counted-page set either: the counts of the L1
        pages go to their runs' counted intervals (:meth:`_to_intervals`, :meth:`_count_l1`), also for
        a later message without chains. The moves and counts are those of the message without
        ``chains`` when the chains are right (as the directory's are, with chained ids: a wrong depth
        of a chain's first entry inside a run is not seen); a message whose chains name a queued page
        twice, or give an entry that starts a run another depth, goes the per-entry way.

        Raises:
            ValueError: if ``hashes`` and ``counts`` differ in length, or ``chains`` do not cover
                ``hashes``.
        """
        n = len(hashes)
        if n != len(counts):
            raise ValueError(f"{n} hashes but {len(counts)} counts")
        if chains is not None and (chains[0][1] if len(chains) == 1 else sum(map(_SECOND, chains))) != n:  # (one chain: the usual)
            raise ValueError(f"chains cover {sum(map(_SECOND, chains))} entries of {n}")
        if not n:
            return 0
        if chains is not None and self._counted is not None:
            self._to_intervals()
        if self._counted is None:  # counts in L1's runs and in groups
            if type(hashes) is not list:
                hashes = list(hashes)
            m, chains = self._count_l1(hashes, counts, chains)
            if m == n:  # every entry is an L1 page: pinned here, queued nowhere
                return 0
            if chains is not None:
                found = self._chain_moves(hashes, counts, chains, m)
                if found is not None:
                    return self._apply_moves(hashes, found)
            # the per-entry way, with the set of the message's queued entries
            named = set(islice(hashes, m, None) if m else hashes)
            return self._entry_moves(hashes, counts, n, m, named.intersection(chain.from_iterable([r.keys for q in self.queues for r in q])))
        pinned = self._settle(hashes) if self._fresh else False  # a run just written through: every page named is pinned
        self._count(hashes, counts)
        if pinned:
            return 0
        if type(hashes) is not list:
            hashes = list(hashes)
        # the usual message names no queued page: nothing moves. One that starts at an L1 root (a
        # branch's path placed here) names L1's pages first, pinned, so only the entries past
        # them are looked up; one whose entries (past that prefix) end at an L1 run's last page
        # and match L1 run by run up to their first names L1's pages only
        m = self._l1_prefix(hashes, n) if hashes[0] in self.gpu.roots else 0
        if m == n or (hashes[-1] in self.gpu.ends and self._l1_suffix(hashes, m, n)):
            return 0
        return self._entry_moves(hashes, counts, n, m, self.queued)

    def update_stored_counts(self, hashes: list[int], counts: list[int]) -> int:
        """:meth:`update_counts` of the directory's re-send of a host store's counted blocks as one
        chain at the store's position, ``update_counts(hashes, counts, [(None, len(hashes))])``
        (the simulator's ``ClusterSim._resend_counts``): the usual one — every count > 0, the
        pages of a run this pool stored (:meth:`_store_depth`), all in L1 — sets their runs'
        counted intervals (:meth:`_chain_l1`) with no message checks and no :meth:`_count_l1`
        loop; any other goes through :meth:`update_counts` (the intervals already set are set
        again, which changes nothing). Returns the blocks moved (none in the usual case).

        Raises:
            ValueError: as :meth:`update_counts`.
        """
        n = len(hashes)
        if n and n == len(counts) and all(counts) and self.stored_counted(hashes):
            return 0
        return self.update_counts(hashes, counts, [(None, n)])

    def stored_counted(self, hashes: list[int]) -> bool:
        """:meth:`update_stored_counts`' usual case, which needs no count values: ``hashes`` (not
        empty) are the directory's re-send of a host store's counted blocks as one chain at the
        store's position, every count > 0 (the simulator's ``ClusterSim._resend_chain``, the
        directory's ``BranchTable.resend_chain_sink``). When counts are kept in L1's runs and the
        pages are of a run this pool stored, all in L1, sets their runs' counted intervals
        (:meth:`_chain_l1`) and returns True: nothing moves. Else returns False (possibly with
        some intervals set, which :meth:`update_counts` sets again): the caller then applies
        ``update_counts(hashes, counts, [(None, len(hashes))])``."""
        if self._counted is not None:
            return False
        rec = self._stored.get(hashes[0])
        if rec is None:
            return False
        d0 = rec[0]
        if d0:  # _chain_l1's usual case without its frame: the last entry ends L1 run r, which holds them all
            r = self.gpu.ends.get(hashes[-1])
            if r is not None:
                keys = r.keys
                end = len(keys)
                o = d0 - r.depth
                if o >= 0 and end - len(hashes) == o and keys[o] == hashes[0]:
                    iv = r.counted  # _mark(r, o, end - o, counts, 0, True) without its frame
                    if len(iv) == 1:
                        a, b = iv[0]
                        if a <= o and end <= b:
                            return True
                        if o <= b and a <= end:  # overlapping or touching: one interval
                            r.counted = ((a if a < o else o, b if b > end else end),)
                            return True
                    r.counted = _ivl_set(iv, o, end, True)
                    return True
        n = len(hashes)
        return self._chain_l1(hashes, _ONES, 0, n, d0, True) == n

    def _to_intervals(self) -> None:
        """Keep counts in L1's runs from now on (the first count message with chains): each L1
        run's counted pages become its counted intervals (O(L1 pages) once), and the pool drops its
        counted-page set and its queued-page set (a chain's queued pages are found run by run)."""
        self._settle()
        counted = self._counted
        assert counted is not None
        for r in self.gpu.ends.values():
            keys = r.keys
            if counted.isdisjoint(keys):
                continue
            r.counted = [(i, j) for i, j, g in _stretches(list(map(counted.__contains__, keys))) if g]
        self._counted = None
        self._stored_at = self._stored  # _written records a run's position only: store does it inline
        for x in self._lazy:
            x.lazy = False
        self._lazy.clear()
        self._lazy_pages = 0
        self._queued = None

    def _count_l1(
        self, hashes: list[int], counts: Sequence[int], chains: Sequence[tuple[int | None, int]] | None
    ) -> tuple[int, Sequence[tuple[int | None, int]] | None]:
        """Set the counted intervals of the L1 pages a count message names (message order: a page
        named twice ends with its last count). Chain by chain (:meth:`_chain_l1`, O(runs) Python
        steps each): a chain's L1 pages are a prefix of it (L1 holds every ancestor of its pages,
        and a chain's entries are consecutive pages of one sequence); a message without chains, or
        whose chains do not fit L1, page by page (:meth:`_count_l1_entries`, O(L1 pages) in C).
        A chain of unknown position (a cut's tail of a store's chain) is placed where L1 holds it
        (:meth:`_l1_depth`). Returns how many leading entries are L1 pages (so queued nowhere;
        ``len(hashes)``: all), and ``chains`` with the positions so placed (a new list if any)."""
        if chains is not None:
            on = all(counts)  # the usual message: every count > 0 (a truth test per count, as in _count)
            m = 0
            lead = True
            i = 0
            stored = self._stored
            placed: list[tuple[int | None, int]] | None = None
            for c, (d0, size) in enumerate(chains):
                end = i + size
                if d0 is None and hashes[i] not in stored:  # a cut's tail of a store's chain: placed by L1
                    d0 = self._l1_depth(hashes, i, end)
                    if d0 is not None:
                        if placed is None:
                            placed = list(chains)
                        placed[c] = (d0, size)
                j = self._chain_l1(hashes, counts, i, end, d0, on)
                if j < 0:
                    break
                if lead:
                    m += j
                    lead = j == size
                i = end
            else:
                return m, chains if placed is None else placed
        self._count_l1_entries(hashes, counts)
        return 0, chains

    def _chain_l1(self, hashes: list[int], counts: Sequence[int], i: int, end: int, d0: int | None, on: bool) -> int:
        """:meth:`_count_l1` of one chain ``hashes[i:end]`` (path position ``d0`` of its first
        entry; None: a store's re-sent head, at the store's position if the pool knows it). The
        chain's ids are chained (the directory's: a page's id names its place, so a page ends its
        chain's stretch of an L1 run when it is the run's page at that depth): its L1 prefix is
        found from L1's roots (``d0 == 0``); else, when its last entry ends an L1 run
        (:attr:`GpuBlockPool.ends`), up from there to the chain's first entry, depths checked, and
        down that run's children; else by a scan of L1's runs (O(runs), ~30 per node at 64-token
        blocks) for the run holding the first entry at its depth, and down from there. Each run's
        stretch is one interval update (:meth:`_mark`); ``on``: every count of the message is > 0.
        Returns the chain's L1 pages (a prefix), or -1 if it does not fit L1 (an entry at another
        depth) or its position is unknown."""
        gpu = self.gpu
        if d0 is None:
            rec = self._stored.get(hashes[i])
            if rec is not None:
                d0 = rec[0]
        if d0 == 0:
            return self._l1_down(hashes, counts, i, end, gpu.roots, on) - i
        ends = gpu.ends
        r = ends.get(hashes[end - 1])
        if r is None and d0 is not None:  # the run holding the first entry at its depth, if any
            h = hashes[i]
            for r in ends.values():
                o = d0 - r.depth
                if 0 <= o < len(r.keys) and r.keys[o] == h:
                    keys = r.keys
                    k = _along(keys, o, hashes, i, end)
                    self._mark(r, o, k, counts, i, on)
                    below = r.children
                    if o + k == len(keys) and below and i + k < end:
                        return self._l1_down(hashes, counts, i + k, end, below, on) - i
                    return k
            return 0  # not in L1: nor is any later entry (its descendants)
        if r is None:  # at an unknown position (:meth:`_l1_depth` found none)
            return -1
        # the last entry ends L1 run r: every entry is a page above it, depth by depth
        di = r.depth + len(r.keys) - (end - i)  # the depth of hashes[i]
        if di < 0 or (d0 is not None and di != d0):
            return -1
        top: _GpuRun | None = r
        while top is not None:
            d = top.depth
            keys = top.keys
            if d <= di:
                o = di - d
                if keys[o] != hashes[i]:
                    return -1
                self._mark(top, o, len(keys) - o, counts, i, on)
                break
            if keys[0] != hashes[i + d - di]:
                return -1
            self._mark(top, 0, len(keys), counts, i + d - di, on)
            top = top.parent
        if top is None:
            return -1
        return end - i

    def _l1_depth(self, hashes: list[int], i: int, end: int) -> int | None:
        """The path position of the first entry of chain ``hashes[i:end]`` found in L1: from the
        first entry that ends an L1 run (probed in C), else from the run holding the first entry
        (a scan of L1's runs, O(L1 pages) in C); None if neither is there. For a chain of unknown
        position (a cut's tail of a store's chain, position None): in a 600-s evolving run at
        64-token blocks, 10 such tails of 4,096 entries lay inside one L1 run, and found no place
        they cost a walk of every L1 and queued page each (:meth:`_count_l1_entries`, the
        per-entry way)."""
        ends = self.gpu.ends
        x = next(compress(count(i), map(ends.__contains__, islice(hashes, i, end))), end)
        if x < end:
            r = ends[hashes[x]]
            return r.depth + len(r.keys) - 1 - (x - i)
        h = hashes[i]
        for r in ends.values():
            keys = r.keys
            if h in keys:
                return r.depth + keys.index(h)
        return None

    def _l1_down(self, hashes: list[int], counts: Sequence[int], pos: int, end: int, children: dict[int, _GpuRun], on: bool) -> int:
        """Count the L1 pages ``hashes[pos:q]`` of a chain that go on from ``children`` (L1's roots,
        or the children of the run holding the page before ``hashes[pos]``) down L1's runs, each
        run's stretch one interval update; returns ``q``. A run is the chain's whole when its last
        page is the chain's page there (chained ids), else the chain leaves it where
        :func:`_along` finds. O(runs on the way) Python steps."""
        while pos < end:
            r = children.get(hashes[pos])
            if r is None:
                return pos
            keys = r.keys
            k = len(keys)
            if pos + k <= end and hashes[pos + k - 1] == keys[-1]:
                iv = r.counted
                if not (on and len(iv) == 1 and iv[0][0] == 0 and iv[0][1] >= k):  # else counted whole: _mark sets nothing
                    self._mark(r, 0, k, counts, pos, on)
                pos += k
                below = r.children
                if below is None:
                    return pos
                children = below
                continue
            k = _along(keys, 0, hashes, pos, end)
            self._mark(r, 0, k, counts, pos, on)
            return pos + k
        return pos

    @staticmethod
    def _mark(r: _GpuRun, o: int, k: int, counts: Sequence[int], p: int, on: bool) -> None:
        """Set the counted intervals of L1 run ``r``'s pages ``[o, o + k)`` from ``counts[p:p + k]``
        (> 0: counted; ``on``: all of them are). O(intervals + stretches of one sign)."""
        iv = r.counted
        if on:
            if len(iv) == 1:  # _ivl_set's usual case, inline (~18,000 of 26,514 calls at 512)
                a, b = iv[0]
                e = o + k
                if a <= o and e <= b:
                    return
                if o <= b and a <= e:  # overlapping or touching: one interval
                    r.counted = ((a if a < o else o, b if b > e else e),)
                    return
            r.counted = _ivl_set(iv, o, o + k, True)
            return
        seg = counts[p : p + k]
        if all(seg):
            r.counted = _ivl_set(iv, o, o + k, True)
        elif seg.count(0) == k:
            if iv:
                r.counted = _ivl_set(iv, o, o + k, False)
        else:
            for a, b, g in _stretches(list(map(bool, seg))):
                iv = _ivl_set(iv, o + a, o + b, g)
            r.counted = iv

    def _count_l1_entries(self, hashes: list[int], counts: Sequence[int]) -> None:
        """:meth:`_count_l1` page by page: each named page's last count (a dict of the message,
        O(entries)), the L1 runs holding a named page found by an ``isdisjoint`` probe of each run
        (O(L1 pages) probes in C, nothing built per page), then those runs' counted intervals
        rebuilt (O(their pages))."""
        last = dict(zip(hashes, counts))
        named = last.keys()
        for r in self.gpu.ends.values():
            keys = r.keys
            if named.isdisjoint(keys):
                continue
            flags = [False] * len(keys)
            for a, b in r.counted:
                flags[a:b] = [True] * (b - a)
            flags = [f if c is None else c > 0 for f, c in zip(flags, map(last.get, keys))]
            r.counted = [(a, b) for a, b, g in _stretches(flags) if g] or _NONE

    def _entry_moves(self, hashes: list[int], counts: Sequence[int], n: int, m: int, queued: set[int]) -> int:
        """:meth:`update_counts` past the L1 prefix ``hashes[:m]``: the queued entries found one by
        one in ``queued`` (the queued-page set, or where none is kept the message's queued entries:
        O(queued pages) probes in C), the moves made. Returns the blocks moved."""
        if queued.isdisjoint(islice(hashes, m, None) if m else hashes):
            return 0
        moves = self._moves(hashes, counts, n, queued)
        if moves is None:  # a queued page named twice: the last count, at its first place
            last = dict(zip(hashes, counts))
            hashes, counts = list(last), list(last.values())
            moves = self._moves(hashes, counts, len(hashes), queued)
            assert moves is not None
        return self._apply_moves(hashes, moves)

    def _apply_moves(self, hashes: list[int], moves: list[tuple[int, int, int, int, int | None, int, int]]) -> int:
        """Make the moves of a count message (:meth:`_moves`' stretches, in message order), chain by
        chain, each then lifted (:meth:`update_counts`' rule). Returns the blocks moved."""
        if not moves:
            return 0
        moved = 0
        c0 = 0
        for c in range(len(moves)):
            if c + 1 < len(moves):
                nxt = moves[c + 1]
                if nxt[4] == moves[c][5] and nxt[3] == moves[c][3]:
                    continue  # the next stretch goes on below this one: one chain
            chain = moves[c0 : c + 1]
            c0 = c + 1
            h, d, k, g, p, _l, _i = chain[0]
            if len(chain) == 1:
                r = self._run_at(h, d)
                if r is None:  # _moves found it queued
                    raise KvInvariantError(f"queued page {h} at depth {d} is in no L2 run")
                o = d - r.depth
                if o + k <= len(r.keys) and r.keys[o + k - 1] == _l:
                    run = self._requeue([(r, o, k)], d, p, g)
                else:  # an earlier chain's lift cut the run the stretch was found in
                    run = self._requeue(self._pieces(hashes, _i, d, k), d, p, g)
                moved += k
            else:
                pieces = [pc for x in chain for pc in self._pieces(hashes, x[6], x[1], x[2])]
                if len(set(map(id, (x[0] for x in pieces)))) == len(pieces):
                    run = self._requeue(pieces, d, p, g)
                else:  # two stretches of one run (the message skipped between them): one by one
                    keys: list[int] = []
                    for x in chain:
                        for r, o, m in self._pieces(hashes, x[6], x[1], x[2]):
                            keys.extend(r.keys[o : o + m])
                            self._excise(r, o, m)
                    run = self._push(keys, d, p, g, entering=False)
                moved += sum(x[2] for x in chain)
            self._lift_above(run)
        return moved

    def _chain_moves(
        self, hashes: list[int], counts: Sequence[int], chains: Sequence[tuple[int | None, int]], start: int
    ) -> list[tuple[int, int, int, int, int | None, int, int]] | None:
        """:meth:`_moves` of the entries ``hashes[start:]`` of a message given as ``chains`` (see
        :meth:`update_counts`), found run by run with no queued-page set: in each chain, its first
        entry (from ``start``) is queued if it starts a run (a dict probe) or lies in one at its
        depth (a scan of the runs, O(runs) Python steps; a chain at position None is a store's
        re-sent head, at the store's position if the pool still knows a store starting at its first
        entry at least as long as the chain, else None is returned); every later queued entry either continues
        the run of the entry before it (its parent: compared in a slice, :func:`_agree`) or starts
        a run, found in C (``first`` probes, the entries of a stretch not probed). None if an entry
        does not lie at its chain's depth in the run it starts (the chains do not fit the pool) or
        a queued page is named twice: the caller takes the per-entry way. Only reads the pool."""
        first = self.first
        moves: list[tuple[int, int, int, int, int | None, int, int]] = []
        spans: dict[_HostRun, list[tuple[int, int]]] = {}
        i = 0
        for d0, size in chains:
            end = i + size
            if end <= start:
                i = end
                continue
            if d0 is None:  # a store's counted head: its position from the store
                rec = self._stored.get(hashes[i])
                if rec is None or size > rec[1]:
                    return None
                d0 = rec[0]
            pos = start if i < start else i
            h = hashes[pos]
            r = first.get(h)
            if r is None:  # inside a run, if queued: the run holding it at its depth
                d = d0 + pos - i
                for q in self.queues:
                    for x in q:
                        o = d - x.depth
                        if 0 <= o < len(x.keys) and x.keys[o] == h:
                            r = x
                            break
                    if r is not None:
                        break
            while True:
                if r is None:  # hashes[pos] is not queued: the next entry that starts a run
                    pos = next(compress(count(pos + 1), map(first.__contains__, islice(hashes, pos + 1, end))), end)
                    if pos >= end:
                        break
                    r = first[hashes[pos]]
                keys = r.keys
                off = d0 + pos - i - r.depth
                if not 0 <= off < len(keys) or keys[off] != hashes[pos]:
                    return None
                k = _agree(keys, off, hashes, pos, end)
                span = spans.get(r)
                if span is None:
                    spans[r] = [(off, k)]
                else:
                    span.append((off, k))
                g = r.group
                seg = counts[pos : pos + k]
                if not g and all(seg):
                    z = 0
                else:
                    z = seg.count(0)
                if z == (k if g else 0):  # every block of the stretch crosses 0
                    moves.append((hashes[pos], r.depth + off, k, 1 - g, keys[off - 1] if off else r.parent, hashes[pos + k - 1], pos))
                elif z != (0 if g else k):  # some do: their sub-stretches, block by block
                    a = -1
                    for x in range(k + 1):
                        crosses = x < k and (counts[pos + x] == 0) == bool(g)
                        if crosses and a < 0:
                            a = x
                        elif not crosses and a >= 0:
                            o = off + a
                            moves.append(
                                (keys[o], r.depth + o, x - a, 1 - g, keys[o - 1] if o else r.parent, keys[off + x - 1], pos + a)
                            )
                            a = -1
                pos += k
                if pos >= end:
                    break
                r = first.get(hashes[pos])  # a queued page after the stretch starts a run (its parent ends one or is not queued)
            i = end
        for span in spans.values():
            if len(span) > 1:
                span.sort()
                for (o1, k1), (o2, _k2) in zip(span, span[1:]):
                    if o1 + k1 > o2:
                        return None
        return moves

    def _l1_prefix(self, hashes: list[int], n: int) -> int:
        """A count of leading entries of count message ``hashes[:n]`` that are L1 pages (so pinned
        here, queued nowhere): L1's runs are walked from its roots along the message, each run
        compared with the entries at its place in one slice compare (a message is any list of
        hashes, not a path, so an equal last page proves nothing); the walk stops at the first run
        that does not match whole. O(runs on the way) Python steps, O(entries matched) in C, a
        few instructions per entry, where :meth:`update_counts`' ``isdisjoint`` probe of an entry
        absent from :attr:`queued` costs ~130 (cachegrind; block ids of a converted trace are
        near-sequential integers, which cluster in a set's linearly probed table). In a 300-s
        evolving run at 64-token blocks, 1,181 of the 2,940 count messages that were not a
        written-through run were L1 paths from a root (1.17M of their 2.95M entries)."""
        pos = 0
        children = self.gpu.roots
        while True:
            r = children.get(hashes[pos])
            if r is None:
                return pos
            keys = r.keys
            end = pos + len(keys)
            if end >= n:  # the message ends in this run
                return n if hashes[pos:n] == keys[: n - pos] else pos
            if hashes[pos:end] != keys:
                return pos
            pos = end
            below = r.children
            if below is None:
                return pos
            children = below

    def _l1_suffix(self, hashes: list[int], m: int, n: int) -> bool:
        """Whether every entry of ``hashes[m:n]`` (not empty) is an L1 page (so pinned here,
        queued nowhere), shown by matching the entries from the last one upward against L1's
        runs: the run ``hashes[n - 1]`` ends (:attr:`GpuBlockPool.ends`), then its parent run,
        and so on, each compared with the entries at its place in one slice compare, until the
        entries are used up; False as soon as one run does not match, or the runs reach a root
        with entries left (which may still be L1 pages elsewhere: the caller looks them up).
        Exact for any list of hashes. O(runs on the way) Python steps, O(entries) in C. In a
        600-s evolving run at 64-token blocks (260 CC sessions, 9 nodes), 1,618 of the 2,352
        messages that read the queued-page set past an L1-root prefix were such a list (0.96M
        entries): each read an ``isdisjoint`` probe per entry (~130 instructions for an absent
        one) and filled the set with the runs queued since the last read (:meth:`_flush`)."""
        end = n
        r: _GpuRun | None = self.gpu.ends.get(hashes[n - 1])
        while r is not None:
            keys = r.keys
            k = len(keys)
            if end - m <= k:  # the entries left end in this run
                return hashes[m:end] == keys[k - (end - m) :]
            if hashes[end - k : end] != keys:
                return False
            end -= k
            r = r.parent
        return False

    def _moves(
        self, hashes: list[int], counts: Sequence[int], n: int, queued_set: set[int]
    ) -> list[tuple[int, int, int, int, int | None, int, int]] | None:
        """The stretches of queued pages a count message moves (their group changes), in
        message order, as ``(first hash, its depth, length, new group, parent hash, last hash,
        index of the first in the message)``; None if the message names a queued page twice
        (the caller keeps each page's last count at its first place and asks again).

        Only reads the pool. The queued entries are found lazily in C (probes of ``queued_set``: the
        queued pages, or at least the message's queued entries), each
        stretch (consecutive entries that are consecutive pages of one run) as the run its first
        entry starts or lies in (:meth:`_run_of`) and a slice compare (:func:`_agree`); a
        stretch of at least :data:`_RESTART` entries restarts the probes after it. A page named
        twice but not queued moves nothing, so it needs no de-duplication (the moved pages, their
        order and counts are those of the de-duplicated message); a queued one named twice is
        found as two overlapping stretches of one run, O(stretches) Python steps instead of a
        set of the whole message (~1.16M entries per 300 s of the 64-token evolving run)."""
        # stretches of moved blocks: (first hash, its depth, length, new group, parent hash, last hash,
        # its index in the message)
        moves: list[tuple[int, int, int, int, int | None, int, int]] = []
        places: dict[_HostRun, dict[int, int]] = {}
        spans: dict[_HostRun, list[tuple[int, int]]] = {}  # each run's stretches: (offset, length)
        queued = compress(count(), map(queued_set.__contains__, hashes))  # lazily, in C
        while True:
            i = next(queued, -1)
            if i < 0:
                break
            h = hashes[i]
            r = self._run_of(h)
            keys = r.keys
            if keys[0] == h:
                off = 0
            else:  # a stretch from inside a run: its place by a scan, or a map once a run has two
                pm = places.get(r)
                if pm is None:
                    off = keys.index(h)
                    places[r] = {}
                else:
                    if not pm:
                        pm = places[r] = dict(zip(keys, range(len(keys))))
                    off = pm[h]
            k = _agree(keys, off, hashes, i, n)
            span = spans.get(r)
            if span is None:
                spans[r] = [(off, k)]
            else:
                span.append((off, k))
            if k >= _RESTART:  # the stretch's other entries are queued: look on after it
                rest = iter(hashes)
                rest.__setstate__(i + k)  # type: ignore[attr-defined]  # a list iterator's: start at i + k, no copy
                queued = compress(count(i + k), map(queued_set.__contains__, rest))
            elif k > 1:  # a short stretch: skip its entries in C
                _drain(islice(queued, k - 1))
            g = r.group
            seg = counts[i : i + k]
            if not g and all(seg):  # no 0 (one truth test per count, as in :meth:`_count`)
                z = 0
            else:
                z = seg.count(0)
            if z == (k if g else 0):  # every block of the stretch crosses 0
                moves.append((h, r.depth + off, k, 1 - g, keys[off - 1] if off else r.parent, hashes[i + k - 1], i))
            elif z != (0 if g else k):  # some do: their sub-stretches, block by block
                a = -1
                for x in range(k + 1):
                    crosses = x < k and (counts[i + x] == 0) == bool(g)
                    if crosses and a < 0:
                        a = x
                    elif not crosses and a >= 0:
                        o = off + a
                        moves.append(
                            (keys[o], r.depth + o, x - a, 1 - g, keys[o - 1] if o else r.parent, keys[off + x - 1], i + a)
                        )
                        a = -1
        for span in spans.values():
            if len(span) > 1:
                span.sort()
                for (o1, k1), (o2, _k2) in zip(span, span[1:]):
                    if o1 + k1 > o2:
                        return None
        return moves

    def _pieces(self, hashes: Sequence[int], i: int, d: int, k: int) -> list[tuple[_HostRun, int, int]]:
        """The queued pages ``hashes[i:i + k]`` (consecutive pages of one chain, the first at
        depth ``d``) as ``(run, offset, length)`` pieces of the runs holding them now: the lift
        of an earlier chain of the message may have cut the run they were found in (a hostile or
        stale message: a child gains a count its parent loses). O(pieces)."""
        out = []
        while k:
            r = self._run_at(hashes[i], d)
            if r is None:  # queued (the caller's stretch): some run holds it
                raise KvInvariantError(f"queued page {hashes[i]} at depth {d} is in no L2 run")
            o = d - r.depth
            m = len(r.keys) - o
            if k < m:
                m = k
            out.append((r, o, m))
            i += m
            d += m
            k -= m
        return out

    def check_structure(self) -> None:
        """:meth:`RunHostPool.check_structure`, plus the queued-page set and the counts (O(n)):
        the set holds exactly the queued pages, a queued run's pages counted > 0 exactly in
        group 1. With counted intervals (count messages with chains) ``counted`` is rebuilt from
        group 1 and the intervals, so that last check holds by construction: only the intervals'
        shape is checked (``GpuBlockPool.check_structure``); whether they hold the right pages is
        for lockstep tests against the counted set (tests/property/test_worker_count_chains_lockstep.py).

        Raises:
            KvInvariantError: naming the first one that fails.
        """
        super().check_structure()
        if self._counted is not None:
            for r in self.gpu.ends.values():
                if r.counted:
                    raise KvInvariantError(f"L1 run {r.keys[0]} has counted intervals, but the pool keeps a counted set")
        counted = self.counted
        queued = self.queued
        n = 0
        for q in self.queues:
            for r in q:
                for h in r.keys:
                    n += 1
                    if h not in queued:
                        raise KvInvariantError(f"L2 page {h} queued but not in the queued set")
                    if (h in counted) != (r.group == 1):
                        raise KvInvariantError(f"L2 page {h} in group {r.group}, counted={h in counted}")
        if len(queued) != n:
            raise KvInvariantError(f"L2 queued set holds {len(queued)} pages, {n} queued")


# --------------------------------------------------------------------------- #
# the node's L1 + L2
# --------------------------------------------------------------------------- #


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
        policy = get_policy(host_policy)
        self.host: RunHostPool
        if isinstance(policy, BranchCountPolicy):
            self.host = BranchRunHostPool(host_blocks, block_size, self.events, self.gpu, policy)
        else:
            self.host = RunHostPool(host_blocks, block_size, self.events, self.gpu, policy)

    # -- queries ---------------------------------------------------------- #

    def match(self, path: Sequence[int], limit: int, *, use_host: bool = True) -> tuple[int, int]:
        """Longest prefix of ``path[:limit]`` in L1, then how far L2 extends it.

        Returns ``(gpu_blocks, host_blocks)``: the first ``gpu_blocks`` pages are
        in L1 and the next ``host_blocks`` must be restored from L2. O(runs).
        """
        n_gpu = self.gpu.match_prefix(path, limit)
        n_host = self.host.match_after_l1(path, n_gpu, limit) if use_host else 0
        return n_gpu, n_host

    # -- request lifecycle ------------------------------------------------ #

    def admit(self, path: Sequence[int], n_hit: int, new_slots: int) -> bool:
        """Reference the L1 hit ``path[:n_hit]`` and reserve ``new_slots`` more slots.

        Returns False, changing nothing, when L1 cannot make room (never over-commits).
        """
        gpu = self.gpu
        if not gpu.acquire_if_room(path, n_hit, new_slots):
            return False
        evicted = gpu.reserve(new_slots)
        assert evicted is not None
        if evicted:
            self.host.unpin_runs(gpu.evicted_runs)
        return True

    def reserve(self, n: int) -> bool:
        """Reserve ``n`` slots (a decode request's footprint); False if no room."""
        evicted = self.gpu.reserve(n)
        if evicted is None:
            return False
        if evicted:
            self.host.unpin_runs(self.gpu.evicted_runs)
        return True

    def fill(self, path: Sequence[int], lo: int, hi: int) -> None:
        """Pages ``path[lo:hi]`` became resident in L1 (computed, received or restored):
        convert reserved slots, then write them through to L2."""
        for s, e in self.gpu.fill(path, lo, hi):
            self.host.store(path, s, e)

    def store_fetched(self, path: Sequence[int], lo: int, hi: int) -> int:
        """Pages ``path[lo:hi]`` arrived from a peer's L2 into this node's L2 (not L1);
        see :meth:`RunHostPool.store_fetched`. Returns the pages stored."""
        return self.host.store_fetched(path, lo, hi)

    def match_admit(self, path: Sequence[int], limit: int, footprint: int) -> tuple[int, int, bool]:
        """:meth:`match`, then :meth:`admit` of the L1 hit it found with ``footprint`` slots in
        all: ``(gpu_blocks, host_blocks, admitted)`` — the scheduler's admission. The same as the
        two calls, with one walk of the hit's L1 runs instead of two (~4,000 per 600 s of the
        ``evolving`` side-by-side). False changes nothing. O(runs).
        """
        gpu = self.gpu
        runs, n_gpu = gpu.match_runs(path, limit)
        n_host = self.host.match_after_l1(path, n_gpu, limit)
        new_slots = footprint - n_gpu
        if not gpu._acquire_runs_if_room(runs, n_gpu, new_slots):
            return n_gpu, n_host, False
        evicted = gpu.reserve(new_slots)
        assert evicted is not None
        if evicted:
            self.host.unpin_runs(gpu.evicted_runs)
        return n_gpu, n_host, True

    def match_hold(self, path: Sequence[int], limit: int) -> tuple[int, int, list[int] | None]:
        """:meth:`match`, then :meth:`hold` of the L1 + L2 prefix it found when L2 extends L1:
        ``(gpu_blocks, host_blocks, the held hashes or None)`` — a queued request's prefix as
        the scheduler takes it at enqueue and at a fetch's completion. The same as the two
        calls, without the hold's second walk of the prefix just matched (~3,300 per 600 s of
        the ``evolving`` side-by-side). O(runs).
        """
        n_gpu = self.gpu.match_prefix(path, limit)
        n_host = self.host.match_after_l1(path, n_gpu, limit)
        if not n_host:
            return n_gpu, 0, None
        return n_gpu, n_host, self.host._hold(path, n_gpu + n_host)

    def hold(self, path: Sequence[int], n: int) -> list[int]:
        """Keep the L2 copy of ``path[:n]`` while a queued request waits to restore it
        (the scheduler holds a request's local prefix from its arrival, and the prefix
        its fetch extended from the fetch's completion).

        A peer fetch lands in L2 unpinned, and before this a queued request could
        find its fetched pages evicted by other fetches and write-throughs by the
        time it was admitted, and recompute them (seen on real Claude Code
        sessions: 500K-token prefixes fetched, evicted within 4 s, recomputed in
        40 s while the router had predicted 1 s). Held pages stay where they are
        in the eviction queue and are skipped: a fetch never evicts them (it
        stores fewer pages instead), and a write-through evicts one only when
        every queued page is held (the hold is then broken: a page L1 needs
        always finds room). As SGLang HiCache locks the host nodes a prefetch
        loads for a waiting request (``inc_lock_ref`` in
        ``hiradix_cache.py``'s ``prefetch_from_storage``).

        Returns the held hashes, the present leading pages of ``path[:n]`` (L1
        pages count: they are in L2 too), a list the pool keeps as the hold (do not
        change it); pass it to :meth:`unhold`. O(runs) + one copy of the held pages.
        """
        return self.host.hold(path, n)

    def unhold(self, hashes: Sequence[int]) -> None:
        """Drop the hold :meth:`hold` returned ``hashes`` for (at admission, abort, re-route)."""
        self.host.unhold(hashes)

    def release(self, path: Sequence[int], n_held: int, reserved: int) -> None:
        """A request leaves: unreference ``path[:n_held]`` (tail first), free ``reserved`` slots."""
        self.gpu.release(path, n_held)
        self.gpu.unreserve(reserved)

    def update_counts(self, hashes: Sequence[int], counts: Sequence[int], chains: Sequence[tuple[int | None, int]] | None = None) -> int:
        """Branch counts for host eviction; see :meth:`BranchRunHostPool.update_counts`."""
        return self.host.update_counts(hashes, counts, chains)

    def reset_counts(self) -> int:
        """Every host block's branch count back to 0 (the KV directory restarted); see
        :meth:`BranchRunHostPool.reset_counts`. Returns the host blocks moved."""
        return self.host.reset_counts()

    def take_events(self) -> list[KvEvent]:
        """Drain the outbox (events in the order they happened): the list itself is handed
        over and the pools append to a new one (O(1), no copy)."""
        out = self.events
        self.events = self.gpu.events = self.host.events = []
        return out

    def snapshot(self) -> tuple[list[int], list[int]]:
        """``(gpu hashes, host hashes)``. O(n)."""
        return self.gpu.snapshot(), self.host.snapshot()

    def snapshot_parents(self) -> tuple[list[int], list[int | None], list[int], list[int | None]]:
        """``(gpu hashes, their parents, host hashes, their parents)`` for a resync reply
        (``KvSnapshot``): the directory needs the parents to place the blocks in its prefix
        tree; without them a resynced node's blocks join no complete prefix. O(n)."""
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

        gpu.check_structure()
        host.check_structure()
        if gpu.free < 0:
            fail(f"L1 over-committed: {gpu.hashed} hashed + {gpu.reserved} reserved > {gpu.capacity}")
        refs: dict[int, int] = {}
        reserved = 0
        for path, held, res in holders:
            reserved += res
            for i in range(held):
                refs[path[i]] = refs.get(path[i], 0) + 1
        if reserved != gpu.reserved:
            fail(f"reserved slots: requests hold {reserved}, pool counts {gpu.reserved}")
        gblocks = gpu.blocks
        gqueue = {b.hash for b in gpu.evictable.ordered()}
        hblocks, hqueue = host.view()
        for h, b in gblocks.items():
            if b.ref != refs.get(h, 0):
                fail(f"L1 block {h}: ref {b.ref} but {refs.get(h, 0)} holders")
            if (b.ref == 0) != (h in gqueue):
                fail(f"L1 block {h}: ref {b.ref} but evictable={h in gqueue}")
            if h not in hblocks or not hblocks[h].pinned:
                fail(f"L1 block {h} not pinned in L2 (write-through broken)")
            if b.parent is not None and b.parent not in gblocks:
                fail(f"L1 block {h} resident without its parent {b.parent} (prefix cut)")
        if set(refs) - set(gblocks):
            fail("a request holds a page that is not resident in L1")
        if len(hblocks) > host.capacity:
            fail(f"L2 over capacity: {len(hblocks)} > {host.capacity}")
        for h in host.holds:
            if h not in hblocks:
                fail(f"L2 hold on block {h}, which is not in L2")
        n_unpinned = 0
        for h, hb in hblocks.items():
            if hb.pinned != (h in gblocks):
                fail(f"L2 block {h}: pinned={hb.pinned} but in L1={h in gblocks}")
            n_unpinned += not hb.pinned
        if n_unpinned != len(hqueue):
            fail(f"L2 evictable queue has {len(hqueue)} blocks, {n_unpinned} unpinned")
        for tier, queue in (("gpu", gpu.evictable.ordered()), ("host", hqueue)):
            if tier == "host":
                for a, b in zip(queue, queue[1:]):
                    if (a.group, a.last_access) >= (b.group, b.last_access):
                        fail(f"{tier} eviction queue out of key order at {a.hash}, {b.hash}")
            pos = {b.hash: i for i, b in enumerate(queue)}
            for b in queue:
                p = b.parent
                if p is not None and p in pos and pos[p] < pos[b.hash] and queue[pos[p]].group == b.group:
                    fail(f"{tier}: parent {p} would be evicted before its child {b.hash}")
