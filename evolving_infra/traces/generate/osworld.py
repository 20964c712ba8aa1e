"""OSWorld-like workload: a computer-use agent (Anthropic's CUA on OSWorld 2.0, paper §6.1), prefill-heavy.

Each step appends a screenshot's tokens (plus the previous action and a short
text observation) to the context and decodes a short action, so each request
prefills far more than it decodes (Figure 2a: prefill-heavy, best static split
6P3D). Multi-agent (§6.1): the main agent sometimes spawns computer-use
sub-agents (each with its own context, screenshots included) and waits for all
of them before its next step.

Parameters (:data:`PARAMS`) and their sources:

* pause before each step: lognormal, mean 1.3 s, σ 0.4 — paper Table C.3
  (T̄pause 1.3–1.4 s for Evolving Infra on OSWorld; DESIGN §6a).
* output tokens: lognormal, mean 250, σ 0.5 — derived: Appendix D.1, OSWorld
  E2E 24.2 s vs TTFT 21.6 s ⇒ ≈2.6 s of decode, ≈250 tokens at ~10 ms per
  token on the single decode node.
* screenshot: 2,500 tokens per step — assumption: a 1920×1080 screenshot in
  28×28-pixel vision tokens (14-px patches, 2×2 merge, Kimi-VL-style) ≈ 2.6K.
* text observation per step: lognormal mean 100, σ 0.5 — assumption.
* first input: a 2,000-token system prompt with tool definitions shared by all
  agents, a ~150-token task, and the first screenshot — assumption.
* steps per task: lognormal mean 30, σ 0.4, at most 100 — assumption (OSWorld
  runs cap steps at 15–100).
* sub-agents: 0.05 spawns per main step (renewal process), fan-out 1, 2 or 3
  with equal frequency (mean 2); each runs lognormal mean 8 (σ 0.4) steps with
  its own 1,500-token shared system prompt and a ~100-token sub-task, then the
  parent's next step joins all of them — assumption.
* E2E estimate for ``--duration`` budgets: 24.5 s (Table C.3, Evolving Infra, 128 agents).
"""

from __future__ import annotations

import numpy as np

from evolving_infra.traces.generate.common import (
    Branch,
    Deck,
    IdPool,
    RateEvents,
    Target,
    agent_budget,
    check_common_options,
    finish_branches,
    lognormal,
    make_header,
)
from evolving_infra.traces.schema import TraceRequest

KIND = "osworld"
DEFAULT_AGENTS = 128
"""Paper §6.1: 128, 144 and 160 concurrent OSWorld agents; the lowest is the default."""

PARAMS = {
    "system_prompt_tokens": 2000,
    "task_tokens_mean": 150.0,
    "screenshot_tokens": 2500,
    "observation_tokens_mean": 100.0,
    "observation_tokens_sigma": 0.5,
    "output_tokens_mean": 250.0,
    "output_tokens_sigma": 0.5,
    "pause_s_mean": 1.3,
    "pause_s_sigma": 0.4,
    "steps_mean": 30.0,
    "steps_sigma": 0.4,
    "steps_max": 100,
    "subagent_spawns_per_step": 0.05,
    "subagent_fanout_counts": {1: 1, 2: 1, 3: 1},
    "subagent_steps_mean": 8.0,
    "subagent_steps_sigma": 0.4,
    "subagent_system_prompt_tokens": 1500,
    "subagent_task_tokens_mean": 100.0,
    "e2e_estimate_s": 24.5,
}

TARGETS = (
    Target("pause_s.mean", 1.3, "paper Table C.3: T̄pause 1.3–1.4 s on OSWorld (Evolving Infra); DESIGN §6a"),
    Target("output_tokens.mean", 250.0, "derived: paper Appendix D.1, E2E 24.2 s − TTFT 21.6 s ≈ 2.6 s of decode"),
    Target("input_growth_tokens.mean", 2850.0, "assumption: screenshot 2,500 + previous action 250 + observation 100 tokens per step"),
    Target("subagents_per_request", 0.10, "assumption: 0.05 spawns per main step × fan-out 2"),
    Target("subagent_fanout.mean", 2.0, "assumption: fan-out 1–3, equal frequency"),
    Target("compactions", 0.0, "no context management in the OSWorld runs (paper §6.1)", abs_tol=0.0),
)


def task_length(rng: np.random.Generator) -> int:
    n = int(round(lognormal(rng, PARAMS["steps_mean"], PARAMS["steps_sigma"])))
    return min(int(PARAMS["steps_max"]), max(1, n))


