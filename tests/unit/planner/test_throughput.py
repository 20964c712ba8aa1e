"""Θ (Eq. 3–5), fewest-change candidates, the significance gate and the M/M/c queueing of the SLO guard."""

import math
import random

import numpy as np
import pytest

from shared.itermodel import qk_pairs
from shared.profile import load_profile
from shared.split import assign_min_change
from services.planner.throughput import (
    ModelTable,
    NodeModelState,
    candidate_masks,
    erlang_c,
    queue_wait,
    significance,
    theta,
    ttft_quantile,
)

from .helpers import sl, state

GB = load_profile("gb300-glm52")


def table(nodes, tbar=8192.0, f=0.1):
    return ModelTable(nodes, {n: NodeModelState(GB.prefill, GB.decode, tbar, f) for n in nodes})


def test_candidate_masks_match_assign_min_change():
    rng = random.Random(7)
    for n in range(2, 10):
        for _ in range(20):
            nodes = [f"n{i}" for i in range(n)]
            rng.shuffle(nodes)
            p0 = rng.randint(1, n - 1)
            phases = {x: ("prefill" if i < p0 else "decode") for i, x in enumerate(rng.sample(nodes, n))}
            phases = {x: phases[x] for x in nodes}  # node order independent of phase order
            counts, mask, got_p0 = candidate_masks(phases)
            assert got_p0 == p0
            for j, p in enumerate(counts):
                want = assign_min_change(phases, int(p))
                assert [want[x] == "prefill" for x in phases] == list(mask[j])


def test_prefill_rate_is_eq3():
    nodes = ["a", "b"]
    t = table(nodes, tbar=4096.0, f=0.25)
    s = sl(t_uc=3000, t_c=50_000)
    mu = t.prefill_rates([s])
    st = NodeModelState(GB.prefill, GB.decode, 4096.0, 0.25)
    want = GB.prefill.c0 * 3000 / 4096 + GB.prefill.c1 * 3000 + GB.prefill.c2 * qk_pairs(3000, 50_000) + GB.prefill.c3 * 0.25 * 50_000
    assert st.prefill_request_time(3000, 50_000) == pytest.approx(want)
    assert mu[0, 0] == pytest.approx(1 / want)


def test_theta_by_hand_for_a_small_cluster():
    nodes = ["a", "b", "c"]
    phases = {"a": "prefill", "b": "decode", "c": "decode"}
    t = table(nodes)
    s = sl(t_uc=4000, t_c=100_000, t_out=1000, q=20)
    counts, mask, p0 = candidate_masks(phases)
    th = theta(mask, t.prefill_rates([s]), t.decode_rates([s], len(nodes) - counts, 64.0))
    mu_p = 1 / NodeModelState(GB.prefill, GB.decode, 8192.0, 0.1).prefill_request_time(4000, 100_000)
    # p = 1: one prefill node, B = 20 / 2 = 10 on two decode nodes (Eq. 4)
    mu_d = GB.decode.accepted_per_iteration * 10 / (GB.decode.iteration_time(10) * 1000)
    assert th[0, 0] == pytest.approx(min(mu_p, 2 * mu_d))
    # p = 2: B = 20 on one decode node
    mu_d1 = GB.decode.accepted_per_iteration * 20 / (GB.decode.iteration_time(20) * 1000)
    assert th[1, 0] == pytest.approx(min(2 * mu_p, mu_d1))


def test_batch_is_capped_at_max_running():
    nodes = ["a", "b"]
    t = table(nodes)
    s = sl(q=1000, t_out=100)
    mu = t.decode_rates([s], np.array([1]), 64.0)
    assert mu[0, 0, 0] == pytest.approx(64 * 3.2 / (GB.decode.iteration_time(64) * 100))
    assert t.decode_capacity(100, 64.0)[0] == pytest.approx(mu[0, 0, 0])


def test_dense_decode_in_the_table():
    from shared.itermodel import DecodeModel

    dense = DecodeModel(d0=0.01, d1=0.005, d2=1e-3)
    t = ModelTable(["a"], {"a": NodeModelState(GB.prefill, dense, 8192.0, 0.0)})
    assert t.decode_iteration(np.array([4.0]))[0, 0] == pytest.approx(dense.iteration_time(4))


def test_significance_gate_on_hand_made_gains():
    steady = [0.5, 0.6, 0.4, 0.55, 0.45, 0.5, 0.52, 0.48, 0.5, 0.5]
    burst = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]  # one slice of a sub-agent burst
    negative = [-0.2] * 5 + [-0.1] * 5
    mean, std, thr, qual = significance(np.array([steady, burst, negative]), z=2.0)
    assert list(qual) == [True, False, False]
    assert mean[1] == pytest.approx(0.5)
    assert thr[1] == pytest.approx(2 * np.std(burst, ddof=1) / math.sqrt(10))
    # constant positive gains: σ = 0, any positive mean qualifies; zero never does
    assert list(significance(np.array([[0.1] * 4, [0.0] * 4]))[3]) == [True, False]
    with pytest.raises(ValueError):
        significance(np.array([[1.0]]))


def test_erlang_c_known_values():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = ρ
    # M/M/2, a = 1: C = (a^2/2!·1/(1−ρ)) / (1 + a + a^2/2!·1/(1−ρ)) = 1/3
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(3, 0.0) == 0.0


def test_ttft_quantile():
    assert ttft_quantile([1.0], 0.0) == pytest.approx(1.0)
    assert ttft_quantile([1.0, 1.0], 2.0) == math.inf
    assert ttft_quantile([], 1.0) == math.inf
    # M/M/1, μ = 1, λ = 0.5: P(W > t) = 0.5·e^(−0.5 t) → t95 = ln(10)/0.5
    assert ttft_quantile([1.0], 0.5, 0.95) == pytest.approx(math.log(10) / 0.5 + 1.0)
    lo, hi = (ttft_quantile([2.0] * c, 5.0) for c in (3, 4))
    assert hi < lo  # one more prefill node shortens the predicted wait


def test_queue_wait_is_eq7_sum():
    st = NodeModelState(GB.prefill, GB.decode, 8192.0, 0.0)
    s = state("a", "prefill", queue=3, qwork=(2000, 50_000), remaining=0.2)
    want = 0.2 + 3 * st.prefill_request_time(2000, 50_000, restored=0)
    assert queue_wait(st, s.remaining_s, s.queue) == pytest.approx(want)
