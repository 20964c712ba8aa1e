"""KV-view liveness (issue #22): serving time without a KV batch, stale views, lookups without them."""

from __future__ import annotations

import pytest

from shared.messages import FetchRange, KvLookupReply, NodePrefix

from services.kvdirectory.core import KvDirectory
from services.kvdirectory.liveness import KvLiveness
from services.kvdirectory.lookup import usable_lookup


def test_only_serving_time_without_a_batch_counts():
    lv = KvLiveness(stale_after=2.0)
    lv.state("w0", True, 0.0)
    lv.state("w0", False, 1.5)  # served 1.5 s, then idle
    assert lv.silent_s("w0", 100.0) == pytest.approx(1.5)  # idle time does not count
    assert lv.check(100.0) == []
    lv.state("w0", True, 100.0)
    assert lv.silent_s("w0", 100.4) == pytest.approx(1.9)
    assert lv.check(100.6) == ["w0"] and lv.is_stale("w0") and lv.stale_nodes() == {"w0"}
    assert lv.check(101.0) == []  # marked once per episode
    assert lv.batch("w0", 101.0) and not lv.is_stale("w0") and lv.silent_s("w0", 101.0) == 0.0
    assert not lv.batch("w0", 101.5)
    lv.state("w1", False, 0.0)
    assert lv.silent_s("w1", 50.0) == 0.0 and lv.silent_s("unknown", 1.0) == 0.0
    assert [r[0] for r in lv.report(101.5)] == ["w0", "w1"]
    with pytest.raises(ValueError):
        KvLiveness(0.0)


def test_a_stale_view_is_left_out_of_lookups():
    rep = KvLookupReply(
        block_size=4, nodes=[NodePrefix(node="w0", host_blocks=3, local_blocks=3), NodePrefix(node="w1", host_blocks=5, local_blocks=5)],
        longest_any=5, sources=[FetchRange(node="w1", start=0, end=5)],
    )  # fmt: skip
    out = usable_lookup(rep, lambda n: n != "w1")
    assert out is not None and [p.node for p in out.nodes] == ["w0"]
    assert [(r.node, r.start, r.end) for r in out.sources] == [("w0", 0, 3)] and out.longest_any == 3


def test_a_stale_node_gets_one_resync_request():
    d = KvDirectory(4)
    assert d.request_resync("w9")  # never heard of on kv.events: registered and asked
    assert d.awaiting_resync("w9") and not d.request_resync("w9")
    assert d.resync_request("w9").node == "w9"


def test_a_node_unheard_for_the_forget_limit_is_forgotten_once_and_back_when_heard():
    lv = KvLiveness(stale_after=2.0)
    lv.heard("w0", 0.0)
    lv.heard("w1", 0.0)
    lv.heard("w1", 250.0)  # a state or a batch: any of them keeps a node known
    assert lv.forget(300.0, 300.0) == []  # not before the limit
    assert lv.forget(300.5, 300.0) == ["w0"] and lv.is_forgotten("w0") and not lv.is_forgotten("w1")
    assert lv.forget(1000.0, 300.0) == ["w1"]  # w0 once per silence
    assert lv.heard("w0", 1001.0) and not lv.is_forgotten("w0")  # back
    assert not lv.heard("w0", 1002.0)
    assert lv.forget(1302.0, 300.0) == [] and lv.forget(1302.5, 300.0) == ["w0"]
    assert lv.forget(10_000.0, 300.0) == [] and not lv.is_forgotten("never-heard")


def test_a_forgotten_node_leaves_the_report_and_checks_and_drop_forgets_it_for_good():
    lv = KvLiveness(stale_after=2.0)
    lv.heard("w0", 0.0)
    lv.state("w0", True, 0.0)  # serving, then SIGKILLed: silent from then on
    lv.heard("w1", 0.0)
    lv.heard("w1", 400.0)
    assert lv.forget(301.0, 300.0) == ["w0"]
    assert [r[0] for r in lv.report(401.0)] == ["w1"]  # was listed forever
    assert lv.check(401.0) == []  # no stale mark (and no resync) for a node that is gone
    assert lv.heard("w0", 402.0) and [r[0] for r in lv.report(402.0)] == ["w0", "w1"]  # back: listed again
    assert lv.forget(703.0, 300.0) == ["w0", "w1"] and lv.report(703.0) == []
    assert lv.drop("w0") and not lv.drop("w0") and len(lv) == 1
    assert not lv.heard("w0", 704.0)  # gone for good: heard again, it is a new node


