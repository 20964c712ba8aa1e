"""Self-contained HTML pages: one run (``report.html``) and a comparison (``compare.html``).

Each page has inline CSS and embeds every plot as a base64 PNG (so the page can
be mailed or moved alone); each ``<img>`` also names its PNG file next to the
page in ``data-file``. Text is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evolving_infra.report.metrics import HEADLINE_METRICS, fmt_value, throughput_label, with_derived
from evolving_infra.report.plots import PlotFile
from evolving_infra.report.write import ttft_split_lines

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5rem auto;max-width:1200px;color:#222;padding:0 1rem}
h1{font-size:1.4rem;margin-bottom:.2rem} h2{font-size:1.1rem;margin-top:1.8rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
.sub{color:#666;font-size:.9rem}
table{border-collapse:collapse;font-size:.88rem;margin:.5rem 0}
th,td{border:1px solid #ddd;padding:.25rem .6rem;text-align:right;vertical-align:top}
th{background:#f4f4f4} td.k,th.k{text-align:left}
tr.sec td{background:#fafafa;font-weight:600;text-align:left} .where{font-weight:400;color:#666;font-size:.8rem}
.better{color:#1a7f37} .worse{color:#b42318}
.grid{display:flex;flex-wrap:wrap;gap:1rem}
figure{margin:0;flex:1 1 520px;max-width:100%} figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.8rem;color:#555}
ul.notes{font-size:.85rem;color:#444} code{font-size:.85rem} li.warn{color:#b42318}
"""

# Keys never shown in the generic "other" rows (structured or shown elsewhere).
_STRUCTURED = {
    "meta", "errors", "series", "timeline", "periods", "prefill_queue_by_node", "report_notes", "split_timeline",
}

_SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Requests", ("requests_sent", "requests_completed", "requests_failed", "requests_retried", "retries", "requests_unfinished",
                  "requests_warmup_excluded", "sessions", "subagent_branches", "fork_branches", "branches",
                  "closed_loop_exhausted_at_s", "duration_s", "throughput_rps")),
    # a live run's TTFT split (ttft_node_*, ttft_control_plane_*) and the router's prediction error sit with TTFT
    ("Latency", ("ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "ttft_node_samples", "ttft_split_client_mean_s",
                 "ttft_node_mean_s", "ttft_node_p50_s", "ttft_node_p95_s", "ttft_control_plane_mean_s",
                 "ttft_control_plane_p50_s", "e2e_mean_s", "e2e_p50_s", "e2e_p95_s", "tpot_mean_s",
                 "ttft_prediction_node_samples", "ttft_prediction_node_abs_error_median_s",
                 "ttft_prediction_node_abs_error_p95_s", "ttft_prediction_samples", "ttft_prediction_abs_error_median_s",
                 "ttft_prediction_abs_error_p95_s", "ttft_prediction_abs_error_median_all_s")),
    ("KV cache", ("kv_hit_rate", "ideal_kv_hit_rate", "lost_kv_reuse", "lost_kv_reuse_tokens",
                  "lost_kv_reuse_eviction_share", "lost_kv_reuse_routing_share", "lost_kv_reuse_unattributed_share",
                  "prompt_tokens_total", "cached_tokens_total", "completion_tokens_total")),
    ("Prefill queue", ("prefill_queue_mean_s", "prefill_queue_p95_s", "prefill_queue_imbalance", "prefill_queue_samples")),
    ("PD split", ("split_decisions", "switches", "switch_time_mean_s", "switch_drain_mean_s", "switch_downtime_mean_s",
                  "switch_downtime_node_s", "switch_requeued", "split_changes", "final_split")),
    ("Faults", ("relaunches", "out_of_service_share", "out_of_service_node_s", "reroutes")),
    ("Run", ("simulated_s", "wall_s", "sim_wall_s", "setup_wall_s", "sim_speed", "peak_rss_mb")),
)
"""The summary table's sections and their rows in order; a scalar key in none of them (the simulator's internals:
``counted_kv_tokens_per_prefill_node_*``, ``decode_kv_reserved_*``, ``kv_directory_peak_bytes``, ...) goes to
"Other" under its report.json name."""

