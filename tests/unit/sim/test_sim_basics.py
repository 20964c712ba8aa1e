"""Simulator core: hand-checked timings, determinism, policy sets, configuration errors."""

from __future__ import annotations

import pytest

from evolving_infra.sim.config import SimConfig, SimConfigError, resolve
from evolving_infra.sim.policies import PolicyError, default_split, policy_set, with_overrides
from evolving_infra.sim.run import simulate
from shared.itermodel import qk_pairs
from shared.profile import load_profile

from .conftest import BS, chain_agent, small_trace, strip_wall


def tiny(**kw: object) -> SimConfig:
    kw.setdefault("profile", "tiny")
    kw.setdefault("nodes", 2)
    kw.setdefault("policy", "static:1P1D")
    kw.setdefault("concurrency", 1)
    return SimConfig(**kw)  # type: ignore[arg-type]


def test_one_request_on_1p1d_matches_eq1_eq2_by_hand():
    """TTFT = one prefill iteration (Eq. 1); E2E = TTFT + KV transfer + decode iterations (Eq. 2)."""
    p = load_profile("tiny")
    reqs = chain_agent("solo", 1, first_blocks=5, tail=0, output=4)  # 20 prompt tokens, 4 output tokens
    res = simulate(tiny(), reqs, BS)
    (rec,) = res.records
    t_p = p.prefill.c0 + p.prefill.c1 * 20 + p.prefill.c2 * qk_pairs(20, 0)  # one 20-token chunk (budget 32)
    transfer = p.links.gpu_to_gpu_latency_s + 20 * p.kv_bytes_per_token / p.links.gpu_to_gpu_bytes_per_s
    # first token from prefill; 3 more at t_acc = 1.5 per iteration: 1 (acc .5), then 2 -> 2 iterations at B = 1
    phi = 1 - (1 - p.decode.active_experts / p.decode.experts) ** (p.decode.tokens_per_forward * 1)
    t_d = p.decode.d0 + p.decode.d1 * phi + p.decode.d2 * 1
    assert rec.ttft_s == pytest.approx(t_p, rel=1e-12)
    assert rec.e2e_s == pytest.approx(t_p + transfer + 2 * t_d, rel=1e-12)
    assert (rec.prefill_node, rec.decode_node, rec.queue_s, rec.cached_tokens) == ("w0", "w1", 0.0, 0)
    assert rec.completion_tokens == 4 and rec.ok
    assert res.report["requests_completed"] == 1 and res.report["sim_stats"]["handoffs"] == 1


def test_second_request_of_a_branch_reuses_the_prefix_on_the_same_prefill_node():
    reqs = chain_agent("solo", 2, first_blocks=5, growth=2, tail=1, output=3, pause=1.0)
    res = simulate(tiny(), reqs, BS)
    first, second = res.records
    assert second.sent_at == pytest.approx(first.finished_at + 1.0)
    assert second.cached_tokens == 5 * BS, "the first request's 5 full pages are reused"
    assert second.ideal_cached_tokens == 5 * BS
    assert res.report["kv_hit_rate"] == pytest.approx(20 / (21 + 29))


def test_same_inputs_give_an_identical_report(tmp_path):
    reqs = small_trace(8, 6, pause=0.05)
    cfg = SimConfig(nodes=3, profile="tiny", policy="arrow", concurrency=5, seed=3, planner_options={"interval_s": 0.02})
    a = simulate(cfg, reqs, BS)
    b = simulate(cfg, reqs, BS)
    assert strip_wall(a.report) == strip_wall(b.report)
    assert [r.e2e_s for r in a.records] == [r.e2e_s for r in b.records]
    for key in ("wall_s", "sim_speed", "sim_wall_s"):
        assert a.report[key] > 0
    assert a.report["requests_completed"] == len(reqs)


def test_open_loop_and_duration_cut():
    reqs = small_trace(20, 4, pause=0.5)
    cfg = SimConfig(nodes=3, profile="tiny", policy="static:2P1D", arrival="open", arrival_rate=600.0, duration_s=1.0, seed=1)
    res = simulate(cfg, reqs, BS)
    assert res.stats.end_time <= 1.0
    assert res.report["requests_unfinished"] + res.report["requests_completed"] >= res.report["requests_sent"]
    assert all(r.sent_at < 1.0 for r in res.records)


def test_warmup_excludes_early_requests():
    reqs = small_trace(4, 6, pause=0.2)
    res = simulate(SimConfig(nodes=3, profile="tiny", policy="static:2P1D", concurrency=4, warmup_s=0.5), reqs, BS)
    assert res.records and all(r.sent_at >= 0.5 for r in res.records)
    assert res.report["requests_warmup_excluded"] > 0


