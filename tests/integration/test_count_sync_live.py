"""A worker that lost ``kv.counts`` messages gets its branch counts back (``kv.countsync``),
over a real nats-server: the KV directory and a worker run in-process as their services (real
bus, sim engine, ``branch-count`` host eviction); the test drives the directory's counts as a
router would (``branch.events``, ``route.placed``) and makes the worker lose a message
deterministically: ``--fault-drop-counts`` drops the directory's message with that seq on
arrival, or the test publishes a message with a skipped seq itself. Afterwards the worker's
counted blocks are the directory's R[·, node] > 0. A lost *last* message (none after it) is
revealed by the directory's seq beacon (``--count-seq-beacon-s``), and beacons racing flushes
start no sync without a loss. The directory takes a new snapshot of a node at most once per its
``--count-sync-min-interval-s``: a worker asking sooner is refused, backs off and still gets its
counts; a well-behaved one (1 s) is never refused. A worker under ``lru`` eviction reads no count:
it neither subscribes to ``kv.counts`` nor syncs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from services.kvdirectory.config import DirectoryConfig
from services.kvdirectory.service import DirectoryService
from services.worker.config import WorkerConfig
from services.worker.countseq import SNAPSHOT_MAX_ENTRIES
from services.worker.prom import worker_families
from services.worker.service import WorkerService
from shared import messages as m
from shared.bus import Bus
from shared.service import serve_until_stopped
from shared.subjects import BRANCH_EVENTS, KV_COUNT_SYNC, KV_COUNTS, ROUTE_PLACED, SVC_STATS, Subjects
from tests.integration.polling import answering, until

pytestmark = pytest.mark.timeout(60)
BS = 4  # the tiny profile's block size


@asynccontextmanager
async def cluster(url: str, *, directory: dict[str, Any] | None = None, worker: dict[str, Any] | None = None) -> AsyncIterator[tuple[Bus, DirectoryService, WorkerService]]:
    """The directory and worker ``w0`` as in-process services; yields a client bus and both service objects."""
    made: dict[str, Any] = {}
    origin = time.time()
    dcfg = DirectoryConfig(nats_url=url, block_size=BS, counts_flush_s=0.02, clock_origin=origin, **(directory or {}))
    wcfg = WorkerConfig(nats_url=url, node="w0", profile="tiny", host_eviction="branch-count", idle_state_interval_s=0.2,
                        clock_origin=origin, check_invariants=True, **(worker or {}))  # fmt: skip

    def keep(kind: str, cls: Any) -> Any:
        def factory(cfg: Any, bus: Bus, clock: Any) -> Any:
            made[kind] = cls(cfg, bus, clock)
            return made[kind]

        return factory

    stops = [asyncio.Event(), asyncio.Event()]
    tasks = [
        asyncio.create_task(serve_until_stopped("kvdirectory", dcfg, keep("dir", DirectoryService), instance="kvdirectory", stop_event=stops[0])),
        asyncio.create_task(serve_until_stopped("worker", wcfg, keep("w0", WorkerService), instance="worker-w0", stop_event=stops[1])),
    ]
    client = await Bus.connect(url, Subjects("p0"), service="test", instance="test")
    try:
        for inst in ("kvdirectory", "worker-w0"):
            await answering(client, inst, tasks)  # ready once svc.stats answers (after start())
        yield client, made["dir"], made["w0"]
    finally:
        for s in stops:
            s.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await client.close()


def directory_counts(d: DirectoryService) -> dict[int, int]:
    """R[·, w0] > 0 now (pending changes included; the core's own snapshot wants them taken first)."""
    return {h: d.core.count("w0", h) for h in range(0, 2000) if d.core.count("w0", h)}


def worker_counted(w: WorkerService) -> set[int]:
    """Blocks whose last count on the worker is > 0 (the branch-count L2 pool's record)."""
    return set(w.core.kv.host.counted)


async def place(c: Bus, branch: str, path: list[int], *, start: bool = True) -> None:
    if start:
        await c.publish(BRANCH_EVENTS, m.BranchStart(branch_id=branch))
    await c.publish(ROUTE_PLACED, m.RoutePlaced(rid=f"r-{branch}", branch_id=branch, node="w0", phase="prefill", block_hashes=path))


A, B, C = [101, 102, 103], [201, 202], [301, 302, 303, 304]


async def test_a_lost_count_message_is_seen_as_a_gap_and_the_counts_come_back(nats_url):
    async with cluster(nats_url, worker={"fault_drop_counts": [2]}) as (c, d, w):
        await place(c, "a", A)
        await until(lambda: w.counts.last == 1, what="message 1 applied")
        assert worker_counted(w) == set(A)
        await place(c, "b", B)  # message 2: lost on the way
        await until(lambda: w.counters["counts.fault_dropped"] == 1, what="message 2 dropped")
        assert worker_counted(w) == set(A) and directory_counts(d) == {h: 1 for h in A + B}  # stale: B's counts missing
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a"))  # message 3 shows the gap
        await until(lambda: w.counts.counters["syncs"] >= 1 and not w.counts.syncing, what="counts synced")
        assert worker_counted(w) == set(directory_counts(d)) == set(B)
        await place(c, "c", C)  # later messages apply as usual
        await until(lambda: worker_counted(w) == set(B + C), what="message after the sync applied")
        assert worker_counted(w) == set(directory_counts(d))
        ws = await c.request(SVC_STATS, m.StatsRequest(), instance="worker-w0")
        ds = await c.request(SVC_STATS, m.StatsRequest(), instance="kvdirectory")
        assert ws.counters["counts.gap"] == 1 and ws.counters["counts.syncs"] == 1 and ws.gauges["counts.syncing"] == 0
        assert ws.counters.get("counts.sync.failures", 0) == 0 and not any(k.startswith("handler_errors") for k in ws.counters)
        assert ds.counters["countsync.snapshots"] == 1 and ds.counters["countsync.entries"] == len(B)


async def test_a_skipped_seq_on_the_bus_syncs_and_the_forged_message_is_dropped(nats_url):
    async with cluster(nats_url) as (c, d, w):
        await place(c, "a", A)
        await place(c, "b", B)
        await until(lambda: worker_counted(w) == set(A + B), what="counts applied")
        last, epoch = w.counts.last, w.counts.epoch
        assert last >= 1 and epoch == d.count_epoch
        # a message numbered past the directory's: its own numbers are below, so it is not applied
        await c.publish(KV_COUNTS, m.CountUpdates(node="w0", seq=last + 5, epoch=epoch, hashes=[999], counts=[3]), node="w0")
        await until(lambda: w.counts.counters["syncs"] >= 1 and not w.counts.syncing, what="counts synced")
        assert w.counts.counters["gap"] == 1 and w.counts.counters["sync.beyond_snapshot"] == 1 and w.counts.last == last
        assert 999 not in worker_counted(w) and worker_counted(w) == set(directory_counts(d)) == set(A + B)
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a"))  # the directory's next number applies
        await until(lambda: worker_counted(w) == set(B), what="the directory's next message applied")
        assert w.counts.last == last + 1 and w.counts.counters["gap"] == 1


async def test_a_large_node_snapshot_comes_in_pieces(nats_url):
    """``--count-sync-piece 3``: the worker fetches the snapshot in pieces of a kept snapshot."""
    big = list(range(1000, 1011))
    async with cluster(nats_url, directory={"count_sync_piece": 3}, worker={"fault_drop_counts": [2]}) as (c, d, w):
        await place(c, "a", A)
        await until(lambda: w.counts.last == 1, what="message 1 applied")
        await place(c, "big", big)  # message 2: lost
        await until(lambda: w.counters["counts.fault_dropped"] == 1, what="message 2 dropped")
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a"))
        await until(lambda: w.counts.counters["syncs"] >= 1 and not w.counts.syncing, what="counts synced")
        assert worker_counted(w) == set(big) == set(directory_counts(d))
        assert w.counters["counts.sync.pieces"] == 4 and d.counters["countsync.pieces"] == 4 and not d._count_snaps
        # a piece of a snapshot the directory no longer keeps is refused with a reason
        gone = await c.request(KV_COUNT_SYNC, m.CountSyncRequest(node="w0", snapshot="nope", offset=3), timeout=2.0, node="w0")
        assert gone.error and gone.hashes == [] and d.counters["countsync.snapshot_gone"] == 1


async def test_a_worker_asking_faster_than_the_directory_allows_is_refused_and_still_converges(nats_url):
    """The directory takes a new snapshot of w0 at most every 0.6 s; this worker would ask every
    0.05 s. Two gaps in a row: the second sync's first request is refused (``error``), the worker
    backs off and asks again until the interval has passed, then applies the snapshot."""
    async with cluster(nats_url, directory={"count_sync_min_interval_s": 0.6},
                       worker={"fault_drop_counts": [2, 4], "count_sync_min_interval_s": 0.05}) as (c, d, w):  # fmt: skip
        await place(c, "a", A)
        await until(lambda: w.counts.last == 1, what="message 1 applied")
        await place(c, "b", B)  # 2: lost
        await until(lambda: w.counters["counts.fault_dropped"] == 1, what="message 2 dropped")
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a"))  # 3: the gap
        await until(lambda: w.counts.counters["syncs"] == 1 and not w.counts.syncing, what="first sync")
        t0 = time.monotonic()
        await place(c, "c", C)  # 4: lost
        await until(lambda: w.counters["counts.fault_dropped"] == 2, what="message 4 dropped")
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="b"))  # 5: the gap, within 0.6 s of the first snapshot
        await until(lambda: w.counts.counters["syncs"] == 2 and not w.counts.syncing, what="second sync")
        assert time.monotonic() - t0 < 3.0
        assert worker_counted(w) == set(directory_counts(d)) == set(C)
        assert d.counters["countsync.rate_limited"] >= 1 and d.counters["countsync.snapshots"] == 2
        assert w.counters["counts.sync.bad_reply"] == d.counters["countsync.rate_limited"] == w.counters["counts.sync.failures"]


