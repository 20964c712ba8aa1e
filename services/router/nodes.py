"""The router's view of the cluster: phases, last reported states, fencing, in-flight counts.

This module contains zero I/O: no asyncio, no NATS, no clock reads, no logging
setup. Every method that depends on time takes ``now`` (seconds in whatever
clock the caller uses: the live shell passes simulated seconds from
``shared.clock.SimClock``, the discrete-event simulator passes virtual time).
The asyncio shell that feeds it lives in ``services/router/service.py``.

What it keeps per node (:class:`NodeRecord`):

* the last :class:`~shared.messages.NodeState` and ``last_seen`` (the ``now``
  at which it arrived — receipt time, not the worker's ``ts``, so clock skew
  between processes cannot fence a healthy node);
* the phase the planner's latest :class:`~shared.messages.SplitCommand`
  assigns it (``split_phase``), if any;
* whether it is fenced (its last state is older than ``fence_after``);
* the router's own in-flight counts: requests dispatched to it and not
  finished (``inflight``), of which those still waiting for their first
  token (``inflight_prefill``) and those bound to it for decode
  (``inflight_decode``).

Eligibility (:meth:`NodeLoadView.eligible`): a node is routable iff it has
reported a state, is not fenced, reported ``accepting``, and — when the
current split names it — reports the phase the split assigns (a node that
has not yet applied a new split, or is draining for a switch, is skipped).
Prefill candidates have phase ``prefill`` or ``both``; decode candidates
have phase ``decode`` (``both`` = collocated: prefill and decode on one node).

Operations (N nodes, R requests in flight):

| operation                   | cost          |
|-----------------------------|---------------|
| apply_state / apply_split   | O(1) / O(N)   |
| candidates(now)             | O(N) after an eligibility change, else O(listed) (a NodeLoad rebuilt per node whose numbers changed) |
| on_dispatch / on_first_token / on_handoff / on_finish / rebind | O(1) |
| check_fences(now)           | O(N)          |
| next_deadline()             | O(N)          |
| requests_on(node)           | O(R)          |
| forget_left(now, after)     | O(N)          |

A node that has left for good (:meth:`NodeLoadView.left`: fenced and silent longer than the
router's ``--forget-node-after-s``) and holds no request is forgotten (:meth:`NodeLoadView.forget_left`):
its record goes, so ``GET /v1/cluster`` and every per-node table stop growing with node ids that
churn (a restarted pod or container may come back under a new id); one that reports again is
recorded afresh, with the phase the current split gives it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

from shared.messages import NodeState, Phase, SplitCommand, boot_older
from shared.subjects import check_token
from shared.values import FACTORY, FrozenValue, StructValue, Value, set_field


def kv_blocks(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request's footprint takes: ``prompt_tokens + max_tokens`` tokens in blocks of ``block_size``
    tokens, rounded up. A node reserves it whole when it takes the request and refuses one larger than its GPU KV
    memory (``services/worker/scheduler.py``: ``_check_fits``; a prefill node that hands the decode to another
    node reserves the prompt's blocks only, ``max_tokens=0`` here). O(1)."""
    return -(-(prompt_tokens + max_tokens) // block_size)


NO_SUCH_NODE = "no such node known"
"""How :meth:`NodeLoadView.no_candidate_reason` ends when no known node of the role is ineligible."""

PREFILL_PHASES: frozenset[str] = frozenset(("prefill", "both"))
DECODE_PHASES: frozenset[str] = frozenset(("decode",))

NODE_DOWN_FUTURE_SLACK_NS = 5 * 10**9
"""How far past the router's wall clock (ns) a ``NodeDown.exited_ns`` may be (the launcher's and the router's
clocks, one host's as a rule, read a moment apart): one later is dropped (:meth:`NodeLoadView.fence_exited`,
``future``); its time floor would skip every state of the node's processes that start before it."""


class ExitNotice(Value):
    """What a ``node.down`` notice that fenced a node said about the process that exited
    (:meth:`NodeLoadView.fence_exited`), kept on its :class:`NodeRecord` to tell that process's late states
    (skipped) from its restart's (let in), and to let the node back in if the "dead" process keeps reporting."""

    pid: int
    """The dead process's pid (``NodeDown.pid`` = the trusted state's ``NodeState.pid``); 0: a pid was not known
    (an older sender), and :attr:`floor` tells the processes apart."""
    boot: str
    """The dead process's ``NodeState.boot`` (that of the state trusted when the notice came; ``""``: not known):
    a state with its pid but another boot is of a process that reused the pid, not of the dead one."""
    floor: str
    """With no pid: a ``NodeState.boot`` floor (``f"{exited_ns:020d}-"``): a state whose process started before it is
    taken for the dead process's. ``""`` with a pid."""
    heard_from: float | None
    """``now`` of the first of the dead process's states skipped in the current run of them (none more than the
    fence time apart), None: none skipped yet (:meth:`NodeLoadView.apply_state`'s safety net)."""
    heard_at: float | None
    """``now`` of the latest of them."""

    __slots__ = __match_args__ = ("pid", "boot", "floor", "heard_from", "heard_at")

    def __init__(self, pid: int, boot: str, floor: str = "", heard_from: float | None = None, heard_at: float | None = None) -> None:
        self.pid = pid
        self.boot = boot
        self.floor = floor
        self.heard_from = heard_from
        self.heard_at = heard_at

    def names(self, state: NodeState) -> bool:
        """Whether ``state`` is of the process this notice said exited: its pid and (both known) its boot, or with no
        pid known, a boot that started before :attr:`floor`. O(1)."""
        if self.pid:
            return state.pid == self.pid and (not self.boot or not state.boot or state.boot == self.boot)
        return boot_older(state.boot, self.floor)


class NodeRecord(Value):
    """Everything the router knows about one node (mutable, owned by :class:`NodeLoadView`)."""

    node: str
    state: NodeState | None
    """Last reported state (None until the node reports)."""
    last_seen: float | None
    """``now`` at which ``state`` arrived."""
    split_phase: Phase | None
    """Phase assigned by the current split command; None if the split does not name the node."""
    fenced: bool
    """Set by :meth:`NodeLoadView.check_fences`; cleared when the node reports again."""
    restarted: bool
    """The node's state sequence went back (a new process under the same node id, e.g. one a
    supervisor restarted faster than ``fence_after``): the next :meth:`NodeLoadView.check_fences`
    fences it at once, so the requests the old process held are re-dispatched."""
    fence_events: int
    inflight: int
    """Requests dispatched to this node (prefill or decode) and not finished."""
    inflight_prefill: int
    """Requests dispatched here for prefill whose first token has not arrived."""
    inflight_decode: int
    """Requests bound here for decode and not finished."""
    load: NodeLoad | None
    """This record as a :class:`NodeLoad` (built on demand; None after any change)."""
    down: ExitNotice | None
    """The process its supervisor saw exit (``node.down``, :meth:`NodeLoadView.fence_exited`): its late states are
    skipped (one would let the dead node back in); None: no notice fenced it."""

    __slots__ = __match_args__ = (
        "node", "state", "last_seen", "split_phase", "fenced", "restarted", "fence_events", "inflight",
        "inflight_prefill", "inflight_decode", "load", "down",
    )
    _repr_skip = _compare_skip = ("load",)  # a cache of the other fields (field(repr=False, compare=False))

    def __init__(
        self, node: str, state: NodeState | None = None, last_seen: float | None = None,
        split_phase: Phase | None = None, fenced: bool = False, restarted: bool = False, fence_events: int = 0,
        inflight: int = 0, inflight_prefill: int = 0, inflight_decode: int = 0, load: NodeLoad | None = None,
        down: ExitNotice | None = None,
    ) -> None:
        self.node = node
        self.state = state
        self.last_seen = last_seen
        self.split_phase = split_phase
        self.fenced = fenced
        self.restarted = restarted
        self.fence_events = fence_events
        self.inflight = inflight
        self.inflight_prefill = inflight_prefill
        self.inflight_decode = inflight_decode
        self.load = load
        self.down = down

    @property
    def phase(self) -> Phase | None:
        """Effective phase: the split's assignment when known, else the reported phase."""
        if self.split_phase is not None:
            return self.split_phase
        return self.state.phase if self.state is not None else None


class NodeLoad(StructValue):
    """Load snapshot of one eligible node: what a routing policy sees.

    ``inflight*`` are the router's own counts; ``running``/``waiting``/
    ``decoding`` and ``state`` are from the node's last :class:`NodeState`,
    received at ``last_seen`` (the caller's clock; :meth:`state_age` at ``now``).

    Read-only once built: :class:`NodeLoadView` keeps one per node record and hands the
    same object to every decision until that record changes, so no caller may assign to
    it (nothing does: the view changes the :class:`NodeRecord` and drops its cached load,
    :meth:`NodeLoadView._changed`, never the load). One is built per state applied (the
    simulator: ~10,000 per 600 s): a :class:`~shared.values.StructValue` (built by C code, ~1,800
    instructions fewer than a Python ``__init__`` of its twelve fields). Not frozen only because it
    was a plain ``Value`` (whose frozen form sets each field through ``object.__setattr__``, ~3x the
    cost) and 8e1ad55 kept its behaviour; a frozen Struct costs no more to build (cachegrind, 200,000
    twelve-field constructions: ~1,810 instructions each, ~1,860 unfrozen), so read-only is kept by
    that rule, not enforced.
    """

    node: str
    phase: Phase
    inflight: int = 0
    inflight_prefill: int = 0
    inflight_decode: int = 0
    running: int = 0
    waiting: int = 0
    decoding: int = 0
    gpu_free_blocks: int = 0
    gpu_total_blocks: int = 0
    last_seen: float = 0.0
    state: NodeState | None = None

    def state_age(self, now: float) -> float:
        """Age of ``state`` at ``now`` (caller's clock units)."""
        return now - self.last_seen


class FencedNode(FrozenValue):
    """A node that :meth:`NodeLoadView.check_fences` just fenced out."""

    node: str
    age: float
    """Age of its last state at fencing time (caller's clock units)."""
    rids: tuple[str, ...]
    """Requests in flight that depend on it when it was fenced (:meth:`NodeLoadView.requests_depending_on`)."""
    cause: Literal["silent", "restarted", "exited"]
    """Why: ``silent``, no state for longer than ``fence_after``; ``restarted``, its state sequence went back (a new
    process, :attr:`NodeRecord.restarted`) while it still reported within ``fence_after``; ``exited``, its supervisor
    saw its process exit (``node.down``, :meth:`NodeLoadView.fence_exited`)."""

    __slots__ = __match_args__ = ("node", "age", "rids", "cause")

    def __init__(self, node: str, age: float, rids: tuple[str, ...] = (), cause: Literal["silent", "restarted", "exited"] = "silent") -> None:
        set_field(self, "node", node)
        set_field(self, "age", age)
        set_field(self, "rids", rids)
        set_field(self, "cause", cause)


def _exited(rec: NodeRecord) -> bool:
    """Whether ``rec``'s latest state is of a process its supervisor saw exit (:attr:`NodeRecord.down`)."""
    st, down = rec.state, rec.down
    if down is None or st is None:
        return False
    return down.names(st) or (not down.pid and not st.boot)


class _Flight(StructValue):
    prefill_node: str
    decode_node: str | None
    first_token: bool = False
    handed_off: bool = False
    """Its decode node has the hand-off (it streamed output, or handed the work back)."""


class NodeLoadView(Value):
    """Cluster view for routing (sans-IO).

    Args:
        fence_after: a node whose last state is older than this (same unit as
            ``now``) is fenced out. The live shell passes
            ``fence_after_s * speedup`` so the threshold is in wall seconds.
        clock: when given, the time at which states arrive and every age of a state (fencing,
            eligibility, forgetting, :meth:`snapshot`'s ``state_age_s``, :meth:`next_deadline`)
            are read from it, and the ``now`` of each call is not used for them: the live router
            passes ``SimClock.local_now`` (monotonic, so a step of the wall clock neither fences
            every node nor keeps a dead one in; the ``now`` it passes is wall-based, for the
            times it shares with other processes). None (the default: the simulator, tests):
            the ``now`` of each call. Same unit as ``now``.
        wall_per_s: wall seconds per second of that clock (``1 / speedup`` for the live router): a fenced
            node's reason (:meth:`no_candidate_reason`: ``/health``, a 503) then gives its silence and the
            fence time in wall s, as ``GET /v1/cluster``'s ``fence_after_s``; None: in the clock's unit.

    Raises:
        ValueError: if ``fence_after`` is not positive.
    """

    fence_after: float
    nodes: dict[str, NodeRecord]
    epoch: int
    """Epoch of the split command applied last (-1: none yet)."""
    split_reason: str
    kv_stale: frozenset[str]
    """Nodes whose KV view the directory calls stale (``kv.liveness``): no prefix credit or
    fetch source on them (:meth:`usable`); they stay routable."""
    _flights: dict[str, _Flight]
    _gen: int
    """Bumped by every change that can change which nodes are eligible: a node's first state,
    a state with another phase or ``accepting``, or one that lets a fenced or stale node back
    in; a split; a fence; a new node. Not by in-flight counts, nor by a state that only
    refreshes an eligible node's numbers (those drop the node's cached :class:`NodeLoad`)."""
    _by_id: list[NodeRecord] | None
    """Records sorted by node id (None after a node is added)."""
    _lists: dict[frozenset[str], tuple[int, float, float, list[NodeRecord]]]
    """Eligible records by phase set: ``(gen, built at, oldest listed last_seen, records)``;
    valid while ``gen`` holds and no listed node went stale (a listed node's ``last_seen``
    only grows; a stale one can only come back with a new state, which bumps ``gen``)."""
    _tokens: set[str]
    """Node ids that passed :func:`check_token` (a state names its node every time)."""
    _usable_gen: int
    """``_gen`` at which :meth:`all_usable` last found every node's record usable with an infinite
    ``fence_after`` (then only a fence or a new node, which bump ``_gen``, can change that)."""
    _kv_bounds: tuple[int, int] | None
    """:meth:`kv_bounds`' answer; None after a node reported a capacity it had not reported before, or was forgotten."""
    _split_phases: dict[str, Phase]
    """The applied split's phases (``SplitCommand.phases``): a node recorded afresh after it was forgotten
    (:meth:`forget_left`) gets its phase from here, as its old record had."""
    _forgotten: set[str]
    """Nodes :meth:`forget_left` dropped that the applied split still names: :meth:`apply_split` does not record
    them again (the planner's ``--nodes`` name a dead node in every split; its next command brought the record
    back, never seen, so never forgotten again and listed by ``/v1/cluster`` for good). An id leaves when the
    node reports again or a split no longer names it, so the set is bounded by the split's size."""

    clock: Callable[[], float] | None
    """The receiving side's clock for state ages (see Args), or None: each call's ``now``."""
    wall_per_s: float | None
    """Wall s per second of ``clock`` for the reasons' ages (see Args), or None."""
    superseded_states: int
    """States skipped because a process that started later (``NodeState.boot``) reports under the same node id and
    is not fenced: the older process (frozen, replaced, resumed) until it stops itself; or because they are of a
    process its supervisor saw exit (``node.down``, :attr:`NodeRecord.down`)."""
    reported_alive: int
    """Nodes let back in although a ``node.down`` said their process exited: that process went on reporting for
    twice the fence time (:meth:`apply_state`; the notice was wrong)."""

    __slots__ = __match_args__ = (
        "fence_after", "nodes", "epoch", "split_reason", "kv_stale", "_flights", "_gen", "_by_id", "_lists", "_tokens",
        "_usable_gen", "_kv_bounds", "_split_phases", "_forgotten", "clock", "wall_per_s", "superseded_states",
        "reported_alive",
    )

    def __init__(
        self, fence_after: float = 3.0, nodes: Any = FACTORY, epoch: int = -1, split_reason: str = "",
        kv_stale: frozenset[str] = frozenset(), _flights: Any = FACTORY, _gen: int = 0,
        _by_id: list[NodeRecord] | None = None, _lists: Any = FACTORY, _tokens: Any = FACTORY,
        _usable_gen: int = -1, _kv_bounds: tuple[int, int] | None = None, _split_phases: Any = FACTORY, _forgotten: Any = FACTORY,
        clock: Callable[[], float] | None = None, wall_per_s: float | None = None, superseded_states: int = 0,
        reported_alive: int = 0,
    ) -> None:
        self.fence_after = fence_after
        self.nodes = {} if nodes is FACTORY else nodes
        self.epoch = epoch
        self.split_reason = split_reason
        self.kv_stale = kv_stale
        self._flights = {} if _flights is FACTORY else _flights
        self._gen = _gen
        self._by_id = _by_id
        self._lists = {} if _lists is FACTORY else _lists
        self._tokens = set() if _tokens is FACTORY else _tokens
        self._usable_gen = _usable_gen
        self._kv_bounds = _kv_bounds
        self._split_phases = {} if _split_phases is FACTORY else _split_phases
        self._forgotten = set() if _forgotten is FACTORY else _forgotten
        self.clock = clock
        self.wall_per_s = wall_per_s
        self.superseded_states = superseded_states
        self.reported_alive = reported_alive
        self.__post_init__()

    def __post_init__(self) -> None:
        if not self.fence_after > 0:
            raise ValueError(f"fence_after must be > 0, got {self.fence_after}")

    # -- inputs ----------------------------------------------------------- #

    def _record(self, node: str) -> NodeRecord:
        rec = self.nodes.get(node)
        if rec is None:
            rec = self.nodes[node] = NodeRecord(node=node, split_phase=self._split_phases.get(node))
            self._by_id = None
            self._gen += 1
        return rec

    def _changed(self, rec: NodeRecord) -> None:
        """Drop ``rec``'s cached :class:`NodeLoad` (its numbers changed)."""
        rec.load = None

    def _eligibility_changed(self, rec: NodeRecord) -> None:
        """Drop ``rec``'s cached :class:`NodeLoad` and every cached candidate list."""
        rec.load = None
        self._gen += 1

    def apply_state(self, state: NodeState, now: float) -> bool:
        """Record a node's state received at ``now``.

        A state of the process a ``node.down`` said exited (:attr:`NodeRecord.down`) is skipped
        (:attr:`superseded_states`), unless that process has gone on reporting while fenced for twice the fence time,
        no two of its states more than the fence time apart: the notice was wrong (a wrong pid, a clock step), and the
        node is let back in (:attr:`reported_alive`) rather than fenced for the router's life.

        Returns:
            True when the node was fenced and is let back in by this state.

        Raises:
            ValueError: if ``state.node`` is not a single NATS token (it is
                used to build ``work.<node>.*`` subjects).
        """
        if self.clock is not None:
            now = self.clock()
        rec = self.nodes.get(state.node)
        if rec is not None:
            # the usual state (about two in three of a simulated run's per decision): the same process's next one,
            # nothing the checks below act on (its node seen before, not fenced, no down notice, the same boot, no
            # lower seq, no forgotten node, the same KV size, phase and acceptance, within the fence time): only
            # the record moves on, its NodeLoad made again when read (the steps below, without their tests)
            old, seen = rec.state, rec.last_seen
            if (
                old is not None
                and seen is not None
                and rec.down is None
                and not rec.fenced
                and state.boot == old.boot
                and state.seq >= old.seq
                and old.phase == state.phase
                and old.accepting == state.accepting
                and old.gpu_total_blocks == state.gpu_total_blocks
                and not self._forgotten
                and now - seen <= self.fence_after
            ):
                rec.state = state
                rec.last_seen = now
                rec.load = None
                return False
        if state.node not in self._tokens:
            check_token(state.node, "node")
            self._tokens.add(state.node)
        rec = rec or self._record(state.node)
        old, seen = rec.state, rec.last_seen
        down = rec.down
        if down is not None and down.names(state):
            # a state of the process its supervisor saw exit (sent before it died, read late): it would let the dead
            # node back in until fence_after. Unless it keeps coming while the node is fenced (safety net)
            if not rec.fenced or not self._reported_alive(down, now):
                self.superseded_states += 1
                return False
            rec.down = None
            self.reported_alive += 1
        if old is not None and not rec.fenced and state.boot != old.boot and boot_older(state.boot, old.boot):
            # a process superseded under this node id (frozen, restarted, then resumed) until it stops itself:
            # its states would read as a restart of the node at each alternation (fence, re-dispatch). Once the
            # later one is fenced (silent) the earlier one's states count again (a restart on a host whose clock
            # is behind is then let in after fence_after, not never)
            self.superseded_states += 1
            return False
        if self._forgotten:  # (a forgotten node reporting again: rare; no call per state otherwise)
            self._forgotten.discard(state.node)
        if old is not None and not rec.fenced and state.seq < old.seq:
            rec.restarted = True  # a new process: what the old one held is gone (issue #22)
        rec.state = state
        rec.last_seen = now
        if old is None or old.gpu_total_blocks != state.gpu_total_blocks:
            self._kv_bounds = None
        if (
            old is None
            or rec.fenced
            or old.phase != state.phase
            or old.accepting != state.accepting
            or seen is None
            or now - seen > self.fence_after
        ):
            self._eligibility_changed(rec)
        else:
            rec.load = None
        if rec.fenced:
            rec.fenced = False
            return True
        return False

    def _reported_alive(self, down: ExitNotice, now: float) -> bool:
        """Note a state of ``down``'s process skipped at ``now``; True once they have come for twice the fence time
        with no gap longer than the fence time (a process that reports is not dead). O(1)."""
        if down.heard_at is None or down.heard_from is None or now - down.heard_at > self.fence_after:
            down.heard_from = now  # the first of a run
        down.heard_at = now
        return now - down.heard_from >= 2 * self.fence_after

    def apply_split(self, cmd: SplitCommand) -> bool:
        """Adopt a split command unless it is older than the current one.

        Nodes named in ``cmd.phases`` get that phase; nodes not named fall back
        to their reported phase. A command with the same epoch replaces the
        current one (the planner's reply to ``split.get`` repeats it).

        Returns:
            False if ``cmd.epoch`` is lower than the applied epoch (ignored).

        Raises:
            ValueError: if a node id in ``cmd.phases`` is not a NATS token
                (the command is then not applied at all).
        """
        if cmd.epoch < self.epoch:
            return False
        for node in cmd.phases:
            check_token(node, "node")
        for rec in self.nodes.values():
            rec.split_phase = None
            rec.load = None
        self._gen += 1
        self._forgotten &= cmd.phases.keys()
        for node, phase in cmd.phases.items():
            known = self.nodes.get(node)
            if known is not None:
                known.split_phase = phase
            elif node not in self._forgotten:  # a forgotten one gets its phase from _split_phases if it reports again
                self._record(node).split_phase = phase
        self._split_phases = dict(cmd.phases)
        self.epoch = cmd.epoch
        self.split_reason = cmd.reason
        return True

    @property
    def split_nodes(self) -> int:
        """Nodes the applied split names (``len(SplitCommand.phases)``, every phase; 0 before the first split).

        The planner's ``--nodes`` are all in every split, dead ones included: against the live candidates this is how
        many of the split's nodes the router cannot place on (``ei_router_split_nodes`` less ``ei_router_live_nodes``).
        """
        return len(self._split_phases)

    # -- eligibility -------------------------------------------------------- #

    def age(self, node: str, now: float) -> float | None:
        """Age of the node's last state, or None if it never reported."""
        if self.clock is not None:
            now = self.clock()
        rec = self.nodes.get(node)
        if rec is None or rec.last_seen is None:
            return None
        return now - rec.last_seen

    def is_stale(self, rec: NodeRecord, now: float) -> bool:
        """True when the node is fenced or its last state is older than ``fence_after``."""
        if self.clock is not None:
            now = self.clock()
        return rec.fenced or rec.last_seen is None or now - rec.last_seen > self.fence_after

    def eligible(self, rec: NodeRecord, now: float) -> bool:
        """Routable now: reported, not stale, accepting, phase agrees with the split."""
        if self.clock is not None:
            now = self.clock()
        st = rec.state
        if st is None or self.is_stale(rec, now) or not st.accepting:
            return False
        return rec.split_phase is None or rec.split_phase == st.phase

    def _load(self, rec: NodeRecord) -> NodeLoad:
        ld = rec.load
        if ld is None:
            st = rec.state
            assert st is not None and rec.last_seen is not None
            # positional, in field order (no keyword parsing: one is built per state applied)
            ld = rec.load = NodeLoad(
                rec.node,
                st.phase,
                rec.inflight,
                rec.inflight_prefill,
                rec.inflight_decode,
                st.running,
                st.waiting,
                st.decoding,
                st.gpu_free_blocks,
                st.gpu_total_blocks,
                rec.last_seen,
                st,
            )
        return ld

    def candidates(self, phases: Iterable[str], now: float) -> list[NodeLoad]:
        """Eligible nodes whose phase is in ``phases``, sorted by node id (a new list).

        Which nodes are listed is kept until a change that can alter eligibility (see
        ``_gen``) or until ``now`` leaves the interval in which no listed node can go
        stale; each node's :class:`NodeLoad` is kept until that node's record changes.
        """
        if self.clock is not None:
            now = self.clock()
        wanted = phases if isinstance(phases, frozenset) else frozenset(phases)
        hit = self._lists.get(wanted)
        if hit is not None and hit[0] == self._gen and hit[1] <= now and now - hit[2] <= self.fence_after:
            listed = hit[3]
            return [rec.load or self._load(rec) for rec in listed] if listed else []
        by_id = self._by_id
        if by_id is None:
            by_id = self._by_id = sorted(self.nodes.values(), key=lambda r: r.node)
        recs: list[NodeRecord] = []
        oldest = float("inf")
        fence = self.fence_after
        for rec in by_id:  # eligible(rec, now) and phase in wanted, inlined (no call per node)
            st = rec.state
            if st is None or rec.fenced or not st.accepting or st.phase not in wanted:
                continue
            if rec.split_phase is not None and rec.split_phase != st.phase:
                continue
            seen = rec.last_seen
            if seen is None or now - seen > fence:
                continue
            if seen < oldest:
                oldest = seen
            recs.append(rec)
        self._lists[wanted] = (self._gen, now, oldest, recs)
        return [rec.load or self._load(rec) for rec in recs]

    def prefill_candidates(self, now: float) -> list[NodeLoad]:
        """Eligible nodes with phase ``prefill`` or ``both``."""
        return self.candidates(PREFILL_PHASES, now)

    def decode_candidates(self, now: float) -> list[NodeLoad]:
        """Eligible nodes with phase ``decode``."""
        return self.candidates(DECODE_PHASES, now)

    def routable(self, now: float) -> tuple[bool, str]:
        """Whether a request could be placed now, and why not.

        Returns:
            ``(True, "")`` when a collocated node, or a prefill node and a decode
            node, are eligible; else ``(False, reason)``.
        """
        if self.clock is not None:
            now = self.clock()
        pre = self.prefill_candidates(now)
        if not pre:
            return False, self.no_candidate_reason("prefill", now)
        if any(n.phase == "both" for n in pre) or self.decode_candidates(now):
            return True, ""
        return False, self.no_candidate_reason("decode", now)

    def engines(self) -> set[str]:
        """Engines the nodes reported (``NodeState.engine``: ``sim``, ``torch``, ...), over every
        node with a state; empty before any state arrived. O(nodes)."""
        return {rec.state.engine for rec in self.nodes.values() if rec.state is not None}

    def nodes_with_engine(self, engine: str) -> list[str]:
        """Nodes not fenced out whose last state reports ``engine`` (``NodeState.engine``), sorted:
        the nodes a request may be placed on (now or, with its phase switched, later) that run it.
        O(nodes log nodes)."""
        return sorted(rec.node for rec in self.nodes.values() if rec.state is not None and not rec.fenced and rec.state.engine == engine)

    def left(self, rec: NodeRecord, now: float, forget_after: float) -> bool:
        """True when the node has left for good: fenced and its last state older than ``forget_after`` at ``now``
        (the caller's clock units; ``math.inf``: never). A node fenced for a moment (restarted, silent less than
        ``forget_after``) has not; a node fenced while the bus is down is not fenced (the shell skips fence
        checks then), so an outage does not make nodes leave. O(1)."""
        if self.clock is not None:
            now = self.clock()
        return rec.fenced and rec.last_seen is not None and now - rec.last_seen > forget_after

    def _unseen_leftover(self, rec: NodeRecord) -> bool:
        """True for a record of a node that never reported to this router and holds no request, which the split
        does not name or names after :meth:`forget_left` dropped it (``_forgotten``): another router's placement
        (``RouterCore.remote_dispatch``) or a decode binding recorded it, and that request has ended. It holds
        nothing a later :meth:`_record` would not rebuild; without this it was never :meth:`left` (never seen, so
        never fenced) and ``GET /v1/cluster`` listed it for good. A node the split names that has not reported
        yet (a new one starting) is kept, as before. O(1)."""
        return (
            rec.last_seen is None
            and rec.inflight == 0
            and (rec.node in self._forgotten or rec.node not in self._split_phases)
        )

    def forget_left(self, now: float, forget_after: float) -> list[str]:
        """Forget every node that has left for good (:meth:`left` at ``now``: fenced and its last state older than
        ``forget_after``, the caller's clock units; ``math.inf``: never) and holds no request (``inflight`` 0: a
        request whose decode node holds its hand-off still names its old prefill node until it ends; the node is
        forgotten at a later call). Its record, and its id among the checked ones, go: :meth:`snapshot`
        (``GET /v1/cluster``), :meth:`no_candidate_reason`, :meth:`kv_bounds` and :meth:`largest_gpu_kv` no longer
        list it. A node that reports again is recorded afresh (:meth:`apply_state`: as a new node, with the phase
        the applied split gives it). A record of a node that never reported here and holds no request (another
        router's placement on a node this one forgot or never heard from; :meth:`_unseen_leftover`) goes too, at
        the first call after its last request ended. Returns the forgotten node ids, sorted (the caller drops its
        own per-node state). O(nodes)."""
        if self.clock is not None:
            now = self.clock()
        if forget_after == math.inf:
            return []
        gone = sorted(
            n for n, rec in self.nodes.items()
            if rec.inflight == 0 and (self.left(rec, now, forget_after) or self._unseen_leftover(rec))
        )
        for node in gone:
            del self.nodes[node]
            self._tokens.discard(node)
            if node in self._split_phases:
                self._forgotten.add(node)
        if gone:
            self._by_id = None
            self._kv_bounds = None
            self._gen += 1
        return gone

    def largest_gpu_kv(self, now: float = 0.0, forget_after: float = math.inf) -> tuple[int, str] | None:
        """(``NodeState.gpu_total_blocks``, node) of the node whose GPU memory (L1) holds the most KV
        blocks, over every node that has reported a state and not left for good (:meth:`left` at ``now``:
        fenced and silent longer than ``forget_after``; fenced ones still count until then: a fenced node is
        let back in when it reports again, and a request may be placed on any node now or after a phase
        switch); the first node id on a tie. None when there is none, or when one of them reports no capacity
        (0: a node of an older version; nothing can be promised then). The defaults count every node that
        reported. O(nodes)."""
        if self.clock is not None:
            now = self.clock()
        best: tuple[int, str] | None = None
        for rec in self.nodes.values():
            st = rec.state
            if st is None or (forget_after < math.inf and self.left(rec, now, forget_after)):
                continue
            if st.gpu_total_blocks <= 0:
                return None
            if best is None or (-st.gpu_total_blocks, rec.node) < (-best[0], best[1]):
                best = (st.gpu_total_blocks, rec.node)
        return best

    def kv_bounds(self) -> tuple[int, int]:
        """(smallest, largest) GPU KV memory (``NodeState.gpu_total_blocks``, blocks) that a node reports, over
        every node with a state, fenced ones included, leaving out nodes that report none (0); ``(0, 0)``
        when no node reports one. A request of at most ``smallest`` blocks fits every node, so placement
        need not look at sizes (:meth:`fits`). O(1) while no node reports a new capacity, else O(nodes)."""
        b = self._kv_bounds
        if b is None:
            caps = [rec.state.gpu_total_blocks for rec in self.nodes.values() if rec.state is not None and rec.state.gpu_total_blocks > 0]
            b = self._kv_bounds = (min(caps), max(caps)) if caps else (0, 0)
        return b

    def no_candidate_reason(self, role: str, now: float) -> str:
        """Human-readable reason why no node of ``role`` (prefill|decode) is eligible: each node of the role (by its
        state or its split) and why it is not, ``"; "``-joined. A node not fenced yet whose last state is older than
        half the fence time (a node reports at least every ``--idle-state-interval-s``, 1 s) has its silence added in
        parentheses (``w1: switching decode->both (no state for 2.4 wall s; fenced at 3.0 wall s if none comes)``):
        before, a frozen node asked to switch was said to be switching, and nothing said it no longer answered; then
        (4abf5da) the silence came after a ``"; "``, the separator between nodes, and read like another node's. Every
        time in it has one unit: wall s on the live router (``wall_per_s``), else s (the fence time was "s" next to
        "wall s" before)."""
        if self.clock is not None:
            now = self.clock()
        phases = PREFILL_PHASES if role == "prefill" else DECODE_PHASES
        parts: list[str] = []
        w = self.wall_per_s or 1.0
        unit = "wall s" if self.wall_per_s is not None else "s"

        def silent(rec: NodeRecord) -> str:
            age = now - rec.last_seen if rec.last_seen is not None else 0.0
            if age <= self.fence_after / 2:
                return ""
            return f" (no state for {age * w:.1f} {unit}; fenced at {self.fence_after * w:.1f} {unit} if none comes)"

        for rec in sorted(self.nodes.values(), key=lambda r: r.node):
            if rec.phase not in phases and (rec.state is None or rec.state.phase not in phases):
                continue
            if rec.state is None:
                parts.append(f"{rec.node}: no state reported")
            elif self.is_stale(rec, now):
                age = now - (rec.last_seen if rec.last_seen is not None else now)
                if rec.fenced and _exited(rec):  # fenced at its supervisor's word (node.down), its late states skipped
                    parts.append(f"{rec.node}: fenced (its process exited, said its supervisor's node.down; let back in at "
                                 f"another process's first state, or if this one reports for {2 * self.fence_after * w:.1f} {unit})")
                elif age <= self.fence_after:  # fenced although it reported within the fence time: a new process
                    parts.append(f"{rec.node}: fenced (restarted: its state sequence went back; let back in at its next state)")
                elif self.wall_per_s is not None:  # the live router: wall s, as /v1/cluster's fence_after_s
                    w = self.wall_per_s
                    parts.append(f"{rec.node}: fenced (no state for {age * w:.1f} wall s, past the fence time of {self.fence_after * w:.1f} wall s)")
                else:
                    parts.append(f"{rec.node}: fenced (no state for {age:.1f} s, past the fence time of {self.fence_after:.1f} s)")
            elif not rec.state.accepting:
                parts.append(f"{rec.node}: not accepting (draining){silent(rec)}")
            elif rec.split_phase is not None and rec.split_phase != rec.state.phase:
                parts.append(f"{rec.node}: switching {rec.state.phase}->{rec.split_phase}{silent(rec)}")
        what = "prefill (phase prefill or both)" if role == "prefill" else "decode (phase decode) or collocated (both)"
        detail = "; ".join(parts) if parts else NO_SUCH_NODE
        return f"no live {what} node: {detail}"

    # -- in-flight bookkeeping ------------------------------------------- #

    def on_dispatch(self, rid: str, prefill_node: str, decode_node: str | None) -> None:
        """Count request ``rid`` as in flight on its prefill (and decode) node.

        Raises:
            ValueError: if ``rid`` is already in flight.
        """
        if rid in self._flights:
            raise ValueError(f"request {rid!r} is already in flight")
        self._flights[rid] = _Flight(prefill_node, decode_node)
        p = self.nodes.get(prefill_node) or self._record(prefill_node)
        p.inflight += 1
        p.inflight_prefill += 1
        p.load = None  # _changed(p)
        if decode_node is not None:
            d = self._record(decode_node)
            d.inflight += 1
            d.inflight_decode += 1
            self._changed(d)

    def on_first_token(self, rid: str) -> None:
        """The first output token of ``rid`` arrived: its prefill is done (idempotent)."""
        fl = self._flights.get(rid)
        if fl is None or fl.first_token:
            return
        fl.first_token = True
        p = self.nodes[fl.prefill_node]
        p.inflight_prefill -= 1
        p.load = None  # _changed(p)

    def first_token_seen(self, rid: str) -> bool:
        """True when in-flight ``rid``'s first output token has arrived (:meth:`on_first_token`). O(1)."""
        fl = self._flights.get(rid)
        return fl is not None and fl.first_token

    def on_handoff(self, rid: str, node: str) -> bool:
        """``node`` showed it holds the prefill → decode hand-off of ``rid`` (it streamed output
        of ``rid``, or handed the decode work back to the router): from now on ``rid`` no longer
        depends on its prefill node (:meth:`requests_depending_on`). Only the decode node of a
        disaggregated placement counts. Returns True when this call marked it. O(1)."""
        fl = self._flights.get(rid)
        if fl is None or fl.handed_off or fl.decode_node is None or node != fl.decode_node or node == fl.prefill_node:
            return False
        fl.handed_off = True
        return True

    def on_finish(self, rid: str) -> tuple[str, str | None] | None:
        """Forget ``rid`` (finished, failed or aborted); idempotent.

        Returns:
            ``(prefill_node, decode_node)`` it was placed on, or None if unknown.
        """
        fl = self._flights.pop(rid, None)
        if fl is None:
            return None
        p = self.nodes[fl.prefill_node]
        p.inflight -= 1
        if not fl.first_token:
            p.inflight_prefill -= 1
        p.load = None  # _changed(p)
        if fl.decode_node is not None:
            d = self.nodes[fl.decode_node]
            d.inflight -= 1
            d.inflight_decode -= 1
            self._changed(d)
        return fl.prefill_node, fl.decode_node

    def rebind(self, rid: str, decode_node: str) -> bool:
        """Bind in-flight ``rid`` to ``decode_node`` (decode binding at prefill start, or a
        new decode node after the old one handed the request back); the first-token
        state is kept. Returns False if ``rid`` is not in flight. O(1).

        Raises:
            ValueError: if ``decode_node`` is not a single NATS token.
        """
        fl = self._flights.get(rid)
        if fl is None:
            return False
        check_token(decode_node, "node")
        if fl.decode_node is not None:
            old = self.nodes[fl.decode_node]
            old.inflight -= 1
            old.inflight_decode -= 1
            self._changed(old)
        fl.decode_node = decode_node
        d = self._record(decode_node)
        d.inflight += 1
        d.inflight_decode += 1
        self._changed(d)
        return True

    def placement(self, rid: str) -> tuple[str, str | None] | None:
        """``(prefill_node, decode_node)`` of an in-flight request, or None."""
        fl = self._flights.get(rid)
        return None if fl is None else (fl.prefill_node, fl.decode_node)

    def requests_on(self, node: str) -> list[str]:
        """In-flight requests placed on ``node`` as prefill or decode node."""
        return [rid for rid, fl in self._flights.items() if fl.prefill_node == node or fl.decode_node == node]

    def requests_depending_on(self, node: str) -> list[str]:
        """In-flight requests that cannot go on without ``node``: those it decodes, and those
        whose prefill it runs and whose hand-off has not reached their decode node yet — its
        prefill is running, or its first token is out but the decode node has not shown it holds
        the hand-off (:meth:`on_handoff`), so the node may have died before publishing it. A
        request whose decode node holds the hand-off depends on its decode node only (issue #22)."""
        return [rid for rid, fl in self._flights.items() if fl.decode_node == node or (fl.prefill_node == node and not fl.handed_off)]

    def usable(self, node: str, now: float) -> bool:
        """True when ``node`` reports, is not fenced and the directory does not call its KV view
        stale (``kv_stale``, from ``kv.liveness``): its cache may be counted on (prefix credit,
        fetch sources). Unknown nodes count as usable (the directory may know a node
        before its first state reaches this router)."""
        if self.clock is not None:
            now = self.clock()
        if node in self.kv_stale:
            return False
        rec = self.nodes.get(node)
        if rec is None or (rec.last_seen is None and not rec.fenced):
            return True
        return not self.is_stale(rec, now)

    def all_usable(self, now: float) -> bool:
        """True when :meth:`usable` holds for every node (none fenced or stale, no KV view
        called stale): a lookup then needs no filtering. O(N)."""
        if self.clock is not None:
            now = self.clock()
        if self.kv_stale:
            return False
        fence = self.fence_after
        if self._usable_gen == self._gen and fence == math.inf:
            return True
        for rec in self.nodes.values():
            if rec.fenced or (rec.last_seen is not None and now - rec.last_seen > fence):
                return False
        if fence == math.inf:  # no state ages out: valid until a fence, a state letting one back in, a new node
            self._usable_gen = self._gen
        return True

    @property
    def inflight_total(self) -> int:
        return len(self._flights)

    # -- fencing ------------------------------------------------------------ #

    def check_fences(self, now: float, hold: Callable[[str], bool] | None = None) -> list[FencedNode]:
        """Fence every node whose last state is older than ``fence_after``, and every node whose
        state sequence went back since the last call (a restarted process, :attr:`NodeRecord.restarted`).

        Args:
            now: as for every call (the view's ``clock`` when it has one).
            hold: None, or asked of each node silent past ``fence_after`` (not one that restarted): True leaves it
                unfenced this call (the router's :class:`~services.router.silence.DeliveryWitness`: the bus did not
                deliver for long enough of its silence to call it the node's).

        Returns:
            The nodes fenced by this call (not those already fenced), each with
            the requests in flight on it; sorted by node id. The caller fails
            those requests and then calls :meth:`on_finish` for each.
        """
        if self.clock is not None:
            now = self.clock()
        out: list[FencedNode] = []
        for rec in sorted(self.nodes.values(), key=lambda r: r.node):
            if rec.fenced or rec.last_seen is None:
                rec.restarted = False
                continue
            age = now - rec.last_seen
            if age > self.fence_after and not rec.restarted and hold is not None and hold(rec.node):
                continue
            if age > self.fence_after or rec.restarted:
                rec.restarted = False
                rec.fenced = True
                rec.fence_events += 1
                self._eligibility_changed(rec)
                out.append(FencedNode(node=rec.node, age=age, rids=tuple(self.requests_depending_on(rec.node)),
                                      cause="silent" if age > self.fence_after else "restarted"))
        return out

    def fence_exited(
        self, node: str, exited_ns: int, now: float, *, pid: int = 0, wall_ns: int | None = None
    ) -> tuple[FencedNode | None, str]:
        """Fence ``node`` now: its supervisor saw its process ``pid`` exit at wall ns ``exited_ns`` (``node.down``).

        Which process died is told by its pid: the notice fences the node only when ``pid`` is the pid of the process
        whose state the view trusts for the node (``NodeState.pid``); that process's later states are skipped
        (:attr:`NodeRecord.down`), and the first state of any other process (its restart) lets the node back in. A
        notice naming another pid fences nothing (a wrong pid; another ``up`` on the same NATS; a notice that came
        after the restart reported). Only when either pid is not known (0: an older sender) is the exit told by wall
        time: the states of a process whose ``boot`` started before ``exited_ns`` are skipped. Before, always by wall
        time: a notice naming a live process (a wrong pid, a backward clock step of more than a second between the
        exit and the restart's start, two launchers (``up``) on one NATS) fenced the node for the router's life. If the process
        named keeps reporting anyway, :meth:`apply_state` lets the node back in after twice the fence time.

        Args:
            exited_ns: wall ns (``time.time_ns()``) of the exit, as the supervisor saw it.
            now: as for every call (the view's ``clock`` when it has one).
            pid: the exited process's id; 0: not known.
            wall_ns: the caller's wall clock (ns); a notice whose ``exited_ns`` is more than
                :data:`NODE_DOWN_FUTURE_SLACK_NS` past it is dropped (``future``). None: not checked.

        Returns:
            ``(fenced, why)``: the :class:`FencedNode` (cause ``exited``, with the requests in flight on it; the
            caller re-dispatches them as for any fence) and ``""``; or None and why nothing was fenced:
            ``future`` (``exited_ns`` past ``wall_ns`` + the slack: nothing noted), ``unknown`` (no state heard from
            it), ``other_pid`` (the process it trusts has another pid), ``later_process`` (no pid known: its latest
            state is of a process that started after the exit, the notice came late), ``already_fenced`` (the dead
            process's late states are skipped from now on all the same).
        """
        if wall_ns is not None and exited_ns > wall_ns + NODE_DOWN_FUTURE_SLACK_NS:
            return None, "future"
        if self.clock is not None:
            now = self.clock()
        rec = self.nodes.get(node)
        if rec is None or rec.state is None or rec.last_seen is None:
            return None, "unknown"
        st = rec.state
        if pid and st.pid:
            if pid != st.pid:
                return None, "other_pid"
            rec.down = ExitNotice(pid, st.boot)
        else:
            floor = f"{exited_ns:020d}-"  # sorts after every boot that started before exited_ns, before every later one
            if st.boot and not boot_older(st.boot, floor):
                return None, "later_process"
            prev = rec.down
            rec.down = ExitNotice(0, "", max(prev.floor, floor) if prev is not None and not prev.pid else floor)
        if rec.fenced:
            return None, "already_fenced"
        rec.restarted = False
        rec.fenced = True
        rec.fence_events += 1
        self._eligibility_changed(rec)
        return FencedNode(node=node, age=now - rec.last_seen, rids=tuple(self.requests_depending_on(node)), cause="exited"), ""

    def next_deadline(self) -> float | None:
        """Earliest ``now`` at which a currently unfenced node would be fenced, or None."""
        times = [rec.last_seen + self.fence_after for rec in self.nodes.values() if not rec.fenced and rec.last_seen is not None]
        return min(times) if times else None

    # -- reporting ------------------------------------------------------------ #

    def live_count(self, now: float) -> int:
        """Nodes that are eligible now (any phase)."""
        if self.clock is not None:
            now = self.clock()
        return sum(1 for rec in self.nodes.values() if self.eligible(rec, now))

    def fenced_count(self) -> int:
        return sum(1 for rec in self.nodes.values() if rec.fenced)

    def snapshot(self, now: float) -> list[dict[str, object]]:
        """One plain dict per node (for ``GET /v1/cluster``), sorted by node id."""
        if self.clock is not None:
            now = self.clock()
        out: list[dict[str, object]] = []
        for rec in sorted(self.nodes.values(), key=lambda r: r.node):
            st = rec.state
            out.append(
                {
                    "node": rec.node,
                    "phase": rec.phase,
                    "split_phase": rec.split_phase,
                    "reported_phase": st.phase if st else None,
                    "eligible": self.eligible(rec, now),
                    "fenced": self.is_stale(rec, now) and st is not None,
                    "fence_events": rec.fence_events,
                    "state_age_s": None if rec.last_seen is None else round(now - rec.last_seen, 4),
                    "accepting": st.accepting if st else None,
                    "epoch": st.epoch if st else None,
                    "engine": st.engine if st else None,
                    "running": st.running if st else None,
                    "waiting": st.waiting if st else None,
                    "decoding": st.decoding if st else None,
                    "queue_len": len(st.queue) if st else None,
                    "gpu_free_blocks": st.gpu_free_blocks if st else None,
                    "gpu_total_blocks": st.gpu_total_blocks if st else None,
                    "host_used_blocks": st.host_used_blocks if st else None,
                    "host_total_blocks": st.host_total_blocks if st else None,
                    "inflight": rec.inflight,
                    "inflight_prefill": rec.inflight_prefill,
                    "inflight_decode": rec.inflight_decode,
                }
            )
        return out
