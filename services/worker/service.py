"""WorkerService: the asyncio shell of one node (symmetric engine host).

Contains zero decision logic: batching, chunking, KV blocks and eviction are
decided by ``EngineScheduler`` (``scheduler.py``); this file decodes messages,
calls the core with ``clock.now()``, waits for the engine, and publishes what
the core returns (STYLE §2.1, §6).

Subjects (DESIGN §3, ``shared/subjects.py``):

    in   work.<node>.prefill (PrefillWork)   work.<node>.decode (DecodeWork)
         work.<node>.abort (RequestAbort)    split.commands (SplitCommand)
         kv.counts.<node> (CountUpdates)     kv.resync.<node> (request → KvSnapshot)
    out  req.<rid>.out (TokenChunk)          kv.events.<node> (KvEventBatch, seq 1, 2, ...)
         node.state.<node> (NodeState)       node.iters.<node> (IterationRecords)
         work.<decode node>.decode (DecodeWork, PD hand-off)
         split.applied (SplitApplied)

Live loop: ``plan = core.schedule(now)``; wait until the plan's end on the
simulated clock (the wall deadline is fixed at launch, so Python overhead is
not added on top; when behind, no wait); ``finish_iteration``; publish. When
idle it waits for new work or the core's next deadline, never spinning.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import structlog

from shared import messages as m
from shared.bus import Bus
from shared.clock import SimClock
from shared.profile import load_profile
from shared.subjects import (
    KV_COUNTS,
    KV_EVENTS,
    KV_RESYNC,
    NODE_ITERS,
    NODE_STATE,
    REQ_OUT,
    SPLIT_APPLIED,
    SPLIT_COMMANDS,
    WORK_ABORT,
    WORK_DECODE,
    WORK_PREFILL,
    check_token,
)
from services.worker.config import WorkerConfig
from services.worker.engines.base import Engine
from services.worker.engines.sim import SimEngine
from services.worker.plan import HandOff, IterationPlan, TokensOut, WorkRejected
from services.worker.scheduler import EngineScheduler

ENGINES: dict[str, type[SimEngine]] = {"sim": SimEngine}
"""Engine kinds by ``WorkerConfig.engine``."""


@dataclass(slots=True)
class _Stream:
    """Output tokens of one request not yet streamed (stream_interval coalescing)."""

    start: int
    """Output index of ``pending[0]``."""
    pending: list[int] = field(default_factory=list)


class WorkerService:
    """One node: NATS in, ``EngineScheduler`` + engine, NATS out.

    Args:
        cfg: the worker configuration.
        bus: a connected bus (instance ``worker-<node>``).
        clock: the cluster's simulated clock.

    Raises:
        shared.profile.ProfileError: if the profile cannot be loaded.
        ValueError: if the profile does not suit the scheduler (see EngineScheduler).
    """

    def __init__(self, cfg: WorkerConfig, bus: Bus, clock: SimClock) -> None:
        self.cfg = cfg
        self.bus = bus
        self.clock = clock
        self.node = cfg.node
        self.profile = load_profile(cfg.profile)
        self.core = EngineScheduler(
            cfg.node,
            self.profile,
            cfg.phase,
            host_eviction=cfg.host_eviction,
            check_invariants=cfg.check_invariants,
        )
        self.engine: Engine = ENGINES[cfg.engine](self.profile)
        self.counters: Counter[str] = Counter()
        self.log = structlog.get_logger("worker").bind(node=cfg.node)
        self.epoch = 0
        self.kv_seq = 0
        self.state_seq = 0
        self.accepting = False
        self._streams: dict[str, _Stream] = {}
        self._records: list[m.IterationRecord] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_state_wall = 0.0

    # ------------------------------------------------------------------ #
    # lifecycle
    # ------------------------------------------------------------------ #

    async def start(self) -> None:
        """Subscribe, announce an empty KV (seq 1: AllBlocksCleared) and start the loop."""
        b, node = self.bus, self.node
        await b.subscribe(WORK_PREFILL, self._on_prefill, node=node)
        await b.subscribe(WORK_DECODE, self._on_decode, node=node)
        await b.subscribe(WORK_ABORT, self._on_abort, node=node)
        await b.subscribe(SPLIT_COMMANDS, self._on_split)
        await b.subscribe(KV_COUNTS, self._on_counts, node=node)
        await b.serve(KV_RESYNC, self._on_resync, node=node)
        self.accepting = True
        now = self.clock.now()
        await self._flush_kv(now)
        await self._publish_state(now)
        for coro, name in (
            (self._run(), "loop"),
            (self._state_heartbeat(), "state"),
            (self._flush_iters_periodically(), "iters"),
        ):
            self._tasks.append(asyncio.create_task(coro, name=f"worker-{node}-{name}"))
        self.log.info("worker started", profile=self.profile.name, phase=self.core.phase, engine=self.engine.name)

    async def stop(self) -> None:
        """Stop the loop, flush iteration records and announce ``accepting=False``."""
        self.accepting = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        try:
            await self._flush_iters()
            await self._publish_state(self.clock.now())
        except Exception as e:  # connection already gone: nothing more to say
            self.log.debug("final publish failed", error=repr(e))

    def ready(self) -> bool:
        return self.accepting

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """Counters (requests, iterations, KV batches) and gauges (KV use, batch)."""
        st = self.core.state(self.clock.now())
        gauges = {
            "gpu_free_blocks": float(st.gpu_free_blocks),
            "gpu_total_blocks": float(st.gpu_total_blocks),
            "gpu_used_blocks": float(st.gpu_total_blocks - st.gpu_free_blocks),
            "host_used_blocks": float(st.host_used_blocks),
            "host_total_blocks": float(st.host_total_blocks),
            "running": float(st.running),
            "waiting": float(st.waiting),
            "decoding": float(st.decoding),
            "epoch": float(self.epoch),
            "kv_seq": float(self.kv_seq),
        }
        counters = dict(self.counters)
        counters["iterations"] = self.core.iterations
        return counters, gauges

    # ------------------------------------------------------------------ #
    # handlers
    # ------------------------------------------------------------------ #

    async def _on_prefill(self, work: m.PrefillWork, _subject: str) -> None:
        self.counters["requests.received"] += 1
        self.counters["requests.received.prefill"] += 1
        if not self._valid_rid(work.rid):
            return
        now = self.clock.now()
        try:
            if not self.accepting:
                raise WorkRejected(work.rid, f"node {self.node} is shutting down")
            if work.decode_node is not None:
                try:
                    check_token(work.decode_node, "decode_node")
                except ValueError as e:
                    raise WorkRejected(work.rid, str(e)) from None
            self.core.add_prefill(work, now)
        except WorkRejected as e:
            await self._reject(e, now)
            return
        self._wake.set()

    async def _on_decode(self, work: m.DecodeWork, _subject: str) -> None:
        self.counters["requests.received"] += 1
        self.counters["requests.received.decode"] += 1
        if not self._valid_rid(work.rid):
            return
        now = self.clock.now()
        try:
            if not self.accepting:
                raise WorkRejected(work.rid, f"node {self.node} is shutting down")
            self.core.add_decode(work, now)
        except WorkRejected as e:
            await self._reject(e, now)
            return
        await self._flush_kv(now)  # a reservation may have evicted blocks
        self._wake.set()

    async def _on_abort(self, msg: m.RequestAbort, _subject: str) -> None:
        now = self.clock.now()
        if not self.core.abort(msg.rid, now):
            self.counters["aborts.unknown"] += 1
            return
        self.counters["requests.aborted"] += 1
        st = self._streams.pop(msg.rid, None)
        if self._valid_rid(msg.rid):
            await self.bus.publish(
                REQ_OUT,
                m.TokenChunk(
                    rid=msg.rid,
                    node=self.node,
                    index=st.start if st else 0,
                    finished=True,
                    finish_reason="abort",
                    error=msg.reason or None,
                    ts=now,
                ),
                rid=msg.rid,
            )
        self._wake.set()  # freed KV may admit waiting work

    async def _on_split(self, cmd: m.SplitCommand, _subject: str) -> None:
        if cmd.epoch <= self.epoch:
            self.counters["split.ignored"] += 1
            return
        self.epoch = cmd.epoch
        phase = cmd.phases.get(self.node)
        if phase is None:
            return
        now = self.clock.now()
        self.core.set_phase(phase, now)
        self.counters["split.applied"] += 1
        await self.bus.publish(
            SPLIT_APPLIED,
            m.SplitApplied(
                epoch=cmd.epoch,
                node=self.node,
                phase=phase,
                status="serving",
                decided_at=cmd.decided_at,
                applied_at=now,
                switch_s=max(0.0, now - cmd.decided_at),
            ),
        )
        await self._publish_state(now)
        self._wake.set()

    async def _on_counts(self, msg: m.CountUpdates, _subject: str) -> None:
        try:
            self.core.update_counts(msg.hashes, msg.counts)
        except ValueError as e:
            self.counters["counts.invalid"] += 1
            self.log.warning("invalid count update dropped", error=str(e))

    async def _on_resync(self, req: m.KvResyncRequest, _subject: str) -> m.KvSnapshot:
        now = self.clock.now()
        # drain pending events and snapshot in one synchronous step, so the
        # snapshot is exactly the state after batch `seq`
        events = self.core.take_kv_events()
        gpu, host = self.core.snapshot()
        if events:
            self.kv_seq += 1
        seq = self.kv_seq
        if events:
            await self._publish_kv(seq, events, now)
        self.counters["kv.resyncs"] += 1
        return m.KvSnapshot(node=self.node, seq=seq, block_size=self.profile.block_size, gpu=gpu, host=host)

    # ------------------------------------------------------------------ #
    # loop
    # ------------------------------------------------------------------ #

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug must not stop the node: count, log, go on
                self.counters["loop_errors"] += 1
                self.log.exception("worker loop step failed", error=repr(e))
                await asyncio.sleep(0.1)

    async def _step(self) -> None:
        self._wake.clear()
        now = self.clock.now()
        horizon = now + self.cfg.fold_wall_s * self.clock.speedup if self.cfg.fold_wall_s > 0 else None
        plan = self.core.schedule(now, horizon)
        await self._flush_kv(now)
        if plan is None:
            deadline = self.core.next_deadline()
            timeout = None if deadline is None else max(0.0, self.clock.wall_at(deadline) - time.time())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
            return
        if time.time() - self._last_state_wall >= self.cfg.state_interval_s:
            await self._publish_state(now)
        duration = self.engine.execute(plan)
        end = plan.start + duration
        if self.engine.simulated:
            end = await self._wait_for_plan_end(plan, end)
        now = max(self.clock.now(), end)
        outs = self.core.finish_iteration(plan, now)
        for out in outs:
            if isinstance(out, TokensOut):
                await self._emit_tokens(out, now)
            elif isinstance(out, HandOff):
                await self._handoff(out)
        self._records.extend(self.core.take_records())
        await self._flush_kv(now)

    async def _wait_for_plan_end(self, plan: IterationPlan, end: float) -> float:
        """Sleep until the plan's end on the simulated clock; new work arriving while
        folded decode iterations run cuts the plan at the next iteration boundary."""
        while True:
            delay = self.clock.wall_at(end) - time.time()
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
            end = self.core.truncate(plan, self.clock.now())

    async def _emit_tokens(self, out: TokensOut, now: float) -> None:
        rid = out.rid
        tokens = self.engine.output_tokens(rid, out.index, out.count)
        if out.index == 0:
            # the first token streams at once and carries the prompt accounting
            await self.bus.publish(
                REQ_OUT,
                m.TokenChunk(
                    rid=rid,
                    node=self.node,
                    index=0,
                    token_ids=tokens,
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    prompt_tokens=out.prompt_tokens,
                    cached_tokens=out.cached_tokens,
                    ts=now,
                    queue_s=out.queue_s,
                ),
                rid=rid,
            )
            if out.finished:
                self.counters["requests.completed"] += 1
            else:
                self._streams[rid] = _Stream(start=out.count)
            return
        st = self._streams.get(rid)
        if st is None:
            st = self._streams[rid] = _Stream(start=out.index)
        st.pending.extend(tokens)
        if out.finished or len(st.pending) >= self.cfg.stream_interval:
            await self.bus.publish(
                REQ_OUT,
                m.TokenChunk(
                    rid=rid,
                    node=self.node,
                    index=st.start,
                    token_ids=st.pending,
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    ts=now,
                ),
                rid=rid,
            )
            st.start += len(st.pending)
            st.pending = []
        if out.finished:
            del self._streams[rid]
            self.counters["requests.completed"] += 1

    async def _handoff(self, h: HandOff) -> None:
        self._streams.pop(h.rid, None)
        await self.bus.publish(WORK_DECODE, h.work, node=h.decode_node)
        self.counters["requests.handed_off"] += 1

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

    async def _reject(self, e: WorkRejected, now: float) -> None:
        self.counters["requests.errored"] += 1
        self.log.warning("work rejected", rid=e.rid, reason=e.reason)
        await self.bus.publish(
            REQ_OUT,
            m.TokenChunk(rid=e.rid, node=self.node, finished=True, finish_reason="error", error=e.reason, ts=now),
            rid=e.rid,
        )

    async def _flush_kv(self, now: float) -> None:
        events = self.core.take_kv_events()
        if not events:
            return
        self.kv_seq += 1
        await self._publish_kv(self.kv_seq, events, now)

    async def _publish_kv(self, seq: int, events: list[m.KvEvent], now: float) -> None:
        await self.bus.publish(KV_EVENTS, m.KvEventBatch(node=self.node, seq=seq, ts=now, events=events), node=self.node)
        self.counters["kv.batches"] += 1

    async def _publish_state(self, now: float) -> None:
        self.state_seq += 1
        st = msgspec.structs.replace(
            self.core.state(now),
            seq=self.state_seq,
            epoch=self.epoch,
            accepting=self.accepting,
            engine=self.engine.name,
        )
        self._last_state_wall = time.time()
        await self.bus.publish(NODE_STATE, st, node=self.node)

    async def _state_heartbeat(self) -> None:
        """node.state at least every ``idle_state_interval_s`` (liveness for the router)."""
        interval = self.cfg.idle_state_interval_s
        while True:
            wait = self._last_state_wall + interval - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            try:
                await self._publish_state(self.clock.now())
            except Exception as e:
                self.log.debug("state publish failed", error=repr(e))
                await asyncio.sleep(interval)

    async def _flush_iters(self) -> None:
        self._records.extend(self.core.take_records())
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
