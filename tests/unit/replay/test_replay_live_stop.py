"""A live replay stopped (``stop`` set: a signal, or ``demo``'s cluster that ended) while branch ends are in flight,
against :class:`tests.unit.replay.stub_router.StubRouter` holding every branch end (a router whose bus is gone does not
answer them):

* ``in_flight_at_stop`` counts the requests cancelled unanswered, not the branch-end POSTs: it counted every
  unfinished task, so a demo whose cluster ended said a request never sent had been sent (``1 in flight``), and with
  more branch ends in flight than requests unsent ``demo_partial`` raised (a traceback and no report: the case the
  partial report exists for);
* once every request is answered, a stop ends the wait for the branch ends at once: it waited up to
  ``request_timeout_s`` (600 s) for POSTs nobody answers;
* the branch ends cancelled at the stop are counted (``branch_ends_cancelled``, the report's
  ``meta.branch_ends_cancelled``): before, they were counted nowhere (neither failed nor in flight);
* the requests cancelled unanswered are named (``in_flight_ids``, their ``X-Request-ID``): what to look for in the
  cluster's logs when a run's requests never ended.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from evolving_infra.cluster import ClusterError
from evolving_infra.launcher import demo_partial
from evolving_infra.replay.core import Arrival
from evolving_infra.replay.live import LiveReplayer, ReplayResult
from evolving_infra.traces.schema import TraceRequest
from shared.clock import SimClock
from tests.unit.replay.stub_router import StubRouter


def _req(rid: str, branch: str, **kw) -> TraceRequest:  # type: ignore[no-untyped-def]
    return TraceRequest(id=rid, agent=branch.split(":")[0], branch=branch, input_tokens=4, output_tokens=1, blocks=[1],
                        kind="main", ends_branch=True, **kw)  # fmt: skip


async def _stopped_once_an_end_is_held(trace: list[TraceRequest], ends: int) -> tuple[ReplayResult, float]:
    """Replay ``trace`` (closed loop, 2 agents at a time, speed-up 1000) against a stub that never answers a branch
    end; set ``stop`` once ``ends`` branch ends reached it. Returns the result and the wall s from the stop to the
    return."""
    stub = StubRouter(hold_ends=asyncio.Event())  # never set
    url = await stub.start()
    stop = asyncio.Event()
    try:
        replayer = LiveReplayer(url, SimClock(1000.0), block_size=4, progress=False)
        run = asyncio.ensure_future(replayer.run(trace, Arrival(kind="closed", concurrency=2), stop=stop))
        deadline = time.monotonic() + 10
        while stub.ends_received < ends:
            assert not run.done() and time.monotonic() < deadline, (stub.ends_received, run.done())
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the replay is waiting (on its next arrival, or on the ends)
        stop.set()
        t0 = time.monotonic()
        res = await asyncio.wait_for(run, 10)
        return res, time.monotonic() - t0
    finally:
        await stub.close()


async def test_a_branch_end_in_flight_at_the_stop_is_not_counted_as_a_request():
    """r1 answered, its branch end unanswered; r2 due 5 wall s later (never sent): 0 requests in flight (was 1), so
    the demo's partial report says 1 answered, 0 cancelled, 1 never sent (it said r2 was sent)."""
    trace = [_req("r1", "a1:x"), _req("r2", "a1:y", after=["r1"], pause_s=5000.0)]
    res, _ = await _stopped_once_an_end_is_held(trace, ends=1)
    assert (len(res.records), res.in_flight_at_stop, res.interrupted) == (1, 0, True)
    assert (res.branch_ends_cancelled, res.branch_end_failures) == (1, 0)  # counted apart, not as a failure
    assert res.in_flight_ids == []
    p = demo_partial(ClusterError("x", service="nats-server"), total=2, answered=len(res.records), in_flight=res.in_flight_at_stop)
    assert (p["requests_answered"], p["in_flight_cancelled"], p["requests_not_sent"]) == (1, 0, 1)


async def test_a_request_in_flight_at_the_stop_is_counted_once_besides_the_branch_ends(monkeypatch):
    """r1 and r3 answered, their branch ends unanswered; r2 sent and unanswered (its worker died): 1 request in flight
    (was 3: more than the 1 request not answered, and ``demo_partial`` raised 'partial demo counts: 2 answered + 3 in
    flight of 3 requests')."""
    sent = asyncio.Event()
    orig = LiveReplayer._send

    async def send(self, http, action):  # type: ignore[no-untyped-def]
        if action.req.id == "r2":
            sent.set()
            await asyncio.sleep(3600)  # never answered
        return await orig(self, http, action)

    monkeypatch.setattr(LiveReplayer, "_send", send)
    trace = [_req("r1", "a1:x"), _req("r2", "a1:y", after=["r1"]), _req("r3", "a2:x")]
    res, _ = await _stopped_once_an_end_is_held(trace, ends=2)
    assert sent.is_set()
    assert (sorted(r.id for r in res.records), res.in_flight_at_stop, res.interrupted) == (["r1", "r3"], 1, True)
    assert res.branch_ends_cancelled == 2
    assert res.in_flight_ids == ["r2"]  # named by its X-Request-ID (no branch prefix: the trace id)
    p = demo_partial(ClusterError("x", service="worker-w0"), total=3, answered=len(res.records), in_flight=res.in_flight_at_stop)
    assert (p["requests_answered"], p["in_flight_cancelled"], p["requests_not_sent"]) == (2, 1, 0)


async def test_a_stop_after_every_request_was_answered_does_not_wait_for_the_branch_ends():
    """Every request answered, the branch ends unanswered: the stop returns at once (it waited for the ends, up to
    ``request_timeout_s``), no request in flight."""
    res, waited_s = await _stopped_once_an_end_is_held([_req("r1", "a1:x"), _req("r2", "a2:x")], ends=2)
    assert waited_s < 2.0
    assert (len(res.records), res.in_flight_at_stop, res.interrupted) == (2, 0, True)
    assert res.branch_ends_cancelled == 2  # counted nowhere before: the report did not say two branches may be open


@pytest.mark.parametrize("hold", [False, True])
async def test_a_replay_never_stopped_still_waits_for_its_branch_ends(hold):
    """Without a stop the replay returns once its branch ends are answered (and not before)."""
    release = asyncio.Event()
    stub = StubRouter(hold_ends=release if hold else None)
    url = await stub.start()
    try:
        replayer = LiveReplayer(url, SimClock(1000.0), block_size=4, progress=False)
        run = asyncio.ensure_future(replayer.run([_req("r1", "a1:x")], Arrival(kind="closed", concurrency=1)))
        if hold:
            await asyncio.sleep(0.3)
            assert not run.done() and stub.ends_received == 1
            release.set()
        res = await asyncio.wait_for(run, 10)
    finally:
        await stub.close()
    assert (len(res.records), res.branch_end_failures, res.branch_ends_cancelled, res.interrupted) == (1, 0, 0, False)
