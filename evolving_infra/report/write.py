"""``report.json`` + ``requests.jsonl`` + plots + ``report.html`` + a terminal summary for one run.

Every command that produces a report (``demo``, ``replay``, later ``simulate``)
calls :func:`build_report` with its records, the run's settings and, when it
knows it, the run's :class:`~evolving_infra.report.timeline.RunTimeline`, then
:func:`write_report`. Times in the report are simulated seconds; ``meta.wall_s``
is the run's wall-clock time. Keys are documented in ``README.md`` next to this
file.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import msgspec

from evolving_infra.report.metrics import (
    HEADLINE_METRICS,
    WINDOW_S,
    fmt_seconds,
    fmt_value,
    measured_span,
    period_metrics,
    prefill_queue_by_node,
    prefill_queue_imbalance,
    split_decisions,
    summarize,
    throughput_unit,
    time_series,
    timeline_metrics,
)
from evolving_infra.report.records import RequestRecord, read_records, write_records
from evolving_infra.report.timeline import RunTimeline, timeline_from_builtins

REPORT_JSON = "report.json"
REQUESTS_JSONL = "requests.jsonl"
REPORT_HTML = "report.html"
DECISIONS_JSONL = "decisions.jsonl"
"""The planner's every evaluation, written by ``simulate`` next to :data:`REPORT_JSON` (``sim.run.write_decisions``)."""


def build_report(
    records: Sequence[RequestRecord],
    *,
    meta: Mapping[str, Any],
    ideal_kv_hit_rate: float | None = None,
    extra: Mapping[str, Any] | None = None,
    timeline: RunTimeline | None = None,
    window_s: float = WINDOW_S,
    start: float | None = None,
    end: float | None = None,
) -> dict[str, Any]:
    """The report dict: headline metrics, per-window series, per-period metrics, run metadata.

    Args:
        records: one per request sent (any order).
        meta: run settings, stored under ``meta``. ``meta["periods"]``, a list of
            ``{name, start_s, end_s}``, adds per-period metrics under ``periods``.
        ideal_kv_hit_rate: h* of the replayed requests (paper Figure 3), for ``lost_kv_reuse``.
        extra: keys a producer adds (e.g. ``ttft_prediction_abs_error_median_s``,
            ``lost_kv_reuse_eviction_share``, ``final_split``, ``wall_s``, ``sim_speed``);
            they are stored at top level and override computed keys of the same name.
        timeline: the PD split over time and phase switches; without it
            ``switches``, ``switch_time_mean_s``, ``split_timeline`` and ``final_split`` are None.
        window_s: window of the time series and the prefill queue imbalance (default 60 s).
        start, end: the measured window in simulated seconds (``start_s``, ``end_s``,
            ``duration_s``, the denominator of ``throughput_rps``, the series' windows); default
            the span of the records, first send → last finish (the simulator's). A live replay
            passes its own window (``ReplayResult.start`` / ``.end``: replay start → its end,
            wall seconds × speedup), so a replay stopped after 89 s wall at speedup 1 with 2
            requests answered in 2.4 s reports 2 / 89 req/s, not 2 / 2.4.

    Returns:
        A JSON-serialisable dict (see ``evolving_infra/report/README.md``).
    """
    if start is None or end is None:
        span = measured_span(records)
        start = span[0] if start is None else start
        end = span[1] if end is None else end
    # once for the summary's mean and the series' windows (it was computed for each: ~12% of this function)
    imbalance = prefill_queue_imbalance(records, start=start, end=end, window_s=window_s, timeline=timeline)
    report: dict[str, Any] = dict(
        summarize(records, ideal_kv_hit_rate=ideal_kv_hit_rate, timeline=timeline, window_s=window_s, start=start, end=end,
                  imbalance=imbalance)
    )
    report.update(timeline_metrics(timeline))
    report["sessions"] = len({r.agent for r in records})
    report["subagent_branches"] = len({r.branch for r in records if r.branch_kind == "subagent"})
    report["fork_branches"] = len({r.branch for r in records if r.branch_kind == "fork"})
    report["branches"] = len({r.branch for r in records})
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or f"HTTP {r.status}")[:120]
            errors[key] = errors.get(key, 0) + 1
    report["errors"] = errors
    report["prefill_queue_by_node"] = prefill_queue_by_node(records)
    series = time_series(records, start=start, end=end, window_s=window_s, timeline=timeline, imbalance=imbalance)
    report["series"] = series
    notes: list[str] = []
    if "lost_kv_reuse" not in series:
        notes.append(
            "lost KV reuse over time not computed: records carry no ideal_cached_tokens "
            "(per-request h* share); only the run-level value is reported"
        )
    if report["prefill_queue_samples"] == 0:
        notes.append("prefill queue metrics not available: no record reports queue_s")
    if timeline is None:
        notes.append("no split timeline given: switches, switch time and PD split over time not reported")
    periods = meta.get("periods")
    if periods:
        try:
            report["periods"] = period_metrics(records, periods, timeline=timeline, window_s=window_s)
        except ValueError as e:
            report["periods"] = None
            notes.append(f"periods not computed: {e}")
    report["report_notes"] = notes
    report["timeline"] = msgspec.to_builtins(timeline) if timeline is not None else None
    if extra:
        report.update(extra)
    report["meta"] = dict(meta)
    return report


