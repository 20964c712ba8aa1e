"""Token ids and block-size conversion for trace requests (spec: docs/trace-format.md §4).

A trace stores block ids, not tokens. Replayers and the simulator turn a
request into token ids with :func:`prompt_token_ids`: each full block id maps to
``block_size`` deterministic token ids (``shared.hashing.tokens_for_blocks``),
and the partial tail (``input_tokens % block_size`` tokens) maps to tokens
private to the request (``shared.hashing.tokens_for_tail`` keyed by the request
id). Equal leading block ids therefore give equal leading tokens, hence equal
SGLang page hashes in every component.

Block-size conversion (:func:`rechunk_blocks`) is explicit, never implicit:

* finer (e.g. 512 → 64, ``m = 8``): coarse block ``b`` becomes the fine blocks
  ``b*m + k`` for ``k = 0..m-1``. Two requests that share a coarse block share
  all of its fine blocks; requests that share only part of a coarse block are
  not known to share anything finer (the source did not record it). Full fine
  blocks inside the coarse partial tail get fresh private ids (from a
  :class:`PrivateIds` allocator, in [2**47, 2**48)) unless the source knows the
  tail's coarse id (``tail_block``, e.g. Mooncake's last hash id).
  Every valid id can be split: a block whose ``b*m + m - 1`` would reach
  ``PRIVATE_ID_BASE`` (large ids, e.g. 47-bit hashes at ``m >= 2``) instead takes
  ``m`` fresh consecutive ids from the trace's :class:`PrivateIds` allocator, the
  same ``m`` ids wherever ``b`` appears (:meth:`PrivateIds.split`: a dense
  renumbering in first-appearance order, deterministic). Prefix identity is kept
  (fine block ``k`` of ``b`` is the same id in every request, distinct coarse
  blocks get distinct ids, and the fresh ids never meet a ``b*m + k`` id, which
  stays below ``PRIVATE_ID_BASE``); ids small enough keep ``b*m + k`` exactly.
* coarser (e.g. 64 → 512, ``m = 8``): coarse block ``j`` takes the id of its
  last fine block, ``blocks[m*j + m - 1]``. Ids are chained (an id stands for its
  whole prefix), so this is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import hashlib

import msgspec
if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

from evolving_infra.traces.schema import MAX_BLOCK_ID, TraceRequest

__all__ = [
    "MAX_BLOCK_ID",
    "PRIVATE_ID_BASE",
    "PrivateIds",
    "blocks_from_tokens",
    "prompt_token_ids",
    "rechain_blocks",
    "rechunk_blocks",
    "rechunk_request",
    "chained_prefix_len",
    "shared_prefix_len",
]

PRIVATE_ID_BASE = 1 << 47
"""Ids in [PRIVATE_ID_BASE, MAX_BLOCK_ID] are fresh private ids made by :class:`PrivateIds`;
converters and generators keep their own ids below it."""


def prompt_token_ids(req: TraceRequest, block_size: int) -> np.ndarray:
    """Token ids of a request's whole input (uint32, length ``req.input_tokens``).

    ``tokens_for_blocks(req.blocks)`` followed by ``tokens_for_tail(req.id,
    req.input_tokens % block_size)``.

    Raises:
        ValueError: ``len(req.blocks) != req.input_tokens // block_size``.
    """
    if len(req.blocks) != req.input_tokens // block_size:
        raise ValueError(
            f"request {req.id!r}: {len(req.blocks)} blocks but input_tokens // block_size = {req.input_tokens // block_size}"
        )
    from shared.hashing import tokens_for_blocks, tokens_for_tail  # (the live replayer's; the simulator does without)

    head = tokens_for_blocks(req.blocks, block_size) if req.blocks else np.empty(0, dtype=np.uint32)
    tail_n = req.input_tokens % block_size
    if not tail_n:
        return head
    return np.concatenate([head, tokens_for_tail(req.id, tail_n)])


def blocks_from_tokens(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Chained block ids of a token sequence: the ids a trace's ``blocks`` takes for a prompt
    of these tokens (docs/trace-format.md §4).

    Block ``j`` (tokens ``[j*block_size, (j+1)*block_size)``) gets the first 47 bits of
    ``d_j = BLAKE2b-128(d_{j-1} ‖ its tokens as little-endian uint64)`` (``d_{-1}`` empty), so
    an id names its whole prefix: equal ids at a position mean equal tokens up to it, and two
    prompts share exactly the ids of their common full leading blocks. Ids are in
    ``[0, PRIVATE_ID_BASE)``, the converters' part of the range (``trace validate`` accepts
    them; ``shared.hashing.block_hashes`` gives signed 64-bit hashes, which it does not).
    The partial last block (``len(tokens) % block_size`` tokens) gets no id.

    Args:
        tokens: token ids, each in [0, 2**64).
        block_size: tokens per block (>= 1).

    Returns:
        ``len(tokens) // block_size`` ids.

    Raises:
        ValueError: ``block_size < 1`` or a negative token id.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    arr = np.asarray(tokens)
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0):
        raise ValueError("token ids must be integers >= 0")
    raw = arr.astype("<u8").tobytes()
    step = 8 * block_size
    out: list[int] = []
    digest = b""
    for j in range(len(arr) // block_size):
        digest = hashlib.blake2b(digest + raw[j * step:(j + 1) * step], digest_size=16).digest()
        out.append(int.from_bytes(digest[:8], "little") & (PRIVATE_ID_BASE - 1))
    return out


class PrivateIds:
    """Sequential allocator of never-shared block ids in [PRIVATE_ID_BASE, MAX_BLOCK_ID].

    Deterministic: the same calls in the same order give the same ids. One
    allocator per output trace.
    """

    __slots__ = ("next", "splits")

    def __init__(self, start: int = PRIVATE_ID_BASE) -> None:
        self.next = start
        self.splits: dict[tuple[int, int], int] = {}
        """(coarse id, m) -> first of the ``m`` fresh ids :meth:`split` gave it"""

    def take(self, n: int) -> range:
        """``n`` fresh ids.

        Raises:
            ValueError: the private range is exhausted.
        """
        start = self.next
        if start + n - 1 > MAX_BLOCK_ID:
            raise ValueError("private block id range exhausted")
        self.next = start + n
        return range(start, start + n)

    def split(self, block: int, m: int) -> range:
        """The ``m`` fine ids of coarse block ``block`` when ``block*m + k`` would leave the
        shared range: fresh ids taken at its first call, the same range at every later call
        with the same ``(block, m)`` (so a shared coarse block stays shared, fine block by fine
        block).

        Raises:
            ValueError: the private range is exhausted.
        """
        start = self.splits.get((block, m))
        if start is None:
            start = self.splits[(block, m)] = self.take(m).start
        return range(start, start + m)


def rechunk_blocks(
    blocks: Sequence[int],
    input_tokens: int,
    from_size: int,
    to_size: int,
    *,
    private: PrivateIds | None = None,
    tail_block: int | None = None,
) -> list[int]:
    """Block ids of the same input at another block size (module docstring has the rule).

    Args:
        blocks: ids of the full ``from_size`` blocks (``len == input_tokens // from_size``).
        input_tokens: input length in tokens.
        from_size, to_size: block sizes in tokens; one must divide the other.
        private: allocator for the fine blocks of a coarse tail without a source id and
            for the fine ids of coarse ids too large for ``b*m + k`` (required when there
            are such blocks; one allocator per output trace, used in file order).
        tail_block: the source's id of the partial coarse block, if it has one.

    Returns:
        ``input_tokens // to_size`` ids.

    Raises:
        ValueError: sizes do not divide one another (the message says which sizes
            would do), ``blocks`` has the wrong length, an id is outside
            [0, MAX_BLOCK_ID], or private ids are needed and ``private`` is None.
    """
    if len(blocks) != input_tokens // from_size:
        raise ValueError(f"{len(blocks)} blocks but input_tokens // from_size = {input_tokens // from_size}")
    if to_size == from_size:
        return list(blocks)
    n_out = input_tokens // to_size
    if to_size % from_size and from_size % to_size:
        raise ValueError(
            f"{to_size}-token blocks cannot be made from {from_size}-token blocks: the target size must "
            f"divide {from_size} or be a multiple of it (e.g. {_size_hint(from_size)}); pick such a block "
            f"size, or convert the source again at {to_size} tokens"
        )
    if to_size > from_size:
        m = to_size // from_size
        return [blocks[m * j + m - 1] for j in range(n_out)]
    m = from_size // to_size
    limit = (PRIVATE_ID_BASE - 1) // m
    out: list[int] = []
    for b in blocks:
        if 0 <= b <= limit:
            base = b * m
            out.extend(range(base, base + m))
        elif not 0 <= b <= MAX_BLOCK_ID:
            raise ValueError(f"block id {b} is outside [0, {MAX_BLOCK_ID}] (docs/trace-format.md §4)")
        elif private is None:
            raise ValueError(f"block id {b} is too large for {b}*{m}+k: pass a PrivateIds allocator")
        else:
            out.extend(private.split(b, m))
    rest = n_out - len(out)
    if rest:
        if tail_block is not None and 0 <= tail_block <= limit:
            out.extend(range(tail_block * m, tail_block * m + rest))
        elif tail_block is not None and 0 <= tail_block <= MAX_BLOCK_ID and private is not None:
            out.extend(private.split(tail_block, m)[:rest])
        elif private is None:
            raise ValueError("the coarse tail holds full fine blocks: pass a PrivateIds allocator")
        else:
            out.extend(private.take(rest))
    return out


def _size_hint(size: int) -> str:
    """A few block sizes a ``size``-token trace converts to (its divisors >= 4, then 2x and 8x)."""
    divs = [d for d in range(4, size + 1) if size % d == 0][-4:]
    return ", ".join(str(x) for x in [*divs, 2 * size, 8 * size])


def rechunk_request(req: TraceRequest, from_size: int, to_size: int, private: PrivateIds | None = None) -> TraceRequest:
    """``req`` with its blocks converted from ``from_size`` to ``to_size`` tokens (see :func:`rechunk_blocks`)."""
    blocks = rechunk_blocks(req.blocks, req.input_tokens, from_size, to_size, private=private)
    return msgspec.structs.replace(req, blocks=blocks)


_Ref = tuple[Sequence[int], Sequence[int], "list[int] | None"]
"""A request :func:`rechain_blocks` has walked: its input ids, its output ids, and None when none
was remapped, else ``acc`` with ``acc[i]`` = remapped occurrences among its first ``i`` ids."""


def shared_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists: one slice comparison when one
    extends the other, else bisection over the unknown window (O(len) element comparisons in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def chained_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """:func:`shared_prefix_len` of two *chained* id lists (docs/trace-format.md §4: an id names
    its whole prefix, so ``a[i] == b[i]`` implies ``a[:i + 1] == b[:i + 1]``): one comparison
    when one extends the other, else a bisection over single ids, O(log len) comparisons and no
    slice (``shared_prefix_len`` copies and compares whole prefixes, O(len), ~2,000 ids per
    request at 64-token blocks). For lists that are not chains the answer may be longer than
    the common prefix: only for callers whose ids are chained (the simulator's, re-chained by
    :func:`rechain_blocks`; tested equal to ``shared_prefix_len`` on chained lists)."""
    n = len(a) if len(a) < len(b) else len(b)
    if not n or a[n - 1] == b[n - 1]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] (a[lo - 1] == b[lo - 1]), a[hi - 1] != b[hi - 1]
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


def rechain_blocks(requests: Sequence[TraceRequest]) -> tuple[list[TraceRequest], int]:
    """Requests whose block ids are chained (docs/trace-format.md: an id stands for its whole
    prefix), remapping every occurrence of an id that follows another prefix than at its first
    occurrence to a fresh id per (new parent id, old id).

    A trace that breaks the rule (a converter bug, a hand-written trace) would otherwise make
    the engines' radix pools — which take a hash to name its prefix — hold one block under two
    parents. Requests that need no change are returned as they are (same objects).

    Cost: the leading ids a request shares with the previous request of its branch (else of
    its parent branch, else of its agent) are not walked again — the walk of an id list it has
    already seen gives the same output and changes no state (the maps only gain keys), so only
    the remap count of that prefix is carried over. A conversation, whose requests extend one
    another, costs O(new ids) dict probes per request plus O(shared ids) slice comparisons in C.

    Returns:
        ``(requests, remapped)``: the requests in the same order and the number of block
        occurrences remapped (0 for a chained trace).
    """
    parent_of: dict[int, int] = {}
    alt: dict[tuple[int, int], int] = {}
    fresh = -1  # next fresh id: 1 + the largest id of the input, computed at the first remap
    out: list[TraceRequest] = []
    remapped = 0
    missing = -2  # never a parent (parents are ids >= 0 or -1 for the sequence start)
    # the last request walked per branch and per agent (the reference of the next one)
    last_branch: dict[str, _Ref] = {}
    last_agent: dict[str, _Ref] = {}
    for r in requests:
        blocks = r.blocks
        ref = last_branch.get(r.branch)
        if ref is None and r.parent_branch is not None:
            ref = last_branch.get(r.parent_branch)
        if ref is None:
            ref = last_agent.get(r.agent)
        new: list[int] | None = None
        k = 0
        prev = -1
        if ref is not None and blocks:
            src, dst, acc = ref
            k = shared_prefix_len(src, blocks)
            if k:
                if acc is not None and acc[k]:
                    remapped += acc[k]
                    new = list(dst[:k])
                prev = dst[k - 1]
        for i in range(k, len(blocks)):
            b = blocks[i]
            p = parent_of.get(b, missing)
            if p == missing:
                parent_of[b] = prev
                nb = b
            elif p == prev:
                nb = b
            else:
                key = (prev, b)
                nb = alt.get(key, -1)
                if nb < 0:
                    if fresh < 0:
                        fresh = 1 + max((max(q.blocks) for q in requests if q.blocks), default=0)
                    nb = alt[key] = fresh
                    parent_of[nb] = prev
                    fresh += 1
                remapped += 1
            if nb != b and new is None:
                new = list(blocks[:i])
            if new is not None:
                new.append(nb)
            prev = nb
        if new is None:
            out.append(r)
            entry: _Ref = (blocks, blocks, None)
        else:
            out.append(msgspec.structs.replace(r, blocks=new))
            acc_new = [0]
            for x, y in zip(blocks, new):  # a remapped id is fresh, so it differs from the input's
                acc_new.append(acc_new[-1] + (x != y))
            entry = (blocks, new, acc_new)
        last_branch[r.branch] = entry
        last_agent[r.agent] = entry
    return out, remapped
