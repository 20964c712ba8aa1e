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
quiet fresh clone's ``make test`` (session 55, the junit of 299aeb4) summed 1613 s of tests in ``live`` and 840 s
in ``rest``, the live lane the whole run's wall time (tests 27 min). ``REST_LANE_LIVE_FILES`` (seconds: each
file's quiet time) now moves another 372 s of those, which leaves about 1,241 s in ``live`` and 1,212 s in ``rest``.
Each file moved in session 55 passed at nice +5 beside two CPU burners, on a box whose load was 8-11 (two other
simulations ran too): 1,827 s for the 372, from 2.4x (test_kvpool_live, mostly waiting) to 18x (test_demo_no_restart,
mostly CLI start-ups starved of CPU). The sums above count every file at its quiet time, as the live lane's own
tests are counted. The next quiet fresh clone's ``make test`` (session 55, ace5aaf9) summed 1,305 s in ``live`` and
1,204 s in ``rest``: tests 22 min 17 s (27 min before), 23 min 23 s with the install.
Plain ``pytest`` (no ``-n``) runs everything in one process as before.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
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


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT as an interactive shell gives it (Python's ``KeyboardInterrupt``) in the test process, also when the
    run was started as a background job of a non-interactive shell (``(make test &)``, a CI runner's script), which
    POSIX starts with SIGINT ignored: every child a test started inherited that, so a ``trace generate`` ran through
    its Ctrl-C (status 0, not 130) and ``up``'s stop could not end a router's drain with SIGINT (5 failures of a
    fresh clone's ``make test`` started so; they passed before only while an earlier in-process test happened to
    leave a handler set, which ``_stop_signals_restored`` now puts back). SIGTERM and SIGHUP are left as inherited
    (``nohup`` keeps its meaning)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _stop_signals_restored() -> Iterator[None]:
    """The router's ``main`` ignores SIGHUP first thing (services/router/__main__.py), for the whole process: a test
    that calls it in this process (tests/unit/router/test_main_label.py) left the pytest worker ignoring SIGHUP, and
    every child a later test spawned inherited that. In a fresh clone's ``make test``, the worker that ran it failed
    test_main_sighup.py's cluster test (the planner started with SIGHUP ignored, as if the cluster had set it) and
    test_launcher_newcomer.py's SIGUSR1 test (its sleepers lived through the SIGHUP). The same for SIGINT and SIGTERM:
    a service run in this process that left them ignored (``shared.service.run_service`` before it put a caller's
    handlers back) made a later ``trace generate`` run through its Ctrl-C (status 0, not 130) and a router ignore the
    stop's SIGTERM until killed (7 failures of one CI worker). All three are put back after every test, and
    ``shared.signals``' process claim (:func:`shared.signals.claim_process`, sticky for the process: a test calling a
    service's ``main()`` with a patched ``sys.argv``) is taken back."""
    sigs = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
    old = [(sig, signal.getsignal(sig)) for sig in sigs]
    sigmod = sys.modules.get("shared.signals")
    claim = None if sigmod is None else (sigmod._claimed, sigmod._caught, sigmod._early)
    yield
    for sig, handler in old:
        if handler is not None:  # None: not set from Python
            signal.signal(sig, handler)
    sigmod = sys.modules.get("shared.signals")
    if sigmod is not None:
        sigmod._claimed, sigmod._caught, sigmod._early = claim or (False, None, ())


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


@pytest.fixture(scope="session", autouse=True)
def _session_trace_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``EI_TRACE_CACHE_DIR`` (``evolving_infra.traces.cache``: ``simulate --trace FILE`` keeps FILE's pack there) is a
    folder of this test process for the whole session, inherited by every process a test starts: no test writes
    packs into the user's ``~/.cache/evolving-infra/traces`` (nor reads one a user's run left there). A test that
    sets it itself (tests/unit/traces/test_trace_cache.py) still wins."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EI_TRACE_CACHE_DIR", str(tmp_path_factory.mktemp("ei-trace-cache")))
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
# because none of its assertions bounds wall-clock time tighter than ~30 s (its waits are 10-240-s deadlines on
# steps that take well under that), it needs no CPU priority over anything, and it passed alone at nice +5 beside
# two CPU burners (the rest lane's condition). Seconds: its time in a quiet fresh clone's ``make test`` (session 55's
# junit of 299aeb4), then, for the files moved in session 55, beside the burners on a box at load 8-11. Files that
# do bound wall time or race it stay live (tests/unit/shared/test_make_test_lanes.py's TIMED).
REST_LANE_LIVE_FILES: dict[str, str] = {
    "tests/e2e/test_compare_trace_identity.py": (
        "45 s: a replay into an in-process stub router, simulate and report compare (deterministic CPU work), and one "
        "1-session demo whose only bound is its 240-s timeout; asserts the recorded trace identity, not timings"),
    "tests/e2e/test_replay_twice.py": (
        "9 s: four 1-session replays at speedup 50 against one small up cluster, 120-s timeouts; asserts exit codes, "
        "request counts and the 400 for an ended branch, no latency"),
    "tests/e2e/test_up_key_id_salt_kept.py": (
        "10 s: three up runs to READY (90-s deadline) and a SIGINT stop (60 s); asserts the salt file's content, mode "
        "and up's warning lines"),
    "tests/e2e/test_demo_api_keys.py": (
        "11 s: a 2-session demo at speedup 100 with API keys (240-s timeout); asserts every request completed with a "
        "key, and the report folder's files"),
    # session 55
    "tests/integration/test_kvpool_live.py": (
        "75 s (184 s burned): Mooncake between two processes on loopback; 62 s of it one test waiting (150-s "
        "deadline) for a killed holder's port to leave TIME_WAIT; asserts blocks, checksums and reasons"),
    "tests/e2e/test_faults_live.py": (
        "69 s (267 s burned): six up fault runs (bench/faults.py, 180-s replays); asserts nothing lost, one restart "
        "each, recovery within 30 s and real-bytes fetch waits within 30 s"),
    "tests/integration/test_branch_end_heard_live.py": (
        "53 s (175 s burned): in-process routers and directories over a nats-server, one router stalled 13 s; asserts "
        "counts, and answers no EARLIER than the stall (lower bounds), 10-60-s waits"),
    "tests/e2e/test_up_newcomer.py": (
        "44 s (221 s burned): small up and demo runs to READY (120 s) with signals, restarts and key files; asserts "
        "exit codes, state and credential files and key rotation; 10-60-s deadlines on sub-second steps"),
    "tests/e2e/test_up_routers.py": (
        "33 s (98 s burned): two routers SIGTERMed and SIGKILLed under load, 30-60-s deadlines; asserts no loss, "
        "restarts, and that the survivor served while the other restarted (an order, not a latency). Its two "
        "tests that race a stream's wall time are in test_up_routers_races.py, live"),
    "tests/e2e/test_demo_killed_keeps_records.py": (
        "17 s (182 s burned): a demo SIGKILLed mid-replay (120-s deadlines), demos refused an --out; asserts the "
        "request records kept and the refusals"),
    "tests/e2e/test_demo_no_restart.py": (
        "14 s (260 s burned): demo --no-restart whose service exits mid-replay (150-s wait); asserts its status "
        "and the partial report's counts"),
    "tests/e2e/test_fuzz_e2e.py": (
        "13 s (45 s burned): a fuzzed cluster; asserts drops counted, failures under 10% of the answers, resyncs "
        "per wall second and memory, no latency"),
    "tests/e2e/test_tracing_e2e.py": (
        "12 s (57 s burned): two small clusters exporting OTLP spans (a fence after 60 s); asserts the span trees "
        "and log lines"),
    "tests/e2e/test_cluster_e2e.py": (
        "9 s (96 s burned): one 2P2D cluster of processes; asserts requests, KV lookups, a resync and malformed "
        "payloads counted"),
    "tests/e2e/test_metrics_e2e.py": (
        "8 s (43 s burned): a replay on a 2P2D cluster with every /metrics scraped; asserts they parse and count "
        "what was served"),
    "tests/e2e/test_faults_sigterm.py": (
        "8 s (15 s burned): bench/faults.py SIGTERMed past READY (120-s deadline); asserts its up's processes gone "
        "within 30 s"),
    "tests/e2e/test_replay_interrupt.py": (
        "7 s (73 s burned): replays SIGINTed and SIGTERMed (120-s deadline); asserts their partial results"),
    "tests/e2e/test_demo_interrupt.py": (
        "6 s (46 s burned): a demo Ctrl-C'd after 2 answers (120-s deadline); asserts the partial report, the "
        "cluster's processes gone within 10 s"),
    "tests/e2e/test_up_block_size.py": (
        "5 s (65 s burned): up and demo with the tiny profile's block size (120-s READY); asserts answers and the "
        "refusal's status and message"),
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


LIVE_RERUNS_ENV = "EI_LIVE_RERUNS"
"""Environment variable: how many times a failed test of a live tier (:data:`RERUN_DIRS`) is run again (``make test``
sets 1; unset or 0 for a plain ``pytest``: no rerun)."""
RERUN_DIRS = (*LIVE_DIRS, "tests/deploy/")
"""The tiers whose tests start real processes (nats-server, services, Docker, Slurm) and wait on them with wall-clock
bounds: on the 2-core CI box, loaded by both lanes, such a wait sometimes runs out where the same test passes alone."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``EI_LIVE_RERUNS=N`` (``make test``: 1) a test of :data:`RERUN_DIRS` that fails is run again, up to ``N``
    times, 1 s apart (pytest-rerunfailures' ``flaky`` mark; a test that marks itself keeps its own). A test that
    fails every time still fails the run; one that passed on a rerun is listed in the short summary ("RERUN", ``make
    test``'s ``-rR``) and counted ("N rerun") in the last line, so that a race it hit is seen, not hidden: each such
    test is a finding to fix (session 57: a directory that never indexed an idle node's KV showed as one such failure).
    Unit and property tests are never run again. The suite's last six fresh-clone runs each failed on one or two live
    tests that passed alone (timing on a loaded box, or a race).

    Raises:
        pytest.UsageError: ``EI_LIVE_RERUNS`` is not an integer >= 0, or is > 0 without pytest-rerunfailures
            (the ``test`` extra installs it).
    """
    text = os.environ.get(LIVE_RERUNS_ENV, "").strip() or "0"
    try:
        reruns = int(text)
    except ValueError:
        raise pytest.UsageError(f"{LIVE_RERUNS_ENV}={text!r}: not an integer") from None
    if reruns < 0:
        raise pytest.UsageError(f"{LIVE_RERUNS_ENV}={reruns}: must be >= 0")
    if reruns == 0:
        return
    if not config.pluginmanager.hasplugin("rerunfailures"):
        raise pytest.UsageError(f"{LIVE_RERUNS_ENV}={reruns} needs pytest-rerunfailures (pip install -e '.[test]')")
    for item in items:
        if item.nodeid.startswith(RERUN_DIRS) and item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=reruns, reruns_delay=1))


