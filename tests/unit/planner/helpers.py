"""Builders for planner core tests: synthetic iteration records, slices, node states, finished requests."""

from __future__ import annotations

import numpy as np

from shared.itermodel import DecodeModel, PrefillModel, qk_pairs
from shared.messages import IterationRecord, NodeState, QueuedWork
from services.planner.observe import SliceStats
from services.planner.policy import RequestDone


def true_time(kind: str, uc: int, qk: int, rst: int, b: int, pm: PrefillModel, dm: DecodeModel) -> float:
    tp = pm.iteration_time(uc, qk, rst) if kind != "decode" else 0.0
    td = dm.iteration_time(b) if kind != "prefill" else 0.0
    if kind == "mixed":
        return tp + td - min(pm.c0, dm.d0)
    return tp + td


def records(
    n: int,
    pm: PrefillModel,
    dm: DecodeModel,
    *,
    seed: int = 0,
    noise: float = 0.0,
    mix: tuple[float, float, float] = (0.1, 0.4, 0.5),
    restore: bool = True,
) -> list[IterationRecord]:
    """``n`` records (prefill, decode, mixed with probabilities ``mix``) timed by the true
    models, times a lognormal noise of relative size ``noise``."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in rng.choice(["prefill", "decode", "mixed"], size=n, p=list(mix)):
        uc = qk = rst = b = 0
        if kind != "decode":
            k = int(rng.integers(1, 4))
            ucs = rng.integers(64, 8192 // k, size=k)
            cs = rng.integers(0, 400_000, size=k)
            uc = int(ucs.sum())
            qk = int(sum(qk_pairs(int(a), int(c)) for a, c in zip(ucs, cs)))
            rst = int(cs.sum() * rng.uniform(0, 0.5)) if restore and rng.random() < 0.5 else 0
        if kind != "prefill":
            b = int(rng.integers(1, 65))
        t = true_time(str(kind), uc, qk, rst, b, pm, dm) * float(np.exp(rng.normal(0.0, noise))) if noise else true_time(
            str(kind), uc, qk, rst, b, pm, dm
        )
        out.append(
            IterationRecord(
                start=0.0, duration_s=t, phase=str(kind), sum_uncached=uc, sum_qk_pairs=qk, sum_restored=rst, decode_batch=b  # type: ignore[arg-type]
            )
        )
    return out


def sl(t_uc: float = 4000, t_c: float = 100_000, t_out: float = 1000, q: float = 60, n: int = 50) -> SliceStats:
    """One slice with requests of the given mean work."""
    return SliceStats(n, t_uc, t_c, t_uc * t_c + t_uc * (t_uc + 1) / 2, t_out, q, t_uc + t_c)


def done(rid: str, now: float, *, prompt: int = 104_000, cached: int = 100_000, out: int = 1000, node: str = "w0", ttft: float = 1.0) -> RequestDone:
    return RequestDone(
        rid=rid,
        prefill_node=node,
        decode_node="w8",
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=out,
        arrived_at=now - 20.0,
        ttft_s=ttft,
        e2e_s=20.0,
    )


def state(node: str, phase: str, *, decoding: int = 0, waiting: int = 0, queue: int = 0, qwork: tuple[int, int] = (4000, 100_000),
          free: int = 100, total: int = 100, remaining: float = 0.0, accepting: bool = True) -> NodeState:
    return NodeState(
        node=node,
        phase=phase,  # type: ignore[arg-type]
        decoding=decoding,
        waiting=waiting,
        queue=[QueuedWork(rid=f"{node}-q{i}", uncached_tokens=qwork[0], cached_tokens=qwork[1]) for i in range(queue)],
        gpu_free_blocks=free,
        gpu_total_blocks=total,
        remaining_s=remaining,
        accepting=accepting,
    )
