"""Live runs attribute their lost KV reuse as the simulator does (paper App. C.1, issue 21)."""

from __future__ import annotations

from evolving_infra.report.ideal import annotate_ideal, annotate_lost_reuse
from evolving_infra.report.records import RequestRecord
from evolving_infra.traces.schema import TraceRequest


def req(rid, branch, blocks, *, kind=None, parent=None):
    return TraceRequest(id=rid, agent="a", branch=branch, input_tokens=len(blocks) * 4, output_tokens=1, blocks=blocks,
                        kind=kind, parent_branch=parent)


def rec(rid, branch, t, node, cached):
    return RequestRecord(id=rid, agent="a", branch=branch, sent_at=t, prefill_node=node, cached_tokens=cached)


def test_causes_follow_the_branchs_previous_prefill_node():
    reqs = {r.id: r for r in [
        req("m0", "m", [1, 2], kind="main"),
        req("m1", "m", [1, 2, 3]),            # same node, lost 2 blocks: eviction
        req("m2", "m", [1, 2, 3, 4]),         # other node, lost: routing
        req("f0", "f", [1, 2, 3, 9], kind="fork", parent="m"),  # fork's first: against its parent's node
    ]}
    records = [rec("m0", "m", 0.0, "w0", 0), rec("m1", "m", 1.0, "w0", 0), rec("m2", "m", 2.0, "w1", 0),
               rec("f0", "f", 3.0, "w1", 0)]
    annotate_ideal(records, reqs, 4)
    assert annotate_lost_reuse(records, reqs) == 4
    assert [r.lost_reuse_cause for r in records] == ["none", "eviction", "routing", "eviction"]


def test_the_summary_names_the_policy_that_ran(capsys):
    from evolving_infra.report.write import print_summary

    print_summary({"meta": {"policy": {"name": "evolving", "routing": "ttft", "planner": "evolving", "eviction": "branch-count"}}})
    assert "policy     evolving  (routing ttft, planner evolving, eviction branch-count)" in capsys.readouterr().out
