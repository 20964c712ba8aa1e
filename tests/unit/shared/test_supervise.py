"""The supervisor of ``LocalCluster`` on real child processes (``sleep``), without NATS:
an exited service is restarted after its backoff, counted, and a crash loop gives up; the stop's signals."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from evolving_infra.cluster import ClusterError, ClusterSpec, LocalCluster, ServiceStopped, _Child, restart_delay


def test_restart_delay_doubles_up_to_the_cap():
    assert [restart_delay(k, 0.5, 4.0) for k in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def _cluster(tmp_path, **kw) -> LocalCluster:
    c = LocalCluster(ClusterSpec(restart=True, restart_backoff_s=0.5, stable_s=60.0, **kw))
    c.log_dir = tmp_path
    c.children = [_Child("svc", ["sleep", "30"], tmp_path / "svc.log")]
    c._spawn(c.children[0])
    return c


def _kill(child: _Child) -> None:
    assert child.proc is not None
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait()


def test_exited_service_is_restarted_after_its_backoff_and_counted(tmp_path):
    c = _cluster(tmp_path)
    child = c.children[0]
    first = child.proc.pid
    try:
        assert c.supervise_once() == []  # running: nothing to do
        _kill(child)
        t = time.monotonic()
        assert c.supervise_once(t) == []  # exit noticed, restart scheduled after 0.5 s
        assert child.restart_at == pytest.approx(t + 0.5)
        assert c.supervise_once(t + 0.4) == []
        assert c.supervise_once(t + 0.6) == ["svc"]
        assert child.proc.pid != first and child.proc.poll() is None
        assert c.restarts() == {"svc": 1}
        c.check_alive()  # supervised: a restarted service is not a failure
        _kill(child)  # second crash without a stable run: backoff doubles
        t = time.monotonic()
        c.supervise_once(t)
        assert child.restart_at == pytest.approx(t + 1.0)
        assert c.supervise_once(t + 1.1) == ["svc"]
        # a stable run resets the streak
        assert c.supervise_once(time.monotonic() + 61.0) == [] and child.streak == 0
    finally:
        child.proc.kill()
        child.proc.wait()
        child.log_file.close()


def test_a_clean_exit_is_restarted_at_once_and_a_second_one_backs_off(tmp_path):
    """A service that exited 0 (its SIGTERM stop: a rolling restart of the router, after its drain) is started again in
    the pass that saw it gone; before, it waited the crash backoff (0.5 s) and the next pass, a quarter of the router's
    restart gap under SIGTERM (bench/RESULTS.md, router-term). A second clean exit before a stable run waits one step
    behind a crash (0.5 s, not 1 s), so a service exiting 0 in a loop still gives up; a crash's first restart still
    waits 0.5 s."""
    c = _cluster(tmp_path)
    child = c.children[0]
    child.argv = [sys.executable, "-c", "import time; time.sleep(0.2)"]  # runs a moment, then exits 0
    c._spawn(child)
    try:
        first = child.proc.pid
        assert child.proc.wait(timeout=20) == 0
        t = time.monotonic()
        assert c.supervise_once(t) == ["svc"]  # exit noticed and restarted in one pass
        assert child.proc.pid != first and c.restarts() == {"svc": 1}
        assert child.proc.wait(timeout=20) == 0  # exits 0 again, before a stable run
        t = time.monotonic()
        assert c.supervise_once(t) == []
        assert child.restart_at == pytest.approx(t + 0.5)
        assert c.supervise_once(t + 0.6) == ["svc"]
        child.argv = ["sleep", "30"]
        child.streak = 0
        c._spawn(child)
        _kill(child)  # a crash: its backoff as before
        t = time.monotonic()
        assert c.supervise_once(t) == [] and child.restart_at == pytest.approx(t + 0.5)
    finally:
        child.proc.kill()
        child.proc.wait()
        child.log_file.close()


def test_crash_loop_gives_up_after_max_restarts(tmp_path):
    c = _cluster(tmp_path, max_restarts=2)
    child = c.children[0]
    try:
        t = time.monotonic()
        for _ in range(2):
            _kill(child)
            c.supervise_once(t)
            t += 100.0  # past any backoff but the run was not "stable" (started_at is real time)
            child.started_at = t
            assert c.supervise_once(t) == ["svc"]
        _kill(child)
        with pytest.raises(ClusterError, match=r"svc exited 3 times in 600 s \(last: killed by signal 9 \(SIGKILL\)\); giving up") as e:
            c.supervise_once(t)
        # the service and a short reason, for the demo's partial report (no log tail in it)
        assert (e.value.service, e.value.reason) == ("svc", "svc exited 3 times in 600 s (last: killed by signal 9 (SIGKILL); restarts gave up)")
    finally:
        child.proc.kill()
        child.proc.wait()
        child.log_file.close()


def test_without_supervision_an_exit_fails_the_cluster(tmp_path):
    c = _cluster(tmp_path)
    child = c.children[0]
    try:
        c.check_alive()
        _kill(child)
        with pytest.raises(ClusterError, match=r"svc was killed by signal 9 \(SIGKILL\); log ") as e:
            c.check_alive()  # no supervisor task running (start() was not called): fail fast
        assert (e.value.service, e.value.reason) == ("svc", "svc was killed by signal 9 (SIGKILL)")
    finally:
        child.log_file.close()


def test_without_supervision_a_clean_exit_ends_the_cluster_as_no_failure(tmp_path):
    """A service that exited 0 (stopped as asked: a SIGTERM sent to it, after its drain) ends an unsupervised
    cluster with ``ServiceStopped`` (``up --no-restart`` says so and exits 0); one exiting non-zero is a failure."""
    for argv, code in ((["true"], 0), (["false"], 1)):
        c = LocalCluster(ClusterSpec(restart=False))
        c.log_dir = tmp_path
        c.children = [_Child("svc", argv, tmp_path / "svc.log")]
        child = c.children[0]
        c._spawn(child)
        try:
            assert child.proc.wait(10) == code
            with pytest.raises(ClusterError) as e:
                c.check_alive()
            if code == 0:
                assert isinstance(e.value, ServiceStopped)
                assert str(e.value) == f"svc exited cleanly (code 0); log {child.log_path}"
                assert (e.value.service, e.value.reason) == ("svc", "svc exited cleanly (code 0)")
            else:
                assert not isinstance(e.value, ServiceStopped)
                assert str(e.value).startswith(f"svc exited with code 1; log {child.log_path}:")
                assert (e.value.service, e.value.reason) == ("svc", "svc exited with code 1")
        finally:
            child.log_file.close()


def test_the_exit_error_quotes_whole_log_lines(tmp_path):
    """``up --no-restart``'s "router exited with code 0; log ...:" quoted the log's last 1,500 characters, cut
    mid-line (the newcomer walk: its first line was 'imestamp": "2026-12-06T01:46:41.964618Z"}'). It starts at the
    first whole line of that tail now; a longer last line is quoted cut, as before."""
    c = _cluster(tmp_path)
    child = c.children[0]
    try:
        _kill(child)
        child.proc.wait()
        lines = [f'{{"event": "line {i}", "timestamp": "2026-12-06T01:46:{i % 60:02d}.000000Z"}}' for i in range(100)]
        child.log_path.write_text("\n".join(lines) + "\n")
        with pytest.raises(ClusterError) as e:
            c.check_alive()
        quoted = str(e.value).split(":\n", 1)[1]
        assert quoted.endswith(lines[-1] + "\n") and 1000 < len(quoted) <= 1500
        assert quoted.split("\n")[0] in lines  # a whole line, not the end of one
        child.log_path.write_text("x" * 4000)  # one line longer than the tail: its end, cut
        with pytest.raises(ClusterError) as e:
            c.check_alive()
        assert str(e.value).split(":\n", 1)[1] == "x" * 1500
    finally:
        child.log_file.close()


def test_a_failing_restart_callback_does_not_end_supervision(tmp_path):
    """``up``'s on_restart rewrites cluster.json and prints a line: a full disk or a closed stdout
    (``up | head``) raised out of the supervisor task, and the cluster failed ('supervisor crashed')."""
    import asyncio

    c = _cluster(tmp_path, restart_backoff_max_s=0.1)
    child = c.children[0]
    calls: list[str] = []

    def on_restart(name: str) -> None:
        calls.append(name)
        raise BrokenPipeError(32, "Broken pipe")

    c.on_restart = on_restart

    async def run() -> None:
        c._supervisor = asyncio.create_task(c._supervise(interval_s=0.02))
        for _ in range(2):
            _kill(child)
            deadline = time.monotonic() + 5
            while child.proc.poll() is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        c.check_alive()  # raised: supervisor crashed: BrokenPipeError
        c._supervisor.cancel()

    try:
        asyncio.run(run())
        assert calls == ["svc", "svc"] and child.restarts == 2
    finally:
        child.proc.kill()
        child.proc.wait()
        child.log_file.close()


_SIGNAL_RECORDER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def got(sig, _frame):
    out.write_text(signal.Signals(sig).name)
    sys.exit(0)
signal.signal(signal.SIGINT, got)
signal.signal(signal.SIGTERM, got)
out.with_suffix(".ready").write_text("")
time.sleep(30)
"""


