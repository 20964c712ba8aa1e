"""Planner core: the cluster's PD split, its epochs, and the planner policy that changes it.

Contains zero I/O: no asyncio, no clock, no network (STYLE §2.1). The shell
(``service.py``) decodes messages, calls these methods with ``now`` (simulated
s), and publishes what they return or what the outboxes hold:

* ``add_records`` / ``on_node_state`` / ``on_token_chunk`` / ``on_split_applied``
  feed the policy (``policy.py``: ``static``, ``evolving``, ``dynamo``, ``arrow``);
* ``tick(now)`` at ``next_tick()`` → a new :class:`SplitCommand` (new epoch) when
  the policy changes the phases;
* ``set_split`` is the operator's override (``split.set``), laid over the live nodes first;
  a phase left on dead nodes only is swapped with a live node at the next ``tick`` (one live
  node left there: it serves ``both`` until each phase of the split before has a node back, the outage rule), and a
  policy's switch that would leave one so is applied with that swap made (``silent_after``;
  "Splits and dead nodes" in ``README.md``);
* adoption (``adopt_until``): a (re)started planner first observes the node states
  and takes over the split the cluster serves (:meth:`PlannerCore.tick` returns it)
  instead of announcing its configured one; see "Restart" in ``README.md``;
* ``take_decisions()`` → every :class:`PlannerDecision` (``planner.decisions``);
* ``take_models()`` → :class:`PlannerModels` when they changed (``planner.models``).

Per-request completions (w̄ of paper §5.2) come from the ``req.<rid>.out.<node>``
token streams the workers already publish (:class:`RequestTracker`): the first
chunk carries the prompt and cached tokens and the prefill node, the last one
the output count and the decode node. No new subject is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import msgspec

from shared.messages import (
    IterationRecord,
    IterationRecords,
    NodeState,
    Phase,
    PlannerDecision,
    PlannerModels,
    SplitApplied,
    SplitCommand,
    TokenChunk,
    boot_older,
)
from shared.profile import Profile
from shared.split import SplitError, parse_split, split_name, split_phases
from shared.subjects import check_token
from shared.validate import MAX_EPOCH_STEP, split_problem
from services.planner.online import OnlineModels
from services.planner.policy import PlannerPolicy, PolicyBase, RequestDone, StaticPlanner


class RequestTracker:
    """Turns token streams into :class:`RequestDone` records (sans-IO).

    Args:
        max_inflight: requests tracked at once; beyond it the oldest is dropped
            (a stream whose end was lost must not grow memory forever).
    """

    def __init__(self, max_inflight: int = 200_000) -> None:
        self.max_inflight = max_inflight
        self._open: OrderedDict[str, tuple[str, int, int, float, float]] = OrderedDict()
        """rid → (prefill node, prompt tokens, cached tokens, first-token time, queue_s)."""
        self.completed = 0
        self.dropped = 0
        """Streams forgotten (overflow) or ended by abort/error."""

    def on_chunk(self, c: TokenChunk, now: float) -> RequestDone | None:
        """Consume one chunk; returns the request when ``c`` finishes it normally. O(1)."""
        at = c.ts or now
        if c.index == 0 and c.prompt_tokens > 0 and c.rid not in self._open:
            self._open[c.rid] = (c.node, c.prompt_tokens, c.cached_tokens, at, float(c.queue_s or 0.0))
            if len(self._open) > self.max_inflight:
                self._open.popitem(last=False)
                self.dropped += 1
        if not c.finished:
            return None
        entry = self._open.pop(c.rid, None)
        if entry is None:
            return None
        if c.error or c.finish_reason in ("abort", "error"):
            self.dropped += 1
            return None
        node, prompt, cached, first_at, queue_s = entry
        arrived = first_at - queue_s
        self.completed += 1
        return RequestDone(
            rid=c.rid,
            prefill_node=node,
            decode_node=c.node,
            prompt_tokens=prompt,
            cached_tokens=cached,
            output_tokens=c.index + len(c.token_ids),
            arrived_at=arrived,
            ttft_s=queue_s,
            e2e_s=max(0.0, at - arrived),
        )

    def __len__(self) -> int:
        return len(self._open)


class PlannerCore:
    """The split with its epoch, the policy, the records history and the switch bookkeeping.

    Args:
        nodes: node ids in cluster order (the order ``xPyD`` specs are applied in).
        split: initial split spec, ``collocated`` or ``xPyD``.
        history: iteration records kept per node (oldest dropped first).
        policy: the planner policy (default: ``static``).
        busy_timeout_s: a node that has not confirmed a phase change (``split.applied``
            status ``serving``) within this long stops counting as busy.
        online: per-node models refitted from the iteration records for the router
            (``online.OnlineModels``), used when the policy publishes no models of its own
            (``static``, ``dynamo``, ``arrow``): :meth:`take_models` returns its refits.
        adopt_until: when given (simulated s), the core starts *adopting*: until then, or
            until every node has reported a state and none is draining, it only observes
            (no policy tick, no ``split.get`` answer, ``split set`` refused: the service holds
            both until the adoption has ended); then
            :meth:`tick` returns the split the nodes serve under the epoch they hold
            (:meth:`_take_cluster`), or — no node holds a split (a fresh cluster) — the
            configured ``split`` at epoch 1. None: the configured split is current at once.
        silent_after: a node whose last ``node.state`` is older than this (s, the clock of ``now``),
            or that never sent one, is *silent*: an operator's :meth:`set_split` lays its phases over
            the live nodes first (:meth:`_place`), and :meth:`tick` swaps a phase left on dead nodes
            only (:meth:`_rescue`), in the current split or in a policy's switch (:meth:`_dead_swap`).
            None: no liveness, splits go by position, nothing is swapped.
        wall_per_s: wall seconds per second of ``now`` (``1 / speedup``), for the silences a
            refusal names (in wall s, as ``--silent-after-s``).

    Raises:
        ValueError / SplitError: on an invalid node id or a split that does not fit the nodes.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        split: str = "collocated",
        *,
        history: int = 100_000,
        policy: PlannerPolicy | None = None,
        busy_timeout_s: float = 900.0,
        online: OnlineModels | None = None,
        adopt_until: float | None = None,
        silent_after: float | None = None,
        wall_per_s: float = 1.0,
        boot: str = "",
    ) -> None:
        if not nodes:
            raise ValueError("the planner needs at least one node")
        self.nodes = [check_token(n, "node") for n in nodes]
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"duplicate node ids in {list(nodes)}")
        self.history = history
        self.records: dict[str, deque[IterationRecord]] = {n: deque(maxlen=history) for n in self.nodes}
        self.records_total = 0
        self.records_unknown_node = 0
        self.states_unknown_node = 0
        self.command = SplitCommand(epoch=1, phases=split_phases(split, self.nodes), reason="initial", decided_at=0.0)
        self.policy: PlannerPolicy = policy or StaticPlanner(self.nodes, _no_profile())
        self.tracker = RequestTracker()
        self.busy_timeout_s = busy_timeout_s
        self.pending: dict[str, tuple[int, float]] = {}
        """node → (epoch that changed its phase, when) until it reports ``serving`` at that epoch."""
        self.draining: set[str] = set()
        self._decisions: list[PlannerDecision] = []
        self._models_seen = -1
        self.online = online if getattr(self.policy, "models_version", None) is None else None
        self._online_last: PlannerModels | None = None
        self.ticks = 0
        self.switches = 0
        self.foreign_commands = 0
        """Split commands seen on the bus that this planner did not issue."""
        self.boot = boot
        """This planner process's incarnation (``SplitCommand.boot``; empty: not known, never superseded)."""
        self.superseded_by: str | None = None
        """The boot of a planner that started later, once a command of its was heard: this one must stop."""
        self.adopt_until = adopt_until
        """Simulated s until which a (re)started core observes before it announces (None: not adopting)."""
        if adopt_until is None:
            self._fresh_start()
        self.silent_after = silent_after
        self.wall_per_s = wall_per_s
        self._rescue_checked = -float("inf")
        """``now`` of the last :meth:`_rescue` check (:meth:`_rescue_at` asks for none at or before it)."""
        self.outage: tuple[int, dict[str, Phase], float, tuple[str, ...]] | None = None
        """The outage split in force, or None: (its epoch, the phases it replaced, when (``now``), the dead
        nodes). A phase was left on dead nodes only with one live node to take it, which serves ``both``
        (:meth:`_dead_swap`); :meth:`_rescue` issues the replaced phases again once each has a node back
        (:meth:`_settled`), unless a later command replaced it (then it is forgotten)."""
        self._adopted_outage = ""
        """The ``--split`` spec whose phases :attr:`outage` holds when the core took the outage split over at its start
        (:meth:`_adopt_outage`), else empty (the command's reason says so)."""
        self._stirred = -float("inf")
        """``now`` of the latest state that may let a node take a phase or a split come back: a node's first state,
        its first after a gap of half of ``silent_after`` or more, or the one its run of states reaches
        ``silent_after`` with (:meth:`_back`, :meth:`_settled`, :meth:`_witness`); other states change neither."""
        self.heard: dict[str, float] = {}
        """node → when (``now``) its latest ``node.state`` arrived: who is live (:meth:`_place`)."""
        self.steady: set[str] = set()
        """Nodes whose latest state came less than ``silent_after`` after the one before: only these
        take a dead phase (:meth:`_rescue`). After a stall of the planner's bus every node's first
        state is a comeback, so the first nodes back cannot take the phase of those a moment behind."""
        self.since: dict[str, float] = {}
        """node → when (``now``) its current run of states began (its first, or its first after a silence
        of ``silent_after`` or more): a taker's run must have begun before the dead phase went silent
        (:meth:`_rescue`), or a node back first after a stall longer than ``silent_after`` (of the bus,
        or of the planner's loop: its backlog is read at one ``now``) and steady by its second state
        would take the phase of nodes a moment behind."""
        self.reports: dict[str, tuple[int, Phase, bool]] = {}
        """node → (epoch, phase, accepting) of its latest ``node.state``: what the cluster serves."""
        self.adoptions = 0
        """Times the core took over the split the nodes serve (at start, or later: :meth:`on_node_state`)."""
        self.states_epoch_ahead = 0
        """Node states above the planner's epoch after the start: counted; only a majority of the nodes moves it."""
        self._late = False
        """A strict majority of the nodes reported epochs above the planner's: adopt at the next :meth:`tick`."""
        self._unsure: set[str] = set()
        """Nodes whose adopted entry is a guess: adopted while draining (the phase they drain to is not in
        a state: their entry is the phase they still served) or silent during the adoption (their entry is
        the planner's ``--split`` phase, not necessarily the one they serve); each is replaced by the phase
        the node reports once serving, until the next command."""
        self._echo: list[SplitCommand] = []
        """The last commands this core replaced (at most ``2N + 8``): their announcements still on the
        bus come back as this planner's own, not as foreign commands — a correction (:meth:`_refine`)
        under the same epoch, or a command that came right after another (a ``split set`` held
        during the adoption, answered as it ends)."""

    @property
    def split(self) -> str:
        """Current split as ``xPyD`` or ``collocated``."""
        return split_name(self.command.phases)

    # -- inputs --------------------------------------------------------------- #

    def add_records(self, msg: IterationRecords, now: float = 0.0) -> int:
        """Store a worker's iteration records and feed them to the policy; returns how many
        were kept (0 for an unknown node)."""
        store = self.records.get(msg.node)
        if store is None:
            self.records_unknown_node += 1
            return 0
        store.extend(msg.records)
        self.records_total += len(msg.records)
        self.policy.on_iterations(msg.node, msg.records, now)
        if self.online is not None:
            self.online.add(msg.node, msg.records)
        return len(msg.records)

    def on_node_state(self, state: NodeState, now: float) -> bool:
        """Feed a node state to the policy and keep it as the node's report (its epoch, phase,
        draining); False (counted) for an unknown node. O(1), O(N) when above the planner's epoch.

        A state's epoch never moves the planner's epoch by itself (any node can put any number
        there): above the planner's epoch it is counted (``states_epoch_ahead``), and only when a
        strict majority of the nodes report epochs above it does the next :meth:`tick` adopt the
        cluster's split (:meth:`_take_cluster`): the planner's commands were ignored by those nodes
        (they refuse epochs at or below their own), e.g. its start-up grace ended before they were
        back on the bus. A node adopted while draining, or silent during the adoption, gets the
        phase it reports once serving (:meth:`_refine`)."""
        node = state.node
        if node not in self.records:
            self.states_unknown_node += 1
            return False
        if not state.accepting:
            self.draining.add(node)
        else:
            self.draining.discard(node)
        self.reports[node] = (state.epoch, state.phase, state.accepting)
        prev = self.heard.get(node)
        if self.silent_after is not None:
            if prev is not None and now - prev < self.silent_after:
                self.steady.add(node)
            else:
                self.steady.discard(node)
                self.since[node] = now
            start, after = self.since[node], self.silent_after
            if prev is None or now - prev >= after / 2 or prev - start < after - 1e-9 <= now - start:
                self._stirred = now
        self.heard[node] = now
        if self.adopt_until is None:
            if node in self._unsure and state.accepting:
                self._unsure.discard(node)
                self._refine(node, state.phase)
            if state.epoch > self.command.epoch:
                self.states_epoch_ahead += 1
                ahead = sum(1 for e, _, _ in self.reports.values() if e > self.command.epoch)
                self._late = 2 * ahead > len(self.nodes)
        self.policy.on_node_state(state, now)
        return True

    def _refine(self, node: str, phase: Phase) -> None:
        """An adopted node that was draining, or did not report during the adoption, now serves
        ``phase``: the adopted command (not yet followed by one of this planner's) says so, under
        the same epoch, if still a valid split. The routers apply a command at their epoch (they
        exclude a node whose reported phase differs from the split's), so the service announces
        the corrected command at once."""
        if self.command.phases.get(node) == phase:
            return
        phases = {**self.command.phases, node: phase}
        if split_problem(phases, self.nodes) is None:
            self._replace(msgspec.structs.replace(self.command, phases=phases))

    def _replace(self, cmd: SplitCommand) -> None:
        """Make ``cmd`` the current command; the one it replaces is kept in ``_echo``, and the outage split
        (:attr:`outage`) is forgotten (:meth:`_rescue` sets it again when ``cmd`` is one). O(N)."""
        self._echo = [*self._echo[-(2 * len(self.nodes) + 7) :], self.command]
        self.command = cmd
        self.outage = None
        self._adopted_outage = ""

    def on_token_chunk(self, chunk: TokenChunk, now: float) -> RequestDone | None:
        """Feed a token chunk; a finished request goes to the policy and is returned."""
        done = self.tracker.on_chunk(chunk, now)
        if done is not None:
            self.policy.on_request_done(done, now)
        return done

    def on_split_applied(self, msg: SplitApplied, now: float) -> None:
        """Switch progress: ``serving`` at (or after) the epoch that changed the node ends its busy period."""
        if msg.node not in self.records:
            return
        if msg.status == "draining":
            self.draining.add(msg.node)
            return
        self.draining.discard(msg.node)
        pend = self.pending.get(msg.node)
        if pend is not None and msg.epoch >= pend[0]:
            del self.pending[msg.node]
            self.policy.on_switch_done(msg.node, msg.phase, now)

    def busy(self, now: float, dead: set[str] | None = None) -> set[str]:
        """Nodes draining or still switching to a phase a command gave them (timed out after ``busy_timeout_s``),
        the policies' reason not to plan (dynamo restarts its adjustment interval, the evolving planner skips
        its window). A *dead* node (heard, then silent for ``silent_after`` or more) is none of them: it is not
        switching, and it never confirms (a phase a liveness swap or a split laid over the live nodes gave it)
        nor ends its drain (``draining`` has no timeout), so it held every policy back for ``busy_timeout_s``,
        or for good. It stays pending: busy again once it reports, until it serves. Dead needs a witness, as
        the liveness swap's takers (:meth:`_dead_swap`): a live, ``steady`` node whose run of states began
        before the node went silent. When every node is silent at once (a stall of the planner's bus or loop,
        a step of its clock) nothing is known and nobody is left out; before, a node still draining or
        switching then stopped holding the policies back (dynamo switched mid-stall on stale states).
        ``dead``: :meth:`dead` at ``now`` when the caller has it (:meth:`tick`), else computed here. O(N)."""
        for n, (_, since) in list(self.pending.items()):
            if now - since > self.busy_timeout_s:
                del self.pending[n]
        out = set(self.pending) | self.draining
        if out:
            out -= self.dead(now) if dead is None else dead
        return out

    def dead(self, now: float) -> set[str]:
        """Nodes heard, then silent for ``silent_after`` or more, with a witness: a live, ``steady`` node whose
        run of states began before the node went silent (as the liveness swap's takers, :meth:`_dead_swap`).
        When every node is silent at once (a stall of the planner's bus or loop, a step of its clock) nothing
        is known: none is dead. A node never heard is not dead (unknown). Empty without liveness
        (``silent_after`` None). What :meth:`busy` leaves out and the policy is told before each tick (its
        ``on_liveness``: it values the live nodes' capacity only). O(N)."""
        if self.silent_after is None:
            return set()
        heard, after = self.heard, self.silent_after
        witnesses = [m for m in self.steady if m in heard and now - heard[m] < after]
        if not witnesses:
            return set()
        return {n for n in self.nodes if n in heard and now - heard[n] >= after and any(self._witness(m, heard[n] + after) for m in witnesses)}

    # -- decisions ------------------------------------------------------------ #

    @property
    def adopting(self) -> bool:
        """True while the (re)started core observes the nodes before it announces a split."""
        return self.adopt_until is not None

    def adopt_due(self) -> bool:
        """True when the next :meth:`tick` adopts at once: every node reported during the
        start-up grace and none is draining, or a majority of nodes is above the planner's epoch."""
        if self.adopt_until is None:
            return self._late
        return len(self.reports) == len(self.nodes) and all(acc for _, _, acc in self.reports.values())

    def next_tick(self) -> float | None:
        """When :meth:`tick` is due (simulated s): while adopting, the grace's end (0 once
        :meth:`adopt_due`); else when the policy wants it, or None."""
        if self.adopt_due():
            return 0.0
        if self.adopt_until is not None:
            return self.adopt_until
        nxt = self.policy.next_tick()
        due = self._rescue_at()
        return due if nxt is None or (due is not None and due < nxt) else nxt

    def tick(self, now: float) -> SplitCommand | None:
        """Run the policy; a new command (epoch + 1) when it changes the phases (a phase its switch would
        leave on dead nodes only swapped onto a live node first: :meth:`_dead_swap`, the policy told by its
        ``on_placed``). First, a phase of the current split left on dead nodes only is swapped
        (:meth:`_rescue`: that command, and no policy tick). While adopting:
        None until the grace ends (or :meth:`adopt_due`), then the command to announce (the
        adopted split, or the configured one in a fresh cluster); the policy runs from the next tick."""
        if self.adopt_until is not None:
            if now < self.adopt_until and not self.adopt_due():
                return None
            self.adopt_until = None
            return self._take_cluster(now, start=True) or self._fresh_start()
        if self._late:
            self._late = False
            cmd = self._take_cluster(now, start=False)
            if cmd is not None:
                return cmd
        cmd = self._rescue(now)
        if cmd is not None:
            return cmd
        self.ticks += 1
        dead = self.dead(now)  # once: the policy is told it, and busy leaves it out
        liveness = getattr(self.policy, "on_liveness", None)
        if liveness is not None:  # the policy values the live nodes' capacity only
            liveness(frozenset(dead), now)
        d = self.policy.tick(now, dict(self.command.phases), frozenset(self.busy(now, dead)))
        cmd = None
        placed = ""
        if d is not None and dict(d.phases) != dict(self.command.phases):
            if set(d.phases) != set(self.nodes):
                raise ValueError(f"policy {self.policy.name} returned phases for {sorted(d.phases)}, nodes are {self.nodes}")
            phases: dict[str, Phase] = dict(d.phases)
            swap = self._dead_swap(phases, now, self.command.phases)
            wanted = phases
            if swap is not None:  # the policy placed a phase on dead nodes only: laid over the live ones, one switch
                phases, why, dead_nodes = swap
                placed = f"laid over the live nodes: {why}"
                hook = getattr(self.policy, "on_placed", None)
                if hook is not None:
                    hook(dict(phases), now)
            if phases != dict(self.command.phases):
                cmd = self._adopt(phases, now, f"{d.reason} ({placed})" if placed else d.reason)
                if swap is not None and any(ph == "both" and wanted[n] != "both" for n, ph in phases.items()):
                    self.outage = (cmd.epoch, wanted, now, dead_nodes)  # the policy's split, once its nodes are back
            elif placed:  # laid over the live nodes, the policy's switch is the split served: nothing switches
                placed += ": the split served"
        take_note = getattr(self.policy, "take_split_note", None)
        note = take_note() if take_note is not None else None
        if cmd is None and note and note != self.command.reason:
            # same phases, same epoch, a truer reason (a warm-up extended): split.get answers it and the next
            # announcement carries it to the routers; nothing switches, no split change is counted
            self.command = msgspec.structs.replace(self.command, reason=note)
        self._collect_decisions(placed, switched=cmd is not None)
        return cmd

    def set_split(self, spec: str, now: float, reason: str = "operator") -> SplitCommand:
        """Adopt a new split spec under a new epoch and return its command (the operator's
        ``split set``); the decision is recorded like any other. The phases go by position
        (the first ``x`` nodes prefill) over the live nodes first (:meth:`_place`): a silent
        node (no ``node.state`` within ``silent_after``) gets no phase a live node could take.

        Raises:
            SplitError: if the spec does not fit the node list, or a phase could only go to
                silent nodes (one live node left for an ``xPyD``): the reason names them.
            ValueError: while adopting (the split the nodes serve is not known yet: a split
                set now would be issued below their epoch, and ignored).
        """
        if self.adopt_until is not None:
            raise ValueError(
                f"the planner is starting: it is reading the split the nodes serve (until t={self.adopt_until:.1f} s "
                "or every node has reported); try again in a few seconds"
            )
        before = dict(self.command.phases)
        phases, placed = self._place(spec, now)
        cmd = self._adopt(phases, now, f"{reason} ({placed})" if placed else reason)
        self._decisions.append(
            PlannerDecision(
                seq=0,
                ts=now,
                policy="operator",
                action="switch" if phases != before else "no_switch",
                split_before=split_name(before),
                split_after=split_name(phases),
                epoch=cmd.epoch,
                reason=cmd.reason,
            )
        )
        return cmd

    def _place(self, spec: str, now: float) -> tuple[dict[str, Phase], str]:
        """The phases of ``spec`` for :meth:`set_split`, and a note when silence moved any. O(N).

        A node is live when its latest ``node.state`` is less than ``silent_after`` old at ``now``.
        ``split_phases`` is applied to the node list with the live nodes first, each group in
        cluster order (so the first ``x`` live nodes take prefill); when only ``x`` or fewer
        nodes are live, the last live node goes last (decode), so each phase has a live node.
        With every node live, none live (nothing is known: a planner that has heard no state,
        a stalled bus), ``silent_after`` None or ``collocated``, the phases are the positional
        ones, as before. Deterministic: the same states and ``now`` give the same phases.

        Raises:
            SplitError: as ``split_phases``; or one node live for an ``xPyD``: a phase would
                have only silent nodes (named, with their silence in wall s).
        """
        phases = split_phases(spec, self.nodes)
        if self.silent_after is None:
            return phases, ""
        heard = self.heard
        live = [n for n in self.nodes if n in heard and now - heard[n] < self.silent_after]
        if not live or len(live) == len(self.nodes):
            return phases, ""
        pd = parse_split(spec, len(self.nodes))
        if pd is None:
            return phases, ""
        silent = [n for n in self.nodes if n not in live]
        said = ", ".join(
            f"{n} never reported" if n not in heard else f"{n} silent {(now - heard[n]) * self.wall_per_s:.1f} s" for n in silent
        )
        if len(live) == 1:
            raise SplitError(
                f"split {spec!r} would leave decode only on silent nodes "
                f"(no node.state for more than {self.silent_after * self.wall_per_s:g} s): {said}; only {live[0]} is live. "
                "Start them again, or wait until they report"
            )
        order = [*live, *silent] if len(live) > pd[0] else [*live[:-1], *silent, live[-1]]
        by_order = split_phases(spec, order)
        placed = {n: by_order[n] for n in self.nodes}
        if placed == phases:
            return phases, ""
        return placed, f"laid over the live nodes first: {said}"

    def _rescue_at(self) -> float | None:
        """When (``now``) a phase of the current command may be left on silent nodes only, for
        :meth:`next_tick`: the latest state of the nodes that serve it (its own and the ``both`` ones) +
        ``silent_after``, the earliest over the phases whose nodes have all reported, or when an outage
        split may be undone (:meth:`_restore_at`); None without liveness, or once that time has been
        checked (:meth:`_rescue` ran after it: nothing to do then until a node reports again). O(N)."""
        if self.silent_after is None:
            return None
        at: float | None = None
        for phase in ("prefill", "decode"):
            nodes = [n for n, ph in self.command.phases.items() if ph == phase or ph == "both"]
            if not nodes or any(n not in self.heard for n in nodes):
                continue
            t = max(self.heard[n] for n in nodes) + self.silent_after
            if t <= self._rescue_checked:
                # silent when last checked and no taker then: a node's state may make one (its run of states
                # ``silent_after`` long, :meth:`_witness`)
                t = self._stirred
            if t > self._rescue_checked and (at is None or t < at):
                at = t
        back = self._restore_at()
        if back is not None and (at is None or back < at):
            at = back
        return at

    def _restore_at(self) -> float | None:
        """When to check the outage split (:attr:`outage`) again: the latest state that may let it be undone
        (:attr:`_stirred`: a node's run of states reaching ``silent_after``, a node quiet for half of it reporting
        again, :meth:`_settled`), if that time has not been checked yet; the steady states of nodes back for good
        change nothing and are not checked. None without an outage split in force. O(1)."""
        out = self.outage
        if out is None or out[0] != self.command.epoch:
            return None
        return self._stirred if self._stirred > self._rescue_checked else None

    def _settled(self, phases: dict[str, Phase], now: float) -> bool:
        """Every phase of ``phases`` has a node (its own or a ``both`` one) that is :meth:`_back` and whose latest
        state is less than half of ``silent_after`` old: the nodes a restore relies on are back for good and not
        going quiet. A restore is elective (the outage split serves every phase), so it waits for a node in doubt
        — silent for half of ``silent_after``, not yet dead — rather than give it a phase and, once it is dead,
        switch the survivor again. O(N)."""
        after = self.silent_after
        if after is None:
            return False
        for phase in ("prefill", "decode"):
            if not any(
                (ph == phase or ph == "both") and now - self.heard.get(n, -float("inf")) < after / 2 and self._back((n,), now)
                for n, ph in phases.items()
            ):
                return False
        return True

    def _rescue(self, now: float) -> SplitCommand | None:
        """A new command when a phase of the current one is left on dead nodes only, or when the outage split
        may be undone; else None. O(N).

        The swap is :meth:`_dead_swap`'s over the current phases: with two or more live nodes of the other
        phase, the phase's first node (cluster order) swaps phases with one of them, the first one for
        prefill, the last one for decode (as ``assign_min_change`` takes them): the split (``xPyD``) stays
        as it was; one live node switches. With one live node there (the outage rule: e.g. 1P1D and its
        prefill node dead), that node serves ``both`` phases: the *outage split* (:attr:`outage`), undone —
        the split before it issued again — once each of its phases has a node back for good and heard lately
        (:meth:`_settled`; a node it found dead may never return), or laid over the live nodes as a PD split
        (a swap) whose phases have such nodes, unless a later command (a policy's, an operator's) replaced it. The
        command's reason and a decision (policy ``liveness``) name the silent nodes and the taker; the
        policy is told (its ``on_placed``), as of a switch of its own laid over the live nodes.
        """
        self._rescue_checked = now
        before = dict(self.command.phases)
        outage = self.outage
        if outage is not None and outage[0] != self.command.epoch:
            outage = self.outage = None  # a later command (a policy's, an operator's) replaced the outage split
        swap = self._dead_swap(before, now, before)
        settled = swap is None and outage is not None and self._settled(outage[1], now)
        alt = None if swap is not None or outage is None or settled else self._dead_swap(outage[1], now, before)
        if swap is not None:
            phases, why, dead = swap
            reason = why.replace(" would have been on ", " was left on ", 1)
        elif outage is not None and settled:
            # each phase of the split the outage replaced has a node back for good: that split again, though a
            # node the outage found dead may never return (its phase is served by the others)
            phases, dead = dict(outage[1]), ()
            back = [n for n in outage[3] if self._back((n,), now)]
            still = [n for n in outage[3] if n not in back]
            states = f"{self.silent_after * self.wall_per_s:g} s of states"  # type: ignore[operator]
            if self._adopted_outage:
                reason = (
                    f"{', '.join(back) or 'every phase'} serving again ({states}; an outage split adopted at "
                    f"t={outage[2]:.1f} s): the planner's --split {self._adopted_outage} laid over the live nodes restored"
                )
            else:
                reason = f"{', '.join(back) or 'the live nodes'} serving again ({states}; dead at t={outage[2]:.1f} s): the split before the outage restored"
            reason += f" ({', '.join(still)} still silent)" if still else ""
            self.outage = None
        elif (
            outage is not None
            and alt is not None
            and "both" not in (alt[0][n] for n in self.nodes if outage[1][n] != "both")
            and self._settled(alt[0], now)
        ):
            # the split the outage replaced laid over the live nodes as a PD split (a swap, its split count), each
            # of its phases on a node back for good (not a state or two of a flapping node): the outage split ends
            phases, why, dead = alt
            reason = why.replace(" would have been on ", " was left on ", 1) + " (the outage split ends: a PD split again)"
            self.outage = None
        else:
            return None
        adopted = self._adopted_outage
        cmd = self._adopt(phases, now, reason)
        if swap is not None and any(ph == "both" and before[n] != "both" for n, ph in phases.items()):
            # kept to be undone (the outage split); a swap that keeps a PD split is a split like any other
            gone = [] if outage is None else [n for n in outage[3] if n not in self.heard or now - self.heard[n] >= self.silent_after]  # type: ignore[operator]
            if not gone:  # a new outage (or one on an outage split whose dead nodes are all live again)
                self.outage = (cmd.epoch, before if outage is None else outage[1], now, dead)
            else:  # an outage on an outage split: the first split comes back once its phases have nodes back
                self.outage = (cmd.epoch, outage[1], outage[2], tuple(dict.fromkeys((*gone, *dead))))  # type: ignore[index]
            if outage is not None:  # its replaced split still the one adopted at the start (the reason says so)
                self._adopted_outage = adopted
        hook = getattr(self.policy, "on_placed", None)
        if hook is not None:  # the planner's own change, not an operator's (the evolving planner logged 'externally')
            hook(dict(phases), now)
        self._decisions.append(
            PlannerDecision(seq=0, ts=now, policy="liveness", action="switch", split_before=split_name(before),
                            split_after=split_name(phases), epoch=cmd.epoch, reason=reason)  # fmt: skip
        )
        return cmd

    def _back(self, nodes: Sequence[str], now: float) -> bool:
        """Every one of ``nodes`` live (a state within ``silent_after``), ``steady``, and its run of states
        ``silent_after`` long or more (its latest state that long after the run's first): back for good, not a
        state or two of a flapping node. O(k)."""
        after = self.silent_after
        if after is None:
            return False
        heard, since = self.heard, self.since
        return all(n in heard and now - heard[n] < after and n in self.steady and heard[n] - since[n] >= after - 1e-9 for n in nodes)

    def _witness(self, n: str, went_silent: float) -> bool:
        """Whether the ``steady`` node ``n`` may take the phase of nodes (or count them dead) that went silent at
        ``went_silent`` (their latest state + ``silent_after``): its run of states began before then, or has lasted
        ``silent_after`` (a node back alone after every node went silent: the others are dead by then, not a moment
        behind it after a stall). O(1)."""
        since = self.since[n]
        return since < went_silent or self.heard[n] - since >= self.silent_after - 1e-9  # type: ignore[operator]

    def _dead_swap(
        self, phases: dict[str, Phase], now: float, base: dict[str, Phase]
    ) -> tuple[dict[str, Phase], str, tuple[str, ...]] | None:
        """``phases`` with a phase left on dead nodes only given to a live node, why, and those dead nodes; None
        when no phase is (or no node may take it). ``base``: the phases the nodes serve now. O(N).

        A phase is served by its nodes and the ``both`` ones. Dead: every node that serves it has reported
        and none within ``silent_after`` (a node that never reported, e.g. at a cold start, does not count:
        it may only be late). A taker is a live node of the other phase among the ``steady`` ones (not just
        back from a silence of their own: a stall of the planner's bus silences every node, and the first
        ones back must not take the phase of the others) whose run of states began before the phase went
        silent (``since``: a node back first after a stall longer than ``silent_after`` is steady by its
        second state, 0.05 wall s later when busy, yet was not live when the others fell silent).

        With 2 or more live nodes of the other phase, one of the dead ones swaps phases with a taker (the
        split count stays). Of those pairs, the one that leaves the fewest live nodes switching from
        ``base``, then the fewest nodes: a taker that serves that phase in ``base`` (a policy moved it
        off), else one that serves ``both`` there (an outage split's survivor, :meth:`_rescue`), a dead node that serves the other phase in ``base``; else the dead phase's first node (cluster
        order) and the first taker for prefill, the last one for decode (as ``assign_min_change`` takes
        them). With ``phases`` = ``base`` (:meth:`_rescue`) every pair switches one live node: that order
        decides. With one live node of the other phase (the outage rule), the taker serves ``both`` (the
        dead nodes keep their phases): the smallest change that serves every phase again.
        Deterministic: the same states and ``now`` give the same phases.
        """
        if self.silent_after is None:
            return None
        heard = self.heard

        def live(n: str) -> bool:
            return n in heard and now - heard[n] < self.silent_after  # type: ignore[operator]

        pairs: tuple[tuple[Phase, Phase], ...] = (("prefill", "decode"), ("decode", "prefill"))
        for phase, other in pairs:
            mine = [n for n in self.nodes if phases[n] == phase or phases[n] == "both"]
            if not mine or any(n not in heard or live(n) for n in mine):
                continue
            theirs = [n for n in self.nodes if phases[n] == other and live(n)]
            went_silent = max(heard[n] for n in mine) + self.silent_after
            takers = [n for n in theirs if n in self.steady and self._witness(n, went_silent)]
            if not takers:
                return None
            silence = ", ".join(f"{n} silent {(now - heard[n]) * self.wall_per_s:.1f} s" for n in mine)
            out = dict(phases)
            if len(theirs) < 2:
                taker = takers[0]
                out[taker] = "both"
                return out, f"{phase} would have been on silent nodes only ({silence}): {taker} serves both phases until they are back", tuple(mine)
            if phase == "decode":
                takers.reverse()
            taker = next((n for n in takers if base.get(n) == phase), next((n for n in takers if base.get(n) == "both"), takers[0]))
            dead = next((n for n in mine if base.get(n) == other), mine[0])
            out[dead], out[taker] = other, phase
            return out, f"{phase} would have been on silent nodes only ({silence}): {taker} takes it from {dead}", tuple(mine)
        return None

    def on_foreign_command(self, cmd: SplitCommand, now: float, max_step: int) -> SplitCommand | None:
        """A split command on the bus that is not this planner's current one.

        The planner alone issues epochs: a command it did not issue whose epoch is at
        least its own (nodes and router adopted it, or would) is answered by re-issuing
        the planner's phases under ``cmd.epoch + 1``, so the forged split lasts one
        round trip and every later command (policy or operator ``split set``) is newer
        than it. An older foreign command is stale everywhere and only counted; one
        more than ``max_step`` above the planner's epoch was refused by every receiver
        (``shared.validate.epoch_step_ok``) and is only counted too. One issued by a planner that
        started later (``cmd.boot`` above :attr:`boot`) sets :attr:`superseded_by` (the shell stops
        this planner) and is not answered; an earlier planner's is answered as any, and that
        planner stops when it hears the answer.

        Returns:
            The re-issued command to publish, or None.
        """
        if boot_older(self.boot, cmd.boot):
            # a planner that started later issued it (also the same split): this one was replaced (frozen, restarted,
            # resumed). Re-issuing over a different split would start a war: each answers the other's command one
            # epoch up, and the nodes flip phase each round trip
            self.foreign_commands += 1
            self.superseded_by = cmd.boot
            return None
        if cmd.epoch == self.command.epoch and dict(cmd.phases) == dict(self.command.phases):
            return None  # our own, echoed back
        if any(cmd.epoch == e.epoch and dict(cmd.phases) == dict(e.phases) for e in self._echo):
            return None  # our own, replaced since (_replace), echoed back
        self.foreign_commands += 1
        if self.adopt_until is not None:
            return None  # nothing announced yet: the adoption reads the epoch the nodes hold
        if cmd.epoch < self.command.epoch or cmd.epoch - self.command.epoch > max_step:
            return None
        old = cmd.phases
        self._replace(
            SplitCommand(
                epoch=cmd.epoch + 1,
                phases=dict(self.command.phases),
                reason=f"planner re-issued its split over a foreign command (epoch {cmd.epoch})",
                decided_at=now,
            )
        )
        for n, ph in self.command.phases.items():
            if old.get(n) != ph:
                self.pending[n] = (self.command.epoch, now)
        self._unsure.clear()
        return self.command

    def _fresh_start(self) -> SplitCommand:
        """The first command of a fresh cluster (no node holds a split: the adoption found none, or there is none):
        the configured ``split``'s phases, or the phases the policy starts in when it has ``start_phases``
        (``EvolvingPlanner.start_phases``: with a warm-up every node serves ``both``, and the configured split is
        the one served after it), at epoch 1 (reason ``initial``). ``up``, compose and the Slurm script launch
        the workers in those phases (``evolving_infra.cluster.launch_phases``), so no node switches at the start;
        before, this command was the configured split (2P2D) and the evolving planner's first tick switched every
        node to ``both`` one epoch later: two switches per node of which the demo's split timeline showed 2P2D
        first. A restarted planner that adopts the split the nodes serve (:meth:`_take_cluster`) does not come
        here. O(N).

        Raises:
            RuntimeError: (``start_phases``) when the policy has ticked already (not from here: only before it).
        """
        start = getattr(self.policy, "start_phases", None)
        if callable(start):
            phases: dict[str, Phase] = dict(start(dict(self.command.phases)))
            if phases != dict(self.command.phases):
                self.command = msgspec.structs.replace(self.command, phases=phases)
        return self.command

    def _take_cluster(self, now: float, *, start: bool) -> SplitCommand | None:
        """Take over the split the nodes report; the command to announce, or None.

        The epoch: the highest one a strict majority of the nodes that hold a split
        (epoch > 0) report at or above (their lower median), so a node alone cannot
        move it while others report; capped at ``MAX_EPOCH_STEP − 1`` above the lowest
        reported epoch, so the planner's next command is one every reporting node accepts
        (``shared.validate.epoch_step_ok``) — above 0 while a node has not reported (it may
        hold no split: a node alone on the bus, e.g. one worker up before the others at a cold
        start, cannot put the planner's epoch out of every other node's and router's reach). The
        phases: each node's reported phase (a draining node's: the one it still serves — or
        ``both`` if that leaves no prefill or no decode node); a node that did not report keeps
        the planner's entry; both corrected once the node reports serving (:meth:`on_node_state`).
        Nothing changes on any node: the command carries the epoch they hold, which every
        node at that epoch ignores, and tells a node behind it (or ``split.get``) what
        the others serve. Only if those phases are no split (no prefill or no decode
        node) are the planner's phases issued above that epoch (nodes switch then).

        Returns None when no node holds a split (fresh cluster: the configured split
        stands) or, after the ``start`` (the grace's end), when that epoch is not above the
        planner's. O(N log N).
        """
        held = sorted(e for e, _, _ in self.reports.values() if e > 0)
        if not held:
            return None
        lowest = min(e for e, _, _ in self.reports.values()) if len(self.reports) == len(self.nodes) else 0
        epoch = min(held[(len(held) - 1) // 2], lowest + MAX_EPOCH_STEP - 1)
        if not start and epoch <= self.command.epoch:
            return None
        before = dict(self.command.phases)
        phases: dict[str, Phase] = {n: self.reports[n][1] if n in self.reports else before[n] for n in self.nodes}
        draining = [n for n, (_, _, acc) in self.reports.items() if not acc]
        if draining and split_problem(phases, self.nodes) is not None:
            # the split the nodes were given has a prefill and a decode node, so the missing side is
            # where a draining node goes: `both` until it reports the phase it serves (no node switches)
            phases.update({n: "both" for n in draining})
        why = split_problem(phases, self.nodes)
        self.pending.clear()
        self._unsure = set()
        self.adoptions += 1
        if why is None:
            reason = f"adopted the split the nodes serve at epoch {epoch} ({len(self.reports)} of {len(self.nodes)} nodes reported)"
            self._replace(SplitCommand(epoch=epoch, phases=phases, reason=reason, decided_at=now))
            self._unsure = set(draining) | {n for n in self.nodes if n not in self.reports}
            hook = getattr(self.policy, "on_adopted", None)
            if hook is not None:
                hook(dict(phases), now)
            if start and not draining:
                self._adopt_outage(phases, before, now)
        else:
            reason = f"the nodes' phases at epoch {epoch} are no split ({why}): the planner's split re-issued above it"
            self._replace(SplitCommand(epoch=epoch + 1, phases=before, reason=reason, decided_at=now))
            for n, ph in before.items():
                if phases[n] != ph:
                    self.pending[n] = (self.command.epoch, now)
        self._decisions.append(
            PlannerDecision(
                seq=0,
                ts=now,
                policy=self.policy.name,
                action="adopt",
                split_before=split_name(before),
                split_after=split_name(self.command.phases),
                epoch=self.command.epoch,
                reason=reason,
            )
        )
        return self.command

    def _adopt_outage(self, phases: dict[str, Phase], configured: dict[str, Phase], now: float) -> None:
        """At the start, an adopted split with a ``both`` node beside single-phase ones (none draining) is an outage
        split (no policy or split spec makes one; the planner that issued it kept what it replaced in its memory):
        :attr:`outage` is set, the split it replaced being the ``configured`` one (``--split``) laid over the live
        nodes (:meth:`_place`), so :meth:`_rescue` restores it as its own. Nothing when ``configured`` is no PD split
        (``collocated``: it says nothing of the split before the outage) or ``silent_after`` is None. O(N)."""
        if self.silent_after is None or "both" in configured.values():
            return
        if "both" not in phases.values() or all(ph == "both" for ph in phases.values()):
            return
        spec = split_name(configured)
        try:
            replaced = self._place(spec, now)[0]
        except SplitError:  # one node live: --split by position (the restore waits for a node per phase)
            replaced = dict(configured)
        if replaced == phases:
            return
        silent = tuple(n for n in self.nodes if n not in self.heard or now - self.heard[n] >= self.silent_after)
        self.outage = (self.command.epoch, replaced, now, silent)
        self._adopted_outage = spec

    def _adopt(self, phases: dict[str, Phase], now: float, reason: str) -> SplitCommand:
        old = self.command.phases
        self._replace(SplitCommand(epoch=self.command.epoch + 1, phases=dict(phases), reason=reason, decided_at=now))
        for n, ph in phases.items():
            if old.get(n) != ph:
                self.pending[n] = (self.command.epoch, now)
        self.switches += 1
        self._unsure.clear()
        return self.command

    def _collect_decisions(self, placed: str = "", *, switched: bool = True) -> None:
        """The policy's decisions, under the current epoch; ``placed`` (the core laid the policy's switch over
        the live nodes, :meth:`tick`) is added to its switch's reason, as to the command's. Not ``switched``
        (laid over the live nodes, the switch was the split served: no command), that decision is a
        ``no_switch`` (before, it read ``switch`` 2P2D -> 2P2D under the current epoch, a switch that never was)."""
        take = getattr(self.policy, "take_decisions", None)
        if take is None:
            return
        for ev in take():
            if placed and ev.action == "switch":
                ev = msgspec.structs.replace(ev, reason=f"{ev.reason} ({placed})")
                if not switched:
                    ev = msgspec.structs.replace(ev, action="no_switch", split_after=ev.split_before)
            self._decisions.append(msgspec.structs.replace(ev, epoch=self.command.epoch))

    def take_decisions(self) -> list[PlannerDecision]:
        """Drain every decision since the last call (policy evaluations and operator commands)."""
        out, self._decisions = self._decisions, []
        return out

    def take_models(self, now: float | None = None) -> PlannerModels | None:
        """The policy's models if they changed since the last call (evolving), else — for a
        policy without models and ``now`` given — the online refit when one is due, else None."""
        version = getattr(self.policy, "models_version", None)
        if version is None and self.online is not None and now is not None:
            msg = self.online.refit(now)
            if msg is not None:
                self._online_last = msg
            return msg
        if version is None or version == self._models_seen:
            return None
        self._models_seen = version
        return self.policy.models()  # type: ignore[attr-defined]

    def current_models(self) -> PlannerModels | None:
        """The policy's models now (for re-announcement), or None when it has none."""
        if self._online_last is not None:
            return self._online_last
        if not isinstance(self.policy, PolicyBase):
            return None
        m = self.policy.models()
        return m if isinstance(m, PlannerModels) else None


def _no_profile() -> Profile:  # pragma: no cover - trivial
    """A static planner needs no profile; give it the tiny one so the type is complete."""
    from shared.profile import load_profile

    return load_profile("tiny")
