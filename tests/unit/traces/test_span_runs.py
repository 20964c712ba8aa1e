"""``traces.io._span_runs``: a chunk's lines as one run, given exactly when and as the
line-by-line splitter gave them (the hold-back before a read error included)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator

import pytest

from evolving_infra.traces.io import _span_runs


def _line_by_line(chunks: list[bytes], hold: int) -> Iterator[tuple[str, bytes]]:
    """The splitter before runs (one bytes.find a line), with a ("chunk",) mark after each chunk's lines."""
    held: deque[tuple[bytes, int, int, int]] = deque()
    total = 0
    rest: list[bytes] = []
    for buf in chunks:
        base, total = total, total + len(buf)
        nl = buf.find(b"\n")
        if nl < 0:
            rest.append(buf)
            yield ("chunk", b"")
            continue
        if rest:
            rest.append(buf[:nl])
            line = b"".join(rest)
            rest = []
            held.append((line, 0, len(line), base + nl + 1))
        else:
            held.append((buf, 0, nl, base + nl + 1))
        s = nl + 1
        nl = buf.find(b"\n", s)
        while nl >= 0:
            held.append((buf, s, nl, base + nl + 1))
            s = nl + 1
            nl = buf.find(b"\n", s)
        if s < len(buf):
            rest.append(buf[s:])
        while held and total - held[0][3] >= hold:
            b, s, e, _ = held.popleft()
            yield ("line", b[s : e - 1] if e > s and b[e - 1] == 13 else b[s:e])
        yield ("chunk", b"")
    for b, s, e, _ in held:
        yield ("line", b[s : e - 1] if e > s and b[e - 1] == 13 else b[s:e])
    if rest:
        yield ("line", b"".join(rest))


def _by_runs(chunks: list[bytes], hold: int) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []

    def gen() -> Iterator[bytes]:
        for c in chunks:
            yield c
            out.append(("chunk", b""))

    for buf, starts, ends in _span_runs(gen(), hold):
        assert starts and len(starts) == len(ends)
        out.extend(("line", buf[s:e]) for s, e in zip(starts, ends))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_runs_give_the_lines_line_by_line_gives_at_the_same_chunk(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        data = bytes(rng.choice(b"ab\n\r") for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(data) + 1), rng.randint(0, min(5, len(data) + 1))))
        chunks = [c for c in (data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])) if c]
        hold = rng.choice([0, 1, 3, 7, 100])
        assert _by_runs(chunks, hold) == list(_line_by_line(chunks, hold)), (chunks, hold)


def test_a_chunk_is_one_run_sharing_its_buffer() -> None:
    buf = b'{"a":1}\r\n{"b":2}\n{"c"'
    runs = list(_span_runs([buf, b":3}"], 0))
    assert runs == [(buf, [0, 9], [7, 16]), (b'{"c":3}', [0], [7])]
    assert runs[0][0] is buf
