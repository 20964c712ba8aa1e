"""The evolving planner inside the simulator: warm-up, window decisions applied, the gate.

A small test profile (the ``tiny`` one with costlier prefill and room for
batches) and hand-made agents: 16 steady agents whose requests each append
64 tokens and decode 20 (2P2D is their best split on 4 nodes), plus, in the
burst test, 300 one-request agents (16-token prompts, 1 output token: a
swarm of sub-agents) that all start within 10 ms.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evolving_infra.sim.config import SimConfig, SimConfigError, resolve
from evolving_infra.sim.run import simulate
from evolving_infra.sim.schedule import ScheduledReplay, Window, windows_from_meta

from .conftest import BS, chain_agent

TINY = Path(__file__).resolve().parents[3] / "shared" / "profiles" / "tiny.toml"
PLANNER = {"t_learn_s": 1.0, "window_s": 2.0, "slices": 4, "cooldown_s": 0.2, "sample_interval_s": 0.05}


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    text = (
        TINY.read_text()
        .replace('name = "tiny"', 'name = "planner-test"')
        .replace("c0 = 0.002", "c0 = 0.01")
        .replace("c1 = 1.0e-5", "c1 = 1.0e-4")
        .replace("gpu_kv_tokens = 256", "gpu_kv_tokens = 8192")
        .replace("host_kv_tokens = 1024", "host_kv_tokens = 32768")
        .replace("chunk_tokens = 32", "chunk_tokens = 512")
        .replace("max_running = 8", "max_running = 16")
    )
    path = tmp_path_factory.mktemp("profile") / "planner-test.toml"
    path.write_text(text)
    return str(path)


def steady(agents: int = 16, n: int = 25) -> list:
    out = []
    for a in range(agents):
        out += chain_agent(f"s{a}", n, first_blocks=4, growth=16, tail=1, output=20, pause=0.02, base=(a + 1) * 10_000)
    return out


def swarm(k: int) -> list:
    out = []
    for a in range(k):
        out += chain_agent(f"b{a}", 1, first_blocks=4, growth=0, tail=0, output=1, base=(500 + a) * 10_000)
    return out


def run(profile: str, reqs: list, split: str, windows: tuple[Window, ...], **opts: float):
    cfg = SimConfig(nodes=4, profile=profile, policy="evolving", split=split, seed=1, schedule=windows,
                    planner_options={**PLANNER, **opts})
    return simulate(cfg, reqs, BS)


def after_warmup(report: dict) -> list[dict]:
    return [d for d in report["planner_decisions"] if not d["reason"].startswith("warm-up over")]


def test_evolving_warms_up_collocated_then_switches_on_a_clear_imbalance(profile):
    reqs = steady()
    res = run(profile, reqs, "1P3D", (Window("s", 0.0, 1e9, 16),))
    r = res.report
    assert r["requests_completed"] == len(reqs) and r["requests_failed"] == 0
    # the cluster launches collocated; the warm-up ends in the initial split (--split), then
    # the first window finds 1P3D prefill-starved and moves one node
    tl = r["split_timeline"]
    assert tl[0] == [0.0, "collocated"]
    assert [p[1] for p in tl if p[1] in ("1P3D", "2P2D")][:1] == ["1P3D"]
    warm = next(d for d in res.stats.planner_decisions if d["reason"].startswith("warm-up over"))
    assert warm["ts"] == pytest.approx(1.0) and warm["split_after"] == "1P3D"
    assert warm["metrics"]["nodes_fitted"] == 4, "iteration records of every node reached the fit"
    (sw,) = after_warmup(r)
    assert (sw["split_before"], sw["split_after"]) == ("1P3D", "2P2D")
    assert sw["ts"] == pytest.approx(3.0) and sw["metrics"]["slices"] >= 3, "completions reached the window"
    assert r["final_split"] == "2P2D"
    assert r["switches"] == 4 + 1, "4 nodes leave the warm-up, 1 node moves to prefill"
    # the window never ends, the pool has its 16 agents only: reported as run dry at the first finish
    (dry,) = r["schedule_exhausted"]
    first_done = min(rec.finished_at for rec in res.records if rec.finished_at is not None)
    assert dry["prefix"] == "s" and dry["agents"] == 16 and dry["concurrency"] == 16
    assert dry["exhausted_at_s"] >= first_done and dry["end_s"] == 1e9
    assert not any(rec.prefill_node is None for rec in res.records)


def test_the_significance_gate_keeps_a_short_burst_from_switching(profile):
    reqs = steady() + swarm(300)
    windows = (Window("s", 0.0, 1e9, 16), Window("b", 1.6, 1.61, 300))  # all 300 start at 1.6 s
    gated = run(profile, reqs, "2P2D", windows)
    assert gated.report["requests_completed"] == len(reqs)
    assert after_warmup(gated.report) == [] and gated.report["final_split"] == "2P2D"
    burst_window = next(d for d in gated.stats.planner_decisions if d["ts"] == pytest.approx(3.0))
    c = next(c for c in burst_window["candidates"] if c["split"] == "3P1D")
    assert 0 < c["mean_gain"] < c["threshold"] and not c.get("qualifies", False), "the burst raised the mean gain, not above z·σ/√m"
    # 1P3D cannot take the burst: its predicted TTFT and latency are inf, recorded as JSON's null
    c1 = next(c for c in burst_window["candidates"] if c["split"] == "1P3D")
    assert c1["ttft_p95_s"] is None and c1["latency_s"] is None
    # without the gate (z = 0) the same burst switches to 3P1D
    ungated = run(profile, reqs, "2P2D", windows, z=0.0)
    (sw,) = after_warmup(ungated.report)[:1]
    assert (sw["split_before"], sw["split_after"], sw["ts"]) == ("2P2D", "3P1D", pytest.approx(3.0))


def test_schedule_windows_from_a_shift_header_and_errors():
    meta = {"periods": [
        {"name": "a", "start_s": 0.0, "end_s": 10.0, "concurrency": {"putnam": 4},
         "agents": {"putnam": {"prefix": "shift.a.putnam.", "count": 9}}},
        {"name": "b", "start_s": 10.0, "end_s": 20.0, "concurrency": {"putnam": 2, "osworld": 1},
         "agents": {"putnam": {"prefix": "shift.b.putnam.", "count": 5}, "osworld": {"prefix": "shift.b.osworld.", "count": 3}}},
    ]}
    w = windows_from_meta(meta, share=0.5)
    assert w == (Window("shift.a.putnam.", 0.0, 10.0, 2), Window("shift.b.putnam.", 10.0, 20.0, 1),
                 Window("shift.b.osworld.", 10.0, 20.0, 1))
    with pytest.raises(ValueError, match="periods"):
        windows_from_meta({})
    with pytest.raises(SimConfigError, match="one partition"):
        resolve(SimConfig(nodes=4, profile="tiny", policy="static:2P2D", partitions=2, schedule=w))


def test_scheduled_replay_starts_pools_in_their_windows_and_stops_replacing():
    reqs = []
    for a in range(6):
        reqs += chain_agent(f"p.{a}", 2, output=2, pause=1.0, base=(a + 1) * 10_000)
    rep = ScheduledReplay(reqs, (Window("p.", 5.0, 7.5, 2),))
    assert rep.next_time() == 5.0 and rep.poll(4.9) == []
    sent = {a.req.agent for a in rep.poll(5.0)}
    assert sent == {"p.0", "p.1"}
    # p.0 finishes inside the window (p.2 replaces it); p.1 after the window (nobody replaces it)
    rep.on_complete("p.0", "p.0-r0", 5.5)
    assert [a.req.id for a in rep.poll(6.5)] == ["p.0-r1"]
    rep.on_complete("p.0", "p.0-r1", 6.5)
    assert [a.req.id for a in rep.poll(6.5)] == ["p.2-r0"]
    rep.on_complete("p.1", "p.1-r0", 7.0)
    assert [a.req.id for a in rep.poll(8.0)] == ["p.1-r1"]
    rep.on_complete("p.1", "p.1-r1", 8.0)
    assert rep.running_agents == {"p.2"} and not rep.done
    rep.on_complete("p.2", "p.2-r0", 8.0)
    assert [a.req.id for a in rep.poll(9.0)] == ["p.2-r1"]
    rep.on_complete("p.2", "p.2-r1", 9.0)
    assert rep.done and rep.finished_agents == ["p.0", "p.1", "p.2"] and rep.next_time() is None


def test_a_pool_that_runs_dry_inside_its_window_is_reported():
    reqs = []
    for a in range(3):
        reqs += chain_agent(f"p.{a}", 1, output=2, base=(a + 1) * 10_000)
    rep = ScheduledReplay(reqs, (Window("p.", 0.0, 10.0, 2),))
    assert {a.req.agent for a in rep.poll(0.0)} == {"p.0", "p.1"}
    rep.on_complete("p.0", "p.0-r0", 1.0)  # p.2 replaces it
    assert rep.exhausted() == []
    assert [a.req.agent for a in rep.poll(1.0)] == ["p.2"]
    rep.on_complete("p.1", "p.1-r0", 2.0)  # nobody left to replace it, 8 s before the window ends
    rep.on_complete("p.2", "p.2-r0", 3.0)
    assert rep.exhausted() == [{"prefix": "p.", "start_s": 0.0, "end_s": 10.0, "concurrency": 2, "agents": 3, "exhausted_at_s": 2.0}]
    # finishing after the window's end is not running dry
    late = ScheduledReplay(reqs, (Window("p.", 0.0, 0.5, 2),))
    late.poll(0.0)
    late.on_complete("p.0", "p.0-r0", 1.0)
    late.on_complete("p.1", "p.1-r0", 2.0)
    assert late.exhausted() == [] and late.done


def test_simulate_writes_every_planner_evaluation_with_its_reason(profile, tmp_path):
    """Issue 21: the simulator's output keeps every evaluation (switch, no switch, skip, warm-up)
    in decisions.jsonl, as the live planner publishes them on planner.decisions; the report
    counts them per action."""
    import json

    from evolving_infra.sim.run import DECISIONS_JSONL, write_decisions

    reqs = steady() + swarm(300)
    windows = (Window("s", 0.0, 1e9, 16), Window("b", 1.6, 1.61, 300))
    res = run(profile, reqs, "2P2D", windows)
    path = write_decisions(tmp_path, res.stats.planner_decisions)
    assert path.name == DECISIONS_JSONL
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    actions = {r["action"] for r in rows}
    assert {"warmup", "switch", "no_switch"} <= actions, actions
    assert all(r["reason"] for r in rows)
    assert [r["ts"] for r in rows] == sorted(r["ts"] for r in rows)
    by = res.report["planner_evaluations_by_action"]
    assert sum(by.values()) == len(rows) and by["no_switch"] >= 1
    assert res.report["planner_decisions_file"] == DECISIONS_JSONL


def test_a_warmup_restarted_by_the_first_record_ends_on_time_without_sample_ticks(profile):
    """The evolving planner restarts a warm-up that ended before any iteration record at the first one
    (aca3183): ``on_iterations`` brings ``next_tick`` forward from the no-data retry. The simulator pushed its
    planner TICK only after a tick, at the ``next_tick`` of then, so without the sample ticks
    (``sample_interval_s`` 0) the restarted warm-up ended at the retry instead (t=6.0 here, not 4.5)."""
    res = run(profile, steady(), "2P2D", (Window("s", 3.0, 1e9, 16),), sample_interval_s=0.0, no_data_retry_s=5.0)
    ds = res.stats.planner_decisions
    assert ds[1]["action"] == "no_switch" and "no node has published one yet" in ds[1]["reason"], ds[1]
    restart = ds[2]
    assert restart["action"] == "warmup" and restart["ts"] > 3.0, restart
    end = restart["metrics"]["warmup_end"]
    assert end < 6.0, "the restart ends before the retry's t=6 (1 + no_data_retry_s)"
    over = next(d for d in ds if d["reason"].startswith("warm-up over"))
    assert over["ts"] == pytest.approx(end), (over["ts"], end)


def test_a_run_that_ends_inside_a_restarted_warmup_reports_the_restart(profile):
    """The restart decision is made between ticks (on_iterations); the simulator moved decisions to its report only
    at a tick, so a run that ended before the next one (no sample ticks here) lost it, and ``warmup_outlasted``
    named the no-data retry's end (t=6) instead of the restart's (4.5)."""
    from evolving_infra.sim.run import warmup_outlasted

    res = run(profile, steady(agents=8, n=8), "2P2D", (Window("s", 3.0, 1e9, 8),), sample_interval_s=0.0, no_data_retry_s=5.0)
    end = res.report["simulated_s"]
    last = res.stats.planner_decisions[-1]
    assert last["action"] == "warmup" and "warm-up restarted" in last["reason"] and last["ts"] > 3.0, last
    assert end < last["metrics"]["warmup_end"] < 6.0
    assert warmup_outlasted(res.stats.planner_decisions, end) == last["metrics"]["warmup_end"]


def test_iteration_records_reach_the_planner_per_node_at_its_ticks_with_the_same_result(profile, monkeypatch):
    """The simulator holds the engines' iteration records between the evolving planner's ticks and hands each
    node's in one ``on_iterations`` call at the tick (``PolicyBase.records_now`` False), not one call per plan:
    each node gets the same records in the same order and the planner decides the same (the run's results are
    equal to those of a hand-over at each plan's end)."""
    from services.planner.evolving import EvolvingPlanner

    seen: list[tuple[str, list]] = []
    orig = EvolvingPlanner.on_iterations

    def spy(self, node, records, now):
        seen.append((node, list(records)))
        return orig(self, node, records, now)

    monkeypatch.setattr(EvolvingPlanner, "on_iterations", spy)
    reqs = steady()
    windows = (Window("s", 0.0, 1e9, 16),)
    held = run(profile, reqs, "1P3D", windows)
    held_calls = list(seen)
    seen.clear()
    monkeypatch.setattr(EvolvingPlanner, "records_now", property(lambda self: True), raising=False)
    each = run(profile, reqs, "1P3D", windows)
    each_calls = list(seen)

    def by_node(calls):
        out: dict[str, list] = {}
        for node, recs in calls:
            out.setdefault(node, []).extend(recs)
        return out

    assert by_node(held_calls) == by_node(each_calls) and len(by_node(each_calls)) == 4
    ticks = held.stats.planner_ticks
    assert len(each_calls) > 4 * (ticks + 1), "one call per plan end"
    assert len(held_calls) <= 4 * (ticks + 1), "at most one call per node per tick, and one at the end"
    assert held.stats.planner_decisions == each.stats.planner_decisions
    assert [(r.id, r.prefill_node, r.decode_node, r.ttft_s, r.e2e_s) for r in held.records] == [
        (r.id, r.prefill_node, r.decode_node, r.ttft_s, r.e2e_s) for r in each.records
    ]
    assert held.report["final_split"] == each.report["final_split"] == "2P2D"
