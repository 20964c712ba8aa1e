"""The stream lookup of :meth:`Bus.ensure_stream` on a real nats-server: one that gets no answer in time (the
server hung, SIGSTOP, as a loaded one is slow) is made again, and the bus stays on JetStream once the server
answers. Before, that one timeout put the bus on core NATS (at most once) for its whole life: measured with the
5-s lookup and a 6-s SIGSTOP, ensure_stream returned False. A server without JetStream still makes it fall
back, at once (it answers "no responders")."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import shared.bus as busmod
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects

pytestmark = pytest.mark.timeout(30)


async def test_a_stream_lookup_without_an_answer_is_made_again_and_the_bus_stays_on_jetstream(monkeypatch):
    monkeypatch.setattr(busmod, "STREAM_LOOKUP_TIMEOUT_S", 0.5)
    with EmbeddedNatsServer() as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="test", instance="test-lookup")
        try:
            assert srv.pid is not None
            os.kill(srv.pid, signal.SIGSTOP)
            try:
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
    with EmbeddedNatsServer(jetstream=False) as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="test", instance="test-nojs")
        try:
            t = time.monotonic()
            assert await bus.ensure_stream() is False
            assert time.monotonic() - t < 1.0 and not bus.jetstream and not bus.counters["stream_lookup_retries"]
        finally:
            await bus.close()
