"""Workload statistics of a canonical trace, including the ideal KV hit rate h* (spec: docs/trace-format.md §5).

h* (paper §6 "lost KV reuse = 1 − h/h*"; Table D.4 "the ideal KV hit rate counts
every prompt token whose KV an earlier request produced"): an unlimited cache
shared by all nodes that never evicts. A request's hit is its longest run of
*leading* full blocks whose ids appeared in the ``blocks`` of any earlier
request, times ``block_size`` (prefix semantics: counting stops at the first
block never seen, later seen blocks do not count). ``h* = Σ hits / Σ input_tokens``.
"Earlier" is file order. Converters write requests in recorded send order
(global clock where the source has one; within a Claude Code session, the
parent's clock), and agents without a shared clock one after another, so file
order is send order wherever the source defines one.

Only input blocks count as produced: the KV of a request's output tokens is not
matched by later prompts in a replay (trace prompts are rebuilt from block ids),
so counting it would make h* unreachable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from evolving_infra.traces.schema import TraceHeader, TraceRequest

__all__ = ["StatsAccumulator", "format_stats", "ideal_kv_hit_rate", "trace_stats", "trace_stats_file"]


def _dist(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """mean / p50 / p95 / max of ``values`` (zeros when empty)."""
    if len(values) == 0:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    a = np.asarray(values, dtype=np.float64)
    p50, p95 = np.percentile(a, [50, 95])
    return {"count": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p95": float(p95), "max": float(a.max())}


class StatsAccumulator:
    """Streaming statistics: :meth:`add` every request in file order, then :meth:`result`.

    Memory: the set of block ids seen so far (for h*) plus a few numbers per
    request; blocks lists are not kept.
    """

    def __init__(self, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.seen: set[int] = set()
        self.hit_tokens = 0
        self.n = 0
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self.new_tokens: list[int] = []
        self.pauses: list[float] = []
        self.pause_total = 0.0
        self.compactions = 0
        self.compaction_ratios: list[float] = []
        self.growth: list[int] = []
        self.agents: dict[str, int] = {}
        self.branch_kind: dict[str, str] = {}
        self.branch_last_input: dict[str, int] = {}
        self.spawns: dict[tuple[str, ...], int] = {}
        self.subagent_requests = 0

    def add(self, r: TraceRequest) -> None:
        """Account one request (file order)."""
        self.n += 1
        seen = self.seen
        hit = 0
        for b in r.blocks:
            if b in seen:
                hit += 1
            else:
                break
        seen.update(r.blocks)
        hit_tok = hit * self.block_size
        self.hit_tokens += hit_tok
        self.inputs.append(r.input_tokens)
        self.outputs.append(r.output_tokens)
        self.new_tokens.append(r.input_tokens - hit_tok)
        self.pause_total += r.pause_s
        if r.after:
            self.pauses.append(r.pause_s)
        self.agents[r.agent] = self.agents.get(r.agent, 0) + 1
        kind = self.branch_kind.get(r.branch)
        prev = self.branch_last_input.get(r.branch)
        if kind is None:
            kind = r.kind or "main"
            self.branch_kind[r.branch] = kind
            if kind == "subagent":
                key = (r.agent, *r.after)
                self.spawns[key] = self.spawns.get(key, 0) + 1
        if kind == "subagent":
            self.subagent_requests += 1
        if r.compaction:
            self.compactions += 1
            if prev:
                self.compaction_ratios.append(r.input_tokens / prev)
        elif prev is not None:
            self.growth.append(r.input_tokens - prev)
        self.branch_last_input[r.branch] = r.input_tokens

    def result(self, header: TraceHeader | None = None) -> dict[str, Any]:
        """The statistics as a JSON-ready dict (keys in docs/trace-format.md §5)."""
        kinds = {"main": 0, "fork": 0, "subagent": 0}
        for k in self.branch_kind.values():
            kinds[k] = kinds.get(k, 0) + 1
        in_total = int(sum(self.inputs))
        main_requests = self.n - self.subagent_requests
        fanout = list(self.spawns.values())
        out: dict[str, Any] = {
            "source": header.source if header else "",
            "block_size": self.block_size,
            "requests": self.n,
            "sessions": len(self.agents),
            "branches": len(self.branch_kind),
            "branches_by_kind": kinds,
            "subagent_branches": kinds.get("subagent", 0),
            "fork_branches": kinds.get("fork", 0),
            "subagent_requests": self.subagent_requests,
            "subagent_spawns": len(fanout),
            "subagent_fanout": _dist(fanout),
            "subagents_per_request": (kinds.get("subagent", 0) / main_requests) if main_requests else 0.0,
            "forks_per_request": (kinds.get("fork", 0) / main_requests) if main_requests else 0.0,
            "compactions": self.compactions,
            "compactions_per_request": self.compactions / self.n if self.n else 0.0,
            "compactions_shrinking": sum(1 for x in self.compaction_ratios if x < 0.7),
            "compaction_ratio": _dist(self.compaction_ratios),
            "input_tokens_total": in_total,
            "output_tokens_total": int(sum(self.outputs)),
            "input_tokens": _dist(self.inputs),
            "output_tokens": _dist(self.outputs),
            "new_tokens": _dist(self.new_tokens),
            "input_growth_tokens": _dist(self.growth),
            "pause_s": _dist(self.pauses),
            "pause_per_request_s": self.pause_total / self.n if self.n else 0.0,
            "requests_per_session": _dist(list(self.agents.values())),
            "ideal_kv_hit_tokens": self.hit_tokens,
            "ideal_kv_hit_rate": self.hit_tokens / in_total if in_total else 0.0,
        }
        return out


def trace_stats(trace) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Statistics of an in-memory :class:`~evolving_infra.traces.io.Trace` (see :meth:`StatsAccumulator.result`).

    Keys include ``requests``, ``sessions``, ``branches_by_kind``,
    ``subagent_branches``, ``compactions``, ``input_tokens_total``,
    ``output_tokens_total``, distributions (``count``/``mean``/``p50``/``p95``/``max``)
    of ``input_tokens``, ``output_tokens``, ``new_tokens`` (input not hit under
    h*), ``input_growth_tokens``, ``pause_s`` (requests with a predecessor),
    and ``ideal_kv_hit_rate`` (h*, module docstring).
    """
    acc = StatsAccumulator(trace.header.block_size)
    for r in trace.requests:
        acc.add(r)
    return acc.result(trace.header)


