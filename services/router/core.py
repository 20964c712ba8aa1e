"""RouterCore: place a request (prefill node, decode node) and say what to publish.

This file contains zero I/O: no asyncio, no NATS, no clock reads, no logging
setup; every call takes ``now``. Its twin ``service.py`` contains zero routing
logic: it decodes HTTP and NATS input, calls this core, and publishes the
messages the core returns.

One call places one request::

    core = RouterCore(make_policy("cache-aware"), block_size=64, fence_after=3.0)
    core.apply_state(node_state, now)            # from node.state.<node>
    core.apply_split(split_command)              # from split.commands / split.get
    out = core.route(RouteRequest(...), lookup, now)
    if isinstance(out, NoRoute): answer 503 with out.reason
    else: publish out.placed on route.placed, out.work on work.<out.prefill.node>.prefill
    bind = core.bind_decode(rid, now)            # route.bind (decode_binding="prefill-start")
    core.requeue(rid, now); core.route(...)      # work.requeue of a prefill: forget, route again
    core.on_first_token(rid, now, first_token_at=chunk.ts, queue_s=chunk.queue_s)   # first chunk
    core.finish(rid, now)                        # last chunk, failure or abort
    for f in core.check_fences(now): fail f.rids  # periodic, see next_deadline()
    core.forget_left(now, forget_after)          # nodes gone for good: records dropped
    core.apply_models(planner_models, now)       # from planner.models
    core.end_branch(branch_id, now)              # POST /v1/branches/{id}/end

The policy learns everything through its hooks (``RoutingPolicy.on_*``), which
this core calls; ``core.metrics`` accumulates the TTFT prediction error and
the per-node queue time at each first token.

The discrete-event simulator drives the same object in virtual time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

from shared.messages import KvLookupReply, NodeState, PlannerModels, PrefillWork, RequestAbort, RoutePlaced, RouteSent, SplitCommand
from shared.subjects import check_token
from shared.values import FACTORY, FrozenValue, StructValue, set_field

DECODE_BINDINGS: tuple[str, ...] = ("dispatch", "prefill-start")
"""When the decode node of a PD request is chosen: at dispatch (``PrefillWork.decode_node``),
or when its prefill starts on the prefill node (``route.bind``, paper Eq. 7 / App. D.1)."""

from services.router.faults import usable_lookup
from services.router.metrics import RouteMetrics, TtftSample
from services.router.nodes import DECODE_PHASES, NO_SUCH_NODE, PREFILL_PHASES, FencedNode, NodeLoad, NodeLoadView, kv_blocks
from services.router.policy import DecodeChoice, PrefillChoice, RouteRequest, RoutingPolicy

_PHASE = attrgetter("phase")
"""A :class:`NodeLoad`'s phase (read in C by :meth:`RouterCore.route`'s check for prefill-only nodes)."""


class NoRoute(FrozenValue):
    """No placement is possible now (HTTP 503); ``reason`` says why."""

    reason: str

    __slots__ = __match_args__ = ("reason",)

    def __init__(self, reason: str) -> None:
        set_field(self, "reason", reason)


class DecodeBinding(FrozenValue):
    """A decode node chosen after dispatch (:meth:`RouterCore.bind_decode`).

    Attributes:
        decode: the policy's choice (with the loads it compared).
        prefill_node: the request's prefill node.
        placed: ``RoutePlaced`` for the decode placement (empty without a branch).
    """

    decode: DecodeChoice
    prefill_node: str
    placed: list[RoutePlaced]

    __slots__ = __match_args__ = ("decode", "prefill_node", "placed")

    def __init__(self, decode: DecodeChoice, prefill_node: str, placed: Any = FACTORY) -> None:
        set_field(self, "decode", decode)
        set_field(self, "prefill_node", prefill_node)
        set_field(self, "placed", [] if placed is FACTORY else placed)

    @property
    def node(self) -> str:
        return self.decode.node


class RouteDecision(StructValue):
    """A placement and the messages that carry it.

    Attributes:
        prefill: the policy's prefill choice (with its diagnostics).
        decode: the decode binding; None when the prefill node is collocated (phase ``both``).
        placed: ``RoutePlaced`` for the prefill placement, then (PD) the decode
            placement; empty for a request without a branch (``route.placed``
            says "branch β placed on node n", DESIGN §3: a request outside any
            branch references no blocks later and must not pin any).
        work: the ``PrefillWork`` to send on ``work.<prefill.node>.prefill``.
        candidates: prefill candidates the policy saw (node-load view).
        decode_candidates: decode candidates (empty when collocated).

    Read-only once built (the caller sends and logs it). Not ``frozen=True`` (nothing
    hashes it; its list made it unhashable anyway): one is built per request, and a frozen
    dataclass's ``__init__`` (``object.__setattr__`` per field) costs ~3x this one.
    """

    prefill: PrefillChoice
    decode: DecodeChoice | None
    placed: list[RoutePlaced]
    work: PrefillWork
    candidates: Sequence[NodeLoad] = ()
    decode_candidates: Sequence[NodeLoad] = ()

    @property
    def decode_node(self) -> str | None:
        return self.decode.node if self.decode is not None else None

    @property
    def predicted_ttft_s(self) -> float | None:
        """The policy's predicted TTFT (s from the decision), if it predicts one."""
        return self.prefill.predicted_ttft_s


