"""A decode node SIGKILLed mid-stream, with a real model (``--engine torch``, the tiny random llama on CPU)
on a 1P2D cluster of real processes over a real nats-server: the client's stream after the router's
re-dispatch is exactly the uninterrupted greedy answer.

The re-dispatch (``services/router/faults.py``'s ``continuation``) makes prompt + the tokens the client
already has the new prompt and the stream go on at that output offset; the old attempt's output is
fenced off by its ``attempt``. With the simulated engine (``test_router_live``, ``test_faults_live``) the
tokens are synthetic, so only their count and order are checked there; here each token is the model's,
so a token duplicated, missing or different across the re-dispatch would change the text. Checked:
text, the chosen tokens of ``logprobs`` (their values within 1e-4: the continuation's prompt is computed
in other chunks, which moves a logprob by about 1e-6), ``finish_reason``, ``usage`` (``prompt_tokens`` the
client's prompt, not prompt + the tokens sent before the re-dispatch), and
on the bus the token ids of the two attempts, joined at the re-dispatch's offset, = the reference's.

Measured (session 43, 2 busy cores): kills after 5 to 61 tokens of 300, chat and completions, also SIGSTOP
past the fence then SIGCONT, stop strings and ``stop_token_ids`` across the re-dispatch, ``max_tokens``
a few tokens past it, seeded sampling with a penalty, four streams with one decode node killed, a prefill
node killed before its prefill and ``split set`` while streaming: every stream equal to its uninterrupted
run. This test keeps the plain case. Needs the ``torch`` extra (no Mooncake); skipped without it.
"""

from __future__ import annotations

import json
import os
import signal
from collections import defaultdict

import httpx
import msgspec
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from evolving_infra.cluster import LocalCluster  # noqa: E402
from shared import messages as m  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.subjects import REQ_OUT, Subjects  # noqa: E402
from tests.integration.torch_cluster import tiny_1p1d  # noqa: E402
from tests.unit.worker.torch_tiny import prompt  # noqa: E402

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 400
KILL_AFTER = 12
"""Output tokens the decode node has published when it is killed: it makes ~250 a second here, so the test has
~1.5 s to see them and kill it before the stream ends without a re-dispatch (a failure saying so)."""


async def test_decode_node_killed_mid_stream_the_stream_is_the_uninterrupted_greedy_answer(tmp_path):
    _, spec = tiny_1p1d(tmp_path)
    spec = msgspec.structs.replace(spec, nodes=3, split="1P2D", restart=True)
    body = {"model": "tiny", "prompt": prompt(11, 45), "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 1}
    chunks: dict[str, list[m.TokenChunk]] = defaultdict(list)
    killed: list[str] = []

    async with LocalCluster(spec) as cluster:
        pids = cluster.pids()

        async def on_chunk(c: m.TokenChunk, _s: str) -> None:
            chunks[c.rid].append(c)
            if c.rid != "victim" or killed:
                return
            decoded = sum(len(x.token_ids) for x in chunks[c.rid] if x.index > 0 and x.node == c.node)
            if c.index > 0 and decoded >= KILL_AFTER:  # the decode node's own tokens (index 0 is the prefill's)
                os.kill(pids[f"worker-{c.node}"], signal.SIGKILL)
                killed.append(c.node)

        bus = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="test-kill", auth=cluster.client_auth("admin"))
        await bus.subscribe(REQ_OUT, on_chunk)
        async with httpx.AsyncClient(base_url=cluster.router_url, timeout=120) as http:
            r = await http.post("/v1/completions", json=body, headers={"X-Request-ID": "ref"})
            assert r.status_code == 200, r.text
            ref = r.json()
            text, tokens, lps, finish, usage, ei = "", [], [], None, None, None
            req = {**body, "stream": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", "/v1/completions", json=req, headers={"X-Request-ID": "victim"}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    usage, ei = ev.get("usage") or usage, ev.get("ei") or ei
                    for ch in ev["choices"]:
                        text += ch["text"]
                        if ch["logprobs"]:
                            tokens += ch["logprobs"]["tokens"]
                            lps += ch["logprobs"]["token_logprobs"]
                        finish = ch["finish_reason"] or finish
        await bus.close()

    assert killed and ref["ei"]["decode_node"] is not None
    attempts = sorted({c.attempt for c in chunks["victim"]})
    assert len(attempts) >= 2, f"no re-dispatch: {len(chunks['victim'])} chunks of one attempt"
    first = {c.index + i: t for c in chunks["victim"] if c.attempt == attempts[0] for i, t in enumerate(c.token_ids)}
    last = {c.index + i: t for c in chunks["victim"] if c.attempt == attempts[-1] for i, t in enumerate(c.token_ids)}
    offset = min(last)
    assert KILL_AFTER < offset < MAX_TOKENS, offset  # the kill came mid-stream, after the decode node's tokens
    want_ids = [t for c in sorted(chunks["ref"], key=lambda c: c.index) for t in c.token_ids]
    assert [first[i] for i in range(offset)] + [last[i] for i in sorted(last)] == want_ids
    # what the client got: the uninterrupted answer, token by token
    rc = ref["choices"][0]
    assert text == rc["text"]
    assert tokens == rc["logprobs"]["tokens"] and len(tokens) == MAX_TOKENS
    assert lps == pytest.approx(rc["logprobs"]["token_logprobs"], abs=1e-4)
    assert finish == rc["finish_reason"] == "length"
    assert usage["completion_tokens"] == ref["usage"]["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == ref["usage"]["prompt_tokens"] == len(body["prompt"])  # the client's prompt, not the continuation's
    assert ei["redispatches"] >= 1 and ei["decode_node"] not in (None, killed[0]), ei
