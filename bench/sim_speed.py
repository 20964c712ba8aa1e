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

Side by side with NVIDIA Dynamo's offline replay (issue 23; with ``--dynamo-python PY`` or
``$EI_DYNAMO_PYTHON``, else skipped with a message): real Claude Code sessions
(``trace convert --from claude-code-weka``, the first ``--dynamo-agents`` sessions), 9 nodes ×
4 GPUs, 126 concurrent agents, pauses capped at 30 s, ``--dynamo-duration`` simulated seconds.
The same input goes to both: :func:`dynamo_trace` writes it in Dynamo's ``agentic_mooncake``
v2 format (agent → play, branch → session, ``after`` → completion dependencies with the pause
as ``delay_ms``, ``hash_id_scope: "local"``, our chained block ids as ``hash_ids`` plus a fresh
id for the partial last block, plays in the trace's agent order). Dynamo replays it with
``dynamo.replay.run_trace_replay`` (Rust, virtual clock; ``bench/_dynamo_replay.py`` runs it
under PY): 4 prefill + 5 decode workers, ``kv_router``, 126 agentic lanes, the profile's batch
token budget and running-request cap, its default ``polynomial`` timing, and as GPU KV blocks
our node's L1 + L2 tokens: its disaggregated replay has no host tier (host offload needs one
prefill and one decode worker), and with our L1 alone it recomputes most prompts (prefix reuse
12% instead of ~87% on the quick input, a third of the requests completed), which is not the
same work.
Ours runs ``static:4P5D`` and ``evolving`` with ``--max-agents`` = the same sessions, from a copy of
the input converted ahead to the block size (:func:`at_block_size`: the same requests ``simulate
--block-size`` builds, as Dynamo reads its file converted ahead), read each way ``--ours-reads``
names (:data:`READS`): ``plain`` = ``--no-trace-cache``, the ``.jsonl.gz`` parsed every run;
``cached`` = as a user's repeated runs read it, the trace cache (``evolving_infra.traces.cache``)
on, in a temporary ``EI_TRACE_CACHE_DIR`` warmed by a first run per policy set whose wall (it
parses the JSON and writes the pack) is reported apart; ``packed`` = the copy packed ahead by
``trace pack`` (:func:`packed`; ``--ours-packed`` alone is ``--ours-reads packed``). All three are
the same run. Ours and Dynamo alternate, each run a fresh process, ``--dynamo-rounds`` rounds (≥ 3),
at 64- and 512-token blocks; medians of simulated seconds per wall second and the ratio ours ÷ Dynamo,
with both sides' completed requests and tokens (the work each simulated). What differs in the
models: engine timing (our profile's fitted iteration model, MTP decode, vs Dynamo's polynomial
mocker), one KV tier of L1 + L2 size in Dynamo vs our L1 / L2 with restores and peer fetches,
Dynamo's KV router vs our policy sets' routers and planner (``evolving`` moves nodes between
prefill and decode). So the work done in the same simulated time differs somewhat; each row
gives its completed requests and tokens, and wall ms per completed request normalises for it.

Dynamo is an optional benchmark-only dependency, in its own venv, never the project's. Its
``ai-dynamo`` package depends on ``aisimulate``, a placeholder that downloads the real wheel from
NVIDIA's index, which cannot be reached here, so it needs ``--no-deps``::

    python3 -m venv /tmp/dynamo-venv
    /tmp/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1
    /tmp/dynamo-venv/bin/pip install --no-deps ai-dynamo==1.6.1

    python bench/sim_speed.py --quick      # ~5 min on 2 shared cores
    python bench/sim_speed.py              # full: the 3,072-GPU hour takes ~1 h of 2 cores
    python bench/sim_speed.py --quick --dynamo-only --dynamo-python /tmp/dynamo-venv/bin/python   # ~10 min
    python bench/sim_speed.py --quick --dynamo-only --dynamo-duration 600 --dynamo-agents 260 \
        --dynamo-python /tmp/dynamo-venv/bin/python                                            # ~20 min

