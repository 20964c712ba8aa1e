"""Count messages with their chains (``BranchTable.take_count_lists(chains=True)`` with
``chain_depths``, the simulator's pass-through to the worker's host pool, issue 23 deliverable 3):
the same messages as without, each with ``[(path position, length), ...]`` covering its entries,
every chain consecutive blocks of one path at the positions given (a host store's counted blocks
at position None: the store's)."""

from __future__ import annotations

import random

import pytest

from services.kvdirectory.core import KvDirectory
from tests.unit.kvdirectory.helpers import BS, store


@pytest.mark.parametrize("held", [False, True], ids=["all", "held only"])
@pytest.mark.parametrize("seed", range(4))
def test_chains_name_each_entry_at_its_path_position(seed: int, held: bool) -> None:
    rng = random.Random(seed)
    kw = {"chained": True, "branch_ttl_s": 8.0, "held_counts_only": held}
    worlds = [KvDirectory(BS, **kw), KvDirectory(BS, **kw)]  # type: ignore[arg-type]
    worlds[0].branches.chain_depths = True
    nodes = ["p0", "p1", "p2"]
    for w in worlds:
        w.branches.max_updates_per_msg = 16  # drains cut into messages: chains cut with them
        for nm in nodes:
            w.node_id(nm)
    fresh = iter(range(1_000_000, 2_000_000))
    paths: dict[str, list[int]] = {}
    depth: dict[int, int] = {}  # chained ids: a block lies at one path position
    t = 0.0
    chained = plain = stores = 0
    for step in range(300):
        t += rng.random()
        op = rng.random()
        bid = f"b{rng.randrange(8)}"
        if op < 0.5:
            old = paths.get(bid) or paths.get(f"b{rng.randrange(8)}") or []
            keep = rng.randrange(len(old) + 1) if old and rng.random() < 0.3 else len(old)
            path = old[:keep] + [next(fresh) for _ in range(rng.randrange(1, 40))]
            depth.update((h, i) for i, h in enumerate(path))
            paths[bid] = path
            nm = rng.choice(nodes)
            for w in worlds:
                w.place(bid, nm, "prefill", path, t)
        elif op < 0.8 and paths:
            p = paths[rng.choice(sorted(paths))]
            nm = rng.choice(nodes)
            a = rng.randrange(len(p))
            b = rng.randrange(a + 1, len(p) + 1)
            for w in worlds:
                store(w, nm, p[:b], "host")  # whole chains from the root: a store below a parent the index lacks is not one
        elif op < 0.9:
            for w in worlds:
                w.branch_end(bid, t)
            paths.pop(bid, None)
        if rng.random() < 0.5:
            got = worlds[0].branches.take_count_lists(chains=True)
            want = worlds[1].branches.take_count_lists()
            assert [m[:4] for m in got] == want, f"step {step}: the messages differ"
            for _n, _seq, hashes, _counts, ch in got:
                if ch is None:
                    plain += 1
                    continue
                chained += 1
                assert sum(k for _, k in ch) == len(hashes)
                i = 0
                for d, k in ch:
                    if d is None:  # a store's counted blocks: a chain at the store's position
                        stores += 1
                        d = depth[hashes[i]]
                    assert [depth[h] for h in hashes[i : i + k]] == list(range(d, d + k)), f"step {step}"
                    i += k
            assert not any(worlds[0].branches.out_depth)  # nothing kept past the drain
    assert stores and chained > 5 and chained > plain  # the test's reach (merged drains too, since 3a84e59: _merged_chains)


def test_no_chains_without_chain_depths() -> None:
    d = KvDirectory(BS, chained=True)
    d.node_id("p0")
    d.place("b", "p0", "prefill", list(range(100, 110)), 1.0)
    assert d.branches.take_count_lists(chains=True) == [(0, 1, list(range(100, 110)), [1] * 10, None)]
    assert not d.branches.out_depth[0]
