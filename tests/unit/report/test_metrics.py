"""Report metrics on hand-made records (paper §6, Appendix C)."""

from __future__ import annotations

import json

import pytest

from evolving_infra.report.metrics import period_metrics, prefill_queue_imbalance, summarize, time_series
from evolving_infra.report.timeline import RunTimeline, SplitPoint
from evolving_infra.report.write import build_report

from .helpers import rec, switching_timeline

ISSUE2_KEYS = (
    "requests_sent", "requests_completed", "requests_failed", "throughput_rps", "ttft_mean_s", "ttft_p50_s",
    "ttft_p95_s", "e2e_mean_s", "e2e_p95_s", "tpot_mean_s", "kv_hit_rate", "sessions", "subagent_branches",
    "duration_s",
)
ISSUE5_KEYS = (
    "ideal_kv_hit_rate", "lost_kv_reuse", "prefill_queue_mean_s", "prefill_queue_imbalance", "switches",
    "switch_time_mean_s", "split_timeline",
)


def test_latency_percentiles_and_throughput():
    # TTFT 1..20 s, E2E = TTFT + 10 s; sent every second from t=0
    records = [rec(i, sent_at=float(i), ttft=float(i + 1), e2e=float(i + 11)) for i in range(20)]
    s = summarize(records)
    assert s["ttft_mean_s"] == pytest.approx(10.5)
    assert s["ttft_p50_s"] == pytest.approx(10.5)
    # linear interpolation: rank 0.95 * 19 = 18.05 → 19 + 0.05 * (20 - 19)
    assert s["ttft_p95_s"] == pytest.approx(19.05)
    assert s["e2e_mean_s"] == pytest.approx(20.5)
    assert s["e2e_p95_s"] == pytest.approx(29.05)
    # span: first send 0 → last finish 19 + 30 = 49 s
    assert s["start_s"] == 0.0 and s["end_s"] == pytest.approx(49.0)
    assert s["throughput_rps"] == pytest.approx(20 / 49.0)


def test_tpot_skips_single_token_and_failed_requests():
    records = [
        rec(0, ttft=1.0, e2e=3.0, out=5),  # (3 - 1) / 4 = 0.5
        rec(1, ttft=1.0, e2e=4.0, out=3),  # (4 - 1) / 2 = 1.5
        rec(2, ttft=1.0, e2e=1.0, out=1),  # one token: no TPOT
        rec(3, ok=False, out=9),
    ]
    s = summarize(records)
    assert s["tpot_mean_s"] == pytest.approx((0.5 + 1.5) / 2)
    assert s["requests_failed"] == 1 and s["requests_completed"] == 3
    assert s["ttft_mean_s"] == pytest.approx(1.0)  # the failed request has no TTFT


def test_kv_hit_rate_and_lost_kv_reuse():
    records = [
        rec(0, prompt=100, cached=50),
        rec(1, prompt=100, cached=30),
        rec(2, prompt=1000, cached=1000, ok=False),  # failed: not counted
    ]
    s = summarize(records, ideal_kv_hit_rate=0.8)
    assert s["kv_hit_rate"] == pytest.approx(0.4)
    assert s["lost_kv_reuse"] == pytest.approx(1 - 0.4 / 0.8)
    assert s["ideal_kv_hit_rate"] == 0.8


def test_ideal_hit_rate_from_record_field_when_caller_has_none():
    records = [rec(0, prompt=100, cached=40, ideal=80), rec(1, prompt=100, cached=40, ideal=80)]
    s = summarize(records)
    assert s["ideal_kv_hit_rate"] == pytest.approx(0.8)
    assert s["lost_kv_reuse"] == pytest.approx(0.5)
    # without any source of h*, lost KV reuse is not reported
    s2 = summarize([rec(0, prompt=100, cached=40)])
    assert s2["ideal_kv_hit_rate"] is None and s2["lost_kv_reuse"] is None


