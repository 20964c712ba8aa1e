"""Two ``evolving-infra up`` given the same ``--log-dir`` both started: the second overwrote the first's
``nats-creds/*.nk``, ``cluster.json``, ``router.port`` and ``prometheus-targets.json``, and the first cluster's
``split get`` and restarted workers were then refused by its nats-server ("refused the credentials of 'worker-w0'").
Now the cluster holds its log folder (an ``flock`` on ``LOG_DIR/.evolving-infra.lock``, as ``--out`` is held) for
its life: the second ``up`` exits 2 naming the holder's pid and the folder, touching none of the first's files, and
the first still serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.e2e._up import read_ready

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {
        "EI_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}


def _cmd(logs: Path) -> list[str]:
    return [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "1", "--profile", "tiny", "--port", "0",
            "--log-dir", str(logs)]  # fmt: skip


def test_a_second_up_on_a_log_dir_in_use_is_refused_and_the_first_still_serves(tmp_path):
    logs = tmp_path / "logs"
    first = subprocess.Popen(_cmd(logs), cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    try:
        info = read_ready(first, lines, timeout_s=90)
        kept = {p.name: p.read_bytes() for p in sorted((logs / "nats-creds").iterdir())}
        kept |= {n: (logs / n).read_bytes() for n in ("cluster.json", "router.port")}
        second = subprocess.run(_cmd(logs), cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stdout + second.stderr
        assert (f"error: --log-dir {logs} is in use: another run (pid {first.pid}) is writing to it "
                f"(it holds {logs / '.evolving-infra.lock'})") in second.stderr, second.stderr
        assert "choose another --log-dir" in second.stderr
        assert "READY " not in second.stdout
        now = {p.name: p.read_bytes() for p in sorted((logs / "nats-creds").iterdir())}
        now |= {n: (logs / n).read_bytes() for n in ("cluster.json", "router.port")}
        assert now == kept  # before: the second up's keys and ports over the first's
        r = httpx.get(f"{info['router_url']}/v1/models", timeout=10)  # the first still serves
        assert r.status_code == 200, r.text
        first.send_signal(signal.SIGINT)
        rest, _ = first.communicate(timeout=60)
        assert first.returncode == 0, "".join(lines) + rest
        assert not (logs / ".evolving-infra.lock").exists()  # released: a later up takes the folder
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)


def test_a_demo_on_a_log_dir_in_use_is_refused_before_it_clears_its_logs(tmp_path):
    """``demo``, which runs ``up``'s cluster, is refused the same way, before it clears the ``*.log`` files of its
    default ``OUT/logs`` (another run's logs, when an ``up --log-dir OUT/logs`` runs) or starts anything."""
    from evolving_infra.out_folder import lock_folder, unlock_folder

    out = tmp_path / "demo"
    logs = out / "logs"
    logs.mkdir(parents=True)
    (logs / "router.log").write_text("the running cluster's line\n")
    fd = lock_folder(logs)  # as a running `up --log-dir OUT/logs` holds it (this process's pid)
    try:
        cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "1", "--out", str(out)]
        p = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    finally:
        unlock_folder(logs, fd)
    assert p.returncode == 2, p.stdout + p.stderr
    assert (f"error: --log-dir {logs} is in use: another run (pid {os.getpid()}) is writing to it "
            f"(it holds {logs / '.evolving-infra.lock'})") in p.stderr, p.stderr
    assert (logs / "router.log").read_text() == "the running cluster's line\n"  # not cleared
    assert not (out / ".evolving-infra.lock").exists()  # OUT's lock released
