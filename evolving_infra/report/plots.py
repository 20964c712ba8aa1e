"""PNG plots of one run and of a comparison of runs (paper Figures 3, 6, 7, C.1; Table C.2).

Drawn with matplotlib's object API on the Agg canvas: no pyplot, no global
backend switch, no display needed. Each function writes one PNG into ``out``
and returns a :class:`PlotFile`, or returns None when the run lacks the data
(e.g. no timeline → no PD split plot).

x axes in minutes since the run's ``start_s`` (first request sent).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatterSciNotation

from evolving_infra.report.metrics import HEADLINE_METRICS, cdf, fmt_value, throughput_label, throughput_unit
from evolving_infra.report.records import RequestRecord
from evolving_infra.report.timeline import RunTimeline

DPI = 110


@dataclass(slots=True, frozen=True)
class PlotFile:
    """One written plot."""

    file: str
    """File name inside the output directory (``*.png``)."""
    title: str
    caption: str = ""


@dataclass(slots=True, frozen=True)
class RunData:
    """One run as the comparison plots need it."""

    label: str
    report: Mapping[str, Any]
    records: Sequence[RequestRecord]
    timeline: RunTimeline | None


def _save(fig: Figure, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=DPI, format="png")
    return name


_MATHTEXT = re.compile(r"^\$\\mathdefault\{(.*)\}\$$")
_EXPONENT = re.compile(r"\^\{(-?\d+)\}")
_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


class LogTickFormatter(LogFormatterSciNotation):
    """matplotlib's log-axis tick labels (which ticks get one, and what they say) as plain text.

    The default formatter writes ``$\\mathdefault{10^{-1}}$`` (and, where it labels minor
    ticks, ``2\\times10^{-1}``), which matplotlib lays out through its pyparsing mathtext parser:
    building that parser and parsing each label at the layout's and again at the save's dpi was
    ~50 ms of the first latency CDF's ~190 ms draw, and ~23k objects. This one returns the same
    label with Unicode superscripts: ``10⁻¹``, ``2×10⁻¹``, ``−10²``; a label of another form is
    returned unchanged.
    """

    def __call__(self, x: float, pos: int | None = None) -> str:
        return plain_tick_label(super().__call__(x, pos))


def plain_tick_label(label: str) -> str:
    """``$\\mathdefault{2\\times10^{-1}}$`` → ``2×10⁻¹`` (a mathtext tick label as the text it shows).

    Handles the forms matplotlib's log formatters write (a number, ``\\times``, integer
    exponents ``^{k}``, a leading minus); anything else is returned unchanged.
    """
    m = _MATHTEXT.match(label)
    if m is None:
        return label
    body = _EXPONENT.sub(lambda e: e.group(1).translate(_SUPERSCRIPT), m.group(1)).replace("\\times", "×")
    if "\\" in body or "{" in body or "^" in body or "$" in body:
        return label
    return body.replace("-", "−")  # mathtext draws a minus sign, not a hyphen


def _t0(report: Mapping[str, Any]) -> float:
    return float(report.get("start_s") or 0.0)


def _log_x(*xs: Any) -> bool:
    """Whether a latency axis is logarithmic: the positive values span more than two decades (agent latencies are heavy-tailed)."""
    vals = np.concatenate([np.asarray(x, dtype=float) for x in xs]) if xs else np.empty(0)
    return bool(len(vals) and vals.min() > 0 and vals.max() / vals.min() > 100)


def _set_log_x(ax: Any) -> None:
    ax.set_xscale("log")
    # the formatters LogScale installs (base 10, no subs), less their mathtext
    ax.xaxis.set_major_formatter(LogTickFormatter(10))
    ax.xaxis.set_minor_formatter(LogTickFormatter(10, labelOnlyBase=False))


def cdf_steps(x: np.ndarray, y: np.ndarray, *, log: bool, width_px: float) -> tuple[np.ndarray, np.ndarray]:
    """The points of an empirical CDF that its ``steps-post`` line needs at ``width_px`` pixels across.

    Cuts the CDF's x span (log10 of it when ``log``) into columns of ``span / (2 * width_px)``
    and keeps the first point and the last point of each column. Between two kept points the
    full staircase then stays inside one column, so the line through the kept points (across
    at the lower level, up at the column's last x) is never further from it than a column's
    width: under half a pixel on an axes at most ``width_px`` wide showing at least the span
    (the plots' axes are narrower than the figure and autoscale adds margins). A run of 10⁶
    requests draws at most ``2 * width_px + 2`` points instead of 10⁶ — the same picture for a
    fraction of matplotlib's transform, step and path work.

    Args:
        x: [n] sample values sorted ascending (``metrics.cdf``); positive when ``log``.
        y: [n] cumulative fractions at ``x``.
        log: the x axis is logarithmic.
        width_px: the figure's width in pixels (an upper bound of the axes' width).

    Returns:
        ``(x[keep], y[keep])``; the inputs unchanged when there is nothing to cut (fewer than
        3 points, one distinct value).

    Raises:
        ValueError: if ``x`` and ``y`` differ in length, ``x`` is not sorted ascending, or
            ``log`` is set and ``x`` has a value ≤ 0.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"cdf_steps: x and y must be 1-d of one length, got {x.shape} and {y.shape}")
    if len(x) < 3:
        return x, y
    if np.any(np.diff(x) < 0):
        raise ValueError("cdf_steps: x must be sorted ascending")
    if log and x[0] <= 0:
        raise ValueError(f"cdf_steps: a log axis needs positive x, got {x[0]}")
    u = np.log10(x) if log else x
    span = u[-1] - u[0]
    if not span > 0 or not width_px > 0:
        return x, y
    col = np.floor((u - u[0]) * (2.0 * width_px / span))
    keep = np.empty(len(x), dtype=bool)
    keep[:-1] = col[1:] != col[:-1]  # the last point of each column
    keep[0] = keep[-1] = True
    return x[keep], y[keep]


