"""Branch table and branch counts R[b, n] (paper Alg. E.1 and E.2; DESIGN §4).

This module contains zero I/O; every transition of a branch lives here.

State:

* branch table ``S[β] = (version v_β, path π_β, counted C_{β,n} per node)``;
  ``N_β`` is the set of nodes with a non-empty ``C_{β,n}``. ``C_{β,n}`` is always a prefix
  of π_β (a placement counts π_new; a version bump cuts it to ``C ∩ π_new``, which for
  chained hashes, a hash naming its whole prefix, is the common prefix of π_old and π_new;
  an extension keeps prefixes prefixes), so it is stored as its length ``k_{β,n}`` and every
  Count is one path slice (:meth:`BranchTable.check` asserts it);
* counts ``R[n][b]`` = number of active branches β with ``b ∈ C_{β,n}``; along a path they
  never grow with depth (a dict per node; with ``chained`` one forest of runs of equal counts for
  all nodes, :class:`_CountRuns`, so a Count walks runs, not blocks);
* an outbox of count changes per node, drained by :meth:`BranchTable.take_count_updates` in
  the order the changes happened, each change's blocks parent first.

Paths must be chains (``shared.validate`` refuses a ``RoutePlaced`` whose hashes repeat; the
simulator re-chains trace ids): for a path that repeats a hash, given directly, counts stay
non-negative and nothing raises, but the repeated hash may keep a count after its branch ends.

Transitions (one method each):

===============================  =============================================================
``start``                        new branch: v = 1, π = ∅, no counts (forks and sub-agents too)
``place`` (Alg. E.1)             π_old not a prefix of π_new → v += 1 and, on every m ∈ N_β,
                                 ``Count(β, m, C_{β,m} ∩ π_new)`` (release dropped history)
``place`` (Alg. E.2 l.9-12)      ``Count(β, n, π_β)``; nodes m ∈ N_β whose phase the placement
                                 covers (P→P, D→D) are released once n holds v_β (the last block
                                 of π_β is present on n); other-phase nodes keep their counts
``end``                          ``Release(β, m)`` for m ∈ N_β; β is forgotten (its id remembered
                                 for ``ended_memory`` ids so a late placement is refused); the end
                                 may come through a router that never saw β (it asked
                                 ``branch.query``, :meth:`BranchTable.state`: another router served
                                 β, or it restarted since)
``node_phase_changed`` D→P       ``Release(β, n)`` for every β counting on n; P→D keeps counts
``expire``                       a branch silent for ``ttl_s`` is ended and counted (a start or
                                 placement of a fork / sub-agent counts as activity of its parents;
                                 a branch with a tool call outstanding is kept until its hold ends)
``evict``                        a router dropped the branch to cap its table (``BranchEnd`` with
                                 ``expired=True``): expired now, as by the TTL (same release and
                                 memory, resumable), counted in ``branch.evicted``; ignored when
                                 its ``rid`` is not the branch's latest placement (another router
                                 placed it since: ``branch.stale_evict``)
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

from bisect import bisect_right
from collections import Counter, OrderedDict, deque
from collections import _count_elements  # type: ignore[attr-defined]  # Counter.update's C loop (pure-Python fallback there)
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress, count, repeat
from operator import add as _add
from operator import attrgetter, contains, getitem, itemgetter
from operator import ge as _ge
from operator import ne as _ne
from operator import not_ as _not
from operator import sub as _sub
from typing import Any

import msgspec

from shared.messages import CountUpdates
from shared.values import FACTORY, IdentityValue, StructValue

from .index import GPU, HOST, BlockIndex, _match, local_bit, tier_bit

_REPEAT0 = repeat(0)
_REPEAT1 = repeat(1)
_REPEAT_M1 = repeat(-1)
_REPEAT_NONE = repeat(None)
_PC = attrgetter("pc")
_CNT = attrgetter("cnt")


def _drain(it: Iterable[object]) -> None:
    deque(it, maxlen=0)

PHASE_SET = {"prefill": frozenset({"prefill"}), "decode": frozenset({"decode"}), "both": frozenset({"prefill", "decode"})}


class Branch(IdentityValue):
    """One row of the branch table."""

    bid: str
    kind: str
    parent: str | None
    agent: str | None
    version: int
    path: list[int]
    """π_β: block path of the branch's last request (chained hashes; never mutated in place)."""
    counted: dict[int, int]
    """node index → k_{β,n} > 0: C_{β,n} is the prefix ``path[:k]`` (the keys are N_β)."""
    pending: dict[int, set[int]]
    """target node → source nodes to release once the target holds v_β."""
    watch: dict[int, int]
    """target node → block hash watched for it (the last block of π_β)."""
    last_seen: float
    implicit: bool
    """Created by a placement that came before its BranchStart."""
    requests: int
    last_prefill_node: int | None
    hold_until: float
    """A tool call is outstanding until this time (simulated s; 0 = none): no expiry before it."""
    last_rid: str | None
    """``RoutePlaced.rid`` of its latest placement (None: placed without one, as the simulator does):
    a router's eviction naming another rid is stale (:meth:`BranchTable.evict`)."""

    __slots__ = __match_args__ = (
        "bid", "kind", "parent", "agent", "version", "path", "counted", "pending", "watch", "last_seen", "implicit",
        "requests", "last_prefill_node", "hold_until", "last_rid",
    )

    def __init__(
        self, bid: str, kind: str = "main", parent: str | None = None, agent: str | None = None, version: int = 1,
        path: Any = FACTORY, counted: Any = FACTORY, pending: Any = FACTORY, watch: Any = FACTORY,
        last_seen: float = 0.0, implicit: bool = False, requests: int = 0, last_prefill_node: int | None = None,
        hold_until: float = 0.0, last_rid: str | None = None,
    ) -> None:
        self.bid = bid
        self.kind = kind
        self.parent = parent
        self.agent = agent
        self.version = version
        self.path = [] if path is FACTORY else path
        self.counted = {} if counted is FACTORY else counted
        self.pending = {} if pending is FACTORY else pending
        self.watch = {} if watch is FACTORY else watch
        self.last_seen = last_seen
        self.implicit = implicit
        self.requests = requests
        self.last_prefill_node = last_prefill_node
        self.hold_until = hold_until
        self.last_rid = last_rid


class PlaceOutcome(StructValue):
    """What :meth:`BranchTable.place` did (input to lost-reuse attribution)."""

    branch: Branch | None
    version: int = 0
    bumped: bool = False
    rejected: str | None = None
    """Why the placement was refused (``ended_branch``), else None."""
    history_blocks: int = 0
    """Blocks of π_new that the branch (or, for a fork's first request, its parent) had in its path before."""
    prev_prefill_node: int | None = None
    released_nodes: list[int] = msgspec.field(default_factory=list)


