"""One PING on a nats-py connection, watched with our own deadline, never cancelled while nats-py still holds it.

Why not ``await asyncio.wait_for(nc.flush(), D)`` or ``nc.flush(timeout=D)``: nats-py's ``Client.flush`` appends a PONG
future to ``Client._pongs`` and writes ``PING``; at its timeout, or when the task awaiting it is cancelled (a
``wait_for`` around it), the future is cancelled but stays in ``_pongs``. When the late PONG comes (a server that
hung a few seconds, a slow path), ``_process_pong`` calls ``set_result`` on the cancelled future: ``InvalidStateError``
ends nats-py's read loop. The client stays "connected" and reads nothing: no message, no PONG, until its own PINGs
(every 2 min, two unanswered) call it stale, minutes later; and its ``flush`` returns at once meanwhile (a client whose
read loop ended sends no PING), so a probe built on it sees a healthy bus. The Slurm job's liveness watcher, so
deafened, SIGKILLed every head service after its liveness timeout
(``tests/integration/test_liveness_watcher_late_pong_live.py``); ``up``'s probe and the router's and the bus's PINGs
had the same defect (session 52). nats-py 2.15.0 and 2.16.0 read the same (``flush``, ``_process_pong``).

So a :class:`Ping` is sent with nats-py's longest wait (:data:`PING_NO_TIMEOUT_S`, never reached) and watched with the
caller's deadline (:meth:`Ping.wait`); the caller may give up on it (:meth:`Ping.drop`), but it is cancelled only once
nats-py forgot it: a reconnect makes a new ``_pongs`` list and drops the old one (its PONGs never come), and a future
nats-py no longer holds can be cancelled safely. A PING left to its PONG is kept in its owner's ``keep`` set
(``Bus._pings``), which cancels what is left when the connection is closed (no PONG can reach it then).

nats-py privates read (``nats-py>=2.15,<2.17`` in pyproject.toml; checked on 2.15.0 and 2.16.0): ``Client._pongs``
(which connection a PING went out on: its identity changes at each reconnect) and ``Client._reading_task`` (the read
loop: a flush on a connected client whose read loop ended sends no PING and returns at once). A nats-py without them
is warned about once (:func:`check_client`, at ``Bus.connect``) and handled safely: nothing is ever cancelled, a PING
is waited for while no reconnect happened since it was sent (``conn``, the bus's ``reconnected_at``), and one a
reconnect may have forgotten is left to its PONG (kept until the close) while the caller sends a fresh one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

import structlog

PING_NO_TIMEOUT_S = 365 * 86400.0
"""The timeout given to nats-py's ``flush`` (PING, then wait for the PONG): one it never reaches, so nats-py never
cancels the PONG's future itself (see the module docstring); the caller bounds its wait with :meth:`Ping.wait`."""

PONGS_ATTR = "_pongs"
"""The nats-py ``Client`` attribute holding the PONG futures of the current connection (a new list at each
(re)connect). A name, not a literal at each use, so a test can play a nats-py without it."""
READING_ATTR = "_reading_task"
"""The nats-py ``Client`` attribute holding its read loop's task (a new one at each (re)connect)."""

_log = structlog.get_logger("natsping")
_warned = False


def nats_py_version() -> str:
    """The installed nats-py's version (``"unknown"`` when its metadata cannot be read)."""
    try:
        return metadata.version("nats-py")
    except metadata.PackageNotFoundError:
        return "unknown"


def privates_ok(nc: Any) -> bool:
    """Whether ``nc`` (a nats-py ``Client``) has the private attributes this module reads (:data:`PONGS_ATTR`,
    :data:`READING_ATTR`): without them PINGs are never cancelled and their connection is judged by the caller's
    ``conn`` token instead (the module docstring)."""
    return hasattr(nc, PONGS_ATTR) and hasattr(nc, READING_ATTR)


def check_client(nc: Any) -> bool:
    """:func:`privates_ok`, and one warning per process (naming the nats-py version) when it is False: called once at
    each connect (``Bus.connect``), so a nats-py that changed its internals is named in the log at the start."""
    global _warned
    ok = privates_ok(nc)
    if not ok and not _warned:
        _warned = True
        _log.warning("nats-py lacks the internals this version of evolving-infra reads to keep its PINGs safe; "
                     "PINGs are never cancelled, a reconnect's is left to its PONG until the close (upgrade "
                     "evolving-infra, or install nats-py>=2.15,<2.17)", nats_py=nats_py_version(),
                     missing=[a for a in (PONGS_ATTR, READING_ATTR) if not hasattr(nc, a)])  # fmt: skip
    return ok


def connection_of(nc: Any) -> object:
    """The identity of ``nc``'s current connection: its PONG list (:data:`PONGS_ATTR`), which nats-py makes anew at
    each (re)connect; None when this nats-py has none (unknown)."""
    return getattr(nc, PONGS_ATTR, None)


