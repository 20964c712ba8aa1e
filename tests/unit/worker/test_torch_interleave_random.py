"""Seeded random interleavings of a torch worker's engine calls beside a forward: the page maps equal the pools.

Since this session (4b7ea0a, 35db764, 532ddeb) a threaded engine's registrations (``accept_prefill`` /
``accept_decode``) and KV drains (``on_kv_events`` with the live rids frozen at the drain, ``drop_fetched``)
given while a plan holds the engine's lock are applied by its next locked call, and a hand-off runs in the
execute thread after the plan in flight (``WorkerService._beside_step``). Here the event loop races them against
plans whose forward is slowed (so most calls land while the lock is held): new prefills (some handed off to
another node), aborts (also of a request whose registration is still deferred, and of one the plan in flight
runs), re-dispatches of a rid, decode work carrying a hand-off made here, drains; a plan's hand-offs go out beside
the step loop (the step's ``_deliver_aside`` task, or a parked prefill's binding task). Every drain checks the
engine's maps against the pools at the drain (``check`` mode); at quiescence (every hand-off out, a drain after)
the maps equal the pools, every page is free and nothing is left registered, deferred or captured. Needs the
``torch`` extra; skipped without it.
"""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest

pytest.importorskip("torch")

from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.plan import HandOff, WorkRejected  # noqa: E402
from services.worker.service import WorkerService  # noqa: E402
from services.worker.watchdog import StepInfo  # noqa: E402
from shared.clock import SimClock  # noqa: E402
from shared.messages import DecodeWork  # noqa: E402
from tests.unit.worker.torch_tiny import prompt, work  # noqa: E402

FORWARD_S = 0.01
"""Wall seconds each forward sleeps under the engine's lock (the loop's calls land beside it)."""


class _Bus:
    """What the worker touches of its bus here: its publishes (the hand-offs recorded, each with the K/V its pieces
    brought ahead, ``work.<d>.kv``, put back inline as the decode node's ``_on_decode`` does)."""

    reconnected_at = 0.0
    max_payload = 1024 * 1024

    def __init__(self) -> None:
        from services.worker.handoffkv import KvAssembler

        self.published: list[object] = []
        self.kv_in = KvAssembler(1 << 30, 60.0)

    async def request(self, subject, msg, **kw):  # type: ignore[no-untyped-def]
        from shared import messages as m

        return m.KvChunkAck(transfer=msg.transfer, index=msg.index, error=self.kv_in.add(msgspec.msgpack.decode(m.encode(msg), type=m.KvChunk), 0.0))

    async def publish(self, subject: str, msg: object, **kw: object) -> None:
        if isinstance(msg, DecodeWork):
            if msg.kv_transfer:
                kv = self.kv_in.take(msg.kv_transfer, msg.rid, msg.kv_chunks, msg.kv_bytes)
                msg = msgspec.structs.replace(msg, kv=kv, kv_transfer="", kv_chunks=0)
            self.published.append(msg)


class _Race:
    """The event loop's side: random calls as the worker's handlers make them, on one seeded ``rng``."""

    def __init__(self, svc: WorkerService, bus: _Bus, rng: random.Random) -> None:
        self.svc, self.bus, self.rng = svc, bus, rng
        self.n = 0
        self.sent: list[asyncio.Task[None]] = []
        self.deferred = 0
        """Calls that found the lock held and left work deferred (the test's reach)."""

    def _accept(self, w, now: float) -> bool:
        svc = self.svc
        try:
            svc._accept(svc.engine.accept_prefill if hasattr(w, "decode_node") else svc.engine.accept_decode, w)
            (svc.core.add_prefill if hasattr(w, "decode_node") else svc.core.add_decode)(w, now)
        except WorkRejected:
            return False  # a refusal (the core's: L1 full); the engine's registration goes at the next drain
        return True

    def _new_prefill(self, rid: str, now: float) -> bool:
        rng = self.rng
        tokens = prompt(rng.randrange(4) if rng.random() < 0.4 else rng.randrange(10**6), rng.randrange(6, 260))
        return self._accept(work(rid, tokens, decode_node="d" if rng.random() < 0.35 else None, n=rng.randrange(1, 6)), now)

    def _free_rids(self) -> list[str]:
        """Requests no step runs and no hand-off sends: new work of theirs may come (_newest_attempt)."""
        svc = self.svc
        return [r for r in svc.core.requests if r not in svc._step_rids and r not in svc._handing_off]

    def op(self, now: float) -> None:
        svc, rng = self.svc, self.rng
        what = rng.random()
        if what < 0.3:
            self.n += 1
            self._new_prefill(f"r{self.n}", now)
        elif what < 0.4:  # accepted, then aborted before the plan in flight ends (its registration deferred)
            self.n += 1
            if self._new_prefill(f"r{self.n}", now):
                svc.core.abort(f"r{self.n}", now)
        elif what < 0.55 and svc.core.requests:  # an abort: of any request, one the plan in flight runs too
            svc.core.abort(rng.choice(sorted(svc.core.requests)), now)
        elif what < 0.65 and (free := self._free_rids()):  # a re-dispatch: the old attempt aborted, the new accepted
            rid = rng.choice(sorted(free))
            svc.core.abort(rid, now)
            self._new_prefill(rid, now)
        elif what < 0.75 and self.bus.published:  # decode work carrying a hand-off made here
            self.n += 1
            sent = self.bus.published.pop(rng.randrange(len(self.bus.published)))
            self._accept(msgspec.structs.replace(sent, rid=f"r{self.n}", kv_ready_at=now, attempt=0), now)
            svc._engine_kv_events(svc.core.take_kv_events())  # _on_decode's flush (its reservation)
        else:
            svc._engine_kv_events(svc.core.take_kv_events())  # a handler's drain (a decode arrival, a resync)

    def send(self, h: HandOff, handoff) -> None:
        """A parked prefill's hand-off as its binding's task sends it (_hand_off_bound): beside the steps, the rid
        in ``_handing_off`` from the moment it left the core until it is out."""
        svc = self.svc

        async def sending() -> None:
            try:
                await handoff(h)
            finally:
                del svc._handing_off[h.rid]

        t = asyncio.ensure_future(sending())
        svc._handing_off[h.rid] = t  # type: ignore[assignment]
        self.sent.append(t)


