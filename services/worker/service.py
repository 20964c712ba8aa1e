"""WorkerService: the asyncio shell of one node (symmetric engine host).

Contains zero decision logic: batching, chunking, KV blocks and eviction are
decided by ``EngineScheduler`` (``scheduler.py``); this file decodes messages,
calls the core with the node's local time (``clock.local_now()``), waits for the
engine, and publishes what the core returns (STYLE §2.1, §6).

Subjects (DESIGN §3, ``shared/subjects.py``):

    in   work.<node>.prefill (PrefillWork)   work.<node>.decode (DecodeWork)
         work.<node>.kv (KvChunk → KvChunkAck: a hand-off's K/V in pieces, before its DecodeWork; handoffkv.py)
         work.<node>.abort (RequestAbort)    split.commands (SplitCommand)
         kv.counts.<node> (CountUpdates, ``--host-eviction branch-count`` only: ``lru`` reads no count)
         kv.resync.<node> (request → KvSnapshot)
         kv.pool.<node> (PoolLocate → PoolLocation, ``--kv-pool real``)
    out  req.<rid>.out.<node> (TokenChunk)   kv.events.<node> (KvEventBatch, seq 1, 2, ...)
         node.state.<node> (NodeState)       node.iters.<node> (IterationRecords)
         work.<decode node>.decode (DecodeWork, PD hand-off)
    req  work.<decode node>.kv (KvChunk → KvChunkAck: a real engine's hand-off K/V, each piece answered, first)
         split.applied (SplitApplied: draining, serving)
    req  route.bind (DecodeBindRequest → DecodeBindReply: decode node at prefill start)
         work.requeue (WorkRequeue → WorkRequeueReply: work handed back in a phase switch)
         route.held (HeldQuery → HeldReply: every ``--owner-check-interval-s``, which of the requests
             held here each owning router no longer has in flight; a router gone or restarted sends
             no abort: ``owners.py``)
         kv.pool.<peer> (real-bytes fetches)
         split.get (SplitQuery → SplitCommand: the current split, once at start)
         kv.countsync.<node> (CountSyncRequest → CountSnapshot: every branch count of this node,
             after a gap in kv.counts' seq or a reconnect to NATS; ``countseq.py``; branch-count only)

In-place phase switch (paper §4.2, DESIGN §1) on a ``SplitCommand`` that changes
this node's phase: ``split.applied(draining)``; ``accepting=False`` (the router
stops routing here); every queued request that has not started is handed back
to the router (``work.requeue``), and so is any work of a phase the node does
not serve that arrives later; running requests finish in place (a draining
decode node still takes hand-offs already bound to it); once nothing runs,
``set_phase`` and ``split.applied(serving, switch_s)``. The engine, its L1/L2
and the real-bytes pool stay up throughout. A switch *to* ``both`` needs no
drain (both serves every phase's work).

Live loop: ``plan = core.schedule(t)``; wait until the plan's end on the
simulated clock (the deadline is fixed at launch, so Python overhead is
not added on top; when behind, no wait); ``finish_iteration`` at the plan's
end; publish. With the sim engine ``t`` is the engine's own timeline, not the
clock: the previous plan's end, or the latest input's arrival, or a deadline
waited for (``_launch_time``), so the shell's work between plans does not
stretch the simulated GPU's time (at most ``--engine-lag-wall-s`` behind the
clock). When idle it waits for new work or the core's next deadline, never
spinning.

Clocks: the core, the engine's timeline and every wait run on ONE local timeline,
the clock's monotonic reading (``SimClock.local_now``): a step of the wall clock
neither stalls nor hurries a plan, a decode waiting for its KV (``kv_ready_at``)
or a fetch completion. Times are moved at the edge: every time received from
another process (``DecodeWork.kv_ready_at``) wall → local on receipt
(:meth:`WorkerService._to_local`), every time sent (a token's, a state's, a KV
batch's ``ts``, an iteration record's ``start``, a hand-off's ``kv_ready_at``,
``SplitApplied``'s times) local → wall when sent (:meth:`WorkerService._to_wall`):
other processes compare them with their wall-based clocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from shared import messages as m
from shared.bus import Bus, BusError, NoResponders, PermissionDenied, RequestRefused
from shared.cancel import cancel_until_done, raise_if_cancel_lost
from shared.clock import SimClock, sleep_until
from shared.profile import Profile
from shared.validate import epoch_step_ok
from shared.subjects import (
    KV_COUNT_SYNC,
    KV_COUNTS,
    KV_EVENTS,
    KV_RESYNC,
    NODE_ITERS,
    NODE_STATE,
    REQ_OUT,
    ROUTE_BIND,
    ROUTE_HELD,
    SPLIT_APPLIED,
    SPLIT_COMMANDS,
    SPLIT_GET,
    WORK_ABORT,
    WORK_DECODE,
    WORK_KV,
    WORK_KV_CANCEL,
    WORK_PREFILL,
    WORK_REQUEUE,
    check_token,
)
from shared import tracing
from shared.metrics import FuncCollector, make_registry
from shared.ratelog import RateLimitedLog
from services.worker import handoffkv
from services.worker.traced import WorkerTraces
from services.worker.prom import worker_families
from services.worker.config import WorkerConfig, worker_profile
from services.worker.countseq import CountStream
from services.worker.owners import SILENT_RETRY_S, OwnerLeases
from services.worker.engines.base import Engine, EngineFatal
from services.worker.engines.sim import SimEngine
from shared.tokenizer import load_tokenizer, output_vocabulary  # the same tokenizers as the router: one spec
from services.worker.fetch import FetchStarted
from services.worker.plan import HandOff, IterationPlan, SchedulerError, TokensOut, WorkRejected
from services.worker.scheduler import EngineScheduler
from services.worker.watchdog import LoopBlocked, StepHung, StepInfo, StepWatchdog, await_chain

if TYPE_CHECKING:  # imported where --kv-pool real needs it: Mooncake is optional
    from services.worker.kvpool.pool import HostKvPool

ABORTED_KEPT = 4096
"""Aborts of requests a node did not hold that it remembers (``WorkerService._aborted``), newest first."""

OWNER_DROP_LOG_EACH = 8
"""Requests of one owner check and router logged one warning each when dropped (``WorkerService._log_owner_drops``);
the rest of them in one summary warning: a router that dies with thousands of streams open writes ~9 lines a node."""

OWNER_DROP_LOG_RIDS = 32
"""Request ids the summary warning of ``WorkerService._log_owner_drops`` names (its count names them all)."""

OWNER_RECHECK_S = 1.0
"""Wall seconds after a router's first "not in flight" answer about a request (``route.held``) before a query whose
same answer drops it (``WorkerService._check_owners_once``). A router that ends a request itself (its client left, a
stop at the router, a re-dispatch) marks it done, then publishes the nodes' abort from a task it spawns; an owner
check answered in between hears "not in flight" (core NATS) before the abort (JetStream) arrives: acted on at once,
a request its router ended on purpose was counted lost with its router. The abort normally comes within
milliseconds and ends the request first (counted an abort); a restarted router's answer is the same a second
later, and its predecessor's requests run on that much longer."""

ENGINES: dict[str, type[SimEngine]] = {"sim": SimEngine}
"""Engine kinds by ``WorkerConfig.engine`` (``torch``: :func:`make_torch_engine`)."""

WALL_STEP_S = 0.01
"""Least change (wall s) of the wall clock against the monotonic one that moves the offset between
the node's local timeline and the cluster's wall-based clock (``WorkerService._wall_offset``).
Reading the two clocks one after the other gives an offset that differs by µs from reading to
reading (ms if the thread is preempted between the reads): taken at every send, the plans of a
back-to-back timeline had µs gaps in their records' ``start``. Under this, the kept offset stays;
NTP's slew (≤ 500 ppm) moves it by this much at most every 20 s. So a time sent out may differ
from the wall clock's by up to this (× speedup) after a smaller step: the order of two hosts' NTP
skew. Times of this node compared with each other (a first token's ``ts`` and its ``arrived_at``)
are converted with one offset and keep their order."""


ALIVE_EARLY_S = 0.002
"""Wall seconds before it is due that :meth:`WorkerService._flush_kv` sends an alive batch: the step loop's wait for
it (uvloop rounds a timer to whole ms of its cached clock) wakes up to ~1 ms early, and without this margin the loop
went round without sending until the batch was due (a spin, as the heartbeat's in 4c88d96)."""

HANDOFF_SENDS_MAX = 16
"""A step's hand-offs going out at once beside the step loop (``WorkerService._handoff_aside``; their K/V bytes held
until every piece is answered), not counting those waiting in a decode node's queue for room
(:data:`HANDOFF_QUEUED_MAX`): past it the step waits for one to end or to be queued."""
HANDOFF_QUEUED_MAX = handoffkv.QUEUE_PER_SENDER - HANDOFF_SENDS_MAX
"""A step's hand-offs waiting in decode nodes' queues for room at once (``KvChunkAck.queued``), apart from
:data:`HANDOFF_SENDS_MAX`; their K/V bytes are bounded too, by ``--handoff-queued-bytes`` (4 GiB). Past either, the
step waits. 112: with the 16 being sent, one prefill
node's hand-offs never pass the 128 tickets one sender may hold on a decode node (``handoffkv.QUEUE_PER_SENDER``).
Before, queued hand-offs counted toward the 16: a full decode node held every other request's first token on this
node up to ``--handoff-queue-wait-s`` (30 s; review 55: 15 of a burst and the next probe waited 30.5-31.6 s)."""


@dataclass(slots=True, eq=False)
class _QueueGate:
    """One hand-off transfer's pieces' shared view of the decode node's queue (``WorkerService._send_piece``): while the
    transfer waits its turn for room (``KvChunkAck.queued``), one piece (``asker``) asks again and the others wait
    for ``admitted``, set when any piece of it is stored; ``since``: monotonic s of its first ``queued`` answer."""

    admitted: asyncio.Event = field(default_factory=asyncio.Event)
    asker: int | None = None
    since: float | None = None
    nbytes: int = 0
    """The transfer's K/V bytes (held on this node until every piece is answered)."""
    counted: bool = False
    """In ``WorkerService._queued_sends`` (queued, not yet admitted)."""


PREVIOUS_WAIT_NOTE_S = 10.0
"""Wall seconds new work of a request may wait for its previous attempt's step or hand-off on this node
(``WorkerService._newest_attempt``) before the wait is logged at warning, once, with where the step loop (or the
hand-off) waits (:func:`~services.worker.watchdog.await_chain`; counted ``requests.waited_long``). The wait goes on:
the engine keeps one registration per rid. Before, such a wait said nothing, and the prefill subscription's later
work queued silently behind it (a fault run's request unanswered for 3 minutes, its worker's log silent)."""

KV_READY_SLACK_WALL_S = 1.0
"""Wall seconds a received hand-off's ``kv_ready_at`` may lie past twice its transfer time (:func:`kv_ready_bound`)."""


def kv_ready_bound(now: float, transfer_s: float, speedup: float) -> float:
    """Latest ``kv_ready_at`` (simulated s, this node's local timeline) a received hand-off keeps; a later
    one is clamped to it (``decode.kv_ready_clamped``: its KV arrives within its transfer time, and a later
    one would hold its reservation idle, or forever for a bogus far-future value).

    ``now + 2·transfer_s`` (simulated s, the profile's, on the cluster clock) plus a slack of
    :data:`KV_READY_SLACK_WALL_S` wall seconds x ``speedup``: the slack covers what lies between the
    prefill node's clock and this one's, the two hosts' clock offsets (``WALL_STEP_S`` x speedup each, NTP
    skew) and the bus's delay, which are wall time whatever the engine; at speed-up 50 a 1-s slack of the
    cluster clock was 20 ms of them.

    Args:
        now: this node's local time (simulated s).
        transfer_s: the hand-off's KV transfer time (simulated s, ``Profile.kv_transfer_s``).
        speedup: cluster seconds per wall second (``--speedup``).
    """
    return now + 2.0 * transfer_s + KV_READY_SLACK_WALL_S * speedup


def make_torch_engine(cfg: WorkerConfig, profile: Profile, speedup: float | None = None) -> Engine:
    """The ``torch`` engine of ``cfg`` (imported lazily: torch is an extra). Its durations are
    in cluster seconds: the measured wall time x ``speedup`` (the shell's clock's; None =
    ``cfg.speedup``), as the shell takes them (plan ends, ``IterationRecord.duration_s``).

    Raises:
        ValueError: no ``--model``, the torch extra missing, or a model folder the engine
            cannot serve (``ModelConfigError``: missing/unsupported config or weights).
    """
    if not cfg.model:
        raise ValueError("--engine torch needs --model DIR (a local Hugging Face model folder)")
    try:
        from services.worker.engines.torch_engine.engine import TorchEngine
    except ModuleNotFoundError as e:
        from services.worker.engines.torch_engine.config import TORCH_EXTRA_INSTALL

        raise ValueError(f"--engine torch needs the torch extra ({e.name} missing): {TORCH_EXTRA_INSTALL}") from e
    if cfg.torch_threads:  # before the model loads: several workers on one machine share its cores
        import torch

        torch.set_num_threads(cfg.torch_threads)
    return TorchEngine(profile, cfg.model, dtype=cfg.dtype or None, device=cfg.device or None, check=cfg.check_invariants,
                       speedup=cfg.speedup if speedup is None else speedup)


class Superseded(RuntimeError):
    """Another process announces this node id and started later (its ``NodeState.boot`` is greater): this one
    was replaced (restarted while it was frozen, then resumed) and stops, so one node id is served once."""


class _BadCountSnapshot(Exception):
    """A ``kv.countsync`` reply that cannot be used (the sync asks again from the start)."""


class _CountSnapshotTooLarge(_BadCountSnapshot):
    """The node's snapshot has more entries than the worker fetches (``countseq.SNAPSHOT_MAX_ENTRIES``):
    the sync ended without it and is not asked again in that directory epoch."""


@dataclass(slots=True)
class _Switch:
    """An in-place phase switch in progress (between ``draining`` and ``serving``)."""

    epoch: int
    target: m.Phase
    decided_at: float
    """``SplitCommand.decided_at`` (simulated s, wall-based: the planner's)."""
    received_at: float
    """When the command came (simulated s, local: moved onto the wall clock when announced, with
    ``drained_at`` and ``applied_at``, so a step of the wall clock during the drain does not change
    its length)."""
    since: float = 0.0
    """Start of the switch time ``switch_s`` (simulated s, local): ``decided_at`` moved onto the local
    timeline on receipt, or this process's start when it began after the decision (a restarted
    worker catching up through ``split.get``: the time it was down is not the switch's). So a step
    of the wall clock during the drain is not in ``switch_s``."""
    requeued: int = 0
    drained_at: float | None = None
    """When the last request running on the node finished (simulated s, local)."""


def _drain_needed(old: str, new: str) -> bool:
    """A switch to ``both`` serves every phase's work at once; any other change drains first."""
    return new != "both" and new != old


def pin_fetched(pool: Any, results: list[Any]) -> list[tuple[int, int | None]]:
    """The pages each ``FetchResult`` of ``results`` (exceptions skipped) fetched or found held already, with
    their slot in ``pool``, pinned (``HostKvBuffer.pin``: no other block's bytes land there until
    :func:`unpin_fetched`), or None for a page the pool no longer holds."""
    return [
        (h, pool.buffer.pin(h)) for res in results if not isinstance(res, BaseException) for h in (*res.fetched, *res.already)
    ]


def unpin_fetched(pool: Any, pinned: list[tuple[int, int | None]]) -> None:
    """Let go of the pins of :func:`pin_fetched`."""
    for _, slot in pinned:
        if slot is not None:
            pool.unpin(slot)


def fetched_pages(pool: Any, pinned: list[tuple[int, int | None]]) -> list[tuple[int, Any]]:
    """``Engine.on_fetched``'s pages: each pinned page with its slot's bytes (a view), or None."""
    return [(h, None if slot is None else pool.buffer.slot_view(slot)) for h, slot in pinned]


async def take_fetched(
    engine: Engine, pool: Any, results: list[Any], fetch_id: int, copy: Callable[..., Awaitable[Any]] | None = None
) -> set[int]:
    """A real engine takes the bytes of fetch ``fetch_id`` before the core stores its pages: those
    each ``FetchResult`` (exceptions skipped) fetched and those the pool held already (another open
    fetch brought them: the engine holds them for this fetch too, or the completion of this one,
    after the other ended and L2 evicted them, would store a page without bytes). The pages' slots
    are pinned here (the pool's bookkeeping stays on the caller's loop), ``engine.on_fetched`` copies
    them, the pins go here. ``copy(fn, *args)`` runs that copy and returns an awaitable of its result
    (the worker: ``WorkerService._beside_plan``, in the execute thread after the plan in flight); None:
    here, at once. Returns the pages the engine could not take (the pool let them go meanwhile):
    reported missing. Cancelled while awaiting ``copy`` (the worker's stop), the pins stay: the copy
    may still run in the thread, and the pool goes with the node.

    Raises:
        what ``on_fetched`` (or ``copy``) raised, after the pins went."""
    pinned = pin_fetched(pool, results)
    if not pinned:
        return set()
    pages = fetched_pages(pool, pinned)
    try:
        lost = await copy(engine.on_fetched, pages, fetch_id) if copy is not None else engine.on_fetched(pages, fetch_id)
    except asyncio.CancelledError:
        raise
    except BaseException:
        unpin_fetched(pool, pinned)
        raise
    unpin_fetched(pool, pinned)
    return set(lost)


def _chain(src: asyncio.Future[Any], dst: asyncio.Future[Any]) -> None:
    """``dst`` ends as ``src`` does (result, exception or cancelled); cancelling ``dst`` cancels ``src``."""

    def done(f: asyncio.Future[Any]) -> None:
        e = None if f.cancelled() else f.exception()  # retrieved even when dst is done: no "never retrieved" log
        if dst.done():
            return
        if f.cancelled():
            dst.cancel()
        elif e is not None:
            dst.set_exception(e)
        else:
            dst.set_result(f.result())

    src.add_done_callback(done)
    dst.add_done_callback(lambda f: src.cancel() if f.cancelled() else None)


class _Live:
    """The rids the engine must keep registered at a KV drain (``Engine.on_kv_events``'s ``live``,
    read with ``in`` only): the scheduler's requests, and those of the engine step in flight (and
    of the hand-offs going out after a late binding, ``WorkerService._handing_off``). A
    request aborted (or superseded) after ``schedule()`` planned it is no longer the scheduler's,
    but the plan still runs it: forgotten by a drain in a bus handler before the execute thread
    took the engine's lock, its registration was gone when the plan ran (``KvMapError``)."""

    __slots__ = ("core", "step")

    def __init__(self, core: Any, step: frozenset[str]) -> None:
        self.core = core
        self.step = step

    def __contains__(self, rid: object) -> bool:
        return rid in self.core or rid in self.step


@dataclass(frozen=True, slots=True)
class _Owner:
    """Who a request on this node belongs to: its dispatch attempt (fencing token), the output
    position of its first output here, and the router that owns it (issue #22)."""

    attempt: int = 0
    offset: int = 0
    router: str = ""
    arrived_at: float | None = None
    """When its work reached this node (simulated s, local: ``TokenChunk.arrived_at`` once moved
    onto the wall-based clock)."""

    @property
    def router_id(self) -> str:
        """The owner's instance id (``route.bind.<id>``, ``work.requeue.<id>``); default ``router``."""
        return self.router or "router"


@dataclass(slots=True)
class _Stream:
    """Output tokens of one request not yet streamed (stream_interval coalescing)."""

    start: int
    """Output index of ``pending[0]``."""
    pending: list[int] = field(default_factory=list)
    lps: list[tuple[float, list[int], list[float]]] | None = None
    """Log-probabilities of ``pending`` (one each) when the request asked (``Sampling.logprobs``)."""


def _lp_fields(lps: list[tuple[float, list[int], list[float]]] | None) -> dict[str, Any]:
    """``TokenChunk`` log-probability fields of ``lps`` (``Engine.output_logprobs``): none when
    not asked, ``top_ids`` / ``top_logprobs`` only when some position has a top list."""
    if not lps:
        return {}
    out: dict[str, Any] = {"logprobs": [x[0] for x in lps]}
    if any(x[1] for x in lps):
        out["top_ids"] = [x[1] for x in lps]
        out["top_logprobs"] = [x[2] for x in lps]
    return out


