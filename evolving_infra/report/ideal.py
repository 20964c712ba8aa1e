"""The ideal KV hit rate h* of a run, in the order the requests were actually sent.

h* (paper §6, Figure 6: "the hit rate under unlimited KV cache capacity shared
by all nodes and no phase switches") counts, for each request, the leading
blocks of its input that an earlier request already produced. A live or
simulated replay interleaves agents, so "earlier" is the send order of the
run, not the file order of the trace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from evolving_infra.report.records import RequestRecord
from evolving_infra.traces.schema import TraceRequest


def annotate_ideal(records: Sequence[RequestRecord], requests: Mapping[str, TraceRequest], block_size: int) -> float | None:
    """Set ``ideal_cached_tokens`` on every record (send order) and return h*.

    Args:
        records: the run's records (any order; processed by ``sent_at``).
        requests: trace requests by id (``record.id``).
        block_size: tokens per trace block.

    Returns:
        Σ ideal cached tokens / Σ input tokens over records found in ``requests``,
        or None when there are none.

    Raises:
        KeyError: if a record names a request that is not in ``requests``.
    """
    seen: set[int] = set()
    hit = total = 0
    for rec in sorted(records, key=lambda r: (r.sent_at, r.id)):
        req = requests[rec.id]
        n = 0
        for b in req.blocks:
            if b not in seen:
                break
            n += 1
        seen.update(req.blocks)
        rec.ideal_cached_tokens = min(n * block_size, req.input_tokens)
        hit += rec.ideal_cached_tokens
        total += req.input_tokens
    return hit / total if total else None
