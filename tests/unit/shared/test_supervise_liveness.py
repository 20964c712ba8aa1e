"""The supervisor's liveness watch and crash-loop limit on a fake clock (``supervise_once(now)``), on real child
processes (``sleep``) and, for nats-server's own watch, a real nats-server: a service silent past
``liveness_timeout_s`` is SIGKILLed and restarted as after a crash, never before its first sign of life within its
start timeout, nor while its beats cannot be seen, nor for a time the supervisor itself did not run (``up`` stopped);
nats-server only up to its latest probe that came to an end; ``max_restarts`` counts the restarts within
``restart_window_s`` (systemd's StartLimitBurst/IntervalSec), so a service crashing every ~61 s gives up where that
many in the window are too many, and a slower loop is named in a "crash loop" warning line."""

from __future__ import annotations

import os
import re
import signal

import pytest

from evolving_infra.cluster import ClusterError, ClusterSpec, LocalCluster, _Child, count_exit, liveness_overdue, m


def test_liveness_overdue_decides_on_the_latest_sign_of_life():
    kw = dict(timeout_s=30.0, start_timeout_s=60.0)
    # answered at 100, watched since 0: overdue past 130, with the silence since the last answer
    assert liveness_overdue(129.0, started_at=90.0, last_ok=100.0, watch_from=0.0, **kw) is None
    assert liveness_overdue(131.0, started_at=90.0, last_ok=100.0, watch_from=0.0, **kw) == pytest.approx(31.0)
    # still starting (no answer since this start; an answer of the previous process does not count): the start timeout
    assert liveness_overdue(149.0, started_at=90.0, last_ok=None, watch_from=0.0, **kw) is None
    assert liveness_overdue(149.0, started_at=90.0, last_ok=80.0, watch_from=0.0, **kw) is None
    assert liveness_overdue(151.0, started_at=90.0, last_ok=None, watch_from=0.0, **kw) == pytest.approx(61.0)
    # the beats could not be seen (NATS down): nothing decided; seen again since 200: counted from then
    assert liveness_overdue(1000.0, started_at=90.0, last_ok=100.0, watch_from=None, **kw) is None
    assert liveness_overdue(229.0, started_at=90.0, last_ok=100.0, watch_from=200.0, **kw) is None
    assert liveness_overdue(231.0, started_at=90.0, last_ok=100.0, watch_from=200.0, **kw) == pytest.approx(31.0)
    # 0 = off
    assert liveness_overdue(1e9, started_at=0.0, last_ok=0.0, watch_from=0.0, timeout_s=0.0, start_timeout_s=60.0) is None


def test_count_exit_keeps_the_window():
    exits: list[float] = []
    assert [count_exit(exits, t, 600.0) for t in (0.0, 61.0, 122.0)] == [1, 2, 3]
    assert count_exit(exits, 601.0, 600.0) == 3  # the exit at 0 left the window
    assert exits == [61.0, 122.0, 601.0]


def _cluster(tmp_path, **kw) -> LocalCluster:
    spec = dict(restart=True, restart_backoff_s=0.5, stable_s=60.0, liveness_timeout_s=30.0, ready_timeout_s=60.0)
    c = LocalCluster(ClusterSpec(**{**spec, **kw}))
    c.log_dir = tmp_path
    c.children = [_Child("svc", ["sleep", "300"], tmp_path / "svc.log")]
    c._spawn(c.children[0])
    return c


def _beat(c: LocalCluster, child: _Child, now: float) -> None:
    assert child.proc is not None
    c._on_beat(m.Heartbeat(service="svc", instance=child.name, pid=child.proc.pid), now)


def _close(child: _Child) -> None:
    assert child.proc is not None
    child.proc.kill()
    child.proc.wait()
    if child.log_file is not None:
        child.log_file.close()


def _walk(c: LocalCluster, child: _Child, t_from: float, t_to: float, *, bus: bool = True) -> float:
    """Supervision passes every second (as ``up``'s, without a gap: :data:`SUPERVISE_GAP_S`) from ``t_from`` to
    ``t_to``, the launcher's NATS answering each (``bus``) or not; none may kill or start anything. Returns ``t_to``."""
    t = t_from
    while True:
        if bus:
            c._bus_last_ok = t
        assert c.supervise_once(t) == [] and child.proc is not None and child.proc.poll() is None, t
        if t >= t_to:
            return t
        t = min(t + 1.0, t_to)


