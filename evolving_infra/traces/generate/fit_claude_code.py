"""Fit the Claude-Code-like generator to the real sessions; writes ``claude_code_fit.py``.

Run (about a minute; converts every session with the ``claude-code-weka``
converter, default options, and streams the result)::

    python -m evolving_infra.traces.generate.fit_claude_code ../shared/traces/claude-code-weka \\
        -o evolving_infra/traces/generate/claude_code_fit.py

The output is a Python module holding one dict, ``FIT`` (so it ships with the
package without package-data configuration); a ``.json`` output name writes
plain JSON instead.

How each parameter is fitted (all from the converted canonical trace, so the
converter's rules for branches, joins, pauses and compactions apply):

* Distributions are stored as empirical quantile tables (:data:`LEVELS`: every
  percentile plus a finer grid above p99 so heavy tails keep their mean),
  sampled by inverse CDF with linear interpolation
  (``generate.common.QuantileTable``):
  ``main_requests`` (main-branch requests per session), ``first_input`` (the
  main branch's first input), ``shared_prefix`` (tokens of the shared tool +
  system prefix: the leading blocks with shared ids), ``growth`` (input − the
  branch's previous input, main branch, no compaction), ``output`` (main
  branch), ``pause`` (main-branch requests waiting on one request),
  ``join_pause`` (main requests that join sub-agents), ``shrink_ratio`` /
  ``rewrite_ratio`` (input after / before a compaction below / at least 0.7),
  ``shrink_context`` (input before a shrinking compaction), ``side_requests``
  and ``side_first_input`` (side-call forks of the main branch), and for
  sub-agents ``sub_requests``, ``sub_first_input``, ``sub_growth``,
  ``sub_output``, ``sub_pause``, ``sub_first_pause``, ``sub_shared_prefix``.
* Rates (events per main-branch request, maximum-likelihood = count / exposure):
  ``subagent_spawns`` (distinct spawning requests), ``side_forks``, ``rewrites``
  (compactions that keep ≥ 70 % of the input), ``manual_shrinks`` (shrinking
  compactions below ``auto_compaction_min_context`` = 0.85 × the median
  pre-compaction context: user-issued ``/compact``, not the automatic one);
  ``fanout`` = how many spawns started 1, 2, 3 … sub-agents at once.
* Context limits: sessions fall into two groups. Most (Opus, 200K-token
  window) compact automatically when their context nears ~150K tokens
  (``auto_compaction_context``: the pre-compaction contexts above
  ``auto_compaction_min_context``);
  the rest (Sonnet with a 1M window) grow past it without compacting.
  ``large_context_share`` = share of sessions whose main branch exceeds
  ``compaction_window`` (the 95th percentile of ``shrink_context``);
  ``max_context`` = the largest input seen (the generator compacts a
  large-window session there).
* ``sessions``: one row per real session (main-branch requests, first input,
  large-window flag); the generator resamples whole rows (a joint bootstrap)
  so the correlations between session length, starting context and window
  size are kept (e.g. sessions resumed with a large context are shorter).
* ``auto_compaction_scale`` λ: the generator compacts a 200K-window session
  when its context would pass λ × a draw from ``auto_compaction_context``.
  Replaying the real sessions' own growth (first input + every non-compaction
  growth step) through that rule with λ = 1 gives about 30 % more automatic
  compactions than they had (their contexts also shrink in ways independent
  growth draws do not carry), so λ is fitted by bisection on those replays
  until the counts agree.
* ``targets`` = ``trace stats`` of the real sessions for the keys the
  generator is checked on.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from evolving_infra.traces.convert import convert
from evolving_infra.traces.stats import StatsAccumulator

SHARED_ID_LIMIT = 10**6
"""claude-code-weka converter: ids below this are the shared tool + system prefix ids."""

LEVELS = np.concatenate([np.linspace(0.0, 0.99, 100), np.linspace(0.991, 0.999, 9), np.linspace(0.9991, 1.0, 10)])

TARGET_KEYS = (
    "requests_per_session.mean",
    "input_tokens.p50",
    "output_tokens.mean",
    "output_tokens.p50",
    "input_growth_tokens.p50",
    "pause_s.p50",
    "pause_s.p95",
    "subagents_per_request",
    "subagent_fanout.mean",
    "forks_per_request",
    "compactions_per_request",
    "compaction_ratio.p50",
)


def table(values: list[float]) -> dict[str, Any]:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        raise ValueError("no samples to fit")
    q = np.quantile(a, LEVELS)
    q = np.maximum.accumulate(q)
    return {"n": int(a.size), "mean": float(a.mean()), "levels": [round(float(x), 6) for x in LEVELS], "values": [round(float(x), 4) for x in q]}


def _auto_compaction_scale(seqs: list[list[tuple[int, bool]]], *, threshold: float, ratio: float, auto_min: float) -> float:
    """λ such that replaying the sessions' growth through "compact at λ·threshold" gives their automatic compactions."""
    target = 0
    for seq in seqs:
        for (prev, _), (x, comp) in zip(seq, seq[1:]):
            if comp and x < 0.7 * prev and prev >= auto_min:
                target += 1

    def crossings(lam: float) -> int:
        n = 0
        for seq in seqs:
            ctx = seq[0][0]
            for (prev, _), (x, comp) in zip(seq, seq[1:]):
                if comp:
                    continue
                g = x - prev
                if ctx + g > lam * threshold:
                    n += 1
                    ctx = int(ctx * ratio)
                else:
                    ctx += g
        return n

    lo, hi = 0.5, 3.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if crossings(mid) > target:
            lo = mid
        else:
            hi = mid
    return round(hi, 4)


