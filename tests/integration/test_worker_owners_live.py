"""The worker's owner checks (``route.held``, ``services/worker/owners.py``) over a real nats-server: a router
that stays subscribed but does not answer in time (timeouts) is not "gone", so one no-responders moment after
such a spell does not drop its requests at once.

Before: the no-responders streak begun before the timeouts was kept through them, and the first no-responders
after ``--owner-gone-after-s`` dropped every request of the router (its streams ended with an abort) although
the router had been subscribed all along."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog

from shared import messages as m
from services.worker.service import OWNER_RECHECK_S, WorkerService
from shared.subjects import ROUTE_HELD, WORK_ABORT, WORK_PREFILL, Subjects
from tests.integration.polling import until
from tests.integration.test_worker_live import Client, prompt, workers

pytestmark = pytest.mark.timeout(60)


async def _stream_owned(c, rid: str, router: str):  # type: ignore[no-untyped-def]
    """Send w0 a 200-token request ``rid`` owned by ``router`` and wait until it streams; returns an
    async ``counter(name)`` reading w0's counter ``name`` (0 when absent)."""
    work = m.PrefillWork(**{f: getattr(prompt(rid, [1, 2], tail=1, max_tokens=200), f)
                            for f in ("rid", "prompt_tokens", "max_tokens", "block_size", "block_hashes")}, router=router)
    await c.bus.publish(WORK_PREFILL, work, node="w0")
    await until(lambda: len(c.chunks[rid]) >= 2, what="the request to stream")

    async def counter(name: str) -> int:
        return (await c.stats("w0")).counters.get(name, 0)

    return counter


async def test_a_router_that_only_timed_out_in_between_is_not_gone_at_its_next_no_responders(nats_url):
    c = await Client.connect(nats_url)
    # slowed 20x: 200 tokens outlive the test unless the owner checks drop them (at 10x a worker loop 0.4 s late at each
    # check, as on a loaded host, let the request end by length first: "length" == "abort")
    spec = {"node": "w0", "speedup": 0.05, "owner_check_interval_s": 0.2, "owner_gone_after_s": 1.0}
    async with workers(nats_url, spec):
        counter = await _stream_owned(c, "held-1", "slow")

        # nobody serves route.held.slow yet: a no-responders streak starts
        await until(lambda: counter("owners.no_responders"), 5.0, "a no-responders answer", every=0.05)
        # the router (re)subscribes but does not answer in time (a stalled loop): timeouts for longer than the grace
        async def never_answer(_msg) -> None:
            pass

        silent = await c.bus.nc.subscribe(Subjects("p0").format(ROUTE_HELD, router="slow"), cb=never_answer)
        await c.bus.flush()
        await asyncio.sleep(1.5)  # timeouts for longer than --owner-gone-after-s

        async def three_timeouts() -> bool:  # about 5 in those 1.5 s; a loaded host's worker loop may lag behind
            return await counter("owners.no_answer") >= 3

        await until(three_timeouts, 5.0, "3 owner checks timed out", every=0.05)
        # a no-responders moment (it reconnects to NATS): one answer of that kind is no 1 s streak
        await silent.unsubscribe()
        await c.bus.flush()
        nr = await counter("owners.no_responders")

        async def one_more() -> bool:
            return await counter("owners.no_responders") > nr

        await until(one_more, 5.0, "a no-responders answer after the timeouts", every=0.05)
        await asyncio.sleep(0.5)
        assert await counter("owners.router_gone") == 0 and not c.finished("held-1")
        # still nobody after the grace: gone, the request dropped
        await until(lambda: c.finished("held-1"), 5.0, "the gone router's request dropped")
        assert c.chunks["held-1"][-1].finish_reason == "abort" and await counter("owners.router_gone") >= 1
        assert await counter("owners.dropped") == 1
    await c.bus.close()


