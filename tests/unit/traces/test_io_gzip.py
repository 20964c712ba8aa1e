"""Reading a compressed trace inflates one gzip member with zlib in large chunks; every other
compressed file (several members, padding, truncated, corrupt) gives exactly the lines, and the
error after them, that reading it line by line with ``gzip`` gives."""

from __future__ import annotations

import gzip
import random
import zlib
from pathlib import Path

import pytest

from evolving_infra.traces import io as tio
from evolving_infra.traces.io import TraceError, read_trace, write_trace
from evolving_infra.traces.schema import FORMAT, TraceHeader, TraceRequest


def _by_gzip(path: Path) -> tuple[list[tuple[int, bytes]], str | None]:
    """The lines ``gzip`` gives line by line (ends stripped as ``_lines`` strips them), and the
    error that stops it (its class name), if any."""
    out: list[tuple[int, bytes]] = []
    try:
        with gzip.open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                out.append((n, tio._strip_eol(raw)))
    except tio._READ_ERRORS as e:
        return out, type(e).__name__
    return out, None


def _read(path: Path) -> tuple[list[tuple[int, bytes]], str | None]:
    out: list[tuple[int, bytes]] = []
    try:
        for item in tio._lines(path):
            out.append(item)
    except tio._READ_ERRORS as e:
        return out, type(e).__name__
    return out, None


def _text(rng: random.Random, n: int) -> bytes:
    """``n`` lines, of random letters (compress ~2:1) or repeated ones (like a trace's ids, far
    more), some with ``\r\n`` ends."""
    lines = [(bytes(rng.choices(b"abcdefghijklmnop", k=rng.randrange(0, 3000))) if rng.random() < 0.3
              else b"%d," % rng.randrange(99) * rng.randrange(0, 1000)) + (b"\r" if rng.random() < 0.2 else b"")
             for _ in range(n)]
    return b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")


def _compressed(rng: random.Random, kind: int) -> bytes:
    """A gzip file of :func:`_text` lines: ``kind`` 0 one clean member, 1 several members, 2 zero
    padding after the member, 3 truncated, 4 a corrupt byte (deflate data or trailer), 5 garbage
    after the member."""
    data = gzip.compress(_text(rng, rng.randrange(0, 200)))
    if kind == 1:
        data += gzip.compress(_text(rng, rng.randrange(1, 200)))
    elif kind == 2:
        data += b"\0" * rng.randrange(1, 9)
    elif kind == 3:
        data = data[: rng.randrange(10, len(data))]
    elif kind == 4:
        i = rng.randrange(10, len(data))
        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
    elif kind == 5:
        data += b"garbage"
    return data


@pytest.mark.parametrize("chunk", [64, 1 << 20])
def test_any_compressed_file_reads_as_gzip_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    # small chunks and hold-back (>= gzip's 128 KiB buffer): lines, errors and members cross chunk ends
    monkeypatch.setattr(tio, "_CHUNK", chunk)
    monkeypatch.setattr(tio, "_HOLD", 256 << 10)
    kinds = set()
    for seed in range(150):
        rng = random.Random(seed)
        kind = seed % 6
        data = _compressed(rng, kind)
        path = tmp_path / f"f{seed}.gz"
        path.write_bytes(data)
        want = _by_gzip(path)
        assert _read(path) == want, (seed, kind)
        kinds.add((kind, want[1], len(want[0]) > 100))
    assert {k for k, err, _ in kinds if err} >= {3, 4, 5}  # the bad kinds do fail
    assert {k for k, err, many in kinds if err and many} >= {3, 4}  # some after many good lines


@pytest.mark.parametrize("chunk", [64, 1 << 20])
def test_plain_file_reads_as_reading_it_line_by_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    # read in chunks: lines (empty ones, \r\n ends, a last line without its end) cross chunk ends
    monkeypatch.setattr(tio, "_CHUNK", chunk)
    for seed in range(60):
        rng = random.Random(seed)
        path = tmp_path / f"p{seed}.jsonl"
        path.write_bytes(_text(rng, rng.randrange(0, 200)) + (b"\r" if seed % 7 == 0 else b""))
        with open(path, "rb") as f:
            want = [(n, tio._strip_eol(raw)) for n, raw in enumerate(f, start=1)]
        assert _read(path) == (want, None), seed


def test_truncated_trace_reports_the_line_gzip_reaches(tmp_path: Path) -> None:
    reqs = [TraceRequest(id=f"r{i}", agent="a", branch="a:main", input_tokens=4 * (i + 1), output_tokens=1,
                         blocks=list(range(i + 1)), kind="main" if i == 0 else None, ends_branch=i == 199) for i in range(200)]
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, TraceHeader(format=FORMAT, block_size=4), reqs)
    assert read_trace(path).requests == reqs
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    lines, err = _by_gzip(path)
    assert err == "EOFError" and lines
    with pytest.raises(TraceError) as got:
        read_trace(path)
    assert f"unreadable compressed data after line {len(lines)}" in str(got.value)


def test_gzip_unreadable_before_line_1_ends_is_one_problem_for_every_reader(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A gzip cut off (or corrupt) before its line 1 ends: ``trace stats`` (``read_header``) was an
    ``EOFError`` / ``zlib.error`` traceback, and the other readers added 'line 1: empty file' to
    the unreadable data, of a file that is not empty. Now one problem, the same for every reader."""
    from evolving_infra.traces.cli import main
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.inflate import InflateAhead
    from evolving_infra.traces.io import iter_validate, read_header

    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"format": "' + FORMAT.encode() + b'", "block_size": 4, "meta": {"x": "' + bytes(range(97, 123)) * 400 + b'"}}\n', mtime=0)[:-30])
    corrupt = tmp_path / "corrupt.gz"
    corrupt.write_bytes(b"\x1f\x8b\x08\x00junkjunkjunk")
    for path, err in ((cut, "EOFError"), (corrupt, "error")):
        assert _by_gzip(path) == ([], err)
        want = list(iter_validate(path))
        assert len(want) == 1 and want[0].line == 1 and want[0].reason.startswith("unreadable compressed data"), want
        reads = [read_trace, read_trace_compact, read_header, lambda p: read_trace_compact(p, ahead=InflateAhead.start(p))]
        for read in reads:
            with pytest.raises(TraceError) as got:
                read(path)
            assert got.value.problems == want, (path.name, read, str(got.value))
        assert main(["stats", str(path)]) == 2
        assert "unreadable compressed data" in capsys.readouterr().err


def test_one_member_is_inflated_by_zlib_not_gzip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.gz"
    path.write_bytes(gzip.compress(b"a\nb\r\nc"))

    def no_gzip(*_a: object, **_k: object) -> None:
        raise AssertionError("gzip's reader used")

    monkeypatch.setattr(tio, "open_trace_bytes", no_gzip)
    assert list(tio._lines(path)) == [(1, b"a"), (2, b"b"), (3, b"c")]
    assert zlib.decompress(path.read_bytes(), wbits=31) == b"a\nb\r\nc"
