"""KV directory benchmark: ingest rate, lookup latency, memory per million blocks.

    .venv/bin/python bench/kvdirectory_bench.py --quick        # ~20 s
    .venv/bin/python bench/kvdirectory_bench.py                # larger run

Measures, on one core, with a fixed seed:

* ingest: ``KvDirectory.apply_kv_batch`` on engine-like batches (each batch one
  BlockStored of 64 new blocks extending a chain, plus BlockRemoved of older
  blocks once a node is "full"), in block events per second; baseline: a
  naive directory of per-(node, tier) sets.
* lookup: a 2,000-block path across 64 nodes, every node holding some prefix
  of it in GPU and host (scenario ``shared``: 16 distinct prefix lengths;
  ``worst``: 64 distinct lengths per tier), p50/p99 in µs; baseline: walk the
  path per node and tier over the naive sets (what a per-node dict walk costs).
* memory: tracemalloc delta of the directory per million indexed blocks
  (blocks held by one node in both tiers, the directory's state only).
* with ``--dynamo-python PY`` (or ``$EI_DYNAMO_PYTHON``): the same three side by
  side with NVIDIA Dynamo's ``RadixTree`` (Rust; ``bench/_dynamo_radix.py`` runs it
  under PY, a separate venv with ``pip install ai-dynamo-runtime``; never the
  project's venv) on the same events: ingest alternating round by round (wall and
  process CPU time), lookup p50/p99 (Dynamo: one ``find_matches`` per tier tree),
  bytes per block (Dynamo: RSS delta). Skipped with a message when absent.

    .venv/bin/python bench/kvdirectory_bench.py --quick --dynamo-python /tmp/dynamo-venv/bin/python

Appends the command, date, commit, machine and a results table to
bench/RESULTS-history.md (creating it with a title line when missing).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from _common import commit_label, dynamo_skip_reason  # noqa: E402

from services.kvdirectory.core import KvDirectory  # noqa: E402
from shared.messages import BlockRemoved, BlockStored, KvEventBatch, encode  # noqa: E402

BS = 64
RESULTS = Path(__file__).resolve().parent / "RESULTS-history.md"


class NaiveDirectory:
    """Baseline: per-(node, tier) sets, lookups walk the path for every node and tier."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], set[int]] = {}

    def apply(self, batch: KvEventBatch) -> None:
        for ev in batch.events:
            s = self.held.setdefault((batch.node, ev.tier), set())
            if isinstance(ev, BlockStored):
                s.update(ev.block_hashes)
            else:
                s.difference_update(ev.block_hashes)

    def lookup(self, path: list[int]) -> dict[str, tuple[int, int, int]]:
        out = {}
        nodes = {n for n, _ in self.held}
        for n in nodes:
            g = self.held.get((n, "gpu"), set())
            h = self.held.get((n, "host"), set())
            res = []
            for test in (lambda b: b in g, lambda b: b in h, lambda b: b in g or b in h):
                k = 0
                for b in path:
                    if not test(b):
                        break
                    k += 1
                res.append(k)
            if res[2]:
                out[n] = tuple(res)
        return out


class Dynamo:
    """NVIDIA Dynamo's ``RadixTree`` (Rust) driven from Python on the same events, in a
    separate venv's interpreter (``bench/_dynamo_radix.py``): Dynamo is an optional,
    benchmark-only dependency and is never installed into the project's venv.

    Set up once (``ai-dynamo-runtime`` is enough for the tree; see bench/RESULTS.md)::

        python3 -m venv /tmp/dynamo-venv && /tmp/dynamo-venv/bin/pip install ai-dynamo-runtime
    """

    def __init__(self, python: str) -> None:
        self.python = python

    @staticmethod
    def find(python: str | None) -> tuple[Dynamo | None, str]:
        """The runner, or None and why not (a clear skip message)."""
        why = dynamo_skip_reason(python, "dynamo._core", "pip install ai-dynamo-runtime")
        return (None, why) if why else (Dynamo(python), "")  # type: ignore[arg-type]

    def run(self, job: dict) -> dict:
        """Run one job (see ``_dynamo_radix.py``) in a fresh Dynamo process; returns its figures."""
        import json
        import pickle
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "job.pickle", Path(tmp) / "out.json"
            with src.open("wb") as f:
                pickle.dump(job, f, protocol=pickle.HIGHEST_PROTOCOL)
            subprocess.run([self.python, str(Path(__file__).resolve().parent / "_dynamo_radix.py"), str(src), str(dst)],
                           check=True, timeout=3600)
            return json.loads(dst.read_text())


