"""``evolving-infra tap`` stopped (Ctrl-C) while its nats-server does not answer: it ends within seconds, exit 0,
no traceback.

Before, tap ended with nats-py's ``Client.drain``: each subscription's drain waited 10 s for the PONG of its PING
(nats-py's flush timeout), then the drain flushed again (10 s more) and raised ``FlushTimeoutError``: about 20 s and a
traceback. Now the drain is bounded (``evolving_infra.tap.TAP_DRAIN_S``), what it leaves is retrieved, then tap closes.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evolving_infra.tap import TAP_DRAIN_S
from shared.natsserver import EmbeddedNatsServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_tap_stopped_while_nats_is_silent_ends_within_its_drain_bound(tmp_path: Path) -> None:
    srv = EmbeddedNatsServer(jetstream=False).start()
    tap = None
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "EI_STATE_DIR": str(tmp_path / "state")}
        tap = subprocess.Popen([sys.executable, "-m", "evolving_infra.cli", "tap", "--nats-url", srv.url, "ei.p0.>"],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        assert tap.stderr is not None
        deadline = time.monotonic() + 30
        seen = b""
        while b"tapping" not in seen and time.monotonic() < deadline and tap.poll() is None:
            if select.select([tap.stderr], [], [], 0.2)[0]:
                seen += os.read(tap.stderr.fileno(), 4096)
        assert b"tapping" in seen, (tap.poll(), seen)
        os.kill(srv.pid, signal.SIGSTOP)  # alive, connected, silent: no PONG comes
        t0 = time.monotonic()
        tap.send_signal(signal.SIGINT)
        rc = tap.wait(timeout=60)
        took = time.monotonic() - t0
        err = seen.decode() + tap.stderr.read().decode()
        assert rc == 0, (rc, err)
        assert "Traceback" not in err and "never retrieved" not in err, err
        assert took < TAP_DRAIN_S + 3.0, f"tap took {took:.1f} s to stop with a silent server; {err}"
    finally:
        if tap is not None and tap.poll() is None:
            tap.kill()
            tap.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(srv.pid, signal.SIGCONT)
        srv.stop()
