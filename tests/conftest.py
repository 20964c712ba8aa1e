"""Shared fixtures: a real nats-server per test that needs one (never a mock bus), and the two lanes of
``make test``.

``make test`` runs ``pytest -n 2`` (pytest-xdist): two worker processes, one per core of
the 2-core CI box. Every test is in one of two groups, each run whole, in order, by one worker:

- ``live``: ``tests/e2e`` and ``tests/integration``, which start clusters of real processes and measure
  wall-clock bounds; one at a time, as before. Except the files of ``REST_LANE_LIVE_FILES`` (below, each with
  its reason): live tests with no tight wall-clock bound, which run in ``rest`` to even the lanes.
- ``rest``: ``tests/unit``, ``tests/property`` and ``tests/deploy`` (Docker and Slurm smokes with minute-long
  bounds), at nice +5 under xdist, so that the live lane's processes get the CPU first and this lane fills
  what they leave idle. With the kernel's autogroup scheduling on (``/proc/sys/kernel/sched_autogroup_enabled``,
  as on the box this was measured on) nice weighs only within a session: what this lane starts in a session
  of its own (the Slurm jobs, slurmd, Docker's containers) runs at full weight beside the live lane.

Serial, the suite took 2082 s here; in two lanes 1477 s (the live lane's slowest tests ran up to 2-3x
longer than alone, and passed); CI allows about 30 minutes. The lanes drifted apart as tests were added: a
fresh clone's ``make test`` under heavy load (session 54) summed 2384 s of tests in ``live`` and 2093 s in
``rest``, the live lane the whole run's wall time; ``REST_LANE_LIVE_FILES`` moves 140 s of those (at nice +5
beside two CPU burners the same files took 165 s, where the live lane had measured them at 140 s), about
even. Plain ``pytest`` (no ``-n``) runs everything in one process as before.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from shared.natsserver import EmbeddedNatsServer

# Tests that run services in this process never call shared.log.setup_logging, so structlog's default
# console renderer applied: with rich installed (the torch extra pulls it in) each logged traceback was
# rendered by rich with every frame's locals, 0.05-0.3 s idle and over 2 s on a loaded box, on the
# event loop of the service under test: a router's work.requeue handler that logs an error with its
# traceback then missed the test's 2-s reply timeout (test_router_parked_live, 2 of 3 runs under load).
# Plain tracebacks here, as setup_logging gives the services.
structlog.configure(
    processors=[
        *structlog.get_config()["processors"][:-1],
        structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback),
    ]
)

REPO = Path(__file__).resolve().parent.parent
SHARED_TRACES = REPO.parent / "shared" / "traces"


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNatsServer]:
    """A real nats-server with JetStream on a kernel-chosen loopback port."""
    with EmbeddedNatsServer() as srv:
        yield srv


@pytest.fixture
def nats_url(nats_server: EmbeddedNatsServer) -> str:
    return nats_server.url


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """A test that calls a ``main`` in this process runs ``shared.log.setup_logging`` (structlog, and a root handler, to
    stderr, for the whole process): both are put back after every test. Before, a later test in the same process found
    its in-process services' log lines in its captured stderr: ``split set``'s stderr checks in
    tests/integration/test_planner_live.py failed (3 tests) in a fresh clone's ``make test`` when they ran after such a
    test in the live lane, though test_exit_status.py (the one such file in the unit lane) already put them back."""
    old = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**old)
    for h in [h for h in root.handlers if h not in handlers and h.get_name() == "evolving-infra"]:  # shared.log's
        root.removeHandler(h)
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _sighup_restored() -> Iterator[None]:
    """The router's ``main`` ignores SIGHUP first thing (services/router/__main__.py), for the whole process: a test
    that calls it in this process (tests/unit/router/test_main_label.py) left the pytest worker ignoring SIGHUP, and
    every child a later test spawned inherited that. In a fresh clone's ``make test``, the worker that ran it failed
    test_main_sighup.py's cluster test (the planner started with SIGHUP ignored, as if the cluster had set it) and
    test_launcher_newcomer.py's SIGUSR1 test (its sleepers lived through the SIGHUP). It is put back after every test."""
    old = signal.getsignal(signal.SIGHUP)
    yield
    if old is not None:  # None: not set from Python (it is, for SIGHUP, at the interpreter's start)
        signal.signal(signal.SIGHUP, old)


