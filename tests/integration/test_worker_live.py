"""The worker service over a real nats-server: token stream, KV events, node state,
iteration records, PD hand-off between two workers, resync, split commands, abort,
and malformed payloads on every subscribed subject."""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import asynccontextmanager

import msgspec
import pytest

from shared import messages as m
from shared.bus import Bus
from shared.clock import SimClock
from shared.hashing import block_hashes, tokens_for_blocks
from shared.service import serve_until_stopped
from shared.subjects import (
    KV_COUNTS,
    KV_EVENTS,
    KV_RESYNC,
    NODE_ITERS,
    NODE_STATE,
    REQ_OUT,
    SPLIT_APPLIED,
    SPLIT_COMMANDS,
    SPLIT_GET,
    SVC_STATS,
    WORK_ABORT,
    WORK_DECODE,
    WORK_PREFILL,
    WORK_REQUEUE,
    Subjects,
)
from services.worker.config import WorkerConfig
from services.worker.engines.sim import sim_output_tokens
from services.worker.service import WorkerService
from tests.integration.polling import answering, until

pytestmark = pytest.mark.timeout(60)
BS = 4  # tiny profile block size


class Client:
    """A test-side bus that records everything the workers publish."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.chunks: dict[str, list[m.TokenChunk]] = defaultdict(list)
        self.kv: dict[str, list[m.KvEventBatch]] = defaultdict(list)
        self.states: dict[str, list[m.NodeState]] = defaultdict(list)
        self.iters: dict[str, list[m.IterationRecords]] = defaultdict(list)
        self.applied: list[m.SplitApplied] = []

    @classmethod
    async def connect(cls, url: str) -> "Client":
        c = cls(await Bus.connect(url, Subjects("p0"), service="test", instance="test"))

        async def on_chunk(msg, subj):
            c.chunks[msg.rid].append(msg)

        async def on_kv(msg, subj):
            c.kv[msg.node].append(msg)

        async def on_state(msg, subj):
            c.states[msg.node].append(msg)

        async def on_iters(msg, subj):
            c.iters[msg.node].append(msg)

        async def on_applied(msg, subj):
            c.applied.append(msg)

        await c.bus.subscribe(REQ_OUT, on_chunk)
        await c.bus.subscribe(KV_EVENTS, on_kv)
        await c.bus.subscribe(NODE_STATE, on_state)
        await c.bus.subscribe(NODE_ITERS, on_iters)
        await c.bus.subscribe(SPLIT_APPLIED, on_applied)
        await c.bus.flush()
        return c

    def finished(self, rid: str) -> bool:
        return any(ch.finished for ch in self.chunks[rid])

    async def stats(self, node: str) -> m.StatsReply:
        reply = await self.bus.request(SVC_STATS, m.StatsRequest(), instance=f"worker-{node}")
        bugs = {k: v for k, v in reply.counters.items() if k.startswith(("handler_errors", "node_fatal", "engine_fatal", "task_errors"))}
        assert not bugs, f"worker {node} hit internal errors: {bugs}"
        return reply


@asynccontextmanager
async def workers(url: str, *specs: dict, wall: Callable[[], float] | None = None):
    """Run workers in-process (one shared clock origin, as the launcher gives them). ``wall``: the
    workers' clocks read it as the wall clock (epoch s) instead of ``time.time`` (a test steps it)."""
    origin = time.time()
    stops, tasks = [], []
    probe = await Bus.connect(url, Subjects("p0"), service="probe", instance="probe")
    try:
        for spec in specs:
            spec = {"profile": "tiny", "speedup": 10.0, "idle_state_interval_s": 0.2, "iters_flush_s": 0.1,
                    "check_invariants": True, "clock_origin": origin, **spec}
            cfg = WorkerConfig(nats_url=url, **spec)
            stop = asyncio.Event()
            stops.append(stop)

            def factory(c, b, made, wall=wall):
                return WorkerService(c, b, made if wall is None else SimClock(c.speedup, c.clock_origin, wall=wall))

            tasks.append(asyncio.create_task(
                serve_until_stopped("worker", cfg, factory, instance=f"worker-{cfg.node}", stop_event=stop)))
            await answering(probe, f"worker-{cfg.node}")  # ready once svc.stats answers (after start())
        yield
    finally:
        for s in stops:
            s.set()
        for t in tasks:
            await asyncio.wait_for(t, 10)
        await probe.close()


def prompt(rid: str, ids: list[int], tail: int, max_tokens: int, decode_node: str | None = None, bs: int = BS) -> m.PrefillWork:
    return m.PrefillWork(
        rid=rid,
        prompt_tokens=len(ids) * bs + tail,
        max_tokens=max_tokens,
        block_size=bs,
        block_hashes=block_hashes(tokens_for_blocks(ids, bs), bs),
        decode_node=decode_node,
    )


