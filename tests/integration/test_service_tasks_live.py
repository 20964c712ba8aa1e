"""The background tasks of the router, the planner and the KV directory are watched, live (real
nats-server, in-process services through ``serve_until_stopped``).

Before, none of them was: one exception in the router's fence loop (the ``assert`` in
``_redispatch``, a core bug) ended fencing for the router's lifetime while it answered ready
(dead nodes' requests waited ``request_timeout_s``, parked ones never expired); the router's HTTP
server could end and the router serve on without it; one failed publish ended the planner's
announcements or its planning; a KV directory resync that failed other than on the bus died with
no log and no count. Now (``shared.service.BackgroundTasks``): a re-dispatch that fails fails that
request alone and fencing goes on, as does work whose placement again raises; any other end of a task the router needs fails the router
(``ServiceFailed``: exit 1, its supervisor restarts it) and makes it not ready; a failed planner
round is logged with the traceback, counted, and its loop goes on; a failed resync is logged with
the traceback and counted. Faults are injected by patching the services' own methods.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from services.kvdirectory.config import DirectoryConfig
from services.kvdirectory.core import KvDirectory
from services.kvdirectory.service import DirectoryService
from services.planner.config import PlannerConfig
from services.planner.service import PlannerService
from services.router.config import RouterConfig
from services.router.service import RouterService
from shared import messages as m
from shared.bus import Bus
from shared.service import ServiceFailed, serve_until_stopped
from shared.subjects import KV_EVENTS, KV_RESYNC, SPLIT_COMMANDS, Subjects
from tests.integration.polling import answering, until
from tests.integration.test_router_live import FakeCluster, router_env

pytestmark = pytest.mark.timeout(60)


def errors(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e.get("event") == event and e.get("log_level") == "error"]


# --------------------------------------------------------------------------- router


async def test_a_redispatch_that_fails_fails_that_request_only_and_fencing_goes_on(nats_url, tmp_path: Path, monkeypatch):
    real = RouterService._redispatch
    broken: list[str] = []

    def redispatch(self: RouterService, p: Any, node: str, reason: str) -> None:
        if not broken:  # the first re-dispatch fails as the assert in _redispatch does
            broken.append(p.rid)
            raise AssertionError("injected: p.rreq is None")
        real(self, p, node, reason)

    monkeypatch.setattr(RouterService, "_redispatch", redispatch)
    phases = {"n0": "both", "n1": "both", "n2": "both"}
    with structlog.testing.capture_logs() as logs:
        async with router_env(nats_url, tmp_path, phases, fence_after_s=0.5) as env:
            env.cluster.answering.clear()  # every node takes work and never answers
            svc = env.service

            async def placed_on(body: dict[str, Any]) -> tuple[asyncio.Task[httpx.Response], str]:
                n = len(env.cluster.works)
                req = asyncio.create_task(env.http.post("/v1/completions", json=body))
                await until(lambda: len(env.cluster.works) > n, 3.0, "work sent")
                rid = env.cluster.works[-1].rid
                return req, (svc.core.view.placement(rid) or ("?",))[0]

            first, a = await placed_on({"prompt": [1, 2, 3], "max_tokens": 4})
            env.cluster.alive.discard(a)  # its node goes silent: fenced, its re-dispatch fails
            t0 = time.monotonic()
            r = await asyncio.wait_for(first, 5.0)  # before: it waited for request_timeout_s (20 s)
            assert r.status_code == 503 and "re-dispatch failed" in r.text and "injected" in r.text, r.text
            assert time.monotonic() - t0 < 3.0
            assert svc.counters["fence.request_errors"] == 1 and svc.ready()
            # fencing goes on: the next silent node's request is re-dispatched to the node left
            second, b = await placed_on({"prompt": [4, 5, 6], "max_tokens": 4})
            assert b != a
            env.cluster.answering.update(set(phases) - {a, b})
            env.cluster.alive.discard(b)
            r = await asyncio.wait_for(second, 5.0)
            assert r.status_code == 200 and r.json()["ei"]["redispatches"] == 1, r.text
            assert svc.counters["fenced"] == 2 and not svc.fatal.is_set()
    [line] = errors(logs, "re-dispatch after a fence failed; request failed")
    assert line["rid"] == broken[0] and line["node"] == a and isinstance(line["exc_info"], AssertionError)


async def test_work_that_cannot_be_placed_again_fails_its_request_at_once(nats_url, tmp_path: Path, monkeypatch):
    """A re-dispatch whose placement raises (here: NATS refusing the work's publish) fails the
    request with a 503 naming the error. Before, the spawned placement's exception was counted as
    a failed publish and the request waited ``request_timeout_s`` (20 s here) for output."""
    real = RouterService._place_again
    failed: list[str] = []

    async def place_again(self: RouterService, msg: m.WorkRequeue) -> bool:
        if not failed:
            failed.append(msg.rid)
            raise RuntimeError("injected: nats: outbound buffer limit exceeded")
        return await real(self, msg)

    monkeypatch.setattr(RouterService, "_place_again", place_again)
    with structlog.testing.capture_logs() as logs:
        async with router_env(nats_url, tmp_path, {"n0": "both", "n1": "both"}, fence_after_s=0.5) as env:
            env.cluster.answering.clear()
            req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}))
            await until(lambda: env.cluster.works, 3.0, "work sent")
            rid = env.cluster.works[0].rid
            env.cluster.alive.discard((env.service.core.view.placement(rid) or ("?",))[0])  # fenced: re-dispatched
            r = await asyncio.wait_for(req, 5.0)  # before: it waited for request_timeout_s
            assert r.status_code == 503 and "could not be placed again" in r.text and "outbound buffer" in r.text, r.text
            assert env.service.counters["requeue.place_errors"] == 1 and failed == [rid]
            assert env.service.core.view.placement(rid) is None  # no node counts it any more
    [line] = errors(logs, "placing work again failed; request failed")
    assert line["rid"] == rid and isinstance(line["exc_info"], RuntimeError)


def _fence_round_fails(svc: RouterService, monkeypatch: Any) -> None:
    def expire_parked(now_mono: float) -> None:
        raise RuntimeError("injected: fence round failed")

    monkeypatch.setattr(svc, "_expire_parked", expire_parked)


def _http_server_ends(svc: RouterService, monkeypatch: Any) -> None:
    assert svc._server is not None
    svc._server.should_exit = True  # uvicorn's serve() returns, as after --limit-max-requests


@pytest.mark.parametrize(("inject", "task", "error"), [
    (_fence_round_fails, "router-fence", "injected: fence round failed"),
    (_http_server_ends, "router-http", "background task router-http ended"),
], ids=["fence loop", "HTTP server"])  # fmt: skip
async def test_a_task_the_router_needs_that_ends_fails_the_router(nats_url, tmp_path: Path, monkeypatch, inject, task, error):
    port_file = tmp_path / "router.port"
    held: list[RouterService] = []
    with structlog.testing.capture_logs() as logs:
        async with AsyncExitStack() as stack:
            bus = await Bus.connect(nats_url, Subjects("p0"), service="fake", instance="fake-cluster")
            stack.push_async_callback(bus.close)
            cluster = FakeCluster(bus=bus, phases={"n0": "both"})
            await cluster.start()
            stack.push_async_callback(cluster.stop)
            cluster.answering.clear()
            cfg = RouterConfig(nats_url=nats_url, port=0, port_file=str(port_file), split_get_timeout_s=2.0, lookup_timeout_s=0.5,
                               request_timeout_s=20.0, decode_binding="dispatch")  # fmt: skip

            def make(c: RouterConfig, b: Bus, clk: Any) -> RouterService:
                held.append(RouterService(c, b, clk))
                return held[-1]

            stop = asyncio.Event()
            stack.callback(stop.set)
            run = asyncio.create_task(serve_until_stopped("router", cfg, make, instance="router", stop_event=stop))
            await answering(bus, "router", [run])
            svc = held[0]
            await until(svc.ready, 5.0, "router ready")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port_file.read_text().strip()}", timeout=10.0) as http:
                req = None
                if task == "router-fence":  # a request in flight (an HTTP one keeps uvicorn's shutdown waiting 5 s)
                    req = asyncio.create_task(http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}))
                    await until(lambda: cluster.works, 3.0, "work sent")
                inject(svc, monkeypatch)
                await until(lambda: not svc.ready(), 3.0, "the router not ready")  # before: it served on, ready
                with pytest.raises(ServiceFailed, match=error) as failed:
                    await asyncio.wait_for(run, 10.0)
                # the one line the process prints at exit (services/router/__main__.py) names the task
                assert str(failed.value).startswith(f"router: task {task} failed: "), str(failed.value)
                if req is not None:  # the in-flight request is answered at the stop, not left waiting
                    r = await asyncio.wait_for(req, 5.0)
                    assert r.status_code == 503 and "shutting down" in r.text
    assert svc.counters["task_fatal"] == 1
    [line] = errors(logs, "a task the service needs failed; the service exits to be restarted")
    assert line["where"] == f"task {task}" and line["exc_info"] is svc.fatal_error


async def test_healthz_during_a_clean_stop_says_the_router_is_stopping(nats_url, tmp_path: Path):
    """SIGTERM (``RouterService.stop``): ``/healthz`` is 503 "router stopping" (vLLM's ``/health`` is 503
    while its server shuts down), from the stop's start to its end. Before, the tasks the stop ends (HTTP
    server, fence loop) read as "router failing: task(s) ended: ..." (a crash) once they had ended.
    Asked through the app itself (ASGI): the router's listening socket closes at the stop."""
    async with router_env(nats_url, tmp_path, {"n0": "both"}) as env:
        svc = env.service
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=svc.app), base_url="http://router") as asgi:
            assert (await asgi.get("/healthz")).status_code == 200
            stopping = asyncio.create_task(svc.stop())
            await asyncio.sleep(0)  # the stop has begun
            answers = []
            while not stopping.done():
                answers.append(await asgi.get("/healthz"))
                await asyncio.sleep(0.02)
            await stopping
            answers.append(await asgi.get("/healthz"))
            assert svc._bg.dead(), "the stop ended the router's tasks"
    assert answers and all(r.status_code == 503 and r.json()["error"]["message"] == "router stopping" for r in answers), [
        (r.status_code, r.text) for r in answers
    ]


