"""The directory's ``kv.counts`` seq beacon (``DirectoryService.send_count_beacons``), on a fake bus.

The bus here publishes with a random number of event-loop turns before the message is on the wire
(as a real client may wait for its buffer), so flushes and beacons interleave at every await. The
order on the wire is then what one NATS connection delivers: no beacon may reach a worker before
the message whose number it carries (that would be a false gap), and a worker's ``CountStream``
fed the wire sees no gap without a loss and one gap per lost last message with it.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Collection
from typing import Any

import structlog

from services.kvdirectory.config import DirectoryConfig
from services.kvdirectory.prom import directory_families
from services.kvdirectory.service import DirectoryService
from services.worker.countseq import CountStream
from shared import messages as m
from shared.bus import BusUnavailable
from shared.clock import SimClock
from shared.ratelog import RateLimitedLog

NODES = ("w0", "w1", "w2")


class FakeBus:
    """What ``DirectoryService`` uses of a bus: ``publish`` (puts the message on :attr:`wire` after
    0–2 event-loop turns, or raises for a seq in :attr:`fail`), ``counters``, ``instance``."""

    def __init__(self, seed: int = 0) -> None:
        self.instance = "kvdirectory"
        self.counters: Counter[str] = Counter()
        self.known_nodes: frozenset[str] | None = None
        self.wire: list[m.CountUpdates] = []
        self.fail: set[tuple[str, int]] = set()
        """``(node, seq)`` of numbered messages whose publication fails."""
        self.fail_beacons = False
        self.rng = random.Random(seed)

    async def publish(self, subject: Any, msg: Any, **params: str) -> None:
        for _ in range(self.rng.randrange(3)):
            await asyncio.sleep(0)
        if not isinstance(msg, m.CountUpdates):
            return
        if ((msg.node, msg.seq) in self.fail and not msg.beacon) or (msg.beacon and self.fail_beacons):
            raise BusUnavailable("cannot publish on kv.counts.{node}: fake")
        self.wire.append(msg)

    async def subscribe(self, subject: Any, handler: Any, **kw: Any) -> None:
        pass

    async def serve(self, subject: Any, handler: Any, **kw: Any) -> None:
        pass


def directory(seed: int = 0, **cfg: Any) -> tuple[DirectoryService, FakeBus]:
    bus = FakeBus(seed)
    return DirectoryService(DirectoryConfig(block_size=4, **cfg), bus, SimClock()), bus  # type: ignore[arg-type]


def traffic(d: DirectoryService, rng: random.Random, step: int) -> None:
    """Count changes on a random subset of the nodes (each its own message at the next flush)."""
    for node in NODES:
        if rng.random() < 0.6:
            b = f"{node}-{step}"
            d.core.branch_start(b, float(step))
            d.core.place(b, node, "prefill", [1000 * NODES.index(node) + step % 7 + i for i in range(1, 4)], float(step))
            if rng.random() < 0.5:
                d.core.branch_end(b, float(step))


def check_wire(wire: list[m.CountUpdates], lost: Collection[tuple[str, int]] = ()) -> dict[str, CountStream]:
    """Every beacon after the numbered message it names (unless that one's publication failed:
    ``lost``); returns each node's stream fed the wire."""
    seen: dict[str, int] = {}
    streams: dict[str, CountStream] = {}
    for msg in wire:
        if msg.beacon:
            ok = msg.seq <= seen.get(msg.node, 0) or (msg.node, msg.seq) in lost
            assert msg.seq > 0 and not msg.hashes and ok, f"beacon {msg.node}:{msg.seq} before its message"
        else:
            seen[msg.node] = max(seen.get(msg.node, 0), msg.seq)
        streams.setdefault(msg.node, CountStream()).offer(msg)
    return streams


async def test_beacons_racing_flushes_never_overtake_a_message():
    for seed in range(20):
        d, bus = directory(seed)
        rng = random.Random(seed)
        for step in range(40):
            traffic(d, rng, step)
            await asyncio.gather(d.flush_counts(), d.send_count_beacons(), d.flush_counts(), d.send_count_beacons())
        await d.send_count_beacons()
        streams = check_wire(bus.wire)
        assert sum(msg.beacon for msg in bus.wire) > 40 and set(streams) == set(NODES)
        for node, s in streams.items():
            assert s.counters["gap"] == 0 and not s.syncing, (seed, node, dict(s.counters))
            assert s.last == d.core.count_snapshot(node)[2]  # the last beacon named the last message
        assert d.counters["counts.beacons"] == sum(msg.beacon for msg in bus.wire) and not d.counters["counts.beacon_errors"]


