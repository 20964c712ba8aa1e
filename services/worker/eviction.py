"""Eviction order of KV blocks: one key function per policy, O(1) ordered groups.

Contains zero I/O: no clock, no asyncio, no logging setup (DESIGN §2).

An eviction policy is a key function in the spirit of SGLang's
``python/sglang/srt/mem_cache/evict_policy.py`` (STYLE §3.3): blocks are evicted
in ascending order of ``key(block) = (group(block), block.last_access)``.

* ``lru``: ``group = 0`` for every block, so the key is the last access alone.
* ``branch-count``: ``group = 1[count > 0]`` — the paper's host eviction key
  ``(1[R_b > 0], T_b)`` (paper §5.3, Alg. E.2 ``EvictHost``): blocks no active
  branch references go first, LRU inside each group.

:class:`EvictionQueue` realises this order without a heap. Every block that
enters a group gets the pool's newest ``last_access`` stamp (a per-pool logical
clock), so appending to the tail of an ``OrderedDict`` keeps each group sorted
by stamp; popping the head of the first non-empty group yields the minimum
key. Insert, remove, pop and a group move are all O(1). A group move (a branch
count crossing 0 ↔ positive) is stamped like an access: the block goes to the
tail of its new group, and the queued ancestors in that group that are older
than it are stamped newer again, so a parent is never evicted before its
child. That is the one place where this order departs from a strict
``(group, T_b)`` sort by access time; it, and the order in which one message's
moves are made (chains of moved blocks, each deepest first), are documented in
the worker README.
"""

from __future__ import annotations

from collections import OrderedDict
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


class EvictionQueue:
    """Evictable blocks in ascending ``(group, last_access)`` order, O(1) per operation.

    The caller stamps ``block.last_access`` with a value larger than every stamp
    already queued before :meth:`push` (or :meth:`regroup`); the queue stores the
    group it filed the block under in ``block.group``.
    """

    __slots__ = ("policy", "groups", "single")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.groups: list[OrderedDict[int, Evictable]] = [OrderedDict() for _ in range(policy.groups)]
        """One ordered dict (hash → block) per group, evicted from group 0's head first.
        Hot loops of the block pools use it directly; everyone else uses the methods."""
        self.single = policy.groups == 1
        """True when every block is in group 0 (``lru``): pools skip the key call."""

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)

    def __contains__(self, block_hash: int) -> bool:
        return any(block_hash in g for g in self.groups)

    def push(self, block: Evictable) -> None:
        """Append ``block`` to the tail of its group (it must carry the newest stamp)."""
        g = self.policy.group(block)
        block.group = g
        self.groups[g][block.hash] = block

    def remove(self, block: Evictable) -> None:
        """Take ``block`` out of the queue. Raises KeyError if it is not queued."""
        del self.groups[block.group][block.hash]

    def pop(self) -> Evictable | None:
        """Remove and return the block with the lowest key, or None when empty."""
        for g in self.groups:
            if g:
                return g.popitem(last=False)[1]
        return None

    def regroup(self, block: Evictable) -> bool:
        """Move a queued block whose group changed to the tail of its new group.

        The caller stamps ``block.last_access`` first. Returns True if it moved.
        """
        g = self.policy.group(block)
        if g == block.group:
            return False
        del self.groups[block.group][block.hash]
        block.group = g
        self.groups[g][block.hash] = block
        return True

    def touch(self, block: Evictable) -> None:
        """Move a queued block to the tail of its group (the caller stamps it newest)."""
        self.groups[block.group].move_to_end(block.hash)

    def ordered(self) -> list[Evictable]:
        """Every queued block in eviction order (O(n); for checks and tests)."""
        return [b for g in self.groups for b in g.values()]
