"""Per-subject bus series on a real nats-server: every subject a service subscribes to or serves
has its ``ei_bus_messages_dropped_total`` / ``ei_bus_handler_errors_total`` /
``ei_bus_messages_received_total`` series from the start, at 0.

Before, a family had no series until its first event, so the dashboard's "Malformed messages
dropped" panel (``sum by (subject) (rate(ei_bus_messages_dropped_total[...]))``) showed "No data" on
a healthy cluster — the same as a service that is not scraped at all.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared import messages as m
from shared.bus import Bus
from shared.metrics import make_registry
from shared.subjects import KV_EVENTS, KV_LOOKUP, Subjects
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(30)


def series(reg, name: str) -> dict[str, float]:
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    return {s.labels["subject"]: s.value for s in fams[name].samples}


async def test_every_subscribed_or_served_subject_has_its_bus_series_at_zero_before_any_message(nats_url):
    subs = Subjects("p0")
    bus = await Bus.connect(nats_url, subs, service="kvdirectory", instance="kvdirectory")
    peer = await Bus.connect(nats_url, subs, service="test", instance="test")
    try:
        async def on_events(_msg, _s):
            pass

        async def on_lookup(_req, _s):
            return m.KvLookupReply(block_size=4)

        await bus.subscribe(KV_EVENTS, on_events)
        await bus.serve(KV_LOOKUP, on_lookup)
        reg = make_registry(bus)
        want = {KV_EVENTS.template: 0.0, KV_LOOKUP.template: 0.0}
        for name in ("ei_bus_messages_dropped", "ei_bus_handler_errors", "ei_bus_messages_received"):
            assert series(reg, name) == want, name

        await peer.publish_raw(subs.format(KV_EVENTS, node="w0"), b"\xc1 not msgpack")
        await peer.nc.flush()
        await until(lambda: bus.counters["dropped." + KV_EVENTS.template] == 1, what="the malformed message counted")
        assert series(reg, "ei_bus_messages_dropped") == {KV_EVENTS.template: 1.0, KV_LOOKUP.template: 0.0}
    finally:
        await peer.close()
        await bus.close()