def trace_stats_file(
    path: str | os.PathLike[str], progress: Callable[[Iterable[TraceRequest]], Iterable[TraceRequest]] | None = None
) -> dict[str, Any]:
    """:func:`trace_stats` of a file, streamed (validated; raises ``TraceError`` on bad lines). ``progress``
    wraps the stream of requests (``trace stats``: progress lines on stderr), None: none."""
    from evolving_infra.traces.io import iter_requests

    header, reqs = iter_requests(path)
    acc = StatsAccumulator(header.block_size)
    for r in reqs if progress is None else progress(reqs):
        acc.add(r)
    return acc.result(header)


def ideal_kv_hit_rate(requests: Iterable[TraceRequest], block_size: int) -> float | None:
    """h* of ``requests`` in the given order (module docstring); None when they have no input tokens."""
    seen: set[int] = set()
    hit = 0
    total = 0
    for r in requests:
        n = 0
        for b in r.blocks:
            if b in seen:
                n += 1
            else:
                break
        seen.update(r.blocks)
        hit += n * block_size
        total += r.input_tokens
    return hit / total if total else None


def format_stats(s: dict[str, Any]) -> str:
    """A readable table of :func:`trace_stats` output."""

    def row(name: str, value: str) -> str:
        return f"  {name:<30} {value}"

    def d(key: str, unit: str = "", fmt: str = ",.0f") -> str:
        x = s[key]
        return f"mean {x['mean']:{fmt}}  p50 {x['p50']:{fmt}}  p95 {x['p95']:{fmt}}  max {x['max']:{fmt}}{unit}"

    k = s["branches_by_kind"]
    lines = [
        f"trace {s['source'] or '(no source)'}  (block size {s['block_size']} tokens)",
        row("requests", f"{s['requests']:,}"),
        row("sessions (agents)", f"{s['sessions']:,}"),
        row("branches", f"{s['branches']:,}  (main {k.get('main', 0):,}, fork {k.get('fork', 0):,}, subagent {k.get('subagent', 0):,})"),
        row("sub-agent spawns / fan-out", f"{s['subagent_spawns']:,} spawns, fan-out mean {s['subagent_fanout']['mean']:.2f} max {s['subagent_fanout']['max']:.0f}"),
        row(
            "compactions (rewrites)",
            f"{s['compactions']:,}  ({s['compactions_shrinking']:,} shrink the input by > 30 %; "
            f"after/before mean {s['compaction_ratio']['mean']:.2f}, p50 {s['compaction_ratio']['p50']:.2f})",
        ),
        row("input tokens total", f"{s['input_tokens_total']:,}"),
        row("output tokens total", f"{s['output_tokens_total']:,}"),
        row("input tokens / request", d("input_tokens")),
        row("output tokens / request", d("output_tokens")),
        row("new (uncached) tokens / req", d("new_tokens")),
        row("context growth / request", d("input_growth_tokens")),
        row("pause s (after a request)", d("pause_s", " s", ",.1f")),
        row("pause s per request (T̄pause)", f"{s['pause_per_request_s']:.2f} s"),
        row("requests / session", d("requests_per_session")),
        row("ideal KV hit rate h*", f"{100 * s['ideal_kv_hit_rate']:.2f} %"),
    ]
    return "\n".join(lines)
