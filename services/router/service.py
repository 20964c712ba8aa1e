"""RouterService: the asyncio shell around :class:`~services.router.core.RouterCore`.

This file contains zero routing logic: it decodes HTTP and NATS input, calls
the core (``core.py``, ``policy.py``, ``nodes.py``, ``branches.py``), and
publishes what the core returns. Its twin ``core.py`` contains zero I/O.

HTTP (uvicorn runs inside the service's own event loop, next to the bus):

=====================================  =========================================================
``POST /v1/completions``               OpenAI completions; ``prompt`` is text or token ids
``POST /v1/chat/completions``          OpenAI chat completions
``GET /v1/models``                     the served model (with vLLM's ``max_model_len``)
``GET /version``                       vLLM's: the package version
``POST /tokenize``, ``/detokenize``    vLLM's: the router's tokenizer and chat formatting
``GET /healthz``, ``GET /health``      readiness: 200 when the fence loop and HTTP server run, NATS is connected,
                                       answers the router's PINGs and has settled, and a placement is possible,
                                       else 503 with the reason ("router draining" during a SIGTERM's drain,
                                       ``--shutdown-grace-s``; "router stopping" during the stop)
``GET /ping``, ``POST /ping``          the same answer (vLLM's: the SageMaker-style health check, GET or POST)
``GET /livez``                         liveness: 200 ``{"status": "ok"}`` whenever the HTTP server answers, draining
                                       and stopping included (a liveness probe on ``/healthz`` restarted a draining
                                       router, failing its open streams); nothing else is checked
``GET /v1/cluster``                    nodes, phases, state ages, fencing, in-flight counts, the clock's speedup,
                                       the routing policy and decode rule (``decode_routing``, ``decode_rule``)
``GET /metrics``                       Prometheus text format (``services/router/prom.py`` lists the metrics)
``POST /v1/branches/{id}/end``         end an agent branch (publishes ``BranchEnd``)
``POST /v1/branches/{id}/tool-call``   "tool call outstanding" hint, body ``{"outstanding": true, "expected_s": 120}``
                                       (both optional): keeps the branch and its KV counted while the
                                       tool runs (publishes ``BranchToolCall``)
=====================================  =========================================================

NATS: subscribes ``node.state.*``, ``split.commands``, ``planner.models`` and (once) ``req.*.out.*`` (a request's
output, one subject per publishing node: a chunk counts only from a node the request was placed on, and its node is
the subject's, ``shared.subjects.REQ_OUT``), ``branch.events`` (a core subscription: the other routers' relayed ends
and tool calls of the branches this one served);
serves ``route.bind`` (decode node at prefill start) and ``work.requeue`` (work a node hands
back during a phase switch); requests ``split.get`` at start and ``kv.lookup`` per request;
publishes ``branch.events``, ``route.placed``, ``work.<node>.prefill``, ``work.<node>.decode``
(a re-bound hand-off), ``work.<node>.abort`` and ``req.<rid>.out.<its instance>`` (the end of a request that ended
parked).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import os
import re
import signal
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
import numpy as np
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared import messages as m
from shared import tracing
from shared import natsping
from shared.bus import RESEND_MAX_MSGS, RESEND_WINDOW_S, STREAM_LOOKUP_TIMEOUT_S, Bus, BusError
from shared.clock import SimClock
from shared.config import env_name, flag_name
from shared.hashing import block_hashes_packed
from shared.metrics import FuncCollector, make_registry, metrics_response
from shared.net import bind_socket, http_url, inherited_socket
from shared.ratelog import RateLimitedLog
from shared.service import BackgroundTasks, WatchedService
from shared.validate import epoch_step_ok
from shared.subjects import (
    BRANCH_EVENTS,
    BRANCH_QUERY,
    BRANCH_SYNC,
    KV_LIVENESS,
    KV_LOOKUP,
    NODE_DOWN,
    NODE_STATE,
    PLANNER_MODELS,
    REQ_OUT,
    ROUTE_BIND,
    ROUTE_HELD,
    ROUTE_PLACED,
    ROUTE_SENT,
    SPLIT_COMMANDS,
    SPLIT_GET,
    WORK_ABORT,
    WORK_DECODE,
    WORK_PREFILL,
    WORK_REQUEUE,
)

from services.router import api, toolcalls
from services.router.ingress import KEY_ID_SCOPE_KEY, RESET_EXTENSION, ApiKeyError, IngressGuard, guarded_h11, key_id, load_api_keys
from services.router.branches import BranchAlreadyEnded, BranchError, BranchTable, UnknownBranch, unseen_verdict
from services.router.config import LOOKUP_TIMEOUT_HINT, RouterConfig
from services.router.core import DecodeBinding, NoRoute, RouteDecision, RouterCore
from services.router.faults import continuation
from services.router.nodes import FencedNode, kv_blocks
from services.router.replicas import RemoteSends
from services.router.policy import RouteRequest
from services.router.silence import DeliveryWitness, Held
from services.router.stops import OutputText
from services.router.prom import router_families
from services.router.template_pool import RequestTemplatePool, TemplateRenderError
from shared.tokenizer import Tokenizer, load_tokenizer, min_prompt_tokens

_JSON = msgspec.json.Encoder()
_SSE_DONE = b"data: [DONE]\n\n"
SSE_BATCH_EVENTS = 32
"""Data events of one stream the router sends in one body message (one socket write) at most, when the chunks they
come from were queued together (``_stream``). Bounded so that a stream whose client reads nothing still leaves its
output in the router's queue, where ``--max-buffered-output-tokens`` counts it (uvicorn's send waits for the socket
only between messages): one message takes at most this many events past the socket's buffer."""
_BIG_TEXT = 32_768
"""Body bytes above which a request's parse, tokenization and per-token work run in a worker thread
(:func:`_off_loop_if_big`)."""
_T = TypeVar("_T")

MAX_BODY_SETTING = f"{flag_name('max_body_bytes')} / {env_name('max_body_bytes')}"
"""How a 413 names the body-size limit's setting: the router's flag and its variable (``up`` and ``demo`` have no
such flag; the router they start reads ``EI_MAX_BODY_BYTES``)."""
BODY_TIMEOUT_SETTING = f"{flag_name('body_timeout_s')} / {env_name('body_timeout_s')}"
"""How a 408 names the body-timeout's setting (as :data:`MAX_BODY_SETTING`: ``--body-timeout-s / EI_BODY_TIMEOUT_S``)."""


_HUGE_BODY = 4 * 1024 * 1024
"""Body bytes above which a request's parse and tokenization wait for the router's gate (:data:`_HUGE_AT_ONCE`).
4 MiB is an agent's 100K-token context (~0.4 MB of text) ten times over: those never wait behind a huge
body; a prompt near ``max_prompt_tokens`` (1M tokens, ~4 MB of English text) may wait its turn."""
_HUGE_AT_ONCE = 2
"""Bodies over ``_HUGE_BODY`` bytes parsed and tokenized at once (:func:`_off_loop_if_big`'s ``gate``); the
others wait their turn, their bodies read. Each takes memory several times its size (a 60 MB prompt of 30M
words: ~360 MB at its peak, measured here): four at once took the router from 70 MB to 1.5 GB, and
``asyncio.to_thread``'s pool runs min(32, cores + 4) of them."""


async def _off_loop_if_big(
    body: bytes, run: Callable[[bytes], _T], gate: asyncio.Semaphore, gone: Callable[[], Awaitable[None]],
) -> _T:
    """``run(body)``: in a worker thread when ``body`` is over ``_BIG_TEXT`` bytes, so that the event
    loop (every stream, every bus message) does not stop for it; here, with no thread hop, when small.
    Used by ``/tokenize``, ``/detokenize`` and the generation endpoints (``_prepare``): a 59 MB body of
    10M ids takes ~0.45 s to parse and ~0.4 s to make an array of (measured here, msgspec + numpy).
    Python-level work (the block hashes, one call per block) gives the loop the GIL every switch interval;
    one C call that holds the GIL does not, and still stops the loop for its length: msgspec's parse
    (44 ms for a 6.2 MB body of 1M ids, 0.45 s for 59 MB), ``tokenizers``' ``Tokenizer.encode`` (a 6 MB
    text: 5.1 s with a toy BPE; ``HFTokenizer`` calls ``encode_batch_fast``, which releases it: 0.09 s).
    ``gate``: held around the thread of a body over :data:`_HUGE_BODY` bytes (the router's: :data:`_HUGE_AT_ONCE`
    at once), so that their memory is bounded by the gate, not by how many clients send one at once.
    ``gone``: returns when the client closed the connection; one that goes while its body waits for the gate
    leaves the line (:func:`_acquire_unless_gone`) instead of being parsed for nobody once a slot is free.

    Raises:
        _GoneAtGate: ``gone`` returned while the body waited for the gate (``run`` was not called).
        Exception: what ``run`` raised.
    """
    if len(body) <= _BIG_TEXT:
        return run(body)
    if len(body) <= _HUGE_BODY:
        return await asyncio.to_thread(run, body)
    if not await _acquire_unless_gone(gate, gone):
        raise _GoneAtGate
    try:
        return await asyncio.to_thread(run, body)
    finally:
        gate.release()


class _GoneAtGate(Exception):
    """The client closed the connection while its body waited for the gate (:func:`_off_loop_if_big`)."""


async def _acquire_unless_gone(gate: asyncio.Semaphore, gone: Callable[[], Awaitable[None]]) -> bool:
    """Acquire ``gate`` unless ``gone()`` returns (or fails: the connection is broken) first. True: acquired;
    False: gone, not acquired (its place in line, or a slot granted at the same moment, goes to the next).
    A caller cancelled meanwhile holds nothing either."""
    if not gate.locked():  # a free slot: taken at once, no task made
        await gate.acquire()
        return True
    acquire = asyncio.ensure_future(gate.acquire())
    watch = asyncio.ensure_future(gone())

    def let_go() -> None:  # the slot, granted or not
        if acquire.done() and not acquire.cancelled():
            gate.release()
        else:
            acquire.cancel()  # Semaphore.acquire hands a slot granted meanwhile to the next waiter

    try:
        await asyncio.wait({acquire, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled
        watch.cancel()
        let_go()
        raise
    if not watch.done():
        watch.cancel()
        return True
    if not watch.cancelled():
        watch.exception()  # retrieved: a broken connection counts as gone
    let_go()
    return False


_DUPLICATE_GRACE_S = 0.5
"""Wall seconds a request whose ``X-Request-ID`` is in flight waits for that request to end before
its 409: a client that closes a request and retries at once with the same id reaches the router
before the close does (on a local 4-node cluster 3 of 5 such retries got a 409, each gone a few
ms later)."""

CHUNK_GAP_WAIT_S = RESEND_WINDOW_S + STREAM_LOOKUP_TIMEOUT_S
"""Wall seconds (7.0) a request's token chunks that came out of order (past its next output position) are held
for the missing ones before the request fails with a 502 'tokens a..b never arrived within N s' (``chunks_gap``).
Why that long: after a NATS reconnect, nats-py flushes what a worker published during the outage before the
worker's bus publishes its last ``RESEND_WINDOW_S`` of reliable messages again (those may have died unstored with
the server), and the bus does that only once its stream lookup has been answered (``STREAM_LOOKUP_TIMEOUT_S`` at
most per try): chunk k + 1 can reach the router that long before chunk k (reviewer rr-gap). A lookup retried past
that (a server that stays unanswering) fails the request; ``RouterService.chunk_gap_wait_s`` is this value."""

REPUBLISH_YIELD_EVERY = 256
"""Messages of a ``branch.sync`` republish between two yields of the event loop (:meth:`RouterService._on_branch_sync`)."""
REPUBLISH_WINDOW_ROOM = RESEND_MAX_MSGS // 4
"""Room in the bus's resend window a republish keeps (it waits, every :data:`REPUBLISH_YIELD_EVERY` messages, while
the window holds more than ``RESEND_MAX_MSGS - REPUBLISH_WINDOW_ROOM`` unconfirmed publishes)."""
REPUBLISH_WINDOW_WAIT_S = 10.0
"""Longest wall seconds a republish waits for room in the resend window (a hung server confirms nothing); past it
the rest of the republish goes out unpaced (``branch_sync.window_full``)."""
BRANCH_QUERY_TIMEOUT_S = 2.0
"""Wall seconds a router waits for the KV directory's answer to ``branch.query`` (the state of a branch its table does
not hold, asked when a harness ends it or sends its tool-call hint); none within it is a 503 with ``Retry-After: 1``.
Only those calls wait on it, and only for an id the router never saw (another router's, or its own before a restart):
a reply takes milliseconds, so the wait is long enough for a loaded host's and short of the OpenAI SDK's 10-minute
timeout by far."""

_PEER_HELD_TIMEOUT_S = 1.0
"""Wall seconds a router waits for another router's answer to ``route.held`` when a request arrives
with an ``X-Request-ID`` that router placed (:meth:`RouterService._duplicate_answer`): none within
it (no responders, or a timeout) means that router is gone."""


class _PeerPlaced(Exception):
    """Another router placed this request's rid (its ``route.sent`` arrived while it was being routed
    here): placing it too would count one rid twice and give two streams one id."""


@dataclass(slots=True)
class _Failure:
    """Put in a request's queue when it fails outside the token stream."""

    status: int
    reason: str


def _lp_entries(chunk: m.TokenChunk) -> list[api.LogprobEntry]:
    """``chunk``'s logprob entries, one per token id. A chunk without them (a node of an older
    version, which does not know ``Sampling.logprobs``) gives NaN logprobs and no top lists,
    sent as ``null`` (``api.LOGPROB_FLOOR``'s doc), not made up."""
    n = len(chunk.token_ids)
    lps = chunk.logprobs if len(chunk.logprobs) == n else [math.nan] * n
    tops = chunk.top_ids if len(chunk.top_ids) == n else [[] for _ in range(n)]
    top_lps = chunk.top_logprobs if len(chunk.top_logprobs) == n else [[] for _ in range(n)]
    return list(zip(chunk.token_ids, lps, tops, top_lps))


@dataclass(slots=True)
class _Pending:
    rid: str
    prefill_node: str
    decode_node: str | None
    queue: asyncio.Queue[m.TokenChunk | _Failure] = field(default_factory=asyncio.Queue)
    first_seen: bool = False
    predicted_ttft_s: float | None = None
    queue_s: float | None = None
    """``queue_s`` of the first chunk (time queued on the prefill node)."""
    fetch_s: float | None = None
    """``fetch_s`` / ``exposed_fetch_s`` of the first chunk (peer fetch while queued)."""
    exposed_fetch_s: float | None = None
    fetched_tokens: int = 0
    """``fetched_tokens`` of the first chunk (prompt tokens whose KV came from peers)."""
    plan_sources: list[str] = field(default_factory=list)
    """Nodes of the fetch plan of the attempt last dispatched (sorted)."""
    fetch_sources: list[str] = field(default_factory=list)
    """``plan_sources`` of the attempt whose first chunk reported a fetch."""
    done: bool = False
    """The core no longer counts it (finished, failed or aborted)."""
    t_in: float = 0.0
    """HTTP arrival (simulated s): TTFT and E2E start here."""
    arrived_at: float | None = None
    """The first chunk's ``arrived_at`` (the work reached its prefill node) and ``ts`` (the first
    token there), simulated s: the control plane's share of TTFT (``evolving-infra fidelity``)."""
    first_token_at: float | None = None
    tr: "_ReqTrace | None" = None
    """The request's spans when tracing is on (``shared/tracing.py``)."""
    ttft_s: float | None = None
    out_tokens: int = 0
    """Output tokens received (the client's count once a stop string or stop token id cut its output)."""
    last_token_t: float | None = None
    """When its last output chunk with tokens reached the router (simulated s; None before the first):
    the start of the next inter-token gap (``ei_router_inter_token_latency_seconds``)."""
    cached_tokens: int = 0
    """``cached_tokens`` of the first chunk (prompt tokens whose KV the prefill node had or fetched)."""
    rreq: RouteRequest | None = None
    """The request as first routed (its prompt: the base of a continuation)."""
    cur: RouteRequest | None = None
    """The request of the current attempt (``rreq``, or a continuation after a decode node died)."""
    attempt: int = 0
    """Dispatch attempt (fencing token): chunks, binds and hand-backs of other attempts are refused."""
    offset: int = 0
    """Output position of the current attempt's first output token."""
    attempt_first: bool = False
    """The current attempt's first chunk arrived (its prefill finished)."""
    handoff: tuple[int, str] | None = None
    """``(attempt, prefill node)`` once that attempt's prefill → decode hand-off from that prefill node reached a
    decode node (its output came, or it handed the decode work back: it had it); from then on the prefill node's
    chunks of that attempt are dropped (:meth:`RouterService._handed_off`). A re-dispatch (a new attempt) or the
    work routed to another prefill node makes it stale."""
    handed_back: tuple[int, str] | None = None
    """``(attempt, decode node)`` of the latest decode hand-back taken (``work.requeue``): that node forgot the
    request, so its chunks of that attempt are dropped (:meth:`RouterService._handed_off`)."""
    next_index: int = 0
    """Output position of the next token the client does not have yet."""
    held: dict[int, m.TokenChunk] = field(default_factory=dict)
    """Chunks of the current attempt that came past :attr:`next_index` (output between still on its way: a NATS
    reconnect stores a resent chunk after later ones), by ``index``; their tokens (:attr:`held_tokens`) at most what
    the request has left to produce (``max_tokens`` - :attr:`next_index`), their log-probabilities at most what it
    asked for (a chunk with more fails the request: :meth:`RouterService._bad_logprobs`); taken in order once the gap fills
    (:meth:`RouterService._take_held`), cleared by a re-dispatch or the request's end."""
    held_order: list[int] = field(default_factory=list)
    """The indices of :attr:`held`, a heap (``heapq``): the first held chunk in O(1), each taken in O(log n)."""
    held_tokens: int = 0
    """Output tokens in :attr:`held` (the sum of their ``token_ids``)."""
    held_until: float = 0.0
    """Monotonic s by which the gap before :attr:`held` must fill (``chunk_gap_wait_s`` after the first chunk held,
    or after the last gap filled while later ones stayed held); past it the request fails (502, ``chunks_gap``)."""
    tokens: list[int] = field(default_factory=list)
    """Output token ids delivered to the client so far (in order)."""
    stale_aborted: set[tuple[str, int]] = field(default_factory=set)
    """(node, attempt) pairs told to drop a superseded attempt."""
    first_attempt: int = 0
    """The attempt it was first dispatched with: 0, or one past the last attempt of an earlier
    request with the same client ``X-Request-ID`` (a retry), so that late output, aborts and
    hand-offs of that earlier request are told apart from this one's (``_RetriedRids``)."""
    client_rid: bool = False
    """Its rid is made of the client's ``X-Request-ID`` (may come again)."""
    client_id: str | None = None
    """The client's ``X-Request-ID`` as sent (``api.parse_request_id``; its rid is ``api.request_rid`` of it):
    the response's ``x-request-id`` and body ``id``; None: the router made the rid."""
    stops: bool = False
    """It has stop strings or stop token ids: the router, not its node, may end it with ``stop``."""
    end_reason: str | None = None
    """The finish reason of an end decided outside its response (``stop`` / ``length`` served, ``error`` /
    ``abort``) while its response is still on, counted when the response ends (:meth:`RouterService._end_decided`):
    chunks queued before it may still end the response at a stop, or the response fail after it (a 500 in the
    output path, a client too slow), which the client then sees and the count says."""
    counted: str | None = None
    """The finish reason it is counted under in ``ei_router_requests_finished_total`` (once; None: not yet)."""
    unread: int = 0
    """Output tokens in :attr:`queue` its response has not taken yet (``--max-buffered-output-tokens``)."""
    slow: bool = False
    """Aborted because its client did not take its output (``_abort_slow``): counted ``slow_client_aborts`` once."""
    response_on: bool = False
    """Its stream's response (or its whole body's, :class:`_WatchedResponse`) is on: from its start until its ASGI
    call returned (its last send, for a stream the empty one after ``[DONE]``, done). An end decided meanwhile is counted then (:meth:`RouterService._close_stream`), not when its
    body ends (:meth:`RouterService._forget`): until the last send returned its client may not have it all (uvicorn
    waits for the socket to drain before it writes a message, so a send that stalls holds its predecessor unsent),
    and a stall counts the request as a too-slow-client abort (:meth:`RouterService._send_stalled`)."""
    reset: Callable[[], bool] | None = None
    """Resets its client's connection (a stream's, ``ingress.RESET_EXTENSION``) while its response is on, and says
    whether it did (a no-op once the response is complete or the connection closing); None: not a stream, or no
    such hook."""


def _error_message(resp: Response | None) -> str | None:
    """The message of our own JSON error body (``api.error_body``), or None (no response, a success, another body)."""
    if resp is None or resp.status_code < 400:
        return None
    with contextlib.suppress(Exception):
        return str(msgspec.json.decode(bytes(resp.body))["error"]["message"])
    return None


def _client_id_fields(rid: str, client_id: str | None, key: str = "client_request_id") -> dict[str, str]:
    """``{key: client_id}`` when the client's ``X-Request-ID`` as sent is not the request's rid (it was mapped
    by ``api.request_rid``: it holds characters a NATS subject token cannot, or is long), else empty: a log
    line or span of a request whose id is its own rid stays as it was."""
    return {key: client_id} if client_id is not None and client_id != rid else {}


def _peer_fields(scope: Scope) -> dict[str, str]:
    """Who sent a request, for its log lines: ``client`` (the TCP peer, ``host:port``; absent when the server gives
    none, e.g. a Unix socket) and ``key`` (the :func:`~services.router.ingress.key_id` of the API key it was let
    through with; absent on an open router, a public path, or a request refused for its key)."""
    out: dict[str, str] = {}
    peer = scope.get("client")
    if peer:
        host, port = peer[0], peer[1]
        out["client"] = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    if (kid := scope.get(KEY_ID_SCOPE_KEY)) is not None:
        out["key"] = kid
    return out


HTTP_ENDPOINTS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/cluster", "/livez", "/healthz", "/health", "/ping",
    "/metrics",
    "/version", "/tokenize", "/detokenize", "/docs", "/openapi.json",
})  # fmt: skip
"""Paths counted under their own ``endpoint`` label in ``ei_router_http_responses_total`` (:func:`endpoint_label`)."""


def endpoint_label(path: str) -> str:
    """The bounded ``endpoint`` label of a request path: one of :data:`HTTP_ENDPOINTS`, a route template
    (``/v1/models/{model}``, ``/v1/branches/{branch_id}/end``, ``/v1/branches/{branch_id}/tool-call``), else ``other``
    (a client's free-form path never becomes a series of its own)."""
    if path in HTTP_ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/branches/"):
        for tail in ("/end", "/tool-call"):
            if path.endswith(tail):
                return "/v1/branches/{branch_id}" + tail
    return "other"


def _hint_fields(hdrs: api.BranchHeaders) -> dict[str, str]:
    """The agent hints of a request for its ``request accepted`` line beside ``branch``: ``kind`` (the
    ``X-Branch-Kind`` sent, ``main`` by default; it counts on the branch's first request only), ``parent`` and
    ``agent`` when sent; empty for a request without ``X-Branch-Id`` (an ``X-Agent-Id`` alone is logged too)."""
    out: dict[str, str] = {} if hdrs.branch_id is None else {"kind": hdrs.kind}
    if hdrs.parent_branch_id is not None:
        out["parent"] = hdrs.parent_branch_id
    if hdrs.agent_id is not None:
        out["agent"] = hdrs.agent_id
    return out


@dataclass(frozen=True, slots=True)
class _RequestId:
    """A request's id, as :class:`_RequestIdHeader` read it once from its ``X-Request-ID`` header
    (:func:`request_id_of`); every handler, log line and span of the request uses this record."""

    shown: str
    """The response's ``x-request-id``: the client's valid ``X-Request-ID`` as sent, else a fresh ``uuid4().hex``."""
    rid: str
    """The request's id on the bus, the nodes and in log lines: ``api.request_rid`` of the client's id, else ``shown``."""
    client: str | None
    """The client's valid ``X-Request-ID`` as sent; None: no header, or an invalid one (``error``)."""
    error: api.ApiError | None
    """Why the client's header is invalid (a generation request answers it with this 400); None: valid or absent."""

    @classmethod
    def parse(cls, headers: Iterable[tuple[bytes, bytes]]) -> _RequestId:
        """The record of a request with ASGI ``headers`` (the first ``x-request-id`` counts, as Starlette's
        ``Request.headers.get``). O(headers) + one regex match or one ``uuid4``."""
        raw = next((v for k, v in headers if k == b"x-request-id"), None)
        client = error = None
        if raw is not None:
            try:
                client = api.parse_request_id(raw.decode("latin-1"))
            except api.ApiError as e:
                error = e
        if client is None:
            made = uuid.uuid4().hex
            return cls(made, made, None, error)
        return cls(client, api.request_rid(client), client, None)


def request_id_of(scope: Scope) -> _RequestId:
    """The request's :class:`_RequestId` as :class:`_RequestIdHeader` put it in ``scope``
    (:data:`REQUEST_ID_SCOPE_KEY`); read from the headers and put there now when the app runs without it."""
    ident = scope.get(REQUEST_ID_SCOPE_KEY)
    if ident is None:
        ident = scope[REQUEST_ID_SCOPE_KEY] = _RequestId.parse(scope["headers"])
    return ident


@dataclass(slots=True)
class _ReqTrace:
    """Spans of one request at the router (tracing on only)."""

    span: Any
    """``router.request``: HTTP ingress → response end."""
    first_ns: int = 0
    """Wall ns of the first output chunk (``router.stream_out`` starts here)."""
    p: "_Pending | None" = None
    """The request once accepted and placed (its finish reason and usage go on the span at its end)."""

    def asked(self, model: str, req: Any, max_tokens: int) -> None:
        """The request's parameters as vLLM's ``llm_request`` span has them (GenAI semconv names):
        ``gen_ai.request.model`` (the served model when the body names none), ``gen_ai.request.max_tokens``
        (the effective one), ``gen_ai.request.temperature`` / ``gen_ai.request.top_p`` when the body sets them."""
        attrs: dict[str, Any] = {"gen_ai.request.model": req.model or model, "gen_ai.response.model": model,
                                 "gen_ai.request.max_tokens": max_tokens}  # fmt: skip
        if req.temperature is not None:
            attrs["gen_ai.request.temperature"] = float(req.temperature)
        if req.top_p is not None:
            attrs["gen_ai.request.top_p"] = float(req.top_p)
        self.span.set_attributes(attrs)

    def end(self, status: int, *, error: str | None = None) -> None:
        """End ``router.request`` with HTTP status ``status`` (OTel HTTP server semconv): ``http.response.status_code``
        (and the older ``http.status_code``); from 400 on ``error.type`` = the status code; from 500 on status ERROR
        (``error``, the response's message, as its description); a 4xx leaves the status UNSET (the client's fault).
        An accepted request adds how it ended (``ei.finish_reason`` and ``gen_ai.response.finish_reasons``: ``stop``,
        ``length``, ``abort`` for a client that went away, ``error``, which is status ERROR also for a stream
        that failed after its 200; absent when it ended before a reason was decided) and its usage: ``gen_ai.usage.input_tokens`` / ``output_tokens`` (also under vLLM's
        ``prompt_tokens`` / ``completion_tokens``), ``ei.cached_tokens`` and ``gen_ai.latency.time_to_first_token``
        (router-clock seconds: simulated under ``--speedup``), and its final placement (``ei.prefill_node``,
        ``ei.decode_node`` when it has one)."""
        now = time.time_ns()
        span = self.span
        if self.first_ns:
            tracing.record("router.stream_out", span, self.first_ns, now)
        span.set_attributes({"http.status_code": status, "http.response.status_code": status})
        if status >= 400:
            span.set_attribute("error.type", str(status))
        if status >= 500:
            span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, error or f"HTTP {status}"))
        p = self.p
        if p is not None:
            reason = p.counted or p.end_reason
            if reason is not None:
                span.set_attributes({"ei.finish_reason": reason, "gen_ai.response.finish_reasons": [reason]})
                if reason == "error" and status < 500:  # a stream's failure after its 200 went out (an SSE error event)
                    span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, "the request failed after its response started"))
            prompt = 0 if p.rreq is None else p.rreq.prompt_tokens
            span.set_attribute("ei.prefill_node", p.prefill_node)  # the final placement
            if p.decode_node is not None:
                span.set_attribute("ei.decode_node", p.decode_node)
            span.set_attributes({
                "gen_ai.usage.input_tokens": prompt, "gen_ai.usage.prompt_tokens": prompt,
                "gen_ai.usage.output_tokens": p.out_tokens, "gen_ai.usage.completion_tokens": p.out_tokens,
                "ei.cached_tokens": p.cached_tokens,
            })  # fmt: skip
            if p.ttft_s is not None:
                span.set_attribute("gen_ai.latency.time_to_first_token", p.ttft_s)
        span.end(end_time=now)


@dataclass(slots=True)
class _ReqLog:
    """One request's ``--log-requests`` record at the router (filled as it is accepted and placed)."""

    rid: str | None = None
    """Set when the request is accepted (None: refused before, ``request rejected``)."""
    client_id: str | None = None
    """The client's ``X-Request-ID`` as sent (None: none); logged as ``client_request_id`` when it is not the rid."""
    prompt_tokens: int = 0
    p: _Pending | None = None
    """Set once it is placed (None: it failed before, e.g. no route)."""


class _ClientGone(Exception):
    pass


class _RetriedRids:
    """The last attempt of recently ended requests whose rid was the client's ``X-Request-ID``.

    A client that goes away and retries with the same id (a timeout, a dropped connection)
    starts a new request with the same rid while the nodes may still hold, or still be ending,
    the first one: its abort chunk came back on the retry's stream, and the retry's work, of the
    same attempt 0, could be taken for the first one's by its node. The retry's first attempt is
    one past the last one's, so every node and the router tell them apart by the attempt (the
    fencing token of issue #22). At most ``cap`` rids, oldest forgotten first. O(1) per call.

    An id not remembered here (never seen, forgotten, or seen by a predecessor: a router
    restarted under the same ``--instance`` knows none) starts at the wall clock in ms, past
    every attempt an earlier router or a forgotten request of that id used (those started at
    their own earlier ms, +1 per re-dispatch). Starting at 0 there, a retry on a restarted router
    had the attempt its predecessor's request still ran at on a node: the node dropped the retry's
    work as old, ``route.held`` called the old request in flight, and its output fed the retry.
    """

    def __init__(self, cap: int = 65_536) -> None:
        self.cap = cap
        self._last: OrderedDict[str, int] = OrderedDict()

    def next_attempt(self, rid: str, now_ms: int | None = None) -> int:
        """The first attempt of a new request ``rid``: one past its last one, and at least
        ``now_ms`` (wall ms since the Unix epoch; default the clock's now)."""
        if now_ms is None:
            now_ms = time.time_ns() // 1_000_000
        return max(self._last.get(rid, -1) + 1, now_ms)

    def ended(self, rid: str, attempt: int) -> None:
        self._last[rid] = attempt
        self._last.move_to_end(rid)
        if len(self._last) > self.cap:
            self._last.popitem(last=False)