class _Agent:
    """Per-trace state shared by all OSWorld agents (rare-event processes)."""

    def __init__(self, rng: np.random.Generator):
        p = PARAMS
        self.spawns = RateEvents(float(p["subagent_spawns_per_step"]), rng)
        self.fanout = Deck(dict(p["subagent_fanout_counts"]), rng)  # type: ignore[arg-type]


def _obs(rng: np.random.Generator) -> int:
    return int(PARAMS["screenshot_tokens"]) + max(1, int(lognormal(rng, PARAMS["observation_tokens_mean"], PARAMS["observation_tokens_sigma"])))


def _output(rng: np.random.Generator) -> int:
    return max(1, int(lognormal(rng, PARAMS["output_tokens_mean"], PARAMS["output_tokens_sigma"])))


def _pause(rng: np.random.Generator) -> float:
    return lognormal(rng, PARAMS["pause_s_mean"], PARAMS["pause_s_sigma"])


def build_agent(
    rng: np.random.Generator,
    pool: IdPool,
    agent: str,
    block_size: int,
    state: _Agent,
    *,
    duration_s: float | None = None,
    requests_per_agent: int | None = None,
) -> list[TraceRequest]:
    """One OSWorld task: main-branch steps with occasional sub-agent fan-outs, in a valid send order."""
    p = PARAMS
    bs = block_size
    fixed, budget = agent_budget(rng, duration_s=duration_s, requests_per_agent=requests_per_agent, task_length=task_length)
    sysp = int(p["system_prompt_tokens"])
    first = sysp + max(1, int(lognormal(rng, p["task_tokens_mean"], 0.4))) + _obs(rng)
    main = Branch(pool, bs, agent, f"{agent}:main", "main", None, pool.shared(f"{KIND}:system", sysp // bs), first)
    out: list[TraceRequest] = []
    busy = 0.0
    after: list[str] = []
    pause = 0.0
    n_sub = 0
    steps = 0
    while True:
        output = _output(rng)
        req = main.request(output, after, pause)
        out.append(req)
        steps += 1
        busy += pause + p["e2e_estimate_s"]
        done = (fixed is not None and steps >= fixed) or (budget is not None and busy >= budget)
        after = [req.id]
        if not done and state.spawns.step():
            k = state.fanout.draw()
            subs: list[Branch] = []
            ssp = int(p["subagent_system_prompt_tokens"])
            for _ in range(k):
                n_sub += 1
                t0 = ssp + max(1, int(lognormal(rng, p["subagent_task_tokens_mean"], 0.4))) + _obs(rng)
                subs.append(Branch(pool, bs, agent, f"{agent}:sub{n_sub}", "subagent", main.bid, pool.shared(f"{KIND}:subagent-system", ssp // bs), t0))
            lasts: list[str] = []
            for sb in subs:  # each sub-agent runs its steps; they run in parallel with each other
                n_steps = max(1, int(round(lognormal(rng, p["subagent_steps_mean"], p["subagent_steps_sigma"]))))
                s_after = [req.id]
                for j in range(n_steps):
                    so = _output(rng)
                    sr = sb.request(so, s_after, _pause(rng))
                    out.append(sr)
                    s_after = [sr.id]
                    if j + 1 < n_steps:
                        sb.extend(so + _obs(rng))
                lasts.append(s_after[0])
            after = after + lasts
        if done:
            break
        main.extend(output + _obs(rng))
        pause = _pause(rng)
    return out


def generate(*, seed: int = 0, agents: int | None = None, duration_s: float | None = None, requests_per_agent: int | None = None, block_size: int = 64):  # type: ignore[no-untyped-def]
    """An OSWorld-like trace: ``agents`` tasks (default 128), seeded; see the module docstring."""
    from evolving_infra.traces.io import Trace

    n = DEFAULT_AGENTS if agents is None else agents
    check_common_options(n, block_size)
    rng = np.random.default_rng(seed)
    pool = IdPool()
    state = _Agent(rng)
    reqs: list[TraceRequest] = []
    for a in range(n):
        reqs.extend(build_agent(rng, pool, f"osworld{a:05d}", block_size, state, duration_s=duration_s, requests_per_agent=requests_per_agent))
    header = make_header(
        KIND,
        block_size=block_size,
        seed=seed,
        options={"agents": n, "duration_s": duration_s, "requests_per_agent": requests_per_agent},
        targets=TARGETS,
        parameters={k: ({str(a): b for a, b in v.items()} if isinstance(v, dict) else v) for k, v in PARAMS.items()},
        description="OSWorld-like computer-use agent: prefill-heavy (a screenshot per step), ~1.3 s pauses, sub-agents",
    )
    return Trace(header, finish_branches(reqs))
