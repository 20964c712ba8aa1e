"""HostKvBuffer: slot allocation, deterministic payloads, checksums, leases (no I/O, explicit now)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.worker.kvpool.buffer import HostKvBuffer, PoolFull
from services.worker.kvpool.payload import checksum, expected_checksum, fill_payload, payload

SB = 4096


def test_put_allocates_distinct_slots_and_evict_frees_them():
    buf = HostKvBuffer(4, SB)
    slots = [buf.put(h, 0.0) for h in (11, 22, 33, 44)]
    assert sorted(slots) == [0, 1, 2, 3]
    assert all(buf.has(h) for h in (11, 22, 33, 44))
    with pytest.raises(PoolFull):
        buf.put(55, 0.0)
    assert buf.counters["pool_full"] == 1
    assert buf.evict(22, 0.0) is True
    assert buf.evict(22, 0.0) is False
    assert not buf.has(22)
    assert buf.put(55, 0.0) == slots[1]  # the freed slot is reused
    buf.check()
    assert buf.occupancy() == {"held": 4, "pending": 0, "free": 0, "released": 0}


def test_put_of_a_held_block_keeps_its_slot_and_bytes():
    buf = HostKvBuffer(2, SB)
    s = buf.put(7, 0.0)
    before = buf.view(7).copy()
    assert buf.put(7, 1.0) == s
    assert buf.counters["put_existing"] == 1
    assert np.array_equal(buf.view(7), before)
    assert buf.held == 1


def test_slot_views_do_not_overlap_and_follow_the_base_address():
    buf = HostKvBuffer(3, SB)
    for h in (1, 2, 3):
        buf.put(h, 0.0)
    for h in (1, 2, 3):
        slot = buf.slot(h)
        assert buf.view(h).ctypes.data == buf.base_addr + slot * SB
        assert np.array_equal(buf.view(h), payload(h, SB))
    assert buf.nbytes == 3 * SB


def test_synthetic_payload_is_deterministic_and_node_independent():
    a, b = HostKvBuffer(2, SB), HostKvBuffer(5, SB)
    b.put(999, 0.0)  # different slot layout on the other "node"
    a.put(12345, 0.0)
    b.put(12345, 0.0)
    assert a.slot(12345) != b.slot(12345)
    assert np.array_equal(a.view(12345), b.view(12345))
    assert a.stored_checksum(12345) == b.stored_checksum(12345) == expected_checksum(12345, SB)
    assert not np.array_equal(payload(12345, SB), payload(12346, SB))
    assert not np.array_equal(payload(-5, SB), payload(5, SB))  # signed int64 hashes are distinct seeds


def test_payload_prefix_property_and_odd_lengths():
    full = payload(42, 64)
    for n in (1, 7, 8, 13, 63):
        assert np.array_equal(payload(42, n), full[:n])
    with pytest.raises(ValueError):
        fill_payload(np.zeros(8, dtype=np.int32), 1)


def test_payload_has_no_short_period():
    # Mooncake slices transfers into 64 KiB pieces; two swapped pieces must change the bytes.
    p = payload(3, 256 * 1024)
    pieces = p.reshape(4, 64 * 1024)
    assert len({bytes(x[:64]) for x in pieces}) == 4


def test_flipped_byte_is_detected():
    buf = HostKvBuffer(2, SB)
    buf.put(77, 0.0)
    assert buf.verify(77)
    buf.view(77)[SB // 2] ^= 0x01
    assert not buf.verify(77)
    assert checksum(buf.view(77)) != buf.stored_checksum(77)


def test_checksum_matches_zlib_crc32():
    import zlib

    data = payload(9, 1000)
    assert checksum(data) == zlib.crc32(data.tobytes())
    assert checksum(data.tobytes()) == checksum(memoryview(data.tobytes()))


def test_external_payload_copies_and_pads():
    buf = HostKvBuffer(2, 64, payload="external")
    buf.put(1, 0.0, b"\x01\x02\x03")
    view = buf.view(1)
    assert bytes(view[:3]) == b"\x01\x02\x03" and not view[3:].any()
    assert buf.verify(1)
    with pytest.raises(ValueError):
        buf.put(2, 0.0, b"x" * 65)
    with pytest.raises(ValueError):
        buf.put(3, 0.0)
    with pytest.raises(ValueError):
        HostKvBuffer(2, 64).put(4, 0.0, b"x")


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        HostKvBuffer(0, SB)
    with pytest.raises(ValueError):
        HostKvBuffer(1, 8)
    with pytest.raises(ValueError):
        HostKvBuffer(1, SB, payload="weird")  # type: ignore[arg-type]


def test_locate_reports_offsets_checksums_and_misses():
    buf = HostKvBuffer(4, SB)
    buf.put(5, 0.0)
    buf.put(6, 0.0)
    locs = buf.locate([6, 404, 5], now=1.0, lease_s=2.0)
    assert locs[0] == (buf.slot(6) * SB, buf.stored_checksum(6))
    assert locs[1] is None
    assert locs[2] == (buf.slot(5) * SB, buf.stored_checksum(5))
    assert buf.counters["locate_hit"] == 2 and buf.counters["locate_miss"] == 1


def test_evicted_slot_under_lease_is_not_reused_until_the_lease_ends():
    buf = HostKvBuffer(1, SB)
    buf.put(1, 0.0)
    buf.locate([1], now=10.0, lease_s=5.0)  # a peer may read until t=15
    assert buf.evict(1, 11.0)
    assert buf.counters["evict_leased"] == 1
    assert buf.occupancy()["released"] == 1
    with pytest.raises(PoolFull, match="leased"):
        buf.put(2, 14.9)
    assert buf.put(2, 15.0) == 0  # lease over: the slot is reused
    buf.check()


def test_evict_without_lease_frees_at_once():
    buf = HostKvBuffer(1, SB)
    buf.put(1, 0.0)
    buf.locate([1], now=0.0, lease_s=1.0)
    buf.evict(1, 5.0)  # the lease ended before the eviction
    assert buf.put(2, 5.0) == 0


def test_reserve_commit_abort():
    buf = HostKvBuffer(3, SB)
    buf.put(1, 0.0)
    assert buf.reserve(1, 0.0) is None  # already held
    s = buf.reserve(2, 0.0)
    assert s is not None and buf.pending == 1
    assert buf.reserve(2, 0.0) is None  # already in flight
    assert not buf.has(2)  # pending blocks are invisible
    assert buf.locate([2], 0.0, 1.0) == [None]
    fill_payload(buf.slot_view(s), 2)
    assert buf.commit(2, checksum(buf.slot_view(s)))
    assert buf.has(2) and buf.verify(2)
    s3 = buf.reserve(3, 0.0)
    buf.abort(3)
    assert not buf.has(3) and buf.free == 1 and s3 is not None
    with pytest.raises(KeyError):
        buf.commit(3, 0)
    buf.check()


def test_commit_loses_to_a_local_put_during_the_transfer():
    buf = HostKvBuffer(3, SB)
    s = buf.reserve(9, 0.0)
    slot_put = buf.put(9, 0.0)  # the engine computed the block itself meanwhile
    assert slot_put != s
    assert buf.commit(9, 123) is False
    assert buf.slot(9) == slot_put and buf.verify(9)
    assert buf.counters["commit_superseded"] == 1
    buf.check()


def test_reserve_when_full_raises():
    buf = HostKvBuffer(1, SB)
    buf.reserve(1, 0.0)
    with pytest.raises(PoolFull):
        buf.reserve(2, 0.0)


def test_clear_evicts_everything():
    buf = HostKvBuffer(3, SB)
    for h in (1, 2, 3):
        buf.put(h, 0.0)
    assert buf.clear(0.0) == 3
    assert buf.held == 0 and buf.free == 3
    buf.check()


def test_random_operations_keep_the_slot_partition():
    rng = random.Random(5)
    buf = HostKvBuffer(8, 64)
    now = 0.0
    for _ in range(2000):
        now += rng.random()
        h = rng.randrange(20)
        op = rng.randrange(6)
        try:
            if op == 0:
                buf.put(h, now)
            elif op == 1:
                buf.evict(h, now)
            elif op == 2:
                buf.locate([h], now, rng.random() * 3)
            elif op == 3:
                buf.reserve(h, now)
            elif op == 4 and h in buf._pending:
                buf.commit(h, 0)
            elif op == 5 and h in buf._pending:
                buf.abort(h)
        except PoolFull:
            pass
        buf.check()


def test_kv_events_of_the_host_tier_drive_residency():
    from shared import messages as m

    buf = HostKvBuffer(3, SB)
    evs = [
        m.BlockStored(block_hashes=[1, 2], tier="gpu"),
        m.BlockStored(block_hashes=[1, 2], tier="host"),
        m.BlockStored(block_hashes=[2, 3, 4, 5], tier="host"),  # 2 already held; 5 finds no slot
    ]
    assert buf.apply_kv_events(evs, 0.0) == 3
    assert [buf.has(h) for h in (1, 2, 3, 4, 5)] == [True, True, True, False, False]
    assert buf.counters["put_full"] == 2
    assert buf.apply_kv_events([m.BlockRemoved(block_hashes=[1, 9], tier="host"), m.BlockRemoved(block_hashes=[2], tier="gpu")], 0.0) == 1
    assert not buf.has(1) and buf.has(2)
    assert buf.apply_kv_events([m.AllBlocksCleared(tier="gpu")], 0.0) == 0
    assert buf.apply_kv_events([m.AllBlocksCleared()], 0.0) == 2
    assert buf.held == 0
    buf.check()
    with pytest.raises(ValueError):
        HostKvBuffer(1, SB, payload="external").apply_kv_events([], 0.0)


def test_a_claimed_block_is_invisible_until_filled_and_a_filled_claim_wins_over_a_fetch():
    """Filled before the fetch commits, the claim is held and the fetch loses; a claim still unfilled when the
    verified fetch commits loses to it (the next test)."""
    buf = HostKvBuffer(4, SB, payload="external")
    assert buf.reserve(7, 0.0) is not None  # a fetch of 7 in flight
    s = buf.claim(7, 0.0)
    assert s is not None and buf.claim(7, 0.0) is None
    assert not buf.has(7) and buf.locate([7], 0.0, 5.0) == [None] and buf.reserve(7, 0.0) is None
    assert buf.occupancy() == {"held": 0, "pending": 2, "free": 2, "released": 0}
    buf.slot_view(s)[:] = 3
    assert buf.fill(7, s, checksum(buf.slot_view(s)), 0.0) is True
    assert buf.has(7) and buf.slot(7) == s and buf.verify(7)
    assert buf.commit(7, 0) is False  # the fetch lost: the engine's copy stays
    assert buf.claim(7, 0.0) is None  # held already
    buf.check()
    assert buf.occupancy() == {"held": 1, "pending": 0, "free": 3, "released": 0}


def test_a_fetch_that_lands_before_a_claim_is_filled_is_held_and_the_claim_cancelled():
    """A verified fetched page whose block was claimed (not held) meanwhile: before, the commit lost to the claim,
    so the fetch reported it held already while ``pin`` found nothing (the page cut, recomputed), and a claim
    filled without bytes then left the pool without it. Now the fetched bytes are held, the claim cancelled."""
    buf = HostKvBuffer(4, SB, payload="external")
    r = buf.reserve(42, 0.0)
    c = buf.claim(42, 0.0)  # the engine stores 42 in L2 while the fetch is in flight
    assert r is not None and c is not None and r != c
    buf.slot_view(r)[:] = 9
    assert buf.commit(42, checksum(buf.slot_view(r))) is True
    assert buf.has(42) and buf.slot(42) == r and buf.verify(42) and buf.pin(42) == r
    assert buf.counters["claim_superseded"] == 1 and buf.counters["commit_superseded"] == 0
    assert buf.occupancy() == {"held": 1, "pending": 0, "free": 2, "released": 1}  # the claim's copy may still run
    assert buf.fill(42, c, None, 0.0) is False  # the claim's copy, without bytes: the fetched page stays
    assert buf.has(42) and buf.slot(42) == r and buf.free == 3
    buf.unpin(r, 0.0)
    c2 = buf.claim(43, 0.0)
    d = buf.reserve(43, 0.0)
    assert c2 is not None and d is None  # a claim made before the fetch's reserve: no fetch at all
    assert buf.fill(43, c2, 7, 0.0) is True
    buf.check()


def test_an_evicted_claim_keeps_its_slot_until_filled():
    buf = HostKvBuffer(2, SB, payload="external")
    s = buf.claim(7, 0.0)
    assert buf.evict(7, 0.0) is False and buf.counters["claim_cancelled"] == 1
    assert buf.free == 1 and buf.released == 1  # the copy may still be writing it
    t = buf.claim(7, 0.0)  # stored again: a new claim, another slot
    assert t != s
    with pytest.raises(PoolFull):
        buf.claim(8, 0.0)
    assert buf.fill(7, s, 123, 0.0) is False  # the old claim's copy: not held, its slot back
    assert not buf.has(7) and buf.free == 1
    assert buf.fill(7, t, 456, 0.0) is True and buf.stored_checksum(7) == 456
    u = buf.claim(9, 0.0)
    assert buf.fill(9, u, None, 0.0) is False and buf.counters["claim_unfilled"] == 1  # no bytes: freed
    buf.check()
    assert buf.occupancy() == {"held": 1, "pending": 0, "free": 1, "released": 0}


def test_a_pinned_slot_is_not_reused_until_its_last_unpin():
    buf = HostKvBuffer(2, SB, payload="external")
    s = buf.put(7, 0.0, b"\x05" * SB)
    assert buf.pin(7) == s and buf.pin(7) == s and buf.pin(8) is None
    buf.locate([7], 0.0, 5.0)  # a peer's lease, too
    assert buf.evict(7, 1.0)
    assert not buf.has(7) and buf.released == 1
    t = buf.put(8, 1.0, b"\x06" * SB)
    assert t != s
    with pytest.raises(PoolFull):
        buf.reserve(9, 1.0)
    assert (buf.slot_view(s) == 5).all()  # the pinned bytes are still the block's
    buf.unpin(s, 1.0)
    with pytest.raises(PoolFull):
        buf.reserve(9, 1.0)
    buf.unpin(s, 2.0)  # the last pin: the lease (until 5.0) still holds it
    assert buf.released == 1
    assert buf.reserve(9, 6.0) == s
    with pytest.raises(KeyError):
        buf.unpin(s, 6.0)
    buf.check()


def test_claim_events_of_the_host_tier_claim_evict_and_clear():
    from shared import messages as m

    buf = HostKvBuffer(3, SB, payload="external")
    claims = buf.claim_events(
        [
            m.BlockStored(block_hashes=[1, 2], tier="gpu"),
            m.BlockStored(block_hashes=[1, 2], tier="host"),
            m.BlockStored(block_hashes=[2, 3, 4], tier="host"),  # 2 claimed already; 4 finds no slot
            m.BlockRemoved(block_hashes=[3], tier="host"),  # 3's claim cancelled
        ],
        0.0,
    )
    assert [h for h, _ in claims] == [1, 2, 3] and buf.counters["put_full"] == 1
    assert [buf.fill(h, slot, 0, 0.0) for h, slot in claims] == [True, True, False]
    [(h5, s5)] = buf.claim_events([m.AllBlocksCleared(tier="host"), m.BlockStored(block_hashes=[5], tier="host")], 0.0)
    assert h5 == 5 and buf.held == 0 and buf.pending == 1
    buf.claim_events([m.AllBlocksCleared()], 0.0)
    assert buf.pending == 0 and buf.released == 1  # the claim of 5 cancelled, its slot kept until filled
    assert buf.fill(5, s5, 0, 0.0) is False
    assert buf.occupancy() == {"held": 0, "pending": 0, "free": 3, "released": 0}
    buf.check()
    with pytest.raises(ValueError):
        HostKvBuffer(1, SB).claim_events([], 0.0)


def test_random_claims_and_pins_never_hand_out_a_slot_in_use():
    """Claims, fills, pins and unpins among puts, evictions, fetches and leases: the slots partition, and no
    allocation hands out a slot that is pinned or claimed (a copy in another thread may be reading or writing it)."""
    rng = random.Random(11)
    buf = HostKvBuffer(8, 64, payload="external")
    now = 0.0
    claims: list[tuple[int, int]] = []
    pins: list[int] = []
    for _ in range(4000):
        now += rng.random()
        h = rng.randrange(20)
        op = rng.randrange(9)
        busy = set(pins) | {slot for _, slot in claims}
        try:
            if op == 0:
                got = None if buf.has(h) else buf.put(h, now, b"\x01")
            elif op == 1:
                buf.evict(h, now)
                got = None
            elif op == 2:
                buf.locate([h], now, rng.random() * 3)
                got = None
            elif op == 3:
                got = buf.reserve(h, now)
            elif op == 4 and h in buf._pending:
                buf.commit(h, 0) if rng.random() < 0.5 else buf.abort(h)
                got = None
            elif op == 5:
                got = buf.claim(h, now)
                if got is not None:
                    claims.append((h, got))
            elif op == 6 and claims:
                ch, cs = claims.pop(rng.randrange(len(claims)))
                buf.fill(ch, cs, None if rng.random() < 0.2 else 0, now)
                got = None
            elif op == 7:
                got = None
                if (slot := buf.pin(h)) is not None:
                    pins.append(slot)
            elif op == 8 and pins:
                buf.unpin(pins.pop(rng.randrange(len(pins))), now)
                got = None
            else:
                got = None
        except PoolFull:
            got = None
        assert got is None or got not in busy, f"slot {got} handed out while pinned or claimed"
        buf.check()


def test_pool_messages_roundtrip():
    from shared import messages as m
    from shared.bus import decoder_for
    from shared.subjects import KV_POOL

    req = m.PoolLocate(node="w1", block_hashes=[-(2**63), 2**63 - 1], lease_s=1.5)
    rep = m.PoolLocation(
        node="w1", session="127.0.0.1:21001", base_addr=2**47 - 4096, slot_bytes=SB,
        block_hashes=req.block_hashes, offsets=[0, -1], checksums=[2**32 - 1, 0],
    )  # fmt: skip
    assert decoder_for(KV_POOL.msg_type).decode(m.encode(req)) == req
    assert decoder_for(KV_POOL.reply_type).decode(m.encode(rep)) == rep


def test_pool_full_names_every_state_that_fills_the_pool():
    """A pool filled by claimed slots (the engine's bytes being copied) and let-go ones (evicted while
    pinned, or a claim cancelled before its fill) read "0 held, 0 pending": the message counted held and
    reserved slots only. Now it names each state, and the counts add up to the pool."""
    buf = HostKvBuffer(6, SB, payload="external")
    buf.put(1, 0.0, b"x")  # held
    assert buf.reserve(2, 0.0) is not None  # a fetch in flight
    assert buf.claim(3, 0.0) is not None  # claimed, not filled yet
    assert buf.claim(4, 0.0) is not None
    buf.evict(4, 0.0)  # claim cancelled: let go, freed at its fill
    buf.put(5, 0.0, b"y")
    buf.pin(5)
    buf.evict(5, 0.0)  # evicted while pinned: let go, freed at its unpin
    buf.put(6, 0.0, b"z")
    buf.locate([6], now=0.0, lease_s=5.0)
    buf.evict(6, 1.0)  # evicted, leased to a peer until t=5
    buf.check()
    with pytest.raises(PoolFull) as e:
        buf.put(7, 2.0, b"w")
    assert str(e.value) == (
        "all 6 slots in use (1 held, 1 pending, 1 claimed, 2 let go while pinned, 1 evicted but leased until >= 5.000)"
    )
    only = HostKvBuffer(2, SB, payload="external")
    only.claim(1, 0.0)
    only.claim(2, 0.0)
    only.evict(2, 0.0)
    with pytest.raises(PoolFull, match=r"^all 2 slots in use \(0 held, 0 pending, 1 claimed, 1 let go while pinned\)$"):
        only.claim(3, 0.0)
