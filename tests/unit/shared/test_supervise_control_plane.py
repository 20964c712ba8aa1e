"""The supervisor's crash-loop decision for the control plane, on real child processes (``sleep``) and a fake clock
(``supervise_once(now)``): past ``max_restarts`` within ``restart_window_s`` a service whose absence serving survives
is left down (one error line saying what no longer adapts, ``left_down`` in ``describe()``, tried again after the
window), as workers were since session 55: the planner (the split stays frozen; the routers route by the phases the
workers report), the KV directory (each ``kv.lookup`` fails at once: the router routes without cache information), a
router beside another one (they serve one socket). Before, any of those stopped the whole cluster (status 1), every
healthy worker's requests with it. What serving does not survive still stops it, with the reason in the error: the
last router, the planner or a worker when the running workers would leave prefill or decode without a node.

A worker restarted meanwhile gets the phase its node last applied as its ``--phase`` (without the planner its
``split.get`` gets no answer and it serves ``--phase``: before, its launch phase, which changed the frozen split)."""

from __future__ import annotations

import re

import pytest

from evolving_infra.cluster import ClusterError, ClusterSpec, LocalCluster, _Child, m
from evolving_infra.report.timeline import TimelineRecorder
from shared.split import split_phases


def _cluster(tmp_path, names: list[str], **kw) -> LocalCluster:
    """A supervised cluster of ``sleep`` processes named ``names`` (nodes w0 prefill, w1 decode: ``1P1D``)."""
    spec = dict(restart=True, restart_backoff_s=0.5, stable_s=60.0, liveness_timeout_s=0.0, ready_timeout_s=60.0,
                nodes=2, split="1P1D", max_restarts=1, restart_window_s=600.0)  # fmt: skip
    c = LocalCluster(ClusterSpec(**{**spec, **kw}))
    c.log_dir = tmp_path
    c.children = [_Child(n, ["sleep", "300"], tmp_path / f"{n}.log") for n in names]
    for child in c.children:
        c._spawn(child)
    return c


def _end(child: _Child) -> None:
    """Kill the running process; its exit reads as a crash (SIGKILL)."""
    assert child.proc is not None
    child.proc.kill()
    child.proc.wait()


def _close(c: LocalCluster) -> None:
    for child in c.children:
        if child.proc is not None:
            child.proc.kill()
            child.proc.wait()
        if child.log_file is not None:
            child.log_file.close()


def _crash_past_the_limit(c: LocalCluster, child: _Child, t: float) -> float:
    """Crash ``child`` and restart it until its next exit is past ``max_restarts``; returns the time of that exit's
    pass (the caller runs it)."""
    for _ in range(c.spec.max_restarts):
        _end(child)
        c.supervise_once(t)
        assert child.restart_at is not None
        t = child.restart_at
        assert child.name in c.supervise_once(t)
    _end(child)
    return t


def _named(c: LocalCluster, name: str) -> _Child:
    return next(x for x in c.children if x.name == name)


@pytest.mark.parametrize(
    ("name", "effect"),
    [
        ("planner", r"the split is frozen at 1P1D .*while the routers and workers serve on"),
        ("kvdirectory", r"the routers route without KV-cache information .*while serving goes on"),
    ],
)
def test_a_crash_looping_control_plane_service_is_left_down_and_tried_again_after_the_window(tmp_path, capsys, name, effect):
    """Before: ``ClusterError("planner exited 2 times in 600 s ...; giving up")``, the cluster stopped."""
    c = _cluster(tmp_path, ["kvdirectory", "planner", "worker-w0", "worker-w1", "router"])
    svc = _named(c, name)
    downs: list[str] = []
    c.on_down = downs.append
    try:
        t = _crash_past_the_limit(c, svc, svc.started_at)
        assert c.supervise_once(t) == []  # no ClusterError: left down
        assert svc.left_down and downs == [name] and c.left_down() == [name]
        assert c.describe()["left_down"] == [name] and name not in c.pids()
        assert svc.restart_at == pytest.approx(t + 600.0)
        out = capsys.readouterr().out
        assert re.search(rf"{name} exited 2 times in 600 s \(last: killed by signal 9 \(SIGKILL\)\); left down, {effect}; "
                         r"trying it again in 600 s", out), out  # fmt: skip
        assert re.search(effect, c.down_effect(name)) and c.down_effect("router") == ""
        assert c.supervise_once(t + 599.0) == []
        assert c.supervise_once(t + 600.0) == [name]  # tried again: its exits now lie outside the window
        assert not svc.left_down and c.left_down() == [] and c.down_effect(name) == "" and name in c.pids()
    finally:
        _close(c)


def test_the_frozen_split_named_is_the_one_the_workers_last_applied(tmp_path):
    """The left-down line names the split the workers serve (``split.applied``), not the launch's ``--split``: in the
    evolving planner's warm-up every node serves both ("collocated")."""
    c = _cluster(tmp_path, ["planner", "worker-w0", "worker-w1", "router"])
    c.recorder = TimelineRecorder(split_phases("1P1D", ["w0", "w1"]))
    for node in ("w0", "w1"):
        c.recorder.on_applied(m.SplitApplied(epoch=2, node=node, phase="both", status="serving", applied_at=1.0))
    planner = _named(c, "planner")
    try:
        t = _crash_past_the_limit(c, planner, planner.started_at)
        assert c.supervise_once(t) == [] and planner.left_down
        assert c.down_effect("planner").startswith("the split is frozen at collocated ")
    finally:
        _close(c)


