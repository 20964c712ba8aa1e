"""Eviction order of KV blocks: one key function per policy.

Contains zero I/O: no clock, no asyncio, no logging setup (DESIGN §2).

An eviction policy is a key function in the spirit of SGLang's
``python/sglang/srt/mem_cache/evict_policy.py`` (STYLE §3.3): blocks are evicted
in ascending order of ``key(block) = (group(block), block.last_access)``.

* ``lru``: ``group = 0`` for every block, so the key is the last access alone.
* ``branch-count``: ``group = 1[count > 0]`` — the paper's host eviction key
  ``(1[R_b > 0], T_b)`` (paper §5.3, Alg. E.2 ``EvictHost``): blocks no active
  branch references go first, LRU inside each group.

The block pools (``blocks.py``) realise this order without a heap: every block
that enters a group gets the pool's newest ``last_access`` stamp (a per-pool
logical clock), so appending to the tail of a group's queue keeps it sorted by
stamp, and the head of the first non-empty group has the minimum key; the
pools keep each queue as runs of blocks (consecutive pages of one sequence,
stamped deepest first). The per-block form, one ``OrderedDict`` per group, is
the reference model's ``EvictionQueue`` (``tests/unit/worker/ref_blocks.py``).
A group move (a branch count crossing 0 ↔ positive) is stamped like an access:
the block goes to the tail of its new group, and the queued ancestors in that
group that are older than it are stamped newer again, so a parent is never
evicted before its child. That is the one place where this order departs from
a strict ``(group, T_b)`` sort by access time; it, and the order in which one
message's moves are made (chains of moved blocks, each deepest first), are
documented in the worker README.
"""

from __future__ import annotations

from typing import Protocol


class Evictable(Protocol):
    """What a policy needs to see of a block."""

    hash: int
    last_access: int
    count: int
    group: int


class EvictionPolicy(Protocol):
    """A key function ``(group(block), block.last_access)``; lower keys go first."""

    name: str
    groups: int
    """Number of groups; ``group()`` returns a value in ``range(groups)``."""

    def group(self, block: Evictable) -> int: ...


class LruPolicy:
    """Least recently used: one group, ordered by last access."""

    name = "lru"
    groups = 1

    def group(self, block: Evictable) -> int:
        return 0


class BranchCountPolicy:
    """Paper §5.3: zero-count blocks first, then positive-count ones, LRU inside each."""

    name = "branch-count"
    groups = 2

    def group(self, block: Evictable) -> int:
        return 1 if block.count > 0 else 0


POLICIES: dict[str, EvictionPolicy] = {"lru": LruPolicy(), "branch-count": BranchCountPolicy()}
"""Registry of eviction policies by name (no if/elif over strings)."""


def get_policy(name: str) -> EvictionPolicy:
    """Look up a policy by name.

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
