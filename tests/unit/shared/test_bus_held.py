"""The reliable publishes a bus keeps while the stream may be lost (``Bus._hold``) are bounded by
``RESEND_MAX_MSGS`` and ``HELD_MAX_BYTES``: the oldest go first, each counted ``stream_held_dropped``; what is
published again is each message once, in the order it was published (``Bus._in_order``)."""

from __future__ import annotations

from nats.aio.client import Client as NatsClient

import shared.bus as busmod
from shared.bus import MSG_ID, Bus
from shared.subjects import Subjects


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