def write_report(
    out_dir: Path,
    report: Mapping[str, Any],
    records: Sequence[RequestRecord],
    *,
    plots: bool = True,
) -> Path:
    """Write ``report.json``, ``requests.jsonl`` and (``plots=True``) the PNGs and ``report.html``.

    ``report.json`` and ``requests.jsonl`` are each replaced atomically (records first); a
    write that fails (disk full) removes its ``.tmp`` files and raises.

    The JSON and the records are written first; a plotting failure is printed to
    stderr and does not lose them (``evolving-infra report show DIR`` redraws).

    Returns:
        The path of ``report.json``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_JSON
    earlier = path.is_file()  # an earlier run's folder: its page and plots are ours to remove, else a user's files
    # atomically (a temp file renamed over the old one): a run killed while writing never
    # leaves half a report, nor the previous run's report under this run's name
    tmp = path.with_name(path.name + ".tmp")
    rec_tmp = out_dir / (REQUESTS_JSONL + ".tmp")
    try:
        tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
        write_records(rec_tmp, records)
        os.replace(rec_tmp, out_dir / REQUESTS_JSONL)
        os.replace(tmp, path)
    except BaseException:  # disk full, Ctrl-C: no half-written .tmp left
        tmp.unlink(missing_ok=True)
        rec_tmp.unlink(missing_ok=True)
        raise
    if earlier:  # a previous run's page and plots in this folder would show that run, not this one
        _clear_rendered(out_dir)
    if plots:
        try:
            render_run(out_dir, report, records, clear=False)
        except Exception as e:  # noqa: BLE001 - the run's data is already on disk
            print(f"warning: plots for {out_dir} failed ({type(e).__name__}: {e}); "
                  f"retry with: evolving-infra report show {out_dir}", file=sys.stderr)
    return path


RUN_PLOTS = ("ttft_cdf.png", "e2e_cdf.png", "throughput.png", "split_timeline.png", "lost_kv_reuse.png", "prefill_queue.png")
"""Every PNG :func:`~evolving_infra.report.plots.plot_run` may draw (each only when the run's data supports it)."""


def _clear_rendered(out_dir: Path) -> None:
    """Remove ``report.html`` and the :data:`RUN_PLOTS` from ``out_dir``: what a run's rendering writes, so
    that none of a previous run's is left beside this run's ``report.json``. A ``simulate --no-plots`` into
    the folder of an earlier 4-node run kept its report.html and six PNGs next to the new 2-node report.json.
    Only for a folder that held a run's ``report.json`` before (:func:`write_report`) or holds one
    (:func:`render_run`, ``report show``): ``--out .`` or ``--out ~`` into a folder of the user's own files
    removed their ``report.html`` or ``throughput.png`` even with ``--no-plots``, which writes neither."""
    for name in (REPORT_HTML, *RUN_PLOTS):
        (Path(out_dir) / name).unlink(missing_ok=True)


def render_run(out_dir: Path, report: Mapping[str, Any], records: Sequence[RequestRecord], *, clear: bool = True) -> Path:
    """Draw the run's PNGs into ``out_dir`` and write ``report.html``; returns the HTML path. With ``clear`` (a
    redraw in a run's folder, ``report show``) the page and plots there before are removed first (a plot this
    run's data does not support is not left from an earlier one); :func:`write_report` passes False, having
    removed them itself only when the folder held a run before."""
    from evolving_infra.report.html import run_page
    from evolving_infra.report.plots import plot_run

    if clear:
        _clear_rendered(Path(out_dir))
    timeline = timeline_from_builtins(report.get("timeline"))
    images = plot_run(Path(out_dir), report, records, timeline)
    html_path = Path(out_dir) / REPORT_HTML
    html_path.write_text(run_page(report, images, base=Path(out_dir)), encoding="utf-8")
    return html_path


def not_a_run(run_dir: Path) -> str:
    """What ``run_dir``, which holds no ``report.json``, is instead: a sweep's ``--out`` (its runs and
    comparison named), a comparison's ``--out``, or a folder of runs (``fidelity``'s); else the question
    whether it is a run directory. ``report show runs/baselines`` (a sweep) said only the question."""
    try:
        runs = sorted(str(p) for p in run_dir.iterdir() if (p / REPORT_JSON).is_file())
    except OSError:
        runs = []
    listed = ", ".join(runs[:8]) + (f", ... ({len(runs)} runs)" if len(runs) > 8 else "")
    if (run_dir / "sweep.json").is_file():
        cmp = run_dir / "compare" / "compare.html"
        return f"{run_dir} is a sweep: its runs are {listed or 'none'}" + (f"; compared in {cmp}" if cmp.is_file() else "")
    if (run_dir / "compare.json").is_file():
        return f"{run_dir} is a comparison (report compare's --out): open {run_dir / 'compare.html'}"
    if runs:
        return f"{run_dir} holds runs: {listed}"
    return f"is {run_dir} a run directory?"


def load_run(run_dir: Path) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Read ``report.json`` and ``requests.jsonl`` (empty list if absent) of a run directory.

    Raises:
        FileNotFoundError: if ``report.json`` is missing.
        ValueError: if ``report.json`` is not a JSON object or a records line is malformed.
    """
    run_dir = Path(run_dir)
    path = run_dir / REPORT_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no report.json ({not_a_run(run_dir)})")
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: {e}") from e
    if not isinstance(report, dict):
        raise ValueError(f"{path}: expected a JSON object")  # noqa: TRY004 - malformed file, one error type
    rec_path = run_dir / REQUESTS_JSONL
    records = read_records(rec_path) if rec_path.is_file() else []
    return report, records


def report_line(path: Path) -> str:
    """The line a command that wrote a run ends with: ``report: DIR/report.json``, and ``page: DIR/report.html``
    when that page was written (not with ``--no-plots``, nor after a plotting failure). The demo, simulate and
    replay named the JSON only; the page with the plots, what a newcomer opens first, was not named."""
    html = Path(path).with_name(REPORT_HTML)
    return f"report: {path}" + (f"  page: {html}" if html.is_file() else "")


CONTROL_PLANE_DOMINANT = 0.5
"""Share of the mean client TTFT above which the summary says the control plane dominates it."""


def ttft_split_lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's lines splitting a live run's client TTFT into the prefill node's part and the control
    plane's (``ttft_node_*``, ``ttft_control_plane_*`` of :func:`~evolving_infra.report.metrics.summarize`),
    plus a warning when the control plane is more than half the mean client TTFT over the same records
    (``ttft_split_client_mean_s``; a report without it, from before, gets no warning: its ``ttft_mean_s`` also
    counts records without a node arrival): under ``--speedup N`` it is N × the real latency of the router, bus
    and client on this machine, so it measures the machine's load more than the serving policy. A run whose
    policy binds the decode node at prefill start (``meta.policy.decode_binding`` ``prefill-start``: the
    evolving and arrow sets) then also says where the prefill node's ``route.bind`` round trip to the router
    went: a prefill that ends before its binding sends its first token at once and waits, parked, only for its
    hand-off, so under ``--speedup N`` that hop (N × real latency) delays its decode (TPOT, end-to-end latency), not
    its first token. Before (until 2026-12-05), the first token waited for the binding too and the summary
    said "on node" held it: two evolving demos side by side (4 nodes, load average 7-11 on 2 cores), before
    and after, gave on-node TTFT mean 16.9 s and 0.67 s, E2E mean 128 s and 130 s, TPOT mean 0.039 s and
    0.127 s (the round trip moved from the first token to the second).
    The page's list (``report.html``); the terminal summary leads with :func:`ttft_lead_lines` instead.
    Empty for a report without them (simulator runs, older reports)."""
    g = report.get
    if g("ttft_node_mean_s") is None:
        return []
    return [f"  on node  mean {fmt_seconds(g('ttft_node_mean_s'))}  p50 {fmt_seconds(g('ttft_node_p50_s'))}  "
            f"p95 {fmt_seconds(g('ttft_node_p95_s'))} (prefill node arrival → first token: queue + prefill)",
            *_control_plane_lines(report)]


def _times(report: Mapping[str, Any]) -> str:
    """`` × speedup 50`` for a run under ``--speedup`` N ≠ 1 (``meta.speedup``), else empty."""
    speedup = (report.get("meta") or {}).get("speedup")
    return f" × speedup {speedup:g}" if isinstance(speedup, (int, float)) and not isinstance(speedup, bool) and speedup != 1 else ""


def ttft_lead_lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's first TTFT lines for a live run (``ttft_node_mean_s`` given): the TTFT on the prefill node first
    (queue + prefill: what a serving system's own TTFT counts, and what the policies decide), then the client's
    TTFT labelled as including the control plane × speedup, then :func:`ttft_split_lines`' control-plane line and
    notes. Before (session 59), ``make demo`` led with ``TTFT mean 14.821 s p95 58.920 s`` (the client's, ~96% of it
    the control plane stretched by ``--speedup 50``), which alarmed a Dynamo user; the on-node 0.544 s came below.
    Empty for a report without the split (simulator runs, older reports): their one TTFT line stays."""
    g = report.get
    if g("ttft_node_mean_s") is None:
        return []
    return [
        f"TTFT on node  mean {fmt_seconds(g('ttft_node_mean_s'))}  p50 {fmt_seconds(g('ttft_node_p50_s'))}  "
        f"p95 {fmt_seconds(g('ttft_node_p95_s'))}  (prefill node arrival → first token: queue + prefill)",
        f"client TTFT   mean {fmt_seconds(g('ttft_mean_s'))}  p50 {fmt_seconds(g('ttft_p50_s'))}  "
        f"p95 {fmt_seconds(g('ttft_p95_s'))}  (incl. control plane{_times(report)})",
        *_control_plane_lines(report),
    ]


def _control_plane_lines(report: Mapping[str, Any]) -> list[str]:
    """The control plane's line of a live run's TTFT split, and the notes when it dominates (:func:`ttft_split_lines`)."""
    g = report.get
    meta = g("meta") or {}
    times = _times(report)
    policy = meta.get("policy")
    binds_at_start = isinstance(policy, Mapping) and policy.get("decode_binding") == "prefill-start"
    lines = [
        f"  control plane mean {fmt_seconds(g('ttft_control_plane_mean_s'))}  p50 {fmt_seconds(g('ttft_control_plane_p50_s'))} "
        f"(router → node, first token → client: real latency{times})",
    ]
    total, control = g("ttft_split_client_mean_s"), g("ttft_control_plane_mean_s")
    if total and control is not None and control > CONTROL_PLANE_DOMINANT * total:
        lines.append(
            f"  note: {100 * control / total:.0f}% of the mean client TTFT is control plane, which grows with this "
            f"machine's load{times}: compare policies on the TTFT on node (or with `simulate`), not the client's"
        )
        if binds_at_start:
            lines.append(
                f"  note: decode binding at prefill start: a prefill that ends before its route.bind round trip to the "
                f"router (real latency{times}) sends its first token and waits for the binding only to hand off: it "
                "delays the decode (TPOT, end-to-end latency), not the TTFT; against a policy that binds at dispatch, "
                "compare end-to-end latency with `simulate`"
            )
    return lines


def _measured_window(report: Mapping[str, Any]) -> str:
    """`` (t=600-900 s, after --warmup 600)`` for a run whose metrics leave out a warm-up (``meta.warmup_s`` > 0):
    its duration is the measured window, which the summary gave beside the whole run's wall time with no word of
    it ("299.8 s simulated, 32.9 s wall" for a 900-s simulate --warmup 600 that ran at 27x); else empty."""
    warmup = (report.get("meta") or {}).get("warmup_s")
    start, end = report.get("start_s"), report.get("end_s")
    if not (isinstance(warmup, (int, float)) and warmup > 0 and isinstance(start, (int, float)) and isinstance(end, (int, float))):
        return ""
    return f" (t={start:.0f}-{end:.0f} s, after --warmup {warmup:g})"


def _throughput_line(rps: Any, speedup: Any) -> str:
    """The summary's throughput line. ``rps``: requests completed per second of the run's clock (``duration_s`` is
    simulated seconds: the simulator's, or a live run's cluster clock, ``speedup`` of them per wall second); it says
    so, and under a live ``--speedup`` N ≠ 1 what that is per wall second (at ``--speedup 1``: req/s alone). Before, ``make demo`` printed
    "throughput 0.118 req/s", read as the wall rate of a run that served 50 times that."""
    if not isinstance(rps, (int, float)) or isinstance(rps, bool) or not rps:
        return "throughput -"
    live = isinstance(speedup, (int, float)) and not isinstance(speedup, bool) and speedup > 0
    # req/s alone for a live run at --speedup 1 (its cluster clock is the wall clock): the pages' rule too
    line = f"throughput {rps:.3f} {throughput_unit([{'speedup': speedup}])}"
    if live and speedup != 1:
        line += f" ({rps * speedup:.2f} req/s of wall time at --speedup {speedup:g})"
    return line


def print_summary(report: Mapping[str, Any], file: TextIO | None = None) -> None:
    """Human-readable summary of a report to ``file`` (default stdout); tolerates reports missing newer keys."""
    g = report.get
    meta = g("meta") or {}

    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    wall = g("wall_s") or meta.get("wall_s")
    lines = [
        f"requests   sent {g('requests_sent', 0)}  completed {g('requests_completed', 0)}  failed {g('requests_failed', 0)}"
        + (f"  retried {g('requests_retried')} ({g('retries', 0)} retries)" if g("requests_retried") else ""),
        f"sessions   {g('sessions', 0)}  (sub-agent branches {g('subagent_branches', 0)}, branches {g('branches', 0)})",
        f"duration   {fmt_seconds(g('duration_s'))} simulated" + _measured_window(report) + (f", {wall:.1f} s wall" if wall else ""),
        _throughput_line(g("throughput_rps"), meta.get("speedup")),
        # a live run's TTFT on the node leads, the client's (control plane × speedup included) follows, labelled (a
        # newcomer read the demo's client 16.4 s against its baseline's 7.0 s as the system losing: on node 0.48 vs
        # 0.81 s; a Dynamo user took "TTFT mean 14.821 s" for the serving's, 96% of it control plane × 50)
        *(ttft_lead_lines(report) or [
            f"TTFT       mean {fmt_seconds(g('ttft_mean_s'))}  p50 {fmt_seconds(g('ttft_p50_s'))}  p95 {fmt_seconds(g('ttft_p95_s'))}"]),
        f"E2E        mean {fmt_seconds(g('e2e_mean_s'))}  p95 {fmt_seconds(g('e2e_p95_s'))}",
        f"TPOT       mean {fmt_seconds(g('tpot_mean_s'))}",
        f"KV hit     {pct(g('kv_hit_rate'))}  (ideal {pct(g('ideal_kv_hit_rate'))}, lost KV reuse {pct(g('lost_kv_reuse'))})",
    ]
    h, ideal = g("kv_hit_rate"), g("ideal_kv_hit_rate")
    if isinstance(h, (int, float)) and isinstance(ideal, (int, float)) and h > ideal + 0.005:
        # h* is the trace's own reuse; a cluster that held prefixes before the run (an earlier replay of the same
        # trace: 100.0% against 86.3% on a 4-session replay run twice) serves more, and lost KV reuse floors at 0
        lines.append("  note: KV hit above the trace's ideal h*: the cluster held some prompts' prefixes before this run "
                     "(an earlier run of the same input?), so lost KV reuse reads 0")
    if g("prefill_queue_samples"):
        lines.append(
            f"prefill Q  mean {fmt_seconds(g('prefill_queue_mean_s'))}  p95 {fmt_seconds(g('prefill_queue_p95_s'))}  "
            f"imbalance {fmt_value(g('prefill_queue_imbalance'), 'x')} (most loaded / mean, per minute)"
        )
    if g("switches") is not None:
        n_decisions = split_decisions(report)
        decisions = "" if n_decisions is None else f"split decisions {n_decisions}  "
        lines.append(
            f"PD split   final {g('final_split') or '-'}  {decisions}node phase switches {g('switches')}  "
            f"time per switch {fmt_seconds(g('switch_time_mean_s'))}"
        )
    elif g("final_split"):
        lines.append(f"PD split   final {g('final_split')}")
    if g("ttft_prediction_node_abs_error_median_s") is not None:  # live: against what the router predicts
        lines.append(
            f"TTFT prediction |error| median {fmt_seconds(g('ttft_prediction_node_abs_error_median_s'))} "
            f"p95 {fmt_seconds(g('ttft_prediction_node_abs_error_p95_s'))} (router's prediction vs the prefill node's "
            f"arrival → first token: queue + prefill)"
        )
        if g("ttft_prediction_abs_error_median_s") is not None:
            lines.append(
                f"  |error| vs client TTFT less admission wait: median {fmt_seconds(g('ttft_prediction_abs_error_median_s'))} "
                f"(adds the control plane, router → node → client, which it does not predict)"
            )
    elif g("ttft_prediction_abs_error_median_s") is not None:
        lines.append(f"TTFT prediction |error| median {fmt_seconds(g('ttft_prediction_abs_error_median_s'))} "
                     f"(router's prediction vs client TTFT less admission wait)")
    known = {k for k, *_ in HEADLINE_METRICS}
    extras = (
        ("lost_kv_reuse_eviction_share", "share of the lost KV reuse due to eviction", pct),
        ("sim_speed", "sim speed", lambda v: f"{v:.0f}x real time"),
    )
    for key, name, show in extras:
        if g(key) is not None and key not in known:
            lines.append(f"{name} {show(g(key))}")
    for p in g("periods") or []:
        lines.append(
            f"period     {p.get('name')}: {fmt_value(p.get('throughput_rps'), 'rps')} {throughput_unit([meta])}, "
            f"E2E mean {fmt_seconds(p.get('e2e_mean_s'))}, TTFT p95 {fmt_seconds(p.get('ttft_p95_s'))}, "
            f"split {p.get('final_split') or '-'}"
        )
    for note in meta.get("notes", []) or []:
        lines.append(f"note       {note}")
    errors = g("errors")
    if errors:
        for err, n in sorted(errors.items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"error      {n}× {err}")
    pol = meta.get("policy")
    if isinstance(pol, dict) and pol.get("name"):  # which serving system ran (live: launcher; sim: the policy set)
        lines.insert(0, f"policy     {pol['name']}  (routing {pol.get('routing', '-')}, planner {pol.get('planner', '-')}, "
                        f"eviction {pol.get('eviction', '-')})")
    print("\n".join(lines), file=file if file is not None else sys.stdout)
