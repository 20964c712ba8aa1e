"""The planner policy interface shared by the live planner and the simulator, and its registry.

Contains zero I/O: a policy is a synchronous state machine (STYLE §2.1, the
Dynamo planner's ``on_tick``). Every method takes ``now`` (simulated s); the
caller feeds it what the cluster reports and calls :meth:`PlannerPolicy.tick`
when :meth:`PlannerPolicy.next_tick` says ("the core schedules itself",
STYLE §2.2). The live shell (``service.py`` via ``core.py``) and the
discrete-event simulator drive the same objects.

Contract::

    pol = make_planner("evolving", nodes, profile, t_learn_s=600)
    pol.on_iterations(node, records, now)       # node.iters.<node>
    pol.on_node_state(state, now)               # node.state.<node>
    pol.on_request_done(done, now)              # a finished request (w̄ input)
    pol.on_switch_done(node, phase, now)        # a node serves its new phase
    d = pol.tick(now, phases, busy)             # at pol.next_tick()
    if d is not None: apply d.phases            # only returned when phases change
    for ev in pol.take_decisions(): publish     # every evaluation, switch or not

Additive extensions beyond the interface the simulator was given:
:meth:`take_decisions` (every decision, including "no switch", as
``PlannerDecision`` messages), :meth:`models` (the per-node Eq. 1–4 models
for ``planner.models``), ``on_placed`` (the live planner's core applied a
decision's split count with other nodes, or swapped the current split's: it lays
a phase left on dead nodes only over live ones) and ``on_liveness`` (the live planner's core says which
nodes are dead before each tick: the policies value the capacity of the live nodes only, see
:meth:`PolicyBase.on_liveness`); all have defaults on :class:`PolicyBase`. The simulator
calls none of them (no node dies there: every policy plans over every node, as before).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from shared.config import parse_key_values
from shared.messages import CandidateGain, IterationRecord, NodeState, Phase, PlannerDecision
from shared.profile import Profile
from shared.split import assign_min_change, split_name
from shared.values import FACTORY, FrozenValue, StructValue, set_field

if TYPE_CHECKING:
    from services.planner.observe import Observer


PLANNERS: tuple[str, ...] = ("static", "evolving", "dynamo", "arrow")


class RequestDone(StructValue):
    """A finished request as the planner sees it (w̄ of paper §5.2, arrivals for the SLO guard).

    In the simulator every field is exact. The live planner builds it from the
    ``req.<rid>.out.<node>`` token stream (``core.RequestTracker``): ``arrived_at`` is
    the first-token time minus the wait in the prefill node's queue
    (``TokenChunk.queue_s``), ``ttft_s`` that wait, ``e2e_s`` arrival → last token.
    The planners only use ``arrived_at + ttft_s`` (first-token time) and the token counts.

    Read-only once built (the planners read it; nothing assigns to it). Not ``frozen=True``
    (nothing hashes it; equality is unchanged): one is built per finished request, and a frozen
    dataclass's ``__init__`` (``object.__setattr__`` per field) costs ~3x this one.
    """

    rid: str
    prefill_node: str
    decode_node: str
    prompt_tokens: int
    cached_tokens: int
    """t_c: prompt tokens served from KV (any tier, after any fetch)."""
    output_tokens: int
    """t_out."""
    arrived_at: float
    ttft_s: float
    e2e_s: float


class SplitDecision(FrozenValue):
    """A new phase map to apply, with why. ``diagnostics['decision']`` is the
    :class:`PlannerDecision` (as a dict) that explains it."""

    phases: dict[str, Phase]
    reason: str
    diagnostics: dict[str, Any]

    __slots__ = __match_args__ = ("phases", "reason", "diagnostics")

    def __init__(self, phases: dict[str, Phase], reason: str, diagnostics: Any = FACTORY) -> None:
        set_field(self, "phases", phases)
        set_field(self, "reason", reason)
        set_field(self, "diagnostics", {} if diagnostics is FACTORY else diagnostics)


@runtime_checkable
class PlannerPolicy(Protocol):
    """What the simulator and the live planner call (see the module docstring)."""

    name: str

    def on_iterations(self, node: str, records: Sequence[IterationRecord], now: float) -> None: ...

    def on_node_state(self, state: NodeState, now: float) -> None: ...

    def on_request_done(self, done: RequestDone, now: float) -> None: ...

    def on_switch_done(self, node: str, phase: Phase, now: float) -> None: ...

    def tick(self, now: float, phases: Mapping[str, Phase], busy: Set[str]) -> SplitDecision | None: ...

    def next_tick(self) -> float | None: ...


class PolicyBase:
    """Shared plumbing: node list, the decision outbox, ``PlannerDecision`` construction.

    Args:
        nodes: node ids (cluster order).
        profile: the node profile (Eq. 1/2 priors, scheduler limits).

    Raises:
        ValueError: on an empty or duplicate node list.
    """

    name = "base"

    obs: Observer | None = None
    """The observer a policy keeps its measurements in (evolving, arrow), or None (static, dynamo): a node
    newly dead leaves its populations (:meth:`on_liveness`)."""

    def __init__(self, nodes: Sequence[str], profile: Profile) -> None:
        if not nodes:
            raise ValueError("a planner needs at least one node")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"duplicate node ids in {list(nodes)}")
        self.nodes = list(nodes)
        self.profile = profile
        self._outbox: list[PlannerDecision] = []
        self._seq = 0
        self.switches = 0
        """Decisions returned that changed the phase map."""
        self._split_note: str | None = None
        self.dead: frozenset[str] = frozenset()
        """Nodes the live planner's core found dead at its last :meth:`on_liveness` (empty in the simulator)."""
        self.tick_moved = False
        """Set by an input (:meth:`on_iterations`, ...) that brought :meth:`next_tick` forward between ticks (the
        evolving planner's warm-up restarted at the first iteration record): a caller that asks ``next_tick``
        only after a tick (the simulator) asks again and clears it; the live core asks every round."""

    @property
    def records_now(self) -> bool:
        """Whether :meth:`on_iterations` must get each plan's records at the plan's end (True here: it may read
        ``now`` or bring :meth:`next_tick` forward). False (a planner that says so, see
        :meth:`services.planner.evolving.EvolvingPlanner.records_now`): until its next :meth:`tick`, a caller
        may hold the records and hand each node's in one call, in that node's order, before the planner's
        next read (its tick, its models, the end of a run), with the planner's state then the same as one
        call per plan would leave. Read at a tick, for the interval to the next one."""
        return True

    # -- default no-op inputs --------------------------------------------- #

    def on_iterations(self, node: str, records: Sequence[IterationRecord], now: float) -> None:
        return None

    def on_node_state(self, state: NodeState, now: float) -> None:
        return None

    def on_request_done(self, done: RequestDone, now: float) -> None:
        return None

    def on_switch_done(self, node: str, phase: Phase, now: float) -> None:
        return None

    def on_placed(self, phases: Mapping[str, Phase], now: float) -> None:
        """The live planner's core applied ``phases`` of its own: this policy's last decision with a phase
        it left on dead nodes only swapped onto a live node (the same prefill count), called after
        :meth:`tick` returned that decision, or the current split with such a swap (the liveness swap,
        ``core.PlannerCore._rescue``), called after it was issued (``core.PlannerCore._dead_swap`` both).
        Never called by the simulator (no node dies there)."""
        return None

    def on_liveness(self, dead: Set[str], now: float) -> None:
        """The live planner's core (``core.PlannerCore.dead``), before each :meth:`tick`: ``dead`` are the nodes
        heard and then silent for ``--silent-after-s`` while a live node was heard (fenced by the routers too,
        ``--fence-after-s``, the same time under ``up``). A policy plans over the live nodes only
        (:meth:`live`): a dead node's capacity is not counted in a phase's throughput, nor in the counts
        a phase keeps, and its last state (a stale queue, KV load, decode batch) is no measurement. A dead
        node keeps its phase in a decision (the core lays a phase left on dead nodes only over a live
        one); it counts again once it reports. Before, every policy counted it: the evolving planner's Θ
        (Eq. 5) and predicted latency of each candidate summed its μP or μD and spread q̄ over it, its
        guard's backlog averaged its last queue; Dynamo averaged its last queue and KV load; Arrow took
        its last queue as the best prefill node's. A node newly dead leaves the populations of the policy's
        observer (:attr:`obs`: the evolving planner's q̄ and prefill queue, Arrow's), as if it had reported an
        empty state (``Observer.forget``); its next state counts again. Never called by the simulator. O(N)."""
        newly = [n for n in dead if n not in self.dead]
        self.dead = frozenset(n for n in dead if n in self.nodes)
        obs = self.obs
        if obs is not None:
            for n in newly:
                obs.forget(n, now)

    def live(self, phases: Mapping[str, Phase]) -> dict[str, Phase]:
        """``phases`` without the dead nodes (:meth:`on_liveness`), in their order; ``phases`` as a dict when none is."""
        dead = self.dead
        return {n: ph for n, ph in phases.items() if n not in dead} if dead else dict(phases)

    def assign_live(self, phases: Mapping[str, Phase], prefill_count: int) -> dict[str, Phase]:
        """``phases`` with the live nodes' (:meth:`live`) given ``prefill_count`` prefill nodes, the rest decode,
        by ``shared.split.assign_min_change`` (the fewest switches); a dead node keeps its phase (the core lays a
        phase left on dead nodes only over a live one). Every node of ``phases``, in its order. O(N).

        Raises:
            SplitError: as ``assign_min_change``: ``prefill_count`` outside ``1 .. len(live) - 1``."""
        return {**phases, **assign_min_change(self.live(phases), prefill_count)}

    # -- outputs ---------------------------------------------------------- #

    def take_decisions(self) -> list[PlannerDecision]:
        """Drain the decisions made since the last call (every evaluation, switch or not)."""
        out, self._outbox = self._outbox, []
        return out

    def take_split_note(self) -> str | None:
        """A new reason for the split this policy keeps (phases unchanged), set since the last call, or None:
        the evolving planner's warm-up extended for want of data, whose split said "until t=180s" while the
        warm-up went on. The planner core puts it in its current command (same epoch), which ``split get``
        answers and every announcement carries to the routers (``GET /v1/cluster``'s ``split_reason``)."""
        out, self._split_note = self._split_note, None
        return out

    def models(self) -> Any:
        """The per-node models this policy plans with (``PlannerModels``), or None."""
        return None

    def _decide(
        self,
        now: float,
        action: str,
        before: Mapping[str, Phase],
        after: Mapping[str, Phase] | None,
        reason: str,
        *,
        candidates: Sequence[CandidateGain] = (),
        metrics: Mapping[str, float] | None = None,
    ) -> SplitDecision | None:
        """Record a decision event; return a :class:`SplitDecision` if ``after`` changes the phases."""
        self._seq += 1
        # non-finite values are left out: JSON has no inf/NaN (they would come back as null)
        clean = {k: float(v) for k, v in (metrics or {}).items() if v is not None and math.isfinite(float(v))}
        changed = after is not None and dict(after) != dict(before)
        ev = PlannerDecision(
            seq=self._seq,
            ts=now,
            policy=self.name,
            action=action if (changed or action != "switch") else "no_switch",
            split_before=split_name(before),
            split_after=split_name(after if changed and after is not None else before),
            reason=reason,
            candidates=list(candidates),
            metrics=clean,
        )
        self._outbox.append(ev)
        if not changed or after is None:
            return None
        self.switches += 1
        return SplitDecision(phases=dict(after), reason=reason, diagnostics={"decision": _as_dict(ev)})


