"""Side-by-side comparison of runs (``evolving-infra report compare RUN_DIR...``).

Reads each run's ``report.json`` + ``requests.jsonl``, and writes into the
output directory ``compare.html`` (self-contained), the comparison PNGs and
``compare.json`` (the table). Ratios are value / value of the first run, the
way the paper quotes a baseline against Evolving Infra (Figure 6, 7b/c) when
the first run is the reference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evolving_infra.report.html import compare_page, fmt_key, label_of
from evolving_infra.report.metrics import HEADLINE_METRICS, throughput_label, with_derived
from evolving_infra.report.plots import RunData, plot_compare
from evolving_infra.report.timeline import timeline_from_builtins
from evolving_infra.report.write import REPORT_JSON, load_run, not_a_run

COMPARE_HTML = "compare.html"
COMPARE_JSON = "compare.json"

INPUT_KEYS: tuple[str, ...] = (
    "trace", "agents", "tile", "max_pause_s", "arrival", "duration_s", "warmup_s", "seed", "block_size", "agent_order",
    "max_retries",
)
"""``meta`` keys that define what a run served and for how long: runs that differ in one of
them answer different questions, and their ratios (requests completed, throughput) mislead.
``max_retries``: how often a live replay sends again a request refused before any answer
(``replay --max-retries``, the demo's default 2): with 0 a router's restart loses what 2 serves."""

# Rows beyond the headline metrics: (key, lower_is_better)
_MORE_ROWS: tuple[tuple[str, bool | None], ...] = (
    ("requests_completed", False),
    ("requests_failed", True),
    ("duration_s", None),
    ("ttft_p50_s", True),
    ("ttft_node_mean_s", True),
    ("ttft_node_p95_s", True),
    ("ttft_control_plane_mean_s", None),  # the machine's latency (× --speedup), not the policy's: no best
    ("e2e_p50_s", True),
    ("split_decisions", None),
    ("split_changes", None),
    ("final_split", None),
    ("ttft_prediction_node_abs_error_median_s", True),
    ("ttft_prediction_abs_error_median_s", True),
    ("lost_kv_reuse_eviction_share", None),
    ("wall_s", None),
    ("sim_speed", None),  # how fast the machine simulated, not how well the policy served: no best
)


def run_label(folder: str, meta: Mapping[str, Any]) -> str:
    """A run's label in a comparison: ``folder (what)``, ``what`` its ``meta.label`` (``simulate``:
    ``--label``, else its policy set; ``fidelity``: live / sim), else the policy set it ran
    (``meta.policy.name``: ``demo``), else the command that made it (``replay``: the cluster's policy
    is not recorded); the folder alone when it is named after ``what`` (a sweep's ``static_4P5D``
    of ``static:4P5D``: then ``what``) or nothing names it. Before, a simulated run was labelled
    by its policy alone and a live one by its folder alone: two runs of one policy read the same,
    and a live run's policy not at all."""
    from evolving_infra.sim.sweep import safe_dir  # not at the top: it loads the simulator config (~0.1 s)

    policy = meta.get("policy")
    what = meta.get("label") or (policy.get("name") if isinstance(policy, Mapping) else None) or meta.get("command")
    if not what:
        return folder
    what = str(what)
    if safe_dir(what) == folder:  # a sweep's folder is named after its item's label
        return what
    return f"{folder} ({what})"


def load_runs(dirs: Sequence[Path]) -> list[RunData]:
    """Each run directory as :class:`RunData`, labelled by :func:`run_label`, made unique.

    Raises:
        FileNotFoundError, ValueError: as :func:`evolving_infra.report.write.load_run`.
    """
    runs: list[RunData] = []
    seen: dict[str, int] = {}
    for d in dirs:
        report, records = load_run(Path(d))
        label = run_label(Path(d).resolve().name, report.get("meta") or {})
        n = seen.get(label, 0)
        seen[label] = n + 1
        if n:
            label = f"{label} ({n + 1})"
        runs.append(RunData(label=label, report=report, records=records, timeline=timeline_from_builtins(report.get("timeline"))))
    return runs


