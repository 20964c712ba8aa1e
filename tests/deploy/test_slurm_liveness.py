"""The Slurm job supervises its head services as ``evolving-infra up`` does: a liveness watch (a silent router is
SIGKILLed and restarted) and restarts counted within ``RESTART_WINDOW_S`` (a crash loop slower than the stable period,
which the job's old streak reset, fails the job). Before, a SIGSTOPped router hung every request until an operator
killed it, and a service crashing every minute or slower was restarted forever.

Runs the script with ``bash``, the real services and nats-server, and Slurm's stand-ins
(``tests/deploy/test_slurm_supervision.py``'s :class:`Job`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.test_slurm_supervision import Job, get, job_pids
from tests.stop_burst import send_stop_bursts


def pid_of(run: Path, name: str) -> int:
    """The running process of head service ``name`` as its supervise loop wrote it (``pids/NAME.pid``).

    Raises:
        OSError: no pid file yet.
        ValueError: the file is empty or not a pid: being written (``echo ... >FILE`` truncates it first), as
            ``evolving_infra.liveness.read_pid_file`` reads it too. Before, an empty file was an IndexError, which the
            crash-loop test's poll did not expect (it failed once in a fresh clone's suite, between a restart's
            truncate and its write).
    """
    words = (run / "pids" / f"{name}.pid").read_text().split()
    if not words:
        raise ValueError(f"{run / 'pids' / name}.pid is empty (being written)")
    return int(words[0])


def test_pid_of_a_pid_file_being_written_is_a_value_error_the_polls_retry(tmp_path):
    """The crash-loop test polls ``pid_of`` and retries on OSError / ValueError: a file caught between the supervise
    loop's truncate and its write (empty) must be one of those, not an IndexError that fails the test."""
    (tmp_path / "pids").mkdir()
    with pytest.raises(OSError):
        pid_of(tmp_path, "planner")
    (tmp_path / "pids" / "planner.pid").write_text("")
    with pytest.raises(ValueError, match="empty"):
        pid_of(tmp_path, "planner")
    (tmp_path / "pids" / "planner.pid").write_text("123 45\n")
    assert pid_of(tmp_path, "planner") == 123


@pytest.mark.timeout(150)
def test_a_stopped_router_is_killed_by_the_liveness_watch_and_restarted(tmp_path):
    job = Job(tmp_path, LIVENESS_TIMEOUT_S="10")
    try:
        job.wait_for("liveness watch: nats, kvdirectory, planner, router (SIGKILL after 10 s silent)", 100)
        # heartbeats are seen (the watch's NATS connection as launcher): nothing healthy is killed meanwhile
        time.sleep(3)
        router = pid_of(job.run, "router")
        os.kill(router, signal.SIGSTOP)
        stopped_at = time.monotonic()
        job.wait_for("router silent for", 30)
        killed_after = time.monotonic() - stopped_at
        # the restart's number by pattern: a router that exited once at its start under load was restart 1
        deadline = time.monotonic() + 10
        while not re.search(r"router exited \(status 137\); restart \d+ of 10 within 600 s", job.text()):
            assert time.monotonic() < deadline, job.text()
            time.sleep(0.3)
        # its silence counts from its last heartbeat (one a second), up to 1 s before the SIGSTOP, and the test's
        # poll of the output every 0.3 s: at least timeout - 1.5 s; at most its timeout, then a pass and a probe round
        assert 10 - 1.5 <= killed_after <= 10 + 10, (killed_after, job.text())
        assert f"SIGKILL to pid {router}" in job.text(), job.text()
        deadline = time.monotonic() + 60
        while True:
            try:
                r = json.loads(get(f"http://127.0.0.1:{job.port}/v1/completions", {"prompt": "hello there", "max_tokens": 4}))
                break
            except OSError as e:
                assert time.monotonic() < deadline, f"no completion after the router's restart: {e}\n{job.text()}"
                time.sleep(0.5)
        assert r["usage"]["completion_tokens"] == 4
        assert pid_of(job.run, "router") != router
        # only the router was silent: no other service killed
        assert re.findall(r"(\S+) silent for", job.text()) == ["router"], job.text()
        os.kill(job.proc.pid, signal.SIGTERM)  # scancel --batch --signal=TERM: the watch stops first, then the rest
        assert job.proc.wait(60) == 0, job.text()
        time.sleep(0.5)
        assert job_pids(job.run) == {}, job_pids(job.run)
    finally:
        job.close()


