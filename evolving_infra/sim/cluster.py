"""ClusterSim: one cluster (or partition) in virtual time, driving the production cores.

Contains zero I/O: no clock, no sleeping, no NATS, no logging. The same
objects the live services hold are called directly (DESIGN §2):

* ``services.worker.scheduler.EngineScheduler`` — one per node;
* ``services.kvdirectory.core.KvDirectory`` — KV events, lookups, branch counts;
* ``services.router.core.RouterCore`` with a ``services.router.policy`` policy;
* a ``services.planner.policy`` planner (``evolving_infra.sim.planners``);
* ``evolving_infra.replay.core.ReplayCore`` — the harness: arrivals, pauses, dependencies.

Event model (a heap of ``(time, seq, kind, a, b)``; ``seq`` breaks ties in
insertion order, so runs are deterministic):

* replay due times (``ReplayCore.next_time``), taken before heap events at the same time;
* ``PLAN_END`` of a node's plan (lazily deleted: a plan cut by ``truncate`` gets a new
  token, the old event is skipped);
* ``WAKE`` of an idle node at its ``next_deadline`` (decode KV arriving);
* ``TICK`` of the planner (``next_tick``), ``RELAUNCH_END``, ``FORCED`` switches,
  ``CALL`` (a message delivered after ``msg_latency_s``), ``STOP`` (``duration_s``).

New work reaching a node with a plan in flight cuts a folded decode plan at
the next iteration boundary (``EngineScheduler.truncate``); an idle node is
scheduled at once with a far horizon, so identical decode iterations fold up
to the next completion or KV arrival (the engine's skip-ahead).

Messages are instantaneous unless ``msg_latency_s`` > 0 (then work dispatch,
PD hand-off and client delivery are delayed by it; decode reservations and
gate openings stay instantaneous). The router sees every node's state as it
is at the decision, or at most ``state_staleness_s`` old.
"""

from __future__ import annotations

import heapq
import math

import msgspec
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from evolving_infra.replay.core import Arrival, EndBranch, ReplayCore, SendRequest
from evolving_infra.report.records import RequestRecord
from evolving_infra.report.timeline import RunTimeline, TimelineRecorder
from evolving_infra.sim.config import ForcedSwitch, Resolved
from evolving_infra.sim.planners import make_planner, make_routing, request_done_type
from evolving_infra.traces.schema import TraceRequest
from services.kvdirectory.core import KvDirectory
from services.router.core import NoRoute, RouterCore
from services.router.policy import RouteRequest
from services.worker.plan import HandOff, TokensOut, WorkRejected
from services.worker.scheduler import EngineScheduler
from shared.messages import DecodeWork, KvEventBatch, Phase, PrefillWork, SplitApplied, SplitCommand
from shared.split import split_phases

PLAN_END, WAKE, TICK, RELAUNCH_END, FORCED, CALL, STOP = range(7)

QUEUE_READING_ROUTERS = frozenset({"ttft"})
"""Routing policies that read ``NodeState.queue`` (Eq. 7's sum over queued work); the others
get node states without the queue list (O(1) per node instead of O(queue))."""

LOCAL_PREFIX_ROUTERS = frozenset({"cache-aware", "dynamo-kv", "sticky", "round-robin"})
"""Routing policies that read only the prefill candidates' own prefixes from the KV directory
(no shared pool: ``longest_any`` and fetch sources unused)."""
HORIZON_S = 1.0e6
"""Horizon given to ``schedule``: far enough that only completions and KV arrivals bound a fold;
new work cuts the fold with ``truncate`` instead."""

SERVING, DRAINING, RELAUNCHING = "serving", "draining", "relaunching"


class SimError(RuntimeError):
    """The simulation reached a state the cores should never produce (a bug, not bad input)."""