class BranchTable:
    """Branch table, counts and their outbox.

    Args:
        index: the block index (read only: presence checks).
        counters: the directory's counter dict (shared, instance-owned).
        ttl_s: silence (simulated s) after which a branch is expired.
        ended_memory: how many ended (and, separately, expired) branch ids are remembered.
        max_hold_s: longest hold of a "tool call outstanding" hint (simulated s).
        max_updates_per_msg: split a node's count updates into messages of at most this many.
        keep_counted_copies: keep :attr:`counted_copies` up to date on every presence change and
            0↔1 crossing (the live service: its gauges, read on every stats request and
            Prometheus scrape, then cost O(nodes), not a stall of O(counted blocks) in the event
            loop); False (the default, the simulator): counted when read.
        held_counts_only: a drain leaves out the changed counts of the blocks the index shows
            the node holding in neither tier (:meth:`take_count_updates`); only for a caller that
            applies a node's KV events before it drains (see there). False (the default): every
            changed count is sent.
        chained: every placed path and every stored block list agree as chains: no hash repeats
            in one, and a block named by several has the same block before it in each (a hash
            names its whole prefix, ``shared.hashing``). Then R[n] never grows along a stored
            or evicted chain (parent first), so the presence hooks find a chain's counted
            blocks and their counts by bisection, O(distinct counts · log L) probes, instead of
            a probe per block (:meth:`_resend`, :meth:`on_removed`), and a placement tells
            whether the old path is a prefix of the new one from its last hash (:meth:`place`),
            and R is kept in runs (:attr:`runs`): a Count, a move's count-up and release
            included, is O(runs of the path) Python steps with no per-block count update.
            For a caller that builds paths and stores from one chained id space (the simulator);
            False (the default): every block is probed, whole paths compared.
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
        keep_counted_copies: bool = False,
        held_counts_only: bool = False,
        chained: bool = False,
    ) -> None:
        self.index = index
        self.chained = chained
        self.keep_counted_copies = keep_counted_copies
        self.held_counts_only = held_counts_only
        self._cc: list[list[int]] = []
        """[node][tier]: present copies whose count is > 0, kept on 0↔1 crossings and presence
        changes (only with ``keep_counted_copies``)."""
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
        self.R: list[Any] = []
        """R[node][block] > 0: number of active branches counting block on node (a dict per node;
        with ``chained`` a read-only :class:`_NodeCounts` view of :attr:`runs`)."""
        self.runs = _CountRuns()
        """With ``chained``: every node's counts in runs of chains, so a Count walks runs, not
        blocks (issue 23: a move is O(runs of the path)); unused otherwise."""
        self.node_branches: list[dict[str, None]] = []
        """[node]: ids of branches with a non-empty C_{β,node}, in the order they started counting
        there (a dict, not a set: a D→P reset releases them in this order, the same in every
        process; a set of strings iterates in an order ``PYTHONHASHSEED`` decides)."""
        self.outbox: list[list[tuple[list[int], int | None, list[int]]]] = []
        """[node]: unsent count changes in the order they happened, each ``(blocks, step,
        after)``: a path slice (parent first) or the counted blocks of a host store (in the
        store's order), what the change added to each block's count (+1 or -1; None: a
        re-send, sent anyway) and their counts after it. The counts before, ``after - step``,
        are read only when a drain merges changes to the same blocks (a handful of drains per
        run), so no list of them is built per change."""
        self.out_len: list[int] = []
        """[node]: blocks listed in its outbox (a block changed twice is listed twice)."""
        self.chain_depths = False
        """Keep the path position of each outbox change that is a chain (a Count's path slice; a
        host store's counted head, position None: the store's; with :attr:`chained` only), for :meth:`take_count_lists`'
        ``chains``: an in-process caller (the simulator) hands them to the worker's host pool,
        which then finds a message's queued pages run by run (``BranchRunHostPool.update_counts``).
        False (the default): none kept."""
        self.out_depth: list[dict[int, tuple[list[int], int | None]]] = []
        """[node]: with :attr:`chain_depths`, ``id(blocks) → (blocks, path position of blocks[0])``
        for the outbox's chains (the list itself kept: its id names it while it is held); position
        None for a host store's counted blocks (the store's chain or its head: the worker knows where
        it stored them, the directory would have to scan its runs)."""
        self.resend_sink: Callable[[int, list[int], list[int], list[tuple[int | None, int]] | None], None] | None = None
        """An in-process caller's delivery of a host store's re-sent counts (:meth:`_resend`) as the
        message :meth:`take_count_lists` would make of them alone, ``sink(node index, hashes, counts,
        chains)`` (``chains``: ``[(None, len(hashes))]``, or None without :attr:`chain_depths`' depth),
        called at once instead of queueing the change, when the node's outbox is empty (no earlier
        change of it waits: the order of its messages is kept) and the change fits one message
        (``out_seq`` advances as for a message taken). For a caller that drains after every
        directory change anyway (the simulator, ``ClusterSim._flush_kv``): ~70% of its count
        messages are such re-sends (8,710 of 12,502 in the 600-s ``evolving`` simulation at
        512-token blocks), each otherwise queued, drained and unpacked. Changes to the same node
        that would have been one drain's message (two host stores of one batch) are then delivered
        one after the other: the worker's pool moves the same blocks either way (a drain cut into
        messages anywhere moves as in one message, ``BranchRunHostPool.update_counts``), and a
        node's counts do not change while its own KV events are applied (a move its stores finish
        releases other nodes), so each is sent the same counts. The sink runs inside the batch's
        apply: an exception it raises leaves the batch applied up to that store (the simulator
        stops on it). None (the default): queued."""
        self.resend_chain_sink: Callable[[int, list[int]], None] | None = None
        """An in-process caller's delivery of the re-sends :attr:`resend_sink` would get with
        chains ``[(None, len(hashes))]``, without their counts built: ``sink(node index, hashes)``,
        ``hashes`` a host store's counted chain (or its counted head) at the store's position, every
        one counted on the node (so every count > 0); the sink reads the counts with
        :meth:`chain_counts` only if it needs them (the simulator's ``ClusterSim._resend_chain``:
        the usual re-send sets its L1 runs' counted intervals, which need only "all > 0", and
        building them cost ~0.3% of a 600-s ``evolving`` simulation at 512-token blocks). Taken
        with :attr:`chained`, :attr:`chain_depths` and without :attr:`keep_counted_copies`, under
        :attr:`resend_sink`'s conditions (empty outbox, one message; ``out_seq`` advances), in its
        place. None (the default): :attr:`resend_sink` (or the outbox) gets them, counts built."""
        self.out_nodes: list[int] = []
        """Nodes whose outbox is not empty, each once, in the order they got their first change
        since the last drain: a drain visits only them (sorted), not every node (an empty
        drain, most of the simulator's ~7,400 per 300 s, cost ~5,000 instructions at 9 nodes)."""
        self.out_seq: list[int] = []
        self.node_names: list[str] = []
        self.node_phase: list[str | None] = []
        """Phase reported by split.applied (authoritative)."""
        self.placed_phase: list[str | None] = []
        """Phase of the last placement on the node (used when no split was reported)."""
        self.watch: list[dict[int, dict[str, None]]] = []
        """[target node]: block hash → ids of branches whose move to that node awaits the block
        (same-phase moves; in the order they started waiting)."""

    # ------------------------------------------------------------------ #
    # nodes
    # ------------------------------------------------------------------ #

    def add_node(self, name: str) -> None:
        """Register the next node index (called by the core, dense from 0)."""
        if self.chained:
            self.runs.total.append(0)
            self.R.append(_NodeCounts(self.runs, len(self.R)))
        else:
            self.R.append({})
        self._cc.append([0, 0])
        self.node_branches.append({})
        self.outbox.append([])
        self.out_depth.append({})
        self.watch.append({})
        self.out_len.append(0)
        self.out_seq.append(0)
        self.node_names.append(name)
        self.node_phase.append(None)
        self.placed_phase.append(None)

    def reset_node(self, n: int, name: str) -> None:
        """Give node index ``n`` to node id ``name`` with nothing of the node that had it (one
        forgotten for good, ``KvDirectory._take_over``): every branch stops counting there (R[n]
        emptied, ``C_{β,n}`` dropped, no count change queued: the old node is gone and the new
        one starts with no counts), no move waits for it or would release it (its watches and
        pending moves, as target and as source, dropped), no branch names it as its last prefill
        node (lost-reuse attribution would blame the new one), its outbox and message number
        (``out_seq``) back to empty and 0, its phases unknown. O(branches) Python steps +
        O(blocks counted there) C-level; with ``chained``: + O(runs of all nodes) Python steps
        (:meth:`_CountRuns.drop_node` looks at every run of the forest)."""
        for b in self.branches.values():
            if n in b.counted:
                del b.counted[n]
            if b.pending:
                b.pending.pop(n, None)
                for t, sources in list(b.pending.items()):
                    sources.discard(n)
                    if not sources:
                        del b.pending[t]
                        self._unwatch(b, t)
            b.watch.pop(n, None)
            if b.last_prefill_node == n:
                b.last_prefill_node = None
        if self.chained:
            self.runs.drop_node(n)
        else:
            self.R[n] = {}
        self._cc[n] = [0, 0]
        self.node_branches[n] = {}
        self.watch[n] = {}
        self.out_depth[n].clear()
        if self.out_len[n] or self.outbox[n]:
            self.outbox[n] = []
            self.out_len[n] = 0
            if n in self.out_nodes:
                self.out_nodes.remove(n)
        self.out_seq[n] = 0
        self.node_names[n] = name
        self.node_phase[n] = None
        self.placed_phase[n] = None

    def phase_of(self, n: int) -> str | None:
        """Current phase of node n as the directory knows it."""
        return self.node_phase[n] or self.placed_phase[n]

    @property
    def counted_copies(self) -> list[list[int]]:
        """``[node][tier]``: present copies whose count is > 0 (README invariant 4): the kept
        figures with ``keep_counted_copies``, else counted now.

        Observability only (the ``copies.<tier>.positive_count`` gauges): no decision reads it,
        so it is counted when asked, O(Σ|R[n]|) C-level work (each counted block's run in the
        index, its presence bits tallied: ~0.1 µs per counted block, a few distinct values) +
        O(distinct presence values) Python steps, rather than kept on every store, eviction
        and 0↔1 crossing. Kept, it cost a pass over every block stored in GPU memory (4.3 M per
        600 s of the evolving simulation at 64-token blocks) and a walk of the index per Count.
        (Tallied by presence, not by run id: ids of runs are addresses, multiples of 16, whose
        hashes collide in a dict's low bits; tallying ids took ~0.8 µs per block.)"""
        if self.keep_counted_copies:
            return self._cc
        return self._count_copies()

    def _count_copies(self) -> list[list[int]]:
        """:attr:`counted_copies` counted from R and the index."""
        return [list(self._present(n, R)) for n, R in enumerate(self.R)]

    def _present(self, n: int, blocks: Iterable[int]) -> tuple[int, int]:
        """How many of ``blocks`` are present on node n: ``(in its GPU, in its host memory)``.
        O(blocks) C-level (each block's run in the index, its presence bits read and sorted) +
        O(distinct presence values) Python steps (each value's share of the sorted list found
        by bisection). Sorted, not tallied in a ``Counter``: a tally hashes, looks up and
        re-stores a count per block, while the list, whose values come in long stretches of
        equal ones (a path's blocks share runs), sorts with about one comparison of one-digit
        ints per block."""
        gb, hb = tier_bit(n, GPU), tier_bit(n, HOST)
        pcs = list(map(_PC, filter(None, map(self.index.where.get, blocks))))
        pcs.sort()
        g = h = 0
        i, L = 0, len(pcs)
        while i < L:
            pc = pcs[i]
            j = bisect_right(pcs, pc, i)
            if pc & gb:
                g += j - i
            if pc & hb:
                h += j - i
            i = j
        return g, h

    # ------------------------------------------------------------------ #
    # Count / Release (Alg. E.2 lines 1-4)
    # ------------------------------------------------------------------ #
    #
    # C_{β,n} is always a prefix of π_β (stored as its length k_{β,n}): a placement counts π_new,
    # a version bump cuts every C_{β,m} to π_old ∩ π_new, which for chained hashes (a hash names
    # its whole prefix) is the common prefix, and an extension keeps old prefixes prefixes. So a
    # Count is one path slice: added π[k_old:k_new] or removed π[k_new:k_old], in path order,
    # with no per-placement set of the path and no set difference.

    def _set_k(self, b: Branch, n: int, k: int) -> None:
        """Make branch b count exactly ``b.path[:k]`` on node n (its count there is a prefix of
        ``b.path``). O(changed blocks) C-level dict work (+ O(index runs crossing 0) with
        ``keep_counted_copies``); with :attr:`chained` O(runs of the slice) (:meth:`_count_runs`)."""
        cur = b.counted.get(n, 0)
        if self.chained:  # the runs the slice spans, not its blocks
            if k > cur:
                self._count_runs(n, b.path, cur, k, 1)
            elif k < cur:
                self._count_runs(n, b.path, k, cur, -1)
            else:
                return
        elif k > cur:
            self._count_up(n, b.path[cur:k])
        elif k < cur:
            self._count_down(n, b.path[k:cur])
        else:
            return
        if k:
            b.counted[n] = k
            if not cur:
                self.node_branches[n][b.bid] = None
        else:
            del b.counted[n]
            self.node_branches[n].pop(b.bid, None)

    def _count_runs(self, n: int, path: list[int], a: int, k: int, step: int) -> None:
        """:meth:`_count_up` (``step`` +1) or :meth:`_count_down` (-1) of the slice ``path[a:k]``
        with :attr:`chained`, in :attr:`runs`: O(runs the slice spans) Python steps (~11 per
        count-up and ~17 per release in the 600-s ``evolving`` simulation at 64-token blocks,
        whose Counts name ~950 and ~1,700 blocks), plus the outbox's lists (a slice copy and the
        counts after, one list repeat per stretch of equal counts after). The same counts, outbox entries and counters as
        the per-block methods (``tests/unit/kvdirectory/test_count_runs.py``)."""
        after, crossed, refused = self.runs.count(n, path, a, k, step)
        if refused:
            keep = [True] * (k - a)
            for i, j in zip(refused[::2], refused[1::2]):
                keep[i - a : j - a] = [False] * (j - i)
            self.counters["count.negative_prevented"] += keep.count(False)
            if not after:
                return
            blocks = list(compress(path[a:k], keep))
        else:
            blocks = path[a:k]
            if self.chain_depths:
                self.out_depth[n][id(blocks)] = (blocks, a)
        if self.keep_counted_copies and crossed:
            self._crossed(n, chain.from_iterable(path[i:j] for i, j in zip(crossed[::2], crossed[1::2])), step)
        out = self.outbox[n]
        if not out:
            self.out_nodes.append(n)
        out.append((blocks, step, after))
        self.out_len[n] += len(blocks)

    def _count_up(self, n: int, blocks: list[int]) -> None:
        """One more branch counts ``blocks`` (a path slice, parent first) on node n.

        Along a path counts never grow with depth (a prefix that holds a block holds its
        parent), so the blocks that cross 0 are a tail of the slice: found by bisection, counted
        by ``_count_elements`` (the C loop behind ``Counter.update``: +1 per block, one hash and
        two probes each, no call per block) and verified by how much R grew: all of the tail
        new and distinct (the usual: the whole slice), else the +1s are taken back and the
        general path reads every count. So R and the outbox's counts after the change are
        written without reading every count first. (It replaced an ``isdisjoint`` pass then an
        update from a zip: ~250 instructions less per block, cachegrind.)"""
        R = self.R[n]
        L = len(blocks)
        if not R.get(blocks[-1]):  # some cross 0: find the first by bisection, then verify the shape
            lo, hi = 0, L - 1
            while lo < hi:
                mid = (lo + hi) >> 1
                if R.get(blocks[mid]):
                    lo = mid + 1
                else:
                    hi = mid
            if not lo:  # the usual move: none counted on n yet
                n0 = len(R)
                _count_elements(R, blocks)
                if len(R) - n0 == L:  # verified: every block was new (and none repeats)
                    new = [1] * L
                    if self.keep_counted_copies:
                        self._crossed_path(n, blocks, 1)
                    out = self.outbox[n]
                    if not out:
                        self.out_nodes.append(n)
                    out.append((blocks, 1, new))
                    self.out_len[n] += L
                    return
                _uncount(R, blocks)
            else:
                head = _values_or_none(R, blocks[:lo])
                if head is not None:  # counted head, new tail?
                    tail = blocks[lo:]
                    n0 = len(R)
                    _count_elements(R, tail)
                    if len(R) - n0 == L - lo:  # verified: the tail's blocks were new (and none repeats)
                        new = list(map(_add, head, _REPEAT1))
                        R.update(zip(blocks, new))  # the head's (zip stops at lo)
                        new += [1] * (L - lo)
                        if self.keep_counted_copies:
                            self._crossed_path(n, tail, 1)
                        out = self.outbox[n]
                        if not out:
                            self.out_nodes.append(n)
                        out.append((blocks, 1, new))
                        self.out_len[n] += L
                        return
                    _uncount(R, tail)
        old = list(map(R.get, blocks, _REPEAT0))  # any shape (a tampered R, a path repeating a hash)
        new = list(map(_add, old, _REPEAT1))
        R.update(zip(blocks, new))
        if self.keep_counted_copies and 0 in old:
            self._crossed(n, compress(blocks, map(_not, old)), 1)
        out = self.outbox[n]
        if not out:
            self.out_nodes.append(n)
        out.append((blocks, 1, new))
        self.out_len[n] += len(blocks)

    def _count_down(self, n: int, blocks: list[int]) -> None:
        """One branch fewer counts ``blocks`` (a path slice, parent first) on node n; a block
        not counted there is refused (``count.negative_prevented``). The blocks whose count
        drops to 0 are a tail of the slice (see :meth:`_count_up`): found by bisection, popped in
        one pass and verified; any other shape (a tampered R) is counted per block."""
        R = self.R[n]
        L = len(blocks)
        first = R.get(blocks[0])
        if first is not None and R.get(blocks[-1]) == 1:  # counts never grow along the slice: a head above 1, a tail of 1s?
            z = 0
            if first > 1:  # the first 1, by bisection
                hi = L - 1
                while z < hi:
                    mid = (z + hi) >> 1
                    v = R.get(blocks[mid])
                    if v is not None and v > 1:
                        z = mid + 1
                    else:
                        hi = mid
            head = _values_or_none(R, blocks[:z]) if z else []
            if head is not None and 1 not in head:
                tail = blocks[z:] if z else blocks
                popped = list(map(R.pop, tail, _REPEAT_NONE))
                if popped.count(1) == len(popped):  # verified: the usual release (z = 0) or a shared head staying counted
                    if z:
                        new = list(map(_sub, head, _REPEAT1))
                        R.update(zip(blocks, new))
                        new += [0] * (L - z)
                    else:
                        new = [0] * L
                    if self.keep_counted_copies:
                        self._crossed_path(n, tail, -1)
                    out = self.outbox[n]
                    if not out:
                        self.out_nodes.append(n)
                    out.append((blocks, -1, new))
                    self.out_len[n] += L
                    return
                R.update(compress(zip(tail, popped), popped))  # another shape: put back, count per block (compress drops the Nones)
        old = list(map(R.get, blocks, _REPEAT0))
        if 0 in old:  # never counted here: refused, counted
            zeros = old.count(0)
            self.counters["count.negative_prevented"] += zeros
            if zeros == len(old):
                return
            keep = list(map(bool, old))
            blocks = list(compress(blocks, keep))
            old = list(compress(old, keep))
        if 1 in old:
            new = list(map(_sub, old, _REPEAT1))
            R.update(zip(blocks, new))
            gone = list(compress(blocks, map(_not, new)))
            _drain(map(R.pop, gone, _REPEAT_NONE))
            if self.keep_counted_copies:
                self._crossed(n, gone, -1)
        else:
            new = list(map(_sub, old, _REPEAT1))
            R.update(zip(blocks, new))
        out = self.outbox[n]
        if not out:
            self.out_nodes.append(n)
        out.append((blocks, -1, new))
        self.out_len[n] += len(blocks)

    def _crossed_path(self, n: int, blocks: list[int], d: int) -> None:
        """:meth:`_crossed` for a path slice (``keep_counted_copies``): walked run by run of the
        index (one ``where`` probe and one slice comparison per run) while its blocks are
        indexed; the rest, once a block is not, per block (usually a tail stored nowhere yet:
        one C-level probe)."""
        where = self.index.where
        gb, hb = tier_bit(n, GPU), tier_bit(n, HOST)
        g = hs = 0
        i, L = 0, len(blocks)
        while i < L:
            h = blocks[i]
            r = where.get(h)
            if r is None:
                rest = blocks[i:]
                if not where.keys().isdisjoint(rest):
                    self._crossed(n, rest, d)
                break
            keys = r.keys
            m = _match(keys, 0 if keys[0] == h else keys.index(h), blocks, i)
            pc = r.pc
            if pc & gb:
                g += m
            if pc & hb:
                hs += m
            i += m
        cc = self._cc[n]
        cc[GPU] += d * g
        cc[HOST] += d * hs

    def _crossed(self, n: int, blocks: Iterable[int], d: int) -> None:
        """``blocks`` had their count on node n cross 0 (d = +1 up, -1 down; ``keep_counted_copies``):
        present copies with a positive count change by d per tier. O(blocks) C-level + O(distinct
        presence values) Python steps."""
        g, h = self._present(n, blocks)
        cc = self._cc[n]
        cc[GPU] += d * g
        cc[HOST] += d * h

    def _release(self, b: Branch, n: int) -> None:
        self._set_k(b, n, 0)
        self._unwatch(b, n)
        b.pending.pop(n, None)

    # ------------------------------------------------------------------ #
    # same-phase moves: release the source once the target holds v_β
    # ------------------------------------------------------------------ #

    def _unwatch(self, b: Branch, target: int) -> None:
        h = b.watch.pop(target, None)
        if h is not None:
            w = self.watch[target]
            s = w.get(h)
            if s is not None:
                s.pop(b.bid, None)
                if not s:
                    del w[h]

    def _holds_version(self, b: Branch, n: int) -> bool:
        return not b.path or self.index.holds(n, b.path[-1])

    def _finish_move(self, b: Branch, target: int) -> list[int]:
        sources = b.pending.pop(target, set())
        self._unwatch(b, target)
        done = []
        for m in sources:
            if m != target and m in b.counted:
                self._set_k(b, m, 0)
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
                self.watch[t].setdefault(h, {})[b.bid] = None

    def on_stored(self, n: int, tier: int, newly: Sequence[int]) -> None:
        """Presence hook: blocks ``newly`` became present on (n, tier). A list is handed over:
        the outbox may keep it as it is (``BlockIndex.store`` and ``replace`` return new lists).

        A host store re-sends the counts of its counted blocks (:meth:`_resend`: one C-level
        pass, as a placement counts a path before its node stores it, so the stored blocks are
        usually all counted: every one of 3.1 M stored blocks in a 300 s simulation at
        64-token blocks); a GPU store reads no count (the counted copies per tier are counted
        when asked, :attr:`counted_copies`). Then the moves to n that wait for a block:
        O(watched blocks of n)."""
        if not newly:
            return
        R = self.R[n]
        if self.runs.total[n] if self.chained else R:  # (not ``R``: a _NodeCounts' __len__ is a Python call)
            if tier == HOST:  # re-sent, in the store's order: the worker keeps counts only for blocks it holds
                self._resend(n, R, newly, 1)
            elif self.keep_counted_copies:
                self._cc[n][tier] += len(R.keys() & newly)
        if self.watch[n]:
            self._moves_came(n, tier_bit(n, tier), newly)

    def on_stored_through(self, n: int, newly: list[int]) -> None:
        """Presence hook of a GPU store and its host write-through, applied as one
        (``BlockIndex.store_written_through``: ``newly``, a new list handed over as in
        :meth:`on_stored`, became present on both tiers of n).
        Same effects as ``on_stored(n, GPU, newly)`` then ``on_stored(n, HOST, newly[:])``
        (the moves a block of ``newly`` finishes release nodes other than n, so they touch
        neither R[n] nor n's outbox) with one pass over ``newly`` instead of three."""
        if not newly:
            return
        R = self.R[n]
        if self.runs.total[n] if self.chained else R:
            self._resend(n, R, newly, 2)
        if self.watch[n]:
            self._moves_came(n, 1 << (1 + 3 * n + GPU), newly)  # tier_bit(n, GPU), without its frame

    def _resend(self, n: int, R: dict[int, int], newly: Sequence[int], tiers: int) -> None:
        """Blocks ``newly`` became present in n's host memory (and, ``tiers`` = 2, its GPU): queue
        the counts of the counted ones, in the store's order (and count them as present copies
        of the tier(s) with ``keep_counted_copies``). O(len(newly)) C-level: one pass when all are counted (the
        usual: the list ``newly`` itself is queued, not a copy), else a filter and a second pass
        over the counted ones. With :attr:`chained` (``newly`` is a store's chain, or what of it was
        new: R never grows along it) the counted ones are a head, found by bisection, and their
        counts are built stretch by stretch (:func:`_chain_values`): O(distinct counts · log L)
        probes, plus a copy of the head when some are not counted. Handed to :attr:`resend_sink`
        at once where it takes them, or unbuilt to :attr:`resend_chain_sink` where it takes them."""
        cs = self.resend_chain_sink
        if (
            cs is not None and not self.outbox[n] and len(newly) <= self.max_updates_per_msg
            and self.chained and self.chain_depths and not self.keep_counted_copies
        ):
            # what resend_sink would get with chains [(None, len)]: the counted head (two probes
            # when all are counted), no counts built. Chained (R: a _NodeCounts), no counted copies
            hit = newly if type(newly) is list else list(newly)
            L = len(hit)
            j = R.head(hit, 0, L)  # type: ignore[attr-defined]
            if not j:
                return
            if j == L or L >= _CHAIN_MIN:  # with a depth below (a short chain has one only when all are counted)
                if j < L:
                    hit = hit[:j]
                self.out_seq[n] += 1
                cs(n, hit)
                return
        if self.chained and len(newly) >= _CHAIN_MIN:  # the counted blocks are a head, their counts stretches
            hit = newly if type(newly) is list else list(newly)
            j = R.head(hit, 0, len(hit)) if type(R) is _NodeCounts else _counted_head(R, hit, 0, len(hit))
            if not j:
                return
            if j < len(hit):
                hit = hit[:j]
            counts = R.chain_values(hit) if type(R) is _NodeCounts else _chain_values(R, hit)
            depth = self.chain_depths  # the store's chain, or its head: at the store's position, which the worker knows
        else:
            try:
                counts = R.counts_of(newly) if type(R) is _NodeCounts else _values(R, newly)
                hit = newly if type(newly) is list else list(newly)
            except KeyError:  # some are not counted
                hit = list(filter(R.__contains__, newly))
                if not hit:
                    return
                counts = R.counts_of(hit) if type(R) is _NodeCounts else _values(R, hit)
            # all counted: the store's chain (a longer one's is set above)
            depth = self.chain_depths and self.chained and not self.keep_counted_copies and len(hit) == len(newly)
        if self.keep_counted_copies:
            cc = self._cc[n]
            cc[HOST] += len(hit)
            if tiers == 2:
                cc[GPU] += len(hit)
        out = self.outbox[n]
        if not out:
            sink = self.resend_sink
            if sink is not None and len(hit) <= self.max_updates_per_msg:  # delivered now, as its own message
                self.out_seq[n] += 1
                sink(n, hit, counts, [(None, len(hit))] if depth else None)
                return
            self.out_nodes.append(n)
        if depth:
            self.out_depth[n][id(hit)] = (hit, None)
        out.append((hit, None, counts))
        self.out_len[n] += len(hit)

    def chain_counts(self, n: int, hashes: list[int]) -> list[int]:
        """The counts on node n of ``hashes`` (not empty), a chain of blocks counted there, as
        :attr:`resend_chain_sink` gets them (with :attr:`chained`): ``[R[n][h] for h in hashes]``,
        the usual one stretch of equal counts two lookups and a list repeat (O(distinct counts ·
        log len) probes). Raises KeyError when a block read is not counted on n."""
        return self.R[n].chain_values(hashes)

    def _moves_came(self, n: int, bit: int, newly: Sequence[int]) -> None:
        """Finish the moves to n whose watched block is among ``newly``, which just became
        present on n's tier ``bit``: the watched blocks present on that tier are probed first
        (O(watched blocks of n), a few ``where`` probes) and only those are looked up in
        ``newly`` (a C-level scan; a move watches a block only while n holds it in neither tier,
        so for chains each one found is in ``newly``), not a set of all of ``newly``. Several at
        once are taken in the order of the set ``w.keys() & newly`` (a set built in ``newly``'s
        order), as before."""
        w = self.watch[n]
        where = self.index.where
        came: list[int] | None = None  # a loop, not a list comprehension (its own frame, 6,209 per 600 s at 512)
        for h in w:
            r = where.get(h)
            if r is not None and r.pc & bit and h in newly:
                if came is None:
                    came = [h]
                else:
                    came.append(h)
        if came is None:
            return
        if len(came) > 1:
            came = set(sorted(came, key=newly.index))  # type: ignore[assignment]
        for h in came:
            for bid in list(w.get(h, ())):
                b = self.branches.get(bid)
                if b is not None and n in b.pending and b.path and b.path[-1] == h:
                    self._finish_move(b, n)

    def on_removed(
        self, n: int, tier: int, removed: Sequence[int], spans: Sequence[tuple[int, int, bool]] | None = None
    ) -> int:
        """Presence hook: blocks ``removed`` (distinct, as ``BlockIndex.remove`` returns them)
        left (n, tier). ``spans``: the chain stretches of ``removed`` that ``BlockIndex.remove``
        reports; with :attr:`chained` each one's counted blocks are its parent-side end, found
        by bisection (two probes when a stretch is counted wholly or not at all).

        Returns:
            How many of them had a positive count on n (``evictions.<tier>.positive_count``).

        Cost: C-level probes of R[n], no set built: none counted (every host eviction of a 600 s
        evolving simulation at 64-token blocks, ~1/3 of its GPU evictions' blocks) is one
        ``isdisjoint`` pass, all counted (~1/3) stops it at once and is one ``itemgetter`` pass
        (:func:`_holds_all`); the rest (a counted prefix of an evicted chain) is counted by a
        ``sum`` over the probes. The set intersection it replaces inserted every counted block
        into a new set.
        """
        R = self.R[n]
        if not (self.runs.total[n] if self.chained else R) or not removed:
            return 0
        if spans is not None and self.chained:
            pos = 0
            for a, b, down in spans:
                if b - a < _CHAIN_MIN:
                    pos += R.how_many(removed[a:b]) if type(R) is _NodeCounts else sum(map(R.__contains__, removed[a:b]))
                elif down:
                    pos += b - (R.tail(removed, a, b) if type(R) is _NodeCounts else _counted_tail(R, removed, a, b))
                else:
                    pos += (R.head(removed, a, b) if type(R) is _NodeCounts else _counted_head(R, removed, a, b)) - a
            if self.keep_counted_copies:
                self._cc[n][tier] -= pos
            return pos
        if R.keys().isdisjoint(removed):
            return 0
        pos = len(removed) if _holds_all(R, removed) else sum(map(R.__contains__, removed))
        if self.keep_counted_copies:
            self._cc[n][tier] -= pos
        return pos

    # ------------------------------------------------------------------ #
    # branch events
    # ------------------------------------------------------------------ #

    def _touch(self, b: Branch, now: float) -> None:
        if now > b.last_seen:  # max(b.last_seen, now), no builtin call
            b.last_seen = now
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

    def state(self, bid: str, now: float) -> str:
        """The state of ``bid`` for a router that never saw it (``branch.query``): ``active``, ``expired``,
        ``ended`` or ``unknown``. Pure: a branch silent past its TTL (and any hold's TTL) that :meth:`expire` has
        not swept yet reads ``expired``, as the sweep will make it; an ended id is remembered for a TTL after its
        end (at most ``ended_memory`` ids), an expired one while remembered (``ended_memory`` ids); past that
        an id reads ``unknown``. O(1).

        The router relays a ``BranchEnd`` (or a ``BranchToolCall``) for ``active`` and ``expired``: :meth:`end`
        takes both (``branch.ended``, ``branch.ended_after_expiry``), :meth:`hold` resumes an expired one."""
        b = self.branches.get(bid)
        if b is not None:
            lapsed = b.last_seen + self.ttl_s <= now and b.hold_until + self.ttl_s <= now
            return "expired" if lapsed else "active"
        if bid in self.ended:
            return "ended"
        return "expired" if bid in self.expired else "unknown"

    def _drop_branch(self, b: Branch) -> None:
        for m in list(b.counted):
            self._set_k(b, m, 0)
        for t in list(b.watch):
            self._unwatch(b, t)
        b.pending.clear()

    def place(
        self, bid: str, n: int, phase: str, path: list[int], now: float, rid: str | None = None
    ) -> PlaceOutcome:
        """RoutePlaced: Alg. E.1 on the path, then Alg. E.2 placement of β on node n.

        Args:
            phase: ``prefill`` (prefill routing), ``decode`` (decode binding) or ``both``.
            path: the request's full-block path π_new (chained hashes).
            rid: the placed request (``RoutePlaced.rid``), remembered as the branch's latest
                placement for :meth:`evict`; None (the simulator) keeps the one remembered.
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
        if rid is None or rid != b.last_rid:  # the tool returned: the branch made its next request (a late decode
            b.hold_until = 0.0  # placement of the request already placed is no new request: its hold stays)
        if rid is not None:
            b.last_rid = rid
        out = PlaceOutcome(branch=b, prev_prefill_node=b.last_prefill_node)
        # -- Alg. E.1 ------------------------------------------------------
        old = b.path
        lo = len(old)
        # π_old a prefix of π_new? With ``chained`` its last hash at the same place tells (a hash
        # names its whole prefix): one comparison instead of a slice of ~2,000 (64-token blocks)
        if old and (lo > len(path) or (path[lo - 1] != old[-1] if self.chained else path[:lo] != old)):
            b.version += 1
            out.bumped = True
            self.counters["branch.version_bumps"] += 1
            c = _common_prefix(old, path)
            for m, k in list(b.counted.items()):
                if k > c:  # C ∩ π_new = π_old[:min(k, c)]: release the dropped history once per node
                    self._set_k(b, m, c)
            out.history_blocks = c
        else:
            out.history_blocks = len(old)
        if b.requests == 0 and b.parent is not None and b.kind == "fork":
            pb = self.branches.get(b.parent)
            if pb is not None:
                out.history_blocks = max(out.history_blocks, _common_prefix(pb.path, path))
                if out.prev_prefill_node is None:
                    out.prev_prefill_node = pb.last_prefill_node
        b.path = path
        b.requests += 1
        out.version = b.version
        if b.pending and (
            (lo != len(path) or (lo and path[-1] != old[-1])) if self.chained else path != old
        ):
            self._rewatch(b)
        # -- Alg. E.2 placement ---------------------------------------------
        if self.placed_phase[n] != phase:
            self.placed_phase[n] = phase
        self._set_k(b, n, len(path))
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
                self.watch[n].setdefault(h, {})[b.bid] = None
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
            self._forget_expired(b)
            gone.append(bid)
        if gone:
            self.counters["branch.expired"] += len(gone)
        while self.ended:
            bid, t = next(iter(self.ended.items()))
            if t + self.ttl_s > now:
                break
            del self.ended[bid]
        return gone

    def _forget_expired(self, b: Branch) -> None:
        """``b``, just removed from :attr:`branches`, is expired: its counts released on every node,
        its kind / parent / agent remembered (``ended_memory`` ids) for a resume."""
        self._drop_branch(b)
        self.expired[b.bid] = (b.kind, b.parent, b.agent)
        self.expired.move_to_end(b.bid)
        while len(self.expired) > self.ended_memory:
            self.expired.popitem(last=False)

    def evict(self, bid: str, rid: str | None = None) -> str:
        """A router forgot ``bid`` to keep its branch table under its cap (``BranchEnd`` with
        ``expired=True``; the router's ``--max-active-branches``): the branch is expired now, as a
        TTL expiry does (counts released on every node, resumable: its next start or placement is a
        resume), counted in ``branch.evicted``. It takes no time: the expiry path reads none.

        Args:
            rid: the evicting router's latest placed request of the branch (``""``: it placed none).
                When it is not the directory's latest placement (:attr:`Branch.last_rid`, ``""`` for
                none) another router placed the branch since, and may have its request in flight:
                the eviction is ignored (``branch.stale_evict``). None: no check (older senders).

        Returns:
            ``evicted``; ``stale`` (another router placed it since: nothing done); ``ended`` (it
            was ended: nothing to do); ``unknown`` (not active: already expired here, or never
            started; nothing to do).
        """
        b = self.branches.get(bid)
        if b is None:
            if bid in self.ended:
                return "ended"
            self.counters["branch.unknown_evict"] += 1
            return "unknown"
        if rid is not None and rid != (b.last_rid or ""):
            self.counters["branch.stale_evict"] += 1
            return "stale"
        del self.branches[bid]
        self._forget_expired(b)
        self.counters["branch.evicted"] += 1
        return "evicted"

    def check(self) -> None:
        """Invariants (O(Σ counted blocks); for tests): every ``C_{β,n}`` is a prefix
        ``π_β[:k]`` with 0 < k ≤ |π_β|, N_β and ``node_branches`` agree, ``R[n][b]`` is exactly
        the number of active branches whose prefix on n holds b (README invariant 3, no zero
        entries), counts never grow along a counted prefix (a prefix that holds a block holds
        its parent: the blocks crossing 0 in a Count are a tail of its slice),
        and the per-node move watches match the branches' own.

        Raises:
            AssertionError: naming the first one that fails.
        """
        want: list[Counter[int]] = [Counter() for _ in self.R]
        on: list[set[str]] = [set() for _ in self.R]
        for b in self.branches.values():
            for n, k in b.counted.items():
                assert 0 < k <= len(b.path), f"branch {b.bid}: k={k} on node {n}, |π|={len(b.path)}"
                want[n].update(set(b.path[:k]))
                on[n].add(b.bid)
        for n, R in enumerate(self.R):
            assert on[n] == self.node_branches[n].keys(), f"node_branches[{n}]"
            assert R == dict(want[n]), f"R[{n}] differs from the branch table"
            for b in self.branches.values():
                k = b.counted.get(n, 0)
                c = list(map(R.__getitem__, b.path[:k]))
                assert all(map(_ge, c, c[1:])), f"counts grow along branch {b.bid}'s prefix on node {n}"
        if self.chained:
            self.runs.check()
        if self.keep_counted_copies:
            assert self._cc == self._count_copies(), f"counted_copies {self._cc} != {self._count_copies()}"
        assert self.out_len == [sum(len(o[0]) for o in out) for out in self.outbox], "out_len"
        assert sorted(self.out_nodes) == [n for n, out in enumerate(self.outbox) if out], "out_nodes"
        watched = {(t, h, b.bid) for b in self.branches.values() for t, h in b.watch.items()}
        listed = {(t, h, bid) for t, w in enumerate(self.watch) for h, s in w.items() for bid in s}
        assert watched == listed and all(all(w.values()) for w in self.watch), "watch out of sync"

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
        """Count changes not yet taken, over all nodes (a block changed twice counts twice). O(nodes)."""
        return sum(self.out_len)

    def drop_count_updates(self) -> int:
        """Empty the outbox without building messages, for a caller whose engines ignore counts
        (the simulator under ``lru`` eviction); message sequence numbers do not advance, as no
        message is made. Returns the changes dropped (as :meth:`pending_updates`). O(nodes)."""
        dropped = sum(self.out_len)
        for n in self.out_nodes:
            self.outbox[n].clear()
            self.out_depth[n].clear()
            self.out_len[n] = 0
        self.out_nodes.clear()
        return dropped

    def take_count_updates(self) -> list[CountUpdates]:
        """Drain the outbox: per node, the new count of every block whose count changed since
        the last drain, in the order of the changes (each change's blocks parent first; a block
        changed twice where it first changed); a change undone before the drain is not sent.
        A node's updates are cut into messages of at most ``max_updates_per_msg``.

        With ``held_counts_only``, the changes of a Count (a path slice) leave out its longest
        tail of blocks that the index shows the node holding in neither tier now
        (:meth:`_held_cut`), as long as the index has refused no block for its cap
        (``cap.rejected_blocks``); a host store's re-sent counts are sent whole. What a worker
        does with the rest is unchanged: it keeps a count only as its L2 pages' eviction group,
        reads it only while the page is in L2, and clears it when the page enters L2 (a page
        stored counts 0), so a count for a page it does not hold is never read; the directory
        re-sends the count of every counted block a host store brings (:meth:`on_stored`,
        :meth:`_resend`), so the page gets its count when it arrives. Exact only when every
        store the node made before the drain is applied first (else a page stored but not yet
        seen here would miss a count it may read before its re-send): the simulator applies a
        node's KV events right after the engine call that made them and before any drain
        (``ClusterSim._flush_kv``; a count drained before a store event then reaches the worker
        as that store's re-send). A removal not yet applied only keeps an entry the worker
        ignores, as without the option. A drain left shorter may be cut into messages of
        ``max_updates_per_msg`` at other places: the worker's eviction order does not depend on
        the cut (``tests/unit/worker/test_count_message_cut.py``; only the numbers of its access
        stamps may differ, and only their order is ever compared). In the 300-s ``evolving``
        simulation 24% of the entries at 64-token blocks (1.05M of 4.38M) and 22% at 512 name
        such blocks (mostly a move's path counted up before the target computes it or fetches
        it); reports identical, instructions 64: -2.9%, 512: -0.25% (kvdirectory README).

        One change that fits one message (the usual): its own lists are the message's (every
        list in the outbox is made for it alone), O(1) (with ``held_counts_only``, O(log L +
        index runs of the cut tail) probes; a cut tail is deleted from those lists in place);
        changes touching distinct blocks (a move's count and a release elsewhere): O(listed
        blocks) list copies; else O(listed blocks) C-level dict work to merge them."""
        names = self.node_names
        return [CountUpdates(node=names[n], seq=seq, hashes=h, counts=c) for n, seq, h, c in self.take_count_lists()]

    def take_count_lists(self, chains: bool = False) -> list[Any]:
        """:meth:`take_count_updates` as ``(node index, seq, hashes, counts)`` per message, the
        message objects not built: the same drain (outbox emptied, ``out_seq`` advanced per
        message), for an in-process caller that hands each node's lists to its engine (the
        simulator, ``ClusterSim._flush_counts``). O(1) per message more than the drain.

        ``chains`` (with :attr:`chain_depths`): each message gets a fifth item, the message as
        chains ``[(path position of the first block, length), ...]`` covering ``hashes`` in order
        (each a path slice or a host store's counted blocks, parent first; position None for the
        latter: the store's, known to the worker, or a cut's tail of it: :func:`_cut_chains`; a
        message of merged changes to the same blocks: :func:`_merged_chains`), or None where a change
        has no position kept. O(changes) more per message (O(entries) for a merged one)."""
        nodes = self.out_nodes
        if not nodes:
            return []
        if len(nodes) > 1:
            nodes.sort()  # node order, as every node's outbox was once visited in turn
        msgs: list[Any] = []
        cap = self.max_updates_per_msg
        outbox = self.outbox
        held = self.held_counts_only and not self.index.counters["cap.rejected_blocks"]
        for n in nodes:
            box = outbox[n]
            if len(box) == 1:  # one change (the usual): every block listed once, each count changed
                # _held_changes and _chains of one change, inline: its own lists are the message's
                # (new lists the outbox held alone), or their head n holds (a Count cut by _held_cut)
                hashes, step, counts = box[0]
                box.clear()
                self.out_len[n] = 0
                deps = self.out_depth[n]
                ch = None
                if chains:
                    d = deps.get(id(hashes))
                    if d is not None and d[0] is hashes:
                        ch = [(d[1], len(hashes))]
                if held and step is not None:
                    k = self._held_cut(n, hashes)
                    if k < len(hashes):
                        if not k:  # the node holds none of its blocks
                            deps.clear()
                            continue
                        # the outbox's own lists (made for this change alone): cut in place,
                        # not copied (a copy of the head and a free of the whole list)
                        del hashes[k:]
                        del counts[k:]
                        if ch is not None:
                            ch = [(ch[0][0], k)]
                deps.clear()
            else:
                out = self._held_changes(n, box) if held else box
                if held and not out:  # the node holds none of their blocks
                    box.clear()
                    self.out_depth[n].clear()
                    self.out_len[n] = 0
                    continue
                ch = self._chains(n, out) if chains else None
                hashes = list(chain.from_iterable([o[0] for o in out]))
                first = dict.fromkeys(hashes)
                if len(first) == len(hashes):  # distinct blocks: each changed once
                    counts = list(chain.from_iterable([o[2] for o in out]))
                else:
                    before: dict[int, int] = {}
                    for blocks, step, after in reversed(out):  # the count before the first change wins
                        before.update(zip(blocks, _REPEAT_M1 if step is None else map(_sub, after, repeat(step))))
                    hashes = list(first)
                    now = list(map(self.R[n].get, hashes, _REPEAT0))
                    changed = list(map(_ne, now, map(before.__getitem__, hashes)))  # an undone change is not sent
                    if False in changed:
                        hashes = list(compress(hashes, changed))
                        now = list(compress(now, changed))
                    counts = now
                    if ch is not None:
                        ch = _merged_chains(out, ch, hashes)
                box.clear()
                self.out_depth[n].clear()
                self.out_len[n] = 0
            if len(hashes) <= cap:  # one message: the lists themselves (new lists the outbox held alone)
                self.out_seq[n] = seq = self.out_seq[n] + 1
                msgs.append((n, seq, hashes, counts, ch) if chains else (n, seq, hashes, counts))
                continue
            for i in range(0, len(hashes), cap):
                self.out_seq[n] = seq = self.out_seq[n] + 1
                if chains:
                    msgs.append((n, seq, hashes[i : i + cap], counts[i : i + cap], _cut_chains(ch, i, i + cap)))
                else:
                    msgs.append((n, seq, hashes[i : i + cap], counts[i : i + cap]))
        nodes.clear()
        return msgs

    def _chains(self, n: int, out: list[tuple[list[int], int | None, list[int]]]) -> list[tuple[int | None, int]] | None:
        """The changes ``out`` of node n as ``[(path position of the first block, length), ...]``
        (:attr:`out_depth`), or None if one has no depth kept; empties n's :attr:`out_depth`."""
        deps = self.out_depth[n]
        ch: list[tuple[int | None, int]] | None = []
        for blocks, _step, _after in out:
            d = deps.get(id(blocks))
            if d is None or d[0] is not blocks:
                ch = None
                break
            ch.append((d[1], len(blocks)))  # type: ignore[union-attr]
        deps.clear()
        return ch

    def _held_changes(
        self, n: int, out: list[tuple[list[int], int | None, list[int]]]
    ) -> list[tuple[list[int], int | None, list[int]]]:
        """Node n's outbox ``out`` less the entries :meth:`take_count_updates` leaves out with
        ``held_counts_only``: each Count (a path slice) cut by :meth:`_held_cut`, a change cut
        to nothing dropped; re-sends (step None) whole. ``out`` itself when nothing is cut."""
        kept: list[tuple[list[int], int | None, list[int]]] | None = None
        for i, c in enumerate(out):
            blocks, step, after = c
            k = len(blocks) if step is None else self._held_cut(n, blocks)
            if k == len(blocks):
                if kept is not None:
                    kept.append(c)
                continue
            if kept is None:
                kept = out[:i]
            if k:
                cut = blocks[:k]
                if self.chain_depths:
                    d = self.out_depth[n].get(id(blocks))
                    if d is not None and d[0] is blocks:
                        self.out_depth[n][id(cut)] = (cut, d[1])
                kept.append((cut, step, after[:k]))
        return out if kept is None else kept

    def _held_cut(self, n: int, blocks: list[int]) -> int:
        """How many leading blocks of a Count's path slice ``blocks`` (parent first) to send
        to node n: ``j`` when the tail ``blocks[j:]`` holds no block present on n in either tier
        (index presence bits), else ``len(blocks)`` (nothing left out).

        ``j`` is where the slice leaves n's complete prefix (index completeness, monotone along
        a chain: found by bisection, ~log2 L probes); every block before it is held, and the
        tail is verified run by run (one ``where`` probe and one slice comparison per index
        run, at most :data:`_CUT_RUNS` runs) up to its end or its first block not indexed: no
        block below that one is indexed either, as the index keeps the recorded parent of every
        indexed block indexed (``BlockIndex.check``), and that parent is the path's block before
        it while :meth:`_rooted` holds (a hash names its whole prefix: paths are chains, see the
        module docstring); otherwise one C-level ``isdisjoint`` pass over the rest tells, and
        the walk goes on from the first block of the rest that is indexed, if any. A held block
        past ``j`` (a node whose held blocks are not closed under parents: a peer fetch stored
        below a page the node lost) or a longer walk sends the slice whole: leaving out only
        blocks shown absent is what keeps the worker's state exact. In the 300-s ``evolving``
        simulation (64- and 512-token blocks) the held blocks of every slice were a prefix of
        it and a cut tail spanned ~1 index run, its first block not indexed in 57% of the cuts."""
        get = self.index.where.get
        lb = local_bit(n)
        L = len(blocks)
        r = get(blocks[-1])
        if r is not None and -r[0] & lb:  # the whole slice lies in n's complete prefix
            return L
        lo = 0
        r = get(blocks[0])
        if r is not None and -r[0] & lb:  # the first block outside it, by bisection
            lo, hi = 1, L - 1
            while lo < hi:
                mid = (lo + hi) >> 1
                r = get(blocks[mid])
                if r is not None and -r[0] & lb:
                    lo = mid + 1
                else:
                    hi = mid
        i = lo
        for _ in range(_CUT_RUNS):
            h = blocks[i]
            r = get(h)
            if r is None:  # not indexed: nor is any block below it, unless the index has unrooted runs
                if i + 1 == L or self._rooted():
                    return lo
                rest = blocks[i + 1 :]
                if self.index.where.keys().isdisjoint(rest):
                    return lo
                i += 1 + next(compress(count(), map(self.index.where.__contains__, rest)))  # the walk goes on there
                continue
            if r.pc & lb:
                return L
            keys = r.keys
            i += _match(keys, 0 if keys[0] == h else keys.index(h), blocks, i)
            if i >= L:
                return lo
        return L

    def _rooted(self) -> bool:
        """Every indexed block's recorded parent is indexed and is the block its chain names
        before it: no block was stored below a parent the index lacked (it then hangs from a
        placeholder, whose own parent is unknown), none with a parent other than the one first
        reported, and no snapshot was applied (its blocks may come without parents). Counters
        read (dict probes; ``kv.resyncs`` is the directory's)."""
        ic = self.index.counters
        return not (ic["stored.without_parent"] or ic["stored.parent_conflict"] or self.counters.get("kv.resyncs"))


