"""Run the hostile flood against a local cluster and account for every message (fuzz test + bench).

:func:`run` starts a 2-node ``LocalCluster`` (auth on), snapshots every
service's bus counters and memory, floods every subject
(``evolving_infra.hostile.flood``) while a client sends normal requests, and
returns a report: per subject and subscriber the drops the bus counted next to
the drops expected from decoding and validating each payload locally, handler
errors, resyncs, memory before/after, requests served during and after the
flood, and whether every process is still alive.

The workers run ``branch-count`` host eviction by default (the ``evolving`` policy
set's, ``evolving_infra.sim.policies``): only then does a worker subscribe to
``kv.counts.<node>`` and sync its counts on ``kv.countsync.<node>``
(``services/worker/service.py``), so only then does the flood reach that code.
``report["worker_counts"]`` holds each worker's count-related counter deltas,
``report["directory_countsync"]`` the directory's ``countsync.*`` ones (snapshots served).
After the flood, the workers' own ``kv.countsync`` requests get hostile replies for a few
seconds (the directory stopped meanwhile; ``report["countsync_replies"]``: replies sent and
the drops each worker's bus must count, ``dropped_reply.kv.countsync.{node}``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from evolving_infra.cluster import ClusterSpec, LocalCluster
from evolving_infra.hostile import SUBSCRIBERS, flood, flood_count_sync_replies
from shared import messages as m
from shared.bus import Bus
from shared.subjects import SVC_STATS, Subjects


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (bytes; 0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def _counters(cluster: LocalCluster, admin: Bus) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for inst in SUBSCRIBERS:
        if inst == "launcher":
            assert cluster._bus is not None
            out[inst] = dict(cluster._bus.counters)
            continue
        rep = await admin.request(SVC_STATS, m.StatsRequest(), instance=inst, timeout=30.0)
        out[inst] = dict(rep.counters)
    return out


COUNT_KEYS = ("counts.", "received.kv.counts.", "dropped.kv.counts.", "invalid.kv.counts.", "handler_errors.kv.counts.",
              "request_failed.kv.countsync.", "request_refused.kv.countsync.", "dropped_reply.kv.countsync.")
"""Prefixes of the worker counters ``report["worker_counts"]`` keeps: the ``kv.counts`` stream
(``services.worker.countseq.CountStream`` counters as ``counts.*``, the bus's per-subject
counts) and the worker's ``kv.countsync`` requests."""


async def run(count: int, *, log_dir: str, seed: int = 18, rate: float = 20_000.0, big: int = 300_000, max_huge: int = 16,
              progress: Any = None, eviction: str = "branch-count", countsync_s: float = 6.0) -> dict[str, Any]:
    """Flood ``count`` payloads per subject; see the module docstring for the report.

    ``eviction``: the workers' ``--host-eviction`` (``lru`` workers read no ``kv.counts``:
    the flood's drop accounting leaves them out of that subject's subscribers).
    ``countsync_s``: wall seconds of the hostile ``kv.countsync`` reply phase after the flood
    (``evolving_infra.hostile.flood_count_sync_replies``, at most ``count`` replies per node;
    ``report["countsync_replies"]``); 0 or ``lru``: none.
    """
    spec = ClusterSpec(nodes=2, split="1P1D", profile="tiny", speedup=5.0, port=0, block_size=4, log_dir=log_dir, ready_timeout_s=120.0,
                       log_level="warning", eviction=eviction)
    async with LocalCluster(spec) as cluster:
        admin = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="fuzz-admin", auth=cluster.client_auth("admin"))
        http = httpx.AsyncClient(base_url=cluster.router_url, timeout=30.0)
        n = {"i": 0}

        async def request() -> bool:
            n["i"] += 1
            r = await http.post("/v1/completions", json={"prompt": [1 + n["i"] % 50, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 2})
            return r.status_code == 200

        try:
            assert await request(), "the cluster does not serve before the flood"
            pids = cluster.pids()
            rss_before = {k: rss_bytes(p) for k, p in pids.items()}
            before = await _counters(cluster, admin)
            t0 = time.monotonic()
            rep = await flood(cluster, count, seed=seed, rate=rate, big=big, max_huge=max_huge, request=request, progress=progress)
            if countsync_s > 0 and eviction == "branch-count":
                rep["countsync_replies"] = await flood_count_sync_replies(cluster, count, seed=seed + 1, big=big, max_huge=max_huge,
                                                                          duration_s=countsync_s)  # fmt: skip
            # let the services drain their queues: counters stop moving
            def settled(c: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
                return {i: {k: v for k, v in d.items() if k.startswith(("dropped.", "invalid.", "handler_errors."))} for i, d in c.items()}

            last: dict[str, dict[str, int]] = {}
            after = before
            for _ in range(900):
                after = await _counters(cluster, admin)
                if settled(after) == last:
                    break
                last = settled(after)
                await asyncio.sleep(1.0)
            rep["drain_s"] = time.monotonic() - t0 - rep["wall_s"] - rep.get("countsync_replies", {}).get("wall_s", 0.0)
            rep["rss_before"] = rss_before
            rep["rss_after"] = {k: rss_bytes(p) for k, p in pids.items()}
            cluster.check_alive()
            rep["alive"] = True
            ok_after = sum([await request() for _ in range(5)])
            rep["requests_after_ok"] = ok_after
            delta = {
                inst: {k: after[inst].get(k, 0) - before[inst].get(k, 0) for k in set(after[inst]) | set(before[inst])} for inst in after
            }
            rep["counted"] = {}
            for template, entry in rep["subjects"].items():
                got = {inst: delta[inst].get("dropped." + template, 0) for inst in entry["expected_drops"]}
                rep["counted"][template] = {
                    "dropped": got,
                    "handler_errors": {i: delta[i].get("handler_errors." + template, 0) for i in delta if delta[i].get("handler_errors." + template)},
                }
            rep["resync_requests"] = delta["kvdirectory"].get("resync.requests", 0)
            rep["eviction"] = eviction
            rep["worker_counts"] = {
                i: {k: v for k, v in sorted(d.items()) if v and k.startswith(COUNT_KEYS)} for i, d in delta.items() if i.startswith("worker-")
            }
            rep["directory_countsync"] = {k: v for k, v in sorted(delta["kvdirectory"].items()) if v and k.startswith("countsync.")}
            rep["log_lines"] = {p.stem: sum(1 for _ in p.open(errors="replace")) for p in sorted(Path(log_dir).glob("*.log"))}
            rep["nats_errors"] = {i: delta[i].get("nats.errors", 0) for i in delta}
            rep["slow_consumer"] = {i: delta[i].get("nats.slow_consumer", 0) for i in delta}
        finally:
            await http.aclose()
            await admin.close()
    return rep
