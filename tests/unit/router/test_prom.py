"""The router's Prometheus families (``services/router/prom.py``) from a core, no HTTP."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.router.branches import BranchTable
from services.router.core import RouterCore
from services.router.policy import make_policy
from services.router.prom import router_families
from shared.messages import SplitCommand
from shared.metrics import FuncCollector, make_registry

from .helpers import state


def scrape(
    core: RouterCore, now: float, counters: Counter | None = None, branches: BranchTable | None = None
) -> dict[tuple[str, tuple], float]:
    svc = SimpleNamespace(core=core, counters=counters or Counter(), clock=SimpleNamespace(now=lambda: now), buffered_output_tokens=0, http_responses=Counter(),
                          cfg=SimpleNamespace(model="m"),
                          branches=branches or BranchTable())  # fmt: skip
    reg = make_registry()
    reg.register(FuncCollector(lambda: router_families(svc)))  # type: ignore[arg-type]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(generate_latest(reg).decode())
        for s in f.samples
    }


def test_a_fenced_node_is_counted_per_node_so_a_worker_killed_between_scrapes_shows():
    """``kill -9`` of a worker that ``up`` restarts within a second: the router fences it (its state sequence went
    back) and lets it back in at its next state, so between two 5-s scrapes ``ei_router_live_nodes`` never moved and
    only ``GET /v1/cluster``'s ``fence_events`` and a log line said so. ``ei_router_node_fences_total{node}`` counts
    every fence, silent or restarted, and every known node has its series from 0."""
    c = RouterCore(make_policy("cache-aware"), block_size=4, fence_after=3.0)
    c.apply_state(state("p1", seq=5), 0.0)
    c.apply_state(state("d1", "decode", seq=5), 0.0)
    fences = lambda m: {dict(k[1])["node"]: v for k, v in m.items() if k[0] == "ei_router_node_fences_total"}  # noqa: E731
    assert fences(scrape(c, 0.0)) == {"p1": 0.0, "d1": 0.0}
    c.apply_state(state("d1", "decode", seq=1), 1.0)  # a new process under d1's id
    assert [f.node for f in c.check_fences(1.0)] == ["d1"]
    c.apply_state(state("d1", "decode", seq=2), 1.5)  # back in
    m = scrape(c, 1.5)
    assert m[("ei_router_live_nodes", (("phase", "decode"),))] == 1.0  # the gauge no longer shows it ...
    assert fences(m) == {"p1": 0.0, "d1": 1.0}  # ... the counter does
    c.apply_state(state("p1", seq=6), 4.0)
    assert [f.node for f in c.check_fences(4.6)] == ["d1"]  # silent since 1.5 > fence_after 3.0
    assert fences(scrape(c, 4.6)) == {"p1": 0.0, "d1": 2.0}


def test_the_router_exports_the_node_count_of_the_split_it_applies_so_each_router_is_held_to_its_own():
    """EINodesMissing compared the planner's ``ei_split_nodes`` with each router's live nodes, matched by ``job``:
    two ``up`` clusters scraped through one job (their targets carry no cluster label) merged their splits and the
    smaller one paged for good. The router now exports the split it applies itself (``ei_router_split_nodes``:
    every node it names, whatever its phase, dead ones included; 0 before its first split), against its own
    ``ei_router_live_nodes``."""
    c = RouterCore(make_policy("cache-aware"), block_size=4, fence_after=3.0)
    assert scrape(c, 0.0)[("ei_router_split_nodes", ())] == 0.0
    c.apply_state(state("p1", seq=1), 0.0)
    c.apply_state(state("d1", "decode", seq=1), 0.0)
    c.apply_split(SplitCommand(epoch=1, phases={"p1": "prefill", "d1": "decode", "gone": "decode"}))
    m = scrape(c, 1.0)
    assert m[("ei_router_split_nodes", ())] == 3.0  # "gone" never reported: in the split all the same
    live = sum(v for k, v in m.items() if k[0] == "ei_router_live_nodes")
    assert m[("ei_router_split_nodes", ())] - live == 1.0  # what the rule pages on
    c.apply_split(SplitCommand(epoch=2, phases={"p1": "both"}))
    assert scrape(c, 1.0)[("ei_router_split_nodes", ())] == 1.0


def test_requests_re_dispatched_off_a_fenced_node_are_counted_by_what_was_lost():
    """``kill -9`` of a prefill worker with a request on it: the router placed it again and the client got its 200,
    so no status or finish-reason count moved; only the response's ``ei.redispatches`` and a log line said so. The
    shell's ``redispatch.<kind>`` counters are now ``ei_router_redispatches_total{lost}``, every kind from 0 (its
    other ``redispatch.*`` counters, e.g. ``already``, are not re-dispatches and stay out)."""
    c = RouterCore(make_policy("cache-aware"), block_size=4, fence_after=3.0)
    counters = Counter({"redispatch.prefill": 2, "redispatch.decode": 1, "redispatch.already": 5, "redispatched": 3})
    m = scrape(c, 0.0, counters)
    got = {dict(k[1])["lost"]: v for k, v in m.items() if k[0] == "ei_router_redispatches_total"}
    assert got == {"prefill": 2.0, "decode": 1.0, "handoff": 0.0}


def test_branch_table_and_client_gone_counts_are_exported():
    """The branch table's active gauge and expired / evicted / resumed counts, and the shell's ``drain_refused``,
    ``http.gone_before_dispatch`` and ``http.gate_disconnects``, were only in ``/v1/stats``' JSON."""
    t = BranchTable(ttl_s=10.0, max_active=2)
    for i, bid in enumerate(("a", "b", "c")):  # c evicts a (the cap), then the TTL expires b and c
        t.observe(bid, float(i))
        t.done(bid)
    t.expire(100.0)
    t.observe("b", 101.0)  # a resume
    counters = Counter({"drain_refused": 4, "http.gone_before_dispatch": 2, "http.gate_disconnects": 1})
    m = scrape(RouterCore(make_policy("cache-aware"), block_size=4, fence_after=3.0), 0.0, counters, t)
    assert m[("ei_router_branches_active", ())] == 1.0
    assert m[("ei_router_branches_evicted_total", ())] == 1.0
    assert m[("ei_router_branches_expired_total", ())] == 2.0
    assert m[("ei_router_branches_resumed_total", ())] == 1.0
    assert m[("ei_router_branch_parents_missing_total", (("reason", "unknown"),))] == 0.0
    t.observe("f", 102.0, kind="fork", parent="ghost")
    m = scrape(RouterCore(make_policy("cache-aware"), block_size=4, fence_after=3.0), 0.0, counters, t)
    assert m[("ei_router_branch_parents_missing_total", (("reason", "unknown"),))] == 1.0
    assert m[("ei_router_branch_parents_missing_total", (("reason", "ended"),))] == 0.0
    assert m[("ei_router_drain_refused_total", ())] == 4.0
    assert m[("ei_router_gone_before_dispatch_total", ())] == 2.0
    assert m[("ei_router_gate_disconnects_total", ())] == 1.0


def test_inflight_requests_counts_other_routers_placements_and_its_help_says_so():
    """``ei_router_inflight_requests`` is the load view's total: another router's placement (``route.sent``,
    ``RouterCore.remote_dispatch``) counts as this router's own does. Its help said "Requests placed and not
    finished", read as this router's own: with ``up --routers 2`` a dashboard summing it over routers doubled."""
    from shared import messages as m

    c = RouterCore(make_policy("cache-aware"), block_size=4, fence_after=3.0)
    c.apply_state(state("p1", seq=1), 0.0)
    assert c.remote_dispatch(m.RouteSent(router="router-1", rid="r1", prefill_node="p1", prompt_tokens=8, max_tokens=4), 0.0)
    assert scrape(c, 0.0)[("ei_router_inflight_requests", ())] == 1.0
    svc = SimpleNamespace(core=c, counters=Counter(), clock=SimpleNamespace(now=lambda: 0.0), buffered_output_tokens=0, http_responses=Counter(),
                          cfg=SimpleNamespace(model="m"),
                          branches=BranchTable())  # fmt: skip
    help_text = next(f.documentation for f in router_families(svc) if f.name == "ei_router_inflight_requests")  # type: ignore[arg-type]
    assert "other routers" in help_text, help_text