_LABELS = {k: label for k, label, _, _ in HEADLINE_METRICS} | {
    "requests_sent": "Requests sent",
    "requests_completed": "Requests completed",
    "requests_failed": "Requests failed",
    "requests_retried": "Requests retried (refused before any answer)",
    "retries": "Retries (sends after the first)",
    "sessions": "Sessions (agents)",
    "subagent_branches": "Sub-agent branches",
    "fork_branches": "Fork branches",
    "branches": "Branches",
    "requests_unfinished": "Requests unfinished at the end",
    "requests_warmup_excluded": "Requests in the warm-up (not measured)",
    "closed_loop_exhausted_at_s": "Input ran out of agents at",
    "duration_s": "Duration (simulated)",
    "ttft_p50_s": "TTFT P50",
    "ttft_node_samples": "Requests in the TTFT split (with a node arrival)",
    "ttft_split_client_mean_s": "TTFT client mean over the requests in the split",
    "ttft_node_mean_s": "TTFT on the prefill node mean (arrival → first token)",
    "ttft_node_p50_s": "TTFT on the prefill node P50",
    "ttft_node_p95_s": "TTFT on the prefill node P95",
    "ttft_control_plane_mean_s": "TTFT control plane mean (router → node → client)",
    "ttft_control_plane_p50_s": "TTFT control plane P50",
    "e2e_p50_s": "E2E P50",
    "ttft_prediction_samples": "TTFT prediction samples",
    "ttft_prediction_abs_error_median_s": "TTFT prediction |error| median (vs client TTFT less admission wait)",
    "ttft_prediction_abs_error_p95_s": "TTFT prediction |error| P95 (vs client TTFT less admission wait)",
    "ttft_prediction_abs_error_median_all_s": "TTFT prediction |error| median, warm-up included (router's samples)",
    "ttft_prediction_node_samples": "TTFT prediction samples (with a node arrival)",
    "ttft_prediction_node_abs_error_median_s": "TTFT prediction |error| median (vs node arrival → first token)",
    "ttft_prediction_node_abs_error_p95_s": "TTFT prediction |error| P95 (vs node arrival → first token)",
    "lost_kv_reuse_tokens": "Lost KV reuse tokens (ideal cached − cached)",
    "lost_kv_reuse_eviction_share": "Share of the lost KV reuse due to eviction",
    "lost_kv_reuse_routing_share": "Share of the lost KV reuse due to routing",
    "lost_kv_reuse_unattributed_share": "Share of the lost KV reuse unattributed (a branch's first request)",
    "prompt_tokens_total": "Prompt tokens",
    "cached_tokens_total": "Cached prompt tokens",
    "completion_tokens_total": "Completion tokens",
    "prefill_queue_samples": "Requests reporting queue time",
    "split_changes": "Splits served after launch (intermediate included)",
    "split_decisions": "Planner split decisions",
    "final_split": "Final split",
    "switch_drain_mean_s": "Drain time per switch",
    "switch_downtime_mean_s": "Downtime per switch (drained → serving)",
    "switch_downtime_node_s": "Switch downtime, all nodes",
    "switch_requeued": "Requests requeued by switches",
    "relaunches": "Node relaunches",
    "out_of_service_share": "Share of the time a node was out of service",
    "out_of_service_node_s": "Node time out of service",
    "reroutes": "Reroutes",
    "simulated_s": "Simulated time",
    "wall_s": "Wall time",
    "sim_wall_s": "Wall time simulating",
    "setup_wall_s": "Wall time setting up",
    "sim_speed": "Simulation speed (sim s / wall s)",
    "peak_rss_mb": "Peak RSS (MB)",
}

