"""The directory's ``kv.countsync.<node>`` answers (``DirectoryService._on_count_sync``) to hostile
and stale requests, on the fake bus of ``test_count_beacon``: a piece of a snapshot that does not
exist, of another node, past its end or expired is refused with ``error`` (a reply the worker's
edge accepts: offset 0, no entries), at most one snapshot per node is kept, and a kept one is
dropped once ``--count-sync-ttl-s`` has passed even when no request follows (a worker that stopped
mid-fetch must not leave its node's counts copied in memory for good). A new snapshot of a node is
taken at most once per ``--count-sync-min-interval-s``: a request sooner is refused the same way
(it would make the directory copy the node's counts again), and counted."""

from __future__ import annotations

import asyncio
from typing import Any

from shared import messages as m
from shared.validate import check as validate_msg
from tests.unit.kvdirectory.test_count_beacon import directory


class _Nc:
    max_payload = 1 << 20


def serving(**cfg: Any):
    d, bus = directory(**cfg)
    bus.nc = _Nc()  # type: ignore[attr-defined]
    for i, node in enumerate(("w0", "w1")):
        d.core.branch_start(f"b{i}", 0.0)
        d.core.place(f"b{i}", node, "prefill", [100 * (i + 1) + k for k in range(7)], 0.0)
    return d, bus


async def ask(d, node: str, snapshot: str = "", offset: int = 0) -> m.CountSnapshot:
    reply = await d._on_count_sync(m.CountSyncRequest(node=node, snapshot=snapshot, offset=offset), f"kv.countsync.{node}")
    assert validate_msg(reply, None, None) is None  # what the worker's edge checks
    return reply


async def test_pieces_of_gone_snapshots_are_refused_and_one_snapshot_per_node_is_kept():
    d, _ = serving(count_sync_piece=3, count_sync_min_interval_s=0)  # 0: new snapshots not rate-limited
    first = await ask(d, "w0")
    assert (first.offset, first.total, len(first.hashes), first.error) == (0, 7, 3, None) and first.seq == 1
    other = await ask(d, "w1")
    assert set(d._count_snaps) == {"w0", "w1"}
    for snap, off, node in [("nope", 3, "w0"), (first.snapshot, 7, "w0"), (first.snapshot, 2**22, "w0"), (other.snapshot, 3, "w0"),
                            (first.snapshot, 3, "w1"), ("", 0, "w9")]:  # fmt: skip
        r = await ask(d, node, snap, off)
        if snap:
            assert r.error and (r.offset, r.total, r.hashes) == (0, 0, []), (snap, off, node)
        else:  # a node never heard of: an empty snapshot, nothing kept
            assert (r.error, r.total, r.seq) == (None, 0, 0) and "w9" not in d._count_snaps
    assert d.counters["countsync.snapshot_gone"] == 5
    again = await ask(d, "w0")  # a new snapshot of w0 replaces the kept one
    assert len(d._count_snaps) == 2 and (await ask(d, "w0", first.snapshot, 3)).error
    got = list(again.hashes)
    while len(got) < again.total:
        got += (await ask(d, "w0", again.snapshot, len(got))).hashes
    assert got == d.core.count_snapshot("w0")[0] and "w0" not in d._count_snaps  # the last piece frees it


async def test_a_kept_snapshot_expires_without_another_request():
    d, _ = serving(count_sync_piece=3, count_sync_ttl_s=0.02, counts_flush_s=0.01, count_seq_beacon_s=0)
    await d.start()
    try:
        await ask(d, "w0")  # a worker asks, then stops before its next piece
        assert "w0" in d._count_snaps
        for _ in range(100):
            if not d._count_snaps:
                break
            await asyncio.sleep(0.01)
        assert not d._count_snaps and d.counters["countsync.expired"] == 1
        assert d.stats()[1]["countsync.kept"] == 0
    finally:
        await d.stop()


async def test_new_snapshots_of_a_node_are_rate_limited():
    """Anyone may ask ``kv.countsync.<node>`` (no auth here): each new snapshot copies R[·, node],
    so one per ``--count-sync-min-interval-s`` per node; a request sooner is answered with
    ``error`` (the worker treats it as any refused reply: backs off and asks again), counted. The
    pieces of the kept snapshot and other nodes' snapshots are not limited."""
    d, _ = serving(count_sync_piece=3, count_sync_min_interval_s=0.2)
    first = await ask(d, "w0")
    for _ in range(5):
        refused = await ask(d, "w0")
        assert refused.error and "at most one new count snapshot" in refused.error
        assert (refused.offset, refused.total, refused.hashes, refused.snapshot) == (0, 0, [], "")
    assert d.counters["countsync.rate_limited"] == 5 and d.counters["countsync.snapshots"] == 1
    assert d._count_snaps["w0"].id == first.snapshot  # the kept snapshot was not replaced
    assert (await ask(d, "w0", first.snapshot, 3)).error is None and (await ask(d, "w1")).error is None
    await asyncio.sleep(0.25)
    again = await ask(d, "w0")
    assert again.error is None and again.total == 7 and d.counters["countsync.snapshots"] == 3
    assert d.counters["countsync.rate_limited"] == 5


async def test_the_rate_limit_marks_are_dropped_once_their_interval_passed():
    d, _ = serving(count_sync_min_interval_s=0.02, counts_flush_s=0.01, count_seq_beacon_s=0)
    await d.start()
    try:
        for i in range(50):  # nodes never heard of (no --nodes here): each leaves a mark
            await ask(d, f"x{i}")
        assert len(d._count_sync_last) == 50
        for _ in range(100):
            if not d._count_sync_last:
                break
            await asyncio.sleep(0.01)
        assert not d._count_sync_last
    finally:
        await d.stop()
