"""Take a subset of a trace's agents and optionally cap every branch (spec: docs/trace-format.md §6)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

from evolving_infra.traces.schema import TraceRequest

__all__ = ["cap_branches", "sample_sessions"]


def sample_sessions(trace, n: int, seed: int = 0, max_requests_per_branch: int | None = None):  # type: ignore[no-untyped-def]
    """N agents of ``trace`` (file order kept), optionally each branch capped to its first K requests.

    Agents are drawn without replacement by ``numpy.random.default_rng(seed)``;
    when ``n`` ≥ the number of agents every agent is kept (no draw). With a cap
    (``max_requests_per_branch`` = K > 0, see :func:`cap_branches`) each branch
    keeps its first K requests; requests whose ``after`` names a dropped request
    are dropped too, transitively, as are branches whose first request is dropped
    (e.g. a sub-agent spawned after the parent's K-th request, or a parent's
    join on a capped sub-agent's dropped request and everything after it);
    ``ends_branch`` is set on the last kept request of every branch.

    The header's ``meta["sample"]`` records ``agents``, ``seed``,
    ``max_requests_per_branch`` and how many requests and branches were dropped.

    Args:
        trace: an :class:`evolving_infra.traces.io.Trace`.
        n: number of agents to keep (> 0).
        seed: RNG seed for the draw.
        max_requests_per_branch: K, or None / 0 for no cap.

    Returns:
        A new ``Trace``; the input is not modified.

    Raises:
        ValueError: ``n`` < 1 or K < 0.
    """
    from evolving_infra.traces.io import Trace

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    agents = trace.agents()
    if n < len(agents):
        rng = np.random.default_rng(seed)
        picked = np.sort(rng.choice(len(agents), size=n, replace=False))
        keep = {agents[i] for i in picked}
        requests = [r for r in trace.requests if r.agent in keep]
    else:
        keep = set(agents)
        requests = list(trace.requests)
    info: dict[str, object] = {"agents": len(keep), "of_agents": len(agents), "seed": seed}
    if max_requests_per_branch:
        requests, dropped_r, dropped_b = cap_branches(requests, max_requests_per_branch)
        info.update(max_requests_per_branch=max_requests_per_branch, dropped_requests=dropped_r, dropped_branches=dropped_b)
    meta = dict(trace.header.meta)
    meta["sample"] = info
    header = msgspec.structs.replace(trace.header, meta=meta)
    return Trace(header, requests)


def cap_branches(requests: list[TraceRequest], k: int) -> tuple[list[TraceRequest], int, int]:
    """Keep each branch's first ``k`` requests and what still has its dependencies.

    Returns:
        (kept requests in input order with ``ends_branch`` fixed, dropped request
        count, dropped branch count).

    Raises:
        ValueError: ``k`` < 1.
    """
    if k < 1:
        raise ValueError(f"max_requests_per_branch must be >= 1, got {k}")
    per_branch: dict[str, int] = {}
    kept_ids: set[str] = set()
    kept: list[TraceRequest] = []
    all_branches: set[str] = set()
    kept_branches: set[str] = set()
    broken: set[str] = set()  # a request of the branch was dropped: the rest of it goes too
    for r in requests:
        all_branches.add(r.branch)
        i = per_branch.get(r.branch, 0)
        per_branch[r.branch] = i + 1
        ok = (
            i < k
            and r.branch not in broken
            and all(d in kept_ids for d in r.after)
            and (r.parent_branch is None or r.parent_branch in kept_branches)
        )
        if not ok:
            broken.add(r.branch)
            continue
        kept_ids.add(r.id)
        kept_branches.add(r.branch)
        kept.append(r)
    last: dict[str, int] = {}
    for idx, r in enumerate(kept):
        last[r.branch] = idx
    out: list[TraceRequest] = []
    for idx, r in enumerate(kept):
        ends = last[r.branch] == idx
        out.append(r if r.ends_branch == ends else msgspec.structs.replace(r, ends_branch=ends))
    return out, len(requests) - len(out), len(all_branches) - len(kept_branches)


def scale_trace_for_model(requests: list[TraceRequest], context: int, max_output: int) -> list[TraceRequest]:
    """The trace scaled down for a small real model (``demo --engine torch``, ``replay --scale-to-model``): each trace
    block becomes one token (``LiveReplayer(block_size=1)``; equal block prefixes stay equal
    token prefixes, so cache reuse, forks and sub-agents keep their shape), prompts are cut
    to ``context − max_output − 1`` tokens (``context``: the token limit a request must fit) (a prefix, so sharing is kept), outputs to
    ``max_output`` tokens. A request with no full block gets one private block.

    Raises:
        ValueError: ``context`` ≤ ``max_output`` + 1 or ``max_output`` < 1.
    """
    from evolving_infra.traces.tokens import PRIVATE_ID_BASE

    if max_output < 1 or context <= max_output + 1:
        raise ValueError(f"context {context} must exceed max_output {max_output} + 1")
    out = []
    for i, r in enumerate(requests):
        blocks = list(r.blocks[: context - max_output - 1]) or [PRIVATE_ID_BASE + i]
        out.append(msgspec.structs.replace(r, blocks=blocks, input_tokens=len(blocks), output_tokens=min(r.output_tokens, max_output)))
    return out


def scale_description(trace_block_size: int, context: int, max_output: int) -> str:
    """What :func:`scale_trace_for_model` does to a trace of ``trace_block_size``-token blocks, in one phrase for the
    line ``demo --engine torch`` and ``replay --scale-to-model`` print (``context``, ``max_output`` as there)."""
    return (f"each {trace_block_size}-token block of the trace is one token, prompts cut to {context - max_output - 1} "
            f"tokens, at most {max_output} output tokens")
