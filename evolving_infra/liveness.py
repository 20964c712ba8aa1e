"""Liveness decisions of a supervisor, shared by ``evolving-infra up`` (:class:`evolving_infra.cluster.LocalCluster`)
and the Slurm job's watcher (``deploy/slurm/evolving-infra.sbatch``: ``python -m evolving_infra.liveness``).

The decisions are sans-IO (each takes ``now``, a ``time.monotonic()`` or a test's clock): :func:`liveness_overdue`
(is a running process silent past its limit), :func:`bus_watch` (can the services' heartbeats be seen now: the
supervisor's own NATS connection answers its PINGs), :func:`probe_seen_until` (nats-server judged up to its latest
finished probe), :func:`paused` (the supervisor itself was not running: every clock starts again) and
:func:`count_exit` (exits within a window). :func:`nats_info_probe` is nats-server's sign of life.

The watcher (:func:`main`, :class:`Watch`) is how the Slurm job's head services get ``up``'s liveness watch: its bash
``supervise`` loop writes each child's pid to ``$EI_RUN_DIR/pids/NAME.pid`` (``PID SUPERVISOR_PID``); the watcher
connects to the job's NATS with the ``launcher`` credentials, notes each service's heartbeat from that pid and
nats-server's INFO line, and SIGKILLs a silent one (checked to be that loop's child still); the loop restarts it as
after a crash, and counts it against ``MAX_RESTARTS`` within ``RESTART_WINDOW_S``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared import messages as m
from shared.auth import NatsAuth
from shared.bus import Bus
from shared.natsping import Ping
from shared.signals import STOP_SIGNALS, ignore_stop_signals
from shared.subjects import SVC_HEARTBEAT, Subjects

NATS_PROBE_TIMEOUT_S = 2.0
"""Wall seconds one liveness probe (nats-server's INFO line, the supervisor's NATS PING) may take."""

BUS_SILENT_AFTER_S = 5.0
"""Wall seconds after the supervisor's NATS connection last answered a PING past which the services' heartbeats
cannot be seen (the bus is down or hung): no service is judged silent then."""

LIVENESS_MIN_S = 10.0
"""The least liveness timeout other than 0 (off) accepted: a service beats every second, one round of the
supervisor's probes (nats-server's INFO line, up to 2 x :data:`NATS_PROBE_TIMEOUT_S`, a PING up to one more, then a
1-s sleep) takes up to ~7 s under load, and a service closing its NATS connection drains up to 5 s: a shorter timeout
SIGKILLs healthy processes."""

SUPERVISE_GAP_S = 3.0
"""Wall seconds between two supervision passes (one every 0.2 s) past which the supervisor itself was not running
(``up`` stopped by Ctrl-Z, a paused VM, a blocked event loop): after such a gap every liveness clock starts again
(nothing is judged silent for a time nobody watched), as after a start. Only the first of late passes in a row does
so, or one later than the liveness timeout (:func:`paused`). ``up`` measures a gap from the end of its previous pass:
the time that pass spent restarting nats-server (up to 10 s) is no pause."""


def liveness_overdue(
    now: float, *, started_at: float, last_ok: float | None, watch_from: float | None, timeout_s: float, start_timeout_s: float
) -> float | None:
    """Whether a running process has been silent too long: the supervisor's liveness decision, on one clock.

    Args:
        now: the current time (s, ``time.monotonic()`` or a test's clock).
        started_at: when the process was (last) started.
        last_ok: when its latest sign of life came (a heartbeat, a probe answered); None or before ``started_at``:
            none since this start (it is still starting: its limit is ``max(timeout_s, start_timeout_s)``).
        watch_from: since when its signs of life could be seen (the supervisor's NATS connection answering); None:
            they cannot be seen now, and nothing is decided.
        timeout_s: the liveness timeout (s); 0 or less = off.
        start_timeout_s: the start-up's own limit (``ready_timeout_s``).

    Returns:
        The seconds it has been silent (counted from the latest of ``last_ok``, ``started_at`` and ``watch_from``)
        when that is past its limit; None when it is not (or nothing is decided).
    """
    if timeout_s <= 0 or watch_from is None:
        return None
    answered = last_ok is not None and last_ok >= started_at
    since = max(last_ok if answered and last_ok is not None else started_at, watch_from)
    limit = timeout_s if answered else max(timeout_s, start_timeout_s)
    silent = now - since
    return silent if silent > limit else None


def count_exit(exits: list[float], now: float, window_s: float) -> int:
    """Record an exit at ``now`` in ``exits`` (times, s), drop those older than ``window_s``, and return how many
    are left: the restarts ``max_restarts`` compares within its window (systemd's ``StartLimitIntervalSec``)."""
    exits.append(now)
    exits[:] = [t for t in exits if now - t < window_s]
    return len(exits)


def paused(last_pass: float | None, now: float, *, late: bool = False, timeout_s: float = 0.0) -> bool:
    """Whether the supervisor itself was not running between its previous pass (``last_pass``; None: none yet) and
    ``now``: a gap over :data:`SUPERVISE_GAP_S`, after which every liveness clock starts again.

    ``late``: the previous pass came after such a gap too. Passes late in a row (the supervisor starved of CPU, a pass
    every 3.1 s) still watch: after the first, only a gap over ``timeout_s`` (the liveness timeout, s) is a pause.
    Restarting the clocks at each of them, a hung process never reached the timeout and was never killed."""
    if last_pass is None or now - last_pass <= SUPERVISE_GAP_S:
        return False
    return not late or now - last_pass > timeout_s


def bus_watch(now: float, last_ok: float | None, ok_since: float | None) -> tuple[float | None, float]:
    """Whether the services' heartbeats (which come over NATS) can be seen at ``now``, and up to when.

    Args:
        now: the current time (s).
        last_ok: when the supervisor's own NATS connection last answered a PING (None: never).
        ok_since: the previous pass's answer (since when it has answered without a gap; None: not then).

    Returns:
        ``(ok_since, seen_until)``: since when the connection has answered without a gap (``now`` when it answers
        again; None while it has not answered within :data:`BUS_SILENT_AFTER_S`: nothing is judged), and the time up
        to which a service's silence counts (its latest answer: a silence after it may be the bus's own).
    """
    if last_ok is None or now - last_ok > BUS_SILENT_AFTER_S:
        ok_since = None
    elif ok_since is None:
        ok_since = now
    return ok_since, (now if last_ok is None else min(now, last_ok))


def probe_seen_until(now: float, tried_at: float | None) -> float | None:
    """The time up to which nats-server's silence counts: the start of its latest probe that came to an end (answered
    or not; ``tried_at``), never past ``now``; None: no probe has ended yet (nothing is decided)."""
    return None if tried_at is None else min(now, tried_at)


async def nats_info_probe(port: int, timeout_s: float = NATS_PROBE_TIMEOUT_S, host: str = "127.0.0.1") -> bool:
    """Whether a nats-server answers on ``host:port`` within ``timeout_s``: it sends a new connection its
    ``INFO {...}`` line (before any login, so no credentials are needed and no failed login is logged). A stopped
    (SIGSTOP) or hung server accepts in the kernel but sends nothing: False. Never raises."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        return line.startswith(b"INFO ")
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), timeout_s)


ANSWERED = "answered"
"""A :meth:`BusProbe.round` whose PING's PONG came: the services' heartbeats can be seen up to now."""
UNANSWERED = "unanswered"
"""A :meth:`BusProbe.round` with no PONG (not connected, refused, lost to a reconnect, not answered yet)."""
DEAF = "deaf"
"""A :meth:`BusProbe.round` that found the supervisor's own client deaf and made it reconnect: what it heard before
says nothing of the services since (their heartbeats were not read); their clocks start again at its next answer."""


class BusProbe:
    """The supervisor's PING through its own NATS connection, one round at a time: ``up``'s liveness probe
    (``LocalCluster._probe``, :mod:`evolving_infra.cluster`) and the Slurm job's watcher's (:meth:`Watcher.probe`).

    The PING is never cancelled while nats-py holds it (``Bus.ping``, ``shared.natsping``): a ``wait_for`` around
    ``flush`` cancelled its PONG's future at the deadline, and a PONG that came later ended nats-py's read loop (the
    connection deaf: every later PING "answered" at once, no heartbeat heard again;
    ``tests/integration/test_liveness_watcher_late_pong_live.py``). One not answered within a round's wait is waited
    for again in the next round, until its PONG comes or a reconnect loses it.

    A client found deaf (connected, its read loop or flusher ended: ``shared.natsping.deaf``) is made to reconnect at
    once (``Bus.reconnect_deaf``, as the router's NATS probe does), whether its PING ended ``DeafClient`` or one sent
    before the read loop ended waits for a PONG nats-py can no longer read. Before, the supervisor's client stayed
    deaf until nats-py's own PINGs (every 2 min, two unanswered) called it stale, or for good while such a PING was
    waited for: no heartbeat heard, no service judged, a hung one never killed
    (``tests/integration/test_liveness_deaf_probe_live.py``).

    Attributes:
        ping: the PING waited for (None: none; the next round sends one when the client is connected).
        deaf_reconnects: how many times a round made the deaf client reconnect.
    """

    def __init__(self) -> None:
        self.ping: Ping | None = None
        self.deaf_reconnects = 0

    async def round(self, bus: Bus, timeout_s: float = NATS_PROBE_TIMEOUT_S) -> str:
        """One round: send a PING on ``bus`` when none is waited for and the client is connected, then wait at most
        ``timeout_s`` seconds for its PONG; a deaf client is made to reconnect.

        Returns:
            :data:`ANSWERED` when its PONG came in this round; :data:`DEAF` when the client was found deaf and made to
            reconnect (the caller stops counting the services' silence until the next answer); :data:`UNANSWERED`
            otherwise (not connected, refused, lost to a reconnect, or not answered yet: then waited for again at the
            next round). Never raises for the bus's state.
        """
        if self.ping is None and bus.nc.is_connected:
            self.ping = bus.ping()
        if self.ping is None:
            return UNANSWERED
        got = await self.ping.wait(timeout_s)
        if got is not None:
            self.ping = None  # (not answered: refused, lost to a reconnect; the beats cannot be seen now)
        if got:
            return ANSWERED
        if await bus.reconnect_deaf():  # its PING ended DeafClient, or one in flight can no longer be answered
            self.close()  # forgotten by the reconnect: cancelled at the bus's next PING, or at its close
            self.deaf_reconnects += 1
            return DEAF
        return UNANSWERED

    def close(self) -> None:
        """Stop watching the PING waited for: left to its PONG while nats-py holds it (the bus's close cancels it)."""
        if self.ping is not None:
            self.ping.drop()
            self.ping = None


NATS = "nats"
"""The name the Slurm job gives its nats-server (``$EI_RUN_DIR/pids/nats.pid``): judged by its INFO line, not a beat."""


def process_identity(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of a live process ``pid`` (``/proc/PID/stat``); None: no such
    process, or a zombie (exited, not reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def process_age_s(start_ticks: int) -> float:
    """Seconds since a process started, from its ``/proc/PID/stat`` start time (``start_ticks``, clock ticks since
    boot: :func:`process_identity`), on ``CLOCK_BOOTTIME`` (the clock that start time counts on); never below 0."""
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))


def read_pid_file(path: Path) -> tuple[int, int] | None:
    """``(pid, supervisor pid)`` from a ``supervise`` pid file (``PID SUPERVISOR_PID``); None: missing or unreadable
    (a file being written is read again at the next pass)."""
    try:
        pid, parent = path.read_text().split()
        return int(pid), int(parent)
    except (OSError, ValueError):
        return None


@dataclass
class Watched:
    """One watched process of a service: its pid and start time (its identity: a pid taken again by another process
    is another one), when the watcher first saw it, its latest sign of life, whether the watcher killed it."""

    pid: int
    start_ticks: int
    started_at: float
    watch_from: float
    last_ok: float | None = None
    killed: bool = False


@dataclass
class Watch:
    """The watcher's liveness decisions over named processes, sans-IO (every method takes ``now``, monotonic s):
    :meth:`observe` what runs now, :meth:`on_beat` / :meth:`nats_probed` / :meth:`bus_answered` its signs of life,
    :meth:`overdue` which to kill. A service's heartbeat counts from its running pid only; a service is judged only
    while the watcher's own NATS connection answers (:func:`bus_watch`), nats-server only up to its latest finished
    probe (:func:`probe_seen_until`), and nothing across a pause of the watcher itself (:func:`paused`).

    Args (fields):
        timeout_s: liveness timeout (wall s; 0 = off).
        start_timeout_s: the limit before a process's first sign of life (``max`` with ``timeout_s``).
    """

    timeout_s: float
    start_timeout_s: float
    procs: dict[str, Watched | None] = field(default_factory=dict)
    """Name -> its running process as last observed (None: not running)."""
    bus_last_ok: float | None = None
    bus_ok_since: float | None = None
    nats_tried_at: float | None = None
    last_pass: float | None = None
    late: bool = False
    """The previous pass came more than :data:`SUPERVISE_GAP_S` after the one before (:func:`paused`'s ``late``)."""

    def observe(self, name: str, ident: tuple[int, int] | None, now: float, *, age_s: float | None = None) -> None:
        """Note that ``name`` runs as ``ident`` (``(pid, start ticks)``; None: not running now). A new identity is a
        new process: its clocks start at ``now``, or from its real start when ``age_s`` (the process's age at ``now``,
        s: ``/proc/PID/stat``'s start time, :func:`process_age_s`) is given.

        A process first seen with an age is judged as one watched since its start: one past its start-up allowance
        (``max(timeout_s, start_timeout_s)``) at ``now`` should have beaten by then, so it gets ``timeout_s`` from
        ``now`` (the watcher saw no beat before it watched); one still starting keeps the rest of its allowance, and
        never less than ``timeout_s`` from ``now``. Before, every process first seen (all of them when the watch
        itself started or restarted) got the whole start-up allowance from ``now``: an already-hung service was
        killed only after up to 300 s (READY_TIMEOUT)."""
        procs = self.procs
        cur = procs.get(name)
        if ident is None:
            procs[name] = None
        elif cur is None or (cur.pid, cur.start_ticks) != ident:
            w = Watched(pid=ident[0], start_ticks=ident[1], started_at=now, watch_from=now)
            if age_s is not None and age_s > 0:
                allowance = max(self.timeout_s, self.start_timeout_s)
                if allowance - age_s <= self.timeout_s:
                    w.last_ok = now  # past (or nearly past) its start-up: silent from now, its limit timeout_s
                else:
                    w.started_at = w.watch_from = now - age_s  # still starting: the rest of its allowance
            procs[name] = w

    def on_beat(self, name: str, pid: int, now: float) -> None:
        """A heartbeat of instance ``name`` from process ``pid`` at ``now``: a sign of life of the running one only."""
        cur = self.procs.get(name)
        if cur is not None and cur.pid == pid:
            cur.last_ok = now

    def nats_probed(self, tried_at: float, answered_at: float | None) -> None:
        """A probe of nats-server started at ``tried_at`` came to an end, answered at ``answered_at`` (None: not)."""
        self.nats_tried_at = tried_at
        cur = self.procs.get(NATS)
        if answered_at is not None and cur is not None:
            cur.last_ok = answered_at

    def bus_answered(self, now: float) -> None:
        """The watcher's own NATS connection answered a PING at ``now``."""
        self.bus_last_ok = now

    def bus_deaf(self) -> None:
        """The watcher's own NATS client was found deaf (it read no heartbeat for a while) and made to reconnect: the
        services are judged again from its next answered PING, with a whole timeout from then (:func:`bus_watch`)."""
        self.bus_last_ok = None
        self.bus_ok_since = None

    def overdue(self, now: float) -> list[tuple[str, int, float]]:
        """One pass: ``(name, pid, silent s)`` of each running process silent past its limit, marked killed (not
        named again); after a pause of the watcher itself every clock starts again and nothing is named. Passes late
        in a row (the watcher starved of CPU) are one pause, not one each: a hung service is still killed."""
        procs = self.procs
        gap = paused(self.last_pass, now, late=self.late, timeout_s=self.timeout_s)
        self.late = self.last_pass is not None and now - self.last_pass > SUPERVISE_GAP_S
        self.last_pass = now
        if gap:
            for p in procs.values():
                if p is not None:
                    p.watch_from = now
            self.bus_ok_since = None
        self.bus_ok_since, bus_seen_until = bus_watch(now, self.bus_last_ok, self.bus_ok_since)
        out = []
        for name, p in procs.items():
            if p is None or p.killed:
                continue
            if name == NATS:
                seen_until = probe_seen_until(now, self.nats_tried_at)
                watch_from: float | None = p.watch_from
            else:
                seen_until = bus_seen_until
                watch_from = None if self.bus_ok_since is None else max(self.bus_ok_since, p.watch_from)
            if seen_until is None:
                continue
            silent = liveness_overdue(seen_until, started_at=p.started_at, last_ok=p.last_ok, watch_from=watch_from,
                                      timeout_s=self.timeout_s, start_timeout_s=self.start_timeout_s)  # fmt: skip
            if silent is not None:
                p.killed = True
                out.append((name, p.pid, silent))
        return out


def say(text: str) -> None:
    """One line of the job's output, as the job script's ``log`` writes it."""
    print(f"[evolving-infra {time.strftime('%H:%M:%S')}] {text}", flush=True)


class Watcher:
    """The Slurm job's watcher process: :class:`Watch` over the head services' pid files, fed by the job's NATS."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.pid_dir = Path(args.pid_dir)
        self.names: list[str] = args.services
        self.nats_port: int | None = args.nats_port
        self.creds: str = args.creds
        self.watch = Watch(timeout_s=args.timeout_s, start_timeout_s=args.start_timeout_s)
        self.bus: Bus | None = None

    def current(self, name: str) -> tuple[int, int] | None:
        """``(pid, start ticks)`` of ``name``'s running process: its pid file's pid, alive and still the child of
        the ``supervise`` loop named there; None otherwise (exited, being restarted, the file not written yet)."""
        got = read_pid_file(self.pid_dir / f"{name}.pid")
        if got is None:
            return None
        pid, parent = got
        ident = process_identity(pid)
        if ident is None or ident[0] != parent:
            return None
        return pid, ident[1]

    async def connect(self) -> None:
        """Connect to the job's NATS (``EI_NATS_URL``, ``EI_PARTITION``) as ``launcher`` and note every heartbeat;
        retried forever (nats-server may be restarting), the INFO probes go on meanwhile."""
        auth = NatsAuth.from_file(self.creds) if self.creds else None
        url = os.environ.get("EI_NATS_URL", "")
        bus = await Bus.connect(url, Subjects(os.environ.get("EI_PARTITION", "p0")), service="launcher", instance="launcher",
                                auth=auth)  # fmt: skip

        async def on_beat(hb: m.Heartbeat, _subject: str) -> None:
            self.watch.on_beat(hb.instance, hb.pid, time.monotonic())

        await bus.subscribe(SVC_HEARTBEAT, on_beat)
        self.bus = bus

    async def probe(self, interval_s: float = 1.0) -> None:
        """Every ``interval_s``: nats-server's INFO line (when the job runs it), then a PING through the watcher's
        own connection (each at most :data:`NATS_PROBE_TIMEOUT_S`; a PING not answered by then is waited for again
        in the next round, until its PONG comes or a reconnect loses it).

        The PING is never cancelled while nats-py holds it (``Bus.ping``, ``shared.natsping``). Before, it was
        ``wait_for(nc.flush(), NATS_PROBE_TIMEOUT_S)``: the PONG's future was cancelled at the deadline, and a PONG
        that came later (nats-server hung a few seconds) ended nats-py's read loop: the watcher heard no heartbeat
        again while its flush returned at once (no PING sent), so every head service looked silent on a healthy bus
        and was SIGKILLed after the liveness timeout (``tests/integration/test_liveness_watcher_late_pong_live.py``)."""
        probe = BusProbe()
        try:
            while True:
                if self.nats_port is not None and NATS in self.names:
                    tried = time.monotonic()
                    ok = await nats_info_probe(self.nats_port)
                    self.watch.nats_probed(tried, time.monotonic() if ok else None)
                if self.bus is not None:
                    got = await probe.round(self.bus)
                    if got == ANSWERED:
                        self.watch.bus_answered(time.monotonic())
                    elif got == DEAF:
                        self.watch.bus_deaf()
                await asyncio.sleep(interval_s)
        finally:
            probe.close()

    def kill(self, name: str, pid: int, silent: float) -> None:
        """SIGKILL ``name``'s process ``pid`` if it is still the one its ``supervise`` loop runs (the loop restarts it)."""
        cur, watched = self.current(name), self.watch.procs.get(name)
        if cur is None or watched is None or cur != (pid, watched.start_ticks):
            return
        why = "no INFO on its port" if name == NATS else "no heartbeat"
        say(f"{name} silent for {silent:.0f} s ({why}); SIGKILL to pid {pid}, its supervise loop restarts it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    async def run(self, interval_s: float = 0.2) -> None:
        connecting = asyncio.create_task(self.connect(), name="liveness-connect")
        prober = asyncio.create_task(self.probe(), name="liveness-probe")
        say(f"liveness watch: {', '.join(self.names)} (SIGKILL after {self.watch.timeout_s:g} s silent)")
        try:
            while True:
                if connecting.done() and (exc := connecting.exception()) is not None:
                    raise exc
                now = time.monotonic()
                for name in self.names:
                    ident = self.current(name)
                    self.watch.observe(name, ident, now, age_s=None if ident is None else process_age_s(ident[1]))
                for name, pid, silent in self.watch.overdue(now):
                    self.kill(name, pid, silent)
                await asyncio.sleep(interval_s)
        finally:
            prober.cancel()
            connecting.cancel()


def main(argv: list[str] | None = None) -> int:
    """``python -m evolving_infra.liveness``: the Slurm job's liveness watch (internal: the job script starts it).

    Returns:
        2 for a bad argument (one line); runs until SIGTERM or SIGINT (0); 1 when it cannot watch (bad credentials).
    """
    p = argparse.ArgumentParser(prog="python -m evolving_infra.liveness",
                                description="The Slurm job's liveness watch over its head services (deploy/slurm).")
    p.add_argument("--pid-dir", required=True, help="folder of the supervise loops' NAME.pid files")
    p.add_argument("--services", required=True, type=lambda v: [n for n in v.split(",") if n],
                   help=f"instance names to watch, comma-separated ({NATS}: the job's nats-server, by its INFO line)")
    p.add_argument("--nats-port", type=int, default=None, help="the job's nats-server port on this node (with nats)")
    p.add_argument("--creds", default="", help="the launcher's credentials file (empty: NATS runs open)")
    p.add_argument("--timeout-s", type=float, required=True, help=f"liveness timeout, wall s: 0 (off) or >= {LIVENESS_MIN_S:g}")
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="limit before a process's first sign of life (s)")
    args = p.parse_args(argv)
    t = args.timeout_s
    if not math.isfinite(t) or t < 0 or 0 < t < LIVENESS_MIN_S:
        print(f"error: --timeout-s {t:g}: 0 (off) or at least {LIVENESS_MIN_S:g} wall s", file=sys.stderr)
        return 2
    if not os.environ.get("EI_NATS_URL"):
        print("error: no NATS server: set EI_NATS_URL", file=sys.stderr)
        return 2
    from shared.log import setup_logging

    setup_logging("console", "error")  # the bus client's own lines are not the job's output
    stop = asyncio.Event()

    async def watch() -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        task = asyncio.create_task(Watcher(args).run())
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        ignore_stop_signals(loop)  # stopping: the rest of a burst (plain scancel) is discarded, no -15 (d715992)
        waiter.cancel()
        if task.done():
            task.result()  # its error
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(watch())
    except Exception as e:
        print(f"error: liveness watch: {e!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
