"""The paper's metrics from per-request records and the run timeline (§6.1–6.3, Appendix C).

Pure functions over :class:`RequestRecord` lists (no I/O, no clock). Times are
simulated seconds.

* throughput: completed requests per simulated second over the measured window (the caller's: a
  live replay's own window; default first send → last finish);
  over time, completions per window (by ``finished_at``) / window length.
* TTFT and E2E latency: mean, P50, P95 (P95 by linear interpolation, numpy default).
* TPOT: mean over requests with ≥ 2 output tokens of (E2E − TTFT)/(tokens − 1).
* KV hit rate h = Σ cached prompt tokens / Σ prompt tokens (completed requests).
* lost KV reuse = 1 − h / h* (Figure 3, Figure 6), with h* the ideal hit rate of
  the replayed requests (unlimited cache shared by all nodes, no phase switches).
  h* comes from the caller (computed from the trace); failing that, from
  ``RequestRecord.ideal_cached_tokens``. Over time it needs the per-request
  field: per window, 1 − Σ cached / Σ ideal cached tokens (Appendix D.4: "the
  share of these tokens that a run recomputes").
* lost KV reuse by cause (Appendix C.1: "We attribute a loss to eviction when
  the request runs on the same prefill node as the previous request in its
  branch, and to routing when it runs on a different one"): per record,
  lost = max(0, ideal cached − cached) tokens, attributed by the producer in
  ``RequestRecord.lost_reuse_cause``; ``lost_kv_reuse_<cause>_share`` = the
  cause's share of Σ lost (see :func:`lost_reuse_by_cause`).
* prefill queueing time (Appendix C.3, Table C.2): mean and P95 of
  ``queue_s`` (arrival at the prefill node → start of its prefill) over the
  requests that report it.
* prefill queue imbalance (Appendix C.3: "the queueing time on the most loaded
  prefill node relative to the average across prefill nodes, computed per
  minute and averaged over the measurement period"); see
  :func:`prefill_queue_imbalance` for the exact definition of load.
* phase switches and time per switch (Appendix C.1), PD split over time
  (Figure 7a, Appendix C.2): from a :class:`RunTimeline`, see
  :func:`timeline_metrics`.
* per period of a shifting run (§6.3, Table C.4): :func:`period_metrics`.
* TTFT prediction error (``ttft`` routing, paper Eq. 7): ``ttft_prediction_abs_error_*`` =
  |client TTFT − admission wait − retry wait − ``predicted_ttft_s``| (retry wait: a live request's
  ``retry_wait_s``, its refused sends and the waits before it was sent again; in a live run the client TTFT adds the
  control plane: router, dispatch to the node, first token back to the client, none of which the
  predictor models); ``ttft_prediction_node_abs_error_*``, only when records carry
  ``node_arrived_at`` and ``first_token_at`` (live runs) = |(``first_token_at`` −
  ``node_arrived_at``) − ``predicted_ttft_s``|: against what the predictor predicts, the wait on
  the prefill node plus the request's prefill (and exposed fetch), ``services/router/ttft.py``.
* TTFT on the node vs the control plane (live runs only, records with ``node_arrived_at`` and
  ``first_token_at``): ``ttft_node_*`` = ``first_token_at`` − ``node_arrived_at`` (the prefill
  node's queue + prefill, what a serving system's own TTFT counts); ``ttft_control_plane_*`` =
  client TTFT − admission wait − retry wait − that (router, bus, dispatch to the node, first token back to the
  client); ``ttft_split_client_mean_s`` = the mean client TTFT over those same records (the
  control plane's share is ``ttft_control_plane_mean_s`` / it). Under ``--speedup N`` the control
  plane is N × its real latency, so on a loaded machine it can dominate the client TTFT and swamp a
  comparison of policies.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

from evolving_infra.report.records import RequestRecord
from evolving_infra.report.timeline import RunTimeline, timeline_from_builtins

WINDOW_S = 60.0
"""Default window of the time series and of the imbalance: one minute (Appendix C.3)."""

# key, label, kind, lower_is_better (None: neither). kind: s | rps | rate | x | count
HEADLINE_METRICS: tuple[tuple[str, str, str, bool | None], ...] = (
    ("throughput_rps", "Throughput (req/s)", "rps", False),
    ("ttft_mean_s", "TTFT mean", "s", True),
    ("ttft_p95_s", "TTFT P95", "s", True),
    ("e2e_mean_s", "E2E mean", "s", True),
    ("e2e_p95_s", "E2E P95", "s", True),
    ("tpot_mean_s", "TPOT mean", "s", True),
    ("kv_hit_rate", "KV hit rate h", "rate", False),
    ("ideal_kv_hit_rate", "Ideal KV hit rate h*", "rate", None),
    ("lost_kv_reuse", "Lost KV reuse 1 - h/h*", "rate", True),
    ("prefill_queue_mean_s", "Prefill queue mean", "s", True),
    ("prefill_queue_p95_s", "Prefill queue P95", "s", True),
    ("prefill_queue_imbalance", "Prefill queue imbalance (max/mean)", "x", True),
    ("switches", "Node phase switches", "count", None),
    ("switch_time_mean_s", "Time per switch", "s", True),
)
"""The metrics every view shows (terminal, HTML, compare), in display order."""


PER_SIMULATED_SECOND = "req/s per simulated second"
"""The throughput's unit wherever a run's clock is not the wall clock (a simulation; a live run under ``--speedup``
N ≠ 1, whose cluster clock counts N simulated seconds per wall second): the summary, report.html, compare.html, the
compare text and the sweep's lines say it alike. Before, only the summary did; the others said "req/s", read as a
wall rate 50 times too low for ``make demo``."""


def _speedup(meta: Mapping[str, Any] | None) -> float | None:
    """A live run's ``meta["speedup"]`` (> 0), None for a simulation (it records none) or a malformed value."""
    v = meta.get("speedup") if isinstance(meta, Mapping) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def throughput_unit(metas: Sequence[Mapping[str, Any] | None]) -> str:
    """The unit of ``throughput_rps`` for runs with these ``meta`` dicts: ``"req/s"`` when every one is a live run
    at ``--speedup 1`` (its cluster clock is the wall clock), else :data:`PER_SIMULATED_SECOND`. Raises nothing."""
    return "req/s" if metas and all(_speedup(m) == 1.0 for m in metas) else PER_SIMULATED_SECOND


