"""An operator's ``split set`` lays its phases over the live nodes first (``PlannerCore._place``).

Before, ``set_split`` went by position whatever the nodes' liveness: faultkit 2P2D, ``worker-w0``
SIGKILLed with no restart, then ``split set 1P3D`` made the dead w0 the only prefill node and
drained w1 to decode: 66 of 80 requests got a 503 "no live prefill node".
"""

from __future__ import annotations

import asyncio

import pytest

from services.planner.core import PlannerCore
from shared import messages as m
from shared.messages import NodeState
from shared.split import SplitError

NODES = ["w0", "w1", "w2", "w3"]


def _core(last: dict[str, float], silent_after: float | None = 3.0) -> PlannerCore:
    """A 2P2D core whose nodes last reported at ``last`` (s; a node not in it never reported)."""
    core = PlannerCore(NODES, "2P2D", silent_after=silent_after)
    phases = dict(core.command.phases)
    for node, t in sorted(last.items(), key=lambda kv: kv[1]):
        core.on_node_state(NodeState(node=node, phase=phases[node], epoch=1), t)
    return core


def test_a_split_set_after_a_node_died_gives_prefill_to_a_live_node() -> None:
    core = _core({"w0": 1.0, "w1": 5.0, "w2": 5.0, "w3": 5.0})  # w0 silent 4.2 s > 3 s at t=5.2
    cmd = core.set_split("1P3D", 5.2)
    assert dict(cmd.phases) == {"w0": "decode", "w1": "prefill", "w2": "decode", "w3": "decode"}
    assert list(cmd.phases) == NODES  # cluster order kept (assign_min_change takes nodes in that order)
    assert cmd.reason == "operator (laid over the live nodes first: w0 silent 4.2 s)"
    assert core.take_decisions()[-1].reason == cmd.reason


def test_with_x_or_fewer_live_nodes_the_last_live_one_serves_decode() -> None:
    core = _core({"w0": 5.0, "w1": 5.0, "w2": 5.0})  # w3 never reported
    cmd = core.set_split("3P1D", 5.2)
    assert dict(cmd.phases) == {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "prefill"}
    assert "w3 never reported" in cmd.reason


def test_positions_stand_when_every_node_or_none_is_live() -> None:
    positional = {"w0": "prefill", "w1": "decode", "w2": "decode", "w3": "decode"}
    assert dict(_core({n: 5.0 for n in NODES}).set_split("1P3D", 5.2).phases) == positional
    assert dict(_core({n: 1.0 for n in NODES}).set_split("1P3D", 5.2).phases) == positional  # nothing known
    assert dict(_core({}).set_split("1P3D", 5.2).phases) == positional
    assert dict(_core({"w0": 1.0, "w1": 5.0}, silent_after=None).set_split("1P3D", 5.2).phases) == positional
    cmd = _core({"w0": 5.0, "w1": 5.0, "w2": 5.0}).set_split("1P3D", 5.2)  # w3 silent, already decode
    assert dict(cmd.phases) == positional and cmd.reason == "operator"


def test_one_live_node_left_refuses_an_xpyd_naming_the_silent_nodes() -> None:
    core = _core({"w0": 1.0, "w1": 5.0, "w2": 2.0})
    with pytest.raises(SplitError) as e:
        core.set_split("2P2D", 5.2)
    assert str(e.value).startswith(
        "split '2P2D' would leave decode only on silent nodes (no node.state for more than 3 s): "
        "w0 silent 4.2 s, w2 silent 3.2 s, w3 never reported; only w1 is live"
    )
    assert core.command.epoch == 1  # nothing issued
    assert set(core.set_split("collocated", 5.2).phases.values()) == {"both"}


def test_the_refusal_is_the_splits_not_a_retry() -> None:
    """The service's reply: refused without ``retry`` (``split set`` exits 2)."""
    from services.planner.service import PlannerService
    from types import SimpleNamespace

    core = _core({"w1": 5.0})
    svc = SimpleNamespace(core=core, clock=SimpleNamespace(now=lambda: 5.2), counters={"split.set.refused": 0},
                          log=SimpleNamespace(warning=lambda *a, **k: None))
    reply = asyncio.run(PlannerService._on_set(svc, m.SplitSetRequest(split="1P3D"), "split.set"))  # type: ignore[arg-type]
    assert (reply.ok, reply.retry) == (False, False) and "only w1 is live" in (reply.error or "")


