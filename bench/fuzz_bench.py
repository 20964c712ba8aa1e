"""Hostile input benchmark (issue 18): flood every subject of a live cluster, and the cost of auth.

Fuzz: ``--per-subject`` payloads (default 10^5) on every subject of a 2-node
cluster with NATS auth on (``evolving_infra.fuzzcheck.run``): random bytes,
truncated and mutated valid messages, valid-shaped hostile values, each from
the identity allowed to publish there, while a client sends requests. Prints
per subject what was sent, refused by the server, dropped as counted by every
subscriber next to the drops expected by decoding and validating each payload
locally, handler errors; the workers' kv.counts counters (they read kv.counts
under the default ``--eviction branch-count`` only) and the hostile replies to
their kv.countsync requests (``--countsync-s``); then crashes (0 = every process alive), requests
served during and after, resync requests, RSS before/after.

Auth cost (``--auth-cost S``): the same cluster twice, open NATS and no API
key vs nkeys NATS auth and an API key, each with 4 closed-loop clients for S
seconds: requests/s and p50/p99 latency, and the ratio on/off.

    python bench/fuzz_bench.py --per-subject 100000 --auth-cost 20 --json /tmp/fuzz.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from evolving_infra.cluster import ClusterSpec, LocalCluster  # noqa: E402
from evolving_infra.fuzzcheck import run  # noqa: E402


def _progress(template: str, entry: dict, elapsed: float, rep: dict) -> None:
    print(f"  {elapsed:8.1f} s  {template:26s} sent {entry['sent']:,}  refused by server {entry['refused_by_server']:,}  "
          f"requests ok {rep['requests_ok']} failed {rep['requests_failed']}", file=sys.stderr, flush=True)


async def auth_cost(seconds: float, clients: int = 4) -> dict[str, dict[str, float]]:
    """Closed-loop requests/s and latency with auth off and on (NATS nkeys + router API key)."""
    out: dict[str, dict[str, float]] = {}
    for label, nats_auth, key in (("off", "off", ""), ("on", "nkeys", "bench-key")):
        old = os.environ.get("EI_API_KEYS")
        if key:
            os.environ["EI_API_KEYS"] = key  # the router child reads it
        else:
            os.environ.pop("EI_API_KEYS", None)
        try:
            spec = ClusterSpec(nodes=2, split="1P1D", profile="tiny", speedup=5.0, port=0, block_size=4, nats_auth=nats_auth,
                               log_dir=tempfile.mkdtemp(prefix=f"ei-authcost-{label}-"), log_level="warning", ready_timeout_s=120.0)
            async with LocalCluster(spec) as cluster:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                lat: list[float] = []
                errors = 0
                async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30.0, headers=headers) as http:
                    r = await http.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 2})
                    assert r.status_code == 200, r.text
                    end = time.monotonic() + seconds

                    async def client(i: int) -> None:
                        nonlocal errors
                        n = 0
                        while time.monotonic() < end:
                            n += 1
                            t0 = time.perf_counter()
                            r = await http.post("/v1/completions", json={"prompt": [i, n % 97, 3, 4, 5, 6, 7, 8], "max_tokens": 2})
                            if r.status_code == 200:
                                lat.append(time.perf_counter() - t0)
                            else:
                                errors += 1

                    await asyncio.gather(*(client(i) for i in range(clients)))
                lat.sort()
                out[label] = {
                    "requests": len(lat),
                    "errors": errors,
                    "rps": len(lat) / seconds,
                    "p50_ms": 1000 * statistics.median(lat),
                    "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                }
        finally:
            if old is None:
                os.environ.pop("EI_API_KEYS", None)
            else:
                os.environ["EI_API_KEYS"] = old
    return out


def render(rep: dict, per_subject: int) -> str:
    lines = [
        f"Fuzz: {per_subject:,} payloads per subject, {len(rep['subjects'])} subjects, sent in {rep['wall_s']:.0f} s "
        f"(+{rep['drain_s']:.0f} s until every counter settled)",
        "",
        "| subject | publisher identity | sent | refused by server | dropped as counted (expected), per subscriber | handler errors |",
        "|---|---|---|---|---|---|",
    ]
    for t, e in rep["subjects"].items():
        got = rep["counted"][t]["dropped"]
        drops = ", ".join(f"{i} {got.get(i, 0):,} ({n:,})" for i, n in sorted(e["expected_drops"].items())) or "no subscriber"
        he = ", ".join(f"{i} {n}" for i, n in rep["counted"][t]["handler_errors"].items()) or "0"
        lines.append(f"| `{t}` | {e['publisher']} | {e['sent']:,} | {e['refused_by_server']:,} | {drops} | {he} |")
    exact = all(rep["counted"][t]["dropped"] == e["expected_drops"] for t, e in rep["subjects"].items())
    rss = ", ".join(f"{k} {rep['rss_before'][k] / 2**20:.0f}→{v / 2**20:.0f}" for k, v in rep["rss_after"].items())
    lines += [
        "",
        f"- crashes: {0 if rep['alive'] else 'some'}; every drop counted exactly: {'yes' if exact else 'NO'}",
        f"- requests during the flood: {rep['requests_ok']} ok, {rep['requests_failed']} failed; after: {rep['requests_after_ok']}/5 ok",
        f"- resync requests of the directory: {rep['resync_requests']}; permission violations (server refusals): {rep['permission_violations']}",
        "- workers' kv.counts handling (host eviction " + rep.get("eviction", "?") + "): "
        + ("; ".join(f"{i} " + (", ".join(f"{k} {v:,}" for k, v in c.items()) or "none") for i, c in rep["worker_counts"].items())),
        "- directory kv.countsync: " + (", ".join(f"{k} {v:,}" for k, v in rep["directory_countsync"].items()) or "none"),
        *([f"- hostile kv.countsync replies (directory stopped {cs['wall_s']:.0f} s): sent "
           + ", ".join(f"{n} {v:,}" for n, v in cs["replies"].items()) + "; dropped as counted (expected): "
           + ", ".join(f"{i} {rep['worker_counts'][i].get('dropped_reply.kv.countsync.{node}', 0):,} ({v:,})"
                       for i, v in sorted(cs["expected_drops"].items()))]
          if (cs := rep.get("countsync_replies")) else []),
        f"- RSS MiB before→after: {rss}",
        f"- service log lines (whole run, level warning): {sum(rep['log_lines'].values()):,} "
        f"({', '.join(f'{k} {v:,}' for k, v in rep['log_lines'].items())})",
    ]
    return "\n".join(lines)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-subject", type=int, default=100_000, help="payloads per subject (default 10^5)")
    ap.add_argument("--rate", type=float, default=4000.0, help="messages per second at most (default 4000)")
    ap.add_argument("--max-huge", type=int, default=16, help="payloads over 64 KiB per subject (default 16)")
    ap.add_argument("--auth-cost", type=float, default=0.0, help="seconds per auth on/off run (0 = skip)")
    ap.add_argument("--eviction", default="branch-count", choices=("branch-count", "lru"),
                    help="workers' host eviction (default branch-count, the evolving set's: lru workers read no kv.counts)")
    ap.add_argument("--countsync-s", type=float, default=30.0,
                    help="wall seconds of hostile kv.countsync replies to the workers after the flood (0 = skip; default 30)")
    ap.add_argument("--skip-fuzz", action="store_true")
    ap.add_argument("--json", default="", help="write the raw report here")
    args = ap.parse_args()
    result: dict = {}
    if not args.skip_fuzz:
        rep = await run(args.per_subject, log_dir=tempfile.mkdtemp(prefix="ei-fuzz-"), rate=args.rate, max_huge=args.max_huge,
                        progress=_progress, eviction=args.eviction, countsync_s=args.countsync_s)
        result["fuzz"] = rep
        print(render(rep, args.per_subject))
    if args.auth_cost > 0:
        cost = await auth_cost(args.auth_cost)
        result["auth_cost"] = cost
        off, on = cost["off"], cost["on"]
        print(f"\nAuth cost (4 closed-loop clients, {args.auth_cost:g} s each): requests/s off {off['rps']:.1f} on {on['rps']:.1f} "
              f"(on/off {on['rps'] / off['rps']:.3f}); p50 ms off {off['p50_ms']:.1f} on {on['p50_ms']:.1f} "
              f"(on/off {on['p50_ms'] / off['p50_ms']:.3f}); p99 ms off {off['p99_ms']:.1f} on {on['p99_ms']:.1f}; "
              f"errors off {off['errors']} on {on['errors']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
