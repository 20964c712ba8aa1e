"""Finer block sizes for every valid trace: ids up to MAX_BLOCK_ID (e.g. the mini-swe-agent
converter's 47-bit hashes) split into fresh ids that keep prefix identity; small ids keep
``b*m + k`` exactly; sizes that do not divide say what would."""

from __future__ import annotations

import pytest

from evolving_infra.sim.run import convert_block_size
from evolving_infra.traces.compact import compact_requests
from evolving_infra.traces.schema import FORMAT, MAX_BLOCK_ID, TraceHeader, TraceRequest
from evolving_infra.traces.tokens import PRIVATE_ID_BASE, PrivateIds, rechunk_blocks

BIG = 118409032647414  # the id the newcomer's mini-swe-agent trace was refused on (47-bit hash)


def R(rid: str, blocks: list[int], n_in: int | None = None, branch: str = "a:main") -> TraceRequest:
    return TraceRequest(id=rid, agent="a", branch=branch, input_tokens=n_in if n_in is not None else 64 * len(blocks),
                        output_tokens=2, blocks=blocks)


def test_large_ids_split_keeping_prefix_identity() -> None:
    priv = PrivateIds()
    a = rechunk_blocks([5, BIG, MAX_BLOCK_ID], 3 * 64, 64, 4, private=priv)
    b = rechunk_blocks([5, BIG, BIG - 1], 3 * 64, 64, 4, private=priv)
    c = rechunk_blocks([BIG], 64, 64, 4, private=priv)
    assert len(a) == len(b) == 48 and len(c) == 16
    assert a[:16] == [5 * 16 + k for k in range(16)]  # small ids: b*m+k exactly, as before
    assert a[16:32] == b[16:32] == c  # fine block k of BIG is the same id wherever BIG appears
    assert all(PRIVATE_ID_BASE <= x <= MAX_BLOCK_ID for x in a[16:] + b[32:])
    assert len(set(a[16:]) | set(b[32:])) == 48  # distinct coarse blocks, distinct fine ids
    # deterministic: a new allocator, the same calls in the same order, the same ids
    priv2 = PrivateIds()
    assert rechunk_blocks([5, BIG, MAX_BLOCK_ID], 3 * 64, 64, 4, private=priv2) == a
    # dense in first-appearance order
    assert a[16] == PRIVATE_ID_BASE and a[32] == PRIVATE_ID_BASE + 16 and b[32] == PRIVATE_ID_BASE + 32
    with pytest.raises(ValueError, match="PrivateIds"):
        rechunk_blocks([BIG], 64, 64, 4)  # fresh ids needed but no allocator
    with pytest.raises(ValueError, match=r"outside \[0, "):
        rechunk_blocks([MAX_BLOCK_ID + 1], 64, 64, 4, private=PrivateIds())


def test_simulator_conversion_takes_large_ids_list_and_compact() -> None:
    reqs = [R("r0", [7, BIG]), R("r1", [7, BIG, BIG + 1], n_in=3 * 64 + 10),
            R("s0", [7, BIG + 2], branch="a:s1")]
    header = TraceHeader(format=FORMAT, source="test", block_size=64)
    plain = convert_block_size(reqs, 64, 4)
    compact = convert_block_size(compact_requests(header, reqs), 64, 4)
    got = [compact.blocks_of(r) for r in compact.requests]
    assert got == [r.blocks for r in plain]
    r0, r1, s0 = (r.blocks for r in plain)
    assert r1[:32] == r0 and s0[:16] == r0[:16] and s0[16] not in set(r0)
    assert len(r1) == (3 * 64 + 10) // 4  # the tail's two full fine blocks are private
    assert len(set(r1[32:])) == len(r1) - 32 and not set(r1[32:]) & set(s0)


def test_sizes_that_do_not_divide_say_what_would() -> None:
    with pytest.raises(ValueError, match=r"divide 48 or be a multiple of it \(e\.g\. .*96"):
        rechunk_blocks([1], 48, 48, 64)
    with pytest.raises(ValueError, match="convert the source again at 48 tokens"):
        rechunk_blocks([1], 64, 64, 48)
