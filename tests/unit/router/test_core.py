"""RouterCore: placement, collocation, messages produced, abort and fencing flow."""

from __future__ import annotations

import pytest

from services.router.core import NoRoute, RouteDecision, RouterCore
from services.router.policy import RouteRequest, make_policy

from .helpers import lookup, state


def core(policy: str = "cache-aware", **kw) -> RouterCore:
    return RouterCore(make_policy(policy, **kw), block_size=4, fence_after=3.0)


def rq(rid: str, blocks: int = 2, branch: str | None = "br") -> RouteRequest:
    return RouteRequest(rid=rid, prompt_tokens=blocks * 4 + 1, block_hashes=list(range(blocks)), max_tokens=5, token_ids=b"\0" * 4, branch_id=branch)


def test_pd_placement_and_messages():
    c = core()
    c.apply_state(state("p1"), 0.0)
    c.apply_state(state("p2"), 0.0)
    c.apply_state(state("d1", "decode", running=4), 0.0)
    c.apply_state(state("d2", "decode", running=1), 0.0)
    out = c.route(rq("r1"), lookup(block_size=4, p2=2), now=1.5)
    assert isinstance(out, RouteDecision)
    assert (out.prefill.node, out.prefill.path, out.decode_node) == ("p2", "cache_hit", "d2")
    assert [(x.node, x.phase, x.branch_id, x.ts) for x in out.placed] == [("p2", "prefill", "br", 1.5), ("d2", "decode", "br", 1.5)]
    w = out.work
    assert (w.rid, w.prompt_tokens, w.max_tokens, w.block_size, w.decode_node, w.branch_id, w.sent_at) == ("r1", 9, 5, 4, "d2", "br", 1.5)
    assert w.block_hashes == [0, 1] and w.token_ids == b"\0" * 4
    assert c.view.nodes["p2"].inflight == 1 and c.view.nodes["d2"].inflight == 1
    # d2 now has running 1 + inflight 1 = 2 < 4: still d2; after two more, d1 ties at 4 and wins by id
    out2 = c.route(rq("r2"), None, 2.0)
    assert isinstance(out2, RouteDecision) and out2.decode_node == "d2"
    out3 = c.route(rq("r3"), None, 2.0)
    assert isinstance(out3, RouteDecision) and out3.decode_node == "d2"
    out4 = c.route(rq("r4"), None, 2.0)
    assert isinstance(out4, RouteDecision) and out4.decode_node == "d1"


def test_collocated_node_has_no_decode_node():
    c = core()
    c.apply_state(state("c1", "both"), 0.0)
    c.apply_state(state("d1", "decode"), 0.0)
    out = c.route(rq("r1", branch=None), None, 0.0)
    assert isinstance(out, RouteDecision)
    assert out.prefill.node == "c1" and out.decode is None and out.work.decode_node is None
    assert out.placed == []  # no branch: nothing to place in the directory
    out = c.route(rq("r2"), None, 0.0)
    assert isinstance(out, RouteDecision)
    assert [(p.node, p.phase, p.branch_id, p.rid) for p in out.placed] == [("c1", "both", "br", "r2")]


def test_without_decode_nodes_only_collocated_nodes_are_offered():
    c = core("round-robin")
    c.apply_state(state("a", "prefill"), 0.0)
    c.apply_state(state("b", "both"), 0.0)
    for i in range(3):
        out = c.route(rq(f"r{i}"), None, 0.0)
        assert isinstance(out, RouteDecision) and out.prefill.node == "b"


def test_no_route_reasons():
    c = core()
    out = c.route(rq("r1"), None, 0.0)
    assert isinstance(out, NoRoute) and "prefill" in out.reason
    c.apply_state(state("p1"), 0.0)
    out = c.route(rq("r1"), None, 0.0)
    assert isinstance(out, NoRoute) and "decode" in out.reason
    c.apply_state(state("d1", "decode"), 0.0)
    assert isinstance(c.route(rq("r1"), None, 1.0), RouteDecision)
    out = c.route(rq("r2"), None, 10.0)  # both silent for 10 s
    assert isinstance(out, NoRoute) and "fenced" in out.reason
    with pytest.raises(ValueError):
        c.route(RouteRequest(rid="x", prompt_tokens=0), None, 0.0)


def test_abort_and_fence_flow():
    c = core()
    c.apply_state(state("p1"), 0.0)
    c.apply_state(state("d1", "decode"), 0.0)
    out = c.route(rq("r1"), None, 0.0)
    assert isinstance(out, RouteDecision)
    aborts = c.abort("r1", "client gone")
    assert [(n, a.rid, a.reason) for n, a in aborts] == [("p1", "r1", "client gone"), ("d1", "r1", "client gone")]
    assert c.abort("r1", "again") == []
    c.route(rq("r2"), None, 0.5)
    assert [n for n, _ in c.abort("r2", "error on p1", skip="p1")] == ["d1"]
    c.route(rq("r3"), None, 1.0)
    c.apply_state(state("p1"), 2.0)
    fenced = c.check_fences(3.5)  # d1 silent since 0.0
    assert [(f.node, f.rids) for f in fenced] == [("d1", ("r3",))]
    assert c.next_deadline() == 5.0


def test_epoch_goes_into_prefill_work():
    from shared.messages import SplitCommand

    c = core()
    c.apply_split(SplitCommand(epoch=7, phases={"c": "both"}))
    c.apply_state(state("c", "both"), 0.0)
    out = c.route(rq("r"), None, 0.0)
    assert isinstance(out, RouteDecision) and out.work.epoch == 7


def test_ignore_eos_reaches_the_work():
    """The OpenAI field ``ignore_eos`` (vLLM's) travels RouteRequest → PrefillWork, and a
    re-dispatch's continuation keeps it."""
    import dataclasses

    from services.router.faults import continuation

    c = core()
    c.apply_state(state("c1", "both"), 0.0)
    for flag in (False, True):
        req = dataclasses.replace(rq(f"r{flag}", branch=None), ignore_eos=flag, token_ids=b"\0" * 36)
        out = c.route(req, None, 0.0)
        assert isinstance(out, RouteDecision) and out.work.ignore_eos is flag
        cont = continuation(req, [7], block_size=4, max_prompt_tokens=100)
        assert not isinstance(cont, str) and cont.ignore_eos is flag


def test_states_reach_the_ttft_predictor_through_the_state_hook():
    from services.router.ttft import TtftPolicy

    c = core("ttft")
    pol = c.policy
    assert isinstance(pol, TtftPolicy)
    assert pol.state_hook() == pol.predictor.apply_state  # no on_state frame per state
    c.apply_state(state("w0"), 1.0)
    assert pol.predictor._nodes["w0"].state is c.view.nodes["w0"].state

    seen: list[str] = []

    class Spy(TtftPolicy):  # a subclass that overrides on_state keeps getting it
        def on_state(self, st, now):  # type: ignore[no-untyped-def]
            seen.append(st.node)
            super().on_state(st, now)

    spy = Spy(pol.predictor, block_size=4)
    c2 = RouterCore(spy, block_size=4, fence_after=3.0)
    c2.apply_state(state("w1"), 1.0)
    assert seen == ["w1"] and "w1" in spy.predictor._nodes
    assert make_policy("cache-aware").state_hook() is not None  # the default: on_state itself
