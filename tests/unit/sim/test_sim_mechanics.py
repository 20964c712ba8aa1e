"""Phase-switch mechanics (relaunch, strand, in place), parking, decode binding modes."""

from __future__ import annotations

import dataclasses

import pytest

from evolving_infra.sim.cluster import ClusterSim
from evolving_infra.sim.config import ForcedSwitch, SimConfig, SimConfigError, resolve
from evolving_infra.sim.run import simulate
from shared.messages import AllBlocksCleared

from .conftest import BS, chain_agent, small_trace


def build(cfg: SimConfig, reqs, nodes=None):
    run = resolve(cfg)
    names = nodes or [f"w{i}" for i in range(cfg.nodes)]
    sim = ClusterSim(run, reqs, names, cfg.arrival_for(), forced=cfg.forced_switches)
    batches: list[tuple[float, str, list]] = []
    orig = sim.directory.apply_kv_events  # the simulator's apply_kv_batch (no batch object)

    def spy(node, seq, ts, events):
        batches.append((ts, sim.directory.names[node], list(events)))
        return orig(node, seq, ts, events)

    sim.directory.apply_kv_events = spy  # type: ignore[method-assign]
    return sim, batches


def switch_cfg(mode: str, **kw: object) -> SimConfig:
    kw.setdefault("relaunch_s", 2.0)
    return SimConfig(
        nodes=3,
        profile="tiny",
        policy="static:2P1D",
        switch_mode=mode,
        concurrency=12,
        forced_switches=(ForcedSwitch(0.001, "w0", "decode"),),
        **kw,  # type: ignore[arg-type]
    )


def clears(batches, node: str) -> list[float]:
    return [t for t, n, ev in batches[1:] if n == node and any(isinstance(e, AllBlocksCleared) for e in ev) and t > 0]


def test_relaunch_drains_goes_out_of_service_and_empties_caches():
    reqs = small_trace(12, 8, pause=0.3)
    sim, batches = build(switch_cfg("relaunch"), reqs)
    res = sim.run_to_end()
    st = res.stats
    assert len(res.records) == len(reqs) and all(r.ok for r in res.records), "nothing lost"
    assert st.reroutes > 0, "requests queued on the switching node were routed elsewhere"
    ((node, down, up),) = st.out_of_service
    assert node == "w0" and up - down == pytest.approx(2.0)
    (sw,) = res.timeline.switches
    assert (sw.node, sw.from_phase, sw.to_phase) == ("w0", "prefill", "decode")
    assert sw.decided_at == pytest.approx(0.001) and sw.applied_at == pytest.approx(up) and sw.switch_s >= 2.0
    assert clears(batches, "w0") == [pytest.approx(down)], "L1 and L2 emptied when the relaunch starts"
    for r in res.records:
        if r.sent_at >= 0.001:
            assert r.prefill_node != "w0", "no routing to the switching node"
        if r.decode_node == "w0":
            assert r.sent_at + (r.ttft_s or 0) >= up - 1e-9, "w0 decodes only after it serves again"
    assert any(r.decode_node == "w0" for r in res.records), "w0 serves its new phase"
    # after the relaunch no KV of the old incarnation is known anywhere
    held_before = {h for t, n, ev in batches if n == "w0" and t <= down for e in ev for h in getattr(e, "block_hashes", [])}
    stored_after = {h for t, n, ev in batches if n == "w0" and t > down for e in ev for h in getattr(e, "block_hashes", [])}
    lk = sim.directory.lookup(sorted(held_before - stored_after)[:1]) if held_before - stored_after else None
    if lk is not None:
        assert all(p.node != "w0" for p in lk.nodes)


def test_strand_switches_in_place_without_downtime_but_loses_the_kv():
    reqs = small_trace(12, 8, pause=0.3)
    sim, batches = build(switch_cfg("strand"), reqs)
    res = sim.run_to_end()
    assert len(res.records) == len(reqs) and all(r.ok for r in res.records)
    assert res.stats.out_of_service == [] and res.stats.reroutes > 0
    (sw,) = res.timeline.switches
    assert sw.switch_s < 0.5, "only the drain"
    assert clears(batches, "w0") == [pytest.approx(sw.applied_at)]


def test_inplace_switch_keeps_the_kv():
    reqs = small_trace(12, 8, pause=0.3)
    sim, batches = build(switch_cfg("inplace"), reqs)
    res = sim.run_to_end()
    assert len(res.records) == len(reqs)
    (sw,) = res.timeline.switches
    assert clears(batches, "w0") == []
    assert sim.nodes["w0"].sched.phase == "decode"


