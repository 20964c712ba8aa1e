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


def _pstate(node: str, seq: int, boot: str, pid: int) -> NodeState:
    return NodeState(node=node, phase="both", seq=seq, boot=boot, pid=pid, gpu_free_blocks=10, gpu_total_blocks=10)


WALL = EXIT_NS + 10**9
"""The router's wall clock (ns) when the notices come."""


def test_a_notice_naming_another_pid_fences_nothing_and_the_live_process_stays_eligible():
    """The node's process (pid 100) is alive; a notice names pid 200 (a wrong pid, another ``up`` on one NATS, a
    notice that came after the restart) with an exit time after the live process's start. Nothing is fenced
    (``other_pid``) and the live process's states go on applying. Before, the time alone decided: fenced, and every
    state of the live process skipped for good."""
    view = NodeLoadView(fence_after=3.0)
    view.apply_state(_pstate("w0", 40, OLD, 100), 0.0)
    view.on_dispatch("r1", "w0", None)
    assert view.fence_exited("w0", EXIT_NS, 0.1, pid=200, wall_ns=WALL) == (None, "other_pid")
    assert view.nodes["w0"].down is None and not view.nodes["w0"].fenced
    assert not view.apply_state(_pstate("w0", 41, OLD, 100), 1.0)
    assert view.superseded_states == 0 and view.eligible(view.nodes["w0"], 3.0)
    assert view.requests_depending_on("w0") == ["r1"]


def test_a_notice_naming_the_trusted_pid_skips_that_process_only_whatever_the_clocks_say():
    """The notice names the trusted process (pid 100): fenced, its late states skipped. Its restart (pid 101) started,
    by its boot, BEFORE the exit (the wall clock stepped back between the exit and the restart): let in at its first
    state all the same (it is another process). Before, its boot below the exit time kept it out for good. A process
    that reused pid 100 (another boot) is let in too."""
    view = NodeLoadView(fence_after=3.0)
    view.apply_state(_pstate("w0", 40, OLD, 100), 0.0)
    f, why = view.fence_exited("w0", EXIT_NS, 0.1, pid=100, wall_ns=WALL)
    assert why == "" and f is not None and f.cause == "exited"
    assert not view.apply_state(_pstate("w0", 41, OLD, 100), 0.2)  # the dead process's late state
    assert view.superseded_states == 1 and view.nodes["w0"].fenced
    assert "w0: fenced (its process exited" in view.no_candidate_reason("prefill", 0.3)
    stepped_back = new_boot(EXIT_NS - 5 * 10**9, b"\x02")  # the restart's start, 5 s before the exit by the clock
    assert view.apply_state(_pstate("w0", 1, stepped_back, 101), 0.5)
    assert view.eligible(view.nodes["w0"], 0.5)
    # a process that reused the dead pid (another boot) after a later notice: let in at its first state
    assert view.fence_exited("w0", EXIT_NS, 1.0, pid=101, wall_ns=WALL)[1] == ""
    assert view.apply_state(_pstate("w0", 1, NEW, 101), 1.5) and view.eligible(view.nodes["w0"], 1.5)


def test_a_notice_whose_exit_is_in_the_future_is_dropped():
    """An ``exited_ns`` more than the slack past the router's wall clock (a forged or skewed notice): dropped
    (``future``), nothing fenced, nothing noted; one within the slack is taken. Before, it fenced the node and its
    time floor skipped every process that started before that future time."""
    from services.router.nodes import NODE_DOWN_FUTURE_SLACK_NS

    view = NodeLoadView(fence_after=3.0)
    view.apply_state(_state("w0", 40, OLD), 0.0)  # no pid known: the notice is told by time
    far = WALL + NODE_DOWN_FUTURE_SLACK_NS + 1
    assert view.fence_exited("w0", far, 0.1, wall_ns=WALL) == (None, "future")
    assert view.nodes["w0"].down is None and view.eligible(view.nodes["w0"], 0.1)
    assert view.apply_state(_state("w0", 1, NEW), 0.2) is False and view.superseded_states == 0
    f, why = view.fence_exited("w0", WALL + NODE_DOWN_FUTURE_SLACK_NS, 0.3, wall_ns=WALL)
    assert why == "" and f is not None
    # the validator bounds the type only (msgpack's uint64), the router's clock the value
    assert validate.check(m.NodeDown(node="w0", exited_ns=2**64 - 1), {"node": "w0"}) is None


def test_a_dead_process_that_keeps_reporting_is_let_back_in_after_twice_the_fence_time():
    """A notice named the trusted process (here by time, no pid known, as after a clock step), yet that process goes
    on reporting every second: after twice ``fence_after`` of its states (none more than ``fence_after`` apart) the
    node is let back in (:attr:`NodeLoadView.reported_alive`), not fenced for the router's life. A run broken by a
    silence longer than ``fence_after`` starts again."""
    view = NodeLoadView(fence_after=3.0)
    view.apply_state(_state("w0", 40, OLD), 0.0)
    assert view.fence_exited("w0", EXIT_NS, 0.1, wall_ns=WALL)[1] == ""
    seq = 41
    for t in (1.0, 2.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0):  # 2.0 -> 6.0: a gap past fence_after, the run starts at 6.0
        assert not view.apply_state(_state("w0", seq, OLD), t), t
        seq += 1
    assert view.reported_alive == 0 and view.nodes["w0"].fenced
    assert view.apply_state(_state("w0", seq, OLD), 12.0)  # 6 s = 2 x fence_after of its states
    assert view.reported_alive == 1 and view.nodes["w0"].down is None and view.eligible(view.nodes["w0"], 12.0)
    assert view.superseded_states == 8
    # the same with a pid: the "dead" pid reports on
    view = NodeLoadView(fence_after=3.0)
    view.apply_state(_pstate("w0", 40, OLD, 100), 0.0)
    assert view.fence_exited("w0", EXIT_NS, 0.1, pid=100, wall_ns=WALL)[1] == ""
    assert [view.apply_state(_pstate("w0", 41 + i, OLD, 100), 1.0 + i) for i in range(8)] == [False] * 6 + [True, False]
    assert view.reported_alive == 1 and view.eligible(view.nodes["w0"], 9.0)
