"""Per-request spans of one worker (tracing on only; see ``shared/tracing.py`` for the span table).

The worker shell calls these hooks only when :data:`shared.tracing.ENABLED`
(arrival) or when a request is tracked (``WorkerTraces.__bool__``), so with
tracing off no hook runs. Times are wall ns (``time.time_ns()``); the fetch
span's length is the engine's ``fetch_s`` (simulated s) divided by the clock's
speed-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from shared import tracing


@dataclass(slots=True)
class _Req:
    ctx: Any
    """Context of the bus's consumer span of the work message (parent of this node's spans)."""
    arrived_ns: int
    admitted_ns: int = 0
    decode_from_ns: int = 0
    """Decode starts here: arrival of a hand-off, or the first token on a collocated node."""
    parked_from_ns: int = 0
    """First token of a prefill parked here (its decode binding had not come: its hand-off waits for it)."""


class WorkerTraces:
    """Spans of the requests this node is serving (rid → timestamps and parent context)."""

    def __init__(self, node: str, speedup: float) -> None:
        self.node = node
        self.speedup = speedup
        self._reqs: dict[str, _Req] = {}

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def arrived(self, rid: str, *, decode: bool) -> None:
        """Work for ``rid`` was accepted; track it when its message carried a sampled ``traceparent``."""
        ctx = tracing.current()
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            return
        now = time.time_ns()
        self._reqs[rid] = _Req(ctx, now, decode_from_ns=now if decode else 0)

    def admitted(self, rids: list[str]) -> None:
        """``rids``' prefill starts now: their ``worker.queue_wait`` ends."""
        now = time.time_ns()
        for rid in rids:
            r = self._reqs.get(rid)
            if r is not None and not r.admitted_ns:
                r.admitted_ns = now
                tracing.record("worker.queue_wait", r.ctx, r.arrived_ns, now, {"ei.node": self.node, "ei.rid": rid})

    def parent(self, rid: str) -> Any:
        """The parent context of ``rid``'s spans here, or None when not traced."""
        r = self._reqs.get(rid)
        return None if r is None else r.ctx

    def tokens(self, rid: str, index: int, finished: bool, *, fetch_s: float | None = None,
               exposed_fetch_s: float | None = None, fetched_tokens: int = 0, output_tokens: int = 0,
               parked: bool = False) -> None:
        """Output of ``rid``: the first token ends ``worker.prefill`` (and records ``worker.fetch``);
        the last ends ``worker.decode``. ``parked``: the first token of a prefill parked here (its
        hand-off waits for its decode binding, ``EngineScheduler.parked``): no decode starts here, so
        one that ends here otherwise (:meth:`forget`) ends ``worker.handoff_wait``, not ``worker.decode``."""
        r = self._reqs.get(rid)
        if r is None:
            return
        now = time.time_ns()
        if index == 0:
            start = r.admitted_ns or r.arrived_ns
            tracing.record("worker.prefill", r.ctx, start, now, {"ei.node": self.node, "ei.rid": rid})
            if fetch_s:
                end = r.arrived_ns + int(fetch_s / self.speedup * 1e9)
                tracing.record("worker.fetch", r.ctx, r.arrived_ns, end, {
                    "ei.node": self.node, "ei.fetch_s": fetch_s, "ei.exposed_fetch_s": exposed_fetch_s or 0.0,
                    "ei.fetched_tokens": fetched_tokens,
                })
            if parked:
                r.parked_from_ns = now
            else:
                r.decode_from_ns = now
        if finished:
            del self._reqs[rid]
            if r.decode_from_ns and (index > 0 or output_tokens > 1):
                tracing.record("worker.decode", r.ctx, r.decode_from_ns, now,
                               {"ei.node": self.node, "ei.rid": rid, "ei.output_tokens": output_tokens})

    def kv_transfer(self, parent: Any, rid: str, peer: str, start_ns: int, end_ns: int, *, blocks: int, fetched: int = 0,
                    missing: int = 0, nbytes: int = 0, seconds: float = 0.0, transfer_s: float = 0.0,
                    error: str | None = None) -> None:
        """A ``worker.kv_transfer`` span: the real bytes of ``rid``'s prefix pulled from ``peer``'s host
        pool (real-bytes mode, ``--kv-pool real``), one span per source node.

        Args:
            parent: ``rid``'s parent context taken when the fetch started (:meth:`parent`; None = not
                traced: nothing recorded), so a request that left while its bytes moved keeps its span.
            start_ns, end_ns: wall ns (``time.time_ns()``) of the pull.
            blocks: blocks asked of ``peer``; fetched / missing: of those, now held locally
                (checksum-verified) / not obtained (recomputed).
            nbytes: bytes the transfer engine moved; seconds: wall s of the whole pull (locate +
                transfer + verify); transfer_s: its transfer part.
            error: why the pull failed, if it did (the span's status is then ERROR).
        """
        if parent is None:
            return
        span = tracing.start("worker.kv_transfer", parent, start_ns=start_ns, attributes={
            "ei.node": self.node, "ei.rid": rid, "ei.peer": peer, "ei.blocks": blocks, "ei.blocks_fetched": fetched,
            "ei.blocks_missing": missing, "ei.bytes": nbytes, "ei.seconds": seconds, "ei.transfer_s": transfer_s,
        })  # fmt: skip
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            span.set_attribute("ei.error", error)
        span.end(end_time=max(start_ns, end_ns))

    def handoff(self, rid: str, decode_node: str) -> dict[str, str] | None:
        """``rid`` leaves for ``decode_node``: a ``worker.handoff`` span; returns the headers for ``work.<d>.decode``."""
        r = self._reqs.pop(rid, None)
        if r is None:
            return None
        span = tracing.start("worker.handoff", r.ctx, kind=trace.SpanKind.PRODUCER, attributes={"ei.node": self.node, "ei.decode_node": decode_node})
        headers = tracing.inject(span)
        span.end()
        return headers

    def forget(self, rid: str, ended: str, reason: str = "", *, error: bool = False) -> None:
        """``rid`` ended otherwise than by its last token or a hand-off: its span of the phase it was in ends
        now, so an aborted or failed request's trace keeps its node's part.

        The span is ``worker.decode`` once decoding (after its first token here, or a hand-off's arrival),
        else ``worker.handoff_wait`` once parked (first token out, its decode binding not come: before,
        ``worker.decode``, though a prefill node never decoded it), else ``worker.prefill`` once
        admitted, else ``worker.queue_wait``; it carries ``ei.ended`` (how it
        ended: ``aborted``, ``rejected``, ``handed_back``) and ``ei.end_reason`` (the reason given, when
        one is); ``error``: status ERROR with ``reason`` (the node failed the request, an engine error).
        Nothing for a request not traced here.
        """
        r = self._reqs.pop(rid, None)
        if r is None:
            return
        now = time.time_ns()
        if r.decode_from_ns:
            name, start = "worker.decode", r.decode_from_ns
        elif r.parked_from_ns:
            name, start = "worker.handoff_wait", r.parked_from_ns
        elif r.admitted_ns:
            name, start = "worker.prefill", r.admitted_ns
        else:
            name, start = "worker.queue_wait", r.arrived_ns
        attrs = {"ei.node": self.node, "ei.rid": rid, "ei.ended": ended}
        if reason:
            attrs["ei.end_reason"] = reason
        span = tracing.start(name, r.ctx, start_ns=start, attributes=attrs)
        if error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, reason or ended))
        span.end(end_time=max(start, now))
