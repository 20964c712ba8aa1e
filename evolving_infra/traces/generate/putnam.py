"""Putnam-like workload: a math agent (mini-SWE-agent on PutnamBench, paper §6.1), decode-heavy.

One ``main`` branch per agent (one problem), append-only, no sub-agents, forks
or compactions ("a single agent branch per problem without context
management", paper §6.1). Each step decodes a long reasoning trace; only the
visible answer and the tool (Lean checker) output go back into the context, so
each request prefills little and decodes a lot (Figure 2a: decode-heavy, best
static split 2P7D).

Parameters (:data:`PARAMS`) and their sources:

* pause before each step: lognormal, mean 10 s, σ 0.5 — paper Table C.3
  (T̄pause 9.9–10.1 s on Putnam at 224–288 agents; DESIGN §6a ≈10 s).
* output tokens: lognormal, mean 1,750, σ 0.6 — derived (paper D.1 / Table C.3,
  DESIGN §6a; the gb300-glm52 decode model of Figure 5d):
  SGLang 2P7D serves 9.00 req/s at E2E 14.6 s and TTFT 1.0 s with ≈10 s pauses:
  9.00 × (14.6 + 10) = 221 branches ≈ the 224 agents (Little's law, Eq. C.1),
  so the numbers are one consistent operating point. Its decode part,
  14.6 − 1.0 = 13.6 s, keeps 9.00 × 13.6 = 122 requests decoding on 7 nodes,
  ≈17.5 per node; Figure 5d's iteration time at that batch (17 ms at 8,
  45 ms at 64 running; the profile gives 24.6 ms at 17.5) over 3.2 accepted
  tokens per iteration is a TPOT of ≈7.7 ms — the top of the paper's 4.4–7.9 ms
  range, as the most decode-loaded workload should be — so 13.6 s / 7.7 ms ≈
  1,770 tokens. The earlier 2,500 (midpoint of 13.6 s / 4.4–7.9 ms) would need
  a 5.4 ms TPOT at 17.5 running, i.e. 4.5 accepted tokens per iteration with
  3 MTP drafts (at most 4): not possible.
* first input: a 1,000-token system + task template shared by all agents plus
  a ~600-token problem (lognormal σ 0.4): ≈1.6K, the median first call of the
  mini-swe-agent trajectories (research/traces.md). The template size is an
  assumption.
* appended per step: the visible answer (lognormal mean 500, σ 0.5, at most the
  output: the thinking part is not re-sent) plus the checker output (lognormal
  mean 400, σ 0.7) — assumption (Figure 2a's per-step numbers are not legible
  in the extracted paper text).
* steps per problem: lognormal mean 20, σ 0.5 — assumption.
* E2E estimate for ``--duration`` budgets: 15.5 s (Table C.3, Evolving Infra, 224 agents).

:data:`TARGETS` are checked through ``trace stats`` by
tests/unit/traces/test_generate.py (default options, within 10 %).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from evolving_infra.traces.generate.common import (
    Branch,
    IdPool,
    Target,
    agent_budget,
    check_common_options,
    finish_branches,
    lognormal,
    make_header,
)
from evolving_infra.traces.schema import TraceRequest

if TYPE_CHECKING:  # for annotations only: generate() imports it when called, as before
    from evolving_infra.traces.io import Trace

KIND = "putnam"
DEFAULT_AGENTS = 224
"""Paper §6.1: 224, 256 and 288 concurrent Putnam agents; the lowest is the default."""

PARAMS = {
    "shared_prompt_tokens": 1000,
    "problem_tokens_mean": 600.0,
    "problem_tokens_sigma": 0.4,
    "output_tokens_mean": 1750.0,
    "output_tokens_sigma": 0.6,
    "kept_output_tokens_mean": 500.0,
    "kept_output_tokens_sigma": 0.5,
    "tool_output_tokens_mean": 400.0,
    "tool_output_tokens_sigma": 0.7,
    "pause_s_mean": 10.0,
    "pause_s_sigma": 0.5,
    "steps_mean": 20.0,
    "steps_sigma": 0.5,
    "e2e_estimate_s": 15.5,
}

TARGETS = (
    Target("pause_s.mean", 10.0, "paper Table C.3: T̄pause 9.9–10.1 s on Putnam; DESIGN §6a ≈10 s"),
    Target(
        "output_tokens.mean",
        1750.0,
        "derived: SGLang 2P7D (D.1) decodes 14.6 − 1.0 = 13.6 s per request with 9.0 × 13.6 / 7 ≈ 17.5 running per "
        "decode node ⇒ TPOT ≈ T_D(17.5)/t_acc ≈ 24.6/3.2 ≈ 7.7 ms (Figure 5d; paper range 4.4–7.9 ms) ⇒ ≈1,770 tokens",
    ),
    Target("input_growth_tokens.mean", 900.0, "assumption: visible answer 500 + checker output 400 tokens per step"),
    Target("requests_per_session.mean", 20.0, "assumption: 20 steps per problem"),
    Target("branches_by_kind.subagent", 0.0, "paper §6.1: a single agent branch per problem", abs_tol=0.0),
    Target("branches_by_kind.fork", 0.0, "paper §6.1: a single agent branch per problem", abs_tol=0.0),
    Target("compactions", 0.0, "paper §6.1: no context management", abs_tol=0.0),
)


def task_length(rng: np.random.Generator) -> int:
    return max(1, int(round(lognormal(rng, PARAMS["steps_mean"], PARAMS["steps_sigma"]))))


def build_agent(
    rng: np.random.Generator,
    pool: IdPool,
    agent: str,
    block_size: int,
    *,
    duration_s: float | None = None,
    requests_per_agent: int | None = None,
) -> list[TraceRequest]:
    """One Putnam agent (one problem): its requests in send order."""
    p = PARAMS
    fixed, budget = agent_budget(rng, duration_s=duration_s, requests_per_agent=requests_per_agent, task_length=task_length)
    shared = int(p["shared_prompt_tokens"])
    first = shared + max(1, int(lognormal(rng, p["problem_tokens_mean"], p["problem_tokens_sigma"])))
    br = Branch(pool, block_size, agent, f"{agent}:main", "main", None, pool.shared(f"{KIND}:prompt", shared // block_size), first)
    out: list[TraceRequest] = []
    busy = 0.0
    prev: str | None = None
    pause = 0.0
    while True:
        output = max(1, int(lognormal(rng, p["output_tokens_mean"], p["output_tokens_sigma"])))
        req = br.request(output, [prev] if prev else [], pause)
        out.append(req)
        prev = req.id
        busy += pause + p["e2e_estimate_s"]
        if fixed is not None and len(out) >= fixed:
            break
        if budget is not None and busy >= budget:
            break
        kept = min(output, max(1, int(lognormal(rng, p["kept_output_tokens_mean"], p["kept_output_tokens_sigma"]))))
        tool = max(1, int(lognormal(rng, p["tool_output_tokens_mean"], p["tool_output_tokens_sigma"])))
        br.extend(kept + tool)
        pause = lognormal(rng, p["pause_s_mean"], p["pause_s_sigma"])
    return out


def generate(*, seed: int = 0, agents: int | None = None, duration_s: float | None = None, requests_per_agent: int | None = None, block_size: int = 64) -> Trace:
    """A Putnam-like trace: ``agents`` problems (default 224), seeded; see the module docstring."""
    from evolving_infra.traces.io import Trace

    n = DEFAULT_AGENTS if agents is None else agents
    check_common_options(n, block_size)
    rng = np.random.default_rng(seed)
    pool = IdPool()
    reqs: list[TraceRequest] = []
    for a in range(n):
        reqs.extend(build_agent(rng, pool, f"putnam{a:05d}", block_size, duration_s=duration_s, requests_per_agent=requests_per_agent))
    header = make_header(
        KIND,
        block_size=block_size,
        seed=seed,
        options={"agents": n, "duration_s": duration_s, "requests_per_agent": requests_per_agent},
        targets=TARGETS,
        parameters=PARAMS,
        description="Putnam-like math agent: decode-heavy, one branch per problem, no context management, ~10 s pauses",
    )
    return Trace(header, finish_branches(reqs))
