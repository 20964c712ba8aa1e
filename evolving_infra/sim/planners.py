"""Planner and routing components looked up by name, as the live services build them.

The simulator runs the *same* planner policies as the live planner service
(``services.planner.policy.make_planner``) and the same routing policies as the
router (``services.router.policy.make_policy``). This module finds them by name
at run time and says clearly when one is missing, so the simulator never
carries its own copy of a policy. One small piece belongs to the simulator
itself:

* :class:`RoundRobinDecode` — a routing-policy wrapper that keeps the wrapped
  policy's prefill choice and binds decode nodes round-robin, the SGLang Model
  Gateway's PD behaviour that the paper's baselines use (§6.1 "cache-aware
  prefill routing and round-robin decode routing").

Planner interface (``services/planner/policy.py``)::

    on_iterations(node, records, now); on_node_state(state, now); on_request_done(done, now)
    on_switch_done(node, phase, now); tick(now, phases, busy) -> SplitDecision | None; next_tick() -> float | None
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set as AbstractSet
from typing import Any, Protocol

from shared.messages import IterationRecord, KvLookupReply, NodeState, Phase
from shared.profile import Profile

from services.planner import policy as planner_policy
from services.router.nodes import NodeLoad
from services.router.policy import DecodeChoice, PrefillChoice, RouteRequest, RoutingPolicy, make_policy, policy_names

PLANNER_MODULE = "services.planner.policy"


class ComponentMissing(LookupError):
    """A policy named by the run is not registered in this tree."""


class PlannerLike(Protocol):
    name: str

    def on_iterations(self, node: str, records: Sequence[IterationRecord], now: float) -> None: ...
    def on_node_state(self, state: NodeState, now: float) -> None: ...
    def on_request_done(self, done: Any, now: float) -> None: ...
    def on_switch_done(self, node: str, phase: Phase, now: float) -> None: ...
    def tick(self, now: float, phases: Mapping[str, Phase], busy: AbstractSet[str]) -> Any: ...
    def next_tick(self) -> float | None: ...


def planner_names() -> list[str]:
    """Planner names registered in the planner service (``services.planner.policy.PLANNERS``)."""
    return list(planner_policy.PLANNERS)


def make_planner(name: str, nodes: Sequence[str], profile: Profile, **options: Any) -> tuple[PlannerLike, str]:
    """Build planner ``name`` for ``nodes``; returns ``(planner, PLANNER_MODULE)``.

    Raises:
        ComponentMissing: the planner service does not know ``name``, or its options are wrong.
    """
    try:
        return planner_policy.make_planner(name, list(nodes), profile, **options), PLANNER_MODULE
    except ValueError as e:
        known = ", ".join(planner_names())
        raise ComponentMissing(f"planner {name!r} could not be built ({e}); known planners: {known}") from e


def request_done_type() -> type:
    """The planner service's ``RequestDone``."""
    return planner_policy.RequestDone


def routing_available(name: str) -> bool:
    return name in policy_names()


def make_routing(name: str, decode_routing: str, **options: Any) -> RoutingPolicy:
    """The router's policy ``name`` (``services.router.policy``), with round-robin decode
    binding when ``decode_routing == "round-robin"``.

    Raises:
        ComponentMissing: ``name`` is not registered.
    """
    if name not in policy_names():
        raise ComponentMissing(f"routing policy {name!r} is not registered in services/router/policy.py; known: {', '.join(policy_names())}")
    inner = make_policy(name, **options)
    if decode_routing == "round-robin":
        return RoundRobinDecode(inner)
    return inner


try:  # the router's forwarding base (every hook reaches the wrapped policy), when present
    from services.router.policy import PolicyWrapper as _WrapperBase
except ImportError:  # pragma: no cover - older router tree
    _WrapperBase = RoutingPolicy  # type: ignore[misc,assignment]


class RoundRobinDecode(_WrapperBase):
    """Wraps a routing policy: its prefill choice, decode nodes bound round-robin.

    Source: SGLang Model Gateway PD mode, which picks the decode worker with its
    ``--decode-policy`` (round robin in the paper's baselines, §6.1). The counter
    is the instance's own; the cycle is over the eligible decode nodes in node-id
    order, continuing at ``counter mod len(candidates)`` when the set changes.
    Every other hook is forwarded to the wrapped policy (``PolicyWrapper``).
    """

    def __init__(self, inner: RoutingPolicy) -> None:
        if _WrapperBase is RoutingPolicy:  # pragma: no cover
            self.inner = inner
            self.name = inner.name  # type: ignore[misc]
        else:
            super().__init__(inner)
        self._next = 0

    def choose_prefill(self, req: RouteRequest, lookup: KvLookupReply | None, candidates: Sequence[NodeLoad], now: float) -> PrefillChoice:
        return self.inner.choose_prefill(req, lookup, candidates, now)

    def choose_decode(self, req: RouteRequest, candidates: Sequence[NodeLoad], now: float) -> DecodeChoice | None:
        if not candidates:
            return None
        node = candidates[self._next % len(candidates)].node
        self._next += 1
        return DecodeChoice(node=node, loads={n.node: n.inflight for n in candidates})
