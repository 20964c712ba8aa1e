"""``simulate``, ``fidelity``, ``report compare --out`` and ``report show`` hold their output folder as ``replay`` and
``demo`` do (:func:`~evolving_infra.out_folder.hold_out`): before, none took the lock, so two simulate runs into one
``--out`` wrote over each other's report and records. ``simulate`` also sets an earlier run's outputs aside to
``OUT/previous/`` as ``replay`` does (:func:`~evolving_infra.out_folder.set_aside_previous_run`): before, it replaced
them, and wrote over the user's own ``report.html`` in ``--out .``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from evolving_infra.cli import main
from evolving_infra.out_folder import LOCK, hold_out

SAMPLE = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"


def _simulate(out: Path, *extra: str) -> int:
    return main(["simulate", "--trace", str(SAMPLE), "--duration", "5", "--no-plots", "--out", str(out), *extra])


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(err: str, out: Path, flag: str = "--out ") -> None:
    assert f"error: {flag}{out}: another run (pid {os.getpid()}) is writing to it (it holds {out / LOCK})" in err, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_simulate_into_an_out_another_run_holds_is_refused_and_touches_nothing(tmp_path, capsys):
    out = tmp_path / "o"
    assert _simulate(out) == 0
    capsys.readouterr()
    with hold_out(out):  # another run writing there (the lock is per open file: this process counts as another)
        before = _tree(out)
        assert _simulate(out) == 2
        _refused(capsys.readouterr().err, out)
        assert _tree(out) == before  # the first run's report and records as they were, no previous/
    assert not (out / LOCK).exists()
    assert _simulate(out) == 0  # the lock went with its holder


def test_a_second_simulate_sets_the_first_ones_outputs_aside_as_replay_does(tmp_path, capsys):
    out = tmp_path / "o"
    assert _simulate(out) == 0
    first = {n: (out / n).read_bytes() for n in ("report.json", "requests.jsonl")}
    (out / "notes.txt").write_text("mine\n")
    capsys.readouterr()
    assert _simulate(out, "--seed", "7") == 0
    err = capsys.readouterr().err
    assert f"simulate: the outputs in {out} this run would overwrite moved to {out / 'previous'}/ (report.json, " \
           "requests.jsonl, decisions.jsonl; it keeps only the last run's)" in err, err
    assert {n: (out / "previous" / n).read_bytes() for n in first} == first
    assert json.loads((out / "report.json").read_text())["meta"]["seed"] == 7
    assert (out / "notes.txt").read_text() == "mine\n"  # the user's other files stay
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no lock, no staging folder left


def test_simulate_refuses_a_previous_of_the_users_before_the_run(tmp_path, capsys):
    out = tmp_path / "o"
    assert _simulate(out) == 0
    (out / "previous").mkdir()
    (out / "previous" / "thesis.tex").write_text("mine\n")
    before = _tree(out)
    capsys.readouterr()
    assert _simulate(out) == 2
    err = capsys.readouterr().err
    assert f"error: --out {out}: {out / 'previous'} holds files that are not a run's outputs (thesis.tex)" in err, err
    assert _tree(out) == before


def test_a_simulate_that_fails_after_taking_out_leaves_no_folder(tmp_path, capsys):
    """OUT is made to hold its lock before the run: a run that then fails takes it back when it is left empty (as
    before: 'created when they are written')."""
    out = tmp_path / "a" / "b"
    assert _simulate(out, "--planner-opt", "no_such_option=1") == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_fidelity_into_an_out_another_run_holds_is_refused_before_its_cluster(tmp_path, capsys):
    out = tmp_path / "f"
    with hold_out(out):
        assert main(["fidelity", "--trace", str(SAMPLE), "--sessions", "1", "--out", str(out)]) == 2
        _refused(capsys.readouterr().err, out)
        assert sorted(p.name for p in out.iterdir()) == [LOCK]  # no logs/, live/ nor sim/: nothing started


def test_report_compare_and_show_into_a_held_folder_are_refused(tmp_path, capsys):
    a, b, cmp = tmp_path / "a", tmp_path / "b", tmp_path / "cmp"
    assert _simulate(a) == 0 and _simulate(b, "--seed", "3") == 0
    capsys.readouterr()
    with hold_out(cmp):
        assert main(["report", "compare", str(a), str(b), "--out", str(cmp)]) == 2
        _refused(capsys.readouterr().err, cmp)
        assert sorted(p.name for p in cmp.iterdir()) == [LOCK]
    assert main(["report", "compare", str(a), str(b), "--out", str(cmp)]) == 0
    assert (cmp / "compare.json").is_file() and not (cmp / LOCK).exists()
    capsys.readouterr()
    with hold_out(a):  # a run writing into RUN_DIR: show does not redraw under it
        before = _tree(a)
        assert main(["report", "show", str(a), "--recompute", "--no-plots"]) == 2
        _refused(capsys.readouterr().err, a, flag="")
        assert _tree(a) == before
        assert main(["report", "show", str(a), "--no-plots"]) == 0  # reading alone needs no lock
    assert main(["report", "show", str(a), "--recompute", "--no-plots"]) == 0
    assert not (a / LOCK).exists()


def test_compare_into_a_new_folder_that_fails_leaves_none(tmp_path, capsys):
    out = tmp_path / "new"
    assert main(["report", "compare", str(tmp_path / "nope1"), str(tmp_path / "nope2"), "--out", str(out)]) == 2
    assert "error:" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("command", ["simulate", "fidelity"])
def test_help_names_the_lock(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "OUT/.evolving-infra.lock" in " ".join(capsys.readouterr().out.split())


def test_simulate_holds_its_out_without_importing_the_live_stack(tmp_path):
    """The folder's lock and set-aside live in ``evolving_infra.out_folder``: taken from ``replay.cli``, a simulate
    run imported asyncio, httpx and the replay's modules (~150 more) to hold its ``OUT``."""
    import subprocess
    import sys

    code = ("import sys; from evolving_infra.cli import main; "
            f"rc = main(['simulate', '--trace', {str(SAMPLE)!r}, '--duration', '5', '--no-plots', '--out', {str(tmp_path / 'o')!r}]); "
            "print(rc, ' '.join(m for m in ('asyncio', 'httpx', 'evolving_infra.replay.cli') if m in sys.modules))")
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(root)})
    assert done.stdout.strip().splitlines()[-1] == "0", done.stdout + done.stderr