class _SendWatch:
    """Times an ASGI ``send``: calls ``on_stall`` once when one send has waited ``limit_s`` wall seconds (uvicorn's
    send waits, with no timeout, for the socket to drain below its high-water mark: a client that keeps its
    connection open and stops reading holds it forever). One timer a response, re-armed at most every ``limit_s``
    (at the oldest send's ``since + limit_s``), so a stall is seen ``limit_s`` after its send began, to the event
    loop's resolution; a send costs two attribute writes. :meth:`close` cancels the timer (the response ended)."""

    __slots__ = ("_send", "_limit", "_on_stall", "_since", "_loop", "_timer")

    def __init__(self, send: Send, limit_s: float, on_stall: Callable[[], None]) -> None:
        self._send = send
        self._limit = limit_s
        self._on_stall = on_stall
        self._since: float | None = None
        """The loop time the send on now began; None: none on."""
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(limit_s, self._check)

    async def send(self, message: Any) -> None:
        """The wrapped ``send``, timed."""
        self._since = self._loop.time()
        try:
            await self._send(message)
        finally:
            self._since = None

    def _check(self) -> None:
        since, now = self._since, self._loop.time()
        if since is not None and now - since >= self._limit:
            self._timer = None
            self._on_stall()
            return
        self._timer = self._loop.call_at(now + self._limit if since is None else since + self._limit, self._check)

    def close(self) -> None:
        """Stop watching (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


OWN_SEND_WATCH_SCOPE_KEY = "evolving_infra.own_send_watch"
"""Set (True) in a request's scope by a handler whose response times its own sends (:class:`_SseResponse`,
:class:`_WatchedResponse`: a generation request's, which counts its request as a too-slow-client abort):
:class:`_SendStallGuard` then leaves a stall of it to that watch."""


async def _call_watched(
    call: Callable[[Scope, Receive, Send], Awaitable[None]], scope: Scope, receive: Receive, send: Send, *,
    on_close: Callable[[], None], on_stall: Callable[[], None] | None, stall_s: float,
) -> None:
    """Run the response ``call`` with its sends timed (``on_stall`` once a send has waited ``stall_s`` wall s:
    :class:`_SendWatch`; none when ``on_stall`` is None or ``stall_s`` 0), then ``on_close``, however it ended."""
    watch = _SendWatch(send, stall_s, on_stall) if on_stall is not None and stall_s > 0 else None
    try:
        await call(scope, receive, send if watch is None else watch.send)
    finally:
        if watch is not None:
            watch.close()
        on_close()


class _WatchedCall:
    """What :class:`_SseResponse` and :class:`_WatchedResponse` add to their Starlette response: ``on_close`` called
    when the response's call ends in any way (cancelled too), ``on_stall`` once when one of its sends has waited
    ``stall_s`` wall seconds (:class:`_SendWatch`, :func:`_call_watched`)."""

    def __init__(
        self, content: Any, *, on_close: Callable[[], None], on_stall: Callable[[], None] | None = None,
        stall_s: float = 0.0, **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)  # type: ignore[call-arg]  # the response class after this one in the MRO
        self._on_close = on_close
        self._on_stall = on_stall
        self._stall_s = stall_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _call_watched(super().__call__, scope, receive, send,  # type: ignore[misc]  # the response's own call
                            on_close=self._on_close, on_stall=self._on_stall, stall_s=self._stall_s)


class _SseResponse(_WatchedCall, StreamingResponse):
    """A streaming response with :class:`_WatchedCall`'s hooks: ``on_close`` covers the case where the body
    generator never started and so never ran its own ``finally``."""


class _WatchedResponse(_WatchedCall, Response):
    """A whole (non-streamed) response with :class:`_WatchedCall`'s hooks: a generation request's body, whose request
    is counted when its sends are done (``_Pending.response_on``)."""


class _SendStallGuard:
    """ASGI middleware: times every HTTP response's sends (:class:`_SendWatch`, ``stall_s`` wall s,
    ``--stream-stall-timeout-s``; 0: off) and resets the connection of one whose send waited that long
    (``ingress.RESET_EXTENSION``; counted ``slow_client_resets`` and ``http.send_stall_resets``, an info line),
    unless its handler marked the scope (:data:`OWN_SEND_WATCH_SCOPE_KEY`: a generation response, which counts its
    request as a too-slow-client abort itself). A whole response's one body send does not wait for its client, but
    uvicorn waits for the socket to drain before it writes a message: on a keep-alive connection whose client
    reads nothing, the next response's first send (behind a big body still buffered) waited with no timeout,
    holding its ASGI task and its body until the client read or left (session 52's review: a 5 MB body, then a
    2-token request pipelined on one unread socket: after 8 s a task still in ``run_asgi``). Cost: one timer a
    request, re-armed at most every ``stall_s``, and two attribute writes a send."""

    def __init__(self, app: ASGIApp, stall_s: float, counters: Counter[str], log: Any) -> None:
        self.app = app
        self.stall_s = stall_s
        self.counters = counters
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.stall_s <= 0:
            await self.app(scope, receive, send)
            return

        def stalled() -> None:
            if scope.get(OWN_SEND_WATCH_SCOPE_KEY):
                return
            reset = scope.get("extensions", {}).get(RESET_EXTENSION)
            if reset is not None and reset():
                self.counters["slow_client_resets"] += 1
                self.counters["http.send_stall_resets"] += 1
                self.log.info("response send stalled; connection reset", path=scope.get("path"), stalled_s=self.stall_s)

        watch = _SendWatch(send, self.stall_s, stalled)
        try:
            await self.app(scope, receive, watch.send)
        finally:
            watch.close()


def _conn_idle(conn: Any) -> bool:
    """Whether one of uvicorn's connections has no request on (``ingress.guarded_h11``'s ``idle``); one of another
    protocol (a websocket upgrade, with websockets installed: the router serves none) is not waited for.

    Raises:
        Exception: what ``idle`` raised (a uvicorn whose protocol renamed the attributes it reads); the caller
            (:meth:`RouterService._busy_connections`) counts it and does not wait for that connection.
    """
    idle = getattr(conn, "idle", None)
    return True if idle is None else bool(idle())


DRAIN_SERVE_FRACTION = 0.5
"""The part of ``--shutdown-grace-s``, from a drain's start, in which a router on a held socket (``--listen-fd``)
serves a request that comes on a connection already open; after it such a request gets 503 "router draining" with
``Retry-After`` and ``Connection: close``. A request served must finish before the grace's end, where the stop fails
it after its first token (the OpenAI SDK does not retry a stream then; the node's work is lost), and the router
cannot know its length beforehand: one taken in the first half has at least the other half, as long as the grace
gives the requests open at the signal, which it is sized for (the default 30 s; bench/faults.py's router-term). A
503 with ``Retry-After: 1`` costs its client one retry (the SDK's two) and about a second, and the retry connects
into the accept queue the next router takes."""


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service shell owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


_GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class _StatusCounter:
    """ASGI middleware counting responses by status code (``http_status.<code>``; generation
    requests, a ``POST`` to :data:`_GENERATE_PATHS`, also under ``requests.<code>``:
    ``ei_router_requests_total``) and, in ``by_endpoint``, every response by
    (:func:`endpoint_label`, code): the 401s of ``GET /v1/models``, ``/version`` ... too.

    Another method on a generation path (a ``GET`` answered 405, a CORS preflight ``OPTIONS``) is no
    generation request: it is in ``by_endpoint`` (``ei_router_http_responses_total``) only, as Dynamo's
    ``dynamo_frontend_requests_total`` and vLLM's request counters count generation requests only."""

    def __init__(self, app: ASGIApp, counters: Counter[str], by_endpoint: Counter[tuple[str, str]] | None = None) -> None:
        self.app = app
        self.counters = counters
        self.by_endpoint: Counter[tuple[str, str]] = by_endpoint if by_endpoint is not None else Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counters[f"http_status.{message['status']}"] += 1
                self.by_endpoint[(endpoint_label(scope["path"]), str(message["status"]))] += 1
                if scope["path"] in _GENERATE_PATHS and scope["method"] == "POST":
                    self.counters[f"requests.{message['status']}"] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


REQUEST_ID_SCOPE_KEY = "ei.request_id"
"""ASGI scope key of the request's :class:`_RequestId` (:func:`request_id_of`) as :class:`_RequestIdHeader` set
it: the response's ``x-request-id`` (the client's valid ``X-Request-ID`` as sent, else a fresh ``uuid4().hex``,
then also the rid of an accepted generation request), the rid, the client's id, why it is invalid."""


class _RequestIdHeader:
    """ASGI middleware giving every HTTP response an ``x-request-id`` header (vLLM's
    ``--enable-request-id-headers``, OpenAI's API): errors too, refusals of the API-key guard and of
    requests never accepted (bad JSON, 404, 413...) included, so that an operator finds a client's failed
    request in the router's log lines and spans, which carry the same id.

    The id is the client's ``X-Request-ID`` as sent when it is valid (:func:`api.parse_request_id`:
    1-256 visible ASCII characters), else a fresh ``uuid4().hex``; the header is read here only, once:
    its :class:`_RequestId` (the id, the rid, the client's id or why it is invalid) is put in the scope under
    :data:`REQUEST_ID_SCOPE_KEY` for the handlers, log lines and spans (the rid of an accepted request, the
    400 of an invalid header, the ``rid`` of a ``request rejected`` line). A header the app set itself is
    kept (a success's id is the same). Cost per request: one scan of the request headers and of the
    response start's headers, a regex match of a client id or one ``uuid4``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ident = scope[REQUEST_ID_SCOPE_KEY] = _RequestId.parse(scope["headers"])
        value = ident.shown.encode("ascii")  # visible ASCII only (parse_request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = message.get("headers") or []
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _NotFoundLog:
    """ASGI middleware for ``--log-requests``: a 404 on a path other than the generation paths (an unknown path,
    model, or branch) calls ``on_404(scope, error)`` once its body is sent, ``error`` the message of its
    OpenAI error body (None if it has none). The generation paths log their own refusals (``request
    rejected``). Cost: one status check per response, and the body of a 404 kept until it is sent."""

    def __init__(self, app: ASGIApp, on_404: Callable[[Scope, str | None], None]) -> None:
        self.app = app
        self.on_404 = on_404

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        body: list[bytes] | None = None

        async def watching_send(message: Message) -> None:
            nonlocal body
            if message["type"] == "http.response.start" and message["status"] == 404:
                body = []
            elif message["type"] == "http.response.body" and body is not None:
                body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    error = None
                    with contextlib.suppress(Exception):
                        error = str(msgspec.json.decode(b"".join(body))["error"]["message"])
                    body = None
                    self.on_404(scope, error)
            await send(message)

        await self.app(scope, receive, watching_send)


class _AnyCharRoute(Route):
    """A route whose ``path`` parameters may hold any character, newlines included,
    so that a bad branch id reaches the handler and gets a 400 with a reason
    instead of a 404."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path_regex = re.compile(self.path_regex.pattern, re.DOTALL)


CORS_EXPOSE_HEADERS = ("x-request-id", "x-ei-prefill-node", "x-ei-decode-node", "retry-after")
"""Response headers a browser page may read with CORS on (``Access-Control-Expose-Headers``): the router's own
(the request's id, its nodes) and the 429 / 503 retry hint. A browser shows a cross-origin page only the
CORS-safelisted response headers (``Content-Type`` and a few more) and those listed here."""


class _JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS middleware whose refused preflight (400: an origin, method or header not allowed) is the
    API's JSON error body (:func:`api.error_body`, ``param`` the request header at fault) with Starlette's CORS
    headers, not its text/plain ``Disallowed CORS origin``."""

    _HEADER_OF = {"origin": "Origin", "method": "Access-Control-Request-Method", "headers": "Access-Control-Request-Headers",
                  "private-network": "Access-Control-Request-Private-Network"}  # fmt: skip

    def preflight_response(self, request_headers: Headers) -> Response:
        r = super().preflight_response(request_headers)
        if r.status_code < 400:
            return r
        reason = bytes(r.body).decode()  # "Disallowed CORS origin, method"
        first = reason.removeprefix("Disallowed CORS ").split(",")[0].strip()
        headers = {k: v for k, v in r.headers.items() if k not in ("content-length", "content-type")}
        body = api.error_body(r.status_code, f"CORS preflight refused: {reason}", self._HEADER_OF.get(first))
        return Response(_JSON.encode(body), status_code=r.status_code, media_type="application/json", headers=headers)


def _with_cors(app: ASGIApp, cfg: RouterConfig) -> ASGIApp:
    """``app`` behind Starlette's CORS middleware when ``--allowed-origins`` is set (vLLM's flags), else as is.

    Outside the API-key guard: a browser's preflight (``OPTIONS`` with ``Origin`` and
    ``Access-Control-Request-Method``) carries no credentials, and a 401 / 429 must carry the
    CORS headers for the page to read it. The response headers of :data:`CORS_EXPOSE_HEADERS` are
    exposed (before, none: a page could not read a response's ``x-request-id``)."""
    if not cfg.allowed_origins:
        return app
    return _JsonCORSMiddleware(
        app,
        allow_origins=cfg.allowed_origins,
        allow_methods=cfg.allowed_methods,
        allow_headers=cfg.allowed_headers,
        allow_credentials=cfg.allow_credentials,
        expose_headers=CORS_EXPOSE_HEADERS,
    )


class RouterService(WatchedService):
    """HTTP ingress and request routing over NATS (see the module docstring).

    Args:
        cfg: router settings.
        bus: connected bus (partition and instance set).
        clock: the cluster's simulated clock (``now`` for the core, ``ts`` fields).
        tokenizer: a ready tokenizer; default: ``load_tokenizer(cfg.tokenizer)``.

    Raises:
        ValueError: unknown routing policy or bad policy option.
        TokenizerError: the tokenizer cannot be loaded.
    """

    def __init__(self, cfg: RouterConfig, bus: Bus, clock: SimClock, *, tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.clock = clock
        self.log = structlog.get_logger("router").bind(instance=bus.instance)
        self._parent_log = RateLimitedLog(self.log, first=5, interval_s=10.0)
        """The parent-missing warnings (:meth:`_log_parents_missing`), keyed by state: behind 2+ routers a fork's
        parent is often another router's, one warning per branch at the request rate otherwise."""
        # at debug level the route log carries every candidate's breakdown: score them all
        # (the ttft policy's profile on the cluster clock: --profile-clock wall, a torch worker's, is x --speedup)
        policy = cfg.routing_policy(ttft_breakdown=self.log.is_enabled_for(logging.DEBUG))
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
        self._tag_tokenizer: Tokenizer | None = toolcalls.keep_tags(self.tokenizer) if cfg.enable_auto_tool_choice else None
        """The output decoder of a request whose tool calls are parsed when the tokenizer marks the tags special
        (``toolcalls.keep_tags``); None: such a request decodes as any other."""
        self._templates: RequestTemplatePool | None = RequestTemplatePool() if cfg.trust_request_chat_template else None
        """Where a request's own chat template is rendered (``--trust-request-chat-template``): child processes with
        a deadline and a memory cap (``services.router.template_pool``); None: such a request gets vLLM's 400."""
        self.core = RouterCore(
            policy, block_size=cfg.block_size, fence_after=cfg.fence_after_s * cfg.speedup, decode_binding=cfg.decode_binding,
            state_clock=clock.local_now,  # node-state ages on the monotonic clock: a wall-clock step fences no node
            state_wall_per_s=clock.to_wall(1.0),  # a fenced node's reason in wall s, as /v1/cluster's fence_after_s
        )
        self.branches = BranchTable(
            cfg.max_ended_branches, ttl_s=cfg.branch_ttl_s, max_hold_s=cfg.max_tool_hold_s, max_active=cfg.max_active_branches
        )
        self.counters: Counter[str] = Counter()
        self._big_gate = asyncio.Semaphore(_HUGE_AT_ONCE)
        """Huge bodies parsed and tokenized at once (:func:`_off_loop_if_big`)."""
        self.registry = make_registry(bus)
        """Prometheus registry (``GET /metrics`` here and on ``--metrics-port``)."""
        self.registry.register(FuncCollector(lambda: router_families(self)))
        self.port: int | None = None
        app: ASGIApp = self._build_app()
        guard = IngressGuard(
            _NotFoundLog(app, lambda scope, error: self._log_rejected(request_id_of(scope), 404, error, scope, path=True)) if cfg.log_requests else app,
            load_api_keys(cfg.api_keys_file, cfg.api_keys),
            public_paths=cfg.api_key_public_paths,
            max_inflight=cfg.api_key_max_inflight,
            counters=self.counters,
            on_refused=self._refused,
        )
        self.api_keys_on = guard.enabled
        self._sighup = False
        """A SIGHUP handler (key reload) is installed on the loop (:meth:`_watch_sighup`)."""
        self._sighup_before: Any = signal.SIG_IGN
        """SIGHUP's disposition before :meth:`_watch_sighup` (the router's ``main``: ignored), put back at the stop."""
        self.ingress = guard
        """The API-key guard (its ``inflight`` per key)."""
        self.http_responses: Counter[tuple[str, str]] = Counter()
        """HTTP responses by (endpoint label, status code): ``ei_router_http_responses_total``."""
        self.app: ASGIApp = _SendStallGuard(
            _StatusCounter(_RequestIdHeader(_with_cors(guard, cfg)), self.counters, self.http_responses),
            cfg.stream_stall_timeout_s, self.counters, self.log,
        )
        self._pending: dict[str, _Pending] = {}
        self.chunk_gap_wait_s = CHUNK_GAP_WAIT_S
        """Wall s a request holds out-of-order chunks for the missing ones (:data:`CHUNK_GAP_WAIT_S`; tests shorten it)."""
        self._holding: set[str] = set()
        """rids of requests that hold out-of-order chunks (``_Pending.held``): what :meth:`_expire_held` looks at."""
        self._unread = 0
        """Output tokens queued for all pending responses, not taken yet (sum of ``_Pending.unread``;
        at most ``--max-buffered-output-tokens`` once :meth:`_shed_slow_clients` has run)."""
        self._routing: set[str] = set()
        """rids of requests being routed (waiting up to ``no_route_wait_s`` / ``bus_outage_wait_s``
        for a node), not pending yet: another request with that ``X-Request-ID`` is a duplicate too."""
        self._retried = _RetriedRids()
        """Last attempts of ended requests with a client ``X-Request-ID`` (a retry starts past them)."""
        self._kv_liveness: dict[str, m.NodeKvLiveness] = {}
        """Latest ``kv.liveness`` per node (the directory's view of each node's KV freshness)."""
        self._syncs_answered: deque[str] = deque(maxlen=8)
        """``BranchSync.sync_id`` of the directory syncs answered (the directory repeats one until it settles)."""
        self._remote = RemoteSends()
        """Requests other routers placed (counted in ``core.view``, never aborted here)."""
        self._parked: dict[str, m.WorkRequeue] = {}
        """Handed-back work that found no eligible node yet (retried on every node state)."""
        self._parked_since: dict[str, tuple[float, str]] = {}
        """rid → (``time.monotonic()`` when it was parked, the latest reason no node took it): the
        request fails with 503 after ``requeue_wait_s`` parked (:meth:`_expire_parked`)."""
        self._parked_checked: float | None = None
        """``time.monotonic()`` of the last :meth:`_expire_parked` (the time since, while the bus was
        settling, is added to every parked request's start: it does not count against the bound)."""
        self._retrying = False
        self._bus_stalled_at: float | None = None
        """``time.monotonic()`` when a PING to NATS went unanswered for :attr:`_bus_stall_s` (the server hung,
        SIGSTOP, or the path to it black-holed while the TCP connection stays up), None once a PONG came back
        (:meth:`_bus_probe_loop`)."""
        self._resumed_at: float | None = None
        """``time.monotonic()`` when a PONG came back after a stall, or when this process ran again after it did
        not run for ``fence_after_s`` (SIGSTOP, a paused VM: :meth:`_fence_loop`): the bus settles from then, as
        after a reconnect."""
        self._resumed_why = ""
        """What :attr:`_resumed_at` follows, for the not-ready reason (:meth:`_bus_unsettled`)."""
        self._froze_at: float | None = None
        """``time.monotonic()`` when this process ran again after a freeze (:meth:`_fence_loop`); unlike a PONG after a
        stall, it suspends fence checks for ``fence_after_s`` + 1 s (:meth:`_fence_unsettled`)."""
        self._witness = DeliveryWitness(cfg.fence_after_s / 3)
        """Every delivery from the bus (a node state, a PONG of :meth:`_bus_probe_loop`): a node is fenced for silence
        only once the bus delivered for ``fence_after_s`` of it (:meth:`_hold_fence`; ``services/router/silence.py``)."""
        self._held: dict[str, float] = {}
        """Nodes silent past ``fence_after_s`` whose fence the last round held back (:meth:`_hold_fence`) → wall s
        of deliveries each still needed."""
        self._fence_round_at: float | None = None
        """``time.monotonic()`` of the fence loop's last round."""
        self._fence_wait_max_s = min(0.5, cfg.fence_after_s / 2)
        """The fence loop's longest sleep (wall s): below ``fence_after_s``, so that a round later than that by
        more tells a freeze of this process (:meth:`_fence_loop`), not a long sleep."""
        self._bus_stall_s = cfg.fence_after_s / 3
        """Wall seconds a PING may wait for its PONG before the bus counts as stalled (``/healthz`` 503, parked work's
        and held chunks' bounds suspended); with a PING every half of it, a stall is seen within ``fence_after_s / 2``.
        Fencing does not follow it (a slow PONG on a loaded host is no hang): :attr:`_witness` does."""
        self._bg = BackgroundTasks(self.log, self.counters)
        """The split.get task and the tasks the router needs (fence loop, HTTP server): one of those
        that ends fails the router (:attr:`fatal`, exit 1) and makes it not ready."""
        self.fatal = self._bg.fatal
        """Set when a task the router needs ended (``shared.service`` stops it and exits non-zero)."""
        self._spawned: set[asyncio.Task[Any]] = set()
        self._server: _Server | None = None
        self._server_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._draining = False
        """A SIGTERM's drain (:meth:`drain`) runs: new requests get 503 (served in its first half, on a held socket),
        the ones taken finish."""
        self._drain_serve_until = 0.0
        """Monotonic seconds until which a drain on a held socket serves the requests on open connections
        (:data:`DRAIN_SERVE_FRACTION` of ``--shutdown-grace-s`` from its start); 503 from then."""
        self._handing_over = False
        """The router stopped accepting on a held socket (:meth:`_stop_accepting`): every request read from here is
        answered with ``Connection: close``, so that its client's next connection waits for the next router."""
        self._handling = 0
        """Generation requests taken and not yet pending or answered (reading, tokenizing, routing): a drain waits for
        them too."""
        self._have_split = False
        self._split_heard_at: float | None = None
        """``time.monotonic()`` when the planner's split last came (``split.commands``, its beacon every few seconds
        included, or the ``split.get`` answer); None: not yet. ``/v1/cluster``'s ``split_heard_s``."""
        self._split_logged: tuple[int, tuple[tuple[str, str], ...]] | None = None
        """(epoch, phases) of the split last logged as applied (a repeat of it is logged at debug)."""
        self._lookup_ok = True
        self._bad_block_size: set[str] = set()
        tv = self.tokenizer.vocab_size
        self.vocab_size = min(tv, cfg.model_vocab_size) if cfg.model_vocab_size else tv
        """Prompt and logit_bias ids must be below this: the tokenizer's vocabulary size, or the model's
        (``--model-vocab-size``) when smaller (the engine has no embedding past it: such an id was a 500)."""
        self._vocab_what = "the model's vocabulary" if cfg.model_vocab_size and self.vocab_size == cfg.model_vocab_size else "the vocabulary"
        self._served_names = tuple(dict.fromkeys((cfg.model, *cfg.model_names)))
        """The names ``GET /v1/models`` lists, in order: ``--model`` then ``--model-names`` (vLLM's
        ``--served-model-name``, one ``ModelCard`` each)."""
        self._model_names = frozenset((*self._served_names, *cfg.model_aliases))
        """Every name a request's ``model`` may give: the served names and ``--model-aliases`` (not listed)."""
        self._context_logged: int | None = None
        """The lowered ``max_model_len`` last logged (:meth:`_note_context`); None: none logged yet."""
        self._forget_after = cfg.forget_node_after_s * cfg.speedup if cfg.forget_node_after_s > 0 else math.inf
        """``--forget-node-after-s`` in router-clock seconds (``math.inf``: 0, never): a node fenced and silent longer
        has left for good: it no longer counts toward the KV cap (:meth:`largest_kv`), and once it holds no request
        it is forgotten (:meth:`_forgotten`)."""
        self._started_wall = time.time()

    # ------------------------------------------------------------------ #
    # lifecycle
    # ------------------------------------------------------------------ #

    async def start(self) -> None:
        """Subscribe, ask the planner for the split (in the background), start HTTP.

        Raises:
            OSError: if the HTTP address cannot be bound.
            RuntimeError: if uvicorn fails to start.
            TemplatePoolError: ``--trust-request-chat-template`` and its child processes cannot render templates
                (jinja2 missing or older than 3.1.6).
        """
        if self._templates is not None:
            await self._templates.start()
        await self.bus.subscribe(NODE_STATE, self._on_state)
        await self.bus.subscribe(NODE_DOWN, self._on_node_down)  # the launcher saw a node's process exit
        await self.bus.subscribe(SPLIT_COMMANDS, self._on_split)
        await self.bus.subscribe(PLANNER_MODELS, self._on_models)
        await self.bus.subscribe(REQ_OUT, self._on_chunk)
        await self.bus.subscribe(ROUTE_SENT, self._on_route_sent)  # other routers' placements
        await self.bus.subscribe(KV_LIVENESS, self._on_kv_liveness)
        await self.bus.subscribe(BRANCH_SYNC, self._on_branch_sync)  # a directory (re)started
        # another router's relayed end / tool call of a branch this one served; core NATS (an observer: a message
        # missed while disconnected leaves this table's copy as it was, the directory keeps the truth)
        await self.bus.subscribe(BRANCH_EVENTS, self._on_branch_event, reliable=False)
        # replies that concern a request go to the router that owns it (PrefillWork.router)
        await self.bus.serve(ROUTE_BIND, self._on_bind, router=self.bus.instance)
        await self.bus.serve(WORK_REQUEUE, self._on_requeue, router=self.bus.instance)
        await self.bus.serve(ROUTE_HELD, self._on_held, router=self.bus.instance)
        self._watch_sighup()
        self._bg.start(self._fetch_split(), "router-split-get", needed=False)
        self._bg.start(self._fence_loop(), "router-fence")
        self._bg.start(self._bus_probe_loop(), "router-bus-probe")
        try:
            await self._start_http()
        except BaseException:
            await self.stop()
            raise

    async def _start_http(self) -> None:
        if self.cfg.listen_fd >= 0:  # a supervisor's socket: the port stays open between this router and the next
            sock = inherited_socket(self.cfg.listen_fd)
        else:
            try:
                sock = bind_socket(self.cfg.host, self.cfg.port, blocking=False)
            except OSError as e:
                raise OSError(e.errno, f"cannot listen on {self.cfg.host}:{self.cfg.port}: {e.strerror or e}") from e
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            loop="none",
            http=guarded_h11(self.cfg.header_timeout_s, self.counters, closing=lambda: self._handing_over),
        )
        self._server = _Server(config)
        self._server_task = self._bg.start(self._server.serve(sockets=[sock]), "router-http")
        while not self._server.started:
            if self._server_task.done():
                exc = self._server_task.exception() if not self._server_task.cancelled() else None
                raise RuntimeError(f"HTTP server failed to start: {exc!r}")
            await asyncio.sleep(0.01)
        if self.cfg.port_file:
            path = Path(self.cfg.port_file)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(f"{self.port}\n")
            os.replace(tmp, path)
        self.log.info(
            "router listening",
            host=self.cfg.host,
            port=self.port,
            url=http_url(self.cfg.host, self.port),
            routing=self.core.policy.name,
            decode_routing=self.cfg.decode_routing,
            decode_rule=self.core.policy.decode_rule,
            tokenizer=self.tokenizer.name,
            model=self.cfg.model,
            block_size=self.cfg.block_size,
        )

    def _open_requests(self) -> int:
        """Generation requests taken and not ended: pending (streaming, parked, awaiting a bind) or still in their
        handler before that."""
        return len(self._pending) + self._handling

    async def drain(self, now: asyncio.Event) -> None:
        """A SIGTERM's graceful part, before :meth:`stop` (``shared.service`` calls it; SIGINT skips it): new generation
        requests get 503 "router draining" (with ``Retry-After``), ``/healthz`` 503, while the requests already taken
        run on (their chunks, ``route.bind``, hand-backs and parked retries are served as before) until none is left,
        ``--shutdown-grace-s`` wall seconds passed, or ``now`` is set (a second signal); :meth:`stop` then fails what
        is still open, as before. Returns at once when nothing is open or the grace is 0. Before, a SIGTERM failed
        every open request at once: a rolling restart of the only router lost 49 of 67 requests in flight.

        With ``--listen-fd`` (a supervisor holds the port and starts the next router on it) the drain first stops
        accepting connections (:meth:`_stop_accepting`): a client connecting meanwhile waits in the socket's accept
        queue and is served by the next router, where a 503 would have cost it one of its few retries (the OpenAI
        SDK's two) for every second of the drain and restart. A request that comes on a connection already open
        (keep-alive) in the drain's first half (:data:`DRAIN_SERVE_FRACTION`) is served, not refused (nothing else
        could serve it: the next router starts after this one exits), with ``Connection: close`` (its client's next
        request connects again, into the queue); later it gets 503 with ``Connection: close`` (it could not finish
        before the grace's end; its client's retry goes into the queue). The drain waits for those too (a connection
        with a request partly read counts: ``busy_connections`` in the log line), and at its end closes the
        connections left idle (:meth:`_close_idle`). Before, the
        drain's start closed the idle ones, some under a request already sent on them, and a busy one right after
        a response that had not said so: steady keep-alive clients had 1-5 requests reset in each run of three restarts
        (``test_sigterm_on_a_held_socket_serves_keep_alive_clients_without_an_error``)."""
        grace = self.cfg.shutdown_grace_s
        if grace <= 0 or not self._drain_busy():
            return
        t0 = time.monotonic()
        self._drain_serve_until = t0 + grace * DRAIN_SERVE_FRACTION
        self._draining = True
        handed = self._stop_accepting(close_idle=False) if self.cfg.listen_fd >= 0 else None
        self.log.info("router draining", open_requests=self._open_requests(), grace_s=grace,
                      **({} if handed is None else {"accepting": False, "connections_open": handed}))
        while self._drain_busy() and not now.is_set() and not self.fatal.is_set() and time.monotonic() - t0 < grace:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(now.wait(), timeout=0.05)
        # in the tick of the last look: a connection idle then has no request, read or partly read, to lose
        closed = self._close_idle() if handed is not None else None
        left = self._open_requests()
        busy = self._busy_connections()  # a request on none of those above: a slow body, a head partly read
        why = ("second signal" if now.is_set() else "failed" if self.fatal.is_set()
               else "grace over" if left or busy else "all done")  # fmt: skip
        self.counters["drain_left_open"] += left
        self.counters["drain_left_busy_connections"] += busy
        held = {} if closed is None else {
            "idle_connections_closed": closed, "busy_connections": busy, "served": self.counters["drain_served"],
            "refused_late": self.counters["drain_refused_late"]}  # fmt: skip
        self.log.info("router drained", why=why, open_requests=left, waited_s=round(time.monotonic() - t0, 3), **held)

    def _drain_busy(self) -> bool:
        """What a drain waits for: generation requests open and, on a held socket (``--listen-fd``), a connection with
        a request on (any path; read and not yet in its handler; its head partly read), which the drain serves."""
        return bool(self._open_requests()) or self._busy_connections() > 0

    def _busy_connections(self) -> int:
        """On a held socket (``--listen-fd``), the connections with a request on (:func:`_conn_idle` false); 0 without
        one. A connection whose state cannot be read (``idle`` raised: a uvicorn that renamed what it reads) is not
        waited for: each look counted ``drain_conn_state_errors``, the first logged; the stop's shutdown closes it as before."""
        if self.cfg.listen_fd < 0 or self._server is None:
            return 0
        busy = 0
        for conn in list(self._server.server_state.connections):
            try:
                busy += not _conn_idle(conn)
            except Exception as e:  # one connection in an odd state must not fail the drain (as _stop_accepting)
                if not self.counters["drain_conn_state_errors"]:
                    self.log.warning("connection state not readable; the drain does not wait for it", error=repr(e))
                self.counters["drain_conn_state_errors"] += 1
        return busy

    def _stop_accepting(self, *, close_idle: bool = True) -> int:
        """Stop taking connections while the socket stays open (its supervisor holds it): new ones wait in the accept
        queue for the next router, and every request read from here is answered with ``Connection: close``.
        ``close_idle`` (the stop): a connection waiting for its next request (keep-alive) is closed, so that its
        client connects again, into that queue; one with a request on finishes that request, then closes (uvicorn's
        own shutdown step, done here instead of after it). Not ``close_idle`` (the drain's start): every connection
        stays open, the request on each (if its response has not started) and the next on each are answered with
        ``Connection: close``; :meth:`_close_idle` closes those left at the drain's end. Returns the connections open."""
        server = self._server
        if server is None:
            return 0
        self._handing_over = True
        for srv in getattr(server, "servers", ()):  # none before uvicorn's startup (a stop during the start)
            srv.close()  # closes this process's copy of the listening socket only
        conns = list(server.server_state.connections)
        for conn in conns:
            try:
                if close_idle:
                    conn.shutdown()
                elif hasattr(conn, "close_after_response"):  # not a websocket upgrade's (uvicorn's own protocol)
                    conn.close_after_response()
            except Exception as e:  # one connection in an odd state must not fail the drain: uvicorn's stop retries it
                self.log.warning("connection not handed over to the next router", at="stop" if close_idle else "drain start",
                                 error=repr(e))  # fmt: skip
        return len(conns)

    def _close_idle(self) -> int:
        """Close the connections with no request on (``close_if_idle``), at a held socket's drain's end; returns how
        many. A client sending on one at this moment sees it closed (RFC 9112 §9.3.1's race, as at any keep-alive
        timeout), which is why the drain leaves them open until here rather than closing them at its start."""
        server = self._server
        if server is None:
            return 0
        closed = 0
        for conn in list(server.server_state.connections):
            try:
                closed += bool(getattr(conn, "close_if_idle", bool)())  # a websocket upgrade's connection: left to the stop
            except Exception as e:  # as _stop_accepting: the stop's own shutdown closes it
                self.log.warning("idle connection not closed at the drain's end", error=repr(e))
        return closed

    def _watch_sighup(self) -> None:
        """SIGHUP reloads the API keys (:meth:`reload_api_keys`) from the router's start on, in a process whose main
        thread runs this loop (``python -m services.router``; a router made inside another program's thread, a
        test's, leaves the signal alone).

        With ``--api-keys-reload-file`` (``up``'s routers) the keys are read from it once here, as a SIGHUP would: a
        SIGHUP that came while the router started (``up``'s SIGUSR1 forwarded to a router it had just restarted) was
        ignored (its ``main``), and that router kept its start keys, a revoked key still accepted (reviewer rr-sec2). A
        file that cannot be read or holds no key leaves the start keys, logged; this read is not counted as a reload."""
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals
            before = signal.getsignal(signal.SIGHUP)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_api_keys)
            self._sighup = True
            self._sighup_before = before if before is not None else signal.SIG_IGN  # None: set outside Python
        if self._sighup and self.cfg.api_keys_reload_file and self.api_keys_on:
            self.reload_api_keys(at_start=True)

    def reload_api_keys(self, at_start: bool = False) -> bool:
        """Read the API keys again: ``--api-keys-reload-file`` (env ``EI_API_KEYS_RELOAD_FILE``) with
        ``EI_API_KEYS_RELOAD_KEYS`` when set (``up`` sets them: its router starts from the keys in ``EI_API_KEYS``, so a
        restart does not need the file), else as at start, ``--api-keys-file`` (env ``EI_API_KEYS_FILE``) with
        ``EI_API_KEYS`` (this process's environment, which does not change). From the next request on only the keys
        read are accepted: a key taken out of the file is refused (401), one added is accepted; requests already in
        flight go on. Logged as ``API keys reloaded`` (how many; each key's :func:`~services.router.ingress.key_id`,
        never a key) and counted (``ei_router_api_key_reloads_total{result}``).

        Returns:
            True when the keys were replaced. False (a warning logged, counted as ``failed``; the keys in use stay)
            when the router has no keys file to read (keys given inline only, or an open router: a reload cannot
            turn authentication on or off), or the file cannot be read or holds no key.

        ``at_start``: the read when the SIGHUP handler is set (:meth:`_watch_sighup`): logged as ``API keys read from
        the reload file at start`` (or ``API keys not read at start; the start keys stay``), not counted.
        """
        reload_file = self.cfg.api_keys_reload_file
        path = reload_file or self.cfg.api_keys_file
        if not path or not self.api_keys_on:
            if at_start:  # nothing to read
                return False
            self.counters["api_keys.reload_failed"] += 1
            self.log.warning("API keys not reloaded: " + ("this router has no --api-keys-file or --api-keys-reload-file "
                                                          "(EI_API_KEYS_FILE, EI_API_KEYS_RELOAD_FILE) to read again"
                             if self.api_keys_on else "this router is open (no API keys): a reload does not turn keys on"))
            return False
        try:
            keys = load_api_keys(path, self.cfg.api_keys_reload_keys if reload_file else self.cfg.api_keys)
        except ApiKeyError as e:
            if at_start:
                self.log.warning("API keys not read at start; the start keys stay", error=str(e))
                return False
            self.counters["api_keys.reload_failed"] += 1
            self.log.warning("API keys not reloaded; the keys in use stay", error=str(e))
            return False
        self.ingress.set_keys(keys)
        if not at_start:
            self.counters["api_keys.reloaded"] += 1
        self.log.info("API keys read from the reload file at start" if at_start else "API keys reloaded", keys=len(keys),
                      key_ids=sorted(key_id(k) for k in keys), file=path)
        return True

    async def stop(self) -> None:
        """Refuse new requests, fail the in-flight ones (aborting them on their nodes), stop HTTP.

        On a held socket (``--listen-fd``) it first stops accepting (:meth:`_stop_accepting`, as the drain's start
        does; again after a drain, for connections accepted since): a client connecting from here waits in the
        queue for the next router. Before, the socket accepted until uvicorn's next tick (0.1 s, more on a loaded
        box) and those connections got 503 "router stopping": a SIGTERM of an idle router, 33 of 156 connections
        made until it exited."""
        self._stopping = True
        if self._templates is not None:
            await self._templates.close()
        if self._sighup:
            self._sighup = False
            with contextlib.suppress(RuntimeError):  # the loop is closing
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            # remove_signal_handler set SIG_DFL: a SIGHUP during the stop killed the router (129). Put back what was
            # there (python -m services.router: ignored, its main)
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGHUP, self._sighup_before)
        if self.cfg.listen_fd >= 0:
            self._stop_accepting()
        self._bg.stopping = True  # the HTTP server's end from here on is no failure
        for p in list(self._pending.values()):
            self._abandon(p, "router shutting down", "shutdown")
            p.queue.put_nowait(_Failure(503, "router shutting down"))
        if self._server is not None and self._server_task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._server_task), timeout=10.0)
            except (asyncio.TimeoutError, Exception):
                self._server.force_exit = True
                self._server_task.cancel()
                with contextlib.suppress(BaseException):
                    await self._server_task
        await self._bg.stop()
        if self._spawned:
            await asyncio.gather(*self._spawned, return_exceptions=True)
        if self.cfg.port_file and self._server is not None and self._server.started:
            with contextlib.suppress(OSError):
                Path(self.cfg.port_file).unlink()
        self.log.info("router stopped")

    def ready(self) -> bool:
        """HTTP up, not draining or stopping, and :meth:`_not_ready` None: the tasks the router needs (fence loop,
        HTTP server) running (a router whose fence loop died would leave dead nodes' requests waiting
        ``request_timeout_s``), NATS connected and answering PINGs, a placement possible. What its heartbeat
        says (``Heartbeat.ready``), as ``/healthz`` does: before, a SIGTERM's drain left it true while
        ``/healthz`` answered 503 "router draining"."""
        if self._draining or self._stopping:
            return False
        return self._server is not None and self._server.started and self._not_ready() is None

    def _not_ready(self) -> str | None:
        """Why the router is not ready (``/healthz``'s 503 reason), or None: a task it needs ended; NATS
        down or stalled (:meth:`_bus_unsettled` with no known end: no node state can come and no request
        can be dispatched); no placement possible. Before, only nats-py's "connected" counted: a hung
        nats-server (SIGSTOP) keeps the TCP connection up, and ``/healthz`` answered 200 through the hang
        while requests waited ``bus_outage_wait_s``.

        Settling after NATS answers again (``--fence-after-s`` + 1 s, no node fenced meanwhile) is ready
        when a placement is possible on the nodes as last heard: requests are dispatched then, and every
        router of a cluster settles at the same moment after a NATS restart, so a 503 there would take
        them all out of a load balancer for 4 s (by default) while they could serve."""
        if not self._bg.healthy():
            return f"router failing: task(s) ended: {', '.join(self._bg.dead()) or repr(self._bg.fatal_error)}"
        unsettled = self._bus_unsettled()
        if unsettled is not None and unsettled[1] == math.inf:
            return unsettled[0]
        ok, reason = self.core.view.routable(self.clock.now())
        return None if ok else reason

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """Counters (requests by status, routed per node, lookups failed, fences, aborts, ...) and gauges."""
        now = self.clock.now()
        view = self.core.view
        gauges = {
            "inflight": float(view.inflight_total),
            "pending_http": float(len(self._pending)),
            "live_nodes": float(view.live_count(now)),
            "live_prefill": float(len(view.prefill_candidates(now))),
            "live_decode": float(len(view.decode_candidates(now))),
            "fenced_nodes": float(view.fenced_count()),
            "known_nodes": float(len(view.nodes)),
            "split_epoch": float(view.epoch),
            "branches_active": float(self.branches.active_count),
            "branches_expired": float(self.branches.expired),
            "branches_resumed": float(self.branches.resumed),
            "branches_evicted": float(self.branches.evicted),
            "http_port": float(self.port or 0),
            "parked": float(len(self._parked)),
            "remote_inflight": float(len(self._remote)),
        }
        counters = dict(self.counters)
        mc, mg = self.core.metrics.export()
        counters.update(mc)
        gauges.update(mg)
        return counters, gauges

    async def _publish_abort(self, node: str, msg: m.RequestAbort, attempt: int | None = None) -> None:
        """Tell ``node`` to drop ``msg.rid`` (``work.abort``), stamped with this router's instance id
        (``RequestAbort.router``: a node drops only a request this router owns) and, when ``attempt``
        is given, that attempt (the node drops attempts <= it). The one place the router sends an
        abort; raises what ``bus.publish`` raises (a caller in the background runs it under
        :meth:`_spawn`, which counts and logs a failure)."""
        msg = msgspec.structs.replace(msg, attempt=msg.attempt if attempt is None else attempt, router=self.bus.instance)
        await self.bus.publish(WORK_ABORT, msg, node=node)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a publish in the background (used where awaiting is not possible, e.g. under cancellation).
        One that raises is counted (``publish_errors``) and logged at warning with its traceback (before:
        the exception's repr alone, which does not say where a bug raised)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._spawned.discard(t)
            if not t.cancelled() and (e := t.exception()) is not None:
                self.counters["publish_errors"] += 1
                self.log.warning("background publish failed", error=repr(e), exc_info=e)

        task.add_done_callback(done)

    # ------------------------------------------------------------------ #
    # NATS input
    # ------------------------------------------------------------------ #

    async def _on_state(self, st: m.NodeState, _subject: str) -> None:
        rec = self.core.view.nodes.get(st.node)
        known = rec.state.gpu_total_blocks if rec is not None and rec.state is not None else None
        skipped, alive = self.core.view.superseded_states, self.core.view.reported_alive
        try:
            back = self.core.apply_state(st, self.clock.now())
        except ValueError as e:
            self.counters["states_bad_node_id"] += 1
            self.log.warning("node state with an unusable node id dropped", error=str(e))
            return
        if self.core.view.reported_alive != alive:
            self.counters["node_down.reported_alive"] += 1
            self.log.error("a node.down said this node's process exited, but that process has gone on reporting for "
                           "twice --fence-after-s: the notice was wrong; the node is let back in", node=st.node,
                           pid=st.pid, boot=st.boot)  # fmt: skip
        if self.core.view.superseded_states != skipped:
            self.counters["states_superseded"] += 1
            self.bus.droplog.event("states_superseded", "node state of a superseded process skipped (a process that started "
                                   "later reports under its node id, or its supervisor saw it exit: node.down)",
                                   node=st.node, boot=st.boot)  # fmt: skip
            return
        self._witness.node_heard(st.node, time.monotonic())
        if back:
            self.counters["unfenced"] += 1
            self.log.info("node reports again; let back in", node=st.node, phase=st.phase)
        if back or known != st.gpu_total_blocks:  # a capacity seen for the first time or changed (O(nodes) only then)
            self._note_context()
        if self._parked and not self._retrying and st.accepting:
            self._retrying = True
            self._spawn(self._retry_parked())
        if st.block_size and st.block_size != self.cfg.block_size and st.node not in self._bad_block_size:
            self._bad_block_size.add(st.node)
            self.counters["block_size_mismatch"] += 1
            self.log.error(
                "BLOCK SIZE MISMATCH: node reports a different KV block size; cache matches will be wrong",
                node=st.node,
                node_block_size=st.block_size,
                router_block_size=self.cfg.block_size,
            )

    async def _on_node_down(self, msg: m.NodeDown, _subject: str) -> None:
        """The launcher (``evolving-infra up``) saw ``msg.node``'s process exit: fence the node now and re-dispatch its
        requests (:meth:`_fence`), whether or not the bus is settling (this is no silence to doubt). Before, they waited
        for ``--fence-after-s`` of state silence after a ``kill -9`` the launcher had seen within 0.2 s. Only the
        launcher may publish ``node.down.<node>`` and ``msg.node`` is the subject's node (``shared.validate``); it fences
        the node only when ``msg.pid`` is the pid of the process the router trusts for it (``NodeState.pid``;
        :meth:`~services.router.nodes.NodeLoadView.fence_exited`). Counted ``node_down.fenced``, or
        ``node_down.<why>`` when nothing was fenced (``unknown``; ``other_pid``: the node's process has another pid;
        ``later_process``: no pid known and a process that started after the exit already reports;
        ``already_fenced``; ``future``: an ``exited_ns`` past this host's wall clock by more than
        :data:`~services.router.nodes.NODE_DOWN_FUTURE_SLACK_NS`, dropped as invalid, with a warning)."""
        f, why = self.core.fence_exited(msg.node, msg.exited_ns, self.clock.now(), pid=msg.pid, wall_ns=time.time_ns())
        if f is None:
            self.counters[f"node_down.{why}"] += 1
            if why == "future":
                self.bus.droplog.event("node_down.future", "node.down notice dropped: its exit time is later than this "
                                       "host's wall clock", node=msg.node, pid=msg.pid, exited_ns=msg.exited_ns,
                                       wall_ns=time.time_ns())  # fmt: skip
                return
            self.log.info("node down notice: nothing fenced", node=msg.node, pid=msg.pid, why=why)
            return
        self.counters["node_down.fenced"] += 1
        self._note_context()  # the fenced node's capacity no longer counts, as after any fence round
        self._fence(f)

    async def _on_split(self, cmd: m.SplitCommand, _subject: str) -> None:
        if not epoch_step_ok(self.core.view.epoch, cmd.epoch):
            self.counters["splits_epoch_jump_refused"] += 1
            self.bus.droplog.event("split.epoch_jump", "split command with a forged epoch jump refused", epoch=cmd.epoch, current=self.core.view.epoch)
            return
        self._apply_split(cmd, "split.commands")

    def _apply_split(self, cmd: m.SplitCommand, source: str) -> None:
        try:
            applied = self.core.apply_split(cmd)
        except ValueError as e:
            self.counters["splits_bad_node_id"] += 1
            self.log.warning("split command with an unusable node id dropped", error=str(e), epoch=cmd.epoch)
            return
        self._split_heard_at = time.monotonic()  # a repeat (the planner's beacon) too: the planner is there
        if not applied:
            self.counters["splits_stale"] += 1
            self.log.info("stale split command ignored", epoch=cmd.epoch, current=self.core.view.epoch)
            return
        self._have_split = True
        self.counters["splits_applied"] += 1
        # the planner repeats its current split every few seconds (a beacon for late joiners): only a
        # new epoch or new phases are news (info); a repeat is logged at debug
        key = (cmd.epoch, tuple(sorted(cmd.phases.items())))
        log = self.log.info if key != self._split_logged else self.log.debug
        self._split_logged = key
        log("split applied", source=source, epoch=cmd.epoch, phases=dict(cmd.phases), reason=cmd.reason)

    async def _on_models(self, msg: m.PlannerModels, _subject: str) -> None:
        changed = self.core.apply_models(msg, self.clock.now())
        self.counters["models_received"] += 1
        if changed:
            self.counters["models_applied"] += 1
            self.log.info("planner models applied", nodes=changed, fitted_at=msg.fitted_at, frozen=msg.frozen)

    async def _on_chunk(self, chunk: m.TokenChunk, _subject: str) -> None:
        p = self._pending.get(chunk.rid)
        if chunk.node == self.bus.instance and chunk.finish_reason == "abort" and (p is None or p.done or chunk.attempt != p.attempt):
            return  # this router's own end of a request that ended parked (_publish_parked_end)
        if p is None or (chunk.router and chunk.router != self.bus.instance):
            # no request of this router's, or one with the rid of another router's (_placed_twice): not this stream's
            self._remote_chunk(chunk)
            return
        if p.done:
            self.counters["chunks_after_end"] += 1
            return
        if chunk.attempt != p.attempt:
            self._stale_chunk(p, chunk)
            return
        if chunk.node not in (p.prefill_node, p.decode_node):
            # only the nodes the request was placed on stream it: a chunk naming another
            # node (or none) must not end or fill someone's stream. ``node`` is the publisher's: the bus
            # dropped a chunk whose node is not its subject's (req.<rid>.out.<node>, shared.validate), and
            # under credentials each node may publish only its own (shared.auth)
            self.counters["chunks_wrong_node"] += 1
            self.bus.droplog.event("chunks_wrong_node", "token chunk from a node the request is not on dropped", rid=chunk.rid, node=chunk.node)
            return
        if self._logprobs_unasked(p, chunk):
            if not self._handed_off(p, chunk):  # (a node that no longer serves the stream cannot fail it)
                self._bad_logprobs(p, chunk)
            return
        if chunk.finish_reason not in ("error", "abort") and chunk.index > p.next_index:
            self._hold_chunk(p, chunk)  # output before it is still on its way, or lost
            return
        await self._take_chunk(p, chunk)
        if p.held:
            await self._take_held(p)

    async def _take_chunk(self, p: _Pending, chunk: m.TokenChunk) -> None:
        """``chunk`` (of ``p``'s current attempt, from one of its nodes, starting at or before ``p.next_index`` unless
        it fails the request) goes to ``p``'s response: the part the client has not had yet, its end, its failure."""
        if self._handed_off(p, chunk):
            return
        if chunk.node != p.prefill_node:  # output of its decode node: the hand-off reached it
            self.core.view.on_handoff(chunk.rid, chunk.node)
            p.handoff = (p.attempt, p.prefill_node)
        now = self.clock.now()
        failed = chunk.finish_reason in ("error", "abort")
        if not failed:
            skip = p.next_index - chunk.index
            if skip > 0:  # output the client already has (a duplicate, or a continuation's overlap)
                if skip >= len(chunk.token_ids) and not chunk.finished:
                    self.counters["chunks_duplicate"] += 1
                    return
                chunk = msgspec.structs.replace(
                    chunk, index=p.next_index, token_ids=chunk.token_ids[skip:], logprobs=chunk.logprobs[skip:],
                    top_ids=chunk.top_ids[skip:], top_logprobs=chunk.top_logprobs[skip:],
                )  # fmt: skip
            p.next_index = chunk.index + len(chunk.token_ids)
            p.tokens.extend(chunk.token_ids)
            if chunk.token_ids:
                gap = None if p.last_token_t is None else now - p.last_token_t
                self.core.metrics.observe_chunk_tokens(gap, len(chunk.token_ids))
                p.last_token_t = now
        p.out_tokens += len(chunk.token_ids)
        if p.tr is not None and not p.tr.first_ns:
            p.tr.first_ns = time.time_ns()
        if not p.attempt_first:
            p.attempt_first = True
            if not failed and p.first_seen:  # a re-dispatched attempt's first token: its prefill is done
                self.core.on_first_token(chunk.rid, now, first_token_at=chunk.ts or None, queue_s=chunk.queue_s)
        if not p.first_seen:
            p.first_seen = True
            p.queue_s = chunk.queue_s
            p.arrived_at, p.first_token_at = chunk.arrived_at, chunk.ts or None
            p.fetch_s, p.exposed_fetch_s = chunk.fetch_s, chunk.exposed_fetch_s
            p.cached_tokens = chunk.cached_tokens
            if chunk.fetch_s is not None:
                p.fetched_tokens, p.fetch_sources = chunk.fetched_tokens, p.plan_sources
            if not failed:
                p.ttft_s = now - p.t_in
                # the prompt's count as its usage.prompt_tokens says it (the node's, else the router's own)
                prompt = chunk.prompt_tokens or (p.rreq.prompt_tokens if p.rreq is not None else 0)
                self.core.metrics.observe_first_token(p.ttft_s, prompt, chunk.cached_tokens)
                sample = self.core.on_first_token(chunk.rid, now, first_token_at=chunk.ts or None, queue_s=chunk.queue_s)
                if sample is not None and sample.error_s is not None:
                    self.log.debug(
                        "first token",
                        rid=chunk.rid,
                        prefill=sample.node,
                        predicted_ttft_s=round(sample.predicted_s or 0.0, 6),
                        measured_ttft_s=round(sample.measured_s or 0.0, 6),
                        error_s=round(sample.error_s, 6),
                        queue_s=chunk.queue_s,
                    )
        if chunk.finished and not p.done:
            p.done = True
            if failed:
                # its client gets a 5xx either way (500 engine error, 503 a node's abort: no decode node to
                # bind): error, as the router's own 503s; abort is a client that went away, or a shutdown
                self._end_decided(p, "error")
                for node, msg in self.core.abort(chunk.rid, f"{chunk.finish_reason} on {chunk.node}", skip=chunk.node, now=now):
                    await self._publish_abort(node, msg, p.attempt)
            else:
                self.core.finish(chunk.rid, now)
                self._end_decided(p, chunk.finish_reason or "length")
                if p.ttft_s is not None:
                    self.core.metrics.observe_finished(p.ttft_s, now - p.t_in, p.out_tokens)
        p.queue.put_nowait(chunk)
        if chunk.token_ids:
            p.unread += len(chunk.token_ids)
            self._unread += len(chunk.token_ids)
            cap = self.cfg.max_buffered_output_tokens
            if cap and self._unread > cap:
                self._shed_slow_clients(cap)

    @property
    def buffered_output_tokens(self) -> int:
        """Output tokens held for responses that have not taken them yet (``ei_router_buffered_output_tokens``)."""
        return self._unread

    def _took(self, p: _Pending, item: m.TokenChunk | _Failure) -> m.TokenChunk | _Failure:
        """``item`` left ``p``'s queue for its response: its tokens are no longer unread."""
        if isinstance(item, m.TokenChunk) and item.token_ids:
            n = min(len(item.token_ids), p.unread)
            p.unread -= n
            self._unread -= n
        return item

    def _shed_slow_clients(self, cap: int) -> None:
        """Output unread by clients is above ``cap`` tokens (``--max-buffered-output-tokens``): abort the request
        with the most unread tokens until it is not (O(pending) per request aborted). Its queued output is
        dropped, its nodes are told to drop it (as for a client that went away), its response gets a 503
        error event 'client too slow: N output tokens unread' (what it has not read yet still comes first)
        and its connection is reset if it has not taken that within ``--slow-client-grace-s``; counted
        ``slow_client_aborts`` (``ei_router_slow_client_aborts_total``) and finished as ``abort``."""
        while self._unread > cap:
            victim = max(self._pending.values(), key=lambda q: q.unread, default=None)
            if victim is None or victim.unread == 0:
                return  # (cannot happen: the sum is the pending requests' unread)
            n = victim.unread
            why = (f"client too slow: {n} output tokens unread (the router holds at most {cap} unread across its "
                   "requests: --max-buffered-output-tokens); request aborted")
            self._abort_slow(victim, why, unread_tokens=n, cap_tokens=cap)
            if victim.reset is not None:
                asyncio.get_running_loop().call_later(self.cfg.slow_client_grace_s, self._reset_slow_client, victim)

    def _abort_slow(self, p: _Pending, why: str, **fields: Any) -> None:
        """``p``'s client does not take its output: drop its queued output, tell its nodes to drop it (as for a client
        that went away), queue the 503 error event ``why`` for its response; counted ``slow_client_aborts`` and
        finished ``abort`` (once: ``p.slow``)."""
        p.slow = True
        n = p.unread
        while not p.queue.empty():
            p.queue.get_nowait()
        self._unread -= n
        p.unread = 0
        self.counters["slow_client_aborts"] += 1
        self.log.warning("client too slow; request aborted", rid=p.rid, **fields)
        self._failed_after_end(p, "client too slow", "slow_client")
        p.queue.put_nowait(_Failure(503, why))

    def _send_stalled(self, p: _Pending) -> None:
        """One send of ``p``'s stream has waited ``--stream-stall-timeout-s`` for its client's socket to drain (a
        client that keeps the connection open and reads nothing, or under ~48 KiB in that time: uvicorn resumes a
        paused send once its 64 KiB write buffer is under 16 KiB; :class:`_SendWatch`): abort it as too slow
        (:meth:`_abort_slow`), whatever the output unread across requests (``--max-buffered-output-tokens`` acts on
        the sum only), and reset its connection at once: the timeout has passed, and the error event cannot reach a
        client that does not read. Before, such a stream never ended while its client held the connection: its
        request stayed pending, its output held, its branch never idle. Its own bound, not ``--slow-client-grace-s``
        (which a send once shared: a client reading steadily at under ~4.8 KB/s was cut after that grace's 10 s, and
        a short grace raced the cap's own abort). One aborted at the cap already keeps the grace its abort gave it
        (:meth:`_shed_slow_clients`).

        A stall on any send before the response is complete is such an abort, the usage chunk's, ``[DONE]``'s and the
        empty last send's too (its request's end not counted until then: ``_Pending.response_on``): uvicorn (0.55,
        ``h11_impl`` ``send``) waits for the socket to drain before it writes a message, so the message before the
        stalled one (for a stall after the finish chunk, the finish chunk or what follows it) is still in the write
        buffer, and the reset drops it: its client has a cut stream. Only a request that had already failed (a
        timeout, a fence, its node's error: its error event is what waits) is not counted again (``slow_client_aborts``
        counts requests that ended, or would have, because of their client): its connection is reset
        (``slow_client_resets``) and it stays counted once as it failed (``error``). One the router ended at a stop
        string or stop token id was counted ``finished.stop`` at the match (:meth:`_end_at_stop`) and stays so,
        counted once: it then shows ``finished.stop`` and one ``slow_client_aborts``, its client cut. Before
        (2c62a96), a stall after the finish chunk was handed to the connection only reset it and counted the request
        as it ended (``finished.length``), although its client never got that chunk."""
        if p.slow:
            return
        failed = (p.counted or p.end_reason) in ("error", "abort") and p.done
        if failed:
            self.log.info("stream send stalled once its request had failed; connection reset", rid=p.rid,
                          stalled_s=self.cfg.stream_stall_timeout_s, finish_reason=p.counted or p.end_reason)
            self._reset_slow_client(p)
            return
        stall = self.cfg.stream_stall_timeout_s
        self._abort_slow(
            p, f"client too slow: a send waited {stall:g} s for the client to read (--stream-stall-timeout-s); "
            "request aborted", stalled_s=stall, unread_tokens=p.unread,
        )  # fmt: skip
        self._reset_slow_client(p)

    def _reset_slow_client(self, p: _Pending) -> None:
        """``--slow-client-grace-s`` after ``p`` was aborted at the cap, or at once after its send stalled: reset its connection unless its
        response ended (its client read the error event): the hook resets only while its own request's response
        is on (9ff3e38). Before, a ``_Pending.http_closed`` flag, set when the response's ASGI call returned, was
        checked here too: it stopped no reset the hook would do (by then the response is complete, or uvicorn
        closes the connection before any other callback runs)."""
        if p.reset is not None and p.reset():
            self.counters["slow_client_resets"] += 1

    def _logprobs_unasked(self, p: _Pending, chunk: m.TokenChunk) -> bool:
        """Whether ``chunk`` carries more log-probabilities than ``p`` asked for (``Sampling.logprobs`` of its request:
        None, none at all; k, at most k top entries a token; fewer is fine, a node's vocabulary may be smaller); then
        it is malformed and fails the request (:meth:`_bad_logprobs`), whether it would be taken or held. So a held
        chunk's log-probabilities are bounded by what the request asked (with its tokens by ``max_tokens``,
        :meth:`_hold_chunk`), not only by message validation (one a token id, at most ``MAX_TOP_LOGPROBS`` = 20 top
        entries, ``shared.validate``). O(tokens of the chunk); changes nothing."""
        if not (chunk.logprobs or chunk.top_ids or chunk.top_logprobs):
            return False
        k = self._asked_logprobs(p)
        return k is None or any(len(x) > k for x in chunk.top_ids) or any(len(x) > k for x in chunk.top_logprobs)

    @staticmethod
    def _asked_logprobs(p: _Pending) -> int | None:
        """The top log-probabilities a token ``p`` asked for (its ``Sampling.logprobs``): None, none at all."""
        sp = p.rreq.sampling if p.rreq is not None else None
        return None if sp is None else sp.logprobs

    def _bad_logprobs(self, p: _Pending, chunk: m.TokenChunk) -> None:
        """``chunk`` (of ``p``'s current attempt, from a node that serves its stream) carries more log-probabilities
        than ``p`` asked for (:meth:`_logprobs_unasked`): its node is broken or lying, and what it sends next cannot be
        trusted to fill the stream. The request fails at once, as for a gap (:meth:`_chunk_gap`): its nodes are told
        to drop it, its response gets a 502 error (what it has read stays its own; a stream's error event) 'malformed
        output from node X: a token chunk at index i carries N log-probabilities, up to M top entries a token; the
        request asked none | asked k; request failed', counted ``chunks_bad_logprobs`` (and ``aborts.bad_logprobs``),
        logged at warning, finished as ``error``. Before, from 90e76c0 the chunk was dropped: when it was the
        stream's last no later chunk was held, so no gap wait began and its client waited ``request_timeout_s``
        (600 s) for a 504 (reviewer rr-sec); before 90e76c0 one in order was taken (its response cut each top list
        to k) and one held kept all its entries until the gap filled."""
        k = self._asked_logprobs(p)
        most = max([len(x) for x in chunk.top_ids] + [len(x) for x in chunk.top_logprobs], default=0)
        asked = "none" if k is None else str(k)
        why = (f"malformed output from node {chunk.node}: a token chunk at index {chunk.index} carries "
               f"{len(chunk.logprobs)} log-probabilities, up to {most} top entries a token; the request asked {asked}; "
               f"request failed")  # fmt: skip
        self.counters["chunks_bad_logprobs"] += 1
        self.log.warning("token chunk with more log-probabilities than its request asked for; request failed",
                         rid=p.rid, node=chunk.node, index=chunk.index, asked=k, logprobs=len(chunk.logprobs),
                         top_entries=most)  # fmt: skip
        self._abandon(p, f"malformed output from {chunk.node}", "bad_logprobs")
        p.queue.put_nowait(_Failure(502, why))

    def _handed_off(self, p: _Pending, chunk: m.TokenChunk) -> bool:
        """Whether ``chunk`` (of ``p``'s current attempt, from its prefill node P or its decode node D: :meth:`_on_chunk`
        checked) comes from a node that no longer serves the stream; then it is dropped and counted (and in the drop
        log). The rule, for the current attempt:

        * until the prefill → decode hand-off reached a decode node, P and D publish (P its first token or its failure;
          D's output is held until P's first token is in, :meth:`_hold_chunk`);
        * once it did (``p.handoff``: D's output came, or D handed the decode work back, ``work.requeue``: it had it),
          P no longer, once the attempt's first chunk is in (``p.attempt_first``: P's first token, which a hand-back
          may overtake, another publisher on another path, is still taken): P handed the request off and holds
          nothing of it, so only a forged chunk (its key publishing on its own ``req.<rid>.out.<node>``) comes, and
          must not end, fill or take an index of the stream. Counted ``chunks_prefill_after_handoff``;
        * a decode node that handed the decode work back (``p.handed_back``) forgot it: its chunks are dropped while
          the work is parked (it is still recorded as D then), counted ``chunks_wrong_node``, as they are once the
          work is bound to another node (:meth:`_on_chunk`: not on the request). The node bound again serves the
          stream from its binding (also when it is P: P's chunks are then its decode output).

        A collocated request (P == D) never has a hand-off. Before, P was dropped only once the current D's output
        came: after a hand-back, a forged chunk of P (or, while parked, of the node that handed it back) ended the
        stream until the new decode node's first output. Used by :meth:`_take_chunk` and :meth:`_hold_chunk` alike."""
        a = p.attempt
        if p.handoff != (a, p.prefill_node):
            return False
        if chunk.node == p.decode_node:
            if p.handed_back != (a, chunk.node):
                return False  # the decode node that serves the stream
            self.counters["chunks_wrong_node"] += 1
            self.bus.droplog.event("chunks_wrong_node", "token chunk from the decode node that handed the request back "
                                   "dropped", rid=chunk.rid, node=chunk.node)  # fmt: skip
            return True
        if not p.attempt_first:
            return False  # P's first token, overtaken by the hand-back
        self.counters["chunks_prefill_after_handoff"] += 1
        self.bus.droplog.event("chunks_prefill_after_handoff", "token chunk from the prefill node of a request "
                               "its decode node serves dropped", rid=chunk.rid, node=chunk.node)  # fmt: skip
        return True

    def _hold_chunk(self, p: _Pending, chunk: m.TokenChunk) -> None:
        """``chunk`` starts past ``p.next_index``: the output between is not here. It is held (``p.held``, counted
        ``chunks_held``) until the missing chunks come (:meth:`_take_held` then sends them all in order; a finishing
        chunk held ends the request only then), for ``chunk_gap_wait_s`` at most (:data:`CHUNK_GAP_WAIT_S`: after a
        NATS reconnect a chunk resent from the bus's window is stored after the ones published during the outage,
        reviewer rr-gap). Past that wait (checked here, unless this router's own bus settles, and by
        :meth:`_expire_held` each fence round) the request fails (:meth:`_chunk_gap`). A second chunk at a held index
        is a duplicate (``chunks_duplicate``). What is held is bounded by tokens, not chunks (an outage at 100 tok/s
        with one token a chunk brings 700 chunks in the wait; reviewer rr-gapfix): a chunk that ends past the
        request's ``max_tokens`` (no node may produce it), or whose tokens with those held pass what the request has
        left (``max_tokens`` - ``p.next_index``: held chunks that overlap), is dropped (``chunks_over_max_tokens``), so
        a request's delivered and held tokens together stay within its ``max_tokens``. Held tokens are not counted
        in ``--max-buffered-output-tokens`` (no client is slow: a bus outage holds them for every request on a node at
        once, and that cap would shed those requests). A chunk of a node that no longer serves the
        stream (the prefill node after the hand-off, a decode node that handed the work back) is dropped
        (:meth:`_handed_off`, the rule :meth:`_take_chunk` applies), so it cannot take the index of the decode node's
        chunk."""
        mono = time.monotonic()
        if p.held and mono > p.held_until and not self._bus_settling():
            self._chunk_gap(p, p.held[p.held_order[0]])
            return
        if self._handed_off(p, chunk):
            return
        if chunk.index in p.held:
            self.counters["chunks_duplicate"] += 1
            return
        limit = p.rreq.max_tokens if p.rreq is not None else 0
        n = len(chunk.token_ids)
        if chunk.index + n > limit or p.held_tokens + n > limit - p.next_index:
            self.counters["chunks_over_max_tokens"] += 1
            self.bus.droplog.event("chunks_over_max_tokens", "token chunk past the request's max_tokens dropped",
                                   rid=chunk.rid, node=chunk.node, index=chunk.index, tokens=n, max_tokens=limit,
                                   held_tokens=p.held_tokens)  # fmt: skip
            return
        if not p.held:
            p.held_until = mono + self.chunk_gap_wait_s
            self._holding.add(p.rid)
            self.log.debug("token chunk out of order held for the output before it", rid=p.rid, node=chunk.node,
                           next_index=p.next_index, chunk_index=chunk.index, wait_s=self.chunk_gap_wait_s)  # fmt: skip
        p.held[chunk.index] = chunk
        heapq.heappush(p.held_order, chunk.index)
        p.held_tokens += n
        self.counters["chunks_held"] += 1

    async def _take_held(self, p: _Pending) -> None:
        """Send ``p``'s held chunks that now start at or before ``p.next_index``, in index order (an overlap is
        trimmed, a chunk the client has whole is a duplicate, as for any chunk); what stays held past a new gap waits
        ``chunk_gap_wait_s`` afresh (output came, so the stream moves). Nothing is held once ``p`` ended. O(log n)
        a chunk taken (n held)."""
        moved = False
        while p.held and not p.done:
            first = p.held_order[0]
            if first > p.next_index:
                break
            moved = True
            heapq.heappop(p.held_order)
            chunk = p.held.pop(first)
            p.held_tokens -= len(chunk.token_ids)
            await self._take_chunk(p, chunk)
        if p.done or not p.held:
            self._drop_held(p)
        elif moved:
            p.held_until = time.monotonic() + self.chunk_gap_wait_s

    def _drop_held(self, p: _Pending) -> None:
        """Forget ``p``'s held chunks (a re-dispatch: they are of the old attempt; or the request ended)."""
        p.held.clear()
        p.held_order.clear()
        p.held_tokens = 0
        self._holding.discard(p.rid)

    def _expire_held(self, mono: float, *, settling: bool = False) -> None:
        """Fail the requests whose held chunks waited past ``chunk_gap_wait_s`` (``mono``: monotonic s now) for the
        output before them (each fence round, so a request with no later chunk coming fails too, at most a round
        late: 0.5 s); forget the held chunks of requests that ended. O(requests holding). ``settling``: this router's
        own NATS connection is down, stalled or just back (:meth:`_bus_settling`): the missing chunks cannot reach it
        yet, so each wait runs ``chunk_gap_wait_s`` from now at least (the request's own timeout still bounds it)."""
        for rid in list(self._holding):
            p = self._pending.get(rid)
            if p is None or p.done or not p.held:
                if p is not None:
                    self._drop_held(p)
                self._holding.discard(rid)
            elif settling:
                p.held_until = max(p.held_until, mono + self.chunk_gap_wait_s)
            elif mono > p.held_until:
                self._chunk_gap(p, p.held[p.held_order[0]])

    def _chunk_gap(self, p: _Pending, chunk: m.TokenChunk) -> None:
        """The output of ``p`` between ``p.next_index`` and ``chunk`` (its first held chunk) never came within
        ``chunk_gap_wait_s`` (longer while this router's own bus settled: :meth:`_expire_held`): a reliable message
        lost (dropped by a bus past its bounds, a core-NATS message on a server without JetStream, a resend that
        waited past the wait). The request fails: its nodes are told to drop it, its response gets a 502 error (what
        it has read stays its own; a stream's error event) 'output lost: tokens a..b of the request's output never
        arrived within 7 s (N later chunks held, the next from node X starts at b + 1); request failed', counted
        ``chunks_gap`` (``ei_router_chunks_gap_total``; and ``aborts.chunks_gap``), finished as ``error``. Before
        4da5861 the later tokens were appended: the client got HTTP 200 with tokens missing (reviewer rr-bus2);
        before the hold, chunk k + 1 stored ahead of a resent chunk k after a reconnect failed it at once (rr-gap);
        before the token bound, 257 chunks held failed it too, though an outage's chunk k was on its way (rr-gapfix)."""
        why = (f"output lost: tokens {p.next_index}..{chunk.index - 1} of the request's output never arrived within "
               f"{self.chunk_gap_wait_s:g} s ({len(p.held)} later chunks held, the next from node {chunk.node} starts at "
               f"{chunk.index}); request failed")  # fmt: skip
        self.counters["chunks_gap"] += 1
        self.log.warning("token chunk index gap; request failed", rid=p.rid, node=chunk.node, next_index=p.next_index,
                         chunk_index=chunk.index, held=len(p.held), wait_s=self.chunk_gap_wait_s)  # fmt: skip
        self._drop_held(p)
        self._abandon(p, "output lost", "chunks_gap")
        p.queue.put_nowait(_Failure(502, why))

    def _stale_chunk(self, p: _Pending, chunk: m.TokenChunk) -> None:
        """A chunk of another attempt than ``p``'s current one (a fenced node that came back):
        dropped, and the node told once to drop that attempt (never double-served)."""
        self.counters["chunks_stale_attempt"] += 1
        key = (chunk.node, chunk.attempt)
        if chunk.attempt < p.attempt and not chunk.finished and chunk.node and key not in p.stale_aborted:
            p.stale_aborted.add(key)
            self.counters["aborts.superseded"] += 1
            self.log.info("output of a superseded attempt dropped; node told to stop", rid=p.rid, node=chunk.node, attempt=chunk.attempt)
            abort = m.RequestAbort(rid=p.rid, reason=f"attempt {chunk.attempt} superseded by attempt {p.attempt}")
            self._spawn(self._publish_abort(chunk.node, abort, chunk.attempt))

    # -- decode binding at prefill start, work handed back ------------------ #

    async def _on_bind(self, req: m.DecodeBindRequest, _subject: str) -> m.DecodeBindReply:
        """``route.bind``: the prefill of ``req.rid`` starts on ``req.prefill_node``; choose its decode node."""
        p = self._pending.get(req.rid)
        if p is None or p.done:
            self.counters["bind.not_pending"] += 1
            return m.DecodeBindReply(rid=req.rid, reason="request is not pending at the router")
        if req.attempt != p.attempt:
            self.counters["bind.stale_attempt"] += 1
            return m.DecodeBindReply(rid=req.rid, reason=f"stale attempt {req.attempt} (the router's is {p.attempt})")
        if p.decode_node is not None and p.prefill_node == req.prefill_node:
            # already bound: the worker asks again because our reply was lost (a NATS restart)
            self.counters["bind.repeated"] += 1
            return m.DecodeBindReply(rid=req.rid, decode_node=p.decode_node)
        out = self.core.bind_decode(req.rid, self.clock.now(), prefill_node=req.prefill_node)
        if isinstance(out, NoRoute):
            self.counters["bind.no_route"] += 1
            return m.DecodeBindReply(rid=req.rid, reason=out.reason)
        await self._bound(p, out)
        if tracing.ENABLED:  # the bus's ``router route.bind`` server span, child of the worker's
            tracing.trace.get_current_span().set_attribute("ei.decode_node", out.node)
        self.counters["bind.ok"] += 1
        return m.DecodeBindReply(rid=req.rid, decode_node=out.node)

    async def _bound(self, p: _Pending, out: DecodeBinding) -> None:
        p.decode_node = out.node
        self._announce(p)
        for placed in out.placed:
            await self._publish_placed(placed)
        self.counters[f"routed.decode.{out.node}"] += 1
        if self.log.is_enabled_for(logging.DEBUG):
            self.log.debug("decode bound", rid=p.rid, prefill=out.prefill_node, decode=out.node, decode_rule=self.core.policy.decode_rule,
                           loads=out.decode.loads)

    async def _on_held(self, q: m.HeldQuery, _subject: str) -> m.HeldReply:
        """``route.held``: a node asks which of the requests it holds for this router are no longer
        in flight here (finished, failed, aborted, another attempt, or never this router's: a
        restarted router has none of its predecessor's); it drops those (no client reads them).
        A peer router's query (``HeldQuery.peer``: is an id it counts as this router's still in flight?) is
        answered the same, but counted ``held.peer_dropped`` and logged naming the router, not as a node's."""
        dropped = []
        for rid, attempt in zip(q.rids, q.attempts):
            p = self._pending.get(rid)
            if p is None or p.done or p.attempt != attempt:
                dropped.append(rid)
        if dropped and q.peer:  # another router asking about an id (_duplicate_answer): no node drops anything
            self.counters["held.peer_dropped"] += len(dropped)
            self.log.info("router asked about request ids no longer in flight here", router=q.node, requests=len(dropped))
        elif dropped:
            self.counters["held.dropped"] += len(dropped)
            self.log.info("node holds requests no longer in flight here; it drops them", node=q.node, requests=len(dropped))
        return m.HeldReply(dropped=dropped)

    async def _on_requeue(self, msg: m.WorkRequeue, _subject: str) -> m.WorkRequeueReply:
        """``work.requeue``: a node hands back work it will not serve (phase switch).

        Exactly one node serves each request: the handing-back node has forgotten
        it; the router accepts it only while it is pending and placed on that node
        (for that role), then places it on exactly one other node — or parks it
        until a node is eligible. A duplicate or stale hand-back is refused.

        Always answered: taking the work back raising (a bug, a policy hook's failure) is answered
        with a refusal naming the error, and the request is failed here (:meth:`_take_back_failed`),
        since the node drops work the router refuses. Before, the exception escaped to the bus, which
        sent no reply: the node asked again until its ``--requeue-timeout-s``, and a repeat found the
        placement already forgotten ("not placed on"), so the node dropped the work while the client
        waited ``request_timeout_s`` (600 s) for output nobody would send."""
        try:
            return self._take_back(msg)
        except Exception as e:
            return self._take_back_failed(msg, e)

    def _take_back(self, msg: m.WorkRequeue) -> m.WorkRequeueReply:
        """:meth:`_on_requeue`'s check and hand-over (see there). The core's bookkeeping of the old
        placement (``RouterCore.requeue`` / ``NodeLoadView.on_handoff``) raising does not refuse the work:
        the node has forgotten it, so it is placed again all the same (a placement that then fails fails
        the request with 503, :meth:`_place_again_or_fail`); counted ``requeue.bookkeeping_errors`` and
        logged at error with the traceback."""
        rid = msg.rid
        p = self._pending.get(rid)
        if p is None or p.done:
            self.counters["requeue.not_pending"] += 1
            return m.WorkRequeueReply(rid=rid, reason="request is not pending at the router")
        placement = self.core.view.placement(rid)
        if (msg.prefill is None) == (msg.decode is None):
            self.counters["requeue.malformed"] += 1
            return m.WorkRequeueReply(rid=rid, reason="exactly one of prefill / decode must be set")
        role = "prefill" if msg.prefill is not None else "decode"
        if msg.attempt != p.attempt:
            self.counters["requeue.stale_attempt"] += 1
            return m.WorkRequeueReply(rid=rid, reason=f"stale attempt {msg.attempt} (the router's is {p.attempt})")
        if placement is None or placement[0 if role == "prefill" else 1] != msg.node:
            self.counters["requeue.stale"] += 1
            return m.WorkRequeueReply(rid=rid, reason=f"request is not placed on {msg.node} for {role}")
        self.counters[f"requeue.{role}"] += 1
        try:
            if role == "prefill":
                self.core.requeue(rid, self.clock.now())
            else:  # the decode node had the hand-off: the router holds it now, not the prefill node
                p.handoff, p.handed_back = (p.attempt, p.prefill_node), (p.attempt, msg.node)  # _handed_off
                self.core.view.on_handoff(rid, msg.node)
        except Exception as e:
            self.counters["requeue.bookkeeping_errors"] += 1
            self.log.error(
                "work handed back: forgetting its old placement failed; placing it again all the same",
                rid=rid, node=msg.node, role=role, reason=msg.reason, error=repr(e), exc_info=e,
            )  # fmt: skip
        self.log.info("work handed back", rid=rid, node=msg.node, role=role, reason=msg.reason)
        self._spawn(self._place_again_or_fail(msg))
        return m.WorkRequeueReply(rid=rid, accepted=True)

    def _take_back_failed(self, msg: m.WorkRequeue, e: Exception) -> m.WorkRequeueReply:
        """Taking handed-back ``msg`` raised ``e``: the work is refused (the reply names ``e``; the node
        drops it) and its request, when still pending at that attempt, is failed here: 503 naming the
        error, its nodes told to drop it. Counted ``requeue.errors``, logged at error with the traceback.
        Never raises (a failure while failing the request is logged too): the node always gets its answer."""
        self.counters["requeue.errors"] += 1
        self.log.error(
            "taking handed-back work failed; refused, request failed", rid=msg.rid, node=msg.node, reason=msg.reason,
            error=repr(e), exc_info=e,
        )  # fmt: skip
        err = repr(e)[:300]  # the reply's reason is bounded (shared/validate.py)
        why = f"node {msg.node} handed it back ({msg.reason[:200]}) and the router failed to take it: {err}; request failed"
        p = self._pending.get(msg.rid)
        if p is not None and not p.done and p.attempt == msg.attempt:
            try:
                self._abandon(p, why, "requeue_failed")
            except Exception as e2:
                self.log.error("failing a request whose hand-back failed raised", rid=msg.rid, error=repr(e2), exc_info=e2)
                p.done = True
            p.queue.put_nowait(_Failure(503, why))
        return m.WorkRequeueReply(rid=msg.rid, reason=f"the router failed to take the request back: {err}")

    async def _place_again_or_fail(self, msg: m.WorkRequeue) -> bool:
        """:meth:`_place_again`, run in the background (a hand-back, a re-dispatch, a parked retry).
        When it raises (NATS refusing the work's publish, a bug), the request is failed: 503 naming
        the error, its nodes told to drop it, its work no longer parked; counted
        (``requeue.place_errors``) and logged at error with the traceback. Before, the exception was
        counted as a failed publish (``publish_errors``) and the request, routed in the core to a
        node that never got its work, waited ``request_timeout_s`` (600 s) for output. Returns
        :meth:`_place_again`'s answer, or True once the request is failed so."""
        try:
            return await self._place_again(msg)
        except Exception as e:
            self.counters["requeue.place_errors"] += 1
            self.log.error("placing work again failed; request failed", rid=msg.rid, reason=msg.reason, error=repr(e), exc_info=e)
            if self._parked.get(msg.rid) is msg:
                self._unpark(msg.rid)
            p = self._pending.get(msg.rid)
            if p is not None and not p.done and p.attempt == msg.attempt:
                why = f"its work could not be placed again ({msg.reason}): {e!r}; request failed"
                self._abandon(p, why, "dispatch_failed")
                p.queue.put_nowait(_Failure(503, why))
            return True

    async def _place_again(self, msg: m.WorkRequeue) -> bool:
        """Route handed-back work to one eligible node; park it when there is none. True if placed."""
        rid = msg.rid
        p = self._pending.get(rid)
        if p is None or p.done or msg.attempt != p.attempt:
            # gone, or another attempt of the rid is current (a client's retry with the same X-Request-ID
            # after this one ended): this work is of no request now
            if self._parked.get(rid) is msg:
                self._unpark(rid)
            return True
        now = self.clock.now()
        tr = p.tr  # the request's trace: the new attempt's lookup, route and work stay in it
        headers = None if tr is None else tracing.inject(tr.span)
        if msg.prefill is not None:
            w = msg.prefill
            rreq = RouteRequest(
                rid=rid,
                prompt_tokens=w.prompt_tokens,
                block_hashes=w.block_hashes,
                max_tokens=w.max_tokens,
                token_ids=w.token_ids,
                branch_id=w.branch_id,
                ignore_eos=w.ignore_eos,
                sampling=w.sampling,
            )
            lookup, status = await self._lookup(list(w.block_hashes), tr, rid) if w.block_hashes else (None, "skipped")
            if p.done or self._pending.get(rid) is not p:
                return True
            out = self.core.route(rreq, lookup, self.clock.now())
            if tr is not None:
                tracing.record("router.route", tr.span, time.time_ns(), time.time_ns(), {
                    "ei.attempt": p.attempt, "ei.reason": msg.reason, "ei.lookup": status,
                    **({"ei.no_route": out.reason} if isinstance(out, NoRoute) else {"ei.prefill_node": out.prefill.node}),
                })  # fmt: skip
            if isinstance(out, NoRoute):
                self._park(msg, out.reason)
                return False
            self._log_route(rreq, out, status)
            p.prefill_node, p.decode_node, p.predicted_ttft_s = out.prefill.node, out.decode_node, out.predicted_ttft_s
            for placed in out.placed:
                await self._publish_placed(placed)
            await self.bus.publish(WORK_PREFILL, self._work(p, out), node=out.prefill.node, headers=headers)
            self.counters[f"routed.prefill.{out.prefill.node}"] += 1
            self.counters["redispatch.placed" if msg.reason.startswith("redispatch:") else "requeue.rerouted"] += 1
        else:
            d = msg.decode
            assert d is not None
            rreq = RouteRequest(rid=rid, prompt_tokens=d.prompt_tokens, block_hashes=d.block_hashes, max_tokens=d.max_tokens, branch_id=d.branch_id)
            bound = self.core.bind_decode(rid, now, req=rreq, exclude=msg.node)
            if isinstance(bound, NoRoute):
                self._park(msg, bound.reason)
                return False
            await self._bound(p, bound)
            await self.bus.publish(
                WORK_DECODE, msgspec.structs.replace(d, attempt=p.attempt, router=self.bus.instance), node=bound.node, headers=headers
            )
            self.counters["requeue.rebound"] += 1
        self._unpark(rid)
        return True

    def _park(self, msg: m.WorkRequeue, reason: str) -> None:
        """No node can take handed-back ``msg`` now (``reason``): keep it, retried at every node state,
        for at most ``requeue_wait_s`` (then :meth:`_expire_parked` fails the request)."""
        since = self._parked_since.get(msg.rid)
        if since is None:
            self.counters["requeue.parked"] += 1
            self.log.info("handed-back work parked until a node is eligible", rid=msg.rid, reason=reason, wait_s=self.cfg.requeue_wait_s)
        self._parked[msg.rid] = msg
        self._parked_since[msg.rid] = (time.monotonic() if since is None else since[0], reason)
        if self.cfg.requeue_wait_s == 0:
            self._expire_parked(time.monotonic())

    def _unpark(self, rid: str) -> None:
        """``rid`` is no longer parked (placed, failed or gone)."""
        self._parked.pop(rid, None)
        self._parked_since.pop(rid, None)

    def _expire_parked(self, now_mono: float) -> None:
        """Fail every request parked for ``requeue_wait_s`` or more (``now_mono``: ``time.monotonic()``):
        503 with the reason no node took it (a stream gets it as an error event), its nodes told to
        drop it, and no record of it left (parked work, in-flight counts). Time while NATS is down or
        settling after an outage (:meth:`_bus_settling`: node states are silent then, and a node restarted
        meanwhile can report only once the bus is back) does not count: the bound is suspended, every
        parked request's start moved on by that time, so a request gets ``requeue_wait_s`` of a working bus
        (before, an outage longer than the bound failed every parked request the moment the bus settled,
        although a node restarted during it had had no chance to report). Called by the fence loop
        (at most every 0.5 s), so a request fails within ``requeue_wait_s`` + 0.5 s of bus-up time parked.
        Before, it waited for its next output chunk until ``request_timeout_s`` (600 s), then 504."""
        last, self._parked_checked = self._parked_checked, now_mono
        if self._bus_settling():  # node states are silent because of the bus: "no live node" says nothing yet
            if last is not None and now_mono > last:
                for rid, (since, reason) in self._parked_since.items():
                    self._parked_since[rid] = (since + (now_mono - last), reason)
            return
        wait = self.cfg.requeue_wait_s
        for rid, (since, reason) in list(self._parked_since.items()):
            if now_mono - since < wait:
                continue
            self._unpark(rid)
            p = self._pending.get(rid)
            if p is None or p.done:
                continue
            why = f"{reason} (handed-back work waited {wait:g} s for one: requeue_wait_s); request failed"
            self.counters["requeue.parked_expired"] += 1
            self.log.warning("parked work found no eligible node in time; request failed", rid=rid, reason=reason, wait_s=wait)
            self._abandon(p, why, "parked_expired")
            self._publish_parked_end(p, why)
            p.queue.put_nowait(_Failure(503, why))

    def _publish_parked_end(self, p: _Pending, why: str) -> None:
        """``p`` ended while parked: no node holds it, so no node's last or abort chunk tells the other
        routers (which count it in their load view since its ``route.sent``) or the planner that it
        ended. Publish that end on its output subject: an ``abort`` chunk from this router (``node`` =
        its instance), which this router ignores (:meth:`_on_chunk`). Before, the other routers counted
        it on the nodes it had left until ``request_timeout_s`` after its last ``route.sent``."""
        end = m.TokenChunk(rid=p.rid, node=self.bus.instance, index=p.next_index, finished=True, finish_reason="abort", error=why,
                           attempt=p.attempt, router=self.bus.instance)  # fmt: skip
        self.counters["parked_end_published"] += 1
        self._spawn(self.bus.publish(REQ_OUT, end, rid=p.rid, node=self.bus.instance))

    async def _retry_parked(self) -> None:
        """Place again every parked work a node may take now (called at an accepting node state). The
        list is taken at the start and each placement may await a ``kv.lookup``: work no longer parked
        by then (its request ended, or placed) is skipped. Before, such work was placed anyway: with a
        client's retry under the same ``X-Request-ID`` in flight meanwhile, the old request's work went
        out under the new request's attempt (a ``DecodeWork`` rebound its decode node: the old
        request's hand-off decoded into the new stream; a ``PrefillWork`` failed "already in flight"
        and ended the round)."""
        try:
            for msg in list(self._parked.values()):
                if self._parked.get(msg.rid) is not msg:
                    self.counters["requeue.parked_gone"] += 1
                    continue
                await self._place_again_or_fail(msg)  # one that fails fails its request only
        finally:
            self._retrying = False

    async def _fetch_split(self) -> None:
        """Ask the planner for the split until it answers or ``split_get_timeout_s`` passes."""
        self.log.info("asking the planner for the current split (split.get)", timeout_s=self.cfg.split_get_timeout_s)

        def retrying(attempt: int, e: BusError) -> None:
            if attempt == 1 or attempt % 10 == 0:
                self.log.info("planner has not answered split.get yet; retrying", attempt=attempt, error=str(e))

        cmd, attempts, err = await self.bus.request_until(
            SPLIT_GET, m.SplitQuery(), deadline_s=self.cfg.split_get_timeout_s,
            done=lambda: self._have_split, on_retry=retrying,
        )
        if cmd is None:
            if err is not None:
                self.counters["split_get_timeouts"] += 1
                self.log.warning(
                    "planner did not answer split.get; routing by node-reported phases until a split.commands arrives",
                    attempts=attempts,
                    waited_s=self.cfg.split_get_timeout_s,
                    error=str(err),
                )
            return
        if not self._have_split:
            self._apply_split(cmd, "split.get")

    def _bus_settling(self) -> bool:
        """True while NATS is down or stalled (connected, but a PING of :meth:`_bus_probe_loop` got no PONG),
        or reconnected or answering again, or this process running again after a freeze (:meth:`_fence_loop`),
        less than ``fence_after_s`` + 1 s ago: node states are silent or unread because of the bus or this
        process, not because the nodes died."""
        return self._bus_unsettled() is not None

    def _bus_unsettled(self) -> tuple[str, float] | None:
        """None when the bus has settled (:meth:`_bus_settling` False), else (why, for ``/healthz``; wall s
        until it settles at the soonest: ``inf`` while NATS is down or stalled, since the end is unknown)."""
        if not self.bus.nc.is_connected:
            return "not connected to NATS", math.inf
        now = time.monotonic()
        if self._bus_stalled_at is not None:
            return f"NATS does not answer a PING (for {now - self._bus_stalled_at:.1f} s): node states cannot come", math.inf
        rec, res = self.bus.reconnected_at or -math.inf, self._resumed_at or -math.inf
        left = max(rec, res) + self.cfg.fence_after_s + 1.0 - now
        if left <= 0:
            return None
        why = "NATS reconnected" if rec >= res else self._resumed_why
        fencing = "no node is fenced until then" if self._fence_unsettled() is not None else "a node is fenced for silence only while the bus delivers"
        return f"settling after {why}: node states may be stale for {left:.1f} s more ({fencing})", left

    def _fence_unsettled(self) -> tuple[str, float] | None:
        """None when the fence loop checks nodes, else (why, wall s until it does at the soonest: ``inf`` while NATS is
        down). Fence checks stop while NATS is down, and for ``fence_after_s`` + 1 s after a reconnect (each node
        reconnects at its own pace: the bus delivers to this router before a node is back) or after a freeze of this
        process. A stall (a PING late by ``fence_after_s`` / 3) and its settle do not stop them: every silence is then
        counted only over the time the bus delivered (:attr:`_witness`). Before, they did: on a loaded host PONGs
        came that late again and again (session 54: load 8–15 on 2 cores), fencing stayed suspended, and a dead node
        was never fenced for silence (only a ``node.down`` fenced it; under Slurm nothing sends one)."""
        if not self.bus.nc.is_connected:
            return "not connected to NATS", math.inf
        rec, res = self.bus.reconnected_at or -math.inf, self._froze_at or -math.inf
        left = max(rec, res) + self.cfg.fence_after_s + 1.0 - time.monotonic()
        if left <= 0:
            return None
        return ("NATS reconnected" if rec >= res else "the router did not run for longer than the fence time"), left

    def _hold_fence(self, node: str, held: list[Held]) -> bool:
        """True: leave ``node`` (silent past ``fence_after_s`` on the clock) unfenced this round, since the bus
        delivered for less than ``fence_after_s`` of its silence (:meth:`DeliveryWitness.hold`); the hold is appended
        to ``held``, and counted ``fence.held_bus_quiet`` and logged once per silence."""
        h = self._witness.hold(node, self.cfg.fence_after_s)
        if h is None:
            return False
        held.append(h)
        if node not in self._held:
            self.counters["fence.held_bus_quiet"] += 1
            self.log.info("node silent past fence_after_s, but the bus delivered for less of that time: fence held until "
                          "it has (the silence may be the bus's)", node=node, delivered_s=round(h.silent_s, 3),
                          fence_after_s=self.cfg.fence_after_s, stalled=self._bus_stalled_at is not None)  # fmt: skip
        return True

    async def _bus_probe_loop(self) -> None:
        """PING the NATS server every ``_bus_stall_s / 2`` wall s; a PING without its PONG for
        ``_bus_stall_s`` marks the bus stalled (:meth:`_bus_settling` is then True) until it is answered, unless node
        states came since the PING (:attr:`_witness`: the server delivers, its PONG is only slow, as on a loaded host;
        counted ``bus.slow_pongs`` once per PING). Before, each such late PONG marked a stall and its settle
        (``fence_after_s`` + 1 s): ``/healthz`` answered 503 "NATS does not answer a PING" again and again on a loaded
        host, and parked requests' and missing chunks' bounds were suspended. A stall marked ends at its PONG, or when
        node states come again ``_bus_stall_s`` after it began (the burst after a hang: settled from then).

        A server that hangs (SIGSTOP, a stuck host) or a path to it that drops packets keeps the TCP
        connection up: nats-py reports it connected (its own PINGs go every 2 min), no node state arrives,
        and the fence loop fenced every node at once after ``fence_after_s`` (8-s SIGSTOP of nats-server on a
        2P2D replay: 4 fences, 8 requests re-dispatched, their prompts of up to 611k tokens computed again,
        3,316 chunks of the old attempts dropped), and a new request got a 503 'no live node' after
        ``no_route_wait_s``, where a server that died and came back cost nothing (fence checks stop while
        it is down). Counted ``bus.stalls``; logged when it stalls and when it answers again.

        The PING is never given up on while its connection lasts (``Bus.ping``, ``shared.natsping``): nats-py's
        ``flush`` cancels the PONG's future at its timeout, and the PONG that comes later then ends the client's read
        loop (``InvalidStateError`` in ``_process_pong``, nats-py 2.16): connected, it never reads again. A
        reconnect forgets the PINGs sent before it (their PONGs never come): the probe is dropped then. Lost is judged
        by nats-py's PONG list, not ``reconnected_at``: a PING sent on a new connection before ``reconnected_cb`` ran
        is in the new list, and cancelling it made its late PONG end the client's read loop (rr-bus52).

        A client found deaf (its read loop or flusher ended: the PING ends ``DeafClient``, ``shared.natsping``) is made
        to reconnect now (:meth:`Bus.reconnect_deaf`, counted ``bus.deaf_reconnects``). Before, the probe saw no
        answer, the router heard no node state and fenced them all after ``fence_after_s``, and nothing reconnected
        it until nats-py's own PINGs (every 2 min, two unanswered) called the connection stale
        (``tests/integration/test_router_bus_stall_live.py``). So is one whose read loop ended while the probe's PING
        was in flight (its PONG can never be read): before, the probe waited for that PONG for good, the bus "stalled"
        and fencing suspended for the router's lifetime, nothing heard."""
        interval = self._bus_stall_s / 2
        while True:
            if not self.bus.nc.is_connected:
                await asyncio.sleep(interval)
                continue
            sent, conn = time.monotonic(), self.bus.reconnected_at
            probe = self.bus.ping()
            got = await probe.wait(self._bus_stall_s)
            if got is False and await self.bus.reconnect_deaf():  # deaf (DeafClient): reconnected now
                self.counters["bus.deaf_reconnects"] += 1
                await asyncio.sleep(interval)  # the reconnect settles the bus (reconnected_at) as any other
                continue
            if got is None:  # a PONG already read but not processed yet (a busy loop ran this timer first) is no stall
                got = await probe.wait(0.01)
            slow, marked_at = False, None
            while got is None:  # no PONG yet, and nats-py still holds the PING (no reconnect since)
                if natsping.deaf(self.bus.nc):  # its read loop ended with the PING in flight: its PONG is never read
                    break
                now = time.monotonic()
                if self._bus_stalled_at is None and self.bus.nc.is_connected:
                    if self._witness.heard_after(max(sent, now - self._bus_stall_s)):  # node states still come: slow, not hung
                        if not slow:
                            slow = True
                            self.counters["bus.slow_pongs"] += 1
                    else:
                        self._bus_stalled_at, marked_at = sent, now
                        self.counters["bus.stalls"] += 1
                        self.log.warning("NATS does not answer a PING; a node's silence counts only while the bus delivers",
                                         waited_s=round(now - sent, 3))
                elif marked_at is not None and self._bus_stalled_at is not None and self._witness.heard_after(marked_at):
                    self._bus_resumed("NATS delivers node states again after a stall")  # its PONG is only slow
                got = await probe.wait(interval)
            if got is None and await self.bus.reconnect_deaf():  # deaf with the PING in flight: reconnected now
                self.counters["bus.deaf_reconnects"] += 1
                probe.drop()  # forgotten by the reconnect: cancelled at the bus's next PING
                await asyncio.sleep(interval)
                continue
            if got:
                self._witness.heard(time.monotonic())
            if got and self._bus_stalled_at is not None:
                self._bus_resumed("NATS answered a PING again after a stall")
            if self.bus.reconnected_at != conn:
                self._bus_stalled_at = None  # a reconnect settles the bus itself (reconnected_at)
            await asyncio.sleep(max(0.0, sent + interval - time.monotonic()))

    def _bus_resumed(self, why: str) -> None:
        """The stall :meth:`_bus_probe_loop` marked is over (its PONG came, or node states came again): the bus settles
        from now, as after a reconnect (``fence_after_s`` + 1 s)."""
        assert self._bus_stalled_at is not None
        self.log.warning("NATS answers again; node states have had time to come back in fence_after_s + 1 s", why=why,
                         stalled_s=round(time.monotonic() - self._bus_stalled_at, 3), settle_s=self.cfg.fence_after_s + 1.0)  # fmt: skip
        self._bus_stalled_at = None
        self._resumed_at, self._resumed_why = time.monotonic(), why

    async def _fence_loop(self) -> None:
        """Fence nodes whose state went silent while the bus delivered (:meth:`_hold_fence`; no check while NATS is down
        or for ``fence_after_s`` + 1 s after a reconnect or a freeze of this process: :meth:`_fence_unsettled`), fail parked requests past ``requeue_wait_s``, drop other routers' requests past
        ``request_timeout_s``, expire branches silent past ``--branch-ttl-s``; wake at the core's next deadline (at most every 0.5 s, or ``fence_after_s`` / 2 if
        less), or, while the bus is down or settling, when it settles, or while a fence is held, when the deliveries could
        suffice (at most every 0.5 s, at least every 0.1 s: before, a fence already due woke it every 0.01 s then).

        One request whose re-dispatch fails is failed alone (:meth:`_fence`). Any other exception
        ends the task, and the router with it (exit 1: ``BackgroundTasks``, the supervisor restarts
        it; its in-flight requests get a 503 at the stop): a round that stopped midway leaves
        nodes fenced in the core whose requests nobody handles, and no later round would. Before,
        it ended the loop silently: fencing stopped for the router's lifetime (dead nodes' requests
        waited ``request_timeout_s``, parked ones never expired) while it answered ready."""
        while True:
            now = self.clock.now()
            mono = time.monotonic()
            if self._fence_round_at is not None and mono - self._fence_round_at > self.cfg.fence_after_s:
                # the loop sleeps at most fence_after_s / 2: this process did not run (SIGSTOP, a paused VM, a blocked loop),
                # and the node states sent meanwhile are still unread. Before, its first round fenced every node
                # (8-s SIGSTOP of the router: 3 fences, 2 requests re-dispatched)
                self.counters["fence.router_stalls"] += 1
                self.log.warning("the router did not run for longer than the fence time; node states settle before fencing",
                                 stalled_s=round(mono - self._fence_round_at, 3), settle_s=self.cfg.fence_after_s + 1.0)  # fmt: skip
                self._resumed_at, self._resumed_why = mono, "the router did not run for longer than the fence time"
                self._froze_at = mono
            self._fence_round_at = mono
            held: list[Held] = []
            if self._fence_unsettled() is not None:
                self.counters["fence_checks_skipped_bus_down"] += 1
            else:
                for f in self.core.check_fences(now, lambda node: self._hold_fence(node, held)):
                    self._fence(f)
                for node in self.core.forget_left(now, self._forget_after):
                    self._forgotten(node)
                self._note_context()  # a node silent past --forget-node-after-s no longer counts toward the KV cap
            self._expire_parked(time.monotonic())
            self._expire_held(time.monotonic(), settling=self._bus_settling())
            # branches silent past --branch-ttl-s leave ei_router_branches_active and /v1/cluster now, not at the
            # next X-Branch-Id request (the only expiry before: the gauge stayed up for as long as traffic stopped)
            self.branches.expire(self.clock.local_now())
            self._parent_log.flush()  # the parent-missing warnings suppressed in an interval that has ended: one line each
            for rid in self._remote.expired(time.monotonic(), self.cfg.request_timeout_s):
                self.core.finish(rid, now)  # its owner went away without its end reaching the bus
                self.counters["remote.expired"] += 1
            self._held = {h.node: h.wait_s for h in held}
            if held:
                self.counters["fence.rounds_held"] += 1
            cap = self._fence_wait_max_s
            unsettled = self._fence_unsettled()
            if unsettled is not None:
                # no fence check runs before the bus settles; a fence already due (every node silent through the
                # outage) woke the loop every 0.01 s before: ~100 rounds a second while NATS was down or settling
                wait = min(cap, max(0.01, unsettled[1] + 0.005))
            elif held:  # a deadline already passed: a hold ends only with deliveries (at least the wait_s needed)
                wait = min(cap, max(0.1, min(self._held.values())))
            else:
                deadline = self.core.next_deadline()  # on the core's state clock (clock.local_now)
                wait = cap if deadline is None else min(cap, max(0.01, self.clock.to_wall(deadline - self.clock.local_now()) + 0.005))
            await asyncio.sleep(wait)

    def _forgotten(self, node: str) -> None:
        """``node`` was fenced and silent longer than ``--forget-node-after-s``, and holds no request: the core
        dropped its record (:meth:`RouterCore.forget_left`: no longer in ``GET /v1/cluster`` nor in any per-node
        table); its block-size warning is forgotten too. Before, a node's record stayed for the router's lifetime,
        so with node ids that change on every restart (Kubernetes pods, compose containers) the cluster view and
        the policies' per-node state grew without end. A node that reports again is recorded afresh (the
        ``routed.*.<node>`` counters, hence the node's ``ei_router_routed_total{node}`` series and its
        ``svc.stats`` entries, go too: with node ids new at each restart they grew without end; the core drops its
        ``ei_router_queue_seconds{node}`` histogram). A node that never reported here, recorded by
        another router's placement that has ended, is dropped the same way (:meth:`NodeLoadView.forget_left`).
        Counted ``nodes.forgotten``."""
        self.counters["nodes.forgotten"] += 1
        self._witness.forget(node)
        self.counters.pop(f"routed.prefill.{node}", None)
        self.counters.pop(f"routed.decode.{node}", None)
        self._bad_block_size.discard(node)
        self.log.info("node forgotten: fenced and silent past --forget-node-after-s, or never reported and no request left",
                      node=node, forget_node_after_s=self.cfg.forget_node_after_s)  # fmt: skip

    def _fence(self, f: FencedNode) -> None:
        """Node ``f.node`` was fenced (:meth:`RouterCore.check_fences`): log it with its ``cause`` (``silent``: no
        node.state within fence_after_s; ``restarted``: its state sequence went back; the line said "or" before,
        naming neither) and re-dispatch or fail the requests that depended on it."""
        node, age, rids = f.node, f.age, f.rids
        self.counters["fenced"] += 1
        self.log.warning(
            "node fenced out: " + ("no node.state within fence_after_s" if f.cause == "silent"
                                   else "its process exited (node.down from its supervisor)" if f.cause == "exited"
                                   else "restarted (its state sequence went back)"),
            node=node,
            cause=f.cause,
            silent_wall_s=round(self.clock.to_wall(age), 3),
            fence_after_s=self.cfg.fence_after_s,
            inflight=len(rids),
        )
        reason = (f"node {node} stopped answering (no state for {self.clock.to_wall(age):.1f}s)" if f.cause == "silent"
                  else f"node {node}'s process exited" if f.cause == "exited"
                  else f"node {node} restarted (its state sequence went back)")
        for rid in rids:
            try:
                self._fence_request(rid, node, reason)
            except Exception as e:
                self._fence_request_failed(rid, node, reason, e)

    def _fence_request(self, rid: str, node: str, reason: str) -> None:
        """Request ``rid`` was on fenced ``node`` (``reason``): re-dispatch it, or fail it."""
        if self._remote.forget(rid):  # another router's request: its owner re-dispatches it
            self.core.finish(rid, self.clock.now())
            self.counters["remote.fenced"] += 1
            return
        p = self._pending.get(rid)
        if p is not None and not p.done and p.cur is not None:
            if node not in (self.core.view.placement(rid) or ()):
                # re-dispatched already by the fence of its other node in the same check (both went
                # silent together): a second one sent a third attempt after the second
                self.counters["redispatch.already"] += 1
                return
            self._redispatch(p, node, reason)
            return
        if p is not None:
            self._abandon(p, reason + "; request failed", "fenced")
            p.queue.put_nowait(_Failure(503, reason + "; request failed"))
        else:
            for n, msg in self.core.abort(rid, reason, now=self.clock.now()):
                self._spawn(self._publish_abort(n, msg))
        self.counters["fenced_requests_failed"] += 1

    def _fence_request_failed(self, rid: str, node: str, reason: str, e: Exception) -> None:
        """Re-dispatching (or failing) ``rid`` off fenced ``node`` raised ``e`` (a bug): that request
        alone is failed (503 with the reason, its nodes told to drop it), counted
        (``fence.request_errors``) and logged at error with the traceback; the fence goes on with
        the node's other requests. Before, the exception ended the fence loop (see
        :meth:`_fence_loop`). Raises what failing the request raises (the fence loop then ends the
        router)."""
        self.counters["fence.request_errors"] += 1
        why = f"{reason}; re-dispatch failed ({e!r}); request failed"
        self.log.error("re-dispatch after a fence failed; request failed", rid=rid, node=node, error=repr(e), exc_info=e)
        p = self._pending.get(rid)
        if p is not None:
            self._abandon(p, why, "fenced")
            p.queue.put_nowait(_Failure(503, why))  # a response already ended reads no further

    async def _route_new(
        self, rreq: RouteRequest, lookup: m.KvLookupReply | None, lookup_status: str, tr: _ReqTrace | None
    ) -> RouteDecision | NoRoute:
        """Route a new request, waiting for a node while NATS settles (``bus_outage_wait_s``) or none
        is eligible (``no_route_wait_s``); its ``router.route`` span when tracing is on."""
        now = self.clock.now()
        route_span = None if tr is None else tracing.start("router.route", tr.span)
        out = self._route_core(rreq, lookup, now, route_span)
        if isinstance(out, NoRoute) and self._bus_settling():
            # a NATS outage silences node states: wait for them instead of failing the request
            self.counters["routes_waited_bus_down"] += 1
            wait_until = time.monotonic() + self.cfg.bus_outage_wait_s
            while isinstance(out, NoRoute) and self._bus_settling() and time.monotonic() < wait_until:
                await asyncio.sleep(0.1)
                out = self._route_core(rreq, lookup, self.clock.now(), route_span)
        if isinstance(out, NoRoute) and self.cfg.no_route_wait_s > 0:
            out = await self._route_when_possible(rreq, lookup, out, route_span)
        if route_span is not None:
            assert tr is not None
            tr.span.set_attribute("ei.rid", rreq.rid)
            if isinstance(out, NoRoute):
                route_span.set_attribute("ei.no_route", out.reason)
            else:
                # a decode node bound later (``route.bind``) is not known here: no ``ei.decode_node`` then
                # (the ``router route.bind.{router}`` span and the root span's final placement carry it)
                route_span.set_attributes(
                    {"ei.policy": self.core.policy.name, "ei.prefill_node": out.prefill.node, "ei.lookup": lookup_status,
                     "ei.matched_blocks": out.prefill.matched_blocks, "ei.prompt_tokens": rreq.prompt_tokens}
                )
                if out.decode_node is not None:
                    route_span.set_attribute("ei.decode_node", out.decode_node)
                if out.predicted_ttft_s is not None:
                    route_span.set_attribute("ei.predicted_ttft_s", out.predicted_ttft_s)
            route_span.end()
        return out

    def _route_core(self, rreq: RouteRequest, lookup: m.KvLookupReply | None, now: float, span: Any) -> RouteDecision | NoRoute:
        """``core.route``, unless another router placed ``rreq.rid`` meanwhile (its ``route.sent`` counted it in the
        view, where a second count raises ValueError).

        Raises:
            _PeerPlaced: ``rreq.rid`` is another router's in-flight request (``span``, the ``router.route`` span or
                None, is ended first).
        """
        if rreq.rid in self._remote:
            if span is not None:
                span.set_attribute("ei.no_route", "X-Request-ID in flight on another router")
                span.end()
            raise _PeerPlaced(rreq.rid)
        return self.core.route(rreq, lookup, now)

    async def _route_when_possible(
        self, rreq: RouteRequest, lookup: m.KvLookupReply | None, out: NoRoute, span: Any = None
    ) -> RouteDecision | NoRoute:
        """No node can take the request now (the last prefill node fenced, a split in flight):
        wait up to ``no_route_wait_s`` for one, retrying every 50 ms, before answering 503 —
        a node's failure costs latency, not requests (issue #22)."""
        deadline = time.monotonic() + self.cfg.no_route_wait_s
        self.counters["route_waits"] += 1
        while time.monotonic() < deadline and not self._stopping:
            await asyncio.sleep(0.05)
            got = self._route_core(rreq, lookup, self.clock.now(), span)
            if not isinstance(got, NoRoute):
                self.counters["route_waits.recovered"] += 1
                return got
            out = got
        return out

    def _work(self, p: _Pending, out: RouteDecision) -> m.PrefillWork:
        """The work to publish for ``out``: stamped with ``p``'s attempt, output offset and this
        router as owner; the placement is announced to the other routers (``route.sent``)."""
        work = msgspec.structs.replace(out.work, attempt=p.attempt, output_offset=p.offset, router=self.bus.instance)
        p.prefill_node, p.decode_node = out.prefill.node, out.decode_node
        p.plan_sources = sorted({r.node for r in work.fetch})
        self._announce(p, work.prompt_tokens, work.max_tokens)
        return work

    def _announce(self, p: _Pending, prompt_tokens: int = 0, max_tokens: int = 0) -> None:
        """``route.sent`` for ``p``'s current placement (other routers count it in their load view)."""
        c = p.cur
        sent = m.RouteSent(
            router=self.bus.instance, rid=p.rid, prefill_node=p.prefill_node, decode_node=p.decode_node, attempt=p.attempt,
            prompt_tokens=prompt_tokens or (c.prompt_tokens if c else 0), max_tokens=max_tokens or (c.max_tokens if c else 0),
            first_token=self.core.view.first_token_seen(p.rid),  # a binding after a parked request's first token
        )  # fmt: skip
        self._spawn(self.bus.publish(ROUTE_SENT, sent))

    async def _publish_placed(self, placed: m.RoutePlaced) -> None:
        """``route.placed``, remembered as its branch's latest placement (for ``branch.sync``)."""
        self.branches.note_placed(placed)
        await self.bus.publish(ROUTE_PLACED, placed)

    async def _publish_evicted(self) -> None:
        """Branches the table's cap (``--max-active-branches``) evicted: ``BranchEnd(expired=True)`` each, so
        the directory expires them as its TTL does (counts released, resumable)."""
        for bid, rid in self.branches.take_evicted():  # rid: the directory ignores it if another router placed bid since
            await self.bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=bid, ts=self.clock.now(), expired=True, rid=rid))

    async def _on_branch_sync(self, msg: m.BranchSync, _subject: str) -> None:
        """A directory started (issue #22): republish every active branch and its latest
        placements, so its branch table and counts are rebuilt (it rebuilds its block index
        from the workers' snapshots), then a :class:`~shared.messages.BranchSyncDone` marker on ``branch.events``
        (after the starts: one publisher, one subject), which the directory waits for before it answers
        ``branch.query`` as settled (``services/kvdirectory/settle.py``).

        The directory sends its ``branch.sync`` again each second until every router it knows of has answered (for a
        router that missed it): one ``sync_id`` is answered once (``branch_sync.repeated``); a republish that failed
        (a publish refused) is answered again at the next one (``branch_sync.failed``). A ``branch.sync`` without
        ``sync_id`` (a directory from before the marker) is answered every time, with no marker.

        The event loop is given back every :data:`REPUBLISH_YIELD_EVERY` messages: a publish does not wait, so the
        loop ran the whole republish at once (4.3 s for 65,536 branches, the default cap, on a 2-core host at load
        4.5), serving nothing meanwhile, and NATS sent its first message only at the end. It also waits, there, for
        room in the bus's resend window (:meth:`~shared.bus.Bus.window_room`, :data:`REPUBLISH_WINDOW_ROOM`): 65,536
        branches with two placements each are 196,608 reliable publishes, and faster than the server's confirms the
        oldest left the window unconfirmed (31,514 measured), lost had the connection died then; paced, the republish
        of 131,072 messages took 12.4 s instead of 7.6 s (one process, real nats-server, no directory reading)."""
        if msg.sync_id and msg.sync_id in self._syncs_answered:
            self.counters["branch_sync.repeated"] += 1
            return
        if msg.sync_id:
            self._syncs_answered.append(msg.sync_id)  # before the first yield: a repeat read meanwhile is not answered
        out = self.branches.republish()
        n = placed = 0
        paced = True
        try:
            for i, ev in enumerate(out, 1):
                # the list was taken before the yields below: a branch ended or evicted by the cap since is not sent (its
                # end or eviction went out before; a start sent after an eviction the new directory did not know yet
                # made it active there until its TTL while this table held it expired)
                if not self.branches.is_active(ev.branch_id):
                    continue
                await self.bus.publish(ROUTE_PLACED if isinstance(ev, m.RoutePlaced) else BRANCH_EVENTS, ev)
                if isinstance(ev, m.BranchStart):
                    n += 1
                else:
                    placed += 1
                if i % REPUBLISH_YIELD_EVERY == 0:
                    # the bus's resend window (RESEND_MAX_MSGS) must hold what the server has not confirmed: a
                    # republish faster than confirms pushed its first messages out of it (27,579 of 131,072 at 17,000
                    # a second), lost had the connection died then. A hung server: waited for once, then as before
                    if paced and not await self.bus.window_room(REPUBLISH_WINDOW_ROOM, REPUBLISH_WINDOW_WAIT_S):
                        paced = False
                        self.counters["branch_sync.window_full"] += 1
                    await asyncio.sleep(0)  # the client's flusher sends what is queued; HTTP and NATS handlers run
            if msg.sync_id:
                await self.bus.publish(BRANCH_EVENTS, m.BranchSyncDone(sync_id=msg.sync_id, directory=msg.directory, branches=n,
                                                                       placements=placed))  # fmt: skip
        except BusError as e:  # answered again at the directory's next branch.sync (it sends one each second)
            with contextlib.suppress(ValueError):
                self._syncs_answered.remove(msg.sync_id)
            self.counters["branch_sync.failed"] += 1
            self.log.warning("republish to the directory failed; retried at its next branch.sync", directory=msg.directory,
                             sent=n, error=repr(e))  # fmt: skip
            return
        self.counters["branch_sync.requests"] += 1
        self.counters["branch_sync.branches"] += n
        self.log.info("directory started: active branches republished", directory=msg.directory, branches=n, placements=placed)

    async def _on_branch_event(self, ev: m.BranchStart | m.BranchEnd | m.BranchToolCall | m.BranchSyncDone, _subject: str) -> None:
        """Another router's ``branch.events``: its ``BranchEnd`` ends the branch in this table too
        (``BranchTable.end_unseen``; counted ``branch_ends_heard``), its ``BranchToolCall`` holds a branch this table
        holds (``BranchTable.heard_tool_call``; ``branch_tool_calls_heard``). Two routers behind one address: the end
        the harness sent through the router that did not serve the branch is relayed (:meth:`_end_branch`); before,
        the router that served it kept it active (a request on it served 200 here, 400 there; ``branches_active``
        too high) and republished it to a restarted directory, which counted its blocks again until the TTL.

        Ignored: this router's own events (``src``), ``BranchStart`` (a branch starts in the table that serves it),
        and an eviction (``BranchEnd(expired=True)``: the other router's cap, not the branch's end). A message missed
        (this router's NATS link down at that instant; core NATS, not the stream) leaves this table as it was: the
        branch stays active here until its TTL or an end sent here (relayed again: the directory counts a duplicate),
        and a directory restart meanwhile would be given it back by this router's republish."""
        if ev.src == self.bus.instance or isinstance(ev, (m.BranchStart, m.BranchSyncDone)):
            return
        now = self.clock.local_now()
        if isinstance(ev, m.BranchToolCall):
            if self.branches.heard_tool_call(ev.branch_id, now, outstanding=ev.outstanding, expected_s=ev.expected_s):
                self.counters["branch_tool_calls_heard"] += 1
                await self._publish_evicted()  # an expired branch resumed past the cap
            return
        if ev.expired:
            return
        try:
            self.branches.end_unseen(ev.branch_id, now)
        except BranchAlreadyEnded:  # ended here already (its end came through this router too)
            return
        self.core.end_branch(ev.branch_id, self.clock.now())
        self.counters["branch_ends_heard"] += 1

    async def _on_kv_liveness(self, msg: m.KvLiveness, _subject: str) -> None:
        """The directory's view of each node's KV: shown in ``/v1/cluster``; a stale node's cache is not counted on."""
        self._kv_liveness = {n.node: n for n in msg.nodes}
        stale = frozenset(n.node for n in msg.nodes if n.stale)
        was = self.core.view.kv_stale
        if stale != was:
            if stale - was:
                self.log.warning("KV views the directory calls stale; their caches are not counted on",
                                 nodes=sorted(stale - was), stale=sorted(stale))  # fmt: skip
            fresh = {n for n in was - stale if n in self._kv_liveness}  # reported again, not stale: a recovery
            if fresh:  # the node sends KV events again (a resync or a batch): a recovery, not a warning
                self.log.info("KV views fresh again; their caches are counted on", nodes=sorted(fresh), stale=sorted(stale))
            if gone := was - stale - fresh:  # the directory forgot the node (silent past its threshold): not a recovery
                self.log.info("stale KV views no longer reported (the directory forgot their nodes)",
                              nodes=sorted(gone), stale=sorted(stale))  # fmt: skip
            self.core.view.kv_stale = stale

    async def _on_route_sent(self, msg: m.RouteSent, _subject: str) -> None:
        if msg.router == self.bus.instance:
            return
        p = self._pending.get(msg.rid)
        if p is not None:
            if p.done or not self._placed_twice(p, msg):
                return
        if self._remote.sent(msg.rid, msg.router, msg.attempt, time.monotonic(), first_token=msg.first_token):
            if self.core.remote_dispatch(msg, self.clock.now(), first_token=self._remote.first_token(msg.rid)):
                self.counters["remote.sent"] += 1
            else:
                self._remote.forget(msg.rid)
                self.counters["remote.bad_node"] += 1

    def _placed_twice(self, p: _Pending, msg: m.RouteSent) -> bool:
        """Router ``msg.router`` placed ``p.rid`` too: the same ``X-Request-ID`` reached both routers before either's
        ``route.sent`` reached the other. Both see the other's, and the one whose instance name sorts after the
        other's gives way: its request ends (409 to its client, an ``error`` event on a stream already started; its
        nodes told to drop it) and from then on it counts the other's as another router's. Each router takes only the
        chunks naming it (:meth:`_on_chunk`), so the two streams never mix meanwhile. Counted
        ``duplicate_rid.placed_twice`` (both routers) and ``duplicate_rid.gave_way``. Returns True when this router
        gave way (the caller counts ``msg`` as the other router's)."""
        self.counters["duplicate_rid.placed_twice"] += 1
        if self.bus.instance < msg.router:
            self.log.warning("request id placed by two routers at once; the other gives way", rid=p.rid, router=msg.router)
            return False
        why = f"X-Request-ID in flight on router {msg.router} too (sent to both at once); this one gave way"
        self.log.warning("request id placed by two routers at once; this one gives way", rid=p.rid, router=msg.router)
        self.counters["duplicate_rid.gave_way"] += 1
        self._abandon(p, why, "duplicate_rid")
        p.queue.put_nowait(_Failure(409, why))
        return True

    def _remote_chunk(self, chunk: m.TokenChunk) -> None:
        """A chunk of a request this router does not own: another router's (load view) or unknown. One of another
        router's requests this router does not count (it started after the placement: :mod:`replicas`) is
        counted ``chunks_peer_rid`` (its ``TokenChunk.router`` names another router), so that ``chunks_unknown_rid``
        counts only ids no router here placed (a chunk naming this router or none: a request this router has
        forgotten, or a stray publisher). Before, every chunk of the requests in flight on the other routers
        when this one started was counted ``chunks_unknown_rid``."""
        what = self._remote.chunk(chunk.rid, chunk.attempt, chunk.finished, chunk.router)
        if what != "end" and self._remote.current(chunk.rid, chunk.attempt, chunk.router):
            self.core.view.on_handoff(chunk.rid, chunk.node)  # output of its decode node: the hand-off reached it
        if what == "first":
            self.core.remote_first_token(chunk.rid, self.clock.now())
        elif what == "end":
            self.core.finish(chunk.rid, self.clock.now())
            self.counters["remote.ended"] += 1
        elif chunk.rid not in self._remote:
            peer = chunk.router and chunk.router != self.bus.instance
            self.counters["chunks_peer_rid" if peer else "chunks_unknown_rid"] += 1

    def _redispatch(self, p: _Pending, node: str, reason: str) -> None:
        """``p`` depends on fenced ``node``: route it again instead of failing it (issue #22).

        Its prefill had not finished: the same request goes out again (a new kv.lookup finds its
        prefix where it still is). Its decode node died: prompt + the tokens the client has
        become the new prompt and the stream continues after them (or, when that cannot be
        exact, it ends with a 503 saying why). Every node of the old attempt is told to drop it;
        output of the old attempt is refused from now on (``attempt`` + 1).
        """
        now = self.clock.now()
        old = p.attempt
        unbound = self.core.pending_binding(p.rid)  # its decode node not bound yet (route.bind): no decode started
        for n, msg in self.core.abort(p.rid, reason, now=now):
            self._spawn(self._publish_abort(n, msg, old))
        p.attempt += 1
        self._drop_held(p)  # chunks of the old attempt
        assert p.rreq is not None and p.cur is not None
        if p.attempt_first:  # its decode (or collocated) node died while decoding
            left = p.rreq.max_tokens - len(p.tokens)
            if left <= 0:  # every token arrived, only the end was lost
                self.counters["redispatch.ended_at_router"] += 1
                p.done = True
                self._end_decided(p, "length")
                if p.ttft_s is not None:
                    self.core.metrics.observe_finished(p.ttft_s, now - p.t_in, p.out_tokens)
                p.queue.put_nowait(m.TokenChunk(rid=p.rid, node=node, index=p.next_index, finished=True, finish_reason="length", attempt=p.attempt))
                return
            cont = continuation(p.rreq, p.tokens, block_size=self.cfg.block_size, max_prompt_tokens=self.cfg.max_prompt_tokens)
            if isinstance(cont, str):
                self.counters["redispatch.decode_failed"] += 1
                why = f"{reason} after {len(p.tokens)} output tokens; the stream cannot be continued exactly: {cont}"
                self.log.warning("decode node lost; stream ended with an error", rid=p.rid, node=node, reason=cont)
                p.done = True
                self._end_decided(p, "error")
                p.queue.put_nowait(_Failure(503, why))
                return
            p.cur, p.offset = cont, len(p.tokens)
            # its decode node died, or its collocated node (no decode node of its own: it was decoding), or
            # its prefill node died after the first token, before the hand-off reached the decode node (the
            # decode node is told to drop it: abort above), or before its decode node was bound (the prefill
            # node sends a parked request's first token before its route.bind is answered)
            lost_handoff = node == p.prefill_node and (unbound or p.decode_node not in (None, node))
            self.counters["redispatch.handoff" if lost_handoff else "redispatch.decode"] += 1
        else:
            self.counters["redispatch.prefill"] += 1
        p.attempt_first = False
        self.counters["redispatched"] += 1
        self.log.info(
            "request re-dispatched after its node was fenced",
            rid=p.rid, node=node, attempt=p.attempt, output_offset=p.offset, prompt_tokens=p.cur.prompt_tokens,
        )  # fmt: skip
        c = p.cur
        work = m.PrefillWork(
            rid=p.rid, prompt_tokens=c.prompt_tokens, max_tokens=c.max_tokens, block_size=self.cfg.block_size,
            block_hashes=list(c.block_hashes), token_ids=c.token_ids, branch_id=c.branch_id,
            attempt=p.attempt, output_offset=p.offset, router=self.bus.instance, ignore_eos=c.ignore_eos,
            sampling=c.sampling,
        )  # fmt: skip
        self._spawn(self._place_again_or_fail(m.WorkRequeue(rid=p.rid, node=node, reason=f"redispatch: {reason}", prefill=work, attempt=p.attempt)))

    def _end_at_stop(self, p: _Pending, out: OutputText) -> None:
        """The client's output ended at a stop string or stop token id (``out.stop_reason``):
        the request finished (``finish_reason`` ``stop``) and is counted so (``finished.stop``), also
        when its node's last chunk arrived first. Unless its node had ended it, its nodes are told to
        drop it (``aborts.stop``), so no node decodes on for nobody."""
        self.counters["stops.matched"] += 1
        p.out_tokens = out.tokens  # the client's count (its node may have sent more)
        self._count_end(p, "stop")  # also when an end decided outside the response came first (_end_decided)
        if p.done:
            return
        p.done = True
        now = self.clock.now()
        aborts = self.core.abort(p.rid, f"stop reached at the router ({out.stop_reason!r})", now=now)
        if p.ttft_s is not None:
            self.core.metrics.observe_finished(p.ttft_s, now - p.t_in, out.tokens)
        if aborts:
            self.counters["aborts.stop"] += 1
        for node, msg in aborts:
            self._spawn(self._publish_abort(node, msg, p.attempt))

    def _parses_tools(self, req: api.ChatRequest) -> bool:
        """The router reads ``req``'s output for tool calls (``services.router.toolcalls``): its ``tool_choice`` is
        ``auto`` (``api.tool_choice``) and the router runs with ``--enable-auto-tool-choice`` (whose
        ``--tool-call-parser`` is the one known, hermes) and it sends tools (a non-empty ``tools``: vLLM parses only
        then; ``tools: []`` with ``auto`` is served as text)."""
        return self.cfg.enable_auto_tool_choice and bool(req.tools) and api.tool_choice(req) == "auto"

    def _output_tokenizer(self, req: Any) -> Tokenizer:
        """The tokenizer that makes ``req``'s output text: the router's, or for a chat whose tool calls are parsed
        (:meth:`_parses_tools`) with a tokenizer that marks the tags special, the view that keeps them
        (``toolcalls.keep_tags``: vLLM's hermes parser decodes such a request with ``skip_special_tokens`` off)."""
        if self._tag_tokenizer is not None and isinstance(req, api.ChatRequest) and self._parses_tools(req):
            return self._tag_tokenizer
        return self.tokenizer

    def _output_text(self, req: Any) -> OutputText:
        """The request's :class:`OutputText` (its ``stop`` strings, ``stop_token_ids``, ``min_tokens``,
        ``include_stop_str_in_output``; its tokenizer: :meth:`_output_tokenizer`)."""
        return OutputText(
            self._output_tokenizer(req), api.stop_strings(req), req.stop_token_ids or (), req.min_tokens or 0,
            req.include_stop_str_in_output,
        )

    def _count_end(self, p: _Pending, reason: str) -> None:
        """Count ``p``'s end once in ``ei_router_requests_finished_total{reason}`` (``reason``: the
        ``finish_reason`` its client sees: ``stop`` / ``length`` served, counters ``finished.<reason>``, and its
        output tokens, ``p.out_tokens``, in ``ei_router_output_sequence_tokens``; ``error`` / ``abort`` failed,
        ``finish.<reason>``). Later calls are no-ops."""
        if p.counted is not None:
            return
        p.counted = reason
        p.end_reason = None
        served = reason in ("stop", "length")
        self.counters[f"finished.{reason}" if served else f"finish.{reason}"] += 1
        if served:  # ei_router_output_sequence_tokens: the client's count (_end_at_stop sets it before this)
            self.core.metrics.observe_served(p.out_tokens)

    def _end_decided(self, p: _Pending, reason: str) -> None:
        """``p`` ended outside its response (``reason``: its node's last chunk's, or the router's failure
        of it): counted now, unless its response is still on (``_pending``): then when the response ends
        (:meth:`_forget` counts ``reason``), so that the count is what its client saw. The chunks queued before
        this end may complete a stop string, and the response, which reads them in order, then ends with ``stop``
        (counted by :meth:`_end_at_stop`; before, a failure or fence decided while such a chunk was queued was
        counted ``error`` / ``abort`` / ``length`` under a client's ``stop``); or the response may fail after it
        (:meth:`_failed_after_end`: a 500 in the output path, a client too slow), counted ``error`` / ``abort``
        (before, a stream that ended with a 500 error event was counted ``finished.stop`` when its node's end had
        come first)."""
        if p.counted is None and (self._pending.get(p.rid) is p or p.response_on):
            p.end_reason = reason
        else:
            self._count_end(p, reason)

    _ABANDON_REASON = {"client_disconnect": "abort", "gone_before_dispatch": "abort", "shutdown": "abort", "slow_client": "abort"}
    """``_abandon``'s ``why`` → the finish reason it is counted under (others: ``error``)."""

    def _failed_after_end(self, p: _Pending, reason: str, why: str) -> None:
        """``p``'s response fails (``why``: ``internal_error``, a 500; ``slow_client``): :meth:`_abandon` it, or, when
        its output all came (its node's end decided; its response still on, so that end is not counted yet:
        :meth:`_end_decided`), count it as its client sees it (``error`` / ``abort``), not as its node ended it:
        nothing is on a node to abort. An end already counted (the router's own ``stop``) stays, counted once."""
        if not p.done:
            self._abandon(p, reason, why)
        elif p.counted is None:
            p.end_reason = self._ABANDON_REASON.get(why, "error")

    def _abandon(self, p: _Pending, reason: str, why: str, *, tell_nodes: bool = True) -> None:
        """Stop counting ``p`` and tell its nodes to drop it (idempotent, never awaits); counted finished
        as ``abort`` (client disconnect or too slow, shutdown) or ``error`` (timeout, fenced, parked too long, dispatch failed).
        ``tell_nodes=False``: no ``work.abort`` (the work was never sent to them)."""
        if p.done:
            return
        p.done = True
        self._drop_held(p)
        self._end_decided(p, self._ABANDON_REASON.get(why, "error"))
        aborts = self.core.abort(p.rid, reason, now=self.clock.now())
        if aborts:
            self.counters["aborts"] += 1
            self.counters[f"aborts.{why}"] += 1
        for node, msg in aborts if tell_nodes else ():
            self._spawn(self._publish_abort(node, msg, p.attempt))

    # ------------------------------------------------------------------ #
    # HTTP
    # ------------------------------------------------------------------ #

    def _build_app(self) -> Starlette:
        async def not_found(request: Request, exc: Exception) -> Response:
            status = exc.status_code if isinstance(exc, HTTPException) else 404
            reason = f"{request.method} {request.url.path}: " + ("not found" if status == 404 else "method not allowed")
            headers = exc.headers if isinstance(exc, HTTPException) else None  # a 405's Allow (RFC 9110 §15.5.6)
            return self._json(api.error_body(status, reason), status, headers=headers)

        async def bus_failed(request: Request, exc: Exception) -> Response:
            # NATS down and the outbound buffer full, or the connection closed: the client may retry
            self.counters["bus_errors_503"] += 1
            ident = request_id_of(request.scope)
            self.log.warning(
                "bus error answered as 503", rid=ident.rid, **_client_id_fields(ident.rid, ident.client), path=request.url.path,
                error=repr(exc),
            )  # fmt: skip
            return self._json(
                api.error_body(503, f"message bus unavailable, retry later: {exc}"), 503, headers={"retry-after": "1"}
            )

        async def unexpected(request: Request, exc: Exception) -> Response:
            # a bug (no handler caught it): the client gets the API's JSON 500, not Starlette's text/plain
            # "Internal Server Error" (before); Starlette raises the exception again after this answer, so
            # uvicorn logs it too. A stream that already started ends without this body (headers sent)
            self.counters["http_errors_500"] += 1
            ident = request_id_of(request.scope)
            self.log.error(
                "unexpected error answered as 500", rid=ident.rid, **_client_id_fields(ident.rid, ident.client),
                path=request.url.path, error=repr(exc), exc_info=exc,
            )  # fmt: skip
            return self._json(api.error_body(500, f"internal error in the router: {type(exc).__name__}"), 500)

        return Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model, methods=["GET"]),  # OpenAI's models.retrieve
                Route("/livez", self._livez, methods=["GET"]),  # liveness: 200 while HTTP answers (draining too)
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/health", self._healthz, methods=["GET"]),  # the name guidellm and vLLM use
                Route("/ping", self._healthz, methods=["GET", "POST"]),  # vLLM's /ping (SageMaker's check): /health's answer
                Route("/v1/cluster", self._cluster, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                _AnyCharRoute("/v1/branches/{branch_id:path}/end", self._end_branch, methods=["POST"]),
                _AnyCharRoute("/v1/branches/{branch_id:path}/tool-call", self._tool_call, methods=["POST"]),
                Route("/version", self._version, methods=["GET"]),  # vLLM's utility endpoints
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/detokenize", self._detokenize, methods=["POST"]),
            ],
            exception_handlers={404: not_found, 405: not_found, BusError: bus_failed, nats.errors.Error: bus_failed,
                                Exception: unexpected},  # fmt: skip
        )

    @staticmethod
    def _json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
        return Response(_JSON.encode(obj), status_code=status, media_type="application/json", headers=headers)

    def _error(self, status: int, reason: str, param: str | None = None) -> Response:
        return self._json(api.error_body(status, reason, param), status)

    async def _models(self, request: Request) -> Response:
        """``GET /v1/models``: one entry per served name (``--model``, then ``--model-names``), as vLLM's
        ``show_available_models`` lists one ``ModelCard`` per ``--served-model-name``."""
        return self._json(api.models_response(self._served_names, int(self._started_wall), self.max_model_len))

    async def _model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: a served name's entry of ``/v1/models``; for one of ``--model-aliases`` (not
        listed) the entry of ``--model``; another id is a 404."""
        model = request.path_params["model"]
        try:
            self._check_model(model)
        except api.ApiError as e:
            return self._error(e.status, e.reason, e.param)
        shown = model if model in self._served_names else self.cfg.model
        return self._json(api.models_response((shown,), int(self._started_wall), self.max_model_len)["data"][0])

    @property
    def max_model_len(self) -> int:
        """vLLM's ``max_model_len`` (tokens) as ``/v1/models`` and ``/tokenize`` report it: the model's context
        (``--max-context-tokens``) when set, else the longest accepted prompt (``--max-prompt-tokens``; the
        router then has no limit on prompt + output beyond ``--max-output-tokens``), lowered to what the
        largest GPU KV memory of a node holds (:meth:`kv_capacity_tokens`) when that is less: a request
        longer than every node's L1 cannot be served (vLLM lowers its ``max_model_len`` to what its KV
        cache holds, or refuses to start). O(nodes)."""
        limit = self.cfg.max_context_tokens or self.cfg.max_prompt_tokens
        kv = self.kv_capacity_tokens()
        return limit if kv is None else min(limit, kv[0])

    def kv_capacity_tokens(self) -> tuple[int, str] | None:
        """(tokens, node) of the node whose GPU KV memory (L1) holds the most, as the nodes report it
        (``NodeState.gpu_total_blocks`` × ``--block-size``, :meth:`largest_kv`); None while no node reports its
        capacity. O(nodes)."""
        largest = self.largest_kv()
        return None if largest is None else (largest[0] * self.cfg.block_size, largest[1])

    def largest_kv(self) -> tuple[int, str] | None:
        """(blocks, node) of the largest GPU KV memory (L1) over the nodes that reported and have not left for good
        (:meth:`NodeLoadView.largest_gpu_kv`): a node fenced and silent longer than ``--forget-node-after-s`` no
        longer counts, nor does its 0 (an older worker's unknown capacity) turn the cap off; a fenced node counts
        until then (a restarting node does not lower the cap, which would refuse prompts it serves once back)
        and again as soon as it reports. None: no capacity to promise (no node, or one reports 0). Before, every
        node that ever reported counted for the router's lifetime: a request only a departed node could hold
        waited ``--no-route-wait-s`` and got a 503 instead of a 400, and ``/v1/models`` advertised its size.
        O(nodes)."""
        return self.core.view.largest_gpu_kv(self.clock.now(), self._forget_after)

    def context_limit(self) -> int:
        """The prompt + max_tokens limit of the context check (tokens; 0 = none): the model's context
        (``--max-context-tokens``) lowered to :meth:`kv_capacity_tokens`, i.e. :attr:`max_model_len`, when the
        model's context is set; 0 without one (a sim cluster: a request that no node's KV holds is
        refused by :meth:`_check_kv_room`, naming the blocks). O(nodes)."""
        return self.max_model_len if self.cfg.max_context_tokens else 0

    def _note_context(self) -> None:
        """Log (once per value; a warning when the model's context is cut, else info) that ``max_model_len`` is
        lowered below the model's context (or the prompt limit) because no node's GPU KV memory holds that many tokens, and how to raise it;
        info when it is back at the configured value. Called when a node's reported capacity changes and at every
        fence-loop round (a node that left for good, :meth:`largest_kv`). O(nodes)."""
        limit = self.cfg.max_context_tokens or self.cfg.max_prompt_tokens
        kv = self.kv_capacity_tokens()
        now = limit if kv is None or kv[0] >= limit else kv[0]
        if now == (self._context_logged or limit):
            return
        if now < limit and kv is not None:
            what = "the model's context (--max-context-tokens)" if self.cfg.max_context_tokens else "--max-prompt-tokens"
            say = self.log.warning if self.cfg.max_context_tokens else self.log.info  # a model's context cut: news
            say(
                "max_model_len lowered to what a node's GPU KV memory holds: requests longer than that get 400; "
                "give the workers more KV (evolving-infra up --gpu-kv-tokens N, or the profile's memory.gpu_kv_tokens)",
                max_model_len=now, configured=limit, configured_from=what, largest_kv_node=kv[1], kv_tokens=kv[0],
            )
        elif self._context_logged is not None:
            self.log.info("max_model_len back at its configured value", max_model_len=now)
        self._context_logged = now

    async def _version(self, request: Request) -> Response:
        """``GET /version`` (vLLM's): this package's version."""
        return self._json(api.version_response())

    async def _tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` (vLLM's): a prompt or chat messages tokenized as the router tokenizes them for
        ``/v1/completions`` / ``/v1/chat/completions`` (``count`` = that request's ``usage.prompt_tokens``).
        ``return_token_strs``: each id's vocabulary piece (``Tokenizer.convert_ids_to_tokens``, vLLM's). A body over
        ``_BIG_TEXT`` bytes is parsed, tokenized, its pieces listed and the answer encoded
        (``api.tokenize_response_json``) in a worker thread, off the event loop."""

        rendered: str | None = None  # a request template's text (:meth:`_render_request_template`)

        def run(body: bytes) -> bytes:
            req = api.parse_tokenize(body)
            self._check_model(req.model)
            try:
                if isinstance(req, api.TokenizeChatRequest):
                    ids = api.render_chat(self.tokenizer, req, trust_request_chat_template=self.cfg.trust_request_chat_template, rendered=rendered)
                else:
                    ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            except (api.ApiError, api.RenderRequestTemplate):
                raise
            except Exception as e:  # a chat template may raise on a malformed conversation
                raise api.ApiError(400, f"cannot tokenize: {e}", param="messages" if isinstance(req, api.TokenizeChatRequest) else "prompt") from e
            ids = [int(t) for t in ids]
            # vLLM's token_strs: each id's vocabulary piece (convert_ids_to_tokens), special tokens shown
            strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return api.tokenize_response_json(ids, max_model_len, strs)

        max_model_len = self.max_model_len  # read here, on the loop: the node view is not read from a worker thread
        try:
            body = await self._read_body(request)
            # the body's size, not the contents': a chat's tools are rendered too
            try:
                answer = await self._off_loop(request, body, run)  # encoded there too: 31M ids took 1 s
            except api.RenderRequestTemplate as t:
                rendered = await self._render_request_template(t)
                answer = await self._off_loop_rendered(request, body, rendered, run)
        except api.ApiError as e:
            return self._error(e.status, e.reason, e.param)
        return Response(answer, media_type="application/json")

    async def _detokenize(self, request: Request) -> Response:
        """``POST /detokenize`` (vLLM's): ``{"prompt": text}`` of ``tokens``, special tokens shown, as vLLM (its
        tokenizer's ``decode`` defaults), so a chat's ``/tokenize`` ids come back with their template markers and
        re-tokenize to themselves. A body over ``_BIG_TEXT`` bytes is parsed, checked and decoded in a worker
        thread (a 59 MB body of 10M ids: 0.63 s to parse and 0.37 s to check the ids, which ran on the event loop)."""

        def run(body: bytes) -> str:
            req = api.parse_detokenize(body)
            self._check_model(req.model)
            api.check_token_ids(req.tokens, self.tokenizer.vocab_size)
            return self.tokenizer.decode(req.tokens, skip_special_tokens=False)

        try:
            body = await self._read_body(request)
            text = await self._off_loop(request, body, run)
        except api.ApiError as e:
            return self._error(e.status, e.reason, e.param)
        return self._json({"prompt": text})

    def _check_model(self, model: str | None) -> None:
        """Absent, null or "": the served model (vLLM's ``_is_model_supported``); so is a served name (``--model``,
        ``--model-names``) or one of ``--model-aliases`` (vLLM's model path); another name is a 404.

        Raises:
            api.ApiError: 404 naming the served names, ``param`` "model"."""
        if model and model not in self._model_names:
            served = ", ".join(map(repr, self._served_names))
            raise api.ApiError(404, f"model {model[:256]!r} not found; this router serves {served}", param="model")

    async def _livez(self, request: Request) -> Response:
        """``GET /livez``: liveness, 200 ``{"status": "ok"}`` whenever this HTTP server answers, also while the router
        drains (SIGTERM, ``--shutdown-grace-s``), stops, or has NATS down or no node to place on: what a liveness
        probe (Kubernetes' ``livenessProbe``) reads. ``/healthz`` is readiness (503 through a drain): a liveness probe
        on it restarted a draining router and failed the streams the drain was finishing. Public with API keys."""
        return self._json({"status": "ok"})

    async def _healthz(self, request: Request) -> Response:
        """``/healthz``, ``/health``, ``/ping`` (GET or POST, as vLLM's, whose ``/ping`` answers as its ``/health``
        for SageMaker-style checks; a POST's body is not read): 200 ``{"status": "ok"}`` when the router can place a request, else 503 with
        why. During a stop (SIGTERM: :meth:`stop`): 503 "router stopping", as vLLM's ``/health`` answers 503 while
        its server shuts down; before, the tasks the stop cancels (or that end at it) read as "router failing:
        task(s) ended" for the up to 5 s uvicorn drains open connections."""
        if self._stopping or self._draining:
            return self._error(503, "router draining" if self._draining and not self._stopping else "router stopping")
        reason = self._not_ready()
        if reason is not None:
            return self._error(503, reason)
        return self._json({"status": "ok"})

    async def _metrics(self, request: Request) -> Response:
        return metrics_response(self.registry)

    async def _cluster(self, request: Request) -> Response:
        now = self.clock.now()
        view = self.core.view
        nodes = view.snapshot(now)
        for n in nodes:
            kl = self._kv_liveness.get(str(n["node"]))
            n["kv_silent_s"] = kl.silent_s if kl else None
            n["kv_last_batch_s"] = kl.last_batch_s if kl else None
            n["kv_stale"] = kl.stale if kl else False
            age = n["state_age_s"]
            n["state_age_wall_s"] = None if age is None else round(self.clock.to_wall(float(age)), 4)  # type: ignore[arg-type]
        ok, reason = view.routable(now)
        return self._json(
            {
                "policy": self.core.policy.name,
                # how a decode node is chosen: --decode-routing, and the rule it runs (RoutingPolicy.decode_rule:
                # round_robin, least_loaded, least_loaded_kv_room for ttft, dynamo_cost for dynamo-kv)
                "decode_routing": self.cfg.decode_routing,
                "decode_rule": self.core.policy.decode_rule,
                "block_size": self.core.block_size,
                # simulated s per wall s (--speedup / EI_SPEEDUP): `replay` takes it, or refuses another, so its
                # times are on this cluster's clock (a compose or Slurm stack has no state file to read it from)
                "speedup": self.clock.speedup,
                # prompt token ids must be below it (the tokenizer's or the model's vocabulary): `replay` --router-url
                # without a state file takes its ids modulo it, as it does with the state file's tokenizer
                "vocab_size": self.vocab_size,
                "epoch": view.epoch,
                "split_reason": view.split_reason,
                # wall s since the planner's split last came (it repeats it every --announce-interval-s, 5 s): far
                # past that, no planner runs (`up` left it down after a crash loop: its 'left_down'): the split is
                # frozen, serving goes on; None: none came since this router started
                "split_heard_s": None if self._split_heard_at is None else round(time.monotonic() - self._split_heard_at, 3),
                "fence_after_s": self.cfg.fence_after_s,
                "routable": ok,
                "reason": reason,
                "inflight": view.inflight_total,
                "branches_active": self.branches.active_count,
                "router": self.bus.instance,
                "remote_inflight": self._remote.by_router(),
                "nodes": nodes,
            }
        )

    async def _end_branch(self, request: Request) -> Response:
        """``POST /v1/branches/{id}/end``: publish the branch's ``BranchEnd``, then end it in the table; answers
        ``{"branch_id", "ended": true}``. Idempotent: ending a branch already ended (while the table remembers it,
        ``--max-ended-branches``) answers 200 with ``"already": true`` and publishes nothing, as a DELETE-like call does,
        so an SDK's retry of an end whose answer it missed (a timeout) succeeds; before, a 410 its client raised. A
        tool call on an ended branch stays 410, a generation request on it 400. An unknown branch is a 404, a bad id a
        400.

        The ``BranchEnd`` goes out first and the table ends the branch only after it did: a publish that fails
        (``BusError``) answers 503, retried by the SDK, and leaves the branch as it was, so the retry ends it. Before,
        the table ended it first: the retry got 410 "already ended" although no ``BranchEnd`` had gone out (the
        directory kept its counts until its TTL). Two ends at once both publish (the directory counts the second a
        ``duplicate_end``); the one that ends it in the table second answers ``already``; it is counted once
        (``branches_ended``).

        A branch the table does not hold (another router served it, or this router restarted since) is not a 404 at
        once: the router asks the KV directory (``branch.query``, :data:`BRANCH_QUERY_TIMEOUT_S`) and acts on
        ``services.router.branches.unseen_verdict``: ``active`` or ``expired`` there → the ``BranchEnd`` is published
        as for its own, the id remembered ended here, 200 (counted ``branches_ended`` and ``branch_ends_relayed``);
        ``ended`` → 200 ``"already": true``; ``unknown`` → 404; no answer or a bus error → 503 with
        ``Retry-After: 1`` (``branch_queries_failed``), never a 404 for "cannot tell"; ``unknown`` from a directory that
        (re)started an instant ago and may not have read the routers' republish yet (``synced`` false) → 503 with
        ``Retry-After: 1`` too (``branch_queries_unsynced``). An ``ended`` answer is remembered here (a request on the
        branch is then refused 400, as for an end of its own). The directory answers from the ``branch.events`` it has
        read: the ``BranchStart`` of a branch whose first request another router answered an instant before may still
        be in the stream, and its end a 404."""
        branch_id = request.path_params["branch_id"]
        already = {"branch_id": branch_id, "ended": True, "already": True}
        unseen = False
        try:
            api.path_branch_id(branch_id, request.scope.get("raw_path"), self.cfg.max_id_len)
            self.branches.check_end(branch_id)
        except api.ApiError as e:
            return self._error(e.status, e.reason, e.param)
        except BranchAlreadyEnded:
            self.counters["branch_ends_repeated"] += 1
            return self._json(already)
        except UnknownBranch as e:
            verdict = await self._unseen_branch(branch_id)
            if verdict == "ended":
                self._ended_elsewhere(branch_id)
                self.counters["branch_ends_repeated"] += 1
                return self._json(already)
            if verdict != "relay":
                return self._unseen_refusal(branch_id, verdict, e)
            unseen = True
        except BranchError as e:
            return self._error(e.status, e.reason)
        try:
            await self.bus.publish(BRANCH_EVENTS, m.BranchEnd(branch_id=branch_id, ts=self.clock.now()))
        except BusError as e:  # as the app's bus_failed answers one: retry in a second
            self.counters["bus_errors"] += 1
            return self._json(api.error_body(503, f"message bus unavailable, retry later: {e}"), 503, headers={"retry-after": "1"})
        try:
            if unseen:  # a request of it may have come meanwhile: ended here whatever the table holds
                self.branches.end_unseen(branch_id, self.clock.local_now())
            else:
                self.branches.end(branch_id, self.clock.local_now())
        except BranchAlreadyEnded:  # another end of it, at once, ended it while this one published
            self.counters["branch_ends_repeated"] += 1
            return self._json(already)
        except BranchError as e:  # forgotten while it published (cannot happen while ids are remembered)
            return self._error(e.status, e.reason)
        self.core.end_branch(branch_id, self.clock.now())
        self.counters["branches_ended"] += 1
        if unseen:
            self.counters["branch_ends_relayed"] += 1
        return self._json({"branch_id": branch_id, "ended": True})

    async def _unseen_branch(self, branch_id: str) -> str:
        """Ask the KV directory for the state of ``branch_id``, which the table does not hold (``branch.query``,
        :data:`BRANCH_QUERY_TIMEOUT_S`), and return ``services.router.branches.unseen_verdict`` of its answer:
        ``relay``, ``ended``, ``unknown``, ``unsynced`` (``unknown`` from a directory not settled since its restart:
        ``branch_queries_unsynced``) or ``unanswered`` (no answer, a bus error, or an answer about another branch id:
        counted ``branch_queries_failed`` and logged at warning). Never raises ``BusError``."""
        try:
            rep = await self.bus.request(BRANCH_QUERY, m.BranchQuery(branch_id=branch_id), timeout=BRANCH_QUERY_TIMEOUT_S)
        except BusError as e:
            self.counters["branch_queries_failed"] += 1
            self.log.warning("branch.query failed: the KV directory did not say whether it holds the branch", branch=branch_id,
                             error=str(e), timeout_s=BRANCH_QUERY_TIMEOUT_S)  # fmt: skip
            return unseen_verdict(None)
        if rep.branch_id != branch_id:  # an answer about another id answers nothing
            self.counters["branch_queries.mismatched"] += 1
            self.counters["branch_queries_failed"] += 1
            self.log.warning("branch.query answered about another branch: taken as no answer", branch=branch_id,
                             answered=rep.branch_id[:200], state=rep.state)  # fmt: skip
            return unseen_verdict(None)
        self.counters[f"branch_queries.{rep.state}"] += 1
        verdict = unseen_verdict(rep.state, rep.synced)
        if verdict == "unsynced":
            self.counters["branch_queries_unsynced"] += 1
        return verdict

    def _ended_elsewhere(self, branch_id: str) -> None:
        """The directory answered ``ended`` for ``branch_id``, which this table does not hold: remembered ended here,
        nothing published (a request on it is then a 400, a tool call 410, as for an end of its own; before, after a
        restart of this router, a request on it was served 200 and a tool call held it here while the directory
        ignored both)."""
        with contextlib.suppress(BranchAlreadyEnded):  # ended here meanwhile (another end, or one heard): as wanted
            self.branches.end_unseen(branch_id, self.clock.local_now())

    def _unseen_refusal(self, branch_id: str, verdict: str, unknown: UnknownBranch) -> Response:
        """The answer to an end or tool call of a branch neither this router nor the KV directory holds (``unknown``:
        the table's 404, saying the directory does not know it either), that a directory still reading the routers'
        republish does not know yet (``unsynced``) or that the directory did not say (``unanswered``); the last two
        503 with ``Retry-After: 1``, which the OpenAI SDK retries."""
        if verdict == "unknown":
            return self._error(404, f"{unknown.reason}, and the KV directory does not know it either: no router started "
                               "it, it ended or expired long enough ago to be forgotten, or its start has not reached the "
                               "directory yet (a request an instant ago through another router, or a router that has not "
                               "yet republished its branches to a restarted directory): a retry in a moment tells")  # fmt: skip
        if verdict == "unsynced":
            why = ("the KV directory, which (re)started an instant ago, has not yet read the routers' republish of their "
                   "branches (branch.sync): retry in a second")  # fmt: skip
        else:
            why = f"the KV directory did not answer whether it holds it (branch.query, {BRANCH_QUERY_TIMEOUT_S:g} s): retry later"
        return self._json(api.error_body(503, f"branch {branch_id!r} is not in this router's table and {why}"), 503,
                          headers={"retry-after": "1"})  # fmt: skip

    async def _tool_call(self, request: Request) -> Response:
        """``POST /v1/branches/{id}/tool-call``: the branch waits for a tool (issue 21).

        A branch the table does not hold is asked of the KV directory (``branch.query``), as an end is
        (:meth:`_end_branch`): ``active`` or ``expired`` there → its ``BranchToolCall`` is published (the directory
        holds it, resuming an expired one; counted ``branch_tool_calls_relayed``) and the answer's ``expected_s`` is
        the hold this hint gets (an earlier, longer one of another router's may still run there); ``ended`` → 410;
        ``unknown`` → 404; no answer, or ``unknown`` from a directory not settled since its restart → 503 with
        ``Retry-After: 1``. The table does not take the branch in (it would need its kind and parents): its next request
        here starts it, a duplicate start the directory ignores. The router that serves the branch hears the relayed
        ``BranchToolCall`` and holds it in its own table (:meth:`_on_branch_event`)."""
        branch_id = request.path_params["branch_id"]
        relayed = False
        try:
            api.path_branch_id(branch_id, request.scope.get("raw_path"), self.cfg.max_id_len)
            body = await self._read_body(request)
            outstanding, expected_s = api.parse_tool_call(body)
            now = self.clock.local_now()  # the TTL and holds on the monotonic clock, as the directory's
            try:
                ev = self.branches.tool_call(branch_id, now, outstanding=outstanding, expected_s=expected_s, ts=self.clock.now())
                # the hold the branch holds, as the directory does: 0 or past --max-tool-hold-s is that cap (1e12 was echoed
                # as asked), a shorter hint after a longer one leaves the longer one running, a release holds 0 (N was echoed)
                held_s = self.branches.hold_left(branch_id, now)
            except UnknownBranch as e:
                verdict = await self._unseen_branch(branch_id)
                if verdict == "ended":
                    self._ended_elsewhere(branch_id)
                    raise BranchAlreadyEnded(f"branch {branch_id!r} was ended") from None
                if verdict != "relay":
                    return self._unseen_refusal(branch_id, verdict, e)
                ev = m.BranchToolCall(branch_id=branch_id, outstanding=outstanding, expected_s=expected_s, ts=self.clock.now())
                held_s = round(self.branches.hold_span(expected_s), 6) if outstanding else 0.0
                relayed = True
        except api.ApiError as e:
            return self._error(e.status, e.reason, e.param)
        except BranchError as e:
            return self._error(e.status, e.reason)
        await self.bus.publish(BRANCH_EVENTS, ev)
        self.counters["branch_tool_calls"] += 1
        if relayed:
            self.counters["branch_tool_calls_relayed"] += 1
        await self._publish_evicted()  # a resumed branch past the cap
        return self._json({"branch_id": branch_id, "outstanding": outstanding, "expected_s": held_s})

    async def _off_loop(self, request: Request, body: bytes, run: Callable[[bytes], _T]) -> _T:
        """:func:`_off_loop_if_big` with the router's gate of huge bodies; a client that closes the connection
        while its body waits for the gate leaves the line (``http.gate_disconnects``): before, its body was parsed
        and tokenized once a slot was free (seconds and hundreds of MB for a 60 MB prompt, for nobody), ahead of
        the clients still waiting, and a generation request was then dispatched before its abort.

        Raises:
            ApiError: 499 (gone while it waited: the answer is never read), or what ``run`` raised.
        """
        try:
            return await _off_loop_if_big(body, run, self._big_gate, lambda: self._wait_disconnect(request.receive))
        except _GoneAtGate:
            self.counters["http.gate_disconnects"] += 1
            raise api.ApiError(499, "client closed the connection while its body waited for a parse slot") from None

    async def _read_body(self, request: Request) -> bytes:
        """The request's body, at most ``max_body_bytes``, received within ``body_timeout_s``; a refusal names the
        limit, in bytes or seconds, and its setting as the router's flag and as its variable (``--max-body-bytes /
        EI_MAX_BODY_BYTES``, ``--body-timeout-s / EI_BODY_TIMEOUT_S``: ``up`` and ``demo`` have no such flag, the
        router they start reads the variable).

        Raises:
            ApiError: 413 (too big), 408 (not received in time; ``http.body_timeouts``), 499 (the client
                closed the connection before its end; ``http.body_disconnects``: the answer is never read).
        """
        limit = self.cfg.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:
            raise api.ApiError(413, f"request body of {cl} bytes exceeds the router's limit of {limit} bytes ({MAX_BODY_SETTING})")
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):  # a stalled body must not hold the connection
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise api.ApiError(413, f"request body exceeds the router's limit of {limit} bytes ({MAX_BODY_SETTING})")
                    parts.append(chunk)
        except TimeoutError:
            self.counters["http.body_timeouts"] += 1
            raise api.ApiError(408, f"request body not received within the router's limit of {self.cfg.body_timeout_s:g} s ({BODY_TIMEOUT_SETTING})") from None
        except ClientDisconnect:  # escaped as a 500 with a traceback in the log (Starlette's ServerErrorMiddleware)
            self.counters["http.body_disconnects"] += 1
            raise api.ApiError(499, f"client closed the connection after {size} of its body's bytes") from None
        return b"".join(parts)

    async def _completions(self, request: Request) -> Response:
        return await self._bus_guard(self._generate(request, chat=False))

    async def _chat(self, request: Request) -> Response:
        return await self._bus_guard(self._generate(request, chat=True))

    async def _bus_guard(self, handler: Coroutine[Any, Any, Response]) -> Response:
        """A bus failure (NATS down, reconnect buffer full) is a 503 with the reason, never a bare 500."""
        try:
            return await handler
        except BusError as e:
            self.counters["bus_errors"] += 1
            self.log.warning("request failed on the message bus", error=str(e))
            return self._error(503, f"message bus unavailable: {e}")

    async def _prepare(self, request: Request, chat: bool) -> tuple[api.BranchHeaders, Any, np.ndarray, int, bytes, list[int], str]:
        """Validate headers and body, tokenize; returns (headers, request, token ids, max_tokens, the ids
        packed as little-endian uint32, their block hashes, the echo text). The body's work (:meth:`_prepare_body`)
        runs in a worker thread when the body is over ``_BIG_TEXT`` bytes (:func:`_off_loop_if_big`).

        Raises:
            ApiError: the 4xx to answer.
        """
        hdrs = api.parse_branch_headers(request.headers, self.cfg.max_id_len)
        body = await self._read_body(request)
        # the body's size, not the prompt's: tools (and tool calls) are rendered too (5.9 MB of tools took
        # 0.5 s on the loop when only contents were counted), and a prompt of ids is parsed, made an array,
        # packed and hashed (1M ids, 6.2 MB: 140 ms on the loop at block_size 16, 90 ms at 64)
        ctx = self.context_limit()  # read here, on the loop: the node view is not read from a worker thread
        try:
            req, arr, max_tokens, packed, hashes, echo = await self._off_loop(request, body, lambda b: self._prepare_body(b, chat, ctx))
        except api.RenderRequestTemplate as t:
            text = await self._render_request_template(t)
            req, arr, max_tokens, packed, hashes, echo = await self._off_loop_rendered(
                request, body, text, lambda b: self._prepare_body(b, chat, ctx, text),
            )
        return hdrs, req, arr, max_tokens, packed, hashes, echo

    async def _render_request_template(self, t: api.RenderRequestTemplate) -> str:
        """The text of a request's own chat template (``--trust-request-chat-template``), rendered in the router's
        child processes (``services.router.template_pool``: :data:`~services.router.template_pool.RENDER_DEADLINE_S`
        seconds, :data:`~services.router.template_pool.CHILD_MEMORY_BYTES` bytes, a text of at most
        ``--max-body-bytes`` characters); the event loop only awaits the child's pipe.

        Raises:
            ApiError: 400 naming the template's field for a template that fails, runs past the deadline or out of
                memory; 503 when every child stayed busy.
        """
        if self._templates is None:  # render_chat raises RenderRequestTemplate only for a trusting router
            raise api.ApiError(400, api.UNTRUSTED_CHAT_TEMPLATE, param=t.param)
        req = t.req
        try:
            return await self._templates.render(
                t.template, api.chat_messages(req), req.tools, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, special=self.tokenizer_special_tokens(),
                kwargs=api.template_kwargs(req), max_chars=self.cfg.max_body_bytes,
            )
        except TemplateRenderError as e:
            self.counters["chat_template.refused"] += 1
            raise api.ApiError(e.status, f"{t.param}: {e}", param=t.param) from None

    def tokenizer_special_tokens(self) -> dict[str, str]:
        """The model's named special tokens (``bos_token``...: text) a chat template sees; {} for the sim tokenizer."""
        return dict(getattr(self.tokenizer, "special_token_texts", {}) or {})

    async def _off_loop_rendered(self, request: Request, body: bytes, text: str, run: Callable[[bytes], _T]) -> _T:
        """:meth:`_off_loop` for a body whose request template rendered ``text``: in a worker thread when the text
        is over ``_BIG_TEXT`` characters too (it is tokenized there), though the body is small."""
        if len(body) <= _BIG_TEXT < len(text):
            return await asyncio.to_thread(run, body)
        return await self._off_loop(request, body, run)

    def _prepare_body(
        self, body: bytes, chat: bool, ctx: int, rendered: str | None = None,
    ) -> tuple[Any, np.ndarray, int, bytes, list[int], str]:
        """Parse and check a generation body and tokenize its prompt: (request, token ids, max_tokens, the
        ids packed as little-endian uint32, their block hashes at ``block_size``, the echo text: the
        completions prompt for ``echo``, as sent or a token-id prompt detokenized with its special tokens; a chat's
        ``api.chat_echo``; else ""). No await and
        no state written: it may run in a worker thread. ``ctx``: the prompt + max_tokens limit in tokens
        (:meth:`context_limit`; 0 = none). ``rendered``: the request's own chat template's text
        (:meth:`_render_request_template`), for a body whose first pass raised ``api.RenderRequestTemplate``.

        Raises:
            ApiError: the 4xx to answer.
            api.RenderRequestTemplate: a request template to render first (``rendered`` None).
        """
        prompt: str | list[int] | None = None
        asked: int | None  # the client's max_tokens; None: a default, cut to the context left after the prompt
        field = "max_tokens"  # the field the client sent it in, as errors name it
        if chat:
            req: Any = api.parse_chat(body)
            if not self.cfg.enable_auto_tool_choice and api.tool_choice(req) == "auto":  # vLLM's serving_chat refuses it
                raise api.ApiError(400, api.AUTO_TOOL_CHOICE_OFF, param="tool_choice")
            asked = req.max_completion_tokens or req.max_tokens
            if req.max_completion_tokens:
                field = "max_completion_tokens"
            max_tokens = asked or self.cfg.chat_default_max_tokens
        else:
            req, prompt = api.parse_completion(body)
            asked = req.max_tokens
            max_tokens = asked or 16
        self._check_model(req.model)
        if asked is None:  # a default the client never sent is cut to the limit, not refused (like the context cut below)
            max_tokens = min(max_tokens, self.cfg.max_output_tokens)
        elif not ctx:  # no context to check first (vLLM's order, below): refused before a long prompt is tokenized
            self._check_output_limit(max_tokens, field)
        part = "messages" if chat else "prompt"
        if isinstance(prompt, str):
            # refused before it is tokenized when even a lower bound on its tokens is too many (a 3 MB text took
            # 5.8 s of a core to count, only to be refused); exact: the bound never exceeds the count
            self._check_prompt_len(min_prompt_tokens(self.tokenizer, prompt), ctx, part, at_least=True)
        try:
            if chat:
                # bounded as a text prompt, on the template's text (what is tokenized; a template may drop text)
                ids = api.render_chat(
                    self.tokenizer, req, lambda text: self._check_prompt_len(min_prompt_tokens(self.tokenizer, text), ctx, part, at_least=True),
                    trust_request_chat_template=self.cfg.trust_request_chat_template, rendered=rendered,
                )
            elif isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
            else:
                ids = prompt  # type: ignore[assignment]
        except (api.ApiError, api.RenderRequestTemplate):
            raise
        except Exception as e:  # a chat template may raise on a malformed conversation
            raise api.ApiError(400, f"cannot tokenize the prompt: {e}", param=part) from e
        # counted before the array is made: a list of 10M ids takes 0.38 s to convert (holding the GIL, so
        # the event loop waits even when this runs in a worker thread), only to be refused
        if len(ids) == 0:
            raise api.ApiError(400, "prompt encodes to no tokens", param="prompt")
        self._check_prompt_len(len(ids), ctx, part)
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except OverflowError:  # an id past int64 (the decoder takes any int, so its 400 is the vocabulary's)
            api.check_token_ids(ids, self.vocab_size, "prompt", self._vocab_what)
            raise
        if ctx:  # the model's context, lowered to what the largest node's KV holds
            # vLLM: an unset max_tokens is the context left after the prompt (here at most the default);
            # a set one that does not fit is a 400 with vLLM's / OpenAI's message naming the field it came in,
            # before the router's own --max-output-tokens (a limit a client of a 1,024-token model cannot see)
            n = int(arr.size)
            if asked is None:
                max_tokens = min(max_tokens, ctx - n)
            elif n + asked > ctx:
                raise api.ApiError(
                    400,
                    f"This model's maximum context length is {ctx} tokens. However, you requested {n + asked} tokens "
                    f"({n} in the {part}, {asked} in the completion). Please reduce the length of the {part} or completion.",
                    param=field,
                )
        self._check_output_limit(max_tokens, field)  # only an asked-for one can fail: a default was cut to it above
        if req.min_tokens and req.min_tokens > max_tokens:
            # vLLM checks min_tokens against the max_tokens it uses (defaulted, cut to the context) too:
            # sent on, a request with a default max_tokens below it ended before its min_tokens
            raise api.ApiError(
                400, f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens}, the limit this request gets)", param="min_tokens"
            )
        if int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size:
            api.check_token_ids(ids, self.vocab_size, "prompt", self._vocab_what)  # names the first (a Python scan, only here)
        packed = arr.astype("<u4").tobytes()
        # a token-id prompt is echoed with its special tokens' text (vLLM detokenizes it for echo with the
        # tokenizer's batch_decode defaults: skip_special_tokens False), unlike output text
        if chat:
            echo = api.chat_echo(req)
        else:
            echo = "" if not req.echo else prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
        return req, arr, max_tokens, packed, block_hashes_packed(packed, self.cfg.block_size), echo

    def _check_output_limit(self, max_tokens: int, field: str) -> None:
        """Refuse a ``max_tokens`` over the router's ``--max-output-tokens``; ``field``: the name the client sent
        it under (``max_tokens`` or ``max_completion_tokens``), the error's ``param``.

        Raises:
            ApiError: 400.
        """
        if max_tokens > self.cfg.max_output_tokens:
            raise api.ApiError(400, f"{field}={max_tokens} exceeds the limit {self.cfg.max_output_tokens}", param=field)

    def _check_prompt_len(self, n: int, ctx: int, part: str, *, at_least: bool = False) -> None:
        """Refuse a prompt of ``n`` tokens (``at_least``: a lower bound on its count, before it is tokenized) that
        fills the model's context ``ctx`` (0: none), with vLLM's message for an input that leaves no room for an
        output token, whether or not ``max_tokens`` was sent (vLLM's ``_validate_input`` checks it first), or that
        is longer than ``max_prompt_tokens``. ``part``: ``prompt`` or ``messages``, the error's ``param``. A lower
        bound keeps vLLM's sentence as it is (clients read the count with ``your request has (\\d+) input tokens``)
        and says after it that the count is one.

        Raises:
            ApiError: 400.
        """
        note = f" ({n} is a lower bound: the prompt was refused before it was tokenized.)" if at_least else ""
        if ctx and n >= ctx:
            raise api.ApiError(
                400, f"This model's maximum context length is {ctx} tokens. However, your request has {n} input tokens. "
                f"Please reduce the length of the input messages.{note}", param=part,
            )
        if n > self.cfg.max_prompt_tokens:
            has = f"at least {n}" if at_least else f"{n}"
            raise api.ApiError(400, f"prompt has {has} tokens; at most {self.cfg.max_prompt_tokens} allowed", param=part)

    async def _lookup(self, hashes: list[int], tr: _ReqTrace | None = None, rid: str = "") -> tuple[m.KvLookupReply | None, str]:
        if not hashes:
            return None, "skipped"
        span = None if tr is None else tracing.start("router.kv_lookup", tr.span, kind=tracing.SpanKind.CLIENT, attributes={
            "ei.rid": rid, "messaging.system": "nats", "messaging.destination.name": KV_LOOKUP.template,
            "messaging.operation.type": "send",
        })  # fmt: skip
        try:
            rep = await self.bus.request(
                KV_LOOKUP,
                m.KvLookupRequest(block_hashes=hashes, block_size=self.cfg.block_size, rid=rid),
                timeout=self.cfg.lookup_timeout_s,
                headers=None if span is None else tracing.inject(span),
            )
        except BusError as e:
            self.counters["lookups_failed"] += 1
            if self._lookup_ok:
                self._lookup_ok = False
                self.log.warning("kv.lookup failed; routing without cache information", error=str(e),
                                 timeout_s=self.cfg.lookup_timeout_s, setting=LOOKUP_TIMEOUT_HINT)
            return None, "failed"
        finally:
            if span is not None:
                span.end()
        if not self._lookup_ok:
            self._lookup_ok = True
            self.log.info("kv.lookup answers again")
        if rep.error:
            self.counters["lookups_refused"] += 1
            self.log.error("kv.lookup refused; routing without cache information", error=rep.error)
            return None, "refused"
        if rep.block_size != self.cfg.block_size:
            self.counters["lookups_block_size_mismatch"] += 1
            self.log.error(
                "BLOCK SIZE MISMATCH: the directory answers with another block size; routing without cache information",
                directory_block_size=rep.block_size,
                router_block_size=self.cfg.block_size,
            )
            return None, "block_size_mismatch"
        return rep, "ok"

    def _gone_before_dispatch(self) -> Response:
        """The client closed the connection before its request was sent to a node: nothing is sent (499, never read)."""
        self.counters["http.gone_before_dispatch"] += 1
        return self._error(499, "client closed the connection before its request was dispatched")

    async def _wait_disconnect(self, receive: Receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return

    async def _next_item(self, p: _Pending, watcher: asyncio.Future[None] | None) -> m.TokenChunk | _Failure:
        """Next chunk or failure of ``p``; a timeout becomes a 504 failure.

        Raises:
            _ClientGone: if ``watcher`` (the disconnect watcher) fires first.
        """
        if not p.queue.empty():
            return self._took(p, p.queue.get_nowait())
        get = asyncio.ensure_future(p.queue.get())
        waiters: set[asyncio.Future[Any]] = {get} if watcher is None else {get, watcher}
        try:
            done, _ = await asyncio.wait(waiters, timeout=self.cfg.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        if get in done:
            return self._took(p, get.result())
        if watcher is not None and watcher in done:
            raise _ClientGone
        reason = f"no output for {self.cfg.request_timeout_s:g}s (request_timeout_s)"
        self._abandon(p, reason, "timeout")
        return _Failure(504, reason)

    def _chunk_failure(self, chunk: m.TokenChunk) -> _Failure | None:
        if chunk.finish_reason == "error":
            return _Failure(500, f"engine error on node {chunk.node or '?'}: {chunk.error or 'no detail'}")
        if chunk.finish_reason == "abort":
            return _Failure(503, f"request aborted by node {chunk.node or '?'}: {chunk.error or 'no detail'}")
        return None

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        if not tracing.ENABLED and not self.cfg.log_requests:
            return await self._generate_traced(request, chat, None, None)
        tr = None
        if tracing.ENABLED:
            span = tracing.start(
                "router.request", tracing.extract(request.headers), kind=tracing.SpanKind.SERVER, attributes={
                    "http.route": request.url.path, "http.request.method": request.method,
                    "gen_ai.operation.name": "chat" if chat else "text_completion",
                },
            )  # fmt: skip
            ident = request_id_of(request.scope)  # a refused request is found by it too
            span.set_attributes({"ei.rid": ident.rid, **_client_id_fields(ident.rid, ident.client, key="ei.client_request_id")})
            tr = _ReqTrace(span)
        rl = _ReqLog() if self.cfg.log_requests else None

        def ended(status: int, resp: Response | None) -> None:
            if tr is not None:
                tr.end(status, error=_error_message(resp) if status >= 500 else None)
            if rl is not None:
                self._log_end(rl, status, request, resp)

        try:
            resp = await self._generate_traced(request, chat, tr, rl)
        except BaseException as e:
            ended(503 if isinstance(e, BusError) else 500, None)  # a bus failure is answered 503 (_bus_guard)
            raise
        if isinstance(resp, (_SseResponse, _WatchedResponse)):
            close = resp._on_close

            def on_close() -> None:
                close()  # counts its end (or a stream's whose body never ran) before it is logged
                ended(resp.status_code, None)

            resp._on_close = on_close
        else:
            ended(resp.status_code, resp)
        return resp

    def _refused(self, scope: Scope, status: int, error: str) -> None:
        """A request the ingress guard refused (400: Authorization sent twice with different values; 401: no or unknown
        API key; 429: its key's requests in flight):
        with ``--log-requests`` a ``request rejected`` line (status, the id of the response's ``x-request-id``:
        a valid client ``X-Request-ID`` or the one the router made, the error message; never the key; on a path
        other than the generation paths also ``path`` and ``method``; before, those were not logged); a
        generation request's, with tracing on, also its ``router.request`` span (status code, ``error.type``,
        ``ei.rid`` of that id), as a request refused past the guard has."""
        ident = request_id_of(scope)  # the response's x-request-id (_RequestIdHeader)
        if scope["path"] not in _GENERATE_PATHS:
            if self.cfg.log_requests:
                self._log_rejected(ident, status, error, scope, path=True)
            return
        if tracing.ENABLED:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            span = tracing.start("router.request", tracing.extract(headers), kind=tracing.SpanKind.SERVER, attributes={
                "http.route": scope["path"], "http.request.method": scope.get("method", "POST"),
            })  # fmt: skip
            span.set_attributes({"ei.rid": ident.rid, **_client_id_fields(ident.rid, ident.client, key="ei.client_request_id")})
            _ReqTrace(span).end(status, error=error)
        if self.cfg.log_requests:
            self._log_rejected(ident, status, error, scope)

    def _log_rejected(self, ident: _RequestId, status: int, error: str | None, scope: Scope, *, path: bool = False) -> None:
        """``--log-requests``' ``request rejected`` line: the rid of ``ident``, the request's id
        (:func:`request_id_of`: the client's valid ``X-Request-ID``, else an id the router made, the response's
        ``x-request-id``; an invalid client value, maybe the reason for the refusal, is never logged), and the
        value as sent, ``client_request_id``, when the rid is not it; the status, the error; who sent it (``scope``,
        the request's ASGI scope: :func:`_peer_fields`, ``client`` address, ``key`` id); with ``path`` (a request on
        a path other than the generation paths: a 401, 404 or 429) also its ``path`` and ``method``. Before, the
        scope was passed twice (``scope`` for the path, ``conn`` for the peer), always the same one."""
        extra = _client_id_fields(ident.rid, ident.client)
        extra.update(_peer_fields(scope))
        if path:
            shown = scope["path"][:256]  # percent-decoded: a %0A in it is shown escaped, never as a line break
            extra.update(path=shown if shown.isprintable() else ascii(shown)[1:-1], method=scope.get("method", ""))
        self.log.info("request rejected", rid=ident.rid, **extra, status=status, error=error)

    def _log_end(self, rl: _ReqLog, status: int, request: Request, resp: Response | None) -> None:
        """``--log-requests``: the info line of a request's end (``request finished``), or of one
        refused before it was accepted (``request rejected``: status, the id of the response's
        ``x-request-id``, the error message). Times are the router clock's seconds (wall × ``--speedup``)."""
        if rl.rid is None:
            self._log_rejected(request_id_of(request.scope), status, _error_message(resp), request.scope)
            return
        p = rl.p
        extra = {**_client_id_fields(rl.rid, rl.client_id), **_peer_fields(request.scope)}
        if p is None:  # accepted, failed before it was placed (no route, dispatch failed)
            self.log.info("request finished", rid=rl.rid, **extra, status=status, finish_reason=None, prompt_tokens=rl.prompt_tokens)
            return
        self.log.info(
            "request finished",
            rid=p.rid, **extra, status=status, finish_reason=p.counted, prompt_tokens=rl.prompt_tokens, cached_tokens=p.cached_tokens,
            output_tokens=p.out_tokens, ttft_s=None if p.ttft_s is None else round(p.ttft_s, 6),
            e2e_s=round(self.clock.now() - p.t_in, 6), prefill=p.prefill_node, decode=p.decode_node,
            redispatches=p.attempt - p.first_attempt,
        )  # fmt: skip

    def _check_model_engines(self, param: str) -> None:
        """A request asks for ``param``, ``logprobs`` or ``logit_bias``, which need a model's logits:
        refuse it (400 naming ``param``) when a node it may be placed on runs the sim engine, which has
        no model (its nodes refuse such a work).

        Every node: no node can serve it, the client's request is at fault. Some nodes (a cluster that
        mixes engines): the router places a request on any eligible prefill and decode node, and on
        another one after a node fails or hands it back, so it cannot promise a model engine for the
        whole request; before, it was dispatched and a sim node's refusal came back as a 500
        ``engine error``. The nodes counted are those with a state and not fenced out
        (:meth:`NodeLoadView.nodes_with_engine`). Counted ``<param>_refused_sim``.

        Raises:
            api.ApiError: 400 naming the sim nodes.
        """
        view = self.core.view
        sim = view.nodes_with_engine("sim")
        if not sim:
            return
        self.counters[f"{param}_refused_sim"] += 1
        if view.engines() == {"sim"}:  # no node has a model to take log-probabilities from
            raise api.ApiError(
                400, f"{param} needs a model's logits: every node of this cluster runs the sim engine (start workers "
                "with --engine torch to get them)", param=param,
            )
        shown = ", ".join(sim[:8]) + (f" and {len(sim) - 8} more" if len(sim) > 8 else "")
        raise api.ApiError(
            400, f"{param} needs a model's logits: node(s) {shown} of this cluster run the sim engine (no model) and the "
            f"request may be placed there; serve {param} from a cluster whose nodes all run --engine torch", param=param,
        )

    def _check_kv_room(self, prompt_tokens: int, max_tokens: int, chat: bool) -> None:
        """Refuse (400) a request no node of the cluster could hold: its KV footprint, ``prompt_tokens``
        + ``max_tokens`` in blocks of ``block_size`` tokens (:func:`~services.router.nodes.kv_blocks`), is more
        than the largest GPU KV memory (L1, ``NodeState.gpu_total_blocks``) of the nodes that reported and have not
        left for good (:meth:`largest_kv`: fenced ones included until ``--forget-node-after-s``; one only a fenced
        node holds waits for it, then 503s: :meth:`RouterCore.route` offers
        only the nodes that hold a request, in placement and re-dispatch alike). A node reserves a request's whole
        footprint when it takes it (no preemption, ``services/worker/scheduler.py``) and refuses one that
        exceeds its L1; before, such a request was dispatched and that refusal came back as a 500
        ``engine error on node w0: request needs 5003 KV blocks but node w0 has 64 in GPU memory``
        although the request, not an engine, was at fault (vLLM answers a prompt longer than it can
        hold with a 400). ``param`` names the prompt (``messages`` for chat) when the prompt alone does
        not fit, else ``max_tokens``. Nothing is checked while no node reports its capacity
        (:meth:`largest_kv`); counted ``kv_room_refused``.

        Raises:
            api.ApiError: 400 with both sizes and the node that holds most.
        """
        largest = self.largest_kv()
        if largest is None:
            return
        blocks, node = largest
        bs = self.cfg.block_size
        need = kv_blocks(prompt_tokens, max_tokens, bs)
        if need <= blocks:
            return
        self.counters["kv_room_refused"] += 1
        part = "messages" if chat else "prompt"
        alone = kv_blocks(prompt_tokens, 0, bs) > blocks
        raise api.ApiError(
            400, f"request needs {need} KV blocks of {bs} tokens ({prompt_tokens} in the {part}, {max_tokens} in the completion) "
            f"but the node of this cluster with the most GPU KV memory ({node}) holds {blocks} ({blocks * bs} tokens); "
            f"reduce the length of the {part}" + ("" if alone else " or max_tokens"),
            param=part if alone else "max_tokens",
        )

    def _log_parents_missing(self) -> None:
        """A warning per new branch whose ``X-Parent-Branch-Id`` this router does not know or has ended
        (``BranchTable.take_parents_missing``; counted, exactly, in ``ei_router_branch_parents_missing_total{reason}``):
        the request is served (the parent may be another router's, or this router restarted), but a harness that
        sends a wrong parent id or ends the parent first loses the fork's sharing hint silently otherwise. The lines
        are rate-limited per state (:attr:`_parent_log`: the first 5 of each 10 s, then one ``log lines suppressed``
        line with the count, written by the fence loop's flush): behind 2+ routers the parent of most forks is
        another router's, and a warning per branch was a line per request at the agents' rate."""
        for bid, parent, state in self.branches.take_parents_missing():
            self._parent_log.event(
                f"branch parent {state}", f"branch parent {state}", branch=bid, parent=parent,
                hint="served; the parent's prefix is not known to this router to be shared (it may be another "
                "router's, or this router restarted)" if state == "unknown" else "served; the parent branch was ended "
                "here before its fork or sub-agent started",
            )  # fmt: skip

    async def _generate_traced(self, request: Request, chat: bool, tr: _ReqTrace | None, rl: _ReqLog | None) -> Response:
        """The generation endpoints; ``tr``: the request's spans (None when tracing is off); ``rl``: its
        ``--log-requests`` record (None when off)."""
        t_in = self.clock.now()
        if self._stopping:
            return self._error(503, "router is shutting down")
        if self._draining and (self.cfg.listen_fd < 0 or time.monotonic() >= self._drain_serve_until):
            # a SIGTERM's drain: the requests taken finish, a new one goes to another router; on a held socket (the
            # next router comes after this one exits) it is served here in the drain's first half (DRAIN_SERVE_FRACTION),
            # counted drain_served, and after it refused too, counted drain_refused_late: its retry connects into the
            # accept queue (every response there says Connection: close, _stop_accepting)
            self.counters["drain_refused"] += 1
            if self.cfg.listen_fd >= 0:
                self.counters["drain_refused_late"] += 1
            return self._json(api.error_body(503, "router draining for a shutdown; retry on another router"), 503,
                              headers={"retry-after": "1"})
        if self._draining:
            self.counters["drain_served"] += 1
        self._handling += 1
        try:
            return await self._generate_taken(request, chat, tr, rl, t_in)
        finally:
            self._handling -= 1

    async def _generate_taken(self, request: Request, chat: bool, tr: _ReqTrace | None, rl: _ReqLog | None, t_in: float) -> Response:
        """:meth:`_generate_traced` for a request taken (not refused for a stop or drain)."""
        try:
            # the rid is a function of the id as sent that never gives two ids one rid (api.request_rid):
            # a duplicate in flight is the same id as sent, whatever characters it holds; the header was
            # read once, by _RequestIdHeader (its id, rid, or why it is invalid: answered 400 here)
            ident = request_id_of(request.scope)
            if ident.error is not None:
                raise ident.error
            client_id = ident.client
            client_rid = None if client_id is None else ident.rid
            if client_rid is not None and self._in_flight(client_rid) and not await self._rid_freed(client_rid):
                return await self._duplicate_answer(client_rid, repr(client_id))
            hdrs, req, arr, max_tokens, packed, hashes, echo = await self._prepare(request, chat)
            if api.logprobs_asked(req) is not None:
                self._check_model_engines("logprobs")
            if req.logit_bias:
                api.check_logit_bias(req, self.vocab_size, self._vocab_what)
                self._check_model_engines("logit_bias")
            self._check_kv_room(int(arr.size), max_tokens, chat)
            start = None
            if hdrs.branch_id is not None:
                start = self.branches.observe(  # branch TTL on the monotonic clock: a wall-clock step expires no branch
                    hdrs.branch_id, self.clock.local_now(), kind=hdrs.kind, parent=hdrs.parent_branch_id,
                    agent_id=hdrs.agent_id, ts=self.clock.now(),
                )
                self._log_parents_missing()
        except api.ApiError as e:
            return self._error(e.status, e.reason, e.param)
        except BranchError as e:  # an ended branch names X-Branch-Id, a cycle X-Parent-Branch-Id (400s)
            return self._error(e.status, e.reason, e.param)
        branch_held = hdrs.branch_id  # observe counted a request in flight on it: done() once it is over
        # the body is read: receive() now returns only at a disconnect. A client gone while its body was parsed and
        # tokenized (or during the lookup, or the wait for a node) is not dispatched (http.gone_before_dispatch)
        watcher = asyncio.ensure_future(self._wait_disconnect(request.receive))
        watching = False  # True once it is the non-streamed response's watcher
        try:
            if tr is not None:
                tr.asked(self.cfg.model, req, max_tokens)
            if start is not None:
                await self.bus.publish(BRANCH_EVENTS, start)
                self.counters["branches_started"] += 1
                await self._publish_evicted()

            # the client's X-Request-ID (api.request_rid of it when it is not one NATS subject token) is the rid
            # on every node and in every log line, so records join; the response's x-request-id is the id as
            # sent and the body's id chatcmpl-/cmpl-<id as sent> (api.response_id, vLLM's)
            rid, shown = ident.rid, ident.shown  # the id of its x-request-id: the client's as sent, or one the router made
            if tr is not None:
                tr.span.set_attribute("ei.rid", rid)
            lookup, lookup_status = await self._lookup(hashes, tr, rid)
            if watcher.done():  # nothing routed yet: nothing to undo
                return self._gone_before_dispatch()
            if self._in_flight(rid):  # the same X-Request-ID arrived while this one was tokenized
                return await self._duplicate_answer(rid, repr(shown))
            if rl is not None:
                rl.rid, rl.client_id, rl.prompt_tokens = rid, client_id, int(arr.size)
                self.log.info(
                    "request accepted", rid=rid, **_client_id_fields(rid, client_id), **_peer_fields(request.scope),
                    branch=hdrs.branch_id, **_hint_fields(hdrs),
                    prompt_tokens=rl.prompt_tokens, max_tokens=max_tokens, stream=bool(req.stream), api="chat" if chat else "completions",
                )  # fmt: skip
            rreq = RouteRequest(
                rid=rid,
                prompt_tokens=int(arr.size),
                block_hashes=hashes,
                max_tokens=max_tokens,
                token_ids=packed,
                branch_id=hdrs.branch_id,
                ignore_eos=req.ignore_eos,
                sampling=api.sampling(req),
            )
            self._routing.add(rid)  # until it is pending (no await between): a duplicate in the meantime is a 409
            try:
                out = await self._route_new(rreq, lookup, lookup_status, tr)
            except _PeerPlaced:  # another router placed it while this one waited (a lookup, a wait for a node)
                self.counters["duplicate_rid.peer_placed"] += 1
                return await self._duplicate_answer(rid, repr(shown))
            finally:
                self._routing.discard(rid)
            if isinstance(out, NoRoute):
                self.counters["no_route"] += 1
                self.log.warning("no route", rid=rid, reason=out.reason)
                return self._error(503, out.reason)
            self._log_route(rreq, out, lookup_status)
            p = _Pending(
                rid=rid, prefill_node=out.prefill.node, decode_node=out.decode_node, predicted_ttft_s=out.predicted_ttft_s, t_in=t_in,
                tr=tr,
            )
            p.rreq = p.cur = rreq
            if tr is not None:
                tr.p = p
            p.stops = bool(api.stop_strings(req) or req.stop_token_ids)
            if rl is not None:
                rl.p = p
            if client_rid is not None:  # a retry of an ended request with this id starts past its attempts
                p.client_rid, p.client_id = True, client_id
                p.attempt = p.first_attempt = self._retried.next_attempt(rid)
            self._pending[rid] = p
            branch_held = None  # from here _forget(p) ends it (BranchTable.done)
            if not watcher.done():
                await asyncio.sleep(0)  # a watcher that has not run yet reads a disconnect already received
            if watcher.done():  # gone while it waited for a route: placed, not sent
                self._forget(p)
                self._abandon(p, "client disconnected before dispatch", "gone_before_dispatch", tell_nodes=False)
                return self._gone_before_dispatch()
            watching = True
        finally:
            if branch_held is not None:
                self.branches.done(branch_held, self.clock.local_now())
            if not watching:
                watcher.cancel()
        try:
            for placed in out.placed:
                await self._publish_placed(placed)
            await self.bus.publish(
                WORK_PREFILL, self._work(p, out), node=out.prefill.node, headers=None if tr is None else tracing.inject(tr.span)
            )
        except Exception as e:
            watcher.cancel()
            self._forget(p)
            self._abandon(p, "dispatch failed", "dispatch_failed")
            self.log.error("dispatch failed", rid=rid, error=repr(e))
            return self._error(503, f"cannot dispatch to node {out.prefill.node}: {e}")
        self.counters["routed"] += 1
        self.counters[f"routed.prefill.{out.prefill.node}"] += 1
        self.counters[f"route_path.{out.prefill.path}"] += 1
        if out.decode_node is not None:
            self.counters[f"routed.decode.{out.decode_node}"] += 1

        stream = bool(req.stream)
        opts = req.stream_options
        include_usage = bool(stream and opts is not None and opts.include_usage)
        continuous_usage = bool(stream and opts is not None and opts.continuous_usage_stats)
        created = int(time.time())
        if stream:
            # status and headers go out now, at acceptance (a client sees its request taken before
            # the first token); what fails before the first token is an SSE error event. The nodes
            # are the placement at dispatch: the ``ei`` object of the last chunk has the final one.
            headers = {"x-request-id": shown, "x-ei-prefill-node": p.prefill_node}
            if p.decode_node is not None:
                headers["x-ei-decode-node"] = p.decode_node
            watcher.cancel()  # the SSE response watches the connection itself
            gen = self._stream(
                p, rreq, chat, created, include_usage, continuous_usage, self._output_text(req), api.logprobs_asked(req), echo,
                api.reply_role(req) if chat else "assistant", toolcalls.HermesStream() if chat and self._parses_tools(req) else None,
            )
            sse = _SseResponse(
                gen,
                on_close=lambda: self._close_stream(p),
                on_stall=lambda: self._send_stalled(p),
                stall_s=self.cfg.stream_stall_timeout_s,
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
            )
            # only once the response exists: its end is counted when its call returns (_close_stream); one that
            # failed to build is a 500 counted by the except below, with the stall guard still on
            p.reset = request.scope.get("extensions", {}).get(RESET_EXTENSION)
            p.response_on = True
            request.scope[OWN_SEND_WATCH_SCOPE_KEY] = True
            return sse
        try:
            first = await self._next_item(p, watcher)
            if isinstance(first, _Failure):
                return self._error(first.status, first.reason)
            fail = self._chunk_failure(first) if first.finished else None
            if fail is not None:
                return self._error(fail.status, fail.reason)
            ids: list[int] = list(first.token_ids)
            lp_top = api.logprobs_asked(req)
            lps: list[api.LogprobEntry] = _lp_entries(first) if lp_top is not None else []
            prompt_tokens = first.prompt_tokens or rreq.prompt_tokens
            cached = first.cached_tokens
            last = first
            # with stop strings / stop token ids the text is made as the ids arrive (it may end
            # before the node ends the request); without, once at the end as before
            stops = self._output_text(req) if p.stops else None
            if stops is not None:
                stops.push(first.token_ids)
            while not last.finished and not (stops is not None and stops.stopped):
                item = await self._next_item(p, watcher)
                if isinstance(item, _Failure):
                    return self._error(item.status, item.reason)
                if item.finished:
                    fail = self._chunk_failure(item)
                    if fail is not None:
                        return self._error(fail.status, fail.reason)
                ids.extend(item.token_ids)
                if lp_top is not None:
                    lps.extend(_lp_entries(item))
                last = item
                if stops is not None:
                    stops.push(item.token_ids)
            finish_reason, stop_reason, n_out = last.finish_reason, None, len(ids)
            if stops is None:
                text = self._output_tokenizer(req).decode(ids)
            else:
                stops.finish()
                text, n_out = stops.text, stops.tokens
                if stops.stopped:
                    finish_reason, stop_reason = "stop", stops.stop_reason
                    self._end_at_stop(p, stops)
            use = api.usage(prompt_tokens, n_out, cached)
            model = self.cfg.model  # the first served name, whichever one (or alias) the request gave: see _stream
            oid = api.response_id(shown, chat=chat)
            lp_body = None
            if lp_top is not None:  # one entry per token that counts (vLLM: up to the one that completed a stop)
                lp_body = (api.chat_logprobs if chat else api.completion_logprobs)(lps[:n_out], lp_top, self._token_text)
            if chat:
                content: str | None = echo + text
                calls: list[dict[str, Any]] | None = None
                if self._parses_tools(req):  # the calls in the output (not in the echoed message)
                    said, found = toolcalls.extract(text)
                    if found:
                        content = (echo + (said or "")) or None
                        calls = [c.message() for c in found]
                        finish_reason = toolcalls.finish_reason(finish_reason, len(found))
                body = api.chat_response(
                    oid, created, model, content, finish_reason, use, stop_reason=stop_reason, logprobs=lp_body, role=api.reply_role(req),
                    tool_calls=calls,
                )
            else:
                body = api.completion_response(oid, created, model, echo + text, finish_reason, use, stop_reason=stop_reason, logprobs=lp_body)
            body["ei"] = self._ei(p)
            self.core.metrics.observe_delivered(n_out)
            # placement as of the response's end, as its ``ei``: a handed-back request was placed again, and
            # the decode node of a request bound at prefill start may be bound after its first token (its
            # prefill node sends that token at the prompt's end, before route.bind is answered)
            headers = {"x-request-id": shown, "x-ei-prefill-node": p.prefill_node}
            if p.decode_node is not None:
                headers["x-ei-decode-node"] = p.decode_node
            # its sends timed as a stream's: one that stalls (uvicorn drains before it writes: behind a big body still
            # buffered on a keep-alive connection whose client reads nothing) aborts it as too slow and resets the
            # connection; its end is counted once its sends are done (_close_stream), as a stream's
            watched = _WatchedResponse(
                _JSON.encode(body), on_close=lambda: self._close_stream(p), on_stall=lambda: self._send_stalled(p),
                stall_s=self.cfg.stream_stall_timeout_s, media_type="application/json", headers=headers,
            )
            # only once the body is encoded and the response built: a body that fails to encode is a 500 counted
            # `error` by the except below (with response_on set first, it was counted nowhere), the guard still on
            p.reset = request.scope.get("extensions", {}).get(RESET_EXTENSION)
            p.response_on = True
            request.scope[OWN_SEND_WATCH_SCOPE_KEY] = True
            return watched
        except _ClientGone:
            self._abandon(p, "client disconnected", "client_disconnect")
            self.log.info("client disconnected; request aborted", rid=rid)
            return Response(status_code=499)
        except Exception as e:  # a bug making the response: the app answers it as a 500 (``unexpected``)
            self._failed_after_end(p, f"internal error in the router: {type(e).__name__}", "internal_error")
            raise
        finally:
            if not watcher.done():
                watcher.cancel()
            self._forget(p)

    async def _stream(
        self, p: _Pending, rreq: RouteRequest, chat: bool, created: int, include_usage: bool, continuous_usage: bool,
        decoder: OutputText, lp_top: int | None = None, echo: str = "", role: str = "assistant",
        tools: toolcalls.HermesStream | None = None,
    ) -> AsyncIterator[bytes]:
        """SSE body from acceptance on: data chunks (one per TokenChunk whose text is not empty),
        optional usage chunk, ``[DONE]``; an error event on failure. With ``continuous_usage``
        (``stream_options.continuous_usage_stats``, vLLM) every data chunk carries ``usage`` so far.
        ``decoder`` makes the text: at a stop string / stop token id the stream ends there
        (``finish_reason`` ``stop``) and the request is dropped on its nodes; text a stop string
        may still cut is held back (``services.router.stops``). ``lp_top`` (``api.logprobs_asked``)
        not None: each data chunk carries the logprobs of the tokens counted since the last one
        (``decoder.tokens``), so the stream's entries are the whole response's. ``echo`` (completions'
        ``echo``: the prompt's text) starts the first data chunk's text, as vLLM's first chunk
        is the prompt and the first output text; a chat's (``api.chat_echo``) is its own chunk after
        the role's, as vLLM's; ``role`` (``api.reply_role``) is the first chat chunk's. ``tools`` (a chat whose
        output is read for tool calls: ``_parses_tools``): the text goes through it, so a call is held from
        ``<tool_call>`` to ``</tool_call>`` and sent whole as ``delta.tool_calls`` (with the text its chunk has
        besides, as ``delta.content``), and the last chunk's ``finish_reason`` is ``tool_calls`` when the model
        stopped after one (``toolcalls.finish_reason``); a chunk whose text is all held is not sent (its logprobs
        go with the next one sent, as with text a stop string holds back).
        Every chunk's ``model`` is ``--model``, the first served name, whichever name the request gave (vLLM's
        ``--served-model-name``: "The model name in the model field of a response will be the first name in this
        list"; vllm-project/vllm#24663 restored it after a time when the request's name was echoed).
        A client that goes away cancels this generator (Starlette): the request is aborted (finished ``abort``).
        An exception raised on the way (a bug) ends the stream with the API's 500 error event (``internal error in
        the router: <type>``) and ``[DONE]``: logged, counted ``stream_errors_500``, its request dropped on its
        nodes and finished ``error``, also when its node's end came first (:meth:`_end_decided`; before, it was counted
        as that end said, ``stop`` / ``length``; and before that the stream was cut with neither, and counted as a
        client disconnect)."""
        model = self.cfg.model
        oid = api.response_id(p.client_id or p.rid, chat=chat)
        prompt_tokens = rreq.prompt_tokens
        cached = 0
        completed = False

        def sse(obj: Any) -> bytes:
            return b"data: " + _JSON.encode(obj) + b"\n\n"

        def with_usage(obj: dict[str, Any]) -> dict[str, Any]:
            if continuous_usage:
                obj["usage"] = api.usage(prompt_tokens, decoder.tokens, cached)
            return obj

        sent = 0  # output tokens in the data chunks sent so far (ei_router_generation_tokens_total)

        def delivered(upto: int | None = None) -> None:
            """The data chunks sent so far carry ``upto`` output tokens (default: every token decoded so far)."""
            nonlocal sent
            n = decoder.tokens if upto is None else upto
            self.core.metrics.observe_delivered(n - sent)
            sent = n

        lps: list[api.LogprobEntry] = []
        lp_sent = 0  # entries sent so far
        lp_offset = 0  # completions' text_offset of the next entry

        def lp_obj() -> dict[str, Any] | None:
            nonlocal lp_sent, lp_offset
            if lp_top is None:
                return None
            part = lps[lp_sent : decoder.tokens]
            lp_sent += len(part)
            if chat:
                return api.chat_logprobs(part, lp_top, self._token_text)
            out = api.completion_logprobs(part, lp_top, self._token_text, lp_offset)
            lp_offset += sum(len(t) for t in out["tokens"])
            return out

        def piece_obj(
            text: str, finish: str | None, stop_reason: str | int | None = None, calls: list[toolcalls.ToolCall] | None = None,
        ) -> dict[str, Any]:
            lp = lp_obj()
            if chat:
                delta: dict[str, Any] = {"content": text} if text or (finish is None and not calls) else {}
                if calls and tools is not None:  # tools.calls counts them already: the first one's index is the count before
                    delta["tool_calls"] = [c.delta(tools.calls - len(calls) + k) for k, c in enumerate(calls)]
                return with_usage(api.chat_chunk(oid, created, model, delta, finish, include_usage, stop_reason=stop_reason, logprobs=lp))
            return with_usage(api.completion_chunk(oid, created, model, text, finish, include_usage, stop_reason=stop_reason, logprobs=lp))

        held: list[bytes] = []
        """Data events made while the stream's next chunk was already queued: sent together with the events after
        them in one body message (one socket write) once the queue is empty, or before the next event that ends the
        stream, or once :data:`SSE_BATCH_EVENTS` are held. A node's step that folds several decode iterations publishes
        a chunk per token at once; one write per event cost the router ~13% of its CPU in the demo (a syscall each).
        The bytes and their order are the same, and nothing waits for them: an event is held only while the next chunk
        is already there."""
        held_upto = 0  # output tokens the held events carry (``delivered`` once they are sent)
        try:
            item: m.TokenChunk | _Failure = await self._next_item(p, None)
            if isinstance(item, m.TokenChunk) and self._chunk_failure(item) is None:
                prompt_tokens = item.prompt_tokens or rreq.prompt_tokens
                cached = item.cached_tokens
                if chat:
                    yield sse(with_usage(api.chat_chunk(oid, created, model, {"role": role, "content": ""}, None, include_usage)))
                    if echo:  # vLLM: the echoed content is its own chunk, after the role's
                        yield sse(with_usage(api.chat_chunk(oid, created, model, {"content": echo}, None, include_usage)))
                        echo = ""
            while True:
                if isinstance(item, _Failure):
                    yield b"".join(held) + sse(api.error_body(item.status, item.reason))
                    if held:
                        held.clear()
                        delivered(held_upto)
                    yield _SSE_DONE
                    completed = True
                    return
                fail = self._chunk_failure(item) if item.finished else None
                if fail is not None:
                    yield b"".join(held) + sse(api.error_body(fail.status, fail.reason))
                    if held:
                        held.clear()
                        delivered(held_upto)
                    yield _SSE_DONE
                    completed = True
                    return
                if lp_top is not None:
                    lps.extend(_lp_entries(item))
                text = echo + decoder.push(item.token_ids)
                echo = ""
                calls: list[toolcalls.ToolCall] = []
                if item.finished or decoder.stopped:
                    text += decoder.finish()
                    if tools is not None:
                        text, calls = tools.push(text)
                        rest, more = tools.finish()
                        text, calls = text + rest, calls + more
                    if decoder.stopped:
                        self._end_at_stop(p, decoder)
                        finish, stop_reason = "stop", decoder.stop_reason
                    else:
                        finish, stop_reason = item.finish_reason or "length", None
                    if tools is not None:
                        finish = toolcalls.finish_reason(finish, tools.calls) or finish
                    last = piece_obj(text, finish, stop_reason, calls)
                    last["ei"] = self._ei(p)
                    yield b"".join(held) + sse(last)
                    held.clear()
                    delivered()
                    break
                if tools is not None:
                    text, calls = tools.push(text)
                if text or calls:
                    held.append(sse(piece_obj(text, None, None, calls)))
                    held_upto = decoder.tokens
                if held and (p.queue.empty() or len(held) >= SSE_BATCH_EVENTS):  # the next chunk is not here yet
                    yield b"".join(held)
                    held.clear()
                    delivered(held_upto)
                item = await self._next_item(p, None)
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                usage = api.usage_chunk(oid, created, model, obj, api.usage(prompt_tokens, decoder.tokens, cached))
                usage["ei"] = self._ei(p)
                yield sse(usage)
            yield _SSE_DONE
            completed = True
        except Exception as e:  # a bug in the output path (not the client's going: that is GeneratorExit / a cancel)
            completed = True
            self.counters["stream_errors_500"] += 1
            self.log.error("unexpected error in a stream; ended with a 500 error event", rid=p.rid, error=repr(e), exc_info=e)
            self._failed_after_end(p, f"internal error in the router: {type(e).__name__}", "internal_error")
            yield b"".join(held) + sse(api.error_body(500, f"internal error in the router: {type(e).__name__}"))
            if held:
                held.clear()
                delivered(held_upto)
            yield _SSE_DONE
        finally:
            if not completed:
                self._abandon(p, "client disconnected", "client_disconnect")
            self._forget(p)

    def _token_text(self, t: int) -> str:
        """One token's own text (a logprob entry's ``token``): the id decoded alone with its special tokens shown, as
        vLLM's ``convert_ids_list_to_tokens`` (``decode([id])`` at the tokenizer's default, ``skip_special_tokens``
        False), so an ``<|im_end|>`` the model chose is listed as such; output text still skips it. Before, each id
        was decoded as output text: a special token's entry was ``""``."""
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _close_stream(self, p: _Pending) -> None:
        """After an SSE response, or a whole generation body (:class:`_WatchedResponse`; its ASGI call returned: its
        last send done, or the connection gone): count the end decided while it was on (``_Pending.response_on``),
        and forget ``p`` if its body never ran (the client left before it started)."""
        p.response_on = False
        if self._pending.get(p.rid) is p:
            self._abandon(p, "client disconnected", "client_disconnect")
        self._forget(p)

    def _in_flight(self, rid: str) -> bool:
        """A request with ``rid`` is pending, or being routed (not pending yet), here or on another router (its
        ``route.sent`` counted, its end not seen yet: :class:`RemoteSends`). Before, only this router's own were
        checked: an id in flight on another router (a client's retry after its router died, reaching the next
        one) was placed again, and the view's second count of one rid raised: a 500 "internal error"."""
        return rid in self._pending or rid in self._routing or rid in self._remote

    async def _duplicate_answer(self, rid: str, shown: str) -> Response:
        """The answer to a request whose ``rid`` is in flight (:meth:`_in_flight`; ``shown``: its id as sent,
        quoted): 409 when this router holds it, or another router that still has it (asked on
        ``route.held.<router>``, :data:`_PEER_HELD_TIMEOUT_S`); 503 with ``Retry-After: 1`` when that router is
        gone (no answer: the nodes drop its work within their ``--owner-gone-after-s``, and its end frees the id)
        or no longer has it (a restarted router: its nodes drop it at their next ``route.held``). Counted
        ``duplicate_rid.{here,peer,peer_gone,peer_dropped}``. Never raises (a bus error reads as a gone router)."""
        sent = self._remote.get(rid)
        if sent is None or rid in self._pending or rid in self._routing:
            self.counters["duplicate_rid.here"] += 1
            return self._error(409, f"X-Request-ID {shown} is already in flight", "X-Request-ID")
        q = m.HeldQuery(node=self.bus.instance, rids=[rid], attempts=[sent.attempt], peer=True)
        try:
            rep = await self.bus.request(ROUTE_HELD, q, timeout=_PEER_HELD_TIMEOUT_S, router=sent.router)
        except BusError:
            rep = None
        if rep is not None and rid not in rep.dropped:
            self.counters["duplicate_rid.peer"] += 1
            return self._error(409, f"X-Request-ID {shown} is already in flight (on router {sent.router})", "X-Request-ID")
        if rep is None:
            self.counters["duplicate_rid.peer_gone"] += 1
            why = (f"X-Request-ID {shown} is in flight on router {sent.router}, which does not answer (gone?); its nodes "
                   "drop that request soon: retry")
        else:
            self.counters["duplicate_rid.peer_dropped"] += 1
            why = f"X-Request-ID {shown} was in flight on router {sent.router}, which no longer has it; its nodes drop it soon: retry"
        return self._json(api.error_body(503, why, "X-Request-ID"), 503, headers={"retry-after": "1"})

    async def _rid_freed(self, rid: str) -> bool:
        """A request with ``rid`` is in flight: True if it ends within ``_DUPLICATE_GRACE_S``
        (polled every 10 ms; the client that sent it went away and is retrying)."""
        deadline = time.monotonic() + _DUPLICATE_GRACE_S
        while self._in_flight(rid) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not self._in_flight(rid)

    def _forget(self, p: _Pending) -> None:
        """The HTTP side of ``p`` is over: forget it (remembering a client rid's last attempt); its
        end not counted yet (decided while its response was still running: :meth:`_end_decided`) is counted now, as
        its client saw it."""
        if p.end_reason is not None and not p.response_on:  # a stream's: when its last send is done (_close_stream)
            self._count_end(p, p.end_reason)
        if p.unread:  # output its client never took
            self._unread -= p.unread
            p.unread = 0
        if self._pending.get(p.rid) is p:
            del self._pending[p.rid]
            if p.rreq is not None and p.rreq.branch_id is not None:
                # its branch may be evicted again (--max-active-branches), and is silent from now on (the TTL)
                self.branches.done(p.rreq.branch_id, self.clock.local_now())
            if p.rid in self._parked:  # its client went (or it timed out) while parked
                self._publish_parked_end(p, "request ended while its work was parked")
            self._unpark(p.rid)
            if p.client_rid:
                self._retried.ended(p.rid, p.attempt)

    @staticmethod
    def _ei(p: _Pending) -> dict[str, Any]:
        """The ``ei`` object of a response: placement, queue time, predicted TTFT, peer fetch
        (s, tokens fetched, source nodes)."""
        return {
            "prefill_node": p.prefill_node,
            "decode_node": p.decode_node,
            "redispatches": p.attempt - p.first_attempt,
            "queue_s": p.queue_s,
            "arrived_at": p.arrived_at,
            "first_token_at": p.first_token_at,
            "predicted_ttft_s": None if p.predicted_ttft_s is None else round(p.predicted_ttft_s, 6),
            "fetch_s": p.fetch_s,
            "exposed_fetch_s": p.exposed_fetch_s,
            "fetched_tokens": p.fetched_tokens,
            "fetch_sources": p.fetch_sources,
        }

    def _log_route(self, req: RouteRequest, out: RouteDecision, lookup_status: str) -> None:
        """One structured debug line per routing decision, with every candidate's score breakdown."""
        if not self.log.is_enabled_for(logging.DEBUG):
            return
        pre = out.prefill
        self.log.debug(
            "route",
            rid=req.rid,
            branch=req.branch_id,
            prompt_tokens=req.prompt_tokens,
            blocks=req.num_blocks,
            lookup=lookup_status,
            policy=self.core.policy.name,
            path=pre.path,
            prefill=pre.node,
            decode=out.decode_node,
            decode_rule=self.core.policy.decode_rule if out.decode else None,
            matched_blocks=pre.matched_blocks,
            match_rate=round(pre.match_rate, 4),
            candidates=[n.node for n in out.candidates],
            matches=pre.matches,
            loads=pre.loads,
            decode_loads=out.decode.loads if out.decode else {},
            predicted_ttft_s=None if pre.predicted_ttft_s is None else round(pre.predicted_ttft_s, 6),
            breakdown={e.node: e.as_dict() for e in pre.estimates},
            fetch=[(r.node, r.start, r.end, r.tier) for r in pre.fetch],
        )
