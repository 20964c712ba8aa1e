"""Mooncake FAST'25 traces (JSONL) → canonical trace (spec: docs/trace-format.md §7.2).

Input rows: ``timestamp`` (ms from trace start), ``input_length``,
``output_length``, ``hash_ids`` (global, chained, 512 tokens per block; the last
id usually covers a partial block).

* **Blocks.** At the native 512-token size, ``blocks`` = the ids of the full
  blocks, ``hash_ids[:input_length // 512]`` (ids are kept as they are). At a
  finer size (``block_size`` 64, 128, 256) block ``b`` becomes ``b·m + k``,
  ``k < m = 512 / block_size``, and the fine blocks inside the partial last
  block come from its id too (the source hashed that partial content), see
  ``tokens.rechunk_blocks``.
* **Timing.** Without sessions, every row is its own agent with one request,
  ``arrival_s`` = ``timestamp / 1000``. Rows are written in timestamp order.
* **Sessions (option ``infer_sessions``).** A row *extends* an earlier row when
  its full-block path starts with that row's whole full-block path, sharing at
  least ``min_shared_blocks`` blocks (default 2: the one-block system header
  ``0`` that 99.99 % of the rows share is not a conversation). The row joins
  the agent of the longest such earlier row and goes ``after`` it; if that row
  already has a successor in its branch the new row starts a ``fork`` branch.
  ``pause_s`` is then the recorded send-to-send gap (Mooncake records no
  completion times, so the replayed gap also includes the earlier row's
  service time: an upper bound of the real client pause); ``t_s`` counts from
  the agent's first row, ``arrival_s`` sits on that first row.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from evolving_infra.traces.convert.common import Conversion, ConvertError, Skipped, expand_inputs, inputs_meta, make_header, progress_iter, read_input, source_line
from evolving_infra.traces.schema import TraceRequest
from evolving_infra.traces.tokens import rechunk_blocks

KIND = "mooncake"
PATTERNS = ("*.jsonl", "*.jsonl.gz")
SOURCE_BLOCK_SIZE = 512
ORIGIN = {
    "repository": "github.com/kvcache-ai/Mooncake",
    "folder": "FAST25-release/traces/",
    "commit": "3cca71daccf2a7afb8fe3f0295358f70e3a69fdb",
    "license": "Apache-2.0 (repository LICENSE-APACHE)",
}


class _Row(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int] = []
    session_id: Any = None
    """aiperf / Dynamo multi-turn rows' session (not used: see :data:`_UNUSED`)."""
    delay: Any = None
    """aiperf / Dynamo multi-turn rows' wait before the turn, ms (not used: see :data:`_UNUSED`)."""


_UNUSED = ("session_id", "delay")
"""Fields of aiperf / Dynamo multi-turn Mooncake rows that this converter does not use: rows are linked into
agents only by ``infer_sessions`` (prefix extension), with the recorded send gaps. Each row carrying one is counted
(``meta.counts.rows_with_<field>_unused``) and a note on stderr says so, rather than dropping them unsaid."""


_DECODER = msgspec.json.Decoder(_Row)


@dataclass(slots=True)
class _Node:
    key: str
    agent: str
    branch: str
    ts: float
    has_successor: bool = False


@dataclass(slots=True)
class _State:
    counts: Counter[str] = field(default_factory=Counter)


