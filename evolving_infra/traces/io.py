"""Read, validate and write canonical agent traces (spec: docs/trace-format.md).

A trace file is JSON Lines, optionally gzip-compressed (detected by the gzip
magic bytes, so the name does not matter when reading; ``.gz`` names are
compressed when writing). Line 1 is a :class:`~evolving_infra.traces.schema.TraceHeader`,
every further line a :class:`~evolving_infra.traces.schema.TraceRequest`.

Validation is streaming and never stops at the first problem: every bad line is
reported as ``line N: reason`` and the lines after it are still checked, so
nothing after a bad line is silently lost. Rules (each a :class:`TraceProblem`):

* line 1 is the header (``format`` = ``evolving-infra-trace``, ``version`` ≤ the
  version this code reads, ``block_size`` > 0);
* every other line decodes as a request (valid JSON, required fields present,
  ``input_tokens`` ≥ 1, ``output_tokens`` ≥ 0, ``pause_s`` ≥ 0, known ``kind``);
* request ids are unique;
* ``after`` lists earlier requests of the same agent, each once;
* ``len(blocks) == input_tokens // block_size`` and every id is in [0, 2**48);
* a branch's first request sets ``kind``; ``fork``/``subagent`` branches set
  ``parent_branch``, which is a branch of the same agent that appeared earlier in
  the file; a ``main`` branch has no parent; later requests of a branch set
  neither; every request of a branch has the same agent;
* no request follows its branch's ``ends_branch`` request, and every branch ends
  (its last request has ``ends_branch``).

Cascades are avoided: a request or branch defined on a bad line is still
remembered when its id can be read, so the lines that refer to it are not
reported again; only the bad line itself is.
"""

from __future__ import annotations

import gc
import gzip
import os
import re
import zlib
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import repeat
from pathlib import Path
from typing import IO, Any

import msgspec

from evolving_infra.traces.inflate import CHUNK, GZIP_MAGIC, PACK_MAGIC, InflateAhead, NotOneMember, one_member
from evolving_infra.traces.schema import FORMAT, MAX_BLOCK_ID, VERSION, TraceHeader, TraceRequest
from shared.values import FACTORY, Value

__all__ = [
    "NO_REQUESTS",
    "PACK_MAGIC",
    "Trace",
    "TraceError",
    "TraceProblem",
    "iter_chain_problems",
    "iter_requests",
    "iter_validate",
    "open_trace_bytes",
    "paused_gc",
    "read_header",
    "read_trace",
    "sample_sessions",
    "write_trace",
]

_GZIP_MAGIC = GZIP_MAGIC
# PACK_MAGIC (defined in traces.inflate, which the trace cache's look-up imports alone): the first bytes of
# a packed trace (``evolving_infra.traces.pack``): only ``read_trace_compact`` (``simulate --trace``) reads
# one; the line readers see its magic as its only line and name it.
_PACKED = "a packed trace (trace pack): simulate --trace reads it; the other commands read the .jsonl[.gz] it was packed from"
_NOT_CANONICAL = ("not a canonical trace (its line 1 is the header {\"format\": \"" + FORMAT + "\", ...}); a raw public "
                  "trace is converted first: evolving-infra trace convert --from "
                  "{azure,claude-code-weka,mini-swe-agent,mooncake,openai-chat} IN... -o OUT.jsonl.gz (docs/trace-format.md)")
"""Appended to an invalid line-1 header: a raw WEKA Claude Code file given to ``simulate --trace`` read only
'invalid trace header: Object missing required field `format`', naming neither the cause nor the command."""
_HEADER_DECODER = msgspec.json.Decoder(TraceHeader)
_STR_FIELD = re.compile(rb'"(id|branch|agent)"\s*:\s*("(?:[^"\\]|\\.)*")')
"""A request line's ``"id"``/``"branch"``/``"agent"`` string pairs, found in a line that is not JSON
(:meth:`_Validator._remember_unreadable`)."""


def _json_str(raw: bytes) -> str | None:
    """The string a JSON string literal (quotes included) stands for; None when it is not one."""
    try:
        v = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return v if isinstance(v, str) else None


def trace_identity(header: TraceHeader, requests: Sequence[Any]) -> dict[str, Any]:
    """``meta`` keys that name a run's input trace by its content, whichever file held it (a ``.jsonl.gz`` or the
    ``.eipack`` packed from it): ``trace_source`` (the header's ``source``) and ``trace_requests`` (how many
    requests the trace holds, as read: before any sampling). With ``trace_block_size`` they are
    ``report compare``'s :data:`~evolving_infra.report.compare.TRACE_IDENTITY_KEYS`; ``simulate``, ``demo`` and
    ``replay`` record them."""
    return {"trace_source": header.source, "trace_requests": len(requests)}


NO_REQUESTS = "the trace has no requests (a header and nothing after it): nothing to replay"
"""Named by the commands that replay a trace (``simulate --trace``, ``demo``, ``fidelity``, ``replay``) for a
valid trace of no request, which they refuse (exit 2) before any run: ``simulate`` wrote a report of 0 requests
and exited 0. ``trace validate`` still passes it (the format allows it) and ``trace stats`` gives its zeros."""


def _run_record(obj: dict[str, Any]) -> bool:
    """Whether ``obj`` (a decoded line 1) is a record of a run's ``requests.jsonl``: it has every field a
    ``RequestRecord`` requires (``id``, ``agent``, ``branch``, ``sent_at``), ``sent_at`` being no trace field."""
    from evolving_infra.report.records import RequestRecord

    return all(f.name in obj for f in msgspec.structs.fields(RequestRecord) if f.required)


_RUN_RECORDS = ("this is a run's requests.jsonl (one record per request served: ttft_s, e2e_s ...), not a trace; the "
                "trace that run replayed is named in its report.json (meta.trace)")
_RUN_REPORT = ("'{' alone: a JSON document over several lines, such as a run's report.json, not a trace (a "
               "trace is JSON Lines: its line 1 is the header {\"format\": \"" + FORMAT + "\", ...}); the trace a run "
               "replayed is named in its report.json (meta.trace)")

