"""The Slurm job's Prometheus file_sd list in the flat folder (``runs/prometheus-targets/slurm-<jobid>.json``,
``deploy/slurm/evolving-infra.sbatch``) does not outlive its job.

Before, the job removed it last in its stop, after up to three ``STOP_GRACE`` waits (the liveness watch, the router's
drain, the other services, nats-server); Slurm SIGKILLs the batch script ``KillWait`` (30 s) after its SIGTERM, so
the file stayed, and Prometheus scraped the finished job's dead ports for good (``EIServiceDown`` paging). And a file
left so by a job before this change, or by a job SIGKILLed outright, was never removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.deploy.test_slurm_supervision import Job

# a squeue that lists this job (4242) and another running one (5555); any other id is unknown, as Slurm's own
# answers once a job has left its memory ("Invalid job id specified", status 1)
SQUEUE = """#!/bin/sh
id=""
while [ $# -gt 0 ]; do case $1 in -j) id=$2; shift 2 ;; *) shift ;; esac; done
[ -n "$SQUEUE_FAIL" ] && [ "$id" != 4242 ] && { echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1; }
[ -z "$id" ] && { printf '4242\n 5555\n'; exit 0; }
case $id in
  4242|5555) echo RUNNING ;;
  *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;
esac
"""


def _stub_squeue(tmp_path: Path) -> Path:
    """A folder holding :data:`SQUEUE` as an executable ``squeue``, to put first on ``PATH``."""
    sq = tmp_path / "sq"
    sq.mkdir()
    (sq / "squeue").write_text(SQUEUE)
    (sq / "squeue").chmod(0o755)
    return sq


def test_a_failed_squeue_removes_no_targets_file(tmp_path):
    """rr-late55 M2: the start-up cleanup asked squeue once per file and read any empty answer as "finished", so one
    squeue timing out (a busy controller, a failover; here every query but this job's own) removed a running job's
    file (Prometheus then stopped scraping it for good). Now one listing of every job; a failed one removes nothing.
    The script's own function, run by bash."""
    script = (Path(__file__).parents[2] / "deploy/slurm/evolving-infra.sbatch").read_text()
    start = script.index("drop_finished_jobs_targets() {")
    func = script[start : script.index("\n}\n", start) + 3]
    flat = tmp_path / "flat"
    flat.mkdir()
    for name in ("slurm-1111.json", "slurm-5555.json", "slurm-4242.json"):
        (flat / name).write_text("[]\n")
    sq = _stub_squeue(tmp_path)
    env = {**os.environ, "PATH": f"{sq}:{os.environ['PATH']}", "TARGETS_DIR": str(flat), "SLURM_JOB_ID": "4242"}
    run = ["bash", "-c", 'log() { echo "$*"; }\n' + func + "drop_finished_jobs_targets"]
    failed = subprocess.run(run, env={**env, "SQUEUE_FAIL": "1"}, capture_output=True, text=True, timeout=30)
    assert failed.returncode == 0 and sorted(p.name for p in flat.iterdir()) == [
        "slurm-1111.json", "slurm-4242.json", "slurm-5555.json"], failed
    ok = subprocess.run(run, env=env, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and sorted(p.name for p in flat.iterdir()) == ["slurm-4242.json", "slurm-5555.json"], ok
    assert "removed" in ok.stdout and "job 1111" in ok.stdout, ok


@pytest.mark.timeout(240)
def test_a_finished_job_s_targets_file_is_removed_at_the_next_start_and_a_stop_removes_its_own_first(tmp_path):
    """At start: ``slurm-1111.json`` (a job squeue no longer lists) is removed, ``slurm-5555.json`` (running) kept, as
    is a run outside Slurm's ``slurm-0-<pid>.json``. At the stop: SIGTERM, then the script SIGKILLed the moment it
    says "stopping" (as Slurm's KillWait would, mid-drain): the job's own file is gone already."""
    flat = tmp_path / "prometheus-targets"
    flat.mkdir()
    for name in ("slurm-1111.json", "slurm-5555.json", "slurm-0-77.json"):
        (flat / name).write_text('[{"targets": ["10.9.9.9:9102"], "labels": {"service": "router"}}]\n')
    sq = _stub_squeue(tmp_path)
    job = Job(tmp_path, PATH=f"{tmp_path / 'bin'}:{sq}:{os.environ['PATH']}", PROMETHEUS_TARGETS_DIR=str(flat))
    try:
        job.wait_for("READY", 150)
        assert sorted(p.name for p in flat.iterdir()) == ["slurm-0-77.json", "slurm-4242.json", "slurm-5555.json"], (
            list(flat.iterdir()), job.text())
        assert f"removed {flat}/slurm-1111.json: job 1111 is no longer in squeue" in job.text(), job.text()
        os.kill(job.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "stopping (SIGTERM" not in job.text():
            assert time.monotonic() < deadline and job.proc.poll() is None, job.text()
            time.sleep(0.005)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.proc.pid, signal.SIGKILL)  # KillWait ran out: the rest of the stop never runs
        job.proc.wait(10)
        assert "] stopped\n" not in job.text(), job.text()  # killed mid-stop indeed
        assert sorted(p.name for p in flat.iterdir()) == ["slurm-0-77.json", "slurm-5555.json"], list(flat.iterdir())
    finally:
        job.close()


def test_outside_slurm_each_run_has_its_own_targets_file_name():
    """Without ``SLURM_JOB_ID`` every run wrote ``slurm-0.json``: two such runs sharing the folder kept one list, and
    the first to stop removed the other's. Now the script's pid makes the name unique (``slurm-0-<pid>.json``)."""
    sbatch = (Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "evolving-infra.sbatch").read_text()
    assert "TARGETS_FILE=$TARGETS_DIR/slurm-${SLURM_JOB_ID:-0-$$}.json" in sbatch