def _latencies(records: Sequence[RequestRecord], attr: str) -> list[float]:
    return [v for r in records if r.ok and (v := getattr(r, attr)) is not None]


# ----------------------------------------------------------------------------- one run


def plot_latency_cdf(out: Path, records: Sequence[RequestRecord], attr: str, name: str, title: str) -> PlotFile | None:
    """CDF of ``ttft_s`` or ``e2e_s`` over completed requests, P50/P95 marked."""
    values = _latencies(records, attr)
    if not values:
        return None
    x, y = cdf(values)
    log = _log_x(x)
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    ax.plot(*cdf_steps(x, y, log=log, width_px=6.4 * DPI), drawstyle="steps-post", color="C0")
    for q, style in ((50, ":"), (95, "--")):
        v = float(np.percentile(x, q))  # same interpolation as the report's P50/P95
        ax.axvline(v, color="grey", linestyle=style, linewidth=1)
        ax.text(v, 0.02 if q == 50 else 0.1, f" P{q} = {v:.2f} s", fontsize=8, color="dimgrey")
    if log:
        _set_log_x(ax)
    ax.set_xlabel(f"{title} (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.set_title(f"{title} CDF ({len(values)} requests)")
    return PlotFile(_save(fig, out, name), f"{title} CDF", "Empirical CDF over completed requests; dotted P50, dashed P95.")


def plot_throughput(out: Path, report: Mapping[str, Any]) -> PlotFile | None:
    """Completed requests per second per window, with the run mean."""
    s = report.get("series") or {}
    t = s.get("t_s") or []
    thr = s.get("throughput_rps") or []
    if not t:
        return None
    t0, w = _t0(report), float(s.get("window_s") or 60.0)
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    xs = [(a - t0) / 60 for a in t]
    ax.bar(xs, [v or 0.0 for v in thr], width=w / 60, align="edge", color="C0", alpha=0.75, label=f"per {w:g} s window")
    if report.get("throughput_rps"):
        ax.axhline(report["throughput_rps"], color="C3", linestyle="--", linewidth=1, label=f"run mean {report['throughput_rps']:.3f}")
    ax.set_xlabel("time since first request (min)")
    ax.set_ylabel(f"completed requests ({throughput_unit([report.get('meta')])})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Throughput over time")
    return PlotFile(_save(fig, out, "throughput.png"), "Throughput over time", f"Requests completed per {w:g} s window.")


def _split_steps(timeline: RunTimeline, t0: float, t_end: float) -> tuple[list[float], list[int]]:
    pts = timeline.split_timeline
    xs = [(p.t - t0) / 60 for p in pts]
    ys = [p.prefill for p in pts]
    end = max((t_end - t0) / 60, xs[-1])
    return xs + [end], ys + [ys[-1]]


def _split_ticks(ax: Any, timelines: Sequence[tuple[RunTimeline, float]]) -> None:
    """Name each prefill-node count on the y axis after the split held there longest, over every
    ``(timeline, end_s)`` drawn (ties: the first seen). Several splits share a count (``collocated`` and
    ``1P0D+3B`` are 4 prefill nodes of 4); the first seen was often a state a switch passed through in
    milliseconds, which then named a 900-s warm-up, or another run's 3P1D in a comparison."""
    held: dict[int, dict[str, float]] = {}
    for tl, end in timelines:
        pts = tl.split_timeline
        ends = [q.t for q in pts[1:]] + [max(end, pts[-1].t)] if pts else []
        for p, until in zip(pts, ends):
            label = p.split if p.switching == 0 else f"{p.prefill}P{p.decode}D"
            at = held.setdefault(p.prefill, {})
            at[label] = at.get(label, 0.0) + max(0.0, until - p.t)
    if held:
        ks = sorted(held)
        ax.set_yticks(ks, [max(held[k].items(), key=lambda kv: kv[1])[0] for k in ks])
        ax.set_ylim(min(ks) - 0.5, max(ks) + 0.5)


def switch_counts(timeline: RunTimeline) -> str:
    """``"3 split decisions, 9 node phase switches"``: what a split plot's title / legend counts (the planner's
    decisions and each node's switch, the shaded intervals), so the two are not read as one number."""
    d, n = timeline.split_decisions(), len(timeline.switches)
    return f"{d} split decision{'s' if d != 1 else ''}, {n} node phase switch{'es' if n != 1 else ''}"


def plot_split(out: Path, report: Mapping[str, Any], timeline: RunTimeline | None) -> PlotFile | None:
    """PD split over time as a step plot of the prefill node count; switch intervals shaded."""
    if timeline is None or not timeline.split_timeline:
        return None
    t0 = _t0(report)
    t_end = float(report.get("end_s") or t0)
    xs, ys = _split_steps(timeline, t0, t_end)
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    ax.step(xs, ys, where="post", color="C0", linewidth=2, label="prefill nodes")
    for i, sw in enumerate(timeline.switches):
        ax.axvspan((sw.decided_at - t0) / 60, (sw.applied_at - t0) / 60, color="C3", alpha=0.2,
                   label="switch (decision → serving)" if i == 0 else None)
    if pending := pending_switch(timeline):
        since, nodes = pending
        ax.axvspan((since - t0) / 60, xs[-1], facecolor="none", edgecolor="C3", hatch="//", linewidth=0,
                   label=f"{nodes} node{'s' if nodes != 1 else ''} still switching at the run's end")
    _split_ticks(ax, [(timeline, t_end)])
    ax.set_xlabel("time since first request (min)")
    ax.set_ylabel("PD split")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(f"PD split over time ({switch_counts(timeline)})")
    return PlotFile(_save(fig, out, "split_timeline.png"), "PD split over time",
                    "Prefill node count over time (Figure 7a, C.1); shaded: node switches, decision to serving; "
                    "hatched: a switch still under way when the run ended (draining, or a relaunch: out of service; the node is "
                    "counted under its old phase).")


def pending_switch(timeline: RunTimeline) -> tuple[float, int] | None:
    """``(since, nodes)`` when the run ended with ``nodes`` nodes still switching (the last split point's
    ``switching``), ``since`` the first point of that unbroken stretch; None otherwise. A Dynamo relaunch
    (750 s) decided within the last 750 s of a run is never applied: it is no :attr:`RunTimeline.switches`
    entry, so the plot drew a flat split and "0 node phase switches" while a node was out of service for the
    rest of the run (a 600-s dynamo run on 9 nodes: one node from t=180 s to the end)."""
    pts = timeline.split_timeline
    if not pts or pts[-1].switching == 0:
        return None
    i = len(pts) - 1
    while i > 0 and pts[i - 1].switching > 0:
        i -= 1
    return pts[i].t, pts[-1].switching


def plot_lost_kv(out: Path, report: Mapping[str, Any]) -> PlotFile | None:
    """Lost KV reuse over time when the series exists, else bars of h, h* and 1 − h/h*."""
    s = report.get("series") or {}
    lost_t = s.get("lost_kv_reuse") or []
    t0, w = _t0(report), float(s.get("window_s") or 60.0)
    xs = [(a + w / 2 - t0) / 60 for a in s.get("t_s") or []]  # window midpoints
    pts = [(x, 100 * v) for x, v in zip(xs, lost_t) if v is not None]
    # a series of only None windows (no request had ideal reuse, h* = 0) and no run figure
    # draws nothing: the bars below say h = h* = 0 instead of an empty plot
    if pts or (lost_t and report.get("lost_kv_reuse") is not None):
        fig = Figure(figsize=(6.4, 3.6))
        ax = fig.add_subplot()
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color="C3", label=f"per {w:g} s window (by send)")
        if report.get("lost_kv_reuse") is not None:
            ax.axhline(100 * report["lost_kv_reuse"], color="grey", linestyle="--", linewidth=1,
                       label=f"run {100 * report['lost_kv_reuse']:.2f}%")
        ax.set_xlabel("time since first request (min)")
        ax.set_ylabel("lost KV reuse (%)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("Lost KV reuse 1 - h/h* over time")
        return PlotFile(_save(fig, out, "lost_kv_reuse.png"), "Lost KV reuse",
                        "1 − Σ cached / Σ ideal cached tokens per window (Figure 6, Appendix D.4).")
    h, hs, lost = report.get("kv_hit_rate"), report.get("ideal_kv_hit_rate"), report.get("lost_kv_reuse")
    if h is None:
        return None
    names, vals = ["KV hit rate h"], [100 * h]
    if hs is not None:
        names.append("ideal h*")
        vals.append(100 * hs)
    if lost is not None:
        names.append("lost 1 - h/h*")
        vals.append(100 * lost)
    fig = Figure(figsize=(5.2, 3.6))
    ax = fig.add_subplot()
    bars = ax.bar(names, vals, color=["C0", "C2", "C3"][: len(vals)])
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}%", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("KV reuse (run)")
    caption = ("Run-level h, h* and lost KV reuse; no per-window series (records carry no ideal_cached_tokens)."
               if not lost_t else "Run-level h and h*; no request had ideal KV reuse (h* = 0), so 1 − h/h* is undefined.")
    return PlotFile(_save(fig, out, "lost_kv_reuse.png"), "Lost KV reuse", caption)


def plot_prefill_queue(out: Path, report: Mapping[str, Any]) -> PlotFile | None:
    """Mean prefill queue time per node, and the per-minute imbalance (Table C.2)."""
    by = report.get("prefill_queue_by_node") or {}
    if not by:
        return None
    s = report.get("series") or {}
    imb = s.get("prefill_queue_imbalance") or []
    has_imb = any(v is not None for v in imb)
    fig = Figure(figsize=(6.4, 6.4 if has_imb else 3.6))
    ax = fig.add_subplot(2 if has_imb else 1, 1, 1)
    nodes = list(by)
    means = [by[n]["mean_s"] or 0.0 for n in nodes]
    bars = ax.bar(nodes, means, color="C1")
    for b, n in zip(bars, nodes):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"n={by[n]['requests']}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("mean queue time (s)")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("Prefill queueing time by node")
    if has_imb:
        t0, w = _t0(report), float(s.get("window_s") or 60.0)
        ax2 = fig.add_subplot(2, 1, 2)
        pts = [((a + w / 2 - t0) / 60, v) for a, v in zip(s.get("t_s") or [], imb) if v is not None]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color="C1")
        if report.get("prefill_queue_imbalance") is not None:
            ax2.axhline(report["prefill_queue_imbalance"], color="grey", linestyle="--", linewidth=1,
                        label=f"mean {report['prefill_queue_imbalance']:.2f}x")
            ax2.legend(fontsize=8)
        ax2.set_xlabel("time since first request (min)")
        ax2.set_ylabel("most loaded / mean")
        ax2.set_ylim(bottom=1 if all(p[1] >= 1 for p in pts) else 0)
        ax2.grid(alpha=0.3)
        ax2.set_title(f"Prefill queue imbalance per {w:g} s window")
    return PlotFile(_save(fig, out, "prefill_queue.png"), "Prefill queue",
                    "Mean queue time per prefill node; imbalance = most loaded node's total queue seconds / mean over prefill nodes (Appendix C.3).")


