"""tests/e2e/_up.py, the e2e tests' shared "read ``up`` until READY": a child process prints like ``up`` (banner, READY
line, more), exits early, or hangs silent; the reader returns the line and leaves the rest in the pipe, or fails within
its timeout with the output and exit status (a hang blocked the copied loops' ``readline`` past their deadlines)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.e2e._up import read_ready, read_until


def _child(code: str, *, stderr: int = subprocess.STDOUT) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr, text=True)


def _stopped(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_ready_returns_the_json_and_leaves_the_later_lines_in_the_pipe():
    proc = _child("print('cluster ready in 1.0 s'); print('READY {\"router_url\": \"http://x\", \"pids\": {\"router\": 7}}');"
                  "print('restarted router'); print('stopped')")  # fmt: skip
    try:
        lines: list[str] = []
        assert read_ready(proc, lines, timeout_s=30) == {"router_url": "http://x", "pids": {"router": 7}}
        assert lines[0] == "cluster ready in 1.0 s\n" and lines[1].startswith("READY ") and len(lines) == 2
        assert read_until(proc, "restarted", lines, timeout_s=30) == "restarted router\n"
        assert proc.stdout is not None and proc.stdout.read() == "stopped\n"  # nothing read past the line asked for
    finally:
        _stopped(proc)


def test_an_exit_before_ready_fails_with_the_output_the_status_and_its_own_stderr():
    proc = _child("import sys; print('starting'); print('boom', file=sys.stderr); sys.exit(3)", stderr=subprocess.PIPE)
    try:
        with pytest.raises(AssertionError) as e:
            read_ready(proc, timeout_s=30)
        msg = str(e.value)
        assert "stdout ended before a line starting 'READY '" in msg and "(exit status 3)" in msg, msg
        assert "starting" in msg and "stderr:\nboom" in msg, msg
    finally:
        _stopped(proc)


def test_a_silent_hang_fails_at_the_timeout_not_at_the_first_line():
    proc = _child("import time; print('banner', flush=True); time.sleep(60)")
    try:
        t0 = time.monotonic()
        with pytest.raises(AssertionError) as e:
            read_ready(proc, timeout_s=1.0)
        took = time.monotonic() - t0
        msg = str(e.value)
        assert "no line starting 'READY ' within 1 s (exit status None)" in msg and "banner" in msg, msg
        assert took < 10.0, took  # before: readline blocked until the child printed or exited (60 s)
    finally:
        _stopped(proc)


def test_a_process_without_a_stdout_pipe_is_a_clear_error():
    proc = _child("pass", stderr=subprocess.DEVNULL)
    _stopped(proc)
    proc.stdout = None
    with pytest.raises(ValueError, match="stdout=subprocess.PIPE"):
        read_until(proc, "READY ")