def dynamo_events(batches: list[KvEventBatch]) -> list[tuple[int, int, bytes]]:
    """Our batches as Dynamo events: ``(worker id, tier index, event JSON)``, one per
    ``BlockStored`` / ``BlockRemoved`` (``tokens_hash`` = block hash: lookups pass the hashes)."""
    import json

    out = []
    ids: dict[str, int] = {}
    eid = 0
    for b in batches:
        w = ids.setdefault(b.node, len(ids))
        for ev in b.events:
            eid += 1
            if isinstance(ev, BlockStored):
                data = {"stored": {"parent_hash": ev.parent_block_hash,
                                   "blocks": [{"block_hash": h, "tokens_hash": h} for h in ev.block_hashes]}}
            else:
                data = {"removed": {"block_hashes": list(ev.block_hashes)}}
            out.append((w, 0 if ev.tier == "gpu" else 1, json.dumps({"event_id": eid, "data": data}).encode()))
    return out


def make_ingest_batches(rng: random.Random, nodes: int, total_blocks: int, keep: int) -> list[KvEventBatch]:
    """Engine-like stream: each node extends chains 64 blocks at a time and, past
    ``keep`` blocks, evicts leaf-first (the tail of its oldest chain), as radix caches do."""
    batches = []
    seq = [0] * nodes
    chains: list[list[list[int]]] = [[[]] for _ in range(nodes)]  # per node: chains, oldest first
    count = [0] * nodes
    made = 0
    while made < total_blocks:
        n = rng.randrange(nodes)
        chain = chains[n][-1]
        if len(chain) >= 2048 or rng.random() < 0.05:
            chain = []
            chains[n].append(chain)
        new = [rng.getrandbits(63) for _ in range(64)]
        events: list = [
            BlockStored(block_hashes=new, parent_block_hash=chain[-1] if chain else None, tier="gpu", block_size=BS),
        ]
        chain += new
        count[n] += 64
        made += 64
        if count[n] > keep:
            oldest = chains[n][0]
            tail = oldest[-64:]
            del oldest[-64:]
            if not oldest:
                chains[n].pop(0)
            events.append(BlockRemoved(block_hashes=tail[::-1], tier="gpu"))
            count[n] -= len(tail)
            made += len(tail)
        seq[n] += 1
        batches.append(KvEventBatch(node=f"n{n}", seq=seq[n], events=events))
    return batches


