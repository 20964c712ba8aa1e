"""``-`` as a path argument: stdin or stdout where the argument is one stream, refused where it is
a folder.

Unix tools read ``-`` as stdin and write ``-`` as stdout (POSIX utility syntax guideline 13:
"For utilities that use operands to represent files to be opened for either reading or writing,
the '-' operand should be used to mean only standard input (or standard output when it is clear
from context that an output file is being specified)"). So, in ``evolving-infra``:

* a trace to read (``trace validate/stats/sample/pack``, ``simulate --trace``, ``replay``,
  ``demo --trace``, ``fidelity --trace``) may be ``-``: stdin, plain or gzip (detected by its
  magic, as a file's), read once into a temporary file (:func:`stdin_file`) because the readers
  open a trace more than once (header, then requests);
* a trace to write (``trace convert/generate/sample -o``, ``trace pack IN OUT``) may be ``-``:
  stdout (uncompressed JSON Lines; a packed trace's bytes), the status line stays on stderr;
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

__all__ = ["STDIO", "folder", "not_stdin", "shown", "stdin_file", "write_stdout"]

STDIO = "-"
"""The path that names stdin (an input) or stdout (an output)."""

_spooled: list[tuple[IO[bytes], str]] = []
"""``(stdin's stream, the temporary file holding what it gave)`` once :func:`stdin_file` has read
it: at most one (a caller that replaces ``sys.stdin``, a test, gets its new stream read)."""


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
    stdin (read at the first call, the same file at every later one; removed at exit).

    Raises:
        OSError: stdin cannot be read, or the temporary file cannot be written.
    """
    if os.fspath(path) != STDIO:
        return os.fspath(path)
    stream = sys.stdin.buffer
    if _spooled and _spooled[0][0] is stream:
        return _spooled[0][1]
    import atexit
    import shutil
    import tempfile

    if _spooled:
        shutil.rmtree(os.path.dirname(_spooled.pop()[1]), ignore_errors=True)
    folder_ = tempfile.mkdtemp(prefix="evolving-infra-stdin-")
    atexit.register(shutil.rmtree, folder_, True)
    name = os.path.join(folder_, "stdin")
    with open(name, "wb") as f:
        shutil.copyfileobj(stream, f, 1 << 20)
    _spooled.append((stream, name))
    return name


def shown(text: str) -> str:
    """``text`` (an error message) with the temporary file of stdin named ``-``, as given."""
    return text.replace(_spooled[0][1], STDIO) if _spooled else text


def write_stdout(write: Callable[[IO[bytes]], object]) -> object:
    """``write(sys.stdout.buffer)``, flushed. A reader that stops early (``| head``) ends the
    output quietly: stdout is pointed at ``/dev/null`` so the interpreter's last flush does not
    print ``BrokenPipeError`` at exit, and the error is raised for the caller's exit status.

    Raises:
        BrokenPipeError: the reader went away.
    """
    out = sys.stdout.buffer
    try:
        sys.stdout.flush()
        result = write(out)
        out.flush()
        return result
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise
