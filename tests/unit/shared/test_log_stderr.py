"""Logging configured while ``sys.stderr`` was a capture keeps working once that capture is closed.

A test (or an in-process CLI call such as ``main(["up", ...])`` under pytest's ``capsys``) runs
``setup_logging`` while ``sys.stderr`` is a temporary capture; structlog kept that object, so every
later log line in the process raised ``ValueError: I/O operation on closed file`` (seen in the full
suite: ``test_supervise`` failed after ``test_exit_status`` ran ``up`` in-process).
"""

from __future__ import annotations

import io
import sys

import structlog

from shared.log import setup_logging


def test_a_logger_configured_under_a_closed_capture_writes_to_the_current_stderr(monkeypatch):
    old = structlog.get_config()
    capture, now = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", capture)
        setup_logging("console", "warning")
        structlog.get_logger().warning("while captured")
        capture.close()
        monkeypatch.setattr(sys, "stderr", now)
        structlog.get_logger().warning("after the capture closed", code=-9)
    finally:
        structlog.configure(**old)
    assert "after the capture closed" in now.getvalue() and "code=-9" in now.getvalue()
