"""An unexpected exception in a worker's engine step (or a hook, a handler, a task of the node)
ends the node with a failure, live (real nats-server, in-process services, sim engine).

Before, only ``EngineFatal`` ended the node. Any other exception out of the step (a CUDA
out-of-memory ``RuntimeError`` in the forward, an error in ``on_kv_events``, ``output_tokens`` or
``handoff``) was counted as ``loop_errors`` and the loop went on: the plan ``schedule()`` had taken
was never finished, so every later step raised ``SchedulerError``; the node kept heartbeating and
holding its requests, the router never re-dispatched them, and clients waited for their timeout.
An exception in a bus handler (the KV drain after a hand-off arrives) was logged and dropped the
same way, a dead state heartbeat task died silently, and an ``accept_prefill`` that failed other
than with ``ValueError`` left its request unanswered. Now the node fails (``serve_until_stopped``
raises ``ServiceFailed``: the process exits 1, its supervisor restarts it) with the traceback and
the request ids it held, and the router re-dispatches them; a failed ``accept_*`` refuses that
request only. Faults are injected with engine subclasses (the bus is real).
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

from shared import messages as m
from shared.hashing import block_hashes, tokens_for_blocks
from shared.service import ServiceFailed
from shared.subjects import WORK_DECODE, WORK_PREFILL
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.engines.sim import SimEngine
from services.worker.plan import IterationPlan
from services.worker.service import WorkerService
from tests.integration.live import Services, node_states, open_bus, router_factory, token_chunks, worker_factory
from tests.integration.polling import answering, until

pytestmark = pytest.mark.timeout(60)
BS = 4  # the tiny profile's block size
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"


class OomInForward(SimEngine):
    """The forward of every plan fails as a CUDA out-of-memory does (torch raises RuntimeError)."""

    def execute(self, plan: IterationPlan) -> float:
        raise RuntimeError(OOM)


class OomInThread(OomInForward):
    """As :class:`OomInForward`, in the execute thread (``threaded``, as the torch engine)."""

    threaded = True


class BadKvEvents(SimEngine):
    """Fails on the first KV event batch drained while a request is held (a page copy's OOM)."""

    def on_kv_events(self, events: list[m.KvEvent], live: Any, snapshot: Any = None) -> None:
        if live:
            raise RuntimeError(OOM)


class BadOutput(SimEngine):
    def output_tokens(self, rid: str, start: int, count: int) -> list[int]:
        raise IndexError("no output at that position")


class BadHandoff(SimEngine):
    def handoff(self, work: m.DecodeWork) -> m.DecodeWork:
        raise RuntimeError(OOM)


class BadAccept(SimEngine):
    def accept_prefill(self, work: m.PrefillWork) -> None:
        if work.rid.startswith("bad"):
            raise TypeError("unsupported sampling combination")


class DeadHeartbeat(WorkerService):
    """The state heartbeat's reconnect check fails once the node holds a request."""

    def _check_reconnect(self) -> None:
        if self.core.requests:
            raise RuntimeError("reconnect check failed")
        super()._check_reconnect()


def prefill(rid: str, ids: list[int], tail: int, max_tokens: int, decode_node: str | None = None) -> m.PrefillWork:
    return m.PrefillWork(rid=rid, prompt_tokens=len(ids) * BS + tail, max_tokens=max_tokens, block_size=BS,
                         block_hashes=block_hashes(tokens_for_blocks(ids, BS), BS), decode_node=decode_node)  # fmt: skip


def worker_cfg(url: str, node: str, phase: str = "both", **kw: Any) -> WorkerConfig:
    kw = {"profile": "tiny", "speedup": 10.0, "idle_state_interval_s": 0.1, "split_get_timeout_s": 0.0, "check_invariants": True, **kw}
    return WorkerConfig(nats_url=url, node=node, phase=phase, **kw)


def fatal_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if str(e.get("event", "")).startswith("engine failed")]


# (engine, service, phase, work, decode work, where the node failed)
CASES = {
    "forward OOM": (OomInForward, WorkerService, "both", prefill("r1", [1, 2], 1, 4), None, "step"),
    "forward OOM in the execute thread": (OomInThread, WorkerService, "both", prefill("r1", [1, 2], 1, 4), None, "step"),
    "engine KV events (in the step)": (BadKvEvents, WorkerService, "both", prefill("r1", [1, 2], 1, 4), None, "engine KV events"),
    "output tokens": (BadOutput, WorkerService, "both", prefill("r1", [1, 2], 1, 4), None, "step"),
    "hand-off": (BadHandoff, WorkerService, "prefill", prefill("r1", [1, 2], 1, 4, decode_node="w9"), None, "step"),
    "engine KV events (in the hand-off handler)": (
        BadKvEvents, WorkerService, "decode", None,
        m.DecodeWork(rid="r1", prompt_tokens=9, max_tokens=4, block_size=BS, block_hashes=[11, 12], prefill_node="w9"),
        "engine KV events",
    ),
    # launch states 10 s apart: the heartbeat is what publishes them while the request runs
    "state heartbeat task": (None, DeadHeartbeat, "both", prefill("r1", [1, 2], 1, 200), None, "task worker-w0-state"),
}
CFG = {"state heartbeat task": {"state_interval_s": 10.0, "speedup": 1.0}}


