"""Two processes under one instance id: a service restarted while its old process was frozen (SIGSTOP, a paused
VM), then the old one resumed. Measured with two routers named ``router`` (faultkit 2P2D, the first SIGSTOPped, a
second started on another port, the first SIGCONTed): the first answered the second's ``route.bind`` with
"request is not pending at the router", and 181 of 230 of the second's requests failed (``no decode node for the
request``), for as long as both ran. Each heartbeat now carries its process's ``boot``; a bus that hears its own
instance beat from a later process sets ``superseded`` (``shared.service`` then stops the service, exit 1)."""

from __future__ import annotations

import asyncio

import pytest

from shared import messages as m
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import SVC_HEARTBEAT, Subjects

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


async def test_a_worker_is_not_stopped_by_a_heartbeat_under_its_instance_id():
    """Every node's identity may publish ``svc.heartbeat.worker`` (one subject per kind), and reading it showed
    each worker the others' boots: worker w1 beating as ``worker-w0`` with a later boot stopped w0, and with a boot
    in the future every restart of w0 too. A worker learns it was replaced from ``node.state.<n>`` (only its own
    node's identity publishes it, ``services/worker``), not from heartbeats."""
    with EmbeddedNatsServer() as srv:
        subj = Subjects("p0")
        victim = await Bus.connect(srv.url, subj, service="worker", instance="worker-w0")
        forger = await Bus.connect(srv.url, subj, service="worker", instance="worker-w1")
        router = await Bus.connect(srv.url, subj, service="router", instance="router")
        try:
            await victim.start_service_plumbing(heartbeat_interval_s=0.1)
            await router.start_service_plumbing(heartbeat_interval_s=0.1)
            for _ in range(10):
                for who in ("worker-w0", "router"):
                    await forger.publish(SVC_HEARTBEAT, m.Heartbeat(service="worker", instance=who, pid=1, wall_ts=1.0,
                                                                    boot="9" * 20 + "-ffffffff"), service="worker")  # fmt: skip
                await asyncio.sleep(0.05)
            await forger.flush(1.0)
            await asyncio.sleep(0.3)
            assert not victim.superseded.is_set() and victim.counters["superseded"] == 0
            assert not router.superseded.is_set()  # a beat on the workers' subject is not a router's
        finally:
            for bus in (victim, forger, router):
                await bus.close()
