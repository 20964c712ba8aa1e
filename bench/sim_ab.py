"""Two versions of the simulator on one fixed input: identical output, and how much faster.

    python bench/sim_ab.py --base c9d6c45 --trace cc.jsonl.gz            # HEAD's tree vs c9d6c45
    python bench/sim_ab.py --base c9d6c45 --head HEAD --rounds 3 --duration 900
    python bench/sim_ab.py --vs-policy static:4P5D --trace cc.jsonl.gz   # HEAD: evolving ÷ static
    python bench/sim_ab.py --base main --trace cc.jsonl.gz --head-trace cc.eipack  # the head on the packed trace

Exports both revisions with ``git archive`` into a temporary directory and runs the real
``evolving-infra simulate`` command of each, alternating (base, head, head, base, ...), each in a
fresh process with this interpreter (the project's venv: same dependencies). Per run: CPU seconds
of the child (user + system, ``RUSAGE_CHILDREN``: robust to other processes' load, which
inflates wall time on a shared box), CPU seconds of the simulation loop alone
(``ClusterSim.run_to_end`` timed with ``time.process_time`` inside the child, so the trace load
does not dilute the loop's change), wall seconds, the loop's wall seconds and peak RSS. Then:

* exactness: ``report.json`` of the two revisions' first runs must be equal apart from wall-clock
  keys (``evolving_infra.sim.run.WALL_CLOCK_KEYS``, ``meta.date``, ``meta.argv``, ``meta.wall_s``)
  and keys only the head has (new report keys); ``requests.jsonl`` must be equal line by line
  apart from keys that are not fields of the base's ``RequestRecord`` (new per-request fields);
* speed: medians of the CPU seconds (whole child, loop alone, and outside the loop: whole − loop
  per run) and their ratios (base ÷ head: > 1 = head faster).

Default input (issue 23): ``--policy evolving`` on 9 nodes, 40 agents of the trace, pauses capped
at 30 s, 64-token blocks, the evolving planner's warm-up and window shortened to 300 s so that
it decides splits within the run. Exit status 1 when the outputs differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
META_WALL = {"date", "argv", "wall_s"}


CHILD_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "EI_TRACE_CACHE_DIR": "off"}
"""Environment of every timed child: with ``PYTHONDONTWRITEBYTECODE`` (set on this project's CI and
dev VMs) each run would recompile every module it imports (~0.1–0.8 s, counted in "CPU outside the
loop"), which an installed package never pays; :func:`export` compiles each tree ahead instead.
The trace cache off (``EI_TRACE_CACHE_DIR=off``; ``evolving_infra.traces.cache``): both revisions
parse the trace every run, so "CPU outside the loop" compares like with like (a revision with the
cache would read the pack its first run wrote, one without it the JSON), and no run writes into the
user's cache. ``--head-trace X.eipack`` compares a packed read."""


def export(rev: str, dest: Path) -> Path:
    """``git archive`` of ``rev`` unpacked into ``dest``, its packages byte-compiled ahead (as an
    installed package is), so that no timed run pays for compiling."""
    dest.mkdir(parents=True)
    arch = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "evolving_infra", "services", "shared"], cwd=dest,
                   capture_output=True, env=CHILD_ENV)
    return dest


LOOP_CPU = """
import atexit, os, sys, time
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the CLI sets it for simulate before numpy is imported
from evolving_infra.sim import cluster
run_to_end, spent = cluster.ClusterSim.run_to_end, [0.0]
def timed(self, *a, **k):
    t = time.process_time()
    try:
        return run_to_end(self, *a, **k)
    finally:
        spent[0] += time.process_time() - t
cluster.ClusterSim.run_to_end = timed
atexit.register(lambda: open(os.environ["SIM_AB_LOOP_CPU"], "w").write(repr(spent[0])))
from evolving_infra.cli import main
sys.exit(main(sys.argv[1:]))
"""
"""The child: ``evolving-infra`` with ``ClusterSim.run_to_end`` (the simulation loop) timed in
CPU seconds of the process (``time.process_time``), written to ``$SIM_AB_LOOP_CPU`` at exit.
``OPENBLAS_NUM_THREADS=1`` first, as ``evolving_infra.cli.COMMAND_ENV`` sets it for ``simulate``: the
import of the simulator here comes before the CLI's, so numpy started OpenBLAS's thread pool (one
thread a core), whose spinning the child's CPU seconds counted (~100 M instructions of a 600-s run
at 512-token blocks under cachegrind; 2026-12-07)."""


