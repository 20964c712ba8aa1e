"""The Docker build context (``docker build .``, ``docker compose build``) leaves out what the image never
copies: the checkout's ``.venv`` (467 MB after ``make demo``), ``.git``, run outputs. Without a
``.dockerignore`` a newcomer's ``docker-compose build`` began with "Sending build context to Docker daemon
586.8MB" (measured on a fresh clone after ``make demo``). Nothing the Dockerfile COPYs may be left out.
No docker needed: both files are read as text; the matching is Docker's for these patterns (a pattern
matches a path or any folder above it; ``**/`` any depth).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def patterns() -> list[str]:
    path = REPO / ".dockerignore"
    assert path.is_file(), "no .dockerignore: the whole checkout (.venv included) is the build context"
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def excluded(path: str, pats: list[str]) -> bool:
    """Whether Docker leaves ``path`` (relative, '/'-separated) out of the context."""
    assert not any(p.startswith("!") for p in pats), "exceptions (!) are not modelled here"
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for p in pats:
        for pre in prefixes:
            if fnmatch.fnmatchcase(pre, p) or (p.startswith("**/") and fnmatch.fnmatchcase(pre.split("/")[-1], p[3:])):
                return True
    return False


def copied_sources() -> list[str]:
    """The sources of every COPY of the Dockerfile (not COPY --from)."""
    out: list[str] = []
    for line in (REPO / "deploy/docker/Dockerfile").read_text().splitlines():
        if m := re.match(r"^COPY\s+(?!--from)(.+)$", line.strip()):
            out += m.group(1).split()[:-1]
    return out


def test_the_build_context_leaves_out_the_venv_git_and_run_outputs():
    pats = patterns()
    for path in [".venv/lib/python3.11/site-packages/torch/__init__.py", ".git/objects/pack/x.pack", "demo-out/report.json",
                 "demo-out-static/logs/nats-creds/admin.nk", "simulate-out/report.json",
                 "replay-out/requests.jsonl", "fidelity-out/live/report.json", "compare-out/compare.json", "runs/replay/requests.jsonl", "evolving_infra.egg-info/PKG-INFO",
                 "services/router/__pycache__/app.cpython-311.pyc", "build/lib/shared/messages.py",
                 "evolving-infra-4242.out"]:  # the Slurm job's output, where README's sbatch runs it (the checkout)
        assert excluded(path, pats), path


def test_nothing_the_dockerfile_copies_is_left_out():
    sources = copied_sources()
    assert {"pyproject.toml", "shared", "services", "evolving_infra", "deploy/docker/wheelhouse/"} <= set(sources), sources
    pats = patterns()
    for src in sources:
        assert not excluded(src, pats), src
    # what pip install needs inside them (package data included)
    for path in ["evolving_infra/data/claude-code-sample.jsonl.gz", "shared/profiles/gb300-glm52.toml",
                 "deploy/docker/wheelhouse/evolving_infra-0-py3-none-any.whl", "deploy/docker/entrypoint.sh"]:
        assert not excluded(path, pats), path


def test_git_leaves_out_every_folder_the_demo_and_its_printed_baseline_write():
    """``make demo`` ends with the baseline command to run next, which writes ``demo-out-static/`` and
    ``demo-out-compare/``; on a fresh clone both showed in ``git status`` (only ``/demo-out/`` was ignored)."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["demo-out/report.json", "demo-out-static/logs/nats-creds/admin.nk", "demo-out-compare/compare.json",
             "simulate-out/report.json", "replay-out/requests.jsonl", "fidelity-out/live/report.json",
             "compare-out/compare.json", "runs/replay/requests.jsonl",
             # README's `sbatch ... deploy/slurm/evolving-infra.sbatch`, run in the checkout, writes its output there
             # (#SBATCH --output=evolving-infra-%j.out); it showed in `git status` after the first job
             "evolving-infra-4242.out"]
    out = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True)
    assert sorted(out.stdout.split()) == sorted(paths), out.stdout + out.stderr
