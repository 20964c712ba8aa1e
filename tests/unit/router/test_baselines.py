"""Baseline routing policies: ``dynamo-kv`` (Dynamo KV router cost) and ``sticky`` (branch affinity)."""

from __future__ import annotations

import pytest

from shared.messages import KvLookupReply, NodePrefix

from services.router.baselines import DynamoKvPolicy, StickyPolicy, _ActiveBlocks
from services.router.core import RouteDecision, RouterCore
from services.router.nodes import NodeLoad
from services.router.policy import RouteRequest, make_policy, policy_names

from .helpers import state

BS = 4


def rq(rid: str, path: list[int], *, branch: str | None = None, tail: int = 0) -> RouteRequest:
    return RouteRequest(rid=rid, prompt_tokens=len(path) * BS + tail, block_hashes=path, max_tokens=4, branch_id=branch)


def loads(*nodes: str, **kw: int) -> list[NodeLoad]:
    return [NodeLoad(node=n, phase="prefill", inflight=kw.get(n, 0)) for n in sorted(nodes)]


def test_registry_has_every_baseline():
    assert {"ttft", "cache-aware", "dynamo-kv", "round-robin", "sticky"} <= set(policy_names())
    d = make_policy("dynamo-kv", block_size=BS, dynamo_host_cache_hit_weight=0.5, ignored=1)
    assert isinstance(d, DynamoKvPolicy) and d.h == 0.5 and d.c == 1.0 and d.block_size == BS
    s = make_policy("sticky", sticky_ttl_s=30.0)
    assert isinstance(s, StickyPolicy) and s.ttl_s == 30.0
    with pytest.raises(ValueError):
        DynamoKvPolicy(host_cache_hit_weight=1.5)
    with pytest.raises(ValueError):
        StickyPolicy(ttl_s=0)


# --------------------------------------------------------------------------- #
# dynamo-kv
# --------------------------------------------------------------------------- #

PATH = list(range(1, 11))  # 10 blocks, 40 tokens


def _look() -> KvLookupReply:
    # a: 4 blocks in L1, 6 in L1 ∪ L2 → device overlap 4, host overlap 2
    return KvLookupReply(block_size=BS, nodes=[NodePrefix(node="a", gpu_blocks=4, host_blocks=6, local_blocks=6)], longest_any=6)


def test_dynamo_cost_by_hand():
    """cost = s·max(0, (active_prefill_tokens + ISL)/bs − (1.0·dev + 0.75·host)) + active_blocks + new_blocks."""
    c = RouterCore(DynamoKvPolicy(block_size=BS), block_size=BS)
    for n in ("a", "b"):
        c.apply_state(state(n), 0.0)
    c.apply_state(state("d", "decode"), 0.0)
    pol = c.policy
    assert isinstance(pol, DynamoKvPolicy)
    # r1: a = (40/4 − (4 + 0.75·2)) + (0 + 10) = 4.5 + 10 = 14.5 ; b = 10 + 10 = 20
    out = c.route(rq("r1", PATH), _look(), 0.0)
    assert isinstance(out, RouteDecision) and out.prefill.node == "a" and out.prefill.path == "dynamo_cost"
    costs = {e.node: e for e in out.prefill.estimates}
    assert costs["a"].cost == pytest.approx(14.5) and costs["b"].cost == pytest.approx(20.0)
    assert (costs["a"].raw_prefill_blocks, costs["a"].overlap_credit, costs["a"].decode_blocks) == (10.0, 5.5, 10)
    # r1 adds 40 − 6·4 = 16 prefill tokens and its 10 blocks on a (and on its decode node d)
    assert pol.prefill_tokens == {"a": 16} and pol.active_blocks("a") == 10 and pol.active_blocks("d") == 10
    # r2, same path: a = ((16 + 40)/4 − 5.5) + (10 + 0) = 18.5 < b = 20
    out = c.route(rq("r2", PATH), _look(), 0.0)
    assert isinstance(out, RouteDecision) and out.prefill.node == "a"
    assert {e.node: e.cost for e in out.prefill.estimates}["a"] == pytest.approx(18.5)
    # r3: a = ((32 + 40)/4 − 5.5) + 10 = 22.5 > b = 20
    out = c.route(rq("r3", PATH), _look(), 0.0)
    assert isinstance(out, RouteDecision) and out.prefill.node == "b"
    # first token of r1 (PD): its prefill tokens leave a, and so do its blocks on a (r2 still holds them)
    c.on_first_token("r1", 0.5)
    assert pol.prefill_tokens == {"a": 16, "b": 40} and pol.active_blocks("a") == 10
    c.finish("r1", 1.0)
    c.finish("r2", 1.0)
    assert pol.prefill_tokens == {"b": 40} and pol.active_blocks("a") == 0 and pol.active_blocks("d") == 10  # r3 on d
    c.finish("r3", 1.0)
    assert pol.prefill_tokens == {} and pol.active_blocks("b") == 0 and pol.active_blocks("d") == 0


