"""TTFT predictor (paper Eq. 3 and 7, App. E.3) on hand-computed cases, and the ``ttft`` policy.

Unless a test says otherwise the node model is c0 = 10 ms per iteration,
c1 = 0.1 ms per uncached token, no attention or restore cost, 100-token
iterations: an iteration of u tokens lasts 0.01 + 1e-4·u s.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from shared.itermodel import DecodeModel, PrefillModel, qk_pairs
from shared.messages import FetchRange, KvLookupReply, NodePrefix, NodeModels, NodeState, PlannerModels, QueuedWork

from services.kvdirectory.lookup import fetch_plan
from services.router.core import RouteDecision, RouterCore
from services.router.nodes import NodeLoad
from services.router.policy import PolicyWrapper, RouteRequest, make_policy
from services.router.ttft import FetchModel, NodeCoefficients, TtftPolicy, TtftPredictor, replay_queue
import services.router.ttft as ttft_mod

DEC = DecodeModel(d0=0.004, d1=0.0, d2=0.001, tokens_per_forward=2.0)
SIMPLE = NodeCoefficients(prefill=PrefillModel(c0=0.01, c1=1e-4, c2=0.0, c3=0.0), decode=DEC, chunk_tokens=100)


def it(u: int) -> float:
    """Duration of one iteration of ``u`` uncached tokens under SIMPLE."""
    return 0.01 + 1e-4 * u


def predictor(**kw) -> TtftPredictor:
    return TtftPredictor(SIMPLE, **kw)


def q(rid: str, uc: int, c: int = 0, rst: int = 0) -> QueuedWork:
    return QueuedWork(rid=rid, uncached_tokens=uc, cached_tokens=c, restore_tokens=rst)


def st(node: str, ts: float, remaining: float = 0.0, queue=(), **kw) -> NodeState:
    return NodeState(node=node, phase=kw.pop("phase", "prefill"), ts=ts, remaining_s=remaining, queue=list(queue), **kw)


def cand(*nodes: str) -> list[NodeLoad]:
    return [NodeLoad(node=n, phase="prefill") for n in sorted(nodes)]


# --------------------------------------------------------------------------- #
# Eq. 3 and the replay
# --------------------------------------------------------------------------- #


def test_lone_request_is_eq3_with_its_real_packing():
    """Replaying one request alone gives Eq. 3 with t̄ = t_uc/ceil(t_uc/chunk) and f·t_c = t_rst."""
    pm = PrefillModel(c0=0.015, c1=2.27e-5, c2=1.8e-10, c3=1.6e-8)
    coef = NodeCoefficients(prefill=pm, decode=DEC, chunk_tokens=8192)
    p = TtftPredictor(coef, copy_price_s_per_token=0.0)
    t_uc, t_c, rst = 20_000, 100_000, 30_000
    e = p.estimate("n", 0.0, uncached_tokens=t_uc, cached_tokens=t_c, restore_tokens=rst)
    eq3 = pm.request_time(t_uc, t_c, mean_chunk_tokens=t_uc / 3, restored_share=rst / t_c)
    assert e.prefill_s == pytest.approx(eq3, rel=1e-12)
    # spelled out: 3 iterations, A(t_uc, t_c) summed over the chunks equals A of the whole request
    by_hand = 3 * 0.015 + 2.27e-5 * t_uc + 1.8e-10 * (t_uc * t_c + t_uc * (t_uc + 1) / 2) + 1.6e-8 * rst
    assert e.prefill_s == pytest.approx(by_hand, rel=1e-12)
    assert e.wait_s == 0.0 and e.ttft_s == e.prefill_s and e.trusted is False


def test_chunk_sums_of_qk_pairs_telescope():
    """Σ over chunks of A(chunk, cached before it) == A(t_uc, t_c): why the replay's closed form is exact."""
    for t_uc, t_c, chunk in [(250, 0, 100), (8193, 12345, 8192), (1, 7, 3), (999, 0, 1)]:
        done, total = 0, 0.0
        while done < t_uc:
            k = min(chunk, t_uc - done)
            total += qk_pairs(k, t_c + done)
            done += k
        assert total == pytest.approx(qk_pairs(t_uc, t_c), rel=1e-12)


def _naive_replay(items, coef: NodeCoefficients, decoding: int = 0):
    """Chunk-by-chunk packing as the worker's scheduler does it (FCFS, budget per iteration)."""
    budget, extra = coef.decode_part(decoding)
    p = coef.prefill
    t, iters = 0.0, []
    cur: list[tuple[int, int, int]] = []  # (tokens, cached before, restore)
    used = 0
    for w in items:
        rem, cb, r = w.uncached_tokens, w.cached_tokens, w.restore_tokens
        while rem > 0:
            k = min(rem, budget - used)
            cur.append((k, cb, r))
            r = 0
            cb += k
            rem -= k
            used += k
            if used == budget:
                iters.append(cur)
                cur, used = [], 0
    for chunks in iters:
        t += p.c0 + extra + sum(p.c1 * k + p.c2 * qk_pairs(k, cb) + p.c3 * r for k, cb, r in chunks)
    return t, used, cur


def test_replay_matches_chunk_by_chunk_packing():
    pm = PrefillModel(c0=0.015, c1=2.27e-5, c2=1.8e-10, c3=1.6e-8)
    coef = NodeCoefficients(prefill=pm, decode=DEC, chunk_tokens=8192)
    items = [q("a", 5000, 1000, 1000), q("b", 20_000, 64_000, 64_000), q("c", 10), q("d", 8182, 5), q("e", 3000, 0)]
    for decoding in (0, 3):
        _check_replay(items, coef, decoding)


def _check_replay(items, coef, decoding):
    s = replay_queue(items, coef, decoding)
    t, used, cur = _naive_replay(items, coef, decoding)
    assert s.t_open == pytest.approx(t, rel=1e-9, abs=1e-12)
    assert s.used == used and s.items == sum(1 for it in items if it.uncached_tokens > 0)
    assert s.sum_uc == sum(k for k, _, _ in cur)
    assert s.sum_qk == pytest.approx(sum(qk_pairs(k, cb) for k, cb, _ in cur), rel=1e-9, abs=1e-9)
    assert s.sum_rst == sum(r for _, _, r in cur)


@settings(max_examples=300, deadline=None)
@given(
    hs.lists(hs.tuples(hs.integers(0, 20_000), hs.integers(0, 100_000), hs.integers(0, 50_000)), max_size=8),
    hs.sampled_from([16, 100, 1000, 8192]),
    hs.integers(0, 6),
)
def test_closed_form_replay_matches_chunk_by_chunk_packing(raw, chunk, decoding):
    coef = NodeCoefficients(prefill=PrefillModel(c0=0.015, c1=2.27e-5, c2=1.8e-10, c3=1.6e-8), decode=DEC, chunk_tokens=chunk)
    _check_replay([q(f"r{i}", uc, c, r) for i, (uc, c, r) in enumerate(raw)], coef, decoding)


def test_collocated_decode_shares_every_iteration():
    """B decoding requests take ceil(t_fwd) tokens each and add T_D(B) − min(c0, d0) per iteration."""
    p = predictor()
    p.apply_state(st("c", 0.0, phase="both", decoding=5), 0.0)
    budget, extra = SIMPLE.decode_part(5)
    assert budget == 100 - 5 * 2 and extra == pytest.approx((0.004 + 0.0 + 0.001 * 5) - 0.004)
    e = p.estimate("c", 0.0, uncached_tokens=180, cached_tokens=0)
    assert e.prefill_s == pytest.approx(2 * (0.01 + extra) + 1e-4 * 180)


# --------------------------------------------------------------------------- #
# Eq. 7: wait, shared iteration, stale state, unreported sends
# --------------------------------------------------------------------------- #


def test_wait_is_remaining_time_plus_queue_service_times():
    """Ŵ = T_rem + Σ T_P^req(w_j) when nothing shares an iteration (queue items fill whole iterations)."""
    p = predictor()
    p.apply_state(st("n", 10.0, remaining=0.3, queue=[q("a", 100), q("b", 200, 50)]), 10.0)
    e = p.estimate("n", 10.0, uncached_tokens=70, cached_tokens=0)
    assert e.wait_s == pytest.approx(0.3 + it(100) + 2 * it(100))  # 0.3 + 0.02 + 0.04
    assert e.prefill_s == pytest.approx(it(70))
    assert e.ttft_s == pytest.approx(0.36 + 0.017) and not e.shared and e.queue_items == 2


