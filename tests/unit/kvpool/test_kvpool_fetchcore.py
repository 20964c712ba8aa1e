"""Fetch planning and settlement: the verification rules, with an in-process copy as the "transfer"."""

from __future__ import annotations

import pytest

from services.worker.kvpool.buffer import HostKvBuffer
from services.worker.kvpool.fetchcore import cancel_plan, plan_fetch, settle_fetch
from services.worker.kvpool.payload import checksum, expected_checksum

SB = 2048


def _holder(hashes):
    src = HostKvBuffer(len(hashes) + 2, SB)
    for h in hashes:
        src.put(h, 0.0)
    return src


def _copy(src: HostKvBuffer, dst: HostKvBuffer, plan) -> list[int]:
    """What Mooncake does: byte copy holder slot → reserved local slot; then the CRC of what landed."""
    for r in plan.reads:
        dst.slot_view(r.local_slot)[:] = src.memory[r.remote_offset : r.remote_offset + SB]
    return [checksum(dst.slot_view(r.local_slot)) for r in plan.reads]


def _locate(src, hashes):
    locs = src.locate(hashes, 0.0, 5.0)
    return [-1 if x is None else x[0] for x in locs], [0 if x is None else x[1] for x in locs]


def test_every_block_verifies_and_is_committed():
    hashes = [101, 102, 103, 104]
    src, dst = _holder(hashes), HostKvBuffer(8, SB)
    offs, crcs = _locate(src, hashes)
    plan = plan_fetch(dst, hashes, offs, crcs, 0.0)
    landed = _copy(src, dst, plan)
    out = settle_fetch(dst, plan, failed=set(), crcs=landed, expected={h: expected_checksum(h, SB) for h in hashes})
    assert out.fetched == hashes and not out.missing and not out.mismatched
    assert out.bytes_moved == 4 * SB
    assert all(dst.has(h) and dst.verify(h) for h in hashes)
    assert dst.counters["fetch_blocks"] == 4 and dst.counters["fetch_mismatch"] == 0
    dst.check()


def test_corrupted_holder_slot_is_a_counted_mismatch_and_never_used():
    hashes = [1, 2, 3]
    src, dst = _holder(hashes), HostKvBuffer(8, SB)
    src.view(2)[100] ^= 0xFF  # flipped after the CRC was recorded
    offs, crcs = _locate(src, hashes)
    plan = plan_fetch(dst, hashes, offs, crcs, 0.0)
    out = settle_fetch(dst, plan, failed=set(), crcs=_copy(src, dst, plan))
    assert out.mismatched == [2] and out.missing == [2] and out.fetched == [1, 3]
    assert not dst.has(2)
    assert dst.counters["fetch_mismatch"] == 1
    assert out.reasons == {"mismatch": 1}
    assert dst.free == 8 - 2  # the mismatched block's slot was given back
    dst.check()


def test_identity_check_catches_wrong_bytes_under_a_consistent_crc():
    # The holder stored block 8's payload under hash 7 (its CRC is self-consistent).
    src = HostKvBuffer(2, SB, payload="external")
    src.put(7, 0.0, HostKvBuffer(1, SB).memory)  # zeros: not the synthetic payload of 7
    offs, crcs = _locate(src, [7])
    dst = HostKvBuffer(2, SB)
    plan = plan_fetch(dst, [7], offs, crcs, 0.0)
    landed = _copy(src, dst, plan)
    assert landed == crcs  # the transfer itself was fine
    out = settle_fetch(dst, plan, failed=set(), crcs=landed, expected={7: expected_checksum(7, SB)})
    assert out.mismatched == [7] and not dst.has(7)


def test_not_held_no_room_busy_and_transfer_failures_are_missing_with_reasons():
    hashes = [1, 2, 3, 4, 5]
    src, dst = _holder([1, 2, 3, 5]), HostKvBuffer(3, SB)
    dst.reserve(2, 0.0)  # block 2 is already in flight in another fetch
    offs, crcs = _locate(src, hashes)
    plan = plan_fetch(dst, hashes, offs, crcs, 0.0)
    # 1 → slot, 2 → busy, 3 → slot, 4 → not held, 5 → no room (3 slots: one pending + 2 reserved)
    assert [r.block_hash for r in plan.reads] == [1, 3]
    assert plan.reasons == {"busy": 1, "not_held": 1, "no_room": 1}
    landed = _copy(src, dst, plan)
    out = settle_fetch(dst, plan, failed={1}, crcs=landed)
    assert out.fetched == [1]
    assert sorted(out.missing) == [2, 3, 4, 5]
    assert out.reasons["transfer"] == 1 and not out.mismatched
    assert out.bytes_moved == SB
    assert dst.counters["fetch_transfer_failed"] == 1
    dst.abort(2)
    dst.check()


def test_local_put_during_transfer_supersedes_the_fetched_copy():
    src, dst = _holder([1]), HostKvBuffer(4, SB)
    offs, crcs = _locate(src, [1])
    plan = plan_fetch(dst, [1], offs, crcs, 0.0)
    landed = _copy(src, dst, plan)
    dst.put(1, 0.0)
    out = settle_fetch(dst, plan, failed=set(), crcs=landed)
    assert out.superseded == [1] and not out.fetched and not out.missing
    dst.check()


def test_a_claim_during_the_transfer_loses_to_the_verified_fetched_copy():
    """The reviewer's case: reserve(42), claim(42), settle_fetch. Before: fetched [], superseded [42] while
    the pool held nothing to pin; now the fetched bytes are held (and pinnable) and the claim is cancelled."""
    src, dst = _holder([42]), HostKvBuffer(4, SB, payload="external")
    offs, crcs = _locate(src, [42])
    plan = plan_fetch(dst, [42], offs, crcs, 0.0)
    c = dst.claim(42, 0.0)
    landed = _copy(src, dst, plan)
    out = settle_fetch(dst, plan, failed=set(), crcs=landed)
    assert out.fetched == [42] and not out.superseded and not out.missing
    s = dst.pin(42)
    assert s is not None and dst.has(42) and dst.verify(42)
    assert dst.fill(42, c, None, 0.0) is False and dst.has(42)  # the claim filled without bytes: the fetch stays
    dst.unpin(s, 0.0)
    dst.check()


def test_cancel_plan_frees_reservations_and_bad_inputs_are_refused():
    src, dst = _holder([1, 2]), HostKvBuffer(4, SB)
    offs, crcs = _locate(src, [1, 2])
    plan = plan_fetch(dst, [1, 2], offs, crcs, 0.0)
    with pytest.raises(ValueError):
        settle_fetch(dst, plan, failed=set(), crcs=[0])
    cancel_plan(dst, plan)
    assert dst.pending == 0 and dst.free == 4
    with pytest.raises(ValueError):
        plan_fetch(dst, [1, 2], [0], [0, 0], 0.0)
