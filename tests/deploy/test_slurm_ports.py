"""Two Slurm jobs whose heads land on one node each get ports of their own; a port the user gives that is
taken stops the job at once, saying which (``deploy/slurm/evolving-infra.sbatch``, ``job_ports``).

Before, every job took NATS 4222, router 8000 and metrics 9100..9102 on its head. Measured with two jobs
started 2 s apart on the test harness's one node (the same fixed ports, ``EI_NATS_AUTH=off``): the second
job's nats-server could not bind ("address already in use") and was restarted, while the job's readiness
check, its JetStream stream and its services reached the first job's server through the port it found
answering ("JetStream stream EI_p0 on nats://127.0.0.1:14222", the first job's); its workers w0, w1 would
join the first job's cluster under the same node ids until NATS gave up (MAX_RESTARTS=10: 2.5 min).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests.deploy.test_slurm_supervision import Job, job_pids

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "evolving-infra.sbatch"


def _ports(job_id: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The script's own ``job_ports`` (with ``log`` and ``taken_ports``) run as a job ``job_id`` of two workers
    would run it; prints NATS_PORT ROUTER_PORT METRICS_PORT."""
    text = SBATCH.read_text()
    funcs = [re.search(rf"^{name}\(\) \{{.*?^\}}\n", text, re.S | re.M) for name in ("log", "taken_ports", "job_ports")]
    assert all(funcs), "the sbatch lacks log(), taken_ports() or job_ports()"
    script = "".join(f.group(0) for f in funcs) + 'job_ports || exit; echo "$NATS_PORT $ROUTER_PORT $METRICS_PORT"\n'
    base = {"PATH": os.environ["PATH"], "PY": "python3", "NWORKERS": "2", "SLURM_JOB_ID": job_id,
            "NATS_PORT": "", "ROUTER_PORT": "", "METRICS_PORT": ""}
    return subprocess.run(["bash", "-c", script], env={**base, **env}, capture_output=True, text=True, timeout=30)


def _head_ports(nats: int, router: int, metrics: int) -> set[int]:
    return {nats, router, metrics, metrics + 1, metrics + 2}


def test_two_job_ids_get_disjoint_ports_and_a_taken_block_moves_to_the_next():
    a, b = _ports("101"), _ports("102")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, a.stdout, b.stdout)
    pa, pb = (tuple(map(int, r.stdout.split())) for r in (a, b))
    assert pa == (20100, 20101, 20102), pa  # 10000 + 100 * (101 mod 220): NATS, router, metrics
    assert not _head_ports(*pa) & _head_ports(*pb), (pa, pb)
    # job 321 has job 101's block (321 mod 220 = 101): while job 101's router holds 20101 on this node, the next
    held = socket.socket()
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("0.0.0.0", 20101))
        held.listen()
        c = _ports("321")
    finally:
        held.close()
    assert c.returncode == 0, c.stdout + c.stderr
    assert tuple(map(int, c.stdout.split()[-3:])) == (20200, 20201, 20202), c.stdout
    assert "ports 20100.. are in use" in c.stdout and "this job's block is 20200.." in c.stdout, c.stdout
    # ports given win (only the unset ones come from the block); NATS_URL: no NATS port of this job's own
    d = _ports("101", ROUTER_PORT="18123")
    assert d.returncode == 0 and d.stdout.split() == ["20100", "18123", "20102"], d.stdout + d.stderr
    e = _ports("101", METRICS_PORT="x")
    assert e.returncode == 2 and "METRICS_PORT=x: a TCP port, 1-65535" in e.stdout, e.stdout
    f = _ports("101", ROUTER_PORT="20000", METRICS_PORT="19999")
    assert f.returncode == 2 and "port 20000 twice" in f.stdout, f.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("var, offset, said", [
    ("ROUTER_PORT", 0, "ROUTER_PORT={p} (router): port {p} is in use"),
    ("NATS_PORT", 0, "NATS_PORT={p} (nats-server): port {p} is in use"),  # another job's server: was joined
    ("METRICS_PORT", 1, "METRICS_PORT={m} (planner, +1): port {p} is in use"),
])
def test_a_given_port_that_is_taken_stops_the_job_before_anything_starts(tmp_path, var, offset, said):
    """Before, a taken ROUTER_PORT restarted the router until MAX_RESTARTS ran out (~2.5 min at the default 10;
    here 1, so the job ended rc 1 with 'router exited ... giving up', the reason only in router.log); a taken
    NATS_PORT was another server's, joined; a taken metrics port failed that service the same way."""
    with socket.socket() as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen()
        p = blocker.getsockname()[1]
        value = p - offset
        job = Job(tmp_path, MAX_RESTARTS="1", **{var: str(value)})
        try:
            rc = job.proc.wait(45)
            text = job.text()
            assert rc == 2, text
            assert said.format(p=p, m=value) in text and "leave " + var + " unset" in text, text
            assert "READY" not in text and "nats-server nats://" not in text, text
            assert job_pids(job.run) == {}, job_pids(job.run)
        finally:
            job.close()