def _reaped(child: _Child) -> None:
    """Let the SIGKILLed process die (a pass does not wait for it: the killing pass reaps it if it is dead by its poll
    right after the kill, else the next one)."""
    assert child.proc is not None and child.killed
    if child.proc.returncode is None:  # not reaped by the killing pass: a waitid of a reaped pid raises ChildProcessError
        os.waitid(os.P_PID, child.proc.pid, os.WEXITED | os.WNOWAIT)  # dead, left for the supervisor's poll to reap


def test_a_silent_service_is_killed_and_restarted_as_after_a_crash(tmp_path, capsys):
    c = _cluster(tmp_path)
    child = c.children[0]
    try:
        os.kill(child.proc.pid, signal.SIGSTOP)  # hung: alive, silent; SIGKILL must still end it
        t0 = child.started_at
        c._bus_last_ok = t0  # the launcher's NATS answers: the beats can be seen
        assert c.supervise_once(t0) == [] and c._bus_ok_since == t0
        _beat(c, child, t0 + 1.0)
        _walk(c, child, t0 + 1.0, t0 + 31.0)
        first = child.proc.pid
        c._bus_last_ok = t0 + 31.5
        assert c.supervise_once(t0 + 31.5) == []  # silent 30.5 s since its beat at +1: killed
        _reaped(child)
        assert c.supervise_once(t0 + 31.6) == []  # reaped by this pass or the killing one: counted as a crash, backed off
        assert child.proc.returncode == -signal.SIGKILL
        assert child.exits in ([t0 + 31.5], [t0 + 31.6]), child.exits  # counted like an exit
        assert child.restart_at == pytest.approx(child.exits[0] + 0.5)  # a crash's backoff (0.5 s)
        out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # the console renderer's colours
        assert "svc silent for 30 s (no heartbeat); killing it to restart" in out and f"pid={first}" in out, out
        assert out.count("silent for") == 1, out  # one line: the pass that waits for its death does not kill again
        assert c.supervise_once(t0 + 32.2) == ["svc"] and child.proc.pid != first and c.restarts() == {"svc": 1}
    finally:
        _close(child)


def test_no_kill_while_starting_within_the_start_timeout_nor_while_the_bus_is_silent(tmp_path):
    c = _cluster(tmp_path)
    child = c.children[0]
    try:
        t0 = child.started_at
        _walk(c, child, t0, t0 + 59.0)  # no beat yet: it is starting (ready_timeout_s 60 > liveness 30)
        _beat(c, child, t0 + 59.5)
        # the launcher's NATS stops answering (nats-server down or hung): the beats cannot come; no one is judged
        _walk(c, child, t0 + 60.0, t0 + 299.0, bus=False)
        # NATS back at +300: the service gets a full timeout from then
        c._bus_last_ok = t0 + 300.0
        assert c.supervise_once(t0 + 300.0) == [] and c._bus_ok_since == t0 + 300.0
        _walk(c, child, t0 + 300.0, t0 + 330.0)
        c._bus_last_ok = t0 + 331.0
        assert c.supervise_once(t0 + 331.0) == []
        _reaped(child)
        assert c.supervise_once(t0 + 331.2) == [] and child.proc.returncode == -signal.SIGKILL
    finally:
        _close(child)


def test_a_silence_is_counted_only_up_to_the_buses_last_answer(tmp_path):
    """nats-server hangs: the launcher's PING gets no answer from T on, and every service's beats stop with it.
    Until the bus counts as silent (``BUS_SILENT_AFTER_S``) a service's silence is counted up to T, not to now: a
    service quiet since T - 27 is not killed at T + 4 (31 s after its beat), for what was the bus's silence."""
    c = _cluster(tmp_path)
    child = c.children[0]
    try:
        t0 = child.started_at
        _walk(c, child, t0, t0 + 3.0)
        _beat(c, child, t0 + 3.0)
        _walk(c, child, t0 + 3.0, t0 + 30.0)  # its last answer at +30
        _walk(c, child, t0 + 31.0, t0 + 34.0, bus=False)  # 31 s since the beat; 27 s seen
        assert c._bus_ok_since == t0
        assert c.supervise_once(t0 + 36.0) == [] and c._bus_ok_since is None  # the bus is silent: nothing judged
    finally:
        _close(child)