def throughput_label(metas: Sequence[Mapping[str, Any] | None]) -> str:
    """The throughput row's label for runs with these ``meta`` dicts: ``Throughput (req/s per simulated second)``,
    or ``Throughput (req/s)`` (:func:`throughput_unit`). Raises nothing."""
    return f"Throughput ({throughput_unit(metas)})"


def _numpy_loaded() -> bool:
    """Whether numpy is imported already (a trace read from JSON, plots): then :func:`_pct` and :func:`_mean`
    use it (faster on a run's thousands of values, the same bits); else they do without its import."""
    return "numpy" in sys.modules


def _pct(values: Sequence[float], q: float) -> float | None:
    """``float(np.percentile(values, q))`` (linear interpolation, numpy's default), None without values.

    The same arithmetic in the same order on the same two neighbours (numpy's ``_quantile`` and ``_lerp``
    for a scalar ``q``, including its gamma past the last index), on a sorted copy instead of a partition:
    every value is bit-for-bit numpy's. The copy is a numpy array when numpy is imported already
    (:func:`_numpy_loaded`), else a sorted list of the values as floats: a ``simulate`` whose trace comes
    from the cache imports no numpy (~65 ms). Values with a NaN, an infinity's NaN sum or a sign bit (a
    negative value, -0.0), whose order a sort and a partition may not share, go to numpy itself. Not
    calling ``np.percentile`` spares a run ``numpy.ma``, which it imports on its first call.

    Raises:
        ValueError: ``q`` outside [0, 100] (numpy's message), or NaN.
    """
    q = float(q)
    if not 0 <= q <= 100:
        raise ValueError("Percentiles must be in the range [0, 100]")
    n = len(values)
    if not n:
        return None
    a: Any
    if _numpy_loaded():
        a = np.array(values, dtype=float)
        a.sort()
        special = bool(a[-1] != a[-1] or np.signbit(a).any())  # (NaN sorts last)
    else:
        a = sorted([float(x) for x in values])
        total = sum(a)
        special = total != total or a[0] < 0 or (a[0] == 0 and _zero_signed(a))  # a NaN (or inf - inf), a sign bit
    if special:  # (numpy on the values in their own order: its partition's)
        return float(np.percentile(np.asarray(values, dtype=float), q))
    vi = (n - 1) * (q / 100)
    if vi >= n - 1:  # numpy's index -1 on both sides, gamma vi + 1
        lo, hi, t = a[-1], a[-1], vi + 1.0
    else:
        i = math.floor(vi)
        lo, hi, t = a[i], a[i + 1], vi - i
    lo, hi = float(lo), float(hi)
    d = hi - lo
    return hi - d * (1 - t) if t >= 0.5 else lo + d * t


