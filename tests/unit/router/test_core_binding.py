"""RouterCore: decode binding at prefill start (route.bind) and work handed back (work.requeue)."""

from __future__ import annotations

import pytest

from shared.messages import RequestAbort
from services.router.core import DecodeBinding, NoRoute, RouteDecision, RouterCore
from services.router.policy import RouteRequest, make_policy

from .helpers import state


def core(policy: str = "cache-aware", binding: str = "prefill-start", **kw) -> RouterCore:
    return RouterCore(make_policy(policy, block_size=4, **kw), block_size=4, fence_after=3.0, decode_binding=binding)


def rq(rid: str, blocks: int = 2, branch: str | None = "br", max_tokens: int = 5) -> RouteRequest:
    return RouteRequest(rid=rid, prompt_tokens=blocks * 4 + 1, block_hashes=list(range(blocks)), max_tokens=max_tokens, branch_id=branch)


def pd(c: RouterCore, d1_running: int = 0, d2_running: int = 0, now: float = 0.0) -> None:
    c.apply_state(state("p1", gpu_free_blocks=100), now)
    c.apply_state(state("d1", "decode", running=d1_running, gpu_free_blocks=100), now)
    c.apply_state(state("d2", "decode", running=d2_running, gpu_free_blocks=100), now)


def test_prefill_start_dispatches_without_a_decode_node_and_binds_later():
    c = core()
    pd(c)
    out = c.route(rq("r1"), None, 0.0)
    assert isinstance(out, RouteDecision) and out.decode is None
    assert out.work.decode_node is None and out.work.decode_binding == "start"
    assert [(p.node, p.phase) for p in out.placed] == [("p1", "prefill")]
    assert c.pending_binding("r1") and c.view.placement("r1") == ("p1", None)
    # the decode nodes' load changes before the prefill starts: the binding sees it
    c.apply_state(state("d1", "decode", running=3, gpu_free_blocks=100), 1.0)
    b = c.bind_decode("r1", 1.0, prefill_node="p1")
    assert isinstance(b, DecodeBinding) and b.node == "d2" and b.prefill_node == "p1"
    assert [(p.node, p.phase, p.rid, p.ts) for p in b.placed] == [("d2", "decode", "r1", 1.0)]
    assert c.view.placement("r1") == ("p1", "d2")
    assert c.view.nodes["d2"].inflight_decode == 1 and c.view.nodes["p1"].inflight_prefill == 1
    assert not c.pending_binding("r1")
    assert isinstance(c.bind_decode("r1", 1.1), NoRoute)  # bound once
    c.on_first_token("r1", 2.0)
    assert c.finish("r1", 3.0) == ("p1", "d2")
    assert all(n.inflight == 0 and n.inflight_decode == 0 and n.inflight_prefill == 0 for n in c.view.nodes.values())


def test_dispatch_binding_is_unchanged():
    c = core(binding="dispatch")
    pd(c)
    out = c.route(rq("r1"), None, 0.0)
    assert isinstance(out, RouteDecision) and out.decode_node == "d1" and out.work.decode_binding == "dispatch"
    assert not c.pending_binding("r1")
    with pytest.raises(ValueError):
        core(binding="never")


def test_collocated_nodes_ignore_the_binding_mode():
    c = core()
    c.apply_state(state("c1", "both"), 0.0)
    out = c.route(rq("r1"), None, 0.0)
    assert isinstance(out, RouteDecision) and out.work.decode_binding == "dispatch" and out.work.decode_node is None
    assert not c.pending_binding("r1")


def test_bind_refusals():
    c = core()
    pd(c)
    assert isinstance(c.bind_decode("nope", 0.0), NoRoute)
    c.route(rq("r1"), None, 0.0)
    out = c.bind_decode("r1", 0.0, prefill_node="p9")
    assert isinstance(out, NoRoute) and "placed on p1" in out.reason
    c.apply_state(state("d1", "decode", accepting=False), 0.1)  # draining
    c.apply_state(state("d2", "decode", accepting=False), 0.1)
    out = c.bind_decode("r1", 0.1)
    assert isinstance(out, NoRoute) and "decode" in out.reason
    assert c.pending_binding("r1")  # still to bind: the worker retries
    c.apply_state(state("d2", "decode"), 0.2)
    assert c.bind_decode("r1", 0.2).node == "d2"  # type: ignore[union-attr]


def test_bind_to_a_named_node_when_none_is_eligible():
    """The simulator's fallback: a started prefill whose decode nodes are all draining."""
    c = core("dynamo-kv")
    pd(c)
    c.route(rq("r1"), None, 0.0)
    c.apply_state(state("d1", "decode", accepting=False), 0.1)
    c.apply_state(state("d2", "decode", accepting=False), 0.1)
    assert isinstance(c.bind_decode("r1", 0.1), NoRoute)
    with pytest.raises(ValueError):
        c.bind_decode("r1", 0.1, node="p1")  # the prefill node
    with pytest.raises(ValueError):
        c.bind_decode("r1", 0.1, node="d9")  # never reported
    b = c.bind_decode("r1", 0.1, prefill_node="p1", node="d2")
    assert isinstance(b, DecodeBinding) and b.node == "d2" and c.view.placement("r1") == ("p1", "d2")
    assert c.policy.active_blocks("d2") > 0  # type: ignore[attr-defined]  # the policy saw the binding
    assert not c.pending_binding("r1")
    c.finish("r1", 1.0)
    assert c.policy.active_blocks("d2") == 0  # type: ignore[attr-defined]


