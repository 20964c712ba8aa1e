"""Re-dispatch after a node failure, and lookups without the nodes one cannot count on (issue #22).

Pure functions; no I/O. The router's shell (``service.py``) calls them when it fences a
node (:meth:`NodeLoadView.check_fences`) and before every routing decision.

* :func:`usable_lookup` removes fenced (or KV-stale) nodes from a ``kv.lookup`` answer:
  no prefix credit, no fetch source on a node that cannot serve the bytes. The fetch
  plan (``sources``) stays a contiguous cover of ``[0, longest_any)``: it is cut at the
  first range held by a removed node, and extended by the longest local prefix of a
  kept node beyond the cut.
* :func:`continuation` builds the request that continues a stream whose decode node
  died: prompt + the output tokens the client already has become the new prompt, the
  rest of ``max_tokens`` the new budget, and the new output starts at output position
  ``len(sent)`` (``PrefillWork.output_offset``). It returns the reason instead when the
  continuation cannot be exact (the prompt's token ids are unknown, or the longer
  prompt exceeds the router's limit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from shared.hashing import block_hashes_packed
from shared.messages import FetchRange, KvLookupReply

from services.router.policy import RouteRequest


def usable_lookup(lookup: KvLookupReply | None, usable: Callable[[str], bool]) -> KvLookupReply | None:
    """``lookup`` without the nodes for which ``usable(node)`` is False.

    Args:
        lookup: the directory's answer (block counts; ``sources`` covers ``[0, longest_any)``).
        usable: node id → whether its cache may be counted on.

    Returns:
        ``lookup`` itself when every node it names is usable (or it is None / an error),
        else a copy: removed nodes' ``NodePrefix`` dropped, ``sources`` cut at the first
        range of a removed node (then extended to the longest kept local prefix, from the
        kept node holding it), ``longest_any`` = the end of that cover. O(nodes + sources).
    """
    if lookup is None or lookup.error is not None:
        return lookup
    named = {p.node for p in lookup.nodes} | {r.node for r in lookup.sources}
    bad = {n for n in named if not usable(n)}
    if not bad:
        return lookup
    nodes = [p for p in lookup.nodes if p.node not in bad]
    longest_local = max((p.local_blocks for p in nodes), default=0)
    if not lookup.sources:  # an answer without a fetch plan: only the local prefixes count
        return KvLookupReply(block_size=lookup.block_size, nodes=nodes, longest_any=longest_local, sources=[])
    sources: list[FetchRange] = []
    cut = 0
    for r in lookup.sources:
        if r.node in bad or r.start != cut:
            break
        sources.append(r)
        cut = r.end
    best = max(nodes, key=lambda p: p.local_blocks, default=None)
    if best is not None and best.local_blocks > cut:
        tier = "host" if best.host_blocks >= best.local_blocks else "gpu"
        sources.append(FetchRange(node=best.node, start=cut, end=best.local_blocks, tier=tier))  # type: ignore[arg-type]
        cut = best.local_blocks
    longest = cut
    return KvLookupReply(block_size=lookup.block_size, nodes=nodes, longest_any=longest, sources=sources)


def continuation(req: RouteRequest, sent: Sequence[int], *, block_size: int, max_prompt_tokens: int) -> RouteRequest | str:
    """The request that continues ``req`` after the client received the output ``sent``.

    Args:
        req: the request as first routed (``token_ids``: the prompt, packed little-endian uint32).
        sent: output token ids already delivered to the client, in order.
        block_size: tokens per KV block (for the new prompt's block hashes).
        max_prompt_tokens: the router's prompt limit (tokens).

    Returns:
        A :class:`RouteRequest` with the same rid and branch, prompt ``prompt + sent``,
        ``max_tokens - len(sent)`` tokens still to generate; or a string saying why the
        stream cannot be continued exactly (nothing to generate is not such a case: the
        caller ends the stream itself when ``len(sent) >= max_tokens``).
    """
    if len(req.token_ids) != 4 * req.prompt_tokens:
        return f"the prompt's token ids are not known to the router ({len(req.token_ids)} bytes for {req.prompt_tokens} tokens)"
    total = req.prompt_tokens + len(sent)
    if total > max_prompt_tokens:
        return f"prompt + {len(sent)} sent tokens = {total} tokens exceeds max_prompt_tokens={max_prompt_tokens}"
    packed = req.token_ids + np.asarray(sent, dtype="<u4").tobytes()
    return RouteRequest(
        rid=req.rid,
        prompt_tokens=total,
        block_hashes=block_hashes_packed(packed, block_size),
        max_tokens=req.max_tokens - len(sent),
        token_ids=packed,
        branch_id=req.branch_id,
    )
