"""Agent-aware host eviction vs LRU in the simulator on real Claude Code sessions (paper §4.3,
§5.3, Appendix C.1; issue 5).

9 nodes × 4 GB300 (``gb300-glm52``) at the fixed split 4P5D with SGLang PD behaviour
(``--policy static:4P5D``: cache-aware prefill routing — the SGLang Model Gateway's —,
round-robin decode, decode KV reserved at dispatch, no switches, no shared pool: each
prefill node reuses only its own L1/L2), real Claude Code sessions
(``/work/shared/traces/claude-code-weka``, all 530, 90 agents in a closed loop entering in
shuffled orders, ``--agent-order shuffled --seed k``: medians over the orders), 512-token
blocks. Three things vary:

* the pauses: capped at 30 s (``--max-pause 30``, the paper's CC load: its runs report
  12.9–18.6 s mean pauses) or as recorded (tool calls and users away: p50 10 s, mean 154 s,
  p99 47 min). A branch-count policy keeps what a *waiting* branch will read again; with
  every pause ≤ 30 s no branch waits long, so most of what LRU evicts first is already
  unreferenced and the two orders nearly coincide — the recorded pauses are where they differ;

* the host (L2) capacity per node, ``--host-capacity-tokens``, swept from "just
  overflowing" (evictions happen, LRU still loses nothing to them) to "heavily" (the KV that
  active branches reference no longer fits); the profile's own is 8.25M tokens, its L1
  2.06M (L2 ⊇ L1: write-through pins L1's pages in L2);
* ``--eviction lru`` vs ``branch-count`` (paper §5.3: key ``(1[R_b > 0], T_b)`` with the KV
  directory's counts R pushed to the engines).

Reported per run: lost KV reuse 1 − h/h* and its Appendix C.1 split (eviction: the request ran
on its branch's previous prefill node; routing: another node; unattributed: a branch's first
request), the prefill nodes' host evictions of zero- vs positive-count blocks (counts from the
directory, which tracks branches under both policies), throughput, mean/P95 TTFT, and the KV
that active branches reference per prefill node (mean/max, sampled at every send). Target
(issue 5): branch-count's lost KV reuse ≤ ½ of LRU's at the same capacity (a capacity where
under 10% of LRU's lost reuse is due to eviction has no eviction pressure: n/a). A plot goes to
``bench/figures/``; a section is appended to ``bench/RESULTS-history.md``.

    python bench/sim_eviction.py --quick           # 3 capacities, 1 order, 1,500 s (600 s warm-up)
    python bench/sim_eviction.py --workers 2       # 6 capacities + the profile's, 3 orders, 2,400 s (600 s warm-up)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
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
SEED = 1
BLOCK = 512
AGENTS = 90
WARMUP = 600.0
POLICIES = ("lru", "branch-count")
HOSTS_FULL = (None, 6_000_000, 5_500_000, 5_000_000, 4_500_000, 4_000_000, 3_000_000)
"""Host capacities (tokens per node); None = the profile's (8.25M, no pressure: the reference)."""
HOSTS_QUICK = (6_000_000, 5_000_000, 4_000_000)


def log(msg: str) -> None:
    print(msg, flush=True)


def load_trace(cache: Path) -> tuple[list[Any], int]:
    """The real Claude Code sessions at 512-token blocks (converted once, cached)."""
    import msgspec

    from evolving_infra.sim.run import convert_block_size
    from evolving_infra.traces.io import read_trace, write_trace

    small = cache / f"claude_code_real_{BLOCK}.jsonl.gz"
    if not small.exists():
        cc = cache / "claude_code_real.jsonl.gz"
        if not cc.exists():
            if not SHARED_CC.exists():
                raise SystemExit(f"{SHARED_CC} not found: the real Claude Code sessions are needed")
            log("converting the real Claude Code sessions ...")
            subprocess.run([sys.executable, "-m", "evolving_infra.cli", "trace", "convert", "--from", "claude-code-weka",
                            str(SHARED_CC), "-o", str(cc), "--no-progress"], cwd=REPO, check=True)
        tr = read_trace(cc)
        log(f"re-chunking to {BLOCK}-token blocks (cached in {small}) ...")
        reqs = convert_block_size(tr.requests, tr.header.block_size, BLOCK)  # what simulate() would do
        write_trace(small, msgspec.structs.replace(tr.header, block_size=BLOCK), reqs)
    tr = read_trace(small)
    return rechained(tr.requests), tr.header.block_size


