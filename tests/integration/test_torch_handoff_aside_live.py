"""A stalled decode node does not hold the prefill node's other work: on a 1P1D cluster of real processes serving a
real model (``--engine torch``, the tiny random llama on CPU) under an embedded nats-server whose ``max_payload`` is
64 KiB, the decode node (w1) is SIGSTOPped, a 1,000-token request A goes in (its hand-off's K/V goes out in pieces
that nobody answers), then a second request B: B's first token (the prefill node's) comes within a second.

Before, the prefill node's step awaited every piece's answer (``_execute_plan`` → ``_handoff`` → ``_send_kv``): B's
first token came only once A's hand-off had given up, ``handoffkv.TRIES`` × ``--handoff-chunk-timeout-s`` (2 s here)
later (5.1 s measured in the review's drill, 0.04 s before the pieces). After SIGCONT both requests end.
Needs the ``torch`` extra.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import msgspec
import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from evolving_infra.cluster import LocalCluster  # noqa: E402
from tests.integration.torch_cluster import tiny_1p1d  # noqa: E402

pytestmark = pytest.mark.timeout(300)


async def _first_data(http: httpx.AsyncClient, prompt: list[int]) -> tuple[float, int, list[str]]:
    """Stream a completion of ``prompt``; returns (wall s to its first ``data:`` line, the status, every data line)."""
    t = time.monotonic()
    first = -1.0
    lines: list[str] = []
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                if first < 0:
                    first = time.monotonic() - t
                lines.append(line)
    return first, r.status_code, lines


async def test_a_stalled_decode_node_does_not_delay_another_requests_prefill(tmp_path):
    _, spec = tiny_1p1d(tmp_path)
    spec = msgspec.structs.replace(
        spec, decode_binding="prefill-start", nats_max_payload=64 * 1024,
        worker_args=(*spec.worker_args, "--handoff-chunk-timeout-s", "2"),
    )  # fmt: skip
    rng = random.Random(1)
    a = [rng.randrange(3, 500) for _ in range(1000)]
    b = [rng.randrange(3, 500) for _ in range(50)]
    async with LocalCluster(spec) as cluster, httpx.AsyncClient(base_url=cluster.router_url, timeout=120) as http:
        warm, status, _ = await _first_data(http, b)  # the model loaded, the path warm
        assert status == 200 and warm >= 0
        w1 = cluster.pids()["worker-w1"]
        os.kill(w1, signal.SIGSTOP)
        try:
            ta = asyncio.create_task(_first_data(http, a))
            await asyncio.sleep(1.0)  # A's prefill is done, its hand-off stuck on w1
            first_b, status_b, _ = await asyncio.wait_for(_first_data(http, [7, *b]), 60)
        finally:
            os.kill(w1, signal.SIGCONT)
        first_a, status_a, lines_a = await asyncio.wait_for(ta, 60)
    assert status_b == 200 and status_a == 200
    assert 0 <= first_b < 1.5, f"B's first token {first_b:.2f} s after it was sent: the prefill node waited on A's hand-off"
    assert first_a >= 0 and lines_a[-1] == "data: [DONE]"
