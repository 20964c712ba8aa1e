"""``model init DIR``: the files it writes and the folder it writes them into.

Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import os
import stat

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from evolving_infra.cli import main  # noqa: E402

SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--vocab", "300"]


def test_every_file_follows_the_umask(tmp_path):
    """Under umask 022 every file is 0644. model.safetensors was 0600 (safetensors >= 0.8 writes a
    tempfile and renames it), so the compose containers' ``USER ei`` could not read the weights of a
    folder made by root or another user, while config.json and the tokenizer were readable."""
    old = os.umask(0o022)
    try:
        assert main(["model", "init", str(tmp_path / "m"), *SMALL]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o644), {k: oct(v) for k, v in modes.items()}


def test_a_non_empty_folder_is_refused_unless_force(tmp_path, capsys):
    """A folder holding another model was overwritten in place: config.json replaced and its shards kept
    beside the new model.safetensors (the engine loads every ``*.safetensors``: a mixed, broken model).
    Now refused with one line (exit 2, nothing written); ``--force`` removes the old weight files."""
    m = tmp_path / "m"
    m.mkdir()
    old = {
        "config.json": "{}",
        "model-00001-of-00002.safetensors": "old",
        "model-00002-of-00002.safetensors": "old",
        "model.safetensors.index.json": "{}",
        "notes.txt": "mine",
    }
    for name, text in old.items():
        (m / name).write_text(text)
    capsys.readouterr()
    assert main(["model", "init", str(m), *SMALL]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {m}: folder is not empty (") and "--force" in err[0], err
    assert {p.name: p.read_text() for p in m.iterdir()} == old  # nothing written or removed

    assert main(["model", "init", str(m), "--force", *SMALL]) == 0
    names = sorted(p.name for p in m.iterdir())
    assert names == sorted(["config.json", "generation_config.json", "model.safetensors", "notes.txt",
                            "tokenizer.json", "tokenizer_config.json"]), names
    assert (m / "notes.txt").read_text() == "mine" and (m / "config.json").read_text() != "{}"


def test_an_empty_existing_folder_is_written(tmp_path):
    (tmp_path / "m").mkdir()
    assert main(["model", "init", str(tmp_path / "m"), *SMALL]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
