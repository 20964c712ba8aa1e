"""Prometheus export for every service (``prometheus-client``); the shells' side of metrics.

The sans-IO cores record what they measure in plain Python objects (counters,
:class:`services.router.metrics.Histogram` buckets); the shells turn them into
Prometheus metric families *at scrape time* through collectors registered on a
per-service :class:`prometheus_client.CollectorRegistry` (one registry per
service object, so several services in one process never collide). Shell-only
measurements (the directory's ingest and lookup latency) use
``prometheus_client.Histogram`` directly.

Every scrape runs on the service's own event loop (the ``/metrics`` handler is
an ASGI route served by uvicorn inside that loop), so collectors read the
service's state without locks.

Names follow Prometheus conventions: ``ei_`` prefix, base units in the name
(``_seconds``, ``_tokens``, ``_blocks``), ``_total`` on counters. Times taken
from the cluster's :class:`~shared.clock.SimClock` are *simulated* seconds
(equal to wall seconds at ``--speedup 1``, i.e. in any real deployment); the
directory's handler latencies are wall seconds (``time.perf_counter``).

Served:

* ``GET /metrics`` on the router's HTTP port (the router's own registry);
* ``GET /metrics`` on ``--metrics-host:--metrics-port`` of every service when
  ``--metrics-port`` is non-zero (0 = off, the default);
* ``GET /healthz`` on that metrics port: 200 ``{"status":"ok"}`` whenever the process
  is alive and its event loop answers (a liveness check), from before the connection to NATS
  and the service's start (either may wait: for an unreachable NATS, for the JetStream stream,
  ``shared.bus``), so that a liveness probe does not see a service that waits as a dead one
  (``/metrics`` holds the process's families only until the bus is connected);
* ``GET /readyz`` on that metrics port: 503 ``{"status":"not ready","reason":...}`` until
  the service's start completed (e.g. "connecting to NATS at nats://nats:4222", "waiting for
  the JetStream stream EI_p0"), then 200
  while its ``ready()`` holds (503 "not ready" otherwise), its bus is connected to NATS and
  not waiting for a stream the server lost, until its stop begins (the reasons:
  ``shared.service.Readiness``): compose's healthcheck of the KV
  directory, planner and workers. Neither says anything of the cluster;
  readiness to serve requests is the router's ``GET /health`` (or ``/healthz``) on
  its HTTP port: 503 with the reason until NATS is connected and a collocated node,
  or a prefill and a decode node, are live, and while NATS is down or hung.

The same readiness is a metric on that metrics port, so that Prometheus sees a service that is up but not
ready (``up`` says only that the scrape answered): ``ei_service_ready`` (gauge, 1 ready, 0 not), read at each
scrape from the very state ``/readyz`` reads, with a ``reason`` label while not ready, one of a fixed set
(:data:`READY_REASONS`; ``/readyz``'s text names the URL and stream), empty (no label) while ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from shared.net import bind_socket, http_url

if TYPE_CHECKING:
    import uvicorn
    from starlette.requests import Request
    from starlette.responses import Response

# uvicorn and Starlette (~0.1 s of imports) load in the functions that serve HTTP: a service with
# --metrics-port 0 (the default; LocalCluster's, so every e2e test's workers, KV directory and planner)
# never serves here and starts without them (the router imports them itself for its HTTP port).

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
"""Bucket upper bounds (s) of request latency histograms (TTFT, E2E, queue time); +Inf implied."""

TPOT_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
"""Bucket upper bounds (s) of the time-per-output-token histogram; +Inf implied."""

HANDLER_BUCKETS_S: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
"""Bucket upper bounds (wall s) of in-process handler latencies (directory ingest / lookup); +Inf implied."""


class BucketHistogram(Protocol):
    """What :func:`histogram_family` reads: a core's fixed-bucket histogram."""

    edges: tuple[float, ...]
    counts: list[int]
    """Per-bucket (non-cumulative) counts, ``len(edges) + 1`` with the +Inf bucket last."""
    sum: float


def _le(x: float) -> str:
    return floatToGoString(x)  # the same ``le`` text as prometheus_client's own histograms


def histogram_buckets(h: BucketHistogram) -> list[tuple[str, float]]:
    """Cumulative ``[(le, count), ..., ("+Inf", count)]`` of a core histogram (Prometheus ``le`` semantics)."""
    out: list[tuple[str, float]] = []
    acc = 0
    for edge, c in zip(h.edges, h.counts):
        acc += c
        out.append((_le(edge), float(acc)))
    out.append(("+Inf", float(acc + h.counts[-1])))
    return out


