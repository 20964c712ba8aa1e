"""CountStream: the worker's sequence check of ``kv.counts.<node>`` (sans-IO).

The KV directory sends branch counts R[b, node] (paper Alg. E.2) as absolute new values, only
when they change, numbered ``seq`` = 1, 2, ... per node within one directory process
(``CountUpdates.epoch``). Core NATS delivers at most once: a lost message would leave its
blocks' counts stale until they change again, maybe never. This class tells, per message, what
the shell does with it, and when the node's counts must be fetched whole from the directory
(``kv.countsync.<node>``, ``CountSnapshot``):

* a new ``epoch`` (a restarted directory, whose counts start empty): reset every count to 0,
  then go on with the new process's numbers (the first message must be ``seq`` 1, or the ones
  before it were lost: a gap);
* ``seq == last + 1``: apply;
* ``seq <= last``: an old or duplicated message, dropped (``stale``);
* ``seq > last + 1``: a gap: a sync starts; the message, and every later one while the sync
  runs, is applied at once AND kept (at most ``buffer_max``; the oldest dropped first, counted),
  so a sync that cannot complete (no directory answers ``kv.countsync``: one that predates it, a
  permission missing, a directory too busy) never freezes the counts: they stay as without the
  sync, only the lost message's blocks stale (``sync.applied_early``); one that arrives after a
  message numbered past it is only kept (its values are older);
* the sync's snapshot (the counts after message ``S``): reset, apply it, drop the kept messages
  up to ``S``, apply the kept ones after it in order again (the reset undid them); a hole among
  them (a message after ``S`` lost too) keeps the sync going. Messages carry absolute values, so
  what was applied early changes nothing the reset and the snapshot do not replace;
* ``seq == 0``: a message outside the numbering (the directory's epoch announcement, which
  carries no counts): applied, never a gap;
* a beacon (``CountUpdates.beacon``, no counts; the directory sends one per node every
  ``--count-seq-beacon-s`` with the ``seq`` of the last message it published to the node):
  ``seq > last`` is a gap (``gap.beacon``): the last message(s) were lost with none after them,
  which no numbered message would ever show; ``seq <= last`` is fine (``seq < last``: the beacon
  was read before a later message went out); in a new epoch every message up to ``seq`` was
  missed (a gap, as a numbered message past 1); while a sync runs it is ignored (the snapshot is
  taken after it was sent, or, if not, the next beacon shows what is still missing). Never kept,
  never applied, never taken for the message with its number. (A beacon with ``seq`` 0 says
  nothing the epoch announcement does not: taken as one.)

A kept message numbered past ``S`` that arrived before the sync's first request was sent cannot
come from the directory (it numbered at most ``S`` messages by then): it is dropped
(``sync.beyond_snapshot``), so a forged sequence jump costs one sync, not a loop of them.

Every counter this class raises is under :attr:`CountStream.counters`; the shell reports them
with the prefix ``counts.``.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from shared.messages import CountUpdates

Action = Literal["apply", "stale", "kept", "beacon"]
"""What the shell does with a message: apply it now (while a sync runs it is also kept, to apply
again after the snapshot), drop it, nothing yet (kept for after the sync: it came after a message
numbered past it, whose values it must not overwrite), or nothing (a beacon: no counts; a gap it
showed has started a sync)."""


class CountStream:
    """Sequence state of one node's ``kv.counts`` (one directory process at a time).

    Args:
        buffer_max: messages kept while a sync runs (the oldest are dropped past it; a dropped one
            leaves a hole, so another sync follows).
    """

    def __init__(self, buffer_max: int = 4096) -> None:
        if buffer_max < 1:
            raise ValueError("buffer_max must be >= 1")
        self.buffer_max = buffer_max
        self.epoch: str | None = None
        """``CountUpdates.epoch`` of the counts held (None before the first message or snapshot)."""
        self.last = 0
        """Last ``seq`` applied in :attr:`epoch` (0: none; a snapshot sets it to its ``seq``)."""
        self.syncing = False
        """True from a gap (or :meth:`start_sync`) until a snapshot closes it."""
        self.reason = ""
        """Why the sync in progress started (``gap``, ``first contact``, ``reconnect``, ...)."""
        self.gen = 0
        """Bumped when a sync in progress no longer fits (a new epoch arrived): a reply to a request
        sent under an older generation is discarded (:meth:`snapshot`)."""
        self.kept: dict[int, CountUpdates] = {}
        """Messages of :attr:`epoch` received while syncing, by ``seq``."""
        self.asked_above = 0
        """Highest kept ``seq`` when the sync's first request went out (:meth:`asking`)."""
        self.kept_top = 0
        """Highest ``seq`` applied early while syncing (0: none): a kept message below it is not applied
        early (its values are older; the snapshot's replay applies it in order)."""
        self.counters: Counter[str] = Counter()

    def offer(self, msg: CountUpdates) -> tuple[bool, Action]:
        """What to do with one received message: ``(reset, action)``. ``reset``: the directory
        restarted (a new epoch): every count back to 0 first. O(1) (amortised; a full buffer
        drops its oldest message in O(kept))."""
        c = self.counters
        if msg.beacon and msg.seq:
            return self._beacon(msg)
        if msg.epoch != self.epoch:
            reset = self._new_epoch(msg.epoch)
            if msg.seq > 1:
                self._gap("first contact" if not reset else "new epoch")
                self._keep(msg)
                return reset, "apply"
            if msg.seq == 1:
                self.last = 1
            return reset, "apply"
        seq = msg.seq
        if seq == 0:  # outside the numbering (the epoch announcement)
            c["unsequenced"] += 1
            return False, "apply"
        if seq <= self.last:
            c["stale"] += 1
            return False, "stale"
        if self.syncing:
            return False, self._keep(msg)
        if seq == self.last + 1:
            self.last = seq
            return False, "apply"
        self._gap("gap")
        self._keep(msg)
        return False, "apply"

    def _new_epoch(self, epoch: str) -> bool:
        """Adopt ``epoch`` with nothing applied in it; returns whether counts of another one were held (reset them)."""
        c = self.counters
        reset = self.epoch is not None
        if reset:
            c["directory_restarts"] += 1
        if self.syncing:  # the old process's counts are gone: its snapshot would not fit
            self.syncing = False
            self.gen += 1
            c["sync.abandoned"] += 1
        self._adopt(epoch)
        return reset

    def _adopt(self, epoch: str) -> None:
        """Hold counts of ``epoch`` from none of its messages: nothing applied, nothing kept."""
        self.epoch, self.last = epoch, 0
        self.kept.clear()
        self.kept_top = 0

    def _beacon(self, msg: CountUpdates) -> tuple[bool, Action]:
        """A beacon: the directory has published the node's messages up to ``msg.seq`` (> 0)."""
        c = self.counters
        c["beacon"] += 1
        if msg.epoch != self.epoch:  # messages 1..seq of this process all missed
            reset = self._new_epoch(msg.epoch)
            self._gap("first contact" if not reset else "new epoch")
            return reset, "beacon"
        if self.syncing or msg.seq <= self.last:
            return False, "beacon"
        self._gap("beacon")
        return False, "beacon"

    def start_sync(self, reason: str) -> bool:
        """Ask for the node's counts whole although no gap was seen (the worker reconnected to NATS:
        a message sent meanwhile may be lost with none after it to show the gap). Returns whether a
        sync started (False: one runs already)."""
        if self.syncing:
            return False
        self.syncing = True
        self.reason = reason
        self.counters["sync.started"] += 1
        self.counters[f"sync.started.{reason.replace(' ', '_')}"] += 1
        return True

    def asking(self) -> int:
        """The sync's first request (the one that makes the directory take its snapshot) goes out
        now: kept messages so far were sent before the snapshot. Returns :attr:`gen`, to pass to
        :meth:`snapshot`."""
        self.asked_above = max(self.kept, default=0)
        return self.gen

    def snapshot(self, epoch: str, seq: int, gen: int) -> list[CountUpdates] | None:
        """The directory's counts after its message ``seq`` of ``epoch`` arrived whole. Returns
        None when they must not be applied (a sync that no longer runs or was superseded, or a
        snapshot older than the counts held: counted), else the kept messages to apply after
        them, in order: those that follow ``seq`` without a hole, then, if a hole is left (the
        sync goes on), the kept ones past it (applied early, so the reset must not undo them;
        they stay kept for the next snapshot). The shell then resets every count, applies the snapshot and these
        (:meth:`WorkerService._sync_counts`). O(kept)."""
        c = self.counters
        if not self.syncing or gen != self.gen:
            c["sync.superseded"] += 1
            return None
        if epoch != self.epoch:  # the directory restarted after the gap: its snapshot is all there is
            c["sync.new_epoch"] += 1
            self._adopt(epoch)
        elif seq < self.last:  # cannot come from the directory (its numbers only grow): ask again
            c["sync.stale"] += 1
            return None
        c["syncs"] += 1
        self.last = seq
        kept = self.kept
        old = [s for s in kept if s <= seq]
        forged = [s for s in kept if seq < s <= self.asked_above]
        for s in old:
            del kept[s]
        for s in forged:
            del kept[s]
        c["sync.kept_before_snapshot"] += len(old)
        c["sync.beyond_snapshot"] += len(forged)
        after = []
        while self.last + 1 in kept:
            self.last += 1
            after.append(kept.pop(self.last))
        c["sync.applied_after"] += len(after)
        self.asked_above = 0
        if kept:  # a message after the snapshot was lost too: sync again
            c["sync.hole_after"] += 1
            # past the hole: applied early, undone by the reset, applied again (and still kept)
            return after + [kept[s] for s in sorted(kept)]
        self.syncing = False
        self.kept_top = 0
        return after

    def _gap(self, reason: str) -> None:
        self.counters["gap"] += 1
        if reason != "gap":
            self.counters[f"gap.{reason.replace(' ', '_')}"] += 1
        self.start_sync(reason)

    def _keep(self, msg: CountUpdates) -> Action:
        """Keep a message received while syncing for after the snapshot; it is applied now too
        (``apply``), or dropped as a duplicate (``stale``)."""
        kept = self.kept
        if msg.seq in kept:
            self.counters["stale"] += 1  # the same message twice
            return "stale"
        early = msg.seq > self.kept_top
        kept[msg.seq] = msg
        if len(kept) > self.buffer_max:
            del kept[min(kept)]
            self.counters["sync.buffer_overflow"] += 1
        if not early:  # older than a message applied early: its values must not overwrite that one's
            return "kept"
        self.kept_top = msg.seq
        self.counters["sync.applied_early"] += 1
        return "apply"
