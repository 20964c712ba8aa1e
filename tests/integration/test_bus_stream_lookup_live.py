"""The stream lookup of :meth:`Bus.ensure_stream` on a real nats-server: one that gets no answer in time (the
server hung, SIGSTOP, as a loaded one is slow) is made again, and the bus stays on JetStream once the server
answers. Before, that one timeout put the bus on core NATS (at most once) for its whole life: measured with the
5-s lookup and a 6-s SIGSTOP, ensure_stream returned False. A server without JetStream still makes it fall
back, at once (it answers "no responders")."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

import shared.bus as busmod
from shared import messages as m
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.service import Readiness
from shared.subjects import REQ_OUT, Subjects
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(30)


def _stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (``T`` in ``/proc/<pid>/task/*/stat``)."""
    tasks = list(Path(f"/proc/{pid}/task").iterdir())
    return bool(tasks) and all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for t in tasks)


async def test_a_stream_lookup_without_an_answer_is_made_again_and_the_bus_stays_on_jetstream(monkeypatch):
    monkeypatch.setattr(busmod, "STREAM_LOOKUP_TIMEOUT_S", 0.5)
    with EmbeddedNatsServer() as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="test", instance="test-lookup")
        try:
            assert srv.pid is not None
            os.kill(srv.pid, signal.SIGSTOP)
            try:
                # kill() returns before every server thread is stopped: a lookup made at once was answered ('not
                # found', then the create timed out) in 1 of 7 runs under load, and no lookup was retried
                await until(lambda: _stopped(srv.pid), 5.0, "the server stopped")  # type: ignore[arg-type]
                check = asyncio.create_task(bus.ensure_stream())
                await asyncio.sleep(1.5)  # two lookups and more without an answer
                assert not check.done() and bus.stream_waiting == "EI_p0", (check, dict(bus.counters))
            finally:
                os.kill(srv.pid, signal.SIGCONT)
            assert await asyncio.wait_for(check, 10.0) is True
            assert bus.jetstream and bus.counters["stream_lookup_retries"] >= 1 and not bus.stream_waiting, dict(bus.counters)
        finally:
            await bus.close()


async def test_a_server_without_jetstream_still_makes_the_bus_fall_back_at_once():
    """No JetStream on the server (not a missing stream): reliable subjects go over core NATS, as before, without
    waiting: no lookup made again, no wait for the stream (its warning) either (a821ec1's test in
    test_auth_stream_live.py, merged here)."""
    with EmbeddedNatsServer(jetstream=False) as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="router", instance="router")
        try:
            t = time.monotonic()
            assert await asyncio.wait_for(bus.ensure_stream(), 10.0) is False
            assert time.monotonic() - t < 1.0 and not bus.jetstream and not bus.counters["stream_lookup_retries"]
            assert not bus.counters["stream_missing_warnings"]
        finally:
            await bus.close()


async def test_a_lookup_after_a_reconnect_without_an_answer_is_made_again_and_the_held_messages_arrive(monkeypatch):
    """The server comes back without its store (SIGKILL, store removed, restart) and hangs (SIGSTOP, 1.5 s) just as
    the bus's reconnect looks the stream up (0.5-s lookups here). The lookup is made again until the server answers:
    the stream is made again, and what was published during the outage (kept, 64a6f3b) reaches the bus's own
    reliable subscription. Before, the one timeout was logged and given up: the held messages were dropped, the
    stream not made again, the consumer not checked: none of them, nor any later publish, arrived."""
    monkeypatch.setattr(busmod, "STREAM_LOOKUP_TIMEOUT_S", 0.5)
    with EmbeddedNatsServer() as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="test", instance="test-reconnect")
        got: list[int] = []

        async def on_chunk(c: m.TokenChunk, _s: str) -> None:
            got.append(c.index)

        look_up = bus._stream_after_reconnect
        stopped: list[float] = []

        async def hung_as_it_looks(go_on):  # the real lookup, on a server stopped when it starts
            assert srv.pid is not None
            os.kill(srv.pid, signal.SIGSTOP)
            await until(lambda: _stopped(srv.pid), 2.0, "the server stopped")  # the signal takes a moment (2 vCPUs)
            stopped.append(time.monotonic())
            asyncio.get_running_loop().call_later(1.5, os.kill, srv.pid, signal.SIGCONT)
            return await look_up(go_on)

        try:
            await bus.subscribe(REQ_OUT, on_chunk)
            await bus.publish(REQ_OUT, m.TokenChunk(rid="r", node="w0", index=0, token_ids=[0]), rid="r", node="w0")
            await until(lambda: got == [0], 5.0, "the first chunk")
            monkeypatch.setattr(bus, "_stream_after_reconnect", hung_as_it_looks)
            assert srv.pid is not None and srv.proc is not None and srv._tmp is not None
            os.kill(srv.pid, signal.SIGKILL)
            srv.proc.wait()
            await until(lambda: not bus.nc.is_connected, 5.0, "the disconnect")
            for i in (1, 2, 3):  # held (and in nats-py's reconnect buffer, flushed into the storeless server)
                await bus.publish(REQ_OUT, m.TokenChunk(rid="r", node="w0", index=i, token_ids=[i]), rid="r", node="w0")
            shutil.rmtree(Path(srv._tmp) / "js")
            srv.restart()
            await until(lambda: stopped, 10.0, "the reconnect's lookup")
            await until(lambda: got == [0, 1, 2, 3], 10.0, "the chunks published during the outage")
            await bus.publish(REQ_OUT, m.TokenChunk(rid="r", node="w0", index=4, token_ids=[4]), rid="r", node="w0")
            await until(lambda: got == [0, 1, 2, 3, 4], 5.0, "a chunk published after")
            assert bus.counters["stream_lookup_retries"] >= 1 and bus.counters["stream_made_again"] == 1, dict(bus.counters)
            assert not bus._held and not bus._holding and not bus.stream_waiting
        finally:
            if stopped:
                os.kill(srv.pid, signal.SIGCONT)
            await bus.close()