def _ratio(v: Any, base: Any) -> float | None:
    if isinstance(v, bool) or isinstance(base, bool):
        return None
    if isinstance(v, (int, float)) and isinstance(base, (int, float)) and base != 0:
        return float(v) / float(base)
    return None


def _shows_as_zero(key: str, value: Any) -> bool:
    """Whether ``value`` prints as zero in the table (:func:`fmt_key`: no digit but 0)."""
    return isinstance(value, (int, float)) and not any(c in "123456789" for c in fmt_key(key, value))


LIVE_TTFT_FIRST: tuple[str, ...] = (
    "ttft_node_mean_s", "ttft_node_p95_s", "ttft_mean_s", "ttft_p95_s", "ttft_control_plane_mean_s",
    "ttft_control_plane_share",
)
"""The rows that lead the table when a run is live (it has ``ttft_node_mean_s``): the TTFT on the prefill
node (queue + prefill: what the serving policies decide) first, then the client's TTFT, which adds the control
plane (router, bus, dispatch, first token back; under ``--speedup N`` N × its real latency), and the control
plane's share of it. Before, ``make demo``'s comparison led with the client TTFT, where the static baseline read
ahead (10.0 vs 9.5 s) while the evolving run's on-node TTFT was the better (0.48 vs 0.81 s) nine rows below."""

_LIVE_LABELS = {
    "ttft_node_mean_s": "TTFT on node mean (queue + prefill: the policies')",
    "ttft_node_p95_s": "TTFT on node P95 (queue + prefill)",
    "ttft_mean_s": "TTFT client mean (incl. control plane × speedup)",
    "ttft_p95_s": "TTFT client P95 (incl. control plane × speedup)",
    "ttft_p50_s": "TTFT client P50 (incl. control plane × speedup)",
    "ttft_control_plane_mean_s": "TTFT control plane mean (router → node → client)",
    "ttft_control_plane_share": "Control plane share of the client TTFT",
}
"""Row labels of a comparison with a live run: which TTFT each row is."""


def control_plane_share(report: Mapping[str, Any]) -> float | None:
    """A live run's control-plane share of its mean client TTFT: ``ttft_control_plane_mean_s`` /
    ``ttft_split_client_mean_s`` (both over the requests with a node arrival, seconds), a fraction in [0, 1]
    for a sane run; None when either is absent (a simulated run, an older report) or the client mean is not
    above 0."""
    control, client = report.get("ttft_control_plane_mean_s"), report.get("ttft_split_client_mean_s")
    if not isinstance(control, (int, float)) or not isinstance(client, (int, float)) or isinstance(control, bool) \
            or isinstance(client, bool) or client <= 0:
        return None
    return float(control) / float(client)


def _direction(lower_is_better: bool | None) -> str | None:
    return None if lower_is_better is None else "lower" if lower_is_better else "higher"


def _best(key: str, values: Sequence[Any], lower_is_better: bool | None, base: Any = None) -> int | None:
    """Index of the run whose value is the better by ``lower_is_better``; None without a direction, with fewer
    than two numbers, or on a tie as the table shows it: the best value prints (:func:`fmt_key`) as another run's
    does, or its ratio to ``base`` (the first run's value, the ratio column's; None or 0: no ratio shown) prints
    (``:.2f``) as another run's does (the first run's is 1.00). Before, a KV hit rate of 89.48% / 89.50% (1.00x) /
    89.51% (1.00x) named the third run best: three values the ratio column shows as equal."""
    if lower_is_better is None:
        return None
    nums = [(i, float(v)) for i, v in enumerate(values)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v]
    if len(nums) < 2:
        return None
    i, v = (min if lower_is_better else max)(nums, key=lambda t: t[1])
    shown = fmt_key(key, v)
    if sum(1 for _, w in nums if fmt_key(key, w) == shown) > 1:
        return None
    ratio = _ratio(v, base)
    if ratio is not None and sum(1 for _, w in nums if f"{_ratio(w, base):.2f}" == f"{ratio:.2f}") > 1:
        return None
    return i


