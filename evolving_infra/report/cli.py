"""``evolving-infra report show RUN_DIR`` and ``evolving-infra report compare RUN_DIR... [--out DIR]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from evolving_infra.stdio_args import folder
from evolving_infra.report.write import REPORT_JSON, build_report, load_run, print_summary, render_run


def cmd_show(args: argparse.Namespace) -> int:
    """Print the summary of one run and redraw its PNGs and ``report.html`` from disk. When it writes (the plots,
    ``--recompute``) it holds ``RUN_DIR`` as a run writing there does (:func:`~evolving_infra.out_folder.hold_out`):
    while a run writes to it, it stops with that run's line and exit 2. A folder this user cannot write (its lock
    cannot be made: not writable, a read-only file system) still gets its summary (recomputed, not stored, with
    ``--recompute``), then one line saying nothing was written and to use ``--no-plots``: exit 2; so does one on a
    file system without ``flock`` (:class:`~evolving_infra.out_folder.NoFlockError`)."""
    import errno

    from evolving_infra.out_folder import NoFlockError, OutFolderError, hold_out

    run_dir = Path(args.run_dir)
    writes = args.recompute or not args.no_plots
    if not writes or not run_dir.is_dir():  # reads only, or no run there (load_run says so): nothing to hold
        return _show(args, run_dir)
    from contextlib import ExitStack

    with ExitStack() as held:
        try:
            held.enter_context(hold_out(run_dir))
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                print(f"error: {run_dir}: {e}", file=sys.stderr)
                return 2
            return _show(args, run_dir, read_only=f"read-only folder ({e.strerror or e}: {e.filename or run_dir})")
        except NoFlockError as e:  # as a read-only folder: the summary, and what was not written
            return _show(args, run_dir, read_only=f"cannot be held ({e})")
        except OutFolderError as e:
            print(f"error: {run_dir}: {e}", file=sys.stderr)
            return 2
        return _show(args, run_dir)


def _show(args: argparse.Namespace, run_dir: Path, read_only: str | None = None) -> int:
    """:func:`cmd_show`'s work; returns the exit code. ``read_only``: why ``run_dir`` cannot be written, a phrase (then the
    summary alone, and exit 2: what was asked to be written was not)."""
    try:
        report, records = load_run(run_dir)
        if args.recompute:
            report = recompute(report, records)
            if read_only is None:
                (run_dir / REPORT_JSON).write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(report)
    if read_only is not None:
        unwritten = " and ".join(w for w, asked in (("the recomputed report.json", args.recompute),
                                                      ("the plots and report.html", not args.no_plots)) if asked)
        print(f"error: {run_dir}: {read_only}: {unwritten} not written; use --no-plots (the summary "
              "above is all it can show)", file=sys.stderr)
        return 2
    if not args.no_plots:
        try:
            path = render_run(run_dir, report, records)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"html: {path}")
    return 0


def recompute(report: dict, records: list) -> dict:  # type: ignore[type-arg]
    """Recompute the metrics of a stored report from its records, stored timeline, h* and meta.

    Keys the stored report has and :func:`build_report` does not produce (a
    producer's ``extra``) are kept; computed keys are refreshed over the stored
    measured window (``start_s``, ``end_s``: a live replay's own, not its records' span).

    Raises:
        ValueError: if the stored timeline is malformed.
    """
    from evolving_infra.report.timeline import timeline_from_builtins

    timeline = timeline_from_builtins(report.get("timeline"))
    window_s = float((report.get("series") or {}).get("window_s") or 60.0)
    meta = report.get("meta") or {}
    # the stored measured window: a live run's is its replay's (start → end of the replay, not first send → last
    # finish), which the records alone cannot give (demo-out: 7,772.9 s recomputed as 7,769.3 s)
    start: Any = report.get("start_s")  # JSON: checked below
    end: Any = report.get("end_s")
    known = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start, end))
    fresh = build_report(records, meta=meta, ideal_kv_hit_rate=report.get("ideal_kv_hit_rate"), timeline=timeline,
                         window_s=window_s, start=float(start) if known else None, end=float(end) if known else None)
    extra = {k: v for k, v in report.items() if k not in fresh}
    fresh.update(extra)
    return fresh


def cmd_compare(args: argparse.Namespace) -> int:
    """Write the side-by-side HTML, PNGs and table of several runs."""
    from evolving_infra.report.compare import compare_notes, format_table, input_differences, write_compare

    from contextlib import ExitStack

    from evolving_infra.out_folder import OutFolderError, hold_new_out

    out = Path(args.out)
    with ExitStack() as held:  # OUT held while it is written, as a run's: a second writer into it stops here
        try:
            hold_new_out(held, out)  # OUT made and held; taken back after the lock's release when left empty
        except (OutFolderError, OSError) as e:
            print(f"error: --out {out}: {e}", file=sys.stderr)
            return 2
        try:
            path, runs, table = write_compare([Path(d) for d in args.run_dirs], out)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(format_table([r.label for r in runs], table))
    for note in compare_notes([r.report for r in runs], [r.label for r in runs]):
        print(f"note: {note}")
    diffs = input_differences([r.report for r in runs], [r.label for r in runs])
    for d in diffs:
        print(f"warning: the runs served different inputs — {d}", file=sys.stderr)
    if diffs:
        print("warning: ratios between them (requests completed, throughput) compare different workloads or durations", file=sys.stderr)
    print(f"html: {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "report",
        help="show one run's report or compare runs side by side",
        description="Render the metrics and plots of runs written by demo, replay or simulate "
        "(RUN_DIR holds report.json and requests.jsonl).",
    )
    rs = p.add_subparsers(dest="report_command", metavar="SUBCOMMAND", required=True)
    s = rs.add_parser(
        "show",
        help="print a run's summary and redraw its plots and report.html",
        description="Print the summary of RUN_DIR/report.json and redraw RUN_DIR/*.png and RUN_DIR/report.html "
        "from report.json and requests.jsonl.",
    )
    s.add_argument("run_dir", metavar="RUN_DIR", type=folder)
    s.add_argument("--recompute", action="store_true",
                   help="recompute the metrics from requests.jsonl and rewrite report.json (keeps producer-added keys)")
    s.add_argument("--no-plots", action="store_true", help="only print the summary")
    s.set_defaults(func=cmd_show)
    c = rs.add_parser(
        "compare",
        help="side-by-side HTML, overlaid CDFs and a metric table with ratios to the first run",
        description="Compare runs: writes OUT/compare.html (self-contained), OUT/compare_*.png and OUT/compare.json; "
        "ratios are value / value of the first RUN_DIR; each metric says which way is better (lower / higher) and which run "
        "is (best). Live runs lead with the TTFT on the prefill node (queue + prefill: what the policies decide), then the "
        "client's, which adds the control plane; a note gives the control plane's measured share of the client TTFT "
        "where it is over half. A run is labelled 'FOLDER (POLICY)', POLICY its simulate --label "
        "(default its policy set), else the policy set a demo ran, else the command that made it (replay); a folder named "
        "after it (a sweep's static_4P5D) is labelled by it alone.",
    )
    c.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=folder)
    c.add_argument("--out", default="compare-out", type=folder,
                   help="output directory (default compare-out); a second writer into it while one writes there stops "
                   "before it starts (a writer holds OUT/.evolving-infra.lock)")
    c.set_defaults(func=cmd_compare)
