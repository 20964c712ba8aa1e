"""The KV directory service over a real nats-server (in-process service, real bus)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from services.kvdirectory.config import DirectoryConfig
from services.kvdirectory.service import DirectoryService
from shared import messages as m
from shared.bus import Bus
from shared.clock import SimClock
from shared.service import serve_until_stopped
from shared.subjects import (
    BRANCH_EVENTS,
    KV_COUNTS,
    KV_EVENTS,
    KV_LIVENESS,
    KV_LOOKUP,
    KV_RESYNC,
    NODE_STATE,
    ROUTE_PLACED,
    SPLIT_APPLIED,
    SVC_STATS,
    Subjects,
)

BS = 64
PATH = [101, 102, 103, 104, 105, 106]


@asynccontextmanager
async def running_directory(nats_url: str, *, clock: SimClock | None = None, **over) -> AsyncIterator[Bus]:
    """Start the service in-process (``clock``: its clock instead of the one the shell makes);
    yield a client bus; stop and drain on exit."""
    cfg = DirectoryConfig(nats_url=nats_url, block_size=BS, resync_timeout_s=0.5, counts_flush_s=0.02, **over)
    stop = asyncio.Event()
    factory = DirectoryService if clock is None else (lambda c, b, _made: DirectoryService(c, b, clock))
    task = asyncio.create_task(serve_until_stopped("kvdirectory", cfg, factory, instance="kvdirectory", stop_event=stop))
    client = await Bus.connect(nats_url, Subjects(cfg.partition), service="test", instance="test")
    try:
        for _ in range(100):  # until the service answers its stats subject
            try:
                await client.request(SVC_STATS, m.StatsRequest(), timeout=0.2, instance="kvdirectory")
                break
            except Exception:
                if task.done():
                    task.result()
                await asyncio.sleep(0.05)
        yield client
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.close()


async def stats(client: Bus) -> m.StatsReply:
    return await client.request(SVC_STATS, m.StatsRequest(), timeout=2.0, instance="kvdirectory")


async def eventually(check: Callable[[], object], timeout: float = 5.0) -> None:
    """Await until ``check()`` (sync or async) returns truthy."""
    end = asyncio.get_running_loop().time() + timeout
    while True:
        r = check()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return
        if asyncio.get_running_loop().time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def lookup(client: Bus, path: list[int], block_size: int = BS) -> m.KvLookupReply:
    return await client.request(KV_LOOKUP, m.KvLookupRequest(block_hashes=path, block_size=block_size), timeout=2.0)


def stored(hashes, tier="gpu", parent=None, size=BS) -> m.BlockStored:
    return m.BlockStored(block_hashes=hashes, parent_block_hash=parent, tier=tier, block_size=size)


async def test_events_reach_lookups_and_evictions_show(nats_url):
    async with running_directory(nats_url) as c:
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=1, events=[stored(PATH), stored(PATH[:4], "host")]), node="w0")
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w1", seq=1, events=[stored(PATH[:2], "host")]), node="w1")

        async def full():
            r = await lookup(c, PATH)
            return r.longest_any == 6 and len(r.nodes) == 2

        await eventually(full)
        r = await lookup(c, PATH)
        by = {p.node: p for p in r.nodes}
        assert (by["w0"].gpu_blocks, by["w0"].host_blocks, by["w0"].local_blocks) == (6, 4, 6)
        assert (by["w1"].gpu_blocks, by["w1"].host_blocks, by["w1"].local_blocks) == (0, 2, 2)
        assert r.sources[0] == m.FetchRange(node="w0", start=0, end=4, tier="host")
        # w0 evicts the tail from GPU: its GPU prefix shrinks, host prefix stays
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=2, events=[m.BlockRemoved(block_hashes=PATH[4:])]), node="w0")

        async def evicted():
            r = await lookup(c, PATH)
            return r.longest_any == 4

        await eventually(evicted)
        r = await lookup(c, PATH)
        assert {p.node: p.gpu_blocks for p in r.nodes} == {"w0": 4, "w1": 0}


async def test_gap_triggers_resync_and_snapshot_is_applied(nats_url):
    async with running_directory(nats_url) as c:
        asked: list[m.KvResyncRequest] = []
        fail_first = {"left": 1}

        async def answer(req: m.KvResyncRequest, subject: str) -> m.KvSnapshot | None:
            asked.append(req)
            if fail_first["left"]:  # the first request times out: the service must retry
                fail_first["left"] -= 1
                return None
            return m.KvSnapshot(node="w2", seq=5, block_size=BS, host=PATH, host_parents=[None] + PATH[:-1])

        await c.serve(KV_RESYNC, answer, node="w2")
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w2", seq=1, events=[stored(PATH[:1])]), node="w2")
        # seq 2..4 lost; 5 arrives: the directory must ask w2 for a snapshot
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w2", seq=5, events=[stored(PATH[:1], "host")]), node="w2")
        await eventually(lambda: len(asked) >= 2)
        assert asked[0].node == "w2" and asked[0].expected_seq == 2

        async def resynced():
            r = await lookup(c, PATH)
            return r.longest_any == 6

        await eventually(resynced)
        r = await lookup(c, PATH)
        assert r.nodes[0].node == "w2" and r.nodes[0].host_blocks == 6
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w2", seq=6, events=[m.BlockRemoved(block_hashes=PATH[3:], tier="host")]), node="w2")

        async def applied_after():
            return (await lookup(c, PATH)).longest_any == 3

        await eventually(applied_after)
        s = await stats(c)
        assert s.counters["kv.gaps"] == 1 and s.counters["kv.resyncs"] == 1
        assert s.counters["resync.failures"] >= 1
        assert s.gauges["nodes.awaiting_resync"] == 0


async def test_malformed_payloads_are_counted_and_service_keeps_serving(nats_url):
    async with running_directory(nats_url) as c:
        subj = c.subjects
        targets = {
            KV_EVENTS.template: subj.format(KV_EVENTS, node="w0"),
            BRANCH_EVENTS.template: subj.format(BRANCH_EVENTS),
            ROUTE_PLACED.template: subj.format(ROUTE_PLACED),
            SPLIT_APPLIED.template: subj.format(SPLIT_APPLIED),
            KV_LOOKUP.template: subj.format(KV_LOOKUP),
        }
        for full in targets.values():
            await c.publish_raw(full, b"\xc1 not msgpack")
            await c.publish_raw(full, m.encode(m.StatsRequest()))  # valid msgpack, wrong schema
        await c.flush()

        async def counted():
            s = await stats(c)
            return all(s.counters.get(f"dropped.{t}", 0) >= 1 for t in targets)

        await eventually(counted)
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=1, events=[stored(PATH)]), node="w0")

        async def still_serving():
            return (await lookup(c, PATH)).longest_any == 6

        await eventually(still_serving)


async def test_block_size_mismatch_is_rejected_loudly(nats_url):
    async with running_directory(nats_url) as c:
        await c.publish(
            KV_EVENTS,
            m.KvEventBatch(node="w0", seq=1, events=[stored(PATH, size=32), stored(PATH[:2])]),
            node="w0",
        )

        async def counted():
            s = await stats(c)
            return s.counters.get("kv.block_size_mismatch", 0) == 1

        await eventually(counted)
        r = await lookup(c, PATH)
        assert r.longest_any == 2  # the foreign-size event was not applied, the rest was
        bad = await lookup(c, PATH, block_size=16)
        assert bad.error and "block size" in bad.error and bad.nodes == []
        s = await stats(c)
        assert s.counters["lookup.block_size_mismatch"] == 1


async def test_counts_are_pushed_to_workers_and_follow_branch_events(nats_url):
    async with running_directory(nats_url) as c:
        got: dict[str, dict[int, int]] = {"w0": {}, "w1": {}}

        async def on_counts(cu: m.CountUpdates, subject: str) -> None:
            got[cu.node].update(zip(cu.hashes, cu.counts))

        await c.subscribe(KV_COUNTS, on_counts)
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w1", seq=1, events=[stored(PATH[:3], "host")]), node="w1")
        await c.publish(BRANCH_EVENTS, m.BranchStart(branch_id="a1"))
        await asyncio.sleep(0.05)
        await c.publish(ROUTE_PLACED, m.RoutePlaced(rid="r1", branch_id="a1", node="w0", phase="prefill", block_hashes=PATH[:3]))
        await c.publish(ROUTE_PLACED, m.RoutePlaced(rid="r1", branch_id="a1", node="w1", phase="decode", block_hashes=PATH[:3]))
        await eventually(lambda: got["w0"].get(101) == 1 and got["w1"].get(103) == 1)
        # w1 switches D→P: its counts reset
        await c.publish(SPLIT_APPLIED, m.SplitApplied(epoch=1, node="w1", phase="prefill", status="serving"))
        await eventually(lambda: got["w1"].get(103) == 0)
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a1"))
        await eventually(lambda: all(v == 0 for v in got["w0"].values()))
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a1"))  # duplicate end: counted, nothing applied

        async def dup_counted():
            return (await stats(c)).counters.get("branch.duplicate_end", 0) == 1

        await eventually(dup_counted)


async def test_a_routers_eviction_of_a_branch_expires_it_in_the_directory_service(nats_url):
    """BranchEnd(expired=True) (a router's --max-active-branches evicted the branch) through the service's
    handler: an eviction naming another request than the branch's latest placement is ignored
    (``branch.stale_evict``), one naming it releases the branch's counts (``branch.evicted``)."""
    async with running_directory(nats_url) as c:
        got: dict[int, int] = {}

        async def on_counts(cu: m.CountUpdates, subject: str) -> None:
            got.update(zip(cu.hashes, cu.counts))

        await c.subscribe(KV_COUNTS, on_counts)
        await c.publish(BRANCH_EVENTS, m.BranchStart(branch_id="a1"))
        await asyncio.sleep(0.05)
        await c.publish(ROUTE_PLACED, m.RoutePlaced(rid="r1", branch_id="a1", node="w0", phase="prefill", block_hashes=PATH[:3]))
        await eventually(lambda: got.get(101) == 1)

        async def counted(key: str) -> bool:
            return (await stats(c)).counters.get(key, 0) == 1

        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a1", expired=True, rid="r0"))  # another router's view
        await eventually(lambda: counted("branch.stale_evict"))
        assert got.get(101) == 1
        await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a1", expired=True, rid="r1"))
        await eventually(lambda: counted("branch.evicted"))
        await eventually(lambda: got.get(101) == 0)


async def test_each_directory_process_stamps_its_counts_with_its_own_epoch(nats_url):
    """A restarted directory starts from empty counts and sends only changes; its messages carry
    a new ``epoch`` so workers reset the counts the old process set (worker: ``reset_counts``)."""
    epochs: list[set[str]] = []
    for _ in range(2):  # the same directory started twice
        async with running_directory(nats_url) as c:
            seen: set[str] = set()

            async def on_counts(cu: m.CountUpdates, subject: str) -> None:
                seen.add(cu.epoch)

            await c.subscribe(KV_COUNTS, on_counts)
            await c.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=1, events=[stored(PATH[:3], "host")]), node="w0")
            await c.publish(BRANCH_EVENTS, m.BranchStart(branch_id="a1"))
            await asyncio.sleep(0.05)
            await c.publish(ROUTE_PLACED, m.RoutePlaced(rid="r1", branch_id="a1", node="w0", phase="prefill", block_hashes=PATH[:3]))
            await eventually(lambda: len(seen) >= 1)
            await c.publish(BRANCH_EVENTS, m.BranchEnd(branch_id="a1"))  # the release: a second message
            await asyncio.sleep(0.2)
            epochs.append(set(seen))
    assert [len(e) for e in epochs] == [1, 1] and all(e and "" not in e for e in epochs)
    assert epochs[0] != epochs[1]


