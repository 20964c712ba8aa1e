"""The compose stack's routers get one API key id salt per stack (reviewer rr-sec2): without ``EI_API_KEY_ID_SALT``
each router made a random one at each start, so the key ids in its log differed per router and restart and could not
be mapped to keys. The auth job writes ``api-key-id.salt`` (0600) once per credentials volume and copies it to the
router's volume only; the router's entrypoint passes it in the environment.

Runs ``deploy/docker/entrypoint.sh`` with ``/bin/sh`` (no docker), as ``test_entrypoint_block_size``."""

from __future__ import annotations

import stat
from pathlib import Path

from tests.deploy.test_entrypoint_block_size import _run


def _env_of(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_the_auth_job_makes_one_salt_per_volume_and_only_the_router_gets_it(tmp_path):
    creds, out = tmp_path / "creds", tmp_path / "creds-out"
    for d in (creds, *(out / who for who in ("router", "planner", "kvdirectory", "launcher", "workers"))):
        d.mkdir(parents=True)
    vols = {"EI_CREDS_DIR": str(creds), "EI_CREDS_OUT": str(out)}
    r = _run(tmp_path, "auth", **vols)
    assert r.returncode == 0, r.stderr
    salt_file = creds / "api-key-id.salt"
    salt = salt_file.read_text().strip()
    assert len(salt) == 32 and int(salt, 16) >= 0
    assert stat.S_IMODE(salt_file.stat().st_mode) == 0o600
    copy = out / "router" / "api-key-id.salt"
    assert copy.read_text().strip() == salt and stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert sorted(p.parent.name for p in out.glob("*/api-key-id.salt")) == ["router"]
    assert _run(tmp_path, "auth", **vols).returncode == 0  # the next `compose up`: the volume's salt stays
    assert salt_file.read_text().strip() == salt == copy.read_text().strip()

    env_out, args_out = tmp_path / "router.env", tmp_path / "router.args"
    r = _run(tmp_path, "router", EI_CREDS_DIR=str(out / "router"), ENV_OUT=str(env_out), ARGS_OUT=str(args_out))
    assert r.returncode == 0, r.stderr
    assert _env_of(env_out)["EI_API_KEY_ID_SALT"] == salt
    assert salt not in args_out.read_text()  # in the environment, never in argv
    r = _run(tmp_path, "router", EI_CREDS_DIR=str(out / "router"), ENV_OUT=str(env_out), EI_API_KEY_ID_SALT="mine")
    assert r.returncode == 0 and _env_of(env_out)["EI_API_KEY_ID_SALT"] == "mine", r.stderr  # one given wins
    r = _run(tmp_path, "planner", EI_CREDS_DIR=str(out / "router"), ENV_OUT=str(env_out))
    assert r.returncode == 0 and "EI_API_KEY_ID_SALT" not in _env_of(env_out), r.stderr  # the router's only
