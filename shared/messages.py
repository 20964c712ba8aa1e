"""Every message that travels over NATS, one type per subject (DESIGN §3).

Producer → consumer flow, in the order of the subject table:

    worker ──kv.events.<node>──────▶ kvdirectory      (KvEventBatch, per-node seq)
    kvdirectory ──kv.resync.<node>─▶ worker           (KvResyncRequest → KvSnapshot)
    router ──kv.lookup─────────────▶ kvdirectory      (KvLookupRequest → KvLookupReply)
    router ──branch.events─────────▶ kvdirectory      (BranchStart | BranchEnd | BranchToolCall | BranchSyncDone)
    router ──branch.query──────────▶ kvdirectory      (BranchQuery → BranchQueryReply: a branch this router never saw)
    router ──route.placed──────────▶ kvdirectory      (RoutePlaced)
    kvdirectory ──kv.counts.<node>─▶ worker           (CountUpdates, per-node seq)
    kvdirectory ◀─kv.countsync.<node>─ worker         (CountSyncRequest → CountSnapshot, after a seq gap)
    worker ──kv.pool.<node>────────▶ worker           (PoolLocate → PoolLocation, real-bytes L2)
    worker ──node.state.<node>─────▶ router, planner  (NodeState)
    launcher ──node.down.<node>────▶ router           (NodeDown: the node's process exited)
    worker ──node.iters.<node>─────▶ planner          (IterationRecords)
    planner ──split.commands───────▶ workers, router  (SplitCommand)
    worker ──split.applied─────────▶ all              (SplitApplied)
    router ──work.<node>.prefill───▶ worker           (PrefillWork)
    worker ──work.<node>.kv────────▶ worker           (KvChunk → KvChunkAck: a hand-off's K/V in pieces, first)
    worker ──work.<node>.kvcancel──▶ worker           (KvCancel: its sender gave the hand-off up; free its K/V)
    worker ──work.<node>.decode────▶ worker           (DecodeWork, prefill → decode hand-off)
    router ──work.<node>.abort─────▶ worker           (RequestAbort)
    worker ──req.<rid>.out.<n>─────▶ router           (TokenChunk stream)
    router ◀─route.bind────────────  worker           (DecodeBindRequest → DecodeBindReply)
    router ◀─work.requeue──────────  worker           (WorkRequeue → WorkRequeueReply)
    router ◀─route.held────────────  worker           (HeldQuery → HeldReply: requests its owner dropped)
    any ──svc.heartbeat.<service>──▶ launcher, tap    (Heartbeat)
    any ◀─svc.stats.<instance>─────  tests, operators (StatsRequest → StatsReply)
    planner ◀─split.get────────────  router, workers  (SplitQuery → SplitCommand)
    planner ──planner.decisions────▶ tap, report      (PlannerDecision, every evaluation)
    planner ◀─split.set────────────  operator CLI     (SplitSetRequest → SplitSetReply)
    planner ──planner.models───────▶ router           (PlannerModels)

Rules (msgspec schema evolution): every message is a frozen, keyword-only
Struct encoded as a msgpack *map* (never ``array_like``); fields are only ever
appended, always with a default; an existing field never changes type.
Unknown fields are skipped on decode, so old readers survive new writers.
Times named ``*_at``/``ts`` are in *simulated* seconds on the shared cluster
clock (``shared.clock``); durations named ``*_s`` are simulated seconds;
token counts are tokens; ``block_hashes`` are the chained SGLang page hashes of
``shared.hashing`` (signed int64).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta, Struct

from shared.itermodel import DecodeModel, PrefillModel

SCHEMA_VERSION = 1

Tier = Literal["gpu", "host"]
"""KV tier: ``gpu`` is L1 (GPU memory), ``host`` is L2 (host memory)."""

Phase = Literal["prefill", "decode", "both"]
"""Node phase: a prefill node, a decode node, or ``both`` (collocated)."""

BranchKind = Literal["main", "fork", "subagent"]

NonNeg = Annotated[int, Meta(ge=0)]
NonNegF = Annotated[float, Meta(ge=0.0)]
Boot = Annotated[str, Meta(pattern=r"^(\d{20}-[0-9a-f]{1,32})?$")]
"""A process incarnation (:func:`new_boot`: 20 digits of wall ns, ``-``, hex), or empty (not known). Any other
text is refused at decode (counted and dropped): compared as a string, a malformed boot such as ``w-invented``
sorts after every real one, so one bad message would make a live service take itself for superseded."""


class Msg(Struct, frozen=True, kw_only=True):
    """Envelope shared by every message: schema version and publisher id."""

    v: int = SCHEMA_VERSION
    """Schema version of the publisher."""
    src: str = ""
    """Instance id of the publisher (e.g. ``worker-w0``); set by the bus."""


# --------------------------------------------------------------------------- #
# kv.events.<node>  (worker → directory; JetStream-captured, replayable)
# --------------------------------------------------------------------------- #


class BlockStored(Struct, frozen=True, kw_only=True, tag=True, omit_defaults=True, gc=False):
    """Blocks became resident in ``tier`` on the publishing node.

    Mirrors SGLang's ``BlockStored`` (tag = class name, map layout) with a tier.
    ``block_hashes`` are consecutive pages of one sequence, parent first.
    """

    block_hashes: list[int]
    parent_block_hash: int | None = None
    """Hash of the page preceding ``block_hashes[0]``; None at a sequence start."""
    tier: Tier = "gpu"
    block_size: NonNeg = 0
    """Tokens per block (page size); checked by the directory, mismatch = loud error."""


class BlockRemoved(Struct, frozen=True, kw_only=True, tag=True, omit_defaults=True, gc=False):
    """Blocks were evicted from ``tier`` on the publishing node."""

    block_hashes: list[int]
    tier: Tier = "gpu"


class AllBlocksCleared(Struct, frozen=True, kw_only=True, tag=True, omit_defaults=True, gc=False):
    """Every block of ``tier`` (or of every tier when ``tier`` is None) was dropped."""

    tier: Tier | None = None


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KvEventBatch(Msg, frozen=True, kw_only=True):
    """KV events of one engine step. ``seq`` starts at 1 and grows by exactly 1
    per batch and node, so a consumer detects a lost or reordered batch."""

    node: str
    seq: Annotated[int, Meta(ge=1)]
    ts: float = 0.0
    events: list[KvEvent] = []


# kv.resync.<node>  (directory → worker, request/reply)


class KvResyncRequest(Msg, frozen=True, kw_only=True):
    """Ask a worker for a full snapshot of its blocks after a sequence gap."""

    node: str
    reason: str = ""
    expected_seq: int = 0
    """The sequence number the requester expected next."""


class KvSnapshot(Msg, frozen=True, kw_only=True):
    """Every block a node holds, consistent with KV batch ``seq``: the requester
    replaces its view of the node with it and applies batches with a higher seq."""

    node: str
    seq: NonNeg
    block_size: NonNeg
    gpu: list[int] = []
    host: list[int] = []
    gpu_parents: list[int | None] = []
    """``gpu_parents[i]`` is the parent hash of ``gpu[i]`` (None at a sequence
    start); empty when the worker does not know them. Lets the directory place
    blocks it never saw in its prefix tree."""
    host_parents: list[int | None] = []
    """Same for ``host``."""


# kv.lookup  (router → directory, request/reply)


class KvLookupRequest(Msg, frozen=True, kw_only=True):
    """Where is this block path cached? ``block_hashes`` is the request's full path."""

    block_hashes: list[int]
    block_size: NonNeg
    rid: str = ""
    """The request looked up for (its trace's ``ei.rid`` on the directory's span); empty: not said."""


