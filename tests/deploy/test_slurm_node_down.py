"""Under the Slurm job a worker's exit is announced on ``node.down.<node>`` by its ``supervise`` loop
(``deploy/slurm/evolving-infra.sbatch``, ``python -m evolving_infra.nodedown`` with the job's launcher credentials), as
``evolving-infra up`` announces it: the router fences the node at once, not after ``--fence-after-s`` of silence.

The job script runs here as in ``test_slurm_supervision`` (real services, real nats-server with per-service nkeys;
``scontrol`` and ``srun`` stand-ins).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.deploy.test_slurm_supervision import Job, service_pid


def fences(router_log: str, node: str) -> list[dict]:
    """The router's "node fenced out" lines for ``node`` (its JSON log), in order."""
    out = []
    for line in router_log.splitlines():
        if line.startswith("{") and "node fenced out" in line:
            e = json.loads(line)
            if e.get("node") == node:
                out.append(e)
    return out


@pytest.mark.timeout(300)
def test_a_killed_worker_is_announced_and_its_node_fenced_at_once(tmp_path):
    """w1 SIGKILLed: its supervise loop prints that it published node.down, and the router's first fence of w1 has cause
    ``exited`` (node.down), seconds after the kill, with ``FENCE_AFTER_S`` 60 (no fence for silence within the test).
    Before, nothing published node.down under Slurm: the first fence of w1 came from its restarted process's first
    state (cause ``restarted``), or after 60 s of silence had it not come back."""
    job = Job(tmp_path, FENCE_AFTER_S="60")
    try:
        job.wait_for("READY", 150)
        pid = service_pid(job.run, "services.worker", "--node w1 ")
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        job.wait_for("worker-w1 exited (status 137)", 20)
        deadline = time.monotonic() + 30
        while not fences((job.run / "router.log").read_text(errors="replace"), "w1"):
            assert time.monotonic() < deadline, f"w1 not fenced:\n{job.text()}"
            time.sleep(0.2)
        took = time.monotonic() - t0
        first = fences((job.run / "router.log").read_text(errors="replace"), "w1")[0]
        assert first["cause"] == "exited", (first, job.text())
        assert f"published that worker-w1 (pid {pid}) exited (node.down): a router fences it now if the pid is the one the node reports" in job.text(), job.text()
        assert took < 20, took
        assert job.proc.poll() is None and "FAILED" not in job.text()
    finally:
        job.close()
