"""Shared fixtures: a real nats-server per test that needs one (never a mock bus)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.natsserver import EmbeddedNatsServer

REPO = Path(__file__).resolve().parent.parent
SHARED_TRACES = REPO.parent / "shared" / "traces"


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNatsServer]:
    """A real nats-server with JetStream on a kernel-chosen loopback port."""
    with EmbeddedNatsServer() as srv:
        yield srv


@pytest.fixture
def nats_url(nats_server: EmbeddedNatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session", autouse=True)
def _session_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``EI_STATE_DIR`` (``evolving_infra.state``) is a folder of this test process for the whole session, and
    every process a test starts inherits it: an ``up`` / ``demo`` a test starts writes its state file there, and
    ``split`` / ``tap`` / ``replay`` look for clusters there. Before, tests that did not set it wrote into the
    user's folder (``$XDG_RUNTIME_DIR/evolving-infra`` or ``~/.local/state/evolving-infra``), where another test
    process (the other lane of ``make test -n 2``, another checkout's run) or the user's own ``up`` found them.
    A test that sets ``EI_STATE_DIR`` itself still wins."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EI_STATE_DIR", str(tmp_path_factory.mktemp("ei-state")))
        yield


def shared_traces_or_skip(*parts: str) -> Path:
    """Path under ../shared/traces, or skip the test when that folder is absent."""
    path = SHARED_TRACES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (the shared traces folder is outside the repo)")
    return path
