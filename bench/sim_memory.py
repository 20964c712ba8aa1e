"""Peak memory of the simulator on real Claude Code sessions (issue 23, deliverable 4).

    python bench/sim_memory.py --trace cc.jsonl.gz                  # every run below
    python bench/sim_memory.py --trace cc.jsonl.gz --only evolving-126

``cc.jsonl.gz`` = ``evolving-infra trace convert --from claude-code-weka`` (64-token blocks, the
converter's default). Each run is the real ``evolving-infra simulate`` command in a fresh child
process; its peak resident memory is the child's ``ru_maxrss`` from ``os.wait4`` (the child and
every process it waited for: a sweep's or partition's workers; Linux reports KiB). Each run has a
trace cache of its own, empty (``EI_TRACE_CACHE_DIR``, a temporary folder): it parses the trace and
writes its pack (``evolving_infra.traces.cache``), the most a run of a ``.jsonl.gz`` holds; a later
run of the same file reads the pack instead, with less. Runs:

* ``evolving-126``: the 1-hour 9 nodes × 4 GPUs ``evolving`` run, 126 agents, pauses ≤ 30 s
  (target ≤ 1 GB);
* ``readme-evolving`` and ``readme-sweep``: the README's example (90 agents, 1 hour, 600 s
  warm-up; ``--sweep policies static:4P5D,dynamo,arrow``) (target ≤ 1.5 GB each).

Appends a section to ``bench/RESULTS-history.md`` (``--no-append``: print only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit_label  # noqa: E402

HISTORY = REPO / "bench" / "RESULTS-history.md"
GB = 1e9
COMMON = ["--nodes", "9", "--max-pause", "30", "--no-plots"]
RUNS: dict[str, tuple[list[str], float]] = {
    "evolving-126": (["--concurrency", "126", "--policy", "evolving"], 1.0 * GB),
    "readme-evolving": (["--concurrency", "90", "--warmup", "600", "--policy", "evolving"], 1.5 * GB),
    "readme-sweep": (["--concurrency", "90", "--warmup", "600", "--sweep", "policies", "static:4P5D,dynamo,arrow"], 1.5 * GB),
}


def measure(trace: str, args: list[str], out: Path, timeout_s: float) -> tuple[int, float, int]:
    """Run one simulate command; returns (peak RSS bytes, wall s, exit status).

    Raises:
        SystemExit: the run does not finish within ``timeout_s``.
    """
    cmd = [sys.executable, "-m", "evolving_infra.cli", "simulate", "--trace", trace, *COMMON, *args, "--out", str(out)]
    t = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "stderr.log"
    cold = tempfile.mkdtemp(prefix="ei-trace-cache-")  # an empty cache: the run reads the JSON and writes the pack
    with log.open("wb") as errf:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=errf, env={**os.environ, "EI_TRACE_CACHE_DIR": cold})
    deadline = t + timeout_s
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            p.kill()
            p.wait()
            shutil.rmtree(cold, ignore_errors=True)
            raise SystemExit(f"timed out after {timeout_s:.0f} s: {' '.join(cmd)}")
        time.sleep(0.5)
    p.returncode = os.waitstatus_to_exitcode(status)
    shutil.rmtree(cold, ignore_errors=True)
    err = log.read_text(errors="replace")
    if p.returncode not in (0, 1):
        raise SystemExit(f"simulate failed ({p.returncode}): {' '.join(cmd)}\n{err[-2000:]}")
    return ru.ru_maxrss * 1024, time.monotonic() - t, p.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="canonical trace (trace convert --from claude-code-weka)")
    ap.add_argument("--only", action="append", choices=sorted(RUNS), help="run only these (repeatable)")
    ap.add_argument("--duration", default="3600", help="simulated seconds (default 3600: the targets' runs)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="wall seconds per run (default 3600)")
    ap.add_argument("--no-append", action="store_true", help="print only; do not append to bench/RESULTS-history.md")
    a = ap.parse_args(argv)
    trace = str(Path(a.trace).resolve())
    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sim-memory-") as tmp:
        for name in a.only or list(RUNS):
            args, target = RUNS[name]
            peak, wall, rc = measure(trace, ["--duration", a.duration, *args], Path(tmp) / name, a.timeout)
            rows.append((name, args, peak, wall, target))
            print(f"{name}: peak RSS {peak / GB:.2f} GB ({peak / 2**30:.2f} GiB), {wall:.0f} s wall, target <= {target / GB:.1f} GB: "
                  f"{'met' if peak <= target else 'NOT met'}", flush=True)
    load1 = os.getloadavg()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"\n## simulator peak memory — {date}\n",
        f"`python bench/sim_memory.py --trace {Path(a.trace).name}` · {commit_label(REPO)} · load average "
        f"{load0[0]:.1f} at start, {load1[0]:.1f} at end\n",
        f"Every run: `evolving-infra simulate --trace {Path(a.trace).name} {' '.join(COMMON)} --duration {a.duration} ...`\n",
        "| run | extra flags | peak RSS | wall s | target | met |",
        "|---|---|---|---|---|---|",
    ]
    full = a.duration == "3600"  # the targets are for the 1-hour runs
    for name, args, peak, wall, target in rows:
        lines.append(f"| {name} | `{' '.join(args)}` | {peak / GB:.2f} GB ({peak / 2**30:.2f} GiB) | {wall:.0f} | "
                     + (f"≤ {target / GB:.1f} GB | {'yes' if peak <= target else 'no'} |" if full else "— | — |"))
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_append:
        with HISTORY.open("a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
