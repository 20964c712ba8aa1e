"""Claude-Code-like workload, fitted to the 530 real Claude Code sessions (paper's CC workload, §6.1).

The distributions and rates come from ``claude_code_fit.py`` beside this
file, written by ``fit_claude_code.py`` (how each one is fitted is documented
there): empirical quantile tables of main-branch requests per session, first
input, shared tool + system prefix, context growth per request, output
tokens, pauses (plain and after joining sub-agents), compaction ratios and the
context at which shrinking compactions happen; rates per main request of
sub-agent spawns (with the real fan-out frequencies), side-call forks and
same-size context rewrites; and the share of sessions with a large (1M-token)
context window.

An agent is one session: a ``main`` branch whose context starts at the
fitted first input (its leading tool + system blocks shared by every agent, as
the converter does) and grows per request. Between two main requests it may
* spawn 1–3 ``subagent`` branches (fresh contexts with the sub-agent shared
  prefix), each running its fitted number of requests; the next main request
  waits for all of them (a join, paper Figure 2c: "sub-agent call");
* issue a side call: a ``fork`` branch from the shared prefix, one or more
  requests, after which the main branch continues;
* compact: the context is rewritten after the shared prefix (``compaction``).
  A session of the 200K-window group (share 1 − ``large_context_share``)
  shrinks by a fitted ratio when its context would pass a threshold drawn from
  the fitted pre-compaction contexts (≈150K, Claude Code's auto-compaction); a
  large-window session only at the largest real context (880K). Same-size
  rewrites (resumed sessions, changed system prompt) come at their fitted rate.

:data:`TARGETS` (values = ``trace stats`` of the real sessions, recorded in the
fit file) are checked by tests/unit/traces/test_generate.py within 10 %. The
mean pause is not a target: it is dominated by a few multi-hour idle gaps
(p99 2.9K s, max 72K s), so its sampling error exceeds 10 % below ~10⁵ requests;
its median and p95 are targets instead. The paper's CC replay reports a mean
pause per request of 12.9–18.6 s (Table C.3), far below the real sessions'
mean; see docs/trace-format.md §8.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from evolving_infra.traces.generate.common import (
    Branch,
    Deck,
    GenerateError,
    IdPool,
    QuantileTable,
    RateEvents,
    Target,
    check_common_options,
    finish_branches,
    make_header,
)
from evolving_infra.traces.schema import TraceRequest

if TYPE_CHECKING:  # for annotations only: generate() imports it when called, as before
    from evolving_infra.traces.io import Trace

KIND = "claude-code"
DEFAULT_AGENTS = 90
"""Paper §6.1: 90, 108 and 126 concurrent CC agents; the lowest is the default."""
FIT_FILE = Path(__file__).with_name("claude_code_fit.py")
E2E_ESTIMATE_S = 7.9
"""Mean E2E latency used for ``--duration`` budgets (paper Table C.3, Evolving Infra, CC 90 agents)."""


@lru_cache(maxsize=1)
def load_fit() -> dict[str, Any]:
    """The fitted parameters (``claude_code_fit.FIT``)."""
    from evolving_infra.traces.generate.claude_code_fit import FIT

    return FIT


def _targets() -> tuple[Target, ...]:
    fit = load_fit()
    src = f"fitted: trace stats of the {fit['fitted_from']['sessions']} real Claude Code sessions (claude_code_fit.py)"
    return tuple(Target(k, float(v), src) for k, v in fit["targets"].items())


TARGETS = _targets()


class _Model:
    """Samplers built from the fit plus the per-trace rare-event processes."""

    def __init__(self, rng: np.random.Generator):
        fit = load_fit()
        self.t = {k: QuantileTable.from_dict(v) for k, v in fit["tables"].items()}
        r = fit["rates"]
        self.spawns = RateEvents(r["subagent_spawns_per_main_request"], rng)
        self.sides = RateEvents(r["side_forks_per_main_request"], rng)
        self.rewrites = RateEvents(r["rewrites_per_main_request"], rng)
        self.manual_shrinks = RateEvents(r["manual_shrinks_per_main_request"], rng)
        self.max_context = float(r["max_context"])
        self.auto_scale = float(r["auto_compaction_scale"])
        self.sessions = fit["sessions"]["rows"]
        self.session_deck = Deck({i: 1 for i in range(len(self.sessions))}, rng)
        self.fanout = Deck({int(k): int(v) for k, v in fit["fanout"].items()}, rng)

    def draw(self, name: str, rng: np.random.Generator) -> float:
        return self.t[name].sample(rng)

    def count(self, name: str, rng: np.random.Generator) -> int:
        return max(1, int(round(self.draw(name, rng))))


def _chain(
    m: _Model, rng: np.random.Generator, br: Branch, n: int, first_after: list[str], first_pause: float, growth: str, output: str, pause: str
) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    after, p = first_after, first_pause
    for j in range(n):
        if j:
            br.extend(max(1, int(m.draw(growth, rng))))
            p = m.draw(pause, rng)
        r = br.request(int(m.draw(output, rng)), after, p)
        out.append(r)
        after = [r.id]
    return out


def build_agent(
    rng: np.random.Generator,
    pool: IdPool,
    agent: str,
    block_size: int,
    m: _Model,
    *,
    duration_s: float | None = None,
    requests_per_agent: int | None = None,
) -> list[TraceRequest]:
    """One Claude-Code-like session: its requests in a valid send order."""
    bs = block_size
    if requests_per_agent is not None and requests_per_agent < 1:
        raise GenerateError("--requests-per-agent must be >= 1")
    if duration_s is not None and duration_s <= 0:
        raise GenerateError("--duration must be > 0")
    real_n, real_first, large = m.sessions[m.session_deck.draw()]
    n_main = requests_per_agent if requests_per_agent is not None else (None if duration_s is not None else int(real_n))
    shared = int(m.draw("shared_prefix", rng)) // bs * bs
    first = max(int(real_first), shared + 1)
    main = Branch(pool, bs, agent, f"{agent}:main", "main", None, pool.shared(f"{KIND}:main", shared // bs), first)
    large_window = bool(large)
    limit = m.max_context if large_window else m.auto_scale * m.draw("auto_compaction_context", rng)
    out: list[TraceRequest] = []
    after: list[str] = []
    pause = 0.0
    busy = 0.0
    n_sub = n_side = 0
    i = 0
    while True:
        compaction = False
        if i:
            ctx = main.tokens
            growth = max(1, int(m.draw("growth", rng)))
            if m.rewrites.step():
                main.rewrite(shared, int(ctx * m.draw("rewrite_ratio", rng)))
                compaction = True
            elif ctx + growth > limit and ctx >= 2 * shared:
                main.rewrite(shared, int(ctx * m.draw("shrink_ratio", rng)))
                compaction = True
                limit = m.max_context if large_window else m.auto_scale * m.draw("auto_compaction_context", rng)
            else:
                main.extend(growth)
            pause = m.draw("join_pause" if len(after) > 1 else "pause", rng)
        req = main.request(int(m.draw("output", rng)), after, pause, compaction=compaction)
        out.append(req)
        after = [req.id]
        busy += pause + E2E_ESTIMATE_S
        i += 1
        if (n_main is not None and i >= n_main) or (duration_s is not None and busy >= duration_s):
            break
        if m.spawns.step():
            lasts: list[str] = []
            for _ in range(m.fanout.draw()):
                n_sub += 1
                sp = int(m.draw("sub_shared_prefix", rng)) // bs * bs
                t0 = max(int(m.draw("sub_first_input", rng)), sp + 1)
                sb = Branch(pool, bs, agent, f"{agent}:sub{n_sub}", "subagent", main.bid, pool.shared(f"{KIND}:subagent", sp // bs), t0)
                chain = _chain(m, rng, sb, m.count("sub_requests", rng), [req.id], m.draw("sub_first_pause", rng), "sub_growth", "sub_output", "sub_pause")
                out.extend(chain)
                lasts.append(chain[-1].id)
            after = after + lasts
        elif m.sides.step():
            n_side += 1
            t0 = max(int(m.draw("side_first_input", rng)), shared + 1)
            fb = Branch(pool, bs, agent, f"{agent}:side{n_side}", "fork", main.bid, pool.shared(f"{KIND}:main", shared // bs), t0)
            chain = _chain(m, rng, fb, m.count("side_requests", rng), [req.id], m.draw("pause", rng), "growth", "output", "pause")
            out.extend(chain)
            after = [chain[-1].id]
    return out


def generate(*, seed: int = 0, agents: int | None = None, duration_s: float | None = None, requests_per_agent: int | None = None, block_size: int = 64) -> Trace:
    """A Claude-Code-like trace: ``agents`` sessions (default 90), seeded; see the module docstring."""
    from evolving_infra.traces.io import Trace

    n = DEFAULT_AGENTS if agents is None else agents
    check_common_options(n, block_size)
    rng = np.random.default_rng(seed)
    pool = IdPool()
    model = _Model(rng)
    reqs: list[TraceRequest] = []
    for a in range(n):
        reqs.extend(build_agent(rng, pool, f"cc{a:05d}", block_size, model, duration_s=duration_s, requests_per_agent=requests_per_agent))
    fit = load_fit()
    header = make_header(
        KIND,
        block_size=block_size,
        seed=seed,
        options={"agents": n, "duration_s": duration_s, "requests_per_agent": requests_per_agent},
        targets=TARGETS,
        parameters={
            "fit_file": FIT_FILE.name,
            "fitted_from": fit["fitted_from"]["sessions"],
            "rates": fit["rates"],
            "fanout": fit["fanout"],
            "table_means": {k: round(v["mean"], 3) for k, v in fit["tables"].items()},
            "e2e_estimate_s": E2E_ESTIMATE_S,
        },
        description="Claude-Code-like coding agent fitted to 530 real sessions: sub-agents, side calls, compactions, long pauses",
    )
    return Trace(header, finish_branches(reqs))