async def test_a_well_behaved_worker_is_never_refused_by_the_rate_limit(nats_url):
    """Defaults (the directory: a new snapshot of a node per 0.5 s; the worker: one per 1 s):
    two gaps in a row make the worker wait for its own limit, and the directory refuses none."""
    async with cluster(nats_url, worker={"fault_drop_counts": [2, 4]}) as (c, d, w):
        await place(c, "a", A)
        await until(lambda: w.counts.last == 1, what="message 1 applied")
        await place(c, "b", B)
        await until(lambda: w.counters["counts.fault_dropped"] == 1, what="message 2 dropped")
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a"))
        await until(lambda: w.counts.counters["syncs"] == 1 and not w.counts.syncing, what="first sync")
        await place(c, "c", C)
        await until(lambda: w.counters["counts.fault_dropped"] == 2, what="message 4 dropped")
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="b"))
        await until(lambda: w.counts.counters["syncs"] == 2 and not w.counts.syncing, what="second sync")
        assert worker_counted(w) == set(directory_counts(d)) == set(C)
        assert w.counters["counts.sync.rate_limited"] >= 1  # the worker's own limit held the second sync back
        assert d.counters.get("countsync.rate_limited", 0) == 0 and w.counters.get("counts.sync.failures", 0) == 0


@pytest.mark.timeout(90)
async def test_a_worker_that_reconnects_to_nats_syncs_its_counts(nats_server):
    """A NATS server SIGKILL and restart: a ``kv.counts`` message sent meanwhile may be lost with
    no later one to show it, so a reconnected worker asks for its counts once."""
    import os
    import signal

    async with cluster(nats_server.url) as (c, d, w):
        await place(c, "a", A)
        await until(lambda: worker_counted(w) == set(A), what="counts applied")
        os.kill(nats_server.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)
        d.core.branch_end("a", d.clock.now())  # the release goes out while the server is down
        with contextlib.suppress(Exception):
            await d.flush_counts()
        nats_server.restart()
        await until(lambda: w.counts.counters["sync.started.reconnect"] >= 1, timeout=30, what="the reconnected worker asks")
        await until(lambda: w.counts.counters["syncs"] >= 1 and not w.counts.syncing, timeout=30, what="counts synced")
        assert worker_counted(w) == set(directory_counts(d)) == set()


