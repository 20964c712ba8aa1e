"""A nats-server restarted WITHOUT JetStream under a bus on JetStream (an operator's config without ``-js``, a
container started without its JetStream flag), then with it again. Before, the reconnect's stream lookup got "no
responders", returned None and left ``bus.jetstream`` True: the reliable subscriptions (JetStream consumers) got
nothing and the reliable publishes went to core NATS where nobody listened: lost without a word, and /readyz 200.
Now the bus keeps the reliable publishes (held, bounded as for a lost stream), its /readyz reason names the missing
JetStream, a warning says so (at once, then every ``STREAM_BACK_WAIT_S``), and when JetStream is back (a restart
with it: the same stream from the kept store, or none: made again) what was kept is published in order."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

import shared.bus as busmod
from shared import messages as m
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.service import Readiness
from shared.subjects import REQ_OUT, Subjects
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("store", ["kept", "wiped"])
async def test_a_server_back_without_jetstream_holds_reliable_publishes_until_it_is_back(store, monkeypatch):
    # the resend window (what a reconnect publishes again anyway) shorter than the time without JetStream: before,
    # the window alone carried a chunk published then across a short outage
    monkeypatch.setattr(busmod, "RESEND_WINDOW_S", 0.2)
    with EmbeddedNatsServer() as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="test", instance="test-nojs")
        readiness = Readiness(srv.url)
        readiness.bus, readiness.phase = bus, "serving"
        got: list[int] = []

        async def on_chunk(c: m.TokenChunk, _s: str) -> None:
            got.append(c.index)

        try:
            await bus.subscribe(REQ_OUT, on_chunk)
            await bus.publish(REQ_OUT, m.TokenChunk(rid="r", node="w0", index=0, token_ids=[0]), rid="r", node="w0")
            await until(lambda: got == [0], 5.0, "the first chunk")
            srv.jetstream = False
            srv.restart()  # SIGKILL, then a server without JetStream on the same port
            await until(lambda: bus.counters["nats.reconnects"] == 1 and bus.jetstream_missing, 10.0, "the reconnect without JetStream")
            assert readiness.reason() == "the NATS server at " + srv.url + " has no JetStream (stream EI_p0): reliable messages wait for it"
            assert bus.counters["jetstream_missing_warnings"] == 1, dict(bus.counters)
            for i in (1, 2, 3):
                await bus.publish(REQ_OUT, m.TokenChunk(rid="r", node="w0", index=i, token_ids=[i]), rid="r", node="w0")
            await asyncio.sleep(0.5)
            assert got == [0] and len(bus._held) >= 3, (got, len(bus._held))  # kept, not sent into the void
            srv.jetstream = True
            if store == "wiped":
                assert srv._tmp is not None
                shutil.rmtree(Path(srv._tmp) / "js")
            srv.restart()
            await until(lambda: got == [0, 1, 2, 3], 15.0, "the chunks published while JetStream was gone")
            await bus.publish(REQ_OUT, m.TokenChunk(rid="r", node="w0", index=4, token_ids=[4]), rid="r", node="w0")
            await until(lambda: got == [0, 1, 2, 3, 4], 10.0, "a chunk published after")
            assert not bus.jetstream_missing and not bus._held and not bus._holding and readiness.reason() is None, (dict(bus.counters), bus._reconnects_seen)
            assert bus.counters["stream_made_again"] == (store == "wiped"), dict(bus.counters)
        finally:
            await bus.close()
