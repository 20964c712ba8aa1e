"""A PD hand-off whose K/V is far larger than one NATS message, on a 1P1D cluster of real processes serving a real
model (``--engine torch``, the tiny random llama on CPU, per-service nkeys) under an embedded nats-server whose
``max_payload`` is 64 KiB: the prompt's K/V (512 B a token: 360,448 B for 700 tokens, 88 pages of 8) goes to the decode node in
pieces (``work.<decode>.kv``, ``services/worker/handoffkv.py``), and every answer equals the same request run
collocated in this process (``LocalNode``: no hand-off), token for token, greedy and seeded sampling alike.

Before (one ``DecodeWork`` carrying the whole K/V), every hand-off past ``max_payload`` failed with nats-py's
``MaxPayloadError`` and the client got a 500 ("hand-off to w1 failed (360448 B of K/V): BusUnavailable(...)");
under ``up``'s 16 MiB that was an 18 MB prompt of an 8-layer, hidden-256 model, and Llama-3-8B's 128 KiB a token
capped PD prompts at ~128 tokens. Also checked: the pieces are counted on both nodes (``svc.stats``: sent and
received bytes and pieces agree, no piece sent twice), the decode node holds no K/V afterwards, and the prefill
node's ``request handed off`` log line gives the K/V's size. Needs the ``torch`` extra (no Mooncake).
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict

import httpx
import msgspec
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from evolving_infra.cluster import LocalCluster  # noqa: E402
from services.worker.handoffkv import ENVELOPE_BYTES  # noqa: E402
from shared import messages as m  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.subjects import REQ_OUT, SVC_STATS, Subjects  # noqa: E402
from tests.integration.torch_cluster import InProcess, tiny_1p1d  # noqa: E402
from tests.unit.worker.torch_tiny import BS  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MAX_PAYLOAD = 64 * 1024
KV_PER_TOKEN = 512
"""The tiny llama's K/V a token: 2 layers × K and V × 2 KV heads × head dim 16 × 4 B (float32); a hand-off carries
whole pages (``BS`` tokens each, the last one partial)."""


async def test_a_hand_off_larger_than_a_nats_message_goes_in_pieces_and_decodes_as_collocated(tmp_path):
    folder, spec = tiny_1p1d(tmp_path)
    spec = msgspec.structs.replace(spec, nats_max_payload=MAX_PAYLOAD, worker_args=(*spec.worker_args, "--log-requests"))
    rng = random.Random(53)
    long_prompt = [rng.randrange(3, 500) for _ in range(700)]
    short_prompt = [rng.randrange(3, 500) for _ in range(37)]
    asks = [  # (prompt, sampling of the body, the same as Sampling)
        (long_prompt, {}, m.Sampling()),
        (long_prompt, {"temperature": 1.0, "top_k": 40, "seed": 7}, m.Sampling(temperature=1.0, top_k=40, seed=7)),
        (short_prompt, {}, m.Sampling()),  # one piece
    ]
    chunks: dict[str, list[m.TokenChunk]] = defaultdict(list)
    async with LocalCluster(spec) as cluster:
        bus = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="test-pieces", auth=cluster.client_auth("admin"))
        assert bus.max_payload == MAX_PAYLOAD

        async def on_chunk(msg: m.TokenChunk, _s: str) -> None:
            chunks[msg.rid].append(msg)

        await bus.subscribe(REQ_OUT, on_chunk)
        got: list[tuple[list[int], dict]] = []
        async with httpx.AsyncClient(base_url=cluster.router_url, timeout=120) as http:
            for prompt, sampling, _ in asks:
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16, "ignore_eos": True, **sampling})
                assert r.status_code == 200, r.text
                rid = r.headers["x-request-id"]
                for _ in range(400):
                    if any(c.finished for c in chunks[rid]):
                        break
                    await asyncio.sleep(0.025)
                got.append(([t for c in sorted(chunks[rid], key=lambda c: c.index) for t in c.token_ids], r.json()))
        stats = {n: (await bus.request(SVC_STATS, m.StatsRequest(), instance=f"worker-{n}", timeout=10.0)) for n in ("w0", "w1")}
        await bus.close()
    log = (tmp_path / "logs" / "worker-w0.log").read_text()

    here = InProcess(folder)
    for i, ((prompt, _, sp), (tokens, body)) in enumerate(zip(asks, got)):
        assert body["ei"]["prefill_node"] == "w0" and body["ei"]["decode_node"] == "w1", body["ei"]  # handed off
        assert len(tokens) == 16 and tokens == here.run(f"ref{i}", prompt, 16, sp).tokens, i
    sizes = [-(-len(p) // BS) * BS * KV_PER_TOKEN for p, _, _ in asks]
    piece = MAX_PAYLOAD - ENVELOPE_BYTES
    pieces = sum(-(-s // piece) for s in sizes)
    assert sizes[0] > MAX_PAYLOAD and pieces == 2 * 7 + 1
    sent, received = stats["w0"].counters, stats["w1"].counters
    assert sent["requests.handed_off"] == 3 and sent.get("requests.handoff_failed", 0) == 0
    assert (sent["handoff.sent_bytes"], sent["handoff.sent_chunks"]) == (sum(sizes), pieces), sent
    assert sent.get("handoff.chunk_retries", 0) == 0
    assert (received["handoff.received"], received["handoff.received_bytes"], received["handoff.received_chunks"]) == (3, sum(sizes), pieces)
    assert received["handoff.kv.chunks"] == pieces and received.get("handoff.kv.duplicate_chunks", 0) == 0
    assert stats["w1"].gauges["handoff.kv_held_bytes"] == 0
    handed = [line for line in log.splitlines() if "request handed off" in line]
    assert len(handed) == 3 and all(str(s) in line for s, line in zip(sizes, handed)), handed
