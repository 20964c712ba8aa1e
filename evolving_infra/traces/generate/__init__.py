"""Calibrated synthetic agent workloads (spec: docs/trace-format.md §8).

``generate(kind, *, seed, agents, duration_s, requests_per_agent, block_size) -> Trace``.
Each generator module documents its parameters with their sources and carries
``TARGETS`` (also written into the header's ``meta.targets``) that
``trace stats`` must reproduce within 10 % (tests/unit/traces/test_generate.py).
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING, Any

from evolving_infra.traces.generate.common import GenerateError, Target, check_targets

if TYPE_CHECKING:  # for annotations only: generate() imports it when called, as before
    from evolving_infra.traces.io import Trace

__all__ = ["GENERATORS", "GenerateError", "Target", "check_targets", "generate", "targets_of"]

GENERATORS: dict[str, str] = {
    "putnam": "Putnam-like math agent (decode-heavy, one branch, ~10 s pauses)",
    "claude-code": "Claude-Code-like coding agent (fitted to the real sessions: sub-agents, compactions, side calls)",
    "osworld": "OSWorld-like computer-use agent (prefill-heavy, a screenshot per step, ~1.3 s pauses, sub-agents)",
    "shift": "shifting composition: Putnam -> Putnam+OSWorld -> OSWorld hours (paper §6.3)",
}

_MODULES = {
    "putnam": "evolving_infra.traces.generate.putnam",
    "claude-code": "evolving_infra.traces.generate.claude_code",
    "osworld": "evolving_infra.traces.generate.osworld",
    "shift": "evolving_infra.traces.generate.shift",
}


def _module(kind: str) -> Any:
    name = _MODULES.get(kind)
    if name is None:
        raise GenerateError(f"unknown workload {kind!r}; one of {', '.join(GENERATORS)}")
    return importlib.import_module(name)


def generate(
    kind: str,
    *,
    seed: int = 0,
    agents: int | None = None,
    duration_s: float | None = None,
    requests_per_agent: int | None = None,
    block_size: int = 64,
) -> Trace:
    """Generate a workload (an :class:`evolving_infra.traces.io.Trace`); same arguments, same trace.

    Raises:
        GenerateError: unknown kind or invalid options (``duration_s`` NaN or infinite too: an agent's
            busy time never reaches it, so the generator would never stop).
    """
    if duration_s is not None and requests_per_agent is not None:
        raise GenerateError("give duration_s or requests_per_agent, not both")
    if duration_s is not None and not 0 < duration_s < math.inf:  # NaN fails both comparisons
        raise GenerateError(f"--duration must be a finite number > 0, not {duration_s!r}")
    return _module(kind).generate(seed=seed, agents=agents, duration_s=duration_s, requests_per_agent=requests_per_agent, block_size=block_size)


def targets_of(kind: str) -> tuple[Target, ...]:
    """The calibration targets of a workload."""
    return tuple(_module(kind).TARGETS)