async def test_stop_gives_the_router_sigint_its_quick_stop(tmp_path):
    """``up``'s stop (Ctrl-C) sends the router SIGINT, which skips its ``--shutdown-grace-s`` drain (20 s, past the
    stop's 10-s wait: a router with streams open would be SIGKILLed); the other services SIGTERM."""
    c = LocalCluster(ClusterSpec())
    c.log_dir = tmp_path
    c.children = [_Child(name, [sys.executable, "-c", _SIGNAL_RECORDER, str(tmp_path / f"{name}.sig")], tmp_path / f"{name}.log")
                  for name in ("planner", "router")]
    for child in c.children:
        c._spawn(child)
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"{name}.ready").exists() for name in ("planner", "router")):
        assert time.monotonic() < deadline, "the recorders did not start"
        time.sleep(0.02)
    await c.stop(timeout_s=10.0)
    assert (tmp_path / "router.sig").read_text() == "SIGINT"
    assert (tmp_path / "planner.sig").read_text() == "SIGTERM"


def _unsupervised(tmp_path, *programs: tuple[str, list[str]]) -> LocalCluster:
    """A ``--no-restart`` cluster of these (name, argv) processes, started and all exited."""
    c = LocalCluster(ClusterSpec(restart=False))
    c.log_dir = tmp_path
    c.children = [_Child(name, argv, tmp_path / f"{name}.log") for name, argv in programs]
    for child in c.children:
        c._spawn(child)
    for child in c.children:
        assert child.proc is not None
        child.proc.wait(20)
    return c