DYNAMO_AGENTIC = "dynamo.agentic_mooncake"
"""The ``schema`` of NVIDIA Dynamo's ``agentic_mooncake`` trace header (``bench/sim_speed.py`` ``dynamo_trace``
writes one)."""


def dynamo_agentic_problem(obj: dict[str, Any]) -> str:
    """What to say of a Dynamo ``agentic_mooncake`` trace given where a canonical trace or a Mooncake FAST'25
    trace is read (``obj``: its header line, ``{"schema": "dynamo.agentic_mooncake", "version", "block_size",
    "source", ...}``): what it is, that no converter here reads it, and the trace it was written from when its
    header names one (``source.format`` is this project's)."""
    src = obj.get("source")
    made_from = ""
    if isinstance(src, dict) and src.get("format") == FORMAT and isinstance(src.get("digest"), str):
        made_from = (f"; its header says it was written from this project's trace {src['digest']!r} (bench/sim_speed.py "
                     "dynamo_trace): give that file instead")
    return (f"a Dynamo agentic_mooncake trace (header schema {DYNAMO_AGENTIC!r}, version {obj.get('version')!r}), not "
            "a canonical trace nor a Mooncake FAST'25 trace: no converter here reads its request graph (play_id, "
            "session_id, dependencies); replay it with Dynamo, or convert the trace it was made from" + made_from)


def _header_problem(raw: bytes, e: msgspec.DecodeError) -> str:
    """The problem of a line 1 that is no valid header: the decoder's reason, and :data:`_NOT_CANONICAL` unless
    the line is a JSON object with a ``format`` key (a canonical header with a bad field). A line 1 of a run's
    ``requests.jsonl`` or ``report.json``, or of a Dynamo ``agentic_mooncake`` trace, is named as what it is."""
    if raw.strip() == b"{":
        return _RUN_REPORT
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        obj = None
    if isinstance(obj, dict) and "format" in obj:
        return f"invalid trace header: {_short(e)}"
    if isinstance(obj, dict) and _run_record(obj):
        return _RUN_RECORDS
    if isinstance(obj, dict) and obj.get("schema") == DYNAMO_AGENTIC:
        return dynamo_agentic_problem(obj)
    return f"invalid trace header: {_short(e)}; {_NOT_CANONICAL}"
_REQUEST_DECODER = msgspec.json.Decoder(TraceRequest)
_MISSING_HEADER = f'missing trace header (expected {{"format": "{FORMAT}", "block_size": ...}} first)'
_REQUEST_KEYS = frozenset(f.name for f in msgspec.structs.fields(TraceRequest) if f.required)
"""The fields every request sets (id, agent, branch, input_tokens, output_tokens)."""
_REQUEST_FIELDS = frozenset(f.name for f in msgspec.structs.fields(TraceRequest))
"""Every field a request may set."""


def _request_like(raw: bytes) -> bool:
    """Whether a line 1 that is no header and no valid request is still meant as a request (a
    JSON object with no ``format``, at least 3 of :data:`_REQUEST_KEYS`, and more of its keys
    request fields than not): a headerless trace whose first request is itself bad, reported as a
    missing header plus that request's problems (it read 'not a canonical trace' and to convert a
    raw trace). No raw public trace's object has 3 of these names (WEKA's has ``id``; Mooncake's
    rows ``input_length``/``output_length``). A run's ``requests.jsonl`` record has ``id``,
    ``agent`` and ``branch`` among ~20 keys of its own (``ttft_s``, ``prompt_tokens`` ...): not a
    request (given as ``--trace`` it read 'missing trace header' and 'invalid request: ... missing
    required field `input_tokens`' on every line, read to its end)."""
    try:
        obj = _ANY_DECODER.decode(raw)
    except msgspec.DecodeError:
        return False
    if not isinstance(obj, dict) or "format" in obj or len(_REQUEST_KEYS.intersection(obj)) < 3:
        return False
    known = len(_REQUEST_FIELDS.intersection(obj))
    return known > len(obj) - known


def _request_type(blocks_type: Any = list[int], blocks_default: Any = msgspec.NODEFAULT) -> type[msgspec.Struct]:
    """:class:`TraceRequest`'s fields with ``blocks`` of another type (default: ids left unbounded,
    to tell a request whose only fault is an id out of range, reported by the validator's own
    check with the line's other problems, from a malformed one; ``msgspec.Raw``: the ids' JSON text
    kept undecoded, ``traces.compact``). Built from the struct's fields, so it cannot drift."""
    fields: list[Any] = []
    for f in msgspec.structs.fields(TraceRequest):
        tp = blocks_type if f.name == "blocks" else f.type
        if f.name == "blocks" and blocks_default is not msgspec.NODEFAULT:
            fields.append((f.name, tp, blocks_default))
        elif f.default is not msgspec.NODEFAULT:
            fields.append((f.name, tp, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, tp, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, tp))
    return msgspec.defstruct("TraceRequest", fields, frozen=True, kw_only=True, omit_defaults=True)


_LENIENT: list[msgspec.json.Decoder[Any]] = []


def _lenient_decoder() -> msgspec.json.Decoder[Any]:
    """The decoder of a request line whose ids are left unbounded (:func:`_request_type`'s default),
    made the first time a line needs it (a line the strict decoder rejects): a valid trace is read
    without it (~1 ms of struct and decoder set-up at import)."""
    if not _LENIENT:
        _LENIENT.append(msgspec.json.Decoder(_request_type()))
    return _LENIENT[0]


_ANY_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder(order="deterministic")


class TraceProblem(msgspec.Struct, frozen=True):
    """One bad line: 1-based ``line`` number and a human-readable ``reason``."""

    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


ERROR_SHOWN_PROBLEMS = 20
"""Problems :class:`TraceError`'s message lists: a file that is no trace at all (a README, a log
given as ``--trace``) has one per line, and ``simulate`` / ``replay`` / ``trace stats`` printed all
of them (635 lines for the README) as their one error. ``trace validate`` still prints every one."""


