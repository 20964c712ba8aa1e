"""Replay core: which request of which agent is due when (sans-IO).

The harness side of the system. Given a canonical trace and an arrival process
it decides, in simulated time, when each agent starts, when each request is
sent (every request in its ``after`` list completed, plus its ``pause_s``),
and when a branch ends. It never sleeps or does I/O: the live replayer
(``replay/live.py``) sleeps until :meth:`ReplayCore.next_time` and sends HTTP
requests; the simulator calls the same core in virtual time.

Arrival processes (paper §6, D.3):

* ``closed``: N agents run concurrently; a finished agent is replaced by the
  next one at its finish time.
* ``open``: agents arrive as a Poisson process (``rate`` per minute, seeded);
  at most ``cap`` run at once, later ones wait for admission. The admission
  wait is reported per agent and counts toward its first request's TTFT.
* ``trace``: agents start at their recorded ``arrival_s`` (relative to the
  earliest one), for traces with a global clock.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal, TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

from evolving_infra.traces.schema import TraceRequest
from shared.values import FACTORY, FrozenStructValue, FrozenValue, Value, set_field


class ReplayError(ValueError):
    """The trace cannot be replayed as given (e.g. an unknown dependency)."""


class Arrival(FrozenValue):
    """How agents enter the system."""

    kind: Literal["closed", "open", "trace"]
    concurrency: int
    """closed: agents running at once."""
    rate_per_min: float
    """open: mean agent arrivals per minute."""
    cap: int
    """open: admission cap (agents running at once); 0 = unlimited."""
    seed: int
    order: Literal["trace", "shuffled"]
    """closed / open: the order in which the input's agents enter — as in the trace, or a
    permutation drawn from ``seed`` (a different sample of sessions for the same
    concurrency, to measure run-to-run spread)."""

    __slots__ = __match_args__ = ("kind", "concurrency", "rate_per_min", "cap", "seed", "order")

    def __init__(
        self, kind: Literal["closed", "open", "trace"] = "closed", concurrency: int = 16, rate_per_min: float = 10.0,
        cap: int = 0, seed: int = 0, order: Literal["trace", "shuffled"] = "trace",
    ) -> None:
        set_field(self, "kind", kind)
        set_field(self, "concurrency", concurrency)
        set_field(self, "rate_per_min", rate_per_min)
        set_field(self, "cap", cap)
        set_field(self, "seed", seed)
        set_field(self, "order", order)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.order not in ("trace", "shuffled"):
            raise ReplayError(f"agent order must be 'trace' or 'shuffled', got {self.order!r}")
        if self.kind == "closed" and self.concurrency < 1:
            raise ReplayError("closed-loop concurrency must be >= 1")
        if self.kind == "open" and self.rate_per_min <= 0:
            raise ReplayError("open-loop arrival rate must be > 0")
        if self.cap < 0:
            raise ReplayError("admission cap must be >= 0")


class SendRequest(FrozenStructValue, frozen=True):
    """Send ``req`` now; ``admission_wait_s`` > 0 only on an agent's first request. Frozen (one per
    request: a :class:`FrozenStructValue`, not a ``FrozenValue`` setting each field through
    ``object.__setattr__``)."""

    req: TraceRequest
    due_at: float
    """Simulated time the request became due (the send should happen then)."""
    new_branch: bool
    admission_wait_s: float = 0.0


class EndBranch(FrozenValue):
    branch: str
    due_at: float

    __slots__ = __match_args__ = ("branch", "due_at")

    def __init__(self, branch: str, due_at: float) -> None:
        set_field(self, "branch", branch)
        set_field(self, "due_at", due_at)


Action = SendRequest | EndBranch


class _Agent(Value):
    agent_id: str
    requests: list[TraceRequest]
    arrived_at: float
    started_at: float | None
    pending: int
    remaining_deps: dict[str, int]
    last_dep_done: dict[str, float]
    dependents: dict[str, list[str]]
    by_id: dict[str, TraceRequest]
    seen_branches: set[str]
    first_sent: bool

    __slots__ = __match_args__ = (
        "agent_id", "requests", "arrived_at", "started_at", "pending", "remaining_deps", "last_dep_done", "dependents",
        "by_id", "seen_branches", "first_sent",
    )

    def __init__(
        self, agent_id: str, requests: list[TraceRequest], arrived_at: float = 0.0, started_at: float | None = None,
        pending: int = 0, remaining_deps: Any = FACTORY, last_dep_done: Any = FACTORY, dependents: Any = FACTORY,
        by_id: Any = FACTORY, seen_branches: Any = FACTORY, first_sent: bool = False,
    ) -> None:
        self.agent_id = agent_id
        self.requests = requests
        self.arrived_at = arrived_at
        self.started_at = started_at
        self.pending = pending
        self.remaining_deps = {} if remaining_deps is FACTORY else remaining_deps
        self.last_dep_done = {} if last_dep_done is FACTORY else last_dep_done
        self.dependents = {} if dependents is FACTORY else dependents
        self.by_id = {} if by_id is FACTORY else by_id
        self.seen_branches = set() if seen_branches is FACTORY else seen_branches
        self.first_sent = first_sent


class ReplayCore:
    """Schedules a trace's requests under an arrival process.

    Args:
        requests: the trace's requests in file order (``after`` refers to earlier ones).
        arrival: the arrival process.
        start: simulated time the replay starts.
        max_agents: replay at most this many agents (file order); None = all.

    Raises:
        ReplayError: if a request depends on a request of another agent or an unknown one.
    """

    def __init__(
        self, requests: Sequence[TraceRequest], arrival: Arrival, *, start: float = 0.0, max_agents: int | None = None
    ) -> None:
        self.arrival = arrival
        self.start = start
        grouped: dict[str, list[TraceRequest]] = {}
        for r in requests:
            g = grouped.get(r.agent)
            if g is None:
                grouped[r.agent] = [r]
            else:
                g.append(r)
        order = list(grouped)
        if max_agents is not None:
            order = order[:max_agents]
        self._agents: dict[str, _Agent] = {}
        for agent_id in order:
            self._agents[agent_id] = self._build_agent(agent_id, grouped[agent_id])
        self._waiting_agents: deque[str] = deque()
        self._arrivals: list[tuple[float, int, str]] = []  # (time, seq, agent)
        self._due: list[tuple[float, int, str, str]] = []  # (due time, seq, agent, request id)
        self._seq = 0
        self.running_agents: set[str] = set()
        self.finished_agents: list[str] = []
        self.admission_wait: dict[str, float] = {}
        self.sent = 0
        self.completed = 0
        self.failed = 0
        self._plan_arrivals()

    # -- construction ------------------------------------------------------ #

    @staticmethod
    def _build_agent(agent_id: str, reqs: list[TraceRequest]) -> _Agent:
        a = _Agent(agent_id=agent_id, requests=reqs)
        by_id, dependents, remaining = a.by_id, a.dependents, a.remaining_deps
        for r in reqs:  # once per request of the input before a run starts: locals, no setdefault lists
            rid = r.id
            if rid in by_id:
                raise ReplayError(f"duplicate request id {rid!r}")
            by_id[rid] = r
            after = r.after
            if not after:
                remaining[rid] = 0
                continue
            for dep in after:
                if dep not in by_id:
                    raise ReplayError(f"request {rid!r} waits for {dep!r}, which is not an earlier request of agent {agent_id!r}")
                d = dependents.get(dep)
                if d is None:
                    dependents[dep] = [rid]
                else:
                    d.append(rid)
            remaining[rid] = len(set(after)) if len(after) > 1 else 1
        a.pending = len(reqs)
        return a

    def _plan_arrivals(self) -> None:
        ids = list(self._agents)
        kind = self.arrival.kind
        if self.arrival.order == "shuffled" and kind != "trace":
            # its own stream: the open loop's inter-arrival draws stay those of the trace order
            perm = np.random.default_rng([self.arrival.seed, 1]).permutation(len(ids))
            ids = [ids[i] for i in perm]
        if kind == "closed":
            self._waiting_agents.extend(ids)
            for _ in range(min(self.arrival.concurrency, len(ids))):
                self._push_arrival(self.start, self._waiting_agents.popleft())
        elif kind == "open":
            rng = np.random.default_rng(self.arrival.seed)
            t = self.start
            for agent_id in ids:
                t += float(rng.exponential(60.0 / self.arrival.rate_per_min))
                self._push_arrival(t, agent_id)
        else:
            firsts = {a: next((r.arrival_s for r in ag.requests if r.arrival_s is not None), None) for a, ag in self._agents.items()}
            known = [v for v in firsts.values() if v is not None]
            if len(known) != len(firsts):
                missing = [a for a, v in firsts.items() if v is None][:3]
                raise ReplayError(f"arrival 'trace' needs arrival_s on every agent's first request (missing for {missing})")
            t0 = min(known) if known else 0.0
            for agent_id, first in zip(firsts, known):  # known: every agent's (checked above), in firsts' order
                self._push_arrival(self.start + float(first) - t0, agent_id)

    def _push_arrival(self, t: float, agent_id: str) -> None:
        self._seq += 1
        heapq.heappush(self._arrivals, (t, self._seq, agent_id))

    # -- queries ----------------------------------------------------------- #

    @property
    def agents_total(self) -> int:
        return len(self._agents)

    @property
    def done(self) -> bool:
        """True when every agent has finished."""
        return len(self.finished_agents) == len(self._agents)

    def due_heaps(self) -> tuple[list[tuple[float, int, str]], list[tuple[float, int, str, str]]]:
        """The two heaps :meth:`next_time` reads, ``(arrivals, due)``, each ordered by its items'
        first field (simulated s): the earliest arrival and the earliest due request. The same
        list objects for the core's life (changed in place), so a caller that reads them instead
        of calling :meth:`next_time` before every event (``ClusterSim.run_to_end``: ~20,000 calls
        of a 600-s run) sees them change; read only."""
        return self._arrivals, self._due

    def next_time(self) -> float | None:
        """Earliest simulated time at which :meth:`poll` will have something to do. O(1)
        (called before every event of a simulation; :meth:`due_heaps` for its inputs)."""
        arrivals, due = self._arrivals, self._due
        if arrivals:
            t = arrivals[0][0]
            return due[0][0] if due and due[0][0] < t else t
        return due[0][0] if due else None

    # -- transitions ------------------------------------------------------- #

    def poll(self, now: float) -> list[Action]:
        """Admit arrived agents and return every action due at or before ``now``."""
        actions: list[Action] = []
        while self._arrivals and self._arrivals[0][0] <= now:
            t, _, agent_id = heapq.heappop(self._arrivals)
            self._admit_or_queue(agent_id, t)
        while self._due and self._due[0][0] <= now:
            due, _, agent_id, rid = heapq.heappop(self._due)
            agent = self._agents[agent_id]
            req = agent.by_id[rid]
            new_branch = req.branch not in agent.seen_branches
            agent.seen_branches.add(req.branch)
            wait = 0.0
            if not agent.first_sent:
                agent.first_sent = True
                wait = self.admission_wait.get(agent_id, 0.0)
            self.sent += 1
            actions.append(SendRequest(req=req, due_at=due, new_branch=new_branch, admission_wait_s=wait))
        return actions

    def _admit_or_queue(self, agent_id: str, t: float) -> None:
        agent = self._agents[agent_id]
        agent.arrived_at = t
        cap = self.arrival.cap if self.arrival.kind == "open" else 0
        if cap and len(self.running_agents) >= cap:
            self._waiting_agents.append(agent_id)
            return
        self._start_agent(agent_id, t)

    def _start_agent(self, agent_id: str, t: float) -> None:
        agent = self._agents[agent_id]
        agent.started_at = t
        self.admission_wait[agent_id] = t - agent.arrived_at
        self.running_agents.add(agent_id)
        for r in agent.requests:
            if not r.after:
                self._schedule(agent_id, r.id, t + r.pause_s)

    def _schedule(self, agent_id: str, rid: str, at: float) -> None:
        self._seq += 1
        heapq.heappush(self._due, (at, self._seq, agent_id, rid))

    def on_complete(self, agent_id: str, rid: str, now: float, *, ok: bool = True) -> list[Action]:
        """Record that request ``rid`` finished (or failed) at ``now``.

        Dependents become due at ``now + pause_s`` once all their dependencies are
        done (a failed request still releases its dependents: the agent goes on).
        Returns the branch ends this completion triggers.

        Raises:
            ReplayError: for an unknown agent or request.
        """
        agent = self._agents.get(agent_id)
        if agent is None or rid not in agent.by_id:
            raise ReplayError(f"completion for unknown request {agent_id}/{rid}")
        self.completed += ok
        self.failed += not ok
        req = agent.by_id[rid]
        actions: list[Action] = []
        if req.ends_branch:
            actions.append(EndBranch(branch=req.branch, due_at=now))
        for dep_id in agent.dependents.get(rid, ()):
            agent.remaining_deps[dep_id] -= 1
            agent.last_dep_done[dep_id] = max(agent.last_dep_done.get(dep_id, now), now)
            if agent.remaining_deps[dep_id] == 0:
                self._schedule(agent_id, dep_id, now + agent.by_id[dep_id].pause_s)
        agent.pending -= 1
        if agent.pending == 0:
            self._finish_agent(agent_id, now)
        return actions

    def _finish_agent(self, agent_id: str, now: float) -> None:
        self.running_agents.discard(agent_id)
        self.finished_agents.append(agent_id)
        if self.arrival.kind == "closed":
            if self._waiting_agents:
                self._push_arrival(now, self._waiting_agents.popleft())
        elif self._waiting_agents:
            self._start_agent(self._waiting_agents.popleft(), now)
