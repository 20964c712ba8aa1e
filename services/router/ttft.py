"""TTFT predictor (paper Eq. 3 and 7, Alg. E.3 inner loop) and the ``ttft`` routing policy.

This module contains zero I/O: no asyncio, no NATS, no clock reads, no
logging. Every call takes ``now`` (simulated seconds on the cluster clock;
the discrete-event simulator passes virtual time).

For a request r and every prefill candidate n the predictor computes

    T̂_n = Ŵ_n + T_P^req(w_n) + max(0, τ(x_n) − Ŵ_n) + κ·x_n

* **work on n** (Alg. E.3 l.6–7) from the KV directory's lookup, by the rule
  of :func:`services.kvdirectory.lookup.fetch_plan` (inlined in the loop over
  candidates for speed and property-tested equal to it; the chosen node's
  ranges come from its :func:`~services.kvdirectory.lookup.fetch_ranges`):
  ``t_c,n`` = longest prefix
  cached on n *or anywhere* (``longest_any``), ``x_n`` = its tokens that only
  other nodes hold, ``t_uc,n = t_in − t_c,n``. Two engine rules are applied on
  top: at most ``(t_in − 1) // bs`` blocks come from cache (at least one token
  is computed, the worker's and vLLM's rule), and a fetch shorter than
  ``fetch.min_tokens`` (512) is not made: those tokens are recomputed
  (``τ = 0``, ``x_n = 0``, ``t_c,n`` = the local prefix). Tokens to restore
  from host memory: ``t_rst = t_c,n − (prefix in n's L1)`` (L2 hits and
  fetched blocks are loaded into L1 at admission).
* **wait Ŵ_n**: the remaining time of n's iteration in flight (``remaining_s``
  of its last :class:`~shared.messages.NodeState`, aged by the state's age)
  plus the replay of n's queue. The queue is the state's ``queue`` (arrival
  order) followed by the requests this router sent to n that no state of n has
  listed yet (de-duplicated by rid: a send is "reported" once a state of n
  lists its rid, and is forgotten at its first token).
* **replay** (Alg. E.3: "replaying the chunked prefill iterations of n in
  arrival order, which also accounts for requests that share an iteration"):
  queue items are packed FCFS into iterations of ``budget`` tokens
  (``chunk_tokens`` = 8,192, minus ``ceil(t_fwd)`` per decoding request on a
  collocated node); an item's chunk in an iteration adds its tokens to Σt_uc,
  ``A(chunk, cached before the chunk)`` to ΣA and, in its first iteration, its
  restore tokens to Σt_rst; each iteration lasts Eq. 1 (``+ T_D(B) − min(c0,
  d0)`` with B decoding requests on a collocated node, one forward pass).
  Summed over one request's chunks this is exactly Eq. 3 with its real packing
  in place of the averages: ``c0·(iterations) + c1·t_uc + c2·A(t_uc, t_c) +
  c3·t_rst`` (ΣA over the chunks equals ``A(t_uc, t_c)``), i.e. Eq. 3 with
  ``t̄_n = t_uc / ceil(t_uc / budget)`` and ``f_n·t_c = t_rst``; when requests
  share an iteration they share its ``c0``, which Eq. 3's ``t_uc/t̄_n``
  approximates on average.
* **shared first iteration**: the queue's last iteration is usually not full.
  If the request's fetch is done by the time that iteration starts
  (``τ(x_n) ≤ Ŵ_share``), the request's first chunk joins it: Ŵ_n is the start
  of that iteration and T_P^req(w_n) runs from there to the end of the
  request's last chunk (so it includes the queue tail's tokens in the shared
  iteration — the first token cannot come before that iteration ends).
  Otherwise the request cannot join an iteration that launches before its KV
  has arrived: Ŵ_n is the end of the whole queue, T_P^req(w_n) is the request
  computed alone and the exposed fetch is ``max(0, τ(x_n) − Ŵ_n)``.
* **stale state** (older than ``state_max_age_s`` = 5 s by its ``ts``; the live
  router's is 5 wall s x ``--speedup``, as workers publish on wall-clock timers): not
  trusted. The node is then treated as unknown: its reported queue and
  remaining time are ignored and the wait is the replay of every request this
  router sent to n that has not produced its first token (reported or not),
  from their dispatch-time work — the router's own record. An idle node whose
  last heartbeat is old is therefore still predicted idle, and a node the
  router keeps loading is still charged for that load. A node that never
  reported is treated the same way.
* **choice**: argmin of T̂_n; candidates within ``tie_eps_s`` of the minimum
  are ties → the node with the longest prefix of r in its own memory
  (``local_blocks``), then the smallest node id.
* **known error sources**: a request arriving later that joins r's last
  iteration (FCFS fills its leftover budget) lengthens it — at most one
  iteration, and no prediction made at r's arrival can know it; the engine's
  ``max_running`` cap and KV-admission stalls are not replayed.

The predicted TTFT carried in the decision is ``Ŵ + T_P^req + exposed fetch``
(seconds from the decision to the end of the request's prefill; the first
decode iteration is left out, it is the same on every prefill node); the copy
price ``κ·x_n`` only enters the score.

Coefficients per node come from the planner's fitted models
(:class:`~shared.messages.PlannerModels` on ``planner.models``) once one
names the node, and from the profile until then.

Cost per decision with N candidates: O(N) for the pruned search's bounds, O(S)
per scored candidate (S = fetch ranges in the lookup, usually 1–3): each node's
queue replay is cached; a new state or new coefficients replay the queue when
they arrive (O(queue), a few operations per item: FCFS packing fills every
iteration but the last, so the replay is closed-form, see :func:`replay_queue`),
and a dispatch or a first token adds or takes out one item of the cached fold
(integer sums, so the result is the replay's to the bit), whose O(1) replay is
then made by the first decision that reads the node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Any, NamedTuple, overload

from shared.itermodel import DecodeModel, PrefillModel
from shared.messages import FetchRange, KvLookupReply, NodeState, PlannerModels, QueuedWork
from shared.profile import Profile
from shared.values import FrozenValue, StructValue, set_field

from services.kvdirectory.lookup import fetch_ranges
from services.router.nodes import NodeLoad
from services.router.policy import DecodeChoice, PrefillChoice, RouteRequest, RoutingPolicy, decode_load


# --------------------------------------------------------------------------- #
# parameters
# --------------------------------------------------------------------------- #


class FetchModel(FrozenValue):
    """τ(x): time to fetch ``x`` tokens of KV from peers (paper App. E.3).

    ``τ(x) = base_s + per_token_s·x`` for ``x ≥ min_tokens``; below
    ``min_tokens`` no fetch is made (τ = 0; the tokens are recomputed).
    Paper values: 0.45 s, 1 µs/token, 512 tokens.

    Raises:
        ValueError: on a negative parameter.
    """

    base_s: float
    per_token_s: float
    min_tokens: int

    __slots__ = __match_args__ = ("base_s", "per_token_s", "min_tokens")

    def __init__(self, base_s: float = 0.45, per_token_s: float = 1e-6, min_tokens: int = 512) -> None:
        set_field(self, "base_s", base_s)
        set_field(self, "per_token_s", per_token_s)
        set_field(self, "min_tokens", min_tokens)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.per_token_s < 0 or self.min_tokens < 0:
            raise ValueError(f"fetch model parameters must be >= 0, got {self}")

    def time(self, tokens: int) -> float:
        """τ(tokens) in seconds (0 below ``min_tokens``)."""
        if tokens <= 0 or tokens < self.min_tokens:
            return 0.0
        return self.base_s + self.per_token_s * tokens


class NodeCoefficients(FrozenValue):
    """Iteration-time models one node is predicted with.

    Attributes:
        prefill: Eq. 1 coefficients.
        decode: Eq. 2 model (used for the decode part of a collocated node's iterations).
        chunk_tokens: token budget of one prefill iteration (8,192).
        source: ``profile`` (the router's ``--profile``) or ``planner-<source>``
            (from ``planner.models``: ``planner-fitted``, ``planner-peer``,
            ``planner-profile``).
        mean_chunk_tokens: t̄_n as last published by the planner (informational;
            the replay uses the real packing).
        restored_share: f_n as last published (informational; the replay uses
            each request's restore tokens).
    """

    prefill: PrefillModel
    decode: DecodeModel
    chunk_tokens: int
    source: str
    mean_chunk_tokens: float
    restored_share: float

    __slots__ = __match_args__ = ("prefill", "decode", "chunk_tokens", "source", "mean_chunk_tokens", "restored_share")

    def __init__(
        self, prefill: PrefillModel, decode: DecodeModel, chunk_tokens: int = 8192, source: str = "profile",
        mean_chunk_tokens: float = 0.0, restored_share: float = 0.0,
    ) -> None:
        set_field(self, "prefill", prefill)
        set_field(self, "decode", decode)
        set_field(self, "chunk_tokens", chunk_tokens)
        set_field(self, "source", source)
        set_field(self, "mean_chunk_tokens", mean_chunk_tokens)
        set_field(self, "restored_share", restored_share)

    @classmethod
    def from_profile(cls, profile: Profile, chunk_tokens: int = 0) -> NodeCoefficients:
        """Coefficients of a profile; ``chunk_tokens`` > 0 overrides the profile's budget."""
        return cls(
            prefill=profile.prefill,
            decode=profile.decode,
            chunk_tokens=chunk_tokens or profile.scheduler.chunk_tokens,
            source="profile",
        )

    def decode_part(self, decoding: int) -> tuple[int, float]:
        """``(budget, extra_s)`` of an iteration with ``decoding`` decode requests:
        prefill budget left (>= 1 token) and the time the decode part adds
        (``T_D(B) − min(c0, d0)``, one forward pass; 0 when B = 0)."""
        if decoding <= 0:
            return self.chunk_tokens, 0.0
        per = max(1, math.ceil(self.decode.tokens_per_forward))
        budget = max(1, self.chunk_tokens - decoding * per)
        extra = self.decode.iteration_time(decoding) - min(self.prefill.c0, self.decode.d0)
        return budget, max(0.0, extra)


# --------------------------------------------------------------------------- #
# results
# --------------------------------------------------------------------------- #


class CandidateEstimate(NamedTuple):
    """Predicted TTFT of a request on one prefill node, with its breakdown (s, tokens)."""

    node: str
    score_s: float
    """What the argmin compares: ``ttft_s + copy_s``."""
    ttft_s: float
    """Predicted time from the decision to the end of the prefill: wait + prefill + exposed fetch."""
    wait_s: float
    """Ŵ_n: until the request's first chunk starts."""
    prefill_s: float
    """T_P^req(w_n): from that start to the end of its last chunk's iteration."""
    fetch_s: float
    """τ(x_n) (0 when no fetch)."""
    exposed_fetch_s: float
    """max(0, τ(x_n) − Ŵ_n)."""
    copy_s: float
    """κ·x_n."""
    uncached_tokens: int
    cached_tokens: int
    """t_c,n after the engine's cap (and without a fetch below the threshold)."""
    local_tokens: int
    """Prefix in n's own memory (L1 ∪ L2), tokens."""
    fetch_tokens: int
    """x_n (0 below the fetch threshold)."""
    restore_tokens: int
    queue_items: int
    """Queue items replayed (reported + unreported sends, or router-tracked when untrusted)."""
    trusted: bool
    """The node's state was fresh enough to use."""
    shared: bool
    """The first chunk shares an iteration with the queue tail."""

    def as_dict(self) -> dict[str, Any]:
        """Rounded fields for a log line (ms precision for times)."""
        return {
            "score_s": round(self.score_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "wait_s": round(self.wait_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "fetch_s": round(self.fetch_s, 6),
            "exposed_fetch_s": round(self.exposed_fetch_s, 6),
            "copy_s": round(self.copy_s, 6),
            "t_uc": self.uncached_tokens,
            "t_c": self.cached_tokens,
            "local": self.local_tokens,
            "x": self.fetch_tokens,
            "t_rst": self.restore_tokens,
            "queue": self.queue_items,
            "trusted": self.trusted,
            "shared": self.shared,
        }


class CandidateEstimates(Sequence[CandidateEstimate]):
    """The per-candidate estimates of one decision (a read-only sequence).

    The hot loop makes plain tuples; each :class:`CandidateEstimate` is built
    when it is read (the debug log, tests), not for every candidate of every
    decision. The tuples are a snapshot: later state changes do not alter them.
    """

    __slots__ = ("_raw",)

    def __init__(self, raw: Sequence[tuple[Any, ...]]) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw)

    @overload
    def __getitem__(self, i: int) -> CandidateEstimate: ...

    @overload
    def __getitem__(self, i: slice) -> list[CandidateEstimate]: ...

    def __getitem__(self, i: int | slice) -> CandidateEstimate | list[CandidateEstimate]:
        if isinstance(i, slice):
            return [CandidateEstimate._make(r) for r in self._raw[i]]
        return CandidateEstimate._make(self._raw[i])

    def __iter__(self) -> Iterator[CandidateEstimate]:
        return map(CandidateEstimate._make, self._raw)

    def find(self, node: str) -> CandidateEstimate | None:
        """The estimate of ``node`` (None when it was not a candidate); builds only that one."""
        r = self.find_raw(node)
        return None if r is None else CandidateEstimate._make(r)

    def find_raw(self, node: str) -> tuple[Any, ...] | None:
        """:meth:`find` as the plain tuple (:class:`CandidateEstimate` field order), building nothing."""
        for r in self._raw:
            if r[0] == node:
                return r
        return None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CandidateEstimates):
            return list(self._raw) == list(other._raw)
        return NotImplemented

    def __repr__(self) -> str:
        return f"CandidateEstimates({list(self)!r})"


class Prediction(NamedTuple):
    """Outcome of :meth:`TtftPredictor.predict` (a named tuple: built once per decision).

    Attributes:
        best: the chosen candidate's estimate.
        estimates: every candidate's estimate, in candidate order.
        ties: how many candidates were within ``tie_eps_s`` of the minimum score.
        fetch: fetch ranges for ``best`` (block ranges of the path, clipped to
            its cached prefix); empty when ``best.fetch_tokens == 0``.
        longest_local_blocks: the longest prefix of the path any node of the
            lookup holds in its own memory (L1 ∪ L2), blocks; 0 without a lookup
            or when nothing is cached.
    """

    best: CandidateEstimate
    estimates: CandidateEstimates
    ties: int = 1
    fetch: tuple[FetchRange, ...] = ()
    longest_local_blocks: int = 0


# --------------------------------------------------------------------------- #
# per-node bookkeeping
# --------------------------------------------------------------------------- #


class QueueReplay(NamedTuple):
    """Replay of a queue, times relative to the end of the iteration in flight."""

    t_open: float
    """Start of the last (not full) iteration, or of the next fresh one when ``used == 0``."""
    used: int
    """Tokens already in that iteration."""
    sum_uc: float
    sum_qk: float
    sum_rst: float
    items: int
    budget: int
    extra_s: float
    """Decode part added to every iteration (collocated node)."""


def replay_queue(items: Iterable[QueuedWork], coef: NodeCoefficients, decoding: int = 0) -> QueueReplay:
    """Pack queue items FCFS into chunked-prefill iterations (Eq. 1 per iteration).

    Args:
        items: queued work in arrival order (``uncached_tokens`` still to compute,
            ``cached_tokens`` already cached or computed, ``restore_tokens`` to load).
        coef: the node's coefficients.
        decoding: decode requests sharing every iteration (collocated node).

    Returns:
        The replay summary: start of the open (last, not full) iteration
        relative to the start of the replay, its content, and the item count.

    FCFS packing fills every iteration to ``budget`` tokens but the last, so the
    replay is closed-form: Q queued tokens make ``Q // budget`` full iterations
    and an open one holding the queue's last ``Q % budget`` tokens. The full
    iterations take ``(Q // budget)·fixed + c1·(Q − open) + c2·(ΣA − A_open) +
    c3·(Σt_rst − t_rst,open)``, where an item's chunks sum to its whole A
    (``A(k, cb) = k·cb + k·(k+1)/2`` is additive over consecutive chunks) and its
    restore tokens load with its first chunk. Cost: O(len(items)), a few
    operations per item, plus a walk back over the items in the open iteration.
    The sums are integers (``k·(k+1)`` is even), so a fold extended or shrunk by
    one item (:class:`_QueueFold`) gives exactly this replay.
    """
    return _QueueFold(items).replay(coef, decoding)


class _QueueFold:
    """The sums :func:`replay_queue` folds a queue into (tokens, ΣA, restore tokens; all
    integers) and its live items (``uncached_tokens > 0``) in order. An item appended
    or removed updates the sums exactly, so :meth:`replay` then equals a replay of the
    changed queue from scratch (what a dispatch or a first token changes, without
    re-folding the whole queue)."""

    __slots__ = ("live", "q_tok", "a_all", "r_all")

    def __init__(self, items: Iterable[QueuedWork]) -> None:
        live: list[QueuedWork] = []
        self.live = live
        q_tok = a_all = r_all = 0
        for it in items:
            k = it.uncached_tokens
            if k <= 0:
                continue
            live.append(it)
            q_tok += k
            a_all += k * it.cached_tokens + k * (k + 1) // 2
            r_all += it.restore_tokens
        self.q_tok, self.a_all, self.r_all = q_tok, a_all, r_all

    def append(self, it: QueuedWork) -> bool:
        """Add ``it`` at the end of the queue; False (nothing changes) when it has no uncached tokens."""
        k = it.uncached_tokens
        if k <= 0:
            return False
        self.live.append(it)
        self.q_tok += k
        self.a_all += k * it.cached_tokens + k * (k + 1) // 2
        self.r_all += it.restore_tokens
        return True

    def remove(self, it: QueuedWork) -> bool:
        """Take the item ``it`` (this very object) out; False when it is not in the fold."""
        live = self.live
        for i in range(len(live) - 1, -1, -1):  # sends sit at the end of the queue
            if live[i] is it:
                del live[i]
                k = it.uncached_tokens
                self.q_tok -= k
                self.a_all -= k * it.cached_tokens + k * (k + 1) // 2
                self.r_all -= it.restore_tokens
                return True
        return False

    def replay(self, coef: NodeCoefficients, decoding: int = 0) -> QueueReplay:
        """The replay of the folded queue with ``coef`` (see :func:`replay_queue`)."""
        budget, extra = coef.decode_part(decoding)
        t_open, used, qk, rst = self.open_iteration(coef.prefill, budget, extra)
        return QueueReplay(t_open, used, float(used), float(qk), float(rst), len(self.live), budget, extra)

    def open_iteration(self, p: PrefillModel, budget: int, extra: float) -> tuple[float, int, int, int]:
        """``(t_open, used, ΣA, Σt_rst)`` of the open iteration of the folded queue: the numbers
        :meth:`replay` reports, with ``(budget, extra)`` = ``coef.decode_part(decoding)`` and ``p``
        the node's Eq. 1 model given by the caller (the predictor memoises the decode part)."""
        q_tok = self.q_tok
        used = q_tok % budget
        qk = 0
        rst = 0
        left = used
        for it in reversed(self.live) if used else ():  # the open iteration: the queue's last `used` tokens
            k = it.uncached_tokens
            take = k if k < left else left
            qk += take * (it.cached_tokens + k - take) + take * (take + 1) // 2  # the item's last chunk
            if take == k:
                rst += it.restore_tokens
            left -= take
            if not left:
                break
        fixed = p.c0 + extra
        t_open = (q_tok // budget) * fixed + p.c1 * (q_tok - used) + p.c2 * (self.a_all - qk) + p.c3 * (self.r_all - rst)
        return t_open, used, qk, rst


class _Send(StructValue):
    work: QueuedWork
    seen: bool = False
    """A state of the node listed this rid (it is in, or has left, the reported queue)."""


class _NodeTrack:
    __slots__ = ("node", "state", "sends", "trusted_ctx", "fold", "fallback_ctx")

    def __init__(self, node: str) -> None:
        self.node = node
        self.state: NodeState | None = None
        self.sends: dict[str, _Send] = {}
        self.trusted_ctx: tuple | None = None  # type: ignore[type-arg]
        """Replay of ``fold`` with the node's coefficients (None = recompute: from ``fold`` when it
        is set, else from the state's queue and the sends)."""
        self.fold: _QueueFold | None = None
        """The reported queue + unreported sends, folded (None = refold): kept up to date by a
        dispatch or a first token in place (O(1)), whose replay is then recomputed only when a
        decision reads it (in the simulator a new state, refolded at once, comes first)."""
        self.fallback_ctx: tuple | None = None  # type: ignore[type-arg]
        """Replay of every send not yet at its first token (untrusted state)."""


# --------------------------------------------------------------------------- #
# the predictor
# --------------------------------------------------------------------------- #


class TtftPredictor:
    """Predicted TTFT per prefill node (sans-IO, deterministic).

    Args:
        default: coefficients of a node the planner has not published (the profile's).
        fetch: τ(x).
        copy_price_s_per_token: κ, seconds charged per fetched token (the
            duplicate KV a fetch creates; the paper gives no value — 1e-7 s/token,
            i.e. a tenth of the fetch's per-token time, is our default).
        state_max_age_s: a state older than this (``now − state.ts``, the unit of ``now``) is not
            trusted (5 s; the live router's ``make_policy`` passes ``--ttft-state-max-age-s`` x
            ``--speedup``: workers publish their states on wall-clock timers).
        tie_eps_s: scores within this of the minimum are ties.
        prune_above: with more candidates than this, score only those whose lower
            bound can still win (:meth:`predict`); the decision is the same.
        breakdown: always score every candidate (set when the route log is at
            debug level, so its line carries every candidate's breakdown).

    Raises:
        ValueError: on a negative κ, a non-positive ``state_max_age_s``, a negative
            ``tie_eps_s`` or a negative ``prune_above``.
    """

    def __init__(
        self,
        default: NodeCoefficients,
        *,
        fetch: FetchModel | None = None,
        copy_price_s_per_token: float = 1e-7,
        state_max_age_s: float = 5.0,
        tie_eps_s: float = 1e-9,
        prune_above: int = 16,
        breakdown: bool = False,
    ) -> None:
        if copy_price_s_per_token < 0:
            raise ValueError(f"copy_price_s_per_token must be >= 0, got {copy_price_s_per_token}")
        if not state_max_age_s > 0:
            raise ValueError(f"state_max_age_s must be > 0, got {state_max_age_s}")
        if tie_eps_s < 0:
            raise ValueError(f"tie_eps_s must be >= 0, got {tie_eps_s}")
        self.default = default
        self.fetch = fetch if fetch is not None else FetchModel()
        self._fetch_base = self.fetch.base_s
        self._fetch_per_token = self.fetch.per_token_s
        self._fetch_min = self.fetch.min_tokens
        self.kappa = copy_price_s_per_token
        self.state_max_age_s = state_max_age_s
        self.tie_eps_s = tie_eps_s
        if prune_above < 0:
            raise ValueError(f"prune_above must be >= 0, got {prune_above}")
        self.prune_above = prune_above
        self.breakdown = breakdown
        pre, dec = default.prefill, default.decode
        self._floor_ok = math.isfinite(self.kappa) and _valid(
            pre.c0, pre.c1, pre.c2, pre.c3, dec.d0, dec.d1, dec.d2, dec.tokens_per_forward, dec.accepted_per_iteration
        )
        """Whether every score is at least its node's share wait ``base + t_open`` (s): every coefficient a node
        can be predicted with is finite and >= 0 (the default's, checked here; the planner's, by
        :meth:`apply_models`) and κ is finite, so each term a score adds to that wait is a float >= 0 and no
        NaN. Then a decision skips a candidate whose share wait alone is above the lowest score so far +
        ``tie_eps_s`` (:meth:`_score_all`)."""
        self.floor_skips = 0
        """Candidates a decision's contenders loop skipped before their work and estimate (their share wait alone
        was above the lowest score so far + ``tie_eps_s``), counted."""
        self.coefs: dict[str, NodeCoefficients] = {}
        self._parts: dict[str, tuple[NodeCoefficients, dict[int, tuple[int, float]], dict[int, tuple]]] = {}  # type: ignore[type-arg]
        """Per node: its coefficients, their ``decode_part(B)`` by decode batch B and the replay
        of an empty queue by B (:meth:`_make_ctx`), computed once per (coefficients, B) instead of
        once per replay (reset when the coefficients change)."""
        self._nodes: dict[str, _NodeTrack] = {}
        self._rid_node: dict[str, str] = {}
        self.models_rejected = 0
        self._bounds: dict[str, tuple[float, float, float, float, float, float]] = {}
        """Per node with a cached trusted replay, what the pruned search's lower bound needs:
        ``(ts + remaining_s, remaining_s, t_open + first − slack, c1, c2, ts)`` of its state
        and replay, where ``first`` = the open iteration's time so far when the queue leaves
        one open, else one iteration's fixed part (c0 + the decode part of a collocated
        node's iterations), and ``slack`` = ``_BOUND_SLACK_S``."""
        self._bounds_oldest = math.inf
        """≤ the oldest ``ts`` in ``_bounds`` (entries older than ``state_max_age_s`` are purged)."""
        self._keep_bounds = prune_above == 0
        """Whether ``_bounds`` is kept: only once a pruned search can run, i.e. once more than
        ``prune_above`` nodes are tracked or a decision got more candidates. Before that no
        decision reads a bound (every candidate is scored), so none is made (a simulated 9-node
        cluster under the default 16 never makes one); a bound missing when pruning starts
        comes from the node's replay at the decision (:meth:`_score_pruned`), as for a node
        whose replay is not cached."""

    # -- inputs ---------------------------------------------------------- #

    def _track(self, node: str) -> _NodeTrack:
        tr = self._nodes.get(node)
        if tr is None:
            tr = self._nodes[node] = _NodeTrack(node)
            if len(self._nodes) > self.prune_above:
                self._keep_bounds = True
        return tr

    def _invalidate(self, tr: _NodeTrack, *, replay: bool = False) -> None:
        """A node's state, sends or coefficients changed: drop its cached replays. With
        ``replay`` (a new state or new coefficients, which arrive off the request path),
        replay its queue now, so the next decisions read it instead of replaying it (as a
        Dynamo router's indexer applies KV events before the decisions that read them).
        Without ``replay`` the node's next decision folds and replays it (a dispatch to a node
        with no fold; a dispatch or first token on a folded one updates the fold in place and
        drops only the replay, see :meth:`on_dispatch`, :meth:`forget` and :meth:`_unreplayed`)."""
        tr.trusted_ctx = None
        tr.fallback_ctx = None
        tr.fold = None
        st = tr.state
        if replay and st is not None and st.phase != "decode":
            self._trusted_ctx(tr, st)
        else:
            self._bounds.pop(tr.node, None)

    def _trusted_ctx(self, tr: _NodeTrack, st: NodeState) -> tuple:  # type: ignore[type-arg]
        """Replay the node's reported queue plus its unreported sends; cache it with the lower
        bound the pruned search reads (``_bounds``). Whether ``st`` is still trusted is
        decided when a decision reads it (its age then)."""
        items: Iterable[QueuedWork] = st.queue
        if tr.sends:  # loops, not a set comprehension and a generator (a call each per refold)
            listed: set[str] = set()
            for w in st.queue:
                listed.add(w.rid)
            items = list(st.queue)
            for r, x in tr.sends.items():
                if not x.seen and r not in listed:
                    items.append(x.work)
        fold = tr.fold = _QueueFold(items)
        return self._set_trusted(tr, st, fold)

    def _unreplayed(self, tr: _NodeTrack) -> None:
        """``tr.fold`` changed (a send joined or left it): drop its replay and lower bound; the next
        decision that reads the node replays the fold (:meth:`_ctx`), not the whole queue."""
        tr.trusted_ctx = None
        self._bounds.pop(tr.node, None)

    def _set_trusted(self, tr: _NodeTrack, st: NodeState, fold: _QueueFold) -> tuple:  # type: ignore[type-arg]
        """Cache the trusted replay of ``fold`` and its lower-bound entry (see ``_bounds``)."""
        c = tr.trusted_ctx = self._make_ctx(tr.node, fold, st.decoding)
        if self._keep_bounds:
            self._set_bound(tr.node, st, c)
        return c

    def _set_bound(self, node: str, st: NodeState, c: tuple) -> None:  # type: ignore[type-arg]
        """The lower-bound entry (``_bounds``) of ``node`` from its state ``st`` and trusted replay ``c``
        (nothing while no pruned search can run: ``_keep_bounds``)."""
        if not self._keep_bounds:
            return
        # busy (the open iteration so far) when one is open, else one iteration's fixed part
        self._bounds[node] = (st.ts + st.remaining_s, st.remaining_s, c[0] + (c[1] if c[2] else c[6]) - _BOUND_SLACK_S, c[7], c[8], st.ts)
        if st.ts < self._bounds_oldest:
            self._bounds_oldest = st.ts

    def coefficients(self, node: str) -> NodeCoefficients:
        """The coefficients ``node`` is predicted with."""
        return self.coefs.get(node, self.default)

    def apply_state(self, state: NodeState, now: float) -> None:
        """A node's state arrived: it replaces the previous one; sends it lists become reported.

        The node's queue is replayed at once (:meth:`_invalidate`), except when the state
        reports the same queue as the one it replaces (equal items in the same order, the
        same phase, not decode) while the node's fold is kept: the fold is then what a refold
        would build (that queue plus the same unreported sends in the same order: a send a
        state lists was marked reported when that queue first came, or was never folded), so
        it is kept, and so is its replay when the decode batch is unchanged too (the replay
        reads only the fold, the node's coefficients and ``decoding``); only the lower bound,
        which reads ``ts`` and ``remaining_s``, is renewed. Cost: O(queue) to compare instead
        of O(queue + sends) to refold and replay (about two states in three in a simulated run)."""
        tr = self._nodes.get(state.node) or self._track(state.node)
        old = tr.state
        tr.state = state
        if tr.sends:
            sends = tr.sends
            for q in state.queue:
                s = sends.get(q.rid)
                if s is not None:
                    s.seen = True
        fold = tr.fold
        if fold is not None and old is not None and old.phase == state.phase != "decode" and old.queue == state.queue:
            tr.fallback_ctx = None
            c = tr.trusted_ctx
            if c is None or old.decoding != state.decoding:
                self._set_trusted(tr, state, fold)
            elif self._keep_bounds:
                self._set_bound(tr.node, state, c)
            return
        self._invalidate(tr, replay=True)

    def apply_models(self, msg: PlannerModels) -> int:
        """Adopt the planner's fitted models (per node; unset parts keep the current ones).

        A model with a negative or non-finite coefficient is ignored and
        counted in ``models_rejected``.

        Returns:
            Number of nodes whose coefficients changed.
        """
        changed = 0
        for nm in msg.models:
            cur = self.coefficients(nm.node)
            pre, dec = nm.prefill, nm.decode
            if pre is not None and not _valid(pre.c0, pre.c1, pre.c2, pre.c3):
                self.models_rejected += 1
                continue
            if dec is not None and not _valid(dec.d0, dec.d1, dec.d2, dec.tokens_per_forward, dec.accepted_per_iteration):
                self.models_rejected += 1
                continue
            new = NodeCoefficients(
                prefill=pre if pre is not None else cur.prefill,
                decode=dec if dec is not None else cur.decode,
                chunk_tokens=cur.chunk_tokens,
                source=f"planner-{getattr(nm, 'source', 'fitted')}" if (pre is not None or dec is not None) else cur.source,
                mean_chunk_tokens=nm.mean_chunk_tokens or cur.mean_chunk_tokens,
                restored_share=nm.restored_share or cur.restored_share,
            )
            if new != cur:
                self.coefs[nm.node] = new
                changed += 1
                tr = self._nodes.get(nm.node)
                if tr is not None:
                    self._invalidate(tr, replay=True)
        return changed

    def on_dispatch(self, rid: str, node: str, *, uncached_tokens: int, cached_tokens: int = 0, restore_tokens: int = 0) -> None:
        """The router sent ``rid`` to ``node`` with this (dispatch-time) work.

        Raises:
            ValueError: if ``rid`` is already tracked.
        """
        if rid in self._rid_node:
            raise ValueError(f"request {rid!r} is already tracked")
        tr = self._nodes.get(node) or self._track(node)
        work = QueuedWork(rid=rid, uncached_tokens=uncached_tokens, cached_tokens=cached_tokens, restore_tokens=restore_tokens)
        tr.sends[rid] = _Send(work)
        self._rid_node[rid] = node
        tr.fallback_ctx = None
        st = tr.state
        fold = tr.fold
        if fold is not None and st is not None:
            # the send joins the end of the trusted queue (unless a state lists a reused rid)
            for w in st.queue:  # (a loop: a generator would be a call per dispatch)
                if w.rid == rid:
                    break
            else:
                if fold.append(work):
                    self._unreplayed(tr)
        else:
            self._invalidate(tr)

    def forget(self, rid: str) -> bool:
        """``rid`` produced its first token, finished, failed or was aborted (idempotent).

        Returns:
            True if it was tracked.
        """
        node = self._rid_node.pop(rid, None)
        if node is None:
            return False
        tr = self._nodes[node]
        send = tr.sends.pop(rid)
        tr.fallback_ctx = None
        # a send a state has listed is not in the trusted queue (the state's queue, or
        # its leaving it, speaks for it): nothing to replay; an unlisted one leaves it
        if not send.seen and tr.fold is not None and tr.state is not None:
            if tr.fold.remove(send.work):
                self._unreplayed(tr)
        return True

    def forget_node(self, node: str) -> bool:
        """``node`` has left for good: drop its track (state, replays), memoised parts and lower bound, unless
        requests sent to it are still tracked (then it is kept: :meth:`forget` of them needs it). The planner's
        coefficients for it (``coefs``) are kept: the planner's models message names its nodes, and sets them
        again. Returns True if it was dropped. O(1)."""
        tr = self._nodes.get(node)
        if tr is not None and tr.sends:
            return False
        self._nodes.pop(node, None)
        self._parts.pop(node, None)
        self._bounds.pop(node, None)
        return True

    def tracked(self, node: str) -> int:
        """Requests sent to ``node`` that have not produced their first token."""
        tr = self._nodes.get(node)
        return len(tr.sends) if tr is not None else 0

    def unreported(self, node: str) -> int:
        """Of those, how many no state of ``node`` has listed yet."""
        tr = self._nodes.get(node)
        return sum(1 for s in tr.sends.values() if not s.seen) if tr is not None else 0

    # -- the wait ---------------------------------------------------------- #

    def _ctx(self, tr: _NodeTrack, now: float) -> tuple[tuple, float, bool]:  # type: ignore[type-arg]
        """(replay context, base = aged remaining time, trusted) of a node at ``now``."""
        st = tr.state
        if st is not None:
            age = now - st.ts
            if age <= self.state_max_age_s:
                c = tr.trusted_ctx
                if c is None:
                    c = self._trusted_ctx(tr, st) if tr.fold is None else self._set_trusted(tr, st, tr.fold)
                rem = st.remaining_s - (age if age > 0.0 else 0.0)
                return c, (rem if rem > 0.0 else 0.0), True
        c = tr.fallback_ctx
        if c is None:
            c = tr.fallback_ctx = self._make_ctx(tr.node, _QueueFold([x.work for x in tr.sends.values()]), 0)
        return c, 0.0, False

    def _make_ctx(self, node: str, fold: _QueueFold, decoding: int) -> tuple:  # type: ignore[type-arg]
        """The replay context of ``fold`` on ``node`` with ``decoding`` decode requests: ``(t_open,
        busy, used, room, items, budget, fixed, c1, c2, c3)`` (s, tokens). O(1) for an empty fold
        (memoised per coefficients and B), else O(items of the open iteration)."""
        coef = self.coefs.get(node, self.default)
        memo = self._parts.get(node)
        if memo is None or memo[0] is not coef:
            memo = self._parts[node] = (coef, {}, {})
        empty = not fold.live
        if empty:  # nothing queued: the replay depends on the coefficients and B only
            c = memo[2].get(decoding)
            if c is not None:
                return c
        part = memo[1].get(decoding)
        if part is None:
            part = memo[1][decoding] = coef.decode_part(decoding)
        budget, extra = part
        p = coef.prefill
        t_open, used, qk, rst = fold.open_iteration(p, budget, extra)  # fold.replay(coef, decoding)'s numbers
        fixed = p.c0 + extra
        # the open iteration's time so far (0 when none is open), and what is left of its budget
        busy = fixed + p.c1 * float(used) + p.c2 * float(qk) + p.c3 * float(rst) if used else 0.0
        c = (t_open, busy, used, budget - used, len(fold.live), budget, fixed, p.c1, p.c2, p.c3)
        if empty:
            memo[2][decoding] = c
        return c

    def wait(self, node: str, now: float) -> float:
        """Ŵ for a request that cannot share an iteration: until n's queue is done (s)."""
        ctx, base, _ = self._ctx(self._track(node), now)
        return base + ctx[0] + ctx[1]

    def _score(self, works: list[tuple[str, int, int, int, int, int]], now: float) -> list[tuple[Any, ...]]:
        """Estimates of ``(node, t_uc, t_c, t_rst, x, local)`` work items, as plain tuples in
        :class:`CandidateEstimate` field order (:meth:`_rows` of the priced work)."""
        return self._rows([w[0] for w in works], [self._priced(*w[1:]) for w in works], now)

    def _priced(self, t_uc: int, t_c: int, rst: int, x: int, local: int) -> tuple[Any, ...]:
        """A node's work ``(t_uc, t_c, t_rst, x, local)`` (tokens) with what the estimate needs of
        it alone: ``(…, τ, ΣA, copy price)`` — the fetch time τ (s; 0 below the fetch threshold),
        the attention pairs ΣA = qk_pairs(t_uc, t_c) and the copy price κ·x (s)."""
        return (
            t_uc,
            t_c,
            rst,
            x,
            local,
            self._fetch_base + self._fetch_per_token * x if (x > 0 and x >= self._fetch_min) else 0.0,  # τ
            t_uc * t_c + t_uc * (t_uc + 1) / 2.0,  # qk_pairs(t_uc, t_c)
            self.kappa * x,  # copy price
        )

    def _rows(self, names: list[str], priced: list[tuple[Any, ...]], now: float) -> list[tuple[Any, ...]]:
        """Estimates of node ``names[i]`` doing work ``priced[i]`` (:meth:`_priced`), as plain tuples
        in :class:`CandidateEstimate` field order (attribute reads hoisted, no helper calls but a cache
        miss, plain arithmetic, no object but the tuple); :meth:`estimate` and the pruned search use it,
        a full decision's loop (:meth:`_score_all`) has the same arithmetic inline."""
        nodes = self._nodes
        max_age = self.state_max_age_s
        out: list[tuple[Any, ...]] = []
        append = out.append
        for node, (t_uc, t_c, rst, x, local_t, tau, a_all, copy) in zip(names, priced):
            tr = nodes.get(node) or self._track(node)
            st = tr.state
            ctx = tr.trusted_ctx
            if ctx is not None and st is not None and (age := now - st.ts) <= max_age:  # fast path: cached replay
                base = st.remaining_s - (age if age > 0.0 else 0.0)
                if base < 0.0:
                    base = 0.0
                trusted = True
            else:
                ctx, base, trusted = self._ctx(tr, now)
            t_open, busy, used, room, items, budget, fixed, c1, c2, c3 = ctx
            w_share = base + t_open
            if used and tau <= w_share:
                k1 = t_uc if t_uc < room else room
                a1 = k1 * t_c + k1 * (k1 + 1) / 2.0
                own = busy + c1 * k1 + c2 * a1 + c3 * rst
                rest = t_uc - k1
                if rest:
                    own += -(-rest // budget) * fixed + c1 * rest + c2 * (a_all - a1)
                wait = w_share
                exposed = 0.0
                shared = True
            else:
                wait = w_share + busy
                own = -(-t_uc // budget) * fixed + c1 * t_uc + c2 * a_all + c3 * rst
                exposed = tau - wait if tau > wait else 0.0
                shared = False
            ttft = wait + own + exposed
            append((node, ttft + copy, ttft, wait, own, tau, exposed, copy, t_uc, t_c, local_t, x, rst, items, trusted, shared))
        return out

    def _score_all(
        self,
        t_in: int,
        lookup: KvLookupReply | None,
        candidates: Sequence[NodeLoad],
        view: _LookupView | None,
        now: float,
        contenders: bool = False,
    ) -> list[tuple[Any, ...]]:
        """``self._score(self._works(t_in, lookup, candidates, view), now)`` in one loop over the
        candidates: each node's priced work (:meth:`_priced`) made once per distinct own prefix (a
        node's work depends only on the decision's lookup and on its own prefix ``(local, gpu)``,
        unless a source range is the node's own: most candidates hold the same shared prefix, e.g. a
        system prompt), computed inline (:func:`_node_work` then :meth:`_priced`), and the node's
        estimate (:meth:`_rows`' arithmetic, the same operations in the same order) made at once,
        with no list of priced work, no second loop and no call but a cache miss. Property-tested
        equal (``test_one_pass_scoring_equals_works_then_score``).

        ``contenders``: return only the estimates that may still be the choice or one of its ties when
        made: score within ``tie_eps_s`` of the lowest so far (a candidate above that is above the
        final lowest + ``tie_eps_s`` too, so :meth:`_decide` finds the same choice, ties and fetch
        among them), in candidate order; the others' tuples are not made. A candidate whose share wait
        ``base + t_open`` (the least wait of any request there) is already above that is skipped before
        its work and estimate are computed (its score, that wait plus terms >= 0, is above it too: see
        ``_floor_ok``), counted in :attr:`floor_skips`; with ``contenders`` off the bound is +inf."""
        nodes = self._nodes
        max_age = self.state_max_age_s
        out: list[tuple[Any, ...]] = []
        append = out.append
        eps = self.tie_eps_s
        cut = math.inf  # contenders: the lowest score so far + eps (inf: keep every estimate)
        if view is None or lookup is None:  # nothing cached: the whole prompt on every node
            t_uc, t_c, rst, x, local_t, tau, a_all, copy = self._priced(t_in, 0, 0, 0, 0)
            srcs: list[tuple[str, int, int]] = []
            src_nodes: set[str] = set()
            prefixes: dict[str, tuple[int, int]] | None = None
        else:
            prefixes, srcs, _, src_nodes = view
            bs = lookup.block_size
            cap = ((t_in - 1) // bs) * bs
            longest_t = lookup.longest_any * bs
            f_min = self._fetch_min
            f_base, f_per, kappa = self._fetch_base, self._fetch_per_token, self.kappa
        memo: dict[tuple[int, int], tuple[Any, ...]] = {}
        floor_ok = self._floor_ok
        skipped = 0
        for cn in candidates:
            node = cn.node
            # the node's replay and aged remaining time first (they do not depend on the request)
            tr = nodes.get(node) or self._track(node)
            st = tr.state
            ctx = tr.trusted_ctx
            if ctx is not None and st is not None and (age := now - st.ts) <= max_age:  # fast path: cached replay
                base = st.remaining_s - (age if age > 0.0 else 0.0)
                if base < 0.0:
                    base = 0.0
                trusted = True
            else:
                ctx, base, trusted = self._ctx(tr, now)
            t_open, busy, used, room, items, budget, fixed, c1, c2, c3 = ctx
            w_share = base + t_open
            if w_share > cut and floor_ok:  # its score >= w_share > cut: neither the choice nor a tie
                skipped += 1
                continue
            if prefixes is not None:
                key = prefixes.get(node, _NO_PREFIX)
                src = node in src_nodes
                w: tuple[Any, ...] | None = None if src else memo.get(key)
                if w is None:
                    # self._priced(*_node_work(node, key, srcs, t_in, bs, cap, longest_t, f_min)) inlined:
                    # the same operations in the same order, without two calls and a tuple per distinct
                    # prefix (test_one_pass_scoring_equals_works_then_score holds it to that pair)
                    local, gpu = key
                    xb = 0
                    for sn, a, b in srcs:
                        if b <= local or sn == node:
                            continue
                        xb += b - (a if a > local else local)
                    t_c = longest_t
                    x = xb * bs
                    local_t = local * bs
                    own = local_t if local_t < cap else cap
                    if t_c > cap:
                        t_c = cap
                        if x > t_c - own:
                            x = t_c - own
                    if x < f_min:
                        t_c, x = own, 0
                    g = gpu * bs
                    t_uc = t_in - t_c
                    rst = t_c - (g if g < t_c else t_c)
                    tau = f_base + f_per * x if (x > 0 and x >= f_min) else 0.0
                    a_all = t_uc * t_c + t_uc * (t_uc + 1) / 2.0  # qk_pairs(t_uc, t_c)
                    copy = kappa * x  # copy price
                    if not src:
                        memo[key] = (t_uc, t_c, rst, x, local_t, tau, a_all, copy)
                else:
                    t_uc, t_c, rst, x, local_t, tau, a_all, copy = w
            # the estimate (_rows' loop body)
            if used and tau <= w_share:
                k1 = t_uc if t_uc < room else room
                a1 = k1 * t_c + k1 * (k1 + 1) / 2.0
                own_s = busy + c1 * k1 + c2 * a1 + c3 * rst
                rest = t_uc - k1
                if rest:
                    own_s += -(-rest // budget) * fixed + c1 * rest + c2 * (a_all - a1)
                wait = w_share
                exposed = 0.0
                shared = True
            else:
                wait = w_share + busy
                own_s = -(-t_uc // budget) * fixed + c1 * t_uc + c2 * a_all + c3 * rst
                exposed = tau - wait if tau > wait else 0.0
                shared = False
            ttft = wait + own_s + exposed
            score = ttft + copy
            if not score > cut:  # (a NaN score is kept, as without ``contenders``: min() and the ties read it so)
                append((node, score, ttft, wait, own_s, tau, exposed, copy, t_uc, t_c, local_t, x, rst, items, trusted, shared))
                if contenders and score + eps < cut:
                    cut = score + eps
        if skipped:
            self.floor_skips += skipped
        return out

    # -- one candidate ---------------------------------------------------- #

    def estimate(
        self,
        node: str,
        now: float,
        *,
        uncached_tokens: int,
        cached_tokens: int,
        restore_tokens: int = 0,
        fetch_tokens: int = 0,
        local_tokens: int = 0,
    ) -> CandidateEstimate:
        """Predicted TTFT of a request with this work on ``node`` (Eq. 7 + App. E.3).

        Args:
            uncached_tokens: t_uc,n (>= 1).
            cached_tokens: t_c,n (after the fetch threshold and the engine's cap).
            restore_tokens: cached tokens loaded from host memory into L1.
            fetch_tokens: x_n (τ is 0 below the fetch threshold).
            local_tokens: prefix in n's own memory (for the tie rule and the log).

        Raises:
            ValueError: if ``uncached_tokens`` < 1.
        """
        if uncached_tokens < 1:
            raise ValueError(f"uncached_tokens must be >= 1, got {uncached_tokens}")
        return CandidateEstimate._make(self._score([(node, uncached_tokens, cached_tokens, restore_tokens, fetch_tokens, local_tokens)], now)[0])

    # -- one decision ------------------------------------------------------ #

    def predict(
        self, req: RouteRequest, lookup: KvLookupReply | None, candidates: Sequence[NodeLoad], now: float, *, breakdown: bool | None = None
    ) -> Prediction:
        """Estimate the candidates and pick the argmin (ties → longest own prefix, then node id).

        ``candidates`` must be sorted by node id (as ``NodeLoadView`` returns them).

        The work on each node (t_c,n, x_n, local prefix) follows
        :func:`services.kvdirectory.lookup.fetch_plan`: ``x_n`` = blocks of the
        plan's ranges beyond n's own prefix held by other nodes. It is computed
        here in the loop, with the same rule (property-tested equal to
        ``fetch_plan``), because a ``fetch_plan`` call per candidate (objects per
        range) costs more than the rest of the estimate; the chosen node's
        ranges come from ``fetch_plan``'s own range rule (:func:`~services.kvdirectory.lookup.fetch_ranges`,
        clipped to its cached prefix), without a ``FetchPlan`` per decision.

        With more than ``prune_above`` candidates (and ``breakdown`` off), only
        the candidates that can still win are scored: each node's lower bound
        T̂_n ≥ T_n^rem + start of the open iteration + max(its time so far, one
        iteration's fixed part) + c1·t_uc + c2·A of the fewest uncached tokens any
        node could have (the cluster's longest prefix; exposed fetch and copy
        price ≥ 0) orders them — a request that joins the open iteration pays its
        time so far in its own prefill, one that does not waits for it and then
        pays at least one iteration's fixed part — and scoring stops
        at the first bound above the best score + ``tie_eps_s``. The choice, the
        ties and the predicted TTFT are those of scoring every candidate
        (property-tested); ``estimates`` then holds only the scored ones.

        Args:
            breakdown: score every candidate (the debug log's full breakdown);
                None = the predictor's ``breakdown`` setting.

        Raises:
            ValueError: if ``candidates`` is empty or ``req.prompt_tokens`` < 1.
        """
        top, raw, ties, ranges, longest = self._decide(req, lookup, candidates, now, breakdown)
        return Prediction(best=CandidateEstimate._make(top), estimates=CandidateEstimates(raw), ties=ties, fetch=ranges, longest_local_blocks=longest)

    def _decide(
        self,
        req: RouteRequest,
        lookup: KvLookupReply | None,
        candidates: Sequence[NodeLoad],
        now: float,
        breakdown: bool | None = None,
        contenders: bool = False,
    ) -> tuple[tuple[Any, ...], list[tuple[Any, ...]], int, tuple[FetchRange, ...], int]:
        """:meth:`predict`'s numbers before any object is made: ``(best, estimates, ties, fetch,
        longest_local_blocks)`` with ``best`` and ``estimates`` as plain tuples in
        :class:`CandidateEstimate` field order (the policy reads them without a :class:`Prediction`).
        ``contenders`` (without a breakdown): ``estimates`` holds only the candidates that could be
        chosen when scored (see :meth:`_score_all`); the choice, ties and fetch are the same."""
        if not candidates:
            raise ValueError("no prefill candidates")
        t_in = req.prompt_tokens
        if t_in < 1:
            raise ValueError("prompt_tokens must be >= 1")
        full = self.breakdown if breakdown is None else breakdown
        view = self._lookup_view(lookup)
        if full or len(candidates) <= self.prune_above:
            raw = self._score_all(t_in, lookup, candidates, view, now, contenders and not full)
        else:
            raw = self._score_pruned(t_in, lookup, view, candidates, now)
        limit = min(map(_SCORE, raw)) + self.tie_eps_s
        ties = 0
        top: tuple[Any, ...] | None = None
        for e in raw:  # candidates are in node-id order: the first longest own prefix wins
            if e[1] <= limit:
                ties += 1
                if top is None or e[10] > top[10]:
                    top = e
        assert top is not None
        ranges: tuple[FetchRange, ...] = ()
        if top[11] and lookup is not None and view is not None:  # fetch_tokens: the plan's ranges
            bs = lookup.block_size
            ranges = fetch_ranges(lookup.sources, top[0], top[10] // bs, top[9] // bs)  # node, local, cached
        return top, raw, ties, ranges, view[2] if view is not None else 0

    @staticmethod
    def _lookup_view(lookup: KvLookupReply | None) -> _LookupView | None:
        """A lookup's per-node prefixes by name, its source ranges, the longest prefix a node
        holds in its own memory (blocks) and the nodes its ranges name (None: nothing cached).
        Built once per decision."""
        if lookup is None or lookup.error is not None or lookup.longest_any <= 0:
            return None
        # plain loops, not attrgetter maps: their attribute reads use the interpreter's inline caches
        # (measured: fewer instructions per decision); one loop for the prefixes and the longest, one
        # for the ranges and their nodes, not a comprehension each (each is a call; a lookup has 1-3 ranges)
        prefixes: dict[str, tuple[int, int]] = {}
        longest = 0
        for p in lookup.nodes:
            local = p.local_blocks
            prefixes[p.node] = (local, p.gpu_blocks)
            if local > longest:
                longest = local
        srcs: list[tuple[str, int, int]] = []
        src_nodes: set[str] = set()
        for r in lookup.sources:
            sn = r.node
            srcs.append((sn, r.start, r.end))
            src_nodes.add(sn)
        return prefixes, srcs, longest, src_nodes

    def _works(
        self,
        t_in: int,
        lookup: KvLookupReply | None,
        candidates: Sequence[NodeLoad],
        view: _LookupView | None,
    ) -> list[tuple[str, int, int, int, int, int]]:
        """``(node, t_uc, t_c, t_rst, x, local)`` of a prompt of ``t_in`` tokens on each candidate
        (``view`` = :meth:`_lookup_view` of ``lookup``, built once per decision)."""
        works: list[tuple[str, int, int, int, int, int]] = []
        append = works.append
        if view is None or lookup is None:
            for n in candidates:
                append((n.node, t_in, 0, 0, 0, 0))
            return works
        prefixes, srcs, _, _ = view
        bs = lookup.block_size
        cap = ((t_in - 1) // bs) * bs
        min_fetch = self._fetch_min
        longest_t = lookup.longest_any * bs
        for n in candidates:
            name = n.node
            append((name, *_node_work(name, prefixes.get(name, _NO_PREFIX), srcs, t_in, bs, cap, longest_t, min_fetch)))
        return works

    def _score_pruned(
        self, t_in: int, lookup: KvLookupReply | None, view: _LookupView | None, candidates: Sequence[NodeLoad], now: float
    ) -> list[tuple[Any, ...]]:
        """Score candidates in order of a lower bound, in batches, until no bound can win (see
        :meth:`predict`). Returns the scored ones' plain estimates in candidate order.

        A node's bound needs its aged remaining time, ``max(0, min(rem, ts + rem − now))``
        (= ``_ctx``'s ``max(0, rem − max(0, now − ts))``), and its replay's ``t_open`` plus
        first-iteration part, c1 and c2; ``_bounds`` keeps those per node while its trusted
        replay is cached (a dispatch or a first token updates it in place), so one
        comprehension bounds every such node. The others (new coefficients, stale or never
        reported) go through ``_ctx``, which caches them again."""
        t_c = 0  # the longest cached prefix any node could use (the engine's cap as in _works)
        if view is not None and lookup is not None:
            bs = lookup.block_size
            t_c = min(lookup.longest_any * bs, ((t_in - 1) // bs) * bs)
        u = t_in - t_c  # the fewest uncached tokens on any node
        a_u = u * t_c + u * (u + 1) / 2.0
        self._keep_bounds = True  # from now on states and replays keep their bounds
        if now - self._bounds_oldest > self.state_max_age_s:
            self._purge_stale_bounds(now)
        names = [n.node for n in candidates]
        vals: list[Any] = list(map(self._bounds.get, names))
        i = -1
        for _ in range(vals.count(None)):  # nodes without a cached bound (C-level scans, no Python loop over all)
            i = vals.index(None, i + 1)
            ctx, base, _ = self._ctx(self._nodes.get(names[i]) or self._track(names[i]), now)
            vals[i] = (math.inf, base, ctx[0] + (ctx[1] if ctx[2] else ctx[6]) - _BOUND_SLACK_S, ctx[7], ctx[8], now)  # min(rem, inf) = base, the aged remaining time
        bounds = [  # T̂ ≥ aged remaining + t_open + max(busy, fixed) + c1·u + c2·A (see predict)
            (rem if (d := end - now) > rem else (d if d > 0.0 else 0.0)) + k + c1 * u + c2 * a_u
            for end, rem, k, c1, c2, _ in vals
        ]
        order = sorted(range(len(bounds)), key=bounds.__getitem__)  # stable: ties in candidate order
        scored: list[tuple[int, tuple[Any, ...]]] = []
        limit = math.inf
        pos, n_all = 0, len(order)
        while pos < n_all and bounds[order[pos]] <= limit:
            batch: list[int] = []
            while pos < n_all and bounds[order[pos]] <= limit and len(batch) < _PRUNE_BATCH:
                batch.append(order[pos])
                pos += 1
            rows = self._score(self._works(t_in, lookup, [candidates[i] for i in batch], view), now)
            scored.extend(zip(batch, rows))
            best = min(map(_SCORE, rows)) + self.tie_eps_s
            if best < limit:
                limit = best
        scored.sort(key=_FIRST)
        return [r for _, r in scored]

    def _purge_stale_bounds(self, now: float) -> None:
        """Drop ``_bounds`` entries whose state is no longer trusted at ``now``."""
        max_age = self.state_max_age_s
        self._bounds = {k: v for k, v in self._bounds.items() if now - v[5] <= max_age}
        self._bounds_oldest = min((v[5] for v in self._bounds.values()), default=math.inf)


_SCORE = itemgetter(1)
"""``score_s`` of a plain estimate tuple."""
_FIRST = itemgetter(0)
_NO_PREFIX = (0, 0)
"""``(local_blocks, gpu_blocks)`` of a node the lookup does not list."""


def _node_work(
    node: str, prefix: tuple[int, int], srcs: Sequence[tuple[str, int, int]], t_in: int, bs: int, cap: int, longest_t: int,
    min_fetch: float,
) -> tuple[int, int, int, int, int]:
    """``(t_uc, t_c, t_rst, x, local)`` in tokens of a prompt of ``t_in`` tokens on ``node``, whose
    own prefix is ``prefix`` = ``(local, gpu)`` blocks (host + GPU, GPU), given the lookup's source
    ranges ``srcs`` (``(node, start, end)`` in blocks), ``bs`` tokens per block, ``cap`` = the most
    tokens that can be cached (``t_in − 1`` rounded down to a block), ``longest_t`` = the longest
    cached prefix anywhere (tokens) and ``min_fetch`` = the smallest fetch worth it (tokens).
    ``fetch_plan``'s rule: ranges of other nodes beyond the own prefix are fetched (``x``), unless
    under ``min_fetch``; the engine computes at least one token, so the prefix's tail past ``cap`` is
    recomputed; ``t_rst`` = the cached tokens restored from L2. Used by :meth:`TtftPredictor._works`;
    :meth:`TtftPredictor._score_all` runs the same steps inline, once per distinct prefix (tested equal)."""
    local, gpu = prefix
    xb = 0
    for sn, a, b in srcs:
        if b <= local or sn == node:
            continue
        xb += b - (a if a > local else local)
    t_c = longest_t
    x = xb * bs
    local_t = local * bs
    own = local_t if local_t < cap else cap
    if t_c > cap:
        t_c = cap
        if x > t_c - own:
            x = t_c - own
    if x < min_fetch:
        t_c, x = own, 0
    g = gpu * bs
    return t_in - t_c, t_c, t_c - (g if g < t_c else t_c), x, local_t


_LookupView = tuple[dict[str, tuple[int, int]], list[tuple[str, int, int]], int, set[str]]
"""What :meth:`TtftPredictor._lookup_view` returns: ``(local_blocks, gpu_blocks)`` by node, ``(node,
start, end)`` source ranges, the longest own prefix (blocks), the nodes the ranges name."""
_PRUNE_BATCH = 8
"""Candidates scored per step of the pruned search (amortises the per-call work)."""
_BOUND_SLACK_S = 1e-9
"""Subtracted from every lower bound: float rounding never prunes a winner or a tie."""


def _valid(*xs: float) -> bool:
    """Every coefficient finite and >= 0 (a loop: a generator would be a call per model)."""
    for x in xs:
        if not (math.isfinite(x) and x >= 0):
            return False
    return True


# --------------------------------------------------------------------------- #
# the routing policy
# --------------------------------------------------------------------------- #


def decode_footprint_blocks(req: RouteRequest, block_size: int) -> int:
    """L1 blocks a request needs on its decode node: ``ceil((prompt + max_tokens) / bs)``."""
    return -(-(req.prompt_tokens + req.max_tokens) // block_size)


class TtftPolicy(RoutingPolicy):
    """Route to the prefill node with the smallest predicted TTFT (paper §5.3, Eq. 7, Alg. E.3).

    Prefill: :class:`TtftPredictor` (see the module docstring for the exact
    rules). The decision carries the predicted TTFT, every candidate's
    breakdown and the fetch plan the chosen node should run while the request
    waits (sent in ``PrefillWork.fetch``).

    Decode (Alg. E.3 l.13, "the node in D with KV room for r and the fewest
    requests"): among decode candidates whose last state shows at least
    ``ceil((prompt + max_tokens)/bs)`` free L1 blocks beyond the footprints of
    the requests the router bound to them that are still in prefill (their KV
    has not reached the node, so no state counts it yet), the one with the
    fewest requests
    (``running + waiting + in flight``); if none has room, the one with the
    fewest requests. The binding is made when the prefill starts
    (``RouterCore.bind_decode`` over ``route.bind``, the router's default
    ``--decode-binding prefill-start``) or at dispatch (``dispatch``); either
    way the reservation lasts until the first token.

    Args:
        predictor: the TTFT predictor (owned by the policy from now on).
        block_size: tokens per block (for the decode footprint).
    """

    name = "ttft"
    decode_rule = "least_loaded_kv_room"

    def __init__(self, predictor: TtftPredictor, *, block_size: int = 64) -> None:
        self.predictor = predictor
        self.block_size = block_size
        self._decode_reserved: dict[str, int] = {}
        self._rid_decode: dict[str, tuple[str, int]] = {}
        self._chosen: tuple[PrefillChoice, tuple[Any, ...]] | None = None
        """The last choice made here and its node's estimate (plain tuple): :meth:`on_dispatch` of that
        choice (the router core's next call, the usual case) reads it there without a search."""

    def choose_prefill(self, req: RouteRequest, lookup: KvLookupReply | None, candidates: Sequence[NodeLoad], now: float) -> PrefillChoice:
        # predict(), no Prediction; the estimates of the candidates that could be chosen (all with a breakdown)
        best, raw, ties, fetch, longest = self.predictor._decide(req, lookup, candidates, now, None, True)
        total = len(req.block_hashes)
        matched = longest if longest < total else total
        # loads / matches stay empty: every contender's estimate (queue, own prefix) is in ``estimates``
        ests = object.__new__(CandidateEstimates)  # CandidateEstimates(raw) without its Python __init__ frame
        ests._raw = raw
        choice = PrefillChoice(  # positional, in field order (one per decision)
            best[0],  # node
            "ttft" if ties == 1 else "ttft_tie",  # path
            matched,  # matched_blocks
            matched / total if total else 0.0,  # match_rate
            {},  # loads
            {},  # matches
            best[2],  # predicted_ttft_s: the estimate's ttft_s
            ests,  # estimates
            fetch,
        )
        self._chosen = (choice, best)
        return choice

    def choose_decode(self, req: RouteRequest, candidates: Sequence[NodeLoad], now: float) -> DecodeChoice | None:
        if not candidates:
            return None
        need = decode_footprint_blocks(req, self.block_size)
        loads = {n.node: decode_load(n) for n in candidates}
        room = [n for n in candidates if n.gpu_free_blocks - self._decode_reserved.get(n.node, 0) >= need]
        pool = room or candidates
        best = min(pool, key=lambda n: (loads[n.node], n.node))
        return DecodeChoice(node=best.node, loads=loads)

    # -- hooks ----------------------------------------------------------------- #

    def on_state(self, state: NodeState, now: float) -> None:
        self.predictor.apply_state(state, now)

    def state_hook(self) -> Callable[[NodeState, float], None]:
        """The predictor's ``apply_state`` itself (what :meth:`on_state` does), unless a subclass
        overrides :meth:`on_state`."""
        return self.predictor.apply_state if type(self).on_state is TtftPolicy.on_state else self.on_state

    def on_dispatch(self, req: RouteRequest, choice: PrefillChoice, decode_node: str | None, now: float) -> None:
        chosen = self._chosen
        if chosen is not None and chosen[0] is choice:  # the choice just made here: its estimate is at hand
            est: tuple[Any, ...] | None = chosen[1]
            self._chosen = None
        else:
            ests = choice.estimates
            est = ests.find_raw(choice.node) if isinstance(ests, CandidateEstimates) else None
        if est is None:  # a choice made elsewhere: charge the whole prompt
            self.predictor.on_dispatch(req.rid, choice.node, uncached_tokens=req.prompt_tokens)
        else:  # uncached, cached and restore tokens of its estimate (CandidateEstimate field order)
            self.predictor.on_dispatch(req.rid, choice.node, uncached_tokens=est[8], cached_tokens=est[9], restore_tokens=est[12])
        if decode_node is not None:
            blocks = decode_footprint_blocks(req, self.block_size)
            self._rid_decode[req.rid] = (decode_node, blocks)
            self._decode_reserved[decode_node] = self._decode_reserved.get(decode_node, 0) + blocks

    def on_decode_bound(self, req: RouteRequest, decode_node: str, now: float) -> None:
        self._release_decode(req.rid)
        blocks = decode_footprint_blocks(req, self.block_size)
        self._rid_decode[req.rid] = (decode_node, blocks)
        self._decode_reserved[decode_node] = self._decode_reserved.get(decode_node, 0) + blocks

    def _release_decode(self, rid: str) -> None:
        d = self._rid_decode.pop(rid, None)
        if d is not None:
            node, blocks = d
            left = self._decode_reserved.get(node, 0) - blocks
            if left > 0:
                self._decode_reserved[node] = left
            else:
                self._decode_reserved.pop(node, None)

    def on_first_token(self, rid: str, now: float) -> None:
        # prefill done: the decode node reserves the KV itself on the hand-off,
        # so its next state shows the room taken
        self.predictor.forget(rid)
        if self._rid_decode:  # (no call while nothing is reserved: collocated nodes)
            self._release_decode(rid)

    def on_finish(self, rid: str, now: float) -> None:
        self.predictor.forget(rid)
        if self._rid_decode:
            self._release_decode(rid)

    def on_models(self, msg: PlannerModels, now: float) -> int:
        return self.predictor.apply_models(msg)

    def on_node_gone(self, node: str, now: float) -> None:
        self.predictor.forget_node(node)
        self._decode_reserved.pop(node, None)
