"""Log-probabilities end to end on a 1P1D cluster of real processes serving a real model
(``--engine torch``, no Mooncake: ``--kv-pool off``), over the OpenAI API and NATS.

Chat ``logprobs: true, top_logprobs: 3``, not streamed and streamed: each returned token has an
entry (``token``, ``logprob``, ``bytes``, 3 ``top_logprobs`` most likely first), the streamed
entries are the non-streamed ones, and every chosen-token logprob equals the one recomputed in
this process (``LocalNode``, the chat's prompt ids from ``/tokenize``): the first token's came
from the prefill node, the rest from the decode node. With a stop string the entries are the
counted tokens (``usage.completion_tokens``). Completions ``logprobs: 2`` answer vLLM's legacy
shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).
"""

from __future__ import annotations

import json

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from evolving_infra.cluster import LocalCluster  # noqa: E402
from shared import messages as m  # noqa: E402
from tests.integration.torch_cluster import InProcess, tiny_1p1d  # noqa: E402

pytestmark = pytest.mark.timeout(600)
N = 12


async def test_chat_logprobs_streamed_and_not_equal_an_in_process_recomputation(tmp_path):
    folder, spec = tiny_1p1d(tmp_path)
    messages = [{"role": "user", "content": "tell me about logprobs and how they are computed"}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": N, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    async with LocalCluster(spec) as cluster, httpx.AsyncClient(base_url=cluster.router_url, timeout=120) as http:
        r = await http.post("/tokenize", json={"model": "tiny", "messages": messages})
        assert r.status_code == 200, r.text
        prompt = r.json()["tokens"]
        r = await http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        whole = r.json()
        content_s, finish = [], None
        async with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                ch = ev["choices"][0]
                if ch["logprobs"] is not None:
                    content_s.extend(ch["logprobs"]["content"])
                finish = ch["finish_reason"] or finish
        # a stop string: the entries are the counted tokens
        text = whole["choices"][0]["message"]["content"]
        stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i)
        r = await http.post("/v1/chat/completions", json={**chat, "stop": [stop]})
        stopped = r.json()
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "logprobs": 2})
        comp = r.json()
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "ignore_eos": True})
        plain = r.json()

    ch = whole["choices"][0]
    assert whole["ei"]["prefill_node"] != whole["ei"]["decode_node"]  # first token on one node, the rest on the other
    content = ch["logprobs"]["content"]
    assert len(content) == N == whole["usage"]["completion_tokens"] and finish == "length"
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["bytes"] == list(e["token"].encode())
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e["top_logprobs"][0]["token"] == e["token"] and tops[0] == e["logprob"]  # greedy: the chosen is the top one
    assert [e["token"] for e in content_s] == [e["token"] for e in content]
    assert [e["logprob"] for e in content_s] == pytest.approx([e["logprob"] for e in content], abs=1e-5)
    # the same request in this process
    ref = InProcess(folder).run("ref", prompt, N, m.Sampling(logprobs=3)).logprobs
    got = [e["logprob"] for e in content]
    want = [ref[i][0] for i in range(N)]
    print(f"chosen-token logprobs over HTTP {got}\nrecomputed in process   {want}")
    assert got == pytest.approx(want, abs=1e-4)
    # stop string: one entry per counted token
    sc = stopped["choices"][0]
    assert sc["finish_reason"] == "stop" and len(sc["logprobs"]["content"]) == stopped["usage"]["completion_tokens"] < N
    assert [e["token"] for e in sc["logprobs"]["content"]] == [e["token"] for e in content[: len(sc["logprobs"]["content"])]]
    # completions: vLLM's legacy shape
    lp = comp["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"} and len(lp["tokens"]) == 5
    # a dict of the top 2 and the chosen token, keyed by text: ids whose texts are equal (byte pieces that
    # each decode alone to U+FFFD) share a key, holding the likeliest one's logprob (the greedy token's own)
    assert all(1 <= len(d) <= 3 and d[t] == v for d, t, v in zip(lp["top_logprobs"], lp["tokens"], lp["token_logprobs"])), lp
    assert lp["text_offset"][0] == 0 and plain["choices"][0]["logprobs"] is None
