"""The PD split of a run over time and its phase switches (paper §6.2, Appendix C.1, C.2).

A :class:`RunTimeline` is what a producer hands to
:func:`evolving_infra.report.write.build_report` next to the request records:

* the live stack builds it from ``split.applied`` messages with a
  :class:`TimelineRecorder` (initial phases from the launch split, then one
  ``SplitApplied`` per node and epoch, as workers publish them);
* the discrete-event simulator builds the same Structs directly, or feeds its
  own ``SplitApplied`` values to a recorder.

All times are simulated seconds on the cluster clock, the clock of
``RequestRecord.sent_at``.

Switch time follows Appendix C.1: "from the planner decision to the point at
which the node serves requests of its new phase, including the time to drain
the requests running on the node" — ``SplitApplied.switch_s``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from shared.messages import Phase, SplitApplied
from shared.split import split_name


class SplitPoint(msgspec.Struct, frozen=True, kw_only=True):
    """The split in force from time ``t`` until the next point."""

    t: float
    """Simulated seconds at which this split took effect."""
    split: str
    """``"xPyD"`` (``shared.split.split_name``), ``"collocated"``, or ``"xPyD+zB"`` when some nodes serve both."""
    epoch: int = 0
    """Planner epoch of the split command that produced it (0 = the launch split)."""
    prefill: int = 0
    """Nodes serving prefill (phase ``prefill`` or ``both``)."""
    decode: int = 0
    """Nodes serving decode only (phase ``decode``)."""
    switching: int = 0
    """Nodes that are draining towards another phase at ``t`` (counted under their old phase)."""
    prefill_nodes: list[str] = []
    """Names of the nodes counted in ``prefill`` (lets the report count idle prefill nodes
    in the prefill queue imbalance); may be empty when the producer does not know them."""


class SwitchRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One node's completed phase switch (Appendix C.1)."""

    node: str
    from_phase: Phase
    to_phase: Phase
    decided_at: float
    """Simulated seconds of the planner decision (``SplitCommand.decided_at``)."""
    applied_at: float
    """Simulated seconds at which the node served its new phase."""
    switch_s: float
    """decision → serving the new phase, drain included (seconds)."""
    epoch: int = 0


class RunTimeline(msgspec.Struct, kw_only=True):
    """PD split over time and the phase switches of one run."""

    split_timeline: list[SplitPoint] = []
    """Split points in time order; the first is the launch split."""
    switches: list[SwitchRecord] = []
    """Completed node phase switches in the order they were applied."""

    def split_decisions(self) -> int:
        """Planner split decisions that switched at least one node: the distinct epochs of :attr:`switches`
        (a decision from 6P3D to 3P6D is 3 node phase switches and, on the way, 3 split points, but one decision)."""
        return len({s.epoch for s in self.switches})

    def split_at(self, t: float) -> SplitPoint | None:
        """The split point in force at time ``t`` (None before the first point)."""
        cur: SplitPoint | None = None
        for p in self.split_timeline:
            if p.t <= t:
                cur = p
            else:
                break
        return cur

    def prefill_nodes_between(self, a: float, b: float) -> set[str]:
        """Nodes named as prefill in any split in force during ``[a, b)``."""
        out: set[str] = set()
        cur = self.split_at(a)
        if cur is not None:
            out.update(cur.prefill_nodes)
        for p in self.split_timeline:
            if a < p.t < b:
                out.update(p.prefill_nodes)
        return out


