"""Other routers' sends in the load view (router replicas, issue #22)."""

from __future__ import annotations

from shared.messages import NodeState, RouteSent

from services.router.core import RouterCore
from services.router.policy import make_policy
from services.router.replicas import RemoteSends


def test_remote_sends_follow_attempts_first_token_and_end():
    r = RemoteSends()
    assert r.sent("x", "router-1", 0, now=10.0)
    assert r.chunk("x", 1, False) is None  # another attempt's chunk
    assert r.chunk("x", 0, False) == "first" and r.chunk("x", 0, False) is None
    assert r.current("x", 0) and not r.current("x", 1) and not r.current("y", 0)
    assert r.sent("x", "router-1", 1, now=11.0) and not r.sent("x", "router-1", 0, now=11.0)
    assert r.current("x", 1) and not r.current("x", 0)
    assert r.by_router() == {"router-1": 1}
    assert r.chunk("x", 1, True) == "end" and "x" not in r
    r.sent("y", "router-2", 0, now=0.0)
    r.sent("z", "router-2", 0, now=50.0)
    assert r.expired(61.0, ttl=60.0) == ["y"] and len(r) == 1
    assert r.forget("z") and not r.forget("z")


def test_another_routers_send_loads_the_view_until_its_first_token_and_end():
    core = RouterCore(make_policy("cache-aware"), block_size=4, fence_after=3.0, decode_binding="prefill-start")
    for n, ph in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        core.apply_state(NodeState(node=n, phase=ph), 0.0)  # type: ignore[arg-type]
    assert core.remote_dispatch(RouteSent(router="r1", rid="a", prefill_node="p0", prompt_tokens=100, max_tokens=8), 0.0)
    rec = core.view.nodes["p0"]
    assert rec.inflight == 1 and rec.inflight_prefill == 1
    # the owner bound its decode node: sent again, the placement is replaced, not doubled
    core.remote_dispatch(RouteSent(router="r1", rid="a", prefill_node="p0", decode_node="d0", prompt_tokens=100, max_tokens=8), 0.0)
    assert rec.inflight == 1 and core.view.nodes["d0"].inflight_decode == 1 and core.view.inflight_total == 1
    core.remote_first_token("a", 0.1)
    assert rec.inflight_prefill == 0
    assert core.finish("a", 0.2) == ("p0", "d0")
    assert core.view.inflight_total == 0 and core.view.nodes["d0"].inflight == 0
    assert not core.remote_dispatch(RouteSent(router="r1", rid="b", prefill_node="bad node"), 0.0)
