"""A planner killed (SIGKILL) and started again adopts the split the cluster serves: every service
its own OS process over a real nats-server (``evolving_infra.faultkit.FaultCluster``: directory,
planner, router, four workers). The operator's ``evolving-infra split set 3P1D`` made before the
crash stays, under its epoch, and no node switches: the restarted planner announces nothing else,
no worker drains, ``split.get`` answers the operator's split. Before the adoption the restarted
planner re-issued its configured 2P2D above the nodes' epoch, and w2 drained back to decode."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from evolving_infra.faultkit import FaultCluster, FaultSpec
from shared import messages as m
from shared.bus import Bus, BusError
from shared.split import split_name
from shared.subjects import NODE_STATE, PLANNER_DECISIONS, SPLIT_APPLIED, SPLIT_COMMANDS, SPLIT_GET, SPLIT_SET, Subjects
from tests.integration.polling import until

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
NODES = ["w0", "w1", "w2", "w3"]


async def _split_get(bus: Bus, timeout_s: float) -> m.SplitCommand:
    """``split.get`` until the planner answers (a restarted one answers once it has adopted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await bus.request(SPLIT_GET, m.SplitQuery(), timeout=1.0)
        except BusError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_a_planner_killed_and_restarted_keeps_the_operators_split_and_switches_no_node(tmp_path):
    spec = FaultSpec(nodes=4, split="2P2D", speedup=50.0, idle_state_interval_s=0.25,
                     extra={"planner": ["--announce-interval-s", "0.5"]})  # fmt: skip
    async with FaultCluster(spec, tmp_path) as fc:
        bus = await Bus.connect(fc.nats_url, Subjects("p0"), service="test", instance="test")
        commands: list[m.SplitCommand] = []
        applied: list[m.SplitApplied] = []
        decisions: list[m.PlannerDecision] = []
        states: dict[str, m.NodeState] = {}

        async def on_cmd(msg, _s):
            commands.append(msg)

        async def on_applied(msg, _s):
            applied.append(msg)

        async def on_dec(msg, _s):
            decisions.append(msg)

        async def on_state(msg, _s):
            states[msg.node] = msg

        await bus.subscribe(SPLIT_COMMANDS, on_cmd)
        await bus.subscribe(SPLIT_APPLIED, on_applied)
        await bus.subscribe(PLANNER_DECISIONS, on_dec)
        await bus.subscribe(NODE_STATE, on_state)
        await bus.flush()  # the SUBs registered (nats-py's flush can PING ahead of them)
        try:
            first = await _split_get(bus, 30.0)
            assert first.epoch == 1 and split_name(first.phases) == "2P2D"  # a fresh cluster: the configured split

            # the operator's command, as a user runs it
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "evolving_infra.cli", "split", "set", "3P1D", "--nats-url", fc.nats_url,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
            )  # fmt: skip
            out, err = await p.communicate()
            assert p.returncode == 0 and "epoch 2: 3P1D" in out.decode(), (out, err)
            await until(
                lambda: all(n in states and states[n].epoch == 2 and states[n].accepting for n in NODES) and states["w2"].phase == "prefill",
                30.0, "every node serving the operator's 3P1D at epoch 2",
            )  # fmt: skip
            switches_before = {n: (await fc.stats(f"worker-{n}")).counters.get("split.switches", 0) for n in NODES}
            assert switches_before["w2"] == 1

            fc.signal("planner", signal.SIGKILL)
            commands.clear()
            applied.clear()
            decisions.clear()
            fc.restart("planner")
            again = await _split_get(bus, 30.0)
            assert again.epoch == 2 and split_name(again.phases) == "3P1D", again
            await asyncio.sleep(2.0)  # four announcements (0.5 s) and eight worker states (0.25 s) later

            assert commands, "the restarted planner announced nothing"
            assert {(c.epoch, split_name(c.phases)) for c in commands} == {(2, "3P1D")}, commands
            assert [d.action for d in decisions] == ["adopt"], decisions
            assert not [a for a in applied if a.status == "draining"], applied
            assert {n: s.phase for n, s in states.items()} == {"w0": "prefill", "w1": "prefill", "w2": "prefill", "w3": "decode"}
            assert all(s.epoch == 2 and s.accepting for s in states.values()), states
            switches_after = {n: (await fc.stats(f"worker-{n}")).counters.get("split.switches", 0) for n in NODES}
            assert switches_after == switches_before
            planner = await fc.stats("planner")
            assert planner is not None and planner.counters["split_epoch"] == 2 and planner.counters["split.adoptions"] == 1
            assert planner.counters["split.foreign"] == 0 and planner.counters["switches"] == 0

            # the operator's next split goes above the adopted epoch, and the nodes follow it
            reply = await bus.request(SPLIT_SET, m.SplitSetRequest(split="2P2D", reason="test"), timeout=5.0)
            assert reply.ok and reply.command.epoch == 3
            await until(lambda: states["w2"].epoch == 3 and states["w2"].phase == "decode" and states["w2"].accepting, 30.0, "w2 back to decode")
        finally:
            await bus.close()