@pytest.mark.parametrize("case", list(CASES))
async def test_an_unexpected_error_ends_the_node_with_a_failure_naming_its_requests(nats_url, case):
    engine, service, phase, work, decode, where = CASES[case]
    held: list[WorkerService] = []
    with structlog.testing.capture_logs() as logs:
        async with AsyncExitStack() as stack:
            bus = await open_bus(stack, nats_url)
            task = Services(stack).start("worker", worker_cfg(nats_url, "w0", phase, **CFG.get(case, {})),
                                         worker_factory(engine, service, held), instance="worker-w0")  # fmt: skip
            await answering(bus, "worker-w0", [task])
            if work is not None:
                await bus.publish(WORK_PREFILL, work, node="w0")
            else:
                await bus.publish(WORK_DECODE, decode, node="w0")
            t0 = time.monotonic()
            with pytest.raises(ServiceFailed):
                await asyncio.wait_for(task, 5.0)
            assert time.monotonic() - t0 < 3.0
    svc = held[0]
    assert svc.fatal_error is not None and svc.counters["node_fatal"] == 1 and not svc.accepting
    assert "loop_errors" not in svc.counters
    [line] = fatal_lines(logs)
    assert line["log_level"] == "error" and line["where"] == where, line
    assert line["rids"] == ["r1"] and line["requests"] == 1
    assert line["exc_info"] is svc.fatal_error  # rendered as the traceback


async def test_an_engine_that_fails_to_accept_work_refuses_that_request_only(nats_url):
    async with AsyncExitStack() as stack:
        bus = await open_bus(stack, nats_url)
        chunks = await token_chunks(bus)
        services = Services(stack)
        task = services.start("worker", worker_cfg(nats_url, "w0"), worker_factory(BadAccept), instance="worker-w0")
        await answering(bus, "worker-w0", [task])
        await bus.publish(WORK_PREFILL, prefill("bad-1", [1, 2], 1, 4), node="w0")
        await bus.publish(WORK_PREFILL, prefill("good-1", [3, 4], 1, 4), node="w0")
        await until(lambda: any(c.finished for c in chunks["bad-1"]) and any(c.finished for c in chunks["good-1"]), 3.0,
                    "both requests answered")  # fmt: skip
        [bad] = chunks["bad-1"]
        assert bad.finish_reason == "error" and "failed to accept the work" in (bad.error or "") and "TypeError" in bad.error
        assert chunks["good-1"][-1].finish_reason == "length"
        assert not task.done()
        services.stops[0].set()
        await asyncio.wait_for(task, 5.0)  # no ServiceFailed: the node served on


async def test_a_failed_forward_ends_the_node_and_the_router_redispatches_its_request(nats_url, tmp_path: Path):
    """Router + one collocated node whose first forward fails with a CUDA out-of-memory error. The
    node ends with a failure; restarted (as its supervisor does), the router fences the old process
    and re-dispatches the request to the new one, and the client gets its tokens."""
    origin = time.time()
    port_file = tmp_path / "router.port"
    router: list[RouterService] = []
    async with AsyncExitStack() as stack:
        states = await node_states(await open_bus(stack, nats_url))
        services = Services(stack)
        wcfg = worker_cfg(nats_url, "w0", clock_origin=origin, speedup=1.0)
        w0 = services.start("worker-w0", wcfg, worker_factory(OomInForward))
        rcfg = RouterConfig(nats_url=nats_url, clock_origin=origin, port=0, port_file=str(port_file), block_size=BS,
                            split_get_timeout_s=0.2, lookup_timeout_s=0.05, fence_after_s=1.0, requeue_wait_s=10.0,
                            request_timeout_s=20.0)  # fmt: skip
        services.start("router", rcfg, router_factory(router))
        await until(lambda: port_file.exists() and router and router[0].ready() and "w0" in states, 10.0, "router ready")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port_file.read_text().strip()}", timeout=30.0) as http:
            req = asyncio.create_task(http.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3}))
            with pytest.raises(ServiceFailed, match="CUDA out of memory"):
                await asyncio.wait_for(w0, 5.0)
            services.start("worker-w0", wcfg, WorkerService)  # the supervisor restarts it with a healthy engine
            r = await asyncio.wait_for(req, 15.0)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 3 and body["ei"]["redispatches"] >= 1, body
