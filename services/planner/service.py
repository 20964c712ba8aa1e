"""Planner service shell: subscribe, decode, call the core, publish what it returns.

Contains zero decision logic (it lives in ``core.py`` and the policies). Inputs:
``node.iters.*``, ``node.state.*``, ``req.*.out.*`` (request completions for w̄),
``split.applied``; request/reply: ``split.get``, ``split.set``. At start the planner reads
the node states for up to ``adopt_grace_s`` (wall s) and adopts the split the nodes serve
(``core.PlannerCore`` adoption: a restarted planner neither reverts an operator's split nor
switches a node); a ``split.get`` or ``split set`` sent meanwhile is held and answered once
the adoption has ended (a ``split set`` then goes above the adopted epoch). Outputs:
``split.commands`` (once the adoption ends, on every new epoch, and every
``announce_interval_s``), ``planner.decisions`` (every decision),
``planner.models`` (when the models change, and with each announcement; for a
policy without models of its own — static, dynamo, arrow — the online refits of
``online.py`` every ``refit_interval_s``, so the router's per-node models follow
the nodes whatever the policy).

The tick loop sleeps on the cluster clock until the policy's ``next_tick()``
(at most ``max_tick_wait_s`` wall seconds at a time), then calls
``core.tick(now)``.

Failures: a round of either loop that raises (a publish NATS refuses, a policy or core bug) is
logged at error with the traceback, counted (``announce.errors``, ``tick.round_errors``) and the
loop goes on after a pause: the core's command and models stand, and the next announcement sends
them again. Anything that ends a loop all the same fails the planner (``BackgroundTasks``:
exit 1, its supervisor restarts it, and a restarted planner adopts the split the nodes serve).
"""

from __future__ import annotations

import asyncio
import importlib
import time

import msgspec
import structlog
from prometheus_client import Histogram

from services.planner.config import PlannerConfig, planner_profile
from services.planner.prom import SWITCH_BUCKETS_S, planner_families
from services.planner.core import PlannerCore
from services.planner.online import OnlineModels
from services.planner.policy import make_planner, parse_planner_args
from shared import messages as m
from shared.bus import Bus
from shared.clock import MIN_SLEEP_S, SimClock
from shared.metrics import FuncCollector, make_registry
from shared.service import BackgroundTasks, WatchedService
from shared.split import SplitError
from shared.validate import MAX_EPOCH_STEP
from shared.subjects import (
    NODE_ITERS,
    NODE_STATE,
    PLANNER_DECISIONS,
    PLANNER_MODELS,
    REQ_OUT,
    SPLIT_APPLIED,
    SPLIT_COMMANDS,
    SPLIT_GET,
    SPLIT_SET,
)

# SciPy (the fits' NNLS, services/planner/fit.py) is imported lazily there, because most simulator
# runs never fit. The live planner loads it in a thread from its start (:meth:`PlannerService._load_scipy`):
# its first fit (the end of the warm-up, at least the adoption grace after the start) then finds it
# loaded and does not stall a planning tick for the ~1 s of CPU the import takes (50 simulated s at
# speed-up 50: the demo's switch at the end of the warm-up took 41 s instead of 2), and the process
# no longer spends that second before it starts (spawn → 'service started' 1.75 → 1.08 s, median of 5,
# bench/RESULTS.md "Service start"). A fit that comes before the thread has finished waits for it on
# the import's module lock, as it waited for the whole import before.
SCIPY_MODULE = "scipy.optimize"
"""The module :meth:`PlannerService._load_scipy` loads off the start path (the fits' ``nnls``)."""


class Superseded(RuntimeError):
    """A planner that started later issues split commands (``SplitCommand.boot``): this one stops."""


