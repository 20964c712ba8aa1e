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
    mean_latencies,
    queue_wait,
    significance,
    theta,
    ttft_quantile,
)

from services.planner.observe import Observer

from .helpers import done, sl, state

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


def test_mean_latency_by_hand():
    """Three nodes; candidates p = 1 (node a prefill) and p = 2 (a, b prefill); two slices."""
    mask = np.array([[True, False, False], [True, True, False]])
    mu_p = np.array([[2.0, 1.0], [2.0, 1.0], [2.0, 1.0]])  # (N, m) prefill rates
    mu_d = np.full((3, 2, 2), 0.5)  # (N, P, m) decode rates
    lam = np.array([1.0, 0.5])
    q = np.array([4.0, 2.0])
    d_counts = np.array([2, 1])
    lat = mean_latencies(mask, mu_p, mu_d, lam, q, d_counts, max_batch=64.0)
    # p = 1, slice 0: M/M/1 with μ = 2, λ = 1: W_q = ρ/(μ − λ) = 0.5, + 1/μ = 0.5; decode B = 4/2 = 2, B/μ_D = 4
    assert lat[0, 0] == pytest.approx(0.5 + 0.5 + 4.0)
    # p = 1, slice 1: μ = 1, λ = 0.5: W_q = 0.5/0.5 = 1, + 1; decode B = 1, B/μ_D = 2
    assert lat[0, 1] == pytest.approx(1.0 + 1.0 + 2.0)
    # p = 2, slice 1: M/M/2 with μ = 1, λ = 0.5 (a = 0.5, ρ = 0.25):
    # C = (a²/2!)/(1−ρ) / (1 + a + (a²/2!)/(1−ρ)) = (1/6)/(5/3) = 0.1, W_q = C/(2μ − λ) = 0.1/1.5;
    # decode: one node, B = 2, B/μ_D = 4
    assert lat[1, 1] == pytest.approx(0.1 / 1.5 + 1.0 + 4.0)
    assert lat[1, 1] == pytest.approx(erlang_c(2, 0.5) / 1.5 + 1.0 + 4.0)
    # λ ≥ cμ: the prefill queue grows without bound
    over = mean_latencies(mask, mu_p, mu_d, np.array([2.0, 2.0]), q, d_counts, max_batch=64.0)
    assert math.isinf(over[0, 0]) and math.isinf(over[0, 1]) and math.isinf(over[1, 1]) and math.isfinite(over[1, 0])
    # no arrivals: no wait, only the service times
    idle = mean_latencies(mask, mu_p, mu_d, np.zeros(2), q, d_counts, max_batch=64.0)
    assert idle[1, 0] == pytest.approx(0.5 + 8.0)
    # λ at or above the decode pool's full-batch capacity, or no decode node: overloaded
    cap = np.array([[2.0, 0.4], [0.9, 0.9]])  # (P, m) requests/s
    dlim = mean_latencies(mask, mu_p, mu_d, lam, q, d_counts, max_batch=64.0, decode_capacity=cap)
    assert dlim[0, 0] == pytest.approx(lat[0, 0]) and math.isinf(dlim[0, 1]) and math.isinf(dlim[1, 0])
    assert dlim[1, 1] == pytest.approx(lat[1, 1])
    none = mean_latencies(mask, mu_p, mu_d, lam, q, np.array([2, 0]), max_batch=64.0)
    assert math.isinf(none[1, 0]) and math.isfinite(none[0, 0])
    # a batch above the cap is charged at the cap
    capped = mean_latencies(mask, mu_p, mu_d, lam, np.array([400.0, 2.0]), d_counts, max_batch=64.0)
    assert capped[1, 0] == pytest.approx(lat[1, 0] - 8.0 + 64.0 / 0.5)


def test_prefill_scv_is_the_variance_of_eq3_over_the_requests():
    """Observer second moments → SCV of the Eq. 3 occupancy = var/mean² of the per-request Eq. 3 times."""
    rng = random.Random(3)
    # agent-like: mostly short new parts on long cached prefixes, now and then a whole new prompt
    work = [(rng.randint(100, 3000), rng.randint(20_000, 300_000)) if rng.random() < 0.9 else (rng.randint(20_000, 120_000), 0) for _ in range(200)]
    obs = Observer(["a", "b"], 60.0)
    for i, (uc, c) in enumerate(work):
        obs.on_request_done(done(f"r{i}", 10.0 + i * 0.1, prompt=uc + c, cached=c, node="a"), 10.0 + i * 0.1)
    obs.advance(60.0)
    w = obs.slices(0, 1)
    assert w[0].n == len(work) and len(w[0].moments2) == 6
    pooled = obs.pooled(0, 1)
    assert pooled.moments2 == pytest.approx(w[0].moments2)
    st = NodeModelState(GB.prefill, GB.decode, 5000.0, 0.2)
    times = np.array([st.prefill_request_time(float(uc), float(c)) for uc, c in work])
    expect = times.var() / times.mean() ** 2
    got = ModelTable(["a", "b"], {"a": st, "b": st}).prefill_scv(w)
    assert got.shape == (1,) and got[0] == pytest.approx(expect, rel=1e-6)
    assert expect > 1.0  # more variable than exponential service
    # no second moments (hand-made slices): exponential service
    assert table(["a"]).prefill_scv([sl()])[0] == 1.0


def test_mean_latency_scales_the_wait_by_the_service_scv():
    mask = np.array([[True, False]])
    mu_p = np.array([[2.0], [2.0]])
    mu_d = np.full((2, 1, 1), 0.5)
    args = (mask, mu_p, mu_d, np.array([1.0]), np.array([1.0]), np.array([1]), 64.0)
    base = mean_latencies(*args)[0, 0]  # M/M/1: W_q = 0.5, service 0.5, decode 2
    assert base == pytest.approx(0.5 + 0.5 + 2.0)
    assert mean_latencies(*args, scv=np.array([1.0]))[0, 0] == pytest.approx(base)
    assert mean_latencies(*args, scv=np.array([0.0]))[0, 0] == pytest.approx(0.25 + 0.5 + 2.0)  # M/D/1: half the wait
    assert mean_latencies(*args, scv=np.array([9.0]))[0, 0] == pytest.approx(2.5 + 0.5 + 2.0)


def test_queue_wait_is_eq7_sum():
    st = NodeModelState(GB.prefill, GB.decode, 8192.0, 0.0)
    s = state("a", "prefill", queue=3, qwork=(2000, 50_000), remaining=0.2)
    want = 0.2 + 3 * st.prefill_request_time(2000, 50_000, restored=0)
    assert queue_wait(st, s.remaining_s, s.queue) == pytest.approx(want)