def plot_run(out: Path, report: Mapping[str, Any], records: Sequence[RequestRecord], timeline: RunTimeline | None) -> list[PlotFile]:
    """Every plot of one run that its data supports, in display order."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    made = [
        plot_latency_cdf(out, records, "ttft_s", "ttft_cdf.png", "TTFT"),
        plot_latency_cdf(out, records, "e2e_s", "e2e_cdf.png", "E2E latency"),
        plot_throughput(out, report),
        plot_split(out, report, timeline),
        plot_lost_kv(out, report),
        plot_prefill_queue(out, report),
    ]
    return [p for p in made if p is not None]


# ----------------------------------------------------------------------------- compare


def compare_latency_cdf(out: Path, runs: Sequence[RunData], attr: str, name: str, title: str) -> PlotFile | None:
    """CDFs of one latency overlaid, one line per run."""
    curves = [(i, run, cdf(values)) for i, run in enumerate(runs) if (values := _latencies(run.records, attr))]
    if not curves:
        return None
    log = _log_x(*(x for _, _, (x, _) in curves))
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    for i, run, (x, y) in curves:
        ax.plot(*cdf_steps(x, y, log=log, width_px=6.4 * DPI), drawstyle="steps-post", color=f"C{i % 10}",
                label=f"{run.label} (n={len(x)})")
    if log:
        _set_log_x(ax)
    ax.set_xlabel(f"{title} (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{title} CDF")
    return PlotFile(_save(fig, out, name), f"{title} CDF", "One line per run.")


def compare_metrics(out: Path, runs: Sequence[RunData]) -> PlotFile | None:
    """One bar chart per headline metric that at least one run has; ratio to the first run on each bar."""
    tput = throughput_label([r.report.get("meta") for r in runs])  # per simulated second, as the table says
    keys = [(k, tput if k == "throughput_rps" else label, kind) for k, label, kind, _ in HEADLINE_METRICS
            if any(r.report.get(k) is not None for r in runs)]
    if not keys:
        return None
    cols = 3
    rows = (len(keys) + cols - 1) // cols
    fig = Figure(figsize=(4.0 * cols, 2.8 * rows))
    labels = [r.label for r in runs]
    for idx, (k, label, kind) in enumerate(keys):
        ax = fig.add_subplot(rows, cols, idx + 1)
        vals = [r.report.get(k) for r in runs]
        scale = 100.0 if kind == "rate" else 1.0
        heights = [(v or 0.0) * scale for v in vals]
        bars = ax.bar(range(len(runs)), heights, color=[f"C{i % 10}" for i in range(len(runs))])
        base = vals[0]
        for i, (b, v) in enumerate(zip(bars, vals)):
            txt = fmt_value(v, kind)
            if i > 0 and v is not None and base:
                txt += f"\n{v / base:.2f}x"
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), txt, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(runs)), labels, fontsize=7, rotation=15)
        ax.set_title(label + (" (%)" if kind == "rate" else ""), fontsize=9)
        ax.margins(y=0.3)
        ax.grid(alpha=0.3, axis="y")
    return PlotFile(_save(fig, out, "compare_metrics.png"), "Headline metrics",
                    "One panel per metric; the number under each value is its ratio to the first run.")


def compare_throughput(out: Path, runs: Sequence[RunData]) -> PlotFile | None:
    """Throughput per window over time, one line per run."""
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    drawn = 0
    for i, run in enumerate(runs):
        s = run.report.get("series") or {}
        t = s.get("t_s") or []
        if not t:
            continue
        t0 = _t0(run.report)
        ax.step([(a - t0) / 60 for a in t], [v or 0.0 for v in s.get("throughput_rps") or []], where="post",
                color=f"C{i % 10}", label=run.label)
        drawn += 1
    if not drawn:
        return None
    ax.set_xlabel("time since first request (min)")
    ax.set_ylabel(f"completed requests ({throughput_unit([r.report.get('meta') for r in runs])})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Throughput over time")
    return PlotFile(_save(fig, out, "compare_throughput.png"), "Throughput over time", "Requests completed per window.")


def compare_split(out: Path, runs: Sequence[RunData]) -> PlotFile | None:
    """PD split over time of every run that has a timeline."""
    with_tl = [(i, r) for i, r in enumerate(runs) if r.timeline is not None and r.timeline.split_timeline]
    if not with_tl:
        return None
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    for i, run in with_tl:
        assert run.timeline is not None
        t0 = _t0(run.report)
        xs, ys = _split_steps(run.timeline, t0, float(run.report.get("end_s") or t0))
        ax.step(xs, ys, where="post", color=f"C{i % 10}", linewidth=2, alpha=0.8, label=f"{run.label} ({switch_counts(run.timeline)})")
    _split_ticks(ax, [(r.timeline, float(r.report.get("end_s") or _t0(r.report))) for _, r in with_tl if r.timeline is not None])
    ax.set_xlabel("time since first request (min)")
    ax.set_ylabel("PD split")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("PD split over time")
    return PlotFile(_save(fig, out, "compare_split_timeline.png"), "PD split over time", "Prefill node count per run.")


def plot_compare(out: Path, runs: Sequence[RunData]) -> list[PlotFile]:
    """Every comparison plot the runs' data supports, in display order."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    made = [
        compare_latency_cdf(out, runs, "ttft_s", "compare_ttft_cdf.png", "TTFT"),
        compare_latency_cdf(out, runs, "e2e_s", "compare_e2e_cdf.png", "E2E latency"),
        compare_metrics(out, runs),
        compare_throughput(out, runs),
        compare_split(out, runs),
    ]
    return [p for p in made if p is not None]
