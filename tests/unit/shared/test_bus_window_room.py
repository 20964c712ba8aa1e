"""``Bus.window_room``: a publisher of a burst larger than the resend window (a router's republish) waits until the
window has room, so no publish leaves it before the server was seen to read it; bounded by a timeout (a hung server
confirms nothing) and refused for a ``room`` the window cannot have. The live proof (a 65,536-branch republish, none
dropped from the window): ``tests/integration/test_branch_end_heard_live.py``."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client as NatsClient

import shared.bus as busmod
from shared.bus import MSG_ID, Bus
from shared.subjects import Subjects


def _fill(bus: Bus, n: int, at: float) -> None:
    for i in range(n):
        bus._recent.append((at, "ei.p0.branch.events", b"x", {MSG_ID: f"r-b-{i}"}))


async def test_it_waits_until_the_window_has_room(monkeypatch):
    monkeypatch.setattr(busmod, "RESEND_MAX_MSGS", 10)
    monkeypatch.setattr(busmod, "RESEND_WINDOW_S", 0.2)  # no confirm loop: the window is the last RESEND_WINDOW_S
    bus = Bus(NatsClient(), Subjects("p0"), service="router", instance="r")
    _fill(bus, 8, time.monotonic())
    assert bus.unconfirmed() == 8
    t0 = time.monotonic()
    assert await bus.window_room(4, timeout_s=5.0)  # 8 > 10 - 4: waits until they age out of the window
    assert 0.15 <= time.monotonic() - t0 < 2.0 and bus.unconfirmed() == 0
    assert await bus.window_room(10, timeout_s=0.0)  # room already: at once


async def test_a_window_that_never_empties_is_waited_for_timeout_s_at_most(monkeypatch):
    monkeypatch.setattr(busmod, "RESEND_MAX_MSGS", 10)
    bus = Bus(NatsClient(), Subjects("p0"), service="router", instance="r")
    _fill(bus, 9, time.monotonic() + 3600.0)  # not confirmed for an hour (a hung server)
    t0 = time.monotonic()
    assert not await bus.window_room(2, timeout_s=0.1)
    assert time.monotonic() - t0 < 1.0 and bus.unconfirmed() == 9
    bus._closing = True
    assert not await asyncio.wait_for(bus.window_room(2, timeout_s=60.0), 1.0)  # a closing bus does not wait


async def test_a_room_the_window_cannot_have_is_refused():
    bus = Bus(NatsClient(), Subjects("p0"), service="router", instance="r")
    for bad in (0, -1, busmod.RESEND_MAX_MSGS + 1):
        with pytest.raises(ValueError, match="room"):
            await bus.window_room(bad, 1.0)
