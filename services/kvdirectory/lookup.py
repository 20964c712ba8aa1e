"""Lookup answers of the KV directory and the router's view of them (paper Eq. 7).

Pure functions; no I/O, no mutation of the index.

For a request path π (chained block hashes) the directory answers:

* per node n: the longest prefix of π held in its GPU (L1), in its host
  memory (L2), and in either ("local"), in blocks;
* ``longest_any``: the longest prefix whose every block is held by *some* node
  in some tier. This is t_c of the request in blocks (paper Alg. E.3 line 6:
  "longest prefix of r cached on n or on another node"), the same for every n;
* ``sources``: a fetch plan covering ``[0, longest_any)``: host copies first
  (prefill nodes read peers' L2, DESIGN §1), GPU copies only where no host copy
  covers a block.

:func:`fetch_plan` turns that into the router's t_c,n and x_n for one node:
x_n = blocks of ``[local_n, t_c)`` whose chosen source is another node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress

import msgspec

from shared.messages import FetchRange, KvLookupReply, NodePrefix
from shared.values import FrozenValue, StructValue, set_field

from .index import GPU, HOST, BlockIndex, tier_bit


class LookupResult(StructValue):
    """Answer of :meth:`KvDirectory.lookup` (all lengths in blocks)."""

    path_blocks: int
    nodes: list[NodePrefix] = msgspec.field(default_factory=list)
    """Nodes with a non-empty local prefix, in node registration order."""
    longest_any: int = 0
    sources: list[FetchRange] = msgspec.field(default_factory=list)

    def to_reply(self, block_size: int) -> KvLookupReply:
        """The ``kv.lookup`` wire reply."""
        return KvLookupReply(block_size=block_size, nodes=self.nodes, longest_any=self.longest_any, sources=self.sources)

    def node(self, name: str) -> NodePrefix:
        """Prefixes of one node (zeros when it holds none)."""
        for p in self.nodes:
            if p.node == name:
                return p
        return NodePrefix(node=name)


class FetchPlan(FrozenValue):
    """Eq. 7 inputs for one prefill node n (tokens = blocks × block size)."""

    node: str
    cached_tokens: int
    """t_c,n: longest prefix cached on n or anywhere."""
    local_tokens: int
    """Tokens of the prefix already on n (either tier)."""
    fetch_tokens: int
    """x_n: tokens of the cached prefix that n must fetch from other nodes."""
    ranges: tuple[FetchRange, ...]
    """Where to fetch them from (block ranges of the path)."""

    __slots__ = __match_args__ = ("node", "cached_tokens", "local_tokens", "fetch_tokens", "ranges")

    def __init__(
        self, node: str, cached_tokens: int, local_tokens: int, fetch_tokens: int, ranges: tuple[FetchRange, ...],
    ) -> None:
        set_field(self, "node", node)
        set_field(self, "cached_tokens", cached_tokens)
        set_field(self, "local_tokens", local_tokens)
        set_field(self, "fetch_tokens", fetch_tokens)
        set_field(self, "ranges", ranges)


def fetch_plan(
    nodes: Sequence[NodePrefix], longest_any: int, sources: Sequence[FetchRange], node: str, block_size: int
) -> FetchPlan:
    """t_c,n, x_n and fetch ranges of ``node`` for a lookup answer (paper Eq. 7, Alg. E.3 l.6).

    Works on a :class:`LookupResult` or a decoded ``KvLookupReply`` alike.
    """
    local = 0
    for p in nodes:
        if p.node == node:
            local = p.local_blocks
            break
    ranges = fetch_ranges(sources, node, local)
    return FetchPlan(
        node=node,
        cached_tokens=longest_any * block_size,
        local_tokens=local * block_size,
        fetch_tokens=sum(r.end - r.start for r in ranges) * block_size,
        ranges=ranges,
    )


def fetch_ranges(sources: Sequence[FetchRange], node: str, local: int, end_block: int | None = None) -> tuple[FetchRange, ...]:
    """The block ranges ``node`` fetches (x_n's ranges, paper Eq. 7): the ``sources`` held by
    other nodes, beyond ``node``'s own prefix of ``local`` blocks, clipped to ``[0, end_block)``
    when given (a prompt that ends inside the cached prefix uses only its first blocks).
    A source range that needs no cut is returned as is. O(len(sources))."""
    out = []
    for r in sources:
        if r.node == node or r.end <= local:
            continue
        start = r.start if r.start > local else local
        end = r.end
        if end_block is not None:
            if start >= end_block:
                break
            if end > end_block:
                end = end_block
        out.append(r if start == r.start and end == r.end else FetchRange(node=r.node, start=start, end=end, tier=r.tier))
    return tuple(out)


def fetch_plan_for_reply(reply: KvLookupReply, node: str) -> FetchPlan:
    """:func:`fetch_plan` over a ``KvLookupReply`` (the router's entry point)."""
    return fetch_plan(reply.nodes, reply.longest_any, reply.sources, node, reply.block_size)


def build_lookup(index: BlockIndex, names: Sequence[str], path: Sequence[int]) -> LookupResult:
    """Answer a lookup from the index (pure query).

    Cost: one ``bisect`` per distinct prefix length (see ``BlockIndex.prefix_drops``),
    a few bytes operations per length to decode them (per set bit beyond
    ``_FEW_DROPS`` lengths), one ``NodePrefix`` per node holding a prefix, plus a
    walk of the blocks beyond the best host/GPU prefix when the cluster's prefix is
    a mosaic of nodes (rare: engines evict leaves first).
    """
    res = LookupResult(path_blocks=len(path))
    drops = index.prefix_drops(path)
    if not drops:
        return res
    nn = len(names)
    if len(drops) <= _FEW_DROPS:
        res.longest_any, lengths, gb, hb, lb = _decode_few(drops, nn)
        get = lengths.__getitem__
        res.nodes = list(compress(map(NodePrefix, names, map(get, gb), map(get, hb), map(get, lb)), lb))
        h, g = max(hb), max(gb)  # drop indices grow with length: the first max is the lowest node index
        best_host, best_gpu = (hb.index(h), lengths[h]), (gb.index(g), lengths[g])
    else:
        res.longest_any, gpu, host, local = _decode_per_bit(drops, nn)
        res.nodes = list(compress(map(NodePrefix, names, gpu, host, local), local))
        h, g = max(host), max(gpu)
        best_host, best_gpu = (host.index(h), h), (gpu.index(g), g)
    res.sources = _sources(index, names, path, best_host, best_gpu, res.longest_any)
    return res


_FEW_DROPS = 16
"""Up to this many distinct prefix lengths a lookup decodes them by spreading bits into bytes
(:func:`_decode_few`, ~1,000 instructions per length at 9 nodes); beyond, per set bit (3 per node)."""

_SPREAD = [0]
"""9 bits → 9 bytes: ``_SPREAD[c]``'s byte j is bit j of ``c`` (0 or 1)."""
for _c in range(1, 512):
    _SPREAD.append(_SPREAD[_c >> 1] << 8 | _c & 1)
del _c


def _decode_few(drops: Sequence[tuple[int, int]], nn: int) -> tuple[int, list[int], bytes, bytes, bytes]:
    """``(longest_any, lengths, gpu, host, local)``: ``lengths[0] = 0`` then the drops'
    lengths; byte i of ``gpu`` / ``host`` / ``local`` indexes node i's length in ``lengths``.

    Each drop's (node, section) bits are spread into one byte per bit (0 or 1), 9 bits at a
    time by table (:data:`_SPREAD`), and multiplied by the drop's index k; the bit sets are
    disjoint, so their sum as integers puts every (node, section)'s index in its byte (k ≤
    ``_FEW_DROPS`` < 256: no carries). At most ``_FEW_DROPS`` drops. (It replaced a binary
    string per drop, formatted, encoded and translated into bytes: ~6,700 instructions per
    drop at 9 nodes against ~1,000, cachegrind on the lookups of a 300-s evolving simulation.)
    """
    width = 3 * nn
    total = 0
    lengths = [0]
    longest_any = 0
    spread = _SPREAD
    for k, (length, bits) in enumerate(drops, 1):
        if bits & 1:
            longest_any = length
        x = bits >> 1
        s = spread[x & 511]
        x >>= 9
        sh = 72
        while x:
            s |= spread[x & 511] << sh
            x >>= 9
            sh += 72
        total += s * k
        lengths.append(length)
    b = total.to_bytes(width, "little")
    return longest_any, lengths, b[0::3], b[1::3], b[2::3]


def _decode_per_bit(drops: Sequence[tuple[int, int]], nn: int) -> tuple[int, list[int], list[int], list[int]]:
    """``(longest_any, gpu[nn], host[nn], local[nn])`` in blocks from :meth:`BlockIndex.prefix_drops`
    (``[(length, bits)]``, disjoint bit sets; bit ``1+3i+s`` is node i, section s = gpu,
    host, local), visiting every set bit."""
    flat = [0] * (3 * nn + 1)
    for length, bits in drops:
        while bits:
            low = bits & -bits
            bits ^= low
            flat[low.bit_length() - 1] = length
    return flat[0], flat[1::3], flat[2::3], flat[3::3]


def _sources(
    index: BlockIndex,
    names: Sequence[str],
    path: Sequence[int],
    best_host: tuple[int, int],
    best_gpu: tuple[int, int],
    t_c: int,
) -> list[FetchRange]:
    """Greedy cover of ``path[:t_c]``: best host prefix, then best GPU prefix, then (mosaic
    tail) block by block, host copies first; ties → lowest node index. ``best_host`` and
    ``best_gpu``: (node index, prefix length in blocks) of the longest prefix in that tier."""
    if t_c == 0:
        return []
    out: list[FetchRange] = []
    pos = 0
    if best_host[1] > 0:
        pos = best_host[1]
        out.append(FetchRange(node=names[best_host[0]], start=0, end=pos, tier="host"))
    if best_gpu[1] > pos:
        out.append(FetchRange(node=names[best_gpu[0]], start=pos, end=best_gpu[1], tier="gpu"))
        pos = best_gpu[1]
    cur: tuple[int, int] | None = None
    start = pos
    for i in range(pos, t_c):
        pc = index.presence(path[i])
        if cur is not None and pc & tier_bit(*cur):
            continue
        if cur is not None:
            out.append(FetchRange(node=names[cur[0]], start=start, end=i, tier="gpu" if cur[1] == GPU else "host"))
        cur = _pick(pc, len(names))
        start = i
        if cur is None:  # cannot happen while comp is consistent; stop the plan here
            return out
    if cur is not None:
        out.append(FetchRange(node=names[cur[0]], start=start, end=t_c, tier="gpu" if cur[1] == GPU else "host"))
    return out


def _pick(pc: int, n_nodes: int) -> tuple[int, int] | None:
    """(node, tier) of the lowest-index node holding a block, host tier first."""
    for tier in (HOST, GPU):
        for node in range(n_nodes):
            if pc & tier_bit(node, tier):
                return node, tier
    return None


def usable_lookup(lookup: KvLookupReply | None, usable: Callable[[str], bool]) -> KvLookupReply | None:
    """``lookup`` without the nodes for which ``usable(node)`` is False.

    Args:
        lookup: the directory's answer (block counts; ``sources`` covers ``[0, longest_any)``).
        usable: node id → whether its cache may be counted on.

    Returns:
        ``lookup`` itself when every node it names is usable (or it is None / an error),
        else a copy: removed nodes' ``NodePrefix`` dropped, ``sources`` cut at the first
        range of a removed node (then extended to the longest kept local prefix, from the
        kept node holding it), ``longest_any`` = the end of that cover. O(nodes + sources).
    """
    if lookup is None or lookup.error is not None:
        return lookup
    named = {p.node for p in lookup.nodes} | {r.node for r in lookup.sources}
    bad = {n for n in named if not usable(n)}
    if not bad:
        return lookup
    nodes = [p for p in lookup.nodes if p.node not in bad]
    longest_local = max((p.local_blocks for p in nodes), default=0)
    if not lookup.sources:  # an answer without a fetch plan: only the local prefixes count
        return KvLookupReply(block_size=lookup.block_size, nodes=nodes, longest_any=longest_local, sources=[])
    sources: list[FetchRange] = []
    cut = 0
    for r in lookup.sources:
        if r.node in bad or r.start != cut:
            break
        sources.append(r)
        cut = r.end
    best = max(nodes, key=lambda p: p.local_blocks, default=None)
    if best is not None and best.local_blocks > cut:
        tier = "host" if best.host_blocks >= best.local_blocks else "gpu"
        sources.append(FetchRange(node=best.node, start=cut, end=best.local_blocks, tier=tier))  # type: ignore[arg-type]
        cut = best.local_blocks
    longest = cut
    return KvLookupReply(block_size=lookup.block_size, nodes=nodes, longest_any=longest, sources=sources)
