"""``evolving-infra simulate`` and ``evolving-infra fidelity``.

``simulate`` runs a trace (or a generated workload) through the discrete-event
simulator (``evolving_infra.sim``) and writes the same ``report.json``,
``requests.jsonl``, plots and ``report.html`` as a live replay; ``--sweep``
runs several policy sets or splits on the same input and writes a comparison.
``fidelity`` runs one small trace through the live stack and the simulator and
prints the relative differences (``evolving_infra.sim.fidelity``).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evolving_infra.policy_args import add_policy_args
from evolving_infra.stdio_args import STDIO, folder, shown, stdin_file
from evolving_infra.sim.policies import DEFAULT_RELAUNCH_S, SWITCH_MODES
from shared.config import parse_key_values

if TYPE_CHECKING:
    from evolving_infra.sim.config import ForcedSwitch, SimConfig
    from evolving_infra.traces.cache import CachedTrace
    from evolving_infra.traces.inflate import InflateAhead

# The simulator itself (evolving_infra.sim.config and what it imports: numpy, the services' cores)
# is imported by the functions that use it, not here: `simulate` starts inflating its trace on a
# thread (cmd_simulate) before it imports them, so that the two overlap.


def parse_options(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``["k=v", ...]`` → dict with ints, floats, booleans and None decoded.

    Raises:
        SimConfigError: an item without ``=``.
    """
    from evolving_infra.sim.config import SimConfigError

    try:
        return parse_key_values(items or [], flag)
    except ValueError as e:
        raise SimConfigError(str(e)) from None


def parse_switch(item: str) -> ForcedSwitch:
    """``T:NODE:PHASE`` (e.g. ``600:w3:prefill``).

    Raises:
        SimConfigError: on a malformed item.
    """
    from evolving_infra.sim.config import ForcedSwitch, SimConfigError

    parts = item.split(":")
    if len(parts) != 3 or parts[2] not in ("prefill", "decode", "both"):
        raise SimConfigError(f"--switch-at {item!r} must look like SECONDS:NODE:prefill|decode|both")
    try:
        t = float(parts[0])
    except ValueError:
        raise SimConfigError(f"--switch-at {item!r}: {parts[0]!r} is not a number of seconds") from None
    return ForcedSwitch(t=t, node=parts[1], phase=parts[2])


