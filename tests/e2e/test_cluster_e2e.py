"""The whole cluster as separate OS processes over a real nats-server (foundation must-shows).

One cluster per module (tiny profile, 4-token blocks, 2P2D) serves every test:
a request end to end over HTTP; KV events reach the directory and lookups
follow stores and evictions; a sequence gap makes the directory resync from the
real worker; a malformed payload on every subject is counted and dropped while
the cluster keeps serving.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import pytest_asyncio

from evolving_infra.cluster import ClusterSpec, LocalCluster
from shared import messages as m
from shared.bus import Bus
from shared.hashing import block_hashes
from shared.subjects import ALL, KV_EVENTS, KV_LOOKUP, KV_RESYNC, SVC_STATS, Subjects

BS = 4
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory):
    spec = ClusterSpec(
        nodes=4,
        split="2P2D",
        profile="tiny",
        speedup=5.0,
        port=0,
        block_size=BS,
        log_dir=str(tmp_path_factory.mktemp("logs")),
        ready_timeout_s=60.0,
    )
    async with LocalCluster(spec) as c:
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bus(cluster):
    b = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="e2e-test", auth=cluster.client_auth("admin"))
    yield b
    await b.close()


async def complete(url: str, prompt: list[int], max_tokens: int = 5, headers: dict | None = None) -> dict:
    """Streamed completion; returns tokens, usage and nodes."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", url + "/v1/completions", json=body, headers=headers or {}) as resp:
            assert resp.status_code == 200, await resp.aread()
            # a stream's headers name the placement at acceptance (the decode node is bound at
            # prefill start, later): the final placement is the `ei` object of the last chunks
            nodes = (resp.headers.get("x-ei-prefill-node"), resp.headers.get("x-ei-decode-node"))
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                obj = json.loads(line[5:])
                assert "error" not in obj, obj
                for ch in obj.get("choices") or []:
                    if ch.get("text"):
                        text.append(ch["text"])
                usage = obj.get("usage") or usage
                if obj.get("ei"):
                    nodes = (obj["ei"]["prefill_node"], obj["ei"]["decode_node"])
    return {"text": text, "usage": usage, "prefill": nodes[0], "decode": nodes[1]}


async def stats(bus: Bus, instance: str) -> m.StatsReply:
    return await bus.request(SVC_STATS, m.StatsRequest(), instance=instance, timeout=5.0)


async def lookup(bus: Bus, prompt: list[int]) -> m.KvLookupReply:
    return await bus.request(KV_LOOKUP, m.KvLookupRequest(block_hashes=block_hashes(prompt, BS), block_size=BS), timeout=5.0)


def prompt_of(seed: int, blocks: int = 8) -> list[int]:
    return [(seed * 1000 + i) % 90_000 for i in range(blocks * BS)]


def flood_prompt(k: int, blocks: int = 8) -> list[int]:
    """The k-th of 2,000 prompts that share no block with each other or with ``prompt_of(s)``
    for s < 50 (distinct first tokens from 50,000; ``prompt_of`` wraps at 90,000, so seeds
    that differ by 90 give the same prompt — the flood once re-sent the target itself)."""
    assert 0 <= k < 2000
    return [50_000 + k * 17 + i for i in range(blocks * BS)]


async def test_request_end_to_end_with_prefix_reuse(cluster, bus):
    prompt = prompt_of(1)
    first = await complete(cluster.router_url, prompt, max_tokens=7, headers={"X-Branch-Id": "agent-1"})
    assert first["usage"]["completion_tokens"] == 7 and len(first["text"]) >= 1
    assert first["prefill"] in ("w0", "w1") and first["decode"] in ("w2", "w3")
    again = await complete(cluster.router_url, prompt + [5, 6, 7, 8], max_tokens=3, headers={"X-Branch-Id": "agent-1"})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - BS
    # the directory saw the KV events of both the prefill and the decode node
    for _ in range(50):
        reply = await lookup(bus, prompt)
        held = {n.node: n for n in reply.nodes}
        if first["prefill"] in held and first["decode"] in held:
            break
        await asyncio.sleep(0.1)
    assert held[first["prefill"]].local_blocks == len(prompt) // BS
    assert held[first["decode"]].gpu_blocks == len(prompt) // BS
    assert reply.longest_any == len(prompt) // BS


