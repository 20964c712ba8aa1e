"""Dynamo (load thresholds) and Arrow (TTFT/TPOT SLOs) baselines on crafted states."""

from __future__ import annotations

import pytest

from shared.messages import IterationRecord
from shared.profile import load_profile
from shared.split import split_name, split_phases
from services.planner.baselines import ArrowPlanner, DynamoPlanner, full_prefill_time
from services.planner.policy import PLANNERS, StaticPlanner, make_planner, parse_planner_args

from .helpers import done, state

GB = load_profile("gb300-glm52")
NODES = [f"w{i}" for i in range(9)]


def dyn(**kw) -> DynamoPlanner:
    p = make_planner("dynamo", NODES, GB, **kw)
    assert isinstance(p, DynamoPlanner)
    return p


def feed_states(pl, phases, now, *, queue_per_prefill=0, kv_used=0.3, decode_waiting=0):
    for n, ph in phases.items():
        if ph == "prefill":
            pl.on_node_state(state(n, "prefill", waiting=queue_per_prefill, queue=queue_per_prefill), now)
        else:
            used = int(round(kv_used * 100))
            pl.on_node_state(state(n, "decode", decoding=10, waiting=decode_waiting, free=100 - used, total=100), now)


def run(pl, phases, t_end, busy=frozenset(), **load):
    out = []
    t = pl.next_tick()
    while t is not None and t <= t_end:
        feed_states(pl, phases, t, **load)
        d = pl.tick(t, phases, busy)
        if d is not None:
            out.append((t, split_name(d.phases)))
            phases = d.phases
        t = pl.next_tick()
    return phases, out


def test_dynamo_moves_one_node_to_decode_when_kv_is_high_and_queue_empty():
    pl = dyn()
    phases = split_phases("6P3D", NODES)
    phases, out = run(pl, phases, 180.0, queue_per_prefill=0, kv_used=0.95)
    assert out == [(180.0, "5P4D")]
    ev = [e for e in pl.take_decisions() if e.action == "switch"][0]
    assert ev.metrics["decode_kv_load"] == pytest.approx(0.95) and ev.metrics["vote_decode"] == 1


def test_dynamo_moves_one_node_to_prefill_on_a_growing_queue():
    pl = dyn()
    phases = split_phases("4P5D", NODES)
    _, out = run(pl, phases, 180.0, queue_per_prefill=8, kv_used=0.3)
    assert out == [(180.0, "5P4D")]


def test_dynamo_ties_and_thresholds_change_nothing():
    for load in (dict(queue_per_prefill=8, kv_used=0.95), dict(queue_per_prefill=1, kv_used=0.7)):
        pl = dyn()
        _, out = run(pl, split_phases("4P5D", NODES), 360.0, **load)
        assert out == []
        assert {e.action for e in pl.take_decisions()} == {"no_switch"}


def test_dynamo_waits_while_a_node_relaunches_and_keeps_min_endpoint():
    pl = dyn()
    phases = split_phases("4P5D", NODES)
    _, out = run(pl, phases, 900.0, busy={"w3"}, queue_per_prefill=0, kv_used=0.95)
    assert out == []
    pl2 = dyn()
    _, out2 = run(pl2, split_phases("1P8D", NODES), 180.0, queue_per_prefill=0, kv_used=0.95)
    assert out2 == []  # prefill already at min_endpoint = 1
    assert "min_endpoint" in pl2.take_decisions()[-1].reason


def test_dynamo_counts_waiting_requests_into_kv_load():
    pl = dyn()
    feed_states(pl, split_phases("4P5D", NODES), 0.0, kv_used=0.5, decode_waiting=10)
    assert pl.sample(split_phases("4P5D", NODES)) == (0.0, pytest.approx(0.5 + 0.02 * 10))


def arrow(**kw) -> ArrowPlanner:
    p = make_planner("arrow", NODES, GB, **kw)
    assert isinstance(p, ArrowPlanner)
    return p


def test_arrow_counts_cached_prefixes_as_prefill_work():
    pl = arrow()
    phases = split_phases("4P5D", NODES)
    # each prefill node holds 6 queued requests with 100K cached + 2K new tokens:
    # ~0.3 s each with the cache, but Arrow prices 102K tokens of prefill
    for n, ph in phases.items():
        if ph == "prefill":
            pl.on_node_state(state(n, "prefill", queue=6, qwork=(2000, 100_000)), 0.0)
        else:
            pl.on_node_state(state(n, "decode", decoding=10), 0.0)
    pl.on_request_done(done("r1", 0.0, prompt=102_000, cached=100_000), 0.0)
    t_full = full_prefill_time(GB.prefill, 102_000, GB.scheduler.chunk_tokens)
    assert pl.predicted_ttft("w0", 102_000) == pytest.approx(7 * t_full)
    d = pl.tick(0.0, phases, set())
    assert d is not None and split_name(d.phases) == "5P4D"
    assert pl.next_tick() == 10.0
    assert pl.tick(5.0, d.phases, set()) is None  # not due


def test_arrow_flips_toward_decode_when_tpot_breaks_and_idles_when_both_met():
    pl = arrow(tpot_slo_s=0.01)
    phases = split_phases("4P5D", NODES)
    for n, ph in phases.items():
        pl.on_node_state(state(n, ph, decoding=40 if ph == "decode" else 0), 0.0)
        if ph == "decode":
            pl.on_iterations(n, [IterationRecord(start=0.0, duration_s=0.04, phase="decode", decode_batch=40, repeat=10)], 0.0)
    d = pl.tick(0.0, phases, set())
    assert d is not None and split_name(d.phases) == "3P6D"
    ev = pl.take_decisions()[-1]
    assert ev.metrics["tpot_s"] == pytest.approx(0.04 / 3.2)
    quiet = arrow()
    for n, ph in phases.items():
        quiet.on_node_state(state(n, ph, decoding=5 if ph == "decode" else 0), 0.0)
    assert quiet.tick(0.0, phases, set()) is None and quiet.take_decisions() == []
    assert arrow().tick(0.0, phases, {"w1"}) is None  # busy: no decision


def test_static_and_registry():
    s = make_planner("static", NODES, GB)
    assert isinstance(s, StaticPlanner) and s.next_tick() is None
    assert s.tick(0.0, split_phases("4P5D", NODES), set()) is None
    assert set(PLANNERS) == {"static", "evolving", "dynamo", "arrow"}
    with pytest.raises(ValueError, match="unknown planner"):
        make_planner("llumnix", NODES, GB)
    with pytest.raises(ValueError, match="takes no parameters"):
        make_planner("static", NODES, GB, x=1)
    with pytest.raises(ValueError, match="valid"):
        make_planner("dynamo", NODES, GB, interval=3)
    with pytest.raises(ValueError):
        make_planner("arrow", NODES, GB, ttft_slo_s=0)


def test_parse_planner_args():
    assert parse_planner_args(["t_learn_s=60", "slo_guard=false", "initial_split=4P5D", "max-batch=32", "x=none"]) == {
        "t_learn_s": 60,
        "slo_guard": False,
        "initial_split": "4P5D",
        "max_batch": 32,
        "x": None,
    }
    with pytest.raises(ValueError):
        parse_planner_args(["novalue"])