def _read_rows(path: Path, skipped: Skipped) -> list[_Row]:
    """The file's valid rows in file order; a malformed row is named and skipped (``skipped.row``).

    Raises:
        ConvertError: the file cannot be read or decompressed; with ``strict``, a malformed row.
    """
    raw = read_input(path)
    rows: list[_Row] = []
    for n, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = _DECODER.decode(line)
        except msgspec.DecodeError as e:
            if n == 1:
                _not_mooncake(path, line)
            skipped.row(path, n, str(e))
            continue
        except RecursionError:  # msgspec's decode of a line nested too deeply
            skipped.row(path, n, "JSON nested too deeply")
            continue
        if row.input_length < 1 or row.output_length < 0:
            skipped.row(path, n, "input_length must be >= 1 and output_length >= 0")
        elif len(row.hash_ids) < row.input_length // SOURCE_BLOCK_SIZE:
            skipped.row(path, n, f"{len(row.hash_ids)} hash_ids for {row.input_length} tokens")
        elif not math.isfinite(row.timestamp) or row.timestamp < 0:
            skipped.row(path, n, f"timestamp must be finite and >= 0, got {row.timestamp}")
        else:
            rows.append(row)
    skipped.end_file(path)
    return rows


def _not_mooncake(path: Path, line: bytes) -> None:
    """Line 1 of ``path`` is no Mooncake row: stop at once when it is the header of another format that
    converters are told apart by (each of its rows would be refused one by one otherwise).

    Raises:
        ConvertError: line 1 is a Dynamo ``agentic_mooncake`` header, or a canonical trace's header.
    """
    from evolving_infra.traces.io import DYNAMO_AGENTIC, dynamo_agentic_problem
    from evolving_infra.traces.schema import FORMAT

    try:
        obj = msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return
    if isinstance(obj, dict) and obj.get("schema") == DYNAMO_AGENTIC:
        raise ConvertError(f"{path}: {dynamo_agentic_problem(obj)}")
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        raise ConvertError(f"{path}: already a canonical trace (line 1 is its header): give it to simulate as it is")


def _note_unused(path: Path, rows: list[_Row], st: _State) -> None:
    """Count the rows of ``path`` carrying a field of :data:`_UNUSED` and say so on stderr."""
    import sys

    for name in _UNUSED:
        n = sum(1 for r in rows if getattr(r, name) is not None)
        if n:
            st.counts[f"rows_with_{name}_unused"] += n
            print(f"note: {path}: {n} row(s) carry {name!r} (aiperf/Dynamo multi-turn Mooncake rows): not used; rows "
                  "become agents of one request each, or are linked by prefix with --infer-sessions "
                  "(docs/trace-format.md §7.2)", file=sys.stderr)


def convert(
    inputs: Sequence[str | Path],
    *,
    progress: bool = False,
    block_size: int = SOURCE_BLOCK_SIZE,
    infer_sessions: bool = False,
    min_shared_blocks: int = 2,
    strict: bool = False,
) -> Conversion:
    """Convert Mooncake JSONL files (or folders) to a canonical trace, streamed.

    Several files are converted one after another, each with its own clock and
    agents named ``<file stem>:<row>``; block ids are kept as they are (one
    file = one id space: do not mix files whose ids mean different things in one
    replay).

    Args:
        block_size: output block size (512 native; 64/128/256 split blocks, see module docstring).
        infer_sessions: link rows into agents by prefix extension (module docstring).
        min_shared_blocks: the shortest earlier path a row may extend.
        strict: stop at the first unreadable file or malformed row instead of naming it on
            stderr, skipping it and going on (skips are listed in ``meta.skipped``).

    Raises:
        ConvertError: missing input, a block size that does not divide 512, no file
            convertible; with ``strict``, an unreadable file or a malformed row.
    """
    if block_size > SOURCE_BLOCK_SIZE or SOURCE_BLOCK_SIZE % block_size:
        raise ConvertError(f"mooncake: block_size must divide {SOURCE_BLOCK_SIZE}, got {block_size}")
    if min_shared_blocks < 1:
        raise ConvertError("mooncake: min_shared_blocks must be >= 1")
    files = expand_inputs(inputs, PATTERNS)
    st = _State()
    skipped = Skipped(strict)

    def gen() -> Iterator[TraceRequest]:
        n = 0
        for path in progress_iter(files, enabled=progress, desc=KIND):
            rows = skipped.call(path, lambda: _read_rows(path, skipped))
            if rows is None:
                continue
            _note_unused(path, rows, st)
            for r in _convert_file(path, rows, block_size, infer_sessions, min_shared_blocks, st):
                n += 1
                yield r
        if not n:
            skipped.none_converted()

    def header():  # type: ignore[no-untyped-def]
        return make_header(
            block_size=block_size,
            source=source_line(KIND, inputs),
            description="Mooncake FAST'25 trace (Kimi production / synthetic), global prefix block ids",
            meta={
                "converter": KIND,
                "origin": ORIGIN,
                "options": {"block_size": block_size, "infer_sessions": infer_sessions, "min_shared_blocks": min_shared_blocks},
                **inputs_meta([p.name for p in files]),
                "block_ids": "source hash_ids (512 tokens); at a finer size b*(512/block_size)+k",
                "clock": "arrival_s = timestamp/1000 per file; each file starts at 0",
                "counts": dict(sorted(st.counts.items())),
                "skipped": skipped.meta(),
            },
        )

    return Conversion(gen(), header)


