"""`evolving-infra up` stops on SIGTERM during its start-up and leaves no process behind.

Before the fix ``up --nats-url`` pointed at a NATS server that is down kept
retrying the connect and ignored SIGTERM (it had to be SIGKILLed); with the
embedded server, a SIGTERM before READY only took effect once every service was
ready. Now the start-up is cancelled, what it started (nats-server, services)
is stopped, and the process exits 0.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e._up import read_ready
from tests.stop_burst import send_stop_bursts

pytestmark = pytest.mark.timeout(180)

EXIT_WITHIN_S = 30.0


def _children(pid: int) -> set[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _up(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--split", "1P1D", "--profile", "tiny", "--port", "0",
           "--policy", "static", "--log-dir", str(tmp_path / "logs"), *extra]  # fmt: skip
    env = {**os.environ, "EI_STATE_DIR": str(tmp_path / "state")}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"`up` still running {EXIT_WITHIN_S:g} s after SIGTERM:\n{out[-2000:]}")
    return proc.returncode, out


def test_sigterm_while_connecting_to_an_unreachable_nats(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"nats://127.0.0.1:{s.getsockname()[1]}"
    proc = _up(tmp_path, "--nats-url", dead)
    try:
        time.sleep(6.0)  # imports, then the launcher's bus retries the connect
        assert proc.poll() is None
        rc, out = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0 and "stopped during start-up" in out, out[-2000:]


def test_sigterm_before_ready_stops_the_embedded_server_and_services(tmp_path):
    proc = _up(tmp_path)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 2:  # nats-server and at least one service started
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            seen |= _children(proc.pid)
            time.sleep(0.02)
        rc, out = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, out[-2000:]
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in seen if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes of `up` outlived it: {left}\n{out[-2000:]}"


@pytest.mark.parametrize("ignored", [False, True])
def test_sighup_stops_a_ready_cluster_cleanly_unless_ignored(tmp_path, ignored):
    """A closed terminal (SIGHUP) killed `up` without its clean stop (its state file stayed behind);
    under `nohup` (SIGHUP ignored) it must keep running."""

    cmd = [sys.executable, *(["-c", "import signal, sys, runpy; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
                               "sys.argv = ['evolving-infra', *sys.argv[1:]]; runpy.run_module('evolving_infra.cli', run_name='__main__')"]
                             if ignored else ["-m", "evolving_infra.cli"]),
           "up", "--nodes", "2", "--split", "1P1D", "--profile", "tiny", "--port", "0", "--policy", "static",
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    env = {**os.environ, "EI_STATE_DIR": str(tmp_path / "state")}
    # the child starts with SIGHUP at its default whatever the runner's is (under nohup it is ignored,
    # and an ignored SIGHUP is inherited and, by design, kept by `up`)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        read_ready(proc)
        assert len(list((tmp_path / "state").glob("up-*.json"))) == 1
        proc.send_signal(signal.SIGHUP)
        if ignored:
            time.sleep(3.0)
            assert proc.poll() is None
            rc, out = _stop(proc)
        else:
            out, _ = proc.communicate(timeout=EXIT_WITHIN_S)
            rc = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0 and "stopped" in out, (rc, out[-2000:])
    assert not list((tmp_path / "state").glob("up-*.json"))


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 3), (signal.SIGKILL, 1)])
def test_no_restart_a_service_that_exits_cleanly_is_no_error(tmp_path, sig, status):
    """``up --no-restart`` stops the cluster when a service exits. A router SIGTERMed on its own drains and exits 0:
    ``up`` says it exited cleanly (stdout, no "error:"), stops the rest and exits 3: no crash, but not the stop asked
    of ``up`` (0: Ctrl-C, SIGTERM to up), which a supervisor restarting on failure or a CI step must tell apart (it
    exited 0, as if asked). Before that, it printed "error: router exited with code 0" (and the log's tail) and
    exited 1, as for a crash; a crash (SIGKILL) still is one."""

    proc = _up(tmp_path, "--no-restart")
    try:
        ready = read_ready(proc)
        os.kill(int(ready["pids"]["router"]), sig)
        out, _ = proc.communicate(timeout=EXIT_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, out[-3000:]
    if status == 3:
        assert "router exited cleanly (code 0); log " in out and "--no-restart: stopping the cluster" in out, out[-3000:]
        assert "error:" not in out, out[-3000:]
    else:  # said as a signal (was "exited with code -9"), and stopped with the same lines as any stop (before: none)
        assert "error: router was killed by signal 9 (SIGKILL); log " in out, out[-3000:]
    assert "\nstopping ...\n" in out and "\nstopped; logs in " in out, out[-3000:]
    assert not list((tmp_path / "state").glob("up-*.json"))


def _signal_masks(pid: int) -> tuple[int, int] | None:
    """``(caught, ignored)``: the process's SigCgt and SigIgn masks (bit ``n - 1`` for signal ``n``), from
    /proc/PID/status; None once it has gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except OSError:
        return None
    return int(fields["SigCgt"], 16), int(fields["SigIgn"], 16)


def test_sigterm_during_the_imports_stops_up_with_0_and_starts_nothing(tmp_path):
    """A SIGTERM sent while ``up`` still imports (about a second of CPU before its event loop exists, more on a loaded
    box) stops it as one sent later does: "stopped during start-up", status 0 (``up --help``), and no nats-server or
    service is started. Before, nothing handled SIGTERM until the loop's handlers were set: it killed ``up`` (-15).
    Deterministic: the SIGTERM is sent as soon as ``up`` catches one (its SigCgt in /proc), and it must catch it
    while SIGUSR1 is still at its default, before ``cmd_up`` (after the launcher's imports) ignores it first thing;
    before, SIGTERM was caught only once ``_up`` set its loop's handlers (SIGUSR1's with them: this test's first
    assertion failed), and a SIGTERM then stopped a nats-server ``up`` had started already."""
    proc = _up(tmp_path)
    try:
        deadline = time.monotonic() + 30
        while (masks := _signal_masks(proc.pid)) is not None and not masks[0] >> (signal.SIGTERM - 1) & 1:
            assert time.monotonic() < deadline, "up never caught SIGTERM"
            time.sleep(0.001)
        assert masks is not None, proc.communicate()[0][-2000:]
        proc.send_signal(signal.SIGTERM)
        usr1 = (masks[0] | masks[1]) >> (signal.SIGUSR1 - 1) & 1  # cmd_up ignores it, then _up catches it
        assert not usr1, "SIGTERM was caught only once cmd_up had run: after the launcher's imports"
        out, _ = proc.communicate(timeout=EXIT_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "stopped during start-up" in out, (proc.returncode, out[-2000:])
    assert not (tmp_path / "logs" / "nats.log").exists(), "a nats-server was started all the same"


def test_a_burst_of_stop_signals_ends_a_ready_up_with_0_and_no_traceback(tmp_path):
    """A plain ``scancel`` of a job running ``up`` SIGTERMs it (and every process of the job) at once, and the job's
    stop sends more: bursts of 4, 2 ms apart (:func:`tests.stop_burst.send_stop_bursts`). The first stops the
    cluster, the rest change nothing: "stopped", status 0, no traceback. Before, one that landed once the cluster
    had stopped, while ``asyncio.run`` closed the loop or just after, killed ``up`` by SIGTERM (-15 in 3 of 3)."""
    proc = _up(tmp_path)
    try:
        read_ready(proc)
        send_stop_bursts(proc)
        out, _ = proc.communicate(timeout=EXIT_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Exception ignored" not in out and "Traceback" not in out, (proc.returncode, out[-2000:])
    assert "stopped" in out and not list((tmp_path / "state").glob("up-*.json")), out[-2000:]


def _up_reading_a_pipe(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """``up --api-keys-file PIPE`` stopped where no loop handler is set yet: its option checks read the pipe (a
    ``<(pass show key)`` whose writer hangs). Returns the process and the pipe's write end, opened once ``up`` has
    opened the read end (before, ENXIO): ``up`` then waits in ``read`` for the key, until the caller writes and
    closes it. SIGINT at its default in ``up`` (a shell's background job inherits it ignored)."""
    fifo = tmp_path / "keys.fifo"
    os.mkfifo(fifo)
    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--split", "1P1D", "--profile", "tiny",
           "--port", "0", "--policy", "static", "--log-dir", str(tmp_path / "logs"), "--api-keys-file", str(fifo)]
    env = {**os.environ, "EI_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while True:
        try:
            return proc, os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:  # ENXIO: no reader yet
            if e.errno != errno.ENXIO or proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"up never opened {fifo}: {e}\n{proc.communicate()[0][-2000:]}") from None
            time.sleep(0.01)


@pytest.mark.parametrize("sigs, status", [((signal.SIGINT, signal.SIGINT), 130), ((signal.SIGTERM, signal.SIGTERM), 143),
                                          ((signal.SIGTERM, signal.SIGHUP), 129)])
def test_a_second_stop_signal_aborts_an_up_stuck_before_its_handlers(tmp_path, sigs, status):
    """``up`` stuck in its option checks (an ``--api-keys-file`` pipe nobody writes), before its loop's handlers are
    set: the first stop signal is only recorded (it stops ``up`` cleanly once the checks end), the second aborts at
    once: 130 and "interrupted" for Ctrl-C, 128 + the signal else, no traceback. Before, every signal was only
    recorded (``shared.signals.catch_early``) and nothing but SIGKILL stopped it."""
    proc, w = _up_reading_a_pipe(tmp_path)
    try:
        proc.send_signal(sigs[0])
        time.sleep(0.3)
        assert proc.poll() is None, "the first signal ended up before its checks did"
        proc.send_signal(sigs[1])
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"up still running 10 s after a second {sigs[1].name}")
    finally:
        os.close(w)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, (proc.returncode, out[-2000:])
    assert ("evolving-infra up: interrupted" in out) == (status == 130), out[-2000:]
    for noise in ("Traceback", "never retrieved", "Exception ignored"):
        assert noise not in out, out[-2000:]
    assert not (tmp_path / "logs" / "nats.log").exists()


def test_one_stop_signal_to_an_up_stuck_before_its_handlers_stops_it_cleanly_once_unstuck(tmp_path):
    """One SIGTERM while ``up`` waits for its ``--api-keys-file`` pipe is kept: once the key comes, ``up`` stops
    "during start-up" with status 0 and starts nothing (as for a SIGTERM during its imports)."""
    proc, w = _up_reading_a_pipe(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None, "one signal ended up before its checks did"
        os.write(w, b"k-one\n")
        os.close(w)
        w = -1
        out, _ = proc.communicate(timeout=EXIT_WITHIN_S)
    finally:
        if w >= 0:
            os.close(w)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "stopped during start-up" in out, (proc.returncode, out[-2000:])
    assert not (tmp_path / "logs" / "nats.log").exists()
