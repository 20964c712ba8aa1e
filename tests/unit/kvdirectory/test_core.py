"""KvDirectory core: explicit scenarios, no bus, explicit ``now``."""

from __future__ import annotations

import pytest

from services.kvdirectory.core import KvDirectory
from services.kvdirectory.lookup import fetch_plan, fetch_plan_for_reply
from services.kvdirectory.reuse import attribute_lost_reuse, lost_reuse_shares
from shared.messages import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, KvSnapshot

BS = 16
P = list(range(1, 11))  # one chained path of 10 blocks: parent of P[i] is P[i-1]


class Feed:
    """Per-node sequence numbers for building batches."""

    def __init__(self, d: KvDirectory) -> None:
        self.d = d
        self.seq: dict[str, int] = {}

    def batch(self, node: str, *events, ts: float = 1.0) -> KvEventBatch:
        self.seq[node] = self.seq.get(node, 0) + 1
        return KvEventBatch(node=node, seq=self.seq[node], ts=ts, events=list(events))

    def send(self, node: str, *events, ts: float = 1.0):
        return self.d.apply_kv_batch(self.batch(node, *events, ts=ts), ts)


def st(hashes, tier="gpu", parent=None, size=BS):
    if parent is None and hashes and hashes[0] != P[0] and hashes[0] in P:
        parent = P[P.index(hashes[0]) - 1]
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, tier=tier, block_size=size)


def counts(d: KvDirectory, node: str, blocks) -> list[int]:
    return [d.count(node, b) for b in blocks]


@pytest.fixture
def d() -> KvDirectory:
    return KvDirectory(BS, branch_ttl_s=100.0)


# --------------------------------------------------------------------------- #
# Alg. E.1 / E.2
# --------------------------------------------------------------------------- #


def test_new_branch_counts_its_path_and_extension_keeps_version(d):
    d.branch_start("b", 0.0)
    r = d.place("b", "p0", "prefill", P[:4], 1.0)
    assert (r.version, r.bumped) == (1, False)
    assert counts(d, "p0", P[:5]) == [1, 1, 1, 1, 0]
    r = d.place("b", "p0", "prefill", P[:6], 2.0)
    assert (r.version, r.bumped) == (1, False)
    assert counts(d, "p0", P[:7]) == [1] * 6 + [0]


def test_counted_blocks_of_all_nodes_in_one_call_in_node_id_order(d):
    for n in ("p0", "p1", "d0"):
        d.node_id(n)
    d.place("a", "p1", "prefill", P[:4], 1.0)
    d.place("b", "d0", "decode", P[:6], 1.0)
    d.place("c", "p1", "prefill", P[:2] + [99], 1.0)
    assert d.names == ["p0", "p1", "d0"]
    assert d.counted_blocks_all() == [d.counted_blocks(n) for n in d.names] == [0, 5, 6]


def test_compaction_bumps_version_and_releases_dropped_history_on_every_node(d):
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:6], 1.0)
    d.place("b", "d0", "decode", P[:6], 1.0)
    summary = [P[0], P[1], 901, 902]  # compaction keeps two blocks and writes a summary
    r = d.place("b", "p1", "prefill", summary, 2.0)
    assert (r.version, r.bumped) == (2, True)
    assert counts(d, "p0", P[:6]) == [1, 1, 0, 0, 0, 0]
    assert counts(d, "d0", P[:6]) == [1, 1, 0, 0, 0, 0]  # other phase: kept, minus the dropped history
    assert counts(d, "p1", summary) == [1, 1, 1, 1]
    assert d.counters["branch.version_bumps"] == 1


def test_fork_counts_parent_blocks_without_touching_parent(d):
    d.branch_start("main", 0.0)
    d.place("main", "p0", "prefill", P[:5], 1.0)
    d.branch_start("f", 1.0, kind="fork", parent="main")
    r = d.place("f", "p0", "prefill", P[:5] + [777], 2.0)
    assert r.version == 1 and not r.bumped  # a fork starts with an empty path
    assert counts(d, "p0", P[:5]) == [2] * 5
    d.branch_end("f", 3.0)
    assert counts(d, "p0", P[:5]) == [1] * 5
    d.branch_start("s", 3.0, kind="subagent", parent="main")
    d.place("s", "p0", "prefill", [555, 556], 3.0)
    assert counts(d, "p0", P[:5]) == [1] * 5 and counts(d, "p0", [555, 556]) == [1, 1]


def test_same_phase_move_releases_source_once_target_holds_version(d):
    f = Feed(d)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:4], 1.0)
    r = d.place("b", "p1", "prefill", P[:5], 2.0)
    assert r.released_nodes == []  # p1 does not hold v_β yet
    assert counts(d, "p0", P[:4]) == [1] * 4
    f.send("p1", st(P[:4]))  # not yet the last block of π_β
    assert counts(d, "p0", P[:4]) == [1] * 4
    f.send("p1", st(P[4:5], "host"))
    assert counts(d, "p0", P[:4]) == [0] * 4
    assert counts(d, "p1", P[:5]) == [1] * 5
    assert d.counters["moves.released_sources"] == 1


def test_move_to_node_already_holding_releases_at_once(d):
    f = Feed(d)
    f.send("p1", st(P[:5], "host"))
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:5], 1.0)
    r = d.place("b", "p1", "prefill", P[:5], 2.0)
    assert r.released_nodes == ["p0"]
    assert counts(d, "p0", P[:5]) == [0] * 5


def test_cross_phase_keeps_both_and_phase_switches(d):
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:3], 1.0)
    d.place("b", "d0", "decode", P[:3], 1.0)
    assert counts(d, "p0", P[:3]) == [1] * 3 and counts(d, "d0", P[:3]) == [1] * 3
    assert d.node_phase_changed("p0", "prefill", "decode", 2.0) == 0  # P→D keeps
    assert counts(d, "p0", P[:3]) == [1] * 3
    assert d.node_phase_changed("d0", "decode", "prefill", 2.0) == 1  # D→P resets
    assert counts(d, "d0", P[:3]) == [0] * 3
    assert d.counters["phase.reset_branches"] == 1


