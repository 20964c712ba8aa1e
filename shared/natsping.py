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

Which connection a PING went out on is read in the step that sends it (:meth:`Ping._send`: the list is read and
nats-py's ``flush`` appends the PONG's future to it with no ``await`` between), not when the :class:`Ping` is made: a
reconnect's new connection can come in the step between. Taken at construction (e30d761), a PING made just before it
went into the new list while the :class:`Ping` held the old one: it counted as forgotten, a give-up cancelled it, and
its PONG ended the read loop (``Bus.flush`` during a reconnect: 4 reconnects of 5, review rr-ping53;
``tests/integration/test_natsping_live.py``).

nats-py privates read (``nats-py>=2.15,<2.17`` in pyproject.toml; checked on 2.15.0 and 2.16.0): ``Client._pongs``
(which connection a PING went out on: its identity changes at each reconnect), ``Client._reading_task`` (the read
loop) and ``Client._flusher_task`` (its writer): a flush on a connected client where either has ended sends no PING
and returns at once. A nats-py without ``_pongs`` or ``_reading_task`` is warned about once (:func:`check_client`, at
``Bus.connect``) and handled safely: a PING is waited for while no reconnect happened since it was sent (``conn``, the
bus's ``reconnected_at``); one a reconnect may have forgotten is left to its PONG while the caller sends a fresh one,
and cancelled once a PING sent after it is answered (PONGs come in order: one nats-py still held would have been
answered first), else at the close.
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
FLUSHER_ATTR = "_flusher_task"
"""The nats-py ``Client`` attribute holding its flusher's task (writes what is queued; a new one at each (re)connect)."""

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
    """True when ``nc`` is connected but its read loop (:data:`READING_ATTR`) or its flusher (:data:`FLUSHER_ATTR`) has
    ended: nats-py's ``flush`` then writes what is queued, sends no PING and returns at once (its own test, mirrored),
    and with the read loop ended nothing more is read (no message, no PONG) until nats-py's own PINGs call the
    connection stale. False when both run, it is not connected (a reconnect makes new ones), or this nats-py has
    neither attribute (an attribute it lacks is not judged)."""
    if not nc.is_connected:
        return False
    for attr in (READING_ATTR, FLUSHER_ATTR):
        if hasattr(nc, attr):
            task = getattr(nc, attr)
            if task is None or task.done():
                return True
    return False


def _deaf_why(nc: Any) -> str:
    """Which of a deaf client's tasks (:func:`deaf`) has ended, in words."""
    if hasattr(nc, READING_ATTR):
        reading = getattr(nc, READING_ATTR)
        if reading is None or reading.done():
            return "its read loop has ended: no PONG can be read (no PING sent)"
    return "its flusher has ended: nats-py sends no PING (what was queued is written)"


class DeafClient(Exception):
    """The outcome of a :class:`Ping` on a connected client whose read loop or flusher has ended (:func:`deaf`):
    nats-py's ``flush`` wrote what was queued and sent no PING (it returns at once there, as if answered). With the
    read loop ended nothing can be heard on that connection until nats-py's own PINGs call it stale and it
    reconnects (``Bus.reconnect_deaf`` makes it reconnect now)."""


class NotConnected(Exception):
    """The outcome of a :class:`Ping` whose send step found the client not connected (reconnecting, or not yet
    connected): no PING sent. nats-py's ``flush`` returns at once there (its read loop ended with the connection), as
    if answered; the caller waits for the reconnect and sends a fresh one."""


async def _unheard(nc: Any) -> None:
    """The "PING" of a deaf client (:func:`deaf`): nats-py's ``flush`` still writes what is queued (it sends no PING
    then and returns at once), and the outcome is :class:`DeafClient`, not an answer."""
    why = _deaf_why(nc)
    await nc.flush(timeout=PING_NO_TIMEOUT_S)
    raise DeafClient(why)


class Ping:
    """One PING on a nats-py connection, sent in the next event-loop step (its task's first, :meth:`_send`); its PONG
    is never cancelled while nats-py holds it.

    Args:
        nc: the nats-py ``Client``. Not connected at the send step (reconnecting): no PING, the outcome is
            :class:`NotConnected`; a PING nats-py refuses (closed) is an outcome too, not an error raised here
            (:meth:`wait` returns False).
        conn: returns a token that changes at each reconnect (``Bus.reconnected_at``); read only where this nats-py
            has no :data:`PONGS_ATTR` (:meth:`lost`). Default: no token (a PING is then never deemed lost).
        keep: where a PING still waiting for its PONG is held (a strong reference; removed once it ends): its
            owner cancels what is left there when the connection is closed (``Bus.close``). Each new PING of the
            same ``keep`` cancels the kept ones nats-py forgot (:meth:`drop`), and each answered one those sent
            before it on an earlier connection (:meth:`_ended`). None: not kept.

    Attributes:
        sent_at: ``time.monotonic()`` when it was made (s); sent in the next step.
        future: its task (nats-py's ``flush``); done with None (PONG), an exception (:class:`NotConnected`;
            :class:`DeafClient`: the read loop or the flusher had ended, what was queued is written, no PING sent;
            nats-py's own: closed), or cancelled (by :meth:`drop` once nats-py forgot it, by a later answered PING of
            the same ``keep`` once a reconnect lost it, or by the owner of ``keep`` at the close).
    """

    _sends = 0
    """PINGs sent so far in this process (the order of their send steps, :attr:`_seq`)."""

    def __init__(self, nc: Any, *, conn: Callable[[], object] = lambda: None, keep: set[Ping] | None = None) -> None:
        self.nc = nc
        self._conn = conn
        self._conn0 = conn()
        self._pongs = connection_of(nc)  # until the send step: a reconnect before it cancels a PING never sent
        self._seq: int | None = None
        """Its place in the order of send steps (None: not sent); a PING answered after it was sent after it."""
        self._keep = keep
        self.sent_at = time.monotonic()
        self.future: asyncio.Future[None] = asyncio.ensure_future(self._send())
        self.future.add_done_callback(self._ended)
        if keep is not None:
            for other in list(keep):  # those a reconnect made nats-py forget since: cancelled now, not at the close
                other.drop()
            if not self.future.done():
                keep.add(self)

    async def _send(self) -> None:
        """Send the PING and wait for its PONG: the connection it goes out on is read here, in the step nats-py's
        ``flush`` appends the PONG's future to that connection's list (no ``await`` between), never earlier."""
        nc = self.nc
        if not nc.is_connected and not nc.is_closed:  # closed: nats-py's flush raises ConnectionClosedError
            raise NotConnected("the client is not connected (reconnecting): no PING sent")
        if deaf(nc):
            await _unheard(nc)
        self._pongs = connection_of(nc)
        self._conn0 = self._conn()
        Ping._sends += 1
        self._seq = Ping._sends
        await nc.flush(timeout=PING_NO_TIMEOUT_S)

    def _ended(self, fut: asyncio.Future[None]) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved: one left to its PONG and refused later logs nothing at its collection
        if self._keep is None:
            return
        self._keep.discard(self)
        if self.answered and self._seq is not None:
            # PONGs come in order: a PING sent before this one and still unanswered is not in the list nats-py
            # answers from. One a reconnect lost (a nats-py without _pongs cannot say it forgot it) is cancelled now:
            # before, each reconnect left one per pinger until the close
            for other in list(self._keep):
                if other._seq is not None and other._seq < self._seq and not other.future.done() and other.lost():
                    other.future.cancel()

    @property
    def answered(self) -> bool:
        """True once its PONG came."""
        f = self.future
        return f.done() and not f.cancelled() and f.exception() is None

    def forgotten(self) -> bool:
        """True when nats-py is known to have forgotten it: a reconnect replaced the connection's PONG list since it
        was sent (its PONG never comes), or since it was made when not sent yet (it never will be), so cancelling it
        is safe. False when it may still be held or it is unknown."""
        return self._pongs is not None and connection_of(self.nc) is not self._pongs

    def lost(self) -> bool:
        """True when no PONG is to be expected for it: :meth:`forgotten`, or (a nats-py without :data:`PONGS_ATTR`) a
        reconnect since it was sent by the ``conn`` token (then possibly still held: cancelled only once a PING sent
        after it is answered)."""
        if self._pongs is not None:
            return self.forgotten()
        return self._conn() != self._conn0

    async def wait(self, timeout_s: float) -> bool | None:
        """Wait at most ``timeout_s`` seconds for its outcome (the caller's cancel ends the wait, never the PING).

        Returns:
            True: its PONG came. False: it ended without one (not connected, :class:`NotConnected`; nats-py refused
            it: closed; :class:`DeafClient`; cancelled: lost to a reconnect), or it is :meth:`lost` (then
            :meth:`drop`\\ ped: the caller sends a fresh one).
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
        until it comes, a later PING is answered after a reconnect lost it, or the owner closes the connection):
        cancelling a future nats-py holds deafens the client."""
        if not self.future.done() and self.forgotten():
            self.future.cancel()
