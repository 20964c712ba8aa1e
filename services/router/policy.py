"""Routing policies: which prefill node serves a request, which decode node it binds.

This module contains zero I/O: no asyncio, no NATS, no clock reads, no logging
setup. A policy is a small synchronous object; the live router
(``services/router/service.py``) and the discrete-event simulator call the
same code with ``now`` passed in.

Interface (what the simulator calls)::

    policy = make_policy("ttft", profile="gb300-glm52")   # or cache-aware, dynamo-kv, round-robin, sticky
    req = RouteRequest(rid="r1", prompt_tokens=4096, block_hashes=hashes, max_tokens=16)
    pre = policy.choose_prefill(req, lookup, view.prefill_candidates(now), now)   # -> PrefillChoice
    dec = policy.choose_decode(req, view.decode_candidates(now), now)             # -> DecodeChoice | None

``lookup`` is the directory's :class:`~shared.messages.KvLookupReply` for
``req.block_hashes`` (or None when the directory did not answer — routing
then has no cache information). ``candidates`` is a non-empty list of
:class:`~services.router.nodes.NodeLoad` (the node-load view of the eligible
nodes, from :class:`~services.router.nodes.NodeLoadView`). Policies never
mutate the view; the caller records the placement with
``NodeLoadView.on_dispatch`` (see :class:`services.router.core.RouterCore`,
which does all of this in one call).

After a placement the caller tells the policy what happened through its
hooks (``on_dispatch``, ``on_first_token``, ``on_finish``), and forwards node
states (``on_state``), branch ends (``on_branch_end``) and the planner's
fitted models (``on_models``); :class:`~services.router.core.RouterCore` does
all of this. Policies that keep no state ignore them.

New policies subclass :class:`RoutingPolicy`, set ``name`` and register with
:func:`register_policy`; the router selects one by name (``--routing``).
Registered: ``ttft`` (``services/router/ttft.py``, the paper's router),
``cache-aware``, ``round-robin`` (here), ``dynamo-kv`` and ``sticky``
(``services/router/baselines.py``). A wrapper that changes one decision
subclasses :class:`PolicyWrapper`, which forwards every hook to the wrapped
policy: :class:`RoundRobinDecode` (the baselines' round-robin decode binding,
``--decode-routing round-robin`` live and in the simulator) is one;
:func:`with_decode_routing` applies a ``--decode-routing`` choice.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from shared.messages import FetchRange, KvLookupReply, NodeState, PlannerModels, Sampling
from shared.values import FACTORY, FrozenValue, StructValue, set_field

from services.router.nodes import NodeLoad


@dataclass(slots=True)
class RouteRequest:
    """One request to place.

    Attributes:
        rid: request id (one NATS token).
        prompt_tokens: prompt length (tokens, >= 1).
        block_hashes: chained page hashes of the prompt's full blocks
            (``shared.hashing.block_hashes_packed``), ``len == prompt_tokens // block_size``.
        max_tokens: output tokens to generate (>= 1).
        token_ids: the prompt as packed little-endian uint32 (may be empty in simulation).
        branch_id: the agent branch the request belongs to, if any.
        ignore_eos: generate ``max_tokens`` past the model's EOS token (``PrefillWork.ignore_eos``).
        sampling: sampling parameters for the nodes (``PrefillWork.sampling``); None = greedy.

    Read-only once built (the policy and the router core read it; nothing assigns to it).
    Not ``frozen=True`` (nothing hashes it; equality is unchanged): one is built per request, and a
    frozen dataclass's ``__init__`` (``object.__setattr__`` per field) costs ~3x this one.
    """

    rid: str
    prompt_tokens: int
    block_hashes: Sequence[int] = ()
    max_tokens: int = 16
    token_ids: bytes = b""
    branch_id: str | None = None
    ignore_eos: bool = False
    sampling: Sampling | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


class PrefillChoice(StructValue):
    """A policy's prefill decision with the numbers behind it (for the route log).

    Attributes:
        node: chosen prefill node.
        path: which rule decided: ``imbalanced`` (load gate → min load),
            ``cache_hit`` (match rate above threshold → longest match),
            ``min_load`` (below threshold / no cache info), ``round_robin``.
        matched_blocks: longest per-node prefix among the candidates (blocks).
        match_rate: ``matched_blocks / num_blocks`` (0 when the prompt has no full block).
        loads: load the policy compared, per candidate node.
        matches: per-candidate local prefix (blocks) from the lookup.
        predicted_ttft_s: the policy's predicted TTFT on ``node`` (s from the
            decision to the end of the prefill); None for policies that do not
            predict it.
        estimates: per-candidate score breakdown, each with ``node`` and
            ``as_dict()`` (``ttft``: wait, own prefill, exposed fetch, copy
            price, of the candidates that could still be chosen when scored, the
            chosen one among them — every candidate's when the predictor keeps a
            breakdown, as the route log at debug level does; ``dynamo-kv``: the
            cost terms); empty when the policy has none.
        fetch: block ranges ``node`` should fetch from peers while the request
            waits (sent in ``PrefillWork.fetch``); empty = none.

    Read-only once built (the router core and the route log read it). Not ``frozen=True``
    (nothing hashes it; its dicts made it unhashable anyway): one is built per decision,
    and a frozen dataclass's ``__init__`` (``object.__setattr__`` per field) costs ~3x this one.
    """

    node: str
    path: str
    matched_blocks: int = 0
    match_rate: float = 0.0
    loads: dict[str, int] = msgspec.field(default_factory=dict)
    matches: dict[str, int] = msgspec.field(default_factory=dict)
    predicted_ttft_s: float | None = None
    estimates: Sequence[Any] = ()
    fetch: tuple[FetchRange, ...] = ()


class DecodeChoice(FrozenValue):
    """Decode binding: chosen node and the load each candidate had."""

    node: str
    loads: dict[str, int]

    __slots__ = __match_args__ = ("node", "loads")

    def __init__(self, node: str, loads: Any = FACTORY) -> None:
        set_field(self, "node", node)
        set_field(self, "loads", {} if loads is FACTORY else loads)


def decode_load(n: NodeLoad) -> int:
    """Decode load of a node: ``running + waiting`` from its last state plus the
    router's own in-flight requests bound to it (issue #5; the in-flight term
    covers requests sent since that state, at the price of counting requests
    the state already shows twice — equally for every node)."""
    return n.running + n.waiting + n.inflight


def least_loaded_decode(candidates: Sequence[NodeLoad]) -> DecodeChoice | None:
    """The decode candidate with the lowest :func:`decode_load`; ties → smallest node id.

    Returns:
        None when ``candidates`` is empty.
    """
    if not candidates:
        return None
    loads = {n.node: decode_load(n) for n in candidates}
    best = min(candidates, key=lambda n: (loads[n.node], n.node))
    return DecodeChoice(node=best.node, loads=loads)


class RoutingPolicy(abc.ABC):
    """A prefill routing policy plus a decode binding rule (default: least loaded).

    Subclasses implement :meth:`choose_prefill`; they keep any state they need
    on the instance (no globals), never read a clock and never do I/O.
    """

    name: ClassVar[str] = ""
    decode_rule: str = "least_loaded"
    """How :meth:`choose_decode` picks (for the router's logs and ``/v1/cluster``): ``least_loaded`` (this default),
    ``least_loaded_kv_room`` (``ttft``), ``dynamo_cost`` (``dynamo-kv``), ``round_robin`` (:class:`RoundRobinDecode`)."""

    @abc.abstractmethod
    def choose_prefill(
        self,
        req: RouteRequest,
        lookup: KvLookupReply | None,
        candidates: Sequence[NodeLoad],
        now: float,
    ) -> PrefillChoice:
        """Pick the prefill node among ``candidates``.

        Args:
            req: the request (prompt length, block path).
            lookup: the KV directory's answer for ``req.block_hashes``; None when
                the directory did not answer (route without cache information).
            candidates: eligible prefill nodes (phase prefill or both), non-empty,
                sorted by node id.
            now: current time (caller's clock).

        Raises:
            ValueError: if ``candidates`` is empty.
        """

    def choose_decode(self, req: RouteRequest, candidates: Sequence[NodeLoad], now: float) -> DecodeChoice | None:
        """Bind the decode node: least loaded (:func:`least_loaded_decode`).

        Returns:
            None when ``candidates`` is empty.
        """
        return least_loaded_decode(candidates)

    # -- hooks (default: no state kept) ----------------------------------- #

    def on_state(self, state: NodeState, now: float) -> None:
        """A node's :class:`NodeState` arrived (after the node view applied it)."""

    def state_hook(self) -> Callable[[NodeState, float], None]:
        """What ``RouterCore`` calls with each state it applies, ``(state, now)``, resolved once when the
        core is made: :meth:`on_state` here; a policy whose ``on_state`` only forwards may return its
        target (one call frame less per state)."""
        return self.on_state

    def on_dispatch(self, req: RouteRequest, choice: PrefillChoice, decode_node: str | None, now: float) -> None:
        """``req`` was placed on ``choice.node`` (and bound to ``decode_node``) and is being sent."""

    def on_decode_bound(self, req: RouteRequest, decode_node: str, now: float) -> None:
        """``req`` (dispatched earlier) is now bound to ``decode_node``: the binding made when
        its prefill started (``RouterCore.bind_decode``), or a new decode node after the old
        one handed the request back. Replaces any earlier decode binding of ``req.rid``."""

    def on_first_token(self, rid: str, now: float) -> None:
        """The first output token of ``rid`` arrived: its prefill is done (called once per rid, and again
        when its decode node is bound after it, ``RouterCore.bind_decode``: its prefill node parked it
        until then, and the hand-off, the end of the prefill's part, follows that binding)."""

    def on_finish(self, rid: str, now: float) -> None:
        """``rid`` is over: finished, failed or aborted (called at most once per rid)."""

    def on_branch_end(self, branch_id: str, now: float) -> None:
        """The harness ended ``branch_id``."""

    def on_node_gone(self, node: str, now: float) -> None:
        """``node`` has left for good and holds no request (``RouterCore.forget_left``): drop what is kept
        about it. It may report again later; it is then a new node."""

    def on_models(self, msg: PlannerModels, now: float) -> int:
        """The planner published fitted models; returns how many nodes' models changed."""
        return 0


class PolicyWrapper(RoutingPolicy):
    """A policy that delegates everything to ``inner``; subclass it to override one decision.

    Every hook is forwarded, so a stateful inner policy (``ttft``, ``dynamo-kv``,
    ``sticky``) keeps seeing node states, dispatches, first tokens and ends.
    ``name`` is the inner policy's.
    """

    def __init__(self, inner: RoutingPolicy) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.decode_rule = inner.decode_rule

    def choose_prefill(self, req: RouteRequest, lookup: KvLookupReply | None, candidates: Sequence[NodeLoad], now: float) -> PrefillChoice:
        return self.inner.choose_prefill(req, lookup, candidates, now)

    def choose_decode(self, req: RouteRequest, candidates: Sequence[NodeLoad], now: float) -> DecodeChoice | None:
        return self.inner.choose_decode(req, candidates, now)

    def on_state(self, state: NodeState, now: float) -> None:
        self.inner.on_state(state, now)

    def on_dispatch(self, req: RouteRequest, choice: PrefillChoice, decode_node: str | None, now: float) -> None:
        self.inner.on_dispatch(req, choice, decode_node, now)

    def on_decode_bound(self, req: RouteRequest, decode_node: str, now: float) -> None:
        self.inner.on_decode_bound(req, decode_node, now)

    def on_first_token(self, rid: str, now: float) -> None:
        self.inner.on_first_token(rid, now)

    def on_finish(self, rid: str, now: float) -> None:
        self.inner.on_finish(rid, now)

    def on_branch_end(self, branch_id: str, now: float) -> None:
        self.inner.on_branch_end(branch_id, now)

    def on_node_gone(self, node: str, now: float) -> None:
        self.inner.on_node_gone(node, now)

    def on_models(self, msg: PlannerModels, now: float) -> int:
        return self.inner.on_models(msg, now)


DECODE_ROUTINGS = ("least-loaded", "round-robin")
"""``--decode-routing`` choices: ``least-loaded`` = the routing policy's own :meth:`RoutingPolicy.choose_decode`
(least loaded; ``ttft``: least loaded with KV room; ``dynamo-kv``: its KV cost), ``round-robin`` =
:class:`RoundRobinDecode` (SGLang Model Gateway PD mode, the paper's baselines, §6.1)."""


class RoundRobinDecode(PolicyWrapper):
    """Wraps a routing policy: its prefill choice, decode nodes bound round-robin.

    Source: SGLang Model Gateway PD mode, which picks the decode worker with its
    ``--decode-policy`` (round robin in the paper's baselines, §6.1: "cache-aware
    prefill routing and round-robin decode routing"). The counter is the
    instance's own (each router process has one, as independent gateway
    instances do); the cycle is over the eligible decode candidates in the order
    given (node-id order: ``NodeLoadView`` sorts them), continuing at
    ``counter mod len(candidates)`` when the set changes. Every call that binds
    takes the next one: a first binding at dispatch or at prefill start, and a
    re-binding (a decode node handed the request back: ``RouterCore.bind_decode``).
    Every other hook is forwarded to the wrapped policy (:class:`PolicyWrapper`).
    The choice's ``loads`` are the candidates' in-flight counts (the gateway's
    ``worker.load()``), for the route log only.
    """

    decode_rule = "round_robin"

    def __init__(self, inner: RoutingPolicy) -> None:
        super().__init__(inner)
        self.decode_rule = "round_robin"
        self._next = 0

    def choose_decode(self, req: RouteRequest, candidates: Sequence[NodeLoad], now: float) -> DecodeChoice | None:
        """The candidate at ``counter mod len(candidates)``, then the counter advances.

        Returns:
            None when ``candidates`` is empty (the counter does not advance).
        """
        if not candidates:
            return None
        node = candidates[self._next % len(candidates)].node
        self._next += 1
        return DecodeChoice(node=node, loads={n.node: n.inflight for n in candidates})


def with_decode_routing(policy: RoutingPolicy, decode_routing: str) -> RoutingPolicy:
    """``policy`` with the decode rule ``decode_routing`` (one of :data:`DECODE_ROUTINGS`): itself for
    ``least-loaded`` (its own rule), wrapped in :class:`RoundRobinDecode` for ``round-robin``.

    Raises:
        ValueError: ``decode_routing`` is not one of :data:`DECODE_ROUTINGS`.
    """
    if decode_routing == "round-robin":
        return RoundRobinDecode(policy)
    if decode_routing != "least-loaded":
        raise ValueError(f"decode routing must be one of {', '.join(DECODE_ROUTINGS)}, got {decode_routing!r}")
    return policy


def _min_load(candidates: Sequence[NodeLoad], loads: dict[str, int]) -> NodeLoad:
    """The candidate with the lowest ``loads[node]``, ties → smallest node id
    (``min`` by ``(load, node)``, without a key tuple per candidate)."""
    best = candidates[0]
    low = loads[best.node]
    for n in candidates:
        x = loads[n.node]
        if x < low or (x == low and n.node < best.node):
            best, low = n, x
    return best


class CacheAwarePolicy(RoutingPolicy):
    """SGLang model gateway's ``cache_aware`` policy over the KV directory's exact prefixes.

    Source: ``sgl-model-gateway/src/policies/cache_aware.rs`` (SGLang model
    gateway) and its event-driven variant
    ``experimental/sgl-router/src/policies/cache_aware_zmq.rs``. Per request:

    1. **Imbalance gate.** ``load`` is the router's in-flight request count per
       node (the gateway's ``worker.load()``: incremented at dispatch, released
       when the response completes — on both prefill and decode workers in PD
       mode). With ``max_load``/``min_load`` over the candidates, the system is
       imbalanced iff ``(max_load − min_load) > balance_abs_threshold`` **and**
       ``max_load > min_load × balance_rel_threshold``; then the min-load node
       wins (path ``imbalanced``).
    2. **Cache match.** Otherwise ``match_rate = matched / total`` where
       ``total`` is the request's full-block count and ``matched`` the longest
       prefix (in blocks) any candidate holds. If ``match_rate >
       cache_threshold`` the node with that longest match wins (path
       ``cache_hit``); among several nodes with the same longest match the
       least loaded one (as ``cache_aware_zmq`` does), then the smallest node id.
    3. **Fallback.** Else the min-load node (path ``min_load``). A prompt
       shorter than one block, or a failed directory lookup, has match rate 0.

    Ties in min-load are broken by node id (the gateway takes the first worker
    in registry order).

    Differences from the gateway, on purpose: the gateway's classic policy
    matches request *text* against an approximate radix tree of its own
    routing history; here ``matched`` comes from the KV directory's exact
    per-node prefix built from the engines' KV events (the gateway's
    event-driven ``cache_aware_zmq`` variant). The per-node match is
    ``local_blocks``: the longest prefix held in the node's L1 (GPU) or L2
    (host) — both are reusable without recomputation on that node. No tree is
    kept here, so there is no eviction thread.

    Defaults are the gateway CLI's (``--cache-threshold 0.3
    --balance-abs-threshold 64 --balance-rel-threshold 1.5``), not the
    library's ``CacheAwareConfig::default()`` (0.5 / 32 / 1.1).

    Args:
        cache_threshold: match rate above which the longest match wins, in [0, 1].
        balance_abs_threshold: absolute in-flight spread (requests) for the gate, >= 0.
        balance_rel_threshold: relative spread for the gate, >= 1.

    Raises:
        ValueError: on a threshold out of range.
    """

    name = "cache-aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def is_imbalanced(self, loads: Sequence[int]) -> bool:
        """The gateway's imbalance test on in-flight loads (False for an empty list)."""
        if not loads:
            return False
        max_load, min_load = max(loads), min(loads)
        return (max_load - min_load) > self.balance_abs_threshold and max_load > min_load * self.balance_rel_threshold

    def choose_prefill(
        self,
        req: RouteRequest,
        lookup: KvLookupReply | None,
        candidates: Sequence[NodeLoad],
        now: float,
    ) -> PrefillChoice:
        if not candidates:
            raise ValueError("no prefill candidates")
        loads = {n.node: n.inflight for n in candidates}
        matches: dict[str, int] = {}
        if lookup is not None and lookup.error is None:
            for p in lookup.nodes:
                if p.local_blocks and p.node in loads:
                    matches[p.node] = p.local_blocks
        total = len(req.block_hashes)
        matched = min(max(matches.values()), total) if matches else 0
        rate = matched / total if total else 0.0
        hi, lo = max(loads.values()), min(loads.values())
        if (hi - lo) > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:  # is_imbalanced
            node = _min_load(candidates, loads).node
            return PrefillChoice(node, "imbalanced", matched, rate, loads, matches)
        if rate > self.cache_threshold:
            best = [n for n in candidates if matches.get(n.node, 0) >= matched]
            node = _min_load(best, loads).node
            return PrefillChoice(node, "cache_hit", matched, rate, loads, matches)
        node = _min_load(candidates, loads).node
        return PrefillChoice(node, "min_load", matched, rate, loads, matches)


class RoundRobinPolicy(RoutingPolicy):
    """Cycle through the eligible prefill nodes in node-id order (a baseline).

    The counter is the instance's own; when the candidate set changes the
    cycle continues at ``counter mod len(candidates)``.
    """

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose_prefill(
        self,
        req: RouteRequest,
        lookup: KvLookupReply | None,
        candidates: Sequence[NodeLoad],
        now: float,
    ) -> PrefillChoice:
        if not candidates:
            raise ValueError("no prefill candidates")
        node = candidates[self._next % len(candidates)].node
        self._next += 1
        loads = {n.node: n.inflight for n in candidates}
        return PrefillChoice(node, "round_robin", 0, 0.0, loads, {})


PolicyFactory = Callable[..., RoutingPolicy]

_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Register a policy factory under ``name`` (``factory(**options) -> RoutingPolicy``).

    Raises:
        ValueError: if ``name`` is already registered.
    """
    if name in _REGISTRY:
        raise ValueError(f"routing policy {name!r} is already registered")
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """Build the policy registered as ``name``.

    Options a policy does not take are ignored, so one config can carry the
    knobs of every policy (e.g. ``cache_threshold`` is ignored by ``round-robin``).

    Raises:
        ValueError: for an unknown name (the message lists the known ones) or a
            bad option value.
    """
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(policy_names())}")
    return factory(**options)


def _cache_aware(**o: Any) -> RoutingPolicy:
    keys = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")
    return CacheAwarePolicy(**{k: o[k] for k in keys if k in o})


def _ttft(**o: Any) -> RoutingPolicy:
    from shared.profile import Profile, cluster_seconds_per, load_profile, on_cluster_clock

    from services.router.ttft import FetchModel, NodeCoefficients, TtftPolicy, TtftPredictor

    prof = o.get("profile", "gb300-glm52")
    profile = prof if isinstance(prof, Profile) else load_profile(str(prof))
    # a real engine's profile (profile_clock wall: measured at speed-up 1) predicts cluster seconds x speedup
    clock, speedup = o.get("profile_clock", "cluster"), float(o.get("speedup", 1.0))
    profile = on_cluster_clock(profile, clock, speedup)
    default = NodeCoefficients.from_profile(profile, int(o.get("ttft_chunk_tokens", 0)))
    # τ(x) and κ are seconds on the profile's clock too (the paper's are a real cluster's, as a wall profile's
    # times): x speedup with it, so every term of Eq. 7's score scales alike and the choice does not change
    n = cluster_seconds_per(clock, speedup)
    fetch = FetchModel(
        base_s=float(o.get("ttft_fetch_base_s", 0.45)) * n,
        per_token_s=float(o.get("ttft_fetch_per_token_s", 1e-6)) * n,
        min_tokens=int(o.get("ttft_fetch_min_tokens", 512)),
    )
    predictor = TtftPredictor(
        default,
        fetch=fetch,
        copy_price_s_per_token=float(o.get("ttft_copy_price_s_per_token", 1e-7)) * n,
        # a state's age is measured against the workers' publication cadence (wall seconds: node.state at
        # least every --idle-state-interval-s = 1 wall s), whatever the profile's clock: x speedup, as
        # --fence-after-s (at speed-up 50, 5 cluster s were 0.1 wall s: nearly every idle node untrusted)
        state_max_age_s=float(o.get("ttft_state_max_age_s", 5.0)) * speedup,
        prune_above=int(o.get("ttft_prune_above", 16)),
        breakdown=bool(o.get("ttft_breakdown", False)),
    )
    return TtftPolicy(predictor, block_size=int(o.get("block_size", profile.block_size)))


def _dynamo_kv(**o: Any) -> RoutingPolicy:
    from services.router.baselines import DynamoKvPolicy

    return DynamoKvPolicy(
        block_size=int(o.get("block_size", 64)),
        overlap_score_credit=float(o.get("dynamo_overlap_score_credit", 1.0)),
        host_cache_hit_weight=float(o.get("dynamo_host_cache_hit_weight", 0.75)),
        prefill_load_scale=float(o.get("dynamo_prefill_load_scale", 1.0)),
        temperature=float(o.get("dynamo_temperature", 0.0)),
        seed=int(o.get("seed", 0)),
    )


def _sticky(**o: Any) -> RoutingPolicy:
    from services.router.baselines import StickyPolicy

    return StickyPolicy(ttl_s=float(o.get("sticky_ttl_s", 600.0)))


register_policy(CacheAwarePolicy.name, _cache_aware)
register_policy(RoundRobinPolicy.name, lambda **_o: RoundRobinPolicy())
register_policy("ttft", _ttft)
register_policy("dynamo-kv", _dynamo_kv)
register_policy("sticky", _sticky)
