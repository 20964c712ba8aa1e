"""Planner service shell: publishes split commands, answers ``split.get``, stores iteration records.

Zero decision logic here (it lives in ``core.py``): subscribe, decode, call the
core, publish what it returns.
"""

from __future__ import annotations

import asyncio

import structlog

from services.planner.config import PlannerConfig
from services.planner.core import PlannerCore
from shared import messages as m
from shared.bus import Bus
from shared.clock import SimClock
from shared.subjects import NODE_ITERS, SPLIT_APPLIED, SPLIT_COMMANDS, SPLIT_GET


class PlannerService:
    """Announces the split (at start, then every ``announce_interval_s``) and collects records."""

    def __init__(self, cfg: PlannerConfig, bus: Bus, clock: SimClock) -> None:
        self.cfg = cfg
        self.bus = bus
        self.clock = clock
        self.core = PlannerCore(cfg.nodes, cfg.split, history=cfg.history)
        self.log = structlog.get_logger("planner")
        self.applied: dict[str, m.SplitApplied] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.bus.subscribe(NODE_ITERS, self._on_iters)
        await self.bus.subscribe(SPLIT_APPLIED, self._on_applied)
        await self.bus.serve(SPLIT_GET, self._on_get)
        await self.bus.publish(SPLIT_COMMANDS, self.core.command)
        self.log.info("split announced", split=self.core.split, epoch=self.core.command.epoch)
        self._task = asyncio.create_task(self._announce_loop(), name="planner-announce")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _announce_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.announce_interval_s)
            await self.bus.publish(SPLIT_COMMANDS, self.core.command)

    async def _on_iters(self, msg: m.IterationRecords, _subject: str) -> None:
        if not self.core.add_records(msg):
            self.log.warning("iteration records from an unknown node dropped", node=msg.node)

    async def _on_applied(self, msg: m.SplitApplied, _subject: str) -> None:
        self.applied[msg.node] = msg

    async def _on_get(self, _req: m.SplitQuery, _subject: str) -> m.SplitCommand:
        return self.core.command

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        counters = {
            "iteration_records": self.core.records_total,
            "iteration_records_unknown_node": self.core.records_unknown_node,
            "split_epoch": self.core.command.epoch,
        }
        gauges = {f"records.{n}": float(len(r)) for n, r in self.core.records.items()}
        return counters, gauges
