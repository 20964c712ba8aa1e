"""A service's ``/readyz`` (its ``--metrics-port``, ``shared.service``) follows its NATS connection, on a real
nats-server: 503 with the reason while NATS cannot be reached at start (the health port opens before the
connect: ``/healthz`` answers 200 meanwhile), while the bus is disconnected later, and while it waits for a
JetStream stream the server lost; 200 again once the bus is back. ``/metrics`` says the same: ``ei_service_ready``
0 with the reason's kind, then 1. A Kubernetes or compose user expects
readiness to drop while the service cannot do its job; liveness (``/healthz``) stays 200 throughout."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest

from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until(http, url: str, ok, what: str, task: asyncio.Task, within_s: float = 10.0):
    """GET ``url`` every 0.05 s until ``ok(response)``; the response. A transport error (port closed) is retried."""
    import httpx

    end = time.monotonic() + within_s
    last = None
    while True:
        assert not task.done(), f"the service ended while waiting for {what}: {task}"
        try:
            last = await http.get(url)
            if ok(last):
                return last
        except httpx.TransportError as e:
            last = e
        assert time.monotonic() < end, f"no {what} in {within_s} s: last {getattr(last, 'text', last)!r}"
        await asyncio.sleep(0.05)


def _not_ready(reason: str):
    return lambda r: r.status_code == 503 and r.json() == {"status": "not ready", "reason": reason}


def _ok(r) -> bool:
    return r.status_code == 200


async def _ready_metric(http, base: str) -> dict[str, float]:
    """``ei_service_ready`` in the service's ``/metrics``: {reason label: value} (one sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http.get(base + "/metrics")).text
    (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "ei_service_ready"]
    assert fam.type == "gauge", fam
    return {smp.labels["reason"]: smp.value for smp in fam.samples}


@pytest.mark.timeout(60)
async def test_readyz_drops_while_nats_is_down_or_the_stream_is_lost_and_comes_back(monkeypatch):
    """Started and ready (200); nats-server SIGKILLed: /readyz 503 "not connected to NATS at URL (reconnecting)",
    /healthz 200; back without its store, where this bus may not make the stream again (its create is refused,
    as under credentials only the launcher may): 503 "waiting for the JetStream stream EI_p6"; the launcher
    makes it: 200. Before, /readyz said 200 through all of it once the start had completed."""
    import httpx

    from services.kvdirectory.config import DirectoryConfig
    from services.kvdirectory.service import DirectoryService
    from shared.service import serve_until_stopped

    with EmbeddedNatsServer() as srv:
        port = _free_port()
        cfg = DirectoryConfig(nats_url=srv.url, partition="p6", metrics_port=port, metrics_host="127.0.0.1")
        stop = asyncio.Event()
        task = asyncio.create_task(serve_until_stopped("kvdirectory", cfg, DirectoryService, instance="kvdirectory", stop_event=stop))
        launcher = None
        try:
            async with httpx.AsyncClient(timeout=2.0) as http:
                base = f"http://127.0.0.1:{port}"
                await _until(http, base + "/readyz", _ok, "ready", task)
                assert await _ready_metric(http, base) == {"": 1.0}  # ready: 1, no reason
                real = Bus._stream_config
                monkeypatch.setattr(Bus, "_stream_config", lambda self: real(self).__class__(name="not allowed"))
                os.kill(srv.pid, signal.SIGKILL)
                srv.proc.wait()
                down = f"not connected to NATS at {srv.url} (reconnecting)"
                await _until(http, base + "/readyz", _not_ready(down), "503 while NATS is down", task)
                # the same readiness, for Prometheus: 0, with a reason from a fixed set (no URL in a label)
                assert await _ready_metric(http, base) == {"disconnected": 0.0}
                assert (await http.get(base + "/healthz")).status_code == 200  # liveness is not readiness
                shutil.rmtree(Path(srv._tmp) / "js")
                srv.restart()
                await _until(http, base + "/readyz", _not_ready("waiting for the JetStream stream EI_p6"),
                             "503 while the stream is lost", task)  # fmt: skip
                assert await _ready_metric(http, base) == {"stream": 0.0}
                launcher = await Bus.connect(srv.url, Subjects("p6"), service="launcher", instance="launcher")
                await launcher.nc.jetstream(timeout=5.0).add_stream(real(launcher))
                await _until(http, base + "/readyz", _ok, "ready again", task)
                assert await _ready_metric(http, base) == {"": 1.0}
                assert (await http.get(base + "/healthz")).status_code == 200
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            if launcher is not None:
                await launcher.close()


