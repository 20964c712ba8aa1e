"""``up``'s metrics ports (issue of a vLLM/Dynamo operator): ``EI_METRICS_PORT=19450 evolving-infra up`` gave every
child the same port (the second to bind it exited 1, Address already in use, and the cluster stopped); ``--metrics``
ports were random each start with no Prometheus ``file_sd`` file, which only the Slurm job wrote."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from evolving_infra.cli import UsageError, build_parser
from evolving_infra.cluster import TARGETS_FILE, ClusterSpec, LocalCluster, _Child
from evolving_infra.launcher import _spec, nats_auth_line


def _free_base(width: int) -> int:
    """The first of ``width`` adjacent ports free now (in 20000-32767, ``kvpool.transport.pick_port_ranges``): a
    fixed ``--metrics-base-port`` that the cluster binds and listens on. The tests that bind took fixed ports
    19450-19454 and 19470-19474, and failed (Address already in use) wherever a process held one."""
    from services.worker.kvpool.transport import pick_port_ranges

    return pick_port_ranges(1, width=width)[0][0]


def test_ei_metrics_port_in_ups_environment_is_a_usage_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("EI_METRICS_PORT", "19450")
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path)])
    with pytest.raises(UsageError, match="EI_METRICS_PORT=19450 is one service's metrics port.*--metrics-base-port 19450"):
        _spec(args)
    monkeypatch.setenv("EI_METRICS_PORT", "0")  # off: nothing to refuse
    assert not _spec(build_parser("up").parse_args(["up", "--log-dir", str(tmp_path)])).metrics


def test_no_child_inherits_a_per_service_variable_of_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("EI_METRICS_PORT", "19450")
    monkeypatch.setenv("EI_PORT", "8001")
    monkeypatch.setenv("EI_LOG_LEVEL", "debug")  # a setting every service shares is kept
    c = LocalCluster(ClusterSpec(log_dir=str(tmp_path)))
    code = "import os; print(os.environ.get('EI_METRICS_PORT'), os.environ.get('EI_PORT'), os.environ.get('EI_LOG_LEVEL'), os.environ.get('MINE'))"
    child = _Child("probe", [sys.executable, "-c", code], tmp_path / "probe.log", env={"MINE": "x"})
    c._spawn(child)
    assert child.proc is not None and child.proc.wait(30) == 0
    child.log_file.close()  # type: ignore[attr-defined]
    assert (tmp_path / "probe.log").read_text().split() == ["None", "None", "debug", "x"]


def test_metrics_base_port_gives_the_slurm_jobs_ports_and_a_file_sd_list_emptied_at_stop(tmp_path, monkeypatch):
    monkeypatch.delenv("EI_METRICS_PORT", raising=False)
    b = _free_base(5)  # the cluster binds them (_plan_children holds each service's port)
    args = build_parser("up").parse_args(["up", "--nodes", "2", "--metrics-base-port", str(b), "--log-dir", str(tmp_path)])
    spec = _spec(args)
    assert spec.metrics and spec.metrics_base_port == b
    c = LocalCluster(spec)
    c.log_dir = tmp_path
    c._plan_children()
    assert {k: int(v.rsplit(":", 1)[1].split("/")[0]) for k, v in c.metrics_urls.items()} == {
        "kvdirectory": b, "planner": b + 1, "router": b + 2, "worker-w0": b + 3, "worker-w1": b + 4,
    }
    path = c.write_targets()
    assert path == tmp_path / TARGETS_FILE
    listed = json.loads(path.read_text())
    assert sorted((t["labels"].get("node", ""), t["labels"]["service"], t["targets"][0]) for t in listed) == [
        ("", "kvdirectory", f"127.0.0.1:{b}"), ("", "planner", f"127.0.0.1:{b + 1}"), ("", "router", f"127.0.0.1:{b + 2}"),
        ("w0", "worker", f"127.0.0.1:{b + 3}"), ("w1", "worker", f"127.0.0.1:{b + 4}"),
    ]
    assert c.describe()["prometheus_targets"] == str(path)
    asyncio.run(c.stop())
    assert json.loads(path.read_text()) == []  # as the Slurm job leaves it: a file_sd glob scrapes nothing


@pytest.mark.parametrize("port", ["0", "80", "65534"])
def test_a_base_port_whose_range_does_not_fit_is_a_usage_error(port, tmp_path):
    """0 as well: it silently turned metrics off while 80 was refused (newcomer walk)."""
    args = build_parser("up").parse_args(["up", "--metrics-base-port", port, "--log-dir", str(tmp_path)])
    with pytest.raises(UsageError, match=rf"--metrics-base-port {port}: \d+ ports from it must lie within 1024-65535"):
        _spec(args)


def test_the_state_files_paths_are_absolute_for_tools_run_from_another_folder(tmp_path, monkeypatch):
    """``make demo`` (``--out demo-out``) wrote ``demo-out/logs/nats-creds/operator.nk`` into its state file, so
    ``split get`` or ``tap`` run from another folder failed: cannot read NATS credentials (newcomer walk, s44)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "creds").mkdir()
    for name in ("operator", "admin"):
        (tmp_path / "creds" / f"{name}.nk").write_text("seed\n")
    c = LocalCluster(ClusterSpec(log_dir="demo-out/logs", nats_url="nats://127.0.0.1:4222", nats_creds_dir="creds"))
    c.log_dir = Path("demo-out/logs")
    c.metrics_urls = {"router": "http://127.0.0.1:1/metrics"}
    info = c.describe()
    assert info["log_dir"] == str(tmp_path / "demo-out" / "logs")
    assert info["nats_operator_creds"] == str(tmp_path / "creds" / "operator.nk")
    assert info["nats_admin_creds"] == str(tmp_path / "creds" / "admin.nk")
    assert info["prometheus_targets"] == str(tmp_path / "demo-out" / "logs" / TARGETS_FILE)
    # up's banner says the same path, for a shell elsewhere
    assert nats_auth_line("nkeys", info).endswith(f"elsewhere: EI_NATS_CREDS={tmp_path / 'creds' / 'operator.nk'}")