@pytest.mark.parametrize("last", ["placement", "release"])
async def test_a_lost_last_message_is_revealed_by_the_seq_beacon(nats_url, last):
    """The node's last count message is lost and none follows (the branch stays where it is, or
    its release was the last change): only the directory's seq beacon (``--count-seq-beacon-s``,
    0.2 s here) shows it; the worker syncs within a few periods and then stays synced."""
    period = 0.2
    async with cluster(nats_url, directory={"count_seq_beacon_s": period}, worker={"fault_drop_counts": [2]}) as (c, d, w):
        await place(c, "a", A)
        await until(lambda: w.counts.last == 1, what="message 1 applied")
        if last == "placement":
            await place(c, "b", B)  # message 2, lost: B stays uncounted on the worker
        else:
            await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a"))  # message 2, lost: A stays counted
        await until(lambda: w.counters["counts.fault_dropped"] == 1, what="message 2 dropped")
        want = set(directory_counts(d))
        assert want != set(A)
        if not w.counts.counters["syncs"]:  # (a beacon may already have come and fixed it)
            assert worker_counted(w) == set(A) and w.counts.last == 1 and not w.counts.syncing
        await until(lambda: w.counts.counters["syncs"] >= 1 and not w.counts.syncing, timeout=10 * period, what="beacon-driven sync")
        assert worker_counted(w) == want == set(directory_counts(d)) and w.counts.last == 2
        assert w.counts.counters["gap"] == 1 and w.counts.counters["gap.beacon"] == 1, dict(w.counts.counters)
        beacons = d.counters["counts.beacons"]
        await until(lambda: d.counters["counts.beacons"] >= beacons + 3, timeout=10 * period, what="three more beacons")
        ws = await c.request(SVC_STATS, m.StatsRequest(), instance="worker-w0")
        assert ws.counters["counts.syncs"] == 1 and ws.counters["counts.gap.beacon"] == 1 and ws.counters["counts.beacon"] >= 3
        assert d.counters["countsync.snapshots"] == 1 and not d.counters["counts.beacon_errors"]


