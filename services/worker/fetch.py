"""Peer fetches into a node's host memory (L2): the shared inbound link and its outputs.

Contains zero I/O: no clock, no asyncio, no network (DESIGN §2). The
``EngineScheduler`` owns one :class:`FetchLink` per node; the live shell and the
simulator only see the scheduler's methods (``next_deadline`` covers fetch
completions) and, in real-bytes mode, the :class:`FetchStarted` outputs.

Model (paper §4.2, DESIGN §1 "the L2 of all nodes is one shared pool"): a
prefill node pulls the blocks of a request's prefix that only peers hold into
its own L2 while the request waits in its queue. Every fetch of a node shares
the node's inbound peer link (``profile.links.peer_fetch_bytes_per_s``) by
**processor sharing**: with n fetches moving bytes, each gets bandwidth / n.
A fetch of b bytes started at t₀ finishes ``peer_fetch_latency_s`` after its
last byte moved (one fixed latency per fetch, not shared). Completion times
are recomputed lazily on every start, cancel and query, O(active fetches)
each (O(k·n) when k fetches drain between two calls).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)  # a fetch's key: the scheduler's request ids

from shared.values import FACTORY, FrozenValue, IdentityValue, set_field


_EPS_BYTES = 1e-6
"""Remaining bytes at or below this count as drained (float round-off)."""


class FetchLink(Generic[K]):
    """One node's inbound peer link shared by concurrent fetches (processor sharing).

    Args:
        bytes_per_s: link bandwidth (bytes/s, > 0).
        latency_s: fixed latency added to each fetch after its last byte (s, ≥ 0).

    Raises:
        ValueError: for a non-positive bandwidth or a negative latency.

    Operations (n = fetches moving bytes, d = drained ones waiting out their latency):

    | operation | cost |
    |---|---|
    | ``start`` / ``cancel`` | O(n) + the drains since the last call |
    | ``next_completion`` | O(n + d) |
    | ``pop_done(now)`` | O(n + d log d) |
    """

    __slots__ = ("bytes_per_s", "latency_s", "_active", "_drained", "_last")

    def __init__(self, bytes_per_s: float, latency_s: float = 0.0) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self.bytes_per_s = float(bytes_per_s)
        self.latency_s = float(latency_s)
        self._active: dict[K, float] = {}
        """key → bytes still to move (insertion order = start order)."""
        self._drained: dict[K, float] = {}
        """key → completion time (last byte moved + latency)."""
        self._last = 0.0
        """Time up to which ``_active`` is accounted."""

    def __len__(self) -> int:
        return len(self._active) + len(self._drained)

    def __contains__(self, key: object) -> bool:
        return key in self._active or key in self._drained

    @property
    def moving(self) -> int:
        """Fetches currently sharing the link (bytes left to move)."""
        return len(self._active)

    def _advance(self, now: float) -> None:
        """Account the link up to ``now``: drain every fetch whose last byte moved by then."""
        active = self._active
        last = self._last
        while active:
            n = len(active)
            rate = self.bytes_per_s / n
            kmin = min(active, key=active.__getitem__)
            rmin = active[kmin]
            t_drain = last + (0.0 if 0.0 > rmin else rmin) / rate  # max(rmin, 0.0), no builtin call
            if t_drain > now:
                moved = (now - last) * rate
                for k in active:
                    active[k] -= moved
                last = now
                break
            for k in active:
                active[k] -= rmin
            del active[kmin]
            self._drained[kmin] = t_drain + self.latency_s
            last = t_drain
            for k in [k for k, r in active.items() if r <= _EPS_BYTES]:  # equal sizes drain together
                del active[k]
                self._drained[k] = t_drain + self.latency_s
        if now > last:
            last = now
        self._last = last

    def start(self, key: K, nbytes: float, now: float) -> None:
        """A fetch of ``nbytes`` starts at ``now``; the others slow down from now on.

        Raises:
            ValueError: if ``key`` is already on the link or ``nbytes`` < 0.
        """
        if key in self:
            raise ValueError(f"fetch {key!r} is already on the link")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._advance(now)
        if nbytes <= _EPS_BYTES:
            self._drained[key] = now + self.latency_s
        else:
            self._active[key] = float(nbytes)

    def cancel(self, key: K, now: float) -> bool:
        """Drop a fetch (its request left); the others speed up from ``now``. False if unknown."""
        self._advance(now)
        if self._active.pop(key, None) is not None:
            return True
        return self._drained.pop(key, None) is not None

    def next_completion(self) -> float | None:
        """Earliest completion time of any fetch on the link (None when empty).

        Exact under processor sharing: the fetch with the fewest bytes left drains
        first, and every fetch pays the same latency after its last byte.
        """
        best = min(self._drained.values(), default=None)
        if self._active:
            rmin = min(self._active.values())
            t = self._last + (0.0 if 0.0 > rmin else rmin) * len(self._active) / self.bytes_per_s + self.latency_s  # max(rmin, 0.0)
            best = t if best is None or t < best else best
        return best

    def pop_done(self, now: float) -> list[tuple[K, float]]:
        """Remove and return ``(key, completion time)`` of every fetch complete at ``now``,
        in completion order (ties: start order)."""
        self._advance(now)
        done = [(k, t) for k, t in self._drained.items() if t <= now]
        if not done:
            return []
        for k, _ in done:
            del self._drained[k]
        done.sort(key=lambda kt: kt[1])
        return done


class FetchState(IdentityValue):
    """The fetch of one queued request (scheduler-internal; one per request at most)."""

    lo: int
    """First page of the request's path fetched (its local prefix when it arrived)."""
    hi: int
    """One past the last page fetched (≤ the request's cache cap ``(prompt − 1) // block_size``)."""
    started_at: float
    external: bool
    """Real-bytes mode: the shell's transfer has not reported yet (``fetch_done``)."""
    sim_done_at: float | None
    """When the link model finished it (None while bytes are moving)."""
    missing: frozenset[int]
    """Blocks the real transfer did not deliver (or whose checksum failed): recomputed."""
    skipped_at: float | None
    """First ``schedule()`` that would have admitted the request but skipped it (fetch incomplete)."""
    done_at: float | None
    """Completion: the blocks are in L2 from then on (None while fetching)."""
    used: int
    """Pages of ``[lo, hi)`` in the prefix the request restored at admission: fewer than
    fetched when the transfer missed some, L2 had no room for all of them (other requests'
    held prefixes) or a broken hold lost some before admission."""
    fetch_id: int
    """This fetch's number on the node (:attr:`FetchStarted.fetch_id`; 0 = not external)."""

    __slots__ = __match_args__ = (
        "lo", "hi", "started_at", "external", "sim_done_at", "missing", "skipped_at", "done_at", "used", "fetch_id",
    )

    def __init__(
        self, lo: int, hi: int, started_at: float, external: bool = False, sim_done_at: float | None = None,
        missing: frozenset[int] = frozenset(), skipped_at: float | None = None, done_at: float | None = None,
        used: int = 0, fetch_id: int = 0,
    ) -> None:
        self.lo = lo
        self.hi = hi
        self.started_at = started_at
        self.external = external
        self.sim_done_at = sim_done_at
        self.missing = missing
        self.skipped_at = skipped_at
        self.done_at = done_at
        self.used = used
        self.fetch_id = fetch_id

    @property
    def fetch_s(self) -> float | None:
        """Start → completion (s), None while fetching."""
        return None if self.done_at is None else self.done_at - self.started_at

    @property
    def exposed_s(self) -> float | None:
        """The part that outlasted the queue wait: skip → completion (0 if never skipped)."""
        if self.done_at is None:
            return None
        if self.skipped_at is None:
            return 0.0
        exposed = self.done_at - self.skipped_at
        return exposed if exposed > 0.0 else 0.0  # max(0.0, exposed), no builtin call


