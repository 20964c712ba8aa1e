"""Branch table and branch counts R[b, n] (paper Alg. E.1 and E.2; DESIGN §4).

This module contains zero I/O; every transition of a branch lives here.

State:

* branch table ``S[β] = (version v_β, path π_β, counted C_{β,n} per node)``;
  ``N_β`` is the set of nodes with a non-empty ``C_{β,n}``;
* counts ``R[n][b]`` = number of active branches β with ``b ∈ C_{β,n}``;
* an outbox of count changes per node, drained by :meth:`BranchTable.take_count_updates`.

Transitions (one method each):

===============================  =============================================================
``start``                        new branch: v = 1, π = ∅, no counts (forks and sub-agents too)
``place`` (Alg. E.1)             π_old not a prefix of π_new → v += 1 and, on every m ∈ N_β,
                                 ``Count(β, m, C_{β,m} ∩ π_new)`` (release dropped history)
``place`` (Alg. E.2 l.9-12)      ``Count(β, n, π_β)``; nodes m ∈ N_β whose phase the placement
                                 covers (P→P, D→D) are released once n holds v_β (the last block
                                 of π_β is present on n); other-phase nodes keep their counts
``end``                          ``Release(β, m)`` for m ∈ N_β; β is forgotten (its id remembered
                                 for ``ended_memory`` ids so a late placement is refused)
``node_phase_changed`` D→P       ``Release(β, n)`` for every β counting on n; P→D keeps counts
``expire``                       a branch silent for ``ttl_s`` is ended and counted (a start or
                                 placement of a fork / sub-agent counts as activity of its parents;
                                 a branch with a tool call outstanding is kept until its hold ends)
``resume`` (issue 21)            a start or placement of an *expired* branch re-creates it (v = 1,
                                 π = ∅, its kind / parent / agent remembered) and is counted in
                                 ``branch.resumed``: an agent back from a pause longer than the
                                 TTL is served, never refused; only an explicitly *ended* id is
                                 refused (``place.ended_branch``)
``hold`` (issue 21)              "tool call outstanding" (``BranchToolCall``): the branch counts as
                                 active until ``now + expected_s`` (at most ``max_hold_s``) or its
                                 next placement, whichever comes first, and expires no earlier than
                                 a TTL after the hold ends (re-checked every TTL); its counts stay
===============================  =============================================================

Counts are *logical* references: a host eviction does not change them (DESIGN
deviation from Alg. E.2 line 20, documented in README.md), so R stays a pure
function of the branch table. When a counted block becomes present in a node's
host memory its count is re-sent, so a worker that keeps counts only for the
blocks it holds still converges.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import compress, filterfalse, repeat
from operator import add as _add
from operator import ne as _ne
from operator import not_ as _not
from operator import sub as _sub
from dataclasses import dataclass, field

from shared.messages import CountUpdates

from .index import GPU, HOST, BlockIndex, tier_bit

_EMPTY: frozenset[int] = frozenset()
_REPEAT0 = repeat(0)
_REPEAT1 = repeat(1)
_REPEAT_M1 = repeat(-1)
_ONE_EQ = (1).__eq__


def _drain(it: Iterable[object]) -> None:
    deque(it, maxlen=0)

PHASE_SET = {"prefill": frozenset({"prefill"}), "decode": frozenset({"decode"}), "both": frozenset({"prefill", "decode"})}


@dataclass(slots=True, eq=False)
class Branch:
    """One row of the branch table."""

    bid: str
    kind: str = "main"
    parent: str | None = None
    agent: str | None = None
    version: int = 1
    path: list[int] = field(default_factory=list)
    """π_β: block path of the branch's last request."""
    path_set: frozenset[int] = _EMPTY
    counted: dict[int, frozenset[int]] = field(default_factory=dict)
    """node index → C_{β,n} (only non-empty sets; the keys are N_β)."""
    pending: dict[int, set[int]] = field(default_factory=dict)
    """target node → source nodes to release once the target holds v_β."""
    watch: dict[int, int] = field(default_factory=dict)
    """target node → block hash watched for it (the last block of π_β)."""
    last_seen: float = 0.0
    implicit: bool = False
    """Created by a placement that came before its BranchStart."""
    requests: int = 0
    last_prefill_node: int | None = None
    hold_until: float = 0.0
    """A tool call is outstanding until this time (simulated s; 0 = none): no expiry before it."""


