"""``up --metrics``: each service's metrics port is held by the cluster from its choice to the stop and passed to
the service (``--metrics-fd``). Real processes over a real nats-server: every service serves its ``/metrics`` on the
socket it inherited (the cluster's socket listens on that port, so a service that bound the port itself could not),
nobody else can take the port, and a worker killed and restarted by the supervisor serves on the same port again.
Before, ``up`` picked a free port and the service bound it moments later: a process that took it in between made
the service exit 1 at its start and, its argv naming the same port, at each restart (seen once)."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import time

import httpx
import pytest

from evolving_infra.cluster import ClusterSpec, LocalCluster

pytestmark = pytest.mark.timeout(180)


async def _scrape(url: str) -> int:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(url)).status_code


async def test_every_service_serves_metrics_on_the_port_up_holds_across_a_restart(tmp_path):
    spec = ClusterSpec(nodes=1, split="collocated", profile="tiny", port=0, metrics=True, restart=True,
                       restart_backoff_s=0.1, log_dir=str(tmp_path / "logs"), ready_timeout_s=120.0)  # fmt: skip
    async with LocalCluster(spec) as cluster:
        assert set(cluster.metrics_urls) == {"router", "planner", "kvdirectory", "worker-w0"}
        for name, url in cluster.metrics_urls.items():
            assert await _scrape(url) == 200, name
        port = int(cluster.metrics_urls["worker-w0"].rsplit(":", 1)[1].split("/")[0])
        worker = next(c for c in cluster.children if c.name == "worker-w0")
        assert "--metrics-fd" in worker.argv
        os.kill(worker.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        worker.proc.wait()  # type: ignore[union-attr]
        with socket.socket() as other, pytest.raises(OSError) as e:  # between two runs: still the cluster's
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE
        deadline = time.monotonic() + 60
        while cluster.restarts().get("worker-w0", 0) < 1:
            assert time.monotonic() < deadline, "worker-w0 not restarted"
            await asyncio.sleep(0.1)
        status = 0
        while status != 200:  # the restarted worker serves on the same port (its accept queue held the scrape)
            assert time.monotonic() < deadline, "worker-w0's metrics port not served after its restart"
            try:
                status = await _scrape(cluster.metrics_urls["worker-w0"])
            except httpx.HTTPError:
                await asyncio.sleep(0.1)
        assert worker.proc.poll() is None  # type: ignore[union-attr]
