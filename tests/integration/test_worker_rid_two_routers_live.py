"""One ``X-Request-ID`` placed on the same worker by two routers at once (``up --routers N``), over a real
nats-server, a real router ("router-m") and a real worker: the worker decides as the routers do
(``RouterService._placed_twice``): the router whose instance id sorts first keeps the request. The other's work is
refused, or the other's held request dropped, with an ``abort`` chunk naming that router; an abort from the router
that gave way leaves the other router's request alone (``RequestAbort.router``).

The other router is played by this test's bus (its ``PrefillWork``, ``route.sent`` and ``work.abort``), so the
crossing is exact. Attempts are each router's own wall-clock ms, so the other's may be lower, equal or higher.
Before (rr-mr2): the worker keyed work by rid and attempt only: an equal attempt from the loser was dropped unanswered
and the loser's abort then ended the winner's request (503 "request aborted by node w0: gave way"); a higher one
silently replaced the winner's request, whose client waited for its timeout."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from shared import messages as m
from shared.bus import Bus
from shared.service import serve_until_stopped
from shared.subjects import NODE_STATE, REQ_OUT, ROUTE_SENT, WORK_ABORT, WORK_PREFILL, Subjects
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(120)
BS = 4  # the tiny profile's block size
TOKENS = 200
"""Output tokens of each request: it still streams when the abort of the test's other router comes."""


