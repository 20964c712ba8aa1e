"""Throughput of a PD split from the iteration-time models (paper Eq. 3–6), vectorised; queueing for the SLO guard.

Contains zero I/O. Shapes: N nodes, P = N − 1 candidate prefill counts
(p = 1 .. N−1), m slices. One call evaluates every candidate on every slice:

    μP[n, i]    = 1 / T^req_P,n(w̄_i)                         Eq. 3   (N, m)
    μD[n, p, i] = B·t_acc / (T_D,n(B)·t̄_out,i),  B = q̄_i/(N−p)  Eq. 4   (N, P, m)
    Θ[p, i]     = min(Σ_{n∈P_p} μP[n, i], Σ_{n∈D_p} μD[n, p, i])  Eq. 5   (P, m)

where (P_p, D_p) is the split with p prefill nodes that changes the fewest
nodes from the current one (:func:`candidate_masks`, the same assignment as
``shared.split.assign_min_change``). The planner's gains are
``g[p, i] = Θ[p, i] − Θ[p0, i]`` (Eq. 6). Cost: O(N·P·m) arithmetic in numpy,
~40K terms at N = 64, m = 10.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

from shared.itermodel import DecodeModel, PrefillModel
from shared.messages import Phase, QueuedWork
from shared.values import Value
from services.planner.observe import SliceStats


class NodeModelState(Value):
    """The models the planner holds for one node: frozen Eq. 1/2 coefficients plus the
    re-measured t̄_n and f_n (paper §5.1)."""

    prefill: PrefillModel
    decode: DecodeModel
    mean_chunk_tokens: float
    """t̄_n (tokens per prefill iteration)."""
    restored_share: float
    """f_n (share of cached tokens restored from host)."""
    source: str
    """``fitted``, ``peer`` or ``profile``."""
    samples: int
    fit_error: float

    __slots__ = __match_args__ = (
        "prefill", "decode", "mean_chunk_tokens", "restored_share", "source", "samples", "fit_error",
    )

    def __init__(
        self, prefill: PrefillModel, decode: DecodeModel, mean_chunk_tokens: float, restored_share: float,
        source: str = "profile", samples: int = 0, fit_error: float = 0.0,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.mean_chunk_tokens = mean_chunk_tokens
        self.restored_share = restored_share
        self.source = source
        self.samples = samples
        self.fit_error = fit_error

    def prefill_request_time(self, t_uc: float, t_c: float, qk: float | None = None, restored: float | None = None) -> float:
        """Eq. 3 for one request (s); ``qk`` defaults to A(t_uc, t_c), ``restored`` to f_n·t_c."""
        p = self.prefill
        a = qk if qk is not None else t_uc * t_c + t_uc * (t_uc + 1) / 2.0
        rst = restored if restored is not None else self.restored_share * t_c
        return p.c0 * t_uc / max(self.mean_chunk_tokens, 1.0) + p.c1 * t_uc + p.c2 * a + p.c3 * rst


class ModelTable:
    """Per-node coefficient vectors in node order (built once per evaluation).

    Args:
        nodes: node order of the arrays.
        models: node → :class:`NodeModelState`.

    Raises:
        KeyError: if a node has no model.
    """

    __slots__ = ("nodes", "c0", "c1", "c2", "c3", "d0", "d1", "d2", "keep", "tfwd", "dense", "tacc", "tbar", "f", "_phi_groups")

    def __init__(self, nodes: Sequence[str], models: Mapping[str, NodeModelState]) -> None:
        self.nodes = list(nodes)
        ms = [models[n] for n in self.nodes]
        self.c0 = np.array([m.prefill.c0 for m in ms])
        self.c1 = np.array([m.prefill.c1 for m in ms])
        self.c2 = np.array([m.prefill.c2 for m in ms])
        self.c3 = np.array([m.prefill.c3 for m in ms])
        self.d0 = np.array([m.decode.d0 for m in ms])
        self.d1 = np.array([m.decode.d1 for m in ms])
        self.d2 = np.array([m.decode.d2 for m in ms])
        self.dense = np.array([m.decode.experts <= 0 or m.decode.active_experts <= 0 for m in ms])
        self.keep = np.array(
            [1.0 if d else 1.0 - m.decode.active_experts / m.decode.experts for m, d in zip(ms, self.dense)]
        )
        """1 − k/E per node (φ base)."""
        self.tfwd = np.array([m.decode.tokens_per_forward for m in ms])
        self.tacc = np.array([m.decode.accepted_per_iteration for m in ms])
        self.tbar = np.array([max(m.mean_chunk_tokens, 1.0) for m in ms])
        self.f = np.array([m.restored_share for m in ms])
        self._phi_groups: tuple[list[tuple[float, float, bool]], np.ndarray] | None = None

    def prefill_rates(self, w: Sequence[SliceStats]) -> np.ndarray:
        """μP[n, i] = 1/T^req_P,n(w̄_i), requests/s (Eq. 3). Shape (N, m)."""
        uc = np.array([s.t_uc for s in w])
        tc = np.array([s.t_c for s in w])
        qk = np.array([s.qk for s in w])
        t = (
            (self.c0 / self.tbar)[:, None] * uc[None, :]
            + self.c1[:, None] * uc[None, :]
            + self.c2[:, None] * qk[None, :]
            + (self.c3 * self.f)[:, None] * tc[None, :]
        )
        return 1.0 / np.maximum(t, 1e-9)

    def prefill_scv(self, w: Sequence[SliceStats]) -> np.ndarray:
        """Squared coefficient of variation of one request's Eq. 3 occupancy per slice, shape (m,).

        Eq. 3 is linear in the request's work, ``S = α·t_uc + c2·A + β·t_c`` (α = c0/t̄ + c1,
        β = c3·f, averaged over the nodes), so ``E[S²]`` follows from the slice's mean second
        moments (:attr:`SliceStats.moments2`) and ``SCV = E[S²]/E[S]² − 1``. A slice without
        second moments gets 1 (exponential service: M/M/c).
        """
        alpha = float(np.mean(self.c0 / self.tbar + self.c1))
        c2 = float(np.mean(self.c2))
        beta = float(np.mean(self.c3 * self.f))
        out = np.ones(len(w))
        for i, s in enumerate(w):
            if not s.moments2:
                continue
            uu, aa, cc, ua, uc, ac = s.moments2
            es = alpha * s.t_uc + c2 * s.qk + beta * s.t_c
            es2 = alpha * alpha * uu + c2 * c2 * aa + beta * beta * cc + 2.0 * (alpha * c2 * ua + alpha * beta * uc + c2 * beta * ac)
            if es > 0:
                out[i] = max(0.0, es2 / (es * es) - 1.0)
        return out

    def decode_iteration(self, batch: np.ndarray) -> np.ndarray:
        """T_D,n(B) for a batch array of any shape S → shape (N, *S) (Eq. 2).

        φ(B) is computed once per distinct MoE shape (k/E, t_fwd) — usually one for
        the whole cluster — and broadcast, so the cost is one ``pow`` over S.
        """
        b = np.asarray(batch, dtype=float)
        extra = (None,) * b.ndim
        col = (slice(None), *extra)
        if self._phi_groups is None:
            keys = list(zip(self.keep.tolist(), self.tfwd.tolist(), self.dense.tolist()))
            uniq = sorted(set(keys))
            self._phi_groups = (uniq, np.array([uniq.index(k) for k in keys]))
        uniq, idx = self._phi_groups
        phis = np.stack([np.ones_like(b) if dense else 1.0 - keep ** (tfwd * b) for keep, tfwd, dense in uniq])
        phi = phis[idx] if len(uniq) > 1 else phis[0][None, ...]
        return self.d0[col] + self.d1[col] * phi + self.d2[col] * b[None, ...]

    def decode_rates(self, w: Sequence[SliceStats], decode_counts: np.ndarray, max_batch: float) -> np.ndarray:
        """μD[n, p, i] with B = min(q̄_i / |D_p|, max_batch), requests/s (Eq. 4). Shape (N, P, m)."""
        q = np.array([s.q for s in w])
        out = np.maximum(np.array([s.t_out for s in w]), 1.0)
        b = np.clip(q[None, :] / np.maximum(decode_counts, 1)[:, None], 1e-6, max_batch)
        td = self.decode_iteration(b)
        return b[None] * self.tacc[:, None, None] / (td * out[None, None, :])

    def decode_capacity(self, t_out: float, max_batch: float) -> np.ndarray:
        """μ_D,n at a full batch (B = max_batch): the most requests/s node n can decode. Shape (N,)."""
        td = self.decode_iteration(np.array(max_batch))
        return max_batch * self.tacc / (td * max(t_out, 1.0))


def candidate_masks(phases: Mapping[str, Phase]) -> tuple[np.ndarray, np.ndarray, int]:
    """Prefill membership of the fewest-change split for every prefill count.

    Nodes keep their phase where possible; decode (or collocated) nodes become
    prefill from the front of ``phases``'s order, prefill nodes become decode
    from the back — exactly ``shared.split.assign_min_change``.

    Returns:
        ``(counts, mask, p0)``: counts = [1 .. N−1]; ``mask[j, n]`` is True if node n
        (in ``phases`` order) is prefill in the split with ``counts[j]`` prefill
        nodes; p0 = current prefill count.
    """
    is_p = np.array([v == "prefill" for v in phases.values()])
    n = len(is_p)
    p0 = int(is_p.sum())
    counts = np.arange(1, n)
    drank = np.cumsum(~is_p) - 1  # rank among non-prefill nodes, front first
    prank_back = np.cumsum(is_p[::-1])[::-1] - 1  # rank among prefill nodes, back first
    grow = counts[:, None] >= p0
    add = (~is_p)[None, :] & (drank[None, :] < (counts - p0)[:, None])
    keep = is_p[None, :] & (prank_back[None, :] >= (p0 - counts)[:, None])
    mask = np.where(grow, is_p[None, :] | add, keep)
    return counts, mask, p0


def theta(mask: np.ndarray, mu_p: np.ndarray, mu_d: np.ndarray) -> np.ndarray:
    """Θ[p, i] = min(prefill capacity, decode capacity) per candidate and slice (Eq. 5). Shape (P, m)."""
    pre = mask.astype(float) @ mu_p
    dec = np.einsum("pn,npi->pi", (~mask).astype(float), mu_d)
    return np.minimum(pre, dec)


def significance(gains: np.ndarray, z: float = 2.0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The paper's gate on per-slice gains (§5.2): qualify iff mean(g) > z·std(g)/√m.

    Args:
        gains: shape (candidates, m) per-slice gains g_i (Eq. 6), m ≥ 2.
        z: multiple of the standard error (paper: 2).

    Returns:
        ``(mean, std, threshold, qualifies)``, each of shape (candidates,); std is
        the sample standard deviation (ddof = 1).

    Raises:
        ValueError: if fewer than two slices are given.
    """
    g = np.atleast_2d(np.asarray(gains, dtype=float))
    m = g.shape[1]
    if m < 2:
        raise ValueError(f"the gate needs at least two slices, got {m}")
    mean = g.mean(axis=1)
    std = g.std(axis=1, ddof=1)
    thr = z * std / math.sqrt(m)
    return mean, std, thr, mean > thr


def erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with offered load a = λ/μ (< c).

    Computed through the Erlang B recursion (stable for large c). Returns 1 when a ≥ c.
    """
    if c <= 0 or a >= c:
        return 1.0
    if a <= 0:
        return 0.0
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1.0 - rho * (1.0 - b))


def erlang_c_array(c: np.ndarray, a: np.ndarray) -> np.ndarray:
    """:func:`erlang_c` element-wise (c servers, offered load a), vectorised through the same
    Erlang B recursion; meaningful where 0 ≤ a < c (callers mask the rest). Any shapes that
    broadcast together; the denominator is floored at 1e-12 (a within ~1e-12 of c)."""
    b = np.ones_like(a)
    for k in range(1, int(np.max(c)) + 1):
        b = np.where(k <= c, a * b / (k + a * b), b)
    return b / np.maximum(1.0 - (a / np.maximum(c, 1.0)) * (1.0 - b), 1e-12)


def ttft_quantile(mu: Sequence[float] | np.ndarray, lam: float, q: float = 0.95) -> float:
    """Predicted q-quantile of TTFT (s) for arrivals at rate ``lam`` on a prefill pool.

    The pool is an M/M/c queue: c = number of prefill nodes, μ = their mean
    Eq. 3 rate (the router spreads requests over the pool). The waiting time
    tail of M/M/c is ``P(W > t) = C·exp(−(cμ − λ)t)`` (C = Erlang C), so the
    q-quantile of the wait is ``ln(C/(1−q))/(cμ − λ)`` when C > 1 − q, else 0;
    the request's own service 1/μ is added. Returns ``inf`` when λ ≥ cμ
    (the queue grows without bound) and ``inf`` for an empty pool.
    """
    rates = np.asarray(mu, dtype=float)
    c = int(rates.size)
    if c == 0:
        return math.inf
    m = float(rates.mean())
    if m <= 0:
        return math.inf
    if lam <= 0:
        return 1.0 / m
    if lam >= c * m:
        return math.inf
    cw = erlang_c(c, lam / m)
    tail = 1.0 - q
    wait = math.log(cw / tail) / (c * m - lam) if cw > tail else 0.0
    return wait + 1.0 / m


def ttft_quantiles(mu: np.ndarray, mask: np.ndarray, lam: float, q: float = 0.95) -> np.ndarray:
    """:func:`ttft_quantile` for every candidate pool at once: ``mask`` (P, N) selects each
    candidate's prefill nodes from the per-node rates ``mu`` (N,). Returns shape (P,)."""
    c = mask.sum(axis=1).astype(float)
    tot = mask.astype(float) @ mu
    m = np.where(c > 0, tot / np.maximum(c, 1.0), 0.0)
    out = np.full(len(c), math.inf)
    ok = (c > 0) & (m > 0)
    if lam <= 0:
        out[ok] = 1.0 / m[ok]
        return out
    ok &= lam < c * m
    if not ok.any():
        return out
    cc, mm = c[ok], m[ok]
    a = lam / mm
    cw = erlang_c_array(cc, a)
    tail = 1.0 - q
    rate = cc * mm - lam
    wait = np.where(cw > tail, np.log(np.maximum(cw, tail) / tail) / rate, 0.0)
    out[ok] = wait + 1.0 / mm
    return out


