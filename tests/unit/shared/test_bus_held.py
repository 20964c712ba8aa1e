"""The reliable publishes a bus keeps while the stream may be lost (``Bus._hold``) are bounded by
``RESEND_MAX_MSGS`` and ``HELD_MAX_BYTES``: the oldest go first, each counted ``stream_held_dropped``; what is
published again is each message once, in the order it was published (``Bus._in_order``)."""

from __future__ import annotations

import msgspec
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
        self.is_closed = False

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        if self.is_closed:
            raise nats.errors.ConnectionClosedError
        if len(self.sent) >= self.accepted:
            raise nats.errors.OutboundBufferLimitError
        self.sent.append(data)


async def test_a_publish_the_client_refused_is_not_in_the_window():
    """A reliable publish refused as :class:`BusUnavailable` (its caller is told it failed, may send it again or
    answer a client 503) is not left in the resend window: published again after a reconnect, it would run anyway
    (a second copy under another message id if the caller sent it again). Before, the window kept it."""
    nc = _FullBuffer(accepted=2)
    bus = Bus(nc, Subjects("p0"), service="router", instance="r")  # type: ignore[arg-type]
    bus.jetstream = bus._stream_checked = True
    for i in range(4):
        try:
            await bus.publish(WORK_ABORT, m.RequestAbort(rid=f"r{i}"), node="w0")
        except BusUnavailable:
            assert i >= 2
    assert [e[2] for e in bus._recent] == nc.sent and len(nc.sent) == 2 and not bus._held, (bus._recent, nc.sent)
    assert bus.counters["publish_failed.work.{node}.abort"] == 2


async def test_reliable_publishes_are_only_kept_while_holding_then_follow_the_window_in_order():
    """From a disconnect until the reconnect's check found the stream (``Bus._holding``) a reliable publish is only
    kept, not handed to nats-py (whose reconnect flush would store it ahead of the older window published again);
    the check publishes the window, then what was kept, then what was kept while those went out, and only then stops
    holding (``Bus._publish_kept``)."""
    nc = _FullBuffer(accepted=100)
    bus = Bus(nc, Subjects("p0"), service="router", instance="r")  # type: ignore[arg-type]
    bus.jetstream = bus._stream_checked = bus._holding = True
    for i in range(2):
        await bus.publish(WORK_ABORT, m.RequestAbort(rid=f"kept{i}"), node="w0")
    assert nc.sent == [] and len(bus._held) == 2 and bus.counters["published.work.{node}.abort"] == 2
    window = [(0.0, "ei.p0.work.w0.abort", b"window", {MSG_ID: "r-old-1"})]
    real = nc.publish

    async def publish_and_meanwhile(subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        await real(subject, data, headers)
        if len(nc.sent) == 1:  # another task publishes while the kept ones go out
            await bus.publish(WORK_ABORT, m.RequestAbort(rid="meanwhile"), node="w0")

    nc.publish = publish_and_meanwhile  # type: ignore[method-assign]
    await bus._publish_kept(window)
    rids = [b"window"] + [msgspec.msgpack.decode(d, type=m.RequestAbort).rid.encode() for d in nc.sent[1:]]
    assert rids == [b"window", b"kept0", b"kept1", b"meanwhile"], rids
    assert not bus._holding and not bus._held and bus.counters["resent"] == 4
    await bus.publish(WORK_ABORT, m.RequestAbort(rid="after"), node="w0")
    assert len(nc.sent) == 5  # sent at once


async def test_a_disconnect_while_the_kept_publishes_go_out_leaves_them_to_the_next_check():
    """A disconnect while ``Bus._publish_kept`` publishes: what it was publishing may have died in the socket and is
    older than the window the disconnect takes, so it goes back into ``_resend``, and the holding goes on (the next
    reconnect's check ends it)."""
    nc = _FullBuffer(accepted=100)
    bus = Bus(nc, Subjects("p0"), service="router", instance="r")  # type: ignore[arg-type]
    bus.jetstream = bus._stream_checked = bus._holding = True
    await bus.publish(WORK_ABORT, m.RequestAbort(rid="kept0"), node="w0")
    window = [(0.0, "ei.p0.work.w0.abort", b"window", {MSG_ID: "r-old-1"})]
    real = nc.publish

    async def publish_then_lost(subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        await real(subject, data, headers)
        bus._js_disconnects += 1  # as _disconnected() does, while the batch goes out

    nc.publish = publish_then_lost  # type: ignore[method-assign]
    await bus._publish_kept(window)
    assert bus._holding and [e[2] for e in bus._resend] == nc.sent and len(nc.sent) == 2


async def test_a_reliable_publish_on_a_closed_client_is_refused_not_kept():
    """A client closed under the bus (its disconnected callback started the holding) never reconnects: a reliable
    publish is refused as :class:`BusUnavailable` (a router answers 503), not kept for a check that never comes (the
    request waited out its timeout, 504: tests/integration/test_router_live.py)."""
    nc = _FullBuffer(accepted=100)
    nc.is_closed = True
    bus = Bus(nc, Subjects("p0"), service="router", instance="r")  # type: ignore[arg-type]
    bus.jetstream = bus._stream_checked = bus._holding = True
    try:
        await bus.publish(WORK_ABORT, m.RequestAbort(rid="r0"), node="w0")
    except BusUnavailable as e:
        assert "ConnectionClosedError" in str(e)
    else:
        raise AssertionError("a publish on a closed client was not refused")
    assert not bus._held and not bus._recent and bus.counters["publish_failed.work.{node}.abort"] == 1