@pytest.mark.parametrize("before", ["with_jetstream", "without_jetstream"])
async def test_readiness_says_not_ready_until_the_reconnects_lookup_answers(before):
    """The server restarts (its store kept), with JetStream (``with_jetstream``), or after a spell without it, while
    ``jetstream_missing`` was the bus's ``/readyz`` reason (``without_jetstream``), and hangs (SIGSTOP, 2 s, less than
    the 5-s lookup) just as the reconnect's check looks the stream up. ``/readyz`` (``Readiness``, sampled each 20 ms)
    must say "waiting for the JetStream stream EI_p0" from the disconnect until that lookup answers, and 200 once it
    has. Before, the check cleared ``jetstream_missing`` at its start and named the stream only once its lookup had
    gone 5 s unanswered: ``Readiness.reason()`` was None (200) throughout the hang (seen failing, both cases)."""
    with EmbeddedNatsServer() as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="test", instance="test-ready")
        readiness = Readiness(srv.url)
        readiness.bus, readiness.phase = bus, "serving"
        samples: list[tuple[float, str | None]] = []

        async def sample() -> None:
            while True:
                samples.append((time.monotonic(), readiness.reason()))
                await asyncio.sleep(0.02)

        look_up = bus._stream_after_reconnect
        answered: list[float] = []
        stopped: list[float] = []

        async def hung_as_it_looks(go_on):  # the real lookup, on a server stopped when it starts
            assert srv.pid is not None
            os.kill(srv.pid, signal.SIGSTOP)
            await until(lambda: _stopped(srv.pid), 2.0, "the server stopped")  # type: ignore[arg-type]
            stopped.append(time.monotonic())
            asyncio.get_running_loop().call_later(2.0, os.kill, srv.pid, signal.SIGCONT)
            try:
                return await look_up(go_on)
            finally:
                answered.append(time.monotonic())

        sampler = asyncio.create_task(sample())
        try:
            assert await bus.ensure_stream() is True and readiness.reason() is None
            if before == "without_jetstream":
                srv.jetstream = False
                srv.restart()
                await until(lambda: bus.jetstream_missing == "EI_p0", 10.0, "the reconnect without JetStream")
                assert readiness.reason() == f"the NATS server at {srv.url} has no JetStream (stream EI_p0): reliable messages wait for it"
                srv.jetstream = True
            bus._stream_after_reconnect = hung_as_it_looks  # type: ignore[method-assign]
            restarted = time.monotonic()
            srv.restart()
            await until(lambda: answered, 15.0, "the reconnect's lookup answered")
            await until(lambda: readiness.reason() is None, 2.0, "ready again once the lookup answered")
            during = [(t, r) for t, r in samples if restarted <= t < answered[0]]
            first = next(i for i, (_t, r) in enumerate(during) if r is not None)  # the bus saw the disconnect
            gaps = [(round(t - restarted, 2), r) for t, r in during[first:] if r is None]
            assert not gaps, f"/readyz 200 before the reconnect's lookup answered: {gaps[:5]} (stopped at {stopped})"
            hung = [r for t, r in during if stopped[0] <= t]
            assert len(hung) >= 20 and set(hung) == {"waiting for the JetStream stream EI_p0"}, set(hung)
            assert not bus.jetstream_missing and bus.jetstream and bus.counters["stream_lookup_retries"] == 0, dict(bus.counters)
        finally:
            sampler.cancel()
            if stopped:
                os.kill(srv.pid, signal.SIGCONT)
            await bus.close()
