"""The trace cache: ``simulate --trace FILE`` keeps a pack of FILE (docs/trace-format.md §10) and
reads that instead of FILE's JSON the next time, as pip or Hugging Face ``datasets`` keep what they
downloaded or built.

A simulation reads its trace whole before it starts; a ``.jsonl.gz`` trace is inflated and its
JSON parsed and validated every run (the 260-session Claude Code trace at 512-token blocks: ~0.13 s
of a ~1.45-s run; at 64-token blocks ~1.3 s CPU), though the pack of it
(:mod:`evolving_infra.traces.pack`) reads back as the same
:class:`~evolving_infra.traces.compact.CompactTrace`, validated, in a fraction of that. A user who
simulates the same trace again and again (knob sweeps over separate runs, benchmarks) pays that
parse once: the first run reads FILE and writes its pack into the cache; later runs read the pack.

Key: one pack per (FILE's resolved path, size, ``st_mtime_ns``, inode, device) and the *reader's
code*: a hash of the source text of the modules that decide what a trace reads as
(:data:`READER_MODULES`: ``pack.py`` holds ``PACK_VERSION``, ``compact.py`` / ``io.py`` /
``schema.py`` what is built and checked) and the Python version. So a changed FILE (rewritten,
even to the same size), an edited checkout or a new release (whose reader differs) never reads an
old pack; a FILE that changes while it is read (its stat differs after the read) leaves no pack.
(The package version itself is not read: ``importlib.metadata`` costs ~35 ms, a third of
what a hit saves, and a release whose reader is unchanged reads the same trace.) The pack's name is
the key's sha256, 32 hex digits, plus ``.eipack``.

Where (:func:`cache_dir`): ``$EI_TRACE_CACHE_DIR``, else ``$XDG_CACHE_HOME/evolving-infra/traces``,
else ``~/.cache/evolving-infra/traces`` (an empty variable counts as unset). Off:
``EI_TRACE_CACHE_DIR=off`` or ``simulate --no-trace-cache``. Folder 0700, packs 0600: a trace may
be private.

Bounded (:func:`max_bytes`): the packs' total size stays ≤ ``$EI_TRACE_CACHE_MAX_BYTES`` (bytes;
default :data:`DEFAULT_MAX_BYTES`, 4 GiB): after each write the least recently used packs go (a hit
touches its pack's mtime), never the one just written; a pack larger than the cap is not kept.

Never fails a run: a pack that does not read back whole (damaged, truncated, from a crashed write:
:func:`~evolving_infra.traces.pack.read_packed` checks its magic, length, CRC-32, layout and store
structure) is a miss (removed, FILE read, one stderr note). A hit does not check the requests'
rules (docs/trace-format.md) again (``read_packed(trusted=True)``): the pack under a key was
written by the reader whose sources the key hashes, from FILE as that reader read and checked it
whole, and its checksum says these are the bytes written (~20 ms of a hit at 512-token blocks).
Only a trace whose block ids are chained (§4; every converted trace) is kept, so a hit takes its
ids as chained without sorting them again: with the store rebuilt in Python, a hit at the trace's
block size imports no numpy (~65 ms); a trace whose ids ``simulate`` remaps is read every run
(one note); a cache that cannot be written (read-only home, disk full) leaves the run to go
on with one stderr note and nothing half-written: packs are written to a temporary file in the
cache folder and renamed (``os.replace``) onto their name, so concurrent runs and a kill mid-write
never leave a partial pack under a key (a temporary file a killed run left is removed by a later
write once an hour old).

This module imports only the standard library until a pack is read or written (``simulate`` looks
its trace up before it imports the simulator, and inflates FILE ahead only on a miss).
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evolving_infra.traces.compact import CompactTrace

__all__ = ["DEFAULT_MAX_BYTES", "ENV_DIR", "ENV_MAX_BYTES", "OFF", "CachedTrace", "TraceCacheError", "cache_dir",
           "lookup", "max_bytes"]

ENV_DIR = "EI_TRACE_CACHE_DIR"
"""Environment variable naming the cache folder, or :data:`OFF`."""
ENV_MAX_BYTES = "EI_TRACE_CACHE_MAX_BYTES"
"""Environment variable: the most bytes the packs may take together."""
OFF = "off"
"""``EI_TRACE_CACHE_DIR=off``: no cache (as ``simulate --no-trace-cache``)."""
DEFAULT_MAX_BYTES = 4 << 30
"""Default cap of the packs' total size: 4 GiB (the 260-session Claude Code trace packs into ~16 MB at
64-token blocks, ~2.5 MB at 512)."""
SUFFIX = ".eipack"
READER_MODULES = ("cache.py", "compact.py", "inflate.py", "io.py", "pack.py", "schema.py", "tokens.py")
"""Sources (in ``evolving_infra/traces/``) whose text is part of every key: what decides the trace read."""
STALE_TMP_S = 3600.0
"""A temporary file in the cache this old (seconds) is a killed run's: removed by the next write."""
_TMP_SUFFIX = ".tmp"


