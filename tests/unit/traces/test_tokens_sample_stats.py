"""prompt_token_ids, block-size conversion, sample_sessions cap semantics, h* prefix semantics."""

from __future__ import annotations

import numpy as np
import pytest

from evolving_infra.traces.io import Trace, validate_requests
from evolving_infra.traces.sample import sample_sessions
from evolving_infra.traces.schema import FORMAT, TraceHeader, TraceRequest
from evolving_infra.traces.stats import ideal_kv_hit_rate, trace_stats
from evolving_infra.traces.tokens import PRIVATE_ID_BASE, PrivateIds, prompt_token_ids, rechunk_blocks
from shared.hashing import block_hashes


def R(rid: str, agent: str = "a", branch: str = "a:main", n_in: int = 8, blocks=(1, 2), **kw) -> TraceRequest:
    return TraceRequest(id=rid, agent=agent, branch=branch, input_tokens=n_in, output_tokens=2, blocks=list(blocks), **kw)


def test_prompt_tokens_share_prefix_exactly_where_blocks_match() -> None:
    a = R("x", n_in=10, blocks=[5, 6])
    b = R("y", n_in=13, blocks=[5, 6, 9])
    c = R("z", n_in=9, blocks=[5, 7])
    ta, tb, tc = (prompt_token_ids(r, 4) for r in (a, b, c))
    assert ta.dtype == np.uint32 and len(ta) == 10 and len(tb) == 13
    assert (ta[:8] == tb[:8]).all() and not (ta[8:10] == tb[8:10]).all()  # tails are private
    assert (ta[:4] == tc[:4]).all() and not (ta[4:8] == tc[4:8]).all()
    ha, hc = block_hashes(ta, 4), block_hashes(tc, 4)
    assert ha[0] == hc[0] and ha[1] != hc[1]
    with pytest.raises(ValueError):
        prompt_token_ids(R("w", n_in=20, blocks=[1]), 4)


def test_rechunk_finer_and_coarser() -> None:
    # 512 -> 64: each coarse id becomes 8 fine ids; the tail's fine blocks from the tail id or private
    fine = rechunk_blocks([3, 4], 1100, 512, 64, tail_block=9)
    assert fine == [24 + k for k in range(8)] + [32 + k for k in range(8)] + [72]
    priv = PrivateIds()
    fine2 = rechunk_blocks([3, 4], 1100, 512, 64, private=priv)
    assert fine2[:16] == fine[:16] and fine2[16] >= PRIVATE_ID_BASE
    assert len(rechunk_blocks([3], 512 + 63, 512, 64)) == 8  # tail shorter than a fine block: nothing private needed
    with pytest.raises(ValueError):
        rechunk_blocks([3, 4], 1100, 512, 64)  # private ids needed but no allocator
    # 64 -> 512: last fine id of each group of 8
    ids = list(range(100, 117))
    assert rechunk_blocks(ids, 17 * 64 + 5, 64, 512) == [107, 115]
    with pytest.raises(ValueError):
        rechunk_blocks([1], 64, 64, 48)


def _capped_fixture() -> Trace:
    reqs = [
        R("m0", kind="main"),
        R("s0", branch="a:s1", kind="subagent", parent_branch="a:main", after=["m0"]),
        R("s1", branch="a:s1", after=["s0"]),
        R("s2", branch="a:s1", after=["s1"], ends_branch=True),  # beyond the cap of 2
        R("m1", after=["m0", "s2"]),  # join on a dropped request: dropped, and the rest of main
        R("m2", after=["m1"], ends_branch=True),
        R("t0", branch="a:s2", kind="subagent", parent_branch="a:main", after=["m0"], ends_branch=True),  # kept
        R("b0", agent="b", branch="b:main", kind="main"),
        R("b1", agent="b", branch="b:main", after=["b0"]),
        R("f0", agent="b", branch="b:f", kind="fork", parent_branch="b:main", after=["b1"], ends_branch=True),
        R("b2", agent="b", branch="b:main", after=["b1"]),
        R("f1", agent="b", branch="b:g", kind="fork", parent_branch="b:main", after=["b2"], ends_branch=True),  # after b2: dropped
        R("b3", agent="b", branch="b:main", after=["b2"], ends_branch=True),
    ]
    h = TraceHeader(format=FORMAT, block_size=4, meta={"x": 1})
    assert validate_requests(h, reqs) == []
    return Trace(h, reqs)


def test_sample_sessions_cap_semantics() -> None:
    t = _capped_fixture()
    out = sample_sessions(t, 10, seed=0, max_requests_per_branch=2)
    ids = [r.id for r in out.requests]
    assert ids == ["m0", "s0", "s1", "t0", "b0", "b1", "f0"]
    ends = {r.id for r in out.requests if r.ends_branch}
    assert ends == {"m0", "s1", "t0", "b1", "f0"}
    assert validate_requests(out.header, out.requests) == []
    info = out.header.meta["sample"]
    assert info["max_requests_per_branch"] == 2 and info["dropped_requests"] == 6 and info["dropped_branches"] == 1
    assert out.header.meta["x"] == 1 and "sample" not in t.header.meta  # input untouched


def test_sample_sessions_picks_agents_deterministically() -> None:
    reqs = [R(f"r{i}", agent=f"g{i}", branch=f"g{i}:main", kind="main", ends_branch=True) for i in range(20)]
    t = Trace(TraceHeader(format=FORMAT, block_size=4), reqs)
    a = sample_sessions(t, 5, seed=7)
    b = sample_sessions(t, 5, seed=7)
    assert [r.id for r in a.requests] == [r.id for r in b.requests]
    assert len(a.agents()) == 5 and a.agents() == sorted(a.agents(), key=lambda x: int(x[1:]))  # file order kept
    assert sample_sessions(t, 100, seed=1).requests == t.requests
    with pytest.raises(ValueError):
        sample_sessions(t, 0)


