"""A torch worker's handlers register arriving work and drain KV events without waiting for the forward in flight.

``TorchEngine.execute`` holds the engine's lock for the whole plan in the execute thread. A bus handler
(``WorkerService._on_prefill`` / ``_on_decode``) registered arriving work with ``accept_prefill`` /
``accept_decode`` on the event loop under that lock: the loop waited for the rest of the forward, and
heartbeats, NATS pings and the metrics endpoint waited with it (measured on CPU: a 256-token chunk of a
hidden-512, 8-layer llama held the loop 40-615 ms per call on a busy 2-core box); so did a KV drain in a
handler (``_engine_kv_events``: ``on_kv_events``, ``drop_fetched``; 47-266 ms). Registrations and KV batches are
now applied by the engine's next locked call when the lock is busy (``TorchEngine._register``), in order; the
work is still checked at once, and the next plan runs it. Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("torch")

from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.engines.base import EngineFatal  # noqa: E402
from services.worker.plan import HandOff, WorkRejected  # noqa: E402
from shared.hashing import block_hashes, pack_tokens  # noqa: E402
from shared.messages import BlockRemoved, DecodeWork  # noqa: E402
from services.worker.service import WorkerService  # noqa: E402
from shared.clock import SimClock  # noqa: E402
from tests.unit.worker.torch_tiny import BS, FORWARD_S, prompt, work  # noqa: E402
from tests.unit.worker.torch_tiny import drain as _drain, slow_step as _slow_step  # noqa: E402


def _run(svc: WorkerService, now: float, keep: set[str]) -> tuple[float, list]:
    """One plan of the core on the engine, here (no forward in flight); returns its end and its outputs."""
    plan = svc.core.schedule(now)
    _drain(svc, keep)
    svc.engine.execute(plan)
    return plan.end, svc.core.finish_iteration(plan, plan.end, svc.engine.take_stopped())


def _svc(model: str) -> WorkerService:
    return WorkerService(
        WorkerConfig(node="p", phase="both", profile="torch-tiny-cpu", engine="torch", model=model), SimpleNamespace(reconnected_at=0.0), SimClock()
    )


async def test_accepts_and_kv_drains_beside_a_forward_keep_the_loop_running(tiny_llama):
    svc = _svc(tiny_llama)
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
        step, plan = await _slow_step(svc, now, "b")
        took = {}
        t0 = time.perf_counter()
        svc._accept(svc.engine.accept_prefill, work("c", prompt(3, 30), n=4))
        svc.core.add_prefill(work("c", prompt(3, 30), n=4), now)
        took["accept_prefill"] = time.perf_counter() - t0
        a2 = msgspec.structs.replace(sent, rid="a2", kv_ready_at=now)
        t0 = time.perf_counter()
        svc._accept(svc.engine.accept_decode, a2)
        svc.core.add_decode(a2, now)
        took["accept_decode"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        svc._engine_kv_events(svc.core.take_kv_events())  # a decode arrival's drain (_on_decode's _flush_kv)
        svc.engine.drop_fetched(7)
        took["kv drain"] = time.perf_counter() - t0
        with pytest.raises(WorkRejected, match="outside the model's vocabulary"):  # still checked at once
            svc._accept(svc.engine.accept_prefill, work("x", [10**6], n=4))
        assert not step.done()
        assert all(t < FORWARD_S / 4 for t in took.values()), f"the loop waited for the forward: {took} (forward {FORWARD_S} s)"
        await step
        now, _ = plan.end, svc.core.finish_iteration(plan, plan.end, svc.engine.take_stopped())
        # applied after the plan, in order, before anything that reads them: the maps equal the pools
        svc._engine_kv_events(svc.core.take_kv_events())
        svc.engine.check(*svc.core.snapshot())
        assert svc.engine.output_tokens("a2", 0, handoff.work.generated) == list(sent.output_ids)
        made = {}
        for _ in range(50):
            if not {"c", "a2"} & set(svc.core.requests):
                break
            now, outs = _run(svc, now, set())
            made.update((r, len(svc.engine.seqs[r].out)) for r in ("c", "a2") if r in svc.engine.seqs)
        assert not {"c", "a2"} & set(svc.core.requests)
        assert made == {"c": 4, "a2": 4}
        assert "x" not in svc.engine.seqs and not svc.engine._deferred and not svc.fatal.is_set()
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


async def test_a_deferred_kv_batch_that_fails_fails_the_node(tiny_llama):
    svc = _svc(tiny_llama)
    try:
        step, plan = await _slow_step(svc, 0.0, "b")
        svc._engine_kv_events([BlockRemoved(block_hashes=[12345], tier="gpu")])  # a page the engine never had
        await step  # the plan ran before the batch
        svc.core.finish_iteration(plan, plan.end, {})
        assert not svc.fatal.is_set()
        with pytest.raises(WorkRejected, match="KvMapError"):  # the next locked call applies it: the node fails
            svc._accept(svc.engine.accept_prefill, work("c", prompt(3, 30), n=4))
        assert svc.fatal.is_set() and svc.counters["engine_fatal"] == 1
        with pytest.raises(EngineFatal, match="12345"):  # and every later one raises it
            svc.engine.take_stopped()
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


def _decode_work(svc: WorkerService, rid: str, tokens: list[int], hashes: list[int]) -> DecodeWork:
    """A hand-off of ``tokens`` (zero K/V of the right size, one output token) carrying ``hashes``."""
    pages = -(-len(tokens) // BS)
    return DecodeWork(
        rid=rid, prompt_tokens=len(tokens), max_tokens=4, block_size=BS, generated=1, block_hashes=hashes,
        token_ids=pack_tokens(tokens), output_ids=[1], kv=bytes(pages * svc.engine.pool_slot_bytes()), ignore_eos=True,
    )  # fmt: skip


async def test_a_bad_hand_off_beside_a_forward_is_refused_and_the_node_serves_on(tiny_llama):
    """A hand-off with more block hashes than K/V pages is the request's fault: refused at once, as when the lock
    is free. Before, the engine checked no hash count: with the lock free the registration raised IndexError
    midway (refused as an unexpected error, its first hashes' K/V left registered); deferred behind the plan,
    the next locked call (the step's take_stopped) raised it as an EngineFatal, and the node failed."""
    svc = _svc(tiny_llama)
    try:
        tokens = prompt(4, 40)
        bad = _decode_work(svc, "bad", tokens, [*block_hashes(tokens, BS), 11, 12])  # 5 pages of K/V, 7 hashes
        with pytest.raises(WorkRejected, match="block hashes"):  # the lock free: refused
            svc._accept(svc.engine.accept_decode, bad)
        step, plan = await _slow_step(svc, 0.0, "b")
        with pytest.raises(WorkRejected, match="block hashes"):  # a plan holding the lock: refused the same way
            svc._accept(svc.engine.accept_decode, bad)
        assert not step.done()
        await step
        svc.core.finish_iteration(plan, plan.end, svc.engine.take_stopped())
        svc._accept(svc.engine.accept_prefill, work("c", prompt(3, 30), n=4))  # the next locked call: the node serves on
        assert not svc.fatal.is_set() and svc.counters["engine_fatal"] == 0
        assert "bad" not in svc.engine.seqs and not any("bad" in held for held in svc.engine._incoming.values())
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)
