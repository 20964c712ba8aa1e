"""A flood of stats requests without a reply inbox costs a decode each, not a full answer each.

Found by the 10^5-per-subject fuzz bench: 25,000 valid ``svc.stats.router``
messages published without a reply subject each made the router build its whole
StatsReply (for nobody), it fell behind, the server cut it off as a slow
consumer, and 94% of that subject's bad payloads were never seen. ``serve(...,
query=True)`` (used for ``svc.stats``) counts such a request under
``noreply.<template>`` and skips the handler; real requests are still answered.
"""

from __future__ import annotations

import asyncio

from shared import messages as m
from shared.bus import Bus
from shared.subjects import SVC_STATS, Subjects


async def test_stats_without_reply_inbox_are_counted_not_answered(nats_url):
    subj = Subjects("p0")
    svc = await Bus.connect(nats_url, subj, service="test", instance="svc")
    peer = await Bus.connect(nats_url, subj, service="test", instance="peer")
    calls = 0

    def stats() -> tuple[dict[str, int], dict[str, float]]:
        nonlocal calls
        calls += 1
        return {"work": 1}, {}

    try:
        await svc.start_service_plumbing(stats, heartbeat_interval_s=60.0)
        # the SUB leaves in the client's write buffer; without a round trip the peer's 200 publishes can reach the
        # server before it (CI, loaded: 0 of 200 counted). Bus.flush, not nats-py's nc.flush: that one writes its PING
        # straight to the socket, ahead of the SUB still queued for nats-py's flusher, so its PONG proves nothing
        # (reproduced with the flusher delayed 0.3 s: nc.flush 0 == 200, Bus.flush passes)
        await svc.flush(10)
        full = subj.format(SVC_STATS, instance="svc")
        for _ in range(200):
            await peer.publish_raw(full, m.encode(m.StatsRequest()))
        await peer.flush(10)
        for _ in range(200):  # bounded: 20 s
            if svc.counters["noreply.svc.stats.{instance}"] >= 200:
                break
            await asyncio.sleep(0.1)
        assert svc.counters["noreply.svc.stats.{instance}"] == 200
        assert calls == 0  # no answer built for nobody
        rep = await peer.request(SVC_STATS, m.StatsRequest(), instance="svc", timeout=10.0)
        assert rep.counters["work"] == 1 and calls == 1
    finally:
        await peer.close()
        await svc.close()