def test_a_stall_of_up_itself_kills_nothing(tmp_path, capsys):
    """``up`` stopped 12 s (Ctrl-Z / fg, a paused VM) with a 8-s timeout: its own loop did not run, so nobody watched.
    On its return the launcher's PING may be answered before the buffered beats are read: the service was killed (its
    silence counted across the stall) before; now every liveness clock starts again after a gap of passes."""
    c = _cluster(tmp_path, liveness_timeout_s=8.0)
    child = c.children[0]
    try:
        t0 = child.started_at
        _beat(c, child, t0 + 1.0)
        _walk(c, child, t0, t0 + 2.0)
        # stalled from +2 to +14: the first pass after it sees the PING answered at +14, the beats not read yet
        _walk(c, child, t0 + 14.0, t0 + 17.0)
        out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
        assert "supervision paused 12 s" in out and "silent for" not in out, out
        # still silent 8 s after the stall (a hang that began in it): killed then
        _walk(c, child, t0 + 17.0, t0 + 22.0)
        c._bus_last_ok = t0 + 22.5
        c.supervise_once(t0 + 22.5)
        assert child.killed
    finally:
        _close(child)


def test_passes_always_a_little_late_still_kill_a_hung_service(tmp_path, capsys):
    """``up`` starved of CPU: every pass 3.1 s after the previous one (past ``SUPERVISE_GAP_S``). Before, each pass
    started the liveness clocks again and a hung service was never killed (not within 600 s); now only the first late
    pass does, and the service is killed once silent past the timeout from then."""
    c = _cluster(tmp_path, liveness_timeout_s=10.0)
    child = c.children[0]
    try:
        os.kill(child.proc.pid, signal.SIGSTOP)
        t0 = child.started_at
        _beat(c, child, t0)
        t, killed_at = t0, None
        while t < t0 + 600.0:
            c._bus_last_ok = t  # up's own NATS answers (its probe ran just before this pass)
            c.supervise_once(t)
            if child.killed:
                killed_at = t - t0
                break
            t += 3.1
        out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
        assert killed_at == pytest.approx(3.1 * 5), (killed_at, out)  # the clocks restarted at the first late pass, +3.1
        assert out.count("supervision paused") == 1, out
    finally:
        _close(child)


def test_paused_only_at_the_first_of_late_passes_in_a_row_or_past_the_timeout():
    from evolving_infra.liveness import paused

    assert not paused(None, 100.0) and not paused(10.0, 13.0) and paused(10.0, 13.1)
    assert not paused(10.0, 13.1, late=True, timeout_s=10.0)  # starved, still watching
    assert paused(10.0, 20.1, late=True, timeout_s=10.0)  # a real stop during a starved spell


def test_liveness_off_never_kills(tmp_path):
    c = _cluster(tmp_path, liveness_timeout_s=0.0)
    child = c.children[0]
    try:
        t0 = child.started_at
        for t in (t0 + 100.0, t0 + 1000.0):
            c._bus_last_ok = t
            assert c.supervise_once(t) == [] and child.proc.poll() is None
    finally:
        _close(child)


def _end(child: _Child, code: int) -> None:
    """End the running process; ``code`` 0 reads as a SIGTERM's clean stop, -9 as a crash (SIGKILL)."""
    assert child.proc is not None
    child.proc.kill()
    child.proc.wait()
    child.proc.returncode = code