@pytest.mark.timeout(60)
async def test_the_health_port_opens_before_nats_is_reached():
    """NATS unreachable at start (nothing listens on its port): the metrics port answers /healthz 200 and
    /readyz 503 "connecting to NATS at URL", /metrics the process's families only; once a server listens
    there, /readyz 200 and /metrics has the bus's. Before, ``Bus.connect`` came first and the port stayed
    closed: a liveness probe saw a dead service."""
    import httpx

    from services.kvdirectory.config import DirectoryConfig
    from services.kvdirectory.service import DirectoryService
    from shared.service import serve_until_stopped

    nats_port = _free_port()
    url = f"nats://127.0.0.1:{nats_port}"
    port = _free_port()
    cfg = DirectoryConfig(nats_url=url, partition="p6", metrics_port=port, metrics_host="127.0.0.1")
    stop = asyncio.Event()
    task = asyncio.create_task(serve_until_stopped("kvdirectory", cfg, DirectoryService, instance="kvdirectory", stop_event=stop))
    srv = EmbeddedNatsServer(port=nats_port)
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            base = f"http://127.0.0.1:{port}"
            live = await _until(http, base + "/healthz", _ok, "the health port", task)
            assert live.json() == {"status": "ok"}
            await _until(http, base + "/readyz", _not_ready(f"connecting to NATS at {url}"), "503 while connecting", task)
            metrics = (await http.get(base + "/metrics")).text
            assert await _ready_metric(http, base) == {"connecting": 0.0}  # up (scraped) but not ready
            assert "process_" in metrics or not Path("/proc/self").exists()
            assert "ei_bus_" not in metrics  # no bus yet
            srv.start()
            await _until(http, base + "/readyz", _ok, "ready", task, within_s=20.0)
            assert "ei_bus_messages_received_total" in (await http.get(base + "/metrics")).text
            assert await _ready_metric(http, base) == {"": 1.0}
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        srv.stop()


@pytest.mark.timeout(60)
async def test_a_service_stopped_while_nats_is_down_stops_cleanly():
    """SIGTERM (the stop event) while nats-server is down: the service stops and ``serve_until_stopped`` returns
    (exit 0). Before, the bus's close raised: nats-py's drain refuses a reconnecting client, and the close that
    followed flushed the messages buffered meanwhile (a heartbeat a second) into the lost connection and raised
    ``ConnectionResetError('Connection lost')``: the process ended in a traceback, exit 1."""
    from services.kvdirectory.config import DirectoryConfig
    from services.kvdirectory.service import DirectoryService
    from shared.service import serve_until_stopped

    with EmbeddedNatsServer() as srv:
        port = _free_port()
        cfg = DirectoryConfig(nats_url=srv.url, partition="p6", metrics_port=port, metrics_host="127.0.0.1")
        stop = asyncio.Event()
        task = asyncio.create_task(serve_until_stopped("kvdirectory", cfg, DirectoryService, instance="kvdirectory", stop_event=stop))
        import httpx

        async with httpx.AsyncClient(timeout=2.0) as http:
            await _until(http, f"http://127.0.0.1:{port}/readyz", _ok, "ready", task)
        os.kill(srv.pid, signal.SIGKILL)
        srv.proc.wait()
        await asyncio.sleep(1.5)  # a heartbeat or more buffered while disconnected
        stop.set()
        await asyncio.wait_for(task, 15)  # returns: no exception


class _Listening:
    """A service whose start subscribes (core, ``node.down.*``) and records what it hears there; its bus's writes
    (``nats-py``'s ``_flush_pending``) leave 1 s late while :attr:`late` is set, as a loaded host's flusher task may."""

    def __init__(self, cfg, bus, clock) -> None:
        self.bus = bus
        self.heard: list = []
        self.fatal = asyncio.Event()
        self.fatal_error = None
        self.fatal_where = None
        self.late = True
        real = bus.nc._flush_pending

        async def flush_pending(*a, **kw):
            if not self.late:
                return await real(*a, **kw)
            asyncio.get_running_loop().call_later(1.0, lambda: asyncio.ensure_future(real(*a, **kw)))

        bus.nc._flush_pending = flush_pending

    async def start(self) -> None:
        from shared.subjects import NODE_DOWN

        async def on_down(msg, _s):
            self.heard.append(msg)

        await self.bus.subscribe(NODE_DOWN, on_down)

    async def stop(self) -> None:
        self.late = False

    def stats(self):
        return {}, {}


@pytest.mark.timeout(60)
async def test_ready_means_the_server_has_the_services_subscriptions(nats_url):
    """/readyz 200 only once the server has the SUBs the start sent: a message another connection publishes right
    after is heard. nats-py only queues a SUB for its flusher task; before, the start said "serving" at once, and
    with that task 1 s late (a loaded host) the peer's message reached the server first and no subscription (heard
    nothing)."""
    import httpx

    from shared import messages as m
    from shared.config import CommonConfig
    from shared.service import serve_until_stopped
    from shared.subjects import NODE_DOWN

    port = _free_port()
    cfg = CommonConfig(nats_url=nats_url, partition="p7", metrics_port=port, metrics_host="127.0.0.1")
    made: list[_Listening] = []

    def make(c, b, clk):
        made.append(_Listening(c, b, clk))
        return made[-1]

    stop = asyncio.Event()
    task = asyncio.create_task(serve_until_stopped("listening", cfg, make, instance="listening", stop_event=stop))
    peer = await Bus.connect(nats_url, Subjects("p7"), service="launcher", instance="peer")
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            await _until(http, f"http://127.0.0.1:{port}/readyz", _ok, "ready", task)
        await peer.publish(NODE_DOWN, m.NodeDown(node="w0"), node="w0")
        await peer.flush(10)  # routed by the server
        end = time.monotonic() + 5
        while not made[0].heard and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert [d.node for d in made[0].heard] == ["w0"]
    finally:
        if made:
            made[0].late = False
        stop.set()
        await asyncio.wait_for(task, 15)
        await peer.close()
