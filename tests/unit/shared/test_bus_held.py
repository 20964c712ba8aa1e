"""The reliable publishes a bus keeps while the stream may be lost (``Bus._hold``) are bounded by
``RESEND_MAX_MSGS`` and ``HELD_MAX_BYTES``: the oldest go first, each counted ``stream_held_dropped``; what is
published again is each message once, in the order it was published (``Bus._in_order``)."""

from __future__ import annotations

import nats.errors
from nats.aio.client import Client as NatsClient

import shared.bus as busmod
from shared import messages as m
from shared.bus import MSG_ID, Bus, BusUnavailable
from shared.subjects import WORK_ABORT, Subjects


def _entry(i: int, size: int = 10) -> tuple[float, str, bytes, dict[str, str]]:
    return (float(i), "ei.p0.req.r.out", b"x" * size, {MSG_ID: f"w0-b-{i}"})


def test_the_oldest_kept_publishes_are_dropped_past_the_bounds_and_counted(monkeypatch):
    bus = Bus(NatsClient(), Subjects("p0"), service="worker", instance="w0")
    monkeypatch.setattr(busmod, "RESEND_MAX_MSGS", 3)
    for i in range(5):
        bus._hold(_entry(i))
    assert [e[0] for e in bus._held] == [2.0, 3.0, 4.0] and bus.counters["stream_held_dropped"] == 2
    monkeypatch.setattr(busmod, "HELD_MAX_BYTES", 25)
    bus._hold(_entry(5))
    assert [e[0] for e in bus._held] == [4.0, 5.0] and bus._held_bytes == 20 and bus.counters["stream_held_dropped"] == 4
    assert [e[0] for e in bus._stop_holding()] == [4.0, 5.0] and not bus._held and not bus._held_bytes and not bus._holding


def test_what_is_published_again_is_each_message_once_in_publish_order():
    a, b, c = _entry(1), _entry(2), _entry(3)
    assert Bus._in_order([b, a, c, b, a]) == [a, b, c]


class _FullBuffer:
    """A client reconnecting with its reconnect buffer full past ``accepted`` publishes: nats-py then refuses each
    publish (``OutboundBufferLimitError``), before queueing it."""

    def __init__(self, accepted: int) -> None:
        self.accepted = accepted
        self.sent: list[bytes] = []

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        if len(self.sent) >= self.accepted:
            raise nats.errors.OutboundBufferLimitError
        self.sent.append(data)


async def test_a_publish_the_client_refused_is_neither_kept_nor_in_the_window():
    """A reliable publish refused as :class:`BusUnavailable` (its caller is told it failed, may send it again or
    answer a client 503) is not kept for the stream's return nor left in the resend window: published again on a
    new stream, it would run anyway (a second copy under another message id if the caller sent it again), and at
    full load during a long outage the refused ones pushed the accepted ones (queued in nats-py's reconnect buffer,
    which went nowhere) out of the bounded ``_held``. Before, both kept it."""
    nc = _FullBuffer(accepted=2)
    bus = Bus(nc, Subjects("p0"), service="router", instance="r")  # type: ignore[arg-type]
    bus.jetstream = bus._stream_checked = bus._holding = True
    for i in range(4):
        try:
            await bus.publish(WORK_ABORT, m.RequestAbort(rid=f"r{i}"), node="w0")
        except BusUnavailable:
            assert i >= 2
    assert [e[2] for e in bus._held] == nc.sent and [e[2] for e in bus._recent] == nc.sent, (bus._held, nc.sent)
    assert bus._held_bytes == sum(map(len, nc.sent)) and bus.counters["publish_failed.work.{node}.abort"] == 2


async def test_a_publish_only_kept_for_a_lost_stream_is_refused_at_the_bounds_not_dropping_the_oldest(monkeypatch):
    """While the reconnect's lookup found the stream lost (``Bus._stream_lost``) a reliable publish is only kept, never
    sent; at ``RESEND_MAX_MSGS`` (or ``HELD_MAX_BYTES``) kept a new one is refused as :class:`BusUnavailable`, as
    nats-py refuses a publish past its reconnect buffer, and what is kept stays. Before, the oldest kept was dropped
    (``stream_held_dropped``) and the caller told it succeeded: a worker's token stream got a hole the client never
    heard of (reviewer rr-bus2)."""
    monkeypatch.setattr(busmod, "RESEND_MAX_MSGS", 3)
    nc = _FullBuffer(accepted=100)
    bus = Bus(nc, Subjects("p0"), service="worker", instance="w0")  # type: ignore[arg-type]
    bus.jetstream = bus._stream_checked = bus._holding = bus._stream_lost = True
    for i in range(3):
        await bus.publish(WORK_ABORT, m.RequestAbort(rid=f"r{i}"), node="w0")
    kept = list(bus._held)
    try:
        await bus.publish(WORK_ABORT, m.RequestAbort(rid="r3"), node="w0")
    except BusUnavailable as e:
        assert "lost the JetStream stream" in str(e) and "3 reliable publishes" in str(e), e
    else:
        raise AssertionError("a publish past the bound was taken (and the oldest kept dropped)")
    assert list(bus._held) == kept and not bus.counters["stream_held_dropped"] and nc.sent == []
    assert bus._recent[-1] is kept[-1]  # the refused one is not in the resend window either (not published again)
    assert bus.counters["publish_failed.work.{node}.abort"] == 1 and bus.counters["published.work.{node}.abort"] == 3
    monkeypatch.setattr(busmod, "HELD_MAX_BYTES", bus._held_bytes)  # the byte bound refuses the same way
    monkeypatch.setattr(busmod, "RESEND_MAX_MSGS", 10)
    try:
        await bus.publish(WORK_ABORT, m.RequestAbort(rid="r4"), node="w0")
    except BusUnavailable:
        pass
    else:
        raise AssertionError("a publish past HELD_MAX_BYTES was taken")
    assert list(bus._held) == kept and bus.counters["publish_failed.work.{node}.abort"] == 2