@pytest.mark.timeout(150)
def test_a_crash_loop_slower_than_the_stable_period_fails_the_job_with_the_service_s_name(tmp_path):
    """The router dies after more than RESTART_STABLE_S (2 s) up, each time: the old streak reset at every exit
    (restarted forever); now the exits count within RESTART_WINDOW_S, the 5th logs the crash-loop line, the 6th
    (past MAX_RESTARTS 5) gives up and the job fails naming it. (The planner until session 59: now a planner past
    MAX_RESTARTS is left down and the job serves on, tests/deploy/test_slurm_control_plane_down.py.)

    Under load a router may also exit by itself (at its start, or between the test's read of its pid and its kill):
    each exit counts the same, so the test asserts on the give-up and the crash-loop lines, and that each of its own
    kills (status 137 after more than 2 s up) restarted with the backoff back at 0.5 s, not on exactly 6 kills."""
    job = Job(tmp_path, MAX_RESTARTS="5", RESTART_WINDOW_S="300", RESTART_STABLE_S="2", LIVENESS_TIMEOUT_S="0")

    def out() -> str:
        router_log = job.run / "router.log"
        tail = router_log.read_text(errors="replace")[-3000:] if router_log.exists() else "(no router.log)"
        return f"{job.text()}\n--- router.log (tail) ---\n{tail}"

    try:
        job.wait_for("READY", 150)
        killed, gone = set(), set()
        deadline = time.monotonic() + 90
        while job.proc.poll() is None:
            assert time.monotonic() < deadline, out()
            try:
                pid = pid_of(job.run, "router")
            except (OSError, ValueError, IndexError):  # not written yet (the job renames it whole, since this read "")
                time.sleep(0.2)
                continue
            if pid not in killed and pid not in gone:
                time.sleep(2.5)  # up longer than RESTART_STABLE_S: the old loop's streak would reset here
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:  # it exited by itself meanwhile (counted by its loop as any exit)
                    gone.add(pid)
            time.sleep(0.2)
        text = out()
        assert job.proc.returncode == 1, text
        exits = re.findall(r"router exited \(status (\d+)\); restart (\d) of 5 within 300 s in ([\d.]+) s", text)
        assert [int(n) for _, n, _ in exits] == [1, 2, 3, 4, 5], (exits, text)
        assert 1 <= len(killed) <= 6, (killed, gone, text)
        # each of the test's kills came after more than RESTART_STABLE_S up: the backoff started again at 0.5 s each
        # time, as the old loop's streak did (it then never gave up: a streak of 1)
        assert [b for status, _, b in exits if status == "137"] == ["0.5"] * sum(st == "137" for st, _, _ in exits), text
        assert "router has restarted 5 times in the last hour (crash loop); the job gives up only past 5 exits within 300 s" in text, text
        assert re.search(r"router exited \(status \d+\) 6 times in 300 s \(RESTART_WINDOW_S\): giving up", text), text
        assert "FAILED: router ended" in text, text
        assert "liveness watch" not in text  # LIVENESS_TIMEOUT_S=0: off
        time.sleep(0.5)
        assert job_pids(job.run) == {}, job_pids(job.run)
    finally:
        job.close()


