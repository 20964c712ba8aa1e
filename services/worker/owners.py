"""Owner leases: which requests a node drops because their owning router no longer wants them.

Pure bookkeeping; no I/O, no clock (``now`` is passed in, wall seconds, monotonic).

A request on a node belongs to one router (``PrefillWork.router`` / ``DecodeWork.router``).
The router tells the node to drop it with a ``RequestAbort`` when its client goes away; but a
router that is SIGKILLed, or restarted (same ``--instance``, none of its old requests), sends
no abort, and the node would decode to ``max_tokens`` for nobody, keep the KV and hold up the
work queued behind (measured before this: a 90,000-token prefill of a killed router's client ran
on for ~60 s of wall time at ``--speedup 0.05`` and a new request queued behind it timed out,
504). So every ``--owner-check-interval-s`` the node asks each owner, on
``route.held.<router>``, which of the requests it holds the router no longer has in flight
(``HeldQuery`` → ``HeldReply.dropped``): those it drops when a query sent ``OWNER_RECHECK_S`` (1 s) later is
answered so too (``services/worker/service.py``: a router that ends a request itself publishes the nodes' abort just
after, and its answer may overtake that abort; the abort ends it first, not counted lost). When
nobody serves ``route.held.<router>`` (NATS "no responders": the router is gone) for
``gone_after_s`` wall seconds in a row, every request of that router is dropped. A timeout or
another bus error decides nothing (NATS down, a busy router): the requests are kept; but a timeout
(or a reply that could not be used) while this node's bus is connected ends a no-responders streak
(:meth:`OwnerLeases.subscribed`): NATS answers "no responders" at once when nobody is subscribed,
so a query that waited instead reached the router's subscription, and the router was there.

The grace (``gone_after_s``, 30 s by default: the router's ``bus_outage_wait_s``) covers a router
cut off from NATS, which looks the same as a dead one (nobody serves its subject) but whose
streams may still complete after it reconnects (``req.*.out.*`` is reliable), and a NATS restart,
after which a live router may subscribe again a moment after the node. A router restarted under
the same ``--instance`` answers for its predecessor's requests (it has none of them in flight: all
dropped) at the first query that reaches it, and again 1 s later. While a router is missing (its streak runs) the node asks
it again every :data:`SILENT_RETRY_S` (not only every ``--owner-check-interval-s``), so that query
comes at most ``min(interval, SILENT_RETRY_S)`` after the new router subscribes.

Bound (wall seconds, from the moment the owner no longer has the request in flight; plus two
``route.held`` round trips): a live router that lost the request (finished, aborted, failed, superseded
attempt), or one restarted before this node noticed it missing: ``--owner-check-interval-s`` + ``OWNER_RECHECK_S``;
a router restarted after this node found it missing: its restart time + ``min(interval, SILENT_RETRY_S)`` +
``OWNER_RECHECK_S``; a
router that does not come back: ``--owner-gone-after-s`` after the first "no responders" (+ up to one
interval). Before the re-ask, a restarted router's predecessor's requests waited for the next full
check: under ``evolving-infra up --engine torch`` (1P1D, tiny model on CPU, ~450 tokens/s) the router
was back ~3 s after its SIGKILL and a 900-token decode finished (~2 s) before any check reached it.

Never dropped: a request its router has in flight (the router records it before it places the work,
and a re-dispatch moves its attempt before the new work is sent: a node holding the old attempt is
told to drop it, which the new attempt then replaces).
"""

from __future__ import annotations

from collections.abc import Iterable

SILENT_RETRY_S = 0.25
"""Wall seconds between asks to an owning router in a no-responders streak (capped by the check interval):
a router restarted under the same ``--instance`` is asked within this of subscribing. Costs one request
per missing router per node that often; NATS answers "no responders" at once."""

MAX_RIDS_PER_QUERY = 4096
"""rids in one ``HeldQuery`` (``shared.validate`` accepts up to 2^16); more are split across queries."""


class OwnerLeases:
    """No-responder streaks per router and the queries to send.

    Args:
        gone_after_s: wall seconds of consecutive "no responders" answers after which a
            router is taken for gone (its requests dropped).
    """

    def __init__(self, gone_after_s: float) -> None:
        if gone_after_s < 0:
            raise ValueError(f"gone_after_s must be >= 0, got {gone_after_s}")
        self.gone_after_s = gone_after_s
        self._silent_since: dict[str, float] = {}
        """router → ``now`` of the first "no responders" of its current streak."""

    @staticmethod
    def queries(held: Iterable[tuple[str, str, int]]) -> list[tuple[str, list[str], list[int]]]:
        """Group held requests ``(rid, router, attempt)`` into ``(router, rids, attempts)``
        queries of at most :data:`MAX_RIDS_PER_QUERY` rids, routers in sorted order. O(R log R)."""
        by: dict[str, tuple[list[str], list[int]]] = {}
        for rid, router, attempt in held:
            rids, attempts = by.setdefault(router, ([], []))
            rids.append(rid)
            attempts.append(attempt)
        out: list[tuple[str, list[str], list[int]]] = []
        for router in sorted(by):
            rids, attempts = by[router]
            for i in range(0, len(rids), MAX_RIDS_PER_QUERY):
                out.append((router, rids[i : i + MAX_RIDS_PER_QUERY], attempts[i : i + MAX_RIDS_PER_QUERY]))
        return out

    def answered(self, router: str) -> None:
        """``router`` answered a query: it is alive (its streak, if any, ends)."""
        self._silent_since.pop(router, None)

    def subscribed(self, router: str) -> None:
        """A query to ``router`` was delivered to its subscription but got no usable answer (a timeout
        with this node's bus connected: NATS answers "no responders" at once when nobody serves the
        subject; a malformed or refused reply): the router was there, so its streak, if any, ends —
        "gone" needs ``gone_after_s`` of no-responders answers with no sign of it in between. Kept
        apart from :meth:`answered` (a timeout drops nothing). Without this, a router that stayed
        subscribed but slow (timeouts) after one no-responders moment (a NATS restart it resubscribed
        after) kept that streak, and its next single no-responders (another reconnect) past
        ``gone_after_s`` dropped every request it owns here at once: their streams ended although it
        was alive all along. Ending a streak wrongly only delays a dead router's verdict (its
        subscription outlives it only until NATS drops its connection)."""
        self._silent_since.pop(router, None)

    def no_responders(self, router: str, now: float) -> bool:
        """Nobody serves ``route.held.<router>`` at ``now``; True when that has lasted
        ``gone_after_s`` (the router is gone: drop its requests). The streak lasts until the
        router answers (:meth:`answered`) or owns nothing here (:meth:`forget`), so every query
        of a check (a node with more than :data:`MAX_RIDS_PER_QUERY` of its requests asks in
        several) and its late work (a hand-off) are judged gone too; a router that comes back
        and gets new work starts from nothing."""
        since = self._silent_since.setdefault(router, now)
        return now - since >= self.gone_after_s

    def forget(self, live_routers: Iterable[str]) -> None:
        """Drop the streaks of routers that own none of the node's requests any more."""
        keep = set(live_routers)
        for r in [r for r in self._silent_since if r not in keep]:
            del self._silent_since[r]

    def silent(self) -> dict[str, float]:
        """router → ``now`` its current no-responders streak began (for stats)."""
        return dict(self._silent_since)
