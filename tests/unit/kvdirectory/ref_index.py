"""Reference model for differential tests: the per-block ``BlockIndex`` of the KV directory
as it was before the run-based rewrite of ``services/kvdirectory/index.py`` (commit c9d6c45),
kept verbatim apart from this docstring (one tuple entry per block, per-(node, tier) held sets).
Every operation of the production index must give the same results, counters, completeness
masks and entry count as this model (``tests/property/test_kvdirectory_index_runs.py``).
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import repeat
from collections.abc import Iterable, Sequence
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

_SET_FANOUT = 16
"""A children list longer than this becomes a set (O(1) removal under wide fan-out)."""


class _ZeroDict(dict):  # type: ignore[type-arg]
    """dict whose missing keys read 0 (``__getitem__`` stays a C call on hits)."""

    __slots__ = ()

    def __missing__(self, key: int) -> int:
        return 0


def tier_bit(node: int, tier: int) -> int:
    """Presence bit of ``(node index, tier index)``."""
    return 1 << (1 + 3 * node + tier)


def local_bit(node: int) -> int:
    """"Held in either tier" bit of a node index."""
    return 1 << (3 + 3 * node)


def decode_bit(pos: int) -> tuple[int, int]:
    """Bit position (≥ 1) → (node index, section 0 = gpu, 1 = host, 2 = local)."""
    return divmod(pos - 1, 3)


class BlockIndex:
    """Presence of blocks per (node, tier) with prefix completeness masks.

    Args:
        max_blocks: cap on indexed entries; a new block past the cap is not
            indexed (counted in ``counters['cap.rejected_blocks']``), so a
            lookup under-reports rather than inventing a hit.

    Node ids are small integers assigned by the caller (:mod:`.core`).
    """

    def __init__(self, max_blocks: int = 16_000_000) -> None:
        self.max_blocks = max_blocks
        self.entries: dict[int, tuple[Any, ...]] = {}
        """hash → ``(pc, parent, children)``."""
        self.negcomp: _ZeroDict = _ZeroDict()
        """hash → ``-comp`` for every entry whose ``comp`` is not 0."""
        self.held: list[tuple[set[int], set[int]]] = []
        """``held[node][tier]``: hashes present on that node in that tier."""
        self.counters: dict[str, int] = {
            "cap.rejected_blocks": 0,
            "stored.duplicate_blocks": 0,
            "stored.without_parent": 0,
            "stored.parent_conflict": 0,
            "removed.unknown_blocks": 0,
        }

    # ------------------------------------------------------------------ #
    # nodes
    # ------------------------------------------------------------------ #

    def ensure_node(self, node: int) -> None:
        """Make room for node index ``node`` (indices are dense, from 0)."""
        while len(self.held) <= node:
            self.held.append((set(), set()))

    def holds(self, node: int, h: int) -> bool:
        """True when ``node`` holds block ``h`` in either tier."""
        g, hs = self.held[node]
        return h in g or h in hs

    # ------------------------------------------------------------------ #
    # internal tree maintenance
    # ------------------------------------------------------------------ #

    def _parent_comp(self, e: tuple[Any, ...]) -> int:
        p = e[1]
        if p is None:
            return -1
        if p is UNKNOWN:
            return 0
        return -self.negcomp[p]

    def _set_comp(self, h: int, children: Any, c: int) -> None:
        """Set ``comp(h)`` to ``c`` and push the change down to ``children`` when it changed."""
        neg = self.negcomp
        if c == -neg[h]:
            return
        if c:
            neg[h] = -c
        else:
            del neg[h]
        if children is not None:
            self._propagate(c, (children,) if type(children) is int else children)

    def _add_child(self, parent: int, h: int) -> None:
        entries = self.entries
        pe = entries.get(parent)
        if pe is None:
            entries[parent] = (0, UNKNOWN, h)
            return
        ch = pe[2]
        if ch is None:
            entries[parent] = (pe[0], pe[1], h)
        elif type(ch) is int:
            entries[parent] = (pe[0], pe[1], [ch, h])
        elif type(ch) is list:
            ch.append(h)
            if len(ch) > _SET_FANOUT:
                entries[parent] = (pe[0], pe[1], set(ch))
        else:
            ch.add(h)

    def _propagate(self, comp: int, children: Iterable[int]) -> None:
        """Push a new ``comp`` down to descendants, only where it changes."""
        entries = self.entries
        neg = self.negcomp
        stack = [(comp, children)]
        while stack:
            pc, chs = stack.pop()
            for c in chs:
                ce = entries[c]
                nc = ce[0] & pc
                if nc != -neg[c]:
                    if nc:
                        neg[c] = -nc
                    else:
                        del neg[c]
                    cc = ce[2]
                    if cc is not None:
                        stack.append((nc, (cc,) if type(cc) is int else cc))

    def _drop(self, h: int, e: tuple[Any, ...]) -> None:
        """Delete an empty, childless entry and the ancestors this leaves empty."""
        entries = self.entries
        while True:
            del entries[h]
            p = e[1]
            if p is None or p is UNKNOWN:
                return
            pe = entries[p]
            ch = pe[2]
            if type(ch) is int:
                pe = entries[p] = (pe[0], pe[1], None)
            else:
                ch.remove(h)
                if len(ch) == 1:
                    entries[p] = (pe[0], pe[1], next(iter(ch)))
                return
            if pe[0] == 0:
                h, e = p, pe
                continue
            return

    # ------------------------------------------------------------------ #
    # mutation
    # ------------------------------------------------------------------ #

    def store(self, node: int, tier: int, hashes: Sequence[int], parent: int | None) -> list[int]:
        """Mark consecutive blocks ``hashes`` (parent first) present on (node, tier).

        Args:
            parent: hash of the block before ``hashes[0]``; None at a sequence start.

        Returns:
            The hashes that were not present on (node, tier) before, in order.
        """
        entries = self.entries
        neg = self.negcomp
        s = self.held[node][tier]
        tb = tier_bit(node, tier)
        bits = tb | local_bit(node) | ANY_BIT
        newly: list[int] = []
        pe: tuple[Any, ...] | None = None
        if parent is None:
            pcomp = -1
        else:
            pe = entries.get(parent)
            pcomp = -neg[parent]
            if pe is None or pe[0] == 0:
                self.counters["stored.without_parent"] += 1
        room = self.max_blocks - len(entries)
        k = len(hashes)
        if k > 1 and room > k and entries.keys().isdisjoint(hashes):
            # Fast path, the common engine case: a brand-new chain of blocks.
            before = len(entries)
            entries.update(zip(hashes, zip(repeat(bits), [parent, *hashes[:-1]], [*hashes[1:], None])))
            if len(entries) - before == k:
                if parent is not None:
                    self._add_child(parent, hashes[0])
                pcomp &= bits
                if pcomp:
                    neg.update(dict.fromkeys(hashes, -pcomp))
                s.update(hashes)
                return list(hashes)
            for h in hashes:  # a hash repeats inside the chain: undo, go block by block
                entries.pop(h, None)
        prev = parent
        for h in hashes:
            e = entries.get(h)
            if e is None:
                if room <= 0:
                    self.counters["cap.rejected_blocks"] += len(hashes) - len(newly)
                    break
                room -= 1
                e = entries[h] = (bits, prev, None)
                if prev is not None:
                    if pe is not None and pe[2] is None:
                        entries[prev] = (pe[0], pe[1], h)  # fast path: appending to a chain
                    else:
                        self._add_child(prev, h)
                        room = self.max_blocks - len(entries)
                pcomp &= bits
                if pcomp:
                    neg[h] = -pcomp
                s.add(h)
                newly.append(h)
            else:
                pc, ep, ch = e
                if ep is UNKNOWN:
                    ep = prev
                    if prev is not None:
                        self._add_child(prev, h)
                elif ep != prev:
                    # Chained hashes name their parent; keep the first report.
                    self.counters["stored.parent_conflict"] += 1
                    pcomp = self._parent_comp(e)
                if pc & tb:
                    self.counters["stored.duplicate_blocks"] += 1
                else:
                    pc |= bits
                    s.add(h)
                    newly.append(h)
                e = entries[h] = (pc, ep, ch)
                pcomp &= pc
                self._set_comp(h, ch, pcomp)
            prev = h
            pe = e
        return newly

    def remove(self, node: int, tier: int, hashes: Iterable[int]) -> list[int]:
        """Mark blocks absent from (node, tier); unknown ones are counted and skipped.

        Returns:
            The hashes that were present and are now removed.
        """
        entries = self.entries
        neg = self.negcomp
        s = self.held[node][tier]
        other = self.held[node][1 - tier]
        keep = ~tier_bit(node, tier)
        keep_both = keep & ~local_bit(node)
        removed: list[int] = []
        for h in hashes:
            try:
                s.remove(h)
            except KeyError:
                self.counters["removed.unknown_blocks"] += 1
                continue
            e = entries[h]
            pc = e[0] & (keep if h in other else keep_both)
            if pc == ANY_BIT:
                pc = 0
            if pc == 0 and e[2] is None:  # a leaf held nowhere (the usual eviction): drop it
                neg.pop(h, None)
                self._drop(h, e)
            else:
                e = entries[h] = (pc, e[1], e[2])
                self._set_comp(h, e[2], pc & self._parent_comp(e))
            removed.append(h)
        return removed

    def clear(self, node: int, tier: int | None) -> list[tuple[int, list[int]]]:
        """Drop every block of ``node`` in ``tier`` (None = both tiers).

        Returns:
            ``[(tier, removed hashes)]`` for each cleared tier.
        """
        out = []
        for t in (GPU, HOST) if tier is None else (tier,):
            hs = list(self.held[node][t])
            out.append((t, self.remove(node, t, hs)))
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
        have = self.held[node][tier]
        removed = self.remove(node, tier, list(have - want))
        added: list[int] = []
        entries = self.entries
        bits = tier_bit(node, tier) | local_bit(node) | ANY_BIT
        for h in want - have:
            e = entries.get(h)
            if e is None or e[1] is UNKNOWN:
                if parents is not None and h in parents:
                    p = parents[h]
                else:
                    p = UNKNOWN
                    self.counters["stored.without_parent"] += 1
                if e is None:
                    if len(entries) >= self.max_blocks:
                        self.counters["cap.rejected_blocks"] += 1
                        continue
                    e = (0, p, None)
                else:
                    e = (e[0], p, e[2])
                if p is not None and p is not UNKNOWN:
                    self._add_child(p, h)
            e = entries[h] = (e[0] | bits, e[1], e[2])
            have.add(h)
            self._set_comp(h, e[2], e[0] & self._parent_comp(e))
            added.append(h)
        return added, removed

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

        Cost: one ``bisect`` (O(log L) C-level probes) per distinct length.
        """
        n = len(path)
        neg = self.negcomp
        if n == 0 or not neg[path[0]]:
            return []
        key = neg.__getitem__
        drops: list[tuple[int, int]] = []
        i = 0
        nv = neg[path[0]]  # -comp of the current run
        while True:
            j = bisect_right(path, nv, i + 1, n, key=key)
            if j >= n:
                drops.append((n, -nv))
                return drops
            nj = neg[path[j]]
            drops.append((j, -nv & ~-nj))
            if not nj:
                return drops
            i, nv = j, nj

    def presence(self, h: int) -> int:
        """Presence bits of one block (0 when not indexed)."""
        e = self.entries.get(h)
        return e[0] if e is not None else 0

    def complete_bits(self, h: int) -> int:
        """Completeness bits of one block (0 when not indexed)."""
        return -self.negcomp[h]

    def __len__(self) -> int:
        return len(self.entries)
