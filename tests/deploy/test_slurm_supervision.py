"""``deploy/slurm/evolving-infra.sbatch`` restarts a service or worker that dies and fails the job
visibly when one keeps dying; before, a dead router, directory, NATS server or worker stayed dead
and the job ran on (still RUNNING, READY printed, every request failing), and a router that never
became healthy left the job waiting for its workers forever.

The script itself runs here with ``bash`` and the real services (sim engine, real nats-server);
only Slurm's two commands are stand-ins on ``PATH``: ``scontrol`` names three nodes at 127.0.0.1,
``srun`` starts the worker step's tasks on this machine with ``SLURM_PROCID`` 0..n-1 and, with
``--kill-on-bad-exit=1``, ends the step when a task exits non-zero (Slurm's documented
behaviour). ``deploy/slurm/smoke.sh`` (tests/deploy/test_deploy.py) runs it under real Slurm.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "evolving-infra.sbatch"

SCONTROL = """#!/bin/sh
# scontrol stand-in: three nodes n1..n3, all at 127.0.0.1
case "$1 $2" in
  "show hostnames") printf 'n1\\nn2\\nn3\\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"; echo "   NodeAddr=127.0.0.1 NodeHostName=localhost" ;;
  *) echo "scontrol stand-in: $*" >&2; exit 1 ;;
esac
"""

SRUN = """#!{python}
# srun stand-in: the command after the options, once per task on this machine (SLURM_PROCID 0..n-1);
# --kill-on-bad-exit=1: a task that exits non-zero ends the others and the step exits with its status;
# SIGINT (with --disable-status, as the job runs it) and SIGTERM forwarded to every task. Python, not bash: started
# in the background by a shell, it inherits SIGINT ignored, which a bash script cannot trap (real srun resets it)
import os, signal, subprocess, sys
args, n, kob = sys.argv[1:], 1, 0
while args and args[0].startswith("--"):
    opt = args.pop(0)
    if opt.startswith("--ntasks="):
        n = int(opt.split("=", 1)[1])
    elif opt.startswith("--kill-on-bad-exit="):
        kob = int(opt.split("=", 1)[1])
tasks: list = []
stop = False


def forward(sig, _frame=None):
    global stop
    stop = True
    for t in tasks:
        if t.poll() is None:
            t.send_signal(sig)


signal.signal(signal.SIGINT, forward)
signal.signal(signal.SIGTERM, forward)
# after the handlers: a task started before would inherit SIGINT ignored (a handler is reset to the default at exec)
tasks += [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(i))) for i in range(n)]
rc = 0
while any(t.returncode is None for t in tasks):
    pid, status = os.wait()
    for t in tasks:
        if t.pid == pid:
            t.returncode = os.waitstatus_to_exitcode(status)
            # any status above 0, as Slurm's --kill-on-bad-exit: 137 too (a SIGKILLed worker's loop giving up exits
            # with its status); before, < 128 here, and such a give-up left the step running (Slurm ends it)
            if not stop and t.returncode > 0 and kob == 1:
                rc = t.returncode
                forward(signal.SIGTERM)
sys.exit(rc)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_pids(run: Path) -> dict[int, str]:
    """pid → command line of every live process started for the job (they inherit ``EI_RUN_DIR``)."""
    out: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"EI_RUN_DIR={run}".encode() not in (d / "environ").read_bytes().split(b"\0"):
                continue
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return out


