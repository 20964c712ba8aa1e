"""Branch table: which agent branches the router has announced, and which ended.

Zero I/O. The shell turns the harness's headers into :meth:`BranchTable.observe`
calls and ``POST /v1/branches/{id}/end`` into :meth:`BranchTable.check_end`, a ``BranchEnd`` published, then
:meth:`BranchTable.end`, and publishes the returned ``BranchStart`` on ``branch.events``.

Transitions (one branch id)::

    unknown --observe--> active   (emits BranchStart once)
    active  --observe--> active   (no event)
    active  --end------> ended    (emits BranchEnd)
    ended   --observe--> error BranchEnded        (HTTP 400, param X-Branch-Id)
    ended   --end------> error BranchAlreadyEnded (the router answers an end 200 ``"already": true``, idempotent;
                                                   a tool call on it: HTTP 410 Gone)
    unknown --end------> error UnknownBranch      (the router asks the KV directory, ``branch.query``:
                                                   :func:`unseen_verdict`; a branch it holds is ended
                                                   here by :meth:`BranchTable.end_unseen`, else HTTP 404)
    unknown --observe with a parent that leads back to it--> error BranchCycle (HTTP 400, param X-Parent-Branch-Id)

A branch this table does not hold may still be one of the cluster's: the KV directory gets every router's
``BranchStart``, so it knows the branches another router served (two routers behind one address) and those this
router served before it restarted (this table is in memory). Its end or tool call is therefore not refused at
once: the shell asks the directory (``branch.query``) and acts on :func:`unseen_verdict` (relay it; ``already``;
404; 503 when the directory does not answer or is still reading the routers' republish). A relayed end, and an
``ended`` answer, are remembered here (:meth:`BranchTable.end_unseen`); a relayed tool call is not (this table would
need the branch's kind and parents to hold it).

The router that served the branch hears an end or tool call another router relayed: the shell reads the other
routers' ``branch.events`` (a core subscription) and ends the branch here too (:meth:`BranchTable.end_unseen`), or
holds it (:meth:`BranchTable.heard_tool_call`), so its table, its ``branches_active`` and its republish to a
restarted directory do not keep a branch the cluster ended.

No refusal is a 408, 409, 429 or 5xx: the OpenAI Python SDK retries those (``openai._base_client._should_retry``,
twice by default, with backoff), and each refusal here is answered the same again while the table holds the id
(an ended id stays ended while remembered). The ended branch was a 409: a harness bug cost it 3 requests and a
second or more of backoff for the same answer.

A branch that is its own parent never reaches the table: the shell's header parser answers it 400
(``api.branch_headers``).

Ended ids are remembered up to ``max_ended`` (oldest forgotten first), so an
id ended long ago behaves as unknown again (reused with one of its old, still held children as
its parent, it is a cycle: ``BranchCycle``).

Expiry (issue 21), as the KV directory does it (``services/kvdirectory/branches.py``):
an active branch without a request for ``ttl_s`` is forgotten — a request of a
fork or sub-agent counts as activity of its parents, a "tool call
outstanding" hint (:meth:`BranchTable.tool_call`) keeps it until the hint's end, and
a request in flight (streamed or parked longer than the TTL) keeps it and its parents
until a TTL after the request ends (:meth:`BranchTable.done`).
A request of an expired branch is a **resume**: accepted, counted
(``resumed``), and a new ``BranchStart`` (the remembered kind, parent, agent)
is published so that the directory counts the branch again::

    active  --ttl_s silent--> expired (remembered up to max_ended)
    expired --observe-------> active   (emits BranchStart; resumed += 1)
    expired --end-----------> ended    (emits BranchEnd)

Cap: at most ``max_active`` active branches. A new branch past it evicts the least recently
active branch with no request in flight (:meth:`BranchTable.observe` counts a request in flight
until :meth:`BranchTable.done`) and no tool-call hold running (one with a hold goes only when no
other idle branch is left; the branch just observed or given a tool call never): it becomes expired, as by the TTL (resumable), is counted
(``evicted``), and :meth:`BranchTable.take_evicted` hands its id and latest placed rid to the
shell, which publishes ``BranchEnd(expired=True, rid=...)`` so the directory expires it too and
releases its counts (unless another router placed the branch since: the rid tells). When every
active branch has a request in flight the table holds them all (no branch of a running request
is forgotten: the in-flight requests bound it)::

    active (none in flight, least recent) --cap--> expired (evicted += 1)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from shared.messages import BranchEnd, BranchKind, BranchStart, BranchState, BranchToolCall, RoutePlaced


UnseenVerdict = Literal["relay", "ended", "unknown", "unsynced", "unanswered"]


def unseen_verdict(state: BranchState | None, synced: bool = True) -> UnseenVerdict:
    """What the router does with an end or a tool-call hint of a branch its table does not hold, given the KV
    directory's answer to ``branch.query`` (``state``; None: no answer within the wait, or a bus error; ``synced``:
    ``BranchQueryReply.synced``, False while a restarted directory may not have read the routers' republish). Pure.

    ======================  ===========================================================================================
    ``state``               verdict: the router's answer
    ======================  ===========================================================================================
    ``active``, ``expired`` ``relay``: publish its ``BranchEnd`` / ``BranchToolCall`` on ``branch.events``, as for a
                            branch of its own (the directory ends it, or holds it, resuming an expired one); 200
    ``ended``               ``ended``: an end answers 200 ``"already": true``, a tool call 410, as for its own ended one;
                            the id is remembered ended here (:meth:`BranchTable.end_unseen`, nothing published)
    ``unknown``             ``unknown``: 404, as before. Also for a ``BranchStart`` still in the stream (its first
                            request was answered an instant before)
    ``unknown``, not synced ``unsynced``: 503 with ``Retry-After: 1``: a directory that (re)started an instant ago may not
                            have read the routers' republish of the branch yet (a 404 lost the end)
    None                    ``unanswered``: 503 with ``Retry-After: 1`` (the OpenAI SDK retries it), never a 404 for
                            "the router does not know"
    ======================  ===========================================================================================
    """
    if state == "active" or state == "expired":
        return "relay"
    if state == "unknown" and not synced:
        return "unsynced"
    if state == "ended" or state == "unknown":
        return state
    return "unanswered"


class BranchError(Exception):
    """A branch operation the client got wrong; ``status`` is the HTTP status to answer, ``param`` the header a
    generation request's error names."""

    status = 400
    param = "X-Branch-Id"

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownBranch(BranchError):
    status = 404


