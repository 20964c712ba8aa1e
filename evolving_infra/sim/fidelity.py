"""Fidelity check: the same small trace through the live stack and through the simulator.

Live: ``evolving_infra.cluster.LocalCluster`` (NATS, every service in its own
process, sim engines at ``--speedup``) replayed by
``evolving_infra.replay.live.LiveReplayer`` — the ``demo`` path. Simulated:
``evolving_infra.sim.run.simulate`` with the settings the live stack runs:
the same profile, nodes and split, the router's routing policy with its own
least-loaded decode binding (``--decode-routing least-loaded``: fidelity's cluster
runs the router's default, so the simulator runs the same rule; what is compared is
the engines' and queues' model, on one placement rule), the decode node bound at dispatch and its KV
reserved when the hand-off arrives (``--decode-binding route``), LRU host
eviction, no phase switches, the same closed-loop concurrency.

The printed relative difference is ``(simulated − live) / live``.

Control plane: a live request's TTFT is the engine's part (its work reaches the
prefill node → first token there; queue wait and prefill iterations, which the
simulator models) plus the control plane's: the HTTP request, prompt parsing and
hashing, KV lookup, routing decision and the NATS message carrying the prompt
(ingress), and the first token's way back through NATS, the router and the HTTP
stream (egress). Each wall millisecond of it counts ``speedup`` simulated ms, more
on a loaded machine; ingress grows with the prompt (the prompt travels as JSON and
as the work message). :func:`control_plane` measures both per request from the
live run's records (``node_arrived_at`` and ``first_token_at``, the router's
``ei``) and fits ``ingress = a + b × prompt tokens`` and ``egress`` = the mean; the
simulator is then run with them (``SimConfig.ingress_s``, ``ingress_s_per_token``,
``egress_s``; the prompt part served one request at a time in send order, as the
router's event loop parses and hashes one prompt after another: at 2P2D a short
request that overtook a 608k-token one flipped a least-loaded tie and with it 13
placements). The engine's part stays a prediction: the simulator's queueing and
iteration times are compared with the live engines'. The simulator without the
control plane (plain ``simulate``'s default) is reported too (``sim_plain``).

What else the two do not share, and why numbers can differ: the live workers
publish node states at most every 50 ms of wall time (the simulator's router sees
the state at the decision); the control plane's time varies per request (the
simulator applies its fit); at a high speed-up a live engine iteration shorter
than the shell's Python overhead per iteration (a few hundred µs of wall time)
stretches simulated time (see ``services/worker/README.md``). Pick a speed-up at
which the live run keeps up (``--speedup``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from evolving_infra.stdio_args import folder, shown, stdin_file

FIDELITY_KEYS = ("throughput_rps", "ttft_mean_s", "e2e_mean_s")


@dataclass(frozen=True, slots=True)
class ControlPlane:
    """The live stack's control-plane latency, measured (simulated seconds at the run's speed-up)."""

    ingress_s: float
    """Fixed part of send → work on the prefill node (s)."""
    ingress_s_per_token: float
    """Prompt-proportional part of it (s per prompt token)."""
    egress_s: float
    """First token on the prefill node → at the client, mean (s)."""
    requests: int
    """Requests measured (those whose ``ei`` carried both node times)."""
    ingress_mean_s: float
    """Mean measured ingress (s)."""


def control_plane(records: Iterable[Any]) -> ControlPlane | None:
    """Measure the control plane from the live run's ``RequestRecord`` list.

    Per successful request with ``node_arrived_at`` and ``first_token_at`` (the router's ``ei``:
    its prefill node's arrival and first-token times): ingress = ``node_arrived_at − sent_at``,
    egress = client first token − ``first_token_at`` with the client's first token at
    ``sent_at + ttft_s − admission_wait_s``. Ingress is fitted by least squares as
    ``a + b × prompt_tokens`` (``numpy.polyfit``; a negative slope or intercept is refitted
    without it), egress is the mean (negative values, clock jitter, count as 0). O(requests).

    Returns:
        The fit, or None when fewer than 2 requests carry both times (an older router).
    """
    import numpy as np

    xs, ins, outs = [], [], []
    for r in records:
        if not r.ok or r.ttft_s is None or r.node_arrived_at is None or r.first_token_at is None:
            continue
        xs.append(float(r.prompt_tokens or r.expected_prompt_tokens))
        ins.append(max(0.0, r.node_arrived_at - r.sent_at))
        outs.append(max(0.0, r.sent_at + r.ttft_s - r.admission_wait_s - r.first_token_at))
    if len(xs) < 2:
        return None
    x, y = np.asarray(xs), np.asarray(ins)
    b, a = (np.polyfit(x, y, 1) if np.ptp(x) > 0 else (0.0, float(y.mean())))
    if b < 0:  # no growth with the prompt: a constant
        a, b = float(y.mean()), 0.0
    elif a < 0:  # proportional: least squares through the origin
        a, b = 0.0, float(x @ y / (x @ x))
    return ControlPlane(
        ingress_s=float(a), ingress_s_per_token=float(b), egress_s=float(np.mean(outs)), requests=len(xs),
        ingress_mean_s=float(y.mean()),
    )


@dataclass(frozen=True, slots=True)
class FidelitySettings:
    """What both runs share."""

    trace: str | None = None
    """Canonical trace; None = the shipped Claude Code sample (``demo``'s)."""
    sessions: int = 6
    concurrency: int = 3
    nodes: int = 4
    split: str = "2P2D"
    profile: str = "gb300-glm52"
    routing: str = "cache-aware"
    speedup: float = 5.0
    max_requests_per_branch: int = 0
    """Cap every branch to its first K requests (0 = no cap) to keep the live run short."""
    max_pause_s: float | None = 10.0
    """Cap every pause (both runs), so that a low speed-up keeps the live run short."""


def load_requests(s: FidelitySettings) -> tuple[list[Any], int, str]:
    """The first ``sessions`` agents of the trace (branches capped when asked), its block size
    and its name (``-`` for stdin).

    Raises:
        SimConfigError: the trace cannot be read, or has no request (one line: ``--trace: <name>: ...``).
    """
    from evolving_infra.launcher import demo_trace_path
    from evolving_infra.sim.config import SimConfigError
    from evolving_infra.traces.io import NO_REQUESTS, TraceError, read_trace

    try:
        path = Path(stdin_file(s.trace)) if s.trace else demo_trace_path()
        trace = read_trace(path)
    except TraceError as e:
        raise SimConfigError(f"--trace: {shown(str(e))}") from e
    except OSError as e:
        raise SimConfigError(f"--trace: {s.trace or demo_trace_path()}: cannot read: {e}") from e
    if not trace.requests:
        raise SimConfigError(f"--trace: {s.trace or demo_trace_path()}: {NO_REQUESTS}")
    if s.max_requests_per_branch:
        from evolving_infra.traces.sample import sample_sessions

        trace = sample_sessions(trace, s.sessions, seed=0, max_requests_per_branch=s.max_requests_per_branch)
        reqs = list(trace.requests)
    else:
        agents = list(dict.fromkeys(r.agent for r in trace.requests))[: s.sessions]
        keep = set(agents)
        reqs = [r for r in trace.requests if r.agent in keep]
    if s.max_pause_s is not None:
        import msgspec

        cap = s.max_pause_s
        reqs = [r if r.pause_s <= cap else msgspec.structs.replace(r, pause_s=cap) for r in reqs]
    return reqs, trace.header.block_size, shown(str(path))


FIDELITY_SIDES = ("live", "sim", "sim-plain")
"""The folders in ``fidelity``'s ``--out`` that each hold one run's report (:func:`fidelity`)."""


async def run_live(s: FidelitySettings, requests: list[Any], bs: int,
                   out: Path) -> tuple[dict[str, Any], list[Any], Path]:
    """Replay ``requests`` through a local live cluster; returns its report, its records and the folder they were
    written to: ``out``, an earlier run's there set aside to ``out/previous/`` first, or ``out/run-<id>/`` when that
    set-aside was refused (:func:`~evolving_infra.out_folder.set_aside_or_elsewhere`)."""
    from evolving_infra.cluster import ClusterSpec, LocalCluster
    from evolving_infra.replay.core import Arrival
    from evolving_infra.replay.live import LiveReplayer
    from evolving_infra.report.ideal import annotate_ideal
    from services.router.ingress import local_client_key
    from evolving_infra.out_folder import set_aside_or_elsewhere
    from evolving_infra.report.write import build_report, write_report
    from shared.clock import SimClock

    spec = ClusterSpec(
        nodes=s.nodes,
        split=s.split,
        profile=s.profile,
        speedup=s.speedup,
        port=0,
        routing=s.routing,
        block_size=bs,
        log_dir=str(out / "logs"),
        log_level="warning",
        ready_timeout_s=120.0,
    )
    wall0 = time.monotonic()
    async with LocalCluster(spec) as cluster:
        clock = SimClock(spec.speedup, cluster.clock_origin)
        replayer = LiveReplayer(cluster.router_url, clock, block_size=bs, model=spec.model, progress=False,
                                api_key=local_client_key())  # its router reads EI_API_KEYS like any other
        result = await replayer.run(requests, Arrival(kind="closed", concurrency=s.concurrency))
        cluster.check_alive()
    ideal = annotate_ideal(result.records, {r.id: r for r in requests}, bs)
    meta = {
        "command": "fidelity (live)",
        "label": "live",
        "cluster": {"nodes": s.nodes, "split": s.split, "profile": s.profile, "routing": s.routing},
        "speedup": s.speedup,
        "arrival": {"kind": "closed", "concurrency": s.concurrency},
        "max_retries": replayer.retry.max_retries,  # an input report compare checks (compare.INPUT_KEYS), as the demo's
        "wall_s": time.monotonic() - wall0,
        "replay_wall_s": result.wall_s,
    }
    dest = set_aside_or_elsewhere(out, "fidelity")  # an earlier fidelity's live/ to live/previous/, now it has ended
    if dest != out:  # its report names the folder it is in
        meta["run_id"] = dest.name.removeprefix("run-")
    report = build_report(result.records, meta=meta, ideal_kv_hit_rate=ideal, extra={"wall_s": result.wall_s})
    write_report(dest, report, sorted(result.records, key=lambda r: r.sent_at), plots=False)
    return report, result.records, dest


def run_sim(s: FidelitySettings, requests: list[Any], bs: int, out: Path,
            cp: ControlPlane | None = None) -> tuple[dict[str, Any], Path]:
    """The simulator with the live stack's settings, and the measured control plane ``cp`` when
    given; returns its report and the folder it was written to: ``out``, an earlier run's there set aside to
    ``out/previous/`` first, or ``out/run-<id>/`` when that set-aside was refused
    (:func:`~evolving_infra.out_folder.set_aside_or_elsewhere`)."""
    from evolving_infra.out_folder import set_aside_or_elsewhere
    from evolving_infra.report.write import write_report
    from evolving_infra.sim.config import SimConfig
    from evolving_infra.sim.run import simulate

    cfg = SimConfig(
        nodes=s.nodes,
        profile=s.profile,
        policy="static",
        split=s.split,
        routing=s.routing,
        decode_routing="least-loaded",
        decode_binding="route",
        eviction="lru",
        arrival="closed",
        concurrency=s.concurrency,
        label="sim",
        ingress_s=cp.ingress_s if cp else 0.0,
        ingress_s_per_token=cp.ingress_s_per_token if cp else 0.0,
        egress_s=cp.egress_s if cp else 0.0,
    )
    res = simulate(cfg, requests, bs, meta={"command": "fidelity (sim)"})
    dest = set_aside_or_elsewhere(out, "fidelity")  # an earlier fidelity's outputs there to OUT/sim*/previous/
    if dest != out:  # its report names the folder it is in
        res.report.setdefault("meta", {})["run_id"] = dest.name.removeprefix("run-")
    write_report(dest, res.report, res.records, plots=False)
    return res.report, dest


def relative_differences(live: dict[str, Any], sim: dict[str, Any]) -> dict[str, float | None]:
    """``(sim − live) / live`` for throughput, mean TTFT and mean E2E (None when undefined)."""
    out: dict[str, float | None] = {}
    for k in FIDELITY_KEYS:
        a, b = live.get(k), sim.get(k)
        out[k] = (b - a) / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
    return out


def check_settings(s: FidelitySettings) -> None:
    """The numeric settings' ranges, checked before the live cluster starts: its services refused
    ``--speedup 0`` / ``nan`` only once started (a service's config traceback, exit 1), and a NaN
    ``--max-pause`` passed every check and the live replay never ended.

    Raises:
        SimConfigError: the first setting out of range, named by its flag.
    """
    import math

    from evolving_infra.sim.config import SimConfigError

    if not 0 < s.speedup < math.inf:
        raise SimConfigError(f"--speedup must be a finite number > 0, not {s.speedup:g}")
    if s.max_pause_s is not None and not 0 <= s.max_pause_s < math.inf:
        raise SimConfigError(f"--max-pause must be a finite number of seconds >= 0, not {s.max_pause_s:g}")
    for flag, value in (("--sessions", s.sessions), ("--concurrency", s.concurrency), ("--nodes", s.nodes)):
        if value < 1:
            raise SimConfigError(f"{flag} must be >= 1, not {value}")
    if s.max_requests_per_branch < 0:
        raise SimConfigError(f"--max-requests-per-branch must be >= 0 (0 = no cap), not {s.max_requests_per_branch}")


def fidelity(s: FidelitySettings, out: Path) -> dict[str, Any]:
    """Run both and return ``{settings, live, sim, relative_difference, control_plane, sim_plain,
    relative_difference_plain, dirs, outputs_elsewhere}`` (also ``out/fidelity.json``): ``sim`` runs with the control
    plane measured on the live run (:func:`control_plane`; none when the router did not report it), ``sim_plain``
    without (``out/sim-plain``; with no control plane, ``sim`` is the plain run and an earlier fidelity's
    ``sim-plain/`` outputs are set aside to its ``previous/``). ``dirs``: the folder each side's report was written
    to (``live``, ``sim``, ``sim_plain``: ``OUT/SIDE``, or ``OUT/SIDE/run-<id>`` when the earlier run's there could
    not be set aside then); ``outputs_elsewhere``: the sides written to such a ``run-<id>/``.

    Raises:
        SimConfigError: a setting out of range (:func:`check_settings`) or an unreadable trace, before
            anything is started or written.
    """
    check_settings(s)
    requests, bs, path = load_requests(s)
    out.mkdir(parents=True, exist_ok=True)
    import asyncio  # here: `simulate` registers this command's flags and needs no event loop

    live, records, live_dir = asyncio.run(run_live(s, requests, bs, out / "live"))
    cp = control_plane(records)
    sim, sim_dir = run_sim(s, requests, bs, out / "sim", cp)
    if cp is not None:
        plain, plain_dir = run_sim(s, requests, bs, out / "sim-plain")
    else:  # no control plane measured: sim is the plain run; an earlier fidelity's sim-plain/ must not look current
        plain, plain_dir = sim, sim_dir
        _set_aside_plain(out / "sim-plain")
    dirs = {"live": (live_dir, out / "live"), "sim": (sim_dir, out / "sim"), "sim_plain": (plain_dir, plain_dir)}
    if cp is not None:
        dirs["sim_plain"] = (plain_dir, out / "sim-plain")
    keys = (*FIDELITY_KEYS, "requests_completed", "requests_failed", "kv_hit_rate", "wall_s")
    result = {
        "settings": asdict(s),
        "trace": path,
        "requests": len(requests),
        "live": {k: live.get(k) for k in keys},
        "sim": {k: sim.get(k) for k in keys},
        "relative_difference": relative_differences(live, sim),
        "control_plane": asdict(cp) if cp is not None else None,
        "sim_plain": {k: plain.get(k) for k in keys},
        "relative_difference_plain": relative_differences(live, plain),
        "dirs": {side: str(d) for side, (d, _) in dirs.items()},
        "outputs_elsewhere": [side for side, (d, meant) in dirs.items() if d != meant],
    }
    (out / "fidelity.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def _set_aside_plain(folder: Path) -> None:
    """With no control plane measured, no ``sim-plain`` run: an earlier fidelity's outputs in ``folder`` set aside to
    its ``previous/`` so that they do not look current (nothing made when ``folder`` does not exist); a set-aside
    refused now (its ``previous/`` held by a ``report show``) leaves them in place with a ``warning:`` line. Raises
    nothing."""
    from evolving_infra.out_folder import OutFolderError, set_aside_note, set_aside_previous_run

    if not folder.is_dir():
        return
    try:
        moved = set_aside_previous_run(folder)
    except (OutFolderError, OSError) as e:
        why = e.reason if isinstance(e, OutFolderError) else str(e)
        print(f"warning: --out {folder}: {why}; left in place: they are an earlier fidelity's, not this one's (no "
              "control plane was measured, so there is no plain run)", file=sys.stderr, flush=True)
        return
    if moved:
        print(set_aside_note("fidelity", folder, moved), file=sys.stderr, flush=True)


def format_result(res: dict[str, Any]) -> str:
    """The comparison as a small table."""
    lines = [f"{'metric':<16}{'live':>12}{'sim':>12}{'sim vs live':>14}"]
    for k in (*FIDELITY_KEYS, "kv_hit_rate"):
        a, b = res["live"].get(k), res["sim"].get(k)
        rel = res["relative_difference"].get(k)
        lines.append(
            f"{k:<16}{(f'{a:.4f}' if a is not None else '-'):>12}{(f'{b:.4f}' if b is not None else '-'):>12}"
            f"{(f'{100 * rel:+.1f}%' if rel is not None else '-'):>14}"
        )
    plain = res.get("relative_difference_plain") or {}
    lines.append(
        "sim without the control plane: "
        + ", ".join(f"{k} {100 * v:+.1f}%" for k, v in plain.items() if v is not None)
    )
    cp = res.get("control_plane")
    if cp:
        lines.append(
            f"control plane (measured live, {cp['requests']} requests): ingress {1e3 * cp['ingress_s']:.1f} ms "
            f"+ {1e3 * cp['ingress_s_per_token'] * 1e5:.1f} ms per 100k prompt tokens (mean {1e3 * cp['ingress_mean_s']:.1f} ms), "
            f"egress {1e3 * cp['egress_s']:.1f} ms (simulated, at {res['settings']['speedup']:g}x)"
        )
    lines.append(
        f"requests {res['requests']}: live completed {res['live'].get('requests_completed')} "
        f"(failed {res['live'].get('requests_failed')}), sim completed {res['sim'].get('requests_completed')}; "
        f"live wall {res['live'].get('wall_s') or 0:.1f} s, sim wall {res['sim'].get('wall_s') or 0:.2f} s"
    )
    return "\n".join(lines)


def add_fidelity_args(p: argparse.ArgumentParser) -> None:
    d = FidelitySettings()
    p.add_argument("--trace", default=None, help="canonical trace (- reads stdin; default: the shipped Claude Code sample)")
    p.add_argument("--sessions", type=int, default=d.sessions, help=f"agents replayed (default {d.sessions})")
    p.add_argument("--max-requests-per-branch", type=int, default=0, help="cap each branch to its first K requests")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help=f"closed-loop agents (default {d.concurrency})")
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"nodes (default {d.nodes})")
    p.add_argument("--split", default=d.split, help=f"split (default {d.split})")
    p.add_argument("--profile", default=d.profile, help=f"profile (default {d.profile})")
    p.add_argument("--routing", default=d.routing, help=f"routing policy (default {d.routing})")
    p.add_argument("--speedup", type=float, default=d.speedup, help=f"live speed-up (default {d.speedup:g})")
    p.add_argument("--max-pause", type=float, default=d.max_pause_s, help=f"cap every pause, both runs (default {d.max_pause_s:g} s)")
    p.add_argument("--out", default="fidelity-out", type=folder,
                   help="output directory (default fidelity-out): OUT/live/, OUT/sim/ and OUT/sim-plain/ (each a run's "
                   "report.json and requests.jsonl) and OUT/fidelity.json. An earlier run's files in a side's folder move "
                   "to its previous/ (OUT/live/previous/, ...) once that side has run, just before its own are written, "
                   "never overwritten (refused then, a side's run goes to OUT/SIDE/run-ID/ instead, which fidelity.json's dirs "
                   "name, exit status 4); fidelity.json is replaced. A second run into OUT while one writes there stops "
                   "before it starts (the run holds OUT/.evolving-infra.lock), as does one whose OUT/SIDE/previous "
                   "holds other files")


def cmd_fidelity(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from evolving_infra.out_folder import OutFolderError, check_previous_run, hold_new_out, recover_set_aside
    from shared.log import setup_logging

    setup_logging("console", "warning")
    s = FidelitySettings(
        trace=args.trace,
        sessions=args.sessions,
        concurrency=args.concurrency,
        nodes=args.nodes,
        split=args.split,
        profile=args.profile,
        routing=args.routing,
        speedup=args.speedup,
        max_requests_per_branch=args.max_requests_per_branch,
        max_pause_s=args.max_pause,
    )
    out = Path(args.out)
    with ExitStack() as held:  # OUT held for the whole run, as replay's and demo's: a second run into it stops here
        try:
            hold_new_out(held, out)  # OUT made and held; taken back after the lock's release when left empty
            for side in FIDELITY_SIDES:  # their refusals now; each side's set-aside once it has run
                recover_set_aside(out / side)  # what a fidelity killed during that side's set-aside left (OUT held)
                check_previous_run(out / side)
        except (OutFolderError, OSError) as e:
            print(f"error: --out {out}: {e}", file=sys.stderr)
            return 2
        return _fidelity_held(s, out)


def _fidelity_held(s: FidelitySettings, out: Path) -> int:
    """:func:`cmd_fidelity` once it holds ``out``; returns the exit code."""
    from evolving_infra.cluster import ClusterError
    from evolving_infra.sim.config import SimConfigError

    from evolving_infra.out_folder import OutFolderError

    try:
        res = fidelity(s, out)
    except SimConfigError as e:  # a bad --trace (read first: nothing started or written), or simulator setting
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OutFolderError as e:  # a side's set-aside refused and its OUT/SIDE/run-<id>/ not made either
        print(f"error: --out {out}: {e}; that side's report was not written", file=sys.stderr)
        return 2
    except ClusterError as e:
        print(f"error: live cluster: {e}", file=sys.stderr)
        return 1
    from evolving_infra.out_folder import OUTPUTS_ELSEWHERE

    print(format_result(res))
    print(f"fidelity: {out / 'fidelity.json'}")
    if res["outputs_elsewhere"]:
        print(f"note: written to a run-ID folder of their own (fidelity.json's dirs name them): "
              f"{', '.join(res['dirs'][side] for side in res['outputs_elsewhere'])} (exit status {OUTPUTS_ELSEWHERE})")
        return OUTPUTS_ELSEWHERE
    ok = res["live"].get("requests_failed") == 0 and res["sim"].get("requests_failed") == 0
    return 0 if ok else 1
