"""Builders shared by the KV directory's branch-count tests: a block size, a chained path whose
set iteration order is not its path order, one host/GPU store as a numbered event batch, and a
drain as plain tuples."""

from __future__ import annotations

from services.kvdirectory.core import KvDirectory
from shared.messages import BlockStored, KvEventBatch

BS = 16
# chained hashes whose set iteration order is not their path order (a frozenset of small ints
# iterates in value order; these do not)
H = [9_001 * (i * 37 % 23) + 17 * i + 3 for i in range(1, 21)]


def store(d: KvDirectory, node: str, hashes: list[int], tier: str, parent: int | None = None) -> None:
    """``node`` stores ``hashes`` (parent first, below ``parent``) in ``tier``, as the batch the directory awaits next."""
    seq = d._streams[d.node_id(node)].next_seq  # noqa: SLF001 - the batch it awaits
    ev = BlockStored(block_hashes=list(hashes), parent_block_hash=parent, tier=tier, block_size=BS)
    d.apply_kv_batch(KvEventBatch(node=node, seq=seq, ts=1.0, events=[ev]), 1.0)


def drained(d: KvDirectory) -> list[tuple[str, list[int], list[int]]]:
    """The directory's pending count messages as ``(node, hashes, counts)``."""
    return [(u.node, u.hashes, u.counts) for u in d.take_count_updates()]
