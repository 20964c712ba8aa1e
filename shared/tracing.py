"""OpenTelemetry traces across the services, W3C ``traceparent`` carried in NATS message headers.

Off unless a service's ``--otlp-traces-endpoint URL`` (``EI_OTLP_TRACES_ENDPOINT``;
``evolving-infra up/demo --otlp-traces-endpoint`` passes it to every service) or the
standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)
variable is set, and ``OTEL_SDK_DISABLED`` is not ``true``. The flag wins over the
variables; like ``OTEL_EXPORTER_OTLP_ENDPOINT`` it names the collector's OTLP/HTTP port (4318; the
protocol is always ``http/protobuf``: an ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` of ``grpc`` or
``http/json`` is not served, and the service logs one warning saying so, :func:`protocol_ignored`) and
``/v1/traces`` is appended (unless the URL already ends with it), while
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is used as is (the OTLP spec's rule). Off, every hook is one test of the module flag :data:`ENABLED`
(and, on receive, of a message's headers): no span objects, no header is added.

On, :func:`setup` (called by ``shared.service`` for every service process)
installs an SDK ``TracerProvider`` whose resource names the service
(``service.name=evolving-infra-<service>``, ``service.instance.id=<instance>``;
this ``service.name`` replaces ``OTEL_SERVICE_NAME``, which would give every
process of a cluster one name, while other ``OTEL_RESOURCE_ATTRIBUTES`` are kept)
with a batch OTLP/HTTP exporter (protobuf, ``<endpoint>/v1/traces``). Sampling
is the SDK's, from the standard variables: ``OTEL_TRACES_SAMPLER`` (default
``parentbased_always_on``) and ``OTEL_TRACES_SAMPLER_ARG``; e.g.
``OTEL_TRACES_SAMPLER=parentbased_traceidratio OTEL_TRACES_SAMPLER_ARG=0.01``
traces 1 % of requests, and the other services follow the router's decision
through the ``sampled`` flag of ``traceparent``.

Propagation: a publisher passes ``headers=tracing.inject(ctx)`` to
:meth:`shared.bus.Bus.publish` / :meth:`~shared.bus.Bus.request`; the bus, on a
message with a ``traceparent`` header, opens a CONSUMER (or SERVER, for a
request) span ``<service> <subject template>`` and runs the handler inside it,
so the handler's spans and :func:`current` are its children. That span carries OTel's messaging
attributes (``messaging.system`` ``nats``, ``messaging.destination.name`` the subject,
``messaging.destination.template``) and ``ei.rid`` when the message names a request.

A request that ends on a node otherwise than by its last token or a hand-off (aborted, rejected,
handed back) still ends that node's span of the stage it was in (``worker.queue_wait``,
``worker.prefill``, ``worker.handoff_wait`` or ``worker.decode``) with ``ei.ended`` (``aborted`` / ``rejected`` /
``handed_back``) and ``ei.end_reason``; a node's engine error is status ERROR.

Spans of one request (names; attributes prefixed ``ei.``):

=================================  ==========  =================================================================
span                               process     covers
=================================  ==========  =================================================================
``router.request``                 router      HTTP ingress → response end (root, SERVER; ``ei.rid`` (a refused request's
                                               too when its ``X-Request-ID`` is valid; ``ei.client_request_id``:
                                               the id as sent when ``ei.rid`` maps it), ``http.route``,
                                               ``http.response.status_code``; from 400 ``error.type``, from 500 status
                                               ERROR; ``gen_ai.request.*`` (model, max_tokens, temperature, top_p),
                                               once accepted ``ei.finish_reason`` / ``gen_ai.response.finish_reasons``
                                               (``abort``: the client went away), ``gen_ai.usage.*``,
                                               ``gen_ai.latency.time_to_first_token``, ``ei.prefill_node``/``ei.decode_node``)
``router.kv_lookup``               router      the ``kv.lookup`` request → ``kvdirectory kv.lookup`` (server span)
``router.route``                   router      routing decision (``ei.prefill_node``, ``ei.decode_node`` when chosen with it,
                                               ``ei.predicted_ttft_s``, ``ei.policy``, ``ei.matched_blocks``)
``worker work.{node}.prefill``     prefill     receipt of the work (consumer)
``worker.queue_wait``              prefill     arrival → admitted to a prefill batch
``worker.fetch``                   prefill     peer KV fetch issued while queued (``ei.fetch_s``, simulated)
``worker.kv_transfer``             prefill     real-bytes mode (``--kv-pool real``): the bytes pulled from one peer's host
                                               pool, wall time (``ei.peer``, ``ei.blocks``, ``ei.blocks_fetched``,
                                               ``ei.blocks_missing``, ``ei.bytes``, ``ei.seconds``, ``ei.transfer_s``;
                                               status ERROR and ``ei.error`` when the pull failed); one per source node
``worker.prefill``                 prefill     admitted → first token
``worker.decode_binding``          prefill     ``route.bind`` request → ``router route.bind.{router}`` (server span,
                                               ``ei.decode_node``)
``worker.handoff``                 prefill     the PD hand-off to the decode node (``ei.decode_node``)
``worker.handoff_wait``            prefill     a prefill parked (its first token out before its decode binding came) that
                                               ended there otherwise (aborted, its binding failed): first token → its
                                               end (``ei.ended``); one handed off has none (``worker.decode_binding``
                                               covers its wait)
``worker work.{node}.decode``      decode      receipt of the hand-off (consumer)
``worker.decode``                  decode      arrival → last token (``ei.output_tokens``)
``router.stream_out``              router      first chunk → response end
=================================  ==========  =================================================================

Work handed back (``work.requeue``) or re-dispatched after its node was fenced stays in the
request's trace: each placement try adds a ``router.kv_lookup`` and a zero-length
``router.route`` (``ei.attempt``, ``ei.reason``, ``ei.prefill_node`` or ``ei.no_route``), and the
new ``work.prefill`` / ``work.decode`` carry the request's ``traceparent``, so the new nodes'
spans join it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENABLED: bool = False
"""True once :func:`setup` installed an exporter in this process."""
URL: str | None = None
"""The URL spans are posted to once :func:`setup` installed the exporter."""

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer = trace.NoOpTracer()
_provider: Any = None


def traces_url(endpoint: str = "", env: Mapping[str, str] | None = None) -> str | None:
    """The OTLP/HTTP URL spans are posted to, or None when tracing is not asked for (or disabled).

    Args:
        endpoint: a service's ``--otlp-traces-endpoint`` (the collector, e.g. ``http://host:4318``;
            ``/v1/traces`` appended unless it ends with it); empty = the environment's.
        env: the environment (default ``os.environ``): ``OTEL_SDK_DISABLED=true`` turns tracing off;
            ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is used as is, else ``OTEL_EXPORTER_OTLP_ENDPOINT``
            + ``/v1/traces`` (OpenTelemetry's OTLP exporter specification).
    """
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if endpoint:
        base = endpoint.rstrip("/")
        return base if base.endswith("/v1/traces") else base + "/v1/traces"
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    return None


def protocol_ignored(env: Mapping[str, str] | None = None) -> str | None:
    """The warning to log once when the environment asks for an OTLP protocol other than ``http/protobuf``, the
    only one exported (``opentelemetry-exporter-otlp-proto-http``; the gRPC exporter is not a dependency), else None.

    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` wins over ``OTEL_EXPORTER_OTLP_PROTOCOL`` (the OTLP exporter
    specification); values ``grpc``, ``http/json`` are not served. ``env``: default ``os.environ``.
    """
    env = os.environ if env is None else env
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(name, "").strip()
        if value:
            if value.lower() == "http/protobuf":
                return None
            return (f"{name}={value} is not supported: spans are exported over OTLP/HTTP with protobuf (http/protobuf, "
                    "POST <endpoint>/v1/traces; a collector's port 4318, not gRPC's 4317)")  # fmt: skip
    return None


def wanted(env: Mapping[str, str] | None = None, endpoint: str = "") -> bool:
    """Whether traces are asked for (:func:`traces_url` is not None)."""
    return traces_url(endpoint, env) is not None


def setup(service: str, instance: str, *, env: Mapping[str, str] | None = None, endpoint: str = "") -> bool:
    """Install the OTLP/HTTP exporter when :func:`wanted`; returns :data:`ENABLED`.

    Idempotent per process (the first call wins). ``endpoint``: the service's
    ``--otlp-traces-endpoint`` (:func:`traces_url`). The exporter reads the other standard
    ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, compression).
    """
    global ENABLED, _tracer, _provider, URL
    url = traces_url(endpoint, env)
    if ENABLED or url is None:
        return ENABLED
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create(
        {"service.name": f"evolving-infra-{service}", "service.instance.id": instance, "process.pid": os.getpid()}
    )
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    _tracer = _provider.get_tracer("evolving_infra")
    ENABLED, URL = True, url
    return True


def shutdown() -> None:
    """Export what is buffered and stop (a service's last step); no-op when off."""
    global ENABLED, _tracer, _provider, URL
    if _provider is not None:
        _provider.shutdown()
    _provider = None
    _tracer = trace.NoOpTracer()
    ENABLED = False
    URL = None


def tracer() -> trace.Tracer:
    """This process's tracer (a no-op one when off)."""
    return _tracer


def start(name: str, parent: otel_context.Context | Span | None = None, *, kind: SpanKind = SpanKind.INTERNAL,
          start_ns: int | None = None, attributes: Mapping[str, Any] | None = None) -> Span:
    """Start a span (end it with ``span.end()``). ``parent``: a span, a context, or None = the current context."""
    ctx = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    return _tracer.start_span(name, context=ctx, kind=kind, start_time=start_ns, attributes=dict(attributes or {}))


def record(name: str, parent: otel_context.Context | Span | None, start_ns: int, end_ns: int,
           attributes: Mapping[str, Any] | None = None) -> Span:
    """A finished span over ``[start_ns, end_ns]`` (wall ns, ``time.time_ns()``), e.g. a queue wait seen afterwards."""
    span = start(name, parent, start_ns=start_ns, attributes=attributes)
    span.end(end_time=max(start_ns, end_ns))
    return span


def current() -> otel_context.Context:
    """The current context (inside a bus handler: the message's consumer span)."""
    return otel_context.get_current()


def inject(parent: otel_context.Context | Span | None = None) -> dict[str, str] | None:
    """``{"traceparent": ...}`` for ``parent`` (span, context or the current one); None when off or nothing to carry."""
    if not ENABLED:
        return None
    ctx = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier or None


def extract(headers: Mapping[str, str]) -> otel_context.Context:
    """The remote parent context a message's headers carry."""
    return _PROPAGATOR.extract(headers)


def attach(ctx: otel_context.Context) -> object:
    """Make ``ctx`` current; returns the token for :func:`detach`."""
    return otel_context.attach(ctx)


def detach(token: object) -> None:
    otel_context.detach(token)  # type: ignore[arg-type]
