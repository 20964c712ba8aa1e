"""The decisions of a fetch, without I/O: which blocks to read into which slots, and what to keep.

``HostKvPool.fetch`` is: ``plan_fetch`` → (transfer + CRC in a thread) →
``settle_fetch``. Both steps are synchronous and only touch the
:class:`~services.worker.kvpool.buffer.HostKvBuffer` bookkeeping, so the
verification rules are unit-tested without Mooncake or NATS.

Rules:

* a block the holder does not have (offset −1) is missing (``not_held``);
* a block needs a free local slot (``no_room`` otherwise) and must not be in
  flight already (``busy``);
* a transferred block is kept only if the CRC-32 of the bytes that landed
  equals the holder's advertised CRC and, when an expected CRC is given (the
  one this node derives from the hash for synthetic payloads), that one too;
  otherwise it is **mismatched**: counted, its slot freed, reported missing,
  never used;
* a block that became held locally during the transfer keeps the local copy;
  one only claimed meanwhile (its bytes not written yet) takes the fetched
  copy, and its claim is cancelled (``HostKvBuffer.commit``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.worker.kvpool.buffer import HostKvBuffer, PoolFull


@dataclass(frozen=True, slots=True)
class PlannedRead:
    """One block to pull: into ``local_slot`` from the holder's ``remote_offset``."""

    block_hash: int
    local_slot: int
    remote_offset: int
    advertised_crc: int


@dataclass(slots=True)
class FetchPlan:
    """Reads to issue (their local slots are reserved) and blocks already known to be missing."""

    reads: list[PlannedRead] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class FetchOutcome:
    """What ``settle_fetch`` kept and dropped (hashes in plan order)."""

    fetched: list[int] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)
    """Transferred and verified, but a local ``put`` (or ``fill``) made the block held meanwhile."""
    missing: list[int] = field(default_factory=list)
    mismatched: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0


def _bump(reasons: dict[str, int], key: str) -> None:
    reasons[key] = reasons.get(key, 0) + 1


def plan_fetch(
    buffer: HostKvBuffer, hashes: Sequence[int], offsets: Sequence[int], checksums: Sequence[int], now: float
) -> FetchPlan:
    """Reserve a local slot for every block the holder has (``offsets[i] >= 0``).

    Raises:
        ValueError: if the three lists differ in length.
    """
    if not (len(hashes) == len(offsets) == len(checksums)):
        raise ValueError(f"ragged location: {len(hashes)} hashes, {len(offsets)} offsets, {len(checksums)} checksums")
    plan = FetchPlan()
    full = False
    for h, off, crc in zip(hashes, offsets, checksums):
        if off < 0:
            plan.missing.append(h)
            _bump(plan.reasons, "not_held")
            continue
        slot = None
        if not full:
            try:
                slot = buffer.reserve(h, now)
            except PoolFull:
                full = True
        if full:
            plan.missing.append(h)
            _bump(plan.reasons, "no_room")
            continue
        if slot is None:
            plan.missing.append(h)
            _bump(plan.reasons, "busy")
            continue
        plan.reads.append(PlannedRead(h, slot, off, crc))
    return plan


def cancel_plan(buffer: HostKvBuffer, plan: FetchPlan) -> None:
    """Give back every slot the plan reserved (the transfer did not run)."""
    for r in plan.reads:
        buffer.abort(r.block_hash)


def settle_fetch(
    buffer: HostKvBuffer,
    plan: FetchPlan,
    *,
    failed: set[int],
    crcs: Sequence[int],
    expected: Mapping[int, int] | None = None,
) -> FetchOutcome:
    """Commit verified blocks, free the rest, count everything in ``buffer.counters``.

    Args:
        failed: indices into ``plan.reads`` whose transfer failed.
        crcs: CRC-32 of each read's landed slot (ignored for failed reads).
        expected: hash → CRC derived locally from the hash (synthetic payloads);
            None to check against the holder's CRC only.

    Raises:
        ValueError: if ``crcs`` does not match ``plan.reads`` in length.
        KeyError: if ``expected`` lacks a transferred block.
    """
    if len(crcs) != len(plan.reads):
        raise ValueError(f"{len(crcs)} CRCs for {len(plan.reads)} reads")
    out = FetchOutcome(missing=list(plan.missing), reasons=dict(plan.reasons))
    c = buffer.counters
    for i, r in enumerate(plan.reads):
        h = r.block_hash
        if i in failed:
            buffer.abort(h)
            out.missing.append(h)
            _bump(out.reasons, "transfer")
            c["fetch_transfer_failed"] += 1
            continue
        out.bytes_moved += buffer.slot_bytes
        ok = crcs[i] == r.advertised_crc and (expected is None or expected[h] == r.advertised_crc)
        if not ok:
            buffer.abort(h)
            out.missing.append(h)
            out.mismatched.append(h)
            _bump(out.reasons, "mismatch")
            c["fetch_mismatch"] += 1
            continue
        if buffer.commit(h, crcs[i]):
            out.fetched.append(h)
        else:
            out.superseded.append(h)
    c["fetch_blocks"] += len(out.fetched)
    c["fetch_bytes"] += out.bytes_moved
    c["fetch_missing"] += len(out.missing)
    return out