def test_dynamo_collocated_blocks_stay_until_the_end_and_ties_go_to_the_smallest_tree():
    pol = DynamoKvPolicy(block_size=BS)
    c = RouterCore(pol, block_size=BS)
    c.apply_state(state("a", "both", gpu_total_blocks=100, gpu_free_blocks=10), 0.0)  # tree 90
    c.apply_state(state("b", "both", gpu_total_blocks=100, gpu_free_blocks=60), 0.0)  # tree 40
    out = c.route(rq("r1", PATH), None, 0.0)
    assert isinstance(out, RouteDecision) and out.prefill.node == "b"  # equal cost 20: smaller tree
    c.on_first_token("r1", 0.1)
    assert pol.prefill_tokens == {} and pol.active_blocks("b") == 10  # collocated: blocks until the end
    c.finish("r1", 0.2)
    assert pol.active_blocks("b") == 0


def test_dynamo_decode_router_balances_decode_blocks_only():
    pol = DynamoKvPolicy(block_size=BS)
    c = RouterCore(pol, block_size=BS)
    c.apply_state(state("p"), 0.0)
    c.apply_state(state("d1", "decode"), 0.0)
    c.apply_state(state("d2", "decode"), 0.0)
    out = c.route(rq("r1", PATH), None, 0.0)
    assert isinstance(out, RouteDecision) and out.decode_node == "d1"  # tie 10/10 → node id
    out = c.route(rq("r2", list(range(100, 110))), None, 0.0)
    assert isinstance(out, RouteDecision) and out.decode_node == "d2"  # d1: 10 active + 10 new = 20 > 10
    assert out.decode is not None and out.decode.loads == {"d1": 20, "d2": 10}
    out = c.route(rq("r3", PATH), None, 0.0)
    assert isinstance(out, RouteDecision) and out.decode_node == "d1"  # d1: 10 + 0 new = 10 < d2: 10 + 10


def test_active_blocks_of_a_chained_path_form_a_prefix():
    ab = _ActiveBlocks()
    ab.add([1, 2, 3, 4, 5])
    ab.add([1, 2, 3])
    assert ab.active_prefix([1, 2, 3, 9, 10]) == 3 and ab.active_prefix([7]) == 0 and ab.active_prefix([1, 2, 3, 4, 5, 6]) == 5
    ab.remove([1, 2, 3, 4, 5])
    assert ab.active_prefix([1, 2, 3, 4]) == 3 and len(ab.refs) == 3


def test_dynamo_temperature_samples_cheaper_nodes_more_often_and_is_seeded():
    def picks(seed: int) -> list[str]:
        pol = DynamoKvPolicy(block_size=BS, temperature=0.5, seed=seed)
        return [pol.choose_prefill(rq(f"r{i}", PATH), _look(), loads("a", "b"), 0.0).node for i in range(400)]

    p = picks(3)
    assert p == picks(3) and p != picks(4)
    assert 0.6 < p.count("a") / len(p) < 1.0  # a is cheaper (14.5 vs 20) but b is still sampled


