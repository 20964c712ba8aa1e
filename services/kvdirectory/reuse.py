"""Lost KV reuse and its attribution to eviction or routing (paper §3.3, Appendix C.1).

Pure functions; no I/O.

Definitions (paper Fig. 3, Table D.4, Appendix C.1):

* the *ideal* hit of a request is every prompt token whose KV an earlier
  request produced (unlimited cache shared by all nodes, no phase switches);
* lost KV reuse = 1 − h/h*, i.e. Σ lost / Σ ideal with lost = ideal − hit;
* "We attribute a loss to eviction when the request runs on the same prefill
  node as the previous request in its branch, and to routing when it runs on
  a different one."

What the directory knows at a prefill placement, and so what it reports:

* ideal blocks = max(blocks of π_new already in the branch's previous path —
  or, on a fork's first request, in its parent's path — , the longest prefix
  held anywhere now). Blocks that every node evicted and no branch path
  contains are unknown to the directory, so this is a lower bound of the
  paper's ideal (the gap is reuse from other branches' evicted history).
* hit blocks = the request node's local prefix (``scope="local"``: engines
  that only reuse their own cache, e.g. the Dynamo and SGLang baselines) or
  the cluster's longest prefix (``scope="cluster"``: Evolving Infra's shared
  pool, where a prefill node fetches what a peer holds).
* previous node = the prefill node of the branch's previous request (for a
  fork's first request: the parent's); none for a branch's first request,
  whose losses are ``unattributed``.
"""

from __future__ import annotations

from typing import Literal

from shared.values import FrozenStructValue

Cause = Literal["none", "eviction", "routing", "unattributed"]


class ReuseRecord(FrozenStructValue, frozen=True):
    """Lost reuse of one prefill placement (blocks). Frozen (one per placement: a :class:`FrozenStructValue`,
    not a ``FrozenValue`` setting each field through ``object.__setattr__``)."""

    ideal_blocks: int
    hit_blocks: int
    lost_blocks: int
    cause: Cause
    node: str
    prev_node: str | None


def attribute_lost_reuse(ideal_blocks: int, hit_blocks: int, node: str, prev_node: str | None) -> tuple[int, Cause]:
    """Paper C.1: lost blocks of one request and their cause.

    Args:
        ideal_blocks: blocks an unlimited shared cache would have hit.
        hit_blocks: blocks actually hit (reused) by the request.
        node: prefill node of the request.
        prev_node: prefill node of the previous request of its branch, or None.

    Returns:
        ``(lost_blocks, cause)`` with ``lost = max(0, ideal − hit)`` and cause
        ``none`` (nothing lost), ``eviction`` (same node), ``routing``
        (different node) or ``unattributed`` (no previous request).
    """
    lost = ideal_blocks - hit_blocks
    if not lost > 0:  # lost = max(0, ideal − hit), no builtin call (one per request)
        lost = 0
    if lost == 0:
        return 0, "none"
    if prev_node is None:
        return lost, "unattributed"
    return lost, "eviction" if prev_node == node else "routing"


def lost_reuse_shares(lost_by_cause: dict[str, int], ideal_total: int) -> dict[str, float]:
    """Lost KV reuse (1 − h/h*) and the share of it per cause.

    Returns:
        ``{"lost_reuse": Σlost/Σideal, "<cause>": lost_cause/Σlost, ...}``
        (zeros when nothing was ideal or lost).
    """
    total = sum(lost_by_cause.values())
    out = {"lost_reuse": total / ideal_total if ideal_total else 0.0}
    for cause, v in lost_by_cause.items():
        out[cause] = v / total if total else 0.0
    return out
