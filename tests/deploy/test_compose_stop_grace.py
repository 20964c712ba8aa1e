"""``docker compose stop``/``down`` gives each long-running service the time its drain takes before SIGKILL.

Compose's default stop grace is 10 s. The router's stop (SIGTERM) fails its in-flight requests, then waits
up to 10 s for its HTTP connections to close (uvicorn's own 5 s, then forced), up to 2 s for its metrics
server and up to 5 s for the NATS drain: 17 s by its own bounds. Measured, the sbatch harness's real
services (the process compose's entrypoint execs), SIGTERM to exit: 14.05 s for the router with 32
streamed completions in flight on this 2-core host under other load (0.5-1.2 s when it was idle, 16 or 64
streams), 0.4-1.4 s for a worker; in compose itself (docker-compose 1.29 on a private dockerd, the sim image,
32 streams in flight, the host less loaded) the router's 'service stopping' to its container's end 1.6 s and
a worker's 1.3 s, both exit 0. A worker SIGKILLed mid-stop never announces that its KV is gone, and the
directory keeps offering its blocks. docker-compose.yml now sets ``stop_grace_period: 30s`` (Slurm's
default ``KillWait`` is 30 s too) on every service that drains.

Since the router's SIGTERM first lets its requests in flight finish, up to ``--shutdown-grace-s`` (20 s by
default, ``services/router/config.py``), the router's own ``stop_grace_period`` is 50 s: that drain, then
the stop's 17 s, and a margin.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.router.config import RouterConfig

REPO = Path(__file__).resolve().parents[2]
DRAINING = ("nats", "kvdirectory", "planner", "router", "worker")
ROUTER_STOP_BOUND_S = 10 + 2 + 5  # HTTP connections, metrics server, NATS drain (see the module docstring)
ROUTER_DRAIN_S = RouterConfig().shutdown_grace_s  # before that stop, on SIGTERM


def _seconds(value: str) -> float:
    """A compose duration (``30s``, ``1m30s``, ``1m``, ``500ms``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s|us)", str(value))
    assert parts and "".join(n + u for n, u in parts) == str(value), f"not a compose duration: {value!r}"
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def test_every_service_that_drains_has_a_stop_grace_period_beyond_the_router_s_drain():
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]  # anchors merged by YAML
    for name in DRAINING:
        grace = services[name].get("stop_grace_period")
        assert grace is not None, f"{name}: no stop_grace_period (compose's default 10 s, SIGKILL after)"
        assert _seconds(grace) >= ROUTER_STOP_BOUND_S + 10, (name, grace)
    assert _seconds(services["router"]["stop_grace_period"]) >= ROUTER_DRAIN_S + ROUTER_STOP_BOUND_S + 10


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="needs docker-compose (.ci/run installs it)")
def test_docker_compose_reads_the_stop_grace_period():
    out = subprocess.run(["docker-compose", "-f", str(REPO / "docker-compose.yml"), "config"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.count("stop_grace_period: 30s") == len(DRAINING) - 1 and out.count("stop_grace_period: 50s") == 1, out