class TimelineRecorder:
    """Builds a :class:`RunTimeline` from ``split.applied`` messages (sans-IO).

    Workers publish ``SplitApplied(status="serving")`` for every node on every
    new epoch, also when the node keeps its phase; only a change of phase is a
    switch. ``status="draining"`` marks a node as switching until it serves.

    Usage::

        rec = TimelineRecorder(split_phases("2P2D", nodes), t0=clock.now())
        bus.subscribe(SPLIT_APPLIED, lambda msg, _s: rec.on_applied(msg))
        ...
        report = build_report(records, meta=meta, timeline=rec.timeline())

    Time order: messages are folded as they arrive, but nodes stamp ``applied_at`` on their own
    clocks and their messages cross the bus in any order, so a message can arrive after one
    stamped later (live: a point at 1140.6957 s before one at 1140.6344 s). When the points so
    folded are not in time order, :meth:`timeline` folds every message again in order of its
    time (a stable sort: equal times keep their arrival order), so that each point is the split
    of the messages stamped up to it. A run whose messages came in time order (the simulator's)
    gets the points as folded.

    Operations: ``on_applied`` O(nodes) (recomputes the split name); ``timeline`` O(points), or
    O(M·nodes + M log M) for M messages when they came out of time order.
    """

    def __init__(self, initial_phases: Mapping[str, Phase], t0: float = 0.0, epoch: int = 0):
        """``initial_phases``: node → phase at launch; ``t0``: launch time (simulated seconds)."""
        self._init = (dict(initial_phases), t0, epoch)
        self._msgs: list[SplitApplied] = []
        self._ordered = True
        """Whether every point was emitted at a time ≥ the previous point's."""
        self._phases: dict[str, Phase] = dict(initial_phases)
        self._draining: set[str] = set()
        self._points: list[SplitPoint] = []
        self._switches: list[SwitchRecord] = []
        self._epoch = epoch
        if self._phases:
            self._emit(t0)

    @staticmethod
    def _time_of(msg: SplitApplied) -> float:
        """The time a message's point takes (simulated seconds): ``applied_at``, or the decision
        for a ``draining`` message that has none."""
        return (msg.applied_at or msg.decided_at) if msg.status == "draining" else msg.applied_at

    def on_applied(self, msg: SplitApplied) -> None:
        """Fold one ``SplitApplied`` into the timeline. Out-of-order epochs are applied as they come."""
        self._msgs.append(msg)
        self._epoch = max(self._epoch, msg.epoch)
        old = self._phases.get(msg.node)
        if msg.status == "draining":
            if msg.node not in self._draining and old != msg.phase:
                self._draining.add(msg.node)
                self._emit(self._time_of(msg))
            return
        was_draining = msg.node in self._draining
        self._draining.discard(msg.node)
        self._phases[msg.node] = msg.phase
        if old is not None and old != msg.phase:
            switch_s = msg.switch_s if msg.switch_s > 0 else max(0.0, msg.applied_at - msg.decided_at)
            self._switches.append(
                SwitchRecord(
                    node=msg.node,
                    from_phase=old,
                    to_phase=msg.phase,
                    decided_at=msg.decided_at,
                    applied_at=msg.applied_at,
                    switch_s=switch_s,
                    epoch=msg.epoch,
                )
            )
        if old != msg.phase or was_draining:
            self._emit(msg.applied_at)

    def phases(self) -> dict[str, Phase]:
        """Node → the phase it serves now, as the ``split.applied`` messages folded so far say (a node switching
        keeps its old phase until it serves the new one); the launch's phases before any message."""
        return dict(self._phases)

    def feed(self, msgs: Iterable[SplitApplied]) -> None:
        """``on_applied`` for each message in order."""
        for m in msgs:
            self.on_applied(m)

    def timeline(self) -> RunTimeline:
        """A snapshot of the timeline so far, its points in time order (see the class docstring)."""
        if not self._ordered:
            phases, t0, epoch = self._init
            again = TimelineRecorder(phases, t0, epoch)
            again.feed(sorted(self._msgs, key=self._time_of))
            return RunTimeline(split_timeline=list(again._points), switches=list(again._switches))
        return RunTimeline(split_timeline=list(self._points), switches=list(self._switches))

    def _emit(self, t: float) -> None:
        prefill = sorted(n for n, p in self._phases.items() if p in ("prefill", "both"))
        point = SplitPoint(
            t=t,
            split=split_name(self._phases),
            epoch=self._epoch,
            prefill=len(prefill),
            decode=sum(p == "decode" for p in self._phases.values()),
            switching=len(self._draining),
            prefill_nodes=prefill,
        )
        last = self._points[-1] if self._points else None
        if last is not None and (last.split, last.switching, last.prefill_nodes) == (
            point.split,
            point.switching,
            point.prefill_nodes,
        ):
            return
        if last is not None and last.t == t:
            # several nodes applied at the same instant: keep only the result
            self._points.pop()
            prev = self._points[-1] if self._points else None
            if prev is not None and (prev.split, prev.switching, prev.prefill_nodes) == (
                point.split,
                point.switching,
                point.prefill_nodes,
            ):
                return
        if self._points and t < self._points[-1].t:
            self._ordered = False
        self._points.append(point)


def timeline_from_builtins(obj: object) -> RunTimeline | None:
    """Decode the ``timeline`` entry of a ``report.json`` (None when absent).

    Raises:
        ValueError: if the entry does not have the :class:`RunTimeline` shape.
    """
    if obj is None:
        return None
    try:
        return msgspec.convert(obj, RunTimeline)
    except msgspec.ValidationError as e:
        raise ValueError(f"report.json 'timeline': {e}") from e