def check_stream(chunks: list[m.TokenChunk], rid: str, max_tokens: int) -> None:
    assert chunks[0].index == 0 and len(chunks[0].token_ids) == 1
    idx = 0
    for ch in chunks:
        assert ch.index == idx, "chunks are contiguous"
        idx += len(ch.token_ids)
    assert idx == max_tokens
    assert [ch.finished for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == "length"
    assert [t for ch in chunks for t in ch.token_ids] == sim_output_tokens(rid, 0, max_tokens)


async def test_token_stream_kv_events_state_iters_and_resync(nats_url):
    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0"}):
        w = prompt("r1", list(range(1, 11)), tail=1, max_tokens=6)
        await c.bus.publish(WORK_PREFILL, w, node="w0")
        await until(lambda: c.finished("r1"), what="r1 to finish")
        chunks = c.chunks["r1"]
        check_stream(chunks, "r1", 6)
        assert (chunks[0].prompt_tokens, chunks[0].cached_tokens, chunks[0].node) == (41, 0, "w0")
        assert 0 < chunks[0].arrived_at <= chunks[0].ts and all(ch.arrived_at is None for ch in chunks[1:])
        assert chunks[0].queue_s is not None and chunks[0].queue_s >= 0

        # same prompt again: 10 full pages cached, (41 - 1) // 4 = 10 pages usable
        await c.bus.publish(WORK_PREFILL, msgspec.structs.replace(w, rid="r2"), node="w0")
        await until(lambda: c.finished("r2"), what="r2 to finish")
        assert c.chunks["r2"][0].cached_tokens == 40

        await until(lambda: c.iters["w0"], timeout=3, what="iteration records")
        await asyncio.sleep(0.3)
        batches = c.kv["w0"]
        assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
        assert batches[0].events[0] == m.AllBlocksCleared()
        stored = {(e.tier, h) for b in batches for e in b.events if isinstance(e, m.BlockStored) for h in e.block_hashes}
        assert {("gpu", h) for h in w.block_hashes} <= stored and {("host", h) for h in w.block_hashes} <= stored

        st = c.states["w0"][-1]
        assert (st.node, st.engine, st.gpu_total_blocks, st.host_total_blocks, st.block_size) == ("w0", "sim", 64, 256, 4)
        assert st.pid == os.getpid() and st.boot  # its process (in-process here): the pid up's node.down names
        assert [s.seq for s in c.states["w0"]] == sorted(s.seq for s in c.states["w0"])
        recs = [r for batch in c.iters["w0"] for r in batch.records]
        assert {"prefill", "decode"} <= {r.phase for r in recs}

        snap = await c.bus.request(KV_RESYNC, m.KvResyncRequest(node="w0"), node="w0")
        assert snap.seq == c.kv["w0"][-1].seq and snap.block_size == 4
        assert set(w.block_hashes) <= set(snap.gpu) and set(w.block_hashes) <= set(snap.host)

        stats = await c.stats("w0")
        assert stats.counters["requests.completed"] == 2
        assert stats.counters["iterations"] >= 8 and stats.counters["kv.batches"] == len(batches)
        assert stats.gauges["gpu_total_blocks"] == 64 and stats.gauges["running"] == 0
    await c.bus.close()


async def test_pd_handoff_between_two_workers(nats_url):
    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0", "phase": "prefill"}, {"node": "w1", "phase": "decode", "stream_interval": 3}):
        work = msgspec.structs.replace(prompt("pd1", [5, 6, 7], tail=2, max_tokens=12, decode_node="w1"), router="router-7")
        await c.bus.publish(WORK_PREFILL, work, node="w0")
        await until(lambda: c.finished("pd1"), what="pd1 to finish")
        chunks = c.chunks["pd1"]
        check_stream(chunks, "pd1", 12)
        assert chunks[0].node == "w0" and all(ch.node == "w1" for ch in chunks[1:])
        # both nodes name the owner (the hand-off carries it to the decode node): a router that never heard
        # the placement counts these chunks as another router's (chunks_peer_rid), not as unknown ids
        assert {ch.router for ch in chunks} == {"router-7"}
        assert all(len(ch.token_ids) >= 3 for ch in chunks[1:-1]), "stream_interval coalesces"
        s0, s1 = await c.stats("w0"), await c.stats("w1")
        assert s0.counters["requests.handed_off"] == 1 and s0.counters.get("requests.completed", 0) == 0
        assert s1.counters["requests.received.decode"] == 1 and s1.counters["requests.completed"] == 1
        await until(lambda: any(isinstance(e, m.BlockStored) for b in c.kv["w1"] for e in b.events),
                      what="decode node KV events")
    await c.bus.close()


async def test_stream_interval_is_exact_when_decode_iterations_fold(nats_url):
    """One engine step may fold many decode iterations (fold_wall_s); the chunks still hold
    exactly stream_interval tokens (SGLang --stream-interval 1 = one token per chunk)."""
    c = await Client.connect(nats_url)
    fold = {"fold_wall_s": 1.0}
    async with workers(nats_url, {"node": "w0", **fold}, {"node": "w1", "stream_interval": 3, **fold}):
        for node, rid in (("w0", "one"), ("w1", "three")):
            await c.bus.publish(WORK_PREFILL, prompt(rid, [5, 6, 7], tail=2, max_tokens=40), node=node)
            await until(lambda rid=rid: c.finished(rid), what=f"{rid} to finish")
            check_stream(c.chunks[rid], rid, 40)
        assert [len(ch.token_ids) for ch in c.chunks["one"]] == [1] * 40
        assert [len(ch.token_ids) for ch in c.chunks["three"]] == [1] + [3] * 13
        iters = (await c.stats("w0")).counters["iterations"]
        assert iters < 40, "decode iterations were folded (else this test shows nothing)"
    await c.bus.close()


async def test_a_newer_attempt_waiting_for_a_folded_sim_step_cuts_it_short(nats_url):
    """A newer attempt of a request the step in flight runs is registered only once that step ends
    (``requests.waited_for_step``). The handler wakes the step loop first, as any new work does: a
    sim engine's folded decode plan is cut at its next iteration boundary. Before, it waited out
    the whole plan (here 2 s of wall time) before the re-dispatched request started."""
    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0", "speedup": 0.1, "fold_wall_s": 2.0}):
        w = prompt("r", [5, 6, 7], tail=2, max_tokens=150)  # ~100 decode iterations: longer than one folded plan
        await c.bus.publish(WORK_PREFILL, w, node="w0")
        await until(lambda: c.chunks["r"], what="r's first token")
        await asyncio.sleep(0.2)  # the first folded decode plan runs (its wall end is ~2 s away)
        t0 = time.monotonic()
        await c.bus.publish(WORK_PREFILL, msgspec.structs.replace(w, attempt=1, max_tokens=2), node="w0")
        await until(lambda: any(ch.attempt == 1 for ch in c.chunks["r"]), timeout=5, what="attempt 1's first token")
        waited = time.monotonic() - t0
        await until(lambda: c.finished("r"), timeout=5, what="attempt 1 to finish")
        stats = await c.stats("w0")
        assert stats.counters["requests.waited_for_step"] == 1 and stats.counters["requests.superseded"] == 1
        assert waited < 0.8, f"the re-dispatched request waited {waited:.2f} s of wall time for the folded plan"
    await c.bus.close()


async def test_sim_engine_runs_its_plans_back_to_back_whatever_the_loop_overhead(nats_url):
    """The sim engine is a GPU running Eq. 1/2 iterations back to back: the shell's Python work
    between two plans (finishing, publishing, scheduling) must not stretch its timeline. Every
    iteration of one request's decode starts exactly where the previous one ended, and the last
    token's time is the first token's plus the decode iterations' profile durations."""
    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0", "speedup": 1.0, "fold_wall_s": 0.0}):
        await c.bus.publish(WORK_PREFILL, prompt("b2b", [5, 6, 7], tail=2, max_tokens=60), node="w0")
        await until(lambda: c.finished("b2b"), what="b2b to finish")
        check_stream(c.chunks["b2b"], "b2b", 60)
        await until(lambda: sum(r.repeat for b in c.iters["w0"] for r in b.records if r.phase == "decode") >= 39,
                      timeout=3, what="the decode iteration records")
    recs = sorted((r for b in c.iters["w0"] for r in b.records), key=lambda r: r.start)
    assert len(recs) >= 40  # one prefill, then ceil(59 / 1.5) decode iterations
    gaps = [b.start - (a.start + a.duration_s * a.repeat) for a, b in zip(recs, recs[1:])]
    assert max(abs(g) for g in gaps) < 1e-9, f"the engine idled between plans: {max(gaps) * 1e3:.3f} ms"
    decode_s = sum(r.duration_s * r.repeat for r in recs if r.phase == "decode")
    chunks = c.chunks["b2b"]
    assert chunks[-1].ts - chunks[0].ts == pytest.approx(decode_s, abs=1e-9)
    await c.bus.close()


@pytest.mark.parametrize("step_s", [-3600.0, 3600.0])
async def test_a_wall_clock_step_neither_stalls_nor_hurries_the_sim_engine(nats_url, step_s):
    """The wall clock steps an hour (NTP, a VM resumed) while a sim engine decodes folded plans, and
    new work then wakes it: its plans still last their simulated durations in wall time, on the
    monotonic clock. Before, each wait for a plan's end was ``wall_at(end) - time.time()``: stepped
    back, a folded plan woken by the new work waited out the hour (the new request too); stepped
    forward, the woken plan ended at once and the timeline ran ``--engine-lag-wall-s`` of plans
    without waiting (measured with ``time.time`` stepped too: the 1.57 s decode took 1.18 s). The
    tokens' ``ts`` stay wall-based: other processes compare them with their clocks."""
    c = await Client.connect(nats_url)
    step = [0.0]
    speedup = 0.25  # ~130 decode iterations of ~3 ms simulated: ~1.5 s of wall time
    async with workers(nats_url, {"node": "w0", "speedup": speedup, "fold_wall_s": 0.5},
                       wall=lambda: time.time() + step[0]):
        await c.bus.publish(WORK_PREFILL, prompt("s", [5, 6, 7], tail=2, max_tokens=200), node="w0")
        await until(lambda: c.chunks["s"], what="s's first token")
        first = time.monotonic()
        step[0] = step_s
        await asyncio.sleep(0.1)  # inside a folded plan of 0.5 s
        await c.bus.publish(WORK_PREFILL, prompt("t", [8, 9], tail=2, max_tokens=5), node="w0")
        await until(lambda: c.finished("t"), timeout=5, what="t to finish")
        await until(lambda: c.finished("s"), timeout=5, what="s to finish")
        took = time.monotonic() - first
        check_stream(c.chunks["s"], "s", 200)
        # s's prefill, then its 199 tokens in 133 iterations (1.5 per iteration), one with t's prefill
        await until(lambda: sum(r.repeat for b in c.iters["w0"] for r in b.records) >= 134, timeout=3,
                    what="the iteration records")
        # in the order they ran (their starts are wall-based, as sent: the step moved the later ones)
        recs = [r for b in c.iters["w0"] for r in b.records]
        busy_s = sum(r.duration_s * r.repeat for r in recs[1:])  # after s's prefill: the engine never idled
        assert busy_s / speedup > 1.4
        # the work after s's first token lasts its simulated time in wall time (never less; an
        # uvloop timer may end ~1 ms early per plan), and a loaded machine adds a little
        assert busy_s / speedup - 0.05 < took < busy_s / speedup + 2.0, (took, busy_s / speedup)
        # the tokens' ts stay on the wall-based cluster clock: the step moved them (× speedup)
        chunks = c.chunks["s"]
        assert chunks[-1].ts - chunks[0].ts == pytest.approx(busy_s + step_s * speedup, abs=1e-3)
    await c.bus.close()


@pytest.mark.parametrize("step_s", [-3600.0, 3600.0])
async def test_a_wall_clock_step_neither_stalls_nor_hurries_a_decode_waiting_for_its_kv(nats_url, step_s):
    """A decode node holds a hand-off whose KV arrives in 1 wall s (``kv_ready_at``, sent on the
    cluster's wall-based clock) when the wall clock steps an hour; new work then wakes its loop.
    The decode still starts 1 s after the hand-off came: the shell moves ``kv_ready_at`` onto its
    monotonic timeline on receipt, and the core waits on that. Before, the core's deadline stayed
    wall-based: stepped back, the decode waited out the hour; stepped forward, it started at once."""
    c = await Client.connect(nats_url)
    step = [0.0]
    speedup, kv_wait_s = 0.25, 1.0
    origin = time.time()
    sender = SimClock(speedup, origin, wall=lambda: time.time() + step[0])  # the prefill node's clock
    async with workers(nats_url, {"node": "w1", "phase": "decode", "speedup": speedup, "clock_origin": origin},
                       wall=lambda: time.time() + step[0]):
        def handoff(rid: str, wait_s: float) -> m.DecodeWork:
            return m.DecodeWork(rid=rid, prompt_tokens=9, max_tokens=4, block_size=BS, block_hashes=[11, 12], prefill_node="w0",
                                kv_ready_at=sender.now() + wait_s * speedup)  # fmt: skip

        u = handoff("u", kv_wait_s)
        t0 = time.monotonic()
        await c.bus.publish(WORK_DECODE, u, node="w1")
        await asyncio.sleep(0.2)
        step[0] = step_s
        await c.bus.publish(WORK_DECODE, handoff("v", 0.0), node="w1")  # wakes the loop
        await until(lambda: c.finished("v"), timeout=5, what="v to finish")
        await until(lambda: c.chunks["u"], timeout=5, what="u's first decode token")
        took = time.monotonic() - t0
        await until(lambda: c.finished("u"), timeout=5, what="u to finish")
        assert kv_wait_s - 0.05 < took < kv_wait_s + 1.0, f"u decoded {took:.2f} s after its hand-off, its KV came in {kv_wait_s} s"
        # the tokens' ts stay on the wall-based cluster clock: u's first is its KV's arrival (and
        # one decode iteration), moved by the step
        assert c.chunks["u"][0].ts == pytest.approx(u.kv_ready_at + step_s * speedup, abs=0.02)
        await c.stats("w1")
    await c.bus.close()


async def test_a_worker_that_finishes_its_work_says_so_before_its_next_heartbeat(nats_url):
    """A node's state goes out at plan launches, showing the batch before the plan runs; when the
    node has finished its last request it must say so at once, not at its next idle heartbeat
    (1 wall s = 50 simulated s in the demo). Before, the last launch's state (a request running)
    stood until the heartbeat, and the live planner counted that request in decode all the while
    (q̄ 1.7–2.9 live against 0.14–0.39 in ``simulate`` on the demo's input: it moved to 1P3D)."""
    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0", "idle_state_interval_s": 30.0, "speedup": 1.0}):
        await asyncio.sleep(0.1)  # past state_interval_s (0.05 s) after the start's state: the first launch publishes
        await c.bus.publish(WORK_PREFILL, prompt("idle1", [5, 6, 7], tail=2, max_tokens=20), node="w0")
        await until(lambda: c.finished("idle1"), what="idle1 to finish")
        assert any(s.running for s in c.states["w0"]), "a state went out while the request ran"

        def idle() -> bool:
            st = c.states["w0"][-1]
            return (st.running, st.waiting, st.decoding, len(st.queue)) == (0, 0, 0, 0)

        await until(idle, timeout=3, what="a state that shows the node idle (the heartbeat is 30 s away)")
        assert (await c.stats("w0")).counters["state.on_stop"] >= 1
    await c.bus.close()


async def test_malformed_payloads_are_counted_and_the_worker_keeps_serving(nats_url):
    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0", "host_eviction": "branch-count"}):  # (lru subscribes to no kv.counts)
        subs = Subjects("p0")
        targets = [WORK_PREFILL, WORK_DECODE, WORK_ABORT, SPLIT_COMMANDS, KV_COUNTS, KV_RESYNC]
        for subj in targets:
            params = {"node": "w0"} if "node" in subj.params else {}
            await c.bus.publish_raw(subs.format(subj, **params), b"\xc1 not msgpack")
        await c.bus.publish(KV_COUNTS, m.CountUpdates(node="w0", hashes=[1, 2], counts=[1]), node="w0")
        await c.bus.flush()
        # bad input that decodes: wrong block size, never fits L1
        await c.bus.publish(WORK_PREFILL, prompt("bad-bs", [1, 2], tail=0, max_tokens=2, bs=8), node="w0")
        await c.bus.publish(WORK_PREFILL, prompt("too-big", list(range(60)), tail=0, max_tokens=100), node="w0")
        await c.bus.publish(WORK_PREFILL, prompt("ok", [3, 4], tail=1, max_tokens=3), node="w0")
        await until(lambda: c.finished("ok") and c.finished("bad-bs") and c.finished("too-big"))
        for rid, why in (("bad-bs", "block size"), ("too-big", "KV blocks")):
            (ch,) = c.chunks[rid]
            assert (ch.finished, ch.finish_reason) == (True, "error") and why in ch.error
        check_stream(c.chunks["ok"], "ok", 3)
        stats = await c.stats("w0")
        for subj in targets:  # the counts update with 1 count for 2 hashes is dropped at the edge (shared.validate)
            assert stats.counters[f"dropped.{subj.template}"] == (2 if subj is KV_COUNTS else 1), subj.template
        assert stats.counters[f"invalid.{KV_COUNTS.template}"] == 1
        assert stats.counters["requests.errored"] == 2 and stats.counters.get("counts.invalid", 0) == 0
    await c.bus.close()


async def test_a_new_directory_epoch_resets_the_branch_counts(nats_url):
    """Count messages of one directory process (one ``epoch``) apply as they come; the first of a
    new epoch (the directory restarted, its counts start empty) resets every count first."""
    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0", "host_eviction": "branch-count"}):
        for epoch, hashes, counts in (("d1", [3, 4], [1, 1]), ("d1", [4], [2]), ("d2", [5], [1]), ("d2", [5], [0])):
            await c.bus.publish(KV_COUNTS, m.CountUpdates(node="w0", hashes=hashes, counts=counts, epoch=epoch), node="w0")
        await c.bus.flush()

        for _ in range(100):  # the stats reply may overtake the count messages: poll
            stats = await c.stats("w0")
            if stats.counters.get("counts.directory_restarts", 0) >= 1:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        stats = await c.stats("w0")  # one reset: the first epoch set none, the second epoch's second message none
        assert stats.counters["counts.directory_restarts"] == 1 and stats.counters.get("counts.invalid", 0) == 0
    await c.bus.close()


async def test_a_starting_worker_asks_the_planner_for_the_split(nats_url):
    """A worker started with ``--phase prefill`` whose node the planner has moved to decode (it
    restarted after a crash, say) asks ``split.get`` at start and switches at once, not at the
    planner's next announcement (5 s). Its switch time runs from its own start, not from the
    decision, made long before while it was down (the cluster started 100 wall s = 1,000
    simulated s ago; the split was decided at 50 s)."""
    c = await Client.connect(nats_url)
    asked: list[float] = []

    async def on_get(_q: m.SplitQuery, _subject: str) -> m.SplitCommand:
        asked.append(time.monotonic())
        return m.SplitCommand(epoch=3, phases={"w0": "decode", "w1": "prefill"}, decided_at=50.0)

    await c.bus.serve(SPLIT_GET, on_get)
    await c.bus.flush()
    t0 = time.monotonic()
    async with workers(nats_url, {"node": "w0", "phase": "prefill", "clock_origin": time.time() - 100.0}):
        await until(lambda: c.applied, timeout=3, what="split.applied")
        assert time.monotonic() - t0 < 3 and len(asked) == 1
        a = c.applied[0]
        assert (a.node, a.phase, a.status, a.epoch) == ("w0", "decode", "serving", 3)
        assert a.decided_at == 50.0 and a.received_at > 990.0  # the decision as made, the command as received
        assert a.switch_s < 30.0  # 3 wall s at 10x at most; was ~950 (measured from the decision)
        await until(lambda: c.states["w0"] and c.states["w0"][-1].phase == "decode", what="phase in state")
        stats = await c.stats("w0")
        assert stats.counters["split.get_answered"] == 1 and stats.counters["split.switches"] == 1
    await c.bus.close()


async def test_split_commands_and_abort(nats_url):
    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0", "speedup": 1.0}):
        await c.bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=1, phases={"w0": "decode", "w9": "prefill"}))
        await until(lambda: c.applied, what="split.applied")
        assert (c.applied[0].node, c.applied[0].phase, c.applied[0].status) == ("w0", "decode", "serving")
        await until(lambda: c.states["w0"] and c.states["w0"][-1].phase == "decode", what="phase in state")
        assert c.states["w0"][-1].epoch == 1
        await c.bus.publish(WORK_PREFILL, prompt("refused", [1], tail=1, max_tokens=2), node="w0")
        await until(lambda: c.finished("refused"))
        assert "serves decode" in c.chunks["refused"][0].error
        await c.bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=1, phases={"w0": "both"}))  # stale epoch
        await c.bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=2, phases={"w0": "both"}))
        await until(lambda: len(c.applied) == 2, what="second split.applied")
        assert c.applied[1].phase == "both"

        await c.bus.publish(WORK_PREFILL, prompt("long", [1, 2], tail=1, max_tokens=220), node="w0")
        await until(lambda: len(c.chunks["long"]) >= 2, what="long to stream")
        await c.bus.publish(WORK_ABORT, m.RequestAbort(rid="long", reason="client gone"), node="w0")
        await until(lambda: c.finished("long"), what="abort chunk")
        last = c.chunks["long"][-1]
        assert (last.finish_reason, last.error) == ("abort", "client gone")
        assert sum(len(ch.token_ids) for ch in c.chunks["long"]) < 220
        stats = await c.stats("w0")
        assert stats.counters["requests.aborted"] == 1 and stats.counters["split.ignored"] == 1
        assert stats.gauges["running"] == 0 and stats.gauges["gpu_free_blocks"] == 64
    await c.bus.close()