class RouterCore:
    """Routing core: node view + policy + placement bookkeeping.

    Args:
        policy: the prefill policy (and decode rule), see ``policy.make_policy``.
        block_size: tokens per KV block; must equal the directory's and the engines'.
        fence_after: state age (same unit as ``now``) after which a node is fenced.
        decode_binding: ``dispatch`` (the decode node is chosen in :meth:`route`) or
            ``prefill-start`` (a request placed on a prefill node goes out with
            ``decode_binding="start"`` and no decode node; the worker asks
            :meth:`bind_decode` when its prefill starts). Collocated placements
            are unaffected.
        keep_metrics: accumulate :attr:`metrics` at every first token (the live router exports
            them); False leaves them empty (the simulator, which reads the samples
            :meth:`on_first_token` returns and never the metrics).
        state_clock: the clock on which node states' arrival and ages are read (``NodeLoadView``'s
            ``clock``: the live router's monotonic ``SimClock.local_now``, so a step of the wall
            clock does not fence every node); None (the simulator): each call's ``now``.
        state_wall_per_s: wall s per second of ``state_clock`` (the live router's ``1 / speedup``): a fenced
            node's reason gives its ages in wall s (``NodeLoadView``'s ``wall_per_s``); None: in its unit.

    Raises:
        ValueError: if ``block_size`` < 1, ``fence_after`` <= 0 or an unknown ``decode_binding``.
    """

    def __init__(
        self,
        policy: RoutingPolicy,
        *,
        block_size: int = 64,
        fence_after: float = 3.0,
        decode_binding: str = "dispatch",
        keep_metrics: bool = True,
        state_clock: Callable[[], float] | None = None,
        state_wall_per_s: float | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if decode_binding not in DECODE_BINDINGS:
            raise ValueError(f"decode_binding must be one of {DECODE_BINDINGS}, got {decode_binding!r}")
        self.decode_binding = decode_binding
        self._unbound: dict[str, RouteRequest] = {}
        """rid → request, dispatched to a prefill node with its decode node still to bind."""
        self.policy = policy
        self._on_state = policy.state_hook()
        """``policy.on_state`` or what it forwards to (:meth:`RoutingPolicy.state_hook`): called per applied state."""
        self.block_size = block_size
        self.view = NodeLoadView(fence_after=fence_after, clock=state_clock, wall_per_s=state_wall_per_s)
        self.metrics = RouteMetrics()
        self.keep_metrics = keep_metrics
        self._routed: dict[str, tuple[str, float, float | None]] = {}
        """rid → (prefill node, decision time, predicted TTFT) until its first token."""

    # -- inputs ---------------------------------------------------------- #

    def apply_state(self, state: NodeState, now: float) -> bool:
        """See :meth:`NodeLoadView.apply_state` (True = node let back in); the policy sees the state too, unless the
        view skipped it (a superseded process's, :attr:`NodeLoadView.superseded_states`)."""
        view = self.view
        skipped = view.superseded_states
        back = view.apply_state(state, now)
        if view.superseded_states == skipped:
            self._on_state(state, now)
        return back

    def apply_models(self, msg: PlannerModels, now: float) -> int:
        """The planner's fitted models: handed to the policy (returns nodes whose models changed)."""
        return self.policy.on_models(msg, now)

    def end_branch(self, branch_id: str, now: float) -> None:
        """The harness ended ``branch_id`` (the policy may drop its affinity)."""
        self.policy.on_branch_end(branch_id, now)

    def apply_split(self, cmd: SplitCommand) -> bool:
        """See :meth:`NodeLoadView.apply_split` (False = stale epoch, ignored)."""
        return self.view.apply_split(cmd)

    # -- routing ----------------------------------------------------------- #

    def route(self, req: RouteRequest, lookup: KvLookupReply | None, now: float) -> RouteDecision | NoRoute:
        """Place ``req``: choose prefill node (policy) and decode node (least loaded).

        Nodes the view cannot count on (fenced: :meth:`NodeLoadView.usable`) are removed
        from ``lookup`` first (:func:`~services.router.faults.usable_lookup`).

        When no decode node is eligible, only collocated nodes (phase ``both``)
        are offered to the policy. On success the request is counted in flight
        on both nodes until :meth:`finish`.

        Only nodes whose GPU KV memory holds the request are candidates (:meth:`_room`): a node
        that reports less than its footprint would refuse it (before, a request that fit only the
        largest node was placed on a smaller one and failed there). When no eligible node of a needed
        phase holds it, :class:`NoRoute` names the sizes (the live router waits, then 503s, as for no
        eligible node); a request no node of the cluster holds is the caller's to refuse (the live
        router's 400) and is placed as before.

        Returns:
            :class:`RouteDecision`, or :class:`NoRoute` with the reason.

        Raises:
            ValueError: if ``req.rid`` is already in flight or ``req.prompt_tokens`` < 1.
        """
        if req.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        view = self.view
        pre = view.candidates(PREFILL_PHASES, now)  # view.prefill_candidates / decode_candidates, without their frames
        if not pre:
            return NoRoute(view.no_candidate_reason("prefill", now))
        dec = view.candidates(DECODE_PHASES, now)
        # with no decode node only collocated ones: pre itself when it lists no prefill-only node (a C-level scan)
        offered = pre if dec or "prefill" not in map(_PHASE, pre) else [n for n in pre if n.phase == "both"]
        need = self._room(req)
        if need and offered:  # some node is too small for it: offer only those that hold it
            pneed = kv_blocks(req.prompt_tokens, 0, self.block_size)  # a prefill node that hands the decode on
            small = [n for n in pre if 0 < n.gpu_total_blocks < (pneed if n.phase == "prefill" else need)]
            small += [n for n in dec if 0 < n.gpu_total_blocks < need]
            if small:
                out = {n.node for n in small}
                pre = [n for n in pre if n.node not in out]
                dec = [n for n in dec if n.node not in out]
                offered = pre if dec else [n for n in pre if n.phase == "both"]
                if not offered:
                    return NoRoute(self._no_room_reason("prefill" if not pre else "decode", req, small, now))
        if not offered:
            return NoRoute(self.view.no_candidate_reason("decode", now))
        # no prefix credit and no fetch source on a fenced node (issue #22)
        if not self.view.all_usable(now):
            lookup = usable_lookup(lookup, lambda n: self.view.usable(n, now))
        choice = self.policy.choose_prefill(req, lookup, offered, now)
        node = choice.node
        for chosen in offered:
            if chosen.node == node:
                break
        else:  # pragma: no cover - a policy chooses among the offered nodes
            raise ValueError(f"policy chose {node!r}, not a candidate")
        phase = chosen.phase
        decode: DecodeChoice | None = None
        dnode: str | None = None
        late = phase != "both" and self.decode_binding == "prefill-start"
        if phase != "both" and not late:
            decode = self.policy.choose_decode(req, dec, now)
            if decode is None:  # pragma: no cover - dec is non-empty here
                return NoRoute(self.view.no_candidate_reason("decode", now))
            dnode = decode.node
        rid = req.rid
        self.view.on_dispatch(rid, node, dnode)
        self.policy.on_dispatch(req, choice, dnode, now)
        self._routed[rid] = (node, now, choice.predicted_ttft_s)
        if late:
            self._unbound[rid] = req
        # the work and the placements share one list: the request's own when it is a list
        # (nothing downstream changes it: the worker and the directory copy what they keep)
        hashes = req.block_hashes if type(req.block_hashes) is list else list(req.block_hashes)
        placed: list[RoutePlaced] = []
        branch = req.branch_id
        if branch is not None:
            placed.append(RoutePlaced(rid=rid, branch_id=branch, node=node, phase=phase, block_hashes=hashes, ts=now))
            if dnode is not None:
                placed.append(RoutePlaced(rid=rid, branch_id=branch, node=dnode, phase="decode", block_hashes=hashes, ts=now))
        epoch = self.view.epoch
        work = PrefillWork(
            rid=rid,
            prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens,
            block_size=self.block_size,
            block_hashes=hashes,
            token_ids=req.token_ids,
            branch_id=branch,
            decode_node=dnode,
            sent_at=now,
            epoch=epoch if epoch > 0 else 0,
            fetch=list(choice.fetch),
            decode_binding="start" if late else "dispatch",
            ignore_eos=req.ignore_eos,
            sampling=req.sampling,
        )
        return RouteDecision(choice, decode, placed, work, tuple(offered), tuple(dec) if decode is not None else ())

    def bind_decode(
        self,
        rid: str,
        now: float,
        *,
        req: RouteRequest | None = None,
        exclude: str | None = None,
        prefill_node: str | None = None,
        node: str | None = None,
    ) -> DecodeBinding | NoRoute:
        """Choose the decode node of in-flight ``rid`` now (paper Eq. 7, Alg. E.3 l.13: the
        decode node with KV room and the fewest requests, at prefill start).

        Two uses: the first binding of a request routed with ``decode_binding="start"``
        (``route.bind`` from its prefill node when the prefill starts), and a new
        binding after a decode node handed a request back (``work.requeue``; pass
        ``req`` rebuilt from its ``DecodeWork`` and ``exclude`` = that node). The view
        and the policy (``on_decode_bound``) move the request to the new node.
        ``prefill_node``: the asker; refused unless it is the request's prefill node
        (a stale ask after the request was re-routed). O(N log N) + ``choose_decode``.
        ``node``: bind to this node instead of asking the policy (the simulator's
        fallback when no decode node is eligible at a prefill start that cannot wait);
        it must be known to the view and not the prefill node, else ``ValueError``.
        The policy still sees the binding (``on_decode_bound``); a first binding that comes after
        the request's first token (its prefill node parked it, its first token already sent) is
        followed by the policy's ``on_first_token`` again, as the hand-off follows at once.

        Returns:
            :class:`DecodeBinding`, or :class:`NoRoute` when ``rid`` is not in flight,
            was bound already (first use), is placed on another prefill node, or no
            decode node is eligible now.
        """
        placement = self.view.placement(rid)
        if placement is None:
            return NoRoute(f"request {rid} is not in flight")
        if prefill_node is not None and placement[0] != prefill_node:
            return NoRoute(f"request {rid} is placed on {placement[0]}, not {prefill_node}")
        first = req is None
        if req is None:
            req = self._unbound.get(rid)
            if req is None:
                return NoRoute(f"request {rid} has no decode binding pending")
        prefill = placement[0]
        if node is not None:
            if node == prefill or node not in self.view.nodes:
                raise ValueError(f"cannot bind {rid} to decode node {node!r}: it is the prefill node or has never reported")
            choice: DecodeChoice | None = DecodeChoice(node=node)
        else:
            cands = [n for n in self.view.decode_candidates(now) if n.node != prefill and n.node != exclude]
            need = self._room(req) if cands else 0
            if need:  # only decode nodes whose GPU KV memory holds it (see route)
                small = [n for n in cands if 0 < n.gpu_total_blocks < need]
                if small:
                    cands = [n for n in cands if not 0 < n.gpu_total_blocks < need]
                    if not cands:
                        return NoRoute(self._no_room_reason("decode", req, small, now))
            choice = self.policy.choose_decode(req, cands, now) if cands else None
        if choice is None:
            return NoRoute(self.view.no_candidate_reason("decode", now))
        self._unbound.pop(rid, None)
        self.view.rebind(rid, choice.node)
        self.policy.on_decode_bound(req, choice.node, now)
        if first and self.view.first_token_seen(rid):
            # its prefill ended before this binding (the prefill node parked it, its first token sent
            # at once): its hand-off follows now, so the policy hears again that the prefill's part is
            # over (the ttft policy frees the decode KV it reserved; the decode node's state shows it)
            self.policy.on_first_token(rid, now)
        placed: list[RoutePlaced] = []
        if req.branch_id is not None:
            placed.append(
                RoutePlaced(rid=rid, branch_id=req.branch_id, node=choice.node, phase="decode", block_hashes=list(req.block_hashes), ts=now)
            )
        return DecodeBinding(choice, prefill, placed)

    def _room(self, req: RouteRequest) -> int:
        """The KV blocks ``req`` takes on a node that decodes it (:func:`~services.router.nodes.kv_blocks` of
        prompt + ``max_tokens``) when placement must look at node sizes: some node reports GPU KV memory
        (``NodeState.gpu_total_blocks``) smaller than that and another one holds it; else 0 (every node
        holds it, or none does: then the caller refuses it, the live router's 400, or the node does).
        O(1) while no node reports a new capacity (:meth:`NodeLoadView.kv_bounds`)."""
        need = -(-(req.prompt_tokens + req.max_tokens) // self.block_size)  # kv_blocks(prompt, max_tokens, block size), inline
        smallest, largest = self.view.kv_bounds()
        return need if smallest < need <= largest else 0

    def _no_room_reason(self, role: str, req: RouteRequest, small: Sequence[NodeLoad], now: float) -> str:
        """Why no eligible ``role`` (prefill|decode) node can take ``req``: the eligible ones are too small
        for its KV (``small``: each with its GPU KV memory in blocks), then why the others are not eligible."""
        need = kv_blocks(req.prompt_tokens, req.max_tokens, self.block_size)
        sizes = ", ".join(f"{n.node} {n.gpu_total_blocks}" for n in small[:8]) + (f" and {len(small) - 8} more" if len(small) > 8 else "")
        why = self.view.no_candidate_reason(role, now)
        return (
            f"no live {role} node can hold the request's KV ({need} blocks of {self.block_size} tokens for {req.prompt_tokens} "
            f"prompt + {req.max_tokens} max_tokens; GPU KV blocks of the live nodes too small for it: {sizes})"
            + ("" if why.endswith(NO_SUCH_NODE) else f"; the others: {why}")
        )

    def requeue(self, rid: str, now: float) -> bool:
        """A prefill node handed ``rid`` back before starting it (phase switch): forget its
        placement (view, policy, pending binding) so that :meth:`route` can place it again
        with the same rid. Returns False if ``rid`` is not in flight. O(1) (+ the policy)."""
        self._routed.pop(rid, None)
        self._unbound.pop(rid, None)
        if self.view.on_finish(rid) is None:
            return False
        self.policy.on_finish(rid, now)
        return True

    def pending_binding(self, rid: str) -> bool:
        """True while ``rid`` waits for :meth:`bind_decode` (dispatched with ``decode_binding="start"``)."""
        return rid in self._unbound

    # -- request lifecycle --------------------------------------------------- #

    def on_first_token(
        self, rid: str, now: float | None = None, *, first_token_at: float | None = None, queue_s: float | None = None
    ) -> TtftSample | None:
        """First chunk of ``rid`` arrived (its prefill finished); idempotent.

        Args:
            now: arrival time of the chunk (router clock); used as the first-token
                time when ``first_token_at`` is not given.
            first_token_at: the worker's time of the first token (``TokenChunk.ts``, > 0).
            queue_s: the chunk's ``queue_s`` (time queued on the prefill node).

        Returns:
            The sample accounted in :attr:`metrics` (predicted vs measured TTFT,
            queue time), or None if ``rid`` is unknown or already had its first token.
        """
        self.view.on_first_token(rid)
        info = self._routed.pop(rid, None)
        if info is None:
            return None
        node, decided_at, predicted = info
        at = first_token_at if first_token_at else now
        measured = at - decided_at if at is not None else None
        sample = TtftSample(rid, node, predicted, measured, queue_s)  # positional: one per request
        if self.keep_metrics:
            self.metrics.observe(sample)
        self.policy.on_first_token(rid, at if at is not None else decided_at)
        return sample

    def finish(self, rid: str, now: float | None = None) -> tuple[str, str | None] | None:
        """``rid`` is over (finished, failed); returns its placement or None if unknown."""
        self._routed.pop(rid, None)
        self._unbound.pop(rid, None)
        placement = self.view.on_finish(rid)
        if placement is not None:
            self.policy.on_finish(rid, now if now is not None else 0.0)
        return placement

    def abort(self, rid: str, reason: str, *, skip: str | None = None, now: float | None = None) -> list[tuple[str, RequestAbort]]:
        """Forget ``rid`` and return the ``RequestAbort`` for each node it was on.

        Args:
            skip: a node not to notify (e.g. the one that reported the error).

        Returns:
            ``[(node, RequestAbort), ...]`` in placement order (prefill, decode);
            empty if ``rid`` is not in flight.
        """
        self._routed.pop(rid, None)
        self._unbound.pop(rid, None)
        placement = self.view.on_finish(rid)
        if placement is None:
            return []
        self.policy.on_finish(rid, now if now is not None else 0.0)
        return [(n, RequestAbort(rid=rid, reason=reason)) for n in placement if n is not None and n != skip]

    # -- other routers' sends (router replicas) ------------------------------ #

    def remote_dispatch(self, msg: RouteSent, now: float, *, first_token: bool = False) -> bool:
        """Count another router's placement in the view and the policy (issue #22): its
        request loads ``msg.prefill_node`` until its first token and ``msg.decode_node`` until
        its end, like this router's own. A rid already counted (a re-dispatch, a decode
        binding) replaces its placement. ``first_token``: this attempt's first token was seen
        already (``RemoteSends.first_token``, or the owner's ``RouteSent.first_token`` for a router that
        started after that token: a decode node bound after it, the prefill node having
        sent a parked request's first token first): the prefill's part is over at once, as in
        :meth:`bind_decode` for this router's own (no prefill load, no decode room reserved).
        Returns False for an unusable node id. O(1) + policy."""
        try:
            check_token(msg.prefill_node, "node")
            if msg.decode_node is not None:
                check_token(msg.decode_node, "node")
        except ValueError:
            return False
        if self.view.placement(msg.rid) is not None:
            self.view.on_finish(msg.rid)
            self.policy.on_finish(msg.rid, now)
        req = RouteRequest(rid=msg.rid, prompt_tokens=max(1, msg.prompt_tokens), max_tokens=max(1, msg.max_tokens))
        self.view.on_dispatch(msg.rid, msg.prefill_node, msg.decode_node)
        self.policy.on_dispatch(req, PrefillChoice(node=msg.prefill_node, path="remote"), msg.decode_node, now)
        if first_token:
            self.remote_first_token(msg.rid, now)
        return True

    def remote_first_token(self, rid: str, now: float) -> None:
        """Another router's request produced its first token: its prefill node is free of it."""
        self.view.on_first_token(rid)
        self.policy.on_first_token(rid, now)

    # -- fencing -------------------------------------------------------------- #

    def check_fences(self, now: float, hold: Callable[[str], bool] | None = None) -> list[FencedNode]:
        """Fence silent nodes (those ``hold`` returns True for are left unfenced this call); see
        :meth:`NodeLoadView.check_fences`."""
        return self.view.check_fences(now, hold)

    def fence_exited(
        self, node: str, exited_ns: int, now: float, *, pid: int = 0, wall_ns: int | None = None
    ) -> tuple[FencedNode | None, str]:
        """Fence ``node`` now, its process ``pid`` seen to exit (``node.down``); see :meth:`NodeLoadView.fence_exited`."""
        return self.view.fence_exited(node, exited_ns, now, pid=pid, wall_ns=wall_ns)

    def forget_left(self, now: float, forget_after: float) -> list[str]:
        """Forget nodes that have left for good and hold no request (:meth:`NodeLoadView.forget_left`), in the
        view, the policy (:meth:`RoutingPolicy.on_node_gone`) and the queue-time metrics; returns their ids,
        sorted. O(nodes)."""
        gone = self.view.forget_left(now, forget_after)
        for node in gone:
            self.policy.on_node_gone(node, now)
            self.metrics.queue.pop(node, None)
        return gone

    def next_deadline(self) -> float | None:
        """When :meth:`check_fences` should be called next (None: no node known), on the
        ``state_clock`` when one was given, else in the unit of ``now``."""
        return self.view.next_deadline()