The side-by-side's traces are cached in ``--cache`` (the 530 converted sessions, the first N of
them, and the ``agentic_mooncake`` files: ~0.3 GB at 64-token blocks for 260 sessions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from _common import commit_label, dynamo_skip_reason  # noqa: E402
RESULTS = REPO / "bench" / "RESULTS-history.md"
CLI = [sys.executable, "-m", "evolving_infra.cli"]
CHILD_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "EI_TRACE_CACHE_DIR": "off"}
"""Environment of every timed child (ours and Dynamo's): as a user's shell has it, except that
Python may write bytecode caches. With ``PYTHONDONTWRITEBYTECODE`` set (this project's CI and
dev VMs set it) every run recompiles every imported module, ~0.8 s of each of our runs, which
a user never pays twice. :func:`compile_ahead` fills both sides' caches before the first round.
The trace cache off (``EI_TRACE_CACHE_DIR=off``): each run parses its trace as the figures before
the cache did, and no run writes into the user's cache; the side-by-side's ``cached`` read turns it
on in a temporary folder of its own."""
READS = ("plain", "cached", "packed")
"""How the side-by-side's ours reads its input (module docstring)."""


def compile_ahead(dynamo_python: str | None = None) -> None:
    """Byte-compile our packages (and Dynamo's Python package under ``dynamo_python``) so that no
    timed run pays for compiling: the state of any installed package. Best effort: a read-only
    tree just compiles in each run, as before."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "evolving_infra", "services", "shared"], cwd=REPO,
                   capture_output=True, env=CHILD_ENV)
    if dynamo_python:
        subprocess.run([dynamo_python, "-c", "import compileall, os, dynamo; "
                        "[compileall.compile_dir(p, quiet=1) for p in dynamo.__path__]"], capture_output=True, env=CHILD_ENV)


def make_trace(path: Path, agents: int, block_size: int, seed: int = 1) -> Path:
    """A Claude-Code-like trace (cached by name)."""
    if path.exists():
        return path
    from evolving_infra.traces.generate import generate
    from evolving_infra.traces.io import write_trace

    tr = generate("claude-code", seed=seed, agents=agents, block_size=block_size)
    write_trace(path, tr.header, tr.requests)
    return path


def run(args: list[str], out: Path, env: dict[str, str] | None = None) -> dict:
    """One ``evolving-infra simulate`` run (environment ``env``, default :data:`CHILD_ENV`); returns its
    report plus ``process_wall_s`` (interpreter start to exit) and ``trace_cache`` (what the summary
    line says: ``hit``, ``miss``, ``off``; None when it says nothing)."""
    cmd = CLI + ["simulate", *args, "--out", str(out), "--no-plots"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=CHILD_ENV if env is None else env)
    wall = time.monotonic() - t0
    if p.returncode not in (0, 1):
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    rep = json.loads((out / "report.json").read_text())
    rep["process_wall_s"] = wall
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("simulated ")), "")
    rep["trace_cache"] = line.partition(", trace cache ")[2] or None
    return rep


def machine() -> str:
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}, "
            f"load average {load:.1f} at the end (shared VM: other jobs run on the same cores)")


# ---------------------------------------------------------------------------- Dynamo's replay (issue 23)

DYNAMO_LANES = 126
"""Concurrent agents on both sides (our ``--concurrency``, Dynamo's ``agentic_lanes``)."""
MAX_PAUSE_S = 30.0


def real_trace(cache: Path) -> Path:
    """All real Claude Code sessions at 64-token blocks (``trace convert --from claude-code-weka``,
    shared tool + system prefix as by default), cached."""
    out = cache / "cc_real_64.jsonl.gz"
    if not out.exists():
        src = REPO.parent / "shared" / "traces" / "claude-code-weka"
        p = subprocess.run(CLI + ["trace", "convert", "--from", "claude-code-weka", str(src), "-o", str(out), "--no-progress"],
                           cwd=REPO, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"trace convert failed:\n{p.stderr[-3000:]}")
    return out


def first_agents(src: Path, dst: Path, agents: int) -> Path:
    """The first ``agents`` agents of ``src`` (in its order, the order both replays start them), cached.
    Streams: O(one request) memory."""
    if dst.exists():
        return dst
    from evolving_infra.traces.io import iter_requests, write_trace

    header, reqs = iter_requests(src)
    keep: set[str] = set()

    def kept():
        for r in reqs:
            if r.agent not in keep:
                if len(keep) >= agents:
                    continue
                keep.add(r.agent)
            yield r

    tmp = dst.with_name(dst.name + ".tmp.jsonl.gz")
    write_trace(tmp, header, kept())
    tmp.rename(dst)
    return dst


def at_block_size(src: Path, dst: Path, block_size: int) -> Path:
    """``src`` rewritten at ``block_size`` tokens per block, cached: the requests ``simulate
    --block-size`` would build from ``src`` (``rechunk_request``, one ``PrivateIds`` allocator in
    file order, as ``evolving_infra.sim.run.convert_block_size`` does), so simulating ``dst`` at
    its own block size is the same run (tests/unit/sim/test_dynamo_trace.py checks it). The
    side-by-side gives each simulator its input already at the block size, as Dynamo's replay
    reads its ``agentic_mooncake`` file converted ahead by :func:`dynamo_trace`. Streams."""
    if dst.exists():
        return dst
    import msgspec

    from evolving_infra.traces.io import iter_requests, write_trace
    from evolving_infra.traces.tokens import PrivateIds, rechunk_request

    header, reqs = iter_requests(src)
    if header.block_size == block_size:
        return src
    private = PrivateIds()
    tmp = dst.with_name(dst.name + ".tmp.jsonl.gz")
    write_trace(tmp, msgspec.structs.replace(header, block_size=block_size),
                (rechunk_request(r, header.block_size, block_size, private) for r in reqs))
    tmp.rename(dst)
    return dst


def packed(src: Path, dst: Path) -> Path:
    """``src`` packed by ``trace pack`` (docs/trace-format.md §10), cached (packed again when ``src`` is
    newer): ``simulate --trace dst`` is the run of ``src`` (tests/unit/traces/test_pack.py), its input read
    without parsing JSON, as Dynamo's replay reads its ``agentic_mooncake`` file converted ahead."""
    if dst.exists() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.pack import write_packed

    write_packed(dst, read_trace_compact(src))
    return dst


def dynamo_trace(src: Path, dst: Path, block_size: int, max_pause_s: float = MAX_PAUSE_S) -> dict[str, int]:
    """Write ``src`` (our trace) as Dynamo's ``agentic_mooncake`` v2 trace at ``block_size`` tokens.

    Header ``{"schema": "dynamo.agentic_mooncake", "version": 2, "block_size", "hash_id_scope":
    "local", "source"}``; one row per request: ``request_id``, ``play_id`` = agent,
    ``source_play_ordinal`` = the agent's index in ``src`` (Dynamo's lanes start plays in that
    order, as our closed loop starts agents), ``session_id`` = branch, ``input_length``,
    ``output_length`` (≥ 1: we ask 1 token for a recorded 0), ``hash_ids`` = our block ids at
    ``block_size`` (``rechunk_request``, as ``simulate --block-size`` converts; chained, so equal
    ids mean an equal prefix, and one namespace for the file, which is what Dynamo's ``local``
    scope is: ids shared across plays are shared KV, like our shared tool + system prefix) plus
    a fresh id for the partial last block (private to the request in both), ``not_before_ms`` =
    a first request's pause (else 0), ``dependencies`` = one ``completion`` trigger per ``after``
    request with the pause (capped at ``max_pause_s``) as ``delay_ms``, relation ``spawn`` (first
    request of a fork / sub-agent), ``sequence`` (same branch) or ``join``. Streams ``src``
    (memory: one request and a request-id → branch map). Returns counts (requests, agents).
    Format checked against ai-dynamo 1.6.1 (``AgenticMooncakeHeader`` / ``AgenticMooncakeRow`` /
    ``AgenticDependency`` of its Rust loader).
    """
    from evolving_infra.traces.io import iter_requests
    from evolving_infra.traces.tokens import PrivateIds, rechunk_request

    header, reqs = iter_requests(src)
    private = PrivateIds()
    ordinal: dict[str, int] = {}
    branch_of: dict[str, str] = {}
    n = 0
    tmp = dst.with_name(dst.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"schema": "dynamo.agentic_mooncake", "version": 2, "block_size": block_size, "hash_id_scope": "local",
                            "source": {"format": "evolving-infra-trace", "digest": src.name}}) + "\n")
        for r in reqs:
            o = ordinal.setdefault(r.agent, len(ordinal))
            branch_of[r.id] = r.branch
            if header.block_size != block_size:
                r = rechunk_request(r, header.block_size, block_size, private)
            ids = list(r.blocks)
            if r.input_tokens % block_size:
                ids.extend(private.take(1))
            pause_ms = min(r.pause_s, max_pause_s) * 1000.0
            rel = "spawn" if r.kind in ("fork", "subagent") else None
            deps = [{"request_id": a, "trigger": "completion", "delay_ms": pause_ms,
                     "relation": rel or ("sequence" if branch_of.get(a) == r.branch else "join")} for a in r.after]
            f.write(json.dumps({
                "request_id": r.id, "play_id": r.agent, "source_play_ordinal": o, "session_id": r.branch,
                "model": r.model or "unknown", "input_length": r.input_tokens, "output_length": max(1, r.output_tokens),
                "hash_ids": ids, "not_before_ms": 0.0 if r.after else pause_ms, "dependencies": deps,
            }, separators=(",", ":")) + "\n")
            n += 1
    tmp.rename(dst)
    return {"requests": n, "agents": len(ordinal)}


