"""Sampling parameters end to end on a 1P1D cluster of real processes serving a real model
(``--engine torch``, no Mooncake: ``--kv-pool off``), over the OpenAI API and NATS.

* **seed**: a request with ``temperature`` 1.0, ``top_k`` 40 and ``seed`` 42, sent twice, gives the
  same token ids (read off ``req.<rid>.out``); its first token is sampled on the prefill node and
  the rest on the decode node after the hand-off, and they equal the same request run
  collocated in this process (``LocalNode``): the draws do not depend on the node. Another seed
  gives other ids; temperature 0 gives the greedy ones.
* **penalties / min_tokens**: a greedy request with ``repetition_penalty`` / ``frequency_penalty`` /
  ``presence_penalty`` gives other ids than greedy and the same as collocated in this process
  (its counts cross the hand-off); ``stop_token_ids`` [the greedy output's j-th id] ends the
  output there, and with ``min_tokens`` j + 3 not before j + 3 tokens; a stop string does not end
  a request whose ``min_tokens`` is its ``max_tokens``.
* **logit_bias**: -100 on every id of the greedy output bans them all (first token on the prefill
  node, the rest after the hand-off), the same ids as collocated in this process.
* **stop string**: a substring of a greedy completion's text, asked as ``stop``: the text ends
  before it (non-streamed and streamed, ``finish_reason`` ``stop``, ``stop_reason`` the string;
  after it with ``include_stop_str_in_output``; ``stop_reason`` the id for a stop token id, null at
  ``max_tokens``; ``echo`` puts the detokenized token-id prompt first),
  and the streamed request (``max_tokens`` 900) is dropped on its node once the router saw the
  stop: the node ends its stream with an ``abort`` chunk long before ``max_tokens``, and the
  router counts ``aborts.stop``.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from evolving_infra.cluster import LocalCluster  # noqa: E402
from shared import messages as m  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.subjects import REQ_OUT, SVC_STATS, Subjects  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402
from tests.integration.torch_cluster import InProcess, tiny_1p1d  # noqa: E402

pytestmark = pytest.mark.timeout(600)


async def test_seed_reproducible_across_nodes_and_stop_string_over_http(tmp_path):
    folder, spec = tiny_1p1d(tmp_path)
    rng = random.Random(11)
    prompt = [rng.randrange(3, 500) for _ in range(37)]
    sampled = {"temperature": 1.0, "top_k": 40}
    async with LocalCluster(spec) as cluster:
        bus = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="test-samp", auth=cluster.client_auth("admin"))
        chunks: dict[str, list[m.TokenChunk]] = defaultdict(list)

        async def on_chunk(msg: m.TokenChunk, _s: str) -> None:
            chunks[msg.rid].append(msg)

        await bus.subscribe(REQ_OUT, on_chunk)

        async def done(rid: str) -> list[m.TokenChunk]:
            for _ in range(400):
                if any(c.finished for c in chunks[rid]):
                    break
                await asyncio.sleep(0.025)
            return sorted(chunks[rid], key=lambda c: c.index)

        async with httpx.AsyncClient(base_url=cluster.router_url, timeout=120) as http:

            async def ids(**kw) -> tuple[list[int], dict]:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "ignore_eos": True, **kw}
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                got = [t for c in await done(r.headers["x-request-id"]) for t in c.token_ids]
                return got, r.json()

            a, obj = await ids(seed=42, **sampled)
            b, _ = await ids(seed=42, **sampled)
            c, _ = await ids(seed=43, **sampled)
            g, gobj = await ids()
            g0, _ = await ids(temperature=0, seed=42, top_k=3)
            assert obj["ei"]["prefill_node"] != obj["ei"]["decode_node"]  # the hand-off path: two nodes sampled it
            # penalties (greedy: the first token on the prefill node, the rest after the hand-off) and min_tokens
            pen = {"repetition_penalty": 1.5, "frequency_penalty": 1.0, "presence_penalty": 0.5}
            pg, _ = await ids(**pen)
            j = next(i for i in range(1, 8) if g.index(g[i]) == i)
            mt, mobj = await ids(stop_token_ids=[g[j]], min_tokens=j + 3)
            st, sobj = await ids(stop_token_ids=[g[j]])
            _, kobj = await ids(stop_token_ids=[g[j]], include_stop_str_in_output=True)
            # logit_bias -100 on every token greedy chose (accepted and ignored before: the same ids came back)
            lb, _ = await ids(logit_bias={str(t): -100 for t in set(g)})

            # a stop string: a piece of the greedy completion's text
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24, "ignore_eos": True})
            full = r.json()["choices"][0]["text"]
            stop = next(full[i : i + 3] for i in range(4, len(full) - 3) if full[i : i + 3].strip() and full.find(full[i : i + 3]) == i)
            want = full[: full.find(stop)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "stop": [stop]}
            r = await http.post("/v1/completions", json=body)
            whole = r.json()
            kept = (await http.post("/v1/completions", json={**body, "include_stop_str_in_output": True})).json()["choices"][0]
            echoed = (await http.post("/v1/completions", json={**body, "stop": None, "echo": True})).json()["choices"][0]
            r = await http.post("/v1/completions", json={**body, "min_tokens": 24})
            unstopped = r.json()["choices"][0]  # min_tokens = max_tokens: the stop string cannot end it
            body = {**body, "max_tokens": 900, "stream": True, "stream_options": {"include_usage": True}}
            pieces, finish, stop_reason, usage = [], None, None, None
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                srid = resp.headers["x-request-id"]
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    if ev["choices"]:
                        pieces.append(ev["choices"][0]["text"])
                        finish = ev["choices"][0]["finish_reason"] or finish
                        stop_reason = ev["choices"][0].get("stop_reason", stop_reason)
                    else:
                        usage = ev["usage"]
            streamed = await done(srid)
        stats = (await bus.request(SVC_STATS, m.StatsRequest(), instance="router", timeout=10.0)).counters
        await bus.close()

    # seeds: reproducible, seed-dependent, and temperature 0 is greedy
    assert a == b and len(a) == 12
    assert a != c and a != g
    assert g0 == g
    # the same draws in one process, collocated (no hand-off): node-independent
    here = InProcess(folder)
    assert here.run("ref", prompt, 12, m.Sampling(temperature=1.0, top_k=40, seed=42)).tokens == a

    # penalties and min_tokens: what the same request gives collocated in this process
    def local(rid: str, sp: m.Sampling) -> list[int]:
        return here.run(rid, prompt, 12, sp).tokens

    assert pg == local("pen", m.Sampling(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)) and pg != g
    assert not set(lb) & set(g) and lb == local("lb", m.Sampling(logit_bias=dict.fromkeys(set(g), -100.0))), (lb, g)
    assert st == g[: j + 1]  # the stop token id ends it ...
    tok = load_tokenizer(f"hf:{folder}")
    # ... with vLLM's stop_reason (the id; null at max_tokens); its text shown only with include_stop_str_in_output
    assert gobj["choices"][0]["stop_reason"] is None and gobj["choices"][0]["finish_reason"] == "length"
    assert sobj["choices"][0]["stop_reason"] == g[j] and sobj["choices"][0]["finish_reason"] == "stop"
    assert sobj["choices"][0]["text"] == tok.decode(g[:j]) and kobj["choices"][0]["text"] == tok.decode(g[: j + 1])
    assert kobj["choices"][0]["stop_reason"] == g[j] and kobj["usage"] == sobj["usage"]
    assert g[j] not in mt[: j + 3] and len(mt) >= j + 3 and mt[:j] == g[:j]  # ... not before min_tokens
    assert mt == local("min", m.Sampling(stop_token_ids=[g[j]], min_tokens=j + 3)), (mt, g, j)
    print(f"penalized greedy {pg} vs greedy {g}; min_tokens {j + 3} with stop id {g[j]}: {len(mt)} tokens, finish {mobj['choices'][0]['finish_reason']}")
    # stop string: the text ends before it, both ways
    ch = whole["choices"][0]
    assert unstopped["text"] == full and unstopped["finish_reason"] == "length", (unstopped, full, stop)
    assert ch["text"] == want and ch["finish_reason"] == "stop" and ch["stop_reason"] == stop, (ch, full, stop)
    assert "".join(pieces) == want and finish == "stop" and stop_reason == stop, (pieces, full, stop)
    assert kept["text"] == want + stop and kept["stop_reason"] == stop, (kept, full, stop)  # include_stop_str_in_output
    assert echoed["text"] == tok.decode(prompt) + full and echoed["stop_reason"] is None  # echo of a token-id prompt
    assert want in tok.decode([t for c in streamed for t in c.token_ids])
    assert usage["completion_tokens"] < 24
    # the node was told to drop it: its stream ends with an abort chunk, far short of max_tokens
    assert streamed[-1].finish_reason == "abort", streamed[-1]
    produced = sum(len(c.token_ids) for c in streamed)
    print(f"stop string {stop!r}: {usage['completion_tokens']} tokens for the client, the node produced {produced} of 900 before the abort")
    assert produced < 900
    assert stats.get("aborts.stop", 0) >= 1 and stats.get("finished.stop", 0) >= 2, stats
