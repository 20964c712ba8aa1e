"""The supervisors' own NATS client gone deaf (connected, its read loop ended, as an ``InvalidStateError`` in nats-py's
``_process_pong`` ends it): ``up``'s liveness probe (``LocalCluster._probe``) and the Slurm job's watcher
(:class:`evolving_infra.liveness.Watcher`) make it reconnect at once (:class:`evolving_infra.liveness.BusProbe`,
``Bus.reconnect_deaf``) and hear heartbeats again; real nats-server, a loopback proxy between the watcher and it.

Before, neither reconnected: a PING on the deaf client ended ``DeafClient`` (or, sent before the read loop ended,
waited for good for a PONG nats-py could no longer read), no heartbeat was heard again and no service was judged
(a hung one never killed) until nats-py's own PINGs (every 2 min, two unanswered) called the connection stale.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from argparse import Namespace

import pytest

from evolving_infra.cluster import ClusterSpec, LocalCluster
from evolving_infra.liveness import NATS_PROBE_TIMEOUT_S, Watcher
from shared import messages as m
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import SVC_HEARTBEAT, Subjects
from tests.integration.nats_proxy import NatsProxy

pytestmark = pytest.mark.timeout(90)

TIMEOUT_S = 6.0
"""The watch's liveness timeout here (wall s): a hung service is killed within the test's watch."""

RECONNECT_WITHIN_S = 2 * NATS_PROBE_TIMEOUT_S + 2.0
"""How soon a deaf client is made to reconnect: the round under way (a PING waited for up to
:data:`NATS_PROBE_TIMEOUT_S`), its 1-s sleep, one more round."""


async def _until(cond, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {limit_s} s: {what}"
        await asyncio.sleep(0.05)


async def _deafen(bus: Bus) -> float:
    """End ``bus``'s nats-py read loop (the client stays "connected"); returns when (monotonic s)."""
    reading = bus.nc._reading_task
    reading.cancel()
    await asyncio.wait({reading}, timeout=5)
    assert bus.nc.is_connected and reading.done()
    return time.monotonic()


def _hearing(bus: Bus) -> bool:
    nc = bus.nc
    return nc.is_connected and nc._reading_task is not None and not nc._reading_task.done()


@pytest.mark.parametrize("when", ["idle", "ping_in_flight"])
async def test_a_deaf_watcher_reconnects_hears_heartbeats_again_and_still_kills_a_hung_service(tmp_path, monkeypatch, when):
    """``idle``: the read loop ends between rounds (the next PING ends ``DeafClient``). ``ping_in_flight``: it ends
    while a PING waits for its PONG (the proxy holds the server's bytes), which then never comes. Either way the
    watcher reconnects within :data:`RECONNECT_WITHIN_S`, hears the beats again, kills nothing for its deaf spell,
    and still kills the service once it stops beating."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the watched "router"
    (tmp_path / "router.pid").write_text(f"{child.pid} {os.getpid()}")
    with EmbeddedNatsServer() as srv:
        proxy = NatsProxy(int(srv.url.rsplit(":", 1)[1]))
        monkeypatch.setenv("EI_NATS_URL", await proxy.start())
        monkeypatch.setenv("EI_PARTITION", "p0")
        beater = await Bus.connect(srv.url, Subjects("p0"), service="router", instance="router")
        stop = asyncio.Event()

        async def beat() -> None:
            while not stop.is_set():
                await beater.publish(SVC_HEARTBEAT, m.Heartbeat(service="router", instance="router", pid=child.pid), service="router")
                await asyncio.sleep(0.25)

        watcher = Watcher(Namespace(pid_dir=str(tmp_path), services=["router"], nats_port=None, creds="",
                                    timeout_s=TIMEOUT_S, start_timeout_s=TIMEOUT_S))  # fmt: skip
        beating = asyncio.create_task(beat())
        running = asyncio.create_task(watcher.run())
        try:
            await _until(lambda: watcher.bus is not None and watcher.watch.bus_last_ok is not None, 20, "the watcher's PING answered")
            w = watcher.watch.procs
            await _until(lambda: w.get("router") is not None and w["router"].last_ok is not None, 10, "a heartbeat seen")
            bus = watcher.bus
            assert bus is not None
            if when == "ping_in_flight":
                link = proxy.links[0]
                link.flowing.clear()  # the server's bytes wait in the proxy: the next PING waits for its PONG
                await _until(lambda: any(not p.future.done() for p in bus._pings), 5, "a PING in flight")
                deaf_at = await _deafen(bus)
                link.flowing.set()  # its PONG reaches the socket; no read loop reads it
            else:
                deaf_at = await _deafen(bus)
            await _until(lambda: bus.counters["nats.deaf_reconnects"] >= 1, RECONNECT_WITHIN_S, "the deaf client reconnected")
            reconnected = time.monotonic() - deaf_at
            await _until(lambda: _hearing(bus), 10, "the watcher's client reading again")
            await _until(lambda: w["router"] is not None and (w["router"].last_ok or 0) > deaf_at + reconnected + 0.5, 10,
                         "a heartbeat heard after the reconnect")  # fmt: skip
            assert bus.counters["nats.deaf_reconnects"] == 1, dict(bus.counters)
            await _until(lambda: watcher.watch.bus_ok_since is not None, 10, "the services judged again")
            ok_since = watcher.watch.bus_ok_since  # the deaf spell is no silence of the services: judged from after it
            assert ok_since is not None and ok_since > deaf_at, (ok_since, deaf_at)
            assert child.poll() is None and not w["router"].killed, "the watcher SIGKILLed a router that beat all along"
            # judged again: a service that stops beating is killed after its timeout
            stop.set()
            await asyncio.wait_for(beating, 5)
            stopped = time.monotonic()
            await _until(lambda: child.poll() is not None, TIMEOUT_S + 6.0, "the silent router SIGKILLed")
            assert time.monotonic() - stopped >= TIMEOUT_S - 0.5
        finally:
            stop.set()
            running.cancel()
            beating.cancel()
            await asyncio.gather(running, beating, return_exceptions=True)
            if watcher.bus is not None:
                await watcher.bus.close()
            await beater.close()
            await proxy.close()
            child.kill()
            child.wait()


async def test_up_s_deaf_probe_reconnects_and_restarts_the_services_clocks():
    """``up``'s probe (``LocalCluster._probe``) on a launcher client whose read loop ended: reconnected within
    :data:`RECONNECT_WITHIN_S`, its PINGs answered again, and the services' clocks (``_bus_ok_since``) start again
    after the deaf spell, not before it (its unheard beats are no silence of the services)."""
    with EmbeddedNatsServer() as srv:
        c = LocalCluster(ClusterSpec(restart=True, liveness_timeout_s=10.0))
        bus = await Bus.connect(srv.url, Subjects("p0"), service="launcher", instance="launcher")
        c._bus = bus
        prober = asyncio.create_task(c._probe())
        try:
            await _until(lambda: c._bus_last_ok is not None, 10, "up's PING answered")
            c.supervise_once()
            assert c._bus_ok_since is not None
            deaf_at = await _deafen(bus)
            await _until(lambda: bus.counters["nats.deaf_reconnects"] >= 1, RECONNECT_WITHIN_S, "up's deaf client reconnected")
            await _until(lambda: (c._bus_last_ok or 0) > deaf_at, 10, "up's PING answered after the reconnect")
            assert _hearing(bus)
            c.supervise_once()
            assert c._bus_ok_since is not None and c._bus_ok_since > deaf_at, (c._bus_ok_since, deaf_at)
        finally:
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
            await bus.close()
