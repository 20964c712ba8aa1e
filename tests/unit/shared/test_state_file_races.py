"""The cluster state file read while its launcher stops or rewrites it (``split``, ``tap``, ``replay`` find the
cluster through it; ``up`` rewrites it on each supervisor restart and removes it when it stops)."""

from __future__ import annotations

import os
from pathlib import Path

from evolving_infra.state import running_clusters, write_state


def test_a_state_file_removed_between_listing_and_reading_is_skipped(tmp_path, monkeypatch, capsys):
    """Another cluster's ``up`` stopping while ``split get`` lists the folder: the file was listed, then gone, and
    sorting by mtime raised FileNotFoundError (a traceback instead of this cluster's URL)."""
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path))
    mine = write_state({"nats_url": "nats://127.0.0.1:1"})
    gone = write_state({"nats_url": "nats://127.0.0.1:2"}, pid=os.getppid())
    listed = Path.glob

    def listing_then_stop(self: Path, pattern: str):  # type: ignore[no-untyped-def]
        found = list(listed(self, pattern))
        gone.unlink()  # its launcher stopped just after the listing
        return iter(found)

    monkeypatch.setattr(Path, "glob", listing_then_stop)
    [info] = running_clusters()
    assert info["state_file"] == str(mine) and "stale" not in capsys.readouterr().err  # not stale: stopped


def test_a_rewrite_leaves_one_file_and_no_temporary(tmp_path, monkeypatch):
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path))
    for restarts in range(3):
        path = write_state({"nats_url": "nats://127.0.0.1:1", "restarts": {"router": restarts}})
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert running_clusters()[0]["restarts"] == {"router": 2}