class TraceCacheError(ValueError):
    """The cache's settings are malformed (``EI_TRACE_CACHE_MAX_BYTES`` not a number of bytes)."""


def cache_dir() -> Path | None:
    """The cache folder (module docstring), or None when the cache is off (``EI_TRACE_CACHE_DIR=off``).
    Not created here."""
    env = os.environ.get(ENV_DIR, "")
    if env.strip().lower() == OFF:
        return None
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "evolving-infra" / "traces"


def max_bytes() -> int:
    """The cap on the packs' total size, bytes: ``$EI_TRACE_CACHE_MAX_BYTES`` or :data:`DEFAULT_MAX_BYTES`.

    Raises:
        TraceCacheError: the variable is not a whole number ≥ 0.
    """
    env = os.environ.get(ENV_MAX_BYTES, "").strip()
    if not env:
        return DEFAULT_MAX_BYTES
    try:
        n = int(env)
    except ValueError:
        n = -1
    if n < 0:
        raise TraceCacheError(f"{ENV_MAX_BYTES}={env!r} is not a number of bytes (a whole number >= 0; "
                              f"default {DEFAULT_MAX_BYTES} = 4 GiB)")
    return n


_reader_stamp: bytes | None = None


def _reader_code() -> bytes | None:
    """sha256 of :data:`READER_MODULES`' sources and the Python version (once per process); None
    when a source cannot be read (no key can then tell a changed reader: no cache)."""
    global _reader_stamp
    if _reader_stamp is None:
        h = hashlib.sha256(repr(sys.version_info[:3]).encode())
        here = Path(__file__).resolve().parent
        try:
            for name in READER_MODULES:
                h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
        except OSError:
            return None
        _reader_stamp = h.digest()
    return _reader_stamp


@dataclass
class CachedTrace:
    """One ``--trace FILE``'s place in the cache: the pack's path, whether one was there when looked
    up, and what became of it (:attr:`status`).

    Attributes:
        trace: FILE as given.
        pack: the pack's path (``<cache>/<sha256 hex[:32]>.eipack``).
        cap: the packs' total size cap, bytes.
        present: a file was at :attr:`pack` when looked up (a hit unless it fails to read back).
        status: ``"hit"`` (read from the pack), ``"miss"`` (FILE read; its pack written, or not:
            :attr:`stored`), or ``"looked-up"`` before :meth:`load` / :meth:`store`.
        stored: the pack written now (a miss).
        noted: the one stderr note of this run was printed.
        signature: FILE's (size, mtime_ns, inode, device) when looked up (in the key): :meth:`store`
            keeps no pack of a FILE that changed since (a write during the read).
    """

    trace: str
    pack: Path
    cap: int
    present: bool
    status: str = "looked-up"
    stored: bool = False
    noted: bool = field(default=False, repr=False)
    signature: tuple[int, ...] = ()

    def _note(self, text: str) -> None:
        if not self.noted:
            self.noted = True
            print(f"note: trace cache: {text}", file=sys.stderr)

    def load(self) -> CompactTrace | None:
        """The pack read back (status ``"hit"``, its mtime touched: recently used), or None: no pack,
        or one that does not read back whole (damaged: removed, one note; status ``"miss"``)."""
        from evolving_infra.traces.io import TraceError
        from evolving_infra.traces.pack import read_packed

        try:
            trace = read_packed(self.pack, trusted=True)  # written by this reader (the key) from a trace it checked
        except FileNotFoundError:  # evicted by another run since the look-up
            self.status = "miss"
            return None
        except (TraceError, OSError) as e:
            self.status = "miss"
            try:
                self.pack.unlink(missing_ok=True)
            except OSError:
                pass
            why = e.problems[0].reason if isinstance(e, TraceError) and e.problems else str(e)
            self._note(f"{self.pack} did not read back ({why}); reading {self.trace} and packing it again")
            return None
        trace.store.known_chained()  # only a chained trace's pack is kept (store): no sort of its ids again
        self.status = "hit"
        try:
            os.utime(self.pack)
        except OSError:  # a read-only cache still serves its packs
            pass
        return trace

    def store(self, trace: CompactTrace) -> None:
        """Write ``trace`` (as read from :attr:`trace`) as the pack (status ``"miss"``), then evict the
        least recently used packs beyond the cap. Never raises for the cache's sake: a folder or
        file that cannot be written is one note, the run goes on, no partial file left."""
        from evolving_infra.traces.pack import write_packed

        self.status = "miss"
        try:
            now = _signature(os.stat(self.trace))
        except OSError:
            now = ()
        if now != self.signature:  # FILE changed while it was read: its pack would not be the file under the key
            return
        if not trace.store.chained():  # (the caller's rechained() asks next: the answer is kept) a hit takes its
            # pack as chained without sorting its ids (load); a trace whose ids must be remapped is read every run
            self._note(f"{self.trace}'s block ids are not chained (remapped every run; docs/trace-format.md §4); "
                       "its pack is not kept")
            return
        folder = self.pack.parent
        tmp: str | None = None
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=self.pack.stem + ".", suffix=_TMP_SUFFIX)
            with os.fdopen(fd, "wb") as f:
                size = write_packed(f, trace)
            if size > self.cap:
                os.unlink(tmp)
                tmp = None
                self._note(f"the pack of {self.trace} ({size:,} bytes) is larger than the cache's cap ({self.cap:,} "
                           f"bytes, {ENV_MAX_BYTES}); not kept")
                return
            os.replace(tmp, self.pack)
            tmp = None
            self.stored = True
        except OSError as e:
            self._note(f"cannot write {folder} ({e.strerror or e}); this run goes on without caching {self.trace}")
            return
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        evict(folder, self.cap, keep=self.pack)


