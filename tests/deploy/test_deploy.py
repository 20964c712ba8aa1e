"""Deployments started for real on this machine (issue 20): docker compose and a Slurm job.

Each test runs the repository's own smoke script and fails if it does:

* ``deploy/docker/compose-smoke.sh``: a private ``dockerd`` (Debian's docker.io) builds the
  image from ``deploy/docker/Dockerfile`` on a debootstrapped Debian base (no registry), brings
  ``docker-compose.yml`` up with two scaled workers, replays real Claude Code sessions against
  the published router port (all must complete), then ``down`` must leave no container;
* ``deploy/slurm/smoke.sh``: Debian's slurmctld + three slurmd (``n1..n3`` on localhost),
  ``sbatch --nodes=3 deploy/slurm/evolving-infra.sbatch``, a replay through the job's router,
  then ``scancel`` must stop every process of the job.

They need root and the Debian packages ``.ci/run`` installs; without them they skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _need(*commands: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (starts dockerd / slurmd)")
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian packages; .ci/run installs them)")


def _run(script: str, timeout_s: float) -> None:
    env = dict(os.environ, PY=sys.executable, EI=str(Path(sys.executable).with_name("evolving-infra")))
    proc = subprocess.run([str(REPO / script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"{script} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_compose_stack_replays_claude_code_sessions_and_down_leaves_nothing():
    _need("dockerd", "docker-compose", "debootstrap", "curl")
    _run("deploy/docker/compose-smoke.sh", 1400)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_slurm_job_over_three_nodes_serves_a_replay_and_scancel_stops_it():
    _need("slurmctld", "slurmd", "sbatch", "munged", "curl")
    _run("deploy/slurm/smoke.sh", 800)
