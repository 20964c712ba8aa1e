"""shared.metrics: core histograms exported as Prometheus families, the bus's counters, the metrics port."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram as PromHistogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import shared.net
from services.router.metrics import Histogram
from shared.metrics import FuncCollector, MetricsServer, bus_families, histogram_family, make_registry
from tests.conftest import ipv6_loopback

IMPORTED_AT = time.time()


def _samples(reg: CollectorRegistry, name: str) -> list[tuple[str, list, float]]:
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    return sorted((s.name, sorted(s.labels.items()), s.value) for s in fams[name].samples if not s.name.endswith("_created"))


def test_core_histogram_exports_like_prometheus_clients_own_histogram():
    edges = (0.1, 0.5, 1.0)
    xs = [0.05, 0.1, 0.100001, 0.5, 0.7, 1.0, 3.0, 0.0]
    core = Histogram(edges)
    ref_reg = CollectorRegistry()
    ref = PromHistogram("ei_x_seconds", "x", buckets=edges, registry=ref_reg)
    for x in xs:
        core.observe(x)
        ref.observe(x)
    reg = CollectorRegistry()
    reg.register(FuncCollector(lambda: [histogram_family("ei_x_seconds", "x", {(): core})]))
    assert _samples(reg, "ei_x_seconds") == _samples(ref_reg, "ei_x_seconds")


def test_bus_counters_become_per_subject_families():
    counters = Counter({"dropped.kv.events.{node}": 2, "received.kv.lookup": 5, "handler_errors.kv.lookup": 1, "nats.reconnects": 3})

    class FakeBus:  # only .counters is read
        pass

    bus = FakeBus()
    bus.counters = counters  # type: ignore[attr-defined]
    reg = make_registry(bus)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    dropped = {s.labels["subject"]: s.value for s in fams["ei_bus_messages_dropped"].samples}
    assert dropped == {"kv.events.{node}": 2}
    assert [s.value for s in fams["ei_bus_handler_errors"].samples] == [1]
    assert [s.value for s in fams["ei_nats_reconnects"].samples] == [3]
    counters["dropped.kv.events.{node}"] += 1  # read at scrape time
    assert {s.value for s in next(iter(text_string_to_metric_families(generate_latest(reg).decode()))).samples} == {3}
    assert list(bus_families(Counter()))  # empty families still parse


def test_the_bus_s_outage_counters_are_exported():
    """A reliable message lost while the stream may be gone or cut from a resend window, a stream lookup retried, a publish left to the reconnect's
    resend, a server back without JetStream, a permission the server refused: each was only in ``/v1/stats``' JSON
    (``Bus.counters``), which no alert reads."""
    counters = Counter({"stream_held_dropped": 7, "stream_lookup_retries": 3, "publish_deferred.route.placed": 2,
                        "jetstream_missing_warnings": 1, "nats.permission_violations": 4, "resend_dropped": 5})  # fmt: skip
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(make_registry(SimpleNamespace(counters=counters))).decode())}
    assert [s.value for s in fams["ei_bus_stream_held_dropped"].samples] == [7]
    assert [s.value for s in fams["ei_bus_resend_dropped"].samples] == [5]  # a resend window cut over a flapping link
    assert [s.value for s in fams["ei_bus_stream_lookup_retries"].samples] == [3]
    assert {s.labels["subject"]: s.value for s in fams["ei_bus_publishes_deferred"].samples} == {"route.placed": 2}
    assert [s.value for s in fams["ei_bus_jetstream_missing_warnings"].samples] == [1]
    assert [s.value for s in fams["ei_nats_permission_violations"].samples] == [4]


async def test_metrics_server_serves_the_registry_and_refuses_a_taken_port():
    core = Histogram((1.0,))
    core.observe(0.5)
    reg = CollectorRegistry()
    reg.register(FuncCollector(lambda: [histogram_family("ei_y_seconds", "y", {(): core})]))
    srv = MetricsServer(reg, "127.0.0.1", 0)
    await srv.start()
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            r = await http.get(f"http://127.0.0.1:{srv.port}/metrics")
        assert r.status_code == 200 and 'ei_y_seconds_bucket{le="1.0"} 1.0' in r.text
        with pytest.raises(OSError, match="cannot listen for metrics"):
            await MetricsServer(reg, "127.0.0.1", srv.port).start()
    finally:
        await srv.stop()
    await asyncio.sleep(0)


async def test_metrics_server_serves_on_a_held_socket_and_refuses_one_that_does_not_listen():
    """``--metrics-fd``: the server serves on the listening socket a supervisor holds (``up --metrics``), on its
    port; a descriptor that is no listening TCP socket is refused naming the flag."""
    import os

    from shared.net import inherited_socket, listen_socket

    held = listen_socket("127.0.0.1", 0)
    srv = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, sock=inherited_socket(os.dup(held.fileno()), "--metrics-fd"))
    await srv.start()
    try:
        assert srv.port == held.getsockname()[1]
        async with httpx.AsyncClient(timeout=5) as http:
            r = await http.get(f"http://127.0.0.1:{srv.port}/metrics")
        assert r.status_code == 200 and "ei_service_ready" in r.text
    finally:
        await srv.stop()
        held.close()
    with socket.socket() as bound:  # bound, not listening
        bound.bind(("127.0.0.1", 0))
        with pytest.raises(OSError, match=f"--metrics-fd {bound.fileno()} is not a listening TCP socket"):
            inherited_socket(bound.fileno(), "--metrics-fd")
        assert bound.fileno() >= 0  # left open: not the caller's to close
    await asyncio.sleep(0)


class _V6OnlyName:
    """``shared.net``'s ``socket`` module, whose ``getaddrinfo`` resolves ``v6only.test`` to ``::1`` only (as
    ``ip6-localhost`` does where /etc/hosts lists it); everything else is the real module, so only the bind under
    test sees the name."""

    NAME = "v6only.test"

    def __getattr__(self, name: str):
        return getattr(socket, name)

    def getaddrinfo(self, host, port, *args, **kwargs):
        return socket.getaddrinfo("::1" if host == self.NAME else host, port, *args, **kwargs)


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_metrics_server_binds_a_name_that_resolves_only_to_ipv6_in_that_family(monkeypatch):
    """The metrics server chose IPv4 or IPv6 by whether ``--metrics-host`` held a ":", so a hostname that resolves
    only to an IPv6 address was bound as IPv4 and the service did not start; it now binds as the router does
    (``shared.net.bind_socket``: the family ``getaddrinfo`` gives)."""
    monkeypatch.setattr(shared.net, "socket", _V6OnlyName())
    srv = MetricsServer(CollectorRegistry(), _V6OnlyName.NAME, 0)
    await srv.start()
    try:
        assert srv.port > 0
        async with httpx.AsyncClient(timeout=5) as http:
            r = await http.get(f"http://[::1]:{srv.port}/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    finally:
        await srv.stop()
    await asyncio.sleep(0)


async def test_an_empty_metrics_host_binds_every_ipv4_interface_as_before():
    """``--metrics-host ''`` (``EI_METRICS_HOST=``) bound every interface (``bind(("", port))`` on IPv4: 0.0.0.0);
    since the metrics port is bound by ``shared.net.bind_socket`` ``getaddrinfo('')`` failed (Name or service not
    known) and the service did not start. ``""`` is again 0.0.0.0, reachable on the loopback."""
    srv = MetricsServer(CollectorRegistry(), "", 0)
    await srv.start()
    try:
        assert srv.port > 0
        async with httpx.AsyncClient(timeout=5) as http:
            r = await http.get(f"http://127.0.0.1:{srv.port}/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    finally:
        await srv.stop()
    await asyncio.sleep(0)


def test_every_service_registry_exports_the_process_start_time_so_a_restart_shows():
    """A worker killed (``kill -9``) and restarted by ``up`` within a second showed nothing in Prometheus:
    its ``ei_*`` counters restarted from 0 (which ``rate()`` hides) and no series said the process was new.
    Every service's registry now exports prometheus_client's ``process_*`` families, as vLLM and SGLang do:
    ``process_start_time_seconds`` is this process's start (Unix s), read at scrape time."""
    reg = make_registry()
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    start = {s.name: s.value for s in fams["process_start_time_seconds"].samples}["process_start_time_seconds"]
    # this process started before this module was imported, and not long before (collection comes first)
    assert IMPORTED_AT - 600.0 < start <= IMPORTED_AT + 1.0, (start, IMPORTED_AT)
    assert fams["process_resident_memory_bytes"].type == "gauge" and fams["process_cpu_seconds"].type == "counter"


def test_a_service_registry_s_own_histograms_export_no_created_gauge_family():
    """The directory's and planner's ``prometheus_client.Histogram`` families came with a separate gauge family,
    ``# TYPE ei_kvdirectory_ingest_seconds_created gauge`` repeating the HELP text (a Unix time), which the router's
    histograms never had: every family of a service registry is now only what its table lists."""
    reg = make_registry()
    h = PromHistogram("ei_z_seconds", "z (wall s)", buckets=(1.0,), registry=reg)
    h.observe(0.5)
    text = generate_latest(reg).decode()
    assert "ei_z_seconds_count 1.0" in text and "_created" not in text, text