def test_the_state_files_paths_name_their_folder_without_dot_dot(tmp_path, monkeypatch):
    """``up --log-dir ../logs`` run in ``work/`` wrote ``/.../work/../logs`` into READY, cluster.json and the state file
    (``Path.absolute`` keeps ``..``): a path one level deeper than the folder it names, which a reader (or a
    lexical clean-up such as ``os.path.abspath``) takes for another folder when a component is a symlink
    (``link/../../creds``). Each path is now the folder itself, symlinks resolved."""
    (tmp_path / "work").mkdir()
    (tmp_path / "elsewhere" / "deep" / "er").mkdir(parents=True)
    (tmp_path / "work" / "link").symlink_to(tmp_path / "elsewhere" / "deep" / "er")
    (tmp_path / "elsewhere" / "creds").mkdir()
    for name in ("operator", "admin"):
        (tmp_path / "elsewhere" / "creds" / f"{name}.nk").write_text("seed\n")
    monkeypatch.chdir(tmp_path / "work")
    c = LocalCluster(ClusterSpec(log_dir="../logs", nats_url="nats://127.0.0.1:4222", nats_creds_dir="link/../../creds"))
    c.log_dir = Path("../logs")
    c.metrics_urls = {"router": "http://127.0.0.1:1/metrics"}
    info = c.describe()
    root = tmp_path.resolve()
    assert info["log_dir"] == str(root / "logs")
    assert info["prometheus_targets"] == str(root / "logs" / TARGETS_FILE)
    # link/../../creds is elsewhere/creds for the kernel (link is elsewhere/deep/er), the file the cluster reads; a
    # lexical clean-up (os.path.abspath) would name tmp_path/creds, which does not exist
    assert info["nats_operator_creds"] == str(root / "elsewhere" / "creds" / "operator.nk")
    assert info["nats_admin_creds"] == str(root / "elsewhere" / "creds" / "admin.nk")


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_out_of_range_is_a_usage_error_before_anything_starts(port, capsys):
    """``up --port 99999`` started NATS and every service, then exited 1 on the router's msgspec error."""
    for cmd in ("up", "demo"):
        with pytest.raises(SystemExit) as e:
            build_parser(cmd).parse_args([cmd, "--port", port])
        assert e.value.code == 2
        assert "0-65535 (0 = any free port)" in capsys.readouterr().err


