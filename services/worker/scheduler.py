"""EngineScheduler: the one scheduling loop of a symmetric engine (prefill, decode or both).

Contains zero I/O: no clock, no asyncio, no network, no logging setup. Every
call takes ``now`` (simulated seconds); the live shell (``service.py``) and the
discrete-event simulator drive the same object (DESIGN §2, §5).

Step contract (vLLM v1 ``schedule()`` / ``update_from_output()``, STYLE §1.1)::

    plan = sched.schedule(now, horizon)      # IterationPlan | None (idle)
    ...  the engine executes the plan: sim = wait plan.end - now
    outs = sched.finish_iteration(plan, plan.end)   # [TokensOut | HandOff]

Token budget (STYLE §1.2): each iteration hands out ``chunk_tokens`` tokens,
running requests first — every decoding request takes ``ceil(t_fwd)`` tokens,
then in-progress chunked prefills in admission order — then waiting requests
in arrival order while the budget lasts and fewer than ``max_running``
requests run. A waiting request is admitted only if L1 can hold its whole
footprint (no over-commit, no preemption); otherwise it and everything behind
it waits (FCFS).

KV footprint of a request in L1 (blocks of ``block_size`` tokens):
``ceil((prompt + max_tokens) / block_size)`` if it decodes on this node,
``ceil(prompt / block_size)`` if it is handed off to a decode node. A decode
request reserves its footprint when it arrives (conservative: no preemption,
so a request never runs out of KV mid-decode).

Iteration time (paper Eq. 1/2, ``shared.itermodel``): prefill part
``c0 + c1·Σt_uc + c2·ΣA + c3·Σt_rst`` over the chunks; decode part
``T_D(B)`` over the B decoding requests; a mixed iteration is one forward pass,
so it pays the fixed cost once: ``T_P + T_D − min(c0, d0)``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.itermodel import qk_pairs
from shared.messages import DecodeWork, IterationRecord, KvEvent, NodeState, Phase, PrefillWork, QueuedWork
from shared.profile import Profile
from services.worker.blocks import KvBlockManager
from services.worker.plan import HandOff, IterationPlan, OutputEvent, PrefillChunk, SchedulerError, TokensOut, WorkRejected

# request states: each live request is in exactly one container
WAITING = "waiting"  # prefill queue, holds no KV
PREFILLING = "prefilling"  # running: prompt partly computed
DECODE_QUEUED = "decode_queued"  # hand-off received, waiting for L1 room
TRANSFERRING = "transferring"  # L1 reserved, KV arriving (kv_ready_at) or waiting for a running slot
DECODING = "decoding"  # running: producing output tokens
DONE = "done"

PHASES: tuple[str, ...] = ("prefill", "decode", "both")
_MILLI = 1000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, eq=False)
class _Request:
    rid: str
    prompt_tokens: int
    max_tokens: int
    path: list[int]
    """Block hashes of the full prompt pages."""
    state: str
    arrived_at: float
    footprint: int
    """L1 slots the request needs in total (see module docstring)."""
    limit: int
    """Most prompt pages that may come from cache: (prompt − 1) // block_size."""
    handoff_to: str | None = None
    """Decode node after prefill; None = decode here."""
    prefill_work: PrefillWork | None = None
    cached: int = 0
    """t_c at admission: tokens from L1 hits plus L2 restores."""
    restored: int = 0
    """Tokens restored from L2 at admission."""
    computed: int = 0
    """Uncached prompt tokens computed so far."""
    held: int = 0
    """Leading pages of ``path`` this request references in L1."""
    reserved: int = 0
    """L1 slots reserved by this request that hold no hashed page."""
    generated: int = 0
    acc: int = 0
    """Fractional accepted tokens carried between decode iterations, in 1/1000 token."""
    ready_at: float = 0.0
    """Decode: when the transferred KV is usable."""
    admitted_at: float = 0.0
    """Prefill: launch time of the first chunk."""
    q_gpu: int = 0
    q_host: int = 0
    """Prefix match (pages in L1, then in L2) last seen while waiting, for NodeState.queue."""