async def test_collocated_work_at_a_prefill_only_node_is_handed_back(nats_url):
    """Work routed as collocated (no decode node) that reaches a node serving prefill only —
    it switched from collocated to PD meanwhile, as at the end of the planner's warm-up — goes
    back to its router (``work.requeue``) to be re-routed; it is not failed."""
    c = await Client.connect(nats_url)
    handed: list[m.WorkRequeue] = []

    async def on_requeue(msg: m.WorkRequeue, _subject: str) -> m.WorkRequeueReply:
        handed.append(msg)
        return m.WorkRequeueReply(rid=msg.rid, accepted=True)

    await c.bus.serve(WORK_REQUEUE, on_requeue, router="router")
    async with workers(nats_url, {"node": "w0", "phase": "prefill"}):
        await c.bus.publish(WORK_PREFILL, prompt("r-coll", [1, 2, 3], 1, 4), node="w0")
        await until(lambda: handed, what="the work handed back")
        assert handed[0].rid == "r-coll" and handed[0].prefill is not None and "prefill only" in handed[0].reason
        await asyncio.sleep(0.3)
        assert not c.chunks["r-coll"], "no error chunk: the router owns the request again"
        st = await c.stats("w0")
        assert st.counters["requeue.prefill"] == 1 and st.counters.get("requests.errored", 0) == 0
    await c.bus.close()