def bench_ingest(quick: bool, seed: int, dynamo: Dynamo | None = None) -> dict[str, float]:
    rng = random.Random(seed)
    total = 300_000 if quick else 2_000_000
    batches = make_ingest_batches(rng, 16, total, keep=8192)
    events = sum(len(ev.block_hashes) for b in batches for ev in b.events)
    core, naive, core_cpu = [], [], []
    dyn: dict[str, list[float]] = {"ingest_eps": [], "ingest_cpu_eps": []}
    job = {"ingest": dynamo_events(batches), "ingest_events": events, "rounds": 1} if dynamo else None
    for _ in range(3 if quick else 5):  # fresh directories, collector on (as in the service)
        d = KvDirectory(BS)
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        for b in batches:
            d.apply_kv_batch(b, 0.0)
        core_cpu.append(events / (time.process_time() - c))
        core.append(events / (time.perf_counter() - t))
        del d
        if dynamo:  # alternating with ours: one Dynamo round after each of ours
            r = dynamo.run(job)  # type: ignore[arg-type]
            for k in dyn:
                dyn[k] += r[k]
        nd = NaiveDirectory()
        gc.collect()
        t = time.perf_counter()
        for b in batches:
            nd.apply(b)
        naive.append(events / (time.perf_counter() - t))
        del nd
    return {
        "events": events,
        "reps": len(core),
        "core_eps": statistics.median(core),
        "core_min": min(core),
        "core_max": max(core),
        "naive_eps": statistics.median(naive),
        "core_cpu_eps": statistics.median(core_cpu),
        "dynamo_eps": statistics.median(dyn["ingest_eps"]) if dynamo else None,
        "dynamo_cpu_eps": statistics.median(dyn["ingest_cpu_eps"]) if dynamo else None,
    }


def setup_lookup(scenario: str, seed: int) -> tuple[KvDirectory, NaiveDirectory, list[int], list[KvEventBatch]]:
    rng = random.Random(seed)
    path = [rng.getrandbits(63) for _ in range(2000)]
    d = KvDirectory(BS)
    naive = NaiveDirectory()
    batches: list[KvEventBatch] = []
    for n in range(64):
        if scenario == "shared":  # shared system prompt everywhere, a few nodes with deep prefixes
            g = rng.choice([200, 200, 200, 600, 1200, 2000])
            h = rng.choice([200, 600, 2000])
            g, h = min(g, 2000), min(h, 2000)
        else:  # every node a different length per tier
            g, h = rng.randrange(1, 2001), rng.randrange(1, 2001)
        events = []
        for tier, k in (("gpu", g), ("host", h)):
            for s in range(0, k, 64):
                events.append(BlockStored(block_hashes=path[s : min(k, s + 64)], parent_block_hash=path[s - 1] if s else None, tier=tier, block_size=BS))
        b = KvEventBatch(node=f"n{n}", seq=1, events=events)
        d.apply_kv_batch(b, 0.0)
        naive.apply(b)
        batches.append(b)
    return d, naive, path, batches