_RATE_KEYS = {"kv_hit_rate", "ideal_kv_hit_rate", "lost_kv_reuse", "lost_kv_reuse_eviction_share"}
_X_KEYS = {"sim_speed"}  # a ratio: 4502.32x, not 4.5e+03


def kind_of(key: str) -> str:
    """Display kind of a report key: ``s``, ``rps``, ``rate``, ``x``, ``count`` or ``other``."""
    for k, _, kind, _ in HEADLINE_METRICS:
        if k == key:
            return kind
    if key in _RATE_KEYS or key.endswith(("_share", "_rate")):
        return "rate"
    if key in _X_KEYS:
        return "x"
    if key.endswith("_s"):
        return "s"
    if key.endswith("_rps"):
        return "rps"
    return "count"


def fmt_key(key: str, value: Any) -> str:
    """A report value formatted for display by its key."""
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and math.isnan(value):
            return "-"
        kind = kind_of(key)
        if kind == "count" and isinstance(value, float) and not value.is_integer():
            return f"{value:.3g}"
        return fmt_value(value, kind)
    if value is None:
        return "-"
    return str(value)


def label_of(key: str) -> str:
    """Human label of a report key (the key itself when unknown)."""
    return _LABELS.get(key, key)


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def img_tag(plot: PlotFile, base: Path) -> str:
    """``<figure>`` embedding ``base / plot.file`` as base64, naming the file in ``data-file``.

    Raises:
        FileNotFoundError: if the PNG is missing.
    """
    data = base64.b64encode((Path(base) / plot.file).read_bytes()).decode("ascii")
    return (
        f'<figure><img alt="{_e(plot.title)}" data-file="{_e(plot.file)}" src="data:image/png;base64,{data}">'
        f"<figcaption><b>{_e(plot.title)}</b> — {_e(plot.caption)} (<code>{_e(plot.file)}</code>)</figcaption></figure>"
    )


def _page(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>\n{body}\n</body></html>\n"
    )


KEY_DOCS = "evolving_infra/report/README.md (every run) and evolving_infra/sim/README.md (simulate's)"
"""Where the keys of a page's "Other" rows (``counted_kv_tokens_per_prefill_node_max``, ``decode_kv_reserved_share``, ...),
shown by their report.json names, are defined: the page named none of them."""


def _summary_table(report: Mapping[str, Any]) -> str:
    report = with_derived(report)
    labels = {"throughput_rps": throughput_label([report.get("meta")])}  # per simulated second, as the summary

    def label_of(k: str) -> str:
        return labels.get(k) or _LABELS.get(k, k)

    rows: list[str] = []
    shown: set[str] = set()
    for section, keys in _SECTIONS:
        present = [k for k in keys if k in report]
        if not present:
            continue
        rows.append(f'<tr class="sec"><td colspan="2">{_e(section)}</td></tr>')
        for k in present:
            rows.append(f'<tr><td class="k">{_e(label_of(k))}</td><td>{_e(fmt_key(k, report[k]))}</td></tr>')
            shown.add(k)
    other = [k for k, v in sorted(report.items())
             if k not in shown and k not in _STRUCTURED and (v is None or isinstance(v, (int, float, str, bool)))
             and k not in ("start_s", "end_s")]
    if other:
        rows.append('<tr class="sec"><td colspan="2">Other <span class="where">(keys by name: their definitions are in '
                    f'{_e(KEY_DOCS)})</span></td></tr>')
        for k in other:
            rows.append(f'<tr><td class="k">{_e(label_of(k))}</td><td>{_e(fmt_key(k, report[k]))}</td></tr>')
    return "<table>" + "".join(rows) + "</table>"


def _ttft_split(report: Mapping[str, Any]) -> str:
    """A live run's TTFT split into the prefill node's part and the control plane's, with the note when the
    control plane is over half the mean client TTFT: the terminal summary's lines
    (:func:`~evolving_infra.report.write.ttft_split_lines`), which the page lacked. Empty for a report without
    the split (simulator runs, older reports)."""
    lines = [" ".join(line.split()) for line in ttft_split_lines(report)]  # the terminal's column spaces
    if not lines:
        return ""
    warn = ' class="warn"'
    items = "".join(f"<li{warn if line.startswith('note:') else ''}>{_e(line)}</li>" for line in lines)
    return ('<div class="sub">TTFT of this live run, on the prefill node and in the control plane '
            "(over the requests with a node arrival):</div>" f'<ul class="notes">{items}</ul>')