class BranchAlreadyEnded(BranchError):
    """``POST /v1/branches/{id}/end`` or ``/tool-call`` on a branch that was ended. A tool call's is a 410 Gone (RFC 9110
    §15.5.11), since the path names the branch and it stays ended while remembered (a 409 was retried by the OpenAI
    SDK); the router answers a repeated end 200 with ``"already": true`` (idempotent, so a retried end succeeds)."""

    status = 410


class BranchEnded(BranchError):
    """A generation request whose ``X-Branch-Id`` names a branch that was ended: a 400 naming the header (the request
    is wrong as sent, as OpenAI answers a body naming an object that is not there), not a 409 the OpenAI SDK retries
    for the same answer."""

    status = 400


class BranchCycle(BranchError):
    """A new branch's ``X-Parent-Branch-Id`` is a branch whose parents (as this table holds them) lead back to it:
    a→b→a. A 400 naming ``X-Parent-Branch-Id``, as a self-parent is (the header parser): the request is wrong as
    sent, and a 409 is retried by the OpenAI SDKs (3 tries, with backoff) for the same answer."""

    status = 400
    param = "X-Parent-Branch-Id"


@dataclass(slots=True)
class _Branch:
    kind: BranchKind
    parent: str | None
    agent_id: str | None
    started_at: float
    """``BranchStart.ts`` of its (re)start: the wall-based cluster time, sent again by :meth:`BranchTable.republish`."""
    requests: int = 0
    last_seen: float = 0.0
    in_flight: int = 0
    """Requests observed and not yet :meth:`BranchTable.done`: a branch with one is never evicted nor expired."""
    hold_until: float = 0.0
    placed: list[RoutePlaced] = field(default_factory=list)
    """``RoutePlaced`` of the branch's latest request (prefill, then decode): what a restarted
    directory needs to count the branch again (:meth:`BranchTable.republish`)."""


