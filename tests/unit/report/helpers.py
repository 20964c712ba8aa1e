"""Small builders for report tests: hand-made records, timelines and run directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evolving_infra.report.records import RequestRecord
from evolving_infra.report.timeline import RunTimeline, TimelineRecorder
from evolving_infra.report.write import build_report, write_report
from shared.messages import SplitApplied


def rec(
    i: int,
    *,
    sent_at: float = 0.0,
    ttft: float | None = 1.0,
    e2e: float | None = 2.0,
    prompt: int = 100,
    cached: int = 0,
    out: int = 11,
    node: str | None = "w0",
    queue: float | None = None,
    ok: bool = True,
    agent: str = "a0",
    branch: str | None = None,
    kind: str = "main",
    ideal: int | None = None,
    finished_at: float | None = None,
) -> RequestRecord:
    """One record; ``finished_at`` defaults to ``sent_at + e2e``."""
    if finished_at is None:
        finished_at = sent_at + (e2e if e2e is not None else 0.0)
    return RequestRecord(
        id=f"r{i}",
        agent=agent,
        branch=branch or f"{agent}-b0",
        branch_kind=kind,
        sent_at=sent_at,
        ok=ok,
        status=200 if ok else 500,
        error=None if ok else "boom",
        ttft_s=ttft if ok else None,
        e2e_s=e2e if ok else None,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=out,
        prefill_node=node,
        decode_node="w3",
        finished_at=finished_at,
        queue_s=queue,
        ideal_cached_tokens=ideal,
    )


def applied(node: str, phase: str, *, epoch: int, decided: float, at: float, status: str = "serving") -> SplitApplied:
    return SplitApplied(
        epoch=epoch, node=node, phase=phase, status=status, decided_at=decided, applied_at=at,  # type: ignore[arg-type]
        switch_s=max(0.0, at - decided) if status == "serving" else 0.0,
    )


def switching_timeline() -> RunTimeline:
    """2P2D at t=0; epoch 1 decided at 95 s turns w1 to decode at 100 s (1P3D); epoch 2 decided at
    200 s turns w1 and w2 to prefill at 203 s and 204 s (3P1D)."""
    r = TimelineRecorder({"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "decode"}, t0=0.0)
    for n, ph in (("w0", "prefill"), ("w1", "decode"), ("w2", "decode"), ("w3", "decode")):
        r.on_applied(applied(n, ph, epoch=1, decided=95.0, at=100.0))
    for n, ph, at in (("w0", "prefill", 200.5), ("w1", "prefill", 203.0), ("w2", "prefill", 204.0), ("w3", "decode", 200.5)):
        r.on_applied(applied(n, ph, epoch=2, decided=200.0, at=at))
    return r.timeline()


def synthetic_records(n: int = 40, *, scale: float = 1.0, seed: int = 0, ideal: bool = True) -> list[RequestRecord]:
    """A small deterministic run over ~4 minutes, two prefill nodes, with queue times."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        sent = i * 6.0
        ttft = scale * (0.2 + rng.random())
        e2e = ttft + scale * (1.0 + 2 * rng.random())
        prompt = 1000 + 100 * (i % 5)
        cached = int(prompt * 0.6) if i % 3 else 0
        out.append(
            rec(
                i, sent_at=sent, ttft=ttft, e2e=e2e, prompt=prompt, cached=cached, out=50,
                node=f"w{i % 2}", queue=scale * rng.random() * (2.0 if i % 2 else 1.0),
                agent=f"a{i % 4}", kind="subagent" if i % 7 == 0 else "main",
                ideal=int(prompt * 0.7) if ideal else None,
            )
        )
    return out


def make_run(tmp: Path, name: str, *, scale: float = 1.0, timeline: bool = True, plots: bool = True, **meta: Any) -> Path:
    """Write a synthetic run directory with ``write_report``; returns it."""
    records = synthetic_records(scale=scale)
    report = build_report(
        records,
        meta={"command": "test", "label": name, "cluster": {"split": "2P2D"}, **meta},
        ideal_kv_hit_rate=0.7,
        timeline=switching_timeline() if timeline else None,
    )
    d = tmp / name
    write_report(d, report, records, plots=plots)
    return d
