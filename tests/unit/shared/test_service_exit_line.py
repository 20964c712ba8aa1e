"""The router, planner and KV directory processes end on ``ServiceFailed`` (a task they need ended; the
traceback is already in their log) with exit status 1 and one line on stderr naming the task, as the
worker does. Before, the router, planner and directory let it escape ``run_service``: a raw Python
traceback on stderr (the exit status, 1, was right). ``shared.service.run_service`` (which each ``main`` runs
through ``run_service_main``) is replaced by one that raises what ``serve_until_stopped`` raises."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from shared.service import ServiceFailed


@pytest.mark.parametrize(("service", "argv"), [
    ("router", ["--model", "m1"]),
    ("planner", []),
    ("kvdirectory", []),
    ("worker", ["--node", "w0", "--profile", "tiny"]),
])  # fmt: skip
def test_a_failed_service_exits_1_with_one_line_naming_the_task(service: str, argv: list[str], monkeypatch, capsys) -> None:
    mod = importlib.import_module(f"services.{service}.__main__")
    label = "worker worker-w0" if service == "worker" else service  # the process, named once (process_label)
    why = f"{label}: task {service}-loop failed: RuntimeError('injected')"

    def failing(*_a: Any, **_k: Any) -> None:
        try:
            raise RuntimeError("injected")
        except RuntimeError as e:
            raise ServiceFailed(why) from e

    monkeypatch.setattr("shared.service.run_service", failing)
    monkeypatch.setattr(mod, "setup_logging", lambda *a, **k: None)  # no process-wide logging set up in the test run
    assert mod.main(argv) == 1
    out = capsys.readouterr()
    assert out.err == f"{why}\n" and out.out == ""


@pytest.mark.parametrize("service", ["planner", "kvdirectory"])
def test_a_bad_configuration_is_one_line_and_exit_2(service: str, monkeypatch, capsys) -> None:
    mod = importlib.import_module(f"services.{service}.__main__")
    monkeypatch.setattr("shared.service.run_service", lambda *a, **k: pytest.fail("must not run"))
    assert mod.main(["--speedup", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{service}: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(("argv", "code", "why"), [
    (["--nats-url", "nats://h1:4222,,nats://h2:4222"], 2, "an empty server in the list"),
    (["--nats-url", ""], 2, "an empty server in the list"),
    (["--nats-creds", "/nonexistent/kvdirectory.nk"], 2, "cannot read NATS credentials"),
    (["--nats-url", "nats://127.0.0.1:9"], 1, "refused the credentials in the URL"),  # Bus.connect replaced below
])  # fmt: skip
def test_unusable_nats_settings_are_one_line_not_a_traceback(argv: list[str], code: int, why: str, monkeypatch, capsys) -> None:
    """An unusable NATS setting (AuthError: EI_NATS_URL with an empty server, an unreadable credentials file)
    or credentials the server refuses (BusError from Bus.connect) ended the service in a Python traceback;
    now one line on stderr naming the problem, exit 2 (the settings) or 1 (the refusal)."""
    from shared.bus import Bus, BusError

    async def refused(*_a: Any, **_k: Any) -> Any:
        raise BusError("NATS at nats://127.0.0.1:9 refused the credentials in the URL (Authorization Violation)")

    if code == 1:
        monkeypatch.setattr(Bus, "connect", refused)
    mod = importlib.import_module("services.kvdirectory.__main__")
    monkeypatch.setattr(mod, "setup_logging", lambda *a, **k: None)
    assert mod.main(argv) == code
    err = capsys.readouterr().err
    # the last line is the one for the user; before it may stand the service's own log line of the
    # refusal (stderr once another test in this process has run setup_logging), never a traceback
    last = err.splitlines()[-1]
    assert last.startswith("kvdirectory: ") and why in last and "Traceback" not in err, err
    assert sum(line.startswith("kvdirectory: ") for line in err.splitlines()) == 1, err


def _kvdirectory(*argv: str, pass_fds: tuple[int, ...] = ()) -> Any:
    """``python -m services.kvdirectory`` with ``argv`` (NATS unreachable: what is tested fails before the connect)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "services.kvdirectory", "--nats-url", "nats://127.0.0.1:1", "--nodes", "w0", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, pass_fds=pass_fds)


def test_a_bad_metrics_fd_is_a_configuration_error_naming_the_service_once():
    """A ``--metrics-fd`` that is no listening socket exited 1 (a runtime failure, as a crash) with the name doubled
    ("kvdirectory: kvdirectory kvdirectory: [Errno 88] --metrics-fd 9 is not an open socket: ..."), while the
    router's bad ``--listen-fd`` exits 2. Now the same: one line naming the service once, exit 2, before NATS."""
    import socket

    done = _kvdirectory("--metrics-fd", "987")  # not open in the child (close_fds)
    assert done.returncode == 2, done
    assert done.stderr == "kvdirectory: --metrics-fd 987 is not an open socket: Bad file descriptor\n", done.stderr
    with socket.socket() as bound:  # bound, not listening
        bound.bind(("127.0.0.1", 0))
        fd = bound.fileno()
        done = _kvdirectory("--metrics-fd", str(fd), "--instance", "dir-a", pass_fds=(fd,))
    assert done.returncode == 2, done
    assert done.stderr == f"kvdirectory dir-a: --metrics-fd {fd} is not a listening TCP socket\n", done.stderr


def test_a_metrics_port_in_use_is_one_line_naming_the_service_once_and_exit_1():
    """The runtime failure (the port taken: exit 1, the supervisor's restart may find it free) said the name three
    times and the errno ("kvdirectory: kvdirectory kvdirectory: [Errno 98] cannot listen ..."); one line now."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _kvdirectory("--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    assert done.returncode == 1, done
    last = done.stderr.splitlines()[-1]
    assert last == f"kvdirectory: cannot listen for metrics on 127.0.0.1:{port}: Address already in use", done.stderr
    assert "kvdirectory kvdirectory" not in done.stderr and "Errno" not in last and "Traceback" not in done.stderr


def test_a_service_run_in_process_leaves_the_callers_stop_signals_as_they_were(monkeypatch, capsys) -> None:
    """A service's ``main([...])`` run in this process (its run ended by an unusable NATS setting, after the loop
    started) must not leave SIGINT / SIGTERM ignored here: a test process that ignored them passed it on to every
    child it started later (a ``trace generate`` then ran through its Ctrl-C with status 0, a router ignored the
    stop's SIGTERM until killed: 7 CI failures). Only the service's own process (``main()``, no argv) ignores them
    once it stops (``shared.service.run_service``)."""
    import signal

    mod = importlib.import_module("services.kvdirectory.__main__")
    monkeypatch.setattr(mod, "setup_logging", lambda *a, **k: None)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        assert mod.main(["--nats-url", "nats://h1:4222,,nats://h2:4222"]) == 2
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    capsys.readouterr()