def run(tree: Path, args: list[str], out: Path) -> dict:
    """One simulate run of ``tree``; returns its report with ``_cpu_s`` (whole child),
    ``_loop_cpu_s`` (the simulation loop alone, without the trace load) and ``_wall_s``."""
    return run_many([(tree, args, out)])[0]


def run_many(jobs: list[tuple[Path, list[str], Path]]) -> list[dict]:
    """Simulate runs ``(tree, args, out)`` started together (one is a plain run); returns their
    reports as :func:`run` does (CPU seconds of each child from ``wait4``)."""
    procs = []
    for tree, args, out in jobs:
        loop_file = out.parent / f"{out.name}.loop_cpu"
        with open(out.parent / f"{out.name}.stderr", "w") as err:  # a file: no pipe to fill
            p = subprocess.Popen([sys.executable, "-c", LOOP_CPU, "simulate", *args, "--out", str(out), "--no-plots"],
                                 cwd=tree, stdout=subprocess.DEVNULL, stderr=err,
                                 env={**CHILD_ENV, "PYTHONPATH": str(tree), "SIM_AB_LOOP_CPU": str(loop_file)})
        procs.append((p, time.monotonic(), loop_file))
    reps = []
    for (tree, _args, out), (p, t, loop_file) in zip(jobs, procs):
        _pid, status, ru = os.wait4(p.pid, 0)
        err = (out.parent / f"{out.name}.stderr").read_text()
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t
        if p.returncode not in (0, 1):
            raise SystemExit(f"simulate failed in {tree}:\n{err[-3000:]}")
        rep = json.loads((out / "report.json").read_text())
        rep["_cpu_s"] = ru.ru_utime + ru.ru_stime
        rep["_loop_cpu_s"] = float(loop_file.read_text())
        rep["_wall_s"] = wall
        reps.append(rep)
    return reps


def record_fields(tree: Path) -> frozenset[str]:
    """The ``RequestRecord`` fields of ``tree``'s version (the keys its ``requests.jsonl`` may hold)."""
    code = "from evolving_infra.report.records import RequestRecord; print(' '.join(RequestRecord.__struct_fields__))"
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(tree)})
    return frozenset(p.stdout.split())


_DEFAULTS_CODE = """
import json, msgspec
from evolving_infra.report.records import RequestRecord
out = {}
for f in msgspec.structs.fields(RequestRecord):
    if f.default is not msgspec.NODEFAULT:
        out[f.encode_name] = f.default
    elif f.default_factory is not msgspec.NODEFAULT:
        out[f.encode_name] = f.default_factory()
print(json.dumps(msgspec.to_builtins(out)))
"""


