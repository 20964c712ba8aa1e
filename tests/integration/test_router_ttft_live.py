"""``--routing ttft`` over a real nats-server: the workers, planner and directory are played by the test.

The router runs in-process through the same shell as ``python -m services.router``;
a fake cluster on its own NATS connection publishes ``NodeState``s (with ``ts`` on
the shared cluster clock and a configurable queue), answers ``kv.lookup`` with a
fetch plan, consumes ``work.*.prefill`` and answers with ``TokenChunk``s carrying
``ts`` and ``queue_s``. Checks: the choice follows the predicted TTFT, the fetch
plan travels in ``PrefillWork.fetch``, the planner's ``planner.models`` changes
the prediction, the response carries the ``ei`` object, and the TTFT prediction
error and per-node queue time show up in ``svc.stats.router``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shared import messages as m
from shared.bus import Bus
from shared.clock import SimClock
from shared.itermodel import PrefillModel
from shared.subjects import KV_LOOKUP, NODE_STATE, PLANNER_MODELS, REQ_OUT, SPLIT_GET, WORK_PREFILL, Subjects

from services.router.config import RouterConfig
from tests.integration.live import RouterEnv, cancelled, router_on_fake_cluster
from tests.integration.live import wait_for as _wait_for

pytestmark = pytest.mark.timeout(60)

BS = 64
BLOCKS = 30
PROMPT = [1000 + i for i in range(BLOCKS * BS)]  # 30 full blocks
QUEUE_S = 0.0125
ARRIVED_AT = 0.25
FETCH_S = 0.04
"""The fake prefill node's peer-fetch time when its work carries a fetch plan."""


@dataclass
class TtftCluster:
    bus: Bus
    clock: SimClock
    phases: dict[str, str]
    queues: dict[str, list[m.QueuedWork]] = field(default_factory=dict)
    holder: str = "p0"
    """Node whose host memory holds the whole prompt path."""
    works: list[tuple[str, m.PrefillWork]] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        await self.bus.serve(SPLIT_GET, self._split_get)
        await self.bus.serve(KV_LOOKUP, self._lookup)
        await self.bus.subscribe(WORK_PREFILL, self._work)
        await self.publish_states()
        self.tasks.append(asyncio.create_task(self._beat()))

    async def stop(self) -> None:
        await cancelled(self.tasks)

    async def publish_states(self) -> None:
        now = self.clock.now()
        for node, phase in sorted(self.phases.items()):
            st = m.NodeState(
                node=node, phase=phase, ts=now, epoch=1, block_size=BS, queue=self.queues.get(node, []),  # type: ignore[arg-type]
                gpu_free_blocks=10_000, gpu_total_blocks=10_000,
            )  # fmt: skip
            await self.bus.publish(NODE_STATE, st, node=node)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            await self.publish_states()

    async def _split_get(self, _q: m.SplitQuery, _s: str) -> m.SplitCommand:
        return m.SplitCommand(epoch=1, phases=dict(self.phases), reason="test")  # type: ignore[arg-type]

    async def _lookup(self, req: m.KvLookupRequest, _s: str) -> m.KvLookupReply:
        n = len(req.block_hashes)
        return m.KvLookupReply(
            block_size=req.block_size,
            nodes=[m.NodePrefix(node=self.holder, host_blocks=n, local_blocks=n)],
            longest_any=n,
            sources=[m.FetchRange(node=self.holder, start=0, end=n, tier="host")],
        )

    async def _work(self, w: m.PrefillWork, subject: str) -> None:
        node = subject.split(".")[-2]
        self.works.append((node, w))
        fetched = sum(r.end - r.start for r in w.fetch) * BS  # as a worker reports a fetch it used
        first = m.TokenChunk(
            rid=w.rid, node=node, index=0, token_ids=[7], prompt_tokens=w.prompt_tokens, cached_tokens=(BLOCKS - 1) * BS,
            finished=w.max_tokens == 1, finish_reason="length" if w.max_tokens == 1 else None, ts=self.clock.now(), queue_s=QUEUE_S,
            arrived_at=ARRIVED_AT,
            fetch_s=FETCH_S if fetched else None, exposed_fetch_s=0.0 if fetched else None, fetched_tokens=fetched,
        )  # fmt: skip
        await self.bus.publish(REQ_OUT, first, rid=w.rid, node=first.node)
        if w.max_tokens > 1:
            rest = m.TokenChunk(rid=w.rid, node=w.decode_node or node, index=1, token_ids=[8] * (w.max_tokens - 1), finished=True, finish_reason="length")
            await self.bus.publish(REQ_OUT, rest, rid=w.rid, node=rest.node)


Env = RouterEnv[TtftCluster]