@pytest.mark.parametrize("fixed", [False, True])
def test_up_holds_each_metrics_port_from_its_choice_until_the_stop(tmp_path, monkeypatch, fixed):
    """``up --metrics`` chose a free port per service and the service bound it moments later: a process that took
    the port in between made the service exit 1 (Address already in use) at its start, and, its argv naming the same
    port, at every restart until the supervisor gave up (seen once). Now ``up`` binds and listens on each port when it
    plans the services (a fixed ``--metrics-base-port`` one too) and passes the socket (``--metrics-fd``): nobody else
    can take it, before the start or between two runs of the service, and it is closed at the stop."""
    import errno
    import socket

    monkeypatch.delenv("EI_METRICS_PORT", raising=False)
    base = _free_base(5) if fixed else 0
    c = LocalCluster(ClusterSpec(nodes=2, split="1P1D", metrics=True, metrics_base_port=base, log_dir=str(tmp_path)))
    c.log_dir = tmp_path
    kids = c._plan_children()
    ports = {k: int(v.rsplit(":", 1)[1].split("/")[0]) for k, v in c.metrics_urls.items()}
    assert len(set(ports.values())) == 5 and (not base or sorted(ports.values()) == list(range(base, base + 5)))
    try:
        for kid in kids:
            instance = kid.argv[kid.argv.index("--instance") + 1]
            fd = int(kid.argv[kid.argv.index("--metrics-fd") + 1])
            assert fd in kid.pass_fds, kid.name  # the service inherits it
            with socket.socket(fileno=os.dup(fd)) as held:
                assert held.getsockname()[1] == ports[instance] == int(kid.argv[kid.argv.index("--metrics-port") + 1])
                assert held.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            with socket.socket() as other, pytest.raises(OSError) as e:  # what took the port before: it cannot now
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                other.bind(("127.0.0.1", ports[instance]))
            assert e.value.errno == errno.EADDRINUSE
    finally:
        asyncio.run(c.stop())
    for port in ports.values():  # closed at the stop
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_a_fixed_metrics_port_that_is_taken_is_one_error_before_any_service_starts(tmp_path, monkeypatch):
    """A ``--metrics-base-port`` port in use: one ``ClusterError`` naming the service and the port when the cluster
    plans its services (``up``: "error: ...", status 1), not a service exiting 1 at its start and at every restart."""
    import socket

    from evolving_infra.cluster import ClusterError

    monkeypatch.delenv("EI_METRICS_PORT", raising=False)
    # base .. base + 3: the KV directory, the planner, the router, worker-w0, bound in the order kvdirectory, planner,
    # worker-w0, router. All four were free a moment ago and lie outside the kernel's ephemeral range (``_free_base``):
    # only the router's is taken, by this test. Before, base was a kernel-chosen (ephemeral) port less 2, so worker-w0's
    # port was an ephemeral one that another process's connection could hold (the other xdist lane's clusters):
    # "worker-w0: cannot listen for metrics on 127.0.0.1:<base + 3>", not the router's error
    base = _free_base(4)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        c = LocalCluster(ClusterSpec(nodes=1, split="collocated", metrics=True, metrics_base_port=base, log_dir=str(tmp_path)))
        c.log_dir = tmp_path
        try:
            with pytest.raises(ClusterError, match=f"router: cannot listen for metrics on 127.0.0.1:{base + 2}: Address already in use"):
                c._plan_children()
        finally:
            asyncio.run(c.stop())


def test_every_inherited_descriptor_setting_is_per_service():
    """A descriptor number (``EI_LISTEN_FD``, ``EI_METRICS_FD``) names a file of the shell's process, not a child's:
    ``EI_LISTEN_FD`` exported where ``up --no-restart`` ran reached the router (it binds its port itself then), which
    exited 2 (not a listening socket). Every ``*_fd`` setting of a service is in ``PER_SERVICE_ENV`` and dropped."""
    from evolving_infra.cluster import PER_SERVICE_ENV, child_env
    from services.kvdirectory.config import DirectoryConfig
    from services.planner.config import PlannerConfig
    from services.router.config import RouterConfig
    from services.worker.config import WorkerConfig
    from shared.config import env_name

    fds = {env_name(f) for cls in (DirectoryConfig, PlannerConfig, RouterConfig, WorkerConfig)
           for f in cls.__struct_fields__ if f.endswith("_fd")}  # fmt: skip
    assert {"EI_LISTEN_FD", "EI_METRICS_FD"} <= fds
    assert fds <= set(PER_SERVICE_ENV)
    assert child_env(None, base={**dict.fromkeys(fds, "5"), "EI_LOG_LEVEL": "info"}) == {"EI_LOG_LEVEL": "info"}


