"""A PD hand-off's K/V in pieces (``services/worker/handoffkv.py``): the piece size under a server's ``max_payload``,
the cut, and the decode node's assembly (order, a piece sent again, a missing piece's timeout, bad pieces, the
buffer bound), each piece through msgpack as it travels; then the worker's shell on both sides of the hand-off
(``WorkerService._on_kv_chunk`` / ``_on_decode`` / ``_send_handoff``, the sim engine, a bus that records)."""

from __future__ import annotations

import asyncio
import os
import random
import re
import zlib

import msgspec
import pytest

from services.worker import handoffkv as hk
from shared import messages as m
from shared.validate import check

MIB = 1024 * 1024


def _wire(c: m.KvChunk) -> m.KvChunk:
    """``c`` as the decode node receives it (encoded, decoded: ``data`` is bytes)."""
    return msgspec.msgpack.decode(m.encode(c), type=m.KvChunk)


def _pieces(kv: bytes, size: int, transfer: str = "t1", rid: str = "r1") -> list[m.KvChunk]:
    return [_wire(c) for c in hk.split(kv, transfer=transfer, rid=rid, size=size)]


def test_piece_size_is_under_the_servers_max_payload_and_at_most_8_mib():
    assert hk.chunk_bytes(16 * MIB) == 8 * MIB  # up, compose, Slurm: the cap
    assert hk.chunk_bytes(MIB) == MIB - hk.ENVELOPE_BYTES  # nats-server's default
    assert hk.chunk_bytes(64 * 1024) == 64 * 1024 - hk.ENVELOPE_BYTES
    with pytest.raises(ValueError, match="max_payload of 9000 B"):
        hk.chunk_bytes(9000)
    # a piece and its envelope fit the payload the size was derived from, with a long rid and transfer id
    for payload in (20_000, 64 * 1024, MIB):
        size = hk.chunk_bytes(payload)
        c = next(hk.split(os.urandom(size * 2), transfer="w" * 64 + "-0123456789ab-99999999", rid="r" * 128, size=size))
        assert len(m.encode(msgspec.structs.replace(c, src="worker-" + "w" * 128))) <= payload - 1024


def test_split_cuts_views_with_their_crc_and_the_last_piece_the_rest():
    kv = os.urandom(10_000)
    raw = list(hk.split(kv, transfer="t1", rid="r1", size=3000))
    assert [(c.index, c.count, c.offset, len(c.data), c.total) for c in raw] == [
        (0, 4, 0, 3000, 10_000), (1, 4, 3000, 3000, 10_000), (2, 4, 6000, 3000, 10_000), (3, 4, 9000, 1000, 10_000)]
    assert all(isinstance(c.data, memoryview) for c in raw)  # no copy: the bus encodes each view once
    assert b"".join(bytes(c.data) for c in raw) == kv and all(c.crc32 == zlib.crc32(c.data) for c in raw)
    assert [len(c.data) for c in _pieces(kv, 20_000)] == [10_000]  # one piece when it fits
    assert all(check(c, {"node": "w1"}) is None for c in _pieces(kv, 3000))
    with pytest.raises(ValueError):
        next(hk.split(b"", transfer="t1", rid="r1", size=10))


@pytest.mark.parametrize("seed", range(5))
def test_pieces_in_any_order_and_some_twice_give_the_kv_once(seed):
    rng = random.Random(seed)
    kv = rng.randbytes(rng.randrange(1, 50_000))
    size = rng.choice((1024, 1500, 4096, 50_000))
    pieces = _pieces(kv, size)
    sent = pieces + rng.sample(pieces, k=min(3, len(pieces)))  # a resend after a lost answer, a reconnect
    rng.shuffle(sent)
    a = hk.KvAssembler(MIB, 10.0)
    assert all(a.add(c, 0.0) == "" for c in sent)
    assert a.counters["chunks"] == len(pieces) and a.counters["duplicate_chunks"] == len(sent) - len(pieces)
    assert a.held_bytes == len(kv)
    got = a.take("t1", "r1", len(pieces), len(kv))
    assert bytes(got) == kv and not got.readonly  # the engine reads its pages in place
    assert a.held_bytes == 0 and not a.open
    # the same work again (delivered twice): told apart from a lost K/V
    with pytest.raises(hk.KvMissing) as e:
        a.take("t1", "r1", len(pieces), len(kv))
    assert e.value.duplicate
    # a piece of it sent again after the take starts nothing
    assert "ended here already: taken" in a.add(pieces[0], 1.0) and not a.open


def test_a_missing_piece_fails_the_take_or_the_transfer_expires_and_late_pieces_are_refused():
    kv = os.urandom(5000)
    pieces = _pieces(kv, 2000)
    a = hk.KvAssembler(MIB, 10.0)
    for c in pieces[:2]:
        assert a.add(c, 0.0) == ""
    with pytest.raises(hk.KvMissing, match="2 of the 3 pieces"):
        a.take("t1", "r1", 3, 5000)
    assert a.held_bytes == 0 and a.counters["missing"] == 1
    # another transfer: no piece for idle_s, dropped (not before), and its late piece and work are refused naming why
    b = _pieces(kv, 2000, transfer="t2")
    assert a.add(b[0], 0.0) == "" and a.add(b[1], 4.0) == ""
    assert a.next_deadline() == 14.0 and a.expire(13.9) == []
    (gone,) = a.expire(14.0)
    assert (gone.transfer, gone.got, gone.count) == ("t2", 2, 3) and a.held_bytes == 0 and a.next_deadline() is None
    assert "dropped after 10 s" in a.add(b[2], 15.0)
    with pytest.raises(hk.KvMissing, match="dropped after 10 s") as e:
        a.take("t2", "r1", 3, 5000)
    assert not e.value.duplicate
    # complete, but its work never comes: dropped too
    c3 = _pieces(kv, 2000, transfer="t3")
    assert all(a.add(c, 20.0) == "" for c in c3)
    assert [x.transfer for x in a.expire(30.0)] == ["t3"]
    assert a.counters["expired"] == 2 and a.counters["expired_bytes"] == 4000 + 5000  # what they stored
    # never heard of (the decode node restarted meanwhile)
    with pytest.raises(hk.KvMissing, match="no piece of it came") as e:
        a.take("t9", "r1", 1, 10)
    assert e.value.unknown and not e.value.duplicate


def test_bad_pieces_are_refused_and_end_their_transfer():
    kv = os.urandom(6000)
    pieces = _pieces(kv, 2048)
    a = hk.KvAssembler(MIB, 10.0)
    assert a.add(pieces[0], 0.0) == ""
    bad = msgspec.structs.replace(pieces[1], total=7000)  # not the transfer's K/V
    assert "transfer t1 has 3 pieces, 6000 B" in a.add(bad, 0.0)
    assert a.counters["refused.mismatch"] == 1 and not a.open and a.held_bytes == 0
    assert "ended here already" in a.add(pieces[2], 0.0)
    # bytes changed on the way: the CRC-32 says so
    a = hk.KvAssembler(MIB, 10.0)
    flipped = msgspec.structs.replace(pieces[1], data=bytes([pieces[1].data[0] ^ 1]) + pieces[1].data[1:])
    assert "CRC-32" in a.add(flipped, 0.0) and a.counters["refused.crc"] == 1 and not a.open
    # shapes no transfer has: offset not index x size, a last piece short of the total, an index past the count,
    # pieces under the least piece size, piece 0 elsewhere than 0
    first = pieces[0]
    for why, c in (
        ("offset", msgspec.structs.replace(pieces[1], offset=2000)),
        ("ends at", msgspec.structs.replace(pieces[2], data=pieces[2].data[:-1], crc32=zlib.crc32(pieces[2].data[:-1]))),
        ("of a transfer of 3", msgspec.structs.replace(first, index=3)),
        ("under 1024 B", m.KvChunk(transfer="t5", rid="r1", index=0, count=6, offset=0, total=6000, crc32=zlib.crc32(kv[:1000]), data=kv[:1000])),
        ("piece 0 at offset", msgspec.structs.replace(first, offset=10, count=1, data=kv[10:], crc32=zlib.crc32(kv[10:]))),
    ):
        a = hk.KvAssembler(MIB, 10.0)
        assert why in a.add(c, 0.0), why
        assert not a.open and a.held_bytes == 0
    # a later piece of another size than the transfer's (its last one came first)
    a = hk.KvAssembler(MIB, 10.0)
    assert a.add(pieces[2], 0.0) == ""
    short = m.KvChunk(transfer="t1", rid="r1", index=0, count=3, offset=0, total=6000, crc32=zlib.crc32(kv[:2500]), data=kv[:2500])
    assert "not one of pieces of 2048 B" in a.add(short, 0.0)
    # a work that names other pieces than came
    a = hk.KvAssembler(MIB, 10.0)
    assert all(a.add(c, 0.0) == "" for c in pieces)
    with pytest.raises(hk.KvMissing, match="its work names 3 pieces, 6001 B"):
        a.take("t1", "r1", 3, 6001)
    assert not a.open


def test_the_buffer_bound_refuses_a_new_transfer_that_does_not_fit_beside_what_is_stored():
    a = hk.KvAssembler(10_000, 10.0)
    one, two = _pieces(os.urandom(6000), 2048, transfer="t1"), _pieces(os.urandom(6000), 2048, transfer="t2")
    assert a.add(one[0], 0.0) == "" and a.add(one[1], 0.0) == ""
    why = a.add(two[0], 0.0)  # t1 being sent: its 1904 B to come are kept room for
    assert why.startswith(hk.FULL_PREFIX) and "4096 B stored for 1 transfers (1904 B more to come of those being sent)" in why, why
    why = a.add(two[0], 2.0)  # t1 quiet since 0.0: it reserves nothing, what it stored still counts
    assert why.startswith(hk.FULL_PREFIX) and "4096 B stored for 1 transfers, a new transfer of 6000 B" in why, why
    assert a.counters["full_refusals"] == 2 and list(a.open) == ["t1"] and a.held_bytes == 4096
    assert not any(k.startswith("refused.") for k in a.counters)  # a full refusal is sent again: no drop
    assert a.add(one[2], 2.0) == ""  # its own pieces go on
    a.take("t1", "r1", 3, 6000)
    assert a.add(two[0], 3.0) == ""  # room again
    # a piece announcing a huge K/V takes no memory beyond what came (anonymous pages, untouched until written)
    big = hk.KvAssembler(1 << 40, 10.0)
    huge = m.KvChunk(transfer="t3", rid="r1", index=0, count=2**20, offset=0, total=2**30, crc32=zlib.crc32(b"\0" * 1024), data=b"\0" * 1024)
    assert big.add(huge, 0.0) == "" and big.held_bytes == 1024
    assert len(big.expire(10.0)) == 1 and big.held_bytes == 0


