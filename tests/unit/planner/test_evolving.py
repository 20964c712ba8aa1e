"""EvolvingPlanner: warm-up and freeze, the window gate, cooldown and busy skips, the SLO guard."""

from __future__ import annotations

import math

import pytest

from shared.profile import load_profile
from shared.split import split_name, split_phases
from services.planner.evolving import EvolvingParams, EvolvingPlanner
from services.planner.policy import make_planner

from .helpers import done, records, sl, state

GB = load_profile("gb300-glm52")
NODES = [f"w{i}" for i in range(9)]


def planner(**kw) -> EvolvingPlanner:
    kw.setdefault("t_learn_s", 0.0)
    pl = make_planner("evolving", NODES, GB, **kw)
    assert isinstance(pl, EvolvingPlanner)
    return pl


def start(pl: EvolvingPlanner, split: str = "4P5D", now: float = 0.0):
    phases = split_phases(split, NODES)
    d = pl.tick(now, phases, set())
    return d.phases if d else phases


def feed(pl, phases, t0: float, t1: float, *, rate: float, t_uc=6000, t_c=100_000, t_out=1000, q=60.0, queue_growth=0.0, queue0=0.0):
    """Steady traffic from t0 to t1 (1-s steps): ``rate`` completions/s, ``q`` requests in decode,
    prefill queue ``queue0 + queue_growth·t`` spread over the prefill nodes."""
    pre = [n for n, v in phases.items() if v != "decode"]
    dec = [n for n, v in phases.items() if v != "prefill"]
    acc = 0.0
    i = 0
    t = t0
    while t < t1:
        queued = queue0 + queue_growth * t
        for n in phases:
            pl.on_node_state(
                state(
                    n,
                    phases[n],
                    queue=int(round(queued / len(pre))) if n in pre else 0,
                    qwork=(t_uc, t_c),
                    decoding=int(round(q / len(dec))) if n in dec else 0,
                ),
                t,
            )
        acc += rate
        while acc >= 1.0:
            acc -= 1.0
            i += 1
            pl.on_request_done(done(f"r{t}-{i}", t, prompt=t_uc + t_c, cached=t_c, out=t_out, node=pre[i % len(pre)]), t)
        t += 1.0


def run_to(pl, phases, t_end, busy=frozenset(), **traffic):
    """Feed traffic and tick whenever the planner asks, applying its decisions; returns (phases, decisions)."""
    decisions = []
    t = pl.next_tick()
    last = 0.0
    while t is not None and t <= t_end:
        feed(pl, phases, last, t, **traffic)
        last = t
        d = pl.tick(t, phases, busy)
        if d is not None:
            decisions.append((t, d))
            phases = d.phases
        t = pl.next_tick()
    return phases, decisions


def test_warmup_is_collocated_then_fits_and_serves_the_initial_split():
    pl = planner(t_learn_s=600.0, window_s=600.0, sample_interval_s=0.0)
    phases = split_phases("6P3D", NODES)
    d = pl.tick(0.0, phases, set())
    assert d is not None and set(d.phases.values()) == {"both"}
    assert pl.next_tick() == 600.0
    ev = pl.take_decisions()
    assert ev[0].action == "warmup" and ev[0].split_before == "6P3D" and ev[0].split_after == "collocated"
    for k, n in enumerate(NODES[:-1]):  # the last node reports nothing: it gets the peers' median
        pl.on_iterations(n, records(300, GB.prefill, GB.decode, seed=k, noise=0.02), 10.0)
    assert pl.tick(300.0, d.phases, set()) is None  # not yet
    d2 = pl.tick(600.0, d.phases, set())
    assert d2 is not None and split_name(d2.phases) == "6P3D" and d2.phases == phases
    assert pl.frozen
    m = pl.models()
    assert m.frozen and {x.source for x in m.models} == {"fitted", "peer"}
    fitted = next(x for x in m.models if x.node == "w0")
    assert fitted.prefill.c2 == pytest.approx(GB.prefill.c2, rel=0.1)
    assert fitted.samples == 300 and 0 < fitted.fit_error < 0.05
    # frozen: later records change nothing
    before = pl.state["w0"].prefill
    pl.on_iterations("w0", records(50, GB.prefill, GB.decode, seed=99), 700.0)
    assert pl.state["w0"].prefill == before
    assert pl.next_tick() == 660.0  # guard check at the next slice boundary
    assert [e.action for e in pl.take_decisions()] == ["switch"]


