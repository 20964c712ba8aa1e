"""DirectoryService: the asyncio shell around :class:`KvDirectory`.

This module contains zero decision logic: it subscribes, decodes (through the
bus), calls the core with ``clock.local_now()`` (monotonic), publishes the core's outbox, logs
what the core's results report, and runs the resync requests.

Subjects in: ``kv.events.*``, ``branch.events``, ``route.placed``,
``split.applied``, ``node.state.*`` (KV liveness); served: ``kv.lookup``, ``branch.query`` (a branch's state, for a
router that never saw it), ``kv.countsync.*``
(a worker's counts after it lost a ``kv.counts`` message: ``CountSnapshot`` pieces); out:
``kv.counts.<node>`` (count changes; every ``count_seq_beacon_s`` a seq beacon with the node's last
``seq``), ``kv.liveness``, ``branch.sync`` (at start, and again each second until every router it waits for, the
ones ``--routers`` names or else those it hears of, has answered with its republish of its active branches and latest
placements, ended by a ``BranchSyncDone`` on ``branch.events``; it reads ``svc.heartbeat.router`` to know the routers:
``settle.py``); requests: ``kv.resync.<node>``. A malformed payload is counted by the bus
(``dropped.<template>``) and dropped; nothing here stops on bad input.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import msgspec
import structlog
from prometheus_client import Histogram

from shared import messages as m
from shared.bus import Bus, BusError
from shared.cancel import raise_if_cancel_lost
from shared.clock import SimClock, sleep_until
from shared.metrics import HANDLER_BUCKETS_S, FuncCollector, make_registry
from shared.ratelog import RateLimitedLog
from shared.service import BackgroundTasks, WatchedService
from shared.subjects import (
    BRANCH_EVENTS,
    BRANCH_QUERY,
    BRANCH_SYNC,
    KV_COUNT_SYNC,
    KV_COUNTS,
    KV_EVENTS,
    KV_LIVENESS,
    KV_LOOKUP,
    KV_RESYNC,
    NODE_STATE,
    ROUTE_PLACED,
    SPLIT_APPLIED,
    SVC_HEARTBEAT,
)

from .config import DirectoryConfig
from .core import KvDirectory
from .liveness import KvLiveness
from .lookup import usable_lookup
from .prom import directory_families
from .settle import BranchSyncSettle

COUNT_ENTRY_BYTES = 14
"""Most msgpack bytes of one ``CountSnapshot`` entry: an int64 hash (9) and a count below 2^32 (5)."""
UNHEARD_RESYNC_AFTER_S = 2.0
"""Wall seconds (monotonic) a node may be heard on ``node.state`` while this directory has heard none of its KV (no
``kv.events`` batch, no snapshot) before the liveness loop asks it for a snapshot (``KvDirectory.resync_unheard``): a
directory restarted while the node idles hears no batch of it until its next request, so its blocks were never
indexed. Not at once: a starting worker publishes its batch 1 before its first state, but on JetStream, which can
deliver it after the state (core NATS); asked then, the snapshot would be needless and the late batch 1 taken for a
restart (a second one)."""


class _CountSnap:
    """A node's counts taken for a ``kv.countsync`` answered in several pieces (kept until its last
    piece is served, a newer snapshot of the node replaces it, or ``count_sync_ttl_s`` passes)."""

    __slots__ = ("id", "seq", "hashes", "counts", "taken")

    def __init__(self, id: str, seq: int, hashes: list[int], counts: list[int], taken: float) -> None:
        self.id = id
        self.seq = seq
        self.hashes = hashes
        self.counts = counts
        self.taken = taken
        """``time.monotonic()`` when it was taken."""


class DirectoryService(WatchedService):
    """The KV directory process: one core, its subscriptions and background tasks.

    Args:
        cfg: service configuration.
        bus: connected bus (subjects already bound to the partition).
        clock: simulated cluster clock; only this shell reads it: ``local_now()`` (monotonic) for
            the core, whose times are all durations of this process (branch TTL, tool-call holds;
            on the wall clock a step forward of ``branch_ttl_s`` expired every branch at once),
            ``monotonic()`` for KV liveness; wall time only where another process reads it
            (``BranchSync.ts``, ``gauges['wall_ts']``).
    """

    def __init__(self, cfg: DirectoryConfig, bus: Bus, clock: SimClock) -> None:
        self.cfg = cfg
        self.bus = bus
        self.clock = clock
        self.core = KvDirectory(
            cfg.block_size,
            max_blocks=cfg.max_blocks,
            branch_ttl_s=cfg.branch_ttl_s,
            max_tool_hold_s=cfg.max_tool_hold_s,
            resync_buffer_batches=cfg.resync_buffer_batches,
            reuse_hit_scope=cfg.reuse_hit_scope,
            keep_counted_copies=True,  # gauges on every stats request / scrape: O(nodes), no loop stall
        )
        self.counters: Counter[str] = Counter()
        self.liveness = KvLiveness(cfg.kv_stale_after_s)
        """Per node: seconds served without a KV batch, heard from, forgotten; stale views (issue #22).
        Fed ``clock.monotonic()``: its durations are this process's own, and on the wall clock a
        step forward forgot every node in one round (and marked every serving one stale)."""
        self.registry = make_registry(bus)
        """Prometheus registry served on ``--metrics-port`` (``services/kvdirectory/prom.py``)."""
        self.registry.register(FuncCollector(lambda: directory_families(self)))
        self._ingest_s = Histogram(
            "ei_kvdirectory_ingest_seconds", "Wall time to apply one kv.events batch (s)", buckets=HANDLER_BUCKETS_S, registry=self.registry
        )
        self._lookup_s = Histogram(
            "ei_kvdirectory_lookup_seconds", "Wall time to answer one kv.lookup (s)", buckets=HANDLER_BUCKETS_S, registry=self.registry
        )
        self.log = structlog.get_logger("kvdirectory").bind(instance=bus.instance)
        self._resyncs: dict[str, asyncio.Task[None]] = {}
        self._compaction_log = RateLimitedLog(self.log, first=5, interval_s=10.0)
        """The ``branch compacted`` info lines (:meth:`_on_placed`): the first 5 of each 10 s, then one count line
        (a harness that sends side requests on its branch ids bumps at the agents' rate); flushed by the flush loop."""
        self._bg = BackgroundTasks(self.log, self.counters)
        """The loops (flush, liveness, beacon: one that ends fails the directory, exit 1) and the
        per-node resyncs (one that fails is logged and counted, ``resync.errors``)."""
        self.fatal = self._bg.fatal
        """Set when a loop ended (``shared.service`` stops the directory and exits non-zero)."""
        self._flush_lock = asyncio.Lock()
        self.count_epoch = uuid.uuid4().hex
        """``CountUpdates.epoch`` of this process: workers reset their counts when it changes."""
        self._epoch_told: dict[str, str] = {}
        """Node → the count epoch (:meth:`node_epoch`) last announced to it in an empty ``kv.counts``
        (on a ``node.state``): announced again when its epoch changes (its id registered anew after
        its slot was taken over)."""
        self._stopping = False
        self._last_resync: dict[str, float] = {}
        """Monotonic time of the last resync request per node (at most one per ``resync_min_interval_s``)."""
        self._count_snaps: dict[str, _CountSnap] = {}
        """Per node: the ``kv.countsync`` snapshot whose later pieces a worker is fetching (one each)."""
        self._count_sync_last: dict[str, float] = {}
        """Per node: ``time.monotonic()`` of its last new ``kv.countsync`` snapshot, while younger than
        ``count_sync_min_interval_s`` (dropped after it on the flush loop)."""
        self.sync = BranchSyncSettle(cfg.branch_sync_settle_s, cfg.branch_sync_max_s, cfg.routers)
        """Has the routers' republish (the answer to this process's ``branch.sync``) been read? ``branch.query``
        answers say so (``BranchQueryReply.synced``); fed ``clock.monotonic()`` (wall-rate seconds: the republish takes
        wall time whatever the ``--speedup``)."""
        self._sync_msg: m.BranchSync | None = None
        """This process's ``branch.sync`` (sent again, as it is, while not settled)."""
        if cfg.nodes:
            bus.known_nodes = frozenset(cfg.nodes)

    # ------------------------------------------------------------------ #
    # lifecycle
    # ------------------------------------------------------------------ #

    async def start(self) -> None:
        """Subscribe to every input subject, serve lookups, start the flush loop."""
        await self.bus.subscribe(KV_EVENTS, self._on_kv)
        await self.bus.subscribe(BRANCH_EVENTS, self._on_branch)
        await self.bus.subscribe(ROUTE_PLACED, self._on_placed)
        await self.bus.subscribe(SPLIT_APPLIED, self._on_split)
        await self.bus.serve(KV_LOOKUP, self._on_lookup)
        await self.bus.serve(BRANCH_QUERY, self._on_branch_query, query=True)
        await self.bus.serve(KV_COUNT_SYNC, self._on_count_sync)
        await self.bus.subscribe(NODE_STATE, self._on_state)
        await self.bus.subscribe(SVC_HEARTBEAT, self._on_router_beat, service="router")  # the routers to wait for
        # a restarted directory has lost its branch table: the routers republish it (issue #22); branch.query answers
        # synced=false until every router's republish has been read (services/kvdirectory/settle.py)
        ts = self.clock.now()
        self._sync_msg = m.BranchSync(directory=self.bus.instance, ts=ts, sync_id=uuid.uuid4().hex)
        # before the publish: it may yield, and the republish come meanwhile
        self.sync.sent(self.clock.monotonic(), ts, self._sync_msg.sync_id)
        await self.bus.publish(BRANCH_SYNC, self._sync_msg)
        self.counters["branch_sync.sent"] += 1
        self._bg.start(self._sync_loop(), "kvdirectory-branch-sync", needed=False, counter="branch_sync.errors")
        self._bg.start(self._flush_loop(), "kvdirectory-flush")
        self._bg.start(self._liveness_loop(), "kvdirectory-liveness")
        if self.cfg.count_seq_beacon_s > 0:
            self._bg.start(self._beacon_loop(), "kvdirectory-count-beacon")

    async def stop(self) -> None:
        """Cancel resyncs and the flush loop, then publish the last count updates."""
        self._stopping = True
        await self._bg.stop()
        try:
            await self.flush_counts()
        except Exception as e:  # connection already gone: nothing to lose but counts
            self.log.warning("final count flush failed", error=repr(e))

    def ready(self) -> bool:
        """Not stopping, and the flush / liveness / beacon loops run."""
        return not self._stopping and self._bg.healthy()

    # ------------------------------------------------------------------ #
    # handlers
    # ------------------------------------------------------------------ #

    def _over_limit(self, node: str) -> bool:
        """``node`` is not live (unknown, or forgotten: :meth:`KvDirectory.is_live`) and
        ``--max-nodes`` nodes are: making it live (registering it, or reviving a forgotten one in
        the slot it still holds) would pass the limit. The limit counts live nodes, and a forgotten
        node is not one (``--max-nodes``' help), so a slot held is no exception: its KV events, its
        ``node.state`` and a resync of it all wait until a node is forgotten. O(1)."""
        return not self.core.is_live(node) and self.core.live_nodes() >= self.cfg.max_nodes

    def _new_over_limit(self, node: str, what: str) -> bool:
        """A placement or a phase change (another process's word, :meth:`KvDirectory._slot`)
        naming ``node``: True, counted ``<what>.nodes_over_limit`` and logged (rate-limited, as
        ``kv.nodes_over_limit``), when ``node`` has no slot and ``--max-nodes`` nodes are live,
        as registering it would pass the limit; the caller drops the message. Before, these
        registered any id unchecked, so a stream of invented node ids in ``route.placed`` grew
        the directory without bound. A forgotten node holding its slot is not refused: ``_slot``
        leaves it forgotten (not live), so it does not pass the limit. O(1)."""
        if self.core.has_node(node) or self.core.live_nodes() < self.cfg.max_nodes:
            return False
        self.counters[f"{what}.nodes_over_limit"] += 1
        self.bus.droplog.event(f"{what}.nodes_over_limit", f"{what} naming a node past max_nodes dropped", node=node)
        return True

    async def _on_kv(self, batch: m.KvEventBatch, subject: str) -> None:
        if self._over_limit(batch.node):
            self.counters["kv.nodes_over_limit"] += 1
            self.bus.droplog.event("kv.nodes_over_limit", "KV events of a node past max_nodes dropped", node=batch.node)
            return
        t0 = time.perf_counter()
        res = self.core.apply_kv_batch(batch, self.clock.local_now())
        self._drop_reclaimed()  # a new node took a forgotten one's slot: before the old id can be heard again
        self._ingest_s.observe(time.perf_counter() - t0)
        mono = self.clock.monotonic()  # liveness measures local durations: a wall-clock step must not forget every node
        if self.liveness.heard(batch.node, mono):  # its batch was buffered: the core awaits a snapshot
            self._node_back(batch.node)
        if self.liveness.batch(batch.node, mono):
            self.counters["kv_view.fresh_again"] += 1
            self.log.info("node sends KV events again; its view counts again", node=batch.node)
        if res.mismatched_block_sizes:
            self.log.error(
                "KV events with a foreign block size rejected",
                node=batch.node,
                seq=batch.seq,
                got=sorted(set(res.mismatched_block_sizes)),
                expected=self.core.block_size,
            )
        if res.status == "gap":
            if res.detail:  # a restarted node or a first contact: not a lost batch (core.ApplyResult.detail)
                self.log.warning("KV sequence out of order; resync requested", node=batch.node, seq=batch.seq, reason=res.detail)
            else:
                self.log.warning("KV sequence gap; resync requested", node=batch.node, seq=batch.seq, expected=res.expected_seq)
        if res.need_resync:
            self._ensure_resync(batch.node)
        await self._maybe_flush()

    async def _on_branch(self, ev: m.BranchStart | m.BranchEnd | m.BranchToolCall | m.BranchSyncDone, subject: str) -> None:
        now = self.clock.local_now()
        if isinstance(ev, m.BranchToolCall):
            verdict = self.core.branch_hold(ev.branch_id, ev.outstanding, ev.expected_s, now)
            if verdict in ("ended", "unknown"):
                self.log.warning("tool-call hint for no active branch", branch=ev.branch_id, verdict=verdict)
        elif isinstance(ev, m.BranchSyncDone):
            self._on_sync_done(ev)
            return
        elif isinstance(ev, m.BranchStart):
            unnamed = len(self.sync.unnamed)
            if self.sync.start(ev.ts, self.clock.monotonic(), ev.src):  # a router's republish (started before our branch.sync)
                self.counters["branch_sync.republished"] += 1
                self._note_unnamed(unnamed, ev.src, "republished start")
            parent = self._parent_missing(ev.parent_branch_id)
            pre = self.core.branches.branches.get(ev.branch_id)
            # a placement that came first made it implicitly: a new branch (no parent yet), or a resume re-created with
            # its remembered parent (BranchTable._resume), whose parent was counted at its first start
            resumed_first = pre is not None and pre.implicit and pre.parent is not None
            verdict = self.core.branch_start(ev.branch_id, now, kind=ev.kind, parent=ev.parent_branch_id, agent=ev.agent_id)
            if verdict in ("duplicate", "ended"):
                self.log.warning("branch start refused", branch=ev.branch_id, verdict=verdict)
            elif parent is not None and (verdict == "started" or (verdict == "merged" and not resumed_first)):
                self.counters[f"branch.parent_missing.{parent}"] += 1  # a resume's parent was counted at its start
        elif ev.expired:  # a router's table cap evicted it: expired, as by the TTL (resumable)
            verdict = self.core.branch_evict(ev.branch_id, ev.rid)
            if verdict != "evicted":
                self.log.debug("branch eviction not applied", branch=ev.branch_id, verdict=verdict, rid=ev.rid)
        else:
            verdict = self.core.branch_end(ev.branch_id, now)
            if verdict != "ended":
                self.log.warning("branch end for no active branch", branch=ev.branch_id, verdict=verdict)
        await self._maybe_flush()

    def _on_sync_done(self, ev: m.BranchSyncDone) -> None:
        """A router's marker: it has republished its branches for ``ev.sync_id`` (counted ``branch_sync.markers``; one
        for another sync, an older directory's, ``branch_sync.stale_markers``). Logs the settling it completes."""
        unnamed = len(self.sync.unnamed)
        if not self.sync.marker(ev.src, ev.sync_id, ev.branches):
            self.counters["branch_sync.stale_markers"] += 1
            return
        self._note_unnamed(unnamed, ev.src, "marker")
        self.counters["branch_sync.markers"] += 1
        self.log.info("router republished its branches", router=ev.src, branches=ev.branches, placements=ev.placements,
                      missing=self.sync.missing())  # fmt: skip
        self._check_settled()

    def _check_settled(self) -> bool:
        """Whether the directory is settled (:attr:`sync`); logs it once, when it settles. O(routers)."""
        was = self.sync.settled_at is not None
        now = self.clock.monotonic()
        if not self.sync.synced(now):
            return False
        if not was:
            after = round(now - (self.sync.sync_at or now), 2)
            if self.sync.timed_out:
                self.counters["branch_sync.timed_out"] += 1
                self.log.warning("BRANCH SYNC TIMED OUT: settled without the republish of routers that never answered "
                                 "(dead, or stalled): a branch only they hold is unknown here until its next request",
                                 missing=self.sync.missing(), after_s=after, max_s=self.sync.max_s)  # fmt: skip
            else:
                self.log.info("branch table settled: every router waited for republished", routers=sorted(self.sync.done),
                              branches=sum(self.sync.done.values()), after_s=after)  # fmt: skip
        return True

    async def _on_router_beat(self, hb: m.Heartbeat, subject: str) -> None:
        """A router's heartbeat: a router to wait for while not settled (:meth:`BranchSyncSettle.heard`), unless
        ``--routers`` names others only."""
        unnamed = len(self.sync.unnamed)
        if self.sync.heard(hb.instance):
            self.counters["branch_sync.routers_heard"] += 1
        else:
            self._note_unnamed(unnamed, hb.instance, "heartbeat")

    def _note_unnamed(self, before: int, router: str, how: str) -> None:
        """``router`` was newly heard (``how``: ``heartbeat``, ``republished start``, ``marker``) while not settled
        though ``--routers`` does not name it (:attr:`BranchSyncSettle.unnamed` grew past ``before`` entries): it is
        not waited for. Counted ``branch_sync.routers_unnamed``, logged once per router (at most
        :data:`~services.kvdirectory.settle.UNNAMED_MAX`): a router missing from ``--routers`` (its republish is read
        but not waited for), or a forged name. O(1)."""
        if len(self.sync.unnamed) <= before:
            return
        self.counters["branch_sync.routers_unnamed"] += 1
        self.log.warning("router not named in --routers heard: its republish is not waited for", router=router,
                         heard_by=how, routers=sorted(self.sync.configured))  # fmt: skip

    async def _sync_loop(self) -> None:
        """Until settled: every :data:`~services.kvdirectory.settle.SYNC_RESEND_S`, and within 50 ms of a router
        newly heard, send ``branch.sync`` again (same ``sync_id``) for a router that missed it (not subscribed yet,
        disconnected, restarted: a core NATS message); a router answers one ``sync_id`` once. A failed send is counted
        (``branch_sync.resend_failed``) and retried."""
        while not self._check_settled():
            await asyncio.sleep(0.05)
            if self._sync_msg is None or not self.sync.resend_due(self.clock.monotonic()):
                continue
            try:
                await self.bus.publish(BRANCH_SYNC, self._sync_msg)
                self.counters["branch_sync.resent"] += 1
            except BusError as e:
                self.counters["branch_sync.resend_failed"] += 1
                self.log.warning("branch.sync resend failed", error=repr(e), missing=self.sync.missing())

    def _parent_missing(self, parent: str | None) -> str | None:
        """Why a new branch's parent is not an active branch here: ``unknown`` (never started here, or forgotten),
        ``ended`` or ``expired`` (its counts released: a fork's first request gets no prefix from it); None when
        it is active or there is none. Read before the start (``branch.parent_missing.<reason>``, Prometheus
        ``ei_kvdirectory_branch_parents_missing_total{reason}``). O(1)."""
        if parent is None:
            return None
        t = self.core.branches
        if parent in t.branches:
            return None
        if parent in t.ended:
            return "ended"
        return "expired" if parent in t.expired else "unknown"

    async def _on_placed(self, msg: m.RoutePlaced, subject: str) -> None:
        if self._new_over_limit(msg.node, "placed"):
            return
        res = self.core.place(msg.branch_id, msg.node, msg.phase, msg.block_hashes, self.clock.local_now(), rid=msg.rid)
        self._drop_reclaimed()
        if res.rejected:
            self.log.warning("placement refused", branch=msg.branch_id, node=msg.node, rid=msg.rid, reason=res.rejected)
        elif res.bumped:
            # a compaction (Alg. E.1), or a request on the branch's id that did not extend its conversation (a side
            # request: a title, a summary, a classifier): either way the branch's blocks past the common prefix are
            # released, and its next request finds only that prefix cached (counted: branch.version_bumps,
            # ei_kvdirectory_branch_compactions_total). Info, at most 5 lines a 10 s (then a count)
            self._compaction_log.event(
                "branch compacted", "branch compacted: its new prompt does not extend its previous one; blocks past "
                "the common prefix released", level="info", branch=msg.branch_id, old_version=res.version - 1,
                new_version=res.version, node=msg.node, rid=msg.rid,
                hint="expected after a compaction; otherwise a request on this X-Branch-Id did not extend its "
                "conversation (send side requests with no X-Branch-Id or their own)",
            )  # fmt: skip
        await self._maybe_flush()

    async def _on_split(self, msg: m.SplitApplied, subject: str) -> None:
        if msg.status != "serving":
            return
        old = self.core.node_phase(msg.node)
        if old != msg.phase and not self._new_over_limit(msg.node, "split"):
            released = self.core.node_phase_changed(msg.node, old, msg.phase, self.clock.local_now())
            self._drop_reclaimed()
            self.log.info("node phase changed", node=msg.node, old=old, new=msg.phase, released_branches=released)
            await self._maybe_flush()

    async def _on_state(self, st: m.NodeState, subject: str) -> None:
        mono = self.clock.monotonic()
        back = self.liveness.heard(st.node, mono)
        if back:
            self._node_back(st.node)
        revived = False
        if self.core.is_forgotten(st.node):  # live again in its slot (a node.state alone says so too) ...
            if not self._over_limit(st.node):
                self.core.node_id(st.node)
                revived = True
            elif back:  # ... unless --max-nodes nodes are live: its next state tries again
                self.counters["nodes.over_limit_not_revived"] += 1
                self.log.warning("forgotten node heard again but --max-nodes nodes are live; it stays forgotten",
                                 node=st.node, max_nodes=self.cfg.max_nodes)  # fmt: skip
        if (back or revived) and self.core.awaiting_resync(st.node):  # an idle node holds KV too: ask for it now
            self._ensure_resync(st.node)
        self.liveness.state(st.node, st.running + st.waiting > 0, mono)
        epoch = self._epoch_to_announce(st.node)
        told = self._epoch_told.get(st.node)
        if epoch is not None and told != epoch and (told is not None or len(self._epoch_told) < self.cfg.max_nodes):
            # tell the node this process's count epoch now, with no counts: a worker holding counts of
            # a directory that died (or of this node id's registration before its slot was taken over)
            # resets them at once, not at this process's first count change for it (which an idle
            # node may not get for a long time)
            self._epoch_told[st.node] = epoch
            await self.bus.publish(KV_COUNTS, m.CountUpdates(node=st.node, epoch=epoch), node=st.node)
            self.counters["counts.epoch_announced"] += 1

    async def _liveness_loop(self) -> None:
        """Every ``liveness_interval_s``: mark silent serving nodes stale (one resync each), ask a snapshot of each node
        heard for ``UNHEARD_RESYNC_AFTER_S`` whose KV was never heard, forget silent nodes, publish ``kv.liveness``."""
        while True:
            await asyncio.sleep(self.cfg.liveness_interval_s)
            try:
                now = self.clock.monotonic()
                for node in self.liveness.check(now):
                    self.counters["kv_view.stale"] += 1
                    self.log.warning(
                        "KV VIEW STALE: node serves but sends no KV events; left out of lookups, resync asked",
                        node=node, silent_s=round(self.liveness.silent_s(node, now), 2), stale_after_s=self.cfg.kv_stale_after_s,
                    )  # fmt: skip
                    if not self._over_limit(node) and self.core.request_resync(node):  # (it registers or revives)
                        self._ensure_resync(node)
                for node in self.liveness.batchless(now, UNHEARD_RESYNC_AFTER_S):  # idle since before this process
                    if not self._over_limit(node) and self.core.resync_unheard(node):  # (it registers)
                        self.log.info("node heard but none of its KV (idle since before this directory started): resync asked",
                                      node=node)  # fmt: skip
                        self._ensure_resync(node)
                if self.cfg.forget_node_after_s > 0:
                    for node in self.liveness.forget(now, self.cfg.forget_node_after_s):
                        self._forget(node)
                self._drop_reclaimed()
                report = [m.NodeKvLiveness(node=n, silent_s=round(s, 3), last_batch_s=None if b is None else round(b, 3), stale=st)
                          for n, s, b, st in self.liveness.report(now)]  # fmt: skip
                await self.bus.publish(KV_LIVENESS, m.KvLiveness(nodes=report, stale_after_s=self.cfg.kv_stale_after_s))
            except Exception as e:  # one failed round must not end the checks
                self.counters["liveness.errors"] += 1
                self.log.warning("liveness round failed", error=repr(e))

    def _forget(self, node: str) -> None:
        """``node`` was heard of neither on ``kv.events`` nor on ``node.state`` for
        ``forget_node_after_s``: drop its KV (``KvDirectory.forget_node``) and stop asking it for
        a snapshot (a resync task of a dead node retries forever); it is asked again when heard.
        A node the core never registered (heard on ``node.state`` only) holds no slot that
        another node would take over: what this shell keeps of it goes at once
        (:meth:`_drop_marks`), or such ids, new at each restart, piled up here for good."""
        dropped = self.core.forget_node(node)
        t = self._resyncs.pop(node, None)
        if t is not None and not t.done():
            t.cancel()
        if not self.core.has_node(node):
            self._drop_marks(node)
        self.log.warning(
            "NODE FORGOTTEN: no KV events and no state for too long; its blocks are dropped from the directory",
            node=node, silent_for_s=self.cfg.forget_node_after_s, copies_dropped=dropped,
        )  # fmt: skip

    def _drop_reclaimed(self) -> None:
        """Forget for good the nodes whose directory slot another node took over
        (``KvDirectory.take_reclaimed``): what this shell keeps per node (liveness, the count epoch
        told, resync and count-sync marks) goes, so node ids that change on every restart do not
        pile up. Called right after every core call that can take a slot over (a KV batch, a
        placement, a phase change; and each liveness round), with no await between: the old id,
        heard again later, is a new node here too (run only on the liveness round, it dropped
        what the shell had meanwhile kept of the new registration: its resync in flight, its
        liveness). O(nodes reclaimed)."""
        for node in self.core.take_reclaimed():
            self._drop_marks(node)

    def _drop_marks(self, node: str) -> None:
        """Drop what this shell keeps of ``node`` (gone for good), and cancel its resync. O(1)."""
        self.liveness.drop(node)
        self._epoch_told.pop(node, None)
        self._last_resync.pop(node, None)
        self._count_snaps.pop(node, None)
        self._count_sync_last.pop(node, None)
        t = self._resyncs.pop(node, None)
        if t is not None and not t.done():
            t.cancel()

    def _epoch_to_announce(self, node: str) -> str | None:
        """:meth:`node_epoch` of ``node`` when it is settled: the node is registered in the core,
        or no slot was ever taken over (then every node registers with the plain
        :attr:`count_epoch`). None otherwise: its epoch depends on how many slots will have been
        taken over when its first KV batch registers it, and announcing the plain one first made
        its worker take its first count message for a directory restart (a reset and a log line
        on every new pod). O(1)."""
        if self.core.has_node(node) or self.core.reclaims == 0:
            return self.node_epoch(node)
        return None

    def node_epoch(self, node: str) -> str:
        """``CountUpdates.epoch`` of ``node``'s counts: :attr:`count_epoch`, with the node's
        generation appended once a forgotten node's slot was taken over before it was registered
        (``KvDirectory.node_generation``): a node id forgotten, its slot given to another, then
        heard again has no counts here and numbers from 1 again, so its worker must reset the
        counts it holds (a new epoch) rather than drop the new numbers as old ones."""
        gen = self.core.node_generation(node)
        return self.count_epoch if gen == 0 else f"{self.count_epoch}.{gen}"

    def _node_back(self, node: str) -> None:
        self.counters["nodes.returned"] += 1
        self.log.info("forgotten node heard again; its KV is resynced", node=node)

    async def _on_lookup(self, req: m.KvLookupRequest, subject: str) -> m.KvLookupReply:
        if req.block_size != self.core.block_size:
            self.counters["lookup.block_size_mismatch"] += 1
            self.log.error("lookup with a foreign block size refused", got=req.block_size, expected=self.core.block_size)
            return m.KvLookupReply(
                block_size=self.core.block_size,
                error=f"block size mismatch: request {req.block_size}, directory {self.core.block_size}",
            )
        self.counters["lookups"] += 1
        t0 = time.perf_counter()
        reply = self.core.lookup(req.block_hashes).to_reply(self.core.block_size)
        stale = self.liveness.stale_nodes()
        if stale:  # no prefix credit, no fetch source on a node whose view is stale
            reply = usable_lookup(reply, lambda n: n not in stale) or reply
        self._lookup_s.observe(time.perf_counter() - t0)
        return reply

    async def _on_branch_query(self, q: m.BranchQuery, subject: str) -> m.BranchQueryReply:
        """``branch.query``: a router that never saw the branch (another router served it, or it restarted) asks its
        state before it relays the harness's end or tool call; counted ``branch_queries.<state>``. Answered from
        the branch table as it stands: a ``BranchStart`` still in ``branch.events``' stream reads ``unknown``.
        ``synced`` is False until every waited-for router's republish after this process's ``branch.sync`` has been read
        (:class:`~services.kvdirectory.settle.BranchSyncSettle`; counted ``branch_queries.unsynced``): an
        ``unknown`` then may be a branch not republished yet, which the router answers 503, not 404."""
        state = self.core.branch_state(q.branch_id, self.clock.local_now())
        synced = self._check_settled()
        self.counters[f"branch_queries.{state}"] += 1
        if not synced:
            self.counters["branch_queries.unsynced"] += 1
        return m.BranchQueryReply(branch_id=q.branch_id, state=state, synced=synced)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ #
    # resync (never blocks other nodes' ingestion: one task per node)
    # ------------------------------------------------------------------ #

    def _ensure_resync(self, node: str) -> None:
        t = self._resyncs.get(node)
        if (t is None or t.done()) and not self._stopping and not self._over_limit(node):  # a resync revives it
            # an exception other than the bus's ends it: logged with the traceback and counted
            # (resync.errors; before, it died silently); the node's next state or gap starts another
            self._resyncs[node] = self._bg.start(self._resync(node), f"kvdirectory-resync-{node}", needed=False, counter="resync.errors")

    async def _resync(self, node: str) -> None:
        delay = 0.1
        while self.core.awaiting_resync(node) and not self._stopping:
            # a forgotten node's resync is cancelled once (_forget, _drop_marks) and no longer tracked; a cancel that
            # came in the turn its request's answer did (Python 3.11's wait_for; a dead node's "no responders") was
            # lost and the task retried for the directory's lifetime (tests/unit/kvdirectory/test_resync_lost_cancel.py)
            raise_if_cancel_lost()
            allowed = self._last_resync.get(node, -1e18) + self.cfg.resync_min_interval_s
            if time.monotonic() < allowed:  # rate limit: one request per node per interval, whatever the batches say
                self.counters["resync.rate_limited"] += 1
                await sleep_until(allowed)  # one asyncio.sleep wakes early under uvloop: counted once per wait
                continue
            self._last_resync[node] = time.monotonic()
            req = self.core.resync_request(node)
            self.counters["resync.requests"] += 1
            try:
                snap = await self.bus.request(KV_RESYNC, req, timeout=self.cfg.resync_timeout_s, node=node)
            except BusError as e:
                self.counters["resync.failures"] += 1
                self.log.warning("resync request failed; retrying", node=node, error=str(e), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.resync_backoff_max_s)
                continue
            # a cancel lost in the turn a real snapshot came: applied, the forgotten node's blocks came back
            raise_if_cancel_lost()
            if snap.node != node:
                self.counters["resync.wrong_node"] += 1
                self.log.error("resync reply for another node ignored", node=node, got=snap.node)
                await asyncio.sleep(delay)
                continue
            res = self.core.apply_snapshot(snap, self.clock.local_now())
            if res.status == "rejected":
                self.log.error("resync snapshot with a foreign block size rejected", node=node, got=snap.block_size)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.resync_backoff_max_s)
            else:
                self.log.info("node resynced", node=node, seq=snap.seq, status=res.status, added=res.blocks_stored, removed=res.blocks_removed)
                delay = 0.1
            await self._maybe_flush()

    # ------------------------------------------------------------------ #
    # count updates and expiry
    # ------------------------------------------------------------------ #

    async def _maybe_flush(self) -> None:
        if self.core.pending_count_updates() >= self.cfg.counts_flush_updates:
            await self.flush_counts()

    async def flush_counts(self) -> int:
        """Publish every pending ``kv.counts.<node>`` message; returns how many."""
        async with self._flush_lock:
            msgs = self.core.take_count_updates()
            await self._publish_counts(msgs)
            return len(msgs)

    async def _publish_counts(self, msgs: list[m.CountUpdates]) -> None:
        """Publish messages just taken from the core. The caller holds :attr:`_flush_lock` from the
        take to the last publication: the core's numbers (``count_seqs``), read under the lock, then
        name only messages whose publication has returned, or failed (lost like one dropped by
        NATS, which the next beacon shows)."""
        for cu in msgs:
            await self.bus.publish(KV_COUNTS, msgspec.structs.replace(cu, epoch=self.node_epoch(cu.node)), node=cu.node)

    # ------------------------------------------------------------------ #
    # kv.countsync: a worker lost a kv.counts message (or reconnected)
    # ------------------------------------------------------------------ #

    def count_sync_piece(self) -> int:
        """Entries per ``CountSnapshot`` piece: ``--count-sync-piece``, less when the server's max
        payload (``nc.max_payload``, 1 MiB by default, 16 MiB on the embedded server) holds fewer."""
        fits = (int(getattr(self.bus.nc, "max_payload", 1 << 20)) - 1024) // COUNT_ENTRY_BYTES
        return max(1, min(self.cfg.count_sync_piece, fits))

    async def _on_count_sync(self, req: m.CountSyncRequest, subject: str) -> m.CountSnapshot:
        """Answer one piece of ``req.node``'s counts: a new snapshot for ``snapshot=""`` (after the
        pending count changes are taken, in the same step, so it is the state after message
        ``seq``: the worker drops older messages and applies newer ones), else the asked piece of
        the kept one, or ``error`` when that one is gone (the worker starts again) or when the
        node's last new snapshot is younger than ``count_sync_min_interval_s``
        (``countsync.rate_limited``: anyone may ask, and each new snapshot copies the node's
        counts; the worker backs off and asks again)."""
        node, now = req.node, time.monotonic()
        self._expire_count_snaps(now)
        piece = self.count_sync_piece()
        if req.snapshot:
            snap = self._count_snaps.get(node)
            if snap is None or snap.id != req.snapshot or req.offset >= len(snap.hashes):
                self.counters["countsync.snapshot_gone"] += 1
                return m.CountSnapshot(node=node, epoch=self.node_epoch(node), snapshot=req.snapshot,
                                       error="count snapshot gone (expired or replaced): ask again from offset 0")  # fmt: skip
        else:
            gap = self.cfg.count_sync_min_interval_s
            last = self._count_sync_last.get(node)
            if last is not None and now - last < gap:
                self.counters["countsync.rate_limited"] += 1
                return m.CountSnapshot(node=node, epoch=self.node_epoch(node),
                                       error=f"at most one new count snapshot of a node every {gap:g} s: ask again later")  # fmt: skip
            if gap > 0:
                self._count_sync_last[node] = now
            self.counters["countsync.snapshots"] += 1
            async with self._flush_lock:
                msgs = self.core.take_count_updates()
                hashes, counts, seq = self.core.count_snapshot(node)  # same step as the take: nothing pending
                await self._publish_counts(msgs)
            snap = _CountSnap(uuid.uuid4().hex[:16], seq, hashes, counts, now)
            self.counters["countsync.entries"] += len(hashes)
            self.log.info("count sync asked: node's counts sent", node=node, reason=req.reason, worker_epoch=req.epoch,
                          worker_last_seq=req.last_seq, seq=seq, entries=len(hashes), pieces=-(-len(hashes) // piece))  # fmt: skip
            if len(hashes) > piece:
                self._count_snaps[node] = snap  # replaces an older one of the node
            else:
                self._count_snaps.pop(node, None)
        lo = req.offset if req.snapshot else 0
        hi = min(lo + piece, len(snap.hashes))
        if req.snapshot and hi == len(snap.hashes):
            del self._count_snaps[node]  # the last piece: the worker has them all
        self.counters["countsync.pieces"] += 1
        return m.CountSnapshot(node=node, epoch=self.node_epoch(node), seq=snap.seq, snapshot=snap.id, offset=lo, total=len(snap.hashes),
                               hashes=snap.hashes[lo:hi], counts=snap.counts[lo:hi])  # fmt: skip

    def _expire_count_snaps(self, now: float) -> None:
        """Drop the kept ``kv.countsync`` snapshots taken more than ``count_sync_ttl_s`` before
        ``now`` (``time.monotonic()``; ``countsync.expired``). Run on every ``kv.countsync``
        request and every flush round, so a snapshot whose worker stopped asking (it stopped,
        or gave up mid-fetch) is not kept, with its copy of the node's counts, until some worker
        next syncs. O(kept snapshots) (at most one per node)."""
        snaps = self._count_snaps
        if snaps:
            for n in [n for n, s in snaps.items() if now - s.taken > self.cfg.count_sync_ttl_s]:
                del snaps[n]
                self.counters["countsync.expired"] += 1

    def _expire_count_sync_marks(self, now: float) -> None:
        """Forget the nodes whose last new ``kv.countsync`` snapshot is ``count_sync_min_interval_s``
        old (``time.monotonic()``): they may ask again, and the marks of node ids asked once (any
        id, without ``--nodes``) do not pile up. Run every flush round. O(marks)."""
        marks = self._count_sync_last
        if marks:
            for n in [n for n, t in marks.items() if now - t >= self.cfg.count_sync_min_interval_s]:
                del marks[n]

    async def send_count_beacons(self) -> int:
        """Publish a seq beacon (``CountUpdates(beacon=True)``: no entries, ``seq`` not incremented)
        to every node sent counts, with the ``seq`` of the last message published to it: a worker
        whose last applied ``seq`` is below it lost the last message(s), which no later message
        would show, and syncs (``kv.countsync``). Returns the beacons published.

        The numbers are read holding :attr:`_flush_lock` (a dict copy, O(nodes)), so no flush is
        between taking messages and publishing them: every message up to the beacon's ``seq`` was
        published before the beacon on this one connection, and NATS keeps one publisher's order,
        so a beacon never overtakes its message (no false gap). A flush after the read only makes
        the beacon's ``seq`` older than the worker's last, which the worker ignores. A failed
        publish is counted (``counts.beacon_errors``) and logged once per round; the others go on."""
        async with self._flush_lock:
            seqs = list(self.core.count_seqs().items())
        sent, failed = 0, 0
        err: Exception | None = None
        for node, seq in seqs:
            try:
                await self.bus.publish(KV_COUNTS, m.CountUpdates(node=node, seq=seq, epoch=self.node_epoch(node), beacon=True), node=node)
                sent += 1
            except Exception as e:  # one node's failure must not stop the others' beacons
                failed += 1
                err = e
        self.counters["counts.beacons"] += sent
        if failed:
            self.counters["counts.beacon_errors"] += failed
            self.log.warning("count seq beacons not published", failed=failed, sent=sent, error=repr(err))
        return sent

    async def _beacon_loop(self) -> None:
        """Every ``count_seq_beacon_s``: :meth:`send_count_beacons`."""
        while True:
            await asyncio.sleep(self.cfg.count_seq_beacon_s)
            try:
                await self.send_count_beacons()
            except Exception as e:  # keep beaconing whatever one round hit
                self.counters["counts.beacon_errors"] += 1
                self.log.warning("count seq beacon round failed", error=repr(e))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.counts_flush_s)
            try:
                self._expire_count_snaps(time.monotonic())
                self._expire_count_sync_marks(time.monotonic())
                self._compaction_log.flush()
                now = self.clock.local_now()
                deadline = self.core.next_deadline()
                if deadline is not None and deadline <= now:
                    gone = self.core.expire(now)
                    if gone:
                        self.log.info("branches expired", count=len(gone), first=gone[0])
                await self.flush_counts()
            except Exception as e:  # keep flushing whatever one round hit
                self.counters["flush.errors"] += 1
                self.log.exception("count flush failed", error=repr(e))

    # ------------------------------------------------------------------ #
    # observability
    # ------------------------------------------------------------------ #

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """Counters (core + shell) and gauges for ``svc.stats.<instance>``."""
        counters = self.core.all_counters()
        counters.update(self.counters)
        gauges = self.core.gauges()
        gauges["resync.in_flight"] = float(sum(1 for t in self._resyncs.values() if not t.done()))
        gauges["countsync.kept"] = float(len(self._count_snaps))
        now = self.clock.monotonic()
        gauges["branch_sync.synced"] = 1.0 if self.sync.synced(now) else 0.0
        for node, silent, _last, stale in self.liveness.report(now):
            gauges[f"kv_silent_s.{node}"] = silent
            gauges[f"kv_stale.{node}"] = 1.0 if stale else 0.0
        gauges["wall_ts"] = time.time()
        return counters, gauges