def environ_of(pid: int) -> dict[str, str]:
    """Process ``pid``'s environment (``/proc/PID/environ``)."""
    items = (Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")).split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def service_pid(run: Path, module: str, arg: str = "") -> int:
    hits = [p for p, cmd in job_pids(run).items() if f"-m {module} " in cmd and arg in cmd]
    assert len(hits) == 1, (module, arg, job_pids(run))
    return hits[0]


def get(url: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


class Job:
    """The sbatch script started as Slurm would start it on the first node of a three-node allocation."""

    def __init__(self, tmp: Path, **env: str) -> None:
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        for name, text in (("scontrol", SCONTROL), ("srun", SRUN.format(python=sys.executable))):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        self.run = tmp / "run"
        self.port = free_port()
        self.out = tmp / "job.out"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("EI_", "SLURM_")) and k != "GOMEMLIMIT"}
        base.update(
            PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(REPO), EI_HOME=str(REPO), EI_PYTHON=sys.executable,
            EI_RUN_DIR=str(self.run), SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="3", SLURM_JOB_NODELIST="n[1-3]",
            ROUTER_PORT=str(self.port), NATS_PORT=str(free_port()), SPLIT="1P1D", SPEEDUP="20", PROFILE="tiny",
            TZ="UTC",  # nats-server's log times are local: UTC as the services' (stopped_before_nats compares them)
        )
        base.update(env)
        self.proc = subprocess.Popen(
            ["bash", str(SBATCH)], cwd=REPO, env=base, stdout=self.out.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def text(self) -> str:
        return self.out.read_text()

    def wait_for(self, what: str, timeout_s: float, count: int = 1) -> None:
        deadline = time.monotonic() + timeout_s
        while self.text().count(what) < count:
            assert self.proc.poll() is None or self.text().count(what) >= count, f"job ended (rc {self.proc.returncode}):\n{self.text()}"
            assert time.monotonic() < deadline, f"no {what!r} ({count}) in {timeout_s} s:\n{self.text()}"
            time.sleep(0.3)

    def healthy(self) -> bool:
        try:
            return get(f"http://127.0.0.1:{self.port}/healthz").startswith(b"{")
        except OSError:
            return False

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in job_pids(self.run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def stopped_before_nats(run: Path) -> dict[str, float]:
    """Seconds from each service's "service stopped" line to nats-server's SIGTERM line ("Trapped "terminated"
    signal"), by log name: positive when the service had stopped before the job stopped nats-server."""
    (trapped,) = [line for line in (run / "nats.log").read_text().splitlines() if 'Trapped "terminated" signal' in line]
    day, clock = trapped.split()[1:3]
    nats_at = datetime.strptime(f"{day} {clock}", "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
    out = {}
    for log in run.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"service stopped"' in line:
                at = datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp()
                out[log.name] = nats_at - at
    return out


@contextlib.contextmanager
def take_after_the_port_check(job: Job, port: int):
    """A listener on ``port`` (backlog 64: the kernel accepts, nobody answers), bound once the job has checked
    the ports it was given (its ``ports:`` line; a given port taken then stops the job, exit 2) and before its
    router starts (after nats-server and the stream, seconds later): a port taken while the job runs."""
    job.wait_for("ports: router", 60)
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))
        s.listen(64)
        yield s


@pytest.mark.timeout(300)
def test_a_router_and_a_worker_killed_are_restarted_and_sigterm_stops_everything(tmp_path):
    job = Job(tmp_path)
    try:
        job.wait_for("READY", 150)
        nodes = json.loads(get(f"http://127.0.0.1:{job.port}/v1/cluster"))["nodes"]
        assert sorted(n["node"] for n in nodes) == ["w0", "w1"]
        # the must-arrive subjects' JetStream stream exists (the job creates it with the launcher's
        # credentials; under nkeys no service may): before, every service logged "no JetStream stream"
        # and NATS a "Publish Violation" on $JS.API.STREAM.CREATE: at most once, silently
        logs = {p.name: p.read_text() for p in job.run.glob("*.log")}
        assert not [n for n, t in logs.items() if "no JetStream stream" in t], logs
        assert "STREAM.CREATE" not in logs["nats.log"], logs["nats.log"]
        assert "JetStream stream EI_p0 on nats:" in job.text()

        # one API key id salt per job (reviewer rr-sec2: the router made its own at each start, so its ids changed at
        # each restart): in $RUN/api-key-id.salt (0600), in the router's environment only, never in argv
        salt_file = job.run / "api-key-id.salt"
        salt = salt_file.read_text().strip()
        assert len(salt) == 32 and stat.S_IMODE(salt_file.stat().st_mode) == 0o600
        router = service_pid(job.run, "services.router")
        assert environ_of(router)["EI_API_KEY_ID_SALT"] == salt
        assert "EI_API_KEY_ID_SALT" not in environ_of(service_pid(job.run, "services.worker", "--node w0 "))
        assert all(salt not in cmd for cmd in job_pids(job.run).values())
        os.kill(router, signal.SIGKILL)
        job.wait_for("router exited (status 137); restart 1 of 10", 20)
        deadline = time.monotonic() + 60
        while not job.healthy():
            assert time.monotonic() < deadline, f"router not back:\n{job.text()}"
            time.sleep(0.5)
        assert environ_of(service_pid(job.run, "services.router"))["EI_API_KEY_ID_SALT"] == salt  # the same after a restart

        # 1P1D: w1 is the decode node, so a request served end to end after this needs it back
        os.kill(service_pid(job.run, "services.worker", "--node w1 "), signal.SIGKILL)
        job.wait_for("worker-w1 exited (status 137); restart 1 of 10", 20)
        deadline = time.monotonic() + 90
        while True:
            try:
                r = json.loads(get(f"http://127.0.0.1:{job.port}/v1/completions", {"prompt": "hello there", "max_tokens": 4}))
                break
            except OSError as e:
                assert time.monotonic() < deadline, f"no completion after the worker restart: {e}\n{job.text()}"
                time.sleep(1)
        assert r["usage"]["completion_tokens"] == 4
        assert job.proc.poll() is None and "FAILED" not in job.text()
        # the supervise loop's own line only: before, bash's job notice for the SIGKILLed child came first
        # ('environment: line 8: 17660 Killed  "$@" >> "$logf" 2>&1'), for the router as for the worker
        assert not re.search(r"line \d+: +\d+ Killed", job.text()), job.text()

        os.kill(job.proc.pid, signal.SIGTERM)  # scancel's signal to the batch script
        assert job.proc.wait(60) == 0, job.text()
        time.sleep(0.5)
        assert job_pids(job.run) == {}, job_pids(job.run)
        assert "stopped" in job.text()
        # nats-server is stopped after the others, whose drain goes through it: before, all at once, and a
        # drain that met it gone waited out the bus's 5-s timeout ("nats connection lost at close")
        order = stopped_before_nats(job.run)
        # (w1, killed above, may still be in its restart's 0.5-s wait: then it has no stop to log; w0 served alone)
        assert {"kvdirectory.log", "planner.log", "router.log", "worker-w0.log"} <= set(order), order
        assert all(s > 0 for s in order.values()), order
    finally:
        job.close()


@pytest.mark.timeout(240)
def test_a_service_that_keeps_dying_fails_the_job_with_its_name(tmp_path):
    """The router's port is taken once the job has started (past its check of the ports given): the router
    exits at start each time; after MAX_RESTARTS the job says which service gave up, stops the others and
    exits 1 (Slurm: state FAILED)."""
    port = free_port()
    job = Job(tmp_path, MAX_RESTARTS="1", ROUTER_PORT=str(port))
    with take_after_the_port_check(job, port):
        try:
            rc = job.proc.wait(180)
            text = job.text()
            assert rc == 1, text
            assert "router exited (status 1); restart 1 of 1" in text, text
            assert "router exited (status 1) 2 times in 600 s (RESTART_WINDOW_S): giving up" in text, text
            assert "FAILED: router ended before the router answered /healthz" in text, text
            assert "READY" not in text
            time.sleep(0.5)
            assert job_pids(job.run) == {}, job_pids(job.run)
        finally:
            job.close()


@pytest.mark.timeout(300)
def test_the_job_runs_up_s_policy_set_and_each_service_has_its_own_metrics_port(tmp_path):
    """Before, the job ran a static planner with LRU eviction (the services' defaults; `up` runs the evolving
    set) and only the router's /metrics existed (no EI_METRICS_PORT): the dashboard's split, queue, KV and
    directory panels stayed empty. Now: POLICY (default evolving) through `deploy-args`, and kvdirectory,
    planner, router on METRICS_PORT+0..2, worker wN on METRICS_PORT+3+N, listed in a file_sd targets file."""
    # no port given: the job's own (deploy/slurm/README.md, Ports), in its output and $EI_RUN_DIR/ports
    job = Job(tmp_path, NATS_PORT="", ROUTER_PORT="", METRICS_PORT="")
    try:
        job.wait_for("ports: router", 60)
        ports = dict(line.split("=", 1) for line in (job.run / "ports").read_text().splitlines() if not line.startswith("#"))
        base, job.port = int(ports["METRICS_PORT"]), int(ports["ROUTER_PORT"])
        assert ports["ROUTER_URL"] == f"http://127.0.0.1:{job.port}" and 10000 <= job.port < 32000, ports
        assert f"ports: router :{job.port}, nats :{ports['NATS_PORT']}, metrics :{base}.." in job.text()
        job.wait_for("READY", 150)
        assert f"READY router http://127.0.0.1:{job.port}  nats nats://127.0.0.1:{ports['NATS_PORT']}" in job.text()
        assert json.loads(get(f"http://127.0.0.1:{job.port}/v1/cluster"))["policy"] == "ttft"
        assert "policy evolving: routing ttft, planner evolving, eviction branch-count, decode binding prefill-start" in job.text()
        assert '"policy": "evolving"' in (job.run / "planner.log").read_text()
        worker = job_pids(job.run)[service_pid(job.run, "services.worker", "--node w0 ")]
        # the evolving planner's warm-up serves every node both: the job starts them so, as up (session 59: prefill)
        assert "--host-eviction branch-count" in worker and "--phase both" in worker, worker
        router = job_pids(job.run)[service_pid(job.run, "services.router")]
        assert "--decode-binding prefill-start" in router, router
        # the one router, whose republish a restarted directory waits for (from deploy-args, as compose's)
        directory = job_pids(job.run)[service_pid(job.run, "services.kvdirectory")]
        assert "--routers router" in directory, directory
        # nats-server's soft heap cap, as under up and compose (shared.natsserver.server_env); before, none
        (nats,) = [pid for pid, cmd in job_pids(job.run).items() if "nats-server" in cmd and "nats.conf" in cmd and not cmd.startswith("env ")]
        assert b"GOMEMLIMIT=512MiB" in Path(f"/proc/{nats}/environ").read_bytes().split(b"\0")
        targets = json.loads((job.run / "prometheus-targets.json").read_text())
        # and the same list in the one flat folder a Prometheus file_sd glob can name (beside the run folder:
        # runs/prometheus-targets/slurm-<jobid>.json): Prometheus refuses runs/slurm-*/prometheus-targets.json
        flat = tmp_path / "prometheus-targets"
        assert [p.name for p in flat.iterdir()] == ["slurm-4242.json"], list(flat.iterdir())
        assert json.loads((flat / "slurm-4242.json").read_text()) == targets
        assert f'Prometheus file_sd: {flat}/slurm-4242.json (files: ["{flat}/*.json"])' in job.text(), job.text()
        by_service = [(t["labels"]["service"], t["labels"].get("node"), t["targets"]) for t in targets]
        assert by_service == [
            ("kvdirectory", None, [f"127.0.0.1:{base}"]), ("planner", None, [f"127.0.0.1:{base + 1}"]),
            ("router", None, [f"127.0.0.1:{base + 2}"]), ("worker", "w0", [f"127.0.0.1:{base + 3}"]),
            ("worker", "w1", [f"127.0.0.1:{base + 4}"]),
        ], by_service
        # each target scraped as Prometheus would, at the address the file gives: a worker's is its node's NodeAddr,
        # as the head's is (before, the node's name: n2, n3, which need not resolve; here they do not)
        families = {}
        for k, t in enumerate(targets):
            text = get(f"http://{t['targets'][0]}/metrics").decode()
            families[k] = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        assert all(families.values()), families
        assert len({frozenset(f) for f in list(families.values())[:4]}) == 4, "the head's services serve one port each"
        # stopped (scancel): no targets left for a file_sd glob over runs/ to scrape under this job's label
        os.kill(job.proc.pid, signal.SIGTERM)
        assert job.proc.wait(60) == 0, job.text()
        assert json.loads((job.run / "prometheus-targets.json").read_text()) == [], job.text()
        assert list(flat.iterdir()) == [], list(flat.iterdir())  # removed: the folder holds running jobs' lists only
    finally:
        job.close()


# EI_PYTHON for test_a_service_that_ignores_sigterm_...: the planner and worker w1 run under a shell that ignores
# SIGTERM and SIGINT (the worker step's stop; the service itself, its child, serves and never gets one), everything
# else is the real Python
IGNORES_TERM = """#!/bin/bash
case " $* " in
  *" -m services.planner "*|*" -m services.worker "*" --node w1 "*) trap '' TERM INT; {python} "$@" & wait; exit ;;
esac
exec {python} "$@"
"""


@pytest.mark.timeout(300)
def test_a_service_that_ignores_sigterm_is_killed_after_stop_grace_and_the_job_ends(tmp_path):
    """After a FAILED line the job stops itself, and no Slurm KillWait bounds that stop (scancel's does). Before,
    stop_all waited for every service without a limit: one that ignored its SIGTERM (here the planner and worker
    w1) kept the job RUNNING until its time limit (here: not ended 25 s after the FAILED line). Now, STOP_GRACE s
    after the SIGTERM, what is left is named in the job's log and SIGKILLed with what it started (the supervise
    loop, its child; the worker step, its tasks), then nats-server is stopped and the job exits 1."""
    python = tmp_path / "python"
    python.write_text(IGNORES_TERM.format(python=sys.executable))
    python.chmod(0o755)
    job = Job(tmp_path, EI_PYTHON=str(python), MAX_RESTARTS="0", STOP_GRACE="4")
    try:
        job.wait_for("READY", 150)
        os.kill(service_pid(job.run, "services.router"), signal.SIGKILL)  # MAX_RESTARTS=0: the job fails at once
        job.wait_for("FAILED: router ended", 30)
        t0 = time.monotonic()
        try:
            rc = job.proc.wait(25)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still runs 25 s after its FAILED line (STOP_GRACE=4):\n{job.text()}")
        took = time.monotonic() - t0
        text = job.text()
        assert rc == 1, text
        assert "still running 4 s after their stop signal (STOP_GRACE): planner (SIGTERM), worker step (SIGINT); SIGKILL" in text, text
        assert took < 4 + 10, f"the stop took {took:.1f} s:\n{text}"
        assert text.index("SIGKILL to them") < text.index("] stopped"), text
        time.sleep(0.5)
        assert job_pids(job.run) == {}, job_pids(job.run)  # the services under the shells too: not left to init
        # the others stopped in their drain, before nats-server (the SIGKILL waited for nothing of theirs)
        order = stopped_before_nats(job.run)
        assert {"kvdirectory.log", "worker-w0.log"} <= set(order) and all(s > 0 for s in order.values()), order
    finally:
        job.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env, frag", [
    ({"POLICY": "nope"}, "unknown policy set"),
    ({"ENGINE": "torch", "MODEL_DIR": "/nonexistent/model"}, "--model /nonexistent/model"),
    ({"EI_NATS_AUTH": "password"}, "EI_NATS_AUTH=password: nkeys"),  # ran nkeys without a word (every test is != off)
    ({"STOP_GRACE": "5s"}, "STOP_GRACE=5s: whole seconds"),
])
def test_a_policy_or_model_up_refuses_fails_the_job_before_anything_starts(tmp_path, env, frag):
    job = Job(tmp_path, **env)
    try:
        assert job.proc.wait(50) == 2, job.text()
        assert frag in job.text() and "READY" not in job.text(), job.text()
        assert job_pids(job.run) == {}, job_pids(job.run)
    finally:
        job.close()


