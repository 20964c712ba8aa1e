"""The process shell every service shares: config → logging → bus → run → drain.

A service's ``__main__`` is three lines::

    cfg = load_config(WorkerConfig, prog="worker")
    setup_logging(cfg.log_format, cfg.log_level, service="worker")
    run_service("worker", cfg, WorkerService)

``WorkerService(cfg, bus, clock)`` must offer ``async start()``, ``async stop()``
and ``stats() -> (counters, gauges)``; ``ready()`` is optional. SIGTERM and
SIGINT set a stop event; the service is then stopped and the bus drained
(in-flight handlers finish) before the connection closes (nats.py's graceful
shutdown example). A service with ``async drain(now: asyncio.Event)`` (the router's:
``--shutdown-grace-s``) is drained first after a SIGTERM, its bus, heartbeats and handlers
still running and ``/readyz`` already 503 ``stopping``; SIGINT (Ctrl-C), or a second signal
during the drain, sets ``now``: the drain returns at once (as gunicorn's TERM graceful,
INT quick). A signal during start-up (NATS unreachable: the connect
retries forever) cancels the start-up instead, closes what was set up and
exits 0. A service that fails beyond repair sets its ``fatal`` event (an ``asyncio.Event``,
optional, with the cause in ``fatal_error`` and, optionally, where it came from in ``fatal_where``,
e.g. ``task router-fence``): it is stopped the same way and
:func:`serve_until_stopped` raises :class:`ServiceFailed` (the process exits non-zero, so its
supervisor restarts it). With ``--metrics-port N`` (N > 0) the shell also serves the
service's Prometheus registry (its ``registry`` attribute, see ``shared.metrics``)
on ``GET http://<metrics-host>:N/metrics``, with ``/healthz`` (liveness) and ``/readyz``
(:class:`Readiness`) there from before the connection to NATS.

:class:`BackgroundTasks` watches a service's background tasks (loops, per-node tasks): one the
service needs that ends is logged with its traceback, counted, and fails the service through
``fatal``; one it can do without is logged and counted.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from contextlib import AsyncExitStack
from typing import Any, Protocol

import structlog

from shared.auth import AuthError, NatsAuth, redact_url
from shared.bus import Bus, BusError
from shared.cancel import cancel_until_done
from shared.clock import SimClock
from shared.config import CommonConfig
from shared import tracing
from shared.metrics import MetricsServer, make_registry, service_registry
from shared.net import inherited_socket
from shared.signals import STOP_SIGNALS, ignore_stop_signals, process_claimed
from shared.subjects import Subjects

try:  # uvloop is a core dependency on Linux/macOS; plain asyncio elsewhere.
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None  # type: ignore[assignment]


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stats(self) -> tuple[dict[str, int], dict[str, float]]: ...


ServiceFactory = Callable[[Any, Bus, SimClock], Service]


class ServiceFailed(RuntimeError):
    """The service set its ``fatal`` event (or could not start); it was stopped and the process must exit non-zero.
    Its message starts with the process's :func:`process_label` and a colon: the line ``run_service_main`` prints."""


def process_label(service_name: str, instance: str) -> str:
    """How a service process names itself in its one-line errors: ``kvdirectory``, or ``worker worker-w0`` where its
    instance is not the service's name (before, ``kvdirectory: kvdirectory kvdirectory: ...``)."""
    return service_name if instance in ("", service_name) else f"{service_name} {instance}"


class Superseded(RuntimeError):
    """A process that started later runs under this service's instance id (its heartbeat's ``boot``): this one was
    replaced while it was frozen (SIGSTOP, a paused VM), then resumed; it stops and exits non-zero."""


class WatchedService:
    """For a service whose background tasks a :class:`BackgroundTasks` (``self._bg``) watches (the
    router, the planner, the KV directory): :attr:`fatal_error` and :attr:`fatal_where`, which
    :func:`serve_until_stopped` reads when the service's ``fatal`` event is set."""

    _bg: "BackgroundTasks"

    @property
    def fatal_error(self) -> BaseException | None:
        """Why ``fatal`` was set (the exception that ended a task the service needs), else None."""
        return self._bg.fatal_error

    @property
    def fatal_where(self) -> str | None:
        """Where :attr:`fatal_error` came from (``task <name>``), else None (named at exit)."""
        return self._bg.fatal_where


