"""Typed publish / subscribe / request-reply over NATS (the only I/O services share).

A service never touches raw bytes: it publishes Structs to a :class:`Subject`
from ``shared.subjects`` and receives decoded Structs in its handler. A payload
that fails to decode, or that decodes but fails the edge checks of
``shared.validate`` (non-finite times, unbounded lists, a node id that is not
the subject's ...), is counted under ``dropped.<template>`` (the latter also
under ``invalid.<template>``) and dropped; an exception raised by a handler is
counted under ``handler_errors.<template>``. Both are logged at a bounded rate
(``shared.ratelog``: the first few per subject and interval, then one summary
line). Neither reaches or stops the service loop (STYLE §4, "Dispatch").

One decoder per message type is built once and reused (msgspec perf tips).

Tracing (``shared/tracing.py``): ``publish``/``request`` take optional NATS
``headers`` (the W3C ``traceparent`` from ``tracing.inject``); with tracing on,
a received message carrying ``traceparent`` is handled inside a CONSUMER
(subscribe) or SERVER (serve) span named ``<service> <subject template>``.
With tracing off nothing is added and headers are not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg as NatsMsg
from nats.aio.subscription import Subscription

from shared import messages as m
from shared.auth import NatsAuth
from shared.ratelog import RateLimitedLog
from shared import tracing
from shared.subjects import SVC_HEARTBEAT, SVC_STATS, Subject, Subjects
from shared.validate import check as validate_msg
from shared.validate import subject_params

Handler = Callable[[Any, str], Awaitable[None]]
"""``async def handler(msg, subject) -> None``."""
ReplyHandler = Callable[[Any, str], Awaitable[msgspec.Struct | None]]
"""``async def handler(request, subject) -> reply or None (no reply)``."""

_DECODERS: dict[Any, msgspec.msgpack.Decoder] = {}


def decoder_for(msg_type: Any) -> msgspec.msgpack.Decoder:
    """The shared msgpack decoder for a message type (built on first use)."""
    dec = _DECODERS.get(msg_type)
    if dec is None:
        dec = _DECODERS[msg_type] = msgspec.msgpack.Decoder(msg_type)
    return dec


class BusError(RuntimeError):
    """A request got no (decodable) reply in time."""


class Bus:
    """A NATS connection bound to a partition and a publishing instance.

    Args:
        nc: a connected nats-py client.
        subjects: the partition's subject builder.
        service: service kind (``router``, ``worker`` ...), used in heartbeats.
        instance: instance id, stamped into every published message's ``src``.
    """

    def __init__(self, nc: NatsClient, subjects: Subjects, *, service: str, instance: str) -> None:
        self.nc = nc
        self.subjects = subjects
        self.service = service
        self.instance = instance
        self.counters: Counter[str] = Counter()
        self.log = structlog.get_logger("bus").bind(instance=instance)
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.droplog = RateLimitedLog(self.log, first=5, interval_s=10.0)
        """Bounds the lines written for dropped messages and handler errors."""
        self.known_nodes: frozenset[str] | None = None
        """Node ids of the cluster when this service knows them: messages naming
        another node are dropped (``shared.validate``). None = any well-formed id."""

    # -- construction ---------------------------------------------------- #

    @classmethod
    async def connect(
        cls,
        url: str,
        subjects: Subjects,
        *,
        service: str,
        instance: str,
        connect_timeout: float = 5.0,
        max_reconnect_attempts: int = -1,
        allow_reconnect: bool = True,
        auth: NatsAuth | None = None,
    ) -> "Bus":
        """Connect to NATS and return a bus; reconnects forever by default
        (``allow_reconnect=False``: one attempt, for command-line tools that must fail fast).

        ``auth`` (``shared.auth``): nkey seed / creds file / user+password and TLS of
        this identity; None = connect without credentials (an open server).

        Raises:
            AuthError: unreadable TLS files.
            BusError: the server refused the credentials ("Authorization Violation").
            OSError / nats.errors.NoServersError: if no server answers in time.
        """
        bus = cls(NatsClient(), subjects, service=service, instance=instance)
        refused = asyncio.Event()

        async def error_cb(e: Exception) -> None:
            bus.counters["nats.errors"] += 1
            text = str(e).lower()
            if "permissions violation" in text:
                bus.counters["nats.permission_violations"] += 1
            if not bus.nc.is_connected and ("authorization violation" in text or "authentication" in text):
                refused.set()  # wrong or missing credentials: retrying cannot help
            bus.droplog.event("nats.errors", "nats error", error=repr(e)[:300])

        async def disconnected_cb() -> None:
            if bus._closing:
                return
            bus.counters["nats.disconnects"] += 1
            bus.log.warning("nats disconnected")

        async def reconnected_cb() -> None:
            bus.counters["nats.reconnects"] += 1
            bus.log.info("nats reconnected")

        async def closed_cb() -> None:
            bus.log.debug("nats connection closed")

        connecting = asyncio.ensure_future(bus.nc.connect(
            url,
            name=f"{service}:{instance}",
            connect_timeout=connect_timeout,
            max_reconnect_attempts=max_reconnect_attempts,
            allow_reconnect=allow_reconnect,
            reconnect_time_wait=0.5,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            closed_cb=closed_cb,
            **(auth.connect_options() if auth is not None else {}),
        ))
        refusal = asyncio.ensure_future(refused.wait())
        await asyncio.wait({connecting, refusal}, return_when=asyncio.FIRST_COMPLETED)
        refusal.cancel()
        if not connecting.done():
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            with contextlib.suppress(Exception):
                await bus.nc.close()
            raise BusError(f"NATS at {url} refused the credentials of {instance!r} (Authorization Violation)")
        try:
            connecting.result()
        except Exception as e:
            if refused.is_set():
                raise BusError(f"NATS at {url} refused the credentials of {instance!r} (Authorization Violation)") from e
            raise
        return bus

    # -- publish / subscribe --------------------------------------------- #

    def _stamp(self, msg: msgspec.Struct) -> msgspec.Struct:
        if isinstance(msg, m.Msg) and not msg.src:
            return msgspec.structs.replace(msg, src=self.instance)
        return msg

    async def publish(self, subject: Subject, msg: msgspec.Struct, *, headers: dict[str, str] | None = None, **params: str) -> None:
        """Publish ``msg`` on ``subject`` formatted with ``params`` (``headers``: NATS headers, e.g. ``traceparent``).

        Raises:
            BusError: the client refused the message (connection closed, reconnect buffer
                full: ``OutboundBufferLimitError``), so that no NATS exception escapes bare.
        """
        try:
            await self.nc.publish(self.subjects.format(subject, **params), m.encode(self._stamp(msg)), headers=headers)
        except nats.errors.Error as e:
            self.counters["publish_failed." + subject.template] += 1
            raise BusError(f"cannot publish on {subject.template}: {type(e).__name__}: {e}") from e
        self.counters["published." + subject.template] += 1

    async def publish_raw(self, full_subject: str, payload: bytes) -> None:
        """Publish bytes as they are (fuzz tests and bridges only)."""
        await self.nc.publish(full_subject, payload)

    def _decode(self, subject: Subject, raw: NatsMsg) -> Any:
        try:
            msg = decoder_for(subject.msg_type).decode(raw.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.counters["dropped." + subject.template] += 1
            self.droplog.event(subject.template, "malformed message dropped", subject=raw.subject, error=str(e)[:200], size=len(raw.data))
            return None
        why = validate_msg(msg, subject_params(subject.template, self.subjects.prefix, raw.subject), self.known_nodes)
        if why is not None:
            self.counters["dropped." + subject.template] += 1
            self.counters["invalid." + subject.template] += 1
            self.droplog.event(subject.template, "invalid message dropped", subject=raw.subject, error=why[:200], size=len(raw.data))
            return None
        return msg

    async def subscribe(self, subject: Subject, handler: Handler, *, queue: str = "", **params: str) -> Subscription:
        """Subscribe to ``subject`` (missing params become ``*``) with a typed handler."""
        template = subject.template

        async def cb(raw: NatsMsg) -> None:
            msg = self._decode(subject, raw)
            if msg is None:
                return
            self.counters["received." + template] += 1
            span = token = None
            if tracing.ENABLED and raw.headers and "traceparent" in raw.headers:
                span = tracing.start(f"{self.service} {template}", tracing.extract(raw.headers), kind=tracing.SpanKind.CONSUMER)
                token = tracing.attach(tracing.trace.set_span_in_context(span))
            try:
                await handler(msg, raw.subject)
            except Exception as e:  # a handler bug must not kill the subscription
                self.counters["handler_errors." + template] += 1
                self.droplog.event("handler." + template, "handler failed", level="exception", subject=raw.subject, error=repr(e)[:200])
            finally:
                if span is not None:
                    tracing.detach(token)
                    span.end()

        sub = await self.nc.subscribe(
            self.subjects.wildcard(subject, **params),
            queue=queue,
            cb=cb,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1024 * 1024 * 1024,
        )
        self._subs.append(sub)
        return sub

    async def serve(self, subject: Subject, handler: ReplyHandler, *, queue: str = "", **params: str) -> Subscription:
        """Answer requests on ``subject``; the handler returns the reply Struct."""
        template = subject.template

        async def cb(raw: NatsMsg) -> None:
            msg = self._decode(subject, raw)
            if msg is None:
                return
            self.counters["received." + template] += 1
            span = token = None
            if tracing.ENABLED and raw.headers and "traceparent" in raw.headers:
                span = tracing.start(f"{self.service} {template}", tracing.extract(raw.headers), kind=tracing.SpanKind.SERVER)
                token = tracing.attach(tracing.trace.set_span_in_context(span))
            try:
                reply = await handler(msg, raw.subject)
            except Exception as e:
                self.counters["handler_errors." + template] += 1
                self.droplog.event("handler." + template, "request handler failed", level="exception", subject=raw.subject, error=repr(e)[:200])
                return
            finally:
                if span is not None:
                    tracing.detach(token)
                    span.end()
            if reply is not None and raw.reply:
                await self.nc.publish(raw.reply, m.encode(self._stamp(reply)))

        sub = await self.nc.subscribe(self.subjects.wildcard(subject, **params), queue=queue, cb=cb)
        self._subs.append(sub)
        return sub

    async def request(
        self, subject: Subject, msg: msgspec.Struct, *, timeout: float = 2.0, headers: dict[str, str] | None = None, **params: str
    ) -> Any:
        """Send a request and return the decoded reply (``headers``: NATS headers, e.g. ``traceparent``).

        Raises:
            BusError: on timeout, no responders, or an undecodable reply.
        """
        full = self.subjects.format(subject, **params)
        try:
            raw = await self.nc.request(full, m.encode(self._stamp(msg)), timeout=timeout, headers=headers)
        except (nats.errors.Error, asyncio.TimeoutError) as e:  # timeout, no responders, closed, buffer full
            self.counters["request_failed." + subject.template] += 1
            raise BusError(f"no reply on {full}: {type(e).__name__}") from e
        try:
            reply = decoder_for(subject.reply_type).decode(raw.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.counters["dropped_reply." + subject.template] += 1
            raise BusError(f"malformed reply on {full}: {e}") from e
        why = validate_msg(reply, None, self.known_nodes)
        if why is not None:
            self.counters["dropped_reply." + subject.template] += 1
            raise BusError(f"invalid reply on {full}: {why}")
        return reply

    # -- service plumbing ------------------------------------------------- #

    async def start_service_plumbing(
        self,
        stats: Callable[[], tuple[dict[str, int], dict[str, float]]] | None = None,
        *,
        heartbeat_interval_s: float = 1.0,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        """Answer ``svc.stats.<instance>`` and publish a heartbeat every interval.

        ``stats`` returns the service's own counters and gauges; the bus adds its
        own counters (published/received/dropped per subject template).
        """

        async def on_stats(_req: m.StatsRequest, _subject: str) -> m.StatsReply:
            counters, gauges = stats() if stats else ({}, {})
            merged = dict(self.counters)
            merged.update(counters)
            return m.StatsReply(service=self.service, instance=self.instance, counters=merged, gauges=gauges)

        await self.serve(SVC_STATS, on_stats, instance=self.instance)

        async def beat() -> None:
            while True:
                try:
                    await self.publish(
                        SVC_HEARTBEAT,
                        m.Heartbeat(
                            service=self.service,
                            instance=self.instance,
                            pid=os.getpid(),
                            ready=ready() if ready else True,
                            wall_ts=time.time(),
                        ),
                        service=self.service,
                    )
                except Exception as e:  # connection hiccup: keep beating
                    self.log.debug("heartbeat failed", error=repr(e))
                self.droplog.flush()
                await asyncio.sleep(heartbeat_interval_s)

        self._tasks.append(asyncio.create_task(beat(), name=f"heartbeat-{self.instance}"))

    async def close(self) -> None:
        """Stop background tasks, drain subscriptions (in-flight handlers finish), close."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=5.0)
            except Exception:
                await self.nc.close()
