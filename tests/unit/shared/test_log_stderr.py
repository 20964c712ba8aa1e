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


def test_a_stdlib_logger_warning_is_one_json_line_in_json_format(monkeypatch):
    """With ``--log-format json`` a library's stdlib warning (the OTLP exporter's ``Transient error ...`` while
    the collector is down) was a plain-text line ``name WARNING message`` among the JSON lines."""
    import json
    import logging

    old = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", out)
        root.handlers[:] = []  # as in a fresh service process (pytest's capture handlers are off this logger)
        setup_logging("json", "info", service="router")
        logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").warning(
            "Transient error %s encountered while exporting span batch, retrying in %.2fs.", "Service Unavailable", 1.0)
        logging.getLogger("some.lib").info("below warning: not shown")
        structlog.get_logger().info("own line")
    finally:
        structlog.configure(**old)
        root.handlers[:] = handlers
        root.setLevel(level)
        structlog.contextvars.clear_contextvars()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    stdlib, own = (json.loads(ln) for ln in lines)
    assert stdlib["event"] == "Transient error Service Unavailable encountered while exporting span batch, retrying in 1.00s."
    assert stdlib["level"] == "warning" and stdlib["logger"] == "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    assert stdlib["service"] == "router" and "timestamp" in stdlib
    assert own["event"] == "own line" and own["service"] == "router"


def test_a_console_traceback_shows_no_local_variables(monkeypatch):
    """With ``rich`` installed (transformers pulls it in), structlog's default console traceback
    printed every frame's locals: a secret held in a local variable (an API key, a prompt, a NATS URL
    with its password) went into the log, and one traceback took ~1 s to render."""
    old = structlog.get_config()
    out = io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", out)
        setup_logging("console", "info")

        def handler() -> None:
            api_key = "sk-secret-do-not-log"  # noqa: F841 (a local the traceback must not show)
            raise RuntimeError("boom")

        try:
            handler()
        except RuntimeError:
            structlog.get_logger().exception("handler failed")
    finally:
        structlog.configure(**old)
    text = out.getvalue()
    assert "handler failed" in text and "RuntimeError: boom" in text and "in handler" in text
    assert "sk-secret-do-not-log" not in text


class _Full(io.StringIO):
    """stderr on a full disk: every write fails with ENOSPC, as a log file under ``up`` does then."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")


def test_an_unwritable_log_loses_lines_not_the_service(monkeypatch):
    """Every service exited 1 at its first log line when its stderr could not be written (measured: router,
    worker, planner and KV directory each started with stderr on /dev/full exited 1 at once; under ``up`` a
    full disk under LOG_DIR did that to every restart). A log write that fails loses its line; the first one
    written afterwards says how many were lost."""
    import json

    old = structlog.get_config()
    out = io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", _Full())
        setup_logging("json", "info")
        log = structlog.get_logger()
        log.warning("lost one")
        log.info("lost two", code=1)
        monkeypatch.setattr(sys, "stderr", out)  # space again
        log.info("written")
    finally:
        structlog.configure(**old)
    note, line = (json.loads(ln) for ln in out.getvalue().splitlines())
    assert note["level"] == "warning" and note["lost"] >= 2 and "lost" in note["event"]
    assert line["event"] == "written"
