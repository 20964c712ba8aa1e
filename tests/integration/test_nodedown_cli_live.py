"""``python -m evolving_infra.nodedown``, the Slurm job's announce of a worker exit (``deploy/slurm``), over a real
nats-server with per-service nkeys: the launcher's credentials tell the routers, a worker's are refused and it says
so, a bad argument is one line and status 2, no server is status 1 within its bound."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from shared import messages as m
from shared.auth import generate
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import NODE_DOWN, Subjects
from tests.integration.live import wait_for

REPO = Path(__file__).resolve().parents[2]


async def announce(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EI_NATS_URL": url, "EI_PARTITION": "p0", "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "evolving_infra.nodedown", *args, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


async def test_the_launcher_s_notice_reaches_the_router_and_a_worker_s_is_refused(tmp_path):
    creds = generate(tmp_path / "creds", ["worker-w0", "router"])
    with EmbeddedNatsServer(auth_block=creds.server_block) as srv:
        router = await Bus.connect(srv.url, Subjects("p0"), service="router", instance="router", auth=creds.auth_for("router"))
        got: list[m.NodeDown] = []

        async def heard(msg: m.NodeDown, _s: str) -> None:
            got.append(msg)

        try:
            await router.subscribe(NODE_DOWN, heard)
            await router.flush()
            ok = await announce(srv.url, "--node", "w0", "--pid", "4321", "--code", "-9", "--creds", str(creds.directory / "launcher.nk"))
            await wait_for(lambda: len(got) == 1, what="the notice")
            refused = await announce(srv.url, "--node", "w0", "--pid", "4322", "--creds", str(creds.directory / "worker-w0.nk"))
            bad = await announce(srv.url, "--node", "w.0", "--pid", "1")
            await asyncio.sleep(0.3)  # a refused notice would have come by now
        finally:
            await router.close()
    assert ok.returncode == 0 and "published that worker-w0 (pid 4321) exited (node.down): a router fences it now if the pid is the one the node reports" in ok.stdout, ok
    assert [(d.node, d.pid, d.code, d.src) for d in got] == [("w0", 4321, -9, "launcher")], got
    assert abs(got[0].exited_ns - time.time_ns()) < 60e9
    assert refused.returncode == 1 and "NATS refused node.down" in refused.stdout and "auth gen" in refused.stdout, refused
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr, bad


async def test_no_nats_server_is_status_1_within_its_bound():
    t0 = time.monotonic()
    r = await announce("nats://127.0.0.1:1", "--node", "w0", "--pid", "5")
    assert r.returncode == 1 and "could not tell the routers that worker-w0 (pid 5) exited" in r.stdout, r
    assert "Traceback" not in r.stdout + r.stderr and time.monotonic() - t0 < 15
