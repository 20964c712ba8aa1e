"""Cost of OpenTelemetry tracing on the live stack: added wall time per request, tracing on vs off.

Starts a real local cluster (embedded nats-server, directory, planner, 1P1D
workers, router; each its own process) with the zero-time profile of
``overhead_bench.py`` (every iteration takes 0 s, so only the control plane is
timed) three times: tracing off (no ``OTEL_EXPORTER_OTLP_ENDPOINT``), on with
every request sampled, and on with 1 % sampled
(``OTEL_TRACES_SAMPLER=parentbased_traceidratio``, ``OTEL_TRACES_SAMPLER_ARG=0.01``).
The OTLP/HTTP exporter sends to an in-process receiver on loopback (it parses
and counts the spans). Each request is a full one (1,000-token fresh prompt,
8 output tokens, streamed; prefill node → route.bind → hand-off → decode node),
one at a time; the figure is the mean HTTP-in → last-byte wall time per mode,
its difference to off (ms) and the ratio to off. The order of the modes
rotates over ``--rounds`` rounds so drift of this shared VM's speed spreads
over all of them.

Usage::

    python bench/tracing_bench.py            # 3 rounds x 150 requests per mode
    python bench/tracing_bench.py --quick    # 1 round x 40 requests

Appends a section to bench/RESULTS-history.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _common import commit_label  # noqa: E402
from overhead_bench import ZERO_PROFILE  # noqa: E402

from evolving_infra.cluster import ClusterSpec, LocalCluster  # noqa: E402
from shared.log import setup_logging  # noqa: E402

MODES: dict[str, dict[str, str]] = {
    "off": {},
    "on, 100% sampled": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"},
    "on, 1% sampled": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
}


class SpanCounter:
    """An OTLP/HTTP receiver on loopback that parses every export and counts its spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        counter = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                req = ExportTraceServiceRequest()
                req.ParseFromString(self.rfile.read(int(self.headers.get("content-length", 0))))
                counter.spans += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


async def one_request(http: httpx.AsyncClient, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 8, "stream": True}
    t0 = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        text = (await resp.aread()).decode()
    if "[DONE]" not in text or '"error"' in text:
        raise RuntimeError(f"request failed: {text[-300:]}")
    return time.perf_counter() - t0


async def run_mode(env: dict[str, str], n: int, prof: Path, tmp: Path, rx: SpanCounter, seed: int) -> list[float]:
    saved = {k: os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")}
    for k in saved:
        os.environ.pop(k, None)
    if env:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.url
        os.environ.update(env)
    try:
        spec = ClusterSpec(nodes=2, split="1P1D", profile=str(prof), speedup=1.0, port=0, log_dir=str(tmp / "logs"), log_level="warning")
        rng = np.random.default_rng(seed)
        out = []
        async with LocalCluster(spec) as c:
            async with httpx.AsyncClient(base_url=c.router_url, timeout=60) as http:
                for i in range(n + 5):
                    dt = await one_request(http, rng.integers(0, 90_000, size=1_000).tolist())
                    if i >= 5:  # warm-up
                        out.append(dt)
        return out
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def run(n: int, rounds: int) -> tuple[dict[str, list[float]], int]:
    tmp = Path(tempfile.mkdtemp(prefix="ei-bench-trace-"))
    prof = tmp / "zero.toml"
    prof.write_text(ZERO_PROFILE)
    rx = SpanCounter()
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    names = list(MODES)
    for r in range(rounds):
        for j in range(len(names)):
            mode = names[(j + r) % len(names)]
            samples[mode] += await run_mode(MODES[mode], n, prof, tmp, rx, seed=r * 10 + j)
    return samples, rx.spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round x 40 requests per mode")
    ap.add_argument("--requests", type=int, default=0, help="requests per mode and round (overrides --quick's / the default)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (overrides --quick's / the default)")
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS-history.md")
    args = ap.parse_args()
    setup_logging("console", "warning")
    n, rounds = (40, 1) if args.quick else (150, 3)
    n, rounds = args.requests or n, args.rounds or rounds
    samples, spans = asyncio.run(run(n, rounds))
    off = float(np.mean(samples["off"]))
    lines = [
        "",
        "## Tracing cost on the live stack (tracing_bench.py)",
        "",
        f"- command: `python bench/tracing_bench.py{' --quick' if args.quick else ''}"
        f"{f' --requests {args.requests}' if args.requests else ''}{f' --rounds {args.rounds}' if args.rounds else ''}`",
        f"- load average at the end: {os.getloadavg()[0]:.1f} (2 shared CPUs)",
        f"- date: {time.strftime('%Y-%m-%d %H:%M')} UTC, commit {commit_label(REPO)}, {platform.machine()} {platform.python_version()}, 2 shared cores",
        "- what: HTTP in → last SSE byte of a full request (1,000-token fresh prompt, 8 output tokens; 1P1D: lookup, route, prefill,"
        " route.bind, hand-off, decode, stream out), one request at a time, zero-time profile (only the control plane is timed);"
        f" {rounds} round(s) x {n} requests per mode after 5 warm-up requests per cluster, mode order rotated per round;"
        f" OTLP/HTTP export to an in-process receiver on loopback ({spans:,} spans received in all).",
        "",
        "| tracing | mean ms | p50 ms | p99 ms | added ms / request vs off | ratio to off |",
        "|---|---|---|---|---|---|",
    ]
    for mode, xs in samples.items():
        mean = float(np.mean(xs))
        p50, p99 = np.percentile(xs, [50, 99])
        lines.append(f"| {mode} | {mean * 1e3:.2f} | {p50 * 1e3:.2f} | {p99 * 1e3:.2f} | {(mean - off) * 1e3:+.2f} | {mean / off:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        with open(REPO / "bench" / "RESULTS-history.md", "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