@dataclass(slots=True, eq=False)
class _Node:
    name: str
    sched: EngineScheduler
    phase: Phase
    """Phase the node serves (its engine's phase)."""
    status: str = SERVING
    target: Phase | None = None
    """Phase the node is switching to (draining / relaunching)."""
    decided_at: float = 0.0
    epoch: int = 0
    token: int = 0
    """Current PLAN_END token (lazy deletion)."""
    plan_end: float = -1.0
    wake_at: float = -1.0
    kv_seq: int = 0
    bound: int = 0
    """Requests dispatched/bound to this node that have not left it (drain condition)."""
    state_at: float = -math.inf
    dirty: bool = True
    out_since: float = 0.0


@dataclass(slots=True, eq=False)
class _Flight:
    req: TraceRequest
    rr: RouteRequest
    sent_at: float
    wait: float
    ideal: int
    kind: str
    prefill: str | None = None
    decode: str | None = None
    first_at: float | None = None
    queue_s: float | None = None
    cached: int = 0
    prompt: int = 0
    reroutes: int = 0
    work: PrefillWork | None = None
    decode_later: bool = False
    """Routed PD with the decode node to be bound at prefill start."""


@dataclass(slots=True)
class SimStats:
    """Counters of one simulated cluster (land in ``report.json`` as ``sim_*``)."""

    events: int = 0
    plans: int = 0
    iterations: int = 0
    truncations: int = 0
    routed: int = 0
    reroutes: int = 0
    parked: int = 0
    rejected: int = 0
    handoffs: int = 0
    kv_batches: int = 0
    planner_ticks: int = 0
    planner_decisions: list[dict[str, Any]] = field(default_factory=list)
    out_of_service: list[tuple[str, float, float]] = field(default_factory=list)
    """(node, start, end) of every relaunch downtime."""
    unfinished: int = 0
    end_time: float = 0.0
    closed_loop_exhausted_at: float | None = None
    """Closed loop: first time a finished agent could not be replaced (the input ran out of
    agents; concurrency falls from then on)."""
    ttft_pred_abs_err: list[float] = field(default_factory=list)
    """|predicted − measured| TTFT (s) of every first token whose routing policy predicted one."""


@dataclass(slots=True)
class ClusterResult:
    """What one cluster (partition) produced."""

    records: list[RequestRecord]
    timeline: RunTimeline
    stats: SimStats
    nodes: list[str]
    initial_phases: dict[str, Phase]


