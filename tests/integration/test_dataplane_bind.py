"""Decode binding at prefill start, live (issue 6 part 3): router, three workers, a real nats-server.

Request B is dispatched to the prefill node w0 while a long prefill (A) occupies
it; between B's dispatch and the start of its prefill the test loads decode node
w2 with a long decode (a hand-off sent straight to it). With
``--decode-binding prefill-start`` (the default) B's decode node is chosen when
its prefill starts — w1, the idle one — through ``route.bind``; with
``dispatch`` it was fixed at dispatch — w2, which was the least loaded then
(A, bound to w1 at its own dispatch, was still running).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from shared import messages as m
from shared.bus import Bus, BusError
from shared.service import serve_until_stopped
from shared.subjects import (
    KV_RESYNC, NODE_STATE, REQ_OUT, ROUTE_BIND, SPLIT_APPLIED, SPLIT_COMMANDS, SVC_STATS, WORK_ABORT, WORK_DECODE, WORK_PREFILL, Subjects,
)
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.prom import worker_families
from services.worker.service import WorkerService
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(90)
BS = 4

SLOW_PREFILL = """
name = "slow-prefill"
block_size = 4
kv_bytes_per_token = 1000
[prefill]
c0 = 0.002
c1 = 2.0e-3
c2 = 0.0
c3 = 1.0e-6
[decode]
d0 = 0.002
d1 = 0.001
d2 = 0.0005
active_experts = 2
experts = 8
tokens_per_forward = 2.0
accepted_per_iteration = 1.5
[memory]
gpu_kv_tokens = 8192
host_kv_tokens = 32768
[links]
gpu_to_gpu_bytes_per_s = 1.0e8
gpu_to_gpu_latency_s = 0.001
[scheduler]
chunk_tokens = 64
max_running = 16
"""


@dataclass
class _Live:
    bus: Bus
    states: dict[str, m.NodeState]
    router: RouterService
    url: str


@asynccontextmanager
async def _live(nats_url: str, tmp_path: Path, workers: dict[str, dict[str, Any]], *, fake_nodes: int = 0,
                bind_delay_s: float = 0.0, **router_kw: Any) -> AsyncIterator[_Live]:
    """In-process workers (node -> extra ``WorkerConfig`` fields; the slow-prefill profile) and a router over a
    real nats-server, on one clock origin; yields once the router is ready and every node (workers and
    ``fake_nodes`` the test reports itself) has a state. ``bind_delay_s``: each worker's route.bind is sent
    that many wall seconds late (a slow control plane: its prefills end before their binding)."""
    profile = tmp_path / "slow.toml"
    profile.write_text(SLOW_PREFILL)
    origin = time.time()
    port_file = tmp_path / "router.port"
    states: dict[str, m.NodeState] = {}
    router: dict[str, RouterService] = {}
    stops: list[asyncio.Event] = []
    tasks: list[asyncio.Task] = []
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-bind")
    try:

        async def on_state(st: m.NodeState, _s: str) -> None:
            states[st.node] = st

        await bus.subscribe(NODE_STATE, on_state)
        for node, kw in workers.items():
            cfg = WorkerConfig(nats_url=nats_url, clock_origin=origin, node=node, profile=str(profile),
                               idle_state_interval_s=0.2, state_interval_s=0.01, **kw)  # fmt: skip
            stops.append(asyncio.Event())
            tasks.append(asyncio.create_task(serve_until_stopped("worker", cfg, _late_binds(bind_delay_s), instance=f"worker-{node}",
                                                                 stop_event=stops[-1])))  # fmt: skip
        rcfg = RouterConfig(
            nats_url=nats_url, clock_origin=origin, port=0, port_file=str(port_file), block_size=BS,
            **{"split_get_timeout_s": 0.2, "lookup_timeout_s": 0.05, "fence_after_s": 5.0, "request_timeout_s": 30.0, **router_kw},
        )  # fmt: skip

        def factory(c, b, clock):
            router["svc"] = RouterService(c, b, clock)
            return router["svc"]

        stops.append(asyncio.Event())
        tasks.append(asyncio.create_task(serve_until_stopped("router", rcfg, factory, instance="router", stop_event=stops[-1])))
        n = len(workers) + fake_nodes
        await until(lambda: port_file.exists() and "svc" in router and router["svc"].ready() and len(states) == n, 15.0, "router ready")
        yield _Live(bus, states, router["svc"], f"http://127.0.0.1:{port_file.read_text().strip()}")
    finally:
        for st in stops:
            st.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()


def _late_binds(delay_s: float) -> Any:
    """A worker factory whose route.bind requests leave ``delay_s`` wall seconds late."""

    def factory(c: WorkerConfig, b: Bus, clock: Any) -> WorkerService:
        if delay_s:
            request = b.request

            async def late(subject: Any, msg: Any, **kw: Any) -> Any:
                if subject is ROUTE_BIND:
                    await asyncio.sleep(delay_s)
                return await request(subject, msg, **kw)

            b.request = late  # type: ignore[method-assign]
        return WorkerService(c, b, clock)

    return factory


async def _complete(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})


@pytest.mark.parametrize("binding,expected", [("prefill-start", "w1"), ("dispatch", "w2")])
async def test_decode_node_is_chosen_when_the_prefill_starts(nats_url, tmp_path: Path, binding: str, expected: str):
    workers = {"w0": {"phase": "prefill"}, "w1": {"phase": "decode"}, "w2": {"phase": "decode"}}
    async with _live(nats_url, tmp_path, workers, decode_binding=binding) as live:
        bus, states, url = live.bus, live.states, live.url
        a = asyncio.create_task(_complete(url, list(range(1, 601)), 1))  # ≈ 1.2 s of prefill on w0
        await until(lambda: states["w0"].running == 1, 15.0, "A prefilling on w0")
        b = asyncio.create_task(_complete(url, list(range(1000, 1040)), 4))
        await until(lambda: len(states["w0"].queue) >= 1 and states["w0"].waiting == 1, 15.0, "B queued on w0 behind A")
        # load w2 now, after B's dispatch and before its prefill starts
        x = m.DecodeWork(rid="x-load", prompt_tokens=8, max_tokens=6_000, block_size=BS, block_hashes=[11, 12],
                         prefill_node="w0", kv_ready_at=0.0)  # fmt: skip
        await bus.publish(WORK_DECODE, x, node="w2")
        await until(lambda: states["w2"].running >= 1, 15.0, "w2 decoding the load")
        assert not b.done() and states["w0"].waiting == 1  # B has not started its prefill yet
        ra, rb = await a, await b
        assert ra.status_code == 200 and rb.status_code == 200, (ra.text, rb.text)
        body = rb.json()
        assert body["usage"]["completion_tokens"] == 4
        assert body["ei"]["decode_node"] == rb.headers["x-ei-decode-node"] == expected
        stats = await bus.request(SVC_STATS, m.StatsRequest(), instance="router", timeout=5.0)
        assert stats.counters.get("bind.ok", 0) == (1 if binding == "prefill-start" else 0)
        if binding == "prefill-start":
            w0 = (await bus.request(SVC_STATS, m.StatsRequest(), instance="worker-w0", timeout=5.0)).counters
            assert w0["bind.ok"] == 1 and w0.get("bind.failed", 0) == 0
        await bus.publish(WORK_ABORT, m.RequestAbort(rid="x-load", reason="test over"), node="w2")
        await until(lambda: states["w2"].running == 0, 15.0, "the load aborted")


async def test_a_slow_binding_is_not_in_the_first_token_and_the_response_names_its_decode_node(nats_url, tmp_path: Path):
    """route.bind answered 1 s after the prefill starts (a slow control plane: × the speed-up in a demo) while
    the prompt takes ~0.1 s: the prefill node sends the first token at the prompt's end, parks the request
    (its KV held) and hands it off once bound; the client gets every token, and the non-streamed response's
    ``x-ei-decode-node`` names the decode node bound after the first token. Before, the first token waited for
    the binding (on-node TTFT ≥ 1 s: the evolving demo's on-node TTFT mean 3.2 s against 0.59 s with
    ``--decode-binding enqueue``), and the header was read at the first token (no decode node then)."""
    workers = {"w0": {"phase": "prefill"}, "w1": {"phase": "decode"}}
    async with _live(nats_url, tmp_path, workers, decode_binding="prefill-start", routing="ttft", bind_delay_s=1.0) as live:
        r = await _complete(live.url, list(range(1, 41)), 4)  # ≈ 0.08 s of prefill on w0
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4
        assert body["ei"]["decode_node"] == r.headers["x-ei-decode-node"] == "w1"
        on_node = body["ei"]["first_token_at"] - body["ei"]["arrived_at"]
        assert on_node < 0.7, f"on-node TTFT {on_node:.3f} s holds the 1-s binding"
        w0 = (await live.bus.request(SVC_STATS, m.StatsRequest(), instance="worker-w0", timeout=5.0)).counters
        assert w0["bind.ok"] == 1 and w0["bind.after_prefill"] == 1 and w0["requests.handed_off"] == 1, w0
        assert live.router.core.view.inflight_total == 0 and live.router.core.policy._decode_reserved == {}  # type: ignore[attr-defined]


async def test_prefill_fails_cleanly_when_no_router_binds_a_decode_node(nats_url):
    """No router answers route.bind: the started prefill fails with an abort chunk at once
    (nobody serves the owner's route.bind: its router is gone, issue #22; a router that does not
    answer at all is waited for up to ``owner_gone_after_s``, the next test), nothing hangs, and the
    node is left empty."""
    chunks: list[m.TokenChunk] = []
    async with AsyncExitStack() as stack:
        bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-nobind")
        stack.push_async_callback(bus.close)

        async def on_chunk(c: m.TokenChunk, _s: str) -> None:
            chunks.append(c)

        await bus.subscribe(REQ_OUT, on_chunk)
        stop = asyncio.Event()
        cfg = WorkerConfig(nats_url=nats_url, node="w0", phase="prefill", profile="tiny", bind_timeout_s=0.3, check_invariants=True)
        task = asyncio.create_task(serve_until_stopped("worker", cfg, WorkerService, instance="worker-w0", stop_event=stop))

        async def stopper() -> None:
            stop.set()
            await task

        stack.push_async_callback(stopper)
        for _ in range(100):
            try:
                await bus.request(SVC_STATS, m.StatsRequest(), instance="worker-w0", timeout=0.2)
                break
            except BusError:
                await asyncio.sleep(0.02)
        work = m.PrefillWork(rid="lonely", prompt_tokens=9, max_tokens=4, block_size=BS, block_hashes=[1, 2], decode_binding="start")
        await bus.publish(WORK_PREFILL, work, node="w0")
        await until(lambda: any(c.finished for c in chunks), timeout=10, what="the error chunk")
        # its first token goes out at its prompt's end when the prefill ends before route.bind's "no
        # responders" comes back (ea82da0): then the error follows it (before: '(c,) = chunks' failed
        # in 1 of 4 runs here, 'too many values to unpack')
        *first, c = chunks
        assert [(x.index, len(x.token_ids), x.finished) for x in first] in ([], [(0, 1, False)]), first
        assert c.finish_reason == "abort" and "no decode node" in (c.error or "")  # the cluster's state, not an engine error
        stats = (await bus.request(SVC_STATS, m.StatsRequest(), instance="worker-w0", timeout=2.0))
        assert stats.counters["bind.failed"] == 1 and stats.gauges["running"] == 0 and stats.gauges["waiting"] == 0
        assert stats.counters["bind.owner_gone"] == 1 and stats.counters.get("bind.retries", 0) == 0
        assert not {k for k in stats.counters if k in ("node_fatal", "engine_fatal", "task_errors")}  # the node served on


async def test_a_bind_without_reply_is_waited_for_past_bind_timeout(nats_url):
    """The owning router (or NATS) hangs: route.bind gets no reply at all for 2 s, ~7x the worker's
    ``bind_timeout_s``, then the router answers. That wait is not the router saying no decode node is
    eligible: the prefill is bound and goes on. Before, it failed at ``bind_timeout_s`` with an abort
    ('no decode node for the request: no reply on route.bind...: TimeoutError'): a 15-s SIGSTOP of
    nats-server lost the 2 requests whose prefill was binding, with every node and the router alive.
    Then each unanswered try's 0.05-s pause still counted toward ``bind_timeout_s`` (0.3 s here: six
    tries, ~1.35 s of hang at most): a 2-s hang failed the prefill."""
    chunks: list[m.TokenChunk] = []
    asked: list[float] = []
    async with AsyncExitStack() as stack:
        bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-hungbind")
        stack.push_async_callback(bus.close)

        async def on_chunk(c: m.TokenChunk, _s: str) -> None:
            chunks.append(c)

        async def on_bind(req: m.DecodeBindRequest, _s: str) -> m.DecodeBindReply | None:
            asked.append(time.monotonic())
            if asked[-1] - asked[0] < 2.0:
                return None  # hung: no reply
            return m.DecodeBindReply(rid=req.rid, decode_node="w1")

        await bus.subscribe(REQ_OUT, on_chunk)
        await bus.serve(ROUTE_BIND, on_bind, router="rt")
        stop = asyncio.Event()
        cfg = WorkerConfig(nats_url=nats_url, node="w0", phase="prefill", profile="tiny", bind_timeout_s=0.3, owner_gone_after_s=10.0,
                           owner_check_interval_s=0, check_invariants=True)  # fmt: skip
        task = asyncio.create_task(serve_until_stopped("worker", cfg, WorkerService, instance="worker-w0", stop_event=stop))

        async def stopper() -> None:
            stop.set()
            await task

        stack.push_async_callback(stopper)
        for _ in range(100):
            try:
                await bus.request(SVC_STATS, m.StatsRequest(), instance="worker-w0", timeout=0.2)
                break
            except BusError:
                await asyncio.sleep(0.02)
        work = m.PrefillWork(rid="hung", prompt_tokens=9, max_tokens=4, block_size=BS, block_hashes=[1, 2], decode_binding="start", router="rt")
        await bus.publish(WORK_PREFILL, work, node="w0")
        stats = None
        for _ in range(100):
            stats = await bus.request(SVC_STATS, m.StatsRequest(), instance="worker-w0", timeout=2.0)
            if stats.counters.get("bind.ok") or stats.counters.get("bind.failed"):
                break
            await asyncio.sleep(0.05)
        assert stats is not None
    assert stats.counters.get("bind.failed", 0) == 0 and stats.counters["bind.ok"] == 1, stats.counters
    assert stats.counters["bind.unanswered"] >= 2 and asked[-1] - asked[0] >= 2.0
    assert not [c for c in chunks if c.finish_reason in ("abort", "error")], chunks


async def test_a_prefill_that_starts_with_no_decode_node_left_fails_with_a_503_not_a_500(nats_url, tmp_path: Path):
    """1P1D; the only decode node (w1, played by the test: its node states) goes silent while A prefills on w0
    (bound to w1) and B waits behind it. w1 is fenced: A, which depends on it, is re-dispatched, finds no decode
    node and fails after ``--requeue-wait-s``; B's prefill starts (A dropped) and ``route.bind`` finds no decode
    node for ``--bind-timeout-s``. Both clients get a 503 naming the missing decode node. Before, B got a 500
    ``engine error on node w0: no decode node for the request ...``: the node's refusal was an ``error`` chunk
    although nothing failed in an engine (now an ``abort`` chunk, as for other work a node cannot serve)."""
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-w1")
    w1_alive = True

    async def w1_states() -> None:  # the decode node's liveness, until it "dies"
        while w1_alive:
            st = m.NodeState(node="w1", phase="decode", epoch=0, block_size=BS, gpu_free_blocks=1000, gpu_total_blocks=1000)
            await bus.publish(NODE_STATE, st, node="w1")
            await asyncio.sleep(0.1)

    beat = asyncio.create_task(w1_states())
    try:
        workers = {"w0": {"phase": "prefill", "bind_timeout_s": 0.5}}
        async with _live(nats_url, tmp_path, workers, fake_nodes=1, decode_binding="prefill-start", fence_after_s=1.0,
                         requeue_wait_s=1.0) as live:  # fmt: skip
            states, url = live.states, live.url
            a = asyncio.create_task(_complete(url, list(range(1, 2001)), 4))  # ≈ 4 s of prefill on w0, bound to w1 at its start
            await until(lambda: states["w0"].running == 1, 15.0, "A prefilling on w0")
            b = asyncio.create_task(_complete(url, list(range(3000, 3040)), 4))
            await until(lambda: states["w0"].waiting == 1, 15.0, "B queued on w0 behind A")
            w1_alive = False  # the decode node dies
            ra, rb = await asyncio.wait_for(a, 20), await asyncio.wait_for(b, 20)
            for r in (ra, rb):
                assert r.status_code == 503, r.text
                assert "no live decode" in r.json()["error"]["message"], r.text
            assert "no decode node for the request" in rb.json()["error"]["message"], rb.text
            w0 = (await bus.request(SVC_STATS, m.StatsRequest(), instance="worker-w0", timeout=5.0)).counters
            assert w0["bind.failed"] == 1
            svc = live.router
            assert svc._pending == {} and svc._parked == {} and svc.core.view.inflight_total == 0
    finally:
        w1_alive = False
        await beat
        await bus.close()



@asynccontextmanager
async def _prefill_node(nats_url: str, routers: dict[str, Any], *, worker_url: str | None = None,
                        gates: dict[tuple[str, str], asyncio.Event] | None = None, **cfg_kw: Any) -> AsyncIterator[tuple[Bus, WorkerService, list[Any]]]:
    """An in-process prefill worker ``w0`` (tiny profile, no owner checks, no planner) over a real nats-server
    (``worker_url``: its own URL, e.g. with credentials); the test's bus serves ``route.bind.<router>`` for each
    of ``routers`` (router -> handler) and records what the worker publishes (in the worker's order) for clients
    and decode nodes, and its split announcements: ``(kind, message, monotonic s)``, kind ``chunk``, ``handoff``
    or ``applied``. ``gates``: (kind, rid) -> an event the worker's first publish of that kind (``chunk`` or
    ``handoff``) of that rid waits for."""
    seen: list[Any] = []
    made: dict[str, WorkerService] = {}
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-binds")
    stop = asyncio.Event()
    task = None
    try:

        for router, handler in routers.items():
            await bus.serve(ROUTE_BIND, handler, router=router)
        cfg = WorkerConfig(nats_url=worker_url or nats_url, node="w0", phase="prefill", profile="tiny", owner_check_interval_s=0,
                           split_get_timeout_s=0, check_invariants=True, **cfg_kw)  # fmt: skip

        kinds = {REQ_OUT: "chunk", WORK_DECODE: "handoff", SPLIT_APPLIED: "applied"}

        def factory(c: WorkerConfig, b: Bus, clock: Any) -> WorkerService:
            publish = b.publish

            async def recorded(subject: Any, msg: Any, **kw: Any) -> None:
                if gates and subject in kinds and (kinds[subject], getattr(msg, "rid", None)) in gates:
                    await gates.pop((kinds[subject], msg.rid)).wait()
                await publish(subject, msg, **kw)
                if subject in kinds:
                    seen.append((kinds[subject], msg, time.monotonic()))

            b.publish = recorded  # type: ignore[method-assign]
            made["w0"] = WorkerService(c, b, clock)
            return made["w0"]

        task = asyncio.create_task(serve_until_stopped("worker", cfg, factory, instance="worker-w0", stop_event=stop))
        await until(lambda: "w0" in made and made["w0"].ready(), 10.0, "worker w0 started")
        yield bus, made["w0"], seen
    finally:
        stop.set()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        await bus.close()


def _bind_work(rid: str, router: str, first: int = 1) -> m.PrefillWork:
    return m.PrefillWork(rid=rid, prompt_tokens=9, max_tokens=4, block_size=BS, block_hashes=[first, first + 1], decode_binding="start",
                         router=router)  # fmt: skip


def _of(seen: list[Any], rid: str) -> list[tuple[str, int | None]]:
    """What the worker published for ``rid``: (kind, chunk index or None), in order."""
    return [(k, getattr(x, "index", None)) for k, x, _ in seen if k != "applied" and x.rid == rid]


class _Router:
    """A router's route.bind as the test plays it: no reply while ``hung`` (SIGSTOPped), else decode node w1."""

    def __init__(self, hung: bool) -> None:
        self.hung = hung
        self.asked: list[str] = []

    async def __call__(self, req: m.DecodeBindRequest, _s: str) -> m.DecodeBindReply | None:
        self.asked.append(req.rid)
        return None if self.hung else m.DecodeBindReply(rid=req.rid, decode_node="w1")


