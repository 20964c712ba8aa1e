"""A torch worker's real-bytes pool (``--kv-pool real``) moves KV pages without waiting for the forward on the loop.

Two pool paths of the worker ran on the event loop under the engine's lock, which ``TorchEngine.execute`` holds
for a whole plan in the execute thread: ``_mirror_pool`` (every drain with host-tier KV events: each page stored
in L2 copied into the Mooncake-registered buffer and checksummed, ``TorchEngine.mirror_pool``) and a finished
fetch's ``take_fetched`` (``TorchEngine.on_fetched``: each fetched page copied out of the buffer). The loop waited
for the rest of the forward and then for the copies of every page (measured on CPU with a hidden-512, 8-layer
llama: 127-323 ms per call); heartbeats, NATS pings and ``/metrics`` waited with it. Now the pool's bookkeeping
stays on the loop (a stored page's slot is claimed, a fetched page's slot pinned, so neither is reused under a
copy) and the copies run in the execute thread after the plan in flight. Here the forward is slowed to
``FORWARD_S``; the pool is a real :class:`HostKvPool` whose Mooncake endpoint and peer transfer are stand-ins
(the buffer, its slots and checksums are the real ones). Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest

torch = pytest.importorskip("torch")

from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402
from services.worker.kvpool.pool import FetchResult, HostKvPool  # noqa: E402
from services.worker.service import WorkerService  # noqa: E402
from shared.clock import SimClock  # noqa: E402
from shared.messages import BlockRemoved, BlockStored, FetchRange  # noqa: E402
from tests.unit.worker.torch_tiny import BS, FORWARD_S, PROFILE, prompt, work  # noqa: E402
from tests.unit.worker.torch_tiny import slow_step  # noqa: E402

PAGES = 75
"""Full pages of the prompts here (600 tokens: 75 of the 128 L1 pages, 75 of the 512 L2 slots)."""


class _Endpoint:
    """What :class:`HostKvPool` asks of its Mooncake endpoint without a transfer (the buffer's registration)."""

    protocol = "tcp"
    session = "127.0.0.1:0"

    def register(self, memory: object) -> None:
        pass

    def unregister(self, addr: int) -> None:
        pass


class _NoBus:
    """The worker's bus where nothing here publishes."""

    reconnected_at = 0.0


def _svc(model: str) -> WorkerService:
    """Node p (torch, ``--kv-pool real``, invariants checked) with a real-bytes pool of its L2's geometry."""
    svc = WorkerService(
        WorkerConfig(node="p", phase="both", profile="torch-tiny-cpu", engine="torch", model=model, kv_pool="real", check_invariants=True),
        _NoBus(), SimClock(),
    )  # fmt: skip
    svc.kvpool = HostKvPool(
        "p", None, num_slots=PROFILE.host_blocks, slot_bytes=svc.engine.pool_slot_bytes(), payload="external", endpoint=_Endpoint()
    )  # type: ignore[arg-type]
    return svc


def _page_bytes(engine, h: int):
    """Page ``h``'s L2 bytes as the pool holds them (``uint8``, one slot)."""
    return engine.host_page(h).reshape(-1).view(torch.uint8).numpy()


class _Lag:
    """The event loop's longest wait past a 5-ms sleep while running (seconds)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._done = False
        self._task = asyncio.create_task(self._probe())

    async def _probe(self) -> None:
        while not self._done:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append(time.perf_counter() - t - 0.005)

    async def stop(self) -> float:
        self._done = True
        await self._task
        return max(self.lags)


def _finish(svc: WorkerService, now: float, rid: str) -> tuple[float, list[int]]:
    """Run ``svc``'s plans here (drained as the worker drains) until ``rid`` left the core; its output tokens."""
    out: list[int] = []
    for _ in range(500):
        if rid not in svc.core.requests:
            return now, out
        plan = svc.core.schedule(now)
        svc._engine_kv_events(svc.core.take_kv_events())
        if plan is None:
            due = svc.core.next_deadline()
            now = max(now + 0.01, due if due is not None else now)
            continue
        svc.engine.execute(plan)
        now = plan.end
        svc.core.finish_iteration(plan, now, svc.engine.take_stopped())
        if rid in svc.engine.seqs:
            out = list(svc.engine.seqs[rid].out)
    raise AssertionError(f"{rid} did not finish")


async def test_a_mirror_of_many_l2_pages_beside_a_forward_keeps_the_loop_running(tiny_llama):
    svc = _svc(tiny_llama)
    try:
        svc.engine.accept_prefill(work("a", prompt(1, PAGES * BS), n=1))
        svc.core.add_prefill(work("a", prompt(1, PAGES * BS), n=1), 0.0)
        stored: list = []  # the drains' events, applied to the engine, not yet mirrored
        now = 0.0
        for _ in range(50):
            if "a" not in svc.core.requests:
                break
            plan = svc.core.schedule(now)
            events = svc.core.take_kv_events()
            svc._engine_kv_events(events)
            stored += events
            svc.engine.execute(plan)
            now = plan.end
            svc.core.finish_iteration(plan, now, svc.engine.take_stopped())
        events = svc.core.take_kv_events()
        svc._engine_kv_events(events)
        stored += events
        l2 = [h for ev in stored if isinstance(ev, BlockStored) and ev.tier == "host" for h in ev.block_hashes]
        assert len(l2) == PAGES and not svc.kvpool.buffer.held
        step, plan = await slow_step(svc, now, "b", keep=set())
        lag = _Lag()
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        svc._mirror_pool(stored)  # a drain's mirror (_flush_kv): 75 pages stored in L2
        took = time.perf_counter() - t0
        assert not step.done()
        worst = await lag.stop()
        await step
        svc.core.finish_iteration(plan, plan.end, svc.engine.take_stopped())
        assert took < FORWARD_S / 4 and worst < FORWARD_S / 4, f"the loop waited for the forward: call {took * 1e3:.0f} ms, lag {worst * 1e3:.0f} ms"
        await asyncio.gather(*svc._spawned)  # the copies, in the execute thread after the plan
        buf = svc.kvpool.buffer
        for h in l2:  # bit-exact: the pool serves the engine's L2 bytes, with their checksum
            assert buf.has(h) and buf.verify(h) and (buf.view(h)[: svc.engine.pool_slot_bytes()] == _page_bytes(svc.engine, h)).all()
        buf.check()
        assert buf.occupancy() == {"held": PAGES, "pending": 0, "free": PROFILE.host_blocks - PAGES, "released": 0}
        assert not svc.fatal.is_set()
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


async def test_a_big_fetch_that_ends_beside_a_forward_keeps_the_loop_running(tiny_llama):
    peer = LocalNode("a", PROFILE, tiny_llama)
    tokens = prompt(5, PAGES * BS + 3)
    peer.add_prefill(work("w", tokens, n=4))
    peer.run()
    svc = _svc(tiny_llama)
    pool = svc.kvpool
    moved: list[int] = []

    async def fetch(node: str, hashes):  # the Mooncake read: the peer's L2 bytes land in this pool, verified
        assert node == "a"
        for h in hashes:
            pool.put(h, _page_bytes(peer.engine, h))
        moved.extend(hashes)
        return FetchResult(node, len(hashes), fetched=tuple(hashes), bytes=len(hashes) * pool.buffer.slot_bytes)

    pool.fetch = fetch  # type: ignore[method-assign]
    try:
        step, plan = await slow_step(svc, 0.0, "b", keep=set())
        lag = _Lag()
        r = msgspec.structs.replace(work("r", tokens, n=4), fetch=[FetchRange(node="a", start=0, end=PAGES)])
        svc._accept(svc.engine.accept_prefill, r)  # arrives during the forward
        svc.core.add_prefill(r, 0.0)
        [fs] = svc.core.take_fetch_starts()
        svc._engine_kv_events(svc.core.take_kv_events())
        t0 = time.perf_counter()
        await svc._transfer(fs)  # the fetch's task: bytes moved, the engine takes them, the core is told
        took = time.perf_counter() - t0
        worst = await lag.stop()
        # the copies ran in the execute thread after the plan in flight (queued behind it), not on the loop
        # under the engine's lock: the step has ended (its result reached the loop before the copies')
        assert step.done(), f"the fetch's pages were taken before the plan in flight ended ({took * 1e3:.0f} ms)"
        assert worst < FORWARD_S / 4, f"the loop stalled {worst * 1e3:.0f} ms while the fetch ended (forward {FORWARD_S} s)"
        assert len(moved) == PAGES and svc.counters["kvfetch.blocks_fetched"] == PAGES
        for h in moved:  # the engine holds the fetched bytes bit for bit, the pool let go of its pins
            assert torch.equal(svc.engine._fetched[h].kv, peer.engine.host_page(h))
        pool.buffer.check()
        assert not pool.buffer._pins
        await step
        now = plan.end
        svc.core.finish_iteration(plan, now, svc.engine.take_stopped())
        now, out = _finish(svc, now, "r")
        assert out == peer.finished["w"].tokens
        assert svc.engine.counters["fetched_pages"] == PAGES and svc.counters["kvfetch.blocks_missing"] == 0
        assert not svc.engine._fetched and not svc.fatal.is_set()
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


async def test_pages_evicted_while_their_copy_waits_are_not_offered_and_their_slots_not_reused(tiny_llama):
    """The copies wait for the plan in flight: the pages' slots are claimed meanwhile. A page evicted from L2 in
    that window (a later drain's ``BlockRemoved(host)``) is not offered once its copy is done, and no fetch's
    reservation gets a slot a copy still writes (the peer's bytes would land under the engine's, or the reverse)."""
    svc = _svc(tiny_llama)
    try:
        svc.engine.accept_prefill(work("a", prompt(1, PAGES * BS), n=1))
        svc.core.add_prefill(work("a", prompt(1, PAGES * BS), n=1), 0.0)
        stored: list = []
        now = 0.0
        while "a" in svc.core.requests:
            plan = svc.core.schedule(now)
            events = svc.core.take_kv_events()
            svc._engine_kv_events(events)
            stored += events
            svc.engine.execute(plan)
            now = plan.end
            svc.core.finish_iteration(plan, now, svc.engine.take_stopped())
        events = svc.core.take_kv_events()
        svc._engine_kv_events(events)
        stored += events
        l2 = [h for ev in stored if isinstance(ev, BlockStored) and ev.tier == "host" for h in ev.block_hashes]
        step, plan = await slow_step(svc, now, "b", keep=set())
        buf = svc.kvpool.buffer
        svc._mirror_pool(stored)
        claimed = set(buf._claimed.values())
        assert len(claimed) == PAGES and not buf.held
        svc._mirror_pool([BlockRemoved(block_hashes=l2[:10], tier="host")])  # evicted before their copy ran
        reserved = []
        while (slot := buf.reserve(10**9 + len(reserved), now)) is not None:  # a fetch takes every slot it can get
            reserved.append(slot)
            buf.slot_view(slot)[:] = 0xEE  # the peer's bytes land
            if buf.free == 0:
                break
        assert len(reserved) == PROFILE.host_blocks - PAGES and not claimed & set(reserved)
        assert not step.done()
        await step
        svc.core.finish_iteration(plan, plan.end, svc.engine.take_stopped())
        await asyncio.gather(*svc._spawned)
        assert not any(buf.has(h) for h in l2[:10])
        for h in l2[10:]:
            assert buf.verify(h) and (buf.view(h)[: svc.engine.pool_slot_bytes()] == _page_bytes(svc.engine, h)).all()
        for i in range(len(reserved)):
            buf.abort(10**9 + i)
        buf.check()
        assert buf.occupancy() == {"held": PAGES - 10, "pending": 0, "free": PROFILE.host_blocks - PAGES + 10, "released": 0}
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


COPY_S = 0.3
"""How long the stand-in of a big batch's copies holds the engine's lock (wall s)."""


class _Bus(_NoBus):
    """The worker's bus where a step publishes (its tokens, its KV batch, its state): recorded."""

    def __init__(self) -> None:
        self.published: list[object] = []

    async def publish(self, subject: str, msg: object, **kw: object) -> None:
        self.published.append(msg)


async def test_copies_asked_during_a_plan_do_not_hold_the_loop_at_its_end(tiny_llama):
    """The copies asked while a plan runs wait for the plan; queued behind it at once, they took the engine's lock
    the moment the forward ended, and the loop's first read of the plan (``take_stopped``, then ``output_tokens``:
    locked calls, ``_run_plan``) waited for all of them. Here a batch's copies hold the lock ``COPY_S`` (a big
    batch of real pages) and the loop reaches its reads 20 ms after the forward (busy with other callbacks): the
    reads must not wait for the copies, which still run before the next plan."""
    from services.worker.watchdog import StepInfo

    svc = _svc(tiny_llama)
    svc.bus = _Bus()  # type: ignore[assignment]
    try:
        svc.engine.accept_prefill(work("a", prompt(1, PAGES * BS), n=1))
        svc.core.add_prefill(work("a", prompt(1, PAGES * BS), n=1), 0.0)
        stored: list = []
        now = 0.0
        while "a" in svc.core.requests:
            plan = svc.core.schedule(now)
            events = svc.core.take_kv_events()
            svc._engine_kv_events(events)
            stored += events
            svc.engine.execute(plan)
            now = plan.end
            svc.core.finish_iteration(plan, now, svc.engine.take_stopped())
        events = svc.core.take_kv_events()
        svc._engine_kv_events(events)
        stored += events
        l2 = [h for ev in stored if isinstance(ev, BlockStored) and ev.tier == "host" for h in ev.block_hashes]
        engine = svc.engine
        copy, reads = engine.copy_to_pool, {}

        def big_copy(pages):  # the copies of a big batch: the engine's lock held COPY_S
            with engine._lock:
                time.sleep(COPY_S)
                return copy(pages)

        def read(name, fn):  # a locked read of the plan on the loop, reached 20 ms after the forward ended
            def call(*args):
                time.sleep(0.02)
                t = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    reads[name] = max(reads.get(name, 0.0), time.perf_counter() - t)

            return call

        engine.copy_to_pool = big_copy  # type: ignore[method-assign]
        engine.take_stopped = read("take_stopped", engine.take_stopped)  # type: ignore[method-assign]
        engine.output_tokens = read("output_tokens", engine.output_tokens)  # type: ignore[method-assign]
        svc.engine.accept_prefill(work("b", prompt(2, 200), n=4))
        svc.core.add_prefill(work("b", prompt(2, 200), n=4), now)
        plan = svc.core.schedule(now)
        forward = engine._forward

        def slow_forward(*args, **kw):
            time.sleep(FORWARD_S)
            return forward(*args, **kw)

        engine._forward = slow_forward  # type: ignore[method-assign]
        svc._steps += 1  # the step loop's step (WorkerService._step)
        svc._step_rids = frozenset(StepInfo.of(plan, svc._steps).rids)
        svc._step_over.clear()
        step = asyncio.ensure_future(svc._run_plan(plan, now, None))
        while engine._lock.acquire(blocking=False):  # until the execute thread runs the plan
            engine._lock.release()
            await asyncio.sleep(0.001)
        engine._forward = forward  # type: ignore[method-assign]
        svc._mirror_pool(stored)  # a drain in a handler during the forward: 75 pages stored in L2
        await asyncio.sleep(0.02)
        assert not step.done()
        await step
        svc._step_rids = frozenset()
        svc._step_over.set()
        assert reads.keys() == {"take_stopped", "output_tokens"}
        assert max(reads.values()) < COPY_S / 2, f"the plan's reads on the loop waited for the copies: {reads}"
        await asyncio.gather(*svc._spawned)
        buf = svc.kvpool.buffer
        for h in l2:  # the copies ran after all, bit-exact
            assert buf.has(h) and buf.verify(h) and (buf.view(h)[: engine.pool_slot_bytes()] == _page_bytes(engine, h)).all()
        buf.check()
        assert not buf._claimed and not buf._pins and not svc.fatal.is_set()
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


def _l2_of_a(svc: WorkerService) -> tuple[list, float]:
    """Request a's 600-token prefill run here (its KV events applied to the engine, not mirrored): the events and the
    time after it."""
    svc.engine.accept_prefill(work("a", prompt(1, PAGES * BS), n=1))
    svc.core.add_prefill(work("a", prompt(1, PAGES * BS), n=1), 0.0)
    stored: list = []
    now = 0.0
    while "a" in svc.core.requests:
        plan = svc.core.schedule(now)
        events = svc.core.take_kv_events()
        svc._engine_kv_events(events)
        stored += events
        svc.engine.execute(plan)
        now = plan.end
        svc.core.finish_iteration(plan, now, svc.engine.take_stopped())
    events = svc.core.take_kv_events()
    svc._engine_kv_events(events)
    return stored + events, now


async def test_a_pool_copy_that_raises_gives_its_slots_back_and_fails_the_node(tiny_llama):
    """An exception in the engine's copy (in the execute thread) after it wrote part of the batch: every claimed
    slot goes back (none held, none left claimed or pinned: a leak would shrink the pool for good) and the node
    fails (the pool would not serve what L2 holds)."""
    svc = _svc(tiny_llama)
    try:
        stored, _ = _l2_of_a(svc)
        copy = svc.engine.copy_to_pool

        def broken(pages):
            copy(pages[: len(pages) // 2])
            raise RuntimeError("a copy failed halfway")

        svc.engine.copy_to_pool = broken  # type: ignore[method-assign]
        svc._mirror_pool(stored)
        buf = svc.kvpool.buffer
        assert buf.pending == PAGES
        await asyncio.wait(svc._spawned)
        buf.check()
        assert buf.occupancy() == {"held": 0, "pending": 0, "free": PROFILE.host_blocks, "released": 0}
        assert not buf._claimed and not buf._pins and not buf._let_go
        assert svc.fatal.is_set() and svc.counters["node_fatal"] == 1 and svc.counters["task_errors"] == 1
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


async def test_a_fetch_copy_that_raises_gives_its_pins_back(tiny_llama):
    """An exception in the engine's copy of a finished fetch's pages (``on_fetched``, in the execute thread): the
    pins of the pages' slots go (an evicted page's slot is freed, not kept for good) and the exception reaches the
    fetch's task (which fails the node)."""
    peer = LocalNode("a", PROFILE, tiny_llama)
    peer.add_prefill(work("w", prompt(5, 10 * BS), n=1))
    peer.run()
    svc = _svc(tiny_llama)
    pool, buf = svc.kvpool, svc.kvpool.buffer
    try:
        hashes = [h for h in peer.engine.host_slot][:10]
        for h in hashes:
            pool.put(h, _page_bytes(peer.engine, h))

        evicted = threading.Event()

        def broken(pages, fetch_id):
            assert all(src is not None for _, src in pages) and evicted.wait(5)
            raise RuntimeError("a copy failed")

        svc.engine.on_fetched = broken  # type: ignore[method-assign]
        taking = asyncio.create_task(svc._take_fetched([FetchResult("a", len(hashes), fetched=tuple(hashes))], 1))
        while not buf._pins:
            await asyncio.sleep(0.001)
        pool.evict(hashes[0])  # L2 dropped it meanwhile: its slot is let go, kept while pinned
        assert buf.released == 1
        evicted.set()
        with pytest.raises(RuntimeError, match="a copy failed"):
            await taking
        buf.check()
        assert not buf._pins and not buf._let_go
        assert buf.occupancy() == {"held": len(hashes) - 1, "pending": 0, "free": PROFILE.host_blocks - len(hashes) + 1, "released": 0}
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


async def test_a_stop_while_copies_wait_for_the_plan_drops_them(tiny_llama):
    """``stop()`` while the copies asked during a plan wait for its reads: the stop does not wait for them (nor hang),
    and they never run (the pool goes with the node), while the plan in flight ends in its thread."""

    svc = _svc(tiny_llama)
    svc.bus = _Bus()  # type: ignore[assignment]
    try:
        stored, now = _l2_of_a(svc)
        copied: list[int] = []
        copy = svc.engine.copy_to_pool

        def counted(pages):
            copied.append(len(pages))
            return copy(pages)

        svc.engine.copy_to_pool = counted  # type: ignore[method-assign]
        step, plan = await slow_step(svc, now, "b", keep=set())
        step.cancel()  # slow_step's own task: the plan below is _run_plan's
        svc._plan_reads = []  # as _run_plan holds them back while its plan runs
        svc._mirror_pool(stored)
        await asyncio.sleep(0.01)
        assert len(svc._plan_reads) == 1 and not copied
        run = asyncio.ensure_future(asyncio.sleep(3600))  # the step loop, cancelled by stop
        svc._tasks.append(run)
        t0 = time.perf_counter()
        await svc.stop()
        svc._plan_read()  # the plan's end (_run_plan's finally): the cancelled copy is not queued
        assert time.perf_counter() - t0 < FORWARD_S / 2
        await asyncio.sleep(FORWARD_S + 0.1)
        assert not copied and svc.kvpool.buffer.pending == PAGES  # claimed for good: the pool went with the node
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


async def test_a_steps_stored_pages_are_copied_before_the_next_forward(tiny_llama):
    """The step loop runs one step after the other without yielding to other tasks in between (``WorkerService._run``):
    the copies of a step's last drain (its computed pages written through to L2) are queued when asked, so they run
    before the next step's forward. Queued by the task the drain spawned, they were queued only once that task first
    ran: behind the next plan, the pages offered to peers a whole forward late."""
    from services.worker.watchdog import StepInfo

    svc = _svc(tiny_llama)
    svc.bus = _Bus()  # type: ignore[assignment]
    engine, pool = svc.engine, svc.kvpool
    order: list[tuple[str, int]] = []  # appended by the loop (claims) and the execute thread (forwards, copies)
    execute, copy, claim = engine.execute, engine.copy_to_pool, pool.claim_events

    def logged(name, fn, n):
        def call(*args):
            out = fn(*args)
            order.append((name, n(args, out)))
            return out

        return call

    engine.execute = logged("forward", execute, lambda a, out: 0)  # type: ignore[method-assign]
    engine.copy_to_pool = logged("copy", copy, lambda a, out: len(a[0]))  # type: ignore[method-assign]
    pool.claim_events = logged("claim", claim, lambda a, out: len(out))  # type: ignore[method-assign]
    try:
        for i in range(2):
            w = work(f"r{i}", prompt(10 + i, 20 * BS), n=2)
            engine.accept_prefill(w)
            svc.core.add_prefill(w, 0.0)
        now, steps = 0.0, 0
        while (plan := svc.core.schedule(now)) is not None:  # the step loop's steps (WorkerService._step)
            steps += 1
            svc._steps += 1
            svc._step_rids = frozenset(StepInfo.of(plan, svc._steps).rids)
            svc._step_over.clear()
            await svc._run_plan(plan, now, None)
            svc._step_rids = frozenset()
            svc._step_over.set()
            now = plan.end
        await asyncio.gather(*svc._spawned)
        claims = [i for i, (name, n) in enumerate(order) if name == "claim" and n]
        assert steps >= 2 and claims and svc.kvpool.buffer.held == 40
        for i in claims:  # each claim's copy runs before the next forward
            later = [name for name, _ in order[i + 1 :]]
            assert "copy" in later and ("forward" not in later or later.index("copy") < later.index("forward")), order
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)
