"""RouterCore places a request only on nodes whose GPU KV memory holds it (nodes of different sizes).

Before: the router's 400 check used the largest node, but placement could pick a smaller node, which
refused the request (a 500 ``engine error``: ``request needs N KV blocks but node ... has M``)."""

from __future__ import annotations

import math

from shared.messages import RouteSent, SplitCommand

from services.router.core import NoRoute, RouteDecision, RouterCore
from services.router.policy import RouteRequest, make_policy

from .helpers import state

BS = 4


def core(policy: str = "round-robin", binding: str = "dispatch") -> RouterCore:
    return RouterCore(make_policy(policy), block_size=BS, fence_after=3.0, decode_binding=binding)


def big(rid: str, prompt: int = 60 * BS, max_tokens: int = 20 * BS) -> RouteRequest:
    """80 blocks of KV (60 in the prompt): more than a 50-block node holds, less than a 120-block one."""
    return RouteRequest(rid=rid, prompt_tokens=prompt, block_hashes=list(range(prompt // BS)), max_tokens=max_tokens)


def test_collocated_request_goes_only_to_the_node_that_holds_it():
    for policy in ("round-robin", "cache-aware", "ttft", "dynamo-kv", "sticky"):
        c = core(policy)
        c.apply_state(state("a", "both", gpu_total_blocks=50, gpu_free_blocks=50), 0.0)  # first by id: ties go here
        c.apply_state(state("b", "both", gpu_total_blocks=120, gpu_free_blocks=120), 0.0)
        for i in range(4):
            out = c.route(big(f"r{i}"), None, 0.1)
            assert isinstance(out, RouteDecision) and out.prefill.node == "b", (policy, out)
            assert [n.node for n in out.candidates] == ["b"]
        small = c.route(big("s", prompt=8 * BS, max_tokens=BS), None, 0.1)  # fits both: both offered
        assert isinstance(small, RouteDecision) and [n.node for n in small.candidates] == ["a", "b"]


def test_pd_prefill_needs_the_prompt_decode_needs_prompt_and_output():
    c = core()
    c.apply_state(state("p1", "prefill", gpu_total_blocks=61), 0.0)  # holds the prompt's 60 blocks
    c.apply_state(state("p2", "prefill", gpu_total_blocks=59), 0.0)
    c.apply_state(state("d1", "decode", gpu_total_blocks=50), 0.0)
    c.apply_state(state("d2", "decode", gpu_total_blocks=120), 0.0)
    for i in range(3):
        out = c.route(big(f"r{i}"), None, 0.0)
        assert isinstance(out, RouteDecision) and (out.prefill.node, out.decode_node) == ("p1", "d2"), out
        assert [n.node for n in out.decode_candidates] == ["d2"]


def test_no_live_node_that_holds_it_is_no_route_and_a_fenced_large_node_back_serves_it():
    c = core()
    c.apply_state(state("a", "both", gpu_total_blocks=50), 0.0)
    c.apply_state(state("b", "both", gpu_total_blocks=120), 0.0)
    c.apply_state(state("a", "both", gpu_total_blocks=50), 4.0)
    assert [f.node for f in c.check_fences(4.0)] == ["b"]
    out = c.route(big("r1"), None, 4.0)
    assert isinstance(out, NoRoute) and "80 blocks" in out.reason and "a 50" in out.reason and "b: fenced" in out.reason, out
    assert c.view.inflight_total == 0
    c.apply_state(state("b", "both", gpu_total_blocks=120), 4.5)  # it reports again: the parked work goes there
    out = c.route(big("r1"), None, 4.5)
    assert isinstance(out, RouteDecision) and out.prefill.node == "b"


def test_a_request_no_node_holds_is_placed_as_before():
    """The live router refuses it first (400, ``_check_kv_room``); the core leaves the choice alone."""
    c = core()
    c.apply_state(state("a", "both", gpu_total_blocks=50), 0.0)
    c.apply_state(state("b", "both", gpu_total_blocks=60), 0.0)
    out = c.route(big("r1"), None, 0.0)
    assert isinstance(out, RouteDecision) and [n.node for n in out.candidates] == ["a", "b"]


def test_decode_binding_at_prefill_start_and_rebinding_pick_a_node_that_holds_it():
    c = core(binding="prefill-start")
    c.apply_state(state("p", "prefill", gpu_total_blocks=120), 0.0)
    c.apply_state(state("d1", "decode", gpu_total_blocks=50), 0.0)  # least loaded and first by id
    c.apply_state(state("d2", "decode", gpu_total_blocks=120, running=9), 0.0)
    c.apply_state(state("d3", "decode", gpu_total_blocks=120, running=9), 0.0)
    out = c.route(big("r1"), None, 0.0)
    assert isinstance(out, RouteDecision) and out.decode is None and out.work.decode_binding == "start"
    bound = c.bind_decode("r1", 0.1, prefill_node="p")
    assert not isinstance(bound, NoRoute) and bound.node == "d2"
    # d2 hands it back: d3 (d1 is too small)
    again = c.bind_decode("r1", 0.2, req=big("r1"), exclude="d2")
    assert not isinstance(again, NoRoute) and again.node == "d3"
    # d3 hands it back while d2 drains: none left that holds it, no route (parked by the live router)
    c.apply_state(state("d2", "decode", gpu_total_blocks=120, accepting=False), 0.3)
    none = c.bind_decode("r1", 0.3, req=big("r1"), exclude="d3")
    assert isinstance(none, NoRoute) and "decode node can hold" in none.reason and "d1 50" in none.reason, none
    assert "d2: not accepting" in none.reason, none
    # a PD route whose decode nodes that hold it are gone: offered nothing but collocated nodes (none)
    c.apply_state(state("d3", "decode", gpu_total_blocks=120, accepting=False), 0.4)
    out = c.route(big("r2"), None, 0.4)
    assert isinstance(out, NoRoute) and "decode node can hold" in out.reason and "not accepting" in out.reason, out


def test_kv_bounds_follow_reported_capacities_fenced_included():
    c = core()
    assert c.view.kv_bounds() == (0, 0)
    c.apply_state(state("a", "both", gpu_total_blocks=50), 0.0)
    c.apply_state(state("b", "both", gpu_total_blocks=0), 0.0)  # no capacity reported: left out
    assert c.view.kv_bounds() == (50, 50)
    c.apply_state(state("b", "both", gpu_total_blocks=120), 0.0)
    assert c.view.kv_bounds() == (50, 120)
    c.apply_state(state("a", "both", gpu_total_blocks=50), 5.0)
    c.check_fences(5.0)  # b fenced: still counted (it may report again)
    assert c.view.kv_bounds() == (50, 120) and c.view.largest_gpu_kv() == (120, "b")


def test_largest_gpu_kv_leaves_out_nodes_gone_for_good_not_restarting_ones():
    """The KV cap (``max_model_len``, the 400 of a request no node holds) counts a node until it has left for good:
    fenced and silent past ``forget_after`` (the router's ``--forget-node-after-s``). A node fenced for a moment
    (silent less than that, or restarted: its sequence went back) still counts, so the cap does not drop under
    prompts it serves once back; one that reports again counts at once. A 0 (an older worker: capacity unknown)
    turns the cap off only while its node counts. Before, every node that ever reported counted forever."""
    c = core()
    v = c.view
    c.apply_state(state("a", "both", gpu_total_blocks=50, seq=1), 0.0)
    c.apply_state(state("b", "both", gpu_total_blocks=120, seq=1), 0.0)
    c.apply_state(state("old", "both", gpu_total_blocks=0, seq=1), 0.0)  # an older worker: capacity unknown
    assert v.largest_gpu_kv(0.0, 10.0) is None  # nothing can be promised while it counts
    for t in (2.0, 4.0, 6.0, 8.0, 10.0, 12.0):  # a keeps reporting; b and old went silent at 0.0
        c.apply_state(state("a", "both", gpu_total_blocks=50, seq=1 + int(t)), t)
        c.check_fences(t)
    assert v.nodes["b"].fenced and v.nodes["old"].fenced
    assert v.largest_gpu_kv(9.0, 10.0) is None  # fenced, silent 9 s < 10: may come back, still counted
    assert v.largest_gpu_kv(12.0, 10.0) == (50, "a")  # silent 12 s: both left for good
    assert v.largest_gpu_kv(12.0) is None  # without a forget_after (the default): every node that reported
    c.apply_state(state("b", "both", gpu_total_blocks=120, seq=1), 12.5)  # b back: counted at once
    assert v.largest_gpu_kv(12.5, 10.0) == (120, "b")
    c.apply_state(state("b", "both", gpu_total_blocks=120, seq=0), 13.0)  # a restart: its sequence went back
    assert [f.node for f in c.check_fences(13.0)] == ["b"]  # fenced at once ...
    assert v.largest_gpu_kv(13.0, 10.0) == (120, "b")  # ... and still counted: no flap of the cap


def test_another_routers_placement_on_a_forgotten_or_unseen_node_leaves_no_record_for_good():
    """Another router's placement (``remote_dispatch``) on a node this router forgot, or never heard from, records
    it with no ``last_seen``: once that request ends and the node stays silent, ``forget_left`` drops the record.
    Before, such a record was never 'left' (never seen, never fenced), so ``/v1/cluster`` listed it for good."""
    c = core("ttft")
    v = c.view
    c.apply_split(SplitCommand(epoch=1, phases={"a": "both", "b": "both"}, reason="test"))
    c.apply_state(state("a", "both", gpu_total_blocks=50, seq=1), 0.0)
    c.apply_state(state("b", "both", gpu_total_blocks=120, seq=1), 0.0)
    for t in (2.0, 4.0, 6.0, 8.0, 10.0, 12.0):  # b went silent at 0.0
        c.apply_state(state("a", "both", gpu_total_blocks=50, seq=1 + int(t)), t)
        c.check_fences(t)
    assert c.forget_left(12.0, 10.0) == ["b"]
    for rid, node in (("x1", "b"), ("x2", "c")):  # b: forgotten; c: never reported here
        assert c.remote_dispatch(RouteSent(router="r2", rid=rid, prefill_node=node, prompt_tokens=8, max_tokens=4), 12.5)
    assert sorted(v.nodes) == ["a", "b", "c"] and v.nodes["b"].split_phase == "both"  # counted while they run
    assert c.forget_left(13.0, 10.0) == []  # still named by a request
    c.finish("x1", 13.0)
    c.finish("x2", 13.0)
    assert c.forget_left(14.0, math.inf) == []  # --forget-node-after-s 0: never
    assert c.forget_left(14.0, 10.0) == ["b", "c"]
    assert [n["node"] for n in v.snapshot(14.0)] == ["a"]
    c.apply_split(SplitCommand(epoch=2, phases={"a": "both", "b": "both"}, reason="test"))  # b stays forgotten
    assert list(v.nodes) == ["a"]
    c.apply_state(state("b", "prefill", gpu_total_blocks=120, seq=1), 15.0)  # back: a new node, the split's phase
    assert v.nodes["b"].split_phase == "both" and c.forget_left(15.0, 10.0) == []


def test_a_node_gone_for_good_is_forgotten_once_it_holds_no_request_and_recorded_afresh_when_back():
    """A node fenced and silent past ``forget_after`` that holds no request is forgotten (``forget_left``): the view
    (``/v1/cluster``'s snapshot, the checked ids), the policy's per-node state and the queue metrics drop it. One
    still named by a request is kept until that ends; one that reports again is a new node, with the split's phase.
    Before, a node's record stayed for the router's lifetime, so ids new at each restart grew every table."""
    for policy in ("ttft", "dynamo-kv", "round-robin"):
        c = core(policy)
        v = c.view
        c.apply_split(SplitCommand(epoch=1, phases={"a": "both", "b": "both"}, reason="test"))
        c.apply_state(state("a", "both", gpu_total_blocks=50, seq=1), 0.0)
        c.apply_state(state("b", "both", gpu_total_blocks=120, seq=1), 0.0)
        out = c.route(big("r0"), None, 0.1)  # only b holds it
        assert isinstance(out, RouteDecision) and out.prefill.node == "b"
        for t in (2.0, 4.0, 6.0, 8.0, 10.0, 12.0):  # a keeps reporting; b went silent at 0.0
            c.apply_state(state("a", "both", gpu_total_blocks=50, seq=1 + int(t)), t)
            c.check_fences(t)
        assert v.nodes["b"].fenced
        assert c.forget_left(9.0, 10.0) == []  # silent 9 s: may come back
        assert c.forget_left(12.0, 10.0) == []  # left, but r0 still names it
        assert c.forget_left(12.0, math.inf) == []  # --forget-node-after-s 0: never
        c.finish("r0", 12.0)  # the caller re-dispatched or failed it (a fence's rids)
        assert c.forget_left(12.0, 10.0) == ["b"], policy
        assert list(v.nodes) == ["a"] and [n["node"] for n in v.snapshot(12.0)] == ["a"] and "b" not in v._tokens
        assert v.kv_bounds() == (50, 50) and v.largest_gpu_kv() == (50, "a")
        if policy == "ttft":
            assert set(c.policy.predictor._nodes) == {"a"} and "b" not in c.policy.predictor._parts  # type: ignore[attr-defined]
        if policy == "dynamo-kv":
            assert "b" not in c.policy.blocks and "b" not in c.policy.prefill_tokens  # type: ignore[attr-defined]
        assert c.forget_left(13.0, 10.0) == []
        # the planner's --nodes name b in every split: its next command (or a split.get reply) brought the
        # record back, never seen, so never forgotten again and listed by /v1/cluster for good
        c.apply_split(SplitCommand(epoch=1, phases={"a": "both", "b": "both"}, reason="test"))
        assert list(v.nodes) == ["a"] and [n["node"] for n in v.snapshot(13.0)] == ["a"], policy
        c.apply_state(state("b", "prefill", gpu_total_blocks=120, seq=1), 13.0)  # back: a new node
        rec = v.nodes["b"]
        assert (rec.fenced, rec.fence_events, rec.split_phase) == (False, 0, "both")  # the split's phase, as before
        assert not v.eligible(rec, 13.0)  # reports prefill, the split says both: as an old record would
        c.apply_state(state("b", "both", gpu_total_blocks=120, seq=2), 13.5)
        out = c.route(big("r1"), None, 13.5)
        assert isinstance(out, RouteDecision) and out.prefill.node == "b"
