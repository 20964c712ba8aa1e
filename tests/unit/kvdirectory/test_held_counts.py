"""``held_counts_only`` (issue 23): a drain leaves out the changed counts of blocks the node holds
in neither tier, and the workers' host pools end exactly as when every changed count is sent.

A worker keeps a count only as the eviction group of its L2 pages, reads it only while the page
is in L2 and clears it when the page enters L2; the directory re-sends the count of every counted
block a host store brings. So when the directory has applied every store a node made before it
drains (the simulator's order), a count for a page the node does not hold is never read.
"""

from __future__ import annotations

import random
from itertools import chain

import pytest

from services.kvdirectory.core import KvDirectory
from services.worker.blocks import KvBlockManager
from shared.messages import BlockRemoved, BlockStored, KvEventBatch, KvSnapshot
from tests.unit.kvdirectory.helpers import BS, H, drained, store


def test_a_move_sends_the_held_prefix_and_the_store_re_sends_the_rest():
    d = KvDirectory(BS, held_counts_only=True)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:8], 1.0)
    assert drained(d) == []  # p0 holds none of it: no message at all
    assert d.count("p0", H[7]) == 1  # R itself counts every block
    store(d, "p0", H[:5], "host")
    assert drained(d) == [("p0", H[:5], [1] * 5)]  # the store's re-send
    d.branch_start("c", 0.0)
    d.place("c", "p0", "prefill", H[:12], 1.0)
    assert drained(d) == [("p0", H[:5], [2] * 5)]  # the held prefix of the slice only
    store(d, "p0", H[5:10], "gpu", parent=H[4])  # either tier is held
    d.branch_start("e", 0.0)
    d.place("e", "p0", "prefill", H[:12], 1.0)
    assert drained(d) == [("p0", H[:10], [3] * 8 + [2] * 2)]
    d.branch_end("e", 2.0)
    d.branch_end("c", 2.0)
    d.branch_end("b", 2.0)
    assert drained(d) == [("p0", H[:10], [0] * 10)]  # a drain merging changes is cut too
    d.branches.check()


@pytest.mark.parametrize("chained", [False, True], ids=["per-block", "chained"])
def test_a_cut_count_hands_over_the_outboxs_own_lists_cut_in_place(chained: bool):
    """A Count cut by the held cut (one change in the node's outbox) is sent as the outbox's own
    lists with their tails deleted, not as copies of their heads (every list in the outbox is made
    for its change alone): the drain of a move's path whose head the node holds copies nothing."""
    d = KvDirectory(BS, held_counts_only=True, chained=chained)
    n = d.node_id("p0")
    store(d, "p0", H[:5], "host")
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:12], 1.0)
    ((hashes, step, counts),) = d.branches.outbox[n]
    assert (hashes, step, counts) == (H[:12], 1, [1] * 12)
    ((node, _seq, h, c),) = d.branches.take_count_lists()
    assert (node, h, c) == (n, H[:5], [1] * 5)
    assert h is hashes and c is counts
    d.branches.check()


def test_a_release_on_a_node_that_evicted_the_path_sends_nothing():
    d = KvDirectory(BS, held_counts_only=True)
    store(d, "p0", H[:6], "host")
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:6], 1.0)
    assert drained(d) == [("p0", H[:6], [1] * 6)]
    seq = d._streams[d.node_id("p0")].next_seq  # noqa: SLF001 - the batch it awaits
    evicted = BlockRemoved(block_hashes=H[2:6][::-1], tier="host")
    d.apply_kv_batch(KvEventBatch(node="p0", seq=seq, ts=2.0, events=[evicted]), 2.0)
    d.branch_end("b", 3.0)
    assert drained(d) == [("p0", H[:2], [0, 0])]


@pytest.mark.parametrize("indexed", [True, False], ids=["gap indexed elsewhere", "gap not indexed"])
def test_a_held_block_below_a_gap_keeps_the_slice_whole(indexed: bool):
    """A node holding a block whose parent it lacks (an L2 that is not closed under parents, as
    a peer fetch stored below a page the node lost): the tail past its complete prefix is not
    left out, whether the gap is indexed (another node holds it: found by the walk of the index
    runs) or not (the blocks below it hang from a placeholder: found by the pass over the rest)."""
    d = KvDirectory(BS, held_counts_only=True)
    if indexed:
        store(d, "p2", H[:12], "host")
    store(d, "p0", H[:3], "host")
    store(d, "p0", H[6:9], "host", parent=H[5])
    assert (d.all_counters()["stored.without_parent"] > 0) != indexed
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:12], 1.0)
    assert drained(d) == [("p0", H[:12], [1] * 12)]
    d.branch_start("c", 0.0)
    d.place("c", "p1", "prefill", H[:12], 1.0)  # p1 holds none of it
    assert drained(d) == []


