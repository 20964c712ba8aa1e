"""A trace held compactly: requests without their block ids, and the ids as prefix differences.

A Claude Code trace at 64-token blocks holds ~72M block ids in ~38,000 requests, but
consecutive requests of a conversation extend one another: only ~2.6M of those ids are new
against the request before. :func:`read_trace_compact` streams a trace file (validated line by
line exactly as :func:`evolving_infra.traces.io.read_trace`), keeps every request as a *stub*
(the same :class:`~evolving_infra.traces.schema.TraceRequest` with ``blocks=[]``) and stores its
ids in a :class:`BlockStore` as ``(reference request, shared prefix length, new ids)`` — the
reference is the previous request of its branch, else of its parent branch, else of its agent
(the order :func:`evolving_infra.traces.tokens.rechain_blocks` uses). Python ints in lists cost
~40 bytes per id; the store costs ~8 bytes per *new* id.

:meth:`CompactTrace.blocks_of` rebuilds a request's id list on demand (the simulator's
``blocks_of`` hook); rebuilding the next request of a branch whose previous request was
rebuilt last costs one list slice and the new ids.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from evolving_infra.traces.io import TraceError, _scan, _Validator, paused_gc
from evolving_infra.traces.schema import TraceHeader, TraceRequest
from evolving_infra.traces.tokens import PrivateIds, rechain_blocks, rechunk_blocks, shared_prefix_len

__all__ = ["BlockStore", "CompactTrace", "compact_requests", "read_trace_compact"]

KEYFRAME_DEPTH = 64
"""A request whose reference chain would be this long stores all its ids (bounds a rebuild that
finds no cached ancestor to ``KEYFRAME_DEPTH`` steps; costs ~1/64 of the full id count)."""


class BlockStore:
    """Block-id lists of requests, each stored as a difference against an earlier one.

    Request ``i``'s ids are ``ids(ref[i])[:k[i]] + flat[off[i]:off[i + 1]]`` (``ref[i] = -1``:
    just the stored ids). Ids are int64 (trace ids are < 2**48). Append-only; indices are
    insertion order.
    """

    __slots__ = ("_flat", "_off", "_ref", "_k", "_depth", "_prev", "_branch", "_cache")

    def __init__(self) -> None:
        self._flat = array("q")
        self._off = array("q", [0])
        self._ref = array("q")
        self._k = array("q")
        self._depth = array("l")
        self._prev = array("q")
        """Id before each stored segment (-1: the segment starts its path)."""
        self._branch: list[str] = []
        self._cache: dict[str, tuple[int, list[int]]] = {}
        """branch -> (index, ids) of the last request of the branch rebuilt (open branches)."""

    def __len__(self) -> int:
        return len(self._ref)

    @property
    def stored_ids(self) -> int:
        """Ids held (the sum of every request's new ids, plus full copies at keyframes)."""
        return len(self._flat)

    @property
    def nbytes(self) -> int:
        """Bytes of the id arrays and per-request tables (the cache of rebuilt lists excluded)."""
        return sum(a.itemsize * len(a) for a in (self._flat, self._off, self._ref, self._k, self._depth, self._prev))

    def add(self, blocks: Sequence[int], branch: str, ref: int = -1, ref_blocks: Sequence[int] | None = None) -> int:
        """Store ``blocks`` against request ``ref`` (whose ids are ``ref_blocks``, the same
        sequence type), or alone (``ref = -1``). Returns the new request's index.

        Raises:
            OverflowError: an id does not fit in int64.
        """
        k = 0
        depth = 0
        if ref >= 0 and ref_blocks is not None:
            k = shared_prefix_len(ref_blocks, blocks)
            depth = self._depth[ref] + 1
            if depth >= KEYFRAME_DEPTH or k == 0:
                ref, k, depth = -1, 0, 0
        else:
            ref = -1
        self._ref.append(ref)
        self._k.append(k)
        self._depth.append(depth)
        self._prev.append(blocks[k - 1] if k else -1)
        self._flat.extend(blocks[k:])
        self._off.append(len(self._flat))
        self._branch.append(branch)
        return len(self._ref) - 1

    def blocks(self, i: int, *, ends_branch: bool = False) -> list[int]:
        """The ids of request ``i`` as a new list (shared elements with earlier results are the
        same int objects). The last result per branch is kept to rebuild the branch's next
        request from; ``ends_branch`` drops it (the branch sends nothing after ``i``).

        Raises:
            IndexError: ``i`` is not a stored request.
        """
        flat, off, refs, ks, cache = self._flat, self._off, self._ref, self._k, self._cache
        pieces: list[list[int]] = [flat[off[i] : off[i + 1]].tolist()]
        need = ks[i]
        j = refs[i]
        while need:
            hit = cache.get(self._branch[j])
            if hit is not None and hit[0] == j:
                pieces.append(hit[1][:need])
                break
            kj = ks[j]
            if kj < need:
                pieces.append(flat[off[j] : off[j] + need - kj].tolist())
                need = kj
            j = refs[j]
        if len(pieces) == 1:
            out = pieces[0]
        else:
            out = pieces.pop()
            while pieces:
                out += pieces.pop()
        br = self._branch[i]
        if ends_branch:
            cache.pop(br, None)
        else:
            cache[br] = (i, out)
        return out

    def chained(self) -> bool:
        """True when the ids are chained (docs/trace-format.md §4: every id follows the same id,
        or starts the path, wherever it appears), checked with numpy sorts over the stored
        segments only: a request's shared prefix repeats pairs of its reference."""
        ids = np.frombuffer(self._flat, dtype=np.int64) if len(self._flat) else np.empty(0, np.int64)
        if not len(ids):
            return True
        off = np.frombuffer(self._off, dtype=np.int64)
        prev = np.empty_like(ids)
        prev[1:] = ids[:-1]
        lens = np.diff(off)
        starts = off[:-1][lens > 0]
        prev[starts] = np.frombuffer(self._prev, dtype=np.int64)[lens > 0]
        order = np.lexsort((prev, ids))
        s_ids, s_prev = ids[order], prev[order]
        return not bool(np.any((s_ids[1:] == s_ids[:-1]) & (s_prev[1:] != s_prev[:-1])))


@dataclass(slots=True)
class CompactTrace:
    """A trace's header, its requests as stubs (``blocks=[]``, file order) and their ids.

    ``blocks_of(stub)`` gives a stub's ids; :meth:`requests_with_blocks` gives the full requests
    back (equal to what :func:`evolving_infra.traces.io.read_trace` returns for the same file).
    """

    header: TraceHeader
    requests: list[TraceRequest]
    store: BlockStore
    index: dict[str, int]
    """request id -> index in ``store`` (and in ``requests``)."""

    def blocks_of(self, req: TraceRequest) -> list[int]:
        """Block ids of the request (or stub) with ``req.id`` (a new list).

        Raises:
            KeyError: no request has that id.
        """
        return self.store.blocks(self.index[req.id], ends_branch=req.ends_branch)

    def iter_with_blocks(self) -> Iterator[TraceRequest]:
        """The full requests, in file order, one at a time."""
        store = self.store
        for i, r in enumerate(self.requests):
            yield msgspec.structs.replace(r, blocks=store.blocks(i, ends_branch=r.ends_branch))

    def requests_with_blocks(self) -> list[TraceRequest]:
        """Every full request (as much memory as the uncompact trace)."""
        return list(self.iter_with_blocks())

    def rechained(self) -> tuple[CompactTrace, int]:
        """This trace with chained ids (``tokens.rechain_blocks``) and the occurrences remapped.

        A chained trace (the usual case, checked without rebuilding a list) is returned as is.
        Otherwise the full requests are rebuilt, rechained and compacted again (as much memory
        as the uncompact trace, once).
        """
        if self.store.chained():
            return self, 0
        out, remapped = rechain_blocks(self.requests_with_blocks())
        return compact_requests(self.header, out), remapped

    def at_block_size(self, to_size: int) -> CompactTrace:
        """The trace at another block size (``tokens.rechunk_blocks``, private ids allocated in
        file order as ``evolving_infra.sim.run.convert_block_size`` does); ``self`` if equal.

        Raises:
            ValueError: the sizes do not divide one another, or an id cannot be split.
        """
        from_size = self.header.block_size
        if to_size == from_size:
            return self
        private = PrivateIds()
        header = msgspec.structs.replace(self.header, block_size=to_size)
        store = self.store
        return _compact(
            header,
            ((r, rechunk_blocks(store.blocks(i, ends_branch=r.ends_branch), r.input_tokens, from_size, to_size,
                                private=private))
             for i, r in enumerate(self.requests)),
        )


class _Builder:
    """Stores requests in file order against their reference (module docstring)."""

    def __init__(self) -> None:
        self.store = BlockStore()
        self.stubs: list[TraceRequest] = []
        self.index: dict[str, int] = {}
        self.last_branch: dict[str, tuple[int, list[int]]] = {}
        """open branch -> (index, ids) of its last request so far"""
        self.last_agent: dict[str, tuple[int, list[int]]] = {}

    def add(self, req: TraceRequest, blocks: list[int]) -> None:
        ref = self.last_branch.get(req.branch)
        if ref is None and req.parent_branch is not None:
            ref = self.last_branch.get(req.parent_branch)
        if ref is None:
            ref = self.last_agent.get(req.agent)
        i = self.store.add(blocks, req.branch, *(ref if ref is not None else (-1, None)))
        self.index[req.id] = i
        self.stubs.append(msgspec.structs.replace(req, blocks=[]) if req.blocks else req)
        entry = (i, blocks)
        if req.ends_branch:  # a later fork of it falls back to its agent's last request
            self.last_branch.pop(req.branch, None)
        else:
            self.last_branch[req.branch] = entry
        self.last_agent[req.agent] = entry


def _compact(header: TraceHeader, items: Iterable[tuple[TraceRequest, list[int]]]) -> CompactTrace:
    b = _Builder()
    with paused_gc():
        for req, blocks in items:
            b.add(req, blocks)
    return CompactTrace(header, b.stubs, b.store, b.index)


def compact_requests(header: TraceHeader, requests: Sequence[TraceRequest]) -> CompactTrace:
    """In-memory requests (file order) as a :class:`CompactTrace` (not validated)."""
    return _compact(header, ((r, r.blocks) for r in requests))


def read_trace_compact(path: str | os.PathLike[str]) -> CompactTrace:
    """Read and validate a trace file like :func:`~evolving_infra.traces.io.read_trace`, holding it
    as a :class:`CompactTrace`: memory O(requests + new ids) instead of O(all ids).

    Raises:
        TraceError: one or more lines are bad; ``err.problems`` lists every one as
            ``line N: reason`` (the whole file is checked first), exactly as ``read_trace``.
        OSError: the file cannot be read.
    """
    v = _Validator()
    trace = _compact(TraceHeader(format="evolving-infra-trace", block_size=1), ((r, r.blocks) for r in _scan(path, v)))
    if v.problems:
        raise TraceError(path, v.problems)
    assert v.header is not None
    trace.header = v.header
    return trace