def histogram_family(
    name: str, doc: str, series: Mapping[tuple[str, ...], BucketHistogram], labels: Sequence[str] = ()
) -> HistogramMetricFamily:
    """A Prometheus histogram family from core histograms, one series per label tuple.

    Args:
        name: metric name without ``_bucket``/``_sum``/``_count`` (e.g. ``ei_router_ttft_seconds``).
        doc: HELP text (say the unit).
        series: label values (``len(labels)`` strings) → histogram.
        labels: label names.
    """
    fam = HistogramMetricFamily(name, doc, labels=list(labels))
    for values, h in series.items():
        fam.add_metric(list(values), histogram_buckets(h), h.sum)
    return fam


def counter_family(name: str, doc: str, values: Mapping[tuple[str, ...], float], labels: Sequence[str] = ()) -> CounterMetricFamily:
    """A counter family (``name`` without ``_total``; the exposition adds it) from label tuple → value."""
    fam = CounterMetricFamily(name, doc, labels=list(labels))
    for lv, v in values.items():
        fam.add_metric(list(lv), float(v))
    return fam


def gauge_family(name: str, doc: str, values: Mapping[tuple[str, ...], float], labels: Sequence[str] = ()) -> GaugeMetricFamily:
    """A gauge family from label tuple → value."""
    fam = GaugeMetricFamily(name, doc, labels=list(labels))
    for lv, v in values.items():
        fam.add_metric(list(lv), float(v))
    return fam


class FuncCollector(Collector):
    """A collector whose families come from ``fn()`` at every scrape (the service's current state)."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterator[Metric]:
        yield from self.fn()

    def describe(self) -> list[Metric]:  # no eager describe: fn() reads live state
        return []


def by_prefix(counters: Mapping[str, int], prefix: str) -> dict[tuple[str, ...], float]:
    """``{"dropped.a": 2, "dropped.b": 1}``, ``"dropped."`` → ``{("a",): 2, ("b",): 1}``."""
    n = len(prefix)
    return {(k[n:],): float(v) for k, v in counters.items() if k.startswith(prefix)}


def bus_families(counters: Mapping[str, int], subscribed: Iterable[str] = ()) -> Iterator[Metric]:
    """The bus's per-subject counters (``shared.bus.Bus.counters``) as Prometheus families.

    ``subject`` is the subject template (``ei.{partition}.work.{node}.prefill`` style,
    as in ``shared/subjects.py``), so label cardinality is bounded by the templates.
    ``subscribed`` (``Bus.subscribed``): templates whose dropped / handler-error / received
    series exist from the start at 0, so ``rate()`` reads 0, not "no data", until the first one.
    """
    zero: dict[tuple[str, ...], float] = {(t,): 0.0 for t in sorted(subscribed)}

    def by_subject(prefix: str) -> dict[tuple[str, ...], float]:
        return {**zero, **by_prefix(counters, prefix)}

    yield counter_family(
        "ei_bus_messages_dropped",
        "Malformed NATS messages counted and dropped, by subject template",
        by_subject("dropped."),
        ["subject"],
    )
    yield counter_family(
        "ei_bus_handler_errors", "Handler exceptions (message dropped, service kept running), by subject template",
        by_subject("handler_errors."), ["subject"],
    )
    yield counter_family(
        "ei_bus_messages_received", "Decoded NATS messages handed to a handler, by subject template",
        by_subject("received."), ["subject"],
    )
    yield counter_family(
        "ei_bus_messages_published", "NATS messages published, by subject template", by_prefix(counters, "published."), ["subject"]
    )
    yield counter_family(
        "ei_bus_requests_failed",
        "NATS requests without a reply in time, by subject template (a retried start-up wait only when it gives up: "
        "ei_bus_request_retries_total counts its tries)",
        by_prefix(counters, "request_failed."), ["subject"],
    )
    yield counter_family(
        "ei_bus_request_retries",
        "Unanswered tries of a request its service retries until a deadline (split.get at start, before the planner "
        "is up), by subject template; not failures: a wait that gives up counts once in ei_bus_requests_failed_total",
        by_prefix(counters, "request_retried."), ["subject"],
    )
    yield counter_family(
        "ei_nats_reconnects", "Reconnections to the NATS server", {(): float(counters.get("nats.reconnects", 0))}
    )
    yield counter_family(
        "ei_nats_permission_violations",
        "Operations the NATS server refused this service's identity (a publish or subscribe its permissions do not "
        "allow: a wrong or stale credential set, shared/auth.py)",
        {(): float(counters.get("nats.permission_violations", 0))},
    )
    yield counter_family(
        "ei_bus_publishes_deferred",
        "Reliable publishes whose connection died under the write, left to the reconnect's resend (not failed), by "
        "subject template",
        by_prefix(counters, "publish_deferred."), ["subject"],
    )
    yield counter_family(
        "ei_bus_stream_held_dropped",
        "Reliable publishes dropped, oldest first, from the copies a bus keeps from a disconnect until the reconnect "
        "found its JetStream stream (past RESEND_MAX_MSGS or HELD_MAX_BYTES, shared/bus.py): lost when the server came "
        "back without the stream (once it is known lost, a publish past the bounds is refused instead)",
        {(): float(counters.get("stream_held_dropped", 0))},
    )
    yield counter_family(
        "ei_bus_resend_dropped",
        "Reliable publishes dropped, oldest first, from the resend window that no reconnect's check published again "
        "yet (past RESEND_MAX_MSGS, merged over several disconnects: a flapping link, shared/bus.py): lost if they "
        "died unstored",
        {(): float(counters.get("resend_dropped", 0))},
    )
    yield counter_family(
        "ei_bus_stream_lookup_retries",
        "JetStream stream lookups after a reconnect made again (no answer in time: a loaded or hung server, or the "
        "connection down a moment); reliable publishes are kept meanwhile",
        {(): float(counters.get("stream_lookup_retries", 0))},
    )
    yield counter_family(
        "ei_bus_jetstream_missing_warnings",
        "Warnings (one at once, then one per STREAM_BACK_WAIT_S) that the NATS server came back without JetStream: "
        "reliable messages cannot be delivered until it has it again (/readyz is 503 meanwhile)",
        {(): float(counters.get("jetstream_missing_warnings", 0))},
    )


READY_REASONS = ("stopping", "connecting", "disconnected", "no_jetstream", "stream", "starting", "not_ready")
"""The ``reason`` label values of ``ei_service_ready`` (``shared.service.Readiness`` says which is which):
the stop began; the first connect to NATS has not succeeded; the bus lost its connection; the server has no
JetStream; the bus waits for its JetStream stream; the start has not completed; the service's ``ready()`` is false."""