def test_a_router_is_left_down_only_beside_another_router(tmp_path):
    """``--routers 2``: one router's crash loop leaves it down, the other serves the port ``up`` holds; the last one
    running stops the cluster, the error saying why (before: both stopped it, with no reason)."""
    c = _cluster(tmp_path, ["planner", "worker-w0", "worker-w1", "router", "router-1"])
    r0, r1 = _named(c, "router"), _named(c, "router-1")
    try:
        t = _crash_past_the_limit(c, r1, r1.started_at)
        assert c.supervise_once(t) == [] and r1.left_down and c.down_effect("router-1") == "the other routers serve on the same port"
        t = _crash_past_the_limit(c, r0, t + 1.0)
        with pytest.raises(ClusterError, match=r"router exited 2 times in 600 s .*giving up \(no other router process runs: "
                           r"nothing would answer on the router port\)") as e:  # fmt: skip
            c.supervise_once(t)
        assert e.value.service == "router" and not r0.left_down
        assert e.value.reason.endswith("restarts gave up) (no other router process runs: nothing would answer on the router port)")
    finally:
        _close(c)


def test_with_the_planner_left_down_a_worker_is_left_down_only_while_both_phases_are_served(tmp_path):
    """Nothing lays the split again without the planner: the prefill worker of ``1P1D`` left down would leave every
    request without a prefill node, so its crash loop stops the cluster, the reason in the error. With the planner
    running (in its backoff too) it is left down as before (the planner lays the split over w1)."""
    c = _cluster(tmp_path, ["planner", "worker-w0", "worker-w1", "router"])
    planner, w0 = _named(c, "planner"), _named(c, "worker-w0")
    try:
        t = _crash_past_the_limit(c, planner, planner.started_at)
        assert c.supervise_once(t) == [] and planner.left_down
        t = _crash_past_the_limit(c, w0, t + 1.0)
        with pytest.raises(ClusterError, match=r"worker-w0 exited 2 times in 600 s .*giving up \(no other running worker "
                           r"serves prefill and the planner is down, so nothing would lay the split over the workers left\)"):  # fmt: skip
            c.supervise_once(t)
    finally:
        _close(c)
    c = _cluster(tmp_path, ["planner", "worker-w0", "worker-w1", "router"])
    planner, w0 = _named(c, "planner"), _named(c, "worker-w0")
    try:
        _end(planner)  # dead, in its backoff: it comes back and lays the split over w1
        c.supervise_once(planner.started_at)
        t = _crash_past_the_limit(c, w0, planner.started_at)
        c.supervise_once(t)
        assert w0.left_down and not planner.left_down
    finally:
        _close(c)


def test_the_planner_is_not_left_down_while_the_running_workers_leave_a_phase_without_a_node(tmp_path):
    """w0 (the only prefill node) left down and the planner crash-looping before it laid the split over w1: without it
    no request would be prefilled, so the cluster stops, saying why."""
    c = _cluster(tmp_path, ["planner", "worker-w0", "worker-w1", "router"])
    planner, w0 = _named(c, "planner"), _named(c, "worker-w0")
    try:
        t = _crash_past_the_limit(c, w0, w0.started_at)
        assert c.supervise_once(t) == [] and w0.left_down
        t = _crash_past_the_limit(c, planner, t + 1.0)
        with pytest.raises(ClusterError, match=r"planner exited 2 times in 600 s .*giving up \(no running worker serves "
                           r"prefill, and only the planner would lay the split again\)"):  # fmt: skip
            c.supervise_once(t)
    finally:
        _close(c)


def test_a_restarted_worker_gets_the_phase_its_node_last_applied(tmp_path):
    """Before, a restart reused the launch's ``--phase decode``: with the planner down (no ``split.get`` answer) w1 came
    back decode-only in a collocated warm-up."""
    c = _cluster(tmp_path, ["planner", "worker-w0", "worker-w1", "router"])
    w1 = _named(c, "worker-w1")
    w1.argv = ["sh", "-c", "sleep 300", "sh", "--node", "w1", "--phase", "decode", "--stream-interval", "1"]
    c.recorder = TimelineRecorder(split_phases("1P1D", ["w0", "w1"]))
    c.recorder.on_applied(m.SplitApplied(epoch=2, node="w1", phase="both", status="serving", applied_at=1.0))
    try:
        _end(w1)
        c.supervise_once(w1.started_at)
        assert w1.restart_at is not None and c.supervise_once(w1.restart_at) == ["worker-w1"]
        assert w1.argv == ["sh", "-c", "sleep 300", "sh", "--node", "w1", "--phase", "both", "--stream-interval", "1"]
        assert w1.proc is not None and w1.proc.poll() is None
        assert _named(c, "router").argv == ["sleep", "300"]
    finally:
        _close(c)