_rerun_failures: list[tuple[str, str]] = []
"""(node id, the failed attempt's report) of each live test run again (:func:`pytest_collection_modifyitems`)."""
RERUN_REPORT_CHARS = 4000
"""How much of a rerun test's failed attempt the summary prints (its end: the assertion and what it saw)."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep the failure of a live test's attempt that pytest-rerunfailures ran again (outcome ``rerun``): the
    junit file and ``-rR`` name the test only, so what raced would be lost with the attempt. Under xdist the
    workers' reports reach this hook in the controller."""
    if report.outcome == "rerun":
        _rerun_failures.append((report.nodeid, str(report.longrepr)[-RERUN_REPORT_CHARS:]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print each rerun live test's failed attempt (:func:`pytest_runtest_logreport`) after the run: a test that
    passed on its rerun still hit a race or a bound, and this is what it saw."""
    for nodeid, text in _rerun_failures:
        terminalreporter.write_sep("-", f"RERUN {nodeid}: its failed attempt (the end of its report)")
        for line in text.splitlines():
            terminalreporter.write_line(line)


_niced = False


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, the worker of the ``rest`` lane lowers its priority once (nice +5; the lanes never
    share a worker), so that the live lane's clusters keep their CPU and their timing."""
    global _niced
    if not _niced and os.environ.get("PYTEST_XDIST_WORKER") and _lane(item.nodeid) == "rest":
        os.nice(REST_NICE)
        _niced = True