def test_policy_sets_and_overrides():
    s = policy_set("static:4P5D")
    assert (s.routing, s.decode_routing, s.planner, s.eviction, s.decode_binding, s.switch_mode, s.split) == (
        "cache-aware", "round-robin", "static", "lru", "enqueue", "none", "4P5D")
    d = policy_set("dynamo")
    assert (d.planner, d.switch_mode, d.decode_binding) == ("dynamo", "relaunch", "enqueue")
    a = policy_set("arrow")
    assert (a.planner, a.switch_mode, a.decode_binding) == ("arrow", "strand", "prefill-start")
    e = policy_set("evolving")
    assert (e.eviction, e.switch_mode, e.decode_binding) == ("branch-count", "decoupled", "prefill-start")
    assert with_overrides(d, switch_mode="inplace").switch_mode == "decoupled", "inplace is an alias"
    assert with_overrides(d, eviction="branch-count").eviction == "branch-count"
    with pytest.raises(PolicyError, match="must be one of"):
        with_overrides(d, switch_mode="teleport")
    with pytest.raises(PolicyError, match="unknown policy set"):
        policy_set("sglang")
    with pytest.raises(PolicyError, match="4P5D"):
        policy_set("static:four")
    assert default_split(9) == "6P3D" and default_split(4) == "3P1D" and default_split(2) == "1P1D"


def test_configuration_errors_name_the_flag():
    with pytest.raises(SimConfigError, match="gpus-per-node"):
        resolve(SimConfig(nodes=9, gpus_per_node=8))
    with pytest.raises(SimConfigError, match="not registered"):
        resolve(SimConfig(nodes=2, profile="tiny", policy="static:1P1D", routing="no-such-router"))
    with pytest.raises(SimConfigError, match="covers 9 nodes"):
        resolve(SimConfig(nodes=4, policy="static:4P5D"))
    with pytest.raises(SimConfigError, match="host-capacity-tokens"):
        resolve(SimConfig(nodes=2, profile="tiny", policy="static:1P1D", host_capacity_tokens=10))
    with pytest.raises(SimConfigError, match="switch mode"):
        from evolving_infra.sim.config import ForcedSwitch

        resolve(SimConfig(nodes=2, profile="tiny", policy="static:1P1D", forced_switches=(ForcedSwitch(1.0, "w0", "decode"),)))
    with pytest.raises(SimConfigError, match="planner"):
        resolve(SimConfig(nodes=2, profile="tiny", policy="dynamo", planner="nope"))


def test_block_size_conversion_and_host_capacity():
    reqs = small_trace(3, 3)
    res = simulate(tiny(nodes=3, policy="static:2P1D", block_size=8, host_capacity_tokens=2048, concurrency=3), reqs, BS)
    assert res.report["meta"]["block_size"] == 8 and res.report["meta"]["trace_block_size"] == BS
    assert res.report["meta"]["host_kv_tokens"] == 2048
    assert res.report["requests_completed"] == len(reqs)


def test_request_larger_than_a_node_fails_alone():
    big = chain_agent("big", 1, first_blocks=70, tail=0, output=4, base=900_000)  # 280 tokens > 256-token L1
    ok = chain_agent("ok", 2, base=800_000)
    res = simulate(tiny(concurrency=2), big + ok, BS)
    by_id = {r.id: r for r in res.records}
    assert not by_id["big-r0"].ok and "KV blocks" in (by_id["big-r0"].error or "")
    assert by_id["ok-r0"].ok and by_id["ok-r1"].ok
    assert res.report["requests_failed"] == 1


@pytest.mark.parametrize("policy", ["dynamo", "arrow", "evolving", "static:2P1D"])
def test_every_policy_set_serves_everything(policy):
    reqs = small_trace(6, 5, pause=0.02)
    res = simulate(SimConfig(nodes=3, profile="tiny", policy=policy, concurrency=6), reqs, BS)
    assert res.report["requests_completed"] == len(reqs) and res.report["requests_failed"] == 0
    assert res.report["meta"]["policy"]["name"] == policy


def test_block_size_error_names_where_the_size_came_from():
    """A trace whose blocks cannot be converted names the flag only when it was given, else the profile: a newcomer's
    `simulate --profile tiny` on a 48-token trace read "--block-size 4: ..." though they never passed --block-size."""
    reqs = chain_agent("a", 1)
    odd = BS * 2 + 1  # neither divides the profile's size nor is divided by it
    with pytest.raises(SimConfigError, match=r"^the profile 'tiny''s block size \d+: cannot convert the trace's "):
        simulate(tiny(), reqs, odd)
    with pytest.raises(SimConfigError, match=r"^--block-size 8: cannot convert the trace's "):
        simulate(tiny(block_size=8), reqs, odd)
