"""A 2P2D cluster of real processes over NATS serving a real model (``--engine torch``).

A multi-turn agent session with a fork and a sub-agent, plus unrelated traffic
that pushes the session out of the prefill nodes' L1, and an in-place
P→D→P switch of a prefill node: every request's output token ids (read off
``req.<rid>.out``) equal ``transformers``' greedy ``generate()`` on the same
folder, whether its prefix was recomputed, hit in L1, restored from the node's
L2, prefilled on a prefill node and handed to a decode node with its real K/V
pages, or served after the node switched phases and back. Each path is counted
(engine counters over ``svc.stats``, ``usage.prompt_tokens_details.cached_tokens``)
and must occur. Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from evolving_infra.cluster import ClusterSpec, LocalCluster  # noqa: E402
from shared import messages as m  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.subjects import REQ_OUT, SPLIT_APPLIED, SPLIT_SET, SVC_STATS, Subjects  # noqa: E402
from services.worker.engines.torch_engine.checkpoint import init_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)
NODES = ["w0", "w1", "w2", "w3"]
BS = 8  # torch-tiny-cpu page size


def _ref(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


async def test_torch_cluster_outputs_equal_reference_on_every_path(tmp_path):
    folder = tmp_path / "model"
    init_model(folder, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, context=2048, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    spec = ClusterSpec(
        nodes=4, split="2P2D", profile="torch-tiny-cpu", speedup=1.0, port=0, block_size=BS, routing="cache-aware",
        log_dir=str(tmp_path / "logs"), ready_timeout_s=180.0, engine="torch", model_dir=str(folder),
        tokenizer=f"hf:{folder}", model="tiny", max_context_tokens=2048, worker_args=("--check-invariants",),
    )  # fmt: skip
    rng = random.Random(3)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    async with LocalCluster(spec) as cluster:
        bus = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="test-torch", auth=cluster.client_auth("admin"))
        chunks: dict[str, list[m.TokenChunk]] = defaultdict(list)
        applied: list[m.SplitApplied] = []

        async def on_chunk(msg: m.TokenChunk, _s: str) -> None:
            chunks[msg.rid].append(msg)

        async def on_applied(msg: m.SplitApplied, _s: str) -> None:
            applied.append(msg)

        await bus.subscribe(REQ_OUT, on_chunk)
        await bus.subscribe(SPLIT_APPLIED, on_applied)
        results: list[dict] = []

        async def ask(http: httpx.AsyncClient, label: str, prompt: list[int], n: int, branch: str) -> list[int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": n}
            r = await http.post(cluster.router_url + "/v1/completions", json=body, headers={"X-Branch-Id": branch})
            assert r.status_code == 200, (label, r.text)
            obj = r.json()
            rid = r.headers["x-request-id"]
            await asyncio.sleep(0.05)
            ids = [t for c in sorted(chunks[rid], key=lambda c: c.index) for t in c.token_ids]
            assert len(ids) == n and obj["usage"]["completion_tokens"] == n, (label, ids)
            results.append(dict(label=label, prompt=prompt, out=ids, cached=obj["usage"]["prompt_tokens_details"]["cached_tokens"],
                                prefill=obj["ei"]["prefill_node"], decode=obj["ei"]["decode_node"]))  # fmt: skip
            return ids

        async def switch(split: str, node: str, phase: str) -> None:
            reply = await bus.request(SPLIT_SET, m.SplitSetRequest(split=split, reason="test"), timeout=10.0)
            assert reply.ok, reply.error
            epoch = reply.command.epoch
            deadline = time.monotonic() + 60
            while not any(a.node == node and a.phase == phase and a.status == "serving" and a.epoch >= epoch for a in applied):
                assert time.monotonic() < deadline, f"switch to {split} did not complete"
                cluster.check_alive()
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)  # the router sees the new phases (node.state)

        async with httpx.AsyncClient(timeout=120) as http:
            # an agent session: turn 1, turn 2 (quotes turn 1's answer), a fork of turn 2, a sub-agent
            system = toks(90)
            t1 = system + toks(40)
            o1 = await ask(http, "turn1", t1, 10, "main")
            t2 = t1 + o1 + toks(25)
            o2 = await ask(http, "turn2", t2, 10, "main")
            fork_a, fork_b = t2 + o2 + toks(14), t2 + o2 + toks(19)
            await asyncio.gather(ask(http, "fork_a", fork_a, 8, "fork-a"), ask(http, "fork_b", fork_b, 8, "fork-b"))
            sub = system + toks(60)
            await ask(http, "subagent", sub, 8, "sub-1")
            # unrelated sessions fill both prefill nodes' L1 (128 pages each): the session's pages go to L2 only
            await asyncio.gather(*(ask(http, f"other{i}", toks(500), 4, f"other-{i}") for i in range(6)))
            t3 = t2 + o2 + toks(11)
            o3 = await ask(http, "turn3", t3, 8, "main")
            # in-place P→D→P switch of w1 (1P3D makes it decode, 2P2D prefill again); its L1/L2 stay,
            # so a session it prefilled before the switches hits its cache after them
            on_w1 = [r for r in results if r["prefill"] == "w1"]
            assert on_w1, [(r["label"], r["prefill"]) for r in results]
            await switch("1P3D", "w1", "decode")
            await switch("2P2D", "w1", "prefill")
            last = on_w1[-1]
            await ask(http, "after_switch", last["prompt"] + last["out"] + toks(9), 8, "after")
        await asyncio.sleep(0.3)
        workers = {n: (await bus.request(SVC_STATS, m.StatsRequest(), instance=f"worker-{n}", timeout=10.0)).counters for n in NODES}
        await bus.close()

    for r in results:
        assert r["out"] == _ref(hf, r["prompt"], len(r["out"])), r["label"]
    by = {r["label"]: r for r in results}
    paths = {
        "recompute": sum(1 for r in results if r["cached"] == 0),
        "l1_hit": sum(1 for k in ("turn2", "fork_a", "fork_b", "subagent") if by[k]["cached"] > 0),
        "l2_restore": sum(w.get("engine.restored_pages", 0) for n, w in workers.items()),
        "handoff": sum(w.get("engine.handoff_pages_in", 0) for n, w in workers.items()),
        "hit_after_switch": int(by["after_switch"]["cached"] > 0 and by["after_switch"]["prefill"] == "w1"),
        "decoded_elsewhere": sum(1 for r in results if r["decode"] and r["decode"] != r["prefill"]),
    }
    print("torch cluster paths:", paths)
    assert all(v > 0 for v in paths.values()), (paths, [(r["label"], r["cached"], r["prefill"], r["decode"]) for r in results])
    assert by["turn3"]["cached"] >= len(t2) // BS * BS - BS  # the session's prefix came back (L1 or L2)