def bench_lookup(quick: bool, seed: int, scenario: str, dynamo: Dynamo | None = None) -> dict[str, float]:
    d, naive, path, batches = setup_lookup(scenario, seed)
    reps = 2000 if quick else 20000
    dyn = dynamo.run({"lookup": {scenario: (dynamo_events(batches), path, reps)}})["lookup"][scenario] if dynamo else None
    ts = []
    res = d.lookup(path)
    want = naive.lookup(path)
    got = {p.node: (p.gpu_blocks, p.host_blocks, p.local_blocks) for p in res.nodes}
    assert got == want, "core and naive lookups disagree"
    cpu = []
    gc.disable()
    try:
        for _ in range(reps):
            c = time.thread_time_ns()
            t = time.perf_counter_ns()
            d.lookup(path)
            ts.append(time.perf_counter_ns() - t)
            cpu.append(time.thread_time_ns() - c)
        ets = []
        for _ in range(reps // 4):
            t = time.perf_counter_ns()
            encode(d.lookup(path).to_reply(BS))
            ets.append(time.perf_counter_ns() - t)
        nts = []
        for _ in range(max(20, reps // 100)):
            t = time.perf_counter_ns()
            naive.lookup(path)
            nts.append(time.perf_counter_ns() - t)
    finally:
        gc.enable()
    ts.sort()
    nts.sort()
    ets.sort()
    cpu.sort()
    return {
        "cpu_p50_us": cpu[len(cpu) // 2] / 1e3,
        "cpu_p99_us": cpu[int(len(cpu) * 0.99)] / 1e3,
        "encode_p50_us": ets[len(ets) // 2] / 1e3,
        "p50_us": ts[len(ts) // 2] / 1e3,
        "p99_us": ts[int(len(ts) * 0.99)] / 1e3,
        "naive_p50_us": nts[len(nts) // 2] / 1e3,
        "naive_p99_us": nts[int(len(nts) * 0.99)] / 1e3,
        "distinct_prefixes": len(d.index.prefix_drops(path)),
        "dynamo_p50_us": dyn["p50_us"] if dyn else None,
        "dynamo_p99_us": dyn["p99_us"] if dyn else None,
    }


def bench_memory(quick: bool, seed: int, dynamo: Dynamo | None = None) -> dict[str, float]:
    rng = random.Random(seed)
    blocks = 200_000 if quick else 1_000_000
    batches = []
    for i in range(0, blocks, 2000):
        chain = [rng.getrandbits(63) for _ in range(2000)]
        evs = []
        for s in range(0, 2000, 64):
            for tier in ("gpu", "host"):
                evs.append(BlockStored(block_hashes=chain[s : s + 64], parent_block_hash=chain[s - 1] if s else None, tier=tier, block_size=BS))
        batches.append(KvEventBatch(node=f"n{(i // 2000) % 8}", seq=1 + i // 16000, events=evs))
    seqs: dict[str, int] = {}
    fixed = []
    for b in batches:
        seqs[b.node] = seqs.get(b.node, 0) + 1
        fixed.append(KvEventBatch(node=b.node, seq=seqs[b.node], events=b.events))
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    d = KvDirectory(BS)
    for b in fixed:
        d.apply_kv_batch(b, 0.0)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    n = len(d.index)
    dyn = dynamo.run({"memory": (dynamo_events(fixed), n)}) if dynamo else None
    return {"blocks": n, "bytes_per_block": used / n, "mib_per_million": used / n * 1e6 / 2**20,
            "dynamo_bytes_per_block": dyn["bytes_per_block"] if dyn else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CI / smoke)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-write", action="store_true", help="print only, do not append to bench/RESULTS-history.md")
    ap.add_argument("--dynamo-python", default=os.environ.get("EI_DYNAMO_PYTHON"),
                    help="Python of a separate venv with ai-dynamo-runtime: adds Dynamo's RadixTree side by side "
                         "on the same events (default $EI_DYNAMO_PYTHON; skipped with a message when absent)")
    args = ap.parse_args(argv)
    dynamo, why = Dynamo.find(args.dynamo_python)
    if why:
        print(why, file=sys.stderr)
    ing = bench_ingest(args.quick, args.seed, dynamo)
    lk_shared = bench_lookup(args.quick, args.seed, "shared", dynamo)
    lk_worst = bench_lookup(args.quick, args.seed, "worst", dynamo)
    mem = bench_memory(args.quick, args.seed, dynamo)
    rows = [
        (
            "ingest, block events/s (target ≥ 500K)",
            f"{ing['core_eps']:,.0f}",
            f"{ing['naive_eps']:,.0f}",
            f"{ing['core_eps'] / ing['naive_eps']:.2f}",
            f"{ing['events']:,} events, 16 nodes; median of {ing['reps']} runs (min {ing['core_min']:,.0f}, max {ing['core_max']:,.0f})",
        ),
    ]
    for name, lk in (("shared", lk_shared), ("worst", lk_worst)):
        rows.append(
            (
                f"lookup 2,000 blocks × 64 nodes [{name}] p50 µs",
                f"{lk['p50_us']:.1f}",
                f"{lk['naive_p50_us']:.0f}",
                f"{lk['naive_p50_us'] / lk['p50_us']:.0f}× faster",
                f"{lk['distinct_prefixes']} distinct prefix lengths",
            )
        )
        rows.append(
            (
                f"lookup 2,000 blocks × 64 nodes [{name}] p99 µs (target ≤ 100)",
                f"{lk['p99_us']:.1f}",
                f"{lk['naive_p99_us']:.0f}",
                f"{lk['naive_p99_us'] / lk['p99_us']:.0f}× faster",
                "",
            )
        )
        rows.append(
            (
                f"lookup [{name}] CPU time p50 / p99 µs",
                f"{lk['cpu_p50_us']:.1f} / {lk['cpu_p99_us']:.1f}",
                "",
                "",
                "thread CPU time: without preemption by other processes",
            )
        )
        rows.append(
            (
                f"lookup + KvLookupReply msgpack encode [{name}] p50 µs",
                f"{lk['encode_p50_us']:.1f}",
                "",
                "",
                "what the kv.lookup handler does per request",
            )
        )
    rows.append(("memory per million blocks, MiB", f"{mem['mib_per_million']:.0f}", "", "", f"{mem['bytes_per_block']:.0f} B/block over {mem['blocks']:,} blocks, 8 nodes, GPU+host"))
    table = ["| metric | KvDirectory | naive | ratio | notes |", "|---|---|---|---|---|"]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    if dynamo:
        drows = [
            ("ingest, block events/s (wall)", f"{ing['core_eps']:,.0f}", f"{ing['dynamo_eps']:,.0f}",
             f"{ing['core_eps'] / ing['dynamo_eps']:.2f}", f"medians of {ing['reps']} alternating rounds, same events"),
            ("ingest, block events per CPU s (process time, all threads)", f"{ing['core_cpu_eps']:,.0f}", f"{ing['dynamo_cpu_eps']:,.0f}",
             f"{ing['core_cpu_eps'] / ing['dynamo_cpu_eps']:.2f}", "CPU time of the process: not inflated by other processes' load"),
        ]
        for name, lk in (("shared", lk_shared), ("worst", lk_worst)):
            drows.append((f"lookup [{name}] p50 / p99 µs", f"{lk['p50_us']:.1f} / {lk['p99_us']:.1f}",
                          f"{lk['dynamo_p50_us']:.1f} / {lk['dynamo_p99_us']:.1f}",
                          f"{lk['dynamo_p50_us'] / lk['p50_us']:.2f} / {lk['dynamo_p99_us'] / lk['p99_us']:.2f}",
                          f"{lk['distinct_prefixes']} distinct prefix lengths; Dynamo: find_matches on its GPU and host trees"))
        drows.append(("memory, B/block (GPU + host copies)", f"{mem['bytes_per_block']:.0f}", f"{mem['dynamo_bytes_per_block']:.0f}",
                      f"{mem['dynamo_bytes_per_block'] / mem['bytes_per_block']:.2f}",
                      "ours: tracemalloc; Dynamo: RSS delta of its two trees (one per tier)"))
        table += ["", "Side by side with NVIDIA Dynamo's `RadixTree` (Rust, `ai-dynamo-runtime`, driven from Python; "
                      "ratio = ours ÷ Dynamo for rates, Dynamo ÷ ours for times and bytes: > 1 = ours better):", "",
                  "| metric | KvDirectory | Dynamo RadixTree | ratio | notes |", "|---|---|---|---|---|"]
        table += ["| " + " | ".join(r) + " |" for r in drows]
    else:
        table += ["", f"({why})"]
    cmd = "python bench/kvdirectory_bench.py" + (" --quick" if args.quick else "") + (f" --seed {args.seed}" if args.seed != 1234 else "")
    cmd += " --dynamo-python PY" if dynamo else ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}, "
        f"Python {platform.python_version()}, load average {load:.1f} at the end of the run"
    )
    section = "\n".join(
        [
            "",
            f"## kvdirectory ({'quick' if args.quick else 'full'}) — {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            "",
            f"- command: `{cmd}`",
            f"- commit: {commit_label(REPO)}",
            f"- machine: {machine} (shared VM; single-threaded Python; p99 includes preemption by other processes)",
            "",
            *table,
            "",
        ]
    )
    print(section)
    if not args.no_write:
        if not RESULTS.exists():
            RESULTS.write_text("# Benchmark results: history\n")
        with RESULTS.open("a") as f:
            f.write(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
