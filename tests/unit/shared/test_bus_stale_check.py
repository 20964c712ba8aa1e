"""A reconnect's stream check that a later disconnect outlived (``Bus._after_reconnect``, its lookup answered after
the connection dropped again, as an old server answering just before it dies): it must neither say the stream is
there (``stream_waiting`` cleared: ``/readyz`` 200) nor stop keeping the reliable publishes (``_holding``) and
send what it would publish again while the bus is disconnected: those go into nats-py's reconnect buffer, which
flushes them into the next server before that reconnect's check, where a server back without its store loses
them. The next reconnect's check decides. Sans-IO: a fake client whose stream lookup answers when the test says."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec

import shared.bus as busmod
from shared import messages as m
from shared.bus import Bus, stream_name
from shared.subjects import WORK_ABORT, Subjects


class _Client:
    """What ``Bus._after_reconnect`` touches of nats-py's client: ``jetstream().stream_info`` answers each lookup
    with the next future of ``answers`` (set by the test), ``publish`` records what was sent."""

    def __init__(self) -> None:
        self.answers: asyncio.Queue[asyncio.Future[Any]] = asyncio.Queue()
        self.sent: list[bytes] = []
        self.is_closed = False
        self.is_connected = True

    def jetstream(self, timeout: float = 5.0) -> Any:
        async def stream_info(_name: str) -> Any:
            return await (await self.answers.get())

        return SimpleNamespace(stream_info=stream_info)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.sent.append(data)


def _rid(data: bytes) -> str:
    """The request id of a published ``RequestAbort``."""
    return msgspec.msgpack.decode(data, type=m.RequestAbort).rid


def _info(created: str) -> Any:
    """A stream's info (``StreamInfo``) as the check reads it: a stream over every subject of partition p0."""
    return SimpleNamespace(created=created, state=SimpleNamespace(first_seq=1, last_seq=10), config=SimpleNamespace(subjects=["ei.p0.>"]))


async def _outlived_check(monkeypatch) -> tuple[Bus, _Client, asyncio.Future[Any]]:
    """A bus on JetStream that disconnected, reconnected (its check began, looking the stream up) and disconnected
    again; returns it, its client, and the check's pending lookup answer."""
    monkeypatch.setattr(busmod, "RESEND_WINDOW_S", -1.0)  # nothing in the resend window: only what is kept survives
    nc = _Client()
    bus = Bus(nc, Subjects("p0"), service="router", instance="r")  # type: ignore[arg-type]
    bus.jetstream = bus._stream_checked = True
    bus._stream_created = "t0"
    bus._disconnected()
    await bus.publish(WORK_ABORT, m.RequestAbort(rid="during-outage-1"), node="w0")
    answer = asyncio.get_running_loop().create_future()
    nc.answers.put_nowait(answer)
    check = asyncio.create_task(bus._after_reconnect())
    await asyncio.sleep(0)  # the check began: its lookup waits for an answer
    assert bus._reconnects_seen == 1 and not check.done()
    bus._disconnected()  # the connection drops again while the check looks
    bus._tasks.append(check)
    return bus, nc, answer


async def test_a_check_outlived_by_a_disconnect_keeps_holding_and_sends_nothing(monkeypatch):
    """The check's lookup answers (the same stream) after the second disconnect: before, it stopped holding and
    published what it kept into the reconnect buffer (seen failing: ``_holding`` False, 1 sent), so a publish for
    the rest of that outage was neither kept nor in the window, and a next server without the store lost it. Now it
    keeps holding; the next reconnect's check, on a new stream, publishes everything kept since the first
    disconnect, in order."""
    bus, nc, answer = await _outlived_check(monkeypatch)
    sent_before = len(nc.sent)  # the publish during the outage went to the (reconnect-buffered) client
    answer.set_result(_info("t0"))
    await asyncio.wait_for(bus._tasks[-1], 5.0)
    assert bus._holding, "a check that began before the latest disconnect stopped holding"
    assert len(nc.sent) == sent_before, "a check that began before the latest disconnect sent into the outage"
    await bus.publish(WORK_ABORT, m.RequestAbort(rid="during-outage-2"), node="w0")
    assert [_rid(e[2]) for e in bus._held] == ["during-outage-1", "during-outage-2"]
    # the next server came back without its store: its check finds a new stream and publishes what was kept
    nc.answers.put_nowait(done := asyncio.get_running_loop().create_future())
    done.set_result(_info("t1"))
    nc.sent.clear()
    await asyncio.wait_for(bus._after_reconnect(), 5.0)
    assert [_rid(d) for d in nc.sent] == ["during-outage-1", "during-outage-2"]
    assert not bus._holding and bus.stream_waiting == "" and bus.counters["stream_recreated"] == 1


async def test_a_check_outlived_by_a_disconnect_does_not_say_the_stream_is_there(monkeypatch):
    """``stream_waiting`` (``/readyz`` 503 "waiting for the JetStream stream") stays set when a check that began before
    the latest disconnect ends (``Bus._wait_over``'s guard; seen failing with it replaced by ``if True:``), and is
    cleared by the check of the reconnect after it, once its lookup answered."""
    bus, nc, answer = await _outlived_check(monkeypatch)
    name = stream_name(Subjects("p0"))
    assert bus.stream_waiting == name
    answer.set_result(_info("t0"))
    await asyncio.wait_for(bus._tasks[-1], 5.0)
    assert bus.stream_waiting == name, "a check older than the latest disconnect cleared readiness"
    nc.answers.put_nowait(done := asyncio.get_running_loop().create_future())
    check = asyncio.create_task(bus._after_reconnect())
    await asyncio.sleep(0)
    assert bus.stream_waiting == name  # the reconnect's check began, no answer yet
    done.set_result(_info("t0"))
    await asyncio.wait_for(check, 5.0)
    assert bus.stream_waiting == "" and not bus._holding