def test_collocated_initial_split_picks_the_best_split_from_the_warmup():
    pl = planner(t_learn_s=600.0)
    both = split_phases("collocated", NODES)
    assert pl.tick(0.0, both, set()) is None  # already collocated
    feed(pl, both, 0.0, 600.0, rate=3.0, t_uc=500, t_c=10_000, t_out=3000, q=120)
    for k, n in enumerate(NODES):  # the fit needs iteration records (without them: no data, no switch)
        pl.on_iterations(n, records(100, GB.prefill, GB.decode, seed=k), 300.0)
    d = pl.tick(600.0, both, set())
    assert d is not None
    assert split_name(d.phases) == "1P8D"  # decode-heavy work: one prefill node is enough


def test_window_switches_when_a_split_is_significantly_better():
    pl = planner()
    phases = start(pl, "6P3D")
    phases, decisions = run_to(pl, phases, 600.0, rate=3.0, t_uc=3000, t_c=97_000, t_out=2000, q=90)
    assert len(decisions) == 1
    t, d = decisions[0]
    assert t == 600.0 and split_name(d.phases) != "6P3D"
    ev = [e for e in pl.take_decisions() if e.action == "switch"][-1]
    chosen = next(c for c in ev.candidates if c.split == ev.split_after)
    assert chosen.qualifies and chosen.mean_gain > chosen.threshold
    assert chosen.mean_gain == max(c.mean_gain for c in ev.candidates if c.qualifies)
    assert len(ev.candidates) == 7  # every p ≠ |P| of 9 nodes
    assert chosen.changes == abs(6 - int(ev.split_after.split("P")[0]))


def test_no_switch_at_the_best_split_is_logged_with_the_gains():
    pl = planner()
    phases = start(pl, "6P3D")
    phases, _ = run_to(pl, phases, 600.0, rate=3.0, t_uc=3000, t_c=97_000, t_out=2000, q=90)
    pl.take_decisions()
    best = split_name(phases)
    phases2, decisions = run_to(pl, phases, 1200.0, rate=3.0, t_uc=3000, t_c=97_000, t_out=2000, q=90)
    evs = [e for e in pl.take_decisions() if e.ts == 1200.0]
    assert evs and evs[-1].action == "no_switch"
    assert all(not c.qualifies for c in evs[-1].candidates)
    # every candidate is slower, or overloaded (8P1D: one decode node cannot finish the requests)
    assert all(c.mean_gain < 0 or (c.latency_s == math.inf and c.mean_gain == 0) for c in evs[-1].candidates)
    assert next(c for c in evs[-1].candidates if c.split == "8P1D").latency_s == math.inf
    assert split_name(phases2) == best == "1P8D" and decisions == []
    assert "theta_current" in evs[-1].metrics


def test_busy_and_cooldown_skip_the_window():
    pl = planner(cooldown_s=120.0)
    phases = start(pl, "6P3D")
    feed(pl, phases, 0.0, 600.0, rate=3.0, t_uc=3000, t_c=97_000, t_out=2000, q=90)
    assert pl.tick(600.0, phases, {"w3"}) is None
    ev = pl.take_decisions()[-1]
    assert ev.action == "skip" and "w3" in ev.reason
    # a switch completing at 1150 puts the 1200 window end inside the cooldown
    pl.on_switch_done("w3", "prefill", 1150.0)
    feed(pl, phases, 600.0, 1200.0, rate=3.0, t_uc=3000, t_c=97_000, t_out=2000, q=90)
    assert pl.tick(1200.0, phases, set()) is None
    ev = [e for e in pl.take_decisions() if e.ts == 1200.0][-1]
    assert ev.action == "skip" and "last switch" in ev.reason


