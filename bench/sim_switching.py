"""Phase switches on real Claude Code sessions: the decoupled data plane vs relaunch vs strand.

Issue 6 part 5 must-show (paper Figure 3a, §3.1, Appendix C.1): with a forced
split change every 10 simulated minutes (4P5D ↔ 5P4D, the nodes that change
chosen by the fewest-changes rule), the lost KV reuse ``1 − h/h*`` and the mean
switch time (decision → serving the new phase) of

* ``decoupled`` — Evolving Infra's in-place switch with the shared pool (drain in
  place, queued requests re-routed, KV kept and readable by every prefill node);
* ``relaunch`` — Dynamo-like (drain, out of service ``--relaunch-s`` = 750 s, KV lost);
* ``strand`` — Arrow-like (drain, switch in place, KV stranded = lost).

The paper reports 0.3% vs 5.1% vs 55.5% lost KV reuse and 0.7–19 s vs ~700 s per
switch (for the full systems with their own planners; here every mode gets the
same forced switches). Every run uses the same routing and engines: cache-aware
prefill routing (SGLang Model Gateway), round-robin decode, LRU host eviction,
decode bound at prefill start; only the switch mechanics (and, with them, the data
plane: ``decoupled`` fetches prefixes other nodes hold while a request queues) differ.
Two references without switches separate what the switches cost from what the
data plane gives in steady state: ``static (local KV)`` and ``static + pool``.

Appends a section to ``bench/RESULTS-history.md`` and a figure to ``bench/figures/``.

    python bench/sim_switching.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from _common import commit_label, rechained  # noqa: E402
RESULTS = REPO / "bench" / "RESULTS-history.md"
FIGURES = REPO / "bench" / "figures"
SHARED_CC = REPO.parent / "shared" / "traces" / "claude-code-weka"
PAPER = {"decoupled": ("0.3%", "0.7–19 s"), "relaunch": ("5.1%", "~700 s (681 s CC)"), "strand": ("55.5%", "≈0 (in place)")}

_W: dict[str, Any] = {}
"""Trace handed to forked workers (loaded once in the parent)."""


def log(msg: str) -> None:
    print(msg, flush=True)


def load_cc(cache: Path) -> tuple[list[Any], int]:
    from evolving_infra.traces.io import read_trace

    cc = cache / "claude_code_real.jsonl.gz"
    if not cc.exists():
        if not SHARED_CC.exists():
            raise SystemExit(f"{SHARED_CC} not found: the real Claude Code sessions are needed")
        cache.mkdir(parents=True, exist_ok=True)
        log("converting the real Claude Code sessions ...")
        subprocess.run([sys.executable, "-m", "evolving_infra.cli", "trace", "convert", "--from", "claude-code-weka",
                        str(SHARED_CC), "-o", str(cc), "--no-progress"], cwd=REPO, check=True)
    tr = read_trace(cc)
    return rechained(tr.requests), tr.header.block_size


def _run(item: tuple[str, Any, str]) -> dict[str, Any]:
    from evolving_infra.report.write import write_report
    from evolving_infra.sim.run import simulate

    label, cfg, out = item
    t0 = time.monotonic()
    res = simulate(cfg, _W["reqs"], _W["bs"], meta={"trace": "claude-code-weka (530 real sessions)"})
    write_report(Path(out) / label.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "pool"),
                 res.report, res.records, plots=False)
    rep = res.report
    keep = ("throughput_rps", "ttft_mean_s", "ttft_p95_s", "e2e_mean_s", "kv_hit_rate", "ideal_kv_hit_rate", "lost_kv_reuse",
            "switches", "switch_time_mean_s", "switch_drain_mean_s", "switch_downtime_mean_s", "switch_downtime_node_s",
            "switch_requeued", "switch_unique_host_share", "out_of_service_node_s", "out_of_service_share", "relaunches",
            "requests_completed", "requests_unfinished", "requests_failed", "simulated_s", "split_timeline", "sim_stats")
    row = {k: rep.get(k) for k in keep}
    row["switch_log"] = rep.get("switch_log") or []
    row["series_t"] = rep["series"]["t_s"]
    row["series_lost"] = rep["series"].get("lost_kv_reuse")
    row["label"] = label
    row["wall_s"] = time.monotonic() - t0
    return row


def configs(a: argparse.Namespace) -> list[tuple[str, Any]]:
    from dataclasses import replace

    from evolving_infra.sim.config import SimConfig

    base = SimConfig(
        nodes=9, policy=f"static:{a.split}", decode_binding="prefill-start", concurrency=a.agents, max_pause_s=30.0,
        block_size=512, duration_s=a.warmup + a.measure, warmup_s=a.warmup, seed=1, relaunch_s=750.0,
        host_capacity_tokens=a.host_capacity_tokens,
    )
    sw = dict(switch_every_s=a.period, switch_to=a.switch_to)
    return [
        ("decoupled", replace(base, switch_mode="decoupled", label="decoupled", **sw)),
        ("relaunch", replace(base, switch_mode="relaunch", label="relaunch", **sw)),
        ("strand", replace(base, switch_mode="strand", label="strand", **sw)),
        ("static (local KV)", replace(base, label="static (local KV)")),
        ("static + pool", replace(base, switch_mode="decoupled", label="static + pool")),
    ] + [
        # diagnostic: Arrow's switching frequency (34 switches in the paper's run) with the same mechanics
        (f"{m}, every {a.diag_period:.0f} s", replace(base, switch_mode=m, label=f"{m}@{a.diag_period:.0f}s",
                                                       switch_every_s=a.diag_period, switch_to=a.switch_to))
        for m in ("decoupled", "strand") if a.diag_period
    ]


def figure(rows: list[dict[str, Any]], warmup: float, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(2, 1, figsize=(8, 5.2), sharex=True, gridspec_kw={"height_ratios": [1, 1.4]})
    colors = {"decoupled": "tab:green", "relaunch": "tab:red", "strand": "tab:orange"}
    for r in rows:
        c = colors.get(r["label"])
        if c is None:
            continue
        pts = r["split_timeline"] or []
        xs, ys = [], []
        for t, s in pts:
            p = int(s.upper().split("P")[0]) if "P" in s.upper() else None
            if p is None:
                continue
            xs.append(t / 60)
            ys.append(p)
        if xs:
            xs.append(r["simulated_s"] / 60)
            ys.append(ys[-1])
            ax[0].step(xs, ys, where="post", color=c, label=r["label"])
        for d in r["switch_log"]:
            ax[0].plot([d["drained_at"] / 60, d["served_at"] / 60], [3.6, 3.6], color=c, linewidth=4, alpha=0.6)
        if r["series_lost"]:
            ax[1].plot([t / 60 for t in r["series_t"]], [100 * (v or 0) for v in r["series_lost"]], color=c, label=r["label"],
                       linewidth=1)
    ax[0].set_ylabel("prefill nodes\n(bars: out of service)")
    ax[0].legend(fontsize=8, loc="upper right")
    ax[1].set_ylabel("lost KV reuse per min (%)")
    ax[1].set_xlabel("simulated minutes (warm-up excluded from the metrics: " + f"{warmup / 60:.0f} min)")
    for a_ in ax:
        a_.axvline(warmup / 60, color="grey", linestyle=":", linewidth=1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def pct(v: float | None, nd: int = 2) -> str:
    return "-" if v is None else f"{100 * v:.{nd}f}%"


def num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def main(argv: list[str] | None = None) -> int:
    import gc
    import multiprocessing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 min warm-up and 30 min measured (default 20 + 60)")
    ap.add_argument("--agents", type=int, default=90, help="concurrent agents (default 90, the paper's §3 setting)")
    ap.add_argument("--split", default="4P5D", help="initial split (default 4P5D, CC's best static split)")
    ap.add_argument("--switch-to", default="5P4D", help="the other split (default 5P4D)")
    ap.add_argument("--period", type=float, default=600.0, help="seconds between forced switches (default 600)")
    ap.add_argument("--diag-period", type=float, default=120.0,
                    help="also run decoupled and strand with a switch every this many seconds (0 = skip; default 120)")
    ap.add_argument("--host-capacity-tokens", type=int, default=None, help="per-node L2 (default: the profile's 8.24M)")
    ap.add_argument("--workers", type=int, default=2, help="runs in parallel (default 2)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "ei-sim-bench"), help="trace cache directory")
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "ei-sim-switching"), help="run directories")
    ap.add_argument("--no-append", action="store_true", help="print only")
    ap.add_argument("--from-summary", action="store_true", help="format the runs saved in OUT/summary_<mode>.json again")
    a = ap.parse_args(argv)
    a.warmup, a.measure = (600.0, 1800.0) if a.quick else (1200.0, 3600.0)
    t0 = time.monotonic()
    mode = ("quick" if a.quick else "full") + (f"_host{a.host_capacity_tokens}" if a.host_capacity_tokens else "")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    summary = Path(a.out) / f"summary_{mode}.json"
    if a.from_summary:
        rows = json.loads(summary.read_text())
    else:
        reqs, bs = load_cc(Path(a.cache))
        gc.freeze()
        _W.update(reqs=reqs, bs=bs)
        items = [(lab, cfg, a.out) for lab, cfg in configs(a)]
        log(f"{len(items)} runs, {a.agents} agents, {a.warmup + a.measure:.0f} s simulated each, {a.workers} workers")
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=a.workers, mp_context=ctx) as pool:
            rows = []
            for r in pool.map(_run, items):
                log(f"  {r['label']}: lost KV reuse {pct(r['lost_kv_reuse'])}, switches {r['switches']}, "
                    f"switch time {num(r['switch_time_mean_s'])} s, {r['wall_s']:.0f} s wall")
                rows.append(r)
        summary.write_text(json.dumps(rows, indent=1, default=str))
    by = {r["label"]: r for r in rows}
    fig_name = f"sim_switching_{mode}.png"
    drew = figure(rows, a.warmup, FIGURES / fig_name)
    cmd = "python bench/sim_switching.py" + (" --quick" if a.quick else "")
    if a.host_capacity_tokens:
        cmd += f" --host-capacity-tokens {a.host_capacity_tokens}"
    lines = [
        f"## simulator: phase switches on real Claude Code — decoupled vs relaunch vs strand ({mode}) — "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- command: `{cmd}`; commit {commit_label(REPO)}; machine: {platform.machine()}, "
        f"{os.cpu_count()} shared CPUs, load average {os.getloadavg()[0]:.1f} at the end; total wall {time.monotonic() - t0:.0f} s",
        f"- workload: all 530 real Claude Code sessions (`claude-code-weka`), closed loop {a.agents} agents, pauses ≤ 30 s, "
        f"512-token blocks, seed 1; 9 nodes × 4 GB300 (`gb300-glm52`, L1 2.06M / L2 "
        f"{(a.host_capacity_tokens or 8_240_000) / 1e6:.2f}M tokens per node); {a.warmup:.0f} s warm-up, "
        f"{a.measure:.0f} s measured (metrics over requests sent after the warm-up; switch counts and times over all switches)",
        f"- forced switch every {a.period:.0f} s: {a.split} ↔ {a.switch_to} (first at {a.period:.0f} s), nodes by "
        "`shared.split.assign_min_change` among the nodes not already switching; relaunch downtime 750 s (longer than the "
        "period: a relaunching node is skipped and another one changes, so up to two nodes are out at once); in-place "
        "control time 0 s (the live sim engine measures 1–6 ms)",
        f"- same for every run: cache-aware prefill routing, round-robin decode, LRU host eviction, decode bound at prefill "
        f"start (`--policy static:{a.split} --decode-binding prefill-start`); `decoupled` adds the shared pool (pool fetch "
        "plans, `sim_stats.pool_fetch_plans`); `static + pool` = the same data plane without switches",
        "",
        "| run | lost KV reuse | paper | switches | mean switch time s (min–max) | paper | drain / out of service per switch s "
        "| node-s out of service | requeued | switched node's L2 unique | req/s | TTFT mean / P95 s | pool fetches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lab = r["label"]
        pl, pt = PAPER.get(lab, ("-", "-"))
        sws = [d["switch_s"] for d in r["switch_log"]]
        rng = f" ({min(sws):.1f}–{max(sws):.1f})" if sws else ""
        lines.append(
            f"| {lab} | {pct(r['lost_kv_reuse'])} | {pl} | {r['switches']} | {num(r['switch_time_mean_s'])}{rng} | {pt} | "
            f"{num(r['switch_drain_mean_s'])} / {num(r['switch_downtime_mean_s'])} | {num(r['switch_downtime_node_s'], '.0f')} | "
            f"{r['switch_requeued']} | {pct(r['switch_unique_host_share'], 0)} | {num(r['throughput_rps'], '.3f')} | "
            f"{num(r['ttft_mean_s'], '.2f')} / {num(r['ttft_p95_s'], '.2f')} | {r['sim_stats']['pool_fetch_plans']} |"
        )
    lines += ["", "Switches per run (node, from → to, decided at, drain s, out of service s, queued requests re-routed, "
              "L2 blocks unique to the node at the decision / all):", ""]
    for r in rows:
        if not r["switch_log"] or "every" in r["label"]:
            continue
        parts = [f"{d['node']} {d['from'][0].upper()}→{d['to'][0].upper()} @{d['decided_at']:.0f} s: "
                 f"{d['drain_s']:.1f} + {d['downtime_s']:.0f} s, {d['requeued']} req, "
                 f"{d['unique_host_blocks']}/{d['host_blocks']}" for d in r["switch_log"]]
        lines.append(f"- {r['label']}: " + "; ".join(parts))
    if drew:
        lines += ["", f"![split and lost KV reuse over time](figures/{fig_name})"]
    dec, rel, strd = by["decoupled"], by["relaunch"], by["strand"]
    loc, pool = by["static (local KV)"], by["static + pool"]
    lines += ["", "Lost KV reuse attributable to the switches (run − its no-switch reference, same data plane): "
              f"decoupled {pct((dec['lost_kv_reuse'] or 0) - (pool['lost_kv_reuse'] or 0))}, "
              f"relaunch {pct((rel['lost_kv_reuse'] or 0) - (loc['lost_kv_reuse'] or 0))}, "
              f"strand {pct((strd['lost_kv_reuse'] or 0) - (loc['lost_kv_reuse'] or 0))}"
              + "".join(f"; {r['label']} {pct((r['lost_kv_reuse'] or 0) - ((pool if r['label'].startswith('decoupled') else loc)['lost_kv_reuse'] or 0))}"
                        for r in rows if "every" in r["label"]) + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_append:
        with open(RESULTS, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
