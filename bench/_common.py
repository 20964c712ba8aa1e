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


def commit_label(repo: Any, paths: Sequence[str] = ("services", "shared", "evolving_infra", "bench")) -> str:
    """Markdown for a results section: ``"`abc1234`"``, with ``" (+ uncommitted changes in
    services/worker, ...)"`` when ``git status`` shows changes under ``paths`` (figures that a
    benchmark rewrites and ``bench/RESULTS*.md`` are not counted); ``"unknown"`` outside git."""
    import subprocess

    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        st = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=repo, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = [f for line in st.splitlines() if (f := line[3:]) and not f.startswith("bench/figures/") and f not in ("bench/RESULTS.md", "bench/RESULTS-history.md")]
    dirs = sorted({"/".join(f.split("/")[:2]) for f in changed})
    return f"`{sha}`" + (f" (+ uncommitted changes in {', '.join(dirs)})" if dirs else "")


def dynamo_skip_reason(python: str | None, module: str, install: str) -> str:
    """Why a side-by-side with NVIDIA Dynamo is skipped ("" when ``python`` imports ``module``):
    Dynamo is an optional benchmark-only dependency in a separate venv (``--dynamo-python`` /
    ``$EI_DYNAMO_PYTHON``), never the project's; ``install`` says what to pip-install there."""
    import subprocess

    if not python:
        return "Dynamo side-by-side skipped: no --dynamo-python (or EI_DYNAMO_PYTHON) given"
    try:
        p = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"Dynamo side-by-side skipped: {python} does not run ({e})"
    if p.returncode:
        last = (p.stderr.strip().splitlines() or [""])[-1]
        return f"Dynamo side-by-side skipped: {python} cannot import {module} ({install} there): {last}"
    return ""
