"""The Slurm job wrote a new ``$RUN/api-key-id.salt`` at each start (``rm -f`` then a new one): a later job on the
same ``EI_RUN_DIR`` made the key ids of the earlier job's router log lines unmappable. It now follows ``up``'s rule
(``evolving_infra.launcher.key_id_salt_main``): a valid file is kept, an invalid one put aside with a warning, none
made when absent. The job's own lines for it run here with ``bash`` (the whole job: test_slurm_supervision.py)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "evolving-infra.sbatch"


def _salt_lines() -> str:
    """The sbatch's lines that settle KEY_ID_SALT (from its assignment to the ``fi`` closing its ``if``)."""
    lines = SBATCH.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("KEY_ID_SALT="))
    end = next(i for i in range(start, len(lines)) if lines[i] == "fi")
    return "\n".join(lines[start:end + 1])


def _job(run: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = ("stopping_traps() { :; }\nlog() { echo \"LOG: $*\"; }\nstop_all() { exit \"$1\"; }\n"
              + _salt_lines() + '\necho "SALT=$KEY_ID_SALT"\n')
    base = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")}
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=base | {"PY": sys.executable, "RUN": str(run), "PYTHONPATH": str(REPO)} | env)


def _salt(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-1].removeprefix("SALT=")


def test_a_later_job_on_the_same_run_dir_keeps_the_salt(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    salt_file = run / "api-key-id.salt"
    first = _salt(_job(run))
    assert len(first) == 32 and salt_file.read_text() == first + "\n"
    assert stat.S_IMODE(salt_file.stat().st_mode) == 0o600
    again = _job(run)
    assert _salt(again) == first  # before: a new salt at each job
    assert f"API key ids: the salt in {salt_file} is kept" in again.stderr
    salt_file.chmod(0o644)
    third = _job(run)
    assert _salt(third) != first and salt_file.read_text() == _salt(third) + "\n"
    assert (run / "api-key-id.salt.invalid").read_text() == first + "\n"
    assert f"warning: {salt_file} is open to others (mode 644, not 600): not used" in third.stderr
    assert _salt(_job(run, EI_API_KEY_ID_SALT="given")) == "given"  # the job's environment's, no file touched
    assert salt_file.read_text() == _salt(third) + "\n"


def test_a_salt_that_cannot_be_written_fails_the_job(tmp_path):
    run = tmp_path / "missing" / "run"  # no such folder: the file cannot be made
    done = _job(run)
    assert done.returncode == 1 and f"LOG: FAILED: cannot write {run}/api-key-id.salt" in done.stdout, done.stdout + done.stderr