class WorkerService:
    """One node: NATS in, ``EngineScheduler`` + engine, NATS out.

    Args:
        cfg: the worker configuration.
        bus: a connected bus (instance ``worker-<node>``).
        clock: the cluster's simulated clock.
        vocab: output ids for the sim engine (``output_vocabulary`` of ``cfg.tokenizer``,
            computed here when not given).

    Raises:
        shared.profile.ProfileError: if the profile cannot be loaded, or --gpu-kv-tokens / --host-kv-tokens is invalid.
        ValueError: if the profile does not suit the scheduler (see EngineScheduler).
        TokenizerError: if ``cfg.tokenizer`` cannot be loaded.
    """

    def __init__(self, cfg: WorkerConfig, bus: Bus, clock: SimClock, *, vocab: list[int] | None = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.clock = clock
        self.node = cfg.node
        self.profile = worker_profile(cfg)  # the profile with --gpu-kv-tokens / --host-kv-tokens applied
        self.core = EngineScheduler(
            cfg.node,
            self.profile,
            cfg.phase,
            host_eviction=cfg.host_eviction,
            check_invariants=cfg.check_invariants,
            external_fetch=cfg.kv_pool == "real",
        )
        if vocab is None and cfg.tokenizer != "sim":
            vocab = output_vocabulary(load_tokenizer(cfg.tokenizer))
        self.engine: Engine = make_torch_engine(cfg, self.profile, clock.speedup) if cfg.engine == "torch" else ENGINES[cfg.engine](self.profile, vocab)
        self.counters: Counter[str] = Counter()
        self.counts = CountStream(cfg.count_sync_buffer_entries)
        """Sequence check of ``kv.counts.<node>``: gaps, stale messages, directory restarts, syncs."""
        self.counts_on = cfg.host_eviction == "branch-count"
        """Whether this node reads branch counts: only ``branch-count`` host eviction does (``lru``
        ignores them), so only then is ``kv.counts.<node>`` subscribed and a count sync ever run."""
        self._count_sync_task: asyncio.Task[None] | None = None
        self._last_count_sync = -1e18
        """``time.monotonic()`` of the last snapshot asked on ``kv.countsync`` (rate limit)."""
        self._counts_reconnect_seen = bus.reconnected_at
        """``Bus.reconnected_at`` when the counts last checked it: a newer value means NATS reconnected."""
        self._drop_counts = set(cfg.fault_drop_counts)
        """``--fault-drop-counts``: seqs still to drop on arrival (fault injection)."""
        self._stopped = False
        """Set by :meth:`stop`: no count sync starts after it (``accepting`` is also False while draining)."""
        self.registry = make_registry(bus)
        """Prometheus registry served on ``--metrics-port`` (``services/worker/prom.py``)."""
        self.registry.register(FuncCollector(lambda: worker_families(self)))
        self.log = structlog.get_logger("worker").bind(node=cfg.node)
        self.epoch = 0
        self.kv_seq = 0
        self._last_kv_mono = time.monotonic()
        """When the last ``kv.events`` batch was published (or, with ``--fault-drop-kv-events``, dropped): monotonic s.
        A node serving this long past ``--kv-alive-interval-s`` with no KV event publishes an empty batch (:meth:`_flush_kv`)."""
        self.state_seq = 0
        self.boot = m.new_boot(time.time_ns(), os.urandom(4))
        """This process's incarnation (``NodeState.boot``): a later process under the same node id supersedes it."""
        self.pid = os.getpid()
        """This process's id (``NodeState.pid``): the pid ``up``'s ``node.down`` names when it exits."""
        self.accepting = False
        self._streams: dict[str, _Stream] = {}
        self._records: list[m.IterationRecord] = []
        self._wake = asyncio.Event()
        self._offset = clock.now() - clock.local_now()
        """Simulated s from the node's local timeline to the cluster clock (:meth:`_wall_offset`)."""
        self._ready_at = 0.0
        """Simulated time (s, local) from which the engine can act on what it holds: the end of its
        last plan, or the latest input handed to the core, or a deadline it waited for (sim engines)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._last_state_mono = float("-inf")
        """``time.monotonic()`` when the last ``node.state`` went out: the heartbeat and the state
        cadence count from it, not from the wall clock (a step back of the wall clock by an hour
        stopped every state for an hour)."""
        self._last_state_counts: tuple[int, int, int] = (0, 0, 0)
        """(running, waiting, decoding) of the last ``node.state`` that went out: :meth:`_step` publishes
        one when the engine stops with other counts (:meth:`_publish_if_stopped`)."""
        self._switch: _Switch | None = None
        self._started_local = clock.local_now()
        """Simulated s (local) this process started (``_Switch.since``, compared with
        ``SplitCommand.decided_at`` moved onto the local timeline). Before, a wall reading: after a
        step of the wall clock back, every later decision came before it, and ``switch_s`` was 0."""
        self._bind_later: dict[str, m.PrefillWork] = {}
        """Queued requests whose decode node is chosen at prefill start (``route.bind``)."""
        self._binds: dict[str, asyncio.Task[None]] = {}
        """route.bind in flight per rid (started when the request's first chunk is admitted)."""
        self._handing_off: dict[str, asyncio.Task[None]] = {}
        """rid → the :meth:`_bind` task publishing its hand-off: the binding came after its prefill
        had finished (parked in the core; its first token went out then). Out of :attr:`_binds`, so an abort no
        longer cancels it (as it cannot stop a step publishing a hand-off); a drain, new work of
        the rid (:meth:`_newest_attempt`) and :meth:`stop` wait for it."""
        self._sending_handoffs = 0
        """Hand-offs :meth:`_handoff` is sending now (a threaded engine's awaits the execute thread) and a step's
        :meth:`_deliver_aside` tasks: a drain waits for them as for :attr:`_handing_off` (a step's requests have left
        the core by then)."""
        self._deliveries: set[asyncio.Task[None]] = set()
        """A step's hand-offs going out beside the step loop (:meth:`_handoff_aside`), at most
        :data:`HANDOFF_SENDS_MAX`: each rid is in :attr:`_handing_off` too until its DecodeWork is out (or failed)."""
        self._bound_sends: set[str] = set()
        """rids whose :meth:`_hand_off_bound` task is sending their hand-off (:meth:`_handoff`): an abort stops it, as it
        stops one of :attr:`_deliveries`."""
        self._queued_sends = 0
        """Hand-offs of :attr:`_deliveries` (and :meth:`_handoff`'s) waiting in a decode node's queue for room, not yet
        admitted (:data:`HANDOFF_QUEUED_MAX`)."""
        self._queued_send_bytes = 0
        """Their K/V bytes (bounded by ``--handoff-queued-bytes``)."""
        self._send_room = asyncio.Event()
        """Set when a hand-off being sent ends or starts waiting in a decode node's queue: the step waiting for room
        to send (:meth:`_handoff_aside`) looks again."""
        self._kv_in = handoffkv.KvAssembler(cfg.handoff_buffer_bytes, cfg.handoff_kv_timeout_s, cfg.handoff_piece_idle_s)
        """Hand-off K/V coming in (``work.<node>.kv``), until its ``DecodeWork`` takes it (``handoffkv.py``)."""
        self._kv_timer: asyncio.TimerHandle | None = None
        """Wakes :meth:`_expire_kv` at the assembler's next deadline while it holds a transfer."""
        self._kv_log = RateLimitedLog(self.log, first=5, interval_s=10.0)
        """Bounds the warnings of refused and dropped hand-off K/V (a flood of bad pieces writes a few lines)."""
        self._transfer_tag = f"{cfg.node[:64]}-{os.urandom(6).hex()}"
        """Prefix of this process's transfer ids (``KvChunk.transfer``: ``<tag>-<n>``), new at each start."""
        self._started_mono = time.monotonic()
        """When this process's service was made (monotonic s): a work whose K/V it never saw names it."""
        self._transfers = 0
        self._kv_due = 0.0
        """Monotonic s :attr:`_kv_timer` fires at."""
        self._spawned: set[asyncio.Task[None]] = set()
        self._owners: dict[str, _Owner] = {}
        """rid → attempt, output offset and owning router of every request on this node."""
        self._leases = OwnerLeases(cfg.owner_gone_after_s)
        """No-responder streaks of owning routers (``route.held``): a router gone drops its requests here."""
        self._not_in_flight: dict[str, tuple[int, str, float]] = {}
        """rid → (attempt, router, monotonic s) of a held request its router first answered "not in flight" about
        then: dropped when a query sent :data:`OWNER_RECHECK_S` later is answered so too (its own abort, if the
        router ended it, comes first). Only requests in :attr:`_owners` (pruned at each check)."""
        self._traces = WorkerTraces(cfg.node, clock.speedup)
        """Spans of traced requests (empty unless tracing is on and requests carry ``traceparent``)."""
        self.kvpool: HostKvPool | None = None  # HostKvPool with --kv-pool real (imported lazily: Mooncake is optional)
        self.fatal = asyncio.Event()
        """Set when the engine failed beyond repair (:class:`EngineFatal`, e.g. ``KvMapError``): the
        process shell (``shared.service``) then stops the node and exits non-zero (``fatal_error``)."""
        self.fatal_error: BaseException | None = None
        self._kv_batches = 0
        """Non-empty KV event batches handed to the engine (``--fault-skip-engine-kv-batch``)."""
        self._steps = 0
        """Engine steps (plans) started by this process (``StepInfo.seq``, ``--fault-hang-step``)."""
        self._fault_hang = threading.Event()
        """``--fault-hang-step`` / ``--fault-block-loop-at-s``: the hung step's thread, or the blocked
        loop, waits for it (never set while serving)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._step_rids: frozenset[str] = frozenset()
        """Requests of the engine step in flight (from its ``schedule()`` to its end; empty between)."""
        self._step_over = asyncio.Event()
        """Set when no engine step is in flight (:meth:`_newest_attempt`)."""
        self._step_over.set()
        self._loop_task: asyncio.Task[None] | None = None
        """The step loop's task (:meth:`_run`): where it waits goes into a hung step's record (:func:`await_chain`)."""
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        """The execute thread (threaded engines, ``--fault-hang-step``), made at the first use."""
        self._plan_reads: list[tuple[asyncio.Future[Any], contextvars.Context, Any, tuple[Any, ...]]] | None = None
        """While :meth:`_run_plan` runs a threaded engine's plan through :meth:`_execute_plan` (None otherwise): the
        real-bytes pool's copies asked meanwhile (:meth:`_beside_plan`), queued in the execute thread once
        :meth:`_execute_plan` is over (:meth:`_plan_read`, in ``_run_plan``'s ``finally``)."""
        self._step_abandoned = False
        """The step in flight was cancelled (stop) while its thread still ran: the watchdog keeps
        watching it until the thread returns (:meth:`_in_thread`)."""
        self._unannounced: m.SplitApplied | None = None
        """The last ``split.applied`` NATS refused, published again until it goes out (:meth:`_announce_applied`)."""
        self._announcing: asyncio.Task[None] | None = None
        self._aborted: OrderedDict[tuple[str, str], int] = OrderedDict()
        """Aborts of requests this node did not hold (``aborts.unknown``, ``aborts.other_router``): (rid, the
        aborting router's instance id, "" from an older sender that names none) → the attempt aborted, the newest
        :data:`ABORTED_KEPT`. Work of that router (any router's for "") of that attempt or an older one that arrives
        later is dropped (:meth:`_newest_attempt`): the abort overtook it on the bus, or came while it waited for a
        step."""
        self._stop_done = False
        """:meth:`stop` has published its last messages (:meth:`_on_hang` exits at once then)."""
        self.watchdog = StepWatchdog(cfg.watchdog_timeout_s, self._on_hang) if cfg.watchdog_timeout_s > 0 else None
        """``--watchdog-timeout-s``: ends the process when one engine step hangs (``watchdog.py``)."""

    # ------------------------------------------------------------------ #
    # lifecycle
    # ------------------------------------------------------------------ #

    async def start(self) -> None:
        """Subscribe, announce an empty KV (seq 1: AllBlocksCleared) and start the loop."""
        b, node = self.bus, self.node
        self._loop = asyncio.get_running_loop()
        await b.subscribe(WORK_PREFILL, self._on_prefill, node=node)
        # pieces of up to 8 MiB, WINDOW of them ahead from each prefill node handing off here at once: nats-py's 64 MiB
        # queue would drop some as a slow consumer (each then sent again after --handoff-chunk-timeout-s)
        await b.serve(WORK_KV, self._on_kv_chunk, node=node, pending_bytes=handoffkv.SERVE_PENDING_BYTES)
        await b.subscribe(WORK_KV_CANCEL, self._on_kv_cancel, node=node)
        await b.subscribe(WORK_DECODE, self._on_decode, node=node)
        await b.subscribe(WORK_ABORT, self._on_abort, node=node)
        await b.subscribe(SPLIT_COMMANDS, self._on_split)
        await b.subscribe(NODE_STATE, self._on_own_state, node=node)  # another process under this node id
        if self.counts_on:
            await b.subscribe(KV_COUNTS, self._on_counts, node=node)
        await b.serve(KV_RESYNC, self._on_resync, node=node)
        if self.cfg.kv_pool == "real":
            await self._start_kvpool()
        self.accepting = True
        now = self.clock.local_now()
        await self._flush_kv(now)
        await self._publish_state(now)
        for coro, name in (
            (self._run(), "loop"),
            (self._state_heartbeat(), "state"),
            (self._flush_iters_periodically(), "iters"),
            (self._fetch_split(), "split-get"),
            *(((self._check_owners(), "owners"),) if self.cfg.owner_check_interval_s > 0 else ()),
        ):
            task = asyncio.create_task(coro, name=f"worker-{node}-{name}")
            task.add_done_callback(self._task_done if name != "split-get" else self._spawned_done)
            self._tasks.append(task)
            if name == "loop":
                self._loop_task = task
        if self.watchdog is not None:
            self.watchdog.start(self._loop)  # also ends the process when a handler blocks the loop
        if self.cfg.fault_block_loop_at_s > 0:
            self._loop.call_later(self.cfg.fault_block_loop_at_s, self._block_loop_forever)
        where = {}
        if self.cfg.engine == "torch":  # the placement up chose (or the defaults), for whoever reads the log
            import torch

            where = {"device": str(getattr(self.engine, "device", "")), "torch_threads": torch.get_num_threads()}
        self.log.info("worker started", profile=self.profile.name, phase=self.core.phase, engine=self.engine.name,
                      gpu_kv_tokens=self.profile.memory.gpu_kv_tokens, host_kv_tokens=self.profile.memory.host_kv_tokens, **where)

    async def _start_kvpool(self) -> None:
        """``--kv-pool real``: a Mooncake-registered buffer mirroring L2, serving ``kv.pool.<node>``
        (``services/worker/kvpool/README.md``, "Wiring into the worker").

        Raises:
            MooncakeUnavailable / TransferError / ValueError: Mooncake missing, the engine
                failed, or the pool geometry is refused (the process exits with the message).
        """
        from services.worker.kvpool.config import parse_port_range, pool_geometry
        from services.worker.kvpool.pool import HostKvPool
        from services.worker.kvpool.transport import set_port_range

        cfg = self.cfg
        ports = parse_port_range(cfg.kv_pool_ports)
        if ports:
            set_port_range(*ports)
        page = self.engine.pool_slot_bytes()  # a real engine's pages are the payload (external)
        slots, slot_bytes = pool_geometry(self.profile, cfg.kv_pool_slot_bytes or page, cfg.kv_pool_max_bytes)
        if page and slot_bytes != page:
            raise ValueError(f"--kv-pool-slot-bytes {slot_bytes} differs from the {self.engine.name} engine's page of {page} B")
        self.kvpool = HostKvPool(
            cfg.node, self.bus, num_slots=slots, slot_bytes=slot_bytes, host=cfg.kv_pool_host, lease_s=cfg.kv_pool_lease_s,
            payload="external" if page else "synthetic",
            locate_timeout_s=cfg.kv_pool_locate_timeout_s, fetch_timeout_s=cfg.kv_pool_fetch_timeout_s,
        )  # fmt: skip
        await self.kvpool.start()
        self.log.info("real-bytes host KV pool up", session=self.kvpool.session, slots=slots, slot_bytes=slot_bytes)

    async def stop(self) -> None:
        """Stop the loop, flush iteration records, announce ``accepting=False`` and that the node's KV
        is gone (``AllBlocksCleared``, as at start): the directory drops its blocks, so a node that
        left is no longer counted in ``ei_kvdirectory_copies`` / ``blocks_indexed`` or offered in
        lookups (a SIGKILLed node cannot say so: its blocks stay until it comes back). A superseded process
        (:class:`Superseded`) announces neither: they would clear the later process's blocks."""
        self.accepting = False
        self._stopped = True
        if self._kv_timer is not None:
            self._kv_timer.cancel()
            self._kv_timer = None
        if self.watchdog is not None:
            self.watchdog.stop()
        # cancelled again until they end (shared.cancel): a task cancelled in the turn its nats-py request's reply
        # came loses that cancel (Python 3.11's wait_for; the requeue's retry loop, a bind) and goes on; one cancel
        # and an unbounded await kept the stopping worker alive (tests/unit/shared/test_stop_lost_cancel.py)
        await cancel_until_done((*self._tasks, *self._binds.values(), *self._handing_off.values(), *self._spawned))
        self._tasks.clear()
        self._binds.clear()
        self._handing_off.clear()
        self._spawned.clear()
        if self.kvpool is not None:
            await self.kvpool.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # a thread still in a forward ends with it (or the watchdog ends the process)
        try:
            await self._flush_iters()
            # a worker learns it was superseded from node.state.<n> only (_on_own_state): its bus reads no
            # heartbeats (shared.auth.BEAT_WATCHERS, 4aab717), so bus.superseded is never set for it
            if not isinstance(self.fatal_error, Superseded):  # the later process's
                await self._publish_state(self.clock.local_now())
                self.kv_seq += 1
                await self._publish_kv(self.kv_seq, [m.AllBlocksCleared()], self.clock.local_now())
            if self.watchdog is not None and (self.watchdog.fired is not None or self._step_abandoned):
                await self.bus.flush(1.0)  # the watchdog exits the process next (or may, any moment): these must be out
        except Exception as e:  # connection already gone: nothing more to say
            self.log.debug("final publish failed", error=repr(e))
        # a hang found during the stop waits for this (_on_hang): the exit comes once the last messages are out
        self._stop_done = True
        if self.watchdog is not None and self.watchdog.fired is not None:
            self.watchdog.exit_ready()

    def ready(self) -> bool:
        return self.accepting

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """Counters (requests, iterations, KV batches) and gauges (KV use, batch)."""
        st = self.core.state(self.clock.local_now())
        gauges = {
            "gpu_free_blocks": float(st.gpu_free_blocks),
            "gpu_total_blocks": float(st.gpu_total_blocks),
            "gpu_used_blocks": float(st.gpu_total_blocks - st.gpu_free_blocks),
            "host_used_blocks": float(st.host_used_blocks),
            "host_total_blocks": float(st.host_total_blocks),
            "running": float(st.running),
            "waiting": float(st.waiting),
            "decoding": float(st.decoding),
            "parked": float(len(self.core.parked)),  # prefills done, KV held, hand-off waiting for route.bind
            "epoch": float(self.epoch),
            "kv_seq": float(self.kv_seq),
        }
        gauges["fetching"] = float(self.core.fetching)
        gauges["engine.fetched_bytes"] = float(self.engine.fetched_bytes())
        gauges["counts.syncing"] = 1.0 if self.counts.syncing else 0.0
        gauges["counts.last_seq"] = float(self.counts.last)
        gauges["counts.kept"] = float(len(self.counts.kept))
        gauges["counts.kept_entries"] = float(self.counts.kept_entries)
        gauges["counts.subscribed"] = 1.0 if self.counts_on else 0.0
        gauges["switching"] = 1.0 if self._switch is not None else 0.0
        counters = dict(self.counters)
        for k, v in self.counts.counters.items():
            counters[f"counts.{k}"] = v
        counters["iterations"] = self.core.iterations
        for k, v in self.core.fetch_counters.items():
            counters[f"fetch.{k}"] = v
        for k, v in getattr(self.engine, "counters", {}).items():  # the torch engine's KV paths
            counters[f"engine.{k}"] = v
        for k, v in self._kv_in.counters.items():
            counters[f"handoff.kv.{k}"] = v
        gauges["handoff.kv_held_bytes"] = float(self._kv_in.held_bytes)
        gauges["handoff.kv_transfers"] = float(len(self._kv_in.open))
        gauges["handoff.queue_depth"] = float(len(self._kv_in.queue))
        if self.kvpool is not None:
            pc, pg = self.kvpool.stats()
            counters.update(pc)
            gauges.update(pg)
        return counters, gauges

    def _spawn(self, coro, name: str | None = None, *, fatal: bool = False) -> asyncio.Task[None]:  # type: ignore[no-untyped-def]
        """Run ``coro`` in the background (a task named ``name``); stop() cancels it. An exception
        that ends it is counted (``task_errors``) and logged with its traceback; with ``fatal``
        (a task that leaves the node half-updated when it stops midway: a fetch's bookkeeping)
        it also fails the node (:meth:`_task_done`). Returns the task."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._spawned.add(task)
        task.add_done_callback(self._task_done if fatal else self._spawned_done)
        return task

    def _spawned_done(self, t: asyncio.Task[Any]) -> None:
        """Done callback of a task whose failure leaves the node able to go on (a count sync is
        started again by the next ``kv.counts`` message; ``split.get`` as a ``split.commands``
        handler): count and log the exception that ended it, if any."""
        self._spawned.discard(t)
        if not t.cancelled() and (e := t.exception()) is not None:
            self.counters["task_errors"] += 1
            self.log.error("background task failed", task=t.get_name(), error=repr(e), exc_info=e)

    def _task_done(self, t: asyncio.Task[Any]) -> None:
        """Done callback of a task the node needs (the step loop, the state heartbeat, the
        iteration records, the owner checks, a decode binding, a real-bytes fetch): one that an
        exception ended fails the node (:meth:`_fail`). Before, such a task died silently (asyncio
        logs "Task exception was never retrieved" at best): a dead heartbeat left a busy node
        routed, a dead fetch left its request fetching forever."""
        self._spawned.discard(t)
        if not t.cancelled() and (e := t.exception()) is not None:
            self.counters["task_errors"] += 1
            self._fail(e, f"task {t.get_name()}")

    # ------------------------------------------------------------------ #
    # handlers
    # ------------------------------------------------------------------ #

    async def _on_prefill(self, work: m.PrefillWork, _subject: str) -> None:
        self.counters["requests.received"] += 1
        self.counters["requests.received.prefill"] += 1
        if not self._valid_rid(work.rid) or self._superseded(work.rid):
            return
        now = self.clock.local_now()
        if not await self._newest_attempt(work.rid, work.attempt, work.router, now):
            return
        now = self.clock.local_now()  # it may have waited for a step (_newest_attempt)
        # decode node bound when the prefill starts (paper D.1), on a prefill-only node
        late = work.decode_binding == "start" and work.decode_node is None and self.core.phase == "prefill"
        # routed as collocated work (decode here) while this node served both phases; it now serves
        # prefill only (a switch from collocated to PD, e.g. at the end of the planner's warm-up)
        collocated_late = self.core.phase == "prefill" and work.decode_node in (None, self.node) and not late
        if self.accepting and (self._switch is not None or self.core.phase == "decode" or collocated_late) and work.rid not in self.core.requests:
            # arrived after this node stopped serving it (switch race): the router re-routes it
            why = ("draining for a phase switch" if self._switch is not None
                   else "serves decode" if self.core.phase == "decode" else "serves prefill only")
            await self._hand_back(m.WorkRequeue(rid=work.rid, node=self.node, reason=f"node {self.node} {why}", prefill=work))
            return
        try:
            if not self.accepting:
                raise WorkRejected(work.rid, f"node {self.node} is shutting down")
            if work.decode_node is not None:
                try:
                    check_token(work.decode_node, "decode_node")
                except ValueError as e:
                    raise WorkRejected(work.rid, str(e)) from None
            self._accept(self.engine.accept_prefill, work)
            with self._fatal_on_error("add prefill work", allowed=(WorkRejected,)):
                self.core.add_prefill(work, now, decode_later=late)
        except WorkRejected as e:
            await self._reject(e, now, attempt=work.attempt, router=work.router)
            return
        self._owners[work.rid] = _Owner(work.attempt, work.output_offset, work.router, arrived_at=now)
        if self.cfg.log_requests:
            self.log.info(
                "request received", rid=work.rid, role="prefill", fence=work.attempt, output_offset=work.output_offset,
                prompt_tokens=work.prompt_tokens, max_tokens=work.max_tokens, decode=work.decode_node, router=work.router,
            )  # fmt: skip
        if late and work.max_tokens > 1:  # a one-token request ends at its prefill: nothing to bind
            self._bind_later[work.rid] = work
        if tracing.ENABLED:
            self._traces.arrived(work.rid, decode=False)
        self._start_transfers()
        self._input()

    async def _on_decode(self, work: m.DecodeWork, _subject: str) -> None:
        self.counters["requests.received"] += 1
        self.counters["requests.received.decode"] += 1
        if not self._valid_rid(work.rid) or self._superseded(work.rid):
            if work.kv_transfer:  # not served here: its K/V is not kept until the timeout (L3)
                self._kv_in.discard(work.kv_transfer)
            return
        now = self.clock.local_now()
        if not await self._newest_attempt(work.rid, work.attempt, work.router, now):
            if work.kv_transfer:  # not served here: its K/V is not kept until the timeout
                self._kv_in.discard(work.kv_transfer)
            return
        now = self.clock.local_now()  # it may have waited for a step (_newest_attempt)
        pieces, kv_lost = work.kv_chunks, ""
        if work.kv_transfer:  # its K/V came ahead in pieces (work.<node>.kv, handoffkv.py): every one was answered
            try:
                kv = self._kv_in.take(work.kv_transfer, work.rid, work.kv_chunks, work.kv_bytes)
            except handoffkv.KvMissing as e:
                if e.duplicate:  # the same work again (counted handoff.kv.duplicate_work): it was served already
                    self.log.info("hand-off work came again: dropped", rid=work.rid, transfer=work.kv_transfer)
                    return
                kv_lost = f"its K/V ({work.kv_bytes} B in {work.kv_chunks} pieces from {work.prefill_node or 'its prefill node'}) is not all here: {e}"
                if e.unknown:  # every piece was answered (the work follows the last answer), by an earlier process?
                    kv_lost += (f"; this process of node {self.node} started {time.monotonic() - self._started_mono:.1f} s ago: a "
                                f"decode node restarted after its pieces were answered loses them (the request must be sent again)")  # fmt: skip
            else:
                work = msgspec.structs.replace(work, kv=kv, kv_transfer="", kv_chunks=0)
        if self.accepting and self.core.phase == "prefill" and work.rid not in self.core.requests:
            # bound here while this node served decode; it has switched since: the KV goes to
            # another decode node instead (transfer restarts now), through the router (work.requeue: the K/V inline)
            inline = len(work.kv) + len(work.token_ids) + 10 * (len(work.block_hashes) + len(work.output_ids)) + handoffkv.ENVELOPE_BYTES
            if kv_lost or inline > self.bus.max_payload:
                self.counters["requeue.decode_refused"] += 1
                why = kv_lost or (f"{len(work.kv)} B of K/V cannot go back through the router in one message (NATS max_payload "
                                  f"{self.bus.max_payload} B)")  # fmt: skip
                await self._reject(WorkRejected(work.rid, f"node {self.node} serves prefill now and cannot hand the decode back: {why}"),
                                   now, attempt=work.attempt, router=work.router)  # fmt: skip
                return
            moved = msgspec.structs.replace(work, kv_ready_at=self._to_wall(now + self.profile.kv_transfer_s(work.prompt_tokens)))
            await self._hand_back(m.WorkRequeue(rid=work.rid, node=self.node, reason=f"node {self.node} serves prefill", decode=moved))
            return
        # the prefill node's kv_ready_at is on the wall-based cluster clock: the core waits for it
        # on this node's local one (a step of the wall clock meanwhile neither stalls nor hurries it)
        work = msgspec.structs.replace(work, kv_ready_at=self._to_local(work.kv_ready_at))
        latest = kv_ready_bound(now, self.profile.kv_transfer_s(work.prompt_tokens), self.clock.speedup)
        if work.kv_ready_at > latest:
            # a hand-off's KV arrives within its transfer time: a later kv_ready_at would hold
            # the reservation (L1 blocks) idle for that long
            self.counters["decode.kv_ready_clamped"] += 1
            work = msgspec.structs.replace(work, kv_ready_at=latest)
        try:
            if not self.accepting:
                raise WorkRejected(work.rid, f"node {self.node} is shutting down")
            if kv_lost:
                self.counters["handoff.kv_lost"] += 1
                raise WorkRejected(work.rid, f"hand-off lost on node {self.node}: {kv_lost}")
            self._accept(self.engine.accept_decode, work)
            with self._fatal_on_error("add decode work", allowed=(WorkRejected,)):
                self.core.add_decode(work, now)
        except WorkRejected as e:
            await self._reject(e, now, attempt=work.attempt, router=work.router)
            return
        self.counters["handoff.received"] += 1
        self.counters["handoff.received_bytes"] += len(work.kv)
        self.counters["handoff.received_chunks"] += pieces
        self._owners[work.rid] = _Owner(work.attempt, work.output_offset, work.router)
        if self.cfg.log_requests:
            self.log.info(
                "request received", rid=work.rid, role="decode", fence=work.attempt, output_offset=work.output_offset,
                prompt_tokens=work.prompt_tokens, max_tokens=work.max_tokens, prefill=work.prefill_node, router=work.router,
                kv_bytes=len(work.kv), kv_chunks=pieces,
            )  # fmt: skip
        if tracing.ENABLED:
            self._traces.arrived(work.rid, decode=True)
        await self._flush_kv(now)  # a reservation may have evicted blocks
        self._input()

    async def _on_kv_chunk(self, c: m.KvChunk, _subject: str) -> m.KvChunkAck | None:
        """``work.<node>.kv``: store a piece of a hand-off's K/V (``handoffkv.KvAssembler.add``) and answer it: ``error``
        "" (stored, or held already), or why it is refused (the prefill node fails the hand-off with it, but for
        ``full``: with ``queued``, the transfer's place in the queue for room, first come first served, which it
        waits in; without, a backoff). With ``--log-requests`` a transfer let in from the queue logs its ticket number
        and wait. A superseded process answers nothing (the later one, which gets every piece too, answers)."""
        if self._superseded(c.rid):
            return None
        now = time.monotonic()
        self._expire_kv(now)
        if self._stopped:
            self.counters["handoff.kv.refused.stopping"] += 1
            error = f"node {self.node} is shutting down"
        elif (
            self.core.phase == "prefill"
            and c.transfer not in self._kv_in.open
            and c.total + handoffkv.ENVELOPE_BYTES > self.bus.max_payload
        ):
            # its work would go back through the router with the K/V inline (_on_decode), and cannot: refused now,
            # not held until its work fails
            self.counters["handoff.kv.refused.prefill"] += 1
            error = (f"node {self.node} serves prefill now: a hand-off's {c.total} B of K/V cannot go back through the "
                     f"router in one message (NATS max_payload {self.bus.max_payload} B)")  # fmt: skip
            self._kv_in.refuse(c.transfer, error)
        else:
            error = self._kv_in.add(c, now)
            t = self._kv_in.last_admitted
            if t is not None:  # admitted after waiting its turn (first come, first served)
                self._kv_in.last_admitted = None
                if self.cfg.log_requests:
                    self.log.info("hand-off K/V admitted from the queue", rid=t.rid, transfer=t.transfer, prefill=t.src,
                                  ticket=t.seq, waited_s=round(now - t.first, 3), asks=t.asks, kv_total=t.total)  # fmt: skip
        full = error.startswith(handoffkv.FULL_PREFIX)
        queued = self._kv_in.place(c.transfer, now) if full else 0
        if error:
            self._kv_log.event("handoff_kv_refused", "hand-off K/V piece refused", rid=c.rid, transfer=c.transfer, piece=c.index,
                               pieces=c.count, prefill=c.src, error=error, full=full, queued=queued)  # fmt: skip
        self._arm_kv_timer()
        return m.KvChunkAck(transfer=c.transfer, index=c.index, error=error, full=full, queued=queued)

    async def _on_kv_cancel(self, msg: m.KvCancel, _subject: str) -> None:
        """``work.<node>.kvcancel``: the prefill node gave the hand-off of ``msg.transfer`` up (a piece refused or
        unanswered, its work refused by the bus, it stopped): its K/V is freed now (``handoff.kv.cancelled``), not
        after ``--handoff-piece-idle-s`` / ``--handoff-kv-timeout-s``; a late piece or work of it is refused naming
        the cancel. A cancel of a transfer not held (taken, never started here) changes nothing."""
        if self._superseded(msg.rid):
            return
        a = self._kv_in.cancel(msg.transfer, msg.rid, msg.reason)
        if a is not None:
            self._kv_log.event("handoff_kv_cancelled", "hand-off K/V freed: its sender gave it up", level="info", rid=a.rid, transfer=a.transfer,
                               prefill=a.src, pieces_in=a.got, pieces=a.count, kv_bytes=a.stored, reason=msg.reason)  # fmt: skip
            self._arm_kv_timer()

    def _discard_kv(self, why: str, keep: Callable[[handoffkv.Assembly], bool]) -> int:
        """Drop every hand-off K/V held whose work will not be served here (``keep`` false: an abort of its rid, a
        switch to prefill), counted ``handoff.kv.discarded`` and logged; returns how many."""
        gone = [a for a in self._kv_in.open.values() if not keep(a)]
        for a in gone:
            self._kv_in.discard(a.transfer, why)
            self._kv_log.event("handoff_kv_discarded", "hand-off K/V freed: its work will not be served here", level="info", rid=a.rid,
                               transfer=a.transfer, prefill=a.src, pieces_in=a.got, pieces=a.count, kv_bytes=a.stored, why=why)  # fmt: skip
        if gone:
            self._arm_kv_timer()
        return len(gone)

    def _arm_kv_timer(self) -> None:
        """Wake :meth:`_expire_kv` at the K/V assembler's next deadline (none while it holds no transfer)."""
        due = self._kv_in.next_deadline()
        timer = self._kv_timer
        if timer is not None and (due is None or self._kv_due > due):
            timer.cancel()
            self._kv_timer = timer = None
        if due is None or timer is not None:
            return
        self._kv_due = due
        self._kv_timer = asyncio.get_running_loop().call_later(max(0.0, due - time.monotonic()) + 0.01, self._kv_timer_fired)

    def _kv_timer_fired(self) -> None:
        self._kv_timer = None
        self._expire_kv(time.monotonic())
        self._arm_kv_timer()

    def _expire_kv(self, now: float) -> None:
        """Drop the hand-off K/V held past ``--handoff-piece-idle-s`` without a newly stored piece (incomplete) or
        ``--handoff-kv-timeout-s`` without its work (complete) (``now``: monotonic s); each one counted
        (``handoff.kv.expired``) and logged with the bytes it had stored (``kv_bytes``) of its total (``kv_total``).
        Its work, if it comes later, fails the request."""
        for a in self._kv_in.expire(now):
            self._kv_log.event(
                "handoff_kv_expired", "hand-off K/V dropped: no piece or work came in time", rid=a.rid, transfer=a.transfer,
                prefill=a.src, pieces_in=a.got, pieces=a.count, kv_bytes=a.stored, kv_total=a.total, refused_full=a.refused_full,
                timeout_s=self.cfg.handoff_kv_timeout_s if a.complete else self.cfg.handoff_piece_idle_s,
            )  # fmt: skip

    def _accept(self, hook: Any, work: m.PrefillWork | m.DecodeWork) -> None:
        """Run the engine's ``accept_prefill`` / ``accept_decode`` ``hook`` on ``work``.

        The hook only checks the work and registers it last (``Engine.accept_prefill``: an engine
        that raises has not changed), and the core has not taken the work yet, so any exception
        concerns this request alone: it is refused with the error (the client gets it), and the
        node serves on. An unexpected one is counted (``requests.accept_errors``) and logged with
        its traceback. Before, an exception other than ``ValueError`` escaped to the bus handler:
        the request was dropped with no answer, and its client waited for its timeout. An
        ``EngineFatal`` is not the request's: a threaded engine applies a KV event batch given while
        a plan held its lock at its next call (``TorchEngine.on_kv_events``), and that batch failed;
        the node fails (:meth:`_fail`), as at a batch applied at once.

        Raises:
            WorkRejected: the hook refused the work (``ValueError``) or failed.
        """
        try:
            hook(work)
        except ValueError as e:
            raise WorkRejected(work.rid, str(e)) from None
        except EngineFatal as e:  # a threaded engine's deferred KV batch failed (TorchEngine._run_deferred): its KV is wrong
            self._fail(e, "engine KV events")
            raise WorkRejected(work.rid, f"node {self.node} failed: {e!r}") from None
        except Exception as e:
            self.counters["requests.accept_errors"] += 1
            self.log.error("engine failed to accept work: request refused", rid=work.rid, error=repr(e), exc_info=e)
            raise WorkRejected(work.rid, f"the {self.engine.name} engine failed to accept the work: {e!r}") from None

    async def _newest_attempt(self, rid: str, attempt: int, router: str, now: float) -> bool:
        """Fencing: True if work of ``attempt`` sent by router ``router`` (``PrefillWork.router``) may be served
        here. Of one router's, an older attempt than the one this node holds is dropped (counted); a newer one
        replaces the held one (the router re-dispatched the request after fencing this node, and dispatched it here
        again). Attempts are each router's own (its wall clock in ms), so work for the id of another router's request
        held here (one ``X-Request-ID`` placed by two routers at once) is decided as the routers decide it
        (``RouterService._placed_twice``): the router whose instance id sorts first keeps it. The other's work is
        refused, or the other's held request dropped, with an ``abort`` chunk naming that router
        (``TokenChunk.router``), so that router ends its side (counted ``requests.duplicate_rid_refused`` /
        ``requests.duplicate_rid_dropped``). Before, a higher attempt from the other router silently replaced the
        held request, whose client then waited for its timeout.

        Returns only once no engine step in flight runs ``rid`` (counted ``requests.waited_for_step``;
        the old attempt is aborted in the core first, so no later plan takes it, and the step loop is
        woken, so a sim engine's folded plan ends at its next iteration boundary): the engine keeps
        one registration per rid, and the new work's (``accept_prefill`` / ``accept_decode``, next)
        replaced the old attempt's while a plan that ``schedule()`` had taken, but whose execute
        thread had not yet taken the engine's lock, still ran it; the plan then computed the old
        chunk into the new registration and the node failed (``KvMapError``) at the new attempt's
        first chunk. A hand-off that :meth:`_bind` publishes (the binding came after the prefill
        finished) is waited for the same way (``requests.waited_for_handoff``). The fencing is
        decided again after the wait (another attempt may have come), and
        work whose attempt an abort the node did not hold has already ended is dropped (``_aborted``,
        ``requests.aborted_before_arrival``)."""
        mine = _Owner(router=router).router_id
        ended: asyncio.Task[None] | None = None  # a hand-off task seen done and still registered
        while True:
            held = self._owners.get(rid)
            if held is not None and rid in self.core.requests and held.router_id != mine:
                why = (f"X-Request-ID {rid} in flight on node {self.node} for router {min(mine, held.router_id)} too "
                       f"(placed by two routers at once); router {max(mine, held.router_id)} gave way")  # fmt: skip
                self.log.warning("request id placed by two routers at once", rid=rid, held=held.router_id, router=mine)
                if mine > held.router_id:
                    self.counters["requests.duplicate_rid_refused"] += 1
                    await self._publish_end(rid, "abort", why, now, attempt=attempt, router=router)
                    return False
                self.counters["requests.duplicate_rid_dropped"] += 1
                await self._drop(rid, why)
                now = self.clock.local_now()
                continue
            if held is not None and rid in self.core.requests:
                if attempt <= held.attempt:
                    self.counters["requests.stale_attempt"] += 1
                    self.log.info("work of an old attempt dropped", rid=rid, attempt=attempt, held=held.attempt)
                    return False
                self._forget(rid)
                with self._fatal_on_error("abort a superseded attempt"):
                    self.core.abort(rid, now)
                self.counters["requests.superseded"] += 1
            if rid not in self._step_rids:
                handing = self._handing_off.get(rid)
                if handing is not None and handing.done() and handing is ended:
                    # done and still registered after its done callbacks had their turn: its bookkeeping never ran (as
                    # a task cancelled before its first step left it before _delivery_ended). Waiting on it returns at
                    # once: the loop went round for good and the subscription's later work queued behind it
                    self.counters["handoff.stale_entries"] += 1
                    self.log.error("a finished hand-off was still registered; dropped so new work of its request goes on",
                                   rid=rid, task=handing.get_name(), attempt=attempt)  # fmt: skip
                    del self._handing_off[rid]
                    continue
                if handing is not None:  # its hand-off is going out (bound after its prefill: _bind), as a step's would
                    ended = handing if handing.done() else None
                    self.counters["requests.waited_for_handoff"] += 1
                    await self._wait_noted(handing, rid, attempt, "its previous attempt's hand-off", handing)
                    now = self.clock.local_now()
                    continue
                aborted = max(self._aborted.get((rid, mine), -1), self._aborted.get((rid, ""), -1))
                if attempt <= aborted:
                    # aborted before it was taken: before, it then ran to its last token for nobody
                    self.counters["requests.aborted_before_arrival"] += 1
                    self.log.info("work of an aborted attempt dropped", rid=rid, attempt=attempt, aborted=aborted)
                    return False
                return True
            self.counters["requests.waited_for_step"] += 1
            # wake the step loop, as any new work does: a sim engine's folded plan is cut at its
            # next iteration boundary (_wait_for_plan_end). Before, the work waited out the whole
            # plan: up to fold_wall_s of wall time, × speedup in simulated time.
            self._input()
            while rid in self._step_rids:
                over = asyncio.ensure_future(self._step_over.wait())
                try:
                    await self._wait_noted(over, rid, attempt, f"engine step {self._steps}", self._loop_task)
                finally:
                    over.cancel()
            now = self.clock.local_now()

    async def _wait_noted(self, fut: asyncio.Future[Any], rid: str, attempt: int, what: str,
                          holder: asyncio.Future[Any] | None) -> None:
        """Wait for ``fut`` (not cancelled here) on behalf of new work (``rid``, ``attempt``) held back by ``what``;
        past :data:`PREVIOUS_WAIT_NOTE_S` wall s the wait is logged at warning once, with the step's requests and
        where ``holder`` (the step loop's task, or the hand-off's) waits (:func:`await_chain`; counted
        ``requests.waited_long``), then waited out."""
        t0 = time.monotonic()
        done, _ = await asyncio.wait({fut}, timeout=PREVIOUS_WAIT_NOTE_S)
        if done:
            return
        self.counters["requests.waited_long"] += 1
        self.log.warning(
            "new work waits long for its request's previous attempt on this node; later work of its subscription waits behind it",
            rid=rid, attempt=attempt, waits_for=what, waited_s=round(time.monotonic() - t0, 3),
            step_rids=sorted(self._step_rids)[:16], awaiting=await_chain(holder),
        )  # fmt: skip
        await asyncio.wait({fut})

    def _forget(self, rid: str) -> None:
        """Drop this shell's per-request state of ``rid`` (binding, stream, owner)."""
        self._bind_later.pop(rid, None)
        bind = self._binds.pop(rid, None)
        if bind is not None:
            bind.cancel()
        self._streams.pop(rid, None)
        self._owners.pop(rid, None)

    def _superseded(self, rid: str) -> bool:
        """This process was superseded (:class:`Superseded`): work for the node (delivered to both processes) is
        the later one's, so it is dropped unanswered here: a rejection would fail the request the other serves.
        Only :meth:`_on_own_state` finds that out (the bus's heartbeat check is not a worker's, ``BEAT_WATCHERS``)."""
        if not isinstance(self.fatal_error, Superseded):
            return False
        self.counters["work.superseded"] += 1
        return True

    async def _on_own_state(self, msg: m.NodeState, _subject: str) -> None:
        """A ``node.state`` under this node id: from another process that started later, this one is superseded
        (it was restarted while frozen, then resumed): it stops serving and exits (:meth:`_fail`), so the node's
        work, KV events and states come from one process. One that started earlier is left to stop itself."""
        if msg.boot != self.boot and m.boot_older(self.boot, msg.boot):
            self.counters["superseded"] += 1
            self._fail(Superseded(f"another process announces node {self.node} and started later (boot {msg.boot}; "
                                  f"this one {self.boot})"), "node.state")  # fmt: skip

    async def _on_abort(self, msg: m.RequestAbort, _subject: str) -> None:
        """``work.<node>.abort``: drop ``msg.rid`` if this node holds it at ``msg.attempt`` or an older attempt, of
        the router that sent the abort (``RequestAbort.router``; "" from an older sender: any router's). An abort
        from another router than the held request's owner (one id placed by two routers at once: the one that gave
        way tells its nodes to drop its request) leaves it alone (``aborts.other_router``); before, it ended the
        other router's request (a 503 to its client). Unheld: remembered, so that its work, if it comes later,
        is dropped (``_aborted``)."""
        held = self._owners.get(msg.rid)
        sender = _Owner(router=msg.router).router_id if msg.router else ""
        if held is not None and sender and sender != held.router_id:
            self.counters["aborts.other_router"] += 1
            self.log.info("abort from a router that does not own the request ignored", rid=msg.rid, router=sender,
                          owner=held.router_id)  # fmt: skip
            self._remember_abort(msg.rid, sender, msg.attempt)
            return
        if held is not None and held.attempt > msg.attempt:
            self.counters["aborts.stale_attempt"] += 1  # aimed at an attempt this node no longer holds
            return
        def other(a: handoffkv.Assembly | handoffkv.Ticket) -> bool:
            return not (a.rid == msg.rid and a.attempt <= msg.attempt and (not sender or _Owner(router=a.router).router_id == sender))

        why = f"its request was aborted ({msg.reason})" if msg.reason else "its request was aborted"
        if self._kv_in.open:
            # hand-off K/V of that attempt (or an older one) of that router's request, its work not come yet: the
            # work will be dropped (_aborted), so the K/V goes now (before, it was held --handoff-kv-timeout-s)
            self._discard_kv(why, other)
        if self._kv_in.queue and self._kv_in.tickets(other, why):
            # and its place in the queue for room (before, it was admitted ahead of live hand-offs: review 55)
            self._arm_kv_timer()
        delivery = self._handing_off.get(msg.rid)
        if held is not None and (delivery in self._deliveries or msg.rid in self._bound_sends):
            # its hand-off is going out from here (a step's beside the step loop, or after its binding): stopped, and
            # its K/V freed on the decode node (_send_kv's KvCancel drops its ticket there too). Before, it went on
            # waiting in the decode node's queue up to --handoff-queue-wait-s and was admitted ahead of live ones
            assert delivery is not None
            delivery.cancel()
            self.counters["handoff.aborted"] += 1
        if not await self._drop(msg.rid, msg.reason, attempt=msg.attempt, router=msg.router):
            self.counters["aborts.unknown"] += 1
            # its work may still come (behind a wait for a step, or overtaken on the bus): dropped then
            self._remember_abort(msg.rid, sender, msg.attempt)
            return
        self.counters["requests.aborted"] += 1

    def _remember_abort(self, rid: str, router: str, attempt: int) -> None:
        """Remember an abort of ``rid`` by ``router`` ("" = unnamed) at ``attempt`` this node did not act on
        (``_aborted``, the newest :data:`ABORTED_KEPT`)."""
        key = (rid, router)
        self._aborted[key] = max(attempt, self._aborted.pop(key, attempt))
        if len(self._aborted) > ABORTED_KEPT:
            self._aborted.popitem(last=False)

    async def _drop(self, rid: str, reason: str, *, attempt: int = 0, router: str = "") -> bool:
        """Drop ``rid`` wherever it is on this node, free its KV, and end its stream with an
        ``abort`` chunk (so every router's count of it ends). False if the node does not hold it.
        ``attempt``, ``router``: the attempt and owner to stamp when the node has no owner record of it."""
        now = self.clock.local_now()
        owner = self._owners.pop(rid, None) or _Owner(attempt=attempt, router=router)
        self._bind_later.pop(rid, None)
        if self._traces:
            self._traces.forget(rid, "aborted", reason)
        bind = self._binds.pop(rid, None)
        if bind is not None:
            bind.cancel()
        with self._fatal_on_error("abort"):
            held_here = self.core.abort(rid, now)
        if not held_here:
            return False
        if self.cfg.log_requests:
            self.log.info("request aborted", rid=rid, reason=reason)
        st = self._streams.pop(rid, None)
        if self._valid_rid(rid):
            await self.bus.publish(
                REQ_OUT,
                m.TokenChunk(
                    rid=rid,
                    node=self.node,
                    index=owner.offset + (st.start if st else 0),
                    finished=True,
                    finish_reason="abort",
                    error=reason or None,
                    ts=self._to_wall(now),
                    attempt=owner.attempt,
                    router=owner.router,
                ),
                rid=rid,
                node=self.node,
            )
        self._input()  # freed KV may admit waiting work; a drain may be over
        return True

    async def _check_owners(self) -> None:
        """Every ``owner_check_interval_s``: ask each owning router (``route.held.<router>``) which of
        the requests held here it no longer has in flight, and drop those; drop every request of a
        router nobody has answered for ``owner_gone_after_s`` (``owners.py``). In between, every
        ``min(interval, SILENT_RETRY_S)``, ask again only the routers that answered "no responders"
        (missing: SIGKILLed, restarting), so a restarted one's answer comes right after it subscribes.
        A re-ask about requests answered "not in flight" comes :data:`OWNER_RECHECK_S` after that answer, and
        no sooner than ``min(interval, SILENT_RETRY_S)`` after the previous check ended: a re-ask that got no
        verdict (the router gone since, NATS down) leaves that time in the past, and the loop then ran back to
        back (thousands of asks a second) until ``--owner-gone-after-s``."""
        interval = self.cfg.owner_check_interval_s
        retry = min(interval, SILENT_RETRY_S)
        next_full = time.monotonic() + interval
        recheck_floor = 0.0  # monotonic s: no "not in flight" re-ask before it
        while True:
            now = time.monotonic()
            wake = min(next_full, now + retry) if self._leases.silent() else next_full
            if self._not_in_flight:  # re-ask about those answered "not in flight" once OWNER_RECHECK_S has passed
                due = min(t for _, _, t in self._not_in_flight.values()) + OWNER_RECHECK_S
                wake = min(wake, max(due, recheck_floor))
            await asyncio.sleep(max(0.0, wake - now))
            only: set[str] | None = None
            if time.monotonic() >= next_full:
                next_full = time.monotonic() + interval
            else:
                only = set(self._leases.silent()) | {r for _, r, _ in self._not_in_flight.values()}
            try:
                await self._check_owners_once(only)
            except Exception as e:  # never let a bad reply stop the checks
                self.counters["owners.check_errors"] += 1
                self.log.warning("owner check failed", error=repr(e))
            recheck_floor = time.monotonic() + retry

    async def _check_owners_once(self, only: set[str] | None = None) -> None:
        """One owner check; ``only``: ask just these routers (a re-ask of missing ones), None = all."""
        held = [(rid, o.router_id, o.attempt) for rid, o in self._owners.items() if rid in self.core.requests]
        self._leases.forget(r for _, r, _ in held)
        for rid, (attempt, router, _) in list(self._not_in_flight.items()):
            o = self._owners.get(rid)
            if o is None or o.attempt != attempt or o.router_id != router:  # ended (its abort came), or replaced
                del self._not_in_flight[rid]
        if only is not None:
            held = [h for h in held if h[1] in only]
        for router, rids, attempts in OwnerLeases.queries(held):
            if not self.bus.nc.is_connected:
                return
            timeout = max(0.05, min(2.0, self.cfg.owner_check_interval_s))
            sent = time.monotonic()
            try:
                rep = await self.bus.request(ROUTE_HELD, m.HeldQuery(node=self.node, rids=rids, attempts=attempts), timeout=timeout, router=router)
            except BusError as e:
                if not isinstance(e, NoResponders):
                    self.counters["owners.no_answer"] += 1  # a timeout decides nothing: kept
                    if self.bus.nc.is_connected:  # it reached the router's subscription: not "no responders in a row"
                        self._leases.subscribed(router)
                    continue
                self.counters["owners.no_responders"] += 1
                if not self._leases.no_responders(router, time.monotonic()):
                    continue
                gone = [(rid, a) for rid, a in zip(rids, attempts)]
                why = f"owning router {router} is gone (nobody served route.held.{router} for {self.cfg.owner_gone_after_s:g} s)"
                kind = "router_gone"
                self.counters["owners.router_gone"] += 1
            else:
                self._leases.answered(router)
                gone = self._not_in_flight_twice(router, rids, attempts, rep.dropped, sent)
                why = f"router {router} no longer has the request in flight"
                kind = "not_in_flight"
            dropped: list[tuple[str, int, int]] = []
            for rid, attempt in gone:
                o = self._owners.get(rid)
                if o is None or o.attempt != attempt or o.router_id != router:
                    continue  # finished, aborted or replaced since the query
                self._not_in_flight.pop(rid, None)
                r = self.core.requests.get(rid)
                done = o.offset + (r.generated if r is not None else 0)  # read before the drop forgets it; a
                # re-dispatched request's output before this node too (the abort chunk's index counts it so)
                if await self._drop(rid, why):
                    self.counters["owners.dropped"] += 1
                    self.counters[f"owners.dropped.{kind}"] += 1
                    dropped.append((rid, attempt, done))
            self._log_owner_drops(router, kind, why, dropped)

    def _not_in_flight_twice(self, router: str, rids: list[str], attempts: list[int], dropped: list[str],
                             sent: float) -> list[tuple[str, int]]:
        """``(rid, attempt)`` of a ``route.held`` answer of ``router`` (``dropped``, to the query of ``rids`` at
        ``attempts`` sent at monotonic ``sent``) to drop now: those answered "not in flight" already by an answer
        that came :data:`OWNER_RECHECK_S` or more before ``sent``. The others answered so are remembered
        (:attr:`_not_in_flight`), and those the router has in flight forgotten: a router's answer may overtake the
        abort it publishes when it ends a request itself (:data:`OWNER_RECHECK_S`), which ends the request first."""
        asked = dict(zip(rids, attempts))
        now = time.monotonic()
        out: list[tuple[str, int]] = []
        for rid in dropped:
            if rid not in asked:
                continue
            seen = self._not_in_flight.get(rid)
            if seen is not None and seen[:2] == (asked[rid], router):
                if sent - seen[2] >= OWNER_RECHECK_S:
                    out.append((rid, asked[rid]))
            else:
                self._not_in_flight[rid] = (asked[rid], router, now)
        for rid in asked.keys() - set(dropped):
            self._not_in_flight.pop(rid, None)
        return out

    def _log_owner_drops(self, router: str, kind: str, why: str, dropped: list[tuple[str, int, int]]) -> None:
        """One warning per request an owner check dropped (``dropped``: ``(rid, attempt, output tokens done)``), so a
        stream lost with its router (SIGKILL, OOM: its client's connection broke, and a restarted router's counters
        start at 0) leaves its request id in a log; past :data:`OWNER_DROP_LOG_EACH` of one check and router, one
        summary warning for the rest (their count, their first :data:`OWNER_DROP_LOG_RIDS` ids). ``kind``:
        ``router_gone`` (nobody served ``route.held.<router>`` for ``--owner-gone-after-s``) or ``not_in_flight``
        (the router, or the one restarted under its id, answered that it no longer has the request)."""
        for rid, attempt, done in dropped[:OWNER_DROP_LOG_EACH]:
            self.log.warning("request dropped: its owning router no longer wants it (its stream is lost)", rid=rid,
                             router=router, attempt=attempt, tokens_done=done, cause=kind, reason=why)  # fmt: skip
        rest = dropped[OWNER_DROP_LOG_EACH:]
        if rest:
            self.log.warning(
                "more requests dropped: their owning router no longer wants them (their streams are lost)", router=router,
                requests=len(rest), cause=kind, reason=why, rids=[rid for rid, _, _ in rest[:OWNER_DROP_LOG_RIDS]],
                tokens_done=sum(d for _, _, d in rest),
            )  # fmt: skip

    # ------------------------------------------------------------------ #
    # in-place phase switch
    # ------------------------------------------------------------------ #

    async def _fetch_split(self) -> None:
        """Ask the planner for the current split at start (``split.get``), so a worker that
        (re)starts serves its node's phase in the split at once, not its ``--phase`` until the
        planner's next announcement (every ``announce_interval_s``, 5 s by default): a worker
        restarted after a crash comes back in the phase the planner has moved it to since. Tries
        every 0.5 s (1-s timeout each) for ``split_get_timeout_s`` (:meth:`Bus.request_until`, the
        router's loop too); without a planner it gives up
        with one log line and serves ``--phase``. The reply is applied as a ``split.commands``."""
        if self.cfg.split_get_timeout_s <= 0:
            return
        cmd, _, err = await self.bus.request_until(SPLIT_GET, m.SplitQuery(), deadline_s=self.cfg.split_get_timeout_s)
        if cmd is None:
            self.log.info("planner did not answer split.get; serving --phase until a split.commands arrives",
                          phase=self.core.phase, waited_s=self.cfg.split_get_timeout_s, error=str(err))
            return
        self.counters["split.get_answered"] += 1
        await self._on_split(cmd, "split.get")

    async def _on_split(self, cmd: m.SplitCommand, _subject: str) -> None:
        if cmd.epoch <= self.epoch:
            self.counters["split.ignored"] += 1
            return
        if not epoch_step_ok(self.epoch, cmd.epoch):
            self.counters["split.epoch_jump_refused"] += 1
            self.bus.droplog.event("split.epoch_jump", "split command with a forged epoch jump refused", epoch=cmd.epoch, current=self.epoch)
            return
        self.epoch = cmd.epoch
        phase = cmd.phases.get(self.node)
        if phase is None:
            return
        now = self.clock.local_now()
        wall = self._to_wall(now)  # the switch's times: compared with the planner's decided_at
        sw = self._switch
        if sw is not None:
            if phase == sw.target:
                sw.epoch = cmd.epoch
                return
            if phase == self.core.phase:  # reversed before the drain ended: serve the old phase again
                self.counters["split.cancelled"] += 1
                self._switch = None
                sw.epoch, sw.target = cmd.epoch, phase
                await self._serving(sw, now)
                return
            sw.epoch, sw.target, sw.decided_at = cmd.epoch, phase, cmd.decided_at
            sw.since = max(self._to_local(cmd.decided_at), self._started_local)
            self.counters["split.retargeted"] += 1
            self._input()
            return
        if phase == self.core.phase:
            await self._announce_applied(
                m.SplitApplied(epoch=cmd.epoch, node=self.node, phase=phase, status="serving", decided_at=cmd.decided_at,
                               applied_at=wall, received_at=wall, drained_at=wall)
            )  # fmt: skip
            return
        sw = _Switch(epoch=cmd.epoch, target=phase, decided_at=cmd.decided_at, received_at=now,
                     since=max(self._to_local(cmd.decided_at), self._started_local))
        self.counters["split.switches"] += 1
        if not _drain_needed(self.core.phase, phase) or (self.core.idle and not self._handing_off and not self._sending_handoffs):
            # nothing to drain (a parked prefill's hand-off going out is not in the core any more, but it is this
            # phase's work: the drain waits for it, as _maybe_switch does; before, 'serving' went out meanwhile;
            # so is a step's hand-off, awaited in the execute thread since 4b7ea0a)
            sw.drained_at = now
            await self._serving(sw, now)
            return
        self._switch = sw
        with self._fatal_on_error("switch: take the queued work"):
            queued = self.core.take_queued(now)
        sw.requeued = len(queued)
        for w in queued:
            self._bind_later.pop(w.rid, None)
        self.log.info("switch started: draining", target=phase, epoch=cmd.epoch, requeued=len(queued), running=len(self.core.running))
        # The core no longer holds the queued work: from here every request taken is handed back
        # (or failed with an error chunk, _hand_back), whatever becomes of the two announcements. A
        # publish NATS refuses (a full reconnect buffer) is logged and counted, not raised: before,
        # it ended the handler here and the work taken was lost with the epoch already recorded (a
        # repeat of the command is ignored). The heartbeat repeats accepting=False and split.applied
        # goes out again (_announce_applied); the router accepts a hand-back on its own checks
        # (pending, placed here, same attempt), not on these.
        await self._announce_applied(
            m.SplitApplied(epoch=cmd.epoch, node=self.node, phase=phase, status="draining", decided_at=cmd.decided_at,
                           applied_at=wall, received_at=wall, requeued=len(queued))
        )  # fmt: skip
        await self._announce("node.state", self._publish_state(now))  # accepting=False: the router stops routing here
        if queued:
            reason = f"node {self.node} switches to {phase}"
            await asyncio.gather(*(self._hand_back(m.WorkRequeue(rid=w.rid, node=self.node, reason=reason, epoch=cmd.epoch, prefill=w)) for w in queued))
        await self._maybe_switch(self.clock.local_now())
        self._input()

    async def _announce(self, what: str, publish: Any) -> bool:
        """Await ``publish`` (a switch announcement, ``what``); a publish NATS refuses (``BusError``)
        is logged at warning and counted (``split.announce_failed``) instead of raised. Returns
        whether it went out."""
        try:
            await publish
        except BusError as e:
            self.counters["split.announce_failed"] += 1
            self.log.warning("switch announcement not published; the switch goes on", what=what, error=repr(e))
            return False
        return True

    async def _announce_applied(self, msg: m.SplitApplied) -> None:
        """Publish ``msg`` (``split.applied``); one NATS refuses is logged and counted
        (:meth:`_announce`), and a ``serving`` one is published again every
        ``--idle-state-interval-s`` until NATS takes it or a newer ``split.applied`` replaces it
        (``split.announce_retried``): the planner ends a node's busy period on ``serving``, so a
        lost one kept the node busy in its eyes until its ``busy_timeout_s``. A lost ``draining``
        is not repeated (the planner counts the node busy from its command on; a late one would
        say draining after the drain). The switch never waits for either."""
        if not await self._announce(f"split.applied {msg.status}", self._publish_applied(msg)) and msg.status == "serving":
            self._unannounced = msg
            if self._announcing is None or self._announcing.done():
                self._announcing = self._spawn(self._announce_again(), f"worker-{self.node}-split-announce")

    async def _announce_again(self) -> None:
        """Publish the ``split.applied`` NATS refused (:meth:`_announce_applied`) until it goes out."""
        while (msg := self._unannounced) is not None:
            await asyncio.sleep(self.cfg.idle_state_interval_s)
            if self._unannounced is not msg:  # a newer announcement went out (or failed: that one is retried)
                continue
            try:
                await self.bus.publish(SPLIT_APPLIED, msg)
            except BusError as e:
                self.log.debug("switch announcement refused again", status=msg.status, epoch=msg.epoch, error=repr(e))
                continue
            if self._unannounced is msg:
                self._unannounced = None
            self.counters["split.announce_retried"] += 1
            self.log.info("switch announcement published on retry", status=msg.status, phase=msg.phase, epoch=msg.epoch)

    async def _maybe_switch(self, now: float) -> None:
        """Finish the switch in progress once nothing runs on the node (``now`` = when it drained,
        simulated s, local)."""
        sw = self._switch
        if sw is None or not self.core.idle or self._binds or self._handing_off or self._sending_handoffs:
            return
        self._switch = None
        sw.drained_at = max(now, sw.received_at)
        await self._serving(sw, self.clock.local_now())

    async def _serving(self, sw: _Switch, now: float) -> None:
        """Serve ``sw.target`` from ``now`` (simulated s, local) on; announce it (state first: the
        router routes by it). ``SplitApplied``'s times and ``switch_s`` are wall-based (measured
        from the planner's ``decided_at``)."""
        old = self.core.phase
        with self._fatal_on_error("switch: set the phase"):
            self.core.set_phase(sw.target, now)
        if sw.target == "prefill" and self._kv_in.open:
            # a decode work that comes now goes back through the router with its K/V inline (_on_decode): K/V that
            # cannot fit one message would only fail its request when its work comes; freed now, and the work fails
            # naming why (before, held until --handoff-kv-timeout-s)
            room = self.bus.max_payload - handoffkv.ENVELOPE_BYTES
            self._discard_kv(f"node {self.node} switched to prefill and its K/V cannot go back through the router in one "
                             f"message (NATS max_payload {self.bus.max_payload} B)", lambda a: a.total <= room)  # fmt: skip
        off = self._wall_offset()  # one offset for the switch's local times: they keep their order and lengths
        local, now = now, now + off
        received, since = sw.received_at + off, sw.since + off
        drained = sw.drained_at + off if sw.drained_at is not None else now
        # The node serves sw.target from here whatever becomes of the two announcements (a refused
        # one is logged and counted; the heartbeat repeats the state, split.applied goes out again).
        # Before, a refusal raised: from the step loop (_maybe_switch) it ended the node as any step
        # error, from the split handler it was only logged and the planner never heard "serving".
        await self._announce("node.state", self._publish_state(local))
        await self._announce_applied(
            m.SplitApplied(
                epoch=sw.epoch,
                node=self.node,
                phase=sw.target,
                status="serving",
                decided_at=sw.decided_at,
                applied_at=now,
                switch_s=max(0.0, now - since),
                received_at=received,
                drained_at=drained,
                requeued=sw.requeued,
            )
        )
        self.log.info(
            "switch done: serving",
            old=old,
            new=sw.target,
            epoch=sw.epoch,
            switch_s=round(now - since, 4),
            drain_s=round(drained - received, 4),
            overhead_s=round(now - drained + received - since, 4),
        )
        self._input()

    async def _publish_applied(self, msg: m.SplitApplied) -> None:
        self._unannounced = None  # a newer announcement replaces one waiting to go out again
        self.counters[f"split.{msg.status}"] += 1
        if msg.status == "serving":
            self.counters["split.applied"] += 1
        await self.bus.publish(SPLIT_APPLIED, msg)

    async def _hand_back(self, msg: m.WorkRequeue) -> None:
        """Give work back to the router (``work.requeue``); this node has forgotten it.

        The router re-routes it to exactly one node or refuses it (no longer pending:
        dropped here). No answer within ``requeue_timeout_s`` (asked again meanwhile): the request
        fails with an error chunk, so nothing hangs.
        """
        kind = "prefill" if msg.prefill is not None else "decode"
        self.counters[f"requeue.{kind}"] += 1
        work = msg.prefill if msg.prefill is not None else msg.decode
        assert work is not None
        owner = self._owners.pop(msg.rid, None) or _Owner(work.attempt, work.output_offset, work.router)
        msg = msgspec.structs.replace(msg, attempt=work.attempt)
        if self._traces:
            self._traces.forget(msg.rid, "handed_back", msg.reason)
        # asked again until requeue_timeout_s when a reply does not come (a NATS restart loses
        # replies): a repeat of a hand-back the router already took is refused, and dropped here
        deadline = time.monotonic() + self.cfg.requeue_timeout_s
        while True:
            try:
                reply = await self.bus.request(
                    WORK_REQUEUE, msg, timeout=max(0.05, min(2.0, deadline - time.monotonic())), router=owner.router_id
                )
                break
            except BusError as e:
                if time.monotonic() + 0.05 < deadline:
                    self.counters["requeue.retries"] += 1
                    await asyncio.sleep(0.05)
                    continue
                self.counters["requeue.failed"] += 1
                why = f"{msg.reason}; the router did not take the request back: {e}"
                try:
                    await self._reject(WorkRejected(msg.rid, why), self.clock.local_now(), attempt=owner.attempt,
                                       router=owner.router)  # popped above: _reject finds no owner
                except BusError as e2:  # NATS refuses even the error chunk: say so, and let the other hand-backs go on
                    self.counters["requeue.lost"] += 1
                    self.log.error("handed-back request neither taken back nor failed: NATS refused both", rid=msg.rid,
                                   reason=msg.reason, requeue_error=str(e), error=repr(e2))  # fmt: skip
                return
        self.counters["requeue.accepted" if reply.accepted else "requeue.refused"] += 1

    # ------------------------------------------------------------------ #
    # decode binding at prefill start, real-bytes fetches
    # ------------------------------------------------------------------ #

    def _bind_started(self, plan: IterationPlan, now: float) -> None:
        """Ask the router for the decode node of every request whose prefill starts in ``plan``."""
        for rid in plan.admitted:
            work = self._bind_later.pop(rid, None)
            if work is not None:
                self._binds[rid] = task = asyncio.create_task(self._bind(work, now), name=f"bind-{rid}")
                task.add_done_callback(self._task_done)

    async def _bind(self, work: m.PrefillWork, started: float) -> None:
        """``route.bind`` until the router names a decode node (retried while none is eligible), beside
        the step loop: a prefill that finishes first is parked in the core, its KV held; its first
        token goes out with the step that completed it, and its hand-off from here once it is bound
        (:meth:`_hand_off_bound`), never before that first token (a binding that comes while that
        step still publishes waits for the step's end). Before, the step loop waited for the binding
        (up to ``owner_gone_after_s`` when the owning router hung): a SIGSTOPped router stalled the
        node's requests of every other router for 30 s; then (77f120e) a parked request's first
        token waited for it, so its TTFT held the round trip to the router.

        ``bind_timeout_s`` bounds the time the router answers that no decode node is eligible. A request
        that gets no reply at all (the owning router or NATS hung, NATS down) does not count toward it:
        that wait is added to the deadline, up to ``owner_gone_after_s`` from the first request (the same
        bound as for a router cut off from NATS, :meth:`_check_owners`). Before, a 15-s SIGSTOP of
        nats-server failed the 2 prefills that were binding ('no decode node for the request: no reply on
        route.bind.router: TimeoutError') although the router was alive and every node too. A
        :class:`PermissionDenied` (this identity may not publish ``route.bind.<owner>``) fails the
        request at once (``bind.denied``): it came at a request's timeout, and was retried as an
        unanswered one for ``owner_gone_after_s``. So does a :class:`RequestRefused` (the router refused the
        request as malformed or invalid, e.g. a ``prefill_node`` outside its node set: ``bind.refused``), which
        was retried until ``bind_timeout_s``."""
        rid = work.rid
        first = time.monotonic()
        deadline = first + self.cfg.bind_timeout_s
        cap = first + max(self.cfg.bind_timeout_s, self.cfg.owner_gone_after_s)
        req = m.DecodeBindRequest(
            rid=rid, prefill_node=self.node, prompt_tokens=work.prompt_tokens, max_tokens=work.max_tokens, branch_id=work.branch_id,
            attempt=work.attempt,
        )  # fmt: skip
        router = _Owner(router=work.router).router_id
        reason = "no answer"
        parent = self._traces.parent(rid) if self._traces else None
        span = None if parent is None else tracing.start("worker.decode_binding", parent, kind=tracing.SpanKind.CLIENT)
        headers = None if span is None else tracing.inject(span)
        try:
            while time.monotonic() < deadline:
                # an abort or _forget cancels this task once and stops tracking it; a cancel that came in the turn
                # the request's reply did (Python 3.11's wait_for returns the reply) was lost and the binding
                # retried until bind_timeout_s / owner_gone_after_s (tests/unit/worker/test_bind_lost_cancel.py)
                raise_if_cancel_lost()
                sent = time.monotonic()
                try:
                    rep = await self.bus.request(
                        ROUTE_BIND, req, timeout=max(0.05, min(2.0, deadline - sent)), router=router, headers=headers
                    )
                except BusError as e:  # router restarting or gone: retry until the deadline
                    reason = str(e)
                    if isinstance(e, NoResponders):
                        # nobody serves route.bind.<owner>: the owning router is gone, and with it the
                        # client's stream; waiting would stall this node's other requests (issue #22)
                        self.counters["bind.owner_gone"] += 1
                        break
                    if isinstance(e, PermissionDenied):  # the credentials lack the subject: no retry can help
                        self.counters["bind.denied"] += 1
                        break
                    if isinstance(e, RequestRefused):  # the router refused it as malformed or invalid: so it will again
                        self.counters["bind.refused"] += 1
                        break
                    unanswered = isinstance(e.__cause__, TimeoutError) or not self.bus.nc.is_connected
                    self.counters["bind.retries"] += 1
                    await asyncio.sleep(0.05)
                    if unanswered:
                        # no reply at all: the router or NATS is hung or down, not short of decode nodes.
                        # The whole try counts, its pause too: before, each unanswered try took its 0.05 s
                        # off bind_timeout_s (at 0.3 s, a 2-s hang failed the prefill)
                        self.counters["bind.unanswered"] += 1
                        deadline = min(cap, deadline + (time.monotonic() - sent))
                    continue
                if rep.decode_node is not None:
                    if self.cfg.fault_delay_bind_s > 0:  # injected fault: the binding comes late (after the prefill)
                        await asyncio.sleep(self.cfg.fault_delay_bind_s)
                    if rid in self.core.parked:
                        # its first token is out once the step that completed its prompt has ended
                        # (that step publishes it): its hand-off never goes out before it
                        while rid in self._step_rids:
                            await self._step_over.wait()
                    if rid not in self.core.requests:
                        break  # it ended here at its first token (end-of-sequence) before its binding came: below
                    now = self.clock.local_now()
                    try:
                        check_token(rep.decode_node, "decode_node")
                        outs = self.core.bind_decode(rid, rep.decode_node, now)
                    except (ValueError, SchedulerError) as e:
                        reason = str(e)
                        break
                    self.counters["bind.ok"] += 1
                    if outs:  # its prefill finished first (parked, its first token out): its hand-off now
                        if span is not None:  # the binding's span ends with the binding
                            span.end()
                            span = None
                        await self._hand_off_bound(rid, outs, now)
                    return
                reason = rep.reason
                if "not pending" in reason or "not in flight" in reason or "placed on" in reason or "stale attempt" in reason:
                    break  # the router gave up on it (aborted, re-routed): nothing to bind
                self.counters["bind.retries"] += 1
                await asyncio.sleep(0.05)
            raise_if_cancel_lost()  # a lost cancel and a reply that ends the loop: aborted here, not ended or failed
            if rid not in self.core.requests:
                # it ended here at its first token (end-of-sequence, finish_reason stop) while its binding
                # was under way: the router, which has its end, answers "not pending", or names a decode node
                # when the end had not reached it yet; nothing failed and there is nothing to abort or bind.
                # Before, counted bind.failed (a torch node's EOS at the first token)
                self.counters["bind.after_end"] += 1
                return
            self.counters["bind.failed"] += 1
            now = self.clock.local_now()
            if self.core.abort(rid, now):
                self._streams.pop(rid, None)
                owner = self._owners.pop(rid, None)
                await self._reject(  # nothing failed in an engine: the router answers an abort with 503
                    WorkRejected(rid, f"no decode node for the request: {reason}"), now, attempt=owner.attempt if owner else work.attempt,
                    router=owner.router if owner else work.router, finish_reason="abort",  # popped above: _reject finds no owner
                )
        finally:
            if span is not None:
                span.end()
            me = asyncio.current_task()
            if self._binds.get(rid) is me:
                del self._binds[rid]
            if self._handing_off.get(rid) is me:
                del self._handing_off[rid]
            self._input()  # a drain may be over (_maybe_switch), KV freed

    async def _hand_off_bound(self, rid: str, outs: list[Any], now: float) -> None:
        """Publish ``outs`` (``bind_decode``'s hand-off, at ``now``: simulated s, local) of ``rid``,
        parked until its binding came (its first token went out at its prefill's end), as the step
        loop publishes a plan's: the
        task leaves :attr:`_binds` for :attr:`_handing_off` first (an abort no longer cancels it
        midway; new work of the rid waits for it; the engine keeps its registration meanwhile)."""
        task = asyncio.current_task()
        assert task is not None
        if self._binds.get(rid) is task:
            del self._binds[rid]
        self._handing_off[rid] = task
        self.counters["bind.after_prefill"] += 1
        for out in outs:
            if isinstance(out, TokensOut):
                await self._emit_tokens(out, now)
            elif isinstance(out, HandOff):
                self._bound_sends.add(rid)
                try:
                    await self._handoff(out)
                finally:
                    self._bound_sends.discard(rid)

    def _start_transfers(self) -> None:
        """Real-bytes mode: move the bytes of every fetch the core started (Mooncake)."""
        if self.kvpool is None:
            return
        for fs in self.core.take_fetch_starts():
            self._spawn(self._transfer(fs), name=f"fetch-{fs.rid}", fatal=True)

    async def _transfer(self, fs: FetchStarted) -> None:
        assert self.kvpool is not None
        parent = self._traces.parent(fs.rid) if self._traces else None
        t0 = time.time_ns()
        results = await asyncio.gather(*(self.kvpool.fetch(peer, hashes) for peer, hashes in fs.sources), return_exceptions=True)
        t1 = time.time_ns()
        missing: set[int] = set()
        c = self.counters
        c["kvfetch.wait_ms_max"] = max(c["kvfetch.wait_ms_max"], (t1 - t0) // 1_000_000)  # the longest a request waited on its sources
        for (peer, hashes), res in zip(fs.sources, results):
            c["kvfetch.calls"] += 1
            c["kvfetch.blocks_requested"] += len(hashes)
            if isinstance(res, BaseException):
                err = repr(res)
                self._traces.kv_transfer(parent, fs.rid, peer, t0, t1, blocks=len(hashes), missing=len(hashes), error=err)
                c["kvfetch.errors"] += 1
                missing.update(hashes)
                self.log.warning("real-bytes fetch failed", rid=fs.rid, peer=peer, error=err)
                continue
            self._traces.kv_transfer(  # parent None (not traced): records nothing
                parent, fs.rid, peer, t0, t0 + int(res.seconds * 1e9), blocks=len(hashes), fetched=len(res.fetched),
                missing=len(res.missing), nbytes=res.bytes, seconds=res.seconds, transfer_s=res.transfer_s, error=res.error,
            )  # fmt: skip
            c["kvfetch.blocks_fetched"] += len(res.fetched)
            c["kvfetch.blocks_already"] += len(res.already)
            c["kvfetch.blocks_missing"] += len(res.missing)
            c["kvfetch.blocks_mismatched"] += len(res.mismatched)
            c["kvfetch.bytes"] += res.bytes
            if res.error:
                c["kvfetch.errors"] += 1
                for why, n in res.reasons.items():  # timeout / error: the pages are recomputed
                    c[f"kvfetch.failed.{why}"] += n
                self.log.warning("real-bytes fetch failed; the missing pages are recomputed", rid=fs.rid, peer=peer, error=res.error)
            missing.update(res.missing)
        missing |= await self._take_fetched(results, fs.fetch_id)
        now = self.clock.local_now()
        path = [h for _, hs in fs.sources for h in hs]
        cut = next((i for i, h in enumerate(path) if h in missing), len(path))
        if not self.core.fetch_done(fs.rid, missing, now, fs.fetch_id):
            c["kvfetch.late"] += 1  # the request left (abort, hand-back, re-dispatch) while the bytes moved
            self.engine.drop_fetched(fs.fetch_id)  # its fetch ended already: nothing will store them
            cut = 0
        for h in self.core.kv.host.absent(path[cut:]):  # pages L2 will never hold (past a missing one, or unused): free their slots
            self.kvpool.evict(h)
        self._input()

    async def _take_fetched(self, results: list[Any], fetch_id: int) -> set[int]:
        """:func:`take_fetched` with a threaded engine's copies in the execute thread, after the plan in flight
        (:meth:`_beside_plan`): the pages' slots are pinned on the loop, the engine copies them there
        (``on_fetched`` takes the engine's lock, which ``execute`` holds for a whole plan), the pins go on the loop.
        Before, the loop waited for the rest of the forward, then for the copy of every page (127-323 ms measured
        on CPU; ``tests/unit/worker/test_torch_pool_loop.py``). Returns the pages the engine could not take."""
        return await take_fetched(self.engine, self.kvpool, results, fetch_id, self._beside_plan if self.engine.threaded else None)

    async def _on_counts(self, msg: m.CountUpdates, _subject: str) -> None:
        if msg.seq and not msg.beacon and msg.seq in self._drop_counts:  # injected fault: NATS lost this message
            self._drop_counts.discard(msg.seq)
            self.counters["counts.fault_dropped"] += 1
            return
        self._check_reconnect()
        st = self.counts
        gaps = st.counters["gap"]
        reset, action = st.offer(msg)
        if reset:  # the directory restarted (or registered this node id anew): its counts start from empty
            with self._fatal_on_error("reset branch counts"):
                moved = self.core.reset_counts()
            self.log.info("new kv directory count epoch (the directory restarted, or re-registered this node after "
                          "forgetting it): branch counts reset to 0", epoch=msg.epoch, moved=moved)  # fmt: skip
        if action == "apply":
            self._apply_counts(msg.hashes, msg.counts)
        if st.counters["gap"] != gaps:
            self.bus.droplog.event("counts.gap", "kv.counts gap: node's counts asked from the directory", seq=msg.seq, last=st.last, reason=st.reason)
        if st.syncing:
            self._ensure_count_sync()

    def _apply_counts(self, hashes: list[int], counts: list[int]) -> int:
        """``core.update_counts``; a message it refuses is counted and dropped. Returns the host blocks moved."""
        try:
            with self._fatal_on_error("apply branch counts", allowed=(ValueError,)):
                return self.core.update_counts(hashes, counts)
        except ValueError as e:
            self.counters["counts.invalid"] += 1
            self.log.warning("invalid count update dropped", error=str(e))
            return 0

    def _check_reconnect(self) -> None:
        """After a reconnect to NATS, a ``kv.counts`` message sent meanwhile may be lost with no later
        one to show the gap: sync the counts (once per reconnect; only once a directory was heard)."""
        seen = self.bus.reconnected_at
        if seen == self._counts_reconnect_seen:
            return
        self._counts_reconnect_seen = seen
        if self.counts.epoch is not None and self.counts.start_sync("reconnect"):
            self.log.info("reconnected to NATS: node's branch counts asked from the directory")
            self._ensure_count_sync()

    def _ensure_count_sync(self) -> None:
        t = self._count_sync_task
        if (t is None or t.done()) and not self._stopped and self.counts_on:
            self._count_sync_task = self._spawn(self._sync_counts(), name=f"worker-{self.node}-countsync")

    async def _sync_counts(self) -> None:
        """While :attr:`counts` is syncing: ask ``kv.countsync.<node>`` for the node's counts (one
        snapshot per ``count_sync_min_interval_s`` at most; retried with backoff, each reply waited
        ``count_sync_timeout_s``), then reset every count and apply the snapshot and the messages
        kept meanwhile, in one synchronous step (nothing else runs between them). Until then
        :meth:`_on_counts` applies the messages as they come (``CountStream``: applied early and
        kept), so a sync that never completes does not freeze the counts.

        The L2 pool afterwards, against a worker that lost no message (``reset_counts`` then
        ``update_counts`` of the snapshot, tests/unit/worker/test_count_sync.py): every page in
        the same group (count 0 or > 0): the set of counted pages is R[·, node] > 0, which is what
        the messages up to the snapshot's ``seq`` net to (absolute values, each block's last one
        wins). Also the same for a page written through to L2 since the directory's last count
        of it: without a loss it counts 0 until the directory re-sends its count (it does on the
        host store), after the sync it counts R's value at once; the re-send then changes nothing.
        What differs is the order inside each group (the eviction order stamps): the reset moves
        every queued counted page to the tail of the zero group (queue order), the snapshot moves
        the pages with R > 0 back to the tail of the counted group in the snapshot's order (the
        order their directory counts last rose from 0, not the order they were last used), each as a
        count message moves pages (deepest first, ancestors lifted). So the counted group's LRU
        order is replaced by the snapshot's, and the pages that lost their count meanwhile (now
        zero-count) are stamped as just used; pages whose count stayed 0 keep their stamps.
        """
        st = self.counts
        delay = 0.1
        while st.syncing:
            allowed = self._last_count_sync + self.cfg.count_sync_min_interval_s
            if time.monotonic() < allowed:
                self.counters["counts.sync.rate_limited"] += 1
                await sleep_until(allowed)
                continue
            self._last_count_sync = time.monotonic()
            gen = st.asking()
            try:
                epoch, seq, hashes, counts = await self._fetch_counts(gen)
            except _CountSnapshotTooLarge as e:  # the sync ended (CountStream.first_piece): not asked again
                self.log.error("node's count snapshot too large to fetch: no count sync until the directory's epoch changes",
                               error=str(e)[:200], max_entries=st.max_entries)  # fmt: skip
                break
            except (BusError, _BadCountSnapshot) as e:
                self.counters["counts.sync.failures"] += 1
                self.bus.droplog.event("counts.sync", "count sync failed; retrying", level="warning", error=str(e)[:200], retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.count_sync_backoff_max_s)
                continue
            after = st.snapshot(epoch, seq, gen)
            if after is None:
                continue
            with self._fatal_on_error("reset branch counts"):
                moved = self.core.reset_counts()
            moved += self._apply_counts(hashes, counts)
            for msg in after:
                moved += self._apply_counts(msg.hashes, msg.counts)
            self.log.info("branch counts synced from the KV directory", seq=seq, entries=len(hashes), applied_after=len(after),
                          moved=moved, again=st.syncing)  # fmt: skip
            delay = 0.1

    async def _fetch_counts(self, gen: int) -> tuple[str, int, list[int], list[int]]:
        """Every piece of one ``CountSnapshot`` of this node, asked under sync generation ``gen``
        (``CountStream.asking``): ``(epoch, seq, hashes, counts)``.

        Raises:
            BusError: a request got no reply in ``count_sync_timeout_s`` (or was refused).
            _BadCountSnapshot: a reply for another node, with ``error`` set (the snapshot expired
                between two pieces, or the directory refused a new one so soon after the last,
                ``--count-sync-min-interval-s`` there), or a piece that does not continue the first.
            _CountSnapshotTooLarge: more entries than the worker fetches (``first_piece``; the
                sync has ended, counted ``counts.sync.too_large``).
        """
        st = self.counts
        req = m.CountSyncRequest(node=self.node, reason=st.reason, epoch=st.epoch or "", last_seq=st.last)
        timeout = self.cfg.count_sync_timeout_s
        first = await self.bus.request(KV_COUNT_SYNC, req, timeout=timeout, node=self.node)
        self.counters["counts.sync.pieces"] += 1
        if first.node != self.node or first.error or first.offset != 0:
            self.counters["counts.sync.bad_reply"] += 1
            raise _BadCountSnapshot(f"reply for node {first.node!r}, offset {first.offset}, error {first.error!r}")
        if not st.first_piece(first.epoch, first.total, gen):
            raise _CountSnapshotTooLarge(f"{first.total} entries; at most {st.max_entries}")
        hashes, counts = list(first.hashes), list(first.counts)
        while len(hashes) < first.total:
            more = msgspec.structs.replace(req, snapshot=first.snapshot, offset=len(hashes))
            piece = await self.bus.request(KV_COUNT_SYNC, more, timeout=timeout, node=self.node)
            self.counters["counts.sync.pieces"] += 1
            if (piece.error or piece.node != self.node or piece.snapshot != first.snapshot or piece.offset != len(hashes)
                    or not piece.hashes or (piece.epoch, piece.seq, piece.total) != (first.epoch, first.seq, first.total)):  # fmt: skip
                self.counters["counts.sync.bad_reply"] += 1
                raise _BadCountSnapshot(f"piece at {len(hashes)} of {first.total} refused: {piece.error or 'does not continue the snapshot'}")
            hashes += piece.hashes
            counts += piece.counts
        return first.epoch, first.seq, hashes, counts

    async def _on_resync(self, req: m.KvResyncRequest, _subject: str) -> m.KvSnapshot:
        if self._stopped:
            # leaving: its last batch (or the one stop() is about to publish) is AllBlocksCleared,
            # and Bus.close drains, so this can run after it; a snapshot of the engine's blocks
            # would put them back in the directory for good
            return m.KvSnapshot(node=self.node, seq=self.kv_seq, block_size=self.profile.block_size)
        now = self.clock.local_now()
        # drain pending events and snapshot in one synchronous step, so the
        # snapshot is exactly the state after batch `seq`
        events = self.core.take_kv_events()
        self._engine_kv_events(events)
        gpu, gpu_parents, host, host_parents = self.core.snapshot_parents()
        self._mirror_pool(events)
        if events:
            self.kv_seq += 1
        seq = self.kv_seq
        if events:
            await self._publish_kv(seq, events, now)
        self.counters["kv.resyncs"] += 1
        return m.KvSnapshot(
            node=self.node, seq=seq, block_size=self.profile.block_size, gpu=gpu, host=host, gpu_parents=gpu_parents, host_parents=host_parents
        )

    # ------------------------------------------------------------------ #
    # loop
    # ------------------------------------------------------------------ #

    async def _run(self) -> None:
        """Step until the node stops or a step fails. Any exception out of :meth:`_step` ends the
        node (:meth:`_fail`): ``EngineFatal`` (its KV is wrong: serving on could send wrong tokens)
        and every other one (a CUDA out-of-memory in the forward, an engine hook, a core bug, NATS
        refusing a publish). A step is not atomic: once ``schedule()`` has taken a plan, only
        ``finish_iteration`` ends it, and every later ``schedule()`` raises ``SchedulerError``; the
        engine and the pools may have applied part of it. Before, the loop counted the error
        (``loop_errors``) and went on: the node kept heartbeating and holding its requests while
        every step failed, so the router never re-dispatched them and clients waited for their
        timeout. As vLLM's EngineCore dies on an exception in its busy loop (``EngineDeadError``)
        and SGLang's scheduler SIGQUITs its server, the node exits 1; its supervisor restarts it
        and the router re-dispatches what it held."""
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._fail(e, "step")
                return

    def _input(self) -> None:
        """The core was handed input (work, abort, a switch, fetched bytes, a binding) now: note
        the time (:meth:`_launch_time`) and wake the loop."""
        now = self.clock.local_now()
        if now > self._ready_at:
            self._ready_at = now
        self._wake.set()

    def _wall_offset(self) -> float:
        """Simulated s from the node's local timeline (the clock's monotonic reading) to the
        cluster's wall-based clock (``clock.now() - clock.local_now()``): ~0 until the wall clock
        steps, then the step × ``speedup``; kept until it moves by :data:`WALL_STEP_S` (×
        ``speedup``), so the times of back-to-back plans stay back to back once sent."""
        off = self.clock.now() - self.clock.local_now()
        if abs(off - self._offset) > WALL_STEP_S * self.clock.speedup:
            self._offset = off
        return self._offset

    def _to_wall(self, t: float) -> float:
        """Local time ``t`` (simulated s, the core's) on the cluster's wall-based clock, for a
        message to another process (which compares it with its own clock)."""
        return t + self._wall_offset()

    def _to_local(self, t: float) -> float:
        """Time ``t`` from another process (simulated s, the cluster's wall-based clock) on this
        node's local timeline, for the core: a deadline it holds then lasts its simulated length
        whatever the wall clock does while it waits."""
        return t - self._wall_offset()

    def _launch_time(self) -> float:
        """Simulated launch time (s, local) of the next plan (sim engines): when the engine could
        first act on what it holds (``_ready_at``: its last plan's end, the latest input, a
        deadline waited for), not later than now. The sim engine is a GPU running the profile's
        Eq. 1/2 iterations back to back; the shell's Python work between two plans (finishing,
        publishing, waking, scheduling: a few ms of wall time, more on a loaded machine, and ×
        ``speedup`` in simulated time) is not GPU time, so it is not added to the engine's
        timeline. The plan's deadline is then earlier, and the loop catches up as long as it keeps
        up on average; it trails the clock by at most ``engine_lag_wall_s`` (beyond that the loop
        is overloaded and simulated time stretches, as before). A real engine's plans launch now
        (its measured time includes its own overhead)."""
        now = self.clock.local_now()
        if not self.engine.simulated:
            return now
        floor = now - self.cfg.engine_lag_wall_s * self.clock.speedup
        t = self._ready_at
        return now if t >= now else t if t > floor else floor

    async def _step(self) -> None:
        self._wake.clear()
        if self._switch is not None:
            await self._maybe_switch(self.clock.local_now())
        now = self._launch_time()
        horizon = now + self.cfg.fold_wall_s * self.clock.speedup if self.cfg.fold_wall_s > 0 else None
        plan = self.core.schedule(now, horizon)
        if plan is None:
            await self._flush_kv(now)
            await self._publish_if_stopped(now)
            deadline = self.core.next_deadline()
            # wall s until the deadline, read now and waited on the loop's (monotonic) clock
            timeout = None if deadline is None else max(0.0, self.clock.to_wall(deadline - self.clock.local_now()))
            # a node whose work all waits (for its KV: a peer fetch, a hand-off's transfer, the pool's bytes) runs no plan,
            # and only this loop sends the alive batch (_flush_kv, the one publisher of kv.events beside a resync): it
            # wakes when one is due, so the directory does not call a healthy node's view stale while it waits
            alive = self._alive_due_s()
            by_alive = alive is not None and (timeout is None or alive < timeout)
            try:
                await asyncio.wait_for(self._wake.wait(), alive if by_alive else timeout)
            except TimeoutError:
                if by_alive:
                    self.counters["kv.alive_wakes"] += 1
                elif deadline is not None and deadline > self._ready_at:
                    self._ready_at = deadline  # a KV arrival or fetch completion: the engine acts at it
            return
        self._steps += 1
        wd = self.watchdog
        info = StepInfo.of(plan, self._steps)
        self._step_rids = frozenset(info.rids)  # kept registered in the engine until the step ends (_Live)
        self._step_over.clear()
        if wd is not None:
            wd.begin(info)  # watched from the plan's taking to its end (--watchdog-timeout-s)
        try:
            await self._run_plan(plan, now, info if wd is not None else None)
        finally:
            if wd is not None and not self._step_abandoned:
                wd.end()
            self._step_rids = frozenset()
            self._step_over.set()

    async def _run_plan(self, plan: IterationPlan, now: float, info: StepInfo | None) -> None:
        """Execute ``plan`` (taken at ``now``, simulated s, local), finish it and publish what it
        produced. ``info``:
        the step the watchdog watches (None: no watchdog); a sim engine's wait for the plan's end on
        the simulated clock (a sleep, as long as ``--speedup`` makes it) is not watched
        (:meth:`_unwatched`). A prefill that completes before its decode node is bound is parked in
        the core (its KV held): its first token goes out here, its hand-off from its :meth:`_bind`
        task: the step never waits for a binding (before, it did, up to ``owner_gone_after_s``, and
        with it every other request here)."""
        await self._flush_kv(now)
        if plan.admitted and self._bind_later:
            self._bind_started(plan, now)
        if plan.admitted and self._traces:
            self._traces.admitted(plan.admitted)
        if time.monotonic() - self._last_state_mono >= self.cfg.state_interval_s:
            await self._publish_state(now)
        if self.engine.threaded:
            self._plan_reads = []  # the pool's copies asked from now on wait for _execute_plan's end (_beside_plan)
        try:
            now = await self._execute_plan(plan, now, info)
        finally:
            self._plan_read()
        self._take_records()
        # the plan has run and its hand-offs are out: its requests that left the core (aborted meanwhile, handed
        # off) are forgotten now, their private L1 pages freed. Before, this drain kept them (_step_rids) until the
        # next step's, which applies its batch first: a restore there (or the next forward) found no free page the
        # scheduler had planned again (KvMapError; tests/unit/worker/test_torch_interleave_random.py)
        await self._flush_kv(now, step_done=True)
        if self._switch is not None:
            await self._maybe_switch(now)

    async def _execute_plan(self, plan: IterationPlan, now: float, info: StepInfo | None) -> float:
        """:meth:`_run_plan`'s forward (in the execute thread for a threaded engine) and its results: the engine's
        stopped requests and tokens read on the loop (locked calls), the tokens and hand-offs published. Returns
        the plan's end (simulated s, local)."""
        if self._steps == self.cfg.fault_hang_step:  # injected fault: this forward never returns
            self.counters["engine.steps_hung_by_fault"] += 1
            await self._in_thread(self._hang_forever)
        duration = await self._in_thread(self.engine.execute, plan) if self.engine.threaded else self.engine.execute(plan)
        end = plan.start + duration
        if self.engine.simulated:
            async with self._unwatched(info):
                end = await self._wait_for_plan_end(plan, end)
        # a sim engine's plan ends at its end on the engine's timeline (the shell's lateness is not
        # GPU time, see _launch_time); a real one ends now
        now = end if self.engine.simulated else max(self.clock.local_now(), end)
        if now > self._ready_at:
            self._ready_at = now
        outs = self.core.finish_iteration(plan, now, self.engine.take_stopped())
        for out in outs:
            if isinstance(out, TokensOut):
                await self._emit_tokens(out, now)
            elif isinstance(out, HandOff):
                await self._handoff_aside(out)
        return now

    def _execute_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The execute thread (one), made at its first use."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"worker-{self.node}-execute")
        return self._executor

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the execute thread (as ``asyncio.to_thread``, with the context); returns
        its result. When the step is cancelled (stop, SIGTERM) while ``fn`` still runs, the
        watchdog keeps the step until ``fn`` returns: a forward that hangs then still ends the
        process at ``--watchdog-timeout-s`` (before, the stop left the hung thread, and Python's
        exit waited for it forever)."""
        cf = self._execute_thread().submit(contextvars.copy_context().run, fn, *args)
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            wd = self.watchdog
            if wd is not None and not cf.done():
                self._step_abandoned = True
                cf.add_done_callback(lambda _: wd.end())
            raise

    async def _beside_step(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` (a threaded engine's method, under the engine's lock) in the execute thread, queued after
        the plan it runs, if any; returns its result. The event loop runs on meanwhile. Not the step's: the
        watchdog watches the plan. A cancelled caller (:meth:`stop`) leaves ``fn`` to finish when it has started
        in the thread; one still queued is cancelled there and never runs (``asyncio.wrap_future``)."""
        return await asyncio.wrap_future(self._execute_thread().submit(contextvars.copy_context().run, fn, *args))

    def _beside_plan(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        """Queue ``fn(*args)`` (the real-bytes pool's copies: :meth:`_fill_pool`, :meth:`_take_fetched`) in the execute
        thread now, as :meth:`_beside_step` does, or, while :meth:`_run_plan` runs a plan, once its
        :meth:`_execute_plan` is over (:meth:`_plan_read`, in ``_run_plan``'s ``finally``): the forward, the loop's
        locked reads of its results (``take_stopped``, ``output_tokens`` of each token publish), the tokens and
        hand-offs published (or the step failed, or stop cancelled it); still before the next plan. Returns a future
        of its result (cancelling it drops ``fn`` while queued). Queued behind the plan at once, the copies took the engine's lock as soon as
        the forward ended, and the loop's first read of the plan (``take_stopped``, a locked call) waited for all of
        them: a big batch's copies held the loop after all (``tests/unit/worker/test_torch_pool_loop.py``: 300 ms of
        copies, the loop stalled 281 ms at the plan's end). Queued here, when asked, not when a task asking for it
        first runs: a drain's copies at a step's end go before the next step's forward (a task started then ran
        after the next plan was queued, and the pages stored at a step's end were offered to peers one forward
        late)."""
        ctx = contextvars.copy_context()
        queue = self._plan_reads
        if queue is None:
            return asyncio.wrap_future(self._execute_thread().submit(ctx.run, fn, *args))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        queue.append((fut, ctx, fn, args))
        return fut

    def _plan_read(self) -> None:
        """:meth:`_execute_plan` is over (the forward, its results read on the loop, its tokens and hand-offs
        published; or the step failed, or stop cancelled it): the copies :meth:`_beside_plan` held back are queued
        in the execute thread now, in order, before any later plan."""
        queue, self._plan_reads = self._plan_reads, None
        for fut, ctx, fn, args in queue or ():
            if fut.done():  # cancelled (stop)
                continue
            try:
                cf = self._execute_thread().submit(ctx.run, fn, *args)
            except RuntimeError as e:  # the executor is shut down (stop)
                fut.set_exception(e)
                continue
            _chain(asyncio.wrap_future(cf), fut)

    @contextlib.asynccontextmanager
    async def _unwatched(self, info: StepInfo | None) -> Any:
        """A wait inside step ``info`` the watchdog does not count: the step's clock starts again after it."""
        wd = self.watchdog
        if wd is not None:
            wd.end()
        try:
            yield
        finally:
            if wd is not None and info is not None:
                wd.begin(info)

    async def _wait_for_plan_end(self, plan: IterationPlan, end: float) -> float:
        """Sleep until the plan's end (simulated s, local); new work arriving while folded decode
        iterations run cuts the plan at the next iteration boundary. Returns the plan's end
        (simulated s, local). The wait is a local duration: before 7e1f91b it ran until
        ``clock.wall_at(end)`` on the wall clock, so a step of the wall clock back stalled the
        engine for the length of the step, and a step forward ended a folded plan at once."""
        while True:
            delay = self.clock.to_wall(end - self.clock.local_now())
            if delay <= 0:
                return end
            if plan.iterations == 1:
                await asyncio.sleep(delay)
                return end
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                return end
            self._wake.clear()
            end = self.core.truncate(plan, self.clock.local_now())

    async def _emit_tokens(self, out: TokensOut, now: float) -> None:
        """Publish ``out``'s tokens on ``req.<rid>.out.<node>``: the first token at once with the prompt
        accounting, then chunks of exactly ``stream_interval`` tokens (the last may be shorter),
        also when one engine step folded several decode iterations (SGLang ``--stream-interval``:
        1 = one token per chunk)."""
        rid = out.rid
        if self._traces:
            self._traces.tokens(
                rid, out.index, out.finished, fetch_s=out.fetch_s, exposed_fetch_s=out.exposed_fetch_s,
                fetched_tokens=out.fetched_tokens or 0, output_tokens=out.index + out.count,
                parked=out.index == 0 and rid in self.core.parked,
            )
        owner = self._owners.get(rid) or _Owner()
        base = owner.offset  # output position of this node's first output (a re-dispatched decode continues)
        off = self._wall_offset()  # one offset for ts and arrived_at: they keep their order
        ts = now + off
        tokens = self.engine.output_tokens(rid, base + out.index, out.count)
        lps = self.engine.output_logprobs(rid, base + out.index, out.count)
        if out.finished:
            self._owners.pop(rid, None)
            if self.cfg.log_requests:
                self.log.info("request finished", rid=rid, finish_reason=out.finish_reason, output_tokens=base + out.index + out.count)
        if out.index == 0:
            # the first token streams at once and carries the prompt accounting
            alone = out.finished and len(tokens) <= 1
            await self.bus.publish(
                REQ_OUT,
                m.TokenChunk(
                    rid=rid,
                    node=self.node,
                    index=base,
                    token_ids=tokens[:1],
                    finished=alone,
                    finish_reason=out.finish_reason if alone else None,
                    prompt_tokens=out.prompt_tokens,
                    cached_tokens=out.cached_tokens,
                    ts=ts,
                    queue_s=out.queue_s,
                    fetch_s=out.fetch_s,
                    exposed_fetch_s=out.exposed_fetch_s,
                    fetched_tokens=out.fetched_tokens,
                    attempt=owner.attempt,
                    router=owner.router,
                    arrived_at=None if owner.arrived_at is None else owner.arrived_at + off,
                    **_lp_fields(lps[:1] if lps is not None else None),
                ),
                rid=rid,
                node=self.node,
            )
            if alone:
                self.counters["requests.completed"] += 1
                return
            if rid not in self.core.requests:
                # handed off by this step (its stream ends here), or dropped while this first token went
                # out (an abort, a failed binding): no stream record to keep. Before, one was made after the
                # publish for a request already dropped, and nothing removed it
                return
            st = self._streams[rid] = _Stream(start=1)
            tokens = tokens[1:]
            lps = lps[1:] if lps is not None else None
        else:
            known = self._streams.get(rid)
            if known is None:
                known = self._streams[rid] = _Stream(start=out.index)
            st = known
        st.pending.extend(tokens)
        if lps is not None:
            st.lps = (st.lps or []) + lps
        size = self.cfg.stream_interval
        while len(st.pending) >= size or (out.finished and st.pending) or (out.finished and not st.pending and rid in self._streams):
            part, st.pending = st.pending[:size], st.pending[size:]
            lp_part = None
            if st.lps is not None:
                lp_part, st.lps = st.lps[: len(part)], st.lps[len(part) :]
            last = out.finished and not st.pending
            await self.bus.publish(
                REQ_OUT,
                m.TokenChunk(
                    rid=rid,
                    node=self.node,
                    index=base + st.start,
                    token_ids=part,
                    finished=last,
                    finish_reason=out.finish_reason if last else None,
                    ts=ts,
                    attempt=owner.attempt,
                    router=owner.router,
                    **_lp_fields(lp_part),
                ),
                rid=rid,
                node=self.node,
            )
            st.start += len(part)
            if last:
                del self._streams[rid]
                self.counters["requests.completed"] += 1
                break

    async def _handoff(self, h: HandOff) -> None:
        """Send ``h`` (its K/V from the engine) to its decode node; a drain waits for it (:attr:`_sending_handoffs`)."""
        self._sending_handoffs += 1
        try:
            await self._send_handoff(h)
        finally:
            self._sending_handoffs -= 1

    async def _handoff_aside(self, h: HandOff) -> None:
        """A step's hand-off ``h``: its K/V is copied out of the engine here, on the step (:meth:`_take_handoff`), and
        sent (:meth:`_deliver_handoff`: every piece answered, then the DecodeWork) by a task beside the step loop, in
        :attr:`_handing_off` (a drain, new work of the rid and :meth:`stop` wait for it; the engine keeps the rid's
        registration meanwhile). Before, the step awaited every piece's answer: a stalled decode node held all
        prefill work here for up to ``handoffkv.TRIES`` × ``--handoff-chunk-timeout-s`` per hand-off
        (``tests/integration/test_torch_handoff_aside_live.py``). At most :data:`HANDOFF_SENDS_MAX` go out at once
        (their bytes held), not counting those waiting in a decode node's queue (at most :data:`HANDOFF_QUEUED_MAX`
        of them, their bytes at most ``--handoff-queued-bytes``): the step waits for one to end or be queued past
        that."""
        while (len(self._deliveries) - self._queued_sends >= HANDOFF_SENDS_MAX or self._queued_sends >= HANDOFF_QUEUED_MAX
               or self._queued_send_bytes >= self.cfg.handoff_queued_bytes):  # fmt: skip
            self.counters["handoff.waited_for_send"] += 1
            self._send_room.clear()
            await self._send_room.wait()
        self._sending_handoffs += 1
        try:
            work, headers = await self._take_handoff(h)
        except BaseException:
            self._sending_handoffs -= 1
            raise
        task = self._spawn(self._deliver_aside(h, work, headers), name=f"worker-{self.node}-handoff-{h.rid}", fatal=True)
        self._deliveries.add(task)
        self._handing_off[h.rid] = task
        task.add_done_callback(functools.partial(self._delivery_ended, h.rid))

    async def _deliver_aside(self, h: HandOff, work: m.DecodeWork, headers: dict[str, str] | None) -> None:
        """:meth:`_handoff_aside`'s task: deliver ``work`` (``h``'s); :meth:`_delivery_ended` follows its end."""
        await self._deliver_handoff(h, work, headers)

    def _delivery_ended(self, rid: str, task: asyncio.Task[None]) -> None:
        """Done callback of :meth:`_handoff_aside`'s task for ``rid`` (ended, failed or cancelled): it leaves
        :attr:`_deliveries`, :attr:`_sending_handoffs` and :attr:`_handing_off`, the step may send the next
        (:attr:`_send_room`), the loop is woken (a drain may be over, KV freed). A callback, not the task's
        ``finally``: a task cancelled before its first step never runs its body. An abort of the request whose
        handler ran in the turn the step made the task (``_on_abort`` cancels it) did that: the rid stayed in
        ``_handing_off`` for good, the re-dispatched attempt's work looped in :meth:`_newest_attempt` (its wait on
        the done task returned at once) and every later work of its subscription queued behind it; the drain of a
        phase switch never ended (a real-bytes fault run's w0 answered nothing for 3 minutes; session 58)."""
        self._sending_handoffs -= 1
        self._deliveries.discard(task)
        self._send_room.set()
        if self._handing_off.get(rid) is task:
            del self._handing_off[rid]
        self._input()

    async def _send_handoff(self, h: HandOff) -> None:
        work, headers = await self._take_handoff(h)
        await self._deliver_handoff(h, work, headers)

    async def _take_handoff(self, h: HandOff) -> tuple[m.DecodeWork, dict[str, str] | None]:
        """``h``'s DecodeWork with its K/V copied out of the engine (``kv_ready_at`` on the wall clock) and its trace
        headers; ``h.rid``'s stream is forgotten here."""
        self._streams.pop(h.rid, None)
        headers = self._traces.handoff(h.rid, h.decode_node) if self._traces else None
        # A threaded engine's hand-off takes the engine's lock, which execute holds for a whole plan, and copies the
        # prompt's K/V into bytes: in the execute thread, after the plan in flight. Before, a hand-off published
        # beside the step loop (_hand_off_bound) waited for the lock on the loop: heartbeats, NATS pings and the
        # metrics endpoint stopped for the rest of the forward (a 256-token chunk of a hidden-512, 8-layer llama on
        # CPU: 20-140 ms). The rid stays registered meanwhile (_step_rids or _handing_off keep it at a drain).
        work = await self._beside_step(self.engine.handoff, h.work) if self.engine.threaded else self.engine.handoff(h.work)
        work = msgspec.structs.replace(work, kv_ready_at=self._to_wall(work.kv_ready_at))  # the decode node's clock is wall-based
        return work, headers

    async def _deliver_handoff(self, h: HandOff, work: m.DecodeWork, headers: dict[str, str] | None) -> None:
        """Send ``work`` (``h``'s, K/V inside) to its decode node: the K/V in pieces, then the DecodeWork naming them;
        a failure fails the request (:meth:`_reject`, ``requests.handoff_failed``)."""
        size = len(work.kv)
        pieces = 0
        if size:
            # a real engine's K/V grows with the prompt past any NATS message: it goes ahead in pieces, each answered
            # (handoffkv.py), and the work that follows names them. Before, it went inside the work, one message: past
            # the server's max_payload the hand-off failed (18 MB of an 8-layer model's 1,100-token prompt; 1 MiB, the
            # default, is 8 tokens of Llama-3-8B)
            try:
                transfer, pieces = await self._send_kv(h.decode_node, work.rid, work.kv, attempt=work.attempt, router=work.router)
            except (handoffkv.KvSendFailed, BusError, ValueError) as e:
                self.counters["requests.handoff_failed"] += 1
                reason = f"hand-off to {h.decode_node} failed ({size} B of K/V): {e}"
                await self._reject(WorkRejected(h.rid, reason), self.clock.local_now())
                return
            work = msgspec.structs.replace(work, kv=b"", kv_bytes=size, kv_transfer=transfer, kv_chunks=pieces)  # its bytes freed
        try:
            await self.bus.publish(WORK_DECODE, work, node=h.decode_node, headers=headers)
        except Exception as e:  # the bus refused it (NATS gone past its buffer): fail it, never hang
            self.counters["requests.handoff_failed"] += 1
            reason = f"hand-off to {h.decode_node} failed ({size} B of K/V): {e!r}"
            if work.kv_transfer:  # the decode node holds its K/V: freed now, not after its timeout
                await self._cancel_kv(h.decode_node, work.kv_transfer, work.rid, f"its work was not sent: {e!r}")
            await self._reject(WorkRejected(h.rid, reason), self.clock.local_now())
            return
        self._owners.pop(h.rid, None)
        self.counters["requests.handed_off"] += 1
        self.counters["handoff.sent_bytes"] += size
        self.counters["handoff.sent_chunks"] += pieces
        if self.cfg.log_requests:
            self.log.info("request handed off", rid=h.rid, decode=h.decode_node, kv_bytes=size, kv_chunks=pieces)

    async def _send_kv(self, decode_node: str, rid: str, kv: bytes, *, attempt: int = 0, router: str = "") -> tuple[str, int]:
        """Send ``kv``, the hand-off K/V of ``rid`` (its work's ``attempt`` and ``router``), to ``decode_node`` in pieces
        (``work.<decode_node>.kv``) of at most ``handoffkv.CHUNK_CAP_BYTES`` under this connection's ``max_payload``,
        ``handoffkv.WINDOW`` in flight; returns (its transfer id, its piece count) once the decode node has answered
        every one. A send that fails or is cancelled once a piece went out tells the decode node to free what it
        holds (``KvCancel``, :meth:`_cancel_kv`): before, it held the partial K/V until its timeout.

        Raises:
            handoffkv.KvSendFailed: a piece refused (its answer's ``error``, or the request refused as invalid, or
                not allowed), or unanswered after ``handoffkv.TRIES`` sends of ``--handoff-chunk-timeout-s`` each, or
                refused ``full`` ``handoffkv.FULL_TRIES`` times.
            ValueError: the server's ``max_payload`` leaves no room for a piece (``handoffkv.chunk_bytes``).
        """
        size = handoffkv.chunk_bytes(self.bus.max_payload)
        self._transfers += 1
        transfer = f"{self._transfer_tag}-{self._transfers}"
        pending: set[asyncio.Task[None]] = set()
        gate = _QueueGate(nbytes=len(kv))

        def settle(done: set[asyncio.Task[None]]) -> None:
            errors = [t.exception() for t in done]  # each one's outcome taken, so none is logged as never retrieved
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first

        sent = False
        try:
            for piece in handoffkv.split(kv, transfer=transfer, rid=rid, size=size, attempt=attempt, router=router):
                while len(pending) >= handoffkv.WINDOW:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    settle(done)
                pending.add(asyncio.create_task(self._send_piece(decode_node, piece, gate), name=f"worker-{self.node}-kv-{rid}"))
                sent = True
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                settle(done)
        except BaseException as e:
            if pending:  # one failed (or this send was cancelled): the rest are not waited for
                await cancel_until_done(pending)
            if sent:  # the decode node may hold some of it: freed there now, not after its timeout
                why = "the prefill node stopped sending it" if isinstance(e, asyncio.CancelledError) else str(e)
                await self._cancel_kv(decode_node, transfer, rid, why)
            raise
        finally:
            self._unqueue(gate)
        return transfer, handoffkv.pieces(len(kv), size)

    def _unqueue(self, gate: _QueueGate) -> None:
        """``gate``'s transfer no longer waits in a decode node's queue (admitted, or its send ended)."""
        if gate.counted:
            gate.counted = False
            self._queued_sends -= 1
            self._queued_send_bytes -= gate.nbytes

    async def _cancel_kv(self, decode_node: str, transfer: str, rid: str, why: str) -> None:
        """Tell ``decode_node`` that ``transfer`` (``rid``'s hand-off K/V) will not be completed (``KvCancel`` on
        ``work.<decode_node>.kvcancel``): best effort, core NATS, waited for at most ``handoffkv.CANCEL_TIMEOUT_S``
        (counted ``handoff.cancels_sent``; one the bus refuses, ``handoff.cancels_failed``: the decode node then frees
        the K/V at its idle timeout, as before). Never raises but a cancellation of the caller."""
        msg = m.KvCancel(transfer=transfer, rid=rid, reason=why[:500])
        try:
            await asyncio.wait_for(self.bus.publish(WORK_KV_CANCEL, msg, node=decode_node), handoffkv.CANCEL_TIMEOUT_S)
        except Exception as e:  # BusError, TimeoutError: the decode node's timeout frees it
            self.counters["handoff.cancels_failed"] += 1
            self.log.info("hand-off cancel not sent", rid=rid, transfer=transfer, decode=decode_node, error=repr(e))
            return
        self.counters["handoff.cancels_sent"] += 1

    async def _send_piece(self, decode_node: str, piece: m.KvChunk, gate: _QueueGate | None = None) -> None:
        """One piece of a hand-off's K/V, sent until answered (``handoffkv.TRIES`` sends; counted
        ``handoff.chunk_retries``). One refused ``full`` (``KvChunkAck.full``: the decode node's hand-off buffer has
        no room now) is sent again after ``handoffkv.full_backoff_s`` (counted ``handoff.chunk_full_retries``), up to
        ``handoffkv.FULL_TRIES`` sends; before, a full buffer failed the request at once (its client's 500). One whose
        transfer waits its turn in the decode node's queue (``KvChunkAck.queued``: its place) is asked again after
        ``handoffkv.queue_poll_s(place)`` (counted ``handoff.queue_asks``) for at most ``--handoff-queue-wait-s`` from
        the first such answer; before, it failed after the 2.5 s of ``full`` retries although the buffer drained.
        ``gate``, the transfer's pieces' shared state: one piece asks while the others of a queued transfer wait for
        it to be admitted (each ask carries a piece's data, up to 8 MiB), then go at once.

        Raises:
            handoffkv.KvSendFailed: refused (the answer's ``error``; the request refused as invalid; not allowed),
                unanswered, refused ``full`` every time, or queued past ``--handoff-queue-wait-s`` (the message says
                the buffer was full).
        """
        timeout = self.cfg.handoff_chunk_timeout_s
        gate = _QueueGate() if gate is None else gate
        last: BusError | None = None
        unanswered = full = 0
        waited = 0.0
        ask = False  # the next send is the transfer's data-less ask for its turn (handoffkv.ask_of), not the piece
        while unanswered < handoffkv.TRIES:
            try:
                ack = await self.bus.request(WORK_KV, handoffkv.ask_of(piece) if ask else piece, timeout=timeout, node=decode_node)
            except (RequestRefused, PermissionDenied) as e:  # sending it again changes nothing
                raise handoffkv.KvSendFailed(f"piece {piece.index} of {piece.count}: {e}") from None
            except BusError as e:  # no answer in time, nobody serving (the decode node restarting), a reconnect
                last = e
                unanswered += 1
                if unanswered < handoffkv.TRIES:
                    self.counters["handoff.chunk_retries"] += 1
                    if isinstance(e, NoResponders):  # answered at once: give a restarting decode node a moment
                        await asyncio.sleep(min(0.5, timeout))
                continue
            unanswered = 0  # answered: TRIES counts sends unanswered in a row (before, 3 spread over a queue wait failed it)
            asked, ask = ask, False
            if ack.transfer != piece.transfer or ack.index != piece.index:
                raise handoffkv.KvSendFailed(f"decode node {decode_node} refused piece {piece.index} of {piece.count}: "
                                             f"its answer names piece {ack.index} of {ack.transfer}")  # fmt: skip
            if ack.error and ack.full and ack.queued:  # its transfer waits its turn for room: first come, first served
                await self._wait_turn(decode_node, piece, gate, ack)
                ask = gate.asker == piece.index and not gate.admitted.is_set()
                continue
            if ack.error and ack.full:
                full += 1
                if full >= handoffkv.FULL_TRIES:
                    raise handoffkv.KvSendFailed(
                        f"decode node {decode_node}'s hand-off buffer was full: piece {piece.index} of {piece.count} "
                        f"refused {full} times over {waited:.1f} s ({ack.error})"
                    )
                self.counters["handoff.chunk_full_retries"] += 1
                pause = handoffkv.full_backoff_s(full)
                waited += pause
                await asyncio.sleep(pause)
                continue
            if ack.error:
                raise handoffkv.KvSendFailed(f"decode node {decode_node} refused piece {piece.index} of {piece.count}: {ack.error}")
            if asked:  # its turn came: the piece itself follows (admitted unless room went meanwhile: queued again)
                continue
            self._unqueue(gate)
            gate.admitted.set()  # the transfer is in: pieces held back by its queued ask go now
            return
        raise handoffkv.KvSendFailed(f"piece {piece.index} of {piece.count} unanswered by {decode_node} after "
                                     f"{handoffkv.TRIES} sends of {timeout:g} s: {last}")  # fmt: skip

    async def _wait_turn(self, decode_node: str, piece: m.KvChunk, gate: _QueueGate, ack: m.KvChunkAck) -> None:
        """``piece``'s transfer waits at place ``ack.queued`` of ``decode_node``'s queue for room: wait before asking
        again (``handoffkv.queue_poll_s``; counted ``handoff.queue_asks``) if this piece asks for the transfer,
        else until the asking piece is admitted (``gate``).

        Raises:
            handoffkv.KvSendFailed: queued ``--handoff-queue-wait-s`` since the transfer's first ``queued`` answer.
        """
        now = time.monotonic()
        if gate.since is None:
            gate.since = now
            self.counters["handoff.queued"] += 1
            if not gate.admitted.is_set():  # it waits: no longer one of the HANDOFF_SENDS_MAX being sent
                gate.counted = True
                self._queued_sends += 1
                self._queued_send_bytes += gate.nbytes
                self._send_room.set()
        left = gate.since + self.cfg.handoff_queue_wait_s - now
        if left <= 0:
            raise handoffkv.KvSendFailed(
                f"decode node {decode_node}'s hand-off buffer was full: transfer {piece.transfer} waited "
                f"{now - gate.since:.1f} s in its queue for room, at place {ack.queued} "
                f"(--handoff-queue-wait-s {self.cfg.handoff_queue_wait_s:g}; {ack.error})"
            )
        if gate.asker is None or gate.asker == piece.index:
            gate.asker = piece.index
            self.counters["handoff.queue_asks"] += 1
            await asyncio.sleep(min(left, handoffkv.queue_poll_s(ack.queued)))
            return
        try:  # another piece asks for the transfer: this one goes once it is in (or asks itself past the wait)
            await asyncio.wait_for(gate.admitted.wait(), left)
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ #
    # publishing helpers
    # ------------------------------------------------------------------ #

    def _valid_rid(self, rid: str) -> bool:
        try:
            check_token(rid, "rid")
        except ValueError as e:
            # no reply subject can be formed: count and drop
            self.counters["requests.bad_rid"] += 1
            self.log.warning("request with an invalid rid dropped", error=str(e))
            return False
        return True

    async def _reject(self, e: WorkRejected, now: float, *, attempt: int | None = None, router: str | None = None,
                      finish_reason: str = "error") -> None:
        """Fail ``e.rid`` with an error chunk at ``now`` (simulated s, local) (of ``attempt``; default: the attempt held here;
        owned by ``router``, default: the owner held here, ``TokenChunk.router``). ``finish_reason``
        ``abort`` instead: the node could serve it but the cluster cannot now (no decode node to bind), which
        the router answers with 503, not the 500 of an engine error."""
        self.counters["requests.errored"] += 1
        if self._traces:  # no decode node to bind (abort) is the cluster's state, not this node failing
            self._traces.forget(e.rid, "rejected", e.reason, error=finish_reason == "error")
        self.log.warning("work rejected", rid=e.rid, reason=e.reason)
        owner = self._owners.pop(e.rid, None)
        if attempt is None:
            attempt = owner.attempt if owner is not None else 0
        await self._publish_end(e.rid, finish_reason, e.reason, now, attempt=attempt,
                                router=router if router is not None else owner.router if owner is not None else "")  # fmt: skip

    async def _publish_end(self, rid: str, finish_reason: str, error: str, now: float, *, attempt: int, router: str) -> None:
        """Publish the last chunk of ``rid``'s stream (``finish_reason`` ``error`` or ``abort``, with ``error``) at
        ``now`` (simulated s, local) for ``attempt`` of router ``router`` (``TokenChunk.router``), touching none of
        this node's state of ``rid`` (it may hold another router's request of that id: :meth:`_newest_attempt`)."""
        await self.bus.publish(
            REQ_OUT,
            m.TokenChunk(rid=rid, node=self.node, finished=True, finish_reason=finish_reason, error=error, ts=self._to_wall(now),
                         attempt=attempt, router=router),  # fmt: skip
            rid=rid,
            node=self.node,
        )

    def _engine_kv_events(self, events: list[m.KvEvent], *, step_done: bool = False) -> None:
        """Hand the engine a drained KV event batch, then free the fetched bytes of the fetches
        that ended (after the events: a completed fetch's ``BlockStored(host)`` takes them first).
        The engine keeps the registrations of the scheduler's requests, of the step in flight's
        (``_step_rids``; not once ``step_done``: its plan has run) and of the hand-offs going out.

        Raises:
            EngineFatal: the engine's KV is out of step (the node is failed first: :meth:`_fail`).
            Exception: anything else the engine raised, after failing the node too: the batch is
                drained from the core, so an engine that did not take all of it (a CUDA
                out-of-memory in a page copy) has a page map out of step with the pools.
        """
        given = events
        if events and self.cfg.fault_skip_engine_kv_batch:
            self._kv_batches += 1
            if self._kv_batches == self.cfg.fault_skip_engine_kv_batch:  # injected fault: the engine misses it
                self.counters["engine.kv_batches_skipped_by_fault"] += 1
                given = []
        step = frozenset() if step_done else self._step_rids
        keep = step.union(self._handing_off) if self._handing_off else step
        if self.engine.threaded:
            # a threaded engine applies the batch after the plan in flight when that plan holds its lock
            # (TorchEngine.on_kv_events): the live rids as they are now, not when it gets to them
            live: Any = frozenset(self.core.requests).union(keep)
        else:
            live = _Live(self.core.requests, keep) if keep else self.core.requests
        with self._fatal_on_error("engine KV events"):
            self.engine.on_kv_events(given, live, self.core.snapshot)
            for fetch_id in self.core.take_fetch_ends():
                self.engine.drop_fetched(fetch_id)

    def _mirror_pool(self, events: list[m.KvEvent]) -> None:
        """``--kv-pool real``: the pool follows the host-tier ``events``: synthetic payloads at once, the
        engine's L2 bytes (external payloads) in two steps: the bookkeeping here (evictions, clears, a slot
        claimed for each stored page: ``HostKvPool.claim_events``), the copies and their checksums in the
        execute thread after the plan in flight (:meth:`_fill_pool`), so the loop waits neither for the forward
        (the engine's lock) nor for the copies of a big batch; a page is offered to peers once filled. Raises
        what the pool raised, after failing the node (:meth:`_fail`): a pool that took part of a batch serves
        pages L2 no longer holds."""
        if not events or self.kvpool is None:
            return
        with self._fatal_on_error("real-bytes pool mirror"):
            if self.kvpool.buffer.payload == "synthetic":
                self.kvpool.apply_kv_events(events)
                return
            claims = self.kvpool.claim_events(events)
        if not claims:
            return
        if self._stopped:  # the pool goes with the node (the execute thread may be shut down)
            for h, slot in claims:
                self.kvpool.fill(h, slot, None)
            return
        copies = self._beside_plan(self._fill_slots, claims) if self.engine.threaded else None
        task = self._spawn(self._fill_pool(claims, copies), name="pool-fill", fatal=True)
        if copies is not None:  # stop() cancelled it before it ran: its copies do not run either
            task.add_done_callback(lambda t: copies.cancel() if t.cancelled() else None)

    async def _fill_pool(self, claims: list[tuple[int, int]], copies: asyncio.Future[list[int | None]] | None) -> None:
        """Copy the engine's L2 bytes of the claimed pages into their pool slots and checksum them (:meth:`_fill_slots`):
        ``copies``, the future of that call that :meth:`_mirror_pool` queued in the execute thread (after the plan in
        flight and its :meth:`_execute_plan`, :meth:`_beside_plan`; a threaded engine's ``copy_to_pool`` takes its lock
        and applies the KV batches given before it first, this claim's among them), or None: here, at once (an
        unthreaded engine). Then make them held here (``HostKvPool.fill``: a page evicted or cleared meanwhile is not). Before, ``TorchEngine.mirror_pool``
        ran on the loop: it waited for the rest of the forward, then for the copy and CRC of every page (127-323
        ms measured on CPU; ``tests/unit/worker/test_torch_pool_loop.py``)."""
        pool = self.kvpool
        assert pool is not None
        try:
            crcs = await copies if copies is not None else self._fill_slots(claims)
        except asyncio.CancelledError:
            raise  # stop(): the copies may still run in the thread; the pool goes with the node, claimed
        except BaseException:
            for h, slot in claims:
                pool.fill(h, slot, None)
            raise
        for (h, slot), crc in zip(claims, crcs):
            pool.fill(h, slot, crc)

    def _fill_slots(self, claims: list[tuple[int, int]]) -> list[int | None]:
        """The bytes of :meth:`_fill_pool` (in the execute thread for a threaded engine): the engine's
        ``copy_to_pool`` into the claimed slots (pinned: never another block's meanwhile), then each slot's
        CRC-32 (None for a page L2 no longer held)."""
        from services.worker.kvpool.payload import checksum

        assert self.kvpool is not None
        views = [self.kvpool.buffer.slot_view(slot) for _, slot in claims]
        done = self.engine.copy_to_pool([(h, v) for (h, _), v in zip(claims, views)])
        return [checksum(v) if ok else None for v, ok in zip(views, done)]

    def _fail(self, e: BaseException, where: str) -> None:
        """The node cannot serve on (``where``: the step, a handler, a background task): stop taking
        work and signal the process shell (:attr:`fatal`), which stops the node and exits non-zero.
        Logged at error with the traceback and the requests it held (up to 64 rids; the router
        re-dispatches them once it fences the node). Idempotent: only the first failure is kept."""
        if self.fatal.is_set():
            return
        self.counters["engine_fatal" if isinstance(e, EngineFatal) else "node_fatal"] += 1
        self.accepting = False
        self.fatal_error = e
        why = (
            "engine failed: its KV can no longer be trusted"
            if isinstance(e, EngineFatal)
            else "engine failed: a step hung past --watchdog-timeout-s"
            if isinstance(e, StepHung)
            else "node failed: the event loop was blocked past --watchdog-timeout-s"
            if isinstance(e, LoopBlocked)
            else "node superseded: a process started later serves this node id"
            if isinstance(e, Superseded)
            else "engine failed: an unexpected error left the node unable to make progress"
        )
        rids = list(dict.fromkeys((*self.core.requests, *self._owners)))  # with one the core handed off, not yet sent
        self.log.error(
            f"{why}; the node exits" + ("" if isinstance(e, Superseded) else " to be restarted"), where=where, error=repr(e),
            requests=len(rids), rids=rids[:64], exc_info=None if isinstance(e, Superseded) else e,
        )  # fmt: skip
        self.fatal.set()

    def _on_hang(self, e: StepHung | LoopBlocked, stacks: str) -> None:
        """``--watchdog-timeout-s``: the engine step in flight hung, or with no step in flight the
        event loop ran nothing (a handler blocks it: :class:`LoopBlocked`); called on the watchdog's
        thread (the execute thread and the event loop may both be stuck). Log at error the step (its
        requests, up to 64, and its size; or how long the loop ran nothing) and every thread's
        Python stack, stop taking work (the heartbeat says ``accepting=False``) and fail the node
        on the loop (:meth:`_fail`:
        the service stops, its last ``node.state`` and ``AllBlocksCleared`` go out); the watchdog
        then exits the process with status 1, at once when the stop is done, else after its
        grace (a loop blocked too). Its supervisor restarts it; the router re-dispatches what it held."""
        self.counters["watchdog.timeouts"] += 1
        self.accepting = False
        if isinstance(e, LoopBlocked):
            self.counters["watchdog.loop_blocked"] += 1
            self.log.error("event loop blocked past --watchdog-timeout-s with no engine step in flight; the node exits to be restarted",
                           elapsed_s=round(e.elapsed_s, 3), timeout_s=self.cfg.watchdog_timeout_s, stacks=stacks)  # fmt: skip
        else:
            self._log_step_hung(e, stacks)
        # Stopping now (``_stopped`` but not ``_stop_done``): stop() says exit_ready once its last messages
        # are out (it reads ``fired``, set before this call, after setting _stop_done, read here after: one
        # of the two sees the other). Before, the exit came at once, before the last node.state and
        # AllBlocksCleared.
        if self._stop_done:  # stopped already (a SIGTERM while the forward hung): nothing left to stop
            if self.watchdog is not None:
                self.watchdog.exit_ready()
        elif not self._stopped and self._loop is not None:  # a blocked loop runs it only if it recovers: else the grace ends it
            self._loop.call_soon_threadsafe(self._fail, e, "step" if isinstance(e, StepHung) else "event loop")

    def _log_step_hung(self, e: StepHung, stacks: str) -> None:
        """The error line of a hung step (:meth:`_on_hang`): the step, its requests and ``stacks``."""
        info = e.info
        self.log.error(
            "engine step hung past --watchdog-timeout-s; the node exits to be restarted",
            step=info.seq, elapsed_s=round(e.elapsed_s, 3), timeout_s=self.cfg.watchdog_timeout_s, requests=len(info.rids),
            rids=list(info.rids[:64]), prefill_tokens=info.prefill_tokens, decode_rows=info.decode_rows,
            iterations=info.iterations, awaiting=await_chain(self._loop_task), stacks=stacks,
        )  # fmt: skip

    def _hang_forever(self) -> None:
        """``--fault-hang-step``: a forward that never returns (the thread waits for an event nobody sets)."""
        self._fault_hang.wait()

    def _block_loop_forever(self) -> None:
        """``--fault-block-loop-at-s``: a handler that never returns, on the event loop (it waits for
        the event ``--fault-hang-step`` waits for: nobody sets it)."""
        if self._stopped:
            return
        self.counters["loop.blocked_by_fault"] += 1
        self._fault_hang.wait()

    @contextlib.contextmanager
    def _fatal_on_error(self, where: str, *, allowed: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Run engine or core code that may leave the node half-updated when it raises: any
        exception but ``allowed`` (the refusals the code documents) fails the node (:meth:`_fail`)
        and is raised on (a bus handler logs it; the step loop stops)."""
        try:
            yield
        except allowed:
            raise
        except Exception as e:
            self._fail(e, where)
            raise

    async def _flush_kv(self, now: float, *, step_done: bool = False) -> None:
        """Drain the core's KV events into the engine (:meth:`_engine_kv_events`; ``step_done``: the step in
        flight has run, its requests are no longer kept), the real-bytes pool and the bus."""
        events = self.core.take_kv_events()
        self._engine_kv_events(events, step_done=step_done)
        if not events:
            # alive batch: a node that serves and stores no block (a long decode: output tokens store none) tells
            # the directory its publisher works, or the directory's liveness check (services/kvdirectory/
            # liveness.py, issue #22) called a healthy node's view stale after --kv-stale-after-s of decoding and
            # left its cache out of lookups. It goes through _publish_kv, so a broken publisher sends none either
            due = self._alive_due_s()
            if due is not None and due <= ALIVE_EARLY_S:
                self.kv_seq += 1
                self.counters["kv.alive_batches"] += 1
                await self._publish_kv(self.kv_seq, [], now)
            return
        self._mirror_pool(events)  # the real-bytes pool mirrors L2 (host-tier events)
        self.kv_seq += 1
        await self._publish_kv(self.kv_seq, events, now)

    def _alive_due_s(self) -> float | None:
        """Wall seconds (monotonic) until this node's next alive ``kv.events`` batch is due (:meth:`_flush_kv`):
        ``--kv-alive-interval-s`` after its last batch, 0 when past; None while its last ``node.state`` held no
        running or waiting request (an idle node rightly sends none), and with ``EI_KV_ALIVE_INTERVAL_S=inf`` (no alive
        batch ever: the directory's staleness turned off). O(1)."""
        running, waiting, _ = self._last_state_counts
        if running + waiting == 0 or self.cfg.kv_alive_interval_s == float("inf"):
            return None
        return max(0.0, self._last_kv_mono + self.cfg.kv_alive_interval_s - time.monotonic())

    async def _publish_kv(self, seq: int, events: list[m.KvEvent], now: float) -> None:
        """Publish batch ``seq`` of ``events`` (empty: an alive batch, :meth:`_flush_kv`) on ``kv.events.<node>``
        stamped ``now`` (simulated s, local; sent wall-based). Raises what the bus raises."""
        self._last_kv_mono = time.monotonic()
        if self.cfg.fault_drop_kv_events:  # injected fault: a broken KV publisher (the directory must notice)
            self.counters["kv.batches_dropped_by_fault"] += 1
            return
        await self.bus.publish(KV_EVENTS, m.KvEventBatch(node=self.node, seq=seq, ts=self._to_wall(now), events=events), node=self.node)
        self.counters["kv.batches"] += 1

    async def _publish_state(self, now: float) -> None:
        """Publish ``node.state`` as of ``now`` (simulated s, local; its ``ts`` goes out wall-based)."""
        self.state_seq += 1
        st = self.core.state(now)
        st = msgspec.structs.replace(
            st,
            # hand-offs waiting in this decode node's queue for room are decode work waiting too: the router's decode
            # choice (running + waiting) sees a full decode node as loaded. Before, it kept binding requests to it.
            # Only tickets that hold others back count, at most 16 of one sender (handoffkv.KvAssembler.holding):
            # before, every ticket counted, so forged or idle ones pushed the planner's decode queue (second review 55)
            waiting=st.waiting + self._kv_in.holding(time.monotonic()),
            ts=self._to_wall(now),
            seq=self.state_seq,
            epoch=self.epoch,
            accepting=self.accepting and self._switch is None,
            engine=self.engine.name,
            boot=self.boot,
            pid=self.pid,
        )
        self._last_state_mono = time.monotonic()
        self._last_state_counts = (st.running, st.waiting, st.decoding)
        await self.bus.publish(NODE_STATE, st, node=self.node)

    async def _publish_if_stopped(self, now: float) -> None:
        """The engine has no plan to run at ``now`` (idle, or waiting for KV): publish ``node.state`` at once
        (not throttled) when its counts differ from the last one that went out.

        States go out at plan launches (at most every ``state_interval_s``) and, with no launch, every
        ``idle_state_interval_s`` (1 wall s: 50 simulated s at the demo's speed-up 50). A launch's state
        shows the batch before the plan finishes it, so the last launch of a busy period left its batch
        (``decoding`` ≥ 1, a prompt in ``queue``) as the node's state for up to that long after the node
        had finished it. The evolving planner integrates ``decoding`` over time for q̄ (Eq. 4/5): on the
        demo's Claude Code sessions it measured q̄ 1.7–2.9 requests live against 0.14–0.39 in
        ``simulate`` (which samples the exact state every 5 s), predicted decode batches ~10× too large
        and moved to 1P3D where ``simulate`` kept 2P2D. O(hand-off queue) when the counts did not change."""
        st = self.core.state(now, with_queue=False)
        if (st.running, st.waiting + self._kv_in.holding(time.monotonic()), st.decoding) != self._last_state_counts:
            self.counters["state.on_stop"] += 1
            await self._publish_state(now)

    async def _state_heartbeat(self) -> None:
        """node.state at least every ``idle_state_interval_s`` (liveness for the router)."""
        interval = self.cfg.idle_state_interval_s
        while True:
            due = self._last_state_mono + interval
            if time.monotonic() < due:
                await sleep_until(due)  # one asyncio.sleep wakes early under uvloop (a spin)
                continue  # a state may have gone out meanwhile
            self._check_reconnect()  # also when no count message comes after the reconnect
            try:
                await self._publish_state(self.clock.local_now())
            except Exception as e:
                self.log.debug("state publish failed", error=repr(e))
                await asyncio.sleep(interval)

    def _take_records(self) -> None:
        """Take the core's iteration records, their ``start`` moved onto the wall-based clock now
        (the planner compares them with other nodes' and its own)."""
        records = self.core.take_records()
        if records:
            off = self._wall_offset()
            self._records.extend(msgspec.structs.replace(r, start=r.start + off) for r in records)

    async def _flush_iters(self) -> None:
        self._take_records()
        if not self._records:
            return
        records, self._records = self._records, []
        await self.bus.publish(NODE_ITERS, m.IterationRecords(node=self.node, records=records), node=self.node)

    async def _flush_iters_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.iters_flush_s)
            try:
                await self._flush_iters()
            except Exception as e:
                self.log.debug("iteration records publish failed", error=repr(e))