async def _parked(bus: Bus, w0: WorkerService, router: _Router, rid: str = "h") -> None:
    """Send ``rid`` (owned by the hung ``router``) to w0 and return once its prefill finished, unbound."""
    await bus.publish(WORK_PREFILL, _bind_work(rid, "hung"), node="w0")
    await until(lambda: rid in router.asked and rid in w0.core.parked, 5.0, f"{rid}'s prefill over, its route.bind unanswered")


def _no_fatal(w0: WorkerService) -> None:
    assert not {k for k in w0.counters if k in ("node_fatal", "engine_fatal", "task_errors")}, w0.counters


async def test_a_hung_owning_router_does_not_stall_the_other_routers_requests(nats_url):
    """Two routers own requests on one prefill node; one hangs (SIGSTOPped: its route.bind gets no reply)
    once the node started its request. The other router's request is prefilled and handed off at once; the
    hung router's request gives its first token at its prompt's end and waits beside the step loop, its KV
    held, until its router answers: then its hand-off goes out. Before 77f120e its first token waited for
    the binding too (its TTFT held the route.bind round trip), and the node waited for the binding inside its step
    loop for up to ``owner_gone_after_s`` (10 s here: the healthy router's request was handed off after
    9.8 s, when the hung one's binding gave up; the fault walk, 2P2D with a router SIGSTOPped: every request
    of the other routers on that prefill node stalled ~30 s)."""
    hung, ok = _Router(hung=True), _Router(hung=False)
    async with _prefill_node(nats_url, {"hung": hung, "ok": ok}, bind_timeout_s=0.3, owner_gone_after_s=10.0) as (bus, w0, seen):
        await _parked(bus, w0, hung)
        sent = time.monotonic()
        await bus.publish(WORK_PREFILL, _bind_work("f", "ok", first=5), node="w0")
        await until(lambda: ("handoff", None) in _of(seen, "f"), 15.0, "f handed off")
        waited = next(t for k, x, t in seen if k == "handoff" and x.rid == "f") - sent
        assert waited < 1.0, f"the healthy router's request waited {waited:.2f} s for the hung router's binding"
        assert _of(seen, "f") == [("chunk", 0), ("handoff", None)]
        assert _of(seen, "h") == [("chunk", 0)]  # h's first token is out; its hand-off waits for its binding
        gpu = w0.core.kv.gpu
        assert "h" in w0.core.parked and gpu.available < gpu.capacity  # its KV is held meanwhile
        # NodeState counts it neither running nor waiting: the parked gauge shows it (before: no gauge said so)
        gauges = w0.stats()[1]
        assert (gauges["parked"], gauges["running"], gauges["waiting"]) == (1.0, 0.0, 0.0), gauges
        assert {f.name: f.samples[0].value for f in worker_families(w0)}["ei_node_parked"] == 1.0
        hung.hung = False  # the router answers again
        await until(lambda: ("handoff", None) in _of(seen, "h"), 10.0, "h handed off")
        assert _of(seen, "h") == [("chunk", 0), ("handoff", None)]  # the first token, then the hand-off
        await until(lambda: not w0.core.requests and not w0._handing_off, 5.0, "w0 empty")
        assert w0.stats()[1]["parked"] == 0.0
        c = w0.counters  # (f may have parked too: its prefill of a few ms can end before its binding's reply)
        assert c["bind.ok"] == 2 and c["bind.after_prefill"] >= 1 and c.get("bind.failed", 0) == 0 and c["requests.handed_off"] == 2, c
        _no_fatal(w0)


