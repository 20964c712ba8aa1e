"""Azure LLM inference traces (Splitwise, CSV) → canonical trace (spec: docs/trace-format.md §7.4).

Input columns: ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``), ``ContextTokens``,
``GeneratedTokens``. Arrivals and lengths only: every row is its own agent with
one request, ``arrival_s`` = seconds since the earliest timestamp over all
inputs (the code and conversation services were recorded in the same hour, so
several files share one clock and are merged in arrival order). There is no
prefix information: every block gets a fresh id (no sharing, h* = 0).
"""

from __future__ import annotations

import csv
import heapq
import io
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path

from evolving_infra.traces.convert.common import Conversion, ConvertError, Skipped, expand_inputs, inputs_meta, make_header, read_input, source_line
from evolving_infra.traces.schema import TraceRequest

KIND = "azure"
PATTERNS = ("*.csv", "*.csv.gz")
DEFAULT_BLOCK_SIZE = 64
ORIGIN = {
    "repository": "github.com/Azure/AzurePublicDataset",
    "files": "data/AzureLLMInferenceTrace_code.csv, data/AzureLLMInferenceTrace_conv.csv",
    "commit": "790921015d50dd6aae7f7e47f39ba0e235ad6b08",
    "license": "CC-BY 4.0",
    "cite": "Patel et al., Splitwise: Efficient generative LLM inference using phase splitting, ISCA 2024",
}


def parse_timestamp(s: str) -> float:
    """``YYYY-MM-DD HH:MM:SS[.fraction]`` (any number of fraction digits, UTC) → unix seconds.

    Raises:
        ValueError: not in that form.
    """
    s = s.strip()
    main, _, frac = s.partition(".")
    dt = datetime.strptime(main, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    if frac and not frac.isdigit():
        raise ValueError(f"bad fractional seconds in {s!r}")
    return dt.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _read(path: Path, skipped: Skipped) -> list[tuple[float, int, int, int]]:
    """(unix time, row number, context tokens, generated tokens) per valid data row, in time
    order; a malformed row is named and skipped (``skipped.row``).

    Raises:
        ConvertError: the file cannot be read or lacks the columns; with ``strict``, a malformed row.
    """
    raw = read_input(path)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConvertError(f"{path}: cannot read: {e}") from None
    reader = csv.DictReader(io.StringIO(text))
    need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if not reader.fieldnames or not need <= set(reader.fieldnames):
        raise ConvertError(f"{path}: expected columns {sorted(need)}, got {reader.fieldnames}")
    rows = []
    try:
        for n, row in enumerate(reader, start=2):
            try:
                rec = (parse_timestamp(row["TIMESTAMP"]), n, int(row["ContextTokens"]), int(row["GeneratedTokens"]))
            except (ValueError, TypeError, AttributeError) as e:
                skipped.row(path, n, str(e) or type(e).__name__)
                continue
            if rec[2] < 1 or rec[3] < 0:
                skipped.row(path, n, "ContextTokens must be >= 1 and GeneratedTokens >= 0")
                continue
            rows.append(rec)
    except csv.Error as e:
        raise ConvertError(f"{path}: line {reader.line_num}: {e}") from None
    skipped.end_file(path)
    rows.sort()
    return rows


def convert(
    inputs: Sequence[str | Path], *, progress: bool = False, block_size: int = DEFAULT_BLOCK_SIZE, strict: bool = False
) -> Conversion:
    """Convert Azure LLM inference CSV files (or folders) to a canonical trace (arrival order).

    Args:
        block_size: tokens per block id (default 64); every id is fresh.
        strict: stop at the first unreadable file or malformed row instead of naming it on
            stderr, skipping it and going on (skips are listed in ``meta.skipped``).

    Raises:
        ConvertError: missing input, or no row convertible; with ``strict``, an unreadable
            file or a malformed row.
    """
    if block_size < 1:
        raise ConvertError("block_size must be >= 1")
    files = expand_inputs(inputs, PATTERNS)
    counts: Counter[str] = Counter()
    origin: list[float] = []

    skipped = Skipped(strict)

    def gen() -> Iterator[TraceRequest]:
        read = [(p, t) for p in files if (t := skipped.call(p, lambda: _read(p, skipped))) is not None]
        if not any(t for _, t in read):
            skipped.none_converted()
        names = [p.name.split(".")[0] for p, _ in read]
        tables = [t for _, t in read]
        t0 = min((t[0][0] for t in tables if t), default=0.0)
        origin.append(t0)
        merged = heapq.merge(*[[(ts, fi, n, c, g) for ts, n, c, g in t] for fi, t in enumerate(tables)])
        next_id = 0
        for ts, fi, n, ctx, gen_tokens in merged:
            stem = names[fi]
            key = f"{stem}:{n}"
            nb = ctx // block_size
            out = gen_tokens
            if out < 1:
                counts["output_tokens_zero"] += 1
            counts["requests"] += 1
            yield TraceRequest(
                id=key,
                agent=key,
                branch=key,
                input_tokens=ctx,
                output_tokens=out,
                blocks=list(range(next_id, next_id + nb)),
                kind="main",
                ends_branch=True,
                t_s=0.0,
                arrival_s=round(ts - t0, 7),
            )
            next_id += nb

    def header():  # type: ignore[no-untyped-def]
        return make_header(
            block_size=block_size,
            source=source_line(KIND, inputs),
            description="Azure LLM inference trace 2023 (Splitwise): arrivals and lengths only, no prefix sharing",
            meta={
                "converter": KIND,
                "origin": ORIGIN,
                "options": {"block_size": block_size},
                **inputs_meta([p.name for p in files]),
                "clock": {"arrival_s": "seconds since the earliest TIMESTAMP of all inputs", "origin_unix_s": origin[0] if origin else None},
                "block_ids": "fresh sequential ids (no prefix information in the source)",
                "counts": dict(sorted(counts.items())),
                "skipped": skipped.meta(),
            },
        )

    return Conversion(gen(), header)