def test_a_service_crashing_every_61_s_gives_up_at_its_4th_exit_with_max_restarts_3(tmp_path):
    """Exits are counted within the window: before, a run of 61 s (past ``stable_s``) reset the streak and this loop went
    on forever even with ``max_restarts=3``. (With the defaults, 10 in 600 s, a 61-s loop goes on, named in a warning
    line: :func:`test_a_slow_crash_loop_goes_on_but_is_named_in_a_warning_line`.)"""
    c = _cluster(tmp_path, max_restarts=3, restart_window_s=600.0)
    child = c.children[0]
    try:
        t = child.started_at
        for _ in range(3):
            t += 61.0
            assert c.supervise_once(t) == [] and child.streak == 0  # seen running past stable_s
            _end(child, -9)
            assert c.supervise_once(t) == []  # a crash after a stable run: its first backoff step again
            assert child.restart_at == pytest.approx(t + 0.5)
            t += 0.5
            assert c.supervise_once(t) == ["svc"]
            child.started_at = t
        t += 61.0
        c.supervise_once(t)
        _end(child, -9)
        with pytest.raises(ClusterError, match=r"svc exited 4 times in 600 s \(last: killed by signal 9 \(SIGKILL\)\); giving up") as e:
            c.supervise_once(t)
        assert e.value.service == "svc"
    finally:
        _close(child)


def test_crashes_spread_past_the_window_do_not_give_up(tmp_path):
    c = _cluster(tmp_path, max_restarts=2, restart_window_s=600.0)
    child = c.children[0]
    try:
        t = child.started_at
        for _ in range(6):  # one crash every 301 s: never 3 within 600 s
            t += 301.0
            c.supervise_once(t)
            _end(child, -9)
            c.supervise_once(t)
            t += 0.5
            assert c.supervise_once(t) == ["svc"]
            child.started_at = t
        assert c.restarts() == {"svc": 6} and len(child.exits) == 2
    finally:
        _close(child)


def test_clean_exits_after_stable_runs_are_rolling_restarts_not_counted(tmp_path):
    """A SIGTERM's stop (code 0) of a service that ran ``stable_s``: an operator's rolling restart, however often;
    a quick clean exit in a loop still counts."""
    c = _cluster(tmp_path, max_restarts=2, restart_window_s=600.0)
    child = c.children[0]
    try:
        t = child.started_at
        for _ in range(5):
            t += 61.0
            c.supervise_once(t)
            _end(child, 0)
            assert c.supervise_once(t) == ["svc"]  # restarted at once, not counted
            child.started_at = t
        assert child.exits == [] and c.restarts() == {"svc": 5}
        for _ in range(2):  # quick clean exits: counted
            t += 1.0
            _end(child, 0)
            c.supervise_once(t)
            t += 5.0
            assert c.supervise_once(t) == ["svc"]
            child.started_at = t
        t += 1.0
        _end(child, 0)
        with pytest.raises(ClusterError, match=r"svc exited 3 times in 600 s \(last: code 0\)"):
            c.supervise_once(t)
    finally:
        _close(child)


def test_up_flags_reach_the_spec_and_bad_values_are_refused(tmp_path):
    from evolving_infra.cli import UsageError, build_parser
    from evolving_infra.launcher import _spec

    def spec(*extra: str) -> ClusterSpec:
        args = build_parser("up").parse_args(["up", "--nodes", "2", "--policy", "static", "--log-dir", str(tmp_path), *extra])
        return _spec(args)

    default = spec()
    assert (default.liveness_timeout_s, default.restart_window_s, default.max_restarts) == (30.0, 600.0, 10)
    given = spec("--liveness-timeout-s", "0", "--restart-window-s", "120", "--max-restarts", "3")
    assert (given.liveness_timeout_s, given.restart_window_s, given.max_restarts) == (0.0, 120.0, 3)
    for flag, value in (("--liveness-timeout-s", "-1"), ("--liveness-timeout-s", "nan"), ("--restart-window-s", "0")):
        with pytest.raises(UsageError, match=f"{flag} "):
            spec(flag, value)
    # a timeout shorter than the signs of life come kills healthy processes: refused with the least and why
    for value in ("1", "9.5"):
        with pytest.raises(UsageError, match=rf"--liveness-timeout-s {value}: 0 \(off\) or at least 10 wall s: a service beats every second"):
            spec("--liveness-timeout-s", value)
    assert spec("--liveness-timeout-s", "10").liveness_timeout_s == 10.0