async def test_a_parked_prefill_whose_binding_fails_is_aborted_and_frees_its_kv(nats_url):
    """The hung router never answers: at ``owner_gone_after_s`` the parked request fails as a binding that
    fails while the prefill runs does (an ``abort`` chunk naming the reason, its pages released): its stream,
    whose first token went out at its prompt's end, ends with that error (the router's 503); the node
    serves on."""
    hung = _Router(hung=True)
    async with _prefill_node(nats_url, {"hung": hung}, bind_timeout_s=0.3, owner_gone_after_s=1.0) as (bus, w0, seen):
        await _parked(bus, w0, hung)
        await until(lambda: len(_of(seen, "h")) == 2, 5.0, "h's error chunk")
        first, c = [x for k, x, _ in seen if k == "chunk"]
        assert (first.index, len(first.token_ids), first.finished) == (0, 1, False), first
        assert c.finished and c.finish_reason == "abort" and "no decode node" in (c.error or ""), c
        # stamped with its owner, as its first token was (a peer router counts it chunks_peer_rid); before, the
        # failed binding had forgotten the owner when it rejected the request: router ""
        assert (first.router, c.router) == ("hung", "hung"), c
        assert not w0.core.requests and not w0._binds and w0.core.kv.gpu.reserved == 0
        assert w0.counters["bind.failed"] == 1 and w0.counters["bind.unanswered"] >= 1
        _no_fatal(w0)


