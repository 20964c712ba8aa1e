"""Whether a (re)started KV directory has rebuilt its branch table from the routers' republish (sans-IO).

A directory keeps its branch table in memory. At start it publishes ``branch.sync`` (a ``sync_id`` of its own) and
every router that hears it republishes its active branches (``BranchStart``, oldest first, each followed by its
latest ``RoutePlaced``) on the reliable ``branch.events`` / ``route.placed``, then ends its republish with a
``BranchSyncDone`` marker on ``branch.events`` (``services/router/service.py`` ``_on_branch_sync``): one publisher, one
subject of the stream, so the directory reads the marker after every start of that router's republish. Until the
republish has been read, ``branch.query`` answers ``unknown`` for a branch a router holds, and the router asking
would answer the harness's end 404, losing it (its counts held until the TTL, 1,800 s). So the answer says whether
the directory has settled (``BranchQueryReply.synced``), and a router turns an ``unknown`` while not settled into a
503 with ``Retry-After: 1`` (retried), not a 404.

Settled means: every router the directory waits for has sent its marker for the current ``sync_id``. With
``--routers`` (``evolving-infra up``, ``deploy-args`` for compose and Slurm, faultkit name theirs) those are exactly the
routers it names: another heard (its heartbeat, a republished start, any ``src``) is listed
(:attr:`BranchSyncSettle.unnamed`, logged) but not waited for, so a forged heartbeat (``instance="router-ghost"``)
cannot hold the directory unsettled until ``max_s``. Without ``--routers`` it waits for every router it hears of: its heartbeat
(``svc.heartbeat.router``, each second) heard, or one of its republished starts read. ``branch.sync`` is a
core NATS message a router may miss (disconnected, not yet subscribed, restarted meanwhile): while not settled the
directory sends it again every ``resend_s`` (same ``sync_id``; a router answers one ``sync_id`` once), so a router
that comes up or reconnects meanwhile republishes too. Without ``--routers`` the directory settles no sooner than
``settle_s`` after the ``branch.sync`` (time to hear every live router's heartbeat); with it, as soon as every
router it names has answered.

Why not the quiet period it used before (settled once ``settle_s``, 10 s, passed with no republished start read): a
router stalled longer than that (SIGSTOP, swap, a loaded host) was taken as having nothing to republish, and its
branches' ends through another router were answered 404 and lost
(``tests/integration/test_branch_end_heard_live.py``). A router that never answers (dead, or stalled for good) holds
the directory unsettled for ``max_s`` (``--branch-sync-max-s``, 60 s) after the ``branch.sync`` at most; the routers
missing then are listed (:meth:`BranchSyncSettle.missing`) and logged.

Measured republish times (router and directory in one process, real nats-server, a 2-core host at a load average of
4-13): the first republished start read 0.08 s (20,000 branches) and 0.45 s (65,536, ``--max-active-branches``'
default) after the ``branch.sync``, the last 6 s and 17 s after it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

SETTLE_MAX_S = 60.0
"""Default longest wall seconds after ``branch.sync`` a directory stays unsettled (``--branch-sync-max-s``)."""
SYNC_RESEND_S = 1.0
"""Wall seconds between two sends of ``branch.sync`` while the directory is not settled."""
UNNAMED_MAX = 64
"""Routers heard that ``--routers`` does not name kept in :attr:`BranchSyncSettle.unnamed` at most (each heartbeat
may carry a new forged name)."""


class BranchSyncSettle:
    """Has the directory read the routers' republish of their branches since its ``branch.sync``?

    Times: ``now`` is the directory's monotonic clock in wall-rate seconds (``SimClock.monotonic``: the republish
    takes wall time whatever the ``--speedup``); ``ts`` values are the cluster time of ``BranchStart.ts`` /
    ``BranchSync.ts`` (``SimClock.now``), compared only with each other. No I/O: the shell calls it and acts on it.

    Once settled it stays settled (a router heard later, e.g. one started afterwards, holds nothing to republish).

    Args:
        settle_s: without ``routers``, least wall seconds after the ``branch.sync`` before it settles (> 0;
            ``--branch-sync-settle-s``).
        max_s: it is settled this long after the ``branch.sync`` whatever it read (>= ``settle_s``;
            ``--branch-sync-max-s``).
        routers: router instance ids known to run (``--routers``); each is waited for, and no other (empty: every
            router heard beating or republishing is).
        resend_s: wall seconds between sends of ``branch.sync`` while not settled (> 0).

    Raises:
        ValueError: a ``settle_s`` or ``resend_s`` that is not a finite number > 0, or a ``max_s`` below ``settle_s``.
    """

    def __init__(self, settle_s: float, max_s: float = SETTLE_MAX_S, routers: Iterable[str] = (), resend_s: float = SYNC_RESEND_S) -> None:
        if not (settle_s > 0 and math.isfinite(settle_s)):
            raise ValueError(f"settle_s must be a finite number > 0, got {settle_s!r}")
        if not max_s >= settle_s:
            raise ValueError(f"max_s must be >= settle_s ({settle_s}), got {max_s!r}")
        if not (resend_s > 0 and math.isfinite(resend_s)):
            raise ValueError(f"resend_s must be a finite number > 0, got {resend_s!r}")
        self.settle_s = settle_s
        self.max_s = max_s
        self.resend_s = resend_s
        self.configured = frozenset(routers)
        """Routers named by configuration (``--routers``)."""
        self.known: set[str] = set(self.configured)
        """Routers waited for: the configured ones; without any, those heard beating or republishing."""
        self.unnamed: set[str] = set()
        """With configured routers: others heard (beating, republishing, a marker) before it settled; not waited for
        (a forged heartbeat, or a router missing from ``--routers``). At most :data:`UNNAMED_MAX` kept."""
        self.done: dict[str, int] = {}
        """Router → branches its marker said it republished, for the current ``sync_id``."""
        self.sync_id = ""
        self.sync_at: float | None = None
        """Monotonic time the first ``branch.sync`` went out; None: not yet (not settled)."""
        self.last_sent: float | None = None
        """Monotonic time of the latest send of ``branch.sync``."""
        self.sync_ts = math.inf
        self.settled_at: float | None = None
        """Monotonic time it settled (latched); None: not yet."""
        self.timed_out = False
        """It settled at ``max_s`` with routers that had not answered (:meth:`missing`)."""
        self.republished = 0
        """Republished ``BranchStart`` read since the ``branch.sync``."""
        self._newly_heard = False

    def sent(self, now: float, ts: float, sync_id: str) -> None:
        """The first ``branch.sync`` (``sync_id``, stamped ``ts``) went out at ``now``.

        Raises:
            ValueError: an empty ``sync_id``.
        """
        if not sync_id:
            raise ValueError("sync_id must not be empty")
        self.sync_at = self.last_sent = now
        self.sync_ts = ts
        self.sync_id = sync_id

    def resend_due(self, now: float) -> bool:
        """Whether to send ``branch.sync`` again now: sent before, not settled, and ``resend_s`` since the last send
        or a router newly heard since (:meth:`heard`: a router beats only once it has subscribed, so it hears this
        one). True records the send. O(routers)."""
        if self.last_sent is None or self.synced(now) or (now - self.last_sent < self.resend_s and not self._newly_heard):
            return False
        self.last_sent = now
        self._newly_heard = False
        return True

    def _unnamed(self, router: str) -> bool:
        """Whether ``router`` is one the configured routers do not name (recorded in :attr:`unnamed` while not
        settled, room left). O(1)."""
        if not self.configured or router in self.configured:
            return False
        if len(self.unnamed) < UNNAMED_MAX and self.settled_at is None:
            self.unnamed.add(router)
        return True

    def heard(self, router: str) -> bool:
        """A router's heartbeat was heard. Returns whether it is newly waited for (a send of ``branch.sync`` is then
        due at once, :meth:`resend_due`); False for one the configured routers do not name (:attr:`unnamed`). O(1)."""
        if router in self.known or self.settled_at is not None or not router or self._unnamed(router):
            return False
        self.known.add(router)
        self._newly_heard = self.sync_at is not None
        return True

    def start(self, ts: float, now: float, router: str = "") -> bool:
        """A ``BranchStart`` stamped ``ts`` from ``router`` was read at ``now``. Returns whether it was a republished
        one (started before the ``branch.sync``); its router is then waited for, unless the configured routers do not
        name it (:attr:`unnamed`). O(1)."""
        if self.sync_at is None or not ts < self.sync_ts:
            return False
        self.republished += 1
        if router and self.settled_at is None and not self._unnamed(router):
            self.known.add(router)
        return True

    def marker(self, router: str, sync_id: str, branches: int) -> bool:
        """``router``'s ``BranchSyncDone`` for ``sync_id`` (it republished ``branches`` starts) was read (recorded in
        :attr:`done`; one the configured routers do not name is not waited for by it, :attr:`unnamed`). Returns False,
        changing nothing, for another ``sync_id`` (an older directory's, or before the ``branch.sync``). O(1)."""
        if not sync_id or sync_id != self.sync_id or not router:
            return False
        if not self._unnamed(router):
            self.known.add(router)
        elif router not in self.unnamed:
            return True  # not kept (UNNAMED_MAX): done holds no more names than unnamed does
        self.done[router] = branches
        return True

    def missing(self) -> list[str]:
        """Routers waited for that have not sent their marker for the current ``sync_id``, sorted."""
        return sorted(self.known.difference(self.done))

    def synced(self, now: float) -> bool:
        """True once every router waited for has sent its marker (without configured routers, no sooner than
        ``settle_s`` after the ``branch.sync``), or ``max_s`` after the ``branch.sync`` whatever it read; False before the
        ``branch.sync`` went out. Latched: once True, True for good. O(routers)."""
        if self.settled_at is not None:
            return True
        if self.sync_at is None:
            return False
        since = now - self.sync_at
        if since >= self.max_s:
            self.timed_out = bool(self.missing())
        elif self.missing() or (not self.configured and since < self.settle_s):
            return False
        self.settled_at = now
        return True
