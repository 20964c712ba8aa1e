"""A third stop signal queued on the replay's loop behind the second (the abort) changes nothing.

A burst's signals reach the loop as bytes of its self-pipe, read at once: the callbacks of the second and third are
queued together. The second raises the abort (``SystemExit(128 + n)``) out of the loop; the third then ran while
``asyncio.run`` cancelled the tasks, raised ``SystemExit`` again, and the loop closed with the replay's task still
pending ("Task was destroyed but it is pending!" and a traceback, 6 of 8 SIGINT bursts under PYTHONTRACEMALLOC).
Deterministic here: the three signals are sent from one callback, so all three are queued before any runs; the main
task must be done (cancelled) once ``asyncio.run`` has raised the abort.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import asyncio, os, signal, sys
from pathlib import Path
from evolving_infra.replay.cli import stop_signal_handler
from shared.signals import STOP_SIGNALS

SIG = signal.Signals[sys.argv[1]]
main_task = []

async def main():
    main_task.append(asyncio.current_task())
    loop = asyncio.get_running_loop()
    names = []
    on_signal = stop_signal_handler(loop, asyncio.Event(), names, Path("out"))
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    loop.call_soon(lambda: [os.kill(os.getpid(), SIG) for _ in range(3)])  # all three queued before any runs
    try:
        await asyncio.sleep(30)
    finally:
        print("names", names, flush=True)

try:
    asyncio.run(main())
except SystemExit as e:
    print("aborted", e.code, "main task done", main_task[0].done(), flush=True)
    os._exit(e.code)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_third_signal_queued_behind_the_abort_lets_asyncio_run_cancel_the_replay(sig, status):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", SCRIPT, sig], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    out = p.stdout + p.stderr
    assert p.returncode == status, (p.returncode, out)
    assert f"aborted {status} main task done True" in out, out
    assert f"names ['{sig}', '{sig}', '{sig}']" in out, out  # the third came, and was not acted on
    assert "Traceback" not in out and "destroyed but it is pending" not in out, out