async def test_a_hand_back_no_router_takes_fails_with_an_error_chunk_naming_its_router(nats_url):
    """Collocated work at a prefill-only node goes back to its router (``work.requeue.<router>``); nobody
    answers there (the router is gone) for ``requeue_timeout_s``: the request fails with an error chunk,
    stamped with the owning router (``TokenChunk.router``), so a peer router counts it as another router's
    (``chunks_peer_rid``). Before, the hand-back had already forgotten the owner, and ``_reject`` stamped ""."""
    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0", "phase": "prefill", "requeue_timeout_s": 0.3}):
        work = msgspec.structs.replace(prompt("r-gone", [1, 2, 3], 1, 4), router="router-b")
        await c.bus.publish(WORK_PREFILL, work, node="w0")
        await until(lambda: c.finished("r-gone"), what="the error chunk")
        [ch] = c.chunks["r-gone"]
        assert (ch.finish_reason, ch.router) == ("error", "router-b"), ch
        assert "did not take the request back" in (ch.error or ""), ch
        st = await c.stats("w0")
        assert st.counters["requeue.failed"] == 1 and st.counters["requests.errored"] == 1, st.counters
    await c.bus.close()


async def test_a_worker_that_stops_clears_its_blocks_from_the_directory(nats_url):
    """A node that leaves (SIGTERM: compose scale-down, scancel, ``up`` stopping) says its KV is
    gone, as it does at start (``AllBlocksCleared``): the directory's index and its gauges
    (``ei_kvdirectory_blocks_indexed`` / ``ei_kvdirectory_copies``) drop the node's blocks. Before,
    they kept them for as long as the directory ran (measured: a 2-node ``collocated`` cluster
    still counted 312 copies of the stopped node 30 s after it left)."""
    from services.kvdirectory.config import DirectoryConfig
    from services.kvdirectory.service import DirectoryService

    c = await Client.connect(nats_url)
    stop_dir = asyncio.Event()
    cfg = DirectoryConfig(nats_url=nats_url, block_size=BS)
    directory = asyncio.create_task(serve_until_stopped("kvdirectory", cfg, DirectoryService, instance="kvdirectory", stop_event=stop_dir))
    try:
        await answering(c.bus, "kvdirectory")

        async def gauges() -> dict[str, float]:
            return (await c.bus.request(SVC_STATS, m.StatsRequest(), instance="kvdirectory")).gauges

        async with workers(nats_url, {"node": "w0"}):
            await c.bus.publish(WORK_PREFILL, prompt("r1", list(range(1, 11)), tail=1, max_tokens=3), node="w0")
            await until(lambda: c.finished("r1"), what="r1 to finish")

            async def indexed() -> bool:
                g = await gauges()
                return g["blocks.indexed"] >= 10 and g["copies.gpu"] >= 10 and g["copies.host"] >= 10

            await until(indexed, what="the directory to index w0's blocks")
        # the worker stopped; its clearing batch reaches this client's subscription a moment later
        await until(lambda: c.kv["w0"][-1].events == [m.AllBlocksCleared()], what="the stopped worker's clearing KV batch")
        last = c.kv["w0"][-1]
        assert last.events == [m.AllBlocksCleared()] and last.seq == len(c.kv["w0"]), [b.seq for b in c.kv["w0"]]

        async def cleared() -> bool:
            g = await gauges()
            return g["blocks.indexed"] == 0 and g["copies.gpu"] == 0 and g["copies.host"] == 0

        await until(cleared, what="the directory to drop the stopped node's blocks")
    finally:
        stop_dir.set()
        await asyncio.wait_for(directory, 10)
        await c.bus.close()


