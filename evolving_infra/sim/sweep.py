"""``evolving-infra simulate --sweep``: several policy sets or splits on the same input, compared.

``--sweep splits`` runs every split ``xPyD`` of the (per-partition) node count,
or the listed ones (``--sweep splits 3P6D,4P5D``); under a ``static`` policy set
each item is ``static:xPyD``, under an adaptive set the split is its initial
one. ``--sweep policies dynamo,arrow,static:4P5D`` runs each named set; the
explicit flags of the command (e.g. ``--eviction``) apply to every item, but a
``--planner-opt`` item only to the items whose planner takes it (a note says which
were left out, :func:`fit_planner_options`).

Each item is a full run written to ``OUT/<label>/`` (``:`` becomes ``_``);
``OUT/compare/`` holds ``evolving-infra report compare`` of all of them, and
``OUT/sweep.json`` a summary with the best item by throughput.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from evolving_infra.report.metrics import PER_SIMULATED_SECOND
from evolving_infra.sim.config import SimConfig, SimConfigError, seed_unused_note
from evolving_infra.sim.policies import PolicyError, policy_set, serving
from evolving_infra.sim.pool import fork_pool
from evolving_infra.traces.schema import TraceRequest

SUMMARY_KEYS = (
    "throughput_rps",
    "ttft_mean_s",
    "ttft_p95_s",
    "e2e_mean_s",
    "e2e_p95_s",
    "kv_hit_rate",
    "lost_kv_reuse",
    "switches",
    "switch_time_mean_s",
    "final_split",
    "relaunches",
    "out_of_service_share",
    "requests_completed",
    "requests_failed",
    "wall_s",
    "sim_speed",
)


def sweep_items(cfg: SimConfig, spec: Sequence[str]) -> list[tuple[str, SimConfig]]:
    """The runs a ``--sweep`` spec stands for, as ``(label, config)``.

    Raises:
        SimConfigError: unknown sweep kind, an empty list, an item listed twice or two items that become one
            label (``static:5P1D,static:3P1D`` under ``--split 3P1D``, ``splits 2P1D,2p1d``: the message names
            both as typed; both runs would write the same OUT/ folder, the second over the first), or
            ``splits`` with ``--split`` (which it replaces).
    """
    if not spec:
        raise SimConfigError("--sweep needs 'splits' or 'policies SET,SET,...'")
    kind, rest = spec[0], [x for part in spec[1:] for x in part.split(",") if x.strip()]
    items: list[tuple[str, SimConfig]] = []
    typed_items: list[str] = []
    """Each item as the user typed it (a duplicate's error names these, not only the labels they became)."""
    if kind == "splits":
        if cfg.split is not None:
            raise SimConfigError(f"--split {cfg.split} and --sweep splits conflict: the sweep sets the split of each run")
        n = cfg.nodes // cfg.partitions
        splits = [s.strip().upper() for s in rest] or [f"{p}P{n - p}D" for p in range(1, n)]
        typed_items = [s.strip() for s in rest] or splits  # '3p1d' is served as 3P1D
        if not splits:
            raise SimConfigError("--sweep splits needs at least 2 nodes per partition")
        static = cfg.policy == "static" or cfg.policy.startswith("static:")
        for sp in splits:
            if static:
                label = f"static:{sp}"
                items.append((label, replace(cfg, policy=label, split=None, label=label)))
            else:
                label = f"{cfg.policy}@{sp}"
                items.append((label, replace(cfg, split=sp, label=label)))
    elif kind == "policies":
        if not rest:
            raise SimConfigError("--sweep policies needs a list, e.g. 'policies dynamo,arrow,static:4P5D'")
        for name in rest:
            label = name.strip()
            typed_items.append(label)
            if cfg.split is not None:  # static:5P1D under --split 3P1D serves, and is labelled, static:3P1D
                try:
                    label = serving(policy_set(label), cfg.split).name
                except PolicyError:  # an unknown set: refused with its reason when the run is resolved
                    pass
            items.append((label, replace(cfg, policy=name.strip(), label=label)))
    else:
        raise SimConfigError(f"unknown --sweep kind {kind!r}: use 'splits' or 'policies'")
    seen: dict[str, tuple[str, str]] = {}  # OUT/ folder -> (the item as typed, its label)
    for (label, _), typed in zip(items, typed_items):
        d = safe_dir(label)
        if d in seen:
            first, first_label = seen[d]
            if first == typed:
                raise SimConfigError(f"--sweep lists {typed!r} twice (its runs would share OUT/{d})")
            # static:5P1D and static:3P1D under --split 3P1D both serve (and are labelled) static:3P1D
            became = f"{first_label!r}" if first_label == label else f"{first_label!r} and {label!r}"
            why = f" under --split {cfg.split}" if kind == "policies" and cfg.split is not None else ""
            raise SimConfigError(f"--sweep lists {first!r} and {typed!r}, which become {became}{why}: their runs would "
                                 f"share OUT/{d}; list one of them")
        seen[d] = (typed, label)
    return items


def _planner_fields(planner: str) -> frozenset[str] | None:
    """The ``--planner-opt`` names planner ``planner`` accepts (its parameter dataclass's fields;
    none for ``static``), or None for a planner this does not know (its options left as given)."""
    from dataclasses import fields

    if planner == "static":
        return frozenset()
    from services.planner.baselines import ArrowParams, DynamoParams
    from services.planner.evolving import EvolvingParams

    cls: Any = {"evolving": EvolvingParams, "dynamo": DynamoParams, "arrow": ArrowParams}.get(planner)
    return None if cls is None else frozenset(f.name for f in fields(cls))


def fit_planner_options(items: list[tuple[str, SimConfig]]) -> tuple[list[tuple[str, SimConfig]], list[str]]:
    """Give each sweep item only the ``--planner-opt`` items its planner accepts (as ``bench/sim_ab.py
    --vs-policy`` does): ``policies evolving,static:3P1D --planner-opt t_learn_s=240`` gives
    ``t_learn_s`` to ``evolving`` alone (``static`` takes no parameters). An option that no item's
    planner accepts is left to every item, so that a misspelt name is still refused with its
    reason. Returns the items and one note per item that had options left out (to print).

    An item whose policy set does not resolve keeps its options (its error comes from the run's
    checks)."""
    from evolving_infra.sim.config import resolve

    planners: list[str | None] = []
    for _, c in items:
        try:
            planners.append(resolve(c).policy.planner if c.planner_options else None)
        except SimConfigError:
            planners.append(None)
    accepted: list[frozenset[str] | None] = [None if p is None else _planner_fields(p) for p in planners]
    anyone = set().union(*(a for a in accepted if a is not None))
    out: list[tuple[str, SimConfig]] = []
    notes: list[str] = []
    for (label, c), planner, ok in zip(items, planners, accepted):
        if ok is not None:
            dropped = sorted(k for k in c.planner_options if k not in ok and k in anyone)
            if dropped:
                kept = {k: v for k, v in c.planner_options.items() if k not in dropped}
                c = replace(c, planner_options=kept)
                notes.append(f"{label}: --planner-opt {', '.join(dropped)} not given (planner {planner!r} does not take it; "
                             "the sweep gives each item the options its planner takes, where a single run of "
                             f"{label} refuses them)")
        out.append((label, c))
    return out, notes


def safe_dir(label: str) -> str:
    """A directory name for a label (``static:4P5D`` → ``static_4P5D``)."""
    return re.sub(r"[^A-Za-z0-9._@-]+", "_", label)


_FORK: dict[str, Any] = {}


def _run_item(i: int) -> dict[str, Any]:
    label, cfg = _FORK["items"][i]
    return _simulate_item(label, cfg, _FORK["requests"], _FORK["bs"], _FORK["out"], _FORK["meta"], _FORK["plots"],
                          progress=f"{label} ({i + 1}/{len(_FORK['items'])})", redraw=False)


def _simulate_item(
    label: str, cfg: SimConfig, requests: Sequence[TraceRequest], bs: int, out: Path, meta: dict[str, Any], plots: bool,
    *, progress: str | bool = False, redraw: bool = True,
) -> dict[str, Any]:
    """Run one sweep item and write its report under ``out`` (``out/ITEM``, or ``out/ITEM/run-<id>`` when the earlier
    sweep's item there could not be set aside: :func:`~evolving_infra.out_folder.set_aside_or_elsewhere`); its
    summary row (``dir``: the folder written; ``elsewhere``: whether it is a ``run-<id>``). ``progress``: the item's
    progress label on stderr (``dynamo (2/4)``); ``redraw`` False in parallel workers sharing a terminal."""
    from evolving_infra.out_folder import OutFolderError, set_aside_or_elsewhere
    from evolving_infra.report.write import write_report
    from evolving_infra.sim.run import simulate, warmup_outlasted, write_decisions
    from evolving_infra.traces.io import make_folders, remove_folders

    res = simulate(cfg, requests, bs, meta=dict(meta, sweep_label=label), progress=progress, progress_redraw=redraw)
    d = out / safe_dir(label)
    made = make_folders(d)
    try:
        try:  # an earlier sweep's item there to its previous/, now that this one has run (checked before the sweep);
            # refused now (ITEM/previous held by a `report show`, the user's files put there): to ITEM/run-<id>/
            dest = set_aside_or_elsewhere(d, "simulate --sweep")
        except OutFolderError as e:  # neither (ITEM not writable any more): as a bad setting, one line
            raise SimConfigError(f"--out {d}: {e}; this item's report was not written") from None
        if dest != d:  # its report names the folder it is in
            res.report.setdefault("meta", {})["run_id"] = dest.name.removeprefix("run-")
            made.append(dest)  # removed again when the report cannot be written there
        write_report(dest, res.report, res.records, plots=plots)
        write_decisions(dest, res.stats.planner_decisions)
    except BaseException:  # a report that cannot be written (disk full): its empty folder goes too
        remove_folders(made)
        raise
    row = {k: res.report.get(k) for k in SUMMARY_KEYS}
    row.update(label=label, dir=str(dest), elsewhere=dest != d, simulated_s=res.report["simulated_s"],
               planner=res.resolved.policy.planner, initial_split=res.resolved.split,
               warmup_outlasted_until_s=warmup_outlasted(res.stats.planner_decisions, res.report["simulated_s"],
                                                          res.report.get("switches") or 0),
               switch_decided_at_s=first_switch_decided(res.stats.planner_decisions))
    return row


def first_switch_decided(decisions: Sequence[dict[str, Any]]) -> float | None:
    """When (simulated s) the planner first decided to switch a node (a ``decisions.jsonl`` record with
    ``action == "switch"``, its ``ts``), else None; a decision counts whether or not its switch completed
    (a relaunch decided near the end of a run does not)."""
    for d in decisions:
        if d.get("action") == "switch" and isinstance(ts := d.get("ts"), (int, float)):
            return float(ts)
    return None


ADAPTIVE_BASELINES = ("dynamo", "arrow")
"""Planners that change the split as the load moves, with no warm-up of their own (the evolving planner's
is :func:`~evolving_infra.sim.run.warmup_outlasted`'s)."""


def never_adapted_note(row: dict[str, Any]) -> str | None:
    """One line (no ``note:`` prefix) for a sweep item whose adaptive baseline planner (:data:`ADAPTIVE_BASELINES`)
    completed no node switch in the whole run: it served its initial split throughout, so it measured that
    static split, not the policy adapting. Either the planner never decided a switch (a short run: its load
    never crossed the planner's thresholds) or it decided one that had not completed by the end (a relaunch
    takes minutes); the line says which. None otherwise (other planners, or a run with switches).

    Args:
        row: a sweep summary row (``planner``, ``initial_split``, ``switches``, ``simulated_s``, ``label``,
            ``switch_decided_at_s``: :func:`first_switch_decided`, absent or None when none was decided).
    """
    if row.get("planner") not in ADAPTIVE_BASELINES or row.get("switches"):
        return None
    split = row.get("initial_split")
    decided = row.get("switch_decided_at_s")
    if decided is not None:  # not the static split either: the switch under way took a node's time
        share = row.get("out_of_service_share")
        out = f", a node out of service {100 * share:.0f}% of the time" if isinstance(share, (int, float)) and share else ""
        return (f"{row['label']} decided a switch at {decided:,.0f} s that had not completed by the end "
                f"({row['simulated_s']:,.0f} s): it served {split} throughout with that switch under way{out}, so it "
                f"measured neither the policy adapted nor static:{split}; run longer (--duration, more agents) to see "
                "the switch complete")
    return (f"{row['label']} never changed its split in {row['simulated_s']:,.0f} s (its {row['planner']} planner "
            f"switched no node): it served {split} throughout, as static:{split} does, so it measured that "
            "static split, not the policy adapting; run longer (--duration, more agents) to see it adapt")


def _item_line(row: dict[str, Any]) -> str:
    return (f"  {row['label']}: {row['throughput_rps'] or 0:.3f} {PER_SIMULATED_SECOND}, TTFT {row['ttft_mean_s'] or 0:.2f} s, "
            f"E2E {row['e2e_mean_s'] or 0:.2f} s")


def throughput_top(rows: Sequence[dict[str, Any]]) -> tuple[str, list[str]]:
    """The best throughput as printed (``0.118``, req/s per simulated second, 3 decimals) and the labels of every
    item that prints it (more than one: a tie; in ``rows``' order); ``("", [])`` without rows."""
    shown = [(r["label"], f"{r.get('throughput_rps') or 0:.3f}") for r in rows]
    if not shown:
        return "", []
    top = max(shown, key=lambda t: float(t[1]))[1]
    return top, [lab for lab, v in shown if v == top]


def _served(rows: Sequence[dict[str, Any]]) -> str:
    """``evolving 118 completed / 0 failed, dynamo 90 / 28``: what each item served (``requests_completed``,
    ``requests_failed``; ``?`` where a row lacks one)."""
    def n(v: Any) -> str:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else "?"

    return ", ".join(f"{r['label']} {n(r.get('requests_completed'))}" + (" completed / " if i == 0 else " / ")
                     + n(r.get("requests_failed")) + (" failed" if i == 0 else "") for i, r in enumerate(rows))


def best_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The sweep's last verdict lines, from its items' rows (``label``, ``throughput_rps`` req/s per simulated
    second, ``ttft_mean_s`` s, either None; ``requests_completed`` / ``requests_failed``): the best throughput
    (higher is better), or, when the best ties with another item as printed (``0.118``: a closed loop's agents
    send the same requests whichever policy serves them), that tie and the items in it, or, when no item completed
    a request, that (not "a tie at 0.000"); then the lowest TTFT mean (lower is better) with every item's, a tie as
    printed (3 decimals) named as one, and, when the throughputs differ as printed, what each item completed and
    failed: a policy that served fewer requests can win the TTFT. Before, a sweep of three policies that all
    served 0.118 req/s ended "best by throughput: evolving (0.118 req/s)", the first of the tie, and never named
    the TTFT, where they differed (0.59 s against 1.34 s and 1.33 s)."""
    lines = []
    top, tied = throughput_top(rows)
    unit = PER_SIMULATED_SECOND
    if tied and float(top) == 0:
        lines.append(f"best by throughput (higher is better): none, no item completed a request ({_served(rows)})")
    elif len(tied) > 1:
        lines.append(f"best by throughput (higher is better): a tie at {top} {unit} ({', '.join(tied)}): a closed "
                     "loop's agents send the same requests whichever policy serves them; compare the latencies")
    elif tied:
        lines.append(f"best by throughput (higher is better): {tied[0]} ({top} {unit})")
    ttft = [(r["label"], r["ttft_mean_s"]) for r in rows if isinstance(r.get("ttft_mean_s"), (int, float))]
    if len(ttft) > 1:
        lab, v = min(ttft, key=lambda t: t[1])
        same = [o for o, w in ttft if f"{w:.3f}" == f"{v:.3f}"]
        others = ", ".join(f"{o} {w:.3f} s" for o, w in ttft if o not in same)
        if len(same) > 1:
            line = f"best by TTFT mean (lower is better): a tie at {v:.3f} s ({', '.join(same)}" + (f"; {others})" if others else ")")
        else:
            line = f"best by TTFT mean (lower is better): {lab} ({v:.3f} s; {others})"
        if len({f"{r.get('throughput_rps') or 0:.3f}" for r in rows}) > 1:
            line += f"; the throughputs differ, requests served: {_served(rows)}"
        lines.append(line)
    return lines


def run_sweep(
    cfg: SimConfig,
    requests: Sequence[TraceRequest],
    bs: int,
    spec: Sequence[str],
    out: Path,
    *,
    meta: dict[str, Any] | None = None,
    plots: bool = True,
    parallel: int = 1,
) -> int:
    """Run every item of ``spec``, write their reports and the comparison; print the table.

    Returns:
        The process exit status: 0; 1 if an item had failed requests;
        :data:`~evolving_infra.out_folder.OUTPUTS_ELSEWHERE` (4) if an item's report went to ``OUT/ITEM/run-<id>/``
        (named in a ``warning:`` line; ``sweep.json``'s ``dir`` and ``compare/`` read it there) because the earlier
        sweep's item in ``OUT/ITEM`` could not be set aside then.

    An earlier sweep's item in an item's folder is set aside to its ``previous/`` once the item has run, just before
    its report is written (:func:`~evolving_infra.out_folder.set_aside_or_elsewhere`); what a sweep killed during such a
    set-aside left in an item's folder is put back first (:func:`~evolving_infra.out_folder.recover_set_aside`: call
    it holding ``out``); ``sweep.json`` and ``compare/`` are replaced.

    Raises:
        SimConfigError: a malformed spec or an item that cannot run, or an item folder's ``previous/`` holding
            other files (checked before any run); an item's set-aside that failed.
    """
    from evolving_infra.report.compare import format_table, write_compare
    from evolving_infra.sim.config import resolve
    from evolving_infra.traces.io import make_folders, remove_folders

    if parallel < 1:
        raise SimConfigError(f"--sweep-workers must be >= 1, not {parallel}")
    items, notes = fit_planner_options(sweep_items(cfg, spec))
    for note in notes:  # about the settings, before the run: on stderr, as the seed's and simulate's input notes
        print(f"note: {note}", file=sys.stderr, flush=True)
    if unused := seed_unused_note([c for _, c in items]):
        print(f"note: {unused}", file=sys.stderr, flush=True)
    sizes = {resolve(c).profile.block_size for _, c in items}  # fails before any run
    from evolving_infra.out_folder import OutFolderError, check_previous_run, recover_set_aside

    for label, _c in items:  # an item folder whose previous/ holds the user's files: refused before any run
        try:
            recover_set_aside(Path(out) / safe_dir(label))  # what a sweep killed during its set-aside left (OUT held)
            check_previous_run(Path(out) / safe_dir(label))
        except OutFolderError as e:
            raise SimConfigError(f"--out {Path(out) / safe_dir(label)}: {e}") from None
    if len(sizes) == 1:  # convert the trace's blocks once, not once per item
        from evolving_infra.sim.run import convert_block_size

        (sim_bs,) = sizes
        requests = convert_block_size(requests, bs, sim_bs)
        bs = sim_bs
    out = Path(out)
    made = make_folders(out)
    meta = dict(meta or {})
    rows: list[dict[str, Any]] = []
    try:
        if parallel > 1 and len(items) > 1:
            _FORK.update(items=items, requests=requests, bs=bs, out=out, meta=meta, plots=plots)
            try:
                with fork_pool(min(parallel, len(items))) as pool:
                    for row in pool.map(_run_item, range(len(items))):  # in order, each as soon as it and those before are done
                        rows.append(row)
                        print(_item_line(row), flush=True)
            finally:
                _FORK.clear()
        else:
            for i, (label, c) in enumerate(items):
                rows.append(_simulate_item(label, c, requests, bs, out, meta, plots, progress=f"{label} ({i + 1}/{len(items)})"))
                print(_item_line(rows[-1]), flush=True)
    except BaseException:  # an item that cannot run: the folders made for --out go again if nothing was written in them
        remove_folders(made)
        raise
    dirs = [Path(r["dir"]) for r in rows]
    best = max(rows, key=lambda r: r["throughput_rps"] or 0.0)
    timed = [r for r in rows if isinstance(r.get("ttft_mean_s"), (int, float))]
    _, tied = throughput_top(rows)
    summary = {"sweep": list(spec), "items": rows, "best_by_throughput": best["label"],
               "throughput_tie": tied if len(tied) > 1 else [],
               "best_by_ttft_mean": min(timed, key=lambda r: r["ttft_mean_s"])["label"] if timed else None}
    (out / "sweep.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if len(dirs) >= 2:
        _, runs, table = write_compare(dirs, out / "compare", plots=plots)
        print(format_table([r.label for r in runs], table))
        print(f"compare: {out / 'compare' / 'compare.html'}")
    from evolving_infra.sim.run import warmup_outlasted_note

    for r in rows:
        if late := warmup_outlasted_note(r["label"], r["warmup_outlasted_until_s"], r["simulated_s"]):
            print(f"note: {late}")
        elif still := never_adapted_note(r):
            print(f"note: {still}")
    for line in best_lines(rows):
        print(line)
    print(f"sweep: {out / 'sweep.json'}")
    failed = 0
    for r in rows:
        rep = json.loads((Path(r["dir"]) / "report.json").read_text())
        failed += rep.get("requests_failed") or 0
    from evolving_infra.out_folder import OUTPUTS_ELSEWHERE

    if elsewhere := [r for r in rows if r["elsewhere"]]:
        print(f"note: {len(elsewhere)} item(s) written to a run-ID folder of their own, not their item folder: "
              f"{', '.join(r['dir'] for r in elsewhere)} (exit status {OUTPUTS_ELSEWHERE})")
        return OUTPUTS_ELSEWHERE
    return 0 if failed == 0 else 1
