"""A torch worker's handlers register arriving work without waiting for the forward in flight.

``TorchEngine.execute`` holds the engine's lock for the whole plan in the execute thread. A bus handler
(``WorkerService._on_prefill`` / ``_on_decode``) registered arriving work with ``accept_prefill`` /
``accept_decode`` on the event loop under that lock: the loop waited for the rest of the forward, and
heartbeats, NATS pings and the metrics endpoint waited with it (measured on CPU: a 256-token chunk of a
hidden-512, 8-layer llama held the loop 40-615 ms per call on a busy 2-core box). The registration is now
deferred to the next locked call when the lock is busy (``TorchEngine._register``); the work is still checked
at once, and the next plan runs it. Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("torch")

from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.plan import HandOff, WorkRejected  # noqa: E402
from services.worker.service import WorkerService  # noqa: E402
from shared.clock import SimClock  # noqa: E402
from tests.unit.worker.torch_tiny import prompt, work  # noqa: E402

FORWARD_S = 0.4
"""How long the test's slowed forward holds the engine's lock (wall s)."""


def _drain(svc: WorkerService, keep: set[str]) -> None:
    svc.engine.on_kv_events(svc.core.take_kv_events(), set(svc.core.requests) | keep)


def _run(svc: WorkerService, now: float, keep: set[str]) -> tuple[float, list]:
    """One plan of the core on the engine, here (no forward in flight); returns its end and its outputs."""
    plan = svc.core.schedule(now)
    _drain(svc, keep)
    svc.engine.execute(plan)
    return plan.end, svc.core.finish_iteration(plan, plan.end, svc.engine.take_stopped())


async def test_accepts_beside_a_forward_keep_the_loop_running(tiny_llama):
    svc = WorkerService(WorkerConfig(node="p", phase="both", profile="torch-tiny-cpu", engine="torch", model=tiny_llama), SimpleNamespace(reconnected_at=0.0), SimClock())
    try:
        # request a prefills here for decode node d: its hand-off is the decode work accepted below
        svc.engine.accept_prefill(work("a", prompt(1, 40), decode_node="d", n=4))
        svc.core.add_prefill(work("a", prompt(1, 40), decode_node="d", n=4), 0.0)
        handoff, now = None, 0.0
        while handoff is None:
            now, outs = _run(svc, now, {"a"})
            handoff = next((o for o in outs if isinstance(o, HandOff)), None)
        sent = svc.engine.handoff(handoff.work)
        _drain(svc, set())
        # request b's prefill runs in the execute thread, its forward slowed to FORWARD_S under the engine's lock
        svc.engine.accept_prefill(work("b", prompt(2, 200), n=4))
        svc.core.add_prefill(work("b", prompt(2, 200), n=4), now)
        plan = svc.core.schedule(now)
        _drain(svc, set())
        forward = svc.engine._forward

        def slow_forward(*args, **kw):
            time.sleep(FORWARD_S)
            return forward(*args, **kw)

        svc.engine._forward = slow_forward  # type: ignore[method-assign]
        step = asyncio.create_task(svc._in_thread(svc.engine.execute, plan))
        while svc.engine._lock.acquire(blocking=False):  # until the execute thread holds it
            svc.engine._lock.release()
            await asyncio.sleep(0.001)
        took = {}
        t0 = time.perf_counter()
        svc._accept(svc.engine.accept_prefill, work("c", prompt(3, 30), n=4))
        took["accept_prefill"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        svc._accept(svc.engine.accept_decode, msgspec.structs.replace(sent, rid="a2"))
        took["accept_decode"] = time.perf_counter() - t0
        with pytest.raises(WorkRejected, match="outside the model's vocabulary"):  # still checked at once
            svc._accept(svc.engine.accept_prefill, work("x", [10**6], n=4))
        assert not step.done()
        assert all(t < FORWARD_S / 4 for t in took.values()), f"the loop waited for the forward: {took} (forward {FORWARD_S} s)"
        await step
        svc.engine._forward = forward  # type: ignore[method-assign]
        now, _ = plan.end, svc.core.finish_iteration(plan, plan.end, svc.engine.take_stopped())
        # the registrations were applied after the plan, before anything that reads them: c's prefill runs
        svc.core.add_prefill(work("c", prompt(3, 30), n=4), now)
        assert svc.engine.output_tokens("a2", 0, handoff.work.generated) == list(sent.output_ids)
        assert set(svc.engine._incoming) == set(sent.block_hashes)
        done = False
        while not done:
            now, outs = _run(svc, now, {"a2"})
            done = "c" not in svc.core.requests
        assert len(svc.engine.seqs["c"].out) == 4  # forgotten at the next drain
        assert "x" not in svc.engine.seqs and not svc.engine._deferred
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)