async def test_a_message_that_failed_to_publish_is_named_by_the_next_beacon():
    """A publication that fails loses the message like NATS would; it was numbered, so the beacon
    carries its number and the worker's stream sees the gap."""
    d, bus = directory()
    d.core.branch_start("a", 0.0)
    d.core.place("a", "w0", "prefill", [1, 2, 3], 0.0)
    await d.flush_counts()  # message 1
    bus.fail.add(("w0", 2))
    d.core.branch_end("a", 1.0)
    try:
        await d.flush_counts()  # message 2: lost
    except BusUnavailable:
        pass
    s = check_wire(bus.wire)["w0"]
    assert s.last == 1 and not s.syncing  # nothing after it shows the loss
    assert await d.send_count_beacons() == 1
    s = check_wire(bus.wire, bus.fail)["w0"]
    assert s.syncing and s.counters["gap.beacon"] == 1
    assert bus.wire[-1] == m.CountUpdates(node="w0", seq=2, epoch=d.count_epoch, beacon=True)


async def test_only_nodes_sent_counts_get_beacons_and_a_failed_beacon_is_counted():
    d, bus = directory()
    await d._on_state(m.NodeState(node="w9"), "node.state.w9")  # the epoch announcement only (seq 0)
    assert await d.send_count_beacons() == 0 and [x.seq for x in bus.wire] == [0]
    d.core.branch_start("a", 0.0)
    d.core.place("a", "w0", "prefill", [1], 0.0)
    await d.flush_counts()
    bus.fail_beacons = True
    assert await d.send_count_beacons() == 0 and d.counters["counts.beacon_errors"] == 1
    bus.fail_beacons = False
    assert await d.send_count_beacons() == 1 and d.counters["counts.beacons"] == 1
    prom = {f.name: f.samples[0].value for f in directory_families(d) if f.name.startswith("ei_kvdirectory_count_beacon")}
    assert prom == {"ei_kvdirectory_count_beacons": 1.0, "ei_kvdirectory_count_beacon_errors": 1.0}


async def test_the_service_beacons_every_period_and_zero_disables_it():
    d, bus = directory(count_seq_beacon_s=0.01)
    await d.start()
    try:
        d.core.branch_start("a", 0.0)
        d.core.place("a", "w0", "prefill", [1], 0.0)
        await d.flush_counts()
        for _ in range(300):
            if d.counters["counts.beacons"] >= 3:
                break
            await asyncio.sleep(0.01)
    finally:
        await d.stop()
    assert d.counters["counts.beacons"] >= 3 and {(x.seq, x.beacon) for x in bus.wire} == {(1, False), (1, True)}
    off, _ = directory(count_seq_beacon_s=0)
    await off.start()
    try:
        assert "kvdirectory-count-beacon" not in off._bg.names()
        assert "kvdirectory-count-beacon" in d._bg.names()
    finally:
        await off.stop()


async def test_a_node_id_back_after_its_slot_was_taken_over_gets_a_new_count_epoch():
    """w0 is forgotten, w1 takes its slot over, w0 comes back: the directory has no counts of w0
    any more and numbers its messages from 1 again; a new epoch makes w0's worker reset the counts
    it holds and apply them (with the old epoch, message 1 was dropped as older than its last)."""
    d, bus = directory()
    for i in range(3):  # w0's worker holds counts up to message 3
        d.core.branch_start(f"a{i}", 0.0)
        d.core.place(f"a{i}", "w0", "prefill", [1, 2, 3 + i], 0.0)
        await d.flush_counts()
    w0 = check_wire(bus.wire)["w0"]
    assert w0.last == 3 and w0.epoch == d.count_epoch == d.node_epoch("w0")
    d.core.forget_node("w0")
    d.core.place("b", "w1", "prefill", [7], 1.0)  # a new node takes the slot over
    d._drop_reclaimed()
    assert d.node_epoch("w1") == f"{d.count_epoch}.1" and d.core.names == ["w1"]
    d.core.place("c", "w0", "prefill", [1, 2], 2.0)  # w0 heard of again: a new node
    await d.flush_counts()
    [msg] = [x for x in bus.wire if x.node == "w0" and x.epoch != d.count_epoch]
    assert msg.seq == 1 and msg.epoch == d.node_epoch("w0") == f"{d.count_epoch}.1"
    assert w0.offer(msg) == (True, "apply")  # reset, then applied
    await d.send_count_beacons()
    assert {x.node: x.epoch for x in bus.wire if x.beacon} == {"w0": d.node_epoch("w0"), "w1": d.node_epoch("w1")}