@contextlib.asynccontextmanager
async def ttft_env(nats_url: str, tmp_path: Path) -> AsyncIterator[Env]:
    origin = time.time()
    clock = SimClock(1.0, origin)
    bus = await Bus.connect(nats_url, Subjects("p0"), service="fake", instance="fake-cluster")
    cluster = TtftCluster(bus=bus, clock=clock, phases={"p0": "prefill", "p1": "prefill", "d0": "decode"})
    await cluster.start()
    port_file = tmp_path / "router.port"
    cfg = RouterConfig(
        nats_url=nats_url, port=0, port_file=str(port_file), routing="ttft", profile="gb300-glm52", clock_origin=origin,
        fence_after_s=2.0, split_get_timeout_s=5.0, lookup_timeout_s=1.0, request_timeout_s=20.0, model="test-model", log_level="debug",
        decode_binding="dispatch",  # the fake workers do not ask route.bind
    )  # fmt: skip
    async with router_on_fake_cluster(cluster, cfg) as env:
        yield env


def _sse(body: str) -> list[Any]:
    out: list[Any] = []
    for block in body.split("\n\n"):
        block = block.strip("\n")
        if block:
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else msgspec.json.decode(data))
    return out


async def test_ttft_routing_live(nats_url, tmp_path):
    async with ttft_env(nats_url, tmp_path) as env:
        cl = env.cluster
        # 1. both prefill nodes idle: p0 holds the prefix (no fetch) → p0
        r = await env.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert r.headers["x-ei-prefill-node"] == "p0" and r.headers["x-ei-decode-node"] == "d0"
        ei = body["ei"]
        assert (ei["prefill_node"], ei["decode_node"], ei["queue_s"]) == ("p0", "d0", QUEUE_S)
        assert ei["arrived_at"] == ARRIVED_AT and ei["first_token_at"] > 0  # the node's times (fidelity's control plane)
        assert 0 < ei["predicted_ttft_s"] < 0.1  # one 64-token block to compute (+ restore)
        node, w = cl.works[-1]
        assert node == "p0" and w.fetch == []
        assert (ei["fetch_s"], ei["exposed_fetch_s"], ei["fetched_tokens"], ei["fetch_sources"]) == (None, None, 0, [])

        # 2. p0 reports a backlog of 200K tokens (several seconds): p1 fetches the prefix from p0
        cl.queues["p0"] = [m.QueuedWork(rid="bg", uncached_tokens=200_000)]
        await cl.publish_states()
        await _wait_for(lambda: env.service.core.view.nodes["p0"].state.queue != [], what="backlog state")  # type: ignore[union-attr]
        r = await env.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 200 and r.headers["x-ei-prefill-node"] == "p1"
        node, w = cl.works[-1]
        assert node == "p1" and w.fetch == [m.FetchRange(node="p0", start=0, end=BLOCKS - 1, tier="host")]
        # predicted: τ((29·64) tokens) = 0.45 + 1.856 ms exposed on an idle node, then one block of prefill
        assert 0.45 < r.json()["ei"]["predicted_ttft_s"] < 0.55
        ei = r.json()["ei"]  # the peer fetch, as the replayer writes it into requests.jsonl
        assert (ei["fetch_s"], ei["exposed_fetch_s"], ei["fetched_tokens"], ei["fetch_sources"]) == (FETCH_S, 0.0, (BLOCKS - 1) * BS, ["p0"])

        # 3. streaming: the ei object rides on the final chunk and on the usage chunk
        payload = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        async with env.http.stream("POST", "/v1/completions", json=payload) as resp:
            assert resp.status_code == 200
            events = _sse((await resp.aread()).decode())
        assert events[-1] == "[DONE]"
        final = next(e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"])
        usage = events[-2]
        assert usage["choices"] == [] and usage["ei"] == final["ei"] and final["ei"]["prefill_node"] == "p1"

        # 4. the planner publishes a slow model for p1: p0 (backlog and all) wins again
        slow = PrefillModel(c0=30.0, c1=1e-3, c2=0.0, c3=0.0)  # p0 backlog ≈ 8.5 s
        await env.bus.publish(PLANNER_MODELS, m.PlannerModels(models=[m.NodeModels(node="p1", prefill=slow, samples=100)], frozen=True))
        await _wait_for(lambda: env.service.counters["models_applied"] == 1, what="planner models applied")
        r = await env.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 200 and r.headers["x-ei-prefill-node"] == "p0"
        assert cl.works[-1][1].fetch == []

        # 5. metrics: prediction error histogram and per-node queue time
        st = await env.stats()
        c, g = st.counters, st.gauges
        assert c["ttft_pred_abs_err_s.count"] == 4 and c["ttft_s.count"] == 4
        assert c["queue_s.count.p0"] == 2 and c["queue_s.count.p1"] == 2
        assert g["queue_s.mean.p1"] == pytest.approx(QUEUE_S) and g["prefill_queue_imbalance"] == pytest.approx(1.0)
        assert "ttft_pred_abs_err_s.median" in g and c["route_path.ttft"] == 4 and c["models_received"] == 1
        cluster = (await env.http.get("/v1/cluster")).json()
        assert cluster["policy"] == "ttft" and cluster["inflight"] == 0
        assert env.service.core.policy.predictor.tracked("p0") == 0  # type: ignore[attr-defined]
