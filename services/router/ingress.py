"""Router ingress guards: API keys, per-key concurrency, header read timeout (issue 18).

* :class:`IngressGuard` (ASGI middleware): with API keys configured, every path
  except the public ones (``/livez``, ``/healthz``, ``/health``, ``/ping``, ``/metrics`` by default)
  needs ``Authorization: Bearer <key>``; a missing or unknown key gets 401 with
  ``WWW-Authenticate: Bearer``; ``Authorization`` sent twice with different values gets 400
  (:func:`authorization_of`: which one counts would be a guess); each body is the API's
  (``api.error_body``: OpenAI's 401 ``invalid_api_key`` and 429 ``rate_limit_exceeded``). Keys are compared as SHA-256 digests (no key
  text is kept in memory in the clear beyond loading, and the lookup takes the
  same time for every wrong key). Each key may have at most ``max_inflight``
  requests in flight (a stream counts until it ends); one more gets 429 with
  ``Retry-After``. A 408 (body not received in time) or 413 also closes the
  connection (``Connection: close``): the rest of that body is never read.
* :func:`guarded_h11`: uvicorn's h11 protocol with a header deadline: a
  connection that has not sent a complete request head within
  ``header_timeout_s`` of opening (or of its previous response) is closed
  (slowloris). Body read time is bounded by the router (``body_timeout_s``).
  Each request's scope carries ``scope["extensions"][RESET_EXTENSION]``: a
  callable that resets its connection at once (the router's end of a stream
  whose client stopped reading, ``--max-buffered-output-tokens``: a plain
  close would wait for the client to read what is buffered first), while that
  request's response is on; after it, a no-op (the connection may carry the
  next request). For a drain on a held socket it can answer each request with
  ``Connection: close`` (``closing``; :meth:`close_after_response`), say whether a
  connection has a request on (``idle``) and close it only when it has none
  (``close_if_idle``).

Keys come from a file (one per line, ``#`` comments) and/or a comma-separated
value (``EI_API_KEYS``); see :func:`load_api_keys`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import h11
import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.router.api import error_body

_JSON = msgspec.json.Encoder()

RESET_EXTENSION = "evolving_infra.connection_reset"
"""Key, in a request's ``scope["extensions"]`` (:func:`guarded_h11`), of the callable that resets its connection
while its response is on (returns True when it did)."""


KEY_ID_SCOPE_KEY = "ei.api_key_id"
"""ASGI scope key under which :class:`IngressGuard` puts the :func:`key_id` of the key a request was let through with
(absent on an open router and on a public path): the router's ``request accepted`` / ``finished`` lines name it."""


class ApiKeyError(ValueError):
    """The API key file cannot be read, or it names no key."""


def load_api_keys(path: str = "", inline: str = "") -> frozenset[str]:
    """API keys from a file (UTF-8, one per line; blank lines and ``#`` comments skipped; a leading BOM, as
    Notepad writes, is not part of the first key) and a comma-separated string; empty set = no keys (the router is open).

    Raises:
        ApiKeyError: ``path`` is given but unreadable, not UTF-8 text, or holds no key.
    """
    keys: set[str] = {k.strip() for k in inline.split(",") if k.strip()}
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8-sig")
        except OSError as e:
            raise ApiKeyError(f"cannot read API keys from {path}: {e}") from e
        except UnicodeDecodeError as e:  # a ValueError, not an OSError: was a traceback at up's start, on SIGUSR1/SIGHUP
            raise ApiKeyError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from e
        file_keys = {ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")}
        if not file_keys:
            raise ApiKeyError(f"{path} holds no API key")
        keys |= file_keys
    return frozenset(keys)


def local_client_key(environ: Mapping[str, str] | None = None, keys: frozenset[str] | None = None) -> str | None:
    """The key a command that starts its own cluster (``demo``, ``fidelity``) sends to its router.

    ``keys``: the router's keys when the command already read them (``demo``: its ``--api-keys-file``
    may be a pipe, read once); else they are read from the environment as the router reads them.

    Its router reads the same environment as any other: with ``EI_API_KEYS`` or
    ``EI_API_KEYS_FILE`` set it requires a key, so the command's own replay must send one.
    Returns ``EI_API_KEY`` when set, else the first (sorted) key of the router's keys, else None
    (the router is open).

    Raises:
        ApiKeyError: ``EI_API_KEYS_FILE`` is set but unreadable or holds no key (the router
            would refuse to start on it too).
    """
    env = os.environ if environ is None else environ
    own = env.get("EI_API_KEY", "").strip()
    if own:
        return own
    if keys is None:
        keys = load_api_keys(env.get("EI_API_KEYS_FILE", ""), env.get("EI_API_KEYS", ""))
    return min(keys) if keys else None


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode()).digest()


