"""A switch whose ``split.applied(serving)`` NATS refuses, live (one worker in this process, a real
nats-server; the refusal is injected through the worker's own bus).

The node serves its new phase all the same, and the announcement goes out again until NATS takes
it, so the planner (which ends a node's busy period on ``serving``) learns of it. Before, the two
paths differed and neither announced it: from the step loop (a switch that drained a running
request) the ``BusUnavailable`` ended the node as any step error (``node_fatal``); from the split
handler (an idle node) it was only logged by the bus and ``serving`` was never announced.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest

from shared import messages as m
from shared.clock import SimClock
from shared.hashing import block_hashes, tokens_for_blocks
from shared.subjects import SPLIT_COMMANDS, WORK_PREFILL
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from tests.integration.live import Services, node_states, open_bus, refusing_split_applied, split_applied
from tests.integration.polling import until

from .test_dataplane_bind import SLOW_PREFILL

pytestmark = pytest.mark.timeout(60)
BS = 4


@pytest.mark.parametrize("path", ["step", "handler"], ids=["drained in the step loop", "idle: split handler"])
async def test_a_refused_serving_announcement_is_not_fatal_and_goes_out_again(nats_url, tmp_path: Path, path: str):
    profile = tmp_path / "slow.toml"
    profile.write_text(SLOW_PREFILL)
    origin = time.time()
    clock = SimClock(1.0, origin)
    refused: list[m.SplitApplied] = []
    held: list[WorkerService] = []

    async with AsyncExitStack() as stack:
        bus = await open_bus(stack, nats_url, "test-announce")
        states = await node_states(bus)
        applied = await split_applied(bus)
        cfg = WorkerConfig(nats_url=nats_url, clock_origin=origin, node="w0", phase="both", profile=str(profile),
                           idle_state_interval_s=0.1, state_interval_s=0.01, split_get_timeout_s=0.0, check_invariants=True)  # fmt: skip
        task = Services(stack).start("worker", cfg, refusing_split_applied(refused, held, "serving"), instance="worker-w0")
        await until(lambda: "w0" in states, 10.0, "w0 up")
        if path == "step":  # a prefill runs (≈ 0.2 s): the switch drains it, the step loop then serves decode
            work = m.PrefillWork(rid="r1", prompt_tokens=100, max_tokens=2, block_size=BS,
                                 block_hashes=block_hashes(tokens_for_blocks(list(range(25)), BS), BS))  # fmt: skip
            await bus.publish(WORK_PREFILL, work, node="w0")
            await until(lambda: states["w0"].running == 1, 10.0, "w0 runs the prefill")
        await bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=1, phases={"w0": "decode", "w1": "prefill"}, reason="to decode", decided_at=clock.now()))
        await until(lambda: bool(refused), 5.0, "the serving announcement refused")
        await until(lambda: any(a.status == "serving" for a in applied) or task.done(), 3.0, "serving announced again")
        await until(lambda: states["w0"].phase == "decode" and states["w0"].accepting, 2.0, "w0 heartbeats serving decode")
    svc = held[0]
    assert svc.fatal_error is None and svc.counters.get("node_fatal", 0) == 0, svc.fatal_error
    want = ([("draining", "decode")] if path == "step" else []) + [("serving", "decode")]
    assert [(a.status, a.phase) for a in applied] == want, applied
    [again] = [a for a in applied if a.status == "serving"]
    assert msgspec.structs.replace(again, src="") == refused[0]  # the same announcement (switch_s, drain), not a new one
    assert svc.counters["split.announce_failed"] == 1 and svc.counters["split.announce_retried"] == 1
    assert svc.core.phase == "decode" and svc.epoch == 1