def _convert_file(path: Path, rows: list[_Row], bs: int, infer: bool, min_shared: int, st: _State) -> Iterator[TraceRequest]:
    order = sorted(range(len(rows)), key=lambda i: (rows[i].timestamp, i))
    stem = path.name.split(".")[0]
    # (path length L, id at L-1) -> row node; ids are chained, so the pair names the whole path
    index: dict[tuple[int, int], _Node] = {}
    agent_start: dict[str, float] = {}
    fork_count: Counter[str] = Counter()
    staged: list[dict[str, object]] = []
    for i in order:
        row = rows[i]
        key = f"{stem}:{i}"
        ts = row.timestamp / 1000.0
        nfull = row.input_length // SOURCE_BLOCK_SIZE
        full = row.hash_ids[:nfull]
        parent: _Node | None = None
        if infer:
            for L in range(nfull, max(min_shared, 1) - 1, -1):
                node = index.get((L, full[L - 1]))
                if node is not None:
                    parent = node
                    break
        if bs == SOURCE_BLOCK_SIZE:
            blocks = list(full)
        else:
            tail = row.hash_ids[nfull] if len(row.hash_ids) > nfull else None
            blocks = rechunk_blocks(full, row.input_length, SOURCE_BLOCK_SIZE, bs, tail_block=tail)
        out_tokens = row.output_length
        if out_tokens < 1:
            st.counts["output_tokens_zero"] += 1
        fields: dict[str, object] = {
            "id": key,
            "input_tokens": row.input_length,
            "output_tokens": out_tokens,
            "blocks": blocks,
        }
        if parent is None:
            agent, branch = key, f"{key}:main"
            agent_start[agent] = ts
            fields.update(agent=agent, branch=branch, kind="main", t_s=0.0, arrival_s=ts)
            st.counts["agents"] += 1
        else:
            agent = parent.agent
            if parent.has_successor:
                fork_count[agent] += 1
                branch = f"{agent}:fork{fork_count[agent]}"
                fields.update(kind="fork", parent_branch=parent.branch)
                st.counts["fork_branches"] += 1
            else:
                branch = parent.branch
            parent.has_successor = True
            fields.update(
                agent=agent,
                branch=branch,
                after=[parent.key],
                pause_s=round(max(0.0, ts - parent.ts), 6),
                t_s=round(ts - agent_start[agent], 6),
            )
            st.counts["linked_rows"] += 1
        if infer and nfull >= 1:
            index[(nfull, full[-1])] = _Node(key, agent, branch, ts)
        staged.append(fields)
    last: dict[object, int] = {}
    for n, f in enumerate(staged):
        last[f["branch"]] = n
    for n, f in enumerate(staged):
        st.counts["requests"] += 1
        yield TraceRequest(ends_branch=last[f["branch"]] == n, **f)  # type: ignore[arg-type]