def _with_nats(tmp_path, **kw) -> LocalCluster:
    from shared.natsserver import EmbeddedNatsServer

    spec = dict(restart=True, stable_s=60.0, liveness_timeout_s=8.0, ready_timeout_s=5.0)
    c = LocalCluster(ClusterSpec(**{**spec, **kw}))
    c.log_dir = tmp_path
    c.nats = EmbeddedNatsServer(jetstream=False).start()
    c._nats_started = c._nats_watch_from = 0.0
    return c


def test_nats_server_is_judged_only_up_to_its_latest_finished_probe(tmp_path, capsys):
    """A probe in flight (up's loop slow, or stopped mid-probe) is no silence of nats-server: before, its silence ran
    to ``now`` and a healthy server was SIGKILLed 8 s after its last answer although no probe had looked since; now
    it is judged up to the start of its latest probe that came to an end, answered or not (a real nats-server)."""
    c = _with_nats(tmp_path)
    try:
        first = c.nats.pid
        for t in range(0, 3):  # answered at 0, 1, 2
            c._nats_last_ok = c._nats_tried_at = float(t)
            assert c.supervise_once(float(t)) == []
        for t in range(3, 20):  # a probe started at 3 has not come to an end: nothing is judged past 2
            assert c.supervise_once(float(t)) == [] and c.nats.alive()
        c._nats_tried_at = 10.0  # probes that came to an end unanswered: silent from 2 up to 10, not past 8
        assert c.supervise_once(20.0) == [] and c.nats.alive()
        c._nats_tried_at = 10.5
        assert c.supervise_once(20.2) == []  # killed (silent 8.5 s); reaped by this pass if dead by its poll after the kill
        c.nats.proc.wait(10)
        # reaped at 20.2 (restarted at 20.4) or at 20.4 (restarted at 20.6): a crash, its restart 0.1 s later
        restarted = [t for t in (20.4, 20.6) if c.supervise_once(t) == ["nats-server"]]
        assert restarted == [round(c._nats_exits[0] + 0.2, 1)] and c._nats_exits in ([20.2], [20.4]), (restarted, c._nats_exits)
        assert c.nats.pid != first and c.nats.alive()
        out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
        assert out.count("nats-server silent for 8 s (no INFO on its port); killing it to restart") == 1, out
    finally:
        c.nats.stop()


def test_a_clean_exit_of_nats_server_after_a_stable_run_is_not_counted(tmp_path):
    """``--max-restarts``' help says a clean exit (code 0) after 60 s up does not count; nats-server's were counted all
    the same (a real nats-server: SIGTERM makes it exit 0). A quick clean exit still counts."""
    c = _with_nats(tmp_path, max_restarts=1)
    try:
        t = 0.0
        for _ in range(3):  # SIGTERMed after 61 s up, three times: none counted
            t += 61.0
            c.nats.proc.send_signal(signal.SIGTERM)
            assert c.nats.proc.wait(10) == 0
            c.supervise_once(t)
            t += 1.0
            assert c.supervise_once(t) == ["nats-server"]
        assert c._nats_exits == []
        for _ in range(2):  # quick ones count: the second past max_restarts 1
            t += 5.0
            c.nats.proc.send_signal(signal.SIGTERM)
            c.nats.proc.wait(10)
            if _ == 1:
                with pytest.raises(ClusterError, match="nats-server exited 2 times in 600 s; giving up"):
                    c.supervise_once(t)
            else:
                c.supervise_once(t)
                t += 1.0
                assert c.supervise_once(t) == ["nats-server"]
    finally:
        c.nats.stop()


