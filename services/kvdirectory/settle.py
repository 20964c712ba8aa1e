"""Whether a (re)started KV directory has rebuilt its branch table from the routers' republish (sans-IO).

A directory keeps its branch table in memory. At start it publishes ``branch.sync`` and every router that hears it
republishes its active branches (``BranchStart``, oldest first, each followed by its latest ``RoutePlaced``) on the
reliable ``branch.events`` / ``route.placed``: ``services/router/branches.py`` ``BranchTable.republish``. Until that
republish has been read, ``branch.query`` answers ``unknown`` for a branch a router holds, and the router asking
would answer the harness's end 404, losing it (its counts held until the TTL, 1,800 s). So the answer says whether
the directory has settled (``BranchQueryReply.synced``), and a router turns an ``unknown`` while not settled into a
503 with ``Retry-After: 1`` (retried), not a 404.

How long the republish takes: ``branch.sync`` is a core NATS publish each router reads within milliseconds; the
router then publishes 1 + (0 to 2 placements) messages a branch back to back, giving its event loop back every 256
(``services/router/service.py`` ``REPUBLISH_YIELD_EVERY``), and the directory reads them in order from the stream.
Measured (router and directory in one process, real nats-server, a 2-core host shared with other jobs at a load
average of 4-13; ``RoutePlaced`` of 16 blocks): before the router yielded, NATS sent nothing until it had queued its
whole republish: the first republished start was read 0.2 s after the ``branch.sync`` for 3,000 branches, 1.1-1.9 s
for 20,000, 4.4-4.9 s for 65,536 (``--max-active-branches``' default), the largest gap between two republished starts
1.3-2.0 s. With the yield: 0.08 s (20,000) and 0.45 s (65,536) to the first, largest gaps 0.06 s and 0.5 s (the last
read 6 s and 17 s after the sync, the directory reading on the router's loop as it goes). A fixed period long enough
for the largest republish would answer 503 for every unknown id of a freshly started cluster for as long; so the
period adapts: a republished ``BranchStart`` is one whose ``ts`` (the cluster time the router started the branch)
is older than the ``branch.sync``'s; the directory has settled once ``settle_s`` (10 s by default: twice the longest
wait for a first republished start measured without the yield, 20 times the largest gap with it) have passed since
the ``branch.sync`` **and** since the last republished start it read, and at the latest ``max_s`` after the
``branch.sync`` (a router whose clock runs behind would make its new branches look republished for ever).

What it does not cover: a router that did not hear the ``branch.sync`` (disconnected at that instant; it is a core
NATS message) republishes nothing, and its branches stay unknown here until their next request.
"""

from __future__ import annotations

import math

SETTLE_MAX_S = 120.0
"""Longest wall seconds after ``branch.sync`` a directory stays unsettled (:class:`BranchSyncSettle`)."""


class BranchSyncSettle:
    """Has the directory read the routers' republish of their branches since its ``branch.sync``?

    Times: ``now`` is the directory's monotonic clock in wall-rate seconds (``SimClock.monotonic``: the republish
    takes wall time whatever the ``--speedup``); ``ts`` values are the cluster time of ``BranchStart.ts`` /
    ``BranchSync.ts`` (``SimClock.now``), compared only with each other.

    Args:
        settle_s: quiet wall seconds that settle it (> 0; ``--branch-sync-settle-s``).
        max_s: it is settled this long after the ``branch.sync`` whatever it read (>= ``settle_s``).

    Raises:
        ValueError: a ``settle_s`` that is not a finite number > 0, or a ``max_s`` below it.
    """

    def __init__(self, settle_s: float, max_s: float = SETTLE_MAX_S) -> None:
        if not (settle_s > 0 and math.isfinite(settle_s)):
            raise ValueError(f"settle_s must be a finite number > 0, got {settle_s!r}")
        if not max_s >= settle_s:
            raise ValueError(f"max_s must be >= settle_s ({settle_s}), got {max_s!r}")
        self.settle_s = settle_s
        self.max_s = max_s
        self.sync_at: float | None = None
        """Monotonic time the ``branch.sync`` went out; None: not yet (not settled)."""
        self.sync_ts = math.inf
        self.last_republished: float | None = None
        """Monotonic time of the last republished ``BranchStart`` read; None: none yet."""
        self.republished = 0
        """Republished ``BranchStart`` read since the ``branch.sync``."""

    def sent(self, now: float, ts: float) -> None:
        """The ``branch.sync`` stamped ``ts`` went out at ``now``."""
        self.sync_at = now
        self.sync_ts = ts

    def start(self, ts: float, now: float) -> bool:
        """A ``BranchStart`` stamped ``ts`` was read at ``now``. Returns whether it was a republished one (started
        before the ``branch.sync``). O(1)."""
        if self.sync_at is None or not ts < self.sync_ts:
            return False
        self.last_republished = now
        self.republished += 1
        return True

    def synced(self, now: float) -> bool:
        """True once ``settle_s`` have passed since the ``branch.sync`` and since the last republished start, or
        ``max_s`` since the ``branch.sync``; False before the ``branch.sync`` went out. Pure, O(1)."""
        if self.sync_at is None:
            return False
        since = now - self.sync_at
        if since >= self.max_s:
            return True
        quiet = since if self.last_republished is None else now - self.last_republished
        return since >= self.settle_s and quiet >= self.settle_s
