"""Baseline routing policies the simulator compares against: ``dynamo-kv`` and ``sticky``.

This module contains zero I/O: no asyncio, no NATS, no clock reads, no
logging. Both policies keep their state on the instance and learn what the
router dispatched through the :class:`~services.router.policy.RoutingPolicy`
hooks (``on_dispatch``, ``on_first_token``, ``on_finish``, ``on_branch_end``),
which :class:`~services.router.core.RouterCore` calls.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from shared.messages import KvLookupReply

from services.router.nodes import NodeLoad
from services.router.policy import DecodeChoice, PrefillChoice, RouteRequest, RoutingPolicy

# --------------------------------------------------------------------------- #
# dynamo-kv
# --------------------------------------------------------------------------- #


class DynamoCost(NamedTuple):
    """Dynamo KV router cost of one worker, in blocks, with its terms (for the route log)."""

    node: str
    cost: float
    raw_prefill_blocks: float
    """``(active_prefill_tokens + ISL) / bs``."""
    overlap_credit: float
    """``c·device_overlap + h·host_overlap`` (blocks)."""
    decode_blocks: int
    """``active_blocks + new blocks of the request not active on the worker``."""
    device_overlap: int
    host_overlap: int
    tree_size: int
    """Tie-break: blocks cached on the worker (its L1 use from its last state)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "cost": round(self.cost, 4),
            "raw_prefill_blocks": round(self.raw_prefill_blocks, 4),
            "overlap_credit": round(self.overlap_credit, 4),
            "decode_blocks": self.decode_blocks,
            "device_overlap": self.device_overlap,
            "host_overlap": self.host_overlap,
            "tree_size": self.tree_size,
        }


@dataclass(slots=True)
class _Active:
    prefill_node: str
    decode_node: str | None
    prefill_tokens: int
    hashes: Sequence[int]
    prefill_open: bool = True
    """Its prefill tokens still count on the prefill node."""
    prefill_blocks: bool = True
    """Its blocks still count on the prefill node."""


class _ActiveBlocks:
    """Refcounted set of block hashes active on one worker (Dynamo ``BlockTracker``)."""

    __slots__ = ("refs",)

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}

    def add(self, hashes: Sequence[int]) -> None:
        refs = self.refs
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1

    def remove(self, hashes: Sequence[int]) -> None:
        refs = self.refs
        for h in hashes:
            c = refs.get(h, 0) - 1
            if c > 0:
                refs[h] = c
            else:
                refs.pop(h, None)

    def active_prefix(self, path: Sequence[int]) -> int:
        """Longest prefix of ``path`` (chained hashes) whose blocks are all active here.

        With chained hashes a request holding block i holds blocks 0..i, so the
        active blocks of a path form a prefix: binary search, O(log len(path)).
        """
        refs = self.refs
        if not refs:
            return 0
        lo, hi = 0, len(path)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if path[mid - 1] in refs:
                lo = mid
            else:
                hi = mid - 1
        return lo