@dataclass(slots=True)
class PlaceOutcome:
    """What :meth:`BranchTable.place` did (input to lost-reuse attribution)."""

    branch: Branch | None
    version: int = 0
    bumped: bool = False
    rejected: str | None = None
    """Why the placement was refused (``ended_branch``), else None."""
    history_blocks: int = 0
    """Blocks of π_new that the branch (or, for a fork's first request, its parent) had in its path before."""
    prev_prefill_node: int | None = None
    released_nodes: list[int] = field(default_factory=list)


class BranchTable:
    """Branch table, counts and their outbox.

    Args:
        index: the block index (read only: presence checks).
        counters: the directory's counter dict (shared, instance-owned).
        ttl_s: silence (simulated s) after which a branch is expired.
        ended_memory: how many ended (and, separately, expired) branch ids are remembered.
        max_hold_s: longest hold of a "tool call outstanding" hint (simulated s).
        max_updates_per_msg: split a node's count updates into messages of at most this many.
    """

    def __init__(
        self,
        index: BlockIndex,
        counters: Counter[str],
        *,
        ttl_s: float = 1800.0,
        ended_memory: int = 65536,
        max_updates_per_msg: int = 4096,
        max_hold_s: float = 14400.0,
    ) -> None:
        self.index = index
        self.max_hold_s = max_hold_s
        self.expired: OrderedDict[str, tuple[str, str | None, str | None]] = OrderedDict()
        """Ids expired by the TTL (oldest first) → (kind, parent, agent), for their resume."""
        self.counters = counters
        self.ttl_s = ttl_s
        self.ended_memory = ended_memory
        self.max_updates_per_msg = max_updates_per_msg
        self.branches: OrderedDict[str, Branch] = OrderedDict()
        """Active branches in order of last activity (oldest first)."""
        self.ended: OrderedDict[str, float] = OrderedDict()
        self.R: list[dict[int, int]] = []
        """R[node][block] > 0: number of active branches counting block on node."""
        self.counted_copies: list[list[int]] = []
        """[node][tier]: present copies whose count is > 0 (kept on 0↔1 crossings)."""
        self.node_branches: list[set[str]] = []
        """[node]: ids of branches with a non-empty C_{β,node}."""
        self.outbox: list[dict[int, int]] = []
        """[node]: block → its count before the first unsent change (-1 = send anyway)."""
        self.out_seq: list[int] = []
        self.node_names: list[str] = []
        self.node_phase: list[str | None] = []
        """Phase reported by split.applied (authoritative)."""
        self.placed_phase: list[str | None] = []
        """Phase of the last placement on the node (used when no split was reported)."""
        self.watch: dict[int, set[tuple[int, str]]] = {}
        """block hash → {(target node, branch id)} awaiting that block (same-phase moves)."""

    # ------------------------------------------------------------------ #
    # nodes
    # ------------------------------------------------------------------ #

    def add_node(self, name: str) -> None:
        """Register the next node index (called by the core, dense from 0)."""
        self.R.append({})
        self.counted_copies.append([0, 0])
        self.node_branches.append(set())
        self.outbox.append({})
        self.out_seq.append(0)
        self.node_names.append(name)
        self.node_phase.append(None)
        self.placed_phase.append(None)

    def phase_of(self, n: int) -> str | None:
        """Current phase of node n as the directory knows it."""
        return self.node_phase[n] or self.placed_phase[n]

    # ------------------------------------------------------------------ #
    # Count / Release (Alg. E.2 lines 1-4)
    # ------------------------------------------------------------------ #

    def _count(self, b: Branch, n: int, target: frozenset[int]) -> None:
        """Make branch b count exactly the blocks of ``target`` on node n."""
        cur = b.counted.get(n, _EMPTY)
        if cur is target:
            return
        add = target - cur if cur else target
        rem = cur - target if target else cur
        if add or rem:
            # per block, but in C: map/compress/dict.update over the sets; Python steps only per
            # run of blocks whose count crosses 0 (presence is read per run of the index)
            R = self.R[n]
            out = self.outbox[n]
            setdefault = out.setdefault
            if add:
                old = list(map(R.get, add, _REPEAT0))
                _drain(map(setdefault, add, old))  # the count before the first unsent change
                R.update(zip(add, map(_add, old, _REPEAT1)))
                if 0 in old:
                    self._crossed(n, compress(add, map(_not, old)), 1)
            if rem:
                old = list(map(R.get, rem, _REPEAT0))
                zeros = old.count(0)
                if zeros:  # never counted here: refused, counted
                    self.counters["count.negative_prevented"] += zeros
                    keep = list(map(bool, old))
                    rem = list(compress(rem, keep))
                    old = list(compress(old, keep))
                _drain(map(setdefault, rem, old))
                ones = list(map(_ONE_EQ, old))
                if True in ones:
                    gone = list(compress(rem, ones))
                    _drain(map(R.__delitem__, gone))
                    self._crossed(n, gone, -1)
                    R.update(zip(compress(rem, map(_not, ones)), map(_sub, compress(old, map(_not, ones)), _REPEAT1)))
                else:
                    R.update(zip(rem, map(_sub, old, _REPEAT1)))
        if target:
            b.counted[n] = target
            self.node_branches[n].add(b.bid)
        else:
            b.counted.pop(n, None)
            self.node_branches[n].discard(b.bid)

    def _crossed(self, n: int, blocks: Iterable[int], d: int) -> None:
        """``blocks`` had their count on node n cross 0 (d = +1 up, -1 down): present copies
        with a positive count change by d per tier (``counted_copies``). Counted per run of
        the index (blocks of one run share their presence): O(blocks) C-level + O(runs)."""
        runs = self.index.live_runs
        gb, hb = tier_bit(n, GPU), tier_bit(n, HOST)
        cc = self.counted_copies[n]
        ids = list(map(id, map(self.index.where.get, blocks)))  # a run is an int: grouped by id
        uniq = dict.fromkeys(ids)
        # few runs (the usual: one path's stretch): one C-level count per run beats a Counter
        per_run = Counter(ids).items() if len(uniq) > 8 else zip(uniq, map(ids.count, uniq))
        for rid, k in per_run:
            r = runs.get(rid)
            if r is not None:
                pc = r.pc
                if pc & gb:
                    cc[GPU] += d * k
                if pc & hb:
                    cc[HOST] += d * k

    def _release(self, b: Branch, n: int) -> None:
        self._count(b, n, _EMPTY)
        self._unwatch(b, n)
        b.pending.pop(n, None)

    # ------------------------------------------------------------------ #
    # same-phase moves: release the source once the target holds v_β
    # ------------------------------------------------------------------ #

    def _unwatch(self, b: Branch, target: int) -> None:
        h = b.watch.pop(target, None)
        if h is not None:
            s = self.watch.get(h)
            if s is not None:
                s.discard((target, b.bid))
                if not s:
                    del self.watch[h]

    def _holds_version(self, b: Branch, n: int) -> bool:
        return not b.path or self.index.holds(n, b.path[-1])

    def _finish_move(self, b: Branch, target: int) -> list[int]:
        sources = b.pending.pop(target, set())
        self._unwatch(b, target)
        done = []
        for m in sources:
            if m != target and m in b.counted:
                self._count(b, m, _EMPTY)
                done.append(m)
        if done:
            self.counters["moves.released_sources"] += len(done)
        return done

    def _rewatch(self, b: Branch) -> None:
        """π_β changed: pending moves now wait for its new last block."""
        for t in list(b.pending):
            self._unwatch(b, t)
            if self._holds_version(b, t):
                self._finish_move(b, t)
            else:
                h = b.path[-1]
                b.watch[t] = h
                self.watch.setdefault(h, set()).add((t, b.bid))

    def on_stored(self, n: int, tier: int, newly: Sequence[int]) -> None:
        """Presence hook: blocks ``newly`` became present on (n, tier)."""
        if not newly:
            return
        R = self.R[n]
        if R:
            hit = R.keys() & newly
            if hit:
                self.counted_copies[n][tier] += len(hit)
                if tier == HOST:  # re-sent: the worker keeps counts only for blocks it holds
                    out = self.outbox[n]
                    out.update(zip(filterfalse(out.__contains__, hit), _REPEAT_M1))
        if self.watch:
            for h in self.watch.keys() & newly:
                for target, bid in list(self.watch.get(h, ())):
                    if target != n:
                        continue
                    b = self.branches.get(bid)
                    if b is not None and target in b.pending and b.path and b.path[-1] == h:
                        self._finish_move(b, target)

    def on_removed(self, n: int, tier: int, removed: Sequence[int]) -> int:
        """Presence hook: blocks ``removed`` left (n, tier).

        Returns:
            How many of them had a positive count on n.
        """
        R = self.R[n]
        if not R or not removed:
            return 0
        pos = len(R.keys() & removed)
        self.counted_copies[n][tier] -= pos
        return pos

    # ------------------------------------------------------------------ #
    # branch events
    # ------------------------------------------------------------------ #

    def _touch(self, b: Branch, now: float) -> None:
        b.last_seen = max(b.last_seen, now)
        self.branches.move_to_end(b.bid)
        self._touch_ancestors(b, now)

    def _touch_ancestors(self, b: Branch, now: float) -> None:
        """A fork or sub-agent that is active keeps its waiting parents from expiring: the
        parent is waiting for it, not silent. O(depth); stops at the first ancestor already
        touched at ``now`` (its own ancestors were touched with it)."""
        seen = 0
        p = b.parent
        while p is not None and seen < 64:  # bounded: ids are the harness's, a cycle must not hang
            pb = self.branches.get(p)
            if pb is None or pb.last_seen >= now:
                return
            pb.last_seen = now
            self.branches.move_to_end(p)
            p = pb.parent
            seen += 1

    def _remember_ended(self, bid: str, now: float) -> None:
        self.ended[bid] = now
        self.ended.move_to_end(bid)
        while len(self.ended) > self.ended_memory:
            self.ended.popitem(last=False)

    def start(self, bid: str, kind: str, parent: str | None, agent: str | None, now: float) -> str:
        """BranchStart: a new branch (main, fork, sub-agent) with v = 1 and π = ∅.

        Returns:
            ``started``, ``merged`` (a placement had created it implicitly),
            ``duplicate`` (already started) or ``ended`` (id already ended: refused).
        """
        b = self.branches.get(bid)
        if b is not None:
            if b.implicit:
                b.implicit = False
                b.kind, b.parent, b.agent = kind, parent, agent
                self._touch(b, now)
                return "merged"
            self.counters["branch.duplicate_start"] += 1
            return "duplicate"
        if bid in self.ended:
            self.counters["branch.start_after_end"] += 1
            return "ended"
        if self.expired.pop(bid, None) is not None:
            b = Branch(bid=bid, kind=kind, parent=parent, agent=agent, last_seen=now)
            self.branches[bid] = b
            self._touch_ancestors(b, now)
            self.counters["branch.resumed"] += 1
            return "resumed"
        b = Branch(bid=bid, kind=kind, parent=parent, agent=agent, last_seen=now)
        self.branches[bid] = b
        self._touch_ancestors(b, now)
        self.counters["branch.started"] += 1
        return "started"

    def _resume(self, bid: str, now: float, *, implicit: bool = False) -> Branch | None:
        """Re-create an expired branch (a resume, counted); None when ``bid`` did not expire.
        ``implicit``: a placement came first, the router's BranchStart may follow (merged)."""
        meta = self.expired.pop(bid, None)
        if meta is None:
            return None
        b = Branch(bid=bid, kind=meta[0], parent=meta[1], agent=meta[2], last_seen=now, implicit=implicit)
        self.branches[bid] = b
        self.counters["branch.resumed"] += 1
        return b

    def hold(self, bid: str, outstanding: bool, expected_s: float, now: float) -> str:
        """"Tool call outstanding" hint: keep ``bid`` (and its counts) from expiring until
        ``now + expected_s`` (0 or more than ``max_hold_s``: ``max_hold_s``), or release the hold
        (``outstanding`` False). An expired branch is resumed first.

        Returns:
            ``held``, ``released``, ``ended`` (an explicitly ended id: ignored) or ``unknown``.
        """
        b = self.branches.get(bid) or self._resume(bid, now)
        if b is None:
            key = "ended" if bid in self.ended else "unknown"
            self.counters[f"branch.hold_{key}"] += 1
            return key
        self._touch(b, now)
        if not outstanding:
            b.hold_until = 0.0
            self.counters["branch.hold_released"] += 1
            return "released"
        span = expected_s if 0 < expected_s <= self.max_hold_s else self.max_hold_s
        b.hold_until = max(b.hold_until, now + span)
        self.counters["branch.holds"] += 1
        return "held"

    def end(self, bid: str, now: float) -> str:
        """BranchEnd: release the branch on every node and forget it.

        Returns:
            ``ended``, ``duplicate_end`` (already ended) or ``unknown``.
        """
        b = self.branches.pop(bid, None)
        if b is None:
            if self.expired.pop(bid, None) is not None:  # ended by the harness after the TTL expired it
                self._remember_ended(bid, now)
                self.counters["branch.ended_after_expiry"] += 1
                return "ended"
            if bid in self.ended:
                self.counters["branch.duplicate_end"] += 1
                return "duplicate_end"
            self.counters["branch.unknown_end"] += 1
            self._remember_ended(bid, now)
            return "unknown"
        self._drop_branch(b)
        self._remember_ended(bid, now)
        self.counters["branch.ended"] += 1
        return "ended"

    def _drop_branch(self, b: Branch) -> None:
        for m in list(b.counted):
            self._count(b, m, _EMPTY)
        for t in list(b.watch):
            self._unwatch(b, t)
        b.pending.clear()

    def place(self, bid: str, n: int, phase: str, path: list[int], now: float) -> PlaceOutcome:
        """RoutePlaced: Alg. E.1 on the path, then Alg. E.2 placement of β on node n.

        Args:
            phase: ``prefill`` (prefill routing), ``decode`` (decode binding) or ``both``.
            path: the request's full-block path π_new (chained hashes).
        """
        b = self.branches.get(bid)
        if b is None:
            if bid in self.ended:
                self.counters["place.ended_branch"] += 1
                return PlaceOutcome(branch=None, rejected="ended_branch")
            b = self._resume(bid, now, implicit=True)
            if b is None:
                b = Branch(bid=bid, implicit=True, last_seen=now)
                self.branches[bid] = b
                self.counters["branch.implicit_start"] += 1
        self._touch(b, now)
        b.hold_until = 0.0  # the tool returned: the branch made its next request
        out = PlaceOutcome(branch=b, prev_prefill_node=b.last_prefill_node)
        # -- Alg. E.1 ------------------------------------------------------
        old = b.path
        if old and (len(old) > len(path) or path[: len(old)] != old):
            b.version += 1
            out.bumped = True
            self.counters["branch.version_bumps"] += 1
            new_set = frozenset(path)
            for m, cset in list(b.counted.items()):
                self._count(b, m, cset & new_set)  # release the dropped history once per node
            out.history_blocks = _common_prefix(old, path)
        else:
            new_set = b.path_set if path == old else frozenset(path)
            out.history_blocks = len(old)
        if b.requests == 0 and b.parent is not None and b.kind == "fork":
            pb = self.branches.get(b.parent)
            if pb is not None:
                out.history_blocks = max(out.history_blocks, _common_prefix(pb.path, path))
                if out.prev_prefill_node is None:
                    out.prev_prefill_node = pb.last_prefill_node
        b.path = path
        b.path_set = new_set
        b.requests += 1
        out.version = b.version
        if b.pending and path != old:
            self._rewatch(b)
        # -- Alg. E.2 placement ---------------------------------------------
        if self.placed_phase[n] != phase:
            self.placed_phase[n] = phase
        self._count(b, n, new_set)
        covered = PHASE_SET.get(phase, PHASE_SET["both"])
        sources = set()
        for m in b.counted:
            if m == n:
                continue
            pm = self.phase_of(m)
            if pm is not None and PHASE_SET[pm] <= covered:
                sources.add(m)
        for t in list(b.pending):  # an older same-phase target is now a source itself
            if t in sources:
                del b.pending[t]
                self._unwatch(b, t)
        self._unwatch(b, n)
        b.pending.pop(n, None)
        if sources:
            b.pending[n] = sources
            if self._holds_version(b, n):
                out.released_nodes = self._finish_move(b, n)
            else:
                h = b.path[-1]
                b.watch[n] = h
                self.watch.setdefault(h, set()).add((n, b.bid))
        if phase in ("prefill", "both"):
            b.last_prefill_node = n
        return out

    def node_phase_changed(self, n: int, old: str | None, new: str) -> int:
        """A node now serves ``new``; D→P resets its counts (Alg. E.2 line 14).

        Returns:
            Number of branches released on the node.
        """
        self.node_phase[n] = new
        if old != "decode" or new != "prefill":
            return 0
        released = 0
        for bid in list(self.node_branches[n]):
            b = self.branches.get(bid)
            if b is not None:
                self._release(b, n)
                released += 1
        self.counters["phase.reset_branches"] += released
        return released

    # ------------------------------------------------------------------ #
    # expiry
    # ------------------------------------------------------------------ #

    def expire(self, now: float) -> list[str]:
        """End branches silent for ``ttl_s`` (counted in ``branch.expired``)."""
        gone = []
        while self.branches:
            bid, b = next(iter(self.branches.items()))
            if b.last_seen + self.ttl_s > now:
                break
            if b.hold_until + self.ttl_s > now:  # a tool call is outstanding (or returned < a TTL ago): checked again a TTL later
                b.last_seen = now
                self.branches.move_to_end(bid)
                self.counters["branch.hold_kept"] += 1
                continue
            del self.branches[bid]
            self._drop_branch(b)
            self.expired[bid] = (b.kind, b.parent, b.agent)
            self.expired.move_to_end(bid)
            while len(self.expired) > self.ended_memory:
                self.expired.popitem(last=False)
            gone.append(bid)
        if gone:
            self.counters["branch.expired"] += len(gone)
        while self.ended:
            bid, t = next(iter(self.ended.items()))
            if t + self.ttl_s > now:
                break
            del self.ended[bid]
        return gone

    def next_deadline(self) -> float | None:
        """Simulated time at which :meth:`expire` has work, or None."""
        if not self.branches:
            return None
        b = next(iter(self.branches.values()))
        return b.last_seen + self.ttl_s

    # ------------------------------------------------------------------ #
    # outbox
    # ------------------------------------------------------------------ #

    def pending_updates(self) -> int:
        """Blocks with an unsent count change, over all nodes."""
        return sum(len(o) for o in self.outbox)

    def drop_count_updates(self) -> int:
        """Empty the outbox without building messages, for a caller whose engines ignore counts
        (the simulator under ``lru`` eviction); message sequence numbers do not advance, as no
        message is made. Returns the blocks dropped. O(nodes + blocks dropped)."""
        dropped = 0
        for out in self.outbox:
            if out:
                dropped += len(out)
                out.clear()
        return dropped

    def take_count_updates(self) -> list[CountUpdates]:
        """Drain the outbox: per node, the new count of every block whose count
        changed since the last drain (a change undone before the drain is not sent)."""
        msgs = []
        cap = self.max_updates_per_msg
        for n, out in enumerate(self.outbox):
            if not out:
                continue
            now = list(map(self.R[n].get, out, _REPEAT0))
            changed = list(map(_ne, now, out.values()))  # a change undone before the drain is not sent
            if False in changed:
                hashes = list(compress(out, changed))
                counts = list(compress(now, changed))
            else:
                hashes, counts = list(out), now
            out.clear()
            for i in range(0, len(hashes), cap):
                self.out_seq[n] += 1
                msgs.append(
                    CountUpdates(
                        node=self.node_names[n], seq=self.out_seq[n], hashes=hashes[i : i + cap], counts=counts[i : i + cap]
                    )
                )
        return msgs


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two block paths."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
