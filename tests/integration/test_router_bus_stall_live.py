"""A hung nats-server (SIGSTOP: the TCP connection stays up, nats-py calls it connected) seen from the router's
readiness and its fence loop (real nats-server, the router's service; nodes played by ``FakeCluster`` of
``test_router_live``, whose own bus hangs with the server)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.integration.polling import until
from tests.integration.test_router_live import FENCE_S, router_env

pytestmark = pytest.mark.timeout(60)


async def test_a_hung_nats_server_makes_the_router_not_ready_until_it_settled_and_the_fence_loop_does_not_spin(nats_server, tmp_path):
    """nats-server is stopped ``FENCE_S`` + 1 s (the router's PING finds it silent within ``FENCE_S`` / 2; every
    node's state is due for fencing from ``FENCE_S`` on), then goes on. ``/healthz`` (readiness) is 503 naming
    the unanswered PING through the hang, then 200 as soon as the PING is answered: while the bus settles
    (``FENCE_S`` + 1 s, no node fenced) the router dispatches on the nodes as last heard, so it is ready
    (every router of a cluster settles at once after a NATS restart: a 503 then would empty a load
    balancer's pool while they could serve). Before, it answered 200 throughout the hang (only nats-py's
    "connected" counted); with 4c98255 it stayed 503 "settling" for ``FENCE_S`` + 1 s after it.

    The fence loop, which fences no node while the bus delivers nothing (every node's fence held:
    ``fence.rounds_held``; no check while it settled after a reconnect: ``fence_checks_skipped_bus_down``), wakes
    at most every 0.5 s then, or when the bus settles: 9 rounds (measured). Before, a fence already due made it
    sleep its 0.01-s minimum: 90 and 98 rounds (measured), ~100 a second from ``FENCE_S`` into the hang to its end."""
    async with router_env(nats_server.url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        svc, loop = env.service, asyncio.get_running_loop()
        assert (await env.http.get("/healthz")).status_code == 200 and svc.ready()
        hang, after = [], []
        os.kill(nats_server.pid, signal.SIGSTOP)
        try:
            t0 = loop.time()
            while loop.time() - t0 < FENCE_S + 1.0:
                r = await env.http.get("/healthz")
                hang.append((round(loop.time() - t0, 2), r.status_code, r.json().get("error", {}).get("message", "")))
                await asyncio.sleep(0.1)
            ready_in_hang = svc.ready()
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        t1 = loop.time()
        while loop.time() - t1 < FENCE_S + 4.0:
            r = await env.http.get("/healthz")
            after.append((round(loop.time() - t1, 2), r.status_code, r.json().get("error", {}).get("message", "")))
            if r.status_code == 200:
                break
            await asyncio.sleep(0.1)
        rounds = svc.counters["fence_checks_skipped_bus_down"] + svc.counters["fence.rounds_held"]
        ready_after = svc.ready()
        st = await env.stats()
    c = st.counters
    assert c["bus.stalls"] == 1 and c.get("fenced", 0) == 0, c
    assert 1 <= rounds <= 20, f"{rounds} fence-loop rounds while the bus was stalled or settling ({FENCE_S + 1.0:.1f} s hang)"
    # the stall is seen within FENCE_S / 2 of the last PONG: the hang's second half is all 503 naming the PING
    late = [a for a in hang if a[0] >= FENCE_S / 2 + 0.3]
    assert late and not ready_in_hang, hang
    assert all(s == 503 and "NATS does not answer a PING" in text for _, s, text in late), hang
    # after: ready once the PING is answered (within FENCE_S / 2 + a poll), not after the settle
    assert after[-1][1] == 200, after
    assert all(s == 503 and "NATS does not answer a PING" in text for _, s, text in after[:-1]), after
    assert after[-1][0] <= FENCE_S / 2 + 0.5 and ready_after, after


async def test_a_deaf_router_bus_reconnects_at_its_next_probe_and_fences_nothing(nats_server, tmp_path):
    """The router's nats-py client goes deaf (its read loop ends, as an ``InvalidStateError`` in ``_process_pong`` ends
    it; the client stays "connected"): its probe's PING ends ``DeafClient`` (no PING sent) and the bus is made to
    reconnect at once (``Bus.reconnect_deaf``, nats-py's ``force_reconnect``). Before, it heard no node state, fenced
    every node after ``FENCE_S`` and a request got a 503 'no live node', until nats-py's own PINGs (every 2 min, two
    unanswered) called the connection stale."""
    async with router_env(nats_server.url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        svc, loop = env.service, asyncio.get_running_loop()
        assert (await env.http.get("/healthz")).status_code == 200
        reading = svc.bus.nc._reading_task
        reading.cancel()
        await asyncio.wait({reading}, timeout=5)
        assert svc.bus.nc.is_connected and reading.done()
        t0 = loop.time()
        while svc.counters["bus.deaf_reconnects"] == 0 and loop.time() - t0 < FENCE_S:
            await asyncio.sleep(0.05)
        took = loop.time() - t0
        await asyncio.sleep(3 * FENCE_S)  # node states heard again: none is due for fencing
        nc = svc.bus.nc
        assert nc.is_connected and not nc._reading_task.done(), "the router's client is still deaf"
        r = await env.http.post("/v1/completions", json={"model": "test-model", "prompt": list(range(100)), "max_tokens": 3})
        st = await env.stats()
    c = st.counters
    assert c["bus.deaf_reconnects"] == 1 and svc.bus.counters["nats.reconnects"] >= 1, c
    assert took <= FENCE_S / 2, f"the deaf client was made to reconnect {took:.2f} s after it went deaf"
    assert c.get("fenced", 0) == 0, c
    assert r.status_code == 200, r.text


async def test_a_router_bus_deaf_with_its_probe_s_ping_in_flight_reconnects_and_fences_nothing(nats_server, tmp_path):
    """nats-server stopped a moment (SIGSTOP: the probe's PING waits for its PONG), the router's read loop ends
    meanwhile, then the server goes on: that PONG reaches a socket nobody reads. The probe sees the client deaf and
    makes it reconnect (``Bus.reconnect_deaf``). Before, it waited for that PONG for good: the bus "stalled", fencing
    suspended and no node state heard for the router's lifetime (reconnected only once nats-py's own PINGs, every 2
    min, two unanswered, called the connection stale)."""
    async with router_env(nats_server.url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        svc, loop = env.service, asyncio.get_running_loop()
        assert (await env.http.get("/healthz")).status_code == 200
        os.kill(nats_server.pid, signal.SIGSTOP)
        try:
            # the probe PINGs every FENCE_S / 6: one is in flight within FENCE_S / 3 (bounded: a loaded host's loop lags)
            await until(lambda: any(not p.future.done() for p in svc.bus._pings), FENCE_S, "a PING in flight")
            reading = svc.bus.nc._reading_task
            reading.cancel()
            await asyncio.wait({reading}, timeout=5)
            assert svc.bus.nc.is_connected and reading.done()
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        t0 = loop.time()
        while svc.counters["bus.deaf_reconnects"] == 0 and loop.time() - t0 < 2 * FENCE_S:
            await asyncio.sleep(0.05)
        took = loop.time() - t0
        await asyncio.sleep(3 * FENCE_S)  # the bus settles, node states heard again: none is due for fencing
        nc = svc.bus.nc
        assert nc.is_connected and not nc._reading_task.done(), "the router's client is still deaf"
        r = await env.http.post("/v1/completions", json={"model": "test-model", "prompt": list(range(100)), "max_tokens": 3})
        st = await env.stats()
    c = st.counters
    assert c["bus.deaf_reconnects"] == 1, c
    assert took <= FENCE_S, f"the deaf client was made to reconnect {took:.2f} s after the server went on"
    assert c.get("fenced", 0) == 0, c
    assert r.status_code == 200, r.text
