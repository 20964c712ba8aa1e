"""Builders for simulator tests: small hand-made traces on the ``tiny`` profile (4-token blocks)."""

from __future__ import annotations

import zlib

import msgspec
import pytest

from evolving_infra.traces.schema import TraceRequest

BS = 4


def chain_agent(
    agent: str,
    n: int,
    *,
    first_blocks: int = 4,
    growth: int = 2,
    tail: int = 1,
    output: int = 4,
    pause: float = 0.0,
    base: int | None = None,
) -> list[TraceRequest]:
    """One agent with one branch of ``n`` requests; request i extends request i-1's prompt by
    ``growth`` blocks (shared prefix, chained ids), each sent ``pause`` s after the previous one.
    The default ``base`` comes from the agent's name by CRC-32, not ``hash()``, whose salt
    ``PYTHONHASHSEED`` changes: the same ids in every test process."""
    base = (zlib.crc32(agent.encode()) % 1000 + 1) * 10_000 if base is None else base
    reqs = []
    blocks: list[int] = []
    for i in range(n):
        want = first_blocks + i * growth
        while len(blocks) < want:
            blocks.append(base + len(blocks))
        reqs.append(
            TraceRequest(
                id=f"{agent}-r{i}",
                agent=agent,
                branch=f"{agent}-main",
                input_tokens=len(blocks) * BS + tail,
                output_tokens=output,
                blocks=list(blocks),
                kind="main" if i == 0 else None,
                after=[f"{agent}-r{i - 1}"] if i else [],
                pause_s=pause if i else 0.0,
                ends_branch=i == n - 1,
            )
        )
    return reqs


def small_trace(agents: int = 6, per_agent: int = 5, **kw: object) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for a in range(agents):
        out.extend(chain_agent(f"a{a}", per_agent, base=(a + 1) * 10_000, **kw))  # type: ignore[arg-type]
    return out


def strip_wall(report: dict) -> dict:
    """A report without its host measurements (wall clock, memory, date)."""
    from evolving_infra.sim.run import WALL_CLOCK_KEYS

    r = {k: v for k, v in report.items() if k not in WALL_CLOCK_KEYS}
    meta = dict(r.get("meta") or {})
    for k in ("date", "wall_s", "argv"):
        meta.pop(k, None)
    r["meta"] = meta
    return msgspec.json.decode(msgspec.json.encode(r))


@pytest.fixture
def trace():
    return small_trace
