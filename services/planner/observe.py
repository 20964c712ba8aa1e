"""What the planners measure from their inputs, bucketed on a fixed time grid (sans-IO).

Contains zero I/O and no clock: every input carries ``now`` (simulated s).
:class:`Observer` turns the three input streams into per-bucket sums the
planners query by bucket index (a bucket is one planner slice, e.g. 60 s,
on a grid that starts at ``origin``):

* ``NodeState`` (per node, at iteration launches) → the latest state per node,
  and the time integral of the **requests in decode** (for q̄_i of Eq. 5) and
  the **prefill queue length** at every bucket start (for the arrival rate);
* ``RequestDone`` → per bucket of completion: count and sums of t_uc, t_c,
  A = qk_pairs(t_uc, t_c) and t_out (for w̄_i); per bucket of *first token*:
  a count (for the arrival rate); per prefill node: cached tokens (for f_n);
* ``IterationRecord`` (per node, bucketed by its start) → prefill iterations,
  their uncached and restored tokens (for t̄_n, f_n) and decode iteration time
  (for Arrow's TPOT).

Definitions (DESIGN §4): requests in decode on node n =
``decoding + (waiting if phase == 'decode')`` (running decode batch plus
hand-offs waiting for KV room or transfer); prefill queue of n =
``len(queue)`` for prefill and collocated nodes (queued plus partly computed
prompts).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from shared.itermodel import qk_pairs
from shared.messages import IterationRecord, NodeState
from shared.values import FACTORY, Value


if TYPE_CHECKING:
    from services.planner.policy import RequestDone

_REPLAY_AT = 1 << 16
"""Inputs an :class:`Observer` logs before it applies them unasked: bounds what a long run
without queries holds (~40 B an input besides the input's own objects)."""

_ITERS, _DONE, _STATE, _ADVANCE = 0, 1, 2, 3
"""Kinds of logged inputs (:meth:`Observer._replay`)."""

_REPLAY_LEN = 4 * _REPLAY_AT
"""Length of the (flat) log at :data:`_REPLAY_AT` inputs."""


class Bucket(Value):
    """Sums of one grid bucket ``[origin + k·size, origin + (k+1)·size)``."""

    decode_integral: float
    """∫ requests in decode dt over the covered part (request·s)."""
    covered_s: float
    """Seconds of the bucket the integral covers."""
    queue_integral: float
    """∫ cluster prefill queue length dt over the covered part (request·s)."""
    queue_at_start: float | None
    """Cluster prefill queue length (requests) at the bucket start."""
    n_done: int
    sum_uc: float
    sum_c: float
    sum_qk: float
    sum_out: float
    sum_prompt: float
    sum_m2: list[float]
    """Σ of the second-moment terms of the completed requests (:data:`MOMENTS2` order)."""
    n_first: int
    """Requests whose first token fell in this bucket (reported at completion)."""
    cached_by_node: dict[str, float]
    """Σ t_c of the requests each node prefilled (by completion bucket)."""
    prefill_iters: dict[str, int]
    prefill_uncached: dict[str, float]
    restored: dict[str, float]
    decode_iters: dict[str, float]
    """Decode iterations (folded records count ``repeat``)."""
    decode_time: dict[str, float]
    """Σ duration·repeat of iterations with a decode part (s)."""

    __slots__ = __match_args__ = (
        "decode_integral", "covered_s", "queue_integral", "queue_at_start", "n_done", "sum_uc", "sum_c", "sum_qk",
        "sum_out", "sum_prompt", "sum_m2", "n_first", "cached_by_node", "prefill_iters", "prefill_uncached", "restored",
        "decode_iters", "decode_time",
    )

    def __init__(
        self, decode_integral: float = 0.0, covered_s: float = 0.0, queue_integral: float = 0.0,
        queue_at_start: float | None = None, n_done: int = 0, sum_uc: float = 0.0, sum_c: float = 0.0,
        sum_qk: float = 0.0, sum_out: float = 0.0, sum_prompt: float = 0.0, sum_m2: Any = FACTORY,
        n_first: int = 0, cached_by_node: Any = FACTORY, prefill_iters: Any = FACTORY,
        prefill_uncached: Any = FACTORY, restored: Any = FACTORY, decode_iters: Any = FACTORY,
        decode_time: Any = FACTORY,
    ) -> None:
        self.decode_integral = decode_integral
        self.covered_s = covered_s
        self.queue_integral = queue_integral
        self.queue_at_start = queue_at_start
        self.n_done = n_done
        self.sum_uc = sum_uc
        self.sum_c = sum_c
        self.sum_qk = sum_qk
        self.sum_out = sum_out
        self.sum_prompt = sum_prompt
        self.sum_m2 = [0.0] * 6 if sum_m2 is FACTORY else sum_m2
        self.n_first = n_first
        self.cached_by_node = {} if cached_by_node is FACTORY else cached_by_node
        self.prefill_iters = {} if prefill_iters is FACTORY else prefill_iters
        self.prefill_uncached = {} if prefill_uncached is FACTORY else prefill_uncached
        self.restored = {} if restored is FACTORY else restored
        self.decode_iters = {} if decode_iters is FACTORY else decode_iters
        self.decode_time = {} if decode_time is FACTORY else decode_time


class SliceStats(Value):
    """One slice of a planning window: w̄_i and q̄_i (paper §5.2)."""

    n: int
    """Requests completed in the slice."""
    t_uc: float
    t_c: float
    qk: float
    """Mean A per request (Eq. 3 is linear in t_uc, A and t_c, so this gives the mean occupancy)."""
    t_out: float
    q: float
    """q̄_i: time-averaged requests in decode (cluster-wide)."""
    prompt: float
    """Mean full prompt length (t_uc + t_c)."""
    queued: float
    """Time-averaged requests waiting for prefill (cluster-wide prefill queues)."""
    moments2: tuple[float, ...]
    """Mean second moments of the completed requests' work, in the order of
    :data:`MOMENTS2`: E[t_uc²], E[A²], E[t_c²], E[t_uc·A], E[t_uc·t_c], E[A·t_c]
    (empty = unknown). With Eq. 3 linear in (t_uc, A, t_c) they give the variance
    of a request's prefill occupancy (the planner's ``latency`` objective)."""

    __slots__ = __match_args__ = ("n", "t_uc", "t_c", "qk", "t_out", "q", "prompt", "queued", "moments2")

    def __init__(
        self, n: int, t_uc: float, t_c: float, qk: float, t_out: float, q: float, prompt: float,
        queued: float = 0.0, moments2: tuple[float, ...] = (),
    ) -> None:
        self.n = n
        self.t_uc = t_uc
        self.t_c = t_c
        self.qk = qk
        self.t_out = t_out
        self.q = q
        self.prompt = prompt
        self.queued = queued
        self.moments2 = moments2


MOMENTS2 = ("uc·uc", "qk·qk", "c·c", "uc·qk", "uc·c", "qk·c")
"""Order of :attr:`SliceStats.moments2` (uc = t_uc, qk = A, c = t_c)."""


def moments2_of(t_uc: float, qk: float, t_c: float) -> tuple[float, float, float, float, float, float]:
    """One request's second-moment terms in :data:`MOMENTS2` order."""
    return (t_uc * t_uc, qk * qk, t_c * t_c, t_uc * qk, t_uc * t_c, qk * t_c)


class Observer:
    """Bucketed measurements for a planner (see the module docstring).

    The inputs (:meth:`on_iterations`, :meth:`on_request_done`, :meth:`on_node_state`,
    :meth:`advance`) are logged, in order, and applied (:meth:`_replay`) only when something
    reads the sums: a query, :meth:`bucket`, :attr:`buckets`, :attr:`decode_now`,
    :attr:`queue_now` (or when the log holds :data:`_REPLAY_AT` inputs). Applying them in
    the order they came is what applying each at once did, and nothing else reads or changes
    the state they change: the reads see the same values. A planner that reads nothing before
    the run ends (the evolving planner during a warm-up longer than the run) applies none of
    them (four list slots per input instead of ~20 dict and float updates per finished request).
    :attr:`latest` and :attr:`latest_at` are set at once (plain overwrites, read by planners
    between queries).

    Args:
        nodes: node ids.
        bucket_s: bucket length (s), > 0.
        origin: simulated time of bucket 0's start.
        keep_buckets: buckets kept behind the newest one (older are dropped).

    Raises:
        ValueError: on a non-positive ``bucket_s`` or ``keep_buckets``.
    """

    def __init__(self, nodes: Sequence[str], bucket_s: float, origin: float = 0.0, keep_buckets: int = 64) -> None:
        if bucket_s <= 0 or keep_buckets < 1:
            raise ValueError(f"bucket_s must be > 0 and keep_buckets >= 1 (got {bucket_s}, {keep_buckets})")
        self.nodes = list(nodes)
        self.bucket_s = float(bucket_s)
        self.origin = float(origin)
        self.keep = keep_buckets
        self._buckets: dict[int, Bucket] = {}
        self.latest: dict[str, NodeState] = {}
        self.latest_at: dict[str, float] = {}
        self._dec: dict[str, float] = {}
        self._que: dict[str, float] = {}
        self._decode_now = 0.0
        self._queue_now = 0.0
        self._t: float | None = None
        self._newest = -(10**9)
        self._log: list[Any] = []
        """Inputs not applied yet, in arrival order, flat: kind, argument, argument, now, kind, ...
        (four list slots an input, no tuple each)."""

    # -- state (current once the logged inputs are applied) ----------------- #

    @property
    def buckets(self) -> dict[int, Bucket]:
        """Index → bucket, the kept ones (the logged inputs applied first)."""
        if self._log:
            self._replay()
        return self._buckets

    @property
    def decode_now(self) -> float:
        """Requests in decode, cluster-wide, per the latest states (the logged inputs applied first)."""
        if self._log:
            self._replay()
        return self._decode_now

    @property
    def queue_now(self) -> float:
        """Prefill queue length, cluster-wide, per the latest states (the logged inputs applied first)."""
        if self._log:
            self._replay()
        return self._queue_now

    def _replay(self) -> None:
        """Apply the logged inputs in arrival order. O(inputs)."""
        log = self._log
        self._log = []
        it = iter(log)
        for kind, a, b, now in zip(it, it, it, it):
            if kind == _ITERS:
                self._iterations(a, b, now)
            elif kind == _DONE:
                self._request_done(a, now)
            elif kind == _STATE:
                self._node_state(a, b[0], b[1], now)
            else:
                self._advance(now)

    # -- grid -------------------------------------------------------------- #

    def index(self, t: float) -> int:
        """Bucket index of time ``t``."""
        return math.floor((t - self.origin) / self.bucket_s + 1e-9)

    def ceil_index(self, t: float) -> int:
        """Index of the first bucket that starts at or after ``t`` (within 1 ns)."""
        return math.ceil((t - self.origin) / self.bucket_s - 1e-9)

    def start_of(self, k: int) -> float:
        return self.origin + k * self.bucket_s

    def bucket(self, k: int) -> Bucket:
        """Bucket ``k``, made if missing (the logged inputs applied first)."""
        if self._log:
            self._replay()
        return self._bucket(k)

    def _bucket(self, k: int) -> Bucket:
        buckets = self._buckets
        b = buckets.get(k)
        if b is None:
            b = buckets[k] = Bucket()
            if k > self._newest:
                self._newest = k
                floor = k - self.keep
                if len(buckets) > self.keep + 8:
                    for old in [i for i in buckets if i < floor]:
                        del buckets[old]
        return b

    # -- inputs (logged) ------------------------------------------------------ #

    def advance(self, now: float) -> None:
        """Integrate the step functions up to ``now`` (idempotent; never goes back). O(1): logged."""
        log = self._log
        log += _ADVANCE, None, None, now
        if len(log) >= _REPLAY_LEN:
            self._replay()

    def on_node_state(self, state: NodeState, now: float) -> None:
        """Latest state of its node (at once); the integrated decode population (logged: the
        node's requests in decode and prefill queue length, not the state). O(1)."""
        n = state.node
        self.latest[n] = state
        self.latest_at[n] = now
        dec = float(state.decoding + (state.waiting if state.phase == "decode" else 0))
        que = float(len(state.queue)) if state.phase != "decode" else 0.0
        log = self._log
        log += _STATE, n, (dec, que), now
        if len(log) >= _REPLAY_LEN:
            self._replay()

    def forget(self, node: str, now: float) -> None:
        """``node`` died (the live planner's core found it silent, ``PolicyBase.on_liveness``): from ``now`` it
        adds no requests in decode and no prefill queue (its last state's would count forever: nothing replaces
        it), as if it had reported an empty state; its next state counts again. :attr:`latest` keeps its last
        state (the planners leave dead nodes out). O(1): logged."""
        log = self._log
        log += _STATE, node, (0.0, 0.0), now
        if len(log) >= _REPLAY_LEN:
            self._replay()

    def on_request_done(self, done: RequestDone, now: float) -> None:
        """A finished request, for the bucket of ``now`` (w̄) and of its first token. O(1): logged."""
        log = self._log
        log += _DONE, done, None, now
        if len(log) >= _REPLAY_LEN:
            self._replay()

    def on_iterations(self, node: str, records: Iterable[IterationRecord], now: float) -> None:
        """Iteration records, for the buckets of their starts. O(1): logged (``records`` is kept
        as it is until applied: the caller must not change it)."""
        log = self._log
        log += _ITERS, node, records, now
        if len(log) >= _REPLAY_LEN:
            self._replay()

    # -- inputs (applied) ------------------------------------------------------ #

    def _advance(self, now: float) -> None:
        """:meth:`advance` applied. O(buckets crossed)."""
        if self._t is None:
            self._t = now
            b = self._bucket(self.index(now))
            if b.queue_at_start is None:
                b.queue_at_start = self._queue_now
            return
        t = self._t
        while t < now:
            k = self.index(t)
            end = min(now, self.start_of(k + 1))
            if end <= t:  # float guard at a boundary
                end = min(now, self.start_of(k + 2))
            b = self._bucket(k)
            b.decode_integral += self._decode_now * (end - t)
            b.queue_integral += self._queue_now * (end - t)
            b.covered_s += end - t
            if end >= self.start_of(k + 1) - 1e-9:
                nb = self._bucket(k + 1)
                if nb.queue_at_start is None:
                    nb.queue_at_start = self._queue_now
            t = end
        self._t = max(self._t, now)

    def _node_state(self, n: str, dec: float, que: float, now: float) -> None:
        """:meth:`on_node_state` applied: node ``n``'s requests in decode and prefill queue
        length (per the module docstring) from ``now``. O(1) amortised."""
        self._advance(now)
        self._decode_now += dec - self._dec.get(n, 0.0)
        self._queue_now += que - self._que.get(n, 0.0)
        self._dec[n] = dec
        self._que[n] = que

    def _request_done(self, done: RequestDone, now: float) -> None:
        """:meth:`on_request_done` applied: the bucket of ``now`` (w̄) and of the first token. O(1)."""
        b = self._bucket(self.index(now))
        t_c = float(max(0, done.cached_tokens))
        t_uc = float(max(0, done.prompt_tokens - done.cached_tokens))
        b.n_done += 1
        b.sum_uc += t_uc
        b.sum_c += t_c
        qk = qk_pairs(t_uc, t_c)
        b.sum_qk += qk
        m2 = b.sum_m2
        for i, v in enumerate(moments2_of(t_uc, qk, t_c)):
            m2[i] += v
        b.sum_out += float(max(1, done.output_tokens))
        b.sum_prompt += float(done.prompt_tokens)
        b.cached_by_node[done.prefill_node] = b.cached_by_node.get(done.prefill_node, 0.0) + t_c
        k_first = self.index(done.arrived_at + done.ttft_s)
        if k_first in self._buckets or k_first >= self._newest - self.keep:
            self._bucket(k_first).n_first += 1

    def _iterations(self, node: str, records: Iterable[IterationRecord], now: float) -> None:
        """:meth:`on_iterations` applied, by each record's start. O(records): :meth:`index` and,
        for a bucket that exists (all but one record per bucket), :meth:`_bucket` inline."""
        buckets = self._buckets
        origin = self.origin
        size = self.bucket_s
        floor = math.floor
        for r in records:
            k = floor((r.start - origin) / size + 1e-9)
            b = buckets.get(k)
            if b is None:
                b = self._bucket(k)
            if r.phase != "decode":
                b.prefill_iters[node] = b.prefill_iters.get(node, 0) + 1
                b.prefill_uncached[node] = b.prefill_uncached.get(node, 0.0) + r.sum_uncached
                b.restored[node] = b.restored.get(node, 0.0) + r.sum_restored
            if r.phase != "prefill":
                b.decode_iters[node] = b.decode_iters.get(node, 0.0) + r.repeat
                b.decode_time[node] = b.decode_time.get(node, 0.0) + r.duration_s * r.repeat

    # -- queries (each applies the logged inputs first) ------------------------ #

    def _range(self, k0: int, k1: int) -> list[Bucket]:
        if self._log:
            self._replay()
        buckets = self._buckets
        return [buckets[k] for k in range(k0, k1) if k in buckets]

    def slices(self, k0: int, m: int) -> list[SliceStats]:
        """w̄_i and q̄_i of buckets ``k0 .. k0+m-1`` (a slice with no completed request has n = 0)."""
        if self._log:
            self._replay()
        out: list[SliceStats] = []
        for k in range(k0, k0 + m):
            b = self._buckets.get(k)
            cov = b is not None and b.covered_s > 0
            if b is None or b.n_done == 0:
                q = (b.decode_integral / b.covered_s) if cov else 0.0  # type: ignore[union-attr]
                qq = (b.queue_integral / b.covered_s) if cov else 0.0  # type: ignore[union-attr]
                out.append(SliceStats(0, 0.0, 0.0, 0.0, 0.0, q, 0.0, qq))
                continue
            n = b.n_done
            q = b.decode_integral / b.covered_s if cov else self._decode_now
            qq = b.queue_integral / b.covered_s if cov else self._queue_now
            out.append(
                SliceStats(
                    n, b.sum_uc / n, b.sum_c / n, b.sum_qk / n, b.sum_out / n, q, b.sum_prompt / n, qq, tuple(v / n for v in b.sum_m2)
                )
            )
        return out

    def pooled(self, k0: int, k1: int) -> SliceStats:
        """w̄ and q̄ pooled over buckets ``[k0, k1)``."""
        bs = self._range(k0, k1)
        n = sum(b.n_done for b in bs)
        cov = sum(b.covered_s for b in bs)
        q = sum(b.decode_integral for b in bs) / cov if cov > 0 else self._decode_now
        qq = sum(b.queue_integral for b in bs) / cov if cov > 0 else self._queue_now
        if n == 0:
            return SliceStats(0, 0.0, 0.0, 0.0, 0.0, q, 0.0, qq)
        return SliceStats(
            n,
            sum(b.sum_uc for b in bs) / n,
            sum(b.sum_c for b in bs) / n,
            sum(b.sum_qk for b in bs) / n,
            sum(b.sum_out for b in bs) / n,
            q,
            sum(b.sum_prompt for b in bs) / n,
            qq,
            tuple(sum(b.sum_m2[i] for b in bs) / n for i in range(6)),
        )

    def mean_chunk_tokens(self, node: str, k0: int, k1: int) -> float | None:
        """t̄_n: mean uncached tokens per prefill iteration of ``node`` over ``[k0, k1)``, or None."""
        bs = self._range(k0, k1)
        it = sum(b.prefill_iters.get(node, 0) for b in bs)
        if it == 0:
            return None
        return sum(b.prefill_uncached.get(node, 0.0) for b in bs) / it

    def restored_share(self, node: str, k0: int, k1: int) -> float | None:
        """f_n: tokens ``node`` restored from host / cached tokens of the requests it prefilled, or None."""
        bs = self._range(k0, k1)
        cached = sum(b.cached_by_node.get(node, 0.0) for b in bs)
        if cached <= 0:
            return None
        return min(1.0, sum(b.restored.get(node, 0.0) for b in bs) / cached)

    def tpot(self, node: str, k0: int, k1: int, accepted_per_iteration: float) -> float | None:
        """Mean time per output token on ``node`` over ``[k0, k1)``: mean decode iteration / t_acc, or None."""
        bs = self._range(k0, k1)
        it = sum(b.decode_iters.get(node, 0.0) for b in bs)
        if it <= 0:
            return None
        return sum(b.decode_time.get(node, 0.0) for b in bs) / it / max(accepted_per_iteration, 1e-9)

    def arrival_rate(self, k0: int, k1: int) -> float:
        """λ̂ over buckets ``[k0, k1)`` (requests/s) by conservation at the prefill queue.

        arrivals = first tokens + (queue at the end − queue at the start). First
        tokens are known at completion, so a request still decoding at the end is
        counted through the decode population (``decode_now``, requests that
        started decoding inside the range when decode time ≪ range). Call at the
        end of the range (after :meth:`advance`).
        """
        length = (k1 - k0) * self.bucket_s
        if length <= 0:
            return 0.0
        bs = self._range(k0, k1)
        first = sum(b.n_first for b in bs)
        start = self._buckets.get(k0)
        q0 = start.queue_at_start if start is not None and start.queue_at_start is not None else self._queue_now
        return max(0.0, (first + self._decode_now + self._queue_now - q0) / length)

    def requests_in(self, k0: int, k1: int) -> int:
        return sum(b.n_done for b in self._range(k0, k1))