async def test_a_request_that_ends_at_its_first_token_while_binding_is_not_a_failed_binding(nats_url):
    """A real engine ends the request at its first token (end-of-sequence: ``take_stopped``) while its
    route.bind is under way; the router, which has its end, then answers "not pending". Nothing failed:
    the client got ``stop``, no abort chunk follows, and the node counts ``bind.after_end``. Before, it
    counted ``bind.failed`` (read as a binding that failed a request)."""
    ended = asyncio.Event()

    async def router(req: m.DecodeBindRequest, _s: str) -> m.DecodeBindReply:
        await ended.wait()  # the router answers once the request's end reached it
        return m.DecodeBindReply(rid=req.rid, reason="request is not pending at the router")

    async with _prefill_node(nats_url, {"r": router}, bind_timeout_s=2.0) as (bus, w0, seen):
        w0.engine.take_stopped = lambda: {"e": 1}  # type: ignore[method-assign]  # EOS as its first token
        await bus.publish(WORK_PREFILL, _bind_work("e", "r"), node="w0")
        await until(lambda: any(k == "chunk" and x.finished for k, x, _ in seen), 5.0, "e's end")
        ended.set()
        await until(lambda: not w0._binds, 5.0, "e's binding over")
        [c] = [x for k, x, _ in seen if k == "chunk"]
        assert (c.index, c.finished, c.finish_reason) == (0, True, "stop"), c
        assert w0.counters["bind.after_end"] == 1 and w0.counters.get("bind.failed", 0) == 0, w0.counters
        _no_fatal(w0)