async def _run(svc: WorkerService, bus: _Bus, seed: int, steps: int) -> int:
    """``steps`` plans raced by the loop's calls (and the loop's calls between them), then quiescence; returns the
    plans run. The race ends after ``steps`` plans, not ``steps`` passes of the loop: how many calls land beside one
    forward depends on the box's load, and so do the seeded calls that follow (one rng). Counted in passes, a slow
    first plan on a loaded box could leave seed 2 on a stretch of 21 calls with no new prefill: 1 plan in all."""
    rng = random.Random(seed)
    race = _Race(svc, bus, rng)
    handoff_aside = svc._handoff_aside

    async def step_handoff(h: HandOff) -> None:
        if rng.random() < 0.5:  # the step's: its K/V taken on the step, sent by a _deliver_aside task (in _handing_off)
            await handoff_aside(h)
        else:  # parked until its binding came: taken and sent by the binding's task, beside the next steps
            race.send(h, svc._handoff)

    svc._handoff_aside = step_handoff  # type: ignore[method-assign]
    now, ran, i = 0.0, 0, 0
    while True:
        i += 1
        if i > steps * 20:
            raise AssertionError(f"no quiescence after {i} steps: {sorted(svc.core.requests)}")
        plan = svc.core.schedule(now)
        if plan is None:
            svc._engine_kv_events(svc.core.take_kv_events())
            if ran < steps:
                race.op(now)
                now += 0.01
                continue
            if svc._handing_off:
                # hand-offs still going out (the step's _deliver_aside tasks, the bindings' sends): the engine keeps
                # their rids registered until they are out, and the step loop drains when one ends (_deliver_aside's
                # _input wakes it), as the next pass here does. Before, only the bindings' sends were waited for
                # (the step's went out through _handoff until 4372d0b): a hand-off of the last plan still being
                # delivered left its rid registered at the final drain (eng.seqs == {'r70'}, under load)
                await asyncio.wait(set(svc._handing_off.values()))
                continue
            if not svc.core.requests:
                break
            now = max(now + 0.01, svc.core.next_deadline() or now)  # a decode's K/V arrival
            continue
        # the step loop's step (WorkerService._step): the plan's rids kept registered, _run_plan's drains,
        # execute in the execute thread, outputs, hand-offs, the final drain
        svc._steps += 1
        svc._step_rids = frozenset(StepInfo.of(plan, svc._steps).rids)
        svc._step_over.clear()
        step = asyncio.ensure_future(svc._run_plan(plan, now, None))
        while ran < steps and not step.done():
            race.op(now)
            race.deferred += bool(svc.engine._deferred)
            await asyncio.sleep(rng.uniform(0, FORWARD_S / 2))
        await step
        svc._step_rids = frozenset()
        svc._step_over.set()
        ran += 1
        now = max(now, plan.end)
    svc._engine_kv_events(svc.core.take_kv_events())
    for t in race.sent:
        t.result()  # a hand-off that failed fails the test
    assert race.deferred >= 10, f"only {race.deferred} calls beside a forward were deferred"
    return ran


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_interleavings_keep_the_page_maps_equal_to_the_pools(tiny_llama, seed):
    bus = _Bus()
    svc = WorkerService(WorkerConfig(node="p", phase="both", profile="torch-tiny-cpu", engine="torch", model=tiny_llama), bus, SimClock())
    eng = svc.engine
    eng.check_each = True  # every drain: the maps against the pools at the drain
    forward = eng._forward

    def slow_forward(*args, **kw):
        time.sleep(FORWARD_S)
        return forward(*args, **kw)

    eng._forward = slow_forward  # type: ignore[method-assign]
    try:
        ran = await _run(svc, bus, seed, steps=30)
        assert ran >= 30 and not svc.fatal.is_set(), (ran, svc.fatal_error)
        eng.check(*svc.core.snapshot())
        assert not svc.core.requests and not eng.seqs and not eng._deferred
        assert not eng._handoffs and not eng._incoming and not eng._pending
        assert len(eng._free) + len(eng.page_of) == eng.pages  # no page private to a request left
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)