async def test_without_a_loss_the_seq_beacon_starts_no_sync(nats_url):
    """Beacons every 20 ms racing a flush on every count change (``--counts-flush-updates 1``)
    over a burst of placements and releases: no beacon overtakes its message (no gap, no sync)."""
    async with cluster(nats_url, directory={"count_seq_beacon_s": 0.02, "counts_flush_updates": 1}) as (c, d, w):
        for i in range(60):
            await place(c, f"b{i}", [500 + 3 * i, 501 + 3 * i, 502 + 3 * i])
            if i % 3 == 2:
                await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=f"b{i - 1}"))
            if i % 10 == 9:
                await asyncio.sleep(0.03)  # let beacons in between the bursts
        await until(lambda: w.counts.last > 0 and w.counts.last == d.core.count_seqs().get("w0"), what="every message applied")
        beacons = d.counters["counts.beacons"]
        await until(lambda: d.counters["counts.beacons"] >= beacons + 5 and w.counts.counters["beacon"] >= 10, what="beacons")
        assert worker_counted(w) == set(directory_counts(d)) and len(worker_counted(w)) == 3 * 40
        ws = await c.request(SVC_STATS, m.StatsRequest(), instance="worker-w0")
        assert ws.counters.get("counts.gap", 0) == 0 and ws.counters.get("counts.syncs", 0) == 0, ws.counters
        assert ws.counters.get("counts.stale", 0) == 0 and ws.counters["counts.beacon"] >= 10


