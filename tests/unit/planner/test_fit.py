"""NNLS fit of Eq. 1/2 (services/planner/fit.py): recovery, held-out error, mixed records, φ, fallbacks."""

import math

import numpy as np
import pytest

from shared.itermodel import DecodeModel, PrefillModel
from shared.messages import IterationRecord
from shared.profile import load_profile
from services.planner.fit import FitSamples, expert_coverage, fit_node, mean_relative_error, median_prefill

from .helpers import records

GB = load_profile("gb300-glm52")
PRIOR_P = PrefillModel(c0=0.03, c1=5e-5, c2=5e-10, c3=5e-8)  # deliberately wrong priors
PRIOR_D = DecodeModel(d0=0.01, d1=0.03, d2=0.001, active_experts=8, experts=256, tokens_per_forward=4.0, accepted_per_iteration=3.2)


def test_recovers_known_coefficients_without_noise():
    recs = records(600, GB.prefill, GB.decode, seed=1)
    f = fit_node(recs, PRIOR_P, PRIOR_D)
    assert f.prefill is not None and f.decode is not None
    # the weak pull toward the (wrong) prior biases the fit by well under 1%, except for c3,
    # whose restored tokens add only a few ms to iterations of hundreds of ms
    for name, rel in (("c0", 5e-3), ("c1", 5e-3), ("c2", 5e-3), ("c3", 5e-2)):
        assert getattr(f.prefill, name) == pytest.approx(getattr(GB.prefill, name), rel=rel)
    for name in ("d0", "d1", "d2"):
        assert getattr(f.decode, name) == pytest.approx(getattr(GB.decode, name), rel=5e-3)
    assert f.mixed_case == "c0>=d0"  # the profile has c0 = 15 ms > d0 = 4.2 ms
    assert f.fit_error < 1e-3
    exact = fit_node(recs, PRIOR_P, PRIOR_D, prior_weight=0.0)
    assert exact.prefill.c0 == pytest.approx(GB.prefill.c0, rel=1e-6)
    assert exact.decode.d1 == pytest.approx(GB.decode.d1, rel=1e-6)


def test_noisy_records_held_out_error_below_five_percent():
    recs = records(3000, GB.prefill, GB.decode, seed=2, noise=0.03)
    f = fit_node(recs[:2000], PRIOR_P, PRIOR_D)
    assert f.prefill is not None and f.decode is not None
    held_out = recs[2000:]
    err = mean_relative_error(held_out, f.prefill, f.decode)
    truth = mean_relative_error(held_out, GB.prefill, GB.decode)  # the noise floor
    assert err < 0.05
    assert err < truth * 1.05
    assert f.prefill.c2 == pytest.approx(GB.prefill.c2, rel=0.05)
    assert f.decode.d2 == pytest.approx(GB.decode.d2, rel=0.1)


def test_mixed_records_when_decode_fixed_cost_is_larger():
    pm = PrefillModel(c0=0.002, c1=2e-5, c2=2e-10, c3=1e-8)
    dm = DecodeModel(d0=0.012, d1=0.01, d2=4e-4, active_experts=8, experts=256, tokens_per_forward=4.0, accepted_per_iteration=3.2)
    recs = records(800, pm, dm, seed=3)
    f = fit_node(recs, PRIOR_P, PRIOR_D)
    assert f.mixed_case == "d0>c0"
    assert f.prefill.c0 == pytest.approx(0.002, rel=2e-2)
    assert f.decode.d0 == pytest.approx(0.012, rel=1e-3)


def test_only_mixed_and_decode_records_still_identify_prefill_terms():
    recs = records(800, GB.prefill, GB.decode, seed=4, mix=(0.0, 0.3, 0.7))
    f = fit_node(recs, PRIOR_P, PRIOR_D)
    assert f.prefill.c0 == pytest.approx(GB.prefill.c0, rel=1e-2)  # mixed intercept is max(c0, d0) = c0
    assert f.prefill.c1 == pytest.approx(GB.prefill.c1, rel=1e-2)