@pytest.fixture(scope="session", autouse=True)
def _session_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``EI_STATE_DIR`` (``evolving_infra.state``) is a folder of this test process for the whole session, and
    every process a test starts inherits it: an ``up`` / ``demo`` a test starts writes its state file there, and
    ``split`` / ``tap`` / ``replay`` look for clusters there. Before, tests that did not set it wrote into the
    user's folder (``$XDG_RUNTIME_DIR/evolving-infra`` or ``~/.local/state/evolving-infra``), where another test
    process (the other lane of ``make test -n 2``, another checkout's run) or the user's own ``up`` found them.
    A test that sets ``EI_STATE_DIR`` itself still wins."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EI_STATE_DIR", str(tmp_path_factory.mktemp("ei-state")))
        yield


def bench_faults():
    """``bench/faults.py`` as a module (``bench/`` is no package), loaded once per process under the name
    ``bench_faults`` (its dataclasses need it in ``sys.modules``) and shared by the tests that drive it."""
    import importlib.util
    import sys

    if (mod := sys.modules.get("bench_faults")) is None:
        repo = Path(__file__).resolve().parents[1]
        spec = importlib.util.spec_from_file_location("bench_faults", repo / "bench" / "faults.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_faults"] = mod
        spec.loader.exec_module(mod)
    return mod


def ipv6_loopback() -> bool:
    """Whether this machine can bind a TCP socket on ``::1`` (IPv6 loopback): tests of IPv6 hosts skip without it."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def shared_traces_or_skip(*parts: str) -> Path:
    """Path under ../shared/traces, or skip the test when that folder is absent."""
    path = SHARED_TRACES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (the shared traces folder is outside the repo)")
    return path


LIVE_DIRS = ("tests/e2e/", "tests/integration/")
REST_NICE = 5

# Files under LIVE_DIRS that run in the ``rest`` lane (module docstring), to even the lanes' sums. Each is chosen
# because none of its assertions bounds wall-clock time tighter than ~30 s (its waits are 60-240-s timeouts on
# work that takes 5-45 s), it needs no CPU priority over anything, and it passed alone at nice +5 beside two CPU
# burners (the rest lane's condition). Seconds: its time in a fresh clone's ``make test`` under heavy load (live lane).
REST_LANE_LIVE_FILES: dict[str, str] = {
    "tests/e2e/test_compare_trace_identity.py": (
        "50 s: a replay into an in-process stub router, simulate and report compare (deterministic CPU work), and one "
        "1-session demo whose only bound is its 240-s timeout; asserts the recorded trace identity, not timings"),
    "tests/e2e/test_replay_twice.py": (
        "43 s: four 1-session replays at speedup 50 against one small up cluster, 120-s timeouts; asserts exit codes, "
        "request counts and the 400 for an ended branch, no latency"),
    "tests/e2e/test_up_key_id_salt_kept.py": (
        "25 s: three up runs to READY (90-s deadline) and a SIGINT stop (60 s); asserts the salt file's content, mode "
        "and up's warning lines"),
    "tests/e2e/test_demo_api_keys.py": (
        "22 s: a 2-session demo at speedup 100 with API keys (240-s timeout); asserts every request completed with a "
        "key, and the report folder's files"),
}


def _lane(nodeid: str) -> str:
    """``live`` or ``rest`` (module docstring) for a test's node id (``tests/unit/...::test_x``): ``live`` for a
    file under LIVE_DIRS unless REST_LANE_LIVE_FILES names it."""
    path = nodeid.split("::", 1)[0]
    return "live" if path.startswith(LIVE_DIRS) and path not in REST_LANE_LIVE_FILES else "rest"


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown (and unused) without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``-n``: each lane is one xdist scope, run whole and in order by one worker (xdist's own
    ``--dist loadgroup`` marks no longer group anything under pytest 9.2, whose node ids it cannot
    rename)."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _lane(nodeid)

    return LaneScheduling(config, log)


_niced = False


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, the worker of the ``rest`` lane lowers its priority once (nice +5; the lanes never
    share a worker), so that the live lane's clusters keep their CPU and their timing."""
    global _niced
    if not _niced and os.environ.get("PYTEST_XDIST_WORKER") and _lane(item.nodeid) == "rest":
        os.nice(REST_NICE)
        _niced = True
