"""Decode binding at prefill start vs decode KV reserved at enqueue (paper Appendix D.1).

SGLang's PD mode reserves a request's KV on its decode node when the request is
dispatched and holds the reservation while the request waits in a prefill node's
queue; at 6P3D on OSWorld the paper measures these reservations at 91% of the
three decode nodes' KV on average, so removing a decode node would delay prefill.
Evolving Infra binds the decode node when the prefill starts, so queued requests
hold no decode memory. This benchmark runs the OSWorld-like workload at
decode-light splits with the same routing (cache-aware prefill, round-robin
decode, LRU) and only the binding changed:

* ``--decode-binding enqueue`` (SGLang PD pre-allocation: reserved at dispatch, the
  prefill gated until the reservation is granted);
* ``--decode-binding prefill-start`` (paper Eq. 7 / D.1).

It reports the time-averaged share of the decode nodes' L1 held by reservations of
requests whose prefill has not started (``decode_kv_reserved_waiting_share``), the
share held by all reservations made before the hand-off (``decode_kv_reserved_share``),
and the TTFT difference (mean / P95).

    python bench/sim_binding.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from _common import commit_label  # noqa: E402
RESULTS = REPO / "bench" / "RESULTS-history.md"

_W: dict[str, Any] = {}


def log(msg: str) -> None:
    print(msg, flush=True)


def _run(item: tuple[str, str, Any]) -> dict[str, Any]:
    from evolving_infra.sim.run import simulate

    split, binding, cfg = item
    t0 = time.monotonic()
    res = simulate(cfg, _W["reqs"], _W["bs"], meta={"workload": "osworld"})
    rep = res.report
    keep = ("throughput_rps", "ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "e2e_mean_s", "e2e_p95_s", "prefill_queue_mean_s",
            "kv_hit_rate", "decode_kv_reserved_share", "decode_kv_reserved_waiting_share", "requests_completed",
            "requests_unfinished", "requests_failed", "simulated_s", "tpot_mean_s")
    row = {k: rep.get(k) for k in keep}
    row.update(split=split, binding=binding, wall_s=time.monotonic() - t0)
    return row


def pct(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{100 * v:.{nd}f}%"


def rel(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{100 * (a - b) / b:+.0f}%"


def main(argv: list[str] | None = None) -> int:
    import gc
    import multiprocessing
    from dataclasses import replace

    from evolving_infra.sim.config import SimConfig
    from evolving_infra.traces.generate import generate
    from shared.profile import ProfileError, load_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 min warm-up + 10 min measured (default 5 + 20)")
    ap.add_argument("--agents", type=int, default=128, help="concurrent agents (default 128, paper D.1)")
    ap.add_argument("--splits", default="6P3D,7P2D", help="decode-light splits (default 6P3D,7P2D)")
    ap.add_argument("--profile", default=None, help="node profile (default gb300-kimi-k26 if present, else gb300-glm52)")
    ap.add_argument("--block-size", type=int, default=512, help="simulation block size (default 512; 64 is exact)")
    ap.add_argument("--workers", type=int, default=2, help="runs in parallel (default 2)")
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "ei-sim-binding"), help="summary directory")
    ap.add_argument("--no-append", action="store_true", help="print only")
    ap.add_argument("--from-summary", action="store_true", help="format the runs saved in OUT/summary_<mode>.json again")
    a = ap.parse_args(argv)
    warm, measure = (300.0, 600.0) if a.quick else (300.0, 1200.0)
    mode = "quick" if a.quick else "full"
    profile = a.profile
    if profile is None:
        try:
            load_profile("gb300-kimi-k26")
            profile = "gb300-kimi-k26"
        except ProfileError:
            profile = "gb300-glm52"
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = out / f"summary_{mode}.json"
    agents_total = 4 * a.agents
    if a.from_summary:
        rows = json.loads(summary.read_text())
    else:
        tr = generate("osworld", seed=1, agents=agents_total, block_size=64)
        _W.update(reqs=tr.requests, bs=tr.header.block_size)
        gc.freeze()
        base = SimConfig(nodes=9, profile=profile, concurrency=a.agents, block_size=a.block_size,
                         duration_s=warm + measure, warmup_s=warm, seed=1)
        items = [(s, b, replace(base, policy=f"static:{s}", decode_binding=b, label=f"{s} {b}"))
                 for s in a.splits.split(",") for b in ("enqueue", "prefill-start")]
        log(f"{len(items)} runs, {a.agents} agents, profile {profile}, {warm + measure:.0f} s simulated each")
        ctx = multiprocessing.get_context("fork")
        rows = []
        with ProcessPoolExecutor(max_workers=a.workers, mp_context=ctx) as pool:
            for r in pool.map(_run, items):
                log(f"  {r['split']} {r['binding']}: waiting share {pct(r['decode_kv_reserved_waiting_share'])}, "
                    f"TTFT {r['ttft_mean_s']:.2f} / {r['ttft_p95_s']:.2f} s, {r['wall_s']:.0f} s wall")
                rows.append(r)
        summary.write_text(json.dumps(rows, indent=1))
    cmd = "python bench/sim_binding.py" + (" --quick" if a.quick else "")
    lines = [
        f"## simulator: decode binding at prefill start vs reservation at enqueue, OSWorld-like (paper D.1) ({mode}) — "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- command: `{cmd}`; commit {commit_label(REPO)}; machine: {platform.machine()}, "
        f"{os.cpu_count()} shared CPUs, load average {os.getloadavg()[0]:.1f} at the end; total wall {time.monotonic() - t0:.0f} s",
        f"- workload: `trace generate osworld --seed 1 --agents {agents_total}` (the generator in the tree at the run), closed loop "
        f"{a.agents} agents, {a.block_size}-token blocks; 9 nodes × 4 GB300, profile `{profile}`; {warm:.0f} s warm-up, "
        f"{measure:.0f} s measured",
        "- same routing for both bindings: cache-aware prefill, round-robin decode, LRU (`--policy static:<split>`); only "
        "`--decode-binding` differs; reservation shares are time-averaged over the measured span, relative to the L1 of the "
        "nodes serving decode",
        "",
        "| split | binding | decode KV reserved, prefill not started | all pre-hand-off reservations | TTFT mean / P95 s "
        "| ΔTTFT mean / P95 vs enqueue | E2E mean s | req/s | prefill queue mean s | KV hit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["split"], r["binding"]): r for r in rows}
    for r in rows:
        e = by.get((r["split"], "enqueue"))
        d = "" if r["binding"] == "enqueue" or e is None else (
            f"{r['ttft_mean_s'] - e['ttft_mean_s']:+.2f} s ({rel(r['ttft_mean_s'], e['ttft_mean_s'])}) / "
            f"{r['ttft_p95_s'] - e['ttft_p95_s']:+.2f} s ({rel(r['ttft_p95_s'], e['ttft_p95_s'])})")
        lines.append(
            f"| {r['split']} | {r['binding']} | {pct(r['decode_kv_reserved_waiting_share'])} | {pct(r['decode_kv_reserved_share'])} | "
            f"{r['ttft_mean_s']:.2f} / {r['ttft_p95_s']:.2f} | {d or '-'} | {r['e2e_mean_s']:.2f} | {r['throughput_rps']:.3f} | "
            f"{r['prefill_queue_mean_s']:.2f} | {r['kv_hit_rate']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_append:
        with open(RESULTS, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