def test_split_set_help_says_live_nodes_go_first(capsys: pytest.CaptureFixture[str]) -> None:
    from evolving_infra.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser("split").parse_args(["split", "set", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "live nodes first" in text and "with one live node left an xPyD is refused (exit 2)" in text
    assert "or only one node is live" in text


def _states(core: PlannerCore, t: float, *nodes: str) -> None:
    for n in nodes:
        core.on_node_state(NodeState(node=n, phase=core.command.phases[n], epoch=core.command.epoch), t)


def test_a_phase_left_on_dead_nodes_only_is_swapped_with_a_live_node() -> None:
    """The fault walk itself: ``split set 1P3D`` 0.2 s after w0's SIGKILL cannot know w0 is dead
    (its last state is 0.2 s old), so w0 is the only prefill node; once w0 is silent past
    ``silent_after`` the planner swaps it with the first live decode node. Before, nothing moved."""
    core = PlannerCore(NODES, "2P2D", silent_after=3.0)
    _states(core, 2.0, *NODES)
    cmd = core.set_split("1P3D", 2.2)
    assert cmd.phases["w0"] == "prefill" and cmd.reason == "operator"
    core.take_decisions()
    _states(core, 4.9, "w1", "w2", "w3")
    assert core.next_tick() == 5.0  # w0's last state + 3 s
    assert core.tick(4.99) is None
    cmd = core.tick(5.0)
    assert cmd is not None and cmd.epoch == 3
    assert dict(cmd.phases) == {"w0": "decode", "w1": "prefill", "w2": "decode", "w3": "decode"}
    assert cmd.reason == "prefill was left on silent nodes only (w0 silent 3.0 s): w1 takes it from w0"
    (d,) = core.take_decisions()
    assert (d.policy, d.action, d.split_before, d.split_after, d.epoch) == ("liveness", "switch", "1P3D", "1P3D", 3)
    assert core.tick(5.5) is None  # w1 serves prefill now


def test_decode_left_on_dead_nodes_takes_the_last_live_prefill_node() -> None:
    core = PlannerCore(NODES, "3P1D", silent_after=3.0)
    _states(core, 1.0, "w3")
    _states(core, 2.0, "w0", "w1", "w2")
    _states(core, 4.5, "w0", "w1", "w2")
    cmd = core.tick(4.5)
    assert cmd is not None and dict(cmd.phases) == {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "prefill"}


def test_no_swap_for_a_node_never_heard_and_both_phases_on_a_lone_live_node() -> None:
    late = PlannerCore(NODES, "1P3D", silent_after=3.0)  # w0 never reported (a cold start): it may be late
    _states(late, 8.0, "w1", "w2", "w3")
    _states(late, 9.0, "w1", "w2", "w3")
    assert late.tick(10.0) is None and late.command.epoch == 1
    alone = PlannerCore(NODES, "2P2D", silent_after=3.0)  # w0, w1 dead; decode keeps one live node only
    _states(alone, 1.0, "w0", "w1", "w2")
    _states(alone, 2.0, "w3")
    _states(alone, 4.5, "w3")
    assert alone.next_tick() == 4.0
    cmd = alone.tick(4.5)  # the outage rule (session 48; before, nothing: no prefill node until w0 or w1 came back)
    assert cmd is not None and cmd.epoch == 2
    assert dict(cmd.phases) == {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "both"}
    assert alone.next_tick() == 7.5  # checked: not 4.0 again (no busy loop); w3 silent at 7.5
    _states(alone, 5.0, "w2")  # w2 back (after 4 s): one state ends no outage (a flap would switch w3 twice)
    assert alone.next_tick() == 5.0 and alone.tick(5.0) is None
    cmds = []
    for k in range(1, 7):  # w2 back for good: once it has reported for 3 s, the 2P2D laid over w2, w3 as a swap
        t = 5.0 + 0.5 * k
        _states(alone, t, "w2", "w3")
        nxt = alone.next_tick()
        if nxt is not None and nxt <= t:
            cmds.append((t, alone.tick(t)))
    assert [t for t, c in cmds if c is not None] == [8.0]
    cmd = cmds[-1][1]  # w3 (serving both) takes prefill: one live node switches
    assert cmd is not None and dict(cmd.phases) == {"w0": "decode", "w1": "prefill", "w2": "decode", "w3": "prefill"}
    assert cmd.reason.endswith("w3 takes it from w0 (the outage split ends: a PD split again)")
    assert alone.outage is None


def test_the_first_nodes_back_after_a_stall_of_the_bus_take_no_phase() -> None:
    """A stall of the planner's bus silences every node; the decode nodes' states arrive first after
    it: they are comebacks, not steady, so prefill (w0, w1: a moment behind) is not taken from them."""
    core = PlannerCore(NODES, "2P2D", silent_after=3.0)
    _states(core, 1.0, *NODES)
    _states(core, 2.0, *NODES)
    assert core.tick(5.5) is None  # every node silent: nothing live
    _states(core, 6.0, "w2", "w3")
    assert core.tick(6.0) is None and core.command.epoch == 1
    _states(core, 6.2, "w0", "w1")
    assert core.tick(6.5) is None and core.command.epoch == 1


def test_nodes_back_first_after_a_stall_take_no_phase_even_once_steady() -> None:
    """A stall of the planner's bus (or of the planner's own loop: the queued states are then read
    at one ``now``) longer than ``silent_after``: the decode nodes' states come back first, and two
    of them (a busy node sends one every 0.05 wall s, a backlog holds many) make them steady before
    the prefill nodes' states arrive. They were not live when prefill went silent (their own run
    of states began after it), so they take nothing: before, w2 took prefill from w0 at 6.1 and
    the cluster switched two live nodes for a stall."""
    core = PlannerCore(NODES, "2P2D", silent_after=3.0)
    _states(core, 1.0, *NODES)
    _states(core, 2.0, *NODES)
    assert core.tick(5.5) is None  # every node silent: nothing live
    _states(core, 6.0, "w2", "w3")
    _states(core, 6.05, "w2", "w3")  # steady now (0.05 after their comeback)
    assert core.tick(6.1) is None and core.command.epoch == 1  # a policy tick: before, a swap
    backlog = PlannerCore(NODES, "2P2D", silent_after=3.0)
    _states(backlog, 2.0, *NODES)
    _states(backlog, 6.0, "w2", "w3")
    _states(backlog, 6.0, "w2", "w3")  # the planner's loop stalled: its backlog read at one now
    assert backlog.tick(6.0) is None and backlog.command.epoch == 1
    _states(backlog, 6.01, "w0", "w1")
    assert backlog.tick(6.5) is None and backlog.command.epoch == 1


def test_the_service_reads_silent_after_s_in_wall_seconds_on_the_cluster_clock() -> None:
    """``--silent-after-s`` is wall s; the core's ``now`` is the cluster clock (simulated s at
    ``--speedup``): at the demo's speedup 50 the core must count 3 wall s as 150 s, as the router's
    ``--fence-after-s`` (``fence_after_s * speedup``), or a node silent 0.06 wall s (one missed
    heartbeat is 1 wall s) would look dead and be swapped."""
    from types import SimpleNamespace

    from services.planner.config import PlannerConfig
    from services.planner.service import PlannerService
    from shared.clock import SimClock

    cfg = PlannerConfig(nodes=NODES, split="2P2D", speedup=50.0)
    svc = PlannerService(cfg, SimpleNamespace(boot=""), SimClock(50.0))  # type: ignore[arg-type]
    assert cfg.silent_after_s == 3.0
    assert svc.core.silent_after == pytest.approx(150.0) and svc.core.wall_per_s == pytest.approx(0.02)


def test_the_planner_has_one_boot_for_its_heartbeats_and_its_split_commands():
    """Two planners of one instance started at almost the same moment: with a boot of its own for
    ``SplitCommand`` beside its bus's for heartbeats, each could be the older on one check and both
    would stop. The core takes the bus's boot."""
    from types import SimpleNamespace

    from services.planner.config import PlannerConfig
    from services.planner.service import PlannerService
    from shared.clock import SimClock

    boot = "1796403068366000000-0a0b0c0d"
    svc = PlannerService(PlannerConfig(nodes=NODES, split="2P2D"), SimpleNamespace(boot=boot), SimClock(1.0))  # type: ignore[arg-type]
    assert svc.core.boot == boot
