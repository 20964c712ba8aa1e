"""Two ``deploy/docker/compose-smoke.sh`` runs at once do not share a Docker data root.

Every run started its private ``dockerd`` on one fixed data root (``$EI_CACHE/docker-data``, kept for its
cached image layers): a second run while one was going put a second engine on the same root, which one
engine at a time may use. Now the run that holds the shared root holds a lock on it (through its dockerd);
a run that finds it held takes a data root of its own in its mktemp folder, removed at exit.

No Docker here: ``dockerd`` and the ``docker`` client are shims on PATH (``EI_SMOKE_DOCKER``). The shim
dockerd records its ``--data-root`` and, for the first run, stays up (holding what the real one holds)
until the test lets it go; the shim client answers ``version`` and fails the next command, which ends the
script right after the engine started (before the image import), so each run takes well under a second.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "deploy" / "docker" / "compose-smoke.sh"

FAKE_DOCKERD = """#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = --data-root ] && echo "$2" >> "$FAKE_ROOTS"; shift; done
if [ -n "${FAKE_HOLD:-}" ]; then
    i=0; while [ ! -e "$FAKE_HOLD" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done
fi
touch "$FAKE_ROOTS.exited"
"""
FAKE_DOCKER = """#!/bin/sh
[ "$1" = version ] && exit 0
exit 1
"""


def _smoke(tmp: Path, roots: Path, **env: str) -> subprocess.Popen[str]:
    bin_ = tmp / "bin"
    if not bin_.is_dir():
        bin_.mkdir()
        for name, text in (("dockerd", FAKE_DOCKERD), ("docker", FAKE_DOCKER)):
            (bin_ / name).write_text(text)
            (bin_ / name).chmod(0o755 | stat.S_IXUSR)
        (tmp / "cache").mkdir()
        (tmp / "cache" / "debian-bookworm-python3.tar").write_bytes(b"not empty")  # no debootstrap
    full = {k: v for k, v in os.environ.items() if not k.startswith(("EI_", "DOCKER"))}
    full.update(PATH=f"{bin_}:{os.environ['PATH']}", PY=sys.executable, EI_CACHE=str(tmp / "cache"),
                EI_SMOKE_DOCKER=str(bin_ / "docker"), ROUTER_PORT="1", FAKE_ROOTS=str(roots), **env)
    return subprocess.Popen(["bash", str(SMOKE)], cwd=REPO, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


def test_a_second_smoke_run_takes_its_own_data_root_and_removes_it(tmp_path: Path):
    shared = tmp_path / "cache" / "docker-data"
    release = tmp_path / "release"
    first_roots, second_roots, third_roots = (tmp_path / f"roots-{n}" for n in ("first", "second", "third"))
    try:
        first = _smoke(tmp_path, first_roots, FAKE_HOLD=str(release))
        out_first = first.communicate(timeout=60)[0]  # the script ends at the shim's failed import; its dockerd stays
        _wait_for(first_roots)
        assert first_roots.read_text().split() == [str(shared)], out_first

        second = _smoke(tmp_path, second_roots)
        out = second.communicate(timeout=60)[0]
        (own,) = second_roots.read_text().split()
        assert Path(own) != shared and Path(own).name == "data" and Path(own).parent.name.startswith("ei-docker."), out
        assert "in use by another run" in out, out
        assert not Path(own).parent.exists(), f"{own}: left after the run"
    finally:
        release.touch()
    _wait_for(Path(f"{first_roots}.exited"))  # the first run's engine has stopped: the shared root is free again
    third = _smoke(tmp_path, third_roots)
    out = third.communicate(timeout=60)[0]
    assert third_roots.read_text().split() == [str(shared)], out