async def test_a_node_is_told_the_count_epoch_on_its_first_state(nats_url):
    """An empty ``kv.counts`` with the process's epoch on a node's first ``node.state``: a worker
    holding counts of a directory that died resets them at once, even if no count of it changes."""
    async with running_directory(nats_url) as c:
        got: list[m.CountUpdates] = []

        async def on_counts(cu: m.CountUpdates, subject: str) -> None:
            got.append(cu)

        await c.subscribe(KV_COUNTS, on_counts)
        for _ in range(3):  # repeated states: told once
            await c.publish(NODE_STATE, m.NodeState(node="w0", phase="both", ts=1.0), node="w0")
        await eventually(lambda: len(got) >= 1)
        await asyncio.sleep(0.2)
        assert len(got) == 1 and got[0].node == "w0" and got[0].epoch and got[0].hashes == [] == got[0].counts


@pytest.mark.parametrize("argv", [["--block-size", "32", "--branch-ttl-s", "60"]])
def test_config_from_flags(argv):
    from shared.config import load_config

    cfg = load_config(DirectoryConfig, argv, prog="kvdirectory", env={})
    assert cfg.block_size == 32 and cfg.branch_ttl_s == 60.0


async def test_forged_sequence_jumps_cause_at_most_one_resync_per_interval(nats_url):
    """Issue 18: a flood of KV batches with seq 10^12+ (forged) must not start a resync storm:
    at most one kv.resync request per node per resync_min_interval_s, and the node's real
    batches keep applying after its snapshot."""
    async with running_directory(nats_url, resync_min_interval_s=0.5) as c:
        asked: list[float] = []

        async def answer(req: m.KvResyncRequest, subject: str) -> m.KvSnapshot:
            asked.append(asyncio.get_running_loop().time())
            return m.KvSnapshot(node="w0", seq=1, block_size=BS, gpu=PATH[:1], gpu_parents=[None])

        await c.serve(KV_RESYNC, answer, node="w0")
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=1, events=[stored(PATH[:1])]), node="w0")
        t0 = asyncio.get_running_loop().time()
        for i in range(60):  # 3 s of forged jumps, 20 per second
            await c.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=10**12 + i, events=[stored(PATH[1:2])]), node="w0")
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        elapsed = asyncio.get_running_loop().time() - t0
        assert 1 <= len(asked) <= elapsed / 0.5 + 1, (len(asked), elapsed)
        assert all(b - a >= 0.45 for a, b in zip(asked, asked[1:]))
        n_asked = len(asked)
        await asyncio.sleep(1.2)
        assert len(asked) == n_asked  # the flood is over: no more resyncs (no loop)
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=2, events=[stored(PATH[1:3])]), node="w0")

        async def applied():
            return (await lookup(c, PATH)).longest_any == 3

        await eventually(applied)
        s = await stats(c)
        assert s.gauges["nodes.awaiting_resync"] == 0 and s.counters["kv.batches_beyond_snapshot"] >= 1


