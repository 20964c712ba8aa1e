"""The paper's metrics from per-request records (§6 "Metrics", DESIGN §6).

* throughput: completed requests per simulated second over the measured span;
* TTFT and E2E latency: mean, P50, P95 (P95 by linear interpolation, numpy default);
* TPOT: mean over requests with ≥ 2 output tokens of (E2E − TTFT)/(tokens − 1);
* KV hit rate h = Σ cached prompt tokens / Σ prompt tokens;
* lost KV reuse = 1 − h / h*, with h* the ideal hit rate of the replayed requests
  (unlimited cache shared by all nodes, no switches; computed from the trace).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from evolving_infra.report.records import RequestRecord


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(np.asarray(values, dtype=float))) if len(values) else None


def summarize(
    records: Sequence[RequestRecord],
    *,
    ideal_kv_hit_rate: float | None = None,
    start: float | None = None,
    end: float | None = None,
) -> dict[str, float | int | None]:
    """Headline metrics of a run.

    Args:
        records: one per request sent.
        ideal_kv_hit_rate: h* of the replayed requests (for ``lost_kv_reuse``).
        start, end: measured span in simulated seconds (default: first send → last finish).

    Returns:
        A flat dict with the report keys (None where a metric has no samples).
    """
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    if start is None:
        start = min((r.sent_at for r in records), default=0.0)
    if end is None:
        end = max((r.finished_at for r in records if r.finished_at is not None), default=start)
    duration = max(end - start, 0.0)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    h = cached / prompt if prompt else None
    lost = None
    if h is not None and ideal_kv_hit_rate:
        lost = max(0.0, 1.0 - h / ideal_kv_hit_rate)
    return {
        "requests_sent": len(records),
        "requests_completed": len(ok),
        "requests_failed": len(records) - len(ok),
        "duration_s": duration,
        "throughput_rps": (len(ok) / duration) if duration > 0 else None,
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "e2e_mean_s": _mean(e2e),
        "e2e_p50_s": _pct(e2e, 50),
        "e2e_p95_s": _pct(e2e, 95),
        "tpot_mean_s": _mean(tpot),
        "prompt_tokens_total": prompt,
        "cached_tokens_total": cached,
        "completion_tokens_total": sum(r.completion_tokens for r in ok),
        "kv_hit_rate": h,
        "ideal_kv_hit_rate": ideal_kv_hit_rate,
        "lost_kv_reuse": lost,
    }


def fmt_seconds(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3f} s" if v < 100 else f"{v:.1f} s"