def config(host: int | None, eviction: str, duration: float, pause: float | None = 30.0, seed: int = SEED) -> Any:
    from evolving_infra.sim.config import SimConfig

    # a node holds whole blocks (Profile.host_blocks floors): the capacity given in whole blocks, as simulate takes it
    whole = None if host is None else host - host % BLOCK
    return SimConfig(nodes=9, policy="static:4P5D", eviction=eviction, host_capacity_tokens=whole, concurrency=AGENTS,
                     max_pause_s=pause, block_size=BLOCK, duration_s=duration, warmup_s=WARMUP, seed=seed,
                     agent_order="shuffled", label=f"{eviction}@{host or 'profile'}")


NO_PRESSURE_SHARE = 0.10
"""Below this share of LRU's lost KV reuse attributed to eviction (App. C.1), a capacity has no
eviction pressure: its verdict says n/a instead of met / MISSED."""

KEYS = ("lost_kv_reuse", "lost_kv_reuse_eviction_share", "lost_kv_reuse_routing_share", "lost_kv_reuse_unattributed_share",
        "lost_kv_reuse_tokens", "kv_hit_rate", "ideal_kv_hit_rate", "throughput_rps", "ttft_mean_s", "ttft_p95_s",
        "e2e_mean_s", "requests_completed", "host_evictions", "host_evictions_positive_share",
        "counted_kv_tokens_per_prefill_node_mean", "counted_kv_tokens_per_prefill_node_max", "simulated_s")

_FORK: dict[str, Any] = {}


def _run(i: int) -> dict[str, Any]:
    pause, host, ev, seed = _FORK["runs"][i]
    return run_one(pause, host, ev, seed, _FORK["reqs"], _FORK["bs"], _FORK["duration"], _FORK["out"])


def run_one(pause: float | None, host: int | None, ev: str, seed: int, reqs: list[Any], bs: int, duration: float,
            out: Path) -> dict[str, Any]:
    from evolving_infra.report.write import write_report
    from evolving_infra.sim.run import simulate

    t0 = time.monotonic()
    cfg = config(host, ev, duration, pause, seed)
    res = simulate(cfg, reqs, bs, meta={"bench": "sim_eviction"})
    d = out / f"pause{pause_name(pause)}_{ev}_{host or 'profile'}_s{seed}"
    write_report(d, res.report, res.records, plots=False)
    rep = res.report
    row = {k: rep.get(k) for k in KEYS}
    kd = rep.get("kv_directory") or {}
    row.update(host=host or rep["meta"]["host_kv_tokens"], profile_host=host is None, eviction=ev, dir=str(d),
               pause=pause_name(pause), seed=seed,
               wall_s=time.monotonic() - t0, expired=kd.get("branch.expired", 0), version_bumps=kd.get("branch.version_bumps", 0),
               branches_ended=kd.get("branch.ended", 0))
    log(f"  pauses {pause_name(pause)}, seed {seed}, {ev} @ {row['host'] / 1e6:.2f}M: lost {100 * (row['lost_kv_reuse'] or 0):.3f}%, eviction share "
        f"{fmt(row['lost_kv_reuse_eviction_share'], pct=True)}, {row['throughput_rps']:.3f} req/s, TTFT "
        f"{row['ttft_mean_s']:.2f} / {row['ttft_p95_s']:.2f} s ({row['wall_s']:.0f} s wall)")
    return row


def pause_name(pause: float | None) -> str:
    return "recorded" if pause is None else f"<={pause:.0f}s"


