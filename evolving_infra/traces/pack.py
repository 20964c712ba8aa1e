"""Packed traces: a :class:`~evolving_infra.traces.compact.CompactTrace` written as one binary file
that ``simulate --trace`` reads without parsing JSON (spec: docs/trace-format.md §10).

``evolving-infra trace pack IN OUT`` reads a trace (``.jsonl`` / ``.jsonl.gz``, validated line by
line as every reader does) and writes what :func:`~evolving_infra.traces.compact.read_trace_compact`
builds from it: the header, the requests as stubs (``blocks=[]``) and the block store (each
request's ids as a reference request, a shared prefix length and its new ids). Reading it back
gives the same :class:`CompactTrace` (header, stubs, index and store, array for array), so a
simulation of the packed file is the simulation of the trace it was packed from. It is to
``simulate`` what Dynamo's converted ``agentic_mooncake`` file is to its replay: the trace read
ahead once. The 260-agent Claude Code trace at 64-token blocks (24 MB gzip, 281 MB of JSON) packs
into 16 MB and loads in ~0.15 s CPU instead of ~1.3 s.

Layout (little-endian)::

    8 bytes   MAGIC  b"\\x93EITPACK"  (neither gzip's magic nor JSON text)
    8 bytes   payload length in bytes (uint64)
    4 bytes   CRC-32 of the payload (zlib.crc32)
    payload   msgpack array [version, header, requests, flat, off, ref, k]

``header`` is the :class:`TraceHeader`, ``requests`` the stubs in file order (struct fields as a
map, defaults omitted), ``flat`` / ``off`` / ``ref`` / ``k`` the store's int64 arrays as bytes
(:class:`~evolving_infra.traces.compact.BlockStore`: request ``i``'s ids are request
``ref[i]``'s first ``k[i]`` then ``flat[off[i]:off[i + 1]]``). What the store derives (reference
depths, the id before each segment, each request's branch) and the request index are rebuilt on
reading, not stored.

Reading checks everything a trace read checks, so a damaged or hand-made pack is rejected with a
reason, not simulated: the checksum and the layout; the store's structure (offsets, references
to earlier requests only, shared prefixes no longer than the reference, chains shorter than
``compact.KEYFRAME_DEPTH``, ids in [0, MAX_BLOCK_ID]); and every rule of docs/trace-format.md on
the requests (ids unique, ``after``, branches, ``len(blocks) == input_tokens // block_size``),
reported as the lines of the trace the pack was made from (request ``i`` on line ``i + 2``).
"""

from __future__ import annotations

import errno
import os
import sys
import zlib
from array import array
from pathlib import Path
from typing import IO, TYPE_CHECKING

import msgspec
if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

from evolving_infra.traces.compact import KEYFRAME_DEPTH, BlockStore, CompactTrace
from evolving_infra.traces.io import PACK_MAGIC as MAGIC
from evolving_infra.traces.io import TraceError, TraceProblem, _Validator, make_folders, paused_gc, remove_folders
from evolving_infra.traces.schema import MAX_BLOCK_ID, VERSION, TraceHeader, TraceRequest

__all__ = ["MAGIC", "PACK_VERSION", "is_packed", "read_packed", "write_packed"]

PACK_VERSION = 1
"""Version of the packed layout (not of the trace format: the header carries that)."""
_PREFIX = len(MAGIC) + 8 + 4


class _Payload(msgspec.Struct, array_like=True):
    version: int
    header: TraceHeader
    requests: list[TraceRequest]
    flat: bytes
    off: bytes
    ref: bytes
    k: bytes


_DECODER = msgspec.msgpack.Decoder(_Payload)
_ENCODER = msgspec.msgpack.Encoder()
_ARRAYS = ("flat", "off", "ref", "k")


def is_packed(path: str | os.PathLike[str]) -> bool:
    """True when the file starts with :data:`MAGIC` (a packed trace, or a damaged one).

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _le_bytes(a: array[int]) -> bytes | memoryview:
    """``a``'s items as little-endian bytes: a view of ``a`` itself on a little-endian machine (no copy)."""
    if sys.byteorder == "little":
        return memoryview(a).cast("B")
    b = array(a.typecode, a)
    b.byteswap()
    return b.tobytes()


_EMPTY_BIN = b"\xc4\x00"
"""msgpack of ``b""`` (bin 8, length 0)."""


def _bin_head(n: int) -> bytes:
    """The msgpack bin header of ``n`` bytes, as msgspec writes it (the shortest of bin 8 / 16 / 32).

    Raises:
        ValueError: ``n`` ≥ 4 GiB (no msgpack bin holds it).
    """
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    if n < 1 << 32:
        return b"\xc6" + n.to_bytes(4, "big")
    raise ValueError(f"an array of {n:,} bytes does not fit a msgpack bin (< 4 GiB)")