def test_prefill_queue_mean_p95():
    records = [rec(i, queue=float(q)) for i, q in enumerate([1, 2, 3, 4])] + [rec(9, queue=None)]
    s = summarize(records)
    assert s["prefill_queue_samples"] == 4
    assert s["prefill_queue_mean_s"] == pytest.approx(2.5)
    assert s["prefill_queue_p95_s"] == pytest.approx(3.85)


def test_prefill_queue_imbalance_two_nodes():
    # load = total queue seconds of the requests that *start prefill* on the node in the minute.
    # minute 0: w0 queues 1 + 2 = 3 s, w1 queues 1 s → max / mean = 3 / 2 = 1.5
    # minute 1: w0 2 s; w1 20 s from the request sent at 50 s, which starts prefill at
    #           50 + 20 = 70 s and so belongs to minute 1 → 20 / 11
    records = [
        rec(0, sent_at=0.0, node="w0", queue=1.0),
        rec(1, sent_at=10.0, node="w0", queue=2.0),
        rec(2, sent_at=20.0, node="w1", queue=1.0),
        rec(3, sent_at=65.0, node="w0", queue=2.0),
        rec(4, sent_at=50.0, node="w1", queue=20.0),
    ]
    mean, per = prefill_queue_imbalance(records, start=0.0, end=120.0)
    assert per[0] == pytest.approx(3.0 / 2.0)
    assert per[1] == pytest.approx(20.0 / 11.0)
    assert mean == pytest.approx((1.5 + 20.0 / 11.0) / 2)


def test_imbalance_counts_idle_prefill_nodes_from_timeline_and_skips_idle_minutes():
    records = [rec(0, sent_at=5.0, node="w0", queue=2.0), rec(1, sent_at=70.0, node="w0", queue=0.0)]
    # records alone: one node in minute 0 → 1.0; minute 1 has no queueing → skipped
    mean, per = prefill_queue_imbalance(records, start=0.0, end=120.0)
    assert per == [pytest.approx(1.0), None]
    assert mean == pytest.approx(1.0)
    # the timeline says w1 also served prefill: it idled with load 0 → 2 / 1 = 2
    tl = RunTimeline(split_timeline=[SplitPoint(t=0.0, split="2P2D", prefill=2, decode=2, prefill_nodes=["w0", "w1"])])
    mean, per = prefill_queue_imbalance(records, start=0.0, end=120.0, timeline=tl)
    assert per[0] == pytest.approx(2.0)
    assert mean == pytest.approx(2.0)
    # no queue data at all → None
    assert prefill_queue_imbalance([rec(0)], start=0.0, end=60.0) == (None, [None])


def test_time_series_throughput_and_lost_kv_reuse():
    records = [
        rec(0, sent_at=0.0, e2e=10.0, prompt=100, cached=20, ideal=40),  # finishes 10 s
        rec(1, sent_at=5.0, e2e=10.0, prompt=100, cached=40, ideal=40),  # finishes 15 s
        rec(2, sent_at=70.0, e2e=50.0, prompt=100, cached=0, ideal=50),  # finishes 120 s = end
    ]
    ts = time_series(records, start=0.0, end=120.0, window_s=60.0)
    assert ts["t_s"] == [0.0, 60.0]
    assert ts["completed"] == [2, 1]
    assert ts["throughput_rps"] == [pytest.approx(2 / 60), pytest.approx(1 / 60)]
    # window 0: 1 - 60 / 80; window 1: 1 - 0 / 50
    assert ts["lost_kv_reuse"] == [pytest.approx(0.25), pytest.approx(1.0)]
    # without the per-request field the series is absent, never estimated
    plain = [rec(0, sent_at=0.0, e2e=10.0, cached=20)]
    assert "lost_kv_reuse" not in time_series(plain, start=0.0, end=60.0)


