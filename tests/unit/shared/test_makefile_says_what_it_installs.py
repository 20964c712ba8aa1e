"""``make demo`` and ``make test`` install with ``pip --quiet``: a newcomer's first command sat silent for the
minute of the project's install (35 s here from a local wheel mirror), and ``make test`` for the minutes of the torch
extra (1.5 min here for the CPU wheel; from PyPI on Linux several GB of CUDA build). Each install step now says
what it installs before it starts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(("target", "steps"), [("demo", ["the project"]), ("test", ["the project", "Mooncake", "hf extra", "torch extra"])])
def test_each_install_step_says_what_it_installs_first(target, steps, tmp_path):
    out = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    said = [line for line in out.splitlines() if line.startswith('echo "make: installing')]
    assert len(said) == len(steps), out
    for line, step in zip(said, steps):
        assert step in line, (step, line)
    assert "CUDA build" in said[-1] or target == "demo"