def test_a_d_to_p_reset_releases_branches_in_the_order_they_started_counting(d):
    """The reset's count messages come in the order the branches started counting on the node,
    the same in every process. Before, a set of branch-id strings decided it, which
    ``PYTHONHASHSEED`` changes: a simulation with decode→prefill switches gave another report in
    another process."""
    names = [f"b{i:02d}" for i in range(24)]
    for i, b in enumerate(names):  # each its own single-block path, counted on d0 in this order
        d.branch_start(b, 0.0)
        d.place(b, "d0", "decode", [9000 + i], 1.0)
    d.take_count_updates()
    assert d.node_phase_changed("d0", "decode", "prefill", 2.0) == len(names)
    released = [h for cu in d.take_count_updates() if cu.node == "d0" for h in cu.hashes]
    assert released == [9000 + i for i in range(len(names))]


def test_branch_end_releases_everything_and_errors_are_counted(d):
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:3], 1.0)
    d.place("b", "d0", "decode", P[:3], 1.0)
    assert d.branch_end("b", 2.0) == "ended"
    assert counts(d, "p0", P[:3]) == [0] * 3 and counts(d, "d0", P[:3]) == [0] * 3
    assert d.branch_end("b", 2.0) == "duplicate_end"
    assert d.branch_end("zz", 2.0) == "unknown"
    r = d.place("b", "p0", "prefill", P[:3], 3.0)  # late placement of an ended branch
    assert r.rejected == "ended_branch" and counts(d, "p0", P[:3]) == [0] * 3
    assert d.branch_start("b", 3.0) == "ended"
    c = d.counters
    assert (c["branch.duplicate_end"], c["branch.unknown_end"], c["place.ended_branch"], c["branch.start_after_end"]) == (1, 1, 1, 1)


def test_placement_before_start_creates_branch_then_start_merges(d):
    d.place("b", "p0", "prefill", P[:2], 1.0)
    assert d.counters["branch.implicit_start"] == 1
    assert d.branch_start("b", 1.0, kind="fork", parent="x") == "merged"
    assert d.branch("b").kind == "fork"
    assert d.branch_start("b", 1.0) == "duplicate"


def test_silent_branches_expire(d):
    d.branch_start("old", 0.0)
    d.place("old", "p0", "prefill", P[:2], 0.0)
    d.branch_start("new", 50.0)
    assert d.next_deadline() == 100.0
    assert d.expire(99.0) == []
    assert d.expire(100.0) == ["old"]
    assert counts(d, "p0", P[:2]) == [0, 0]
    assert d.counters["branch.expired"] == 1 and d.next_deadline() == 150.0


def test_a_parent_waiting_for_an_active_sub_agent_does_not_expire(d):
    d.branch_start("main", 0.0)
    d.place("main", "p0", "prefill", P[:4], 0.0)
    d.branch_start("sub", 60.0, kind="subagent", parent="main")
    d.place("sub", "p1", "prefill", [101, 102], 90.0)
    d.branch_start("fork", 95.0, kind="fork", parent="sub")
    d.place("fork", "p1", "prefill", [101, 102, 103], 150.0)  # grandchild: main and sub stay alive
    assert d.expire(120.0) == [] and d.expire(200.0) == []
    assert counts(d, "p0", P[:4]) == [1, 1, 1, 1], "the parent's KV keeps its count while it waits"
    assert d.next_deadline() == 250.0
    assert sorted(d.expire(250.0)) == ["fork", "main", "sub"]
    assert counts(d, "p0", P[:4]) == [0, 0, 0, 0]


def test_negative_count_is_refused_and_counted(d):
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:2], 1.0)
    del d.branches.R[d.node_id("p0")][P[0]]  # corrupt the state on purpose
    d.branch_end("b", 2.0)
    assert d.counters["count.negative_prevented"] == 1
    assert d.count("p0", P[0]) == 0


# --------------------------------------------------------------------------- #
# count updates and observability
# --------------------------------------------------------------------------- #


def test_count_updates_are_batched_per_node_and_only_changes(d):
    f = Feed(d)
    f.send("p0", st(P[:3], "host"))
    d.branch_start("a", 0.0)
    d.place("a", "p0", "prefill", P[:3], 1.0)
    d.branch_start("tmp", 0.0)
    d.place("tmp", "p0", "prefill", [50], 1.0)
    d.branch_end("tmp", 1.0)  # 0 → 1 → 0 before a drain: nothing to send
    msgs = d.take_count_updates()
    assert [(u.node, u.seq, u.hashes, u.counts) for u in msgs] == [("p0", 1, P[:3], [1, 1, 1])]
    assert d.take_count_updates() == []
    g = d.gauges()
    assert g["copies.host.positive_count"] == 3 and g["copies.host.zero_count"] == 0
    f.send("p0", st(P[3:5], "host"))
    assert d.gauges()["copies.host.zero_count"] == 2
    f.send("p0", BlockRemoved(block_hashes=[P[0], P[4]], tier="host"))
    assert d.counters["evictions.host.positive_count"] == 1
    assert d.counters["evictions.host.zero_count"] == 1
    # a counted block that comes back to host memory gets its count re-sent
    f.send("p0", st(P[:1], "host"))
    assert [(u.hashes, u.counts) for u in d.take_count_updates()] == [([P[0]], [1])]


def test_place_with_the_callers_lookup_gives_the_same_reuse_record():
    """place(lookup=...) (the simulator passes its routing lookup) == place() looking it up."""
    out = []
    for pass_lookup in (False, True):
        d = KvDirectory(BS, branch_ttl_s=100.0)
        f = Feed(d)
        f.send("p0", st(P[:3], "host"))
        f.send("p1", st(P[:6], "host"))
        d.branch_start("b", 0.0)
        d.place("b", "p0", "prefill", P[:2], 1.0)
        lk = d.lookup(P[:8]) if pass_lookup else None
        r = d.place("b", "p0", "prefill", P[:8], 2.0, lookup=lk)
        out.append((r.reuse, dict(d.counters)))
    assert out[0] == out[1]
    assert out[0][0].hit_blocks == 6 and out[0][0].ideal_blocks == 6


def test_dropping_count_updates_empties_the_outbox_without_messages(d):
    d.branch_start("a", 0.0)
    d.place("a", "p0", "prefill", P[:3], 1.0)
    assert d.pending_count_updates() == 3
    assert d.drop_count_updates() == 3
    assert d.pending_count_updates() == 0 and d.take_count_updates() == []
    d.place("a", "p0", "prefill", P[:4], 2.0)
    assert [(u.seq, u.hashes, u.counts) for u in d.take_count_updates()] == [(1, [P[3]], [1])]


