"""Two processes under one instance id: a service restarted while its old process was frozen (SIGSTOP, a paused
VM), then the old one resumed. Measured with two routers named ``router`` (faultkit 2P2D, the first SIGSTOPped, a
second started on another port, the first SIGCONTed): the first answered the second's ``route.bind`` with
"request is not pending at the router", and 181 of 230 of the second's requests failed (``no decode node for the
request``), for as long as both ran. Each heartbeat now carries its process's ``boot``; a bus that hears its own
instance beat from a later process sets ``superseded`` (``shared.service`` then stops the service, exit 1)."""

from __future__ import annotations

import asyncio

import pytest

from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects

pytestmark = pytest.mark.timeout(60)


async def test_the_earlier_of_two_processes_under_one_instance_is_told_to_stop():
    with EmbeddedNatsServer() as srv:
        subj = Subjects("p0")
        early = await Bus.connect(srv.url, subj, service="router", instance="router")
        other = await Bus.connect(srv.url, subj, service="router", instance="router-1")  # another replica: not a twin
        late = await Bus.connect(srv.url, subj, service="router", instance="router")
        try:
            for bus in (early, other, late):
                await bus.start_service_plumbing(heartbeat_interval_s=0.1)
            await asyncio.wait_for(early.superseded.wait(), 5.0)
            await asyncio.sleep(0.5)
            assert early.superseded_by == late.boot and early.counters["superseded"] == 1
            assert not late.superseded.is_set() and not other.superseded.is_set()
        finally:
            for bus in (early, other, late):
                await bus.close()