def test_a_slow_crash_loop_goes_on_but_is_named_in_a_warning_line(tmp_path, capsys):
    """Under the defaults (10 exits within 600 s give up: a crash more often than about once a minute) a service
    crashing every 61 s is restarted on, as before; but from its 5th exit within an hour one warning line names the
    loop, again every 10 min while it lasts (before: only "service exited; restarting" lines, 40 restarts in 41 min)."""
    c = _cluster(tmp_path, max_restarts=10, restart_window_s=600.0)
    child = c.children[0]
    try:
        t = child.started_at
        warned_at: list[int] = []
        for i in range(1, 41):
            t += 61.0
            c.supervise_once(t)
            _end(child, -9)
            c.supervise_once(t)
            if "crash loop" in capsys.readouterr().out:
                warned_at.append(i)
            t += 0.5
            assert c.supervise_once(t) == ["svc"]
            child.started_at = t
        assert c.restarts() == {"svc": 40}  # no give-up: slower than 10 in 600 s
        assert warned_at == [5, 15, 25, 35]  # the 5th exit within the hour, then every 600 s (~10 exits of 61.5 s)
    finally:
        _close(child)


def test_the_crash_loop_line_says_how_often_and_the_give_up_limit(tmp_path, capsys):
    c = _cluster(tmp_path, max_restarts=10, restart_window_s=600.0)
    child = c.children[0]
    try:
        t = child.started_at
        for _ in range(5):
            t += 100.0
            c.supervise_once(t)
            _end(child, 1)
            c.supervise_once(t)
            t += 1.0
            assert c.supervise_once(t) == ["svc"]
            child.started_at = t
        out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
        assert (f"svc has restarted 5 times in the last hour (crash loop); up gives up only past 10 exits within 600 s; "
                f"see {child.log_path}") in out, out
    finally:
        _close(child)