class NodePrefix(Struct, frozen=True, omit_defaults=True, gc=False):
    """Longest prefixes of a looked-up path held by one node, in blocks.

    Positional construction ``NodePrefix(node, gpu, host, local)`` is allowed (the
    directory builds one per node per lookup with ``map``); the wire form is by name.
    """

    node: str
    gpu_blocks: NonNeg = 0
    """Longest prefix whose every block is in this node's L1."""
    host_blocks: NonNeg = 0
    """Longest prefix whose every block is in this node's L2."""
    local_blocks: NonNeg = 0
    """Longest prefix whose every block is in this node's L1 or L2."""


class FetchRange(Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """Blocks ``[start, end)`` of a looked-up path that ``node`` holds in ``tier``:
    where a prefill node fetches them from (host copies preferred, DESIGN §1)."""

    node: str
    start: NonNeg
    end: NonNeg
    tier: Tier = "host"


class KvLookupReply(Msg, frozen=True, kw_only=True):
    """Answer to ``KvLookupRequest``; nodes with no matching prefix are omitted."""

    block_size: NonNeg
    nodes: list[NodePrefix] = []
    longest_any: NonNeg = 0
    """Longest prefix whose every block is held somewhere in the cluster (any node, any tier)."""
    error: str | None = None
    """Set when the lookup was refused (e.g. block-size mismatch); fields are then empty."""
    sources: list[FetchRange] = []
    """Fetch plan covering blocks ``[0, longest_any)``, in order; a prefill node n
    fetches the part beyond its ``local_blocks`` from ranges held by other nodes
    (``services.kvdirectory.lookup.fetch_plan`` computes t_c,n and x_n of Eq. 7)."""


# --------------------------------------------------------------------------- #
# branch.events, route.placed  (router → directory)
# --------------------------------------------------------------------------- #


class BranchStart(Msg, frozen=True, kw_only=True, tag=True):
    """A new branch: the main branch of an agent, a fork, or a sub-agent."""

    branch_id: str
    kind: BranchKind = "main"
    parent_branch_id: str | None = None
    agent_id: str | None = None
    ts: float = 0.0


class BranchEnd(Msg, frozen=True, kw_only=True, tag=True):
    """The harness ended a branch: none of its blocks will be read by it again.

    ``expired=True``: not an end but a router's eviction (its ``--max-active-branches`` cap): the
    directory expires the branch as its TTL does (counts released, the id resumable: a later
    ``BranchStart`` or placement of it is a resume, never refused).

    ``rid`` (with ``expired=True``): the evicting router's latest placed request of the branch
    (``RoutePlaced.rid``; ``""`` = it placed none). The directory ignores the eviction when its own
    latest placement of the branch was another request (another router serves the branch now,
    ``branch.stale_evict``). None (a sender from before the field): expired whatever the placement."""

    branch_id: str
    ts: float = 0.0
    expired: bool = False
    rid: str | None = None


class BranchToolCall(Msg, frozen=True, kw_only=True, tag=True):
    """The harness says a tool call of the branch is outstanding (issue 21): the directory keeps
    the branch active, and its blocks counted, until ``ts + expected_s`` (0 = the directory's
    ``--max-tool-hold-s``) or the branch's next request; ``outstanding=False`` ends the hold."""

    branch_id: str
    outstanding: bool = True
    expected_s: NonNegF = 0.0
    """Expected tool run time, s (0 = unknown)."""
    ts: float = 0.0


class BranchSyncDone(Msg, frozen=True, kw_only=True, tag=True):
    """A router's last message of its answer to a directory's ``branch.sync``: it has republished its active branches
    (``branches`` ``BranchStart`` and ``placements`` ``RoutePlaced``) for the sync ``sync_id``. Published on
    ``branch.events`` after the republished starts (one publisher, one subject of the stream: read after them); the
    directory is settled once every router it knows of has sent one (``services/kvdirectory/settle.py``). The
    router's instance id is ``src`` (set by the bus)."""

    sync_id: str
    """The ``BranchSync.sync_id`` answered."""
    directory: str = ""
    """The ``BranchSync.directory`` answered."""
    branches: NonNeg = 0
    placements: NonNeg = 0


BranchEvent = Union[BranchStart, BranchEnd, BranchToolCall, BranchSyncDone]


# branch.query  (router → directory, request/reply)

BranchState = Literal["active", "expired", "ended", "unknown"]
"""A branch's state at the KV directory, the cluster's record of branches (every router's ``BranchStart`` reaches
it): ``active`` (started, neither ended nor expired: its blocks counted), ``expired`` (silent for its TTL or
evicted by a router's cap: counts released, resumable), ``ended`` (a ``BranchEnd`` came; remembered for a TTL, at
most ``ended_memory`` ids) or ``unknown`` (never started there, or forgotten)."""


class BranchQuery(Msg, frozen=True, kw_only=True):
    """What state is ``branch_id`` in? Asked by a router whose branch table does not hold the id when a harness
    ends it or sends its tool-call hint (``POST /v1/branches/{id}/end`` / ``tool-call``): another router served
    it, or this router restarted since. The directory answers from its branch table (no side effect)."""

    branch_id: str


class BranchQueryReply(Msg, frozen=True, kw_only=True):
    """The directory's answer to :class:`BranchQuery`: the branch's :data:`BranchState` when asked. It does not
    wait for ``branch.events``: a ``BranchStart`` still in the stream (published an instant before) is answered
    ``unknown``."""

    branch_id: str
    state: BranchState = "unknown"
    synced: bool = True
    """False while a (re)started directory may not have read the routers' republish of their active branches (the
    answer to its ``branch.sync``; ``services/kvdirectory/settle.py``): an ``unknown`` then is no answer (the router
    answers 503 with ``Retry-After: 1``, not 404). True from a directory that predates the field."""


class RoutePlaced(Msg, frozen=True, kw_only=True):
    """Request ``rid`` of ``branch_id`` was placed on ``node`` for ``phase`` with
    this block path (input of paper Alg. E.1/E.2)."""

    rid: str
    branch_id: str
    node: str
    phase: Phase
    block_hashes: list[int] = []
    ts: float = 0.0


# kv.counts.<node>  (directory → worker)


class CountUpdates(Msg, frozen=True, kw_only=True):
    """New branch counts R[b, node] for blocks whose count changed since the node's last message
    (paper Alg. E.2), each block once; a directory run with ``held_counts_only`` (the simulator)
    leaves out the blocks the node holds in neither tier (their counts come with the re-send of a
    host store: ``BranchTable.take_count_updates``)."""

    node: str
    seq: NonNeg = 0
    hashes: list[int] = []
    counts: list[NonNeg] = []
    """``counts[i]`` is the new count of ``hashes[i]``."""
    epoch: str = ""
    """The directory process that sent it (a new id each time it starts). A restarted directory
    starts from empty counts and sends only changes, so a count set before the restart would never
    be sent as 0: a worker that sees ``epoch`` change resets every count to 0 before applying the
    message (``EngineScheduler.reset_counts``)."""
    beacon: bool = False
    """True: not a numbered message but the directory's periodic note that it has published the
    node's messages up to ``seq`` (``--count-seq-beacon-s``; no entries, ``seq`` not incremented).
    A worker whose last applied ``seq`` is below it lost the last message(s) with none after them
    to show the gap, and syncs (``kv.countsync``). Absent (False) from a directory that predates
    it; a worker that predates it decodes it as an empty message numbered ``seq``: dropped as
    stale when ``seq`` is its last, a gap when past ``last + 1``, and taken as message ``last + 1``
    otherwise, which hides that message's loss exactly as no beacon would (``countseq.py``)."""


# kv.countsync.<node>  (worker → directory, request/reply: the node's counts after a kv.counts gap)


class CountSyncRequest(Msg, frozen=True, kw_only=True):
    """A worker asks the KV directory for every branch count R[b, node] of its node: a
    ``kv.counts.<node>`` message was lost (its ``seq`` skipped one), or the worker reconnected.

    Paged: the first request (``snapshot`` empty, ``offset`` 0) makes the directory take the
    snapshot and answer its first piece; the worker asks for the next pieces with the snapshot's
    id and the offset of the next entry, until ``offset`` reaches ``CountSnapshot.total``."""

    node: str
    reason: str = ""
    """Why (``gap``, ``reconnect``, ``first contact``): logged by the directory."""
    epoch: str = ""
    """``CountUpdates.epoch`` the worker holds counts of (empty: none yet)."""
    last_seq: NonNeg = 0
    """The last ``CountUpdates.seq`` the worker applied in ``epoch``."""
    snapshot: str = ""
    """Id of the snapshot whose pieces are asked for (empty: take a new one)."""
    offset: NonNeg = 0
    """Index of the first entry asked for (0 with a new snapshot)."""


class CountSnapshot(Msg, frozen=True, kw_only=True):
    """One piece of every block's branch count R[b, node] > 0 on ``node`` (paper Alg. E.2), as
    the directory's counts were after ``kv.counts.<node>`` message ``seq`` of ``epoch``: the worker
    resets its counts to 0, applies every piece, then the messages with a higher ``seq``."""

    node: str
    epoch: str = ""
    """The directory process's ``CountUpdates.epoch``."""
    seq: NonNeg = 0
    """The last ``CountUpdates.seq`` the directory had made for ``node`` when it took the snapshot
    (0: none yet)."""
    snapshot: str = ""
    """Id of this snapshot (pass it back for the next piece)."""
    offset: NonNeg = 0
    """Index of ``hashes[0]`` in the whole snapshot."""
    total: NonNeg = 0
    """Entries of the whole snapshot (blocks with R[b, node] > 0). A worker fetches at most
    ``services.worker.countseq.SNAPSHOT_MAX_ENTRIES`` (2^30; past it the sync ends, counted)."""
    hashes: list[int] = []
    counts: list[NonNeg] = []
    """``counts[i]`` is R[``hashes[i]``, node] (branches, > 0)."""
    error: str | None = None
    """Set when the piece cannot be served (the snapshot expired or was replaced, or a new snapshot
    of the node was asked sooner than the directory's ``--count-sync-min-interval-s`` allows): ask
    again from offset 0 (after a backoff)."""


# kv.pool.<node>  (worker → worker, request/reply: real-bytes host KV pool)


class PoolLocate(Msg, frozen=True, kw_only=True):
    """Where in ``node``'s registered host KV buffer are these blocks?
    (``services.worker.kvpool``; the puller then reads them with Mooncake.)"""

    node: str
    """The holder asked (checked against its own id)."""
    block_hashes: list[int]
    lease_s: NonNegF = 5.0
    """Wall seconds the holder keeps every located slot from reuse, even if it
    evicts the block meanwhile (the puller is about to read it)."""


class PoolLocation(Msg, frozen=True, kw_only=True):
    """Answer to :class:`PoolLocate`: transfer-engine address and slot of each block."""

    node: str
    session: str = ""
    """Mooncake session id of the holder's transfer engine (``ip:rpc_port``,
    P2PHANDSHAKE metadata): the ``target`` of the puller's reads."""
    protocol: str = "tcp"
    base_addr: NonNeg = 0
    """Address of the holder's registered buffer (slot 0) in the holder's process."""
    slot_bytes: NonNeg = 0
    """Bytes per block slot; puller and holder must agree."""
    block_hashes: list[int] = []
    """Echo of the request, same order."""
    offsets: list[int] = []
    """``offsets[i]``: byte offset of ``block_hashes[i]``'s slot from ``base_addr``; -1 = not held."""
    checksums: list[int] = []
    """``checksums[i]``: CRC-32 of that slot recorded when the block was stored (0 when not held)."""
    checksum_algo: str = "crc32"
    payload: Literal["synthetic", "external"] = "synthetic"
    """``synthetic``: payloads derive from the block hash (puller can recompute them)."""
    error: str | None = None
    """Set when the holder refused the request; the lists are then empty."""
    instance: str = ""
    """The holder pool's process (a random nonce drawn at its start): a puller tells a restarted holder by it even
    where the new buffer lands at the old ``base_addr`` (ASLR off); "" from a holder older than this field."""


# --------------------------------------------------------------------------- #
# node.state.<node>, node.iters.<node>  (worker → router, planner)
# --------------------------------------------------------------------------- #


class QueuedWork(Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """Prefill work of one queued request as the node sees it (Eq. 3 inputs)."""

    rid: str
    uncached_tokens: NonNeg = 0
    cached_tokens: NonNeg = 0
    restore_tokens: NonNeg = 0
    """Cached tokens that must be restored from host memory (L2 → L1)."""


class NodeState(Msg, frozen=True, kw_only=True, gc=False):
    """Snapshot of a node at an iteration launch (throttled) or heartbeat."""

    node: str
    seq: NonNeg = 0
    ts: float = 0.0
    phase: Phase = "both"
    epoch: NonNeg = 0
    """Epoch of the split command this node last applied."""
    accepting: bool = True
    """False while draining for a phase switch or shutting down."""
    engine: str = "sim"
    block_size: NonNeg = 0
    running: NonNeg = 0
    """Requests in the running batch (prefilling or decoding)."""
    waiting: NonNeg = 0
    """Requests queued for prefill (or waiting for decode KV room), and on a decode node the hand-offs waiting in its
    queue for hand-off buffer room (``handoffkv.KvAssembler.queue``)."""
    decoding: NonNeg = 0
    remaining_s: NonNegF = 0.0
    """Remaining time of the iteration in flight."""
    queue: list[QueuedWork] = []
    """Queued prefill requests in arrival order (Eq. 7's Q_n)."""
    gpu_free_blocks: NonNeg = 0
    gpu_total_blocks: NonNeg = 0
    host_used_blocks: NonNeg = 0
    host_total_blocks: NonNeg = 0
    boot: Boot = ""
    """The publishing process's incarnation (:func:`new_boot`): a later start compares greater, so two
    processes that announce one node id (a worker restarted while the old process was frozen, then
    resumed) are told apart: the older one stops (``services/worker``) and the router skips its states.
    Empty: not known (an older publisher)."""
    pid: NonNeg = 0
    """The publishing process's id (``os.getpid()``): a router fences a node on a :class:`NodeDown` only when the
    notice names this pid (the process it trusts for the node), and skips only this process's late states after.
    0: not known (an older publisher; the router then goes by :attr:`NodeDown.exited_ns` against ``boot``)."""


def new_boot(now_ns: int, rand: bytes) -> str:
    """A process incarnation id for :attr:`NodeState.boot`: its start in wall nanoseconds (20 digits), ``-``,
    ``rand`` in hex (the tie-break of two starts in one nanosecond). Ordered as strings by start time
    (across machines as far as their clocks agree)."""
    return f"{now_ns:020d}-{rand.hex()}"


def boot_older(boot: str, than: str) -> bool:
    """Whether incarnation ``boot`` started before ``than`` (False when either is unknown, empty)."""
    return bool(boot) and bool(than) and boot < than


class IterationRecord(Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """One engine iteration, the sample the planner fits Eq. 1/2 on."""

    start: float
    duration_s: NonNegF
    phase: Literal["prefill", "decode", "mixed"]
    prefill_requests: NonNeg = 0
    sum_uncached: NonNeg = 0
    """Σ t_uc: uncached prompt tokens computed in this iteration."""
    sum_qk_pairs: NonNeg = 0
    """Σ A = Σ (t_uc·t_c + t_uc·(t_uc+1)/2) over the prefill chunks."""
    sum_restored: NonNeg = 0
    """Σ t_rst: tokens restored from host memory."""
    sum_cached: NonNeg = 0
    decode_batch: NonNeg = 0
    """B: running requests in the decode part."""
    repeat: Annotated[int, Meta(ge=1)] = 1
    """Identical consecutive decode iterations folded into this record."""


class IterationRecords(Msg, frozen=True, kw_only=True):
    node: str
    records: list[IterationRecord] = []


# --------------------------------------------------------------------------- #
# split.commands / split.applied / split.get
# --------------------------------------------------------------------------- #


class SplitCommand(Msg, frozen=True, kw_only=True):
    """The PD split every node must serve from ``epoch`` on."""

    epoch: NonNeg
    phases: dict[str, Phase]
    """node id → phase."""
    reason: str = ""
    decided_at: float = 0.0
    boot: Boot = ""
    """The issuing planner process's incarnation (:func:`new_boot`): a planner that hears a command from one that
    started later was replaced (restarted while frozen, then resumed) and stops, so two planners never re-issue
    over each other's commands. Empty: not known (an older planner, an operator's tool)."""


class SplitQuery(Msg, frozen=True, kw_only=True):
    """Ask the planner for the current split (reply: SplitCommand)."""


class SplitApplied(Msg, frozen=True, kw_only=True):
    """Progress of one node through a split command."""

    epoch: NonNeg
    node: str
    phase: Phase
    status: Literal["draining", "serving"]
    decided_at: float = 0.0
    applied_at: float = 0.0
    switch_s: NonNegF = 0.0
    """decision → serving the new phase (only when ``status == 'serving'``); for a node process
    that started after the decision (a restart catching up through ``split.get``), its start →
    serving."""
    received_at: float = 0.0
    """When the node received the command (simulated s); ``received_at − decided_at`` is
    the command's propagation."""
    drained_at: float = 0.0
    """``serving`` only: when the last request running on the node finished (= ``received_at``
    when nothing had to drain). ``drained_at − received_at`` is the drain; the control
    overhead beyond draining is ``switch_s − (drained_at − received_at)``."""
    requeued: NonNeg = 0
    """Queued requests the node handed back to the router for re-routing (``work.requeue``)."""


# --------------------------------------------------------------------------- #
# planner.decisions / split.set  (planner → tap, report; operator → planner)
# --------------------------------------------------------------------------- #


class CandidateGain(Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """One candidate split of a planning window (paper Eq. 6 and its significance gate)."""

    prefill_nodes: NonNeg
    """p: prefill nodes of the candidate."""
    split: str
    """The candidate as ``xPyD``."""
    mean_gain: float = 0.0
    """ḡ: mean over slices of the gain (``objective``): Θ(candidate) − Θ(current), requests/s,
    or the predicted mean latency saved, s."""
    std_gain: float = 0.0
    """σ_g: sample standard deviation of the per-slice gains (unit of ``mean_gain``)."""
    threshold: float = 0.0
    """What ḡ must exceed to qualify: z·σ_g/√m (z = 2 in the paper), or the planner's
    minimum gain (a share of the current Θ, or of its predicted latency) when that is larger."""
    qualifies: bool = False
    changes: NonNeg = 0
    """Nodes that switch phase to reach it (fewest-change assignment)."""
    ttft_p95_s: float | None = None
    """SLO guard: predicted P95 TTFT of the candidate (s); None when the guard is off; inf = overloaded."""
    vetoed: str = ""
    """Why the SLO guard vetoed a qualifying candidate (empty = not vetoed)."""
    objective: str = "throughput"
    """What the gains measure: ``throughput`` (Θ(candidate) − Θ(current), req/s; the paper)
    or ``latency`` (predicted mean latency of the current split − the candidate's, s)."""
    theta: float | None = None
    """Mean Θ of the candidate over the window's slices (req/s, Eq. 5)."""
    latency_s: float | None = None
    """Predicted mean latency of a request on the candidate (s) when the planner computed it
    (windows decided on latency, and the SLO guard's reversal under the ``latency``
    objective); inf = its prefill or decode pool cannot take the rate (JSON: null)."""


class PlannerDecision(Msg, frozen=True, kw_only=True):
    """One planner evaluation and its outcome, switch or not (STYLE §2.3: decisions explain themselves)."""

    seq: NonNeg = 0
    ts: float = 0.0
    """Simulated time of the decision."""
    policy: str = ""
    """``evolving``, ``dynamo``, ``arrow``, ``static`` or ``operator``."""
    action: str = "no_switch"
    """``switch``, ``no_switch``, ``skip`` (busy / cooldown / too little data), ``warmup``, ``adopt`` (a started
    planner takes over the split the nodes serve, or re-issues its own above it: ``PlannerCore._take_cluster``);
    each a series of ``ei_planner_decisions_total{action}`` (``services/planner/prom.py``)."""
    split_before: str = ""
    split_after: str = ""
    epoch: NonNeg = 0
    """Epoch of the split in force after the decision."""
    reason: str = ""
    candidates: list[CandidateGain] = []
    metrics: dict[str, float] = {}
    """Every numeric term behind the decision (Θ, q̄, λ, queue load, KV utilisation ...)."""


class SplitSetRequest(Msg, frozen=True, kw_only=True):
    """Operator → planner: adopt ``split`` (``xPyD`` or ``collocated``) now."""

    split: str
    reason: str = "operator"


class SplitSetReply(Msg, frozen=True, kw_only=True):
    """Planner's answer to :class:`SplitSetRequest`."""

    ok: bool
    error: str | None = None
    """Why the split was refused (malformed, wrong node count ...)."""
    command: SplitCommand | None = None
    """The new split command (new epoch) when ``ok``."""
    retry: bool = False
    """Refused for now, not for the split asked: the planner is starting (it has not read the split the
    nodes serve yet) and the same request may succeed in a few seconds. False on a refusal of the split
    itself (malformed, not covering the cluster's nodes): the asker's error. ``evolving-infra split set``
    exits 1 on a refusal with ``retry``, 2 on one without (a usage error)."""


ADOPTING_HOLD_S = 1.0
"""Wall seconds a starting planner holds a ``split.get`` or ``split.set`` past what is left of its adoption grace
(``services/planner/service.py`` ``_adoption_ended``) before it answers; a held ``split.set`` is applied when the
adoption ends meanwhile, whether or not its asker still waits. After a refusal for now the grace is over, so the
planner holds the next try up to this long: ``evolving-infra split set`` asks again only while its ``--timeout``
has that (and a margin) left."""


# --------------------------------------------------------------------------- #
# work.<node>.prefill / work.<node>.decode / work.<node>.kv / work.<node>.abort ; req.<rid>.out.<node>
# --------------------------------------------------------------------------- #


class Sampling(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request's sampling parameters (vLLM's ``SamplingParams`` subset the ``torch``
    engine applies), carried by :class:`PrefillWork` and the hand-off :class:`DecodeWork`
    so the prefill node (first token) and the decode node (the rest) sample alike.

    The defaults are greedy decoding; a work without ``sampling`` (None: old senders,
    the simulator) is greedy. The ``sim`` engine has no real tokens and ignores all of it.
    Stop *strings* are not here: the router ends the text at them (it detokenizes).
    """

    temperature: NonNegF = 0.0
    """Softmax temperature; below 1e-5 (vLLM's ``_SAMPLING_EPS``) = greedy (argmax)."""
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus: keep the most likely tokens whose probabilities sum to ``top_p``; 1 = off."""
    top_k: NonNeg = 0
    """Keep the ``top_k`` most likely tokens; 0 = off (the router maps vLLM's -1 to 0)."""
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    """Drop tokens less likely than ``min_p`` × the most likely one's probability; 0 = off."""
    seed: int | None = None
    """Reproducible sampling: output position i is drawn with a uniform hashed from (``seed``, i)
    (SplitMix64, no ``torch.Generator``: ``torch_engine.sampling``); None = a random seed per request."""
    stop_token_ids: list[int] = []
    """Token ids that end the request (``finish_reason`` ``stop``; ``ignore_eos`` does not
    apply to them, as in vLLM); the token is part of the output, its text is not shown."""
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    """vLLM / OpenAI: subtracted from the logit of every token already in the request's output
    (the client's output: a re-dispatch's earlier output counts); 0 = off."""
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    """vLLM / OpenAI: subtracted × the token's count in the output so far; 0 = off."""
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    """vLLM (CTRL, Keskar et al. 2019): the logit of a token in the prompt or the output is
    divided by it when positive, multiplied when not; 1 = off."""
    min_tokens: NonNeg = 0
    """vLLM: the model's EOS token(s) and ``stop_token_ids`` are masked (logit -inf) while the
    client's output is shorter than this; 0 = off."""
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    """Log-probabilities asked for: None = none (no cost); k = the chosen token's and the k
    most likely tokens' (``TokenChunk.logprobs`` / ``top_ids`` / ``top_logprobs``) of every
    output token, from the raw model distribution (vLLM's default ``logprobs_mode``
    ``raw_logprobs``: log_softmax of the logits before temperature and filters). Only a real
    engine (``torch``) has them; the ``sim`` engine refuses such a work."""
    logit_bias: dict[int, float] = {}
    """vLLM / OpenAI: token id → bias in [-100, 100] added to that token's logit before
    penalties, temperature and the filters, on greedy and sampled rows alike (-100 effectively bans
    a token, +100 all but forces it); empty = off. Ids are in the model's vocabulary (the router
    checks its tokenizer's, the ``torch`` engine the model's: it refuses the work otherwise). Only a
    real engine applies it; the ``sim`` engine refuses such a work, as it does ``logprobs``."""

    @property
    def greedy(self) -> bool:
        """Argmax decoding (temperature below 1e-5)."""
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        """Any of ``presence_penalty`` / ``frequency_penalty`` / ``repetition_penalty`` is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class PrefillWork(Msg, frozen=True, kw_only=True):
    """A request dispatched to a node for prefill (and decode when collocated)."""

    rid: str
    prompt_tokens: Annotated[int, Meta(ge=1)]
    max_tokens: Annotated[int, Meta(ge=1)]
    block_size: Annotated[int, Meta(ge=1)]
    block_hashes: list[int] = []
    """Chained hashes of the prompt's full blocks (len == prompt_tokens // block_size)."""
    token_ids: bytes = b""
    """Prompt token ids as little-endian uint32 (empty when the engine needs none)."""
    branch_id: str | None = None
    decode_node: str | None = None
    """Node that decodes after prefill; None = decode on this node (collocated)."""
    sent_at: float = 0.0
    epoch: NonNeg = 0
    fetch: list[FetchRange] = []
    """Fetch plan chosen by the router (``ttft`` routing): block ranges of the
    prompt's path to copy from peers' memory while the request waits in this
    node's queue (paper §4.2, Alg. E.3 l.12). Empty = fetch nothing (the node
    uses its own cache and recomputes the rest)."""
    decode_binding: Literal["dispatch", "start"] = "dispatch"
    """``dispatch``: ``decode_node`` is the binding. ``start`` (with ``decode_node``
    None, on a prefill node): the worker asks the router for the decode node on
    ``route.bind`` when the request's prefill starts (paper Eq. 7, App. D.1)."""
    attempt: NonNeg = 0
    """Dispatch attempt of ``rid`` (fencing token): at the first dispatch 0, or, for a rid that is
    the client's ``X-Request-ID`` (which may come again), the router's wall clock in ms or one past
    the last attempt of an earlier request with that id (``RouterService._RetriedRids``); +1 each
    time the router re-dispatches the request after its node was fenced. Only its order means
    something: a node serves only the newest attempt it has seen; the router drops output of any
    older one (issue #22)."""
    output_offset: NonNeg = 0
    """Output tokens the client already has: a re-dispatch of a request whose decode node
    died sends prompt + those tokens as the new prompt; the new output's position 0 is
    output position ``output_offset`` of the request (the engine indexes its outputs so)."""
    router: str = ""
    """Instance id of the router that owns the request (its ``route.bind.<router>`` and
    ``work.requeue.<router>`` subjects); empty = the default instance ``router``."""
    ignore_eos: bool = False
    """Generate ``max_tokens`` even past the model's end-of-sequence token (vLLM's
    ``SamplingParams.ignore_eos``). Without it a real engine (``torch``) ends the request
    at its EOS token (``finish_reason`` ``stop``); the ``sim`` engine has no tokens and
    always generates ``max_tokens``."""
    sampling: Sampling | None = None
    """Sampling parameters (:class:`Sampling`); None = greedy. A re-dispatched request
    (``output_offset``) keeps them, so a seeded request continues its sequence exactly."""


class DecodeWork(Msg, frozen=True, kw_only=True):
    """Prefill → decode hand-off: the request's KV is in flight to this node."""

    rid: str
    prompt_tokens: Annotated[int, Meta(ge=1)]
    max_tokens: Annotated[int, Meta(ge=1)]
    block_size: Annotated[int, Meta(ge=1)]
    generated: NonNeg = 1
    """Output tokens already produced (the prefill produced the first one)."""
    block_hashes: list[int] = []
    token_ids: bytes = b""
    branch_id: str | None = None
    prefill_node: str = ""
    kv_ready_at: float = 0.0
    """When the GPU-to-GPU KV transfer completes (simulated clock)."""
    kv_bytes: NonNeg = 0
    """Real engines: bytes of the prompt's K/V (``len(kv)`` inline, or the sum of the :class:`KvChunk` pieces of
    ``kv_transfer``); 0 for the sim engine."""
    attempt: NonNeg = 0
    """Dispatch attempt of ``rid`` (fencing token): at the first dispatch 0, or, for a rid that is
    the client's ``X-Request-ID`` (which may come again), the router's wall clock in ms or one past
    the last attempt of an earlier request with that id (``RouterService._RetriedRids``); +1 each
    time the router re-dispatches the request after its node was fenced. Only its order means
    something: a node serves only the newest attempt it has seen; the router drops output of any
    older one (issue #22)."""
    output_offset: NonNeg = 0
    """See ``PrefillWork.output_offset``."""
    router: str = ""
    """See ``PrefillWork.router``."""
    ignore_eos: bool = False
    """See ``PrefillWork.ignore_eos``."""
    output_ids: list[int] = []
    """Real engines (``torch``): the ``generated`` output token ids the prefill node produced
    (the decode node continues from the last one); empty for the sim engine."""
    kv: bytes = b""
    """Real engines (``torch``): the prompt's K/V pages, ``ceil(prompt / block_size)`` pages
    of the engine's page layout (``TorchEngine.handoff``); empty for the sim engine."""
    sampling: Sampling | None = None
    """See ``PrefillWork.sampling`` (the decode node samples as the prefill node did)."""
    kv_transfer: str = ""
    """Real engines: the K/V went ahead apart, as ``kv_chunks`` :class:`KvChunk` pieces of this transfer id on
    ``work.<decode node>.kv``, every one acknowledged by the decode node before this message was sent (``kv`` is
    empty then); "" = the K/V is inline in ``kv`` (a hand-off the router re-binds, or the sim engine's: none)."""
    kv_chunks: NonNeg = 0
    """Pieces of ``kv_transfer`` (0 with ``kv`` inline)."""


class KvChunk(Msg, frozen=True, kw_only=True):
    """Prefill worker → decode worker (``work.<decode node>.kv``, request → :class:`KvChunkAck`): one piece of a
    PD hand-off's K/V (``services/worker/handoffkv.py``). A hand-off's K/V grows with the prompt (128 KiB a token
    for Llama-3-8B in bf16) past any NATS message (``max_payload``: 1 MiB by default, 16 MiB under ``up``); it
    goes in pieces of at most ``handoffkv.CHUNK_CAP_BYTES`` (8 MiB) that fit the connection's ``max_payload``,
    each acknowledged, before the :class:`DecodeWork` that names the transfer (``DecodeWork.kv_transfer``)."""

    transfer: str
    """The hand-off's transfer id, one NATS token: ``<prefill node>-<its process boot>-<n>`` (unique per send)."""
    rid: str
    index: NonNeg
    """This piece's place, 0 .. ``count`` - 1."""
    count: Annotated[int, Meta(ge=1)]
    """Pieces of the transfer."""
    offset: NonNeg
    """Byte offset of ``data`` in the K/V."""
    total: Annotated[int, Meta(ge=1)]
    """Bytes of the whole K/V (the layout of ``DecodeWork.kv``)."""
    crc32: NonNeg = 0
    """``zlib.crc32`` of ``data``: the decode node refuses a piece whose bytes differ."""
    data: bytes = b""
    """The piece's bytes; none: an ask (``handoffkv.ask_of``) of a transfer waiting in the decode node's queue for
    room, answered ``error`` "" when its turn came (the piece follows), else as its piece would be."""
    attempt: NonNeg = 0
    """The hand-off's ``DecodeWork.attempt``: an abort of this rid at this attempt or a later one frees the K/V on
    the decode node at once (not one of an older attempt: a re-dispatched request's new K/V stays)."""
    router: str = ""
    """The hand-off's ``DecodeWork.router`` (its owning router's instance id; "" = ``router``): an abort from another
    router leaves the K/V alone, as it leaves that router's request."""


class KvChunkAck(Msg, frozen=True, kw_only=True):
    """Decode worker's answer to a :class:`KvChunk`: stored (or already held: a piece sent again), or ``error``
    (why the decode node refused it: its hand-off buffer full, a piece that does not fit its transfer, a CRC-32
    mismatch, a transfer it dropped); the prefill node then fails the hand-off with that reason, but for ``full``."""

    transfer: str
    index: NonNeg = 0
    error: str = ""
    full: bool = False
    """The refusal is the decode node's hand-off buffer having no room now (``error`` says how much it holds): a
    transient state, so the prefill node sends the piece again after a short backoff (``handoffkv.FULL_TRIES``)
    before it fails the hand-off."""
    queued: NonNeg = 0
    """With ``full``: the transfer's place in the decode node's queue of transfers waiting for room (1 = next; room
    that frees goes to the oldest first ask first); 0 = not queued (a piece of a transfer already admitted, or the
    queue at its bound). A queued transfer's sender asks again after ``handoffkv.queue_poll_s(queued)`` and waits
    up to its ``--handoff-queue-wait-s``, not the ``FULL_TRIES`` retries; it keeps its place while it asks at least
    every ``handoffkv.TICKET_IDLE_S``."""


class KvCancel(Msg, frozen=True, kw_only=True):
    """Prefill worker → decode worker (``work.<decode node>.kvcancel``, core NATS, no answer): the hand-off of
    ``transfer`` will not be completed (a piece refused or unanswered, its ``DecodeWork`` refused by the bus, the
    prefill node stopping): the decode node frees the K/V it holds of it at once instead of at its idle timeout.
    Best effort: a lost one costs the timeout, as before."""

    transfer: str
    rid: str
    reason: str = ""


class DecodeBindRequest(Msg, frozen=True, kw_only=True):
    """Worker → router (``route.bind``): the prefill of ``rid`` starts now; which node decodes it?"""

    rid: str
    prefill_node: str
    prompt_tokens: NonNeg = 0
    max_tokens: NonNeg = 0
    branch_id: str | None = None
    attempt: NonNeg = 0
    """The work's ``attempt``; the router refuses to bind an older attempt than its own."""


class DecodeBindReply(Msg, frozen=True, kw_only=True):
    """Router's answer: the decode node with KV room and the fewest requests, or None (``reason``)."""

    rid: str
    decode_node: str | None = None
    reason: str = ""


class WorkRequeue(Msg, frozen=True, kw_only=True):
    """Worker → router (``work.requeue``): ``node`` hands back work it will not serve
    (queued when its phase switch began, or arrived for a phase it no longer serves).
    Exactly one of ``prefill`` / ``decode`` is set; the node has already forgotten it."""

    rid: str
    node: str
    reason: str = ""
    epoch: NonNeg = 0
    """The split epoch the node was switching to."""
    prefill: PrefillWork | None = None
    decode: DecodeWork | None = None
    attempt: NonNeg = 0
    """The work's ``attempt``; a hand-back of an older attempt than the router's is refused."""


class WorkRequeueReply(Msg, frozen=True, kw_only=True):
    """``accepted``: the router owns the request again (it re-routes it to exactly one node);
    False: the request is no longer pending there (finished, failed or aborted) — drop it."""

    rid: str
    accepted: bool = False
    reason: str = ""


class HeldQuery(Msg, frozen=True, kw_only=True):
    """Worker → owning router (``route.held.<router>``), every ``--owner-check-interval-s``:
    ``node`` holds these requests of that router (``rids[i]`` at attempt ``attempts[i]``);
    which does the router no longer want? A router that was SIGKILLed (no responder) or
    restarted (it has none of them) frees the node of work nobody reads."""

    node: str
    rids: list[str] = []
    attempts: list[NonNeg] = []
    peer: bool = False
    """True: another router asks (``node`` is its instance id), about an ``X-Request-ID`` it counts as this router's
    (``RouterService._duplicate_answer``); the answer is the same, but nothing is dropped for it, so the router
    counts and logs it apart (``held.peer_dropped``). False: a node (an older router's query, too)."""


class HeldReply(Msg, frozen=True, kw_only=True):
    """``dropped``: the rids of the query the router does not have in flight at that attempt
    (finished, failed, aborted, re-dispatched, or never its own): the node drops them."""

    dropped: list[str] = []


class BranchSync(Msg, frozen=True, kw_only=True):
    """Directory → routers (``branch.sync``), sent when a directory starts: every router
    republishes its active branches (``BranchStart``) and their latest placements
    (``RoutePlaced``), so a restarted directory gets its branch table and counts back (issue #22), then a
    :class:`BranchSyncDone`. Sent again (same ``sync_id``) every second while the directory is not settled, for a
    router that missed it; a router answers one ``sync_id`` once."""

    directory: str = ""
    ts: float = 0.0
    sync_id: str = ""
    """The directory process's id of this sync (one per start); empty: a sender from before the marker."""


class NodeKvLiveness(Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """One node's KV-view liveness as the directory sees it (issue #22)."""

    node: str
    silent_s: NonNegF = 0.0
    """Wall seconds the node has served (running or waiting work) without a KV batch."""
    last_batch_s: float | None = None
    """Wall seconds since its last KV batch (None: none yet)."""
    stale: bool = False
    """Silent past the directory's ``--kv-stale-after-s``: lookups leave it out."""


class KvLiveness(Msg, frozen=True, kw_only=True):
    """Directory → routers (``kv.liveness``, every ``--liveness-interval-s``): per node, how
    fresh the directory's view of its KV is. A router shows it in ``/v1/cluster`` and gives
    no prefix credit / fetch source to a stale node."""

    nodes: list[NodeKvLiveness] = []
    stale_after_s: NonNegF = 0.0


class RouteSent(Msg, frozen=True, kw_only=True):
    """Router → other routers (``route.sent``): this router placed ``rid`` (issue #22, router
    replicas). Every router counts the others' sends in its node-load view until the request's
    first token (prefill) and its end (decode), seen on ``req.<rid>.out.<node>`` like its own; sent
    again when the decode node is bound at prefill start and on each re-dispatch."""

    router: str
    rid: str
    prefill_node: str
    decode_node: str | None = None
    prompt_tokens: NonNeg = 0
    """Prompt tokens the prefill node computes or restores (tokens)."""
    max_tokens: NonNeg = 0
    attempt: NonNeg = 0
    first_token: bool = False
    """The owner has seen this attempt's first token (its prefill is done): a decode binding made after it (a
    parked request's prefill node sends that token at the prompt's end, before ``route.bind`` is answered). A
    router that started after that token, so that it was not counting the request when the token went by,
    counts the prefill as done from this (as its owner does), not afresh until the decode node's output."""


class RequestAbort(Msg, frozen=True, kw_only=True):
    """Drop request ``rid`` wherever it is on this node (client went away, node fenced)."""

    rid: str
    reason: str = ""
    attempt: NonNeg = 0
    """Drop attempts <= this one only: a stale abort (sent when an earlier attempt was fenced)
    never kills a newer attempt that was re-dispatched to the same node."""
    router: str = ""
    """Instance id of the router that sends it (the owner of its request, ``PrefillWork.router``): a node drops only
    a request that router owns, so a router that gave way (one ``X-Request-ID`` placed by two routers at once)
    never ends the other router's request of the same id. Empty: an older sender (attempt checked only)."""


class TokenChunk(Msg, frozen=True, kw_only=True):
    """Part of a request's output stream; the last chunk has ``finished``."""

    rid: str
    node: str = ""
    """The publishing node (a router's instance for its own end of a request that ended parked): the subject's
    ``node`` (``req.<rid>.out.<node>``); a chunk naming another is dropped (``shared.validate``)."""
    index: NonNeg = 0
    """Output position of ``token_ids[0]``."""
    token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None
    """``length`` (max_tokens reached), ``stop``, ``abort`` or ``error``."""
    prompt_tokens: NonNeg = 0
    cached_tokens: NonNeg = 0
    """Prompt tokens served from cache (any tier); set on the first chunk."""
    error: str | None = None
    ts: float = 0.0
    queue_s: float | None = None
    """On the first chunk: time the request waited in the prefill node's queue
    (arrival on the node → its first prefill chunk), simulated seconds."""
    fetch_s: float | None = None
    """On the first chunk, when the prefill node fetched prefix KV from peers: fetch
    start → blocks in its L2 (simulated s)."""
    exposed_fetch_s: float | None = None
    """On the first chunk, with a fetch: the part of it that outlasted the queue wait (s)."""
    fetched_tokens: NonNeg = 0
    """On the first chunk: prompt tokens whose KV was fetched from peers' host memory and
    used (restored at the request's start; fetched pages evicted before it are not counted)."""
    attempt: NonNeg = 0
    """The work's ``attempt`` (the router drops chunks of an older attempt)."""
    router: str = ""
    """Instance id of the router that owns the request, as its work named it (``PrefillWork.router``): every
    router hears ``req.<rid>.out.<node>``, and one that never heard the placement (it started after it) tells another
    router's request (``chunks_peer_rid``) from an id nobody placed (``chunks_unknown_rid``). Work the node refuses
    (a rejection, a failed binding or hand-back) is stamped from the work or its owner record too. Empty: an older
    writer, or an abort (``RequestAbort``) of a request the node holds no owner record of."""
    arrived_at: float | None = None
    """On the first chunk: when the work reached this node (simulated s; the control plane's
    share of TTFT is the client's TTFT minus ``ts − arrived_at``, see ``evolving-infra fidelity``)."""
    logprobs: list[float] = []
    """With ``Sampling.logprobs``: natural-log probability of each of ``token_ids`` under the raw
    model distribution (one per token id); empty when not asked (old writers, other requests)."""
    top_ids: list[list[int]] = []
    """With ``Sampling.logprobs`` = k > 0: the k most likely token ids at each position, most
    likely first (one list per token id); empty otherwise."""
    top_logprobs: list[list[float]] = []
    """The log-probabilities of ``top_ids`` (same shape)."""


# --------------------------------------------------------------------------- #
# svc.heartbeat.<service>, svc.stats.<instance>
# --------------------------------------------------------------------------- #


class Heartbeat(Msg, frozen=True, kw_only=True):
    """Liveness of a service process, published every second."""

    service: str
    instance: str
    pid: NonNeg = 0
    ready: bool = True
    wall_ts: float = 0.0
    boot: Boot = ""
    """The process's incarnation (:func:`new_boot`): a service that hears its own instance id beat from a later
    process was replaced while it was frozen, then resumed, and stops (``shared.service``). Empty: not known."""


class NodeDown(Msg, frozen=True, kw_only=True):
    """Launcher → routers (``node.down.<node>``): the process serving ``node`` exited (a crash, ``kill -9``, or the
    supervisor's own liveness kill), seen by its supervisor (``evolving-infra up``) at once. A router fences the node
    now and re-dispatches its requests, without waiting for ``--fence-after-s`` of silence; the node is let back in
    at the state of a process that started after ``exited_ns`` (its restart). Only the launcher's identity may
    publish it (``shared.auth``), and ``node`` must be the subject's token (``shared.validate``): it fences no other
    node."""

    node: str
    pid: NonNeg = 0
    """The process that exited: a router fences the node only when it is the pid of the process it trusts for the
    node (:attr:`NodeState.pid`), and skips only that process's states after; a notice naming another pid (a wrong
    pid, another ``up`` on the same NATS, a notice that came after the restart) fences nothing. 0: not known."""
    exited_ns: NonNeg = 0
    """Wall-clock ns (``time.time_ns()``) at which the supervisor saw the exit. Used only when a pid is not known
    (this notice's or the node's state's: an older sender): a node state whose ``boot`` started before it is then
    taken for that process's (or an older one's), one that started after it for its restart. A router drops a
    notice whose ``exited_ns`` is more than a few seconds past its own wall clock (``node_down.future``)."""
    code: int = 0
    """Its exit status as ``Popen.returncode`` gives it (negative: killed by that signal)."""


class StatsRequest(Msg, frozen=True, kw_only=True):
    """Ask an instance for its counters (reply: StatsReply)."""


class StatsReply(Msg, frozen=True, kw_only=True):
    service: str
    instance: str
    counters: dict[str, int] = {}
    gauges: dict[str, float] = {}


# --------------------------------------------------------------------------- #
# planner.models  (planner → router)
# --------------------------------------------------------------------------- #


class NodeModels(Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """Iteration-time models of one node as the planner fitted them (paper §5.1).

    A field left unset (None / 0) means "not fitted yet": the consumer keeps
    what it had (the profile's coefficients at first).
    """

    node: str
    prefill: PrefillModel | None = None
    """Eq. 1 coefficients c0..c3 (s, s/token, s/pair, s/token)."""
    decode: DecodeModel | None = None
    """Eq. 2 coefficients and MoE/MTP shape."""
    mean_chunk_tokens: NonNegF = 0.0
    """t̄_n: mean uncached tokens per prefill iteration (0 = not measured)."""
    restored_share: NonNegF = 0.0
    """f_n: share of cached tokens restored from host memory."""
    samples: NonNeg = 0
    """Iteration records the fit used."""
    source: Literal["profile", "fitted", "peer"] = "fitted"
    """``fitted``: NNLS on this node's warm-up records; ``peer``: median of the
    fitted nodes (this node had too few records); ``profile``: the hardware profile."""
    fit_error: NonNegF = 0.0
    """Mean relative error of the model on the records it was fitted on (0 = not fitted)."""


class PlannerModels(Msg, frozen=True, kw_only=True):
    """Fitted iteration-time models per node; published by the planner after each
    fit or remeasurement of t̄_n / f_n (Alg. E.3 l.1, l.15)."""

    models: list[NodeModels] = []
    fitted_at: float = 0.0
    frozen: bool = False
    """True once the warm-up fit is frozen (afterwards only t̄_n and f_n change)."""


ENCODER = msgspec.msgpack.Encoder()
"""The one msgpack encoder every publisher uses."""


def encode(msg: Struct) -> bytes:
    """Encode a message to msgpack bytes."""
    return ENCODER.encode(msg)
