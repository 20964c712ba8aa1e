"""Block index of the KV directory: which node holds which block in which tier.

This module contains zero I/O and zero branch logic; :mod:`.core` drives it.

The prefix tree is keyed by chained block hash (``shared.hashing``): a chained
hash names its whole prefix, so a request's block path is a root-to-node walk
of that tree. Per block the index knows

* ``pc`` — presence bits: bit 0 = held anywhere; for node index ``i`` bit
  ``1+3i`` = in its GPU (L1), ``2+3i`` = in its host memory (L2), ``3+3i`` =
  in either ("local").
* ``comp`` — *completeness* bits, same layout: ``comp = pc & comp(parent)``
  (root: ``pc``). A set bit means every block from the root down to this one
  is present in that (node, tier) / anywhere. Along any path ``comp`` is
  monotone (each value a subset of the previous one, hence numerically ≤),
  so the longest prefix per node and tier is found by ``bisect`` over the
  path instead of a walk of every block: O(k · log L) C-level dict probes for
  k distinct prefix lengths, not O(L · nodes). ``bisect``'s key function is
  ``where.__getitem__`` (C, no Python frame): a run *is* a one-item list
  ``[-comp]`` (a list subclass; lists compare item by item in C), and a
  missing block reads ``[0]``.
* its parent — parent hash, ``None`` at a sequence start, :data:`UNKNOWN` for
  a placeholder created because a child named it before it was ever stored
  (or a snapshot block reported without its parent) — and its children.

Representation (runs of blocks, as the worker's block pools and SGLang's radix
cache store compressed edges): engines store and evict *runs* — a Claude Code
prompt is ~1,900 blocks of 64 tokens, written through to host memory and
evicted deepest first in runs — and the blocks of a run share their presence.
So the tree is kept as maximal runs (:class:`_Run`): consecutive blocks of one
sequence with the same ``pc`` (hence the same ``comp``) where every block but
the last has exactly one child. ``where[h]`` is the run holding block ``h``,
the only per-block dict. A store or removal costs O(runs touched) Python steps plus
C-level dict updates per block: a new chain that extends a run with the same
presence is appended to it; a chain indexed elsewhere is matched run by run by
slice comparison; removals listed deepest first (or parent first) are matched
as run ends. Runs are split where presence changes and joined again when it
evens out (the smaller side's blocks re-pointed, C-level; a run's deep end
evicted from a tier whose deeper blocks left it before goes straight into
their run), so two indexes with
the same blocks have the same runs; a run whose completeness changes keeps its
blocks: its one list item is overwritten, O(1) per run whatever its length
(a GPU copy arriving or leaving changes the completeness of runs of hundreds
of blocks: ~10M blocks per 600 s of the evolving simulation were re-pointed
when a run was an immutable int). Per block
this costs one ``where`` slot and one list slot (about 100 B with the hash int
itself, against ~430 B with one tuple entry per block, a completeness dict and
per-(node, tier) held sets, ``tests/unit/kvdirectory/ref_index.py``); run
objects are few, so the cyclic garbage collector walks runs, not blocks.

A block whose parent is missing is *stored* anyway (unlike Dynamo's
``ParentBlockNotFound``, which rejects the whole store); it is simply not part
of a complete prefix until the parent shows up, when ``comp`` propagates down.

Entries follow evictions: a block held nowhere and with no indexed child is
deleted, and so are the ancestors that this leaves empty and childless.
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

GPU = 0
"""Tier index of L1 (GPU memory)."""
HOST = 1
"""Tier index of L2 (host memory)."""
TIERS = ("gpu", "host")
TIER_INDEX = {"gpu": GPU, "host": HOST}

ANY_BIT = 1


class _Unknown:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()
"""Parent of a placeholder entry whose own parent was never reported."""


class _ZeroDict(dict):  # type: ignore[type-arg]
    """dict whose missing keys read ``_NOWHERE``, a run of completeness 0 (``__getitem__``
    stays a C call on hits)."""

    __slots__ = ()

    def __missing__(self, key: int) -> _Run:
        return _NOWHERE


def tier_bit(node: int, tier: int) -> int:
    """Presence bit of ``(node index, tier index)``."""
    return 1 << (1 + 3 * node + tier)


def local_bit(node: int) -> int:
    """"Held in either tier" bit of a node index."""
    return 1 << (3 + 3 * node)


def decode_bit(pos: int) -> tuple[int, int]:
    """Bit position (≥ 1) → (node index, section 0 = gpu, 1 = host, 2 = local)."""
    return divmod(pos - 1, 3)


class _Run(list):  # type: ignore[type-arg]
    """Consecutive blocks of one sequence with the same presence bits (a compressed edge of
    the prefix tree): ``keys[i]`` is the parent of ``keys[i + 1]``, and every block but the
    last has exactly one indexed child (the next key).

    The run *is* its negated completeness in a one-item list (``run[0] == -comp``):
    ``where`` maps every block to its run, so ``where.__getitem__`` is the C-level key
    function that lookups bisect with (one-item lists order as their items, compared in
    C), and no per-block completeness dict is kept. A run whose completeness changes
    keeps its identity and its blocks (:meth:`BlockIndex._set_comp` overwrites
    ``run[0]``). Runs compare as lists (by completeness) and are unhashable: identity
    (``is``, ``id``) tells them apart.

    Attributes: ``keys`` (block hashes, parent first; ``[]`` once the run is gone),
    ``parent`` (parent hash of ``keys[0]``: None at a sequence start, :data:`UNKNOWN` for a
    placeholder or a block whose parent was never reported), ``pc`` (presence bits of every
    block), ``children`` (child runs hanging below ``keys[-1]`` by first hash, or None).
    """

    __slots__ = ("keys", "parent", "pc", "children", "fwd")
    keys: list[int]
    parent: Any
    pc: int
    children: dict[int, _Run] | None
    fwd: _Run | None
    """Once the run is gone: the run that took its blocks (a join), if any."""


def _mk(keys: list[int], parent: Any, pc: int, comp: int) -> _Run:
    r = _Run((-comp,))
    r.keys = keys
    r.parent = parent
    r.pc = pc
    r.children = None
    r.fwd = None
    return r


_RUN_BYTES = (lambda r: sys.getsizeof(r) + sys.getsizeof(r[0]) + sys.getsizeof([]))(_mk([], None, 1, 1 << 30))
"""Bytes of one run object: the list with its slots and one item, that item (an int) and an
empty keys list."""

_WALK_GAP = 16
"""``prefix_drops`` walks the rest of a path run by run once it has found more than one
completeness drop per this many blocks. Each bisection costs ~log2(L) probes; the walk one
probe per run plus one comparison per block, which is cheap while the blocks' hash ints
are in the CPU cache and ~1/3 of a probe when they are not (a simulated cluster's
index): measured, 16 pays on ``bench/kvdirectory_bench.py``'s 123-length lookup (-20%)
and on the evolving simulation's lookups at 512-token blocks; 64 made the latter ~25%
slower."""

_NOWHERE = _mk([], None, 0, 0)
"""What :attr:`BlockIndex.where` reads for a missing block: completeness 0 (never changed,
not a live run)."""


_drain: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend
"""Run an iterator of C calls to the end (``map(d.__delitem__, keys)`` without a Python loop):
one empty deque's ``extend`` for every call (a deque built per call, its keyword argument
parsed, cost ~1,000 instructions more each)."""


def _add_new(where: dict[int, _Run], hashes: Sequence[int], r: _Run, fresh: bool) -> bool:
    """Point ``where`` at run ``r`` for ``hashes`` if none of them is in ``where`` yet; False,
    with ``where`` as it was, when one is (its entry is left alone) or a hash repeats.

    One ``setdefault`` per block (``map``, C-level): a lookup that inserts a missing block and
    never overwrites one already indexed, so no ``isdisjoint`` pass must come first; how much
    ``where`` grew tells whether every block was new and distinct (no set of the hashes is
    built). On failure the blocks it added are taken back: those now pointing at ``r`` that
    ``r`` did not hold before (a ``fresh`` run held none; else its ``keys``, not yet
    extended), Python steps only then. (An ``isdisjoint`` pass then ``update`` from
    ``zip(hashes, repeat(r))`` cost ~190 instructions per block more, cachegrind; a
    ``dict.fromkeys`` then ``update`` inserts every block twice and grows the temporary dict by
    rehashing, ~300 more. The same holds for every re-pointing of blocks in this module.)"""
    n0 = len(where)
    _drain(map(where.setdefault, hashes, repeat(r)))
    if len(where) - n0 == len(hashes):
        return True
    held = () if fresh else set(r.keys)
    for h in hashes:
        if where.get(h) is r and h not in held:
            del where[h]
    return False


def _match(keys: list[int], j: int, hashes: list[int], i: int) -> int:
    """Length of the common prefix of ``keys[j:]`` and ``hashes[i:]``, given
    ``keys[j] == hashes[i]``: one list comparison (C) when they agree to the end of
    either, else a bisection over slices. A whole list is compared as it is, not as a
    slice copy (the usual case: a whole run; a slice copies and counts a reference to
    every item)."""
    m = len(keys) - j
    if len(hashes) - i < m:  # m = min(len(keys) - j, len(hashes) - i), no builtin call
        m = len(hashes) - i
    if m == 1:
        return 1
    if m == len(keys):  # (j == 0) the whole run
        if keys == (hashes if m == len(hashes) else hashes[i : i + m]):
            return m
    elif keys[j : j + m] == (hashes if m == len(hashes) else hashes[i : i + m]):
        return m
    lo, hi = 1, m  # keys[j:j+lo] matches, keys[j:j+hi] does not
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if keys[j + lo : j + mid] == hashes[i + lo : i + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _match_down(keys: list[int], j: int, hashes: list[int], i: int) -> int:
    """Length of the common prefix of ``hashes[i:]`` and ``keys[j::-1]`` (a run listed deepest
    first, as engines evict), given ``keys[j] == hashes[i]``."""
    m = j + 1
    if len(hashes) - i < m:  # m = min(j + 1, len(hashes) - i)
        m = len(hashes) - i
    if m == 1:
        return 1
    if m == len(keys) and keys == (hashes[i + m - 1 : i - 1 : -1] if i else hashes[m - 1 :: -1]):
        return m  # the whole run (j is its last key): one reversed slice, not two slices
    rev = keys[j - m + 1 : j + 1]
    rev.reverse()
    if rev == hashes[i : i + m]:
        return m
    lo, hi = 1, m
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if rev[lo:mid] == hashes[i + lo : i + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class BlockIndex:
    """Presence of blocks per (node, tier) with prefix completeness masks, stored as runs.

    Args:
        max_blocks: cap on indexed entries; a new block past the cap is not
            indexed (counted in ``counters['cap.rejected_blocks']``), so a
            lookup under-reports rather than inventing a hit.

    Node ids are small integers assigned by the caller (:mod:`.core`). Every
    mutation keeps the per-block semantics of one entry per block (the property
    tests check them against a brute-force model); runs only change what a
    mutation costs: O(runs touched) Python steps plus C-level dict updates.
    """

    def __init__(self, max_blocks: int = 16_000_000) -> None:
        self.max_blocks = max_blocks
        self.where: _ZeroDict = _ZeroDict()
        """hash → the run holding it (every indexed block, placeholders included); a missing
        hash reads a run of completeness 0 (``[0]``)."""
        self._runs: dict[int, _Run] = {}
        """id → run, every live run (in creation order)."""
        self.copies: list[list[int]] = []
        """``copies[node][tier]``: blocks present on that node in that tier."""
        self.counters: dict[str, int] = {
            "cap.rejected_blocks": 0,
            "stored.duplicate_blocks": 0,
            "stored.without_parent": 0,
            "stored.parent_conflict": 0,
            "removed.unknown_blocks": 0,
        }

    # ------------------------------------------------------------------ #
    # nodes and views
    # ------------------------------------------------------------------ #

    def ensure_node(self, node: int) -> None:
        """Make room for node index ``node`` (indices are dense, from 0)."""
        while len(self.copies) <= node:
            self.copies.append([0, 0])

    def holds(self, node: int, h: int) -> bool:
        """True when ``node`` holds block ``h`` in either tier."""
        r = self.where.get(h)
        return r is not None and bool(r.pc & local_bit(node))

    @property
    def live_runs(self) -> dict[int, _Run]:
        """id → run, every live run (read only: the index's registry)."""
        return self._runs

    def runs(self) -> list[_Run]:
        """Every run, in creation order (deterministic). O(runs)."""
        return list(self._runs.values())

    @property
    def negcomp(self) -> dict[int, int]:
        """hash → ``-comp`` for every block whose ``comp`` is not 0 (a copy, for checks and tests)."""
        return {h: r[0] for h, r in self.where.items() if r[0]}

    def _new(self, keys: list[int], parent: Any, pc: int, comp: int) -> _Run:
        r = _mk(keys, parent, pc, comp)
        self._runs[id(r)] = r
        return r

    def _gone(self, r: _Run, fwd: _Run | None = None) -> None:
        del self._runs[id(r)]
        r.keys = []
        r.fwd = fwd

    def held_blocks(self, node: int, tier: int) -> list[int]:
        """Hashes present on (node, tier), each run deepest block first. O(blocks)."""
        tb = tier_bit(node, tier)
        out: list[int] = []
        for r in self.runs():
            if r.pc & tb:
                out.extend(reversed(r.keys))
        return out

    @property
    def entries(self) -> dict[int, int]:
        """hash → first hash of its run, for every indexed block (a copy, for checks and
        tests: two indexes with the same blocks, parents and presence have equal views,
        as runs are kept maximal)."""
        return {h: r.keys[0] for h, r in self.where.items()}

    def run_count(self) -> int:
        """Number of runs (O(1))."""
        return len(self._runs)

    def size_bytes(self) -> int:
        """Estimated memory of the index in bytes, O(1): the ``where`` hash
        table (``sys.getsizeof``), per block one list slot (8 B) and its hash int (32 B for a
        64-bit hash), per run the run object, its attribute dict and its list header. Within ~10% of
        tracemalloc on ``bench/kvdirectory_bench.py``'s memory scenario."""
        n = len(self.where)
        return sys.getsizeof(self.where) + 40 * n + _RUN_BYTES * len(self._runs)

    # ------------------------------------------------------------------ #
    # internal tree maintenance
    # ------------------------------------------------------------------ #


    def _parent_comp(self, r: _Run) -> int:
        p = r.parent
        if p is None:
            return -1
        if p is UNKNOWN:
            return 0
        return -self.where[p][0]

    def _set_comp(self, r: _Run, c: int) -> _Run:
        """Set ``comp`` of run ``r`` to ``c`` and push the change down, only where it changes:
        O(1) per run whose comp changes (its item overwritten; no block touched). Returns ``r``."""
        if c == -r[0]:
            return r
        r[0] = -c  # r itself, then its child runs (a leaf, the usual run, needs no stack)
        ch = r.children
        if ch is None:
            return r
        top = r
        stack: list[tuple[_Run, int]] | None = None  # the children whose comp changes (in a run: none, every time)
        for cr in ch.values():
            cc = cr.pc & c
            if cc != -cr[0]:
                if stack is None:
                    stack = [(cr, cc)]
                else:
                    stack.append((cr, cc))
        while stack:
            r, c = stack.pop()
            if c == -r[0]:
                continue
            r[0] = -c
            ch = r.children
            if ch is not None:
                for cr in ch.values():
                    stack.append((cr, cr.pc & c))
        return top

    def _split(self, r: _Run, j: int) -> tuple[_Run, _Run]:
        """Cut run ``r`` after its first ``j`` keys (0 < j < len); returns (head, tail). The
        smaller part becomes a new run (its blocks are re-pointed in :attr:`where`)."""
        where = self.where
        keys = r.keys
        if 2 * j <= len(keys):
            head = self._new(keys[:j], r.parent, r.pc, -r[0])
            del keys[:j]
            r.parent = head.keys[-1]
            head.children = {keys[0]: r}
            p = head.parent
            if p is not None and p is not UNKNOWN:
                where[p].children[head.keys[0]] = head
            where.update(zip(head.keys, repeat(head)))
            return head, r
        tail = self._new(keys[j:], keys[j - 1], r.pc, -r[0])
        del keys[j:]
        tail.children = r.children
        r.children = {tail.keys[0]: tail}
        where.update(zip(tail.keys, repeat(tail)))
        return r, tail

    def _isolate(self, r: _Run, a: int, b: int) -> _Run:
        """Split ``r`` so that its keys ``[a, b)`` form one run; returns that run."""
        if b < len(r.keys):
            r = self._split(r, b)[0]
        if a > 0:
            r = self._split(r, a)[1]
        return r

    def _join(self, a: _Run, b: _Run) -> _Run:
        """One run of ``a`` and its only child ``b`` (same presence, hence same comp);
        the smaller one's blocks are re-pointed. Returns the survivor."""
        where = self.where
        if len(a.keys) >= len(b.keys):
            a.keys.extend(b.keys)
            a.children = b.children
            where.update(zip(b.keys, repeat(a)))
            self._gone(b, a)
            return a
        b.keys[:0] = a.keys
        b.parent = a.parent
        p = a.parent
        if p is not None and p is not UNKNOWN:
            where[p].children[a.keys[0]] = b
        where.update(zip(a.keys, repeat(b)))
        self._gone(a, b)
        return b

    def _settle(self, r: _Run) -> None:
        """Keep runs maximal around ``r`` (or the run that took its blocks): join it with its
        parent run and with its only child when their presence bits are equal."""
        self._settle_runs((r,))

    def _settle_runs(self, runs: Iterable[_Run]) -> None:
        """:meth:`_settle` each run of ``runs`` in turn, in one frame (``store`` and ``remove`` touch ~19,000 runs in a
        600-s simulation, nearly all with nothing to join: a call per run cost more than the work)."""
        where = self.where
        for r in runs:
            while not r.keys:
                r = r.fwd  # type: ignore[assignment]
                if r is None:
                    break
            else:
                while True:
                    p = r.parent
                    if p is None or p is UNKNOWN:
                        break
                    a = where[p]
                    if a.pc != r.pc or len(a.children) != 1 or a is r:
                        break
                    r = self._join(a, r)
                while True:
                    ch = r.children
                    if ch is None or len(ch) != 1:
                        break
                    (c,) = ch.values()
                    if c.pc != r.pc or c is r:  # (a cycle: only inconsistent parent reports make one)
                        break
                    r = self._join(r, c)

    def _shift_tail(self, r: _Run, a: int, pc: int) -> bool:
        """Give the blocks ``r.keys[a:]`` (0 < a), whose presence becomes ``pc``, to ``r``'s only
        child run when it has presence ``pc`` already, if that re-points no more blocks than
        cutting them off and joining them to the child would (``min(tail, a) + min(tail,
        child)``): an engine evicting a run's deep end from one tier, whose deeper blocks it
        evicted from that tier before. Their completeness is the child's (same presence, same
        parent completeness), so nothing else changes. Returns False, changing nothing, when
        the tail does not go to the child."""
        ch = r.children
        if ch is None or len(ch) != 1:
            return False
        (c,) = ch.values()
        keys = r.keys
        if c.pc != pc or c is r or len(keys) - a > a + len(c.keys):
            return False
        tail = keys[a:]
        del keys[a:]
        self.where.update(zip(tail, repeat(c)))
        c.keys[:0] = tail
        c.parent = keys[-1]
        r.children = {tail[0]: c}
        return True

    def _attach(self, p: int, r: _Run) -> None:
        """Hang run ``r`` below block ``p`` (its parent): a placeholder is created for a ``p``
        that is not indexed, and ``p``'s run is split after ``p`` when ``p`` is inside it."""
        where = self.where
        a = where.get(p)
        if a is None:
            a = where[p] = self._new([p], UNKNOWN, 0, 0)
        elif a.keys[-1] != p:
            a = self._split(a, a.keys.index(p) + 1)[0]
        if a.children is None:
            a.children = {r.keys[0]: r}
        else:
            a.children[r.keys[0]] = r

    def _new_run(self, keys: list[int], parent: Any, pc: int) -> _Run:
        """Index new blocks ``keys`` (a chain below ``parent``) with presence ``pc``."""
        where = self.where
        if parent is None:
            pcomp = -1
        elif parent is UNKNOWN:
            pcomp = 0
        else:
            pcomp = -where[parent][0]  # 0 when missing (a placeholder is made below); a split keeps comp
        r = self._new(keys, parent, pc, pc & pcomp)
        where.update(zip(keys, repeat(r)))
        if parent is not None and parent is not UNKNOWN:
            self._attach(parent, r)
        return r

    def _fresh_run(self, hashes: Sequence[int], parent: int | None, pr: _Run | None, pc: int) -> _Run | None:
        """Index a new chain ``hashes`` below ``parent`` (``pr``: its run, None when not
        indexed) as one new run with presence ``pc``, as :meth:`_new_run` does; None, with
        nothing changed, when a block is indexed already or a hash repeats inside the chain
        (told by how much :attr:`where` grew, :func:`_add_new`: no set of the hashes is built).
        O(len(hashes)) C-level."""
        where = self.where
        pcomp = -1 if parent is None else (-pr[0] if pr is not None else 0)  # a missing parent: 0 (placeholder below)
        r = _mk(list(hashes), parent, pc, pc & pcomp)
        if not _add_new(where, hashes, r, True):
            return None
        self._runs[id(r)] = r
        if parent is not None:
            self._attach(parent, r)
        return r

    def _drop_run(self, r: _Run) -> None:
        """Delete run ``r`` (held nowhere, childless) and the ancestors this leaves empty and childless."""
        where = self.where
        while True:
            keys = r.keys
            _drain(map(where.__delitem__, keys))
            self._gone(r)
            p = r.parent
            if p is None or p is UNKNOWN:
                return
            a = where[p]
            ch = a.children
            del ch[keys[0]]
            if ch:
                if len(ch) == 1:
                    self._settle(a)
                return
            a.children = None
            if a.pc:
                self._settle(a)
                return
            r = a

    # ------------------------------------------------------------------ #
    # mutation
    # ------------------------------------------------------------------ #

    def store(self, node: int, tier: int, hashes: Sequence[int], parent: int | None) -> list[int]:
        """Mark consecutive blocks ``hashes`` (parent first) present on (node, tier).

        Args:
            parent: hash of the block before ``hashes[0]``; None at a sequence start.

        Returns:
            The hashes that were not present on (node, tier) before, in order.

        Cost: O(runs touched) plus C-level dict updates per block (a brand-new chain is one
        run; a chain already indexed elsewhere is matched run by run with slice comparisons).
        """
        where = self.where
        counters = self.counters
        tb = 1 << (1 + 3 * node + tier)  # tier_bit(node, tier)
        bits = tb | 1 << (3 + 3 * node) | ANY_BIT  # | local_bit(node)
        if parent is not None:
            pr = where.get(parent)
            if pr is None or pr.pc == 0:
                counters["stored.without_parent"] += 1
        hashes = hashes if type(hashes) is list else list(hashes)
        k = len(hashes)
        if not k:
            return []
        cnt = self.copies[node]
        room = self.max_blocks - len(where)
        if room > k and where.keys().isdisjoint(hashes):
            # the common engine case: a brand-new chain of blocks
            pr = where.get(parent) if parent is not None else None
            if pr is not None and pr.pc == bits and pr.children is None and pr.keys[-1] == parent:
                # ... that extends a run with the same presence: append to it
                where.update(zip(hashes, repeat(pr)))
                if len(where) - (self.max_blocks - room) == k:
                    pr.keys.extend(hashes)
                    cnt[tier] += k
                    return hashes[:]
                for h in hashes:  # a hash repeats inside the chain: undo, take the general path
                    where.pop(h, None)
            else:
                r = self._fresh_run(hashes, parent, pr, bits)
                if r is not None:
                    # _settle only when it can join: a fresh run has no children, so only with
                    # its parent's run, alike and with r its only child (a frame saved otherwise)
                    if parent is not None and (a := where[parent]).pc == bits and len(a.children) == 1:
                        self._settle(r)
                    cnt[tier] += k
                    return hashes[:]
        newly: list[int] = []
        touched: list[_Run] = []
        prev: Any = parent
        i = 0
        while i < k:
            h = hashes[i]
            r = where.get(h)
            if r is None:  # new blocks hashes[i:e]
                rest = hashes[i:]
                if where.keys().isdisjoint(rest) and len(set(rest)) == k - i:
                    e = k
                else:
                    seen: set[int] = set()
                    e = i
                    while e < k:
                        x = hashes[e]
                        if x in where or x in seen:
                            break
                        seen.add(x)
                        e += 1
                if room <= 0:
                    counters["cap.rejected_blocks"] += k - len(newly)
                    break
                room -= 1
                recount = False
                if prev is not None:
                    pr = where.get(prev)
                    recount = pr is None or pr.keys[-1] != prev or pr.children is not None
                more = e - i - 1
                if recount:  # the first block's parent had children or was missing (placeholder)
                    room = self.max_blocks - len(where) - 1 - (prev not in where)
                fit = 1 + max(0, min(more, room))
                seg = hashes[i : i + fit]
                touched.append(self._new_run(seg, prev, bits))
                room -= fit - 1
                newly.extend(seg)
                cnt[tier] += fit
                if fit <= more:
                    counters["cap.rejected_blocks"] += k - len(newly)
                    break
                prev = hashes[e - 1]
                i = e
                continue
            keys = r.keys
            j = 0 if keys[0] == h else keys.index(h)
            rp = keys[j - 1] if j else r.parent
            relinked = False
            if rp is UNKNOWN:  # a placeholder (or snapshot block) learns its parent
                r.parent = prev
                if prev is not None:
                    self._attach(prev, r)
                relinked = True
            elif rp != prev:  # chained hashes name their parent; keep the first report
                counters["stored.parent_conflict"] += 1
            m = _match(keys, j, hashes, i)
            if r.pc & tb:
                counters["stored.duplicate_blocks"] += m
                if relinked:
                    touched.append(self._set_comp(r, r.pc & self._parent_comp(r)))
            else:
                s = r if j == 0 and m == len(keys) else self._isolate(r, j, j + m)
                s.pc |= bits
                p = s.parent  # the parent's completeness inline (_parent_comp)
                c = s.pc & (-1 if p is None else 0 if p is UNKNOWN else -where[p][0])
                if c != -s[0]:  # _set_comp's leaf case inline (no frame: the usual run has no children)
                    if s.children is None:
                        s[0] = -c
                    else:
                        self._set_comp(s, c)
                touched.append(s)
                newly.extend(hashes[i : i + m])
                cnt[tier] += m
            prev = hashes[i + m - 1]
            i += m
        self._settle_runs(touched)
        return newly

    def store_written_through(self, node: int, hashes: Sequence[int], parent: int | None) -> list[int] | None:
        """:meth:`store` of ``hashes`` on (node, GPU) then on (node, HOST) in one step, when they are
        a brand-new chain (no block indexed, no hash repeated, room for all): an engine's freshly
        computed blocks and their write-through to host memory, two consecutive ``BlockStored``
        events of one batch. The index, ``copies`` and counters end exactly as after the two
        calls (runs are kept maximal, so the same blocks and presence make the same runs), with
        one run created or extended instead of a GPU-only run that the host store then
        re-points and joins.

        Returns:
            ``hashes`` (a new list): what each of the two calls returns (every block is new on
            both tiers); None, with nothing changed, when they are not a brand-new chain (the
            caller then makes the two :meth:`store` calls).

        Cost: one lookup-or-insertion per block into ``where`` (how much it grows tells a
        block indexed already or a repeated hash, then taken back: no ``isdisjoint`` pass and
        no set of the hashes; :func:`_add_new`), one copy of ``hashes`` returned and, for a new
        run, one for its keys (:meth:`_fresh_run`).
        """
        where = self.where
        k = len(hashes)
        if not k or self.max_blocks - len(where) <= k:
            return None
        pr = where.get(parent) if parent is not None else None
        bits = 7 << (1 + 3 * node) | ANY_BIT  # tier_bit(node, GPU) | tier_bit(node, HOST) | local_bit(node)
        if pr is not None and pr.pc == bits and pr.children is None and pr.keys[-1] == parent:
            if not _add_new(where, hashes, pr, False):  # extends a run with the same presence
                return None  # (a block indexed already, or a hash repeats inside the chain)
            pr.keys.extend(hashes)
            r = None
        else:
            r = self._fresh_run(hashes, parent, pr, bits)
            if r is None:
                return None
        if parent is not None and (pr is None or pr.pc == 0):
            self.counters["stored.without_parent"] += 2  # both calls count it (the first's placeholder has pc 0)
        if r is not None and parent is not None and (a := where[parent]).pc == bits and len(a.children) == 1:
            self._settle(r)  # only when it can join (see store's fresh run)
        cnt = self.copies[node]
        cnt[GPU] += k
        cnt[HOST] += k
        return list(hashes)

    def remove(self, node: int, tier: int, hashes: Iterable[int], spans: list[tuple[int, int, bool]] | None = None) -> list[int]:
        """Mark blocks absent from (node, tier); unknown ones are counted and skipped.

        Args:
            spans: if given, gets one ``(start, end, deepest_first)`` per stretch of the returned
                list that was consecutive blocks of one index chain: ``removed[start:end]`` lists
                them parent first (``deepest_first`` False) or deepest first (True), in the
                order of the parent links the stores reported. (For a caller that tallies
                something monotone along chains, :meth:`BranchTable.on_removed`.)

        Returns:
            The hashes that were present and are now removed: a list ``hashes`` itself when all
            were (not a copy; the directory's presence hook only reads it).

        Cost: O(runs touched) plus C-level work per block when the hashes list runs of
        blocks (deepest first, as engines evict, or parent first).
        """
        where = self.where
        tb = 1 << (1 + 3 * node + tier)  # tier_bit(node, tier)
        other = 1 << (2 + 3 * node - tier)  # tier_bit(node, 1 - tier)
        keep = ~tb
        keep_both = keep & ~(1 << (3 + 3 * node))  # ~local_bit(node)
        hashes = hashes if type(hashes) is list else list(hashes)
        k = len(hashes)
        removed: list[int] | None = None  # None while no block was unknown: hashes[:i] so far
        touched: list[_Run] = []
        unknown = 0
        i = 0
        while i < k:
            h = hashes[i]
            r = where.get(h)
            if r is None or not r.pc & tb:
                if removed is None:
                    removed = hashes[:i]
                unknown += 1
                i += 1
                continue
            keys = r.keys
            last = len(keys) - 1
            j = last if keys[-1] == h else keys.index(h)
            if j < last and i + 1 < k and hashes[i + 1] == keys[j + 1]:
                m = _match(keys, j, hashes, i)  # parent first
                a, b = j, j + m
                down = False
            else:
                m = _match_down(keys, j, hashes, i)  # deepest first
                a, b = j - m + 1, j + 1
                down = True
            if spans is not None:
                s0 = i - unknown  # blocks removed so far: each one before i was removed or unknown
                spans.append((s0, s0 + m, down))
            if removed is not None:
                removed.extend(hashes[i : i + m])
            i += m
            pc = r.pc
            pc &= keep if pc & other else keep_both
            if pc == ANY_BIT:
                pc = 0
            if pc == 0 and b == last + 1 and r.children is None:
                # leaves held nowhere (the usual eviction): drop them
                if a == 0:
                    self._drop_run(r)
                else:
                    gone = keys[a:]
                    del keys[a:]
                    _drain(map(where.__delitem__, gone))
            elif a and b == last + 1 and self._shift_tail(r, a, pc):
                pass
            else:
                # a whole run (the usual GPU eviction of written-through blocks) is not split;
                # the parent's completeness read inline (_isolate, _parent_comp)
                s = r if a == 0 and b == last + 1 else self._isolate(r, a, b)
                s.pc = pc
                p = s.parent
                c = pc & (-1 if p is None else 0 if p is UNKNOWN else -where[p][0])
                if c != -s[0]:  # _set_comp's leaf case inline (no frame: the usual run has no children)
                    if s.children is None:
                        s[0] = -c
                    else:
                        self._set_comp(s, c)
                touched.append(s)
        if removed is None:
            removed = hashes  # every block was removed: the list itself (not a copy: the caller reads it)
        if unknown:
            self.counters["removed.unknown_blocks"] += unknown
        self.copies[node][tier] -= len(removed)
        self._settle_runs(touched)
        return removed

    def clear(self, node: int, tier: int | None) -> list[tuple[int, list[int]]]:
        """Drop every block of ``node`` in ``tier`` (None = both tiers).

        Returns:
            ``[(tier, removed hashes)]`` for each cleared tier.
        """
        out = []
        for t in (GPU, HOST) if tier is None else (tier,):
            out.append((t, self.remove(node, t, self.held_blocks(node, t))))
        return out

    def replace(
        self, node: int, tier: int, hashes: Iterable[int], parents: dict[int, int | None] | None
    ) -> tuple[list[int], list[int]]:
        """Make (node, tier) hold exactly ``hashes`` (a snapshot).

        Args:
            parents: parent of each snapshot block (None = sequence start); a
                block with no known parent here or in the index gets an
                :data:`UNKNOWN` parent and joins complete prefixes only once a
                later ``BlockStored`` names its parent.

        Returns:
            (added hashes, removed hashes).
        """
        want = set(hashes)
        have = set(self.held_blocks(node, tier))
        removed = self.remove(node, tier, list(have - want))
        new = list(want - (have & want))  # (the same set, and the same order, as the old per-block sets gave)
        where = self.where
        # Blocks the index has never seen, whose parent the snapshot names, go in as chains
        # through store() (runs: a restarted directory rebuilds ~50x faster than block by
        # block); everything else block by block. Same final state either way.
        fresh: set[int] = set()
        chains: list[list[int]] | None = None
        if parents is not None and len(where) + 2 * len(new) < self.max_blocks:  # room for placeholders too
            fresh = {h for h in new if h not in where and h in parents}
            chains = self._chains([h for h in new if h in fresh], parents) if fresh else None
            if chains is None:
                fresh = set()
        added_one: set[int] = set()
        bits = tier_bit(node, tier) | local_bit(node) | ANY_BIT
        touched: list[_Run] = []
        for h in new:
            if h in fresh:
                continue
            r = where.get(h)
            if r is None or (r.parent is UNKNOWN and r.keys[0] == h):
                if parents is not None and h in parents:
                    p = parents[h]
                else:
                    p = UNKNOWN
                    self.counters["stored.without_parent"] += 1
                if r is None:
                    if len(where) >= self.max_blocks:
                        self.counters["cap.rejected_blocks"] += 1
                        continue
                    r = self._new_run([h], p, 0)
                else:
                    r.parent = p
                    if p is not None and p is not UNKNOWN:
                        self._attach(p, r)
            j = r.keys.index(h)
            s = self._isolate(r, j, j + 1)
            s.pc |= bits
            touched.append(self._set_comp(s, s.pc & self._parent_comp(s)))
            added_one.add(h)
        self.copies[node][tier] += len(added_one)
        for r in touched:
            self._settle(r)
        if chains:
            # a block the snapshot names with its parent is not "stored without parent" (as
            # in the block-by-block path): store() may count it so, the counter is kept
            kept = self.counters["stored.without_parent"]
            for chain in chains:
                self.store(node, tier, chain, parents[chain[0]])  # type: ignore[index]
            self.counters["stored.without_parent"] = kept
        added = [h for h in new if h in fresh or h in added_one]
        return added, removed

    @staticmethod
    def _chains(fresh: list[int], parents: dict[int, int | None]) -> list[list[int]] | None:
        """``fresh`` (distinct hashes, each with its parent in ``parents``) cut into maximal
        chains, parents' chains first, in a fixed order; None when some block is not reached
        from a block whose parent is outside ``fresh`` (a parent cycle: only inconsistent
        reports make one). Pure; O(len(fresh))."""
        fs = set(fresh)
        children: dict[int, list[int]] = {}
        for h in fresh:
            p = parents[h]
            if p in fs:
                children.setdefault(p, []).append(h)
        out: list[list[int]] = []
        done = 0
        for root in fresh:
            if parents[root] in fs:
                continue
            stack = [root]
            while stack:
                cur = stack.pop()
                chain = [cur]
                kids = children.get(cur)
                while kids is not None and len(kids) == 1:
                    cur = kids[0]
                    chain.append(cur)
                    kids = children.get(cur)
                if kids:
                    stack.extend(reversed(kids))
                out.append(chain)
                done += len(chain)
        return out if done == len(fs) else None

    # ------------------------------------------------------------------ #
    # queries (no mutation)
    # ------------------------------------------------------------------ #

    def prefix_drops(self, path: Sequence[int]) -> list[tuple[int, int]]:
        """Where each completeness bit of ``path`` stops.

        Returns:
            ``[(length, bits)]`` in increasing ``length``: every bit in
            ``bits`` is complete over ``path[:length]`` and not over
            ``path[:length + 1]``. Bit 0 gives the longest prefix held
            anywhere; bit ``1+3i+s`` node ``i``'s longest prefix in section
            ``s`` (gpu, host, local).

        Cost: one ``bisect`` (O(log L) C-level probes) per distinct length; once the
        lengths found are denser than one per :data:`_WALK_GAP` blocks, the rest of the path
        is walked run by run instead (:meth:`_walk_drops`: one probe and one slice comparison
        per run), with the same result.
        """
        n = len(path)
        neg = self.where  # runs are their negated completeness, [-comp]; a missing block reads [0]
        if n == 0:
            return []
        r = neg[path[0]]  # the current run
        nv = r[0]  # -comp of the current run
        if not nv:
            return []
        key = neg.__getitem__
        drops: list[tuple[int, int]] = []
        i = 0
        walk = True
        while True:
            j = bisect_right(path, r, i + 1, n, key=key)
            if j >= n:
                drops.append((n, -nv))
                return drops
            r = neg[path[j]]
            nj = r[0]
            drops.append((j, -nv & ~-nj))
            if not nj:
                return drops
            i, nv = j, nj
            if walk and i < _WALK_GAP * len(drops):
                rest = self._walk_drops(path, i, r)
                if rest is not None:
                    drops += rest
                    return drops
                walk = False

    def _walk_drops(self, path: Sequence[int], i: int, r: _Run) -> list[tuple[int, int]] | None:
        """:meth:`prefix_drops` of ``path`` from position ``i`` (held by run ``r``, completeness
        not 0) to the end, walked run by run; None when the walk cannot show that the
        completeness never grows from ``i`` to the end of the path.

        The bisection finds where a bit stops on the assumption that ``comp`` only shrinks
        along the path, which inconsistent parent reports (or a path that is not a chain)
        break; there its answer depends on which blocks it probed. So the walk answers only
        when it has seen every block from ``i`` on: each run's blocks by one slice comparison
        with the path, ``-comp`` never smaller than on the run before (numerically: the order
        the bisection relies on), and past the last indexed block only blocks missing from
        the index. Then both methods find the same lengths.

        Cost: O(runs along the path) probes and Python steps, plus O(blocks from ``i`` on)
        C-level comparisons (slices) and probes (the unindexed tail).
        """
        where = self.where
        n = len(path)
        out: list[tuple[int, int]] = []
        cur = r[0]  # -comp of the blocks walked so far (0 once completeness ran out)
        t = i
        while True:
            keys = r.keys
            e = t + len(keys)
            if not keys:  # path[t] is missing: so must be every later block
                if not where.keys().isdisjoint(path[t + 1 :]):
                    return None
                break
            if e >= n:  # the path ends in this run
                if path[t:] != keys[: n - t]:
                    return None
                break
            if path[t:e] != keys:
                return None
            r = where[path[e]]
            v = r[0]
            if v != cur:
                if v < cur:  # completeness grows: the bisection's answer depends on its probes
                    return None
                out.append((e, -cur & ~-v))
                cur = v
            t = e
        if cur:
            out.append((n, -cur))
        return out

    def presence(self, h: int) -> int:
        """Presence bits of one block (0 when not indexed)."""
        r = self.where.get(h)
        return r.pc if r is not None else 0

    def complete_bits(self, h: int) -> int:
        """Completeness bits of one block (0 when not indexed)."""
        return -self.where[h][0]

    def __len__(self) -> int:
        return len(self.where)

    def check(self) -> None:
        """Invariants (O(blocks); for tests): runs maximal and well linked, ``where`` and
        the run registry consistent with the runs, ``comp = pc & comp(parent)``, copies counted.

        Raises:
            AssertionError: naming the first one that fails.
        """
        where = self.where
        seen = 0
        copies = [[0, 0] for _ in self.copies]
        runs = self.runs()
        assert len(set(map(id, where.values()))) == len(runs), "runs registry out of sync"
        for r in runs:
            assert r.keys and all(where[h] is r for h in r.keys), "where out of sync"
            seen += len(r.keys)
            assert -r[0] == r.pc & self._parent_comp(r), f"comp of run {r.keys[0]}"
            assert r.pc or r.children, f"run {r.keys[0]} held nowhere and childless"
            p = r.parent
            if p is not None and p is not UNKNOWN:
                a = where[p]
                assert a.keys[-1] == p and a.children and a.children.get(r.keys[0]) is r, f"run {r.keys[0]} misfiled"
                assert not (len(a.children) == 1 and a.pc == r.pc), f"run {r.keys[0]} not joined to its parent"
            for c in (r.children or {}).values():
                assert c.parent == r.keys[-1], f"child run {c.keys[0]} of {r.keys[-1]}"
            for n in range(len(copies)):
                for t in (GPU, HOST):
                    if r.pc & tier_bit(n, t):
                        copies[n][t] += len(r.keys)
        assert seen == len(where), "runs do not cover where"
        assert copies == self.copies, f"copies {self.copies} != {copies}"