def parse_slow(item: str) -> tuple[str, float]:
    """``NODE:FACTOR`` (e.g. ``w0:5``).

    Raises:
        SimConfigError: on a malformed item.
    """
    from evolving_infra.sim.config import SimConfigError

    node, sep, factor = item.rpartition(":")
    try:
        if not sep or not node:
            raise ValueError
        return node, float(factor)
    except ValueError:
        raise SimConfigError(f"--slow-node {item!r} must look like NODE:FACTOR (e.g. w0:5)") from None


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` the flags describe.

    Raises:
        SimConfigError: contradictory or malformed flags.
    """
    from evolving_infra.sim.config import SimConfig, SimConfigError

    if args.arrival_rate is not None and args.concurrency is not None:
        raise SimConfigError("give --concurrency (closed loop) or --arrival-rate (open loop), not both")
    if args.arrival_rate is not None:
        arrival, rate, conc = "open", args.arrival_rate, 16
    elif args.trace_arrivals:
        arrival, rate, conc = "trace", 1.0, 16
    else:
        arrival, rate, conc = "closed", 1.0, args.concurrency if args.concurrency is not None else 16
    return SimConfig(
        nodes=args.nodes,
        profile=args.profile,
        gpus_per_node=args.gpus_per_node,
        host_capacity_tokens=args.host_capacity_tokens,
        gpu_kv_tokens=args.gpu_kv_tokens,
        block_size=args.block_size,
        policy=args.policy,
        split=args.split,
        routing=args.routing,
        decode_routing=args.decode_routing,
        planner=args.planner,
        eviction=args.eviction,
        decode_binding=args.decode_binding,
        switch_mode=args.switch_mode,
        relaunch_s=args.relaunch_s,
        routing_options=parse_options(args.routing_opt, "--routing-opt"),
        planner_options=parse_options(args.planner_opt, "--planner-opt"),
        arrival=arrival,
        concurrency=conc,
        arrival_rate=rate,
        cap=args.cap,
        duration_s=args.duration,
        warmup_s=args.warmup,
        seed=args.seed,
        agent_order=args.agent_order,
        max_agents=args.max_agents,
        max_pause_s=args.max_pause,
        tile=args.tile,
        partitions=args.partitions,
        workers=args.workers,
        state_staleness_s=args.state_staleness_s,
        msg_latency_s=args.msg_latency_s,
        ingress_s=args.ingress_s,
        ingress_s_per_token=args.ingress_s_per_token,
        egress_s=args.egress_s,
        forced_switches=tuple(parse_switch(s) for s in args.switch_at or ()),
        switch_every_s=args.switch_every,
        switch_to=args.switch_to,
        switch_control_s=args.switch_control_s,
        pool_fetch_min_tokens=args.pool_fetch_min_tokens,
        label=args.label,
        node_slowdown=tuple(parse_slow(s) for s in getattr(args, "slow_node", None) or ()),
    )


def load_workload(args: argparse.Namespace, ahead: InflateAhead | None = None,
                  cached: CachedTrace | None = None) -> tuple[Any, int, dict[str, Any]]:
    """The requests to replay (a ``--trace`` as a ``traces.compact.CompactTrace``, a generated
    workload as a list of requests), their block size, and provenance for ``meta``.

    ``ahead``: the ``--trace`` file already being inflated on a thread (:func:`inflate_ahead`).
    ``cached``: the ``--trace`` file's place in the trace cache (:func:`trace_cache_lookup`): its pack
    read when there (the same trace, no JSON parsed), else the file read and its pack written there.

    Raises:
        SimConfigError: no input, an unreadable trace or one of no request, or bad generator options.
    """
    from evolving_infra.sim.config import SimConfigError
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.io import NO_REQUESTS, TraceError, trace_identity

    if bool(args.trace) == bool(args.workload):
        raise SimConfigError("give exactly one of --trace FILE or --workload KIND")
    if args.trace:
        trace = cached.load() if cached is not None and cached.present else None
        if trace is None:
            try:  # held compactly (stubs + prefix differences): ~8 bytes per new block id, not ~40 per id
                trace = read_trace_compact(Path(stdin_file(args.trace)), ahead=ahead)
            except TraceError as e:
                raise SimConfigError(shown(f"--trace: {e}")) from e
            except OSError as e:  # as demo and fidelity say it (simulate gave "--trace: [Errno 2] No such file ...")
                raise SimConfigError(shown(f"--trace: {args.trace}: cannot read: {e}")) from e
            if cached is not None and trace.requests:  # as read, before rechaining: a hit rechains the same
                cached.store(trace)
        if not trace.requests:
            raise SimConfigError(f"--trace: {args.trace}: {NO_REQUESTS}")
        trace, remapped = trace.rechained()
        # trace_source + trace_requests (+ trace_block_size, from meta): the input's identity for report compare,
        # whichever file held it (the .jsonl.gz or the .eipack packed from it)
        prov: dict[str, Any] = {"trace": str(args.trace), **trace_identity(trace.header, trace.requests)}
        if remapped:
            print(f"note: {args.trace}: {remapped} block occurrences followed another prefix than their id's first "
                  "occurrence (ids must be chained, docs/trace-format.md); remapped to fresh ids", file=sys.stderr)
            prov["block_ids_rechained"] = remapped
        return trace, trace.header.block_size, _with_periods(prov, trace.header.meta)
    from evolving_infra.traces.generate import GenerateError, generate

    try:
        made = generate(
            args.workload,
            seed=args.workload_seed,
            agents=args.agents,
            duration_s=args.agent_duration,
            block_size=64,
        )
    except GenerateError as e:
        raise SimConfigError(f"--workload: {e}") from e
    return made.requests, made.header.block_size, _with_periods(
        {"workload": args.workload, "workload_seed": args.workload_seed, "trace_source": made.header.source}, made.header.meta
    )


def _with_periods(prov: dict[str, Any], header_meta: dict[str, Any]) -> dict[str, Any]:
    """``prov`` plus the trace's period schedule (``trace generate shift``), if it has one:
    ``schedule_periods`` (the header's table) and ``periods`` (``{name, start_s, end_s}``, per-period metrics)."""
    if header_meta.get("periods"):
        from evolving_infra.sim.schedule import period_table

        prov["schedule_periods"] = header_meta["periods"]
        prov["periods"] = period_table(header_meta)
    return prov


def apply_schedule(cfg: SimConfig, args: argparse.Namespace, prov: dict[str, Any]) -> SimConfig:
    """A trace with a period schedule runs it (closed loops per pool, ``evolving_infra.sim.schedule``)
    unless an arrival process is given (``--concurrency``, ``--arrival-rate``, ``--trace-arrivals``);
    then its periods are dropped from ``prov``.

    Raises:
        SimConfigError: a malformed schedule.
    """
    from evolving_infra.sim.config import SimConfigError

    table = prov.pop("schedule_periods", None)
    if table is None:
        return cfg
    if args.concurrency is not None or args.arrival_rate is not None or args.trace_arrivals:
        prov.pop("periods", None)
        return cfg
    from dataclasses import replace

    from evolving_infra.sim.schedule import windows_from_meta

    try:
        return replace(cfg, schedule=windows_from_meta({"periods": table}))
    except ValueError as e:
        raise SimConfigError(str(e)) from e


def trace_cache_lookup(args: argparse.Namespace) -> CachedTrace | None:
    """The ``--trace`` file's place in the trace cache (``evolving_infra.traces.cache``), or None: no
    trace file (a workload, stdin), ``--no-trace-cache``, ``EI_TRACE_CACHE_DIR=off``, or a file the
    cache does not keep (a pipe, a pack). Standard library only: looked up before the simulator is
    imported, so that a hit skips :func:`inflate_ahead`.

    Raises:
        TraceCacheError: ``EI_TRACE_CACHE_MAX_BYTES`` is malformed.
    """
    if not args.trace or args.workload or args.trace == STDIO or getattr(args, "no_trace_cache", False):
        return None
    from evolving_infra.traces.cache import lookup

    return lookup(args.trace)


def inflate_ahead(args: argparse.Namespace) -> InflateAhead | None:
    """A gzip ``--trace`` being inflated on a thread from now (``traces.inflate.InflateAhead``), or
    None (no trace, a plain or packed one, one that cannot be opened: read as before). Started
    before the simulator is imported, so that on a second core the trace's inflating overlaps
    the imports and the parsing (~0.6 s of CPU at 64-token blocks for the 260-session CC trace)."""
    if not args.trace or args.workload or args.trace == STDIO:  # stdin is read whole first (load_workload)
        return None
    from evolving_infra.traces.inflate import InflateAhead

    return InflateAhead.start(Path(args.trace))


def cmd_simulate(args: argparse.Namespace) -> int:
    """``evolving-infra simulate``: the run with the cyclic GC paused outside its loop
    (``evolving_infra.traces.io.paused_gc``: no collection walks the trace while it loads), and
    frozen at the process's exit (``atexit`` → ``gc.freeze``: the run's cyclic garbage is left to
    the OS, not collected just before the process ends)."""
    from evolving_infra.traces.cache import TraceCacheError

    try:
        cached = trace_cache_lookup(args)
    except TraceCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ahead = None if cached is not None and cached.present else inflate_ahead(args)  # a hit inflates nothing
    from evolving_infra.traces.io import paused_gc

    # At exit, before the interpreter's last collections: the run leaves cyclic garbage (the
    # cluster's objects refer to one another) that those would walk and free one by one, only
    # for the process to end: ~0.1 s of CPU after a 600-s run at 64-token blocks (~0.04 s at 512).
    # Frozen objects are left to the OS; nothing of the run needs a finalizer (every file it
    # writes is closed before the command returns). Registered once however often this runs.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    try:
        with paused_gc():
            return _cmd_simulate(args, ahead, cached)
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback from wherever the loop was
        print(f"\nsimulate: interrupted; a run that had not finished wrote no report under {args.out}", file=sys.stderr)
        return 130
    finally:
        if ahead is not None:  # (read to its end, it is closed already)
            ahead.close()


def _cmd_simulate(args: argparse.Namespace, ahead: InflateAhead | None = None, cached: CachedTrace | None = None) -> int:
    import evolving_infra.report.write  # noqa: F401 - imported here, as the run's modules, while the trace inflates
    import evolving_infra.sim.run  # noqa: F401 - (inflate_ahead); used by _simulate_held
    from evolving_infra.sim.config import SimConfigError
    from evolving_infra.traces.io import output_error

    t0 = time.monotonic()
    try:
        cfg = config_from_args(args)
        why = output_error(args.out, directory=True)
        if why:  # before the trace is read and the run made, not after
            raise SimConfigError(why)
    except SimConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    from contextlib import ExitStack

    from evolving_infra.out_folder import OutFolderError, check_previous_run, hold_new_out

    with ExitStack() as held:  # OUT's lock (hold_out), from before the input is read to the end of the report
        try:  # before the input is read: a second run into OUT stops here, as replay's and demo's do
            hold_new_out(held, out)  # OUT made and held; taken back after the lock's release when left empty
            if not args.sweep:  # a sweep writes no file of those names in OUT
                check_previous_run(out)  # its refusals now; the set-aside itself once the run has ended
        except (OutFolderError, OSError) as e:
            print(f"error: --out {out}: {e}", file=sys.stderr)
            return 2
        try:
            requests, bs, prov = load_workload(args, ahead, cached)
            cfg = apply_schedule(cfg, args, prov)
        except SimConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return _simulate_held(args, cfg, requests, bs, prov, time.monotonic() - t0, out, _cache_state(args, cached))


def _cache_state(args: argparse.Namespace, cached: CachedTrace | None) -> str | None:
    """What the summary line says of the trace cache: ``hit``, ``miss`` (the file read; its pack
    written now, or not kept), ``off`` (``--no-trace-cache`` or ``EI_TRACE_CACHE_DIR=off``), or None
    (no trace file the cache keeps: a workload, stdin, a pipe, a pack). Not in ``report.json``: a
    run's report is the same whichever way its trace was read."""
    if cached is not None:
        return cached.status
    if not args.trace or args.workload or args.trace == STDIO:
        return None
    from evolving_infra.traces.cache import cache_dir

    return "off" if getattr(args, "no_trace_cache", False) or cache_dir() is None else None


def _simulate_held(args: argparse.Namespace, cfg: SimConfig, requests: Any, bs: int, prov: dict[str, Any],
                   setup: float, out: Path, trace_cache: str | None = None) -> int:
    """The run (or sweep) of :func:`_cmd_simulate` once it holds ``out``; returns the exit code.
    ``trace_cache``: what the summary line says of the trace cache (:func:`_cache_state`)."""
    from evolving_infra.report.write import print_summary, report_line, write_report
    from evolving_infra.replay.core import ReplayError
    from evolving_infra.sim.config import SimConfigError, l1_overflow_note, seed_unused_note
    from evolving_infra.sim.planners import ComponentMissing
    from evolving_infra.sim.run import simulate, warmup_outlasted, warmup_outlasted_note, write_decisions

    try:  # only with --gpu-kv-tokens: one pass over the input's lengths
        if too_long := l1_overflow_note(cfg, getattr(requests, "requests", requests)):
            print(f"note: {too_long}", file=sys.stderr)
    except SimConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.sweep:
        from evolving_infra.sim.sweep import run_sweep

        try:
            return run_sweep(cfg, requests, bs, args.sweep, out, meta=prov, plots=not args.no_plots, parallel=args.sweep_workers)
        except (SimConfigError, ComponentMissing, ReplayError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # an item's report could not be written (disk full, ...)
            print(f"error: {out}: cannot write: {e}", file=sys.stderr)
            return 2
    if unused := seed_unused_note([cfg]):
        print(f"note: {unused}", file=sys.stderr)
    try:
        res = simulate(cfg, requests, bs, meta=prov, setup_wall_s=setup, progress=True, leave_for_exit=True)
    except (SimConfigError, ComponentMissing, ReplayError) as e:  # a component's bad option (--planner-opt ...) names itself
        print(f"error: {e}", file=sys.stderr)
        return 2
    from evolving_infra.out_folder import OUTPUTS_ELSEWHERE, OutFolderError, set_aside_or_elsewhere

    try:  # only now, before the first output: a run that failed or was interrupted leaves the earlier one's in place;
        dest = set_aside_or_elsewhere(out, "simulate")  # refused now: the outputs to OUT/run-<id>/ (named on stderr)
    except OutFolderError as e:
        print(f"error: --out {out}: {e}; this run's report was not written", file=sys.stderr)
        return 2
    if dest != out:  # its report names the folder it is in
        res.report.setdefault("meta", {})["run_id"] = dest.name.removeprefix("run-")
    try:  # OUT was made before the run (hold_out); taken back by the caller when left empty
        path = write_report(dest, res.report, res.records, plots=not args.no_plots)
        write_decisions(dest, res.stats.planner_decisions)
    except OSError as e:
        print(f"error: {dest}: cannot write: {e}", file=sys.stderr)
        if dest != out:  # its OUT/run-<id>/, made for this report: not left empty
            try:
                dest.rmdir()
            except OSError:
                pass
        return 2
    print_summary(res.report)
    r = res.report
    print(
        f"simulated {r['simulated_s']:.0f} s in {r['wall_s']:.1f} s wall ({r['sim_speed']:.0f}x), "
        f"relaunches {r['relaunches']}, a node out of service {100 * r['out_of_service_share']:.1f}% of the time "
        f"({r['out_of_service_node_s']:,.0f} node-s), "
        f"reroutes {r['reroutes']}, unfinished {r['requests_unfinished']}"
        + (f", trace cache {trace_cache}" if trace_cache else "")
    )
    if late := warmup_outlasted_note("the run", warmup_outlasted(res.stats.planner_decisions, r["simulated_s"], r.get("switches") or 0), r["simulated_s"]):
        print(f"note: {late}")
    if r.get("closed_loop_exhausted_at_s") is not None:
        print(f"note: the input ran out of agents at {r['closed_loop_exhausted_at_s']:.0f} s (closed loop: concurrency "
              "fell from then on); give more agents (--workload --agents, or --tile)")
    for w in r.get("schedule_exhausted") or []:
        print(f"warning: pool {w['prefix']!r} ({w['agents']} agents) ran dry at {w['exhausted_at_s']:.0f} s, before its "
              f"period ends at {w['end_s']:.0f} s: its concurrency fell from {w['concurrency']} from then on, so later "
              "windows measure the pool, not the cluster; generate more agents ('trace generate shift')", file=sys.stderr)
    print(report_line(path))
    if dest != out:  # OUT/report.json is still the earlier run's: a script reading it must know
        return OUTPUTS_ELSEWHERE
    return 0 if r["requests_failed"] == 0 else 1


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("input")
    src.add_argument("--trace", default=None, help="canonical trace (.jsonl or .jsonl.gz; - reads stdin), or one packed by 'trace pack' (the same run, loaded without parsing JSON); "
                     "a .jsonl[.gz] file is packed into the trace cache on its first run and read from there while unchanged (--no-trace-cache)")
    src.add_argument("--no-trace-cache", action="store_true",
                     help="read --trace FILE's JSON every run: no pack of it read from or written to the trace cache. "
                     "The cache (default on): the first run of a .jsonl[.gz] FILE writes its pack (docs/trace-format.md §10.1) to "
                     "$EI_TRACE_CACHE_DIR, else $XDG_CACHE_HOME/evolving-infra/traces, else ~/.cache/evolving-infra/traces; later "
                     "runs of the unchanged FILE (same path, size, mtime, inode) read the pack: the same run, no JSON parsed. "
                     "EI_TRACE_CACHE_DIR=off turns it off for every run; EI_TRACE_CACHE_MAX_BYTES caps the packs' total size "
                     "(default 4 GiB, least recently used evicted). A damaged pack is read around and replaced; a cache that "
                     "cannot be written is a note, never a failed run; a FILE whose block ids are not chained (remapped every "
                     "run) keeps no pack. The summary line says 'trace cache hit|miss|off'")
    src.add_argument("--workload", default=None, choices=("putnam", "claude-code", "osworld", "shift"),
                     help="generate this workload instead of reading a trace (evolving_infra.traces.generate)")
    src.add_argument("--agents", type=int, default=None, help="--workload: agents to generate (default per workload)")
    src.add_argument("--agent-duration", type=float, default=None, help="--workload: busy seconds per generated agent")
    src.add_argument("--workload-seed", type=int, default=0, help="--workload: generator seed (default 0)")
    src.add_argument("--max-agents", type=int, default=None, help="replay only the first N agents of the input (default: all)")
    src.add_argument("--tile", type=int, default=1,
                     help="replay every agent this many times as distinct agents (private block ids per copy), "
                     "for clusters larger than the trace (default 1: each agent once)")
    src.add_argument("--max-pause", type=float, default=None,
                     help="cap every pause (tool/think time) at this many seconds (30 s reproduces the paper's CC mean pause; default: the recorded pauses, uncapped)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=9, help="nodes (default 9)")
    c.add_argument("--gpus-per-node", type=int, default=None,
                   help="must equal the profile's gpus_per_node (a profile is one node; write a profile for another size)")
    c.add_argument("--profile", default="gb300-glm52", help="node profile name or TOML path (default gb300-glm52)")
    c.add_argument("--split", default=None, help="initial split xPyD (default: the policy set's, else round(2N/3) prefill); "
                   "one other than a static:xPyD set's own is served and names the set (static:5P1D --split 3P1D: static:3P1D)")
    c.add_argument("--host-kv-tokens", "--host-capacity-tokens", dest="host_capacity_tokens", type=int, default=None, metavar="N",
                   help="per-node L2 (host) KV capacity in tokens, the profile's memory.host_kv_tokens overridden (default, or 0: "
                   "the profile's); --host-kv-tokens as 'up' names it, --host-capacity-tokens the same flag; a multiple of "
                   "the block size, >= the GPU KV capacity")
    c.add_argument("--gpu-kv-tokens", type=int, default=None, metavar="N",
                   help="per-node L1 (GPU) KV capacity in tokens, the profile's memory.gpu_kv_tokens overridden (default, "
                   "or 0: the profile's), a multiple of the block size, as up's flag; alone and above the profile's host "
                   "KV it raises that to match; with a small --host-kv-tokens, a small trace fills both tiers and "
                   "exercises eviction. A request longer than it (prompt + output) fails (status 500) and the run "
                   "exits 1; a note before the run counts them")
    c.add_argument("--block-size", type=int, default=None,
                   help="simulation block size in tokens; the trace is converted (e.g. 512 for speed; default: the profile's)")
    c.add_argument("--partitions", type=int, default=1, help="partitions (paper D.2): agents bound by hash, one cluster slice each (default 1)")
    c.add_argument("--workers", type=int, default=1, help="processes running partitions in parallel (default 1)")
    c.add_argument("--slow-node", action="append", metavar="NODE:FACTOR",
                   help="that node's engine runs FACTOR times slower than the profile (router and planner not told; "
                   "repeatable; what-if runs of the online per-node models)")
    pol = add_policy_args(p, live=False)
    pol.add_argument("--switch-mode", default=None, choices=SWITCH_MODES,
                     help="phase switch mechanics: decoupled = drain in place, KV kept in a pool every prefill node "
                     "reads (paper §4; inplace = alias); relaunch = Dynamo (downtime --relaunch-s, KV lost); "
                     "strand = Arrow (in place, KV lost); none (default: the set's: decoupled for evolving, none for static, "
                     "relaunch for dynamo, strand for arrow)")
    pol.add_argument("--switch-control-s", type=float, default=0.0,
                     help="in-place switches: seconds from the end of the drain to serving the new phase (default 0)")
    pol.add_argument("--relaunch-s", type=float, default=DEFAULT_RELAUNCH_S, help=f"relaunch downtime (default {DEFAULT_RELAUNCH_S:g} s)")
    pol.add_argument("--switch-at", action="append", metavar="T:NODE:PHASE", help="force a phase switch (repeatable)")
    pol.add_argument("--switch-every", type=float, default=None, metavar="SECONDS",
                     help="force a split change every SECONDS, alternating between --split and --switch-to "
                     "(fewest nodes changed)")
    pol.add_argument("--switch-to", default=None, metavar="xPyD", help="the other split of --switch-every")
    pol.add_argument("--pool-fetch-min-tokens", type=int, default=512,
                     help="decoupled data plane, routers that plan no fetch (cache-aware, ...): smallest peer fetch "
                     "made while queued, in tokens (default 512, as the ttft router)")
    a = p.add_argument_group("arrivals and run length")
    a.add_argument("--concurrency", type=int, default=None, help="closed loop: concurrent agents (default 16)")
    a.add_argument("--arrival-rate", type=float, default=None, help="open loop: Poisson agent arrivals per minute")
    a.add_argument("--cap", type=int, default=0, help="open loop: most agents running at once (0 = no cap)")
    a.add_argument("--trace-arrivals", action="store_true", help="agents start at their recorded arrival_s")
    a.add_argument("--duration", type=float, default=None, help="stop at this simulated second (default: when the input is exhausted)")
    a.add_argument("--warmup", type=float, default=0.0, help="leave requests sent before this second out of the metrics")
    a.add_argument("--seed", type=int, default=0,
                   help="seed of what draws at random (default 0): the open loop's arrival times (--arrival-rate), the "
                   "agents' order under --agent-order shuffled, and dynamo-kv routing with --routing-opt dynamo_temperature>0. "
                   "In a closed loop or with --trace-arrivals, agents in trace order and no such routing it moves nothing: every "
                   "seed gives the same run (only meta.seed differs; a note says so). The evolving planner's fit reservoir "
                   "takes --planner-opt seed=N instead")
    a.add_argument("--agent-order", choices=("trace", "shuffled"), default="trace",
                   help="order in which the input's agents enter (closed and open loops): as in the trace (default), "
                   "or shuffled by --seed (another sample of sessions, for run-to-run spread)")
    s = p.add_argument_group("simulation")
    s.add_argument("--state-staleness-s", type=float, default=0.0, help="router sees node states at most this old (default 0)")
    s.add_argument("--msg-latency-s", type=float, default=0.0, help="constant message latency (default 0)")
    s.add_argument("--ingress-s", type=float, default=0.0,
                   help="control plane: send -> routing decision and work on the prefill node, fixed part "
                   "(s; default 0; `fidelity` measures it on the live stack)")
    s.add_argument("--ingress-s-per-token", type=float, default=0.0,
                   help="control plane: the ingress part per prompt token (s/token; default 0)")
    s.add_argument("--egress-s", type=float, default=0.0,
                   help="control plane: first token / end -> client (s; default 0)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="simulate-out", type=folder,
                   help="output directory (report.json, requests.jsonl, decisions.jsonl, plots; default simulate-out, as demo-out, "
                   "replay-out and fidelity-out; removed again when a failed run left it empty). Files of those names already there "
                   "(an earlier run's, or your own) move to OUT/previous/ once the run has ended, just before its outputs are "
                   "written, never overwritten (a run that fails or is interrupted leaves them in place); OUT/previous/ keeps only "
                   "the last run's (replaced each run); when that move is refused at the end (OUT/previous held by a 'report show', or your "
                   "files put there meanwhile) the outputs go to a new OUT/run-ID/ instead, named on stderr, exit status 4. The run stops before it starts (before reading its input) when "
                   "OUT/previous holds other files, or while another run is writing to OUT (it holds OUT/.evolving-infra.lock)")
    o.add_argument("--label", default=None, help="what names the run in comparisons, as 'OUT (LABEL)' (default: the policy set)")
    o.add_argument("--no-plots", action="store_true", help="no plots: report.json, requests.jsonl and decisions.jsonl only (a sweep's compare/ has "
                   "compare.json and compare.html's table, no PNGs)")
    o.add_argument("--sweep", nargs="+", metavar="KIND",
                   help="'splits [xPyD,...]' (every split, or the listed ones) or 'policies SET,SET,...'; "
                   "writes one run per item under OUT/ (an earlier sweep's run in OUT/ITEM/ moves to OUT/ITEM/previous/ "
                   "once the item has run; refused then, as for --out, the item's run goes to OUT/ITEM/run-ID/, sweep.json names it, "
                   "exit status 4) and OUT/compare/ (replaced)")
    o.add_argument("--sweep-workers", type=int, default=1, help="sweep items run in parallel processes (default 1)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Both commands of this module (``evolving-infra --help`` lists every command)."""
    register_simulate(sub)
    register_fidelity(sub)


def register_simulate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``simulate`` alone (``evolving_infra.cli.build_parser`` of that command): its parser does not
    import ``evolving_infra.sim.fidelity`` (~2 ms of module and dataclass set-up a run does not use)."""
    p = sub.add_parser(
        "simulate",
        help="discrete-event simulation of a cluster serving a trace (same cores as the live services)",
        description="Simulate a cluster (nodes, profile, partitions) serving a trace or generated workload under an "
        "arrival process, in virtual time with the production router, planner, KV directory and engine scheduler. "
        "Writes OUT/report.json, OUT/requests.jsonl and plots, as a live replay does.",
    )
    add_simulate_args(p)
    p.set_defaults(func=cmd_simulate)


def register_fidelity(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``fidelity`` alone."""
    from evolving_infra.sim.fidelity import add_fidelity_args, cmd_fidelity

    f = sub.add_parser(
        "fidelity",
        help="run one small trace through the live stack and the simulator; print their relative differences",
        description="Replay the same small trace through a local live cluster (the demo path, at a speed-up) and "
        "through the simulator with matching settings and the live run's control plane (HTTP, routing, NATS: "
        "measured per request, --ingress-s / --ingress-s-per-token / --egress-s of simulate); print the relative "
        "difference of throughput, mean TTFT and mean E2E, with and without the control plane, and write OUT/live, "
        "OUT/sim, OUT/sim-plain and OUT/fidelity.json.",
    )
    add_fidelity_args(f)
    f.set_defaults(func=cmd_fidelity)


def dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
