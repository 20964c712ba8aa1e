"""``up --nats-url`` against a real nats-server whose permissions do not let the launcher's credentials create
the partition's JetStream stream. The server answers the create with an async ``-ERR 'Permissions Violation
for Publish to "$JS.API.STREAM.CREATE.EI_p0"'`` and leaves the request to time out; before, ``up`` took that
for a slow server and waited forever (a warning each minute). Now it exits 2 with one line naming the identity,
the subject refused and the fix, before any service starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.auth import generate
from shared.natsserver import EmbeddedNatsServer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_up_exits_2_naming_the_identity_and_subject_when_its_credentials_may_not_create_the_stream(tmp_path):
    names = ["planner", "kvdirectory", "router", "worker-w0"]
    creds = generate(tmp_path / "creds", names, partition="p0")
    create = ', "$JS.API.STREAM.CREATE.EI_p0"'
    assert creds.server_block.count(create) == 1  # only the launcher's grant
    with EmbeddedNatsServer(auth_block=creds.server_block.replace(create, "")) as srv:
        r = subprocess.run(
            [sys.executable, "-m", "evolving_infra.cli", "up", "--nats-url", srv.url, "--nats-creds-dir", str(tmp_path / "creds"),
             "--nodes", "1", "--split", "collocated", "--profile", "tiny", "--port", "0", "--log-dir", str(tmp_path / "logs")],
            cwd=REPO, capture_output=True, text=True, timeout=40,
            env={**os.environ, "EI_STATE_DIR": str(tmp_path / "state")},
        )  # fmt: skip
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r
    assert len(err) == 1 and err[0].startswith("error: "), r
    assert "identity 'launcher'" in err[0] and "$JS.API.STREAM.CREATE.EI_p0" in err[0] and "auth stream" in err[0], err
    assert not (tmp_path / "logs" / "router.log").exists() or not (tmp_path / "logs" / "router.log").stat().st_size