async def test_a_directory_started_while_a_worker_idles_indexes_its_blocks(nats_url):
    """A KV directory that starts (or restarts: SIGKILLed, started again) while a worker holding
    blocks idles learns of the node from its ``node.state`` alone: an idle node publishes no
    ``kv.events`` batch, so the first-contact gap that asks the busy nodes for a snapshot never
    comes. It asks the node for one once it has heard it ``UNHEARD_RESYNC_AFTER_S`` without a batch,
    and indexes every block the worker holds. Before, it never did: CI's
    ``test_directory_sigkill_loses_nothing_and_gets_index_and_branches_back`` found the restarted
    directory's copies 14,746 below the workers' snapshots in both tiers 180 s after the run, the
    blocks of a prefill node idle from before the restart (a prefill node's GPU and host hold the
    same blocks: write-through, no GPU eviction); here the copies stayed 0."""
    from services.kvdirectory.config import DirectoryConfig
    from services.kvdirectory.service import UNHEARD_RESYNC_AFTER_S, DirectoryService

    c = await Client.connect(nats_url)
    async with workers(nats_url, {"node": "w0"}):
        await c.bus.publish(WORK_PREFILL, prompt("r1", list(range(1, 11)), tail=1, max_tokens=3), node="w0")
        await until(lambda: c.finished("r1"), what="r1 to finish")
        await until(lambda: c.states["w0"] and c.states["w0"][-1].running == 0, what="w0 to idle")
        batches = len(c.kv["w0"])
        snap = await c.bus.request(KV_RESYNC, m.KvResyncRequest(node="w0", reason="test"), node="w0")  # idle: no batch
        assert len(snap.gpu) >= 10 and len(snap.host) >= 10 and snap.seq == c.kv["w0"][-1].seq, (len(snap.gpu), snap.seq)
        stop_dir = asyncio.Event()
        cfg = DirectoryConfig(nats_url=nats_url, block_size=BS, liveness_interval_s=0.1)
        t0 = time.monotonic()
        directory = asyncio.create_task(serve_until_stopped("kvdirectory", cfg, DirectoryService, instance="kvdirectory", stop_event=stop_dir))
        try:
            await answering(c.bus, "kvdirectory")

            async def stats() -> m.StatsReply:
                return await c.bus.request(SVC_STATS, m.StatsRequest(), instance="kvdirectory")

            async def indexed() -> bool:
                g = (await stats()).gauges
                return g["copies.gpu"] == len(snap.gpu) and g["copies.host"] == len(snap.host)

            await until(indexed, timeout=UNHEARD_RESYNC_AFTER_S + 10.0, what="the directory to index the idle worker's blocks")
            assert time.monotonic() - t0 > UNHEARD_RESYNC_AFTER_S  # not asked before the bound (a starting worker's batch 1)
            s = await stats()
            assert s.counters["kv.unheard_resyncs"] == 1 and s.counters["kv.resyncs"] == 1, s.counters
            assert s.gauges["nodes.awaiting_resync"] == 0 and s.gauges["blocks.indexed"] >= 10
            assert len(c.kv["w0"]) == batches  # the worker published no batch: its state alone got it asked
            assert (await c.stats("w0")).counters["kv.resyncs"] == 2  # the test's own, then the directory's
        finally:
            stop_dir.set()
            await asyncio.wait_for(directory, 10)
    await c.bus.close()


