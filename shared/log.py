"""structlog setup: console output for humans, JSON lines for machines.

Call :func:`setup_logging` once in a process's ``__main__`` (never at import). Lines of the stdlib
``logging`` module (libraries: the OTLP exporter, nats, uvicorn; warning and above) are rendered by
the same renderer (structlog's ``ProcessorFormatter``, with a ``logger`` key), so a ``json`` log is
JSON on every line.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog


_HANDLER = "evolving-infra"
"""Name of the root logger's handler :func:`setup_logging` installs."""


class _CurrentStderr:
    """A file that writes to whatever ``sys.stderr`` is when a line is written, not the object it
    was when logging was configured: a process (a test, an in-process CLI call) that configured
    logging while ``sys.stderr`` was replaced by a capture that is closed since keeps logging to the
    real stderr instead of raising ``ValueError: I/O operation on closed file``.

    A write or flush that fails with ``OSError`` (the log's disk full: ``ENOSPC``; a closed pipe) loses
    the line, not the service: it raised out of every log call, so each service exited 1 at its first
    line (``up`` writes each child's stderr to ``LOG_DIR/<service>.log``: a full disk there stopped the
    cluster, restart after restart) and a handler that logged failed. Lost lines are counted
    (:attr:`lost`); the first line written afterwards is preceded by one saying how many."""

    def __init__(self, fmt: str = "console") -> None:
        self.fmt = fmt
        self.lost = 0
        """Lines (writes) lost since the last one that went out."""
        self.lost_total = 0

    def write(self, text: str) -> int:
        try:
            if self.lost:
                self._note()
            return sys.stderr.write(text)
        except OSError:
            self._lose()
            return 0

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except OSError:
            self._lose()

    def _lose(self) -> None:
        self.lost += 1
        self.lost_total += 1

    def _note(self) -> None:
        """Say how many lines were lost (raises ``OSError`` when it cannot: still lost)."""
        import json
        import time

        what = f"{self.lost} log writes lost: the log could not be written (OSError, e.g. its disk full)"
        if self.fmt == "json":
            line = json.dumps({"event": what, "level": "warning", "lost": self.lost,
                               "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})  # fmt: skip
        else:
            line = f"{time.strftime('%H:%M:%S')} [warning  ] {what}"
        sys.stderr.write(line + "\n")
        self.lost = 0


def setup_logging(fmt: Literal["console", "json"] = "console", level: str = "info", *, service: str = "") -> None:
    """Configure structlog (and the stdlib root logger it feeds) for this process.

    Args:
        fmt: ``console`` (coloured key=value, for terminals) or ``json`` (one JSON object per line).
        level: ``debug``, ``info``, ``warning`` or ``error``.
        service: bound into every line as ``service=...`` when given.

    Raises:
        ValueError: on an unknown level name.
    """
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}")
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso" if fmt == "json" else "%H:%M:%S", utc=fmt == "json"),
    ]
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        # plain tracebacks, never rich's: with ``rich`` installed (transformers pulls it in) structlog's
        # default prints every frame's local variables (a request's prompt, an API key, a NATS URL with
        # its password) and took ~1 s per traceback, long enough for a bus handler to miss its reply
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback)]
    out = _CurrentStderr(fmt)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=out),  # type: ignore[arg-type]  # a TextIO in what it does: write, flush
        cache_logger_on_first_use=True,
    )
    # stdlib logging (libraries: the OTLP exporter's "Transient error ...", nats, uvicorn) goes through the
    # same renderer (structlog's ProcessorFormatter), so with ``json`` every line of a service's log is a
    # JSON object (``logger`` names the library); it was "name LEVEL message" plain text before
    handler = logging.StreamHandler(out)
    handler.set_name(_HANDLER)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*processors[:-1], structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, processors[-1]],
    ))  # fmt: skip
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER]:  # a second call replaces ours
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(lvl, logging.WARNING))
    if service:
        structlog.contextvars.bind_contextvars(service=service)