def test_request_shares_the_queue_tails_iteration():
    """Queue a:150 → [a100] [a50 + r40]: the request's first chunk joins the tail's iteration.

    Ŵ = T_rem + 0.02 (start of the shared iteration); T_P^req = the shared iteration
    (90 tokens: 0.019); TTFT 0.2 + 0.02 + 0.019 = 0.239 — one iteration's c0 less than
    running it after the tail (0.2 + 0.02 + 0.015 + 0.014 = 0.249).
    """
    p = predictor()
    p.apply_state(st("n", 5.0, remaining=0.2, queue=[q("a", 150)]), 5.0)
    e = p.estimate("n", 5.0, uncached_tokens=40, cached_tokens=0)
    assert e.shared
    assert e.wait_s == pytest.approx(0.2 + 0.02)
    assert e.prefill_s == pytest.approx(it(90))
    assert e.ttft_s == pytest.approx(0.239)
    # a longer request fills the shared iteration (50 of its tokens) and continues alone
    e = p.estimate("n", 5.0, uncached_tokens=180, cached_tokens=0)  # [a50 + r50] [r100] [r30]
    assert e.shared and e.wait_s == pytest.approx(0.22) and e.prefill_s == pytest.approx(0.02 + 0.02 + 0.013)


def test_shared_iteration_charges_attention_on_the_new_chunk():
    pm = PrefillModel(c0=0.01, c1=1e-4, c2=1e-8, c3=1e-6)
    p = TtftPredictor(NodeCoefficients(prefill=pm, decode=DEC, chunk_tokens=100))
    p.apply_state(st("n", 0.0, queue=[q("a", 30, 10, 10)]), 0.0)  # tail: 30 tokens after 10 cached, 10 restored
    e = p.estimate("n", 0.0, uncached_tokens=120, cached_tokens=500, restore_tokens=200)
    first = 0.01 + 1e-4 * (30 + 70) + 1e-8 * (qk_pairs(30, 10) + qk_pairs(70, 500)) + 1e-6 * (10 + 200)
    second = 0.01 + 1e-4 * 50 + 1e-8 * qk_pairs(50, 570)
    assert e.shared and e.wait_s == 0.0
    assert e.prefill_s == pytest.approx(first + second, rel=1e-12)


def test_remaining_time_is_aged_by_the_states_age():
    p = predictor()
    p.apply_state(st("n", 10.0, remaining=1.5, queue=[q("a", 100)]), 10.2)
    assert p.estimate("n", 11.0, uncached_tokens=100, cached_tokens=0).wait_s == pytest.approx(0.5 + 0.02)
    assert p.estimate("n", 12.0, uncached_tokens=100, cached_tokens=0).wait_s == pytest.approx(0.0 + 0.02)


def test_stale_state_is_not_trusted_only_router_sends_count():
    """A state older than 5 s: its queue and remaining time are ignored; the router's
    own in-flight sends (reported or not) are the queue."""
    p = predictor()
    p.apply_state(st("n", 0.0, remaining=1.0, queue=[q("old", 500), q("r1", 150)]), 0.0)
    p.on_dispatch("r1", "n", uncached_tokens=150)  # listed by the state: reported
    p.on_dispatch("r2", "n", uncached_tokens=30)  # not listed: unreported
    fresh = p.estimate("n", 4.0, uncached_tokens=10, cached_tokens=0)
    # trusted at age 4: remaining 1.0 aged to 0; queue old:500, r1:150, r2:30 → 6 full iterations, open 80
    assert fresh.trusted and fresh.wait_s == pytest.approx(6 * it(100)) and fresh.prefill_s == pytest.approx(it(90))
    stale = p.estimate("n", 6.0, uncached_tokens=10, cached_tokens=0)
    # untrusted at age 6: queue = r1:150, r2:30 → [r1 100] [r1 50 + r2 30 + new 10]
    assert not stale.trusted and stale.queue_items == 2
    assert stale.wait_s == pytest.approx(it(100)) and stale.prefill_s == pytest.approx(it(90))
    # an idle node with an old heartbeat and no sends is predicted idle
    p.apply_state(st("idle", 0.0, remaining=3.0, queue=[q("x", 900)]), 0.0)
    e = p.estimate("idle", 100.0, uncached_tokens=100, cached_tokens=0)
    assert not e.trusted and e.wait_s == 0.0 and e.ttft_s == pytest.approx(it(100))


@pytest.mark.parametrize("speedup", [1.0, 5.0, 50.0, 200.0])
def test_the_live_routers_state_max_age_follows_the_workers_wall_clock_publications(speedup):
    """Workers publish node.state on wall-clock timers (an idle one every --idle-state-interval-s = 1 wall s,
    a busy one at launches at least --state-interval-s = 0.05 wall s apart); the router's ``now`` and a
    state's ``ts`` are cluster seconds (wall x --speedup). Before, --ttft-state-max-age-s was 5 cluster s:
    at speed-up 50 (up's demo) 0.1 wall s, so an idle node's state went untrusted 0.1 wall s after each
    publication (live, `up --speedup 50`, 20 requests 1.5 s apart: 66 of 70 candidates untrusted); at 200
    even a busy node's. Now 5 wall s x --speedup, as --fence-after-s: the trust decision is the one made at
    speed-up 1, whatever the profile's clock, and the simulator (no speedup) is unchanged."""
    from services.router.config import RouterConfig
    from services.worker.config import WorkerConfig
    from shared.config import load_config

    worker = WorkerConfig()
    for clock in ("cluster", "wall"):
        cfg = load_config(RouterConfig, ["--routing", "ttft", "--profile", "tiny", "--profile-clock", clock, "--speedup", str(speedup)])
        pred = cfg.routing_policy().predictor
        pred.apply_state(st("n", 100.0, phase="prefill"), 100.0)

        def trusted(wall_age: float) -> bool:
            return pred.estimate("n", 100.0 + wall_age * speedup, uncached_tokens=10, cached_tokens=0).trusted

        # a state as old as the longest gap between publications is trusted, at every speed-up
        assert trusted(worker.idle_state_interval_s) and trusted(worker.state_interval_s)
        assert trusted(4.9) and not trusted(5.1)  # --ttft-state-max-age-s's 5 s, on the wall clock
    # the simulator builds the policy with no speedup: 5 of its seconds, as before
    sim = make_policy("ttft", profile="tiny", block_size=4).predictor
    assert sim.state_max_age_s == 5.0


def test_unreported_sends_extend_the_queue_and_are_deduplicated_by_rid():
    p = predictor()
    p.apply_state(st("n", 1.0, queue=[q("a", 100)]), 1.0)
    p.on_dispatch("b", "n", uncached_tokens=60)  # sent after the state
    e = p.estimate("n", 1.0, uncached_tokens=30, cached_tokens=0)
    assert e.queue_items == 2 and p.unreported("n") == 1
    assert e.wait_s == pytest.approx(it(100)) and e.shared and e.prefill_s == pytest.approx(it(90))
    # the next state lists b (with its progress): counted once, from the state
    p.apply_state(st("n", 1.1, queue=[q("b", 60)]), 1.1)
    e = p.estimate("n", 1.1, uncached_tokens=30, cached_tokens=0)
    assert e.queue_items == 1 and p.unreported("n") == 0 and p.tracked("n") == 1
    assert e.wait_s == 0.0 and e.prefill_s == pytest.approx(it(90))
    # b left the reported queue (prefill done) before its first token reached the router: not counted
    p.apply_state(st("n", 1.2, queue=[]), 1.2)
    assert p.estimate("n", 1.2, uncached_tokens=30, cached_tokens=0).queue_items == 0
    assert p.forget("b") and not p.forget("b") and p.tracked("n") == 0
    p.on_dispatch("c", "n", uncached_tokens=1)
    with pytest.raises(ValueError, match="already tracked"):
        p.on_dispatch("c", "m", uncached_tokens=1)


