"""The image variables of the compose stack: ``EI_IMAGE`` (renamed ``EI_IMAGE_REPO``) is refused, not ignored.

``EI_IMAGE`` (``REPO:TAG``) became ``EI_IMAGE_REPO`` (the repository; the tag is ``EI_TARGET``), and a user who
still set ``EI_IMAGE`` got the default image without a word. Compose now passes it into the containers and the
auth job (which every service waits for) refuses to start the stack while it is set; the compose smoke, which
always runs its own image, says so and unsets it.

The entrypoint runs with ``/bin/sh`` and the shims of ``test_entrypoint_block_size._run``; the compose file is
resolved by ``docker-compose config``; the smoke runs on the shim engine of ``test_compose_smoke_runs_apart``.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.deploy.test_compose_smoke_runs_apart import _smoke
from tests.deploy.test_deploy_policy import _env, needs_compose
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
    assert "its tag torch" in line, line
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
