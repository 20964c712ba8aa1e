"""Ctrl-C during `simulate` ends it with one line and exit status 130, not a traceback from the loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(180)


def _sigint_default() -> None:
    """The child starts with SIGINT at its default, whatever the test runner's is: a shell's
    background job (``make test &``, nohup) ignores SIGINT, and an ignored SIGINT is inherited
    and, rightly, kept by Python (no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_while_simulating_prints_a_line_not_a_traceback(tmp_path):
    out = tmp_path / "run"
    from evolving_infra.launcher import demo_trace_path

    cmd = [sys.executable, "-m", "evolving_infra.cli", "simulate", "--trace", str(demo_trace_path()), "--tile", "50",
           "--nodes", "2", "--no-plots", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ},
                            preexec_fn=_sigint_default)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and not line.startswith("simulate: "):  # the loop runs (a line every 5 s)
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("simulate: "), (line, proc.poll())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert f"simulate: interrupted; a run that had not finished wrote no report under {out}" in err
    assert not (out / "report.json").exists()
