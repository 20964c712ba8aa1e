"""An aborted request's hand-off waiting in a full decode node's queue, on a 1P1D cluster of real processes serving
a real model (``--engine torch``, the tiny random llama on CPU, per-service nkeys) under an embedded nats-server whose
``max_payload`` is 64 KiB, ``--handoff-buffer-bytes`` 600,000 B, stuffed with a 300,000-B transfer whose work never
comes (each 700-token prompt's K/V, 360,448 B, does not fit beside it).

Review 55 M2: request A's client gives up after 1 s (the router aborts it) while its hand-off waits in the decode
node's queue; B comes after. The prefill node went on asking for A's hand-off and the decode node kept its ticket
(an abort, a discard and a refusal left the queue alone), so when room came A's K/V was admitted first, for a
request nobody waits for, and B waited behind it. Now the abort stops A's hand-off on the prefill node
(``handoff.aborted``; its ``KvCancel`` frees its place) and drops the rid's tickets on the decode node: B alone
waits, and is admitted as soon as the stuffing goes. Each binding is acted on 0.5 s late (``--fault-delay-bind-s``),
so every hand-off goes out after its binding (``bind.after_prefill``), the path 82308139 fixed: before, the test hit
it about 1 run in 4 (second review 55 M-c). Needs the ``torch`` extra.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import msgspec
import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from evolving_infra.cluster import LocalCluster  # noqa: E402
from services.worker import handoffkv as hk  # noqa: E402
from shared import messages as m  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.subjects import SVC_STATS, WORK_KV, WORK_KV_CANCEL, Subjects  # noqa: E402
from tests.integration.torch_cluster import tiny_1p1d  # noqa: E402

pytestmark = pytest.mark.timeout(120)

BUFFER = 600_000


async def test_an_aborted_requests_hand_off_leaves_the_decode_nodes_queue(tmp_path):
    _, spec = tiny_1p1d(tmp_path)
    spec = msgspec.structs.replace(spec, nats_max_payload=64 * 1024,
                                   worker_args=(*spec.worker_args, "--handoff-buffer-bytes", str(BUFFER),
                                                "--fault-delay-bind-s", "0.5"))  # fmt: skip
    rng = random.Random(8)

    def body() -> dict[str, object]:
        return {"model": "tiny", "prompt": [rng.randrange(3, 500) for _ in range(700)], "max_tokens": 4, "ignore_eos": True}

    async with LocalCluster(spec) as cluster, httpx.AsyncClient(base_url=cluster.router_url, timeout=60) as http:
        admin = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="test-abort", auth=cluster.client_auth("admin"))
        w0 = await Bus.connect(cluster.nats_url, Subjects("p0"), service="worker", instance="as-w0", auth=cluster.client_auth("worker-w0"))
        try:
            r = await http.post("/v1/completions", json={**body(), "prompt": [1, 2]})  # warm up
            assert r.status_code == 200, r.text
            for c in hk.split(os.urandom(300_000), transfer="stuff-1", rid="stuff", size=hk.chunk_bytes(admin.max_payload)):
                assert (await admin.request(WORK_KV, c, node="w1", timeout=10.0)).error == ""
            with pytest.raises(httpx.TimeoutException):  # A: its client gives up, the router aborts it
                await http.post("/v1/completions", json=body(), timeout=1.0)
            t0 = time.monotonic()
            b = asyncio.create_task(http.post("/v1/completions", json=body()))
            for _ in range(60):  # until B's hand-off asks for its turn (A's asked before it)
                await asyncio.sleep(0.1)
                s1 = await admin.request(SVC_STATS, m.StatsRequest(), instance="worker-w1", timeout=10.0)
                if s1.counters.get("handoff.kv.queue.entered", 0) >= 2:
                    break
            await asyncio.sleep(0.5)
            s1 = await admin.request(SVC_STATS, m.StatsRequest(), instance="worker-w1", timeout=10.0)
            depth = s1.gauges["handoff.queue_depth"]
            await w0.publish(WORK_KV_CANCEL, m.KvCancel(transfer="stuff-1", rid="stuff", reason="room"), node="w1")
            await w0.flush()
            rb = await b
            took = time.monotonic() - t0
            s0 = (await admin.request(SVC_STATS, m.StatsRequest(), instance="worker-w0", timeout=10.0)).counters
            s1c = (await admin.request(SVC_STATS, m.StatsRequest(), instance="worker-w1", timeout=10.0)).counters
        finally:
            await w0.close()
            await admin.close()
    assert rb.status_code == 200, rb.text
    assert depth == 1.0, depth  # before: 2, A's ticket first
    assert s1c["handoff.kv.queue.admitted"] == 1 and s1c["handoff.received"] == 2, s1c  # B's (and the warm-up's) only
    assert s0["handoff.aborted"] == 1 and s0.get("requests.handoff_failed", 0) == 0, s0
    assert s0["bind.after_prefill"] == 3, s0  # every hand-off after its binding (--fault-delay-bind-s): the path 82308139 fixed
    assert took < 30.0, took
