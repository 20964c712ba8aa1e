"""An abort that reaches a worker before the work it aborts, live: an in-process worker on a real
nats-server, a sim engine whose forward waits at a gate in the execute thread.

Work of a newer attempt of a request the engine step in flight runs waits for that step to end
(``requests.waited_for_step``); the node's prefill handler, one at a time, holds every later prefill
message behind it. An abort that the router sends meanwhile (the client went away) found the
request nowhere on the node (``aborts.unknown``) and was forgotten, so the work taken after the wait
ran to its last token for nobody (its KV held, its GPU time spent). The same held for an abort that
overtook its work on the bus (two subscriptions: nothing orders their handlers).
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import AsyncExitStack
from typing import Any

import pytest

from shared import messages as m
from shared.hashing import block_hashes, tokens_for_blocks
from shared.subjects import WORK_ABORT, WORK_PREFILL
from services.worker.config import WorkerConfig
from services.worker.engines.sim import SimEngine
from services.worker.plan import IterationPlan
from services.worker.service import WorkerService
from tests.integration.live import Services, node_states, open_bus, token_chunks, worker_factory
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(60)


class GatedSim(SimEngine):
    """The first forward waits at ``gate`` in the execute thread (as a torch forward in flight)."""

    threaded = True

    def __init__(self, profile: Any) -> None:
        super().__init__(profile)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def execute(self, plan: IterationPlan) -> float:
        if not self.entered.is_set():
            self.entered.set()
            self.gate.wait(20)
        return super().execute(plan)


def prefill(rid: str, attempt: int) -> m.PrefillWork:
    return m.PrefillWork(rid=rid, attempt=attempt, prompt_tokens=9, max_tokens=30, block_size=4,
                         block_hashes=block_hashes(tokens_for_blocks([1, 2], 4), 4))  # fmt: skip


@pytest.mark.parametrize("order", ["abort while the work waits for the step", "abort before the work"])
async def test_an_abort_that_comes_before_its_work_is_taken_drops_the_work(nats_url, order: str):
    held: list[WorkerService] = []
    cfg = WorkerConfig(nats_url=nats_url, node="w0", phase="both", profile="tiny", split_get_timeout_s=0.0,
                       idle_state_interval_s=0.1)  # fmt: skip
    async with AsyncExitStack() as stack:
        bus = await open_bus(stack, nats_url)
        chunks = await token_chunks(bus)
        states = await node_states(bus)
        Services(stack).start("worker", cfg, worker_factory(GatedSim, held=held), instance="worker-w0")
        stack.callback(lambda: held and held[0].engine.gate.set())  # type: ignore[attr-defined]  # before the stop: the step ends
        await until(lambda: "w0" in states, 10.0, "w0 up")
        svc = held[0]
        engine = svc.engine
        assert isinstance(engine, GatedSim)
        # the step in flight runs attempt 0 of x; the router fenced the node and sent x here again (attempt 1)
        await bus.publish(WORK_PREFILL, prefill("x", 0), node="w0")
        assert await asyncio.to_thread(engine.entered.wait, 5.0), "the step did not start"
        await bus.publish(WORK_PREFILL, prefill("x", 1), node="w0")
        await until(lambda: svc.counters["requests.waited_for_step"] == 1, 5.0, "attempt 1 waits for the step")
        if order == "abort while the work waits for the step":
            # the client went away: the router aborts attempt 1, which the node does not hold yet
            await bus.publish(WORK_ABORT, m.RequestAbort(rid="x", reason="client went away", attempt=1), node="w0")
            await until(lambda: svc.counters["aborts.unknown"] == 1, 5.0, "the abort handled")
        else:
            # y's work waits behind x's in the node's prefill handler; y's abort overtakes it
            await bus.publish(WORK_PREFILL, prefill("y", 0), node="w0")
            await bus.publish(WORK_ABORT, m.RequestAbort(rid="y", reason="client went away"), node="w0")
            await until(lambda: svc.counters["aborts.unknown"] == 1, 5.0, "the abort handled")
        engine.gate.set()
        gone = "x" if order == "abort while the work waits for the step" else "y"
        await until(lambda: svc.counters["requests.received"] == (3 if gone == "y" else 2) and svc.core.idle, 10.0,
                    "the node has taken everything and is idle")  # fmt: skip
        ran = [c for c in chunks[gone] if c.attempt == (1 if gone == "x" else 0) and c.token_ids]
        assert not ran, f"aborted work of {gone} ran for nobody: {sum(len(c.token_ids) for c in ran)} tokens"
        # the check above reads the recorded chunks: work nobody aborted streams all its tokens into them
        await bus.publish(WORK_PREFILL, prefill("z", 0), node="w0")
        await until(lambda: sum(len(c.token_ids) for c in chunks.get("z", ())) == 30, 10.0, "z's 30 tokens recorded")
        assert svc.counters["requests.aborted_before_arrival"] == 1
        assert svc.fatal_error is None