def _payload_parts(trace: CompactTrace) -> list[bytes | memoryview]:
    """The payload (module docstring) in parts whose concatenation is what msgspec encodes for
    ``_Payload(PACK_VERSION, header, requests, flat, off, ref, k)``: the array, version, header and
    requests as msgspec encodes them (with empty arrays, whose 4 × 2 bytes are cut off), then each
    store array's bin header and the array itself, not copied (``_le_bytes``). Writing the parts
    one by one holds no second copy of the store (~34 MB for 530 Claude Code sessions at 64-token
    blocks: the whole payload and the arrays' copies were ~44 MB above the read trace while written)."""
    st = trace.store
    head = _ENCODER.encode(_Payload(PACK_VERSION, trace.header, trace.requests, b"", b"", b"", b""))
    assert head.endswith(_EMPTY_BIN * len(_ARRAYS))
    parts: list[bytes | memoryview] = [head[: -len(_EMPTY_BIN) * len(_ARRAYS)]]
    for name in _ARRAYS:
        raw = _le_bytes(getattr(st, "_" + name))
        parts += [_bin_head(len(raw)), raw]
    return parts


def _write_all(f: IO[bytes], data: bytes | memoryview) -> None:
    """``data`` written to ``f`` to the last byte.

    A buffered stream's ``write`` of a payload larger than a pipe returns the count the first raw write took
    (64 KiB) when a later one fails, without raising: ``trace pack IN - | head -c 100`` printed
    "1,203,985 bytes" and exited 0. Writing the rest makes that failure raise.

    Raises:
        OSError: the write failed (``BrokenPipeError``: the reader went away); a stream that takes
            nothing is reported as ``OSError(EIO)``.
    """
    view = memoryview(data)
    while view:
        n = f.write(view)
        if not n:
            raise OSError(errno.EIO, "the stream took no bytes")
        view = view[n:]


