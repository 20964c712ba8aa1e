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
* output tokens: lognormal, mean 2,500, σ 0.6 — derived from DESIGN §6a: Putnam
  E2E 14.6 s − TTFT 1.0 s under SGLang 2P7D = 13.6 s of decode at the paper's
  TPOT of 4.4–7.9 ms ⇒ 1.7K–3.1K tokens per request.
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

KIND = "putnam"
DEFAULT_AGENTS = 224
"""Paper §6.1: 224, 256 and 288 concurrent Putnam agents; the lowest is the default."""

PARAMS = {
    "shared_prompt_tokens": 1000,
    "problem_tokens_mean": 600.0,
    "problem_tokens_sigma": 0.4,
    "output_tokens_mean": 2500.0,
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
    Target("output_tokens.mean", 2500.0, "derived: DESIGN §6a Putnam (E2E 14.6 s − TTFT 1.0 s) / TPOT 4.4–7.9 ms ≈ 1.7K–3.1K"),
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


def generate(*, seed: int = 0, agents: int | None = None, duration_s: float | None = None, requests_per_agent: int | None = None, block_size: int = 64):  # type: ignore[no-untyped-def]
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