def test_an_external_split_change_restarts_the_cooldown():
    pl = planner(cooldown_s=300.0)
    start(pl, "4P5D")
    other = split_phases("5P4D", NODES)
    feed(pl, other, 0.0, 600.0, rate=3.0, t_uc=3000, t_c=97_000, t_out=2000, q=90)
    assert pl.tick(400.0, other, set()) is None
    assert "externally" in pl.take_decisions()[-1].reason
    assert pl.tick(600.0, other, set()) is None
    assert pl.take_decisions()[-1].action == "skip"


def test_too_few_slices_with_requests_skip():
    pl = planner()
    phases = start(pl, "4P5D")
    feed(pl, phases, 540.0, 600.0, rate=1.0)  # only the last slice has completions
    assert pl.tick(600.0, phases, set()) is None
    ev = pl.take_decisions()[-1]
    assert ev.action == "skip" and "slice" in ev.reason


# --------------------------------------------------------------------------- #
# SLO guard
# --------------------------------------------------------------------------- #

# Work of the D.3-like case: μ_P ≈ 3.9 req/s per prefill node; decode-heavy outputs make
# Θ prefer fewer prefill nodes than the arrival rate can bear.
D3 = dict(t_uc=6000, t_c=100_000, t_out=3000, q=60)


def test_guard_vetoes_a_split_that_cannot_take_the_arrival_rate():
    w = [sl(**D3, n=50) for _ in range(10)]
    phases = split_phases("4P5D", NODES)
    off = planner(slo_guard=False, objective="throughput")
    cands, _, best_off = off.evaluate(phases, w)
    assert best_off == 1  # the paper's planner: 1P8D has the largest Θ
    on = planner(objective="throughput")
    cands, metrics, best_on = on.evaluate(phases, w, lam=5.0)
    c1 = next(c for c in cands if c.prefill_nodes == 1)
    assert c1.qualifies and c1.ttft_p95_s == math.inf and "TTFT" in c1.vetoed
    assert best_on == 2  # the best candidate that keeps P95 TTFT within 15 s
    assert next(c for c in cands if c.prefill_nodes == 2).ttft_p95_s < 15.0
    assert metrics["arrival_rate"] == 5.0


def test_guard_changes_nothing_at_a_moderate_arrival_rate():
    w = [sl(**D3, n=50) for _ in range(10)]
    phases = split_phases("4P5D", NODES)
    _, _, best_off = planner(slo_guard=False).evaluate(phases, w)
    _, _, best_on = planner().evaluate(phases, w, lam=2.0)
    assert best_on == best_off


def test_guard_reverses_a_split_that_queues_prefill():
    """D.3: after a switch to 2P7D the arrival rate exceeds what two prefill nodes serve
    and the queue grows; the guard moves a node back within minutes."""
    pl = planner(cooldown_s=120.0, window_s=600.0)
    phases = start(pl, "2P7D")
    # 2 prefill nodes complete 7.7 req/s; 9 req/s arrive: the queue grows 1.3 req/s
    phases, decisions = run_to(pl, phases, 420.0, rate=7.7, queue_growth=1.3, t_uc=6000, t_c=100_000, t_out=1000, q=60)
    assert decisions, "the guard should have reversed the split"
    t, d = decisions[0]
    assert t < 600.0  # before the window end
    assert split_name(d.phases) == "3P6D"
    ev = [e for e in pl.take_decisions() if e.action == "switch"][0]
    assert ev.reason.startswith("SLO guard") and ev.metrics["backlog_s"] > 7.5
    assert ev.metrics["arrival_rate"] == pytest.approx(9.0, rel=0.15)


