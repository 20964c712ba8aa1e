"""Work handed back during an in-place switch, live (router + three workers, one process, real nats-server).

w0 (prefill) has one prefill running and four queued when a split swaps it with
w2: w0 → decode, w2 → prefill. w0 hands the four back (``work.requeue``) and
finishes the running one in place; w2 is still draining a decode, so no node
serves prefill: the router parks the four until w2 reports serving prefill,
then places each exactly once there. Every request completes with all its
tokens; both switches report ``draining`` then ``serving`` with their drain.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest

from shared import messages as m
from shared.bus import Bus
from shared.clock import SimClock
from shared.hashing import block_hashes, tokens_for_blocks
from shared.subjects import (
    SPLIT_COMMANDS, SVC_STATS, WORK_ABORT, WORK_DECODE, WORK_PREFILL, WORK_REQUEUE,
)  # fmt: skip
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService

from tests.integration.live import Services, node_states, open_bus, refusing_split_applied, router_factory, split_applied, token_chunks
from tests.integration.polling import until

from .test_dataplane_bind import SLOW_PREFILL

pytestmark = pytest.mark.timeout(90)
BS = 4


async def watched_bus(
    stack: AsyncExitStack, nats_url: str, instance: str
) -> tuple[Bus, dict[str, m.NodeState], list[m.SplitApplied], defaultdict[str, list[m.TokenChunk]]]:
    """The test's bus, with each node's latest ``node.state``, every ``split.applied`` and every token chunk by request."""
    bus = await open_bus(stack, nats_url, instance)
    return bus, await node_states(bus), await split_applied(bus), await token_chunks(bus)


async def test_queued_work_is_handed_back_parked_and_served_exactly_once(nats_url, tmp_path: Path):
    profile = tmp_path / "slow.toml"
    profile.write_text(SLOW_PREFILL)
    origin = time.time()
    clock = SimClock(1.0, origin)
    port_file = tmp_path / "router.port"
    router: list[RouterService] = []
    async with AsyncExitStack() as stack:
        bus, states, applied, chunks = await watched_bus(stack, nats_url, "test-requeue")
        services = Services(stack)
        for node, phase in (("w0", "prefill"), ("w1", "decode"), ("w2", "decode")):
            cfg = WorkerConfig(nats_url=nats_url, clock_origin=origin, node=node, phase=phase, profile=str(profile),
                               idle_state_interval_s=0.2, state_interval_s=0.01, check_invariants=True)  # fmt: skip
            services.start("worker", cfg, WorkerService, instance=f"worker-{node}")
        rcfg = RouterConfig(nats_url=nats_url, clock_origin=origin, port=0, port_file=str(port_file), block_size=BS,
                            split_get_timeout_s=0.2, lookup_timeout_s=0.05, fence_after_s=5.0, request_timeout_s=30.0)  # fmt: skip
        services.start("router", rcfg, router_factory(router))
        await until(lambda: port_file.exists() and router and router[0].ready() and len(states) == 3, 15.0, "router ready")
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"

        # w2 decodes a long request: its switch to prefill must drain it first
        x = m.DecodeWork(rid="x-long", prompt_tokens=8, max_tokens=5_000, block_size=BS, block_hashes=[1, 2], prefill_node="w0")
        await bus.publish(WORK_DECODE, x, node="w2")
        await until(lambda: states["w2"].running == 1, 15.0, "w2 decoding")

        async def complete(i: int) -> httpx.Response:
            prompt = [(i * 1000 + k) % 40_000 for k in range(200)]  # ≈ 0.4 s of prefill each
            async with httpx.AsyncClient(timeout=30) as http:
                return await http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3})

        reqs = [asyncio.create_task(complete(i)) for i in range(5)]
        await until(lambda: states["w0"].running == 1 and states["w0"].waiting == 4, 15.0, "one prefill running, four queued on w0")
        await bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=1, phases={"w0": "decode", "w1": "decode", "w2": "prefill"},
                                                          reason="swap", decided_at=clock.now()))  # fmt: skip
        await until(lambda: router[0].counters.get("requeue.parked", 0) == 4, 15.0, "the four handed back and parked")
        assert not any(t.done() for t in reqs)
        await asyncio.sleep(0.3)
        await bus.publish(WORK_ABORT, m.RequestAbort(rid="x-long", reason="end the drain"), node="w2")
        responses = await asyncio.gather(*reqs)
        rstats = router[0].counters

        assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
        placed = [r.json()["ei"]["prefill_node"] for r in responses]
        assert sorted(placed) == ["w0"] + ["w2"] * 4  # the running one finished in place, the four moved
        for r in responses:
            rid = r.headers["x-request-id"]
            assert r.json()["usage"]["completion_tokens"] == 3
            cs = sorted(chunks[rid], key=lambda c: c.index)
            pos = 0
            for c in cs:  # every output position exactly once
                assert c.index == pos and c.finish_reason in (None, "length"), cs
                pos += len(c.token_ids)
            assert pos == 3 and [c.finished for c in cs] == [False] * (len(cs) - 1) + [True]
            assert len({c.node for c in cs if c.index == 0}) == 1
        assert rstats["requeue.prefill"] == 4 and rstats["requeue.rerouted"] == 4 and rstats["requeue.parked"] == 4
        w0 = [a for a in applied if a.node == "w0"]
        w2 = [a for a in applied if a.node == "w2"]
        assert [(a.status, a.phase) for a in w0] == [("draining", "decode"), ("serving", "decode")]
        assert [(a.status, a.phase) for a in w2] == [("draining", "prefill"), ("serving", "prefill")]
        assert w0[0].requeued == 4 and w0[1].requeued == 4
        for a in (w0[1], w2[1]):
            drain = a.drained_at - a.received_at
            assert drain > 0 and a.switch_s >= drain and a.switch_s - drain <= 1.0, a
        assert w2[1].drained_at - w2[1].received_at >= 0.3  # waited for the long decode (ended by the abort)
        w0c = (await bus.request(SVC_STATS, m.StatsRequest(), instance="worker-w0", timeout=5.0)).counters
        assert w0c["requeue.accepted"] == 4 and w0c.get("requeue.failed", 0) == 0 and w0c["split.serving"] == 1


async def test_a_switch_whose_draining_announcement_fails_still_hands_back_all_its_queued_work(nats_url, tmp_path: Path):
    """w0 (collocated) has one prefill running and four queued when a split moves it to decode; NATS
    refuses its ``split.applied(draining)`` publish (``BusUnavailable``, as with a full reconnect
    buffer). The four are handed back all the same (this test answers ``work.requeue.router``), the
    running one finishes in place and the switch ends ``serving``. Before, the failed publish ended the
    handler right after ``take_queued()``: the four were neither queued nor handed back (no requeue,
    no chunk: their clients waited for their timeout), and the command's epoch was recorded, so its
    next announcement did not try again."""
    profile = tmp_path / "slow.toml"
    profile.write_text(SLOW_PREFILL)
    origin = time.time()
    clock = SimClock(1.0, origin)
    requeued: list[m.WorkRequeue] = []
    refused: list[m.SplitApplied] = []
    held: list[WorkerService] = []

    async with AsyncExitStack() as stack:
        bus, states, applied, chunks = await watched_bus(stack, nats_url, "test-requeue-fail")

        async def on_requeue(msg: m.WorkRequeue, _s: str) -> m.WorkRequeueReply:
            requeued.append(msg)
            return m.WorkRequeueReply(rid=msg.rid, accepted=True)

        await bus.serve(WORK_REQUEUE, on_requeue, router="router")
        cfg = WorkerConfig(nats_url=nats_url, clock_origin=origin, node="w0", phase="both", profile=str(profile),
                           idle_state_interval_s=0.2, state_interval_s=0.01, split_get_timeout_s=0.0, check_invariants=True)  # fmt: skip
        Services(stack).start("worker", cfg, refusing_split_applied(refused, held), instance="worker-w0")
        await until(lambda: "w0" in states, 10.0, "w0 up")
        rids = [f"q{i}" for i in range(5)]
        for i, rid in enumerate(rids):
            ids = [i * 100 + k for k in range(50)]  # 200 tokens, ≈ 0.4 s of prefill each
            work = m.PrefillWork(rid=rid, prompt_tokens=200, max_tokens=2, block_size=BS,
                                 block_hashes=block_hashes(tokens_for_blocks(ids, BS), BS))  # fmt: skip
            await bus.publish(WORK_PREFILL, work, node="w0")
        await until(lambda: states["w0"].running == 1 and states["w0"].waiting == 4, 10.0, "one prefill running, four queued on w0")
        await bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=1, phases={"w0": "decode", "w1": "prefill"}, reason="to decode", decided_at=clock.now()))
        await until(lambda: any(a.status == "serving" for a in applied), 10.0, "w0 serving decode")
        await until(lambda: len(requeued) + sum(any(c.finished for c in chunks[r]) for r in rids) >= 5, 5.0, "every request accounted for")
    svc = held[0]
    assert [a.status for a in refused] == ["draining"]
    assert [(a.status, a.phase, a.requeued) for a in applied] == [("serving", "decode", 4)]
    done = [r for r in rids if any(c.finished for c in chunks[r])]
    assert len(done) == 1 and chunks[done[0]][-1].finish_reason == "length", dict(chunks)
    assert sorted(q.rid for q in requeued) == sorted(set(rids) - set(done))
    assert all(q.node == "w0" and q.epoch == 1 and q.prefill is not None for q in requeued)
    assert svc.counters["requeue.accepted"] == 4 and svc.counters["split.announce_failed"] == 1
    assert svc.core.phase == "decode" and svc.epoch == 1 and svc.fatal_error is None