class PlannerService(WatchedService):
    """Runs the selected planner policy over the bus (see the module docstring).

    Raises:
        ValueError / SplitError / ProfileError: on a bad node list, split, profile or planner argument.
    """

    def __init__(self, cfg: PlannerConfig, bus: Bus, clock: SimClock) -> None:
        self.cfg = cfg
        self.bus = bus
        self.clock = clock
        profile = planner_profile(cfg)  # on the cluster clock, as the records it fits (--profile-clock)
        policy = make_planner(cfg.planner, cfg.nodes, profile, **parse_planner_args(cfg.planner_args))
        online = OnlineModels(cfg.nodes, profile, refit_interval_s=cfg.refit_interval_s) if cfg.nodes else None
        adopt_until = clock.now() + cfg.adopt_grace_s * clock.speedup if cfg.adopt_grace_s > 0 else None
        self.core = PlannerCore(
            cfg.nodes, cfg.split, history=cfg.history, policy=policy, busy_timeout_s=cfg.busy_timeout_s, online=online,
            adopt_until=adopt_until, silent_after=cfg.silent_after_s * clock.speedup, wall_per_s=clock.to_wall(1.0),
            boot=bus.boot,  # one incarnation for its heartbeats and its split commands (Bus.boot)
        )
        self.log = structlog.get_logger("planner").bind(policy=cfg.planner)
        self.applied: dict[str, m.SplitApplied] = {}
        self._wake = asyncio.Event()
        self._adopted = asyncio.Event()
        """Set once the start-up adoption has ended (at once without one): held ``split.get`` and
        ``split set`` requests are answered then."""
        if not self.core.adopting:
            self._adopted.set()
        self.counters: dict[str, int] = {"split.set.ok": 0, "split.set.refused": 0, "decisions": 0, "models.published": 0}
        self._bg = BackgroundTasks(self.log, self.counters)
        self.fatal = self._bg.fatal
        """Set when the announce or the tick loop ended (``shared.service`` stops the planner, exit 1)."""
        self.registry = make_registry(bus)
        """Prometheus registry served on ``--metrics-port`` (``services/planner/prom.py``)."""
        self.registry.register(FuncCollector(lambda: planner_families(self)))
        self._switch_s = Histogram(
            "ei_split_switch_seconds", "Node phase switch: decision (or, for a node restarted after it, its start) to serving the new phase (s, cluster clock: simulated s under --speedup, wall s at speedup 1)",
            buckets=SWITCH_BUCKETS_S, registry=self.registry,
        )
        self._drain_s = Histogram(
            "ei_split_switch_drain_seconds", "Part of a node phase switch spent draining its running requests (s, cluster clock: simulated s under --speedup, wall s at speedup 1)",
            buckets=SWITCH_BUCKETS_S, registry=self.registry,
        )
        self._serving_phase: dict[str, str] = {}
        """node → the phase its last ``split.applied`` ``serving`` named (what a switch leaves)."""
        bus.known_nodes = frozenset(cfg.nodes)

    async def start(self) -> None:
        self._bg.start(self._load_scipy(), "planner-load-scipy", needed=False, counter="scipy.load_errors")
        await self.bus.subscribe(NODE_ITERS, self._on_iters)
        await self.bus.subscribe(NODE_STATE, self._on_state)
        await self.bus.subscribe(REQ_OUT, self._on_chunk, reliable=False)  # observes only: a missed chunk is harmless
        await self.bus.subscribe(SPLIT_APPLIED, self._on_applied)
        await self.bus.serve(SPLIT_GET, self._on_get)
        await self.bus.serve(SPLIT_SET, self._on_set)
        await self.bus.subscribe(SPLIT_COMMANDS, self._on_command)
        if self.core.adopting:
            self.log.info("reading the node states before announcing a split", grace_s=self.cfg.adopt_grace_s)
        else:
            await self._publish_command(self.core.command)
            self.log.info("split announced", split=self.core.split, epoch=self.core.command.epoch)
        await self._publish_models(force=True)
        self._bg.start(self._announce_loop(), "planner-announce")
        self._bg.start(self._tick_loop(), "planner-tick")

    async def stop(self) -> None:
        await self._bg.stop()

    async def _load_scipy(self) -> None:
        """Import :data:`SCIPY_MODULE` in a worker thread (see the comment above the class): the
        event loop serves meanwhile. Logs the wall seconds it took at debug.

        Raises:
            ImportError: SciPy missing or broken; ``BackgroundTasks`` logs it at error and counts
                ``scipy.load_errors``; the planner serves on, and a fit then raises the ImportError
                again in its tick (counted as the tick loop's errors).
        """
        t0 = time.perf_counter()
        await asyncio.to_thread(importlib.import_module, SCIPY_MODULE)
        self.log.debug("scipy loaded", module=SCIPY_MODULE, wall_s=round(time.perf_counter() - t0, 3))

    def ready(self) -> bool:
        """Both loops (announce, tick) run."""
        return self._bg.healthy()

    # -- loops ------------------------------------------------------------------ #

    async def _round_failed(self, loop: str, counter: str, e: Exception) -> None:
        """One round of ``loop`` raised ``e``: count it (``counter``), log it at error with the
        traceback, pause ``max_tick_wait_s`` (a failure that repeats, NATS refusing every publish,
        is not retried in a busy loop). Before, the exception ended the loop silently: no more
        announcements (a router started later never learnt the split), or no more planning."""
        self.counters[counter] = self.counters.get(counter, 0) + 1
        self.log.error(f"planner {loop} round failed; the loop goes on", error=repr(e), exc_info=e)
        await asyncio.sleep(self.cfg.max_tick_wait_s)

    async def _announce_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.announce_interval_s)
            if self.core.adopting:
                continue
            try:
                await self._publish_command(self.core.command)
                await self._publish_models(force=True)
            except Exception as e:
                await self._round_failed("announce", "announce.errors", e)

    async def _tick_loop(self) -> None:
        while True:
            try:
                nxt = self.core.next_tick()
                now = self.clock.now()
                if nxt is not None and nxt <= now:
                    await self._tick(now)
                    continue
                wait = self.cfg.max_tick_wait_s
                if nxt is not None:
                    # at least MIN_SLEEP_S: the wait ends up to ~1 ms early under uvloop, and a shorter
                    # one is no wait there (the loop went round up to ~13 times before a tick)
                    wait = min(wait, max(MIN_SLEEP_S, self.clock.to_wall(nxt - now)))
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    pass
                await self._publish_models()  # online refits for the router (policies without models of their own)
            except Exception as e:
                await self._round_failed("tick", "tick.round_errors", e)

    async def _tick(self, now: float) -> None:
        try:
            cmd = self.core.tick(now)
        except Exception as e:  # a policy bug must not stop the planner loop
            self.counters["tick.errors"] = self.counters.get("tick.errors", 0) + 1
            self.log.exception("planner tick failed", error=repr(e))
            await asyncio.sleep(self.cfg.max_tick_wait_s)
            return
        if cmd is not None:
            await self._publish_command(cmd)
            self.log.info("split announced", split=self.core.split, epoch=cmd.epoch, reason=cmd.reason)
        if not self.core.adopting:
            self._adopted.set()
        await self._flush()

    async def _adoption_ended(self) -> bool:
        """Wait (at most the grace left, + :data:`~shared.messages.ADOPTING_HOLD_S` wall s) until the start-up adoption has ended: a
        ``split.get`` or ``split set`` sent meanwhile is answered once the planner knows the
        split the nodes serve, instead of timing out at the asker (``evolving-infra split get``
        asks once) or being refused. True when it has ended."""
        if self.core.adopt_until is not None:
            left = self.clock.to_wall(max(0.0, self.core.adopt_until - self.clock.now())) + m.ADOPTING_HOLD_S
            try:
                await asyncio.wait_for(self._adopted.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass
        return not self.core.adopting

    async def _flush(self) -> None:
        for d in self.core.take_decisions():
            self.counters["decisions"] += 1
            key = f"decisions.{d.action}"
            self.counters[key] = self.counters.get(key, 0) + 1
            self.log.info(
                "[decision]",
                action=d.action,
                current=d.split_before,
                recommended=d.split_after,
                reason=d.reason,
                objective=d.candidates[0].objective if d.candidates else None,  # unit of the gains: req/s (throughput) or s (latency)
                candidates=[(c.split, round(c.mean_gain, 4), round(c.threshold, 4), c.vetoed) for c in d.candidates],
                **{k: round(v, 4) for k, v in d.metrics.items()},
            )
            await self.bus.publish(PLANNER_DECISIONS, d)
        await self._publish_models()

    async def _publish_models(self, *, force: bool = False) -> None:
        models = self.core.take_models(self.clock.now())
        if models is None and force:
            models = self.core.current_models()
        if models is not None:
            await self.bus.publish(PLANNER_MODELS, models)
            self.counters["models.published"] += 1

    # -- handlers ----------------------------------------------------------------- #

    async def _on_iters(self, msg: m.IterationRecords, _subject: str) -> None:
        if not self.core.add_records(msg, self.clock.now()):
            self.log.warning("iteration records from an unknown node dropped", node=msg.node)

    async def _on_state(self, msg: m.NodeState, _subject: str) -> None:
        # a state's epoch only feeds the adoption (core.on_node_state); the tick loop adopts when it is due
        before = self.core.command
        if self.core.on_node_state(msg, self.clock.now()) and self.core.adopt_due():
            self._wake.set()
        if self.core.command is not before and not self.core.adopting:
            # an adopted node's entry corrected under the same epoch (core._refine): the routers
            # exclude the node while the split they hold names another phase, so say it now, not
            # at the next announcement (announce_interval_s)
            await self._publish_command(self.core.command)
            self.log.info("split announced", split=self.core.split, epoch=self.core.command.epoch, reason="corrected: " + msg.node)

    async def _on_chunk(self, msg: m.TokenChunk, _subject: str) -> None:
        self.core.on_token_chunk(msg, self.clock.now())

    async def _on_applied(self, msg: m.SplitApplied, _subject: str) -> None:
        if msg.status == "serving" and self.applied.get(msg.node) != msg:
            # a switch: the node serves another phase than it last said it served, or its switch
            # took time (a node restarted after the decision: from its start). A node the command
            # leaves in its phase confirms it at once (switch_s 0, same phase): no switch
            # (evolving_infra/report/timeline.py counts switches the same way).
            last = self._serving_phase.get(msg.node)
            if msg.switch_s > 0 or (last is not None and last != msg.phase):
                self._switch_s.observe(msg.switch_s)
                self._drain_s.observe(max(0.0, msg.drained_at - msg.received_at))
            self._serving_phase[msg.node] = msg.phase
        self.applied[msg.node] = msg
        self.core.on_split_applied(msg, self.clock.now())

    async def _publish_command(self, cmd: m.SplitCommand) -> None:
        """Publish ``cmd`` on ``split.commands`` stamped with this process's ``boot``."""
        await self.bus.publish(SPLIT_COMMANDS, msgspec.structs.replace(cmd, boot=self.core.boot))

    async def _on_command(self, cmd: m.SplitCommand, _subject: str) -> None:
        """``split.commands`` as everyone receives it: a command this planner did not issue
        is answered by re-issuing the planner's split above its epoch (``core.on_foreign_command``);
        one from a planner that started later stops this one (exit 1)."""
        again = self.core.on_foreign_command(cmd, self.clock.now(), MAX_EPOCH_STEP)
        if self.core.superseded_by is not None:
            if not self.fatal.is_set():
                self.counters["superseded"] = 1
                self.log.error("planner superseded: a planner started later issues split commands; this one exits",
                               boot=self.core.boot, later=self.core.superseded_by, foreign_epoch=cmd.epoch)  # fmt: skip
                self._bg.fail(Superseded(f"a planner started later (boot {self.core.superseded_by}) issues split commands"),
                              "split.commands")  # fmt: skip
            return
        if again is not None:
            await self._publish_command(again)
            self.bus.droplog.event(
                "split.foreign", "foreign split command overridden", level="warning", foreign_epoch=cmd.epoch, src=cmd.src, epoch=again.epoch
            )

    async def _on_get(self, _req: m.SplitQuery, _subject: str) -> m.SplitCommand | None:
        if self.core.adopting:  # no split known yet: answered once it is (an asker that gave up retries)
            self.counters["split.get.adopting"] = self.counters.get("split.get.adopting", 0) + 1
            if not await self._adoption_ended():
                return None
        return self.core.command

    async def _on_set(self, req: m.SplitSetRequest, _subject: str) -> m.SplitSetReply:
        if self.core.adopting:  # set above the epoch the nodes hold, once it is known (else refused: core)
            self.counters["split.set.adopting"] = self.counters.get("split.set.adopting", 0) + 1
            await self._adoption_ended()
        now = self.clock.now()
        try:
            cmd = self.core.set_split(req.split, now, reason=req.reason or "operator")
        except ValueError as e:  # SplitError (the split does not fit: the asker's), or still starting (retry)
            self.counters["split.set.refused"] += 1
            self.log.warning("split set refused", split=req.split, error=str(e))
            return m.SplitSetReply(ok=False, error=str(e), retry=not isinstance(e, SplitError))
        self.counters["split.set.ok"] += 1
        await self._publish_command(cmd)
        self.log.info("split set by operator", split=self.core.split, epoch=cmd.epoch)
        await self._flush()
        await self._tick(now)  # the policy sees the new split at once
        return m.SplitSetReply(ok=True, command=cmd)

    # -- stats ---------------------------------------------------------------------- #

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        counters = {
            "iteration_records": self.core.records_total,
            "iteration_records_unknown_node": self.core.records_unknown_node,
            "node_states_unknown_node": self.core.states_unknown_node,
            "split_epoch": self.core.command.epoch,
            "requests_completed": self.core.tracker.completed,
            "requests_dropped": self.core.tracker.dropped,
            "switches": self.core.switches,
            "split.foreign": self.core.foreign_commands,
            "split.adoptions": self.core.adoptions,
            "node_states_epoch_ahead": self.core.states_epoch_ahead,
            "ticks": self.core.ticks,
            **self.counters,
        }
        gauges = {f"records.{n}": float(len(r)) for n, r in self.core.records.items()}
        gauges["requests_inflight"] = float(len(self.core.tracker))
        nxt = self.core.next_tick()
        if nxt is not None:
            gauges["next_tick_s"] = float(nxt)
        return counters, gauges