class DynamoReplay:
    """NVIDIA Dynamo's offline replay in a separate venv's interpreter (``bench/_dynamo_replay.py``):
    an optional, benchmark-only dependency."""

    def __init__(self, python: str) -> None:
        self.python = python

    @staticmethod
    def find(python: str | None) -> tuple[DynamoReplay | None, str]:
        """The runner for ``python``, or None and why the side-by-side is skipped."""
        why = dynamo_skip_reason(python, "dynamo.replay", "pip install ai-dynamo-runtime, then pip install --no-deps ai-dynamo")
        return (None, why) if why else (DynamoReplay(python), "")  # type: ignore[arg-type]

    def run(self, job: dict, work: Path) -> dict:
        """One replay in a fresh process; returns ``_dynamo_replay.py``'s figures plus ``process_wall_s``
        measured from here (interpreter start included). Dynamo's per-request log lines are off
        (``DYN_LOG=error``), as ours writes none."""
        src, dst = work / "dynamo_job.json", work / "dynamo_out.json"
        src.write_text(json.dumps(job))
        t0 = time.monotonic()
        p = subprocess.run([self.python, str(Path(__file__).resolve().parent / "_dynamo_replay.py"), str(src), str(dst)],
                           capture_output=True, text=True, env={**CHILD_ENV, "DYN_LOG": "error"})
        wall = time.monotonic() - t0
        if p.returncode != 0:
            raise SystemExit(f"Dynamo replay failed:\n{p.stderr[-3000:]}")
        out = json.loads(dst.read_text())
        out["outer_wall_s"] = wall
        return out