def test_without_supervision_a_clean_exit_in_the_same_poll_does_not_hide_a_crash(tmp_path):
    """check_alive reported the first dead service in the list: a worker's exit 0 seen in the same 0.2-s poll as the
    router's exit 3 read as a clean stop (ServiceStopped; up exited as for one). Every exit counts now: any crash is
    the failure, named with its log's tail and the others; only when all exited 0 is it ServiceStopped."""
    c = _unsupervised(tmp_path, ("worker-w0", ["true"]), ("router", ["sh", "-c", "echo boom; exit 3"]))
    try:
        with pytest.raises(ClusterError) as e:
            c.check_alive()
        assert not isinstance(e.value, ServiceStopped)
        assert str(e.value) == (f"router exited with code 3 (also exited: worker-w0 code 0); "
                                f"log {tmp_path / 'router.log'}:\nboom\n")
    finally:
        for child in c.children:
            child.log_file.close()
    (tmp_path / "clean").mkdir()
    c = _unsupervised(tmp_path / "clean", ("a", ["true"]), ("b", ["true"]))  # all clean: a stop, naming both
    try:
        with pytest.raises(ServiceStopped, match=r"^a exited cleanly \(code 0\) \(also exited cleanly: b\); log "):
            c.check_alive()
    finally:
        for child in c.children:
            child.log_file.close()


