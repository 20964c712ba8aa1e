"""Shared pieces of the converters: input expansion, the conversion object, streaming output."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import IO, Any

from evolving_infra.traces.io import Trace, encode_line, make_folders, remove_folders
from evolving_infra.traces.schema import FORMAT, VERSION, TraceHeader, TraceRequest

__all__ = [
    "ConvertError", "Conversion", "MAX_HEADER_NAMES", "Skipped", "expand_inputs", "inputs_meta", "lcp", "progress_iter",
    "source_line", "write_conversion",
]

MAX_HEADER_NAMES = 1000
"""Input names a converter's header lists at most (``meta.inputs``, ``source``), and skipped files
(``meta.skipped.files``) and claude-code-weka's ``meta.block_ids.file_number_fallbacks`` entries it
keeps at most: one name per file put a conversion of ~150k+ files over the readers' 8 MiB bound on
line 1 (:data:`evolving_infra.traces.io.MAX_FIRST_LINE`), a trace no reader accepts. 1,000 names
of up to 255 bytes (a file name) are under 1.6 MB even with every byte JSON-escaped; the real
WEKA folder has 530 files, so its header is unchanged."""


def inputs_meta(names: Sequence[str]) -> dict[str, Any]:
    """The header's ``meta`` entries that name a conversion's input files, bounded.

    ``{"inputs": names}`` for at most :data:`MAX_HEADER_NAMES` names (as before); more are listed
    as the first :data:`MAX_HEADER_NAMES` (``inputs``) plus ``inputs_count`` (all of them),
    ``inputs_last`` (the last name) and ``inputs_sha256``: the SHA-256 (hex) of every name, in
    order, each followed by a newline (UTF-8) -- ``printf '%s\n' NAME... | sha256sum`` of the same
    list -- so a user can check that a given list of files is what went in.
    """
    names = list(names)
    if len(names) <= MAX_HEADER_NAMES:
        return {"inputs": names}
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode("utf-8", "surrogateescape") + b"\n")
    return {"inputs": names[:MAX_HEADER_NAMES], "inputs_count": len(names), "inputs_last": names[-1], "inputs_sha256": h.hexdigest()}


def source_line(kind: str, inputs: Sequence[str | os.PathLike[str]]) -> str:
    """The header's ``source``: ``KIND: INPUT, INPUT, ...`` of the inputs as given (files or
    folders), the first :data:`MAX_HEADER_NAMES` of them and then ``... (N inputs in all)``."""
    shown = ", ".join(str(p) for p in inputs[:MAX_HEADER_NAMES])
    more = f", ... ({len(inputs):,} inputs in all)" if len(inputs) > MAX_HEADER_NAMES else ""
    return f"{kind}: {shown}{more}"


class ConvertError(ValueError):
    """A raw input cannot be converted; the message names the file and the reason."""


def read_input(path: Path) -> bytes:
    """The bytes of a converter's input file, gunzipped when they start with gzip's magic bytes (whatever the
    file's name).

    Raises:
        ConvertError: ``"{path}: cannot read: {reason}"``: missing or unreadable, or a gzip stream that is cut
            short or corrupt (``zlib.error`` included: a damaged deflate stream is no ``BadGzipFile``).
    """
    try:
        raw = path.read_bytes()
        return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ConvertError(f"{path}: cannot read: {e}") from None


class Skipped:
    """Files a converter could not read: named with the reason on stderr, skipped, counted in
    the header (``meta.skipped``); with ``strict`` the first one stops the conversion instead.

    Args:
        strict: re-raise the first :class:`ConvertError` instead of skipping the file.
    """

    #: bad rows named on stderr one by one; after that, one summary line per file
    WARN_ROWS = 20
    #: bad rows listed in ``meta.skipped.rows`` (all are counted in ``rows_count``)
    META_ROWS = 100
    #: skipped files listed in ``meta.skipped.files`` (all are counted in ``count``)
    META_FILES = MAX_HEADER_NAMES

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.files: list[dict[str, str]] = []  # the first META_FILES
        self.files_count = 0
        self.rows: list[dict[str, object]] = []
        self.rows_count = 0
        self._rows_by_file: dict[str, int] = {}

    def call(self, path: Path, fn: Callable[[], Any]) -> Any:
        """``fn()``; on a :class:`ConvertError` skip ``path`` (return None) unless strict.

        Raises:
            ConvertError: with ``strict``.
        """
        try:
            return fn()
        except ConvertError as e:
            if self.strict:
                raise
            # every ConvertError names its file first (for --strict's one line); the warning and
            # meta.skipped name it once ("skipped F: F: not a ..." before)
            reason = str(e).removeprefix(f"{path}: ")
            self.files_count += 1
            if len(self.files) < self.META_FILES:
                self.files.append({"file": str(path), "reason": reason})
            print(f"warning: skipped {path}: {reason}", file=sys.stderr)
            return None

    def row(self, path: Path, line: int, reason: str) -> None:
        """A row of a row-per-line file (Mooncake JSONL, Azure CSV) cannot be converted: name
        ``path``, its 1-based ``line`` and the reason on stderr (the first :attr:`WARN_ROWS` of a
        file; the rest are summed by :meth:`end_file`), count it, go on with the next row.

        Raises:
            ConvertError: with ``strict``, naming the file and line.
        """
        if self.strict:
            raise ConvertError(f"{path}: line {line}: {reason}")
        self.rows_count += 1
        n = self._rows_by_file.get(str(path), 0) + 1
        self._rows_by_file[str(path)] = n
        if len(self.rows) < self.META_ROWS:
            self.rows.append({"file": str(path), "line": line, "reason": reason})
        if n <= self.WARN_ROWS:
            print(f"warning: skipped {path}: line {line}: {reason}", file=sys.stderr)

    def end_file(self, path: Path) -> None:
        """After the last row of ``path``: one line with how many of its bad rows were not named."""
        n = self._rows_by_file.get(str(path), 0)
        if n > self.WARN_ROWS:
            print(f"warning: {path}: {n} rows skipped in all ({n - self.WARN_ROWS} not named above)", file=sys.stderr)

    def none_converted(self) -> None:
        """Call when no file converted: a trace of nothing would not validate.

        Raises:
            ConvertError: naming the first skipped file (or row) and its reason, when any was skipped.
        """
        if self.files:
            first = self.files[0]
            raise ConvertError(f"none of the input files could be converted ({self.files_count} skipped); "
                               f"first: {first['file']}: {first['reason']}")
        if self.rows:
            row = self.rows[0]
            raise ConvertError(f"no row of the inputs could be converted ({self.rows_count} skipped); "
                               f"first: {row['file']}: line {row['line']}: {row['reason']}")

    def meta(self) -> dict[str, Any]:
        """``{"count": n, "files": [{"file", "reason"}, ...]}`` (the first :attr:`META_FILES`) for
        the header, plus ``rows_count`` and ``rows`` (the first :attr:`META_ROWS` ``{"file",
        "line", "reason"}``) when rows were skipped."""
        out: dict[str, Any] = {"count": self.files_count, "files": self.files}
        if self.rows_count:
            out.update(rows_count=self.rows_count, rows=self.rows)
        return out


def expand_inputs(paths: Sequence[str | os.PathLike[str]], patterns: Sequence[str]) -> list[Path]:
    """Files named directly, plus files under named folders matching ``patterns`` (recursive), sorted.

    A folder contributes its matching files in sorted path order; explicitly
    named files keep the given order. Duplicates are removed.

    Raises:
        ConvertError: a path does not exist, or a folder holds no matching file.
    """
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted({f for pat in patterns for f in p.rglob(pat) if f.is_file()})
            if not found:
                raise ConvertError(f"{p}: no input files matching {' or '.join(patterns)}")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise ConvertError(f"{p}: no such file or folder")
    return list(dict.fromkeys(out))


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists; exact for any lists.

    Fast path for chained ids (an equal id at position j implies equal
    prefixes): binary search on single elements, then one slice comparison to
    verify; if the lists are not chained there, a binary search on slice
    equality (C-speed compares) gives the exact answer.
    """
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if a[n - 1] == b[n - 1] and a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # candidate: a[:lo] == b[:lo], a[hi] != b[hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    if a[:lo] == b[:lo] and a[lo] != b[lo]:
        return lo
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] holds; a[:hi+1] != b[:hi+1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


PROGRESS_EVERY_S = 5.0
"""Wall seconds between :func:`progress_iter`'s lines when stderr is no terminal (as ``simulate``'s)."""


def progress_iter(
    items: Iterable[Any], *, enabled: bool, desc: str, every_s: float | None = None, unit: str = "file", stream: IO[str] | None = None
) -> Iterable[Any]:
    """``items`` with progress on ``stream`` (default stderr) when ``enabled``: a tqdm bar, redrawn, on a
    terminal; otherwise (a log file, a pipe, CI) one whole line every ``every_s`` wall seconds (default
    :data:`PROGRESS_EVERY_S`), ``DESC: 120 of 530 files, 8 s``, or ``DESC: 120,000 requests, 8 s`` when
    ``items`` has no length (a stream), as ``simulate``'s progress. ``unit``: what an item is, singular
    (``file``, ``request``). A 34-s conversion of the 530 WEKA files printed nothing into a log before."""
    if not enabled:
        return items
    out = sys.stderr if stream is None else stream
    total = len(items) if isinstance(items, Sized) else None
    if out.isatty():
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit=unit, total=total, file=out, leave=False)
    return _progress_lines(items, desc, PROGRESS_EVERY_S if every_s is None else every_s, unit, total, out)


