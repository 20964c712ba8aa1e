"""A forging sender at the head of a decode node's hand-off queue, on a 1P1D cluster of real processes serving a
real model (``--engine torch``, the tiny random llama on CPU, per-service nkeys) under an embedded nats-server whose
``max_payload`` is 64 KiB, ``--handoff-buffer-bytes`` 600,000 B.

Review 55 H1: a sender with a worker's credentials admits ``f-1`` (one 1-KiB piece announcing the whole buffer), then
asks for ``f-2`` (the whole buffer too), which gets the first ticket; once a second it sends one new piece of ``f-1``
and asks for ``f-2`` again. ``f-2`` can never fit beside its own sender's ``f-1``, yet as the first ticket it held
every real hand-off back: both real requests answered 500 after 30 s (``--handoff-queue-wait-s``). Now a ticket
whose total does not fit beside its own sender's stored bytes holds other senders back no more (nor does one whose
turn came and whose piece did not follow within ``handoffkv.GRANT_USE_S``, second review 55 H-a): both answer 200
at once (0.06 and 0.09 s measured).
Needs the ``torch`` extra.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib

import httpx
import msgspec
import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from evolving_infra.cluster import LocalCluster  # noqa: E402
from shared import messages as m  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.subjects import SVC_STATS, WORK_KV, Subjects  # noqa: E402
from tests.integration.torch_cluster import tiny_1p1d  # noqa: E402

pytestmark = pytest.mark.timeout(120)

BUFFER = 600_000
COUNT = -(-BUFFER // 1024)


def _piece(transfer: str, i: int) -> m.KvChunk:
    d = bytes([i % 251]) * 1024
    return m.KvChunk(transfer=transfer, rid="forged-" + transfer, index=i, count=COUNT, offset=i * 1024, total=BUFFER,
                     crc32=zlib.crc32(d), data=d)  # fmt: skip


async def test_a_forged_ticket_that_can_never_fit_does_not_lock_the_decode_node_out_of_real_hand_offs(tmp_path):
    _, spec = tiny_1p1d(tmp_path)
    spec = msgspec.structs.replace(spec, nats_max_payload=64 * 1024,
                                   worker_args=(*spec.worker_args, "--handoff-buffer-bytes", str(BUFFER)))  # fmt: skip
    rng = random.Random(3)
    body = {"model": "tiny", "prompt": [rng.randrange(3, 500) for _ in range(700)], "max_tokens": 4, "ignore_eos": True}
    async with LocalCluster(spec) as cluster, httpx.AsyncClient(base_url=cluster.router_url, timeout=60) as http:
        f = await Bus.connect(cluster.nats_url, Subjects("p0"), service="worker", instance="forger", auth=cluster.client_auth("worker-w0"))
        admin = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="test-forged", auth=cluster.client_auth("admin"))
        stop = asyncio.Event()

        async def keep() -> None:  # f-1 stays open (a new piece a second), f-2's ticket alive (an ask a second)
            i = 1
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except TimeoutError:
                    pass
                await f.request(WORK_KV, _piece("f-1", i), node="w1", timeout=10.0)
                await f.request(WORK_KV, _piece("f-2", 0), node="w1", timeout=10.0)
                i += 1

        try:
            r = await http.post("/v1/completions", json={**body, "prompt": [1, 2, 3]})  # warm up
            assert r.status_code == 200, r.text
            assert (await f.request(WORK_KV, _piece("f-1", 0), node="w1", timeout=10.0)).error == ""
            a2 = await f.request(WORK_KV, _piece("f-2", 0), node="w1", timeout=10.0)
            assert a2.full and a2.queued == 1, a2
            k = asyncio.create_task(keep())
            took = []
            for n in range(2):
                t0 = time.monotonic()
                r = await http.post("/v1/completions", json={**body, "prompt": [n + 9, *body["prompt"]]})
                took.append(time.monotonic() - t0)
                assert r.status_code == 200, r.text  # before: 500 after 30 s, "waited 30.0 s in its queue for room"
            stop.set()
            await k
            st: m.StatsReply = await admin.request(SVC_STATS, m.StatsRequest(), instance="worker-w1", timeout=10.0)
        finally:
            await f.close()
            await admin.close()
    assert max(took) < 10.0, took
    assert st.counters["handoff.kv.queue.entered"] >= 1 and st.counters["handoff.kv.taken"] >= 3, st.counters
