"""The router's ``router.request`` span as an OTel HTTP server span (semconv), over a real nats-server.

Spans are caught by the SDK's in-memory exporter (``shared.tracing``'s tracer replaced). A newcomer
checking traces against a real OTLP receiver found: a 5xx left the span's status UNSET (server
spans: ERROR for 5xx); a request refused with 400/404/409 had no rid or error type to find it by; an
aborted or failed request's root span had no finish reason; and the span had none of vLLM's
``llm_request`` attributes (usage, TTFT, sampling parameters, model).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import tracing
from tests.integration.test_router_live import _wait_for, router_env


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "ENABLED", True)
    monkeypatch.setattr(tracing, "shutdown", lambda: None)
    yield exporter
    provider.shutdown()


def _roots(spans):
    return [s for s in spans.get_finished_spans() if s.name == "router.request"]


async def test_router_request_span_has_status_error_type_finish_reason_and_usage(nats_url, tmp_path, spans):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        body = {"model": "test-model", "prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "temperature": 0.5, "top_p": 0.9}
        assert (await env.http.post("/v1/completions", json=body, headers={"X-Request-ID": "ok-1"})).status_code == 200
        bad = {"model": "test-model", "prompt": [1], "max_tokens": -1}
        assert (await env.http.post("/v1/completions", json=bad, headers={"X-Request-ID": "bad-1"})).status_code == 400
        other = {"model": "other", "prompt": [1], "max_tokens": 2}
        assert (await env.http.post("/v1/completions", json=other, headers={"X-Request-ID": "nomodel-1"})).status_code == 404
        # a client that goes away mid-stream: the response was 200, the trace must say it was aborted
        env.cluster.answering.clear()
        n = len(env.cluster.works)
        req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True},
                                                headers={"X-Request-ID": "gone-1"}))
        await _wait_for(lambda: len(env.cluster.works) == n + 1, what="work dispatched")
        req.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await req
        env.cluster.answering = set(env.cluster.phases)
        env.cluster.error_nodes = {"p0"}
        err = {"model": "test-model", "prompt": [1, 2], "max_tokens": 2}
        assert (await env.http.post("/v1/completions", json=err, headers={"X-Request-ID": "err-1"})).status_code == 500
        r = await env.http.post("/v1/completions", json={**err, "stream": True}, headers={"X-Request-ID": "err-stream-1"})
        assert r.status_code == 200 and '"error"' in r.text  # the failure is an SSE error event after the 200
        await _wait_for(lambda: len(_roots(spans)) == 6, what="6 router.request spans")
    got = {s.attributes.get("ei.rid"): s for s in _roots(spans)}
    assert set(got) == {"ok-1", "bad-1", "nomodel-1", "gone-1", "err-1", "err-stream-1"}
    streamed = got["err-stream-1"]
    assert streamed.status.status_code == trace.StatusCode.ERROR and streamed.attributes["ei.finish_reason"] == "error"
    assert "error.type" not in streamed.attributes
    ok = got["ok-1"]
    assert ok.kind == trace.SpanKind.SERVER and ok.status.status_code == trace.StatusCode.UNSET
    a = ok.attributes
    assert a["http.response.status_code"] == 200 and "error.type" not in a
    assert a["ei.finish_reason"] == "length" and tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.usage.input_tokens"] == a["gen_ai.usage.prompt_tokens"] == 5
    assert a["gen_ai.usage.output_tokens"] == a["gen_ai.usage.completion_tokens"] == 4
    assert a["gen_ai.latency.time_to_first_token"] > 0
    assert (a["gen_ai.request.model"], a["gen_ai.request.max_tokens"]) == ("test-model", 4)
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (0.5, 0.9)
    assert (a["ei.prefill_node"], a["ei.decode_node"]) == ("p0", "d0")
    for rid, code in (("bad-1", 400), ("nomodel-1", 404)):  # semconv: a server span's 4xx leaves the status UNSET
        s = got[rid]
        assert s.status.status_code == trace.StatusCode.UNSET
        assert (s.attributes["http.response.status_code"], s.attributes["error.type"]) == (code, str(code))
        assert "ei.finish_reason" not in s.attributes
    gone = got["gone-1"].attributes
    assert gone["http.response.status_code"] == 200 and gone["ei.finish_reason"] == "abort"
    err = got["err-1"]
    assert err.status.status_code == trace.StatusCode.ERROR and "kv transfer failed" in err.status.description
    assert err.attributes["error.type"] == "500" and err.attributes["ei.finish_reason"] == "error"


async def test_router_route_names_no_decode_node_it_does_not_know(nats_url, tmp_path, spans):
    """Decode bound at prefill start (``--decode-binding prefill-start``, the default): ``router.route`` had ``ei.decode_node: ''``."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, decode_binding="prefill-start") as env:
        env.cluster.answering.clear()
        req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}))
        await _wait_for(lambda: env.cluster.works, what="work dispatched")
        req.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await req
        await _wait_for(lambda: _roots(spans), what="router.request span")
    (route,) = [s for s in spans.get_finished_spans() if s.name == "router.route"]
    assert route.attributes["ei.prefill_node"] == "p0" and "ei.decode_node" not in route.attributes


async def test_received_message_spans_name_their_request_and_nats_subject(nats_url, tmp_path, spans):
    """The bus's span of a received message (``worker work.{node}.prefill``, ``kvdirectory kv.lookup``; here the
    fake cluster's bus) had no ``ei.rid`` and no messaging attributes."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        body = {"prompt": list(range(1, 131)), "max_tokens": 2}  # 2 full blocks: the router asks kv.lookup
        assert (await env.http.post("/v1/completions", json=body, headers={"X-Request-ID": "msg-1"})).status_code == 200
        await _wait_for(lambda: _roots(spans), what="router.request span")
    by_name = {s.name: s for s in spans.get_finished_spans()}
    lookup, work = by_name["fake kv.lookup"], by_name["fake work.{node}.prefill"]
    assert lookup.kind == trace.SpanKind.SERVER and work.kind == trace.SpanKind.CONSUMER
    for s, template in ((lookup, "kv.lookup"), (work, "work.{node}.prefill")):
        a = s.attributes
        assert a["ei.rid"] == "msg-1" and a["messaging.system"] == "nats"
        assert a["messaging.destination.template"] == template
    assert "p0" in work.attributes["messaging.destination.name"]
    assert by_name["router.kv_lookup"].attributes["ei.rid"] == "msg-1"


async def test_a_grpc_otlp_protocol_is_warned_about_once_at_start(nats_url, tmp_path, spans, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    old = structlog.get_config()
    cap = structlog.testing.LogCapture()
    structlog.configure(processors=[cap], cache_logger_on_first_use=False)
    try:
        async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, log_level="info"):
            pass
    finally:
        structlog.configure(**old)
    warned = [e for e in cap.entries if "OTEL_EXPORTER_OTLP_PROTOCOL" in e["event"]]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning" and warned[0]["protocol"] == "http/protobuf"


async def test_a_request_the_api_key_guard_refuses_has_its_span(nats_url, tmp_path, spans):
    """401 (no or wrong API key) is answered by the ingress guard, before the generation handler: no span."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys="k1") as env:
        r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Request-ID": "nokey-1"})
        assert r.status_code == 401
        await env.http.get("/v1/models")  # not a generation path: no span
    (s,) = _roots(spans)
    assert s.kind == trace.SpanKind.SERVER and s.status.status_code == trace.StatusCode.UNSET
    a = s.attributes
    assert (a["ei.rid"], a["http.response.status_code"], a["error.type"], a["http.route"]) == ("nokey-1", 401, "401", "/v1/completions")