# --------------------------------------------------------------------------- #
# KV event streams: gaps, reordering, resync, restarts
# --------------------------------------------------------------------------- #


def test_gap_freezes_node_and_snapshot_repairs_without_dropping_the_tree(d):
    f = Feed(d)
    f.send("w0", st(P[:4]))
    f.send("w1", st(P[:6], "host"))
    f.batch("w0", st(P[4:6]))  # lost
    r = f.send("w0", BlockRemoved(block_hashes=[P[0]]))
    assert (r.status, r.need_resync, r.expected_seq) == ("gap", True, 2)
    assert d.awaiting_resync("w0") and not d.awaiting_resync("w1")
    lk = d.lookup(P)
    assert lk.node("w0").gpu_blocks == 4 and lk.node("w1").host_blocks == 6  # frozen view, other node intact
    r = f.send("w1", BlockRemoved(block_hashes=[P[5]], tier="host"))
    assert r.status == "applied"  # other nodes keep ingesting
    req = d.resync_request("w0")
    assert req.expected_seq == 2
    snap = KvSnapshot(node="w0", seq=2, block_size=BS, gpu=P[:6], gpu_parents=[None] + P[:5])
    r = d.apply_snapshot(snap, 2.0)
    assert (r.status, r.need_resync, r.expected_seq) == ("resynced", False, 4)  # buffered seq 3 applied on top
    assert d.lookup(P).node("w0").gpu_blocks == 0  # P[0] removed by batch 3
    assert d.lookup(P).longest_any == 6  # P[0] from w1's host, P[1:6] from w0's GPU
    assert not d.awaiting_resync("w0")


def test_reordered_batch_recovers_without_resync(d):
    f = Feed(d)
    b1 = f.batch("w0", st(P[:2]))
    b2 = f.batch("w0", st(P[2:3]))
    b3 = f.batch("w0", BlockRemoved(block_hashes=[P[2]]))
    assert d.apply_kv_batch(b1, 1.0).status == "applied"
    assert d.apply_kv_batch(b3, 1.0).status == "gap"
    assert d.lookup(P).node("w0").gpu_blocks == 2
    r = d.apply_kv_batch(b2, 1.0)
    assert (r.status, r.need_resync, r.expected_seq) == ("recovered", False, 4)
    assert d.lookup(P).node("w0").gpu_blocks == 2
    assert d.apply_kv_batch(b2, 1.0).status == "stale"
    assert d.counters["kv.recovered_without_resync"] == 1


def test_stale_snapshot_ignored_and_foreign_block_size_rejected(d):
    f = Feed(d)
    f.send("w0", st(P[:3]))
    f.send("w0", st(P[3:4]))
    assert d.apply_snapshot(KvSnapshot(node="w0", seq=0, block_size=BS), 1.0).status == "stale"
    assert d.lookup(P).node("w0").gpu_blocks == 4
    r = d.apply_snapshot(KvSnapshot(node="w0", seq=5, block_size=BS * 2), 1.0)
    assert r.status == "rejected" and d.counters["kv.snapshot_block_size_mismatch"] == 1


def test_publisher_restart_needs_a_snapshot(d):
    f = Feed(d)
    f.send("w0", st(P[:3]), ts=1.0)
    f.send("w0", st(P[3:4]), ts=2.0)
    late_dup = KvEventBatch(node="w0", seq=1, ts=1.0, events=[st(P[:3])])
    assert d.apply_kv_batch(late_dup, 3.0).status == "stale"
    restarted = KvEventBatch(node="w0", seq=1, ts=5.0, events=[st(P[:1])])
    r = d.apply_kv_batch(restarted, 5.0)
    assert r.status == "gap" and r.need_resync
    # the directory's log line says why (it read "KV sequence gap; resync requested seq=1 expected=1" after a
    # worker was killed -9 and restarted: a gap at the seq it expected); a plain lost batch has no detail
    assert r.detail.startswith("node restarted") and "after 2" in r.detail, r.detail
    lost = Feed(d)
    lost.send("w1", st(P[:1]))
    lost.batch("w1", st(P[1:2]))  # lost
    r = d.apply_kv_batch(lost.batch("w1", st(P[2:3])), 5.0)
    assert (r.status, r.expected_seq, r.detail) == ("gap", 2, "")
    first = d.apply_kv_batch(KvEventBatch(node="w2", seq=7, ts=5.0, events=[st(P[:1])]), 5.0)
    assert first.status == "gap" and "first batch heard is seq 7" in first.detail
    r = d.apply_kv_batch(KvEventBatch(node="w0", seq=2, ts=5.0, events=[st(P[1:2])]), 5.0)
    assert r.status == "buffered"  # only a snapshot can end a restart
    r = d.apply_snapshot(KvSnapshot(node="w0", seq=1, block_size=BS, gpu=P[:1], gpu_parents=[None]), 6.0)
    assert (r.status, r.expected_seq) == ("resynced", 3)
    assert d.lookup(P).node("w0").gpu_blocks == 2
    assert d.counters["kv.seq_restarts"] == 1


def test_buffer_overflow_requires_a_snapshot():
    d = KvDirectory(BS, resync_buffer_batches=2)
    f = Feed(d)
    f.send("w0", st(P[:1]))
    f.batch("w0", st(P[1:2]))  # lost
    for i in range(3):
        f.send("w0", st(P[2 + i : 3 + i]))
    assert d.counters["kv.buffer_overflow_batches"] == 1
    r = d.apply_snapshot(KvSnapshot(node="w0", seq=2, block_size=BS, gpu=P[:2], gpu_parents=[None, P[0]]), 1.0)
    assert r.need_resync  # seq 3 was dropped from the buffer: the hole remains
    r = d.apply_snapshot(KvSnapshot(node="w0", seq=5, block_size=BS, gpu=P[:5], gpu_parents=[None] + P[:4]), 1.0)
    assert not r.need_resync and d.lookup(P).node("w0").gpu_blocks == 5