def test_guard_ignores_a_burst_backlog_at_a_sustainable_rate():
    pl = planner()
    phases = start(pl, "2P7D")
    # a long queue (a sub-agent burst) but only 3 req/s arrive: two nodes drain it
    phases, decisions = run_to(pl, phases, 540.0, rate=3.0, queue0=120.0, t_uc=6000, t_c=100_000, t_out=1000, q=60)
    assert decisions == []
    assert not [e for e in pl.take_decisions() if e.reason.startswith("SLO guard")]


def test_guard_off_is_the_papers_planner():
    pl = planner(slo_guard=False, min_gain_share=0.0, objective="throughput")
    phases = start(pl, "2P7D")
    phases, decisions = run_to(pl, phases, 540.0, rate=7.7, queue_growth=1.3, t_uc=6000, t_c=100_000, t_out=1000, q=60)
    assert decisions == []
    assert not [e for e in pl.take_decisions() if "guard" in e.reason]
    assert pl.next_tick() == 545.0  # sampling ticks only (every 5 s)
    quiet = planner(slo_guard=False, min_gain_share=0.0, objective="throughput", sample_interval_s=0.0)
    start(quiet, "2P7D")
    assert quiet.next_tick() == 600.0  # only window ends


def test_sampling_ticks_give_per_slice_decode_averages():
    """A caller that reports node states only at ticks (the simulator) still gets q̄ per slice."""
    pl = planner()
    phases = split_phases("4P5D", NODES)
    t = pl.next_tick()
    while t is not None and t < 600.0:
        q = 30 if t < 300 else 90  # the decode population changes mid-window
        for n, ph in phases.items():
            pl.on_node_state(state(n, ph, decoding=q // 5 if ph == "decode" else 0), t)
        assert pl.tick(t, phases, set()) is None
        t = pl.next_tick()
    qs = [s.q for s in pl.obs.slices(0, 10)]
    assert qs[:5] == pytest.approx([30.0] * 5) and qs[5:] == pytest.approx([90.0] * 5)


def test_params_are_validated():
    with pytest.raises(ValueError):
        EvolvingParams(slices=1)
    with pytest.raises(ValueError):
        make_planner("evolving", NODES, GB, bogus=1)
    with pytest.raises(ValueError):
        make_planner("evolving", NODES, GB, initial_split="3P3D")


def test_min_gain_share_keeps_a_near_tie_from_switching():
    w = [sl(**D3, n=50) for _ in range(10)]
    phases = split_phases("4P5D", NODES)
    cands, metrics, best = planner(slo_guard=False, min_gain_share=0.0, objective="throughput").evaluate(phases, w)
    assert best is not None
    top = next(c for c in cands if c.prefill_nodes == best)
    share = top.mean_gain / metrics["theta_current"]  # the best candidate's gain as a share of Θ
    assert top.qualifies and top.threshold < top.mean_gain
    cands, _, best_above = planner(slo_guard=False, min_gain_share=share * 0.99, objective="throughput").evaluate(phases, w)
    assert best_above == best
    cands, _, best_below = planner(slo_guard=False, min_gain_share=min(share * 1.01, 0.99), objective="throughput").evaluate(phases, w)
    assert best_below is None  # no candidate gains that share of Θ: stay
    assert all(not c.qualifies and c.threshold >= share * metrics["theta_current"] for c in cands)
    with pytest.raises(ValueError, match="min_gain_share"):
        planner(min_gain_share=1.0)


LAT = dict(t_uc=20_000, t_c=50_000, t_out=300, q=12)
"""Prefill-heavy slices: Θ keeps rising up to 7P2D while the predicted latency is lowest at 5P4D."""


def test_latency_objective_picks_the_lowest_predicted_latency():
    phases = split_phases("4P5D", NODES)
    w = [sl(**LAT, n=300) for _ in range(10)]  # 5 requests/s
    _, _, best_thr = planner(slo_guard=False, objective="throughput").evaluate(phases, w)
    cands, metrics, best = planner(slo_guard=False).evaluate(phases, w)  # the default objective: latency
    assert metrics["latency_objective"] == 1.0
    assert all(c.objective == "latency" for c in cands)
    feasible = [c for c in cands if math.isfinite(c.latency_s)]
    top = min(feasible, key=lambda c: c.latency_s)
    assert best == top.prefill_nodes == 5 and best_thr == 7
    assert top.qualifies and top.mean_gain == pytest.approx(metrics["latency_current_s"] - top.latency_s)
    assert len(feasible) < len(cands) and not any(c.qualifies for c in cands if not math.isfinite(c.latency_s))
    # a gain below the minimum share of the current latency: stay (3P6D is 2% faster at 1.67 req/s)
    w = [sl(**LAT, n=100) for _ in range(10)]
    cands, metrics, best = planner(slo_guard=False, objective="latency").evaluate(phases, w)
    c3 = next(c for c in cands if c.prefill_nodes == 3)
    assert best is None and 0 < c3.mean_gain < c3.threshold == pytest.approx(0.03 * metrics["latency_current_s"])
    # the current split's prefill pool is predicted overloaded: the window is decided on Θ
    w = [sl(**LAT, n=400) for _ in range(10)]
    cands, metrics, best = planner(slo_guard=False, objective="latency").evaluate(phases, w)
    assert metrics["latency_objective"] == 0.0 and all(c.objective == "throughput" for c in cands)
    assert best == planner(slo_guard=False, objective="throughput").evaluate(phases, w)[2]
    with pytest.raises(ValueError, match="objective"):
        planner(objective="e2e")


def test_guard_reversal_goes_to_the_lowest_predicted_latency_with_the_latency_objective():
    """Prefill-heavy work on 2P7D with the queue growing: the Θ objective reverses to the
    smallest passing p (3P6D), the latency objective to the passing p with the lowest
    predicted mean latency (4P5D here)."""
    heavy = dict(rate=2.6, queue_growth=0.6, t_uc=20_000, t_c=50_000, t_out=200, q=6)
    got = {}
    for objective in ("throughput", "latency"):
        pl = planner(cooldown_s=120.0, window_s=600.0, objective=objective)
        phases = start(pl, "2P7D")
        _, decisions = run_to(pl, phases, 420.0, **heavy)
        assert len(decisions) == 1 and decisions[0][0] < 600.0
        ev = [e for e in pl.take_decisions() if e.action == "switch"][0]
        assert ev.reason.startswith("SLO guard")
        got[objective] = (split_name(decisions[0][1].phases), ev.candidates)
    assert got["throughput"][0] == "3P6D" and len(got["throughput"][1]) == 1  # stops at the first that passes
    split, cands = got["latency"]
    passing = [c for c in cands if c.qualifies]
    assert len(passing) > 1 and all(c.latency_s is not None for c in cands)
    assert split == min(passing, key=lambda c: c.latency_s).split == "4P5D"


def test_collocated_initial_split_with_the_latency_objective_minimises_predicted_latency():
    both = split_phases("collocated", NODES)
    got = {}
    for objective in ("throughput", "latency"):
        pl = planner(t_learn_s=600.0, objective=objective)
        assert pl.tick(0.0, both, set()) is None
        feed(pl, both, 0.0, 600.0, rate=5.0, t_uc=20_000, t_c=50_000, t_out=300, q=12)
        for k, n in enumerate(NODES):  # the fit needs iteration records (without them: no data, no switch)
            pl.on_iterations(n, records(100, GB.prefill, GB.decode, seed=k), 300.0)
        d = pl.tick(600.0, both, set())
        assert d is not None
        got[objective] = (split_name(d.phases), pl.take_decisions()[-1].metrics)
    assert got["throughput"][0] == "6P3D"  # Θ: the prefill-capacity side binds up to here
    assert got["latency"][0] == "5P4D" and got["latency"][1]["best_latency_s"] > 0


def test_latency_objective_sees_an_overloaded_decode_pool():
    """Past max_running the batch stops growing, so Eq. 4 alone would rate a split with too few
    decode nodes as fast: its full-batch capacity below λ makes it infeasible."""
    phases = split_phases("4P5D", NODES)
    w = [sl(t_uc=20_000, t_c=50_000, t_out=2000, q=600, n=300) for _ in range(10)]  # 5 requests/s
    cands, metrics, best = planner(slo_guard=False).evaluate(phases, w)
    assert metrics["latency_objective"] == 1.0
    c8 = next(c for c in cands if c.prefill_nodes == 8)
    assert c8.latency_s == math.inf and not c8.qualifies
    assert best is not None and best != 8
    assert next(c for c in cands if c.prefill_nodes == best).latency_s < math.inf


def test_a_burst_slice_is_left_out_of_the_latency_gate():
    """One slice whose completions bunch up beyond what the current split's prefill pool is
    predicted to serve does not send the window to Θ (which would pick another split)."""
    phases = split_phases("5P4D", NODES)
    norm = [sl(**LAT, n=300) for _ in range(10)]
    burst = norm[:9] + [sl(**LAT, n=520)]
    _, m_norm, b_norm = planner(slo_guard=False).evaluate(phases, norm)
    _, m_burst, b_burst = planner(slo_guard=False).evaluate(phases, burst)
    assert m_norm["latency_objective"] == m_burst["latency_objective"] == 1.0
    assert m_norm["latency_slices"] == 10 and m_burst["latency_slices"] == 9
    assert b_norm is None and b_burst is None  # 5P4D is the latency optimum: stay
    # overloaded in most slices: the window is decided on Θ
    heavy = [sl(**LAT, n=520) for _ in range(6)] + norm[:4]
    _, m_heavy, b_heavy = planner(slo_guard=False).evaluate(phases, heavy)
    assert m_heavy["latency_objective"] == 0.0
    assert b_heavy == planner(slo_guard=False, objective="throughput").evaluate(phases, heavy)[2]


def test_decision_metrics_leave_out_non_finite_values():
    """JSON has no inf or NaN: a decision's metrics keep only finite values, so it round-trips typed."""
    import msgspec

    from shared.messages import PlannerDecision

    pl = planner()
    phases = split_phases("4P5D", NODES)
    pl._decide(0.0, "no_switch", phases, None, "test", metrics={"ttft_current_s": math.inf, "x": math.nan, "q_mean": 3.0})
    ev = pl.take_decisions()[-1]
    assert ev.metrics == {"q_mean": 3.0}
    assert msgspec.json.decode(msgspec.json.encode(ev), type=PlannerDecision) == ev


# --------------------------------------------------------------------------- #
# issue 21: no data, no freeze; a burst that ended does not move the guard
# --------------------------------------------------------------------------- #


def test_no_iteration_records_no_freeze_no_switch_and_the_decision_says_no_data():
    """llm-d-autoscaling #1212: a planner whose nodes never report iterations must not freeze
    the profile's coefficients nor leave the warm-up on them."""
    pl = planner(t_learn_s=600.0, sample_interval_s=0.0)
    phases = split_phases("6P3D", NODES)
    both = pl.tick(0.0, phases, set()).phases
    feed(pl, both, 0.0, 600.0, rate=3.0)  # requests complete, node states arrive; no node.iters
    assert pl.tick(600.0, both, set()) is None
    assert not pl.frozen and not pl.models().frozen
    ev = pl.take_decisions()[-1]
    assert ev.action == "no_switch" and ev.reason.startswith("no data") and "not frozen" in ev.reason
    assert ev.split_after == "" or ev.split_after == ev.split_before
    assert pl.next_tick() == 1200.0  # the warm-up is extended by no_data_retry_s
    for k, n in enumerate(NODES):  # data arrives: the warm-up restarts (test_warmup_first_record), its end fits,
        pl.on_iterations(n, records(100, GB.prefill, GB.decode, seed=k), 900.0)  # freezes, serves the initial split
    assert pl.next_tick() == 1500.0  # t_learn_s from the first record
    d = pl.tick(1500.0, both, set())
    assert d is not None and split_name(d.phases) == "6P3D" and pl.frozen
    ev = pl.take_decisions()[-1]
    assert ev.action == "switch" and ev.metrics["nodes_fitted"] == 9.0


def _burst(pl, phases, t_end, *, burst_s, growth):
    """2P7D serving D.3-like work: 3 req/s until t=300, then a prefill burst of ``burst_s``
    (the queue grows ``growth`` req/s while the two prefill nodes complete 7.7 req/s), then the
    queue drains at 4.7 req/s. Ticks as the planner asks; returns the decisions that changed phases."""
    work = dict(t_uc=6000, t_c=100_000, t_out=1000, q=60)
    t_b1 = 300.0 + burst_s
    peak = growth * burst_s
    segments = [(0.0, 300.0, dict(rate=3.0))]
    segments.append((300.0, t_b1, dict(rate=7.7, queue0=-growth * 300.0, queue_growth=growth)))
    t_empty = t_b1 + peak / 4.7
    segments.append((t_b1, t_empty, dict(rate=7.7, queue0=peak + 4.7 * t_b1, queue_growth=-4.7)))
    segments.append((t_empty, 1e9, dict(rate=3.0)))
    out = []
    last = 0.0
    t = pl.next_tick()
    while t is not None and t <= t_end:
        for a, b, kw in segments:
            lo, hi = max(a, last), min(b, t)
            if lo < hi:
                feed(pl, phases, lo, hi, **work, **kw)
        last = t
        d = pl.tick(t, phases, set())
        if d is not None:
            out.append((t, d))
            phases = d.phases
        t = pl.next_tick()
    return out


def test_guard_a_60s_burst_that_ended_does_not_switch():
    pl = planner(cooldown_s=120.0, window_s=1200.0, objective="throughput")  # no window end before t=1200
    phases = start(pl, "2P7D")
    pl.take_decisions()
    switches = _burst(pl, phases, 1100.0, burst_s=60.0, growth=15.0)  # 23 req/s for a minute
    assert switches == []
    evs = pl.take_decisions()
    guard = [e for e in evs if e.reason.startswith("SLO guard")]
    assert guard and all(e.action == "no_switch" for e in guard)
    assert any("not yet sustained" in e.reason for e in guard)  # kept with its reason


def test_guard_a_sustained_overload_switches():
    pl = planner(cooldown_s=120.0, window_s=1200.0, objective="throughput")
    phases = start(pl, "2P7D")
    switches = _burst(pl, phases, 1100.0, burst_s=700.0, growth=1.5)  # 9.2 req/s from t=300 on
    assert len(switches) == 1
    t, d = switches[0]
    assert 480.0 < t <= 800.0 and split_name(d.phases) == "3P6D"
    ev = [e for e in pl.take_decisions() if e.action == "switch"][-1]
    assert ev.reason.startswith("SLO guard") and ev.metrics["sustained_checks"] >= 3


@pytest.mark.parametrize("first_tick, end", [(0.0, 1800.0), (0.2, 1860.0), (59.0, 1860.0), (60.0, 1860.0), (60.5, 1920.0)])
def test_the_warm_up_ends_on_the_first_slice_boundary_after_t_learn(first_tick, end):
    """A live planner ticks first ~0.2 s after t=0, and `split get` said "until t=1860s" for t_learn_s=1800:
    the warm-up ends on the first 60-s slice boundary at or after first tick + t_learn_s (the freeze and the
    windows after it use whole slices), so it lasts t_learn_s to t_learn_s + one slice."""
    pl = planner(t_learn_s=1800.0)
    d = pl.tick(first_tick, split_phases("4P5D", NODES), set())
    assert d is not None and set(d.phases.values()) == {"both"}
    assert pl.warmup_end == end and f"until t={end:.0f}s" in d.reason
