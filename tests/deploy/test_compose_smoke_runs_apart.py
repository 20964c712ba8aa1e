"""Two ``deploy/docker/compose-smoke.sh`` runs at once do not share a Docker data root.

Every run started its private ``dockerd`` on one fixed data root (``$EI_CACHE/docker-data``, kept for its
cached image layers): a second run while one was going put a second engine on the same root, which one
engine at a time may use. Now the run that holds the shared root holds a lock on it (through its dockerd);
a run that finds it held takes a data root of its own in its mktemp folder, removed at exit.

No Docker here: ``dockerd`` and the ``docker`` client are shims on PATH (``EI_SMOKE_DOCKER``). The shim
dockerd records its ``--data-root`` and, for the first run, stays up (holding what the real one holds)
until the test lets it go; the shim client answers ``version`` and fails the next command, which ends the
script right after the engine started (before the image import), so each run takes well under a second.

A run killed outright (SIGKILL, no cleanup) left its dockerd holding the shared root's lock, so every later
run built from scratch on a root of its own: a later run now finds that run gone and stops its engine. The
cleanup stopped the engine only once its socket had appeared: one that never made it kept running (and held the
lock). Two runs from one checkout wrote the build context's deploy/docker/wheelhouse at once: now one at a time.
"""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "deploy" / "docker" / "compose-smoke.sh"

FAKE_DOCKERD = """#!/bin/sh
trap 'touch "$FAKE_ROOTS.exited"; exit 0' TERM
while [ $# -gt 0 ]; do
    [ "$1" = --data-root ] && echo "$2" >> "$FAKE_ROOTS"
    [ "$1" = --exec-root ] && echo "$2" >> "$FAKE_ROOTS.exec" && exec_root=$2
    [ "$1" = -H ] && sock=${2#unix://}
    shift
done
[ -n "${FAKE_NO_SOCKET:-}" ] || touch "$sock"  # the client's `version` answers once it is there
if [ -n "${FAKE_SHIM:-}" ]; then  # a containerd shim: its own session, its argv naming the run's folder, a container
    setsid sh -c 'sleep 30 9>&- & echo $! > "$FAKE_ROOTS.container"; wait' "$exec_root/containerd/containerd.sock" &
fi
if [ -n "${FAKE_HOLD:-}" ]; then
    i=0; while [ ! -e "$FAKE_HOLD" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done
fi
touch "$FAKE_ROOTS.exited"
"""
# version: the engine is up once the fake engine made its "socket" (a file); anything else fails (FAKE_CLIENT_HOLD: once that file is
# there, the run meanwhile alive) or, with FAKE_ALL_OK, succeeds
FAKE_DOCKER = """#!/bin/sh
[ "$1" = version ] && { [ -e "${DOCKER_HOST#unix://}" ] && exit 0; exit 1; }
[ -n "${FAKE_ALL_OK:-}" ] && exit 0
if [ -n "${FAKE_CLIENT_HOLD:-}" ]; then
    i=0; while [ ! -e "$FAKE_CLIENT_HOLD" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done
fi
exit 1
"""
FAKE_COMPOSE = "#!/bin/sh\nexit 1\n"


def _smoke(tmp: Path, roots: Path, session: bool = False, **env: str) -> subprocess.Popen[str]:
    bin_ = tmp / "bin"
    if not bin_.is_dir():
        bin_.mkdir()
        for name, text in (("dockerd", FAKE_DOCKERD), ("docker", FAKE_DOCKER), ("docker-compose", FAKE_COMPOSE)):
            (bin_ / name).write_text(text)
            (bin_ / name).chmod(0o755 | stat.S_IXUSR)
        (tmp / "cache").mkdir()
        (tmp / "cache" / "debian-bookworm-python3.tar").write_bytes(b"not empty")  # no debootstrap
    full = {k: v for k, v in os.environ.items() if not k.startswith(("EI_", "DOCKER"))}
    full.update(PATH=f"{bin_}:{os.environ['PATH']}", PY=sys.executable, EI_CACHE=str(tmp / "cache"),
                EI_SMOKE_DOCKER=str(bin_ / "docker"), ROUTER_PORT="1", FAKE_ROOTS=str(roots))
    full.update(env)
    return subprocess.Popen(["bash", str(SMOKE)], cwd=REPO, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=session)


