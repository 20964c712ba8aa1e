"""``up`` keeps an earlier run's ``api-key-id.salt`` only when it is what ``up`` writes (a plain 0600 file of the
user's, one line of hex): :func:`evolving_infra.launcher.kept_key_id_salt`. The ``up`` path itself:
tests/e2e/test_up_key_id_salt_kept.py."""

from __future__ import annotations

import os

import pytest

from evolving_infra.launcher import KEY_ID_SALT_FILE, kept_key_id_salt
from shared.auth import write_private

SALT = "0123456789abcdef0123456789abcdef"


def test_a_file_as_up_writes_it_is_kept_and_none_is_none(tmp_path):
    path = tmp_path / KEY_ID_SALT_FILE
    assert kept_key_id_salt(path) == (None, None)
    write_private(path, (SALT + "\n").encode())
    assert kept_key_id_salt(path) == (SALT, None)
    path.chmod(0o400)  # narrower: still the user's alone
    assert kept_key_id_salt(path) == (SALT, None)


@pytest.mark.parametrize(("content", "mode", "why"), [
    (SALT + "\n", 0o640, "is open to others (mode 640, not 600)"),
    ("", 0o600, "does not hold a salt"),
    ("not-hex-not-hex-not-hex-not-hex!\n", 0o600, "does not hold a salt"),
    (SALT + "\n" + SALT + "\n", 0o600, "does not hold a salt"),
    (SALT[:16] + "\n", 0o600, "does not hold a salt"),
])
def test_a_file_that_is_not_up_s_is_not_kept_and_says_why(tmp_path, content, mode, why):
    path = tmp_path / KEY_ID_SALT_FILE
    write_private(path, content.encode())
    path.chmod(mode)
    salt, said = kept_key_id_salt(path)
    assert salt is None and said is not None and said.startswith(why), said


def test_a_symlink_or_a_folder_is_not_kept(tmp_path):
    target = tmp_path / "elsewhere"
    write_private(target, (SALT + "\n").encode())
    link = tmp_path / KEY_ID_SALT_FILE
    os.symlink(target, link)
    assert kept_key_id_salt(link) == (None, "is a symlink")
    link.unlink()
    link.mkdir()
    assert kept_key_id_salt(link) == (None, "is not a plain file")


def test_a_second_rejection_keeps_the_first_rejected_salt(tmp_path):
    """Each rejected salt maps the log lines of the runs that used it: the second rejection moved its file over the
    first one's api-key-id.salt.invalid (os.replace; reviewer rr-out). Now .invalid, then .invalid.1, ..."""
    from evolving_infra.launcher import write_key_id_salt

    path = tmp_path / KEY_ID_SALT_FILE
    olds = [f"{n:032x}" for n in (1, 2, 3)]
    for n, old in enumerate(olds):
        write_private(path, (old + "\n").encode())
        path.chmod(0o644)
        salt, why = kept_key_id_salt(path)
        assert salt is None and why is not None
        said = write_key_id_salt(path, SALT, why)
        aside = KEY_ID_SALT_FILE + ".invalid" + (f".{n}" if n else "")
        assert len(said) == 1 and f"(the old file is {aside})" in said[0], said
    assert [(tmp_path / (KEY_ID_SALT_FILE + s)).read_text() for s in (".invalid", ".invalid.1", ".invalid.2")] == \
        [o + "\n" for o in olds]
    assert kept_key_id_salt(path) == (SALT, None)


def test_the_probe_gives_what_a_file_made_here_gets_and_leaves_nothing(tmp_path):
    from evolving_infra.launcher import _own_file_here

    assert _own_file_here(tmp_path) == (os.geteuid(), 0o600)
    assert list(tmp_path.iterdir()) == []
    assert _own_file_here(tmp_path / "missing") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_root_squash_a_salt_owned_as_this_process_s_files_are_there_is_kept(tmp_path, monkeypatch):
    """NFS with root_squash: a root up's files are nobody's (65534), so 'the user's own' (st_uid == euid) rejected
    the salt at every run (reviewer rr-out). The owner compared is the one a file made there gets (the probe: here
    faked, as this box has no such export); a file of a third uid is still refused, naming both."""
    import evolving_infra.launcher as launcher

    path = tmp_path / KEY_ID_SALT_FILE
    write_private(path, (SALT + "\n").encode())
    os.chown(path, 65534, 65534)
    assert kept_key_id_salt(path) == (None, "is another user's (uid 65534, not 0)")  # an ordinary file system
    monkeypatch.setattr(launcher, "_own_file_here", lambda folder: (65534, 0o600))
    assert kept_key_id_salt(path) == (SALT, None)
    os.chown(path, 4242, 4242)
    assert kept_key_id_salt(path) == (None, "is another user's (uid 4242, not 0 nor 65534, the owner this process's "
                                            "files get there)")


def test_a_file_system_that_keeps_no_mode_keeps_the_salt(tmp_path, monkeypatch):
    """vfat/SMB mounts give every file the mount's mode (a 0600 file is 755): 'open to others' rejected the salt at
    every run, the new one as open. The mode compared is the one a 0600 file made there gets (faked probe)."""
    import evolving_infra.launcher as launcher

    path = tmp_path / KEY_ID_SALT_FILE
    write_private(path, (SALT + "\n").encode())
    path.chmod(0o755)
    assert kept_key_id_salt(path) == (None, "is open to others (mode 755, not 600)")  # an ordinary file system
    monkeypatch.setattr(launcher, "_own_file_here", lambda folder: (os.geteuid(), 0o755))
    assert kept_key_id_salt(path) == (SALT, None)
    path.chmod(0o777)
    assert kept_key_id_salt(path) == (None, "is open to others (mode 777, not 600 nor 755, the mode a 600 file gets "
                                            "there)")


@pytest.mark.parametrize("refuses", [False, True], ids=["mode-ignored", "chmod-refused"])
def test_a_salt_whose_mode_cannot_be_600_is_written_with_one_warning_naming_it(tmp_path, monkeypatch, capsys, refuses):
    """A file system without POSIX modes (vfat/SMB: every file gets the mount's mode, here 644), or a server that
    refuses the chmod (and made the file 644): the salt is still written (the routers' key ids need it) and kept at
    the next up, but it is readable by others there, which was said nowhere. One warning line names the path and
    its mode; the ``up``-like path of :func:`key_id_salt_main` prints it, the salt alone on stdout. On an ordinary
    file system no such line."""
    from evolving_infra.launcher import key_id_salt_main, write_key_id_salt

    path = tmp_path / KEY_ID_SALT_FILE
    assert write_key_id_salt(path, SALT, None) == []
    assert kept_key_id_salt(path) == (SALT, None)
    path.unlink()
    real = os.fchmod

    def mount_mode(fd: int, mode: int) -> None:  # the mount's mode whatever is asked, or a refusal after it
        real(fd, 0o644)
        if refuses:
            raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", mount_mode)
    said = write_key_id_salt(path, SALT, None)
    assert len(said) == 1 and said[0].startswith(f"warning: {path}: its mode cannot be set to 600 on this file system "
                                                 "(it is 644"), said
    assert "readable by others" in said[0]
    assert path.read_text() == SALT + "\n"
    assert kept_key_id_salt(path) == (SALT, None)  # what a 600 file gets there: kept (the probe), not rejected
    path.unlink()
    assert key_id_salt_main([str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == path.read_text() and len(out.strip()) == 32
    assert err.count("warning:") == 1 and f"warning: {path}: its mode cannot be set to 600" in err, err
