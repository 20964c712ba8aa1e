"""The engine interface the worker shell drives (DESIGN §5).

Contains zero decision logic: what to run is decided by the scheduler core
(``services.worker.scheduler.EngineScheduler``); an engine only executes a
plan and says how long it took and which tokens it produced. The ``sim``
engine (``engines/sim.py``) answers from the hardware/model profile; a GPU
engine would run the forward pass of the plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from services.worker.plan import IterationPlan


class Engine(ABC):
    """One model replica that executes iteration plans."""

    name: str = ""
    """Engine kind reported in ``NodeState.engine`` (``sim``)."""
    simulated: bool = True
    """True if executing a plan takes no wall time: the shell then waits until the
    plan's end on the simulated clock (``SimClock.wall_at(plan.start + duration)``)."""

    @abstractmethod
    def execute(self, plan: IterationPlan) -> float:
        """Execute ``plan`` and return its duration in simulated seconds (all
        ``plan.iterations`` iterations together)."""

    @abstractmethod
    def output_tokens(self, rid: str, start: int, count: int) -> list[int]:
        """Token ids of request ``rid`` at output positions ``[start, start + count)``
        that the last executed plans produced."""
