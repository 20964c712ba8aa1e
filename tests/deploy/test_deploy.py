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
import re
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


def _run(script: str, timeout_s: float) -> str:
    """Run ``script`` (from the repository's root) and return its output; it must exit 0."""
    env = dict(os.environ, PY=sys.executable, EI=str(Path(sys.executable).with_name("evolving-infra")))
    proc = subprocess.run([str(REPO / script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"{script} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def _naming(text: str) -> dict[int, str]:
    """Running processes whose command line contains ``text``: pid -> command line."""
    out = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(d.name) != os.getpid():
            out[int(d.name)] = cmd
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_compose_stack_replays_claude_code_sessions_and_down_leaves_nothing():
    _need("dockerd", "docker-compose", "debootstrap", "curl")
    _run("deploy/docker/compose-smoke.sh", 1400)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_slurm_job_over_three_nodes_serves_a_replay_and_scancel_stops_it():
    """Also: the script runs a munged of its own (its socket in the run's folder, slurm.conf's ``AuthInfo``) and
    stops it with Slurm's daemons. Before, it started the system's munged when none ran and left it running after
    every run (a later run, another cluster's test, found it and never stopped it either)."""
    _need("slurmctld", "slurmd", "sbatch", "munged", "curl")
    out = _run("deploy/slurm/smoke.sh", 800)
    m = re.search(r"munged \(socket (/\S+)/munge/munge\.socket\)", out)
    assert m, out[-3000:]
    assert _naming(m.group(1)) == {}, _naming(m.group(1))  # its munged (--socket=<run>/munge/...) and slurm* gone