async def test_a_resync_answered_while_the_worker_stops_offers_no_blocks(nats_url):
    """A stopping worker's last KV batch says its blocks are gone (``AllBlocksCleared``); a
    ``kv.resync`` it answers after that (``Bus.close`` drains: in-flight handlers still run after
    ``WorkerService.stop``) must agree, or the directory replaces its view of the node with the
    snapshot and indexes the blocks of a node that left for as long as it runs. Before, the
    snapshot listed every block the engine still held, at the seq of the clearing batch."""
    c = await Client.connect(nats_url)
    held: dict[str, WorkerService] = {}

    def factory(cfg, bus, clock):
        held["svc"] = WorkerService(cfg, bus, clock)
        return held["svc"]

    cfg = WorkerConfig(nats_url=nats_url, node="w0", profile="tiny", speedup=10.0, idle_state_interval_s=0.2, iters_flush_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(serve_until_stopped("worker", cfg, factory, instance="worker-w0", stop_event=stop))
    try:
        await answering(c.bus, "worker-w0")
        await c.bus.publish(WORK_PREFILL, prompt("r1", list(range(1, 11)), tail=1, max_tokens=3), node="w0")
        await until(lambda: c.finished("r1"), what="r1 to finish")
        svc = held["svc"]
        live = await svc._on_resync(m.KvResyncRequest(node="w0"), "")
        assert len(live.gpu) >= 10  # a running node offers its blocks
        stop.set()
        await asyncio.wait_for(task, 10)
        # the clearing batch is published before the worker's bus closes, but reaches this client's
        # subscription a moment later (CI once read the batch before it)
        await until(lambda: c.kv["w0"][-1].events == [m.AllBlocksCleared()], what="the stopped worker's clearing KV batch")
        last = c.kv["w0"][-1]
        snap = await svc._on_resync(m.KvResyncRequest(node="w0"), "")
        assert snap.seq == last.seq and snap.gpu == [] and snap.host == [], (snap.seq, len(snap.gpu), len(snap.host))
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await c.bus.close()


@pytest.mark.parametrize("step_s", [0.008, -0.008])
async def test_a_small_wall_clock_step_does_not_put_a_first_token_before_its_work_arrived(nats_url, step_s):
    """A step of the wall clock under ``WALL_STEP_S`` (±8 ms, a hypervisor's time sync) at ``--speedup 50``
    (the demo's): a request that arrives after it has its ``arrived_at`` and its first token's ``ts``
    moved onto the cluster clock with one kept offset (the pre-step one: the step is under
    ``WALL_STEP_S``), and the ``ts`` must not come before it (``ttft_node`` = ``first_token_at -
    node_arrived_at`` in the report: the prefill's simulated time, never negative). Before the core
    moved onto the local timeline, ``arrived_at`` was the stepped ``clock.now()`` and the plan's times
    the kept offset's: 771a636 measured a first token 0.397 s before its work (``queue_s`` negative,
    the chunk dropped)."""
    c = await Client.connect(nats_url)
    step = [0.0]
    async with workers(nats_url, {"node": "w0", "speedup": 50.0}, wall=lambda: time.time() + step[0]):
        await c.bus.publish(WORK_PREFILL, prompt("a", [1, 2], tail=2, max_tokens=1), node="w0")
        await until(lambda: c.finished("a"), what="a's token")
        step[0] = step_s
        await asyncio.sleep(0.05)
        await c.bus.publish(WORK_PREFILL, prompt("b", [3, 4], tail=2, max_tokens=1), node="w0")
        await until(lambda: c.finished("b"), what="b's token")
        first = c.chunks["b"][0]
        assert first.arrived_at is not None and first.ts >= first.arrived_at, (first.ts, first.arrived_at)
        await c.stats("w0")  # no internal errors
    await c.bus.close()


async def test_a_wall_clock_step_back_keeps_a_switchs_times_in_order(nats_url):
    """The wall clock steps back (an hour, then a second) on a live worker. A switch decided after
    the first step takes its ``switch_s`` from the planner's ``decided_at``: the process start it is
    bounded by (a worker restarted after the decision) is this node's local time, moved onto the
    wall clock when compared. A switch whose drain spans the second step keeps received ≤ drained ≤
    applied, with the drain's local length. Before, the start was a wall reading kept from before
    the step (an hour ahead of every later ``decided_at``: ``switch_s`` 0), and ``received_at`` a
    wall reading from before the drain (``drained_at`` clamped to it, ``applied_at`` before it), and
    ``switch_s`` lost the step (``decided_at`` is moved onto the local timeline on receipt now)."""
    c = await Client.connect(nats_url)
    step = [0.0]
    origin = time.time()
    speedup = 0.1  # d's decode below lasts ~1.2 wall s
    planner = SimClock(speedup, origin, wall=lambda: time.time() + step[0])
    async with workers(nats_url, {"node": "w0", "speedup": speedup, "clock_origin": origin}, wall=lambda: time.time() + step[0]):
        await asyncio.sleep(0.7)  # the decision below comes after the process start
        step[0] = -3600.0
        decided = planner.now() - 0.5 * speedup  # decided half a wall second ago, after the step
        await c.bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=2, phases={"w0": "decode", "w9": "prefill"}, decided_at=decided))
        await until(lambda: any(a.epoch == 2 for a in c.applied), what="the switch to decode")
        a = next(a for a in c.applied if a.epoch == 2)
        assert a.status == "serving" and 0.45 < a.switch_s / speedup < 1.5, a
        await c.bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=3, phases={"w0": "both"}, decided_at=planner.now()))
        await until(lambda: any(a.epoch == 3 for a in c.applied), what="the switch back to both")
        await c.bus.publish(WORK_PREFILL, prompt("d", [5, 6, 7], tail=2, max_tokens=60), node="w0")
        await until(lambda: c.chunks["d"], what="d's first token")
        await c.bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=4, phases={"w0": "prefill", "w9": "decode"}, decided_at=planner.now()))
        await until(lambda: any(a.epoch == 4 for a in c.applied), what="the drain's start")
        t0 = time.monotonic()
        await asyncio.sleep(0.1)
        step[0] -= 1.0
        await until(lambda: any(a.epoch == 4 and a.status == "serving" for a in c.applied), timeout=10, what="the switch to prefill")
        drain_wall_s = time.monotonic() - t0
        s = next(a for a in c.applied if a.epoch == 4 and a.status == "serving")
        assert s.received_at <= s.drained_at <= s.applied_at, (s.received_at, s.drained_at, s.applied_at)
        drain_s = (s.drained_at - s.received_at) / speedup
        assert drain_wall_s > 0.3 and drain_wall_s - 0.3 < drain_s < drain_wall_s + 0.1, (drain_s, drain_wall_s)
        assert drain_s - 0.05 < s.switch_s / speedup < drain_s + 0.5, (s.switch_s / speedup, drain_s)  # the step is not in it
        await c.stats("w0")
    await c.bus.close()


