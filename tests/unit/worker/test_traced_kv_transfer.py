"""``worker.kv_transfer``: a real-bytes KV pull between nodes is a span of the request's trace, with its
source node, blocks, bytes and seconds (``services/worker/traced.py``; spans caught by the SDK's in-memory
exporter). Before, the pull (``WorkerService._transfer``) had no span: the trace showed only the simulated
``worker.fetch``, without the peer, the bytes or the wall time the bytes took."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.worker.traced import WorkerTraces
from shared import tracing


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "ENABLED", True)
    yield exporter
    provider.shutdown()


def test_a_pull_from_each_peer_is_a_child_span_of_the_work_with_its_peer_blocks_bytes_and_seconds(spans):
    traces = WorkerTraces("w1", speedup=1.0)
    with tracing.tracer().start_as_current_span("worker work.{node}.prefill") as work:
        traces.arrived("r1", decode=False)
    parent = traces.parent("r1")
    assert parent is not None
    traces.kv_transfer(parent, "r1", "w0", 1_000, 2_500_000, blocks=40, fetched=40, nbytes=40 * 65536, seconds=0.0025, transfer_s=0.002)
    traces.kv_transfer(parent, "r1", "w2", 1_000, 9_000, blocks=3, missing=3, error="peer w2 unreachable")
    got = {s.attributes["ei.peer"]: s for s in spans.get_finished_spans() if s.name == "worker.kv_transfer"}
    assert set(got) == {"w0", "w2"}
    ok, bad = got["w0"], got["w2"]
    for s in (ok, bad):
        assert s.parent.span_id == work.get_span_context().span_id and s.context.trace_id == work.get_span_context().trace_id
        assert s.attributes["ei.node"] == "w1" and s.attributes["ei.rid"] == "r1"
    assert (ok.start_time, ok.end_time) == (1_000, 2_500_000)
    assert {k: ok.attributes[k] for k in ("ei.blocks", "ei.blocks_fetched", "ei.blocks_missing", "ei.bytes")} == {
        "ei.blocks": 40, "ei.blocks_fetched": 40, "ei.blocks_missing": 0, "ei.bytes": 40 * 65536}
    assert ok.attributes["ei.seconds"] == 0.0025 and ok.attributes["ei.transfer_s"] == 0.002
    assert ok.status.status_code == trace.StatusCode.UNSET and "ei.error" not in ok.attributes
    assert bad.status.status_code == trace.StatusCode.ERROR and bad.attributes["ei.error"] == "peer w2 unreachable"
    assert bad.attributes["ei.blocks_missing"] == 3 and bad.attributes["ei.bytes"] == 0


def test_an_untraced_request_records_nothing(spans):
    traces = WorkerTraces("w1", speedup=1.0)
    traces.arrived("r1", decode=False)  # no traceparent: not tracked
    traces.kv_transfer(traces.parent("r1"), "r1", "w0", 1, 2, blocks=1, fetched=1)
    assert spans.get_finished_spans() == ()


@pytest.mark.parametrize(("stage", "name"), [("queued", "worker.queue_wait"), ("admitted", "worker.prefill"), ("decoding", "worker.decode")])
def test_a_request_that_ends_otherwise_keeps_the_span_of_its_stage_with_how_it_ended(spans, stage, name):
    """``forget`` (aborted, rejected, handed back) recorded nothing: an aborted request's trace lost its decode span."""
    traces = WorkerTraces("w1", speedup=1.0)
    with tracing.tracer().start_as_current_span("worker work.{node}.decode") as work:
        traces.arrived("r1", decode=stage == "decoding")
    if stage == "admitted":
        traces.admitted(["r1"])
    traces.forget("r1", "aborted", "client disconnected")
    got = [s for s in spans.get_finished_spans() if s.name == name and "ei.ended" in s.attributes]
    assert len(got) == 1
    s = got[0]
    assert s.parent.span_id == work.get_span_context().span_id
    assert (s.attributes["ei.rid"], s.attributes["ei.ended"], s.attributes["ei.end_reason"]) == ("r1", "aborted", "client disconnected")
    assert s.status.status_code == trace.StatusCode.UNSET
    assert not traces  # no longer tracked


def test_a_request_the_node_failed_is_an_error_span(spans):
    traces = WorkerTraces("w1", speedup=1.0)
    with tracing.tracer().start_as_current_span("worker work.{node}.prefill"):
        traces.arrived("r1", decode=False)
    traces.forget("r1", "rejected", "request needs 90 KV blocks", error=True)
    (s,) = spans.get_finished_spans()[1:]
    assert s.name == "worker.queue_wait" and s.attributes["ei.ended"] == "rejected"
    assert s.status.status_code == trace.StatusCode.ERROR and s.status.description == "request needs 90 KV blocks"


def test_a_parked_prefill_that_ends_on_its_node_is_a_handoff_wait_not_a_decode(spans):
    """A prefill parked on its node (first token out, its decode binding not come: ``EngineScheduler.parked``)
    that is aborted there, or whose binding fails, ends ``worker.handoff_wait`` from its first token. Before, its
    first token started ``worker.decode`` (as on a collocated node), so the prefill node's part of the trace
    showed a decode span for a request it never decoded."""
    traces = WorkerTraces("w0", speedup=1.0)
    with tracing.tracer().start_as_current_span("worker work.{node}.prefill"):
        traces.arrived("r1", decode=False)
    traces.admitted(["r1"])
    traces.tokens("r1", 0, False, output_tokens=1, parked=True)
    traces.forget("r1", "aborted", "client disconnected")
    names = [s.name for s in spans.get_finished_spans()]
    assert names[-3:] == ["worker.queue_wait", "worker.prefill", "worker.handoff_wait"], names
    (s,) = [s for s in spans.get_finished_spans() if s.name == "worker.handoff_wait"]
    assert (s.attributes["ei.rid"], s.attributes["ei.ended"]) == ("r1", "aborted")
    assert "worker.decode" not in names