SIMULATED_TTFT = {"ttft_node_mean_s": "ttft_mean_s", "ttft_node_p95_s": "ttft_p95_s"}
"""A simulated run's on-node TTFT rows, from its TTFT: the simulator has no control plane (its TTFT is the prefill
node's arrival → first token), so in a comparison with a live run its TTFT is compared on the node rows."""


def _simulated(report: Mapping[str, Any]) -> bool:
    """Whether ``report`` is a simulated run's (``meta.command`` in :data:`SIMULATED_COMMANDS`)."""
    meta = report.get("meta")
    return isinstance(meta, Mapping) and meta.get("command") in SIMULATED_COMMANDS


def with_node_ttft(reports: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``reports`` where, when one is live (has ``ttft_node_mean_s``), each simulated run
    (:func:`_simulated`) without on-node TTFT gets it from its TTFT (:data:`SIMULATED_TTFT`). Before, a live
    run compared with a simulated one showed the simulation's TTFT only on the client rows ("+ control plane",
    which it has none of) and "-" on the on-node rows the notes say to compare on."""
    out = [dict(r) for r in reports]
    if any(r.get("ttft_node_mean_s") is not None for r in out):
        for r in out:
            if _simulated(r):
                for node, own in SIMULATED_TTFT.items():
                    if r.get(node) is None:
                        r[node] = r.get(own)
    return out


def compare_table(reports: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per metric that at least one report has.

    Each row: ``key``, ``label``, ``values`` (one per report, None where absent),
    ``ratios`` (value / first report's value; None for the first, for
    non-numbers, or when the first is None or shows as zero in the table: ``0.000 s``,
    ``0.00%``), ``lower_is_better`` (True, False, None: neither), ``better`` (the same as
    ``"lower"``, ``"higher"`` or None) and ``best`` (the index in ``reports`` of the run with the
    better value; None without a direction, with fewer than two values, or on a tie as printed).
    A first value that is not 0 but prints as 0 (a
    simulated run's TTFT prediction error, ~1e-14 s of float rounding; a lost KV reuse of
    0.0004 %) gave ratios such as ``316679000242923.00x`` and ``149.82x`` beside a ``0.000 s``
    and a ``0.00%``: a ratio to a value the table cannot tell from 0 measures nothing.

    When a report is live (has ``ttft_node_mean_s``) the rows of :data:`LIVE_TTFT_FIRST` lead, labelled by
    which TTFT they are (on node, client, control plane), with ``ttft_control_plane_share``
    (:func:`control_plane_share`, no direction: it measures the machine, not the policy) among them.
    """
    rows: list[dict[str, Any]] = []
    derived = with_node_ttft([with_derived(r) for r in reports])
    live = any(r.get("ttft_node_mean_s") is not None for r in derived)
    if live:
        for r in derived:
            r["ttft_control_plane_share"] = control_plane_share(r)
    # the throughput's unit as the summary says it: per simulated second unless every run is live at --speedup 1
    tput = throughput_label([r.get("meta") for r in derived])
    keys: list[tuple[str, str, bool | None]] = [(k, tput if k == "throughput_rps" else label, lib)
                                                 for k, label, _, lib in HEADLINE_METRICS]
    keys += [(k, label_of(k), lib) for k, lib in _MORE_ROWS]
    if live:
        lib_of = {k: lib for k, _, lib in keys} | {"ttft_control_plane_share": None}
        labels = dict(_LIVE_LABELS)
        if any(_simulated(r) for r in derived):  # its TTFT is on the node rows; the client rows hold it as it is
            labels |= {k: v.replace("(incl. control plane × speedup)", "(+ control plane; a simulation has none)")
                       for k, v in _LIVE_LABELS.items() if "(incl. control plane × speedup)" in v}
            labels["ttft_node_mean_s"] = "TTFT on node mean (queue + prefill: the policies'; a simulation's TTFT)"
            labels["ttft_node_p95_s"] = "TTFT on node P95 (queue + prefill; a simulation's TTFT P95)"
        first = [(k, labels.get(k, label_of(k)), lib_of[k]) for k in LIVE_TTFT_FIRST]
        keys = first + [(k, labels.get(k, label), lib) for k, label, lib in keys if k not in LIVE_TTFT_FIRST]
    for key, label, lib in keys:
        values = [r.get(key) if key != "wall_s" else (r.get("wall_s") or (r.get("meta") or {}).get("wall_s")) for r in derived]
        if all(v is None for v in values):
            continue
        base = None if _shows_as_zero(key, values[0]) else values[0]
        ratios = [None] + [_ratio(v, base) for v in values[1:]]
        rows.append({"key": key, "label": label, "values": values, "ratios": ratios, "lower_is_better": lib,
                     "better": _direction(lib), "best": _best(key, values, lib, base)})
    return rows