def test_a_tail_spanning_more_runs_than_the_walk_checks_is_sent(monkeypatch):
    from services.kvdirectory import branches

    d = KvDirectory(BS, held_counts_only=True)
    for i in range(0, 12, 2):  # p1 holds every other pair: runs of two blocks along H[:12]
        store(d, "p1", H[i : i + 1], "host", parent=H[i - 1] if i else None)
    monkeypatch.setattr(branches, "_CUT_RUNS", 3)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:12], 1.0)
    assert drained(d) == [("p0", H[:12], [1] * 12)]  # more than 3 runs to walk: not left out
    monkeypatch.setattr(branches, "_CUT_RUNS", 32)
    d.branch_start("c", 0.0)
    d.place("c", "p0", "prefill", H[:14], 1.0)
    assert drained(d) == []


def test_a_cap_refusal_turns_the_filter_off():
    d = KvDirectory(BS, held_counts_only=True, max_blocks=4)
    store(d, "p0", H[:6], "host")  # two blocks refused: p0 holds them, the index does not know
    assert d.all_counters()["cap.rejected_blocks"] == 2
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:8], 1.0)
    assert drained(d) == [("p0", H[:8], [1] * 8)]


def test_without_the_option_every_changed_count_is_sent():
    d = KvDirectory(BS)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H[:8], 1.0)
    assert drained(d) == [("p0", H[:8], [1] * 8)]


# --------------------------------------------------------------------------- #
# differential: workers fed with and without the option end the same
# --------------------------------------------------------------------------- #

NODES = ["n0", "n1", "n2"]


