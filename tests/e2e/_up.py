"""Reading a started ``evolving-infra up`` (or ``demo``) until a line, and the other steps the e2e tests shared by
copy: stopping ``up``, and waiting until a ``demo`` has answered requests.

``up`` prints its banner, then one ``READY {json}`` line once every service answers (``evolving_infra.cli``); a
test starts it with ``stdout=subprocess.PIPE, text=True`` and reads until that line. Here the reading is done by a
thread, so the wait is bounded even when ``up`` hangs without printing (a ``readline`` on the pipe would block past
any deadline); the thread stops right after the line it looks for, so what ``up`` prints next stays in
``proc.stdout`` for the test to read.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

READY = "READY "
"""The prefix of ``up``'s ready line; the rest of the line is a JSON object (``router_url``, ``pids``, ...)."""


def read_until(proc: subprocess.Popen[str], prefix: str, lines: list[str] | None = None, timeout_s: float = 120.0) -> str:
    """Read ``proc``'s stdout (a text pipe) line by line until one that starts with ``prefix``, and return it.

    ``lines``: every line read, that one included, is appended to it (in order; newline kept). ``timeout_s``: seconds
    of wall time for the whole wait. Raises AssertionError, whose message is ``up``'s exit status (None: still
    running) and the last 3,000 characters of what it printed (and of its stderr, when that is a pipe of its own
    and it has exited), when stdout ends (``up`` exited or closed it; its exit is waited for up to 5 s more)
    before such a line, or when ``timeout_s`` passes first: then the thread reading may stay blocked on the pipe
    until the caller stops ``proc``. ValueError if ``proc`` has no stdout pipe."""
    if proc.stdout is None:
        raise ValueError("read_until needs a process started with stdout=subprocess.PIPE")
    stdout = proc.stdout
    seen: list[str] = [] if lines is None else lines
    got: queue.Queue[str | None] = queue.Queue()

    def reader() -> None:
        try:
            for line in iter(stdout.readline, ""):
                seen.append(line)
                if line.startswith(prefix):
                    got.put(line)
                    return
        except (OSError, ValueError):  # the pipe closed under the thread (the caller stopped proc after a timeout)
            pass
        got.put(None)

    thread = threading.Thread(target=reader, name=f"read-until-{proc.pid}", daemon=True)
    thread.start()
    try:
        line = got.get(timeout=max(0.0, timeout_s))
    except queue.Empty:
        raise AssertionError(f"no line starting {prefix!r} within {timeout_s:g} s (exit status {proc.poll()}):\n"
                             f"{''.join(seen)[-3000:]}{_stderr_tail(proc)}") from None
    thread.join()
    if line is not None:
        return line
    with contextlib.suppress(subprocess.TimeoutExpired):  # the pipe ended: the process exits about now
        proc.wait(timeout=5.0)
    raise AssertionError(f"its stdout ended before a line starting {prefix!r} (exit status {proc.poll()}):\n"
                         f"{''.join(seen)[-3000:]}{_stderr_tail(proc)}")


def read_ready(proc: subprocess.Popen[str], lines: list[str] | None = None, timeout_s: float = 120.0) -> dict:
    """:func:`read_until` ``up``'s ``READY`` line and return its JSON object (``router_url``, ``nats_url``, ``pids``:
    service name -> pid, ...). ``lines`` and ``timeout_s`` (seconds) and the AssertionError as there; a READY line
    whose rest is not JSON raises ``json.JSONDecodeError``."""
    return json.loads(read_until(proc, READY, lines, timeout_s)[len(READY):])


def _stderr_tail(proc: subprocess.Popen[str]) -> str:
    """The last 3,000 characters of ``proc``'s own stderr pipe, once it has exited (read for at most 5 s: a child it
    left may hold the pipe open); "" if it has none or still runs."""
    err = proc.stderr
    if err is None or proc.poll() is None:
        return ""
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(err.read()), daemon=True)
    t.start()
    t.join(5.0)
    return f"\nstderr:\n{out[0][-3000:]}" if out and out[0] else ""


def stop(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> None:
    """Stop a still running ``up`` as a service manager does: SIGTERM, then SIGKILL if it has not exited within
    ``timeout_s`` seconds; returns once it is reaped. Nothing if it has exited already."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def finished_ok(router_url: str) -> float:
    """Requests the router at ``router_url`` finished with a completion (its ``/metrics``:
    ``ei_router_requests_finished_total``, reason length or stop); 0 when it does not answer within 5 s."""
    try:
        with urllib.request.urlopen(router_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("ei_router_requests_finished_total{reason=\"length\"",
                                   "ei_router_requests_finished_total{reason=\"stop\"")))  # fmt: skip


def demo_answering(proc: subprocess.Popen[str], state_dir: Path, answers: int = 2, timeout_s: float = 120.0) -> dict:
    """Wait until ``demo`` (``proc``, run with ``EI_STATE_DIR=state_dir``) has written its state file (it does once its
    cluster is ready, before the replay) and its router has finished ``answers`` requests with a completion
    (:func:`finished_ok`); return the state file's JSON (``router_url``, ``pids``: service name -> pid, ...).
    ``timeout_s``: seconds for both. Raises AssertionError (the demo's exit status) if the demo exits or the time
    runs out first."""
    deadline = time.monotonic() + timeout_s
    while not list(state_dir.glob("up-*.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
        time.sleep(0.05)
    state: dict = json.loads(next(state_dir.glob("up-*.json")).read_text())
    while finished_ok(state["router_url"]) < answers:
        assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
        time.sleep(0.1)
    return state