def _progress_lines(items: Iterable[Any], desc: str, every_s: float, unit: str, total: int | None, out: IO[str]) -> Iterator[Any]:
    t0 = time.monotonic()
    next_at = t0 + every_s
    of = "" if total is None else f" of {total:,}"
    for i, item in enumerate(items):
        if (t := time.monotonic()) >= next_at:
            next_at = t + every_s
            print(f"{desc}: {i:,}{of} {unit}s, {t - t0:,.0f} s", file=out, flush=True)
        yield item


class Conversion:
    """A streaming conversion: iterate :meth:`requests` once, then read :attr:`header`.

    The header is complete only after the requests are exhausted (it records
    counts found on the way, e.g. clipped lengths).
    """

    def __init__(self, requests: Iterator[TraceRequest], header: Callable[[], TraceHeader]):
        self._requests = requests
        self._header = header
        self._done = False

    def requests(self) -> Iterator[TraceRequest]:
        yield from self._requests
        self._done = True

    @property
    def header(self) -> TraceHeader:
        if not self._done:
            raise RuntimeError("Conversion.header is known only after requests() is exhausted")
        return self._header()

    def to_trace(self) -> Trace:
        reqs = list(self.requests())
        return Trace(self.header, reqs)


def make_header(*, block_size: int, source: str, description: str, meta: dict[str, Any]) -> TraceHeader:
    return TraceHeader(format=FORMAT, version=VERSION, block_size=block_size, source=source, description=description, meta=meta)


