"""``evolving-infra tap | head -1`` against a real nats-server: tap ends once its reader is gone."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parents[2]


def test_tap_ends_with_141_when_its_reader_goes(nats_url: str, tmp_path: Path) -> None:
    """The reader takes one line and closes the pipe; tap's next print fails. That failure was
    raised inside nats' subscription callback, which drops it: tap ran on, printing nothing,
    until killed (``tap | head -1`` never returned). Now it stops within seconds with status 141
    (128 + SIGPIPE, as ``trace ... | head``), without a traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EI_STATE_DIR": str(tmp_path / "state")}
    tap = subprocess.Popen([sys.executable, "-m", "evolving_infra.cli", "tap", "--nats-url", nats_url, "ei.p0.>"],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    async def publish_until_tap_exits() -> None:
        nc = await nats.connect(nats_url, connect_timeout=5)
        try:
            first = True
            deadline = time.monotonic() + 30
            while tap.poll() is None and time.monotonic() < deadline:
                await nc.publish("ei.p0.svc.heartbeat.worker", b"\xc1")
                await nc.flush(timeout=5)
                if first and await asyncio.to_thread(_line_ready):
                    tap.stdout.readline()  # the reader's one line ...
                    tap.stdout.close()  # ... and it goes
                    first = False
                await asyncio.sleep(0.05)
        finally:
            await nc.close()

    def _line_ready() -> bool:
        import select

        return bool(select.select([tap.stdout], [], [], 0.2)[0])

    try:
        asyncio.run(publish_until_tap_exits())
        rc = tap.wait(timeout=10)
    finally:
        if tap.poll() is None:
            tap.kill()
            tap.wait()
    err = tap.stderr.read().decode()
    assert rc == 141, (rc, err)
    assert "Traceback" not in err and "rror" not in err, err
