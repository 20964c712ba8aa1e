"""Scheduled closed loops: a workload whose composition shifts over time (paper §6.3).

The shifting-composition run of the paper serves, after a warm-up, 288
Putnam agents for an hour, then 144 Putnam + 72 OSWorld agents, then 144
OSWorld agents, each period a closed loop that replaces every finished agent
with a new one. ``trace generate shift`` writes the agents of every period in
pools (agent id prefixes) and the schedule in its header
(``meta.periods``: ``[{name, start_s, end_s, concurrency: {workload: n},
agents: {workload: {prefix, count}}}]``).

:class:`ScheduledReplay` replays such a trace: one
:class:`~evolving_infra.replay.core.ReplayCore` closed loop per pool
(:class:`Window`), started at the window's start with the pool's concurrency;
a finished agent is replaced only before the window's end, and agents running
at the end finish their sessions (nobody cuts an agent off). It offers the part
of the ``ReplayCore`` interface the simulator calls (``next_time``, ``poll``,
``on_complete``, ``done``, ``running_agents``, ``finished_agents``,
``agents_total``, ``arrival``), so ``ClusterSim`` drives it unchanged.

Deterministic: pools are polled in schedule order; each pool's closed loop
is the ``ReplayCore`` one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from evolving_infra.replay.core import Action, Arrival, ReplayCore, ReplayError
from evolving_infra.traces.schema import TraceRequest
from shared.values import FrozenValue, set_field


class Window(FrozenValue):
    """One closed-loop pool: agents whose id starts with ``prefix`` run ``concurrency`` at a
    time from ``start_s``; none is started at or after ``end_s``."""

    prefix: str
    start_s: float
    end_s: float
    concurrency: int

    __slots__ = __match_args__ = ("prefix", "start_s", "end_s", "concurrency")

    def __init__(self, prefix: str, start_s: float, end_s: float, concurrency: int) -> None:
        set_field(self, "prefix", prefix)
        set_field(self, "start_s", start_s)
        set_field(self, "end_s", end_s)
        set_field(self, "concurrency", concurrency)


class ScheduleArrival(FrozenValue):
    """The ``arrival`` a :class:`ScheduledReplay` reports (not ``closed``: the closed-loop
    exhaustion check of the simulator does not apply to a schedule)."""

    kind: str
    concurrency: int

    __slots__ = __match_args__ = ("kind", "concurrency")

    def __init__(self, kind: str = "schedule", concurrency: int = 0) -> None:
        set_field(self, "kind", kind)
        set_field(self, "concurrency", concurrency)


def windows_from_meta(meta: Mapping[str, Any], share: float = 1.0) -> tuple[Window, ...]:
    """The pools of a trace header's ``meta.periods`` (``trace generate shift``), with every
    concurrency scaled by ``share`` (a partition's share of the agents; at least 1).

    Raises:
        ValueError: ``meta`` has no usable ``periods`` table.
    """
    rows = meta.get("periods")
    if not isinstance(rows, list) or not rows:
        raise ValueError("the trace header has no 'periods' schedule (generate one with 'trace generate shift')")
    out: list[Window] = []
    for row in rows:
        try:
            start, end = float(row["start_s"]), float(row["end_s"])
            conc: Mapping[str, Any] = row["concurrency"]
            pools: Mapping[str, Any] = row["agents"]
            for kind, c in conc.items():
                out.append(Window(str(pools[kind]["prefix"]), start, end, max(1, round(int(c) * share))))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed period {row!r} in the trace header: {e}") from e
    return tuple(out)


def period_table(meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``[{name, start_s, end_s}]`` of a header's periods (the report's ``meta.periods``)."""
    return [{"name": str(r["name"]), "start_s": float(r["start_s"]), "end_s": float(r["end_s"])} for r in meta.get("periods") or []]


class _WindowLoop(ReplayCore):
    """A ``ReplayCore`` closed loop that stops replacing agents at ``end_s``."""

    def __init__(self, requests: Sequence[TraceRequest], window: Window, seed: int) -> None:
        self.end_s = window.end_s
        self.exhausted_at: float | None = None
        """First time, before ``end_s``, that a finished agent could not be replaced (the
        pool ran dry: the window's concurrency falls from then on)."""
        super().__init__(requests, Arrival(kind="closed", concurrency=window.concurrency, seed=seed), start=window.start_s)

    def _finish_agent(self, agent_id: str, now: float) -> None:
        if now >= self.end_s:
            self._waiting_agents.clear()  # the window is over: no replacement
        elif not self._waiting_agents and self.exhausted_at is None:
            self.exhausted_at = now
        super()._finish_agent(agent_id, now)

    @property
    def done(self) -> bool:
        return not self.running_agents and not self._arrivals and not self._due and (
            not self._waiting_agents or len(self.finished_agents) == len(self._agents)
        )


class ScheduledReplay:
    """Closed loops per pool on a schedule (module docstring).

    Args:
        requests: the trace's requests (every agent's id starts with one window's prefix;
            agents of no window are not replayed).
        windows: the pools, e.g. :func:`windows_from_meta`.
        seed: seed of the closed loops (they draw nothing today; kept for ``Arrival``).

    Raises:
        ReplayError: a window with no agents, or a malformed dependency (``ReplayCore``).
    """

    def __init__(self, requests: Sequence[TraceRequest], windows: Sequence[Window], seed: int = 0) -> None:
        if not windows:
            raise ReplayError("a schedule needs at least one window")
        prefixes = [w.prefix for w in windows]
        grouped: dict[str, list[TraceRequest]] = {p: [] for p in prefixes}
        by_len = sorted(set(prefixes), key=len, reverse=True)  # longest prefix wins
        cache: dict[str, str | None] = {}
        for r in requests:
            p = cache.get(r.agent, "")
            if p == "":
                p = next((q for q in by_len if r.agent.startswith(q)), None)
                cache[r.agent] = p
            if p is not None:
                grouped[p].append(r)
        self.windows = tuple(windows)
        self.loops: list[_WindowLoop] = []
        self._loop_of: dict[str, _WindowLoop] = {}
        for i, w in enumerate(windows):
            if not grouped[w.prefix]:
                raise ReplayError(f"schedule window {w.prefix!r} has no agents in the trace")
            loop = _WindowLoop(grouped[w.prefix], w, seed + i)
            self.loops.append(loop)
            for a in loop._agents:
                self._loop_of[a] = loop
        self.arrival = ScheduleArrival(concurrency=sum(w.concurrency for w in windows))

    @property
    def agents_total(self) -> int:
        return sum(lp.agents_total for lp in self.loops)

    @property
    def running_agents(self) -> set[str]:
        return set().union(*(lp.running_agents for lp in self.loops))

    @property
    def finished_agents(self) -> list[str]:
        return [a for lp in self.loops for a in lp.finished_agents]

    @property
    def done(self) -> bool:
        return all(lp.done for lp in self.loops)

    def next_time(self) -> float | None:
        times = [t for lp in self.loops if (t := lp.next_time()) is not None]
        return min(times) if times else None

    def poll(self, now: float) -> list[Action]:
        out: list[Action] = []
        for lp in self.loops:
            out.extend(lp.poll(now))
        return out

    def exhausted(self) -> list[dict[str, Any]]:
        """``[{prefix, start_s, end_s, concurrency, agents, exhausted_at_s}]`` of the windows
        whose pool ran dry before their end (measurements after ``exhausted_at_s`` there
        reflect the pool's size, not the cluster: generate a larger pool)."""
        return [
            {
                "prefix": w.prefix,
                "start_s": w.start_s,
                "end_s": w.end_s,
                "concurrency": w.concurrency,
                "agents": lp.agents_total,
                "exhausted_at_s": lp.exhausted_at,
            }
            for w, lp in zip(self.windows, self.loops)
            if lp.exhausted_at is not None
        ]

    def on_complete(self, agent_id: str, rid: str, now: float, *, ok: bool = True) -> list[Action]:
        lp = self._loop_of.get(agent_id)
        if lp is None:
            raise ReplayError(f"completion for unknown agent {agent_id!r}")
        return lp.on_complete(agent_id, rid, now, ok=ok)
