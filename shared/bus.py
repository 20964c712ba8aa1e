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

Surviving a NATS restart (issue 22): the client reconnects forever to the
same address (the embedded server keeps its port across restarts), and what
is published while disconnected waits in a bounded buffer
(``PENDING_BYTES``) that is flushed on reconnect. Core NATS still delivers at
most once: a message flushed by one service before another has re-subscribed
is gone. So the subjects that must arrive (``Subject.reliable``: work
dispatches, hand-offs, aborts, token outputs, KV events, branch events,
placements) are captured by a JetStream stream (``EI_<partition>``, file
storage, kept ``STREAM_MAX_AGE_S``), and a subscription to one of them is an
ordered JetStream consumer: after a reconnect it resumes from the last stream
sequence it handled (from the stream's new end when a killed server came back
without its last writes; from the start of a new stream when the server came back without its
store at all, e.g. a new container without a volume: the stream is made again after the
reconnect, by the first bus allowed to). What a client wrote in the moments before the server
died may never have been stored: each reliable message carries a
``Nats-Msg-Id``, the publisher keeps them (its resend window) until the server is known to have read them
``RESEND_WINDOW_S`` before (a PING each ``CONFIRM_PING_S`` confirms by its PONG every publish that had reached the
connection's transport before it: :meth:`Bus._confirm_loop`; the last 2-3 s in normal operation) and publishes them again on
reconnect; the stream drops the copies it already has (its duplicate window) and each consumer drops an id it has
handled, so nothing is lost or handled twice. A server that hangs (SIGSTOP) keeps the TCP connection open and answers
no PING: what is published during the freeze sits in the socket and stays in the window (up to ``RESEND_MAX_MSGS``),
so the kill that ends the freeze loses none of it; before, only the last ``RESEND_WINDOW_S`` before the disconnect was
kept (``tests/integration/test_bus_freeze_kill_live.py``). One known limit on order: nats-py flushes its reconnect buffer (what was published during
the outage) before the reconnected callback, where the bus publishes the older window again, so a server that kept
its store stores an outage's publishes ahead of the window's unstored ones (a router holds the later token chunks up
to ``CHUNK_GAP_WAIT_S``, 7 s, for the older ones, then sends them in order, else fails the request with a 502:
``services/router/service.py``); docs/architecture.md says so. Without JetStream on the server (``--nats-url`` to a plain server) the
bus falls back to core subscriptions and says so in the log (at the bus's first stream check; a bus on JetStream
that reconnects to a server restarted without it keeps its reliable publishes until JetStream is back,
:meth:`Bus._await_jetstream`, its ``/readyz`` 503 meanwhile); a server with JetStream that lacks the
stream while this bus may not make it (under credentials only the launcher may) is waited for
(:meth:`Bus.ensure_stream`), so a service that starts first does not stay on core NATS.

Tracing (``shared/tracing.py``): ``publish``/``request`` take optional NATS
``headers`` (the W3C ``traceparent`` from ``tracing.inject``); with tracing on,
a received message carrying ``traceparent`` is handled inside a CONSUMER
(subscribe) or SERVER (serve) span named ``<service> <subject template>``.
With tracing off nothing is added and headers are not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg as NatsMsg
from nats.aio.subscription import Subscription

from shared import messages as m
from shared.cancel import cancel_until_done
from shared.auth import BEAT_WATCHERS, NatsAuth, client_options, redact_url, subject_matcher
from shared import natsping
from shared.natsping import Ping
from shared.ratelog import RateLimitedLog
from shared import tracing
from shared.subjects import SVC_HEARTBEAT, SVC_STATS, Subject, Subjects
from shared.validate import check as validate_msg
from shared.validate import subject_params

Handler = Callable[[Any, str], Awaitable[None]]
"""``async def handler(msg, subject) -> None``."""
ReplyHandler = Callable[[Any, str], Awaitable[msgspec.Struct | None]]
"""``async def handler(request, subject) -> reply or None (no reply)``."""

_DECODERS: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def decoder_for(msg_type: Any) -> msgspec.msgpack.Decoder[Any]:
    """The shared msgpack decoder for a message type (built on first use)."""
    dec = _DECODERS.get(msg_type)
    if dec is None:
        dec = _DECODERS[msg_type] = msgspec.msgpack.Decoder(msg_type)
    return dec



def _span_attrs(subject: str, template: str, msg: Any, operation: str) -> dict[str, Any]:
    """Attributes of the span opened for a received message (OTel messaging semconv): ``messaging.system``
    ``nats``, ``messaging.destination.name`` (the subject, e.g. ``work.w0.prefill``),
    ``messaging.destination.template`` (``work.{node}.prefill``), ``messaging.operation.type``, and
    ``ei.rid`` when the message names a request (a ``rid`` field that is not empty)."""
    attrs: dict[str, Any] = {"messaging.system": "nats", "messaging.destination.name": subject,
                             "messaging.destination.template": template, "messaging.operation.type": operation}  # fmt: skip
    rid = getattr(msg, "rid", None)
    if isinstance(rid, str) and rid:
        attrs["ei.rid"] = rid
    return attrs

_CLOSED_TRANSPORT: tuple[type[Exception], ...] = (RuntimeError, OSError)
_REQUEST_FAILED: tuple[type[Exception], ...] = (nats.errors.Error, asyncio.TimeoutError, *_CLOSED_TRANSPORT)
"""What nats-py lets escape when its connection drops while it writes: uvloop's ``RuntimeError: unable to perform
operation on <TCPTransport closed=True ...>; the handler is closed`` (``_flush_pending`` writing into a transport the
server's death just closed: a router's ``kv.lookup`` while nats-server was killed escaped it as an HTTP 500,
tests/e2e/test_faults_live.py), or an ``OSError`` of the socket. :meth:`Bus.publish` and :meth:`Bus.request` turn
them into a :class:`BusError` as they do nats-py's own errors (:class:`BusError` itself, a ``RuntimeError``, is
re-raised as it is)."""


class BusError(RuntimeError):
    """A request got no (decodable) reply in time, or the bus could not take a message."""


class NoReply(BusError):
    """A request got no reply: its timeout passed, nobody serves its subject (:class:`NoResponders`), or the
    connection closed or its buffer filled under it. Unlike a refused, malformed or denied request, the same
    request may be answered later (a responder restarting, a hung one resumed)."""


class NoResponders(NoReply):
    """A request found nobody serving its subject (NATS "no responders"): the service that answers it
    is gone or not subscribed yet, unlike a timeout, where it may only be slow."""


class PermissionDenied(BusError):
    """The NATS server refused this identity a publish its request needed ("Permissions Violation"):
    its credentials lack the subject, so waiting or retrying cannot help."""


class RequestRefused(BusError):
    """The responder refused the request as malformed or invalid (its empty reply's ``Ei-Refused`` header,
    :data:`REFUSED_HEADER`, names why): the same request is refused again, so retrying cannot help, unlike a
    timeout or no responders."""


class NoCredentials(BusError):
    """The NATS server requires credentials and the client connected without any."""


_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"', re.IGNORECASE)


def denied_subject(error_text: str) -> tuple[str, str] | None:
    """``("publish" | "subscription", subject)`` of a NATS "Permissions Violation" error text, else None.

    Source: nats-server's ``-ERR 'Permissions Violation for Publish to "SUBJECT"'``, as nats-py
    passes it to ``error_cb``.
    """
    found = _VIOLATION.search(error_text)
    return (found.group(1).lower(), found.group(2)) if found else None


class BusUnavailable(BusError):
    """NATS is unreachable and the outbound buffer is full or the connection closed:
    the caller should answer 503 and let the client retry."""


def _refusal(url: str, instance: str, auth: NatsAuth | None) -> BusError:
    """The error of a connect the server refused: :class:`NoCredentials` when none were given (neither
    ``auth`` nor a user part in ``url``)."""
    if auth is None or not auth.enabled:
        if "@" in url:  # the URL's credentials (client_options sends them when auth has none)
            return BusError(f"NATS at {redact_url(url)} refused the credentials in the URL (Authorization Violation)")
        return NoCredentials(f"NATS at {redact_url(url)} requires credentials and none were given (Authorization Violation)")
    who = repr(instance) if auth.name in ("", instance) else f"{instance!r} (identity {auth.name!r})"
    return BusError(f"NATS at {redact_url(url)} refused the credentials of {who} (Authorization Violation)")


PENDING_BYTES = 256 * 1024 * 1024
"""Bytes a client buffers while disconnected (nats-py ``pending_size``); beyond it a
publish raises :class:`BusUnavailable` instead of growing without bound."""
RECONNECT_WAIT_S = 0.25
"""Seconds between reconnect attempts to the same server."""
CLOSE_DRAIN_S = 5.0
"""Seconds :meth:`Bus.close` drains the connection (in-flight handlers finish, what was published goes out) before it
cancels the drain (at most 1 s more for the cancel to land) and closes the connection."""
CLOSE_LOST_GRACE_S = 0.3
"""Seconds :meth:`Bus.close`'s drain waits for a lost connection to come back once no handler is running or queued;
then it ends, what was published meanwhile dropped. Counted from the loss itself (``disconnected_cb``) when the
connection was already lost, with no handler busy, as the drain began: a close that begins this long after the loss
ends at once, with no reconnect try of its own (since 71d5cdd). Otherwise counted from when the drain first finds the
connection lost and no handler busy (more than one ``RECONNECT_WAIT_S``: one reconnect try at least).
A nats-server gone for good held every service's close the whole ``CLOSE_DRAIN_S`` before (5.0 s; now about
this grace, ``tests/integration/test_bus_close_nats_gone_live.py``)."""
CLOSE_POLL_S = 0.05
"""Seconds between :meth:`Bus.close`'s looks at the connection and the handlers while it drains."""
FLUSH_RECHECK_S = 0.25
"""Seconds at most between :meth:`Bus.flush`'s looks at the connection while it waits for a reconnect or a PONG: the
bus's reconnected and closed callbacks wake it at once (:meth:`Bus._connection_changed`); the look covers a bus built
on a client without them. Before, a flush while disconnected spun (1.6 CPU-s in a 2-s flush, review rr-ping53)."""
ABANDON_S = 5.0
"""Seconds a cancelled :meth:`Bus.connect` keeps cancelling nats-py's connect (every 0.05 s) until it ends: one
cancel can be lost (Python 3.11's ``asyncio.wait_for`` and a refusal in one loop turn; a later one lands within
a ``RECONNECT_WAIT_S``)."""
STREAM_MAX_AGE_S = 120.0
"""How long the JetStream stream keeps a reliable message (seconds): it only has to
bridge an outage and a consumer's resume."""
STREAM_MAX_BYTES = 192 * 1024 * 1024
"""Byte cap of the stream (oldest dropped first); under the embedded server's JetStream file
store cap (``shared.natsserver.JS_MAX_FILE_BYTES``)."""
CONSUMER_HEARTBEAT_S = 0.5
"""Idle heartbeat of an ordered consumer; two missed ones make it resume (seconds)."""
RESEND_WINDOW_S = 2.0
"""Reliable messages published this many seconds before a disconnect are published again
on reconnect (they may have died in the socket or in the server's write buffer); on a bus made by
:meth:`Bus.connect` also every one the server has not yet been seen to read that long ago (:data:`CONFIRM_PING_S`)."""
CONFIRM_PING_S = 1.0
"""Seconds between the PINGs with which a bus that publishes reliable messages learns what the server has read
(:meth:`Bus._confirm_loop`): a reliable publish leaves the resend window only once a PING sent after it got its PONG
``RESEND_WINDOW_S`` ago. A server that hangs (SIGSTOP, a stuck host) keeps the TCP connection open and answers none,
so everything published since stays in the window until the kill that ends the freeze, and is published again."""
CONFIRM_QUEUE_WAIT_S = 0.05
"""Seconds a confirm round waits for nats-py's outgoing queue to empty before its PING (so that the PING confirms
everything published before it, a quiet bus's last publish at once); a queue still busy then (a publisher sending
back to back) confirms what was published before it was last seen empty (``Bus._clear``)."""
RESEND_MAX_MSGS = 50_000
"""Bound in messages of the resend window (merged over disconnects no reconnect's check took, :meth:`Bus._put_back`:
past it the oldest are dropped, counted ``resend_dropped``) and of the reliable publishes kept while the stream may be
lost (``HELD_MAX_BYTES``)."""
WINDOW_POLL_S = 0.02
"""Seconds between two looks at the resend window while :meth:`Bus.window_room` waits for room."""
HELD_MAX_BYTES = 64 * 1024 * 1024
"""Byte bound (payloads) of the reliable publishes a bus keeps from a disconnect until it knows the stream is there
after the reconnect (:meth:`Bus._hold`): copies of what went to nats-py's reconnect buffer, published again, in
order, when the server came back without its store; past it (or ``RESEND_MAX_MSGS``) the oldest copies are dropped,
counted ``stream_held_dropped`` (lost if the stream was new). Once the reconnect's lookup found the stream lost
(:attr:`Bus._stream_lost`) a publish is only kept, not sent: at the bound a new one is refused
(:class:`BusUnavailable`, counted ``publish_failed.<subject>``), nothing kept is dropped."""
PUBLISH_STREAM_WAIT_S = 5.0
"""How long the first reliable publish of a bus that has not looked for the stream yet waits for it (seconds);
past that it is sent over core NATS and the search goes on in the background (:meth:`Bus.publish`)."""
STREAM_SUBJECT_OVERLAP = 10065
"""JetStream's ``err_code`` for a stream whose subjects overlap another stream's (``JSStreamSubjectOverlapErr``)."""


def stream_refusal(e: BaseException) -> str:
    """Why the server refused to create the stream, as words for a warning or an error line, from its
    JetStream API answer (``description`` and ``err_code``), with the fix for subjects that overlap
    another stream's (``STREAM_SUBJECT_OVERLAP``); empty when ``e`` is no such answer (a timeout: under
    credentials only the launcher may create it, the server leaves the create unanswered).

    nats-py's API errors have an empty repr (``BadRequestError()``): use this, or ``str(e)``, to show one."""
    if not isinstance(e, nats.js.errors.APIError) or isinstance(e, nats.js.errors.ServiceUnavailableError):
        return ""
    why = f"the server refused to create it ({e.description or 'no description'}, err_code {e.err_code}"
    if e.err_code == STREAM_SUBJECT_OVERLAP:
        why += "; another stream already takes some of its subjects: delete that stream or use another partition"
    return why + ")"


JETSTREAM_NOT_ENABLED = frozenset({10076, 10039})
"""JetStream API ``err_code`` of a server or account without JetStream (``JSNotEnabledErr``,
``JSNotEnabledForAccountErr``): the stream lookup's answer then, when the server answers at all."""
STREAM_LOOKUP_TIMEOUT_S = 5.0
"""How long :meth:`Bus.ensure_stream` waits for one answer to its stream lookup (seconds); without one it looks
again (a loaded server), it does not take the silence for a server without JetStream."""


def no_jetstream(e: BaseException) -> bool:
    """Whether ``e``, the error of a JetStream API request (the stream lookup), says the server has no JetStream:
    nobody serves the API (nats-py's bare ``ServiceUnavailableError``, from "no responders": what a nats-server
    started without ``-js`` answers, at once, measured), or an answer "JetStream not enabled" (for the account)
    (:data:`JETSTREAM_NOT_ENABLED`). False for a timeout, a connection down a moment, or a 503 answered by
    JetStream itself ("temporarily unavailable": it is there, not ready): JetStream may well be there, so the
    caller looks again rather than fall back to core NATS (at most once) for the bus's whole life."""
    if isinstance(e, nats.errors.NoRespondersError):
        return True
    if not isinstance(e, nats.js.errors.APIError):
        return False
    if e.err_code in JETSTREAM_NOT_ENABLED or "not enabled" in str(e.description or "").lower():
        return True
    return isinstance(e, nats.js.errors.ServiceUnavailableError) and e.code is None and e.err_code is None


STREAM_BACK_WAIT_S = 60.0
"""After a reconnect to a server that lost the stream (its store gone), a bus that may not make it again (under
credentials only the launcher may) waits for another to make it, with a warning every this many wall seconds."""
SEEN_IDS = 200_000
"""Message ids a reliable subscription remembers to drop duplicates (per subscription)."""
MSG_ID = "Nats-Msg-Id"
#: Header of the empty reply to a request refused as malformed or invalid; its value is the reason.
REFUSED_HEADER = "Ei-Refused"


REPLY_PREFIX = "_INBOX."
"""Reply subjects :meth:`Bus.serve` answers: nats-py's inboxes (``_INBOX.<id>``, and with credentials
``_INBOX.<identity>.<id>``, ``shared.auth.NatsAuth.inbox_prefix``)."""


def stream_name(subjects: Subjects) -> str:
    """Name of the partition's JetStream stream for reliable subjects: ``EI_<partition>``."""
    return "EI_" + subjects.partition


def covers(pattern: str, subject: str) -> bool:
    """Whether NATS subject ``pattern`` (``*`` one token, ``>`` the rest) matches every subject that
    ``subject`` (itself possibly a wildcard) matches; e.g. ``ei.p0.>`` covers ``ei.p0.work.*.prefill``."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return i < len(s)
        if i >= len(s) or s[i] == ">" or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def stream_lacks(have: Sequence[str], want: Sequence[str]) -> list[str]:
    """The subjects of ``want`` (the stream's config: every reliable subject) that no subject of ``have`` (a stream
    found on the server) covers (:func:`covers`), in ``want``'s order; empty when it takes them all."""
    return [w for w in want if not any(covers(h, w) for h in have)]


STREAM_FIX = (
    "delete it and make it anew (it keeps only {age:g} s of messages): `evolving-infra auth stream --recreate "
    "--nats-url URL` (with credentials that may delete it: auth gen's admin.nk), or use another partition"
)
"""How to mend a stream that lacks reliable subjects (:class:`StreamLacksSubjects`); ``{age}``: its max age, s."""


class StreamLacksSubjects(BusError):
    """The partition's stream is there but does not take every reliable subject (another version's, or one made by
    hand): messages on those subjects are kept by no stream and reach no JetStream consumer (a request's output
    never reaches its router). Raised by :meth:`Bus.ensure_stream` for ``maker`` (``up``'s launcher); the message
    names the stream, what it lacks and the fix (:data:`STREAM_FIX`)."""


def stream_api_subject(api: str, name: str) -> str:
    """The JetStream API subject of ``api`` (``INFO``, ``CREATE``) on stream ``name``: ``$JS.API.STREAM.<api>.<name>``
    (what a lookup or create publishes to, and what a permission refusal names)."""
    return f"$JS.API.STREAM.{api}.{name}"


CONSUMER_CHECK_TASKS = ("_hbtask", "_fctask")
"""nats-py's attributes (2.16, private) of an ordered consumer's ``_JSI`` holding its idle-heartbeat activity check and
its flow-control responder tasks: :meth:`Bus._stop_consumer_checks` cancels them at the close's drain
(``tests/integration/test_bus_close_ordered_drain_live.py`` fails if nats-py renames them)."""


def js_position(raw: NatsMsg) -> tuple[int, str]:
    """``(stream sequence, consumer name)`` of a JetStream delivery, read from its reply subject as nats-py's
    ``Msg.metadata`` reads it (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>``, or the
    form with domain and account hash, 11 tokens or more), its numbers parsed the same; ``(0, "")`` for a message
    that is none (no such reply, a number that is not one). nats-py's builds a dataclass, two nested ones and a
    ``datetime`` a message, which a subscription reads two fields of: ~4% of the router's CPU in the demo, one
    per streamed token."""
    reply = raw.reply
    if reply and reply.startswith("$JS.ACK."):
        t = reply.split(".")
        n = len(t)
        try:
            if n == 9:
                int(t[4]), int(t[6]), int(t[7]), int(t[8])  # noqa: B018 - parsed as nats-py parses them
                return int(t[5]), t[3]
            if n >= 11:
                int(t[6]), int(t[8]), int(t[9]), int(t[10])  # noqa: B018
                return int(t[7]), t[5]
        except ValueError:
            pass
    return 0, ""


def _ordered_state(sub: Subscription) -> Any:
    """nats-py's state of the ordered consumer behind ``sub`` (``_JSI``: next stream sequence, the
    consumer's config, its reset), or None. ``js.subscribe`` returns a ``PushSubscription`` that
    wraps the subscription holding it: read on the wrapper, it was never found, so the start
    sequence and the resumption after a shortened stream were not set."""
    return getattr(sub, "_jsi", None) or getattr(getattr(sub, "_sub", None), "_jsi", None)


class _StreamPosition:
    """Where one reliable subscription stands in the partition's stream (``Bus.subscribe``).

    ``floor``: the highest stream sequence handled; a delivery at or below it is a redelivery after
    a consumer reset and is dropped. When the stream comes back shorter (a killed server lost its
    last writes) the floor falls to the stream's end and new messages reuse the lost sequence numbers;
    the deliveries already received then (waiting in the subscription, from the consumers in
    ``stale``) belong to the lost numbering: they are checked against ``stale_floor`` and leave the
    floor alone. Before, handling them raised the floor back, and the new messages under the reused
    numbers were dropped as redeliveries (lost)."""

    __slots__ = ("floor", "stale_floor", "stale", "names")

    def __init__(self) -> None:
        self.floor = 0
        self.stale_floor = 0
        self.stale: set[str] = set()
        self.names: deque[str] = deque(maxlen=64)
        """The subscription's latest consumer names (each reset makes one)."""

    def rewind(self, last: int) -> None:
        """The stream came back ending at ``last`` < ``floor``: what the current consumers delivered is stale."""
        self.stale.update(self.names)
        self.stale_floor = max(self.stale_floor, self.floor)
        self.floor = last

    def accept(self, seq: int, consumer: str) -> bool:
        """Whether the delivery of stream sequence ``seq`` (0: unknown) by ``consumer`` is new, raising the floor
        it is checked against (``stale_floor`` for a consumer from before a rewind); False: a redelivery."""
        if consumer in self.stale:  # received before the stream came back shorter
            if seq and seq <= self.stale_floor:
                return False
            self.stale_floor = max(self.stale_floor, seq)
        else:
            if seq and seq <= self.floor:
                return False
            self.floor = max(self.floor, seq)
        return True


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
        self.subscribed: set[str] = set()
        """Subject templates this bus subscribes to or serves: their per-subject Prometheus
        series (dropped, handler errors, received) start at 0 (``shared.metrics.bus_families``)."""
        self._tasks: list[asyncio.Task[Any]] = []
        self._closing = False
        self._lost_at: float | None = None
        """When the connection was last lost (monotonic seconds; None while connected): :meth:`_drain`'s grace counts
        from it."""
        self.droplog = RateLimitedLog(self.log, first=5, interval_s=10.0)
        """Bounds the lines written for dropped messages and handler errors."""
        self.known_nodes: frozenset[str] | None = None
        """Node ids of the cluster when this service knows them: messages naming
        another node are dropped (``shared.validate``). None = any well-formed id."""
        self.jetstream = False
        """True once the partition's stream exists: reliable subjects are consumed from it."""
        self._stream_checked = False
        self.stream_waiting = ""
        """The stream's name while :meth:`_await_stream` waits for it (another must make it, or the server refuses
        the create, or the server lost it), or a lookup of it gets no answer, or, on JetStream, from a disconnect until
        the reconnect's check found the stream again (:meth:`_stream_unconfirmed`), else empty: a service's ``/readyz``
        reason while it waits (``shared.service``). Set by :meth:`_wait_for_stream` and :meth:`_stream_unconfirmed`,
        cleared only by :meth:`_wait_over` (a later reconnect's check owns it once it began; after a disconnect only
        the check that began after it clears it)."""
        self._js_disconnects = 0
        """Disconnects while on JetStream (:meth:`_stream_unconfirmed`); :attr:`_check_disconnects` the count when the
        latest reconnect's check began: a check clears :attr:`stream_waiting` only while they are equal."""
        self._check_disconnects = 0
        self.jetstream_missing = ""
        """The stream's name while the server this bus reconnected to has no JetStream (:meth:`_await_jetstream`):
        reliable publishes are kept until it is back; a service's ``/readyz`` reason meanwhile (``shared.service``).
        Set by :meth:`_wait_for_jetstream`, cleared by :meth:`_reconnect_check` and :meth:`_wait_over`."""
        self.stream_refused = ""
        """Why the server refused the create of :meth:`ensure_stream` ``(wait=False)`` (:func:`stream_refusal`);
        empty when it did not answer one (no JetStream, or credentials that may not create it)."""
        self.stream_lacking = ""
        """Why the stream found is unusable, when it lacks reliable subjects (:class:`StreamLacksSubjects`'s words:
        the stream, what it lacks, the fix), else empty: logged at error, and a service's ``/readyz`` 503 reason
        (``shared.service``) for the bus's life; ``auth stream`` exits 1 with it."""
        self._lacking_logged = ""
        """The :attr:`stream_lacking` last logged (:meth:`_check_subjects`): a check that finds the same lack says
        nothing again."""
        self.stream_unanswered = ""
        """What got no answer in time with :meth:`ensure_stream` ``(wait=False)`` (``auth stream``): "the stream lookup
        ($JS.API.STREAM.INFO.<stream>) in 5 s" (or the create, without a permission violation), a loaded or hung
        server; empty when it answered. Before, that silence was reported as "no JetStream stream"."""
        self._stream_lock = asyncio.Lock()
        """One stream check at a time (:meth:`ensure_stream`): a second reliable subscription waits for the first's."""
        self._publish_check: asyncio.Task[bool] | None = None
        """The stream check a reliable publish began (:meth:`publish`), going on in the background past its wait."""
        self._reconnects_seen = 0
        """Reconnects whose stream check began (:meth:`_reconnect_check`): a wait gives way to a later one."""
        self._stream_created: object = None
        """The stream's creation time as the server reported it (``StreamInfo.created``) when this bus first
        saw it: a different one after a reconnect is a new stream (the server lost its store)."""
        self.reconnected_at: float | None = None
        """``time.monotonic()`` of the last reconnect (None: never disconnected)."""
        self._pings: set[Ping] = set()
        """PINGs of this bus and its users (:meth:`ping`) still waiting for their PONGs, including those given up on
        and left to them (never cancelled while nats-py holds them: ``shared.natsping``); those a reconnect lost are
        cancelled by the bus's next PING or its next answered one, what is left at :meth:`close`."""
        self._changed = asyncio.Event()
        """Set (and replaced by a fresh one) when the connection came back or was closed (:meth:`_connection_changed`):
        wakes a :meth:`flush` waiting for a reconnect or for a PONG a reconnect lost."""
        self._boot = os.urandom(4).hex()
        self.boot = m.new_boot(time.time_ns(), os.urandom(4))
        """This process's incarnation (``Heartbeat.boot``)."""
        self.superseded = asyncio.Event()
        """Set when a process that started later beats under this bus's service and instance (:meth:`start_service_plumbing`;
        never for a worker, ``shared.auth.BEAT_WATCHERS``):
        this one was replaced while it was frozen and must stop (``shared.service.serve_until_stopped``)."""
        self.superseded_by = ""
        self._msg_no = 0
        self._recent: deque[tuple[float, str, bytes, dict[str, str]]] = deque()
        """(monotonic time, subject, payload, headers) of recent reliable publishes: the resend window."""
        self._confirms: deque[tuple[float, float]] = deque()
        """``(sent, answered)`` monotonic seconds of the PINGs of :meth:`_confirm_loop` that got their PONG, on the
        connection of the time: the server had read every publish made before ``sent`` (the PING's time when nothing
        was queued, else :attr:`_clear`'s) by ``answered``. Only the latest answered more than ``RESEND_WINDOW_S`` ago and those after it
        are kept (:meth:`_trim_recent`)."""
        self._clear: tuple[float, object] = (-math.inf, None)
        """``(monotonic time, connection)`` of the latest reliable publish that found nats-py's outgoing queue empty:
        every publish made before that time had been written to that connection's transport, so a PING written to it
        afterwards follows them (nats-py writes a PING straight to the transport, ahead of what is still queued). The
        connection is nats-py's ``_pongs`` list, which it makes anew at each (re)connect (``natsping.connection_of``)."""
        self._confirming = False
        """True on a bus made by :meth:`connect`: its first reliable publish on JetStream starts :meth:`_confirm_loop`."""
        self._confirm_task: asyncio.Task[None] | None = None
        self._resend: list[tuple[float, str, bytes, dict[str, str]]] = []
        self._holding = False
        """True from a disconnect (on JetStream) until the stream is known to be there after the reconnect: reliable
        publishes are kept in ``_held`` meanwhile (:meth:`_hold`), since a server back without its store drops them."""
        self._held: deque[tuple[float, str, bytes, dict[str, str]]] = deque()
        self._held_bytes = 0
        self._held_unsent = False
        """True once a reliable publish was only kept (:attr:`_stream_lost`), not sent: a stream found again after the
        reconnect (the same one) lacks it, so what is kept is published again then, not dropped."""
        self._stream_lost = False
        """True while a reconnect's lookup has found the stream lost (the server answered "not found") and the bus waits
        for it (:meth:`_await_stream` ``again``): reliable publishes are then only kept, not sent, and go out with the
        rest in publish order once it is back. Before, they were sent too: nowhere, unless another bus had just made the
        stream, where they were stored ahead of the older kept ones published again after it, and a consumer got a
        token stream out of order (the router holds the later chunks for the older ones up to ``CHUNK_GAP_WAIT_S``, 7 s;
        past that it fails the request with a 502; before its hold, it took the older chunks for duplicates: a hole).
        True too while a reconnect's check waits for JetStream with publishes held. Set by :meth:`_wait_for_stream` and
        :meth:`_wait_for_jetstream`, cleared by :meth:`_wait_over`."""
        self._js_subs: list[tuple[Subscription, _StreamPosition]] = []
        self.identity = ""
        """Name of the NATS identity this bus connected as (``NatsAuth.name``); empty = no credentials."""
        self.url_user = ""
        """The user named in the connect URL (``nats://user:pass@host``) when no ``NatsAuth`` credentials were
        given, else empty: who the server's refusals are for, in an error line (:meth:`_who`)."""
        self.last_denied: tuple[str, str] | None = None
        """``("publish" | "subscription", subject)`` of the server's latest "Permissions Violation" (:func:`denied_subject`)."""
        self._stream_maker = False
        """True while :meth:`ensure_stream` ``(maker=True)`` runs: it reports a stream API permission violation itself."""
        self._publish_denials: Counter[str] = Counter()
        """Full subject (lowercased, as nats-py passes the server's text) -> the "Permissions Violation for Publish" the
        server reported on it: a stream lookup or create counts as refused only when its own subject was
        (:meth:`_stream_api_denials`); only those two subjects are kept (a denial of any other subject, a per-request
        one say, would add an entry for the life of the process). Before, any violation during it did (a count
        compared): an unrelated one made the launcher exit 2 naming the stream lookup, a service fall back to core
        NATS, a reconnect drop what it held."""
        self._requesting: Counter[str] = Counter()
        """Full subjects of requests in flight, lowercased (a permission violation on one is the request's error, not a
        log line): nats-py lowercases the server's -ERR text (``nats/protocol/parser.py``), so the violation names
        ``ei.p0.route.bind.r1`` for a request on ``ei.P0.route.bind.R1``. Before, the index was in the subject's own
        case, and a denial on a partition or router id with a capital looked like a plain timeout (retried)."""
        self._denied: dict[str, float] = {}
        """Full subject (lowercased, as :attr:`_requesting`) of an in-flight request -> when (monotonic s) the server's
        permission violation for it came; dropped when no request on it is in flight, or when one sent after it gets a
        reply (the permission is there now: a later timeout on the subject is a timeout, not :class:`PermissionDenied`)."""

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

        ``url``: one NATS server or a comma-separated list (``nats://h1:4222,nats://h2:4222``, the form
        of the NATS Go client), credentials in it percent-decoded (``shared.auth.nats_servers``).

        Raises:
            AuthError: unreadable TLS files; an empty server in a URL list.
            NoCredentials: the server requires credentials and ``auth`` gives none.
            BusError: the server refused the credentials ("Authorization Violation").
            OSError / nats.errors.NoServersError: if no server answers in time.
        """
        bus = cls(NatsClient(), subjects, service=service, instance=instance)
        bus.identity = auth.name if auth is not None and auth.enabled else ""
        bus._confirming = True
        refused = asyncio.Event()
        connected = False

        async def error_cb(e: Exception) -> None:
            bus.counters["nats.errors"] += 1
            text = str(e).lower()
            if "permissions violation" in text:
                bus.counters["nats.permission_violations"] += 1
                denied = bus.last_denied = denied_subject(str(e))
                if denied is not None and denied[0] == "publish" and denied[1].lower() in bus._stream_api_subjects():
                    bus._publish_denials[denied[1].lower()] += 1  # only the two subjects read (bounded)
                # compared lowercased: nats-py lowercases the server's text, the subject's own case is lost (_requesting)
                if denied is not None and denied[0] == "publish" and bus._requesting[denied[1].lower()]:
                    bus._denied[denied[1].lower()] = time.monotonic()  # the request reports it (PermissionDenied), once
                    return
                if denied is not None and bus._stream_maker and denied[1].lower().startswith("$js.api.stream."):
                    return  # ensure_stream(maker=True) reports it (PermissionDenied, naming the fix), once
            if not bus.nc.is_connected and ("authorization violation" in text or "authentication" in text):
                refused.set()  # wrong or missing credentials: retrying cannot help
                if not connected:
                    return  # connect() raises it: one message, not a log line too
            if not connected and not allow_reconnect:
                return  # a fail-fast tool's one connect (split get): connect() raises why, its one line; a log line per try came first
            bus.droplog.event("nats.errors", "nats error", error=repr(e)[:300])

        async def disconnected_cb() -> None:
            bus._lost_at = time.monotonic()
            if bus._closing and bus.nc.is_closed:  # the close's own (nats-py's close calls it): nothing to take
                return
            # a server lost during the close too: its window is published again if it comes back during the drain
            # (reconnected_cb). Before, the close skipped this: reliable publishes that died unstored in a server
            # killed during the close were lost though it came back (tests/integration/test_bus_close_resend_live.py)
            bus._disconnected()

        async def reconnected_cb() -> None:
            bus._lost_at = None
            bus.counters["nats.reconnects"] += 1
            try:
                await reconnected()
            finally:
                bus._connection_changed()  # after reconnected_at: a flush's PING on the old connection is lost by now

        async def reconnected() -> None:
            if bus._closing:
                # close cancelled the bus's tasks before its drain, and nothing would cancel one started now (its
                # stream lookup could outlive the close): no stream check, but the resend window is published again
                # here, before the drain sees the reconnect (reconnected_at), so its flush sends it (message ids drop
                # a copy the stream has); nats-py's close cancels this callback's reconnect task, within the close's
                # bound. Before (7591e94), nothing was resent: reliable publishes that died unstored in a server
                # killed just before the close were lost though it came back during the drain. What the bus kept since
                # a disconnect goes with it, in publish order (the close cancelled the check that would have sent it):
                # before, what it only kept while the stream was lost (_stream_lost, never sent) was dropped
                # (tests/integration/test_bus_close_held_live.py)
                held = bus._stop_holding()
                resend, bus._resend = bus._in_order([*bus._resend, *held]), []
                bus.log.warning("nats reconnected during the close; the resend window and kept publishes published "
                                "again, no stream check", resend=len(resend), held=len(held))  # fmt: skip
                await bus._publish_again(resend)
                bus.reconnected_at = time.monotonic()
                return
            bus.reconnected_at = time.monotonic()
            bus.log.warning("nats reconnected", resend=len(bus._resend))
            bus._tasks.append(asyncio.create_task(bus._after_reconnect(), name=f"bus-reconnect-{instance}"))

        async def closed_cb() -> None:
            bus._connection_changed()
            bus.log.debug("nats connection closed")

        options = client_options(url, auth)  # the servers of a list, its credentials percent-decoded
        bus.url_user = str(options.get("user") or "") if not bus.identity else ""
        connecting = asyncio.ensure_future(bus.nc.connect(
            name=f"{service}:{instance}",
            connect_timeout=connect_timeout,  # type: ignore[arg-type]  # nats-py annotates int seconds; a float works
            max_reconnect_attempts=max_reconnect_attempts,
            allow_reconnect=allow_reconnect,
            reconnect_time_wait=RECONNECT_WAIT_S,  # type: ignore[arg-type]  # as connect_timeout
            pending_size=PENDING_BYTES,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            closed_cb=closed_cb,
            **options,
        ))
        refusal = asyncio.ensure_future(refused.wait())

        async def abandon() -> None:  # stop nats-py's connect retries and close the client
            bus._closing = True
            # cancelled again until it ends: Python 3.11's asyncio.wait_for (nats-py's transport connect) answers a
            # cancel that comes after its inner connect finished with that connect's outcome, a refusal nats-py
            # retries (every RECONNECT_WAIT_S), so one cancel can be lost. It was one cancel and an unbounded wait:
            # a service stopped while NATS refused (the Slurm job's stop_all, which stops NATS too, on a loaded
            # node) logged "nats error" forever and never exited (tests/unit/shared/test_bus_connect_cancel.py)
            with contextlib.suppress(asyncio.CancelledError):  # this task cancelled again: it is stopping anyway
                await cancel_until_done([connecting], limit_s=ABANDON_S)
            if not connecting.done():
                bus.log.error("nats connect still running after its cancel; left behind", waited_s=ABANDON_S)
            with contextlib.suppress(Exception):
                await bus.nc.close()

        try:
            await asyncio.wait({connecting, refusal}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (a service stopped while NATS is unreachable)
            await abandon()
            raise
        finally:
            refusal.cancel()
        if not connecting.done():
            await abandon()
            raise _refusal(url, instance, auth)
        try:
            connecting.result()
        except Exception as e:
            if refused.is_set():
                raise _refusal(url, instance, auth) from e
            raise
        connected = True
        natsping.check_client(bus.nc)  # one warning at the start if this nats-py lacks what natsping reads
        return bus

    def _permission_error(self, full: str) -> PermissionDenied | None:
        """The error of a request on ``full`` whose publish the server refused, else None."""
        if full.lower() not in self._denied:
            return None
        return PermissionDenied(
            f"NATS refused {self._who()} permission to publish to {full} (Permissions Violation): "
            "its credentials do not allow this subject; use an identity that may publish it"
        )

    def _who(self) -> str:
        """Who this bus is to the server, for an error line: its identity, the URL's user, or no credentials."""
        if self.identity:
            return f"identity {self.identity!r}"
        return f"user {self.url_user!r}" if self.url_user else "a client without credentials"

    def _stream_api_subjects(self) -> tuple[str, str]:
        """The partition's stream ``INFO`` and ``CREATE`` API subjects, lowercased (as nats-py passes a violation's
        text): the only subjects whose denials :attr:`_publish_denials` counts."""
        name = stream_name(self.subjects)
        return (stream_api_subject("INFO", name).lower(), stream_api_subject("CREATE", name).lower())

    def _stream_api_denials(self, api: str) -> int:
        """How many permission violations the server reported on the stream ``api`` (``INFO``, ``CREATE``) subject of
        the partition's stream (``$JS.API.STREAM.<api>.<stream>``): compared before and after a lookup or create."""
        return self._publish_denials[stream_api_subject(api, stream_name(self.subjects)).lower()]

    def _stream_denied(self, name: str, api: str) -> PermissionDenied:
        """The error of a stream ``api`` (``CREATE``, ``INFO``) on stream ``name`` that the server refused this bus
        (Permissions Violation): the refused subject as the server named it (:attr:`last_denied`, which nats-py
        lowercases: named here in its own case), the fix."""
        denied = self.last_denied[1] if self.last_denied is not None and self.last_denied[0] == "publish" else ""
        api = next((a for a in (api, "INFO", "CREATE") if denied == stream_api_subject(a, name).lower()), api)
        subject = stream_api_subject(api, name)
        return PermissionDenied(
            f"NATS refused {self._who()} permission to publish to {subject} (Permissions Violation), so it cannot "
            f"make the JetStream stream {name}: grant it {subject} (the launcher identity of 'evolving-infra auth gen' "
            f"has it), or create the stream first with 'evolving-infra auth stream --creds <launcher credentials>'"
        )

    def _disconnected(self) -> None:
        """The connection to the server is lost (nats-py's disconnected callback; it reconnects on its own): the resend
        window is taken for the reconnect, and on JetStream reliable publishes are kept (:attr:`_holding`) and the
        stream is unconfirmed (:meth:`_stream_unconfirmed`) until the reconnect's check found it."""
        self.counters["nats.disconnects"] += 1
        # the last RESEND_WINDOW_S may have died unstored: published again on reconnect (the window is
        # cut here too, not only on publish: after a quiet spell _recent still holds older messages). Merged with what
        # no check took yet: a reconnect cut during nats-py's own flush, before reconnected_cb, started none, and a
        # check a disconnect outlived put its window back (_after_reconnect). Before, it was replaced: after an outage
        # longer than RESEND_WINDOW_S the first one's window was lost (tests/integration/test_bus_resend_reconnect_live.py)
        self._trim_recent(time.monotonic())
        self._put_back([*self._resend, *self._recent])
        # until the stream is known to be there after the reconnect, keep what is published (nats-py's reconnect
        # buffer flushes it into a server that may have come back without its store, where it goes nowhere)
        self._holding = self._holding or self.jetstream
        self._stream_unconfirmed(disconnect=True)
        self.log.warning("nats disconnected")

    async def _after_reconnect(self) -> None:
        """Find the stream again (make it when the server lost it), publish the resend window again,
        resume consumers whose stream came back shorter or new. A stream found that lacks some reliable subjects (a
        server restarted with another version's stream) is said as at the first lookup (:meth:`_check_subjects`:
        :attr:`stream_lacking`, ``/readyz`` 503, an error line); before, only the first lookup checked.

        A check that a later disconnect outlived (its lookup answered after the connection dropped again) leaves all
        that to the next reconnect's check: it keeps holding, puts its window back in :attr:`_resend` (the next check
        takes it), sends nothing and resumes no consumer. Before, it stopped holding and published into nats-py's
        reconnect buffer, and so did every reliable publish for the rest of that outage, unkept: the buffer is
        flushed into the next server before its check, and one back without its store lost them
        (:meth:`_wait_over` keeps :attr:`stream_waiting` by the same test).

        Cancelled (:meth:`close`) before it published the window again, it puts what it took back in :attr:`_resend`
        (with what a later disconnect took meanwhile), for the close to publish. Before, the window was taken off the
        bus before the lookup and a close during it dropped it: reliable publishes that died unstored in a server
        killed just before were lost though it came back (tests/integration/test_bus_close_cancels_reconnect_live.py)."""
        resend, self._resend = self._resend, []
        try:
            go_on = self._reconnect_check()
            # its end clears the waits' state, an earlier check's too, unless a later reconnect took over (_wait_over)
            info = await self._stream_after_reconnect(go_on) if self.jetstream else None
            # a disconnect since the latest check began (this one while go_on()): its answer may be the old server's
            outlived = self._js_disconnects != self._check_disconnects
            if outlived:  # disconnected: nothing sent (nats-py's reconnect buffer), the consumers left to the next check
                # which takes the window with the next disconnect's (:meth:`_disconnected` merges them). Before, it went
                # to _held, which that check, finding the same stream, dropped as sent: the window was never published
                # again (tests/integration/test_bus_resend_reconnect_live.py)
                self._put_back([*resend, *self._resend])
                return
            if info is not None and go_on():  # the stream found after the reconnect may be another one (c01bc72)
                self._check_subjects(info, log=True)
            if not go_on():  # a later reconnect took over: its check ends the holding
                for r in (resend if self._holding else ()):
                    self._hold(r)
            elif info is not None and self._stream_created is not None and info.created is not None and info.created != self._stream_created:
                # a new stream (the server came back without its store): what was published since the disconnect, before
                # the stream was there, went nowhere: published again, in order, with the window (ids drop any copy).
                # Before, only the last RESEND_WINDOW_S of it was: a longer wait for the stream lost the rest
                self._stream_created = info.created
                self.counters["stream_recreated"] += 1
                resend = self._in_order([*resend, *self._stop_holding(), *self._recent])
                first = max(0, int(info.state.first_seq) - 1)
                self.log.warning("stream is new after the reconnect (the server lost its store); consumers resume at its start",
                                 consumers=len(self._js_subs), stream_first=first + 1)  # fmt: skip
                for sub, pos in self._js_subs:
                    jsi = _ordered_state(sub)
                    if jsi is None:
                        continue
                    pos.rewind(first)
                    jsi._sseq = first
                    await jsi.reset_ordered_consumer(first + 1)
                info = None  # the consumers are placed
            else:  # the same stream (what was published meanwhile is in it, unless only kept), or none to be found
                unsent = self._held_unsent
                held = self._stop_holding()
                if info is not None and unsent:
                    # published while the server had no JetStream (or lacked the stream), only kept: the stream lacks
                    # them. Before, they were dropped here (ids drop a copy of any the stream has)
                    resend = self._in_order([*resend, *held])
        except asyncio.CancelledError:
            self._put_back([*resend, *self._resend])
            raise
        await self._publish_again(resend)
        if info is None:
            return
        last = int(info.state.last_seq)
        for sub, pos in self._js_subs:
            jsi = _ordered_state(sub)
            if jsi is None or pos.floor <= last:
                continue
            # a killed server lost the tail of its store: new messages reuse those sequence
            # numbers, so resume from the stream's end (message ids drop any duplicate)
            self.counters["stream_rewound"] += 1
            self.log.warning("stream came back shorter; consumer resumes at its end", stream_last=last, consumer_at=pos.floor)
            pos.rewind(last)
            jsi._sseq = last
            await jsi.reset_ordered_consumer(last + 1)

    def _put_back(self, entries: list[tuple[float, str, bytes, dict[str, str]]]) -> None:
        """Make ``entries`` (reliable publishes ``(monotonic s, subject, payload, headers)``) the resend window the next
        reconnect's check (or the close) publishes again: once each, in publish order, at most ``RESEND_MAX_MSGS`` (the
        oldest dropped, counted ``resend_dropped``: windows of many disconnects that no check took, a flapping link)."""
        resend = self._in_order(entries)
        excess = len(resend) - RESEND_MAX_MSGS
        if excess > 0:
            del resend[:excess]
            self.counters["resend_dropped"] += excess
            self.droplog.event("resend", "reliable publishes dropped from the resend window: too many kept over "
                               "reconnects", dropped=excess, kept=len(resend))  # fmt: skip
        self._resend = resend

    async def _publish_again(self, resend: list[tuple[float, str, bytes, dict[str, str]]]) -> None:
        """Publish ``resend`` (reliable publishes ``(monotonic s, subject, payload, headers)``, in order) again after a
        reconnect, each with its own message id (the stream drops a copy it has), counted ``resent``; a refusal by
        the client (connection closed again) is logged and ends it. Returns once they are in nats-py's buffer."""
        for _t, subject, data, hdr in resend:
            try:
                await self.nc.publish(subject, data, headers=hdr)
                self.counters["resent"] += 1
            except nats.errors.Error as e:
                self.log.warning("resend after reconnect failed", error=repr(e))
                break

    def _reconnect_check(self) -> Callable[[], bool]:
        """A reconnect's stream check begins (:meth:`_after_reconnect`) and takes over from any earlier one's: returns
        its ``go_on()``, true until a later reconnect's check begins. An earlier check's wait for JetStream gives way at
        once (:attr:`jetstream_missing` cleared: this check says again); its wait for the stream and what it only keeps
        (:attr:`stream_waiting`, :attr:`_stream_lost`) stand until this check is over (:meth:`_wait_over`), and
        :attr:`stream_waiting` names the stream until this check found it (:meth:`_stream_unconfirmed`)."""
        self._reconnects_seen += 1
        mine = self._reconnects_seen
        self.jetstream_missing = ""
        self._stream_unconfirmed(disconnect=False)
        return lambda: mine == self._reconnects_seen

    def _stream_unconfirmed(self, *, disconnect: bool) -> None:
        """On JetStream, the stream is not known to be there from a disconnect (``disconnect``) until the reconnect's
        check found it: :attr:`stream_waiting` names it (``/readyz`` 503, reliable publishes are kept meanwhile,
        :attr:`_holding`) from the disconnect on (nats-py's reconnect flushes and PINGs the new server, connected,
        before the check begins), through the check's first lookup, until :meth:`_wait_over` of the check that
        began after the latest disconnect (a check that began before it, still looking, may get its answer from the
        old server). Before, the check cleared :attr:`jetstream_missing` at its start but set ``stream_waiting`` only
        once a lookup had gone ``STREAM_LOOKUP_TIMEOUT_S`` unanswered: ``/readyz`` 200 for up to 5 s after a reconnect
        to a server that had not answered whether it has the stream (or JetStream)."""
        if not self.jetstream:  # on core NATS (or the start's check, which holds readiness back itself): no check
            return
        if disconnect:
            self._js_disconnects += 1
        else:
            self._check_disconnects = self._js_disconnects
        self.stream_waiting = stream_name(self.subjects)

    def _wait_for_stream(self, name: str, *, lost: bool | None = None) -> None:
        """A stream check waits for stream ``name`` (a lookup without an answer, :meth:`_lookup_unanswered`, or a
        stream the server lacks, :meth:`_await_stream`): :attr:`stream_waiting` names it (``/readyz``); ``lost`` (None:
        as it is): reliable publishes are only kept meanwhile (:attr:`_stream_lost`)."""
        self.stream_waiting = name
        if lost is not None:
            self._stream_lost = lost

    def _wait_for_jetstream(self, name: str) -> None:
        """A reconnect's check waits for JetStream (:meth:`_await_jetstream`): :attr:`jetstream_missing` names the
        stream (``/readyz``); reliable publishes are only kept meanwhile when the bus holds them (:attr:`_holding`),
        and what it kept since the disconnect counts as unsent (nats-py's reconnect buffer sent it to this server,
        where nobody got it)."""
        self.jetstream_missing = name
        self._stream_lost = self._holding
        self._held_unsent = self._holding

    def _wait_over(self, go_on: Callable[[], bool]) -> None:
        """A stream check's wait (or the check) is over: :attr:`stream_waiting`, :attr:`jetstream_missing` and
        :attr:`_stream_lost` are cleared, unless ``go_on()`` is false: a later reconnect's check took over
        (:meth:`_reconnect_check`) and owns them until its own is over. Before, a wait of reconnect 1 that gave way
        cleared ``stream_waiting`` all the same, the name reconnect 2's wait had set: ``/readyz`` 200 while it waited.
        ``stream_waiting`` stays too after a disconnect since the check began (:meth:`_stream_unconfirmed`)."""
        if go_on():
            self.jetstream_missing = ""
            self._stream_lost = False
            if self._js_disconnects == self._check_disconnects:
                self.stream_waiting = ""

    def _hold(self, entry: tuple[float, str, bytes, dict[str, str]]) -> None:
        """Keep a reliable publish ``(monotonic s, subject, payload, headers)`` until the stream is known to be there
        after a reconnect (:attr:`_holding`), bounded by ``RESEND_MAX_MSGS`` and ``HELD_MAX_BYTES``: the oldest
        go first, counted ``stream_held_dropped`` (a line now and then)."""
        self._held.append(entry)
        self._held_bytes += len(entry[2])
        while len(self._held) > RESEND_MAX_MSGS or self._held_bytes > HELD_MAX_BYTES:
            old = self._held.popleft()
            self._held_bytes -= len(old[2])
            self.counters["stream_held_dropped"] += 1
            self.droplog.event("stream_held", "reliable publish dropped: too many kept while the stream may be lost",
                               subject=old[1], kept=len(self._held), kept_bytes=self._held_bytes)  # fmt: skip

    def _held_full(self, size: int) -> bool:
        """Whether keeping one more reliable publish of ``size`` payload bytes would pass ``RESEND_MAX_MSGS`` or
        ``HELD_MAX_BYTES`` (:meth:`_hold` would drop the oldest kept)."""
        return len(self._held) >= RESEND_MAX_MSGS or self._held_bytes + size > HELD_MAX_BYTES

    def _stop_holding(self) -> list[tuple[float, str, bytes, dict[str, str]]]:
        """End :attr:`_holding`; return what was kept (oldest first)."""
        held = list(self._held)
        self._held.clear()
        self._held_bytes = 0
        self._holding = False
        self._held_unsent = False
        return held

    @staticmethod
    def _in_order(entries: list[tuple[float, str, bytes, dict[str, str]]]) -> list[tuple[float, str, bytes, dict[str, str]]]:
        """``entries`` (reliable publishes) once each (by ``Nats-Msg-Id``), in the order they were published."""
        seen: set[str | None] = set()
        once = []
        for e in entries:
            mid = e[3].get(MSG_ID)
            if mid not in seen:
                seen.add(mid)
                once.append(e)
        return sorted(once, key=lambda e: e[0])  # stable: one bus's publishes have rising monotonic times

    async def _stream_after_reconnect(self, go_on: Callable[[], bool]) -> Any:
        """The stream's info after a reconnect; a stream the server lost is made again or, when this bus may not
        (under credentials only the launcher may), waited for until another bus makes it (:meth:`_await_stream`).
        A lookup without an answer in ``STREAM_LOOKUP_TIMEOUT_S`` (a loaded or hung server), or on a connection down
        a moment, is made again each 0.5 s (counter ``stream_lookup_retries``, a warning at once then every
        ``STREAM_BACK_WAIT_S``, :attr:`stream_waiting` names the stream meanwhile), as at start (:meth:`_look_up_stream`):
        before, that one timeout was logged and given up, so the consumers were not checked, the stream not made again
        and the publishes kept since the disconnect (:meth:`_hold`) dropped.
        A server that says it has no JetStream (:func:`no_jetstream`: restarted without it) is waited for until it has
        (:meth:`_await_jetstream`, the reliable publishes kept meanwhile); before, the lookup was given up and the bus
        went on as if on JetStream: what it published then was lost.
        None when the server refuses this identity the lookup (a permission violation on its subject), the connection
        is closed (each logged), the bus closes, or ``go_on()`` turns false (a later reconnect took over)."""
        name = stream_name(self.subjects)
        warn_at = time.monotonic()
        try:
            while True:
                if self._closing or not go_on():
                    return None
                violations = self._stream_api_denials("INFO")
                try:
                    return await self.nc.jetstream(timeout=STREAM_LOOKUP_TIMEOUT_S).stream_info(name)
                except nats.js.errors.NotFoundError:
                    break
                except (nats.errors.Error, asyncio.TimeoutError) as e:
                    if self._closing or not go_on():
                        return None
                    if self.nc.is_closed or self._stream_api_denials("INFO") != violations:
                        self.log.warning("stream info after reconnect failed", error=str(e) or repr(e))
                        return None
                    if no_jetstream(e):  # the server came back without JetStream: kept until it is back
                        return await self._await_jetstream(go_on, e)
                    # no answer in time, or the connection down a moment: the stream may well be there (or lost)
                    warn_at = self._lookup_unanswered(name, e, warn_at, "the stream lookup after the reconnect got no "
                                                      "answer; looking again (reliable publishes are kept meanwhile)")
                await asyncio.sleep(0.5)
        finally:
            self._wait_over(go_on)
        return await self._await_stream(go_on, again=True)

    async def _await_jetstream(self, go_on: Callable[[], bool], first: BaseException) -> Any:
        """After a reconnect to a server without JetStream (its stream lookup answered "no responders" or "JetStream not
        enabled", ``first``), while this bus is on JetStream: its reliable subscriptions are JetStream consumers, which
        get nothing then, and a reliable publish sent would go to core NATS, where nobody listens. So reliable publishes
        are only kept (:attr:`_stream_lost`, bounded as :meth:`_hold`), :attr:`jetstream_missing` names the stream (a
        service's ``/readyz`` 503), a warning comes at once and every ``STREAM_BACK_WAIT_S`` (counter
        ``jetstream_missing_warnings``), and the stream is looked up each 0.5 s until JetStream answers: its info (the
        same stream, or one another bus made), or, when it answers "not found" (a store lost), :meth:`_await_stream`
        (made again). A restart with JetStream is a later reconnect, whose own check takes over (``go_on()`` false).
        Before, the lookup's failure was logged and given up with ``jetstream`` still True: silent loss.

        Returns the stream's info, or None once ``go_on()`` is false or the bus closes."""
        name = stream_name(self.subjects)
        self._wait_for_jetstream(name)
        warn_at = time.monotonic()
        error: BaseException = first
        try:
            while not self._closing and go_on():
                if time.monotonic() >= warn_at:
                    warn_at = time.monotonic() + STREAM_BACK_WAIT_S
                    self.counters["jetstream_missing_warnings"] += 1
                    self.log.warning(
                        "the NATS server came back without JetStream: reliable messages cannot be delivered; those published "
                        f"meanwhile are kept (the latest {RESEND_MAX_MSGS}) and published once JetStream is back",
                        stream=name, error=str(error) or repr(error),
                    )  # fmt: skip
                await asyncio.sleep(0.5)
                try:
                    return await self.nc.jetstream(timeout=STREAM_LOOKUP_TIMEOUT_S).stream_info(name)
                except nats.js.errors.NotFoundError:  # JetStream is back without the stream
                    break
                except (nats.errors.Error, asyncio.TimeoutError) as e:  # still none, or no answer: look again
                    error = e
            else:
                return None
        finally:
            self._wait_over(go_on)
        return await self._await_stream(go_on, again=True)

    async def _await_stream(self, go_on: Callable[[], bool], *, again: bool, maker: bool = False) -> Any:
        """Make the partition's stream, which the server (it has JetStream: it answered "not found") lacks, or,
        when this bus may not (under credentials only the launcher may: the server refuses the create unanswered),
        wait until another bus makes it: each 0.5 s the stream is looked up and the create tried again (any failure
        is a retry), with a warning at once (a start, ``again=False``) and every ``STREAM_BACK_WAIT_S`` wall seconds
        (counter ``stream_missing_warnings``) naming the fix: the launcher makes it (``up``, the Slurm job,
        ``evolving-infra auth stream``; under docker compose ``docker compose run stream``), or, when the server
        answered the create with a refusal (subjects that overlap another stream's), its reason.

        ``again``: the server lost the stream after a reconnect (counter ``stream_made_again`` when made here).
        ``maker``: this bus is the one that makes the stream (the launcher of ``up``): nobody else will, so a create
        the server refuses for permissions raises instead of waiting.
        Returns the stream's info, or None once ``go_on()`` is false or the bus closes.

        Raises:
            PermissionDenied: ``maker``, and the server refused this identity the create ("Permissions Violation",
                seen by the error callback: the create itself only times out), naming the identity, the subject and the fix."""
        name = stream_name(self.subjects)
        warn_at = time.monotonic() if not again else time.monotonic() + STREAM_BACK_WAIT_S
        may_make = True
        self._wait_for_stream(name, lost=again and self._holding)  # the wait as a service's /readyz reason
        try:
            while not self._closing and go_on():
                violations = self._stream_api_denials("CREATE")
                try:  # a short wait: under credentials the server refuses it unanswered (only the launcher may make it)
                    if not may_make:
                        raise PermissionDenied(f"this identity may not create stream {name} (Permissions Violation)")
                    info = await self.nc.jetstream(timeout=1.0).add_stream(self._stream_config())
                    if again:
                        self.counters["stream_made_again"] += 1
                        self.log.warning("the server lost the stream (its store); made it again", stream=name)
                    return info
                except Exception as e:  # not allowed (credentials), made meanwhile, refused: look again, warn now and then
                    # a create the server refused for permissions is not tried again (each refusal is a server error line
                    # and a permission-violation count): the stream is only looked up until another bus made it
                    may_make = may_make and self._stream_api_denials("CREATE") == violations
                    if maker and not may_make:
                        raise self._stream_denied(name, "CREATE") from e
                    if time.monotonic() >= warn_at:
                        warn_at = time.monotonic() + STREAM_BACK_WAIT_S
                        self.counters["stream_missing_warnings"] += 1
                        what = "the server lost the stream and nobody made it again yet" if again else "the stream is not there yet"
                        # answered: this bus may create it, the server refuses the config
                        fix = stream_refusal(e) or (
                            (f"reliable messages published meanwhile are kept (the latest {RESEND_MAX_MSGS}) and published "
                             "once it is there; the launcher makes it" if again else "reliable messages go nowhere until the launcher makes it")
                            + " (evolving-infra auth stream; under docker compose: docker compose run stream)"
                        )  # fmt: skip
                        # str, not repr: nats-py's API errors have an empty repr (BadRequestError()), their str names the reason
                        self.log.warning(f"{what}: {fix}; waiting for it", stream=name, error=str(e) or repr(e))
                await asyncio.sleep(0.5)
                try:
                    return await self.nc.jetstream(timeout=1.0).stream_info(name)
                except Exception:  # not there yet, or the connection is down a moment: look again
                    pass
            return None
        finally:
            self._wait_over(go_on)

    def _stream_config(self) -> Any:
        """The partition's stream over every reliable subject (file storage, bounded by age and bytes)."""
        from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

        from shared.subjects import ALL

        return StreamConfig(
            name=stream_name(self.subjects),
            subjects=[self.subjects.wildcard(s) for s in ALL if s.reliable],
            storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_age=STREAM_MAX_AGE_S,
            max_bytes=STREAM_MAX_BYTES,
            num_replicas=1,
        )

    async def ensure_stream(self, *, wait: bool = True, maker: bool = False) -> bool:
        """Find or create the partition's stream over every reliable subject; idempotent (concurrent callers
        share one check). Called by the first reliable subscription or publish (and by the launcher, before
        any service starts).

        A server without JetStream (its stream lookup answered "no responders" or "JetStream not enabled",
        :func:`no_jetstream`) makes reliable subjects fall back to core NATS (at most once, one warning); a lookup
        that gets no answer in time (a loaded server) is made again (:meth:`_look_up_stream`), with ``wait``.
        A server with JetStream that lacks the stream while this bus may not create it (under credentials only
        the launcher may: a service started before compose's ``stream`` job or the Slurm job made it) is
        waited for (``wait``, :meth:`_await_stream`: a warning at once, then every ``STREAM_BACK_WAIT_S``), so
        the caller (a service's start, the readiness it holds back) goes on on JetStream once the stream is
        there. Before, such a bus stayed on core NATS for its whole life. ``wait=False`` (``auth stream``):
        one create (5 s), and False when it is refused. ``maker=True`` (``up``'s launcher, which makes the stream
        before any service starts): a lookup or create the server refuses this identity raises instead of waiting
        for another to make it (nobody will): before, ``up --nats-url`` with credentials that may not create the
        stream waited forever, a warning each minute.

        A stream of that name found (not made) that lacks some reliable subjects (:func:`stream_lacks`; another
        version's, one made by hand) sets :attr:`stream_lacking` (a service's ``/readyz`` 503 for good, logged at
        error unless ``wait=False``, whose caller reports it; the bus goes on with it, so the service stays up and says why) or, for ``maker``, raises. Before,
        any stream of that name was taken: ``up --nats-url`` reported READY and every request hung 600 s.

        Raises:
            PermissionDenied: ``maker``, and the server refused this identity the stream's lookup or create.
            StreamLacksSubjects: ``maker``, and the stream there lacks some reliable subjects.

        Returns:
            Whether the stream is there (``self.jetstream``); False only without JetStream, with
            ``wait=False``, or when the bus closed while it waited.
        """
        async with self._stream_lock:
            if self._stream_checked:
                return self.jetstream
            self._stream_maker = maker
            try:
                return await self._ensure_stream(wait=wait, maker=maker)
            finally:
                self._stream_maker = False

    def _lookup_unanswered(self, name: str, e: BaseException, warn_at: float, warning: str) -> float:
        """A lookup of stream ``name`` that got no answer in time (``e``) and is made again: counted
        ``stream_lookup_retries``, :attr:`stream_waiting` names the stream (``/readyz``), ``warning`` logged when
        ``warn_at`` (monotonic s) has come, and then not for ``STREAM_BACK_WAIT_S``. Returns the next ``warn_at``."""
        self.counters["stream_lookup_retries"] += 1
        self._wait_for_stream(name)
        if time.monotonic() < warn_at:
            return warn_at
        self.log.warning(warning, stream=name, error=str(e) or repr(e))
        return time.monotonic() + STREAM_BACK_WAIT_S

    async def _ensure_stream(self, *, wait: bool, maker: bool) -> bool:
        """:meth:`ensure_stream` under its lock, once the stream was not checked yet."""
        config = self._stream_config()
        info = await self._look_up_stream(config.name, wait=wait, maker=maker)
        if info is False:
            return False
        jsm = self.nc.jetstream(timeout=STREAM_LOOKUP_TIMEOUT_S)
        if info is None and not wait:
            violations = self._stream_api_denials("CREATE")
            try:
                info = await jsm.add_stream(config)
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                self._stream_checked = True
                self.stream_refused = stream_refusal(e)
                if isinstance(e, asyncio.TimeoutError) and self._stream_api_denials("CREATE") == violations:
                    self.stream_unanswered = f"the stream create ({stream_api_subject('CREATE', config.name)}) in {STREAM_LOOKUP_TIMEOUT_S:g} s"
                self.log.warning(
                    f"no JetStream stream: {self.stream_refused or 'this bus may not create it'}",
                    stream=config.name, error=str(e) or repr(e),
                )  # fmt: skip
                return False
        elif info is None:
            info = await self._await_stream(lambda: True, again=False, maker=maker)
            if info is None:  # the bus closed while it waited
                return False
        # a service's is logged; wait=False is auth stream's, which reports it itself (one line)
        if self._check_subjects(info, log=wait and not maker) and maker:
            raise StreamLacksSubjects(self.stream_lacking)
        if self._stream_created is None:
            self._stream_created = info.created
        self._stream_checked = True
        self.jetstream = True
        return True

    def _check_subjects(self, info: Any, *, log: bool) -> bool:
        """Whether the stream found (``info``, its ``StreamInfo``) lacks some reliable subjects (:func:`stream_lacks`;
        another version's, one made by hand): then :attr:`stream_lacking` says so (the stream, what it lacks, the fix)
        and, with ``log``, an error line ``STREAM LACKS SUBJECTS: ...`` when that lack was not logged yet or changed
        (:attr:`_lacking_logged`; the same lack found again, as at each reconnect to the same server, says nothing
        again: one line; before, each reconnect that found it logged it again). Run at the first lookup
        (:meth:`_ensure_stream`) and at each reconnect's check that found the stream (:meth:`_after_reconnect`: a
        server restarted with an old stream). A stream found whole leaves :attr:`stream_lacking` as it was (once
        set, a service says so until it is restarted: its consumers were made on the lacking stream)."""
        config = self._stream_config()
        have = list(info.config.subjects or ())
        lacks = stream_lacks(have, list(config.subjects or ()))
        if not lacks:
            return False
        self.stream_lacking = (
            f"the JetStream stream {config.name} lacks subjects {lacks} (it has {have}; another version's, or made by "
            f"hand): messages on them are kept by no stream and reach no consumer; " + STREAM_FIX.format(age=STREAM_MAX_AGE_S)
        )  # fmt: skip
        if log and self.stream_lacking != self._lacking_logged:
            self._lacking_logged = self.stream_lacking
            self.log.error("STREAM LACKS SUBJECTS: " + self.stream_lacking, stream=config.name)
        return True

    async def _look_up_stream(self, name: str, *, wait: bool, maker: bool) -> Any:
        """The stream's info, None when the server (it has JetStream) answers that it is not there, or False when
        this bus goes on without it: the server has no JetStream (:func:`no_jetstream`; reliable subjects fall back
        to core NATS, one warning), it refuses this identity the lookup (a permission violation), ``wait`` is False
        and the lookup got no answer, or the bus closed. With ``wait``, a lookup that gets no answer in
        ``STREAM_LOOKUP_TIMEOUT_S`` (a loaded server) is made again each 0.5 s (counter ``stream_lookup_retries``;
        a warning at once, then every ``STREAM_BACK_WAIT_S``, while :attr:`stream_waiting` names the stream):
        before, that one timeout put the bus on core NATS (at most once) for its whole life.

        Raises:
            PermissionDenied: ``maker``, and the server refused this identity the lookup (:meth:`_stream_denied`)."""
        warn_at = time.monotonic()
        try:
            while True:
                violations = self._stream_api_denials("INFO")
                try:  # under auth only the launcher may create it (shared.auth); the others find it
                    return await self.nc.jetstream(timeout=STREAM_LOOKUP_TIMEOUT_S).stream_info(name)
                except nats.js.errors.NotFoundError:  # the server has JetStream: the stream is not there yet
                    return None
                except (nats.errors.Error, asyncio.TimeoutError) as e:
                    denied = self._stream_api_denials("INFO") != violations
                    if maker and denied:
                        raise self._stream_denied(name, "INFO") from e
                    if self._closing:
                        return False
                    if not wait and not denied and isinstance(e, asyncio.TimeoutError):  # auth stream: its one lookup
                        self._stream_checked = True
                        self.stream_unanswered = f"the stream lookup ({stream_api_subject('INFO', name)}) in {STREAM_LOOKUP_TIMEOUT_S:g} s"
                        self.log.warning("the server did not answer " + self.stream_unanswered, stream=name)
                        return False
                    if denied or not wait or no_jetstream(e) or self.nc.is_closed:
                        self._stream_checked = True
                        self.log.warning(
                            "no JetStream stream: reliable subjects fall back to core NATS (at most once)", error=str(e) or repr(e)
                        )
                        return False
                    # no answer in time (a loaded server), or the connection down a moment: JetStream may be there
                    warn_at = self._lookup_unanswered(name, e, warn_at, "the stream lookup got no answer; looking again "
                                                      "(reliable subjects wait for JetStream)")
                await asyncio.sleep(0.5)
        finally:
            self._wait_over(lambda: True)  # at start: no reconnect's check runs before the stream is known (jetstream)

    @property
    def max_payload(self) -> int:
        """The most bytes one message may carry on this connection (headers included, as the server counts them):
        the server's ``max_payload`` from its INFO (nats-py's 1 MiB default before the first connect). A publish past
        it is refused (:class:`BusUnavailable`, nats-py's ``MaxPayloadError``); a hand-off's K/V goes in pieces under it
        (``services/worker/handoffkv.py``)."""
        return int(getattr(self.nc, "max_payload", 1024 * 1024))

    # -- publish / subscribe --------------------------------------------- #

    def _stamp(self, msg: msgspec.Struct) -> msgspec.Struct:
        if isinstance(msg, m.Msg) and not msg.src:
            return msgspec.structs.replace(msg, src=self.instance)
        return msg

    async def publish(self, subject: Subject, msg: msgspec.Struct, *, headers: dict[str, str] | None = None, **params: str) -> None:
        """Publish ``msg`` on ``subject`` formatted with ``params`` (``headers``: NATS headers, e.g. ``traceparent``).

        While disconnected the message waits in the client's buffer (flushed on reconnect). The first reliable
        publish of a bus that has not looked for the stream yet waits up to ``PUBLISH_STREAM_WAIT_S`` for it
        (:meth:`ensure_stream`); a reliable message published while the stream is not known goes over core NATS
        without a message id (a stream there stores it all the same). After a reconnect to a server that lost the
        stream, a reliable message is only kept until the stream is back (:attr:`_stream_lost`), then sent in order.

        Raises:
            BusUnavailable (a :class:`BusError`): the client refused the message (reconnect
                buffer full, ``PENDING_BYTES``; connection closed), so no NATS exception escapes bare; or, after a
                reconnect to a server that lost the stream, a reliable message when ``RESEND_MAX_MSGS`` /
                ``HELD_MAX_BYTES`` are kept already (nothing kept is dropped for it). A reliable
                message refused so is not published again after a reconnect (:meth:`_unkeep`). A
                reliable message on JetStream whose write met a transport the server's death just closed is
                not refused: it is in the resend window the reconnect publishes again (``publish_deferred``).
        """
        full = self.subjects.format(subject, **params)
        data = m.encode(self._stamp(msg))
        kept: tuple[float, str, bytes, dict[str, str]] | None = None
        if subject.reliable and not self._stream_checked and self._publish_check is None and not self._closing:
            # the first reliable publish before any reliable subscription: wait a moment for the stream (found or made
            # at once as a rule); one this bus waits for (another must make it) is searched on in the background
            check = self._publish_check = asyncio.create_task(self.ensure_stream(), name=f"bus-stream-{self.instance}")
            check.add_done_callback(lambda t: t.cancelled() or t.exception())  # its errors are logged by ensure_stream
            self._tasks.append(check)
            await asyncio.wait({check}, timeout=PUBLISH_STREAM_WAIT_S)
        try:
            if subject.reliable and self.jetstream:
                self._msg_no += 1
                hdr = {MSG_ID: f"{self.instance}-{self._boot}-{self._msg_no}"}
                now = time.monotonic()
                kept = (now, full, data, hdr)
                if getattr(self.nc, "pending_data_size", None) == 0:  # all before it is in the transport: a PING follows it
                    self._clear = (now, natsping.connection_of(self.nc))
                self._recent.append(kept)
                self._trim_recent(now)
                if self._confirming and self._confirm_task is None and not self._closing:
                    self._confirm_task = asyncio.create_task(self._confirm_loop(), name=f"bus-confirm-{self.instance}")
                    self._tasks.append(self._confirm_task)
                if self._holding:
                    if self._stream_lost and self._held_full(len(data)):
                        # only kept, never sent, and no room: refused, as nats-py refuses a publish past its reconnect
                        # buffer. Before, the oldest kept was dropped and the caller told it succeeded: a token stream
                        # with a hole (reviewer rr-bus2)
                        self._unkeep(kept)
                        self.counters["publish_failed." + subject.template] += 1
                        raise BusUnavailable(
                            f"cannot publish on {subject.template}: the server lost the JetStream stream and this bus "
                            f"already keeps {len(self._held)} reliable publishes ({self._held_bytes} bytes) for it "
                            f"(RESEND_MAX_MSGS {RESEND_MAX_MSGS}, HELD_MAX_BYTES {HELD_MAX_BYTES})"
                        )  # fmt: skip
                    self._hold(kept)
                    if self._stream_lost:  # sent with the kept ones, in order, once the stream is back (_stream_lost)
                        self._held_unsent = True
                        self.counters["published." + subject.template] += 1
                        return
                await self.nc.publish(full, data, headers={**headers, **hdr} if headers else hdr)
            else:
                await self.nc.publish(full, data, headers=headers)
        except BusError:
            raise
        except _CLOSED_TRANSPORT as e:
            if subject.reliable and self.jetstream:
                # the server's connection died under nats-py's write, before nats-py saw it: the message is in the
                # resend window (_recent), which the disconnect that follows keeps and the reconnect publishes again
                # (its id drops a copy). Raised, it failed a request the reconnect would have carried: the router
                # answered 503 'cannot dispatch ... route.placed: RuntimeError' during a nats-server kill
                self.counters["publish_deferred." + subject.template] += 1
                return
            self.counters["publish_failed." + subject.template] += 1
            raise BusUnavailable(f"cannot publish on {subject.template}: {type(e).__name__}: {e}") from e
        except nats.errors.Error as e:
            if kept is not None:
                self._unkeep(kept)
            self.counters["publish_failed." + subject.template] += 1
            raise BusUnavailable(f"cannot publish on {subject.template}: {type(e).__name__}: {e}") from e
        self.counters["published." + subject.template] += 1

    def _unkeep(self, entry: tuple[float, str, bytes, dict[str, str]]) -> None:
        """Take a reliable publish the client refused (:class:`BusUnavailable`: reconnect buffer full, connection
        closed) out of the resend window and :attr:`_held`: its caller was told it failed (and may send it again, or
        answer its client 503), so it is not published again after a reconnect. Before, it was: on a stream the
        server lost, it ran anyway, and at full load during a long outage the refused publishes pushed the accepted
        ones (in nats-py's reconnect buffer, which flushed into a server without the stream) out of ``_held``."""
        for kept in (self._recent, self._held):
            if kept and kept[-1] is entry:  # as a rule the latest (one event loop; nats-py refuses before it awaits)
                kept.pop()
            else:
                try:
                    kept.remove(entry)
                except ValueError:  # trimmed meanwhile, or never held
                    continue
            if kept is self._held:
                self._held_bytes -= len(entry[2])

    async def publish_raw(self, full_subject: str, payload: bytes) -> None:
        """Publish bytes as they are (fuzz tests and bridges only)."""
        await self.nc.publish(full_subject, payload)

    def _decode(self, subject: Subject, raw: NatsMsg) -> Any:
        msg, _why = self._decode_why(subject, raw)
        return msg

    def _decode_why(self, subject: Subject, raw: NatsMsg) -> tuple[Any, str]:
        """Decode and validate ``raw``: ``(msg, "")``, or ``(None, reason)`` when it is dropped (counted)."""
        try:
            msg = decoder_for(subject.msg_type).decode(raw.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.counters["dropped." + subject.template] += 1
            self.droplog.event(subject.template, "malformed message dropped", subject=raw.subject, error=str(e)[:200], size=len(raw.data))
            return None, f"malformed: {str(e)[:200]}"
        why = validate_msg(msg, subject_params(subject.template, self.subjects.prefix, raw.subject), self.known_nodes)
        if why is not None:
            self.counters["dropped." + subject.template] += 1
            self.counters["invalid." + subject.template] += 1
            self.droplog.event(subject.template, "invalid message dropped", subject=raw.subject, error=why[:200], size=len(raw.data))
            return None, f"invalid: {why[:200]}"
        return msg, ""

    async def subscribe(
        self, subject: Subject, handler: Handler, *, queue: str = "", reliable: bool | None = None, **params: str
    ) -> Subscription:
        """Subscribe to ``subject`` (missing params become ``*``) with a typed handler.

        A reliable subject (``subject.reliable``, or ``reliable=True``) is consumed through an
        ordered JetStream consumer starting after the stream's current last message, so a
        NATS restart costs latency, not messages; ``reliable=False`` (an observer that may
        miss messages) or a queue group uses a core subscription.
        """
        template = subject.template
        self.subscribed.add(template)
        use_js = (subject.reliable if reliable is None else reliable) and not queue and await self.ensure_stream()
        pattern = self.subjects.wildcard(subject, **params)
        matches = subject_matcher(pattern)
        received = "received." + template
        pos = _StreamPosition()
        seen: OrderedDict[str, None] = OrderedDict()
        """Message ids handled lately: a copy published again after a reconnect is dropped."""

        async def cb(raw: NatsMsg) -> None:
            if not matches(raw.subject):  # see _wrong_subject; a consumer's filter can be changed too
                self._wrong_subject(template, raw)
                return
            if use_js:
                seq, consumer = js_position(raw)  # (0, "") for no JetStream delivery (cannot happen on a push consumer)
                if not pos.accept(seq, consumer):
                    self.counters["redelivered." + template] += 1
                    return
                mid = raw.headers.get(MSG_ID) if raw.headers else None
                if mid is not None:
                    if mid in seen:
                        self.counters["duplicates." + template] += 1
                        return
                    seen[mid] = None
                    if len(seen) > SEEN_IDS:
                        seen.popitem(last=False)
            msg = self._decode(subject, raw)
            if msg is None:
                return
            self.counters[received] += 1
            span = token = None
            if tracing.ENABLED and raw.headers and "traceparent" in raw.headers:
                span = tracing.start(f"{self.service} {template}", tracing.extract(raw.headers), kind=tracing.SpanKind.CONSUMER,
                                     attributes=_span_attrs(raw.subject, template, msg, "process"))
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

        if use_js:
            sub = await self._js_subscribe(pattern, cb, pos)
        else:
            sub = await self.nc.subscribe(
                pattern,
                queue=queue,
                cb=cb,
                pending_msgs_limit=1_000_000,
                pending_bytes_limit=1024 * 1024 * 1024,
            )
        self._subs.append(sub)
        return sub

    async def _js_subscribe(self, filter_subject: str, cb: Callable[[NatsMsg], Awaitable[None]], pos: _StreamPosition) -> Subscription:
        from nats.js.api import ConsumerConfig, DeliverPolicy

        js = self.nc.jetstream(timeout=5.0)
        name = stream_name(self.subjects)
        info = await js.stream_info(name)
        last = int(info.state.last_seq)
        pos.floor = last
        pos.names.append(first_name := self._consumer_name())
        # A named consumer with one filter is created on ``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``
        # (nats-py does so when the config has a name and a filter_subject, server >= 2.9), so the
        # server's permissions confine each identity to consumers on its own subjects (shared.auth).
        sub = await js.subscribe(
            filter_subject,
            stream=name,
            cb=cb,
            ordered_consumer=True,
            idle_heartbeat=CONSUMER_HEARTBEAT_S,
            config=ConsumerConfig(
                name=first_name, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=last + 1
            ),
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1024 * 1024 * 1024,
        )
        jsi = _ordered_state(sub)
        if jsi is not None and hasattr(jsi, "_sseq"):
            # nats-py resumes an ordered consumer from its last seen stream sequence + 1, and from 1
            # (the whole retained stream) when it has seen none yet: start that count where we start
            jsi._sseq = last
        if jsi is not None and hasattr(jsi, "recreate_consumer") and hasattr(jsi, "_ccreq"):
            # nats-py recreates a reset ordered consumer (missed heartbeats, a gap, a NATS restart) from
            # the same config: with the same name, while the old consumer still lives, the server takes
            # it for an update of the start sequence and refuses it, and the subscription stops. Each
            # incarnation gets a fresh name (the old one expires once nobody listens on its inbox).
            recreate = jsi.recreate_consumer

            async def recreate_renamed() -> None:
                jsi._ccreq.name = self._consumer_name()
                pos.names.append(jsi._ccreq.name)
                await recreate()

            jsi.recreate_consumer = recreate_renamed
        self._js_subs.append((sub, pos))
        return sub

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Return once the server has handled every command this bus sent before the call: its
        subscriptions are registered (what anyone publishes afterwards reaches them), its publishes routed.

        nats-py's ``Client.flush`` does not promise that: it writes its PING straight to the socket,
        ahead of the SUBs and PUBs still queued for nats-py's flusher task (``subscribe`` and ``publish``
        only queue theirs), so its PONG can come back before the server has seen them. A test's planner,
        whose subscriptions are all core (no JetStream round trip flushes them on the way), had its 16
        SUBs reach the server 13 ms after that PING, after another connection's publishes: it received
        none of them (5 runs of 40 under CPU load; ``tests/integration/test_bus_flush_live.py``). Here the
        PING is written only when nothing is queued, so it follows everything sent before it, and the
        server answers one connection's commands in order.

        While disconnected it waits for the reconnect (woken by it, :meth:`_connection_changed`), then PINGs the new
        connection, where nats-py's reconnect has subscribed everything again and sent what it buffered; what had
        died in the old connection's socket is the resend window's (:meth:`_trim_recent`), not this flush's. A PING a
        reconnect lost (nats-py forgot it, or another PING of the bus cancelled it once forgotten) is replaced by a
        fresh one on the new connection while time is left. Before, a PING sent while disconnected "was answered" at
        once (nats-py's flush returns at once then): a flush with nothing queued returned as if the server had
        everything, one with something queued spun until its deadline (1.6 CPU-s in 2 s), and one whose PING a
        reconnect lost failed with "TimeoutError" at once (another PING's sweep, 0.36 s) or at its deadline (8 s)
        where a fresh PING was answered in milliseconds (review rr-ping53; ``tests/integration/test_bus_flush_live.py``).

        A PING not answered in time is left to its PONG (:meth:`ping`, ``shared.natsping``): nats-py's own
        ``flush`` timeout cancels the PONG's future, and the PONG that comes later (a server that hung, SIGSTOP)
        then ends the client's read loop (``InvalidStateError`` in ``_process_pong``, nats-py 2.16): the bus stayed
        connected and received nothing for good (``tests/integration/test_bus_flush_live.py``).

        Raises:
            ValueError: ``timeout_s`` is not positive.
            BusUnavailable: no PONG within ``timeout_s`` seconds in all (the server did not answer; disconnected and no
                reconnect in time; PINGs lost to reconnects), the connection is closed, the client is deaf (its read
                loop or flusher has ended, ``shared.natsping.DeafClient``: nats-py's flush would return at once without
                a PING; raised at once), or commands still queued all that time (others keep publishing on this
                connection).
        """
        if not timeout_s > 0:
            raise ValueError(f"flush timeout must be positive seconds, got {timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        within = f"{round(timeout_s, 2):g}"
        queued = "commands still queued"
        why = "the server did not answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if why == queued:
                    raise BusUnavailable(f"flush: commands still queued after {within} s")
                raise BusUnavailable(f"flush: no answer from NATS within {within} s: {why}")
            if not self.nc.is_connected and not self.nc.is_closed:
                why = "not connected (no reconnect in time)"
                await _first_of(self._changed.wait(), timeout_s=min(left, FLUSH_RECHECK_S))  # the event of this look
                continue
            clean = self.nc.pending_data_size == 0  # nothing queued: the PING below goes out after all of it
            # also lets nats-py's flusher write what is queued; a PING not answered in time is left to its PONG
            # (the caller's cancel, Bus.close's drain cut short, too): cancelled once a reconnect forgot it, or at close
            ping = self.ping()
            while not ping.future.done() and not ping.lost() and (left := deadline - time.monotonic()) > 0:
                await _first_of(self._changed.wait(), ping.future, timeout_s=min(left, FLUSH_RECHECK_S))
            if not ping.future.done():
                if ping.lost():  # a reconnect lost it: a fresh one on the new connection
                    ping.drop()
                    why = "the PINGs were lost to reconnects"
                else:
                    why = "the server did not answer"
                continue
            if ping.answered:
                if clean:
                    return
                why = queued
                continue
            e = None if ping.future.cancelled() else ping.future.exception()
            if isinstance(e, natsping.DeafClient):
                raise BusUnavailable(f"flush: the NATS client is deaf, {e}; it hears nothing until nats-py calls the "
                                     "connection stale (DeafClient)") from e  # fmt: skip
            if self.nc.is_closed:
                raise BusUnavailable("flush: no answer from NATS: the connection is closed") from e
            if isinstance(e, natsping.NotConnected):
                why = "not connected (no reconnect in time)"
            elif e is None:  # cancelled by another PING of the bus once a reconnect made nats-py forget it
                why = "the PINGs were lost to reconnects"
            else:
                raise BusUnavailable(f"flush: NATS refused the PING: {e!r}") from e

    def ping(self) -> Ping:
        """Send a PING on this bus's connection (:class:`shared.natsping.Ping`, in the next event-loop step; found not
        connected then, it ends ``NotConnected``, no PING sent): watch its PONG with :meth:`Ping.wait`, give up on it
        with :meth:`Ping.drop`. It is never cancelled while nats-py holds it (a cancelled PONG future that nats-py
        answers later ends its read loop: connected, deaf); one a reconnect made nats-py forget is cancelled at the
        next PING of the bus, one a reconnect lost once a later PING of the bus is answered, what is left at
        :meth:`close`."""
        return Ping(self.nc, conn=lambda: self.reconnected_at, keep=self._pings)

    async def reconnect_deaf(self) -> bool:
        """Make a deaf client reconnect now: one connected whose read loop or flusher has ended
        (``shared.natsping.deaf``; its PINGs end ``DeafClient``), which hears nothing (no message, no PONG) until
        nats-py's own PINGs, every 2 min, two unanswered, call the connection stale. nats-py's public
        ``Client.force_reconnect`` (2.15 and 2.16) closes the transport and reconnects as after a lost connection: the
        disconnected and reconnected callbacks run (the resend window published again, the stream checked), every
        subscription is made again. Counted ``nats.deaf_reconnects``, logged.

        Returns:
            True when a reconnect was started; False when the client is not deaf (nothing done), its reconnects are
            off (``allow_reconnect=False``) or this nats-py has no ``force_reconnect`` (logged)."""
        nc = self.nc
        if not natsping.deaf(nc):
            return False
        force = getattr(nc, "force_reconnect", None)
        if force is None or not getattr(nc, "options", {}).get("allow_reconnect", False):
            self.droplog.event("nats.deaf", "nats client deaf (its read loop or flusher has ended) and no reconnect can "
                               "be forced: it hears nothing until nats-py calls the connection stale",
                               nats_py=natsping.nats_py_version())  # fmt: skip
            return False
        self.counters["nats.deaf_reconnects"] += 1
        self.log.warning("nats client deaf (its read loop or flusher has ended): it hears nothing; reconnecting now")
        await force()
        return True

    def _connection_changed(self) -> None:
        """The connection came back (after :attr:`reconnected_at`) or was closed: wake whoever waits on :attr:`_changed`
        (:meth:`flush`), and give the next waiters a fresh event."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def unconfirmed(self) -> int:
        """Reliable publishes in the resend window now (:meth:`_trim_recent`): not yet known to have been read by the
        server ``RESEND_WINDOW_S`` ago. At most ``RESEND_MAX_MSGS``. O(1) amortized."""
        self._trim_recent(time.monotonic())
        return len(self._recent)

    async def window_room(self, room: int, timeout_s: float) -> bool:
        """Wait until the resend window has room for ``room`` more reliable publishes (it holds at most
        ``RESEND_MAX_MSGS - room``), for a publisher of a burst larger than the window (a router's republish of
        65,536 branches is up to 196,608 messages; at 17,000 a second the window, the last 2-3 s, passed
        ``RESEND_MAX_MSGS``, and the oldest left it unconfirmed: lost if the connection then died). The window empties
        as the server's PONGs confirm what it read (:meth:`_confirm_loop`, each ``CONFIRM_PING_S``).

        Args:
            room: publishes the caller is about to make (0 < room <= ``RESEND_MAX_MSGS``).
            timeout_s: longest wall seconds to wait (a hung server confirms nothing).

        Returns:
            True once there is room; False at ``timeout_s`` or when the bus is closing (the caller goes on: the oldest
            then leave the window, counted ``resend_window_dropped``).

        Raises:
            ValueError: ``room`` outside (0, ``RESEND_MAX_MSGS``].
        """
        if not 0 < room <= RESEND_MAX_MSGS:
            raise ValueError(f"room must be in (0, {RESEND_MAX_MSGS}], got {room!r}")
        deadline = time.monotonic() + timeout_s
        while self.unconfirmed() > RESEND_MAX_MSGS - room:
            if self._closing or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(WINDOW_POLL_S)
        return True

    def _trim_recent(self, now: float) -> None:
        """Cut the resend window ``_recent`` (what a reconnect publishes again; ``now``: monotonic seconds).

        With :meth:`_confirm_loop` running (a bus made by :meth:`connect` that published a reliable message), a publish
        leaves it only once the server is known to have read it ``RESEND_WINDOW_S`` ago: made before the ``sent`` of a
        PING whose PONG came more than ``RESEND_WINDOW_S`` ago (:attr:`_confirms`). At a PING each
        ``CONFIRM_PING_S`` (1 s) that holds the last 2-3 s of publishes in normal operation (before: the last 2 s).
        While the server hangs nothing is confirmed and everything is kept. Before, only the last ``RESEND_WINDOW_S``
        was, whatever the server had read: publishes made during a freeze sat in the socket, and the kill that ended
        it lost all but the last 2 s of them (``tests/integration/test_bus_freeze_kill_live.py``). Without the loop
        (a bus built on a client directly, the unit tests' fakes) the window is the last ``RESEND_WINDOW_S``.

        Either way at most ``RESEND_MAX_MSGS`` are kept: an older publish dropped for that (not known to be read)
        is counted ``resend_window_dropped`` and logged (rate-bounded); lost if the server was then killed."""
        recent = self._recent
        if self._confirm_task is None:
            bound = now - RESEND_WINDOW_S
            while recent and recent[0][0] < bound:
                recent.popleft()
        else:
            confirms = self._confirms
            while len(confirms) > 1 and now - confirms[1][1] > RESEND_WINDOW_S:
                confirms.popleft()
            if confirms and now - confirms[0][1] > RESEND_WINDOW_S:
                bound = confirms[0][0]
                while recent and recent[0][0] < bound:
                    recent.popleft()
        excess = len(recent) - RESEND_MAX_MSGS
        if excess > 0:
            for _ in range(excess):
                recent.popleft()
            self.counters["resend_window_dropped"] += excess
            last = self._confirms[-1][1] if self._confirms else None
            self.droplog.event("resend_window", "reliable publishes dropped from the resend window before the server "
                               "was seen to read them: RESEND_MAX_MSGS reached (a hung server, when no PING was answered "
                               "for a while; else more publishes a second than the window holds)", dropped=excess,
                               kept=len(recent), max_msgs=RESEND_MAX_MSGS,
                               last_confirm_s_ago=None if last is None else round(now - last, 1))  # fmt: skip

    async def _confirm_loop(self) -> None:
        """Learn what the server has read, for :meth:`_trim_recent`: each ``CONFIRM_PING_S`` a PING, whose PONG appends
        ``(sent, answered)`` to :attr:`_confirms` (``sent``: the time before which every publish had reached the
        connection's transport, ahead of the PING: :meth:`_confirm_once`). A round that fails (the client refused the PING) is logged (rate-bounded) and the loop
        goes on; it ends with the bus (:meth:`close` cancels it).

        As the router's NATS probe (``services/router/service.py``, ``_bus_probe_loop``) the PING is never given up
        on while its connection lasts (:meth:`ping`, ``shared.natsping``): nats-py's own ``flush`` timeout cancels the
        PONG's future, and a PONG that comes later then ends the client's read loop (nats-py 2.16). A reconnect forgets
        the PINGs sent before it (nats-py drops their futures; their PONGs never come): the round ends then, confirming
        nothing."""
        while True:
            try:
                await self._confirm_once()
            except Exception as e:  # a PING the client refused (connection closed under it): the next round tries again
                self.droplog.event("confirm", "resend window PING failed", error=repr(e)[:300])
            await asyncio.sleep(CONFIRM_PING_S)

    async def _confirm_once(self) -> None:
        """One round of :meth:`_confirm_loop`. What its PONG confirms: every publish made before the PING when nothing
        was queued then, else those made before :attr:`_clear` on this connection (a publisher that keeps the queue
        busy, thousands a second, still gets confirms: before, a round waited for an empty queue and, finding none in
        ``CONFIRM_PING_S``, confirmed nothing, so its window grew to ``RESEND_MAX_MSGS``)."""
        nc = self.nc
        if not nc.is_connected or natsping.deaf(nc):
            return  # down, or a client whose flush sends no PING (its read loop ended): nothing to confirm
        waited = time.monotonic() + CONFIRM_QUEUE_WAIT_S
        while nc.is_connected and nc.pending_data_size and time.monotonic() < waited:
            await asyncio.sleep(0.005)  # nats-py's flusher writes what is queued as a rule within a loop turn
        pongs = natsping.connection_of(nc)  # this connection's: nats-py makes a new list at each (re)connect
        sent, conn = time.monotonic(), self.reconnected_at
        if nc.pending_data_size:
            at, on = self._clear
            if on is not pongs or pongs is None:
                return  # no publish found the queue empty on this connection yet: nothing it could confirm
            sent = at
        ping = self.ping()
        # given up on only once lost (Ping.wait: nats-py forgot it, a reconnect made a new _pongs list): a PING sent on
        # a new connection before reconnected_cb ran (nats-py sets connected, then awaits its own flush, then calls
        # it) is in the new list, and cancelling it made its late PONG end the client's read loop (InvalidStateError
        # in _process_pong): connected, deaf, for minutes (review rr-bus52's proxy run)
        got = await ping.wait(CONFIRM_PING_S)
        while got is None:
            got = await ping.wait(CONFIRM_PING_S)
        if not got or self.reconnected_at != conn:
            return
        now = time.monotonic()
        self._confirms.append((sent, now))
        self._trim_recent(now)  # a quiet bus lets go of its window (and the confirms it no longer needs) too

    def _wrong_subject(self, template: str, raw: NatsMsg) -> None:
        """Count (``dropped.<template>``, ``wrong_subject.<template>``) and drop a message that came
        in on a subscription to ``template`` under another subject.

        A JetStream push consumer delivers the stream's messages on its deliver subject under their
        own subject, and that deliver subject is in the consumer's config, which the server's
        permissions do not see: a worker had a consumer of its own ``work.<n>.decode`` (where it may
        publish anything) deliver a forged split command on ``split.commands``, which it may not publish.
        Likewise an identity that learned the name of another's consumer may update its filter (to one of
        its own subjects, all its create grant allows): a worker turned the directory's ``route.placed``
        consumer onto its ``work.<n>.decode`` and the directory took the worker's placement for the router's.
        """
        self.counters["dropped." + template] += 1
        self.counters["wrong_subject." + template] += 1
        self.droplog.event(template, "message dropped: its subject is not the subscription's", subject=raw.subject[:200],
                           reply=(raw.reply or "")[:200], size=len(raw.data))  # fmt: skip

    def _consumer_name(self) -> str:
        """A fresh JetStream consumer name: ``<instance>_<16 hex>`` (the instance cut to the characters
        a consumer name may hold, ``[A-Za-z0-9_-]``, and 32 of them), unique per subscription and
        incarnation, so two processes, or one process before and after a restart, never share one."""
        tag = "".join(c if c.isascii() and (c.isalnum() or c in "_-") else "_" for c in self.instance)[:32] or "ei"
        return f"{tag}_{os.urandom(8).hex()}"

    async def serve(
        self, subject: Subject, handler: ReplyHandler, *, queue: str = "", query: bool = False, pending_bytes: int = 0, **params: str
    ) -> Subscription:
        """Answer requests on ``subject``; the handler returns the reply Struct.

        Only a reply subject under ``_INBOX.`` (:data:`REPLY_PREFIX`, where every client of the system
        gets its replies) is answered: a request with another one is counted (``dropped.<template>``,
        ``bad_reply.<template>``) and dropped, unanswered and unhandled, since the server lets the
        responder publish on any reply subject (``allow_responses``), the JetStream API's included.

        ``query=True``: the handler only computes an answer (no side effect), so a
        request without a reply inbox is counted under ``noreply.<template>`` (after
        decoding and validation, like any request) and not run: a flood of them
        costs a decode each, not a full answer each.

        ``pending_bytes``: how many bytes of requests nats-py queues for the handler before it drops the rest
        (a slow consumer); 0 = nats-py's default (64 MiB). A subject of large requests (a hand-off's K/V pieces,
        up to 8 MiB each, from several senders at once) sets more.
        """
        template = subject.template
        self.subscribed.add(template)

        pattern = self.subjects.wildcard(subject, **params)
        matches = subject_matcher(pattern)

        async def cb(raw: NatsMsg) -> None:
            if not matches(raw.subject):  # a consumer's delivery (see _wrong_subject)
                self._wrong_subject(template, raw)
                return
            if raw.reply and not raw.reply.startswith(REPLY_PREFIX):
                # The server lets a responder publish on a request's reply subject whatever it is
                # (allow_responses): a worker's request with reply ``$JS.API.STREAM.DELETE.EI_p0`` made
                # the router's refusal (an empty body) delete the partition's stream, and one with
                # reply ``ei.p0.kv.events.w1`` put the router's answer on a subject it may not publish.
                self.counters["dropped." + template] += 1
                self.counters["bad_reply." + template] += 1
                self.droplog.event(template, "request dropped: its reply subject is not an inbox", subject=raw.subject,
                                   reply=raw.reply[:200], size=len(raw.data))  # fmt: skip
                return
            msg, why = self._decode_why(subject, raw)
            if msg is None:
                # A refused request is answered at once (empty body, the reason in a header), so
                # the requester fails fast with the reason instead of waiting for its timeout.
                if raw.reply:
                    try:
                        await self.nc.publish(raw.reply, b"", headers={REFUSED_HEADER: why})
                    except nats.errors.Error:
                        self.counters["publish_failed.refusal"] += 1
                return
            self.counters["received." + template] += 1
            if query and not raw.reply:
                self.counters["noreply." + template] += 1
                return
            span = token = None
            if tracing.ENABLED and raw.headers and "traceparent" in raw.headers:
                span = tracing.start(f"{self.service} {template}", tracing.extract(raw.headers), kind=tracing.SpanKind.SERVER,
                                     attributes=_span_attrs(raw.subject, template, msg, "process"))
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

        if pending_bytes > 0:
            sub = await self.nc.subscribe(pattern, queue=queue, cb=cb, pending_bytes_limit=pending_bytes)
        else:
            sub = await self.nc.subscribe(pattern, queue=queue, cb=cb)
        self._subs.append(sub)
        return sub

    async def request(
        self, subject: Subject, msg: msgspec.Struct, *, timeout: float = 2.0, headers: dict[str, str] | None = None,
        _unanswered: str = "request_failed.", **params: str,
    ) -> Any:
        """Send a request and return the decoded reply (``headers``: NATS headers, e.g. ``traceparent``).
        Without a reply it is counted under ``request_failed.<template>`` (``ei_bus_requests_failed_total``;
        :meth:`request_until`'s tries under ``_unanswered`` = ``request_retried.``).

        Raises:
            BusError: on timeout or a closed connection (:class:`NoReply`), no responders (:class:`NoResponders`,
                a :class:`NoReply`), a publish this identity may not
                make (:class:`PermissionDenied`, at the timeout), an undecodable reply, or a request the
                server refused as malformed or invalid (:class:`RequestRefused`, the reason in the message).
        """
        full = self.subjects.format(subject, **params)
        key = full.lower()  # as the server's violation names it, once nats-py lowercased it (_requesting)
        self._requesting[key] += 1
        sent = time.monotonic()
        try:
            raw = await self.nc.request(full, m.encode(self._stamp(msg)), timeout=timeout, headers=headers)
        except _REQUEST_FAILED as e:  # timeout, no responders, closed, buffer full
            self.counters[_unanswered + subject.template] += 1
            if (denied := self._permission_error(full)) is not None:
                raise denied from e
            cls = NoResponders if isinstance(e, nats.errors.NoRespondersError) else NoReply
            raise cls(f"no reply on {full}: {type(e).__name__}") from e
        finally:
            self._requesting[key] -= 1
            if not self._requesting[key]:
                del self._requesting[key]
                self._denied.pop(key, None)
        seen = self._denied.get(key)
        if seen is not None and seen <= sent:
            # this publish went through after the violation came (one connection: the server took the denied
            # publish first), so the credentials allow the subject now (permissions reloaded). Before, the
            # entry stayed while requests on it overlapped (a worker's route.bind under load), and each later
            # timeout there was reported as PermissionDenied, which callers do not retry (bind.denied)
            del self._denied[key]
        if raw.headers and REFUSED_HEADER in raw.headers:
            self.counters["request_refused." + subject.template] += 1
            raise RequestRefused(f"request refused on {full}: {raw.headers[REFUSED_HEADER]}")
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

    async def request_until(
        self,
        subject: Subject,
        msg: msgspec.Struct,
        *,
        deadline_s: float,
        attempt_timeout_s: float = 1.0,
        retry_every_s: float = 0.5,
        done: Callable[[], bool] | None = None,
        on_retry: Callable[[int, BusError], None] | None = None,
    ) -> tuple[Any | None, int, BusError | None]:
        """:meth:`request` again and again until a reply, for at most ``deadline_s`` seconds: a
        service asking at start for state another service may not serve yet (``split.get`` before
        the planner is up). Each try waits ``attempt_timeout_s``; a failed one is retried after
        ``retry_every_s`` (``on_retry(attempt, error)`` is called first, e.g. to log); ``done()``
        true before a try ends the wait without a reply (the state arrived another way).

        Returns ``(reply or None, attempts made, last error or None)``: None and the last error
        when the deadline passed; None and the :class:`RequestRefused` at once when the responder
        refused the request as malformed or invalid (the same request is refused again: before, it was
        retried until the deadline); None and no error when ``done()`` ended it. Never raises
        :class:`BusError`.

        Counted: each try without a reply under ``request_retried.<template>``
        (``ei_bus_request_retries_total``), not as a failed request: a clean start, where the router asks
        the planner before it is up, counted ``ei_bus_requests_failed_total{subject="split.get"}`` 2 and
        an alert on failures fired on every start. A wait that gives up at the deadline without a reply
        counts once in ``request_failed.<template>``.
        """
        deadline = time.monotonic() + deadline_s
        attempt = 0
        key = "request_retried." + subject.template
        while done is None or not done():
            attempt += 1
            unanswered = self.counters.get(key, 0)
            try:
                return await self.request(subject, msg, timeout=attempt_timeout_s, _unanswered="request_retried."), attempt, None
            except RequestRefused as e:  # answered: a retry is refused again (counted request_refused.<template>)
                return None, attempt, e
            except BusError as e:
                if time.monotonic() >= deadline:
                    if self.counters.get(key, 0) != unanswered:  # no reply (not a refusal or a bad reply, counted apart)
                        self.counters["request_failed." + subject.template] += 1
                    return None, attempt, e
                if on_retry is not None:
                    on_retry(attempt, e)
                await asyncio.sleep(retry_every_s)
        return None, attempt, None

    # -- service plumbing ------------------------------------------------- #

    async def start_service_plumbing(
        self,
        stats: Callable[[], tuple[dict[str, int], dict[str, float]]] | None = None,
        *,
        heartbeat_interval_s: float = 1.0,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        """Answer ``svc.stats.<instance>`` and publish a heartbeat every interval; a planner, router or directory
        (``shared.auth.BEAT_WATCHERS``) also reads its kind's heartbeats and sets :attr:`superseded` at one of its
        instance id from a process that started later (a worker, whose kind's beats any node may publish, does not).

        ``stats`` returns the service's own counters and gauges; the bus adds its
        own counters (published/received/dropped per subject template).
        """

        async def on_stats(_req: m.StatsRequest, _subject: str) -> m.StatsReply:
            counters, gauges = stats() if stats else ({}, {})
            merged = dict(self.counters)
            merged.update(counters)
            return m.StatsReply(service=self.service, instance=self.instance, counters=merged, gauges=gauges)

        await self.serve(SVC_STATS, on_stats, instance=self.instance, query=True)

        async def on_beat(hb: m.Heartbeat, _subject: str) -> None:
            # another process under this instance id that started later: this one was replaced (restarted while
            # it was frozen, then resumed); two of one instance answer each other's requests (a router's
            # route.bind with "not pending", measured: 181 of 230 requests lost) until this one stops
            if hb.instance == self.instance and hb.boot != self.boot and m.boot_older(self.boot, hb.boot) and not self.superseded.is_set():
                self.superseded_by = hb.boot
                self.counters["superseded"] += 1
                self.log.error("a process that started later runs as this instance; this one stops", boot=self.boot, later=hb.boot,
                               later_pid=hb.pid)  # fmt: skip
                self.superseded.set()

        if self.service in BEAT_WATCHERS:  # not a worker: any node may beat as it (node.state.<n> tells it, services/worker)
            await self.subscribe(SVC_HEARTBEAT, on_beat, service=self.service)

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
                            boot=self.boot,
                        ),
                        service=self.service,
                    )
                except Exception as e:  # connection hiccup: keep beating
                    self.log.debug("heartbeat failed", error=repr(e))
                self.droplog.flush()
                await asyncio.sleep(heartbeat_interval_s)

        self._tasks.append(asyncio.create_task(beat(), name=f"heartbeat-{self.instance}"))

    async def close(self) -> None:
        """Stop background tasks, drain subscriptions (in-flight handlers finish), close. The drain takes at most
        ``CLOSE_DRAIN_S`` (about 5 s), then is cut short (handlers still running are cancelled); with the connection
        lost and no handler running, at most ``CLOSE_LOST_GRACE_S`` (:meth:`_drain`). A connection lost meanwhile
        (NATS down) is logged, not raised: what was buffered for it is dropped, and the reliable publishes a reconnect
        would have published again (the resend window, :attr:`_held`) are dropped with a warning, counted ``close_dropped``.

        Raises:
            asyncio.CancelledError: the caller was cancelled meanwhile; raised after the connection is closed (the
                tasks ended, the drain cut short), so a cancelled close still closes."""
        self._closing = True
        caller_cancel: asyncio.CancelledError | None = None
        # cancelled again until they end (shared.cancel): a task cancelled in the turn its nats-py call's answer came
        # loses that cancel (Python 3.11's wait_for) and goes on (the heartbeat's while True); one cancel and an
        # unbounded await kept a stopping service alive (tests/unit/shared/test_stop_lost_cancel.py). Tasks added
        # meanwhile (a handler's first reliable publish's bus-stream check) are cancelled too, not cleared away still
        # running; a reconnect from now on starts none (reconnected_cb)
        while self._tasks:
            tasks = list(self._tasks)
            self._tasks.clear()
            try:
                await cancel_until_done(tasks)
            except asyncio.CancelledError as e:  # the caller's: the tasks have ended; close first, then raise it
                caller_cancel = e
        drain_s = CLOSE_DRAIN_S
        if (self._resend or self._held) and self.nc.is_connected:
            # a reconnect's check cancelled above before it published the window again put it back (_after_reconnect):
            # published here, before the drain, so its flush sends it (message ids drop a copy the stream has); while
            # disconnected it stays for a reconnect during the close (reconnected_cb). Bounded with the drain: nats-py's
            # publish only waits when its buffer is full, and the drain gets what is left of CLOSE_DRAIN_S (at least
            # CLOSE_LOST_GRACE_S). Before, the cancel dropped it (tests/integration/test_bus_close_cancels_reconnect_live.py).
            # What the bus kept since the disconnect (_held: the cancelled check had not found the stream yet) goes with
            # it, in publish order: a server back without its store got those from nats-py's reconnect buffer before
            # the stream was made again, or the bus only kept them (_stream_lost). Before, they were dropped with the
            # check (tests/integration/test_bus_close_held_live.py)
            held = self._stop_holding()
            resend, self._resend = self._in_order([*self._resend, *held]), []
            self.log.warning("resend window and kept publishes published again at the close (its reconnect check was "
                             "cancelled)", resend=len(resend), held=len(held))  # fmt: skip
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(self._publish_again(resend), CLOSE_DRAIN_S)
            except asyncio.TimeoutError:
                self.log.warning("resend at close timed out", timeout_s=CLOSE_DRAIN_S)
            except asyncio.CancelledError as e:  # the caller's: the connection is closed below, then it is raised
                caller_cancel = e
            drain_s = max(CLOSE_LOST_GRACE_S, CLOSE_DRAIN_S - (time.monotonic() - t0))
        if not self.nc.is_closed:
            try:
                await self._drain(drain_s)
            except asyncio.CancelledError as e:  # the caller's cancel during the drain: the connection is closed below
                caller_cancel = e
            if not self.nc.is_closed:
                try:
                    await self.nc.close()
                except Exception as e:
                    # the server is gone (the drain ended, or found no connection): its close flushes what was
                    # buffered meanwhile (heartbeats, publishes) into the lost connection and raises ConnectionResetError.
                    # Those messages could not be delivered anyway; before, the error ended a service stopped during a
                    # NATS outage in a traceback (exit 1) instead of a clean stop
                    self.log.warning("nats connection lost at close; messages buffered while disconnected dropped", error=repr(e))
        unsent = self._in_order([*self._resend, *self._held])
        if unsent:
            # the connection was lost at the close and did not come back during it (reconnected_cb publishes these
            # then): the reliable publishes a reconnect would have published again are dropped with the bus. Before,
            # silently (reviewer rr-bus2)
            self.counters["close_dropped"] += len(unsent)
            self.log.warning("nats connection lost at close; reliable publishes a reconnect would have published again "
                             "dropped", dropped=len(unsent), resend=len(self._resend), held=len(self._held),
                             only_kept=self._held_unsent)  # fmt: skip
            self._resend, self._held_bytes = [], 0
            self._held.clear()
        for ping in list(self._pings):  # the client no longer reads: no PONG can reach them now
            ping.future.cancel()
        if caller_cancel is not None:
            raise caller_cancel

    def _stop_consumer_checks(self) -> None:
        """Cancel nats-py's background tasks of each reliable subscription's ordered consumer (:data:`CONSUMER_CHECK_TASKS`
        of its ``_JSI``, :func:`_ordered_state`) before :meth:`_drain` unsubscribes it. nats-py cancels them only in
        ``PushSubscription.unsubscribe``, not in a drain: its activity check went on, took the drained consumer's
        silence for two missed heartbeats (``CONSUMER_HEARTBEAT_S``), subscribed again and made a new consumer on the
        server, left behind by the close (a drain of 3 s left 2 consumers)."""
        for sub, _pos in self._js_subs:
            jsi = _ordered_state(sub)
            for name in CONSUMER_CHECK_TASKS:
                task = getattr(jsi, name, None)
                if isinstance(task, asyncio.Task):
                    task.cancel()

    def _connection_subscriptions(self) -> list[Subscription]:
        """Every subscription of the connection, as nats-py's ``Client.drain`` drains them: its ``Client._subs``
        (the bus's, the subscription behind each JetStream consumer as it stands after a reset, a request's reply
        inbox, one made on ``nc`` directly). Only the bus's own when that nats-py internal is missing."""
        subs = getattr(self.nc, "_subs", None)
        if isinstance(subs, dict):
            return [s for s in subs.values() if isinstance(s, Subscription)]
        return list(self._subs)

    def _reply_subscriptions(self, subs: list[Subscription]) -> list[Subscription]:
        """Those of ``subs`` that carry the replies to this connection's requests: nats-py's request-reply
        subscription (``_INBOX.<nuid>.*``, made at the first ``request``), known by its callback,
        ``Client._request_sub_callback``. None when that nats-py internal is missing."""
        mux = getattr(self.nc, "_request_sub_callback", None)
        return [s for s in subs if mux is not None and getattr(s, "_cb", None) == mux]

    async def _drain_again(self, sub: Subscription, deadline: float) -> None:
        """Drain ``sub`` again on the connection nats-py made after a reconnect (:meth:`_drain`), by ``deadline``
        (monotonic seconds): its UNSUB, then :meth:`flush` (the server has sent every message it routed to ``sub``
        before that UNSUB), then its queue handled, then nats-py stops and forgets it, as ``Subscription.drain`` does.
        That one cannot be called again: its first drain, cancelled, marked the subscription closed (nats-py 2.16),
        though it is still in ``Client._subs`` and nats-py subscribed it again when it reconnected. A subscription
        nats-py no longer has (its first drain ended as it was cancelled) is done.

        Raises:
            BusUnavailable: no PONG by ``deadline`` (:meth:`flush`)."""
        subs = getattr(self.nc, "_subs", None)
        if isinstance(subs, dict) and subs.get(sub._id) is not sub:
            return
        await self.nc._send_unsubscribe(sub._id)
        await self.flush(timeout_s=max(0.01, deadline - time.monotonic()))
        queue = getattr(sub, "_pending_queue", None)
        if queue is not None:
            await queue.join()
        sub._stop_processing()
        self.nc._remove_sub(sub._id)

    async def _drain(self, limit_s: float) -> None:
        """Drain the connection before :meth:`close` closes it, for at most ``limit_s`` seconds: every subscription of
        the connection stops taking messages and handles those already received (nats-py ``Subscription.drain``:
        UNSUB, a PING round trip, then its queue is handled), then what was published goes out (:meth:`flush`).

        nats-py's request-reply subscription (:meth:`_reply_subscriptions`) is drained last, once the others have
        ended, within the same bound: a handler still running may be waiting on a request's reply. Drained with the
        others, it was gone before the reply came, and the handler waited out its request's timeout, then failed
        (``tests/integration/test_bus_close_drain_live.py``: close 1.95 s and ``TimeoutError``; now 0.26 s, answered).

        A lost connection does not end it while a handler is running or has a message queued (handlers run locally;
        what they publish while the client reconnects is sent when the server is back,
        ``tests/integration/test_bus_close_stalled_nats_live.py``). Once the connection has been lost for
        ``CLOSE_LOST_GRACE_S`` with none, it ends: the subscriptions' PINGs are never answered by a server gone for
        good, and waiting out ``limit_s`` held every service's stop 5 s (``test_bus_close_nats_gone_live``).

        A reconnect makes what the drain still waits on again on the new connection: the drains sent before it are
        cancelled and each subscription drained again (:meth:`_drain_again`: UNSUB, :meth:`flush`, its queue handled),
        and a final flush begun before it is sent again. nats-py forgets the PINGs it waits on when it reconnects
        (``Client._pongs``, nats-py 2.16), so those never end, and the connection is up, so the grace above never
        starts: NATS restarted during a close that had a handler running held it the whole ``limit_s`` (5.00 s with the
        handler done at 1.0 s; now about 1.0 s, ``tests/integration/test_bus_close_drain_live.py``), and one during
        the final flush did too (``tests/integration/test_bus_close_flush_reconnect_live.py``: 7.7 s after the
        reconnect with an 8-s bound; now a PING round trip). nats-py subscribes the draining subscriptions again on
        the new connection, a queue group's included, so the server routes messages to them again until the new
        UNSUB: those come before the new drain's PONG and are handled. Before, once no handler was busy, the
        subscriptions were unsubscribed instead (nats-py drops one at once, its UNSUB follows), and a queue-group
        request the server had routed to this member meanwhile was dropped on arrival, unanswered
        (``tests/integration/test_bus_close_queue_reconnect_live.py``: 10 of 20).

        The bus drains each subscription in a task it owns, not with nats-py's ``Client.drain``: that one gathers the
        subscriptions' drains with ``asyncio.gather`` inside ``wait_for`` and, cancelled at the bound, leaves the
        gather's exception unretrieved ("_GatheringFuture exception was never retrieved" at the service's exit,
        nats-py 2.16). Here every drain's outcome is retrieved: one that failed on its own (not one this bus cut
        short) is logged, one line for all. The bound is this loop's, and what it cuts short is cancelled until it
        ends (``shared.cancel``): with ``wait_for`` around nats-py's drain, which swallowed the timeout's cancel and
        flushed with its own 10-s timeout, a server that stopped answering held the close 15 s
        (``test_bus_close_stalled_nats_live``).

        Raises:
            asyncio.CancelledError: the caller was cancelled; the drains still running are cancelled first."""
        deadline = time.monotonic() + limit_s
        self._stop_consumer_checks()
        subs = self._connection_subscriptions()
        quiet_since: float | None = None  # lost, and no handler busy, since
        first_look = True

        draining: dict[asyncio.Future[Any], Subscription] = {}

        def drain(batch: list[Subscription], *, again: bool = False) -> list[asyncio.Future[Any]]:
            """Start draining ``batch`` (``again``: on a new connection, :meth:`_drain_again`); the drains."""
            started: list[asyncio.Future[Any]] = []
            for sub in batch:
                fut = asyncio.ensure_future(self._drain_again(sub, deadline) if again else _drain_subscription(sub))
                draining[fut] = sub
                started.append(fut)
            return started

        def drain_again(stuck: list[asyncio.Future[Any]]) -> list[asyncio.Future[Any]]:
            return drain([draining[f] for f in stuck], again=True)

        def flush_again(_stuck: list[asyncio.Future[Any]]) -> list[asyncio.Future[Any]]:
            flushing.append(asyncio.ensure_future(self.flush(timeout_s=max(0.01, deadline - time.monotonic()))))
            return flushing[-1:]

        async def wait(futs: list[asyncio.Future[Any]], again: Callable[[list[asyncio.Future[Any]]], list[asyncio.Future[Any]]]) -> bool:
            """Wait for ``futs`` (begun now): True when all ended. When the bus reconnects meanwhile, those still
            running (no PONG answers their PINGs now) are cancelled and ``again(them)`` starts what replaces them on
            the new connection, waited for in turn. False at the deadline or when the connection has stayed lost with
            no handler busy for CLOSE_LOST_GRACE_S (logged; counted from the loss itself when the connection was
            already lost, with no handler busy, as the drain began)."""
            nonlocal quiet_since, first_look
            since = time.monotonic()
            while True:
                pending = [f for f in futs if not f.done()]
                now = time.monotonic()
                if not pending:
                    return True
                if now >= deadline:
                    return False
                back = self.reconnected_at
                if back is not None and back >= since and self.nc.is_connected:
                    self.log.info("nats reconnected during the close's drain; what it waited on is done again on the new "
                                  "connection", waiting=len(pending))  # fmt: skip
                    await cancel_until_done(pending, limit_s=1.0)
                    since = time.monotonic()
                    futs = again(pending)
                    continue
                if self.nc.is_connected or _handlers_busy(subs):
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = min(now, self._lost_at or now) if first_look else now
                first_look = False
                if quiet_since is not None and now - quiet_since >= CLOSE_LOST_GRACE_S:
                    self.log.warning("nats connection lost at close; drain ended, what was published meanwhile dropped",
                                     lost_s=round(now - quiet_since, 2))  # fmt: skip
                    return False
                await asyncio.wait(pending, timeout=min(CLOSE_POLL_S, deadline - now))

        replies = self._reply_subscriptions(subs)
        flushing: list[asyncio.Future[Any]] = []
        try:
            ended = await wait(drain([sub for sub in subs if sub not in replies]), drain_again)
            if ended and replies:  # the handlers have ended: no request of theirs waits on a reply now
                ended = await wait(drain(replies), drain_again)
            if ended and not self.nc.is_closed and deadline > time.monotonic():
                await wait(flush_again([]), flush_again)
        finally:
            drains = list(draining)
            failed = [f.exception() for f in drains + flushing if f.done() and not f.cancelled() and f.exception()]
            running = [f for f in drains + flushing if not f.done()]
            if failed:
                self.log.warning("nats drain at close failed", failed=len(failed), error=repr(failed[0])[:300])
            if running:  # cut short: their outcomes are retrieved and dropped
                await cancel_until_done(running, limit_s=1.0)


async def _first_of(*waits: Awaitable[Any], timeout_s: float) -> None:
    """Wait until one of ``waits`` (coroutines or futures) ends or ``timeout_s`` seconds pass; the coroutines still
    running are cancelled, futures (a PING's) are left as they are. Their outcomes are not looked at."""
    futs = [w if isinstance(w, asyncio.Future) else asyncio.ensure_future(w) for w in waits]
    mine = [f for f, w in zip(futs, waits) if f is not w]
    try:
        await asyncio.wait(futs, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in mine:
            f.cancel()


def _handlers_busy(subs: list[Subscription]) -> bool:
    """Whether a handler of one of ``subs`` is running or has a message queued. nats-py has no public count of that:
    its message loop marks each message of ``Subscription._pending_queue`` (an ``asyncio.Queue``) done after the
    handler returns, so the queue's unfinished count is read. A nats-py without those counts as busy: the drain then
    keeps to ``CLOSE_DRAIN_S``, as before ``CLOSE_LOST_GRACE_S``."""
    for sub in subs:
        unfinished = getattr(getattr(sub, "_pending_queue", None), "_unfinished_tasks", None)
        if not isinstance(unfinished, int) or unfinished > 0:
            return True
    return False


async def _drain_subscription(sub: Subscription) -> None:
    """Drain one subscription (nats-py ``Subscription.drain``); one already closed (unsubscribed, drained) is done."""
    with contextlib.suppress(nats.errors.BadSubscriptionError):
        await sub.drain()