# --------------------------------------------------------------------------- #
# fetch: shorter / longer than the wait, threshold, copy price
# --------------------------------------------------------------------------- #

BS = 64


def _lookup_on(node: str, blocks: int, tier: str = "host") -> KvLookupReply:
    pre = NodePrefix(node=node, gpu_blocks=blocks if tier == "gpu" else 0, host_blocks=blocks if tier == "host" else 0, local_blocks=blocks)
    return KvLookupReply(block_size=BS, nodes=[pre], longest_any=blocks, sources=[FetchRange(node=node, start=0, end=blocks, tier=tier)])  # type: ignore[arg-type]


def test_fetch_shorter_than_the_wait_is_hidden():
    """x = 1,280 tokens on a: τ = 0.45 + 1.28 ms = 0.45128 s < Ŵ = 0.8 s → no exposed fetch."""
    p = predictor(copy_price_s_per_token=1e-7)
    p.apply_state(st("a", 0.0, remaining=0.8), 0.0)
    p.apply_state(st("b", 0.0, remaining=2.0), 0.0)
    req = RouteRequest(rid="r", prompt_tokens=20 * BS + 100, block_hashes=list(range(20)))
    pred = p.predict(req, _lookup_on("b", 20), cand("a", "b"), 0.0)
    a, b = pred.estimates
    assert (a.cached_tokens, a.fetch_tokens, a.uncached_tokens, a.restore_tokens) == (1280, 1280, 100, 1280)
    assert a.fetch_s == pytest.approx(0.45128) and a.exposed_fetch_s == 0.0
    assert a.copy_s == pytest.approx(1.28e-4)
    assert a.ttft_s == pytest.approx(0.8 + it(100)) and a.score_s == pytest.approx(0.8 + it(100) + 1.28e-4)
    assert (b.cached_tokens, b.fetch_tokens, b.local_tokens, b.restore_tokens) == (1280, 0, 1280, 1280)
    assert b.ttft_s == pytest.approx(2.0 + it(100))
    assert pred.best.node == "a"
    assert pred.fetch == (FetchRange(node="b", start=0, end=20, tier="host"),)


def test_fetch_longer_than_the_wait_is_exposed():
    """Ŵ_a = 0.1 s < τ = 0.45128 s → exposed 0.35128 s; TTFT_a = 0.1 + 0.02 + 0.35128 = 0.47128.
    b holds the prefix but waits 0.5 s: TTFT_b = 0.52 → a still wins (0.47128 + κx < 0.52)."""
    p = predictor(copy_price_s_per_token=1e-7)
    p.apply_state(st("a", 0.0, remaining=0.1), 0.0)
    p.apply_state(st("b", 0.0, remaining=0.5), 0.0)
    req = RouteRequest(rid="r", prompt_tokens=20 * BS + 100, block_hashes=list(range(20)))
    pred = p.predict(req, _lookup_on("b", 20), cand("a", "b"), 0.0)
    a, b = pred.estimates
    assert a.wait_s == pytest.approx(0.1) and a.exposed_fetch_s == pytest.approx(0.35128)
    assert a.ttft_s == pytest.approx(0.47128) and b.ttft_s == pytest.approx(0.52)
    assert pred.best.node == "a"
    # with b a bit less loaded, staying on the prefix's holder wins
    p.apply_state(st("b", 0.0, remaining=0.44), 0.0)
    assert p.predict(req, _lookup_on("b", 20), cand("a", "b"), 0.0).best.node == "b"


def test_an_exposed_fetch_cannot_join_the_tails_iteration():
    """Queue tail a:50 would start at Ŵ = 0; the fetch (0.45128 s) is not done then, so the request
    waits for the whole queue (0.015) and runs alone: exposed = 0.45128 − 0.015."""
    p = predictor(copy_price_s_per_token=0.0)
    p.apply_state(st("a", 0.0, queue=[q("t", 50)]), 0.0)
    e = p.estimate("a", 0.0, uncached_tokens=40, cached_tokens=1280, restore_tokens=1280, fetch_tokens=1280)
    assert not e.shared and e.wait_s == pytest.approx(it(50))
    assert e.exposed_fetch_s == pytest.approx(0.45128 - 0.015) and e.prefill_s == pytest.approx(it(40))
    assert e.ttft_s == pytest.approx(0.45128 + it(40))


def test_no_fetch_below_512_tokens_the_tokens_are_recomputed():
    p = predictor()
    req = RouteRequest(rid="r", prompt_tokens=7 * BS + 10, block_hashes=list(range(7)))
    pred = p.predict(req, _lookup_on("b", 7), cand("a", "b"), 0.0)  # 448 tokens < 512
    a = pred.estimates[0]
    assert (a.fetch_tokens, a.fetch_s, a.cached_tokens, a.uncached_tokens, a.copy_s) == (0, 0.0, 0, 458, 0.0)
    assert FetchModel().time(511) == 0.0 and FetchModel().time(512) == pytest.approx(0.45 + 512e-6)


def test_prefix_partly_local_fetches_only_the_rest_and_keeps_one_token_to_compute():
    """a holds blocks [0, 10) in L1, b holds [0, 30) in L2; the prompt is exactly 30 blocks, so
    the engine computes the last block: t_c = 29 blocks, x = 19 blocks, restore = 19 blocks."""
    look = KvLookupReply(
        block_size=BS,
        nodes=[NodePrefix(node="a", gpu_blocks=10, local_blocks=10), NodePrefix(node="b", host_blocks=30, local_blocks=30)],
        longest_any=30,
        sources=[FetchRange(node="b", start=0, end=30, tier="host")],
    )
    p = predictor()
    req = RouteRequest(rid="r", prompt_tokens=30 * BS, block_hashes=list(range(30)))
    pred = p.predict(req, look, cand("a", "b"), 0.0)
    a, b = pred.estimates
    assert (a.cached_tokens, a.fetch_tokens, a.local_tokens, a.restore_tokens, a.uncached_tokens) == (29 * BS, 19 * BS, 10 * BS, 19 * BS, BS)
    assert (b.cached_tokens, b.fetch_tokens, b.restore_tokens, b.uncached_tokens) == (29 * BS, 0, 29 * BS, BS)
    assert pred.best.node == "b" and pred.fetch == ()
    # a is chosen when b is busy: its fetch plan is clipped to the cached prefix
    p.apply_state(st("b", 0.0, remaining=5.0), 0.0)
    pred = p.predict(req, look, cand("a", "b"), 0.0)
    assert pred.best.node == "a" and pred.fetch == (FetchRange(node="b", start=10, end=29, tier="host"),)


# --------------------------------------------------------------------------- #
# ties
# --------------------------------------------------------------------------- #


def test_ties_go_to_the_longest_own_prefix_then_node_id():
    p = predictor()
    req = RouteRequest(rid="r", prompt_tokens=6 * BS, block_hashes=list(range(6)))
    # no cache anywhere: all equal → smallest node id
    pred = p.predict(req, None, cand("c", "a", "b"), 0.0)
    assert pred.best.node == "a" and pred.ties == 3
    # b holds 5 blocks, c all 6: both use 5 (the engine computes the last block) → equal TTFT;
    # the tie goes to c, the longest prefix in its own memory, though b sorts first
    look = KvLookupReply(
        block_size=BS,
        nodes=[NodePrefix(node="b", gpu_blocks=5, local_blocks=5), NodePrefix(node="c", gpu_blocks=6, local_blocks=6)],
        longest_any=6,
        sources=[FetchRange(node="c", start=0, end=6, tier="gpu")],
    )
    pred = p.predict(req, look, cand("a", "b", "c"), 0.0)
    b, c = pred.estimates[1], pred.estimates[2]
    assert b.ttft_s == c.ttft_s and pred.ties == 2 and pred.best.node == "c"


# --------------------------------------------------------------------------- #
# models from the planner
# --------------------------------------------------------------------------- #


