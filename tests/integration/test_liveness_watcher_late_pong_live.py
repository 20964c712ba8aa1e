"""The Slurm job's liveness watcher (``python -m evolving_infra.liveness``, :class:`evolving_infra.liveness.Watcher`)
after a PONG that came later than its probe's deadline (real nats-server; a loopback proxy between the watcher and
the server holds the server's bytes for a while, as a server that hangs a few seconds).

Before, the watcher's probe was ``asyncio.wait_for(nc.flush(), NATS_PROBE_TIMEOUT_S)``: at the deadline the PONG's
future was cancelled while nats-py still held it, and the late PONG ended nats-py's read loop (``InvalidStateError``
in ``_process_pong``). The watcher's connection stayed "connected" and read nothing (no heartbeat came again), while
its ``flush`` returned at once (a client whose read loop ended sends no PING): the bus looked healthy, every head
service looked silent, and the watcher SIGKILLed each of them after the liveness timeout.

Run twice: with the nats-py internals ``shared.natsping`` reads, and as with a nats-py without them (its fallback).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from argparse import Namespace

import pytest

from evolving_infra.liveness import NATS_PROBE_TIMEOUT_S, Watcher
from shared import messages as m
from shared import natsping
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import SVC_HEARTBEAT, Subjects
from tests.integration.nats_proxy import NatsProxy

pytestmark = pytest.mark.timeout(90)

TIMEOUT_S = 6.0
"""The watch's liveness timeout here (wall s): more than the hold below (no kill for the hold itself), less than the
time the test watches after it."""


async def _until(cond, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {limit_s} s: {what}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("internals", [True, False], ids=["internals", "fallback"])
async def test_a_pong_later_than_the_watcher_s_deadline_leaves_it_hearing_heartbeats(tmp_path, monkeypatch, internals):
    if not internals:  # this nats-py seen as one without _pongs and _reading_task (the real ones still work)
        monkeypatch.setattr(natsping, "PONGS_ATTR", "_pongs_not_in_this_nats_py")
        monkeypatch.setattr(natsping, "READING_ATTR", "_reading_task_not_in_this_nats_py")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the watched "router"
    (tmp_path / "router.pid").write_text(f"{child.pid} {os.getpid()}")
    with EmbeddedNatsServer() as srv:
        proxy = NatsProxy(int(srv.url.rsplit(":", 1)[1]))
        url = await proxy.start()
        monkeypatch.setenv("EI_NATS_URL", url)
        monkeypatch.setenv("EI_PARTITION", "p0")
        beater = await Bus.connect(srv.url, Subjects("p0"), service="router", instance="router")  # straight to the server
        stop = asyncio.Event()

        async def beat() -> None:
            while not stop.is_set():
                await beater.publish(SVC_HEARTBEAT, m.Heartbeat(service="router", instance="router", pid=child.pid), service="router")
                await asyncio.sleep(0.25)

        watcher = Watcher(Namespace(pid_dir=str(tmp_path), services=["router"], nats_port=None, creds="",
                                    timeout_s=TIMEOUT_S, start_timeout_s=TIMEOUT_S))  # fmt: skip
        beating = asyncio.create_task(beat())
        running = asyncio.create_task(watcher.run())
        try:
            await _until(lambda: watcher.bus is not None and watcher.watch.bus_last_ok is not None, 20, "the watcher's PING answered")
            w = watcher.watch.procs
            await _until(lambda: w.get("router") is not None and w["router"].last_ok is not None, 10, "a heartbeat seen")
            link = proxy.links[0]
            link.flowing.clear()  # the server's bytes (PONGs, heartbeats) wait in the proxy: a PING outlives its deadline
            await asyncio.sleep(NATS_PROBE_TIMEOUT_S + 2.0)
            link.flowing.set()  # the late PONG, then what was held
            released = time.monotonic()
            await asyncio.sleep(TIMEOUT_S + 5.0)  # a deaf watcher judges again ~3 s after (its next PING "answers" at once), kills 6 s later
            assert child.poll() is None, "the watcher SIGKILLed a router that beat all along"
            proc = w["router"]
            assert proc is not None and not proc.killed, proc
            assert proc.last_ok is not None and proc.last_ok > released + 1.0, (
                f"no heartbeat heard since the late PONG (last {proc.last_ok}, released {released})"
            )
            reading = watcher.bus.nc._reading_task if watcher.bus is not None else None
            assert reading is not None and not reading.done(), f"the watcher's nats-py read loop ended: {reading!r}"
        finally:
            stop.set()
            running.cancel()
            beating.cancel()
            await asyncio.gather(running, beating, return_exceptions=True)
            if watcher.bus is not None:
                await watcher.bus.close()
            await beater.close()
            await proxy.close()
            child.kill()
            child.wait()
