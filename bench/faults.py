"""Fault injection on a live cluster: what a fault costs in requests and in recovery time.

Each run starts ``evolving-infra up`` (every service its own OS process, the embedded
nats-server, the supervisor) as a user would, replays real Claude Code sessions (the
sample shipped in ``evolving_infra/data/``) through its router, injects ONE fault
while requests are in flight, waits for the replay to finish and reports:

* requests sent / completed / lost (failed at the client: any non-200, error event or
  a stream that ended without tokens), with the first error texts; the replayer retries as agent
  harnesses do (``LiveReplayer``'s default ``RetryPolicy``: twice, a refusal before any answer), so a
  request that completed on a retry is not lost: ``retried`` counts those sent again;
* time to recover: from the fault to the moment the supervisor restarted the victim
  (its pid in ``LOG_DIR/cluster.json`` changed) and the router's ``/healthz`` said 200;
* whether ``up`` was still running at the end, and the supervisor's restart counts.

Faults are entries of :data:`FAULTS` (name -> async injector); add one by writing an
``async def inject(run: FaultRun) -> str | None`` (returns the service whose restart
marks recovery, or None when the cluster recovers without a restart) and registering it.

    python bench/faults.py                          # every fault, appends a section to bench/RESULTS-history.md
    python bench/faults.py --fault nats-kill --no-results
    python bench/faults.py --fault decode-worker-kill --policy static:2P2D   # the split served from the start
    python bench/faults.py --fault decode-worker-kill --engine torch         # the tiny random llama on CPU
    python bench/faults.py --fault decode-worker-kill --kv-pool real          # KV bytes moved between workers (Mooncake)
    python bench/faults.py --fault router-kill --fault router-term --routers 2   # `up --routers 2`: the other router serves
    python bench/faults.py --list

Under ``up``'s default policy (the evolving planner) every node serves collocated for the planner's 1,800-s warm-up,
36 wall s at ``--speedup 50``: a short replay never sees ``--split``, so ``prefill-worker-*`` / ``decode-worker-*``
then hit a collocated node; ``--policy static:2P2D`` makes w0/w1 prefill and w2/w3 decode from the start.

The live tests (``tests/e2e/test_faults_live.py``) call :func:`run_fault` with a small
replay; the numbers in ``bench/RESULTS.md`` come from this script's defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import msgspec  # noqa: E402

from evolving_infra.report.records import RequestRecord  # noqa: E402


@dataclass
class FaultRun:
    """A running ``evolving-infra up`` under fault injection."""

    proc: subprocess.Popen[bytes]
    info: dict[str, object]
    """The ``READY`` line of ``up`` (router_url, nats_url, log_dir, pids, restarts)."""
    log_dir: Path
    t_fault: float | None = None
    """``time.monotonic()`` when the fault was injected."""
    signalled: dict[str, int] = field(default_factory=dict)
    """Service -> the pid the fault signalled (recovery = a different pid in cluster.json)."""
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """Processes the fault started itself (a twin): killed when the run ends."""
    notes: dict[str, object] = field(default_factory=dict)
    """What the injector measured (a SIGTERM's exit time, the node seen parked, split exit statuses)."""
    frozen: set[str] = field(default_factory=set)
    """Services the fault SIGSTOPped (their own clocks ran on while they were frozen)."""
    frozen_s: dict[str, float] = field(default_factory=dict)
    """Service -> wall seconds it was frozen, SIGSTOP to SIGCONT (:meth:`thaw`; summed over freezes)."""
    _stopped_at: dict[str, float] = field(default_factory=dict)
    recover_s: float | None = None
    """Set by an injector that measures recovery itself while it runs (``switch-planner-kill``: the kill to the restarted
    planner's first answered ``split get``): :attr:`FaultResult.recover_s` is this, not the wait that starts once the
    injector has returned."""

    @property
    def router_url(self) -> str:
        return str(self.info["router_url"])

    def cluster_json(self) -> dict[str, object]:
        """The latest ``LOG_DIR/cluster.json`` (``up`` rewrites it after every restart)."""
        return json.loads((self.log_dir / "cluster.json").read_text())

    def pid(self, service: str) -> int:
        """Current pid of ``service`` (``router``, ``planner``, ``kvdirectory``, ``worker-w0`` ..., ``nats-server``)."""
        return int(self.cluster_json()["pids"][service])  # type: ignore[index]

    def kill(self, service: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to ``service``'s process; records the fault time. Returns the pid signalled."""
        pid = self.pid(service)
        self.t_fault = time.monotonic()
        self.signalled[service] = pid
        if sig == signal.SIGSTOP:
            self.frozen.add(service)
            self._stopped_at[service] = time.monotonic()
        os.kill(pid, sig)
        return pid

    def thaw(self, service: str, pid: int) -> None:
        """SIGCONT ``pid`` (``service``'s frozen process) and add the freeze's length to :attr:`frozen_s`. A process
        gone meanwhile (``up``'s liveness watch SIGKILLed it: ``--liveness-timeout-s`` shorter than the freeze) is
        counted in ``notes["thaw_gone"]``, not raised (it aborted the whole ``python bench/faults.py`` run)."""
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            self.notes["thaw_gone"] = int(self.notes.get("thaw_gone", 0)) + 1  # type: ignore[call-overload]
        t = self._stopped_at.pop(service, None)
        if t is not None:
            self.frozen_s[service] = self.frozen_s.get(service, 0.0) + time.monotonic() - t


Injector = Callable[[FaultRun], Awaitable[str | None]]


def _kill(service: str) -> Injector:
    async def inject(run: FaultRun) -> str | None:
        run.kill(service)
        return service

    return inject


def _stop(service: str, hold_s: float) -> Injector:
    """SIGSTOP ``service`` (a hung process: it neither dies nor answers), SIGCONT it ``hold_s`` wall s later.
    Nothing restarts while ``up``'s liveness watch is off or longer than the freeze (:data:`UP_LIVENESS_S`): recovery
    is the router's ``/healthz`` 200 after the SIGCONT, so its time includes ``hold_s``."""

    async def inject(run: FaultRun) -> str | None:
        run.kill(service, signal.SIGSTOP)
        try:
            await asyncio.sleep(hold_s)
        finally:
            run.thaw(service, run.signalled[service])
        return None

    return inject


def _stop_watched(service: str, hold_s: float) -> Injector:
    """SIGSTOP ``service`` and let ``up``'s liveness watch (:data:`UP_LIVENESS_S`, shorter than ``hold_s``) SIGKILL and
    restart it: polled every 50 ms until cluster.json names a new pid (at most ``hold_s`` wall s), then SIGCONT (a
    process gone is :meth:`FaultRun.thaw`'s ``thaw_gone``). Recovery is the restart (from the SIGSTOP: the watch's
    timeout included); ``notes["watch_kill_s"]``: wall s from the SIGSTOP to the new pid, or ``"no restart"``."""

    async def inject(run: FaultRun) -> str | None:
        pid = run.kill(service, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < hold_s:
                try:
                    if run.pid(service) != pid:
                        run.notes["watch_kill_s"] = round(time.monotonic() - t0, 3)
                        break
                except (OSError, ValueError, KeyError):
                    pass  # cluster.json being rewritten
                await asyncio.sleep(0.05)
            else:
                run.notes["watch_kill_s"] = "no restart"
        finally:
            run.thaw(service, pid)
        return service

    return inject


def _then(first: Injector, service: str, after_s: float, new_pid_wait_s: float = 10.0) -> Injector:
    """``first``, then SIGKILL of ``service`` ``after_s`` wall s later (two faults at once). When ``first`` hit
    ``service`` itself (``nats-kill-twice``) the second kill waits (polled every 50 ms, up to ``new_pid_wait_s``
    wall s) for ``up`` to have started it again: cluster.json's pid no longer the one ``first`` signalled (that one
    is reaped; its number may be reused). A process gone before the signal (``ProcessLookupError``) is waited for
    again. Recovery is timed from the second kill (``run.t_fault``, ``run.signalled[service]``: its pid) and is
    ``service``'s restart; ``run.notes``: ``second_kill_s`` (wall s from the first fault to the second), or
    ``second_kill`` = ``"no new pid"`` when none came in time (then recovery stays ``first``'s)."""

    async def inject(run: FaultRun) -> str | None:
        victim = await first(run)
        t_first = run.t_fault
        old = run.signalled.get(service)
        await asyncio.sleep(after_s)
        deadline = time.monotonic() + new_pid_wait_s
        while True:
            try:
                pid: int | None = run.pid(service)
            except (OSError, ValueError, KeyError):
                pid = None  # cluster.json being rewritten
            if pid is not None and pid != old:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    old = pid  # exited before the signal: wait for up's next one
                else:
                    run.t_fault = time.monotonic()
                    run.signalled[service] = pid
                    if t_first is not None:
                        run.notes["second_kill_s"] = round(run.t_fault - t_first, 3)
                    return service
            if time.monotonic() >= deadline:
                run.notes["second_kill"] = "no new pid"
                return victim
            await asyncio.sleep(0.05)

    return inject


def _kill_wiping_store(service: str = "nats-server") -> Injector:
    """SIGKILL nats-server and remove its JetStream store before the supervisor starts it again: a server
    that comes back empty (a new container without a volume). The store is the ``js`` folder next to the
    config file its command line names (``-c``)."""

    async def inject(run: FaultRun) -> str | None:
        pid = run.pid(service)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        store = Path(argv[argv.index(b"-c") + 1].decode()).parent / "js"
        run.kill(service)
        await asyncio.sleep(0.02)  # gone before its store is (up restarts it 0.1 s after it exits)
        shutil.rmtree(store, ignore_errors=True)
        return service

    return inject


def _twin(service: str, hold_s: float) -> Injector:
    """SIGSTOP ``service``, start a second process with its command line and environment (a supervisor that
    replaced a frozen worker under the same node id), SIGCONT the first ``hold_s`` wall s later: two processes
    under one node id. The first must stop itself (``node superseded``), after which ``up`` restarts it as the
    latest process and the twin stops in turn; nothing may be lost."""

    async def inject(run: FaultRun) -> str | None:
        pid = run.pid(service)
        argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        env = dict(kv.decode().split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        run.kill(service, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)
            with open(run.log_dir / f"{service}-twin.log", "ab") as log:
                run.started.append(subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
            await asyncio.sleep(hold_s)
        finally:
            run.thaw(service, pid)
        return None

    return inject


def _term(service: str) -> Injector:
    """SIGTERM ``service`` under load (a graceful stop: compose's ``docker stop``, Kubernetes' pod deletion): it must
    exit within its compose stop grace (:data:`STOP_GRACE_S`: the router's drain, ``--shutdown-grace-s``, lets its
    open requests finish first); ``up`` restarts it. ``run.notes['exit_s']``: wall s from the signal to the process
    gone (-1: still there 5 s past its grace)."""

    async def inject(run: FaultRun) -> str | None:
        pid = run.kill(service, signal.SIGTERM)
        t0 = time.monotonic()
        while time.monotonic() - t0 < STOP_GRACE_S.get(service, 30.0) + 5.0:
            if not Path(f"/proc/{pid}").exists() or _zombie(pid):
                run.notes["exit_s"] = round(time.monotonic() - t0, 3)
                break
            await asyncio.sleep(0.02)
        else:
            run.notes["exit_s"] = -1
        return service

    return inject


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits for its parent to reap it (``State: Z`` in /proc)."""
    try:
        return "\tZ" in Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        return True


async def _parked_node(run: FaultRun, among: tuple[str, ...], timeout_s: float) -> str | None:
    """The first worker of ``among`` (node ids) whose ``ei_node_parked`` is above 0 on its /metrics, polled every
    20 ms for up to ``timeout_s`` wall s (None if none ever was)."""
    urls = {n: u for n, u in _metrics_urls(run).items() if n in among}
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=1.0) as http:
        while time.monotonic() < deadline:
            for node, url in urls.items():
                try:
                    if _gauges((await http.get(url)).text).get("ei_node_parked", 0.0) > 0:
                        return node
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(0.02)
    return None


def _park_then_kill(victim: str) -> Injector:
    """Phase switches under load (``split set`` 3P1D, 1P3D, 2P2D, one a second, as :func:`_split_flips`): a request
    whose decode node is chosen at its prefill's start (``route.bind``) and whose prefill ends first is PARKED on
    its prefill node, its first token out, its KV held. At the first parked request seen on a worker's /metrics
    (polled every 20 ms, up to 12 s) SIGKILL ``victim``: ``"router"`` (its clients lose their streams, by
    design; the workers must release what they parked) or ``"parked-worker"`` (the worker seen parked: the
    router must re-dispatch or fail its requests, not hang them or stream a first token twice).
    ``run.notes['parked_on']``: the node seen parked (``none``: ``victim`` killed after 12 s anyway, w0 for
    ``parked-worker``)."""

    async def inject(run: FaultRun) -> str | None:
        flips = asyncio.ensure_future(_split_flips(("3P1D", "1P3D", "2P2D"), parallel=1)(run))
        try:
            node = await _parked_node(run, ("w0", "w1", "w2", "w3"), 12.0)
            run.notes["parked_on"] = node or "none"
            target = "router" if victim == "router" else f"worker-{node or 'w0'}"
            run.kill(target)
        finally:
            await flips
        return target

    return inject


def _split_flips(splits: tuple[str, ...], parallel: int = 2) -> Injector:
    """``evolving-infra split set`` of each of ``splits`` in turn, ``parallel`` at once from separate processes (two
    terminals), each a new phase switch under load; ``run.notes['split_exit']``: their exit statuses."""

    async def inject(run: FaultRun) -> str | None:
        run.t_fault = time.monotonic()
        codes: list[int] = []
        for i in range(0, len(splits), parallel):
            codes += [code for code, _ in await asyncio.gather(*(_split_cli(run, "set", sp) for sp in splits[i:i + parallel]))]
            await asyncio.sleep(1.0)
        run.notes["split_exit"] = codes
        return None

    return inject


async def _split_cli(run: FaultRun, *argv: str) -> tuple[int, str]:
    """``evolving-infra split <argv>`` against ``run``'s cluster as its operator: (exit status, stdout); a failure's
    stderr is added to ``run.notes['split_errors']``."""
    env = dict(os.environ, EI_STATE_DIR=str(run.log_dir))
    creds = next((str(f) for f in (run.log_dir / "nats-creds").glob("operator.*")), "")
    pr = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "evolving_infra.cli", "split", *argv, "--nats-url", str(run.info["nats_url"]),
        "--nats-creds", creds, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    out, err = await pr.communicate()
    code = pr.returncode if pr.returncode is not None else -1
    if code:
        run.notes.setdefault("split_errors", []).append(err.decode(errors="replace")[-200:])
    return code, out.decode(errors="replace").strip()


def _in_split(split: str, then: Injector, settle_s: float = 1.0) -> Injector:
    """``split set split`` under load, ``settle_s`` wall s for the nodes to switch, then ``then`` (a fault in a split
    where the victim is its phase's only node). ``run.notes['split_exit']``: the ``split set``'s status."""

    async def inject(run: FaultRun) -> str | None:
        run.notes["split_exit"] = [(await _split_cli(run, "set", split))[0]]
        await asyncio.sleep(settle_s)
        return await then(run)

    return inject


def _switch_then_kill(first: str, then: tuple[str, ...], service: str = "planner") -> Injector:
    """``split set first`` under load and, the moment it has returned (the planner published the new epoch; the
    nodes it moves are draining), SIGKILL ``service``; once ``up`` has restarted it and it answers ``split get``,
    ``split set`` each of ``then``
    (one a second) and ``split get``. The restarted planner must adopt the split the nodes serve (not revert it,
    not leave a node switching) and take the next ``split set`` commands. ``run.recover_s`` (and ``run.notes``'
    ``planner_answer_s``): wall s from the kill to the restarted planner's first answered ``split get`` (None: none
    in 30 s), not the injector's whole run (its later sets and pauses). ``run.notes``: ``split_exit`` (every ``split
    set``'s status, ``first``'s first), ``split_after`` (``split get``'s line at the end)."""

    async def inject(run: FaultRun) -> str | None:
        code, _ = await _split_cli(run, "set", first)
        old = run.kill(service)
        codes = [code]
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            try:
                if run.pid(service) != old:
                    break
            except (OSError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.05)
        errors = list(run.notes.get("split_errors", []))  # split get's while the restarted one is not up are not kept
        while time.monotonic() < deadline:  # until the restarted one answers
            if not (await _split_cli(run, "get"))[0]:
                assert run.t_fault is not None
                run.recover_s = round(time.monotonic() - run.t_fault, 3)
                run.notes["planner_answer_s"] = run.recover_s
                break
            await asyncio.sleep(0.2)
        run.notes["split_errors"] = errors
        for sp in then:
            codes.append((await _split_cli(run, "set", sp))[0])
            await asyncio.sleep(1.0)
        run.notes["split_exit"] = codes
        run.notes["split_after"] = (await _split_cli(run, "get"))[1]
        return service

    return inject


FAULTS: dict[str, Injector] = {
    "nats-kill": _kill("nats-server"),
    "directory-kill": _kill("kvdirectory"),
    "planner-kill": _kill("planner"),
    "prefill-worker-kill": _kill("worker-w0"),
    "decode-worker-kill": _kill("worker-w3"),
    "nats-stop": _stop("nats-server", 8.0),
    "router-kill": _kill("router"),
    "prefill-worker-stop": _stop("worker-w0", 8.0),
    "decode-worker-stop": _stop("worker-w3", 8.0),
    "worker-kill-then-nats-kill": _then(_kill("worker-w3"), "nats-server", 0.3),
    "directory-kill-then-worker-kill": _then(_kill("kvdirectory"), "worker-w0", 0.2),
    "nats-kill-store-lost": _kill_wiping_store(),
    "decode-worker-twin": _twin("worker-w3", 6.0),
    "nats-stop-long": _stop("nats-server", 40.0),
    "router-term": _term("router"),
    "prefill-worker-term": _term("worker-w0"),
    "decode-worker-term": _term("worker-w3"),
    "planner-term": _term("planner"),
    "directory-term": _term("kvdirectory"),
    "nats-term": _term("nats-server"),
    "router-kill-parked": _park_then_kill("router"),
    "parked-prefill-kill": _park_then_kill("parked-worker"),
    "split-flips": _split_flips(("1P3D", "3P1D", "3P1D", "1P3D", "2P2D", "2P2D")),
    "decode-worker-stop-long": _stop("worker-w3", 40.0),
    "switch-planner-kill": _switch_then_kill("1P3D", ("3P1D", "2P2D")),
    "lone-decode-stop-long": _in_split("3P1D", _stop("worker-w3", 40.0)),
    "lone-prefill-kill": _in_split("1P3D", _kill("worker-w0")),
    "planner-stop-long": _stop("planner", 40.0),
    "router-stop": _stop("router", 8.0),
    "router-stop-long": _stop("router", 40.0),
    "directory-stop-long": _stop("kvdirectory", 40.0),
    "router-stop-watched": _stop_watched("router", 40.0),
    "switch-worker-kill": _in_split("1P3D", _kill("worker-w1"), settle_s=0.0),
    "nats-kill-twice": _then(_kill("nats-server"), "nats-server", 0.6),
    "nats-store-lost-twice": _then(_kill_wiping_store(), "nats-server", 0.6),
}
"""Fault name -> injector. With ``--split 2P2D`` on 4 nodes, w0/w1 prefill and w2/w3 decode (once the split is served:
from the start with ``--policy static:2P2D``, after the evolving planner's warm-up otherwise). ``*-stop``: the
process hangs 8 s (SIGSTOP, then SIGCONT); ``router-kill``: a single router's clients lose its open streams and
what they send before ``up`` restarts it (connection errors, no hang); ``a-then-b``: b is SIGKILLed while a is
being restarted; ``nats-kill-store-lost``: nats-server comes back without its JetStream store (the stream is
made again by the launcher, every consumer resumes at its start); ``decode-worker-twin``: w3 frozen, a second
process started under its node id, the first resumed 6 s later (two processes, one node id); ``nats-stop-long``:
nats-server hung 40 s (TCP open, nothing answers), then SIGCONT; ``*-term``: SIGTERM (a graceful stop, as
``docker compose stop``), ``notes.exit_s`` the time to exit (compose allows 30 s, the router 50: it drains its
open requests first), ``up`` restarts the service;
``router-kill-parked`` / ``parked-prefill-kill``: SIGKILL of the router / of the prefill worker at the moment a
worker holds a PARKED request (phase switches under load make them), ``leftover`` must show nothing parked,
queued or running afterwards; ``split-flips``: six ``split set`` commands under load, two at once;
``decode-worker-stop-long``: w3 hung 40 s, past the workers' ``--bind-timeout-s`` (10 s) and the router's
``--requeue-wait-s`` (30 s); ``switch-planner-kill``: the planner SIGKILLed the moment ``split set 1P3D`` returned (its
switch in flight), then ``split set 3P1D`` and ``2P2D`` to the restarted planner; ``lone-decode-stop-long`` /
``lone-prefill-kill``: ``split set 3P1D`` / ``1P3D`` first, then the only decode node hung 40 s / the only prefill node
SIGKILLed (the planner must give its phase to another node, or the router wait for it); ``planner-stop-long`` /
``directory-stop-long``: hung 40 s; ``router-stop`` / ``router-stop-long``: the one router hung 8 s / 40 s (its
streams wait; the workers must not drop its requests as a router gone); ``switch-worker-kill``: w1 SIGKILLed the
moment ``split set 1P3D`` returned (its switch from prefill to decode in flight); ``nats-kill-twice`` /
``nats-store-lost-twice``: nats-server SIGKILLed (its store removed) and its restarted process SIGKILLed again 0.6 s
later (or once ``up`` has restarted it, if later), while every service's reconnect check (and stream wait) of the
first restart runs; ``router-stop-watched``: the one router hung as in ``router-stop-long``, under ``up
--liveness-timeout-s 10``: ``up`` SIGKILLs it after 10 s of silence and restarts it (recovery: its restart). ``a-then-b``'s
recovery is timed from b's kill."""

UP_LIVENESS_S = {
    **dict.fromkeys(("nats-stop-long", "decode-worker-stop-long", "lone-decode-stop-long", "planner-stop-long",
                     "router-stop-long", "directory-stop-long"), 0.0),
    "router-stop-watched": 10.0,
}
"""Fault -> ``up --liveness-timeout-s`` (absent: ``up``'s default, 30 s). The ``*-stop-long`` faults measure a 40-s
freeze that the other services must fence and outlive (the router's, the planner's, the workers' own timeouts), not
``up``'s restart: their watch is off (its default 30 s SIGKILLed the frozen process mid-fault). ``router-stop-watched``
measures the watch itself."""

SIM_POOL_SLOT_BYTES = 4096
"""``--kv-pool real`` with the sim engine: bytes per pool slot (``up --kv-pool-slot-bytes``). The pool mirrors the
whole L2, and gb300-glm52's 128,750 host blocks at the default 64 KiB (7.9 GiB) are over its 1 GiB limit: 4 KiB
makes 0.49 GiB per worker, of which only the blocks stored are touched."""

TORCH_MAX_OUTPUT = 128
"""``--engine torch``: output tokens per request at most (the trace scaled to the tiny model): enough decode steps
that a decode node killed 3 s in holds streams mid-decode."""

STOP_GRACE_S = {"router": 50.0}
"""docker-compose.yml's ``stop_grace_period`` where it is not 30 s: the router's (its SIGTERM drains first)."""

LOSSY = frozenset({"router-kill", "router-kill-parked", "router-term", "router-stop-watched"})
"""Faults whose victim's clients lose requests by design (its open streams, what they send while it is down): they
pass with requests lost as long as the replay ends (no hang: ``lost`` is -1 when it did not end in time)."""

STOP_REPLAY_WAIT_S = 30.0
"""Wall seconds :func:`run_fault` waits for a replay it stopped at ``replay_timeout_s`` to return its result (the stop
cancels the requests in flight: it returns at once unless its loop is starved)."""


@dataclass
class FaultResult:
    fault: str
    sessions: int
    sent: int = 0
    completed: int = 0
    lost: int = 0
    retried: int = 0
    """Requests the replayer sent again after a refusal before any answer (429 / 503, connection refused or
    reset before the first byte: ``evolving_infra.replay.retry``), completed or not."""
    recover_s: float | None = None
    """Fault -> victim restarted (new pid) and router /healthz 200 (wall s); where the injector measured it itself
    (:attr:`FaultRun.recover_s`), that: ``switch-planner-kill``'s is the kill -> the restarted planner's first answered
    ``split get``."""
    up_alive: bool = False
    restarts: dict[str, int] = field(default_factory=dict)
    replay_wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    """First few error texts of lost requests, then each worker watchdog's record of a hung step (its requests, where
    the step loop awaited, the threads' stacks; :func:`hang_errors`): a failed run says where a worker stuck."""
    hangs: list[str] = field(default_factory=list)
    """Every hang record of the workers' logs (:func:`worker_hangs`): watchdog firings and long waits of new work for
    a previous attempt's step, each with where the step loop awaited. A watchdog firing fails :func:`_passed`."""
    token_mismatch: int = 0
    """Completed requests whose ``usage.completion_tokens`` is not the length the replay asked for (``ignore_eos``):
    tokens lost or counted twice."""
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    """Instance -> its counters (``svc.stats``) at the end of the run (bus resends, duplicates, binds ...)."""
    leftover: dict[str, dict[str, float]] = field(default_factory=dict)
    """Worker node -> its work gauges (/metrics) ``--leftover-after`` s after the replay ended: parked, queued, running
    and decoding are 0 on a cluster that lost nothing in its workers (L1 blocks may stay: the prefix cache)."""
    notes: dict[str, object] = field(default_factory=dict)
    """:attr:`FaultRun.notes` of the run."""
    log_dir: str = ""
    in_flight_at_timeout: list[str] = field(default_factory=list)
    """The rid (``X-Request-ID``) of each request still unanswered when the replay ran past ``replay_timeout_s`` (it is
    then stopped: those requests are cancelled; :attr:`sent` counts them, :attr:`lost` is -1): grep the cluster's
    logs in :attr:`log_dir` for them. Empty when the replay ended in time."""
    kv_pool: str = "off"
    """The workers' host KV pool (``up --kv-pool``): ``real`` moves KV bytes between workers (Mooncake)."""
    frozen: list[str] = field(default_factory=list)
    """Services the fault SIGSTOPped: their ``kvfetch.wait_ms_max`` includes their own freeze, so
    :func:`kv_fetch_summary` leaves it out, and :func:`_passed` allows them :data:`FETCH_WAIT_BOUND_MS` plus their
    :attr:`frozen_s`."""
    frozen_s: dict[str, float] = field(default_factory=dict)
    """Service -> wall seconds the fault kept it frozen (:attr:`FaultRun.frozen_s`); a frozen service missing here
    is allowed no more than any other."""
    log_problems: dict[str, int] = field(default_factory=dict)
    """:func:`worker_log_problems` at the end of the run: warning / error lines and tracebacks in the workers' logs."""
    routers: int = 1
    """Router processes on the one port (``up --routers N``)."""
    trails: dict[str, list[str]] = field(default_factory=dict)
    """Rid -> the last :data:`TRAIL_LINES` lines of the cluster's logs naming it (:func:`request_trails`), for each
    request that failed or was still open at the replay's bound (at most :data:`TRAIL_RIDS` of them); each trail goes
    into :attr:`errors` too: where the request was last seen (router dispatch, worker received, hand-off, decode ...)."""


def up_argv(log_dir: Path, *, speedup: float, nodes: int, split: str, timeout_s: float = 180.0,
            model_dir: Path | None = None, policy: str | None = None, kv_pool: str = "off",
            routing_opts: tuple[str, ...] = (), routing: str | None = None, routers: int = 1,
            liveness_timeout_s: float | None = None, log_requests: bool = False) -> list[str]:
    """The ``evolving-infra up`` command line of a run (router on a free port, ``--metrics``); with ``model_dir``,
    its workers run ``--engine torch`` on that Hugging Face folder (CPU); with ``policy``, ``up --policy policy``;
    with ``kv_pool`` ``real``, ``up --kv-pool real`` (the sim's slots :data:`SIM_POOL_SLOT_BYTES`, a torch worker's
    its page); ``routing``: ``up --routing`` (over the policy's); each of ``routing_opts`` (``K=V``) as ``up --routing-opt``;
    ``routers`` > 1: ``up --routers N`` (router processes on the one port); ``liveness_timeout_s``: ``up
    --liveness-timeout-s`` (None: its default); ``log_requests``: ``up --log-requests`` (the router and the workers log one
    line per request received and ended, by rid: where a request that never ended was last seen)."""
    argv = [sys.executable, "-m", "evolving_infra.cli", "up", "--port", "0", "--nodes", str(nodes), "--split", split,
            "--speedup", repr(speedup), "--log-dir", str(log_dir), "--ready-timeout", str(timeout_s), "--metrics"]
    if routers != 1:
        argv += ["--routers", str(routers)]
    if model_dir is not None:
        argv += ["--engine", "torch", "--model", str(model_dir), "--device", "cpu"]
    if policy is not None:
        argv += ["--policy", policy]
    if kv_pool == "real":
        argv += ["--kv-pool", "real"] + (["--kv-pool-slot-bytes", str(SIM_POOL_SLOT_BYTES)] if model_dir is None else [])
    if routing is not None:
        argv += ["--routing", routing]
    for opt in routing_opts:
        argv += ["--routing-opt", opt]
    if liveness_timeout_s is not None:
        argv += ["--liveness-timeout-s", repr(liveness_timeout_s)]
    if log_requests:
        argv += ["--log-requests"]
    return argv


def start_up(log_dir: Path, *, speedup: float, nodes: int, split: str, timeout_s: float = 180.0,
             model_dir: Path | None = None, policy: str | None = None, kv_pool: str = "off",
             routing_opts: tuple[str, ...] = (), routing: str | None = None, routers: int = 1,
             liveness_timeout_s: float | None = None, log_requests: bool = False,
             watchdog_timeout_s: float | None = None) -> FaultRun:
    """Start ``evolving-infra up`` (:func:`up_argv`) and wait for its READY line. ``watchdog_timeout_s``: the workers'
    ``--watchdog-timeout-s`` (``EI_WATCHDOG_TIMEOUT_S`` in ``up``'s environment, which its services inherit; None: the
    workers' default, 300 s).

    Raises:
        RuntimeError: when ``up`` exits or prints no READY line within ``timeout_s``.
    """
    argv = up_argv(log_dir, speedup=speedup, nodes=nodes, split=split, timeout_s=timeout_s, model_dir=model_dir, policy=policy,
                   kv_pool=kv_pool, routing_opts=routing_opts, routing=routing, routers=routers,
                   liveness_timeout_s=liveness_timeout_s, log_requests=log_requests)
    out = open(log_dir / "up.out", "wb")
    if watchdog_timeout_s is not None and not watchdog_timeout_s > 0:
        raise ValueError(f"watchdog_timeout_s {watchdog_timeout_s!r}: positive seconds, or None for the workers' default")
    env = None if watchdog_timeout_s is None else {**os.environ, "EI_WATCHDOG_TIMEOUT_S": repr(float(watchdog_timeout_s))}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=out,
                            start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        chunk = proc.stdout.read()
        if chunk:
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith("READY "):
                    run = FaultRun(proc, json.loads(line[6:]), log_dir)
                    _drain_stdout(proc, log_dir / "up.stdout")
                    return run
        if proc.poll() is not None:
            raise RuntimeError(f"up exited with {proc.returncode}: {(log_dir / 'up.out').read_text()[-2000:]}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"up printed no READY line within {timeout_s} s")


def _drain_stdout(proc: subprocess.Popen[bytes], path: Path) -> None:
    """Keep reading ``up``'s stdout into a file so its pipe never fills."""
    import threading

    def pump() -> None:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), True)
        with open(path, "ab") as f:
            for line in proc.stdout:
                f.write(line)
                f.flush()

    threading.Thread(target=pump, daemon=True).start()


def stop_up(run: FaultRun, timeout_s: float = 30.0) -> int | None:
    """SIGINT ``up`` (it stops every service in order), SIGKILL its group if it hangs; returns its exit code."""
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGINT)
        try:
            run.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()
    return run.proc.returncode


async def _wait_recovered(run: FaultRun, victim: str | None, old_pid: int | None, timeout_s: float) -> float | None:
    """Wall seconds from the fault until ``victim`` has a new pid and the router answers /healthz 200. With several
    routers (``up --routers N``) a router victim's own ``/readyz`` (on its metrics port) must answer 200 too: the
    shared port's /healthz is answered by whichever router accepts, the others included."""
    assert run.t_fault is not None
    deadline = run.t_fault + timeout_s
    own = None
    if victim is not None and victim.startswith("router"):
        urls = dict(run.cluster_json().get("metrics", {}))  # type: ignore[call-overload]
        if sum(1 for k in urls if str(k).startswith("router")) > 1 and victim in urls:
            own = str(urls[victim]).removesuffix("/metrics") + "/readyz"
    async with httpx.AsyncClient(timeout=2.0) as http:
        while time.monotonic() < deadline:
            restarted = True
            if victim is not None:
                try:
                    restarted = run.pid(victim) != old_pid
                except (OSError, ValueError, KeyError):
                    restarted = False
            if restarted:
                try:
                    r = await http.get(run.router_url + "/healthz")
                    if r.status_code == 200 and (own is None or (await http.get(own)).status_code == 200):
                        return time.monotonic() - run.t_fault
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(0.05)
    return None


async def run_fault(
    fault: str,
    *,
    sessions: int = 16,
    max_requests_per_branch: int = 0,
    concurrency: int = 8,
    speedup: float = 50.0,
    nodes: int = 4,
    split: str = "2P2D",
    fault_at_s: float = 3.0,
    replay_timeout_s: float = 300.0,
    max_pause_s: float | None = None,
    log_dir: Path | None = None,
    leftover_after_s: float | None = None,
    engine: str = "sim",
    max_output: int = TORCH_MAX_OUTPUT,
    policy: str | None = None,
    kv_pool: str = "off",
    routing_opts: tuple[str, ...] = (),
    routing: str | None = None,
    routers: int = 1,
    log_requests: bool = False,
    request_timeout_s: float | None = None,
    watchdog_timeout_s: float | None = None,
) -> FaultResult:
    """Start ``up``, replay ``sessions`` Claude Code sessions, inject ``fault`` after ``fault_at_s``
    wall seconds of replay, and count what it cost.

    Args:
        fault: a key of :data:`FAULTS`.
        sessions: sessions (agents) of the shipped sample to replay.
        max_requests_per_branch: cap each branch to its first K requests (0 = whole sessions).
        concurrency: closed-loop concurrent agents.
        speedup: simulated seconds per wall second of the cluster.
        fault_at_s: wall seconds after the replay starts when the fault is injected.
        replay_timeout_s: wall bound of the replay: past it the replay is stopped, the requests still open are
            cancelled and named in :attr:`FaultResult.in_flight_at_timeout` (counted in ``sent``; ``lost`` is -1).
        max_pause_s: clip each request's recorded pause (tool time) to this many simulated
            seconds, so a short run keeps requests in flight (None: pauses as recorded).
        leftover_after_s: read every worker's work gauges (:attr:`FaultResult.leftover`) this many wall s
            after the replay ended (None: not read, no wait).
        engine: ``sim`` (profile-timed workers) or ``torch``: the workers run the tiny random llama of
            ``evolving-infra model init`` (written to ``log_dir``/model, 1,024-token KV per node) on CPU, and the
            trace is scaled to it as ``replay --scale-to-model`` does (one token per trace block, prompts cut to
            half the router's ``max_model_len``, outputs to ``max_output`` tokens), ids below its vocabulary.
        kv_pool: ``off`` or ``real``: the workers' real-bytes host KV pool (``up --kv-pool real``, Mooncake): peer
            fetches move bytes over TCP, a killed or stopped peer can be mid-fetch.
        routing_opts: ``up --routing-opt`` items (``K=V``), e.g. ``ttft_fetch_base_s=0.001`` for a router that
            plans peer fetches wherever a prefix is on another node.
        routing: ``up --routing`` (None: the policy's; ``static:2P2D``'s is cache-aware, which plans no fetch).
        routers: ``up --routers N``: router processes on the one port (the faults hit ``router``, the first; the
            replay's clients reach whichever router the kernel hands each connection).
        log_requests: ``up --log-requests``: one log line per request received and ended in the router's and the
            workers' logs, so a request the replay names unanswered (:attr:`FaultResult.in_flight_at_timeout`) can be
            followed to where it was last seen.
        request_timeout_s: each request's own wall bound in the replay client (None: ``replay_timeout_s``, as a
            request stuck since the replay's start ends with the replay); one longer than ``replay_timeout_s`` leaves
            every request open at the bound to be named in :attr:`FaultResult.in_flight_at_timeout`; one shorter lets a
            request stuck from the start fail on its own (named with its wait, :func:`record_error`) and the replay end.
            Either way each failed or open request's trail in the logs (:func:`request_trails`) goes into the errors.
        watchdog_timeout_s: the workers' ``--watchdog-timeout-s`` (None: their default, 300 s). Below
            ``replay_timeout_s``, a worker step that hangs is ended (the worker restarts) and its record (the step's
            requests, where it awaited, the threads' stacks) reaches :attr:`FaultResult.errors` before the replay's
            bound; keep it above any freeze the fault puts on a worker (``*-stop-long``: 40 s).

    Raises:
        KeyError: unknown ``fault``. RuntimeError: ``up`` did not start. ValueError: ``watchdog_timeout_s`` not positive.
    """
    from evolving_infra.launcher import demo_trace_path
    from evolving_infra.replay.core import Arrival
    from evolving_infra.replay.live import LiveReplayer
    from evolving_infra.traces.io import read_trace
    from evolving_infra.traces.sample import sample_sessions
    from shared.clock import SimClock

    inject = FAULTS[fault]
    trace = read_trace(demo_trace_path())
    agents = list(dict.fromkeys(r.agent for r in trace.requests))[:sessions]
    keep = set(agents)
    trace = type(trace)(header=trace.header, requests=[r for r in trace.requests if r.agent in keep])
    if max_requests_per_branch:
        trace = sample_sessions(trace, sessions, seed=0, max_requests_per_branch=max_requests_per_branch)
    if max_pause_s is not None:
        trace.requests = [msgspec.structs.replace(r, pause_s=min(r.pause_s, max_pause_s)) for r in trace.requests]
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"ei-fault-{fault}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    res = FaultResult(fault=fault, sessions=len(agents), log_dir=str(log_dir))
    if engine not in ("sim", "torch"):
        raise ValueError(f"engine {engine!r}: sim or torch")
    model_dir = None
    if engine == "torch":
        from services.worker.engines.torch_engine.checkpoint import init_model

        model_dir = log_dir / "model"
        init_model(model_dir, arch="llama")  # `evolving-infra model init`'s defaults: vocabulary 512, context 2048
    if kv_pool not in ("off", "real"):
        raise ValueError(f"kv_pool {kv_pool!r}: off or real")
    res.kv_pool = kv_pool
    res.routers = routers
    run = start_up(log_dir, speedup=speedup, nodes=nodes, split=split, model_dir=model_dir, policy=policy, kv_pool=kv_pool,
                   routing_opts=routing_opts, routing=routing, routers=routers, liveness_timeout_s=UP_LIVENESS_S.get(fault),
                   log_requests=log_requests, watchdog_timeout_s=watchdog_timeout_s)
    try:
        requests, block, model, vocab = trace.requests, trace.header.block_size, "evolving-infra-sim", None
        if model_dir is not None:
            from evolving_infra.replay.cli import fit_to_router, router_answers, router_max_model_len, router_vocab_size

            answers = await router_answers(run.router_url, None)
            requests, block, _ = fit_to_router(requests, block, router_max_model_len(answers), scale=True, max_output=max_output)
            model, vocab = model_dir.name, router_vocab_size(answers)
        clock = SimClock(speedup)
        replayer = LiveReplayer(run.router_url, clock, block_size=block, progress=False, model=model,
                                vocab_size=vocab,
                                request_timeout_s=replay_timeout_s if request_timeout_s is None else request_timeout_s)
        wall0 = time.monotonic()
        stop_replay = asyncio.Event()
        replay = asyncio.ensure_future(replayer.run(requests, Arrival(kind="closed", concurrency=concurrency), stop=stop_replay))
        await asyncio.wait({replay}, timeout=fault_at_s)
        recover: asyncio.Future[float | None] | None = None
        fault_sim: float | None = None
        if not replay.done():
            fault_sim = clock.now()
            victim = await inject(run)
            if run.t_fault is None:
                run.t_fault = time.monotonic()
            old_pid = run.signalled.get(victim) if victim is not None else None
            recover = asyncio.ensure_future(_wait_recovered(run, victim, old_pid, timeout_s=120.0))
        timed_out = False
        try:
            result = await asyncio.wait_for(asyncio.shield(replay), timeout=replay_timeout_s)
        except asyncio.TimeoutError:
            # stopped, not cancelled: the result keeps what was answered and names the requests still open (before, a
            # cancel left no record at all and the result read sent=0, as if nothing had been sent)
            timed_out = True
            stop_replay.set()
            try:
                result = await asyncio.wait_for(replay, timeout=STOP_REPLAY_WAIT_S)
            except asyncio.TimeoutError:
                result = None
        except asyncio.CancelledError:  # the run cancelled (Ctrl-C, a test's timeout): the shielded replay with it
            replay.cancel()
            raise
        res.replay_wall_s = time.monotonic() - wall0
        if recover is not None:
            res.recover_s = await recover
            if run.recover_s is not None:
                res.recover_s = run.recover_s  # the injector's own measure (it ran past the recovery)
        if result is not None:
            res.sent = len(result.records)
            res.completed = sum(1 for r in result.records if r.ok)
            res.lost = res.sent - res.completed
            res.retried = sum(1 for r in result.records if r.retries)
            res.errors = [record_error(r, speedup) for r in result.records if not r.ok][:5]
            res.token_mismatch = sum(1 for r in result.records if r.ok and r.expected_completion_tokens
                                     and r.completion_tokens != r.expected_completion_tokens)
            if fault_sim is not None:
                res.notes.update(ttft_after_fault(result.records, fault_sim, speedup))
        if timed_out:
            open_ids = [] if result is None else result.in_flight_ids
            res.in_flight_at_timeout = list(open_ids)
            res.sent += len(open_ids)
            what = f"replay did not finish within {replay_timeout_s} s: {len(open_ids)} requests unanswered then"
            if open_ids:
                what += f" ({', '.join(open_ids[:5])}{', ...' if len(open_ids) > 5 else ''})"
            if result is None:
                what += f"; the stopped replay did not return within {STOP_REPLAY_WAIT_S:g} s"
            elif result.branch_ends_cancelled:
                what += f", {result.branch_ends_cancelled} branch ends unanswered"
            res.errors = [what, *res.errors[:4]]
            res.lost = -1
        res.up_alive = run.proc.poll() is None
        res.notes = {**run.notes, **res.notes}
        if res.up_alive and leftover_after_s is not None:
            await asyncio.sleep(leftover_after_s)
            res.leftover = await worker_gauges(run)
        if res.up_alive:
            res.counters = await collect_counters(run)
        try:
            res.restarts = {k: v for k, v in run.cluster_json().get("restarts", {}).items() if v}  # type: ignore[union-attr]
        except (OSError, ValueError):
            pass
        res.counters.update(await _twin_counters(run) if run.started and res.up_alive else {})
        res.log_problems = worker_log_problems(Path(log_dir))
        hangs = worker_hangs(Path(log_dir))
        res.hangs = [text for _, text in hangs]
        res.errors += hang_errors(hangs, timed_out or res.lost != 0)  # a request failed on its own bound: where it waited
        failed = [] if result is None else [r.x_request_id or r.request_id or r.id for r in result.records if not r.ok]
        res.trails = request_trails(Path(log_dir), [*res.in_flight_at_timeout, *failed][:TRAIL_RIDS])
        res.errors += trail_errors(res.trails)
        res.frozen = sorted(run.frozen)
        res.frozen_s = {k: round(v, 3) for k, v in sorted(run.frozen_s.items())}
    finally:
        for twin in run.started:
            if twin.poll() is None:
                twin.kill()
            twin.wait()
        stop_up(run)
    return res


AFTER_FAULT_S = 3.0
"""Wall seconds after the fault whose requests :func:`ttft_after_fault` looks at (a router's restart gap is 1.1-1.6 s)."""


def record_error(rec: RequestRecord, speedup: float) -> str:
    """The text of a failed request's record for :attr:`FaultResult.errors`: its rid (the ``X-Request-ID`` the replay
    sent, the rid of the cluster's logs), its error, after how many wall seconds (the record's simulated send -> failure
    divided by ``speedup``, the cluster's simulated seconds per wall second), the HTTP status (``no response`` when no
    answer's header came: the record has no ``request_id``), the tokens streamed and the nodes the stream named, e.g.
    ``trace_0049-7: ReadTimeout after 180.0 s (HTTP 200, 0 tokens, prefill w0)``. Before, the text was the error
    alone (``ReadTimeout: ``), which named no request."""
    rid = rec.x_request_id or rec.request_id or rec.id
    error = (rec.error or "failed").strip().removesuffix(":")
    text = f"{rid}: {error}"
    if rec.finished_at is not None and speedup > 0:
        text += f" after {(rec.finished_at - rec.sent_at) / speedup:.1f} s"
    parts = [f"HTTP {rec.status}" if rec.request_id is not None else "no response", f"{rec.completion_tokens} tokens"]
    parts += [f"{k} {v}" for k, v in (("prefill", rec.prefill_node), ("decode", rec.decode_node)) if v]
    return f"{text} ({', '.join(parts)})"


TRAIL_LINES = 15
"""Lines of a request's trail (:func:`request_trails`): its last ones."""
TRAIL_RIDS = 5
"""Requests whose trail :func:`run_fault` collects (the still open ones first, then the failed)."""
TRAIL_LINE_MAX = 300
"""Characters of one trail line kept."""
TRAIL_LOGS = ("router*.log", "worker-*.log", "kvdirectory.log", "planner.log")
"""The logs of a run's folder :func:`request_trails` reads (every router process, every worker process, twins too)."""
_TRAIL_SKIP = frozenset({"timestamp", "event", "service", "level", "instance", "rid"})


def _json_records(path: Path, keep: Callable[[str], bool]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(line, record)`` for each line of the service log ``path`` that ``keep`` accepts and that is a JSON object (the
    services' log lines); other lines are skipped, an unreadable file yields nothing."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        if not line.startswith("{") or not keep(line):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield line, rec


def request_trails(log_dir: Path, rids: Sequence[str], lines: int = TRAIL_LINES) -> dict[str, list[str]]:
    """Rid -> the last ``lines`` log lines of ``log_dir`` (:data:`TRAIL_LOGS`, the services' JSON lines) that name it,
    ordered by their ``timestamp``: each as ``HH:MM:SS.ffffff <log file> <level> <event> k=v ...`` (the other fields;
    ``timestamp``, ``service``, ``instance`` and the rid left out), at most :data:`TRAIL_LINE_MAX` characters. A line
    names a rid when its JSON text holds the rid as a quoted string (``"rid": "r"``, ``"rids": ["r", ...]``); a line
    that is not a JSON object is skipped. Every rid of ``rids`` is a key, with ``[]`` when no line names it (the
    request never reached the router); an unreadable log is skipped. Empty ``rids``: ``{}``, no log read."""
    want = {rid: f'"{rid}"' for rid in dict.fromkeys(rids) if rid}
    found: dict[str, list[tuple[str, str]]] = {rid: [] for rid in want}
    if not want:
        return {}
    files = sorted({f for pattern in TRAIL_LOGS for f in Path(log_dir).glob(pattern)})
    for f in files:
        for line, rec in _json_records(f, lambda line: any(quoted in line for quoted in want.values())):
            hits = [rid for rid, quoted in want.items() if quoted in line]
            ts = str(rec.get("timestamp", ""))
            rest = " ".join(f"{k}={v}" for k, v in rec.items() if k not in _TRAIL_SKIP)
            shown = f"{ts[11:26] or '?'} {f.name} {rec.get('level', '?')} {rec.get('event', '')} {rest}".rstrip()
            for rid in hits:
                found[rid].append((ts, shown if len(shown) <= TRAIL_LINE_MAX else shown[: TRAIL_LINE_MAX - 3] + "..."))
    return {rid: [shown for _, shown in sorted(got, key=lambda t: t[0])[-lines:]] for rid, got in found.items()}


def trail_errors(trails: dict[str, list[str]]) -> list[str]:
    """One :attr:`FaultResult.errors` text per rid of ``trails`` (:func:`request_trails`): ``trail of <rid> (last N
    log lines naming it):`` and its lines, one a line; ``no log line names <rid>`` for an empty trail."""
    return [f"trail of {rid} (last {len(got)} log lines naming it):\n" + "\n".join(got) if got
            else f"trail of {rid}: no log line names it" for rid, got in trails.items()]


def ttft_after_fault(records: Sequence[RequestRecord], fault_sim: float, speedup: float,
                     window_s: float = AFTER_FAULT_S) -> dict[str, object]:
    """How long the requests sent in the ``window_s`` wall seconds after the fault waited for their first token,
    against the whole run's median: the gap a client sees while a router restarts (with one router: new
    connections wait in the accept queue, or are refused and retried; with several: the others serve at once).

    Args:
        records: the replay's request records (``sent_at`` and ``ttft_s`` in simulated s of the cluster clock).
        fault_sim: the cluster clock (simulated s) when the fault was injected.
        speedup: simulated s per wall s.

    Returns:
        ``after_fault_sent`` (requests sent in the window), ``after_fault_ttft_max_s`` (the longest first-token
        wait of those that completed, wall s; absent when none did) and ``ttft_p50_s`` (every completed
        request's median, wall s; absent when none completed).
    """
    ok = sorted(r.ttft_s / speedup for r in records if r.ok and r.ttft_s is not None)
    after = [r for r in records if fault_sim <= r.sent_at <= fault_sim + window_s * speedup]
    waits = [r.ttft_s / speedup for r in after if r.ok and r.ttft_s is not None]
    out: dict[str, object] = {"after_fault_sent": len(after)}
    if waits:
        out["after_fault_ttft_max_s"] = round(max(waits), 3)
    if ok:
        out["ttft_p50_s"] = round(ok[len(ok) // 2], 3)
    return out


LEFTOVER = ("ei_node_parked", "ei_node_queue_depth", "ei_node_running_batch", "ei_node_decoding",
            "ei_node_kv_l1_used_blocks", "ei_node_kv_fetched_held_bytes", "ei_node_split_epoch")


def _metrics_urls(run: FaultRun) -> dict[str, str]:
    """Worker node -> its /metrics URL (``up --metrics`` lists them in cluster.json under ``metrics``)."""
    urls = run.cluster_json().get("metrics", {})  # type: ignore[union-attr]
    out = {}
    for name, url in dict(urls).items():  # type: ignore[call-overload]
        if str(name).startswith("worker-"):
            u = str(url)
            out[str(name)[len("worker-"):]] = u if u.endswith("/metrics") else u.rstrip("/") + "/metrics"
    return out


def _gauges(text: str) -> dict[str, float]:
    """``name -> value`` of a Prometheus text page's samples (labels dropped; the last sample of a name wins)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition(" ")
            try:
                out[name.split("{", 1)[0]] = float(rest.split()[0])
            except (ValueError, IndexError):
                pass
    return out


async def worker_gauges(run: FaultRun) -> dict[str, dict[str, float]]:
    """Every worker's :data:`LEFTOVER` gauges from its /metrics (empty for one that does not answer)."""
    out: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=2.0) as http:
        for node, url in _metrics_urls(run).items():
            try:
                g = _gauges((await http.get(url)).text)
                out[node] = {k[len("ei_node_"):]: g[k] for k in LEFTOVER if k in g}
            except httpx.HTTPError:
                out[node] = {}
    return out


async def _twin_counters(run: FaultRun) -> dict[str, dict[str, int]]:
    """Whether the twin processes a fault started are still running (``twin.running`` 1) and their exit codes."""
    return {f"twin-{i}": {"running": int(t.poll() is None), "exit": t.returncode if t.returncode is not None else -1}
            for i, t in enumerate(run.started)}  # fmt: skip


async def collect_counters(run: FaultRun, timeout_s: float = 2.0) -> dict[str, dict[str, int]]:
    """Every service's counters over ``svc.stats.<instance>`` (empty for one that does not answer)."""
    from shared import messages as m
    from shared.bus import Bus, BusError
    from shared.subjects import SVC_STATS, Subjects

    from shared.auth import NatsAuth

    auth = None  # `up` runs NATS with per-service credentials by default: ask as the operator
    for ext in (".nk", ".pass", ".creds"):
        f = run.log_dir / "nats-creds" / f"operator{ext}"
        if f.exists():
            auth = NatsAuth.from_file(f)
            break
    bus = await Bus.connect(str(run.info["nats_url"]), Subjects("p0"), service="operator", instance="operator", auth=auth)
    out: dict[str, dict[str, int]] = {}
    try:
        for inst in run.cluster_json()["pids"]:  # type: ignore[union-attr]
            if inst == "nats-server":
                continue
            try:
                rep = await bus.request(SVC_STATS, m.StatsRequest(), timeout=timeout_s, instance=inst)
                out[inst] = dict(rep.counters)
            except BusError:
                out[inst] = {}
    finally:
        await bus.close()
    return out


FETCH_WAIT_BOUND_MS = 30_000
"""``--kv-pool real``: the longest a request may wait on its peer fetches (``kvfetch.wait_ms_max``; a worker the fault
froze: this plus its freeze, :func:`_frozen_waits_ok`): its locates (``--kv-pool-locate-timeout-s``, 2 s each, one per
4,096 blocks: a fetch of the walk's sizes, up to 8,192 blocks, sends at most two) and the read
(``--kv-pool-fetch-timeout-s``, 10 s), 14 s, and as much again for a loaded machine's loop (18.3 s seen at load 15 on 2
cores). Longer: a remote wait without its bound (a stopped peer holds the request for its whole 40-s freeze)."""

WATCHDOG_EVENTS = ("engine step hung past --watchdog-timeout-s", "event loop blocked past --watchdog-timeout-s")
"""Prefixes of the worker watchdog's error lines (``services/worker/service.py`` ``_on_hang``): the node was hung."""
LONG_WAIT_EVENT = "new work waits long for its request's previous attempt"
"""Prefix of the worker's warning when new work of a request waited past ``PREVIOUS_WAIT_NOTE_S`` for the step (or
hand-off) of its previous attempt (``WorkerService._wait_noted``): where the step loop waited then."""
HANG_TEXT_MAX = 8000
"""Characters of one :func:`worker_hangs` record kept (the threads' stacks are cut past it)."""


def worker_hangs(log_dir: Path) -> list[tuple[str, str]]:
    """The hang records in the workers' logs (``worker-*.log``, every process of a node): ``("watchdog", text)`` for
    each watchdog firing (a step hung past ``--watchdog-timeout-s``, or the event loop blocked) and ``("wait", text)``
    for each new work that waited long for its previous attempt's step (``LONG_WAIT_EVENT``). ``text`` names the log
    file, the event, the step (its number, how long it ran, its requests), where the step loop awaited
    (``awaiting``: the coroutine chain, ``services.worker.watchdog.await_chain``) and the threads' stacks, at most
    :data:`HANG_TEXT_MAX` characters: what a failed run prints of where a worker stuck. A line that is not JSON is
    skipped."""
    out: list[tuple[str, str]] = []
    for f in sorted(Path(log_dir).glob("worker-*.log")):
        for _, rec in _json_records(f, lambda line: any(e in line for e in WATCHDOG_EVENTS) or LONG_WAIT_EVENT in line):
            event = str(rec.get("event", ""))
            kind = "watchdog" if event.startswith(WATCHDOG_EVENTS) else "wait" if event.startswith(LONG_WAIT_EVENT) else ""
            if not kind:
                continue
            keys = ("node", "step", "elapsed_s", "timeout_s", "rid", "attempt", "waits_for", "waited_s", "rids", "step_rids",
                    "prefill_tokens", "decode_rows", "iterations", "timestamp")  # fmt: skip
            head = ", ".join(f"{k}={rec[k]}" for k in keys if k in rec)
            text = f"{f.name}: {event} ({head})"
            if rec.get("awaiting"):
                text += f"\nawaiting:\n{rec['awaiting']}"
            if rec.get("stacks"):
                text += f"\nstacks:\n{rec['stacks']}"
            out.append((kind, text if len(text) <= HANG_TEXT_MAX else text[: HANG_TEXT_MAX - 3] + "..."))
    return out


def hang_errors(hangs: Sequence[tuple[str, str]], timed_out: bool) -> list[str]:
    """The texts of ``hangs`` (:func:`worker_hangs`) that go into :attr:`FaultResult.errors`: every watchdog firing,
    and the long waits for a previous attempt's step too when the replay ran past its bound or a request was lost
    (``timed_out``; :func:`run_fault` passes both: a request that failed on its own bound, below the replay's, is
    lost with the replay in time): they say where the request it names stuck."""
    return [text for kind, text in hangs if kind == "watchdog" or timed_out]


MOONCAKE_HARMLESS = ("Local segment descriptor not found",)
"""Mooncake's glog error lines every worker prints at start (services/worker/kvpool/README.md: harmless)."""


def worker_log_problems(log_dir: Path) -> dict[str, int]:
    """Lines of the workers' logs (``worker-*.log``, every process of a node, twins too) at level warning
    (``warning``) or error (``error``; Mooncake's glog ``E`` / ``F`` lines too), ``Traceback`` lines (``traceback``), and the real-bytes fetches that failed
    (``fetch_failed``: the ``real-bytes fetch failed`` warnings)."""
    out = {"warning": 0, "error": 0, "traceback": 0, "fetch_failed": 0}
    for f in sorted(log_dir.glob("worker-*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if '"level": "warning"' in line:
                out["warning"] += 1
            elif '"level": "error"' in line or '"level": "critical"' in line or (
                    re.match(r"[EF]\d{4} ", line) and not any(h in line for h in MOONCAKE_HARMLESS)):
                out["error"] += 1  # the service's error lines, Mooncake's (glog) E and F ones
            if line.startswith("Traceback"):
                out["traceback"] += 1
            if "real-bytes fetch failed" in line:
                out["fetch_failed"] += 1
    return out


def kv_fetch_summary(r: FaultResult) -> dict[str, int]:
    """The workers' real-bytes fetches (``kvfetch.*`` counters of every worker that answered at the end; a worker
    restarted during the run counts from its restart): calls, blocks fetched, errors (fetches that failed), timeouts
    (of those, the ones past ``--kv-pool-fetch-timeout-s``), mismatched blocks, and the longest a request waited on its
    sources (ms; not counted for a worker the fault froze, :attr:`FaultResult.frozen`)."""
    out = {"calls": 0, "fetched": 0, "errors": 0, "timeouts": 0, "mismatched": 0, "wait_ms_max": 0}
    for inst, c in r.counters.items():
        if not inst.startswith("worker"):
            continue
        out["calls"] += c.get("kvfetch.calls", 0)
        out["fetched"] += c.get("kvfetch.blocks_fetched", 0)
        out["errors"] += c.get("kvfetch.errors", 0)
        out["timeouts"] += c.get("kvpool.fetch_failed.timeout", 0)  # fetches (kvfetch.failed.timeout counts blocks)
        out["mismatched"] += c.get("kvfetch.blocks_mismatched", 0)
        if inst not in r.frozen:  # a frozen worker's own fetch waited through its freeze
            out["wait_ms_max"] = max(out["wait_ms_max"], c.get("kvfetch.wait_ms_max", 0))
    return out


def _left_in_workers(r: FaultResult) -> float:
    """Requests still parked, queued, running or decoding over every worker in :attr:`FaultResult.leftover`."""
    return sum(g.get(k, 0.0) for g in r.leftover.values() for k in ("parked", "queue_depth", "running_batch", "decoding"))


def _frozen_waits_ok(r: FaultResult) -> bool:
    """Whether every worker the fault froze waited on its fetches no longer than :data:`FETCH_WAIT_BOUND_MS` plus its
    own freeze (:attr:`FaultResult.frozen_s`, wall s; none recorded: no allowance)."""
    return all(
        r.counters.get(inst, {}).get("kvfetch.wait_ms_max", 0) <= FETCH_WAIT_BOUND_MS + 1000 * r.frozen_s.get(inst, 0.0)
        for inst in r.frozen
        if inst.startswith("worker")
    )


def _passed(r: FaultResult) -> bool:
    """Nothing lost (a :data:`LOSSY` fault: the replay ended), ``up`` alive, no token count off, nothing left in a
    worker, a SIGTERMed service gone within its compose stop grace (:data:`STOP_GRACE_S`, else 30 s), and no request
    waiting on a real-bytes fetch longer than :data:`FETCH_WAIT_BOUND_MS` (``--kv-pool real``; a worker the fault
    froze: that plus its freeze, :func:`_frozen_waits_ok`), and no worker watchdog firing (:attr:`FaultResult.hangs`)."""
    hung = any(e in h for h in r.hangs for e in WATCHDOG_EVENTS)
    lost_ok = r.lost == 0 or (r.fault in LOSSY and r.lost > 0)
    fetch_ok = kv_fetch_summary(r)["wait_ms_max"] <= FETCH_WAIT_BOUND_MS and _frozen_waits_ok(r)
    exit_s = r.notes.get("exit_s")
    grace = STOP_GRACE_S.get(r.fault.removesuffix("-term"), 30.0)
    term_ok = not isinstance(exit_s, (int, float)) or 0 <= exit_s <= grace
    return lost_ok and fetch_ok and r.up_alive and r.token_mismatch == 0 and _left_in_workers(r) == 0 and term_ok and not hung


def _results_section(results: list[FaultResult], args: argparse.Namespace) -> str:
    sys.path.insert(0, str(REPO / "bench"))
    from _common import commit_label

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    pool = getattr(args, "kv_pool", "off") == "real"
    lines = [
        f"## faults: live cluster under fault injection — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- command: `python bench/faults.py {' '.join(sys.argv[1:])}`",
        f"- commit: {commit_label(REPO)}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load average {load:.1f} at the end",
        f"- workload: `evolving-infra up --nodes {args.nodes} --split {args.split} --speedup {args.speedup:g}"
        + (f" --policy {args.policy}" if args.policy else "")
        + (" --kv-pool real" if pool else "")
        + (f" --routing {args.routing}" if getattr(args, "routing", None) else "")
        + (f" --routers {args.routers}" if getattr(args, "routers", 1) != 1 else "")
        + "".join(f" --routing-opt {o}" for o in (getattr(args, "routing_opt", None) or ()))
        + (" --engine torch` (the tiny random llama on CPU; the trace scaled to it as `replay --scale-to-model`, at most "
           f"{args.max_output} output tokens)" if args.engine == "torch" else "`")
        + f", the shipped Claude Code sample, {args.sessions} sessions closed-loop at concurrency {args.concurrency}"
        + (f", each branch capped to {args.max_requests_per_branch} requests" if args.max_requests_per_branch else "")
        + (f", pauses clipped to {args.max_pause:g} simulated s" if args.max_pause is not None else "")
        + f"; the fault {args.fault_at:g} s into the replay",
        "- lost = failed at the client (non-200, error event, or a stream without tokens) after the replayer's retries "
        "(twice, as the OpenAI SDK: a 429 / 503 or a connection refused or reset before any answer); retried = requests "
        "sent again (completed or not); recover = fault → the victim's new "
        "pid in cluster.json and router /healthz 200",
        "",
        "- re-dispatched: the routers' `redispatched` counter; bus resends: reliable messages published again after "
        "a reconnect (all services)",
        "",
        "- left in workers: parked + queued + running + decoding requests over every worker, `--leftover-after` s after the "
        "replay (/metrics; blank: not read); token mismatch: completed requests whose usage.completion_tokens is not the "
        "length asked for; notes: what the fault measured (`exit_s`: SIGTERM → exit; `after_fault_sent` / "
        f"`after_fault_ttft_max_s`: requests sent in the {AFTER_FAULT_S:g} wall s after the fault and the longest first-token "
        "wait among those that completed, wall s, a retry's wait included; `ttft_p50_s`: every completed request's median)"
        + ("; with several routers (`--routers`) recover waits for the victim's own `/readyz` (its metrics port) too: "
           "the shared port's /healthz is answered by the others" if getattr(args, "routers", 1) > 1 else ""),
        "",
        *([] if not pool else [
            "- kv fetch (`--kv-pool real`): the workers' `kvfetch.*` counters at the end: calls / blocks fetched / errors "
            "(timeouts) / mismatched blocks / the longest a request waited on its sources (ms); a restarted worker counts "
            "from its restart. worker log: warning / error lines and tracebacks in every worker log",
            ""]),
        "| fault | sent | completed | lost | retried | re-dispatched | recover s | restarts | bus resends | up alive | replay wall s "
        "| left in workers | token mismatch | notes | first error |" + (" kv fetch | worker log |" if pool else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if pool else ""),
    ]
    for r in results:
        rec = "" if r.recover_s is None else f"{r.recover_s:.2f}"
        rs = ", ".join(f"{k} {v}" for k, v in sorted(r.restarts.items())) or "none"
        err = (r.errors[0][:80].replace("|", "/") if r.errors else "")
        redis = sum(c.get("redispatched", 0) for k, c in r.counters.items() if k.startswith("router"))
        resent = sum(c.get("resent", 0) for c in r.counters.values())
        left = "" if not r.leftover else f"{_left_in_workers(r):g}"
        notes = ", ".join(f"{k} {v}" for k, v in r.notes.items() if k != "split_errors").replace("|", "/")
        kv = ""
        if pool:
            k, lp = kv_fetch_summary(r), r.log_problems
            kv = (f" {k['calls']} / {k['fetched']} / {k['errors']} ({k['timeouts']}) / {k['mismatched']} / {k['wait_ms_max']} |"
                  f" {lp.get('warning', 0)} / {lp.get('error', 0)} / {lp.get('traceback', 0)} |")
        name = r.fault + (f" ({r.routers} routers)" if r.routers != 1 else "")
        lines.append(f"| {name} | {r.sent} | {r.completed} | {r.lost} | {r.retried} | {redis} | {rec} | {rs} | {resent} | "
                     f"{'yes' if r.up_alive else 'NO'} | {r.replay_wall_s:.1f} | {left} | {r.token_mismatch} | {notes} | {err} |" + kv)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault", action="append", help=f"fault(s) to inject, one run each (default all: {', '.join(FAULTS)})")
    p.add_argument("--list", action="store_true", help="list the faults and exit")
    p.add_argument("--sessions", type=int, default=16, help="Claude Code sessions to replay per run (default 16)")
    p.add_argument("--max-requests-per-branch", type=int, default=0, help="cap each branch to K requests (default 0: no cap)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop concurrent agents (default 8)")
    p.add_argument("--speedup", type=float, default=50.0, help="cluster speedup (default 50)")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--split", default="2P2D")
    p.add_argument("--max-pause", type=float, default=None, help="clip recorded pauses to this many simulated s (default: as recorded)")
    p.add_argument("--fault-at", type=float, default=3.0, help="wall seconds into the replay when the fault hits (default 3)")
    p.add_argument("--leftover-after", type=float, default=5.0,
                   help="read every worker's parked / queued / running gauges this many wall s after the replay (default 5; "
                   "a negative value: not read)")
    p.add_argument("--engine", choices=("sim", "torch"), default="sim",
                   help="workers' engine (default sim); torch: the tiny random llama of `evolving-infra model init` on CPU, "
                   "the trace scaled to it as `replay --scale-to-model` (needs the torch extra)")
    p.add_argument("--max-output", type=int, default=TORCH_MAX_OUTPUT,
                   help=f"--engine torch: output tokens per request at most (default {TORCH_MAX_OUTPUT})")
    p.add_argument("--policy", default=None,
                   help="`up --policy` (default: up's, the evolving planner, which serves every node collocated for its "
                   "1,800-s warm-up: 36 wall s at --speedup 50, so a short replay never sees --split; static:2P2D serves it "
                   "from the start)")
    p.add_argument("--kv-pool", choices=("off", "real"), default="off",
                   help="workers' host KV pool (`up --kv-pool`): real = every L2 block has bytes in a Mooncake buffer and "
                   f"peer fetches pull them over TCP (needs scripts/install-mooncake.sh; sim slots {SIM_POOL_SLOT_BYTES} B)")
    p.add_argument("--routing", default=None,
                   help="`up --routing` over the policy's (static:xPyD's cache-aware plans no peer fetch; ttft does)")
    p.add_argument("--routing-opt", action="append", metavar="K=V",
                   help="`up --routing-opt` (repeatable), e.g. ttft_fetch_base_s=0.001 ttft_fetch_min_tokens=64: the ttft "
                   "router plans a peer fetch wherever a prefix is on another node (a peer-fetch heavy run)")
    p.add_argument("--routers", type=int, default=1, metavar="N",
                   help="`up --routers N`: N router processes on the one port (default 1); router-kill / router-term hit "
                   "the first (`router`) while the others keep serving")
    p.add_argument("--watchdog-timeout-s", type=float, default=None, metavar="S",
                   help="the workers' --watchdog-timeout-s (default: theirs, 300 s); below the replay's bound a hung "
                   "worker step is ended and its record (where it awaited, the stacks) goes into the run's errors; keep "
                   "it above a fault's freeze of a worker (*-stop-long: 40 s)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument("--from-json", default=None, help="render the section from a file written by --out instead of running")
    p.add_argument("--no-results", action="store_true", help="do not append a section to bench/RESULTS-history.md")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(FAULTS))
        return 0
    faults = args.fault or list(FAULTS)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        p.error(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    if args.routers < 1:
        p.error(f"--routers {args.routers}: at least 1")
    if args.watchdog_timeout_s is not None and not args.watchdog_timeout_s > 0:
        p.error(f"--watchdog-timeout-s {args.watchdog_timeout_s}: positive seconds")
    if args.engine == "torch" and not args.from_json:
        import importlib.util

        from services.worker.engines.torch_engine.config import TORCH_EXTRA_INSTALL  # imports no torch

        if importlib.util.find_spec("torch") is None:  # before an `up` starts and its workers fail to import it
            p.error(f"--engine torch needs the torch extra (torch missing): {TORCH_EXTRA_INSTALL}")
        if args.max_output < 1:
            p.error(f"--max-output must be at least 1, not {args.max_output}")
    # SIGTERM (``timeout``, a CI runner's stop) as Ctrl-C: asyncio.run cancels the run, whose ``finally`` stops ``up``
    # (started in a session of its own, so nothing else would): a terminated run left the whole cluster running
    # SIGINT at its default first: a parent that ignores it (a pytest-xdist worker, nohup) passes SIG_IGN on, and then
    # neither Ctrl-C nor this SIGTERM reached the run, and up, started with it ignored too, outlived stop_up's SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: signal.raise_signal(signal.SIGINT))
    results: list[FaultResult] = []
    if args.from_json:
        results = [FaultResult(**d) for d in json.loads(Path(args.from_json).read_text())]
        faults = []
    for f in faults:
        r = asyncio.run(
            run_fault(f, sessions=args.sessions, max_requests_per_branch=args.max_requests_per_branch, concurrency=args.concurrency,
                      speedup=args.speedup, nodes=args.nodes, split=args.split, fault_at_s=args.fault_at,
                      max_pause_s=args.max_pause, leftover_after_s=None if args.leftover_after < 0 else args.leftover_after,
                      engine=args.engine, max_output=args.max_output, policy=args.policy, kv_pool=args.kv_pool,
                      routing_opts=tuple(args.routing_opt or ()), routing=args.routing, routers=args.routers,
                      watchdog_timeout_s=args.watchdog_timeout_s)
        )
        print(json.dumps(asdict(r)), flush=True)
        results.append(r)
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    section = _results_section(results, args)
    print(section)
    if not args.no_results:
        with open(REPO / "bench" / "RESULTS-history.md", "a") as fh:
            fh.write("\n" + section)
    return 0 if all(_passed(r) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