def compare_notes(reports: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> list[str]:
    """What to read a comparison by, one sentence each (``report compare`` prints them under the table,
    ``compare.json`` keeps them as ``notes``, the page shows them). For runs with a TTFT split (live): which rows
    measure the policies (on node) and which add the control plane (client); for each run whose control plane is
    more than :data:`~evolving_infra.report.write.CONTROL_PLANE_DOMINANT` of its mean client TTFT, that measured
    share, and which run the on-node TTFT favours. Empty for simulated runs (their TTFT has no control plane)."""
    from evolving_infra.report.write import CONTROL_PLANE_DOMINANT

    reports = with_node_ttft(reports)
    if not any(r.get("ttft_node_mean_s") is not None for r in reports):
        return []
    notes = ["TTFT rows: 'on node' = prefill node arrival → first token (queue + prefill: what the policies decide); "
             "'client' adds the control plane (router, bus, dispatch, first token back to the client: real latency, "
             "× the demo's --speedup)"]
    dominated = []
    for lab, r in zip(labels, reports):
        share = control_plane_share(r)
        if share is not None and share > CONTROL_PLANE_DOMINANT:
            speedup = (r.get("meta") or {}).get("speedup")
            at = f" at --speedup {speedup:g}" if isinstance(speedup, (int, float)) and not isinstance(speedup, bool) else ""
            dominated.append(f"{100 * share:.0f}% of {lab}'s mean client TTFT "
                             f"({fmt_key('ttft_mean_s', r.get('ttft_control_plane_mean_s'))} of {fmt_key('ttft_mean_s', r.get('ttft_split_client_mean_s'))}{at})")
    if simulated := [lab for lab, r in zip(labels, reports) if _simulated(r)]:
        notes.append(f"{', '.join(simulated)}: simulated; a simulation's TTFT has no control plane, it is the TTFT on "
                     "the node (its on-node rows), the row to compare with a live run's")
    if dominated:
        node = [r.get("ttft_node_mean_s") for r in reports]
        best = _best("ttft_node_mean_s", node, True, node[0] if node and node[0] else None)
        favours = (f"; on the node, {labels[best]} is the better ("
                   + " vs ".join(f"{fmt_key('ttft_node_mean_s', v)}" for v in node) + " mean)") if best is not None else ""
        notes.append("the control plane is " + "; ".join(dominated) + ": the client TTFT rows measure this machine's "
                     "load more than the policies; compare the policies on the TTFT on node (or with "
                     f"`simulate --sweep`){favours}")
    return notes


def format_table(labels: Sequence[str], table: Sequence[Mapping[str, Any]]) -> str:
    """The comparison table as fixed-width text for the terminal: per metric, which way is better
    (``lower`` / ``higher``; blank: neither), each run's value (with its ratio to the first run's) and the run
    with the better value (``best``; blank: no direction, one value, or a tie as printed)."""
    head = ["metric", "better"] + [labels[0]] + [f"{lab} (ratio)" for lab in labels[1:]] + ["best"]
    lines = [head]
    for row in table:
        cells = [row["label"], row.get("better") or ""]
        for i, (v, r) in enumerate(zip(row["values"], row["ratios"])):
            text = fmt_key(row["key"], v)
            if i and r is not None:
                text += f" ({r:.2f}x)"
            cells.append(text)
        best = row.get("best")
        cells.append(labels[best] if isinstance(best, int) and 0 <= best < len(labels) else "")
        lines.append(cells)
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


NOT_APPLICABLE = "inputs_not_applicable"
"""``meta`` key: the :data:`INPUT_KEYS` that cannot change what this run served (a live demo's
``seed``: its agents enter in trace order on a closed loop, nothing is drawn)."""

SIMULATED_COMMANDS = frozenset({"simulate", "fidelity (sim)"})
"""``meta["command"]`` of a simulated run (``sweep`` runs ``simulate``)."""

LIVE_ONLY_KEYS = frozenset({"max_retries"})
""":data:`INPUT_KEYS` that do not apply to a simulated run (:data:`SIMULATED_COMMANDS`), which
records none of them: its harness is never refused (a request no node can take waits until one
can), so a replay's ``--max-retries`` cannot change what it served. Left out of that key's check
as :data:`NOT_APPLICABLE` keys are, every simulation's report, older ones included."""


def input_differences(reports: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> list[str]:
    """One line per :data:`INPUT_KEYS` key whose ``meta`` value differs between runs that record
    it (a key no run records is skipped), naming each run's value: ``not recorded`` for a run whose
    ``meta`` lacks the key. A run that lists the key in ``meta["inputs_not_applicable"]`` is left
    out of that key's comparison (a live demo has no seed: ``seed: demo=None, sim=0`` would read as
    a missing setting), and is shown as ``n/a`` when the others differ; so is a simulated run for
    :data:`LIVE_ONLY_KEYS`.
    ``trace`` values of the same input are equal (the same header source and request count, whichever file
    held it: a ``.jsonl.gz`` and the ``.eipack`` packed from it; else the same file or a copy with the same
    bytes): :func:`trace_identities`.
    Empty when the runs served the same input for the same time."""
    out = []
    metas: list[Mapping[str, Any]] = [meta if isinstance(meta := r.get("meta"), Mapping) else {} for r in reports]
    for key in INPUT_KEYS:
        na = [key in (m.get(NOT_APPLICABLE) or ()) or (key in LIVE_ONLY_KEYS and m.get("command") in SIMULATED_COMMANDS)
              for m in metas]
        vals = [m.get(key) for m, skip in zip(metas, na) if not skip]
        if key == "trace":
            vals = trace_identities(vals, [m for m, skip in zip(metas, na) if not skip])
        if any(v is not None for v in vals) and any(v != vals[0] for v in vals[1:]):
            shown = ["n/a" if skip else m[key] if key in m else "not recorded" for m, skip in zip(metas, na)]
            out.append(f"{key}: " + ", ".join(f"{lab}={v}" for lab, v in zip(labels, shown)))
    return out


TRACE_IDENTITY_KEYS = ("trace_source", "trace_requests", "trace_block_size")
"""``meta`` keys that identify a run's input trace by its content, whichever file held it: the header's
``source``, the number of requests read and the trace's block size (``simulate`` records all three; a
``report compare`` of a run on ``cc.jsonl.gz`` and one on ``cc.eipack`` warned that they served different
inputs)."""


def trace_identities(values: Sequence[Any], metas: Sequence[Mapping[str, Any]] | None = None) -> list[Any]:
    """``meta["trace"]`` values made comparable. When every run's ``meta`` (``metas``, in the order of
    ``values``) records :data:`TRACE_IDENTITY_KEYS`, each trace is those three values (no file is read).
    Otherwise a path to an existing file becomes its resolved path (relative ones resolved against the
    current directory: ``report compare`` run where the runs were), and when those still differ, the
    SHA-256 of each file's bytes (read only then; O(file size)). Other values (``-`` for stdin, None, a file
    no longer there) are kept as they are."""
    import hashlib

    if metas is not None and len(metas) == len(values) and all(
        isinstance(m.get("trace_source"), str) and isinstance(m.get("trace_requests"), int) for m in metas
    ):
        return [None if v is None else tuple(m.get(k) for k in TRACE_IDENTITY_KEYS) for v, m in zip(values, metas)]

    paths: list[Path | None] = []
    for v in values:
        p = Path(v) if isinstance(v, str) and v not in ("", "-") else None
        paths.append(p.resolve() if p is not None and p.is_file() else None)
    out: list[Any] = [str(p) if p is not None else v for p, v in zip(paths, values)]
    if len({str(p) for p in paths if p is not None}) > 1:
        digests: dict[Path, str] = {}
        for i, p in enumerate(paths):
            if p is not None:
                if p not in digests:
                    with open(p, "rb") as f:
                        digests[p] = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
                out[i] = digests[p]
    return out


COMPARE_PLOTS = ("compare_ttft_cdf.png", "compare_e2e_cdf.png", "compare_metrics.png", "compare_throughput.png",
                 "compare_split_timeline.png")
"""Every PNG :func:`~evolving_infra.report.plots.plot_compare` may draw."""


def write_compare(dirs: Sequence[Path], out: Path, *, plots: bool = True) -> tuple[Path, list[RunData], list[dict[str, Any]]]:
    """Compare run directories; write ``compare.html``, ``compare.json`` and the PNGs into ``out``
    (``plots`` False: no PNGs, the page has the table only; ``simulate --sweep --no-plots``).

    Returns:
        ``(html path, runs, table)``.

    Raises:
        ValueError: if fewer than two directories are given, or a run is malformed.
        FileNotFoundError: if a directory has no ``report.json``.
    """
    if len(dirs) < 2:
        lone = Path(dirs[0]) if dirs else None  # a sweep's --out given alone: name its runs
        why = f" ({not_a_run(lone)})" if lone is not None and not (lone / REPORT_JSON).is_file() else ""
        raise ValueError(f"report compare needs at least two run directories{why}")
    runs = load_runs(dirs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = compare_table([r.report for r in runs])
    if (out / COMPARE_JSON).is_file():  # an earlier comparison's plots here would not be this one's; without
        for name in COMPARE_PLOTS:       # its compare.json the folder is not one (`--out .`): a user's files stay
            (out / name).unlink(missing_ok=True)
    figs = plot_compare(out, runs) if plots else []
    info = []
    for d, r in zip(dirs, runs):
        meta = r.report.get("meta") or {}
        cluster = c if isinstance(c := meta.get("cluster"), Mapping) else {}
        info.append({"label": r.label, "dir": str(d), "command": meta.get("command"),
                     "split": cluster.get("split"), "date": meta.get("date")})
    diffs = input_differences([r.report for r in runs], [r.label for r in runs])
    notes = compare_notes([r.report for r in runs], [r.label for r in runs])
    (out / COMPARE_JSON).write_text(
        json.dumps({"runs": info, "input_differences": diffs, "metrics": table, "notes": notes,
                    "plots": [p.file for p in figs]}, indent=2, default=str)
        + "\n"
    )
    html_path = out / COMPARE_HTML
    html_path.write_text(compare_page(info, table, figs, base=out, notes=notes), encoding="utf-8")
    return html_path, runs, table
