"""One simulated run: load the workload, split it over partitions, run them, merge, report.

``simulate(cfg, requests, trace_block_size)`` is the library entry point;
``evolving-infra simulate`` (``cli.py``) wraps it. Partitions (paper D.2): a
global router binds each agent to one of ``k`` partitions by a stable hash of
its agent id (CRC-32, not Python's salted ``hash``); each partition is a full,
independent cluster slice with its own router, planner and KV directory
(:class:`~evolving_infra.sim.cluster.ClusterSim`), run in its own process when
``workers > 1``. The closed-loop concurrency (or the open-loop arrival rate
and cap) is split over partitions in proportion to their agents; results are
merged into one report.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import msgspec

from evolving_infra.report.records import RequestRecord
from evolving_infra.report.timeline import RunTimeline, SplitPoint, SwitchRecord
from evolving_infra.report.write import DECISIONS_JSONL, build_report
from evolving_infra.sim.cluster import DIRECTORY_SAMPLE_S, ClusterResult, ClusterSim, SimStats
from evolving_infra.sim.config import Resolved, SimConfig, SimConfigError, node_names, resolve
from evolving_infra.sim.workload import PlainWorkload, TiledWorkload, WorkloadError
from evolving_infra.traces.compact import CompactTrace
from evolving_infra.traces.io import paused_gc
from evolving_infra.traces.schema import TraceRequest
from evolving_infra.traces.tokens import PrivateIds, rechain_blocks, rechunk_request
from shared.values import Value

"""Every planner evaluation of a simulated run (switch, no switch, skip, warm-up), one JSON per line."""


def _count_actions(decisions: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Planner evaluations per action (``switch``, ``no_switch``, ``skip``, ``warmup``)."""
    out: dict[str, int] = {}
    for d in decisions:
        a = str(d.get("action", "switch"))
        out[a] = out.get(a, 0) + 1
    return dict(sorted(out.items()))


def write_decisions(out_dir: Any, decisions: Sequence[dict[str, Any]]) -> Any:
    """Write ``decisions`` (``SimStats.planner_decisions``: each a ``PlannerDecision`` as JSON,
    or ``{ts, reason, changes, action}`` for planners without ``take_decisions``) to
    ``out_dir/decisions.jsonl``, in time order, the same records the live planner publishes on
    ``planner.decisions``. Returns the path."""
    import json
    from pathlib import Path

    path = Path(out_dir) / DECISIONS_JSONL
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for d in decisions:
            f.write(json.dumps(d, sort_keys=True, default=str) + "\n")
    return path


def warmup_outlasted(decisions: Sequence[dict[str, Any]], end_s: float, switches: int = 0) -> float | None:
    """The end (simulated s) of a planner warm-up the run never left while serving every node
    collocated, else None.

    The evolving planner serves every node collocated for its warm-up (``t_learn_s``, 1,800 s by
    default; paper §5.1) and states its end in each warm-up decision (``metrics.warmup_end``, later
    ones extending it). A run that stops before the last stated end compared collocated serving, not
    an adapted split; ``simulate --duration 900`` of the README's sample did so and said nothing,
    its "PD split final collocated" read as the planner's choice.

    The planner switches no node during its warm-up, so a run with node phase switches had them
    forced (``--switch-every``, ``--switch-at``): its nodes did not serve both phases throughout
    and it measured the forced splits, so None (``simulate --split 3P1D --switch-every 60
    --switch-to 1P3D`` printed "node phase switches 30" and then that every node served both
    phases). ``--split`` alone does not: the planner still serves collocated until the warm-up ends.

    Args:
        decisions: ``SimStats.planner_decisions`` (every evaluation, in time order).
        end_s: the run's end, simulated seconds (``report["simulated_s"]``).
        switches: the run's node phase switches (``report["switches"]``).
    """
    if switches:
        return None
    ends = [float(m["warmup_end"]) for d in decisions if isinstance(m := d.get("metrics"), dict) and "warmup_end" in m]
    return ends[-1] if ends and ends[-1] > end_s + 1e-9 else None