def test_block_size_mismatch_rejects_that_event_only(d):
    f = Feed(d)
    r = f.send("w0", st(P[:3], size=BS * 4), st(P[:2]))
    assert r.mismatched_block_sizes == [BS * 4]
    assert d.counters["kv.block_size_mismatch"] == 1 and d.counters["kv.block_size_mismatch_blocks"] == 3
    assert d.lookup(P).node("w0").gpu_blocks == 2


def test_clear_one_tier_or_all(d):
    f = Feed(d)
    f.send("w0", st(P[:3]), st(P[:3], "host"))
    f.send("w0", AllBlocksCleared(tier="gpu"))
    p = d.lookup(P).node("w0")
    assert (p.gpu_blocks, p.host_blocks) == (0, 3)
    f.send("w0", AllBlocksCleared())
    assert d.lookup(P).nodes == [] and len(d.index) == 0


# --------------------------------------------------------------------------- #
# index: memory bound, missing parents, lookups
# --------------------------------------------------------------------------- #


def test_entries_follow_evictions(d):
    f = Feed(d)
    f.send("w0", st(P[:5]), st(P[:5], "host"))
    f.send("w1", st(P[:2], "host"))
    assert len(d.index) == 5
    f.send("w0", AllBlocksCleared())
    assert len(d.index) == 2
    f.send("w1", BlockRemoved(block_hashes=P[:2], tier="host"))
    assert len(d.index) == 0 and d.gauges()["blocks.indexed"] == 0


def test_cap_bites_with_a_counter():
    d = KvDirectory(BS, max_blocks=4)
    f = Feed(d)
    f.send("w0", st(P[:6]))
    assert len(d.index) == 4 and d.index.counters["cap.rejected_blocks"] == 2
    assert d.lookup(P).node("w0").gpu_blocks == 4  # under-reports, never invents


def test_missing_parent_keeps_the_subtree_and_joins_when_parent_arrives(d):
    """Dynamo rejects a store whose parent is unknown (whole subtree lost); we keep it."""
    f = Feed(d)
    f.send("w0", st(P[:2]))
    f.send("w0", st(P[3:6]))  # P[2] was never reported: a hole
    assert d.lookup(P).node("w0").gpu_blocks == 2
    assert d.lookup(P[:2]).longest_any == 2
    f.send("w0", st(P[2:3]))
    assert d.lookup(P).node("w0").gpu_blocks == 6  # the kept subtree joins the prefix


def test_snapshot_without_parents_joins_once_parents_are_reported(d):
    d.apply_snapshot(KvSnapshot(node="w0", seq=0, block_size=BS, host=P[:3]), 1.0)  # old worker: no parents
    assert d.lookup(P).node("w0").host_blocks == 0  # cannot place them in the tree yet
    f = Feed(d)
    f.send("w0", st(P[:3], "host"))
    assert d.lookup(P).node("w0").host_blocks == 3


def test_lookup_holes_mosaic_and_fetch_plan(d):
    f = Feed(d)
    f.send("a", st(P[:3], "host"), st(P[:6]))
    f.send("b", st(P[:8], "host"))
    f.send("c", st(P[:2]), st(P[3:10], "host", parent=P[2]))  # c lacks P[2]: a hole
    f.send("a", BlockRemoved(block_hashes=P[4:6]))
    lk = d.lookup(P)
    assert lk.longest_any == 10
    assert {(p.node, p.gpu_blocks, p.host_blocks, p.local_blocks) for p in lk.nodes} == {
        ("a", 4, 3, 4),
        ("b", 0, 8, 8),
        ("c", 2, 0, 2),
    }
    assert [(r.node, r.start, r.end, r.tier) for r in lk.sources] == [("b", 0, 8, "host"), ("c", 8, 10, "host")]
    plan = fetch_plan(lk.nodes, lk.longest_any, lk.sources, "a", BS)
    assert (plan.cached_tokens, plan.local_tokens, plan.fetch_tokens) == (10 * BS, 4 * BS, 6 * BS)
    assert [(r.node, r.start, r.end) for r in plan.ranges] == [("b", 4, 8), ("c", 8, 10)]
    reply = lk.to_reply(BS)
    assert fetch_plan_for_reply(reply, "c").fetch_tokens == 6 * BS  # its own range is not a fetch
    assert d.lookup([]).nodes == [] and d.lookup([12345]).longest_any == 0


def test_lookup_falls_back_to_gpu_copies(d):
    f = Feed(d)
    f.send("a", st(P[:2], "host"), st(P[:5]))
    lk = d.lookup(P)
    assert [(r.node, r.start, r.end, r.tier) for r in lk.sources] == [("a", 0, 2, "host"), ("a", 2, 5, "gpu")]


# --------------------------------------------------------------------------- #
# lost reuse (paper C.1)
# --------------------------------------------------------------------------- #


def test_attribute_lost_reuse():
    assert attribute_lost_reuse(10, 10, "p0", "p0") == (0, "none")
    assert attribute_lost_reuse(10, 4, "p0", "p0") == (6, "eviction")
    assert attribute_lost_reuse(10, 4, "p1", "p0") == (6, "routing")
    assert attribute_lost_reuse(10, 4, "p1", None) == (6, "unattributed")
    s = lost_reuse_shares({"eviction": 30, "routing": 10}, 400)
    assert s == {"lost_reuse": 0.1, "eviction": 0.75, "routing": 0.25}


def test_lost_reuse_is_attributed_at_prefill_placements():
    d = KvDirectory(BS, reuse_hit_scope="local")
    f = Feed(d)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:4], 1.0)
    f.send("p0", st(P[:4]), st(P[:4], "host"))
    f.send("p0", BlockRemoved(block_hashes=P[2:4]), BlockRemoved(block_hashes=P[2:4], tier="host"))  # LRU evicted
    r = d.place("b", "p0", "prefill", P[:6], 2.0)
    assert (r.reuse.ideal_blocks, r.reuse.hit_blocks, r.reuse.lost_blocks, r.reuse.cause) == (4, 2, 2, "eviction")
    f.send("p1", st(P[:6], "host"))
    r = d.place("b", "p2", "prefill", P[:7], 3.0)  # routed away from its KV
    assert (r.reuse.lost_blocks, r.reuse.cause) == (6, "routing")
    assert d.counters["reuse.lost_tokens.eviction"] == 2 * BS
    assert d.counters["reuse.lost_tokens.routing"] == 6 * BS
    assert d.gauges()["reuse.eviction"] == pytest.approx(0.25)


