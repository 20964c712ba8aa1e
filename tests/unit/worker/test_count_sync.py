"""A worker that lost ``kv.counts`` messages gets its branch counts back (``kv.countsync``).

``CountStream`` (``services/worker/countseq.py``) is the sequence check: which message to apply,
drop or keep, when a sync starts and what to apply after its snapshot. The last tests drive the
real directory core and two real L2 pools: one gets every message, the other loses some and is
synced as the worker shell does it (``reset_counts``, then the snapshot, then the kept messages):
every L2 page ends in the same group (count 0 vs > 0); only the order inside a group differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from types import SimpleNamespace

import msgspec
import pytest
import structlog

from services.kvdirectory.core import KvDirectory
from services.worker.blocks import KvBlockManager
from services.worker.countseq import SNAPSHOT_MAX_ENTRIES, CountStream
from shared.messages import CountUpdates, Msg, NonNeg
from tests.unit.worker.test_count_message_cut import compute, order


def cu(seq: int, epoch: str = "e1", hashes: list[int] | None = None, counts: list[int] | None = None) -> CountUpdates:
    hashes = [seq] if hashes is None else hashes
    return CountUpdates(node="w0", seq=seq, epoch=epoch, hashes=hashes, counts=[1] * len(hashes) if counts is None else counts)


def test_in_order_messages_apply_and_old_ones_are_dropped():
    s = CountStream()
    assert s.offer(cu(1)) == (False, "apply") and s.offer(cu(2)) == (False, "apply")
    assert s.offer(cu(2)) == (False, "stale") and s.offer(cu(1)) == (False, "stale")
    assert s.offer(CountUpdates(node="w0", epoch="e1")) == (False, "apply")  # seq 0: the epoch announcement
    assert (s.last, s.syncing, s.counters["stale"], s.counters["gap"]) == (2, False, 2, 0)


def test_a_gap_keeps_messages_until_the_snapshot_then_applies_those_after_it():
    s = CountStream()
    s.offer(cu(1))
    assert s.offer(cu(3)) == (False, "apply") and s.syncing and s.reason == "gap" and s.counters["gap"] == 1
    gen = s.asking()  # the first request goes out: the directory has made 3 messages at least
    assert s.offer(cu(4)) == (False, "apply") and s.offer(cu(5)) == (False, "apply") and s.offer(cu(4)) == (False, "stale")
    after = s.snapshot("e1", 4, gen)  # the snapshot covers message 4 (taken after it was made)
    assert [m.seq for m in after] == [5] and s.last == 5 and not s.syncing and not s.kept
    assert s.counters["sync.kept_before_snapshot"] == 2 and s.counters["syncs"] == 1
    assert s.offer(cu(6)) == (False, "apply")


def test_a_hole_after_the_snapshot_keeps_the_sync_going():
    s = CountStream()
    s.offer(cu(1))
    s.offer(cu(3))
    gen = s.asking()
    s.offer(cu(6))  # 4 and 5 were made after the snapshot; 4 is lost too
    s.offer(cu(5))
    # past the hole: applied early, so applied again after the reset (and kept for the next snapshot)
    assert [m.seq for m in s.snapshot("e1", 3, gen)] == [5, 6] and s.syncing and sorted(s.kept) == [5, 6]
    assert s.counters["sync.hole_after"] == 1
    gen = s.asking()
    assert [m.seq for m in s.snapshot("e1", 6, gen)] == [] and not s.syncing and s.last == 6


def test_a_forged_jump_costs_one_sync_not_a_loop():
    """A message numbered past what the directory had made when it took its snapshot cannot be
    the directory's: it is dropped, and the directory's own message with that number applies."""
    s = CountStream()
    s.offer(cu(1))
    s.offer(cu(10**9, hashes=[7], counts=[5]))
    gen = s.asking()
    assert s.snapshot("e1", 1, gen) == [] and not s.syncing and s.counters["sync.beyond_snapshot"] == 1
    assert s.offer(cu(2)) == (False, "apply")


def test_a_new_epoch_resets_and_abandons_the_old_processes_sync():
    s = CountStream()
    assert s.offer(cu(1, "e1")) == (False, "apply")  # the first epoch: nothing to reset
    s.offer(cu(3, "e1"))
    gen = s.asking()
    assert s.offer(cu(1, "e2")) == (True, "apply") and not s.syncing and s.counters["sync.abandoned"] == 1
    assert s.snapshot("e1", 3, gen) is None and s.counters["sync.superseded"] == 1  # the dead process's reply
    assert s.offer(cu(3, "e3")) == (True, "apply") and s.syncing and s.counters["gap.new_epoch"] == 1
    assert s.counters["directory_restarts"] == 2


def test_first_contact_past_seq_1_is_a_gap():
    s = CountStream()
    assert s.offer(cu(7)) == (False, "apply") and s.syncing and s.reason == "first contact"
    assert [m.seq for m in s.snapshot("e1", 6, s.asking())] == [] and s.last == 6 and not s.syncing
    # 7 arrived before the request: the directory had made it, so its snapshot (6) is stale
    assert s.counters["sync.beyond_snapshot"] == 1


def test_a_snapshot_older_than_the_counts_held_is_adopted_not_asked_for_again():
    """The directory takes its snapshot after every message it numbered, so one below ``last``
    means a message was forged in sequence (here 3): the snapshot is adopted. Refused and asked
    again (before), it came back the same for as long as the directory sent the node nothing: a
    snapshot every ``--count-sync-min-interval-s`` for good on an idle node."""
    s = CountStream()
    for q in (1, 2, 3):  # 3 forged: the directory is at 2
        s.offer(cu(q))
    assert s.start_sync("reconnect") and not s.start_sync("reconnect")
    gen = s.asking()
    assert s.snapshot("e1", 2, gen) == [] and not s.syncing and s.last == 2 and s.counters["sync.behind"] == 1
    assert s.offer(cu(3)) == (False, "apply")  # the directory's own 3 applies
    assert s.counters["syncs"] == 1 and s.counters["sync.started.reconnect"] == 1


def test_a_forged_in_sequence_message_and_a_forged_beacon_cost_one_snapshot_not_a_loop():
    s = CountStream()
    s.offer(cu(1))
    s.offer(cu(2))
    s.offer(cu(3))  # forged, in sequence: the directory's 3 will be dropped as a duplicate
    assert s.offer(beacon(10**9)) == (False, "beacon") and s.syncing
    asks = 0
    while s.syncing and asks < 5:
        asks += 1
        gen = s.asking()
        assert s.first_piece("e1", 2, gen)
        s.snapshot("e1", 2, gen)  # the idle directory's: still at 2
    assert (asks, s.syncing, s.last) == (1, False, 2)


def beacon(seq: int, epoch: str = "e1") -> CountUpdates:
    return CountUpdates(node="w0", seq=seq, epoch=epoch, beacon=True)


def test_a_beacon_at_or_below_last_is_fine_and_one_past_it_syncs():
    s = CountStream()
    s.offer(cu(1))
    s.offer(cu(2))
    assert s.offer(beacon(2)) == (False, "beacon") and s.offer(beacon(1)) == (False, "beacon")  # 1: read before 2 went out
    assert (s.syncing, s.last, s.counters["stale"], s.counters["gap"], s.counters["beacon"]) == (False, 2, 0, 0, 2)
    # the directory published 3 and nothing after it: only the beacon shows it lost
    assert s.offer(beacon(3)) == (False, "beacon") and s.syncing and s.reason == "beacon" and s.last == 2
    assert s.counters["gap"] == 1 and s.counters["gap.beacon"] == 1 and s.counters["sync.started.beacon"] == 1 and not s.kept
    assert s.offer(beacon(3)) == (False, "beacon") and s.counters["gap"] == 1  # while syncing: ignored, not kept
    assert s.snapshot("e1", 3, s.asking()) == [] and not s.syncing and s.last == 3
    assert s.offer(cu(4)) == (False, "apply")


def test_a_beacon_is_never_taken_for_the_message_with_its_number():
    s = CountStream()
    s.offer(cu(1))
    s.offer(beacon(3))  # 2 and 3 lost
    gen = s.asking()
    assert s.offer(cu(3)) == (False, "apply") and sorted(s.kept) == [3]  # the real 3 (a late copy) is kept, not "stale"
    assert [m.seq for m in s.snapshot("e1", 2, gen)] == [3] and s.last == 3 and not s.syncing


def test_a_beacon_of_a_new_epoch_means_every_message_up_to_it_was_missed():
    s = CountStream()
    assert s.offer(beacon(1)) == (False, "beacon") and s.syncing and s.reason == "first contact" and s.last == 0
    assert s.counters["gap.first_contact"] == 1
    s.snapshot("e1", 1, s.asking())
    gen = s.asking()
    assert s.offer(beacon(4, "e2")) == (True, "beacon") and s.syncing and s.reason == "new epoch" and s.gen == gen
    assert s.counters["directory_restarts"] == 1 and s.counters["gap.new_epoch"] == 1 and s.epoch == "e2"
    # a beacon with seq 0 says no more than the epoch announcement
    t = CountStream()
    assert t.offer(beacon(0)) == (False, "apply") and t.offer(beacon(0)) == (False, "apply") and not t.syncing
    assert t.counters["unsequenced"] == 1 and t.counters["beacon"] == 0


class OldCountUpdates(Msg, frozen=True, kw_only=True):
    """``CountUpdates`` as it was before the ``beacon`` field."""

    node: str
    seq: NonNeg = 0
    hashes: list[int] = []
    counts: list[NonNeg] = []
    epoch: str = ""


def test_a_beacon_decodes_for_a_worker_that_predates_it_and_an_old_message_is_no_beacon():
    """msgspec ignores fields it does not know and defaults the ones it misses: the pairing of an
    old worker with a new directory, or the reverse, decodes every message (``CountUpdates.beacon``)."""
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(beacon(5)), type=OldCountUpdates)
    assert (old.seq, old.hashes, old.epoch) == (5, [], "e1")
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(OldCountUpdates(node="w0", seq=5, epoch="e1")), type=CountUpdates)
    assert new.beacon is False and CountStream().offer(new) == (False, "apply")  # a numbered (empty) message


def test_the_buffer_is_bounded_in_block_counts_not_messages():
    """The kept messages are capped by the block counts they carry (an empty one counting one):
    three messages of 400 entries each fill a 1,000-entry buffer, which a cap of 4,096 messages
    would have let grow 4,096-fold. Past the cap the oldest go first (each counted; a dropped one
    leaves a hole, so the sync goes on after the snapshot); the newest is kept even alone past it."""
    s = CountStream(buffer_entries=1000)
    s.offer(cu(1))
    s.offer(cu(3, hashes=list(range(400))))  # the gap
    gen = s.asking()
    for q in range(4, 7):
        s.offer(cu(q, hashes=list(range(1000 * q, 1000 * q + 400))))
    assert sorted(s.kept) == [5, 6] and s.kept_entries == 800 and s.counters["sync.buffer_overflow"] == 2
    for q in range(7, 9):  # empty messages count one entry each
        s.offer(cu(q, hashes=[]))
    assert sorted(s.kept) == [5, 6, 7, 8] and s.kept_entries == 802
    s.offer(cu(9, hashes=list(range(1500))))  # one message past the cap alone: kept, the older ones dropped
    assert sorted(s.kept) == [9] and s.kept_entries == 1500 and s.counters["sync.buffer_overflow"] == 6
    assert [m.seq for m in s.snapshot("e1", 6, gen)] == [9] and s.syncing  # 7, 8 dropped: a hole, sync again
    assert s.kept_entries == 1500 and s.counters["sync.hole_after"] == 1
    assert s.snapshot("e1", 9, s.asking()) == [] and not s.syncing and s.last == 9 and s.kept_entries == 0
    for bad in ({"buffer_entries": 0}, {"retired_max": 0}, {"max_entries": 0}):
        with pytest.raises(ValueError):
            CountStream(**bad)


def test_kept_entries_follow_the_kept_messages():
    rng = random.Random(5)
    s = CountStream(buffer_entries=50)
    last = 0
    for _ in range(2000):
        last += rng.choice((1, 1, 1, 2, 3))
        s.offer(cu(last if rng.random() < 0.9 else max(1, last - 2), hashes=list(range(rng.randrange(12)))))
        if s.syncing and rng.random() < 0.1:
            s.snapshot("e1", max(0, last - rng.randrange(4)), s.asking())
        assert s.kept_entries == sum(max(1, len(m.hashes)) for m in s.kept.values())
        assert s.kept_entries <= 50 or len(s.kept) == 1


# --------------------------------------------------------------------------- #
# a snapshot too large to fetch; late messages of an epoch that is over
# --------------------------------------------------------------------------- #


def test_a_snapshot_too_large_to_fetch_ends_the_sync_once_and_its_epoch_syncs_no_more():
    """A node's counts past ``SNAPSHOT_MAX_ENTRIES`` (2^30; more than 2^23, the old edge bound,
    fits): the sync ends unfetched, counted; later gaps, beacons and reconnects of that epoch
    start none (the numbering goes on, the counts apply as without the sync); a new epoch syncs."""
    s = CountStream()
    s.offer(cu(1))
    s.offer(cu(3))
    gen = s.asking()
    s.offer(cu(5))
    s.offer(cu(4))  # after 5: only kept
    # a 2 TB host pool at 64-token blocks of a 12 KB/token model: ~2.5 M blocks; 2^23 + 1 and the bound itself fit
    for total in (2_500_000, 2**23 + 1, SNAPSHOT_MAX_ENTRIES):
        assert s.first_piece("e1", total, gen) and s.syncing
    assert not s.first_piece("e1", SNAPSHOT_MAX_ENTRIES + 1, gen)
    assert not s.syncing and s.counters["sync.too_large"] == 1 and s.unsynced == "e1"
    assert s.last == 5 and not s.kept and s.kept_entries == 0 and s.kept_top == 0
    assert s.snapshot("e1", 5, gen) is None  # a reply to that sync no longer applies
    assert s.offer(cu(6)) == (False, "apply") and s.offer(cu(8)) == (False, "apply") and not s.syncing and s.last == 8
    assert s.offer(cu(7)) == (False, "stale")
    assert s.offer(beacon(10)) == (False, "beacon") and not s.syncing and s.last == 10
    assert not s.start_sync("reconnect") and s.counters["sync.unsynced"] == 3 and s.counters["gap"] == 3
    assert s.offer(cu(11)) == (False, "apply")
    # the directory restarted: its counts may fit, so a gap of the new epoch syncs
    assert s.offer(cu(3, "e2")) == (True, "apply") and s.syncing and s.counters["sync.too_large"] == 1
    # a too-large snapshot of a new epoch marks that epoch (the old one's counts are dropped on its first message)
    t = CountStream(max_entries=10)
    t.offer(cu(1))
    t.offer(cu(3))
    assert not t.first_piece("e2", 11, t.asking()) and not t.syncing and t.unsynced == "e2" and t.epoch == "e1"
    assert t.offer(cu(4, "e2")) == (True, "apply") and not t.syncing and t.last == 4 and t.counters["sync.unsynced"] == 1


def test_late_messages_beacons_and_snapshots_of_a_retired_epoch_are_dropped():
    """The directory restarted (e1 → e2): a message, beacon or snapshot of e1 arriving late must
    not be taken for another restart (a reset of every count and a sync)."""
    s = CountStream()
    for q in (1, 2):
        s.offer(cu(q, "e1"))
    assert s.offer(cu(1, "e2")) == (True, "apply") and list(s.retired) == ["e1"] and s.claimed
    # e2 came by a message only (it may be forged): the first late one of e1 starts one sync
    assert s.offer(cu(3, "e1")) == (False, "stale") and s.syncing and s.reason == "retired epoch"
    assert s.offer(beacon(7, "e1")) == (False, "stale")
    assert s.offer(CountUpdates(node="w0", epoch="e1")) == (False, "stale")  # its epoch announcement too
    assert (s.epoch, s.last, s.counters["stale_epoch"], s.counters["directory_restarts"]) == ("e2", 1, 3, 1)
    assert s.counters["sync.started"] == 1
    assert s.snapshot("e2", 1, s.asking()) == [] and not s.syncing and not s.claimed  # e2 is the live one
    assert s.offer(cu(4, "e1")) == (False, "stale") and not s.syncing  # from now on dropped at no further cost
    assert s.offer(cu(2, "e2")) == (False, "apply")
    s.offer(cu(4, "e2"))  # a gap in e2
    assert s.snapshot("e2", 4, s.asking()) == [] and not s.syncing and s.last == 4
    assert s.counters["stale_epoch"] == 4 and not s.restored and s.counters["sync.started"] == 2
    # a genuinely new epoch is adopted as ever; an epoch the worker never held (it came after) cannot be told old
    assert s.offer(cu(1, "e3")) == (True, "apply") and list(s.retired) == ["e1", "e2"]
    # a snapshot of a new process adopts it, retiring the one held
    s.offer(cu(3, "e3"))
    assert s.snapshot("e4", 2, s.asking()) == [] and s.epoch == "e4" and list(s.retired) == ["e1", "e2", "e3"]
    assert s.offer(cu(5, "e3")) == (False, "stale") and s.counters["directory_restarts"] == 2 and not s.syncing


def test_one_forged_epoch_message_does_not_cut_the_worker_off_from_the_directory():
    """A forged ``kv.counts`` message of a new epoch is adopted (a message's epoch is only a claim)
    and retires the real one; the sync it starts is answered by the live directory, whose snapshot
    of the real epoch is adopted (taken back from the retired ones): its messages apply again.
    (Before: the snapshot was dropped as of a retired epoch, asked again for good, and every real
    message dropped.)"""
    s = CountStream()
    for q in (1, 2, 3):
        s.offer(cu(q, "real"))
    assert s.offer(cu(5, "forged-1")) == (True, "apply") and s.syncing and list(s.retired) == ["real"]
    assert s.offer(cu(4, "real")) == (False, "stale")  # the real directory's, while the sync runs
    gen = s.asking()
    assert s.first_piece("real", 4, gen)  # fetched, not refused
    assert s.snapshot("real", 4, gen) == [] and not s.syncing
    assert (s.epoch, s.last, list(s.retired), s.restored) == ("real", 4, ["forged-1"], True)
    assert s.offer(cu(5, "real")) == (False, "apply") and s.last == 5
    assert s.counters["sync.epoch_restored"] == 1 and s.counters["syncs"] == 1
    # the forged epoch repeated: dropped, and (the epoch held came back from retirement) checked with one sync
    assert s.offer(cu(9, "forged-1")) == (False, "stale") and s.syncing and s.reason == "retired epoch"
    assert s.offer(cu(10, "forged-1")) == (False, "stale") and s.counters["sync.started.retired_epoch"] == 1
    assert s.snapshot("real", 5, s.asking()) == [] and not s.syncing and s.epoch == "real"
    # a real restart adopted from a message ends that state; a late message of a retired epoch costs one sync,
    # whose snapshot (of the new epoch) settles it: later ones cost only their drop
    assert s.offer(cu(1, "real-2")) == (True, "apply") and not s.restored and list(s.retired) == ["forged-1", "real"]
    assert s.offer(cu(6, "real")) == (False, "stale") and s.syncing
    assert s.snapshot("real-2", 1, s.asking()) == [] and not s.syncing and s.epoch == "real-2"
    assert s.offer(cu(7, "real")) == (False, "stale") and not s.syncing


@pytest.mark.parametrize("seq", [0, 1])
def test_a_forged_new_epoch_at_seq_0_or_1_is_undone_by_the_directorys_next_message_or_beacon(seq):
    """A new epoch's announcement (``seq`` 0) or first message starts no sync; forged, it retired
    the real epoch with nothing to take it back: every real message and beacon after it was dropped
    (``stale_epoch``) for good. Now the first one of them starts a sync; its snapshot restores the
    real epoch."""
    s = CountStream()
    for q in (1, 2):
        s.offer(cu(q, "real"))
    assert s.offer(cu(seq, "forged")) == (True, "apply") and not s.syncing and s.epoch == "forged"
    assert s.offer(cu(3, "real")) == (False, "stale") and s.syncing and s.reason == "retired epoch"
    assert s.offer(beacon(3, "real")) == (False, "stale")
    gen = s.asking()
    assert s.first_piece("real", 3, gen) and s.snapshot("real", 3, gen) == [] and not s.syncing
    assert (s.epoch, s.last, list(s.retired), s.counters["sync.epoch_restored"]) == ("real", 3, ["forged"], 1)
    assert s.offer(cu(4, "real")) == (False, "apply")
    assert s.offer(beacon(4, "real")) == (False, "beacon") and not s.syncing


def test_a_snapshot_from_an_old_directory_still_answering_is_undone_by_its_successors():
    """Two directory processes up at once (the new one started before the old one stopped): the
    worker holds the new epoch, a sync is answered by the old process (adopted: the reply's
    responder is taken for the live one), which then stops. The new process's next message or
    beacon (its epoch now retired) starts a sync; its snapshot puts the worker back on it."""
    s = CountStream()
    s.offer(cu(1, "old"))
    s.offer(cu(1, "new"))
    s.offer(cu(3, "new"))  # a gap in the new epoch
    assert s.snapshot("old", 7, s.asking()) == [] and s.epoch == "old" and s.restored and list(s.retired) == ["new"]
    assert s.offer(beacon(3, "new")) == (False, "stale") and s.syncing  # the old one stopped: the new one's beacon
    assert s.snapshot("new", 3, s.asking()) == [] and (s.epoch, s.last, list(s.retired)) == ("new", 3, ["old"])
    assert s.offer(cu(4, "new")) == (False, "apply") and s.counters["sync.epoch_restored"] == 2


def test_a_superseded_syncs_snapshot_is_discarded_even_of_a_retired_epoch():
    """A reply to a request sent before a new epoch arrived (:attr:`CountStream.gen`) is never
    adopted, retired epoch or not (replies to earlier requests never arrive: a fresh inbox each)."""
    s = CountStream()
    s.offer(cu(1, "e1"))
    s.offer(cu(3, "e1"))
    gen = s.asking()
    assert s.offer(cu(1, "e2")) == (True, "apply") and not s.syncing
    assert s.first_piece("e1", 1, gen) and s.snapshot("e1", 3, gen) is None and s.epoch == "e2" and list(s.retired) == ["e1"]
    s.offer(cu(3, "e2"))
    assert s.snapshot("e1", 3, gen) is None and s.syncing  # still the old generation's
    assert s.counters["sync.superseded"] == 2 and not s.restored


@pytest.mark.parametrize("seed", range(100))
def test_forged_messages_cost_at_most_one_snapshot_each_and_never_cut_the_worker_off(seed):
    """A real directory (epoch ``real``, every message delivered) and a forger sending random
    ``kv.counts`` messages and beacons (the real epoch or others, new or retired; ``seq`` 0, 1, in
    sequence, behind, ahead, huge), the shell's sync run at once after each message against the real
    directory's snapshot. Each sync takes one snapshot (no loop), all of them together at most one
    per forged message; after the forger stops, the directory's next message and beacon put the
    worker back on its epoch, and a reconnect's sync on its counts exactly."""
    rng = random.Random(seed)
    s = CountStream(retired_max=4)
    real, dir_counts, held = "real", {}, {}
    dir_seq = snaps = forged = 0

    def deliver(msg: CountUpdates) -> None:
        reset, action = s.offer(msg)
        if reset:
            held.clear()
        if action == "apply":
            held.update(zip(msg.hashes, msg.counts))
        run_sync()

    def run_sync() -> None:
        nonlocal snaps
        asks = 0
        while s.syncing:
            asks += 1
            assert asks == 1, (seed, dict(s.counters))
            snaps += 1
            gen = s.asking()
            assert s.first_piece(real, len(dir_counts), gen)
            after = s.snapshot(real, dir_seq, gen)
            if after is not None:
                held.clear()
                held.update(dir_counts)
                for msg in after:
                    held.update(zip(msg.hashes, msg.counts))

    def send_real(beacon_only: bool = False) -> None:
        nonlocal dir_seq
        if beacon_only:
            deliver(beacon(dir_seq, real))
            return
        dir_seq += 1
        h = rng.randrange(8)
        dir_counts[h] = rng.randrange(1, 5)
        deliver(cu(dir_seq, real, [h], [dir_counts[h]]))

    send_real()
    for _ in range(120):
        r = rng.random()
        if r < 0.45:
            send_real()
        elif r < 0.55:
            send_real(beacon_only=True)
        else:
            forged += 1
            epoch = rng.choice([real, real, "f1", "f2", f"f{rng.randrange(3, 1000)}"])
            seq = rng.choice([0, 1, s.last, s.last + 1, dir_seq + rng.randrange(1, 4), 10**9, rng.randrange(50)])
            if rng.random() < 0.2 and seq:
                deliver(beacon(seq, epoch))
            else:
                h = rng.randrange(8)
                deliver(cu(seq, epoch, [h], [rng.randrange(1, 5)]))
        assert snaps <= forged, (seed, snaps, forged, dict(s.counters))
    send_real()
    send_real(beacon_only=True)
    assert s.epoch == real and not s.syncing, (seed, s.epoch, dict(s.counters))
    assert s.start_sync("reconnect")
    run_sync()
    assert held == dir_counts and s.last == dir_seq and s.epoch == real


def test_the_retired_epochs_are_bounded():
    s = CountStream(retired_max=3)
    for i in range(6):
        s.offer(cu(1, f"e{i}"))
    assert list(s.retired) == ["e2", "e3", "e4"] and s.epoch == "e5"
    assert s.offer(cu(2, "e4")) == (False, "stale")
    assert s.offer(cu(2, "e1")) == (True, "apply")  # forgotten: taken for a restart, as before
    assert s.counters["directory_restarts"] == 6


# --------------------------------------------------------------------------- #
# the L2 pool after a sync, against one that lost nothing
# --------------------------------------------------------------------------- #

CHAINS = [[100 * c + i for i in range(1, 5)] for c in range(1, 6)]
"""Five 4-block paths (hash 100·c + i); each fills L1 (4 blocks), pushing the previous to L2."""


def pool() -> KvBlockManager:
    kv = KvBlockManager(4, 32, 4, "branch-count")
    for path in CHAINS:
        compute(kv, path)
    return kv


def groups(kv: KvBlockManager) -> dict[int, int]:
    """Group of every queued L2 page, and 1/0 for every pinned one (its count)."""
    g = dict(order(kv))
    counted = kv.host.counted
    for h in CHAINS[-1]:  # pinned in L1
        g[h] = int(h in counted)
    return g


def messages(seed: int) -> tuple[KvDirectory, list[CountUpdates]]:
    """Random branch traffic on node w0 over the chains' blocks, drained after every step."""
    rng = random.Random(seed)
    d = KvDirectory(4, branch_ttl_s=1e9)
    msgs: list[CountUpdates] = []
    live: list[str] = []
    for step in range(60):
        t = float(step)
        if live and rng.random() < 0.3:
            d.branch_end(live.pop(rng.randrange(len(live))), t)
        else:
            b = f"b{step}" if not live or rng.random() < 0.4 else rng.choice(live)
            if b not in live:
                d.branch_start(b, t)
                live.append(b)
            path = rng.choice(CHAINS)
            d.place(b, "w0", "prefill", path[: rng.randint(1, 4)], t)
        msgs.extend(x for x in d.take_count_updates() if x.node == "w0")
    return d, msgs


@pytest.mark.parametrize("seed", range(12))
def test_a_synced_pool_has_every_page_in_the_group_of_a_pool_that_lost_nothing(seed):
    d, msgs = messages(seed)
    assert len(msgs) > 10
    rng = random.Random(seed)
    lost = set(rng.sample(range(len(msgs) - 1), 6))  # never the last: the gap shows on it
    whole, synced = pool(), pool()
    s = CountStream()
    for i, msg in enumerate(msgs):
        whole.update_counts(msg.hashes, msg.counts)
        if i in lost:
            continue
        _reset, action = s.offer(msg)
        if action == "apply":
            synced.update_counts(msg.hashes, msg.counts)
    assert s.syncing and s.counters["gap"] >= 1
    gen = s.asking()
    hashes, counts, seq = d.count_snapshot("w0")
    after = s.snapshot("", seq, gen)  # the epoch of these messages is "" (the core does not stamp it)
    assert after == [] and not s.syncing
    synced.reset_counts()
    synced.update_counts(hashes, counts)
    assert groups(synced) == groups(whole)
    l2 = set(groups(whole))
    assert synced.host.counted & l2 == whole.host.counted & l2
    synced.check([])
    # the order inside a group may differ (eviction stamps), never the split into groups
    assert sorted(order(synced)) == sorted(order(whole))


@pytest.mark.parametrize("seed", range(6))
def test_a_lost_last_message_is_shown_by_the_beacon_and_the_sync_matches_a_pool_that_lost_nothing(seed):
    """The last message lost and none after it: no numbered message shows the gap; the
    directory's beacon (the seq it reached, ``count_snapshot``'s) does."""
    d, msgs = messages(seed)
    whole, synced = pool(), pool()
    s = CountStream()
    for i, msg in enumerate(msgs):
        whole.update_counts(msg.hashes, msg.counts)
        if i < len(msgs) - 1 and s.offer(msg)[1] == "apply":
            synced.update_counts(msg.hashes, msg.counts)
    hashes, counts, seq = d.count_snapshot("w0")
    assert not s.syncing and s.last == seq - 1  # nothing seen wrong
    assert s.offer(CountUpdates(node="w0", seq=seq, beacon=True)) == (False, "beacon") and s.syncing
    assert s.snapshot("", seq, s.asking()) == [] and not s.syncing
    synced.reset_counts()
    synced.update_counts(hashes, counts)
    assert groups(synced) == groups(whole)
    assert s.offer(CountUpdates(node="w0", seq=seq, beacon=True)) == (False, "beacon") and s.counters["gap"] == 1


def test_without_the_sync_the_lost_messages_leave_pages_in_the_wrong_group():
    """The case above is not vacuous: without the sync, most seeds leave a page in the wrong group."""
    wrong = 0
    for seed in range(12):
        _d, msgs = messages(seed)
        lost = set(random.Random(seed).sample(range(len(msgs) - 1), 6))
        whole, stale = pool(), pool()
        for i, msg in enumerate(msgs):
            whole.update_counts(msg.hashes, msg.counts)
            if i not in lost:
                stale.update_counts(msg.hashes, msg.counts)
        wrong += groups(stale) != groups(whole)
    assert wrong >= 4


def test_while_a_sync_runs_later_messages_apply_at_once_and_an_older_one_is_only_kept():
    s = CountStream()
    s.offer(cu(1))
    assert s.offer(cu(3)) == (False, "apply") and s.syncing  # the gap: applied and kept
    gen = s.asking()
    assert s.offer(cu(5)) == (False, "apply") and s.offer(cu(4)) == (False, "kept")  # 4 after 5: its values are older
    assert s.offer(cu(5)) == (False, "stale") and sorted(s.kept) == [3, 4, 5] and s.counters["sync.applied_early"] == 2
    assert [m.seq for m in s.snapshot("e1", 3, gen)] == [4, 5] and not s.syncing and s.last == 5
    assert s.offer(cu(6)) == (False, "apply") and s.kept_top == 0


@pytest.mark.parametrize("seed", range(12))
def test_while_a_sync_cannot_complete_the_pool_is_as_if_there_were_no_sync(seed):
    """No directory answers ``kv.countsync`` (one that predates it, a permission missing): the
    counts must not freeze at the gap; every message received applies, as before the sync
    existed (only the lost ones' blocks stay stale)."""
    _d, msgs = messages(seed)
    lost = set(random.Random(seed).sample(range(len(msgs) - 1), 6))
    stale, synced = pool(), pool()
    s = CountStream()
    for i, msg in enumerate(msgs):
        if i in lost:
            continue
        stale.update_counts(msg.hashes, msg.counts)
        if s.offer(msg)[1] == "apply":
            synced.update_counts(msg.hashes, msg.counts)
    assert s.syncing and s.counters["sync.applied_early"] > 0
    assert order(synced) == order(stale) and synced.host.counted == stale.host.counted


# --------------------------------------------------------------------------- #
# the shell's rate limit: one wait per snapshot asked too soon, under the services' loop (uvloop)
# --------------------------------------------------------------------------- #


class _SyncShell:
    """What ``WorkerService._sync_counts`` touches: a stream in a sync, a fetch answering at once."""

    def __init__(self, interval: float, wait: float) -> None:
        self.counts = CountStream()
        self.counts.offer(cu(1))
        self.counts.offer(cu(3))  # 2 lost: a sync
        self.counters: Counter[str] = Counter()
        self.cfg = SimpleNamespace(count_sync_min_interval_s=interval, count_sync_backoff_max_s=1.0)
        self.interval, self.wait = interval, wait
        self._last_count_sync = -1e18
        self.asked: list[float] = []
        self.log = structlog.get_logger()
        self.core = SimpleNamespace(reset_counts=lambda: 0)

    async def _fetch_counts(self, gen: int) -> tuple[str, int, list[int], list[int]]:
        self.asked.append(time.monotonic())
        return "e1", 3, [3], [1]

    def _apply_counts(self, hashes: list[int], counts: list[int]) -> int:
        return 0

    def _fatal_on_error(self, where: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the core here cannot fail


@pytest.mark.parametrize("wait", [0.0003, 0.002, 0.05, 0.2])
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_rate_limited_sync_waits_once_and_really_waits(loop, wait):
    """A snapshot asked sooner than ``count_sync_min_interval_s`` after the last one waits once
    (``counts.sync.rate_limited`` 1) until the interval is over. uvloop rounds a sleep to whole ms,
    counted from its cached ms clock: the loop used to wake early and go round again without a
    real wait (``asyncio.sleep`` under 0.5 ms is no wait there), up to ~100 times in one wait (on
    main this test counted 18 to 48 under uvloop, 1 under asyncio; a fuzz run counted 71 on one
    worker). The fetch answers at once, so exactly one snapshot is asked, not before the interval."""
    from services.worker.service import WorkerService

    run = pytest.importorskip("uvloop").run if loop == "uvloop" else asyncio.run

    async def sync(shell: _SyncShell) -> float:
        """Runs the sync with the last snapshot asked ``wait`` short of the interval ago; returns when the next one is allowed."""
        shell._last_count_sync = time.monotonic() - shell.interval + shell.wait
        allowed = shell._last_count_sync + shell.interval
        await WorkerService._sync_counts(shell)  # type: ignore[arg-type]
        return allowed

    for _ in range(5):  # where the wait ends within the loop's millisecond differs from run to run
        shell = _SyncShell(1.0, wait)
        allowed = run(sync(shell))
        assert shell.counters["counts.sync.rate_limited"] == 1 and len(shell.asked) == 1 and shell.asked[0] >= allowed
        assert not shell.counts.syncing and shell.counts.counters["syncs"] == 1
