"""What a plain ``scancel`` sends a process of a job: bursts of SIGTERM, until it has exited (``shared.signals``).

Slurm signals every process of the job at once, and the job's stop and the supervise loops send more: a process
gets several SIGTERMs within milliseconds. The tests that check an entry point ends with its own status, and no
"signal wakeup fd" traceback, send :func:`send_stop_bursts`'s bounded bursts (c07e55a: a tight kill loop of ~a
million signals filled asyncio's self-pipe and timed out under load).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

BURST = 4
"""Signals per burst."""
BURST_GAP_S = 0.002
"""Seconds between two signals of a burst."""
BURSTS_EVERY_S = 0.02
"""Seconds between two bursts."""


def send_stop_bursts(proc: subprocess.Popen, bursts: int = 150, sig: int = signal.SIGTERM) -> int:
    """Send ``proc`` bursts of :data:`BURST` ``sig`` signals :data:`BURST_GAP_S` apart, one burst every
    :data:`BURSTS_EVERY_S`, until it has exited or ``bursts`` bursts were sent (150: about 600 signals, ~4 s).

    Returns:
        How many signals were sent (>= 0; 0 when ``proc`` had already exited). The caller waits for the exit.
    """
    sent = 0
    for _ in range(bursts):
        for _ in range(BURST):
            if proc.poll() is not None:
                return sent
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                return sent
            sent += 1
            time.sleep(BURST_GAP_S)
        if proc.poll() is not None:
            return sent
        time.sleep(BURSTS_EVERY_S)
    return sent
