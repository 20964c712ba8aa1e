"""Other routers' requests in this router's load view (issue #22: router replicas).

Pure bookkeeping; no I/O. Several routers serve one partition; each publishes a
``RouteSent`` on ``route.sent`` for every placement it makes, and every router counts the
others' placements in its ``NodeLoadView`` and policy (``RouterCore.remote_dispatch``)
until the request's first token (prefill load) and its end (decode load), which it sees on
``req.<rid>.out.<node>`` like its own. The owner sends it again when it binds the decode node at prefill
start (``route.bind``); a prefill node sends a parked request's first token at the prompt's end,
before that binding, so the first token a re-sent placement of the same attempt already had is kept
(:meth:`RemoteSends.first_token`), and the owner says it has seen it (``RouteSent.first_token``: a router
that started after that token went by has not): the peer then counts it as its owner does (prefill done, no
decode room reserved: ``RouterCore.bind_decode``), not afresh on its prefill node until the decode node's
first output. A router that starts while others have requests in flight counts none of them until their
next ``RouteSent`` (a decode binding, a re-dispatch): their load is in the nodes' states, and their chunks
are not its business (:meth:`RemoteSends.chunk`: unknown rid; the router counts them ``chunks_peer_rid``, told
by ``TokenChunk.router``, not ``chunks_unknown_rid``), so nothing it did not hear is ever counted
nor left over. :class:`RemoteSends` remembers which rids are another
router's, with their attempt, so that their chunks update the view, a fence never aborts
them (only the owner re-dispatches its requests), and a request whose owner vanished
without an end ever reaching the bus is forgotten after ``ttl`` (the router's request
timeout).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RemoteSend:
    """One request another router placed."""

    router: str
    attempt: int
    since: float
    """When its last ``RouteSent`` arrived (s, the caller's clock: the live router's
    ``time.monotonic()``, a local duration only)."""
    first_token: bool = False


class RemoteSends:
    """rid → :class:`RemoteSend` of the requests other routers own. O(1) per operation, O(R) per sweep."""

    def __init__(self) -> None:
        self._sends: dict[str, RemoteSend] = {}

    def __len__(self) -> int:
        return len(self._sends)

    def __contains__(self, rid: object) -> bool:
        return rid in self._sends

    def sent(self, rid: str, router: str, attempt: int, now: float, *, first_token: bool = False) -> bool:
        """A ``RouteSent`` arrived at ``now`` (s, the clock :meth:`expired` is given): True when it
        should be counted (newer or equal attempt than known). The same attempt sent again (its decode
        node bound) keeps its first token; a newer attempt (a re-dispatch) starts without one.
        ``first_token``: the message's (``RouteSent.first_token``: its owner saw this attempt's first
        token): a router that was not counting the request when that token went by (it started later)
        has it too."""
        old = self._sends.get(rid)
        if old is not None and attempt < old.attempt:
            return False
        seen = first_token or (old is not None and old.attempt == attempt and old.first_token)
        self._sends[rid] = RemoteSend(router, attempt, now, first_token=seen)
        return True

    def get(self, rid: str) -> RemoteSend | None:
        """The counted placement of ``rid`` (its owning router and attempt), or None. O(1)."""
        return self._sends.get(rid)

    def first_token(self, rid: str) -> bool:
        """True when counted ``rid``'s current attempt has had its first token (its prefill is done)."""
        s = self._sends.get(rid)
        return s is not None and s.first_token

    def chunk(self, rid: str, attempt: int, finished: bool, router: str = "") -> str | None:
        """A chunk of another router's request: ``"first"`` (its first token: free its prefill
        node), ``"end"`` (forget it), or None (nothing to do: unknown rid, other attempt, later token,
        or a chunk naming a router (``TokenChunk.router``; "" = an older writer's: not checked) other than the
        owner counted: the same id placed by two routers at once, and the one that gave way sees its own
        request's end, which must not end the other's in its view)."""
        s = self._sends.get(rid)
        if s is None or attempt != s.attempt or (router and router != s.router):
            return None
        if finished:
            del self._sends[rid]
            return "end"
        if not s.first_token:
            s.first_token = True
            return "first"
        return None

    def current(self, rid: str, attempt: int, router: str = "") -> bool:
        """True when ``rid`` is counted here and ``attempt`` is its owner's current attempt (and ``router``, when
        given, is its owner)."""
        s = self._sends.get(rid)
        return s is not None and s.attempt == attempt and (not router or router == s.router)

    def forget(self, rid: str) -> bool:
        """Drop ``rid`` (its node was fenced: the owner re-dispatches it and says so again)."""
        return self._sends.pop(rid, None) is not None

    def expired(self, now: float, ttl: float) -> list[str]:
        """Forget and return the rids whose last ``RouteSent`` arrived more than ``ttl`` seconds
        before ``now`` (the clock :meth:`sent` was given: monotonic in the live router, so a
        step of the wall clock does not drop every other router's request at once)."""
        old = [rid for rid, s in self._sends.items() if now - s.since > ttl]
        for rid in old:
            del self._sends[rid]
        return old

    def by_router(self) -> dict[str, int]:
        """Requests counted per owning router."""
        out: dict[str, int] = {}
        for s in self._sends.values():
            out[s.router] = out.get(s.router, 0) + 1
        return out
