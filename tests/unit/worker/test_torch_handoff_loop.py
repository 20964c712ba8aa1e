"""A torch worker's hand-off does not block its event loop for the rest of a forward.

``TorchEngine.handoff`` runs under the engine's lock, which ``execute`` holds for the whole plan in the
execute thread. A hand-off published beside the step loop (``WorkerService._hand_off_bound``: the decode
node was bound after the prefill finished) called it on the event loop: the loop waited for the forward
in flight to end, and heartbeats, NATS pings and the metrics endpoint waited with it (measured on CPU:
a 256-token chunk of a hidden-512, 8-layer llama held the loop 20-140 ms, the whole forward). Needs the
``torch`` extra; skipped without it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("torch")

from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.plan import HandOff  # noqa: E402
from services.worker.service import WorkerService  # noqa: E402
from shared.clock import SimClock  # noqa: E402
from tests.unit.worker.torch_tiny import FORWARD_S, prompt, work  # noqa: E402
from tests.unit.worker.torch_tiny import drain as _drain, slow_step  # noqa: E402


class _Bus:
    """What the worker touches of its bus here: the hand-off's publish, recorded, and its K/V pieces
    (``work.<d>.kv`` requests), answered by a real decode side's assembler (``handoffkv.KvAssembler``)."""

    reconnected_at = 0.0
    max_payload = 1024 * 1024

    def __init__(self) -> None:
        from services.worker.handoffkv import KvAssembler

        self.published: list[tuple[str, object, dict]] = []
        self.kv_in = KvAssembler(1 << 30, 60.0)
        self.pieces: list[tuple[str, object]] = []

    async def publish(self, subject: str, msg: object, **kw: object) -> None:
        self.published.append((subject, msg, kw))

    async def request(self, subject: object, msg, **kw: object) -> object:  # type: ignore[no-untyped-def]
        import msgspec

        from shared import messages as m

        self.pieces.append((str(kw["node"]), msg))
        return m.KvChunkAck(transfer=msg.transfer, index=msg.index, error=self.kv_in.add(msgspec.msgpack.decode(m.encode(msg), type=m.KvChunk), 0.0))


def _prefilled(svc: WorkerService) -> tuple[HandOff, float]:
    """Request a prefilled here and handed off to d (its hand-off not yet published); (the hand-off, its time)."""
    svc.engine.accept_prefill(work("a", prompt(1, 40), decode_node="d", n=4))
    svc.core.add_prefill(work("a", prompt(1, 40), decode_node="d", n=4), 0.0)
    handoff, now = None, 0.0
    while handoff is None:
        plan = svc.core.schedule(now)
        _drain(svc, {"a"})
        svc.engine.execute(plan)
        now = plan.end
        handoff = next((o for o in svc.core.finish_iteration(plan, now, svc.engine.take_stopped()) if isinstance(o, HandOff)), None)
    _drain(svc, {"a"})  # a left the core; the worker keeps it registered while its hand-off goes out
    return handoff, now


async def test_a_hand_off_beside_a_forward_keeps_the_loop_running(tiny_llama):
    bus = _Bus()
    svc = WorkerService(WorkerConfig(node="p", phase="both", profile="torch-tiny-cpu", engine="torch", model=tiny_llama), bus, SimClock())
    try:
        # request a prefills here and is handed off to d (its hand-off not yet published, as when parked for its binding)
        handoff, now = _prefilled(svc)
        # request b's prefill runs in the execute thread, its forward slowed to FORWARD_S under the engine's lock
        step, _ = await slow_step(svc, now, "b", keep={"a"})
        lags: list[float] = []
        done = False

        async def probe() -> None:
            while not done:
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)

        probing = asyncio.create_task(probe())
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        await svc._handoff(handoff)
        took = time.perf_counter() - t0
        done = True
        await probing
        await step
        assert max(lags) < FORWARD_S / 4, f"the loop stalled {max(lags) * 1e3:.0f} ms during the hand-off (forward {FORWARD_S} s)"
        assert took > FORWARD_S / 2  # the hand-off did wait for the forward's end (the lock): it ran beside it, not after it
        (subject, sent, kw), = bus.published
        assert kw["node"] == "d" and sent.rid == "a" and sent.output_ids == svc.engine.seqs["a"].out[: handoff.work.generated]
        # its K/V went ahead to d (one piece: 40 tokens × 512 B) and the work names it
        assert sent.kv == b"" and sent.kv_chunks == 1 and sent.kv_bytes == 40 * 512 and [n for n, _ in bus.pieces] == ["d"]
        assert len(bus.kv_in.take(sent.kv_transfer, "a", 1, sent.kv_bytes)) == sent.kv_bytes
        assert svc.counters["requests.handed_off"] == 1
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


async def test_a_switch_waits_for_the_hand_off_a_step_sends(tiny_llama):
    """A step's hand-off (``_run_plan``) awaits the execute thread since the hand-off left the event loop; a
    switch command handled meanwhile found the core idle (the request had left it) and announced ``serving`` in
    the new phase at once, before this phase's last hand-off went out: the drain that waits for a parked
    prefill's hand-off (``_handing_off``) did not see a step's. Now the switch drains until it is out."""
    from shared import messages as m
    from shared.subjects import SPLIT_APPLIED, WORK_DECODE

    bus = _Bus()
    svc = WorkerService(WorkerConfig(node="p", phase="both", profile="torch-tiny-cpu", engine="torch", model=tiny_llama), bus, SimClock())
    try:
        handoff, _ = _prefilled(svc)
        assert svc.core.idle
        handoff_of = svc.engine.handoff

        def slow_handoff(w):
            time.sleep(0.3)  # a long prompt's K/V copied into bytes
            return handoff_of(w)

        svc.engine.handoff = slow_handoff  # type: ignore[method-assign]
        going = asyncio.create_task(svc._handoff(handoff))  # as _run_plan sends it, in the execute thread
        await asyncio.sleep(0.05)
        assert not going.done()
        await svc._on_split(m.SplitCommand(epoch=1, phases={"p": "decode"}, decided_at=time.time()), "split.cmd")
        await going

        def statuses() -> list[str]:
            return [f"{msg.status}:{msg.phase}" if subject == SPLIT_APPLIED else subject
                    for subject, msg, _ in bus.published if subject in (SPLIT_APPLIED, WORK_DECODE)]

        assert statuses() == ["draining:decode", WORK_DECODE], statuses()
        assert svc.core.phase == "both" and svc._switch is not None
        await svc._maybe_switch(svc.clock.local_now())  # the step's end (_run_plan)
        assert statuses() == ["draining:decode", WORK_DECODE, "serving:decode"] and svc.core.phase == "decode", statuses()
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)