@pytest.mark.parametrize(("port", "owner"), [(19650, "the KV directory"), (19652, "the router"), (19654, "worker w1"),
                                             (19655, "router-1"), (19656, "router-2")])  # fmt: skip
def test_a_router_port_inside_the_metrics_range_is_a_usage_error(port, owner, tmp_path):
    """``up --port 19652 --metrics-base-port 19650``: up bound the router's port, then the router's metrics port was
    the same one, and the router exited 1 ('cannot listen for metrics on 127.0.0.1:19652: Address already in use')
    after NATS and every service had started. Refused up front now (exit 2), as the Slurm job's job_ports does."""
    def args(p: int):  # type: ignore[no-untyped-def]
        return build_parser("up").parse_args(["up", "--nodes", "2", "--routers", "3", "--port", str(p),
                                              "--metrics-base-port", "19650", "--log-dir", str(tmp_path)])  # fmt: skip

    with pytest.raises(UsageError, match=rf"--port {port} is {owner}'s metrics port under --metrics-base-port 19650 "
                                         r"\(.*19650-19656\)"):  # fmt: skip
        _spec(args(port))
    for outside in (19649, 19657):  # just below and past the range (2 workers, 2 more routers: 19650..19656)
        assert _spec(args(outside)).port == outside


def test_metrics_bind_to_loopback_under_a_public_router_host_unless_metrics_host_says_otherwise(tmp_path, monkeypatch):
    """``up --host 0.0.0.0 --metrics`` bound every service's /metrics and /readyz on every interface, without a
    login or a word (``--metrics-host`` was the router's ``--host``; ``up`` had no such flag). Now ``--metrics-host``
    (default 127.0.0.1) is where they listen, the targets file lists it, and the banner warns when it is public."""
    from evolving_infra.launcher import metrics_host_line

    monkeypatch.delenv("EI_METRICS_PORT", raising=False)
    args = build_parser("up").parse_args(["up", "--nodes", "1", "--host", "0.0.0.0", "--metrics", "--log-dir", str(tmp_path)])
    spec = _spec(args)
    assert spec.host == "0.0.0.0" and spec.metrics_host == "127.0.0.1"
    c = LocalCluster(spec)
    c.log_dir = tmp_path
    try:
        children = c._plan_children()
        for child in children:
            assert child.argv[child.argv.index("--metrics-host") + 1] == "127.0.0.1", child.argv
        assert all(s.getsockname()[0] == "127.0.0.1" for s in c.metrics_sockets.values())
        assert all(u.startswith("http://127.0.0.1:") for u in c.metrics_urls.values())
        # the API reachable from elsewhere, its metrics not: said (a remote Prometheus found nothing, no word why)
        assert metrics_host_line(spec) == "metrics on 127.0.0.1 (--metrics-host 0.0.0.0 for a remote Prometheus)"
    finally:
        asyncio.run(c.stop())
    args = build_parser("up").parse_args(["up", "--nodes", "1", "--metrics", "--metrics-host", "0.0.0.0", "--log-dir", str(tmp_path)])
    spec = _spec(args)
    c = LocalCluster(spec)
    c.log_dir = tmp_path
    try:
        c._plan_children()
        assert all(s.getsockname()[0] == "0.0.0.0" for s in c.metrics_sockets.values())
        host = __import__("socket").gethostname()
        assert all(t["targets"][0].startswith(f"{host}:") for t in c.prometheus_targets())
        line = metrics_host_line(spec)
        assert line and line.startswith("WARNING: ") and "0.0.0.0" in line and "no authentication" in line and "/readyz" in line
    finally:
        asyncio.run(c.stop())
    assert metrics_host_line(_spec(build_parser("up").parse_args(["up", "--metrics", "--log-dir", str(tmp_path)]))) is None
    # no metrics ports: nothing listens there, and the flag did nothing without a word
    with pytest.raises(UsageError, match=r"^error: --metrics-host 0\.0\.0\.0 needs --metrics or --metrics-base-port"):
        _spec(build_parser("up").parse_args(["up", "--metrics-host", "0.0.0.0", "--log-dir", str(tmp_path)]))
    spec = _spec(build_parser("up").parse_args(["up", "--metrics-base-port", "19700", "--metrics-host", "::1",
                                                "--log-dir", str(tmp_path)]))  # fmt: skip
    assert spec.metrics and spec.metrics_host == "::1"
