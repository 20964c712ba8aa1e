"""A live ``up`` and ``demo`` as a newcomer runs them from the README (session 36): ``up --nodes 2`` with no
``--split``, ``--api-keys-file``, the profile and the keys in the banner, a state file that follows the
supervisor's restarts; ``demo`` ended by SIGINT/SIGTERM removes its state file and NATS store."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from evolving_infra.state import _alive  # a zombie counts as dead
from tests.e2e._up import read_ready, read_until

pytestmark = pytest.mark.timeout(240)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment without API keys, the state dir under ``tmp_path``, plus ``extra``."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {"EI_STATE_DIR": str(tmp_path / "state"), **extra}


def _small_up(tmp_path: Path, nodes: int, *extra: str) -> list[str]:
    """``up`` of ``nodes`` tiny static workers on a free port, logs under ``tmp_path``."""
    return [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", str(nodes), "--profile", "tiny", "--port", "0",
            "--policy", "static", *extra, "--log-dir", str(tmp_path / "logs")]  # fmt: skip


@contextlib.contextmanager
def _running_up(tmp_path: Path, nodes: int, *extra: str) -> Iterator[tuple[subprocess.Popen[str], dict, list[str]]]:
    """A :func:`_small_up` until READY: (its process, the READY line's JSON, the lines so far); killed if still
    running at the end."""
    proc = subprocess.Popen(_small_up(tmp_path, nodes, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(tmp_path))  # fmt: skip
    lines: list[str] = []
    try:
        yield proc, read_ready(proc, lines), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_with_keys_file_on_two_nodes_keeps_its_state_file_current(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# ops\nk-newcomer\n")
    state_dir = tmp_path / "state"
    with _running_up(tmp_path, 2, "--api-keys-file", str(keys)) as (proc, info, lines):
        banner = "".join(lines)
        assert "split 1P1D; 2 workers, profile tiny" in banner, banner  # was refused: '2P2D' covers 4 nodes
        assert f"API keys ON (1 from --api-keys-file {keys})" in banner, banner
        url = info["router_url"]
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k-newcomer"}, timeout=5).status_code == 200

        [path] = state_dir.glob("up-*.json")
        assert json.loads(path.read_text())["pids"] == info["pids"]
        old = info["pids"]["worker-w1"]
        os.kill(old, signal.SIGKILL)
        read_until(proc, "restarted worker-w1", lines, timeout_s=60)
        state = json.loads(path.read_text())  # was the READY-time file: the dead pid, restarts 0
        new = state["pids"]["worker-w1"]
        assert new != old and _alive(new) and state["restarts"]["worker-w1"] == 1, state
        assert {k: v for k, v in state["pids"].items() if k != "worker-w1"} == {k: v for k, v in info["pids"].items() if k != "worker-w1"}
        assert not list(state_dir.glob("*.tmp"))  # written atomically
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert not list(state_dir.glob("up-*.json"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_demo_stops_its_cluster_and_removes_its_state_and_nats_store(sig, tmp_path):
    """SIGTERM killed the demo (143, no message) with its state file and its nats-server's JetStream folder
    (/tmp/ei-nats-*, 196 MB once) left behind; now it stops as ``up`` does."""
    tmp = tmp_path / "tmp"  # where tempfile puts ei-nats-*
    tmp.mkdir()
    state_dir = tmp_path / "state"
    env = _env(tmp_path, TMPDIR=str(tmp))
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "4", "--concurrency", "2", "--speedup", "5",
           "--nodes", "2", "--out", str(tmp_path / "demo")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        read_until(proc, "cluster ready in", lines)
        deadline = time.monotonic() + 10
        while not list(state_dir.glob("up-*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(state_dir.glob("up-*.json")) and list(tmp.glob("ei-nats-*")), list(tmp.iterdir())
        pids = json.loads(next(state_dir.glob("up-*.json")).read_text())["pids"]
        time.sleep(1.0)  # requests in flight
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    # stopped during the replay: the report of what was answered (tests/e2e/test_demo_interrupt.py checks its figures)
    assert err.splitlines()[-1] == (f"demo: {sig.name}: stopped the replay and the cluster (its state file and NATS store "
                                    f"removed); partial report written; logs in {tmp_path / 'demo' / 'logs'}"), err
    assert json.loads((tmp_path / "demo" / "report.json").read_text())["meta"]["partial"]["signal"] == sig.name
    assert not list(state_dir.glob("up-*.json"))
    assert not list(tmp.glob("ei-nats-*"))
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in pids.items() if _alive(p)]


def test_a_router_restarted_after_its_key_file_was_deleted_keeps_the_keys_none_in_ps_or_logs(tmp_path):
    """The router re-read --api-keys-file's path at each start: a file deleted after ``up`` started (a secret
    mounted for the start) failed every restart until the cluster gave up. The keys go in its environment now."""
    keys = tmp_path / "keys"
    keys.write_text("k-secret-rl36\n")
    with _running_up(tmp_path, 1, "--api-keys-file", str(keys)) as (proc, info, lines):
        keys.unlink()
        router = info["pids"]["router"]
        assert b"k-secret-rl36" not in Path(f"/proc/{router}/cmdline").read_bytes()  # world-readable (ps)
        os.kill(router, signal.SIGKILL)
        read_until(proc, "restarted router", lines, timeout_s=60)
        url, auth = info["router_url"], {"Authorization": "Bearer k-secret-rl36"}
        deadline = time.monotonic() + 30
        while True:  # the restarted router listens on the same port
            try:
                if httpx.get(url + "/v1/models", headers=auth, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "logs" / "router.log").read_text()[-2000:]
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert not [p.name for p in (tmp_path / "logs").glob("*.log") if "k-secret-rl36" in p.read_text()]


def _sigusr1_handled_or_ignored(pid: int) -> bool:
    """Whether process ``pid`` ignores or catches SIGUSR1 (its SigIgn / SigCgt masks in /proc)."""
    bit = 1 << (signal.SIGUSR1 - 1)
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return bool((int(fields["SigIgn"], 16) | int(fields["SigCgt"], 16)) & bit)


def test_up_sigusr1_rotates_the_keys_and_a_router_restarted_later_keeps_the_rotated_ones(tmp_path):
    """``up``'s SIGUSR1 during its start killed it (the default action, 138); after READY it sends each router SIGHUP
    (a key reload), and a router ``up`` restarts afterwards, with the file gone, starts with the rotated keys (it read
    the path at its start: exit 1 at every restart until ``up`` gave up)."""
    keys = tmp_path / "keys"
    keys.write_text("k-before-rot\n")
    proc = subprocess.Popen(_small_up(tmp_path, 1, "--api-keys-file", str(keys)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(tmp_path))  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not _sigusr1_handled_or_ignored(proc.pid):  # the interpreter's start: no process can help that
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-2000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)  # during the start
        info = read_ready(proc, lines)
        url = info["router_url"]

        def code(key: str) -> int:
            return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code

        assert code("k-before-rot") == 200
        keys.write_text("k-after-rot\n")
        proc.send_signal(signal.SIGUSR1)
        line = read_until(proc, "SIGUSR1: ", lines, timeout_s=30)
        assert line.startswith(f"SIGUSR1: {keys} holds 1 keys; SIGHUP sent to 1 router (router); each logs"), line
        deadline = time.monotonic() + 30
        while code("k-after-rot") != 200:
            assert time.monotonic() < deadline, (tmp_path / "logs" / "router.log").read_text()[-2000:]
            time.sleep(0.2)
        assert code("k-before-rot") == 401
        # the reload's line names each key by its id: an HMAC under the cluster's salt (0600), not a plain SHA-256
        # prefix anyone who reads the log could match against guessed keys
        salt_file = tmp_path / "logs" / "api-key-id.salt"
        assert stat.S_IMODE(salt_file.stat().st_mode) == 0o600
        kid = hmac.new(salt_file.read_text().strip().encode(), b"k-after-rot", hashlib.sha256).hexdigest()[:8]
        router_log = (tmp_path / "logs" / "router.log").read_text()
        assert "API keys reloaded" in router_log and kid in router_log, router_log[-2000:]
        assert hashlib.sha256(b"k-after-rot").hexdigest()[:8] not in router_log
        keys.unlink()
        os.kill(info["pids"]["router"], signal.SIGKILL)
        read_until(proc, "restarted router", lines, timeout_s=60)
        deadline = time.monotonic() + 30
        while True:  # the restarted router listens on the same port, with the keys of the last SIGUSR1
            with contextlib.suppress(httpx.HTTPError):
                if code("k-after-rot") == 200:
                    break
            assert time.monotonic() < deadline, (tmp_path / "logs" / "router.log").read_text()[-2000:]
            time.sleep(0.2)
        assert code("k-before-rot") == 401
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, "".join(lines)[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not [p.name for p in (tmp_path / "logs").glob("*.log") if "k-after-rot" in p.read_text()]


_SIGINT_WHILE_WRITING = """
import os, signal, sys, time
import evolving_infra.report.write as w
from evolving_infra.cli import main
real = w.write_report
def write_report(*a, **k):  # Ctrl-C while the plots are drawn (seconds on the full sample)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1.0)
    return real(*a, **k)