def test_without_supervision_a_dead_embedded_nats_server_fails_the_cluster(tmp_path):
    """``up --no-restart`` says the cluster stops when nats-server exits, but nothing watched it: SIGKILLed, the
    cluster ran on (every service alive, reconnecting forever) and wait_failed never returned. check_alive fails on
    it now, as on a dead service (a real nats-server)."""
    from shared.natsserver import EmbeddedNatsServer

    c = _unsupervised(tmp_path)
    c.children = [_Child("svc", ["sleep", "30"], tmp_path / "svc.log")]
    c._spawn(c.children[0])
    c.nats = EmbeddedNatsServer(jetstream=False).start()
    try:
        c.check_alive()  # all running
        assert c.nats.proc is not None
        os.kill(c.nats.proc.pid, signal.SIGKILL)
        c.nats.proc.wait(20)
        with pytest.raises(ClusterError) as e:
            c.check_alive()
        assert not isinstance(e.value, ServiceStopped)
        assert str(e.value).startswith("nats-server was killed by signal 9 (SIGKILL); without supervision (--no-restart) nothing restarts it")
    finally:
        c.nats.stop()
        c.children[0].proc.kill()
        c.children[0].proc.wait()
        c.children[0].log_file.close()


def test_a_clean_exit_during_the_start_up_is_a_failed_start_with_the_logs_tail(tmp_path, monkeypatch):
    """A service exiting 0 before the cluster was ready said "error: router exited cleanly (code 0); log ..." (a
    stop's wording, no log tail) and up exited 1. start() words it as the failed start it is, with the log's tail,
    as for a crash; what it started is stopped."""
    import asyncio

    c = LocalCluster(ClusterSpec(restart=False))
    c.log_dir = tmp_path
    child = _Child("router", ["sh", "-c", "echo cannot load the tokenizer; exit 0"], tmp_path / "router.log")

    async def start_up() -> None:  # what _start does to the point of its readiness wait: spawn, then check
        c.children = [child]
        c._spawn(child)
        assert child.proc is not None
        while child.proc.poll() is None:
            await asyncio.sleep(0.02)
        c.check_alive()

    monkeypatch.setattr(c, "_start", start_up)
    try:
        with pytest.raises(ClusterError) as e:
            asyncio.run(c.start())
        assert not isinstance(e.value, ServiceStopped)
        assert str(e.value) == (f"start-up failed: router exited with code 0 before the cluster was ready; "
                                f"log {child.log_path}:\ncannot load the tokenizer\n")
    finally:
        if child.log_file is not None:
            child.log_file.close()


def test_exit_text_says_a_signal_for_a_negative_code():
    """A child's ``returncode`` -9 read "exited with code -9" (newcomer walk): a negative code is the signal that
    ended it."""
    from shared.natsserver import exit_text

    assert exit_text(-9) == "was killed by signal 9 (SIGKILL)" and exit_text(-15) == "was killed by signal 15 (SIGTERM)"
    assert exit_text(1) == "exited with code 1" and exit_text(0) == "exited with code 0" and exit_text(None) == "exited"
    assert exit_text(-200) == "was killed by signal 200"  # no name on this platform


def test_a_nats_server_killed_during_start_up_says_the_signal(tmp_path, monkeypatch):
    """A nats-server ended by a signal before it listened read "nats-server exited with -9": the same "was killed
    by signal 9 (SIGKILL)" as any other child (:func:`shared.natsserver.exit_text`, which ``evolving_infra`` uses)."""
    from shared import natsserver

    fake = tmp_path / "nats-server"
    fake.write_text("#!/bin/sh\nkill -9 $$\n")
    fake.chmod(0o755)
    monkeypatch.setattr(natsserver, "find_nats_server", lambda: str(fake))
    with pytest.raises(natsserver.NatsServerError) as e:
        natsserver.EmbeddedNatsServer(jetstream=False, startup_timeout_s=5.0).start()
    assert str(e.value).startswith("nats-server was killed by signal 9 (SIGKILL)"), e.value
