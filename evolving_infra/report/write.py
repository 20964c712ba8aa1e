"""``report.json`` + ``requests.jsonl`` + a terminal summary for one run.

Every command that produces a report (``demo``, ``replay``, later ``simulate``)
calls :func:`write_report` with its records and the run's settings. Times in
the report are simulated seconds; ``wall_s`` is the run's wall-clock time.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from evolving_infra.report.metrics import fmt_seconds, summarize
from evolving_infra.report.records import RequestRecord, write_records


def build_report(
    records: Sequence[RequestRecord],
    *,
    meta: Mapping[str, Any],
    ideal_kv_hit_rate: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report dict: headline metrics, agent structure counts, run metadata."""
    report: dict[str, Any] = dict(summarize(records, ideal_kv_hit_rate=ideal_kv_hit_rate))
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
    if extra:
        report.update(extra)
    report["meta"] = dict(meta)
    return report


def write_report(out_dir: Path, report: Mapping[str, Any], records: Sequence[RequestRecord]) -> Path:
    """Write ``report.json`` and ``requests.jsonl`` into ``out_dir``; returns the report path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    write_records(out_dir / "requests.jsonl", records)
    return path


def print_summary(report: Mapping[str, Any], file: TextIO = sys.stdout) -> None:
    """Human-readable summary of a report."""
    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    lines = [
        f"requests   sent {report['requests_sent']}  completed {report['requests_completed']}  failed {report['requests_failed']}",
        f"sessions   {report['sessions']}  (sub-agent branches {report['subagent_branches']}, branches {report['branches']})",
        f"duration   {fmt_seconds(report['duration_s'])} simulated"
        + (f", {report['meta'].get('wall_s', 0):.1f} s wall" if report.get("meta", {}).get("wall_s") else ""),
        f"throughput {report['throughput_rps']:.3f} req/s" if report.get("throughput_rps") else "throughput -",
        f"TTFT       mean {fmt_seconds(report['ttft_mean_s'])}  p50 {fmt_seconds(report['ttft_p50_s'])}  p95 {fmt_seconds(report['ttft_p95_s'])}",
        f"E2E        mean {fmt_seconds(report['e2e_mean_s'])}  p95 {fmt_seconds(report['e2e_p95_s'])}",
        f"TPOT       mean {fmt_seconds(report['tpot_mean_s'])}",
        f"KV hit     {pct(report['kv_hit_rate'])}  (ideal {pct(report.get('ideal_kv_hit_rate'))}, lost KV reuse {pct(report.get('lost_kv_reuse'))})",
    ]
    for note in report.get("meta", {}).get("notes", []):
        lines.append(f"note       {note}")
    if report.get("errors"):
        for err, n in sorted(report["errors"].items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"error      {n}× {err}")
    print("\n".join(lines), file=file)
