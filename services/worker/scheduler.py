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

Peer fetch (paper §4.2): a prefill request with a fetch plan pulls the prefix
pages it lacks from peers' L2 into this node's L2 while it waits; the node's
fetches share its inbound link (processor sharing, ``fetch.FetchLink``). A
waiting request whose fetch is incomplete keeps its place but is skipped, so
later requests may start first and only the part of the fetch that outlasts
the wait delays it (``TokensOut.exposed_fetch_s``). Prefill budget goes in
queue order: once its fetch is in, a request that a long prompt overtook is
admitted ahead of that prompt's next chunk instead of waiting for its whole
prefill (chunked prefill lets the two share iterations).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from heapq import heappop, heappush

from shared.messages import DecodeWork, IterationRecord, KvEvent, NodeState, Phase, PrefillWork, QueuedWork
from shared.profile import Profile
from shared.values import IdentityValue
from services.worker.blocks import KvBlockManager
from services.worker.fetch import FetchLink, FetchStarted, FetchState
from services.worker.plan import HandOff, IterationPlan, OutputEvent, PrefillChunk, SchedulerError, TokensOut, WorkRejected

# request states: each live request is in exactly one container
WAITING = "waiting"  # prefill queue, holds no KV
BOOTSTRAP = "bootstrap"  # prefill queued behind a gate (decode KV not reserved yet), holds no KV
RESERVED = "reserved"  # decode KV reserved before the hand-off arrived (SGLang PD pre-allocation)
PREFILLING = "prefilling"  # running: prompt partly computed
DECODE_QUEUED = "decode_queued"  # hand-off received, waiting for L1 room
TRANSFERRING = "transferring"  # L1 reserved, KV arriving (kv_ready_at) or waiting for a running slot
DECODING = "decoding"  # running: producing output tokens
PARKED = "parked"  # prefill done, first token out, hand-off held until bind_decode names its decode node; holds its prompt KV
DONE = "done"

PHASES: tuple[str, ...] = ("prefill", "decode", "both")
_UNBOUND = ""
"""``handoff_to`` of a ``decode_later`` request before :meth:`EngineScheduler.bind_decode`."""
_MILLI = 1000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Request(IdentityValue):
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
    handoff_to: str | None
    """Decode node after prefill; None = decode here."""
    prefill_work: PrefillWork | None
    cached: int
    """t_c at admission: tokens from L1 hits plus L2 restores."""
    restored: int
    """Tokens restored from L2 at admission."""
    computed: int
    """Uncached prompt tokens computed so far."""
    held: int
    """Leading pages of ``path`` this request references in L1."""
    reserved: int
    """L1 slots reserved by this request that hold no hashed page."""
    generated: int
    acc: int
    """Fractional accepted tokens carried between decode iterations, in 1/1000 token."""
    ready_at: float
    """Decode: when the transferred KV is usable."""
    admitted_at: float
    """Prefill: launch time of the first chunk."""
    q_gpu: int
    q_host: int
    """Prefix match (pages in L1, then in L2) last seen while waiting, for NodeState.queue."""
    awaiting_handoff: bool
    """Decode side: reserved with :meth:`EngineScheduler.reserve`; the DecodeWork has not arrived."""
    fetch: FetchState | None
    """Prefill side: the peer fetch of this request's prefix (kept after completion for metrics)."""
    seq: int
    """Prefill side: order of joining the waiting queue (the order prefill budget is given in)."""
    l2_hold: list[int] | None
    """Prefill side, queued: hashes of the local prefix this request holds in L2 until it
    is admitted or leaves (``KvBlockManager.hold``; the pool keeps this very list as the hold,
    so it is never changed and its unhold is O(1)); None when it holds nothing."""
    qw: QueuedWork | None
    """Prefill side, queued: this request's :attr:`NodeState.queue` entry as :meth:`EngineScheduler.state` last
    built it from ``q_gpu`` / ``q_host`` (immutable: reused by every state until either changes, which sets it
    None); None when not built since."""

    __slots__ = __match_args__ = (
        "rid", "prompt_tokens", "max_tokens", "path", "state", "arrived_at", "footprint", "limit", "handoff_to",
        "prefill_work", "cached", "restored", "computed", "held", "reserved", "generated", "acc", "ready_at",
        "admitted_at", "q_gpu", "q_host", "awaiting_handoff", "fetch", "seq", "l2_hold", "qw",
    )

    def __init__(
        self, rid: str, prompt_tokens: int, max_tokens: int, path: list[int], state: str, arrived_at: float,
        footprint: int, limit: int, handoff_to: str | None = None, prefill_work: PrefillWork | None = None,
        cached: int = 0, restored: int = 0, computed: int = 0, held: int = 0, reserved: int = 0,
        generated: int = 0, acc: int = 0, ready_at: float = 0.0, admitted_at: float = 0.0, q_gpu: int = 0,
        q_host: int = 0, awaiting_handoff: bool = False, fetch: FetchState | None = None, seq: int = 0,
        l2_hold: list[int] | None = None, qw: QueuedWork | None = None,
    ) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.path = path
        self.state = state
        self.arrived_at = arrived_at
        self.footprint = footprint
        self.limit = limit
        self.handoff_to = handoff_to
        self.prefill_work = prefill_work
        self.cached = cached
        self.restored = restored
        self.computed = computed
        self.held = held
        self.reserved = reserved
        self.generated = generated
        self.acc = acc
        self.ready_at = ready_at
        self.admitted_at = admitted_at
        self.q_gpu = q_gpu
        self.q_host = q_host
        self.awaiting_handoff = awaiting_handoff
        self.fetch = fetch
        self.seq = seq
        self.l2_hold = l2_hold
        self.qw = qw