def _zero_signed(a: list[float]) -> bool:
    """Whether a -0.0 is among the zeros at the start of the sorted ``a``."""
    for x in a:
        if x != 0:
            return False
        if math.copysign(1.0, x) < 0:
            return True
    return False


def _pairwise_sum(a: list[float], lo: int, n: int) -> float:
    """numpy's pairwise sum of ``a[lo:lo + n]`` (float64, ``DOUBLE_pairwise_sum``): below 8 values one
    running sum from 0.0; up to 128 eight running sums, added in pairs, then the rest; else the two
    halves (the first a multiple of 8 long), each so."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    if n <= 128:
        r0, r1, r2, r3, r4, r5, r6, r7 = a[lo:lo + 8]
        end = lo + n - n % 8
        for i in range(lo + 8, end, 8):
            r0 += a[i]
            r1 += a[i + 1]
            r2 += a[i + 2]
            r3 += a[i + 3]
            r4 += a[i + 4]
            r5 += a[i + 5]
            r6 += a[i + 6]
            r7 += a[i + 7]
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        for i in range(end, lo + n):
            res += a[i]
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise_sum(a, lo, n2) + _pairwise_sum(a, lo + n2, n - n2)


def _mean(values: Sequence[float]) -> float | None:
    """``float(np.mean(np.asarray(values, dtype=float)))``, None without values: numpy's when it is imported
    already (:func:`_numpy_loaded`), else its pairwise sum over the values as floats in Python, divided by
    their count, bit for bit."""
    n = len(values)
    if not n:
        return None
    if _numpy_loaded():
        return float(np.mean(np.asarray(values, dtype=float)))
    a = [float(x) for x in values]
    return _pairwise_sum(a, 0, n) / n


def measured_span(records: Sequence[RequestRecord]) -> tuple[float, float]:
    """``(start, end)``: first send → last finish (simulated seconds); ``(0, 0)`` without records."""
    start = min((r.sent_at for r in records), default=0.0)
    end = max((r.finished_at for r in records if r.finished_at is not None), default=start)
    return start, max(end, start)


def _windows(start: float, end: float, window_s: float) -> list[tuple[float, float]]:
    """``[a, b)`` windows of ``window_s`` covering ``[start, end]``; the last one may be shorter."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    if end <= start:
        return []
    n = max(1, math.ceil((end - start) / window_s - 1e-9))
    return [(start + i * window_s, min(end, start + (i + 1) * window_s)) for i in range(n)]


