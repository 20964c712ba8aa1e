"""Online per-node iteration-time models for the router, whatever the planner policy (issue 21).

Contains zero I/O; every method takes ``now`` (simulated s).

The router's ``ttft`` policy predicts each node's prefill with Eq. 1/2
coefficients (``services/router/ttft.py``); they come from ``planner.models``.
The evolving planner publishes its fitted (then frozen) models; the other
policies (``static``, ``dynamo``, ``arrow``) have none, so before this module a
node five times slower than its profile kept its profile coefficients in the
router and kept getting prefill work. :class:`OnlineModels` closes that gap:
it keeps the last ``window_records`` iteration records of every node and, every
``refit_interval_s``, refits the nodes that reported new records with the same
NNLS fit the evolving planner uses (``fit.fit_node``, the profile as prior),
returning a :class:`~shared.messages.PlannerModels` (``frozen=False``, source
``fitted``) for the router. A node with fewer than ``min_samples`` records of a
side keeps what the router has for that side (the message leaves it unset).

Used by ``PlannerCore`` (live planner: published on ``planner.models``) and by
the simulator (applied to the router core), for every policy that publishes no
models of its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from shared.messages import IterationRecord, NodeModels, PlannerModels
from shared.profile import Profile
from services.planner.fit import FitSamples, fit_node


class OnlineModels:
    """Sliding-window refits of each node's Eq. 1/2 coefficients (module docstring).

    Args:
        nodes: node ids.
        profile: priors (Eq. 1/2 coefficients, MoE/MTP shape) of the fit.
        window_records: most recent records kept per node (the fit's input).
        refit_interval_s: simulated seconds between refits.
        min_samples: records with a prefill (decode) part needed to fit that side.

    Raises:
        ValueError: ``window_records`` < 1, ``refit_interval_s`` <= 0 or ``min_samples`` < 1.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        profile: Profile,
        *,
        window_records: int = 1000,
        refit_interval_s: float = 60.0,
        min_samples: int = 8,
    ) -> None:
        if window_records < 1 or refit_interval_s <= 0 or min_samples < 1:
            raise ValueError("window_records >= 1, refit_interval_s > 0 and min_samples >= 1 are required")
        self.profile = profile
        self.window_records = window_records
        self.refit_interval_s = refit_interval_s
        self.min_samples = min_samples
        self.recent: dict[str, deque[IterationRecord]] = {n: deque(maxlen=window_records) for n in nodes}
        self._dirty: set[str] = set()
        self.next_refit = refit_interval_s
        self.refits = 0
        """Refits that produced a message."""

    def add(self, node: str, records: Sequence[IterationRecord]) -> None:
        """Keep ``node``'s records (unknown nodes are ignored). O(records)."""
        q = self.recent.get(node)
        if q is None or not records:
            return
        q.extend(records)
        self._dirty.add(node)

    def due(self, now: float) -> bool:
        """True when a refit is due at ``now``."""
        return now + 1e-9 >= self.next_refit

    def refit(self, now: float) -> PlannerModels | None:
        """Refit every node with new records since the last refit (if due); None when nothing
        was fitted. O(nodes × window_records)."""
        if not self.due(now):
            return None
        while self.next_refit <= now + 1e-9:
            self.next_refit += self.refit_interval_s
        out: list[NodeModels] = []
        for node in sorted(self._dirty):
            s = FitSamples(cap=self.window_records)
            s.add(self.recent[node])
            f = fit_node(s, self.profile.prefill, self.profile.decode, min_samples=self.min_samples)
            if f.prefill is None and f.decode is None:
                continue
            out.append(
                NodeModels(node=node, prefill=f.prefill, decode=f.decode, samples=len(s), source="fitted", fit_error=f.fit_error)
            )
        self._dirty.clear()
        if not out:
            return None
        self.refits += 1
        return PlannerModels(models=out, fitted_at=now, frozen=False)


__all__ = ["OnlineModels"]