def write_conversion(conv: Conversion, out: str | os.PathLike[str] | IO[bytes]) -> tuple[TraceHeader, int]:
    """Stream a conversion into ``out`` (gzip when the name ends in ``.gz``), header first.

    Requests are spooled to a temporary file next to ``out`` while the header's
    counts are collected, then header + requests are written; the bytes are the
    same as :func:`evolving_infra.traces.io.write_trace` would give. ``out`` may also be an
    open binary stream (``trace convert -o -``: stdout), written uncompressed; the spool is
    then in the system's temporary folder. The spool has no name (``tempfile.TemporaryFile``),
    so nothing of it outlives the process however it ends (SIGTERM, SIGKILL: a named spool
    stayed, a copy of the whole trace). A conversion that fails (``--strict``) leaves nothing
    new on disk: no spool, no ``.tmp``, none of the folders made for ``out``.

    Returns:
        (header, number of requests).
    """
    stream = not isinstance(out, (str, os.PathLike))
    outp = Path("-" if stream else out)  # type: ignore[arg-type]
    made = [] if stream else make_folders(outp.parent)
    n = 0
    tmp = outp.with_name(outp.name + ".tmp")
    try:
        spool_dir = None if stream else outp.parent
        with tempfile.TemporaryFile(dir=spool_dir, prefix=outp.name + ".", suffix=".body") as body:
            for r in conv.requests():
                body.write(encode_line(r))
                body.write(b"\n")
                n += 1
            header = conv.header
            body.seek(0)
            if stream:
                f: IO[bytes] = out  # type: ignore[assignment]
                f.write(encode_line(header) + b"\n")
                shutil.copyfileobj(body, f, 1 << 20)
                f.flush()
                return header, n
            with open(tmp, "wb") as raw:
                if outp.name.endswith(".gz"):
                    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
                        gz.write(encode_line(header) + b"\n")
                        shutil.copyfileobj(body, gz, 1 << 20)
                else:
                    raw.write(encode_line(header) + b"\n")
                    shutil.copyfileobj(body, raw, 1 << 20)
            os.replace(tmp, outp)
    except BaseException:  # the spool is gone already (closed)
        if not stream:
            tmp.unlink(missing_ok=True)
        remove_folders(made)
        raise
    return header, n
