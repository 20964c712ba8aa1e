"""A run SIGKILLed during its set-aside (:func:`~evolving_infra.out_folder.set_aside_previous_run`) left
``OUT/.previous.tmp-<pid>-<n>`` (the outputs it had moved out of ``OUT``: their only copy) and/or
``OUT/.previous.old-<pid>-<n>`` (the older ``previous/`` it was replacing), and nothing ever cleaned them: the next
run's set-aside went on beside them, so the killed run's outputs stayed hidden in a dot-folder, or ``previous/`` was
gone. Now the next holder of ``OUT`` (:func:`~evolving_infra.out_folder.hold_out`) puts them back first
(:func:`~evolving_infra.out_folder.recover_set_aside`): every one of them, whatever its pid (a set-aside runs only
under ``OUT``'s lock, so whatever is there with the lock held was abandoned)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from evolving_infra.out_folder import PREVIOUS, hold_out, recover_set_aside, set_aside_previous_run

ROOT = Path(__file__).resolve().parents[3]
NAMES = ("report.json", "requests.jsonl", "report.html", "ttft_cdf.png")

# Set aside OUT's outputs, SIGKILLed just before the K-th os.rename/os.unlink of it (renames: each name into the
# staging folder, then previous/ into the old one, then staging -> previous/; then the older one's unlinks).
KILLED_AT = """
import os, signal, sys
from pathlib import Path
from evolving_infra.out_folder import hold_out, set_aside_previous_run
out, k, calls = Path(sys.argv[1]), int(sys.argv[2]), [0]
def step(real):
    def at(*a, **kw):
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)
    return at
with hold_out(out):
    os.rename, os.unlink = step(os.rename), step(os.unlink)
    set_aside_previous_run(out)
print("ended", calls[0])
"""


def _run(out: Path, tag: str) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    for n in NAMES:
        (out / n).write_text(f"{tag} {n}\n")
    return {n: f"{tag} {n}\n" for n in NAMES}


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}


def _killed_set_aside(out: Path, k: int) -> int:
    done = subprocess.run([sys.executable, "-c", KILLED_AT, str(out), str(k)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=os.environ | {"PYTHONPATH": str(ROOT)})
    return done.returncode


@pytest.mark.parametrize(("older", "k"), [(True, k) for k in range(1, 11)] + [(False, k) for k in range(1, 6)])
def test_the_next_run_puts_back_what_a_killed_set_aside_left(tmp_path, capsys, older, k):
    """Killed before each of its steps: 4 moves into the staging folder, then (older) previous/ into the old one,
    the staging folder to previous/, and (older) the 4 deletions of the older generation."""
    out = tmp_path / "o"
    if older:
        _run(out / PREVIOUS, "run1")
    run2 = _run(out, "run2")
    assert _killed_set_aside(out, k) == -signal.SIGKILL
    last = 6 if older else 5  # the set-aside's own steps (after them: the deletion of the older previous/)
    leftovers = sorted(p.name for p in out.iterdir() if p.name.startswith(".previous."))
    assert leftovers, k  # what this test is about: the kill left a staging or old folder
    held = any(any(p.iterdir()) for p in out.iterdir() if p.name.startswith(".previous."))
    with hold_out(out):  # the next run
        moved = set_aside_previous_run(out)
    err = capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [], (k, err)  # nothing left over
    # run 2's outputs, which the killed run was setting aside, are in previous/: none lost, none left hidden
    assert _files(out / PREVIOUS) == run2, (k, err)
    # put back before the set-aside, they moved as the killed one's would have; killed once previous/ was in place,
    # only its older one's deletion was left to do
    assert sorted(moved) == (sorted(NAMES) if k <= last else []), (k, moved, err)
    assert (f"note: --out {out}: a run (pid " in err) == held, err  # said when it held something (not an empty one)


@pytest.mark.parametrize("whose", ["this process", "a live process", "pid 1"])
def test_a_leftover_whose_pid_is_alive_here_is_recovered_too(tmp_path, capsys, whose):
    """A set-aside runs only under OUT's lock: whatever is left with the lock held is abandoned, whatever its pid
    is now here. Before (af867e8) a leftover whose pid looked alive was skipped silently, for ever: in a container
    every run is pid 1 (this process's own pid here), a pid is reused, or the run was on another host sharing OUT
    (reviewer rr-out)."""
    out = tmp_path / "o"
    _run(out, "run3")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid = {"this process": os.getpid(), "a live process": alive.pid, "pid 1": 1}[whose]
        staged = out / f".previous.tmp-{pid}-0"
        staged.mkdir()
        (staged / "report.json").write_text("run2\n")
        with hold_out(out):
            said = recover_set_aside(out)  # hold_out's own pass has put it back already: nothing left
        err = capsys.readouterr().err
        assert said == [] and not staged.exists(), err
        assert _files(out / PREVIOUS) == {"report.json": "run2\n"}, err  # OUT had report.json again: it became previous/
        assert f"note: --out {out}: a run (pid {pid}) that ended while setting its outputs aside had moved " in err, err
    finally:
        alive.kill()
        alive.wait(10)


def test_a_leftover_that_is_not_a_folder_is_said_not_skipped_silently(tmp_path, capsys):
    out = tmp_path / "o"
    _run(out, "run2")
    odd = out / ".previous.tmp-4242-0"
    odd.write_text("mine\n")
    with hold_out(out):
        pass
    err = capsys.readouterr().err
    assert f"warning: --out {out}: {odd} is named as a set-aside's folder but is not a folder: left in place" in err, err
    assert odd.read_text() == "mine\n"


def test_a_dead_runs_staged_files_clashing_with_outs_become_previous_when_there_is_none(tmp_path, capsys):
    """A run of a version without this step ran since the kill and wrote those names again: the staged ones are
    not put over them; with no previous/ they become it, else they stay, said in a warning."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    out = tmp_path / "o"
    _run(out, "run3")
    staged = out / f".previous.tmp-{dead.pid}-0"
    staged.mkdir()
    (staged / "report.json").write_text("run2\n")
    with hold_out(out):
        pass
    assert _files(out / PREVIOUS) == {"report.json": "run2\n"} and not staged.exists()
    assert (out / "report.json").read_text() == "run3 report.json\n"
    staged.mkdir()
    (staged / "report.json").write_text("run2b\n")
    with hold_out(out):
        pass
    err = capsys.readouterr().err
    assert f"warning: --out {out}: {staged} (a run (pid {dead.pid}) that ended while setting its outputs aside) " \
           "holds report.json, and" in err, err
    assert _files(staged) == {"report.json": "run2b\n"}
