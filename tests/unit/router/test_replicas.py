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


def test_a_chunk_naming_another_router_than_the_counted_owner_neither_starts_nor_ends_its_request():
    """One id placed by two routers at once, at the same attempt: the one that gave way (router-z) counts router-a's
    placement; its own request's end (the abort chunk its node sends, naming router-z) must not end router-a's in
    its view. Before, ``chunk`` matched on rid and attempt alone: router-a's request was forgotten there."""
    r = RemoteSends()
    assert r.sent("x", "router-a", 7, now=0.0)
    assert r.chunk("x", 7, False, "router-z") is None and not r.current("x", 7, "router-z")
    assert r.chunk("x", 7, True, "router-z") is None and "x" in r
    assert r.current("x", 7, "router-a") and r.current("x", 7)
    assert r.chunk("x", 7, False, "router-a") == "first"
    assert r.chunk("x", 7, True, "") == "end" and "x" not in r  # an older writer's chunk (no router) still ends it


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


def _peer_sent(remote: RemoteSends, core: RouterCore, msg: RouteSent, now: float) -> None:
    """What ``RouterService._on_route_sent`` does with a ``RouteSent`` of another router."""
    if remote.sent(msg.rid, msg.router, msg.attempt, now, first_token=msg.first_token):
        assert core.remote_dispatch(msg, now, first_token=remote.first_token(msg.rid))


def _peer_chunk(remote: RemoteSends, core: RouterCore, rid: str, now: float) -> None:
    """What ``RouterService._remote_chunk`` does with a (not last) chunk of another router's request."""
    if remote.chunk(rid, 0, False) == "first":
        core.remote_first_token(rid, now)


def test_a_peer_counts_a_parked_request_as_its_owner_once_its_decode_node_is_bound_after_its_first_token():
    """The prefill node sends a parked request's first token at the prompt's end, before route.bind is
    answered (ea82da0); the owner's binding then re-announces the placement (route.sent with the decode
    node). The owner's own view has the prefill done and no decode room reserved from then on
    (``RouterCore.bind_decode``); a peer must count it the same. Before, the re-announcement counted it
    afresh on its prefill node (inflight_prefill 1, the ttft predictor's queue charged with its prompt)
    and reserved its decode KV room until the decode node's first output."""
    from .helpers import state
    from services.router.policy import RouteRequest

    owner = RouterCore(make_policy("ttft", block_size=4, profile="tiny"), block_size=4, fence_after=3.0, decode_binding="prefill-start")
    peer = RouterCore(make_policy("ttft", block_size=4, profile="tiny"), block_size=4, fence_after=3.0, decode_binding="prefill-start")
    remote = RemoteSends()
    for c in (owner, peer):
        c.apply_state(state("p1"), 0.0)
        c.apply_state(state("d1", "decode", gpu_free_blocks=4), 0.0)
    req = RouteRequest(rid="r1", prompt_tokens=9, block_hashes=[0, 1], max_tokens=3)
    owner.route(req, None, 0.0)
    _peer_sent(remote, peer, RouteSent(router="r-own", rid="r1", prefill_node="p1", prompt_tokens=9, max_tokens=3), 0.0)
    owner.on_first_token("r1", 0.1)  # parked on p1, its first token out (from p1)
    _peer_chunk(remote, peer, "r1", 0.1)
    assert owner.bind_decode("r1", 0.2, prefill_node="p1").node == "d1"  # type: ignore[union-attr]
    _peer_sent(remote, peer, RouteSent(router="r-own", rid="r1", prefill_node="p1", decode_node="d1", prompt_tokens=9, max_tokens=3), 0.2)
    for c in (owner, peer):
        assert c.view.nodes["p1"].inflight_prefill == 0 and c.view.nodes["p1"].inflight == 1
        assert c.view.nodes["d1"].inflight_decode == 1
        assert c.policy._decode_reserved == {} and c.policy._rid_decode == {}  # type: ignore[attr-defined]
    _peer_chunk(remote, peer, "r1", 0.3)  # the decode node's first output: nothing more to free
    assert peer.view.nodes["p1"].inflight_prefill == 0
    # a re-dispatch (a new attempt) is a new prefill: counted on its prefill node until its first token
    _peer_sent(remote, peer, RouteSent(router="r-own", rid="r1", prefill_node="p1", decode_node="d1", prompt_tokens=9, max_tokens=3, attempt=1), 0.4)
    assert peer.view.nodes["p1"].inflight_prefill == 1 and not remote.first_token("r1")


