"""A node that dies while the router's bus is slow (PONGs later than ``--fence-after-s`` / 3, as on a loaded host) is
fenced for silence, with no ``node.down`` (Slurm sends none); a hung nats-server still fences nothing, slow bus or not.

Real nats-server; the router's connection goes through :class:`~tests.integration.nats_proxy.NatsProxy`, which delays
every byte from the server (``down_delay_s``); the nodes are ``FakeCluster``'s (``test_router_live``), on their own
connection, straight to the server. Their states come every 0.1 s; a "killed" node's stop (``node.down`` is never sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.router.config import RouterConfig
from shared.bus import Bus
from shared.subjects import Subjects
from tests.integration.live import router_on_fake_cluster, wait_for
from tests.integration.nats_proxy import NatsProxy
from tests.integration.test_router_live import FENCE_S, HEARTBEAT_S, Env, FakeCluster

pytestmark = pytest.mark.timeout(60)

DELAY_S = 0.8
"""Every byte from nats-server to the router comes this late: each PONG of the router's PINGs is later than its stall
time (``FENCE_S`` / 3 = 0.5 s); the node states keep coming meanwhile (every 0.1 s, as late), so the bus is slow, not
stalled."""


@contextlib.asynccontextmanager
async def slow_router_env(nats_server, tmp_path: Path) -> AsyncIterator[tuple[Env, NatsProxy]]:
    """The router (``FENCE_S``) on a proxied connection, nodes p0 (prefill), d0 and d1 (decode) on a direct one."""
    proxy = NatsProxy(int(nats_server.url.rsplit(":", 1)[1]))
    url = await proxy.start()
    bus = await Bus.connect(nats_server.url, Subjects("p0"), service="fake", instance="fake-cluster")
    cluster = FakeCluster(bus=bus, phases={"p0": "prefill", "d0": "decode", "d1": "decode"})
    await cluster.start()
    cfg = RouterConfig(nats_url=url, port=0, port_file=str(tmp_path / "router.port"), fence_after_s=FENCE_S,
                       split_get_timeout_s=5.0, lookup_timeout_s=0.5, request_timeout_s=20.0, model="test-model",
                       decode_binding="dispatch")  # fmt: skip
    try:
        async with router_on_fake_cluster(cluster, cfg) as env:
            await wait_for(lambda: all(n in env.service.core.view.nodes for n in cluster.phases), what="every node's state")
            yield env, proxy
    finally:
        await proxy.close()


async def test_a_node_killed_while_pongs_are_slow_is_fenced_for_silence(nats_server, tmp_path):
    """d1 stops reporting (killed, no ``node.down``) while the router's PONGs come ``DELAY_S`` late (the router stays
    ready: ``/healthz`` 200 throughout once the delay's onset settled, no stall, ``bus.slow_pongs`` counted). It is fenced
    within ``DELAY_S`` + ``FENCE_S`` + 1 s of its last state sent (its last state reaches the router ``DELAY_S`` late,
    then its silence counts as the other nodes' states and the PONGs keep coming); p0 and d0 are not. Before, each
    late PONG marked the bus stalled and suspended fencing until ``FENCE_S`` + 1 s after the PONG: d1 was never
    fenced (nothing within 10 s here)."""
    async with slow_router_env(nats_server, tmp_path) as (env, proxy):
        svc, loop = env.service, asyncio.get_running_loop()
        proxy.down_delay_s = DELAY_S
        # the delay's onset is a gap of DELAY_S with nothing delivered (a stall, then its settle); from then on every
        # PONG is late while the node states come
        await asyncio.sleep(3 * DELAY_S + FENCE_S + 1.0)
        stalls, health = svc.counters["bus.stalls"], []
        for _ in range(int(3 * DELAY_S / 0.1)):
            health.append((await env.http.get("/healthz")).status_code)
            await asyncio.sleep(0.1)
        # a slow PONG while node states come is no stall: before, every late PONG marked one and its settle, and
        # /healthz answered 503 "NATS does not answer a PING" on and off (a load balancer would drop the router)
        assert set(health) == {200}, health
        assert svc.counters["bus.slow_pongs"] >= 2 and svc.counters["bus.stalls"] == stalls
        t0 = loop.time()
        env.cluster.alive.discard("d1")  # killed: no state, no node.down
        view = svc.core.view
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: view.nodes["d1"].fenced, timeout=10.0, what="d1 fenced")
        took = loop.time() - t0
        assert view.nodes["d1"].fenced, f"d1 not fenced {took:.1f} s after its last state (bus stalls: {svc.counters['bus.stalls']})"
        assert took <= DELAY_S + FENCE_S + HEARTBEAT_S + 1.0, took
        assert not view.nodes["p0"].fenced and not view.nodes["d0"].fenced
        c = dict(svc.counters)
    assert c["fenced"] == 1 and c.get("bus.stalls", 0) == stalls <= 1 and c["bus.slow_pongs"] >= 4, c


async def test_a_hung_nats_server_fences_no_node_over_a_slow_bus(nats_server, tmp_path):
    """The safety kept: nats-server SIGSTOPped ``FENCE_S`` + 2.5 s (every node silent past the fence time on the
    clock) while the router's PONGs come ``DELAY_S`` late: nothing is delivered in the hang, so no node's silence is
    counted past the fence time before its held-back states come (``fence.held_bus_quiet`` says it was held)."""
    async with slow_router_env(nats_server, tmp_path) as (env, proxy):
        svc = env.service
        proxy.down_delay_s = DELAY_S
        await asyncio.sleep(3 * DELAY_S)
        os.kill(nats_server.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(FENCE_S + 2.5)
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        await asyncio.sleep(DELAY_S + FENCE_S + 1.0)  # the burst through the delay, and time to fence wrongly
        view = svc.core.view
        assert not any(view.nodes[n].fenced for n in ("p0", "d0", "d1"))
        c = dict(svc.counters)
    assert c.get("fenced", 0) == 0 and c["fence.held_bus_quiet"] >= 3, c
    assert c["fence.rounds_held"] <= 2 * (FENCE_S + 2.5 + DELAY_S) / 0.1 + 5, c  # no 0.01-s spin while held