def dead_note(dead: Set[str]) -> str:
    """`` (live nodes only; dead: w0, w3)`` for a decision's reason when nodes are dead (the policy planned
    without them, :meth:`PolicyBase.on_liveness`), else ``""``."""
    return f" (live nodes only; dead: {', '.join(sorted(dead))})" if dead else ""


def _as_dict(ev: PlannerDecision) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(ev)


class StaticPlanner(PolicyBase):
    """Never switches (the best-static-split baseline, and the default of the live planner)."""

    name = "static"

    def tick(self, now: float, phases: Mapping[str, Phase], busy: Set[str]) -> SplitDecision | None:
        return None

    def next_tick(self) -> float | None:
        return None


def make_planner(name: str, nodes: Sequence[str], profile: Profile, **kw: Any) -> PlannerPolicy:
    """Build a planner policy by name: ``static``, ``evolving``, ``dynamo`` or ``arrow``.

    Keyword arguments are the fields of the policy's parameter dataclass
    (``EvolvingParams``, ``DynamoParams``, ``ArrowParams``); ``static`` takes none.

    Raises:
        ValueError: unknown name, unknown or invalid parameter, bad node list.
    """
    if name == "static":
        if kw:
            raise ValueError(f"planner 'static' takes no parameters, got {sorted(kw)}")
        return StaticPlanner(nodes, profile)
    if name == "evolving":
        from services.planner.evolving import EvolvingParams, EvolvingPlanner

        return EvolvingPlanner(nodes, profile, params_from(EvolvingParams, kw, name))
    if name == "dynamo":
        from services.planner.baselines import DynamoParams, DynamoPlanner

        return DynamoPlanner(nodes, profile, params_from(DynamoParams, kw, name))
    if name == "arrow":
        from services.planner.baselines import ArrowParams, ArrowPlanner

        return ArrowPlanner(nodes, profile, params_from(ArrowParams, kw, name))
    raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(PLANNERS)}")


def params_from(cls: Any, kw: Mapping[str, Any], name: str) -> Any:
    """Build a frozen parameter dataclass from keyword arguments, with a clear error.

    Raises:
        ValueError: an unknown key (the message lists the valid ones) or a value the
            dataclass's ``__post_init__`` rejects.
    """
    import dataclasses

    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kw) - valid)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for planner {name!r}; valid: {sorted(valid)}")
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"planner {name!r}: {e}") from e


def parse_planner_args(items: Sequence[str]) -> dict[str, Any]:
    """``["t_learn_s=60", "slo_guard=false"]`` → ``{"t_learn_s": 60.0, "slo_guard": False}``.

    Values: ``true/false`` → bool, ints, floats, ``none`` → None, else the string.

    Raises:
        ValueError: an item without ``=`` or with an empty key.
    """
    return parse_key_values(items, "planner argument")