@pytest.mark.timeout(150)
def test_the_stop_waits_for_the_liveness_watch_a_few_seconds_not_stop_grace(tmp_path):
    """The stop stops the liveness watch first (nothing a stop makes silent is SIGKILLed). It holds nothing: a watch
    that does not stop (here SIGSTOPped) is SIGKILLed after 5 s. Before, that wait was STOP_GRACE (here 60 s), on
    top of the router's, the others' and nats-server's."""
    from tests.deploy.test_slurm_supervision import service_pid

    job = Job(tmp_path, LIVENESS_TIMEOUT_S="10", STOP_GRACE="60")
    try:
        job.wait_for("liveness watch: nats, kvdirectory, planner, router", 100)
        os.kill(service_pid(job.run, "evolving_infra.liveness"), signal.SIGSTOP)
        t0 = time.monotonic()
        os.kill(job.proc.pid, signal.SIGTERM)  # scancel --batch --signal=TERM
        try:
            rc = job.proc.wait(45)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still runs 45 s after its SIGTERM (its watch stopped):\n{job.text()}")
        took, text = time.monotonic() - t0, job.text()
        assert rc == 0, text
        assert "still running 5 s after their stop signal (the liveness watch's own bound): liveness (SIGTERM); SIGKILL" in text, text
        assert text.index("the liveness watch's own bound") < text.index("] stopped"), text
        assert took < 40, (took, text)
        time.sleep(0.5)
        assert job_pids(job.run) == {}, job_pids(job.run)
    finally:
        job.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("env, frag", [
    ({"LIVENESS_TIMEOUT_S": "5"}, "LIVENESS_TIMEOUT_S=5: whole seconds, 0 (off) or at least 10"),
    ({"RESTART_WINDOW_S": "10m"}, "RESTART_WINDOW_S=10m: whole seconds, 1 or more"),
])
def test_a_bad_limit_stops_the_job_before_anything_starts(tmp_path, env, frag):
    job = Job(tmp_path, **env)
    try:
        assert job.proc.wait(20) == 2, job.text()
        assert frag in job.text(), job.text()
    finally:
        job.close()


# the watch's decisions, sans-IO (evolving_infra.liveness.Watch: up's liveness_overdue, bus_watch, probe_seen_until,
# paused), on a test clock


def _watch(timeout_s: float = 10.0, start_timeout_s: float = 30.0):
    from evolving_infra.liveness import Watch

    return Watch(timeout_s=timeout_s, start_timeout_s=start_timeout_s)


def _passes(w, names: dict[str, tuple[int, int] | None], t_from: float, t_to: float, *, beats: dict[str, int] | None = None,
            bus: bool = True) -> list[tuple[str, int, float]]:
    """Passes every 0.5 s from ``t_from`` to ``t_to``: each observes ``names``, beats come from ``beats`` (name → pid),
    the bus answers (``bus``); returns what was named overdue."""
    beats = beats or {}
    out = []
    t = t_from
    while t <= t_to + 1e-9:
        for name, ident in names.items():
            w.observe(name, ident, t)
        for name, pid in beats.items():
            w.on_beat(name, pid, t)
        if bus:
            w.bus_answered(t)
        out += [(n, p, round(s, 1)) for n, p, s in w.overdue(t)]
        t += 0.5
    return out


def test_watch_names_a_silent_service_once_and_only_beats_from_its_running_pid_count():
    w = _watch()
    # beats from the router's running pid 100: never named
    assert _passes(w, {"router": (100, 7)}, 0.0, 40.0, beats={"router": 100}) == []
    # beats from an old process (pid 99, still in flight) are no sign of life of pid 100: named 10 s after its last
    named = _passes(w, {"router": (100, 7)}, 40.5, 60.0, beats={"router": 99})
    assert named == [("router", 100, 10.5)], named
    assert _passes(w, {"router": (100, 7)}, 60.5, 80.0) == []  # killed: not named again
    # its restart (a new pid) starts its clocks anew: before its first beat, max(timeout, start timeout) = 30 s
    assert _passes(w, {"router": (101, 9)}, 80.5, 110.5) == []
    assert _passes(w, {"router": (101, 9)}, 111.0, 111.0) == [("router", 101, 30.5)]


def test_watch_judges_nothing_while_its_own_nats_connection_is_silent_nor_across_its_own_pause():
    w = _watch()
    assert _passes(w, {"planner": (5, 1)}, 0.0, 5.0, beats={"planner": 5}) == []
    # nats-server hung: no beats and no PING answer (the bus's silence, not the planner's): nothing named in 60 s
    assert _passes(w, {"planner": (5, 1)}, 5.5, 65.0, bus=False) == []
    # the bus answers again at 65.5: the planner's silence counts from then (10 s later: named)
    assert _passes(w, {"planner": (5, 1)}, 65.5, 75.5) == []
    assert _passes(w, {"planner": (5, 1)}, 76.0, 76.0) == [("planner", 5, 10.5)]
    # the watch itself stopped 20 s (a pass 20 s after the last): clocks start again, nothing named for the gap
    w2 = _watch()
    assert _passes(w2, {"router": (8, 1)}, 0.0, 2.0, beats={"router": 8}) == []
    assert _passes(w2, {"router": (8, 1)}, 22.0, 31.5) == []
    assert _passes(w2, {"router": (8, 1)}, 32.5, 32.5) == [("router", 8, 10.5)]


