"""Shared setup of the live integration tests that run services in this process (next to
:mod:`tests.integration.polling`): the test's own bus on the real nats-server, subscriptions that
record what the services publish, and services started with ``serve_until_stopped`` and stopped
together when the test's exit stack closes.

Nothing here is shared across tests: each helper takes the test's own ``AsyncExitStack`` and
returns fresh containers, so the two xdist lanes (``tests/conftest.py``) and any test order hold.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import httpx

from shared import messages as m
from shared.bus import Bus, BusUnavailable
from shared.clock import SimClock
from shared.service import serve_until_stopped
from shared.subjects import NODE_STATE, REQ_OUT, SPLIT_APPLIED, SVC_STATS, Subjects
from services.router.config import RouterConfig
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


def refusing_split_applied(
    refused: list[m.SplitApplied], held: list[WorkerService], status: str | None = None
) -> Callable[[Any, Bus, Any], WorkerService]:
    """A factory for :meth:`Services.start`: a ``WorkerService`` (appended to ``held``) whose own bus
    refuses its first ``split.applied`` publish (the first of ``status`` when given) with
    ``BusUnavailable``, as with a full reconnect buffer; the refused message is appended to ``refused``."""

    def make(c: Any, b: Bus, clk: Any) -> WorkerService:
        svc = WorkerService(c, b, clk)
        real = b.publish

        async def publish(subject, msg, **kw):  # type: ignore[no-untyped-def]
            if subject is SPLIT_APPLIED and (status is None or msg.status == status) and not refused:
                refused.append(msg)
                raise BusUnavailable("cannot publish on split.applied: OutboundBufferLimitError (injected)")
            await real(subject, msg, **kw)

        b.publish = publish  # type: ignore[method-assign]
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


async def wait_for(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Return once ``pred()`` is true, polling every 0.02 s (the event loop's clock).

    Raises:
        AssertionError: ``pred()`` stayed false for ``timeout`` seconds ("timed out waiting for ``what``").
    """
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def serving_router(cfg: RouterConfig, clock: SimClock | None = None) -> AsyncIterator[RouterService]:
    """The router of ``cfg`` served in this process as ``router`` (as ``python -m services.router``),
    with ``clock`` in place of the one the shell makes when given; yields it once its port file
    (``cfg.port_file``) is written and it has applied split epoch 1 and is ready (5 s each); on exit
    stops it and waits up to 20 s for its end.

    Raises:
        AssertionError: no port file, or not ready, within 5 s.
        Whatever the router failed to start with (its task ended before the port file).
    """
    port_file = Path(cfg.port_file)
    holder: list[RouterService] = []

    def factory(c: Any, b: Bus, made: Any) -> RouterService:
        holder.append(RouterService(c, b, clock or made))
        return holder[-1]

    stop = asyncio.Event()
    task = asyncio.create_task(serve_until_stopped("router", cfg, factory, instance="router", stop_event=stop))
    try:
        await wait_for(lambda: port_file.exists() or task.done(), what="router port file")
        if task.done():
            task.result()
        svc = holder[0]
        await wait_for(lambda: svc.core.view.epoch == 1 and svc.ready(), what="split applied and nodes live")
        yield svc
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


async def cancelled(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel every task of ``tasks`` (a fake cluster's heartbeats), then await each to its end.

    Raises:
        Whatever a task raised before it saw its cancellation (``CancelledError`` is swallowed).
    """
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


class FakeClusterLike(Protocol):
    """What :func:`router_on_fake_cluster` needs of a test's fake cluster (workers, planner and
    directory played on its own bus connection, started already)."""

    bus: Bus

    def stop(self) -> Awaitable[None]: ...


C = TypeVar("C", bound=FakeClusterLike)


@dataclass
class RouterEnv(Generic[C]):
    """A router served in this process beside a test's fake ``cluster``: the router, an HTTP client
    on its port, the cluster's bus and the router's port file."""

    cluster: C
    service: RouterService
    http: httpx.AsyncClient
    bus: Bus
    port_file: Path

    async def stats(self) -> m.StatsReply:
        """The router's ``svc.stats`` (2 s timeout)."""
        return await self.bus.request(SVC_STATS, m.StatsRequest(), instance="router", timeout=2.0)


@contextlib.asynccontextmanager
async def router_on_fake_cluster(cluster: C, cfg: RouterConfig, clock: SimClock | None = None) -> AsyncIterator[RouterEnv[C]]:
    """:func:`serving_router` (``cfg``, ``clock``) with an HTTP client on its port (30 s timeout);
    on exit, after the router's stop, the cluster is stopped and its bus closed (also when the
    router failed to start)."""
    try:
        async with serving_router(cfg, clock) as svc, httpx.AsyncClient(base_url=f"http://127.0.0.1:{svc.port}", timeout=30.0) as http:
            yield RouterEnv(cluster, svc, http, cluster.bus, Path(cfg.port_file))
    finally:
        await cluster.stop()
        await cluster.bus.close()