class _SlowResyncBus(FakeBus):
    """A fake bus whose ``kv.resync`` requests wait until cancelled (a resync in flight)."""

    async def request(self, subject: Any, msg: Any, **kw: Any) -> Any:
        await asyncio.Event().wait()


def _kv(node: str, seq: int) -> m.KvEventBatch:
    return m.KvEventBatch(node=node, seq=seq, events=[m.BlockStored(block_hashes=[seq], tier="gpu", block_size=4)])


async def test_a_node_id_back_right_after_its_slot_was_taken_keeps_its_new_state_and_learns_its_new_epoch():
    """w0 forgotten, w1 takes its slot, w0 heard again before the next liveness round: the round
    must not drop what the shell now keeps of the new w0 (before: its resync in flight was
    cancelled and its liveness entry dropped, so an idle w0 was never resynced), and w0's next
    state announces its new epoch (before: w0 was still marked told, so its worker kept the old
    registration's counts until a count of the new one changed)."""
    mono = [100.0]
    bus = _SlowResyncBus()
    d = DirectoryService(DirectoryConfig(block_size=4), bus, SimClock(mono=lambda: mono[0]))  # type: ignore[arg-type]
    await d._on_state(m.NodeState(node="w0"), "")
    await d._on_kv(_kv("w0", 1), "")
    mono[0] += 1000.0
    assert d.liveness.forget(mono[0], 300.0) == ["w0"]
    d._forget("w0")
    await d._on_kv(_kv("w1", 1), "")  # takes w0's slot over
    await d._on_kv(_kv("w0", 5), "")  # w0 back: a new node, first contact past seq 1: resync
    await d._on_state(m.NodeState(node="w0"), "")
    task = d._resyncs["w0"]
    assert d.node_epoch("w0") == f"{d.count_epoch}.1"
    assert [x.epoch for x in bus.wire if x.node == "w0"] == [d.count_epoch, d.node_epoch("w0")]
    d._drop_reclaimed()  # what the next liveness round runs
    await asyncio.sleep(0)
    assert not task.cancelled() and d._resyncs.get("w0") is task
    assert [r[0] for r in d.liveness.report(mono[0])] == ["w0", "w1"]
    task.cancel()


async def test_a_node_first_heard_on_node_state_after_a_take_over_gets_one_epoch_only():
    """After a slot was taken over, a new node's count epoch is only known once the core has
    registered it: announcing the plain epoch on its first state (before its first KV batch) made
    its worker take its first count message for a directory restart (a reset, a 'kv directory
    restarted' log line and a directory_restarts count on every new pod)."""
    d, bus = directory()
    await d._on_kv(_kv("w0", 1), "")
    d.core.forget_node("w0")
    await d._on_kv(_kv("w1", 1), "")  # takes w0's slot over
    await d._on_state(m.NodeState(node="w2"), "")  # a new pod: its state before its KV events
    await d._on_kv(_kv("w2", 1), "")
    await d._on_state(m.NodeState(node="w2"), "")
    d.core.branch_start("a", 0.0)
    d.core.place("a", "w2", "prefill", [1], 0.0)
    await d.flush_counts()
    s = check_wire(bus.wire)["w2"]
    assert s.counters["directory_restarts"] == 0 and s.epoch == d.node_epoch("w2") == f"{d.count_epoch}.1"
    assert s.last == 1 and not s.syncing


async def test_a_node_never_indexed_and_forgotten_leaves_no_marks_behind():
    """A node id heard only on node.state (a pod that died before its first KV event) and then
    silent past --forget-node-after-s holds nothing in the core, so no other node ever takes its
    slot over; its liveness entry and its epoch mark must go when it is forgotten (before they
    stayed for good: with such ids new at each restart, the marks reached --max-nodes and no node
    was told the epoch any more)."""
    mono = [0.0]
    bus = FakeBus()
    d = DirectoryService(DirectoryConfig(block_size=4, max_nodes=2), bus, SimClock(mono=lambda: mono[0]))  # type: ignore[arg-type]
    for i in range(3):
        await d._on_state(m.NodeState(node=f"p{i}"), "")
        mono[0] += 1000.0
        for node in d.liveness.forget(mono[0], 300.0):
            d._forget(node)
    assert len(d.liveness) == 0
    assert [x.node for x in bus.wire] == ["p0", "p1", "p2"]  # each new pod told the epoch