@pytest.mark.timeout(420)
def test_engine_torch_serves_the_model_as_up_does(tmp_path):
    """The header's ``ENGINE=torch MODEL_DIR=...`` could not work: PROFILE stayed gb300-glm52 (the torch engine
    refuses it: tokens_per_forward 4.0) and the router got neither the model's tokenizer, name nor context. Now
    the job derives them as ``up --engine torch`` (profile torch-tiny-cpu, hf:MODEL_DIR, the folder's name,
    max_position_embeddings) and a completion is served by the model."""
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    model = tmp_path / "tiny-model"
    subprocess.run([sys.executable, "-m", "evolving_infra.cli", "model", "init", str(model)], check=True, capture_output=True,
                   timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    job = Job(tmp_path, ENGINE="torch", MODEL_DIR=str(model), PROFILE="gb300-glm52", SPEEDUP="1")
    try:
        job.wait_for("READY", 300)
        router = job_pids(job.run)[service_pid(job.run, "services.router")]
        for frag in (f"--tokenizer hf:{model} ", "--model tiny-model ", f"--max-context-tokens {context}", "--profile torch-tiny-cpu "):
            assert frag in router, (frag, router)
        worker = job_pids(job.run)[service_pid(job.run, "services.worker", "--node w1 ")]
        assert f"--engine torch --model {model}" in worker and "--profile torch-tiny-cpu" in worker, worker
        r = json.loads(get(f"http://127.0.0.1:{job.port}/v1/completions", {"prompt": "hello there", "max_tokens": 3}))
        assert r["usage"]["completion_tokens"] == 3 and r["model"] == "tiny-model", r
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_ready_timeout_is_wall_seconds_even_when_each_probe_hangs(tmp_path):
    """READY_TIMEOUT is seconds, as its doc says. Before, it counted probe rounds: each round was a
    Python start, a /healthz probe of up to 2 s and a 1 s sleep, so a router port that accepts and
    never answers (here: another listener holds it, the router keeps restarting) made READY_TIMEOUT=4
    last 12+ s (300: 15+ minutes). READY_TIMEOUT=8 here: its FAILED line comes within 8 s plus the last
    round and the services' start, where counting rounds took 24+ s; at 4 the bound had no room for a
    loaded box (9 s to the line when the services took 6 s to start under load).

    The probes are counted too (each is a connection the kernel accepted on the blocker): a round lasts 3 s
    at least (the 2-s probe timeout and the 1-s sleep), so 8 s hold 3 rounds at most, and counting rounds
    made 8, whatever the machine's load. The wall bound has to leave room for the last round, whose Python
    start took ~5 s under ``make test -n 2`` (this lane at nice +5 beside the live lane's clusters): 8 + 8 s
    could reach 16."""
    port = free_port()
    job = Job(tmp_path, MAX_RESTARTS="100", READY_TIMEOUT="8", ROUTER_PORT=str(port))
    with take_after_the_port_check(job, port) as blocker:  # connections are accepted by the kernel, never answered
        try:
            job.wait_for("JetStream stream EI_p0 on", 60)  # the line just before the services start
            t0 = time.monotonic()
            # until the FAILED line (polled every 0.3 s), not the job's exit: the services' drain after it
            # (~2 s, more on a loaded box) is not what READY_TIMEOUT bounds
            job.wait_for("FAILED: the router did not answer /healthz within 8 s", 60)
            took = time.monotonic() - t0
            rc = job.proc.wait(60)
            stop_s = time.monotonic() - t0 - took
            text = job.text()
            assert rc == 1, text
            # the stop after the FAILED line, within Slurm's default KillWait (30 s). Before, a service stopped while
            # NATS (stopped with it) refused its connect could lose the cancel and never exit (shared.bus
            # Bus.connect, tests/unit/shared/test_bus_connect_cancel.py): this wait ran out at 60 s on a loaded box
            assert stop_s < 30.0, f"the stop took {stop_s:.1f} s:\n{text}"
            blocker.setblocking(False)
            probes = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    blocker.accept()[0].close()
                    probes += 1
            assert 1 <= probes <= 3, f"READY_TIMEOUT=8 made {probes} probes of >= 3 s each (rounds: 8 probes):\n{text}"
            assert took < 25.0, f"READY_TIMEOUT=8 took {took:.1f} s:\n{text}"
        finally:
            job.close()


@pytest.mark.timeout(180)
def test_sigterm_at_any_moment_stops_supervise_and_its_child():
    """The script's ``supervise`` (run alone, on ``sleep 30``) given SIGTERM at random moments of its
    first milliseconds ends within 1 s every time. Before, a SIGTERM whose trap ran between the fork of
    the service and ``child=$!`` found no child to stop: the service ran on and supervise waited for it
    (here 30 s; under stop_all, a job that never ended). Seen 5 times in 200 before; 0 in 300 after."""
    import random
    import re

    text = SBATCH.read_text()
    func = re.search(r"^supervise\(\) \{\n.*?^\}\n", text, re.S | re.M)
    assert func, "no supervise() in the sbatch"
    script = func.group(0) + "MAX_RESTARTS=10\nsupervise svc /dev/null sleep 30\n"
    hung = []
    rng = random.Random(37)
    for i in range(300):
        p = subprocess.Popen(["bash", "-c", script], start_new_session=True)
        time.sleep(rng.uniform(0.0005, 0.004))
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(1.0)
        except subprocess.TimeoutExpired:
            hung.append(i)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the sleep too, if it was left
        p.wait()
    assert not hung, f"supervise still running 1 s after SIGTERM in {len(hung)} of 300 runs"


STARTS_SLOWLY = """import pathlib, signal, sys, time
time.sleep(float(sys.argv[2]))  # its imports: the service shell's handlers are not installed yet
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))  # as shared.service: SIGINT and SIGTERM stop it
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
pathlib.Path(sys.argv[1]).write_text("up")
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_sigint_to_supervise_stops_a_worker_still_starting(tmp_path):
    """The worker step's stop is a SIGINT (stop_worker_step: srun forwards it to each task, whose supervise passes it
    on). A worker still starting (Python importing, the service shell's handlers not installed: a loaded node after a
    READY_TIMEOUT) had SIGINT ignored, as bash starts a background command without job control, and Python keeps an
    ignored SIGINT ignored: the SIGINT was lost, the worker then started and ran until the job's SIGKILL STOP_GRACE
    (50) s later (the job's stop took 50.6 s in a loaded suite). Now supervise sends SIGTERM after the SIGINT, which
    ends a worker still starting at once and stops a started one as SIGINT does (the worker has no drain)."""
    text = SBATCH.read_text()
    func = re.search(r"^supervise\(\) \{\n.*?^\}\n", text, re.S | re.M)
    assert func, "no supervise() in the sbatch"
    child, up = tmp_path / "child.py", tmp_path / "up"
    child.write_text(STARTS_SLOWLY)
    script = func.group(0) + f"MAX_RESTARTS=10\nsupervise w0 {tmp_path}/w0.log {sys.executable} {child} {up} 3\n"
    # SIGINT at its default in bash, whatever the runner's: a runner started as a background job (`make test &`,
    # nohup, a CI agent) ignores SIGINT, bash inherits that, and a non-interactive bash cannot trap a signal ignored
    # at its entry (the trap would be silently void and this test would fail for the runner's reason, not supervise's)
    p = subprocess.Popen(["bash", "-c", script], start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not any(str(child) in cmd for cmd in (Path(f"/proc/{q}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
                                                    for q in _children(p.pid))):
            assert time.monotonic() < deadline, "supervise did not start its child"
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGINT)  # while the child sleeps its 3 s "imports"
        try:
            rc = p.wait(8)
        except subprocess.TimeoutExpired:
            pytest.fail(f"supervise still running 8 s after its SIGINT (its child started: {up.exists()})")
        assert rc == 0
        assert not up.exists(), "the child started after the stop signal"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (/proc/PID/task/PID/children)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


DRAINS = """import signal, sys, time
name, out, drain = sys.argv[1], sys.argv[2], float(sys.argv[3])
stop_at = None


def on(sig, _frame):
    global stop_at
    with open(out, "a") as f:
        f.write(f"{name} {signal.Signals(sig).name}\\n")
    if stop_at is None:
        stop_at = time.monotonic() + drain


signal.signal(signal.SIGTERM, on)
signal.signal(signal.SIGINT, on)
with open(out + ".up", "a") as f:  # its stop signal handled from now on
    f.write(name + "\\n")
while stop_at is None or time.monotonic() < stop_at:
    time.sleep(0.02)
"""


@pytest.mark.timeout(120)
def test_a_second_sigterm_or_sigint_while_stopping_is_logged_and_the_stop_goes_on(tmp_path):
    """The script's stop (``stop_all`` from its ``on_signal`` trap, run with stand-in parts that each take 2 s to
    drain after their stop signal) given SIGTERM, then SIGTERM and SIGINT again while the router drains: the second
    SIGTERM is logged and ignored, the SIGINT ignored, every part gets its stop signal once, the job's own ``stopped`` line comes and it
    exits 0 with nothing left. Before, ``stop_all`` reset the traps to their defaults and the second SIGTERM killed
    the script mid-drain (status -15): the planner and the worker step were never stopped, left running without it."""
    text = SBATCH.read_text()
    funcs = []
    for name in ("log", "tree", "wait_bounded", "stop_worker_step", "stop_all", "stopping_traps", "again_while_stopping",
                 "on_signal", "gone"):
        func = re.search(rf"^{name}\(\) \{{.*?^\}}\n", text, re.S | re.M) or re.search(rf"^{name}\(\) \{{.*?\}}\n", text, re.M)
        assert func, f"no {name}() in the sbatch"
        funcs.append(func.group(0))
    (tmp_path / "drains.py").write_text(DRAINS)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\necho RUNNING\n")  # a job Slurm is not ending (scancel --batch)
    (bin_dir / "squeue").chmod(0o755)
    sig_file = tmp_path / "signals"
    part = f"{sys.executable} {tmp_path / 'drains.py'}"
    script = "set -uo pipefail\n" + "".join(funcs) + f"""