RUN_FILES = ("report.json", "requests.jsonl", "decisions.jsonl")


def test_a_simulate_that_fails_before_its_outputs_keeps_the_earlier_runs_in_place(tmp_path, capsys):
    """The set-aside comes just before the first output is written: a run that fails before it (a bad component
    option: exit 2, nothing started) left OUT without the earlier run's report and records, and deleted the older
    previous/ (reviewer rr-out)."""
    out = tmp_path / "o"
    assert _simulate(out) == 0 and _simulate(out, "--seed", "7") == 0  # OUT: run 2; previous/: run 1
    before = _tree(out)
    assert "previous/report.json" in before
    capsys.readouterr()
    assert _simulate(out, "--planner-opt", "no_such_option=1") == 2
    err = capsys.readouterr().err
    assert "error:" in err and "moved to" not in err, err
    assert _tree(out) == before


def test_a_simulate_interrupted_before_its_outputs_keeps_the_earlier_runs_in_place(tmp_path, capsys, monkeypatch):
    import evolving_infra.sim.run as sim_run

    out = tmp_path / "o"
    assert _simulate(out) == 0
    before = _tree(out)

    def interrupted(*a, **k):  # Ctrl-C in the loop
        raise KeyboardInterrupt

    monkeypatch.setattr(sim_run, "simulate", interrupted)
    capsys.readouterr()
    assert _simulate(out, "--seed", "7") == 130
    assert "interrupted" in capsys.readouterr().err
    assert _tree(out) == before
    assert not (out / LOCK).exists()


def test_decisions_jsonl_is_set_aside_with_the_report(tmp_path, capsys):
    """simulate always writes decisions.jsonl: a second run overwrote it, and previous/ held the first run's report
    and records without its decisions (reviewer rr-out)."""
    out = tmp_path / "o"
    assert _simulate(out) == 0
    first = {n: (out / n).read_bytes() for n in RUN_FILES}
    capsys.readouterr()
    assert _simulate(out, "--seed", "7") == 0
    assert "(report.json, requests.jsonl, decisions.jsonl; it keeps only the last run's)" in capsys.readouterr().err
    assert {n: (out / "previous" / n).read_bytes() for n in RUN_FILES} == first
    assert json.loads((out / "report.json").read_text())["meta"]["seed"] == 7
    assert (out / "decisions.jsonl").is_file()


