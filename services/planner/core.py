"""Planner core: the cluster's PD split, its epochs, and the planner policy that changes it.

Contains zero I/O: no asyncio, no clock, no network (STYLE §2.1). The shell
(``service.py``) decodes messages, calls these methods with ``now`` (simulated
s), and publishes what they return or what the outboxes hold:

* ``add_records`` / ``on_node_state`` / ``on_token_chunk`` / ``on_split_applied``
  feed the policy (``policy.py``: ``static``, ``evolving``, ``dynamo``, ``arrow``);
* ``tick(now)`` at ``next_tick()`` → a new :class:`SplitCommand` (new epoch) when
  the policy changes the phases;
* ``set_split`` is the operator's override (``split.set``);
* ``take_decisions()`` → every :class:`PlannerDecision` (``planner.decisions``);
* ``take_models()`` → :class:`PlannerModels` when they changed (``planner.models``).

Per-request completions (w̄ of paper §5.2) come from the ``req.<rid>.out``
token streams the workers already publish (:class:`RequestTracker`): the first
chunk carries the prompt and cached tokens and the prefill node, the last one
the output count and the decode node. No new subject is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import msgspec

from shared.messages import (
    IterationRecord,
    IterationRecords,
    NodeState,
    Phase,
    PlannerDecision,
    PlannerModels,
    SplitApplied,
    SplitCommand,
    TokenChunk,
)
from shared.split import split_name, split_phases
from shared.subjects import check_token
from services.planner.online import OnlineModels
from services.planner.policy import PlannerPolicy, PolicyBase, RequestDone, StaticPlanner


class RequestTracker:
    """Turns token streams into :class:`RequestDone` records (sans-IO).

    Args:
        max_inflight: requests tracked at once; beyond it the oldest is dropped
            (a stream whose end was lost must not grow memory forever).
    """

    def __init__(self, max_inflight: int = 200_000) -> None:
        self.max_inflight = max_inflight
        self._open: OrderedDict[str, tuple[str, int, int, float, float]] = OrderedDict()
        """rid → (prefill node, prompt tokens, cached tokens, first-token time, queue_s)."""
        self.completed = 0
        self.dropped = 0
        """Streams forgotten (overflow) or ended by abort/error."""

    def on_chunk(self, c: TokenChunk, now: float) -> RequestDone | None:
        """Consume one chunk; returns the request when ``c`` finishes it normally. O(1)."""
        at = c.ts or now
        if c.index == 0 and c.prompt_tokens > 0 and c.rid not in self._open:
            self._open[c.rid] = (c.node, c.prompt_tokens, c.cached_tokens, at, float(c.queue_s or 0.0))
            if len(self._open) > self.max_inflight:
                self._open.popitem(last=False)
                self.dropped += 1
        if not c.finished:
            return None
        entry = self._open.pop(c.rid, None)
        if entry is None:
            return None
        if c.error or c.finish_reason in ("abort", "error"):
            self.dropped += 1
            return None
        node, prompt, cached, first_at, queue_s = entry
        arrived = first_at - queue_s
        self.completed += 1
        return RequestDone(
            rid=c.rid,
            prefill_node=node,
            decode_node=c.node,
            prompt_tokens=prompt,
            cached_tokens=cached,
            output_tokens=c.index + len(c.token_ids),
            arrived_at=arrived,
            ttft_s=queue_s,
            e2e_s=max(0.0, at - arrived),
        )

    def __len__(self) -> int:
        return len(self._open)


class PlannerCore:
    """The split with its epoch, the policy, the records history and the switch bookkeeping.

    Args:
        nodes: node ids in cluster order (the order ``xPyD`` specs are applied in).
        split: initial split spec, ``collocated`` or ``xPyD``.
        history: iteration records kept per node (oldest dropped first).
        policy: the planner policy (default: ``static``).
        busy_timeout_s: a node that has not confirmed a phase change (``split.applied``
            status ``serving``) within this long stops counting as busy.
        online: per-node models refitted from the iteration records for the router
            (``online.OnlineModels``), used when the policy publishes no models of its own
            (``static``, ``dynamo``, ``arrow``): :meth:`take_models` returns its refits.

    Raises:
        ValueError / SplitError: on an invalid node id or a split that does not fit the nodes.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        split: str = "collocated",
        *,
        history: int = 100_000,
        policy: PlannerPolicy | None = None,
        busy_timeout_s: float = 900.0,
        online: OnlineModels | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("the planner needs at least one node")
        self.nodes = [check_token(n, "node") for n in nodes]
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"duplicate node ids in {list(nodes)}")
        self.history = history
        self.records: dict[str, deque[IterationRecord]] = {n: deque(maxlen=history) for n in self.nodes}
        self.records_total = 0
        self.records_unknown_node = 0
        self.states_unknown_node = 0
        self.command = SplitCommand(epoch=1, phases=split_phases(split, self.nodes), reason="initial", decided_at=0.0)
        self.policy: PlannerPolicy = policy or StaticPlanner(self.nodes, _no_profile())
        self.tracker = RequestTracker()
        self.busy_timeout_s = busy_timeout_s
        self.pending: dict[str, tuple[int, float]] = {}
        """node → (epoch that changed its phase, when) until it reports ``serving`` at that epoch."""
        self.draining: set[str] = set()
        self._decisions: list[PlannerDecision] = []
        self._models_seen = -1
        self.online = online if getattr(self.policy, "models_version", None) is None else None
        self._online_last: PlannerModels | None = None
        self.ticks = 0
        self.switches = 0
        self.foreign_commands = 0
        """Split commands seen on the bus that this planner did not issue."""

    @property
    def split(self) -> str:
        """Current split as ``xPyD`` or ``collocated``."""
        return split_name(self.command.phases)

    # -- inputs --------------------------------------------------------------- #

    def add_records(self, msg: IterationRecords, now: float = 0.0) -> int:
        """Store a worker's iteration records and feed them to the policy; returns how many
        were kept (0 for an unknown node)."""
        store = self.records.get(msg.node)
        if store is None:
            self.records_unknown_node += 1
            return 0
        store.extend(msg.records)
        self.records_total += len(msg.records)
        self.policy.on_iterations(msg.node, msg.records, now)
        if self.online is not None:
            self.online.add(msg.node, msg.records)
        return len(msg.records)

    def on_node_state(self, state: NodeState, now: float) -> bool:
        """Feed a node state to the policy; False (counted) for an unknown node."""
        if state.node not in self.records:
            self.states_unknown_node += 1
            return False
        if not state.accepting:
            self.draining.add(state.node)
        else:
            self.draining.discard(state.node)
        self.policy.on_node_state(state, now)
        return True

    def on_token_chunk(self, chunk: TokenChunk, now: float) -> RequestDone | None:
        """Feed a token chunk; a finished request goes to the policy and is returned."""
        done = self.tracker.on_chunk(chunk, now)
        if done is not None:
            self.policy.on_request_done(done, now)
        return done

    def on_split_applied(self, msg: SplitApplied, now: float) -> None:
        """Switch progress: ``serving`` at (or after) the epoch that changed the node ends its busy period."""
        if msg.node not in self.records:
            return
        if msg.status == "draining":
            self.draining.add(msg.node)
            return
        self.draining.discard(msg.node)
        pend = self.pending.get(msg.node)
        if pend is not None and msg.epoch >= pend[0]:
            del self.pending[msg.node]
            self.policy.on_switch_done(msg.node, msg.phase, now)

    def busy(self, now: float) -> set[str]:
        """Nodes draining or still switching to a phase a command gave them (timed out after ``busy_timeout_s``)."""
        for n, (_, since) in list(self.pending.items()):
            if now - since > self.busy_timeout_s:
                del self.pending[n]
        return set(self.pending) | self.draining

    # -- decisions ------------------------------------------------------------ #

    def next_tick(self) -> float | None:
        """When the policy wants :meth:`tick` (simulated s), or None."""
        return self.policy.next_tick()

    def tick(self, now: float) -> SplitCommand | None:
        """Run the policy; a new command (epoch + 1) when it changes the phases."""
        self.ticks += 1
        d = self.policy.tick(now, dict(self.command.phases), frozenset(self.busy(now)))
        cmd = None
        if d is not None and dict(d.phases) != dict(self.command.phases):
            if set(d.phases) != set(self.nodes):
                raise ValueError(f"policy {self.policy.name} returned phases for {sorted(d.phases)}, nodes are {self.nodes}")
            cmd = self._adopt(d.phases, now, d.reason)
        self._collect_decisions()
        return cmd

    def set_split(self, spec: str, now: float, reason: str = "operator") -> SplitCommand:
        """Adopt a new split spec under a new epoch and return its command (the operator's
        ``split set``); the decision is recorded like any other.

        Raises:
            SplitError: if the spec does not fit the node list.
        """
        before = dict(self.command.phases)
        phases: dict[str, Phase] = split_phases(spec, self.nodes)
        cmd = self._adopt(phases, now, reason)
        self._decisions.append(
            PlannerDecision(
                seq=0,
                ts=now,
                policy="operator",
                action="switch" if phases != before else "no_switch",
                split_before=split_name(before),
                split_after=split_name(phases),
                epoch=cmd.epoch,
                reason=reason,
            )
        )
        return cmd

    def on_foreign_command(self, cmd: SplitCommand, now: float, max_step: int) -> SplitCommand | None:
        """A split command on the bus that is not this planner's current one.

        The planner alone issues epochs: a command it did not issue whose epoch is at
        least its own (nodes and router adopted it, or would) is answered by re-issuing
        the planner's phases under ``cmd.epoch + 1``, so the forged split lasts one
        round trip and every later command (policy or operator ``split set``) is newer
        than it. An older foreign command is stale everywhere and only counted; one
        more than ``max_step`` above the planner's epoch was refused by every receiver
        (``shared.validate.epoch_step_ok``) and is only counted too.

        Returns:
            The re-issued command to publish, or None.
        """
        if cmd.epoch == self.command.epoch and dict(cmd.phases) == dict(self.command.phases):
            return None  # our own, echoed back
        self.foreign_commands += 1
        if cmd.epoch < self.command.epoch or cmd.epoch - self.command.epoch > max_step:
            return None
        old = cmd.phases
        self.command = SplitCommand(
            epoch=cmd.epoch + 1,
            phases=dict(self.command.phases),
            reason=f"planner re-issued its split over a foreign command (epoch {cmd.epoch})",
            decided_at=now,
        )
        for n, ph in self.command.phases.items():
            if old.get(n) != ph:
                self.pending[n] = (self.command.epoch, now)
        return self.command

    def _adopt(self, phases: dict[str, Phase], now: float, reason: str) -> SplitCommand:
        old = self.command.phases
        self.command = SplitCommand(epoch=self.command.epoch + 1, phases=dict(phases), reason=reason, decided_at=now)
        for n, ph in phases.items():
            if old.get(n) != ph:
                self.pending[n] = (self.command.epoch, now)
        self.switches += 1
        return self.command

    def _collect_decisions(self) -> None:
        take = getattr(self.policy, "take_decisions", None)
        if take is None:
            return
        for ev in take():
            self._decisions.append(msgspec.structs.replace(ev, epoch=self.command.epoch))

    def take_decisions(self) -> list[PlannerDecision]:
        """Drain every decision since the last call (policy evaluations and operator commands)."""
        out, self._decisions = self._decisions, []
        return out

    def take_models(self, now: float | None = None) -> PlannerModels | None:
        """The policy's models if they changed since the last call (evolving), else — for a
        policy without models and ``now`` given — the online refit when one is due, else None."""
        version = getattr(self.policy, "models_version", None)
        if version is None and self.online is not None and now is not None:
            msg = self.online.refit(now)
            if msg is not None:
                self._online_last = msg
            return msg
        if version is None or version == self._models_seen:
            return None
        self._models_seen = version
        return self.policy.models()  # type: ignore[attr-defined]

    def current_models(self) -> PlannerModels | None:
        """The policy's models now (for re-announcement), or None when it has none."""
        if self._online_last is not None:
            return self._online_last
        if not isinstance(self.policy, PolicyBase):
            return None
        m = self.policy.models()
        return m if isinstance(m, PlannerModels) else None


def _no_profile():  # pragma: no cover - trivial
    """A static planner needs no profile; give it the tiny one so the type is complete."""
    from shared.profile import load_profile

    return load_profile("tiny")