class FetchStarted(FrozenValue):
    """A fetch the scheduler started (real-bytes mode: the shell moves the bytes).

    The scheduler's simulated completion waits for :meth:`EngineScheduler.fetch_done`
    with the same ``rid``; whichever of the two is later completes the fetch.
    """

    rid: str
    sources: list[tuple[str, list[int]]]
    """``(peer node, block hashes)`` per source, in path order (the router's fetch plan
    clipped to the blocks this node lacked when the request arrived)."""
    at: float
    """Simulated time the fetch started (the request's arrival on the node)."""
    fetch_id: int
    """This fetch's number on the node (from 1): what its report (``fetch_done``), the engine's
    hold on its bytes (``on_fetched`` / ``drop_fetched``) and ``take_fetch_ends`` name it by. The
    rid alone is not enough: a request re-dispatched here (a newer attempt) starts a new fetch
    while the old attempt's transfer may still be moving bytes."""

    __slots__ = __match_args__ = ("rid", "sources", "at", "fetch_id")

    def __init__(self, rid: str, sources: Any = FACTORY, at: float = 0.0, fetch_id: int = 0) -> None:
        set_field(self, "rid", rid)
        set_field(self, "sources", [] if sources is FACTORY else sources)
        set_field(self, "at", at)
        set_field(self, "fetch_id", fetch_id)


__all__ = ["FetchLink", "FetchStarted", "FetchState"]