def _window_index(t: float, start: float, end: float, window_s: float, n: int) -> int | None:
    """Index of the window holding ``t``; ``t == end`` falls into the last window."""
    if t < start or t > end or n == 0:
        return None
    k = int((t - start) // window_s)
    return k if k < n - 1 else n - 1  # min(k, n − 1), no builtin call (one per record and series)


def prefill_queue_by_node(records: Sequence[RequestRecord]) -> dict[str, dict[str, float | int | None]]:
    """Per prefill node: requests reporting a queue time, mean / P95 / total queue seconds."""
    by: dict[str, list[float]] = {}
    for r in records:
        if r.queue_s is not None and r.prefill_node is not None:
            by.setdefault(r.prefill_node, []).append(r.queue_s)
    return {
        node: {"requests": len(v), "mean_s": _mean(v), "p95_s": _pct(v, 95), "total_s": float(sum(v))}
        for node, v in sorted(by.items())
    }


def prefill_queue_imbalance(
    records: Sequence[RequestRecord],
    *,
    start: float,
    end: float,
    window_s: float = WINDOW_S,
    timeline: RunTimeline | None = None,
) -> tuple[float | None, list[float | None]]:
    """Prefill queue imbalance: per minute, most loaded prefill node / mean over prefill nodes.

    Paper Appendix C.3 (Table C.2): "the queueing time on the most loaded
    prefill node relative to the average across prefill nodes, computed per
    minute and averaged over the measurement period". Made precise from what
    records carry:

    * a request *starts prefill* at ``sent_at + queue_s`` on ``prefill_node``
      (``sent_at`` is after any admission wait, and routing takes no simulated
      time); only requests that report ``queue_s`` and ``prefill_node`` count;
    * the *load* of node n in window [a, b) is the total queue seconds of the
      requests that started prefill on n in that window;
    * the prefill nodes of a window are the nodes that started at least one
      such prefill in it, plus, when the timeline names them
      (``SplitPoint.prefill_nodes``), every node that served prefill at some
      instant of the window (an idle prefill node counts with load 0);
    * ratio of the window = max load / mean load; a window whose mean load is
      0 (no queueing anywhere) has no ratio and is skipped; a window with one
      prefill node has ratio 1.

    Args:
        records: the run's records.
        start, end: measured span (simulated seconds).
        window_s: window length (default 60 s, "per minute").
        timeline: optional, for the idle prefill nodes.

    Returns:
        ``(mean over windows with a ratio or None, ratio per window or None)``.

    Raises:
        ValueError: if ``window_s <= 0``.
    """
    wins = _windows(start, end, window_s)
    loads: list[dict[str, float]] = [{} for _ in wins]
    for r in records:
        if r.queue_s is None or r.prefill_node is None:
            continue
        i = _window_index(r.sent_at + r.queue_s, start, end, window_s, len(wins))
        if i is None:
            continue
        loads[i][r.prefill_node] = loads[i].get(r.prefill_node, 0.0) + r.queue_s
    ratios: list[float | None] = []
    for (a, b), load in zip(wins, loads):
        nodes = set(load)
        if timeline is not None and load:
            nodes |= timeline.prefill_nodes_between(a, b)
        values = [load.get(n, 0.0) for n in sorted(nodes)]  # fixed order: the float sum is reproducible
        mean = sum(values) / len(values) if values else 0.0
        ratios.append(max(values) / mean if mean > 0 else None)
    valid = [x for x in ratios if x is not None]
    return _mean(valid), ratios


LOST_REUSE_CAUSES = ("eviction", "routing", "unattributed")
"""Causes of lost KV reuse (paper Appendix C.1; ``unattributed``: a branch's first request)."""


def lost_reuse_by_cause(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Lost KV reuse split by cause (paper Appendix C.1), over completed records the producer
    attributed (``lost_reuse_cause`` set and ``ideal_cached_tokens`` known).

    Returns:
        ``lost_kv_reuse_<cause>_share`` for each of :data:`LOST_REUSE_CAUSES` (the cause's lost
        tokens / all lost tokens; 0.0 when nothing was lost) and ``lost_kv_reuse_tokens`` (Σ lost
        tokens); every value None when no record is attributed. O(records).
    """
    lost = dict.fromkeys(LOST_REUSE_CAUSES, 0)
    seen = False
    for r in records:
        if not r.ok or r.lost_reuse_cause is None or r.ideal_cached_tokens is None:
            continue
        seen = True
        miss = r.ideal_cached_tokens - r.cached_tokens
        if miss > 0 and r.lost_reuse_cause in lost:
            lost[r.lost_reuse_cause] += miss
    total = sum(lost.values())
    out: dict[str, Any] = {f"lost_kv_reuse_{c}_share": ((v / total if total else 0.0) if seen else None) for c, v in lost.items()}
    out["lost_kv_reuse_tokens"] = total if seen else None
    return out


def summarize(
    records: Sequence[RequestRecord],
    *,
    ideal_kv_hit_rate: float | None = None,
    start: float | None = None,
    end: float | None = None,
    timeline: RunTimeline | None = None,
    window_s: float = WINDOW_S,
    imbalance: tuple[float | None, list[float | None]] | None = None,
) -> dict[str, Any]:
    """Headline metrics of a run (or of a slice of it).

    Args:
        records: one per request sent.
        ideal_kv_hit_rate: h* of the replayed requests (for ``lost_kv_reuse``); when None and
            records carry ``ideal_cached_tokens``, h* = Σ ideal cached / Σ prompt tokens.
        start, end: measured span in simulated seconds (default: first send → last finish).
        timeline: optional, lets the imbalance count idle prefill nodes.
        window_s: window of the prefill queue imbalance (default 60 s).
        imbalance: :func:`prefill_queue_imbalance` of these records over this span, window and
            timeline, when the caller has it (``build_report`` computes it once for the summary and
            :func:`time_series`); else computed here.

    Returns:
        A flat dict with the report keys (None where a metric has no samples;
        ``ttft_prediction_node_*``, ``ttft_node_*`` and ``ttft_control_plane_*`` only when a record
        carries the node's arrival and first-token times, i.e. in live runs).
    """
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    if start is None or end is None:
        span = measured_span(records)
        start = span[0] if start is None else start
        end = span[1] if end is None else end
    duration = max(end - start, 0.0)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    h = cached / prompt if prompt else None
    if ideal_kv_hit_rate is None:
        with_ideal = [r for r in ok if r.ideal_cached_tokens is not None]
        ideal_prompt = sum(r.prompt_tokens for r in with_ideal)
        if with_ideal and ideal_prompt:
            ideal_kv_hit_rate = sum(r.ideal_cached_tokens or 0 for r in with_ideal) / ideal_prompt
    lost = None
    if h is not None and ideal_kv_hit_rate:
        lost = max(0.0, 1.0 - h / ideal_kv_hit_rate)
    queue = [r.queue_s for r in records if r.queue_s is not None]
    pred_err = [
        abs(r.ttft_s - r.admission_wait_s - r.retry_wait_s - r.predicted_ttft_s)
        for r in ok
        if r.predicted_ttft_s is not None and r.ttft_s is not None
    ]
    # live: the node's part of TTFT (arrival on the prefill node -> its first token), what the
    # predictor predicts; absent from simulator records (no node_arrived_at), so no key for them
    node_err = [
        abs(r.first_token_at - r.node_arrived_at - r.predicted_ttft_s)
        for r in ok
        if r.predicted_ttft_s is not None and r.first_token_at is not None and r.node_arrived_at is not None
    ]
    node_keys: dict[str, Any] = {}
    if node_err:
        node_keys = {
            "ttft_prediction_node_samples": len(node_err),
            "ttft_prediction_node_abs_error_median_s": _pct(node_err, 50),
            "ttft_prediction_node_abs_error_p95_s": _pct(node_err, 95),
        }
    # live: client TTFT = admission wait + control plane + the node's part; a live run at --speedup N
    # multiplies the control plane's real latency (and its lateness on a loaded machine) by N
    split = [
        (r.first_token_at - r.node_arrived_at,
         r.ttft_s - r.admission_wait_s - r.retry_wait_s - (r.first_token_at - r.node_arrived_at), r.ttft_s)
        for r in ok
        if r.ttft_s is not None and r.first_token_at is not None and r.node_arrived_at is not None
    ]
    if split:
        on_node = [n for n, _, _ in split]
        control = [c for _, c, _ in split]
        node_keys |= {
            "ttft_node_samples": len(split),
            "ttft_split_client_mean_s": _mean([t for _, _, t in split]),
            "ttft_node_mean_s": _mean(on_node),
            "ttft_node_p50_s": _pct(on_node, 50),
            "ttft_node_p95_s": _pct(on_node, 95),
            "ttft_control_plane_mean_s": _mean(control),
            "ttft_control_plane_p50_s": _pct(control, 50),
        }
    if imbalance is None:
        imbalance = prefill_queue_imbalance(records, start=start, end=end, window_s=window_s, timeline=timeline)
    return {
        "requests_sent": len(records),
        "requests_completed": len(ok),
        "requests_failed": len(records) - len(ok),
        "requests_retried": sum(1 for r in records if r.retries),
        "retries": sum(r.retries for r in records),
        "start_s": start,
        "end_s": end,
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
        **lost_reuse_by_cause(ok),
        "prefill_queue_samples": len(queue),
        "prefill_queue_mean_s": _mean(queue),
        "prefill_queue_p95_s": _pct(queue, 95),
        "prefill_queue_imbalance": imbalance[0],
        "ttft_prediction_samples": len(pred_err),
        "ttft_prediction_abs_error_median_s": _pct(pred_err, 50),
        "ttft_prediction_abs_error_p95_s": _pct(pred_err, 95),
        **node_keys,
    }


def split_decisions(report: Mapping[str, Any]) -> int | None:
    """Planner split decisions of a report (:meth:`RunTimeline.split_decisions` of its ``timeline``), for display
    next to ``switches`` (node phase switches) and ``split_changes`` (changes of the split served); derived
    from ``report["timeline"]``, not a ``report.json`` key. None without a timeline."""
    tl = report.get("timeline")
    if not isinstance(tl, Mapping):
        return None
    return len({s.get("epoch", 0) for s in tl.get("switches") or () if isinstance(s, Mapping)})


def with_derived(report: Mapping[str, Any]) -> dict[str, Any]:
    """``report`` plus the display-only values derived from it (``split_decisions``, when it has a timeline), with
    ``split_changes`` recomputed from its ``timeline`` (:func:`timeline_metrics`) when that decodes: reports
    written before 2026-12-06 stored every timeline point there (draining marks included), so ``report compare``
    / ``show`` of an old and a new report of the same run printed different counts under one label. Without a
    (well-formed) timeline the stored value is kept."""
    out = dict(report)
    decisions = split_decisions(report)
    if decisions is not None:
        out["split_decisions"] = decisions
    if "split_changes" in report:
        try:
            timeline = timeline_from_builtins(report.get("timeline"))
        except ValueError:  # a malformed timeline: the stored value, as it is
            timeline = None
        if timeline is not None:
            out["split_changes"] = timeline_metrics(timeline)["split_changes"]
    return out


def timeline_metrics(timeline: RunTimeline | None, *, start: float | None = None, end: float | None = None) -> dict[str, Any]:
    """Phase switches, time per switch and the PD split over time (Appendix C.1, C.2).

    * ``switches``: completed node phase switches (one per node that changed
      phase; a split change from 6P3D to 8P1D is two switches), counted by
      ``applied_at`` in ``[start, end]`` when given;
    * ``switch_time_mean_s``: mean ``switch_s`` (decision → serving the new
      phase, drain included) over those switches;
    * ``split_changes``: changes of the split served after the launch split (in
      the window): timeline points whose ``split`` differs from the point
      before, so intermediate splits count (a decision whose 3 nodes finish
      their drains at 3 instants is 3: 4P2D → 3P3D → 2P4D → 1P5D), nodes that
      change at one instant count once (a 0-s drain moving 4 nodes is 1), and
      points that only mark a node draining (``switching``; the split is
      unchanged until it serves its new phase) do not count;
    * ``split_timeline``: ``[[t, split], ...]`` in time order (all points);
    * ``final_split``: the split in force at ``end`` (or the last one).

    All values are None when there is no timeline.
    """
    if timeline is None:
        return {
            "switches": None,
            "switch_time_mean_s": None,
            "split_changes": None,
            "split_timeline": None,
            "final_split": None,
        }
    lo = -math.inf if start is None else start
    hi = math.inf if end is None else end
    sw = [s for s in timeline.switches if lo <= s.applied_at <= hi]
    points = timeline.split_timeline
    changes = sum(1 for a, b in zip(points, points[1:]) if b.split != a.split and lo <= b.t <= hi)
    final = timeline.split_at(hi) if end is not None else (points[-1] if points else None)
    return {
        "switches": len(sw),
        "switch_time_mean_s": _mean([s.switch_s for s in sw]),
        "split_changes": changes,
        "split_timeline": [[p.t, p.split] for p in points],
        "final_split": final.split if final is not None else None,
    }


def time_series(
    records: Sequence[RequestRecord],
    *,
    start: float,
    end: float,
    window_s: float = WINDOW_S,
    timeline: RunTimeline | None = None,
    imbalance: tuple[float | None, list[float | None]] | None = None,
) -> dict[str, Any]:
    """Per-window series over ``[start, end]`` (simulated seconds); ``imbalance``: as :func:`summarize`'s.

    Keys: ``window_s``; ``t_s`` (window starts); ``completed`` (requests
    finished OK in the window); ``throughput_rps`` (completed / window length);
    ``ttft_mean_s`` (requests sent in the window); ``prefill_queue_imbalance``
    (:func:`prefill_queue_imbalance`); ``lost_kv_reuse`` — per window of
    ``sent_at``, 1 − Σ cached / Σ ``ideal_cached_tokens`` over completed
    requests that carry the field; the key is absent when no record carries
    it (the report then says so in ``notes``; it is never estimated).
    """
    wins = _windows(start, end, window_s)
    n = len(wins)
    completed = [0] * n
    ttft: list[list[float]] = [[] for _ in wins]
    cached = [0] * n
    ideal = [0] * n
    have_ideal = False
    for r in records:
        if not r.ok:
            continue
        if r.finished_at is not None:
            i = _window_index(r.finished_at, start, end, window_s, n)
            if i is not None:
                completed[i] += 1
        j = _window_index(r.sent_at, start, end, window_s, n)
        if j is None:
            continue
        if r.ttft_s is not None:
            ttft[j].append(r.ttft_s)
        if r.ideal_cached_tokens is not None:
            have_ideal = True
            cached[j] += r.cached_tokens
            ideal[j] += r.ideal_cached_tokens
    if imbalance is None:
        imbalance = prefill_queue_imbalance(records, start=start, end=end, window_s=window_s, timeline=timeline)
    out: dict[str, Any] = {
        "window_s": window_s,
        "t_s": [a for a, _ in wins],
        "completed": completed,
        "throughput_rps": [c / (b - a) if b > a else None for c, (a, b) in zip(completed, wins)],
        "ttft_mean_s": [_mean(v) for v in ttft],
        "prefill_queue_imbalance": imbalance[1],
    }
    if have_ideal:
        out["lost_kv_reuse"] = [max(0.0, 1.0 - c / i) if i > 0 else None for c, i in zip(cached, ideal)]
    return out


def period_metrics(
    records: Sequence[RequestRecord],
    periods: Sequence[Mapping[str, Any]],
    *,
    timeline: RunTimeline | None = None,
    window_s: float = WINDOW_S,
) -> list[dict[str, Any]]:
    """Headline metrics per period of a shifting run (§6.3, Figure 7, Table C.4).

    Each period is ``{name, start_s, end_s}`` (simulated seconds). Latency, TPOT,
    KV hit rate and queue metrics use the requests *sent* in ``[start_s, end_s)``;
    throughput is the requests *completed* (any send time) in ``[start_s, end_s)``
    divided by ``end_s − start_s``; switches count those applied in the period;
    ``final_split`` is the split in force at ``end_s``. h* per period comes only
    from ``RequestRecord.ideal_cached_tokens`` (the run's overall h* is not
    reused for a period).

    Raises:
        ValueError: naming the period, if it lacks ``start_s``/``end_s``, they are not
            numbers, or ``end_s <= start_s``.
    """
    out: list[dict[str, Any]] = []
    for k, p in enumerate(periods):
        if not isinstance(p, Mapping):
            raise ValueError(f"period {k}: expected a mapping with name, start_s, end_s, got {p!r}")  # noqa: TRY004
        name = str(p.get("name", f"period-{k}"))
        try:
            a, b = float(p["start_s"]), float(p["end_s"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"period {name!r}: needs numeric start_s and end_s ({e})") from e
        if b <= a:
            raise ValueError(f"period {name!r}: end_s {b} must be > start_s {a}")
        sel = [r for r in records if a <= r.sent_at < b]
        row: dict[str, Any] = {"name": name}
        row.update(summarize(sel, start=a, end=b, timeline=timeline, window_s=window_s))
        done = sum(1 for r in records if r.ok and r.finished_at is not None and a <= r.finished_at < b)
        row["requests_completed_in_period"] = done
        row["throughput_rps"] = done / (b - a)
        tm = timeline_metrics(timeline, start=a, end=b)
        row["switches"] = tm["switches"]
        row["switch_time_mean_s"] = tm["switch_time_mean_s"]
        row["final_split"] = tm["final_split"]
        out.append(row)
    return out


def cdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Empirical CDF: sorted values and cumulative fractions in (0, 1]."""
    x = np.sort(np.asarray(values, dtype=float))
    y = np.arange(1, len(x) + 1, dtype=float) / max(len(x), 1)
    return x, y


def fmt_seconds(v: float | None) -> str:
    """``"1.234 s"`` (3 decimals below 100 s, 1 above), ``"-"`` for None or NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3f} s" if v < 100 else f"{v:.1f} s"


def fmt_value(v: Any, kind: str) -> str:
    """Format a metric value by kind (``s``, ``rps``, ``rate``, ``x``, ``count``); ``"-"`` for None."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "s":
        return fmt_seconds(float(v))
    if kind == "rps":
        return f"{float(v):.3f}"
    if kind == "rate":
        return f"{100 * float(v):.2f}%"
    if kind == "x":
        return f"{float(v):.2f}x"
    if kind == "count":
        return f"{int(v):,}" if float(v).is_integer() else f"{float(v):.2f}"
    return str(v)
