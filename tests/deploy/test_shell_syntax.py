"""Every shell script in ``deploy/`` and ``scripts/`` parses: ``bash -n`` for all of them, and ``sh -n`` (and
``dash -n`` where dash is installed) for those whose shebang is a POSIX ``sh``.

``deploy/docker/entrypoint.sh`` (``#!/bin/sh``: dash in the image) failed ``bash -n`` ("unexpected EOF while
looking for matching ``"``"): a ``'`` inside a double-quoted ``${tag:+...}`` is a literal to dash and POSIX
mode but opens a single quote to bash, so running it with ``bash`` (``bash entrypoint.sh``, an image whose
``/bin/sh`` is bash outside POSIX mode, a linter) broke on the whole file. A script with a bash shebang uses
bash's syntax (arrays, ``[[``, ``<(...)``) on purpose and is not held to ``sh -n``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _shebang(path: Path) -> str:
    with path.open("rb") as f:
        first = f.readline(200)
    return first.decode("latin-1").strip() if first.startswith(b"#!") else ""


def _is_posix_sh(shebang: str) -> bool:
    """``#!/bin/sh``, ``#!/usr/bin/env sh``, ``#!/bin/dash`` (options after the interpreter allowed)."""
    words = shebang[2:].split()
    if words and Path(words[0]).name == "env":
        words = words[1:]
    return bool(words) and Path(words[0]).name in ("sh", "dash")


def shell_scripts() -> list[Path]:
    """Files under ``deploy/`` and ``scripts/`` named ``*.sh`` / ``*.sbatch`` or with a sh / bash / dash shebang."""
    found = []
    for top in ("deploy", "scripts"):
        for path in sorted((REPO / top).rglob("*")):
            if not path.is_file():
                continue
            shebang = _shebang(path)
            words = shebang[2:].split()
            interpreters = {Path(w).name for w in words[:2]}
            if path.suffix in (".sh", ".sbatch") or interpreters & {"sh", "bash", "dash"}:
                found.append(path)
    return found


SCRIPTS = shell_scripts()


def test_the_scripts_are_found():
    names = {p.relative_to(REPO).as_posix() for p in SCRIPTS}
    assert {"deploy/docker/entrypoint.sh", "deploy/slurm/evolving-infra.sbatch", "scripts/install-mooncake.sh"} <= names, names
    assert _is_posix_sh("#!/bin/sh") and _is_posix_sh("#!/usr/bin/env sh") and _is_posix_sh("#!/bin/sh -eu")
    assert not _is_posix_sh("#!/usr/bin/env bash") and not _is_posix_sh("#!/bin/bash")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_a_shell_script_parses_with_bash_and_a_posix_one_with_sh_too(script: Path):
    shebang = _shebang(script)
    posix = _is_posix_sh(shebang) or (not shebang and script.suffix == ".sh")
    for shell in ("bash", "sh", "dash") if posix else ("bash",):
        exe = shutil.which(shell)
        if exe is None:
            if shell == "dash":  # sh is dash on Debian (and in the image); elsewhere dash is an extra
                continue
            pytest.skip(f"{shell} is not installed")
        r = subprocess.run([exe, "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{shell} -n {script.relative_to(REPO)}: {r.stderr.strip()}"
