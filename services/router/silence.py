"""Whose silence is it: a node's, or the bus's? (sans-IO; the router's fence loop asks it.)

A node is fenced for silence when no ``node.state`` of it came for ``--fence-after-s``. A silence can be the bus's
instead: nats-server hung (SIGSTOP, a stuck host), the path to it dropping packets, this router not running. Then
every node is silent at once, and fencing them all re-dispatches every request for nothing. The router used to tell
that by its PING to NATS: a PONG later than ``--fence-after-s`` / 3 marked the bus stalled and suspended fencing until
``--fence-after-s`` + 1 s after the PONG. On a loaded host PONGs take that long again and again (session 54: five
test runs on two cores, load 8–15), so fencing was suspended for good and a dead node was never fenced for silence.

:class:`DeliveryWitness` counts a node's silence only over the time the bus was seen to deliver: every message this
router receives (another node's state, the PONG of its own PING) is a delivery; the time between two deliveries
counts, but a gap counts for at most ``max_gap_s`` (a hang delivers nothing, however long it lasts). A node is due for
fencing when the bus delivered for ``--fence-after-s`` of its silence: the silence is the node's, not the bus's.

Bound (why an 8-s hang of nats-server fences nothing): when the server goes on, every node's states held back in the
hang come in one burst. Before the node's own state of the burst is read, its silence counted at most its state
interval (as received) plus ``max_gap_s`` (the hang's gap, capped): below ``--fence-after-s`` with the defaults
(1 s idle state interval, ``max_gap_s`` = ``--fence-after-s`` / 3 = 1 s, fence 3 s). A slow bus (PONGs of 1–2 s
under load) still counts every gap, up to ``max_gap_s`` each: a node dead meanwhile is fenced, later by at most the
ratio of the gaps to ``max_gap_s``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Held:
    """A node whose silence is past the fence time on the clock but not yet on the bus's deliveries."""

    node: str
    silent_s: float
    """Wall seconds of the node's silence during which the bus delivered (:meth:`DeliveryWitness.silent_s`)."""
    wait_s: float
    """Wall seconds of deliveries still needed before it is due (``fence_after_s - silent_s``, > 0)."""


class DeliveryWitness:
    """Per node, the wall seconds of its silence during which the bus was seen to deliver (see the module doc).

    Times are one monotonic clock in seconds (the router passes ``time.monotonic()``); a time earlier than the last
    one seen counts as that one (no negative gap). O(1) per call, O(nodes) memory.

    Args:
        max_gap_s: the most a gap between two deliveries counts (wall s, > 0): the router uses
            ``fence_after_s / 3``, twice its PING interval.

    Raises:
        ValueError: ``max_gap_s`` not > 0.
    """

    def __init__(self, max_gap_s: float) -> None:
        if not max_gap_s > 0:
            raise ValueError(f"max_gap_s must be > 0 (wall seconds), got {max_gap_s!r}")
        self.max_gap_s = max_gap_s
        self._last: float | None = None
        """Time of the last delivery (None: none yet)."""
        self._live = 0.0
        """Seconds counted from the first delivery to the last one (each gap up to ``max_gap_s``)."""
        self._marks: dict[str, float] = {}
        """node → :attr:`_live` at its last state."""
        self.gaps_capped = 0
        """Gaps longer than ``max_gap_s`` seen (each counted as ``max_gap_s``): hangs, or a very slow bus."""

    def heard(self, now: float) -> None:
        """A message came from the bus at ``now`` (a node's state, the PONG of this router's PING)."""
        last = self._last
        if last is not None and now > last:
            gap = now - last
            if gap > self.max_gap_s:
                self.gaps_capped += 1
                gap = self.max_gap_s
            self._live += gap
        if last is None or now > last:
            self._last = now

    def heard_after(self, t: float) -> bool:
        """Whether a delivery came later than ``t`` (the same clock): the bus delivers, whatever a PONG's delay."""
        return self._last is not None and self._last > t

    def node_heard(self, node: str, now: float) -> None:
        """``node``'s state came at ``now`` (and was taken: the view's ``last_seen`` moved): a delivery, and the start of
        the node's silence."""
        self.heard(now)
        self._marks[node] = self._live

    def silent_s(self, node: str) -> float | None:
        """Wall seconds of ``node``'s silence (since its last :meth:`node_heard`) during which the bus delivered, up to
        the last delivery; None for a node never heard."""
        mark = self._marks.get(node)
        return None if mark is None else self._live - mark

    def hold(self, node: str, fence_after_s: float) -> Held | None:
        """None when ``node``'s silence is the node's (the bus delivered for ``fence_after_s`` of it, or the node was
        never heard here: nothing to doubt), else the :class:`Held` that says how far it is."""
        silent = self.silent_s(node)
        if silent is None or silent >= fence_after_s:
            return None
        return Held(node, silent, fence_after_s - silent)

    def forget(self, node: str) -> None:
        """Drop ``node``'s mark (the view forgot it)."""
        self._marks.pop(node, None)
