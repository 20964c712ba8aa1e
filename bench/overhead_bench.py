"""Added cost per request of the live stack: HTTP in → first token out, minus simulated GPU time.

Starts a real local cluster (embedded nats-server, directory, planner, 1P1D
workers, router; each its own process) with a profile whose iteration times
are zero, so everything measured is the control plane: HTTP parsing,
tokenisation/hashing, the directory lookup over NATS request/reply, dispatch
to the worker over NATS, the engine step, and the first token back over NATS
and SSE. Requests are sent one at a time (no queueing). As a floor, the same
client times ``GET /v1/models`` on the same router (one HTTP round trip).

Usage::

    python bench/overhead_bench.py            # 200 requests per prompt size
    python bench/overhead_bench.py --quick    # 30 requests per prompt size

Appends a section to bench/RESULTS-history.md.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from _common import commit_label  # noqa: E402

from evolving_infra.cluster import ClusterSpec, LocalCluster  # noqa: E402
from shared.log import setup_logging  # noqa: E402

ZERO_PROFILE = """
name = "zero"
description = "benchmark profile: every iteration takes 0 s, so only control-plane cost remains"
gpus_per_node = 1
block_size = 64
kv_bytes_per_token = 1000
[prefill]
c0 = 0.0
c1 = 0.0
c2 = 0.0
c3 = 0.0
[decode]
d0 = 0.0
d1 = 0.0
d2 = 0.0
[memory]
gpu_kv_tokens = 4000000
host_kv_tokens = 16000000
[links]
gpu_to_gpu_bytes_per_s = 1e18
host_to_gpu_bytes_per_s = 1e18
peer_fetch_bytes_per_s = 1e18
[scheduler]
chunk_tokens = 8192
max_running = 64
"""


async def first_token_s(http: httpx.AsyncClient, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 1, "stream": True}
    t0 = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and '"text"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("no token")


async def run(n: int, sizes: list[int]) -> tuple[list[tuple[str, float, float, float]], str]:
    tmp = Path(tempfile.mkdtemp(prefix="ei-bench-"))
    prof = tmp / "zero.toml"
    prof.write_text(ZERO_PROFILE)
    spec = ClusterSpec(nodes=2, split="1P1D", profile=str(prof), speedup=1.0, port=0, log_dir=str(tmp / "logs"), log_level="warning")
    rows = []
    rng = np.random.default_rng(0)
    async with LocalCluster(spec) as c:
        async with httpx.AsyncClient(base_url=c.router_url, timeout=60) as http:
            floor = []
            for _ in range(n):
                t0 = time.perf_counter()
                (await http.get("/v1/models")).raise_for_status()
                floor.append(time.perf_counter() - t0)
            rows.append(("GET /v1/models (HTTP floor)", *np.percentile(floor, [50, 99]) * 1e3, float(np.mean(floor) * 1e3)))
            for size in sizes:
                samples = []
                for i in range(n + 3):
                    prompt = rng.integers(0, 90_000, size=size).tolist()  # fresh prompt: no cache hits
                    dt = await first_token_s(http, prompt)
                    if i >= 3:  # warm-up
                        samples.append(dt)
                rows.append((f"{size:,}-token prompt, first token", *np.percentile(samples, [50, 99]) * 1e3, float(np.mean(samples) * 1e3)))
    return rows, str(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="30 requests per size instead of 200")
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS-history.md")
    args = ap.parse_args()
    setup_logging("console", "warning")
    n = 30 if args.quick else 200
    sizes = [1_000, 10_000, 100_000]
    rows, _ = asyncio.run(run(n, sizes))
    lines = [
        "",
        "## Live stack: added cost per request over NATS on loopback (overhead_bench.py)",
        "",
        f"- command: `python bench/overhead_bench.py{' --quick' if args.quick else ''}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}, commit {commit_label(REPO)}, {platform.machine()} {platform.python_version()}, 2 shared cores",
        "- what: HTTP in → first SSE token out, one request at a time, through router → kv.lookup → work.<node>.prefill →"
        " engine step → req.<rid>.out.<node> → SSE, with a zero-time profile (so simulated GPU time is 0 and all of it is control plane);"
        f" {n} requests per row after 3 warm-up requests; fresh random prompts (no cache hits); 1P1D, every service its own process.",
        "",
        "| path | p50 ms | p99 ms | mean ms | p50 / HTTP floor |",
        "|---|---|---|---|---|",
    ]
    floor = rows[0][1]
    for name, p50, p99, mean in rows:
        lines.append(f"| {name} | {p50:.2f} | {p99:.2f} | {mean:.2f} | {p50 / floor:.1f}× |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        with open(REPO / "bench" / "RESULTS-history.md", "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
