"""Planner core: the cluster's PD split and the iteration records it learns from.

Sans-IO: no asyncio, no clock, no I/O. The shell (``service.py``) feeds it
``IterationRecords`` and asks it for the current :class:`SplitCommand`.
This core holds the configured split (collocated or xPyD) and stores the
iteration records workers publish, bounded per node; fitting the Eq. 1/2
models and planning new splits build on these records (paper §5.1–5.2).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from shared.messages import IterationRecord, IterationRecords, Phase, SplitCommand
from shared.split import split_name, split_phases
from shared.subjects import check_token


class PlannerCore:
    """Holds the split with its epoch and a bounded history of iteration records.

    Args:
        nodes: node ids in cluster order (the order ``xPyD`` specs are applied in).
        split: initial split spec, ``collocated`` or ``xPyD``.
        history: iteration records kept per node (oldest dropped first).

    Raises:
        ValueError / SplitError: on an invalid node id or a split that does not fit the nodes.
    """

    def __init__(self, nodes: Sequence[str], split: str = "collocated", *, history: int = 100_000) -> None:
        if not nodes:
            raise ValueError("the planner needs at least one node")
        self.nodes = [check_token(n, "node") for n in nodes]
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"duplicate node ids in {list(nodes)}")
        self.history = history
        self.records: dict[str, deque[IterationRecord]] = {n: deque(maxlen=history) for n in self.nodes}
        self.records_total = 0
        self.records_unknown_node = 0
        self.command = SplitCommand(epoch=1, phases=split_phases(split, self.nodes), reason="initial", decided_at=0.0)

    @property
    def split(self) -> str:
        """Current split as ``xPyD`` or ``collocated``."""
        return split_name(self.command.phases)

    def set_split(self, spec: str, now: float, reason: str = "operator") -> SplitCommand:
        """Adopt a new split spec under a new epoch and return its command.

        Raises:
            SplitError: if the spec does not fit the node list.
        """
        phases: dict[str, Phase] = split_phases(spec, self.nodes)
        self.command = SplitCommand(epoch=self.command.epoch + 1, phases=phases, reason=reason, decided_at=now)
        return self.command

    def add_records(self, msg: IterationRecords) -> int:
        """Store a worker's iteration records; returns how many were kept (0 for an unknown node)."""
        store = self.records.get(msg.node)
        if store is None:
            self.records_unknown_node += 1
            return 0
        store.extend(msg.records)
        self.records_total += len(msg.records)
        return len(msg.records)
