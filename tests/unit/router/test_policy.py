"""Cache-aware (SGLang model gateway) and round-robin policies, decode choice."""

from __future__ import annotations

import pytest

from shared.messages import KvLookupReply

from services.router.policy import (
    CacheAwarePolicy,
    RoundRobinPolicy,
    RouteRequest,
    RoutingPolicy,
    least_loaded_decode,
    make_policy,
    policy_names,
    register_policy,
)

from .helpers import load, lookup


def req(blocks: int, tokens: int | None = None) -> RouteRequest:
    return RouteRequest(rid="r", prompt_tokens=tokens or max(1, blocks * 64), block_hashes=list(range(blocks)))


def test_defaults_are_the_gateway_cli_defaults():
    p = CacheAwarePolicy()
    assert (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold) == (0.3, 64, 1.5)


def test_imbalance_gate_picks_min_load_even_against_a_full_cache_hit():
    p = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    cands = [load("a", inflight=10), load("b", inflight=2)]
    # a holds the whole prompt, but 10 - 2 > 4 and 10 > 2 * 1.5: imbalanced
    c = p.choose_prefill(req(10), lookup(a=10), cands, now=0.0)
    assert (c.node, c.path) == ("b", "imbalanced")
    assert c.matched_blocks == 10 and c.match_rate == 1.0


def test_imbalance_needs_both_conditions():
    p = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    assert p.is_imbalanced([10, 2])
    assert not p.is_imbalanced([6, 2])  # abs spread 4 is not > 4
    assert not p.is_imbalanced([100, 90])  # abs 10 > 4 but 100 <= 90 * 1.5
    assert p.is_imbalanced([5, 0])  # min 0: rel test 5 > 0
    assert not p.is_imbalanced([])
    # balanced: the cache-hit node wins even though it is busier
    c = p.choose_prefill(req(10), lookup(a=10), [load("a", inflight=100), load("b", inflight=90)], 0.0)
    assert (c.node, c.path) == ("a", "cache_hit")


def test_cache_hit_path_routes_to_longest_match():
    p = CacheAwarePolicy()
    cands = [load("a", inflight=3), load("b", inflight=0), load("c", inflight=1)]
    c = p.choose_prefill(req(10), lookup(a=4, c=8), cands, 0.0)
    assert (c.node, c.path) == ("c", "cache_hit")
    assert c.matched_blocks == 8 and c.match_rate == pytest.approx(0.8)
    assert c.matches == {"a": 4, "c": 8}
    assert c.loads == {"a": 3, "b": 0, "c": 1}


def test_below_threshold_goes_to_min_load():
    p = CacheAwarePolicy(cache_threshold=0.5)
    cands = [load("a", inflight=3), load("b", inflight=1)]
    c = p.choose_prefill(req(10), lookup(a=5), cands, 0.0)  # 0.5 is not > 0.5
    assert (c.node, c.path) == ("b", "min_load")
    c = p.choose_prefill(req(10), lookup(a=6), cands, 0.0)
    assert (c.node, c.path) == ("a", "cache_hit")


def test_no_lookup_or_refused_lookup_or_short_prompt_means_no_cache_information():
    p = CacheAwarePolicy(cache_threshold=0.0)
    cands = [load("a", inflight=1), load("b", inflight=0)]
    assert p.choose_prefill(req(10), None, cands, 0.0).path == "min_load"
    refused = KvLookupReply(block_size=64, error="block size mismatch")
    assert p.choose_prefill(req(10), refused, cands, 0.0).node == "b"
    c = p.choose_prefill(req(0, tokens=10), lookup(a=1), cands, 0.0)
    assert (c.node, c.match_rate) == ("b", 0.0)


def test_matches_on_non_candidates_are_ignored():
    p = CacheAwarePolicy()
    cands = [load("a", inflight=1), load("b", inflight=0)]
    c = p.choose_prefill(req(10), lookup(zz=10), cands, 0.0)
    assert (c.node, c.path, c.matched_blocks) == ("b", "min_load", 0)


def test_ties():
    p = CacheAwarePolicy()
    # equal loads, no cache: smallest node id
    c = p.choose_prefill(req(4), None, [load("b"), load("a"), load("c")], 0.0)
    assert c.node == "a"
    # equal longest match: the less loaded of the two, then the node id
    c = p.choose_prefill(req(4), lookup(b=4, c=4), [load("a"), load("b", inflight=2), load("c", inflight=1)], 0.0)
    assert (c.node, c.path) == ("c", "cache_hit")
    c = p.choose_prefill(req(4), lookup(b=4, c=4), [load("a"), load("b", inflight=1), load("c", inflight=1)], 0.0)
    assert c.node == "b"


def test_empty_candidates_raise_and_bad_thresholds_raise():
    with pytest.raises(ValueError):
        CacheAwarePolicy().choose_prefill(req(1), None, [], 0.0)
    with pytest.raises(ValueError):
        CacheAwarePolicy(cache_threshold=1.5)
    with pytest.raises(ValueError):
        CacheAwarePolicy(balance_rel_threshold=0.5)
    with pytest.raises(ValueError):
        CacheAwarePolicy(balance_abs_threshold=-1)


def test_round_robin_cycles_in_node_order():
    p = RoundRobinPolicy()
    cands = [load("a"), load("b"), load("c")]
    assert [p.choose_prefill(req(1), None, cands, 0.0).node for _ in range(5)] == ["a", "b", "c", "a", "b"]
    # two instances do not share a counter
    assert RoundRobinPolicy().choose_prefill(req(1), None, cands, 0.0).node == "a"


def test_least_loaded_decode_counts_reported_and_inflight():
    d = least_loaded_decode([load("d1", running=5, waiting=1), load("d2", running=2, inflight=3), load("d3", running=4)])
    assert d is not None and d.node == "d3"  # loads 6, 5, 4
    assert d.loads == {"d1": 6, "d2": 5, "d3": 4}
    tie = least_loaded_decode([load("d2", running=1), load("d1", inflight=1)])
    assert tie is not None and tie.node == "d1"
    assert least_loaded_decode([]) is None


def test_registry_by_name():
    assert {"cache-aware", "round-robin"} <= set(policy_names())
    p = make_policy("cache-aware", cache_threshold=0.7, unrelated_option=1)
    assert isinstance(p, CacheAwarePolicy) and p.cache_threshold == 0.7
    assert isinstance(make_policy("round-robin", cache_threshold=0.7), RoundRobinPolicy)
    with pytest.raises(ValueError, match="known: .*cache-aware"):
        make_policy("nope")
    with pytest.raises(ValueError):
        register_policy("cache-aware", lambda **o: CacheAwarePolicy())


def test_a_new_policy_plugs_in():
    class Last(RoutingPolicy):
        name = "test-last"

        def choose_prefill(self, req, lookup, candidates, now):
            from services.router.policy import PrefillChoice

            return PrefillChoice(candidates[-1].node, "last")

    if "test-last" not in policy_names():
        register_policy("test-last", lambda **o: Last())
    p = make_policy("test-last")
    assert p.choose_prefill(req(1), None, [load("a"), load("b")], 0.0).node == "b"
    assert p.choose_decode(req(1), [load("x", running=1), load("y")], 0.0).node == "y"
