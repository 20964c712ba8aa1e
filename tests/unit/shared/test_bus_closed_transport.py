"""A connection that drops while nats-py writes lets uvloop's ``RuntimeError: unable to perform operation on
<TCPTransport closed=True ...>; the handler is closed`` escape ``Client.request``/``publish``: the router's kv.lookup
during a kill of nats-server answered HTTP 500 (tests/e2e/test_faults_live.py, nats-kill, 1 request of 51). The bus
turns it into a BusError, as it does nats-py's own errors, so its callers' handling (route without cache, 503) runs."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from shared import messages as m
from shared.bus import Bus, BusError, BusUnavailable
from shared.subjects import KV_LOOKUP, NODE_STATE, ROUTE_PLACED, Subjects

CLOSED = "unable to perform operation on <TCPTransport closed=True reading=False 0x5564>; the handler is closed"


class _ClosedNc:
    """A nats-py client whose transport the server's death just closed."""

    is_connected = True

    async def request(self, *a: Any, **k: Any) -> Any:
        raise RuntimeError(CLOSED)

    async def publish(self, *a: Any, **k: Any) -> None:
        raise RuntimeError(CLOSED)


def _bus() -> Bus:
    return Bus(_ClosedNc(), Subjects("p0"), service="router", instance="router")  # type: ignore[arg-type]


def test_a_request_on_a_closed_transport_is_a_bus_error_and_counted() -> None:
    bus = _bus()
    with pytest.raises(BusError, match="RuntimeError"):
        asyncio.run(bus.request(KV_LOOKUP, m.KvLookupRequest(block_hashes=[1, 2], block_size=64), timeout=0.5))
    assert bus.counters["request_failed." + KV_LOOKUP.template] == 1


def test_a_publish_on_a_closed_transport_is_bus_unavailable_and_counted() -> None:
    bus = _bus()
    with pytest.raises(BusUnavailable, match="RuntimeError"):
        asyncio.run(bus.publish(NODE_STATE, m.NodeState(node="w0", phase="both"), node="w0"))
    assert bus.counters["publish_failed." + NODE_STATE.template] == 1


def test_a_reliable_publish_on_a_closed_transport_is_kept_for_the_resend_not_raised() -> None:
    """The full suite's nats-kill (this session's third run): the router's publish of route.placed hit the closed
    transport and the request got a 503 ('cannot dispatch to node w3: cannot publish on route.placed: RuntimeError').
    A reliable message is in the resend window before nats-py writes it, and the disconnect that follows keeps that
    window for the reconnect: the publish returns, counted as deferred, and the message waits there."""
    bus = _bus()
    bus.jetstream, bus._stream_checked = True, True
    placed = m.RoutePlaced(rid="r1", branch_id="b1", node="w3", phase="prefill", block_hashes=[1, 2], src="router")
    asyncio.run(bus.publish(ROUTE_PLACED, placed))
    assert bus.counters["publish_deferred." + ROUTE_PLACED.template] == 1
    assert bus.counters["publish_failed." + ROUTE_PLACED.template] == 0
    (_t, subject, data, hdr), = bus._recent
    assert subject.endswith("route.placed") and msgspec.msgpack.decode(data, type=m.RoutePlaced) == placed and hdr