def test_build_report_keys_timeline_and_extra():
    records = [rec(i, sent_at=10.0 * i, node=f"w{i % 2}", queue=0.5, kind="subagent" if i == 3 else "main",
                   branch=f"b{i % 2}" if i != 3 else "sub") for i in range(30)]
    report = build_report(records, meta={"command": "t"}, ideal_kv_hit_rate=0.5, timeline=switching_timeline(),
                          extra={"sim_speed": 123.0, "final_split": "override"})
    for k in ISSUE2_KEYS + ISSUE5_KEYS + ("final_split", "series", "timeline", "prefill_queue_by_node"):
        assert k in report, k
    # 3 node switches: w1 P→D (decided 95, applied 100: 5 s), w1 D→P (3 s), w2 D→P (4 s)
    assert report["switches"] == 3
    assert report["switch_time_mean_s"] == pytest.approx((5.0 + 3.0 + 4.0) / 3)
    assert report["split_timeline"] == [[0.0, "2P2D"], [100.0, "1P3D"], [203.0, "2P2D"], [204.0, "3P1D"]]
    assert report["final_split"] == "override"  # extra wins over computed keys
    assert report["sim_speed"] == 123.0
    assert report["subagent_branches"] == 1
    assert report["meta"] == {"command": "t"}
    json.dumps(report)  # serialisable as is


def test_build_report_computes_the_prefill_queue_imbalance_once(monkeypatch):
    """The summary's mean imbalance and the series' per-window ratios come from one :func:`prefill_queue_imbalance`
    call (it was computed for each: ~12% of building a 600-s run's report), the same values as each computes alone."""
    from evolving_infra.report import metrics, write

    records = [rec(i, sent_at=7.0 * i, node=f"w{i % 3}", queue=0.1 * (i % 5)) for i in range(40)]
    calls = []
    real = metrics.prefill_queue_imbalance
    monkeypatch.setattr(write, "prefill_queue_imbalance", lambda *a, **k: calls.append(1) or real(*a, **k), raising=False)
    monkeypatch.setattr(metrics, "prefill_queue_imbalance", lambda *a, **k: calls.append(1) or real(*a, **k))
    report = build_report(records, meta={}, timeline=switching_timeline())
    assert len(calls) == 1
    monkeypatch.undo()
    alone = summarize(records, timeline=switching_timeline())
    assert report["prefill_queue_imbalance"] == alone["prefill_queue_imbalance"] is not None
    series = time_series(records, start=alone["start_s"], end=alone["end_s"], timeline=switching_timeline())
    assert report["series"] == series
    assert report["start_s"] == alone["start_s"] and report["end_s"] == alone["end_s"]


def test_build_report_without_timeline_says_so():
    report = build_report([rec(0)], meta={})
    assert report["switches"] is None and report["split_timeline"] is None and report["final_split"] is None
    assert any("no split timeline" in n for n in report["report_notes"])
    assert any("lost KV reuse over time" in n for n in report["report_notes"])
    assert report["prefill_queue_mean_s"] is None and report["prefill_queue_imbalance"] is None


def test_periods_split_by_send_time():
    # period A [0, 60): 3 requests TTFT 1 s; period B [60, 120): 2 requests TTFT 5 s
    records = [rec(i, sent_at=10.0 * i, ttft=1.0, e2e=2.0) for i in range(3)]
    records += [rec(10 + i, sent_at=60.0 + 10 * i, ttft=5.0, e2e=58.0 if i == 1 else 8.0) for i in range(2)]
    tl = switching_timeline()  # switches applied at 100 s (1P3D), 203 s, 204 s
    periods = [{"name": "A", "start_s": 0, "end_s": 60}, {"name": "B", "start_s": 60, "end_s": 120}]
    rows = period_metrics(records, periods, timeline=tl)
    a, b = rows
    assert (a["name"], a["requests_sent"], a["ttft_mean_s"]) == ("A", 3, pytest.approx(1.0))
    assert (b["name"], b["requests_sent"], b["ttft_mean_s"]) == ("B", 2, pytest.approx(5.0))
    # throughput counts completions inside the period: A has 3, B has the one finished at 68 s
    # (the other finishes at 70 + 58 = 128 s, after B)
    assert a["throughput_rps"] == pytest.approx(3 / 60) and b["throughput_rps"] == pytest.approx(1 / 60)
    assert a["switches"] == 0 and b["switches"] == 1
    assert a["final_split"] == "2P2D" and b["final_split"] == "1P3D"
    report = build_report(records, meta={"periods": periods}, timeline=tl)
    assert [p["name"] for p in report["periods"]] == ["A", "B"]