class EngineScheduler:
    """Continuous batching with chunked prefill over paged L1/L2 KV for one node.

    Args:
        node: this node's id (a NATS token).
        profile: hardware/model profile (Eq. 1/2 coefficients, capacities, limits).
        phase: ``prefill``, ``decode`` or ``both`` (collocated): what work the node accepts.
        host_eviction: host (L2) eviction policy: ``lru`` or ``branch-count``.
        check_invariants: run the full O(blocks) invariant check after every
            step (tests, debug); the O(1) checks always run, once per plan
            (at :meth:`schedule`).
        external_fetch: real-bytes mode: every fetch the scheduler starts is also
            reported by :meth:`take_fetch_starts`, and completes only once both the
            link model is done and the caller reported :meth:`fetch_done`.

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
        external_fetch: bool = False,
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
        self.keep_records = True
        """Build an :class:`IterationRecord` per plan (:meth:`take_records`). A caller that never
        reads them (the simulator when no planner or model refit consumes them) sets it False."""
        self.partial_outputs = True
        """Emit a :class:`TokensOut` for every decode step that produced tokens. False (the
        simulator, which forwards only first tokens and ends): only a request's first token and
        its last output are emitted; nothing else changes (KV, counts, iteration records)."""
        self._lazy = False
        """Decode progress kept by one clock (:meth:`set_lazy_decode`): no per-request walk per plan."""
        self._dclock = 0
        """Lazy decode: 1/1000 tokens each decoding request has gained since this scheduler started
        (every decoding request is in every plan's decode batch, so all gain the same)."""
        self._dheap: list[tuple[int, int, _Request]] = []
        """Lazy decode: ``(fin, n, r)`` per decoding request, ``fin`` the :attr:`_dclock` at which
        ``r`` reaches ``max_tokens`` (``n`` a push counter, the tie-break); an entry whose request is
        no longer decoding (aborted) is stale and dropped when it reaches the top."""
        self._dpush = 0
        self.kv = KvBlockManager(profile.gpu_blocks, profile.host_blocks, profile.block_size, host_eviction)
        self.requests: dict[str, _Request] = {}
        self.waiting: OrderedDict[str, _Request] = OrderedDict()
        self.decode_queue: OrderedDict[str, _Request] = OrderedDict()
        self.transferring: OrderedDict[str, _Request] = OrderedDict()
        self.running: OrderedDict[str, _Request] = OrderedDict()
        self.prefilling: dict[str, _Request] = {}
        """The running requests whose prompt is still being computed (``PREFILLING``), in ``running``'s order
        (admission order): :meth:`state` lists them without walking the decoding ones. Read it, never change it."""
        self.bootstrap: OrderedDict[str, _Request] = OrderedDict()
        """Prefill requests waiting for :meth:`open_gate` (decode KV reserved elsewhere)."""
        self.reserved: OrderedDict[str, _Request] = OrderedDict()
        """Decode reservations made by :meth:`reserve` whose hand-off has not arrived."""
        self.parked: OrderedDict[str, _Request] = OrderedDict()
        """``decode_later`` requests whose prefill finished before :meth:`bind_decode` named their
        decode node: out of the running batch, their prompt pages held (they count against L1 as
        a running request's do; counted in neither ``NodeState.running`` nor ``waiting``: they
        take no batch slot and no compute). Their first token went out with the plan that completed
        the prompt (:meth:`finish_iteration`); their hand-off is returned by :meth:`bind_decode`."""
        self.granted: list[str] = []
        """rids whose queued :meth:`reserve` got its L1 room since the last :meth:`take_granted` (read
        it to skip an empty drain; never change it)."""
        links = profile.links
        self.link: FetchLink[str] = FetchLink(links.peer_fetch_bytes_per_s, links.peer_fetch_latency_s)
        """The node's inbound peer link, shared by the fetches of queued requests."""
        self.external_fetch = external_fetch
        self._fetching: set[str] = set()
        """rids whose fetch is incomplete (each is waiting or gated)."""
        self._seq = 0
        self._fetch_starts: list[FetchStarted] = []
        self._fetch_ends: list[int] = []
        """Fetch ids (:attr:`FetchStarted.fetch_id`) of the fetches that ended since the last
        :meth:`take_fetch_ends` (``external_fetch`` only)."""
        self._fetch_ids = 0
        """Fetch id of the last external fetch started."""
        self.fetch_counters: dict[str, int] = {}
        """``started``, ``completed``, ``cancelled``, ``blocks`` (fetched pages), ``missing``
        (pages the real transfer did not deliver), ``nothing`` (plan adds no page),
        ``ignored_decode`` (a fetch plan sent to a decode node)."""
        self.n_decoding = 0
        self._decode_s: dict[int, float] = {}
        """Eq. 2 time of a decode part by batch size B (``profile.decode.iteration_time(B)``, a pure
        function of the node's fixed profile): computed once per B instead of once per plan."""
        self.inflight: IterationPlan | None = None
        """The plan between ``schedule()`` and ``finish_iteration()``, if any (read it, never set it:
        a plain attribute, as the simulator reads it at every plan end and every new input)."""
        self._records: list[IterationRecord] = []
        self.iterations = 0
        """Iterations executed (a k-iteration plan counts k)."""

    # ------------------------------------------------------------------ #
    # inputs
    # ------------------------------------------------------------------ #

    def set_lazy_decode(self, on: bool = True) -> None:
        """Keep decode progress lazily (the simulator, which emits no partial outputs and passes
        no ``stopped``): a decoding request's generated tokens follow from one per-scheduler clock
        of accepted 1/1000 tokens and the clock value at which it finishes (a heap), instead of
        being advanced one by one at every plan end; :meth:`finish_iteration` then touches only
        the requests that finish, and a pure-decode plan's first completion (:meth:`_skip_ahead`)
        is the heap's top. Outputs, plans and records are the same as without it; a decoding
        request's ``generated`` / ``acc`` are brought up to date by :meth:`sync_decode` (the full
        check does). Call before the first request; ``on`` implies ``partial_outputs = False``
        (``on=False``: back to the per-request walk, ``partial_outputs`` as it is).

        Raises:
            SchedulerError: if the scheduler already holds a request.
        """
        if self.requests or self.inflight is not None:
            raise SchedulerError("set_lazy_decode() on a scheduler that holds requests")
        if on:
            self.partial_outputs = False
        self._lazy = on

    def _join_decode(self, r: _Request) -> None:
        """Lazy decode: ``r`` (``generated``, ``acc`` up to date) joins the decode batch now."""
        self._dpush = n = self._dpush + 1
        heappush(self._dheap, ((r.max_tokens - r.generated) * _MILLI - r.acc + self._dclock, n, r))

    def sync_decode(self) -> None:
        """Lazy decode: set each decoding request's ``generated`` and ``acc`` from the clock (what
        the per-plan walk would have left there). O(decoding requests); a no-op otherwise."""
        if not self._lazy:
            return
        clock = self._dclock
        for fin, _, r in self._dheap:
            if r.state == DECODING:
                total = r.max_tokens * _MILLI - fin + clock  # generated * 1000 + acc
                r.generated, r.acc = divmod(total, _MILLI)

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

    def add_prefill(self, work: PrefillWork, now: float, *, gated: bool = False, decode_later: bool = False) -> None:
        """Queue a request for prefill (and decode here when ``work.decode_node`` is None
        or this node). O(prompt pages) for the prefix match.

        Args:
            gated: the request may not start before :meth:`open_gate` (SGLang PD: the
                prefill waits in a bootstrap queue until its decode node has reserved
                KV, paper D.1); it then joins the waiting queue at its tail.
            decode_later: the request is handed off after prefill but its decode node is
                chosen when the prefill starts (paper Eq. 7): ``work.decode_node`` must be
                None and the caller binds it with :meth:`bind_decode` once its first chunk
                is admitted (``IterationPlan.admitted``). A prefill that finishes before
                then is parked (:attr:`parked`) until the binding comes.

        A non-empty ``work.fetch`` (the router's fetch plan) starts a peer fetch of the
        prefix pages this node lacks (see :meth:`_start_fetch`); the request keeps its
        place in the queue but is not admitted before the fetch completes.

        Raises:
            WorkRejected: duplicate rid, the node does not serve prefill, block-size or
                hash-count mismatch, a prefill node given no other decode node, or a
                footprint larger than this node's L1.
        """
        rid = work.rid
        if work.fetch and self.phase == "decode":
            self._count("ignored_decode")  # decode nodes never fetch (DESIGN §4); the work is refused below
        self._check_common(rid, work.block_size, work.prompt_tokens, len(work.block_hashes), "prefill")
        if decode_later and work.decode_node is not None:
            raise WorkRejected(rid, "decode_later needs a work without decode_node")
        decode_here = not decode_later and (work.decode_node is None or work.decode_node == self.node)
        if decode_here and self.phase == "prefill":
            raise WorkRejected(rid, f"node {self.node} serves prefill only: the work must name a decode node")
        bs = self.block_size
        footprint = _ceil_div(work.prompt_tokens + (work.max_tokens if decode_here else 0), bs)
        self._check_fits(rid, footprint)
        r = _Request(  # positional, in field order (one per request)
            rid,  # rid
            work.prompt_tokens,  # prompt_tokens
            work.max_tokens,  # max_tokens
            bh if type(bh := work.block_hashes) is list else list(bh),  # path: the work's list, never changed (not a copy)
            WAITING,  # state
            now,  # arrived_at
            footprint,  # footprint
            (work.prompt_tokens - 1) // bs,  # limit
            None if decode_here else (work.decode_node or _UNBOUND),  # handoff_to
            work,  # prefill_work
        )
        # keep the L2 part of the prefix it was routed for (if any) until admission
        r.q_gpu, r.q_host, r.l2_hold = self.kv.match_hold(r.path, r.limit)
        self.requests[rid] = r
        if work.fetch:
            self._start_fetch(r, work, now)
        if gated:
            r.state = BOOTSTRAP
            self.bootstrap[rid] = r
        else:
            self._enqueue(r)

    def open_gate(self, rid: str, now: float) -> bool:
        """Let a gated prefill request (``add_prefill(gated=True)``) join the waiting queue
        (at its tail). Returns False if ``rid`` is not gated on this node. O(1)."""
        r = self.bootstrap.pop(rid, None)
        if r is None:
            return False
        r.state = WAITING
        self._enqueue(r)
        return True

    def _enqueue(self, r: _Request) -> None:
        self._seq += 1
        r.seq = self._seq
        self.waiting[r.rid] = r

    def bind_decode(self, rid: str, decode_node: str, now: float) -> list[OutputEvent]:
        """Name the decode node of a ``decode_later`` request (at its prefill start), at ``now``
        (simulated s). Returns nothing while its prefill runs (the plan that completes it hands it
        off); for a request :attr:`parked` (its prefill finished first: :meth:`finish_iteration`
        returned its first token then) its :class:`HandOff` at ``now``: it leaves the node, its
        pages unreferenced. O(1). Before, a parked request's first token was held until this call
        too, so its TTFT held the binding's round trip to the router (the evolving demo's on-node
        TTFT mean 3.2 s against 0.59 s with ``--decode-binding enqueue``), though the first token
        does not depend on the decode node.

        Raises:
            SchedulerError: if ``rid`` is not a prefill request of this node waiting for a binding,
                or ``decode_node`` is empty or this node.
        """
        r = self.requests.get(rid)
        if r is None or r.handoff_to != _UNBOUND:
            raise SchedulerError(f"{rid} is not waiting for a decode binding on node {self.node}")
        if not decode_node or decode_node == self.node:
            raise SchedulerError(f"{rid}: decode node must be another node, got {decode_node!r}")
        r.handoff_to = decode_node
        if r.state != PARKED:
            return []
        out: list[OutputEvent] = [self._handoff(r, now)]
        self._remove(r)
        self._check()
        return out

    def reserve(self, rid: str, prompt_tokens: int, max_tokens: int, now: float) -> bool:
        """Reserve this decode node's L1 for a request before its prefill runs elsewhere
        (SGLang PD decode pre-allocation, paper D.1). FIFO with hand-offs waiting for room.

        The later :meth:`add_decode` of the same rid uses the reservation. Returns True
        if reserved now; False if queued — the rid then appears in :meth:`take_granted`
        once reserved (during a later :meth:`schedule`).

        Raises:
            WorkRejected: duplicate rid, the node does not serve decode, or a footprint
                larger than this node's L1.
        """
        if rid in self.requests:
            raise WorkRejected(rid, f"request {rid} is already on node {self.node}")
        if self.phase == "prefill":
            raise WorkRejected(rid, f"node {self.node} serves prefill; decode reservation refused")
        if max_tokens < 1 or prompt_tokens < 1:
            raise WorkRejected(rid, "reservation needs prompt_tokens >= 1 and max_tokens >= 1")
        footprint = _ceil_div(prompt_tokens + max_tokens, self.block_size)
        self._check_fits(rid, footprint)
        r = _Request(
            rid=rid,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            path=[],
            state=DECODE_QUEUED,
            arrived_at=now,
            footprint=footprint,
            limit=0,
            awaiting_handoff=True,
        )
        self.requests[rid] = r
        if not self.decode_queue and self.kv.reserve(footprint):
            r.reserved = footprint
            r.state = RESERVED
            self.reserved[rid] = r
            return True
        self.decode_queue[rid] = r
        return False

    def take_granted(self) -> list[str]:
        """Drain the rids whose queued :meth:`reserve` got its L1 room (in grant order)."""
        out = self.granted
        self.granted = []
        return out

    def take_queued(self, now: float) -> list[PrefillWork]:
        """Remove every prefill request that has not started (gated, then waiting, each in
        arrival order) and return its work, for re-routing elsewhere (phase switch:
        paper §4.2, "the router moves the queued requests of each switching node").
        They hold no KV. O(queued)."""
        out: list[PrefillWork] = []
        for cont in (self.bootstrap, self.waiting):
            for r in cont.values():
                assert r.prefill_work is not None
                self._drop_queue_claims(r, now)
                out.append(r.prefill_work)
                del self.requests[r.rid]
                r.state = DONE
            cont.clear()
        self._check()
        return out

    @property
    def idle(self) -> bool:
        """True when the node holds no request (any state) and no plan is in flight."""
        return not self.requests and self.inflight is None

    def clear_caches(self, now: float) -> None:
        """Empty L1 and L2 (a relaunched engine, or a switch that strands the node's KV).

        The KV outbox then holds ``AllBlocksCleared()`` (a fresh block manager), so a
        consumer drops everything the node reported. Pending events not yet taken are
        dropped with it (they describe blocks that no longer exist).

        Raises:
            SchedulerError: if any request is still on the node or a plan is in flight.
        """
        if not self.idle:
            raise SchedulerError(f"clear_caches on node {self.node} with {len(self.requests)} requests / a plan in flight")
        host_policy = self.kv.host.evictable.policy.name
        self.kv = KvBlockManager(self.profile.gpu_blocks, self.profile.host_blocks, self.profile.block_size, host_policy)

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
        held = self.requests.get(rid)
        if held is not None and held.awaiting_handoff:
            return self._decode_into_reservation(held, work, now)
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

    def _decode_into_reservation(self, r: _Request, work: DecodeWork, now: float) -> None:
        """The hand-off of a request reserved with :meth:`reserve` arrived."""
        rid = work.rid
        if work.block_size != self.block_size:
            raise WorkRejected(rid, f"block size mismatch: work has {work.block_size}, node {self.node} uses {self.block_size}")
        if work.prompt_tokens != r.prompt_tokens or work.max_tokens != r.max_tokens:
            raise WorkRejected(
                rid,
                f"hand-off ({work.prompt_tokens} prompt, {work.max_tokens} max) does not match the reservation "
                f"({r.prompt_tokens}, {r.max_tokens})",
            )
        if len(work.block_hashes) != work.prompt_tokens // self.block_size:
            raise WorkRejected(rid, f"{len(work.block_hashes)} block hashes for {work.prompt_tokens} prompt tokens")
        if work.generated >= work.max_tokens:
            raise WorkRejected(rid, f"nothing to decode: generated {work.generated} >= max_tokens {work.max_tokens}")
        r.path = list(work.block_hashes)
        r.generated = work.generated
        r.awaiting_handoff = False
        if r.state == RESERVED:
            del self.reserved[rid]
            r.ready_at = work.kv_ready_at
            r.state = TRANSFERRING
            self.transferring[rid] = r
        # else still DECODE_QUEUED: the transfer starts when room is reserved (_promote_decode)

    def abort(self, rid: str, now: float) -> bool:
        """Drop ``rid`` wherever it is on this node and release its KV.
        Returns False if the node does not hold it. O(pages held)."""
        r = self.requests.pop(rid, None)
        if r is None:
            return False
        self._drop_queue_claims(r, now)
        self._container(r.state).pop(rid)
        if r.state == DECODING:
            self.n_decoding -= 1
        elif r.state == PREFILLING:
            del self.prefilling[rid]
        self.kv.release(r.path, r.held, r.reserved)
        r.held = r.reserved = 0
        r.state = DONE
        return True

    def update_counts(self, hashes: list[int], counts: list[int], chains: list[tuple[int | None, int]] | None = None) -> int:
        """Branch counts from the KV directory (``kv.counts.<node>``; ``chains``: the message as
        chains, from an in-process directory); see :meth:`BranchRunHostPool.update_counts`. Returns
        the host blocks moved. (The host pool's method itself, as :meth:`KvBlockManager.update_counts`
        would call it: one call less per message.)"""
        if chains is None:
            return self.kv.host.update_counts(hashes, counts)
        return self.kv.host.update_counts(hashes, counts, chains)

    def reset_counts(self) -> int:
        """Every host block's branch count back to 0 (the KV directory restarted; see
        :meth:`BranchRunHostPool.reset_counts`). Returns the host blocks moved."""
        return self.kv.reset_counts()

    # ------------------------------------------------------------------ #
    # peer fetch into L2 while queued (paper §4.2, DESIGN §1)
    # ------------------------------------------------------------------ #

    def _count(self, key: str, n: int = 1) -> None:
        self.fetch_counters[key] = self.fetch_counters.get(key, 0) + n

    def _start_fetch(self, r: _Request, work: PrefillWork, now: float) -> None:
        """Start pulling the prefix pages ``r`` lacks from the peers of ``work.fetch``.

        The fetched run starts at the request's local prefix (L1 then L2, as
        matched on arrival) and follows the plan's ranges while they are
        contiguous, come from another node and lie below the cache cap
        ``(prompt − 1) // block_size``; a gap, a range naming this node (the
        directory is behind) or the cap ends it — pages past a hole can never
        extend the prefix. Its bytes (pages × block_size × kv_bytes_per_token)
        share the node's inbound link with the other fetches. O(ranges + pages).
        """
        lo = pos = r.q_gpu + r.q_host
        cap = r.limit
        spans: list[tuple[str, int, int]] = []
        for fr in sorted(work.fetch, key=lambda f: f.start):
            if pos >= cap:
                break
            if fr.end <= pos:
                continue
            if fr.start > pos or fr.node == self.node:
                break
            end = cap if cap < fr.end else fr.end  # min(fr.end, cap), no builtin call
            spans.append((fr.node, pos, end))
            pos = end
        if pos <= lo:
            self._count("nothing")
            return
        p = self.profile
        fetch_id = 0
        if self.external_fetch:
            self._fetch_ids += 1
            fetch_id = self._fetch_ids
        r.fetch = FetchState(lo=lo, hi=pos, started_at=now, external=self.external_fetch, fetch_id=fetch_id)
        self.link.start(r.rid, (pos - lo) * self.block_size * p.kv_bytes_per_token, now)
        self._fetching.add(r.rid)
        r.q_host += pos - lo  # what the queue entry will restore once the fetch is in
        r.qw = None
        self._count("started")
        self._count("blocks", pos - lo)
        if self.external_fetch:
            self._fetch_starts.append(FetchStarted(r.rid, [(n, r.path[a:b]) for n, a, b in spans], now, fetch_id))

    def take_fetch_starts(self) -> list[FetchStarted]:
        """Drain the fetches started since the last call (only with ``external_fetch``):
        the caller moves the bytes and reports each with :meth:`fetch_done`."""
        out = self._fetch_starts
        self._fetch_starts = []
        return out

    def take_fetch_ends(self) -> list[int]:
        """Drain the fetch ids (:attr:`FetchStarted.fetch_id`) of the fetches that ended since the
        last call (only with ``external_fetch``):
        completed (its ``BlockStored(host)`` events are queued before it is listed here, so drain
        the KV events first) or cancelled (the request left). The caller frees the bytes the
        transfer brought that L2 did not take."""
        out = self._fetch_ends
        self._fetch_ends = []
        return out

    def fetch_done(self, rid: str, missing: Iterable[int], now: float, fetch_id: int | None = None) -> bool:
        """The real transfer of ``rid``'s fetch finished (``external_fetch`` mode).

        ``missing``: hashes not delivered or whose checksum failed; the fetch keeps
        the pages before the first missing one and the request recomputes the rest.
        ``fetch_id``: the transfer's :attr:`FetchStarted.fetch_id` (None: whichever fetch ``rid``
        has); a transfer of an earlier fetch of the same rid (the request left and was
        re-dispatched here while its bytes moved) is late, not this fetch's report.
        The fetch completes now if the link model is done, else when it is.
        Returns False (nothing changes) if ``rid`` has no real transfer pending
        (aborted, handed back, reported already, or another fetch). O(pages) at completion.
        """
        r = self.requests.get(rid)
        f = r.fetch if r is not None else None
        if r is None or f is None or f.done_at is not None or not f.external:
            return False
        if fetch_id is not None and f.fetch_id != fetch_id:
            return False
        f.external = False
        f.missing = frozenset(missing)
        if f.sim_done_at is not None:
            done_at = f.sim_done_at
            self._complete_fetch(r, done_at if done_at > now else now)  # max(now, done_at)
        return True

    @property
    def fetching(self) -> int:
        """Queued requests whose fetch is incomplete."""
        return len(self._fetching)

    def _advance_fetches(self, now: float) -> None:
        """Complete every fetch the link finished by ``now`` (real-bytes: and reported)."""
        for rid, t in self.link.pop_done(now):
            r = self.requests[rid]
            f = r.fetch
            assert f is not None
            f.sim_done_at = t
            if not f.external:
                self._complete_fetch(r, t)

    def _complete_fetch(self, r: _Request, t: float) -> None:
        """The fetched pages are in this node's L2 from ``t`` (BlockStored host events)."""
        f = r.fetch
        assert f is not None
        f.done_at = t
        self._fetching.discard(r.rid)
        hi = f.hi
        if f.missing:
            for i in range(f.lo, f.hi):
                if r.path[i] in f.missing:
                    hi = i
                    break
            self._count("missing", f.hi - hi)
        self.kv.store_fetched(r.path, f.lo, hi)
        self._count("completed")
        if self.external_fetch:
            self._fetch_ends.append(f.fetch_id)
        self._drop_hold(r)  # (an unhold changes no page's place: the match below is the same after it)
        # hold the extended L2 prefix (fetched pages and their ancestors), if any, until admission
        r.q_gpu, r.q_host, r.l2_hold = self.kv.match_hold(r.path, r.limit)
        r.qw = None

    def _drop_hold(self, r: _Request) -> None:
        """Release the L2 prefix queued request ``r`` holds, if it holds one (idempotent)."""
        if r.l2_hold is not None:
            self.kv.unhold(r.l2_hold)
            r.l2_hold = None

    def _drop_queue_claims(self, r: _Request, now: float) -> None:
        """``r`` leaves the node (abort, re-route): release what it claims while queued — the
        L2 prefix it holds (not admitted yet) and its share of the link (fetch incomplete)."""
        self._drop_hold(r)
        f = r.fetch
        if f is None or f.done_at is not None:
            return
        self.link.cancel(r.rid, now)
        self._fetching.discard(r.rid)
        self._count("cancelled")
        if self.external_fetch:
            self._fetch_ends.append(f.fetch_id)

    def _head_admissible(self, now: float) -> _Request | None:
        """The oldest waiting request whose fetch is complete (or that has none).

        Rule: a waiting request whose fetch is incomplete keeps its place but is
        skipped, so later requests may start before it — only the part of a
        fetch that outlasts the queue wait delays its request. The first skip
        is recorded (``exposed_fetch_s``). O(1) without fetches, else O(skipped).
        """
        if not self._fetching:
            return next(iter(self.waiting.values()), None)
        for r in self.waiting.values():
            f = r.fetch
            if f is None or f.done_at is not None:
                return r
            if f.skipped_at is None:
                f.skipped_at = now
        return None

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
        if self.inflight is not None:
            raise SchedulerError("schedule() called while a plan is in flight; call finish_iteration() first")
        if self.decode_queue or self.transferring:
            self._promote_decode(now)
        if self._fetching:
            self._advance_fetches(now)
        budget = self.chunk_tokens
        prefill_reqs: list[_Request] = []
        chunks: list[PrefillChunk] = []
        admitted: list[str] = []
        running = self.running
        if self.n_decoding == len(running):  # nothing prefilling: the whole running batch decodes
            decode_reqs = list(running.values())
            decode_rids = list(running)
            prefilling: list[_Request] = []
        else:
            decode_reqs = []
            decode_rids = []
            prefilling = []
            for r in running.values():
                if r.state == DECODING:
                    decode_reqs.append(r)
                    decode_rids.append(r.rid)
                elif r.state == PREFILLING:
                    prefilling.append(r)
        budget -= len(decode_reqs) * self.fwd_tokens
        if len(prefilling) > 1:
            prefilling.sort(key=_by_seq)
        for r in prefilling:
            if self.waiting and budget > 0 and next(iter(self.waiting.values())).seq < r.seq:
                budget = self._admit_waiting(now, budget, r.seq, chunks, prefill_reqs, admitted)
            if budget <= 0:
                break
            before = r.cached + r.computed
            n = r.prompt_tokens - before
            if budget < n:  # n = min(left, budget), no builtin call (3.11's min parses its keywords each call)
                n = budget
            chunks.append(PrefillChunk(r.rid, n, before, 0, before + n >= r.prompt_tokens))  # positional, in field order
            prefill_reqs.append(r)
            budget -= n
        if budget > 0 and self.waiting:
            budget = self._admit_waiting(now, budget, None, chunks, prefill_reqs, admitted)
        if budget < 0:
            raise SchedulerError(f"token budget went negative ({budget})")
        if not chunks and not decode_reqs:
            self._check()
            return None

        p = self.profile
        sum_uc = sum_qk = sum_rst = sum_c = 0
        k = 1
        if chunks:
            for c in chunks:  # one pass (Eq. 1's sums)
                t, b = c.tokens, c.cached_before
                sum_uc += t
                sum_qk += int(t * b + t * (t + 1) / 2.0)  # qk_pairs(t, b), inline
                sum_rst += c.restored
                sum_c += b
            prefill_s = p.prefill.iteration_time(sum_uc, sum_qk, sum_rst)
            if decode_reqs:
                decode_s = self._decode_s.get(len(decode_reqs)) or self._decode_time(len(decode_reqs))
                c0, d0 = p.prefill.c0, p.decode.d0
                iteration_s = prefill_s + decode_s - (d0 if d0 < c0 else c0)  # min(c0, d0)
            else:
                decode_s = 0.0
                iteration_s = prefill_s + decode_s
        else:
            prefill_s = 0.0
            decode_s = self._decode_s.get(len(decode_reqs)) or self._decode_time(len(decode_reqs))
            iteration_s = prefill_s + decode_s
            if horizon is not None and iteration_s > 0:
                k = self._skip_ahead(decode_reqs, now, horizon, iteration_s)
        plan = IterationPlan(  # positional, in field order (one per plan)
            now,  # start
            k,  # iterations
            iteration_s,  # iteration_s
            now + k * iteration_s,  # end
            chunks,  # prefill
            decode_rids,  # decode
            prefill_s,  # prefill_s
            decode_s,  # decode_s
            sum_uc,  # sum_uncached
            sum_qk,  # sum_qk_pairs
            sum_rst,  # sum_restored
            sum_c,  # sum_cached
            prefill_reqs + decode_reqs if prefill_reqs else decode_reqs,  # reqs
            admitted,  # admitted
        )
        self.inflight = plan
        gpu = self.kv.gpu
        if (  # _check's O(1) checks, inline (one per plan): on a failure, or with the full check on, _check runs
            self.check_invariants
            or len(self.waiting) + len(self.running) + len(self.decode_queue) + len(self.transferring)
            + len(self.bootstrap) + len(self.reserved) + len(self.parked) != len(self.requests)
            or len(self.running) > self.max_running
            or gpu.hashed + gpu.reserved > gpu.capacity
        ):
            self._check()
        return plan

    def finish_iteration(self, plan: IterationPlan, now: float, stopped: Mapping[str, int] | None = None) -> list[OutputEvent]:
        """Account a finished plan at ``now`` (normally ``plan.end``) and return its outputs.

        ``stopped`` (real engines): requests whose last output token in this plan was an
        end-of-sequence token, mapped to their output count including it; they finish
        there with ``finish_reason`` ``stop`` (no hand-off when it was the first token).

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
        if plan is not self.inflight:
            raise SchedulerError("finish_iteration() got a plan that is not in flight")
        self.inflight = None
        k = plan.iterations
        self.iterations += k
        out: list[OutputEvent] = []
        n_chunks = len(plan.prefill)
        bs = self.block_size
        joined: list[_Request] = []
        for chunk, r in zip(plan.prefill, plan.reqs):  # reqs: the chunks' requests first
            if r.state != PREFILLING:
                continue
            r.computed += chunk.tokens
            full = (r.cached + r.computed) // bs  # the prompt pages now computed become cached
            if full > len(r.path):
                full = len(r.path)
            if full > r.held:
                kv = self.kv  # kv.fill(r.path, r.held, full) without its wrapper call (one per chunk)
                for lo, hi in kv.gpu.fill(r.path, r.held, full):
                    kv.host.store(r.path, lo, hi)
                r.reserved -= full - r.held
                r.held = full
            if not chunk.completes:
                continue
            r.generated = 1
            eos = stopped is not None and r.rid in stopped
            done = r.max_tokens <= 1 or eos
            out.append(self._first_token(r, now, done, ("stop" if eos else "length") if done else None))
            if not done and r.handoff_to == _UNBOUND:
                # no decode node named yet (route.bind under way): its first token goes out now, it
                # waits out of the batch, its pages held, and bind_decode returns its hand-off
                del self.running[r.rid]
                del self.prefilling[r.rid]
                r.state = PARKED
                self.parked[r.rid] = r
                continue
            if done:
                self._remove(r)
            elif r.handoff_to is not None:
                out.append(self._handoff(r, now))
                self._remove(r)
            else:
                del self.prefilling[r.rid]
                r.state = DECODING
                self.n_decoding += 1
                if self._lazy:
                    joined.append(r)
        step = k * self.acc_milli
        partial = self.partial_outputs
        if self._lazy:  # every decoding request gains step; only those reaching max_tokens are touched
            if stopped is not None or partial:
                raise SchedulerError("lazy decode takes no stopped requests and emits no partial outputs")
            before = self._dclock
            self._dclock = clock = before + step if plan.decode else before
            heap = self._dheap
            if heap and heap[0][0] <= clock:
                done_reqs: list[tuple[int, _Request]] = []
                while heap and heap[0][0] <= clock:
                    fin, _, r = heappop(heap)
                    if r.state == DECODING:  # else aborted while queued here: stale
                        done_reqs.append((fin, r))
                if len(done_reqs) > 1:  # in running order, as the walk of the decode batch finds them
                    at = {rid: i for i, rid in enumerate(self.running)}
                    done_reqs.sort(key=lambda e: at[e[1].rid])
                for fin, r in done_reqs:
                    top = r.max_tokens * _MILLI
                    start = (top - fin + before) // _MILLI
                    left = r.max_tokens - start
                    r.acc = (top - fin + clock) % _MILLI
                    r.generated = r.max_tokens
                    out.append(TokensOut(r.rid, start, left, True, "length", r.prompt_tokens, r.cached, now))
                    self._remove(r)
            for r in joined:  # after the clock moved: they gain nothing from this plan
                self._join_decode(r)
            decoding = []
        else:
            decoding = plan.reqs[n_chunks:] if n_chunks else plan.reqs
        if stopped is None:  # no end-of-sequence (the simulator): a request decodes to max_tokens
            for r in decoding:
                if r.state != DECODING:
                    continue
                total = r.acc + step
                r.acc = total % _MILLI
                n = total // _MILLI
                start = r.generated
                left = r.max_tokens - start
                if n < left:
                    r.generated = start + n
                    if n and partial:
                        out.append(TokensOut(r.rid, start, n, False, None, r.prompt_tokens, r.cached, now))
                    continue
                r.generated = start + left
                out.append(TokensOut(r.rid, start, left, True, "length", r.prompt_tokens, r.cached, now))
                self._remove(r)
            decoding = []
        for r in decoding:  # a real engine's (``stopped`` given): one TokensOut per request per iteration
            if r.state != DECODING:
                continue
            total = r.acc + step
            n = total // _MILLI
            left = r.max_tokens - r.generated
            if left < n:  # n = min(n, left), no builtin call
                n = left
            eos = stopped is not None and r.rid in stopped
            if eos:
                n = min(n, max(0, stopped[r.rid] - r.generated))  # type: ignore[index]
            r.acc = total % _MILLI
            start = r.generated
            r.generated += n
            done = r.generated >= r.max_tokens or eos
            if done or (n and partial):
                out.append(
                    TokensOut(  # positional, in field order (3× faster than by keyword; 128 a plan at batch 128)
                        r.rid, start, n, done, ("stop" if eos else "length") if done else None, r.prompt_tokens, r.cached, now
                    )
                )
            if done:
                self._remove(r)
        if self.keep_records:
            self._records.append(
                IterationRecord(
                    start=plan.start,
                    duration_s=plan.iteration_s,
                    phase=("mixed" if plan.decode else "prefill") if n_chunks else "decode",  # plan.phase
                    prefill_requests=n_chunks,
                    sum_uncached=plan.sum_uncached,
                    sum_qk_pairs=plan.sum_qk_pairs,
                    sum_restored=plan.sum_restored,
                    sum_cached=plan.sum_cached,
                    decode_batch=len(plan.decode),
                    repeat=k,
                )
            )
        if self.check_invariants:  # the full check; the O(1) ones run at the next schedule() (see _check)
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
        if plan is not self.inflight:
            raise SchedulerError("truncate() got a plan that is not in flight")
        if plan.iterations > 1 and not plan.prefill and plan.iteration_s > 0:
            j = _ceil_div_f(now - plan.start, plan.iteration_s) if now > plan.start else 1
            if not j > 1:  # max(1, j)
                j = 1
            if j < plan.iterations:
                plan.iterations = j
                plan.end = plan.start + j * plan.iteration_s
        return plan.end

    def next_deadline(self) -> float | None:
        """Earliest ``kv_ready_at`` of a decode request still waiting for its KV, or
        completion of a peer fetch (link model), or None. The caller should call
        :meth:`schedule` again at that time when idle. A real-bytes fetch whose link
        part is done waits for :meth:`fetch_done` (an input), not for a deadline."""
        t = self.link.next_completion() if len(self.link) else None
        if self.transferring:
            ready = min(r.ready_at for r in self.transferring.values())
            t = ready if t is None or ready < t else t
        return t

    # ------------------------------------------------------------------ #
    # outboxes and views
    # ------------------------------------------------------------------ #

    def take_kv_events(self) -> list[KvEvent]:
        """Drain the KV events (BlockStored / BlockRemoved / AllBlocksCleared) in order."""
        return self.kv.take_events()

    @property
    def has_records(self) -> bool:
        """Whether :meth:`take_records` has any to give."""
        return bool(self._records)

    def take_records(self) -> list[IterationRecord]:
        """Drain the iteration records (one per plan, ``repeat`` = k)."""
        out = self._records
        self._records = []
        return out

    def snapshot(self) -> tuple[list[int], list[int]]:
        """``(L1 hashes, L2 hashes)`` as of the events drained so far plus pending ones."""
        return self.kv.snapshot()

    def snapshot_parents(self) -> tuple[list[int], list[int | None], list[int], list[int | None]]:
        """``(L1 hashes, their parents, L2 hashes, their parents)``: a resync reply's content."""
        return self.kv.snapshot_parents()

    def state(self, now: float, *, with_queue: bool = True) -> NodeState:
        """The node's state for ``node.state.<node>``; the shell fills seq, epoch,
        accepting and engine. ``queue`` lists in-progress chunked prefills (the
        tokens left after the chunk in flight, which ``remaining_s`` already
        covers; a prompt that the chunk in flight completes is not listed), then
        waiting requests (their prefix match when last seen).

        ``with_queue=False`` leaves ``queue`` empty, O(1) instead of O(queue): for a
        reader that uses only the counts (the simulator's router under a routing
        policy that never reads the queue).

        Cost: O(1) + O(prefilling) (:attr:`prefilling`: the decoding requests are not walked)
        + O(waiting + bootstrap), a queued request's entry made anew only when its prefix match
        changed (``_Request.qw``; the entries are immutable, so states share them)."""
        queue: list[QueuedWork] = []
        running = self.running
        n_running = len(running)
        inflight = self.inflight
        if with_queue:
            if self.prefilling:
                in_flight: dict[str, int] = {}
                if inflight is not None:
                    for c in inflight.prefill:
                        in_flight[c.rid] = c.tokens
                for r in self.prefilling.values():
                    done = r.cached + r.computed + in_flight.get(r.rid, 0)
                    if done < r.prompt_tokens:
                        queue.append(QueuedWork(rid=r.rid, uncached_tokens=r.prompt_tokens - done, cached_tokens=done))
            if self.waiting or self.bootstrap:
                bs = self.block_size
                for r in (*self.waiting.values(), *self.bootstrap.values()):
                    w = r.qw
                    if w is None:  # built anew only when its prefix match changed (see _Request.qw)
                        cached = (r.q_gpu + r.q_host) * bs
                        w = r.qw = QueuedWork(
                            rid=r.rid,
                            uncached_tokens=r.prompt_tokens - cached,
                            cached_tokens=cached,
                            restore_tokens=r.q_host * bs,
                        )
                    queue.append(w)
        remaining = inflight.end - now if inflight is not None else 0.0
        if not remaining > 0.0:  # max(0.0, remaining), no builtin call (one per state)
            remaining = 0.0
        kv = self.kv
        gpu, host = kv.gpu, kv.host
        host_used = host.pinned  # host.used and gpu.available below, without their property calls
        for q in host.queues:
            host_used += q.blocks
        return NodeState(
            node=self.node,
            ts=now,
            phase=self.phase,
            block_size=self.block_size,
            running=n_running,
            # waiting + bootstrap + decode_queue + transferring + reserved: each request is in one container
            # (schedule() checks it per plan), so the others' complement, 3 lengths instead of 5
            waiting=len(self.requests) - n_running - len(self.parked),
            decoding=self.n_decoding,
            remaining_s=remaining,
            queue=queue,
            gpu_free_blocks=gpu.capacity - gpu.hashed - gpu.reserved + gpu.queue.blocks,
            gpu_total_blocks=gpu.capacity,
            host_used_blocks=host_used,
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
        if state == BOOTSTRAP:
            return self.bootstrap
        if state == RESERVED:
            return self.reserved
        if state == PARKED:
            return self.parked
        raise SchedulerError(f"request in state {state} has no container")

    def _admit_waiting(
        self,
        now: float,
        budget: int,
        before: int | None,
        chunks: list[PrefillChunk],
        prefill_reqs: list[_Request],
        admitted: list[str],
    ) -> int:
        """Admit waiting requests in queue order (see :meth:`_head_admissible`) while
        budget, running slots and L1 room last, giving each its first chunk; returns
        the budget left.

        ``before``: only requests that joined the queue before this ``seq`` — the
        ones a running prefill overtook while their fetch was in flight. Admitted
        ahead of that prefill's next chunk, they take their place back: the prefill
        budget goes in queue order, so a fetching request is not left waiting for
        the whole prefill of a long prompt that started while it fetched.
        """
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            r = self._head_admissible(now) if self._fetching else next(iter(self.waiting.values()))  # (the same, without fetches)
            if r is None or (before is not None and r.seq > before) or not self._admit(r, now):
                break
            done = r.cached + r.computed  # the chunk's cached_before
            n = r.prompt_tokens - r.cached
            if budget < n:  # n = min(left, budget)
                n = budget
            chunks.append(PrefillChunk(r.rid, n, done, r.restored, done + n >= r.prompt_tokens))  # positional, in field order
            prefill_reqs.append(r)
            admitted.append(r.rid)
            budget -= n
        return budget

    def _admit(self, r: _Request, now: float) -> bool:
        """Move the head of the waiting queue to running if L1 can hold its footprint."""
        n_gpu, n_host, admitted = self.kv.match_admit(r.path, r.limit, r.footprint)
        r.q_gpu, r.q_host = n_gpu, n_host
        r.qw = None
        if not admitted:
            return False
        new_slots = r.footprint - n_gpu
        r.held, r.reserved = n_gpu, new_slots
        if n_host:
            self.kv.fill(r.path, n_gpu, n_gpu + n_host)
            r.held += n_host
            r.reserved -= n_host
        if r.l2_hold is not None:
            self._drop_hold(r)  # the restored pages are pinned by L1 now
        f = r.fetch
        if f is not None and f.done_at is not None:
            used = n_gpu + n_host
            if f.hi < used:  # max(0, min(n_gpu + n_host, f.hi) - f.lo), no builtin calls
                used = f.hi
            used -= f.lo
            f.used = used if used > 0 else 0
        bs = self.block_size
        r.cached = (n_gpu + n_host) * bs
        r.restored = n_host * bs
        del self.waiting[r.rid]
        r.admitted_at = now
        r.state = PREFILLING
        self.running[r.rid] = r
        self.prefilling[r.rid] = r
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
            if r.awaiting_handoff:
                r.state = RESERVED
                self.reserved[r.rid] = r
                self.granted.append(r.rid)
                continue
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
            if self._lazy:
                self._join_decode(r)

    def _first_token(self, r: _Request, now: float, done: bool, finish_reason: str | None) -> TokensOut:
        """The first output token of ``r``, whose prompt completed, at ``now``."""
        f = r.fetch
        return TokensOut(  # positional, in field order (one per first token)
            r.rid,  # rid
            0,  # index
            1,  # count
            done,  # finished
            finish_reason,  # finish_reason
            r.prompt_tokens,  # prompt_tokens
            r.cached,  # cached_tokens
            now,  # at
            r.admitted_at - r.arrived_at,  # queue_s
            f.fetch_s if f is not None else None,  # fetch_s
            f.exposed_s if f is not None else None,  # exposed_fetch_s
            f.used * self.block_size if f is not None else 0,  # fetched_tokens
        )

    def _handoff(self, r: _Request, now: float) -> HandOff:
        w = r.prefill_work
        assert w is not None and r.handoff_to is not None
        if r.handoff_to == _UNBOUND:
            raise SchedulerError(f"{r.rid} finished prefill on {self.node} without a decode binding (bind_decode)")
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
            attempt=w.attempt,
            output_offset=w.output_offset,
            router=w.router,
            ignore_eos=w.ignore_eos,
            sampling=w.sampling,
        )
        return HandOff(rid=r.rid, decode_node=r.handoff_to, work=work, at=now)

    def _remove(self, r: _Request) -> None:
        """A request leaves the node: its pages stay cached (unreferenced), slots are freed."""
        state = r.state
        if state == DECODING:
            self.n_decoding -= 1
            del self.running[r.rid]  # (_container's answer for a running request, without the call)
        elif state == PREFILLING:
            del self.running[r.rid]
            del self.prefilling[r.rid]
        else:
            self._container(state).pop(r.rid)
        del self.requests[r.rid]
        self.kv.release(r.path, r.held, r.reserved)
        r.held = r.reserved = 0
        r.state = DONE

    def _skip_ahead(self, decode_reqs: list[_Request], now: float, horizon: float, iteration_s: float) -> int:
        """k for a pure-decode plan: up to the first completion, all starts before the horizon."""
        m = self.acc_milli
        if self._lazy:  # the first completion is the heap's top (its stale entries dropped)
            heap = self._dheap
            while heap[0][2].state != DECODING:
                heappop(heap)
            k_finish = -(-(heap[0][0] - self._dclock) // m)
        else:
            k_finish = 1 << 62
            for r in decode_reqs:  # the first completion (a loop: a comprehension would be a call)
                k = -(-((r.max_tokens - r.generated) * _MILLI - r.acc) // m)  # ceil division
                if k < k_finish:
                    k_finish = k
        h = horizon
        for r in self.transferring.values():
            if now < r.ready_at < h:
                h = r.ready_at
        fetch_at = self.link.next_completion() if self._fetching and len(self.link) else None  # (link ⊆ fetching)
        if fetch_at is not None and now < fetch_at < h:
            h = fetch_at
        if h > now:  # _ceil_div_f(h - now, iteration_s), inline
            d = h - now
            q = int(d // iteration_s)
            k_h = q + 1 if q * iteration_s < d else q
        else:
            k_h = 1
        k = k_h if k_h < k_finish else k_finish  # max(1, min(k_finish, k_h)), no builtin calls
        return k if k > 1 else 1

    def _decode_time(self, batch: int) -> float:
        """Eq. 2: one decode iteration of ``batch`` requests on this node (s); memoised per batch
        size (:attr:`_decode_s`), the same float as ``profile.decode.iteration_time(batch)``."""
        t = self._decode_s.get(batch)
        if t is None:
            t = self._decode_s[batch] = self.profile.decode.iteration_time(batch)
        return t

    def _check(self) -> None:
        """Invariants: O(1) always, the full check when enabled. (:meth:`schedule` tests the O(1)
        conditions inline, once per plan, and calls this only when one fails, so that it raises
        naming it, or when the full check is on; :meth:`finish_iteration` calls it only for the
        full check. A plan's end cannot break two of the three O(1) conditions — it only takes
        requests out of the running batch and turns reserved L1 slots into pages, never more
        — and a container count it broke is caught by the next :meth:`schedule`, which follows
        every plan end, before that plan starts; checking at both cost ~0.5% of a simulation.)"""
        running = len(self.running)
        n = (
            len(self.waiting)
            + running
            + len(self.decode_queue)
            + len(self.transferring)
            + len(self.bootstrap)
            + len(self.reserved)
            + len(self.parked)
        )
        if n != len(self.requests):
            raise SchedulerError(f"{len(self.requests)} requests but {n} in state containers")
        if running > self.max_running:
            raise SchedulerError(f"{running} running > cap {self.max_running}")
        gpu = self.kv.gpu
        if gpu.hashed + gpu.reserved > gpu.capacity:  # GpuBlockPool.free < 0, without the property call
            raise SchedulerError(f"L1 over-committed by {-gpu.free} blocks")
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
        self.sync_decode()
        seen: set[str] = set()
        for name, cont, states in (
            ("waiting", self.waiting, (WAITING,)),
            ("running", self.running, (PREFILLING, DECODING)),
            ("decode_queue", self.decode_queue, (DECODE_QUEUED,)),
            ("transferring", self.transferring, (TRANSFERRING,)),
            ("bootstrap", self.bootstrap, (BOOTSTRAP,)),
            ("reserved", self.reserved, (RESERVED,)),
            ("parked", self.parked, (PARKED,)),
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
        if list(self.prefilling.values()) != [r for r in self.running.values() if r.state == PREFILLING]:
            raise SchedulerError("prefilling out of sync with the running batch's prefilling requests")
        if self._lazy and sorted(id(r) for _, _, r in self._dheap if r.state == DECODING) != sorted(
            id(r) for r in self.running.values() if r.state == DECODING
        ):
            raise SchedulerError("lazy decode heap out of sync with the decoding requests")
        for r in self.requests.values():
            if r.state in (WAITING, DECODE_QUEUED, BOOTSTRAP) and (r.held or r.reserved):
                raise SchedulerError(f"{r.rid} holds KV while {r.state}")
            if (r.awaiting_handoff and r.state not in (RESERVED, DECODE_QUEUED)) or (r.state == RESERVED and not r.awaiting_handoff):
                raise SchedulerError(f"{r.rid}: awaiting_handoff={r.awaiting_handoff} in state {r.state}")
            if r.state in (PREFILLING, DECODING, TRANSFERRING, RESERVED, PARKED) and r.held + r.reserved != r.footprint:
                raise SchedulerError(f"{r.rid}: holds {r.held}+{r.reserved} slots, footprint {r.footprint}")
            if r.state == PREFILLING and not 0 <= r.computed < r.prompt_tokens - r.cached:
                raise SchedulerError(f"{r.rid}: computed {r.computed} out of range")
            if r.state == DECODING and not 1 <= r.generated < r.max_tokens:
                raise SchedulerError(f"{r.rid}: generated {r.generated} out of range")
            f = r.fetch
            incomplete = f is not None and f.done_at is None
            if incomplete != (r.rid in self._fetching):
                raise SchedulerError(f"{r.rid}: fetch incomplete={incomplete} but fetching set says {r.rid in self._fetching}")
            if incomplete and r.state not in (WAITING, BOOTSTRAP):
                raise SchedulerError(f"{r.rid}: {r.state} with an incomplete fetch")
            if f is not None and incomplete and (f.sim_done_at is None) != (r.rid in self.link):
                raise SchedulerError(f"{r.rid}: fetch on the link={r.rid in self.link}, link done at {f.sim_done_at}")
        if len(self._fetching) > len(self.requests) or len(self.link) > len(self._fetching):
            raise SchedulerError(f"{len(self._fetching)} fetching, {len(self.link)} on the link, {len(self.requests)} requests")
        self.kv.check([(r.path, r.held, r.reserved) for r in self.requests.values()])


def _by_seq(r: _Request) -> int:
    return r.seq


def _ceil_div_f(a: float, b: float) -> int:
    """ceil(a / b) for positive floats."""
    q = int(a // b)
    return q + 1 if q * b < a else q


__all__ = ["EngineScheduler", "PHASES"]
