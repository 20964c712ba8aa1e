"""A connection that drops while nats-py writes lets uvloop's ``RuntimeError: unable to perform operation on
<TCPTransport closed=True ...>; the handler is closed`` escape ``Client.request``/``publish``: the router's kv.lookup
during a kill of nats-server answered HTTP 500 (tests/e2e/test_faults_live.py, nats-kill, 1 request of 51). The bus
turns it into a BusError, as it does nats-py's own errors, so its callers' handling (route without cache, 503) runs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared import messages as m
from shared.bus import Bus, BusError, BusUnavailable
from shared.subjects import KV_LOOKUP, NODE_STATE, Subjects

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
