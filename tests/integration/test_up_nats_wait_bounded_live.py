"""``up --nats-url`` to a server that never becomes usable gives up after ``--ready-timeout`` with one line naming
the URL and what it waited for. Before, it waited forever: nothing listening (``Bus.connect`` reconnects forever,
still retrying after 25 s), or a server whose JetStream never answers (``ensure_stream(maker=True)`` looks the
stream up again and again). Services started by compose or Slurm keep retrying (they are supervised); only the
launcher gives up."""

from __future__ import annotations

import os
import socket
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _up(url: str, tmp_path: Path, timeout_s: float = 25.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evolving_infra.cli", "up", "--nats-url", url, "--ready-timeout", "2",
         "--nodes", "1", "--split", "collocated", "--profile", "tiny", "--port", "0", "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
        env={**os.environ, "EI_STATE_DIR": str(tmp_path / "state")},
    )  # fmt: skip


class _SilentJetStream(socketserver.StreamRequestHandler):
    """A NATS server as far as the core protocol goes (INFO, PONG to each PING) that answers no request: a JetStream
    API request (the stream lookup) gets neither an answer nor "no responders" (a loaded or hung server)."""

    def handle(self) -> None:
        self.wfile.write(b'INFO {"server_id":"silent","version":"2.10.0","proto":1,"headers":true,"max_payload":1048576}\r\n')
        for line in self.rfile:
            if line.strip() == b"PING":
                self.wfile.write(b"PONG\r\n")


@pytest.mark.timeout(60)
def test_up_gives_up_after_its_ready_timeout_when_nothing_listens_at_the_nats_url(tmp_path):
    url = f"nats://127.0.0.1:{_free_port()}"
    r = _up(url, tmp_path)
    err = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2, r
    assert len(err) == 1 and url in err[0] and "2 s" in err[0] and "--ready-timeout" in err[0], r.stderr
    assert not (tmp_path / "logs" / "router.log").exists()  # nothing started


@pytest.mark.timeout(60)
def test_up_gives_up_after_its_ready_timeout_when_jetstream_never_answers(tmp_path):
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _SilentJetStream)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"nats://127.0.0.1:{server.server_address[1]}"
        r = _up(url, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    err = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 1, r
    assert len(err) == 1 and url in err[0] and "$JS.API.STREAM.INFO.EI_p0" in err[0] and "--ready-timeout" in err[0], r.stderr
    assert not (tmp_path / "logs" / "router.log").exists()