async def test_a_binding_that_names_a_decode_node_after_the_request_ended_counts_one_after_end(nats_url):
    """The other order of the test above: the router names a decode node (it had not seen the end yet) for a
    request that ended here at its first token. Nothing to bind or hand off, nothing failed: one
    ``bind.after_end``, no ``bind.ok``, ``bind.failed`` nor hand-off, and the binding task is gone."""
    ended = asyncio.Event()

    async def router(req: m.DecodeBindRequest, _s: str) -> m.DecodeBindReply:
        await ended.wait()
        return m.DecodeBindReply(rid=req.rid, decode_node="w1")

    async with _prefill_node(nats_url, {"r": router}, bind_timeout_s=2.0) as (bus, w0, seen):
        w0.engine.take_stopped = lambda: {"e": 1}  # type: ignore[method-assign]  # EOS as its first token
        await bus.publish(WORK_PREFILL, _bind_work("e", "r"), node="w0")
        await until(lambda: any(k == "chunk" and x.finished for k, x, _ in seen), 5.0, "e's end")
        ended.set()
        await until(lambda: not w0._binds, 5.0, "e's binding over")
        assert _of(seen, "e") == [("chunk", 0)] and not w0.core.requests
        assert w0.counters["bind.after_end"] == 1, w0.counters
        assert not {k: v for k, v in w0.counters.items() if k in ("bind.ok", "bind.failed") and v}, w0.counters
        _no_fatal(w0)