def _merged_chains(
    out: list[tuple[list[int], int | None, list[int]]], ch: list[tuple[int | None, int]], hashes: list[int]
) -> list[tuple[int | None, int]]:
    """The chains of a merged message (:meth:`BranchTable.take_count_lists`: changes ``out`` naming
    some blocks twice, their chains ``ch``; ``hashes``, each block once at its first place, less
    the undone changes): a chain per stretch of entries that are consecutive blocks of one change,
    at its path position (a store's chain: None, the store's, for its head, and None for the rest,
    which the worker finds by its last pages). O(entries), one Python step each; in a 600-s
    evolving run at 64-token blocks, 17 of 13,545 messages (35K entries): without chains the worker
    walked every L1 and queued page for each."""
    place: dict[int, tuple[int, int]] = {}
    for c in range(len(out) - 1, -1, -1):  # the first change naming a block wins
        blocks = out[c][0]
        place.update(zip(blocks, zip(repeat(c), count())))
    chains: list[tuple[int | None, int]] = []
    c0 = o0 = k = -1
    for c, o in map(place.__getitem__, hashes):
        if c == c0 and o == o0 + k:
            k += 1
            continue
        if k > 0:
            d = ch[c0][0]
            chains.append((None if d is None else d + o0, k))
        c0, o0, k = c, o, 1
    if k > 0:
        d = ch[c0][0]
        chains.append((None if d is None else d + o0, k))
    return chains