def test_the_time_a_pass_spends_restarting_nats_server_is_no_pause_of_the_supervision(tmp_path, capsys, monkeypatch):
    """``nats.restart()`` waits for the new server's port (up to 10 s) inside a pass. Before, the next pass's gap was
    counted from the start of that pass: a restart that took 5 s read as "supervision paused 5 s" and restarted every
    liveness clock. Now from its end (a fake clock: the restart takes 5 s of it)."""
    import types

    from evolving_infra import cluster

    clock = [0.0]
    monkeypatch.setattr(cluster, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    c = _with_nats(tmp_path)
    real_restart = c.nats.restart

    def slow_restart():  # type: ignore[no-untyped-def]
        clock[0] += 5.0
        return real_restart()

    monkeypatch.setattr(c.nats, "restart", slow_restart)
    try:
        for t in (0.0, 1.0, 2.0):
            c._bus_last_ok = c._nats_last_ok = c._nats_tried_at = clock[0] = t
            assert c.supervise_once(t) == []
        watched_from, bus_since = c._nats_watch_from, c._bus_ok_since
        c.nats.proc.kill()
        c.nats.proc.wait(10)
        clock[0] = 2.2
        assert c.supervise_once(2.2) == []  # its exit: a restart in 0.1 s
        clock[0] = 2.4
        c._bus_last_ok = 2.4
        assert c.supervise_once(2.4) == ["nats-server"] and clock[0] == 7.4  # the restart took 5 s
        c._bus_last_ok = 7.6
        assert c.supervise_once(7.6) == []  # 0.2 s after the end of the previous pass
        out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
        assert "supervision paused" not in out, out
        assert c._nats_watch_from == watched_from and c._bus_ok_since == bus_since is not None
    finally:
        c.nats.stop()


def _workers(tmp_path, names, **kw) -> LocalCluster:
    spec = dict(restart=True, restart_backoff_s=0.5, stable_s=60.0, liveness_timeout_s=0.0, ready_timeout_s=60.0)
    c = LocalCluster(ClusterSpec(**{**spec, **kw}))
    c.log_dir = tmp_path
    c.children = [_Child(n, ["sleep", "300"], tmp_path / f"{n}.log") for n in names]
    for child in c.children:
        c._spawn(child)
    return c


def _crash_past_the_limit(c: LocalCluster, child: _Child, t: float) -> float:
    """Crash ``child`` (SIGKILL) and restart it until its next exit is past ``max_restarts``; returns the time."""
    for _ in range(c.spec.max_restarts):
        _end(child, -9)
        c.supervise_once(t)
        t = child.restart_at
        assert child.name in c.supervise_once(t)
    _end(child, -9)
    return t


def test_a_crash_looping_worker_is_left_down_while_another_worker_serves_and_tried_again_after_the_window(tmp_path):
    """Before, one worker's crash loop past ``max_restarts`` stopped the whole cluster (every healthy worker's requests
    lost with it); now it is left down (its ``node.down`` already fenced it at the routers), the other workers serve on,
    it is tried again ``restart_window_s`` later, and ``describe()`` names it while its exited pid leaves ``pids()``."""
    c = _workers(tmp_path, ["worker-w0", "worker-w1"], max_restarts=2, restart_window_s=600.0)
    w0, w1 = c.children
    downs: list[str] = []
    c.on_down = downs.append
    try:
        t = _crash_past_the_limit(c, w0, w0.started_at)
        assert c.supervise_once(t) == []  # no ClusterError: left down
        assert w0.left_down and downs == ["worker-w0"] and c.left_down() == ["worker-w0"]
        assert w0.restart_at == pytest.approx(t + 600.0)
        assert "worker-w0" not in c.pids() and "worker-w1" in c.pids()
        assert c.describe()["left_down"] == ["worker-w0"]
        assert c.supervise_once(t + 599.0) == []
        assert c.supervise_once(t + 600.0) == ["worker-w0"]  # tried again: its exits now lie outside the window
        assert not w0.left_down and c.left_down() == [] and "left_down" not in c.describe()
        assert w0.proc is not None and w0.proc.poll() is None and "worker-w0" in c.pids()
    finally:
        for child in c.children:
            _close(child)


def test_the_last_serving_worker_and_any_other_service_still_give_up(tmp_path):
    """Nothing would serve without a worker, nor without the only router: those stop the cluster past ``max_restarts``
    as before, the error saying why (the planner, the directory and a router beside another are left down:
    ``test_supervise_control_plane.py``)."""
    c = _workers(tmp_path, ["worker-w0", "worker-w1", "router"], max_restarts=1, restart_window_s=600.0)
    w0, w1, router = c.children
    try:
        t = _crash_past_the_limit(c, w0, w0.started_at)
        assert c.supervise_once(t) == [] and w0.left_down
        t = _crash_past_the_limit(c, w1, t)
        with pytest.raises(ClusterError, match=r"worker-w1 exited 2 times in 600 s .*giving up \(no other worker process runs") as e:
            c.supervise_once(t)
        assert e.value.service == "worker-w1" and not w1.left_down
    finally:
        for child in c.children:
            _close(child)
    c = _workers(tmp_path, ["worker-w0", "router"], max_restarts=1, restart_window_s=600.0)
    router = c.children[1]
    try:
        t = _crash_past_the_limit(c, router, router.started_at)
        with pytest.raises(ClusterError, match=r"router exited 2 times in 600 s .*giving up \(no other router process runs"):
            c.supervise_once(t)
    finally:
        for child in c.children:
            _close(child)


def test_a_worker_is_not_left_down_while_the_only_other_one_is_dead_in_its_backoff(tmp_path):
    """rr-fencing55 M1: w0 left down, retried after the window, crashed again (dead, waiting for its restart: not left
    down); then w1 past the limit. Before, w0 counted as serving (not left down) and w1 was left down too: no worker
    ran and ``up`` said "the other workers serve on". Now only a running worker process counts: the cluster gives up."""
    c = _workers(tmp_path, ["worker-w0", "worker-w1"], max_restarts=1, restart_window_s=600.0)
    w0, w1 = c.children
    try:
        t = _crash_past_the_limit(c, w0, w0.started_at)
        assert c.supervise_once(t) == [] and w0.left_down
        t += 600.0
        assert c.supervise_once(t) == ["worker-w0"]
        _end(w0, -9)
        c.supervise_once(t + 1.0)  # its restart is due after a backoff
        assert not w0.left_down and w0.restart_at is not None and w0.restart_at > t + 1.0
        t2 = _crash_past_the_limit(c, w1, t + 1.0)
        with pytest.raises(ClusterError, match=r"worker-w1 exited 2 times in 600 s .*giving up"):
            c.supervise_once(t2)
        assert not w1.left_down
    finally:
        for child in c.children:
            _close(child)
