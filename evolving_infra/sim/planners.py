"""Planner and routing components looked up by name, as the live services build them.

The simulator runs the *same* planner policies as the live planner service
(``services.planner.policy.make_planner``) and the same routing policies as the
router (``services.router.policy.make_policy``). This module finds them by name
at run time and says clearly when one is missing, so the simulator never
carries its own copy of a policy. Two small pieces belong to the simulator
itself:

* :class:`StaticPlanner` — the fixed split, used only when
  ``services/planner/policy.py`` does not exist in the tree (it never switches,
  so there is nothing to diverge from);
* :class:`RoundRobinDecode` — a routing-policy wrapper that keeps the wrapped
  policy's prefill choice and binds decode nodes round-robin, the SGLang Model
  Gateway's PD behaviour that the paper's baselines use (§6.1 "cache-aware
  prefill routing and round-robin decode routing").

Planner interface (``services/planner/policy.py``)::

    on_iterations(node, records, now); on_node_state(state, now); on_request_done(done, now)
    on_switch_done(node, phase, now); tick(now, phases, busy) -> SplitDecision | None; next_tick() -> float | None
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence, Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.messages import IterationRecord, KvLookupReply, NodeState, Phase
from shared.profile import Profile

from services.router.nodes import NodeLoad
from services.router.policy import DecodeChoice, PrefillChoice, RouteRequest, RoutingPolicy, make_policy, policy_names

PLANNER_MODULE = "services.planner.policy"


class ComponentMissing(LookupError):
    """A policy named by the run is not registered in this tree."""


@dataclass(frozen=True, slots=True)
class RequestDoneLocal:
    """Field-for-field twin of ``services.planner.policy.RequestDone``, used only when that
    module does not exist (the built-in :class:`StaticPlanner` ignores it)."""

    rid: str
    prefill_node: str | None
    decode_node: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    arrived_at: float
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True, slots=True)
class SplitDecisionLocal:
    """Twin of ``services.planner.policy.SplitDecision`` for the built-in planner."""

    phases: dict[str, Phase]
    reason: str
    diagnostics: dict[str, Any] = field(default_factory=dict)


class PlannerLike(Protocol):
    name: str

    def on_iterations(self, node: str, records: Sequence[IterationRecord], now: float) -> None: ...
    def on_node_state(self, state: NodeState, now: float) -> None: ...
    def on_request_done(self, done: Any, now: float) -> None: ...
    def on_switch_done(self, node: str, phase: Phase, now: float) -> None: ...
    def tick(self, now: float, phases: Mapping[str, Phase], busy: AbstractSet[str]) -> Any: ...
    def next_tick(self) -> float | None: ...


class StaticPlanner:
    """A fixed split: never decides anything (paper §6.1 "best static split").

    Used only when ``services/planner/policy.py`` is absent; otherwise the
    planner service's own ``static`` policy runs.
    """

    name = "static"

    def on_iterations(self, node: str, records: Sequence[IterationRecord], now: float) -> None:
        return None

    def on_node_state(self, state: NodeState, now: float) -> None:
        return None

    def on_request_done(self, done: Any, now: float) -> None:
        return None

    def on_switch_done(self, node: str, phase: Phase, now: float) -> None:
        return None

    def tick(self, now: float, phases: Mapping[str, Phase], busy: AbstractSet[str]) -> None:
        return None

    def next_tick(self) -> float | None:
        return None


def planner_module() -> Any | None:
    """``services.planner.policy`` if it exists in this tree, else None."""
    try:
        return importlib.import_module(PLANNER_MODULE)
    except ModuleNotFoundError as e:
        if e.name != PLANNER_MODULE:
            raise
        return None


def planner_names() -> list[str]:
    """Planner names available now (the planner service's ``PLANNERS``, or ``static`` alone)."""
    mod = planner_module()
    if mod is None:
        return ["static"]
    return list(getattr(mod, "PLANNERS", ("static",)))


def make_planner(name: str, nodes: Sequence[str], profile: Profile, **options: Any) -> tuple[PlannerLike, str]:
    """Build planner ``name`` for ``nodes``; returns ``(planner, where)`` with ``where`` =
    ``services.planner.policy`` or ``sim built-in``.

    Raises:
        ComponentMissing: the planner module is absent and ``name`` is not ``static``,
            or the module does not know ``name``.
    """
    mod = planner_module()
    if mod is None:
        if name == "static":
            return StaticPlanner(), "sim built-in (services/planner/policy.py absent)"
        raise ComponentMissing(
            f"planner {name!r} is not available: services/planner/policy.py does not exist in this tree "
            "(only the built-in 'static' planner can run)"
        )
    try:
        return mod.make_planner(name, list(nodes), profile, **options), PLANNER_MODULE
    except ValueError as e:
        known = ", ".join(planner_names())
        raise ComponentMissing(f"planner {name!r} could not be built ({e}); known planners: {known}") from e


def request_done_type() -> type:
    """``RequestDone`` of the planner module, or the local twin."""
    mod = planner_module()
    return getattr(mod, "RequestDone", RequestDoneLocal) if mod is not None else RequestDoneLocal


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


class RoundRobinDecode(_WrapperBase):  # type: ignore[misc,valid-type]
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
            super().__init__(inner)  # type: ignore[call-arg]
        self._next = 0

    def choose_prefill(self, req: RouteRequest, lookup: KvLookupReply | None, candidates: Sequence[NodeLoad], now: float) -> PrefillChoice:
        return self.inner.choose_prefill(req, lookup, candidates, now)

    def choose_decode(self, req: RouteRequest, candidates: Sequence[NodeLoad], now: float) -> DecodeChoice | None:
        if not candidates:
            return None
        node = candidates[self._next % len(candidates)].node
        self._next += 1
        return DecodeChoice(node=node, loads={n.node: n.inflight for n in candidates})