def test_requests_wait_when_no_node_serves_a_phase_then_complete():
    # 1P2D: the only prefill node leaves prefill while w1 becomes the new one
    cfg = SimConfig(
        nodes=3,
        profile="tiny",
        policy="static:1P2D",
        switch_mode="inplace",
        concurrency=8,
        forced_switches=(ForcedSwitch(0.001, "w0", "decode"), ForcedSwitch(0.001, "w1", "prefill")),
    )
    res = simulate(cfg, small_trace(8, 4, pause=0.05), BS)
    assert res.stats.parked > 0
    assert res.report["requests_completed"] == 32 and res.report["final_split"] == "1P2D"
    assert res.report["switches"] == 2


def binding_run(mode: str):
    # prompt 36 tokens + 40 output = 19 blocks of the decode node's 64: three fit at once
    reqs = []
    for i in range(6):
        reqs += chain_agent(f"b{i}", 1, first_blocks=9, tail=0, output=40, base=(i + 1) * 1000)
    cfg = SimConfig(nodes=2, profile="tiny", policy="static:1P1D", decode_binding=mode, concurrency=6)
    return simulate(cfg, reqs, BS)


def test_enqueue_reservation_holds_prefill_until_decode_room():
    res = binding_run("enqueue")
    starts = sorted(r.sent_at + r.queue_s for r in res.records)
    first_finish = min(r.finished_at for r in res.records)
    assert starts[2] < first_finish <= starts[3] + 1e-12, "the 4th prefill waits for a decode reservation"


@pytest.mark.parametrize("mode", ["prefill-start", "route"])
def test_late_binding_lets_prefill_run_ahead(mode):
    res = binding_run(mode)
    starts = sorted(r.sent_at + r.queue_s for r in res.records)
    first_finish = min(r.finished_at for r in res.records)
    assert starts[-1] < first_finish, "every prefill starts before any decode finishes"
    assert res.report["requests_completed"] == 6


def test_prefill_start_binding_happens_when_the_prefill_starts():
    reqs = small_trace(8, 4)
    cfg = SimConfig(nodes=4, profile="tiny", policy="static:2P2D", decode_binding="prefill-start", concurrency=8)
    sim, _ = build(cfg, reqs)
    bound: dict[str, float] = {}
    orig = sim._bind_at_prefill_start

    def spy(pnode, f, t):
        bound[f.req.id] = t
        return orig(pnode, f, t)

    sim._bind_at_prefill_start = spy  # type: ignore[method-assign]
    res = sim.run_to_end()
    assert len(bound) == len(reqs)
    for r in res.records:
        assert bound[r.id] == pytest.approx(r.sent_at + r.queue_s)
        assert r.decode_node in ("w2", "w3")


def test_message_latency_delays_every_hop():
    reqs = chain_agent("solo", 1, first_blocks=5, tail=0, output=4)
    base = simulate(SimConfig(nodes=2, profile="tiny", policy="static:1P1D", concurrency=1), reqs, BS).records[0]
    lat = simulate(SimConfig(nodes=2, profile="tiny", policy="static:1P1D", concurrency=1, msg_latency_s=0.01), reqs, BS).records[0]
    transfer = 0.0012  # tiny: 1 ms + 20 tokens x 1 KB / 100 MB/s; the KV moves while the hand-off travels
    assert lat.ttft_s == pytest.approx(base.ttft_s + 0.02)  # dispatch + first token back
    assert lat.e2e_s == pytest.approx(base.e2e_s - transfer + 0.03)  # dispatch + max(hand-off, transfer) + last token back