def ready_family(state: tuple[str, str] | None) -> GaugeMetricFamily:
    """``ei_service_ready`` for one readiness ``state``: None (ready) is 1 with an empty ``reason``, ``(kind,
    reason)`` is 0 with ``reason=kind``.

    Raises:
        ValueError: ``kind`` is not one of :data:`READY_REASONS` (a label value must come from a fixed set).
    """
    if state is None:
        return gauge_family("ei_service_ready", _READY_HELP, {("",): 1.0}, ["reason"])
    kind = state[0]
    if kind not in READY_REASONS:
        raise ValueError(f"readiness kind {kind!r} is not one of {READY_REASONS}")
    return gauge_family("ei_service_ready", _READY_HELP, {(kind,): 0.0}, ["reason"])


_READY_HELP = (
    "1 while the service is ready (its /readyz answers 200), 0 while not, with reason: "
    + "|".join(READY_REASONS) + " (its /readyz gives the details); read at each scrape"
)


def metrics_payload(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text exposition format (version 0.0.4)."""
    return generate_latest(registry)


def metrics_response(registry: CollectorRegistry) -> Response:
    """A Starlette response for ``GET /metrics``."""
    from starlette.responses import Response

    return Response(metrics_payload(registry), media_type=CONTENT_TYPE_LATEST)


@functools.cache
def _quiet_server_type() -> type[uvicorn.Server]:
    """``uvicorn.Server`` without its own signal handling: the service shell owns SIGINT/SIGTERM
    (a class made on first use, so that importing this module does not import uvicorn)."""
    import uvicorn

    class _QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29
            pass

    return _QuietServer


class MetricsServer:
    """``GET /metrics``, ``GET /healthz`` (liveness only, always 200 while the process runs) and ``GET /readyz``
    (503 with ``not_ready()``'s reason, else 200; see the module docstring) on its own port, inside the
    running event loop. ``/metrics`` serves ``registry`` and ``ei_service_ready`` (:func:`ready_family`), from
    the same ``not_ready()`` at each scrape: the metric and ``/readyz`` never disagree.

    Args:
        registry: what to expose.
        host: bind address (``0.0.0.0`` inside a container).
        port: TCP port (1-65535; the caller does not start it for 0).
        not_ready: why the service is not ready, ``(kind, reason)`` (kind one of :data:`READY_REASONS`, reason
            the text ``/readyz`` answers with), or None when it is; None (the argument): always ready.
        sock: a listening socket to serve on instead of binding ``host:port`` (``--metrics-fd``: one a supervisor
            holds; ``port`` is then the one it is bound to).
    """

    def __init__(
        self, registry: CollectorRegistry, host: str, port: int,
        not_ready: Callable[[], tuple[str, str] | None] | None = None, sock: socket.socket | None = None,
    ) -> None:  # fmt: skip
        self._sock = sock
        self.registry = registry
        self.not_ready = not_ready
        self._ready_registry = CollectorRegistry(auto_describe=False)
        self._ready_registry.register(FuncCollector(lambda: [ready_family(self.not_ready() if self.not_ready else None)]))
        self.host = host
        self.port = port
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind and serve.

        Raises:
            OSError: the address cannot be bound (the service then does not start).
        """
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        async def metrics(_request: Request) -> Response:
            return Response(metrics_payload(self.registry) + metrics_payload(self._ready_registry), media_type=CONTENT_TYPE_LATEST)

        async def healthz(_request: Request) -> Response:
            return Response(b'{"status":"ok"}', media_type="application/json")

        async def readyz(_request: Request) -> Response:
            from starlette.responses import JSONResponse

            why = self.not_ready() if self.not_ready is not None else None
            if why is None:
                return Response(b'{"status":"ok"}', media_type="application/json")
            return JSONResponse({"status": "not ready", "reason": why[1]}, status_code=503)

        app = Starlette(
            routes=[
                Route("/metrics", metrics, methods=["GET"]),
                Route("/healthz", healthz, methods=["GET"]),
                Route("/readyz", readyz, methods=["GET"]),
            ]
        )
        if self._sock is not None:  # held by the supervisor (--metrics-fd), listening since before this process
            sock = self._sock
        else:
            try:  # the router's bind (SO_REUSEADDR, the family getaddrinfo gives: a name that resolves only to IPv6 too);
                # "" is every IPv4 interface, as bind(("", port)) made it before (getaddrinfo cannot resolve "")
                sock = bind_socket(self.host or "0.0.0.0", self.port, blocking=False)
            except OSError as e:
                raise OSError(e.errno, f"cannot listen for metrics on {self.host}:{self.port}: {e.strerror or e}") from e
        self.port = sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", loop="none", timeout_graceful_shutdown=2)
        self._server = _quiet_server_type()(cfg)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="metrics-http")
        while not self._server.started:
            if self._task.done():
                exc = self._task.exception() if not self._task.cancelled() else None
                raise OSError(f"metrics server failed to start: {exc!r}")
            await asyncio.sleep(0.01)
        structlog.get_logger("metrics").info("metrics listening", url=http_url(self.host, self.port) + "/metrics")

    async def stop(self) -> None:
        """Stop serving (waits up to 5 s, then cancels)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=5.0)
        except (asyncio.TimeoutError, Exception):
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task


def make_registry(bus: Any = None) -> CollectorRegistry:
    """A fresh registry for one service, with the bus's per-subject counters when ``bus`` is given.

    Every registry also exports the process's standard ``process_*`` families (prometheus_client's
    :class:`~prometheus_client.ProcessCollector`, read from ``/proc`` at each scrape; none where
    there is no ``/proc``): ``process_start_time_seconds`` (Unix s), ``process_cpu_seconds_total``,
    ``process_resident_memory_bytes``, ``process_open_fds``, as vLLM, SGLang and Dynamo export them.
    A worker killed and restarted by its supervisor between two scrapes shows only there (its new
    start time: ``changes(process_start_time_seconds[1h])``); its ``ei_*`` counters merely restart.
    """
    # prometheus_client's own metrics (the directory's and planner's latency histograms) leave out their
    # `<name>_created` series, which the text format exposes as a separate gauge family repeating the HELP
    # (`# TYPE ei_kvdirectory_ingest_seconds_created gauge`): the router's histograms never had one. The switch
    # is the library's, for the process: each service is its own process, and the setting is only made here.
    disable_created_metrics()
    reg = CollectorRegistry(auto_describe=False)
    if bus is not None:
        reg.register(FuncCollector(lambda: bus_families(bus.counters, getattr(bus, "subscribed", ()))))
    ProcessCollector(registry=reg)
    return reg


def service_registry(svc: Any, bus: Any = None) -> CollectorRegistry:
    """The service's registry (its ``registry`` attribute, built with :func:`make_registry`) or a fresh one
    holding only the bus's counters."""
    reg = getattr(svc, "registry", None)
    return reg if isinstance(reg, CollectorRegistry) else make_registry(bus)
