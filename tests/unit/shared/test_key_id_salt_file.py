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