RUN={tmp_path} STOP_GRACE=20 SLURM_JOB_ID=4242
PIDS=() NAMES=()
for n in nats router planner; do {part} $n {sig_file} 2 & PIDS+=($!) NAMES+=($n); done
{part} worker-step {sig_file} 2 &
WORKER_STEP=$!
trap on_signal TERM INT
log READY
while [ -z "$(gone)" ]; do wait -n "${{PIDS[@]}}" "$WORKER_STEP"; done
log "FAILED: $(gone) ended"
stop_all 1
"""
    out = tmp_path / "job.out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=out.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        up = tmp_path / "signals.up"
        while "READY" not in out.read_text() or len(up.read_text().splitlines() if up.exists() else []) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        while "router SIGTERM" not in (sig_file.read_text() if sig_file.exists() else ""):  # the router drains (2 s)
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)
        # the SIGINT only once the second SIGTERM's trap has run (its line): bash (5.2) runs one trap only of two
        # trapped signals pending at once in its `wait` (the first handler longjmps out of the wait, the other's
        # handler never runs), and under load (2 cores, load average 5-9) a fixed 0.3 s did not keep them apart:
        # the SIGINT line was missing. Harmless in the script (the trap that runs does what the other would), so
        # the test keeps them apart rather than the script
        while "SIGTERM again while stopping" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.02)
        assert proc.poll() is None, out.read_text()  # still stopping: the SIGINT comes while it does
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(30)
        got = out.read_text()
        assert rc == 0, f"status {rc}:\n{got}"
        assert "SIGTERM again while stopping: ignored; the stop goes on" in got, got
        # the SIGINT's own line is not asserted: in the fresh-clone suite on 889d619 (load 3-5) it was missing though
        # the SIGINT came after the second SIGTERM's line, with the script still stopping: bash may run one trap only
        # when the next signal lands while a trap is being run. What the SIGINT tests is rc 0 and the stop's end: with
        # the traps reset to their defaults (the defect) it kills the script (status -2) before "stopped"
        assert got.rstrip().endswith("] stopped"), got
        # each part stopped once, by its own stop signal, nats-server last
        lines = sig_file.read_text().splitlines()
        assert sorted(lines) == ["nats SIGTERM", "planner SIGTERM", "router SIGTERM", "worker-step SIGINT"], lines
        assert lines[0] == "router SIGTERM" and lines[-1] == "nats SIGTERM", lines
        time.sleep(0.2)
        with pytest.raises(ProcessLookupError):  # nothing of the job left running
            os.killpg(proc.pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.timeout(120)
def test_a_sigterm_after_the_failed_line_keeps_the_jobs_failure_status(tmp_path):
    """The script's own end (its last lines, after its functions): a part ends for good, the script logs its
    ``FAILED`` line and stops with status 1. A SIGTERM there (a scancel while the line is written; here the ``log``
    of that line is made to take 2 s) is logged and ignored, and the job still fails (1). Before, the traps of a
    stop were set only in ``stop_all``: between the FAILED line and it ``on_signal`` was the trap and ran
    ``stop_all 0``, so the failed job exited 0."""
    text = SBATCH.read_text()
    funcs = []
    for name in ("log", "tree", "wait_bounded", "stop_worker_step", "stop_all", "stopping_traps", "again_while_stopping",
                 "on_signal", "gone"):
        func = re.search(rf"^{name}\(\) \{{.*?^\}}\n", text, re.S | re.M) or re.search(rf"^{name}\(\) \{{.*?\}}\n", text, re.M)
        assert func, f"no {name}() in the sbatch"
        funcs.append(func.group(0))
    end = re.search(r"^# until scancel \(the trap\).*\Z", text, re.S | re.M)
    assert end and "FAILED" in end.group(0), "no job end (until scancel ... FAILED ... stop_all 1) in the sbatch"
    (tmp_path / "drains.py").write_text(DRAINS)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\necho RUNNING\n")
    (bin_dir / "squeue").chmod(0o755)
    sig_file = tmp_path / "signals"
    part = f"{sys.executable} {tmp_path / 'drains.py'}"
    script = "set -uo pipefail\n" + "".join(funcs) + f"""
