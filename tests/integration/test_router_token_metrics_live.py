"""``ei_router_generation_tokens_total`` and ``ei_router_inter_token_latency_seconds`` (real nats-server, the
router's service, nodes played by ``FakeCluster`` of ``test_router_live``; values read from ``GET /metrics``).

Before: no output-token counter at all (vLLM's ``generation_tokens_total``), and only the per-request mean
``ei_router_tpot_seconds``; the prompt counter added 0 for a first chunk that did not report its prompt size.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import messages as m
from shared.tokenizer import SimTokenizer
from tests.integration.test_router_live import _wait_for, output_token, router_env, sse_events

pytestmark = pytest.mark.timeout(60)


async def scrape(env) -> dict[str, float]:
    """Every unlabelled sample of the router's ``/metrics`` by sample name."""
    r = await env.http.get("/metrics")
    assert r.status_code == 200
    return {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples if not s.labels}


async def test_generation_tokens_count_what_clients_got_and_itl_one_sample_per_token_after_the_first(nats_url, tmp_path):
    """The fake engine sends output positions 0, 1–3, 4–6, 7 (8 tokens, the last chunk ends it). A stop string
    on token 4 cuts the output to 5 tokens (``usage.completion_tokens`` 5): counted 5, not the 8 received."""
    words = [SimTokenizer().word(output_token(i)) for i in range(8)]
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        base = {"prompt": [1, 2, 3], "max_tokens": 8}
        used = 0
        for stream in (False, True):
            for extra in ({}, {"stop": words[4]}):
                body = {**base, **extra, "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                before = await scrape(env)
                r = await env.http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                usage = sse_events(r.text)[-2]["usage"] if stream else r.json()["usage"]
                await _wait_for(lambda: env.service.core.view.inflight_total == 0, what="request ended")
                after = await scrape(env)
                got = after["ei_router_generation_tokens_total"] - before.get("ei_router_generation_tokens_total", 0.0)
                assert got == usage["completion_tokens"] == (5 if extra else 8), (stream, extra)
                assert after["ei_router_prompt_tokens_total"] - before["ei_router_prompt_tokens_total"] == usage["prompt_tokens"] == 3
                used += 1
        after = await scrape(env)
        # every request brought 8 tokens to the router: 7 gaps each, whose sum is its E2E - TTFT
        assert after["ei_router_inter_token_latency_seconds_count"] == 7 * used
        assert after["ei_router_tpot_seconds_count"] == used
        assert after["ei_router_inter_token_latency_seconds_sum"] == pytest.approx(7 * after["ei_router_tpot_seconds_sum"])


async def test_a_stream_whose_client_leaves_counts_the_tokens_it_was_sent(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        env.cluster.answering.clear()
        svc = env.service
        before = await scrape(env)
        got: list[str] = []

        async def client() -> None:
            async with env.http.stream("POST", "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        got.append(line)

        req = asyncio.create_task(client())
        await _wait_for(lambda: len(env.cluster.works) == 1, what="work dispatched")
        w = env.cluster.works[0]
        ids = [output_token(i) for i in range(4)]
        await svc._on_chunk(m.TokenChunk(rid=w.rid, node="c0", index=0, token_ids=ids[:1], prompt_tokens=0, attempt=w.attempt), "")
        await svc._on_chunk(m.TokenChunk(rid=w.rid, node="c0", index=1, token_ids=ids[1:4], attempt=w.attempt), "")
        await _wait_for(lambda: len(got) >= 2, what="two data chunks at the client")
        req.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await req
        await _wait_for(lambda: svc.core.view.inflight_total == 0, what="request forgotten")
        after = await scrape(env)
        assert after["ei_router_generation_tokens_total"] - before.get("ei_router_generation_tokens_total", 0.0) == 4
        # a first chunk without the prompt's size: its usage.prompt_tokens (the router's count, 3) is counted
        assert after["ei_router_prompt_tokens_total"] - before.get("ei_router_prompt_tokens_total", 0.0) == 3


async def test_input_and_output_sequence_length_histograms_carry_the_served_model(nats_url, tmp_path):
    """Dynamo's frontend has ``dynamo_frontend_input_sequence_tokens`` / ``..._output_sequence_tokens`` (label
    ``model``); ours had only the sums (``ei_router_prompt_tokens_total``, ``..._generation_tokens_total``): no
    per-request length distribution. A 3-token prompt served 8 tokens and a 300-token one cut by a stop string
    to 5: one ISL sample each at the prompt's size, one OSL sample each at what the client got."""
    words = [SimTokenizer().word(output_token(i)) for i in range(8)]
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        for prompt, extra in (([1, 2, 3], {}), (list(range(1, 301)), {"stop": words[4]})):
            r = await env.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, **extra})
            assert r.status_code == 200, r.text
        await _wait_for(lambda: env.service.core.view.inflight_total == 0, what="requests ended")
        r = await env.http.get("/metrics")
        fams = {f.name: f for f in text_string_to_metric_families(r.text)}
        model = env.service.cfg.model
        for name, total, buckets in (
            ("ei_router_input_sequence_tokens", 303.0, {"64.0": 1.0, "256.0": 1.0, "1024.0": 2.0, "262144.0": 2.0}),
            ("ei_router_output_sequence_tokens", 13.0, {"1.0": 0.0, "8.0": 2.0, "+Inf": 2.0}),
        ):
            assert fams[name].type == "histogram", name
            samples = fams[name].samples
            assert {s.labels["model"] for s in samples} == {model}, name
            got = {s.name.rsplit("_", 1)[-1]: s.value for s in samples if not s.name.endswith("_bucket")}
            assert got == {"count": 2.0, "sum": total}, name
            les = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
            assert {le: les[le] for le in buckets} == buckets, (name, les)
