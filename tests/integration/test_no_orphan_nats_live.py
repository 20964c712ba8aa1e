"""No nats-server outlives its owner: killed owner, failed or cancelled cluster start-up.

The embedded server runs in its own session (so a terminal's Ctrl-C reaches the
launcher, which stops the services before NATS). Before the fix an owner killed
by SIGTERM/SIGKILL (a test run timed out, a CI job cancelled) left the server
running for good, and a ``LocalCluster`` start-up that failed or was cancelled
between starting NATS and waiting for the services left it running too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evolving_infra.cluster import ClusterSpec, LocalCluster

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

OWNER = """
import sys, time
from shared.natsserver import EmbeddedNatsServer
srv = EmbeddedNatsServer().start()
print(srv.pid, flush=True)
time.sleep(120)
"""


FAULTKIT_OWNER = """
import asyncio, sys
from pathlib import Path
from evolving_infra.faultkit import FaultCluster, FaultSpec

async def main():
    fc = FaultCluster(FaultSpec(nodes=2, split="1P1D", profile="tiny", block_size=4), Path(sys.argv[1]))
    await fc.start()
    print(" ".join(str(p.proc.pid) for p in fc.procs.values()), fc.nats.pid, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_server_dies_with_its_owner(sig):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    server_pid = 0
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        owner.send_signal(sig)  # no clean-up code runs in the owner
        owner.wait(timeout=30)
        assert _gone_within(server_pid, 15.0), f"nats-server {server_pid} outlived its owner ({signal.Signals(sig).name})"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if server_pid:
            try:
                os.kill(server_pid, signal.SIGKILL)  # do not leave it behind when the test fails
            except ProcessLookupError:
                pass


def test_fault_cluster_services_and_server_die_with_a_killed_owner(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", FAULTKIT_OWNER, str(tmp_path / "fc")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    pids: list[int] = []
    try:
        assert owner.stdout is not None
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) >= 5, pids  # router, planner, kvdirectory, 2 workers (+ nats-server)
        owner.kill()
        owner.wait(timeout=30)
        left = [p for p in pids if not _gone_within(p, 15.0)]
        assert not left, f"outlived the killed FaultCluster owner: {left}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def test_cancelled_cluster_start_stops_its_server(tmp_path):
    cluster = LocalCluster(ClusterSpec(nodes=2, split="1P1D", profile="tiny", port=0, log_dir=str(tmp_path / "logs"), nats_auth="off"))
    start = asyncio.create_task(cluster.start())
    deadline = time.monotonic() + 60
    while cluster.nats is None:  # NATS is up; the launcher is connecting or the services are starting
        assert not start.done(), start
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    server_pid = cluster.nats.pid
    assert server_pid
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    try:
        assert _gone_within(server_pid, 15.0), "nats-server left running after a cancelled start-up"
        assert cluster.nats is None
    finally:
        try:
            os.kill(server_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