w.write_report = write_report
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_after_the_cluster_stopped_still_interrupts_the_demo(tmp_path):
    """The demo's signal handlers only set its stop event, and stayed installed after the cluster had stopped: a
    Ctrl-C while the report and plots were written was swallowed (status 0, report written as if none came)."""
    env = _env(tmp_path)
    cmd = [sys.executable, "-c", _SIGINT_WHILE_WRITING, "demo", "--sessions", "2", "--concurrency", "2", "--speedup", "100",
           "--nodes", "1", "--out", str(tmp_path / "demo")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert p.returncode == 130, (p.returncode, (p.stdout + p.stderr)[-3000:])
    assert p.stderr.splitlines()[-1] == "evolving-infra demo: interrupted", p.stderr[-2000:]
    assert not (tmp_path / "demo" / "report.json").exists()


def test_up_whose_stdout_reader_went_stops_its_cluster_and_removes_its_nats_store(tmp_path):
    """``up | head -1``, then Ctrl-C: a line to the closed pipe raised BrokenPipeError (the CLI ends quietly, 141)
    past ``_up``'s finally, which removed the state file but did not stop the cluster: the services died with their parent, the
    nats-server's JetStream folder (/tmp/ei-nats-*) stayed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = _env(tmp_path, TMPDIR=str(tmp))
    cmd = _small_up(tmp_path, 1)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().startswith("cluster ready")  # type: ignore[union-attr]
        # the whole banner is read before the close: closed after its first line, the banner's next print could
        # fail first, up then stopped by itself and the SIGINT below met the exiting interpreter (-2, not 141)
        read_until(proc, "READY")
        proc.stdout.close()  # type: ignore[union-attr]
        time.sleep(0.5)  # 'stopping ...' is the next print, the first to meet the closed pipe
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 141, proc.stderr.read()[-2000:]  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(tmp.glob("ei-nats-*")) and not list((tmp_path / "state").glob("up-*.json"))


def test_up_whose_terminal_closed_stops_on_sighup_and_removes_its_nats_store(tmp_path):
    """The terminal closed, then SIGHUP: 'stopping ...' to the gone terminal raised OSError (EIO), and the cluster
    was never stopped (its /tmp/ei-nats-* store stayed), as with ``up | head``."""
    import pty

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = _env(tmp_path, TMPDIR=str(tmp))
    cmd = _small_up(tmp_path, 1)
    terminal, tty = pty.openpty()
    # the child starts with SIGHUP at its default whatever the runner's is: under nohup it is ignored, an ignored
    # SIGHUP is inherited, and `up` keeps running under nohup by design (tests/e2e/test_up_signals.py)
    proc = subprocess.Popen(cmd, stdout=tty, stderr=tty, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    os.close(tty)
    try:
        seen, deadline = b"", time.monotonic() + 120
        while b"READY " not in seen and time.monotonic() < deadline:
            seen += os.read(terminal, 4096)
        assert b"READY " in seen, seen[-2000:]
        os.close(terminal)
        time.sleep(0.3)
        proc.send_signal(signal.SIGHUP)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(tmp.glob("ei-nats-*")) and not list((tmp_path / "state").glob("up-*.json"))


def test_a_clean_stop_keeps_the_temp_logs_and_deletes_the_generated_credentials(tmp_path):
    """Without ``--log-dir`` up logs into a new ``$TMPDIR/ei-logs-*`` folder and generates every identity's NATS
    credentials into its ``nats-creds/`` (nkey seeds: secrets). A clean stop left all of it behind and said only
    'stopped'. Now the logs stay, the credentials go, and the last line says where the logs are. (And the banner
    of one node says '1 worker', not '1 workers'.)"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "1", "--profile", "tiny", "--port", "0", "--policy", "static"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path, TMPDIR=str(tmp)))
    lines: list[str] = []
    try:
        ready = read_ready(proc, lines)
        banner = next(line for line in lines if line.startswith("cluster ready"))
        assert "collocated; 1 worker, profile tiny" in banner, banner  # was '1 workers'
        logs = Path(ready["log_dir"])
        assert logs.parent == tmp and logs.name.startswith("ei-logs-") and list((logs / "nats-creds").glob("*.nk")), ready
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-2000:]
    assert out.splitlines()[-1] == f"stopped; logs in {logs} (its generated NATS credentials removed)", out[-2000:]
    assert not (logs / "nats-creds").exists() and not list(tmp.rglob("*.nk"))
    assert list(logs.glob("*.log")) and (logs / "cluster.json").exists()  # the logs stay
