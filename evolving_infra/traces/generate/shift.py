"""Shifting workload composition: Putnam → mixed → OSWorld hours (paper §6.3, Figure 7, Table C.4).

The paper serves, after a 30-minute warmup, 288 concurrent Putnam agents for
an hour, then 144 Putnam + 72 OSWorld agents, then 144 OSWorld agents, each
period a closed loop that replaces every finished agent with a new one. This
generator writes the agents of every period (Putnam and OSWorld agents exactly
as ``putnam`` and ``osworld`` build them, sharing one block-id space) and
makes the schedule explicit in ``meta.periods``:

``[{"name", "start_s", "end_s", "concurrency": {workload: agents},
"agents": {workload: {"prefix", "count"}}}]``

and ``meta.start_windows`` = ``{agent id prefix: [start_s, end_s]}``: an agent
whose id starts with the prefix may be started (closed loop, as a replacement)
only inside that window. Agent ids are ``shift.<period>.<workload>.<n>``. A
replayer runs, in each window, the period's concurrency per workload from its
pool; a report splits by the windows. Requests are written period by period.

Options: ``agents`` = Putnam concurrency of the first hour (default 36, 1/8 of
the paper's 288 to keep the file small; ``--agents 288`` is full scale; the
other concurrencies scale with it: ``agents/2`` Putnam + ``agents/4`` OSWorld,
then ``agents/2`` OSWorld); ``duration_s`` = length of each measured period
(default 3,600 s; the warmup is half of it). Pool size per workload and
period: ``ceil(1.25 · concurrency · period / lifetime) + concurrency`` agents,
with ``lifetime`` = mean steps × (mean pause + E2E estimate / 10), the E2E
estimates being the paper's Table C.3 values (Putnam 15.5 s, OSWorld 24.5 s):
the pool must last for a system up to 10× faster per request than the paper's.
With the full estimate (before) the simulator's calibrated profile ran out of
OSWorld agents: at 288 agents its OSWorld requests took 3.6–6 s at 3P6D–5P4D,
an agent lived ~150 s instead of ~770 s, and every split from 2P7D to 7P2D sent
its whole pool (~55K requests) before the OSWorld hour ended, 3P6D–7P2D within
30–40 minutes (the mixed hour's OSWorld quarter ran out too), so later windows
measured the pool, not the split.
``requests_per_agent`` fixes every agent's main-branch length.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NotRequired, TypedDict

import numpy as np

from evolving_infra.traces.generate import osworld, putnam
from evolving_infra.traces.generate.common import GenerateError, IdPool, Target, finish_branches, make_header
from evolving_infra.traces.schema import TraceRequest

if TYPE_CHECKING:  # for annotations only: generate() imports it when called, as before
    from evolving_infra.traces.io import Trace

KIND = "shift"
PAPER_AGENTS = 288
"""Paper §6.3: 288 Putnam agents in the first hour."""
DEFAULT_AGENTS = PAPER_AGENTS // 8
"""Default scale 1/8 of the paper (36 → 18 + 9 → 18 agents; ~25K requests); ``--agents 288`` is full scale
(~7K agents, ~200K requests, several hundred MB)."""
DEFAULT_PERIOD_S = 3600.0
POOL_MARGIN = 1.25
POOL_SPEEDUP = 10.0
"""Pools are sized for requests this many times faster than the paper's E2E (module docstring)."""



class Period(TypedDict):
    """One row of :func:`periods` (written as is into the header's ``meta``)."""

    name: str
    start_s: float
    end_s: float
    concurrency: dict[str, int]  # workload kind -> concurrent agents
    agents: NotRequired[dict[str, dict[str, object]]]  # kind -> {prefix, count}: generate() adds it