def test_planner_models_replace_the_profile_per_node():
    p = predictor()
    slow = PrefillModel(c0=0.02, c1=2e-4, c2=0.0, c3=0.0)
    assert p.apply_models(PlannerModels(models=[NodeModels(node="a", prefill=slow, mean_chunk_tokens=90.0)])) == 1
    assert p.coefficients("a").source == "planner-fitted" and p.coefficients("b").source == "profile"
    assert p.estimate("a", 0.0, uncached_tokens=100, cached_tokens=0).ttft_s == pytest.approx(0.02 + 0.02)
    assert p.estimate("b", 0.0, uncached_tokens=100, cached_tokens=0).ttft_s == pytest.approx(it(100))
    # a cached replay is recomputed with the new model
    p.apply_state(st("b", 0.0, queue=[q("x", 100)]), 0.0)
    assert p.estimate("b", 0.0, uncached_tokens=100, cached_tokens=0).wait_s == pytest.approx(it(100))
    p.apply_models(PlannerModels(models=[NodeModels(node="b", prefill=slow)]))
    assert p.estimate("b", 0.0, uncached_tokens=100, cached_tokens=0).wait_s == pytest.approx(0.04)
    bad = PrefillModel(c0=-1.0, c1=0.0, c2=0.0, c3=0.0)
    nan = PrefillModel(c0=math.nan, c1=0.0, c2=0.0, c3=0.0)
    assert p.apply_models(PlannerModels(models=[NodeModels(node="a", prefill=bad), NodeModels(node="a", prefill=nan)])) == 0
    assert p.models_rejected == 2 and p.coefficients("a").prefill == slow


# --------------------------------------------------------------------------- #
# the policy in the router core
# --------------------------------------------------------------------------- #


def _core() -> RouterCore:
    pol = TtftPolicy(predictor(copy_price_s_per_token=1e-7), block_size=BS)
    return RouterCore(pol, block_size=BS)


def test_on_dispatch_of_the_choice_just_made_reads_its_estimate_without_a_search(monkeypatch):
    """The router core dispatches the choice the policy has just made: its estimate is kept, not searched
    for among the candidates' (a choice built elsewhere is still searched)."""
    pol = TtftPolicy(predictor(), block_size=BS)
    for n in ("a", "b", "c"):
        pol.on_state(st(n, 0.0, phase="both"), 0.0)
    look = KvLookupReply(
        block_size=BS, nodes=[NodePrefix(node="b", gpu_blocks=1, local_blocks=2)], longest_any=2, sources=[FetchRange(node="b", start=0, end=2, tier="host")]
    )
    req = RouteRequest(rid="r", prompt_tokens=5 * BS, block_hashes=list(range(5)))
    choice = pol.choose_prefill(req, look, cand("a", "b", "c"), 0.0)
    est = choice.estimates.find(choice.node)
    assert choice.node == "b" and est is not None and est.restore_tokens > 0
    searched = []
    real = ttft_mod.CandidateEstimates.find_raw
    monkeypatch.setattr(ttft_mod.CandidateEstimates, "find_raw", lambda self, node: searched.append(node) or real(self, node))
    pol.on_dispatch(req, choice, None, 0.0)
    work = pol.predictor._nodes["b"].sends["r"].work
    assert searched == [] and (work.uncached_tokens, work.cached_tokens, work.restore_tokens) == (est.uncached_tokens, est.cached_tokens, est.restore_tokens)
    again = msgspec.structs.replace(choice)  # the same decision, another object: searched
    pol.on_dispatch(RouteRequest(rid="r2", prompt_tokens=5 * BS, block_hashes=list(range(5))), again, None, 0.0)
    work = pol.predictor._nodes["b"].sends["r2"].work
    assert searched == ["b"] and (work.uncached_tokens, work.cached_tokens, work.restore_tokens) == (est.uncached_tokens, est.cached_tokens, est.restore_tokens)


def test_registry_builds_ttft_from_a_profile_and_a_wrapper_forwards_hooks():
    pol = make_policy("ttft", profile="tiny", block_size=4, ttft_fetch_min_tokens=64, ttft_copy_price_s_per_token=2e-7)
    assert isinstance(pol, TtftPolicy) and pol.predictor.default.chunk_tokens == 32
    assert pol.predictor.fetch.min_tokens == 64 and pol.predictor.kappa == 2e-7
    assert pol.predictor.default.prefill.c0 == 0.002  # tiny.toml
    wrapped = PolicyWrapper(pol)
    c = RouterCore(wrapped, block_size=4)
    c.apply_state(st("a", 0.0, phase="both", queue=[q("x", 64)]), 0.0)
    assert wrapped.name == "ttft" and pol.predictor.estimate("a", 0.0, uncached_tokens=1, cached_tokens=0).queue_items == 1
    out = c.route(RouteRequest(rid="r", prompt_tokens=8), None, 0.0)
    assert isinstance(out, RouteDecision) and pol.predictor.tracked("a") == 1
    c.finish("r", 0.1)
    assert pol.predictor.tracked("a") == 0


def test_core_balances_by_predicted_ttft_and_sends_the_fetch_plan():
    c = _core()
    for n in ("a", "b"):
        c.apply_state(st(n, 0.0), 0.0)
    c.apply_state(st("d", 0.0, phase="decode", gpu_free_blocks=1000), 0.0)
    req = RouteRequest(rid="r1", prompt_tokens=20 * BS + 100, block_hashes=list(range(20)), branch_id="br")
    out = c.route(req, _lookup_on("b", 20), 0.0)
    assert isinstance(out, RouteDecision)
    # b holds the prefix, both idle: b (no fetch)
    assert out.prefill.node == "b" and out.work.fetch == [] and out.predicted_ttft_s == pytest.approx(it(100))
    assert out.prefill.path == "ttft" and len(out.prefill.estimates) == 2
    # b now has r1 unreported (1,380 tokens, 1,280 cached → 100 uncached); a second request of the
    # same prefix: b waits 0.02, a must fetch (0.45128 exposed) → b again
    out2 = c.route(RouteRequest(rid="r2", prompt_tokens=20 * BS + 100, block_hashes=list(range(20))), _lookup_on("b", 20), 0.0)
    assert isinstance(out2, RouteDecision) and out2.prefill.node == "b"
    e_b = next(e for e in out2.prefill.estimates if e.node == "b")
    assert e_b.queue_items == 1 and e_b.shared is False and e_b.wait_s == pytest.approx(it(100))
    # b reports a long backlog: the next request goes to a, with the fetch plan from b
    c.apply_state(st("b", 0.1, remaining=3.0, queue=[q("r1", 100, 1280), q("r2", 100, 1280)]), 0.1)
    out3 = c.route(RouteRequest(rid="r3", prompt_tokens=20 * BS + 100, block_hashes=list(range(20))), _lookup_on("b", 20), 0.1)
    assert isinstance(out3, RouteDecision) and out3.prefill.node == "a"
    assert out3.work.fetch == [FetchRange(node="b", start=0, end=20, tier="host")]
    assert out3.predicted_ttft_s == pytest.approx(0.45128 + it(100))
    # first token: the prediction error is measured against the worker's first-token time
    s = c.on_first_token("r3", 0.7, first_token_at=0.65, queue_s=0.4)
    assert s is not None and s.node == "a" and s.measured_s == pytest.approx(0.55)
    assert s.error_s == pytest.approx(0.47128 - 0.55)
    counters, gauges = c.metrics.export()
    assert counters["ttft_pred_abs_err_s.count"] == 1 and gauges["queue_s.mean.a"] == pytest.approx(0.4)
    assert c.policy.predictor.tracked("a") == 0  # forgotten at its first token
    assert c.finish("r3", 1.0) is not None and c.on_first_token("r3", 1.0) is None


