"""One ``X-Request-ID`` placed by two routers at once (each placed it before the other's ``route.sent`` reached it),
over a real nats-server: a router with the rid pending that hears another router's ``route.sent`` for it gives way
when its instance name sorts after the other's (its client gets a 409, its nodes drop the work) and keeps it
otherwise; either way it takes only the chunks naming it (``TokenChunk.router``), so the two streams never mix.

The other router is played by this test's bus (its ``route.sent`` and its node's chunks), so the crossing is exact.
Before: a router ignored a ``route.sent`` for a rid it had pending (both requests ran, and each router took the
other's chunks from a node both had placed it on, into its own stream)."""

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
from shared.subjects import NODE_STATE, REQ_OUT, ROUTE_HELD, ROUTE_SENT, Subjects
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(120)
BS = 4  # the tiny profile's block size


async def test_a_rid_placed_by_two_routers_at_once_one_gives_way_and_streams_never_mix(nats_url, tmp_path: Path):
    origin = time.time()
    stops: list[asyncio.Event] = []
    tasks: list[asyncio.Task[Any]] = []
    routers: dict[str, RouterService] = {}
    chunks: list[m.TokenChunk] = []
    states: dict[str, m.NodeState] = {}
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-placed-twice")

    async def on_chunk(chunk: m.TokenChunk, _s: str) -> None:
        chunks.append(chunk)

    async def on_state(st: m.NodeState, _s: str) -> None:
        states[st.node] = st

    port_file = tmp_path / "router.port"
    cfg = RouterConfig(nats_url=nats_url, clock_origin=origin, port=0, port_file=str(port_file), block_size=BS,
                       split_get_timeout_s=0.2, lookup_timeout_s=0.05, fence_after_s=10.0, request_timeout_s=60.0)  # fmt: skip

    def factory(c: Any, b: Bus, clock: Any) -> RouterService:
        routers["router-m"] = RouterService(c, b, clock)
        return routers["router-m"]

    try:
        await bus.subscribe(REQ_OUT, on_chunk)
        await bus.subscribe(NODE_STATE, on_state)
        # one collocated node, slowed: 120 output tokens stream for seconds (a few tokens a chunk)
        wcfg = WorkerConfig(nats_url=nats_url, node="w0", phase="both", profile="tiny", speedup=0.5, clock_origin=origin,
                            idle_state_interval_s=0.2, stream_interval=4)  # fmt: skip
        stops.append(asyncio.Event())
        tasks.append(asyncio.create_task(serve_until_stopped("worker", wcfg, WorkerService, instance="worker-w0", stop_event=stops[-1])))
        stops.append(asyncio.Event())
        tasks.append(asyncio.create_task(serve_until_stopped("router", cfg, factory, instance="router-m", stop_event=stops[-1])))
        await until(lambda: port_file.exists() and "router-m" in routers and routers["router-m"].ready() and "w0" in states, 20.0, "router ready")
        r = routers["router-m"]
        body = {"prompt": [5] * 40, "max_tokens": 120, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port_file.read_text().strip()}", timeout=60.0) as http:
            # 1. the other router ("router-z") sorts after this one ("router-m"): this one keeps its request; the other's chunks stay out
            keep = asyncio.create_task(http.post("/v1/completions", json=body, headers={"X-Request-ID": "keep-1"}))
            await until(lambda: any(c.rid == "keep-1" for c in chunks), 20.0, "keep-1 streaming")
            await bus.publish(ROUTE_SENT, m.RouteSent(router="router-z", rid="keep-1", prefill_node="w0", prompt_tokens=40, max_tokens=120))
            # the other router's placement on the same node streams too, and ends first: its chunks (named router-z)
            # must not mix in (before, this one ended the stream here early)
            attempt = r._pending["keep-1"].attempt  # that of a retry of an id's earlier request: the same for both routers
            await bus.publish(REQ_OUT, m.TokenChunk(rid="keep-1", node="w0", index=0, finished=True, finish_reason="stop", router="router-z",
                                                    attempt=attempt), rid="keep-1", node="w0")  # fmt: skip
            res = await asyncio.wait_for(keep, 60.0)
            assert res.status_code == 200, res.text
            assert res.json()["usage"]["completion_tokens"] == 120, res.json()["usage"]
            assert r.counters["duplicate_rid.placed_twice"] == 1 and r.counters["duplicate_rid.gave_way"] == 0, dict(r.counters)

            # 2. the other router ("router-a") sorts first: this one ("router-m") gives way, 409 to its client
            gone = asyncio.create_task(http.post("/v1/completions", json=body, headers={"X-Request-ID": "yield-1"}))
            await until(lambda: any(c.rid == "yield-1" for c in chunks), 20.0, "yield-1 streaming")
            await bus.publish(ROUTE_SENT, m.RouteSent(router="router-a", rid="yield-1", prefill_node="w0", prompt_tokens=40, max_tokens=120))
            res = await asyncio.wait_for(gone, 60.0)
            assert res.status_code == 409 and "router-a" in res.text, res.text
            assert r.counters["duplicate_rid.gave_way"] == 1, dict(r.counters)
            # from now on the rid is router-a's: the same id sent here again is refused, never placed a second time
            again = await http.post("/v1/completions", json={**body, "max_tokens": 2}, headers={"X-Request-ID": "yield-1"})
            assert again.status_code in (409, 503), again.text

            # 3. route.held: a peer router's query (HeldQuery.peer) is counted apart from a node's (rr-mr2: a peer's
            # "dropped" answer was counted held.dropped and logged as a node dropping requests, the router named as node)
            held = dict(r.counters)
            rep = await bus.request(ROUTE_HELD, m.HeldQuery(node="router-a", rids=["gone-1"], attempts=[1], peer=True), timeout=5.0,
                                    router="router-m")  # fmt: skip
            assert rep.dropped == ["gone-1"], rep
            assert r.counters["held.peer_dropped"] == held.get("held.peer_dropped", 0) + 1, dict(r.counters)
            assert r.counters["held.dropped"] == held.get("held.dropped", 0), dict(r.counters)
            rep = await bus.request(ROUTE_HELD, m.HeldQuery(node="w0", rids=["gone-1"], attempts=[1]), timeout=5.0, router="router-m")
            assert rep.dropped == ["gone-1"] and r.counters["held.dropped"] == held.get("held.dropped", 0) + 1, dict(r.counters)
    finally:
        for s in stops:
            s.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()