def warmup_outlasted_note(label: str, warm: float | None, end_s: float) -> str | None:
    """One line (no ``note:`` prefix) saying that run ``label``, which ended at ``end_s`` simulated
    seconds, did so inside its planner's collocated warm-up, which would have ended at ``warm``
    (:func:`warmup_outlasted`), with the flags that show the planner adapt; None when ``warm`` is None."""
    if warm is None:
        return None
    short = max(60, int(end_s / 3 // 60) * 60)  # a third of the run, on the planner's 60-s slices
    return (f"{label} ended at {end_s:,.0f} s, within its planner's collocated warm-up (until t={warm:,.0f} s): every "
            f"node served both phases throughout, so it measured collocated serving, not an adapted PD split; run past "
            f"the warm-up (--duration, more agents) or shorten it (--planner-opt t_learn_s={short})")


WALL_CLOCK_KEYS = ("wall_s", "sim_wall_s", "setup_wall_s", "sim_speed", "peak_rss_mb")
"""Top-level ``report.json`` keys that measure the host (wall clock, memory), not the
simulated system; with ``meta.date`` and ``meta.wall_s`` they are the only keys two runs
with the same inputs may differ in."""

_REC_ENC = msgspec.msgpack.Encoder()
_REC_DEC = msgspec.msgpack.Decoder(list[RequestRecord])


class SimRun(Value):
    """The outcome of :func:`simulate`."""

    report: dict[str, Any]
    records: list[RequestRecord]
    """Records in the report (sent at or after the warm-up), ordered by send time."""
    timeline: RunTimeline
    stats: SimStats
    resolved: Resolved

    __slots__ = __match_args__ = ("report", "records", "timeline", "stats", "resolved")

    def __init__(
        self, report: dict[str, Any], records: list[RequestRecord], timeline: RunTimeline, stats: SimStats, resolved: Resolved,
    ) -> None:
        self.report = report
        self.records = records
        self.timeline = timeline
        self.stats = stats
        self.resolved = resolved


def partition_of(agent: str, k: int) -> int:
    """The partition a user (agent) is bound to: CRC-32 of its id mod ``k`` (stable across runs)."""
    return zlib.crc32(agent.encode()) % k if k > 1 else 0


def convert_block_size(requests: Sequence[TraceRequest] | CompactTrace, from_size: int, to_size: int) -> Any:
    """Requests at the simulation's block size (``evolving_infra.traces.tokens.rechunk_request``):
    a list for a list, a :class:`~evolving_infra.traces.compact.CompactTrace` for one (converted
    request by request in the same order, so with the same ids; ``from_size`` is its header's).

    Coarser blocks (e.g. 64 → 512) are exact in what they share (chained ids) but
    round every shared prefix down to a whole coarse block, so reuse is
    under-counted by up to one block per request; finer ones cannot invent
    sharing the source did not record. Ids are chained, so the converted ids are
    usable as block hashes directly.
    """
    if isinstance(requests, CompactTrace):
        return requests.at_block_size(to_size)
    if from_size == to_size:
        return list(requests)
    private = PrivateIds()
    return [rechunk_request(r, from_size, to_size, private) for r in requests]


# ---------------------------------------------------------------------------- partitions

_FORK: dict[str, Any] = {}
"""State handed to forked partition workers (set before the pool starts, read-only after)."""


def _run_partition(k: int) -> tuple[int, bytes, RunTimeline, SimStats, list[str], dict[str, str]]:
    run: Resolved = _FORK["run"]
    res = _simulate_partition(run, k, _FORK["workload"], _FORK["keep"], _FORK["shares"][k])
    return k, _REC_ENC.encode(res.records), res.timeline, res.stats, res.nodes, dict(res.initial_phases)


@contextmanager
def quiet_gc() -> Iterator[None]:
    """Keep the cyclic GC off the loaded trace and slow down its young generations.

    The trace (millions of block ids in lists) is frozen into the permanent
    generation, and gen-0 collections run every 100,000 allocations instead of
    700: the cores allocate many small objects (blocks, events), and a full
    collection walking the trace every few thousand allocations doubled the run
    time. The collector runs during the loop even inside :func:`paused_gc` (the
    cores make cyclic garbage: radix-tree runs, queue links); the caller's state
    is restored after. Results do not depend on it.
    """
    old = gc.get_threshold()
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    gc.enable()
    try:
        yield
    finally:
        if not was_enabled:
            gc.disable()
        gc.set_threshold(*old)
        gc.unfreeze()


def _simulate_partition(run: Resolved, k: int, workload: Any, keep: set[str] | None, share: float,
                        leave: bool = False) -> ClusterResult:
    """Partition ``k``'s run. ``leave``: its :class:`ClusterSim` (the cores, the directory, every request's
    state: ~15 ms of freeing at 512-token blocks, 600 s) is not freed on return but made cyclic garbage,
    which the caller's paused GC leaves alone (:func:`simulate`'s ``leave_for_exit``)."""
    cfg = run.cfg
    names = node_names(k, run.nodes_per_partition[k], cfg.partitions)
    forced = [f for f in cfg.forced_switches if f.node in names]
    reqs = workload.partition(lambda a: partition_of(a, cfg.partitions), k, keep)
    with quiet_gc():
        sim = ClusterSim(run, reqs, names, cfg.arrival_for(share, seed_offset=k), forced=forced, blocks_of=workload.blocks_of)
        part = f"partition {k + 1}/{cfg.partitions}" if cfg.partitions > 1 else ""
        name = _FORK.get("progress")
        name = name if isinstance(name, str) else "simulate"  # a sweep names its item
        label = f"{name}, {part}" if part and name != "simulate" else (part or name)
        progress = ProgressLine(label, sim.duration, redraw=_FORK.get("progress_redraw", True)) if _FORK.get("progress") else None
        try:
            return sim.run_to_end(progress=progress)
        finally:
            if progress is not None:
                progress.close()
            if leave:  # a list that holds itself and the run: freed by a collection, not by its last reference
                left: list[Any] = [sim]
                left.append(left)
                # every tracked object into the oldest generation, the young ones' counts reset (two list splices):
                # else the run's young objects, garbage now, were the first young collection's once the caller
                # enables the GC again (cli.GC_PAUSED_COMMANDS): ~55,000 objects walked and freed, more than the
                # freeing this spares
                gc.freeze()
                gc.unfreeze()


class ProgressLine:
    """How far a simulation has got, on stderr: on a terminal one line redrawn every 0.5 s;
    otherwise (a log file, a pipe, CI) one line every ``every_s`` seconds of wall time.

    Called by :meth:`ClusterSim.run_to_end` with the simulated time (s) and the requests
    completed so far; it reads the wall clock itself.

    Args:
        label: what is running (``simulate``, ``partition 2/8``).
        duration_s: simulated seconds to run, or None (until the agents finish).
        every_s: wall seconds between lines when stderr is not a terminal.
        stream: where to write (default ``sys.stderr``).
        redraw: redraw one line on a terminal; False writes whole lines every ``every_s`` there too
            (several processes sharing one terminal: a parallel sweep's items).
    """

    def __init__(self, label: str, duration_s: float | None, every_s: float = 5.0, stream: Any = None,
                 redraw: bool = True) -> None:
        self.label = label
        self.duration_s = duration_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = redraw and bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = 0.5 if self.tty else every_s
        self.t0 = time.monotonic()
        self.next_at = self.t0 + self.every_s
        self.lines = 0

    def line(self, now: float, completed: int) -> str:
        wall = time.monotonic() - self.t0
        if self.duration_s:
            done = f"{now:,.0f} of {self.duration_s:,.0f} simulated s ({100 * min(now / self.duration_s, 1):.0f}%)"
        else:
            done = f"{now:,.0f} simulated s"
        return f"{self.label}: {done}, {completed:,} requests completed, {wall:,.0f} s wall"

    def __call__(self, now: float, completed: int) -> None:
        t = time.monotonic()
        if t < self.next_at:
            return
        self.next_at = t + self.every_s
        self.lines += 1
        if self.tty:
            self.stream.write("\r" + self.line(now, completed) + "\x1b[K")
        else:
            self.stream.write(self.line(now, completed) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End a terminal's redrawn line (its last state stays visible)."""
        if self.tty and self.lines:
            self.stream.write("\n")
            self.stream.flush()


def _decision_epochs(timelines: Sequence[RunTimeline]) -> dict[tuple[int, int], int]:
    """``(partition index, its epoch)`` → the merged timeline's epoch. Each partition's planner numbers its own
    decisions from the launch split's epoch (1) on, so two partitions' epoch 2 are two decisions: every epoch above
    1 gets a number of its own, 2, 3, ... in the order of its first decision (or point), ties by partition; the
    launch epochs stay."""
    first: dict[tuple[int, int], float] = {}
    for i, tl in enumerate(timelines):
        for key, t in [((i, p.epoch), p.t) for p in tl.split_timeline] + [((i, s.epoch), s.decided_at) for s in tl.switches]:
            first[key] = min(first.get(key, t), t)
    out = {key: key[1] for key in first if key[1] <= 1}
    later = sorted((t, i, e) for (i, e), t in first.items() if e > 1)
    out.update({(i, e): 2 + n for n, (_, i, e) in enumerate(later)})
    return out


def merge_timelines(timelines: Sequence[RunTimeline]) -> RunTimeline:
    """One cluster-wide timeline from the partitions' timelines (counts summed at every change; epochs renumbered
    so that each partition's decisions stay apart, :func:`_decision_epochs`)."""
    if len(timelines) == 1:
        return timelines[0]
    epochs = _decision_epochs(timelines)
    events: list[tuple[float, int, int, SplitPoint]] = []
    for i, tl in enumerate(timelines):
        for j, p in enumerate(tl.split_timeline):
            events.append((p.t, i, j, p))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    current: list[SplitPoint | None] = [None] * len(timelines)
    points: list[SplitPoint] = []
    for idx, (t, i, _, p) in enumerate(events):
        current[i] = p
        if idx + 1 < len(events) and events[idx + 1][0] == t:
            continue  # fold simultaneous changes into one point
        live = [c for c in current if c is not None]
        pre = sum(c.prefill for c in live)
        dec = sum(c.decode for c in live)
        name = "collocated" if all(c.split == "collocated" for c in live) else f"{pre}P{dec}D"
        points.append(
            SplitPoint(
                t=t,
                split=name,
                epoch=max(epochs[(j, c.epoch)] for j, c in enumerate(current) if c is not None),
                prefill=pre,
                decode=dec,
                switching=sum(c.switching for c in live),
                prefill_nodes=[n for c in live for n in c.prefill_nodes],
            )
        )
    switches: list[SwitchRecord] = sorted(
        (msgspec.structs.replace(s, epoch=epochs[(i, s.epoch)]) for i, tl in enumerate(timelines) for s in tl.switches),
        key=lambda s: (s.applied_at, s.node),
    )
    return RunTimeline(split_timeline=points, switches=switches)


def merge_stats(stats: Sequence[SimStats]) -> SimStats:
    out = SimStats()
    for s in stats:
        for f in ("events", "plans", "iterations", "truncations", "routed", "reroutes", "parked", "rejected",
                  "handoffs", "kv_batches", "planner_ticks", "unfinished"):
            setattr(out, f, getattr(out, f) + getattr(s, f))
        out.planner_decisions.extend(s.planner_decisions)
        out.switch_log.extend(s.switch_log)
        for f in ("pool_fetch_plans", "fetch_plans_dropped", "periodic_skipped", "resv_node_s", "resv_waiting_node_s",
                  "decode_cap_node_s"):
            setattr(out, f, getattr(out, f) + getattr(s, f))
        out.ttft_pred_abs_err.extend(s.ttft_pred_abs_err)
        out.counted_samples += s.counted_samples
        out.counted_sum += s.counted_sum
        out.counted_max = max(out.counted_max, s.counted_max)
        for key, n in s.host_evictions.items():
            out.host_evictions[key] = out.host_evictions.get(key, 0) + n
        for key, v in s.directory.items():
            out.directory[key] = out.directory.get(key, 0) + v
        for k, row in s.directory_size.items():  # partitions: one directory each, sizes add up
            acc = out.directory_size.get(k)
            out.directory_size[k] = list(row) if acc is None else [a + b for a, b in zip(acc, row)]
        out.out_of_service.extend(s.out_of_service)
        out.end_time = max(out.end_time, s.end_time)
        if s.closed_loop_exhausted_at is not None:
            out.closed_loop_exhausted_at = min(out.closed_loop_exhausted_at or s.closed_loop_exhausted_at, s.closed_loop_exhausted_at)
        out.schedule_exhausted.extend(s.schedule_exhausted)
    out.planner_decisions.sort(key=lambda d: d.get("ts", 0.0))
    out.out_of_service.sort(key=lambda o: (o[1], o[0]))
    out.switch_log.sort(key=lambda d: (d["served_at"], d["node"]))
    return out


def switch_keys(stats: SimStats) -> dict[str, Any]:
    """Report keys of the phase switches beyond the timeline's ``switches`` / ``switch_time_mean_s``.

    Over every completed node switch (as ``switches``): ``switch_drain_mean_s`` (decision →
    the last running request left), ``switch_downtime_mean_s`` (drained → serving the new
    phase: relaunch or in-place control time, the node serves nothing), ``switch_downtime_node_s``
    (their sum), ``switch_requeued`` (queued requests handed back for re-routing),
    ``switch_unique_host_share`` (of the switching nodes' L2 blocks at the decision, the share
    no other node's L2 held: what a switch that empties the node loses), and ``switch_log``
    (the first 500 switches)."""
    log = stats.switch_log
    n = len(log)
    return {
        "switch_drain_mean_s": sum(d["drain_s"] for d in log) / n if n else None,
        "switch_downtime_mean_s": sum(d["downtime_s"] for d in log) / n if n else None,
        "switch_downtime_node_s": sum(d["downtime_s"] for d in log),
        "switch_requeued": sum(d["requeued"] for d in log),
        "switch_unique_host_share": (sum(d["unique_host_blocks"] for d in log) / hb
                                     if (hb := sum(d["host_blocks"] for d in log)) else None),
        "switch_log": log[:500],
    }


def reservation_keys(stats: SimStats) -> dict[str, Any]:
    """Decode KV held by reservations made before the hand-off (paper D.1), time-averaged over the
    measured span: ``decode_kv_reserved_share`` (all pre-hand-off reservations / L1 of the nodes
    serving decode) and ``decode_kv_reserved_waiting_share`` (only requests whose prefill has not
    started: SGLang's pre-allocation while queued); None without decode capacity."""
    cap = stats.decode_cap_node_s
    return {
        "decode_kv_reserved_share": stats.resv_node_s / cap if cap > 0 else None,
        "decode_kv_reserved_waiting_share": stats.resv_waiting_node_s / cap if cap > 0 else None,
    }


def _union_length(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total


def directory_keys(stats: SimStats, block_size: int) -> dict[str, Any]:
    """Report keys of the KV directory (summed over partitions, whole run, warm-up included).

    ``host_evictions`` — L2 evictions by the evicting node's phase and the block's branch count
    there (``prefill.zero_count``, ``prefill.positive_count``, ...; paper §5.3: branch-count
    evicts positive-count blocks only when no zero-count block is left; decode nodes appear only
    when their KV events reach the directory); ``host_evictions_positive_share`` — positive-count
    share of the L2 evictions of nodes serving prefill (``prefill`` and ``both``; None without
    any); ``kv_directory`` — the directory's counters (branch starts, ends, expiries, version
    bumps, same-phase moves, evictions by count and tier) and ``end.copies.*`` (blocks by tier
    and count > 0 at the end); ``counted_kv_tokens_per_prefill_node_mean`` / ``_max`` — tokens
    of KV that active branches reference on a node serving prefill, sampled at every request
    sent (mean over sends of the mean over nodes; max over both): the host memory
    ``branch-count`` eviction needs to keep every active branch's KV; ``kv_directory_size`` —
    the directory's size over time (all partitions): one row per ``DIRECTORY_SAMPLE_S`` simulated
    seconds with a KV batch, ``{t, blocks, runs, gpu_copies, host_copies, bytes}`` (blocks
    indexed, runs of blocks, block copies per tier, estimated bytes of the index), so that its
    memory can be seen to plateau; ``kv_directory_peak_bytes`` — the largest sample."""
    ev = dict(sorted(stats.host_evictions.items()))
    z = ev.get("prefill.zero_count", 0) + ev.get("both.zero_count", 0)
    p = ev.get("prefill.positive_count", 0) + ev.get("both.positive_count", 0)
    return {
        "host_evictions": ev,
        "host_evictions_positive_share": p / (z + p) if z + p else None,
        "kv_directory": dict(sorted(stats.directory.items())),
        "counted_kv_tokens_per_prefill_node_mean": (stats.counted_sum / stats.counted_samples * block_size
                                                    if stats.counted_samples else None),
        "counted_kv_tokens_per_prefill_node_max": stats.counted_max * block_size,
        "kv_directory_size": [
            {"t": k * DIRECTORY_SAMPLE_S, "blocks": b, "runs": r, "gpu_copies": g, "host_copies": h, "bytes": n}
            for k, (b, r, g, h, n) in sorted(stats.directory_size.items())
        ],
        "kv_directory_peak_bytes": max((row[4] for row in stats.directory_size.values()), default=0),
    }


def _median(values: Sequence[float]) -> float:
    """``statistics.median`` of a non-empty sequence, the same arithmetic (the middle value, or the
    mean of the two middle ones as ``(a + b) / 2``) without importing ``statistics`` (and its
    ``fractions`` / ``decimal`` imports: ~2 ms of a simulate run's start, for one call)."""
    data = sorted(values)
    n = len(data)
    i = n // 2
    return data[i] if n % 2 else (data[i - 1] + data[i]) / 2


def peak_rss_mb() -> float:
    """Peak resident memory of this process plus its largest finished child (MiB; Linux ru_maxrss is KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + kids) / 1024.0


# ---------------------------------------------------------------------------- run


def simulate(
    cfg: SimConfig,
    requests: Sequence[TraceRequest] | CompactTrace,
    trace_block_size: int,
    *,
    meta: dict[str, Any] | None = None,
    setup_wall_s: float = 0.0,
    progress: bool | str = False,
    progress_redraw: bool = True,
    leave_for_exit: bool = False,
) -> SimRun:
    """Simulate ``requests`` (a trace at ``trace_block_size``: a list, or a
    :class:`~evolving_infra.traces.compact.CompactTrace` — same report, a fraction of the
    memory) under ``cfg`` and build the report.

    ``progress``: print how far each partition has simulated on stderr (:class:`ProgressLine`),
    labelled ``simulate`` (True) or with the string given (a sweep's item, ``dynamo (2/4)``);
    ``progress_redraw`` False: whole lines on a terminal too (processes sharing it); partitions run by
    several worker processes (``cfg.workers`` > 1) always write whole lines, each naming its partition.

    ``leave_for_exit``: for a caller that ends the process soon after (``evolving-infra simulate``, whose
    ``atexit`` ``gc.freeze`` leaves the run's cyclic garbage to the OS): the partitions run in this
    process's last partition is left as cyclic garbage when it returns, not freed object by object (~15 ms
    of a 600-s run at 512-token blocks; earlier partitions run in this process are freed as before, so
    peak memory stays that of the largest); the next full collection frees it (an in-process caller's
    memory is not lost, only held until then).

    Raises:
        SimConfigError: the configuration cannot run (bad flag, missing component).
    """
    _FORK["progress"] = progress
    _FORK["progress_redraw"] = progress_redraw
    try:
        with paused_gc():  # the loop (quiet_gc) collects; the setup around it leaves the trace alone
            return _simulate(cfg, requests, trace_block_size, meta=meta, setup_wall_s=setup_wall_s, leave=leave_for_exit)
    finally:
        _FORK.pop("progress", None)
        _FORK.pop("progress_redraw", None)


def _simulate(
    cfg: SimConfig,
    requests: Sequence[TraceRequest] | CompactTrace,
    trace_block_size: int,
    *,
    meta: dict[str, Any] | None,
    setup_wall_s: float,
    leave: bool = False,
) -> SimRun:
    wall0 = time.monotonic()
    run = resolve(cfg)
    bs = run.profile.block_size
    # ids must be chained (docs/trace-format.md §4): the engines' radix pools and the directory's
    # chained presence hooks (ClusterSim) rely on it, so every caller's input is (the CLI's already
    # is: the check is kept on the trace, not redone); unchained ids are remapped as the CLI does
    if isinstance(requests, CompactTrace):
        requests, remapped = requests.rechained()
    else:
        requests, remapped = rechain_blocks(requests)
    if remapped and (meta is None or "block_ids_rechained" not in meta):
        meta = {**(meta or {}), "block_ids_rechained": remapped}
    try:
        reqs = convert_block_size(requests, trace_block_size, bs)
    except ValueError as e:
        # name where the block size came from: the flag, else the profile (a `--profile tiny` run never gave --block-size)
        given = f"--block-size {bs}" if cfg.block_size is not None else f"the profile {run.profile.name!r}'s block size {bs}"
        raise SimConfigError(f"{given}: cannot convert the trace's {trace_block_size}-token blocks ({e})") from e
    blocks_of = None
    if isinstance(reqs, CompactTrace):  # stubs; their ids are rebuilt as each is sent
        blocks_of = reqs.blocks_of
        reqs = reqs.requests
    if cfg.max_pause_s is not None:
        cap = cfg.max_pause_s
        reqs = [r if r.pause_s <= cap else msgspec.structs.replace(r, pause_s=cap) for r in reqs]
    k = cfg.partitions
    try:
        workload: Any = (TiledWorkload(reqs, cfg.tile, blocks_of=blocks_of) if cfg.tile != 1
                         else PlainWorkload(reqs, blocks_of=blocks_of))
    except WorkloadError as e:
        raise SimConfigError(str(e)) from e
    agents = workload.agents
    keep: set[str] | None = None
    if cfg.max_agents is not None:
        # keep the first max_agents agents of the input (as ReplayCore does for one cluster)
        agents = agents[: cfg.max_agents]
        keep = set(agents)
    counts = [0] * k
    for a in agents:
        counts[partition_of(a, k)] += 1
    n_agents = max(len(agents), 1)
    shares = [c / n_agents for c in counts]
    conv_s = time.monotonic() - wall0
    t0 = time.monotonic()
    results: list[tuple[list[RequestRecord], RunTimeline, SimStats, list[str], dict[str, str]]] = [None] * k  # type: ignore[list-item]
    if k == 1 or cfg.workers == 1:
        for i in range(k):
            # only the last is left: an earlier one left as garbage would be out of reach of every collection
            # of the next partition's loop (quiet_gc freezes), so memory would grow as the sum of the partitions
            r = _simulate_partition(run, i, workload, keep, shares[i], leave=leave and i == k - 1)
            results[i] = (r.records, r.timeline, r.stats, r.nodes, dict(r.initial_phases))
    else:
        from evolving_infra.sim.pool import fork_pool  # (signal, process pools: a one-process run does without)

        _FORK.update(run=run, workload=workload, keep=keep, shares=shares)
        if min(cfg.workers, k) > 1:  # processes sharing stderr: whole lines, not \r redraws over each other's
            _FORK["progress_redraw"] = False
        try:
            with fork_pool(min(cfg.workers, k)) as pool:
                for i, blob, tl, st, nodes, phases in pool.map(_run_partition, range(k)):
                    results[i] = (_REC_DEC.decode(blob), tl, st, nodes, phases)
        finally:
            _FORK.clear()
    sim_wall = time.monotonic() - t0
    records = [rec for res in results for rec in res[0]]
    records.sort(key=lambda r: (r.sent_at, r.id))
    timeline = merge_timelines([res[1] for res in results])
    stats = merge_stats([res[2] for res in results])
    nodes = [n for res in results for n in res[3]]
    kept = [r for r in records if r.sent_at >= cfg.warmup_s]
    wall = time.monotonic() - wall0 + setup_wall_s
    end = stats.end_time
    lo = cfg.warmup_s
    oos = [(s, e) for _, s, e in stats.out_of_service]
    node_s = sum(max(0.0, min(e, end) - max(s, lo)) for s, e in oos)
    span = max(end - lo, 1e-9)
    ps = run.policy
    extra: dict[str, Any] = {
        "wall_s": wall,
        "sim_wall_s": sim_wall,
        "setup_wall_s": setup_wall_s + conv_s,
        "sim_speed": end / wall if wall > 0 else None,
        "peak_rss_mb": peak_rss_mb(),
        "simulated_s": end,
        "requests_unfinished": stats.unfinished,
        "closed_loop_exhausted_at_s": stats.closed_loop_exhausted_at,
        "schedule_exhausted": sorted(stats.schedule_exhausted, key=lambda w: (w["exhausted_at_s"], w["prefix"])),
        "requests_warmup_excluded": len(records) - len(kept),
        "relaunches": len(stats.out_of_service),
        "out_of_service_node_s": node_s,
        "out_of_service_share": _union_length(oos, lo, end) / span,
        "reroutes": stats.reroutes,
        **switch_keys(stats),
        **reservation_keys(stats),
        "sim_stats": {
            "events": stats.events,
            "plans": stats.plans,
            "iterations": stats.iterations,
            "truncations": stats.truncations,
            "routed": stats.routed,
            "parked": stats.parked,
            "rejected": stats.rejected,
            "handoffs": stats.handoffs,
            "kv_batches": stats.kv_batches,
            "planner_ticks": stats.planner_ticks,
            "planner_evaluations": len(stats.planner_decisions),
            "pool_fetch_plans": stats.pool_fetch_plans,
            "fetch_plans_dropped": stats.fetch_plans_dropped,
            "periodic_skipped": stats.periodic_skipped,
        },
        "planner_decisions": [d for d in stats.planner_decisions if d.get("action", "switch") == "switch"][:500],
        "planner_evaluations_by_action": _count_actions(stats.planner_decisions),
        "planner_decisions_file": DECISIONS_JSONL,
        "out_of_service": [list(o) for o in stats.out_of_service],
    }
    extra.update(directory_keys(stats, bs))
    if stats.ttft_pred_abs_err:
        # the router core's own samples, warm-up included (the report's
        # ttft_prediction_abs_error_median_s comes from the measured records)
        extra["ttft_prediction_abs_error_median_all_s"] = _median(stats.ttft_pred_abs_err)
    if timeline.split_timeline and timeline.split_timeline[-1].split:
        extra["final_split"] = timeline.split_timeline[-1].split
    m: dict[str, Any] = {
        "command": "simulate",
        "label": cfg.label or ps.name,
        "argv": sys.argv[1:],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cluster": {
            "nodes": cfg.nodes,
            "gpus_per_node": run.profile.gpus_per_node,
            "gpus": cfg.nodes * run.profile.gpus_per_node,
            "split": run.split,
            "profile": run.profile.name,
            "routing": ps.routing,
            "partitions": k,
            "node_ids": nodes if len(nodes) <= 64 else nodes[:64] + ["..."],
        },
        "policy": asdict(ps),
        "planner_source": run.planner_source,
        "block_size": bs,
        "trace_block_size": trace_block_size,
        "host_kv_tokens": run.profile.memory.host_kv_tokens,
        "gpu_kv_tokens": run.profile.memory.gpu_kv_tokens,
        "relaunch_s": cfg.relaunch_s,
        "switch_control_s": cfg.switch_control_s,
        "switch_every_s": cfg.switch_every_s,
        "switch_to": cfg.switch_to,
        "pool_fetch_min_tokens": cfg.pool_fetch_min_tokens,
        "arrival": {
            "kind": cfg.arrival,
            "concurrency": cfg.concurrency if cfg.arrival == "closed" else None,
            "rate_per_min": cfg.arrival_rate if cfg.arrival == "open" else None,
            "cap": cfg.cap if cfg.arrival == "open" else None,
        },
        "duration_s": cfg.duration_s,
        "warmup_s": cfg.warmup_s,
        "max_pause_s": cfg.max_pause_s,
        "tile": cfg.tile,
        "agents": len(agents),
        "seed": cfg.seed,
        "workers": cfg.workers,
        "state_staleness_s": cfg.state_staleness_s,
        "msg_latency_s": cfg.msg_latency_s,
        "wall_s": wall,
    }
    if cfg.ingress_s or cfg.ingress_s_per_token or cfg.egress_s:  # only when modelled: plain runs' meta unchanged
        m["control_plane"] = {"ingress_s": cfg.ingress_s, "ingress_s_per_token": cfg.ingress_s_per_token, "egress_s": cfg.egress_s}
    if meta:
        m.update(meta)
    report = build_report(kept, meta=m, extra=extra, timeline=timeline)
    return SimRun(report=report, records=kept, timeline=timeline, stats=stats, resolved=run)