def test_watch_judges_nats_server_up_to_its_latest_finished_probe():
    from evolving_infra.liveness import NATS

    def run(w, t_from: float, t_to: float, probes_end: bool) -> list[tuple[str, int, float]]:
        out, t = [], t_from
        while t <= t_to + 1e-9:
            w.observe(NATS, (3, 1), t)
            if probes_end:
                w.nats_probed(t - 0.5, None)  # a probe started 0.5 s ago ended unanswered
            out += [(n, p, round(s, 1)) for n, p, s in w.overdue(t)]
            t += 0.5
        return out

    w = _watch()
    w.observe(NATS, (3, 1), 0.0)
    w.nats_probed(0.0, 0.1)  # answered at 0.1
    assert run(w, 0.5, 10.5, True) == []
    assert run(w, 11.0, 11.0, True) == [(NATS, 3, 10.4)]  # judged up to 10.5, its latest finished probe's start
    # a probe that never ends (the watch's own connect hangs): nothing judged past the start of the last that ended
    w2 = _watch()
    w2.observe(NATS, (3, 1), 0.0)
    w2.nats_probed(0.0, 0.1)
    w2.nats_probed(5.0, None)
    assert run(w2, 0.5, 30.0, False) == []


def test_the_watcher_signals_only_a_process_its_supervise_loop_still_runs(tmp_path):
    """A pid file whose pid is not the named loop's child (the pid taken again by another process after an exit) is
    no process of the service: never observed, never killed."""
    import argparse
    import subprocess
    import sys as _sys

    from evolving_infra.liveness import Watcher

    child = subprocess.Popen([_sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        w = Watcher(argparse.Namespace(pid_dir=str(tmp_path), services=["router"], nats_port=None, creds="", timeout_s=10.0,
                                       start_timeout_s=30.0))  # fmt: skip
        (tmp_path / "router.pid").write_text(f"{child.pid} {os.getpid()}\n")
        ident = w.current("router")
        assert ident is not None and ident[0] == child.pid
        (tmp_path / "router.pid").write_text(f"{child.pid} {os.getpid() + 1}\n")  # another parent: not its loop's child
        assert w.current("router") is None
        w.watch.observe("router", (child.pid, ident[1]), 0.0)
        w.kill("router", child.pid, 12.0)
        assert child.poll() is None  # not signalled
        (tmp_path / "router.pid").write_text(f"{child.pid} {os.getpid()}\n")
        w.kill("router", child.pid, 12.0)
        assert child.wait(5) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def test_watch_judges_a_process_it_first_sees_from_the_process_s_real_start():
    """The watch (re)started while a service already ran: before, every process first seen got the whole start-up
    allowance (max(timeout, READY_TIMEOUT): up to 300 s) from then, so an already-hung service was killed only
    ~300 s later. Now its age (/proc/PID/stat's start time) says whether it is still starting."""
    w = _watch(timeout_s=10.0, start_timeout_s=300.0)
    # up 400 s when the watch starts, hung (no beat): named 10 s after the watch can see beats, not 300 s
    w.observe("router", (100, 7), 0.0, age_s=400.0)
    named = _passes(w, {"router": (100, 7)}, 0.0, 19.5)
    assert named == [("router", 100, 10.5)], named
    # a process seen 5 s after its start (at 15; the watch running): it keeps the rest of its allowance, to 315
    w.observe("planner", (200, 9), 20.0, age_s=5.0)
    assert _passes(w, {"planner": (200, 9)}, 20.0, 315.0) == []
    named = _passes(w, {"planner": (200, 9)}, 315.5, 315.5)
    assert named == [("planner", 200, 300.5)], named
    # 295 s into its 300-s allowance: never less than the timeout from now (10 s), then named
    assert _passes(w, {}, 316.0, 319.5) == []  # passes go on (no pause of the watch)
    w.observe("kvdirectory", (300, 4), 320.0, age_s=295.0)
    assert _passes(w, {"kvdirectory": (300, 4)}, 320.0, 330.0) == []
    assert _passes(w, {"kvdirectory": (300, 4)}, 330.5, 330.5) == [("kvdirectory", 300, 10.5)]
    # a beat from it clears it as from any process
    w2 = _watch(timeout_s=10.0, start_timeout_s=300.0)
    w2.observe("router", (100, 7), 0.0, age_s=400.0)
    assert _passes(w2, {"router": (100, 7)}, 0.0, 60.0, beats={"router": 100}) == []


def test_watch_passes_always_a_little_late_still_kill_a_hung_service():
    """The watcher starved of CPU makes a pass every 3.1 s (each past SUPERVISE_GAP_S): only the first late pass in a
    row is a pause (clocks start again), as up's (evolving_infra.cluster); before, each one was, and a hung service
    was never killed."""
    w = _watch(timeout_s=10.0, start_timeout_s=30.0)
    assert _passes(w, {"router": (100, 7)}, 0.0, 5.0, beats={"router": 100}) == []
    named, t = [], 5.0
    while t < 40.0 and not named:
        t += 3.1
        w.observe("router", (100, 7), t)
        w.bus_answered(t)
        named = w.overdue(t)
    assert [(n, p) for n, p, _ in named] == [("router", 100)], (t, named)
    assert t < 5.0 + 3.1 + 10.0 + 3.1 + 0.1, t  # the first late pass restarted the clocks (8.1), then 10 s + one pass
    # a gap longer than the timeout is a pause even when late in a row: nothing named for it
    w2 = _watch(timeout_s=10.0, start_timeout_s=30.0)
    assert _passes(w2, {"router": (100, 7)}, 0.0, 5.0, beats={"router": 100}) == []
    for t in (8.1, 11.2):
        w2.observe("router", (100, 7), t)
        w2.bus_answered(t)
        assert w2.overdue(t) == []
    w2.observe("router", (100, 7), 30.0)
    w2.bus_answered(30.0)
    assert w2.overdue(30.0) == []  # 18.8 s after the last pass: paused, the clocks start again


@pytest.mark.timeout(120)
def test_a_burst_of_stop_signals_ends_the_watch_with_0_and_no_traceback(tmp_path, nats_url):
    """A plain ``scancel`` sends SIGTERM to every process of the job at once, and the job's stop and the watch's
    ``supervise`` loop each send it one more: the watch (whose output is the job's) gets several within milliseconds.
    Before, one that came while ``asyncio.run`` closed the loop printed "Exception ignored when trying to write to the
    signal wakeup fd ... OSError: [Errno 9] Bad file descriptor" into the job's output, and one just after killed the
    watch by SIGTERM (-15). Now the first stops it and the rest are ignored: status 0, no traceback.
    The real watch against a real nats-server (open), sent what a stop sends: bursts of 4 SIGTERMs 2 ms apart, one
    burst every 20 ms until it has exited (at most 150 bursts, 600 signals: bounded, so neither asyncio's self-pipe
    nor the output fills; a tight loop of ~a million signals did, and timed out under load)."""
    (tmp_path / "pids").mkdir()
    for attempt in range(3):
        log = tmp_path / f"watch-{attempt}.log"
        with log.open("w") as out_f:
            watch = subprocess.Popen(
                [sys.executable, "-m", "evolving_infra.liveness", "--pid-dir", str(tmp_path / "pids"),
                 "--services", "planner", "--timeout-s", "30"],
                env=dict(os.environ, EI_NATS_URL=nats_url, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
                stdout=out_f, stderr=subprocess.STDOUT, text=True,
            )
        try:
            started = time.monotonic() + 30
            while "liveness watch: planner" not in log.read_text() and time.monotonic() < started:
                assert watch.poll() is None, log.read_text()
                time.sleep(0.02)
            assert "liveness watch: planner" in log.read_text()  # its handlers are set: it runs its watch
            send_stop_bursts(watch)
            rc = watch.wait(timeout=15)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait(timeout=10)
        out = log.read_text()
        assert rc == 0 and "Exception ignored" not in out and "Traceback" not in out, (attempt, rc, out)
