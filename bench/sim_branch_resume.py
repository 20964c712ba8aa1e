"""Branches resumed after expiry, on a simulated day of real Claude Code sessions (issue 21, part 4).

Real Claude Code sessions pause between requests for as long as their users and tools took
(recorded pauses, uncapped: p50 10 s, mean 154 s, p99 47 min); many pauses are longer than
the KV directory's branch TTL (``--branch-ttl-s``, 1,800 s), so the directory expires the
branch meanwhile. Before issue 21 the branch's next placement was then refused as an ended
branch's (``place.ended_branch``) until a further TTL passed: its KV was no longer counted for
the rest of that window. Now such a placement is a *resume* (``branch.resumed``) and nothing
is refused. This check runs the simulator's directory (the live service's core) over a day:

* input: every session of ``../shared/traces/claude-code-weka`` (530, converted once and cached
  at 512-token blocks, as ``bench/sim_eviction.py`` does), recorded pauses;
* 9 nodes × 4 GB300 (``gb300-glm52``), the default policy (``evolving``), ``--concurrency 32``
  agents in a closed loop (the sessions last ~50 h at that concurrency: the day never runs dry),
  86,400 simulated seconds;
* figure: refused placements (target 0), with the expiries and resumes that show the case
  happened, and the pauses of the input longer than the TTL.

    python bench/sim_branch_resume.py                  # the day (a few minutes of wall time)
    python bench/sim_branch_resume.py --duration 7200  # a quick look

Prints a Markdown row; ``--record`` appends a section to ``bench/RESULTS-history.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit_label  # noqa: E402

HISTORY = REPO / "bench" / "RESULTS-history.md"
TTL_S = 1800.0
"""The directory's default ``--branch-ttl-s`` (``services/kvdirectory/config.py``), which the simulator uses."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=86_400.0, help="simulated seconds (default a day, 86,400)")
    ap.add_argument("--concurrency", type=int, default=32, help="agents in the closed loop (default 32)")
    ap.add_argument("--policy", default="evolving", help="policy set (default evolving)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "ei-sim-bench"), help="trace cache directory")
    ap.add_argument("--record", action="store_true", help="append a section to bench/RESULTS-history.md")
    a = ap.parse_args()

    import sim_eviction  # the real sessions' loader (converted once, cached)

    from evolving_infra.sim.config import SimConfig
    from evolving_infra.sim.run import simulate

    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    reqs, bs = sim_eviction.load_trace(cache)
    long_pauses = sum(1 for r in reqs if r.pause_s > TTL_S)
    cfg = SimConfig(nodes=9, policy=a.policy, concurrency=a.concurrency, max_pause_s=None, block_size=bs,
                    duration_s=a.duration, seed=1, label=f"{a.policy}-day")
    t0 = time.monotonic()
    res = simulate(cfg, reqs, bs)
    wall = time.monotonic() - t0
    r = res.report
    kd = r.get("kv_directory", {})
    refused = int(kd.get("place.ended_branch", 0)) + int(kd.get("branch.start_after_end", 0))
    row = {
        "refused placements": refused,
        "branches expired": int(kd.get("branch.expired", 0)),
        "branches resumed": int(kd.get("branch.resumed", 0)),
        "requests completed": r["requests_completed"],
        "requests failed": r["requests_failed"],
        "input pauses > TTL": long_pauses,
    }
    ok = refused == 0 and r["requests_failed"] == 0
    line = (f"| {a.duration:.0f} s, {a.concurrency} agents, {a.policy} | " + " | ".join(str(v) for v in row.values())
            + f" | {'met' if ok else 'MISSED'} | {wall:.0f} s |")
    head = ("| run | " + " | ".join(row) + " | refused = 0 | wall |\n|" + "---|" * (len(row) + 3))
    print(head)
    print(line)
    if a.record:
        text = (
            f"\n## Branch resume after expiry: real Claude Code sessions, recorded pauses, a simulated day "
            f"({time.strftime('%Y-%m-%d')}, {commit_label(REPO)})\n\n"
            f"`python bench/sim_branch_resume.py` — 530 real Claude Code sessions (512-token blocks), pauses as recorded, "
            f"9 nodes `gb300-glm52`, `--policy {a.policy}`, {a.concurrency} agents closed loop, branch TTL {TTL_S:.0f} s. "
            "Target (issue 21): no placement refused; before issue 21 every expired branch's next request was refused "
            "(`place.ended_branch`).\n\n" + head + "\n" + line + "\n"
        )
        with HISTORY.open("a") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
