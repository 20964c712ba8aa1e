"""Logging that survives a flood: the first N events of a kind per interval, then one summary line.

A service that drops a malformed message logs it; a hostile or broken peer
can send 10^5 of them a second. :class:`RateLimitedLog` writes the first
``first`` events of each key (e.g. a subject template) in every interval of
``interval_s`` wall seconds with their details, counts the rest, and writes one
``suppressed`` summary line per key when the interval ends (on the next event
or :meth:`flush`, which ``Bus`` calls from its heartbeat loop), at the level of
the events it counts (an info event's flood is no warning). The counts
themselves are kept by the caller (``Bus.counters``); this only bounds lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0
    last_event: str = ""
    level: str = "warning"
    """The level of the last event suppressed: the summary's."""


class RateLimitedLog:
    """Per-key rate limit on log lines (thread-unsafe; one event loop).

    Args:
        log: a structlog logger (anything with ``warning``/``exception``-style methods; the levels the
            events name, for their lines and their summaries).
        first: events logged in full per key and interval (≥ 0).
        interval_s: wall seconds of one interval (> 0).
        clock: seconds, monotonic (tests pass their own).

    Raises:
        ValueError: ``first`` < 0 or ``interval_s`` ≤ 0.
    """

    def __init__(self, log: Any, *, first: int = 5, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if first < 0 or not interval_s > 0:
            raise ValueError("first must be >= 0 and interval_s > 0")
        self.log = log
        self.first = first
        self.interval_s = interval_s
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        self.lines = 0
        """Lines written so far (events and summaries)."""
        self.suppressed_total = 0

    def event(self, key: str, event: str, *, level: str = "warning", **fields: Any) -> bool:
        """Log ``event`` under ``key`` at ``level`` (a method of ``log``) unless this interval's quota is used;
        returns True if written. The interval's summary line has the level of its last suppressed event."""
        now = self.clock()
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = _Window(now)
        elif now - w.start >= self.interval_s:
            self._summarize(key, w, now)
            w.start, w.logged, w.suppressed = now, 0, 0
        if w.logged < self.first:
            w.logged += 1
            self.lines += 1
            if w.logged == self.first:
                fields["more_suppressed_for_s"] = self.interval_s
            getattr(self.log, level)(event, key=key, **fields)
            return True
        w.suppressed += 1
        w.last_event, w.level = event, level
        self.suppressed_total += 1
        return False

    def _summarize(self, key: str, w: _Window, now: float) -> None:
        if w.suppressed:
            self.lines += 1
            getattr(self.log, w.level)(
                "log lines suppressed", key=key, suppressed=w.suppressed, last_event=w.last_event, interval_s=round(now - w.start, 3)
            )

    def flush(self) -> None:
        """Write the summary of every interval that has ended (call periodically)."""
        now = self.clock()
        for key, w in list(self._windows.items()):
            if now - w.start >= self.interval_s:
                self._summarize(key, w, now)
                del self._windows[key]
