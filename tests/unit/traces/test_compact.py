"""traces.compact: a trace held as stubs + prefix differences gives back exactly the same requests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from evolving_infra.traces.compact import KEYFRAME_DEPTH, compact_requests, read_trace_compact
from evolving_infra.traces.io import TraceError, read_trace, write_trace
from evolving_infra.traces.schema import FORMAT, TraceHeader, TraceRequest
from evolving_infra.traces.tokens import rechain_blocks

BS = 4
HEADER = TraceHeader(format=FORMAT, block_size=BS)


def _random_requests(seed: int) -> list[TraceRequest]:
    """Agents, branches, forks and rewritten contexts (ids drawn from a small range, so often
    not chained), branches that end; ``input_tokens`` consistent with the blocks."""
    rng = random.Random(seed)
    ctx: dict[str, list[int]] = {}
    reqs = []
    for j in range(rng.randint(1, 60)):
        agent = f"a{rng.randrange(3)}"
        branch = f"{agent}:b{rng.randrange(4)}"
        base = ctx.get(branch, [])
        u = rng.random()
        if u < 0.6:
            blocks = base + [rng.randrange(40) for _ in range(rng.randint(0, 5))]
        elif u < 0.8:
            blocks = base[: rng.randint(0, len(base))] + [rng.randrange(40) for _ in range(rng.randint(0, 5))]
        else:
            other = rng.choice(list(ctx.values())) if ctx else []
            blocks = other[: rng.randint(0, len(other))] + [rng.randrange(40) for _ in range(rng.randint(0, 3))]
        ctx[branch] = blocks
        parent = f"{agent}:b{rng.randrange(4)}" if rng.random() < 0.3 else None
        reqs.append(TraceRequest(id=f"r{j}", agent=agent, branch=branch, input_tokens=len(blocks) * BS + rng.randrange(1, BS),
                                 output_tokens=1, blocks=blocks, parent_branch=parent, ends_branch=rng.random() < 0.2))
    return reqs


def test_random_traces_round_trip_in_any_order() -> None:
    for seed in range(300):
        reqs = _random_requests(seed)
        ct = compact_requests(HEADER, reqs)
        assert all(s.blocks == [] for s in ct.requests) and [s.id for s in ct.requests] == [r.id for r in reqs]
        assert ct.requests_with_blocks() == reqs, seed
        rng = random.Random(seed)
        for r in rng.sample(reqs, len(reqs)) * 2:  # any order, repeated: cached or rebuilt, the same ids
            assert ct.blocks_of(r) == r.blocks, seed
        assert ct.store.stored_ids <= sum(len(r.blocks) for r in reqs)


def test_chained_check_and_rechain_match_rechain_blocks() -> None:
    unchained = 0
    for seed in range(300):
        reqs = _random_requests(seed)
        out, remapped = rechain_blocks(reqs)
        ct = compact_requests(HEADER, reqs)
        assert ct.store.chained() == (remapped == 0), seed
        ct2, n = ct.rechained()
        assert n == remapped and ct2.requests_with_blocks() == out, seed
        assert (ct2 is ct) == (remapped == 0)
        unchained += remapped > 0
    assert 0 < unchained < 300  # both cases exercised


def test_block_size_conversion_matches_the_list_path() -> None:
    from evolving_infra.sim.run import convert_block_size

    for seed in range(60):
        reqs = _random_requests(seed)
        ct = compact_requests(HEADER, reqs)
        for to in (2, 8, BS):
            want = convert_block_size(reqs, BS, to)
            got = convert_block_size(ct, BS, to)
            assert got.header.block_size == to
            assert got.requests_with_blocks() == want, (seed, to)


def test_long_branch_stores_only_new_ids_with_bounded_rebuilds() -> None:
    n = 5 * KEYFRAME_DEPTH
    reqs = [TraceRequest(id=f"r{i}", agent="a", branch="a:main", input_tokens=(10 + 3 * i) * BS, output_tokens=1,
                         blocks=list(range(10 + 3 * i)), ends_branch=i == n - 1) for i in range(n)]
    ct = compact_requests(HEADER, reqs)
    total = sum(len(r.blocks) for r in reqs)
    assert ct.store.stored_ids < total // 20  # new ids plus a full copy every KEYFRAME_DEPTH requests
    assert [ct.blocks_of(r) for r in reversed(reqs)] == [r.blocks for r in reversed(reqs)]  # no cached reference


def _write_lines(path: Path, lines: list[object]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_read_trace_compact_equals_read_trace(tmp_path: Path) -> None:
    from tests.unit.sim.conftest import small_trace

    reqs = small_trace(5, 7)
    reqs[3] = msgspec.structs.replace(reqs[3], pause_s=2.5)
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, TraceHeader(format=FORMAT, block_size=BS, source="test", meta={"x": 1}), reqs)
    full = read_trace(path)
    ct = read_trace_compact(path)
    assert ct.header == full.header
    assert ct.requests_with_blocks() == full.requests
    assert [msgspec.structs.replace(r, blocks=[]) for r in full.requests] == ct.requests


def test_bad_lines_are_reported_as_read_trace_does(tmp_path: Path) -> None:
    def req(rid: str, **kw: object) -> dict:
        return {"id": rid, "agent": "a", "branch": "a:main", "input_tokens": 9, "output_tokens": 3, "blocks": [1, 2], **kw}

    path = _write_lines(tmp_path / "bad.jsonl", [
        {"format": FORMAT, "block_size": 4},
        req("r0", kind="main"),
        '{"id": "broken", "agent": ',
        req("r1", after=["r0"], blocks=[1]),
        req("r2", after=["ghost"], ends_branch=True),
    ])
    with pytest.raises(TraceError) as want:
        read_trace(path)
    with pytest.raises(TraceError) as got:
        read_trace_compact(path)
    assert got.value.problems == want.value.problems
    assert [p.line for p in got.value.problems] == [3, 4, 5]
    assert str(got.value) == str(want.value)