def test_abort_and_finish_forget_a_pending_binding():
    c = core()
    pd(c)
    c.route(rq("r1"), None, 0.0)
    assert c.abort("r1", "client gone") == [("p1", RequestAbort(rid="r1", reason="client gone"))]
    assert not c.pending_binding("r1")
    c.route(rq("r2"), None, 0.0)
    c.finish("r2", 1.0)
    assert not c.pending_binding("r2")


def test_requeue_then_route_again_with_the_same_rid():
    c = core()
    pd(c)
    c.apply_state(state("p2"), 0.0)
    out = c.route(rq("r1"), None, 0.0)
    first = out.prefill.node  # type: ignore[union-attr]
    assert c.requeue("r1", 1.0)
    assert not c.requeue("r1", 1.0) and not c.pending_binding("r1")
    assert c.view.nodes[first].inflight == 0
    c.apply_state(state(first, "prefill", accepting=False), 1.0)  # the node is draining
    again = c.route(rq("r1"), None, 1.1)
    assert isinstance(again, RouteDecision) and again.prefill.node != first
    assert c.pending_binding("r1")


def test_rebinding_a_handed_back_decode_keeps_the_first_token_state():
    c = core("ttft", profile="tiny")
    pd(c)
    c.route(rq("r1"), None, 0.0)
    assert c.bind_decode("r1", 0.1).node == "d1"  # type: ignore[union-attr]
    c.on_first_token("r1", 0.2)
    assert c.view.nodes["p1"].inflight_prefill == 0
    b = c.bind_decode("r1", 0.3, req=rq("r1"), exclude="d1")
    assert isinstance(b, DecodeBinding) and b.node == "d2"
    assert c.view.placement("r1") == ("p1", "d2")
    assert c.view.nodes["d1"].inflight == 0 and c.view.nodes["d2"].inflight_decode == 1
    assert c.view.nodes["p1"].inflight_prefill == 0  # not counted again
    c.finish("r1", 1.0)
    assert c.policy._decode_reserved == {} and c.policy._rid_decode == {}  # type: ignore[attr-defined]


def test_ttft_binding_reserves_kv_room_until_the_first_token():
    c = core("ttft", profile="tiny")
    c.apply_state(state("p1"), 0.0)
    c.apply_state(state("d1", "decode", gpu_free_blocks=4), 0.0)
    c.apply_state(state("d2", "decode", running=2, gpu_free_blocks=100), 0.0)
    c.route(rq("r1", blocks=2, max_tokens=3), None, 0.0)  # footprint ceil(12/4) = 3 blocks
    c.route(rq("r2", blocks=2, max_tokens=3), None, 0.0)
    assert c.bind_decode("r1", 0.1).node == "d1"  # type: ignore[union-attr]  # fewest requests, room 4 ≥ 3
    assert c.bind_decode("r2", 0.1).node == "d2"  # type: ignore[union-attr]  # d1: 4 − 3 reserved < 3 → no room


def test_a_binding_after_the_first_token_frees_the_decode_room_the_ttft_policy_reserved():
    """The prefill node sends a parked request's first token before its route.bind is answered: the
    binding that follows reserves decode KV room (ttft) and the hand-off goes out at once, so that room is
    the decode node's to show (its state) from then on, as for a binding before the first token. Before,
    it stayed reserved in the router until the request finished: d1 (room 4, footprint 3) was refused to
    r2 for r1's whole decode."""
    c = core("ttft", profile="tiny")
    c.apply_state(state("p1"), 0.0)
    c.apply_state(state("d1", "decode", gpu_free_blocks=4), 0.0)
    c.apply_state(state("d2", "decode", running=2, gpu_free_blocks=100), 0.0)
    c.route(rq("r1", blocks=2, max_tokens=3), None, 0.0)  # footprint ceil(12/4) = 3 blocks
    c.on_first_token("r1", 0.1)  # parked on p1, its first token out
    assert c.view.nodes["p1"].inflight_prefill == 0 and c.pending_binding("r1")
    assert c.bind_decode("r1", 0.2, prefill_node="p1").node == "d1"  # type: ignore[union-attr]
    assert c.policy._decode_reserved == {} and c.policy._rid_decode == {}  # type: ignore[attr-defined]
    c.route(rq("r2", blocks=2, max_tokens=3), None, 0.3)
    assert c.bind_decode("r2", 0.3).node == "d1"  # type: ignore[union-attr]  # fewest requests, room 4 ≥ 3 (d1's next state shows r1)
    assert c.view.nodes["p1"].inflight_prefill == 1 and c.view.nodes["d1"].inflight_decode == 2
    c.finish("r1", 1.0)
    c.finish("r2", 1.0)
    assert c.policy._decode_reserved == {}  # type: ignore[attr-defined]


def test_keep_metrics_false_returns_the_first_token_sample_but_accumulates_no_metrics():
    # the simulator's router: it reads the samples on_first_token returns, never core.metrics
    for keep in (True, False):
        c = RouterCore(make_policy("cache-aware", block_size=4), block_size=4, fence_after=3.0, keep_metrics=keep)
        c.apply_state(state("p1", "both", gpu_free_blocks=100), 0.0)
        assert isinstance(c.route(rq("r1"), None, 0.0), RouteDecision)
        sample = c.on_first_token("r1", 2.0, queue_s=0.5)
        assert sample is not None and sample.measured_s == pytest.approx(2.0) and sample.queue_s == 0.5
        counters, _ = c.metrics.export()
        assert (counters.get("queue_s.count.p1") == 1) is keep and (counters == {}) is not keep