# --------------------------------------------------------------------------- #
# sticky
# --------------------------------------------------------------------------- #


def test_sticky_keeps_a_branch_on_its_node_while_live():
    pol = StickyPolicy(ttl_s=10.0)
    c = RouterCore(pol, block_size=BS, fence_after=100.0)
    for n in ("a", "b", "c"):
        c.apply_state(state(n, "both"), 0.0)
    first = c.route(rq("r1", PATH, branch="br"), None, 0.0)
    assert isinstance(first, RouteDecision) and (first.prefill.node, first.prefill.path) == ("a", "sticky_new")
    # b and c are less loaded now, but the branch stays on a
    for i, t in enumerate((1.0, 5.0, 14.0)):  # sliding TTL: each request renews it
        out = c.route(rq(f"r{i + 2}", PATH, branch="br"), None, t)
        assert isinstance(out, RouteDecision) and (out.prefill.node, out.prefill.path) == ("a", "sticky")
    # another branch and a request without a branch go to the least loaded node
    out = c.route(rq("x", PATH, branch="other"), None, 14.0)
    assert isinstance(out, RouteDecision) and (out.prefill.node, out.prefill.path) == ("b", "sticky_new")
    out = c.route(rq("y", PATH), None, 14.0)
    assert isinstance(out, RouteDecision) and (out.prefill.node, out.prefill.path) == ("c", "min_load")
    assert pol.bound("br", 14.0) == "a" and pol.bound("y", 14.0) is None


def test_sticky_binding_expires_moves_when_its_node_is_gone_and_ends_with_the_branch():
    pol = StickyPolicy(ttl_s=10.0)
    c = RouterCore(pol, block_size=BS, fence_after=100.0)
    c.apply_state(state("a", "both"), 0.0)
    c.apply_state(state("b", "both"), 0.0)
    for rid in ("load1", "load2"):
        c.route(rq(rid, PATH), None, 0.0)  # a and b each get one request in flight
    out = c.route(rq("r1", PATH, branch="br"), None, 0.0)
    assert isinstance(out, RouteDecision) and out.prefill.node == "a"
    # expired after 10 s without a request: bound again by load (a has 2 in flight, b 1)
    assert pol.bound("br", 10.5) is None
    out = c.route(rq("r2", PATH, branch="br"), None, 10.5)
    assert isinstance(out, RouteDecision) and (out.prefill.node, out.prefill.path) == ("b", "sticky_new")
    # b stops accepting (draining for a switch): the live binding moves
    c.apply_state(state("b", "both", accepting=False), 11.0)
    out = c.route(rq("r3", PATH, branch="br"), None, 11.0)
    assert isinstance(out, RouteDecision) and (out.prefill.node, out.prefill.path) == ("a", "sticky_rebind")
    assert pol.bound("br", 11.0) == "a"
    c.end_branch("br", 12.0)
    assert pol.bound("br", 12.0) is None and "br" not in pol.bindings


def test_sticky_bindings_are_capped_least_recently_used_first():
    pol = StickyPolicy(ttl_s=100.0, max_bindings=2)
    cands = loads("a", "b")
    for i, br in enumerate(("x", "y", "z")):
        req = rq(f"r{i}", PATH, branch=br)
        pol.on_dispatch(req, pol.choose_prefill(req, None, cands, float(i)), None, float(i))
    assert list(pol.bindings) == ["y", "z"]
    # expired entries are dropped as they are met
    req = rq("r9", PATH, branch="w")
    pol.on_dispatch(req, pol.choose_prefill(req, None, cands, 150.0), None, 150.0)
    assert list(pol.bindings) == ["w"]
