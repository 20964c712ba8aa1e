"""Every deployment's nats-server takes the same limits as ``up``'s embedded one (``shared.natsserver.limits_conf``:
``max_payload`` 16 MiB, ``max_pending`` 256 MiB). Compose's and the Slurm job's configs set none: nats-server's 1 MiB
payload refused there a prefill dispatch that ``up`` takes (past ~250k prompt tokens), and, before hand-offs went in
pieces, every PD hand-off of more than 1 MiB of K/V (2,000 tokens of the tiny model, 8 of Llama-3-8B).

Compose: the ``auth`` role (``deploy/docker/entrypoint.sh`` under ``/bin/sh``, no docker, as
``test_entrypoint_block_size``) writes the limits in both auth modes, and the ``nats`` role's server, started with the
real binary from what the role runs (its port, address and store moved into ``tmp_path``), announces 16 MiB in its
INFO. Slurm: the job writes the limits into its ``nats.conf``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import pytest

from shared.natsserver import MAX_PAYLOAD_BYTES, MAX_PENDING_BYTES, find_nats_server, limits_conf
from tests.deploy.test_entrypoint_block_size import ENTRYPOINT, REPO, _run


def _info(port: int, proc: subprocess.Popen[bytes], deadline_s: float = 20.0) -> dict:
    """The INFO a nats-server listening on ``port`` sends first (before any login)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                line = s.makefile("rb").readline().decode()
                assert line.startswith("INFO "), line
                return json.loads(line[5:])
        except OSError:
            time.sleep(0.1)
    raise AssertionError("nats-server did not listen")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("auth", ["off", "nkeys"])
def test_compose_nats_takes_ups_limits_in_both_auth_modes(tmp_path, auth):
    creds, out = tmp_path / "creds", tmp_path / "creds-out"
    for d in (creds, *(out / who for who in ("router", "planner", "kvdirectory", "launcher", "workers"))):
        d.mkdir(parents=True)
    vols = {"EI_CREDS_DIR": str(creds), "EI_CREDS_OUT": str(out), "EI_NATS_AUTH": auth}
    r = _run(tmp_path, "auth", **vols)
    assert r.returncode == 0, r.stderr
    assert (creds / "nats-limits.conf").read_text() == limits_conf()
    if auth == "nkeys":
        assert "include nats-limits.conf" in (creds / "nats.conf").read_text()
        # a volume an older image made (its nats.conf without the limits): the next start writes it again, keys kept
        key = (creds / "launcher.nk").read_text()
        (creds / "nats.conf").write_text((creds / "nats.conf").read_text().replace("include nats-limits.conf\n", ""))
        assert _run(tmp_path, "auth", **vols).returncode == 0
        assert "include nats-limits.conf" in (creds / "nats.conf").read_text() and (creds / "launcher.nk").read_text() == key
    # the nats role's own command line, with the real server (the port, address, monitor and store moved here)
    bin_dir = tmp_path / "bin"
    (bin_dir / "nats-server").symlink_to(find_nats_server())
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(REPO), EI_CLOCK_ORIGIN="1.0", **vols)
    move = ["-a", "127.0.0.1", "-p", str(port), "-m", str(_free_port())]
    if auth == "off":
        move += ["-sd", str(tmp_path / "js")]
    else:  # nats-server refuses a -sd beside its config's store_dir
        conf = creds / "nats.conf"
        conf.write_text(conf.read_text().replace("/var/lib/ei/jetstream", str(tmp_path / "js")))
    proc = subprocess.Popen(["/bin/sh", str(ENTRYPOINT), "nats", *move], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        info = _info(port, proc)
    finally:
        proc.terminate()
        proc.wait(10)
    assert info["max_payload"] == MAX_PAYLOAD_BYTES == 16 * 1024 * 1024
    assert info.get("auth_required", False) == (auth == "nkeys")


def test_the_slurm_job_writes_ups_limits_into_its_nats_config():
    text = (REPO / "deploy" / "slurm" / "evolving-infra.sbatch").read_text()
    block = text[text.index('NATS_LIMITS=$("$PY" -c') : text.index('>"$RUN/nats.conf"')]
    assert "from shared.natsserver import limits_conf" in block and 'echo "$NATS_LIMITS"' in block, block
    assert re.findall(r"max_pending: (\d+)", limits_conf()) == [str(MAX_PENDING_BYTES)]
    # the one source: no deployment writes its own number
    for path in (ENTRYPOINT, REPO / "deploy" / "slurm" / "evolving-infra.sbatch", REPO / "docker-compose.yml"):
        assert not re.search(r"max_payload: \d", path.read_text()), path