@pytest.mark.parametrize("eviction", ["lru", "branch-count"])
@pytest.mark.parametrize("mode", ["relaunch", "strand", "none"])
def test_unsent_decode_kv_events_change_nothing(mode, eviction):
    """Decode nodes' KV events (and decode placements) are not sent when no decision can read
    them: same report, branch counts included (nothing reads a decode node's L2)."""
    reqs = small_trace(12, 8, pause=0.3)
    forced = (ForcedSwitch(0.5, "w2", "prefill"), ForcedSwitch(0.5, "w0", "decode")) if mode != "none" else ()
    kw = dict(nodes=3, profile="tiny", policy="static:2P1D", concurrency=12, relaunch_s=0.5, forced_switches=forced,
              eviction=eviction, host_capacity_tokens=256)
    if mode != "none":
        kw["switch_mode"] = mode
    a = simulate(SimConfig(**kw), reqs, BS)  # type: ignore[arg-type]
    b = simulate(SimConfig(decode_kv_events="always", **kw), reqs, BS)  # type: ignore[arg-type]
    assert a.stats.kv_batches < b.stats.kv_batches
    assert [(r.id, r.ttft_s, r.e2e_s, r.cached_tokens, r.prefill_node, r.decode_node) for r in a.records] == [
        (r.id, r.ttft_s, r.e2e_s, r.cached_tokens, r.prefill_node, r.decode_node) for r in b.records
    ]


@pytest.mark.parametrize("routing", ["cache-aware", "round-robin"])
@pytest.mark.parametrize("mode", ["none", "decoupled"])
def test_unsent_gpu_kv_events_change_nothing(mode, routing):
    """GPU-tier KV events are not sent when the router reads no GPU prefix and no branch counts
    are kept: L2 ⊇ L1, so lookups (local prefixes, longest_any, host-first fetch sources, the
    shared pool's fetches under decoupled switching) are the same. Same records."""
    reqs = small_trace(12, 8, pause=0.3)
    forced = (ForcedSwitch(0.5, "w2", "prefill"), ForcedSwitch(0.5, "w0", "decode")) if mode != "none" else ()
    kw = dict(nodes=3, profile="tiny", policy="static:2P1D", concurrency=12, forced_switches=forced, routing=routing)
    if mode != "none":
        kw.update(switch_mode=mode, pool_fetch_min_tokens=1)
    sim_a, batches_a = build(SimConfig(**kw), reqs)  # type: ignore[arg-type]
    a = sim_a.run_to_end()
    sim_b, batches_b = build(SimConfig(decode_kv_events="always", **kw), reqs)  # type: ignore[arg-type]
    b = sim_b.run_to_end()
    assert sim_a.skip_gpu_kv and not sim_b.skip_gpu_kv
    gpu_a = sum(1 for _, _, evs in batches_a for e in evs if getattr(e, "tier", None) == "gpu")
    gpu_b = sum(1 for _, _, evs in batches_b for e in evs if getattr(e, "tier", None) == "gpu")
    assert gpu_a == 0 and gpu_b > 0
    assert sim_a.pool == (mode == "decoupled")
    fetched = sum(n.sched.fetch_counters.get("completed", 0) for n in sim_a.nodes.values())
    assert fetched == sum(n.sched.fetch_counters.get("completed", 0) for n in sim_b.nodes.values())
    if mode == "decoupled" and routing == "round-robin":
        assert fetched > 0  # agents move between prefill nodes: the pool's fetch sources are read
    assert [r for r in a.records] == [r for r in b.records]
    assert a.stats.events == b.stats.events and a.stats.plans == b.stats.plans


def test_gpu_kv_events_sent_when_read():
    """dynamo-kv credits device hits (gpu_blocks) and branch-count keeps counts: GPU events go out."""
    reqs = small_trace(4, 3)
    for kw in (dict(routing="dynamo-kv"), dict(eviction="branch-count")):
        sim, batches = build(SimConfig(nodes=3, profile="tiny", policy="static:2P1D", concurrency=4, **kw), reqs)  # type: ignore[arg-type]
        sim.run_to_end()
        assert not sim.skip_gpu_kv
        assert any(getattr(e, "tier", None) == "gpu" for _, _, evs in batches for e in evs)


@pytest.mark.parametrize("binding", ["enqueue", "prefill-start", "route"])
def test_recorded_zero_output_gets_one_token_as_live(binding):
    """Real CC sessions record 23 zero-length outputs; the live replayer asks for max(1, n)
    tokens, and so does the simulator (a 0 once crashed the decode reservation)."""
    reqs = small_trace(3, 4, output=0, pause=0.1)
    res = simulate(SimConfig(nodes=3, profile="tiny", policy="static:2P1D", decode_binding=binding, concurrency=3), reqs, BS)
    assert len(res.records) == len(reqs) and all(r.ok for r in res.records)
    assert {r.completion_tokens for r in res.records} == {1}
    assert {r.expected_completion_tokens for r in res.records} == {0}