def test_decode_binding_needs_kv_room_then_fewest_requests():
    c = _core()
    c.apply_state(st("p", 0.0), 0.0)
    c.apply_state(st("d1", 0.0, phase="decode", gpu_free_blocks=100, running=0), 0.0)
    c.apply_state(st("d2", 0.0, phase="decode", gpu_free_blocks=10_000, running=5), 0.0)
    small = RouteRequest(rid="s", prompt_tokens=50 * BS, max_tokens=BS, block_hashes=list(range(50)))
    out = c.route(small, None, 0.0)
    assert isinstance(out, RouteDecision) and out.decode_node == "d1"  # 51 blocks fit in d1's 100: fewest requests
    big = RouteRequest(rid="b", prompt_tokens=60 * BS, max_tokens=BS, block_hashes=list(range(60)))
    out = c.route(big, None, 0.0)
    assert isinstance(out, RouteDecision) and out.decode_node == "d2"  # d1 has 100 − 51 reserved = 49 < 61 blocks
    c.on_first_token("s", 0.5)  # s's KV is now on d1 and its next state counts it
    c.apply_state(st("d1", 0.6, phase="decode", gpu_free_blocks=100 - 51, running=1), 0.6)
    out = c.route(RouteRequest(rid="c", prompt_tokens=10 * BS, block_hashes=list(range(10))), None, 0.6)
    assert isinstance(out, RouteDecision) and out.decode_node == "d1"


# --------------------------------------------------------------------------- #
# the work on each node follows the directory's fetch_plan
# --------------------------------------------------------------------------- #

@hs.composite
def _lookups(draw):
    names = [f"n{i}" for i in range(draw(hs.integers(2, 6)))]
    longest = draw(hs.integers(1, 60))
    cuts = sorted(set(draw(hs.lists(hs.integers(1, longest - 1), max_size=4)) if longest > 1 else []))
    bounds = [0, *cuts, longest]
    sources = [
        FetchRange(node=draw(hs.sampled_from(names)), start=a, end=b, tier=draw(hs.sampled_from(["gpu", "host"])))
        for a, b in zip(bounds, bounds[1:])
    ]
    prefixes = []
    for n in names:
        local = draw(hs.integers(0, longest))
        if local:
            prefixes.append(NodePrefix(node=n, gpu_blocks=draw(hs.integers(0, local)), local_blocks=local))
    return KvLookupReply(block_size=BS, nodes=prefixes, longest_any=longest, sources=sources), names