class _World:
    """A directory and one worker block manager per node; a node's KV events are applied to the
    directory after every engine call, then counts are drained (the simulator's order)."""

    def __init__(
        self, held: bool, cap: int, max_blocks: int = 16_000_000, chained: bool = False, direct: bool = False
    ) -> None:
        self.d = KvDirectory(
            BS, held_counts_only=held, max_updates_per_msg=cap, branch_ttl_s=300.0, max_blocks=max_blocks, chained=chained
        )
        for n in NODES:
            self.d.node_id(n)
        self.direct = direct
        self.split = False
        """Each KV event in a batch of its own: no write-through pair or triple applied as one."""
        """Events and counts as the simulator passes them (``apply_kv_events``, ``take_count_lists``:
        no batch, result or message objects) instead of ``apply_kv_batch`` / ``take_count_updates``."""
        self.kv = {n: KvBlockManager(12, 40, BS, "branch-count") for n in NODES}
        self.seq = dict.fromkeys(NODES, 0)
        self.entries = 0
        self.moved = 0
        self.host_evicted = 0
        """Host-tier blocks evicted, as ``apply_kv_events`` returned them (``direct``)."""

    def place(self, bid: str, n: str, phase: str, path: list[int], t: float) -> None:
        """``RoutePlaced``: through ``place_unread`` when ``direct`` (the simulator's call, no result built)."""
        if self.direct:
            assert self.d.place_unread(bid, n, phase, path, t) is None
        else:
            self.d.place(bid, n, phase, path, t)

    def flush(self, t: float) -> list[list[object]]:
        out = []
        for n in NODES:
            ev = self.kv[n].take_events()
            out.append(ev)
            if ev and self.split:
                for e in ev:
                    self.seq[n] += 1
                    self.d.apply_kv_batch(KvEventBatch(node=n, seq=self.seq[n], ts=t, events=[e]), t)
            elif ev:
                self.seq[n] += 1
                if self.direct:
                    c = self.d.counters
                    before = c.get("evictions.host.zero_count", 0), c.get("evictions.host.positive_count", 0)
                    got = self.d.apply_kv_events(self.d.node_id(n), self.seq[n], t, ev)
                    # its host evictions by count, what it added to the two counters (the simulator's per-phase split)
                    assert got == (c.get("evictions.host.zero_count", 0) - before[0], c.get("evictions.host.positive_count", 0) - before[1])
                    self.host_evicted += got[0] + got[1]
                else:
                    self.d.apply_kv_batch(KvEventBatch(node=n, seq=self.seq[n], ts=t, events=ev), t)
        self.drain()
        return out

    def clear(self, n: str) -> None:
        """Node n empties L1 and L2 (a relaunched engine, ``EngineScheduler.clear_caches``): a fresh
        block manager, whose first event is ``AllBlocksCleared``."""
        self.kv[n] = KvBlockManager(12, 40, BS, "branch-count")

    def resync(self, n: str, t: float, parents: bool) -> None:
        """The directory replaces its view of node n with the node's snapshot (``kv.resync``),
        consistent with the last batch it applied (pending events flushed first)."""
        self.flush(t)
        g, gp, h, hp = self.kv[n].snapshot_parents()
        if not parents:
            gp, hp = [], []
        snap = KvSnapshot(node=n, seq=self.seq[n], block_size=BS, gpu=g, host=h, gpu_parents=gp, host_parents=hp)
        assert self.d.apply_snapshot(snap, t).status == "resynced"
        self.drain()

    def drain(self) -> None:
        if self.direct:
            for n, _, hashes, counts in self.d.take_count_lists():
                self.entries += len(hashes)
                self.moved += self.kv[NODES[n]].update_counts(hashes, counts)
            return
        for u in self.d.take_count_updates():
            self.entries += len(u.hashes)
            self.moved += self.kv[u.node].update_counts(u.hashes, u.counts)

    def directory_state(self, batches: bool = True) -> tuple[object, ...]:
        """The directory's state as its callers and its next calls see it: counters, every indexed
        block's run, presence and completeness, copies, counts R, message numbers and (with
        ``batches``) each node's event stream (expected batch, resync flags, buffered batches,
        last stamp) and the batches applied."""
        d, ix = self.d, self.d.index
        streams = [(s.known, s.next_seq, s.awaiting, s.needs_snapshot, sorted(s.buffer), s.last_ts) for s in d._streams]  # noqa: SLF001
        counters = d.all_counters()
        if not batches:
            del counters["kv.batches_applied"]
            streams = []
        return (
            counters, ix.entries, ix.negcomp, {h: r.pc for h, r in ix.where.items()}, ix.copies,
            [dict(R) for R in d.branches.R], d.branches.out_seq, streams, [dict(w) for w in d.branches.watch],
        )

    def state(self, n: str, stamps: bool) -> tuple[object, ...]:
        """Node n's L2 eviction queue (pages in eviction order, their groups and, with ``stamps``,
        their access stamps), the counts of its L2 pages (> 0 or not) and its L1."""
        host = self.kv[n].host
        fresh = set(chain.from_iterable(host._fresh))  # noqa: SLF001 - pages whose count is owed a discard
        marks = (host._counted - fresh) & host._members()  # noqa: SLF001 - the counts of L2 pages
        return (
            [(b.hash, b.group, b.last_access if stamps else 0) for b in host.evictable.ordered()],
            sorted(marks),
            self.kv[n].gpu.snapshot(),
        )


def _compute(kv: KvBlockManager, path: list[int], upto: int) -> None:
    n_gpu, _ = kv.match(path, upto)
    if kv.admit(path, n_gpu, upto - n_gpu):
        kv.fill(path, n_gpu, upto)
        kv.release(path, upto, 0)


@pytest.mark.parametrize("gaps", [False, True], ids=["fetch below the local prefix", "fetch anywhere"])
@pytest.mark.parametrize("seed", range(8))
def test_workers_end_the_same_with_and_without_counts_of_blocks_not_held(seed: int, gaps: bool):
    """Random placements (extensions, rewrites, forks, moves), computes (L1 of 12 pages, L2 of
    40: evictions in both), peer fetches into L2 (some below a page the node lacks), branch
    ends, phase switches and expiry, on three nodes (with ``gaps``, a fetch may start below a page
    the node lacks, as after a broken hold: pages the index hangs from a placeholder, and L2s not
    closed under parents; without, it starts at the node's local prefix, as the scheduler's
    does, and the index's runs stay rooted): after every step each node's L2 eviction
    queue (pages, groups, stamps), the counts of its L2 pages and its L1 are the same whether
    the directory sends every changed count or only those of blocks the node holds, and so are
    the KV events the nodes emit. With messages of at most 5 entries a drain left shorter is cut
    into messages elsewhere: the eviction order is the same (the worker's moves do not depend on
    the cut, ``tests/unit/worker/test_count_message_cut.py``) but the stamps may be numbered
    otherwise (only their order is ever compared), so only the order is compared there."""
    _differential(seed, gaps)


