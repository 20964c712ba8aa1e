"""``evolving-infra tap`` sent a burst of SIGTERMs (a plain ``scancel`` of the job it runs in, a script's ``kill``
loop): it stops on the first and exits 0, no traceback.

Before, one that landed once tap had stopped, while ``asyncio.run`` closed the loop or just after, killed it by
SIGTERM (status -15: 6 of 6 tries) or printed "Exception ignored when trying to write to the signal wakeup fd".
Now SIGINT/SIGTERM are ignored from its stop to its exit (``shared.signals.ignore_stop_signals``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.stop_burst import send_stop_bursts

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_a_burst_of_stop_signals_ends_tap_with_0_and_no_traceback(tmp_path: Path, nats_url: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EI_STATE_DIR": str(tmp_path / "state")}
    for attempt in range(3):
        log = tmp_path / f"tap-{attempt}.log"
        with log.open("w") as out:
            tap = subprocess.Popen([sys.executable, "-m", "evolving_infra.cli", "tap", "--nats-url", nats_url, "ei.p0.>"],
                                   cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while "tapping" not in log.read_text() and time.monotonic() < deadline:  # its handlers are set
                assert tap.poll() is None, log.read_text()
                time.sleep(0.02)
            assert "tapping" in log.read_text(), log.read_text()
            send_stop_bursts(tap)
            rc = tap.wait(timeout=15)
        finally:
            if tap.poll() is None:
                tap.kill()
                tap.wait()
        text = log.read_text()
        assert rc == 0 and "Exception ignored" not in text and "Traceback" not in text, (attempt, rc, text[-2000:])
