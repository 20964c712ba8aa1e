"""``evolving-infra replay``: the harness side, against a running cluster's router."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from evolving_infra.replay.core import Arrival, ReplayError
from shared.log import setup_logging


async def _replay(args: argparse.Namespace) -> int:
    from evolving_infra.replay.live import LiveReplayer
    from evolving_infra.report.write import build_report, print_summary, write_report
    from evolving_infra.traces.io import TraceError, read_trace
    from evolving_infra.report.ideal import annotate_ideal
    from shared.clock import SimClock

    if args.from_kind == "canonical":
        try:
            trace = read_trace(Path(args.input[0]))
        except TraceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        from evolving_infra.traces.convert import convert_inputs

        trace = convert_inputs(args.from_kind, [Path(p) for p in args.input], progress=True)
    if args.max_requests_per_branch or args.sessions:
        from evolving_infra.traces.sample import sample_sessions

        trace = sample_sessions(trace, args.sessions or 10**9, seed=args.seed, max_requests_per_branch=args.max_requests_per_branch)
    try:
        arrival = Arrival(kind=args.arrival, concurrency=args.concurrency, rate_per_min=args.rate, cap=args.cap, seed=args.seed,
                          order=args.agent_order)
    except ReplayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab_size = _use_running_cluster(args)
    clock = SimClock(args.speedup)
    replayer = LiveReplayer(args.router_url, clock, block_size=trace.header.block_size, model=args.model, vocab_size=vocab_size)
    wall0 = time.monotonic()
    result = await replayer.run(trace.requests, arrival)
    meta = {
        "command": "replay",
        "argv": sys.argv[1:],
        "input": args.input,
        "trace_source": trace.header.source,
        "router_url": args.router_url,
        "speedup": args.speedup,
        "arrival": {"kind": args.arrival, "concurrency": args.concurrency, "rate_per_min": args.rate, "cap": args.cap},
        "wall_s": time.monotonic() - wall0,
        "notes": list(trace.header.meta.get("notes", []) or []),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    ideal = annotate_ideal(result.records, {r.id: r for r in trace.requests}, trace.header.block_size)
    report = build_report(result.records, meta=meta, ideal_kv_hit_rate=ideal)
    path = write_report(Path(args.out), report, sorted(result.records, key=lambda r: r.sent_at))
    print_summary(report)
    print(f"report: {path}")
    return 0 if report["requests_failed"] == 0 else 1


def _use_running_cluster(args: argparse.Namespace) -> int | None:
    """Fill ``--router-url`` / ``--speedup`` left unset from the running ``up`` cluster's state file
    (:mod:`evolving_infra.state`), else ``http://127.0.0.1:8000`` and 1; returns the router tokenizer's
    vocabulary size when it is not the sim one (the replayer takes prompt ids modulo it)."""
    from evolving_infra.state import running_clusters

    info: dict = {}
    if args.router_url is None:
        found = running_clusters()
        if len(found) == 1:
            info = found[0]
            print(f"replaying against the running cluster: router {info.get('router_url')} (state {info.get('state_file')})",
                  file=sys.stderr)
        elif len(found) > 1:
            print(f"note: {len(found)} local clusters are running; using --router-url's default (pass it to pick one)", file=sys.stderr)
        args.router_url = info.get("router_url") or "http://127.0.0.1:8000"
    if args.speedup is None:
        args.speedup = float(info.get("speedup") or 1.0)
    tokenizer = info.get("tokenizer") or "sim"
    if tokenizer == "sim":
        return None
    from services.router.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer).vocab_size


def cmd_replay(args: argparse.Namespace) -> int:
    setup_logging("console", "warning")
    return asyncio.run(_replay(args))


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "replay",
        help="replay agent traces against a running router",
        description="Replay a canonical agent trace (or raw traces converted on the fly) against a running cluster: "
        "each request is sent after its predecessors complete plus the recorded pause, with branch headers; "
        "branches are ended; TTFT, E2E, tokens and cached tokens are recorded per request.",
    )
    p.add_argument("input", nargs="+", help="canonical trace file, or raw trace files/folders with --from")
    p.add_argument(
        "--from",
        dest="from_kind",
        default="canonical",
        choices=["canonical", "claude-code-weka", "mooncake", "mini-swe-agent", "azure"],
        help="input kind (default canonical)",
    )
    p.add_argument(
        "--router-url", default=None, help="router base URL (default: the running `up` cluster's, else http://127.0.0.1:8000)"
    )
    p.add_argument(
        "--speedup", type=float, default=None, help="the cluster's speedup, simulated s per wall s (default: the running cluster's, else 1)"
    )
    p.add_argument("--model", default="evolving-infra-sim", help="model name sent with requests")
    p.add_argument("--arrival", choices=["closed", "open", "trace"], default="closed", help="arrival process")
    p.add_argument("--concurrency", type=int, default=16, help="closed loop: concurrent agents")
    p.add_argument("--rate", type=float, default=10.0, help="open loop: agent arrivals per minute")
    p.add_argument("--cap", type=int, default=0, help="open loop: admission cap (0 = none)")
    p.add_argument("--sessions", type=int, default=0, help="replay at most this many agents (0 = all)")
    p.add_argument("--max-requests-per-branch", type=int, default=0, help="cap each branch to its first K requests (0 = no cap)")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling and open-loop arrivals")
    p.add_argument("--agent-order", choices=("trace", "shuffled"), default="trace",
                   help="order in which agents enter (closed and open loops): as in the trace, or shuffled by --seed")
    p.add_argument("--out", default="replay-out", help="output directory for report.json")
    p.set_defaults(func=cmd_replay)
