"""``-`` as a path argument: stdin or stdout where the argument is one stream, refused where it is
a folder.

Unix tools read ``-`` as stdin and write ``-`` as stdout (POSIX utility syntax guideline 13:
"For utilities that use operands to represent files to be opened for either reading or writing,
the '-' operand should be used to mean only standard input (or standard output when it is clear
from context that an output file is being specified)"). So, in ``evolving-infra``:

* a trace to read (``trace validate/stats/sample/pack``, ``simulate --trace``, ``replay``,
  ``demo --trace``, ``fidelity --trace``) may be ``-``: stdin, plain or gzip (detected by its
  magic, as a file's), read once into a temporary file (:func:`stdin_file`) because the readers
  open a trace more than once (header, then requests); a stdin that is a terminal or closed is
  refused (a trace is piped or redirected; ``trace stats -`` typed by mistake does not wait);
* a trace to write (``trace convert/generate/sample -o``, ``trace pack IN OUT``) may be ``-``:
  stdout (uncompressed JSON Lines; a packed trace's bytes), the status line stays on stderr; a
  reader that stops early (``| head``) ends any command quietly, status :data:`READER_GONE`;
* a folder (``simulate/replay/demo/fidelity/report compare --out``, ``report show RUN_DIR``,
  ``up --log-dir``, ``auth --dir``, ``model init DIR``) or a raw input walked as files and folders
  (``trace convert`` inputs, ``replay --from`` inputs) cannot be a stream: ``-`` there is a usage
  error (exit status 2, argparse's usage line) naming ``./-`` for a file or folder really called
  ``-``, never a folder or file created under that name.

Kept free of heavy imports: the parsers import it when they are built.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import IO

__all__ = ["READER_GONE", "STDIO", "STDOUT_CLOSED", "folder", "not_stdin", "reader_gone", "shown", "stdin_file", "write_stdout"]

STDIO = "-"
"""The path that names stdin (an input) or stdout (an output)."""

_spooled: list[tuple[IO[bytes], str, Callable[[], None]]] = []
"""``(stdin's stream, the name of the temporary file holding what it gave, what removes that
file)`` once :func:`stdin_file` has read it: at most one (a caller that replaces ``sys.stdin``,
a test, gets its new stream read)."""


def folder(value: str) -> str:
    """``type=`` of an argument naming a folder: ``-`` is refused (a usage error).

    Raises:
        argparse.ArgumentTypeError: ``value`` is ``-``.
    """
    if value == STDIO:
        raise argparse.ArgumentTypeError("'-' (stdin/stdout) cannot be a folder; give a folder path (./- for a folder named '-')")
    return value


def not_stdin(value: str) -> str:
    """``type=`` of a raw input that is walked as files and folders (converters read files by
    name and kind): ``-`` is refused (a usage error).

    Raises:
        argparse.ArgumentTypeError: ``value`` is ``-``.
    """
    if value == STDIO:
        raise argparse.ArgumentTypeError(
            "'-' (stdin) cannot be a raw input, which is read as named files and folders; save it to a file "
            "(./- for a file named '-')"
        )
    return value


def stdin_file(path: str | os.PathLike[str]) -> str:
    """``path`` as a readable file name: itself, or for ``-`` a temporary file holding all of
    stdin (read at the first call, the same file at every later one).

    On Linux the copy has no name in ``$TMPDIR`` (``tempfile.TemporaryFile``, reopened through
    ``/proc/self/fd/N``), so nothing of it outlives the process however it ends (SIGTERM from
    ``timeout`` or a job scheduler, SIGKILL); elsewhere it is a named file removed at exit.

    Raises:
        OSError: stdin is closed or a terminal (a trace is piped or redirected, never typed:
            ``trace stats -`` typed by mistake would wait for input nobody gives), cannot be
            read, or the temporary file cannot be written (the message names the folder).
    """
    if os.fspath(path) != STDIO:
        return os.fspath(path)
    if sys.stdin is None:  # the process started with fd 0 closed
        raise OSError("stdin is closed; pipe or redirect a trace into it (... < trace.jsonl)")
    stream = sys.stdin.buffer
    if _spooled and _spooled[0][0] is stream:
        return _spooled[0][1]
    if stream.isatty():
        raise OSError("stdin is a terminal; pipe or redirect a trace into it (zcat t.jsonl.gz | ... -, ... - < t.jsonl), "
                      "or give the trace's file name")
    import shutil
    import tempfile

    if _spooled:
        _spooled.pop()[2]()
    release: Callable[[], None]
    if os.path.isdir("/proc/self/fd"):
        f = tempfile.TemporaryFile(prefix="evolving-infra-stdin-")
        name, release = f"/proc/self/fd/{f.fileno()}", f.close
    else:
        import atexit

        folder_ = tempfile.mkdtemp(prefix="evolving-infra-stdin-")
        atexit.register(shutil.rmtree, folder_, True)
        name = os.path.join(folder_, "stdin")
        f = open(name, "w+b")

        def release_named() -> None:
            f.close()
            shutil.rmtree(folder_, ignore_errors=True)

        release = release_named

    try:
        while chunk := stream.read(1 << 20):  # a read error is stdin's, raised as it is
            try:
                f.write(chunk)
            except OSError as e:  # disk full: say where, the message would name no file
                raise OSError(e.errno, f"stdin could not be copied into the temporary folder {tempfile.gettempdir()}: "
                              f"{e.strerror or e} (set TMPDIR to another)") from e
        f.flush()
    except BaseException:
        release()
        raise
    _spooled.append((stream, name, release))
    return name


def shown(text: str) -> str:
    """``text`` (an error message) with the temporary file of stdin named ``-``, as given."""
    return text.replace(_spooled[0][1], STDIO) if _spooled else text


STDOUT_CLOSED = "stdout is closed; run without >&- or give a file name"
"""Why ``-`` cannot be written when the process started with fd 1 closed (``sys.stdout`` is None)."""


def write_stdout(write: Callable[[IO[bytes]], object]) -> object:
    """``write(sys.stdout.buffer)``, flushed.

    Raises:
        BrokenPipeError: the reader went away (``| head``); ``evolving_infra.cli.main`` ends the
            command quietly then (:func:`reader_gone`).
        OSError: the process was started with stdout closed (``>&-``).
    """
    if sys.stdout is None:
        raise OSError(STDOUT_CLOSED)
    out = sys.stdout.buffer
    sys.stdout.flush()
    result = write(out)
    out.flush()
    return result


READER_GONE = 141
"""Exit status of a command whose stdout reader went away (``| head -1``): 128 + SIGPIPE, what a
shell shows for ``cat`` or ``yes`` ended by the same reader (Python ignores SIGPIPE, so the
write fails with ``BrokenPipeError`` instead of ending the process)."""


def reader_gone() -> bool:
    """True if stdout is a pipe (or socket) whose reader has closed it: a ``BrokenPipeError`` is
    then the reader stopping early (``| head``), not a failure to report. stdout is pointed at
    ``/dev/null`` so the interpreter's last flush does not print the error again at exit. False
    (nothing changed) when stdout is open, or is no file (a test's capture): another peer broke
    the pipe (a socket), which stays an error.
    """
    import select

    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        events = poll.poll(0)
    except (AttributeError, OSError, ValueError):  # no stdout, or not a file (io.UnsupportedOperation)
        return False
    if not any(ev & select.POLLERR for _, ev in events):  # Linux: POLLERR on a pipe's write end once no reader is left
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return True