def mean_latencies(
    mask: np.ndarray,
    mu_p: np.ndarray,
    mu_d: np.ndarray,
    lam: np.ndarray,
    q: np.ndarray,
    decode_counts: np.ndarray,
    max_batch: float,
    scv: np.ndarray | None = None,
    decode_capacity: np.ndarray | None = None,
) -> np.ndarray:
    """Predicted mean latency of a request (s) per candidate and slice (beyond the paper; the
    planner's ``latency`` objective). Shape (P, m).

    ``L[p, i] = W_q + 1/μ̄ + T_D(B)·t̄_out/t_acc``: the prefill pool of candidate p is an
    M/G/c queue (c = its prefill nodes, μ̄ = their mean Eq. 3 rate ``mu_p[n, i]``, Poisson
    arrivals at ``lam[i]`` requests/s, service SCV ``scv[i]``) with the Lee–Longton
    approximation ``W_q = (1 + SCV)/2 · C(c, λ/μ̄)/(cμ̄ − λ)`` (Erlang C; SCV = 1 is M/M/c,
    exact); the decode part is one request's Eq. 4 occupancy at ``B = q̄_i/|D_p|`` (the
    batch Eq. 4 uses), i.e. ``B/μ_D`` averaged over the decode nodes. ``inf`` where λ ≥ cμ̄
    (the prefill queue grows without bound), where λ ≥ the decode pool's capacity at a full
    batch (``decode_capacity``; past ``max_batch`` B no longer grows and Eq. 4 alone would
    not show the decode queue) and for a candidate without decode nodes.

    Args:
        mask: (P, N) prefill membership per candidate (:func:`candidate_masks`).
        mu_p: (N, m) prefill rates (:meth:`ModelTable.prefill_rates`).
        mu_d: (N, P, m) decode rates (:meth:`ModelTable.decode_rates`).
        lam: (m,) arrival rate per slice, requests/s.
        q: (m,) requests in decode per slice (q̄_i).
        decode_counts: (P,) decode nodes per candidate.
        max_batch: the cap on B that ``mu_d`` was computed with.
        scv: (m,) squared coefficient of variation of the prefill occupancy
            (:meth:`ModelTable.prefill_scv`); None = 1 (M/M/c).
        decode_capacity: (P, m) requests/s the candidate's decode nodes finish at a full
            batch (:meth:`ModelTable.decode_capacity` summed over them); None = unbounded.
    """
    pm = mask.astype(float)
    c = pm.sum(axis=1)[:, None]  # (P, 1)
    mbar = (pm @ mu_p) / np.maximum(c, 1.0)  # (P, m)
    lam2 = np.broadcast_to(np.asarray(lam, dtype=float)[None, :], mbar.shape)
    ok = (c > 0) & (mbar > 0) & (lam2 < c * mbar)
    a = np.where(ok, lam2 / np.where(mbar > 0, mbar, 1.0), 0.0)
    cw = erlang_c_array(c, a)
    rate = np.where(ok, c * mbar - lam2, 1.0)
    wait = np.where(lam2 > 0, cw / rate, 0.0)
    if scv is not None:
        wait = wait * (1.0 + np.asarray(scv, dtype=float)[None, :]) / 2.0
    prefill = np.where(ok, wait + 1.0 / np.where(mbar > 0, mbar, 1.0), np.inf)
    bsz = np.clip(np.asarray(q, dtype=float)[None, :] / np.maximum(decode_counts, 1)[:, None], 1e-6, max_batch)  # (P, m)
    dm = (~mask).astype(float)
    per_node = bsz[None, :, :] / np.maximum(mu_d, 1e-12)  # (N, P, m): T_D(B)·t_out/t_acc on node n
    decode = np.einsum("pn,npi->pi", dm, per_node) / np.maximum(decode_counts, 1)[:, None]
    decode = np.where(np.asarray(decode_counts)[:, None] > 0, decode, np.inf)
    if decode_capacity is not None:
        decode = np.where(lam2 < decode_capacity, decode, np.inf)
    return prefill + decode


def queue_wait(model: NodeModelState, remaining_s: float, queue: Sequence[QueuedWork]) -> float:
    """Predicted wait before a new request starts on a prefill node: T_rem + Σ Eq. 3 of the queue (paper Eq. 7's Ŵ_n)."""
    total = remaining_s
    for q in queue:
        total += model.prefill_request_time(
            float(q.uncached_tokens), float(q.cached_tokens), restored=float(q.restore_tokens)
        )
    return total
