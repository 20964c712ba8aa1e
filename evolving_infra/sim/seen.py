"""The set of block ids a simulation has sent so far, held compactly.

The simulator asks, for every request it sends, how many of its leading blocks were sent
before (the request's ideal cached tokens, ``RequestRecord.ideal_cached_tokens``), then adds
the rest. A Python ``set`` of the ids costs ~70–90 bytes per id (the int object and its
slot); a 1-hour 9-node run sends about a million distinct ids. :class:`SeenIds` keeps them
in a sorted ``int64`` numpy array (8 bytes per id) plus a Python set of the ids added since
the last merge, merged once that set outgrows ``max(262,144, len(array) / 8)`` (amortised
O(log n) per id). Membership is exactly that of a set: the simulation's output does not
change. Ids outside int64 (a trace may use any int) switch it to a plain set for good.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice, takewhile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

__all__ = ["SeenIds"]

FIRST_CHUNK = 8
"""Blocks :meth:`SeenIds.leading` looks up first; each further chunk is four times longer."""

MERGE_MIN = 1 << 18
"""The pending set is merged into the array once it holds more than this many ids (or an
eighth of the array, whichever is larger). A set probe answers a send whose first block is new;
after a merge each such send also costs a numpy ``searchsorted`` call (~1 µs): a 600-s 9-node
run at 512-token blocks sends ~74,000 ids, merged once at 65,536 (1 << 16 before 2026-12-07)
and then probed the array ~4,000 times: 0.3% of its instructions; at 64-token blocks (~600,000
ids) 2 merges instead of 8, -0.24%. 1 << 17 gave the same at 512 and half at 64; 1 << 19 cost
+0.25% at 64. The set's table and the ids it keeps alive: ~16 MB at most (peak RSS of those
runs unchanged: 96.1 -> 96.6 MB, 194.0 -> 192.5 MB)."""


class SeenIds:
    """A grow-only set of block ids (ints): :meth:`leading` and :meth:`update`.

    Memory: 8 bytes per merged id plus a Python set of at most ``max(262,144, n / 8)`` recent
    ids (``n`` ids in all); a merge briefly needs about three times the array.
    """

    __slots__ = ("_arr", "_new", "_plain")

    def __init__(self) -> None:
        self._arr: Any = ()  # the merged ids: a sorted int64 array from the first merge on (numpy only then)
        self._new: set[int] = set()
        self._plain = False

    def __len__(self) -> int:
        return len(self._arr) + len(self._new)

    def __contains__(self, h: int) -> bool:
        if h in self._new:
            return True
        a = self._arr
        if self._plain or not len(a) or not (-(1 << 63) <= h < (1 << 63)):
            return False
        i = int(a.searchsorted(h))
        return i < len(a) and int(a[i]) == h

    def leading(self, blocks: Sequence[int], start: int = 0) -> int:
        """How many of ``blocks[start:]``, from the first on, are in the set.

        Looked up in chunks of growing length (:data:`FIRST_CHUNK`, then ×4), stopping at the
        chunk holding the first id not in the set: O(k log n) in C for ``k`` ≤ ~4 × (the answer
        + ``FIRST_CHUNK``) blocks, plus a Python step per block found only among the recent
        ids. Most sends continue a branch with new blocks (answer 0): their first block alone
        is looked up (a set probe and one binary search; a numpy chunk of a few ids costs
        several times more), not a chunk nor the whole rest of the path."""
        n = len(blocks) - start
        if n <= 0:
            return 0
        if self._plain or not len(self._arr):
            return len(list(takewhile(self._new.__contains__, islice(blocks, start, None))))
        if blocks[start] not in self:  # most calls: the first block is new
            return 0
        done = 0
        m = FIRST_CHUNK
        while done < n:
            if m > n - done:
                m = n - done
            k = self._leading_chunk(blocks, start + done, m)
            done += k
            if k < m:
                return done
            m <<= 2
        return done

    def _leading_chunk(self, blocks: Sequence[int], s: int, m: int) -> int:
        """How many of ``blocks[s:s + m]`` (1 ≤ m), from the first on, are in the set."""
        new = self._new
        a = self._arr
        try:
            x = np.fromiter(islice(blocks, s, s + m), dtype=np.int64, count=m)
        except OverflowError:
            return len(list(takewhile(self.__contains__, islice(blocks, s, s + m))))
        idx = a.searchsorted(x)
        idx[idx == len(a)] = 0
        missing = np.flatnonzero(a[idx] != x)
        for j in missing.tolist():  # not in the array: in the recent ids, or the end of the run
            if blocks[s + j] not in new:
                return j
        return m

    def update(self, ids: Iterable[int]) -> None:
        """Add ``ids`` (any ints; ids already in the set are fine)."""
        new = self._new
        new.update(ids)
        if not self._plain and len(new) > MERGE_MIN and len(new) > len(self._arr) >> 3:  # > max(MERGE_MIN, n / 8)
            try:
                add = np.fromiter(new, dtype=np.int64, count=len(new))
            except OverflowError:  # an id outside int64: a plain set from now on
                if len(self._arr):
                    new.update(self._arr.tolist())
                self._arr = ()
                self._plain = True
                return
            self._arr = _merge_sorted_unique(self._arr, add) if len(self._arr) else np.sort(add)
            new.clear()


def _merge_sorted_unique(arr: np.ndarray, add: np.ndarray) -> np.ndarray:
    """``np.union1d(arr, add)`` for a sorted, unique ``arr`` and distinct ``add``: ``add`` is sorted
    alone and the two runs merged by a stable sort (timsort: linear in two runs), then repeats
    dropped. numpy 2's ``union1d`` hashes every element first (``unique``): ~0.2 s per merge of
    half a million ids, 15% of a 600-s simulation at 64-token blocks."""
    out = np.concatenate((arr, np.sort(add)))
    out.sort(kind="stable")
    keep = np.empty(len(out), dtype=bool)
    keep[:1] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]
