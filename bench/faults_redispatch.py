"""What each fault costs on the live stack (issue #22): requests sent / completed /
re-dispatched / lost, time to fence and to recover.

Every service is its own process over a real nats-server, nothing supervises them
(``evolving_infra.faultkit``); the shipped Claude Code sample is replayed (tool pauses
dropped, closed loop) while one fault happens. Usage::

    python bench/faults_redispatch.py            # every fault, ~3 min on 2 cores
    python bench/faults_redispatch.py --only kill-prefill,stop-10s

Appends a section to ``bench/RESULTS-history.md`` and prints the dashboard table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import commit_label  # noqa: E402

from evolving_infra.faultkit import Fault, FaultCluster, FaultRun, FaultSpec, demo_requests, replay_with_faults  # noqa: E402

SCENARIOS: dict[str, tuple[str, FaultSpec, list[Fault], list[int]]] = {
    "none": ("no fault (reference)", FaultSpec(), [], [0]),
    "kill-prefill": ("SIGKILL of a prefill worker (w0) at 3 s", FaultSpec(), [Fault("kill", "worker-w0", 3.0)], [0]),
    "kill-decode": ("SIGKILL of a decode worker (w3) at 3 s", FaultSpec(), [Fault("kill", "worker-w3", 3.0)], [0]),
    "stop-10s": ("SIGSTOP of a prefill worker (w0) at 3 s, SIGCONT 10 s later", FaultSpec(), [Fault("stop", "worker-w0", 3.0, 10.0)], [0]),
    "stop-nats": ("SIGSTOP of nats-server at 3 s, SIGCONT 15 s later", FaultSpec(), [Fault("stop", "nats-server", 3.0, 15.0)], [0]),
    "directory": ("SIGKILL of the KV directory at 3 s, started again 0.5 s later", FaultSpec(), [Fault("restart", "kvdirectory", 3.0, 0.5)], [0]),
    "router": ("two routers, half the agents each; SIGKILL of router-1 at 3 s", FaultSpec(routers=2), [Fault("kill", "router-1", 3.0)], [0, 1]),
}


async def run_one(key: str, agents: int, per_agent: int) -> tuple[str, FaultRun]:
    title, spec, faults, routers = SCENARIOS[key]
    reqs, bs = demo_requests(agents, max_per_agent=per_agent)
    with tempfile.TemporaryDirectory(prefix=f"ei-fault-{key}-") as tmp:
        async with FaultCluster(spec, Path(tmp)) as fc:
            run = await replay_with_faults(fc, reqs, faults, concurrency=8, block_size=bs, routers=routers)
    return title, run


def fmt(v: Any) -> str:
    return "—" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help=f"comma-separated scenarios of {', '.join(SCENARIOS)} (default all)")
    ap.add_argument("--agents", type=int, default=8, help="Claude Code sessions replayed (default 8)")
    ap.add_argument("--per-agent", type=int, default=10, help="first requests of each session (default 10)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to bench/RESULTS-history.md")
    args = ap.parse_args()
    keys = [k for k in args.only.split(",") if k] or list(SCENARIOS)
    for k in keys:
        if k not in SCENARIOS:
            ap.error(f"unknown scenario {k!r}")
    rows = []
    for k in keys:
        t0 = time.monotonic()
        title, run = asyncio.run(run_one(k, args.agents, args.per_agent))
        c = {name: cs for name, cs in run.router_counters.items()}
        red = sum(cs.get("redispatch.prefill", 0) for cs in c.values()), sum(cs.get("redispatch.decode", 0) for cs in c.values())
        extra = ""
        if run.groups and len(run.groups) > 1:
            extra = "; ".join(f"{g}: {v['sent']} sent, {v['lost']} lost ({v['broken']} open streams, {v['refused']} refused after)"
                              for g, v in run.groups.items())  # fmt: skip
        rows.append((k, title, run, red, extra))
        print(f"{k}: {run.row()} redispatch prefill/decode {red} {extra} ({time.monotonic() - t0:.0f} s)", flush=True)
        for status, err in run.failures[:10]:
            print(f"    failed: {status} {err}", flush=True)
        fenced = {name: cs.get("fenced", 0) for name, cs in c.items()}
        print(f"    fences per router: {fenced}", flush=True)
    header = "| fault | sent | completed | re-dispatched (prefill / decode) | lost | time to fence, s | time to recover, s | wrong output length |\n|---|---|---|---|---|---|---|---|"
    lines = [header]
    for _k, title, run, red, extra in rows:
        lost = f"{run.lost}" + (f" ({extra})" if extra else "")
        lines.append(f"| {title} | {run.sent} | {run.completed} | {run.redispatched} ({red[0]} / {red[1]}) | {lost} | {fmt(run.fence_s)} | {fmt(run.recover_s)} | {run.wrong_length} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        load = os.getloadavg()[0]
        section = (
            f"\n## faults: what each fault costs on the live stack — {stamp}\n\n"
            f"- command: `python bench/faults_redispatch.py{' --only ' + args.only if args.only else ''}`\n"
            f"- commit: {commit_label(REPO)}\n"
            f"- cluster: 4 sim workers (gb300-glm52) at 2P2D, speedup 50, router fence after 1.5 s wall, worker states every 0.25 s; "
            f"{args.agents} Claude Code sessions of the shipped sample, first {args.per_agent} requests each, tool pauses dropped, "
            f"8 concurrent agents; load average {load:.1f} at the end (2 shared CPUs)\n"
            "- time to fence: fault → the router's fence of the node; time to recover: fault → every request in flight at "
            "the fault completed (the longest a victim waited, fence included); wrong output length: completed requests whose "
            "token count differs from the trace's (a token repeated or dropped by a re-dispatch)\n\n"
            f"{table}\n"
        )
        with open(REPO / "bench" / "RESULTS-history.md", "a") as f:
            f.write(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
