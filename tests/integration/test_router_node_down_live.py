"""A worker's process exits (``kill -9``) under ``evolving-infra up``: the launcher tells the routers at once
(``node.down.<node>``, ``LocalCluster._announce_downs``) and the router fences the node and re-dispatches its
requests without waiting for ``--fence-after-s`` of state silence (real nats-server, the router's service, nodes
played by ``FakeCluster`` of ``test_router_live``; ``up``'s own announce with a real ``LocalCluster`` pass)."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

import structlog

from evolving_infra.cluster import ClusterSpec, LocalCluster, _Child
from shared import messages as m
from shared.auth import generate
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import NODE_DOWN, NODE_STATE, Subjects
from tests.integration.test_router_live import BS, _wait_for, router_env

pytestmark = pytest.mark.timeout(60)

FENCE_AFTER_S = 10.0
"""The router's --fence-after-s here: a silence fence would come only after it."""

WITHIN_S = 3.0
"""How soon the request on the dead node must complete once its process exited (well below ``FENCE_AFTER_S``)."""


async def test_a_request_on_a_node_whose_process_exited_is_re_dispatched_at_up_s_word(nats_server, tmp_path):
    """``c0`` and ``c1`` (collocated) answer nothing at first; a request lands on one of them, which then dies (its
    states stop). ``up``'s supervision pass sees the exit (a real ``LocalCluster`` whose child ``worker-<node>`` was
    SIGKILLed) and announces it: the router fences the node, the request goes to the other node and completes within
    ``WITHIN_S``. Before, it waited for ``FENCE_AFTER_S`` of silence (no node.down: the wait ran out)."""
    async with router_env(nats_server.url, tmp_path, {"c0": "both", "c1": "both"}, fence_after_s=FENCE_AFTER_S) as env:
        svc = env.service
        env.cluster.answering.clear()
        req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [5] * 70, "max_tokens": 4}))
        await _wait_for(lambda: len(env.cluster.works) == 1, what="the request's work on a node")
        rid = env.cluster.works[0].rid
        victim = svc.core.view.placement(rid)[0]
        other = "c1" if victim == "c0" else "c0"
        env.cluster.answering.add(other)
        env.cluster.alive.discard(victim)  # no more states from it

        launcher = await Bus.connect(nats_server.url, Subjects("p0"), service="launcher", instance="launcher")
        up = LocalCluster(ClusterSpec(restart=True, restart_backoff_s=5.0, liveness_timeout_s=0.0))
        up.log_dir = tmp_path
        child = _Child(f"worker-{victim}", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "w.log")
        up.children = [child]
        up._spawn(child)
        up._bus = launcher
        try:
            assert child.proc is not None
            child.proc.kill()  # kill -9 of the worker
            child.proc.wait()
            killed = time.monotonic()
            up.supervise_once()  # sees the exit, schedules the restart (5 s backoff) and notes the node's exit
            await up._announce_downs()
            r = await asyncio.wait_for(req, FENCE_AFTER_S + 5)
            took = time.monotonic() - killed
            st = await env.stats()
        finally:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
            if child.log_file is not None:
                child.log_file.close()
            await launcher.close()
    assert r.status_code == 200 and r.headers["x-ei-prefill-node"] == other, (r.status_code, r.text, dict(r.headers))
    assert took <= WITHIN_S, f"the request on the dead node completed {took:.2f} s after its process exited"
    c = st.counters
    assert c["node_down.fenced"] == 1 and c["fenced"] == 1, c


async def test_a_node_down_on_another_node_s_subject_or_from_a_later_process_fences_nothing(nats_server, tmp_path):
    """A ``NodeDown`` naming ``c0`` on ``node.down.c1`` is dropped (invalid: its node is not the subject's), and one
    for ``c0`` whose exit is older than the process reporting now (a late notice) fences nothing."""
    async with router_env(nats_server.url, tmp_path, {"c0": "both", "c1": "both"}, fence_after_s=FENCE_AFTER_S) as env:
        svc = env.service
        view = svc.core.view
        await _wait_for(lambda: "c0" in view.nodes and "c1" in view.nodes, what="both nodes' states")
        env.cluster.alive.discard("c0")  # c0's states from here on are this test's (a process with a boot)
        boot = m.new_boot(time.time_ns(), b"\x01")
        st = m.NodeState(node="c0", phase="both", epoch=1, block_size=BS, gpu_free_blocks=100, gpu_total_blocks=100,
                         seq=10**6, boot=boot)  # fmt: skip
        await env.bus.publish(NODE_STATE, st, node="c0")
        await _wait_for(lambda: view.nodes["c0"].state is not None and view.nodes["c0"].state.boot == boot, what="c0's state with a boot")
        await env.bus.publish_raw("ei.p0.node.down.c1", m.encode(m.NodeDown(node="c0", exited_ns=time.time_ns())))
        await env.bus.publish(NODE_DOWN, m.NodeDown(node="c0", exited_ns=time.time_ns() - 60 * 10**9), node="c0")
        await _wait_for(lambda: svc.counters["node_down.later_process"] == 1, what="the late notice")
        stats = await env.stats()
    c = stats.counters
    assert c.get("node_down.fenced", 0) == 0 and c.get("fenced", 0) == 0, c
    assert c["invalid.node.down.{node}"] == 1, c