def evict(folder: Path, cap: int, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used packs (oldest mtime first) in ``folder`` until their total size is
    ≤ ``cap`` bytes, never ``keep``; and temporary files older than :data:`STALE_TMP_S` (a killed run's).
    Files another run removes meanwhile are skipped.

    Returns:
        The packs removed.
    """
    packs: list[tuple[int, int, Path]] = []
    total = 0
    now = time.time()
    try:
        scan = list(os.scandir(folder))
    except OSError:
        return []
    for e in scan:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if e.name.endswith(SUFFIX):
            packs.append((st.st_mtime_ns, st.st_size, Path(e.path)))
            total += st.st_size
        elif e.name.endswith(_TMP_SUFFIX) and now - st.st_mtime > STALE_TMP_S:
            try:
                os.unlink(e.path)
            except OSError:
                pass
    removed: list[Path] = []
    for _, size, p in sorted(packs, key=lambda t: (t[0], t[2].name)):
        if total <= cap:
            break
        if keep is not None and p == keep:
            continue
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            continue
        total -= size
        removed.append(p)
    return removed


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def lookup(trace: str | os.PathLike[str], folder: Path | None = None, cap: int | None = None) -> CachedTrace | None:
    """``trace``'s place in the cache, or None: the cache is off, or ``trace`` is not a regular file
    that can be read (stdin, a pipe: read as before), or is a pack itself, or the reader's sources
    cannot be read. Reads 8 bytes of ``trace`` and stats it; nothing is written.

    Args:
        trace: the ``--trace`` path.
        folder: the cache folder (default :func:`cache_dir`).
        cap: the total size cap, bytes (default :func:`max_bytes`).

    Raises:
        TraceCacheError: ``EI_TRACE_CACHE_MAX_BYTES`` is malformed.
    """
    folder = cache_dir() if folder is None else folder
    if folder is None:
        return None
    cap = max_bytes() if cap is None else cap
    code = _reader_code()
    if code is None:
        return None
    from evolving_infra.traces.inflate import PACK_MAGIC

    try:
        path = Path(trace).resolve()
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a pipe (<(zcat ...)), a device: read once, as before (never opened here)
            return None
        with open(path, "rb") as f:
            if f.read(len(PACK_MAGIC)) == PACK_MAGIC:
                return None
    except (OSError, RuntimeError):  # missing, unreadable (the read says so), a symlink loop
        return None
    sig = _signature(st)
    key = hashlib.sha256(code + repr((str(path), *sig)).encode()).hexdigest()
    pack = folder / (key[:32] + SUFFIX)
    return CachedTrace(str(trace), pack, cap, present=os.path.isfile(pack), signature=sig)