async def test_a_router_back_after_a_no_responders_answer_is_asked_again_at_once_and_its_lost_request_dropped(nats_url):
    """A router SIGKILLed and restarted under the same ``--instance`` (``evolving-infra up`` does it) has
    none of its predecessor's requests: its first ``route.held`` answer drops them. The node found the
    router missing (no responders) at a check; the new router subscribes right after. Before, the node
    asked it again only at the next full check (``--owner-check-interval-s``, 3 s here): the request ran
    on for nobody that long (under ``up --engine torch`` a 900-token decode of the tiny model ended
    first). Now a missing router is asked again every ``SILENT_RETRY_S`` (0.25 s), and its "not in flight" answer
    acted on when a query ``OWNER_RECHECK_S`` (1 s) later is answered so too: dropped within ~1.3 s."""
    c = await Client.connect(nats_url)
    spec = {"node": "w0", "speedup": 0.02, "owner_check_interval_s": 3.0, "owner_gone_after_s": 30.0}
    async with workers(nats_url, spec):
        counter = await _stream_owned(c, "lost-1", "r1")

        # the router is gone: the node's check gets "no responders" (the first full check, <= 3 s)
        await until(lambda: counter("owners.no_responders"), 5.0, "a no-responders answer", every=0.05)
        asked: list[m.HeldQuery] = []

        async def restarted(q: m.HeldQuery, _subject: str) -> m.HeldReply:  # empty state, as RouterService._on_held
            asked.append(q)
            return m.HeldReply(dropped=list(q.rids))

        back = asyncio.get_running_loop().time()
        await c.bus.serve(ROUTE_HELD, restarted, router="r1")
        await c.bus.flush()
        await until(lambda: c.finished("lost-1"), 2.5, "the lost request dropped before the next full check", every=0.02)
        took = asyncio.get_running_loop().time() - back
        assert took < OWNER_RECHECK_S + 1.0, f"dropped {took:.2f} s after the router came back"
        assert c.chunks["lost-1"][-1].finish_reason == "abort" and "no longer has the request in flight" in c.chunks["lost-1"][-1].error
        assert [q.rids for q in asked] == [["lost-1"], ["lost-1"]] and await counter("owners.dropped") == 1
        assert await counter("owners.router_gone") == 0
    await c.bus.close()


async def test_a_router_answer_that_overtakes_its_own_abort_drops_nothing_as_lost(nats_url):
    """A router ends a request itself (its client left, a stop at the router, a re-dispatch): it marks it done, then
    publishes the nodes' abort from a task it spawns (``RouterService._abandon``). A node's owner check answered
    in between hears "not in flight" (core NATS) before the abort (JetStream) arrives. Before, the node dropped the
    request at that first answer and counted it lost with its router (``owners.dropped.not_in_flight``, a warning
    "its stream is lost", alert ``EIStreamsLostWithRouter``) although its router had ended it on purpose. Now a
    "not in flight" answer is acted on only when a query sent ``OWNER_RECHECK_S`` later gets it too: the abort
    comes first and ends the request, counted an abort, nothing lost."""
    c = await Client.connect(nats_url)
    spec = {"node": "w0", "speedup": 0.1, "owner_check_interval_s": 0.2, "owner_gone_after_s": 30.0}
    async with workers(nats_url, spec):
        counter = await _stream_owned(c, "ended-1", "r3")
        asked: list[m.HeldQuery] = []

        async def abort_later() -> None:  # the router's spawned abort, right after its answer went out
            await asyncio.sleep(0.05)
            await c.bus.publish(WORK_ABORT, m.RequestAbort(rid="ended-1", reason="client disconnected", router="r3"), node="w0")

        async def ended_here(q: m.HeldQuery, _subject: str) -> m.HeldReply:
            asked.append(q)
            if len(asked) == 1:
                tasks.append(asyncio.create_task(abort_later()))
            return m.HeldReply(dropped=list(q.rids))

        tasks: list[asyncio.Task[None]] = []
        await c.bus.serve(ROUTE_HELD, ended_here, router="r3")
        await c.bus.flush()
        await until(lambda: c.finished("ended-1"), 5.0, "the request ended", every=0.02)
        await asyncio.gather(*tasks)
        last = c.chunks["ended-1"][-1]
        assert last.finish_reason == "abort" and last.error == "client disconnected", last
        assert await counter("requests.aborted") == 1
        assert await counter("owners.dropped") == 0 and await counter("owners.dropped.not_in_flight") == 0
    await c.bus.close()


