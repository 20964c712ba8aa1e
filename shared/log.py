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
        # plain tracebacks, never rich's: with ``rich`` installed (transformers pulls it in) structlog's
        # default prints every frame's local variables (a request's prompt, an API key, a NATS URL with
        # its password) and took ~1 s per traceback, long enough for a bus handler to miss its reply
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback)]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    # stdlib logging (libraries: the OTLP exporter's "Transient error ...", nats, uvicorn) goes through the
    # same renderer (structlog's ProcessorFormatter), so with ``json`` every line of a service's log is a
    # JSON object (``logger`` names the library); it was "name LEVEL message" plain text before
    handler = logging.StreamHandler(_CurrentStderr())  # type: ignore[arg-type]
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