class EngineScheduler:
    """Continuous batching with chunked prefill over paged L1/L2 KV for one node.

    Args:
        node: this node's id (a NATS token).
        profile: hardware/model profile (Eq. 1/2 coefficients, capacities, limits).
        phase: ``prefill``, ``decode`` or ``both`` (collocated): what work the node accepts.
        host_eviction: host (L2) eviction policy: ``lru`` or ``branch-count``.
        check_invariants: run the full O(blocks) invariant check after every
            step (tests, debug); the O(1) checks always run.

    Raises:
        ValueError: unknown phase or policy, or a profile whose token budget
            cannot hold a full decode batch plus one prefill token
            (``chunk_tokens <= max_running * ceil(t_fwd)``), or ``t_acc`` < 0.001.
    """

    def __init__(
        self,
        node: str,
        profile: Profile,
        phase: Phase = "both",
        *,
        host_eviction: str = "lru",
        check_invariants: bool = False,
    ) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.node = node
        self.profile = profile
        self.phase: Phase = phase
        self.block_size = profile.block_size
        self.chunk_tokens = profile.scheduler.chunk_tokens
        self.max_running = profile.scheduler.max_running
        self.fwd_tokens = _ceil_div(int(round(profile.decode.tokens_per_forward * _MILLI)), _MILLI)
        self.acc_milli = int(round(profile.decode.accepted_per_iteration * _MILLI))
        if self.acc_milli < 1:
            raise ValueError("profile.decode.accepted_per_iteration must be >= 0.001")
        if self.chunk_tokens <= self.max_running * self.fwd_tokens:
            raise ValueError(
                f"chunk_tokens {self.chunk_tokens} must exceed max_running × ceil(t_fwd) = "
                f"{self.max_running * self.fwd_tokens} so a full decode batch leaves budget for prefill"
            )
        self.check_invariants = check_invariants
        self.kv = KvBlockManager(profile.gpu_blocks, profile.host_blocks, profile.block_size, host_eviction)
        self.requests: dict[str, _Request] = {}
        self.waiting: OrderedDict[str, _Request] = OrderedDict()
        self.decode_queue: OrderedDict[str, _Request] = OrderedDict()
        self.transferring: OrderedDict[str, _Request] = OrderedDict()
        self.running: OrderedDict[str, _Request] = OrderedDict()
        self.n_decoding = 0
        self._inflight: IterationPlan | None = None
        self._records: list[IterationRecord] = []
        self.iterations = 0
        """Iterations executed (a k-iteration plan counts k)."""

    # ------------------------------------------------------------------ #
    # inputs
    # ------------------------------------------------------------------ #

    def set_phase(self, phase: Phase, now: float) -> None:
        """Change what work the node accepts from now on; queued and running work continues.

        Raises:
            ValueError: for an unknown phase.
        """
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.phase = phase

    def _check_common(self, rid: str, block_size: int, prompt_tokens: int, n_hashes: int, kind: str) -> None:
        if rid in self.requests:
            raise WorkRejected(rid, f"request {rid} is already on node {self.node}")
        if kind == "prefill" and self.phase == "decode":
            raise WorkRejected(rid, f"node {self.node} serves decode; prefill work refused")
        if kind == "decode" and self.phase == "prefill":
            raise WorkRejected(rid, f"node {self.node} serves prefill; decode work refused")
        if block_size != self.block_size:
            raise WorkRejected(rid, f"block size mismatch: work has {block_size}, node {self.node} uses {self.block_size}")
        if n_hashes != prompt_tokens // block_size:
            raise WorkRejected(
                rid, f"{n_hashes} block hashes for {prompt_tokens} prompt tokens (expected {prompt_tokens // block_size})"
            )

    def _check_fits(self, rid: str, footprint: int) -> None:
        if footprint > self.kv.gpu.capacity:
            raise WorkRejected(
                rid, f"request needs {footprint} KV blocks but node {self.node} has {self.kv.gpu.capacity} in GPU memory"
            )

    def add_prefill(self, work: PrefillWork, now: float) -> None:
        """Queue a request for prefill (and decode here when ``work.decode_node`` is None
        or this node). O(prompt pages) for the prefix match.

        Raises:
            WorkRejected: duplicate rid, the node does not serve prefill, block-size or
                hash-count mismatch, a prefill node given no other decode node, or a
                footprint larger than this node's L1.
        """
        rid = work.rid
        self._check_common(rid, work.block_size, work.prompt_tokens, len(work.block_hashes), "prefill")
        decode_here = work.decode_node is None or work.decode_node == self.node
        if decode_here and self.phase == "prefill":
            raise WorkRejected(rid, f"node {self.node} serves prefill only: the work must name a decode node")
        bs = self.block_size
        footprint = _ceil_div(work.prompt_tokens + (work.max_tokens if decode_here else 0), bs)
        self._check_fits(rid, footprint)
        r = _Request(
            rid=rid,
            prompt_tokens=work.prompt_tokens,
            max_tokens=work.max_tokens,
            path=list(work.block_hashes),
            state=WAITING,
            arrived_at=now,
            footprint=footprint,
            limit=(work.prompt_tokens - 1) // bs,
            handoff_to=None if decode_here else work.decode_node,
            prefill_work=work,
        )
        r.q_gpu, r.q_host = self.kv.match(r.path, r.limit)
        self.requests[rid] = r
        self.waiting[rid] = r

    def add_decode(self, work: DecodeWork, now: float) -> None:
        """Accept a prefill → decode hand-off. Reserves L1 for prompt + max_tokens now if
        there is room (else it waits, FIFO); the KV is usable from ``work.kv_ready_at``
        (or, when the reservation came later, from reservation + transfer time).

        Raises:
            WorkRejected: duplicate rid, the node does not serve decode, block-size or
                hash-count mismatch, nothing left to generate, or a footprint larger
                than this node's L1.
        """
        rid = work.rid
        self._check_common(rid, work.block_size, work.prompt_tokens, len(work.block_hashes), "decode")
        if work.generated >= work.max_tokens:
            raise WorkRejected(rid, f"nothing to decode: generated {work.generated} >= max_tokens {work.max_tokens}")
        footprint = _ceil_div(work.prompt_tokens + work.max_tokens, self.block_size)
        self._check_fits(rid, footprint)
        r = _Request(
            rid=rid,
            prompt_tokens=work.prompt_tokens,
            max_tokens=work.max_tokens,
            path=list(work.block_hashes),
            state=DECODE_QUEUED,
            arrived_at=now,
            footprint=footprint,
            limit=0,
            generated=work.generated,
        )
        self.requests[rid] = r
        if not self.decode_queue and self.kv.reserve(footprint):
            r.reserved = footprint
            r.ready_at = work.kv_ready_at
            r.state = TRANSFERRING
            self.transferring[rid] = r
        else:
            self.decode_queue[rid] = r

    def abort(self, rid: str, now: float) -> bool:
        """Drop ``rid`` wherever it is on this node and release its KV.
        Returns False if the node does not hold it. O(pages held)."""
        r = self.requests.pop(rid, None)
        if r is None:
            return False
        self._container(r.state).pop(rid)
        if r.state == DECODING:
            self.n_decoding -= 1
        self.kv.release(r.path, r.held, r.reserved)
        r.held = r.reserved = 0
        r.state = DONE
        return True

    def update_counts(self, hashes: list[int], counts: list[int]) -> int:
        """Branch counts from the KV directory (``kv.counts.<node>``); see
        :meth:`HostBlockPool.update_counts`. Returns the host blocks moved."""
        return self.kv.update_counts(hashes, counts)

    # ------------------------------------------------------------------ #
    # step
    # ------------------------------------------------------------------ #

    def schedule(self, now: float, horizon: float | None = None) -> IterationPlan | None:
        """Plan the next iteration(s) starting at ``now``; None when there is nothing to run.

        Args:
            now: launch time (simulated s).
            horizon: simulator only — the time of the next external input to this
                node. A pure-decode batch that cannot change before it (no
                admissible waiting work, no KV arrival before it) is advanced k
                identical iterations in one plan: k stops at the first request
                completion, and every folded iteration starts before
                ``min(horizon, next kv_ready_at)``. None (live) means k = 1.

        Raises:
            SchedulerError: if the previous plan was not finished.
        """
        if self._inflight is not None:
            raise SchedulerError("schedule() called while a plan is in flight; call finish_iteration() first")
        self._promote_decode(now)
        budget = self.chunk_tokens
        decode_reqs: list[_Request] = []
        prefill_reqs: list[_Request] = []
        chunks: list[PrefillChunk] = []
        for r in self.running.values():
            if r.state == DECODING:
                decode_reqs.append(r)
        budget -= len(decode_reqs) * self.fwd_tokens
        for r in self.running.values():
            if budget <= 0:
                break
            if r.state == PREFILLING:
                n = min(r.prompt_tokens - r.cached - r.computed, budget)
                chunks.append(self._chunk(r, n, restored=0))
                prefill_reqs.append(r)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            r = next(iter(self.waiting.values()))
            if not self._admit(r, now):
                break
            n = min(r.prompt_tokens - r.cached, budget)
            chunks.append(self._chunk(r, n, restored=r.restored))
            prefill_reqs.append(r)
            budget -= n
        if budget < 0:
            raise SchedulerError(f"token budget went negative ({budget})")
        if not chunks and not decode_reqs:
            self._check()
            return None

        p = self.profile
        sum_uc = sum(c.tokens for c in chunks)
        sum_qk = sum(int(qk_pairs(c.tokens, c.cached_before)) for c in chunks)
        sum_rst = sum(c.restored for c in chunks)
        sum_c = sum(c.cached_before for c in chunks)
        prefill_s = p.prefill.iteration_time(sum_uc, sum_qk, sum_rst) if chunks else 0.0
        decode_s = p.decode.iteration_time(len(decode_reqs)) if decode_reqs else 0.0
        iteration_s = prefill_s + decode_s
        if chunks and decode_reqs:
            iteration_s -= min(p.prefill.c0, p.decode.d0)
        k = 1
        if horizon is not None and not chunks and iteration_s > 0:
            k = self._skip_ahead(decode_reqs, now, horizon, iteration_s)
        plan = IterationPlan(
            start=now,
            iterations=k,
            iteration_s=iteration_s,
            end=now + k * iteration_s,
            prefill=chunks,
            decode=[r.rid for r in decode_reqs],
            prefill_s=prefill_s,
            decode_s=decode_s,
            sum_uncached=sum_uc,
            sum_qk_pairs=sum_qk,
            sum_restored=sum_rst,
            sum_cached=sum_c,
            reqs=prefill_reqs + decode_reqs,
        )
        self._inflight = plan
        self._check()
        return plan

    def finish_iteration(self, plan: IterationPlan, now: float) -> list[OutputEvent]:
        """Account a finished plan at ``now`` (normally ``plan.end``) and return its outputs.

        Chunks advance their requests and their newly full prompt pages become
        cached (L1 + L2 write-through, with KV events). A chunk that completes
        a prompt yields the first output token, then the request either
        finishes (max_tokens == 1), leaves with a :class:`HandOff` (PD), or joins
        the local decode batch. Each decoding request gains ``t_acc`` tokens per
        iteration (fractions carried exactly in 1/1000 token). Requests aborted
        while the plan was in flight are skipped.

        Raises:
            SchedulerError: if ``plan`` is not the plan in flight.
        """
        if plan is not self._inflight:
            raise SchedulerError("finish_iteration() got a plan that is not in flight")
        self._inflight = None
        k = plan.iterations
        self.iterations += k
        out: list[OutputEvent] = []
        n_chunks = len(plan.prefill)
        for chunk, r in zip(plan.prefill, plan.reqs[:n_chunks]):
            if r.state != PREFILLING:
                continue
            r.computed += chunk.tokens
            self._fill_computed(r)
            if not chunk.completes:
                continue
            r.generated = 1
            done = r.max_tokens <= 1
            out.append(
                TokensOut(
                    rid=r.rid,
                    index=0,
                    count=1,
                    finished=done,
                    finish_reason="length" if done else None,
                    prompt_tokens=r.prompt_tokens,
                    cached_tokens=r.cached,
                    at=now,
                    queue_s=r.admitted_at - r.arrived_at,
                )
            )
            if done:
                self._remove(r)
            elif r.handoff_to is not None:
                out.append(self._handoff(r, now))
                self._remove(r)
            else:
                r.state = DECODING
                self.n_decoding += 1
        for r in plan.reqs[n_chunks:]:
            if r.state != DECODING:
                continue
            total = r.acc + k * self.acc_milli
            n = min(total // _MILLI, r.max_tokens - r.generated)
            r.acc = total % _MILLI
            start = r.generated
            r.generated += n
            done = r.generated >= r.max_tokens
            if n or done:
                out.append(
                    TokensOut(
                        rid=r.rid,
                        index=start,
                        count=n,
                        finished=done,
                        finish_reason="length" if done else None,
                        prompt_tokens=r.prompt_tokens,
                        cached_tokens=r.cached,
                        at=now,
                    )
                )
            if done:
                self._remove(r)
        self._records.append(
            IterationRecord(
                start=plan.start,
                duration_s=plan.iteration_s,
                phase=plan.phase,  # type: ignore[arg-type]
                prefill_requests=n_chunks,
                sum_uncached=plan.sum_uncached,
                sum_qk_pairs=plan.sum_qk_pairs,
                sum_restored=plan.sum_restored,
                sum_cached=plan.sum_cached,
                decode_batch=len(plan.decode),
                repeat=k,
            )
        )
        self._check()
        return out

    def truncate(self, plan: IterationPlan, now: float) -> float:
        """Cut a folded pure-decode plan at the first iteration boundary at or after ``now``.

        New work that arrives while k identical decode iterations are in flight
        joins at the next iteration boundary, as it would without folding: the
        plan keeps ``j = max(1, ceil((now − start)/iteration_s))`` iterations.
        Returns the plan's (possibly earlier) end. A plan of one iteration, or a
        ``now`` past the plan's last boundary, is left unchanged.

        Raises:
            SchedulerError: if ``plan`` is not the plan in flight.
        """
        if plan is not self._inflight:
            raise SchedulerError("truncate() got a plan that is not in flight")
        if plan.iterations > 1 and not plan.prefill and plan.iteration_s > 0:
            j = max(1, _ceil_div_f(now - plan.start, plan.iteration_s)) if now > plan.start else 1
            if j < plan.iterations:
                plan.iterations = j
                plan.end = plan.start + j * plan.iteration_s
        return plan.end

    def next_deadline(self) -> float | None:
        """Earliest ``kv_ready_at`` of a decode request still waiting for its KV, or None.
        The caller should call :meth:`schedule` again at that time when idle."""
        if not self.transferring:
            return None
        return min(r.ready_at for r in self.transferring.values())

    # ------------------------------------------------------------------ #
    # outboxes and views
    # ------------------------------------------------------------------ #

    def take_kv_events(self) -> list[KvEvent]:
        """Drain the KV events (BlockStored / BlockRemoved / AllBlocksCleared) in order."""
        return self.kv.take_events()

    def take_records(self) -> list[IterationRecord]:
        """Drain the iteration records (one per plan, ``repeat`` = k)."""
        out = self._records
        self._records = []
        return out

    def snapshot(self) -> tuple[list[int], list[int]]:
        """``(L1 hashes, L2 hashes)`` as of the events drained so far plus pending ones."""
        return self.kv.snapshot()

    @property
    def inflight(self) -> IterationPlan | None:
        """The plan between ``schedule()`` and ``finish_iteration()``, if any."""
        return self._inflight

    def state(self, now: float) -> NodeState:
        """The node's state for ``node.state.<node>``; the shell fills seq, epoch,
        accepting and engine. ``queue`` lists in-progress chunked prefills (their
        remaining tokens) then waiting requests (their prefix match when last seen)."""
        bs = self.block_size
        queue: list[QueuedWork] = []
        for r in self.running.values():
            if r.state == PREFILLING:
                done = r.cached + r.computed
                queue.append(QueuedWork(rid=r.rid, uncached_tokens=r.prompt_tokens - done, cached_tokens=done))
        for r in self.waiting.values():
            cached = (r.q_gpu + r.q_host) * bs
            queue.append(
                QueuedWork(
                    rid=r.rid,
                    uncached_tokens=r.prompt_tokens - cached,
                    cached_tokens=cached,
                    restore_tokens=r.q_host * bs,
                )
            )
        remaining = max(0.0, self._inflight.end - now) if self._inflight is not None else 0.0
        gpu, host = self.kv.gpu, self.kv.host
        return NodeState(
            node=self.node,
            ts=now,
            phase=self.phase,
            block_size=bs,
            running=len(self.running),
            waiting=len(self.waiting) + len(self.decode_queue) + len(self.transferring),
            decoding=self.n_decoding,
            remaining_s=remaining,
            queue=queue,
            gpu_free_blocks=gpu.available,
            gpu_total_blocks=gpu.capacity,
            host_used_blocks=host.used,
            host_total_blocks=host.capacity,
        )

    # ------------------------------------------------------------------ #
    # internals
    # ------------------------------------------------------------------ #

    def _container(self, state: str) -> OrderedDict[str, _Request]:
        if state == WAITING:
            return self.waiting
        if state in (PREFILLING, DECODING):
            return self.running
        if state == DECODE_QUEUED:
            return self.decode_queue
        if state == TRANSFERRING:
            return self.transferring
        raise SchedulerError(f"request in state {state} has no container")

    def _chunk(self, r: _Request, n: int, restored: int) -> PrefillChunk:
        before = r.cached + r.computed
        return PrefillChunk(
            rid=r.rid, tokens=n, cached_before=before, restored=restored, completes=before + n >= r.prompt_tokens
        )

    def _admit(self, r: _Request, now: float) -> bool:
        """Move the head of the waiting queue to running if L1 can hold its footprint."""
        n_gpu, n_host = self.kv.match(r.path, r.limit)
        r.q_gpu, r.q_host = n_gpu, n_host
        new_slots = r.footprint - n_gpu
        if not self.kv.admit(r.path, n_gpu, new_slots):
            return False
        r.held, r.reserved = n_gpu, new_slots
        if n_host:
            self.kv.fill(r.path, n_gpu, n_gpu + n_host)
            r.held += n_host
            r.reserved -= n_host
        bs = self.block_size
        r.cached = (n_gpu + n_host) * bs
        r.restored = n_host * bs
        del self.waiting[r.rid]
        r.admitted_at = now
        r.state = PREFILLING
        self.running[r.rid] = r
        return True

    def _promote_decode(self, now: float) -> None:
        """Reserve L1 for queued hand-offs (FIFO), then move decode requests whose KV
        has arrived into the running batch while there is a running slot."""
        while self.decode_queue:
            r = next(iter(self.decode_queue.values()))
            if not self.kv.reserve(r.footprint):
                break
            del self.decode_queue[r.rid]
            r.reserved = r.footprint
            # the transfer starts once room is reserved (SGLang decode pre-allocation)
            r.ready_at = now + self.profile.kv_transfer_s(r.prompt_tokens)
            r.state = TRANSFERRING
            self.transferring[r.rid] = r
        if not self.transferring:
            return
        joined: list[_Request] = []
        for r in self.transferring.values():
            if len(self.running) + len(joined) >= self.max_running:
                break
            if r.ready_at <= now:
                joined.append(r)
        for r in joined:
            del self.transferring[r.rid]
            n = len(r.path)
            self.kv.fill(r.path, 0, n)
            r.held = n
            r.reserved -= n
            r.state = DECODING
            self.n_decoding += 1
            self.running[r.rid] = r

    def _fill_computed(self, r: _Request) -> None:
        full = min((r.cached + r.computed) // self.block_size, len(r.path))
        if full > r.held:
            self.kv.fill(r.path, r.held, full)
            r.reserved -= full - r.held
            r.held = full

    def _handoff(self, r: _Request, now: float) -> HandOff:
        w = r.prefill_work
        assert w is not None and r.handoff_to is not None
        p = self.profile
        work = DecodeWork(
            rid=r.rid,
            prompt_tokens=r.prompt_tokens,
            max_tokens=r.max_tokens,
            block_size=self.block_size,
            generated=r.generated,
            block_hashes=w.block_hashes,
            token_ids=w.token_ids,
            branch_id=w.branch_id,
            prefill_node=self.node,
            kv_ready_at=now + p.kv_transfer_s(r.prompt_tokens),
            kv_bytes=r.prompt_tokens * p.kv_bytes_per_token,
        )
        return HandOff(rid=r.rid, decode_node=r.handoff_to, work=work, at=now)

    def _remove(self, r: _Request) -> None:
        """A request leaves the node: its pages stay cached (unreferenced), slots are freed."""
        if r.state == DECODING:
            self.n_decoding -= 1
        self._container(r.state).pop(r.rid)
        del self.requests[r.rid]
        self.kv.release(r.path, r.held, r.reserved)
        r.held = r.reserved = 0
        r.state = DONE

    def _skip_ahead(self, decode_reqs: list[_Request], now: float, horizon: float, iteration_s: float) -> int:
        """k for a pure-decode plan: up to the first completion, all starts before the horizon."""
        m = self.acc_milli
        k_finish = min(_ceil_div((r.max_tokens - r.generated) * _MILLI - r.acc, m) for r in decode_reqs)
        h = horizon
        for r in self.transferring.values():
            if now < r.ready_at < h:
                h = r.ready_at
        k_h = _ceil_div_f(h - now, iteration_s) if h > now else 1
        return max(1, min(k_finish, k_h))

    def _check(self) -> None:
        """Invariants after every step: O(1) always, the full check when enabled."""
        n = len(self.waiting) + len(self.running) + len(self.decode_queue) + len(self.transferring)
        if n != len(self.requests):
            raise SchedulerError(f"{len(self.requests)} requests but {n} in state containers")
        if len(self.running) > self.max_running:
            raise SchedulerError(f"{len(self.running)} running > cap {self.max_running}")
        if self.kv.gpu.free < 0:
            raise SchedulerError(f"L1 over-committed by {-self.kv.gpu.free} blocks")
        if self.check_invariants:
            self.check()

    def check(self) -> None:
        """Full invariant check, O(requests + blocks): every request is in exactly one
        state container matching its state; KV held matches its state and footprint;
        decode count in sync; and the block pools' own invariants (refs equal holders,
        slots conserved, L1 ⊆ L2, eviction order leaf-first).

        Raises:
            SchedulerError or KvInvariantError: naming the first invariant that fails.
        """
        seen: set[str] = set()
        for name, cont, states in (
            ("waiting", self.waiting, (WAITING,)),
            ("running", self.running, (PREFILLING, DECODING)),
            ("decode_queue", self.decode_queue, (DECODE_QUEUED,)),
            ("transferring", self.transferring, (TRANSFERRING,)),
        ):
            for rid, r in cont.items():
                if r.state not in states or self.requests.get(rid) is not r or rid in seen:
                    raise SchedulerError(f"request {rid} in {name} has state {r.state}")
                seen.add(rid)
        if seen != set(self.requests):
            raise SchedulerError(f"requests outside every container: {set(self.requests) - seen}")
        if len(self.running) > self.max_running:
            raise SchedulerError(f"{len(self.running)} running > cap {self.max_running}")
        if self.n_decoding != sum(1 for r in self.running.values() if r.state == DECODING):
            raise SchedulerError("n_decoding out of sync")
        for r in self.requests.values():
            if r.state in (WAITING, DECODE_QUEUED) and (r.held or r.reserved):
                raise SchedulerError(f"{r.rid} holds KV while {r.state}")
            if r.state in (PREFILLING, DECODING, TRANSFERRING) and r.held + r.reserved != r.footprint:
                raise SchedulerError(f"{r.rid}: holds {r.held}+{r.reserved} slots, footprint {r.footprint}")
            if r.state == PREFILLING and not 0 <= r.computed < r.prompt_tokens - r.cached:
                raise SchedulerError(f"{r.rid}: computed {r.computed} out of range")
            if r.state == DECODING and not 1 <= r.generated < r.max_tokens:
                raise SchedulerError(f"{r.rid}: generated {r.generated} out of range")
        self.kv.check([(r.path, r.held, r.reserved) for r in self.requests.values()])


def _ceil_div_f(a: float, b: float) -> int:
    """ceil(a / b) for positive floats."""
    q = int(a // b)
    return q + 1 if q * b < a else q


__all__ = ["EngineScheduler", "PHASES"]
