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


def annotate_lost_reuse(records: Sequence[RequestRecord], requests: Mapping[str, TraceRequest]) -> int:
    """Set ``lost_reuse_cause`` on every successful record with ``ideal_cached_tokens`` and a
    prefill node (paper App. C.1, as the simulator attributes it): lost tokens
    ``max(0, ideal − cached)`` are due to ``eviction`` when the previous request of the branch
    (for a fork's first request, its parent's last one) was prefilled on the same node, to
    ``routing`` when on another node, ``unattributed`` without a previous request; ``none`` when
    nothing was lost. Call after :func:`annotate_ideal`. Records are taken in send order (a
    branch's requests are sequential). Returns the records annotated.
    """
    from services.kvdirectory.reuse import attribute_lost_reuse

    last: dict[str, str] = {}
    done = 0
    for rec in sorted(records, key=lambda r: (r.sent_at, r.id)):
        req = requests.get(rec.id)
        if req is None:
            continue
        prev = last.get(req.branch)
        if prev is None and req.kind == "fork" and req.parent_branch is not None:
            prev = last.get(req.parent_branch)
        if rec.ok and rec.prefill_node and rec.ideal_cached_tokens is not None:
            rec.lost_reuse_cause = attribute_lost_reuse(rec.ideal_cached_tokens, rec.cached_tokens or 0, rec.prefill_node, prev)[1]
            done += 1
        if rec.prefill_node:
            last[req.branch] = rec.prefill_node
    return done