def test_a_captured_hand_off_holds_no_private_page(tiny_llama):
    """A prefill handed off to another node: once its K/V is captured the engine holds none of its pages privately
    (its partial last page freed; its full ones stored), as the scheduler, which frees them when it hands it off,
    while the worker keeps its registration until the hand-off is out. Before, the partial page stayed private
    until the drain after that: one page per hand-off the scheduler had planned again."""
    svc = WorkerService(WorkerConfig(node="p", phase="both", profile="torch-tiny-cpu", engine="torch", model=tiny_llama), _Bus(), SimClock())
    eng = svc.engine
    w = work("a", prompt(1, 5 * 8 + 3), decode_node="d", n=4)  # 5 full pages and a partial one
    eng.accept_prefill(w)
    svc.core.add_prefill(w, 0.0)
    handoff, now = None, 0.0
    while handoff is None:
        plan = svc.core.schedule(now)
        eng.on_kv_events(svc.core.take_kv_events(), {"a"})
        eng.execute(plan)
        now = plan.end
        handoff = next((o for o in svc.core.finish_iteration(plan, now, eng.take_stopped()) if isinstance(o, HandOff)), None)
    eng.on_kv_events(svc.core.take_kv_events(), {"a"})  # its hand-off not out yet: kept registered
    eng.check(*svc.core.snapshot())
    assert not eng.seqs["a"].own and len(eng._free) + len(eng.page_of) == eng.pages
    sent = eng.handoff(handoff.work)  # the captured K/V goes out whole
    assert len(sent.kv) == 6 * eng.pool_slot_bytes() and sent.output_ids == eng.seqs["a"].out[:1]


async def test_a_steps_hand_off_is_forgotten_by_the_step_after_its_delivery(tiny_llama):
    """A step's hand-off goes out beside the step loop (``_deliver_aside``, its rid in ``_handing_off``): the engine
    keeps the rid's registration while it is out (no private page: captured), and once it is out its task wakes the
    step loop (``_input``), whose next step drains and forgets it, every page free. What the random test above reached
    at its quiescence too early (it waited only for the bindings' sends): ``eng.seqs == {'r70'}`` under load."""
    gate = asyncio.Event()

    class _HeldBus(_Bus):
        async def publish(self, subject: str, msg: object, **kw: object) -> None:
            if isinstance(msg, DecodeWork):
                await gate.wait()  # the decode node's queue is slow: the hand-off is still going out
            await super().publish(subject, msg, **kw)

    bus = _HeldBus()
    svc = WorkerService(WorkerConfig(node="p", phase="both", profile="torch-tiny-cpu", engine="torch", model=tiny_llama), bus, SimClock())
    eng = svc.engine
    eng.check_each = True
    try:
        w = work("a", prompt(1, 5 * 8 + 3), decode_node="d", n=4)
        svc._accept(eng.accept_prefill, w)
        svc.core.add_prefill(w, 0.0)
        for _ in range(10):
            await svc._step()  # a plan each (its prompt's chunks), the last one hands it off
            if "a" in svc._handing_off:
                break
        delivery = svc._handing_off["a"]
        await asyncio.sleep(0)  # the delivery task runs up to its held publish
        assert not delivery.done() and "a" not in svc.core.requests
        assert "a" in eng.seqs and not eng.seqs["a"].own  # kept while it goes out, its K/V captured
        svc._wake.clear()
        gate.set()
        await delivery
        assert [x.rid for x in bus.published] == ["a"] and "a" not in svc._handing_off
        assert svc._wake.is_set()  # the step loop steps again
        step = asyncio.ensure_future(svc._step())  # no plan: it drains, then waits for input
        await asyncio.sleep(0)
        assert not eng.seqs and not eng._deferred and not eng._handoffs
        eng.check(*svc.core.snapshot())
        assert len(eng._free) + len(eng.page_of) == eng.pages
        svc._input()
        await asyncio.wait_for(step, 5.0)
        assert not svc.fatal.is_set(), svc.fatal_error
    finally:
        if svc._executor is not None:
            svc._executor.shutdown(wait=True)