def test_a_forged_announcement_costs_what_it_stored_not_what_it_announced():
    """Before, a transfer reserved its announced total from its first piece: one 1-KiB piece announcing the whole
    buffer filled it for ``idle_s`` and every real hand-off meanwhile was refused "full" (its client's 500)."""
    a = hk.KvAssembler(MIB, 60.0, 5.0)
    forged = m.KvChunk(transfer="f1", rid="rf", index=0, count=MIB // 1024, offset=0, total=MIB, crc32=zlib.crc32(b"\1" * 1024),
                       data=b"\1" * 1024)  # fmt: skip
    assert a.add(forged, 0.0) == "" and a.held_bytes == 1024
    kv = os.urandom(600_000)
    real = _pieces(kv, 100_000, transfer="t1")
    assert all(a.add(c, 1.0) == "" for c in real), a.counters
    assert bytes(a.take("t1", "r1", len(real), len(kv))) == kv and a.held_bytes == 1024
    # a total past the whole buffer is refused at once, not as "full" (it never fits: the sender does not retry it)
    over = msgspec.structs.replace(forged, transfer="f2", total=MIB + 1024, count=MIB // 1024 + 1)
    why = a.add(over, 1.0)
    assert "can never fit this node's 1048576 B hand-off buffer" in why and not why.startswith(hk.FULL_PREFIX)
    assert a.counters["refused.too_large"] == 1 and "f2" not in a.open
    # the forged transfer, no piece after its first: dropped after piece_idle_s (5 s), not idle_s (60 s)
    assert a.next_deadline() == 5.0 and a.expire(4.9) == []
    (gone,) = a.expire(5.0)
    assert gone.transfer == "f1" and a.held_bytes == 0 and a.counters["expired_bytes"] == 1024
    assert "dropped after 5 s without a new piece (1 of 1024 pieces came)" in a.add(msgspec.structs.replace(forged, index=1, offset=1024), 6.0)
    # a complete transfer waits idle_s for its work
    done = _pieces(kv, 100_000, transfer="t2")
    assert all(a.add(c, 10.0) == "" for c in done)
    assert a.next_deadline() == 70.0 and a.expire(69.0) == [] and [x.transfer for x in a.expire(70.0)] == ["t2"]


def test_a_piece_past_the_buffer_is_refused_full_and_its_transfer_kept_until_room_comes():
    """A transfer quiet for more than ``ACTIVE_S`` reserves nothing, so another one is admitted beside what it
    stored; when it goes on, the piece that would pass the bound is refused ``full`` (transient: the transfer stays,
    its sender sends it again, for at most ``FULL_WAIT_S`` past its idle time) and stored once the other one's work
    took its K/V."""
    a = hk.KvAssembler(10_000, 60.0, 5.0)
    kv1, kv2 = os.urandom(6000), os.urandom(6000)
    one, two = _pieces(kv1, 2048, transfer="t1"), _pieces(kv2, 2048, transfer="t2", rid="r2")
    assert a.add(one[0], 0.0) == ""
    assert a.add(two[0], 2.0) == ""  # t1 quiet since 0.0: 2048 + 6000 fits
    assert a.add(one[1], 2.0) == "" and a.add(one[2], 2.0) == ""  # t1 goes on: 8048 stored
    why = a.add(two[1], 3.0)
    assert why.startswith(hk.FULL_PREFIX) and "piece 1 of 2048 B" in why, why
    t2 = a.open["t2"]
    assert (t2.last, t2.full_at, t2.refused_full, a.held_bytes) == (2.0, 3.0, 1, 8048)  # kept: its sender waits for room
    assert a.next_deadline() == 8.0 and a.expire(7.9) == []  # the refusal keeps it piece_idle_s (5 s) from then
    a.take("t1", "r1", 3, 6000)
    assert a.add(two[1], 4.0) == "" and a.add(two[2], 4.0) == ""
    assert bytes(a.take("t2", "r2", 3, 6000)) == kv2 and a.held_bytes == 0
    assert a.counters["full_refusals"] == 1 and not any(k.startswith("refused.") for k in a.counters)


def test_two_transfers_admitted_at_once_each_fitting_alone_both_complete():
    """Review 54, item 1: a new transfer was admitted when its total fitted beside the bytes STORED: two hand-offs
    whose pieces came interleaved were both admitted, each stored part, then each one's next piece was refused
    ``full`` by the other's bytes until both senders gave up (2P1D, 300,000-B buffer, 6 at once: 16 of 24 requests failed).
    Now the bytes still to come of a transfer being sent are kept room for: the second waits (refused ``full``, sent
    again), the first completes, and the second goes in once the first's work took its K/V."""
    a = hk.KvAssembler(600_000, 60.0, 15.0)
    size = hk.chunk_bytes(64 * 1024)
    ka, kb = os.urandom(360_448), os.urandom(360_448)  # each fits alone; both do not
    pa, pb = _pieces(ka, size, transfer="ta", rid="ra"), _pieces(kb, size, transfer="tb", rid="rb")
    refused: list[m.KvChunk] = []
    now = 0.0
    for x, y in zip(pa, pb, strict=True):  # as two senders' windows arrive: one piece of each in turn
        now += 0.001
        assert a.add(x, now) == "", a.counters
        why = a.add(y, now)
        assert why.startswith(hk.FULL_PREFIX), why
        refused.append(y)
    assert a.open["ta"].complete and "tb" not in a.open and a.held_bytes == len(ka)
    assert bytes(a.take("ta", "ra", len(pa), len(ka))) == ka
    for y in refused:  # its sender sends each again after its backoff
        assert a.add(y, now + 0.1) == ""
    assert bytes(a.take("tb", "rb", len(pb), len(kb))) == kb and a.held_bytes == 0
    # a transfer quiet for ACTIVE_S reserves nothing: a forged announcement costs what it stored
    forged = _pieces(os.urandom(500_000), 100_000, transfer="tf", rid="rf")[0]
    assert a.add(forged, 10.0) == "" and a.reserved(10.0) == 400_000 and a.reserved(10.0 + hk.ACTIVE_S) == 0
    late = msgspec.structs.replace(pb[0], transfer="tc")
    assert a.add(late, 10.5).startswith(hk.FULL_PREFIX)  # 400,000 B to come of it, 100,000 stored: 360,448 does not fit
    assert a.add(late, 10.0 + hk.ACTIVE_S) == ""


def test_a_transfer_kept_open_only_by_pieces_sent_again_expires():
    """Review 54, item 2: a piece sent again (held already) or refused ``full`` reset its transfer's idle time: a
    forger re-sending one piece of each of 1,024 transfers kept ``OPEN_MAX`` full and every real hand-off was
    refused ``full``. Now only a newly stored piece keeps a transfer (a ``full`` refusal: at most ``FULL_WAIT_S``
    past its idle time, the sender's retries of one piece)."""
    a = hk.KvAssembler(hk.OPEN_MAX * 4096, 60.0, 15.0)
    forged = [msgspec.structs.replace(c, src=f"worker-f{i % 8}") for i in range(hk.OPEN_MAX)
              for c in _pieces(os.urandom(2048), 1024, transfer=f"f{i}", rid=f"rf{i}")[:1]]  # fmt: skip
    assert all(a.add(c, 0.0) == "" for c in forged) and len(a.open) == hk.OPEN_MAX
    real = _pieces(os.urandom(4096), 2048, transfer="real", rid="r")
    why = a.add(real[0], 0.0)
    assert why.startswith(hk.FULL_PREFIX) and f"or its {hk.OPEN_MAX} transfers at once" in why, why
    for t in (10.0, 14.9):  # the forger re-sends its piece 0 of each: answered, not a sign of life
        assert all(a.add(c, t) == "" for c in forged)
    assert a.next_deadline() == hk.TICKET_IDLE_S and a.expire(hk.TICKET_IDLE_S) == [] and not a.queue  # "real" asked no more
    assert a.counters["duplicate_chunks"] == 2 * hk.OPEN_MAX and a.next_deadline() == 15.0
    assert len(a.expire(15.0)) == hk.OPEN_MAX and not a.open
    assert a.add(real[0], 15.0) == "" and a.add(real[1], 15.0) == ""
    # a piece refused full keeps its transfer past piece_idle_s, at most FULL_WAIT_S more
    assert hk.FULL_WAIT_S == sum(hk.full_backoff_s(t) for t in range(1, hk.FULL_TRIES)) == 2.5
    b = hk.KvAssembler(6144, 60.0, 5.0)
    one, two = _pieces(os.urandom(4096), 2048, transfer="t1"), _pieces(os.urandom(4096), 2048, transfer="t2", rid="r2")
    assert b.add(one[0], 0.0) == "" and b.add(two[0], 2.0) == "" and b.add(one[1], 2.0) == ""
    for t in (3.0, 5.0, 7.0, 9.0):
        assert b.add(two[1], t).startswith(hk.FULL_PREFIX)
    assert b.next_deadline() == 2.0 + 5.0 + hk.FULL_WAIT_S and b.open["t2"].refused_full == 4
    (gone,) = b.expire(9.5)
    assert gone.transfer == "t2" and "without a new piece (1 of 2 pieces came, 4 refused full)" in b.ended["t2"]


def test_one_sender_opens_at_most_open_per_sender_transfers():
    """Review 54, item 2: one sender (``KvChunk.src``) could take all ``OPEN_MAX``; now at most
    ``OPEN_PER_SENDER`` of its transfers are open at once (a piece of a new one is refused ``full``), others' go on."""
    a = hk.KvAssembler(MIB, 60.0, 15.0)
    mine = [msgspec.structs.replace(_pieces(os.urandom(2048), 1024, transfer=f"m{i}", rid=f"r{i}")[0], src="worker-x")
            for i in range(hk.OPEN_PER_SENDER + 1)]  # fmt: skip
    assert all(a.add(c, 0.0) == "" for c in mine[:-1])
    why = a.add(mine[-1], 0.0)
    assert why.startswith(hk.FULL_PREFIX) and f"or its {hk.OPEN_PER_SENDER} transfers of one sender (worker-x) at once" in why, why
    other = msgspec.structs.replace(mine[-1], transfer="o1", src="worker-y")
    assert a.add(other, 0.0) == "" and a.by_src == {"worker-x": hk.OPEN_PER_SENDER, "worker-y": 1}
    assert a.cancel("m0", "r0", "gave up") is not None and a.add(mine[-1], 0.0) == ""  # room for it again
    a.expire(100.0)
    assert not a.open and not a.by_src


def test_a_cancel_that_overtook_its_first_piece_keeps_the_transfer_from_opening():
    """Review 54, item 4: a ``KvCancel`` comes on another subscription than the pieces, and can overtake a piece
    queued behind others: it changed nothing, and the piece then opened the transfer, held ``piece_idle_s`` for
    pieces that never come. Now the cancel is remembered (bounded: ``ENDED_KEPT``)."""
    a = hk.KvAssembler(MIB, 60.0, 15.0)
    pieces = _pieces(os.urandom(5000), 2000)
    assert a.cancel("t1", "r1", "piece 1 of 3 unanswered") is None
    assert a.counters["cancelled_unheld"] == 1 and a.counters["cancelled"] == 0
    why = a.add(pieces[0], 1.0)
    assert "ended here already: cancelled by its sender: piece 1 of 3 unanswered" in why, why
    assert not a.open and a.held_bytes == 0 and a.counters["refused.ended"] == 1
    with pytest.raises(hk.KvMissing, match="cancelled by its sender") as e:
        a.take("t1", "r1", 3, 5000)
    assert not e.value.unknown
    # a cancel of a transfer taken already does not rewrite what became of it
    assert all(a.add(c, 2.0) == "" for c in _pieces(os.urandom(5000), 2000, transfer="t2"))
    a.take("t2", "r1", 3, 5000)
    assert a.cancel("t2", "r1", "late") is None and a.ended["t2"] == "taken" and a.counters["cancelled_unheld"] == 1
    # such cancels are remembered apart, bounded: a flood of them (review 54: 4,096 wiped the memory of transfers
    # held here) forgets only other such cancels; a late piece of a cancelled transfer held here stays refused
    assert all(a.add(c, 3.0) == "" for c in _pieces(os.urandom(5000), 2000, transfer="t3")[:1])
    assert a.cancel("t3", "r1", "gave up") is not None and a.ended["t3"].startswith("cancelled by its sender")
    for i in range(hk.ENDED_KEPT + 10):
        a.cancel(f"x{i}", "r", "flood")
    assert "ended here already" in a.add(_pieces(os.urandom(5000), 2000, transfer="t3")[1], 4.0)
    with pytest.raises(hk.KvMissing, match="taken already"):
        a.take("t2", "r1", 3, 5000)
    assert a.ended["t2"] == "taken" and "t3" in a.ended
    assert len(a.cancelled_unheld) == hk.CANCELLED_UNHELD_KEPT and f"x{hk.ENDED_KEPT + 9}" in a.cancelled_unheld
    # and what ended here is bounded too (oldest forgotten first)
    for i in range(hk.ENDED_KEPT + 10):
        a._remember(f"e{i}", "taken")
    assert len(a.ended) == hk.ENDED_KEPT and "t2" not in a.ended and f"e{hk.ENDED_KEPT + 9}" in a.ended


def test_a_cancel_frees_its_transfer_at_once():
    a = hk.KvAssembler(MIB, 60.0, 15.0)
    pieces = _pieces(os.urandom(5000), 2000)
    assert a.add(pieces[0], 0.0) == "" and a.held_bytes == 2000
    assert a.cancel("t1", "r9", "x") is None and "t1" in a.open  # another rid's cancel changes nothing
    gone = a.cancel("t1", "r1", "piece 1 of 3 unanswered")
    assert gone is not None and gone.stored == 2000 and a.held_bytes == 0 and not a.open
    assert (a.counters["cancelled"], a.counters["cancelled_bytes"]) == (1, 2000)
    assert "cancelled by its sender: piece 1 of 3 unanswered" in a.add(pieces[1], 1.0)
    with pytest.raises(hk.KvMissing, match="cancelled by its sender"):
        a.take("t1", "r1", 3, 5000)
    assert a.cancel("t1", "r1", "again") is None and a.counters["cancelled"] == 1


def test_a_buffer_the_kernel_refuses_is_a_refusal_not_an_exception():
    """L2: ``mmap.mmap(-1, total)`` raising ENOMEM went up through ``Bus.serve`` (no reply: the sender sent the piece
    three times and failed "unanswered"); now the piece is refused naming the bytes, and nothing is held."""
    a = hk.KvAssembler(1 << 63, 10.0)
    data = b"\0" * 1024
    huge = m.KvChunk(transfer="t4", rid="r1", index=0, count=2**52, offset=0, total=2**62, crc32=zlib.crc32(data), data=data)
    why = a.add(huge, 0.0)
    assert why.startswith(f"cannot allocate {2**62} B for transfer t4 of r1: "), why
    assert a.counters["refused.nomem"] == 1 and a.held_bytes == 0 and not a.open


def test_the_edge_refuses_pieces_and_works_of_no_shape():
    kv = os.urandom(3000)
    c = _pieces(kv, 1024)[0]
    assert check(c) is None
    assert check(hk.ask_of(c)) is None  # a data-less ask for its turn
    assert "does not fit" in (check(msgspec.structs.replace(c, data=b"", offset=3000)) or "")
    assert "does not fit" in (check(msgspec.structs.replace(c, offset=2990)) or "")
    assert "index" in (check(msgspec.structs.replace(c, index=3)) or "")
    assert "count" in (check(msgspec.structs.replace(c, count=3001)) or "")
    assert "transfer" in (check(msgspec.structs.replace(c, transfer="a.b")) or "")
    w = m.DecodeWork(rid="r1", prompt_tokens=9, max_tokens=4, block_size=4, block_hashes=[1, 2], kv_bytes=3000, kv_transfer="t1", kv_chunks=3)
    assert check(w) is None
    assert "go together" in (check(msgspec.structs.replace(w, kv_chunks=0)) or "")
    assert "go together" in (check(msgspec.structs.replace(w, kv=b"x")) or "")
    assert "kv_chunks" in (check(msgspec.structs.replace(w, kv_bytes=2)) or "")


# --------------------------------------------------------------------------- #
# the worker's shell (sim engine: the K/V is opaque to it; a recording bus)
# --------------------------------------------------------------------------- #


class _Bus:
    """What the worker touches of its bus here: publishes recorded; requests on ``work.<d>.kv`` answered by
    ``answer`` (the decode node's handler, or a fake)."""

    reconnected_at = 0.0
    max_payload = 20_000

    def __init__(self) -> None:
        self.published: list[tuple[str, object, dict]] = []
        self.requests: list[m.KvChunk] = []
        self.answer = None

    async def publish(self, subject, msg, **kw) -> None:  # type: ignore[no-untyped-def]
        self.published.append((subject.template, msg, kw))

    async def request(self, subject, msg, **kw):  # type: ignore[no-untyped-def]
        self.requests.append(msg)
        wire = msgspec.msgpack.decode(m.encode(msg), type=subject.msg_type)  # as the responder gets it
        return await self.answer(wire)


def _worker(node: str, phase: str, bus: _Bus, **cfg):  # type: ignore[no-untyped-def]
    from services.worker.config import WorkerConfig
    from services.worker.service import WorkerService
    from shared.clock import SimClock

    svc = WorkerService(WorkerConfig(node=node, phase=phase, profile="tiny", **cfg), bus, SimClock())  # type: ignore[arg-type]
    svc.accepting = True  # as start() leaves it (no subscriptions here: the handlers are called directly)
    return svc


def _work(rid: str = "r1", **kw) -> m.DecodeWork:  # type: ignore[no-untyped-def]
    return m.DecodeWork(rid=rid, prompt_tokens=9, max_tokens=4, block_size=4, block_hashes=[11, 12], prefill_node="p", **kw)


def _errors(bus: _Bus) -> list[str]:
    return [msg.error for t, msg, _ in bus.published if t == "req.{rid}.out.{node}" and msg.finish_reason == "error"]


async def test_the_decode_node_takes_a_work_whose_kv_came_and_fails_one_whose_kv_is_lost():
    bus = _Bus()
    d = _worker("d", "decode", bus)
    kv = os.urandom(50_000)
    pieces = _pieces(kv, 16_384, transfer="p-aa-1")
    for c in reversed(pieces):
        ack = await d._on_kv_chunk(c, "")
        assert ack is not None and (ack.transfer, ack.index, ack.error) == ("p-aa-1", c.index, "")
    assert (await d._on_kv_chunk(pieces[0], "")).error == ""  # sent again: answered, kept once
    await d._on_decode(_work(kv_bytes=len(kv), kv_transfer="p-aa-1", kv_chunks=len(pieces)), "")
    assert "r1" in d.core.requests and not _errors(bus)
    assert (d.counters["handoff.received"], d.counters["handoff.received_bytes"], d.counters["handoff.received_chunks"]) == (1, 50_000, 4)
    counters, gauges = d.stats()
    assert counters["handoff.kv.chunks"] == 4 and counters["handoff.kv.duplicate_chunks"] == 1 and gauges["handoff.kv_held_bytes"] == 0
    # the same work again: dropped, not failed, while the request is served (an old attempt) and once it ended
    again = _work(kv_bytes=len(kv), kv_transfer="p-aa-1", kv_chunks=len(pieces))
    await d._on_decode(again, "")
    assert not _errors(bus) and d.counters["requests.stale_attempt"] == 1
    d._forget("r1")
    d.core.abort("r1", d.clock.local_now())
    await d._on_decode(again, "")
    assert not _errors(bus) and d._kv_in.counters["duplicate_work"] == 1 and "r1" not in d.core.requests
    # a work whose K/V is not all here: the request fails with why (its client gets the error)
    for c in _pieces(kv, 16_384, transfer="p-aa-2", rid="r2")[:3]:
        await d._on_kv_chunk(c, "")
    await d._on_decode(_work("r2", kv_bytes=len(kv), kv_transfer="p-aa-2", kv_chunks=4), "")
    (err,) = _errors(bus)
    assert "hand-off lost on node d" in err and "3 of the 4 pieces" in err and "r2" not in d.core.requests
    assert d.counters["handoff.kv_lost"] == 1 and d._kv_in.held_bytes == 0
    # pieces whose work never comes: dropped after --handoff-kv-timeout-s, counted; its late work fails
    for c in _pieces(kv, 16_384, transfer="p-aa-3", rid="r3"):
        await d._on_kv_chunk(c, "")
    assert d._kv_in.held_bytes == 50_000 and d._kv_timer is not None
    d._expire_kv(d._kv_in.next_deadline())
    assert d._kv_in.held_bytes == 0 and d.stats()[0]["handoff.kv.expired"] == 1
    await d._on_decode(_work("r3", kv_bytes=len(kv), kv_transfer="p-aa-3", kv_chunks=4), "")
    assert "dropped after 60 s" in _errors(bus)[-1]
    # a work whose pieces went to an earlier process of this node (restarted after their answers): the error says so
    await d._on_decode(_work("r4", kv_bytes=len(kv), kv_transfer="p-aa-9", kv_chunks=4), "")
    err = _errors(bus)[-1]
    assert "transfer p-aa-9 is not here (no piece of it came)" in err and "this process of node d started" in err, err
    assert "a decode node restarted after its pieces were answered loses them" in err
    from services.worker.prom import worker_families

    fams = {f.name: f for f in worker_families(d)}
    assert {s.labels["reason"]: s.value for s in fams["ei_node_handoff_kv_dropped"].samples} == {
        "expired": 1.0, "refused": 0.0, "lost": 3.0, "discarded": 0.0, "cancelled": 0.0}
    assert fams["ei_node_handoff_received_bytes"].samples[0].value == 50_000
    await d.stop()


async def test_the_prefill_node_sends_the_kv_in_pieces_then_the_work_and_fails_the_request_when_refused():
    from services.worker.plan import HandOff

    pbus, dbus = _Bus(), _Bus()
    p, d = _worker("p", "prefill", pbus, log_requests=True), _worker("d", "decode", dbus)
    pbus.answer = lambda c: d._on_kv_chunk(c, "")
    kv = os.urandom(70_000)
    p.engine.handoff = lambda w: msgspec.structs.replace(w, kv=kv)  # type: ignore[method-assign]  # a real engine's K/V
    await p._handoff(HandOff("r1", "d", _work(), 0.0))
    (subject, sent, kw), = pbus.published
    size = hk.chunk_bytes(pbus.max_payload)
    assert subject == "work.{node}.decode" and kw["node"] == "d" and sent.kv == b""
    assert (sent.kv_bytes, sent.kv_chunks) == (70_000, -(-70_000 // size)) and len(pbus.requests) == sent.kv_chunks
    assert all(len(m.encode(c)) <= pbus.max_payload for c in pbus.requests)
    assert (p.counters["requests.handed_off"], p.counters["handoff.sent_bytes"], p.counters["handoff.sent_chunks"]) == (1, 70_000, 6)
    await d._on_decode(sent, "")
    assert "r1" in d.core.requests and d.counters["handoff.received_bytes"] == 70_000
    # the decode node refuses a piece for good (a K/V that can never fit): the request fails at once, naming why
    d._kv_in.max_bytes = 1000
    await p._handoff(HandOff("r2", "d", _work("r2"), 0.0))
    (err,) = _errors(pbus)
    assert "hand-off to d failed (70000 B of K/V)" in err and "can never fit this node's 1000 B hand-off buffer" in err
    assert p.counters["requests.handoff_failed"] == 1 and p.counters["handoff.chunk_full_retries"] == 0
    assert [t for t, _, _ in pbus.published].count("work.{node}.decode") == 1  # no work went out for r2
    # an unanswered piece is sent again, then the hand-off fails
    tries = []

    async def silent(c: m.KvChunk) -> m.KvChunkAck:
        from shared.bus import NoReply

        tries.append(c.index)
        raise NoReply("no reply on work.d.kv: TimeoutError")

    pbus.answer = silent
    await p._handoff(HandOff("r3", "d", _work("r3"), 0.0))
    assert "unanswered by d after 3 sends" in _errors(pbus)[-1] and p.counters["handoff.chunk_retries"] >= 2
    assert len(tries) <= hk.WINDOW * hk.TRIES
    await asyncio.gather(p.stop(), d.stop())


async def test_a_decode_node_that_switched_to_prefill_hands_the_kv_back_inline_or_fails_it_when_too_large():
    """A hand-off bound to a decode node that serves prefill by the time its work comes goes back to the router
    (``work.requeue``) with its K/V inline, the one message the router re-binds; one past ``max_payload`` cannot, and
    fails at once naming why (before, a ``work.requeue`` past it was retried for ``requeue_timeout_s``)."""
    bus = _Bus()
    d = _worker("d", "prefill", bus)
    handed: list[m.WorkRequeue] = []

    async def router(msg: m.WorkRequeue) -> m.WorkRequeueReply:
        handed.append(msg)
        return m.WorkRequeueReply(rid=msg.rid, accepted=True)

    bus.answer = router
    kv = os.urandom(8_000)
    for c in _pieces(kv, 4096, transfer="p-aa-1"):
        assert (await d._on_kv_chunk(c, "")).error == ""
    await d._on_decode(_work(kv_bytes=len(kv), kv_transfer="p-aa-1", kv_chunks=2), "")
    (back,) = handed
    assert back.decode is not None and back.decode.kv == kv and (back.decode.kv_transfer, back.decode.kv_chunks) == ("", 0)
    assert d.counters["requeue.decode"] == 1 and not _errors(bus) and d._kv_in.held_bytes == 0
    big = os.urandom(30_000)  # with its envelope, past the bus's 20,000-B max_payload
    for c in _pieces(big, 8192, transfer="p-aa-2", rid="r2"):  # refused at once: never held (before: held, then failed)
        assert "serves prefill now: a hand-off's 30000 B of K/V cannot go back" in (await d._on_kv_chunk(c, "")).error
    assert d._kv_in.held_bytes == 0 and not d._kv_in.open and d.counters["handoff.kv.refused.prefill"] == 4
    await d._on_decode(_work("r2", kv_bytes=len(big), kv_transfer="p-aa-2", kv_chunks=4), "")
    assert len(handed) == 1 and d.counters["requeue.decode_refused"] == 1
    (err,) = _errors(bus)
    assert "serves prefill now and cannot hand the decode back" in err and "30000 B of K/V cannot go back" in err
    await d.stop()


async def test_a_switch_to_prefill_frees_the_kv_that_cannot_go_back_inline_and_keeps_the_rest():
    """K/V held for works not come yet when a decode node switches to prefill: what cannot go back through the
    router in one message would only fail its request when its work comes; freed at the switch (before: held until
    ``--handoff-kv-timeout-s``), its work failing naming why; the small one still goes back inline."""
    from services.worker.service import _Switch

    bus = _Bus()
    d = _worker("d", "decode", bus)
    handed: list[m.WorkRequeue] = []

    async def router(msg: m.WorkRequeue) -> m.WorkRequeueReply:
        handed.append(msg)
        return m.WorkRequeueReply(rid=msg.rid, accepted=True)

    bus.answer = router
    small, big = os.urandom(8_000), os.urandom(30_000)
    for c in (*_pieces(small, 4096, transfer="p-aa-1"), *_pieces(big, 8192, transfer="p-aa-2", rid="r2")):
        assert (await d._on_kv_chunk(c, "")).error == ""
    assert d._kv_in.held_bytes == 38_000
    now = d.clock.local_now()
    await d._serving(_Switch(epoch=1, target="prefill", since=now, received_at=now, decided_at=0.0), now)
    assert d.core.phase == "prefill" and list(d._kv_in.open) == ["p-aa-1"] and d._kv_in.held_bytes == 8_000
    assert d._kv_in.counters["discarded"] == 1
    await d._on_decode(_work("r2", kv_bytes=len(big), kv_transfer="p-aa-2", kv_chunks=4), "")
    (err,) = _errors(bus)
    assert "cannot hand the decode back" in err and "discarded: node d switched to prefill" in err, err
    await d._on_decode(_work(kv_bytes=len(small), kv_transfer="p-aa-1", kv_chunks=2), "")
    (back,) = handed
    assert back.decode is not None and back.decode.kv == small and d._kv_in.held_bytes == 0
    await d.stop()


async def test_an_abort_frees_the_kv_of_its_rid_not_a_newer_attempts_nor_another_routers():
    """An abort of a rid whose K/V came but whose work has not: the work will be dropped (``_aborted``), so the K/V
    goes now (before: held until ``--handoff-kv-timeout-s``). Not the K/V of a newer attempt (a re-dispatch) nor of
    another router's request of the same id."""
    bus = _Bus()
    d = _worker("d", "decode", bus)
    kv = os.urandom(20_000)
    for t, att, router in (("p-aa-1", 3, "router-a"), ("p-aa-2", 4, "router-a"), ("p-aa-3", 1, "router-b")):
        for c in _pieces(kv, 8192, transfer=t, rid="r1"):
            assert (await d._on_kv_chunk(msgspec.structs.replace(c, attempt=att, router=router), "")).error == ""
    other = _pieces(kv, 8192, transfer="p-aa-4", rid="r2")
    for c in other:
        assert (await d._on_kv_chunk(c, "")).error == ""
    await d._on_abort(m.RequestAbort(rid="r1", reason="client went away", attempt=3, router="router-a"), "")
    assert sorted(d._kv_in.open) == ["p-aa-2", "p-aa-3", "p-aa-4"] and d._kv_in.counters["discarded"] == 1
    assert "its request was aborted (client went away)" in d._kv_in.ended["p-aa-1"]
    await d._on_abort(m.RequestAbort(rid="r2", reason="gone"), "")  # an older sender's abort names no router
    assert sorted(d._kv_in.open) == ["p-aa-2", "p-aa-3"] and d._kv_in.held_bytes == 40_000
    # its work, when it comes, is dropped as aborted, not failed
    await d._on_decode(_work("r2", kv_bytes=len(kv), kv_transfer="p-aa-4", kv_chunks=len(other)), "")
    assert not _errors(bus) and d.counters["requests.aborted_before_arrival"] == 1
    await d.stop()


async def test_the_prefill_node_retries_a_full_buffer_then_fails_saying_so_and_cancels_what_it_gave_up(monkeypatch):
    """A full hand-off buffer is transient: a new transfer refused for room waits its turn in the decode node's queue
    (``KvChunkAck.queued``), one piece asking again, up to ``--handoff-queue-wait-s``; one refused ``full`` without a
    place (the queue at its bound) is sent again after a backoff (``FULL_TRIES``); before, the first "full" failed
    the request (its client's 500). A hand-off given up (refused, unanswered) tells the decode node (``KvCancel``),
    which frees what it holds at once; before, the partial K/V stayed until its timeout."""
    import time

    from services.worker.plan import HandOff

    monkeypatch.setattr(hk, "FULL_BACKOFF_S", 0.001)
    monkeypatch.setattr(hk, "FULL_BACKOFF_MAX_S", 0.001)
    monkeypatch.setattr(hk, "QUEUE_POLL_S", 0.001)
    pbus, dbus = _Bus(), _Bus()
    p, d = _worker("p", "prefill", pbus), _worker("d", "decode", dbus)
    kv = os.urandom(70_000)
    p.engine.handoff = lambda w: msgspec.structs.replace(w, kv=kv)  # type: ignore[method-assign]
    d._kv_in.max_bytes = 100_000
    for c in _pieces(os.urandom(40_000), 16_384, transfer="x-1", rid="rx"):  # 40,000 B stored: 70,000 more do not fit
        assert d._kv_in.add(c, time.monotonic()) == ""
    refusals = 0
    asked: list[int] = []

    async def answer(c: m.KvChunk) -> m.KvChunkAck:
        nonlocal refusals
        ack = await d._on_kv_chunk(c, "")
        assert ack is not None
        if ack.full:
            refusals += 1
            asked.append(c.index)
            if refusals == 8 and free:  # room comes: the stuffing's work took its K/V
                d._kv_in.discard("x-1")
        return ack

    pbus.answer = answer
    free = True
    await p._handoff(HandOff("r1", "d", _work(), 0.0))
    assert not _errors(pbus) and p.counters["requests.handed_off"] == 1 and p.counters["handoff.chunk_full_retries"] == 0
    assert p.counters["handoff.queued"] == 1 and p.counters["handoff.queue_asks"] >= 4, p.counters
    assert len(set(asked[4:])) == 1, asked  # past the first window's answers, one piece asks for the transfer
    assert d._kv_in.counters["queue.admitted"] == 1 and not d._kv_in.queue and d._kv_in.queue_waits.counts[-1] == 0
    (r1,) = d._kv_in.open  # its work (recorded, not delivered here) would take it
    d._kv_in.discard(r1)
    # queued and no room ever: fails after --handoff-queue-wait-s, saying the buffer was full; its place is freed
    for c in _pieces(os.urandom(40_000), 16_384, transfer="x-2", rid="rx"):
        assert d._kv_in.add(c, time.monotonic()) == ""
    free, refusals = False, 0
    p.cfg = msgspec.structs.replace(p.cfg, handoff_queue_wait_s=0.05)
    await p._handoff(HandOff("r2", "d", _work("r2"), 0.0))
    (err,) = _errors(pbus)
    assert re.search(r"decode node d's hand-off buffer was full: transfer \S+ waited 0\.\d s in its queue for room, at "
                     r"place 1 \(--handoff-queue-wait-s 0\.05", err), err  # fmt: skip
    assert p.counters["requests.handoff_failed"] == 1
    for msg in [msg for t, msg, kw in pbus.published if t == "work.{node}.kvcancel"]:
        await d._on_kv_cancel(msg, "")
    assert not d._kv_in.queue and d._kv_in.counters["queue.cancelled"] == 1
    # the queue at its bound: refused full without a place, sent again FULL_TRIES times, then failed saying so
    monkeypatch.setattr(hk, "QUEUE_MAX", 0)
    refusals = 0
    await p._handoff(HandOff("r2b", "d", _work("r2b"), 0.0))
    err = _errors(pbus)[-1]
    assert re.search(f"decode node d's hand-off buffer was full: piece [0-3] of 6 refused {hk.FULL_TRIES} times", err), err
    assert "its queue of transfers waiting for room is full (0 waiting)" in err, err
    assert refusals >= hk.FULL_TRIES and p.counters["requests.handoff_failed"] == 2 and d._kv_in.counters["queue.refused"] >= 1
    # a hand-off given up mid-way: the decode node stored two pieces, the third goes unanswered
    d._kv_in.discard("x-2")
    seen = 0

    async def then_silent(c: m.KvChunk) -> m.KvChunkAck:
        nonlocal seen
        from shared.bus import NoReply

        seen += 1
        if c.index >= 2:
            raise NoReply("no reply on work.d.kv: TimeoutError")
        ack = await d._on_kv_chunk(c, "")
        assert ack is not None
        return ack

    pbus.answer = then_silent
    p.cfg = msgspec.structs.replace(p.cfg, handoff_chunk_timeout_s=0.01)
    await p._handoff(HandOff("r3", "d", _work("r3"), 0.0))
    assert "unanswered by d after 3 sends" in _errors(pbus)[-1]
    (transfer,) = [x.transfer for x in d._kv_in.open.values() if x.rid == "r3"]
    size = hk.chunk_bytes(pbus.max_payload)
    assert d._kv_in.open[transfer].got == 2 and d._kv_in.held_bytes == 2 * size  # as it was before the cancel
    cancels = [msg for t, msg, kw in pbus.published if t == "work.{node}.kvcancel" and kw["node"] == "d"]
    assert [c.transfer for c in cancels][-1] == transfer and "unanswered" in cancels[-1].reason
    for c in cancels:  # as the decode node receives them
        await d._on_kv_cancel(c, "")
    assert not d._kv_in.open and d._kv_in.held_bytes == 0 and d._kv_in.counters["cancelled"] == 1
    assert p.counters["handoff.cancels_sent"] == len(cancels)
    from services.worker.prom import worker_families

    fams = {f.name: f for f in worker_families(d)}
    assert {s.labels["reason"]: s.value for s in fams["ei_node_handoff_kv_dropped"].samples}["cancelled"] == 1.0
    await asyncio.gather(p.stop(), d.stop())


async def test_the_kv_of_an_older_attempts_work_is_discarded_at_once():
    """L3: a work of an attempt older than the one served here is dropped (``requests.stale_attempt``) and its K/V
    with it (``discarded``), not held until ``--handoff-kv-timeout-s``."""
    bus = _Bus()
    d = _worker("d", "decode", bus)
    kv = os.urandom(50_000)
    new = _pieces(kv, 16_384, transfer="p-aa-5", rid="r5")
    for c in new:
        await d._on_kv_chunk(c, "")
    await d._on_decode(_work("r5", attempt=2, kv_bytes=len(kv), kv_transfer="p-aa-5", kv_chunks=len(new)), "")
    assert "r5" in d.core.requests and d._kv_in.held_bytes == 0
    old = _pieces(kv, 16_384, transfer="p-bb-1", rid="r5")
    for c in old:
        await d._on_kv_chunk(c, "")
    assert d._kv_in.held_bytes == 50_000
    await d._on_decode(_work("r5", attempt=1, kv_bytes=len(kv), kv_transfer="p-bb-1", kv_chunks=len(old)), "")
    assert d.counters["requests.stale_attempt"] == 1 and not _errors(bus)
    assert d._kv_in.held_bytes == 0 and d._kv_in.counters["discarded"] == 1 and "p-bb-1" not in d._kv_in.open
    # a work dropped for its rid (no reply subject can be formed from it): its K/V goes too
    bad = _pieces(kv, 16_384, transfer="p-bb-2", rid="r 6")
    for c in bad:
        assert d._kv_in.add(c, 0.0) == ""
    await d._on_decode(_work("r 6", kv_bytes=len(kv), kv_transfer="p-bb-2", kv_chunks=len(bad)), "")
    assert d.counters["requests.bad_rid"] == 1 and d._kv_in.held_bytes == 0 and d._kv_in.counters["discarded"] == 2


async def test_a_decode_work_the_bus_refused_cancels_its_kv_on_the_decode_node():
    """Review 54, item 3: the pieces all answered, the ``DecodeWork`` that names them refused by the bus (NATS
    gone past its buffer): the request fails and the prefill node tells the decode node (``KvCancel``), which frees
    the K/V at once, not after ``--handoff-kv-timeout-s`` (60 s)."""
    from services.worker.plan import HandOff
    from shared.bus import BusUnavailable

    class _Refusing(_Bus):
        async def publish(self, subject, msg, **kw) -> None:  # type: ignore[no-untyped-def]
            if subject.template == "work.{node}.decode":
                raise BusUnavailable("nats: outbound buffer limit exceeded")
            await super().publish(subject, msg, **kw)

    pbus, dbus = _Refusing(), _Bus()
    p, d = _worker("p", "prefill", pbus), _worker("d", "decode", dbus)
    pbus.answer = lambda c: d._on_kv_chunk(c, "")
    kv = os.urandom(50_000)
    p.engine.handoff = lambda w: msgspec.structs.replace(w, kv=kv)  # type: ignore[method-assign]
    await p._handoff(HandOff("r1", "d", _work(), 0.0))
    (err,) = _errors(pbus)
    assert "hand-off to d failed (50000 B of K/V)" in err and "outbound buffer limit exceeded" in err, err
    assert p.counters["requests.handoff_failed"] == 1 and p.counters["handoff.cancels_sent"] == 1
    ((cancel, kw),) = [(msg, kw) for t, msg, kw in pbus.published if t == "work.{node}.kvcancel"]
    (held,) = d._kv_in.open.values()
    assert kw["node"] == "d" and (cancel.transfer, cancel.rid) == (held.transfer, "r1") and held.complete
    assert "its work was not sent" in cancel.reason
    await d._on_kv_cancel(cancel, "")
    assert not d._kv_in.open and d._kv_in.held_bytes == 0 and d._kv_in.counters["cancelled_bytes"] == 50_000
    await asyncio.gather(p.stop(), d.stop())


async def test_a_superseded_process_leaves_a_cancel_to_the_process_that_replaced_it():
    """Review 54, item 3: a process superseded by a later one of its node id (both receive the node's
    ``work.<n>.kvcancel``) changes nothing on a cancel: what it holds is no longer the node's to count or log."""
    from services.worker.service import Superseded

    bus = _Bus()
    d = _worker("d", "decode", bus)
    for c in _pieces(os.urandom(5000), 2000, transfer="p-aa-1"):
        assert (await d._on_kv_chunk(c, "")).error == ""
    d._fail(Superseded("another process announces node d and started later"), "node.state")
    await d._on_kv_cancel(m.KvCancel(transfer="p-aa-1", rid="r1", reason="gave up"), "")
    assert "p-aa-1" in d._kv_in.open and d._kv_in.counters["cancelled"] == 0 and d.counters["work.superseded"] == 1
    await d.stop()


async def test_a_full_refusal_is_counted_apart_not_as_a_dropped_kv():
    """Review 54, item 5: ``ei_node_handoff_kv_dropped_total{reason="refused"}`` counted every ``full`` refusal,
    even of a piece stored at its next send; now those are ``ei_node_handoff_full_refusals_total``, and an expired
    transfer's log names the bytes it stored, not its announced total."""
    from services.worker.prom import worker_families

    bus = _Bus()
    d = _worker("d", "decode", bus, handoff_buffer_bytes=10_000)
    one, two = _pieces(os.urandom(6000), 2048, transfer="p-aa-1"), _pieces(os.urandom(6000), 2048, transfer="p-aa-2", rid="r2")
    assert (await d._on_kv_chunk(one[0], "")).error == ""
    ack = await d._on_kv_chunk(two[0], "")
    assert ack.full and ack.error.startswith(hk.FULL_PREFIX)
    d._kv_in.discard("p-aa-1")
    assert (await d._on_kv_chunk(two[0], "")).error == ""  # sent again: stored
    fams = {f.name: f for f in worker_families(d)}
    assert fams["ei_node_handoff_full_refusals"].samples[0].value == 1.0
    assert {s.labels["reason"]: s.value for s in fams["ei_node_handoff_kv_dropped"].samples}["refused"] == 0.0
    assert d.stats()[0]["handoff.kv.full_refusals"] == 1
    logged: list[dict] = []
    d._kv_log.event = lambda kind, text, **kw: logged.append(kw)  # type: ignore[method-assign]
    d._expire_kv(d._kv_in.next_deadline())
    (e,) = logged
    assert (e["kv_bytes"], e["kv_total"], e["timeout_s"]) == (2048, 6000, d.cfg.handoff_piece_idle_s), e
    await d.stop()


def _forged(transfer: str, index: int, total: int, piece: int = 1024) -> m.KvChunk:
    """Piece ``index`` of a transfer announcing ``total`` bytes in ``piece``-byte pieces (a forger's, or a slow one)."""
    data = bytes([index % 251]) * piece
    return m.KvChunk(transfer=transfer, rid="rf", index=index, count=total // piece, offset=index * piece, total=total,
                     crc32=zlib.crc32(data), data=data)  # fmt: skip


def test_a_trickling_sender_keeps_room_for_what_its_rate_stores_not_its_whole_announcement():
    """Review 54 (M1): a transfer that stored a new piece within ``ACTIVE_S`` kept room for its whole remainder: one
    announcing the whole buffer and sending 1 KiB every 0.9 s (each piece new, so never idle) kept every other
    hand-off refused ``full`` (60 of 60 tries over 54 s in the review's probe). Now it keeps at most what its rate so
    far stores in ``RESERVE_HORIZON_S``."""
    a = hk.KvAssembler(MIB, 60.0, 15.0)
    now = 0.0
    for i in range(30):  # 30 KiB over 26.1 s: ~1.2 KB/s
        now = 0.9 * i
        assert a.add(_forged("slow", i, MIB), now) == ""
    assert a.reserved(now) < 10_000, a.reserved(now)
    kv = os.urandom(600_000)
    real = _pieces(kv, 100_000, transfer="t1")
    assert all(a.add(c, now + 0.1) == "" for c in real), a.counters  # beside its 30 KiB, not its announced 1 MiB
    assert bytes(a.take("t1", "r1", len(real), len(kv))) == kv
    # a live sender's pieces come milliseconds apart: it keeps room for all it has still to send
    fast = [_pieces(os.urandom(400_000), 16_384, transfer="t2", rid="r2")[i] for i in range(2)]
    assert a.add(fast[0], 30.0) == "" and a.add(fast[1], 30.002) == ""
    assert a.reserved(30.003) == 400_000 - 2 * 16_384


def test_a_transfer_waiting_after_a_full_refusal_keeps_its_room_from_a_newcomer():
    """Review 54 (M2): a transfer whose piece was refused ``full`` counted as quiet while its sender waited (0.1 ...
    1 s between tries), so a newcomer admitted when another work freed room took it, and the waiting one was refused
    until its sender gave up. Now a transfer refused within ``ACTIVE_S`` + ``FULL_BACKOFF_MAX_S`` keeps its room."""
    a = hk.KvAssembler(10_000, 60.0, 5.0)
    kv1, kv2, kv3 = os.urandom(6000), os.urandom(6000), os.urandom(6000)
    one = _pieces(kv1, 2048, transfer="t1")
    two = _pieces(kv2, 2048, transfer="t2", rid="r2")
    three = _pieces(kv3, 2048, transfer="t3", rid="r3")
    assert a.add(one[0], 0.0) == ""
    assert all(a.add(c, 2.0) == "" for c in two)  # t1 quiet since 0.0: t2 admitted beside its 2048 B, and complete
    assert a.add(one[1], 2.5).startswith(hk.FULL_PREFIX)  # 8048 + 2048 > 10,000: t1's sender waits for room
    a.take("t2", "r2", 3, 6000)  # t2's work frees 6000 B at 3.2
    why = a.add(three[0], 3.3)  # t1 (refused at 2.5) is still being sent: its 3952 B to come are kept for it
    assert why.startswith(hk.FULL_PREFIX) and "3952 B more to come" in why, why
    assert a.add(one[1], 3.5) == "" and a.add(one[2], 3.5) == ""  # the waiting sender's retry goes in
    assert bytes(a.take("t1", "r1", 3, 6000)) == kv1
    assert a.add(three[0], 3.6) == ""  # and the newcomer after it
    # a refusal long past no longer keeps room: quiet for ACTIVE_S, refused more than ACTIVE_S + FULL_BACKOFF_MAX_S ago
    b = hk.KvAssembler(10_000, 60.0, 15.0)
    assert b.add(one[0], 0.0) == "" and all(b.add(c, 2.0) == "" for c in two) and b.add(one[1], 2.5).startswith(hk.FULL_PREFIX)
    b.take("t2", "r2", 3, 6000)
    assert b.reserved(2.5 + hk.ACTIVE_S + hk.FULL_BACKOFF_MAX_S) == 0


def test_room_that_frees_goes_to_the_oldest_ask_first_and_a_ticket_ends_when_its_sender_stops_asking(monkeypatch):
    """Review 54's open finding: admission was not first come, first served. 12 hand-offs at once into a buffer that
    holds one: room that freed went to whichever sender's retry came first, so a late one could win it over one
    waiting longer, and one that waited past its 2.5 s of retries failed although the buffer drained (3 of 36). Now a
    new transfer refused for room gets a ticket (its place by first ask); room goes to the oldest ticket first (a
    younger one, or a newcomer, is refused ``full`` while an older one waits, even with room); a ticket whose
    sender stops asking (``TICKET_IDLE_S``) or cancels leaves the queue, so it cannot hold the others."""
    a = hk.KvAssembler(10_000, 60.0, 15.0)
    kv0 = os.urandom(6000)
    for c in _pieces(kv0, 2048, transfer="t0", rid="r0"):
        assert a.add(c, 0.0) == ""
    new = {x: _pieces(os.urandom(6000), 2048, transfer=x, rid=f"r{x}") for x in ("A", "B", "C", "D", "E")}
    for i, x in enumerate("ABC"):  # they ask in this order; none fits beside t0
        why = a.add(new[x][0], 0.1 * (i + 1))
        assert why.startswith(hk.FULL_PREFIX) and f"waiting for room, {i + 1} of {i + 1} in line" in why, why
    assert list(a.queue) == ["A", "B", "C"] and [a.place(x) for x in "ABCD"] == [1, 2, 3, 0]
    assert [t.seq for t in a.queue.values()] == [1, 2, 3] and a.counters["queue.entered"] == 3
    a.take("t0", "r0", 3, 6000)  # room for one
    assert a.add(new["C"][1], 0.6).startswith(hk.FULL_PREFIX) and a.place("C") == 3  # the youngest asks first: not its turn
    assert a.add(new["B"][0], 0.7).startswith(hk.FULL_PREFIX) and a.place("B") == 2
    assert a.add(new["A"][2], 0.8) == "" and "A" in a.open and "A" not in a.queue  # the oldest: in, any piece of it
    assert a.last_admitted is not None and a.last_admitted.seq == 1 and a.counters["queue.admitted"] == 1
    assert a.queue_waits.sum == pytest.approx(0.7) and sum(a.queue_waits.counts) == 1
    for c in new["A"]:
        assert a.add(c, 0.9) == ""
    a.take("A", "rA", 3, 6000)  # room again: B's, though D asks first, never having asked before
    why = a.add(new["D"][0], 1.0)
    assert why.startswith(hk.FULL_PREFIX) and "waiting for room, 3 of 3 in line" in why and a.place("D") == 3
    assert a.add(new["C"][0], 1.1).startswith(hk.FULL_PREFIX) and a.place("C") == 2
    # B's sender stops asking: its ticket ends TICKET_IDLE_S after its last ask (0.7), and C is next
    assert a.next_deadline() == pytest.approx(0.7 + hk.TICKET_IDLE_S)
    assert a.add(new["C"][0], 0.7 + hk.TICKET_IDLE_S - 0.01).startswith(hk.FULL_PREFIX)  # B still holds its place
    assert a.add(new["D"][0], 0.7 + hk.TICKET_IDLE_S - 0.01).startswith(hk.FULL_PREFIX)
    assert a.expire(0.7 + hk.TICKET_IDLE_S) == [] and list(a.queue) == ["C", "D"] and a.counters["queue.expired"] == 1
    assert a.add(new["D"][0], 3.8).startswith(hk.FULL_PREFIX) and a.place("D") == 2  # C's turn
    assert a.add(new["C"][0], 3.8) == "" and list(a.queue) == ["D"]
    # a cancel gives its place up at once; E, behind it, is next
    assert a.add(new["E"][0], 3.9).startswith(hk.FULL_PREFIX) and list(a.queue) == ["D", "E"]
    assert a.cancel("D", "rD", "gave up") is None and list(a.queue) == ["E"] and a.counters["queue.cancelled"] == 1
    assert "cancelled by its sender" in a.add(new["D"][0], 4.0)  # a late piece of it is refused, not queued again
    for c in new["C"][1:]:
        assert a.add(c, 4.0) == ""
    a.take("C", "rC", 3, 6000)
    assert a.add(new["E"][0], 4.1) == "" and not a.queue
    # a sender at its OPEN_PER_SENDER waits for its own transfers, not for room: its ticket holds nobody back
    monkeypatch.setattr(hk, "OPEN_PER_SENDER", 1)
    f1, f2 = _pieces(os.urandom(2048), 1024, transfer="F1", rid="rF1"), _pieces(os.urandom(2048), 1024, transfer="F2", rid="rF2")
    assert a.add(msgspec.structs.replace(f1[0], src="worker-f"), 4.2) == ""
    g = msgspec.structs.replace(f2[0], src="worker-f")
    assert a.add(g, 4.2).startswith(hk.FULL_PREFIX) and list(a.queue) == ["F2"] and a.place("F2") == 1
    x = msgspec.structs.replace(_pieces(os.urandom(1024), 1024, transfer="G", rid="rG")[0], src="worker-g")  # F2 waits for its sender
    assert a.add(x, 4.3) == "" and "G" in a.open
    # bounded: past QUEUE_MAX waiting, a new one is refused full without a place, counted
    monkeypatch.setattr(hk, "QUEUE_MAX", 1)
    why = a.add(msgspec.structs.replace(new["B"][0], transfer="H"), 4.4)
    assert "its queue of transfers waiting for room is full (1 waiting)" in why and a.place("H") == 0
    assert a.counters["queue.refused"] == 1 and list(a.queue) == ["F2"]


def _from(c: m.KvChunk, src: str, **kw) -> m.KvChunk:  # type: ignore[no-untyped-def]
    return msgspec.structs.replace(c, src=src, **kw)


def test_a_ticket_that_cannot_fit_beside_its_own_senders_bytes_holds_nobody_back_and_a_head_that_can_fit_holds_all():
    """Review 55 H1: a forging sender admits f-1 (1 KiB stored, announcing the whole buffer), then asks for f-2 (the
    whole buffer): f-2 can never fit while its own f-1 holds bytes, yet as the first ticket it kept every other
    sender's hand-off out for their whole wait (both real requests 500 after 30 s). Now a ticket whose total does not
    fit beside its own sender's stored bytes holds other senders back no more, and its sender's own later transfers
    at most ``HEAD_HOLD_S``. Second review 55 M-b: a head that can fit once room frees (a large legitimate one) holds
    every one behind it while bytes free at least once in ``HEAD_HOLD_S``; before, it did so at most ``HEAD_HOLD_S``
    from its first refusal, then steady smaller traffic starved it."""
    a = hk.KvAssembler(600_000, 60.0, 15.0)
    f1 = _pieces(os.urandom(600_000), 1024, transfer="f-1", rid="rf1")
    f2 = _pieces(os.urandom(600_000), 1024, transfer="f-2", rid="rf2")
    assert a.add(_from(f1[0], "forger"), 0.0) == ""
    why = a.add(_from(f2[0], "forger"), 0.0)
    assert why.startswith(hk.FULL_PREFIX) and list(a.queue) == ["f-2"] and a.place("f-2", 0.0) == 1
    real = _pieces(os.urandom(100_000), 50_000, transfer="w0-1", rid="r1")
    assert a.add(_from(real[0], "worker-w0"), 0.5) == "" and "w0-1" in a.open  # f-2 waits for its own sender
    mine = _from(_pieces(os.urandom(2048), 1024, transfer="f-3", rid="rf3")[0], "forger")
    assert a.add(mine, 0.6).startswith(hk.FULL_PREFIX) and a.place("f-3", 0.6) == 2  # its own sender's keep their order
    for t in (2.5, 4.5):  # both keep asking
        assert a.add(_from(f2[0], "forger"), t).startswith(hk.FULL_PREFIX)
        assert a.add(mine, t).startswith(hk.FULL_PREFIX) and a.place("f-3", t) == 2
    assert a.queue["f-2"].head == 0.5  # its sender's first since the first ask after its ticket
    assert a.add(mine, 0.5 + hk.HEAD_HOLD_S) == "" and "f-3" in a.open  # at most HEAD_HOLD_S behind it
    a.cancel("f-1", "rf1", "gone")
    a.cancel("f-3", "rf3", "gone")
    # a large legit head that can fit once w0-1's 100 KB go: the others wait behind it, however long
    assert a.add(_from(f2[0], "forger"), 5.6).startswith(hk.FULL_PREFIX) and a.place("f-2", 5.6) == 1
    assert a.add(_from(f2[0], "forger"), 6.0).startswith(hk.FULL_PREFIX) and a.place("f-2", 6.0) == 1
    small = _from(_pieces(os.urandom(2048), 1024, transfer="w2-1", rid="r2")[0], "worker-w2")
    why = a.add(small, 6.1)
    assert why.startswith(hk.FULL_PREFIX) and "2 of 2 in line" in why
    for t in (7.0, 9.0, 10.4):  # both keep asking; f-1 and f-3 freed their bytes at 5.5
        assert a.add(_from(f2[0], "forger"), t).startswith(hk.FULL_PREFIX) and a.place("f-2", t) == 1
        assert a.add(small, t).startswith(hk.FULL_PREFIX) and a.place("w2-1", t) == 2
    # nothing freed for HEAD_HOLD_S (w0-1 waits for work that does not come): those behind go as they fit
    assert a.add(small, 5.5 + hk.HEAD_HOLD_S) == "" and "w2-1" in a.open and a.place("f-2", 10.6) == 1
    a.discard("w2-1")  # bytes freed: f-2 holds the others back again
    big = _from(_pieces(os.urandom(2048), 1024, transfer="w2-2", rid="r22")[0], "worker-w2")
    assert a.add(big, 10.7).startswith(hk.FULL_PREFIX) and a.place("w2-2", 10.7) == 2
    a.discard("w0-1")
    assert a.add(big, 10.8).startswith(hk.FULL_PREFIX)  # room for both now, but the head's first
    assert a.add(_from(f2[0], "forger"), 10.9) == "" and "f-2" in a.open and list(a.queue) == ["w2-2"]


def test_a_large_head_is_not_starved_by_steady_smaller_traffic():
    """Second review 55 M-b (``exp/starve2.py``): a 450-KB head in a 600-KB buffer, 100-KB hand-offs of another
    sender arriving every 0.5 s and held 6 s each. Before, past ``HEAD_HOLD_S`` the smaller ones went as they fit and
    the head was never admitted in 35 s; strict first come, first served (8fb20cfa) admitted it at 7.6 s."""
    a = hk.KvAssembler(600_000, 60.0, 15.0)
    big = _from(_pieces(os.urandom(450_000), 450_000, transfer="BIG", rid="rBIG")[0], "worker-w0")
    held: dict[str, float] = {}
    pending: list[m.KvChunk] = []
    got, k, nxt, t = None, 0, 0.0, 0.0
    while t < 35 and got is None:
        for tr, until in list(held.items()):
            if until <= t:
                a.discard(tr, "taken")
                held.pop(tr)
        if t >= nxt:
            k += 1
            pending.append(_from(_pieces(os.urandom(100_000), 100_000, transfer=f"s{k}", rid=f"r{k}")[0], "worker-w2"))
            nxt = round(nxt + 0.5, 2)
        for c in list(pending):
            if a.add(c, t) == "":
                held[c.transfer] = t + 6.0
                pending.remove(c)
        if t >= 2 and round(t * 10) % 2 == 0:
            if "BIG" not in a.queue:
                r = a.add(big, t)
            elif (r := a.add(_from(hk.ask_of(big), "worker-w0"), t)) == "":  # its turn: the piece follows
                r = a.add(big, t)
            if r == "":
                got = t
        t = round(t + 0.1, 1)
    assert got is not None and got < 10.0, got


def test_a_turn_granted_and_not_used_costs_the_ticket_its_place():
    """Second review 55 H-a (``exp/lockout.py``): a forged ticket that asks without data while there is room, and
    never sends its piece, kept its place as the head (its asks were answered "" and ``blocked`` was set only on a
    refusal for room), so it held every real hand-off back: a real request 500 after 30 s with the buffer empty.
    Now an ask answered "" whose piece does not follow within ``GRANT_USE_S`` costs the ticket its place (counted
    ``queue.unused_turns``); asking again does not extend the grant; a sender that sends its piece keeps it."""
    a = hk.KvAssembler(600_000, 60.0, 15.0)
    f1 = _from(_pieces(os.urandom(600_000), 1024, transfer="f-1", rid="rf1")[0], "forger")
    F = _from(_pieces(os.urandom(600_000), 1024, transfer="F", rid="rF")[0], "forger")
    assert a.add(f1, 0.0) == ""
    assert a.add(F, 0.0).startswith(hk.FULL_PREFIX) and list(a.queue) == ["F"]
    a.cancel("f-1", "rf1", "gone")  # room for F now: its asks are answered "", it never sends its piece
    ask = _from(hk.ask_of(F), "forger")
    use = 2.0  # hk.GRANT_USE_S (spelled so that the test fails on its behaviour before it)
    assert a.add(ask, 0.1) == "" and list(a.queue) == ["F"]
    real = _from(_pieces(os.urandom(100_000), 50_000, transfer="w0-1", rid="r1")[0], "worker-w0")
    assert a.add(real, 0.2).startswith(hk.FULL_PREFIX) and a.place("w0-1", 0.2) == 2  # F's turn: the piece may come
    assert a.add(ask, 0.25) == "" and a.place("F", 0.25) == 1  # a re-ask does not extend its turn (from 0.1)
    assert a.next_deadline() == pytest.approx(0.1 + use)
    assert a.add(real, 0.1 + use) == "" and "w0-1" in a.open and "F" not in a.queue
    assert a.counters["queue.unused_turns"] == 1 and hk.GRANT_USE_S == use
    # a piece that follows its turn in time is admitted
    w2 = _from(_pieces(os.urandom(600_000), 1024, transfer="w2-1", rid="r2")[0], "worker-w2")
    assert a.add(w2, 3.1).startswith(hk.FULL_PREFIX) and list(a.queue) == ["w2-1"]
    a.discard("w0-1")
    assert a.add(_from(hk.ask_of(w2), "worker-w2"), 3.2) == "" and a.add(w2, 4.9) == "" and "w2-1" in a.open
    assert a.counters["queue.unused_turns"] == 1 and not a.queue


def test_holding_counts_tickets_that_hold_others_back_at_most_per_sender():
    """Second review 55 L-a: every queued ticket counted in the decode node's ``NodeState.waiting`` (the planner's
    decode queue), so forged or idle tickets pushed the split. Now only tickets that hold another sender back count,
    at most ``per_sender`` of one sender."""
    a = hk.KvAssembler(600_000, 60.0, 15.0)
    assert a.add(_from(_pieces(os.urandom(590_000), 590_000, transfer="x", rid="rx")[0], "worker-w9"), 0.0) == ""
    assert a.add(_from(_pieces(os.urandom(10_000), 1024, transfer="f-1", rid="rf1")[0], "forger"), 0.0) == ""
    for i in range(5):  # cannot fit beside the forger's own 1 KiB: they hold nobody back
        c = _from(_pieces(os.urandom(600_000), 1024, transfer=f"f{i}", rid=f"rf{i}")[0], "forger")
        assert a.add(c, 0.1).startswith(hk.FULL_PREFIX)
    ws = [_from(_pieces(os.urandom(100_000), 100_000, transfer=f"w{i}", rid=f"rw{i}")[0], "worker-w0") for i in range(5)]
    for c in ws:
        assert a.add(c, 0.2).startswith(hk.FULL_PREFIX)
    assert len(a.queue) == 10 and a.holding(0.3) == 5 and a.holding(0.3, per_sender=2) == 2
    # rr-late55 M1: nothing frees for HEAD_HOLD_S (the most stuck node): its waiting hand-offs still count (before: 0,
    # the queue's progress clock let the tickets behind pass, and the node looked idle to the router)
    for t in (2.5, 5.0):
        for c in ws:
            assert a.add(_from(hk.ask_of(c), "worker-w0"), t).startswith(hk.FULL_PREFIX)
    assert a.holding(5.5) == 5


def test_a_discard_or_refusal_or_abort_drops_its_ticket_and_an_ask_without_data_asks_for_its_turn():
    """Review 55 M2: an aborted request's hand-off kept its place in the queue (``discard`` and ``refuse`` left its
    ticket) and was admitted ahead of live ones. M3: an ask carried a whole piece (up to 8 MiB); a data-less ask
    (``ask_of``) is answered "" when the transfer's turn came, stores nothing and keeps the ticket's place. L2: a
    piece of another sender (or rid, or total) naming a queued transfer is refused, not taken as its ask."""
    a = hk.KvAssembler(10_000, 60.0, 15.0)
    for c in _pieces(os.urandom(6000), 2048, transfer="t0", rid="r0"):
        assert a.add(c, 0.0) == ""
    new = {x: _pieces(os.urandom(6000), 2048, transfer=x, rid=f"r{x}") for x in "ABCD"}
    for i, x in enumerate("ABCD"):
        assert a.add(_from(new[x][0], f"s{x}", attempt=2, router="router-a"), 0.1 * i).startswith(hk.FULL_PREFIX)
    a.discard("A", "its request was aborted")
    a.refuse("B", "serves prefill now")
    assert list(a.queue) == ["C", "D"] and a.counters["queue.discarded"] == 2 and a.place("C", 0.5) == 1
    gone = a.tickets(lambda t: not (t.rid == "rC" and t.attempt <= 2), "its request was aborted")
    assert [t.transfer for t in gone] == ["C"] and list(a.queue) == ["D"]
    assert "its request was aborted" in a.add(_from(new["C"][0], "sC"), 0.6)  # a late piece of it: refused, not queued
    # L2: another sender's piece naming D's transfer is refused (D's ticket untouched), not counted as D's ask
    why = a.add(_from(new["D"][0], "sX"), 0.7)
    assert not why.startswith(hk.FULL_PREFIX) and "waits for room for sD" in why and a.queue["D"].asks == 1
    # M3: D asks without data: still no room, then its turn: "" and nothing stored, its place kept for the piece
    ask = _wire(_from(hk.ask_of(new["D"][1]), "sD"))
    assert ask.data == b"" and check(ask) is None
    assert a.add(ask, 0.8).startswith(hk.FULL_PREFIX) and a.place("D", 0.8) == 1 and a.queue["D"].asks == 2
    a.take("t0", "r0", 3, 6000)
    newcomer = _from(_pieces(os.urandom(1024), 1024, transfer="E", rid="rE")[0], "sE")
    assert a.add(ask, 0.9) == "" and "D" not in a.open and a.held_bytes == 0 and list(a.queue) == ["D"]
    assert a.add(newcomer, 0.95).startswith(hk.FULL_PREFIX)  # D's turn: a newcomer waits behind it
    assert a.add(_from(new["D"][1], "sD"), 1.0) == "" and "D" in a.open and a.held_bytes == 2048
    assert a.add(ask, 1.1) == ""  # an ask of a transfer let in: its pieces go
    assert a.counters["queue.asks"] == 3 and a.counters["queue.admitted"] == 1


def test_one_senders_tickets_are_bounded_and_a_buffer_the_kernel_refuses_gives_the_place_up(monkeypatch):
    """Review 55 L1: ``QUEUE_PER_SENDER`` keeps one sender from taking the whole queue (refused ``full`` without a
    place, counted ``queue.refused``); a ticket whose turn came but whose buffer the kernel refused (ENOMEM) leaves
    the queue, so the next one goes."""
    real_mmap = hk.mmap.mmap
    monkeypatch.setattr(hk, "QUEUE_PER_SENDER", 2)
    a = hk.KvAssembler(10_000, 60.0, 15.0)
    for c in _pieces(os.urandom(6000), 2048, transfer="t0", rid="r0"):
        assert a.add(c, 0.0) == ""
    xs = [_from(_pieces(os.urandom(6000), 2048, transfer=f"x{i}", rid=f"rx{i}")[0], "sx") for i in range(3)]
    assert a.add(xs[0], 0.1).startswith(hk.FULL_PREFIX) and a.add(xs[1], 0.2).startswith(hk.FULL_PREFIX)
    why = a.add(xs[2], 0.3)
    assert "its queue of transfers waiting for room is full (2 waiting)" in why and a.place("x2", 0.3) == 0
    assert a.counters["queue.refused"] == 1 and a.queue_by_src["sx"] == 2
    y = _from(_pieces(os.urandom(6000), 2048, transfer="y", rid="ry")[0], "sy")  # another sender still gets a place
    assert a.add(y, 0.4).startswith(hk.FULL_PREFIX) and a.place("y", 0.4) == 3
    a.take("t0", "r0", 3, 6000)

    def refuse(*_a: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hk.mmap, "mmap", refuse)
    assert "cannot allocate 6000 B" in a.add(xs[0], 0.5) and list(a.queue) == ["x1", "y"]
    assert a.counters["refused.nomem"] == 1
    monkeypatch.setattr(hk.mmap, "mmap", real_mmap)
    assert a.add(xs[1], 0.6) == "" and list(a.queue) == ["y"]


async def test_a_queued_hand_off_asks_without_data_and_an_abort_on_the_prefill_node_gives_its_place_up(monkeypatch):
    """Review 55 M3: a queued transfer's asks carried a whole piece each (up to 8 MiB, 20 a second): now one data-less
    ask (``ask_of``) every ``queue_poll_s``, the piece once its turn came. M2: an abort of a request whose hand-off
    waits in the decode node's queue kept its place there (the prefill node went on asking, up to
    ``--handoff-queue-wait-s``) and was admitted ahead of live ones: now the prefill node stops the hand-off and its
    ``KvCancel`` drops the ticket."""
    import time

    from services.worker.plan import HandOff
    from services.worker.service import _Owner

    monkeypatch.setattr(hk, "QUEUE_POLL_S", 0.001)
    pbus, dbus = _Bus(), _Bus()
    p, d = _worker("p", "prefill", pbus), _worker("d", "decode", dbus)
    kv = os.urandom(70_000)
    p.engine.handoff = lambda w: msgspec.structs.replace(w, kv=kv)  # type: ignore[method-assign]
    d._kv_in.max_bytes = 100_000
    for c in _pieces(os.urandom(40_000), 16_384, transfer="x-1", rid="rx"):  # 70,000 more do not fit
        assert d._kv_in.add(c, time.monotonic()) == ""
    queued = asyncio.Event()

    async def answer(c: m.KvChunk) -> m.KvChunkAck:
        ack = await d._on_kv_chunk(c, "")
        assert ack is not None
        if ack.queued and sum(1 for r in pbus.requests if not r.data) >= 5:
            queued.set()
        return ack

    pbus.answer = answer
    p._owners["r1"] = _Owner(attempt=0, router="")
    await p._handoff_aside(HandOff("r1", "d", _work(), 0.0))
    await asyncio.wait_for(queued.wait(), 5.0)
    asks = [r for r in pbus.requests if not r.data]
    assert len({r.index for r in asks}) == 1 and len(pbus.requests) - len(asks) == hk.WINDOW, pbus.requests
    assert list(d._kv_in.queue) and d._kv_in.counters["queue.asks"] >= 5
    # its turn comes: the ask is answered "", then the piece itself, then the rest
    d._kv_in.discard("x-1")
    while p._handing_off:
        await asyncio.sleep(0.001)
    assert not _errors(pbus) and p.counters["requests.handed_off"] == 1 and d._kv_in.counters["queue.admitted"] == 1
    (r1,) = d._kv_in.open
    assert d._kv_in.open[r1].complete and d._kv_in.held_bytes == 70_000
    # M2: aborted while queued: the prefill node stops its hand-off and the decode node's queue forgets it
    queued.clear()
    pbus.requests.clear()
    p._owners["r2"] = _Owner(attempt=0, router="")
    await p._handoff_aside(HandOff("r2", "d", _work("r2"), 0.0))
    await asyncio.wait_for(queued.wait(), 5.0)
    assert [t.rid for t in d._kv_in.queue.values()] == ["r2"]
    await p._on_abort(m.RequestAbort(rid="r2", reason="client went away"), "")
    while p._handing_off:
        await asyncio.sleep(0.001)
    assert p.counters["handoff.aborted"] == 1 and p.counters["requests.handoff_failed"] == 0
    cancels = [msg for t, msg, kw in pbus.published if t == "work.{node}.kvcancel"]
    assert [c.rid for c in cancels] == ["r2"]
    await d._on_kv_cancel(cancels[0], "")
    assert not d._kv_in.queue and d._kv_in.counters["queue.cancelled"] == 1
    # and an abort reaching the decode node drops its ticket too (its sender may not have heard)
    late = _from(_pieces(os.urandom(70_000), 16_384, transfer="p-2-9", rid="r3")[0], "worker-q")
    assert (await d._on_kv_chunk(late, "")).queued == 1
    await d._on_abort(m.RequestAbort(rid="r3", reason="gone"), "")
    assert not d._kv_in.queue and "its request was aborted" in (await d._on_kv_chunk(late, "")).error
    from services.worker.prom import worker_families

    fams = {f.name: f for f in worker_families(d)}  # L1: what the queue's metrics say of all this
    dropped = {s.labels["reason"]: s.value for s in fams["ei_node_handoff_queue_dropped"].samples}
    assert dropped == {"expired": 0.0, "cancelled": 1.0, "discarded": 1.0, "refused": 0.0, "unused_turn": 0.0}, dropped
    assert [s.value for s in fams["ei_node_handoff_queue_depth"].samples] == [0.0]
    waits = {s.name: s.value for s in fams["ei_node_handoff_queue_wait_seconds"].samples}
    assert waits["ei_node_handoff_queue_wait_seconds_count"] == 1.0, waits
    pf = {f.name: f for f in worker_families(p)}
    assert [s.value for s in pf["ei_node_handoffs_queued"].samples if s.name.endswith("_total")] == [2.0]
    await asyncio.gather(p.stop(), d.stop())


async def test_hand_offs_waiting_in_a_full_decode_nodes_queue_do_not_hold_up_the_prefill_nodes_other_work(monkeypatch):
    """Review 55 M1: the step loop waits when ``HANDOFF_SENDS_MAX`` hand-offs are being sent; those waiting in a full
    decode node's queue counted, so it waited up to ``--handoff-queue-wait-s`` (30 s) and every other request's
    first token with it (15 of a burst and the next probe: 30.5-31.6 s). Now queued ones count apart, bounded by
    ``HANDOFF_QUEUED_MAX`` and their bytes by ``--handoff-queued-bytes``: a hand-off to another decode node goes."""
    import time

    from services.worker import service as ws
    from services.worker.plan import HandOff

    monkeypatch.setattr(hk, "QUEUE_POLL_S", 0.001)
    monkeypatch.setattr(ws, "HANDOFF_SENDS_MAX", 2)
    monkeypatch.setattr(ws, "HANDOFF_QUEUED_MAX", 3)

    class _Two(_Bus):
        async def request(self, subject, msg, **kw):  # type: ignore[no-untyped-def]
            self.requests.append(msg)
            node = nodes[kw["node"]]
            ack = await node._on_kv_chunk(msgspec.msgpack.decode(m.encode(msg), type=subject.msg_type), "")
            for a in [a for a in node._kv_in.open.values() if a.complete and a.rid != "rx"]:  # its work takes it
                node._kv_in.take(a.transfer, a.rid, a.count, a.total)
            return ack

    pbus = _Two()
    p = _worker("p", "prefill", pbus)
    nodes = {"d": _worker("d", "decode", _Bus()), "e": _worker("e", "decode", _Bus())}
    p.engine.handoff = lambda w: msgspec.structs.replace(w, kv=os.urandom(70_000))  # type: ignore[method-assign]
    d = nodes["d"]
    d._kv_in.max_bytes = 100_000
    for c in _pieces(os.urandom(40_000), 16_384, transfer="x-1", rid="rx"):  # d is full: 70,000 more do not fit
        assert d._kv_in.add(c, time.monotonic()) == ""
    for i in range(3):  # before, the third waited here for one of the first two to end
        await asyncio.wait_for(p._handoff_aside(HandOff(f"d{i}", "d", _work(f"d{i}"), 0.0)), 2.0)
    for _ in range(2000):
        if p._queued_sends == 3:
            break
        await asyncio.sleep(0.001)
    assert p._queued_sends == 3 and p._queued_send_bytes == 210_000 and len(d._kv_in.queue) == 3, (p.counters, _errors(pbus), d._kv_in.counters)
    with pytest.raises(TimeoutError):  # bounded: HANDOFF_QUEUED_MAX waiting, the step waits
        await asyncio.wait_for(p._handoff_aside(HandOff("e0", "e", _work("e0"), 0.0)), 0.2)
    monkeypatch.setattr(ws, "HANDOFF_QUEUED_MAX", 16)
    p.cfg = msgspec.structs.replace(p.cfg, handoff_queued_bytes=210_000)
    with pytest.raises(TimeoutError):  # and by their bytes
        await asyncio.wait_for(p._handoff_aside(HandOff("e0", "e", _work("e0"), 0.0)), 0.2)
    p.cfg = msgspec.structs.replace(p.cfg, handoff_queued_bytes=hk.CHUNK_CAP_BYTES)
    await asyncio.wait_for(p._handoff_aside(HandOff("e1", "e", _work("e1"), 0.0)), 2.0)  # another decode node: goes
    for _ in range(2000):
        if p.counters["requests.handed_off"] == 1:
            break
        await asyncio.sleep(0.001)
    assert p.counters["requests.handed_off"] == 1 and p._queued_sends == 3 and not _errors(pbus)
    d._kv_in.discard("x-1")  # room on d: its three go, one after another
    while p._handing_off:
        await asyncio.sleep(0.001)
    assert p.counters["requests.handed_off"] == 4 and p._queued_sends == 0 and p._queued_send_bytes == 0 and not _errors(pbus)
    await asyncio.gather(p.stop(), *(n.stop() for n in nodes.values()))


async def test_a_decode_nodes_state_counts_the_hand_offs_waiting_in_its_queue_so_the_router_binds_elsewhere():
    """Review 55 M1's catch: the router kept binding requests to a full decode node (its state showed nothing
    waiting while hand-offs queued for its buffer). Now its ``NodeState.waiting`` counts them, and the router's
    decode choice (least ``running + waiting``) goes to another node."""
    import time

    from services.router.policy import NodeLoad, least_loaded_decode

    bus = _Bus()
    d = _worker("d", "decode", bus)
    d._kv_in.max_bytes = 10_000
    for c in _pieces(os.urandom(6000), 2048, transfer="x-1", rid="rx"):
        assert d._kv_in.add(c, time.monotonic()) == ""
    for i in range(2):
        c = _from(_pieces(os.urandom(6000), 2048, transfer=f"q-{i}", rid=f"rq{i}")[0], f"worker-p{i}")
        assert (await d._on_kv_chunk(c, "")).queued == i + 1
    await d._publish_state(d.clock.local_now())
    (st,) = [msg for _t, msg, _kw in bus.published if isinstance(msg, m.NodeState)]
    assert st.waiting == 2 and d._last_state_counts[1] == 2
    await d._publish_if_stopped(d.clock.local_now())  # nothing changed: no second state
    assert sum(isinstance(msg, m.NodeState) for _t, msg, _kw in bus.published) == 1
    loads = [NodeLoad("d", "decode", 0, 0, 0, st.running, st.waiting, st.decoding, 0, 0, 0.0, st),
             NodeLoad("e", "decode", 0, 0, 0, 1, 0, 1, 0, 0, 0.0, None)]  # fmt: skip
    choice = least_loaded_decode(loads)
    assert choice is not None and choice.node == "e"
    await d.stop()


async def test_an_abort_that_cancels_a_step_hand_off_before_it_started_leaves_no_stale_entry_and_new_work_goes_on():
    """A step's hand-off goes out from a task beside the step loop (``_handoff_aside``); an abort of its request
    (``work.<node>.abort``: the router re-dispatched it after its decode node was SIGKILLed, or dropped that attempt's
    first token) cancels that task. When the abort's handler ran in the same loop turn, before the task's first step,
    the task ended without running its body, so its ``finally`` never ran: its rid stayed in ``_handing_off`` (a done
    task), ``_deliveries`` and ``_sending_handoffs`` kept it. New work of the rid (the re-dispatched attempt) then
    looped in ``_newest_attempt`` forever (``asyncio.wait`` on the done task returns at once), and every later
    prefill work of the node queued behind it on its subscription: the real-bytes fault run's w0 went silent for 3
    minutes (session 58, trace_0045-3 / trace_0049-7). A drain (a phase switch) never ended either. Now the task's
    bookkeeping runs in its done callback, which runs whether or not the task started."""
    from services.worker.plan import HandOff
    from services.worker.service import _Owner

    bus = _Bus()
    p = _worker("p", "prefill", bus)
    p._owners["r1"] = _Owner(attempt=1, router="")
    await p._handoff_aside(HandOff("r1", "d", _work(attempt=1), 0.0))
    (delivery,) = p._deliveries
    assert p._handing_off["r1"] is delivery and p._sending_handoffs == 1
    # the abort's handler in the same turn: nothing awaited between, so the hand-off's task has not started
    await p._on_abort(m.RequestAbort(rid="r1", attempt=1, reason="re-dispatched"), "")
    assert delivery.cancelled() or delivery.cancelling() > 0
    assert p.counters["handoff.aborted"] == 1
    # the re-dispatched attempt's work: taken within a bound, not waited for forever
    ok = await asyncio.wait_for(p._newest_attempt("r1", 2, "", p.clock.local_now()), 2.0)
    assert ok
    assert delivery.cancelled()
    assert p._handing_off == {} and p._deliveries == set() and p._sending_handoffs == 0
    assert not [msg for t, msg, _ in bus.published if t == "work.{node}.decode"]  # the aborted hand-off never went out
    await p.stop()


async def test_a_finished_hand_off_left_registered_is_dropped_once_seen_twice_and_new_work_goes_on():
    """Defence behind ``_delivery_ended``: a hand-off task that is done but still in ``_handing_off`` after its done
    callbacks had their turn (its bookkeeping never ran) no longer makes new work of its rid loop for good; it is
    dropped, logged at error and counted (``handoff.stale_entries``). A task that has just ended, its callbacks not
    yet run, is waited for as before (one turn)."""
    bus = _Bus()
    p = _worker("p", "prefill", bus)

    async def nothing() -> None:
        return None

    stale = asyncio.get_running_loop().create_task(nothing())
    await stale
    p._handing_off["r1"] = stale  # as a hand-off whose bookkeeping never ran left it
    assert await asyncio.wait_for(p._newest_attempt("r1", 2, "", p.clock.local_now()), 2.0)
    assert p._handing_off == {} and p.counters["handoff.stale_entries"] == 1
    await p.stop()