# --------------------------------------------------------------------------- planner


async def test_a_failed_planner_round_is_logged_counted_and_its_loop_goes_on(nats_url, monkeypatch):
    real = PlannerService._publish_models
    armed = {True: 0, False: 0}  # force (the announce loop) / not (the tick loop): failures to inject
    calls = {True: 0, False: 0}

    async def publish_models(self: PlannerService, *, force: bool = False) -> None:
        calls[force] += 1
        if armed[force]:
            armed[force] -= 1
            raise RuntimeError("injected: nats: outbound buffer limit exceeded")
        await real(self, force=force)

    monkeypatch.setattr(PlannerService, "_publish_models", publish_models)
    held: list[PlannerService] = []
    commands: list[m.SplitCommand] = []
    cfg = PlannerConfig(nats_url=nats_url, nodes=["w0", "w1"], split="1P1D", profile="tiny", planner="static", adopt_grace_s=0.0,
                        announce_interval_s=0.1, max_tick_wait_s=0.05, clock_origin=time.time())  # fmt: skip

    def make(c: PlannerConfig, b: Bus, clk: Any) -> PlannerService:
        held.append(PlannerService(c, b, clk))
        return held[-1]

    with structlog.testing.capture_logs() as logs:
        async with AsyncExitStack() as stack:
            bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test")
            stack.push_async_callback(bus.close)

            async def on_cmd(cmd: m.SplitCommand, _s: str) -> None:
                commands.append(cmd)

            await bus.subscribe(SPLIT_COMMANDS, on_cmd)
            stop = asyncio.Event()
            run = asyncio.create_task(serve_until_stopped("planner", cfg, make, instance="planner", stop_event=stop))
            stack.callback(stop.set)
            await answering(bus, "planner", [run])
            svc = held[0]
            armed[True] = armed[False] = 1
            await until(lambda: not armed[True] and not armed[False], 3.0, "both loops failed once")
            seen, ticks = len(commands), calls[False]
            # both loops go on: announcements keep coming, the tick loop keeps publishing refits
            await until(lambda: len(commands) >= seen + 2 and calls[False] >= ticks + 2, 3.0, "the loops went on")
            assert svc.counters["announce.errors"] == 1 and svc.counters["tick.round_errors"] == 1
            assert svc.ready() and not run.done()
            stop.set()
            await asyncio.wait_for(run, 5.0)  # no ServiceFailed
    for loop in ("announce", "tick"):
        [line] = errors(logs, f"planner {loop} round failed; the loop goes on")
        assert isinstance(line["exc_info"], RuntimeError)


# --------------------------------------------------------------------------- kvdirectory


async def test_a_resync_that_fails_is_logged_and_counted_and_the_next_gap_resyncs(nats_url, monkeypatch):
    real = KvDirectory.apply_snapshot
    failures = [1]

    def apply_snapshot(self: KvDirectory, snap: m.KvSnapshot, now: float) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise ValueError("injected: snapshot parents out of order")
        return real(self, snap, now)

    monkeypatch.setattr(KvDirectory, "apply_snapshot", apply_snapshot)
    held: list[DirectoryService] = []
    asked: list[m.KvResyncRequest] = []
    path = [101, 102, 103]
    cfg = DirectoryConfig(nats_url=nats_url, block_size=64, resync_timeout_s=0.5, counts_flush_s=0.02, resync_min_interval_s=0.0)

    def make(c: DirectoryConfig, b: Bus, clk: Any) -> DirectoryService:
        held.append(DirectoryService(c, b, clk))
        return held[-1]

    def batch(seq: int) -> m.KvEventBatch:
        return m.KvEventBatch(node="w0", seq=seq, events=[m.BlockStored(block_hashes=path[:1], parent_block_hash=None, tier="gpu", block_size=64)])

    with structlog.testing.capture_logs() as logs:
        async with AsyncExitStack() as stack:
            bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test")
            stack.push_async_callback(bus.close)

            async def answer(req: m.KvResyncRequest, _s: str) -> m.KvSnapshot:
                asked.append(req)
                return m.KvSnapshot(node="w0", seq=9, block_size=64, gpu=path, gpu_parents=[None] + path[:-1])

            await bus.serve(KV_RESYNC, answer, node="w0")
            stop = asyncio.Event()
            run = asyncio.create_task(serve_until_stopped("kvdirectory", cfg, make, instance="kvdirectory", stop_event=stop))
            stack.callback(stop.set)
            await answering(bus, "kvdirectory", [run])
            svc = held[0]
            await bus.publish(KV_EVENTS, batch(1), node="w0")
            await bus.publish(KV_EVENTS, batch(5), node="w0")  # seq 2..4 lost: a resync, whose snapshot fails
            await until(lambda: svc.counters["resync.errors"] == 1, 3.0, "the failed resync counted")  # before: never
            assert svc.counters["task_errors"] == 1 and svc.ready() and not svc.fatal.is_set()
            await bus.publish(KV_EVENTS, batch(6), node="w0")  # still awaiting a snapshot: asked again
            await until(lambda: not svc.core.awaiting_resync("w0"), 3.0, "resynced")
            assert len(asked) == 2
            stop.set()
            await asyncio.wait_for(run, 5.0)
    [line] = errors(logs, "background task failed")
    assert line["task"] == "kvdirectory-resync-w0" and isinstance(line["exc_info"], ValueError)
