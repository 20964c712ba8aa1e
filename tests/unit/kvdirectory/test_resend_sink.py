"""A host store's re-sent counts handed to ``BranchTable.resend_sink`` at once (the simulator's
``ClusterSim._resend_counts``, issue 23) instead of queued for the next drain: the message is the
one the drain would have made of the change alone, a node with an earlier change waiting still
gets it queued (its messages keep their order), and a worker that applies every message it gets
in order ends with the same counts as one fed by the plain drains."""

from __future__ import annotations

import random

import pytest

from services.kvdirectory.core import KvDirectory
from shared.messages import BlockRemoved
from tests.unit.kvdirectory.helpers import BS, store


def _world(sink: list[tuple[int, list[int], list[int], object]] | None, held: bool = True, chain: bool = False) -> KvDirectory:
    """Three nodes; ``sink``: the re-sends handed over (``resend_sink``), and with ``chain`` those at
    the store's position through ``resend_chain_sink`` (as the simulator), their counts read then
    (``chain_counts``) and recorded as ``resend_sink`` would have got them."""
    d = KvDirectory(BS, chained=True, held_counts_only=held)
    d.branches.chain_depths = True
    for nm in ("p0", "p1", "p2"):
        d.node_id(nm)
    if sink is not None:
        d.branches.resend_sink = lambda n, h, c, ch: sink.append((n, h, c, ch))
        if chain:
            d.branches.resend_chain_sink = lambda n, h: sink.append((n, h, d.branches.chain_counts(n, h), [(None, len(h))]))
    return d


@pytest.mark.parametrize("chain", [False, True], ids=["counts", "counts unbuilt"])
def test_a_re_send_goes_to_the_sink_as_the_drain_would_send_it(chain: bool) -> None:
    got: list[tuple[int, list[int], list[int], object]] = []
    a, b = _world(got, chain=chain), _world(None)
    if chain:  # a re-send of a whole chain goes to resend_chain_sink, its counts not built
        a.branches.resend_sink = lambda *x: pytest.fail(f"built and sent to resend_sink: {x}")
    path = list(range(100, 120))
    for w in (a, b):
        w.place("x", "p0", "prefill", path, 1.0)
        w.place("y", "p0", "prefill", path[:12], 1.0)
    assert a.branches.take_count_lists(chains=True) == b.branches.take_count_lists(chains=True) == []  # p0 holds none
    for w in (a, b):
        store(w, "p0", path, "host")
    want = b.branches.take_count_lists(chains=True)
    assert want == [(0, 1, path, [2] * 12 + [1] * 8, [(None, 20)])]
    assert got == [(0, path, [2] * 12 + [1] * 8, [(None, 20)])]  # at the store, not at a drain
    assert a.branches.take_count_lists(chains=True) == []
    assert a.branches.out_seq == b.branches.out_seq == [1, 0, 0]  # numbered as a message taken
    assert not a.branches.out_depth[0] and not a.branches.out_len[0]

    # an earlier change of the node waits: the re-send queues behind it, one drain as before
    got.clear()
    more = list(range(200, 210))
    for w in (a, b):
        w.place("z", "p1", "prefill", more, 2.0)
        store(w, "p1", more[:4], "gpu")  # p1 holds a head: the count is sent, and waits
        store(w, "p1", more, "host")
    assert got == []
    assert a.branches.take_count_lists(chains=True) == b.branches.take_count_lists(chains=True)


def test_no_sink_no_change() -> None:
    d = _world(None)
    d.place("x", "p0", "prefill", [1, 2, 3], 1.0)
    assert d.branches.take_count_lists(chains=True) == []  # p0 holds none of it
    store(d, "p0", [1, 2, 3], "host")
    assert d.branches.resend_sink is None
    assert d.branches.take_count_lists(chains=True) == [(0, 1, [1, 2, 3], [1, 1, 1], [(None, 3)])]


@pytest.mark.parametrize("chain", [False, True], ids=["counts", "counts unbuilt"])
@pytest.mark.parametrize("held", [False, True], ids=["all", "held only"])
@pytest.mark.parametrize("seed", range(4))
def test_a_worker_ends_with_the_same_counts(seed: int, held: bool, chain: bool) -> None:
    """Random placements, host and GPU stores, evictions and ends on three nodes, drained at random:
    per node, the counts a worker keeps (each message applied in order, a block's last count kept)
    are those of the plain drains at every drain."""
    rng = random.Random(seed)
    sunk: list[tuple[int, list[int], list[int], object]] = []
    a, b = _world(sunk, held, chain), _world(None, held)
    views: list[list[dict[int, int]]] = [[{} for _ in range(3)] for _ in range(2)]
    fresh = iter(range(1_000_000, 2_000_000))
    paths: dict[str, list[int]] = {}
    placed: dict[str, str] = {}
    nodes = ["p0", "p1", "p2"]
    t = 0.0
    direct = 0

    def drain(step: int) -> None:
        for v, w in zip(views, (a, b)):
            for n, _seq, h, c, _ch in w.branches.take_count_lists(chains=True):
                v[n].update(zip(h, c))
        assert views[0] == views[1], f"step {step}"

    for step in range(400):
        t += rng.random()
        op = rng.random()
        bid = f"b{rng.randrange(8)}"
        if op < 0.35:
            old = paths.get(bid) or paths.get(f"b{rng.randrange(8)}") or []
            keep = rng.randrange(len(old) + 1) if old and rng.random() < 0.3 else len(old)
            path = old[:keep] + [next(fresh) for _ in range(rng.randrange(1, 30))]
            paths[bid] = path
            nm = placed[bid] = rng.choice(nodes)
            for w in (a, b):
                w.place(bid, nm, "prefill", path, t)
            if rng.random() < 0.7:  # its prefill computes it there (the simulator's usual turn)
                if rng.random() < 0.5:
                    drain(step)
                for w in (a, b):
                    store(w, nm, path, "host")
        elif op < 0.7 and paths:
            sb = rng.choice(sorted(paths))
            p = paths[sb]
            nm = placed[sb] if rng.random() < 0.7 else rng.choice(nodes)  # mostly where it counts
            k = rng.randrange(1, len(p) + 1)
            tier = "host" if rng.random() < 0.7 else "gpu"
            if rng.random() < 0.5:
                drain(step)  # nothing waits: a host store's re-send goes to the sink
            for w in (a, b):
                store(w, nm, p[:k], tier)
        elif op < 0.92 and paths:
            p = paths[rng.choice(sorted(paths))]
            nm = rng.choice(nodes)
            k = rng.randrange(len(p))
            gone = BlockRemoved(block_hashes=p[k:], tier=rng.choice(["host", "gpu"]))
            for w in (a, b):
                n = w.node_id(nm)
                w.apply_kv_events(n, w._streams[n].next_seq, t, [gone])  # noqa: SLF001  # the batch it awaits
        elif op < 0.97:
            for w in (a, b):
                w.branch_end(bid, t)
            paths.pop(bid, None)
        direct += len(sunk)
        for n, h, c, _ch in sunk:
            views[0][n].update(zip(h, c))
        sunk.clear()
        if rng.random() < 0.5:
            drain(step)
    assert direct > 5  # the test's reach
