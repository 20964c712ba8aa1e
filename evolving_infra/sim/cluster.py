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
* ``TICK`` of the planner (``next_tick``; lazily deleted too: a ``next_tick`` brought forward by
  iteration records, the evolving planner's warm-up restarted at the first one, gets a new token),
  ``RELAUNCH_END``, ``FORCED`` switches, ``CALL`` (a message delivered after ``msg_latency_s``),
  ``STOP`` (``duration_s``).

New work reaching a node with a plan in flight cuts a folded decode plan at
the next iteration boundary (``EngineScheduler.truncate``); an idle node is
scheduled at once with a far horizon, so identical decode iterations fold up
to the next completion or KV arrival (the engine's skip-ahead).

Messages are instantaneous unless ``msg_latency_s`` > 0 (then work dispatch,
PD hand-off and client delivery are delayed by it; decode reservations and
gate openings stay instantaneous). The live stack's control plane, measured by
``evolving-infra fidelity``, is modelled by ``ingress_s`` (+ ``ingress_s_per_token``
× prompt: send → routing decision and work on the prefill node) and ``egress_s``
(first token / end → client); all 0 by default. The router sees every node's state as it
is at the decision, or at most ``state_staleness_s`` old.
"""

from __future__ import annotations

import heapq
from itertools import islice
import math

import msgspec
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from evolving_infra.replay.core import Arrival, EndBranch, ReplayCore, SendRequest
from evolving_infra.report.records import RequestRecord
from evolving_infra.report.timeline import RunTimeline, TimelineRecorder
from evolving_infra.sim.config import ForcedSwitch, Resolved
from evolving_infra.sim.planners import make_planner, make_routing, request_done_type
from services.planner.online import OnlineModels
from evolving_infra.sim.schedule import ScheduledReplay
from evolving_infra.sim.seen import SeenIds
from evolving_infra.sim.policies import LOCAL_KV_MODES, SHARED_POOL_MODES
from evolving_infra.traces.schema import TraceRequest
from evolving_infra.traces.tokens import chained_prefix_len
from services.kvdirectory.core import KvDirectory
from services.kvdirectory.lookup import fetch_ranges
from services.kvdirectory.reuse import attribute_lost_reuse
from services.router.core import NoRoute, RouterCore
from services.router.policy import RouteRequest
from services.worker.blocks import BranchRunHostPool
from services.worker.plan import HandOff, TokensOut, WorkRejected
from services.worker.scheduler import EngineScheduler
from shared.profile import Profile
from shared.messages import DecodeWork, FetchRange, KvLookupReply, Phase, PrefillWork, SplitApplied, SplitCommand
from shared.split import SplitError, assign_min_change, parse_split, split_phases
from shared.values import FACTORY, IdentityValue, Value


PLAN_END, WAKE, TICK, RELAUNCH_END, FORCED, CALL, STOP, PERIODIC, SWITCH_END = range(9)

QUEUE_READING_ROUTERS = frozenset({"ttft"})
"""Routing policies that read ``NodeState.queue`` (Eq. 7's sum over queued work); the others
get node states without the queue list (O(1) per node instead of O(queue))."""

STATE_BLIND_ROUTERS = frozenset({"cache-aware", "round-robin"})
"""Routing policies that read no node-state numbers (only the router's own in-flight counts, and
a node's phase for its eligibility): with round-robin decode binding, a node's state is applied
to the router only when its phase differs from the one the router has (same decisions)."""

LOCAL_PREFIX_ROUTERS = frozenset({"cache-aware", "dynamo-kv", "sticky", "round-robin"})
"""Routing policies that read only the prefill candidates' own prefixes from the KV directory
(no shared pool: ``longest_any`` and fetch sources unused)."""
GPU_BLIND_ROUTERS = frozenset({"cache-aware", "sticky", "round-robin"})
"""Routing policies that never read a lookup's ``gpu_blocks`` (``dynamo-kv`` and ``ttft`` credit
device hits): with them the directory's GPU tier is read by nobody unless branch counts are kept."""
HORIZON_S = 1.0e6
"""Horizon given to ``schedule``: far enough that only completions and KV arrivals bound a fold;
new work cuts the fold with ``truncate`` instead."""

SERVING, DRAINING, RELAUNCHING, SWITCHING = "serving", "draining", "relaunching", "switching"
"""Node status: ``switching`` = drained, in the in-place switch's control time (serves nothing)."""

FETCH_PLANNING_ROUTERS = frozenset({"ttft"})
"""Routing policies that plan peer fetches themselves (``PrefillChoice.fetch``); with the shared
pool the simulator plans one for the others (:func:`pool_fetch`)."""

POOL_FETCH_MIN_TOKENS = 512
"""No pool fetch below this many tokens (recomputed instead): the ``ttft`` router's default
``--ttft-fetch-min-tokens`` (DESIGN §4, "x ≥ 512 (no fetch below)")."""


def pool_fetch(lookup: KvLookupReply | None, node: str, prompt_tokens: int, min_tokens: int = POOL_FETCH_MIN_TOKENS) -> list[FetchRange]:
    """The decoupled data plane's fetch for a request placed on ``node`` by a router that plans
    no fetch (paper §4.2: any prefill node reads the shared pool while the request queues).

    The ranges of the cluster's longest cached prefix beyond ``node``'s own prefix that other
    nodes hold (``services.kvdirectory.lookup.fetch_ranges``, host copies first), clipped to the
    engine's cache cap ``(prompt − 1) // block_size`` blocks; empty when that is under
    ``min_tokens`` tokens or there is no lookup. The engine fetches them while the request
    waits (``EngineScheduler._start_fetch``). O(ranges).
    """
    if lookup is None or lookup.error is not None or lookup.longest_any <= 0 or prompt_tokens < 2:
        return []
    bs = lookup.block_size
    local = next((p.local_blocks for p in lookup.nodes if p.node == node), 0)
    out = list(fetch_ranges(lookup.sources, node, local, (prompt_tokens - 1) // bs))
    return out if sum(r.end - r.start for r in out) * bs >= min_tokens else []


def _fetch_fields(out: TokensOut, work: PrefillWork | None) -> dict[str, Any]:
    """A request record's peer-fetch fields (``RequestRecord.fetch_sources`` …), as the live
    router reports them: the nodes of the executed fetch plan and the first token's
    ``fetched_tokens`` / ``fetch_s`` / ``exposed_fetch_s``. O(ranges)."""
    return {
        "fetch_sources": sorted({r.node for r in work.fetch}) if work is not None else [],
        "fetched_tokens": out.fetched_tokens,
        "fetch_s": out.fetch_s,
        "exposed_fetch_s": out.exposed_fetch_s,
    }


class SimError(RuntimeError):
    """The simulation reached a state the cores should never produce (a bug, not bad input)."""


class _Node(IdentityValue):
    name: str
    sched: EngineScheduler
    phase: Phase
    """Phase the node serves (its engine's phase)."""
    status: str
    target: Phase | None
    """Phase the node is switching to (draining / relaunching)."""
    decided_at: float
    epoch: int
    """The timeline epoch (``ClusterSim.decision``) of the node's current switch."""
    token: int
    """Current PLAN_END token (lazy deletion)."""
    plan_end: float
    wake_at: float
    kv_seq: int
    bound: int
    """Requests dispatched/bound to this node that have not left it (drain condition)."""
    state_at: float
    dirty: bool
    reported: Phase | None
    """Phase of the last state applied to the router."""
    out_since: float
    drained_at: float
    """When the current switch's drain ended (the last running request left)."""
    requeued: int
    """Queued requests the current switch handed back for re-routing."""
    host_at_switch: tuple[int, int]
    """(blocks in its L2, of which no other node's L2 holds a copy) at the switch decision."""
    kv_id: int
    """The node's id in the KV directory (``KvDirectory.node_id``; -1 until registered)."""

    __slots__ = __match_args__ = (
        "name", "sched", "phase", "status", "target", "decided_at", "epoch", "token", "plan_end", "wake_at", "kv_seq",
        "bound", "state_at", "dirty", "reported", "out_since", "drained_at", "requeued", "host_at_switch", "kv_id",
    )

    def __init__(
        self, name: str, sched: EngineScheduler, phase: Phase, status: str = SERVING,
        target: Phase | None = None, decided_at: float = 0.0, epoch: int = 0, token: int = 0,
        plan_end: float = -1.0, wake_at: float = -1.0, kv_seq: int = 0, bound: int = 0,
        state_at: float = -math.inf, dirty: bool = True, reported: Phase | None = None, out_since: float = 0.0,
        drained_at: float = 0.0, requeued: int = 0, host_at_switch: tuple[int, int] = (0, 0), kv_id: int = -1,
    ) -> None:
        self.name = name
        self.sched = sched
        self.phase = phase
        self.status = status
        self.target = target
        self.decided_at = decided_at
        self.epoch = epoch
        self.token = token
        self.plan_end = plan_end
        self.wake_at = wake_at
        self.kv_seq = kv_seq
        self.bound = bound
        self.state_at = state_at
        self.dirty = dirty
        self.reported = reported
        self.out_since = out_since
        self.drained_at = drained_at
        self.requeued = requeued
        self.host_at_switch = host_at_switch
        self.kv_id = kv_id


class _Flight(IdentityValue):
    req: TraceRequest
    rr: RouteRequest
    sent_at: float
    wait: float
    ideal: int
    kind: str
    prefill: str | None
    decode: str | None
    first_at: float | None
    queue_s: float | None
    cached: int
    prompt: int
    reroutes: int
    work: PrefillWork | None
    decode_later: bool
    """Routed PD with the decode node to be bound at prefill start."""
    started: bool
    """Its prefill was admitted on its prefill node (for the decode-reservation meter)."""
    decided_at: float
    """Time of the routing decision that placed it (its last one, after a re-route)."""
    predicted: float | None
    """The router's predicted TTFT at that decision (s from the decision; ``ttft`` routing)."""
    first_token_at: float | None
    """Time the prefill node produced the first token."""
    prev_prefill: str | None
    """Prefill node of the branch's previous request (a fork's first request: its parent's), for
    the paper's C.1 attribution of lost KV reuse."""
    fetch: TokensOut | None
    """Its first token's output when the prefill node fetched KV from peers (``fetch_s`` set)."""

    __slots__ = __match_args__ = (
        "req", "rr", "sent_at", "wait", "ideal", "kind", "prefill", "decode", "first_at", "queue_s", "cached", "prompt",
        "reroutes", "work", "decode_later", "started", "decided_at", "predicted", "first_token_at", "prev_prefill",
        "fetch",
    )

    def __init__(
        self, req: TraceRequest, rr: RouteRequest, sent_at: float, wait: float, ideal: int, kind: str,
        prefill: str | None = None, decode: str | None = None, first_at: float | None = None,
        queue_s: float | None = None, cached: int = 0, prompt: int = 0, reroutes: int = 0,
        work: PrefillWork | None = None, decode_later: bool = False, started: bool = False,
        decided_at: float = 0.0, predicted: float | None = None, first_token_at: float | None = None,
        prev_prefill: str | None = None, fetch: TokensOut | None = None,
    ) -> None:
        self.req = req
        self.rr = rr
        self.sent_at = sent_at
        self.wait = wait
        self.ideal = ideal
        self.kind = kind
        self.prefill = prefill
        self.decode = decode
        self.first_at = first_at
        self.queue_s = queue_s
        self.cached = cached
        self.prompt = prompt
        self.reroutes = reroutes
        self.work = work
        self.decode_later = decode_later
        self.started = started
        self.decided_at = decided_at
        self.predicted = predicted
        self.first_token_at = first_token_at
        self.prev_prefill = prev_prefill
        self.fetch = fetch


DIRECTORY_SAMPLE_S = 60.0
"""Simulated seconds between two samples of the KV directory's size (``SimStats.directory_size``)."""
_EVICTION_KEYS = {ph: (ph + ".zero_count", ph + ".positive_count") for ph in ("prefill", "decode", "both")}
"""``SimStats.host_evictions``' keys by the evicting node's phase."""


class SimStats(Value):
    """Counters of one simulated cluster (land in ``report.json`` as ``sim_*``)."""

    events: int
    plans: int
    iterations: int
    truncations: int
    routed: int
    reroutes: int
    parked: int
    rejected: int
    handoffs: int
    kv_batches: int
    planner_ticks: int
    planner_decisions: list[dict[str, Any]]
    out_of_service: list[tuple[str, float, float]]
    """(node, start, end) of every relaunch downtime."""
    unfinished: int
    end_time: float
    closed_loop_exhausted_at: float | None
    """Closed loop: first time a finished agent could not be replaced (the input ran out of
    agents; concurrency falls from then on)."""
    schedule_exhausted: list[dict[str, Any]]
    """Period schedule: the windows whose pool ran dry before their end
    (:meth:`~evolving_infra.sim.schedule.ScheduledReplay.exhausted`)."""
    ttft_pred_abs_err: list[float]
    """|predicted − measured| TTFT (s) of every first token whose routing policy predicted one."""
    host_evictions: dict[str, int]
    """L2 evictions the KV directory classified, by the evicting node's phase and the block's
    branch count on it: ``<phase>.zero_count`` / ``<phase>.positive_count`` (whole run)."""
    counted_samples: int
    counted_sum: float
    counted_max: int
    """Blocks that active branches reference (count > 0) on a node serving prefill, sampled at
    every request sent: samples, Σ of the per-send mean over those nodes, max over nodes and sends."""
    directory: dict[str, float]
    """The KV directory's counters at the end of the run (``KvDirectory.all_counters``: branch
    starts/ends/expiries/version bumps, moves, evictions by count) and ``end.copies.*`` gauges."""
    switch_log: list[dict[str, Any]]
    """Every completed node switch: node, from/to phase, mode, decided_at, drained_at,
    served_at, drain_s (decision → drained), downtime_s (drained → serving: relaunch or
    control time, the node serves nothing), switch_s (decision → serving), requeued, host_blocks
    and unique_host_blocks (its L2 at the decision, and the part no other node's L2 holds)."""
    pool_fetch_plans: int
    """Fetch plans the simulator made for a router that plans none (decoupled data plane)."""
    fetch_plans_dropped: int
    """Router fetch plans dropped because the switch mode keeps KV local (relaunch, strand)."""
    periodic_skipped: int
    """``switch_every`` changes that could not be made (too many nodes still switching)."""
    resv_node_s: float
    """∫ decode KV blocks reserved for requests whose hand-off has not arrived dt (warm-up excluded)."""
    resv_waiting_node_s: float
    """The same, only reservations of requests whose prefill has not started."""
    decode_cap_node_s: float
    """∫ L1 blocks of the nodes serving decode dt (warm-up excluded)."""
    directory_size: dict[int, list[int]]
    """Size of the KV directory over time, sampled at the first KV batch of every
    :data:`DIRECTORY_SAMPLE_S` simulated seconds: sample index → [blocks indexed, runs, GPU
    copies, host copies, estimated bytes] (``BlockIndex.size_bytes``)."""

    __slots__ = __match_args__ = (
        "events", "plans", "iterations", "truncations", "routed", "reroutes", "parked", "rejected", "handoffs",
        "kv_batches", "planner_ticks", "planner_decisions", "out_of_service", "unfinished", "end_time",
        "closed_loop_exhausted_at", "schedule_exhausted", "ttft_pred_abs_err", "host_evictions", "counted_samples",
        "counted_sum", "counted_max", "directory", "switch_log", "pool_fetch_plans", "fetch_plans_dropped",
        "periodic_skipped", "resv_node_s", "resv_waiting_node_s", "decode_cap_node_s", "directory_size",
    )

    def __init__(
        self, events: int = 0, plans: int = 0, iterations: int = 0, truncations: int = 0, routed: int = 0,
        reroutes: int = 0, parked: int = 0, rejected: int = 0, handoffs: int = 0, kv_batches: int = 0,
        planner_ticks: int = 0, planner_decisions: Any = FACTORY, out_of_service: Any = FACTORY,
        unfinished: int = 0, end_time: float = 0.0, closed_loop_exhausted_at: float | None = None,
        schedule_exhausted: Any = FACTORY, ttft_pred_abs_err: Any = FACTORY, host_evictions: Any = FACTORY,
        counted_samples: int = 0, counted_sum: float = 0.0, counted_max: int = 0, directory: Any = FACTORY,
        switch_log: Any = FACTORY, pool_fetch_plans: int = 0, fetch_plans_dropped: int = 0,
        periodic_skipped: int = 0, resv_node_s: float = 0.0, resv_waiting_node_s: float = 0.0,
        decode_cap_node_s: float = 0.0, directory_size: Any = FACTORY,
    ) -> None:
        self.events = events
        self.plans = plans
        self.iterations = iterations
        self.truncations = truncations
        self.routed = routed
        self.reroutes = reroutes
        self.parked = parked
        self.rejected = rejected
        self.handoffs = handoffs
        self.kv_batches = kv_batches
        self.planner_ticks = planner_ticks
        self.planner_decisions = [] if planner_decisions is FACTORY else planner_decisions
        self.out_of_service = [] if out_of_service is FACTORY else out_of_service
        self.unfinished = unfinished
        self.end_time = end_time
        self.closed_loop_exhausted_at = closed_loop_exhausted_at
        self.schedule_exhausted = [] if schedule_exhausted is FACTORY else schedule_exhausted
        self.ttft_pred_abs_err = [] if ttft_pred_abs_err is FACTORY else ttft_pred_abs_err
        self.host_evictions = {} if host_evictions is FACTORY else host_evictions
        self.counted_samples = counted_samples
        self.counted_sum = counted_sum
        self.counted_max = counted_max
        self.directory = {} if directory is FACTORY else directory
        self.switch_log = [] if switch_log is FACTORY else switch_log
        self.pool_fetch_plans = pool_fetch_plans
        self.fetch_plans_dropped = fetch_plans_dropped
        self.periodic_skipped = periodic_skipped
        self.resv_node_s = resv_node_s
        self.resv_waiting_node_s = resv_waiting_node_s
        self.decode_cap_node_s = decode_cap_node_s
        self.directory_size = {} if directory_size is FACTORY else directory_size


class ClusterResult(Value):
    """What one cluster (partition) produced."""

    records: list[RequestRecord]
    timeline: RunTimeline
    stats: SimStats
    nodes: list[str]
    initial_phases: dict[str, Phase]

    __slots__ = __match_args__ = ("records", "timeline", "stats", "nodes", "initial_phases")

    def __init__(
        self, records: list[RequestRecord], timeline: RunTimeline, stats: SimStats, nodes: list[str],
        initial_phases: dict[str, Phase],
    ) -> None:
        self.records = records
        self.timeline = timeline
        self.stats = stats
        self.nodes = nodes
        self.initial_phases = initial_phases


def slowed(profile: Profile, factor: float) -> Profile:
    """``profile`` with its Eq. 1/2 time coefficients (c0..c3, d0..d2) multiplied by ``factor``
    (``SimConfig.node_slowdown``); ``profile`` itself when ``factor`` is 1."""
    if factor == 1.0:
        return profile
    pre = msgspec.structs.replace(profile.prefill, **{k: getattr(profile.prefill, k) * factor for k in ("c0", "c1", "c2", "c3")})
    dec = msgspec.structs.replace(profile.decode, **{k: getattr(profile.decode, k) * factor for k in ("d0", "d1", "d2")})
    return msgspec.structs.replace(profile, prefill=pre, decode=dec)


class ClusterSim:
    """A cluster of ``len(node_names)`` nodes serving ``requests`` under ``arrival``.

    Args:
        run: the resolved run (profile, policy set, split, options).
        requests: trace requests (already at the profile's block size), file order, with chained
            block ids (docs/trace-format.md §4; :func:`evolving_infra.sim.run.simulate` re-chains its
            input): the KV directory's presence hooks assume it.
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
        self._state_blind = ps.routing in STATE_BLIND_ROUTERS and ps.decode_routing == "round-robin"
        self.run = run
        self.profile = run.profile
        self.bs = run.profile.block_size
        self._gpu_blocks = run.profile.gpu_blocks
        """L1 blocks of a node (``Profile.gpu_blocks``, a property: read once, not per request)."""
        self.binding = ps.decode_binding
        self.switch_mode = ps.switch_mode
        self.relaunch_s = cfg.relaunch_s
        self.latency = cfg.msg_latency_s
        self.ingress, self.ingress_tok, self.egress = cfg.ingress_s, cfg.ingress_s_per_token, cfg.egress_s
        self._client_now = not self.latency + self.egress > 0.0
        """First tokens and ends reach the client at once (:meth:`_to_client` delays nothing)."""
        self._ingress_free = 0.0
        """End of the prompt work (``ingress_s_per_token``) of the last request sent: the router does it
        one request at a time, in send order."""
        self.staleness = cfg.state_staleness_s
        self.duration = cfg.duration_s
        # The directory always hears branch starts/ends and placements (as live: the router
        # publishes them whatever the engines' eviction), so it keeps the counts R and classifies
        # evictions under every policy; only branch-count engines are sent the counts.
        self.track_branches = ps.eviction == "branch-count"
        # Decode-phase nodes' KV is invisible to every decision when the router reads only the
        # candidates' own prefixes and a node that leaves decode empties its caches (or never
        # switches): nothing reads a decode node's L2, so neither its content nor its eviction
        # order (branch counts included) can change a result. Their KV events and decode
        # placements are then not sent at all (tested: identical reports). With a shared pool
        # (ttft) or in-place switches they are sent, as live.
        self.skip_decode_kv = (
            cfg.decode_kv_events == "auto"
            and ps.routing in LOCAL_PREFIX_ROUTERS
            and ps.switch_mode in ("none", "relaunch", "strand")
        )
        # GPU-tier KV events: L2 is written through, so every node's host copy holds its GPU
        # copy and a lookup's local prefixes, longest_any and fetch sources (host copies first)
        # are the same without them; only NodePrefix.gpu_blocks differs. Routers that never read
        # it, with no branch counts, get the same decisions: the events are not sent (tested:
        # identical reports; decode_kv_events="always" sends everything).
        self.skip_gpu_kv = cfg.decode_kv_events == "auto" and ps.routing in GPU_BLIND_ROUTERS and not self.track_branches
        # the data plane: decoupled = one pool every prefill node reads (router's fetch plan,
        # else pool_fetch); relaunch / strand = local KV only (a router's fetch plan is dropped)
        self.switch_control_s = cfg.switch_control_s
        self.pool = ps.switch_mode in SHARED_POOL_MODES
        self.make_pool_fetch = self.pool and ps.routing not in FETCH_PLANNING_ROUTERS
        self.pool_fetch_min = cfg.pool_fetch_min_tokens
        self.drop_fetch = ps.switch_mode in LOCAL_KV_MODES
        self.switch_every = cfg.switch_every_s
        self.switch_splits = (run.split, cfg.switch_to)
        # decode-reservation meter (paper D.1): rid -> [blocks, prefill not started yet]
        self._resv: dict[str, list[Any]] = {}
        self._resv_sum = 0
        self._resv_wait = 0
        self._resv_t = 0.0
        self._meter_from = cfg.warmup_s
        names = list(node_names)
        self.phases: dict[str, Phase] = split_phases(run.split, names)
        self.planner, self.planner_source = make_planner(ps.planner, names, self.profile, **cfg.planner_options)
        start_phases = getattr(self.planner, "start_phases", None)
        if callable(start_phases):  # evolving: launch collocated for the warm-up; run.split comes after it
            self.phases = dict(start_phases(self.phases))
        self.initial_phases = dict(self.phases)
        slow = dict(cfg.node_slowdown)
        self.nodes: dict[str, _Node] = {
            n: _Node(n, EngineScheduler(n, slowed(self.profile, slow.get(n, 1.0)), self.phases[n], host_eviction=ps.eviction), self.phases[n])
            for n in names
        }
        # Counts only for blocks a node holds (``BranchTable.take_count_updates``): exact here, as
        # every store an engine makes is applied to the directory before the next drain (each engine
        # call that stores is followed by ``_flush_kv``, which drains after it; the other calls that
        # drain follow engine calls that store nothing), unless a decode node's events are not sent
        # (``skip_decode_kv``: its view would lack its stores). Tested: identical reports.
        # Chained: every path and every engine store here lists ids of one chained id space (``simulate``
        # re-chains its input, generated workloads are chained; ``requests`` must be), so the directory's presence hooks
        # bisect chains for their counted blocks (``BranchTable``'s ``chained``). Identical reports.
        self.directory = KvDirectory(
            self.bs, held_counts_only=self.track_branches and not self.skip_decode_kv, chained=True
        )
        self.directory.branches.chain_depths = self.track_branches  # the chains of count messages (_flush_counts)
        if self.track_branches:  # a host store's re-sent counts go to its engine at once, not through the outbox
            self.directory.branches.resend_sink = self._resend_counts
            self.directory.branches.resend_chain_sink = self._resend_chain  # those at the store's position, counts unbuilt
        self._sample_at = 0.0
        """The start of the next :data:`DIRECTORY_SAMPLE_S` window: its first KV batch samples the
        directory's size (``SimStats.directory_size``)."""
        for n in names:
            self.nodes[n].kv_id = self.directory.node_id(n)
        self._n_decode = sum(n.phase == "decode" for n in self.nodes.values())
        """Nodes serving decode only (their counted blocks are not sampled per request; kept by :meth:`_serve`)."""
        self._by_kv_id = sorted(self.nodes.values(), key=lambda n: n.kv_id)
        """The nodes by directory id (``_Node.kv_id``: 0, 1, … in ``names``' order)."""
        ropts: dict[str, Any] = {"profile": self.profile, "block_size": self.bs, "seed": cfg.seed}
        ropts.update(cfg.routing_options)
        # prefill-start: the router core defers the decode choice to ``bind_decode`` at the
        # prefill start (the live router's route.bind path); enqueue / route: chosen in route()
        self.router = RouterCore(
            make_routing(ps.routing, ps.decode_routing, **ropts),
            block_size=self.bs,
            fence_after=math.inf,
            decode_binding="prefill-start" if self.binding == "prefill-start" else "dispatch",
            keep_metrics=False,  # nothing reads router.metrics here: stats take on_first_token's samples
        )
        self._apply_models = getattr(self.router, "apply_models", None)
        self.epoch = 1
        """The router's split epoch: one more for each node's switch (its own ``SplitCommand``)."""
        self.decision = 1
        """The timeline's epoch (``SplitApplied.epoch``): one more per decision (a planner tick's, a forced
        switch, a periodic change), whatever number of nodes it switches, as the live planner's command
        carries one epoch for all of them; the report counts a run's split decisions by it."""
        self.router.apply_split(SplitCommand(epoch=1, phases=dict(self.phases), reason="initial", decided_at=0.0))
        self._feed_planner = ps.planner != "static"
        self._online: OnlineModels | None = None
        """Issue 21: the router's per-node models refitted from the iteration records when the
        planner publishes none of its own (static, dynamo, arrow), as the live planner does."""
        if self._apply_models is not None and ps.routing == "ttft" and getattr(self.planner, "models_version", None) is None:
            self._online = OnlineModels(names, self.profile)
        self._RequestDone = request_done_type()
        self._take_records = self._feed_planner or self._online is not None
        self._can_hold = self._feed_planner and self._online is None
        """Iteration records may be held in the engines between planner ticks (no online refit reads them)."""
        self._records_held = self._can_hold and not getattr(self.planner, "records_now", True)
        """The plans' iteration records stay in their engines until the planner's next read (:meth:`_hand_records`
        at its tick and at the run's end), each node's then handed in one call: the planner said at its last tick
        that it takes them so (``PolicyBase.records_now`` False). Else each plan's records at its end."""
        for node in self.nodes.values():
            # the simulator forwards only first tokens and ends, and reads iteration records only
            # for a planner or the online refit: the engines build nothing else (same results);
            # decode progress is kept by one clock per engine, not walked request by request
            node.sched.set_lazy_decode()
            node.sched.keep_records = self._take_records
        self.replay: Any = (
            ScheduledReplay(requests, cfg.schedule, seed=cfg.seed)
            if cfg.schedule
            else ReplayCore(requests, arrival, start=0.0, max_agents=cfg.max_agents)
        )
        self.timeline = TimelineRecorder(self.phases, t0=0.0, epoch=1)
        self.stats = SimStats()
        self.records: list[RequestRecord] = []
        self.flights: dict[str, _Flight] = {}
        self.parked: OrderedDict[str, _Flight] = OrderedDict()
        self.branch_kind: dict[str, str] = {}
        self._last_prefill: dict[str, str] = {}
        """branch → prefill node of its last request that produced a first token (paper C.1)."""
        for r in requests:
            if r.kind is not None and r.branch not in self.branch_kind:
                self.branch_kind[r.branch] = r.kind
        self._seen = SeenIds()
        """Every block id sent so far (for the requests' ideal cached tokens), 8 B per id."""
        self._sent_path: dict[str, Sequence[int]] = {}
        """branch → block ids of its last request sent (all in ``_seen``), until the branch ends."""
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self.now = 0.0
        for f in forced:
            if f.node not in self.nodes:
                raise ValueError(f"forced switch names unknown node {f.node!r}")
            self._push(f.t, FORCED, f.node, f.phase)
        if self.switch_every is not None:
            self._push(self.switch_every, PERIODIC, 1, None)
        self._decode_cap = sum(self.profile.gpu_blocks for p in self.phases.values() if p == "decode")
        self._tick_at = math.inf
        """Time of the pending planner ``TICK`` (inf: none), the one whose token is :attr:`_tick_token`."""
        self._tick_token = 0
        self._tick_floor = -math.inf
        """The earliest the next ``TICK`` may be: 1 µs after the last one (as :meth:`_on_tick` pushes it)."""
        self._tick_movable = hasattr(self.planner, "tick_moved")
        """The planner says when an input brought its next tick forward (``PolicyBase.tick_moved``)."""
        nt = self.planner.next_tick()
        if nt is not None:
            self._schedule_tick(max(nt, 0.0))
        if self.duration is not None:
            self._push(self.duration, STOP, None, None)

    # ------------------------------------------------------------------ #
    # event loop
    # ------------------------------------------------------------------ #

    def _push(self, t: float, kind: int, a: Any, b: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def run_to_end(self, progress: Callable[[float, int], None] | None = None) -> ClusterResult:
        """Run until every agent has finished (or ``duration_s``); returns the result.

        ``progress(now, completed)`` is called every 256 events (the caller decides what to
        show and when; simulated seconds, requests completed so far): an event of the ``evolving``
        set can take milliseconds (a placement re-counts a path), and every 4,096 left gaps of
        up to 31 s between progress lines."""
        heap = self._heap
        replay = self.replay
        stats = self.stats
        pop = heapq.heappop
        flights = self.flights
        parked = self.parked
        # ReplayCore.next_time read inline from its heaps (no call per event); a ScheduledReplay is asked
        arrivals, due = replay.due_heaps() if type(replay) is ReplayCore else (None, None)
        while True:
            if not flights and not parked and replay.done:
                break  # every agent finished: only planner ticks / relaunches would follow
            if progress is not None and not stats.events & 255:
                progress(self.now, len(self.records))
            if arrivals is None:
                t_rep = replay.next_time()
            elif arrivals:
                t_rep = arrivals[0][0]
                if due and due[0][0] < t_rep:
                    t_rep = due[0][0]
            else:
                t_rep = due[0][0] if due else None
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
                    if a == self._tick_token:  # else superseded by an earlier one (_schedule_tick)
                        self._on_tick(t)
                elif kind == RELAUNCH_END:
                    self._on_relaunch_end(a, t)
                elif kind == FORCED:
                    self.decision += 1
                    self._start_switch(self.nodes[a], b, t, "forced")
                elif kind == PERIODIC:
                    self._on_periodic(a, t)
                elif kind == SWITCH_END:
                    self._on_switch_end(a, t)
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
        if self._records_held:
            self._hand_records(self.now)
        if self._feed_planner:
            self._take_decisions()  # one made between ticks (a warm-up restarted at the first record) after the last
        if isinstance(self.replay, ScheduledReplay):
            stats.schedule_exhausted = self.replay.exhausted()
        self._meter(self.now)
        stats.unfinished = len(self.flights) + len(self.parked)
        stats.directory = dict(self.directory.all_counters())
        for k, v in self.directory.gauges().items():
            if k.startswith("copies."):  # blocks by (count > 0, tier) at the end
                stats.directory["end." + k] = v
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
        # leading blocks sent before: those shared with the branch's (a new fork: its parent's)
        # last request are (ids are chained, see the class docstring: one comparison, or a
        # bisection over single ids), the rest are looked up (C loops)
        paths = self._sent_path
        last = paths.get(req.branch)
        if last is None and req.parent_branch is not None:
            last = paths.get(req.parent_branch)
        shared = chained_prefix_len(last, blocks) if last is not None else 0
        hit = shared + seen.leading(blocks, shared)
        seen.update(islice(blocks, hit, None))  # the first ``hit`` are in already
        paths[req.branch] = blocks
        kind = self.branch_kind.get(req.branch, "main")
        directory = self.directory
        if action.new_branch:
            directory.branch_start(req.branch, t, kind=req.kind or "main", parent=req.parent_branch, agent=req.agent)
        dl = directory.next_deadline()
        if dl is not None and dl <= t:  # the live shell's expiry loop: silent branches end
            directory.expire(t)
            self._flush_counts()
        st = self.stats
        # the KV active branches reference per prefill node (node ids registered in self.nodes' order):
        # their sum and maximum in C (a Python step per node cost ~0.35% of a 600-s run's instructions)
        counts = directory.counted_blocks_all()
        if self._n_decode:
            counts = [c for n, c in zip(self.nodes.values(), counts) if n.phase != "decode"]
        if counts:
            m = max(counts)
            if m > st.counted_max:
                st.counted_max = m
            st.counted_samples += 1
            st.counted_sum += sum(counts) / len(counts)
        max_tokens = req.output_tokens if req.output_tokens > 1 else 1  # max(1, output_tokens), no builtin call
        rr = RouteRequest(  # positional, in field order (one per request)
            req.id,  # rid
            req.input_tokens,  # prompt_tokens
            blocks,  # block_hashes
            max_tokens,  # as the live replayer asks, a recorded 0 still gets one token
            b"",  # token_ids
            req.branch,  # branch_id
        )
        f = _Flight(req, rr, t, action.admission_wait_s, hit * self.bs, kind)  # req, rr, sent_at, wait, ideal, kind
        # paper C.1: the previous request of the branch (a fork's first: its parent's) ran here
        prev = self._last_prefill.get(req.branch)
        if prev is None and action.new_branch and kind == "fork" and req.parent_branch is not None:
            prev = self._last_prefill.get(req.parent_branch)
        f.prev_prefill = prev
        self.flights[req.id] = f
        footprint = -(-(req.input_tokens + max_tokens) // self.bs)
        if footprint > self._gpu_blocks:
            self._reject(f, f"request needs {footprint} KV blocks but a node has {self._gpu_blocks} in GPU memory", t)
            return
        if self.ingress > 0.0 or self.ingress_tok > 0.0:  # control plane (SimConfig.ingress_s): the work arrives later
            free = self._ingress_free
            # the prompt work is serial, in send order (a request sent just after a long prompt waits for it)
            self._ingress_free = done = (t if t > free else free) + self.ingress_tok * req.input_tokens
            self._push(done + self.ingress, CALL, self._dispatch_call, (f,))
            return
        self._dispatch(f, t)

    def _dispatch_call(self, t: float, f: _Flight) -> None:
        """:meth:`_dispatch` of a request whose ingress delay ended at ``t``."""
        self._dispatch(f, t)

    def _end_branch(self, action: EndBranch, t: float) -> None:
        self._sent_path.pop(action.branch, None)
        self.router.end_branch(action.branch, t)
        self.directory.branch_end(action.branch, t)
        self._flush_counts()

    # ------------------------------------------------------------------ #
    # routing
    # ------------------------------------------------------------------ #

    def _refresh_states(self, t: float) -> None:
        router = self.router
        stale = self.staleness
        blind = self._state_blind
        for n in self.nodes.values():
            if n.dirty and t - n.state_at >= stale:
                sched = n.sched
                if not blind or sched.phase != n.reported:
                    router.apply_state(sched.state(t, with_queue=self._state_queue), t)
                    n.reported = sched.phase
                n.state_at = t
                n.dirty = False

    def _dispatch(self, f: _Flight, t: float) -> None:
        """Route ``f`` (router core + policy) and send its work to the chosen node(s)."""
        rr = f.rr
        found = self.directory.lookup(rr.block_hashes) if rr.block_hashes else None
        lookup = found.to_reply(self.bs) if found is not None else None
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
        if work.fetch:
            if self.drop_fetch:  # relaunch / strand: a prefill node reuses only its own KV
                self.stats.fetch_plans_dropped += 1
                work = msgspec.structs.replace(work, fetch=[])
        elif self.make_pool_fetch:  # decoupled data plane: read the rest of the prefix from the pool
            ranges = pool_fetch(lookup, pnode.name, rr.prompt_tokens, self.pool_fetch_min)
            if ranges:
                self.stats.pool_fetch_plans += 1
                work = msgspec.structs.replace(work, fetch=ranges)
        for placed in out.placed:  # prefill-start: the decode placement comes with the binding
            if placed.phase != "decode" or not self.skip_decode_kv:  # decode: only where decode KV is seen
                # no KV event since the lookup above: the directory's lost-reuse record reuses it
                # (the router passes the request's own list on: identity answers without a scan)
                # (place_unread: place, its result not built, as nothing here reads it)
                same = found is not None and (placed.block_hashes is rr.block_hashes or placed.block_hashes == rr.block_hashes)
                self.directory.place_unread(placed.branch_id, placed.node, placed.phase, placed.block_hashes, t,
                                            found if same else None)
        self._flush_counts()
        f.prefill = pnode.name
        f.decided_at = t
        f.predicted = out.predicted_ttft_s
        pnode.bound += 1
        gated = False
        # prefill-start: the core dispatched the work with no decode node
        # (decode_binding="start"); it is bound by RouterCore.bind_decode at the prefill start
        decode_later = work.decode_binding == "start"
        f.decode_later = decode_later
        if dname is not None:
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
                if granted:
                    self._resv_add(rr.rid, rr.prompt_tokens, rr.max_tokens, True, t)
        f.work = work
        if self.latency > 0.0:
            self._deliver(t, self._add_prefill, f, work, gated, decode_later)
        else:  # _deliver's undelayed case, without its call
            self._add_prefill(t, f, work, gated, decode_later)

    def _deliver(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        if self.latency > 0.0:
            self._push(t + self.latency, CALL, fn, args)
        else:
            fn(t, *args)

    def _to_client(self, t: float, fn: Callable[..., None], arg: Any) -> None:
        """A first token or a request's end, delivered ``msg_latency_s + egress_s`` after ``t``."""
        d = self.latency + self.egress
        if d > 0.0:
            self._push(t + d, CALL, fn, (arg,))
        else:
            fn(t, arg)

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
            self._end_branch(follow, t)

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
            self._resv_drop(f.req.id, t)
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
        if n.status == RELAUNCHING or n.status == SWITCHING:
            return
        plan = sched.schedule(t, t + HORIZON_S)
        n.dirty = True
        if sched.kv.events:  # (most plans change no KV: no call)
            self._flush_kv(n, t)
        if sched.granted or (plan is not None and plan.admitted):  # (else _after_schedule has nothing to do)
            self._after_schedule(n, plan, t)
        if plan is not None:
            self.stats.plans += 1
            n.plan_end = end = plan.end
            n.token = token = n.token + 1
            self._seq = seq = self._seq + 1  # self._push, inline (one per plan)
            heapq.heappush(self._heap, (end, seq, PLAN_END, n, token))
            return
        dl = sched.next_deadline()
        if dl is not None and dl > t and dl != n.wake_at:
            n.wake_at = dl
            self._push(dl, WAKE, n, None)
        if n.status == DRAINING:
            self._maybe_finish_drain(n, t)

    def _after_schedule(self, n: _Node, plan: Any, t: float) -> None:
        """What ``n``'s :meth:`EngineScheduler.schedule` started, after its KV events were taken:
        decode reservations it granted, prefills it admitted (the reservation meter, decode binding
        at prefill start)."""
        granted = n.sched.take_granted() if n.sched.granted else ()
        for rid in granted:
            f = self.flights.get(rid)
            if f is None:
                continue
            self._resv_add(rid, f.rr.prompt_tokens, f.rr.max_tokens, not f.started, t)
            if f.prefill is None:
                continue
            p = self.nodes[f.prefill]
            if p.sched.open_gate(rid, t):
                p.dirty = True
                self._kick(p, t)
        if plan is None or not plan.admitted:
            return
        if self.binding == "enqueue":
            for rid in plan.admitted:  # the reservation meter: these prefills have started
                f = self.flights.get(rid)
                if f is not None:
                    f.started = True
                    self._resv_started(rid, t)
        elif self.binding == "prefill-start":
            for rid in plan.admitted:
                f = self.flights[rid]
                if f.decode_later and f.decode is None:
                    self._bind_at_prefill_start(n, f, t)

    def _bind_at_prefill_start(self, pnode: _Node, f: _Flight, t: float) -> None:
        """Paper Eq. 7 / D.1: the decode node is chosen, and its KV reserved, when the prefill starts."""
        self._refresh_states(t)
        bound = self.router.bind_decode(f.req.id, t, prefill_node=pnode.name)  # the live route.bind
        if isinstance(bound, NoRoute):
            # every decode node is switching (the live worker would retry route.bind every
            # 50 ms; here the prefill has started and needs a target now): the least loaded
            # node still in decode phase, bound through the same core call
            pool = [
                d for d in self.nodes.values()
                if d.phase == "decode" and d.status != RELAUNCHING and d.status != SWITCHING and d.name != pnode.name
            ]
            if not pool:
                raise SimError(f"{f.req.id} started prefill on {pnode.name} but no node serves decode")
            force = min(pool, key=lambda d: (d.bound, d.name)).name
            bound = self.router.bind_decode(f.req.id, t, prefill_node=pnode.name, node=force)
            if isinstance(bound, NoRoute):
                raise SimError(f"{f.req.id}: the router refused its decode binding: {bound.reason}")
        dname = bound.node
        pnode.sched.bind_decode(f.req.id, dname, t)  # at its prefill's start: nothing to hand off yet
        d = self.nodes[dname]
        f.decode = dname
        d.bound += 1
        if d.sched.reserve(f.req.id, f.rr.prompt_tokens, f.rr.max_tokens, t):
            self._resv_add(f.req.id, f.rr.prompt_tokens, f.rr.max_tokens, False, t)
        d.dirty = True
        self._flush_kv(d, t)
        if not self.skip_decode_kv:  # decode placements only where the directory sees decode KV
            for placed in bound.placed:
                self.directory.place_unread(placed.branch_id, placed.node, placed.phase, placed.block_hashes, t)
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
        if self._take_records and not self._records_held:
            records = sched.take_records()
            if self._feed_planner and records:
                self.planner.on_iterations(n.name, records, t)
                if self._tick_movable and self.planner.tick_moved:  # type: ignore[attr-defined]  # hasattr: _tick_movable
                    self._tick_moved(t)
            online = self._online
            if online is not None and records:
                online.add(n.name, records)
                if online.due(t):
                    msg = online.refit(t)
                    if msg is not None:
                        self._apply_models(msg, t)  # type: ignore[misc]
        if sched.kv.events:
            self._flush_kv(n, t)
        for out in outs:
            if type(out) is TokensOut:
                if out.index == 0:
                    if self._client_now:  # _to_client's undelayed case, without its call
                        self._first_token(t, out)
                    else:
                        self._to_client(t, self._first_token, out)
                if out.finished:
                    f = self.flights.get(out.rid)
                    if f is not None:
                        n.bound -= 1
                        if f.decode is not None and f.decode != n.name:
                            # finished at prefill (max_tokens 1): release the decode binding
                            d = self.nodes[f.decode]
                            self._resv_drop(out.rid, t)
                            if d.sched.abort(out.rid, t):
                                self._flush_kv(d, t)
                                self._kick(d, t)
                            d.bound -= 1
                            d.dirty = True
                            self._maybe_finish_drain(d, t)
                    if self._client_now:
                        self._finish(t, out.rid)
                    else:
                        self._to_client(t, self._finish, out.rid)
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
        self._resv_drop(h.rid, t)  # the reservation now holds a hand-off: no longer a pre-allocation
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
                    self._end_branch(follow, t)
            return
        d.dirty = True
        self._flush_kv(d, t)
        self._kick(d, t, cut_at=work.kv_ready_at)

    def _first_token(self, t: float, out: TokensOut) -> None:
        f = self.flights.get(out.rid)
        if f is None:
            return
        f.first_at = t
        f.first_token_at = out.at
        f.queue_s = out.queue_s
        f.cached = out.cached_tokens
        f.prompt = out.prompt_tokens
        if out.fetch_s is not None:
            f.fetch = out
        if f.prefill is not None:
            self._last_prefill[f.req.branch] = f.prefill
        sample = self.router.on_first_token(out.rid, t, first_token_at=out.at, queue_s=out.queue_s)
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
                self._RequestDone(  # positional, in RequestDone's field order (one per request)
                    rid,  # rid
                    f.prefill or "",  # prefill_node
                    f.decode or f.prefill or "",  # decode_node
                    f.prompt,  # prompt_tokens
                    f.cached,  # cached_tokens
                    f.rr.max_tokens,  # output_tokens
                    f.sent_at,  # arrived_at
                    (f.first_at if f.first_at is not None else t) - f.sent_at,  # ttft_s
                    t - f.sent_at,  # e2e_s
                ),
                t,
            )
        replay = self.replay
        for follow in replay.on_complete(f.req.agent, rid, t, ok=True):
            self._end_branch(follow, t)
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
            completion_tokens=f.rr.max_tokens if ok else 0,
            cached_tokens=f.cached,
            expected_prompt_tokens=req.input_tokens,
            expected_completion_tokens=req.output_tokens,
            prefill_node=f.prefill,
            decode_node=f.decode,
            finished_at=t,
            queue_s=f.queue_s,
            ideal_cached_tokens=f.ideal,
            # the prediction counts from its decision; a request parked or re-routed was decided
            # after its send, so the record's prediction (of send → first token) adds that delay
            predicted_ttft_s=(f.decided_at - f.sent_at + f.predicted) if ok and f.predicted is not None else None,
            first_token_at=f.first_token_at,
            lost_reuse_cause=attribute_lost_reuse(f.ideal, f.cached, f.prefill or "", f.prev_prefill)[1] if ok else None,
            **(_fetch_fields(f.fetch, f.work) if f.fetch is not None else {}),
        )

    # ------------------------------------------------------------------ #
    # KV directory plumbing
    # ------------------------------------------------------------------ #

    def _flush_kv(self, n: _Node, t: float) -> None:
        kv = n.sched.kv
        events = kv.events
        if not events:  # nothing happened to the node's KV (most calls): no list to drain
            return
        kv.events = kv.gpu.events = kv.host.events = []  # KvManager.take_events without its call frame
        if self.skip_decode_kv and n.phase == "decode":
            return
        self.stats.kv_batches += 1
        if self.skip_gpu_kv:
            events = [e for e in events if e.tier != "gpu"]
            if not events:
                return
        n.kv_seq += 1
        d = self.directory
        z, p = d.apply_kv_events(n.kv_id, n.kv_seq, t, events)  # apply_kv_batch without the batch and result objects
        if z or p:  # host evictions by (count > 0) and by the phase of the evicting node
            ev = self.stats.host_evictions
            kz, kp = _EVICTION_KEYS[n.phase]
            ev[kz] = ev.get(kz, 0) + z
            ev[kp] = ev.get(kp, 0) + p
        if t >= self._sample_at:  # the first batch of a DIRECTORY_SAMPLE_S window (t never goes back)
            k = int(t // DIRECTORY_SAMPLE_S)
            self._sample_at = (k + 1) * DIRECTORY_SAMPLE_S
            ix = d.index
            self.stats.directory_size[k] = [
                len(ix), ix.run_count(), sum(c[0] for c in ix.copies), sum(c[1] for c in ix.copies), ix.size_bytes()
            ]
        if d.branches.out_nodes:  # (a host store's re-sent counts went to the engine at once: _resend_counts)
            self._flush_counts()

    def _flush_counts(self) -> None:
        """Count changes (``kv.counts.<node>``) to the engines at once; engines whose eviction
        ignores counts (``lru``) are not sent them (the outbox is emptied either way, without
        building the messages)."""
        if not self.track_branches:
            self.directory.drop_count_updates()
            return
        by_id = self._by_kv_id
        # take_count_updates, no message objects; each message with its chains (path position, length), by
        # which the host pool finds the queued pages it names run by run (BranchRunHostPool.update_counts)
        for n, _, hashes, counts, chains in self.directory.branches.take_count_lists(chains=True):
            if n < len(by_id):  # (a node the directory heard of from a placement alone has no engine here)
                by_id[n].sched.kv.host.update_counts(hashes, counts, chains)  # EngineScheduler.update_counts, unwrapped

    def _resend_counts(self, n: int, hashes: list[int], counts: list[int], chains: list[tuple[int | None, int]] | None) -> None:
        """``BranchTable.resend_sink``: node n's re-sent counts of a host store, the message
        :meth:`_flush_counts` would hand its engine at the next drain, handed to it now (the drain
        follows every directory change here, and node n's own KV events change no count of n)."""
        by_id = self._by_kv_id
        if n < len(by_id):  # (a node the directory heard of from a placement alone has no engine here)
            host = by_id[n].sched.kv.host
            if chains is not None and type(host) is BranchRunHostPool:  # one chain at the store's position
                host.update_stored_counts(hashes, counts)
            else:
                host.update_counts(hashes, counts, chains)

    def _resend_chain(self, n: int, hashes: list[int]) -> None:
        """``BranchTable.resend_chain_sink``: :meth:`_resend_counts` of a re-send at the store's
        position (chains ``[(None, len(hashes))]``) whose counts, all > 0, the directory has not
        built: the usual one only sets the host pool's L1 intervals
        (``BranchRunHostPool.stored_counted``) and reads none; any other reads them
        (``BranchTable.chain_counts``) and goes through ``update_counts``."""
        by_id = self._by_kv_id
        if n < len(by_id):  # (a node the directory heard of from a placement alone has no engine here)
            host = by_id[n].sched.kv.host
            if type(host) is BranchRunHostPool and host.stored_counted(hashes):
                return
            host.update_counts(hashes, self.directory.branches.chain_counts(n, hashes), [(None, len(hashes))])

    # ------------------------------------------------------------------ #
    # planner and phase switches
    # ------------------------------------------------------------------ #

    def _tick_moved(self, t: float) -> None:
        """Records brought the planner's next tick forward (``PolicyBase.tick_moved``: the evolving planner's
        warm-up that ended before any record restarts at the first, ``t_learn_s`` from it): the live planner
        asks ``next_tick`` every round; here the pending ``TICK``, at the old time, would have ended it late.
        Asked only on the flag: a ``next_tick`` per plan end cost 4 % of the loop (sim_ab, 9 nodes)."""
        self.planner.tick_moved = False  # type: ignore[attr-defined]  # only when _tick_movable (hasattr)
        nt = self.planner.next_tick()
        if nt is not None and max(nt, t, self._tick_floor) < self._tick_at:
            self._schedule_tick(max(nt, t, self._tick_floor))

    def _schedule_tick(self, t: float) -> None:
        """Push the planner's ``TICK`` at ``t`` (simulated s), superseding the pending one (its event is
        skipped when popped: a new token)."""
        self._tick_token += 1
        self._tick_at = t
        self._push(t, TICK, self._tick_token, None)

    def _take_decisions(self) -> Any:
        """Move the planner's decisions (``take_decisions``, every evaluation) to ``stats.planner_decisions``;
        returns ``take_decisions`` (None: the planner has none)."""
        take = getattr(self.planner, "take_decisions", None)
        if callable(take):
            for ev in take():  # as JSON has it: an inf (an overloaded candidate) is null, report.json stays valid JSON
                self.stats.planner_decisions.append(msgspec.json.decode(msgspec.json.encode(ev)))
        return take

    def _hand_records(self, t: float) -> None:
        """The iteration records held since the last tick (:attr:`_records_held`) to the planner: each node's in
        one ``on_iterations`` call, in the node's order (no call per plan: 13,628 a 600-s run at 512-token blocks)."""
        planner = self.planner
        for n in self.nodes.values():
            sched = n.sched
            if sched.has_records:
                planner.on_iterations(n.name, sched.take_records(), t)

    def _on_tick(self, t: float) -> None:
        self._tick_at = math.inf
        self._tick_floor = t + 1e-6
        self.stats.planner_ticks += 1
        planner = self.planner
        if self._records_held:  # the records of the plans that ended before this tick, as if handed at each end
            self._hand_records(t)
        for n in self.nodes.values():
            planner.on_node_state(n.sched.state(t), t)
        busy = frozenset(n.name for n in self.nodes.values() if n.status != SERVING)
        decision = planner.tick(t, dict(self.phases), busy)
        self._records_held = self._can_hold and not getattr(planner, "records_now", True)  # until the next tick
        take = self._take_decisions()
        if decision is not None:
            changes = {k: v for k, v in decision.phases.items() if k in self.nodes and v != self.phases[k] and k not in busy}
            if not callable(take):
                self.stats.planner_decisions.append({"ts": t, "reason": getattr(decision, "reason", ""), "changes": dict(changes)})
            if changes and self.switch_mode == "none":
                raise SimError(f"planner {planner.name!r} decided a switch but the switch mode is 'none'")
            if changes:
                self.decision += 1
            for node, phase in changes.items():
                self._start_switch(self.nodes[node], phase, t, getattr(decision, "reason", "planner"))
        models = getattr(planner, "models", None)
        if self._apply_models is not None and callable(models):
            msg = models()
            if msg is not None:
                self._apply_models(msg, t)
        nt = planner.next_tick()
        if nt is not None:
            self._schedule_tick(max(nt, t + 1e-6))

    def _start_switch(self, n: _Node, phase: Phase, t: float, reason: str) -> None:
        """Stop routing to ``n``, hand back its queued prefill requests, let running ones finish (a switch of
        decision :attr:`decision`, which the caller has counted)."""
        if n.status != SERVING or phase == n.phase:
            return
        self.epoch += 1
        self.phases[n.name] = phase
        self.router.apply_split(SplitCommand(epoch=self.epoch, phases=dict(self.phases), reason=reason, decided_at=t))
        n.status = DRAINING
        n.target = phase
        n.decided_at = t
        n.epoch = self.decision
        n.dirty = True
        self.timeline.on_applied(
            SplitApplied(epoch=self.decision, node=n.name, phase=phase, status="draining", decided_at=t, applied_at=t)
        )
        own = set(n.sched.snapshot()[1])
        others: set[int] = set()
        for m in self.nodes.values():
            if m is not n:
                others.update(m.sched.snapshot()[1])
        n.host_at_switch = (len(own), len(own - others))
        queued = n.sched.take_queued(t)
        n.requeued = 0
        for work in queued:
            f = self.flights.get(work.rid)
            if f is None:
                continue
            n.requeued += 1
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
        n.drained_at = t
        if self.switch_mode in ("relaunch", "strand"):
            n.sched.clear_caches(t)
            self._flush_kv(n, t)
        if self.switch_mode == "relaunch":
            if self.relaunch_s > 0:
                n.status = RELAUNCHING
                n.out_since = t
                self._push(t + self.relaunch_s, RELAUNCH_END, n, None)
                return
        elif self.switch_control_s > 0:  # in place: the engine reconfigures, serving nothing meanwhile
            n.status = SWITCHING
            self._push(t + self.switch_control_s, SWITCH_END, n, None)
            return
        self._serve(n, old, new, t)

    def _on_switch_end(self, n: _Node, t: float) -> None:
        assert n.target is not None
        self._serve(n, n.phase, n.target, t)

    def _on_periodic(self, k: int, t: float) -> None:
        """``switch_every``: at k·period move to ``switch_to`` (odd k) or back to ``split`` (even k),
        changing the fewest nodes (``assign_min_change``) among those not already switching."""
        spec = self.switch_splits[k % 2 == 1]
        self._push(t + self.switch_every, PERIODIC, k + 1, None)  # type: ignore[operator]
        assert spec is not None
        pd = parse_split(spec, len(self.nodes))
        assert pd is not None  # checked by resolve()
        busy = {name for name, n in self.nodes.items() if n.status != SERVING}
        free = {name: ph for name, ph in self.phases.items() if name not in busy}
        need = pd[0] - sum(1 for name in busy if self.phases[name] == "prefill")
        if need == sum(1 for ph in free.values() if ph == "prefill"):
            return  # already there (or on the way)
        if not free or not 0 <= need <= len(free):
            self.stats.periodic_skipped += 1
            return
        if 1 <= need <= len(free) - 1:
            try:
                want = assign_min_change(free, need)
            except SplitError:  # pragma: no cover - range checked above
                self.stats.periodic_skipped += 1
                return
        else:
            want = {name: ("prefill" if need else "decode") for name in free}
        changes = {name: ph for name, ph in want.items() if ph != free[name]}
        reason = f"periodic {spec}"
        self.stats.planner_decisions.append({"ts": t, "reason": reason, "changes": dict(changes), "action": "switch"})
        self.decision += 1
        for name, ph in changes.items():
            self._start_switch(self.nodes[name], ph, t, reason)

    # ------------------------------------------------------------------ #
    # decode-reservation meter (paper D.1)
    # ------------------------------------------------------------------ #

    def _meter(self, t: float) -> None:
        """Integrate the reserved and capacity block counts up to ``t`` (from the warm-up on)."""
        lo = self._resv_t if self._resv_t > self._meter_from else self._meter_from
        if t > lo:
            dt = t - lo
            st = self.stats
            st.resv_node_s += self._resv_sum * dt
            st.resv_waiting_node_s += self._resv_wait * dt
            st.decode_cap_node_s += self._decode_cap * dt
        if t > self._resv_t:
            self._resv_t = t

    def _resv_add(self, rid: str, prompt: int, max_tokens: int, waiting: bool, t: float) -> None:
        """A decode reservation of ``rid`` was granted (before its hand-off)."""
        if rid in self._resv:
            return
        self._meter(t)
        blocks = -(-(prompt + max_tokens) // self.bs)
        self._resv[rid] = [blocks, waiting]
        self._resv_sum += blocks
        if waiting:
            self._resv_wait += blocks

    def _resv_started(self, rid: str, t: float) -> None:
        """The prefill of reserved ``rid`` started: its reservation no longer waits for prefill."""
        e = self._resv.get(rid)
        if e is not None and e[1]:
            self._meter(t)
            e[1] = False
            self._resv_wait -= e[0]

    def _resv_drop(self, rid: str, t: float) -> None:
        """``rid``'s reservation ends (hand-off arrived, abort, re-route)."""
        e = self._resv.pop(rid, None)
        if e is not None:
            self._meter(t)
            self._resv_sum -= e[0]
            if e[1]:
                self._resv_wait -= e[0]

    def _on_relaunch_end(self, n: _Node, t: float) -> None:
        self.stats.out_of_service.append((n.name, n.out_since, t))
        assert n.target is not None
        self._serve(n, n.phase, n.target, t)

    def _serve(self, n: _Node, old: Phase, new: Phase, t: float) -> None:
        if (old == "decode") != (new == "decode"):
            self._meter(t)
            self._decode_cap += self.profile.gpu_blocks if new == "decode" else -self.profile.gpu_blocks
        self.stats.switch_log.append(
            {
                "node": n.name, "from": old, "to": new, "mode": self.switch_mode,
                "decided_at": n.decided_at, "drained_at": n.drained_at, "served_at": t,
                "drain_s": n.drained_at - n.decided_at, "downtime_s": t - n.drained_at,
                "switch_s": t - n.decided_at, "requeued": n.requeued,
                "host_blocks": n.host_at_switch[0], "unique_host_blocks": n.host_at_switch[1],
            }
        )
        n.sched.set_phase(new, t)
        n.phase = new
        self._n_decode = sum(m.phase == "decode" for m in self.nodes.values())
        n.status = SERVING
        n.target = None
        n.dirty = True
        self.directory.node_phase_changed(n.name, old, new, t)
        self._flush_counts()
        self.timeline.on_applied(
            SplitApplied(
                epoch=n.epoch, node=n.name, phase=new, status="serving", decided_at=n.decided_at, applied_at=t,
                switch_s=t - n.decided_at, received_at=n.decided_at, drained_at=n.drained_at, requeued=n.requeued,
            )
        )
        if self._feed_planner:
            self.planner.on_switch_done(n.name, new, t)
        if self.parked:
            parked = list(self.parked.values())
            self.parked.clear()
            for f in parked:
                self._dispatch(f, t)