def _wait_for(path: Path, timeout_s: float = 10.0) -> None:
    """Until ``path`` has something in it (the fakes write a line, or touch an empty ``.exited``)."""
    end = time.monotonic() + timeout_s
    while not (path.exists() and (path.stat().st_size > 0 or path.suffix == ".exited")):
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


def test_a_second_smoke_run_takes_its_own_data_root_and_removes_it(tmp_path: Path):
    shared = tmp_path / "cache" / "docker-data"
    release = tmp_path / "release"
    first_roots, second_roots, third_roots = (tmp_path / f"roots-{n}" for n in ("first", "second", "third"))
    try:  # the first run stays alive (its client waits for `release`), its engine on the shared root
        first = _smoke(tmp_path, first_roots, FAKE_HOLD=str(release), FAKE_CLIENT_HOLD=str(release))
        _wait_for(first_roots)
        assert first_roots.read_text().split() == [str(shared)]

        second = _smoke(tmp_path, second_roots)
        out = second.communicate(timeout=60)[0]
        (own,) = second_roots.read_text().split()
        assert Path(own) != shared and Path(own).name == "data" and Path(own).parent.name.startswith("ei-docker."), out
        assert "in use by another run" in out, out
        assert not Path(own).parent.exists(), f"{own}: left after the run"
    finally:
        release.touch()
    first.communicate(timeout=60)
    _wait_for(Path(f"{first_roots}.exited"))  # the first run's engine has stopped: the shared root is free again
    third = _smoke(tmp_path, third_roots)
    out = third.communicate(timeout=60)[0]
    assert third_roots.read_text().split() == [str(shared)], out


def test_a_killed_run_s_engine_is_stopped_and_its_data_root_lock_taken_back(tmp_path: Path):
    shared = tmp_path / "cache" / "docker-data"
    release = tmp_path / "release"
    first_roots, second_roots = tmp_path / "roots-first", tmp_path / "roots-second"
    try:
        first = _smoke(tmp_path, first_roots, FAKE_HOLD=str(release), FAKE_CLIENT_HOLD=str(release))
        _wait_for(Path(f"{first_roots}.exec"))
        first_dir = str(Path(Path(f"{first_roots}.exec").read_text().strip()).parent)  # the run's mktemp folder
        first.kill()  # SIGKILL: no cleanup; its dockerd keeps the lock
        first.wait(timeout=10)
        assert not Path(f"{first_roots}.exited").exists() and Path(first_dir).is_dir()

        second = _smoke(tmp_path, second_roots)
        out = second.communicate(timeout=90)[0]
        assert second_roots.exists(), out  # its engine started
        assert second_roots.read_text().split() == [str(shared)], out  # the shared root, not one of its own
        assert f"of a run that is gone (pid {first.pid}, {first_dir}): stopping it" in out, out
        assert Path(f"{first_roots}.exited").exists(), out  # that engine was stopped (TERM)
        assert not Path(first_dir).exists(), out
    finally:
        release.touch()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_what_is_left_of_a_run_killed_with_its_process_group_is_killed_by_the_next_run(tmp_path: Path):
    """kill -9 -PGID (a cancelled job) ends dockerd and containerd too, but not the containerd shims (their own
    session), which hold the lock and keep their containers running: the next run kills them and their children."""
    shared = tmp_path / "cache" / "docker-data"
    release = tmp_path / "release"
    first_roots, second_roots = tmp_path / "roots-first", tmp_path / "roots-second"
    try:
        first = _smoke(tmp_path, first_roots, session=True, FAKE_HOLD=str(release), FAKE_CLIENT_HOLD=str(release),
                       FAKE_SHIM="1")
        _wait_for(Path(f"{first_roots}.container"))
        _wait_for(Path(f"{first_roots}.exec"))
        first_dir = str(Path(Path(f"{first_roots}.exec").read_text().strip()).parent)
        container = int(Path(f"{first_roots}.container").read_text())
        os.killpg(first.pid, 9)
        first.wait(timeout=10)

        second = _smoke(tmp_path, second_roots)
        out = second.communicate(timeout=90)[0]
        assert second_roots.exists(), out
        assert second_roots.read_text().split() == [str(shared)], out
        assert f"held by what is left of the engine of a run that is gone (pid {first.pid}, {first_dir})" in out, out
        assert _gone(container) and not Path(first_dir).exists(), out
    finally:
        release.touch()


