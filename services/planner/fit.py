"""Online fit of the iteration-time models (paper §5.1, Eq. 1 and 2) by nonnegative least squares.

Contains zero I/O. The evolving planner feeds every :class:`IterationRecord` a
node publishes during the collocated warm-up into that node's
:class:`FitSamples`, then calls :func:`fit_node` once per node and freezes the
result (Alg. E.3 line 1).

What one record says (``shared.messages.IterationRecord``), with the unknowns
``x = (c0, c1, c2, c3, d0, d1, d2)``::

    prefill  T = c0 + c1·Σt_uc + c2·ΣA + c3·Σt_rst
    decode   T = d0 + d1·φ(B) + d2·B                      (Eq. 2, φ of App. B.3)
    mixed    T = T_P + T_D − min(c0, d0)                   (services/worker/scheduler.py)
             = max(c0, d0) + c1·Σt_uc + c2·ΣA + c3·Σt_rst + d1·φ(B) + d2·B

**Mixed records are fitted jointly**, not dropped: the ``sim`` engine runs one
forward pass over the prefill chunks and the decode batch of a collocated node
(SGLang would run them as separate batches, which gives pure records only), so
in a loaded warm-up most records are mixed and pure prefill records are rare.
The ``max(c0, d0)`` makes the mixed row nonlinear; :func:`fit_node` solves the
two linear cases (``c0 ≥ d0``: the mixed intercept is c0; ``d0 > c0``: it is
d0) by NNLS and keeps the case whose solution is consistent with its own
assumption and has the smaller residual.

Rows are weighted by ``sqrt(repeat)/T`` (a folded record of k identical decode
iterations counts k times; residuals are relative, because the paper reports
and the planner needs *relative* error across iterations from 5 ms to 2 s).
Columns are scaled to unit max before NNLS (ΣA reaches 1e10, the intercept is
1) and unscaled after. A feature that is zero in every row (e.g. Σt_rst when
nothing was restored during warm-up) cannot be learnt: its coefficient keeps
the prior (profile) value. A side (prefill or decode) with fewer than
``min_samples`` records is not fitted (``None``); the planner then uses the
median of the nodes that were fitted, or the profile.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

from shared.itermodel import DecodeModel, PrefillModel
from shared.messages import IterationRecord
from shared.values import Value

_PREFILL, _DECODE, _MIXED = 0, 1, 2
_PHASE_CODE = {"prefill": _PREFILL, "decode": _DECODE, "mixed": _MIXED}


def expert_coverage(batch: np.ndarray | float, model: DecodeModel) -> np.ndarray:
    """φ(B) = 1 − (1 − k/E)^(t_fwd·B), vectorised; 1 for a dense model (k or E = 0). Paper App. B.3."""
    b = np.asarray(batch, dtype=float)
    if model.experts <= 0 or model.active_experts <= 0:
        return np.ones_like(b)
    return 1.0 - (1.0 - model.active_experts / model.experts) ** (model.tokens_per_forward * b)


class FitSamples:
    """A bounded, uniform sample of one node's iteration records (features only).

    Keeps every record until ``cap``, then reservoir-samples (Vitter's algorithm R
    with the instance's own seeded RNG, so runs are reproducible), so a long
    warm-up keeps a uniform sample of the whole warm-up rather than its end.

    Args:
        cap: most records kept (≥ 1).
        seed: RNG seed of the reservoir.

    Raises:
        ValueError: if ``cap`` < 1.
    """

    __slots__ = ("cap", "kept", "seen", "_rng")

    def __init__(self, cap: int = 50_000, seed: int = 0) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.cap = cap
        self.kept: list[IterationRecord] = []
        """The sampled records themselves (positive duration), in reservoir order: :attr:`rows`
        is made from them when read (once per fit), not per record added."""
        self.seen = 0
        self._rng = random.Random(seed)

    @property
    def rows(self) -> list[tuple[int, float, float, float, float, float, float]]:
        """(phase code, Σt_uc, ΣA, Σt_rst, B, duration s, repeat) of each kept record, in
        reservoir order (a new list per read). O(kept)."""
        code = _PHASE_CODE
        return [
            (
                code[r.phase],
                float(r.sum_uncached),
                float(r.sum_qk_pairs),
                float(r.sum_restored),
                float(r.decode_batch),
                float(r.duration_s),
                float(r.repeat),
            )
            for r in self.kept
        ]

    def add(self, records: Iterable[IterationRecord]) -> None:
        """Add records; those with a zero duration carry no information and are skipped. O(1) each
        (the record is kept as it is: a frozen message, shared with the caller)."""
        kept = self.kept
        cap = self.cap
        for r in records:
            if r.duration_s <= 0.0:
                continue
            self.seen += 1
            if len(kept) < cap:
                kept.append(r)
            else:
                j = self._rng.randrange(self.seen)
                if j < cap:
                    kept[j] = r

    def clear(self) -> None:
        """Drop the kept records (``seen`` stays)."""
        self.kept = []

    def __len__(self) -> int:
        return len(self.kept)


class NodeFit(Value):
    """Result of :func:`fit_node` for one node."""

    prefill: PrefillModel | None
    """Fitted Eq. 1 coefficients, or None when too few records had a prefill part."""
    decode: DecodeModel | None
    """Fitted Eq. 2 coefficients (shape k, E, t_fwd, t_acc from the prior), or None."""
    prefill_samples: int
    """Records with a prefill part (prefill or mixed)."""
    decode_samples: int
    """Records with a decode part (decode or mixed)."""
    fit_error: float
    """Mean relative error |T̂ − T|/T on the records fitted (0 when nothing was fitted)."""
    mixed_case: str
    """``c0>=d0``, ``d0>c0`` (which linearisation of the mixed rows won) or ``none``."""

    __slots__ = __match_args__ = ("prefill", "decode", "prefill_samples", "decode_samples", "fit_error", "mixed_case")

    def __init__(
        self, prefill: PrefillModel | None, decode: DecodeModel | None, prefill_samples: int,
        decode_samples: int, fit_error: float, mixed_case: str,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.prefill_samples = prefill_samples
        self.decode_samples = decode_samples
        self.fit_error = fit_error
        self.mixed_case = mixed_case


def _design(rows: np.ndarray, prior_decode: DecodeModel) -> np.ndarray:
    """Columns (c0, c1, c2, c3, d0, d1, d2) for case ``c0 ≥ d0`` (mixed intercept = c0)."""
    phase = rows[:, 0]
    has_p = phase != _DECODE
    has_d = phase != _PREFILL
    x = np.zeros((rows.shape[0], 7))
    x[:, 0] = has_p
    x[:, 1] = rows[:, 1]
    x[:, 2] = rows[:, 2]
    x[:, 3] = rows[:, 3]
    x[:, 4] = phase == _DECODE
    x[:, 5] = np.where(has_d, expert_coverage(rows[:, 4], prior_decode), 0.0)
    x[:, 6] = np.where(has_d, rows[:, 4], 0.0)
    return x


def _solve(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, free: np.ndarray, prior: np.ndarray, prior_weight: float
) -> tuple[np.ndarray, float]:
    """Weighted NNLS over the columns in ``free``, with one pseudo-row per coefficient that
    pulls it toward its prior in relative terms (``sqrt(prior_weight)·(x_j/prior_j − 1)``);
    returns (coefficients, weighted residual norm of the data rows)."""
    if not free.any():
        return np.zeros(x.shape[1]), float(np.linalg.norm(y * w))
    a = x[:, free] * w[:, None]
    b = y * w
    pr = prior[free]
    if prior_weight > 0:
        keep = pr > 0
        reg = np.zeros((int(keep.sum()), a.shape[1]))
        reg[np.arange(reg.shape[0]), np.flatnonzero(keep)] = math.sqrt(prior_weight) / pr[keep]
        a = np.vstack([a, reg])
        b = np.concatenate([b, np.full(reg.shape[0], math.sqrt(prior_weight))])
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    from scipy.optimize import nnls  # here: ~1 s of CPU to import, and most runs never fit

    coef_s, _ = nnls(a / scale, b, maxiter=50 * a.shape[1])
    out = np.zeros(x.shape[1])
    out[free] = coef_s / scale
    res = float(np.linalg.norm(x[:, free] @ out[free] * w - y * w))
    return out, res


def fit_node(
    samples: FitSamples | Sequence[IterationRecord],
    prior_prefill: PrefillModel,
    prior_decode: DecodeModel,
    *,
    min_samples: int = 8,
    prior_weight: float = 1e-3,
) -> NodeFit:
    """Fit Eq. 1 and Eq. 2 of one node by weighted NNLS (see the module docstring).

    Args:
        samples: the node's records (a :class:`FitSamples` or plain records).
        prior_prefill: coefficients kept for features absent from every record.
        prior_decode: MoE/MTP shape (k, E, t_fwd, t_acc) used for φ(B) and copied
            into the fitted model; its d0..d2 fill unlearnable coefficients.
        min_samples: records with a prefill (resp. decode) part needed to fit that side.
        prior_weight: weight of the pull toward the prior, in records (each pseudo-row
            counts as one record's relative error). Small: it only decides directions
            the records leave flat (e.g. every mixed iteration filling the 8,192-token
            budget makes Σt_uc = 8192 − t_fwd·B, so c0, c1 and d2 trade off exactly).

    Returns:
        A :class:`NodeFit`; a side with too few records is None.
    """
    if not isinstance(samples, FitSamples):
        s = FitSamples(cap=max(1, len(samples)))
        s.add(samples)
        samples = s
    if not samples.kept:
        return NodeFit(None, None, 0, 0, 0.0, "none")
    rows = np.asarray(samples.rows, dtype=float)
    phase = rows[:, 0]
    n_p = int(np.count_nonzero(phase != _DECODE))
    n_d = int(np.count_nonzero(phase != _PREFILL))
    fit_p, fit_d = n_p >= min_samples, n_d >= min_samples
    if not fit_p and not fit_d:
        return NodeFit(None, None, n_p, n_d, 0.0, "none")
    if not (fit_p and fit_d):  # one side only: its pure records, mixed rows cannot be split
        rows = rows[phase == (_PREFILL if fit_p else _DECODE)]
        phase = rows[:, 0]
        if len(rows) < min_samples:
            return NodeFit(None, None, n_p, n_d, 0.0, "none")
    y = rows[:, 5]
    w = np.sqrt(rows[:, 6]) / y
    x = _design(rows, prior_decode)
    free = np.array([fit_p] * 4 + [fit_d] * 3)
    free &= np.abs(x).max(axis=0) > 0  # a feature never seen cannot be learnt
    dense = prior_decode.experts <= 0 or prior_decode.active_experts <= 0
    if dense:
        free[5] = False  # φ ≡ 1 duplicates the intercept d0
    prior = np.array(
        [prior_prefill.c0, prior_prefill.c1, prior_prefill.c2, prior_prefill.c3, prior_decode.d0, prior_decode.d1, prior_decode.d2]
    )
    if dense:
        prior[5] = 0.0
    mixed = phase == _MIXED
    cases = [("c0>=d0", x)]
    if mixed.any():
        xb = x.copy()  # case d0 > c0: the mixed intercept is d0
        xb[mixed, 0] = 0.0
        xb[mixed, 4] = 1.0
        cases.append(("d0>c0", xb))
    candidates: list[tuple[bool, float, np.ndarray, str]] = []
    for name, xc in cases:
        learnt = free & (np.abs(xc).max(axis=0) > 0)
        coef, res = _solve(xc, y, w, learnt, prior, prior_weight)
        coef = np.where(learnt, coef, prior)  # unlearnable coefficients keep the prior
        consistent = True
        if mixed.any():
            consistent = bool(coef[0] >= coef[4]) if name == "c0>=d0" else bool(coef[4] >= coef[0])
        candidates.append((consistent, res, coef, name))
    candidates.sort(key=lambda c: (not c[0], c[1]))
    _, _, coef, case = candidates[0]
    if not mixed.any():
        case = "none"
    pred = _predict(rows, coef, prior_decode)
    err = float(np.mean(np.abs(pred - y) / y))
    pm = PrefillModel(c0=float(coef[0]), c1=float(coef[1]), c2=float(coef[2]), c3=float(coef[3])) if fit_p else None
    dm = (
        DecodeModel(
            d0=float(coef[4]),
            d1=float(coef[5]),
            d2=float(coef[6]),
            active_experts=prior_decode.active_experts,
            experts=prior_decode.experts,
            tokens_per_forward=prior_decode.tokens_per_forward,
            accepted_per_iteration=prior_decode.accepted_per_iteration,
        )
        if fit_d
        else None
    )
    return NodeFit(pm, dm, n_p, n_d, err, case)


def _predict(rows: np.ndarray, coef: np.ndarray, shape: DecodeModel) -> np.ndarray:
    phase = rows[:, 0]
    tp = coef[0] + coef[1] * rows[:, 1] + coef[2] * rows[:, 2] + coef[3] * rows[:, 3]
    td = coef[4] + coef[5] * expert_coverage(rows[:, 4], shape) + coef[6] * rows[:, 4]
    return np.where(phase == _PREFILL, tp, np.where(phase == _DECODE, td, tp + td - np.minimum(coef[0], coef[4])))


def predict(records: Sequence[IterationRecord], prefill: PrefillModel, decode: DecodeModel) -> np.ndarray:
    """Model duration (s) of each record, with the same mixed-record rule as the ``sim`` engine."""
    s = FitSamples(cap=max(1, len(records)))
    s.add(records)
    if not s.kept:
        return np.zeros(0)
    coef = np.array([prefill.c0, prefill.c1, prefill.c2, prefill.c3, decode.d0, decode.d1, decode.d2])
    return _predict(np.asarray(s.rows, dtype=float), coef, decode)


def mean_relative_error(records: Sequence[IterationRecord], prefill: PrefillModel, decode: DecodeModel) -> float:
    """Mean |T̂ − T|/T over records with a positive duration (NaN when there are none)."""
    kept = [r for r in records if r.duration_s > 0]
    if not kept:
        return math.nan
    pred = predict(kept, prefill, decode)
    y = np.array([r.duration_s for r in kept])
    return float(np.mean(np.abs(pred - y) / y))


def median_prefill(models: Sequence[PrefillModel]) -> PrefillModel:
    """Coefficient-wise median (the ``peer`` fallback for a node with too few records)."""
    a = np.array([[m.c0, m.c1, m.c2, m.c3] for m in models])
    med = np.median(a, axis=0)
    return PrefillModel(c0=float(med[0]), c1=float(med[1]), c2=float(med[2]), c3=float(med[3]))


def median_decode(models: Sequence[DecodeModel], shape: DecodeModel) -> DecodeModel:
    """Coefficient-wise median of d0..d2, with the MoE/MTP shape of ``shape``."""
    a = np.array([[m.d0, m.d1, m.d2] for m in models])
    med = np.median(a, axis=0)
    return DecodeModel(
        d0=float(med[0]),
        d1=float(med[1]),
        d2=float(med[2]),
        active_experts=shape.active_experts,
        experts=shape.experts,
        tokens_per_forward=shape.tokens_per_forward,
        accepted_per_iteration=shape.accepted_per_iteration,
    )