def periods(agents: int, period_s: float) -> list[Period]:
    """The period table (paper §6.3) for a first-hour Putnam concurrency of ``agents``."""
    half, quarter = max(1, agents // 2), max(1, agents // 4)
    warm = period_s / 2
    rows = [
        ("warmup", 0.0, warm, {"putnam": agents}),
        ("putnam", warm, warm + period_s, {"putnam": agents}),
        ("mixed", warm + period_s, warm + 2 * period_s, {"putnam": half, "osworld": quarter}),
        ("osworld", warm + 2 * period_s, warm + 3 * period_s, {"osworld": half}),
    ]
    return [Period(name=n, start_s=s, end_s=e, concurrency=c) for n, s, e, c in rows]


def _lifetime(kind: str) -> float:
    p = putnam.PARAMS if kind == "putnam" else osworld.PARAMS
    return float(p["steps_mean"]) * (float(p["pause_s_mean"]) + float(p["e2e_estimate_s"]) / POOL_SPEEDUP)


def pool_size(kind: str, concurrency: int, window_s: float) -> int:
    """Agents a closed loop of ``concurrency`` needs for ``window_s`` seconds (module docstring)."""
    return math.ceil(POOL_MARGIN * concurrency * window_s / _lifetime(kind)) + concurrency


def generate(*, seed: int = 0, agents: int | None = None, duration_s: float | None = None, requests_per_agent: int | None = None, block_size: int = 64) -> Trace:
    """The shifting-composition trace (module docstring); seeded, byte-identical for the same options."""
    from evolving_infra.traces.io import Trace

    n = DEFAULT_AGENTS if agents is None else agents
    if n < 4:
        raise GenerateError("--agents must be >= 4 for the shift workload (it is halved and quartered)")
    if block_size < 1:
        raise GenerateError("--block-size must be >= 1")
    period_s = DEFAULT_PERIOD_S if duration_s is None else duration_s
    if period_s <= 0:
        raise GenerateError("--duration must be > 0")
    rng = np.random.default_rng(seed)
    pool = IdPool()
    os_state = osworld._Agent(rng)
    table = periods(n, period_s)
    reqs: list[TraceRequest] = []
    windows: dict[str, list[float]] = {}
    counts: dict[str, int] = {"putnam": 0, "osworld": 0}
    for row in table:
        window = float(row["end_s"]) - float(row["start_s"])
        row_agents: dict[str, dict[str, object]] = {}
        for kind, conc in row["concurrency"].items():
            k = pool_size(kind, int(conc), window)
            prefix = f"shift.{row['name']}.{kind}."
            for a in range(k):
                agent = f"{prefix}{a:05d}"
                if kind == "putnam":
                    reqs.extend(putnam.build_agent(rng, pool, agent, block_size, requests_per_agent=requests_per_agent))
                else:
                    reqs.extend(osworld.build_agent(rng, pool, agent, block_size, os_state, requests_per_agent=requests_per_agent))
            row_agents[kind] = {"prefix": prefix, "count": k}
            windows[prefix] = [float(row["start_s"]), float(row["end_s"])]
            counts[kind] += k
        row["agents"] = row_agents
    total = sum(counts.values())
    header = make_header(
        KIND,
        block_size=block_size,
        seed=seed,
        options={"agents": n, "duration_s": period_s, "requests_per_agent": requests_per_agent},
        targets=targets_for(n, period_s),
        parameters={"putnam": putnam.PARAMS, "osworld": {k: ({str(a): b for a, b in v.items()} if isinstance(v, dict) else v) for k, v in osworld.PARAMS.items()}, "pool_margin": POOL_MARGIN, "pool_speedup": POOL_SPEEDUP},
        description="Shifting composition (paper §6.3): Putnam -> 1/2 Putnam + 1/4 OSWorld -> 1/2 OSWorld, closed loop per period",
        extra={"periods": table, "start_windows": windows, "agents_by_workload": counts, "agents_total": total},
    )
    return Trace(header, finish_branches(reqs))


def targets_for(agents: int, period_s: float) -> tuple[Target, ...]:
    """Checked targets of a shift trace with these options.

    Per period and workload (subset = the agent id prefix): the pool size
    (exact, from the schedule) and the component workload's pause and output
    means (paper Table C.3 / DESIGN §6a, see ``putnam`` and ``osworld``), so the
    composition shift from decode-heavy to prefill-heavy shows in each window.
    """
    comp = {
        "putnam": [t for t in putnam.TARGETS if t.key in ("pause_s.mean", "output_tokens.mean")],
        "osworld": [t for t in osworld.TARGETS if t.key in ("pause_s.mean", "output_tokens.mean", "input_growth_tokens.mean")],
    }
    out: list[Target] = []
    for row in periods(agents, period_s):
        window = float(row["end_s"]) - float(row["start_s"])
        for kind, conc in row["concurrency"].items():
            prefix = f"shift.{row['name']}.{kind}."
            out.append(Target("sessions", float(pool_size(kind, int(conc), window)), "paper §6.3 schedule: closed-loop pool size (module docstring)", rel=0.0, subset=prefix))
            out.extend(Target(t.key, t.value, t.source, t.rel, t.abs_tol, prefix) for t in comp[kind])
    return tuple(out)


TARGETS = targets_for(DEFAULT_AGENTS, DEFAULT_PERIOD_S)
"""Targets at the default options (a trace's own targets are in its header, ``meta.targets``)."""