class ClusterSim:
    """A cluster of ``len(node_names)`` nodes serving ``requests`` under ``arrival``.

    Args:
        run: the resolved run (profile, policy set, split, options).
        requests: trace requests (already at the profile's block size), file order.
        node_names: node ids of this cluster (partition), in split order.
        arrival: the arrival process of this cluster's agents.
        forced: forced switches for these nodes.
        blocks_of: the block ids of a request when its ``blocks`` are not stored in it
            (``evolving_infra.sim.workload.TiledWorkload`` stubs); None = ``req.blocks``.

    Raises:
        SimConfigError / ComponentMissing: when a component cannot be built.
    """

    def __init__(
        self,
        run: Resolved,
        requests: Sequence[TraceRequest],
        node_names: Sequence[str],
        arrival: Arrival,
        *,
        forced: Sequence[ForcedSwitch] = (),
        blocks_of: Callable[[TraceRequest], Sequence[int]] | None = None,
    ) -> None:
        cfg = run.cfg
        self._blocks_of = blocks_of
        self._state_queue = run.policy.routing not in LOCAL_PREFIX_ROUTERS
        ps = run.policy
        self.run = run
        self.profile = run.profile
        self.bs = run.profile.block_size
        self.binding = ps.decode_binding
        self.switch_mode = ps.switch_mode
        self.relaunch_s = cfg.relaunch_s
        self.latency = cfg.msg_latency_s
        self.staleness = cfg.state_staleness_s
        self.duration = cfg.duration_s
        self.track_branches = ps.eviction == "branch-count"
        # Decode-phase nodes' KV is invisible to every decision when the router reads only the
        # candidates' own prefixes, no branch counts are kept, and a node that leaves decode
        # empties its caches (or never switches): their KV events are then not sent at all
        # (tested: identical reports). With a shared pool (ttft), branch counts or in-place
        # switches they are sent, as live.
        self.skip_decode_kv = (
            cfg.decode_kv_events == "auto"
            and ps.routing in LOCAL_PREFIX_ROUTERS
            and not self.track_branches
            and ps.switch_mode in ("none", "relaunch", "strand")
        )
        names = list(node_names)
        self.phases: dict[str, Phase] = split_phases(run.split, names)
        self.initial_phases = dict(self.phases)
        self.nodes: dict[str, _Node] = {
            n: _Node(n, EngineScheduler(n, self.profile, self.phases[n], host_eviction=ps.eviction), self.phases[n]) for n in names
        }
        self.directory = KvDirectory(self.bs)
        for n in names:
            self.directory.node_id(n)
        ropts: dict[str, Any] = {"profile": self.profile, "block_size": self.bs, "seed": cfg.seed}
        ropts.update(cfg.routing_options)
        self.router = RouterCore(make_routing(ps.routing, ps.decode_routing, **ropts), block_size=self.bs, fence_after=math.inf)
        self._apply_models = getattr(self.router, "apply_models", None)
        self.epoch = 1
        self.router.apply_split(SplitCommand(epoch=1, phases=dict(self.phases), reason="initial", decided_at=0.0))
        self.planner, self.planner_source = make_planner(ps.planner, names, self.profile, **cfg.planner_options)
        self._feed_planner = ps.planner != "static"
        self._RequestDone = request_done_type()
        self.replay = ReplayCore(requests, arrival, start=0.0, max_agents=cfg.max_agents)
        self.timeline = TimelineRecorder(self.phases, t0=0.0, epoch=1)
        self.stats = SimStats()
        self.records: list[RequestRecord] = []
        self.flights: dict[str, _Flight] = {}
        self.parked: OrderedDict[str, _Flight] = OrderedDict()
        self.branch_kind: dict[str, str] = {}
        for r in requests:
            if r.kind is not None and r.branch not in self.branch_kind:
                self.branch_kind[r.branch] = r.kind
        self._seen: set[int] = set()
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self.now = 0.0
        for f in forced:
            if f.node not in self.nodes:
                raise ValueError(f"forced switch names unknown node {f.node!r}")
            self._push(f.t, FORCED, f.node, f.phase)
        nt = self.planner.next_tick()
        if nt is not None:
            self._push(max(nt, 0.0), TICK, None, None)
        if self.duration is not None:
            self._push(self.duration, STOP, None, None)

    # ------------------------------------------------------------------ #
    # event loop
    # ------------------------------------------------------------------ #

    def _push(self, t: float, kind: int, a: Any, b: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def run_to_end(self) -> ClusterResult:
        """Run until every agent has finished (or ``duration_s``); returns the result."""
        heap = self._heap
        replay = self.replay
        stats = self.stats
        pop = heapq.heappop
        flights = self.flights
        parked = self.parked
        while True:
            if not flights and not parked and replay.done:
                break  # every agent finished: only planner ticks / relaunches would follow
            t_rep = replay.next_time()
            if heap and (t_rep is None or heap[0][0] < t_rep):
                t, _, kind, a, b = pop(heap)
                stats.events += 1
                self.now = t
                if kind == PLAN_END:
                    self._on_plan_end(a, b, t)
                elif kind == WAKE:
                    self._on_wake(a, t)
                elif kind == CALL:
                    a(t, *b)
                elif kind == TICK:
                    self._on_tick(t)
                elif kind == RELAUNCH_END:
                    self._on_relaunch_end(a, t)
                elif kind == FORCED:
                    self._start_switch(self.nodes[a], b, t, "forced")
                elif kind == STOP:
                    break
            elif t_rep is not None:
                if self.duration is not None and t_rep >= self.duration:
                    self.now = self.duration
                    break
                self.now = t_rep
                stats.events += 1
                self._on_replay(t_rep)
            else:
                break
        stats.end_time = self.now
        stats.unfinished = len(self.flights) + len(self.parked)
        for n in self.nodes.values():
            if n.status == RELAUNCHING:
                stats.out_of_service.append((n.name, n.out_since, self.now))
            stats.iterations += n.sched.iterations
        return ClusterResult(
            records=self.records,
            timeline=self.timeline.timeline(),
            stats=stats,
            nodes=list(self.nodes),
            initial_phases=self.initial_phases,
        )

    # ------------------------------------------------------------------ #
    # harness side
    # ------------------------------------------------------------------ #

    def _on_replay(self, t: float) -> None:
        for action in self.replay.poll(t):
            if isinstance(action, SendRequest):
                self._send(action, t)
            else:
                self._end_branch(action, t)

    def _send(self, action: SendRequest, t: float) -> None:
        req = action.req
        blocks = req.blocks if self._blocks_of is None else self._blocks_of(req)
        seen = self._seen
        hit = 0
        for b in blocks:
            if b in seen:
                hit += 1
            else:
                break
        seen.update(blocks)
        kind = self.branch_kind.get(req.branch, "main")
        if action.new_branch and self.track_branches:
            self.directory.branch_start(req.branch, t, kind=req.kind or "main", parent=req.parent_branch, agent=req.agent)
        rr = RouteRequest(
            rid=req.id,
            prompt_tokens=req.input_tokens,
            block_hashes=blocks,
            max_tokens=req.output_tokens,
            branch_id=req.branch if self.track_branches else None,
        )
        f = _Flight(req=req, rr=rr, sent_at=t, wait=action.admission_wait_s, ideal=hit * self.bs, kind=kind)
        self.flights[req.id] = f
        footprint = -(-(req.input_tokens + req.output_tokens) // self.bs)
        if footprint > self.profile.gpu_blocks:
            self._reject(f, f"request needs {footprint} KV blocks but a node has {self.profile.gpu_blocks} in GPU memory", t)
            return
        self._dispatch(f, t)

    def _end_branch(self, action: EndBranch, t: float) -> None:
        self.router.end_branch(action.branch, t)
        if self.track_branches:
            self.directory.branch_end(action.branch, t)
            self._flush_counts()

    # ------------------------------------------------------------------ #
    # routing
    # ------------------------------------------------------------------ #

    def _refresh_states(self, t: float) -> None:
        router = self.router
        stale = self.staleness
        for n in self.nodes.values():
            if n.dirty and t - n.state_at >= stale:
                router.apply_state(n.sched.state(t, with_queue=self._state_queue), t)
                n.state_at = t
                n.dirty = False

    def _dispatch(self, f: _Flight, t: float) -> None:
        """Route ``f`` (router core + policy) and send its work to the chosen node(s)."""
        rr = f.rr
        lookup = self.directory.lookup(rr.block_hashes).to_reply(self.bs) if rr.block_hashes else None
        self._refresh_states(t)
        out = self.router.route(rr, lookup, t)
        if isinstance(out, NoRoute):
            # every node of a needed phase is switching: wait for one (the live router
            # answers 503; the simulated harness retries when a node serves again)
            self.parked[rr.rid] = f
            self.stats.parked += 1
            return
        self.stats.routed += 1
        pnode = self.nodes[out.prefill.node]
        dname = out.decode_node
        work = out.work
        if self.track_branches:
            for placed in out.placed:
                if placed.phase != "decode" or self.binding != "prefill-start":
                    self.directory.place(placed.branch_id, placed.node, placed.phase, placed.block_hashes, t)
            self._flush_counts()
        f.prefill = pnode.name
        pnode.bound += 1
        gated = False
        decode_later = False
        if dname is not None:
            if self.binding == "prefill-start":
                # the router's core binds decode at dispatch; this mode binds at prefill start
                view = self.router.view
                view.on_finish(rr.rid)
                view.on_dispatch(rr.rid, pnode.name, None)
                work = _replace_decode(work, None)
                decode_later = True
                f.decode_later = True
            else:
                f.decode = dname
                dnode = self.nodes[dname]
                dnode.bound += 1
                if self.binding == "enqueue":
                    try:
                        granted = dnode.sched.reserve(rr.rid, rr.prompt_tokens, rr.max_tokens, t)
                    except WorkRejected as e:
                        self._reject(f, e.reason, t)
                        return
                    self._flush_kv(dnode, t)
                    dnode.dirty = True
                    gated = not granted
        f.work = work
        if not decode_later:
            f.decode_later = False
        self._deliver(t, self._add_prefill, f, work, gated, decode_later)

    def _deliver(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        if self.latency > 0.0:
            self._push(t + self.latency, CALL, fn, args)
        else:
            fn(t, *args)

    def _add_prefill(self, t: float, f: _Flight, work: PrefillWork, gated: bool, decode_later: bool) -> None:
        if self.flights.get(work.rid) is not f or f.work is not work:
            return  # re-routed meanwhile
        n = self.nodes[f.prefill]  # type: ignore[index]
        try:
            n.sched.add_prefill(work, t, gated=gated, decode_later=decode_later)
        except WorkRejected as e:
            if n.status != SERVING:  # delayed delivery reached a switching node: route again
                self._unbind(f, t)
                f.reroutes += 1
                self.stats.reroutes += 1
                self._dispatch(f, t)
                return
            self._reject(f, e.reason, t)
            return
        n.dirty = True
        self._kick(n, t)

    def _reject(self, f: _Flight, reason: str, t: float) -> None:
        """A request the engines refuse (e.g. larger than a node's L1): it fails, nothing hangs."""
        self.stats.rejected += 1
        self._unbind(f, t)
        self.flights.pop(f.req.id, None)
        self.router.finish(f.req.id, t)
        rec = self._record(f, t)
        rec.ok = False
        rec.status = 500
        rec.error = reason
        self.records.append(rec)
        for follow in self.replay.on_complete(f.req.agent, f.req.id, t, ok=False):
            self._end_branch(follow, t)  # type: ignore[arg-type]

    def _unbind(self, f: _Flight, t: float) -> None:
        """Remove ``f`` from its nodes (not started anywhere): prefill queue, decode reservation."""
        if f.prefill is not None:
            p = self.nodes[f.prefill]
            p.sched.abort(f.req.id, t)
            p.bound -= 1
            p.dirty = True
            f.prefill = None
            self._maybe_finish_drain(p, t)
        if f.decode is not None:
            d = self.nodes[f.decode]
            if d.sched.abort(f.req.id, t):
                self._flush_kv(d, t)
                self._kick(d, t)  # freed room may grant queued reservations
            d.bound -= 1
            d.dirty = True
            f.decode = None
            self._maybe_finish_drain(d, t)
        self.router.finish(f.req.id, t)  # the view and the policy forget it (it may be routed again)

    # ------------------------------------------------------------------ #
    # nodes
    # ------------------------------------------------------------------ #

    def _kick(self, n: _Node, t: float, cut_at: float | None = None) -> None:
        """New input reached ``n`` at ``t``: cut a folded plan, or schedule an idle node.

        ``cut_at``: the earliest time the input can change the batch (a hand-off's
        ``kv_ready_at``); the folded plan is cut at the first iteration boundary at or
        after it — exactly what single iterations would do, since the batch is the
        same until then (the KV is reserved at arrival either way)."""
        sched = n.sched
        plan = sched.inflight
        if plan is not None:
            if plan.iterations > 1:
                end = sched.truncate(plan, t if cut_at is None or cut_at < t else cut_at)
                if end != n.plan_end:
                    self.stats.truncations += 1
                    n.plan_end = end
                    n.token += 1
                    self._push(end, PLAN_END, n, n.token)
            return
        if n.status == RELAUNCHING:
            return
        plan = sched.schedule(t, t + HORIZON_S)
        n.dirty = True
        self._after_schedule(n, plan, t)
        if plan is not None:
            self.stats.plans += 1
            n.plan_end = plan.end
            n.token += 1
            self._push(plan.end, PLAN_END, n, n.token)
            return
        dl = sched.next_deadline()
        if dl is not None and dl > t and dl != n.wake_at:
            n.wake_at = dl
            self._push(dl, WAKE, n, None)
        if n.status == DRAINING:
            self._maybe_finish_drain(n, t)

    def _after_schedule(self, n: _Node, plan: Any, t: float) -> None:
        self._flush_kv(n, t)
        granted = n.sched.take_granted()
        for rid in granted:
            f = self.flights.get(rid)
            if f is None or f.prefill is None:
                continue
            p = self.nodes[f.prefill]
            if p.sched.open_gate(rid, t):
                p.dirty = True
                self._kick(p, t)
        if plan is not None and plan.admitted and self.binding == "prefill-start":
            for rid in plan.admitted:
                f = self.flights[rid]
                if f.decode_later and f.decode is None:
                    self._bind_at_prefill_start(n, f, t)

    def _bind_at_prefill_start(self, pnode: _Node, f: _Flight, t: float) -> None:
        """Paper Eq. 7 / D.1: the decode node is chosen, and its KV reserved, when the prefill starts."""
        self._refresh_states(t)
        view = self.router.view
        cands = view.decode_candidates(t)
        choice = self.router.policy.choose_decode(f.rr, cands, t) if cands else None
        if choice is not None:
            dname = choice.node
        else:  # every decode node is switching: the least loaded node still in decode phase
            pool = [d for d in self.nodes.values() if d.phase == "decode" and d.status != RELAUNCHING]
            if not pool:
                raise SimError(f"{f.req.id} started prefill on {pnode.name} but no node serves decode")
            dname = min(pool, key=lambda d: (d.bound, d.name)).name
        view.on_finish(f.req.id)
        view.on_dispatch(f.req.id, pnode.name, dname)
        pnode.sched.bind_decode(f.req.id, dname)
        d = self.nodes[dname]
        f.decode = dname
        d.bound += 1
        d.sched.reserve(f.req.id, f.rr.prompt_tokens, f.rr.max_tokens, t)
        d.dirty = True
        self._flush_kv(d, t)
        if self.track_branches:
            self.directory.place(f.rr.branch_id, dname, "decode", f.rr.block_hashes, t)  # type: ignore[arg-type]
            self._flush_counts()

    def _on_wake(self, n: _Node, t: float) -> None:
        if n.wake_at == t:
            n.wake_at = -1.0
        if n.sched.inflight is None:
            self._kick(n, t)

    def _on_plan_end(self, n: _Node, token: int, t: float) -> None:
        if token != n.token:
            return
        sched = n.sched
        plan = sched.inflight
        outs = sched.finish_iteration(plan, t)  # type: ignore[arg-type]
        n.dirty = True
        records = sched.take_records()
        if self._feed_planner and records:
            self.planner.on_iterations(n.name, records, t)
        self._flush_kv(n, t)
        for out in outs:
            if type(out) is TokensOut:
                if out.index == 0:
                    self._deliver(t, self._first_token, out)
                if out.finished:
                    f = self.flights.get(out.rid)
                    if f is not None:
                        n.bound -= 1
                        if f.decode is not None and f.decode != n.name:
                            # finished at prefill (max_tokens 1): release the decode binding
                            d = self.nodes[f.decode]
                            if d.sched.abort(out.rid, t):
                                self._flush_kv(d, t)
                                self._kick(d, t)
                            d.bound -= 1
                            d.dirty = True
                            self._maybe_finish_drain(d, t)
                    self._deliver(t, self._finish, out.rid)
            elif type(out) is HandOff:
                self.stats.handoffs += 1
                n.bound -= 1
                self._deliver(t, self._add_decode, out)
        self._kick(n, t)
        if n.status == DRAINING:
            self._maybe_finish_drain(n, t)

    def _add_decode(self, t: float, h: HandOff) -> None:
        d = self.nodes[h.decode_node]
        work: DecodeWork = h.work
        try:
            d.sched.add_decode(work, t)
        except WorkRejected as e:
            f = self.flights.get(h.rid)
            if f is not None:
                d.bound -= 1
                f.decode = None
                self.stats.rejected += 1
                self.router.finish(h.rid, t)
                self.flights.pop(h.rid, None)
                rec = self._record(f, t)
                rec.ok, rec.status, rec.error = False, 500, e.reason
                self.records.append(rec)
                for follow in self.replay.on_complete(f.req.agent, f.req.id, t, ok=False):
                    self._end_branch(follow, t)  # type: ignore[arg-type]
            return
        d.dirty = True
        self._flush_kv(d, t)
        self._kick(d, t, cut_at=work.kv_ready_at)

    def _first_token(self, t: float, out: TokensOut) -> None:
        f = self.flights.get(out.rid)
        if f is None:
            return
        f.first_at = t
        f.queue_s = out.queue_s
        f.cached = out.cached_tokens
        f.prompt = out.prompt_tokens
        sample = self.router.on_first_token(out.rid, t, first_token_at=t, queue_s=out.queue_s)
        if sample is not None and sample.predicted_s is not None and sample.measured_s is not None:
            self.stats.ttft_pred_abs_err.append(abs(sample.predicted_s - sample.measured_s))

    def _finish(self, t: float, rid: str) -> None:
        f = self.flights.pop(rid, None)
        if f is None:
            return
        self.router.finish(rid, t)
        rec = self._record(f, t)
        self.records.append(rec)
        if self._feed_planner:
            self.planner.on_request_done(
                self._RequestDone(
                    rid=rid,
                    prefill_node=f.prefill or "",
                    decode_node=f.decode or f.prefill or "",
                    prompt_tokens=f.prompt,
                    cached_tokens=f.cached,
                    output_tokens=f.req.output_tokens,
                    arrived_at=f.sent_at,
                    ttft_s=(f.first_at if f.first_at is not None else t) - f.sent_at,
                    e2e_s=t - f.sent_at,
                ),
                t,
            )
        replay = self.replay
        for follow in replay.on_complete(f.req.agent, rid, t, ok=True):
            self._end_branch(follow, t)  # type: ignore[arg-type]
        if (
            self.stats.closed_loop_exhausted_at is None
            and replay.arrival.kind == "closed"
            and len(replay.running_agents) < replay.arrival.concurrency
            and len(replay.running_agents) + len(replay.finished_agents) == replay.agents_total
            and not replay.done
        ):
            self.stats.closed_loop_exhausted_at = t

    def _record(self, f: _Flight, t: float) -> RequestRecord:
        req = f.req
        ok = f.first_at is not None
        return RequestRecord(
            id=req.id,
            agent=req.agent,
            branch=req.branch,
            branch_kind=f.kind,
            sent_at=f.sent_at,
            ttft_s=(f.first_at - f.sent_at + f.wait) if ok else None,  # type: ignore[operator]
            e2e_s=(t - f.sent_at + f.wait) if ok else None,
            admission_wait_s=f.wait,
            prompt_tokens=f.prompt or req.input_tokens,
            completion_tokens=req.output_tokens if ok else 0,
            cached_tokens=f.cached,
            expected_prompt_tokens=req.input_tokens,
            expected_completion_tokens=req.output_tokens,
            prefill_node=f.prefill,
            decode_node=f.decode,
            finished_at=t,
            queue_s=f.queue_s,
            ideal_cached_tokens=f.ideal,
        )

    # ------------------------------------------------------------------ #
    # KV directory plumbing
    # ------------------------------------------------------------------ #

    def _flush_kv(self, n: _Node, t: float) -> None:
        events = n.sched.take_kv_events()
        if not events or (self.skip_decode_kv and n.phase == "decode"):
            return
        n.kv_seq += 1
        self.stats.kv_batches += 1
        self.directory.apply_kv_batch(KvEventBatch(node=n.name, seq=n.kv_seq, ts=t, events=events), t)
        if self.track_branches:
            self._flush_counts()

    def _flush_counts(self) -> None:
        for cu in self.directory.take_count_updates():
            node = self.nodes.get(cu.node)
            if node is not None:
                node.sched.update_counts(cu.hashes, cu.counts)

    # ------------------------------------------------------------------ #
    # planner and phase switches
    # ------------------------------------------------------------------ #

    def _on_tick(self, t: float) -> None:
        self.stats.planner_ticks += 1
        planner = self.planner
        for n in self.nodes.values():
            planner.on_node_state(n.sched.state(t), t)
        busy = frozenset(n.name for n in self.nodes.values() if n.status != SERVING)
        decision = planner.tick(t, dict(self.phases), busy)
        take = getattr(planner, "take_decisions", None)
        if callable(take):
            for ev in take():
                self.stats.planner_decisions.append(msgspec.to_builtins(ev))
        if decision is not None:
            changes = {k: v for k, v in decision.phases.items() if k in self.nodes and v != self.phases[k] and k not in busy}
            if not callable(take):
                self.stats.planner_decisions.append({"ts": t, "reason": getattr(decision, "reason", ""), "changes": dict(changes)})
            if changes and self.switch_mode == "none":
                raise SimError(f"planner {planner.name!r} decided a switch but the switch mode is 'none'")
            for node, phase in changes.items():
                self._start_switch(self.nodes[node], phase, t, getattr(decision, "reason", "planner"))
        models = getattr(planner, "models", None)
        if self._apply_models is not None and callable(models):
            msg = models()
            if msg is not None:
                self._apply_models(msg, t)
        nt = planner.next_tick()
        if nt is not None:
            self._push(max(nt, t + 1e-6), TICK, None, None)

    def _start_switch(self, n: _Node, phase: Phase, t: float, reason: str) -> None:
        """Stop routing to ``n``, hand back its queued prefill requests, let running ones finish."""
        if n.status != SERVING or phase == n.phase:
            return
        self.epoch += 1
        self.phases[n.name] = phase
        self.router.apply_split(SplitCommand(epoch=self.epoch, phases=dict(self.phases), reason=reason, decided_at=t))
        n.status = DRAINING
        n.target = phase
        n.decided_at = t
        n.epoch = self.epoch
        n.dirty = True
        self.timeline.on_applied(
            SplitApplied(epoch=self.epoch, node=n.name, phase=phase, status="draining", decided_at=t, applied_at=t)
        )
        queued = n.sched.take_queued(t)
        for work in queued:
            f = self.flights.get(work.rid)
            if f is None:
                continue
            n.bound -= 1
            f.prefill = None
            self._unbind(f, t)
            f.reroutes += 1
            self.stats.reroutes += 1
            self._dispatch(f, t)
        self._maybe_finish_drain(n, t)

    def _maybe_finish_drain(self, n: _Node, t: float) -> None:
        if n.status != DRAINING or n.bound > 0 or not n.sched.idle:
            return
        old, new = n.phase, n.target
        assert new is not None
        if self.switch_mode in ("relaunch", "strand"):
            n.sched.clear_caches(t)
            self._flush_kv(n, t)
        if self.switch_mode == "relaunch" and self.relaunch_s > 0:
            n.status = RELAUNCHING
            n.out_since = t
            self._push(t + self.relaunch_s, RELAUNCH_END, n, None)
            return
        self._serve(n, old, new, t)

    def _on_relaunch_end(self, n: _Node, t: float) -> None:
        self.stats.out_of_service.append((n.name, n.out_since, t))
        assert n.target is not None
        self._serve(n, n.phase, n.target, t)

    def _serve(self, n: _Node, old: Phase, new: Phase, t: float) -> None:
        n.sched.set_phase(new, t)
        n.phase = new
        n.status = SERVING
        n.target = None
        n.dirty = True
        self.directory.node_phase_changed(n.name, old, new, t)
        if self.track_branches:
            self._flush_counts()
        self.timeline.on_applied(
            SplitApplied(
                epoch=n.epoch, node=n.name, phase=new, status="serving", decided_at=n.decided_at, applied_at=t, switch_s=t - n.decided_at
            )
        )
        if self._feed_planner:
            self.planner.on_switch_done(n.name, new, t)
        if self.parked:
            parked = list(self.parked.values())
            self.parked.clear()
            for f in parked:
                self._dispatch(f, t)


def _replace_decode(work: PrefillWork, node: str | None) -> PrefillWork:
    return msgspec.structs.replace(work, decode_node=node)