@pytest.mark.parametrize("event", ["clear", "resync", "resync without parents", "cap"])
@pytest.mark.parametrize("seed", range(6))
def test_workers_end_the_same_after_clears_resyncs_and_a_capped_index(seed: int, event: str):
    """The differential run above with the events the cut must fall back on or see through: a
    node emptying its caches (``AllBlocksCleared``: the index forgets its blocks, R keeps its
    counts), a resync snapshot replacing the directory's view of a node (with or without the
    blocks' parents: a snapshot may bring blocks without them, so the walk's shortcut is off
    after it) and an index capped below the blocks stored (the cut is off after its first
    refusal). Pools, counts and KV events equal after every step, as there."""
    _differential(100 + seed, gaps=seed % 2 == 1, event=event)


@pytest.mark.parametrize("chain_min", [1, 8])
@pytest.mark.parametrize("event", ["", "clear", "resync without parents"])
@pytest.mark.parametrize("seed", range(2))
def test_chained_bisection_changes_nothing(seed: int, event: str, chain_min: int, monkeypatch):
    """``chained`` (issue 23: the simulator's paths and stores come from one chained id space):
    the presence hooks bisect a stored or evicted chain for its counted blocks instead of probing
    each. The differential run above, with and without it (both with ``held_counts_only``, as
    the simulator runs): the same count messages reach the workers (pools, counts and KV events
    equal after every step) and every directory counter, the eviction tallies by count
    included, is equal after every step; with ``chain_min`` 1 every chain is bisected, with 8
    (the default) short ones are probed block by block."""
    from services.kvdirectory import branches

    monkeypatch.setattr(branches, "_CHAIN_MIN", chain_min)
    _differential(200 + seed, gaps=seed % 2 == 1, event=event, chained=True)


@pytest.mark.parametrize("event", ["", "clear", "resync", "cap"])
@pytest.mark.parametrize("seed", range(2))
def test_the_simulators_direct_calls_change_nothing(seed: int, event: str):
    """``apply_kv_events``, ``take_count_lists`` and ``place_unread`` (issue 23: the simulator hands the
    directory a node's events and placements and the engines their counts without building batch,
    result or message objects): the differential run above, through them and through ``apply_kv_batch`` /
    ``take_count_updates`` / ``place`` (both worlds ``held_counts_only`` and ``chained``, as the simulator
    runs): the directory's whole state (counters, index, counts, message numbers, event
    streams) and the workers' pools and KV events are equal after every step, through clears,
    resync snapshots and a capped index."""
    _differential(300 + seed, gaps=seed % 2 == 1, event=event, direct=True)


@pytest.mark.parametrize("seed", range(4))
def test_write_through_pairs_and_triples_act_as_their_events_one_by_one(seed: int, monkeypatch):
    """A GPU store and its host write-through, with or without the host eviction that makes room
    for it between them (``KvDirectory._through_first``), applied as one: the differential run above
    with each engine's events in batches as they come and with every event in a batch of its own
    (nothing paired): the directory's state (counters but the batches applied, index, counts,
    message numbers, pending moves), the count messages and the workers are equal after every step,
    and the triples were met."""
    from services.kvdirectory.core import KvDirectory as Dir

    met = [0]
    first = Dir._through_first

    def spy(self, n, hashes, parent, evicted):
        ok = first(self, n, hashes, parent, evicted)
        met[0] += ok
        return ok

    monkeypatch.setattr(Dir, "_through_first", spy)
    _differential(400 + seed, gaps=seed % 2 == 1, split=True)
    assert met[0] > 0


