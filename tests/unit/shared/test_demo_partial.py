"""``launcher.demo_partial`` / ``partial_line``: the figures of a demo whose cluster ended during the replay
(live: ``tests/e2e/test_demo_no_restart.py``)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from evolving_infra.cluster import ClusterError, ServiceStopped
from evolving_infra.launcher import demo_partial, partial_line, watch_cluster


def test_a_crash_names_the_service_and_the_requests_answered_cancelled_and_never_sent():
    e = ClusterError("worker-w1 was killed by signal 9 (SIGKILL); log /x/worker-w1.log:\n...tail...", service="worker-w1",
                     reason="worker-w1 was killed by signal 9 (SIGKILL)")  # fmt: skip
    p = demo_partial(e, total=34, answered=9, in_flight=2)
    assert p == {"service": "worker-w1", "reason": "worker-w1 was killed by signal 9 (SIGKILL)", "clean": False,
                 "requests_total": 34, "requests_answered": 9, "in_flight_cancelled": 2, "requests_not_sent": 23}  # fmt: skip
    # the answered figure is the summary's 'requests   sent 9' (it said '11 of 34 requests sent, 2 of them in flight')
    assert partial_line(p) == ("the cluster ended during the replay (worker-w1 was killed by signal 9 (SIGKILL)): 9 answered + "
                               "2 cancelled in flight (not in the counts) of 34 requests; 23 never sent")  # fmt: skip


def test_a_clean_exit_is_marked_clean_and_an_error_without_reason_gives_its_first_line():
    stopped = ServiceStopped("planner exited cleanly (code 0); log /x/planner.log", service="planner",
                             log_path=Path("/x/planner.log"), log_tail="")  # fmt: skip
    p = demo_partial(stopped, total=5, answered=5, in_flight=0)
    assert (p["service"], p["reason"], p["clean"], p["requests_not_sent"]) == ("planner", "planner exited cleanly (code 0)", True, 0)
    bare = ClusterError("supervisor crashed: RuntimeError('x')\nmore")
    assert (bare.service, bare.reason) == (None, "supervisor crashed: RuntimeError('x')")
    assert demo_partial(bare, total=1, answered=0, in_flight=0)["service"] is None


def test_a_signal_names_itself_and_no_service():
    """Ctrl-C / SIGTERM during the demo's replay: the same figures, the signal as the cause (no service, not clean)."""
    p = demo_partial(signal.SIGTERM, total=10, answered=4, in_flight=1)
    assert p == {"service": None, "reason": "stopped by SIGTERM", "clean": False, "signal": "SIGTERM", "requests_total": 10,
                 "requests_answered": 4, "in_flight_cancelled": 1, "requests_not_sent": 5}  # fmt: skip
    assert partial_line(p) == ("the replay was stopped by SIGTERM: 4 answered + 1 cancelled in flight (not in the counts) "
                               "of 10 requests; 5 never sent")  # fmt: skip


@pytest.mark.parametrize(("total", "answered", "in_flight", "taken"),
                         [(3, 2, 2, (3, 2, 1, 0)), (2, 1, 2, (2, 1, 1, 0)), (-1, 0, 0, (0, 0, 0, 0)), (3, -1, 0, (3, 0, 0, 3)),
                          (3, 0, -1, (3, 0, 0, 3)), (1, 2, 1, (1, 2, 0, 0))])  # fmt: skip
def test_counts_that_do_not_add_up_are_clamped_with_a_warning_never_refused(capsys, total, answered, in_flight, taken):
    """The partial report is written whatever the counts (it raised ValueError: a traceback, status 1 and no report, the
    case the report exists for); counts that do not add up are clamped and said on stderr."""
    p = demo_partial(ClusterError("x"), total=total, answered=answered, in_flight=in_flight)
    assert (p["requests_total"], p["requests_answered"], p["in_flight_cancelled"], p["requests_not_sent"]) == taken
    assert f"warning: partial report counts do not add up ({answered} answered + {in_flight} in flight of {total}" in capsys.readouterr().err


def test_counts_that_add_up_give_no_warning(capsys):
    p = demo_partial(ClusterError("x"), total=3, answered=1, in_flight=2)
    assert (p["requests_answered"], p["in_flight_cancelled"], p["requests_not_sent"]) == (1, 2, 0)
    assert capsys.readouterr().err == ""


class _Cluster:
    """What :func:`watch_cluster` uses of a ``LocalCluster``: ``wait_failed`` returns ``ended`` or raises ``error``."""

    def __init__(self, ended: ClusterError | None = None, error: Exception | None = None) -> None:
        self.ended, self.error = ended, error

    async def wait_failed(self) -> ClusterError:
        await asyncio.sleep(0.01)
        if self.error is not None:
            raise self.error
        assert self.ended is not None
        return self.ended


async def test_the_watcher_stops_the_replay_when_the_cluster_ends_and_says_why(capsys):
    stop = asyncio.Event()
    e = ClusterError("worker-w0 was killed by signal 9 (SIGKILL)", service="worker-w0")
    assert await asyncio.wait_for(watch_cluster(_Cluster(ended=e), stop), 5) is e  # type: ignore[arg-type]
    assert stop.is_set() and capsys.readouterr().err == ""


async def test_a_watcher_that_fails_otherwise_says_so_and_leaves_the_replay_running(capsys):
    """An error other than the cluster's end (a defect) was swallowed by the demo's ``gather(watcher,
    return_exceptions=True)``: the replay went on unwatched without a word."""
    stop = asyncio.Event()
    assert await asyncio.wait_for(watch_cluster(_Cluster(error=OSError(24, "Too many open files")), stop), 5) is None  # type: ignore[arg-type]
    assert not stop.is_set()
    err = capsys.readouterr().err
    assert err.startswith("warning: the demo's cluster watcher failed (OSError: [Errno 24] Too many open files); "), err


async def test_a_cancelled_watcher_sets_no_stop():
    stop = asyncio.Event()
    task = asyncio.create_task(watch_cluster(_Cluster(ended=ClusterError("x")), stop))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and not stop.is_set()
