"""Process pools of the simulator (sweep items, partitions): fork workers that end with the run.

A SIGINT to the parent alone (``kill -INT``, a supervisor) used to wait, on leaving the ``with
ProcessPoolExecutor`` block, for the running items to finish: minutes of a sweep. Now the
workers are terminated at once. Ctrl-C in a terminal (SIGINT to the whole process group) ends
each worker at once and silently; the parent prints the one line.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a pool is made: a run on one process does without (~0.03 s CPU)
    from concurrent.futures import ProcessPoolExecutor


def _worker_init() -> None:
    """A pool worker ends at once and silently on SIGINT; the parent reports the interruption."""
    signal.signal(signal.SIGINT, lambda _sig, _frame: os._exit(130))


@contextmanager
def fork_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A ``fork`` process pool of ``workers`` processes (they inherit module state set before).

    On any exception in the body (``KeyboardInterrupt`` included) the pool's workers are
    terminated and queued items cancelled, so the caller's handler runs at once; otherwise the
    pool is shut down normally (waiting for its items).

    Raises:
        ValueError: ``workers`` < 1.
    """
    if workers < 1:
        raise ValueError(f"a pool needs at least one worker, got {workers}")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init)
    try:
        yield pool
    except BaseException:
        procs = list((getattr(pool, "_processes", None) or {}).values())
        manager = getattr(pool, "_executor_manager_thread", None)  # shutdown() forgets it
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
        # and its manager thread, which closes the pool's wake-up pipe when it sees the workers
        # gone: on Python 3.11 the exit hook (concurrent.futures.process._python_exit) writes
        # to that pipe without a lock, so a close racing it printed "Exception ignored ...
        # OSError: [Errno 9] Bad file descriptor" under the one line of a Ctrl-C'd sweep
        if manager is not None:
            manager.join(timeout=5)
        raise
    pool.shutdown(wait=True)