@pytest.mark.parametrize("parent_on_gpu", [True, False], ids=["applied as one", "kept in order"])
def test_a_write_through_triple_ends_as_its_three_events(parent_on_gpu: bool):
    """A GPU store, a host eviction of the blocks above it (its parent among them) and the store's
    write-through. With the parent in the node's GPU the stores go as one, then the eviction; with
    the parent held in the host alone they do not (in order the eviction leaves the parent held
    nowhere before the write-through, which then finds it so: ``stored.without_parent``): one
    batch and three batches end the same either way, results included."""
    p = [7_100 + i for i in range(6)]
    worlds = [_World(True, 4096, chained=True), _World(True, 4096, chained=True)]
    before = [
        BlockStored(block_hashes=p[:3], parent_block_hash=None, tier=tier, block_size=BS)
        for tier in (("gpu", "host") if parent_on_gpu else ("host",))
    ]
    triple = [
        BlockStored(block_hashes=p[3:], parent_block_hash=p[2], tier="gpu", block_size=BS),
        BlockRemoved(block_hashes=p[:3][::-1], tier="host"),
        BlockStored(block_hashes=p[3:], parent_block_hash=p[2], tier="host", block_size=BS),
    ]
    results = []
    for w, one in zip(worlds, (True, False)):
        w.d.branch_start("b", 0.0)
        w.d.place("b", "n0", "prefill", p, 0.0)
        got = [0, 0]
        for batch in (before, triple):
            for part in [batch] if one else [[e] for e in batch]:
                w.seq["n0"] += 1
                r = w.d.apply_kv_batch(KvEventBatch(node="n0", seq=w.seq["n0"], ts=1.0, events=part), 1.0)
                if batch is triple:
                    got[0] += r.blocks_stored
                    got[1] += r.blocks_removed
            w.drain()
        results.append(got)
    assert worlds[0].directory_state(batches=False) == worlds[1].directory_state(batches=False)
    assert results[0] == results[1] == [6, 3]
    c = worlds[0].d.all_counters()
    assert c["stored.without_parent"] == (0 if parent_on_gpu else 1)  # (in order: the write-through finds it held nowhere)
    assert worlds[0].d.index.entries[p[0]] == p[0]  # still indexed: in the GPU, or held nowhere with the chain below


def _triple_worlds(held: list[int], chain: list[int], evicted: list[int]) -> list[_World]:
    """Node n0 holds ``held`` in its host and the block 5 in its GPU, then stores ``chain`` below 5
    in its GPU, evicts ``evicted`` from its host and writes ``chain`` through: as one batch (the
    triple) in the first world, as three in the second."""
    worlds = [_World(True, 4096, chained=True), _World(True, 4096, chained=True)]
    for w, one in zip(worlds, (True, False)):
        w.seq["n0"] = 2
        w.d.apply_kv_batch(KvEventBatch(node="n0", seq=1, ts=1.0, events=[
            BlockStored(block_hashes=held, parent_block_hash=None, tier="host", block_size=BS)]), 1.0)
        w.d.apply_kv_batch(KvEventBatch(node="n0", seq=2, ts=1.0, events=[
            BlockStored(block_hashes=[5], parent_block_hash=None, tier="gpu", block_size=BS)]), 1.0)
        triple = [
            BlockStored(block_hashes=chain, parent_block_hash=5, tier="gpu", block_size=BS),
            BlockRemoved(block_hashes=evicted, tier="host"),
            BlockStored(block_hashes=list(chain), parent_block_hash=5, tier="host", block_size=BS),
        ]
        for part in [triple] if one else [[e] for e in triple]:
            w.seq["n0"] += 1
            w.d.apply_kv_batch(KvEventBatch(node="n0", seq=w.seq["n0"], ts=1.0, events=part), 1.0)
    return worlds


def test_a_write_through_triple_leaves_the_index_the_size_of_its_three_events():
    """The triple as one leaves the index's ``where`` table the size its three events leave it
    (``size_bytes``, reported by the simulator as ``kv_directory_size``): the table grows when an
    insertion finds no free slot, to a size set by the blocks then live, so the chain must be
    inserted before the eviction's blocks leave, as in order (with the eviction applied first,
    8 host blocks of 8 evicted and a chain of 2: 872 bytes against 1,152 in order)."""
    sizes = 0
    for n_held in range(2, 40):
        held = list(range(1_000, 1_000 + n_held))
        for n_evicted in (1, 8):
            for k in (1, 2, 3):
                if n_evicted > n_held:
                    continue
                chain = list(range(9_000, 9_000 + k))
                a, b = _triple_worlds(held, chain, held[-n_evicted:][::-1])
                assert a.directory_state(batches=False) == b.directory_state(batches=False), (n_held, n_evicted, k)
                assert a.d.index.size_bytes() == b.d.index.size_bytes(), (n_held, n_evicted, k)
                sizes += 1
    assert sizes > 150