def test_apply_dispatch_and_bad_arguments():
    from shared.messages import BranchEnd, BranchStart, RoutePlaced

    d = KvDirectory(BS)
    assert d.apply(BranchStart(branch_id="x"), 0.0) == "started"
    assert d.apply(RoutePlaced(rid="r", branch_id="x", node="n", phase="prefill", block_hashes=P[:1]), 0.0).version == 1
    assert d.apply(BranchEnd(branch_id="x"), 0.0) == "ended"
    with pytest.raises(TypeError):
        d.apply(object(), 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        KvDirectory(0)
    with pytest.raises(ValueError):
        KvDirectory(BS, reuse_hit_scope="nowhere")  # type: ignore[arg-type]


def test_late_batch_one_after_a_snapshot_is_stale_not_a_restart(d):
    """Batch 1 lost, batch 2 buffered as a gap, a snapshot at seq 2, then batch 1 arrives late:
    stale (found by the property test: it once read as a publisher restart)."""
    b1 = KvEventBatch(node="w0", seq=1, ts=1.0, events=[st([1002])])
    b2 = KvEventBatch(node="w0", seq=2, ts=1.0, events=[AllBlocksCleared()])
    assert d.apply_kv_batch(b2, 1.0).status == "gap"
    assert d.apply_snapshot(KvSnapshot(node="w0", seq=2, block_size=BS), 1.0).status == "resynced"
    assert d.apply_kv_batch(b1, 1.0).status == "stale"


def test_a_hash_repeated_inside_one_store_is_indexed_as_block_by_block():
    # the new-chain fast path must not build a cycle out of a repeated hash
    from services.kvdirectory.index import GPU, BlockIndex

    fast, slow = BlockIndex(), BlockIndex()
    for ix in (fast, slow):
        ix.ensure_node(0)
    chain = [11, 12, 11, 13]
    assert fast.store(0, GPU, chain, None) == [11, 12, 13]
    for i, h in enumerate(chain):
        slow.store(0, GPU, [h], chain[i - 1] if i else None)
    assert fast.entries == slow.entries and dict(fast.negcomp) == dict(slow.negcomp)
    assert fast.counters == slow.counters and fast.counters["stored.parent_conflict"] == 1
    assert fast.prefix_drops(chain) == slow.prefix_drops(chain)


def test_index_entries_leave_the_cyclic_collector(d):
    # millions of entries must not be walked by every full collection (a lookup stall)
    import gc

    f = Feed(d)
    f.send("w0", st(P), st(P[:4], "host"))
    f.send("w1", st(P[:3], "host"), BlockRemoved(block_hashes=[P[9]], tier="gpu"))
    gc.collect()
    assert not any(gc.is_tracked(e) for e in d.index.entries.values())


@pytest.mark.parametrize("seed", range(20))
def test_decode_few_bytes_path_matches_per_bit_path(seed):
    import random

    from services.kvdirectory import lookup

    rng = random.Random(seed)
    nn = rng.randint(1, 70)
    positions = list(range(3 * nn + 1))
    rng.shuffle(positions)
    k = rng.randint(1, min(16, len(positions)))  # disjoint bit sets, one per distinct length
    cuts = sorted(rng.sample(range(1, len(positions)), k - 1)) if k > 1 else []
    groups = [positions[a:b] for a, b in zip([0, *cuts], [*cuts, len(positions)])]
    lengths = sorted(rng.sample(range(1, 3000), k))
    drops = [(n, sum(1 << p for p in g)) for n, g in zip(lengths, groups)]
    longest_any, table, gb, hb, lb = lookup._decode_few(drops, nn)
    fast = (longest_any, [table[i] for i in gb], [table[i] for i in hb], [table[i] for i in lb])
    per_bit = lookup._decode_per_bit(drops, nn)
    assert fast == per_bit
    want = [0] * (3 * nn + 1)
    for n, g in zip(lengths, groups):
        for p in g:
            want[p] = n
    assert per_bit == (want[0], want[1::3], want[2::3], want[3::3])


def test_forged_sequence_jump_ends_with_one_snapshot():
    """A batch with seq 10^12 (forged) is buffered as a gap; the node's snapshot, taken at its
    real seq, discards it (no node publishes that far past its snapshot), so the node is no
    longer awaiting a resync: one resync, not a storm (issue 18)."""
    d = KvDirectory(BS, resync_buffer_batches=8)
    f = Feed(d)
    f.send("w0", st(P[:1]))
    r = d.apply_kv_batch(KvEventBatch(node="w0", seq=10**12, events=[st(P[1:2])]), 1.0)
    assert r.need_resync and d.awaiting_resync("w0")
    r = d.apply_snapshot(KvSnapshot(node="w0", seq=1, block_size=BS, gpu=P[:1], gpu_parents=[None]), 2.0)
    assert not r.need_resync and not d.awaiting_resync("w0")
    assert d.counters["kv.batches_beyond_snapshot"] == 1
    f.send("w0", st(P[1:2]))  # the worker's real next batch (seq 2) applies normally
    assert d.lookup(P).node("w0").gpu_blocks == 2 and not d.awaiting_resync("w0")


def test_a_branch_active_again_after_expiry_is_resumed_not_refused(d):
    """Issue 21: an agent back from a pause longer than the TTL is served; the resume is counted.
    Only an explicitly ended branch is refused."""
    d.branch_start("b", 0.0, kind="subagent", parent="main", agent="a1")
    d.place("b", "p0", "prefill", P[:3], 0.0)
    assert d.expire(100.0) == ["b"] and counts(d, "p0", P[:3]) == [0] * 3
    r = d.place("b", "p0", "prefill", P[:4], 5000.0)  # long after the TTL (100 s here)
    assert r.rejected is None
    assert counts(d, "p0", P[:4]) == [1] * 4
    b = d.branch("b")
    assert (b.kind, b.parent, b.agent) == ("subagent", "main", "a1")
    assert d.counters["branch.resumed"] == 1 and d.counters["place.ended_branch"] == 0
    assert d.branch_start("b", 5000.0) == "merged"  # the router's re-announcement merges
    # the same through a start first
    assert d.expire(5100.0) == ["b"]
    assert d.branch_start("b", 9000.0) == "resumed" and d.counters["branch.resumed"] == 2
    # an explicit end of an expired branch is an end; then placements are refused
    assert d.expire(9100.0) == ["b"]
    assert d.branch_end("b", 9200.0) == "ended" and d.counters["branch.ended_after_expiry"] == 1
    assert d.place("b", "p0", "prefill", P[:4], 9300.0).rejected == "ended_branch"


def test_a_tool_call_outstanding_keeps_the_branch_counted_until_it_returns(d):
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:3], 0.0)
    assert d.branch_hold("b", True, 500.0, 10.0) == "held"  # the tool is expected to run 500 s
    assert d.expire(100.0) == [] and d.expire(300.0) == []
    assert counts(d, "p0", P[:3]) == [1] * 3, "the blocks stay counted while the tool runs"
    assert d.counters["branch.hold_kept"] >= 1
    d.place("b", "p0", "prefill", P[:4], 520.0)  # the tool returned: the next request clears the hold
    assert d.branch("b").hold_until == 0.0
    assert d.expire(620.0) == ["b"]  # then the normal TTL
    # no expected duration: held up to max_hold_s; a release ends the hold
    d.branch_start("c", 1000.0)
    assert d.branch_hold("c", True, 0.0, 1000.0) == "held" and d.branch("c").hold_until == 1000.0 + d.branches.max_hold_s
    assert d.branch_hold("c", False, 0.0, 1050.0) == "released"
    assert d.expire(1150.0) == ["c"]
    assert d.branch_hold("nope", True, 10.0, 1200.0) == "unknown"


