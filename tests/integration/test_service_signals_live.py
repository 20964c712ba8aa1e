"""Every service process exits promptly and cleanly on SIGTERM/SIGINT at any time.

Before the fix a service whose NATS server was unreachable kept retrying the
initial connect and ignored SIGTERM (the signal only set an event nobody waited
on until start-up had finished): it had to be SIGKILLed. Here each service is
started against a loopback port nothing listens on, signalled while it retries,
and must exit 0 within seconds; and a started service whose server then dies
(the bus reconnecting) must exit on SIGTERM too. A service that fails during the drain a SIGTERM
asks for exits non-zero.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.natsserver import EmbeddedNatsServer
from tests.stop_burst import send_stop_bursts

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

EXIT_WITHIN_S = 15.0
"""Generous for a loaded 2-core box; the exit itself takes well under a second."""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _dead_url() -> str:
    """A loopback URL where nothing listens (a port the kernel just handed out and freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def _service(service: str, url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m services.<service>`` logging to ``log``; killed on the way out if still running."""
    extra = ["--port", "0"] if service == "router" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", f"services.{service}", "--nats-url", url, *extra],
        cwd=REPO, env=_env(), stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{log.read_text(errors='replace')}"
        time.sleep(0.1)


def _signal_and_wait(proc: subprocess.Popen[bytes], sig: int, log: Path) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {EXIT_WITHIN_S:g} s after {signal.Signals(sig).name}:\n{log.read_text(errors='replace')[-2000:]}")


@pytest.mark.parametrize(
    ("service", "sig"),
    [("router", signal.SIGTERM), ("worker", signal.SIGTERM), ("planner", signal.SIGTERM), ("kvdirectory", signal.SIGTERM),
     ("planner", signal.SIGINT)],
)
def test_signal_during_initial_connect_retries(service, sig, tmp_path):
    log = tmp_path / f"{service}.log"
    with _service(service, _dead_url(), log) as proc:
        _wait_for(log, "Connection refused", proc)  # the bus is retrying; signal handlers are installed
        time.sleep(1.0)  # a few more retries
        rc = _signal_and_wait(proc, sig, log)
    assert rc == 0, log.read_text(errors="replace")[-2000:]
    assert "service stopped during start-up" in log.read_text(errors="replace")


def test_sigterm_while_reconnecting_after_the_server_died(tmp_path):
    log = tmp_path / "kvdirectory.log"
    with EmbeddedNatsServer() as srv, _service("kvdirectory", srv.url, log) as proc:
        _wait_for(log, "service started", proc)
        srv.stop()
        _wait_for(log, "nats disconnected", proc)
        rc = _signal_and_wait(proc, signal.SIGTERM, log)
    assert rc == 0, log.read_text(errors="replace")[-2000:]
    assert "service stopped" in log.read_text(errors="replace")


_DRAINING_SERVICE = """
import asyncio, sys
from shared.config import CommonConfig
from shared.service import run_service_main

MODE = sys.argv[2]


class Draining:
    '''A service whose SIGTERM drain raises (MODE raise), meets a fatal error (fatal: as the router's
    drain ends when a task it needs fails) or ends cleanly (ok).'''

    def __init__(self, cfg, bus, clock):
        self.fatal = asyncio.Event()
        self.fatal_error = None
        self.fatal_where = None

    async def start(self):
        pass

    async def stop(self):
        if MODE == "fatal-in-stop":  # a needed task that fails as the service stops, before it marks itself stopping
            self.fatal_error, self.fatal_where = RuntimeError("flush failed"), "task flush"
            self.fatal.set()

    def stats(self):
        return {}, {}

    async def drain(self, now):
        await asyncio.sleep(0.1)
        if MODE == "raise":
            raise RuntimeError("drain broke")
        if MODE == "fatal":
            self.fatal_error, self.fatal_where = RuntimeError("loop died"), "task fence"
            self.fatal.set()


sys.exit(run_service_main("draining", CommonConfig(nats_url=sys.argv[1]), Draining))
"""


@pytest.mark.parametrize(("mode", "rc", "line"), [
    ("raise", 1, "draining: drain failed: RuntimeError('drain broke')"),
    ("fatal", 1, "draining: task fence failed: RuntimeError('loop died')"),
    ("ok", 0, None),
], ids=["drain-raises", "fatal-during-drain", "clean-drain"])
def test_a_failure_during_the_sigterm_drain_exits_non_zero(mode, rc, line, nats_url, tmp_path):
    """A service that fails while draining after SIGTERM (its drain raised, or a task it needs failed:
    its ``fatal`` event) exits 1 with one line saying what failed, so a supervisor restarting on
    failure restarts it; a clean drain exits 0. Before, a fatal error during the drain exited 0."""
    log = tmp_path / "draining.log"
    script = tmp_path / "draining.py"
    script.write_text(_DRAINING_SERVICE)
    proc = subprocess.Popen([sys.executable, str(script), nats_url, mode], cwd=REPO, env=_env(),
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_for(log, "service started", proc)
        got = _signal_and_wait(proc, signal.SIGTERM, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert got == rc, text[-2000:]
    if line is not None:
        assert line in text.splitlines(), text[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_fatal_error_while_stopping_exits_non_zero(sig, nats_url, tmp_path):
    """A service whose ``fatal`` event is set as it stops (its ``stop()``; after SIGINT no drain runs) exits 1 with
    the line saying what failed. Before, ``fatal`` was checked only while serving and after SIGTERM's drain: a
    fatal error met with the stop signal or in ``stop()`` exited 0, and a supervisor restarting on failure did not."""
    log = tmp_path / "draining.log"
    script = tmp_path / "draining.py"
    script.write_text(_DRAINING_SERVICE)
    proc = subprocess.Popen([sys.executable, str(script), nats_url, "fatal-in-stop"], cwd=REPO, env=_env(),
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_for(log, "service started", proc)
        got = _signal_and_wait(proc, sig, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert got == 1, text[-2000:]
    assert "draining: task flush failed: RuntimeError('flush failed')" in text.splitlines(), text[-2000:]


@pytest.mark.parametrize("service", ["kvdirectory", "router"])
def test_a_burst_of_stop_signals_ends_a_service_with_0_and_no_traceback(service, nats_url, tmp_path):
    """A plain ``scancel`` SIGTERMs every process of the job at once, and the job's stop and the supervise loops send
    more: a service gets several within milliseconds (:func:`tests.stop_burst.send_stop_bursts`). The first stops it
    (the router's drain), a second ends the drain at once, and the rest, once it has stopped, are ignored: status 0,
    no traceback. Before, one that landed after the service had stopped, while ``uvloop.run`` closed the loop or
    Python finalized, killed it by SIGTERM (-15: 10 of 10 tries for the KV directory, 5 of 5 for the router). The real
    service against a real nats-server, 3 tries each."""
    for attempt in range(3):
        log = tmp_path / f"{service}-{attempt}.log"
        with _service(service, nats_url, log) as proc:
            _wait_for(log, "service started", proc)  # its handlers are set (before the connect)
            send_stop_bursts(proc)
            try:
                rc = proc.wait(timeout=EXIT_WITHIN_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {EXIT_WITHIN_S:g} s after the bursts:\n{log.read_text(errors='replace')[-2000:]}")
        text = log.read_text(errors="replace")
        assert rc == 0 and "Exception ignored" not in text and "Traceback" not in text, (attempt, rc, text[-2000:])
        assert "service stopped" in text, text[-2000:]
