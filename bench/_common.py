"""Helpers shared by the simulator benchmarks (``python bench/<name>.py`` puts this
directory on ``sys.path``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def rechained(requests: Sequence[Any]) -> list[Any]:
    """The requests with chained block ids, as ``simulate --trace`` loads them.

    A trace cached by an older Claude Code converter (one block id under two
    parents, fixed in the converter) is remapped by
    :func:`evolving_infra.traces.tokens.rechain_blocks`, and the count is printed
    to stderr, so a stale cache cannot break the run-based L1 pool or skew a result.
    """
    from evolving_infra.traces.tokens import rechain_blocks

    reqs, remapped = rechain_blocks(requests)
    if remapped:
        print(f"[bench] cached trace had unchained block ids: {remapped} remapped (as simulate --trace does)", file=sys.stderr)
    return reqs