def _periods_table(periods: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> str:
    labels = {"throughput_rps": throughput_label([meta])}

    def label_of(k: str) -> str:
        return labels.get(k) or _LABELS.get(k, k)

    cols = ("throughput_rps", "requests_sent", "ttft_mean_s", "ttft_p95_s", "e2e_mean_s", "e2e_p95_s", "tpot_mean_s",
            "kv_hit_rate", "prefill_queue_mean_s", "prefill_queue_imbalance", "switches", "final_split")
    head = '<tr><th class="k">Period</th><th>Span (s)</th>' + "".join(f"<th>{_e(label_of(c))}</th>" for c in cols) + "</tr>"
    body = []
    for p in periods:
        span = f"{p.get('start_s', 0):g} – {p.get('end_s', 0):g}"
        cells = "".join(f"<td>{_e(fmt_key(c, p.get(c)))}</td>" for c in cols)
        body.append(f'<tr><td class="k">{_e(p.get("name"))}</td><td>{_e(span)}</td>{cells}</tr>')
    return "<table>" + head + "".join(body) + "</table>"


def _queue_table(by_node: Mapping[str, Mapping[str, Any]]) -> str:
    head = '<tr><th class="k">Prefill node</th><th>Requests</th><th>Mean (s)</th><th>P95 (s)</th><th>Total (s)</th></tr>'
    body = "".join(
        f'<tr><td class="k">{_e(n)}</td><td>{v.get("requests")}</td><td>{_e(fmt_value(v.get("mean_s"), "s"))}</td>'
        f'<td>{_e(fmt_value(v.get("p95_s"), "s"))}</td><td>{_e(fmt_value(v.get("total_s"), "s"))}</td></tr>'
        for n, v in by_node.items()
    )
    return "<table>" + head + body + "</table>"


def _meta_list(meta: Mapping[str, Any]) -> str:
    def show(v: Any) -> str:
        if isinstance(v, (dict, list)):
            return json.dumps(v, default=str)
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    items = []
    for k in ("command", "label", "trace", "trace_source", "input", "cluster", "speedup", "arrival", "periods",
              "wall_s", "date"):
        if meta.get(k) not in (None, "", [], {}):
            items.append(f"<li><b>{_e(k)}</b>: <code>{_e(show(meta[k]))}</code></li>")
    if meta.get("argv"):
        items.append(f"<li><b>argv</b>: <code>{_e(' '.join(map(str, meta['argv'])))}</code></li>")
    return "<ul class=\"notes\">" + "".join(items) + "</ul>" if items else ""


def _notes(report: Mapping[str, Any]) -> str:
    notes = list((report.get("meta") or {}).get("notes") or []) + list(report.get("report_notes") or [])
    errs = report.get("errors") or {}
    items = [f"<li>{_e(n)}</li>" for n in notes]
    items += [f"<li>error ×{n}: <code>{_e(e)}</code></li>" for e, n in sorted(errs.items(), key=lambda kv: -kv[1])[:10]]
    return '<h2>Notes</h2><ul class="notes">' + "".join(items) + "</ul>" if items else ""


def run_page(report: Mapping[str, Any], plots: Sequence[PlotFile], *, base: Path) -> str:
    """The HTML page of one run: metadata, summary table, per-period and per-node tables, plots, notes.

    Args:
        report: a ``report.json`` dict.
        plots: the PNGs written into ``base`` (embedded in the page).
        base: directory holding the PNGs.
    """
    meta = report.get("meta") or {}
    title = f"Evolving Infra report — {meta.get('label') or meta.get('command') or 'run'}"
    parts = [f"<h1>{_e(title)}</h1>", f'<div class="sub">{_e(meta.get("date", ""))}</div>', _meta_list(meta)]
    parts.append("<h2>Summary</h2>" + _summary_table(report) + _ttft_split(report))
    if report.get("periods"):
        parts.append("<h2>Per period</h2>" + _periods_table(report["periods"], report.get("meta")))
    if report.get("prefill_queue_by_node"):
        parts.append("<h2>Prefill queue by node</h2>" + _queue_table(report["prefill_queue_by_node"]))
    if plots:
        parts.append('<h2>Plots</h2><div class="grid">' + "".join(img_tag(p, base) for p in plots) + "</div>")
    parts.append(_notes(report))
    return _page(title, "\n".join(parts))


def compare_page(
    runs: Sequence[Mapping[str, Any]],
    table: Sequence[Mapping[str, Any]],
    plots: Sequence[PlotFile],
    *,
    base: Path,
    notes: Sequence[str] = (),
) -> str:
    """The side-by-side page: runs, metric table with ratios to the first run, which way each metric is better and
    which run is, the notes to read it by, overlaid plots.

    Args:
        runs: one dict per run with ``label``, ``dir``, ``command``, ``split``, ``date``.
        table: :func:`evolving_infra.report.compare.compare_table` rows.
        plots: the PNGs written into ``base`` (embedded in the page).
        base: directory holding the PNGs.
        notes: :func:`evolving_infra.report.compare.compare_notes`, shown under the table.
    """
    labels = [str(r["label"]) for r in runs]
    title = "Evolving Infra comparison — " + " vs ".join(labels)
    cols = ("label", "dir", "command", "split", "date")
    runs_t = (
        '<table><tr><th class="k">Run</th><th class="k">Directory</th><th class="k">Command</th>'
        '<th class="k">Initial split</th><th class="k">Date</th></tr>'
        + "".join("<tr>" + "".join(f'<td class="k">{_e(r.get(c) or "")}</td>' for c in cols) + "</tr>" for r in runs)
        + "</table>"
    )
    head = '<tr><th class="k">Metric</th><th class="k">Better</th>' + "".join(
        f"<th>{_e(lab)}</th>" + (f"<th>ratio vs {_e(labels[0])}</th>" if i else "") for i, lab in enumerate(labels)
    ) + '<th class="k">Best</th></tr>'
    body = []
    for row in table:
        cells = []
        for i, (v, ratio) in enumerate(zip(row["values"], row["ratios"])):
            cells.append(f"<td>{_e(fmt_key(row['key'], v))}</td>")
            if i:
                cls = ""
                if ratio is not None and row.get("lower_is_better") is not None and ratio != 1:
                    good = (ratio < 1) == bool(row["lower_is_better"])
                    cls = ' class="better"' if good else ' class="worse"'
                cells.append(f"<td{cls}>{'-' if ratio is None else f'{ratio:.2f}x'}</td>")
        best = row.get("best")
        best_label = labels[best] if isinstance(best, int) and 0 <= best < len(labels) else ""
        body.append(f'<tr><td class="k">{_e(row["label"])}</td><td class="k">{_e(row.get("better") or "")}</td>'
                    f'{"".join(cells)}<td class="k">{_e(best_label)}</td></tr>')
    parts = [
        f"<h1>{_e(title)}</h1>",
        "<h2>Runs</h2>" + runs_t,
        "<h2>Metrics</h2>"
        f'<div class="sub">ratio = value / value of the first run ({_e(labels[0])}); green: better, red: worse.</div>'
        "<table>" + head + "".join(body) + "</table>",
    ]
    if notes:
        parts.append('<ul class="notes">' + "".join(f'<li class="warn">{_e(n)}</li>' for n in notes) + "</ul>")
    if plots:
        parts.append('<h2>Plots</h2><div class="grid">' + "".join(img_tag(p, base) for p in plots) + "</div>")
    return _page(title, "\n".join(parts))