@pytest.mark.parametrize("extend", [True, False])
def test_written_through_store_declines_a_chain_with_an_indexed_block_and_changes_nothing(extend):
    from services.kvdirectory.index import BlockIndex

    ix = BlockIndex()
    ix.ensure_node(0)
    ix.ensure_node(1)
    assert ix.store_written_through(0, [1, 2, 3], None) == [1, 2, 3]
    ix.store(1, 0, [7], None)
    before = (dict(ix.where), [list(r.keys) for r in ix.runs()], [c[:] for c in ix.copies])
    # below block 3 on node 0 (extends its run, same presence) or on node 1 (a new run); 2 or 7 is indexed already
    node = 0 if extend else 1
    assert ix.store_written_through(node, [4, 5, 2, 6], 3) is None
    assert ix.store_written_through(node, [4, 7], 3) is None
    assert ix.store_written_through(node, [4, 5, 4], 3) is None  # repeated inside the chain
    assert (dict(ix.where), [list(r.keys) for r in ix.runs()], [c[:] for c in ix.copies]) == before
    ix.check()
    assert ix.store_written_through(node, [4, 5], 3) == [4, 5]
    ix.check()


def test_count_snapshot_is_what_the_messages_up_to_its_seq_net_to():
    """``count_snapshot`` (``kv.countsync``): R[·, node] > 0 and the seq of the node's last
    message; a worker that applied every message up to that seq holds exactly these counts."""
    d = KvDirectory(BS, branch_ttl_s=100.0)
    assert d.count_snapshot("p0") == ([], [], 0)  # a node never heard of
    worker: dict[int, int] = {}
    d.branch_start("a", 0.0)
    d.branch_start("b", 0.0)
    d.place("a", "p0", "prefill", P[:4], 1.0)
    d.place("b", "p0", "prefill", P[:6], 1.0)
    with pytest.raises(ValueError, match="not yet taken"):
        d.count_snapshot("p0")  # R already holds changes the next message will carry
    seq = 0
    for step in range(3):
        for cu in d.take_count_updates():
            assert cu.seq == seq + 1 and cu.node == "p0"
            seq = cu.seq
            worker.update(zip(cu.hashes, cu.counts))
        hashes, cnts, s = d.count_snapshot("p0")
        assert s == seq and len(hashes) == d.counted_blocks("p0") and min(cnts) >= 1
        assert dict(zip(hashes, cnts)) == {h: c for h, c in worker.items() if c}
        if step == 0:
            d.branch_end("a", 2.0)
        elif step == 1:
            d.place("b", "p0", "prefill", [P[0], 99], 3.0)  # a version bump: P[1:6] released
    assert d.count_snapshot("p0") == ([P[0], 99], [1, 1], seq)


def test_forget_node_drops_its_blocks_like_all_blocks_cleared_and_a_returning_node_is_resynced():
    def cluster():
        d = KvDirectory(BS, keep_counted_copies=True)
        f = Feed(d)
        f.send("w0", st(P[:6]), st(P[:6], "host"))
        f.send("w1", st(P[:3], "host"))
        d.branch_start("b", 1.0)
        d.place("b", "w0", "both", P[:6], 1.0)
        return d, f

    d, f = cluster()
    ref, rf = cluster()
    rf.send("w0", AllBlocksCleared())  # what a SIGTERMed worker sends; a SIGKILLed one sends nothing
    assert d.forget_node("w0") == 12 and d.forget_node("nobody") == 0
    lk, rk = d.lookup(P), ref.lookup(P)
    assert lk.node("w0") == rk.node("w0") and lk.node("w0").local_blocks == 0
    assert lk.node("w1").host_blocks == 3  # other nodes untouched
    g, rg = d.gauges(), ref.gauges()
    for k in ("blocks.indexed", "copies.gpu", "copies.host", "copies.gpu.positive_count", "copies.host.positive_count", "counts.entries"):
        assert g[k] == rg[k], k
    assert counts(d, "w0", P[:6]) == counts(ref, "w0", P[:6]) == [1] * 6  # R is the branches': kept
    assert d.counters["nodes.forgotten"] == 1 and d.counters["nodes.forgotten_copies"] == 12
    assert d.awaiting_resync("w0") and not d.awaiting_resync("w1")

    # the same process comes back (a long pause, a partition): its next batch is not applied on an
    # empty view (half-indexed) but buffered until a snapshot of its true KV arrives
    r = f.send("w0", st(P[6:8]))
    assert r.status == "buffered" and r.need_resync and d.lookup(P).node("w0").local_blocks == 0
    r = d.apply_snapshot(KvSnapshot(node="w0", seq=f.seq["w0"] - 1, block_size=BS, gpu=P[:6], gpu_parents=[None] + P[:5]), 2.0)
    assert r.status == "resynced" and not r.need_resync and not d.awaiting_resync("w0")
    assert d.lookup(P).node("w0").gpu_blocks == 8  # snapshot + the buffered batch after it
    assert f.send("w0", st(P[8:9])).status == "applied" and d.lookup(P).node("w0").gpu_blocks == 9

    # a restarted worker (seq back to 1, newer ts) after being forgotten: resynced as well
    d.forget_node("w1")
    r = d.apply_kv_batch(KvEventBatch(node="w1", seq=1, ts=5.0, events=[AllBlocksCleared()]), 5.0)
    assert r.need_resync and d.awaiting_resync("w1")
    d.apply_snapshot(KvSnapshot(node="w1", seq=1, block_size=BS, host=P[:2], host_parents=[None, P[0]]), 5.0)
    assert not d.awaiting_resync("w1") and d.lookup(P).node("w1").host_blocks == 2