async def test_a_drain_waits_for_a_parked_prefill_and_a_stop_cancels_its_binding(nats_url):
    """A phase switch of the prefill node waits for the parked request's hand-off before it says
    ``serving`` (it counts in flight, as while the step loop waited for its binding); a worker stopped
    with a request parked ends its binding task (no task left pending)."""
    hung = _Router(hung=True)
    async with _prefill_node(nats_url, {"hung": hung}, bind_timeout_s=0.3, owner_gone_after_s=10.0) as (bus, w0, seen):
        await _parked(bus, w0, hung)
        await bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=1, phases={"w0": "decode", "w2": "prefill"}, reason="to decode", decided_at=w0.clock.now()))
        await until(lambda: [a.status for k, a, _ in seen if k == "applied"] == ["draining"], 5.0, "w0 draining")
        await asyncio.sleep(0.5)
        assert [a.status for k, a, _ in seen if k == "applied"] == ["draining"] and w0.core.phase == "prefill"
        hung.hung = False
        await until(lambda: [a.status for k, a, _ in seen if k == "applied"] == ["draining", "serving"], 10.0, "w0 serving decode")
        kinds = [(k, getattr(x, "status", None) or getattr(x, "index", None)) for k, x, _ in seen]
        assert kinds.index(("handoff", None)) < kinds.index(("applied", "serving")), kinds
        assert w0.core.phase == "decode"
        _no_fatal(w0)
    hung2 = _Router(hung=True)
    async with _prefill_node(nats_url, {"hung": hung2}, bind_timeout_s=0.3, owner_gone_after_s=10.0) as (bus, w0, seen):
        await _parked(bus, w0, hung2)
        task = w0._binds["h"]
        await w0.stop()
        assert task.cancelled() and not w0._binds and not w0._handing_off


