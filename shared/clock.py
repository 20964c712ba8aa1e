"""The cluster's simulated clock.

Every process maps wall time to simulated time the same way::

    sim_now = (time.time() - origin) * speedup

``origin`` is one wall instant shared by all processes of a cluster (the
launcher passes it to every service), so simulated timestamps from different
processes are comparable. With ``speedup = 1`` simulated time is wall time
since the origin. Cores never read a clock: shells read it and pass the value
in (DESIGN §2): :meth:`SimClock.now`, or, for a core whose own deadlines must not
move with a step of the wall clock (the worker's engine scheduler),
:meth:`SimClock.local_now`, with every time converted at the edge.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

MIN_SLEEP_S = 0.001
"""Shortest sleep (wall s) a loop waiting for a deadline takes: uvloop's timer resolution.

``uvloop.Loop.call_later`` (the services' loop, ``shared.service``) rounds a delay to whole
milliseconds, under 0.5 ms it is ``call_soon`` (no wait at all), and libuv counts it from the
loop's cached millisecond clock, so ``asyncio.sleep(deadline - now)`` ends up to ~1 ms early. A
loop that re-checks the time then goes round without waiting until the deadline (measured,
uvloop 0.23: a 0.2 s wait woke 98 times; asyncio: once). Waiting at least this long makes every
pass a real wait (commit 4c88d96)."""


async def sleep_until(deadline: float, now: Callable[[], float] = time.monotonic) -> None:
    """Sleep until ``now()`` reaches ``deadline`` (both seconds on the ``now`` clock, default
    ``time.monotonic``; ``now`` must run at wall speed). Returns at once if it already has.

    Each pass sleeps at least :data:`MIN_SLEEP_S`, so the few early wakes uvloop leaves are real
    waits, not a spin; it may end up to ~1 ms late."""
    while (left := deadline - now()) > 0:
        await asyncio.sleep(max(left, MIN_SLEEP_S))


class SimClock:
    """Simulated seconds since ``origin`` at ``speedup`` simulated s per wall s.

    Two readings: :meth:`now`, on the wall clock, for every time that goes to or is compared with
    another process (message ``ts`` fields, a worker's first-token time, a state's ``ts``): all
    processes of a cluster share ``origin``, and a step of the wall clock (NTP, a VM resumed) moves
    them all alike; and :meth:`local_now`, on the monotonic clock, for durations a process
    measures between two of its own readings (how long since a node's last state arrived) and for
    a process's own timeline (the worker's core: its plans and deadlines): a wall clock step does
    not move it, so it cannot fence every node in one round, nor stall or hurry a deadline.

    Args:
        speedup: simulated seconds per wall second (> 0).
        origin: wall epoch seconds of simulated time 0; 0 means "now".
        wall: the wall clock (epoch seconds; default ``time.time``; tests inject a step).
        mono: the monotonic clock (seconds; default ``time.monotonic``).

    Raises:
        ValueError: if ``speedup`` is not positive.
    """

    def __init__(
        self, speedup: float = 1.0, origin: float = 0.0, *,
        wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        self.speedup = speedup
        self._wall = wall
        self._mono = mono
        self.origin = origin or wall()
        self._local0 = self.now()
        self._mono0 = mono()

    def now(self) -> float:
        """Current simulated time (s), on the wall clock (comparable across processes)."""
        return (self._wall() - self.origin) * self.speedup

    def local_now(self) -> float:
        """Current simulated time (s) on the monotonic clock: :meth:`now` as it was when the clock
        was made, plus the monotonic seconds since × ``speedup``. For this process only: durations
        between two of its readings, or its own timeline. Never sent to another process nor
        compared with :meth:`now` or a message's ``ts`` as it is (they part by every step of the
        wall clock): a time that crosses the process boundary is moved by ``now() - local_now()``
        first (the worker: ``WorkerService._to_wall`` / ``_to_local``)."""
        return self._local0 + (self._mono() - self._mono0) * self.speedup

    def monotonic(self) -> float:
        """The monotonic clock this clock reads (wall-rate seconds, not scaled by ``speedup``;
        ``time.monotonic`` unless injected): for wall-second durations of this process only."""
        return self._mono()

    def wall_at(self, sim_t: float) -> float:
        """Wall epoch time at which simulated time ``sim_t`` is reached."""
        return self.origin + sim_t / self.speedup

    def to_wall(self, sim_duration_s: float) -> float:
        """Wall seconds that a simulated duration lasts."""
        return sim_duration_s / self.speedup