def test_a_forgotten_nodes_slot_goes_to_the_next_new_node_with_nothing_of_the_old_one():
    """Node ids that change on every restart (pod names): a forgotten node's slot is taken over
    by the next new id, so slots count the nodes there are, not every id ever seen; the new node
    inherits no block, count, pending move, phase, lost-reuse history or message number."""
    d = KvDirectory(BS, keep_counted_copies=True)
    f = Feed(d)
    f.send("p0", st(P[:6]))
    f.send("p1", st(P[:2], "host"))
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:4], 1.0)
    d.place("b", "p1", "prefill", P[:4], 2.0)  # p1 lacks P[3]: the move p0 -> p1 waits for it
    d.branch_start("c", 0.0)
    d.place("c", "p0", "prefill", P[:6], 1.0)  # c's last prefill node is p0
    d.take_count_updates()
    assert d.count_seqs()["p0"] == 1 and d.branch("b").pending == {1: {0}}

    assert d.forget_node("p0") == 6 and d.forget_node("p0") == 0  # once
    assert d.is_forgotten("p0") and not d.is_live("p0") and d.live_nodes() == 1
    assert d.gauges()["nodes"] == 1.0 and d.gauges()["nodes.forgotten_slots"] == 1.0
    assert counts(d, "p0", P[:4]) == [2] * 4  # kept while the slot is not taken over
    d.place("c", "p0", "prefill", P[:6], 1.5)  # another router's word: p0 stays forgotten
    assert d.is_forgotten("p0")

    f.send("p2", st(P[:1]))  # a new pod: takes over p0's slot
    assert d.names == ["p2", "p1"] and d.live_nodes() == 2 and not d.has_node("p0")
    assert d.take_reclaimed() == ["p0"] and d.take_reclaimed() == []
    assert d.node_generation("p2") == 1 and d.node_generation("p1") == 0 and d.counters["nodes.reclaimed"] == 1
    assert d.lookup(P).node("p2").gpu_blocks == 1  # only its own block
    assert d.counted_blocks("p2") == 0 and "p2" not in d.count_seqs() and d.node_phase("p2") is None
    assert d.branch("b").pending == {} and 0 not in d.branch("b").counted and d.branch("c").counted == {}
    assert d.take_count_updates() == []  # the release of a gone node's counts is sent to nobody
    d.branches.check()
    d.index.check()
    r = d.place("c", "p2", "prefill", P[:6], 3.0)
    assert r.reuse is not None and r.reuse.prev_node is None  # p0's history is not p2's
    assert counts(d, "p2", P[:6]) == [1] * 6
    f.send("p1", st(P[2:4], "host"))  # b's move to p1 completes: nothing of p2 is released
    assert counts(d, "p2", P[:6]) == [1] * 6 and counts(d, "p1", P[:4]) == [1] * 4
    [cu] = [u for u in d.take_count_updates() if u.node == "p2"]
    assert cu.seq == 1  # p2's own numbering

    # a forgotten node heard again before its slot is taken over is live again, in its own slot
    d.forget_node("p1")
    f.send("p1", st(P[4:5], "host"))
    assert d.is_live("p1") and d.names == ["p2", "p1"] and d.counters["nodes.revived"] == 1
    # and p0, heard again after its slot went to p2, is a new node: a new slot, a new generation
    d.forget_node("p2")
    f.send("p3", st(P[:1]))
    assert d.names == ["p3", "p1"]
    f.send("p0", st(P[:1]))
    assert d.names == ["p3", "p1", "p0"] and d.node_generation("p0") == 2 and d.counted_blocks("p0") == 0
    d.branches.check()
    d.index.check()


@pytest.mark.parametrize("seed", range(4))
def test_pod_churn_keeps_the_branch_table_and_index_consistent(seed):
    """Pods come and go (each restart a new id) while branches move between them: every slot
    taken over starts empty and the branch table's and index's invariants hold throughout."""
    import random

    rng = random.Random(seed)
    d = KvDirectory(BS, keep_counted_copies=True)
    f = Feed(d)
    pods = [f"pod-{i}" for i in range(3)]
    nxt = 3
    for step in range(60):
        node = rng.choice(pods)
        k = rng.randrange(1, len(P) + 1)
        if rng.random() < 0.5:
            f.send(node, st(P[:k], rng.choice(["gpu", "host"])))
        b = f"b{rng.randrange(5)}"
        d.place(b, node, rng.choice(["prefill", "decode", "both"]), P[:k], float(step))
        if rng.random() < 0.1:
            d.branch_end(b, float(step))
        if rng.random() < 0.3:
            d.take_count_updates()
        if rng.random() < 0.2:  # a pod dies for good; a new one starts
            gone = pods.pop(rng.randrange(len(pods)))
            d.forget_node(gone)
            new = f"pod-{nxt}"
            nxt += 1
            pods.append(new)
            f.send(new, st(P[:1]))
            assert d.lookup(P).node(new).local_blocks == 1 and d.counted_blocks(new) == 0
            assert new not in d.count_seqs() and d.node_phase(new) is None
        d.branches.check()
        d.index.check()
    assert len(d.names) == 3 and d.counters["nodes.reclaimed"] == nxt - 3