def test_budget_filling_mixed_records_are_collinear_and_the_prior_decides():
    """Every mixed iteration fills the 8,192-token budget: Σt_uc = 8192 − 4B, so c0, c1 and d2
    trade off exactly; the weak prior pull picks the prior-consistent solution, and the
    predictions on such records stay exact either way."""
    dm = GB.decode
    recs = []
    for b in range(1, 60):
        uc = 8192 - 4 * b
        qk = int(uc * 100_000 + uc * (uc + 1) / 2)
        t = GB.prefill.iteration_time(uc, qk) + dm.iteration_time(b) - min(GB.prefill.c0, dm.d0)
        recs.append(IterationRecord(start=0, duration_s=t, phase="mixed", sum_uncached=uc, sum_qk_pairs=qk, decode_batch=b))
    f = fit_node(recs, GB.prefill, GB.decode)
    assert f.prefill.c1 == pytest.approx(GB.prefill.c1, rel=1e-3)
    assert f.decode.d2 == pytest.approx(GB.decode.d2, rel=1e-3)
    assert mean_relative_error(recs, f.prefill, f.decode) < 1e-4


def test_expert_coverage_and_dense_fallback():
    moe = GB.decode
    b = np.array([1.0, 8.0, 64.0])
    phi = expert_coverage(b, moe)
    assert phi == pytest.approx([1 - (1 - 8 / 256) ** (4 * x) for x in b])
    assert phi[1] == pytest.approx(moe.expert_coverage(8))
    dense = DecodeModel(d0=0.005, d1=0.0, d2=3e-4)
    assert expert_coverage(b, dense) == pytest.approx([1.0, 1.0, 1.0])
    truth = DecodeModel(d0=0.007, d1=0.0, d2=3e-4)
    recs = records(300, GB.prefill, truth, seed=5, mix=(0.3, 0.7, 0.0))
    f = fit_node(recs, PRIOR_P, dense)
    assert f.decode.d1 == 0.0  # φ ≡ 1 would duplicate d0: not fitted
    assert f.decode.d0 == pytest.approx(0.007, rel=1e-4)
    assert f.decode.d2 == pytest.approx(3e-4, rel=1e-4)


def test_feature_never_seen_keeps_the_prior():
    recs = records(400, GB.prefill, GB.decode, seed=6, restore=False)
    f = fit_node(recs, PRIOR_P, PRIOR_D)
    assert f.prefill.c3 == PRIOR_P.c3
    assert f.prefill.c1 == pytest.approx(GB.prefill.c1, rel=1e-4)


def test_too_few_records_give_no_model_for_that_side():
    recs = records(60, GB.prefill, GB.decode, seed=7, mix=(0.0, 1.0, 0.0))
    f = fit_node(recs, PRIOR_P, PRIOR_D, min_samples=8)
    assert f.prefill is None and f.decode is not None
    assert f.decode.d2 == pytest.approx(GB.decode.d2, rel=1e-4)
    assert fit_node([], PRIOR_P, PRIOR_D).prefill is None


def test_folded_records_weigh_by_repeat_and_zero_durations_are_ignored():
    dm = GB.decode
    recs = [IterationRecord(start=0, duration_s=dm.iteration_time(b), phase="decode", decode_batch=b, repeat=5) for b in range(1, 40)]
    recs.append(IterationRecord(start=0, duration_s=0.0, phase="decode", decode_batch=3))
    f = fit_node(recs, PRIOR_P, PRIOR_D)
    assert f.decode.d0 == pytest.approx(dm.d0, rel=1e-4)
    assert f.decode_samples == 39


def test_reservoir_keeps_a_bounded_uniform_sample():
    s = FitSamples(cap=100, seed=1)
    recs = [IterationRecord(start=float(i), duration_s=0.01 + i, phase="decode", decode_batch=1) for i in range(2000)]
    s.add(recs)
    assert len(s) == 100 and s.seen == 2000
    durations = sorted(r[5] for r in s.rows)
    assert durations[0] < 500 and durations[-1] > 1500  # from the whole stream, not just its start
    with pytest.raises(ValueError):
        FitSamples(cap=0)


def test_median_prefill_and_nan_error_on_empty():
    m = median_prefill([PrefillModel(c0=1, c1=2, c2=3, c3=4), PrefillModel(c0=3, c1=2, c2=1, c3=0), PrefillModel(c0=2, c1=2, c2=2, c3=2)])
    assert (m.c0, m.c1, m.c2, m.c3) == (2, 2, 2, 2)
    assert math.isnan(mean_relative_error([], GB.prefill, GB.decode))
