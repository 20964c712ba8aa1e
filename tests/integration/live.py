"""Shared setup of the live integration tests that run services in this process (next to
:mod:`tests.integration.polling`): the test's own bus on the real nats-server, subscriptions that
record what the services publish, and services started with ``serve_until_stopped`` and stopped
together when the test's exit stack closes.

Nothing here is shared across tests: each helper takes the test's own ``AsyncExitStack`` and
returns fresh containers, so the two xdist lanes (``tests/conftest.py``) and any test order hold.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from shared import messages as m
from shared.bus import Bus
from shared.service import serve_until_stopped
from shared.subjects import NODE_STATE, REQ_OUT, SPLIT_APPLIED, Subjects
from services.router.service import RouterService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerService


async def open_bus(stack: AsyncExitStack, nats_url: str, instance: str = "test") -> Bus:
    """The test's own bus (service ``test``, ``instance``, cluster prefix ``p0``) on ``nats_url``,
    closed when ``stack`` closes (after whatever is pushed on it later, as services)."""
    bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance=instance)
    stack.push_async_callback(bus.close)
    return bus


async def node_states(bus: Bus) -> dict[str, m.NodeState]:
    """Each node's latest ``node.state`` seen on ``bus`` from now on, by node name."""
    states: dict[str, m.NodeState] = {}

    async def on_state(st: m.NodeState, _s: str) -> None:
        states[st.node] = st

    await bus.subscribe(NODE_STATE, on_state)
    return states


async def node_state_history(bus: Bus) -> dict[str, list[m.NodeState]]:
    """Every ``node.state`` seen on ``bus`` from now on, in arrival order, by node name."""
    states: dict[str, list[m.NodeState]] = {}

    async def on_state(st: m.NodeState, _s: str) -> None:
        states.setdefault(st.node, []).append(st)

    await bus.subscribe(NODE_STATE, on_state)
    return states


async def token_chunks(bus: Bus) -> defaultdict[str, list[m.TokenChunk]]:
    """Every ``req.out`` token chunk seen on ``bus`` from now on, in arrival order, by request id."""
    chunks: defaultdict[str, list[m.TokenChunk]] = defaultdict(list)

    async def on_chunk(c: m.TokenChunk, _s: str) -> None:
        chunks[c.rid].append(c)

    await bus.subscribe(REQ_OUT, on_chunk)
    return chunks


async def split_applied(bus: Bus) -> list[m.SplitApplied]:
    """Every ``split.applied`` seen on ``bus`` from now on, in arrival order."""
    applied: list[m.SplitApplied] = []

    async def on_applied(a: m.SplitApplied, _s: str) -> None:
        applied.append(a)

    await bus.subscribe(SPLIT_APPLIED, on_applied)
    return applied


class Services:
    """Services served in this process with ``serve_until_stopped``, each with its own stop event
    (what SIGTERM sets in a process). When ``stack`` closes every stop is set, then every task is
    awaited (their errors ignored: a test that expects one awaits that task itself)."""

    def __init__(self, stack: AsyncExitStack) -> None:
        self.stops: list[asyncio.Event] = []
        self.tasks: list[asyncio.Task[None]] = []
        stack.push_async_callback(self.shutdown)

    def start(self, service: str, cfg: Any, make: Any, instance: str | None = None) -> asyncio.Task[None]:
        """Serve ``make(cfg, bus, clock)`` as ``service`` (instance ``instance``, default the same name);
        its task (it ends when its stop is set, or raises what the service failed with)."""
        self.stops.append(asyncio.Event())
        self.tasks.append(
            asyncio.create_task(serve_until_stopped(service, cfg, make, instance=instance or service, stop_event=self.stops[-1]))
        )
        return self.tasks[-1]

    async def shutdown(self) -> None:
        for s in self.stops:
            s.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def worker_factory(
    engine: Callable[[Any], SimEngine] | None = None, service: type[WorkerService] = WorkerService, held: list | None = None
) -> Callable[[Any, Bus, Any], WorkerService]:
    """A factory for :meth:`Services.start`: a ``service`` (``WorkerService`` or a subclass) whose
    engine is replaced by ``engine(profile)`` when given, appended to ``held`` when given (so the
    test can read its counters)."""

    def make(c: Any, b: Bus, clk: Any) -> WorkerService:
        svc = service(c, b, clk)
        if engine is not None:
            svc.engine = engine(svc.profile)
        if held is not None:
            held.append(svc)
        return svc

    return make


def router_factory(held: list[RouterService]) -> Callable[[Any, Bus, Any], RouterService]:
    """A factory for :meth:`Services.start`: a ``RouterService``, appended to ``held`` once built
    (``held and held[0].ready()`` tells when it serves)."""

    def make(c: Any, b: Bus, clk: Any) -> RouterService:
        held.append(RouterService(c, b, clk))
        return held[-1]

    return make