@settings(max_examples=200, deadline=None)
@given(_lookups(), hs.integers(0, 40))
def test_cached_fetched_and_local_tokens_equal_fetch_plan(lk_names, short):
    """Every candidate's work, and the chosen node's fetch ranges, follow ``fetch_plan``; a
    prompt that ends inside the cached prefix (``short`` blocks before its end) gets the
    plan's ranges clipped to the blocks it can use (at least one token is computed)."""
    look, names = lk_names
    p = TtftPredictor(SIMPLE, fetch=FetchModel(min_tokens=0))
    prompt = max(1, look.longest_any - short) * BS + (1 if short == 0 else 0)
    req = RouteRequest(rid="r", prompt_tokens=prompt, block_hashes=list(range(prompt // BS)))
    pred = p.predict(req, look, cand(*names), 0.0)
    if short == 0:
        for e in pred.estimates:
            fp = fetch_plan(look.nodes, look.longest_any, look.sources, e.node, BS)
            assert (e.cached_tokens, e.fetch_tokens, e.local_tokens) == (fp.cached_tokens, fp.fetch_tokens, fp.local_tokens)
    if pred.best.fetch_tokens:
        fp = fetch_plan(look.nodes, look.longest_any, look.sources, pred.best.node, BS)
        end = pred.best.cached_tokens // BS
        clipped = []
        for r in fp.ranges:
            if r.start >= end:
                break
            clipped.append(r if r.end <= end else FetchRange(node=r.node, start=r.start, end=end, tier=r.tier))
        assert pred.fetch == tuple(clipped)



# --------------------------------------------------------------------------- #
# pruned scoring decides as scoring every candidate does
# --------------------------------------------------------------------------- #

ATTN = NodeCoefficients(prefill=PrefillModel(c0=1e-4, c1=1e-4, c2=2e-9, c3=1e-6), decode=DEC, chunk_tokens=100)


@hs.composite
def _clusters(draw):
    n = draw(hs.integers(1, 40))
    names = [f"n{i:02d}" for i in range(n)]
    longest = draw(hs.integers(0, 60))
    prefixes, sources = [], []
    if longest:  # 1–3 ranges by random nodes, contiguous or (rarely, not from the directory) with a gap
        cuts = sorted(set(draw(hs.lists(hs.integers(1, longest), max_size=2))) | {longest})
        start = 0
        for end in cuts:
            if draw(hs.integers(0, 9)) == 0 and end - start > 1:
                start += 1
            sources.append(FetchRange(node=draw(hs.sampled_from(names)), start=start, end=end, tier=draw(hs.sampled_from(["host", "gpu"]))))
            start = end
        for name in names:
            local = draw(hs.integers(0, longest))
            if local:
                prefixes.append(NodePrefix(node=name, gpu_blocks=draw(hs.integers(0, local)), local_blocks=local))
    look = KvLookupReply(block_size=BS, nodes=prefixes, longest_any=longest, sources=sources) if longest else None
    states = {}
    for name in names:
        kind = draw(hs.sampled_from(["fresh", "fresh", "stale", "none"]))
        if kind == "none":
            continue
        queue = [q(f"{name}q{j}", draw(hs.integers(1, 3000)), draw(hs.integers(0, 3000))) for j in range(draw(hs.integers(0, 4)))]
        ts = -10.0 if kind == "stale" else -draw(hs.floats(0.0, 4.0))
        states[name] = st(name, ts, remaining=draw(hs.floats(0.0, 2.0)), queue=queue)
    sends = draw(hs.lists(hs.tuples(hs.sampled_from(names), hs.integers(1, 3000)), max_size=6))
    prompt = draw(hs.integers(1, 61 * BS))
    ties = draw(hs.booleans())  # no state, no sends, no lookup: identical nodes, every score ties
    return names, look, states, sends, prompt, ties


@hs.composite
def _predictor_params(draw):
    """Coefficients, τ and κ (the pruned search's bounds use every one of them)."""
    c0 = draw(hs.sampled_from([1e-4, 0.01, 0.05]))
    coef = NodeCoefficients(prefill=PrefillModel(c0=c0, c1=1e-4, c2=2e-9, c3=1e-6), decode=DEC, chunk_tokens=100)
    fetch = FetchModel(base_s=draw(hs.sampled_from([0.0, 0.05, 0.45])), per_token_s=draw(hs.sampled_from([0.0, 1e-6, 1e-4])), min_tokens=draw(hs.sampled_from([0, 64, 512])))
    return {"default": coef, "fetch": fetch, "copy_price_s_per_token": draw(hs.sampled_from([0.0, 1e-7, 1e-5]))}


@settings(max_examples=400, deadline=None)
@given(_clusters(), _predictor_params())
def test_pruned_scoring_picks_what_scoring_every_candidate_picks(cluster, params):
    names, look, states, sends, prompt, ties = cluster
    p = TtftPredictor(prune_above=0, **params)
    if ties:
        look = None
    else:
        for state in states.values():
            p.apply_state(state, 0.0)
        for j, (name, uc) in enumerate(sends):
            p.on_dispatch(f"s{j}", name, uncached_tokens=uc)
    req = RouteRequest(rid="r", prompt_tokens=prompt, block_hashes=list(range(prompt // BS)))
    full = p.predict(req, look, cand(*names), 0.0, breakdown=True)
    pruned = p.predict(req, look, cand(*names), 0.0)
    assert (pruned.best, pruned.ties, pruned.fetch) == (full.best, full.ties, full.fetch)
    every = {e.node: e for e in full.estimates}
    assert len(full.estimates) == len(names) and all(every[e.node] == e for e in pruned.estimates)
    if ties:
        assert pruned.ties == len(names)


@settings(max_examples=300, deadline=None)
@given(_clusters(), _predictor_params())
def test_one_pass_scoring_equals_works_then_score(cluster, params):
    """The decision's one-pass loop (``_score_all``) gives every candidate the very tuple that
    ``_works`` then ``_score`` give it (the pruned search and ``estimate`` use those): same
    work, same floats."""
    names, look, states, sends, prompt, _ = cluster
    p = TtftPredictor(**params)
    for state in states.values():
        p.apply_state(state, 0.0)
    for j, (name, uc) in enumerate(sends):
        p.on_dispatch(f"s{j}", name, uncached_tokens=uc)
    view = p._lookup_view(look)
    cands = cand(*names)
    for now in (0.0, 0.5, 6.0):  # fresh, aged and untrusted states
        assert p._score_all(prompt, look, cands, view, now) == p._score(p._works(prompt, look, cands, view), now)


@settings(max_examples=300, deadline=None)
@given(_clusters(), _predictor_params())
def test_a_decisions_contenders_give_the_choice_ties_and_fetch_of_every_estimate(cluster, params):
    """``choose_prefill`` keeps only the estimates that could be chosen when made (score within
    ``tie_eps_s`` of the lowest so far): the same choice, ties, prediction and fetch as scoring
    every candidate, each kept estimate the very tuple of the full list, in candidate order."""
    names, look, states, sends, prompt, _ = cluster
    p = TtftPredictor(**params)
    for state in states.values():
        p.apply_state(state, 0.0)
    for j, (name, uc) in enumerate(sends):
        p.on_dispatch(f"s{j}", name, uncached_tokens=uc)
    req = RouteRequest(rid="r", prompt_tokens=prompt, block_hashes=list(range(prompt // BS)))
    cands = cand(*names)
    for now in (0.0, 0.5, 6.0):
        best, raw, ties, fetch, longest = p._decide(req, look, cands, now)
        c_best, c_raw, c_ties, c_fetch, c_longest = p._decide(req, look, cands, now, None, True)
        assert (c_best, c_ties, c_fetch, c_longest) == (best, ties, fetch, longest)
        kept = iter(raw)
        assert all(any(e is k or e == k for k in kept) for e in c_raw), "a subsequence of the full list"
        limit = min(e[1] for e in raw) + p.tie_eps_s
        assert [e for e in raw if e[1] <= limit] == [e for e in c_raw if e[1] <= limit]


def test_a_decision_makes_the_estimates_of_its_contenders_only():
    """Of 8 nodes, each with a second more queued than the one before it, only the first can be chosen:
    ``choose_prefill`` makes its estimate alone (the others' tuples are not built); with the route log's
    breakdown every candidate's."""
    p = TtftPredictor(SIMPLE)
    names = [f"n{i}" for i in range(8)]
    for i, n in enumerate(names):
        p.apply_state(st(n, 0.0, remaining=float(i)), 0.0)
    req = RouteRequest(rid="r", prompt_tokens=1000, block_hashes=list(range(1000 // BS)))
    choice = TtftPolicy(p, block_size=BS).choose_prefill(req, None, cand(*names), 0.0)
    assert choice.node == "n0" and [e.node for e in choice.estimates] == ["n0"]
    p.breakdown = True
    choice = TtftPolicy(p, block_size=BS).choose_prefill(req, None, cand(*names), 0.0)
    assert choice.node == "n0" and [e.node for e in choice.estimates] == names


@settings(max_examples=300, deadline=None)
@given(_clusters(), _predictor_params())
def test_a_decisions_contenders_are_the_running_cut_of_every_estimate(cluster, params):
    """The contenders loop (which skips a node whose share wait alone is above the lowest score so far +
    ``tie_eps_s``, before its work and estimate) keeps exactly the tuples the running cut keeps of the full
    list: each estimate whose score is not above the lowest one before it + ``tie_eps_s``, in order."""
    names, look, states, sends, prompt, _ = cluster
    p = TtftPredictor(**params)
    for state in states.values():
        p.apply_state(state, 0.0)
    for j, (name, uc) in enumerate(sends):
        p.on_dispatch(f"s{j}", name, uncached_tokens=uc)
    view = p._lookup_view(look)
    cands = cand(*names)
    for now in (0.0, 0.5, 6.0):
        every = p._score_all(prompt, look, cands, view, now)
        kept, cut = [], math.inf
        for e in every:
            if not e[1] > cut:
                kept.append(e)
                cut = min(cut, e[1] + p.tie_eps_s)
        assert p._score_all(prompt, look, cands, view, now, True) == kept


def test_a_decision_skips_a_node_whose_wait_alone_is_above_the_best_so_far():
    """Of 8 nodes, node i with i seconds of work ahead: the first scores ~0.11 s, so the other seven are
    skipped before their work and estimate (their wait alone is >= 1 s), and counted; the route log's
    breakdown scores every one; with a coefficient < 0 (a score may then be below its wait) none is skipped."""
    names = [f"n{i}" for i in range(8)]
    req = RouteRequest(rid="r", prompt_tokens=1000, block_hashes=list(range(1000 // BS)))
    p = TtftPredictor(SIMPLE)
    for i, n in enumerate(names):
        p.apply_state(st(n, 0.0, remaining=float(i)), 0.0)
    choice = TtftPolicy(p, block_size=BS).choose_prefill(req, None, cand(*names), 0.0)
    assert choice.node == "n0" and p.floor_skips == 7
    p.breakdown = True
    assert TtftPolicy(p, block_size=BS).choose_prefill(req, None, cand(*names), 0.0).node == "n0" and p.floor_skips == 7
    odd = NodeCoefficients(prefill=PrefillModel(c0=0.01, c1=1e-4, c2=-1e-12, c3=0.0), decode=DEC, chunk_tokens=100)
    p = TtftPredictor(odd)
    for i, n in enumerate(names):
        p.apply_state(st(n, 0.0, remaining=float(i)), 0.0)
    assert TtftPolicy(p, block_size=BS).choose_prefill(req, None, cand(*names), 0.0).node == "n0" and p.floor_skips == 0


def test_pruning_scores_only_candidates_that_can_win():
    p = TtftPredictor(SIMPLE, prune_above=0)
    for i in range(40):  # node i has i seconds of work queued ahead
        p.apply_state(st(f"n{i:02d}", 0.0, remaining=float(i)), 0.0)
    req = RouteRequest(rid="r", prompt_tokens=1000, block_hashes=list(range(1000 // BS)))
    pred = p.predict(req, None, cand(*[f"n{i:02d}" for i in range(40)]), 0.0)
    assert pred.best.node == "n00" and len(pred.estimates) == 8  # one batch: every other bound is > 1 s worse
    assert len(p.predict(req, None, cand(*[f"n{i:02d}" for i in range(40)]), 0.0, breakdown=True).estimates) == 40


def test_pruning_sees_a_node_whose_queue_drained_since_the_last_decision():
    p = TtftPredictor(SIMPLE, prune_above=0)
    names = [f"n{i:02d}" for i in range(20)]
    for i, n in enumerate(names):
        p.apply_state(st(n, 0.0, remaining=1.0 + i), 0.0)
    req = RouteRequest(rid="r", prompt_tokens=1000, block_hashes=list(range(1000 // BS)))
    assert p.predict(req, None, cand(*names), 0.0).best.node == "n00"
    p.apply_state(st("n19", 0.5, remaining=0.0), 0.5)  # the busiest node is now idle
    assert p.predict(req, None, cand(*names), 0.5).best.node == "n19"


def test_a_new_state_is_replayed_on_arrival_not_by_the_next_decision(monkeypatch):
    """Queue replays of reported states are done by ``apply_state`` (off the request path);
    a decision that follows replays nothing. A dispatch and a first token change the
    node's cached replay by one item, without replaying its queue."""
    p = TtftPredictor(SIMPLE, prune_above=0)
    names = [f"n{i:02d}" for i in range(20)]
    for i, n in enumerate(names):
        p.apply_state(st(n, 0.0, remaining=0.1 * i, queue=[q(f"x{i}", 100 * i)]), 0.0)
    p.apply_state(st("d0", 0.0, phase="decode"), 0.0)
    replays: list[int] = []
    fold = ttft_mod._QueueFold.__init__
    monkeypatch.setattr(ttft_mod._QueueFold, "__init__", lambda self, items: replays.append(1) or fold(self, items))
    req = RouteRequest(rid="r", prompt_tokens=1000, block_hashes=list(range(1000 // BS)))
    first = p.predict(req, None, cand(*names), 0.0)
    assert replays == []
    p.apply_state(st("n05", 0.2, remaining=0.0), 0.2)
    assert replays == [1]
    wait = p.wait(first.best.node, 0.2)
    p.on_dispatch("r", first.best.node, uncached_tokens=1000)
    assert p.wait(first.best.node, 0.2) == pytest.approx(wait + it(100) * 10)  # ten full iterations more
    assert p.predict(req, None, cand(*names), 0.2).best.node == "n05"
    p.forget("r")
    assert p.wait(first.best.node, 0.2) == pytest.approx(wait)
    assert replays == [1]  # neither the dispatch, nor the first token, nor the decisions re-folded a queue


def _assert_cached_replays_are_fresh(p: TtftPredictor) -> None:
    """Every cached trusted replay (kept up to date by dispatches and first tokens) and its
    lower-bound entry equal a replay of the node's queue from scratch, to the bit."""
    for tr in list(p._nodes.values()):
        if tr.trusted_ctx is None or tr.state is None:
            continue
        cached, bound = tr.trusted_ctx, p._bounds.get(tr.node)
        assert p._trusted_ctx(tr, tr.state) == cached
        if bound is not None:
            assert p._bounds[tr.node] == bound


def test_a_dispatch_whose_rid_the_state_already_lists_does_not_count_twice():
    """A state that lists a rid before the router records its dispatch (a rid reused after
    its first token, or a state that overtook the send): the request is in the reported
    queue once, and the dispatch leaves the cached replay as a fresh replay makes it."""
    p = TtftPredictor(SIMPLE, prune_above=0)
    p.apply_state(st("n", 0.0, remaining=0.0, queue=[q("r", 300)]), 0.0)
    before = p.wait("n", 0.0)
    p.on_dispatch("r", "n", uncached_tokens=300)
    assert p.wait("n", 0.0) == before == pytest.approx(3 * it(100))
    _assert_cached_replays_are_fresh(p)
    p.on_dispatch("s", "n", uncached_tokens=100)  # an ordinary send still extends the queue
    assert p.wait("n", 0.0) == pytest.approx(before + it(100))
    _assert_cached_replays_are_fresh(p)


@settings(max_examples=200, deadline=None)
@given(_clusters(), hs.lists(hs.tuples(hs.sampled_from(["send", "forget", "state"]), hs.integers(0, 39), hs.integers(0, 3000), hs.integers(0, 3000)), max_size=40))
def test_dispatches_and_first_tokens_update_a_cached_replay_exactly(cluster, ops):
    names, _, states, _, _, _ = cluster
    p = TtftPredictor(ATTN, prune_above=0)
    for state in states.values():
        p.apply_state(state, 0.0)
    for j, (kind, i, uc, cb) in enumerate(ops):
        node = names[i % len(names)]
        if kind == "send":  # some sends have nothing left to compute (not in a replay)
            p.on_dispatch(f"s{j}", node, uncached_tokens=uc, cached_tokens=cb, restore_tokens=cb // 2)
        elif kind == "forget":
            p.forget(f"s{i}")
        else:  # a state that lists some sends to the node (they become reported), and maybe a reused rid
            tr = p._nodes.get(node)
            listed = [q(r, 10, 0) for r in (tr.sends if tr is not None else ())][: uc % 3] + ([q(f"s{j + 1}", 7, 0)] if cb % 5 == 0 else [])
            p.apply_state(st(node, 0.0, remaining=0.1, queue=listed), 0.0)
        for name in names:  # decisions read (and cache) every node's replay
            p.wait(name, 0.0)
        _assert_cached_replays_are_fresh(p)


@settings(max_examples=200, deadline=None)
@given(
    _clusters(),
    hs.lists(hs.tuples(hs.sampled_from(["send", "forget", "state", "same", "same"]), hs.integers(0, 39), hs.integers(0, 3000), hs.integers(0, 3000)), max_size=40),
)
def test_a_state_repeating_the_queue_keeps_the_fold_exactly(cluster, ops):
    """A state whose queue equals the one it replaces keeps the node's fold (and its replay
    while the decode batch is unchanged) instead of refolding it: replays, lower bounds and
    waits equal, to the bit, those of a predictor that refolds and replays every state."""
    names, _, states, _, _, _ = cluster
    p, ref = TtftPredictor(ATTN, prune_above=0), TtftPredictor(ATTN, prune_above=0)

    def apply(state: NodeState, now: float) -> None:
        p.apply_state(state, now)
        ref.apply_state(state, now)
        ref._invalidate(ref._nodes[state.node], replay=True)  # the reference always refolds

    for state in states.values():
        apply(state, 0.0)
    now = 0.0
    for j, (kind, i, uc, cb) in enumerate(ops):
        node = names[i % len(names)]
        now += 0.01
        if kind == "send":
            for x in (p, ref):
                x.on_dispatch(f"s{j}", node, uncached_tokens=uc, cached_tokens=cb, restore_tokens=cb // 2)
        elif kind == "forget":
            for x in (p, ref):
                x.forget(f"s{i}")
        else:
            tr = p._nodes.get(node)
            old = tr.state if tr is not None else None
            if kind == "same" and old is not None:  # equal items (new objects), maybe another decode batch
                queue, phase = [q(w.rid, w.uncached_tokens, w.cached_tokens, w.restore_tokens) for w in old.queue], old.phase
            else:  # lists some sends (they become reported), maybe a reused rid
                sent = list(tr.sends if tr is not None else ())[: uc % 3]
                queue = [q(r, 10 + (uc + k) % 40, cb % 7) for k, r in enumerate(sent)] + ([q(f"s{j + 1}", 7, 0)] if cb % 5 == 0 else [])
                phase = "prefill"
            apply(st(node, now, remaining=uc / 1e4, queue=queue, decoding=cb % 3, phase=phase), now)
        if j % 3:  # decisions read (and cache) every node's replay; other steps leave some unreplayed
            for name in names:
                assert p.wait(name, now) == ref.wait(name, now)
        for name in names:
            a, b = p._nodes.get(name), ref._nodes.get(name)
            if a is not None and a.trusted_ctx is not None and b.trusted_ctx is not None:
                assert a.trusted_ctx == b.trusted_ctx
        assert p._bounds == ref._bounds


@hs.composite
def _histories(draw):
    names, look, _, _, _, _ = draw(_clusters())
    steps = []
    for _ in range(draw(hs.integers(1, 8))):
        events = []
        for _ in range(draw(hs.integers(0, 5))):
            kind = draw(hs.sampled_from(["state", "send", "forget", "models"]))
            name = draw(hs.sampled_from(names))
            if kind == "state":
                queue = [q(f"{name}x{j}", draw(hs.integers(1, 3000)), draw(hs.integers(0, 3000))) for j in range(draw(hs.integers(0, 4)))]
                events.append(("state", name, draw(hs.floats(0.0, 2.0)), draw(hs.floats(0.0, 2.0)), queue))
            elif kind == "send":
                events.append(("send", name, draw(hs.integers(1, 3000))))
            elif kind == "forget":
                events.append(("forget", draw(hs.integers(0, 20))))
            else:
                c1 = draw(hs.sampled_from([1e-4, 3e-4]))
                events.append(("models", name, c1))
        steps.append((events, draw(hs.floats(0.0, 3.0)), draw(hs.integers(1, 61 * BS))))
    return names, look, steps


def _apply_events(predictors, events, now: float, sent: int) -> int:
    """Apply drawn events (state / send / forget / models) to every predictor; returns the
    number of sends so far. A models event is ``(kind, node, c1[, c2, c0])``."""
    for ev in events:
        for p in predictors:
            if ev[0] == "state":
                p.apply_state(st(ev[1], now - ev[2], remaining=ev[3], queue=ev[4]), now)
            elif ev[0] == "send":
                p.on_dispatch(f"s{sent}", ev[1], uncached_tokens=ev[2])
            elif ev[0] == "forget":
                p.forget(f"s{ev[1]}")
            else:
                c2 = ev[3] if len(ev) > 3 else 2e-9
                c0 = ev[4] if len(ev) > 4 else 1e-4
                pre = PrefillModel(c0=c0, c1=ev[2], c2=c2, c3=1e-6)
                p.apply_models(PlannerModels(models=[NodeModels(node=ev[1], prefill=pre)]))
        sent += ev[0] == "send"
    return sent


@settings(max_examples=200, deadline=None)
@given(_histories(), _predictor_params())
def test_pruned_scoring_stays_exact_across_decisions(history, params):
    """The pruned search's cached bounds follow every state, send, forget, model change and
    the passing of time (states going stale): decision after decision it picks what a
    predictor that scores every candidate picks."""
    names, look, steps = history
    pruned, full = TtftPredictor(prune_above=0, **params), TtftPredictor(breakdown=True, **params)
    now, sent = 0.0, 0
    for events, dt, prompt in steps:
        sent = _apply_events((pruned, full), events, now, sent)
        req = RouteRequest(rid="r", prompt_tokens=prompt, block_hashes=list(range(prompt // BS)))
        a, b = pruned.predict(req, look, cand(*names), now), full.predict(req, look, cand(*names), now)
        assert (a.best, a.ties, a.fetch) == (b.best, b.ties, b.fetch)
        now += dt


def test_bounds_are_kept_only_once_a_pruned_search_can_run():
    """Up to ``prune_above`` tracked nodes (every candidate scored) no lower bound is made; the
    first pruned search uses the cached replays, and from then on states keep their bounds.
    Every decision equals scoring every candidate."""
    names = [f"n{i}" for i in range(6)]
    p, full = TtftPredictor(SIMPLE, prune_above=3), TtftPredictor(SIMPLE, breakdown=True)
    req = RouteRequest(rid="r", prompt_tokens=1000, block_hashes=list(range(1000 // BS)))
    for k, n in enumerate(names[:3]):
        for x in (p, full):
            x.apply_state(st(n, 0.0, remaining=0.3 * (3 - k), queue=[q(f"{n}q", 150 * k)] if k else []), 0.0)
    assert p.predict(req, None, cand(*names[:3]), 0.1).best == full.predict(req, None, cand(*names[:3]), 0.1).best
    assert not p._keep_bounds and p._bounds == {}
    for now, nodes in ((0.2, names), (0.3, names[1:]), (0.4, names)):  # 3 of them cached, without bounds
        a, b = p.predict(req, None, cand(*nodes), now), full.predict(req, None, cand(*nodes), now)
        assert (a.best, a.ties) == (b.best, b.ties)
    assert p._keep_bounds
    for x in (p, full):
        x.apply_state(st("n4", 0.5, remaining=0.01), 0.5)
        x.on_dispatch("s", "n0", uncached_tokens=500)
    assert set(p._bounds) == {"n4"}  # the new state's replay; n0's dropped with the dispatch
    for now in (0.5, 0.6, 7.0):
        a, b = p.predict(req, None, cand(*names), now), full.predict(req, None, cand(*names), now)
        assert (a.best, a.ties) == (b.best, b.ties)
    assert TtftPredictor(SIMPLE, prune_above=0)._keep_bounds


def test_pruning_follows_bounds_that_move_between_decisions():
    """Decision after decision on the same predictor, each node's bound moves: a state from the
    future, a busy node going stale (only the router's own sends count then), a node whose
    remaining time runs out, per-node coefficients. Each decision equals scoring every candidate."""
    names = [f"n{i:02d}" for i in range(24)]
    pruned, full = TtftPredictor(SIMPLE, prune_above=0), TtftPredictor(SIMPLE, breakdown=True)
    req = RouteRequest(rid="r", prompt_tokens=1000, block_hashes=list(range(1000 // BS)))

    def both(f):
        for p in (pruned, full):
            f(p)

    def check(now: float, nodes=names) -> str:
        a, b = pruned.predict(req, None, cand(*nodes), now), full.predict(req, None, cand(*nodes), now)
        assert (a.best, a.ties) == (b.best, b.ties)
        return a.best.node

    for i, n in enumerate(names):  # node i: 1 + i seconds ahead
        both(lambda p, i=i, n=n: p.apply_state(st(n, 0.0, remaining=1.0 + i), 0.0))
    assert check(0.0) == "n00"
    both(lambda p: p.apply_state(st("n20", 0.9, remaining=0.05), 0.5))  # a state from 0.4 s ahead
    assert check(0.5) == "n20"
    assert check(0.6) == "n20"
    both(lambda p: p.apply_state(st("n20", 0.7, remaining=30.0), 0.7))
    assert check(0.7) == "n00"
    assert check(1.2) == "n00"  # n00's remaining time runs out at 1.0: its bound stops falling
    both(lambda p: p.apply_state(st("n01", 1.2, remaining=0.0, queue=[q("x", 5000)]), 1.2))
    both(lambda p: p.on_dispatch("s", "n01", uncached_tokens=50))
    assert check(1.3) == "n00"
    both(lambda p: p.forget("s"))
    for i, n in enumerate(names[:-1]):  # busy states for all but n23 (its state of 0.0 has 24 s left)
        both(lambda p, i=i, n=n: p.apply_state(st(n, 4.0, remaining=10.0 + i), 4.0))
    assert check(4.0) == "n00"
    assert check(5.5) == "n23"  # n23's state is stale: predicted idle
    for i, n in enumerate(names):
        both(lambda p, i=i, n=n: p.apply_state(st(n, 7.0, remaining=0.5 + 0.01 * i), 7.0))
    assert check(7.0) == "n00"
    fast = PrefillModel(c0=0.001, c1=1e-5, c2=0.0, c3=0.0)
    both(lambda p: p.apply_models(PlannerModels(models=[NodeModels(node="n17", prefill=fast)])))
    assert check(7.0) == "n17"  # the least c1 of any node orders the search
    assert check(7.0, names[:12]) == "n00"  # another candidate list
    assert check(7.1, names[10:]) == "n17"
    assert check(3.0) == check(3.0, names)  # an earlier clock


@hs.composite
def _moving_histories(draw):
    names, look, _, _, _, _ = draw(_clusters())
    steps = []
    for _ in range(draw(hs.integers(1, 10))):
        events = []
        for _ in range(draw(hs.integers(0, 5))):
            kind = draw(hs.sampled_from(["state", "state", "send", "forget", "models"]))
            name = draw(hs.sampled_from(names))
            if kind == "state":  # ts from 7 s before (stale on arrival) to 1 s after now (clock skew)
                queue = [q(f"{name}x{j}", draw(hs.integers(1, 3000)), draw(hs.integers(0, 3000))) for j in range(draw(hs.integers(0, 4)))]
                events.append(("state", name, draw(hs.floats(-1.0, 7.0)), draw(hs.floats(0.0, 2.0)), queue))
            elif kind == "send":
                events.append(("send", name, draw(hs.integers(1, 3000))))
            elif kind == "forget":
                events.append(("forget", draw(hs.integers(0, 20))))
            else:
                events.append(("models", name, draw(hs.sampled_from([3e-5, 1e-4, 3e-4])), draw(hs.sampled_from([0.0, 2e-9, 1e-8])), draw(hs.sampled_from([1e-4, 0.02]))))
        subset = sorted(draw(hs.sets(hs.sampled_from(names), min_size=1)))
        dt = draw(hs.one_of(hs.floats(0.0, 3.0), hs.just(0.0), hs.floats(-1.0, 0.0)))  # now and then the clock goes back
        steps.append((events, dt, draw(hs.integers(1, 61 * BS)), subset))
    return names, look, steps


@settings(max_examples=60, deadline=None)
@given(_moving_histories(), _predictor_params())
def test_pruned_scoring_stays_exact_as_bounds_move(history, params):
    """Like the test above, with what moves a node in the pruned search's order: states from the
    future and stale on arrival, remaining times running out, per-node c0/c1/c2, candidate
    lists that change, a clock that goes back."""
    names, look, steps = history
    pruned, full = TtftPredictor(prune_above=0, **params), TtftPredictor(breakdown=True, **params)
    now, sent = 0.0, 0
    for events, dt, prompt, subset in steps:
        sent = _apply_events((pruned, full), events, now, sent)
        req = RouteRequest(rid="r", prompt_tokens=prompt, block_hashes=list(range(prompt // BS)))
        for nodes in (names, subset):
            a, b = pruned.predict(req, look, cand(*nodes), now), full.predict(req, look, cand(*nodes), now)
            assert (a.best, a.ties, a.fetch) == (b.best, b.ties, b.fetch)
            every = {e.node: e for e in b.estimates}
            assert all(every[e.node] == e for e in a.estimates)
        now += dt
