"""``BranchRunHostPool.update_stored_counts`` (the simulator's entry for the directory's re-send of
a host store's counted blocks, ``ClusterSim._resend_counts``, issue 23) is
``update_counts(hashes, counts, [(None, len(hashes))])``: the same moves, eviction order, counts
and invariants under random traffic, with its short way (a run the pool stored, all in L1) taken."""

from __future__ import annotations

import random

import pytest

from services.worker.blocks import BranchRunHostPool, KvBlockManager
from shared.messages import BlockStored
from tests.unit.worker.test_count_chains import _message
from tests.unit.worker.test_count_message_cut import _forest, order


def _stores(kv: KvBlockManager) -> list[list[int]]:
    """The host stores among the manager's pending events (taken)."""
    return [e.block_hashes for e in kv.take_events() if type(e) is BlockStored and e.tier == "host"]


@pytest.mark.parametrize("seed", range(40))
def test_re_sent_counts_as_update_counts_with_the_store_chain(seed: int) -> None:
    rng = random.Random(seed)
    paths, script = _forest(rng)
    kvs = [KvBlockManager(20, 60, 4, "branch-count"), KvBlockManager(20, 60, 4, "branch-count")]
    for kv in kvs:
        assert type(kv.host) is BranchRunHostPool
        kv.update_counts([99_999], [1], [(0, 1)])  # counts in L1's runs from here on (a chained message first)
        kv.take_events()
    live: list[list[int]] = []
    short = resent = 0
    for step in range(120):
        x = rng.random()
        if x < 0.45:
            p = rng.choice(script)
            path = p[: rng.randint(1, len(p))]
            done = set()
            for kv in kvs:
                g, _ = kv.match(path, len(path))
                ok = kv.admit(path, g, len(path) - g)
                if ok:
                    kv.fill(path, g, len(path))
                done.add(ok)
            assert len(done) == 1
            if not done.pop():
                continue
            live.append(path)
            stores = [_stores(kv) for kv in kvs]
            assert stores[0] == stores[1]
            for run in stores[0]:  # the directory re-sends each store's counted head, counts never growing
                head = run[: rng.randint(1, len(run))] if rng.random() < 0.3 else run
                if len(run) > 1 and rng.random() < 0.2:  # not a store's start: the pool has no position, the long way
                    head = run[1:]
                top = rng.randint(1, 3)
                counts = sorted((rng.randint(1, top) for _ in head), reverse=True)
                pool = kvs[0].host
                calls: list[int] = []
                full = pool.update_counts
                pool.update_counts = lambda *a, _f=full: calls.append(1) or _f(*a)  # type: ignore[method-assign]
                got = [pool.update_stored_counts(head, counts), kvs[1].update_counts(head, counts, [(None, len(head))])]
                del pool.update_counts
                assert got[0] == got[1], f"seed {seed} step {step}"
                resent += 1
                short += not calls  # the short way: no update_counts
        elif x < 0.7 and live:
            path = live.pop(rng.randrange(len(live)))
            for kv in kvs:
                kv.release(path, len(path), 0)
                kv.take_events()
        else:
            h, c, ch = _message(rng, paths + [p[: rng.randint(1, len(p))] for p in live])
            if not h:
                continue
            assert kvs[0].update_counts(h, c, ch) == kvs[1].update_counts(h, c, ch)
        assert order(kvs[0]) == order(kvs[1]), f"seed {seed} step {step}"
        assert kvs[0].host.counted == kvs[1].host.counted, f"seed {seed} step {step}"
        assert [r.counted for r in kvs[0].gpu.ends.values()] == [r.counted for r in kvs[1].gpu.ends.values()]
        for kv in kvs:
            kv.check([(p, len(p), 0) for p in live])
    assert resent > 3 and short > 0, f"seed {seed}: {resent} re-sends, {short} the short way"


def test_re_sent_chunk_counts_set_the_run_interval_without_a_walk() -> None:
    """The usual re-send (a prefill chunk's pages, written through at path position > 0, appended to
    the L1 run of the request's prefix) sets that run's counted interval in
    ``update_stored_counts`` itself: no ``_chain_l1`` walk, no ``update_counts``; the same intervals
    as ``update_counts`` with the store's chain on a twin pool."""
    path = list(range(1, 13))
    kvs = [KvBlockManager(20, 60, 4, "branch-count"), KvBlockManager(20, 60, 4, "branch-count")]
    for kv in kvs:
        kv.update_counts([99_999], [1], [(0, 1)])  # counts in L1's runs from here on
        assert kv.admit(path, 0, len(path))
        kv.fill(path, 0, 4)  # first chunk: the run's head
        kv.fill(path, 4, 8)  # second chunk: the same run, extended
        kv.take_events()
    pool = kvs[0].host
    assert type(pool) is BranchRunHostPool
    walks: list[int] = []
    chain_l1 = pool._chain_l1
    pool._chain_l1 = lambda *a: walks.append(1) or chain_l1(*a)  # type: ignore[method-assign]
    full = pool.update_counts
    pool.update_counts = lambda *a: walks.append(2) or full(*a)  # type: ignore[method-assign]
    for head in (path[4:8], path[4:8], path[4:6]):  # the whole chunk (twice: already counted), then a head of it
        counts = [2] * len(head)
        assert pool.update_stored_counts(head, counts) == kvs[1].update_counts(head, counts, [(None, len(head))]) == 0
        assert [r.counted for r in kvs[0].gpu.ends.values()] == [r.counted for r in kvs[1].gpu.ends.values()]
    assert walks == [1], "the whole chunk's re-sends walked (a head that ends no run walks: _chain_l1)"
    (run,) = kvs[0].gpu.ends.values()
    assert run.counted == ((4, 8),)
