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


def test_the_state_file_is_private_and_keeps_the_url_for_the_tools(tmp_path, monkeypatch):
    """It names the credential files and holds ``--nats-url`` whole (``split`` / ``tap`` connect with it, a
    password included): mode 0600 in a 0700 folder. It was written with the umask (0644, in a 0755 folder)."""
    import stat

    folder = tmp_path / "state"
    monkeypatch.setenv("EI_STATE_DIR", str(folder))
    url = "nats://ei:pw-secret@127.0.0.1:4222"
    old_umask = os.umask(0o022)
    try:
        path = write_state({"nats_url": url, "nats_admin_creds": "/x/admin.nk"})
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    path.chmod(0o644)  # a file left by an older version: narrowed on the next rewrite
    write_state({"nats_url": url})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    [info] = running_clusters()
    assert info["nats_url"] == url


def test_a_test_sessions_clusters_are_not_the_users(tmp_path_factory):
    """A test that starts ``up`` without its own ``EI_STATE_DIR`` (``tests/e2e/test_up.py``) wrote its state file into
    the user's folder, where the other lane of ``make test -n 2``, another checkout's test run and the user's
    ``split`` / ``replay`` counted it as a running cluster (tests/conftest.py gives each test process its own)."""
    from evolving_infra.state import state_dir

    assert state_dir().is_relative_to(tmp_path_factory.getbasetemp()), state_dir()
