"""``up --routers N`` without processes: the flag's checks, the router children ``LocalCluster`` plans (one held
socket, one identity, port file and log each), their fixed metrics ports and Prometheus labels, and the banner line.
The processes themselves: ``tests/e2e/test_up_routers.py``."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from evolving_infra.cli import UsageError, build_parser
from evolving_infra.cluster import ClusterSpec, LocalCluster, _Child, is_router, router_names
from evolving_infra.launcher import _spec, routers_line
from shared.natsserver import EmbeddedNatsServer


def _args(tmp_path, *extra: str):  # type: ignore[no-untyped-def]
    return build_parser("up").parse_args(["up", "--nodes", "2", "--log-dir", str(tmp_path), *extra])


@pytest.mark.parametrize("n", ["0", "-1"])
def test_fewer_than_one_router_is_a_usage_error(tmp_path, n):
    with pytest.raises(UsageError, match=f"--routers {n}: a cluster needs at least one router process"):
        _spec(_args(tmp_path, "--routers", n))
    with pytest.raises(ValueError, match="at least one router"):
        router_names(int(n))


def test_router_names_and_which_instances_are_routers():
    assert router_names(1) == ["router"]
    assert router_names(3) == ["router", "router-1", "router-2"]
    assert [is_router(n) for n in ("router", "router-1", "router-12", "router-x", "routers", "worker-w0", "planner")] == [
        True, True, True, False, False, False, False]


def test_each_router_serves_the_held_socket_with_its_own_identity_port_file_and_log(tmp_path, monkeypatch):
    monkeypatch.delenv("EI_METRICS_PORT", raising=False)
    spec = _spec(_args(tmp_path, "--routers", "3", "--metrics-base-port", "19650"))
    assert spec.routers == 3 and spec.router_names() == ["router", "router-1", "router-2"]
    c = LocalCluster(spec)
    c.log_dir = tmp_path
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        c.router_socket = held
        kids = {k.name: k for k in c._plan_children()}
        port = held.getsockname()[1]
        for name in ("router", "router-1", "router-2"):
            argv = kids[name].argv
            assert argv[argv.index("--instance") + 1] == name
            # the held router socket, and its own metrics socket (--metrics-fd)
            metrics_fd = int(argv[argv.index("--metrics-fd") + 1])
            assert argv[argv.index("--listen-fd") + 1] == str(held.fileno())
            assert kids[name].pass_fds == (held.fileno(), metrics_fd) and metrics_fd == c.metrics_sockets[name].fileno()
            assert argv[argv.index("--port") + 1] == str(port)
            assert argv[argv.index("--port-file") + 1] == str(tmp_path / f"{name}.port")
            assert kids[name].log_path == tmp_path / f"{name}.log"
    # the Slurm job's layout as before (router P+2, wN P+3+N), the other routers after the workers
    ports = {k: int(v.rsplit(":", 1)[1].split("/")[0]) for k, v in c.metrics_urls.items()}
    assert ports == {"kvdirectory": 19650, "planner": 19651, "router": 19652, "worker-w0": 19653, "worker-w1": 19654,
                     "router-1": 19655, "router-2": 19656}
    path = c.write_targets()
    assert path is not None
    routers = sorted((t["labels"]["router"], t["targets"][0]) for t in json.loads(path.read_text()) if t["labels"]["service"] == "router")
    assert routers == [("router", "127.0.0.1:19652"), ("router-1", "127.0.0.1:19655"), ("router-2", "127.0.0.1:19656")]
    asyncio.run(c.stop())  # closes the metrics sockets the plan bound


def test_one_router_keeps_its_labels_and_the_base_port_range_counts_every_router(tmp_path, monkeypatch):
    monkeypatch.delenv("EI_METRICS_PORT", raising=False)
    c = LocalCluster(_spec(_args(tmp_path, "--metrics-base-port", "19670")))
    c.log_dir = tmp_path
    c._plan_children()
    assert [t["labels"] for t in c.prometheus_targets() if t["labels"]["service"] == "router"] == [{"service": "router"}]
    asyncio.run(c.stop())
    # 2 nodes + planner + directory + 3 routers = 7 ports: the last base that fits is 65529
    assert _spec(_args(tmp_path, "--routers", "3", "--metrics-base-port", "65529")).metrics_base_port == 65529
    with pytest.raises(UsageError, match="--metrics-base-port 65530: 7 ports from it"):
        _spec(_args(tmp_path, "--routers", "3", "--metrics-base-port", "65530"))


def test_the_socket_is_held_with_restarts_or_several_routers_and_the_banner_says_what_n_routers_do():
    assert ClusterSpec(restart=True).holds_router_socket()
    assert not ClusterSpec(restart=False).holds_router_socket()  # one router, no next one: it binds its own port
    assert ClusterSpec(restart=False, routers=2).holds_router_socket()  # the other router takes the queue of a draining one
    assert routers_line(ClusterSpec(routers=1)) is None
    line = routers_line(ClusterSpec(routers=2, restart=True))
    assert line is not None and line.startswith("2 routers (router, router-1) on one port") and "others serving" in line
    assert "router, router-1, ..., router-5" in (routers_line(ClusterSpec(routers=6, restart=False)) or "")
    assert "--no-restart" in (routers_line(ClusterSpec(routers=2, restart=False)) or "")


def test_demo_takes_the_flag_too(tmp_path):
    args = build_parser("demo").parse_args(["demo", "--routers", "2", "--out", str(tmp_path)])
    assert args.routers == 2


def test_given_credentials_without_the_other_routers_identities_are_refused_before_anything_starts(tmp_path):
    """``up --nats-url ... --nats-creds-dir D --routers 2`` with ``auth gen``'s default routers (``router`` only): the
    second router would connect without credentials, be refused, and ``up`` wait out --ready-timeout; it says which
    identities are missing and how to make them instead."""
    from evolving_infra.cluster import ClusterConfigError

    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "router.nk").write_text("seed\n")
    spec = ClusterSpec(nats_url="nats://127.0.0.1:1", nats_creds_dir=str(creds), routers=3, port=0, log_dir=str(tmp_path / "logs"))
    with pytest.raises(ClusterConfigError, match=r"no credentials for router-1, router-2 \(--routers 3\).*auth gen --routers router,router-1,router-2"):
        asyncio.run(LocalCluster(spec).start())
    for name in ("router-1", "router-2"):  # with them, the check passes (and the start goes on to NATS: not run here)
        (creds / f"{name}.nk").write_text("seed\n")
    c = LocalCluster(spec)
    c.log_dir = tmp_path / "logs"
    assert all(c.creds_file(n) for n in spec.router_names())


def test_the_drain_wait_of_a_stop_on_its_own_is_the_routers_shutdown_grace(tmp_path, monkeypatch):
    """``LocalCluster.stop(drain_routers=True)`` waits up to the routers' ``--shutdown-grace-s`` (+ 5 s): the last one
    in ``router_args``, else ``EI_SHUTDOWN_GRACE_S``, else the router's default (20 s); a value the router would refuse
    reads as the default here (the router itself says why at its start)."""
    monkeypatch.delenv("EI_SHUTDOWN_GRACE_S", raising=False)
    spec = _spec(_args(tmp_path))
    assert LocalCluster(spec).router_grace_s() == 20.0
    monkeypatch.setenv("EI_SHUTDOWN_GRACE_S", "7.5")
    assert LocalCluster(spec).router_grace_s() == 7.5
    cases: list[tuple[tuple[str, ...], float]] = [
        (("--shutdown-grace-s", "3"), 3.0),
        (("--shutdown-grace-s=4", "--shutdown-grace-s", "2"), 2.0),
        (("--shutdown-grace-s", "x"), 20.0),
        (("--shutdown-grace-s=-1",), 20.0),
    ]
    for args, want in cases:
        assert LocalCluster(msgspec.structs.replace(spec, router_args=args)).router_grace_s() == want, args


def _draining_router(tmp_path: Path) -> _Child:
    """A process named ``router`` that keeps draining: SIGTERM ignored (a router with streams open), SIGINT (its quick
    stop) ends it."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
    router = _Child("router", [sys.executable, "-c", code], tmp_path / "router.log")
    router.proc = subprocess.Popen(router.argv, stdout=subprocess.PIPE)
    assert router.proc.stdout is not None and router.proc.stdout.readline() == b"up\n"  # its SIGTERM is ignored now
    return router


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_stop_on_its_own_does_not_wait_out_the_routers_drain_once_the_nats_server_died(tmp_path, monkeypatch, when):
    """rr-mr2: ``up --no-restart`` stopping because its nats-server died (``drain_routers=True``) SIGTERMed the routers
    and waited their whole ``--shutdown-grace-s`` (+ 5 s: 21.4 s in a review's run, ~1 s before that drain), though no
    stream can finish without the bus. Now no drain when the embedded nats-server is dead, and a drain ends when it
    dies meanwhile. Real nats-server, real processes; grace 20 s: before, this stop took 25 s."""
    monkeypatch.setenv("EI_SHUTDOWN_GRACE_S", "20")
    c = LocalCluster(_spec(_args(tmp_path)))
    c.log_dir = tmp_path
    router = _draining_router(tmp_path)
    c.children = [router]
    c.nats = EmbeddedNatsServer(jetstream=False).start()
    assert c.nats.proc is not None
    if when == "before":
        c.nats.proc.kill()
        c.nats.proc.wait()
    else:
        threading.Timer(0.5, c.nats.proc.kill).start()
    t0 = time.monotonic()
    try:
        asyncio.run(c.stop(drain_routers=True))
    finally:
        if router.proc.poll() is None:
            router.proc.kill()
        router.proc.wait()
    took = time.monotonic() - t0
    assert took < 5.0, took
    assert router.proc.returncode != 0  # ended by its quick stop (SIGINT), not a drain