def test_cleanup_stops_an_engine_whose_socket_never_appeared(tmp_path: Path):
    release = tmp_path / "release"
    roots = tmp_path / "roots"
    try:
        run = _smoke(tmp_path, roots, FAKE_HOLD=str(release), FAKE_NO_SOCKET="1", EI_SMOKE_DOCKERD_WAIT_S="1")
        out = run.communicate(timeout=60)[0]
        assert Path(f"{roots}.exited").exists(), out  # stopped by the cleanup, not left running
        assert run.returncode == 1 and "no engine socket within 1 s" in out, out
        with open(tmp_path / "cache" / "docker-data.lock", "a") as lock:  # and the shared root is free
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        release.touch()


def test_two_runs_from_one_checkout_write_its_wheelhouse_one_at_a_time(tmp_path: Path):
    """Up to the image build with a ``python`` whose ``pip wheel`` takes 1 s and logs its start and end, and a
    client that succeeds (then docker-compose, a shim, fails)."""
    log = tmp_path / "wheel-log"
    py = tmp_path / "python"
    py.write_text('#!/bin/sh\n'
                  'if [ "$1 $2 $3" = "-m pip wheel" ]; then echo "start $PPID" >> "$FAKE_WHEEL_LOG"; sleep 1; '
                  'echo "end $PPID" >> "$FAKE_WHEEL_LOG"; exit 0; fi\n'
                  '[ "$1 $2" = "-m pip" ] && exit 0\n'
                  f'exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    env = dict(PY=str(py), FAKE_ALL_OK="1", FAKE_WHEEL_LOG=str(log))
    runs = [_smoke(tmp_path, tmp_path / f"roots-{i}", **env) for i in (1, 2)]
    outs = [r.communicate(timeout=60)[0] for r in runs]
    events = log.read_text().split()
    assert [e for e in events[::2]] == ["start", "end", "start", "end"], (events, outs)
    assert events[1] == events[3] and events[5] == events[7] and events[1] != events[5], (events, outs)


def test_the_smoke_says_when_replay_runs_another_checkout_s_code(tmp_path: Path):
    """A venv installed editable from another checkout runs that checkout's replay unless PYTHONPATH points at
    this one: the smoke named no checkout, and a run of one's own changes tested another's code."""
    other = tmp_path / "other-checkout"
    (other / "evolving_infra").mkdir(parents=True)
    (other / "evolving_infra" / "__init__.py").write_text("")
    out = _smoke(tmp_path, tmp_path / "roots-other", PYTHONPATH=str(other)).communicate(timeout=60)[0]
    assert f"replay runs the code in {other.resolve()} (what {sys.executable} imports), not this checkout's" in out, out
    assert f"PYTHONPATH={REPO} runs this one's" in out, out
    out = _smoke(tmp_path, tmp_path / "roots-this", PYTHONPATH=str(REPO)).communicate(timeout=60)[0]
    assert "replay runs the code in" not in out, out
