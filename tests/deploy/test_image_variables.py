"""The image variables of the compose stack: ``EI_IMAGE`` (renamed ``EI_IMAGE_REPO``) is refused, not ignored;
images carry the package version too; ``EI_TARGET`` and ``EI_ENGINE`` must agree.

``EI_IMAGE`` (``REPO:TAG``) became ``EI_IMAGE_REPO`` (the repository; the tag is ``EI_TARGET``), and a user who
still set ``EI_IMAGE`` got the default image without a word. Compose now passes it into the containers and the
auth job (which every service waits for) refuses to start the stack while it is set; the compose smoke, which
always runs its own image, says so and unsets it.

``deploy/docker/build.sh`` tags an image ``REPO:TARGET`` and ``REPO:VERSION-TARGET`` (a deployment pins the second;
before, images carried no version). The auth job refuses ``EI_ENGINE=torch`` on the sim image (it failed later,
in deploy-args, with pip's advice and a hint naming ``evolving-infra:torch`` whatever ``EI_IMAGE_REPO``) and
``EI_ENGINE=sim`` on the torch image (it served the sim engine without a word).

The entrypoint runs with ``/bin/sh`` and the shims of ``test_entrypoint_block_size._run``; the compose file is
resolved by ``docker-compose config``; the smoke runs on the shim engine of ``test_compose_smoke_runs_apart``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.deploy.test_compose_smoke_runs_apart import _smoke
from tests.deploy.test_deploy_policy import REPO, _env, needs_compose
from tests.deploy.test_entrypoint_block_size import _run
from tests.deploy.test_prometheus_config import resolved_services


def test_auth_refuses_ei_image_and_names_its_replacement(tmp_path: Path):
    r = _run(tmp_path, "auth", EI_IMAGE="registry.example:5000/ei:torch", EI_CREDS_DIR=str(tmp_path),
             EI_IMAGE_REPO="evolving-infra", EI_TARGET="sim")
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "clock_origin").exists(), (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert "EI_IMAGE=registry.example:5000/ei:torch is no longer read" in line, line
    assert "this stack runs evolving-infra:sim" in line and "set EI_IMAGE_REPO=registry.example:5000/ei " in line, line
    assert line.endswith("set EI_IMAGE_REPO=registry.example:5000/ei (its tag torch: EI_TARGET=sim or torch, the image's variant)"), line
    r = _run(tmp_path, "auth", EI_IMAGE="registry.example:5000/ei", EI_CREDS_DIR=str(tmp_path))  # no tag: no "(its tag ...)"
    assert r.returncode == 2 and r.stderr.strip().endswith("set EI_IMAGE_REPO=registry.example:5000/ei"), r.stderr
    r = _run(tmp_path, "auth", EI_IMAGE="", EI_CREDS_DIR=str(tmp_path))  # compose's value when it is not set
    assert r.returncode == 0 and "no longer read" not in r.stderr, (r.stdout, r.stderr)


@needs_compose
def test_compose_passes_ei_image_to_the_auth_job():
    auth = resolved_services(_env(EI_IMAGE="registry.example/ei:v1"))["auth"]
    assert re.search(r"^      EI_IMAGE: registry\.example/ei:v1$", auth, re.M), auth


def test_the_compose_smoke_says_ei_image_is_not_read_and_unsets_it(tmp_path: Path):
    smoke = _smoke(tmp_path, tmp_path / "roots", EI_IMAGE="registry.example/ei:v1")
    out = smoke.communicate(timeout=60)[0]
    assert "EI_IMAGE=registry.example/ei:v1 is no longer read (renamed EI_IMAGE_REPO" in out, out
    assert "its own image evolving-infra-smoke:sim" in out, out


def _version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _build(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    record = tmp_path / "docker-argv"
    docker = tmp_path / "docker"
    docker.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    docker.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("EI_", "BASE_IMAGE"))}
    r = subprocess.run([str(REPO / "deploy" / "docker" / "build.sh"), *args], env={**base, "DOCKER": str(docker), **env},
                       capture_output=True, text=True, timeout=30)
    return r, (record.read_text().splitlines() if record.exists() else [])


def test_build_sh_tags_the_target_and_the_package_version(tmp_path: Path):
    version = _version()
    r, argv = _build(tmp_path)
    assert r.returncode == 0, r.stderr
    tags = [argv[i + 1] for i, a in enumerate(argv) if a == "-t"]
    assert tags == ["evolving-infra:sim", f"evolving-infra:{version}-sim"], argv
    assert argv[argv.index("--target") + 1] == "sim" and argv[-1] == "." and "BASE_IMAGE" not in " ".join(argv), argv
    r, argv = _build(tmp_path, "torch", "-q", EI_IMAGE_REPO="registry.example/ei", BASE_IMAGE="ei-base:x")
    tags = [argv[i + 1] for i, a in enumerate(argv) if a == "-t"]
    assert tags == ["registry.example/ei:torch", f"registry.example/ei:{version}-torch"], argv
    assert argv[argv.index("--target") + 1] == "torch" and "BASE_IMAGE=ei-base:x" in argv and "-q" in argv, argv
    (tmp_path / "docker-argv").unlink()
    for args, env, said in ((("latest",), {}, "target latest: sim or torch"),
                            ((), {"EI_IMAGE": "ei:sim"}, "EI_IMAGE=ei:sim is no longer read")):
        r, argv = _build(tmp_path, *args, **env)
        assert r.returncode == 2 and argv == [] and said in r.stderr, (r.stderr, argv)


@needs_compose
def test_compose_passes_the_image_s_repo_and_target_to_the_auth_job():
    auth = resolved_services(_env(EI_TARGET="0.1.0-torch", EI_IMAGE_REPO="registry.example/ei"))["auth"]
    assert re.search(r"^      EI_TARGET: 0\.1\.0-torch$", auth, re.M), auth
    assert re.search(r"^      EI_IMAGE_REPO: registry\.example/ei$", auth, re.M), auth
    assert re.search(r"^    image: registry\.example/ei:0\.1\.0-torch$", auth, re.M), auth  # the pinned image


def _auth(tmp_path: Path, **env: str) -> str:
    r = _run(tmp_path, "auth", EI_CREDS_DIR=str(tmp_path), EI_IMAGE_REPO="registry.example/ei", **env)
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "clock_origin").exists(), (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1, line
    return line


def test_auth_refuses_an_engine_that_is_not_the_image_s_variant(tmp_path: Path):
    line = _auth(tmp_path, EI_TARGET="sim", EI_ENGINE="torch")
    assert "EI_ENGINE=torch but EI_TARGET=sim: the sim image (registry.example/ei:sim) has no torch engine" in line, line
    assert "EI_TARGET=torch (image registry.example/ei:torch)" in line, line
    line = _auth(tmp_path, EI_TARGET="0.1.0-sim", EI_ENGINE="torch")  # pinned: the same version's torch image
    assert "EI_TARGET=0.1.0-torch (image registry.example/ei:0.1.0-torch)" in line, line
    line = _auth(tmp_path, EI_TARGET="torch", EI_ENGINE="sim")
    assert "EI_TARGET=torch (the torch image, registry.example/ei:torch) but EI_ENGINE=sim" in line, line
    assert "set EI_ENGINE=torch and MODEL_DIR" in line and "or EI_TARGET=sim" in line, line


def test_a_torch_stack_on_an_image_without_torch_names_the_repo_s_torch_image(tmp_path: Path):
    """Without ``EI_TARGET`` (the image started without compose) the sim image shows as a failed ``import torch``;
    the hint named ``evolving-infra:torch`` whatever ``EI_IMAGE_REPO``."""
    fake = tmp_path / "no-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    model = tmp_path / "model"
    model.mkdir()
    r = _run(tmp_path, "auth", EI_ENGINE="torch", EI_MODEL_DIR=str(model), EI_CREDS_DIR=str(tmp_path),
             EI_IMAGE_REPO="registry.example/ei", PYTHONPATH=f"{fake.parent}{os.pathsep}{REPO}")
    assert r.returncode == 2 and "EI_TARGET=torch (image registry.example/ei:torch)" in r.stderr, r.stderr


def test_the_compose_smoke_refuses_a_torch_engine_before_it_starts_an_engine(tmp_path: Path):
    roots = tmp_path / "roots"
    smoke = _smoke(tmp_path, roots, EI_ENGINE="torch")
    out = smoke.communicate(timeout=60)[0]
    assert smoke.returncode == 2 and "EI_ENGINE=torch: this smoke builds and runs the sim image" in out, out
    assert not roots.exists(), out  # no dockerd started