async def test_a_node_silent_past_forget_node_after_s_is_forgotten_and_resynced_when_back(nats_url):
    """A worker SIGKILLed for good sends no AllBlocksCleared: the directory drops its blocks after
    --forget-node-after-s without a batch or a state; a live node (states only) is kept; the
    forgotten node, heard again (a state), is asked for a snapshot and indexed whole again."""
    async with running_directory(nats_url, forget_node_after_s=1.0, liveness_interval_s=0.1) as c:
        asked: list[m.KvResyncRequest] = []

        async def answer(req: m.KvResyncRequest, subject: str) -> m.KvSnapshot:
            asked.append(req)
            return m.KvSnapshot(node="w5", seq=1, block_size=BS, gpu=PATH, gpu_parents=[None] + PATH[:-1])

        await c.serve(KV_RESYNC, answer, node="w5")
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w5", seq=1, events=[stored(PATH)]), node="w5")
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w6", seq=1, events=[stored(PATH[:2], "host")]), node="w6")
        await c.publish(NODE_STATE, m.NodeState(node="w5", ts=1.0), node="w5")

        async def indexed():
            return {p.node: p.local_blocks for p in (await lookup(c, PATH)).nodes} == {"w5": 6, "w6": 2}

        await eventually(indexed)
        t0 = asyncio.get_running_loop().time()

        async def forgotten():  # w6 stays heard (a state every 0.2 s), w5 says nothing
            await c.publish(NODE_STATE, m.NodeState(node="w6", ts=1.0), node="w6")
            return (await stats(c)).counters.get("nodes.forgotten", 0) >= 1

        await eventually(forgotten, timeout=10.0)
        assert asyncio.get_running_loop().time() - t0 > 0.8  # not before the limit (1 s since w5's state)
        s = await stats(c)
        assert s.counters["nodes.forgotten"] == 1 and s.counters["nodes.forgotten_copies"] == 6
        assert s.gauges["copies.gpu"] == 0 and s.gauges["copies.host"] == 2
        r = await lookup(c, PATH)
        assert {p.node: p.local_blocks for p in r.nodes} == {"w6": 2} and r.longest_any == 2
        assert asked == []  # no resync asked of a silent node

        await c.publish(NODE_STATE, m.NodeState(node="w5", ts=2.0), node="w5")  # back, idle, KV intact
        await eventually(indexed)
        s = await stats(c)
        assert len(asked) == 1 and s.counters["nodes.returned"] == 1 and s.counters["kv.resyncs"] == 1
        assert s.gauges["nodes.awaiting_resync"] == 0 and s.gauges["copies.gpu"] == 6
        # and its stream goes on from the snapshot's seq
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w5", seq=2, events=[m.BlockRemoved(block_hashes=PATH[4:], tier="gpu")]), node="w5")

        async def applied():
            return (await lookup(c, PATH)).nodes[0].gpu_blocks == 4

        await eventually(applied)