def test_a_write_through_triple_whose_eviction_lists_the_chain_is_kept_in_order():
    """An eviction that lists blocks of the chain being stored (in order the host does not hold
    them yet: unknown there, skipped) is applied in order, not after the write-through (which
    would remove them): one batch and three end the same."""
    held = [1_000, 1_001, 1_002]
    chain = [9_000, 9_001]
    a, b = _triple_worlds(held, chain, [9_001, 1_002])
    assert a.directory_state(batches=False) == b.directory_state(batches=False)
    assert a.d.index.size_bytes() == b.d.index.size_bytes()
    c = a.d.all_counters()
    assert c["removed.unknown_blocks"] == 1 and a.d.index.holds(a.d.node_id("n0"), 9_001)


def test_apply_kv_events_off_sequence_is_apply_kv_batch():
    """A batch that is not the next of its node's stream (its first, a gap, a late one, a restart)
    goes through ``apply_kv_batch``: buffered, stale or resynced exactly as there."""
    worlds = [_World(True, 4096, chained=True), _World(True, 4096, chained=True, direct=True)]
    p = [7_000 + i for i in range(6)]
    batches = [  # (seq, ts, events) of node n0, in arrival order
        (1, 1.0, [BlockStored(block_hashes=p[:2], parent_block_hash=None, tier="host", block_size=BS)]),
        (3, 3.0, [BlockStored(block_hashes=p[4:], parent_block_hash=p[3], tier="host", block_size=BS)]),  # a gap
        (2, 2.0, [BlockStored(block_hashes=p[2:4], parent_block_hash=p[1], tier="host", block_size=BS)]),  # fills it
        (2, 2.0, [BlockRemoved(block_hashes=p[:1], tier="host")]),  # stale
        (4, 4.0, [BlockRemoved(block_hashes=p[5:], tier="host")]),
        (1, 5.0, [BlockStored(block_hashes=p[:1], parent_block_hash=None, tier="gpu", block_size=BS)]),  # a restart
        (2, 6.0, [BlockStored(block_hashes=p[1:2], parent_block_hash=p[0], tier="gpu", block_size=BS)]),
    ]
    for seq, ts, events in batches:
        for w in worlds:
            if w.direct:
                c = w.d.counters
                before = c.get("evictions.host.zero_count", 0), c.get("evictions.host.positive_count", 0)
                got = w.d.apply_kv_events(w.d.node_id("n0"), seq, ts, events)
                assert got == (c.get("evictions.host.zero_count", 0) - before[0], c.get("evictions.host.positive_count", 0) - before[1])
                w.host_evicted += got[0] + got[1]
            else:
                w.d.apply_kv_batch(KvEventBatch(node="n0", seq=seq, ts=ts, events=events), ts)
        assert worlds[0].directory_state() == worlds[1].directory_state(), f"after batch {seq} at {ts}"
    c = worlds[1].d.all_counters()
    assert worlds[1].host_evicted == 1  # batch 4's, applied in sequence (the stale one is not applied)
    assert c["kv.gaps"] == 1 and c["kv.batches_stale"] == 1 and c["kv.seq_restarts"] == 1
    assert c["kv.recovered_without_resync"] == 1 and worlds[1].d.awaiting_resync("n0")


