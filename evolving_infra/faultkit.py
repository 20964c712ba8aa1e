"""Fault injection on a local cluster: every service its own OS process, started without a
supervisor, so that a test or a benchmark can kill, freeze and restart any one of them.

``evolving-infra up`` (``cluster.LocalCluster``) supervises its children; here nothing
restarts on its own — what the fault costs is what the services themselves recover.
Used by ``tests/e2e/test_faults.py`` and ``bench/faults_redispatch.py``::

    async with FaultCluster(FaultSpec(nodes=4, split="2P2D", routers=2), tmp) as fc:
        result = await fc.replay(requests, concurrency=8, routers=[0, 1])
        fc.signal("worker-w0", signal.SIGKILL)
        fc.restart("kvdirectory")

A :class:`Fault` is a timed action on one service (``kill``, ``stop`` = SIGSTOP then
SIGCONT after ``hold_s``, ``restart``); :func:`replay_with_faults` runs a replay of real
Claude Code sessions while the faults happen and returns the figures ``bench/RESULTS.md``
records per fault: requests sent / completed / re-dispatched / lost, time to fence and
to recover.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shared import messages as m
from shared.auth import router_names
from shared.bus import Bus, BusError
from shared.clock import SimClock
from shared.natsserver import EmbeddedNatsServer, die_with_parent, exit_text
from shared.split import parse_split
from shared.subjects import SVC_STATS, Subjects


NATS = "nats-server"
"""The name a :class:`Fault` gives the embedded nats-server."""


class FaultError(RuntimeError):
    """A service did not come up, or a fault names an unknown service."""


@dataclass(frozen=True)
class FaultSpec:
    """The cluster a fault test runs on.

    Attributes:
        nodes: worker processes (``w0`` …).
        split: ``collocated`` or ``xPyD`` (x + y = nodes).
        routers: router processes (``router``, ``router-1``, …), all on one NATS partition.
        speedup: simulated seconds per wall second.
        profile: node profile (shared name or TOML path).
        block_size: tokens per KV block.
        fence_after_s: wall seconds without a node.state before a node is dead: the routers' ``--fence-after-s``
            (fenced) and the planner's ``--silent-after-s`` (splits laid over the live nodes, the policies value
            the live nodes only), one liveness time as ``up --fence-after-s`` gives them. Before, the planner kept
            its default 3 s while the routers fenced at 1.5 s.
        idle_state_interval_s: worker: wall seconds between liveness states.
        extra: extra flags per service name prefix (``worker``, ``router``, ``kvdirectory``, ``planner``).
    """

    nodes: int = 4
    split: str = "2P2D"
    routers: int = 1
    speedup: float = 50.0
    profile: str = "gb300-glm52"
    block_size: int = 64
    fence_after_s: float = 1.5
    idle_state_interval_s: float = 0.25
    extra: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class _Proc:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None


class FaultCluster:
    """nats-server + kvdirectory + planner + workers + routers, as separate processes.

    Args:
        spec: what to start.
        workdir: logs (``<name>.log``) and router port files go here.

    Raises:
        FaultError: from :meth:`start` when the cluster is not healthy within 90 s.
    """

    def __init__(self, spec: FaultSpec, workdir: Path) -> None:
        self.spec = spec
        self.workdir = Path(workdir)
        self.nats: EmbeddedNatsServer | None = None
        self.nats_url = ""
        self.origin = 0.0
        self.procs: dict[str, _Proc] = {}
        self.bus: Bus | None = None

    async def __aenter__(self) -> FaultCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def clock(self) -> SimClock:
        return SimClock(self.spec.speedup, self.origin)

    def router_names(self) -> list[str]:
        return router_names(self.spec.routers)

    def router_url(self, i: int = 0) -> str:
        """HTTP base URL of router ``i`` (read from its port file)."""
        port = (self.workdir / f"{self.router_names()[i]}.port").read_text().strip()
        return f"http://127.0.0.1:{port}"

    def _common(self, instance: str) -> list[str]:
        return ["--nats-url", self.nats_url, "--partition", "p0", "--instance", instance, "--speedup", repr(self.spec.speedup),
                "--clock-origin", repr(self.origin), "--log-level", "info", "--log-format", "json"]  # fmt: skip

    def _plan(self) -> None:
        s = self.spec
        py = [sys.executable, "-m"]
        nodes = [f"w{i}" for i in range(s.nodes)]
        pd = parse_split(s.split, s.nodes)
        phases = ["both"] * s.nodes if pd is None else ["prefill"] * pd[0] + ["decode"] * pd[1]

        def add(name: str, module: str, args: list[str]) -> None:
            extra = [a for prefix, flags in s.extra.items() if name.startswith(prefix) for a in flags]
            self.procs[name] = _Proc(name, py + [module] + self._common(name) + args + extra, self.workdir / f"{name}.log")

        # --routers: after a start (a restart among the faults) it waits for each router's republish, not a quiet period
        add("kvdirectory", "services.kvdirectory", ["--block-size", str(s.block_size), "--routers", ",".join(self.router_names())])
        add("planner", "services.planner", ["--nodes", ",".join(nodes), "--split", s.split, "--silent-after-s", repr(s.fence_after_s)])
        for node, phase in zip(nodes, phases):
            add(f"worker-{node}", "services.worker", ["--node", node, "--profile", s.profile, "--phase", phase,
                                                      "--idle-state-interval-s", repr(s.idle_state_interval_s)])  # fmt: skip
        for name in self.router_names():
            add(name, "services.router", ["--port", "0", "--port-file", str(self.workdir / f"{name}.port"), "--block-size",
                                          str(s.block_size), "--fence-after-s", repr(s.fence_after_s), "--split-get-timeout-s", "5"])  # fmt: skip

    def _spawn(self, p: _Proc) -> None:
        with open(p.log, "ab") as log:
            p.proc = subprocess.Popen(p.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent())  # a killed test run leaves no service behind

    async def start(self) -> None:
        """Start everything and wait until every router answers ``/healthz`` with 200."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.nats = EmbeddedNatsServer().start()
        self.nats_url = self.nats.url
        self.origin = time.time()
        self.bus = await Bus.connect(self.nats_url, Subjects("p0"), service="faultkit", instance="faultkit")
        self._plan()
        for p in self.procs.values():
            self._spawn(p)
        try:
            await self.wait_healthy(90.0)
        except BaseException:
            await self.stop()
            raise

    async def wait_healthy(self, timeout_s: float) -> None:
        """Wait until every router's ``/healthz`` answers 200.

        Raises:
            FaultError: a service exited, or not healthy in ``timeout_s`` (wall s).
        """
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            for i, name in enumerate(self.router_names()):
                while True:
                    for p in self.procs.values():
                        if p.proc is not None and p.proc.poll() is not None:
                            raise FaultError(f"{p.name} {exit_text(p.proc.returncode)}: {self.log_tail(p.name)}")
                    if (self.workdir / f"{name}.port").exists():
                        try:
                            if (await http.get(self.router_url(i) + "/healthz")).status_code == 200:
                                break
                        except (httpx.HTTPError, ValueError):
                            pass
                    if time.monotonic() > deadline:
                        raise FaultError(f"{name} not healthy after {timeout_s:.0f} s (logs in {self.workdir})")
                    await asyncio.sleep(0.1)

    def log_tail(self, name: str, chars: int = 2000) -> str:
        try:
            return self.procs[name].log.read_text(errors="replace")[-chars:]
        except (KeyError, OSError):
            return ""

    def pid(self, name: str) -> int:
        """Pid of service ``name`` (``nats-server``: the embedded server's)."""
        if name == NATS:
            if self.nats is None or self.nats.pid is None:
                raise FaultError("nats-server is not running")
            return self.nats.pid
        p = self.procs.get(name)
        if p is None or p.proc is None:
            raise FaultError(f"no service {name!r}; known: {sorted(self.procs) + [NATS]}")
        return p.proc.pid

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to service ``name`` (reaped at once after SIGKILL)."""
        os.kill(self.pid(name), sig)
        proc = self.nats.proc if name == NATS and self.nats is not None else self.procs[name].proc
        if sig == signal.SIGKILL and proc is not None:
            proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        """Start service ``name`` again with the same arguments (after it was killed); ``nats-server`` on its port."""
        if name == NATS:
            assert self.nats is not None
            self.nats.restart()
            return
        p = self.procs[name]
        if p.proc is not None and p.proc.poll() is None:
            raise FaultError(f"{name} is still running")
        self._spawn(p)

    async def stats(self, instance: str, timeout_s: float = 3.0) -> m.StatsReply | None:
        """``svc.stats.<instance>`` (None when it does not answer)."""
        assert self.bus is not None
        try:
            return await self.bus.request(SVC_STATS, m.StatsRequest(), instance=instance, timeout=timeout_s)
        except BusError:
            return None

    async def stop(self) -> None:
        """SIGCONT + SIGTERM everything still running, SIGKILL what is left after 10 s, stop NATS."""
        if self.nats is not None and self.nats.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self.nats.pid, signal.SIGCONT)
        for p in self.procs.values():
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
                p.proc.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            if p.proc is None:
                continue
            while p.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        if self.bus is not None:
            await self.bus.close()
            self.bus = None
        if self.nats is not None:
            self.nats.stop()
            self.nats = None


@dataclass(frozen=True)
class Fault:
    """A timed fault: ``action`` on service ``target`` ``at_s`` wall seconds into the replay.

    ``kill`` = SIGKILL; ``stop`` = SIGSTOP, then SIGCONT ``hold_s`` later; ``restart`` = SIGKILL,
    then the same command again ``hold_s`` later. ``target``: a service (``worker-w0``, ``router``,
    ``kvdirectory`` ...) or ``nats-server``.
    """

    action: str
    target: str
    at_s: float
    hold_s: float = 0.0


@dataclass
class FaultRun:
    """What a replay under faults cost.

    Attributes:
        sent / completed / lost: requests (lost = sent - completed: failed or never answered).
        redispatched: requests the routers re-dispatched (their ``redispatched`` counters).
        fence_s: wall s from the fault to the first router's fence of the node (None: no fence).
        recover_s: wall s from the first fault until every request in flight at that moment
            has completed (the longest a fault's victim waited, fence time included).
        failures: (status, error) of every failed request.
        router_counters: each router's counters at the end.
    """

    sent: int
    completed: int
    lost: int
    redispatched: int
    fence_s: float | None
    recover_s: float | None
    wall_s: float
    wrong_length: int = 0
    """Completed requests whose output length differs from the trace's (a repeated or lost token)."""
    failures: list[tuple[int, str]] = field(default_factory=list)
    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per router (its clients' share of the agents): sent, completed, lost, and of the lost
    ``refused`` (the router was gone when the request was sent: a client would reconnect to
    another router) and ``broken`` (a stream open on it when it died, or any other failure)."""
    router_counters: dict[str, dict[str, int]] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {"sent": self.sent, "completed": self.completed, "redispatched": self.redispatched, "lost": self.lost,
                "fence_s": self.fence_s, "recover_s": self.recover_s, "wrong_length": self.wrong_length,
                "wall_s": round(self.wall_s, 2)}  # fmt: skip


def demo_requests(agents: int, *, max_per_agent: int | None = None, pauses: bool = False) -> tuple[list[Any], int]:
    """The first ``agents`` sessions of the shipped Claude Code sample (and its block size);
    ``max_per_agent`` keeps only each session's first requests (a session's later requests
    depend on its earlier ones only); ``pauses=False`` drops the tool-call pauses between a
    session's requests (the load stays on the cluster while the faults happen)."""
    import msgspec

    from evolving_infra.launcher import demo_trace_path
    from evolving_infra.traces.io import read_trace

    trace = read_trace(demo_trace_path())
    keep = list(dict.fromkeys(r.agent for r in trace.requests))[:agents]
    chosen = set(keep)
    out: list[Any] = []
    seen: dict[str, int] = {}
    for r in trace.requests:
        if r.agent not in chosen:
            continue
        seen[r.agent] = seen.get(r.agent, 0) + 1
        if max_per_agent is None or seen[r.agent] <= max_per_agent:
            out.append(r if pauses else msgspec.structs.replace(r, pause_s=0.0))
    return out, trace.header.block_size


async def replay_with_faults(
    fc: FaultCluster,
    requests: Sequence[Any],
    faults: Sequence[Fault],
    *,
    concurrency: int = 8,
    block_size: int = 64,
    routers: Sequence[int] = (0,),
    request_timeout_s: float = 120.0,
) -> FaultRun:
    """Replay ``requests`` (closed loop, ``concurrency`` agents split over ``routers``) while
    ``faults`` happen; return what it cost (:class:`FaultRun`).

    The fence time is read from the routers' ``fenced`` counter (polled every 50 ms).
    """
    from evolving_infra.replay.core import Arrival
    from evolving_infra.replay.live import LiveReplayer

    agents = list(dict.fromkeys(r.agent for r in requests))
    groups = [[a for j, a in enumerate(agents) if j % len(routers) == k] for k in range(len(routers))]
    t0 = time.monotonic()
    names = fc.router_names()

    async def fence_counts() -> tuple[int, int]:
        """(fenced, unfenced) summed over the routers, from one stats request each."""
        fenced = unfenced = 0
        for i in routers:
            st = await fc.stats(names[i], timeout_s=0.5)
            if st is not None:
                fenced += st.counters.get("fenced", 0)
                unfenced += st.counters.get("unfenced", 0)
        return fenced, unfenced

    async def fenced_total() -> int:
        return (await fence_counts())[0]

    fence_at: list[float] = []
    fault_at: list[float] = []

    async def inject() -> None:
        base = await fenced_total()
        for f in sorted(faults, key=lambda f: f.at_s):
            await asyncio.sleep(max(0.0, t0 + f.at_s - time.monotonic()))
            fault_at.append(time.monotonic())
            if f.action == "kill":
                fc.signal(f.target, signal.SIGKILL)
            elif f.action == "stop":
                fc.signal(f.target, signal.SIGSTOP)
            elif f.action == "restart":
                fc.signal(f.target, signal.SIGKILL)
            else:
                raise FaultError(f"unknown fault action {f.action!r}")
            if f.action in ("stop", "restart"):
                end = time.monotonic() + f.hold_s
                while time.monotonic() < end:
                    if not fence_at and f.target.startswith("worker") and await fenced_total() > base:
                        fence_at.append(time.monotonic())
                    await asyncio.sleep(0.05)
                if f.action == "stop":
                    fc.signal(f.target, signal.SIGCONT)
                    if f.target.startswith("worker") and fence_at:
                        # the counters are read when the replay ends: give the resumed worker's
                        # state (at most 10 s) to reach the routers, so a let-back-in is counted
                        back = time.monotonic() + 10.0
                        while time.monotonic() < back:
                            fenced, unfenced = await fence_counts()
                            if unfenced >= fenced:
                                break
                            await asyncio.sleep(0.05)
                else:
                    fc.restart(f.target)
        while not fence_at and any(f.target.startswith("worker") for f in faults) and time.monotonic() - fault_at[0] < 30:
            if await fenced_total() > base:
                fence_at.append(time.monotonic())
                break
            await asyncio.sleep(0.05)

    async def one(i: int, group: list[str]) -> Any:
        keep = set(group)
        rep = LiveReplayer(fc.router_url(i), fc.clock, block_size=block_size, request_timeout_s=request_timeout_s, progress=False)
        return await rep.run([r for r in requests if r.agent in keep], Arrival(kind="closed", concurrency=max(1, concurrency // len(routers))))

    injector = asyncio.create_task(inject())
    used = [(i, g) for i, g in zip(routers, groups) if g]
    results = await asyncio.gather(*(one(i, g) for i, g in used))
    await injector
    wall = time.monotonic() - t0
    records = [r for res in results for r in res.records]
    completed = [r for r in records if r.ok]
    failures = [(int(r.status or 0), str(r.error or "")[:200]) for r in records if not r.ok]
    counters: dict[str, dict[str, int]] = {}
    for i in routers:
        st = await fc.stats(names[i])
        if st is not None:
            counters[names[i]] = dict(st.counters)
    recover = None
    if fault_at:  # every request in flight at the first fault has completed (simulated → wall s)
        t_fault = fc.clock.now() - (time.monotonic() - fault_at[0]) * fc.spec.speedup
        victims = [r.finished_at for r in completed if r.finished_at is not None and r.sent_at <= t_fault < r.finished_at]
        if victims:
            recover = round((max(victims) - t_fault) / fc.spec.speedup, 3)
    by_group: dict[str, dict[str, int]] = {}
    for (i, _g), res in zip(used, results):
        bad = [r for r in res.records if not r.ok]
        refused = sum(1 for r in bad if (r.error or "").startswith("ConnectError"))
        by_group[names[i]] = {"sent": len(res.records), "completed": len(res.records) - len(bad), "lost": len(bad),
                              "refused": refused, "broken": len(bad) - refused}  # fmt: skip
    return FaultRun(
        groups=by_group,
        sent=len(records),
        completed=len(completed),
        lost=len(records) - len(completed),
        redispatched=sum(c.get("redispatched", 0) for c in counters.values()),
        fence_s=round(fence_at[0] - fault_at[0], 3) if fence_at and fault_at else None,
        recover_s=recover,
        wall_s=wall,
        wrong_length=sum(1 for r in completed if r.expected_completion_tokens and r.completion_tokens != r.expected_completion_tokens),
        failures=failures,
        router_counters=counters,
    )
