"""PD splits: ``collocated`` or ``xPyD`` over an ordered node list.

``"2P3D"`` over nodes ``[w0..w4]`` makes the first 2 nodes prefill and the next 3
decode. ``"collocated"`` makes every node serve both phases. A split change is
applied by the node assignment that changes the fewest nodes
(:func:`assign_min_change`), as the paper's planner does (§5.2).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from shared.messages import Phase

_XPYD = re.compile(r"^\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*$")


class SplitError(ValueError):
    """A split spec is malformed or does not match the node count."""


def parse_split(spec: str, n_nodes: int) -> tuple[int, int] | None:
    """Parse ``xPyD`` into ``(x, y)``; ``collocated`` gives None.

    Raises:
        SplitError: if the spec is malformed, x or y is 0, or x + y != n_nodes.
    """
    if spec.strip().lower() in ("collocated", "both", "agg", "aggregated"):
        return None
    m = _XPYD.match(spec)
    if not m:
        raise SplitError(f"split {spec!r} must look like '4P5D' or 'collocated'")
    try:
        p, d = int(m.group(1)), int(m.group(2))
    except ValueError:  # more digits than int() takes (4,300): a plain ValueError, which the planner's
        # split.set reply took for "refused for now, retry" (split set exited 1, not 2)
        raise SplitError(f"split {spec[:40]!r}... has a node count of more than 4,300 digits") from None
    if p < 1 or d < 1:
        raise SplitError(f"split {spec!r} needs at least one prefill and one decode node")
    if p + d != n_nodes:
        raise SplitError(f"split {spec!r} covers {p + d} nodes but the cluster has {n_nodes}")
    return p, d


def canonical_split(spec: str) -> str:
    """``spec`` as the cluster names it: ``xPyD`` (``3p1d`` → ``3P1D``) or ``collocated`` (also for its
    aliases ``both``, ``agg``, ``aggregated``). The node count is not checked (:func:`parse_split` does).

    Raises:
        SplitError: if the spec is malformed.
    """
    if spec.strip().lower() in ("collocated", "both", "agg", "aggregated"):
        return "collocated"
    m = _XPYD.match(spec)
    if not m:
        raise SplitError(f"split {spec!r} must look like '4P5D' or 'collocated'")
    return f"{int(m.group(1))}P{int(m.group(2))}D"


def split_phases(spec: str, nodes: Sequence[str]) -> dict[str, Phase]:
    """Node → phase for a split spec, first ``x`` nodes prefill (see module docstring).

    Raises:
        SplitError: as :func:`parse_split`.
    """
    pd = parse_split(spec, len(nodes))
    if pd is None:
        return {n: "both" for n in nodes}
    p, _ = pd
    return {n: ("prefill" if i < p else "decode") for i, n in enumerate(nodes)}


def split_name(phases: Mapping[str, Phase]) -> str:
    """``"xPyD"`` for a phase map, or ``"collocated"`` when every node serves both."""
    values = list(phases.values())
    if values and all(v == "both" for v in values):
        return "collocated"
    p = sum(v == "prefill" for v in values)
    d = sum(v == "decode" for v in values)
    b = sum(v == "both" for v in values)
    return f"{p}P{d}D" + (f"+{b}B" if b else "")


def assign_min_change(current: Mapping[str, Phase], prefill_count: int) -> dict[str, Phase]:
    """The phase map with ``prefill_count`` prefill nodes that changes the fewest nodes.

    Nodes keep their phase where possible; nodes that must flip are taken in
    the node order of ``current`` (decode → prefill from the front, prefill →
    decode from the back), so the result is deterministic.

    Raises:
        SplitError: if ``prefill_count`` is not in ``[1, len(current) - 1]``.
    """
    n = len(current)
    if not 1 <= prefill_count <= n - 1:
        raise SplitError(f"prefill count {prefill_count} must be in [1, {n - 1}]")
    out: dict[str, Phase] = {k: ("prefill" if v == "prefill" else "decode") for k, v in current.items()}
    have = sum(v == "prefill" for v in out.values())
    order = list(current)
    if have < prefill_count:
        for node in order:
            if have == prefill_count:
                break
            if out[node] == "decode":
                out[node] = "prefill"
                have += 1
    else:
        for node in reversed(order):
            if have == prefill_count:
                break
            if out[node] == "prefill":
                out[node] = "decode"
                have -= 1
    return out
