"""Benchmark: convert every shared Claude Code session to the canonical trace (target < 60 s).

Times ``evolving-infra trace convert --from claude-code-weka <folder> -o OUT.jsonl``
(the library call behind it, ``convert_to_file``), and two baselines in the same
process over the same files: reading them with the standard library
(``json.load(gzip.open(...))``, the naive reader) and the parse floor
(``gzip.decompress`` + ``msgspec.json.decode``). Appends command, date, commit,
machine and a results table to ``bench/RESULTS-history.md``.

    .venv/bin/python bench/trace_convert_bench.py            # all sessions
    .venv/bin/python bench/trace_convert_bench.py --quick    # first 50 sessions, no RESULTS-history.md entry
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _common import commit_label  # noqa: E402

from evolving_infra.traces.convert import convert_to_file  # noqa: E402

TARGET_S = 60.0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, default=REPO.parent / "shared" / "traces" / "claude-code-weka")
    ap.add_argument("--quick", action="store_true", help="first 50 sessions only; do not append to RESULTS-history.md")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "RESULTS-history.md")
    args = ap.parse_args(argv)
    files = sorted(args.src.glob("trace_*.json*"))
    if not files:
        print(f"error: no sessions in {args.src}", file=sys.stderr)
        return 2
    if args.quick:
        files = files[:50]

    t0 = time.perf_counter()
    for f in files:
        with gzip.open(f) as fh:
            json.load(fh)
    naive_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    for f in files:
        msgspec.json.decode(gzip.decompress(f.read_bytes()))
    floor_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cc.jsonl"
        t0 = time.perf_counter()
        header, n = convert_to_file("claude-code-weka", files, out)
        conv_s = time.perf_counter() - t0
        size = out.stat().st_size
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    counts = header.meta["counts"]
    ok = conv_s < TARGET_S
    rows = [
        ("sessions", f"{len(files)}"),
        ("requests written", f"{n:,}"),
        ("sub-agents / side forks / compactions", f"{counts.get('subagents', 0)} / {counts.get('side_branches', 0)} / {counts.get('compactions', 0)}"),
        ("**convert wall time**", f"**{conv_s:.1f} s** ({'meets' if ok else 'MISSES'} the < {TARGET_S:.0f} s target)"),
        ("throughput", f"{n / conv_s:,.0f} requests/s, {len(files) / conv_s:.1f} sessions/s"),
        ("output", f"{size / 1e6:,.0f} MB JSONL (uncompressed)"),
        ("baseline: stdlib json.load of the inputs", f"{naive_s:.1f} s ({conv_s / naive_s:.2f}× of it)"),
        ("baseline: parse floor (gzip + msgspec decode)", f"{floor_s:.1f} s ({conv_s / floor_s:.1f}× of it)"),
        ("peak RSS of the process", f"{rss_mb:,.0f} MB"),
    ]
    table = "| measure | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    print(table)
    if not args.quick:
        cmd = "python bench/trace_convert_bench.py" + (f" --src {args.src}" if args.src != ap.get_default("src") else "")
        section = (
            f"\n## trace convert: all Claude Code sessions ({dt.date.today().isoformat()})\n\n"
            f"- command: `{cmd}` (times `convert_to_file('claude-code-weka', files, OUT.jsonl)`, "
            "the call behind `evolving-infra trace convert --from claude-code-weka`)\n"
            f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
            f"- commit: {commit_label(REPO)}\n"
            f"- machine: {_cpu()}, {os.cpu_count()} CPUs (shared with other jobs), Python {platform.python_version()}, "
            f"msgspec {msgspec.__version__}\n"
            f"- input: {args.src} ({len(files)} gzip files)\n\n{table}\n"
        )
        if not args.results.exists():
            args.results.write_text("# Benchmark results: history\n")
        with args.results.open("a") as fh:
            fh.write(section)
        print(f"appended to {args.results}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
