"""``bench/faults.py``'s fourth-walk additions without a cluster: the ``up`` command line a run starts (``--policy``,
``--engine torch``), the order of the planner-kill-during-a-switch injector (``switch-planner-kill``: kill at the
first ``split set``'s return, the next ones only once the restarted planner answers), ``_in_split``'s order, and
``--engine torch`` refused before anything starts when torch is missing."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import signal
from pathlib import Path

import pytest

from tests.conftest import bench_faults

faults = bench_faults()


def test_up_argv_adds_policy_and_the_torch_engine_only_when_asked(tmp_path):
    plain = faults.up_argv(tmp_path, speedup=50.0, nodes=4, split="2P2D")
    assert "--policy" not in plain and "--engine" not in plain
    assert plain[plain.index("--split") + 1] == "2P2D" and plain[plain.index("--speedup") + 1] == "50.0"
    argv = faults.up_argv(tmp_path, speedup=50.0, nodes=4, split="2P2D", model_dir=tmp_path / "model", policy="static:2P2D")
    assert argv[argv.index("--policy") + 1] == "static:2P2D"
    assert argv[argv.index("--engine") + 1] == "torch" and argv[argv.index("--model") + 1] == str(tmp_path / "model")
    assert argv[argv.index("--device") + 1] == "cpu"


class _Run:
    """What the injectors use of a ``FaultRun``: a planner whose pid changes a few polls after its SIGKILL (``up``
    restarting it) and a ``split`` CLI that answers no responders until the restarted planner is up."""

    def __init__(self, *, restart_after_polls: int, answers_after_gets: int) -> None:
        self.log: list[str] = []
        self.notes: dict[str, object] = {}
        self.signalled: dict[str, int] = {}
        self.t_fault: float | None = None
        self.recover_s: float | None = None
        self.now = 0.0
        self._pid = 100
        self._polls_left = restart_after_polls
        self._gets_left = answers_after_gets
        self.killed = False

    def pid(self, service: str) -> int:
        if self.killed and self._pid == 100:
            self._polls_left -= 1
            if self._polls_left <= 0:
                self._pid = 200
                self.log.append(f"{service} restarted")
        return self._pid

    def kill(self, service: str, sig: int = signal.SIGKILL) -> int:
        self.log.append(f"kill {service}")
        self.killed = True
        self.t_fault = 1.0
        self.signalled[service] = self._pid
        return self._pid

    async def split_cli(self, run: object, *argv: str) -> tuple[int, str]:
        assert run is self
        self.now += 1.0  # each split CLI takes a wall second
        if self.killed and self._pid == 200 and argv[0] == "get" and self._gets_left > 0:
            self._gets_left -= 1
            self.log.append("get: no responders")
            return 2, ""
        if self.killed and self._pid == 100:
            raise AssertionError(f"split {' '.join(argv)} sent before the planner was restarted")
        self.log.append(" ".join(argv))
        return 0, "epoch 9: 2P2D" if argv[0] == "get" else ""


def test_switch_planner_kill_kills_at_the_first_set_and_sets_again_only_once_the_new_planner_answers(monkeypatch):
    run = _Run(restart_after_polls=3, answers_after_gets=2)
    monkeypatch.setattr(faults, "_split_cli", run.split_cli)
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    victim = asyncio.run(faults._switch_then_kill("1P3D", ("3P1D", "2P2D"))(run))
    assert victim == "planner"
    assert run.log == ["set 1P3D", "kill planner", "planner restarted", "get: no responders", "get: no responders", "get",
                       "set 3P1D", "set 2P2D", "get"]  # fmt: skip
    assert run.notes["split_exit"] == [0, 0, 0] and run.notes["split_after"] == "epoch 9: 2P2D"
    assert run.notes["split_errors"] == []  # the gets while the new planner was not up are not errors of the walk
    assert run.signalled == {"planner": 100} and run.t_fault == 1.0  # recovery timed from the kill


def test_switch_planner_kill_recovery_is_the_first_answered_get_not_the_injector_run(monkeypatch):
    run = _Run(restart_after_polls=3, answers_after_gets=2)
    monkeypatch.setattr(faults, "_split_cli", run.split_cli)
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    monkeypatch.setattr(faults.time, "monotonic", lambda: run.now)
    asyncio.run(faults._switch_then_kill("1P3D", ("3P1D", "2P2D"))(run))
    # set 1P3D ends at 1 s, kill at t_fault 1.0, two unanswered gets, the third answered at 4 s; the two sets and
    # the last get after it (to 7 s) are not recovery
    assert run.recover_s == 3.0 and run.notes["planner_answer_s"] == 3.0 and run.now == 7.0
    never = _Run(restart_after_polls=1, answers_after_gets=10_000)
    monkeypatch.setattr(faults, "_split_cli", never.split_cli)
    monkeypatch.setattr(faults.time, "monotonic", lambda: never.now)
    asyncio.run(faults._switch_then_kill("1P3D", ())(never))
    assert never.recover_s is None and "planner_answer_s" not in never.notes  # no answer in 30 s: not recovered


def test_in_split_sets_the_split_before_the_fault(monkeypatch):
    run = _Run(restart_after_polls=1, answers_after_gets=0)
    monkeypatch.setattr(faults, "_split_cli", run.split_cli)
    order: list[str] = []

    async def fault(r: object) -> str:
        order.extend(run.log)
        return "worker-w3"

    assert asyncio.run(faults._in_split("3P1D", fault, settle_s=0.0)(run)) == "worker-w3"
    assert order == ["set 3P1D"] and run.notes["split_exit"] == [0]


_REAL_SLEEP = asyncio.sleep


async def _no_sleep(_s: float) -> None:
    """``asyncio.sleep`` without the wait (the injectors' pauses and polls), still a yield to the loop."""
    await _REAL_SLEEP(0)


def test_engine_torch_without_torch_is_refused_before_up_starts(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    monkeypatch.setattr(faults, "run_fault", _must_not_run)
    with pytest.raises(SystemExit) as e:
        faults.main(["--engine", "torch", "--fault", "decode-worker-kill", "--no-results"])
    assert e.value.code == 2
    assert "--engine torch needs the torch extra (torch missing)" in capsys.readouterr().err


def test_results_section_names_the_policy_and_the_torch_engine():
    args = argparse.Namespace(nodes=4, split="2P2D", speedup=50.0, sessions=8, concurrency=8, max_requests_per_branch=8,
                              max_pause=2.0, fault_at=3.0, policy="static:2P2D", engine="torch", max_output=128)  # fmt: skip
    head = faults._results_section([], args)
    assert "`evolving-infra up --nodes 4 --split 2P2D --speedup 50 --policy static:2P2D --engine torch`" in head
    assert "at most 128 output tokens" in head
    plain = faults._results_section([], argparse.Namespace(**{**vars(args), "policy": None, "engine": "sim"}))
    assert "`evolving-infra up --nodes 4 --split 2P2D --speedup 50`, the shipped" in plain


async def _must_not_run(*_a: object, **_k: object) -> None:
    raise AssertionError("a run started")


def test_every_fault_is_listed(capsys):
    assert faults.main(["--list"]) == 0
    listed = capsys.readouterr().out.split()
    for name in ("decode-worker-stop-long", "switch-planner-kill", "lone-decode-stop-long", "lone-prefill-kill",
                 "planner-stop-long", "router-stop", "router-stop-long", "directory-stop-long", "switch-worker-kill",
                 "nats-kill-twice", "nats-store-lost-twice"):
        assert name in listed and name in faults.FAULTS
    assert Path(faults.__file__).name == "faults.py"


class _Restarting:
    """A ``FaultRun`` whose cluster.json names each of ``pids`` in turn for ``polls`` reads of ``service``'s pid (the
    first: the process the first fault kills; then ``up``'s restarts); ``alive`` are the pids ``os.kill`` may reach."""

    def __init__(self, pids: list[int], polls: int, alive: set[int]) -> None:
        self.notes: dict[str, object] = {}
        self.signalled: dict[str, int] = {}
        self.t_fault: float | None = None
        self._pids, self._polls, self._reads = pids, polls, 0
        self.alive = alive
        self.sent: list[int] = []

    def pid(self, service: str) -> int:
        pid = self._pids[min(self._reads // self._polls, len(self._pids) - 1)]
        self._reads += 1
        return pid

    def kill(self, service: str, sig: int = signal.SIGKILL) -> int:
        pid = self.pid(service)
        self.t_fault = 1.0
        self.signalled[service] = pid
        self._os_kill(pid, sig)
        return pid

    def _os_kill(self, pid: int, sig: int) -> None:
        self.sent.append(pid)
        if pid not in self.alive:
            raise ProcessLookupError(pid)
        self.alive.discard(pid)


def _kill_first(run: _Restarting) -> object:
    async def first(r: object) -> str:
        run.kill("nats-server")
        return "nats-server"

    return first


def test_then_kills_the_restarted_process_not_the_reaped_one(monkeypatch):
    # cluster.json still names the killed pid 100 for a while (up not restarted yet), then 200: the second SIGKILL
    # must wait for 200 (before: os.kill(100) -> ProcessLookupError out of run_fault, or a reused pid killed)
    run = _Restarting([100, 200], polls=4, alive={100, 200})
    monkeypatch.setattr(faults.os, "kill", run._os_kill)
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    clock = iter(range(10, 10_000))
    monkeypatch.setattr(faults.time, "monotonic", lambda: float(next(clock)) * 0.001)
    victim = asyncio.run(faults._then(_kill_first(run), "nats-server", 0.6)(run))
    assert victim == "nats-server" and run.sent == [100, 200]
    assert run.signalled == {"nats-server": 200}  # recovery: a pid other than the second one
    assert run.t_fault is not None and run.t_fault != 1.0  # timed from the second kill, not the first's (1.0)
    assert run.notes["second_kill_s"] == round(run.t_fault - 1.0, 3)


def test_then_waits_again_when_the_restarted_process_is_gone_and_gives_up_bounded(monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    clock = iter(range(10, 100_000))
    monkeypatch.setattr(faults.time, "monotonic", lambda: float(next(clock)) * 0.01)
    run = _Restarting([100, 200, 300], polls=3, alive={100, 300})  # 200 exited on its own before the signal
    monkeypatch.setattr(faults.os, "kill", run._os_kill)
    assert asyncio.run(faults._then(_kill_first(run), "nats-server", 0.6)(run)) == "nats-server"
    assert run.sent == [100, 200, 300] and run.signalled == {"nats-server": 300}
    stuck = _Restarting([100], polls=1, alive={100})  # up never restarts it: no signal to pid 100 again, no hang
    monkeypatch.setattr(faults.os, "kill", stuck._os_kill)
    assert asyncio.run(faults._then(_kill_first(stuck), "nats-server", 0.6, new_pid_wait_s=2.0)(stuck)) == "nats-server"
    assert stuck.sent == [100] and stuck.notes["second_kill"] == "no new pid" and stuck.t_fault == 1.0


def test_stop_long_faults_run_without_ups_liveness_watch_and_thaw_tolerates_a_process_gone(tmp_path):
    """``up``'s liveness watch (default 30 s) SIGKILLed the six ``*-stop-long`` faults' 40-s frozen process, and the
    SIGCONT's ProcessLookupError ended ``python bench/faults.py`` (every fault). Those faults measure a freeze the
    other services must outlive: ``up`` runs them with the watch off; a thaw of a process gone is counted, not raised."""
    import subprocess

    long = [n for n in faults.FAULTS if n.endswith("-stop-long")]
    assert len(long) == 6 and all(faults.UP_LIVENESS_S[n] == 0.0 for n in long)
    for name in long:
        argv = faults.up_argv(tmp_path, speedup=50.0, nodes=4, split="2P2D", liveness_timeout_s=faults.UP_LIVENESS_S[name])
        assert argv[argv.index("--liveness-timeout-s") + 1] == "0.0"
    assert "--liveness-timeout-s" not in faults.up_argv(tmp_path, speedup=50.0, nodes=4, split="2P2D")
    assert faults.UP_LIVENESS_S["router-stop-watched"] == 10.0 and "router-stop-watched" in faults.LOSSY
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    run = faults.FaultRun(proc=gone, info={}, log_dir=tmp_path)  # type: ignore[arg-type]
    run._stopped_at["router"] = 0.0
    run.thaw("router", gone.pid)
    assert run.notes["thaw_gone"] == 1 and run.frozen_s["router"] > 0


def test_stop_watched_returns_the_victim_once_up_restarted_it(monkeypatch):
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    run = _Restarting([41, 42], polls=3, alive={41, 42})
    run.frozen, run.frozen_s, run._stopped_at = set(), {}, {}  # type: ignore[attr-defined]
    run.kill = lambda service, sig: faults.FaultRun.kill(run, service, sig)  # type: ignore[attr-defined]
    run.thaw = lambda service, pid: faults.FaultRun.thaw(run, service, pid)  # type: ignore[attr-defined]
    assert asyncio.run(faults.FAULTS["router-stop-watched"](run)) == "router"  # type: ignore[arg-type]
    assert sent == [(41, signal.SIGSTOP), (41, signal.SIGCONT)] and isinstance(run.notes["watch_kill_s"], float)