def fit(inputs: list[str], progress: bool = False) -> dict[str, Any]:
    conv = convert("claude-code-weka", inputs, progress=progress)
    acc: StatsAccumulator | None = None
    t: dict[str, list[float]] = {k: [] for k in (
        "main_requests", "first_input", "shared_prefix", "growth", "output", "pause", "join_pause",
        "shrink_ratio", "rewrite_ratio", "shrink_context", "side_requests", "side_first_input",
        "sub_requests", "sub_first_input", "sub_growth", "sub_output", "sub_pause", "sub_first_pause", "sub_shared_prefix",
    )}
    kind: dict[str, str] = {}
    owner: dict[str, str] = {}
    parent: dict[str, str | None] = {}
    last_in: dict[str, int] = {}
    n_req: Counter[str] = Counter()
    session_max: Counter[str] = Counter()
    session_first: dict[str, int] = {}
    session_seq: dict[str, list[tuple[int, bool]]] = {}
    spawns: Counter[tuple[str, ...]] = Counter()
    main_requests = 0
    rewrites = 0
    block_size = 64
    for r in conv.requests():
        if acc is None:
            acc = StatsAccumulator(block_size)
        acc.add(r)
        if r.kind is not None:
            kind[r.branch] = r.kind
            parent[r.branch] = r.parent_branch
            owner[r.branch] = r.agent
        k = kind[r.branch]
        prev = last_in.get(r.branch)
        n_req[r.branch] += 1
        shared = 0
        for block in r.blocks:
            if block >= SHARED_ID_LIMIT:
                break
            shared += 1
        if k == "main":
            main_requests += 1
            session_max[r.agent] = max(session_max[r.agent], r.input_tokens)
            session_seq.setdefault(r.agent, []).append((r.input_tokens, r.compaction))
            t["output"].append(r.output_tokens)
            if prev is None:
                session_first.setdefault(r.agent, r.input_tokens)
                t["first_input"].append(r.input_tokens)
                t["shared_prefix"].append(shared * block_size)
            else:
                if r.compaction:
                    ratio = r.input_tokens / prev
                    if ratio < 0.7:
                        t["shrink_ratio"].append(ratio)
                        t["shrink_context"].append(prev)
                    else:
                        t["rewrite_ratio"].append(ratio)
                        rewrites += 1
                else:
                    t["growth"].append(r.input_tokens - prev)

                if len(r.after) == 1:
                    t["pause"].append(r.pause_s)
                elif len(r.after) > 1:
                    t["join_pause"].append(r.pause_s)
        elif k == "subagent":
            t["sub_output"].append(r.output_tokens)
            if prev is None:
                spawns[(r.agent, *r.after)] += 1
                t["sub_first_input"].append(r.input_tokens)
                t["sub_first_pause"].append(r.pause_s)
                t["sub_shared_prefix"].append(shared * block_size)
            else:
                if not r.compaction:
                    t["sub_growth"].append(r.input_tokens - prev)
                t["sub_pause"].append(r.pause_s)
        elif k == "fork" and prev is None and kind.get(parent.get(r.branch) or "") == "main":
            t["side_first_input"].append(r.input_tokens)
        last_in[r.branch] = r.input_tokens
    assert acc is not None, "no requests"
    stats = acc.result(conv.header)
    per_session: Counter[str] = Counter()
    main_count: Counter[str] = Counter()
    for b, kb in kind.items():
        if kb == "main":
            per_session[b] = n_req[b]
            main_count[owner[b]] = n_req[b]
        elif kb == "fork" and kind.get(parent.get(b) or "") == "main":
            t["side_requests"].append(n_req[b])
        elif kb == "subagent":
            t["sub_requests"].append(n_req[b])
    t["main_requests"] = [float(v) for v in per_session.values()]
    auto_min = 0.85 * float(np.median(t["shrink_context"]))
    manual = [c for c in t["shrink_context"] if c < auto_min]
    t["auto_compaction_context"] = [c for c in t["shrink_context"] if c >= auto_min]
    window = float(np.quantile(t["shrink_context"], 0.95))
    large = sum(1 for v in session_max.values() if v > window)
    sides = len(t["side_requests"])
    fanout = Counter(spawns.values())
    from evolving_infra.traces.generate.common import stat_at

    sessions = [[main_count[a], session_first[a], int(session_max[a] > window)] for a in session_first]
    scale = _auto_compaction_scale(
        [seq for a, seq in session_seq.items() if session_max[a] <= window],
        threshold=float(np.median(t["auto_compaction_context"])),
        ratio=float(np.median(t["shrink_ratio"])),
        auto_min=auto_min,
    )
    return {
        "sessions": {"columns": ["main_requests", "first_input", "large_window"], "rows": sessions},
        "fitted_from": {
            "converter": "claude-code-weka (default options: shared prefix on, block size 64)",
            "inputs": conv.header.meta.get("inputs", []),
            "origin": conv.header.meta.get("origin"),
            "sessions": stats["sessions"],
            "requests": stats["requests"],
        },
        "method": "empirical quantile tables (inverse CDF, linear) and count/exposure rates; see fit_claude_code.py",
        "tables": {k: table(v) for k, v in t.items()},
        "rates": {
            "subagent_spawns_per_main_request": len(spawns) / main_requests,
            "side_forks_per_main_request": sides / main_requests,
            "rewrites_per_main_request": rewrites / main_requests,
            "manual_shrinks_per_main_request": len(manual) / main_requests,
            "auto_compaction_min_context": auto_min,
            "auto_compaction_scale": scale,
            "compaction_window": window,
            "large_context_share": large / len(session_max),
            "max_context": float(max(session_max.values())),
        },
        "fanout": {str(k): v for k, v in sorted(fanout.items())},
        "targets": {k: stat_at(stats, k) for k in TARGET_KEYS},
        "real_stats": {k: stats[k] for k in ("requests", "sessions", "subagent_branches", "fork_branches", "compactions", "ideal_kv_hit_rate")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evolving_infra.traces.generate.fit_claude_code", description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="claude-code-weka session files or folders")
    ap.add_argument("-o", "--output", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    res = fit(args.inputs, progress=sys.stderr.isatty())
    out = Path(args.output)
    if out.suffix == ".json":
        out.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    else:
        body = json.dumps(res, indent=1, sort_keys=True)
        out.write_text(
            '"""Fitted parameters of the Claude-Code-like generator (generated; do not edit).\n\n'
            "Written by ``python -m evolving_infra.traces.generate.fit_claude_code``; how each value is\n"
            'fitted is documented in fit_claude_code.py.\n"""\n\n'
            "import json\n\n"
            f"FIT = json.loads(\n    r\"\"\"\n{body}\n\"\"\"\n)\n"
        )
    print(f"{args.output}: fitted on {res['fitted_from']['sessions']} sessions, {res['fitted_from']['requests']} requests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