RUN={tmp_path} STOP_GRACE=20 SLURM_JOB_ID=4242
slow_log() {{ log "$@"; case "$*" in FAILED*) sleep 2;; esac; }}  # the FAILED line takes 2 s to write
PIDS=() NAMES=()
for n in nats router; do {part} $n {sig_file} 0.2 & PIDS+=($!) NAMES+=($n); done
{part} worker-step {sig_file} 0.2 &
WORKER_STEP=$!
while [ "$(cat {sig_file}.up 2>/dev/null | wc -l)" -lt 3 ]; do sleep 0.05; done  # each handles its stop signal
sleep 0.3 & PIDS+=($!) NAMES+=(planner)  # ends by itself: the job fails
trap on_signal TERM INT
log READY
""" + end.group(0).replace('log "FAILED', 'slow_log "FAILED')
    assert "slow_log" in script
    out = tmp_path / "job.out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=out.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while "FAILED: planner ended" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)  # while the FAILED line is written, before stop_all 1
        rc = proc.wait(30)
        got = out.read_text()
        assert rc == 1, f"status {rc}:\n{got}"
        assert "SIGTERM again while stopping: ignored; the stop goes on" in got, got
        assert got.rstrip().endswith("] stopped"), got
        lines = sig_file.read_text().splitlines()
        assert sorted(lines) == ["nats SIGTERM", "router SIGTERM", "worker-step SIGINT"], lines
        time.sleep(0.2)
        with pytest.raises(ProcessLookupError):  # nothing of the job left running
            os.killpg(proc.pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
