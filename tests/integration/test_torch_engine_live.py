"""A 2P2D cluster of real processes over NATS serving a real model (``--engine torch``).

A multi-turn agent session with a fork and a sub-agent, plus unrelated traffic
that pushes the session out of the prefill nodes' L1, and an in-place
P→D→P switch of a prefill node: every request's output token ids (read off
``req.<rid>.out``) equal ``transformers``' greedy ``generate()`` on the same
folder, whether its prefix was recomputed, hit in L1, restored from the node's
L2, fetched from a peer's L2 through Mooncake (real bytes), prefilled on a
prefill node and handed to a decode node with its real K/V pages, or served
after the node switched phases and back. The router runs the paper's ``ttft``
policy (Eq. 7) with a fetch model for these ~200-token prompts (``--routing-opt``
values as router flags, ``ROUTER_ARGS``); the peer fetch is its own choice: the
prefill node holding the session gets a queue of one-token requests, and the
router sends the session's next turn to the other prefill node with a fetch plan
(asserted from the response's ``ei``: prefill node, ``fetch_sources``,
``fetched_tokens``). Each path is counted (engine counters over ``svc.stats``,
``usage.prompt_tokens_details.cached_tokens``) and must occur. These requests
say ``ignore_eos``; one more prompt, whose greedy continuation contains the
token the folder's ``generation_config.json`` names as EOS, ends there with
``finish_reason`` ``stop`` without it and runs to ``max_tokens`` (``length``)
with it. Needs the ``torch`` extra and Mooncake; skipped without them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import defaultdict

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from evolving_infra.cluster import ClusterSpec, LocalCluster  # noqa: E402
from evolving_infra.policy_args import routing_option_args  # noqa: E402
from shared import messages as m  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.hashing import block_hashes, pack_tokens  # noqa: E402
from shared.subjects import KV_LOOKUP, NODE_STATE, REQ_OUT, SPLIT_APPLIED, SPLIT_SET, SVC_STATS, WORK_PREFILL, Subjects  # noqa: E402
from services.worker.kvpool.transport import pick_port_range  # noqa: E402
from services.worker.engines.torch_engine.checkpoint import init_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def _disjoint_port_ranges(n: int) -> list[tuple[int, int]]:
    """``n`` free Mooncake port pairs that share no port (each draw is free on its own, but two
    draws may overlap: a worker then fails to initialise its transfer engine)."""
    out: list[tuple[int, int]] = []
    while len(out) < n:
        lo, hi = pick_port_range()
        if all(hi < a or lo > b for a, b in out):
            out.append((lo, hi))
    return out
NODES = ["w0", "w1", "w2", "w3"]
BS = 8  # torch-tiny-cpu page size
LOAD = 2000
"""One-token requests queued on the prefill node holding the session before its peer-fetch turn."""
ROUTER_ARGS = routing_option_args({"ttft_fetch_min_tokens": BS, "ttft_fetch_base_s": 0.005}) + ("--lookup-timeout-s", "5")
"""The ttft router's fetch model for ~200-token prompts on one machine (``--routing-opt`` of ``up``; paper
Eq. 7: τ(x) = base + 1 µs·x, fetch from one page on; the paper's 0.45 s and 512 tokens are for GPU nodes
and long prompts), and a directory reply waited for up to 5 s on a loaded machine (a reply too late
routes without cache info)."""


def _ref(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _mooncake() -> bool:
    try:
        from services.worker.kvpool.transport import load_mooncake

        load_mooncake()
        return True
    except Exception:
        return False


async def test_torch_cluster_outputs_equal_reference_on_every_path(tmp_path):
    if not _mooncake():
        if os.environ.get("EI_REQUIRE_MOONCAKE"):
            pytest.fail("EI_REQUIRE_MOONCAKE is set but mooncake.engine does not import")
        pytest.skip("Mooncake not installed (make .venv/.mooncake): the peer fetch needs it")
    folder = tmp_path / "model"
    init_model(folder, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, context=2048, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    # EOS: the folder's generation_config.json names a token the model is known to produce
    # for eos_prompt (its first occurrence at output index j ≥ 2); every other request says
    # ignore_eos (their lengths stay max_tokens), eos_prompt is asked with and without it
    erng = random.Random(99)
    eos_prompt = [erng.randrange(3, 500) for _ in range(45)]
    eos_ref = _ref(hf, eos_prompt, 10)
    j = next(i for i in range(2, 10) if eos_ref.index(eos_ref[i]) == i)
    gen_cfg = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen_cfg, "eos_token_id": eos_ref[j]}))
    spec = ClusterSpec(
        nodes=4, split="2P2D", profile="torch-tiny-cpu", speedup=1.0, port=0, block_size=BS, routing="ttft",
        log_dir=str(tmp_path / "logs"), ready_timeout_s=180.0, engine="torch", model_dir=str(folder),
        tokenizer=f"hf:{folder}", model="tiny", max_context_tokens=2048, router_args=ROUTER_ARGS,
        # the test publishes work itself (as admin, not through the router), so no router has it in
        # flight: the nodes' owner checks (route.held) would drop it as a dead router's work
        worker_args=("--check-invariants", "--kv-pool", "real", "--owner-check-interval-s", "0"),
        node_args={n: ("--kv-pool-ports", "%d-%d" % r) for n, r in zip(NODES, _disjoint_port_ranges(len(NODES)))},
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

        states: dict[str, m.NodeState] = {}

        async def on_state(msg: m.NodeState, _s: str) -> None:
            states[msg.node] = msg

        await bus.subscribe(REQ_OUT, on_chunk)
        await bus.subscribe(SPLIT_APPLIED, on_applied)
        await bus.subscribe(NODE_STATE, on_state)
        results: list[dict] = []

        async def ask(http: httpx.AsyncClient, label: str, prompt: list[int], n: int, branch: str) -> list[int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "ignore_eos": True}
            r = await http.post(cluster.router_url + "/v1/completions", json=body, headers={"X-Branch-Id": branch})
            assert r.status_code == 200, (label, r.text)
            obj = r.json()
            rid = r.headers["x-request-id"]
            await asyncio.sleep(0.05)
            ids = [t for c in sorted(chunks[rid], key=lambda c: c.index) for t in c.token_ids]
            assert len(ids) == n and obj["usage"]["completion_tokens"] == n, (label, ids)
            ei = obj["ei"]
            results.append(dict(label=label, prompt=prompt, out=ids, cached=obj["usage"]["prompt_tokens_details"]["cached_tokens"],
                                prefill=ei["prefill_node"], decode=ei["decode_node"], fetched=ei["fetched_tokens"],
                                sources=ei["fetch_sources"]))  # fmt: skip
            return ids

        def by_label(label: str) -> dict:
            return next(r for r in results if r["label"] == label)

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
            # peer fetch chosen by the router (paper Eq. 7): the prefill node holding the session is
            # given a queue of one-token requests shorter than a page (no full page: they add,
            # evict and restore no KV anywhere), published to it directly; the router reads that
            # queue in the node's node.state, predicts the wait there and sends the session's next
            # turn to the other prefill node, which fetches the prefix from a peer's L2 through
            # Mooncake (the test only loads the node; the choice and the fetch plan are the router's)
            x = by_label("turn3")["prefill"]
            y = "w1" if x == "w0" else "w0"
            t5 = t3 + o3 + toks(7)
            hashes = block_hashes(t5, BS)
            for _ in range(200):  # the directory knows the session's pages
                reply = await bus.request(KV_LOOKUP, m.KvLookupRequest(block_hashes=hashes, block_size=BS), timeout=10.0)
                if reply.longest_any >= len(t3) // BS:
                    break
                await asyncio.sleep(0.05)
            assert reply.longest_any >= len(t3) // BS, reply
            states.pop(x, None)
            t_load = time.monotonic()
            load = {f"load-{i}": toks(BS - 1) for i in range(LOAD)}
            for rid, prompt in load.items():
                await bus.publish(WORK_PREFILL, m.PrefillWork(rid=rid, prompt_tokens=len(prompt), max_tokens=1, block_size=BS,
                                  token_ids=pack_tokens(prompt), decode_node="w2", ignore_eos=True), node=x)  # fmt: skip
            deadline = time.monotonic() + 120
            while x not in states or len(states[x].queue) < LOAD // 4:  # x reports the queue (it drains ~300 a second here)
                assert time.monotonic() < deadline, f"{x} never reported the queue of {LOAD} requests"
                cluster.check_alive()
                await asyncio.sleep(0.01)
            seen_queue = len(states[x].queue)
            t_seen = time.monotonic()
            await ask(http, "peer_fetch", t5, 8, "main")
            t_asked, asked_queue = time.monotonic(), len(states[x].queue)
            deadline = time.monotonic() + 300
            while not all(any(c.finished for c in chunks[rid]) for rid in load):
                assert time.monotonic() < deadline, "the load on the prefix holder did not finish"
                cluster.check_alive()
                await asyncio.sleep(0.05)
            pf = by_label("peer_fetch")
            print(f"load: {LOAD} requests on {x}, a queue of {seen_queue} seen after {t_seen - t_load:.2f} s, peer_fetch answered "
                  f"{t_asked - t_seen:.2f} s later (queue then {asked_queue}) (prefill {pf['prefill']}, fetched {pf['fetched']} tokens from {pf['sources']}), "
                  f"load done after {time.monotonic() - t_load:.2f} s")  # fmt: skip
            assert all(not c.error for rid in load for c in chunks[rid]), [c for rid in load for c in chunks[rid] if c.error][:3]
            load_sample = [(load[rid], [t for c in chunks[rid] for t in c.token_ids]) for rid in list(load)[:: LOAD // 40]]
            # in-place P→D→P switch of w1 (1P3D makes it decode, 2P2D prefill again); its L1/L2 stay,
            # so a session it prefilled before the switches hits its cache after them
            on_w1 = [r for r in results if r["prefill"] == "w1"]
            assert on_w1, [(r["label"], r["prefill"]) for r in results]
            await switch("1P3D", "w1", "decode")
            await switch("2P2D", "w1", "prefill")
            # a session only w1 holds: when the peer fetch went to the other prefill node, that node
            # holds the main session too and may rightly serve its next turn (seen: 1 run in 3)
            w1_only = [r for r in on_w1 if not any(o["prefill"] != "w1" and o["prompt"][:BS] == r["prompt"][:BS] for o in results)]
            last = (w1_only or on_w1)[-1]
            await ask(http, "after_switch", last["prompt"] + last["out"] + toks(9), 8, "after")
            # EOS through the OpenAI API: stops at the EOS token ("stop"), unless ignore_eos ("length")
            eos_out = {}
            for flag in (False, True):
                body = {"model": "tiny", "prompt": eos_prompt, "max_tokens": 10, "ignore_eos": flag}
                r = await http.post(cluster.router_url + "/v1/completions", json=body, headers={"X-Branch-Id": f"eos-{flag}"})
                assert r.status_code == 200, r.text
                await asyncio.sleep(0.05)
                ids = [t for c in sorted(chunks[r.headers["x-request-id"]], key=lambda c: c.index) for t in c.token_ids]
                eos_out[flag] = (ids, r.json())
        await asyncio.sleep(0.3)
        workers = {n: (await bus.request(SVC_STATS, m.StatsRequest(), instance=f"worker-{n}", timeout=10.0)).counters for n in NODES}
        await bus.close()

    for r in results:
        assert r["out"] == _ref(hf, r["prompt"], len(r["out"])), r["label"]
    for prompt, out in load_sample:  # the load's one-token requests, prefilled 32 to an iteration
        assert out == _ref(hf, prompt, 1), prompt
    (ids, obj), (ids_all, obj_all) = eos_out[False], eos_out[True]
    assert ids == eos_ref[: j + 1] and obj["usage"]["completion_tokens"] == j + 1, (ids, eos_ref, j)
    assert obj["choices"][0]["finish_reason"] == "stop"
    assert ids_all == eos_ref and obj_all["choices"][0]["finish_reason"] == "length"
    by = {r["label"]: r for r in results}
    # the router chose the fetch: the other prefill node, with a fetch plan whose pages came from a peer
    pf = by["peer_fetch"]
    assert pf["prefill"] == y and pf["sources"] and y not in pf["sources"], pf
    assert pf["fetched"] > 0 and pf["cached"] >= pf["fetched"], pf
    paths = {
        "recompute": sum(1 for r in results if r["cached"] == 0),
        "l1_hit": sum(1 for k in ("turn2", "fork_a", "fork_b", "subagent") if by[k]["cached"] > 0),
        "l2_restore": sum(w.get("engine.restored_pages", 0) for n, w in workers.items()),
        "handoff": sum(w.get("engine.handoff_pages_in", 0) for n, w in workers.items()),
        "hit_after_switch": int(by["after_switch"]["cached"] > 0 and by["after_switch"]["prefill"] == "w1"),
        "peer_fetch": sum(w.get("engine.fetched_pages", 0) for w in workers.values()),
        "decoded_elsewhere": sum(1 for r in results if r["decode"] and r["decode"] != r["prefill"]),
    }
    print("torch cluster paths:", paths)
    assert all(v > 0 for v in paths.values()), (paths, [(r["label"], r["cached"], r["prefill"], r["decode"]) for r in results])
    assert by["turn3"]["cached"] >= len(t2) // BS * BS - BS  # the session's prefix came back (L1 or L2)