def deaf(nc: Any) -> bool:
    """True when ``nc`` is connected but its read loop has ended: it reads nothing more (no message, no PONG) until
    nats-py's own PINGs call the connection stale, and its ``flush`` would return at once without a PING. False when
    it reads, is not connected (a reconnect makes a new read loop), or this nats-py has no :data:`READING_ATTR`."""
    reading = getattr(nc, READING_ATTR, None)
    return bool(nc.is_connected) and reading is not None and reading.done()


class DeafClient(Exception):
    """The outcome of a :class:`Ping` on a connected client whose read loop has ended (:func:`deaf`): nats-py's
    ``flush`` wrote what was queued and sent no PING (it returns at once there, as if answered); nothing can be
    heard on that connection until nats-py's own PINGs call it stale and it reconnects."""


async def _unheard(nc: Any) -> None:
    """The "PING" of a client whose read loop ended: nats-py's ``flush`` still writes what is queued (it sends no PING
    then and returns at once), and the outcome is :class:`DeafClient`, not an answer."""
    await nc.flush(timeout=PING_NO_TIMEOUT_S)
    raise DeafClient("the client's read loop has ended: it reads no PONG (no PING sent)")


class Ping:
    """One PING on a nats-py connection, sent at construction; its PONG is never cancelled while nats-py holds it.

    Args:
        nc: the nats-py ``Client``; send only while it is connected (a PING nats-py refuses is an outcome, not an
            error raised here: :meth:`wait` returns False).
        conn: returns a token that changes at each reconnect (``Bus.reconnected_at``); read only where this nats-py
            has no :data:`PONGS_ATTR` (:meth:`lost`). Default: no token (a PING is then never deemed lost).
        keep: where a PING still waiting for its PONG is held (a strong reference; removed once it ends): its
            owner cancels what is left there when the connection is closed (``Bus.close``). None: not kept.

    Attributes:
        sent_at: ``time.monotonic()`` when it was sent (s).
        future: nats-py's ``flush`` running; done with None (PONG), an exception (refused; :class:`DeafClient`: the
            read loop had ended, what was queued is written, no PING sent), or
            cancelled (only by :meth:`drop` once nats-py forgot it, or by the owner of ``keep`` at the close).
    """

    def __init__(self, nc: Any, *, conn: Callable[[], object] = lambda: None, keep: set[Ping] | None = None) -> None:
        self.nc = nc
        self._conn = conn
        self._conn0 = conn()
        self._pongs = connection_of(nc)
        self._keep = keep
        self.sent_at = time.monotonic()
        self.future: asyncio.Future[None] = asyncio.ensure_future(
            _unheard(nc) if deaf(nc) else nc.flush(timeout=PING_NO_TIMEOUT_S))  # fmt: skip
        self.future.add_done_callback(self._ended)
        if keep is not None:
            for other in list(keep):  # those a reconnect made nats-py forget since: cancelled now, not at the close
                other.drop()
            if not self.future.done():
                keep.add(self)

    def _ended(self, fut: asyncio.Future[None]) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved: one left to its PONG and refused later logs nothing at its collection
        if self._keep is not None:
            self._keep.discard(self)

    @property
    def answered(self) -> bool:
        """True once its PONG came."""
        f = self.future
        return f.done() and not f.cancelled() and f.exception() is None

    def forgotten(self) -> bool:
        """True when nats-py is known to have forgotten it: a reconnect replaced the connection's PONG list since it
        was sent (its PONG never comes), so cancelling it is safe. False when it may still be held or it is unknown."""
        return self._pongs is not None and connection_of(self.nc) is not self._pongs

    def lost(self) -> bool:
        """True when no PONG is to be expected for it: :meth:`forgotten`, or (a nats-py without :data:`PONGS_ATTR`) a
        reconnect since it was sent by the ``conn`` token (then possibly still held: it is never cancelled)."""
        if self._pongs is not None:
            return self.forgotten()
        return self._conn() != self._conn0

    async def wait(self, timeout_s: float) -> bool | None:
        """Wait at most ``timeout_s`` seconds for its outcome (the caller's cancel ends the wait, never the PING).

        Returns:
            True: its PONG came. False: it ended without one (nats-py refused it: not connected, closed;
            :class:`DeafClient`), or it is :meth:`lost` (then :meth:`drop`\\ ped: the caller sends a fresh one).
            None: no PONG yet and it is still waited for (the caller may wait again, or :meth:`drop` it).
        """
        if not self.future.done():
            await asyncio.wait({self.future}, timeout=max(0.0, timeout_s))
        if self.future.done():
            return self.answered
        if self.lost():
            self.drop()
            return False
        return None

    def drop(self) -> None:
        """Stop watching it: cancelled when nats-py forgot it (:meth:`forgotten`); else left to its PONG (in ``keep``
        until it comes or the owner closes the connection): cancelling a future nats-py holds deafens the client."""
        if not self.future.done() and self.forgotten():
            self.future.cancel()
