"""A worker whose engine step hangs ends, live: ``python -m services.worker`` as a process, a real
nats-server, the router in this process.

A forward that hangs without raising (a stuck CUDA kernel, a deadlocked collective) left the node
heartbeating and routed forever: its requests never finished, and nothing restarted it. With
``--watchdog-timeout-s`` the worker finds the step hung, logs it (the step's requests, every
thread's Python stack) and exits 1; restarted (as ``up``'s supervisor, compose or Slurm does), the
router fences the old process and re-dispatches the request, which completes. The hang is injected
with ``--fault-hang-step 1`` (the first forward waits forever in the execute thread, as a torch
forward stuck in a kernel: the event loop, and so the heartbeat, go on).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from shared import messages as m
from shared.bus import Bus
from shared.hashing import block_hashes, tokens_for_blocks
from shared.subjects import WORK_PREFILL
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.engines.sim import SimEngine
from services.worker.plan import IterationPlan
from services.worker.service import WorkerService
from tests.conftest import bench_faults
from tests.integration.live import Services, node_state_history, node_states, open_bus, router_factory
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.0


async def test_a_hung_step_ends_the_worker_and_the_router_redispatches_its_request(nats_url, tmp_path: Path):
    origin = time.time()
    port_file = tmp_path / "router.port"
    router: list[RouterService] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    env["PYTHONPATH"] = str(REPO)
    async with AsyncExitStack() as stack:
        states = await node_state_history(await open_bus(stack, nats_url))
        services = Services(stack)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.worker", "--nats-url", nats_url, "--node", "w0", "--profile", "tiny",
            "--speedup", "1", "--clock-origin", str(origin), "--split-get-timeout-s", "0", "--idle-state-interval-s", "0.1",
            "--watchdog-timeout-s", str(TIMEOUT_S), "--fault-hang-step", "1", "--log-format", "json",
            cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip

        async def kill() -> None:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

        stack.push_async_callback(kill)
        rcfg = RouterConfig(nats_url=nats_url, clock_origin=origin, port=0, port_file=str(port_file), block_size=4,
                            split_get_timeout_s=0.2, lookup_timeout_s=0.05, fence_after_s=1.0, requeue_wait_s=10.0,
                            request_timeout_s=20.0)  # fmt: skip
        services.start("router", rcfg, router_factory(router))
        await until(lambda: port_file.exists() and router and router[0].ready() and "w0" in states, 20.0, "router and w0 up")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port_file.read_text().strip()}", timeout=30.0) as http:
            req = asyncio.create_task(
                http.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3}, headers={"x-request-id": "hung-1"})
            )
            await until(lambda: any(s.running for s in states["w0"]), 5.0, "w0 runs the request")
            t0 = time.monotonic()
            await until(lambda: len(states["w0"]) >= 3 + next(i for i, s in enumerate(states["w0"]) if s.running), 5.0,
                        "w0 heartbeats on while its step hangs")  # fmt: skip
            rc = await asyncio.wait_for(proc.wait(), 15.0)
            exited_s = time.monotonic() - t0
            out = (await proc.stdout.read()).decode() if proc.stdout else ""
            assert rc == 1, out
            assert exited_s < TIMEOUT_S + 3.0, (exited_s, out)
            assert not states["w0"][-1].accepting  # its last state: not routed to any more
            lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            [hung] = [x for x in lines if x.get("event", "").startswith("engine step hung")]
            assert hung["level"] == "error" and hung["rids"] == ["hung-1"] and hung["step"] == 1, hung
            assert hung["elapsed_s"] >= TIMEOUT_S and hung["prefill_tokens"] == 6, hung
            assert "_hang_forever" in hung["stacks"] and "Thread 0x" in hung["stacks"], hung["stacks"]
            # where the step loop awaited: the coroutine chain a thread's stack cannot show (a step hung on an await)
            assert "in _run_plan" in hung["awaiting"] and "in _execute_plan" in hung["awaiting"], hung["awaiting"]
            # the fault harness reads the record from the worker's log into its result's errors (bench/faults.py)
            (tmp_path / "worker-w0.log").write_text(out)
            hangs = bench_faults().worker_hangs(tmp_path)
            [(kind, text)] = hangs
            assert kind == "watchdog" and bench_faults().hang_errors(hangs, False) == [text], hangs
            assert "engine step hung" in text and "rids=['hung-1']" in text and "in _execute_plan" in text, text
            assert "_hang_forever" in text, text
            assert not req.done()
            # the supervisor restarts it: the router fences the hung process and re-dispatches the request
            wcfg = WorkerConfig(nats_url=nats_url, node="w0", profile="tiny", speedup=1.0, clock_origin=origin,
                                split_get_timeout_s=0.0, idle_state_interval_s=0.1)  # fmt: skip
            services.start("worker-w0", wcfg, WorkerService)
            r = await asyncio.wait_for(req, 15.0)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 3 and body["ei"]["redispatches"] >= 1, body


class HangInThread(SimEngine):
    """Every forward waits for ``release`` in the execute thread (as a torch forward stuck in a kernel)."""

    threaded = True
    entered = threading.Event()
    release = threading.Event()

    def execute(self, plan: IterationPlan) -> float:
        self.entered.set()
        self.release.wait(30)
        return super().execute(plan)


def hanging_worker(c: WorkerConfig, b: Bus, clk: Any, exit: Any) -> WorkerService:
    """A worker whose engine is a :class:`HangInThread` and whose watchdog calls ``exit(code)`` in
    place of ``os._exit``."""
    svc = WorkerService(c, b, clk)
    svc.engine = HangInThread(svc.profile)
    assert svc.watchdog is not None
    svc.watchdog._exit = exit
    return svc


async def stopped_while_hung(stack: AsyncExitStack, nats_url: str, make: Any) -> tuple[asyncio.Task[None], float]:
    """A worker (``make``, whose engine is a :class:`HangInThread`; watchdog at ``TIMEOUT_S``) gets
    request ``r1``; once its forward hangs its stop is set (SIGTERM). Its task and the monotonic
    time of the stop."""
    HangInThread.entered.clear()
    HangInThread.release.clear()
    cfg = WorkerConfig(nats_url=nats_url, node="w0", profile="tiny", split_get_timeout_s=0.0, idle_state_interval_s=0.1,
                       watchdog_timeout_s=TIMEOUT_S)  # fmt: skip
    bus = await open_bus(stack, nats_url)
    states = await node_states(bus)
    services = Services(stack)
    task = services.start("worker", cfg, make, instance="worker-w0")
    await until(lambda: "w0" in states, 10.0, "w0 up")
    work = m.PrefillWork(rid="r1", prompt_tokens=9, max_tokens=4, block_size=4,
                         block_hashes=block_hashes(tokens_for_blocks([1, 2], 4), 4))  # fmt: skip
    await bus.publish(WORK_PREFILL, work, node="w0")
    assert await asyncio.to_thread(HangInThread.entered.wait, 5.0)
    t0 = time.monotonic()
    services.stops[0].set()  # SIGTERM
    return task, t0


async def test_a_stop_while_a_forward_hangs_still_ends_the_process_at_the_timeout(nats_url):
    """SIGTERM reached a worker whose forward hangs: the stop cancels the step, not the thread, and
    Python's exit then waits for that thread forever (the supervisor's SIGKILL at best). The
    watchdog keeps watching the step whose thread still runs, and ends the process at the timeout."""
    exits: list[float] = []
    held: list[WorkerService] = []

    def make(c: WorkerConfig, b: Bus, clk: Any) -> WorkerService:
        svc = hanging_worker(c, b, clk, lambda code: exits.append(time.monotonic()) if code == 1 else None)
        held.append(svc)
        return svc

    try:
        with structlog.testing.capture_logs() as logs:
            async with AsyncExitStack() as stack:
                task, t0 = await stopped_while_hung(stack, nats_url, make)
                await asyncio.wait_for(task, 5.0)  # stopped (no failure): what follows is the process's exit
                await until(lambda: bool(exits), TIMEOUT_S + 3.0, "the watchdog ended the process")
        assert exits[0] - t0 < TIMEOUT_S + 2.0, exits[0] - t0
        [hung] = [e for e in logs if str(e.get("event", "")).startswith("engine step hung")]
        assert hung["rids"] == ["r1"] and "test_worker_watchdog_live.py" in hung["stacks"] and " in execute" in hung["stacks"], hung
        assert held[0].counters["watchdog.timeouts"] == 1
    finally:
        HangInThread.release.set()


def handler_blocking_the_loop(release: threading.Event) -> None:
    """A handler's synchronous call that does not return (a CUDA copy of a hand-off's pages stuck,
    a lock never released), on the event loop, with no engine step in flight."""
    release.wait(10.0)


@pytest.mark.parametrize("how", ["handler", "drill"])
async def test_a_loop_blocked_outside_a_step_ends_the_process_at_the_timeout(nats_url, how: str):
    """An idle worker (no step in flight) whose event loop a handler blocks (this test's call, or
    the drill's ``--fault-block-loop-at-s``): its heartbeat stops, so the router fences it, but before
    only steps were watched and the process lived on (its supervisor never restarted it). The
    watchdog's loop check logs the stacks and exits 1."""
    exits: list[float] = []
    held: list[WorkerService] = []
    release = threading.Event()

    def make(c: WorkerConfig, b: Bus, clk: Any) -> WorkerService:
        svc = WorkerService(c, b, clk)
        assert svc.watchdog is not None

        def exit(code: int) -> None:  # in place of os._exit: record it and let the loop go
            exits.append(time.monotonic())
            release.set()
            svc._fault_hang.set()  # the drill's block

        svc.watchdog._exit = exit
        svc.watchdog.grace_s = 0.3  # the wait for a stop the blocked loop cannot run (5 s by default)
        held.append(svc)
        return svc

    cfg = WorkerConfig(nats_url=nats_url, node="w0", profile="tiny", split_get_timeout_s=0.0, idle_state_interval_s=0.1,
                       watchdog_timeout_s=TIMEOUT_S, fault_block_loop_at_s=0.5 if how == "drill" else 0.0)  # fmt: skip
    try:
        with structlog.testing.capture_logs() as logs:
            async with AsyncExitStack() as stack:
                bus = await open_bus(stack, nats_url)
                states = await node_states(bus)
                services = Services(stack)
                task = services.start("worker", cfg, make, instance="worker-w0")
                await until(lambda: "w0" in states and held[0].accepting, 10.0, "w0 up")
                t0 = time.monotonic()
                if how == "handler":
                    handler_blocking_the_loop(release)  # this test shares the worker's loop: it blocks it
                await until(lambda: task.done(), 5.0, "the node failed and stopped once its loop ran again")
        assert exits, "the watchdog did not end the process"
        late = 0.5 if how == "drill" else 0.0  # the drill blocks 0.5 s after start (t0 is a bit later)
        assert TIMEOUT_S <= exits[0] - t0 < TIMEOUT_S + late + 1.5, exits[0] - t0  # (its last tick up to a poll earlier) + the grace
        [line] = [e for e in logs if str(e.get("event", "")).startswith("event loop blocked")]
        assert line["log_level"] == "error" and line["elapsed_s"] >= TIMEOUT_S, line
        blocker = "handler_blocking_the_loop" if how == "handler" else "_block_loop_forever"
        assert blocker in line["stacks"], line["stacks"]
        svc = held[0]
        assert svc.counters["watchdog.timeouts"] == 1 and svc.counters["watchdog.loop_blocked"] == 1
        assert svc.counters["loop.blocked_by_fault"] == (how == "drill")
        assert not states["w0"].accepting  # once the loop ran again: the node failed, its last state out
    finally:
        release.set()


async def test_a_hang_found_while_the_node_stops_exits_only_after_its_last_messages(nats_url):
    """SIGTERM reached a worker whose forward hangs, and its stop takes a while (here its first
    await is slowed past the timeout): the watchdog fires while the stop is under way. Before, the
    hang handler saw the node stopped and let the watchdog exit at once, before the stop published
    (and flushed) its last node.state and AllBlocksCleared; the exit now waits for the stop's end."""
    exits: list[bool] = []
    final: list[float] = []

    def make(c: WorkerConfig, b: Bus, clk: Any) -> WorkerService:
        svc = hanging_worker(c, b, clk, lambda code: exits.append(bool(final)))  # were the last messages out?
        flush_iters, publish_kv = svc._flush_iters, svc._publish_kv

        async def slow_flush_iters() -> None:  # a stop that takes a while: the watchdog fires meanwhile
            await asyncio.sleep(TIMEOUT_S + 0.5)
            await flush_iters()

        async def recorded_publish_kv(seq: int, events: list[Any], now: float) -> None:
            await publish_kv(seq, events, now)
            if svc._stopped and any(isinstance(e, m.AllBlocksCleared) for e in events):
                final.append(time.monotonic())

        svc._flush_iters = slow_flush_iters  # type: ignore[method-assign]
        svc._publish_kv = recorded_publish_kv  # type: ignore[method-assign]
        return svc

    try:
        async with AsyncExitStack() as stack:
            task, _ = await stopped_while_hung(stack, nats_url, make)
            await asyncio.wait_for(task, 10.0)
            await until(lambda: bool(exits), TIMEOUT_S + 6.0, "the watchdog ended the process")
        assert exits == [True], "the watchdog exited before the stop's last messages were out"
    finally:
        HangInThread.release.set()