@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["older", "same", "newer"])
@pytest.mark.parametrize("peer", ["router-z", "router-a"], ids=["peer_gives_way", "peer_keeps"])
async def test_a_worker_keeps_the_request_of_the_router_that_sorts_first(nats_url, tmp_path: Path, peer: str, delta: int):
    origin = time.time()
    stops: list[asyncio.Event] = []
    tasks: list[asyncio.Task[Any]] = []
    routers: dict[str, RouterService] = {}
    workers: dict[str, WorkerService] = {}
    chunks: list[m.TokenChunk] = []
    states: dict[str, m.NodeState] = {}
    works: list[m.PrefillWork] = []
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-two-routers")

    async def on_chunk(chunk: m.TokenChunk, _s: str) -> None:
        chunks.append(chunk)

    async def on_state(st: m.NodeState, _s: str) -> None:
        states[st.node] = st

    async def on_work(work: m.PrefillWork, _s: str) -> None:
        works.append(work)

    def router_factory(c: Any, b: Bus, clock: Any) -> RouterService:
        routers["router-m"] = RouterService(c, b, clock)
        return routers["router-m"]

    def worker_factory(c: Any, b: Bus, clock: Any) -> WorkerService:
        workers["w0"] = WorkerService(c, b, clock)
        return workers["w0"]

    def ends(router: str) -> list[m.TokenChunk]:
        return [c for c in chunks if c.rid == "keep-1" and c.router == router and c.finished]

    port_file = tmp_path / "router.port"
    cfg = RouterConfig(nats_url=nats_url, clock_origin=origin, port=0, port_file=str(port_file), block_size=BS,
                       split_get_timeout_s=0.2, lookup_timeout_s=0.05, fence_after_s=10.0, request_timeout_s=60.0)  # fmt: skip
    try:
        await bus.subscribe(REQ_OUT, on_chunk)
        await bus.subscribe(NODE_STATE, on_state)
        await bus.subscribe(WORK_PREFILL, on_work, node="w0")
        # one collocated node, slowed: the output tokens stream for about a second (a few tokens a chunk)
        wcfg = WorkerConfig(nats_url=nats_url, node="w0", phase="both", profile="tiny", speedup=0.25, clock_origin=origin,
                            idle_state_interval_s=0.2, stream_interval=4)  # fmt: skip
        stops.append(asyncio.Event())
        tasks.append(asyncio.create_task(serve_until_stopped("worker", wcfg, worker_factory, instance="worker-w0", stop_event=stops[-1])))
        stops.append(asyncio.Event())
        tasks.append(asyncio.create_task(serve_until_stopped("router", cfg, router_factory, instance="router-m", stop_event=stops[-1])))
        await until(lambda: port_file.exists() and "router-m" in routers and routers["router-m"].ready() and "w0" in states, 20.0, "router ready")
        w = workers["w0"]
        body = {"prompt": [5] * 40, "max_tokens": TOKENS, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port_file.read_text().strip()}", timeout=60.0) as http:
            mine = asyncio.create_task(http.post("/v1/completions", json=body, headers={"X-Request-ID": "keep-1"}))
            await until(lambda: works and any(c.rid == "keep-1" and c.router == "router-m" for c in chunks), 20.0, "keep-1 streaming")
            other = msgspec.structs.replace(works[0], router=peer, attempt=works[0].attempt + delta)
            await bus.publish(WORK_PREFILL, other, node="w0")
            if peer == "router-z":
                # router-z sorts after router-m: its work is refused with an abort chunk naming it (its router ends its side)
                await until(lambda: ends("router-z"), 20.0, "router-z's work refused")
                end = ends("router-z")[0]
                assert end.finish_reason == "abort" and end.attempt == other.attempt, end
                assert end.error is not None and "router router-z gave way" in end.error, end
                assert w.counters["requests.duplicate_rid_refused"] == 1, dict(w.counters)
                # it gives way (route.sent from router-m) and tells the node to drop its request: router-m's stays
                assert not ends("router-m"), ends("router-m")
                await bus.publish(ROUTE_SENT, m.RouteSent(router=peer, rid="keep-1", prefill_node="w0", prompt_tokens=40,
                                                          max_tokens=TOKENS, attempt=other.attempt))  # fmt: skip
                await bus.publish(WORK_ABORT, m.RequestAbort(rid="keep-1", reason="gave way", attempt=other.attempt, router=peer), node="w0")
                await until(lambda: w.counters["aborts.other_router"] == 1, 20.0, "router-z's abort ignored")
                res = await asyncio.wait_for(mine, 60.0)
                assert res.status_code == 200, res.text
                assert res.json()["usage"]["completion_tokens"] == TOKENS, res.json()["usage"]
                assert not ends("router-m") or ends("router-m")[-1].finish_reason == "length", ends("router-m")
            else:
                # router-a sorts first: the node drops router-m's request (an abort chunk naming router-m: its client gets
                # a 503 at once) and serves router-a's
                res = await asyncio.wait_for(mine, 20.0)
                assert res.status_code == 503 and "router router-m gave way" in res.text, res.text
                assert [c.finish_reason for c in ends("router-m")] == ["abort"], ends("router-m")
                assert w.counters["requests.duplicate_rid_dropped"] == 1, dict(w.counters)
                await until(lambda: any(c.rid == "keep-1" and c.router == peer for c in chunks), 20.0, "router-a's request streaming")
                assert not ends(peer), ends(peer)
                # router-m hears router-a's placement; an abort router-m sends now (at its own attempt, even a later
                # one) leaves router-a's request alone
                await bus.publish(ROUTE_SENT, m.RouteSent(router=peer, rid="keep-1", prefill_node="w0", prompt_tokens=40,
                                                          max_tokens=TOKENS, attempt=other.attempt))  # fmt: skip
                await bus.publish(WORK_ABORT, m.RequestAbort(rid="keep-1", reason="gave way", attempt=other.attempt + 1,
                                                             router="router-m"), node="w0")  # fmt: skip
                await until(lambda: w.counters["aborts.other_router"] == 1, 20.0, "router-m's abort ignored")
                await until(lambda: ends("router-a"), 60.0, "router-a's request served to its end")
                end = ends("router-a")[0]
                assert end.finish_reason == "length" and end.attempt == other.attempt, end
                served = sum(len(c.token_ids) for c in chunks if c.rid == "keep-1" and c.router == "router-a")
                assert served == TOKENS, served
    finally:
        for s in stops:
            s.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()