async def test_a_bind_this_identity_may_not_publish_fails_at_once(nats_url, tmp_path: Path):
    """The worker's NATS identity may not publish ``route.bind.<router>`` (a real nats-server's permissions):
    nats-py reports the violation and the request raises ``PermissionDenied`` at its timeout. The request
    fails after that one try (``bind.denied``) instead of being retried as an unanswered one for
    ``owner_gone_after_s`` (10 s here)."""
    from shared.natsserver import EmbeddedNatsServer

    block = ('authorization { users = [ {user: "test", password: "pw"}, '
             '{user: "worker", password: "pw", permissions: {publish: {allow: [">"], deny: ["ei.p0.route.bind.>"]}}} ] }')  # fmt: skip
    with EmbeddedNatsServer(jetstream=False, auth_block=block) as srv:
        url = srv.url.replace("nats://", "nats://test:pw@")
        ok = _Router(hung=False)
        async with _prefill_node(url, {"ok": ok}, worker_url=srv.url.replace("nats://", "nats://worker:pw@"), bind_timeout_s=0.3,
                                 owner_gone_after_s=10.0) as (bus, w0, seen):  # fmt: skip
            sent = time.monotonic()
            await bus.publish(WORK_PREFILL, _bind_work("d", "ok"), node="w0")
            await until(lambda: any(x.finished for k, x, _ in seen if k == "chunk"), 8.0, "d's error chunk")
            took = time.monotonic() - sent
            *first, c = [x for k, x, _ in seen if k == "chunk"]  # its first token goes out at its prompt's end
            assert [(x.index, x.finished) for x in first] in ([], [(0, False)]), first
            assert c.finish_reason == "abort" and "Permissions Violation" in (c.error or ""), c
            assert took < 2.0, f"failed after {took:.2f} s"
            assert ok.asked == [] and w0.counters["bind.denied"] == 1 and w0.counters.get("bind.retries", 0) == 0, w0.counters
            assert not w0.core.requests
            _no_fatal(w0)


async def test_a_bind_the_router_refuses_as_invalid_fails_at_once(nats_url):
    """The router refuses the worker's ``route.bind`` as invalid (its node set lacks ``w0``, the request's
    ``prefill_node``): its reply says so at once (``Ei-Refused``), and the same request would be refused again.
    The request fails after that one try (``bind.refused``). Before, the refusal was a plain ``BusError``,
    retried until ``bind_timeout_s`` (2 s here) and the request failed then."""
    ok = _Router(hung=False)
    async with _prefill_node(nats_url, {"ok": ok}, bind_timeout_s=2.0, owner_gone_after_s=10.0) as (bus, w0, seen):
        bus.known_nodes = frozenset({"w9"})  # the router's node set, without w0
        sent = time.monotonic()
        await bus.publish(WORK_PREFILL, _bind_work("r", "ok"), node="w0")
        await until(lambda: any(x.finished for k, x, _ in seen if k == "chunk"), 8.0, "r's error chunk")
        took = time.monotonic() - sent
        c = [x for k, x, _ in seen if k == "chunk"][-1]
        assert c.finish_reason == "abort" and "refused" in (c.error or "") and "prefill_node" in (c.error or ""), c
        assert took < 1.0, f"failed after {took:.2f} s"
        assert ok.asked == [] and w0.counters["bind.refused"] == 1 and w0.counters.get("bind.retries", 0) == 0, w0.counters
        assert not w0.core.requests
        # and its /metrics says so (before: only its JSON stats)
        fams = {f.name: f.samples[0].value for f in worker_families(w0)}
        assert fams["ei_node_bind_refused"] == 1.0 and fams["ei_node_bind_failures"] == 1.0, fams
        _no_fatal(w0)


async def test_new_work_of_a_request_waits_for_its_parked_hand_off_to_go_out(nats_url):
    """A new attempt of a request arrives while the hand-off of its old attempt (parked, then bound) is
    being published by the binding's task: it is taken only once it is out, as new work waits for a step
    that runs its rid. Else the new attempt's first token went out before the old one's hand-off (and the
    old hand-off took its owner record). A KV drain meanwhile (a ``kv.resync``) keeps the
    engine's registration of the request being handed off (a torch engine reads its pages for the hand-off)."""
    hung = _Router(hung=True)
    gate = asyncio.Event()
    async with _prefill_node(nats_url, {"hung": hung}, gates={("handoff", "h"): gate}, bind_timeout_s=0.3,
                             owner_gone_after_s=10.0) as (bus, w0, seen):  # fmt: skip
        await _parked(bus, w0, hung)
        hung.hung = False
        await until(lambda: "h" in w0._handing_off, 5.0, "h bound, its hand-off held at the gate")
        await bus.publish(WORK_PREFILL, msgspec.structs.replace(_bind_work("h", "hung"), attempt=1), node="w0")
        lives: list[bool] = []
        drain = w0.engine.on_kv_events

        def on_kv_events(events: Any, live: Any, snapshot: Any = None) -> None:
            lives.append("h" in live)
            drain(events, live, snapshot)

        w0.engine.on_kv_events = on_kv_events  # type: ignore[method-assign]
        await bus.request(KV_RESYNC, m.KvResyncRequest(node="w0"), node="w0", timeout=2.0)
        assert lives == [True], lives
        await asyncio.sleep(0.3)
        gate.set()
        await until(lambda: len([k for k, _, _ in seen if k == "handoff"]) == 2, 10.0, "both attempts handed off")
        assert [(k, x.attempt) for k, x, _ in seen] == [("chunk", 0), ("handoff", 0), ("chunk", 1), ("handoff", 1)], seen
        assert w0.counters["requests.waited_for_handoff"] == 1
        _no_fatal(w0)