class DynamoKvPolicy(RoutingPolicy):
    """NVIDIA Dynamo's KV router cost (the Dynamo-like baseline, DESIGN §6).

    Source: ``lib/kv-router/src/scheduling/selector/default.rs`` and
    ``scheduling/config.rs`` (Dynamo ≥ 1.3; ``selector.rs`` in v1.1), load
    tracking in ``lib/kv-router/src/sequences/`` (``ActiveSequences``:
    ``PrefillLoadTracker``, ``BlockTracker``); see
    ``research/anchor-dynamo.md`` §5.1–5.3. For a request of ``ISL`` prompt
    tokens and each candidate worker w, in blocks of ``bs`` tokens::

        raw_prefill_blocks = (active_prefill_tokens(w) + ISL) / bs
        overlap_credit     = c · device_overlap(w) + h · host_overlap(w)
        decode_blocks      = active_blocks(w) + |request blocks not active on w|
        cost(w)            = s · max(0, raw_prefill_blocks − overlap_credit) + decode_blocks

    with ``c = overlap_score_credit = 1.0``, ``h = host_cache_hit_weight =
    0.75``, ``s = prefill_load_scale = 1.0`` (Dynamo's defaults; the disk term
    ``k = 0.25`` has no tier here, the shared-cache multiplier ``m`` is 0 by
    default in Dynamo and omitted, the decay λ is 0 by default so ``d = 1``,
    and the newest optional ``w_r·active_requests`` term is off by default).
    ``device_overlap`` is the worker's L1 prefix of the request (KV directory
    ``gpu_blocks``), ``host_overlap`` the blocks its L1 ∪ L2 prefix adds
    beyond it (``local_blocks − gpu_blocks``). With device-only hits this is
    the v1.1 formula ``prefill_tokens/bs + decode_blocks``.

    Load is the router's own record of its dispatches (Dynamo: "the router
    tracks these loads itself from the requests that it routes"):

    * ``active_prefill_tokens(w)``: Σ over requests sent to w whose first token
      has not arrived of their prefill tokens ``ISL − overlap·bs`` (overlap =
      the worker's L1 ∪ L2 prefix at dispatch); removed at the first token
      (``MarkPrefillCompleted``);
    * ``active_blocks(w)``: distinct block hashes of the requests active on w
      (refcounted); freed at completion (``Free``) — for a prefill worker of a
      PD pair at the first token (its part is done), for a collocated worker
      or a decode worker at the end of the request.

    Choice: temperature 0 → argmin of the cost; ties → the smallest tree (the
    worker caching the fewest blocks: L1 blocks in use from its last state),
    then the smallest node id (Dynamo: then random). Temperature > 0 → softmax
    sampling ``p ∝ exp(−((c − c_min)/(c_max − c_min))/T)`` (uniform when all
    costs are equal) with the instance's seeded RNG.

    Decode binding: Dynamo's decode router in disaggregated mode forces the
    prefill weight to 0 and does not track prefill tokens, so it balances on
    ``decode_blocks`` alone; ties as above.

    Args:
        block_size: tokens per block (> 0).
        overlap_score_credit: c (>= 0).
        host_cache_hit_weight: h, in [0, 1].
        prefill_load_scale: s (>= 0).
        temperature: T (>= 0).
        seed: RNG seed for T > 0.

    Raises:
        ValueError: on a parameter out of range.
    """

    name = "dynamo-kv"
    decode_rule = "dynamo_cost"

    def __init__(
        self,
        *,
        block_size: int = 64,
        overlap_score_credit: float = 1.0,
        host_cache_hit_weight: float = 0.75,
        prefill_load_scale: float = 1.0,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if overlap_score_credit < 0:
            raise ValueError(f"overlap_score_credit must be >= 0, got {overlap_score_credit}")
        if not 0.0 <= host_cache_hit_weight <= 1.0:
            raise ValueError(f"host_cache_hit_weight must be in [0, 1], got {host_cache_hit_weight}")
        if prefill_load_scale < 0:
            raise ValueError(f"prefill_load_scale must be >= 0, got {prefill_load_scale}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.block_size = block_size
        self.c = overlap_score_credit
        self.h = host_cache_hit_weight
        self.s = prefill_load_scale
        self.temperature = temperature
        self.rng = random.Random(seed)
        self.prefill_tokens: dict[str, int] = {}
        self.blocks: dict[str, _ActiveBlocks] = {}
        self._active: dict[str, _Active] = {}
        self._last_overlap: tuple[str, dict[str, int]] | None = None

    # -- cost ------------------------------------------------------------------ #

    def _blocks(self, node: str) -> _ActiveBlocks:
        b = self.blocks.get(node)
        if b is None:
            b = self.blocks[node] = _ActiveBlocks()
        return b

    def costs(self, req: RouteRequest, lookup: KvLookupReply | None, candidates: Sequence[NodeLoad], *, prefill: bool = True) -> list[DynamoCost]:
        """The cost of every candidate (``prefill=False``: the decode router's ``decode_blocks``)."""
        bs = self.block_size
        isl = req.prompt_tokens
        path = req.block_hashes
        n_blocks = len(path)
        prefixes = {p.node: p for p in lookup.nodes} if (prefill and lookup is not None and lookup.error is None) else {}
        out: list[DynamoCost] = []
        for n in candidates:
            node = n.node
            ab = self.blocks.get(node)
            if ab is None:
                active, shared = 0, 0
            else:
                active, shared = len(ab.refs), ab.active_prefix(path)
            decode_blocks = active + n_blocks - shared
            tree = max(0, n.gpu_total_blocks - n.gpu_free_blocks)
            if not prefill:
                out.append(DynamoCost(node, float(decode_blocks), 0.0, 0.0, decode_blocks, 0, 0, tree))
                continue
            pre = prefixes.get(node)
            dev = min(pre.gpu_blocks, n_blocks) if pre is not None else 0
            host = max(0, min(pre.local_blocks, n_blocks) - dev) if pre is not None else 0
            credit = self.c * dev + self.h * host
            raw = (self.prefill_tokens.get(node, 0) + isl) / bs
            cost = self.s * max(0.0, raw - credit) + decode_blocks
            out.append(DynamoCost(node, cost, raw, credit, decode_blocks, dev, host, tree))
        return out

    def _pick(self, costs: list[DynamoCost]) -> DynamoCost:
        if self.temperature > 0 and len(costs) > 1:
            lo = min(c.cost for c in costs)
            hi = max(c.cost for c in costs)
            if hi > lo:
                weights = [math.exp(-((c.cost - lo) / (hi - lo)) / self.temperature) for c in costs]
            else:
                weights = [1.0] * len(costs)
            return self.rng.choices(costs, weights=weights, k=1)[0]
        return min(costs, key=lambda c: (c.cost, c.tree_size, c.node))

    def choose_prefill(self, req: RouteRequest, lookup: KvLookupReply | None, candidates: Sequence[NodeLoad], now: float) -> PrefillChoice:
        if not candidates:
            raise ValueError("no prefill candidates")
        costs = self.costs(req, lookup, candidates)
        best = self._pick(costs)
        matches = {c.node: c.device_overlap + c.host_overlap for c in costs if c.device_overlap + c.host_overlap}
        total = req.num_blocks
        matched = max(matches.values(), default=0)
        loads = {n.node: self.prefill_tokens.get(n.node, 0) for n in candidates}
        self._last_overlap = (req.rid, {c.node: c.device_overlap + c.host_overlap for c in costs})
        return PrefillChoice(
            best.node, "dynamo_cost", matched, matched / total if total else 0.0, loads, matches, estimates=tuple(costs)
        )

    def choose_decode(self, req: RouteRequest, candidates: Sequence[NodeLoad], now: float) -> DecodeChoice | None:
        if not candidates:
            return None
        costs = self.costs(req, None, candidates, prefill=False)
        best = min(costs, key=lambda c: (c.cost, c.tree_size, c.node))
        return DecodeChoice(node=best.node, loads={c.node: c.decode_blocks for c in costs})

    # -- load tracking -------------------------------------------------------- #

    def on_dispatch(self, req: RouteRequest, choice: PrefillChoice, decode_node: str | None, now: float) -> None:
        overlap = 0
        if self._last_overlap is not None and self._last_overlap[0] == req.rid:
            overlap = self._last_overlap[1].get(choice.node, 0)
        self._last_overlap = None
        tokens = max(0, req.prompt_tokens - overlap * self.block_size)
        hashes = req.block_hashes
        self._active[req.rid] = _Active(choice.node, decode_node, tokens, hashes)
        self.prefill_tokens[choice.node] = self.prefill_tokens.get(choice.node, 0) + tokens
        self._blocks(choice.node).add(hashes)
        if decode_node is not None:
            self._blocks(decode_node).add(hashes)

    def on_decode_bound(self, req: RouteRequest, decode_node: str, now: float) -> None:
        a = self._active.get(req.rid)
        if a is None:
            return
        if a.decode_node is not None:
            self._blocks(a.decode_node).remove(a.hashes)
        a.decode_node = decode_node
        self._blocks(decode_node).add(a.hashes)

    def _prefill_done(self, a: _Active) -> None:
        if a.prefill_open:
            a.prefill_open = False
            left = self.prefill_tokens.get(a.prefill_node, 0) - a.prefill_tokens
            if left > 0:
                self.prefill_tokens[a.prefill_node] = left
            else:
                self.prefill_tokens.pop(a.prefill_node, None)

    def on_first_token(self, rid: str, now: float) -> None:
        a = self._active.get(rid)
        if a is None:
            return
        self._prefill_done(a)
        if a.decode_node is not None and a.prefill_blocks:  # PD: the prefill worker's part is over
            a.prefill_blocks = False
            self._blocks(a.prefill_node).remove(a.hashes)

    def on_finish(self, rid: str, now: float) -> None:
        a = self._active.pop(rid, None)
        if a is None:
            return
        self._prefill_done(a)
        if a.prefill_blocks:
            self._blocks(a.prefill_node).remove(a.hashes)
        if a.decode_node is not None:
            self._blocks(a.decode_node).remove(a.hashes)

    def on_node_gone(self, node: str, now: float) -> None:
        """Drop ``node``'s active-block set and prefill load (empty: it holds no request)."""
        self.blocks.pop(node, None)
        self.prefill_tokens.pop(node, None)

    def active_blocks(self, node: str) -> int:
        """Distinct block hashes active on ``node``."""
        b = self.blocks.get(node)
        return len(b.refs) if b is not None else 0


# --------------------------------------------------------------------------- #
# sticky
# --------------------------------------------------------------------------- #


class StickyPolicy(RoutingPolicy):
    """Branch affinity: a branch's requests go to the prefill node that served its previous request.

    Sources: SGLang model gateway ``--policy sticky`` (``StickyConfig``: a
    routing key from the ``x-sgl-routing-key`` header pins a key to one
    worker; the worker of a new key, and of requests without a key, comes from
    a fallback policy; an assignment idle for ``idle_secs`` = 600 s is
    evicted) and Dynamo's ``StickySessionRouter`` (``nvext.session_control``:
    session → worker affinity with a sliding TTL, 300 s by default); see
    ``research/anchor-sglang-mooncake.md`` §A5 and ``research/anchor-peers.md``.

    Here the key is the agent branch (``X-Branch-Id``). Rules:

    1. A request of a branch whose binding is **live** — the branch has not
       ended and its previous request was dispatched at most ``ttl_s`` ago
       (sliding: every request renews it) — goes to the bound node if that node
       is a candidate now (path ``sticky``).
    2. Otherwise (first request of the branch, binding expired, or the bound
       node fenced / switched phase / draining) the node with the fewest
       router in-flight requests, ties → node id (path ``sticky_new``, or
       ``sticky_rebind`` when a live binding's node was not available), and
       the branch is bound to it.
    3. A request without a branch: fewest in-flight requests (path ``min_load``).

    A branch end (``on_branch_end``) drops its binding. At most
    ``max_bindings`` bindings are kept (least recently used dropped first);
    expired ones are dropped as they are met. Decode: least loaded (the
    default rule).

    Args:
        ttl_s: sliding idle time after which a binding expires (s, > 0); the
            SGLang gateway's default is 600 s.
        max_bindings: cap on remembered bindings (>= 1).

    Raises:
        ValueError: on a parameter out of range.
    """

    name = "sticky"

    def __init__(self, *, ttl_s: float = 600.0, max_bindings: int = 1_000_000) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_bindings < 1:
            raise ValueError(f"max_bindings must be >= 1, got {max_bindings}")
        self.ttl_s = ttl_s
        self.max_bindings = max_bindings
        self.bindings: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """branch id → (node, time of its last dispatch); oldest first."""

    def _expire(self, now: float) -> None:
        b = self.bindings
        while b:
            _, (_, last) = next(iter(b.items()))
            if now - last <= self.ttl_s:
                break
            b.popitem(last=False)

    def bound(self, branch_id: str, now: float) -> str | None:
        """The node ``branch_id`` is bound to now, or None (no live binding)."""
        got = self.bindings.get(branch_id)
        if got is None or now - got[1] > self.ttl_s:
            return None
        return got[0]

    def choose_prefill(self, req: RouteRequest, lookup: KvLookupReply | None, candidates: Sequence[NodeLoad], now: float) -> PrefillChoice:
        if not candidates:
            raise ValueError("no prefill candidates")
        loads = {n.node: n.inflight for n in candidates}
        path = "min_load"
        if req.branch_id is not None:
            node = self.bound(req.branch_id, now)
            if node is not None and node in loads:
                return PrefillChoice(node, "sticky", loads=loads)
            path = "sticky_new" if node is None else "sticky_rebind"
        best = min(candidates, key=lambda n: (loads[n.node], n.node))
        return PrefillChoice(best.node, path, loads=loads)

    def on_dispatch(self, req: RouteRequest, choice: PrefillChoice, decode_node: str | None, now: float) -> None:
        if req.branch_id is None:
            return
        b = self.bindings
        b[req.branch_id] = (choice.node, now)
        b.move_to_end(req.branch_id)
        self._expire(now)
        while len(b) > self.max_bindings:
            b.popitem(last=False)

    def on_branch_end(self, branch_id: str, now: float) -> None:
        self.bindings.pop(branch_id, None)
