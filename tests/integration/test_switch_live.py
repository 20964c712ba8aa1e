"""In-place phase switches on the live stack under continuous load (issue 6 part 4, Must-show).

Every service is its own OS process (``LocalCluster``: nats-server, directory,
planner, router, four workers) at ``--speedup 1``. Six agents stream
completions without pause while the operator switches nodes back and forth
(``evolving-infra split set`` for the first switch, ``split.set`` requests for
the rest): 2P2D → 3P1D → 2P2D → 1P3D → 2P2D → 3P1D → 2P2D, so w2 goes D→P→D→P→D
and w1 P→D→P. Checked:

* no request is lost, duplicated or answered twice: every HTTP request gets 200
  with exactly ``max_tokens`` tokens and one ``[DONE]``; on the bus, each
  request's ``TokenChunk`` indexes cover ``[0, max_tokens)`` exactly once, with
  one first chunk and one final chunk, and no error/abort chunk;
* every switch completes: the switching node reports ``split.applied`` serving
  its new phase with a ``switch_s``;
* the control overhead beyond draining — ``switch_s − (drained_at − received_at)``,
  i.e. command propagation plus everything after the last running request
  finished — is at most 1 s;
* the directory applied the D→P rule (counts of the switched node reset).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from evolving_infra.cluster import ClusterSpec, LocalCluster
from shared import messages as m
from shared.bus import Bus
from shared.split import split_phases
from shared.subjects import NODE_STATE, REQ_OUT, SPLIT_APPLIED, SPLIT_SET, SVC_STATS, Subjects

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
BS = 4
NODES = ["w0", "w1", "w2", "w3"]
SWITCHES = ["3P1D", "2P2D", "1P3D", "2P2D", "3P1D", "2P2D"]
AGENTS = 8

PROFILE = """
# tiny's timing with room for a few concurrent requests per node (tests only)
name = "switch-test"
block_size = 4
kv_bytes_per_token = 1000
[prefill]
c0 = 0.002
c1 = 6.0e-4
c2 = 1.0e-8
c3 = 1.0e-6
[decode]
d0 = 0.003
d1 = 0.001
d2 = 0.0005
active_experts = 2
experts = 8
tokens_per_forward = 2.0
accepted_per_iteration = 1.5
[memory]
gpu_kv_tokens = 4096
host_kv_tokens = 16384
[links]
gpu_to_gpu_bytes_per_s = 1.0e8
gpu_to_gpu_latency_s = 0.001
[scheduler]
chunk_tokens = 64
max_running = 16
"""


@dataclass
class Sent:
    rid: str
    max_tokens: int
    status: int
    tokens: int = 0
    done_events: int = 0
    errors: list = field(default_factory=list)
    nodes: tuple = ()


async def _agent(url: str, i: int, stop: asyncio.Event, out: list[Sent], rng: random.Random) -> None:
    """One agent: a branch whose context grows by a turn per request, streamed, back to back."""
    context = [(i * 7919 + k) % 50_000 for k in range(40)]
    async with httpx.AsyncClient(timeout=60) as http:
        while not stop.is_set():
            context = context + [rng.randrange(50_000) for _ in range(rng.randint(4, 24))]
            if len(context) > 600:  # a compaction: start over with a short summary
                context = context[:40]
            max_tokens = rng.randint(6, 40)
            body = {"prompt": context, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", url + "/v1/completions", json=body, headers={"X-Branch-Id": f"agent-{i}"}) as r:
                s = Sent(rid=r.headers.get("x-request-id", "?"), max_tokens=max_tokens, status=r.status_code,
                         nodes=(r.headers.get("x-ei-prefill-node"), r.headers.get("x-ei-decode-node")))  # fmt: skip
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if line.strip() == "data: [DONE]":
                        s.done_events += 1
                        continue
                    obj = json.loads(line[5:])
                    if "error" in obj:
                        s.errors.append(obj["error"])
                    if obj.get("usage"):
                        s.tokens = obj["usage"]["completion_tokens"]
                if r.status_code != 200:
                    s.errors.append((await r.aread()).decode(errors="replace"))
            out.append(s)


async def _burst(url: str, seed: int, out: list[Sent]) -> None:
    """A fresh 400-token prompt (7 prefill chunks): queues up on a prefill node."""
    rng = random.Random(10_000 + seed)
    prompt = [rng.randrange(50_000) for _ in range(400)]
    max_tokens = rng.randint(2, 10)
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            s = Sent(rid=r.headers.get("x-request-id", "?"), max_tokens=max_tokens, status=r.status_code)
            async for line in r.aiter_lines():
                if line.strip() == "data: [DONE]":
                    s.done_events += 1
                elif line.startswith("data:"):
                    obj = json.loads(line[5:])
                    if "error" in obj:
                        s.errors.append(obj["error"])
                    if obj.get("usage"):
                        s.tokens = obj["usage"]["completion_tokens"]
    out.append(s)


async def test_switch_nodes_back_and_forth_under_load(tmp_path):
    t_start = time.monotonic()
    profile = tmp_path / "switch.toml"
    profile.write_text(PROFILE)
    spec = ClusterSpec(nodes=4, split="2P2D", profile=str(profile), speedup=1.0, port=0, block_size=BS,
                       log_dir=str(tmp_path / "logs"), ready_timeout_s=60.0)  # fmt: skip
    async with LocalCluster(spec) as cluster:
        bus = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="test-switch", auth=cluster.client_auth("admin"))
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
        bursts: list[asyncio.Task] = []
        stop = asyncio.Event()
        sent: list[Sent] = []
        loops = [asyncio.create_task(_agent(cluster.router_url, i, stop, sent, random.Random(i))) for i in range(AGENTS)]
        switched: list[tuple[str, str, int]] = []  # (node, new phase, epoch)
        try:
            await asyncio.sleep(1.0)  # load builds up
            phases = split_phases("2P2D", NODES)
            for k, split in enumerate(SWITCHES):
                new = split_phases(split, NODES)
                changed = {n: p for n, p in new.items() if phases[n] != p}
                assert len(changed) == 1, changed
                ((node, _),) = changed.items()
                if phases[node] == "prefill":  # P→D: make sure requests are queued there when the command lands
                    bursts += [asyncio.create_task(_burst(cluster.router_url, 100 * k + j, sent)) for j in range(8)]
                    t_q = time.monotonic() + 5
                    while time.monotonic() < t_q and not (node in states and states[node].waiting >= 2):
                        await asyncio.sleep(0.005)
                if k == 0:  # the operator's command line
                    proc = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "evolving_infra.cli", "split", "set", split, "--nats-url", cluster.nats_url, "--json", "--nats-creds", str(cluster.creds_file("operator")),
                        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    )  # fmt: skip
                    outb, errb = await asyncio.wait_for(proc.communicate(), 30)
                    assert proc.returncode == 0, errb.decode()
                    line = [ln for ln in outb.decode().splitlines() if ln.startswith("{")][-1]  # the CLI may log before it
                    epoch = json.loads(line)["epoch"]
                else:
                    reply = await bus.request(SPLIT_SET, m.SplitSetRequest(split=split, reason="test"), timeout=5.0)
                    assert reply.ok, reply.error
                    epoch = reply.command.epoch
                deadline = time.monotonic() + 30
                while not all(
                    any(a.node == n and a.phase == p and a.status == "serving" and a.epoch >= epoch for a in applied)
                    for n, p in changed.items()
                ):
                    assert time.monotonic() < deadline, f"switch to {split} did not complete: {changed}, applied={applied[-6:]}"
                    cluster.check_alive()
                    await asyncio.sleep(0.02)
                switched += [(n, p, epoch) for n, p in changed.items()]
                phases = new
                await asyncio.sleep(0.8)  # serve a while in the new split
        finally:
            stop.set()
            await asyncio.gather(*loops, *bursts)
        await asyncio.sleep(0.3)  # last chunks on the test's subscription
        router = (await bus.request(SVC_STATS, m.StatsRequest(), instance="router", timeout=5.0)).counters
        directory = (await bus.request(SVC_STATS, m.StatsRequest(), instance="kvdirectory", timeout=5.0)).counters
        workers = {n: (await bus.request(SVC_STATS, m.StatsRequest(), instance=f"worker-{n}", timeout=5.0)).counters for n in NODES}
        await bus.close()

    # -- no request lost, duplicated or answered twice ---------------------------------------- #
    assert len(sent) >= 50, len(sent)
    bad = [s for s in sent if s.status != 200 or s.errors or s.done_events != 1 or s.tokens != s.max_tokens]
    assert not bad, bad[:5]
    assert len({s.rid for s in sent}) == len(sent)
    for s in sent:
        cs = sorted(chunks[s.rid], key=lambda c: c.index)
        assert cs, f"{s.rid}: no chunk on the bus"
        assert all(c.finish_reason in (None, "length") and c.error is None for c in cs), cs
        pos = 0
        for c in cs:
            assert c.index == pos, f"{s.rid}: chunk at {c.index}, expected {pos} (gap or duplicate): {cs}"
            pos += len(c.token_ids)
        assert pos == s.max_tokens, (s.rid, pos, s.max_tokens)
        assert sum(c.finished for c in cs) == 1 and cs[-1].finished
        assert sum(c.index == 0 for c in cs) == 1
    assert set(chunks) <= {s.rid for s in sent}, "a chunk for a request nobody sent"
    assert all(v == 0 for k, v in router.items() if k.startswith(("finish.", "no_route", "requeue.stale", "requeue.malformed")))

    # -- every switch completes, and the control overhead beyond draining is ≤ 1 s --------------- #
    overheads = []
    for node, phase, epoch in switched:
        (a,) = [a for a in applied if a.node == node and a.phase == phase and a.status == "serving" and a.epoch >= epoch][:1]
        assert a.switch_s > 0 and a.received_at >= a.decided_at and a.drained_at >= a.received_at, a
        drain = a.drained_at - a.received_at
        overhead = a.switch_s - drain
        assert 0 <= overhead <= 1.0, (a, overhead)
        overheads.append((node, phase, round(a.switch_s, 4), round(drain, 4), round(overhead, 4), a.requeued))
    assert len(overheads) == len(SWITCHES)
    requeued = sum(o[5] for o in overheads)
    assert requeued >= 1, overheads  # queued requests were handed back (and then served elsewhere, checked above)
    assert router.get("requeue.prefill", 0) >= requeued and router.get("requeue.rerouted", 0) >= requeued
    assert sum(w.get("requeue.refused", 0) + w.get("requeue.failed", 0) for w in workers.values()) == 0
    assert sum(w.get("bind.failed", 0) for w in workers.values()) == 0
    assert directory.get("phase.reset_branches", 0) >= 1  # D→P of w2 released the branches counted there
    print(f"\nswitches (node, phase, switch_s, drain_s, overhead_s, requeued): {overheads}")
    print(f"requests: {len(sent)}, wall {time.monotonic() - t_start:.1f} s, router requeue: "
          f"{ {k: v for k, v in router.items() if k.startswith(('requeue', 'bind'))} }")  # fmt: skip
