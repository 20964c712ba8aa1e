"""Under real Slurm, ``scancel --batch --signal=TERM <jobid>`` drains ``deploy/slurm/evolving-infra.sbatch``: a request
in flight finishes (200, every token), and only then do the workers, the other services and nats-server stop; the job
then ends with every process it started gone. Plain ``scancel <jobid>`` cannot drain (Slurm sends SIGTERM to every
process of the job at once: nats-server, the services, and the worker step's ``srun``, which turns it into a SIGKILL of
every worker), and the job's output says so and names the command that drains.

Before, the script's stop sent SIGTERM to the router, the other services and the worker step's ``srun`` together:
``srun`` SIGKILLed the workers at once ("srun: error: n2: task 0: Killed"), so the router's drain waited its whole
grace for requests that could no longer finish and failed them (503 "router shutting down" after 20 s).

Slurm is Debian's slurmctld + three slurmd (``n1..n3`` on localhost), set up as ``deploy/slurm/smoke.sh`` sets it
up, with ``KillWait=30`` (Slurm's default). Needs root and the Slurm and munge packages; skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.test_slurm_supervision import job_pids, stopped_before_nats

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "evolving-infra.sbatch"
MAX_TOKENS = 3000  # at SPEEDUP=1 (gb300-glm52) the request runs ~6 s: in flight when the job is told to stop, done well
# within the router's 20-s grace


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _slurm(env: dict[str, str], *args: str) -> str:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=30, check=True).stdout


@contextlib.contextmanager
def _cluster(tmp: Path) -> Iterator[dict[str, str]]:
    """slurmctld and slurmd n1..n3 on this machine (deploy/slurm/smoke.sh's configuration) and a munged of their own
    (its socket in a folder of this cluster's, slurm.conf's ``AuthInfo``); yields the environment whose SLURM_CONF
    names it. Everything started is stopped on exit, munged last. Before, the system's munged was started when none
    ran and left running."""
    if os.geteuid() != 0:
        pytest.skip("needs root (starts slurmctld / slurmd)")
    missing = [c for c in ("slurmctld", "slurmd", "sbatch", "scancel", "squeue", "munged") if shutil.which(c) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian packages; .ci/run installs them)")
    d = tmp / "slurm"
    (d / "state").mkdir(parents=True)
    (d / "spool").mkdir()
    ctld, p1, p2, p3 = _free_ports(4)
    # munged runs as the munge user, which cannot reach into pytest's 0700 folders: its own folder under /tmp
    md = Path(tempfile.mkdtemp(prefix="ei-munge."))
    md.chmod(0o755)
    (md / "munge").mkdir(mode=0o711)
    shutil.chown(md / "munge", "munge", "munge")
    (md / "munge").chmod(0o711)  # executable by all: munged refuses a socket folder that is not
    sock = md / "munge" / "munge.socket"
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=eiscancel
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SlurmdParameters=config_overrides
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ReturnToService=2
KillWait=30
MpiDefault=none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={p1} CPUs=8 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={p2} CPUs=8 State=UNKNOWN
NodeName=n3 NodeHostname=localhost NodeAddr=127.0.0.1 Port={p3} CPUs=8 State=UNKNOWN
PartitionName=ei Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    munged_pid = md / "munge" / "munged.pid"
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={sock}", f"--pid-file={munged_pid}",
                    f"--log-file={md}/munge/munged.log", f"--seed-file={md}/munge/munged.seed"], check=True, timeout=30)
    try:
        subprocess.run(["slurmctld", "-i"], env=env, check=True, timeout=30)
        for n in ("n1", "n2", "n3"):
            subprocess.run(["slurmd", "-N", n], env=env, check=True, timeout=30)
        deadline = time.monotonic() + 60
        while _slurm(env, "sinfo", "-h", "-o", "%T", "-p", "ei").split() != ["idle"]:
            assert time.monotonic() < deadline, _slurm(env, "sinfo", "-p", "ei")
            time.sleep(0.3)
        yield env
    finally:
        # a job still there (a test that failed) first: shut down under it, its slurmstepds stayed, orphaned
        subprocess.run(["scancel", "--partition=ei"], env=env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 45  # KillWait (30 s) and a margin
        while time.monotonic() < deadline and subprocess.run(
            ["squeue", "-h", "-p", "ei"], env=env, capture_output=True, text=True, timeout=30
        ).stdout.strip():
            time.sleep(0.5)
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True, timeout=30)
        time.sleep(1)
        for pidfile in d.glob("*.pid"):
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
        # what is left of this cluster (a slurmstepd, a job's process: all have its SLURM_CONF), as smoke.sh's cleanup
        mark = f"SLURM_CONF={conf}".encode()
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                if proc.name.isdigit() and mark in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
        with contextlib.suppress(ValueError, OSError):  # its munged, once nothing of the cluster uses it
            pid = int(munged_pid.read_text())
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.1)
        shutil.rmtree(md, ignore_errors=True)


def _submit(env: dict[str, str], tmp: Path, name: str) -> tuple[str, Path, Path, int]:
    """sbatch --nodes=3 of the script (static 1P1D, sim engine at speed-up 1); (job id, output file, run folder,
    router port) once its output says READY."""
    run = tmp / name
    router_port, nats_port = _free_ports(2)
    job_env = dict(
        env, EI_HOME=str(REPO), EI_PYTHON=sys.executable, EI_RUN_DIR=str(run), ROUTER_PORT=str(router_port),
        NATS_PORT=str(nats_port), POLICY="static:1P1D", SPEEDUP="1", PYTHONPATH=str(REPO), TZ="UTC",
    )
    out = tmp / f"{name}.out"
    job = _slurm(job_env, "sbatch", "--parsable", "--nodes=3", f"--output={out}", str(SBATCH)).strip()
    deadline = time.monotonic() + 120
    while "READY" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, f"job {job} not ready:\n{out.read_text() if out.exists() else ''}"
        assert _slurm(env, "squeue", "-h", "-j", job).strip(), f"job {job} ended:\n{out.read_text() if out.exists() else ''}"
        time.sleep(0.5)
    return job, out, run, router_port


def _gone(env: dict[str, str], job: str, run: Path, timeout_s: float) -> float:
    """Seconds until the job has left the queue and none of its processes is left (asserted within ``timeout_s``)."""
    t0 = time.monotonic()
    while _slurm(env, "squeue", "-h", "-j", job).strip() or job_pids(run):
        assert time.monotonic() - t0 < timeout_s, (_slurm(env, "squeue", "-h", "-j", job), job_pids(run))
        time.sleep(0.25)
    return time.monotonic() - t0


def _post(url: str, body: dict, timeout_s: float) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.mark.timeout(420)
def test_scancel_batch_term_drains_a_request_in_flight_and_plain_scancel_says_it_cannot(tmp_path):
    with _cluster(tmp_path) as env:
        job, out, run, port = _submit(env, tmp_path, "drain")
        try:
            got: list[tuple[int, dict | str]] = []
            req = threading.Thread(target=lambda: got.append(_post(
                f"http://127.0.0.1:{port}/v1/completions", {"prompt": "hello there", "max_tokens": MAX_TOKENS}, 120)))
            t0 = time.monotonic()
            req.start()
            time.sleep(2.0)  # in flight: its prefill on w0 done, its decode running on w1
            assert not got, f"the request ended before the stop: raise MAX_TOKENS ({str(got)[:300]})"
            _slurm(env, "scancel", "--batch", "--signal=TERM", job)
            signalled = time.monotonic() - t0
            req.join(120)
            print(f"request done {time.monotonic() - t0:.1f} s after it was sent, the stop {signalled:.1f} s after")
            (status, body), = got
            assert status == 200, (status, str(body)[:300], out.read_text())
            assert isinstance(body, dict) and body["usage"]["completion_tokens"] == MAX_TOKENS, str(body)[:300]
            took = _gone(env, job, run, 90)
            text = out.read_text()
            assert "JobState=COMPLETED" in _slurm(env, "scontrol", "show", "job", job), text
            assert "stopping (SIGTERM: the router drains" in text and "stopped" in text, text
            assert "Killed" not in text, text  # the workers got SIGTERM through Slurm, not srun's SIGKILL
            router_log = (run / "router.log").read_text()
            assert '"router draining"' in router_log and '"router drained"' in router_log and '"all done"' in router_log, router_log[-3000:]
            # each service, the workers included, logged its clean stop before nats-server got its SIGTERM
            before = stopped_before_nats(run)
            assert set(before) >= {"router.log", "planner.log", "kvdirectory.log", "worker-w0.log", "worker-w1.log"}, before
            assert all(s >= 0 for s in before.values()), before
            print(f"drain: request {MAX_TOKENS} tokens done, job gone {took:.1f} s after its end; before nats {before}")
        finally:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)

        # plain scancel: Slurm signals every process at once; the job says so, names the drain, and leaves nothing
        job, out, run, port = _submit(env, tmp_path, "plain")
        try:
            _slurm(env, "scancel", job)
            took = _gone(env, job, run, 60)
            text = out.read_text()
            print(text)
            assert "JobState=CANCELLED" in _slurm(env, "scontrol", "show", "job", job), text
            assert f"to drain them first: scancel --batch --signal=TERM {job}" in text, text
            # no traceback: before, a signal of the burst landing while the liveness watch's loop closed printed
            # "Exception ignored when trying to write to the signal wakeup fd ... OSError: [Errno 9]" here
            assert "Exception ignored" not in text and "Traceback" not in text, text
            print(f"plain scancel: job gone in {took:.1f} s")
        finally:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
