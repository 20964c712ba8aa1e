"""Real-bytes shared host pool between two worker processes (issue 6 part 2, wired into the worker).

Two ``python -m services.worker --kv-pool real`` processes and a KV directory
process over a real nats-server; the test plays the router: it computes the
fetch plan from the directory's ``kv.lookup`` (``fetch_plan_for_reply``, the
router's own function) and dispatches ``PrefillWork``. A prompt whose prefix is
only in w0's L2 is sent to w1: w1 pulls those blocks with Mooncake's transfer
engine (TCP), every block's CRC-32 is checked, the blocks land in w1's L2 (the
directory sees them) and the prefill reuses them. Skipped without Mooncake
unless ``EI_REQUIRE_MOONCAKE`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest

from services.kvdirectory.lookup import fetch_plan_for_reply
from services.worker.kvpool.transport import pick_port_range
from shared import messages as m
from shared.bus import Bus, BusError, decoder_for
from shared.hashing import block_hashes, pack_tokens, tokens_for_blocks
from shared.subjects import KV_LOOKUP, REQ_OUT, SVC_STATS, WORK_PREFILL, Subjects
from tests.e2e.test_tracing_e2e import OtlpReceiver, _attrs

REPO = Path(__file__).resolve().parents[2]
BS = 4
pytestmark = pytest.mark.timeout(120)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def mooncake_or_skip() -> None:
    probe = subprocess.run(
        [sys.executable, "-c", "from services.worker.kvpool.transport import load_mooncake; load_mooncake()"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        if os.environ.get("EI_REQUIRE_MOONCAKE"):
            pytest.fail(f"EI_REQUIRE_MOONCAKE is set but mooncake.engine does not import: {last}")
        pytest.skip(f"mooncake.engine does not import: {last}")


def _spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *args], cwd=REPO, env={**_env(), **(env or {})}, stdin=subprocess.DEVNULL,
        stdout=open(log, "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip


async def _stats(bus: Bus, instance: str) -> m.StatsReply:
    return await bus.request(SVC_STATS, m.StatsRequest(), instance=instance, timeout=5.0)


async def _wait_up(bus: Bus, instances: list[str], procs: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + 60
    pending = set(instances)
    while pending:
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise AssertionError(f"{log.name} exited with {p.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        for inst in list(pending):
            try:
                await bus.request(SVC_STATS, m.StatsRequest(), instance=inst, timeout=0.3)
                pending.discard(inst)
            except BusError:
                pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not up: {sorted(pending)}")
        await asyncio.sleep(0.1)


def _work(rid: str, ids: list[int], tail: int, max_tokens: int, fetch: list[m.FetchRange] | None = None) -> m.PrefillWork:
    tokens = tokens_for_blocks(ids, BS) + [7] * tail
    return m.PrefillWork(
        rid=rid,
        prompt_tokens=len(tokens),
        max_tokens=max_tokens,
        block_size=BS,
        block_hashes=block_hashes(tokens, BS),
        token_ids=pack_tokens(tokens),
        fetch=fetch or [],
    )


async def test_prefix_in_a_peer_l2_is_pulled_with_mooncake_and_every_checksum_matches(nats_url, mooncake_or_skip, tmp_path):
    """The pull is also a ``worker.kv_transfer`` span of the request's trace (workers export to an in-process
    OTLP receiver; the test sends the work with a sampled ``traceparent``), with peer, blocks, bytes, seconds."""
    with OtlpReceiver() as otlp:
        await _pull_with_mooncake(nats_url, tmp_path, otlp)


async def _pull_with_mooncake(nats_url: str, tmp_path: Path, otlp: OtlpReceiver) -> None:
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    origin = time.time()
    common = ["--nats-url", nats_url, "--speedup", "1.0", "--clock-origin", repr(origin), "--log-format", "json"]
    procs, logs = [], []
    logs.append(tmp_path / "kvdirectory.log")
    procs.append(_spawn(["services.kvdirectory", *common, "--instance", "kvdirectory", "--block-size", str(BS)], logs[-1]))
    for node in ("w0", "w1"):
        lo, hi = pick_port_range()
        logs.append(tmp_path / f"worker-{node}.log")
        procs.append(
            _spawn(
                ["services.worker", *common, "--instance", f"worker-{node}", "--node", node, "--profile", "tiny",
                 "--phase", "both", "--kv-pool", "real", "--kv-pool-ports", f"{lo}-{hi}", "--idle-state-interval-s", "0.2"],
                logs[-1], otel,
            )
        )  # fmt: skip
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-realbytes")
    chunks: dict[str, list[m.TokenChunk]] = defaultdict(list)

    async def on_chunk(msg: m.TokenChunk, _s: str) -> None:
        chunks[msg.rid].append(msg)

    try:
        await bus.subscribe(REQ_OUT, on_chunk)
        await _wait_up(bus, ["kvdirectory", "worker-w0", "worker-w1"], procs, logs)

        async def run(work: m.PrefillWork, node: str, headers: dict[str, str] | None = None) -> list[m.TokenChunk]:
            await bus.publish(WORK_PREFILL, work, node=node, headers=headers)
            for _ in range(300):
                if any(c.finished for c in chunks[work.rid]):
                    return chunks[work.rid]
                await asyncio.sleep(0.02)
            raise AssertionError(f"{work.rid} did not finish on {node}")

        # 1. w0 computes a 40-page prompt: its pages go to w0's L1 and, written through, its L2 pool
        ids = list(range(500, 540))
        out = await run(_work("warm", ids, tail=1, max_tokens=2), "w0")
        assert out[0].cached_tokens == 0 and out[-1].finish_reason == "length"
        # 2. the directory knows them (host tier of w0); w1 holds none
        longer = _work("pull", ids + [900, 901], tail=1, max_tokens=3)
        for _ in range(100):
            reply = await bus.request(KV_LOOKUP, m.KvLookupRequest(block_hashes=longer.block_hashes, block_size=BS), timeout=5.0)
            if reply.longest_any == 40:
                break
            await asyncio.sleep(0.05)
        plan = fetch_plan_for_reply(reply, "w1")
        assert plan.local_tokens == 0 and plan.fetch_tokens == 40 * BS
        assert [(r.node, r.start, r.end) for r in plan.ranges] == [("w0", 0, 40)]
        # 3. routed to w1 with the fetch plan: w1 pulls the 40 blocks from w0's registered buffer
        work = m.PrefillWork(**{**{f: getattr(longer, f) for f in longer.__struct_fields__}, "fetch": list(plan.ranges)})
        trace_id = os.urandom(16).hex()
        out = await run(work, "w1", {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
        first = out[0]
        assert first.finish_reason is None and out[-1].finish_reason == "length"
        assert first.fetched_tokens == 40 * BS and first.cached_tokens == 40 * BS  # restored from L2, not recomputed
        assert first.fetch_s is not None and first.fetch_s > 0 and first.exposed_fetch_s is not None
        assert sum(len(c.token_ids) for c in out) == 3

        s1 = await _stats(bus, "worker-w1")
        c1 = s1.counters
        assert c1["kvfetch.blocks_requested"] == 40
        assert c1["kvfetch.blocks_fetched"] == 40  # every block moved by Mooncake ...
        assert c1.get("kvfetch.blocks_mismatched", 0) == 0 and c1.get("kvfetch.blocks_missing", 0) == 0
        assert c1["kvpool.fetch_blocks"] == 40  # ... and kept only after its CRC-32 matched
        assert c1.get("kvpool.fetch_mismatch", 0) == 0 and c1.get("kvfetch.errors", 0) == 0
        assert c1["kvfetch.bytes"] == 40 * int(s1.gauges["kvpool.slot_bytes"])
        assert 0 <= c1["kvfetch.wait_ms_max"] < 10_000  # the longest a request waited on its sources (bench/faults.py reads it)
        assert c1["fetch.started"] == 1 and c1["fetch.completed"] == 1 and c1["fetch.blocks"] == 40
        c0 = (await _stats(bus, "worker-w0")).counters
        assert c0["kvpool.locate_hit"] == 40 and c0["kvpool.put"] >= 40
        # the pull is a span of the request's trace, under w1's receipt of the work
        spans: list = []
        for _ in range(100):
            spans = [(res, sp) for res, sp in otlp.spans if sp.trace_id.hex() == trace_id]
            if any(sp.name == "worker.kv_transfer" for _, sp in spans):
                break
            await asyncio.sleep(0.05)
        pulls = [sp for _, sp in spans if sp.name == "worker.kv_transfer"]
        assert len(pulls) == 1, sorted(sp.name for _, sp in spans)
        pull, a = pulls[0], _attrs(pulls[0])
        assert a["ei.node"] == "w1" and a["ei.peer"] == "w0" and a["ei.rid"] == "pull"
        assert a["ei.blocks"] == 40 and a["ei.blocks_fetched"] == 40 and a["ei.blocks_missing"] == 0
        assert a["ei.bytes"] == c1["kvfetch.bytes"] and 0 < a["ei.transfer_s"] <= a["ei.seconds"]
        assert pull.end_time_unix_nano - pull.start_time_unix_nano == pytest.approx(a["ei.seconds"] * 1e9, abs=1e3)
        receipt = [sp for _, sp in spans if sp.name == f"worker {WORK_PREFILL.template}"]
        assert [sp.span_id for sp in receipt] == [pull.parent_span_id]
        # 4. w1's L2 now holds the prefix too (BlockStored host from the fetch, then its own L1 copy)
        for _ in range(100):
            reply = await bus.request(KV_LOOKUP, m.KvLookupRequest(block_hashes=longer.block_hashes, block_size=BS), timeout=5.0)
            held = {n.node: n for n in reply.nodes}
            if "w1" in held and held["w1"].host_blocks >= 40:
                break
            await asyncio.sleep(0.05)
        assert held["w1"].host_blocks >= 40
    finally:
        await bus.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


FROZEN_PEER_PROFILE = """
name = "tiny-big-l2"
description = "tiny with room for a 1,500-page prompt in L1 and L2 (frozen-peer fetch test)"
gpus_per_node = 1
block_size = 4
kv_bytes_per_token = 1000
[prefill]
c0 = 0.002
c1 = 1.0e-5
c2 = 1.0e-8
c3 = 1.0e-6
[decode]
d0 = 0.002
d1 = 0.001
d2 = 0.0005
active_experts = 2
experts = 8
tokens_per_forward = 2.0
accepted_per_iteration = 1.5
[memory]
gpu_kv_tokens = 6400
host_kv_tokens = 6400
[links]
gpu_to_gpu_bytes_per_s = 1.0e8
gpu_to_gpu_latency_s = 0.001
peer_fetch_bytes_per_s = 1.0e8
peer_fetch_latency_s = 0.001
host_to_gpu_bytes_per_s = 1.0e8
[scheduler]
chunk_tokens = 512
max_running = 8
"""


async def test_a_peer_frozen_mid_read_costs_the_fetch_timeout_then_the_pages_are_recomputed(nats_url, mooncake_or_skip, tmp_path):
    """Issue #22: w1 pulls a 1,500-page prefix (64 KiB pages, ~100 MB) from w0's pool; w0 is
    frozen (SIGSTOP) the moment it answers the locate, so the Mooncake read hangs. The fetch
    gives up after --kv-pool-fetch-timeout-s, the request recomputes the pages and completes;
    the read's slots come back once w0 runs again."""
    import signal

    pages, fetch_timeout = 1500, 2.0
    profile = tmp_path / "big.toml"
    profile.write_text(FROZEN_PEER_PROFILE)
    origin = time.time()
    common = ["--nats-url", nats_url, "--speedup", "1.0", "--clock-origin", repr(origin), "--log-format", "json"]
    procs, logs = [], []
    logs.append(tmp_path / "kvdirectory.log")
    procs.append(_spawn(["services.kvdirectory", *common, "--instance", "kvdirectory", "--block-size", str(BS)], logs[-1]))
    for node in ("w0", "w1"):
        lo, hi = pick_port_range()
        logs.append(tmp_path / f"worker-{node}.log")
        procs.append(
            _spawn(
                ["services.worker", *common, "--instance", f"worker-{node}", "--node", node, "--profile", str(profile),
                 "--phase", "both", "--kv-pool", "real", "--kv-pool-ports", f"{lo}-{hi}", "--kv-pool-slot-bytes", "65536",
                 "--kv-pool-fetch-timeout-s", repr(fetch_timeout), "--idle-state-interval-s", "0.2"],
                logs[-1],
            )
        )  # fmt: skip
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test-frozen")
    chunks: dict[str, list[m.TokenChunk]] = defaultdict(list)
    frozen_at: list[float] = []

    async def on_chunk(msg: m.TokenChunk, _s: str) -> None:
        chunks[msg.rid].append(msg)

    async def run(work: m.PrefillWork, node: str, timeout_s: float) -> list[m.TokenChunk]:
        await bus.publish(WORK_PREFILL, work, node=node)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(c.finished for c in chunks[work.rid]):
                return chunks[work.rid]
            await asyncio.sleep(0.02)
        raise AssertionError(f"{work.rid} did not finish on {node} within {timeout_s} s")

    try:
        await bus.subscribe(REQ_OUT, on_chunk)
        await _wait_up(bus, ["kvdirectory", "worker-w0", "worker-w1"], procs, logs)
        ids = list(range(10_000, 10_000 + pages))
        out = await run(_work("warm", ids, tail=1, max_tokens=2), "w0", 60)
        assert out[-1].finish_reason == "length"
        longer = _work("pull", ids + [900], tail=1, max_tokens=3)
        for _ in range(200):
            reply = await bus.request(KV_LOOKUP, m.KvLookupRequest(block_hashes=longer.block_hashes, block_size=BS), timeout=5.0)
            if reply.longest_any == pages:
                break
            await asyncio.sleep(0.05)
        plan = fetch_plan_for_reply(reply, "w1")
        assert plan.fetch_tokens == pages * BS
        w0 = procs[1]

        location = decoder_for(m.PoolLocation)

        async def freeze_on_locate_reply(msg) -> None:  # w0's answer to w1's locate, on w1's inbox
            if frozen_at:
                return
            try:  # other request/reply traffic (stats, resyncs) shares the inbox prefix
                loc = location.decode(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return
            if loc.node == "w0" and loc.offsets:
                os.kill(w0.pid, signal.SIGSTOP)
                frozen_at.append(time.monotonic())

        sub = await bus.nc.subscribe("_INBOX.>", cb=freeze_on_locate_reply)
        work = m.PrefillWork(**{**{f: getattr(longer, f) for f in longer.__struct_fields__}, "fetch": list(plan.ranges)})
        t0 = time.monotonic()
        out = await run(work, "w1", 30)
        took = time.monotonic() - t0
        await sub.unsubscribe()
        assert frozen_at, "w0 never answered the locate"
        first = out[0]
        assert out[-1].finish_reason == "length" and sum(len(c.token_ids) for c in out) == 3
        assert first.fetched_tokens == 0  # nothing came from the frozen peer: the prefix was recomputed
        assert took < fetch_timeout + 5.0, took  # bounded: the fetch timeout plus the recompute
        os.kill(w0.pid, signal.SIGCONT)
        c1 = (await _stats(bus, "worker-w1")).counters
        assert c1.get("kvpool.fetch_failed.timeout") == 1 and c1["kvfetch.failed.timeout"] == pages, c1
        assert c1["fetch.started"] == 1
        # the stuck read returns once w0 runs again: its slots are given back
        for _ in range(100):
            c1 = (await _stats(bus, "worker-w1")).counters
            if c1.get("kvpool.abort", 0) >= pages:
                break
            await asyncio.sleep(0.1)
        assert c1.get("kvpool.abort", 0) >= pages, c1
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
        await bus.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