async def test_the_drop_warning_counts_the_output_a_redispatched_request_had_before_this_node(nats_url):
    """``tokens_done`` of the drop warning is the request's output position (what its client had received, at
    most): a re-dispatched request continuing at ``output_offset`` 500 counts those 500 too. Before, only the
    tokens generated on this node (the abort chunk's index, ``owner.offset + ...``, already counted them)."""
    c = await Client.connect(nats_url)
    spec = {"node": "w0", "speedup": 0.1, "owner_check_interval_s": 0.2, "owner_gone_after_s": 30.0}
    with structlog.testing.capture_logs() as logs:
        async with workers(nats_url, spec):
            base = prompt("cont-1", [1, 2], tail=1, max_tokens=200)
            work = m.PrefillWork(**{f: getattr(base, f) for f in ("rid", "prompt_tokens", "max_tokens", "block_size", "block_hashes")},
                                 router="r4", output_offset=500, attempt=1)
            await c.bus.publish(WORK_PREFILL, work, node="w0")
            await until(lambda: len(c.chunks["cont-1"]) >= 2, what="the request to stream")

            async def restarted(q: m.HeldQuery, _subject: str) -> m.HeldReply:
                return m.HeldReply(dropped=list(q.rids))

            await c.bus.serve(ROUTE_HELD, restarted, router="r4")
            await c.bus.flush()
            await until(lambda: c.finished("cont-1"), 5.0, "the lost request dropped", every=0.02)
            last = c.chunks["cont-1"][-1]
    await c.bus.close()
    drops = [x for x in logs if x["event"] == "request dropped: its owning router no longer wants it (its stream is lost)"]
    assert len(drops) == 1 and drops[0]["rid"] == "cont-1" and drops[0]["cause"] == "not_in_flight", drops
    assert 700 >= drops[0]["tokens_done"] >= last.index >= 502, (drops, last)  # 500 + at most its 200 tokens


async def _not_in_flight_once(c, rid: str, router: str):  # type: ignore[no-untyped-def]
    """Stream ``rid`` owned by ``router`` on w0, answer w0's first ``route.held.<router>`` "not in flight", and
    unsubscribe right after (the router dies then); returns w0's ``counter``."""
    counter = await _stream_owned(c, rid, router)
    asked: list[m.HeldQuery] = []

    async def once(q: m.HeldQuery, _subject: str) -> m.HeldReply:
        asked.append(q)
        return m.HeldReply(dropped=list(q.rids))

    sub = await c.bus.serve(ROUTE_HELD, once, router=router)
    await c.bus.flush()
    await until(lambda: len(asked) >= 1, 5.0, "the first owner check", every=0.01)
    await sub.unsubscribe()
    await c.bus.flush()
    return counter


async def test_a_router_gone_after_a_not_in_flight_answer_is_asked_again_at_the_retry_pace_not_back_to_back(nats_url):
    """After a "not in flight" answer the node re-asks ``OWNER_RECHECK_S`` later. Before, a re-ask that got no
    verdict (here: the router died right after its answer, so no responders) left that time in the past and the
    owner-check loop asked again at once, back to back: 3076 no-responders answers in 2 s, 0.6 s CPU, until
    ``--owner-gone-after-s``. Now no sooner than ``SILENT_RETRY_S`` (0.25 s) after the previous check: ~8 in 2 s."""
    c = await Client.connect(nats_url)
    spec = {"node": "w0", "speedup": 0.02, "owner_check_interval_s": 2.0, "owner_gone_after_s": 30.0}
    async with workers(nats_url, spec):
        counter = await _not_in_flight_once(c, "x-1", "r9")
        await asyncio.sleep(OWNER_RECHECK_S + 0.2)  # the re-ask is due, and got no responders
        n0 = await counter("owners.no_responders")
        assert n0 >= 1
        await asyncio.sleep(2.0)
        n = await counter("owners.no_responders") - n0
        assert n <= 2.0 / 0.25 + 4, f"{n} no-responders answers in 2 s"
        assert not c.finished("x-1") and await counter("owners.dropped") == 0  # nothing decided without a verdict
    await c.bus.close()


async def test_nats_down_after_a_not_in_flight_answer_does_not_spin_the_owner_checks(nats_server, monkeypatch):
    """The same with NATS down after the "not in flight" answer: each check returns at once (not connected),
    and before, the loop ran them back to back (1.7 s CPU in 3 s); now one per ``SILENT_RETRY_S`` at most."""
    calls: list[float] = []
    real = WorkerService._check_owners_once

    async def counted(self: WorkerService, only: set[str] | None = None) -> None:
        calls.append(time.monotonic())
        await real(self, only)

    monkeypatch.setattr(WorkerService, "_check_owners_once", counted)
    c = await Client.connect(nats_server.url)
    spec = {"node": "w0", "speedup": 0.02, "owner_check_interval_s": 2.0, "owner_gone_after_s": 30.0}
    async with workers(nats_server.url, spec):
        await _not_in_flight_once(c, "x-2", "r8")
        nats_server.stop()
        await asyncio.sleep(OWNER_RECHECK_S + 0.2)
        n0 = len(calls)
        await asyncio.sleep(2.0)
        n = len(calls) - n0
        nats_server.restart()
        assert n <= 2.0 / 0.25 + 4, f"{n} owner checks in 2 s with NATS down"
    await c.bus.close()
