"""structlog setup: console output for humans, JSON lines for machines.

Call :func:`setup_logging` once in a process's ``__main__`` (never at import).
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog


class _CurrentStderr:
    """A file that writes to whatever ``sys.stderr`` is when a line is written, not the object it
    was when logging was configured: a process (a test, an in-process CLI call) that configured
    logging while ``sys.stderr`` was replaced by a capture that is closed since keeps logging to the
    real stderr instead of raising ``ValueError: I/O operation on closed file``."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


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
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=_CurrentStderr(), format="%(name)s %(levelname)s %(message)s")
    if service:
        structlog.contextvars.bind_contextvars(service=service)
