"""The decode node's hand-off buffer under a forged announcement and a full buffer, on a 1P1D cluster of real
processes serving a real model (``--engine torch``, the tiny random llama on CPU, per-service nkeys) under an
embedded nats-server whose ``max_payload`` is 64 KiB, ``--handoff-buffer-bytes`` 600,000 B; a 700-token prompt's
K/V is 360,448 B (7 pieces).

1. A forged piece (1 KiB) announcing a 600,000-B K/V, sent to the decode node's ``work.w1.kv``: before, it reserved
   the whole buffer for ``--handoff-kv-timeout-s`` and the real hand-off was refused "full" (the client's 500);
   now it costs the 1 KiB it stored and the request gets its 200.
2. 300,000 B really stored by another transfer (complete, its work never coming): the real hand-off does not fit
   beside it; its first pieces are refused ``full`` and it waits its turn in the decode node's queue (one piece asking
   again, ``KvChunkAck.queued``), and a ``KvCancel`` of that transfer,
   sent as the prefill node's identity on ``work.w1.kvcancel`` (its permission, the decode node's subscription),
   frees it: the request gets its 200 (before: a 500 at the first "full"), the prefill node counts its wait,
   the decode node the cancel, and holds nothing once the forged piece is cancelled too.
Needs the ``torch`` extra.
"""

from __future__ import annotations

import asyncio
import os
import random
import zlib

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

pytestmark = pytest.mark.timeout(300)

BUFFER = 600_000


async def _stats(bus: Bus, node: str) -> m.StatsReply:
    rep: m.StatsReply = await bus.request(SVC_STATS, m.StatsRequest(), instance=f"worker-{node}", timeout=10.0)
    return rep


async def test_a_forged_announcement_does_not_starve_a_hand_off_and_a_full_buffer_is_waited_for(tmp_path):
    _, spec = tiny_1p1d(tmp_path)
    spec = msgspec.structs.replace(
        spec, nats_max_payload=64 * 1024, worker_args=(*spec.worker_args, "--handoff-buffer-bytes", str(BUFFER)),
    )  # fmt: skip
    rng = random.Random(54)
    prompt = [rng.randrange(3, 500) for _ in range(700)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    async with LocalCluster(spec) as cluster, httpx.AsyncClient(base_url=cluster.router_url, timeout=120) as http:
        bus = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="test-buffer", auth=cluster.client_auth("admin"))
        w0 = await Bus.connect(cluster.nats_url, Subjects("p0"), service="worker", instance="test-as-w0", auth=cluster.client_auth("worker-w0"))
        try:
            # 1. a forged piece announcing the whole buffer
            forged = m.KvChunk(transfer="forged-1", rid="forged", index=0, count=-(-BUFFER // 1024), offset=0, total=BUFFER,
                               crc32=zlib.crc32(b"\1" * 1024), data=b"\1" * 1024)  # fmt: skip
            ack = await bus.request(WORK_KV, forged, node="w1", timeout=10.0)
            assert ack.error == "", ack
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["ei"]["decode_node"] == "w1"
            # 2. 300,000 B stored for a transfer whose work never comes: the next hand-off does not fit beside it
            stuffing = os.urandom(300_000)
            for c in hk.split(stuffing, transfer="stuff-1", rid="stuff", size=hk.chunk_bytes(bus.max_payload)):
                ack = await bus.request(WORK_KV, c, node="w1", timeout=10.0)
                assert ack.error == "", ack
            held = (await _stats(bus, "w1")).gauges["handoff.kv_held_bytes"]
            assert held == 300_000 + 1024, held

            async def free_soon() -> None:
                for _ in range(200):  # until the prefill node's first piece was refused full
                    if (await _stats(bus, "w1")).counters.get("handoff.kv.full_refusals", 0) >= 1:
                        break
                    await asyncio.sleep(0.05)
                await w0.publish(WORK_KV_CANCEL, m.KvCancel(transfer="stuff-1", rid="stuff", reason="test: gave up"), node="w1")

            freeing = asyncio.create_task(free_soon())
            r = await http.post("/v1/completions", json={**body, "prompt": [7, *prompt]})
            await freeing
            assert r.status_code == 200, r.text  # before: 500 "hand-off buffer full"
            await w0.publish(WORK_KV_CANCEL, m.KvCancel(transfer="forged-1", rid="forged", reason="test"), node="w1")
            await w0.flush()
            for _ in range(100):
                s1 = await _stats(bus, "w1")
                if s1.gauges["handoff.kv_held_bytes"] == 0:
                    break
                await asyncio.sleep(0.05)
            s0 = await _stats(bus, "w0")
        finally:
            await w0.close()
            await bus.close()
    sent, got = s0.counters, s1.counters
    assert sent["requests.handed_off"] == 2 and sent.get("requests.handoff_failed", 0) == 0, sent
    assert sent["handoff.queued"] == 1 and sent["handoff.queue_asks"] >= 1 and sent.get("handoff.chunk_full_retries", 0) == 0, sent
    assert got["handoff.kv.full_refusals"] >= 1 and got["handoff.kv.cancelled"] == 2, got
    assert got["handoff.kv.queue.entered"] == got["handoff.kv.queue.admitted"] == 1 and s1.gauges["handoff.queue_depth"] == 0, got
    assert got["handoff.received"] == 2 and s1.gauges["handoff.kv_held_bytes"] == 0 and s1.gauges["handoff.kv_transfers"] == 0