def test_bad_periods_keep_the_report():
    with pytest.raises(ValueError, match="'X'"):
        period_metrics([rec(0)], [{"name": "X", "start_s": 5, "end_s": 5}])
    report = build_report([rec(0)], meta={"periods": [{"name": "X", "start_s": "soon"}]})
    assert report["periods"] is None
    assert any("periods not computed" in n for n in report["report_notes"])
    assert report["requests_sent"] == 1


def test_ttft_prediction_error_median():
    rs = [rec(i, ttft=t) for i, t in enumerate((1.0, 2.0, 4.0))]
    for r, p in zip(rs, (1.5, 2.0, 1.0)):  # |errors| 0.5, 0.0, 3.0
        r.predicted_ttft_s = p
    rs[0].admission_wait_s = 0.25  # the admission wait is not the router's to predict
    rs[0].ttft_s = 1.25
    s = summarize(rs + [rec(9, ttft=7.0)])  # a request without a prediction is left out
    assert s["ttft_prediction_samples"] == 3
    assert s["ttft_prediction_abs_error_median_s"] == pytest.approx(0.5)
    assert summarize([rec(0)])["ttft_prediction_abs_error_median_s"] is None


def test_live_ttft_prediction_error_against_the_node_part():
    """Live records carry the prefill node's arrival and first-token times: the router predicts
    that part (queue + prefill on the node), not the client's TTFT, which adds the control plane
    (a demo on a loaded box: 10.6 s median error against the client TTFT, 0.28 s against the node)."""
    rs = [rec(i, ttft=10.0 + i, sent_at=100.0 * i) for i in range(3)]
    for r, (arr, first, p) in zip(rs, ((5.0, 7.0, 2.5), (106.0, 107.0, 1.0), (209.0, 213.0, 3.0))):
        r.node_arrived_at, r.first_token_at, r.predicted_ttft_s = arr, first, p  # |errors| 0.5, 0.0, 1.0
    s = summarize(rs)
    assert s["ttft_prediction_node_samples"] == 3
    assert s["ttft_prediction_node_abs_error_median_s"] == pytest.approx(0.5)
    assert s["ttft_prediction_node_abs_error_p95_s"] == pytest.approx(0.95)
    assert s["ttft_prediction_abs_error_median_s"] == pytest.approx(9.0)  # the client-side figure, kept
    # simulator records (no node_arrived_at) get no such keys: their report is unchanged
    sim = [rec(0, ttft=2.0)]
    sim[0].predicted_ttft_s, sim[0].first_token_at = 1.5, 1.0
    assert not any(k.startswith("ttft_prediction_node") for k in summarize(sim))


def test_control_plane_note_compares_means_over_the_same_records():
    """The "control plane over half the mean TTFT" note divides the control plane's mean (records with
    ``node_arrived_at``) by the mean client TTFT over those same records. Before, it divided by the mean over
    every record: 8 quick records without a node arrival (0.5 s) pulled that mean to 2.4 s and a 2 s control
    plane (20% of those records' 10 s) read as 83%."""
    from evolving_infra.report.write import ttft_split_lines

    rs = [rec(i, ttft=10.0 if i < 2 else 0.5, sent_at=100.0 * i) for i in range(10)]
    for r in rs[:2]:
        r.node_arrived_at, r.first_token_at = r.sent_at + 2.0, r.sent_at + 10.0  # 8 s on the node, 2 s control plane
    s = summarize(rs)
    assert s["ttft_mean_s"] == pytest.approx(2.4) and s["ttft_split_client_mean_s"] == pytest.approx(10.0)
    assert not any("note:" in line for line in ttft_split_lines(s))
    for r in rs[:2]:  # now the control plane is 8 s of those 10 s: 80%
        r.node_arrived_at = r.sent_at + 8.0
    assert any("note: 80% of the mean client TTFT is control plane" in line for line in ttft_split_lines(summarize(rs)))