def test_control_plane_ingress_and_egress_delay_first_token_and_end():
    """``ingress_s`` (+ per prompt token) delays the work's arrival at the routing decision and its
    prefill node, ``egress_s`` the first token's and the end's delivery: TTFT and E2E grow by exactly
    their sum; all 0 (the default) is the plain run."""
    reqs = chain_agent("solo", 1, first_blocks=5, tail=0, output=4)
    cfg = SimConfig(nodes=2, profile="tiny", policy="static:1P1D", concurrency=1)
    base = simulate(cfg, reqs, BS).records[0]
    cp = simulate(dataclasses.replace(cfg, ingress_s=0.01, ingress_s_per_token=0.001, egress_s=0.005), reqs, BS)
    r = cp.records[0]
    delay = 0.01 + 0.001 * reqs[0].input_tokens + 0.005
    assert r.ttft_s == pytest.approx(base.ttft_s + delay) and r.e2e_s == pytest.approx(base.e2e_s + delay)
    assert r.first_token_at == pytest.approx(base.first_token_at + delay - 0.005)  # the engine's time
    assert cp.report["meta"]["control_plane"] == {"ingress_s": 0.01, "ingress_s_per_token": 0.001, "egress_s": 0.005}
    assert "control_plane" not in simulate(cfg, reqs, BS).report["meta"]
    with pytest.raises(SimConfigError, match="--egress-s"):
        simulate(dataclasses.replace(cfg, egress_s=-1.0), reqs, BS)


def test_the_prompt_part_of_the_ingress_is_served_in_send_order():
    """The router parses and hashes one prompt after another: a short request sent with a long one
    (same instant, after it in send order) reaches the decision after it, as live; the fixed part
    runs in parallel."""
    long_, short = chain_agent("long", 1, first_blocks=40, tail=0, output=2), chain_agent("short", 1, first_blocks=2, tail=0, output=2)
    cfg = SimConfig(nodes=2, profile="tiny", policy="static:1P1D", concurrency=2, ingress_s=0.01, ingress_s_per_token=0.001)
    sim = ClusterSim(resolve(cfg), long_ + short, ["w0", "w1"], cfg.arrival_for())
    decided: dict[str, float] = {}
    orig = sim._dispatch

    def spy(f, t):
        decided.setdefault(f.req.id, t)
        return orig(f, t)

    sim._dispatch = spy  # type: ignore[method-assign]
    recs = {r.id: r for r in sim.run_to_end().records}
    n_long, n_short = long_[0].input_tokens, short[0].input_tokens
    assert recs["long-r0"].sent_at == recs["short-r0"].sent_at == 0.0
    assert decided["long-r0"] == pytest.approx(0.001 * n_long + 0.01)
    assert decided["short-r0"] == pytest.approx(0.001 * (n_long + n_short) + 0.01)  # waited for the long prompt


def test_counted_kv_samples_only_prefill_nodes_across_a_switch():
    """``SimStats.counted_*``: at every send, the counted blocks of the nodes not serving decode only
    (their sum over their number, their maximum), as the phases stand then: collocated at first (every
    node sampled), then w0 serves decode (left out from its switch on)."""
    reqs = small_trace(12, 8, pause=0.3)
    cfg = SimConfig(nodes=3, profile="tiny", policy="static:collocated", switch_mode="inplace", concurrency=12,
                    forced_switches=(ForcedSwitch(0.3, "w0", "decode"),))
    sim, _ = build(cfg, reqs)
    seen: list[tuple[list[str], list[int]]] = []
    orig = sim.directory.counted_blocks_all

    def spy() -> list[int]:
        out = orig()
        seen.append(([n.phase for n in sim.nodes.values()], list(out)))
        return out

    sim.directory.counted_blocks_all = spy  # type: ignore[method-assign]
    st = sim.run_to_end().stats
    samples, total, top = 0, 0.0, 0
    for phases, counts in seen:
        own = [c for p, c in zip(phases, counts) if p != "decode"]
        if own:
            samples += 1
            total += sum(own) / len(own)
            top = max(top, *own)
    decode_sets = {tuple(p == "decode" for p in phases) for phases, _ in seen}
    assert len(decode_sets) == 2, "samples were taken under both splits"
    assert any(c for p, counts in seen for c, ph in zip(counts, p) if ph == "decode"), "a decode node's count is left out"
    assert top > 0 and (st.counted_samples, st.counted_sum, st.counted_max) == (samples, total, top)
