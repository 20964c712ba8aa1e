"""The live router's ``--decode-routing``: round-robin decode binding (SGLang Model Gateway PD mode, the paper's
baselines, §6.1), as ``simulate`` runs the static / dynamo / arrow sets.

Before session 58 the live router had no round-robin decode binding: every routing policy bound the least loaded
decode node (ties to the lowest node id), so requests sent one at a time all decoded on the first decode node and
``up --policy static:2P2D`` was not the paper's baseline."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, load_config
from services.router.config import RouterConfig
from services.router.core import DecodeBinding, NoRoute, RouteDecision, RouterCore
from services.router.policy import DECODE_ROUTINGS, PolicyWrapper, RoundRobinDecode, RouteRequest, with_decode_routing

from .helpers import state

DECODE = ("d1", "d2", "d3")


def core(routing: str = "cache-aware", decode_routing: str = "round-robin", binding: str = "dispatch") -> RouterCore:
    cfg = RouterConfig(routing=routing, decode_routing=decode_routing, block_size=4, profile="tiny")  # type: ignore[arg-type]
    c = RouterCore(cfg.routing_policy(), block_size=4, fence_after=3.0, decode_binding=binding)
    c.apply_state(state("p1", gpu_free_blocks=100), 0.0)
    for node in reversed(DECODE):  # reported in reverse: the cycle is in node-id order all the same
        c.apply_state(state(node, "decode", gpu_free_blocks=100), 0.0)
    return c


def rq(rid: str) -> RouteRequest:
    return RouteRequest(rid=rid, prompt_tokens=9, block_hashes=[1, 2], max_tokens=5)


def one_at_a_time(c: RouterCore, n: int) -> list[str]:
    """Send ``n`` requests one after the other, each finished before the next: the decode node of each."""
    out = []
    for i in range(n):
        now = 0.1 * i  # within the fence time of the states at 0
        d = c.route(rq(f"r{i}"), None, now)
        assert isinstance(d, RouteDecision) and d.decode_node is not None
        out.append(d.decode_node)
        c.on_first_token(f"r{i}", now + 0.1)
        c.finish(f"r{i}", now + 0.5)
    return out


@pytest.mark.parametrize("routing", ["cache-aware", "ttft", "dynamo-kv", "round-robin", "sticky"])
def test_requests_sent_one_at_a_time_cycle_over_the_decode_nodes(routing):
    assert one_at_a_time(core(routing), 7) == ["d1", "d2", "d3", "d1", "d2", "d3", "d1"]


def test_least_loaded_the_default_decodes_them_all_on_the_first_decode_node():
    assert RouterConfig().decode_routing == "least-loaded"
    assert one_at_a_time(core(decode_routing="least-loaded"), 4) == ["d1"] * 4


def test_the_prefill_start_binding_and_a_rebinding_take_the_next_in_the_cycle():
    c = core(binding="prefill-start")
    for rid in ("a", "b"):
        assert isinstance(c.route(rq(rid), None, 0.0), RouteDecision)
    first = [c.bind_decode(rid, 0.1, prefill_node="p1") for rid in ("a", "b")]
    assert [b.node for b in first if isinstance(b, DecodeBinding)] == ["d1", "d2"]
    # d1 hands a's decode back (work.requeue): the re-binding takes the next turn (the third) over the eligible
    # decode nodes without d1, (d2, d3): counter 2 mod 2 -> d2
    again = c.bind_decode("a", 0.2, req=rq("a"), exclude="d1")
    assert isinstance(again, DecodeBinding) and again.node == "d2"
    assert isinstance(c.route(rq("c"), None, 0.3), RouteDecision)
    b = c.bind_decode("c", 0.3, prefill_node="p1")
    assert isinstance(b, DecodeBinding) and b.node == "d1"  # counter 3 mod 3: the cycle goes on
    # the candidates change (d3 leaves the decode phase): the cycle goes on at counter mod 2
    c.apply_state(state("d3", "prefill", gpu_free_blocks=100), 0.4)
    got = []
    for rid in ("e", "f"):
        assert isinstance(c.route(rq(rid), None, 0.4), RouteDecision)
        b = c.bind_decode(rid, 0.5)
        assert isinstance(b, DecodeBinding)
        got.append(b.node)
    assert got == ["d1", "d2"]  # counters 4 and 5 over (d1, d2)


def test_no_decode_candidate_is_no_route_and_does_not_take_a_turn():
    c = core(binding="prefill-start")
    assert isinstance(c.route(rq("a"), None, 0.0), RouteDecision)
    for node in DECODE:
        c.apply_state(state(node, "decode", accepting=False), 0.1)  # all draining
    out = c.bind_decode("a", 0.1, prefill_node="p1")
    assert isinstance(out, NoRoute) and "decode" in out.reason
    policy = c.policy
    assert isinstance(policy, RoundRobinDecode) and policy.choose_decode(rq("x"), [], 0.2) is None
    for node in DECODE:
        c.apply_state(state(node, "decode", gpu_free_blocks=100), 0.2)
    b = c.bind_decode("a", 0.2, prefill_node="p1")
    assert isinstance(b, DecodeBinding) and b.node == "d1"


def test_each_router_keeps_its_own_turn():
    """Two routers (up --routers 2, or two gateway instances) each cycle from the first decode node."""
    a, b = core(), core()
    assert one_at_a_time(a, 2) == ["d1", "d2"] and one_at_a_time(b, 2) == ["d1", "d2"]


def test_the_decode_rule_is_named_and_the_policy_keeps_its_name_and_hooks():
    assert core().policy.decode_rule == "round_robin" and core().policy.name == "cache-aware"
    assert core("ttft", "least-loaded").policy.decode_rule == "least_loaded_kv_room"
    assert core("dynamo-kv", "least-loaded").policy.decode_rule == "dynamo_cost"
    assert core("cache-aware", "least-loaded").policy.decode_rule == "least_loaded"
    rr = core("ttft").policy
    assert isinstance(rr, RoundRobinDecode) and isinstance(rr, PolicyWrapper) and rr.name == "ttft"
    assert DECODE_ROUTINGS == ("least-loaded", "round-robin")
    with pytest.raises(ValueError, match="decode routing must be one of least-loaded, round-robin"):
        with_decode_routing(rr.inner, "random")


def test_the_flag_and_its_environment_twin():
    cfg = load_config(RouterConfig, ["--decode-routing", "round-robin"], prog="router", env={})
    assert cfg.decode_routing == "round-robin" and isinstance(cfg.routing_policy(), RoundRobinDecode)
    cfg = load_config(RouterConfig, [], prog="router", env={"EI_DECODE_ROUTING": "round-robin"})
    assert cfg.decode_routing == "round-robin"
    assert load_config(RouterConfig, [], prog="router", env={}).decode_routing == "least-loaded"
    with pytest.raises((ConfigError, SystemExit)):
        load_config(RouterConfig, [], prog="router", env={"EI_DECODE_ROUTING": "random"})