def test_live_ttft_split_into_the_node_and_the_control_plane():
    """A demo (speedup 50, load ~4 on 2 cores) vs its static:2P2D baseline: client TTFT 23.1 s vs
    35.1 s, but on the prefill node 3.3 s vs 1.1 s; the rest (86% and 97%) was the control plane's real
    latency × 50. The report now gives both parts, and says when the control plane dominates."""
    import io

    from evolving_infra.report.write import print_summary

    rs = [rec(i, ttft=10.0 + i, sent_at=100.0 * i) for i in range(3)]
    for r, (arr, first) in zip(rs, ((5.0, 7.0), (106.0, 107.0), (209.0, 213.0))):
        r.node_arrived_at, r.first_token_at = arr, first  # on the node 2, 1, 4 s of client 10, 11, 12 s
    rs[2].admission_wait_s = 1.0
    s = summarize(rs)
    assert s["ttft_node_samples"] == 3
    assert s["ttft_node_mean_s"] == pytest.approx(7 / 3)
    assert s["ttft_node_p50_s"] == pytest.approx(2.0)
    assert s["ttft_control_plane_mean_s"] == pytest.approx((8 + 10 + 7) / 3)  # less the admission wait
    assert s["ttft_control_plane_p50_s"] == pytest.approx(8.0)
    out = io.StringIO()
    print_summary(s | {"meta": {"speedup": 50.0}}, file=out)
    text = out.getvalue()
    assert "note: 76% of the mean client TTFT is control plane" in text
    # session 59: the TTFT on node leads, the client's follows labelled (a Dynamo user read the demo's first TTFT
    # line, the client's "TTFT mean 14.821 s p95 58.920 s", 96% control plane × 50, as the serving's)
    ttft = [line for line in text.splitlines() if "TTFT" in line]
    assert ttft[0].startswith("TTFT on node  mean 2.333 s  p50 2.000 s  p95 "), text
    assert ttft[1] == "client TTFT   mean 11.000 s  p50 11.000 s  p95 11.900 s  (incl. control plane × speedup 50)", text
    assert "TTFT       mean" not in text
    # the node's part dominating: no note; simulator records (no node_arrived_at): no keys, no lines
    quick = [rec(0, ttft=2.0)]
    quick[0].node_arrived_at, quick[0].first_token_at = 0.5, 2.0
    out = io.StringIO()
    print_summary(summarize(quick), file=out)
    assert "TTFT on node" in out.getvalue() and "(incl. control plane)" in out.getvalue() and "note:" not in out.getvalue()
    sim = [rec(0, ttft=2.0)]
    sim[0].first_token_at = 1.0
    assert not any(k.startswith(("ttft_node", "ttft_control")) for k in summarize(sim))
    out = io.StringIO()
    print_summary(summarize(sim), file=out)
    assert "TTFT       mean" in out.getvalue() and "(client" not in out.getvalue()  # a simulation's TTFT: no control plane


def test_live_replay_window_is_the_duration_not_the_span_of_the_requests():
    """A replay at speedup 1 stopped after 89.3 s wall, 2 requests answered within 2.433 s,
    printed 'throughput 0.822 req/s'; over the replay's own window it is 2 / 89.3."""
    rs = [rec(0, sent_at=1000.0, e2e=1.0), rec(1, sent_at=1001.0, e2e=1.433)]
    assert build_report(rs, meta={})["throughput_rps"] == pytest.approx(2 / 2.433)  # the simulator's default
    report = build_report(rs, meta={}, start=999.5, end=999.5 + 89.3)
    assert (report["start_s"], report["duration_s"]) == (999.5, pytest.approx(89.3))
    assert report["throughput_rps"] == pytest.approx(2 / 89.3)
    assert report["series"]["t_s"] == [999.5, 1059.5]  # windows over the replay's window too