async def test_a_node_down_naming_another_pid_fences_nothing_and_one_naming_the_node_s_pid_does(nats_server, tmp_path):
    """``c0`` reports as process pid 4242; a notice for ``c0`` names pid 4343 with an exit time after c0's start (a
    wrong pid, another ``up`` on one NATS): nothing is fenced (``node_down.other_pid``), c0 stays eligible and a request
    still lands there. Before, the exit time alone decided: c0 was fenced and its states skipped for the router's
    life. A notice naming 4242 fences it; a process with another pid whose boot says it started BEFORE that exit (the
    wall clock stepped back) is let in at its first state."""
    async with router_env(nats_server.url, tmp_path, {"c0": "both", "c1": "both"}, fence_after_s=FENCE_AFTER_S) as env:
        svc = env.service
        view = svc.core.view
        await _wait_for(lambda: "c0" in view.nodes and "c1" in view.nodes, what="both nodes' states")
        env.cluster.alive.discard("c0")  # c0's states from here on are this test's (a process with a pid and a boot)
        env.cluster.alive.discard("c1")  # the request can only go to c0
        started = time.time_ns()

        async def report(pid: int, boot: str, seq: int) -> None:
            st = m.NodeState(node="c0", phase="both", epoch=1, block_size=BS, gpu_free_blocks=100, gpu_total_blocks=100,
                             seq=seq, boot=boot, pid=pid)  # fmt: skip
            await env.bus.publish(NODE_STATE, st, node="c0")
            await _wait_for(lambda: (s := view.nodes["c0"].state) is not None and (s.pid, s.seq) == (pid, seq), what=f"c0's state {seq}")

        live = m.new_boot(started, b"\x01")
        await report(4242, live, 10**6)
        await env.bus.publish(NODE_DOWN, m.NodeDown(node="c0", pid=4343, exited_ns=time.time_ns()), node="c0")
        await _wait_for(lambda: svc.counters["node_down.other_pid"] == 1, what="the other pid's notice")
        await report(4242, live, 10**6 + 1)
        assert view.eligible(view.nodes["c0"], 0.0), view.snapshot(0.0)
        env.cluster.answering.add("c0")
        r = await env.http.post("/v1/completions", json={"prompt": [5] * 70, "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-ei-prefill-node"] == "c0", (r.status_code, r.text)
        await env.bus.publish(NODE_DOWN, m.NodeDown(node="c0", pid=4242, exited_ns=time.time_ns()), node="c0")
        await _wait_for(lambda: svc.counters["node_down.fenced"] == 1, what="the notice naming c0's pid")
        assert view.nodes["c0"].fenced
        await report(4444, m.new_boot(started - 10**9, b"\x02"), 1)  # the restart; by the clock before c0's start
        await _wait_for(lambda: not view.nodes["c0"].fenced, what="c0's restart let in")
        stats = await env.stats()
    c = stats.counters
    assert c["node_down.other_pid"] == 1 and c["node_down.fenced"] == 1 and c["fenced"] == 1 and c["unfenced"] == 1, c
    assert c.get("states_superseded", 0) == 0, c


async def test_nats_refuses_node_down_from_a_non_launcher_identity_and_up_says_so(tmp_path):
    """Per-identity permissions (``auth gen``'s table): a worker's identity may not publish ``node.down.<node>``; the
    router never sees it. ``up``'s announce through a bus whose credentials lack it (as those of an ``auth gen`` from
    before node.down) logs a warning naming the refusal and ``evolving-infra auth gen``, not "told the routers";
    with the launcher's identity the router gets it and ``up`` says it told them. Before, "told the routers" at info
    either way (the refusal is an asynchronous -ERR, no publish error)."""
    creds = generate(tmp_path / "creds", ["worker-w0", "router"])
    with EmbeddedNatsServer(auth_block=creds.server_block) as srv:
        subs = Subjects("p0")
        router = await Bus.connect(srv.url, subs, service="router", instance="router", auth=creds.auth_for("router"))
        got: list[m.NodeDown] = []

        async def heard(msg: m.NodeDown, _s: str) -> None:
            got.append(msg)

        await router.subscribe(NODE_DOWN, heard)
        await router.flush()
        buses = {name: await Bus.connect(srv.url, subs, service=name.split("-")[0], instance=name, auth=creds.auth_for(name))
                 for name in ("worker-w0", "launcher")}  # fmt: skip
        up = LocalCluster(ClusterSpec())
        try:
            logs = {}
            for name, bus in buses.items():
                up._bus = bus
                up._downs.append(m.NodeDown(node="w0", pid=77, exited_ns=time.time_ns(), code=-9))
                with structlog.testing.capture_logs() as logs[name]:
                    await up._announce_downs()
            await router.flush()
            await _wait_for(lambda: len(got) == 1, what="the launcher's notice")
            await asyncio.sleep(0.3)  # a refused one would have come by now
        finally:
            for bus in buses.values():
                await bus.close()
            await router.close()
    assert [d.pid for d in got] == [77] and got[0].src == "launcher", got
    refused = [e for e in logs["worker-w0"] if e["event"].startswith("NATS refused")]
    assert len(refused) == 1 and refused[0]["log_level"] == "warning" and "evolving-infra auth gen" in refused[0]["event"], logs
    assert not any(e["event"].startswith("told the routers") for e in logs["worker-w0"]), logs
    assert [e["event"] for e in logs["launcher"]] == ["told the routers that a worker exited (node.down)"], logs
