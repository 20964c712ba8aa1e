"""Issue 21: the router's per-node models follow the nodes under every planner.

A node whose engine runs five times slower than the profile the router was given
(``SimConfig.node_slowdown``) under the *static* planner: the online refits
(``services.planner.online.OnlineModels``, every 60 s) teach the ttft router its
real speed, and once they do it stops sending it prefill work while the fast
prefill node keeps up. Before issue 21 only the evolving planner fitted models;
the same run sent the slow node 17% of the later requests (40 of 242).
"""

from __future__ import annotations

from collections import Counter

from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import simulate
from evolving_infra.traces.schema import TraceRequest

B = 64


def one_shot_agents(k: int, blocks: int = 125, output: int = 50) -> list[TraceRequest]:
    """``k`` agents of one request each: an 8,000-token prompt nobody shares (all uncached)."""
    out = []
    for a in range(k):
        base = (a + 1) * 1_000_000
        out.append(
            TraceRequest(id=f"s{a}-r0", agent=f"s{a}", branch=f"s{a}-main", input_tokens=blocks * B + 1, output_tokens=output,
                         blocks=[base + i for i in range(blocks)], kind="main", ends_branch=True)
        )
    return out


def test_a_node_five_times_slower_than_its_profile_stops_getting_prefill_work_under_the_static_planner():
    reqs = one_shot_agents(500)
    cfg = SimConfig(nodes=4, policy="static", split="2P2D", routing="ttft", seed=1, concurrency=4, node_slowdown=(("w0", 5.0),))
    res = simulate(cfg, reqs, B)
    assert res.report["requests_completed"] == len(reqs) and res.report["requests_failed"] == 0
    assert res.report["meta"]["policy"]["planner"] == "static"
    before = Counter(r.prefill_node for r in res.records if r.sent_at < 60.0)
    after = Counter(r.prefill_node for r in res.records if r.sent_at > 61.0)  # after the first refit
    assert before["w0"] > 0, "with the profile's coefficients the slow node looks as fast as the other"
    assert sum(after.values()) > 50
    assert after["w0"] <= 0.02 * sum(after.values()), after


def test_a_slowdown_factor_must_be_positive():
    import pytest

    from evolving_infra.sim.config import SimConfigError, resolve

    with pytest.raises(SimConfigError, match="slow-node"):
        resolve(SimConfig(nodes=4, node_slowdown=(("w0", 0.0),)))