def test_ideal_hit_rate_counts_leading_blocks_only() -> None:
    reqs = [
        R("a", n_in=12, blocks=[1, 2, 3], kind="main"),
        R("b", n_in=14, blocks=[9, 2, 3], after=["a"]),  # 2, 3 seen but not leading: no hit
        R("c", n_in=18, blocks=[1, 2, 7, 3], after=["b"], ends_branch=True),  # hit 1, 2 only
    ]
    assert ideal_kv_hit_rate(reqs, 4) == pytest.approx(8 / 44)
    assert ideal_kv_hit_rate([], 4) is None
    s = trace_stats(Trace(TraceHeader(format=FORMAT, block_size=4), reqs))
    assert s["ideal_kv_hit_tokens"] == 8 and s["ideal_kv_hit_rate"] == pytest.approx(8 / 44)
    assert s["new_tokens"]["mean"] == pytest.approx((12 + 14 + 10) / 3)
    assert s["input_growth_tokens"]["mean"] == pytest.approx((2 + 4) / 2)
    assert s["requests"] == 3 and s["sessions"] == 1 and s["branches_by_kind"]["main"] == 1


def test_stats_structure_keys() -> None:
    t = _capped_fixture()
    s = trace_stats(t)
    for key in ("requests", "sessions", "subagent_branches", "compactions", "input_tokens_total", "output_tokens_total", "ideal_kv_hit_rate"):
        assert key in s
    assert s["subagent_branches"] == 2 and s["fork_branches"] == 2
    assert s["subagent_spawns"] == 1 and s["subagent_fanout"]["mean"] == 2.0  # both spawned after m0
    assert s["input_tokens_total"] == 8 * 13 and s["output_tokens_total"] == 2 * 13


def test_rechain_blocks_gives_an_id_one_prefix() -> None:
    from evolving_infra.traces.tokens import rechain_blocks

    reqs = [
        R("a1", blocks=[1, 2, 3], n_in=12),
        R("a2", blocks=[1, 2, 3, 4], n_in=16),
        R("b1", agent="b", branch="b:main", blocks=[7, 8, 3, 4], n_in=16),  # 3 after 8: another prefix
        R("b2", agent="b", branch="b:main", blocks=[7, 8, 3, 4, 5], n_in=20),
    ]
    out, remapped = rechain_blocks(reqs)
    assert out[0] is reqs[0] and out[1] is reqs[1]  # chained requests are left as they are
    assert remapped == 4  # 3 and 4 of b1 and of b2
    b1, b2 = out[2].blocks, out[3].blocks
    assert b1[:2] == [7, 8] and b1[2] > 8 and b1[3] > 8 and b1[2] != b1[3]
    assert b2[:4] == b1 and b2[4] == 5  # the same new prefix keeps its ids; 5 was never seen elsewhere
    again, n = rechain_blocks(out)
    assert n == 0 and all(x is y for x, y in zip(again, out))



def _rechain_reference(requests: list[TraceRequest]) -> tuple[list[list[int]], int]:
    """rechain_blocks' rule walked id by id over every request (no shared-prefix skipping)."""
    parent_of: dict[int, int] = {}
    alt: dict[tuple[int, int], int] = {}
    fresh = 1 + max((max(r.blocks) for r in requests if r.blocks), default=0)
    out: list[list[int]] = []
    remapped = 0
    for r in requests:
        prev, new = -1, []
        for b in r.blocks:
            p = parent_of.setdefault(b, prev)
            nb = b
            if p != prev:
                nb = alt.get((prev, b), -1)
                if nb < 0:
                    nb = alt[prev, b] = fresh
                    parent_of[nb] = prev
                    fresh += 1
                remapped += 1
            new.append(nb)
            prev = nb
        out.append(new)
    return out, remapped


def test_rechain_blocks_matches_the_id_by_id_walk_on_random_traces() -> None:
    """The shared-prefix skip (previous request of the branch / parent branch / agent) changes
    nothing: same ids, same remap count, unchanged requests returned as they are."""
    import random

    from evolving_infra.traces.tokens import rechain_blocks

    for seed in range(400):
        rng = random.Random(seed)
        ctx: dict[str, list[int]] = {}
        reqs = []
        for j in range(rng.randint(1, 30)):
            agent = f"a{rng.randrange(3)}"
            branch = f"{agent}:b{rng.randrange(3)}"
            base = ctx.get(branch, [])
            u = rng.random()
            if u < 0.5:
                blocks = base + [rng.randrange(30) for _ in range(rng.randint(0, 5))]  # extends the branch
            elif u < 0.75:
                blocks = base[: rng.randint(0, len(base))] + [rng.randrange(30) for _ in range(rng.randint(0, 5))]
            else:
                other = rng.choice(list(ctx.values())) if ctx else []
                blocks = other[: rng.randint(0, len(other))] + [rng.randrange(30) for _ in range(rng.randint(0, 3))]
            ctx[branch] = blocks
            parent = f"{agent}:b{rng.randrange(3)}" if rng.random() < 0.3 else None
            reqs.append(R(f"r{j}", agent=agent, branch=branch, n_in=len(blocks), blocks=blocks, parent_branch=parent))
        ids, remapped = _rechain_reference(reqs)
        out, n = rechain_blocks(reqs)
        assert n == remapped and [r.blocks for r in out] == ids, seed
        assert all((o is r) == (i == r.blocks) for o, r, i in zip(out, reqs, ids)), seed