def test_a_router_eviction_is_ignored_when_another_router_placed_the_branch_since(d):
    """Two routers serve branch "x": router A placed request a1, router B then placed b1 (its
    request may still run). A's cap evicts "x" (BranchEnd expired=True, rid=a1): the directory's
    latest placement is b1, so it keeps the branch, its counts, path and version
    (``branch.stale_evict``). Before, it expired "x" at once: its counts dropped to 0 on every node
    while B served it. B's own eviction (rid=b1) expires it; an old sender's (no rid) still does."""
    import msgspec

    from shared.messages import BranchEnd, RoutePlaced

    d.branch_start("x", 0.0)
    d.apply(RoutePlaced(rid="a1", branch_id="x", node="p0", phase="prefill", block_hashes=P[:2]), 0.0)
    d.apply(RoutePlaced(rid="b1", branch_id="x", node="p0", phase="prefill", block_hashes=P[:3]), 1.0)
    d.apply(RoutePlaced(rid="b1", branch_id="x", node="d0", phase="decode", block_hashes=P[:3]), 1.0)
    before = (counts(d, "p0", P[:3]), counts(d, "d0", P[:3]), d.branch("x").version, list(d.branch("x").path))
    assert before[0] == [1, 1, 1] and before[1] == [1, 1, 1]
    assert d.apply(BranchEnd(branch_id="x", expired=True, rid="a1"), 2.0) == "stale"
    assert d.apply(BranchEnd(branch_id="x", expired=True, rid=""), 2.0) == "stale"  # A never placed it
    after = (counts(d, "p0", P[:3]), counts(d, "d0", P[:3]), d.branch("x").version, list(d.branch("x").path))
    assert after == before and d.counters["branch.stale_evict"] == 2 and d.counters["branch.evicted"] == 0
    d.branches.check()
    assert d.apply(BranchEnd(branch_id="x", expired=True, rid="b1"), 3.0) == "evicted"
    assert counts(d, "p0", P[:3]) == [0, 0, 0] and d.branch("x") is None
    d.apply(RoutePlaced(rid="b2", branch_id="x", node="p0", phase="prefill", block_hashes=P[:2]), 4.0)  # a resume
    assert d.apply(BranchEnd(branch_id="x", expired=True), 5.0) == "evicted"  # no rid: unchecked
    assert d.counters["branch.evicted"] == 2
    d.branches.check()
    assert msgspec.json.decode(b'{"type":"BranchEnd","branch_id":"x","expired":true}', type=BranchEnd).rid is None


def test_a_router_eviction_expires_the_branch_as_the_ttl_does(d):
    """A router's --max-active-branches evicted "a" (BranchEnd expired=True): the directory
    releases its counts at once, exactly as the TTL's expiry would, and keeps it resumable (an
    end would refuse its next placement)."""
    from shared.messages import BranchEnd, BranchStart

    d.apply(BranchStart(branch_id="a", kind="fork", parent_branch_id="m", agent_id="ag"), 0.0)
    d.place("a", "p0", "prefill", P[:3], 0.0)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:2], 0.0)
    assert counts(d, "p0", P[:3]) == [2, 2, 1]
    assert d.apply(BranchEnd(branch_id="a", expired=True), 1.0) == "evicted"
    assert counts(d, "p0", P[:3]) == [1, 1, 0] and d.branch("a") is None
    d.branches.check()
    assert d.counters["branch.evicted"] == 1 and d.counters["branch.ended"] == 0
    assert d.apply(BranchEnd(branch_id="a", expired=True), 2.0) == "unknown"  # a second one changes nothing
    assert d.counters["branch.unknown_evict"] == 1
    r = d.place("a", "p0", "prefill", P[:4], 3.0)  # its next request: a resume, not refused
    assert r.rejected is None and counts(d, "p0", P[:4]) == [2, 2, 1, 1]
    assert (d.branch("a").kind, d.branch("a").parent, d.branch("a").agent) == ("fork", "m", "ag")
    assert d.counters["branch.resumed"] == 1
    d.branches.check()
    d.branch_end("b", 4.0)
    assert d.apply(BranchEnd(branch_id="b", expired=True), 5.0) == "ended"  # an ended branch stays ended
    assert d.place("b", "p0", "prefill", P[:2], 6.0).rejected == "ended_branch"


def test_batch_counters_match_one_event_per_batch():
    """``kv.blocks_stored`` / ``kv.blocks_removed`` are added once per batch (``KvDirectory._apply``)
    and the eviction counters by tier (``_EVICT_PAIRS``): the same counters, index and copies as
    the same events applied one batch each, for a batch holding a write-through pair, a host
    eviction between a GPU store and its write-through, a GPU-only store and removals of both tiers."""
    events = [
        st(P[:3]), st(P[:3], "host"),  # a write-through pair (applied as one)
        st(P[3:5]), BlockRemoved(block_hashes=[P[2]], tier="host"), st(P[3:5], "host"),  # eviction between
        st(P[5:7]),  # GPU only
        BlockRemoved(block_hashes=[P[6], P[5]], tier="gpu"),
        BlockRemoved(block_hashes=[P[4], P[3]], tier="host"),
        BlockRemoved(block_hashes=[], tier="gpu"),
    ]
    one = KvDirectory(BS)
    Feed(one).send("p0", *events)
    each = KvDirectory(BS)
    f = Feed(each)
    for ev in events:
        f.send("p0", ev)
    for key in ("kv.blocks_stored", "kv.blocks_removed", "evictions.gpu.zero_count", "evictions.host.zero_count"):
        assert one.counters[key] == each.counters[key] > 0, key
    assert one.counters["kv.blocks_stored"] == 12 and one.counters["kv.blocks_removed"] == 5
    assert one.index.copies == each.index.copies
    assert sorted(one.index.where) == sorted(each.index.where)


def test_a_late_placement_of_the_request_already_placed_keeps_the_tool_call_hold(d):
    """A request's decode placement can reach the directory after the harness's tool-call hint (the hint follows the
    response; the placement is a bus message of another router or the decode binding): it is no new request, so the
    hold stays. Before, it cleared the hold (test_branch_end_elsewhere_live.py failed 2 of 3: hold_until 0.0 right
    after the hold). A placement of a new request clears it, as before."""
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", P[:3], 0.0, rid="r1")
    assert d.branch_hold("b", True, 500.0, 10.0) == "held"
    d.place("b", "p0", "decode", P[:3], 11.0, rid="r1")  # r1's decode binding, late
    assert d.branch("b").hold_until == 510.0
    d.place("b", "p0", "prefill", P[:4], 520.0, rid="r2")  # the next request: the tool returned
    assert d.branch("b").hold_until == 0.0