class TraceError(ValueError):
    """A trace file has problems; ``problems`` lists every one, in line order.

    ``str(err)`` is ``"<path>: N problem(s)"`` followed by one ``line N: reason``
    for each of the first :data:`ERROR_SHOWN_PROBLEMS` problems, then, when there
    are more, one line saying how many were left out and that ``evolving-infra
    trace validate`` lists them all.
    """

    def __init__(self, path: str | os.PathLike[str], problems: list[TraceProblem]):
        self.path = str(path)
        self.problems = problems
        lines = [f"{self.path}: {len(problems)} problem(s)"] + [str(p) for p in problems[:ERROR_SHOWN_PROBLEMS]]
        if len(problems) > ERROR_SHOWN_PROBLEMS:
            lines.append(f"... {len(problems) - ERROR_SHOWN_PROBLEMS} more not shown (evolving-infra trace validate lists every one)")
        super().__init__("\n".join(lines))


class Trace(Value):
    """A whole trace in memory: the header and the requests in file order."""

    header: TraceHeader
    requests: list[TraceRequest]

    __slots__ = __match_args__ = ("header", "requests")

    def __init__(self, header: TraceHeader, requests: Any = FACTORY) -> None:
        self.header = header
        self.requests = [] if requests is FACTORY else requests

    def agents(self) -> list[str]:
        """Agent ids in order of first appearance."""
        return list(dict.fromkeys(r.agent for r in self.requests))

    def by_agent(self) -> dict[str, list[TraceRequest]]:
        """Requests grouped by agent (file order kept inside each group)."""
        out: dict[str, list[TraceRequest]] = {}
        for r in self.requests:
            out.setdefault(r.agent, []).append(r)
        return out


# ----------------------------------------------------------------------------- reading