def test_summary_says_why_the_kv_hit_is_above_the_traces_ideal():
    """The same 4 sessions replayed twice against one cluster: the second run's summary read 'KV hit 100.0% (ideal
    86.3%, lost KV reuse 0.0%)' with no word on how a run beats its ideal (the first run's KV was still held)."""
    import io

    from evolving_infra.report.write import print_summary

    def summary(h: float) -> str:
        out = io.StringIO()
        print_summary({"kv_hit_rate": h, "ideal_kv_hit_rate": 0.863, "lost_kv_reuse": max(0.0, 1 - h / 0.863)}, file=out)
        return out.getvalue()

    assert "above the trace's ideal h*" in summary(1.0)
    assert "above the trace's ideal" not in summary(0.854)  # below it: the usual case, lost KV reuse 1.1%


def test_a_run_binding_decode_at_prefill_start_says_the_bind_round_trip_delays_the_hand_off_not_the_ttft():
    """A live run whose decode binding is at prefill start (the evolving demo): a prefill that ends before its
    route.bind is answered sends its first token at once and waits for the binding only to hand off, so
    "on node" is queue + prefill as for any policy, and the note says where that control-plane hop (× speedup)
    went: the decode, the end-to-end latency. Before, the first token waited for the binding and the summary
    said the node's TTFT held it ("queue + prefill + the wait for route.bind")."""
    from evolving_infra.report.write import ttft_split_lines

    rs = [rec(i, ttft=10.0, sent_at=100.0 * i) for i in range(2)]
    for r in rs:
        r.node_arrived_at, r.first_token_at = r.sent_at + 8.0, r.sent_at + 10.0  # control plane 8 of 10 s
    s = summarize(rs)
    start = ttft_split_lines(s | {"meta": {"speedup": 50.0, "policy": {"decode_binding": "prefill-start"}}})
    assert start[0].endswith("(prefill node arrival → first token: queue + prefill)")
    assert any("route.bind" in line and "delays the decode (TPOT, end-to-end latency), not the TTFT" in line for line in start), start
    for meta in ({"speedup": 50.0, "policy": {"decode_binding": "dispatch"}}, {"speedup": 50.0}):
        lines = ttft_split_lines(s | {"meta": meta})
        assert lines[0].endswith("(prefill node arrival → first token: queue + prefill)")
        assert not any("route.bind" in line for line in lines)


def test_the_summary_says_a_duration_is_the_window_after_the_warmup():
    """simulate --duration 900 --warmup 600 printed "duration 299.8 s simulated, 32.9 s wall": the measured
    window beside the whole run's wall time (its last line: 900 s in 32.9 s, 27x), with no word of the warm-up."""
    import io

    from evolving_infra.report.write import print_summary

    base = {"requests_sent": 1, "requests_completed": 1, "duration_s": 299.8, "start_s": 600.1, "end_s": 899.9, "wall_s": 32.9}
    out = io.StringIO()
    print_summary(base | {"meta": {"warmup_s": 600.0}}, file=out)
    assert "duration   299.8 s simulated (t=600-900 s, after --warmup 600), 32.9 s wall" in out.getvalue()
    for meta in ({"warmup_s": 0.0}, {}):  # no warm-up left out (a live demo's start_s is its replay's start): as before
        out = io.StringIO()
        print_summary(base | {"meta": meta}, file=out)
        assert "duration   299.8 s simulated, 32.9 s wall" in out.getvalue()


def test_the_summary_says_throughput_is_per_simulated_second(capsys):
    """``make demo`` printed "throughput 0.118 req/s" for a run at --speedup 50 whose duration is simulated seconds:
    read as a wall rate, it is 50 times too low. The line says which second, and the wall rate under a speed-up."""
    from evolving_infra.report.write import print_summary

    print_summary({"throughput_rps": 0.118, "meta": {"command": "demo", "speedup": 50.0}})
    print_summary({"throughput_rps": 0.118, "meta": {"command": "simulate"}})
    print_summary({"throughput_rps": 0.118, "meta": {"command": "replay", "speedup": 1.0}})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("throughput")]
    assert lines == ["throughput 0.118 req/s per simulated second (5.90 req/s of wall time at --speedup 50)",
                     "throughput 0.118 req/s per simulated second", "throughput 0.118 req/s"]
