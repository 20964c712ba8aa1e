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


def shared_traces_or_skip(*parts: str) -> Path:
    """Path under ../shared/traces, or skip the test when that folder is absent."""
    path = SHARED_TRACES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (the shared traces folder is outside the repo)")
    return path