class BackgroundTasks:
    """A service's background tasks, watched (the router's, the planner's, the KV directory's).

    A task started ``needed`` (the default: a loop the service cannot do without, the router's
    fence loop or HTTP server) must run until :meth:`stop`. When it ends before (an exception, or
    a return), the service fails: the cause is logged at error with its traceback, counted
    (``task_errors``, and ``task_fatal``), :attr:`fatal_error` holds it and :attr:`fatal` is set,
    so :func:`serve_until_stopped` stops the service and raises :class:`ServiceFailed` (the process
    exits 1 and its supervisor restarts it), as the worker does for its step loop. A task started
    with ``needed=False`` (one whose failure leaves the service able to go on: a node's resync,
    started again by that node's next message) that an exception ends is logged at error with the
    traceback and counted (``task_errors``, and ``counter`` when given); the service serves on.
    :meth:`healthy` is False once a needed task has ended: the service's ``ready()`` uses it.

    Before, such a task died silently (asyncio's "Task exception was never retrieved" at best, at
    garbage collection): the router's fence loop could end on one exception and the router went on
    answering ready while dead nodes' requests waited ``request_timeout_s``.

    Args:
        log: the service's structlog logger.
        counters: the service's counters (name → int), updated in place.
    """

    def __init__(self, log: Any, counters: MutableMapping[str, int]) -> None:
        self.log = log
        self.counters = counters
        self.fatal = asyncio.Event()
        """Set when a needed task ended before :meth:`stop` (the service's ``fatal``)."""
        self.fatal_error: BaseException | None = None
        """Why (the first needed task that ended; its exception, or a ``RuntimeError`` saying it returned)."""
        self.fatal_where: str | None = None
        """Where :attr:`fatal_error` came from (``task <name>``), for the one line the process prints at exit."""
        self.stopping = False
        """Set by the service when it begins to stop: a needed task that ends from then on is not a failure."""
        self._needed: dict[str, asyncio.Task[Any]] = {}
        self._all: set[asyncio.Task[Any]] = set()

    def start(self, coro: Coroutine[Any, Any, Any], name: str, *, needed: bool = True, counter: str | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` as task ``name`` (watched, cancelled by :meth:`stop`). ``needed``: its end
        fails the service; else an exception ending it is logged and counted (also as ``counter``).
        Returns the task."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._all.add(task)
        if needed:
            self._needed[name] = task
        task.add_done_callback(lambda t: self._done(t, needed, counter))
        return task

    def _done(self, t: asyncio.Task[Any], needed: bool, counter: str | None) -> None:
        self._all.discard(t)
        if t.cancelled():
            return
        e = t.exception()
        if e is not None:
            self.counters["task_errors"] = self.counters.get("task_errors", 0) + 1
            if counter:
                self.counters[counter] = self.counters.get(counter, 0) + 1
        if not needed:
            if e is not None:
                self.log.error("background task failed", task=t.get_name(), error=repr(e), exc_info=e)
            return
        if self.stopping:
            if e is not None:
                self.log.warning("background task failed while stopping", task=t.get_name(), error=repr(e), exc_info=e)
            return
        self.fail(e if e is not None else RuntimeError(f"background task {t.get_name()} ended"), f"task {t.get_name()}")

    def fail(self, e: BaseException, where: str) -> None:
        """The service cannot serve on (``where``): log at error with the traceback, count
        ``task_fatal``, keep ``e`` in :attr:`fatal_error` and set :attr:`fatal`. Idempotent: only
        the first failure is kept."""
        if self.fatal.is_set():
            return
        self.counters["task_fatal"] = self.counters.get("task_fatal", 0) + 1
        self.fatal_error = e
        self.fatal_where = where
        self.log.error(
            "a task the service needs failed; the service exits to be restarted", where=where, error=repr(e), exc_info=e
        )
        self.fatal.set()

    def names(self) -> list[str]:
        """Names of the needed tasks started (running or not)."""
        return list(self._needed)

    def dead(self) -> list[str]:
        """Names of the needed tasks that have ended (empty while all run)."""
        return [n for n, t in self._needed.items() if t.done()]

    def healthy(self) -> bool:
        """True while every needed task runs and none has failed."""
        return not self.fatal.is_set() and not self.dead()

    async def stop(self) -> None:
        """Cancel every task still running and wait for them (their errors are already logged)."""
        self.stopping = True
        # cancelled again until they end (shared.cancel): a loop cancelled in the turn its nats-py request's reply came
        # loses that cancel (Python 3.11's wait_for) and goes on; one cancel and a gather waited for it forever
        # (tests/unit/shared/test_stop_lost_cancel.py)
        await cancel_until_done(list(self._all))


START_FLUSH_S = 10.0
"""Seconds at most a service's start waits for the server to confirm its subscriptions (:meth:`Bus.flush`) before it
says it serves; past them it serves anyway (with a warning)."""


class Readiness:
    """Why a service is not ready: the reason its ``/readyz`` (``--metrics-port``, ``shared.metrics``) answers
    503 with, or None (200). Reads the bus's connection and stream state and the service's ``ready()`` at each
    call (no I/O). In order:

    * ``stopping``: the service's stop began (SIGTERM, ``fatal``);
    * ``connecting to NATS at <url>``: the first connect has not succeeded (NATS unreachable: it retries forever);
    * ``not connected to NATS at <url> (reconnecting)``: the bus lost its connection (nats-server down or
      restarting; the bus reconnects forever);
    * ``the NATS server at <url> has no JetStream (stream <name>): reliable messages wait for it``: the bus, on
      JetStream, reconnected to a server restarted without it; reliable publishes are kept until it is back;
    * ``the JetStream stream <name> lacks subjects [...] ...``: the stream found is another version's (or made by
      hand) and keeps none of some must-arrive messages (``shared.bus.Bus.stream_lacking``): for good, until it is made
      anew and the service restarted;
    * ``waiting for the JetStream stream <name>``: the bus waits for the partition's stream (at start; after a
      reconnect until the server has answered that it has it, the reliable publishes kept meanwhile; or, to a server
      that lost its store, until it or the launcher makes it again: ``shared.bus``). Before, a reconnect's first
      lookup, up to 5 s unanswered, was 200;
    * ``starting``: the service's start has not completed (nor the server confirmed the subscriptions it sent:
      ``START_FLUSH_S``);
    * ``not ready``: its ``ready()`` is false (a loop it needs ended, a worker that does not accept).

    Before, only the start's wait for the stream was a reason: once started, ``/readyz`` followed ``ready()``
    alone and said 200 while NATS was down or the stream lost, when the service could not do its job.
    Liveness (``/healthz``) is not this: it is 200 whenever the process answers.

    Args:
        nats_url: the ``--nats-url`` the bus connects to (shown with its secrets redacted).
    """

    def __init__(self, nats_url: str) -> None:
        self.url = redact_url(nats_url)
        self.phase = "starting"
        """``starting`` until the service's start completed, then ``serving``, then ``stopping``."""
        self.bus: Any = None
        """The service's :class:`~shared.bus.Bus` once connected (its ``nc.is_connected``, ``stream_waiting``)."""
        self.ready: Callable[[], bool] | None = None
        """The service's ``ready()``, when it has one."""

    def reason(self) -> str | None:
        """Why not ready (see the class), or None when ready."""
        state = self.state()
        return None if state is None else state[1]

    def state(self) -> tuple[str, str] | None:
        """``(kind, reason)``: why not ready (see the class) and its kind, one of ``shared.metrics.READY_REASONS``
        (``stopping``, ``connecting``, ``disconnected``, ``no_jetstream``, ``stream``, ``starting``, ``not_ready``:
        the ``reason`` label of ``ei_service_ready``, a fixed set where the reason names URLs and streams), or None
        when ready."""
        if self.phase == "stopping":
            return "stopping", "stopping"
        bus = self.bus
        if bus is None:
            return "connecting", f"connecting to NATS at {self.url}"
        if not bus.nc.is_connected:
            return "disconnected", f"not connected to NATS at {self.url} (reconnecting)"
        if bus.jetstream_missing:
            return "no_jetstream", f"the NATS server at {self.url} has no JetStream (stream {bus.jetstream_missing}): reliable messages wait for it"
        if bus.stream_lacking:  # a stream of another version: its must-arrive messages reach nobody (shared.bus)
            return "stream", bus.stream_lacking
        if bus.stream_waiting:
            return "stream", f"waiting for the JetStream stream {bus.stream_waiting}"
        if self.phase != "serving":
            return "starting", "starting"
        return None if self.ready is None or self.ready() else ("not_ready", "not ready")


def instance_name(service: str, cfg: CommonConfig, suffix: str = "") -> str:
    """The instance id: ``cfg.instance`` or ``<service>[-suffix]``."""
    if cfg.instance:
        return cfg.instance
    return f"{service}-{suffix}" if suffix else service


async def serve_until_stopped(
    service_name: str,
    cfg: CommonConfig,
    factory: ServiceFactory,
    *,
    instance: str,
    stop_event: asyncio.Event | None = None,
) -> None:
    """Connect, start the service, wait for ``stop_event`` (or a signal), then stop and drain.

    Raises:
        Whatever the factory or ``start()`` raise (a service that cannot start exits non-zero).
        ServiceFailed: the service set its ``fatal`` event while serving, during the ``drain`` a SIGTERM
            asks for, with the stop signal or during its ``stop()``, or that drain raised (it was stopped first).
    """
    log = structlog.get_logger(service_name).bind(instance=instance)
    stop = stop_event or asyncio.Event()
    now = asyncio.Event()  # SIGINT, or a second signal: a drain (SIGTERM's, the service's ``drain``) ends at once
    drain_asked = False
    loop = asyncio.get_running_loop()
    if stop_event is None:

        def on_signal(sig: int) -> None:
            nonlocal drain_asked
            if stop.is_set() or sig != signal.SIGTERM:
                now.set()
            else:
                drain_asked = True
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
    clock = SimClock(cfg.speedup, cfg.clock_origin)
    if tracing.setup(service_name, instance, endpoint=cfg.otlp_traces_endpoint):
        log.info("tracing on: OTLP/HTTP export", endpoint=redact_url(tracing.URL or ""), service_name=f"evolving-infra-{service_name}")
        if (ignored := tracing.protocol_ignored()) is not None:
            log.warning(ignored, protocol="http/protobuf")
    started: list[Any] = []
    buses: list[Bus] = []
    readiness = Readiness(cfg.nats_url)
    failed: BaseException | None = None
    drain_error: BaseException | None = None
    async with AsyncExitStack() as stack:
        stack.callback(tracing.shutdown)

        async def start_up() -> Any:
            auth = NatsAuth.from_settings(
                creds=cfg.nats_creds, user=cfg.nats_user, password=cfg.nats_password,
                tls_ca=cfg.nats_tls_ca, tls_cert=cfg.nats_tls_cert, tls_key=cfg.nats_tls_key, name=instance,
            )
            metrics = None
            if cfg.metrics_port or cfg.metrics_fd >= 0:
                # before the connect, which retries forever while NATS is unreachable, and the start, which may wait
                # (for the JetStream stream): /healthz (liveness) answers meanwhile and /readyz says why it is not
                # ready. Before, the port opened only after start, then only after the connect: a liveness probe saw
                # a service that waited for NATS or the stream as a dead one. Until the bus exists the registry holds
                # the process's families only; the service's (and its bus's) replace it then.
                try:  # a port in use, a --metrics-fd that is no listening socket: one line and exit 1, not a traceback
                    held = inherited_socket(cfg.metrics_fd, "--metrics-fd") if cfg.metrics_fd >= 0 else None
                    metrics = MetricsServer(make_registry(), cfg.metrics_host, cfg.metrics_port, readiness.state, sock=held)
                    await metrics.start()
                except OSError as e:
                    log.error("cannot serve metrics", error=str(e))
                    raise ServiceFailed(f"{process_label(service_name, instance)}: {e.strerror or e}") from e
                stack.push_async_callback(metrics.stop)
            try:
                bus = await Bus.connect(cfg.nats_url, Subjects(cfg.partition), service=service_name, instance=instance, auth=auth)
            except BusError as e:  # the server refused the credentials (or none were given): retrying cannot help
                log.error("nats refused the connection", error=str(e))
                raise ServiceFailed(f"{process_label(service_name, instance)}: {e}") from e
            stack.push_async_callback(bus.close)
            buses.append(bus)
            svc = factory(cfg, bus, clock)
            started.append(svc)
            ready = getattr(svc, "ready", None)
            readiness.bus, readiness.ready = bus, ready
            if metrics is not None:
                metrics.registry = service_registry(svc, bus)
            await svc.start()
            stack.push_async_callback(svc.stop)
            await bus.start_service_plumbing(svc.stats, ready=ready)
            # "serving" (/readyz 200, the "service started" line) only once the server has every SUB of the start:
            # nats-py queues them for its flusher, and a peer that publishes on the word reached no subscription
            # (tests/integration/test_service_readiness_live.py). Not answered within START_FLUSH_S: a warning, and
            # the start goes on to "serving" all the same. A lost connection shows in /readyz by itself ("not
            # connected", and a reconnect subscribes everything again); a server that hangs with the connection
            # open does not: /readyz then answers 200 with nothing answering (review rr-sig56 L3).
            try:
                await bus.flush(START_FLUSH_S)
            except BusError as e:
                log.warning("nats did not confirm the subscriptions at start", error=str(e))
            readiness.phase = "serving"
            return auth

        # A signal during start-up (NATS unreachable: the connect retries forever) cancels
        # it; what was already set up is closed by the exit stack, and the process exits 0.
        if (auth := await until_stopped(start_up(), stop)) is None:
            log.info("service stopped during start-up", nats=redact_url(cfg.nats_url))
            return
        log.info("service started", nats=redact_url(cfg.nats_url), partition=cfg.partition, speedup=cfg.speedup, nats_auth=auth.enabled)
        fatal = getattr(started[0], "fatal", None)
        waits = [asyncio.ensure_future(stop.wait())]
        if isinstance(fatal, asyncio.Event):
            waits.append(asyncio.ensure_future(fatal.wait()))
        waits.append(asyncio.ensure_future(buses[0].superseded.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            readiness.phase = "stopping"
        if buses[0].superseded.is_set() and not stop.is_set():
            failed = Superseded(f"a process that started later (boot {buses[0].superseded_by}) runs as {service_name} {instance}")
            log.error("service superseded; stopping, then exiting non-zero", error=repr(failed))
        elif isinstance(fatal, asyncio.Event) and fatal.is_set() and not stop.is_set():
            failed = getattr(started[0], "fatal_error", None) or RuntimeError("fatal")
            log.error("service failed; stopping, then exiting non-zero", error=repr(failed))
        else:
            log.info("service stopping")
            drain = getattr(started[0], "drain", None)
            if drain_asked and not now.is_set() and callable(drain):
                try:
                    await drain(now)  # the bus, its heartbeats and the service's handlers run on meanwhile
                except Exception as e:  # a drain that fails is a failed service (the supervisor restarts on failure)
                    failed = drain_error = e
                    log.error("service drain failed; stopping, then exiting non-zero", error=repr(e), exc_info=e)
    # a fatal error that came with the stop signal (SIGINT, a second signal), during SIGTERM's drain (the router's
    # drain ends on it) or during ``svc.stop()`` (the exit stack's): a failed service exits non-zero, so a supervisor
    # restarting on failure restarts it. Before, one met with the signal or in stop() exited 0 (7008d2e), and one met
    # during the drain had a check of its own after the drain, which set the same ``failed`` as this one does.
    if failed is None and isinstance(fatal, asyncio.Event) and fatal.is_set():
        failed = getattr(started[0], "fatal_error", None) or RuntimeError("fatal")
        log.error("service failed while draining or stopping; exiting non-zero", error=repr(failed))
    if failed is not None:
        log.error("service stopped after a fatal error", error=repr(failed))
        if failed is drain_error:
            where: str | None = "drain"
        else:
            where = None if isinstance(failed, Superseded) else getattr(started[0], "fatal_where", None)
        raise ServiceFailed(f"{process_label(service_name, instance)}: {f'{where} failed: ' if where else ''}{failed!r}") from failed
    log.info("service stopped")


STOP_GRACE_S = 3.0
"""Seconds :func:`until_stopped` lets a cancelled start run (its clean-up: ``RouterService.start``'s stop,
``Bus.connect``'s close of the abandoned client) before it cancels it again, every 0.05 s: the bound on what a lost
cancel costs a stop (0277de5) and on a start's clean-up after its cancel."""


async def until_stopped(
    coro: Any, stop: asyncio.Event, *, grace_s: float = STOP_GRACE_S,
    discard: Callable[[Any], Awaitable[Any]] | None = None,
) -> Any:
    """Run ``coro`` unless ``stop`` is set first; then cancel it and return None (a coroutine not begun when
    ``stop`` is already set is not run at all).

    After that cancel, ``coro`` runs until it ends (its clean-up on cancellation runs to its end) for up to
    ``grace_s`` seconds; one still running then is cancelled again every 0.05 s until it ends (a cancel lost in a
    nats-py call: below). A ``coro`` that returns a result all the same (its cancel was lost and it finished) has
    started what the stop should not leave running: ``discard`` is awaited with that result to stop it, then None is
    returned as for any stopped start.

    Args:
        coro: the start (a coroutine or future).
        stop: set to stop it.
        grace_s: seconds a cancelled ``coro`` may take to end before it is cancelled again (>= 0).
        discard: awaited with the result of a ``coro`` that finished after its cancel (e.g. ``up``'s cluster stop);
            None: that result is dropped (the caller stops what it started otherwise, e.g. an exit stack).

    Returns:
        ``coro``'s result, or None when ``stop`` was set before it finished.

    Raises:
        ValueError: ``grace_s`` negative or not a number (``coro`` is not run).
        asyncio.CancelledError: this coroutine was cancelled (while stopping ``coro``: once ``coro`` has ended).
        Whatever ``coro`` raises.
    """
    if not grace_s >= 0:
        if asyncio.iscoroutine(coro):
            coro.close()  # not run: no "never awaited" warning
        raise ValueError(f"grace_s must be seconds >= 0, got {grace_s!r}")
    if stop.is_set() and asyncio.iscoroutine(coro):  # stopped before it began (``up``: a signal caught while it
        coro.close()  # imported): not started at all, where a first step already started nats-server to stop it
        return None
    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this coroutine itself was cancelled
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if not task.done():
        # one cancel, then up to grace_s for the start to end: a delivered cancel's clean-up (a service's stop after
        # a half-done start, a cluster's stop of what it started) runs to its end. Cancelled again from the first
        # 0.05 s on (0277de5), a 0.2-s clean-up was cut short (tests/unit/shared/test_bus_connect_cancel.py).
        # Then cancelled again (every 0.05 s) until it ends (shared.cancel): a start inside a nats-py call can lose one
        # cancel (Python 3.11's asyncio.wait_for hands back what finished in the cancel's turn, a refusal or a reply,
        # and the call goes on or is retried). One cancel and an unbounded wait left such a service running after
        # SIGTERM, and a second SIGTERM did not end it (tests/unit/shared/test_bus_connect_cancel.py)
        caller_cancel: asyncio.CancelledError | None = None
        try:
            await cancel_until_done([task], grace_s=grace_s)
        except asyncio.CancelledError as e:  # the caller's own cancel: raised once the start has ended
            caller_cancel = e
        # a start whose cancel was lost may have finished all the same: what it started is stopped here. Before, its
        # result was dropped and ``up`` printed "stopped during start-up" with its services and nats-server running
        if discard is not None and not task.cancelled() and task.exception() is None:
            await discard(task.result())
        if caller_cancel is not None:
            raise caller_cancel
        return None
    return task.result()


def run_service(service_name: str, cfg: CommonConfig, factory: ServiceFactory, *, instance: str | None = None) -> None:
    """Run a service in this process until SIGINT/SIGTERM (uvloop when available); the process exits after it.

    In the service's own process (its ``main`` called with no ``argv``, :func:`shared.signals.claim_process`), once
    :func:`serve_until_stopped` has ended (drained, stopped, or failed), SIGINT and SIGTERM are ignored until
    the process exits (:func:`shared.signals.ignore_stop_signals`): a plain ``scancel`` sends every process of the
    job a SIGTERM and the job's stop and supervisors more, and one that came while the loop closed, or just after,
    killed the service by SIGTERM (status -15, not its 0 or 1; every burst of 4 SIGTERMs 2 ms apart did). Until then
    the signals keep their meaning (a second one, or SIGINT, ends SIGTERM's drain at once). Called in-process
    otherwise (a test's ``main([...])``, in the main thread), the caller's SIGINT / SIGTERM handlers are put back when
    it returns: ignored there, they stayed ignored in the test process and in every child it started later (a
    ``trace`` command's Ctrl-C, a router's SIGTERM: CI failures), and uvloop leaves its own handlers set.

    Raises:
        What :func:`serve_until_stopped` raises.
    """
    inst = instance or instance_name(service_name, cfg)

    async def serve() -> None:
        try:
            await serve_until_stopped(service_name, cfg, factory, instance=inst)
        finally:  # the process exits after this: the rest of a burst of stop signals is discarded
            if process_claimed():  # the service's own process (its main with no argv), not a caller's (a test's)
                ignore_stop_signals(asyncio.get_running_loop())

    # in-process (a test's main([...])): the caller's handlers back afterwards (uvloop leaves its own on the signals)
    saved = None if process_claimed() else [(sig, signal.getsignal(sig)) for sig in STOP_SIGNALS]
    coro = serve()
    try:
        if uvloop is not None:
            uvloop.run(coro)
        else:  # pragma: no cover
            asyncio.run(coro)
    finally:
        for sig, handler in saved or ():
            if handler is not None:  # (None: not set from Python; nothing to put back)
                signal.signal(sig, handler)


def run_service_main(service_name: str, cfg: CommonConfig, factory: ServiceFactory, *, instance: str | None = None) -> int:
    """:func:`run_service` for a service's ``main``: its exit status.

    Returns:
        0 after SIGINT/SIGTERM; 1 when the service failed (:class:`ServiceFailed`: a task or loop
        it needs ended, already logged at error with the traceback; or NATS refused its credentials), after one
        line on stderr (``<service>: <what failed>``, :func:`process_label`) in place of a Python traceback; the
        supervisor restarts it. 2 after one such line when ``--metrics-fd`` is no listening TCP socket (checked
        before anything starts, as the router's ``--listen-fd``) or when its NATS settings are unusable
        (:class:`~shared.auth.AuthError`: an unreadable credentials file, an empty server in ``EI_NATS_URL``'s
        list, servers with different credentials a URL cannot carry); before, those two cases ended in a Python
        traceback.
    """
    label = process_label(service_name, instance or instance_name(service_name, cfg))
    if cfg.metrics_fd >= 0:
        try:  # before NATS and the start: a bad descriptor is a configuration error, as the router's --listen-fd
            inherited_socket(cfg.metrics_fd, "--metrics-fd").detach()
        except OSError as e:
            print(f"{label}: {e.strerror or e}", file=sys.stderr)
            return 2
    try:
        run_service(service_name, cfg, factory, instance=instance)
    except ServiceFailed as e:
        print(str(e), file=sys.stderr)  # it names the process (process_label)
        return 1
    except AuthError as e:
        print(f"{label}: {e}", file=sys.stderr)
        return 2
    return 0
