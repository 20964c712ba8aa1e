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

:func:`read_trace_compact` does not decode the ids a request shares with its reference either:
it keeps each request's ``blocks`` as JSON text (cut from the line, :func:`_stub_and_text`), finds
the shared ids by comparing that text with the reference's (:func:`shared_text_prefix`) and
decodes only the rest.
:meth:`CompactTrace.at_block_size` to coarser blocks slices the stored ids (numpy), no list rebuilt.
"""

from __future__ import annotations

import os
from array import array
from struct import pack as _pack
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any, TYPE_CHECKING

import msgspec
if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np
from msgspec import Meta

from evolving_infra.traces.inflate import InflateAhead
from evolving_infra.traces.io import PACK_MAGIC, TraceError, _request_type, _scan_runs, _Validator, paused_gc
from evolving_infra.traces.schema import MAX_BLOCK_ID, TraceHeader, TraceRequest
from evolving_infra.traces.tokens import PrivateIds, rechain_blocks, rechunk_blocks, shared_prefix_len
from shared.values import Value

__all__ = ["BlockStore", "CompactTrace", "compact_requests", "read_trace_compact"]

KEYFRAME_DEPTH = 64
"""A request whose reference chain would be this long stores all its ids (bounds a rebuild that
finds no cached ancestor to ``KEYFRAME_DEPTH`` steps; costs ~1/64 of the full id count)."""


def holder_of(k: np.ndarray, ref: np.ndarray, at: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """For each request ``at[i]`` and id position ``pos[i]`` in it, the request that stores that
    id (:meth:`BlockStore.id_at` for all at once): references are followed while the position is
    among the request's shared ids (``pos < k``). ``k`` and ``ref`` are a store's ``_k`` and
    ``_ref`` as arrays; ``at`` is updated in place and returned. O(reference depth) numpy steps."""
    while True:
        back = pos < k[at]
        if not back.any():
            return at
        at[back] = ref[at[back]]


class BlockStore:
    """Block-id lists of requests, each stored as a difference against an earlier one.

    Request ``i``'s ids are ``ids(ref[i])[:k[i]] + flat[off[i]:off[i + 1]]`` (``ref[i] = -1``:
    just the stored ids). Ids are int64 (trace ids are < 2**48). Append-only; indices are
    insertion order.
    """

    __slots__ = ("_flat", "_off", "_ref", "_k", "_depth", "_prev", "_branch", "_cache", "_chained")

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
        self._chained: tuple[int, bool] | None = None
        """(stored ids when checked, :meth:`chained`'s answer then): the store is append-only."""

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

    def add_segment(self, new: Sequence[int], k: int, branch: str, ref: int = -1) -> int:
        """Store a request whose ids are request ``ref``'s first ``k`` then ``new`` (``k`` as
        :meth:`add` finds it, or fewer; ``k = 0`` or ``ref = -1``: ``new`` is every id). The caller
        keeps the reference chain shorter than :data:`KEYFRAME_DEPTH` (:meth:`depth`). Returns
        the new request's index."""
        if ref < 0 or k == 0:
            ref, k, depth, prev = -1, 0, 0, -1
        else:
            depth = self._depth[ref] + 1
            prev = self.id_at(ref, k - 1)
        self._ref.append(ref)
        self._k.append(k)
        self._depth.append(depth)
        self._prev.append(prev)
        if type(new) is list:
            self._flat.fromlist(new)  # half the time of extend (which takes any iterable)
        else:
            self._flat.extend(new)
        self._off.append(len(self._flat))
        self._branch.append(branch)
        return len(self._ref) - 1

    _TABLES = (("_off", "q"), ("_ref", "q"), ("_k", "q"), ("_depth", "l"), ("_prev", "q"))

    def _as_lists(self) -> None:
        """Hold the per-request tables (not the ids) as lists while a reader appends to them a
        request at a time (``list.append`` ~40 instructions; ``array.append`` ~500, most of it
        ``PyArg_Parse`` of the item); :meth:`_as_arrays` makes them arrays again. Every method
        but :attr:`nbytes`, :meth:`coarsened` and :meth:`chained` works on either."""
        for name, _ in self._TABLES:
            setattr(self, name, list(getattr(self, name)))

    def _as_arrays(self) -> None:
        """The tables as arrays again (:meth:`_as_lists`), each packed in one call."""
        for name, code in self._TABLES:
            t = getattr(self, name)
            a = array(code)
            if t:
                a.frombytes(_pack(f"{len(t)}{code}", *t))
            setattr(self, name, a)

    def prefix(self, i: int, k: int) -> list[int]:
        """The first ``k`` ids of request ``i`` (``k`` at most its length) as a new list, taken from
        the stored segments (the rebuild cache of :meth:`blocks` neither read nor changed).

        Raises:
            IndexError: ``i`` is not a stored request.
        """
        flat, off, ks, refs = self._flat, self._off, self._k, self._ref
        pieces: list[list[int]] = []
        while k:
            ki = ks[i]
            if ki < k:
                pieces.append(flat[off[i] : off[i] + k - ki].tolist())
                k = ki
            i = refs[i]
        out: list[int] = []
        for piece in reversed(pieces):
            out += piece
        return out

    def depth(self, i: int) -> int:
        """References followed to rebuild request ``i`` from stored ids alone (0: a keyframe)."""
        return self._depth[i]

    def id_at(self, i: int, pos: int) -> int:
        """Id ``pos`` of request ``i`` (``0 <= pos <`` its length), without rebuilding its list.

        Raises:
            IndexError: ``i`` is not a stored request, or ``pos`` is past its ids.
        """
        ks, refs = self._k, self._ref
        while pos < ks[i]:
            i = refs[i]
        j = self._off[i] + pos - ks[i]
        if j >= self._off[i + 1]:
            raise IndexError(f"request {i} has no id {pos}")
        return self._flat[j]

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

    def coarsened(self, m: int, lengths: Sequence[int]) -> BlockStore:
        """The store of every request's ids at ``m`` times coarser blocks: coarse id ``j`` is fine
        id ``m*j + m - 1`` (``tokens.rechunk_blocks``: ids are chained, the last fine id of a
        coarse block stands for it), ``lengths[i] // m`` of them, where ``lengths[i]`` is request
        ``i``'s fine id count. Taken from the stored segments with numpy (one gather, no list
        rebuilt, no step per request but the reference depths): a request shares with its
        reference the coarse blocks its shared fine ids cover (``k // m``), and every other coarse
        id lies in its own stored segment.

        Raises:
            ValueError: a request does not hold ``lengths[i]`` ids.
        """
        out = BlockStore()
        flat, off, ref, k = (np.frombuffer(a, dtype=np.int64) if len(a) else np.empty(0, np.int64)
                             for a in (self._flat, self._off, self._ref, self._k))
        fine_n = np.asarray(lengths, dtype=np.int64).reshape(-1)
        lo = off[:-1]
        held = k + off[1:] - lo
        if len(fine_n) != len(k) or np.any(held != fine_n):
            i = int(np.argmax(held != fine_n)) if len(fine_n) == len(k) else min(len(k), len(fine_n))
            raise ValueError(f"request {i} holds {int(held[i]) if i < len(k) else 0} ids, not "
                             f"{int(fine_n[i]) if i < len(fine_n) else 0}")
        kc = k // m
        n = fine_n // m - kc  # >= 0: fine_n >= k
        start = lo + m * kc + m - 1 - k  # fine id m*kc + m - 1, the first past the shared ones
        out_off = np.zeros(len(n) + 1, dtype=np.int64)
        np.cumsum(n, out=out_off[1:])
        # request i's coarse ids: flat[start[i] + m*j] for j < n[i], every request's in one gather
        pick = np.repeat(start - m * out_off[:-1], n) + m * np.arange(out_off[-1], dtype=np.int64)
        has = kc > 0
        cur = np.flatnonzero(has)  # the fine id before each request's new coarse ids: id m*kc - 1,
        pos = m * kc[cur] - 1  # found by following references (BlockStore.id_at, for all at once)
        at = holder_of(k, ref, cur.copy(), pos)
        prev = np.full(len(k), -1, dtype=np.int64)
        prev[cur] = flat[off[at] + pos - k[at]]
        depth = [0] * len(k)
        refs = ref.tolist()
        for i in cur.tolist():  # references point back
            depth[i] = depth[refs[i]] + 1
        out._flat.frombytes(flat[pick].tobytes())
        out._off = array("q", out_off.tobytes())
        out._ref = array("q", np.where(has, ref, -1).tobytes())
        out._k = array("q", kc.tobytes())
        out._depth = array("l", depth)
        out._prev = array("q", prev.tobytes())
        out._branch = list(self._branch)
        return out

    def chained(self) -> bool:
        """True when the ids are chained (docs/trace-format.md §4: every id follows the same id,
        or starts the path, wherever it appears), checked with a numpy sort over the stored
        segments only: a request's shared prefix repeats pairs of its reference. The answer is
        kept until an id is added (``simulate`` checks what the CLI has already checked)."""
        if self._chained is not None and self._chained[0] == len(self._flat):
            return self._chained[1]
        ok = self._check_chained()
        self._chained = (len(self._flat), ok)
        return ok

    def known_chained(self) -> None:
        """Take the ids as chained without :meth:`chained`'s sort (until an id is added): for a store
        known to be chained elsewhere (the trace cache keeps only chained traces' packs, checked
        when it wrote them)."""
        self._chained = (len(self._flat), True)

    def _check_chained(self) -> bool:
        ids = np.frombuffer(self._flat, dtype=np.int64) if len(self._flat) else np.empty(0, np.int64)
        if not len(ids):
            return True
        off = np.frombuffer(self._off, dtype=np.int64)
        prev = np.empty_like(ids)
        prev[1:] = ids[:-1]
        lens = np.diff(off)
        starts = off[:-1][lens > 0]
        prev[starts] = np.frombuffer(self._prev, dtype=np.int64)[lens > 0]
        order = np.argsort(ids, kind="stable")  # equal ids side by side, their preceding ids in any order:
        s_ids, s_prev = ids[order], prev[order]  # all equal iff each equals its neighbour (timsort: ids mostly ascend)
        return not bool(np.any((s_ids[1:] == s_ids[:-1]) & (s_prev[1:] != s_prev[:-1])))


class CompactTrace(Value):
    """A trace's header, its requests as stubs (``blocks=[]``, file order) and their ids.

    ``blocks_of(stub)`` gives a stub's ids; :meth:`requests_with_blocks` gives the full requests
    back (equal to what :func:`evolving_infra.traces.io.read_trace` returns for the same file).
    """

    header: TraceHeader
    requests: list[TraceRequest]
    store: BlockStore
    index: dict[str, int]
    """request id -> index in ``store`` (and in ``requests``)."""

    __slots__ = __match_args__ = ("header", "requests", "store", "index")

    def __init__(
        self, header: TraceHeader, requests: list[TraceRequest], store: BlockStore, index: dict[str, int],
    ) -> None:
        self.header = header
        self.requests = requests
        self.store = store
        self.index = index

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
        Coarser blocks are sliced from the stored ids (:meth:`BlockStore.coarsened`), finer ones
        rebuilt request by request.

        Raises:
            ValueError: the sizes do not divide one another, or an id cannot be split.
        """
        from_size = self.header.block_size
        if to_size == from_size:
            return self
        header = msgspec.structs.replace(self.header, block_size=to_size)
        store = self.store
        if to_size > from_size and to_size % from_size == 0:  # coarser: slices of the stored ids
            fine = store.coarsened(to_size // from_size, [r.input_tokens // from_size for r in self.requests])
            return CompactTrace(header, list(self.requests), fine, dict(self.index))
        private = PrivateIds()
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
        self.last_branch: dict[str, tuple[int, Any]] = {}
        """open branch -> (index, ids) of its last request so far (:class:`_TextBuilder`: the ids'
        JSON text and count instead of the ids)"""
        self.last_agent: dict[str, tuple[int, Any]] = {}

    def add(self, req: TraceRequest, blocks: list[int]) -> None:
        ref = self._ref_of(req)
        i = self.store.add(blocks, req.branch, *(ref if ref is not None else (-1, None)))
        self._added(req, i, blocks)

    def _ref_of(self, req: TraceRequest) -> tuple[int, Any] | None:
        """The request ``req``'s ids are stored against: the last of its branch, else of its
        parent branch, else of its agent (None: the first of its agent)."""
        ref = self.last_branch.get(req.branch)
        if ref is None and req.parent_branch is not None:
            ref = self.last_branch.get(req.parent_branch)
        if ref is None:
            ref = self.last_agent.get(req.agent)
        return ref

    def _added(self, req: TraceRequest, i: int, ids: Any) -> None:
        self.index[req.id] = i
        self.stubs.append(msgspec.structs.replace(req, blocks=[]) if req.blocks else req)
        entry = (i, ids)
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


_STUB: list[tuple[msgspec.json.Decoder[Any], tuple[str, ...]]] = []


def _stub_decoder() -> tuple[msgspec.json.Decoder[Any], tuple[str, ...]]:
    """The decoder of a request line with its ``blocks`` left as JSON text (``msgspec.Raw``: skipped
    in C, no ints made) and its struct's other fields; made the first time a line is not cut
    (:func:`_stub_and_text`): the usual trace is read without it (~0.5 ms of set-up at import)."""
    if not _STUB:
        stub = _request_type(msgspec.Raw, msgspec.Raw(b"[]"))
        _STUB.append((msgspec.json.Decoder(stub), tuple(f for f in stub.__struct_fields__ if f != "blocks")))
    return _STUB[0]


_REQUEST_DECODER = msgspec.json.Decoder(TraceRequest)
_IDS_DECODER = msgspec.json.Decoder(list[Annotated[int, Meta(ge=0, le=MAX_BLOCK_ID)]])
_COMMA, _CLOSE, _COLON, _OPEN = ord(","), ord("]"), ord(":"), ord("[")
_DELIMS = (_COMMA, _CLOSE)
_replace = msgspec.structs.replace
_KEY = b'"blocks":['
_NAME = b'"blocks"'


def _stub_and_text(buf: bytes, s: int, e: int) -> tuple[TraceRequest, bytes, int, int]:
    """The request on line ``buf[s:e]`` decoded without its ids (a stub: ``blocks=[]``) and where its
    ``blocks`` JSON text is: ``(stub, text, a, b)``, the text being ``text[a:b]`` (``text`` is ``buf``
    itself when the line was cut, else the JSON value's text alone).

    The usual line is cut, not scanned by the JSON decoder: with no escape in it, the only
    ``"blocks"`` token, followed by ``:[``, is an object key, and its array ends at the next ``]``
    if it holds ints; the line with that array replaced by ``[0]`` must decode with ``[0]`` as its
    ``blocks`` (else the key was another object's, or the array held more than ints, and the whole
    line is decoded). Only the text around the array is searched for escapes and other
    ``"blocks"`` tokens: the array itself is not checked here, the caller decodes every id it does
    not match byte for byte against a valid reference (``_TextBuilder._split``), so an array that
    holds anything but ids fails there, and a line is taken exactly when the JSON decoder would
    take it.

    Raises:
        msgspec.DecodeError: the line is not a valid request apart from its ids.
    """
    i = buf.find(_KEY, s, e)
    if i >= 0:
        j = buf.find(b"]", i, e)
        if j > i and buf.find(b"\\", s, i) < 0 and buf.find(b"\\", j, e) < 0 and buf.find(_NAME, s, i + 7) < 0 and buf.find(_NAME, j, e) < 0:
            try:
                req = _REQUEST_DECODER.decode(buf[s : i + 10] + b"0" + buf[j:e])
            except msgspec.DecodeError:
                req = None
            if req is not None and req.blocks == [0]:
                return msgspec.structs.replace(req, blocks=[]), buf, i + 9, j + 1
    decoder, fields = _stub_decoder()
    st = decoder.decode(buf[s:e])
    text = bytes(st.blocks)
    return TraceRequest(**{f: getattr(st, f) for f in fields}), text, 0, len(text)


def shared_text_prefix(ref: bytes, ref_n: int, buf: bytes, start: int = 0, end: int | None = None) -> tuple[int, int]:
    """How many leading ids two JSON int arrays share, read from their text alone.

    ``ref`` is a valid array of ``ref_n`` ids *without its closing* ``]`` (``b"[1,2"``); the new
    array is ``buf[start:end]`` (default: all of ``buf``), valid JSON or text from ``[`` to its only
    ``]`` (:func:`_stub_and_text`). Returns ``(k, e)``: the first ``k`` ids of the new array are
    ``ref``'s first ``k`` and ``buf[e]`` is the delimiter after them (``,`` or ``]``; the caller
    checks that what follows is ids); ``(0, -1)`` when nothing is shared (or the new text is no
    array). ``k`` is the longest common prefix of the two id lists unless they are written
    differently (spaces, ``-0``): then it may be shorter, never wrong — equal text up to a
    delimiter is equal ids, and ids past ``k`` are decoded from the new text. Nothing is copied in
    the usual case (the new array extends ``ref``).
    """
    if end is None:
        end = len(buf)
    if ref_n == 0:
        return 0, -1
    if buf.startswith(ref, start, end):  # the usual case: a conversation extends its previous request
        p = len(ref)
        c = ref_n - 1
        mine = _CLOSE  # ref's own delimiter at p
    else:  # some byte before ref's end differs (the new text ends with a ']' that ref lacks)
        m = min(len(ref), end - start)
        r = np.frombuffer(ref, np.uint8, m)
        p = int((r != np.frombuffer(buf, np.uint8, m, start)).argmax())
        c = int(np.count_nonzero(r[:p] == _COMMA))  # bytes.count steps byte by byte: ~5x the instructions at 17 KB
        mine = ref[p]
    if mine in (_COMMA, _CLOSE) and buf[start + p] in (_COMMA, _CLOSE):
        return c + 1, start + p  # the same id's text ends at p in both (before different delimiters, or equal)
    if c == 0:
        return 0, -1
    return c, start + ref.rfind(b",", 0, p)


class _TextBuilder(_Builder):
    """Reads request lines into the store without decoding the ids a request shares with its
    reference: they are found by comparing the two ``blocks`` arrays' JSON text
    (:func:`shared_text_prefix`, in C and numpy) and only the ids after them are decoded (a
    conversation's new ids). A line this cannot take (malformed, or ids it cannot split off)
    goes through the validator's own decode instead, so problems are reported exactly as
    :func:`~evolving_infra.traces.io.read_trace` reports them. The text kept per open branch is
    its last request's ids' text without the closing ``]``."""

    def __init__(self, v: _Validator) -> None:
        super().__init__()
        self.v = v
        self._chunk: bytes | None = None
        """The last ``buf`` :meth:`feed_run` was given (a whole chunk of the file, shared by its lines)."""
        self._chunk_bs = True
        """Whether ``_chunk`` holds a backslash anywhere: searched once per chunk, not once per line."""
        self._name_from = -1
        self._name_at = -1
        """The first "blocks" token of ``_chunk`` at or after ``_name_from`` (-1: none; ``_name_from``
        -1: not searched): the previous line's search past its ids, which finds the next line's."""

    def feed_run(self, line: int, buf: bytes, starts: list[int], ends: list[int]) -> int:
        """Take the lines of a :data:`~evolving_infra.traces.io.Run` (line ``i`` is
        ``buf[starts[i]:ends[i]]``, its end excluded), the lines after line ``line`` (1-based) of the
        file; returns the number of the last. One call a run, the loop over its lines written here
        (no call, generator step or attribute look-up of the reader's state per line).
        The usual line (cut by :func:`_stub_and_text`'s fast path; a request that extends its
        reference's text) is taken here in one frame: the steps of :meth:`_split`,
        :meth:`_Validator.feed_checked`, :meth:`BlockStore.add_segment` and :meth:`_added` written
        out, the same values in the same order (~40% of the Python time per line of reading a
        16,000-request trace was calls and attribute look-ups between those). Any other line
        takes :meth:`_feed_split`, the general path."""
        if buf is not self._chunk:
            self._chunk = buf
            self._chunk_bs = buf.find(b"\\") >= 0
            self._name_from = -1
        chunk_bs, name_from, name_at = self._chunk_bs, self._name_from, self._name_at
        find = buf.find
        startswith = buf.startswith
        decode = _REQUEST_DECODER.decode
        decode_ids = _IDS_DECODER.decode
        v = self.v
        vids, id_line, branches, problems = v.ids, v.id_line, v.branches, v.problems
        last_branch, last_agent, index, stubs = self.last_branch, self.last_agent, self.index, self.stubs
        store = self.store
        depths, ks, refs, off, flat = store._depth, store._k, store._ref, store._off, store._flat
        prevs, branch_of = store._prev, store._branch
        pend: list[int] = []  # the run's new ids not yet in flat (one struct.pack for the run, not array.fromlist a line)
        base = len(flat)  # flat's length when pend began: id q is flat[q] below it, pend[q - base] from it
        for s, e in zip(starts, ends):
            line += 1
            if line == 1:
                self.v.feed(1, buf[s:e])
                continue
            # _stub_and_text's cut, its checks in fewer calls (each bytes.find with bounds costs more in
            # parsing its arguments than in searching): the first "blocks" token followed by ":[" is
            # the first _KEY with no "blocks" token before it; no backslash anywhere in the line is
            # stricter than none outside the array (a line with one goes the general way, which
            # takes it or not as before). The line is searched for one only when its chunk holds one
            # (one search of the chunk, ~1,200 instructions of a call saved per line: the usual
            # trace has none)
            # The line's first "blocks" token is the one the previous line's search past its ids found,
            # when that search ran over this chunk from before this line and found none before it
            # (a token never crosses a line's end): one bytes.find call fewer a line.
            at = name_at
            if 0 <= name_from <= s and (at < 0 or at >= s):
                i = at if at < e else -1
            else:
                i = find(_NAME, s, e)
            if (i < 0 or i + 10 > e or buf[i + 8] != _COLON or buf[i + 9] != _OPEN
                    or (chunk_bs and find(b"\\", s, e) >= 0)):
                pend, base = self._general(self._feed_split, pend, line, buf, s, e)
                continue
            j = find(b"]", i, e)
            if j < 0:
                pend, base = self._general(self._feed_split, pend, line, buf, s, e)
                continue
            at = find(_NAME, j)  # past this line too: the next line's first, if this line has no other
            name_from = j
            name_at = at
            if 0 <= at < e:
                pend, base = self._general(self._feed_split, pend, line, buf, s, e)
                continue
            try:
                req = decode(buf[s : i + 10] + b"0" + buf[j:e])
            except msgspec.DecodeError:
                pend, base = self._general(self._feed_split, pend, line, buf, s, e)
                continue
            probe = req.blocks
            if probe != [0]:
                pend, base = self._general(self._feed_split, pend, line, buf, s, e)
                continue
            probe.clear()  # the stub: the decoded request, its own list emptied (equal to replace(req, blocks=[]), one struct fewer)
            stub = req
            a, b = i + 9, j + 1  # the ids' text is buf[a:b], "[" to "]"
            branch = stub.branch
            ref = last_branch.get(branch)
            if ref is None and stub.parent_branch is not None:
                ref = last_branch.get(stub.parent_branch)
            if ref is None:
                ref = last_agent.get(stub.agent)
            k = 0
            r = -1
            try:
                if ref is not None:
                    r, (ref_text, ref_n) = ref
                    p = a + len(ref_text)
                    if ref_n and startswith(ref_text, a, b) and buf[p] in _DELIMS:  # shared_text_prefix's usual case
                        k, d = ref_n, p
                    else:
                        k, d = shared_text_prefix(ref_text, ref_n, buf, a, b)
                if k == 0:
                    new = decode_ids(memoryview(buf)[a:b])
                    r = -1
                elif buf[d] == _CLOSE:  # every id shared
                    new = []
                else:
                    new = decode_ids(b"[" + buf[d + 1 : b])
                    if not new:  # ",]"
                        raise msgspec.DecodeError("a comma before the array's end")
            except msgspec.DecodeError:  # the validator's own decode and report
                pend, base = self._general(self._feed_invalid, pend, line, buf, s, e)
                continue
            if k and depths[r] + 1 >= KEYFRAME_DEPTH:  # a keyframe stores every id: the shared ones
                _store_ids(flat, pend)  # copied from the store, not decoded again (~560 instructions an id)
                pend = []
                base = len(flat)
                new = store.prefix(r, k) + new
                k, r = 0, -1
            n = k + len(new)
            # _Validator._check_request(line, stub, ids_checked=True, n_blocks=n), its usual case written
            # out (~1 µs of its ~2.5 a line): a new id; the id count its tokens give; no `after`, or one
            # request of the same agent; a branch of that agent open already, neither kind nor parent set.
            # Any other line takes the call, which finds and records exactly what it did before.
            rid = stub.id
            agent = stub.agent
            br = branches.get(branch)
            after = stub.after
            bs = v.block_size
            if (br is not None and br.agent == agent and not br.ended_line and rid not in vids
                    and (not after or (len(after) == 1 and vids.get(after[0]) == agent))
                    and stub.kind is None and stub.parent_branch is None and bs is not None and n == stub.input_tokens // bs):
                vids[rid] = agent
                id_line[rid] = line
                br.last_line = line
                if stub.ends_branch:
                    br.ended_line = line
            else:
                n_before = len(problems)
                v._check_request(line, stub, ids_checked=True, n_blocks=n)
                if len(problems) != n_before:
                    continue
            # BlockStore.add_segment(new, k, branch, r)
            if k:
                depth = depths[r] + 1
                pos, at = k - 1, r  # BlockStore.id_at(r, k - 1)
                while pos < ks[at]:
                    at = refs[at]
                q = off[at] + pos - ks[at]
                if q >= off[at + 1]:
                    raise IndexError(f"request {at} has no id {pos}")
                prev = flat[q] if q < base else pend[q - base]
            else:
                depth, prev = 0, -1
            refs.append(r)
            ks.append(k)
            depths.append(depth)
            prevs.append(prev)
            pend += new
            off.append(base + len(pend))
            branch_of.append(branch)
            idx = len(refs) - 1
            # _Builder._added(stub, idx, (text, n))
            index[rid] = idx
            stubs.append(stub)
            entry = (idx, (buf[a : b - 1], n))
            if stub.ends_branch:
                last_branch.pop(branch, None)
            else:
                last_branch[branch] = entry
            last_agent[agent] = entry
        _store_ids(flat, pend)
        self._name_from, self._name_at = name_from, name_at
        return line

    def _general(self, take: Any, pend: list[int], line: int, buf: bytes, s: int, e: int) -> tuple[list[int], int]:
        """:meth:`feed_run`'s line that takes the general path ``take`` (:meth:`_feed_split`,
        :meth:`_feed_invalid`), which stores its ids itself: the run's ids pending before it are
        stored first. Returns the pending ids and their base anew."""
        flat = self.store._flat
        _store_ids(flat, pend)
        take(line, buf, s, e)
        return [], len(flat)

    def _feed_split(self, line: int, buf: bytes, s: int, e: int) -> None:
        """:meth:`feed_run`'s line its fast path does not take: :meth:`_split`, then the validator."""
        try:
            stub, text, new, k, ref = self._split(buf, s, e)
        except msgspec.DecodeError:
            return self._feed_invalid(line, buf, s, e)
        if self.v.feed_checked(line, stub, k + len(new)):
            self._added(stub, self.store.add_segment(new, k, stub.branch, ref), (text, k + len(new)))
        return None

    def _feed_invalid(self, line: int, buf: bytes, s: int, e: int) -> None:
        """A line that does not split: the validator's own decode and report."""
        req = self.v.feed(line, buf[s:e])
        if req is not None:  # (not expected: a valid line splits)
            self._added(req, self.store.add_segment(req.blocks, 0, req.branch), (msgspec.json.encode(req.blocks)[:-1], len(req.blocks)))

    def _split(self, buf: bytes, s: int, e: int) -> tuple[TraceRequest, bytes, list[int], int, int]:
        """(stub, ids' text without its ``]``, ids after the shared ones, shared count, reference index).

        Raises:
            msgspec.DecodeError: the line is not a valid request apart from its ids, or its ids'
                text is not an array of valid ids.
        """
        stub, buf, a, b = _stub_and_text(buf, s, e)
        ref = self._ref_of(stub)
        k, d, j = 0, -1, -1
        if ref is not None and self.store.depth(ref[0]) + 1 < KEYFRAME_DEPTH:
            j, (ref_text, ref_n) = ref
            k, d = shared_text_prefix(ref_text, ref_n, buf, a, b)
        text = buf[a : b - 1]
        if k == 0:
            return stub, text, _IDS_DECODER.decode(memoryview(buf)[a:b]), 0, -1
        if buf[d] == _CLOSE:  # every id shared (a ']' where the reference's text has a delimiter ends the array)
            return stub, text, [], k, j
        new = _IDS_DECODER.decode(b"[" + buf[d + 1 : b])
        if not new:  # ",]"
            raise msgspec.DecodeError("a comma before the array's end")
        return stub, text, new, k, j


def _store_ids(flat: array[int], ids: list[int]) -> None:
    """Append ``ids`` (int64, checked by the decoder) to ``flat``: one ``struct.pack`` (~110
    instructions an id) instead of ``array.fromlist`` (~220: it parses each item with
    ``PyArg_Parse``)."""
    if ids:
        flat.frombytes(_pack(f"{len(ids)}q", *ids))


def read_trace_compact(path: str | os.PathLike[str], *, ahead: InflateAhead | None = None) -> CompactTrace:
    """Read and validate a trace file like :func:`~evolving_infra.traces.io.read_trace`, holding it
    as a :class:`CompactTrace`: memory O(requests + new ids) instead of O(all ids). Time O(new
    ids) decoded plus the file's text compared in C (:class:`_TextBuilder`), not O(all ids).

    A packed trace (``trace pack``, :mod:`evolving_infra.traces.pack`) is read as packed: the same
    :class:`CompactTrace` as reading the trace it was packed from.

    ``ahead``: ``path`` already being inflated on a thread (``traces.inflate.InflateAhead``; the
    same result, sooner on a second core); closed before this returns.

    Raises:
        TraceError: one or more lines are bad; ``err.problems`` lists every one as
            ``line N: reason`` (the whole file is checked first), exactly as ``read_trace``
            (a packed trace: ``pack.read_packed``'s problems); a file whose line 1 is neither a
            header nor a request (not JSON, binary): that one problem at once, as ``read_trace``
            (before, an 18 MB binary file was read whole: 1.4 s, ~60 MB, 70,000 problems).
        OSError: the file cannot be read.
    """
    try:
        with open(path, "rb") as f:
            packed = f.read(len(PACK_MAGIC)) == PACK_MAGIC
    except OSError:
        if ahead is not None:
            ahead.close()
        raise
    if packed:
        if ahead is not None:
            ahead.close()
        from evolving_infra.traces.pack import read_packed

        return read_packed(path)
    v = _Validator(stop_at_no_trace=True)
    b = _TextBuilder(v)
    b.store._as_lists()
    with paused_gc():
        _scan_runs(path, v, b.feed_run, ahead)
    b.store._as_arrays()
    if v.problems:
        raise TraceError(path, v.problems)
    assert v.header is not None
    return CompactTrace(v.header, b.stubs, b.store, b.index)