async def test_a_binding_that_comes_while_the_first_token_is_being_published_waits_for_it(nats_url):
    """The router answers route.bind while the step that completed the (parked) prompt is still publishing
    its first token (held here at a gate): the hand-off goes out only after that first token, so the decode
    node's output can never reach the client before the first token. Without the wait the hand-off went
    out first ([handoff, chunk 0]): the router would have taken the decode node's tokens for positions 0..
    and dropped the first token as a duplicate."""
    hung = _Router(hung=True)
    gate = asyncio.Event()
    async with _prefill_node(nats_url, {"hung": hung}, gates={("chunk", "h"): gate}, bind_timeout_s=0.3,
                             owner_gone_after_s=10.0) as (bus, w0, seen):  # fmt: skip
        await _parked(bus, w0, hung)  # parked, its first token's publish held at the gate
        asked = len(hung.asked)
        hung.hung = False
        await until(lambda: len(hung.asked) > asked, 5.0, "route.bind answered")
        await asyncio.sleep(0.3)  # time enough for a hand-off that does not wait
        assert _of(seen, "h") == []
        gate.set()
        await until(lambda: ("handoff", None) in _of(seen, "h"), 5.0, "h handed off")
        assert _of(seen, "h") == [("chunk", 0), ("handoff", None)]
        assert w0.counters["bind.after_prefill"] == 1
        _no_fatal(w0)


async def test_a_request_aborted_while_its_first_token_is_being_published_leaves_no_stream_behind(nats_url):
    """A client's abort lands while the step that completed its (parked) prompt is still publishing its
    first token (held here at a gate): the abort drops it (its binding cancelled, its KV freed, an abort
    chunk), and the step, resumed, leaves no stream record of it. Before, the step made the record
    (``_Stream(start=1)``) after the publish for a request already dropped: nothing ever removed it (no
    hand-off, no more output), one record left behind per such abort."""
    hung = _Router(hung=True)
    gate = asyncio.Event()
    async with _prefill_node(nats_url, {"hung": hung}, gates={("chunk", "h"): gate}, bind_timeout_s=0.3,
                             owner_gone_after_s=10.0) as (bus, w0, seen):  # fmt: skip
        await _parked(bus, w0, hung)  # parked, its first token's publish held at the gate
        await bus.publish(WORK_ABORT, m.RequestAbort(rid="h", reason="client gone"), node="w0")
        await until(lambda: any(k == "chunk" and x.finish_reason == "abort" for k, x, _ in seen), 5.0, "h's abort chunk")
        assert not w0.core.requests and not w0._binds
        gate.set()
        await until(lambda: ("chunk", 0) in _of(seen, "h") and "h" not in w0._step_rids, 5.0, "h's first token out, its step over")
        assert "h" not in w0._streams, w0._streams
        assert w0.counters["requests.aborted"] == 1 and w0.core.kv.gpu.reserved == 0
        _no_fatal(w0)


async def test_a_switch_that_comes_while_a_parked_hand_off_goes_out_waits_for_it(nats_url):
    """The parked request was bound and its hand-off is being published (held here at a gate) when a phase
    switch comes: the core holds no request any more, but the switch drains for the hand-off as for one still
    parked, and says ``serving`` only once it is out. Before, a core with no request was taken for a drained
    node: ``serving`` (decode) went out while the prefill's hand-off was still going out."""
    hung = _Router(hung=True)
    gate = asyncio.Event()
    async with _prefill_node(nats_url, {"hung": hung}, gates={("handoff", "h"): gate}, bind_timeout_s=0.3,
                             owner_gone_after_s=10.0) as (bus, w0, seen):  # fmt: skip
        await _parked(bus, w0, hung)
        hung.hung = False
        await until(lambda: "h" in w0._handing_off and not w0.core.requests, 5.0, "h bound, its hand-off held at the gate")
        await bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=1, phases={"w0": "decode", "w2": "prefill"}, reason="to decode", decided_at=w0.clock.now()))
        await until(lambda: any(k == "applied" for k, _, _ in seen), 5.0, "w0's split.applied")
        await asyncio.sleep(0.2)
        assert [a.status for k, a, _ in seen if k == "applied"] == ["draining"] and w0.core.phase == "prefill", seen
        gate.set()
        await until(lambda: [a.status for k, a, _ in seen if k == "applied"] == ["draining", "serving"], 5.0, "w0 serving decode")
        kinds = [(k, getattr(x, "status", None) or getattr(x, "index", None)) for k, x, _ in seen]
        assert kinds.index(("handoff", None)) < kinds.index(("applied", "serving")), kinds
        _no_fatal(w0)