# --------------------------------------------------------------------------- #
# the worker's sync against a scripted directory (the test serves kv.countsync itself)
async def test_one_forged_epoch_message_does_not_cut_the_worker_off_from_the_directory(nats_url):
    """A single ``kv.counts`` message with a forged epoch (anyone allowed to publish there can send
    one) is taken for a directory restart: the worker resets, retires the real epoch and syncs. The
    real directory answers the sync: its snapshot is adopted (the reply to the worker's own request
    comes from the live responder), and its later messages apply again. On main the snapshot and
    every later message of the real epoch were dropped as of a retired epoch, and the worker asked
    for a snapshot every few seconds for good."""
    async with cluster(nats_url) as (c, d, w):
        await place(c, "a", A)
        await place(c, "b", B)
        await until(lambda: worker_counted(w) == set(A + B), what="counts applied")
        await c.publish(KV_COUNTS, m.CountUpdates(node="w0", seq=5, epoch="forged-1"), node="w0")
        await until(lambda: w.counts.counters["directory_restarts"] == 1, what="the forged epoch taken")
        await place(c, "c", C)  # the real directory's next messages
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a"))
        await until(lambda: w.counts.epoch == d.count_epoch and not w.counts.syncing and worker_counted(w) == set(B + C),
                    timeout=8, what="back on the real directory's counts")  # fmt: skip
        assert worker_counted(w) == set(directory_counts(d)) and list(w.counts.retired) == ["forged-1"]
        await place(c, "d", [401, 402])  # and its numbering goes on
        await until(lambda: worker_counted(w) == set(B + C + [401, 402]), what="the directory's next message applied")
        assert worker_counted(w) == set(directory_counts(d))
        assert w.counts.counters["sync.epoch_restored"] == 1 and w.counts.counters["syncs"] <= 2
        assert not w.counters.get("counts.sync.failures")


# --------------------------------------------------------------------------- #


@asynccontextmanager
async def lone_worker(url: str, **worker: Any) -> AsyncIterator[tuple[Bus, WorkerService, asyncio.Event]]:
    """Worker ``w0`` alone (no directory process); yields a client bus, the service and its stop event."""
    made: dict[str, Any] = {}
    wcfg = WorkerConfig(nats_url=url, node="w0", profile="tiny", idle_state_interval_s=0.2, check_invariants=True,
                        **{"host_eviction": "branch-count", **worker})  # fmt: skip

    def factory(cfg: Any, bus: Bus, clock: Any) -> Any:
        made["w0"] = WorkerService(cfg, bus, clock)
        return made["w0"]

    stop = asyncio.Event()
    task = asyncio.create_task(serve_until_stopped("worker", wcfg, factory, instance="worker-w0", stop_event=stop))
    client = await Bus.connect(url, Subjects("p0"), service="test", instance="test")
    try:
        await answering(client, "worker-w0", [task])
        yield client, made["w0"], stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.close()


def prom(w: WorkerService, family: str) -> float:
    """The value of one of the worker's Prometheus counters (node w0)."""
    (f,) = [f for f in worker_families(w) if f.name == family]
    return sum(x.value for x in f.samples if x.name == family + "_total")


def counts(node: str, epoch: str, seq: int, hashes: list[int], cnts: list[int]) -> m.CountUpdates:
    return m.CountUpdates(node=node, seq=seq, epoch=epoch, hashes=hashes, counts=cnts)


