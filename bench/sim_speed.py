"""Simulator speed: simulated seconds per wall second, and wall time at 3,072 GPUs.

Two scale targets (issue 4):

* ``9x4``: 9 nodes × 4 GPUs (gb300-glm52) serving 126 concurrent Claude-Code-like
  agents (``trace generate claude-code``, pauses capped at 30 s as in the paper's
  runs) for one simulated hour under ``static:4P5D``; target ≥ 1000× real time.
  Medians of repeated runs; also the same hour at the profile's 64-token blocks
  (one run) for the speed/accuracy trade-off of ``--block-size 512``.
* ``3072``: 768 nodes × 4 GPUs in 8 partitions, ~30,720 agents (``--tile``), one
  simulated hour on 2 worker processes; target ≤ 30 min. ``--quick`` runs one
  96-node partition (3,840 agents) for 10 simulated minutes and extrapolates
  (× 6 for the hour, × 8 partitions / 2 workers), marked as an extrapolation.

Every run is the real command (``evolving-infra simulate ... --no-plots``) in a
fresh process, so wall time and peak memory (``ru_maxrss`` of the process and
its partition workers) are per run. Appends a section to ``bench/RESULTS-history.md``.

    python bench/sim_speed.py --quick      # ~5 min on 2 shared cores
    python bench/sim_speed.py              # full: the 3,072-GPU hour takes ~1 h of 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from _common import commit_label  # noqa: E402
RESULTS = REPO / "bench" / "RESULTS-history.md"
CLI = [sys.executable, "-m", "evolving_infra.cli"]


def make_trace(path: Path, agents: int, block_size: int, seed: int = 1) -> Path:
    """A Claude-Code-like trace (cached by name)."""
    if path.exists():
        return path
    from evolving_infra.traces.generate import generate
    from evolving_infra.traces.io import write_trace

    tr = generate("claude-code", seed=seed, agents=agents, block_size=block_size)
    write_trace(path, tr.header, tr.requests)
    return path


def run(args: list[str], out: Path) -> dict:
    """One ``evolving-infra simulate`` run; returns its report."""
    cmd = CLI + ["simulate", *args, "--out", str(out), "--no-plots"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if p.returncode not in (0, 1):
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    rep = json.loads((out / "report.json").read_text())
    rep["process_wall_s"] = wall
    return rep


def machine() -> str:
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}, "
            f"load average {load:.1f} at the end (shared VM: other jobs run on the same cores)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs; the 3,072-GPU hour is extrapolated from one partition")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of the 9x4 run (default 3, quick 2)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "ei-sim-bench"), help="trace cache directory")
    ap.add_argument("--no-append", action="store_true", help="print only; do not append to bench/RESULTS-history.md")
    ap.add_argument("--skip-3072", action="store_true", help="only the 9x4 target")
    a = ap.parse_args(argv)
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    repeats = a.repeats or (2 if a.quick else 3)
    hour = 3600.0
    rows: list[tuple[str, str, str, str]] = []
    notes: list[str] = []

    # ---------------------------------------------------------------- 9 x 4, 126 agents
    t512 = make_trace(cache / "cc500_512.jsonl.gz", 500, 512)
    base = ["--trace", str(t512), "--nodes", "9", "--policy", "static:4P5D", "--concurrency", "126", "--max-pause", "30",
            "--block-size", "512", "--duration", str(hour)]
    reps = []
    for i in range(repeats):
        r = run(base, cache / f"run9_{i}")
        reps.append(r)
        print(f"9x4 run {i}: {r['simulated_s']:.0f} s simulated in {r['wall_s']:.1f} s ({r['sim_speed']:.0f}x), "
              f"loop {r['sim_wall_s']:.1f} s, {r['requests_completed']} requests, peak {r['peak_rss_mb']:.0f} MiB", flush=True)
    speed = statistics.median(r["sim_speed"] for r in reps)
    loop_speed = statistics.median(r["simulated_s"] / r["sim_wall_s"] for r in reps)
    wall = statistics.median(r["wall_s"] for r in reps)
    per_req = statistics.median(1000 * r["sim_wall_s"] / max(1, r["sim_stats"]["routed"]) for r in reps)
    rss = max(r["peak_rss_mb"] for r in reps)
    r0 = reps[0]
    rows += [
        ("9×4 GPUs, 126 CC agents, 1 h, 512-token blocks: sim speed, sim s / wall s (target ≥ 1000)",
         f"{speed:.0f}", f"{speed / 1000:.2f} of target", f"median of {repeats}; wall {wall:.1f} s incl. trace load"),
        ("same, simulation loop only (trace loaded), sim s / wall s", f"{loop_speed:.0f}", f"{loop_speed / 1000:.2f} of target",
         f"{per_req:.2f} ms of wall per routed request"),
        ("same, peak RSS MiB", f"{rss:.0f}", "", f"{r0['requests_completed']} requests, {r0['throughput_rps']:.2f} req/s, "
         f"TTFT {r0['ttft_mean_s']:.2f} s, E2E {r0['e2e_mean_s']:.2f} s"),
    ]
    if not a.quick:
        t64 = make_trace(cache / "cc500_64.jsonl.gz", 500, 64)
        r64 = run(["--trace", str(t64), *base[2:-4], "--duration", str(hour)], cache / "run9_64")
        rows += [
            ("same at 64-token blocks (profile default): sim speed", f"{r64['sim_speed']:.0f}",
             f"{r64['sim_speed'] / speed:.2f}× of 512", "one run"),
            ("64 vs 512 blocks: throughput / mean TTFT / mean E2E / KV hit (ratio 512÷64)",
             f"{r64['throughput_rps']:.3f} / {r64['ttft_mean_s']:.2f} / {r64['e2e_mean_s']:.2f} / {r64['kv_hit_rate']:.4f}",
             f"{r0['throughput_rps'] / r64['throughput_rps']:.3f} / {r0['ttft_mean_s'] / r64['ttft_mean_s']:.3f} / "
             f"{r0['e2e_mean_s'] / r64['e2e_mean_s']:.3f} / {r0['kv_hit_rate'] / r64['kv_hit_rate']:.4f}",
             "the accuracy cost of --block-size 512"),
            ("64-token blocks: peak RSS MiB", f"{r64['peak_rss_mb']:.0f}", "", ""),
        ]

    # ---------------------------------------------------------------- 3,072 GPUs
    if not a.skip_3072:
        if a.quick:
            dur = 600.0
            big = ["--trace", str(t512), "--nodes", "96", "--policy", "static:48P48D", "--concurrency", "3840", "--tile", "16",
                   "--max-pause", "30", "--block-size", "512", "--duration", str(dur)]
            rb = run(big, cache / "run3072_part")
            est = rb["wall_s"] * (hour / dur) * 8 / 2
            rows += [
                ("3,072 GPUs, 1 h, 2 cores: wall min (target ≤ 30) — EXTRAPOLATED", f"{est / 60:.1f}", f"{est / 1800:.2f} of target",
                 f"one 96-node partition, 3,840 agents, {dur:.0f} s simulated in {rb['wall_s']:.1f} s; × {hour / dur:.0f} × 8 partitions ÷ 2 workers"),
                ("one partition: peak RSS MiB", f"{rb['peak_rss_mb']:.0f}", "",
                 f"2 workers hold 2 partitions at once: ≈ {2 * rb['peak_rss_mb'] / 1024:.1f} GiB; {rb['sim_stats']['routed']} requests routed, "
                 f"{rb['requests_completed']} completed, TTFT {rb['ttft_mean_s']:.0f} s (cold start of 3,840 agents)"),
            ]
            notes.append("3,072-GPU figure extrapolated from one partition's first 10 simulated minutes (cold start included); "
                         "run `python bench/sim_speed.py` for the measured hour")
        else:
            big = ["--trace", str(t512), "--nodes", "768", "--partitions", "8", "--workers", "2", "--policy", "static:48P48D",
                   "--concurrency", "30720", "--tile", "123", "--max-pause", "30", "--block-size", "512", "--duration", str(hour)]
            rb = run(big, cache / "run3072")
            rows += [
                ("3,072 GPUs (768 nodes, 8 partitions, 30,720 agents), 1 h, 2 workers: wall min (target ≤ 30)",
                 f"{rb['wall_s'] / 60:.1f}", f"{rb['wall_s'] / 1800:.2f} of target", f"{rb['sim_stats']['routed']} requests routed"),
                ("peak RSS MiB (parent + largest worker)", f"{rb['peak_rss_mb']:.0f}", "", ""),
            ]

    mode = "quick" if a.quick else "full"
    cmd = "python bench/sim_speed.py" + (" --quick" if a.quick else "")
    lines = [
        f"## simulator speed ({mode}) — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- command: `{cmd}`",
        f"- commit: {commit_label(REPO)}",
        f"- machine: {machine()}",
        "- workload: `trace generate claude-code --agents 500 --seed 1 --block-size 512`, `--max-pause 30`, closed loop",
        *[f"- note: {n}" for n in notes],
        "",
        "| metric | value | vs target / ratio | notes |",
        "|---|---|---|---|",
        *[f"| {m} | {v} | {t} | {n} |" for m, v, t, n in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not a.no_append:
        with open(RESULTS, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
