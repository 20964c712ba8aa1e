"""KvDirectory: the sans-IO core of the cluster-wide KV directory (paper §4.3, DESIGN §4).

This module contains zero I/O: no asyncio, no NATS, no clock, no logging
setup. Every mutating call takes ``now`` (simulated seconds); the shell
(``service.py``) decodes messages, calls the core, publishes what
:meth:`KvDirectory.take_count_updates` returns and logs what the results say.

Pieces (one module each):

* :mod:`.index` — which node holds which block in which tier (prefix tree
  keyed by chained hash, with completeness masks for fast lookups);
* :mod:`.branches` — branch table and counts R[b, n] (Alg. E.1, E.2), outbox;
* :mod:`.lookup` — lookup answers and the router's Eq. 7 fetch plan;
* :mod:`.reuse` — lost KV reuse attribution (Appendix C.1).

Per-node KV event streams (this module): batches must arrive with
``seq = last + 1``. A gap (or a publisher restart, ``seq`` back to 1) puts the
node in *awaiting resync*: its view is frozen as it was before the gap, later
batches are buffered (at most ``resync_buffer_batches``; oldest dropped first,
counted), and the shell asks the worker for a snapshot. If the missing
batches arrive late (reordering), the buffer drains in order and the node
recovers without a snapshot. A snapshot replaces the node's presence wholesale
and the buffered batches after its ``seq`` are applied on top. Other nodes,
and the rest of the tree, are never touched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from shared.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BranchEnd,
    BranchStart,
    BranchToolCall,
    CountUpdates,
    KvEvent,
    KvEventBatch,
    KvResyncRequest,
    KvSnapshot,
    RoutePlaced,
)
from shared.values import FACTORY, StructValue, Value

from .branches import Branch, BranchTable
from .index import GPU, HOST, TIER_INDEX, TIERS, BlockIndex, tier_bit
from .lookup import LookupResult, build_lookup
from .reuse import Cause, ReuseRecord, attribute_lost_reuse, lost_reuse_shares

ApplyStatus = Literal["applied", "stale", "gap", "buffered", "recovered", "resynced", "rejected"]


class ApplyResult(Value):
    """What happened to one KV batch or snapshot.

    ``need_resync``: the node awaits a snapshot; the shell should make sure a
    ``kv.resync.<node>`` request is in flight (one per node is enough).
    """

    status: ApplyStatus
    node: str
    seq: int
    expected_seq: int
    """Next sequence number the directory expects from the node after this call."""
    need_resync: bool
    blocks_stored: int
    blocks_removed: int
    mismatched_block_sizes: list[int]
    """block_size of every rejected ``BlockStored`` (or snapshot) in the batch."""
    detail: str
    """Why, in words, where the status alone misleads: a ``gap`` that is a restarted node (its sequence back
    at 1) or a first contact past seq 1; "" otherwise."""

    __slots__ = __match_args__ = (
        "status", "node", "seq", "expected_seq", "need_resync", "blocks_stored", "blocks_removed",
        "mismatched_block_sizes", "detail",
    )

    def __init__(
        self, status: ApplyStatus, node: str, seq: int, expected_seq: int, need_resync: bool = False,
        blocks_stored: int = 0, blocks_removed: int = 0, mismatched_block_sizes: Any = FACTORY, detail: str = "",
    ) -> None:
        self.status = status
        self.node = node
        self.seq = seq
        self.expected_seq = expected_seq
        self.need_resync = need_resync
        self.blocks_stored = blocks_stored
        self.blocks_removed = blocks_removed
        self.mismatched_block_sizes = [] if mismatched_block_sizes is FACTORY else mismatched_block_sizes
        self.detail = detail


class PlaceResult(StructValue):
    """What a ``RoutePlaced`` did."""

    branch_id: str
    node: str
    version: int = 0
    bumped: bool = False
    """The path did not extend the previous one: context rewritten (Alg. E.1)."""
    rejected: str | None = None
    released_nodes: list[str] = msgspec.field(default_factory=list)
    """Same-phase sources released right away (target already held v_β)."""
    reuse: ReuseRecord | None = None
    """Lost-reuse record (prefill placements only)."""


class _Stream(Value):
    known: bool
    next_seq: int
    awaiting: bool
    needs_snapshot: bool
    """Only a snapshot can end the wait (first contact, restart, buffer overflow)."""
    buffer: dict[int, KvEventBatch]
    last_ts: float
    """``ts`` of the last applied batch (tells a restart from a late duplicate)."""

    __slots__ = __match_args__ = ("known", "next_seq", "awaiting", "needs_snapshot", "buffer", "last_ts")

    def __init__(
        self, known: bool = False, next_seq: int = 1, awaiting: bool = False, needs_snapshot: bool = False,
        buffer: Any = FACTORY, last_ts: float = 0.0,
    ) -> None:
        self.known = known
        self.next_seq = next_seq
        self.awaiting = awaiting
        self.needs_snapshot = needs_snapshot
        self.buffer = {} if buffer is FACTORY else buffer
        self.last_ts = last_ts


_EVICT_KEYS = {
    (t, pos): f"evictions.{TIERS[t]}.{'positive_count' if pos else 'zero_count'}" for t in (GPU, HOST) for pos in (0, 1)
}
_HOST_ZERO, _HOST_POS = _EVICT_KEYS[HOST, 0], _EVICT_KEYS[HOST, 1]
_EVICT_PAIRS = {t: (_EVICT_KEYS[t, 0], _EVICT_KEYS[t, 1]) for t in (GPU, HOST)}
"""Tier → its ``(zero_count, positive_count)`` eviction counter names (no key tuple per event)."""
_NO_HOST_EVICTIONS = (0, 0)


def _writes_through(ev: BlockStored, nxt: object, block_size: int) -> bool:
    """``nxt`` stores the blocks of GPU store ``ev`` on the host tier (the engine's write-through)."""
    return (
        type(nxt) is BlockStored
        and nxt.tier == "host"
        and nxt.block_size == block_size
        and nxt.parent_block_hash == ev.parent_block_hash
        and (nxt.block_hashes is ev.block_hashes or nxt.block_hashes == ev.block_hashes)
    )


class KvDirectory:
    """Cluster-wide KV directory: block presence, branch counts, lookups.

    Args:
        block_size: tokens per block; a ``BlockStored``, snapshot or lookup with
            another size is rejected and counted (never applied).
        max_blocks: cap on indexed blocks (``cap.rejected_blocks`` counts blocks refused).
        branch_ttl_s: a branch silent this long (simulated s) is expired.
        resync_buffer_batches: batches buffered per node while it awaits a resync.
        reuse_hit_scope: ``cluster`` (shared pool: hit = longest prefix anywhere)
            or ``local`` (hit = the node's own prefix) for lost-reuse accounting.
        max_updates_per_msg: largest ``CountUpdates`` message.
        max_tool_hold_s: longest "tool call outstanding" hold (``BranchToolCall``), simulated s.
        keep_counted_copies: keep the ``copies.<tier>.positive_count`` gauges up to date on every
            change (the live service, whose gauges are read often) instead of counting them when
            read, O(counted blocks) (the default: no decision reads them; see
            ``BranchTable.counted_copies``).
        held_counts_only: leave out of ``kv.counts`` the changed counts of blocks the node holds
            in neither tier (``BranchTable.take_count_updates``: exact for a caller that applies
            a node's KV events before it drains, as the simulator does); False (the default):
            every changed count is sent.
        chained: paths and stores agree as chains (``BranchTable``'s ``chained``: the presence
            hooks bisect a chain for its counted blocks instead of probing each); False (the
            default): every block is probed.

    Raises:
        ValueError: on a non-positive ``block_size`` or an unknown scope.
    """

    def __init__(
        self,
        block_size: int,
        *,
        max_blocks: int = 16_000_000,
        branch_ttl_s: float = 1800.0,
        resync_buffer_batches: int = 4096,
        reuse_hit_scope: Literal["cluster", "local"] = "cluster",
        max_updates_per_msg: int = 4096,
        max_tool_hold_s: float = 14400.0,
        keep_counted_copies: bool = False,
        held_counts_only: bool = False,
        chained: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if reuse_hit_scope not in ("cluster", "local"):
            raise ValueError(f"reuse_hit_scope must be 'cluster' or 'local', got {reuse_hit_scope!r}")
        self.block_size = block_size
        self.resync_buffer_batches = resync_buffer_batches
        self.reuse_hit_scope = reuse_hit_scope
        self.counters: Counter[str] = Counter()
        self.index = BlockIndex(max_blocks)
        self.branches = BranchTable(
            self.index,
            self.counters,
            ttl_s=branch_ttl_s,
            max_updates_per_msg=max_updates_per_msg,
            max_hold_s=max_tool_hold_s,
            keep_counted_copies=keep_counted_copies,
            held_counts_only=held_counts_only,
            chained=chained,
        )
        self.names: list[str] = []
        """Node id of each slot (dense index, from 0); a forgotten node keeps its slot, and its
        name, until another node takes the slot over."""
        self._ids: dict[str, int] = {}
        self._streams: list[_Stream] = []
        self._free: dict[int, None] = {}
        """Slots of forgotten nodes (:meth:`forget_node`), oldest first: the next new node id takes
        the oldest over (:meth:`node_id`), so a deployment whose node ids change on every restart
        keeps as many slots as nodes it has at once, not one per id it ever saw."""
        self._gen: list[int] = []
        """Per slot: :attr:`reclaims` when its node id was registered (:meth:`node_generation`)."""
        self.reclaims = 0
        """Slots taken over from a forgotten node so far."""
        self._reclaimed: list[str] = []
        """Node ids whose slot was taken over since the last :meth:`take_reclaimed`."""

    # ------------------------------------------------------------------ #
    # nodes
    # ------------------------------------------------------------------ #

    def node_id(self, name: str) -> int:
        """Dense index (slot) of a node id, registered on first use: in the slot of the node
        forgotten longest ago when there is one (:meth:`_take_over`), else in a new one. A
        forgotten node named here (its KV events, a snapshot, a resync) is live again, in its own
        slot, if no other node took it over. O(1), plus O(branches) to take a slot over."""
        i = self._ids.get(name)
        if i is None:
            return self._register(name)
        if self._free and i in self._free:
            del self._free[i]
            self.counters["nodes.revived"] += 1
        return i

    def _slot(self, name: str) -> int:
        """:meth:`node_id` for a placement or a phase change: another process's word that the
        node serves, not the node's own, so a forgotten node stays forgotten (its slot free;
        whatever is counted there is released when another node takes it over). O(1)."""
        i = self._ids.get(name)
        return self._register(name) if i is None else i

    def _register(self, name: str) -> int:
        if self._free:
            i = next(iter(self._free))
            del self._free[i]
            self._take_over(i, name)
            return i
        i = self._ids[name] = len(self.names)
        self.names.append(name)
        self._streams.append(_Stream())
        self._gen.append(self.reclaims)
        self.index.ensure_node(i)
        self.branches.add_node(name)
        return i

    def _take_over(self, i: int, name: str) -> None:
        """Give slot ``i`` of a forgotten node to node id ``name``, with nothing of the old one:
        no block in the index (dropped when it was forgotten; dropped again here if a copy came
        back since, which only a bug would do), no branch count, pending move, watch, outbox,
        message number or phase (``BranchTable.reset_node``), a fresh KV stream. The old id is
        unknown from then on (its return is a new node: a fresh slot, counts from empty, first
        contact). Counted ``nodes.reclaimed``; the old id is listed by :meth:`take_reclaimed`.
        O(branches) + O(blocks counted there), C-level mostly."""
        old = self.names[i]
        if self.index.copies[i] != [0, 0]:
            self._clear(i, None)
        del self._ids[old]
        self._ids[name] = i
        self.names[i] = name
        self._streams[i] = _Stream()
        self.reclaims += 1
        self._gen[i] = self.reclaims
        self.branches.reset_node(i, name)
        self.counters["nodes.reclaimed"] += 1
        self._reclaimed.append(old)

    def take_reclaimed(self) -> list[str]:
        """Node ids whose slot another node took over since the last call (forgotten for good:
        the shell drops what it keeps per node), oldest first."""
        out, self._reclaimed = self._reclaimed, []
        return out

    def node_generation(self, node: str) -> int:
        """How many slots had been taken over (:attr:`reclaims`) when ``node`` was registered; 0
        for an unknown node and for every node while no slot was ever taken over (the simulator,
        which forgets none). A node id forgotten, taken over and heard again is registered anew
        with a higher number than before: the shell's count epoch of the node includes it, so the
        worker resets counts that the directory no longer has. O(1)."""
        i = self._ids.get(node)
        return 0 if i is None else self._gen[i]

    def has_node(self, node: str) -> bool:
        """True once ``node`` has an id (KV events, a snapshot or a placement named it), until
        another node takes over its slot after it was forgotten."""
        return node in self._ids

    def is_live(self, node: str) -> bool:
        """``node`` has a slot and is not forgotten (:meth:`forget_node`)."""
        i = self._ids.get(node)
        return i is not None and i not in self._free

    def is_forgotten(self, node: str) -> bool:
        """``node`` was forgotten and still holds its slot (no other node took it over)."""
        i = self._ids.get(node)
        return i is not None and i in self._free

    def live_nodes(self) -> int:
        """Nodes with a slot that are not forgotten (what ``--max-nodes`` limits). O(1)."""
        return len(self.names) - len(self._free)

    def awaiting_resync(self, node: str) -> bool:
        """True while ``node``'s KV view waits for a snapshot or a missing batch."""
        i = self._ids.get(node)
        return i is not None and self._streams[i].awaiting

    def request_resync(self, node: str) -> bool:
        """Ask for a snapshot of ``node`` outside a sequence gap (its view went stale, issue #22):
        the node awaits a snapshot (later batches are buffered until it arrives); a node never
        heard of on ``kv.events`` is registered. Returns False when it already awaits a resync. O(1)."""
        st = self._streams[self.node_id(node)]
        if st.awaiting:
            return False
        st.awaiting = True
        st.needs_snapshot = True
        self.counters["kv.stale_resyncs"] += 1
        return True

    def kv_unheard(self, node: str) -> bool:
        """True while this directory has no view of ``node``'s KV and is not getting one: no
        ``kv.events`` batch of it was heard and no snapshot of it applied (a node never
        registered, or registered by a placement only), and it awaits no resync. A forgotten
        node is not unheard: it awaits a snapshot already. Pure query, O(1)."""
        i = self._ids.get(node)
        if i is None:
            return True
        st = self._streams[i]
        return not st.known and not st.awaiting

    def resync_unheard(self, node: str) -> bool:
        """Make a node whose KV this directory never heard (:meth:`kv_unheard`) await a snapshot:
        a directory restarted while the node was idle learns of it from its ``node.state`` only,
        and an idle node sends no ``kv.events`` batch, so the first-contact gap that asks the
        others for a snapshot never comes and its blocks were never indexed (a SIGKILLed
        directory's index missed a whole idle prefill node, 14,746 blocks in each tier, in CI).
        The node is registered (:meth:`node_id`) and awaits as after a first contact: a batch 1
        (a worker that restarted meanwhile) recovers it, any later batch is buffered until the
        snapshot. Counted ``kv.unheard_resyncs``.

        Returns:
            True when the shell should ask ``kv.resync.<node>``; False (nothing changed) when
            the node's KV was heard, or it awaits a resync already.
        """
        if not self.kv_unheard(node):
            return False
        self._streams[self.node_id(node)].awaiting = True
        self.counters["kv.unheard_resyncs"] += 1
        return True

    def forget_node(self, node: str) -> int:
        """Forget the KV of a node that went silent (the shell's ``--forget-node-after-s``: a
        worker SIGKILLed and never restarted sends no ``AllBlocksCleared``): its index entries are
        dropped exactly as an ``AllBlocksCleared`` of every tier from it drops them (branch counts
        R[·, node] are kept, as after that event: they belong to the branches, which release them
        when they end or expire), and its stream awaits a snapshot with its buffer emptied, so a
        node heard again is resynced, never half-indexed: its later batches are buffered (a
        restarted one's ``seq`` 1 too) until a ``KvSnapshot`` replaces its presence. Its slot is
        free from then on: the next new node id takes it over (:meth:`node_id`), and the node's
        counts with it, unless the node is heard first (its KV events, a snapshot or a resync
        name it: :meth:`node_id`). Counted ``nodes.forgotten`` and ``nodes.forgotten_copies``.
        Returns the copies dropped (0 for a node never named or already forgotten). O(blocks of
        the node) C-level, like ``AllBlocksCleared``."""
        n = self._ids.get(node)
        if n is None or n in self._free:
            return 0
        self._free[n] = None
        dropped = self._clear(n, None)
        st = self._streams[n]
        st.awaiting = st.needs_snapshot = True
        st.buffer.clear()
        self.counters["nodes.forgotten"] += 1
        self.counters["nodes.forgotten_copies"] += dropped
        return dropped

    def resync_request(self, node: str, reason: str = "sequence gap") -> KvResyncRequest:
        """The ``kv.resync.<node>`` request to send for a node awaiting resync."""
        st = self._streams[self.node_id(node)]
        return KvResyncRequest(node=node, reason=reason, expected_seq=st.next_seq)

    # ------------------------------------------------------------------ #
    # KV events
    # ------------------------------------------------------------------ #

    def apply_kv_batch(self, batch: KvEventBatch, now: float) -> ApplyResult:
        """Ingest one ``kv.events.<node>`` batch (see the module docstring for ordering)."""
        n = self.node_id(batch.node)
        st = self._streams[n]
        seq = batch.seq
        res = ApplyResult(status="applied", node=batch.node, seq=seq, expected_seq=st.next_seq)
        if not st.known:
            st.known = True
            if seq != 1:  # joined late, or batch 1 is late: buffer, wait for 1.. or a snapshot
                self.counters["kv.gaps.first_contact"] += 1
                st.awaiting = True
                res.detail = f"first batch heard is seq {seq} (the node started before this directory, or its batch 1 is late)"
                return self._buffer(st, batch, res, "gap")
        if seq == 1 and st.next_seq > 1 and (batch.ts > st.last_ts or batch.ts == 0.0):
            # publisher restarted (a late duplicate of batch 1 has an older ts): old state void
            self.counters["kv.seq_restarts"] += 1
            res.detail = f"node restarted: its sequence went back to 1 after {st.next_seq - 1}; what it held before is void"
            st.awaiting = st.needs_snapshot = True
            st.next_seq = 1
            st.buffer.clear()
            return self._buffer(st, batch, res, "gap")
        if seq < st.next_seq:
            self.counters["kv.batches_stale"] += 1
            res.status = "stale"
            res.need_resync = st.awaiting
            return res
        if st.awaiting:
            if seq == st.next_seq and not st.needs_snapshot:
                self._apply_events(n, batch, res)
                st.next_seq += 1
                self._drain(n, st, res)
                if not st.buffer:
                    st.awaiting = False
                    self.counters["kv.recovered_without_resync"] += 1
                    res.status = "recovered"
                else:
                    res.status = "buffered"
                    res.need_resync = True
                res.expected_seq = st.next_seq
                return res
            return self._buffer(st, batch, res, "buffered")
        if seq > st.next_seq:
            self.counters["kv.gaps"] += 1
            st.awaiting = True
            return self._buffer(st, batch, res, "gap")
        self._apply_events(n, batch, res)
        st.next_seq += 1
        res.expected_seq = st.next_seq
        return res

    def apply_kv_events(self, n: int, seq: int, ts: float, events: list[KvEvent]) -> tuple[int, int]:
        """What ``apply_kv_batch(KvEventBatch(node=…, seq=seq, ts=ts, events=events), ts)`` does
        to the directory, for an in-process caller that holds node n's id (:meth:`node_id`)
        and reads no :class:`ApplyResult` (the simulator, ``ClusterSim._flush_kv``): the batch next
        in n's sequence is applied by the same code (:meth:`_apply`), with no batch or
        :class:`ApplyResult` built; any other batch (n's first, a gap, a restart, n awaiting a
        resync) goes through :meth:`apply_kv_batch` itself. Same index, counts, outbox, counters
        and stream state either way (``tests/unit/kvdirectory/test_held_counts.py``).

        Returns:
            ``(zero, positive)``: the host-tier blocks this call evicted (removed from n's host
            tier) with a zero / positive branch count on n, what it added to the counters
            ``evictions.host.zero_count`` / ``evictions.host.positive_count`` (the simulator
            splits them by the evicting node's phase; read here, not as two counter reads
            before and two after every batch).

        Raises:
            IndexError: for a node id never registered.
        """
        st = self._streams[n]
        if seq != st.next_seq or st.awaiting or not st.known:
            c = self.counters
            z, p = c.get(_HOST_ZERO, 0), c.get(_HOST_POS, 0)
            self.apply_kv_batch(KvEventBatch(node=self.names[n], seq=seq, ts=ts, events=events), ts)
            return c.get(_HOST_ZERO, 0) - z, c.get(_HOST_POS, 0) - p
        host = self._apply(n, events, ts, [])[2]
        st.next_seq += 1
        return host

    def _buffer(self, st: _Stream, batch: KvEventBatch, res: ApplyResult, status: ApplyStatus) -> ApplyResult:
        st.buffer[batch.seq] = batch
        if batch.ts > st.last_ts:
            # received, if not applied: a later snapshot covers it, and a late duplicate of an
            # older batch 1 (ts ≤ this one's) must read as stale, not as a publisher restart
            st.last_ts = batch.ts
        self.counters["kv.batches_buffered"] += 1
        while len(st.buffer) > self.resync_buffer_batches:
            del st.buffer[min(st.buffer)]
            st.needs_snapshot = True  # what was dropped can only come back in a snapshot
            self.counters["kv.buffer_overflow_batches"] += 1
        res.status = status
        res.need_resync = True
        res.expected_seq = st.next_seq
        return res

    def _drain(self, n: int, st: _Stream, res: ApplyResult) -> None:
        """Apply buffered batches that are next in sequence; forget older ones."""
        buf = st.buffer
        for s in [s for s in buf if s < st.next_seq]:
            del buf[s]
        while st.next_seq in buf:
            self._apply_events(n, buf.pop(st.next_seq), res)
            st.next_seq += 1

    def _apply_events(self, n: int, batch: KvEventBatch, res: ApplyResult) -> None:
        """Apply ``batch``, the next of node n's sequence; its blocks (and block sizes refused) are
        added to ``res``."""
        stored, removed, _ = self._apply(n, batch.events, batch.ts, res.mismatched_block_sizes)
        res.blocks_stored += stored
        res.blocks_removed += removed

    def _apply(self, n: int, events: Sequence[Any], ts: float, mismatched: list[int]) -> tuple[int, int, tuple[int, int]]:
        """Apply ``events`` of node n (a batch stamped ``ts``, next in its sequence): index,
        presence hooks, counters; the block size of every ``BlockStored`` refused is appended to
        ``mismatched``. Returns (blocks stored, blocks removed) as :class:`ApplyResult` counts them,
        and the host-tier evictions' ``(zero, positive)`` count tallies (:meth:`apply_kv_events`)."""
        index, table, counters = self.index, self.branches, self.counters
        chained = table.chained
        counters["kv.batches_applied"] += 1
        st = self._streams[n]
        if ts > st.last_ts:
            st.last_ts = ts
        stored = removed_blocks = 0
        host = _NO_HOST_EVICTIONS
        last = len(events) - 1
        done = -1  # events up to this one were applied with an earlier one (a write-through pair or triple)
        for i, ev in enumerate(events):
            if i <= done:
                continue
            t = type(ev)
            if t is BlockStored:
                if ev.block_size != self.block_size:  # Dynamo #13904: never silently
                    counters["kv.block_size_mismatch"] += 1
                    counters["kv.block_size_mismatch_blocks"] += len(ev.block_hashes)
                    mismatched.append(ev.block_size)
                    continue
                tier = TIER_INDEX[ev.tier]
                if tier == GPU and i < last:
                    nxt = events[i + 1]
                    if (  # _writes_through(ev, nxt, block_size), inline (~9,700 calls a 600-s run at 512)
                        type(nxt) is BlockStored
                        and nxt.tier == "host"
                        and nxt.block_size == ev.block_size  # (ev's is the directory's: checked above)
                        and nxt.parent_block_hash == ev.parent_block_hash
                        and (nxt.block_hashes is ev.block_hashes or nxt.block_hashes == ev.block_hashes)
                    ):
                        newly = index.store_written_through(n, ev.block_hashes, ev.parent_block_hash)
                        if newly is not None:  # both events applied: same effects as one after the other
                            done = i + 1
                            table.on_stored_through(n, newly)
                            stored += 2 * len(newly)
                            continue
                    elif (
                        i + 1 < last
                        and type(nxt) is BlockRemoved
                        and nxt.tier == "host"
                        and _writes_through(ev, events[i + 2], self.block_size)
                        and self._through_first(n, ev.block_hashes, ev.parent_block_hash, nxt.block_hashes)
                    ):
                        # the host eviction that makes room for the write-through, between the two
                        # stores: the stores as one, then the eviction (same effects, _through_first)
                        newly = index.store_written_through(n, ev.block_hashes, ev.parent_block_hash)
                        if newly is not None:  # (always, as _through_first checked)
                            done = i + 2
                            table.on_stored_through(n, newly)
                            stored += 2 * len(newly)
                            removed_blocks += len(nxt.block_hashes)
                            z, p = self._apply_removed(n, nxt)
                            host = (host[0] + z, host[1] + p)  # (a host eviction)
                            continue
                newly = index.store(n, tier, ev.block_hashes, ev.parent_block_hash)
                table.on_stored(n, tier, newly)
                stored += len(ev.block_hashes)
            elif t is BlockRemoved:
                removed_blocks += len(ev.block_hashes)
                # self._apply_removed(n, ev) without its frame (one per eviction batch: ~6,100 a 600-s run at 512)
                tier = TIER_INDEX[ev.tier]
                if chained:
                    spans: list[tuple[int, int, bool]] = []
                    removed = index.remove(n, tier, ev.block_hashes, spans)
                    p = table.on_removed(n, tier, removed, spans)
                else:
                    removed = index.remove(n, tier, ev.block_hashes)
                    p = table.on_removed(n, tier, removed)
                zk, pk = _EVICT_PAIRS[tier]
                counters[pk] += p
                z = len(removed) - p
                counters[zk] += z
                if z or p:
                    if tier == HOST:
                        host = (host[0] + z, host[1] + p)
            elif t is AllBlocksCleared:
                counters["kv.cleared_blocks"] += self._clear(n, None if ev.tier is None else TIER_INDEX[ev.tier])
                counters["kv.clears"] += 1
        if stored:  # the batch's sums, added once (the per-event sums they replace: same counters)
            counters["kv.blocks_stored"] += stored
        if removed_blocks:
            counters["kv.blocks_removed"] += removed_blocks
        return stored, removed_blocks, host

    def _apply_removed(self, n: int, ev: BlockRemoved) -> tuple[int, int]:
        """Apply node n's ``BlockRemoved`` ``ev``: index, presence hook, ``evictions.<tier>.*``
        counters (:meth:`_apply` adds the batch's ``kv.blocks_removed`` once). Returns the blocks
        it removed with a zero and with a positive branch count on n (``evictions.<tier>.*``)."""
        index, table, counters = self.index, self.branches, self.counters
        tier = TIER_INDEX[ev.tier]
        if table.chained:
            spans: list[tuple[int, int, bool]] = []
            removed = index.remove(n, tier, ev.block_hashes, spans)
            pos = table.on_removed(n, tier, removed, spans)
        else:
            removed = index.remove(n, tier, ev.block_hashes)
            pos = table.on_removed(n, tier, removed)
        zk, pk = _EVICT_PAIRS[tier]
        counters[pk] += pos
        z = len(removed) - pos
        counters[zk] += z
        return z, pos

    def _through_first(self, n: int, hashes: list[int], parent: int | None, evicted: list[int]) -> bool:
        """Whether node n's GPU store of ``hashes`` (below ``parent``), a host eviction of
        ``evicted`` and the store's write-through (``GPU store, host removal, host store``: the
        engine evicts from its L2 to make room for the write-through) may be applied as the two
        stores as one (``BlockIndex.store_written_through``, which then cannot refuse them), then
        the eviction: same index, counts, outbox and counters as the three in order, when

        * ``hashes`` is a brand-new chain (none indexed, none repeated) and the index has room for
          it, as the pair needs;
        * the eviction lists none of ``hashes`` (in order it finds them on the GPU alone: unknown
          to the host tier, skipped and counted so; after the write-through it would remove them);
        * ``parent`` is None or held in n's GPU: the host eviction cannot leave it held nowhere
          (in order the write-through would then find it so, ``stored.without_parent``), so the
          chain hangs below a held block during the eviction either way.

        The index's ``where`` table gets the same insertions then deletions as in order (the
        chain's blocks, then what the eviction drops), so it is resized at the same points and
        ends the same size (``BlockIndex.size_bytes``, the simulator's ``kv_directory_size``);
        the eviction applied first would resize it with fewer live blocks. The presence hooks
        commute: the eviction's reads R[n] only, which the stores' hooks leave alone (a move they
        finish releases nodes other than n); both tiers of one brand-new chain are what
        ``BranchTable.on_stored_through`` applies. The index keeps runs maximal, so the same
        blocks and presence make the same runs whatever the order. O(len(hashes) + len(evicted))
        C-level."""
        where = self.index.where
        k = len(hashes)
        if not k or self.index.max_blocks - len(where) <= k or not where.keys().isdisjoint(hashes):
            return False
        if parent is not None:
            pr = where.get(parent)
            if pr is None or not pr.pc & tier_bit(n, GPU):
                return False
        chain = set(hashes)
        return len(chain) == k and chain.isdisjoint(evicted)

    def _clear(self, n: int, tier: int | None) -> int:
        """Drop every copy node ``n`` holds in ``tier`` (None: both) from the index, each through the
        branch table's presence hook (``AllBlocksCleared``, and a forgotten node). Returns the copies
        dropped. O(blocks of the node) C-level."""
        dropped = 0
        for t, removed in self.index.clear(n, tier):
            self.branches.on_removed(n, t, removed)
            dropped += len(removed)
        return dropped

    def apply_snapshot(self, snap: KvSnapshot, now: float) -> ApplyResult:
        """Replace a node's presence with a ``KvSnapshot`` and continue from ``snap.seq + 1``.

        Accepted when it is at least as recent as the directory's view
        (``seq ≥ expected − 1``), or whenever only a snapshot can repair the
        node (first contact, publisher restart, buffer overflow); otherwise
        ignored (status ``stale``). A block-size mismatch is rejected and counted.
        """
        n = self.node_id(snap.node)
        st = self._streams[n]
        res = ApplyResult(status="resynced", node=snap.node, seq=snap.seq, expected_seq=st.next_seq)
        if snap.block_size != self.block_size:
            self.counters["kv.snapshot_block_size_mismatch"] += 1
            res.status = "rejected"
            res.mismatched_block_sizes.append(snap.block_size)
            res.need_resync = st.awaiting
            return res
        if st.known and not st.needs_snapshot and snap.seq < st.next_seq - 1:
            self.counters["kv.snapshots_stale"] += 1  # older than the view we already have
            res.status = "stale"
            res.need_resync = st.awaiting
            return res
        for tier, hashes, parents in ((GPU, snap.gpu, snap.gpu_parents), (HOST, snap.host, snap.host_parents)):
            pmap = dict(zip(hashes, parents)) if len(parents) == len(hashes) else None
            added, removed = self.index.replace(n, tier, hashes, pmap)
            self.branches.on_removed(n, tier, removed)
            self.branches.on_stored(n, tier, added)
            res.blocks_stored += len(added)
            res.blocks_removed += len(removed)
            self.counters["kv.resync_added_blocks"] += len(added)
            self.counters["kv.resync_removed_blocks"] += len(removed)
        self.counters["kv.resyncs"] += 1
        st.known = True
        st.next_seq = snap.seq + 1
        st.needs_snapshot = False
        # the node had published up to snap.seq when it took the snapshot: a buffered batch
        # further ahead than a full buffer of later batches was never published by it
        # (a forged sequence jump); keeping it would keep the node awaiting a resync forever
        beyond = [s for s in st.buffer if s > snap.seq + self.resync_buffer_batches]
        for s in beyond:
            del st.buffer[s]
        self.counters["kv.batches_beyond_snapshot"] += len(beyond)
        self._drain(n, st, res)
        st.awaiting = bool(st.buffer)
        res.need_resync = st.awaiting
        res.expected_seq = st.next_seq
        return res

    # ------------------------------------------------------------------ #
    # lookups (pure)
    # ------------------------------------------------------------------ #

    def lookup(self, block_hashes: Sequence[int]) -> LookupResult:
        """Longest prefixes of a block path per node and tier, cluster-wide, and
        the fetch plan (see :mod:`.lookup`). Pure query."""
        return build_lookup(self.index, self.names, block_hashes)

    # ------------------------------------------------------------------ #
    # branches (Alg. E.1 / E.2)
    # ------------------------------------------------------------------ #

    def branch_start(
        self, branch_id: str, now: float, *, kind: str = "main", parent: str | None = None, agent: str | None = None
    ) -> str:
        """A new branch (v = 1, empty path). Returns the table's verdict (see ``BranchTable.start``)."""
        return self.branches.start(branch_id, kind, parent, agent, now)

    def branch_hold(self, branch_id: str, outstanding: bool, expected_s: float, now: float) -> str:
        """A "tool call outstanding" hint (``BranchToolCall``): the branch and its counts stay
        active until ``now + expected_s`` or its next placement (see ``BranchTable.hold``).
        Returns ``held``/``released``/``ended``/``unknown``."""
        return self.branches.hold(branch_id, outstanding, expected_s, now)

    def branch_end(self, branch_id: str, now: float) -> str:
        """End a branch: release its counts everywhere. Returns ``ended``/``duplicate_end``/``unknown``."""
        return self.branches.end(branch_id, now)

    def branch_state(self, branch_id: str, now: float) -> str:
        """The branch's state for ``branch.query`` (a router that never saw it ends it or holds it):
        ``active``/``expired``/``ended``/``unknown`` (see ``BranchTable.state``). Pure query."""
        return self.branches.state(branch_id, now)

    def branch_evict(self, branch_id: str, rid: str | None = None) -> str:
        """A router evicted the branch from its capped table: expire it now, as the TTL does (counts
        released everywhere, resumable), unless ``rid`` (``BranchEnd.rid``, the router's latest
        placed request) is not the branch's latest placement here (another router serves it).
        Takes no time (nothing in it reads one).
        Returns ``evicted``/``stale``/``ended``/``unknown`` (see ``BranchTable.evict``)."""
        return self.branches.evict(branch_id, rid)

    def place(
        self,
        branch_id: str,
        node: str,
        phase: str,
        block_hashes: Sequence[int],
        now: float,
        *,
        lookup: LookupResult | None = None,
        rid: str | None = None,
    ) -> PlaceResult:
        """Branch placed on a node for a phase with this block path (``RoutePlaced``).

        Args:
            rid: ``RoutePlaced.rid``, remembered as the branch's latest placement (a router's
                eviction naming another is ignored: ``branch_evict``); None (the simulator) keeps
                the one remembered.
            lookup: :meth:`lookup` of ``block_hashes`` made with no KV event or snapshot
                applied since (a caller that has just looked the path up to route it, as the
                simulator does); a prefill placement's lost-reuse record reads it instead of
                looking the path up again. None (the service): looked up here. Same result
                either way (a lookup reads only block presence).
        """
        n = self._slot(node)
        path = list(block_hashes)
        out = self.branches.place(branch_id, n, phase, path, now, rid)
        res = PlaceResult(branch_id=branch_id, node=node, version=out.version, bumped=out.bumped, rejected=out.rejected)
        if out.rejected:
            return res
        res.released_nodes = [self.names[m] for m in out.released_nodes]
        if phase in ("prefill", "both") and path:
            res.reuse = ReuseRecord(*self._reuse(n, path, out.history_blocks, out.prev_prefill_node, lookup))
        return res

    def place_unread(
        self, branch_id: str, node: str, phase: str, block_hashes: Sequence[int], now: float, lookup: LookupResult | None = None
    ) -> None:
        """:meth:`place` (``rid`` None) for an in-process caller that reads no result (the simulator,
        ``ClusterSim._dispatch``): the same branch table, counts, outbox and counters (the lost-reuse
        ones included), with no :class:`PlaceResult`, released-node names or :class:`ReuseRecord`
        built (``tests/unit/kvdirectory/test_held_counts.py``). ``lookup`` as in :meth:`place`.
        A list ``block_hashes`` becomes the branch's path as it is, not copied (the simulator's
        request lists are never changed once sent): the caller must not change it afterwards."""
        n = self._slot(node)
        path = block_hashes if type(block_hashes) is list else list(block_hashes)
        out = self.branches.place(branch_id, n, phase, path, now, None)
        if not out.rejected and path and (phase == "prefill" or phase == "both"):
            self._reuse(n, path, out.history_blocks, out.prev_prefill_node, lookup)

    def _reuse(
        self, n: int, path: list[int], history: int, prev: int | None, lookup: LookupResult | None = None
    ) -> tuple[int, int, int, Cause, str, str | None]:
        """Count the lost reuse of node n's prefill placement of ``path`` (``reuse.*`` counters);
        returns its :class:`ReuseRecord`'s fields, in field order."""
        lk = lookup if lookup is not None else self.lookup(path)
        longest = lk.longest_any
        ideal = longest if longest > history else history  # max(history, longest): no builtin call
        # (the node's own prefix is read only when it is the hit: a walk of the lookup's nodes)
        hit = longest if self.reuse_hit_scope == "cluster" else lk.node(self.names[n]).local_blocks
        prev_name = self.names[prev] if prev is not None else None
        lost, cause = attribute_lost_reuse(ideal, hit, self.names[n], prev_name)
        c = self.counters
        c["reuse.ideal_tokens"] += ideal * self.block_size
        c["reuse.hit_tokens"] += (ideal if ideal < hit else hit) * self.block_size
        if lost:
            c["reuse.lost_tokens." + cause] += lost * self.block_size
        return ideal, hit, lost, cause, self.names[n], prev_name

    def node_phase_changed(self, node: str, old: str | None, new: str, now: float) -> int:
        """A node now serves ``new``: D→P resets its counts, P→D keeps them. Returns branches released."""
        return self.branches.node_phase_changed(self._slot(node), old, new)

    def node_phase(self, node: str) -> str | None:
        """Phase the directory knows for a node (split.applied, else last placement)."""
        i = self._ids.get(node)
        return None if i is None else self.branches.phase_of(i)

    def apply(self, msg: KvEventBatch | KvSnapshot | BranchStart | BranchEnd | BranchToolCall | RoutePlaced, now: float) -> object:
        """Dispatch any input message to its method (for simulators and tests)."""
        match msg:
            case KvEventBatch():
                return self.apply_kv_batch(msg, now)
            case KvSnapshot():
                return self.apply_snapshot(msg, now)
            case BranchStart():
                return self.branch_start(msg.branch_id, now, kind=msg.kind, parent=msg.parent_branch_id, agent=msg.agent_id)
            case BranchEnd(expired=True):
                return self.branch_evict(msg.branch_id, msg.rid)
            case BranchEnd():
                return self.branch_end(msg.branch_id, now)
            case BranchToolCall():
                return self.branch_hold(msg.branch_id, msg.outstanding, msg.expected_s, now)
            case RoutePlaced():
                return self.place(msg.branch_id, msg.node, msg.phase, msg.block_hashes, now, rid=msg.rid)
        raise TypeError(f"KvDirectory.apply: unsupported message {type(msg).__name__}")

    def branch(self, branch_id: str) -> Branch | None:
        """The branch table row (read only), or None."""
        return self.branches.branches.get(branch_id)

    def count(self, node: str, block: int) -> int:
        """R[block, node]."""
        i = self._ids.get(node)
        return 0 if i is None else self.branches.R[i].get(block, 0)

    def counted_blocks(self, node: str) -> int:
        """Blocks with R[block, node] > 0 (held there or not): the KV that active branches
        reference on ``node``. O(1)."""
        i = self._ids.get(node)
        return 0 if i is None else len(self.branches.R[i])

    def counted_blocks_all(self) -> list[int]:
        """:meth:`counted_blocks` of every node, in node-id order (the order of :attr:`names`, in
        which :meth:`node_id` registered them): one call per caller's sample of all nodes instead
        of one per node (the simulator samples every prefill node per request sent). O(nodes)."""
        t = self.branches
        return t.runs.total[:] if t.chained else list(map(len, t.R))

    # ------------------------------------------------------------------ #
    # time, outbox, observability
    # ------------------------------------------------------------------ #

    def expire(self, now: float) -> list[str]:
        """Expire branches silent for ``branch_ttl_s``; returns their ids."""
        return self.branches.expire(now)

    def next_deadline(self) -> float | None:
        """When :meth:`expire` next has work (simulated s), or None."""
        return self.branches.next_deadline()

    def take_count_updates(self) -> list[CountUpdates]:
        """Drain the per-node count changes (``kv.counts.<node>`` messages)."""
        return self.branches.take_count_updates()

    def take_count_lists(self) -> list[tuple[int, int, list[int], list[int]]]:
        """:meth:`take_count_updates` as ``(node id, seq, hashes, counts)`` per message, no message
        object built (an in-process caller, the simulator); see ``BranchTable.take_count_lists``."""
        return self.branches.take_count_lists()

    def drop_count_updates(self) -> int:
        """Discard the pending count changes without building messages (a caller whose engines
        ignore counts); returns the changes dropped. See ``BranchTable.drop_count_updates``."""
        return self.branches.drop_count_updates()

    def count_snapshot(self, node: str) -> tuple[list[int], list[int], int]:
        """Every block's branch count R[b, node] > 0 on ``node`` and the ``seq`` of the last
        ``kv.counts.<node>`` message made for it: what a worker that lost a count message resets
        its counts to (``kv.countsync.<node>``, ``CountSnapshot``).

        Returns ``(hashes, counts)`` — two lists of :meth:`counted_blocks` entries, ``counts[i] =
        R[hashes[i], node]`` (branches, ≥ 1), in R's order (the order the blocks' counts last rose
        from 0 there) — and ``seq``, ``BranchTable.out_seq[node]`` (0: no message yet; also
        for a node the directory never heard of, with empty lists). Source: the branch table's
        per-node R (paper Alg. E.2) and its message counter. O(counted blocks on ``node``),
        C-level list copies; reads only.

        Raises:
            ValueError: if count changes of ``node`` are pending (not yet taken by
                :meth:`take_count_updates`): R then already holds changes that the next message,
                numbered after ``seq``, will carry, and a change undone before that drain is not
                sent at all, so the snapshot would not be the state after message ``seq``. Take
                the updates first, in the same synchronous step.
        """
        n = self._ids.get(node)
        if n is None:
            return [], [], 0
        t = self.branches
        if t.out_len[n]:
            raise ValueError(f"{t.out_len[n]} count changes of {node} not yet taken: take_count_updates() first")
        R = t.R[n]
        return list(R), list(R.values()), t.out_seq[n]

    def count_seqs(self) -> dict[str, int]:
        """``seq`` of the last ``kv.counts.<node>`` message made for each node made one (``node →
        seq``, nodes never sent counts left out): what a seq beacon tells each worker. Source:
        ``BranchTable.out_seq``. O(nodes)."""
        seqs = self.branches.out_seq
        return {name: seqs[n] for n, name in enumerate(self.names) if seqs[n]}

    def pending_count_updates(self) -> int:
        """Count changes not yet taken (a block changed twice before a drain counts twice). O(nodes)."""
        return self.branches.pending_updates()

    def all_counters(self) -> dict[str, int]:
        """Every counter of the core (directory + index)."""
        out = dict(self.counters)
        out.update(self.index.counters)
        return out

    def gauges(self) -> dict[str, float]:
        """Current sizes: blocks indexed, copies by (count > 0, tier), branches, lost-reuse shares."""
        g: dict[str, float] = {"blocks.indexed": float(len(self.index)), "branches.active": float(len(self.branches.branches))}
        counted_copies = self.branches.counted_copies  # O(counted blocks) unless kept
        for t in (GPU, HOST):
            copies = sum(c[t] for c in self.index.copies)
            counted = sum(c[t] for c in counted_copies)
            g[f"copies.{TIERS[t]}"] = float(copies)
            g[f"copies.{TIERS[t]}.positive_count"] = float(counted)
            g[f"copies.{TIERS[t]}.zero_count"] = float(copies - counted)
        g["counts.entries"] = float(sum(len(r) for r in self.branches.R))
        g["nodes"] = float(self.live_nodes())
        g["nodes.forgotten_slots"] = float(len(self._free))
        g["nodes.awaiting_resync"] = float(sum(1 for s in self._streams if s.awaiting))
        lost = {k.rsplit(".", 1)[1]: v for k, v in self.counters.items() if k.startswith("reuse.lost_tokens.")}
        for k, v in lost_reuse_shares(lost, self.counters["reuse.ideal_tokens"]).items():
            g["reuse." + k] = v
        return g