async def test_messages_arriving_while_the_sync_awaits_its_pieces_apply_after_the_snapshot(nats_url):
    """The directory goes on numbering while the worker fetches a snapshot in pieces: messages up to
    the snapshot's seq are dropped, the later ones (sent between the pieces) apply after it."""
    async with lone_worker(nats_url) as (c, w, _):
        snap = ([11, 12, 13, 14], [1, 1, 2, 1])

        async def directory(req: m.CountSyncRequest, _s: str) -> m.CountSnapshot:
            if not req.snapshot:  # the snapshot is after message 3; 3 goes out before the reply
                await c.publish(KV_COUNTS, counts("w0", "e1", 3, [13], [2]), node="w0")
                return m.CountSnapshot(node="w0", epoch="e1", seq=3, snapshot="s1", total=4, hashes=snap[0][:2], counts=snap[1][:2])
            await c.publish(KV_COUNTS, counts("w0", "e1", 4, [12, 15], [0, 1]), node="w0")  # while the pieces come
            await c.publish(KV_COUNTS, counts("w0", "e1", 5, [16], [1]), node="w0")
            await asyncio.sleep(0.05)  # (they are kept before the last piece is applied)
            return m.CountSnapshot(node="w0", epoch="e1", seq=3, snapshot="s1", offset=2, total=4, hashes=snap[0][2:], counts=snap[1][2:])

        await c.serve(KV_COUNT_SYNC, directory, node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e1", 1, [11], [1]), node="w0")
        await until(lambda: w.counts.last == 1, what="message 1 applied")
        await c.publish(KV_COUNTS, counts("w0", "e1", 3, [13], [2]), node="w0")  # 2 lost: a gap
        await until(lambda: w.counts.counters["syncs"] >= 1 and not w.counts.syncing, what="counts synced")
        assert w.counts.last == 5 and worker_counted(w) == {11, 13, 14, 15, 16}
        assert w.counts.counters["sync.applied_after"] == 2 and w.counters["counts.sync.pieces"] == 2
        assert not w.counts.kept and not w.counters.get("task_errors")


async def test_a_reply_for_another_node_or_a_refused_piece_is_dropped_and_the_sync_asks_again(nats_url):
    async with lone_worker(nats_url, count_sync_min_interval_s=0.05) as (c, w, _):
        replies = [
            m.CountSnapshot(node="w1", epoch="e1", seq=2, snapshot="x", total=1, hashes=[21], counts=[1]),  # another node's
            m.CountSnapshot(node="w0", epoch="e1", seq=2, snapshot="s1", total=2, hashes=[22], counts=[1]),
            m.CountSnapshot(node="w0", epoch="e1", snapshot="s1", error="count snapshot gone"),  # its second piece refused
            m.CountSnapshot(node="w0", epoch="e1", seq=2, snapshot="s2", total=1, hashes=[23], counts=[1]),
        ]

        async def directory(req: m.CountSyncRequest, _s: str) -> m.CountSnapshot:
            return replies.pop(0)

        await c.serve(KV_COUNT_SYNC, directory, node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e1", 2, [20], [1]), node="w0")  # first contact past 1
        await until(lambda: w.counts.counters["syncs"] >= 1 and not w.counts.syncing, what="counts synced")
        assert worker_counted(w) == {23} and w.counts.last == 2 and not replies
        assert w.counters["counts.sync.bad_reply"] == 2 and w.counters["counts.sync.failures"] == 2


async def test_a_directory_restart_mid_sync_ends_the_old_sync(nats_url):
    """The directory restarts between two pieces: the piece is refused, the new process's first
    message resets the counts and is applied, and the old sync ends without asking again."""
    async with lone_worker(nats_url, count_sync_min_interval_s=0.05) as (c, w, _):
        asked: list[m.CountSyncRequest] = []

        async def directory(req: m.CountSyncRequest, _s: str) -> m.CountSnapshot:
            asked.append(req)
            if not req.snapshot:
                return m.CountSnapshot(node="w0", epoch="e1", seq=2, snapshot="s1", total=2, hashes=[31], counts=[1])
            await c.publish(KV_COUNTS, counts("w0", "e2", 1, [41], [1]), node="w0")  # the new process
            await asyncio.sleep(0.05)
            return m.CountSnapshot(node="w0", epoch="e2", snapshot="s1", error="count snapshot gone")

        await c.serve(KV_COUNT_SYNC, directory, node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e1", 2, [30], [1]), node="w0")
        await until(lambda: w.counts.epoch == "e2" and w.counters["counts.sync.bad_reply"] == 1, what="the restart seen")
        await asyncio.sleep(0.3)
        assert not w.counts.syncing and w.counts.last == 1 and worker_counted(w) == {41} and len(asked) == 2
        assert w.counts.counters["sync.abandoned"] == 1 and not w.counters.get("task_errors")


async def test_a_worker_stopped_mid_sync_cancels_the_sync_cleanly(nats_url):
    """The directory holds the request (no reply before the worker's 5-s timeout); the worker
    stops meanwhile: the stop does not wait for the timeout and leaves no sync task pending."""
    release = asyncio.Event()
    async with lone_worker(nats_url, count_sync_timeout_s=5.0) as (c, w, stop):

        async def directory(req: m.CountSyncRequest, _s: str) -> m.CountSnapshot | None:
            await asyncio.wait_for(release.wait(), 10)
            return None

        await c.serve(KV_COUNT_SYNC, directory, node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e1", 3, [1], [1]), node="w0")
        await until(lambda: w.counters["counts.sync.pieces"] == 0 and w.counts.syncing and w._count_sync_task is not None, what="sync asked")
        await asyncio.sleep(0.1)
        task = w._count_sync_task
        t0 = time.monotonic()
        stop.set()
        await until(lambda: task.done(), timeout=3, what="the sync task ended")
        assert time.monotonic() - t0 < 2.5 and task.cancelled()
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "worker-w0-countsync" and not t.done()]
        release.set()


async def test_while_no_directory_answers_kv_countsync_later_messages_still_apply(nats_url):
    """A sync that cannot complete (no responder on ``kv.countsync``: a directory that predates it,
    a permission missing, a directory too busy to answer) must not freeze the node's counts: the
    messages after the gap apply as they come (only the lost one's blocks stay stale, as before
    the sync existed), and the sync keeps asking."""
    async with lone_worker(nats_url, count_sync_min_interval_s=0.05, count_sync_backoff_max_s=0.1) as (c, w, _):
        await c.publish(KV_COUNTS, counts("w0", "e1", 1, [1, 2], [1, 1]), node="w0")
        await until(lambda: w.counts.last == 1, what="message 1 applied")
        for q, (hashes, cnts) in enumerate([([3], [1]), ([1, 4], [0, 1]), ([5], [2])], start=3):  # 2 lost
            await c.publish(KV_COUNTS, counts("w0", "e1", q, hashes, cnts), node="w0")
        await until(lambda: worker_counted(w) == {2, 3, 4, 5}, timeout=3, what="the messages after the gap applied")
        await until(lambda: w.counters["counts.sync.failures"] >= 3, what="the sync still asking")
        assert w.counts.syncing and sorted(w.counts.kept) == [3, 4, 5]


async def test_a_snapshot_too_large_to_fetch_is_asked_once_and_later_messages_still_apply(nats_url):
    """The directory's snapshot of w0 announces more entries than a worker fetches: the worker
    asks once, counts it, stops syncing in that epoch (no retry loop), and applies what comes."""
    async with lone_worker(nats_url, count_sync_min_interval_s=0.05, count_sync_backoff_max_s=0.1) as (c, w, _):
        asked: list[m.CountSyncRequest] = []

        async def directory(req: m.CountSyncRequest, _s: str) -> m.CountSnapshot:
            asked.append(req)
            return m.CountSnapshot(node="w0", epoch="e1", seq=3, snapshot="s1", total=SNAPSHOT_MAX_ENTRIES + 1, hashes=[11], counts=[1])

        await c.serve(KV_COUNT_SYNC, directory, node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e1", 1, [1], [1]), node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e1", 3, [3], [1]), node="w0")  # 2 lost: a gap
        await until(lambda: w.counts.counters["sync.too_large"] == 1, what="the snapshot refused")
        await c.publish(KV_COUNTS, counts("w0", "e1", 4, [4], [1]), node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e1", 6, [6], [1]), node="w0")  # another gap: no sync now
        await until(lambda: w.counts.last == 6, what="later messages applied")
        await asyncio.sleep(0.3)
        assert len(asked) == 1 and not w.counts.syncing and worker_counted(w) == {1, 3, 4, 6}
        assert w.counts.counters["sync.unsynced"] == 1 and w.counts.counters.get("syncs", 0) == 0
        assert w.counters.get("counts.sync.failures", 0) == 0 and not w.counters.get("task_errors")
        assert prom(w, "ei_node_count_sync_too_large") == 1


async def test_a_late_message_of_the_directorys_previous_epoch_is_dropped(nats_url):
    """The directory restarted (e1 → e2); a message of e1 delayed past e2's first one must not be
    taken for another restart: no reset. It costs one sync (e2 came by a message only, which anyone
    can forge, ``CountStream.claimed``): e2's snapshot settles it, and the late beacon after it costs
    nothing."""
    async with lone_worker(nats_url) as (c, w, _):
        asked: list[m.CountSyncRequest] = []

        async def directory(req: m.CountSyncRequest, _s: str) -> m.CountSnapshot:
            asked.append(req)
            return m.CountSnapshot(node="w0", epoch="e2", seq=1, snapshot="s", total=1, hashes=[2], counts=[1])

        await c.serve(KV_COUNT_SYNC, directory, node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e1", 1, [1], [1]), node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e2", 1, [2], [1]), node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e1", 2, [9], [1]), node="w0")  # late, from the old process
        await until(lambda: w.counts.counters["syncs"] == 1, what="the one sync")
        await c.publish(KV_COUNTS, m.CountUpdates(node="w0", seq=5, epoch="e1", beacon=True), node="w0")
        await c.publish(KV_COUNTS, counts("w0", "e2", 2, [3], [1]), node="w0")
        await until(lambda: w.counts.last == 2 and w.counts.epoch == "e2", what="e2's messages applied")
        await asyncio.sleep(0.2)
        assert worker_counted(w) == {2, 3} and not w.counts.syncing and [r.reason for r in asked] == ["retired epoch"]
        assert w.counts.counters["stale_epoch"] == 2 and w.counts.counters["directory_restarts"] == 1
        assert prom(w, "ei_node_count_stale_epoch") == 2


async def test_a_worker_under_lru_eviction_reads_no_counts_and_never_syncs(nats_url):
    """``lru`` ignores branch counts: the worker does not subscribe to ``kv.counts.<node>``, so a
    gap, a beacon or a reconnect there start no ``kv.countsync``."""
    async with lone_worker(nats_url, host_eviction="lru", count_sync_min_interval_s=0.05) as (c, w, _):
        asked: list[m.CountSyncRequest] = []

        async def directory(req: m.CountSyncRequest, _s: str) -> m.CountSnapshot:
            asked.append(req)
            return m.CountSnapshot(node="w0", epoch="e1", seq=3, snapshot="s", total=0)

        await c.serve(KV_COUNT_SYNC, directory, node="w0")
        for msg in (counts("w0", "e1", 1, [1], [1]), counts("w0", "e1", 3, [3], [1]), m.CountUpdates(node="w0", seq=9, epoch="e1", beacon=True)):
            await c.publish(KV_COUNTS, msg, node="w0")
        await c.nc.flush()
        await asyncio.sleep(0.3)
        ws = await c.request(SVC_STATS, m.StatsRequest(), instance="worker-w0")
        assert not asked and w.counts.epoch is None and not w.counts.counters and w._count_sync_task is None
        assert ws.gauges["counts.subscribed"] == 0 and not any(k.startswith(("counts.", "dropped.kv.counts")) for k in ws.counters)