def test_a_simulate_into_a_held_out_is_refused_before_its_trace_is_read(tmp_path, capsys):
    """The lock is taken before the input is loaded: a second run stops at once, not after reading its trace (here
    one that cannot be read, whose error came first before; reviewer rr-out)."""
    out, bad = tmp_path / "o", tmp_path / "bad.jsonl"
    bad.write_text("not a trace\n")
    with hold_out(out):
        assert main(["simulate", "--trace", str(bad), "--duration", "5", "--no-plots", "--out", str(out)]) == 2
        _refused(capsys.readouterr().err, out)


def test_a_lock_file_a_killed_report_show_left_in_previous_does_not_refuse_later_runs(tmp_path, capsys):
    """``report show OUT/previous`` holds previous/ itself: killed, it left previous/.evolving-infra.lock, and every
    later run into OUT was refused ('holds files that are not a run's outputs'; reviewer rr-out). The file is a
    run's own now, deleted with the older previous/; while a show holds it, the run stops before it starts."""
    out = tmp_path / "o"
    assert _simulate(out) == 0 and _simulate(out, "--seed", "7") == 0
    (out / "previous" / LOCK).write_text("4242\n")  # what a killed show left (the kernel dropped its lock)
    second = (out / "report.json").read_bytes()
    capsys.readouterr()
    assert _simulate(out, "--seed", "9") == 0, capsys.readouterr().err
    assert (out / "previous" / "report.json").read_bytes() == second
    assert not (out / "previous" / LOCK).exists()
    with hold_out(out / "previous"):  # a show redrawing previous/ now
        before = _tree(out)
        assert _simulate(out, "--seed", "11") == 2
        err = capsys.readouterr().err
        assert f"error: --out {out}: another run (pid {os.getpid()}) is writing to {out / 'previous'} (it holds " \
               f"{out / 'previous' / LOCK}" in err, err
        assert _tree(out) == before


@pytest.mark.parametrize("flags", [[], ["--recompute", "--no-plots"]])
def test_report_show_of_a_folder_it_cannot_write_prints_the_summary(tmp_path, capsys, monkeypatch, flags):
    """A RUN_DIR this user cannot write: its lock cannot be made (PermissionError; the tests run as root, whom
    a chmod does not stop, so the lock's open is what fails here). Before, show stopped at the lock with no summary
    (reviewer rr-out); now the summary, then one line, exit 2 (what was asked to be written was not)."""
    import evolving_infra.out_folder as of

    run = tmp_path / "r"
    assert _simulate(run) == 0
    before = _tree(run)
    capsys.readouterr()

    def denied(out):
        raise PermissionError(13, "Permission denied", str(out / LOCK))

    monkeypatch.setattr(of, "hold_out", denied)
    assert main(["report", "show", str(run), *flags]) == 2
    got = capsys.readouterr()
    assert "requests   sent " in got.out and "TTFT       mean" in got.out, got
    assert f"error: {run}: read-only folder (Permission denied: {run / LOCK}): " in got.err, got.err
    assert "use --no-plots" in got.err and len(got.err.strip().splitlines()) == 1, got.err
    assert _tree(run) == before
    assert main(["report", "show", str(run), "--no-plots"]) == 0  # reading alone: no lock, no error


@pytest.mark.parametrize("errno_", ["ENOSYS", "ENOLCK"])
def test_a_file_system_without_flock_is_refused_in_one_line_leaving_no_lock_file(tmp_path, capsys, monkeypatch, errno_):
    """Lustre mounted ``noflock`` (flock: ENOSYS) or NFS without its lock manager (ENOLCK): ``simulate`` said
    ``error: --out OUT: [Errno 38] Function not implemented`` and left ``OUT/.evolving-infra.lock`` (and so ``OUT``)
    behind. Now one line says the file system gives no flock, and ``OUT`` is as it was (an earlier run's outputs and
    a lock file of another run's untouched); a folder the run made is taken back."""
    import errno
    import fcntl

    out = tmp_path / "o"
    assert _simulate(out) == 0
    capsys.readouterr()
    before = _tree(out)

    def no_flock(fd: int, op: int) -> None:
        raise OSError(getattr(errno, errno_), os.strerror(getattr(errno, errno_)))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert _simulate(out) == 2
    err = capsys.readouterr().err
    assert f"error: --out {out}: cannot lock {out / LOCK} ({os.strerror(getattr(errno, errno_))}): this file system " \
           "gives no flock" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _tree(out) == before and not (out / LOCK).exists()
    assert _simulate(tmp_path / "new") == 2
    assert not (tmp_path / "new").exists()  # made for the run, taken back
    (out / LOCK).write_text("4242\n")  # another run's file: not removed
    assert _simulate(out) == 2
    assert (out / LOCK).read_text() == "4242\n"
