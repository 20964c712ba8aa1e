"""CountStream: the worker's sequence check of ``kv.counts.<node>`` (sans-IO).

The KV directory sends branch counts R[b, node] (paper Alg. E.2) as absolute new values, only
when they change, numbered ``seq`` = 1, 2, ... per node within one directory process
(``CountUpdates.epoch``). Core NATS delivers at most once: a lost message would leave its
blocks' counts stale until they change again, maybe never. This class tells, per message, what
the shell does with it, and when the node's counts must be fetched whole from the directory
(``kv.countsync.<node>``, ``CountSnapshot``):

* a new ``epoch`` (a restarted directory, whose counts start empty; or a directory that forgot this
  node id, gave its slot to another node and registered it anew, with no counts: its epoch then
  ends in ``.<generation>``, ``DirectoryService.node_epoch``): reset every count to 0,
  then go on with the new process's numbers (the first message must be ``seq`` 1, or the ones
  before it were lost: a gap);
* ``seq == last + 1``: apply;
* ``seq <= last``: an old or duplicated message, dropped (``stale``);
* ``seq > last + 1``: a gap: a sync starts; the message, and every later one while the sync
  runs, is applied at once AND kept (at most ``buffer_entries`` block counts in all, an empty
  message counting one; past it the oldest messages are dropped first, counted, the newest one
  always kept), so a sync that cannot complete (no directory answers ``kv.countsync``: one that
  predates it, a permission missing, a directory too busy) never freezes the counts: they stay
  as without the sync, only the lost message's blocks stale (``sync.applied_early``); one that
  arrives after a message numbered past it is only kept (its values are older);
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

An ``epoch`` the worker held counts of before the one it holds now (the directory restarted;
the last ``retired_max``, 8, are remembered) is over: a late message or beacon of it is dropped
(``stale_epoch``), not taken for another restart (which would reset the counts and cost a sync).
Epochs are opaque (``uuid4().hex`` per directory process, ``DirectoryService.count_epoch``, with a
``.<generation>`` per registration of the node id after a slot was taken over): a process never
reuses one for a node, so a genuinely new epoch is never among them. (A worker that first hears
a new process, then a late message of the one before it, never held that one: it takes it for a
restart, as before.)

A message's epoch is only a claim: anyone allowed to publish ``kv.counts`` can send one with a new
epoch (the fuzz flood does), and the worker adopts it, retiring the real one. The sync's snapshot
is different: it is the reply to the worker's own request (a fresh reply inbox per request, and
per piece: nats-py's ``request`` matches the reply by a per-request token and drops one arriving
after its request timed out, so no reply of an earlier request or sync is ever taken; a sync
superseded meanwhile is told by :attr:`CountStream.gen`), so it comes from the responder that is
live on ``kv.countsync.<node>``. It is the authority: its epoch is adopted even if retired (taken
back out of :attr:`CountStream.retired`, ``sync.epoch_restored``; the epoch left is retired), and
that epoch's messages apply from then on. Without this, one forged-epoch message cut the worker
off from the real directory for good (its snapshot and messages all dropped as of a retired
epoch, a sync asked every few seconds forever). While the epoch held came back that way
(:attr:`CountStream.restored`: until a message adopts a new one), a message or beacon of a retired
epoch also starts a sync (``sync.started.retired_epoch``; if none runs): the snapshot may have come
from an old process still answering while its successor started (two directories up at once),
which then stops, leaving the worker on an epoch nobody sends; the live responder's next snapshot
settles it. The same holds while the epoch held was adopted from a message that retired another
(:attr:`CountStream.claimed`: until a snapshot of it comes): a new epoch's ``seq`` 0 (the
announcement) or 1 starts no sync, so one forged such message retired the real epoch with no
snapshot to undo it, and every real message and beacon after it was dropped as ``stale_epoch``
for good (seen: 5 of 5 real messages dropped after one forged ``seq`` 1, commit e53688f's rule
only covered ``seq`` > 1). Now the real directory's next message or beacon (one every
``--count-seq-beacon-s``) starts one sync, whose snapshot restores its epoch. After a genuine
restart a late message of the dead process costs at most that one sync (its snapshot, of the new
epoch, ends the doubt); otherwise a late message of a retired epoch costs nothing but its drop.

A snapshot of the epoch held numbered below the last message applied (``sync.behind``) cannot come
from the directory (it takes the snapshot after every message it numbered, and no message moves
:attr:`CountStream.last` while a sync runs) unless that message was forged in sequence
(``seq = last + 1`` with the real epoch): it is adopted like any other (``last`` goes back to its
``seq``). It used to be refused and asked again, which on an idle node (the directory's numbers not
growing) repeated for good: one forged message and one forged beacon cost a snapshot every
``--count-sync-min-interval-s`` forever (seen: 10 of 10 asks refused).

A snapshot of more than ``max_entries`` blocks (:data:`SNAPSHOT_MAX_ENTRIES`; its first piece
says how many) is not fetched: the sync ends (``sync.too_large``), and no later gap of that epoch
nor a reconnect starts one (``sync.unsynced``: the numbering goes on from the message or beacon
that showed the gap, the counts stay as without the sync); a new epoch lifts it. No request is
repeated either way.

A kept message numbered past ``S`` that arrived before the sync's first request was sent cannot
come from the directory (it numbered at most ``S`` messages by then): it is dropped
(``sync.beyond_snapshot``), so a forged sequence jump costs one sync, not a loop of them.

Every counter this class raises is under :attr:`CountStream.counters`; the shell reports them
with the prefix ``counts.``.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Literal

from shared.messages import CountUpdates

SNAPSHOT_MAX_ENTRIES = 2**30
"""Most entries (blocks with R[b, node] > 0) of a ``kv.countsync`` snapshot a worker fetches; one
announcing more (``CountSnapshot.total``) ends the sync unfetched (:meth:`CountStream.first_piece`).
For scale: a 2 TB host pool of 64-token blocks holds 2^30 blocks only at 32 B of KV per token;
Qwen2.5-0.5B in bf16 (24 layers × 2 KV heads × 64 dims × K,V × 2 B ≈ 12 KB a token) fills it with
≈2.5 M blocks, GLM-5.2 (≈50 KB a token, DESIGN §5) with ≈0.6 M. Held as the shell holds a snapshot
(two lists, an int object per hash) 2^30 entries take ≈50 GB, which bounds what a forged ``total``
can make a worker ask for."""

Action = Literal["apply", "stale", "kept", "beacon"]
"""What the shell does with a message: apply it now (while a sync runs it is also kept, to apply
again after the snapshot), drop it, nothing yet (kept for after the sync: it came after a message
numbered past it, whose values it must not overwrite), or nothing (a beacon: no counts; a gap it
showed has started a sync)."""


class CountStream:
    """Sequence state of one node's ``kv.counts`` (one directory process at a time).

    Args:
        buffer_entries: block counts (hashes; an empty message counts one) of the messages kept
            while a sync runs: past it the oldest messages are dropped (a dropped one leaves a
            hole, so another sync follows), the newest one always kept (one message is bounded by
            ``shared.validate.MAX_KV_BATCH_HASHES``).
        retired_max: epochs held before the current one that are remembered as over.
        max_entries: most entries of a snapshot fetched (:data:`SNAPSHOT_MAX_ENTRIES`).
    """

    def __init__(self, buffer_entries: int = 2**20, retired_max: int = 8, max_entries: int = SNAPSHOT_MAX_ENTRIES) -> None:
        if buffer_entries < 1 or retired_max < 1 or max_entries < 1:
            raise ValueError("buffer_entries, retired_max and max_entries must be >= 1")
        self.buffer_entries = buffer_entries
        self.max_entries = max_entries
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
        self.kept_entries = 0
        """Block counts in :attr:`kept` (an empty message counts one): at most ``buffer_entries``
        unless a single message holds more."""
        self.retired: deque[str] = deque(maxlen=retired_max)
        """Epochs held before :attr:`epoch`, newest last: their messages and beacons are dropped (a
        snapshot of one is adopted: :meth:`snapshot`)."""
        self.restored = False
        """Whether :attr:`epoch` was taken back from :attr:`retired` by a snapshot (:meth:`snapshot`)
        and no message has adopted a new epoch since: then a message or beacon of a retired epoch
        starts a sync (the snapshot's responder may have been an old process that has stopped since)."""
        self.claimed = False
        """Whether :attr:`epoch` was adopted from a message (not a snapshot) that retired another, and
        no snapshot of it has come since: then a message or beacon of a retired epoch starts a sync
        (the message may have been forged, leaving the live directory's epoch retired)."""
        self.unsynced: str | None = None
        """Epoch whose snapshot was too large to fetch (:meth:`first_piece`): its gaps start no sync."""
        self.asked_above = 0
        """Highest kept ``seq`` when the sync's first request went out (:meth:`asking`)."""
        self.kept_top = 0
        """Highest ``seq`` applied early while syncing (0: none): a kept message below it is not applied
        early (its values are older; the snapshot's replay applies it in order)."""
        self.counters: Counter[str] = Counter()

    def offer(self, msg: CountUpdates) -> tuple[bool, Action]:
        """What to do with one received message: ``(reset, action)``. ``reset``: the directory
        restarted (a new epoch): every count back to 0 first. O(1) (amortised; a full buffer
        drops its oldest message in O(kept); an epoch is looked up among ``retired_max``)."""
        c = self.counters
        if msg.epoch != self.epoch and msg.epoch in self.retired:  # a late one of a process that is gone
            c["stale_epoch"] += 1
            if (self.restored or self.claimed) and not self.syncing:  # or the live one, if the epoch held is in doubt
                self.start_sync("retired epoch")
            return False, "stale"
        if msg.beacon and msg.seq:
            return self._beacon(msg)
        if msg.epoch != self.epoch:
            reset = self._new_epoch(msg.epoch)
            if msg.seq > 1:
                if self._gap("first contact" if not reset else "new epoch"):
                    self._keep(msg)
                else:
                    self.last = msg.seq
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
        if self._gap("gap"):
            self._keep(msg)
        else:
            self.last = seq
        return False, "apply"

    def _new_epoch(self, epoch: str) -> bool:
        """Adopt ``epoch`` with nothing applied in it; returns whether counts of another one were held (reset them)."""
        c = self.counters
        reset = self.epoch is not None
        if reset:
            c["directory_restarts"] += 1
        if self.syncing:  # the old process's counts are gone: its snapshot would not fit
            self._end_sync()
            c["sync.abandoned"] += 1
        self._adopt(epoch)
        self.restored = False
        self.claimed = reset
        return reset

    def _end_sync(self) -> None:
        """No sync runs any more: a reply to one of its requests is discarded (:attr:`gen`)."""
        self.syncing = False
        self.gen += 1

    def _adopt(self, epoch: str) -> None:
        """Hold counts of ``epoch`` from none of its messages: nothing applied, nothing kept; the
        epoch held so far is remembered as over (:attr:`retired`), ``epoch`` no longer is."""
        if self.epoch is not None and self.epoch != epoch and self.epoch not in self.retired:
            self.retired.append(self.epoch)
        if epoch in self.retired:
            self.retired.remove(epoch)
        self.epoch, self.last = epoch, 0
        self._drop_kept()

    def _drop_kept(self) -> None:
        self.kept.clear()
        self.kept_entries = 0
        self.kept_top = 0

    def _beacon(self, msg: CountUpdates) -> tuple[bool, Action]:
        """A beacon: the directory has published the node's messages up to ``msg.seq`` (> 0)."""
        c = self.counters
        c["beacon"] += 1
        if msg.epoch != self.epoch:  # messages 1..seq of this process all missed
            reset = self._new_epoch(msg.epoch)
            if not self._gap("first contact" if not reset else "new epoch"):
                self.last = msg.seq
            return reset, "beacon"
        if self.syncing or msg.seq <= self.last:
            return False, "beacon"
        if not self._gap("beacon"):
            self.last = msg.seq
        return False, "beacon"

    def start_sync(self, reason: str) -> bool:
        """Ask for the node's counts whole although no gap was seen (the worker reconnected to NATS:
        a message sent meanwhile may be lost with none after it to show the gap). Returns whether a
        sync started (False: one runs already, or the epoch's snapshot is too large to fetch:
        ``sync.unsynced``)."""
        if self.syncing:
            return False
        if self.unsynced is not None and self.unsynced == self.epoch:
            self.counters["sync.unsynced"] += 1
            return False
        self.syncing = True
        self.reason = reason
        self.counters["sync.started"] += 1
        self.counters[f"sync.started.{reason.replace(' ', '_')}"] += 1
        return True

    def asking(self) -> int:
        """The sync's first request (the one that makes the directory take its snapshot) goes out
        now: kept messages so far were sent before the snapshot. Returns :attr:`gen`, to pass to
        :meth:`first_piece` and :meth:`snapshot`."""
        self.asked_above = max(self.kept, default=0)
        return self.gen

    def first_piece(self, epoch: str, total: int, gen: int) -> bool:
        """The first piece of the snapshot asked under ``gen`` says it is of ``epoch`` and has
        ``total`` entries: whether to fetch the rest (True for a superseded sync's, which
        :meth:`snapshot` discards, and for a retired epoch: the live responder's, adopted). False
        only for more than ``max_entries`` entries (``sync.too_large``): then the sync ends, the
        kept messages are dropped (each was applied when it came, unless one numbered past it had
        been), the numbering goes on from the highest one, and no gap of ``epoch`` starts another
        sync (``sync.unsynced``). O(kept)."""
        c = self.counters
        if not self.syncing or gen != self.gen:
            return True  # a superseded sync's: snapshot() discards it
        if total <= self.max_entries:
            return True
        c["sync.too_large"] += 1
        self.unsynced = epoch
        if epoch == self.epoch:
            self.last = max(self.last, max(self.kept, default=0))
        self._drop_kept()
        self.asked_above = 0
        self._end_sync()
        return False

    def snapshot(self, epoch: str, seq: int, gen: int) -> list[CountUpdates] | None:
        """The directory's counts after its message ``seq`` of ``epoch`` arrived whole. Returns
        None when they must not be applied (a sync that no longer runs or was superseded: counted),
        else (one numbered below the counts held adopted too, ``sync.behind``: see the module docstring) (the snapshot's epoch adopted if it is
        another, even a retired one: the reply to this sync's own request comes from the live
        responder; see the module docstring) the kept messages to apply after
        them, in order: those that follow ``seq`` without a hole, then, if a hole is left (the
        sync goes on), the kept ones past it (applied early, so the reset must not undo them;
        they stay kept for the next snapshot). The shell then resets every count, applies the snapshot and these
        (:meth:`WorkerService._sync_counts`). O(kept)."""
        c = self.counters
        if not self.syncing or gen != self.gen:
            c["sync.superseded"] += 1
            return None
        if epoch != self.epoch:  # the directory restarted after the gap, or the epoch held was forged
            back = epoch in self.retired
            c["sync.epoch_restored" if back else "sync.new_epoch"] += 1
            self._adopt(epoch)
            self.restored = back
        elif seq < self.last:  # not the directory's numbers: a message was forged in sequence; asking again would loop
            c["sync.behind"] += 1
        self.claimed = False
        c["syncs"] += 1
        self.last = seq
        kept = self.kept
        old = [s for s in kept if s <= seq]
        forged = [s for s in kept if seq < s <= self.asked_above]
        for s in old:
            self._unkeep(s)
        for s in forged:
            self._unkeep(s)
        c["sync.kept_before_snapshot"] += len(old)
        c["sync.beyond_snapshot"] += len(forged)
        after = []
        while self.last + 1 in kept:
            self.last += 1
            after.append(self._unkeep(self.last))
        c["sync.applied_after"] += len(after)
        self.asked_above = 0
        if kept:  # a message after the snapshot was lost too: sync again
            c["sync.hole_after"] += 1
            # past the hole: applied early, undone by the reset, applied again (and still kept)
            return after + [kept[s] for s in sorted(kept)]
        self.syncing = False
        self.kept_top = 0
        return after

    def _gap(self, reason: str) -> bool:
        """A gap seen while no sync runs: count it and start one. Returns whether one started
        (False: the epoch's snapshot is too large, ``sync.unsynced``)."""
        self.counters["gap"] += 1
        if reason != "gap":
            self.counters[f"gap.{reason.replace(' ', '_')}"] += 1
        return self.start_sync(reason)

    def _unkeep(self, seq: int) -> CountUpdates:
        msg = self.kept.pop(seq)
        self.kept_entries -= max(1, len(msg.hashes))
        return msg

    def _keep(self, msg: CountUpdates) -> Action:
        """Keep a message received while syncing for after the snapshot; it is applied now too
        (``apply``), or dropped as a duplicate (``stale``)."""
        kept = self.kept
        if msg.seq in kept:
            self.counters["stale"] += 1  # the same message twice
            return "stale"
        early = msg.seq > self.kept_top
        kept[msg.seq] = msg
        self.kept_entries += max(1, len(msg.hashes))
        while self.kept_entries > self.buffer_entries and len(kept) > 1:
            self._unkeep(min(kept))
            self.counters["sync.buffer_overflow"] += 1
        if not early:  # older than a message applied early: its values must not overwrite that one's
            return "kept"
        self.kept_top = msg.seq
        self.counters["sync.applied_early"] += 1
        return "apply"