def fmt(x: Any, spec: str = ".2f", pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.{2 if pct is True else pct}f}%" if pct else format(x, spec)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Median lost KV reuse over agent orders vs host capacity, one panel per pause regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pauses = sorted({r["pause"] for r in rows})
    fig, axes = plt.subplots(1, len(pauses), figsize=(5 * len(pauses), 3.6), dpi=90, squeeze=False)
    for ax, pz in zip(axes[0], pauses):
        sub = [r for r in rows if r["pause"] == pz]
        for ev, style in (("lru", "o-"), ("branch-count", "s-")):
            caps = sorted({r["host"] for r in sub if r["eviction"] == ev})
            med = [statistics.median(100 * (r["lost_kv_reuse"] or 0) for r in sub if r["eviction"] == ev and r["host"] == c)
                   for c in caps]
            ax.plot([c / 1e6 for c in caps], med, style, label=ev)
        counted = [r["counted_kv_tokens_per_prefill_node_mean"] for r in sub if r["counted_kv_tokens_per_prefill_node_mean"]]
        if counted:
            ax.axvline(statistics.median(counted) / 1e6, color="grey", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("host (L2) capacity per node, M tokens")
        ax.set_ylabel("lost KV reuse 1 − h/h* (%, median)")
        ax.set_title(f"pauses {pz}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("CC, 90 agents, 4P5D cache-aware; dotted: KV active branches reference per prefill node (mean)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 capacities, one agent order, 1,500 s simulated")
    ap.add_argument("--hosts", default=None, help="host capacities in tokens, comma list ('profile' = the profile's)")
    ap.add_argument("--pauses", default="30,recorded",
                    help="pause regimes, comma list: a cap in seconds, or 'recorded' (default 30,recorded)")
    ap.add_argument("--seeds", type=int, default=None, help="agent orders per setting (default 3, quick 1)")
    ap.add_argument("--workers", type=int, default=1, help="runs in parallel (forked processes)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "ei-sim-bench"), help="trace cache directory")
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "ei-sim-eviction"), help="run directories")
    ap.add_argument("--no-append", action="store_true", help="print only")
    a = ap.parse_args(argv)
    q = a.quick
    hosts = (tuple(None if h == "profile" else int(float(h)) for h in a.hosts.split(",")) if a.hosts
             else HOSTS_QUICK if q else HOSTS_FULL)
    pauses = tuple(None if p.strip() == "recorded" else float(p) for p in a.pauses.split(","))
    seeds = tuple(range(1, 1 + (a.seeds or (1 if q else 3))))
    duration = 1500.0 if q else 2400.0
    cache, out = Path(a.cache), Path(a.out)
    cache.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    reqs, bs = load_trace(cache)
    runs = [(pz, h, ev, sd) for pz in pauses for h in hosts for sd in seeds for ev in POLICIES]
    log(f"--- {len(runs)} runs, {duration:.0f} s simulated each ({WARMUP:.0f} s warm-up), workers {a.workers}")
    if a.workers > 1:
        _FORK.update(runs=runs, reqs=reqs, bs=bs, duration=duration, out=out)
        try:
            with ProcessPoolExecutor(max_workers=a.workers, mp_context=multiprocessing.get_context("fork")) as pool:
                rows = list(pool.map(_run, range(len(runs))))
        finally:
            _FORK.clear()
    else:
        rows = [run_one(pz, h, ev, sd, reqs, bs, duration, out) for pz, h, ev, sd in runs]
    (out / "rows.json").write_text(json.dumps(rows, indent=1, default=str))
    mode = "quick" if q else "full"
    fig = FIGURES / f"sim_eviction_{mode}.png"
    plot(rows, fig)

    def med(rs: list[dict[str, Any]], key: str) -> float | None:
        vals = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    table = ["| pauses | host tokens/node | eviction | lost KV reuse (median) | ÷ LRU (median; per order min–max) | "
             "C.1 eviction / routing / first-request share | prefill L2 evictions of positive-count blocks | req/s | "
             "TTFT mean / P95 s | active-branch KV per prefill node, mean / max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for pz in [pause_name(p) for p in pauses]:
        caps = sorted({r["host"] for r in rows if r["pause"] == pz}, reverse=True)
        for h in caps:
            sel = {ev: [r for r in rows if r["pause"] == pz and r["host"] == h and r["eviction"] == ev] for ev in POLICIES}
            lru, bc = sel["lru"], sel["branch-count"]
            ll, lb = med(lru, "lost_kv_reuse") or 0.0, med(bc, "lost_kv_reuse") or 0.0
            per = sorted((b["lost_kv_reuse"] or 0) / l["lost_kv_reuse"] for l in lru for b in bc
                         if b["seed"] == l["seed"] and l["lost_kv_reuse"])
            for ev, rs in sel.items():
                if not rs:
                    continue
                name = f"{h / 1e6:.2f}M" + (" (profile)" if rs[0]["profile_host"] else "")
                ratio = "1" if ev == "lru" else (f"{lb / ll:.2f}" if ll else "-") + (
                    f" ({per[0]:.2f}–{per[-1]:.2f})" if len(per) > 1 else "")
                table.append(
                    f"| {pz} | {name} | {ev} | {fmt(med(rs, 'lost_kv_reuse'), pct=3)} | {ratio} | "
                    f"{fmt(med(rs, 'lost_kv_reuse_eviction_share'), pct=0)} / {fmt(med(rs, 'lost_kv_reuse_routing_share'), pct=0)} / "
                    f"{fmt(med(rs, 'lost_kv_reuse_unattributed_share'), pct=0)} | {fmt(med(rs, 'host_evictions_positive_share'), pct=1)} | "
                    f"{med(rs, 'throughput_rps'):.3f} | {med(rs, 'ttft_mean_s'):.2f} / {med(rs, 'ttft_p95_s'):.2f} | "
                    f"{(med(rs, 'counted_kv_tokens_per_prefill_node_mean') or 0) / 1e6:.2f}M / "
                    f"{(med(rs, 'counted_kv_tokens_per_prefill_node_max') or 0) / 1e6:.2f}M |"
                )
            if lru and bc:
                evict_share = med(lru, "lost_kv_reuse_eviction_share") or 0.0
                if ll == 0:
                    v = "no loss under LRU"
                elif evict_share < NO_PRESSURE_SHARE:  # the capacity holds what branches reuse: nothing for an eviction order to win
                    v = f"{lb / ll:.2f}× LRU — n/a (under LRU only {100 * evict_share:.0f}% of the lost reuse is eviction's)"
                else:
                    v = f"{lb / ll:.2f}× LRU — {'met' if lb <= 0.5 * ll else 'MISSED'}"
                verdicts.append(f"{pz} @ {h / 1e6:.2f}M: {v}")
    expired = sum(r["expired"] for r in rows)
    head = [
        f"## simulator: branch-count vs LRU host eviction ({mode}) — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- command: `python bench/sim_eviction.py{' --quick' if q else ''}{f' --workers {a.workers}' if a.workers > 1 else ''}"
        f"{f' --hosts {a.hosts}' if a.hosts else ''}{f' --pauses {a.pauses}' if a.pauses != '30,recorded' else ''}"
        f"{f' --seeds {a.seeds}' if a.seeds else ''}`",
        f"- commit: {commit_label(REPO)}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
        f"{os.getloadavg()[0]:.1f} at the end (shared VM); total wall {time.monotonic() - t0:.0f} s",
        f"- settings: 9 nodes × 4 GPUs `gb300-glm52`, `--policy static:4P5D` (cache-aware prefill routing, round-robin "
        f"decode, decode KV reserved at dispatch, no switches, no shared pool), real CC sessions (all 530 of "
        f"`../shared/traces/claude-code-weka`), {AGENTS} agents closed loop entering in {len(seeds)} shuffled orders "
        f"(`--agent-order shuffled --seed 1..{len(seeds)}`; medians over them), `--block-size {BLOCK}`, "
        f"`--duration {duration:.0f} --warmup {WARMUP:.0f}`; pauses capped at 30 s (`--max-pause 30`: the paper's CC "
        f"load) or as recorded (tool calls and users away: p50 10 s, mean 154 s); only the pauses, "
        f"`--host-capacity-tokens` and `--eviction` vary. L1 = 2.06M tokens per node (L2 ⊇ L1)",
        "- verdicts (target: branch-count's lost KV reuse ≤ ½ LRU's; n/a where under 10% of LRU's lost reuse is due to eviction): " + "; ".join(verdicts),
        f"- branches expired by the directory's TTL over all runs: {expired}; plot: "
        f"[`bench/figures/{fig.name}`](figures/{fig.name})",
        "",
    ]
    text = "\n".join(head + table) + "\n"
    print(text)
    if not a.no_append:
        with open(RESULTS, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
