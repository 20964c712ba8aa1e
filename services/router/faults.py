"""Re-dispatch after a node failure, and lookups without the nodes one cannot count on (issue #22).

Pure functions; no I/O. The router's shell (``service.py``) calls them when it fences a
node (:meth:`NodeLoadView.check_fences`) and before every routing decision.

* :func:`usable_lookup` (defined in ``services.kvdirectory.lookup``: the directory applies
  it too, to nodes whose KV view is stale) removes fenced (or KV-stale) nodes from a ``kv.lookup`` answer:
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

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

from shared.hashing import block_hashes_packed
from services.kvdirectory.lookup import usable_lookup
from services.router.policy import RouteRequest

__all__ = ["continuation", "usable_lookup"]


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
        ignore_eos=req.ignore_eos,
        sampling=req.sampling,
    )