def record_defaults(tree: Path | None = None) -> dict[str, Any]:
    """The ``RequestRecord`` defaults of ``tree``'s version (this checkout's when None), as JSON values: what a
    ``requests.jsonl`` key left out means. Since 69a2a04 the counters and the outcome are written at 0 / true / 200,
    where a record before it left them out; reading both sides with these filled in compares values, not spellings."""
    if tree is None:
        import msgspec

        from evolving_infra.report.records import RequestRecord

        out: dict[str, Any] = {}
        for f in msgspec.structs.fields(RequestRecord):  # as _DEFAULTS_CODE, in this process
            if f.default is not msgspec.NODEFAULT:
                out[f.encode_name] = f.default
            elif f.default_factory is not msgspec.NODEFAULT:
                out[f.encode_name] = f.default_factory()
        return json.loads(json.dumps(msgspec.to_builtins(out)))
    p = subprocess.run([sys.executable, "-c", _DEFAULTS_CODE], cwd=tree, capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(p.stdout)


def differences(a: Path, b: Path, base_fields: frozenset[str] | None = None, meta_skip: set[str] = set(),  # noqa: B006
                defaults: dict[str, Any] | None = None) -> list[str]:
    """What differs between two output dirs (report.json minus wall keys, ``meta_skip`` keys of its
    ``meta`` and head-only keys; requests.jsonl
    line by line, minus keys that are not fields of the base's ``RequestRecord`` when ``base_fields``
    is given: a new per-request field may appear, an old one may not change). Each requests.jsonl line is
    read with ``defaults`` (the head's :func:`record_defaults`; this checkout's when None) filled in where
    a key is left out, so a record that leaves a counter out at 0 and one that writes it equal."""
    from evolving_infra.sim.run import WALL_CLOCK_KEYS

    ra, rb = (json.loads((d / "report.json").read_text()) for d in (a, b))
    out = []
    for k in sorted(ra):
        if k in WALL_CLOCK_KEYS:
            continue
        va, vb = ra[k], rb.get(k)
        if k == "meta":
            va = {m: v for m, v in va.items() if m not in META_WALL | meta_skip}
            vb = {m: v for m, v in (vb or {}).items() if m not in META_WALL | meta_skip}
        if va != vb:
            out.append(f"report.json {k}: {str(va)[:120]} -> {str(vb)[:120]}")
    la, lb = ((d / "requests.jsonl").read_text().splitlines() for d in (a, b))
    if la != lb:  # equal apart from keys only the head writes (new per-request fields) and defaults left out
        fill = record_defaults() if defaults is None else defaults
        ja, jb = ([{**fill, **json.loads(x)} for x in lines] for lines in (la, lb))
        keep = base_fields if base_fields is not None else frozenset(k for y in jb for k in y)
        n = sum({k: v for k, v in x.items() if k in keep} != {k: v for k, v in y.items() if k in keep}
                for x, y in zip(ja, jb))
        n += abs(len(la) - len(lb))
        if n:
            out.append(f"requests.jsonl: {n} of {max(len(la), len(lb))} lines differ")
    return out


def vs_policy(a: argparse.Namespace, args: list[str]) -> int:
    """One revision, two policy sets on the same input, alternating; medians of the loop CPU s."""
    other = list(args)
    other[other.index("--policy") + 1] = a.vs_policy
    while "--planner-opt" in other:  # the evolving planner's options mean nothing to another planner
        i = other.index("--planner-opt")
        del other[i : i + 2]
    runs = {a.policy: args, a.vs_policy: other}
    with tempfile.TemporaryDirectory(prefix="sim-ab-") as tmp:
        tree = export(a.head, Path(tmp) / "head")
        reps: dict[str, list[dict]] = {a.policy: [], a.vs_policy: []}
        for r in range(a.rounds):
            for i, name in enumerate(runs if r % 2 == 0 else reversed(list(runs))):
                rep = run(tree, runs[name], Path(tmp) / f"p{r}{i}")
                reps[name].append(rep)
                print(f"round {r} {name}: loop CPU {rep['_loop_cpu_s']:.1f} s, loop wall {rep['sim_wall_s']:.1f} s, "
                      f"CPU {rep['_cpu_s']:.1f} s, sim speed {rep['sim_speed']:.0f}x", flush=True)
    loop = {k: statistics.median(r["_loop_cpu_s"] for r in v) for k, v in reps.items()}
    speed = {k: float(a.duration) / loop[k] for k in loop}
    print(f"\n{a.head}, {a.duration} s simulated, {a.block_size}-token blocks, {a.extra}")
    for k in runs:
        print(f"{k}: loop CPU s, median of {a.rounds}: {loop[k]:.2f} (simulated s per loop CPU s: {speed[k]:.0f})")
    print(f"ratio {a.policy} / {a.vs_policy}: {loop[a.policy] / loop[a.vs_policy]:.2f}")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="git revision to compare against (required unless --vs-policy)")
    ap.add_argument("--head", default="HEAD", help="git revision to measure (default HEAD)")
    ap.add_argument("--trace", required=True, help="canonical trace (e.g. trace convert --from claude-code-weka)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each revision, alternating (default 3)")
    ap.add_argument("--duration", default="900", help="simulated seconds (default 900)")
    ap.add_argument("--block-size", default="64")
    ap.add_argument("--policy", default="evolving")
    ap.add_argument("--extra", default="--nodes 9 --concurrency 40 --max-pause 30 --planner-opt t_learn_s=300 "
                                        "--planner-opt window_s=300", help="further simulate arguments")
    ap.add_argument("--head-trace", metavar="FILE",
                    help="the head reads this input instead of --trace: the same trace in another form (e.g. packed "
                         "by 'trace pack'); meta.trace, the path, is then left out of the output check")
    ap.add_argument("--together", action="store_true",
                    help="run base and head of a round at the same time (each sees the other's load, and both "
                         "the box's), instead of one after the other")
    ap.add_argument("--vs-policy", metavar="POLICY",
                    help="instead of two revisions: --head under --policy against --head under POLICY (e.g. "
                         "static:4P5D, run without the --planner-opt items of --extra), alternating; prints the "
                         "loop CPU ratio policy ÷ POLICY (issue 23: evolving within 1.5x of static:4P5D)")
    a = ap.parse_args(argv)
    extra = a.extra.split()
    for i, x in enumerate(extra[:-1]):  # a --block-size in --extra wins (the last one does): say the one in force
        if x == "--block-size":
            a.block_size = extra[i + 1]
    args = ["--trace", str(Path(a.trace).resolve()), "--policy", a.policy, "--duration", a.duration,
            "--block-size", a.block_size, *a.extra.split()]
    if a.vs_policy:
        return vs_policy(a, args)
    if not a.base:
        ap.error("--base is required (or --vs-policy)")
    with tempfile.TemporaryDirectory(prefix="sim-ab-") as tmp:
        trees = {"base": export(a.base, Path(tmp) / "base"), "head": export(a.head, Path(tmp) / "head")}
        argv = {"base": args, "head": args}
        if a.head_trace:
            argv["head"] = ["--trace", str(Path(a.head_trace).resolve()), *args[2:]]
        reps: dict[str, list[dict]] = {"base": [], "head": []}
        for r in range(a.rounds):
            order = ("base", "head") if r % 2 == 0 else ("head", "base")
            if a.together:  # both at once: the same load on a shared box
                got = dict(zip(order, run_many([(trees[n], argv[n], Path(tmp) / f"{n}{r}") for n in order])))
            for name in order:
                rep = got[name] if a.together else run(trees[name], argv[name], Path(tmp) / f"{name}{r}")
                reps[name].append(rep)
                print(f"round {r} {name}: CPU {rep['_cpu_s']:.1f} s (loop {rep['_loop_cpu_s']:.1f} s), wall {rep['_wall_s']:.1f} s, "
                      f"loop wall {rep['sim_wall_s']:.1f} s, "
                      f"peak RSS {rep['peak_rss_mb']:.0f} MiB", flush=True)
        diff = differences(Path(tmp) / "base0", Path(tmp) / "head0", record_fields(trees["base"]),
                           meta_skip={"trace"} if a.head_trace else set(), defaults=record_defaults(trees["head"]))
    cpu = {k: statistics.median(r["_cpu_s"] for r in v) for k, v in reps.items()}
    loop = {k: statistics.median(r["_loop_cpu_s"] for r in v) for k, v in reps.items()}
    rss = {k: statistics.median(r["peak_rss_mb"] for r in v) for k, v in reps.items()}
    print(f"\n{a.policy}, {a.duration} s simulated, {a.block_size}-token blocks, {a.extra}")
    print(f"CPU s, median of {a.rounds}: base {a.base} {cpu['base']:.1f}, head {a.head} {cpu['head']:.1f}, "
          f"ratio base/head {cpu['base'] / cpu['head']:.2f}")
    print(f"loop CPU s, median of {a.rounds}: base {loop['base']:.1f}, head {loop['head']:.1f}, "
          f"ratio base/head {loop['base'] / loop['head']:.2f}")
    out_loop = {k: statistics.median(r["_cpu_s"] - r["_loop_cpu_s"] for r in v) for k, v in reps.items()}
    print(f"CPU s outside the loop (trace read, setup, report, imports; whole - loop per run), median of {a.rounds}: "
          f"base {out_loop['base']:.2f}, head {out_loop['head']:.2f}, ratio base/head {out_loop['base'] / out_loop['head']:.2f}")
    print(f"peak RSS MiB, median: base {rss['base']:.0f}, head {rss['head']:.0f}")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("output: IDENTICAL" if not diff else "output DIFFERS:\n  " + "\n  ".join(diff))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