async def test_pods_that_come_and_go_never_exhaust_max_nodes(nats_url):
    """Node ids that change on every restart: with --max-nodes 2, a third id is indexed once one
    of the two was forgotten (it takes the forgotten one's slot; before, every id ever seen kept
    one and the third was dropped as over the limit), and kv.liveness no longer lists the
    forgotten node (it listed it forever)."""
    async with running_directory(nats_url, max_nodes=2, forget_node_after_s=0.3, liveness_interval_s=0.05) as c:
        reports: list[m.KvLiveness] = []

        async def on_liveness(msg: m.KvLiveness, subject: str) -> None:
            reports.append(msg)

        await c.subscribe(KV_LIVENESS, on_liveness)
        await c.publish(KV_EVENTS, m.KvEventBatch(node="pod-a", seq=1, events=[stored(PATH)]), node="pod-a")
        await c.publish(KV_EVENTS, m.KvEventBatch(node="pod-b", seq=1, events=[stored(PATH[:2], "host")]), node="pod-b")

        async def forgotten():  # pod-b stays heard, pod-a says nothing
            await c.publish(NODE_STATE, m.NodeState(node="pod-b", ts=1.0), node="pod-b")
            return (await stats(c)).counters.get("nodes.forgotten", 0) >= 1

        await eventually(forgotten)
        n = len(reports)
        await eventually(lambda: len(reports) > n)
        assert [x.node for x in reports[-1].nodes] == ["pod-b"]
        await c.publish(KV_EVENTS, m.KvEventBatch(node="pod-c", seq=1, events=[stored(PATH[:3])]), node="pod-c")

        async def indexed():
            return {p.node: p.local_blocks for p in (await lookup(c, PATH)).nodes} == {"pod-b": 2, "pod-c": 3}

        await eventually(indexed)
        s = await stats(c)
        assert s.counters.get("kv.nodes_over_limit", 0) == 0 and s.counters["nodes.reclaimed"] == 1
        assert s.gauges["nodes"] == 2 and s.gauges["nodes.forgotten_slots"] == 0
        # the limit counts live nodes: a fourth id, with two live, is still refused
        await c.publish(KV_EVENTS, m.KvEventBatch(node="pod-d", seq=1, events=[stored(PATH[:1])]), node="pod-d")
        await eventually(lambda: _over_limit(c))