def side_by_side(dyn: DynamoReplay, cache: Path, *, agents: int, duration: float, rounds: int,
                 block_sizes: tuple[int, ...] = (64, 512), policies: tuple[str, ...] = ("static:4P5D", "evolving"),
                 reads: tuple[str, ...] = ("plain",)) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """Ours (each policy set, each way of reading its input in ``reads``: :data:`READS`) and Dynamo's
    replay alternately, ``rounds`` rounds, on the same input; returns result rows and notes (see the
    module docstring)."""
    from shared.profile import load_profile

    prof = load_profile("gb300-glm52")
    trace = first_agents(real_trace(cache), cache / f"cc_real_64_first{agents}.jsonl.gz", agents)
    rows: list[tuple[str, str, str, str]] = []
    notes: list[str] = []
    for bs in block_sizes:
        dtrace = cache / f"cc_real_first{agents}_{bs}.agentic.jsonl"
        if not dtrace.exists():
            counts = dynamo_trace(trace, dtrace, bs)
            print(f"agentic_mooncake trace at {bs}-token blocks: {counts['requests']} requests of {counts['agents']} agents", flush=True)
        job = {"trace": str(dtrace), "block_size": bs, "prefill": 4, "decode": 5, "lanes": DYNAMO_LANES, "duration_s": duration,
               "engine": {"num_gpu_blocks": (prof.memory.gpu_kv_tokens + prof.memory.host_kv_tokens) // bs, "max_num_batched_tokens": prof.scheduler.chunk_tokens,
                          "max_num_seqs": prof.scheduler.max_running}}
        ours_trace = at_block_size(trace, cache / f"cc_real_first{agents}_at{bs}.jsonl.gz", bs)
        common = ["--nodes", "9", "--concurrency", str(DYNAMO_LANES), "--max-agents", str(agents),
                  "--max-pause", str(MAX_PAUSE_S), "--block-size", str(bs), "--duration", str(duration)]
        ours: dict[str, tuple[list[str], dict[str, str] | None]] = {}  # "policy/read" -> (args, env)
        cold: dict[str, dict] = {}
        warm_dir = Path(tempfile.mkdtemp(prefix="ei-trace-cache-"))  # the cached read's cache, warmed below
        for pol in policies:
            for how in reads:
                src = packed(ours_trace, cache / f"cc_real_first{agents}_at{bs}.eipack") if how == "packed" else ours_trace
                args = ["--trace", str(src), *common, "--policy", pol] + (["--no-trace-cache"] if how == "plain" else [])
                env = {**CHILD_ENV, "EI_TRACE_CACHE_DIR": str(warm_dir)} if how == "cached" else None
                ours[f"{pol}/{how}"] = (args, env)
                if how == "cached":  # the cold first run: parses the JSON and writes the pack (a cache of its own)
                    with tempfile.TemporaryDirectory(prefix="ei-trace-cache-cold-") as cdir, \
                            tempfile.TemporaryDirectory(prefix="ei-dyn-") as tmp:
                        c = run(args, Path(tmp) / "out", env={**CHILD_ENV, "EI_TRACE_CACHE_DIR": cdir})
                    cold[pol] = c
                    print(f"{bs}-token blocks, ours {pol} (cached), cold first run: {c['process_wall_s']:.2f} s wall, "
                          f"trace cache {c['trace_cache']}", flush=True)
        if "cached" in reads:  # warm the rounds' cache (one pack: the key is the file, not the policy)
            args, env = ours[f"{policies[0]}/cached"]
            with tempfile.TemporaryDirectory(prefix="ei-dyn-") as tmp:
                run(args, Path(tmp) / "out", env=env)
        res: dict[str, list[dict]] = {p: [] for p in ("dynamo", *ours)}
        for r in range(rounds):
            order = ("dynamo", *ours) if r % 2 == 0 else (*ours, "dynamo")
            for who in order:
                with tempfile.TemporaryDirectory(prefix="ei-dyn-") as tmp:
                    if who == "dynamo":
                        d = dyn.run(job, Path(tmp))
                        # its virtual clock runs to max_sim_time unless every play finished before
                        busy = (d["completed_trajectories"] or 0) < (d["total_trajectories"] or 0)
                        d["simulated_s"] = duration if busy else (d["duration_ms"] or 0.0) / 1000.0
                        d["speed"] = d["simulated_s"] / d["outer_wall_s"]
                        d["loop_speed"] = d["simulated_s"] / max(d["replay_wall_s"], 1e-9)
                        d["wall_s"], d["completed"] = d["outer_wall_s"], d["completed_requests"] or 0
                        res[who].append(d)
                        print(f"{bs}-token blocks, round {r}, Dynamo: {d['simulated_s']:.0f} s simulated in "
                              f"{d['outer_wall_s']:.1f} s ({d['speed']:.0f}x; replay {d['replay_wall_s']:.1f} s, "
                              f"{d['loop_speed']:.0f}x), {d['completed_requests']} requests", flush=True)
                    else:
                        args, env = ours[who]
                        rep = run(args, Path(tmp) / "out", env=env)
                        want = {"plain": "off", "cached": "hit", "packed": "off"}[who.split("/")[1]]  # packed: CHILD_ENV's cache off
                        if rep["trace_cache"] != want:  # the read is what the row says it is
                            raise SystemExit(f"ours {who}: trace cache {rep['trace_cache']}, expected {want}")
                        out_tok = _output_tokens(Path(tmp) / "out" / "requests.jsonl")
                        e = {"speed": rep["simulated_s"] / rep["process_wall_s"], "loop_speed": rep["simulated_s"] / rep["sim_wall_s"],
                             "simulated_s": rep["simulated_s"], "completed": rep["requests_completed"], **out_tok,
                             "exhausted_at": rep.get("closed_loop_exhausted_at_s"), "peak_rss_mb": rep["peak_rss_mb"],
                             "wall_s": rep["process_wall_s"]}
                        res[who].append(e)
                        print(f"{bs}-token blocks, round {r}, ours {who}: {e['simulated_s']:.0f} s simulated in "
                              f"{rep['process_wall_s']:.2f} s ({e['speed']:.0f}x; loop {rep['sim_wall_s']:.2f} s, "
                              f"{e['loop_speed']:.0f}x), {e['completed']} requests", flush=True)
        shutil.rmtree(warm_dir, ignore_errors=True)
        med = {k: (statistics.median(x["speed"] for x in v), statistics.median(x["loop_speed"] for x in v)) for k, v in res.items()}
        per_req = {k: statistics.median(1000 * x["wall_s"] / max(1, x["completed"]) for x in v) for k, v in res.items()}
        d0 = res["dynamo"][0]
        rows.append((f"Dynamo replay (4P5D, kv_router), {bs}-token blocks: sim s / wall s, whole process (replay only)",
                     f"{med['dynamo'][0]:.0f} ({med['dynamo'][1]:.0f})", "—",
                     f"median of {rounds}; {per_req['dynamo']:.2f} wall ms per completed request; "
                     f"{d0['completed_requests']} requests completed, {d0['total_input_tokens']:,} input / "
                     f"{d0['total_output_tokens']:,} output tokens, {d0['simulated_s']:.0f} s simulated (last completion at "
                     f"{d0['duration_ms'] / 1000:.0f} s), "
                     f"{d0['completed_trajectories']} of {d0['total_trajectories']} agents finished"))
        walls = {k: statistics.median(x["wall_s"] for x in v) for k, v in res.items()}
        for who in ours:
            pol, how = who.split("/")
            o0 = res[who][0]
            extra = ""
            if how == "cached":
                c = cold[pol]
                extra = (f"; input read from the trace cache (warm); the cold first run {c['process_wall_s']:.2f} s wall "
                         f"(parses the JSON and writes the pack; median warm {walls[who]:.2f} s"
                         + (f", plain {walls[pol + '/plain']:.2f} s" if pol + "/plain" in walls else "") + ")")
            rows.append((f"ours `{pol}` ({how}), {bs}-token blocks: sim s / wall s, whole process (loop only)",
                         f"{med[who][0]:.0f} ({med[who][1]:.0f})",
                         f"{med[who][0] / med['dynamo'][0]:.2f}× Dynamo ({med[who][1] / med['dynamo'][1]:.2f}× loop vs replay)",
                         f"median of {rounds}; {per_req[who]:.2f} wall ms per completed request "
                         f"({per_req['dynamo'] / per_req[who]:.2f}× Dynamo's); {o0['completed']} requests completed, {o0['input_tokens']:,} input / "
                         f"{o0['output_tokens']:,} output tokens, {o0['simulated_s']:.0f} s simulated, peak {o0['peak_rss_mb']:.0f} MiB"
                         + ("" if o0["exhausted_at"] is None else f"; agents exhausted at {o0['exhausted_at']:.0f} s") + extra))
        for how in reads:
            e, s_ = f"evolving/{how}", f"static:4P5D/{how}"
            if e in med and s_ in med:
                rows.append((f"`evolving` ÷ `static:4P5D` ({how}), {bs}-token blocks (whole process)",
                             f"{med[e][0] / med[s_][0]:.2f}", "",
                             "issue 23 target: ≥ 1/1.5 = 0.67; per completed request (static's wall ms ÷ evolving's): "
                             f"{per_req[s_] / per_req[e]:.2f} — the same input is closed-loop, so the "
                             "policy with the lower TTFT completes more requests in the same simulated time"))
    notes.append(f"side by side: the first {agents} real Claude Code sessions, {DYNAMO_LANES} concurrent agents, pauses ≤ "
                 f"{MAX_PAUSE_S:.0f} s, {duration:.0f} s simulated; whole process = interpreter start to exit (trace read "
                 "included) on both sides; Dynamo's replay-only time is its `wall_time_ms` (runtime construction and "
                 "execution), ours the simulation loop (`sim_wall_s`); both sides run with bytecode caches written "
                 "ahead (`compile_ahead`, no `PYTHONDONTWRITEBYTECODE`), as an installed package has them; ours read "
                 "its input (converted ahead to the block size) " + ", ".join(
                     {"plain": "plain = the `.jsonl.gz` parsed every run (`--no-trace-cache`)",
                      "cached": "cached = the trace cache on, warm (a pack of the `.jsonl.gz` written by a first run, "
                                "in a temporary `EI_TRACE_CACHE_DIR`)",
                      "packed": "packed = packed ahead by `trace pack`"}[h] for h in reads))
    return rows, notes