def write_packed(path: str | os.PathLike[str] | IO[bytes], trace: CompactTrace) -> int:
    """Write ``trace`` (as :func:`~evolving_infra.traces.compact.read_trace_compact` builds it) as a
    packed trace; the bytes are a pure function of ``trace``. Written to ``path.tmp`` then renamed;
    or into ``path``, an open binary stream (``trace pack IN -``: stdout).

    Returns:
        Bytes written.

    Raises:
        OSError: ``path`` cannot be written (its ``.tmp`` is removed).
    """
    parts = _payload_parts(trace)
    size = crc = 0
    for part in parts:
        size += len(part)
        crc = zlib.crc32(part, crc)
    head = MAGIC + size.to_bytes(8, "little") + crc.to_bytes(4, "little")
    if not isinstance(path, (str, os.PathLike)):
        for part in (head, *parts):
            _write_all(path, part)
        return _PREFIX + size
    p = Path(path)
    made = make_folders(p.parent)
    tmp = p.with_name(p.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for part in (head, *parts):
                _write_all(f, part)
        os.replace(tmp, p)
    except BaseException:  # no partial .tmp (disk full, a folder in the way) nor folders made for it left behind
        tmp.unlink(missing_ok=True)
        remove_folders(made)
        raise
    return _PREFIX + size


def _bad(path: str | os.PathLike[str], reason: str) -> TraceError:
    return TraceError(path, [TraceProblem(1, f"packed trace (trace pack): {reason}")])


def _int64s(path: str | os.PathLike[str], name: str, raw: bytes) -> array[int]:
    if len(raw) % 8:
        raise _bad(path, f"the {name} array is {len(raw)} bytes, not a whole number of int64s")
    a = array("q", raw)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def _store(path: str | os.PathLike[str], pl: _Payload, *, check_ids: bool = True) -> tuple[BlockStore, list[int]]:
    """The store the payload describes, its derived arrays (depths, ``_prev``) rebuilt, and every request's id
    count, in one Python pass over the requests (no numpy: a trace-cache hit's run need not import it, ~65 ms).
    ``check_ids``: also check that every stored id lies in [0, ``MAX_BLOCK_ID``] (with numpy); a pack this reader
    wrote from a trace it read (``read_packed(trusted=True)``) skips it, the reader bounded every id then.

    Raises:
        TraceError: the arrays do not describe a store ``compact`` builds.
    """
    st = BlockStore()
    st._flat, st._off, st._ref, st._k = (_int64s(path, name, getattr(pl, name)) for name in _ARRAYS)
    flat, off, refs, ks = st._flat, st._off, st._ref, st._k
    n = len(pl.requests)
    if len(refs) != n or len(ks) != n or len(off) != n + 1:
        raise _bad(path, f"{n} requests but {len(refs)} references, {len(ks)} shared counts and {len(off)} offsets")
    lens = [b - a for a, b in zip(off, off[1:])]
    if off[0] != 0 or off[-1] != len(flat) or (n and min(lens) < 0):
        raise _bad(path, "the offsets are not increasing from 0 to the number of ids stored")
    if check_ids and len(flat):
        ids = np.frombuffer(flat, dtype=np.int64)
        if ids.min() < 0 or ids.max() > MAX_BLOCK_ID:
            raise _bad(path, f"a block id outside [0, {MAX_BLOCK_ID}]")
    depth = [0] * n
    prev = [-1] * n
    for i in range(n):  # references point back: lengths, depths and the id before each segment in one pass
        r = refs[i]
        k = ks[i]
        if r >= 0:
            if r >= i or k <= 0:
                raise _bad(path, "a request refers to itself or a later request, or its shared count does not match its reference")
            if k > lens[r]:
                raise _bad(path, f"request {i} shares {k} ids with request {r}, which has {lens[r]}")
            lens[i] += k
            depth[i] = d = depth[r] + 1
            if d >= KEYFRAME_DEPTH:
                raise _bad(path, f"request {i} is {d} references from stored ids (at most {KEYFRAME_DEPTH - 1})")
            pos = k - 1  # BlockStore.id_at(r, k - 1), which cannot run past r's ids once the lengths are checked
            at = r
            while pos < ks[at]:
                at = refs[at]
            prev[i] = flat[off[at] + pos - ks[at]]
        elif r != -1 or k != 0:
            raise _bad(path, "a request refers to itself or a later request, or its shared count does not match its reference")
    st._depth = array("l", depth)
    st._branch = [r.branch for r in pl.requests]
    st._prev = array("q", prev)
    return st, lens


def read_packed(path: str | os.PathLike[str], *, trusted: bool = False) -> CompactTrace:
    """Read a packed trace: the :class:`CompactTrace` that ``read_trace_compact`` built from the
    trace it was packed from (module docstring).

    ``trusted``: the pack is one this code wrote from a trace it read and checked itself (the trace
    cache's, ``evolving_infra.traces.cache``: its key hashes this reader's sources, and it packs only
    a trace ``read_trace_compact`` read whole): the rules of docs/trace-format.md on its requests
    (ids, ``after``, branches, id counts) and the ids' range are not checked again, and the store is
    checked without the ids' range (:func:`_store`); the magic, length, checksum, layout and store
    structure still are checked, so a damaged or truncated pack is still rejected. Same trace
    either way; the rules' check is ~20 ms of a ~50-ms read of the 260-session trace at 512-token
    blocks (15,845 requests), numpy's import ~65 ms more.

    Raises:
        TraceError: not a whole packed trace (magic, length, checksum, layout), its store is not
            one ``compact`` builds, or its requests break a rule of docs/trace-format.md (the
            problems as lines of the trace it was packed from).
        OSError: the file cannot be read.
    """
    data = Path(path).read_bytes()
    if data[: len(MAGIC)] != MAGIC:
        raise _bad(path, "no packed-trace magic at the start")
    size = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    payload = memoryview(data)[_PREFIX:]
    if len(data) < _PREFIX or len(payload) != size:
        raise _bad(path, f"{len(payload)} bytes of payload where the file says {size}: truncated or extended")
    if zlib.crc32(payload) != int.from_bytes(data[len(MAGIC) + 8 : _PREFIX], "little"):
        raise _bad(path, "checksum mismatch: the file is damaged (pack the trace again)")
    with paused_gc():
        try:
            pl = _DECODER.decode(payload)
        except msgspec.DecodeError as e:
            raise _bad(path, f"undecodable payload: {e}") from None
        if pl.version != PACK_VERSION:
            raise _bad(path, f"packed layout version {pl.version} (this code reads {PACK_VERSION})")
        if pl.header.version > VERSION:
            raise _bad(path, f"unsupported trace format version {pl.header.version} (this code reads up to {VERSION})")
        store, lengths = _store(path, pl, check_ids=not trusted)
        if trusted:
            return CompactTrace(pl.header, pl.requests, store, {r.id: i for i, r in enumerate(pl.requests)})
        v = _Validator()
        v.header, v.block_size = pl.header, pl.header.block_size
        # a line's own problem first, then the rules' (finish sorts by line, stably: the order of old)
        for i in [i for i, r in enumerate(pl.requests) if r.blocks]:
            v._bad(i + 2, "a packed request holds its block ids in the request (they belong in the store)")
        v.check_all(pl.requests, lengths)
        v.finish(len(pl.requests) + 1)
        if v.problems:
            raise TraceError(path, v.problems)
        index = {r.id: i for i, r in enumerate(pl.requests)}
    return CompactTrace(pl.header, pl.requests, store, index)