async def test_a_forgotten_node_holding_its_slot_is_revived_by_nothing_while_max_nodes_are_live():
    """--max-nodes limits live nodes and a forgotten node is not one: at the limit its KV events
    were dropped (kv.nodes_over_limit) but its node.state revived it in the slot it still held,
    with no limit check (limit + 1 live nodes). Now its state, like its KV events, leaves it
    forgotten until a node is forgotten; its next state then revives it and asks for its KV."""
    mono = [0.0]
    bus = _SlowResyncBus()
    bus.droplog = RateLimitedLog(structlog.get_logger("bus"), first=5, interval_s=10.0)  # type: ignore[attr-defined]
    d = DirectoryService(DirectoryConfig(block_size=4, max_nodes=2), bus, SimClock(mono=lambda: mono[0]))  # type: ignore[arg-type]
    await d._on_kv(_kv("w0", 1), "")
    await d._on_kv(_kv("w1", 1), "")
    d.core.place("b", "w2", "prefill", [9], 0.0)  # a placement's word registers w2 (3 slots, all live)
    mono[0] += 1000.0
    await d._on_state(m.NodeState(node="w1"), "")
    assert d.liveness.forget(mono[0], 300.0) == ["w0"]
    d._forget("w0")
    assert d.core.live_nodes() == 2 and d.core.is_forgotten("w0")
    await d._on_kv(_kv("w0", 2), "")
    assert d.counters["kv.nodes_over_limit"] == 1
    await d._on_state(m.NodeState(node="w0"), "")
    assert d.core.live_nodes() == 2 and d.core.is_forgotten("w0") and "w0" not in d._resyncs
    assert d.counters["nodes.over_limit_not_revived"] == 1
    d.core.forget_node("w2")  # a slot frees
    await d._on_state(m.NodeState(node="w0"), "")
    assert d.core.is_live("w0") and d.core.live_nodes() == 2 and d.counters["nodes.over_limit_not_revived"] == 1
    task = d._resyncs["w0"]  # its KV was dropped when it was forgotten: asked for again
    await asyncio.sleep(0)
    assert not task.done()
    task.cancel()


async def test_placements_and_phase_changes_naming_new_nodes_past_max_nodes_are_dropped():
    """--max-nodes guards the directory against unbounded node ids, but a route.placed or a
    split.applied naming an unknown node registered it with no check: a stream of invented ids in
    placements grew the directory past the limit. Now, at the limit, they are counted and dropped
    like KV batches; a known node's placement, and any placement below the limit, is unchanged."""
    d, bus = directory(max_nodes=2)
    bus.droplog = RateLimitedLog(structlog.get_logger("bus"), first=5, interval_s=10.0)  # type: ignore[attr-defined]
    d.core.branch_start("a", 0.0)
    await d._on_placed(m.RoutePlaced(rid="r0", branch_id="a", node="w0", phase="prefill", block_hashes=[1]), "")
    await d._on_kv(_kv("w1", 1), "")
    assert d.core.live_nodes() == 2 and not d.counters["placed.nodes_over_limit"]  # below the limit: registered
    for i in range(5):
        await d._on_placed(m.RoutePlaced(rid=f"r{i}", branch_id="a", node=f"x{i}", phase="prefill", block_hashes=[1]), "")
    await d._on_split(m.SplitApplied(epoch=1, node="y", phase="decode", status="serving"), "")
    assert d.core.live_nodes() == 2 and len(d.core.names) == 2
    assert not any(d.core.has_node(n) for n in ("x0", "x4", "y"))
    assert d.counters["placed.nodes_over_limit"] == 5 and d.counters["split.nodes_over_limit"] == 1
    await d._on_placed(m.RoutePlaced(rid="r9", branch_id="a", node="w1", phase="prefill", block_hashes=[1]), "")
    await d._on_split(m.SplitApplied(epoch=1, node="w0", phase="decode", status="serving"), "")
    assert d.core.node_phase("w1") == "prefill" and d.core.node_phase("w0") == "decode"  # known nodes: as before
    assert d.counters["placed.nodes_over_limit"] == 5 and d.counters["split.nodes_over_limit"] == 1