_key_id_salt: bytes = secrets.token_bytes(16)
"""The secret :func:`key_id` is made with: random per process unless :func:`set_key_id_salt` gave one."""


def set_key_id_salt(salt: str) -> None:
    """Make :func:`key_id` with ``salt`` from now on (the router's ``--api-key-id-salt``, env ``EI_API_KEY_ID_SALT``:
    ``up`` gives all the routers of one cluster the same, so their ids agree across routers and restarts).

    Raises:
        ValueError: ``salt`` is empty.
    """
    global _key_id_salt
    if not salt:
        raise ValueError("an API key id salt cannot be empty")
    _key_id_salt = salt.encode()


def key_id(key: str | bytes) -> str:
    """A short name of an API key for logs: the first 8 hex digits of its HMAC-SHA256 under a secret salt
    (:func:`set_key_id_salt`; without one, random per process: ids stable for the router's life). An unsalted
    SHA-256 prefix in a world-readable log identified a short or guessable key offline (hash the candidates, compare);
    without the salt the id says nothing about the key. An operator with the salt finds a key's lines:
    the README's ``python3 -c`` line, which reads the key on stdin and the salt from its file (``up``: the salt is in
    ``LOG_DIR/api-key-id.salt``, mode 0600; an ``openssl dgst -hmac "$SALT"`` put it in ``ps``)."""
    return hmac.new(_key_id_salt, key if isinstance(key, bytes) else key.encode(), hashlib.sha256).hexdigest()[:8]


class RepeatedAuthorization(ValueError):
    """A request's ``Authorization`` header is sent more than once with different values."""