def _cut_chains(ch: list[tuple[int | None, int]] | None, lo: int, hi: int) -> list[tuple[int | None, int]] | None:
    """Chains ``ch`` (``(first block's path position, length)`` end to end) cut to the message
    entries ``[lo, hi)``: the chains of that piece of the message; None if ``ch`` is None. A store's
    chain (position None) that loses its head to the cut stays a chain of position None: its
    position is nobody's to give (the worker knows a store by its first block), but its blocks are
    still consecutive pages of one sequence, which the worker finds in its L1 by their last pages
    (``BranchRunHostPool._chain_l1``); a whole message without chains cost it a walk of every L1
    page (in a 300-s evolving run at 64-token blocks, 39 of the 47 messages without chains)."""
    if ch is None:
        return None
    out: list[tuple[int | None, int]] = []
    i = 0
    for d, k in ch:
        a = max(i, lo)
        b = min(i + k, hi)
        if a < b:
            out.append((None if d is None else d + a - i, b - a))
        i += k
    return out


_CUT_RUNS = 32
"""Index runs :meth:`BranchTable._held_cut` walks to verify a tail it leaves out before it gives
up and sends the slice whole (a cut tail spans ~1 run in the ``evolving`` simulation)."""


def _values(R: dict[int, int], keys: Sequence[int]) -> list[int]:
    """``[R[k] for k in keys]`` (``keys`` not empty), KeyError when one is missing: one
    ``itemgetter`` call, whose C loop indexes R directly (~95 instructions per key less than
    ``list(map(R.__getitem__, keys))``, which calls a method per key; cachegrind)."""
    if len(keys) == 1:
        return [R[keys[0]]]
    return list(itemgetter(*keys)(R))


