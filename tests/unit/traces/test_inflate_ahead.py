"""``simulate --trace x.jsonl.gz`` inflates the trace on a thread started before the simulator is
imported (``traces.inflate.InflateAhead``): the reader must see exactly the lines, and the error
after them, that inflating in its own thread gives (which is what ``gzip`` gives line by line,
``test_io_gzip.py``), and the thread must never outlive the read or keep the switch interval."""

from __future__ import annotations

import gzip
import os
import random
import sys
import threading
from pathlib import Path

import pytest

from evolving_infra.traces import inflate
from evolving_infra.traces import io as tio
from evolving_infra.traces.compact import read_trace_compact
from evolving_infra.traces.inflate import InflateAhead, NotOneMember, one_member
from evolving_infra.traces.io import TraceError, write_trace
from evolving_infra.traces.schema import FORMAT, TraceHeader, TraceRequest

from .test_io_gzip import _compressed


def _read(path: Path, ahead: InflateAhead | None) -> tuple[list[tuple[int, bytes]], str | None]:
    out: list[tuple[int, bytes]] = []
    try:
        for n, (buf, s, e) in enumerate(tio._line_spans(path, ahead), start=1):
            out.append((n, buf[s:e]))
    except tio._READ_ERRORS as e:
        return out, type(e).__name__
    return out, None


def _no_thread_left() -> bool:
    return not any(t.name == "inflate-ahead" for t in threading.enumerate())


@pytest.mark.parametrize("chunk", [64, 4096])
def test_lines_and_errors_are_those_of_inflating_in_the_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(tio, "_CHUNK", chunk)
    monkeypatch.setattr(tio, "_HOLD", 256 << 10)
    monkeypatch.setattr(inflate, "AHEAD_CHUNKS", 3)  # the thread waits on a full queue often
    interval = sys.getswitchinterval()
    bad = set()
    for seed in range(90):
        rng = random.Random(seed)
        kind = seed % 6
        data = _compressed(rng, kind)
        path = tmp_path / f"f{seed}.gz"
        path.write_bytes(data)
        want = _read(path, None)
        ahead = InflateAhead.start(path, chunk)
        assert ahead is not None
        assert _read(path, ahead) == want, (seed, kind)
        if want[1]:
            bad.add(kind)
        assert _no_thread_left() and sys.getswitchinterval() == interval, seed
    assert bad >= {3, 4, 5}


def test_chunks_then_the_error_in_the_readers_thread(tmp_path: Path) -> None:
    data = gzip.compress(os.urandom(1 << 16) * 4)
    for tail, err in ((b"", None), (b"x", NotOneMember), (gzip.compress(b"more"), NotOneMember)):
        path = tmp_path / "c.gz"
        path.write_bytes(data + tail)
        with open(path, "rb") as f:
            want = []
            try:
                for c in one_member(f, 1 << 14):
                    want.append(c)
            except NotOneMember:
                pass
        got = []
        ahead = InflateAhead.start(path, 1 << 14)
        assert ahead is not None
        if err is None:
            got = list(ahead.chunks())
        else:
            with pytest.raises(err):
                for c in ahead.chunks():
                    got.append(c)
        assert got == want and len(want) > 4
        assert _no_thread_left()


def test_close_before_the_end_stops_the_thread_and_restores_the_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inflate, "AHEAD_CHUNKS", 2)
    path = tmp_path / "big.gz"
    path.write_bytes(gzip.compress(b"0123456789abcdef\n" * 200_000))
    interval = sys.getswitchinterval()
    ahead = InflateAhead.start(path, 1 << 12)
    assert ahead is not None and sys.getswitchinterval() <= inflate.SWITCH_INTERVAL_S
    it = ahead.chunks()
    next(it)  # one chunk taken; the thread is blocked on its full queue
    ahead.close()
    ahead.close()  # idempotent
    assert _no_thread_left() and sys.getswitchinterval() == interval


def test_start_leaves_anything_but_a_regular_gzip_file_to_the_reader(tmp_path: Path) -> None:
    plain = tmp_path / "p.jsonl"
    plain.write_bytes(b"{}\n")
    assert InflateAhead.start(plain) is None
    assert InflateAhead.start(tmp_path / "missing.gz") is None
    assert InflateAhead.start(tmp_path) is None  # a folder
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert InflateAhead.start(fifo) is None  # not opened: opening a FIFO would block on its writer
    assert _no_thread_left()


def _trace(path: Path) -> list[TraceRequest]:
    reqs = [TraceRequest(id=f"r{i}", agent="a", branch="a:main", input_tokens=4 * (i + 1), output_tokens=1,
                         blocks=list(range(i + 1)), kind="main" if i == 0 else None, ends_branch=i == 299) for i in range(300)]
    write_trace(path, TraceHeader(format=FORMAT, block_size=4), reqs)
    return reqs


def test_read_trace_compact_reads_the_same_trace_and_the_same_problems(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    reqs = _trace(path)
    got = read_trace_compact(path, ahead=InflateAhead.start(path))
    assert got.requests_with_blocks() == read_trace_compact(path).requests_with_blocks() == reqs
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    problems = []
    for ahead in (None, InflateAhead.start(path)):
        with pytest.raises(TraceError) as e:
            read_trace_compact(path, ahead=ahead)
        problems.append(e.value.problems)
    assert problems[0] == problems[1] and any("unreadable compressed data" in str(p) for p in problems[0])
    other = tmp_path / "other.jsonl.gz"
    _trace(other)
    # an InflateAhead of another file is closed and not read
    assert read_trace_compact(path.with_name("other.jsonl.gz"), ahead=InflateAhead.start(path)).requests_with_blocks() == reqs
    assert _no_thread_left()