def test_a_node_whose_kv_was_never_heard_awaits_one_snapshot():
    """A directory restarted while a node idles hears only its ``node.state``: ``resync_unheard`` makes
    it await a snapshot (once), which then indexes it; a node whose batch or snapshot was heard, one
    awaiting a resync and a forgotten one are left alone."""
    from shared.messages import BlockStored, KvEventBatch, KvSnapshot

    d = KvDirectory(4)
    assert d.kv_unheard("w0") and not d.has_node("w0")  # a query: registers nothing
    assert d.resync_unheard("w0") and d.awaiting_resync("w0") and d.counters["kv.unheard_resyncs"] == 1
    assert not d.kv_unheard("w0") and not d.resync_unheard("w0") and d.counters["kv.unheard_resyncs"] == 1
    assert d.resync_request("w0").node == "w0"
    res = d.apply_snapshot(KvSnapshot(node="w0", seq=7, block_size=4, gpu=[11, 12], gpu_parents=[None, 11], host=[11], host_parents=[None]), 0.0)
    assert res.status == "resynced" and not d.awaiting_resync("w0") and d.index.copies[d.node_id("w0")] == [2, 1]
    assert not d.kv_unheard("w0") and not d.resync_unheard("w0")  # known from its snapshot, though no batch came
    assert d.apply_kv_batch(KvEventBatch(node="w0", seq=8, events=[BlockStored(block_hashes=[13], parent_block_hash=12, block_size=4)]), 1.0).status == "applied"
    d.apply_kv_batch(KvEventBatch(node="w1", seq=1, events=[]), 0.0)  # its batch heard
    assert not d.kv_unheard("w1") and not d.resync_unheard("w1")
    d.apply_kv_batch(KvEventBatch(node="w2", seq=5, events=[]), 0.0)  # first contact: awaits a snapshot already
    assert not d.resync_unheard("w2")
    d.apply_kv_batch(KvEventBatch(node="w3", seq=1, events=[]), 0.0)
    d.forget_node("w3")
    assert not d.kv_unheard("w3") and not d.resync_unheard("w3") and d.is_forgotten("w3")  # still forgotten, not revived
    # asked, then its batch 1 comes (the worker restarted meanwhile: its KV starts empty): applied, no snapshot needed
    assert d.resync_unheard("w4")
    res = d.apply_kv_batch(KvEventBatch(node="w4", seq=1, events=[BlockStored(block_hashes=[21], parent_block_hash=None, block_size=4)]), 0.0)
    assert res.status == "recovered" and not d.awaiting_resync("w4") and d.index.copies[d.node_id("w4")] == [1, 0]
    assert d.counters["kv.unheard_resyncs"] == 2


def test_batchless_lists_nodes_heard_long_enough_without_a_kv_batch():
    lv = KvLiveness(stale_after=2.0)
    lv.heard("w0", 0.0)  # states only (idle)
    lv.heard("w1", 0.0)
    lv.batch("w1", 0.5)  # a batch heard
    lv.heard("w2", 1.5)
    assert lv.batchless(2.0, 2.0) == [] and lv.batchless(2.5, 2.0) == ["w0"]
    lv.heard("w0", 3.0)  # its later states keep the first time
    assert lv.batchless(3.6, 2.0) == ["w0", "w2"]
    assert lv.forget(300.0, 250.0) == ["w0", "w1", "w2"] and lv.batchless(300.0, 2.0) == []  # forgotten: left out
    assert lv.heard("w2", 301.0) and lv.batchless(301.0, 2.0) == ["w2"]
    lv.batch("w2", 302.0)
    assert lv.batchless(400.0, 2.0) == []
    assert KvLiveness(1.0).batchless(10.0, 2.0) == []