def open_trace_bytes(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open a trace file for binary reading, decompressing gzip if the file starts with its magic."""
    f = open(path, "rb")  # noqa: SIM115 - returned to the caller
    magic = f.read(2)
    f.seek(0)
    if magic == _GZIP_MAGIC:
        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]
    return f


def _strip_eol(raw: bytes) -> bytes:
    if raw.endswith(b"\n"):
        raw = raw[:-1]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
    return raw


_CHUNK = CHUNK
"""Bytes read, and most bytes inflated, at a time by :func:`_line_runs` (``gzip``'s line reads go
8 KiB at a time through Python, with a separate CRC pass: ~20% of reading a large compressed
trace). zlib's cost per byte falls with the bytes inflated per call (each call fills a chain of
output blocks from 32 KiB up): reading the 260-session CC trace at 64-token blocks (281 MB
inflated) took 6.15 G instructions with 1-MiB calls, 5.88 G with 4-MiB ones (5.77 G with 16 MiB),
for ~10 MB more peak memory while reading (the run's peak, in its loop, is unchanged)."""
_HOLD = 1 << 20
"""Inflated bytes :func:`_line_runs` holds back until more follows: ``gzip`` loses at most one
read of its buffer (8 KiB; 128 KiB from Python 3.12) before bad data, so the lines given before an
error are never more than ``gzip`` gives."""

Span = tuple[bytes, int, int]
"""A line as ``(buf, start, end)``: the line is ``buf[start:end]``, its end (``\\n``, and a
``\\r`` before it) excluded. ``buf`` is a whole chunk of the file, shared by the lines in it: a
reader slices out only what it keeps (``traces.compact`` copies a request's ids' text once, not
the line and then the ids)."""


_NotOneMember = NotOneMember


def _one_member(f: IO[bytes]) -> Iterator[bytes]:
    """The inflated bytes of a file that is exactly one gzip member, at most :data:`_CHUNK` at a
    time (``traces.inflate.one_member``).

    Raises:
        _NotOneMember: the data ends early, or more follows the member (another member, padding).
        zlib.error: the data is corrupt.
    """
    return one_member(f, _CHUNK)


Run = tuple[bytes, list[int], list[int]]
"""Lines of one buffer as ``(buf, starts, ends)``: line ``i`` is ``buf[starts[i]:ends[i]]``, as a
:data:`Span` (``traces.compact`` takes a whole run in one call: no generator step per line)."""


MAX_FIRST_LINE = 8 << 20
"""Bytes of a file read at most to find the end of its line 1 (8 MiB): a file with no newline in
them is no trace (:class:`_NoFirstLine`). Line 1 is the header (12.7 KB in the real Claude Code
trace, with its converter options and skipped files in ``meta``); the longest request line of
that trace at 64-token blocks is 136 KB, and a request of 1M tokens at 16-token blocks ~1 MB. A
file of 18 MB of zeros, or a binary with no newline, was read whole before it failed."""
_NO_FIRST_LINE = f"not a trace (no newline in the first {MAX_FIRST_LINE:,} bytes); " + _NOT_CANONICAL


class _NoFirstLine(Exception):
    """Raised by :func:`_span_runs` (and the ``gzip`` fallback of :func:`_file_line_runs`) when
    the first :data:`MAX_FIRST_LINE` bytes hold no newline: the readers report it as line 1's one
    problem (:func:`_no_first_line`) and read no further."""


def _no_first_line(v: "_Validator") -> None:
    v._bad(1, _NO_FIRST_LINE)


def _span_runs(chunks: Iterable[bytes], hold: int) -> Iterator[Run]:
    """The lines of the concatenated ``chunks`` as :data:`Run` s, none copied but a line that
    crosses a chunk's end (its own run); a line only once ``hold`` more bytes follow it, or the
    chunks have ended (an error raised by ``chunks`` comes before the lines it holds back). A last
    line without its end keeps a ``\\r`` at its end (as reading the file line by line gives it).

    Raises:
        _NoFirstLine: the first :data:`MAX_FIRST_LINE` bytes hold no newline (read no further
            than that and one more chunk).
    """
    held: deque[list[Any]] = deque()  # [buf, starts, ends, newline indices, base, lines given]
    total = 0  # bytes read
    rest: list[bytes] = []  # pieces of a line not ended yet
    find = bytes.find
    first = True  # no newline seen yet
    for buf in chunks:
        base, total = total, total + len(buf)
        nl = buf.find(b"\n")
        if nl < 0:
            if first and total >= MAX_FIRST_LINE:
                raise _NoFirstLine
            rest.append(buf)
            continue
        if first:
            if base + nl >= MAX_FIRST_LINE:
                raise _NoFirstLine
            first = False
        if rest:
            rest.append(buf[:nl])
            line = b"".join(rest)
            rest = []
            n = len(line)
            held.append([line, [0], [n - 1 if n and line[-1] == 13 else n], [n], base + nl - n, 0])
            starts, nls = [], []
        else:
            starts, nls = [0], [nl]
        s = nl + 1
        nl = find(buf, b"\n", s)
        while nl >= 0:
            starts.append(s)
            nls.append(nl)
            s = nl + 1
            nl = find(buf, b"\n", s)
        if nls:
            ends = nls
            if find(buf, b"\r") >= 0:
                ends = [e - 1 if e > s and buf[e - 1] == 13 else e for s, e in zip(starts, nls)]
            held.append([buf, starts, ends, nls, base, 0])
        if s < len(buf):
            rest.append(buf[s:])
        lim = total - hold  # a line is given once base + its newline + 1 <= lim
        while held:
            run = held[0]
            b, ss, es, nls, rb, pos = run
            k = bisect_right(nls, lim - rb - 1, pos)
            if k == len(nls):
                held.popleft()
                yield (b, ss, es) if pos == 0 else (b, ss[pos:], es[pos:])
                continue
            if k > pos:
                run[5] = k
                yield b, ss[pos:k], es[pos:k]
            break
    for b, ss, es, _, _, pos in held:
        yield (b, ss, es) if pos == 0 else (b, ss[pos:], es[pos:])
    if rest:  # a last line without its end
        line = b"".join(rest)
        yield line, [0], [len(line)]


_BOM = b"\xef\xbb\xbf"
"""The UTF-8 byte order mark: editors on Windows (Notepad, PowerShell's ``Out-File -Encoding utf8``)
write it before the first line; JSON has no place for it (msgspec: 'invalid character (byte 0)')."""


def _line_runs(path: str | os.PathLike[str], ahead: InflateAhead | None = None) -> Generator[Run, None, None]:
    """:func:`_file_line_runs` with a UTF-8 byte order mark (:data:`_BOM`) before the first line
    left out. Only the first run is looked at; the others are the reader's own (``yield from``:
    no Python step per run)."""
    runs = _file_line_runs(path, ahead)
    try:
        for buf, starts, ends in runs:
            if buf.startswith(_BOM, starts[0]):
                starts = starts.copy()  # the reader's list: a run's lists may be slices of a held one
                starts[0] += len(_BOM)
            yield buf, starts, ends
            break
        yield from runs
    finally:
        runs.close()  # the file (and ``ahead``) closed now, whenever this is closed


def _file_line_runs(path: str | os.PathLike[str], ahead: InflateAhead | None = None) -> Generator[Run, None, None]:
    """The lines of a trace file, gzip or plain, in order, as :data:`Run` s. A compressed file
    that is one clean gzip member (what :func:`write_trace` writes) is inflated by zlib in large
    chunks; any other (several members, padding, truncated or corrupt data) is read on by
    ``gzip``'s own reader from the first line not yet given, so every line, and the error after
    the last good one, is what reading the file line by line with ``gzip`` gives.

    ``ahead``: the same file being inflated on a thread (``traces.inflate.InflateAhead``, started
    for ``path``): its chunks are taken instead of inflating here (the same chunks and errors);
    it is closed when the lines end, whatever the file turns out to hold."""
    n = 0
    if ahead is not None and ahead.path != os.fspath(path):
        ahead.close()
        ahead = None
    try:
        with open(path, "rb") as f:
            if f.read(len(PACK_MAGIC)) == PACK_MAGIC:  # binary: its magic is its one line, for the problem that names it
                yield PACK_MAGIC, [0], [len(PACK_MAGIC)]
                return
            f.seek(0)
            if f.read(2) != _GZIP_MAGIC:
                f.seek(0)
                yield from _span_runs(iter(lambda: f.read(_CHUNK), b""), 0)
                return
            f.seek(0)
            try:
                for run in _span_runs(_one_member(f) if ahead is None else ahead.chunks(), _HOLD):
                    n += len(run[1])
                    yield run
                return
            except (_NotOneMember, zlib.error):
                pass
    finally:
        if ahead is not None:
            ahead.close()
    with open_trace_bytes(path) as g:
        first = 1
        if n == 0:  # line 1 read with a bound: ``gzip`` reads a line to its end, however far
            raw = g.readline(MAX_FIRST_LINE)
            if len(raw) == MAX_FIRST_LINE and not raw.endswith(b"\n"):
                raise _NoFirstLine
            if not raw:
                return
            raw = _strip_eol(raw)
            yield raw, [0], [len(raw)]
            first = 2
        for i, raw in enumerate(g, start=first):
            if i > n:
                raw = _strip_eol(raw)
                yield raw, [0], [len(raw)]


def _line_spans(path: str | os.PathLike[str], ahead: InflateAhead | None = None) -> Generator[Span, None, None]:
    """:func:`_line_runs`, line by line, as :data:`Span` s."""
    for buf, starts, ends in _line_runs(path, ahead):
        yield from zip(repeat(buf), starts, ends)


def _lines(path: str | os.PathLike[str]) -> Generator[tuple[int, bytes], None, None]:
    """``(line number, line without its end)`` of a trace file (:func:`_line_spans`)."""
    for n, (buf, s, e) in enumerate(_line_spans(path), start=1):
        yield n, buf[s:e]


def _short(err: Exception) -> str:
    return str(err).replace("\n", " ")


class _Branch(Value):
    agent: str
    first_line: int
    last_line: int
    ended_line: int

    __slots__ = __match_args__ = ("agent", "first_line", "last_line", "ended_line")

    def __init__(self, agent: str, first_line: int, last_line: int, ended_line: int = 0) -> None:
        self.agent = agent
        self.first_line = first_line
        self.last_line = last_line
        self.ended_line = ended_line


class _NotATrace(Exception):
    """Raised by a :class:`_Validator` made with ``stop_at_no_trace`` when line 1 is neither a
    header nor a request (not JSON, binary, a packed trace, another JSON object): its one problem
    is in ``problems``; the readers stop there instead of reading the rest of the file."""


class _Validator:
    """Streaming checker: feed lines in order, then call :meth:`finish`.

    Cascades are avoided: a request or branch defined on a bad line is still
    remembered (when its id can be read), so later lines that refer to it are
    judged on their own merits and only the bad line itself is reported.

    ``stop_at_no_trace``: line 1 that is neither a valid header nor a request raises
    :class:`_NotATrace` after its problem is noted (the loading readers: ``read_trace``,
    ``traces.compact.read_trace_compact``); False (``trace validate``) goes on and reports every
    line. A line 1 that is a request (a header missing) or empty is checked on either way.
    """

    def __init__(self, stop_at_no_trace: bool = False) -> None:
        self.stop_at_no_trace = stop_at_no_trace
        self.header: TraceHeader | None = None
        self.block_size: int | None = None
        self.problems: list[TraceProblem] = []
        self.ids: dict[str, str | None] = {}  # request id -> agent (None: unreadable line)
        self.id_line: dict[str, int] = {}
        self.branches: dict[str, _Branch] = {}

    def _bad(self, line: int, reason: str) -> None:
        self.problems.append(TraceProblem(line, reason))

    def feed(self, line: int, raw: bytes) -> TraceRequest | None:
        """Check one line; return the request when the line is a valid request."""
        if line == 1:
            return self._feed_header(raw)
        return self._feed_request(line, raw)

    def _feed_header(self, raw: bytes) -> TraceRequest | None:
        if not raw.strip():
            self._bad(1, "empty line: expected the trace header")
            return None
        try:
            header = _HEADER_DECODER.decode(raw)
        except msgspec.DecodeError as e:
            if raw == PACK_MAGIC:
                self._bad(1, _PACKED)
                if self.stop_at_no_trace:
                    raise _NotATrace from None
                return None
            # Not a header. If it is a request, even an invalid one, check it as one so it is not lost.
            try:
                _lenient_decoder().decode(raw)
            except msgspec.DecodeError:
                if not _request_like(raw):
                    self._bad(1, _header_problem(raw, e))
                    if self.stop_at_no_trace:
                        raise _NotATrace from None
                    return None
            self._bad(1, _MISSING_HEADER)
            self._feed_request(1, raw)
            return None
        if header.version > VERSION:
            self._bad(1, f"unsupported trace format version {header.version} (this code reads up to {VERSION})")
        self.header = header
        self.block_size = header.block_size
        return None

    def _remember_unreadable(self, line: int, raw: bytes) -> None:
        """Take the ``id``, ``branch`` and ``agent`` of a line that is no valid request as known, so that the
        lines after it that name them report no problems of their own ("after references unknown request",
        "first request of branch ... must set kind"): one bad line, one problem. A line that is not even JSON
        (cut short, say) gives them by a string match of its top-level ``"id": "..."`` style pairs."""
        try:
            obj = _ANY_DECODER.decode(raw)
        except msgspec.DecodeError:
            obj = {k.decode(): _json_str(v) for k, v in _STR_FIELD.findall(raw)[::-1]}  # the first of a key wins
        if not isinstance(obj, dict):
            return
        rid, br, agent = obj.get("id"), obj.get("branch"), obj.get("agent")
        agent = agent if isinstance(agent, str) else None
        if isinstance(rid, str) and rid not in self.ids:
            self.ids[rid] = agent
            self.id_line[rid] = line
        if isinstance(br, str) and br not in self.branches and agent is not None:
            self.branches[br] = _Branch(agent, line, line, line if obj.get("ends_branch") is True else 0)

    def _feed_request(self, line: int, raw: bytes) -> TraceRequest | None:
        if not raw.strip():
            self._bad(line, "empty line")
            return None
        ids_checked = True  # the decoder bounds every block id (in C, while parsing)
        try:
            req = _REQUEST_DECODER.decode(raw)
        except msgspec.ValidationError:
            try:  # an id out of range is checked below with the line's other rules
                req = _lenient_decoder().decode(raw)
            except msgspec.ValidationError as e:
                self._bad(line, f"invalid request: {_short(e)}")
                self._remember_unreadable(line, raw)
                return None
            ids_checked = False
        except msgspec.DecodeError as e:
            self._bad(line, f"invalid JSON: {_short(e)}")
            self._remember_unreadable(line, raw)
            return None
        n_before = len(self.problems)
        self._check_request(line, req, ids_checked=ids_checked)
        return req if ids_checked and len(self.problems) == n_before else None

    def feed_checked(self, line: int, req: TraceRequest, n_blocks: int) -> bool:
        """Check a request decoded elsewhere whose ``n_blocks`` block ids were decoded and bounded
        (``req.blocks`` is ignored: a stub's are not held); the same rules and problems as
        :meth:`feed` of the line. Returns True when the line is a valid request."""
        n_before = len(self.problems)
        self._check_request(line, req, ids_checked=True, n_blocks=n_blocks)
        return len(self.problems) == n_before

    def check_all(self, requests: Sequence[TraceRequest], n_blocks: Sequence[int], first_line: int = 2) -> None:
        """:meth:`feed_checked` of every request, ``requests[i]`` on line ``first_line + i`` with
        ``n_blocks[i]`` block ids (decoded and bounded elsewhere, e.g. a packed trace's store): the
        same problems and the same state after. The usual request (a new id of an open branch of its
        agent, neither kind nor parent set, no ``after`` or one earlier request of its agent, the id
        count its tokens give) is taken in this loop; any other takes :meth:`_check_request`, which
        finds and records exactly what it does for every request (~1.8 → ~0.6 µs a request: the
        calls and look-ups of the general path, 15,845 requests of a packed 260-session trace)."""
        vids, id_line, branches, bs = self.ids, self.id_line, self.branches, self.block_size
        check = self._check_request
        line = first_line - 1
        for req, nb in zip(requests, n_blocks):
            line += 1
            rid = req.id
            agent = req.agent
            br = branches.get(req.branch)
            after = req.after
            if (br is not None and br.agent == agent and not br.ended_line and rid not in vids
                    and (not after or (len(after) == 1 and vids.get(after[0]) == agent))
                    and req.kind is None and req.parent_branch is None and bs is not None and nb == req.input_tokens // bs):
                vids[rid] = agent
                id_line[rid] = line
                br.last_line = line
                if req.ends_branch:
                    br.ended_line = line
            else:
                check(line, req, ids_checked=True, n_blocks=nb)

    def _check_request(self, line: int, req: TraceRequest, *, ids_checked: bool = False, n_blocks: int | None = None) -> None:
        """Every rule of a decoded request; ``ids_checked``: the decoder bounded its block ids;
        ``n_blocks``: its number of block ids when ``req.blocks`` does not hold them."""
        bad = self._bad
        if req.id in self.ids:
            bad(line, f"duplicate request id {req.id!r} (first on line {self.id_line[req.id]})")
        bs = self.block_size
        nb = len(req.blocks) if n_blocks is None else n_blocks
        if bs is not None and nb != req.input_tokens // bs:
            bad(
                line,
                f"len(blocks) = {nb} but input_tokens // block_size = "
                f"{req.input_tokens} // {bs} = {req.input_tokens // bs}",
            )
        if not ids_checked and req.blocks and (min(req.blocks) < 0 or max(req.blocks) > MAX_BLOCK_ID):
            bad(line, f"block ids must be in [0, {MAX_BLOCK_ID}] (2**48 - 1)")
        seen_after: set[str] = set()
        for dep in req.after:
            if dep in seen_after:
                bad(line, f"after lists {dep!r} twice")
                continue
            seen_after.add(dep)
            if dep not in self.ids:
                bad(line, f"after references unknown request {dep!r} (it must appear earlier in the file)")
                continue
            agent = self.ids[dep]
            if agent is not None and agent != req.agent:
                bad(line, f"after references request {dep!r} of another agent ({agent!r})")
        if req.id not in self.ids:
            self.ids[req.id] = req.agent
            self.id_line[req.id] = line
        br = self.branches.get(req.branch)
        if br is None:
            self._check_branch_start(line, req)
            self.branches[req.branch] = _Branch(req.agent, line, line, line if req.ends_branch else 0)
            return
        if br.agent != req.agent:
            bad(line, f"branch {req.branch!r} belongs to agent {br.agent!r}, not {req.agent!r}")
        if br.ended_line:
            bad(line, f"branch {req.branch!r} already ended on line {br.ended_line}")
        if req.kind is not None:
            bad(line, f"kind is set only on a branch's first request (branch {req.branch!r} started on line {br.first_line})")
        if req.parent_branch is not None:
            bad(line, f"parent_branch is set only on a branch's first request (branch {req.branch!r} started on line {br.first_line})")
        br.last_line = line
        if req.ends_branch and not br.ended_line:
            br.ended_line = line

    def _check_branch_start(self, line: int, req: TraceRequest) -> None:
        bad = self._bad
        if req.kind is None:
            bad(line, f"first request of branch {req.branch!r} must set kind (main, fork or subagent)")
            return
        if req.kind == "main":
            if req.parent_branch is not None:
                bad(line, f"main branch {req.branch!r} must not have a parent_branch")
            return
        parent = req.parent_branch
        if parent is None:
            bad(line, f"{req.kind} branch {req.branch!r} must set parent_branch")
            return
        if parent == req.branch:
            bad(line, f"branch {req.branch!r} cannot be its own parent")
            return
        pb = self.branches.get(parent)
        if pb is None:
            bad(line, f"parent branch {parent!r} of {req.kind} branch {req.branch!r} does not exist earlier in the file")
        elif pb.agent != req.agent:
            bad(line, f"parent branch {parent!r} belongs to agent {pb.agent!r}, not {req.agent!r}")

    def finish(self, n_lines: int) -> None:
        if n_lines == 0:
            if not self.problems:  # (a compressed file unreadable before its line 1 ends is not empty)
                self._bad(1, "empty file: expected the trace header")
            return
        if self.header is None and not any(p.line == 1 for p in self.problems):
            self._bad(1, "missing trace header")
        for name, br in self.branches.items():
            if not br.ended_line:
                self._bad(br.last_line, f"branch {name!r} never ends (its last request has no ends_branch)")
        self.problems.sort(key=lambda p: p.line)


_READ_ERRORS: tuple[type[Exception], ...] = (EOFError, gzip.BadGzipFile, zlib.error)


def _scan(path: str | os.PathLike[str], v: "_Validator") -> Iterator[Any]:
    """The valid requests of a file (``v.feed`` of each line that is not None), then
    ``v.finish``; an unreadable compressed stream is one problem. Ends after line 1 when ``v``
    stops there (:class:`_NotATrace`): the rest of the file is not read."""
    n = 0
    feed = v.feed
    spans = _line_spans(path)
    try:
        for n, (buf, s, e) in enumerate(spans, start=1):
            req = feed(n, buf[s:e])
            if req is not None:
                yield req
    except _READ_ERRORS as e:
        _unreadable(v, n, e)
    except _NotATrace:
        return
    except _NoFirstLine:
        _no_first_line(v)
        return
    finally:
        spans.close()  # the file (and an InflateAhead) closed now, not when the frame is freed
    v.finish(n)


def _unreadable(v: "_Validator", n: int, e: Exception) -> None:
    v._bad(n + 1, f"unreadable compressed data after line {n}: {e}")


def _scan_runs(path: str | os.PathLike[str], v: "_Validator", feed_run: Callable[[int, bytes, list[int], list[int]], int],
               ahead: InflateAhead | None = None) -> None:
    """:func:`_scan` of a reader that takes a :data:`Run` at a time: ``feed_run(lines before,
    buf, starts, ends)`` takes the run's lines and returns the lines read so far; then
    ``v.finish``. The same problems, at the same lines, as :func:`_scan` (and it ends after line
    1 as :func:`_scan` does when ``v`` stops there)."""
    n = 0
    runs = _line_runs(path, ahead)
    try:
        for buf, starts, ends in runs:
            n = feed_run(n, buf, starts, ends)
    except _READ_ERRORS as e:
        _unreadable(v, n, e)
    except _NotATrace:
        return
    except _NoFirstLine:
        _no_first_line(v)
        return
    finally:
        runs.close()  # the file and ``ahead`` closed now, not when the frame is freed
    v.finish(n)


def iter_validate(path: str | os.PathLike[str], *, chained: bool = False) -> Iterator[TraceProblem]:
    """Yield every problem of a trace file, in line order.

    Streams the file (memory grows with the number of requests and branches,
    not with their blocks); the problems are yielded once the whole file has
    been read, sorted by line (a branch that never ends is only known at the end).

    Args:
        chained: also check, in the same pass, that block ids are chained
            (:func:`iter_chain_problems`; memory O(distinct ids)). Reported only
            when the file has no other problem.

    Raises:
        OSError: the file cannot be read.
    """
    v = _Validator()
    requests = _scan(path, v)
    chain = list(iter_chain_problems(requests)) if chained else []
    for _ in requests:  # (drained already when chained)
        pass
    yield from v.problems or chain


CHAIN_REPORT_LIMIT = 20
"""Unchained requests :func:`iter_chain_problems` reports one by one before it summarises."""


def iter_chain_problems(requests: Iterable[TraceRequest], first_line: int = 2) -> Iterator[TraceProblem]:
    """Requests whose block ids break the chained-ids rule (docs/trace-format.md §4).

    An id stands for its whole prefix, so it must follow the same id (or start the
    path) wherever it appears. Yields one problem per offending request (its first
    offending block) for the first :data:`CHAIN_REPORT_LIMIT` such requests, then one
    summary problem with the total. ``read_trace`` does not check this (``simulate
    --trace`` remaps such ids with ``tokens.rechain_blocks`` and says how many);
    ``trace validate`` does. O(total blocks) dict probes; memory O(distinct ids).

    Args:
        requests: in file order; request k is on line ``first_line + k``.
    """
    parent_of: dict[int, int] = {}
    bad = 0
    last_line = first_line
    for k, r in enumerate(requests):
        prev = -1
        for i, b in enumerate(r.blocks):
            p = parent_of.setdefault(b, prev)
            if p != prev:
                bad += 1
                last_line = first_line + k
                if bad <= CHAIN_REPORT_LIMIT:
                    before = "the path's start" if p == -1 else f"id {p}"
                    here = "the path's start" if prev == -1 else f"id {prev}"
                    yield TraceProblem(
                        first_line + k,
                        f"block {i} (id {b}) follows {here} here but {before} earlier: ids are not chained "
                        "(docs/trace-format.md §4; simulate --trace remaps them)",
                    )
                break
            prev = b
    if bad > CHAIN_REPORT_LIMIT:
        yield TraceProblem(last_line, f"{bad} requests in all break the chained-ids rule ({bad - CHAIN_REPORT_LIMIT} not listed)")


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic GC (restored on exit) while traces are read, converted or frozen.

    Decoded requests hold no reference cycles, but every collection that reaches them
    visits each of their block-id lists: ~25% of reading a 35,000-request trace, and
    ~0.25 s a pass over the cc500 trace once it is loaded.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_header(path: str | os.PathLike[str]) -> TraceHeader:
    """Decode only the header line.

    Raises:
        TraceError: line 1 is missing or not a valid header, or the compressed data is unreadable
            before it ends (before, ``trace stats`` of a gzip cut off in line 1 was an ``EOFError``
            traceback).
        OSError: the file cannot be read.
    """
    lines = _lines(path)
    try:
        for _n, raw in lines:
            if raw == PACK_MAGIC:
                raise TraceError(path, [TraceProblem(1, _PACKED)])
            try:
                return _HEADER_DECODER.decode(raw)
            except msgspec.DecodeError:
                v = _Validator()  # line 1's problems as validation gives them (a request there: the header missing, and its own)
                v.feed(1, raw)
                raise TraceError(path, v.problems) from None
    except _NoFirstLine:
        raise TraceError(path, [TraceProblem(1, _NO_FIRST_LINE)]) from None
    except _READ_ERRORS as e:  # compressed data corrupt or cut off before line 1 ends: as the other readers say
        v = _Validator()
        _unreadable(v, 0, e)
        raise TraceError(path, v.problems) from None
    finally:
        lines.close()
    raise TraceError(path, [TraceProblem(1, "empty file: expected the trace header")])


def iter_requests(path: str | os.PathLike[str]) -> tuple[TraceHeader, Iterator[TraceRequest]]:
    """Header plus a lazy iterator over the requests, validating as it goes.

    For files too large to hold in memory (e.g. all converted Claude Code
    sessions). The iterator raises :class:`TraceError` with every problem at the
    end of the file if any line was bad (valid requests before that are yielded).

    Raises:
        TraceError: the header is invalid (immediately), or any line is bad (at the end).
    """
    header = read_header(path)

    def gen() -> Iterator[TraceRequest]:
        v = _Validator()
        yield from _scan(path, v)
        if v.problems:
            raise TraceError(path, v.problems)

    return header, gen()


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a whole trace file (``.gz`` supported).

    Returns:
        :class:`Trace` with the header and every request in file order.

    Raises:
        TraceError: one or more lines are bad; ``err.problems`` lists every one
            as ``line N: reason`` (the whole file is checked first), except a file whose line 1
            is neither a header nor a request (not JSON, binary, a packed trace): that one
            problem at once, the rest of the file unread.
        OSError: the file cannot be read.

    The cyclic garbage collector is paused while the file is read (and restored after): the
    decoded requests hold no reference cycles, and the collections that walked the growing
    list of requests took ~25% of reading a 35,000-request trace.
    """
    v = _Validator(stop_at_no_trace=True)
    with paused_gc():
        requests = list(_scan(path, v))
    if v.problems:
        raise TraceError(path, v.problems)
    assert v.header is not None
    return Trace(v.header, requests)


def validate_requests(header: TraceHeader, requests: Iterable[TraceRequest]) -> list[TraceProblem]:
    """Check in-memory requests with the file rules; line numbers count the header as line 1."""
    v = _Validator()
    v.feed(1, encode_line(header))
    n = 1
    for n, req in enumerate(requests, start=2):
        v.feed(n, encode_line(req))
    v.finish(n)
    return v.problems


# ----------------------------------------------------------------------------- writing


def encode_line(obj: Any) -> bytes:
    """One JSON object (msgspec, dict keys sorted, struct fields in declaration order), no newline."""
    return _ENCODER.encode(obj)


def output_error(path: str | os.PathLike[str], *, inputs: Iterable[str | os.PathLike[str]] = (), directory: bool = False) -> str | None:
    """Why ``path`` cannot be written, checked before any work starts; None if it can.

    ``path`` is a file to write (``directory=False``) or a folder to write into
    (``directory=True``). Missing folders are not created here: the writer creates them when it
    writes, so a run that fails after this check (a bad option, an unreadable input) leaves
    nothing new on disk. The check is that the nearest existing folder on the way is a folder
    the caller can write in (and each missing name fits the file system's name length). An
    output that is one of ``inputs`` (the same file once resolved) is refused: writing it would
    replace the input with the output. Creates nothing.

    Returns:
        One line naming ``path`` and the reason (not a folder on the way, not writable, a name
        too long, a folder where a file is asked, the same file as an input, an existing
        device, pipe or socket: the writers write ``path.tmp`` and rename it over ``path``, so
        ``-o /dev/null`` run as root would replace the device with a file), or None.
    """
    p = Path(path)
    try:
        same = any(Path(i).resolve() == p.resolve() for i in inputs)
    except OSError:
        same = False
    if same:
        return f"{path}: is also the input; writing it would replace the input, give another output path"
    d = p if directory else p.parent
    have, missing = _nearest_existing(d)
    if not have.is_dir():
        return f"{path}: cannot write: {have} is not a folder"
    if not os.access(have, os.W_OK | os.X_OK):
        return f"{path}: cannot write: the folder {have} is not writable"
    if missing:
        try:
            name_max = os.pathconf(have, "PC_NAME_MAX")
        except (OSError, ValueError):
            name_max = 255
        for name in (f.name for f in missing):
            if len(os.fsencode(name)) > name_max:
                return f"{path}: cannot write: the name {name!r} is longer than {name_max} bytes"
        return None
    if not directory and p.is_dir():
        return f"{path}: is a folder; give a file path"
    if not directory and p.exists() and not p.is_file():  # the file is written beside it, then renamed over it
        return f"{path}: is not a regular file (a device, pipe or socket), which the output would replace; give a file path"
    return None


def _nearest_existing(folder: Path) -> tuple[Path, list[Path]]:
    """``(the nearest path at or above folder that exists, the missing folders below it, innermost
    first)``; a dangling link counts as existing (``os.path.lexists``)."""
    missing: list[Path] = []
    f = folder
    while not os.path.lexists(f) and f.parent != f:
        missing.append(f)
        f = f.parent
    return f, missing


def make_folders(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents (like ``mkdir -p``).

    Returns:
        The folders this call created, outermost first, for :func:`remove_folders` to take back
        when the write that needed them fails.
    """
    made = _nearest_existing(folder)[1]
    folder.mkdir(parents=True, exist_ok=True)
    return made[::-1]


def remove_folders(made: Sequence[Path]) -> None:
    """Remove the folders :func:`make_folders` created, innermost first, if still empty."""
    for f in reversed(made):
        try:
            f.rmdir()
        except OSError:
            return


def write_trace(path: str | os.PathLike[str] | IO[bytes], header: TraceHeader, requests: Iterable[TraceRequest]) -> int:
    """Write a trace; bytes are a pure function of the arguments.

    ``path`` ending in ``.gz`` is gzip-compressed with mtime 0 and no stored
    file name, so the same trace always gives the same bytes. ``path`` may also
    be an open binary file object (written uncompressed). ``requests`` may be a
    generator (written as it is consumed).

    Returns:
        The number of requests written.
    """
    if isinstance(path, (str, os.PathLike)):
        p = Path(path)
        made = make_folders(p.parent)
        tmp = p.with_name(p.name + ".tmp")
        try:
            with open(tmp, "wb") as raw:
                if p.name.endswith(".gz"):
                    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
                        n = _write_lines(gz, header, requests)
                else:
                    n = _write_lines(raw, header, requests)
            os.replace(tmp, p)
        except BaseException:  # a failed write (disk full, a generator's error) leaves nothing new
            tmp.unlink(missing_ok=True)
            remove_folders(made)
            raise
        return n
    return _write_lines(path, header, requests)


def _write_lines(f: IO[bytes] | gzip.GzipFile, header: TraceHeader, requests: Iterable[TraceRequest]) -> int:
    enc = _ENCODER.encode
    f.write(enc(header) + b"\n")
    n = 0
    for r in requests:
        f.write(enc(r) + b"\n")
        n += 1
    f.flush()
    return n


# Re-exported here because the replayer imports it from io.
from evolving_infra.traces.sample import sample_sessions  # noqa: E402