async def _over_limit(c: Bus) -> bool:
    return (await stats(c)).counters.get("kv.nodes_over_limit", 0) == 1


async def test_a_wall_clock_step_forgets_no_node_and_stales_no_view(nats_url):
    """The wall clock steps an hour forward: KV liveness measures its durations on the monotonic
    clock, so a serving node heard a moment ago is neither forgotten (its blocks dropped) nor
    stale (on the wall clock both happened in the next liveness round)."""
    step = [0.0]
    clock = SimClock(wall=lambda: time.time() + step[0])
    async with running_directory(nats_url, clock=clock, liveness_interval_s=0.05) as c:
        await c.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=1, events=[stored(PATH)]), node="w0")
        await c.publish(NODE_STATE, m.NodeState(node="w0", ts=1.0, running=1), node="w0")  # serving
        await eventually(lambda: _local_blocks(c, "w0", 6))
        step[0] = 3600.0
        await asyncio.sleep(0.3)  # several liveness rounds
        s = await stats(c)
        assert s.counters.get("nodes.forgotten", 0) == 0 and s.counters.get("kv_view.stale", 0) == 0
        assert s.gauges["copies.gpu"] == 6 and s.gauges["kv_silent_s.w0"] < 1.0


async def test_a_wall_clock_step_expires_no_branch(nats_url):
    """The wall clock steps past --branch-ttl-s: the core's times are the process's own durations,
    read on the monotonic clock, so an active branch and its counts stay (on the wall clock every
    branch expired at the next flush round, its counts released)."""
    step = [0.0]
    clock = SimClock(wall=lambda: time.time() + step[0])
    async with running_directory(nats_url, clock=clock, branch_ttl_s=60.0) as c:
        await c.publish(BRANCH_EVENTS, m.BranchStart(branch_id="a1"))
        await c.publish(ROUTE_PLACED, m.RoutePlaced(rid="r1", branch_id="a1", node="w0", phase="prefill", block_hashes=PATH))
        await eventually(lambda: _counts_entries(c, 6))
        step[0] = 3600.0
        await asyncio.sleep(0.2)  # the flush loop runs every 0.02 s
        s = await stats(c)
        assert s.gauges["branches.active"] == 1 and s.gauges["counts.entries"] == 6
        assert s.counters.get("branch.expired", 0) == 0


async def _counts_entries(c: Bus, n: int) -> bool:
    return (await stats(c)).gauges["counts.entries"] == n


async def _local_blocks(c: Bus, node: str, n: int) -> bool:
    return {p.node: p.local_blocks for p in (await lookup(c, PATH)).nodes}.get(node) == n


def test_forget_node_after_s_flag():
    from shared.config import load_config

    assert DirectoryConfig().forget_node_after_s == 300.0
    cfg = load_config(DirectoryConfig, ["--forget-node-after-s", "0"], prog="kvdirectory", env={})
    assert cfg.forget_node_after_s == 0.0