_CHAIN_MIN = 8
"""Chains shorter than this are probed block by block even with ``chained`` (a bisection's Python
steps cost more than a few C-level probes)."""


def _counted_head(R: Mapping[int, object], seq: Sequence[int], lo: int, hi: int) -> int:
    """``seq[lo:hi]`` (not empty), whose counted blocks are a head (R never grows along it):
    the end of that head, ``lo`` (none counted) … ``hi`` (all). Two probes when all or none
    are counted, else a bisection."""
    if seq[hi - 1] in R:
        return hi
    if seq[lo] not in R:
        return lo
    lo += 1  # seq[lo - 1] counted, seq[hi - 1] not
    hi -= 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if seq[mid] in R:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _counted_tail(R: dict[int, int], seq: Sequence[int], lo: int, hi: int) -> int:
    """``seq[lo:hi]`` (not empty) listed deepest first, so its counted blocks are a tail: where
    that tail starts, ``lo`` (all counted) … ``hi`` (none)."""
    if seq[lo] in R:
        return lo
    if seq[hi - 1] not in R:
        return hi
    lo += 1  # seq[lo - 1] not counted, seq[hi - 1] counted
    hi -= 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if seq[mid] in R:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _chain_values(R: Mapping[int, int], seq: list[int]) -> list[int]:
    """``[R[k] for k in seq]`` for a chain ``seq`` (not empty) of counted blocks whose counts
    never grow along it: built stretch by stretch of equal counts, each stretch's end found by
    bisection, O(distinct counts · log L) probes and a C-level list repeat per stretch (the
    usual: one stretch, two probes)."""
    L = len(seq)
    last = R[seq[-1]]
    v = R[seq[0]]
    if v == last:
        return [v] * L
    out: list[int] = []
    i = 0
    while True:
        lo, hi = i + 1, L - 1  # R[seq[i]] == v > last == R[seq[L - 1]]: the first j > i with R[seq[j]] < v
        while lo < hi:
            mid = (lo + hi) >> 1
            if R[seq[mid]] < v:
                hi = mid
            else:
                lo = mid + 1
        out += [v] * (lo - i)
        i = lo
        v = R[seq[i]]
        if v == last:
            out += [v] * (L - i)
            return out