def _differential(
    seed: int, gaps: bool, event: str = "", chained: bool = False, direct: bool = False, split: bool = False
) -> None:
    rng = random.Random(seed)
    cap = rng.choice([5, 4096])
    max_blocks = 60 if event == "cap" else 16_000_000
    if direct:  # the simulator's calls vs the general ones
        full, held = _World(True, cap, max_blocks, chained=True), _World(True, cap, max_blocks, chained=True, direct=True)
    elif split:  # every event in a batch of its own vs the engines' batches
        full, held = _World(True, cap, max_blocks, chained=True), _World(True, cap, max_blocks, chained=True)
        full.split = True
    elif chained:  # the same drains, with the hooks probing every block vs bisecting chains
        full, held = _World(True, cap, max_blocks), _World(True, cap, max_blocks, chained=True)
    else:
        full, held = _World(False, cap, max_blocks), _World(True, cap, max_blocks)
    worlds = (full, held)
    paths: dict[str, list[int]] = {}
    nxt = [1000 * (seed + 1)]

    def fresh(k: int, after: list[int]) -> list[int]:
        out = list(after)
        for _ in range(k):
            nxt[0] += 1
            out.append(nxt[0])
        return out

    for step in range(400):
        t = float(step)
        op = rng.random()
        if op < 0.08 or not paths:
            bid = f"b{step}"
            par = rng.choice(sorted(paths)) if paths and rng.random() < 0.5 else None
            for w in worlds:
                w.d.branch_start(bid, t, kind="fork" if par else "main", parent=par)
            paths[bid] = list(paths[par]) if par else []
        elif op < 0.45:
            bid = rng.choice(sorted(paths))
            old = paths[bid]
            how = rng.choice(["extend", "extend", "compact", "same"])
            if how == "extend" or not old:
                new = fresh(rng.randint(1, 8), old)[:24]
            elif how == "compact":
                new = fresh(rng.randint(1, 4), old[: rng.randint(0, len(old) - 1)])
            else:
                new = old
            paths[bid] = new
            n = rng.choice(NODES)
            phase = rng.choice(["prefill", "decode", "both"])
            for w in worlds:
                w.place(bid, n, phase, new, t)
                w.drain()
        elif op < 0.75:
            n = rng.choice(NODES)
            p = paths[rng.choice(sorted(paths))]
            if p:
                upto = rng.randint(1, min(len(p), 11))
                for w in worlds:
                    _compute(w.kv[n], p, upto)
        elif op < 0.85:
            n = rng.choice(NODES)
            p = paths[rng.choice(sorted(paths))]
            if p:
                lo = rng.randint(0, len(p) - 1) if gaps else sum(full.kv[n].match(p, len(p)))
                hi = rng.randint(lo + 1, len(p)) if lo < len(p) else lo
                for w in worlds:
                    w.kv[n].store_fetched(p, lo, hi)
        elif op < 0.92:
            bid = rng.choice(sorted(paths))
            del paths[bid]
            for w in worlds:
                w.d.branch_end(bid, t)
                w.drain()
        elif op < 0.97:
            n = rng.choice(NODES)
            new_phase = rng.choice(["prefill", "decode"])
            for w in worlds:
                w.d.node_phase_changed(n, w.d.node_phase(n), new_phase, t)
                w.drain()
        elif op < 0.985 and event and event != "cap":
            n = rng.choice(NODES)
            for w in worlds:
                if event == "clear":
                    w.clear(n)
                else:
                    w.resync(n, t, parents=event == "resync")
        else:
            later = t + rng.choice([0.0, 400.0])
            for w in worlds:
                gone = w.d.expire(later)
                w.drain()
            for bid in gone:
                paths.pop(bid, None)
        assert full.flush(t) == held.flush(t), f"step {step}: the nodes' KV events differ"
        if direct or split:
            assert full.directory_state(not split) == held.directory_state(not split), f"step {step}: the directories differ"
        if chained:
            assert full.d.all_counters() == held.d.all_counters(), f"step {step}: counters differ"
        for n in NODES:  # (cut elsewhere, a drain gives the same order, not the same stamps)
            assert full.state(n, cap > 100) == held.state(n, cap > 100), f"step {step}: node {n}'s pools differ"
    assert full.moved == held.moved and full.moved > 0
    if direct or split:
        assert held.entries == full.entries
        if direct:
            assert held.host_evicted == sum(v for k, v in held.d.all_counters().items() if k.startswith("evictions.host."))
    elif chained:
        assert held.entries == full.entries
        c = held.d.all_counters()
        assert c["evictions.gpu.positive_count"] > 0 and c["evictions.gpu.zero_count"] > 0
    elif event == "cap":
        assert held.d.all_counters()["cap.rejected_blocks"] > 0
    else:
        assert held.entries < full.entries  # some entries were left out
    if event == "clear":
        assert held.d.all_counters()["kv.clears"] > len(NODES)  # more than each fresh manager's first
    if not gaps and not event.startswith("resync") and event != "cap":  # (a refused parent leaves its children unrooted)
        assert held.d.all_counters()["stored.without_parent"] == 0  # the walk's shortcut was taken
    for w in worlds:
        w.d.branches.check()
        for kv in w.kv.values():
            kv.check([])
