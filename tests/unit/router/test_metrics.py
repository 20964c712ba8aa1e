"""Routing metrics: TTFT prediction error histogram, per-node queue time, queue imbalance."""

from __future__ import annotations

import math

import pytest

from services.router.metrics import Histogram, RouteMetrics, TtftSample


def test_histogram_buckets_are_cumulative_and_quantiles_exact_on_the_window():
    h = Histogram((0.1, 1.0), window=3)
    for x in (0.05, 0.1, 0.5, 2.0, math.nan):
        h.observe(x)
    assert h.count == 4 and h.sum == pytest.approx(2.65) and h.max == 2.0
    assert h.cumulative() == [("0.1", 2), ("1", 3), ("inf", 4)]
    assert list(h.recent) == [0.1, 0.5, 2.0] and h.quantile(0.5) == 0.5 and h.quantile(1.0) == 2.0
    with pytest.raises(ValueError):
        Histogram((1.0, 1.0))


def test_route_metrics_export():
    m = RouteMetrics()
    m.observe(TtftSample("r1", "a", predicted_s=1.0, measured_s=1.2, queue_s=0.5))
    m.observe(TtftSample("r2", "a", predicted_s=2.0, measured_s=1.95, queue_s=1.5))
    m.observe(TtftSample("r3", "b", predicted_s=None, measured_s=0.3, queue_s=0.5))
    m.observe(TtftSample("r4", "b", predicted_s=1.0, measured_s=None, queue_s=None))
    counters, gauges = m.export()
    assert counters["ttft_pred_abs_err_s.count"] == 2 and counters["ttft_pred_over"] == 1
    assert m.ttft_abs_err.cumulative()[:5] == [("0.005", 0), ("0.01", 0), ("0.025", 0), ("0.05", 0), ("0.1", 1)]
    assert m.ttft_abs_err.cumulative()[5] == ("0.25", 2)
    assert gauges["ttft_pred_abs_err_s.median"] == pytest.approx(0.05) and gauges["ttft_pred_err_s.mean_signed"] == pytest.approx(-0.075)
    assert counters["queue_s.count.a"] == 2 and counters["queue_s.count.b"] == 1
    assert gauges["queue_s.mean.a"] == pytest.approx(1.0) and gauges["queue_s.max.a"] == 1.5
    # most loaded node's mean queue (1.0) over the mean of the node means (0.75)
    assert gauges["prefill_queue_imbalance"] == pytest.approx(1.0 / 0.75)
    assert RouteMetrics().export() == ({}, {})


def test_request_latencies_tpot_and_kv_hit_rate():
    m = RouteMetrics()
    m.observe_first_token(0.2, prompt_tokens=1000, cached_tokens=750)
    m.observe_finished(0.2, 1.2, output_tokens=11)  # 1.0 s over 10 tokens after the first
    m.observe_first_token(0.4, prompt_tokens=1000, cached_tokens=2000)  # cached clipped to the prompt
    m.observe_finished(0.4, 0.4, output_tokens=1)  # one token: no TPOT sample
    assert m.ttft.count == 2 and m.e2e.count == 2 and m.tpot.count == 1
    assert m.tpot.sum == pytest.approx(0.1)
    assert m.kv_hit_rate == pytest.approx(1750 / 2000)
    counters, gauges = m.export()
    assert counters["ttft_s.count"] == 2 and counters["tpot_s.count"] == 1
    assert gauges["ttft_s.p95"] == pytest.approx(0.4) and gauges["kv_hit_rate"] == pytest.approx(0.875)


def test_inter_token_latency_spreads_a_chunk_gap_over_its_tokens_and_sums_to_e2e_minus_ttft():
    m = RouteMetrics()
    m.observe_chunk_tokens(None, 2)  # the first chunk: the first token and one more, 0 s after it
    m.observe_chunk_tokens(0.3, 3)  # 3 tokens 0.3 s later: three samples of 0.1 s
    m.observe_chunk_tokens(0.05, 0)  # no tokens: nothing
    assert m.itl.count == 4 and m.itl.sum == pytest.approx(0.3)
    assert m.itl.cumulative()[:4] == [("0.001", 1), ("0.0025", 1), ("0.005", 1), ("0.01", 1)]
    assert m.itl.cumulative()[8] == ("0.1", 4) and list(m.itl.recent) == pytest.approx([0.0, 0.1, 0.1, 0.1]) and m.itl.max == pytest.approx(0.1)
    m.observe_delivered(5)
    m.observe_delivered(-1)
    assert m.generation_tokens == 5