@pytest.mark.parametrize("wait", ["peer fetch", "hand-off"])
async def test_a_worker_whose_only_work_waits_for_its_kv_still_sends_alive_batches(nats_url, tmp_path, wait):
    """A node whose only request waits for its KV (a prefill's peer fetch: 2.5 s of link latency here; a decode's
    hand-off whose KV arrives in 2.5 s) runs no plan meanwhile, yet it holds work (its node.state says so: the KV
    directory counts that time against its view, ``services/kvdirectory/liveness.py``). It must send an empty alive
    ``kv.events`` batch every ``--kv-alive-interval-s`` all the same. Before, only a plan's start and end or a new
    input ran the check (``_flush_kv``), so the node's loop slept out the whole wait with nothing sent and the
    directory called a healthy node's view stale after ``--kv-stale-after-s``."""
    from shared.profile import PROFILE_DIR

    c = await Client.connect(nats_url)
    wait_s, interval, speedup = 2.5, 0.25, 1.0
    tiny = (PROFILE_DIR / "tiny.toml").read_text()
    assert "peer_fetch_latency_s = 0.001" in tiny and "gpu_to_gpu_latency_s = 0.001" in tiny
    slow = tmp_path / "slow-kv.toml"  # a hand-off's kv_ready_at is kept up to twice its transfer time (kv_ready_bound)
    slow.write_text(tiny.replace("peer_fetch_latency_s = 0.001", f"peer_fetch_latency_s = {wait_s}")
                    .replace("gpu_to_gpu_latency_s = 0.001", f"gpu_to_gpu_latency_s = {wait_s}"))
    got: list[float] = []  # monotonic s at which each of w0's kv.events batches arrived

    async def on_kv(msg: m.KvEventBatch, _subject: str) -> None:
        if msg.node == "w0":
            got.append(time.monotonic())

    await c.bus.subscribe(KV_EVENTS, on_kv)
    await c.bus.flush()
    origin = time.time()
    phase = "both" if wait == "peer fetch" else "decode"
    async with workers(nats_url, {"node": "w0", "speedup": speedup, "kv_alive_interval_s": interval, "profile": str(slow),
                                  "phase": phase, "clock_origin": origin, "idle_state_interval_s": 0.2}):
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        if wait == "peer fetch":  # the prompt's 10 pages are on w9 (as the directory's lookup says): fetched first
            w = msgspec.structs.replace(prompt("f1", list(range(1, 11)), tail=1, max_tokens=2),
                                        fetch=[m.FetchRange(node="w9", start=0, end=10)])
            await c.bus.publish(WORK_PREFILL, w, node="w0")
            rid = "f1"
        else:
            kv_at = SimClock(speedup, origin).now() + wait_s * speedup
            await c.bus.publish(WORK_DECODE, m.DecodeWork(rid="d1", prompt_tokens=9, max_tokens=2, block_size=BS,
                                                          block_hashes=[11, 12], prefill_node="w9", kv_ready_at=kv_at), node="w0")
            rid = "d1"
        await until(lambda: c.chunks[rid], timeout=wait_s + 10, what=f"{rid}'s first token")
        t1 = time.monotonic()
        await until(lambda: c.finished(rid), timeout=5, what=f"{rid} to finish")
        stats = await c.stats("w0")
        t2 = time.monotonic()
    await c.bus.close()
    assert t1 - t0 > wait_s - 0.2, (t1 - t0, "the request did not wait for its KV")
    if wait == "peer fetch":
        assert stats.counters["fetch.started"] == 1, stats.counters
    # the longest stretch of the wait with no batch from w0: an alive batch at least every interval (+ loop slack)
    marks = [t0, *(t for t in got if t0 < t < t1), t1]
    longest = max(b - a for a, b in zip(marks, marks[1:]))
    assert longest < interval + 0.5, (longest, [round(t - t0, 2) for t in marks])
    assert stats.counters["kv.alive_batches"] >= (wait_s - 0.5) / interval / 2, stats.counters
    # and no more than one wake (and alive batch) per interval of the work's life (t0 .. the stats read): a wait that
    # woke early without sending (a busy loop: ~1,000 wakes a second) ran up the counter and sent nothing more
    most = (t2 - t0) / interval + 3
    assert stats.counters["kv.alive_wakes"] <= most and stats.counters["kv.alive_batches"] <= most, (most, stats.counters)