class BranchTable:
    """Active and recently ended branches (sans-IO).

    Args:
        max_ended: how many ended (and, separately, expired) branch ids to remember (>= 0).
        ttl_s: a branch without a request this long (simulated s) expires (the directory's
            ``--branch-ttl-s``); ``math.inf`` = never.
        max_hold_s: longest "tool call outstanding" hold (the directory's ``--max-tool-hold-s``).
        max_active: most active branches (>= 1; the router's ``--max-active-branches``): a new
            branch past it evicts the least recently active idle one (see the module docstring).

    Raises:
        ValueError: a negative ``max_ended``, a non-positive ``ttl_s`` / ``max_hold_s`` or a
            ``max_active`` below 1.
    """

    def __init__(
        self, max_ended: int = 100_000, *, ttl_s: float = 1800.0, max_hold_s: float = 14400.0, max_active: int = 65_536
    ) -> None:
        if max_ended < 0:
            raise ValueError(f"max_ended must be >= 0, got {max_ended}")
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {max_active}")
        if not ttl_s > 0 or not max_hold_s > 0:
            raise ValueError("ttl_s and max_hold_s must be > 0")
        self.max_ended = max_ended
        self.ttl_s = ttl_s
        self.max_hold_s = max_hold_s
        self.max_active = max_active
        self._active: OrderedDict[str, _Branch] = OrderedDict()
        """Active branches, least recently active first."""
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._expired: OrderedDict[str, _Branch] = OrderedDict()
        self.expired = 0
        """Branches expired so far."""
        self.resumed = 0
        """Requests of an expired branch accepted as a resume."""
        self.evicted = 0
        """Branches evicted by the ``max_active`` cap so far."""
        self._evicted: list[tuple[str, str]] = []
        """(id, latest placed rid or ``""``) evicted since the last :meth:`take_evicted`."""
        self.parents_missing: dict[str, int] = {"unknown": 0, "ended": 0}
        """New branches whose ``X-Parent-Branch-Id`` this table does not hold (``unknown``: never seen, or forgotten;
        another router may hold it) or holds as ended (``ended``), counted at the branch's start."""
        self._parents_missing: list[tuple[str, str, str]] = []
        """(branch id, parent id, ``unknown`` | ``ended``) since the last :meth:`take_parents_missing`."""

    def _touch(self, branch_id: str, b: _Branch, now: float) -> None:
        b.last_seen = max(b.last_seen, now)
        self._active.move_to_end(branch_id)
        self._parents_to_end(b, now)

    def _parents_to_end(self, b: _Branch, now: float) -> None:
        """``b``'s active parents (up to 64) seen at ``now`` at the latest and moved to the recent end, each after its
        child: a waiting parent is not silent, and :meth:`expire` meets a branch with a request in flight before the
        parents it keeps (with equal times too: a parent left ahead of its child expired first)."""
        p, depth = b.parent, 0
        while p is not None and depth < 64:  # bounded: ids are the client's
            pb = self._active.get(p)
            if pb is None:
                return
            pb.last_seen = max(pb.last_seen, now)
            self._active.move_to_end(p)
            p, depth = pb.parent, depth + 1

    def expire(self, now: float) -> list[str]:
        """Forget branches without a request for ``ttl_s``; a branch whose tool-call hold has not
        ended ``ttl_s`` ago is kept and re-checked a TTL later (never expired before hold end + TTL);
        one with a request in flight is kept with its parents, as the ``max_active`` cap keeps it, and
        re-checked a TTL later (:meth:`done` starts its silence at the request's end).
        Returns their ids. O(expired + kept)."""
        gone = []
        kept, most = 0, len(self._active)  # each kept one is passed once: with now + ttl_s == now (a TTL below the
        while self._active:                # clock's float step) one moved to the end would come round again for ever
            bid, b = next(iter(self._active.items()))
            if b.last_seen + self.ttl_s > now:
                break
            if b.in_flight or b.hold_until + self.ttl_s > now:
                kept += 1
                if kept > most:
                    break
                if b.in_flight:  # a request streamed or parked past the TTL: its agent waits for it, as do its parents
                    self._touch(bid, b, now)
                else:  # held, or its hold ended less than a TTL ago
                    b.last_seen = now
                    self._active.move_to_end(bid)
                continue
            del self._active[bid]
            self._remember_expired(bid, b)
            gone.append(bid)
        self.expired += len(gone)
        return gone

    def _remember_expired(self, bid: str, b: _Branch) -> None:
        """``bid``, just removed from the active table, is expired (resumable while remembered)."""
        if self.max_ended:
            self._expired[bid] = b
            while len(self._expired) > self.max_ended:
                self._expired.popitem(last=False)

    def _evict_over_cap(self, now: float, keep: str) -> None:
        """Past ``max_active``: expire the least recently active branches with no request in
        flight (the TTL's path), ids queued for :meth:`take_evicted`. ``keep`` (the branch just
        observed or given a tool call) is never one. A branch whose tool-call hold runs past ``now``
        (its agent waits for a tool: the TTL keeps it too) goes only when no other idle branch is
        left, the oldest first; one passed over is moved to the recent end, its ``last_seen`` set to
        ``now``, as :meth:`expire` does with a held branch (so a flood of new ids passes each held
        branch once, not at every eviction). O(evicted + busy and held branches passed over), the
        busy ones staying in place."""
        over = len(self._active) - self.max_active
        if over <= 0:
            return
        victims: list[str] = []
        held: list[str] = []
        for bid, b in self._active.items():
            if b.in_flight or bid == keep:
                continue
            if b.hold_until > now:
                held.append(bid)
                continue
            victims.append(bid)
            if len(victims) == over:
                break
        taken = held[: over - len(victims)]
        for bid in victims + taken:
            b = self._active.pop(bid)
            self._remember_expired(bid, b)
            self._evicted.append((bid, b.placed[0].rid if b.placed else ""))
        for bid in held[len(taken):]:
            self._active[bid].last_seen = max(self._active[bid].last_seen, now)
            self._active.move_to_end(bid)
        self._active.move_to_end(keep)  # still the most recent (it was touched just before), its parents after it
        self._parents_to_end(self._active[keep], now)
        self.evicted += len(victims) + len(taken)

    def take_evicted(self) -> list[tuple[str, str]]:
        """The branches evicted by the cap since the last call (oldest first), each as (id, the
        rid of its latest placement here or ``""`` if none): each to be published as
        ``BranchEnd(expired=True, rid=rid)``, so the directory expires it and releases its counts
        unless another router placed the branch since (the directory's latest placement is
        another rid)."""
        out, self._evicted = self._evicted, []
        return out

    def take_parents_missing(self) -> list[tuple[str, str, str]]:
        """The new branches whose parent was unknown or ended at their start (:meth:`observe`) since the last
        call, oldest first, each as (branch id, parent id, ``"unknown"`` | ``"ended"``)."""
        out, self._parents_missing = self._parents_missing, []
        return out

    def parent_state(self, parent: str) -> str:
        """What this table holds of ``parent``: ``active``, ``expired`` (resumable), ``ended`` or ``unknown``
        (never seen here, or forgotten past ``max_ended``). O(1)."""
        if parent in self._active:
            return "active"
        if parent in self._ended:
            return "ended"
        return "expired" if parent in self._expired else "unknown"

    def parent_cycle(self, branch_id: str, parent: str) -> list[str] | None:
        """The chain ``[branch_id, parent, ..., branch_id]`` when ``parent``'s parents (as this table holds the
        parents of its active and expired branches) lead back to ``branch_id``, else None. ``parent`` is not
        ``branch_id`` (the shell's header parser refuses a self-parent). O(depth), at most 64 steps (ids are the
        client's: a longer chain is not followed)."""
        chain = [branch_id, parent]
        p = parent
        while len(chain) < 65:
            b = self._active.get(p) or self._expired.get(p)
            if b is None or b.parent is None:
                return None
            p = b.parent
            chain.append(p)
            if p == branch_id:
                return chain
        return None

    def hold_span(self, expected_s: float) -> float:
        """The hold a tool-call hint of ``expected_s`` gets (s): ``expected_s``, or ``max_hold_s`` when it is 0 or
        more than that (the directory caps it so too: ``services/kvdirectory/branches.py`` ``hold``)."""
        return expected_s if 0 < expected_s <= self.max_hold_s else self.max_hold_s

    def hold_left(self, branch_id: str, now: float) -> float:
        """Seconds the tool-call hold of ``branch_id`` still runs after ``now`` (0.0: none, released, or not
        active), rounded to the µs: what the tool-call endpoint echoes (a later, shorter hint does not cut an
        earlier one short, as at the directory). O(1)."""
        b = self._active.get(branch_id)
        return 0.0 if b is None else round(max(0.0, b.hold_until - now), 6)

    def done(self, branch_id: str, now: float | None = None) -> None:
        """A request :meth:`observe` counted for ``branch_id`` is over (answered, failed or
        abandoned) at ``now`` (the TTL's clock; None: not noted): one fewer in flight, and the branch
        (with its parents) silent from ``now`` on, as after a request (a response streamed longer than
        the TTL does not expire it at its end). No-op for a branch no longer active (ended; neither the
        TTL nor the cap expires one with a request in flight)."""
        b = self._active.get(branch_id)
        if b is None or b.in_flight <= 0:
            return
        b.in_flight -= 1
        if now is not None:
            self._touch(branch_id, b, now)

    def observe(
        self,
        branch_id: str,
        now: float,
        *,
        kind: BranchKind = "main",
        parent: str | None = None,
        agent_id: str | None = None,
        ts: float | None = None,
    ) -> BranchStart | None:
        """Note a request of ``branch_id`` at ``now`` (the TTL's clock: the live router's
        monotonic ``SimClock.local_now``); ``ts``: the ``BranchStart.ts`` (the wall-based cluster
        time another process reads; None: ``now``).

        The request counts as in flight on the branch until :meth:`done`. A new branch past
        ``max_active`` evicts idle ones (:meth:`take_evicted`).

        A new branch (not a resume) whose ``parent`` is unknown here or ended is counted in
        :attr:`parents_missing` (its ``BranchStart`` names the parent all the same: the parent may be another
        router's) and queued for :meth:`take_parents_missing`, once per branch (the shell logs it).

        Returns:
            The ``BranchStart`` to publish when the branch is new, else None
            (kind/parent/agent of later requests are ignored).

        Raises:
            BranchEnded: if the branch was ended.
            BranchCycle: a new branch whose ``parent`` leads back to it (:meth:`parent_cycle`): not started, nothing
                counted (before, a→b→a was served, each branch keeping the other alive). ``parent`` is not
                ``branch_id`` (the shell's header parser refuses a self-parent with a 400).
        """
        self.expire(now)
        b = self._active.get(branch_id)
        if b is not None:
            b.requests += 1
            b.in_flight += 1
            b.hold_until = 0.0  # the tool returned
            self._touch(branch_id, b, now)
            return None
        if branch_id in self._ended:
            raise BranchEnded(f"X-Branch-Id {branch_id!r} names a branch that was ended; start a new branch id")
        old = self._expired.pop(branch_id, None)
        if old is not None:  # a resume after a pause longer than the TTL: accepted, announced again
            self.resumed += 1
            kind, parent, agent_id = old.kind, old.parent, old.agent_id
        elif parent is not None:
            cycle = self.parent_cycle(branch_id, parent)
            if cycle is not None:
                raise BranchCycle(
                    f"X-Parent-Branch-Id {parent!r} of new branch {branch_id!r} makes a cycle of parents ("
                    + " -> ".join(repr(c) for c in cycle) + "); name a branch that is not its descendant"
                )
            state = self.parent_state(parent)
            if state in self.parents_missing:
                self.parents_missing[state] += 1
                self._parents_missing.append((branch_id, parent, state))
        b = _Branch(kind, parent, agent_id, now if ts is None else ts, 1, now, 1)  # started_at: a BranchStart.ts again (republish)
        self._active[branch_id] = b
        self._touch(branch_id, b, now)
        self._evict_over_cap(now, branch_id)
        return BranchStart(branch_id=branch_id, kind=kind, parent_branch_id=parent, agent_id=agent_id, ts=now if ts is None else ts)

    def tool_call(
        self, branch_id: str, now: float, *, outstanding: bool = True, expected_s: float = 0.0, ts: float | None = None
    ) -> BranchToolCall:
        """"Tool call outstanding" hint: keep ``branch_id`` from expiring until ``now + expected_s``
        (0 or more than ``max_hold_s``: ``max_hold_s``) or its next request; ``outstanding=False``
        ends the hold. ``now`` and ``ts`` as in :meth:`observe`.

        Returns:
            The ``BranchToolCall`` to publish (the directory keeps the branch's blocks counted).

        Raises:
            BranchAlreadyEnded: the branch was ended.
            UnknownBranch: no request of it was seen (nor of it before it expired).
            ValueError: a negative or non-finite ``expected_s``.
        """
        if not (expected_s >= 0 and expected_s != float("inf")):
            raise ValueError(f"expected_s must be a finite number >= 0, got {expected_s!r}")
        self.expire(now)
        if branch_id in self._ended:
            raise BranchAlreadyEnded(f"branch {branch_id!r} was ended")
        b = self._active.get(branch_id)
        if b is None:
            old = self._expired.pop(branch_id, None)
            if old is None:
                raise UnknownBranch(f"unknown branch {branch_id!r}: no request with X-Branch-Id {branch_id!r} was seen")
            b = old
            self._active[branch_id] = b
            self.resumed += 1
        self._touch(branch_id, b, now)
        b.hold_until = max(b.hold_until, now + self.hold_span(expected_s)) if outstanding else 0.0
        self._evict_over_cap(now, branch_id)
        return BranchToolCall(branch_id=branch_id, outstanding=outstanding, expected_s=expected_s, ts=now if ts is None else ts)

    def heard_tool_call(self, branch_id: str, now: float, *, outstanding: bool = True, expected_s: float = 0.0) -> bool:
        """Another router relayed a tool-call hint of ``branch_id`` (its ``BranchToolCall`` on ``branch.events``):
        hold the branch here as :meth:`tool_call` does when this table holds it active or expired (an expired one is
        resumed, as the directory resumes it; a branch it evicts past the cap goes to :meth:`take_evicted`), so this
        router's cap and TTL keep it while its tool runs, as the directory does. ``now`` as in :meth:`observe`.

        Returns:
            True if held (or released: ``outstanding=False``) here; False for a branch this table holds ended or
            never saw (nothing to hold: it lacks the branch's kind and parents), or a bad ``expected_s``.
        """
        if branch_id in self._ended or (branch_id not in self._active and branch_id not in self._expired):
            return False
        try:
            self.tool_call(branch_id, now, outstanding=outstanding, expected_s=expected_s)
        except (BranchError, ValueError):  # expired past the TTL meanwhile and forgotten; a non-finite expected_s
            return False
        return True

    def check_end(self, branch_id: str) -> None:
        """Raise what :meth:`end` would raise for ``branch_id`` now, changing nothing: the router checks before it
        publishes the ``BranchEnd``, and ends the branch here only once that went out.

        Raises:
            BranchAlreadyEnded: if it was ended before.
            UnknownBranch: if no request of it was seen.
        """
        if branch_id in self._ended:
            raise BranchAlreadyEnded(f"branch {branch_id!r} already ended")
        if branch_id not in self._active and branch_id not in self._expired:
            raise UnknownBranch(f"unknown branch {branch_id!r}: no request with X-Branch-Id {branch_id!r} was seen")

    def end(self, branch_id: str, now: float, *, ts: float | None = None) -> BranchEnd:
        """End ``branch_id`` (``now`` and ``ts`` as in :meth:`observe`).

        Returns:
            The ``BranchEnd`` to publish.

        Raises:
            BranchAlreadyEnded: if it was ended before.
            UnknownBranch: if no request of it was seen.
        """
        self.check_end(branch_id)
        return self.end_unseen(branch_id, now, ts=ts)

    def end_unseen(self, branch_id: str, now: float, *, ts: float | None = None) -> BranchEnd:
        """End ``branch_id`` whatever this table holds of it: the router relays the end of a branch the KV directory
        holds although this table never saw it (another router served it, or this one restarted since;
        :func:`unseen_verdict`). Remembered as ended, as by :meth:`end` (a request on it is then refused, a repeated
        end answers ``already``), and taken out of the active or expired set should a request of it have arrived
        meanwhile. ``now`` and ``ts`` as in :meth:`observe`.

        Returns:
            The ``BranchEnd`` (the shell published it already).

        Raises:
            BranchAlreadyEnded: an end of it here came first.
        """
        if branch_id in self._ended:
            raise BranchAlreadyEnded(f"branch {branch_id!r} already ended")
        if self._active.pop(branch_id, None) is None:
            self._expired.pop(branch_id, None)
        if self.max_ended:
            self._ended[branch_id] = now
            while len(self._ended) > self.max_ended:
                self._ended.popitem(last=False)
        return BranchEnd(branch_id=branch_id, ts=now if ts is None else ts)

    def note_placed(self, placed: RoutePlaced) -> None:
        """Remember ``placed`` as part of its branch's latest placement: a new rid replaces the
        old ones, the same rid adds (or replaces the placement of the same phase). O(1)."""
        b = self._active.get(placed.branch_id)
        if b is None:
            return
        if b.placed and b.placed[0].rid != placed.rid:
            b.placed = []
        b.placed = [p for p in b.placed if p.phase != placed.phase] + [placed]

    def republish(self) -> list[BranchStart | RoutePlaced]:
        """What a restarted directory needs (issue #22): per active branch, oldest start first
        (parents before their forks), its ``BranchStart`` and its latest placements. O(active)."""
        out: list[BranchStart | RoutePlaced] = []
        for bid, b in sorted(self._active.items(), key=lambda kv: kv[1].started_at):
            out.append(BranchStart(branch_id=bid, kind=b.kind, parent_branch_id=b.parent, agent_id=b.agent_id, ts=b.started_at))
            out.extend(b.placed)
        return out

    def is_active(self, branch_id: str) -> bool:
        return branch_id in self._active

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def in_flight_count(self) -> int:
        """Requests in flight over the active branches (observed, not yet :meth:`done`). O(active)."""
        return sum(b.in_flight for b in self._active.values())

    @property
    def ended_count(self) -> int:
        return len(self._ended)