def _ttft_core() -> RouterCore:
    from .helpers import state

    core = RouterCore(make_policy("ttft", block_size=4, profile="tiny"), block_size=4, fence_after=3.0, decode_binding="prefill-start")
    core.apply_state(state("p1"), 0.0)
    core.apply_state(state("d1", "decode", gpu_free_blocks=4), 0.0)
    return core


def _load(core: RouterCore) -> tuple[object, ...]:
    """What a router counts of the requests in flight: per node (in flight, waiting for their first token,
    bound for decode), the ttft predictor's sends per prefill node, its decode KV reservations and the wait it
    predicts on the prefill node."""
    v, pol = core.view, core.policy
    return (
        {n: (r.inflight, r.inflight_prefill, r.inflight_decode) for n, r in sorted(v.nodes.items())},
        pol.predictor.tracked("p1"),  # type: ignore[attr-defined]
        dict(pol._decode_reserved),  # type: ignore[attr-defined]
        round(pol.predictor.wait("p1", 0.3), 9),  # type: ignore[attr-defined]
    )


def test_a_router_that_joins_while_a_parked_request_waits_for_its_decode_node_counts_it_as_one_there_from_the_start():
    """A router that starts (or restarts) after another router placed a request has no record of it: it never
    counts a placement it did not hear (the nodes' states show that load), and the chunks it sees of such a
    request are not its business (``RemoteSends.chunk``: unknown rid). It hears of the request again when the
    owner binds its decode node (``route.sent`` at ``route.bind``). When that binding comes after the first token
    (a parked request: its prefill node sends the first token at the prompt's end, before the binding), the
    joiner, which has not seen that first token as belonging to a request it counts, counted the prefill again on
    its prefill node (inflight_prefill 1, the ttft predictor's queue charged with its prompt: a longer wait
    predicted on p1) and reserved its decode KV room, until the decode node's first output; a router there from
    the start counts the prefill done (it saw the first token, ``RemoteSends.first_token``). The owner now says
    so in the ``RouteSent`` (``first_token``): the joiner counts it as the others do. Both stop counting it at
    its end."""
    from services.router.policy import RouteRequest

    owner, peer = _ttft_core(), _ttft_core()
    remote_peer = RemoteSends()
    req = RouteRequest(rid="r1", prompt_tokens=9, block_hashes=[0, 1], max_tokens=3)
    owner.route(req, None, 0.0)
    _peer_sent(remote_peer, peer, RouteSent(router="r-own", rid="r1", prefill_node="p1", prompt_tokens=9, max_tokens=3), 0.0)
    joiner, remote_joiner = _ttft_core(), RemoteSends()  # starts now: it never heard the placement above
    assert _load(joiner) != _load(peer)  # it does not count a placement it did not hear
    owner.on_first_token("r1", 0.1)  # parked on p1, its first token out (from p1)
    _peer_chunk(remote_peer, peer, "r1", 0.1)
    _peer_chunk(remote_joiner, joiner, "r1", 0.1)  # not a request it counts
    assert "r1" not in remote_joiner and joiner.view.inflight_total == 0
    assert owner.bind_decode("r1", 0.2, prefill_node="p1").node == "d1"  # type: ignore[union-attr]
    sent = RouteSent(router="r-own", rid="r1", prefill_node="p1", decode_node="d1", prompt_tokens=9, max_tokens=3,
                     first_token=owner.view.first_token_seen("r1"))  # fmt: skip
    _peer_sent(remote_peer, peer, sent, 0.2)
    _peer_sent(remote_joiner, joiner, sent, 0.2)
    assert _load(joiner) == _load(peer) == _load(owner)
    assert joiner.view.nodes["p1"].inflight_prefill == 0 and joiner.view.nodes["d1"].inflight_decode == 1
    for c, r in ((peer, remote_peer), (joiner, remote_joiner)):  # the decode node's first output, then its end
        _peer_chunk(r, c, "r1", 0.3)
        assert r.chunk("r1", 0, True) == "end" and c.finish("r1", 0.4) == ("p1", "d1")
    owner.finish("r1", 0.4)
    assert _load(joiner) == _load(peer) == _load(owner) == _load(_ttft_core())  # nothing left counted anywhere
