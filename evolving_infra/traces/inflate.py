"""Inflating a gzip-compressed trace: in the reader's thread, or on a thread of its own ahead of it.

:func:`one_member` inflates a file that is exactly one gzip member with zlib, in large chunks
(``traces.io`` reads every compressed trace through it; any other stream falls back to ``gzip``'s
own reader there). :class:`InflateAhead` runs the same generator on a thread started before the
reader needs the data: ``evolving-infra simulate`` starts one as soon as its arguments are
parsed, so that the trace is inflated while the process imports the simulator and while
``traces.compact`` parses the lines already inflated. zlib inflates with the GIL released, so on
a second core the two overlap: the real Claude Code trace of 260 sessions at 64-token blocks is
24 MB compressed, 281 MB inflated, ~0.6 s of CPU on this project's 2-core VM, against ~0.25 s of
imports and ~0.3 s of parsing after it.

The reader sees exactly the chunks, and the exception at the same place, that :func:`one_member`
gives in its own thread, so what a read returns or reports does not depend on it.

This module imports only the standard library (``zlib``, ``threading``, ``queue``): it is
imported before the rest of the simulator, so that the thread starts first.
"""

from __future__ import annotations

import os
import queue
import stat
import sys
import threading
import zlib
from collections.abc import Iterator
from typing import IO

GZIP_MAGIC = b"\x1f\x8b"
PACK_MAGIC = b"\x93EITPACK"
"""The first bytes of a packed trace (``evolving_infra.traces.pack``; neither gzip's magic nor JSON
text): only ``read_trace_compact`` (``simulate --trace``) reads one. Here, with gzip's, so that the
trace cache's look-up (``traces.cache``, before the simulator is imported) tells one without
importing ``traces.io``; ``traces.io.PACK_MAGIC`` is this."""

CHUNK = 4 << 20
"""Bytes read, and most bytes inflated, at a time (``traces.io._CHUNK`` is this value)."""

AHEAD_CHUNKS = 12
"""Inflated chunks :class:`InflateAhead` holds at most before its reader takes them (48 MiB at
:data:`CHUNK`): the thread waits there rather than hold a whole trace the reader is not ready for."""

SWITCH_INTERVAL_S = 0.0005
"""``sys.setswitchinterval`` while an :class:`InflateAhead` thread runs (Python's default is
0.005 s). The thread needs the GIL for a moment after each chunk it inflates; the reader's thread
holds it, running Python, and gives it up only when the interval has passed since the thread
asked: with the default, the thread waited up to 5 ms per chunk (~2 ms of inflating per MiB),
more than doubling its time at 1-MiB chunks. The reader gives the GIL up at most once per chunk for it."""


class NotOneMember(Exception):
    """The compressed stream is not one clean gzip member: ``gzip``'s own reader takes over."""


def one_member(f: IO[bytes], chunk: int = CHUNK) -> Iterator[bytes]:
    """The inflated bytes of a file that is exactly one gzip member, at most ``chunk`` at a
    time (header, CRC and length checked by zlib).

    Raises:
        NotOneMember: the data ends early, or more follows the member (another member, padding).
        zlib.error: the data is corrupt.
    """
    d = zlib.decompressobj(wbits=31)
    while not d.eof:
        data = d.unconsumed_tail or f.read(chunk)
        if not data:
            raise NotOneMember
        out = d.decompress(data, chunk)  # bounded: a trace's id lists can inflate 100-fold
        if out:
            yield out
    if d.unused_data or f.read(1):
        raise NotOneMember


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class InflateAhead:
    """:func:`one_member` of ``path`` run on a daemon thread from construction; :meth:`chunks`
    gives its chunks, then raises what it raised, in the caller's thread.

    Made by :meth:`start`, only for a file that starts with the gzip magic (None for any other,
    or one that cannot be opened: the reader then reads it itself and reports what it finds).
    :meth:`close` stops the thread (at its next chunk), waits for it to end and restores the
    switch interval; :meth:`chunks` closes it once it has given everything.

    Args:
        f: the file, open for binary reading at its start (the thread closes it).
        path: its path, as ``os.fspath`` gives it (the reader checks it is reading the same).
        chunk: as :func:`one_member`'s.
    """

    def __init__(self, f: IO[bytes], path: str, chunk: int = CHUNK) -> None:
        self.path = path
        self.chunk = chunk
        self._q: queue.Queue[object] = queue.Queue(AHEAD_CHUNKS)
        self._stop = False
        self._closed = False
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, args=(f,), name="inflate-ahead", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, path: str | os.PathLike[str], chunk: int = CHUNK) -> InflateAhead | None:
        """An :class:`InflateAhead` of ``path`` if it is a regular gzip file that can be opened,
        else None (a pipe or device is left unread for the reader)."""
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                return None
            f = open(path, "rb")  # noqa: SIM115 - the thread closes it
        except OSError:
            return None
        try:
            gz = f.read(2) == GZIP_MAGIC
            f.seek(0)
        except OSError:
            gz = False
        if not gz:
            f.close()
            return None
        return cls(f, os.fspath(path), chunk)

    def _run(self, f: IO[bytes]) -> None:
        put = self._q.put
        try:
            with f:
                for out in one_member(f, self.chunk):
                    if self._stop:
                        return
                    put(out)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, raised there
            put(_Failed(e))
            return
        put(_END)

    def chunks(self) -> Iterator[bytes]:
        """The chunks :func:`one_member` gives for the file, in order, then its exception if it
        raised one (:class:`NotOneMember`, ``zlib.error``, ``OSError``)."""
        get = self._q.get
        try:
            while True:
                item = get()
                if item is _END:
                    return
                if type(item) is _Failed:
                    raise item.error
                yield item  # type: ignore[misc]
        finally:
            self.close()

    def close(self) -> None:
        """Stop the thread (it ends at its next chunk; the chunks it holds are dropped), wait for
        it to end (no thread is left running into a later ``fork``) and restore the switch
        interval. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop = True
        while self._thread.is_alive():
            try:  # room for the chunk it may be waiting to put; then it sees _stop and ends
                self._q.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.01)
        sys.setswitchinterval(self._interval)
