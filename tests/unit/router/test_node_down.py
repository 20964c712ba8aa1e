"""``node.down.<node>``: the launcher saw a worker's process exit, and the router fences the node at once
(:meth:`services.router.nodes.NodeLoadView.fence_exited`), trusting the notice for that node id only, for that
process only (one that started after the exit is not fenced), and skipping the dead process's late states."""

from __future__ import annotations

import pytest

from services.router.nodes import NodeLoadView
from shared import auth, validate
from shared import messages as m
from shared.messages import NodeState, new_boot
from shared.subjects import NODE_DOWN, Subjects

T0 = 1_000_000_000_000_000_000
"""Wall ns of the dead process's start."""
OLD = new_boot(T0, b"\xff\xff\xff\xff")
EXIT_NS = T0 + 60 * 10**9
NEW = new_boot(EXIT_NS + 500_000_000, b"\x00")


def _state(node: str, seq: int, boot: str) -> NodeState:
    return NodeState(node=node, phase="both", seq=seq, boot=boot, gpu_free_blocks=10, gpu_total_blocks=10)


def test_a_node_whose_process_exited_is_fenced_at_once_with_its_requests_and_let_back_in_by_its_restart():
    view = NodeLoadView(fence_after=3.0)
    view.apply_state(_state("w0", 40, OLD), 0.0)
    view.apply_state(_state("w1", 40, OLD), 0.0)
    view.on_dispatch("r1", "w0", None)
    f, why = view.fence_exited("w0", EXIT_NS, 0.2)
    assert why == "" and f is not None and (f.node, f.cause, f.rids) == ("w0", "exited", ("r1",))
    assert f.age == pytest.approx(0.2)
    assert not view.eligible(view.nodes["w0"], 0.2) and view.eligible(view.nodes["w1"], 0.2)
    assert view.check_fences(0.3) == []  # fenced once
    assert view.fence_exited("w0", EXIT_NS, 0.3) == (None, "already_fenced")
    assert "w0: fenced (its process exited" in view.no_candidate_reason("prefill", 0.3)
    # a state the dead process sent before it died, read late: skipped, not let back in
    assert not view.apply_state(_state("w0", 41, OLD), 0.4)
    assert view.superseded_states == 1 and view.nodes["w0"].fenced
    # its restart (a process that started after the exit) is let back in at its first state
    assert view.apply_state(_state("w0", 1, NEW), 2.0)
    assert view.eligible(view.nodes["w0"], 2.0) and view.check_fences(2.1) == []


def test_a_late_notice_fences_no_later_process_nor_an_unknown_node():
    view = NodeLoadView(fence_after=3.0)
    view.apply_state(_state("w0", 1, NEW), 0.0)  # the restart already reports
    assert view.fence_exited("w0", EXIT_NS, 0.1) == (None, "later_process")
    assert view.eligible(view.nodes["w0"], 0.1)
    assert view.fence_exited("w9", EXIT_NS, 0.1) == (None, "unknown")
    assert "w9" not in view.nodes


def test_a_node_down_notice_is_trusted_for_its_subject_s_node_only_and_only_the_launcher_may_publish_it():
    s = Subjects("p0")
    d = m.NodeDown(node="w0", pid=123, exited_ns=EXIT_NS, code=-9)
    assert validate.check(d, {"node": "w0"}, nodes={"w0", "w1"}) is None
    assert "node" in (validate.check(d, {"node": "w1"}, nodes={"w0", "w1"}) or "")  # node.down.w1 naming w0: dropped
    assert validate.check(d, {"node": "w0"}, nodes={"w1"}) is not None  # not a node of this cluster
    assert validate.check(m.NodeDown(node="w0", code=999), {"node": "w0"}) is not None
    subject = s.format(NODE_DOWN, node="w0")
    assert subject == "ei.p0.node.down.w0"
    pubs = {kind: auth.permissions(auth.identity(name))["publish"]
            for kind, name in (("launcher", "launcher"), ("worker", "worker-w0"), ("router", "router"))}  # fmt: skip
    assert "ei.p0.node.down.*" in pubs["launcher"]
    assert not any("node.down" in p for p in pubs["worker"] + pubs["router"])
    assert "ei.p0.node.down.*" in auth.permissions(auth.identity("router"))["subscribe"]
