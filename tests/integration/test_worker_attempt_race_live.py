"""Bus handlers that change the engine's view of a request while the engine step holding it has
been planned (``schedule()``) but its execute thread has not taken the engine's lock yet, live
(real nats-server, the torch engine on CPU, one process).

In that window the event loop runs handlers (the step awaits a publish and the thread hand-off).
Two of them broke the engine's registration of a request the plan still runs: a newer attempt of
it (the router re-dispatched the request to this node) registered its work over the old one, so
the plan computed the old chunk into the new registration; and an abort of it followed by a KV
drain in another handler (a hand-off's arrival, a ``kv.resync``) let the engine forget it (gc).
Either way the engine's page map no longer matched the plan (``KvMapError``) and the node exited.
Now a newer attempt is registered once the step holding the old one ended, and a KV drain keeps
the registrations of the step in flight. The window is widened here by a gate the first gated
plan's execute thread waits at before it takes the lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import pytest

torch = pytest.importorskip("torch")

from shared import messages as m  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.subjects import KV_RESYNC, WORK_ABORT, WORK_PREFILL  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.engines.torch_engine.engine import TorchEngine  # noqa: E402
from services.worker.plan import IterationPlan  # noqa: E402
from services.worker.service import WorkerService  # noqa: E402
from tests.integration.live import Services, node_states, open_bus, token_chunks  # noqa: E402
from tests.integration.polling import until  # noqa: E402
from tests.unit.worker.torch_tiny import prompt, work, write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class GatedEngine(TorchEngine):
    """The first plan ``arm`` accepts waits, in its execute thread, at ``gate`` before it takes the lock."""

    arm: Callable[[IterationPlan], bool]
    entered: threading.Event
    gate: threading.Event

    def execute(self, plan: IterationPlan) -> float:
        if not self.entered.is_set() and self.arm(plan):
            self.entered.set()
            self.gate.wait(20)
        return super().execute(plan)


class Node:
    def __init__(self, bus: Bus, svc: WorkerService, task: asyncio.Task[None], chunks: dict[str, list[m.TokenChunk]]) -> None:
        self.bus, self.svc, self.task, self.chunks = bus, svc, task, chunks


async def gated_node(stack: AsyncExitStack, nats_url: str, tmp_path: Path, arm: Callable[[IterationPlan], bool]) -> tuple[Node, GatedEngine]:
    folder = write_tiny_llama(tmp_path / "model")
    held: list[WorkerService] = []

    def make(c: WorkerConfig, b: Bus, clk: Any) -> WorkerService:
        svc = WorkerService(c, b, clk)
        svc.engine.__class__ = GatedEngine
        svc.engine.arm, svc.engine.entered, svc.engine.gate = arm, threading.Event(), threading.Event()  # type: ignore[attr-defined]
        held.append(svc)
        return svc

    bus = await open_bus(stack, nats_url)
    chunks = await token_chunks(bus)
    states = await node_states(bus)
    cfg = WorkerConfig(nats_url=nats_url, node="w0", phase="both", profile="torch-tiny-cpu", engine="torch", model=folder,
                       split_get_timeout_s=0.0, idle_state_interval_s=0.1, check_invariants=True)  # fmt: skip
    task = Services(stack).start("worker", cfg, make, instance="worker-w0")
    stack.callback(lambda: held and held[0].engine.gate.set())  # type: ignore[attr-defined]  # before the stop: the step ends
    await until(lambda: "w0" in states, 60.0, "w0 up")
    engine = held[0].engine
    assert isinstance(engine, GatedEngine)
    return Node(bus, held[0], task, chunks), engine


async def test_handlers_in_the_window_between_schedule_and_the_engine_lock_leave_the_planned_request_alone(nats_url, tmp_path: Path):
    arm: list[Callable[[IterationPlan], bool]] = [lambda plan: any(c.rid == "r" for c in plan.prefill)]
    async with AsyncExitStack() as stack:
        node, engine = await gated_node(stack, nats_url, tmp_path, lambda plan: arm[0](plan))
        # 1. the router fenced this node and re-dispatched the request here again (attempt 2)
        w1 = work("r", prompt(3, 29), n=4)
        await node.bus.publish(WORK_PREFILL, w1, node="w0")
        assert await asyncio.to_thread(engine.entered.wait, 10.0), "the step did not start"
        await node.bus.publish(WORK_PREFILL, msgspec.structs.replace(w1, attempt=2), node="w0")
        await until(lambda: node.svc.counters["requests.superseded"] == 1, 5.0, "attempt 2 arrived")
        engine.gate.set()
        await until(lambda: node.task.done() or any(c.finished for c in node.chunks["r"]), 20.0, "attempt 2 finished or the node failed")
        assert not node.task.done() and node.svc.fatal_error is None, repr(node.svc.fatal_error)
        cs = node.chunks["r"]
        assert cs[-1].finished and cs[-1].finish_reason == "length", cs
        assert sum(len(c.token_ids) for c in cs) == 4 and all(c.attempt == 2 for c in cs)
        assert node.svc.counters["requests.waited_for_step"] == 1

        # 2. a client abort, then a KV drain in another handler (a resync here; a hand-off's arrival does the same)
        arm[0] = lambda plan: "d" in plan.decode
        engine.entered.clear()
        engine.gate.clear()
        await node.bus.publish(WORK_PREFILL, work("d", prompt(4, 29), n=200), node="w0")
        assert await asyncio.to_thread(engine.entered.wait, 10.0), "no decode step started"
        await node.bus.publish(WORK_ABORT, m.RequestAbort(rid="d", reason="client went away"), node="w0")
        await until(lambda: node.svc.counters["requests.aborted"] == 1, 5.0, "abort taken")
        await node.bus.request(KV_RESYNC, m.KvResyncRequest(node="w0", reason="test"), node="w0", timeout=5.0)
        engine.gate.set()
        await node.bus.publish(WORK_PREFILL, work("s", prompt(5, 29), n=3), node="w0")
        await until(lambda: node.task.done() or any(c.finished for c in node.chunks["s"]), 20.0, "s finished or the node failed")
        assert not node.task.done() and node.svc.fatal_error is None, repr(node.svc.fatal_error)
        assert node.chunks["d"][-1].finish_reason == "abort" and node.chunks["s"][-1].finish_reason == "length"