async def test_lookups_follow_evictions(cluster, bus):
    target = prompt_of(2)
    await complete(cluster.router_url, target, max_tokens=2)
    assert (await lookup(bus, target)).longest_any == len(target) // BS
    # tiny profile: L1 64 blocks, L2 256 blocks per node. A node that gets >= 40 of the
    # 160 distinct 8-block prompts below (320 blocks) evicts every block of `target` from
    # both tiers (LRU). How the router spreads them is its business (cache-aware ties race
    # on load), so the test counts what each node got.
    before = (await stats(bus, "router")).counters
    for batch in range(8):
        await asyncio.gather(*(complete(cluster.router_url, flood_prompt(batch * 20 + i), max_tokens=2) for i in range(20)))
    after = (await stats(bus, "router")).counters
    got = {
        n: sum(after.get(f"routed.{ph}.{n}", 0) - before.get(f"routed.{ph}.{n}", 0) for ph in ("prefill", "decode"))
        for n in ("w0", "w1", "w2", "w3")
    }
    flooded = {n for n, k in got.items() if k >= 40}
    assert flooded, got
    for _ in range(50):
        reply = await lookup(bus, target)
        claimed = {x.node for x in reply.nodes}
        if not claimed & flooded:
            break
        await asyncio.sleep(0.1)
    assert not claimed & flooded, (reply, got)  # evicted wherever the flood went, and the directory knows
    last = block_hashes(target, BS)[-1]
    for n in claimed:  # what it still claims, the worker really holds
        snap = await bus.request(KV_RESYNC, m.KvResyncRequest(node=n, reason="test"), node=n, timeout=5.0)
        assert last in set(snap.gpu) | set(snap.host), (n, got)


async def test_sequence_gap_triggers_resync_from_the_worker(cluster, bus):
    before = (await stats(bus, "kvdirectory")).counters.get("kv.resyncs", 0)
    # A batch from "w0" far ahead of its real sequence: the directory must detect
    # the gap and ask the real worker w0 for a snapshot.
    await bus.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=10**9, events=[]), node="w0")
    for _ in range(100):
        after = (await stats(bus, "kvdirectory")).counters
        if after.get("kv.resyncs", 0) > before:
            break
        await asyncio.sleep(0.1)
    assert after.get("kv.gaps", 0) >= 1
    assert after.get("kv.resyncs", 0) > before
    served = (await stats(bus, "worker-w0")).counters
    assert served.get("kv.resyncs", 0) >= 1
    # and the cluster still serves, with the directory's view of w0 intact
    out = await complete(cluster.router_url, prompt_of(3), max_tokens=2)
    assert out["usage"]["completion_tokens"] == 2


async def test_malformed_payload_on_every_subject_is_counted_and_dropped(cluster, bus):
    subjects = Subjects("p0")
    params = {"node": "w0", "rid": "deadbeef", "service": "worker", "instance": "nobody", "router": "router"}
    garbage = b"\xc1\xff not msgpack"
    for s in ALL:
        await bus.publish_raw(subjects.format(s, **{p: params[p] for p in s.params}), garbage)
    await bus.nc.flush()
    expected = {
        "kvdirectory": ["kv.events.{node}", "branch.events", "route.placed", "kv.lookup"],
        "worker-w0": ["work.{node}.prefill", "work.{node}.decode", "work.{node}.kv", "work.{node}.abort", "split.commands", "kv.resync.{node}"],
        "router": ["node.state.{node}", "split.commands", "req.{rid}.out.{node}"],
        "planner": ["node.iters.{node}", "split.get"],
    }
    for _ in range(50):
        snap = {inst: (await stats(bus, inst)).counters for inst in expected}
        if all(snap[i].get("dropped." + t, 0) >= 1 for i, ts in expected.items() for t in ts):
            break
        await asyncio.sleep(0.1)
    for inst, templates in expected.items():
        for t in templates:
            assert snap[inst].get("dropped." + t, 0) >= 1, (inst, t, snap[inst])
    out = await complete(cluster.router_url, prompt_of(4), max_tokens=3)
    assert out["usage"]["completion_tokens"] == 3
    cluster.check_alive()
