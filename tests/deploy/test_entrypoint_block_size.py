"""The container entrypoint gives the KV directory and the router ``EI_PROFILE``'s block size (the
workers': compose's ``EI_PROFILE=tiny`` with its old ``EI_BLOCK_SIZE`` default of 64 answered every
request with 500 "block size mismatch"), and refuses another ``EI_BLOCK_SIZE`` (status 2, one line).

Runs ``deploy/docker/entrypoint.sh`` itself with ``/bin/sh`` (no docker): a ``python`` first on
PATH shows what ``python -m services.<role>`` would be started with, and runs anything else with
this interpreter (the entrypoint reads the profile with ``python -c``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"


def _run(tmp_path: Path, role: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "python"
    shim.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ]; then echo "started $2 EI_BLOCK_SIZE=${EI_BLOCK_SIZE-unset}"; '
        '[ -n "${ENV_OUT:-}" ] && env > "$ENV_OUT"; '
        '[ -n "${ARGS_OUT:-}" ] && shift 2 && printf "%s\\n" "$@" > "$ARGS_OUT"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    shim.chmod(0o755)
    cli = bin_dir / "evolving-infra"  # the image's console script (deploy-args)
    cli.write_text(f'#!/bin/sh\nexec {sys.executable} -m evolving_infra.cli "$@"\n')
    cli.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    base.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(REPO), EI_CLOCK_ORIGIN="1.0", EI_NATS_AUTH="off")
    return subprocess.run(["/bin/sh", str(ENTRYPOINT), role, *args], env={**base, **env}, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("role", ["kvdirectory", "router"])
def test_the_block_size_follows_the_profile(tmp_path, role):
    r = _run(tmp_path, role, EI_PROFILE="tiny", EI_BLOCK_SIZE="")  # compose's value when EI_BLOCK_SIZE is not set
    assert (r.returncode, r.stdout.strip()) == (0, f"started services.{role} EI_BLOCK_SIZE=4"), r.stderr
    r = _run(tmp_path, role)  # no profile given: the services' default, gb300-glm52
    assert (r.returncode, r.stdout.strip()) == (0, f"started services.{role} EI_BLOCK_SIZE=64"), r.stderr
    r = _run(tmp_path, role, EI_PROFILE="tiny", EI_BLOCK_SIZE="4")  # the same size, said again
    assert (r.returncode, r.stdout.strip()) == (0, f"started services.{role} EI_BLOCK_SIZE=4"), r.stderr


@pytest.mark.parametrize("role", ["kvdirectory", "router"])
def test_another_block_size_is_refused(tmp_path, role):
    r = _run(tmp_path, role, EI_PROFILE="tiny", EI_BLOCK_SIZE="64")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert "EI_BLOCK_SIZE=64 differs from the block size 4 of profile tiny" in line and "set EI_BLOCK_SIZE=4" in line, line


def test_an_unreadable_profile_stops_the_service(tmp_path):
    r = _run(tmp_path, "router", EI_PROFILE=str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "started" not in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"router: EI_PROFILE={tmp_path / 'missing.toml'}: ") and "Traceback" not in r.stderr, r.stderr


def test_a_worker_whose_profile_has_another_block_size_than_the_clusters_is_refused(tmp_path):
    """A worker given ``--profile torch-tiny-cpu`` (8-token blocks; compose's old ``worker-torch``)
    while the router and directory follow ``EI_PROFILE`` (gb300-glm52 by default, 64): it
    started, and every request failed with 500 "block size mismatch". Refused (one line, status 2)
    naming the EI_PROFILE to set; one with the same block size, or the same profile, starts."""
    torch_cmd = ["--engine", "torch", "--model", "/models", "--profile", "torch-tiny-cpu"]
    r = _run(tmp_path, "worker", *torch_cmd, EI_REPLICA="1")  # EI_PROFILE unset: the default gb300-glm52
    assert r.returncode == 2 and "started" not in r.stdout, (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert "--profile torch-tiny-cpu" in line and "block size 8" in line and "EI_PROFILE=gb300-glm52" in line, line
    assert "64" in line and "set EI_PROFILE=torch-tiny-cpu" in line, line
    r = _run(tmp_path, "worker", *torch_cmd, EI_REPLICA="1", EI_PROFILE="torch-tiny-cpu")
    assert (r.returncode, r.stdout.strip()) == (0, "started services.worker EI_BLOCK_SIZE=unset"), r.stderr
    r = _run(tmp_path, "worker", "--profile=gb300-kimi-k26", EI_REPLICA="2")  # another profile, same block size (64)
    assert (r.returncode, r.stdout.strip()) == (0, "started services.worker EI_BLOCK_SIZE=unset"), r.stderr
    r = _run(tmp_path, "worker", EI_REPLICA="1", EI_PROFILE="tiny")  # no --profile: EI_PROFILE, the cluster's
    assert (r.returncode, r.stdout.strip()) == (0, "started services.worker EI_BLOCK_SIZE=unset"), r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (unshare --pid: the entrypoint as PID 1, as in a container)")
def test_sigterm_stops_the_entrypoint_as_pid_1_while_it_waits(tmp_path):
    """In a container the entrypoint is PID 1 until it execs the service, and the kernel drops a
    signal PID 1 has no handler for: waiting for ``$EI_CREDS_DIR/clock_origin`` (written by the
    auth job; up to 60 s) it ignored ``docker compose stop``'s SIGTERM until the 10-s SIGKILL.
    Here in a new PID namespace (``unshare --pid --fork``): SIGTERM ends it within ~1 s, status 143."""
    import shutil
    import time

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    creds = tmp_path / "creds"
    creds.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    env.update(EI_CREDS_DIR=str(creds), EI_NATS_AUTH="off", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "/bin/sh", str(ENTRYPOINT), "router"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        pid1 = None
        while pid1 is None:  # the entrypoint: unshare's child, PID 1 of the new namespace
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            if kids and Path(f"/proc/{kids[0]}/status").read_text().split("NSpid:")[1].split("\n")[0].split()[-1] == "1":
                pid1 = int(kids[0])
            time.sleep(0.05)
        time.sleep(1.0)  # inside its wait for clock_origin
        assert proc.poll() is None
        t0 = time.monotonic()
        os.kill(pid1, 15)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pytest.fail("the entrypoint (PID 1) ignored SIGTERM while waiting for the clock origin")
        assert time.monotonic() - t0 < 3
        assert proc.returncode == 143, proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
