"""Two routers, one worker, a real nats-server: a router that starts while its peer has a request in flight
hears that request's chunks (every router subscribes to ``req.*.out.*``) without having heard its placement
(``route.sent`` went by before it started). Those chunks are the peer's business, counted ``chunks_peer_rid``
(``TokenChunk.router``, stamped by the worker from the work's owner, names the peer); ``chunks_unknown_rid``
stays for ids no router here placed.

Before: every one of those chunks was counted ``chunks_unknown_rid``, so a router that joined a busy cluster
(a rolling restart, a scale-up) showed a stream of "unknown" chunks that were nobody's fault."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared import messages as m
from shared.bus import Bus
from shared.service import serve_until_stopped
from shared.subjects import NODE_STATE, REQ_OUT, Subjects
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(120)
BS = 4  # the tiny profile's block size


async def test_a_router_started_mid_stream_counts_its_peers_chunks_apart_from_unknown_ids(nats_url, tmp_path: Path):
    origin = time.time()
    stops: list[asyncio.Event] = []
    tasks: list[asyncio.Task[Any]] = []
    routers: dict[str, RouterService] = {}
    chunks: list[m.TokenChunk] = []
    states: dict[str, m.NodeState] = {}
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-peer-chunks")

    async def on_chunk(chunk: m.TokenChunk, _s: str) -> None:
        chunks.append(chunk)

    async def on_state(st: m.NodeState, _s: str) -> None:
        states[st.node] = st

    def start_router(name: str) -> Path:
        port_file = tmp_path / f"{name}.port"
        cfg = RouterConfig(nats_url=nats_url, clock_origin=origin, port=0, port_file=str(port_file), block_size=BS,
                           split_get_timeout_s=0.2, lookup_timeout_s=0.05, fence_after_s=10.0, request_timeout_s=60.0)  # fmt: skip

        def factory(c: Any, b: Bus, clock: Any) -> RouterService:
            routers[name] = RouterService(c, b, clock)
            return routers[name]

        stops.append(asyncio.Event())
        tasks.append(asyncio.create_task(serve_until_stopped("router", cfg, factory, instance=name, stop_event=stops[-1])))
        return port_file

    try:
        await bus.subscribe(REQ_OUT, on_chunk)
        await bus.subscribe(NODE_STATE, on_state)
        # one collocated node, slowed: 120 output tokens stream for seconds (a few tokens a chunk)
        wcfg = WorkerConfig(nats_url=nats_url, node="w0", phase="both", profile="tiny", speedup=0.5, clock_origin=origin,
                            idle_state_interval_s=0.2, stream_interval=4)  # fmt: skip
        stops.append(asyncio.Event())
        tasks.append(asyncio.create_task(serve_until_stopped("worker", wcfg, WorkerService, instance="worker-w0", stop_event=stops[-1])))
        port_a = start_router("router")
        await until(lambda: port_a.exists() and "router" in routers and routers["router"].ready() and "w0" in states, 20.0, "router A ready")
        a = routers["router"]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port_a.read_text().strip()}", timeout=60.0) as http:
            req = asyncio.create_task(http.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 120, "ignore_eos": True}))
            await until(lambda: len(chunks) >= 2, 20.0, "A's request streaming")
            assert chunks[0].router == "router"  # the worker names the owner it was given (PrefillWork.router)
            port_b = start_router("router-b")
            await until(lambda: port_b.exists() and "router-b" in routers and routers["router-b"].ready(), 20.0, "router B ready")
            b = routers["router-b"]
            heard = len(chunks)
            r = await asyncio.wait_for(req, 60.0)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 120, r.text
            assert chunks[-1].finished and len(chunks) > heard, "A's request ended before B was up: no chunk to count"
            await until(lambda: b.counters["chunks_peer_rid"] + b.counters["chunks_unknown_rid"] >= len(chunks) - heard, 10.0,
                        "B heard the rest of the stream")  # fmt: skip
        assert b.counters["chunks_unknown_rid"] == 0 and b.counters["chunks_peer_rid"] >= len(chunks) - heard, dict(b.counters)
        assert a.counters["chunks_unknown_rid"] == 0 and a.counters["chunks_peer_rid"] == 0  # its own request
        assert {c.router for c in chunks} == {"router"}
    finally:
        for s in stops:
            s.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()