def _output_tokens(path: Path) -> dict[str, int]:
    """Prompt and output tokens of the completed requests in a ``requests.jsonl``."""
    inp = out = 0
    with open(path, "rb") as f:
        for line in f:
            r = json.loads(line)
            if r.get("ok", True) and r.get("finished_at") is not None:
                inp += r.get("prompt_tokens", 0)
                out += r.get("completion_tokens", 0)
    return {"input_tokens": inp, "output_tokens": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs; the 3,072-GPU hour is extrapolated from one partition")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of the 9x4 run (default 3, quick 2)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "ei-sim-bench"), help="trace cache directory")
    ap.add_argument("--no-append", action="store_true", help="print only; do not append to bench/RESULTS-history.md")
    ap.add_argument("--skip-3072", action="store_true", help="only the 9x4 target")
    ap.add_argument("--dynamo-python", default=os.environ.get("EI_DYNAMO_PYTHON"),
                    help="Python of a separate venv with ai-dynamo-runtime + ai-dynamo (--no-deps): adds the side-by-side "
                         "with Dynamo's offline replay (default $EI_DYNAMO_PYTHON; skipped with a message when absent)")
    ap.add_argument("--dynamo-only", action="store_true", help="only the side-by-side with Dynamo's replay")
    ap.add_argument("--dynamo-rounds", type=int, default=3, help="alternating rounds of the side-by-side (default 3)")
    ap.add_argument("--dynamo-agents", type=int, default=None,
                    help="real sessions in the side-by-side's input, the first in the trace (default all 530, quick 200: "
                         "enough that neither side runs out within the duration)")
    ap.add_argument("--dynamo-duration", type=float, default=None,
                    help="simulated seconds of each side-by-side run (default 2400, quick 300)")
    ap.add_argument("--dynamo-blocks", default="64,512", help="block sizes of the side-by-side (default 64,512)")
    ap.add_argument("--ours-reads", default=None,
                    help="side-by-side: how ours reads its input, comma-separated, each a row of its own (default plain,cached): "
                         "plain = the .jsonl.gz parsed every run (--no-trace-cache); cached = the trace cache on and warm "
                         "(a temporary EI_TRACE_CACHE_DIR; the cold first run's wall reported apart); packed = packed ahead "
                         "by 'trace pack'. All the same run")
    ap.add_argument("--ours-packed", action="store_true",
                    help="side-by-side: ours reads its input packed ahead by 'trace pack' (the same run, no JSON parsed), "
                         "as Dynamo reads its converted agentic_mooncake file: --ours-reads packed")
    a = ap.parse_args(argv)
    if a.ours_packed and a.ours_reads:
        ap.error("give --ours-reads or --ours-packed, not both")
    reads = tuple(x.strip() for x in (a.ours_reads or ("packed" if a.ours_packed else "plain,cached")).split(","))
    if not reads or any(x not in READS for x in reads) or len(set(reads)) != len(reads):
        ap.error(f"--ours-reads {a.ours_reads!r}: comma-separated, each one of {', '.join(READS)}, once")
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    repeats = a.repeats or (2 if a.quick else 3)
    hour = 3600.0
    rows: list[tuple[str, str, str, str]] = []
    notes: list[str] = []

    # ---------------------------------------------------------------- side by side with Dynamo's replay
    dyn, why = DynamoReplay.find(a.dynamo_python)
    compile_ahead(a.dynamo_python if dyn is not None else None)
    if dyn is None:
        print(why, flush=True)
        notes.append(why)
    else:
        if a.dynamo_rounds < 3:
            print(f"note: --dynamo-rounds {a.dynamo_rounds} is fewer than the 3 rounds issue 23 asks for", flush=True)
        r_, n_ = side_by_side(dyn, cache, agents=a.dynamo_agents or (200 if a.quick else 530),
                              duration=a.dynamo_duration or (300.0 if a.quick else 2400.0), rounds=a.dynamo_rounds,
                              block_sizes=tuple(int(x) for x in a.dynamo_blocks.split(",")), reads=reads)
        rows += r_
        notes += n_
    if a.dynamo_only:
        return _write(a, rows, notes)

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

    return _write(a, rows, notes)


def _write(a: argparse.Namespace, rows: list[tuple[str, str, str, str]], notes: list[str]) -> int:
    """Print the section and append it to ``bench/RESULTS-history.md`` (unless ``--no-append``)."""
    mode = ("quick" if a.quick else "full") + (", Dynamo side-by-side only" if a.dynamo_only else "")
    cmd = "python " + " ".join(["bench/sim_speed.py", *sys.argv[1:]])
    lines = [
        f"## simulator speed ({mode}) — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- command: `{cmd}`",
        f"- commit: {commit_label(REPO)}",
        f"- machine: {machine()}",
        *([] if a.dynamo_only else
          ["- workload: `trace generate claude-code --agents 500 --seed 1 --block-size 512`, `--max-pause 30`, closed loop"]),
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
