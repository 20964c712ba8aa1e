"""Planner and routing components looked up by name, as the live services build them.

The simulator runs the *same* planner policies as the live planner service
(``services.planner.policy.make_planner``) and the same routing policies as the
router (``services.router.policy.make_policy``). This module finds them by name
at run time and says clearly when one is missing, so the simulator never
carries its own copy of a policy. The round-robin decode binding of the
baselines (:class:`~services.router.policy.RoundRobinDecode`, re-exported here)
is the router's too: a live router runs it with ``--decode-routing round-robin``.

Planner interface (``services/planner/policy.py``)::

    on_iterations(node, records, now); on_node_state(state, now); on_request_done(done, now)
    on_switch_done(node, phase, now); tick(now, phases, busy) -> SplitDecision | None; next_tick() -> float | None
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set as AbstractSet
from typing import Any, Protocol

from shared.messages import IterationRecord, NodeState, Phase
from shared.profile import Profile

from services.planner import policy as planner_policy
from services.router.policy import RoundRobinDecode, RoutingPolicy, make_policy, policy_names, with_decode_routing

__all__ = ["ComponentMissing", "PlannerLike", "RoundRobinDecode", "make_planner", "make_routing", "planner_names",
           "request_done_type", "routing_available"]

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
    return with_decode_routing(make_policy(name, **options), decode_routing)
