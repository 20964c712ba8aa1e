"""``evolving-infra replay`` sent a burst of stop signals (a plain ``scancel`` of its job, a script's ``kill`` loop):
the first stops it, the next aborts at once (README: "again to abort at once"), with 128 + the signal's number and no
traceback; the rest are ignored.

Before, the abort's ``SystemExit`` left the loop with its handlers on, and the run's ``finally`` then put SIGTERM back
to its default: a later signal of the burst killed the replay (-15), or printed "Exception ignored when trying to
write to the signal wakeup fd" while ``asyncio.run`` closed the loop; a replay whose run had ended before the second
signal (its report being written) was killed by it (-15). Now the abort ignores the rest
(``shared.signals.ignore_stop_signals``), and from the run's end on a signal aborts as during the run
(``shared.signals.aborting``). Neither leaves asyncio's complaints behind: a third signal queued with the second
raised the abort again while ``asyncio.run`` cancelled the tasks ("Task was destroyed but it is pending!", a
traceback; deterministic in test_replay_third_signal.py), and a raise there can skip the shutdown's loop run in which
asyncio retrieves an abort raised in the replay's task ("Task exception was never retrieved").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evolving_infra.launcher import demo_trace_path
from tests.stop_burst import send_stop_bursts
from tests.unit.replay.stub_router import stub_router_thread

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_burst_of_stop_signals_aborts_a_replay_with_128_plus_the_signal_and_no_traceback(tmp_path, sig):
    env = os.environ | {"PYTHONPATH": str(ROOT), "EI_STATE_DIR": str(tmp_path / "state")}
    with stub_router_thread(hold=True) as (url, _stub):
        for attempt in range(3):
            out, log = tmp_path / f"o{attempt}", tmp_path / f"replay-{attempt}.log"
            with log.open("w") as err:
                p = subprocess.Popen([sys.executable, "-m", "evolving_infra.cli", "replay", str(demo_trace_path()),
                                      "--router-url", url, "--speedup", "1000", "--sessions", "1", "--out", str(out)],
                                     env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
            try:
                t0 = time.monotonic()
                while not list(out.glob("requests.partial-*")) and time.monotonic() - t0 < 60:  # its handlers are set
                    assert p.poll() is None, log.read_text()
                    time.sleep(0.02)
                time.sleep(0.3)  # its requests in flight (the stub holds them)
                send_stop_bursts(p, sig=sig)
                rc = p.wait(timeout=30)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            text = log.read_text()
            assert rc == 128 + sig, (attempt, rc, text[-2000:])
            for noise in ("Exception ignored", "Traceback", "never awaited", "never retrieved", "destroyed but it is pending"):
                assert noise not in text, (attempt, noise, text[-3000:])