def _values_or_none(R: dict[int, int], keys: Sequence[int]) -> list[int] | None:
    """:func:`_values`, or None when a key is missing."""
    try:
        return _values(R, keys)
    except KeyError:
        return None


def _holds_all(R: dict[int, int], keys: Sequence[int]) -> bool:
    """Every one of ``keys`` (not empty) is in R: one ``itemgetter`` call, stopped by the first
    missing key (~90 instructions per key less than ``all(map(R.__contains__, keys))``,
    cachegrind)."""
    try:
        itemgetter(*keys)(R)
    except KeyError:
        return False
    return True


def _uncount(R: dict[int, int], blocks: list[int]) -> None:
    """Take back ``_count_elements(R, blocks)``: -1 per occurrence, an entry that reaches 0
    removed (R holds no zero counts, so it was not there before). Python steps per block: only
    when a Count's slice is not the usual shape (a tampered R, a path repeating a hash)."""
    for h in blocks:
        v = R[h] - 1
        if v:
            R[h] = v
        else:
            del R[h]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two block paths: one C-level comparison when one
    is a prefix of the other, else a bisection comparing only the half in question each step
    (``index._match``: O(length) element comparisons in all, not O(length · log length) in
    slice copies of whole prefixes; a version bump's paths are ~2,000 blocks at 64 tokens)."""
    if not a or not b or a[0] != b[0]:
        return 0
    return _match(a, 0, b, 0)


class _CRun:
    """A run of the counted-block forest (:class:`_CountRuns`): consecutive blocks of one chain
    (``keys``, parent first; ``keys[0]`` at path position ``depth``) with the same count on every
    node (``cnt``: node index → count > 0; empty while a new run is being counted, and once its
    blocks are counted nowhere: a run left in ``where``)."""

    __slots__ = ("keys", "depth", "cnt")

    def __init__(self, keys: list[int], depth: int, cnt: dict[int, int]) -> None:
        self.keys = keys
        self.depth = depth
        self.cnt = cnt


class _CountRuns:
    """R[n][b] for every node at once, in runs (``BranchTable`` with ``chained``; issue 23).

    Every block counted on some node is in exactly one run (``where``: block → run); a run's
    blocks have equal counts on every node, so a Count of a path slice on a node (+1 or -1 per
    block) walks the runs the slice spans and changes one count per run, cutting a run in two
    only where the slice starts or ends inside it or the path leaves it, and joining two runs it
    walks in a row once their counts are equal (:meth:`join`). A move (a count-up on the new node, a
    count-down on the old) then costs O(runs of the path) Python steps, not a dict update per
    block per node; a block enters ``where`` once, when first counted anywhere, and stays there:
    a run whose blocks a Count leaves counted nowhere keeps them (its counts empty, out of
    ``runs``), and a later count-up walks it as any run. Popping them cost ~300 instructions a
    block (44 K a 600-s ``evolving`` simulation at 512-token blocks, 0.35 M at 64) and almost
    none comes back (47 of 74 K at 512); what stays is a dict entry per block ever counted (the
    simulator's ``SeenIds`` keeps every block ever sent). Relies on chained paths (a hash names its whole prefix, so a block's path
    position is the same in every path naming it, and the blocks counted anywhere are closed
    under parents): a run found where a path does not continue it raises ValueError, with no
    count changed (:meth:`_take_back`).

    ``total[n]``: blocks counted > 0 on node n (``len(R[n])``), kept per run crossing 0;
    ``runs``: every run counted on some node, in the order listed (a node's counted blocks are
    listed run by run; a run counted nowhere is dropped from it and listed again, at the end,
    when counted again).
    """

    __slots__ = ("where", "total", "runs")

    def __init__(self) -> None:
        self.where: dict[int, _CRun] = {}
        self.total: list[int] = []
        self.runs: dict[_CRun, None] = {}

    def split(self, r: _CRun, o: int) -> tuple[_CRun, _CRun]:
        """Cut run ``r`` before its offset ``o`` (0 < o < len): ``(head, tail)``, both with r's
        counts; the smaller part is the new run, its blocks re-pointed in ``where`` (C-level)."""
        keys = r.keys
        if o <= len(keys) - o:
            head = _CRun(keys[:o], r.depth, r.cnt.copy())
            if r.cnt:  # (a run counted nowhere is not listed, nor are its parts)
                self.runs[head] = None
            self.where.update(zip(head.keys, repeat(head)))
            del keys[:o]
            r.depth += o
            return head, r
        tail = _CRun(keys[o:], r.depth + o, r.cnt.copy())
        if r.cnt:
            self.runs[tail] = None
        self.where.update(zip(tail.keys, repeat(tail)))
        del keys[o:]
        return r, tail

    def join(self, up: _CRun, down: _CRun) -> _CRun:
        """One run of ``up`` and ``down`` (``down`` continues ``up`` on a path, their counts equal:
        no other counted run hangs below ``up``'s end, as its counts would add to ``up``'s): the
        smaller one's blocks re-pointed (C-level), so a path counted alike by the same branches
        is walked as few runs (each request's new blocks enter as a run of their own). Returns
        the run kept."""
        where = self.where
        if len(up.keys) >= len(down.keys):
            up.keys += down.keys
            where.update(zip(down.keys, repeat(up)))
            del self.runs[down]
            return up
        down.keys[:0] = up.keys
        down.depth = up.depth
        where.update(zip(up.keys, repeat(down)))
        del self.runs[up]
        return down

    def count(self, n: int, path: list[int], a: int, k: int, step: int) -> tuple[list[int], list[int], list[int]]:
        """Add ``step`` (+1 or -1) to node n's count of every block of ``path[a:k]`` (a < k): one
        count change per run walked, a run cut where the slice starts, ends or leaves it, two
        runs walked in a row joined once their counts are equal. O(runs) Python steps + O(blocks
        counted nowhere before, or re-pointed by a cut or a join) C-level, and ``after`` built
        with one list repeat per stretch of equal counts after (not one per run).

        Returns:
            ``(after, crossed, refused)``: the counts after, one per block that changed (all of
            the slice unless some were refused), and the path positions ``[i, j, ...]`` of the
            stretches ``path[i:j]`` whose count crossed 0, and of those a -1 found uncounted on
            n (left unchanged and out of ``after``: ``count.negative_prevented``).

        Raises:
            ValueError: a run found does not follow the path (the paths are not chains); the
                counts it changed before are taken back first (:meth:`_take_back`), so none
                of the slice has changed. Also (a count-up, before any change) when the
                slice's tail never counted names a block counted elsewhere.
        """
        where = self.where
        get = where.get
        total = self.total
        fresh: _CRun | None = None
        if step > 0:  # the slice's tail never counted (what was ever counted is closed under parents: two probes, else
            # a bisection) becomes one new run with no count yet, listed in runs once counted below
            j = _counted_head(where, path, a, k)
            if j < k:
                keys = path[j:k]
                if not where.keys().isdisjoint(keys):
                    raise ValueError(f"path position {j} on names blocks counted elsewhere in a path: paths are not chains")
                fresh = _CRun(keys, j, {})
                where.update(zip(keys, repeat(fresh)))
        after: list[int] = []
        crossed: list[int] = []
        refused: list[int] = []
        prev: _CRun | None = None  # the run just before, on the path, if this walk left it counted
        pc: dict[int, int] | None = None  # prev's counts (None with prev: never equal to a run's)
        # ``after`` is written a stretch of equal counts at a time (path[s:i], each ``av``), not a
        # run at a time: runs walked in a row often differ only on other nodes (a count-up from 0
        # at 512-token blocks walks ~11 runs in ~6 stretches), and each ``after += [v] * L`` costs
        # a list built, an extension (a reallocation) and its free: ~1,400 instructions beyond
        # the entries themselves
        av = -1  # (-1: no stretch open; counts after are >= 0)
        s = i = a
        while i < k:
            h = path[i]
            r = get(h)
            if r is None:  # a -1 on a block counted nowhere (an inconsistent caller): refused
                if i > s:
                    after += [av] * (i - s)
                refused += (i, i + 1)
                prev = pc = None
                i += 1
                s = i
                continue
            keys = r.keys
            L = len(keys)
            e = i + L
            if r.depth != i or e > k or keys[-1] != path[e - 1] or keys[0] != h:
                # not the usual step (the whole run, starting at i, the path going through it): find
                # where the slice and the path keep to it, and cut it there
                o = i - r.depth
                if not 0 <= o < L or keys[o] != h:
                    self._take_back(n, path, a, i, k, step, refused, fresh)
                    raise ValueError(f"block {h} at path position {i} lies elsewhere in a counted run: paths are not chains")
                L -= o
                if L > k - i:
                    L = k - i
                if keys[o + L - 1] != path[i + L - 1]:  # the path leaves the run (a fork): where, by bisection
                    lo, hi = 1, L - 1  # keys[o] agrees, keys[o + L - 1] does not (chains: agreement is a head)
                    while lo < hi:
                        mid = (lo + hi) >> 1
                        if keys[o + mid] == path[i + mid]:
                            lo = mid + 1
                        else:
                            hi = mid
                    L = lo
                if o:
                    r = self.split(r, o)[1]
                if len(r.keys) > L:
                    r = self.split(r, L)[0]
                e = i + L
            cnt = r.cnt
            old = cnt.get(n, 0)
            new = old + step
            if new > 0:
                if not old:
                    if not cnt:  # counted nowhere before (new, or left in where): listed
                        self.runs[r] = None
                    total[n] += L
                    crossed += (i, e)
                cnt[n] = new
                if pc == cnt:  # equal counts on every node: one run
                    prev = self.join(prev, r)  # type: ignore[arg-type]  # pc is prev's counts
                else:
                    prev = r
                    pc = cnt
            elif new:  # a -1 on a block n does not count: refused
                if i > s:
                    after += [av] * (i - s)
                refused += (i, e)
                prev = pc = None
                s = i = e
                continue
            else:
                del cnt[n]
                total[n] -= L
                crossed += (i, e)
                if cnt:
                    if pc == cnt:
                        prev = self.join(prev, r)  # type: ignore[arg-type]  # pc is prev's counts
                    else:
                        prev = r
                        pc = cnt
                else:  # counted nowhere now: out of the list, its blocks left in where
                    del self.runs[r]
                    prev = pc = None
            if new != av:  # the open stretch of equal counts after ends here
                if i > s:
                    after += [av] * (i - s)
                av = new
                s = i
            i = e
        if k > s:
            after += [av] * (k - s)
        return after, crossed, refused

    def _take_back(
        self, n: int, path: list[int], a: int, i: int, k: int, step: int, refused: list[int], fresh: _CRun | None
    ) -> None:
        """Undo a :meth:`count` of ``path[a:k]`` that found at path position ``i`` a run the path
        does not follow: ``-step`` on the stretches of ``path[a:i]`` it changed (those not in
        ``refused``; a block a -1 left counted nowhere is still in ``where``, its run walked as
        any), and the run ``fresh`` it made for the slice's tail (not reached: it starts after
        ``i``; None if none) taken out of ``where`` again. Only on that error (non-chain input);
        O(runs of ``path[a:i]``) Python steps + O(its blocks) C-level."""
        changed: list[tuple[int, int]] = []
        s = a
        for x, y in zip(refused[::2], refused[1::2]):
            if x > s:
                changed.append((s, x))
            s = y
        if i > s:
            changed.append((s, i))
        for s, e in changed:
            self.count(n, path, s, e, -step)
        if fresh is not None:
            _drain(map(self.where.pop, fresh.keys))

    def drop_node(self, n: int) -> None:
        """Node n counts nothing any more (``BranchTable.reset_node``): O(runs) Python steps (a
        run left counted nowhere keeps its blocks in ``where``)."""
        for r in list(self.runs):
            if r.cnt.pop(n, None) is not None and not r.cnt:
                del self.runs[r]
        self.total[n] = 0

    def check(self) -> None:
        """Every block in ``where`` lies in its run at its place, counts are > 0, the runs listed
        are those counted on some node, and ``total`` adds up. O(blocks ever counted)."""
        total = [0] * len(self.total)
        for h, r in self.where.items():
            assert all(c > 0 for c in r.cnt.values()), f"run of {h}: counts {r.cnt}"
            for n in r.cnt:
                total[n] += 1
        seen = {id(r): r for r in self.where.values()}
        assert {i for i, r in seen.items() if r.cnt} == {id(r) for r in self.runs}, "runs listed are not the counted runs"
        for r in seen.values():
            assert r.keys and all(self.where.get(h) is r for h in r.keys), f"a run's blocks not all pointing to it (depth {r.depth})"
        assert total == self.total, f"counted totals {self.total} != {total}"


class _NodeCounts(Mapping[int, int]):
    """R[n] as a read-only mapping (block → count > 0) over :class:`_CountRuns`: one ``where``
    probe and one count lookup per block; ``len`` O(1)."""

    __slots__ = ("_where", "_n", "_total", "_runs")

    def __init__(self, runs: _CountRuns, n: int) -> None:
        self._where = runs.where
        self._runs = runs.runs
        self._n = n
        self._total = runs.total

    def __getitem__(self, h: int) -> int:
        r = self._where.get(h)
        c = None if r is None else r.cnt.get(self._n)
        if c is None:
            raise KeyError(h)
        return c

    def get(self, h: int, default: Any = None) -> Any:
        r = self._where.get(h)
        if r is None:
            return default
        return r.cnt.get(self._n, default)

    def __contains__(self, h: object) -> bool:
        r = self._where.get(h)  # type: ignore[call-overload]
        return r is not None and self._n in r.cnt

    def __len__(self) -> int:
        return self._total[self._n]

    def how_many(self, keys: Iterable[int]) -> int:
        """How many of ``keys`` are counted on the node: ``sum(map(self.__contains__, keys))``
        in C (a ``where`` probe and a membership test of the node in its run's counts per key)."""
        return sum(map(contains, map(_CNT, filter(None, map(self._where.get, keys))), repeat(self._n)))

    def __iter__(self) -> Iterator[int]:
        n = self._n
        return chain.from_iterable([r.keys for r in self._runs if n in r.cnt])

    # The hot paths of :class:`BranchTable` (a store's or an eviction's chain) call these rather
    # than the module's functions over the mapping: those index or probe it per block, each a
    # ``__getitem__`` / ``__contains__`` call in Python (a frame per probe: ~37,000 per 600 s
    # at 512-token blocks); here a probe is a ``where`` lookup and a test on the run's counts.

    def counts_of(self, keys: Sequence[int]) -> list[int]:
        """:func:`_values` over this mapping: ``[self[k] for k in keys]`` in C (a ``where``
        lookup and the run's count of the node per key). Raises KeyError when a key is not
        counted on the node."""
        return list(map(getitem, map(_CNT, map(self._where.__getitem__, keys)), repeat(self._n)))

    def head(self, seq: Sequence[int], lo: int, hi: int) -> int:
        """:func:`_counted_head` over this mapping (``seq[lo:hi]`` not empty, its counted blocks
        a head): where that head ends, ``lo`` … ``hi``; two probes, else a bisection."""
        get = self._where.get
        n = self._n
        r = get(seq[hi - 1])
        if r is not None and n in r.cnt:
            return hi
        r = get(seq[lo])
        if r is None or n not in r.cnt:
            return lo
        lo += 1  # seq[lo - 1] counted, seq[hi - 1] not
        hi -= 1
        while lo < hi:
            mid = (lo + hi) >> 1
            r = get(seq[mid])
            if r is not None and n in r.cnt:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def tail(self, seq: Sequence[int], lo: int, hi: int) -> int:
        """:func:`_counted_tail` over this mapping (``seq[lo:hi]`` not empty, deepest first, its
        counted blocks a tail): where that tail starts, ``lo`` … ``hi``."""
        get = self._where.get
        n = self._n
        r = get(seq[lo])
        if r is not None and n in r.cnt:
            return lo
        r = get(seq[hi - 1])
        if r is None or n not in r.cnt:
            return hi
        lo += 1  # seq[lo - 1] not counted, seq[hi - 1] counted
        hi -= 1
        while lo < hi:
            mid = (lo + hi) >> 1
            r = get(seq[mid])
            if r is not None and n in r.cnt:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def chain_values(self, seq: list[int]) -> list[int]:
        """:func:`_chain_values` over this mapping (``seq`` a chain of blocks counted on the node,
        not empty): the usual one stretch of equal counts is two lookups and a list repeat.
        Raises KeyError when a block read is not counted on the node."""
        where = self._where
        n = self._n
        last = where[seq[-1]].cnt[n]
        v = where[seq[0]].cnt[n]
        if v == last:
            return [v] * len(seq)
        return _chain_values(self, seq)
