"""The embedded nats-server runs with a soft cap on its Go heap (``GOMEMLIMIT``). Without one its resident memory
grew without levelling off under steady load while its stream stayed at its 192-MiB cap: 19 → 956 → 1,671 MiB at
0 / 120 / 300 s of a 16-session replay through ``up`` (bench/RESULTS.md, "Third fault walk"); 384MiB held it at
375 MiB. An operator's own ``GOMEMLIMIT`` is kept."""

from __future__ import annotations

from pathlib import Path

from shared.natsserver import EmbeddedNatsServer


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def test_the_embedded_server_runs_with_a_go_memory_limit(monkeypatch):
    monkeypatch.delenv("GOMEMLIMIT", raising=False)
    with EmbeddedNatsServer() as srv:
        assert srv.proc is not None
        assert _environ(srv.proc.pid).get("GOMEMLIMIT") == "512MiB"


def test_an_operators_gomemlimit_is_kept(monkeypatch):
    monkeypatch.setenv("GOMEMLIMIT", "2GiB")
    with EmbeddedNatsServer() as srv:
        assert srv.proc is not None
        assert _environ(srv.proc.pid).get("GOMEMLIMIT") == "2GiB"
