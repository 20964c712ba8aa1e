"""Rebuild the shipped demo trace ``evolving_infra/data/claude-code-sample.jsonl.gz`` (see data/SOURCE.md).

Picks 60 of the real Claude Code sessions in ``../shared/traces/claude-code-weka``
deterministically (``numpy.random.default_rng(SEED)``): :data:`SUBAGENT_SESSIONS`
sessions whose sub-agents start within the first :data:`MAX_REQUESTS_PER_BRANCH`
main requests and are no longer than that (so the cap keeps them and their
joins), the rest from the sessions without sub-agents; converts
them with the ``claude-code-weka`` converter (default options: shared tool +
system prefix ids, 64-token blocks), keeps each branch's first
:data:`MAX_REQUESTS_PER_BRANCH` requests (``sample_sessions``) and writes the
trace, sessions in file-name order. Run from the repository root::

    python -m evolving_infra.traces.make_demo_sample            # default paths
    python -m evolving_infra.traces.make_demo_sample --src DIR --out FILE
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import numpy as np

from evolving_infra.traces.convert import convert_inputs
from evolving_infra.traces.io import sample_sessions, write_trace

SEED = 20261109
SESSIONS = 60
SUBAGENT_SESSIONS = 4
MAX_REQUESTS_PER_BRANCH = 12
REPO = Path(__file__).resolve().parents[2]
DEFAULT_SRC = REPO.parent / "shared" / "traces" / "claude-code-weka"
DEFAULT_OUT = REPO / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"


def _raw(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


def has_subagents(path: Path) -> bool:
    """Whether a session file contains a sub-agent marker."""
    return b'"subagent"' in _raw(path)


def subagents_survive_cap(path: Path, k: int = MAX_REQUESTS_PER_BRANCH) -> bool:
    """Whether the session spawns a sub-agent within its first ``k`` main requests and every
    sub-agent spawned there has at most ``k`` requests (so the cap keeps it and its join)."""
    import msgspec

    d = msgspec.json.decode(_raw(path))
    main_seen = 0
    early = []
    for e in d.get("requests", []):
        if e.get("type") == "subagent":
            if main_seen <= k - 1:
                early.append(len(e.get("requests", [])))
        else:
            main_seen += 1
    return bool(early) and max(early) <= k


def pick(files: list[Path], seed: int = SEED, n: int = SESSIONS, n_sub: int = SUBAGENT_SESSIONS) -> list[Path]:
    """The sample, sorted by name: ``n_sub`` sessions whose sub-agents survive the cap
    (:func:`subagents_survive_cap`; all of them if fewer) and the rest from sessions without sub-agents."""
    files = sorted(files)
    with_sub = [f for f in files if has_subagents(f)]
    sub = [f for f in with_sub if subagents_survive_cap(f)]
    other = [f for f in files if f not in set(with_sub)]
    rng = np.random.default_rng(seed)
    k_sub = min(n_sub, len(sub))
    chosen = [sub[i] for i in rng.choice(len(sub), size=k_sub, replace=False)] if k_sub else []
    k_other = min(n - k_sub, len(other))
    chosen += [other[i] for i in rng.choice(len(other), size=k_other, replace=False)]
    return sorted(chosen)


def build(src: Path = DEFAULT_SRC, out: Path = DEFAULT_OUT) -> tuple[int, int, list[Path]]:
    """Write the sample; returns (requests, bytes, picked files)."""
    files = pick(sorted(src.glob("trace_*.json*")))
    trace = convert_inputs("claude-code-weka", files)
    sample = sample_sessions(trace, len(files), seed=SEED, max_requests_per_branch=MAX_REQUESTS_PER_BRANCH)
    meta = dict(sample.header.meta)
    meta["demo_sample"] = {
        "script": "python -m evolving_infra.traces.make_demo_sample",
        "seed": SEED,
        "sessions": len(files),
        "subagent_sessions": SUBAGENT_SESSIONS,
        "max_requests_per_branch": MAX_REQUESTS_PER_BRANCH,
    }
    import msgspec

    header = msgspec.structs.replace(sample.header, meta=meta, source="claude-code-weka sample (make_demo_sample.py)")
    n = write_trace(out, header, sample.requests)
    return n, out.stat().st_size, files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evolving_infra.traces.make_demo_sample", description="Rebuild the shipped Claude Code demo trace.")
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help=f"claude-code-weka folder (default {DEFAULT_SRC})")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output file (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    if not args.src.is_dir():
        print(f"error: {args.src} is not a folder", file=sys.stderr)
        return 2
    n, size, files = build(args.src, args.out)
    print(f"{args.out}: {n} requests from {len(files)} sessions, {size:,} bytes", file=sys.stderr)
    print(" ".join(f.name for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
