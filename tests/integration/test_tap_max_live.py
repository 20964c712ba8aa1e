"""``evolving-infra tap --max N`` against a real nats-server: it prints N messages, then stops, even when many more had
already reached it in a burst.

Before, the callback only set the stop event once N were printed; tap's drain then handled every message already
received, and the callback printed each of them (a read-only review's tap1.py: 2,000 published, ``--max 1`` printed
2,000 lines). ``--help`` says "stop after this many messages".
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from shared import messages as m
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import BRANCH_EVENTS, Subjects

ROOT = Path(__file__).resolve().parents[2]
BURST = 2000


@pytest.mark.timeout(90)
@pytest.mark.parametrize("limit", [1, 7])
def test_tap_max_prints_that_many_messages_of_a_burst(tmp_path: Path, limit: int) -> None:
    srv = EmbeddedNatsServer(jetstream=False).start()
    tap = None
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "EI_STATE_DIR": str(tmp_path / "state")}
        tap = subprocess.Popen(
            [sys.executable, "-m", "evolving_infra.cli", "tap", "--nats-url", srv.url, "--max", str(limit), "ei.p0.>"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert tap.stderr is not None
        deadline = time.monotonic() + 30
        seen = b""
        while b"tapping" not in seen and time.monotonic() < deadline and tap.poll() is None:
            if select.select([tap.stderr], [], [], 0.2)[0]:
                seen += os.read(tap.stderr.fileno(), 4096)
        assert b"tapping" in seen, (tap.poll(), seen)

        async def burst() -> None:
            nc = await nats.connect(srv.url, connect_timeout=5)
            try:
                subject = Subjects("p0").format(BRANCH_EVENTS)
                for i in range(BURST):
                    await nc.publish(subject, m.encode(m.BranchEnd(branch_id=f"b{i}")))
                await nc.flush(timeout=5)
            finally:
                await nc.close()

        asyncio.run(burst())
        out, err = tap.communicate(timeout=60)
        lines = out.decode().splitlines()
        text = seen.decode() + err.decode()
        assert tap.returncode == 0, (tap.returncode, text)
        assert "Traceback" not in text, text
        assert len(lines) == limit, f"--max {limit} printed {len(lines)} of the {BURST} messages published"
        for i, line in enumerate(lines):  # the first ones, in order
            assert re.search(rf"\bb{i}\b", line), f"line {i} is not message b{i}: {line}"
    finally:
        if tap is not None and tap.poll() is None:
            tap.kill()
            tap.wait()
        srv.stop()