def authorization_of(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The one ``Authorization`` value of a request's ASGI ``headers`` (names lowercase), None without one.

    The same value sent again (a proxy's copy) is one value, as the agent headers' rule
    (``api.parse_branch_headers``). Different values are refused: proxies and servers disagree which one
    counts (the first, the last, or all joined), so a gateway in front may authorize a request by one
    credential while this router takes the other (the request-smuggling class; RFC 9110 allows the
    header once). The first was taken here, silently.

    Raises:
        RepeatedAuthorization: two different values; its message counts them.
    """
    values = [value for name, value in headers if name == b"authorization"]
    if len(set(values)) > 1:
        raise RepeatedAuthorization(f"Authorization is sent {len(values)} times with different values; send it once")
    return values[0] if values else None


def inflight_limit_message(limit: int) -> str:
    """The 429's message for a key at its ``limit`` (>= 1) of requests in flight, in words for one and for more:
    "1 request ... when it ends", "4 requests ... when one ends" (it said "1 requests")."""
    if limit == 1:
        return "this API key has 1 request in flight, its limit; retry when it ends"
    return f"this API key has {limit} requests in flight, its limit; retry when one ends"


class IngressGuard:
    """ASGI middleware in front of the router's app (see the module docstring).

    Args:
        app: the wrapped ASGI app.
        keys: accepted API keys; empty = no authentication (and no per-key limit).
        public_paths: paths served without a key.
        max_inflight: requests in flight per key; 0 = unlimited.
        counters: where ``http.unauthorized``, ``http.key_limited``, ``http.auth_header_repeated`` are counted.
        on_refused: called as ``on_refused(scope, status, message)`` for each request refused here
            (400, 401, 429) before it is answered (the router's ``--log-requests`` line); never given the key.
    """

    def __init__(self, app: ASGIApp, keys: Iterable[str], *, public_paths: Iterable[str] = ("/livez", "/healthz", "/health", "/ping", "/metrics"),
                 max_inflight: int = 0, counters: Counter[str] | None = None,
                 on_refused: Callable[[Scope, int, str], None] | None = None) -> None:
        self.app = app
        self.on_refused = on_refused
        self._digests: dict[bytes, str] = {}
        self.set_keys(keys)
        self.public = frozenset(public_paths)
        self.max_inflight = max_inflight
        self.inflight: Counter[str] = Counter()
        """Requests in flight per key, by :func:`key_id`."""
        self.counters = counters if counters is not None else Counter()

    def set_keys(self, keys: Iterable[str]) -> None:
        """Accept exactly ``keys`` from the next request on (a key reload): a request already let through goes on,
        and its in-flight count is released under its key's id whether that key is still accepted or not. An empty
        set turns authentication off; callers that reload refuse one first (:meth:`RouterService.reload_api_keys`)."""
        self._digests = {_digest(k): key_id(k) for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    async def _reply(self, send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), *headers]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in (408, 413):
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if not self._digests or scope["path"] in self.public:
            await self.app(scope, receive, closing_send)
            return
        try:
            value = authorization_of(scope["headers"])
        except RepeatedAuthorization as e:
            self.counters["http.auth_header_repeated"] += 1
            if self.on_refused is not None:
                self.on_refused(scope, 400, str(e))
            await self._reply(send, 400, _JSON.encode(error_body(400, str(e), "Authorization")), [(b"connection", b"close")])
            return
        who = None
        if value is not None:
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                who = self._digests.get(_digest(token.strip()))
        if who is None:
            self.counters["http.unauthorized"] += 1
            message = "missing or invalid API key: send 'Authorization: Bearer <key>'"
            if self.on_refused is not None:
                self.on_refused(scope, 401, message)
            await self._reply(
                send, 401, _JSON.encode(error_body(401, message)),
                [(b"www-authenticate", b'Bearer realm="evolving-infra"'), (b"connection", b"close")],
            )
            return
        if self.max_inflight and self.inflight[who] >= self.max_inflight:
            self.counters["http.key_limited"] += 1
            message = inflight_limit_message(self.max_inflight)
            if self.on_refused is not None:
                self.on_refused(scope, 429, message)
            await self._reply(
                send, 429, _JSON.encode(error_body(429, message)),
                [(b"retry-after", b"1"), (b"connection", b"close")],
            )
            return
        scope[KEY_ID_SCOPE_KEY] = who
        self.inflight[who] += 1
        try:
            await self.app(scope, receive, closing_send)
        finally:
            self.inflight[who] -= 1
            if not self.inflight[who]:
                del self.inflight[who]


_CLOSE = (b"connection", b"close")


def guarded_h11(header_timeout_s: float, counters: Counter[str], closing: Callable[[], bool] = lambda: False) -> type[H11Protocol]:
    """uvicorn's h11 protocol closing connections whose request head is not complete
    within ``header_timeout_s`` wall seconds (counted as ``http.header_timeouts``), and giving each
    request's scope a :data:`RESET_EXTENSION` (``transport.abort`` while that request's response is
    on: the buffered output is dropped and uvicorn sees the connection lost, as when its client goes
    away; a no-op once its response is complete).

    ``closing()`` is asked as each request head is read: True answers that request with ``Connection: close``
    (:meth:`close_after_response`; the router's drain on a held socket, whose next router takes the client's
    next connection). Keep-alive connections are not closed by it while idle: :meth:`close_if_idle` does that,
    when the caller chooses (a close races a request the client is sending on the connection meanwhile, RFC 9112
    §9.3.1; one right after a response that said ``Connection: close`` races nothing)."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: Any = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:  # still waiting for a request head
                counters["http.header_timeouts"] += 1
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request head arrived
                self._disarm()
                if self.cycle is not None:  # its app task has not run yet: the scope it gets is this dict
                    ext: dict[Any, Any] = self.cycle.scope.setdefault("extensions", {})
                    ext[RESET_EXTENSION] = self._reset_hook(self.cycle)
                    if closing():
                        self.close_after_response()

        def close_after_response(self) -> bool:
            """Answer the request on now with ``Connection: close`` (uvicorn then closes the connection right after
            the response, and its client connects again for its next request). True when it will be; False when
            there is none or its response has started (its head is out without the header: the connection stays
            open, and its next request gets it if ``closing()`` says so then)."""
            cycle = self.cycle
            if cycle is None or cycle.response_started or self.transport.is_closing():
                return False
            if _CLOSE not in cycle.default_headers:  # the headers uvicorn puts before the app's at the response's start
                cycle.default_headers = [*cycle.default_headers, _CLOSE]
                counters["http.closed_after_response"] += 1
            return True

        def idle(self) -> bool:
            """No request on: none since connecting or since the last response ended, and no byte of a next one
            read (a request head partly read is a request on); or closing (it carries no further request)."""
            if self.transport.is_closing():
                return True
            if self.cycle is not None and not self.cycle.response_complete:
                return False
            return self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]

        def close_if_idle(self) -> bool:
            """Close the connection if :meth:`idle` (as uvicorn's own shutdown closes an idle one); True when closed.
            A request the client is sending meanwhile, not read yet, is lost with it (its client sees the connection
            closed or reset): call it when no client is expected to send on the connection."""
            if self.transport.is_closing() or not self.idle():
                return False
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:  # the connection's state forbids a clean close: closed all the same
                pass
            self.transport.close()
            return True

        def _reset_hook(self, cycle: Any) -> Callable[[], bool]:
            """``cycle``'s :data:`RESET_EXTENSION`: aborts the connection only while ``cycle`` is its current
            request and its response is not complete, and says whether it did. Once complete, the connection
            may carry the next request (keep-alive; a pipelined one starts at the completion, before the
            app's call returns), which a reset would kill."""

            def reset() -> bool:
                if self.cycle is not cycle or cycle.response_complete or self.transport.is_closing():
                    return False
                self.transport.abort()
                return True

            return reset

        def on_response_complete(self) -> None:
            self._arm()  # the next request's head must come in time too (a pipelined one disarms it)
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol
