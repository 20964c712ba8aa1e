"""``model init``'s tokenizer is trained on a fixed corpus that ships with the package.

It was trained on the repository's README and docs, so any doc edit changed the tiny model's
tokenizer (every token id tests and users see) and an install without those files trained on
other text. The digests below pin the tokenizer and weights of ``init_model(seed=0)``: a change
of them must be deliberate (a new corpus file, never an edit of ``tokenizer_corpus.txt``).

Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import pathlib
import tomllib
from fnmatch import fnmatch

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from services.worker.engines.torch_engine import checkpoint  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[3]

CORPUS_SHA256 = "42248944ef97da7554de8a4a4f4a67ecfecf9a2aee337c529e1b3befacd8f4ca"
"""sha256 of tokenizer_corpus.txt's bytes."""
TOKENIZER_512 = "17573321ee09b6f53e027f47c72c3c49fce4103a36846fe6356188bac38f109c"
"""sha256 of the vocabulary and merges (:func:`tokenizer_digest`) that ``vocab=512`` trains
(tokenizers 0.23.3; the bytes of tokenizer.json also hold the library's format, so they are not hashed)."""
WEIGHTS_SEED0 = "99676cf0e53a281522570f5b9b8d5bdc0df2201f408f3eb8ad61c979cbf2d4df"
"""sha256 of the tensors (:func:`weights_digest`) of ``init_model(seed=0)`` with its defaults (torch 2.13.0)."""


def tokenizer_digest(path: pathlib.Path) -> str:
    """sha256 of a tokenizer.json's vocabulary (sorted token → id) and merges in order, merges as
    pairs whichever form (``"a b"`` or ``["a", "b"]``) the ``tokenizers`` version writes."""
    model = json.loads(path.read_text(encoding="utf-8"))["model"]
    merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
    blob = json.dumps([sorted(model["vocab"].items()), merges], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def weights_digest(path: pathlib.Path) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes, by name."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_the_corpus_file_is_the_fixed_one():
    data = (pathlib.Path(checkpoint.__file__).parent / checkpoint.CORPUS_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == CORPUS_SHA256, "tokenizer_corpus.txt must never change"
    docs = checkpoint.corpus()
    assert len(docs) == 4 and sum(map(len, docs)) > 60_000
    assert not any("MUST NEVER CHANGE" in d for d in docs)  # the header is not trained on


def test_init_model_seed0_is_pinned(tmp_path):
    """Tokenizer and weights of ``init_model(seed=0)`` equal the pinned digests; before the fix the
    tokenizer was whatever the docs of the commit trained."""
    folder = checkpoint.init_model(tmp_path / "m", seed=0)
    assert tokenizer_digest(folder / "tokenizer.json") == TOKENIZER_512
    assert weights_digest(folder / "model.safetensors") == WEIGHTS_SEED0
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["eos_token_id"]) == (512, 2)


def test_the_tokenizer_reads_no_docs_and_not_the_cwd(tmp_path, monkeypatch):
    """With every ``.md`` file unreadable and the working directory elsewhere, the same tokenizer
    is trained (it was trained on text generated from a seed when the docs could not be read)."""
    tried: list[str] = []

    def guard(real):
        def opener(file, *args, **kwargs):
            name = str(file.path if hasattr(file, "path") else file)
            if name.endswith(".md"):
                tried.append(name)
                raise PermissionError(13, "unreadable in this test", name)
            return real(file, *args, **kwargs)

        return opener

    monkeypatch.setattr(builtins, "open", guard(builtins.open))
    monkeypatch.setattr(io, "open", guard(io.open))
    monkeypatch.setattr(pathlib.Path, "open", guard(pathlib.Path.open))
    monkeypatch.setattr(pathlib.Path, "read_text", guard(pathlib.Path.read_text))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    assert checkpoint.train_tokenizer(512, tmp_path / "out") == 512
    monkeypatch.undo()
    assert tried == []
    assert tokenizer_digest(tmp_path / "out" / "tokenizer.json") == TOKENIZER_512


def test_a_missing_corpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(checkpoint, "CORPUS_FILE", "no-such-corpus.txt")
    with pytest.raises(FileNotFoundError, match="no-such-corpus.txt is missing .*package data"):
        checkpoint.corpus()


def test_the_corpus_is_package_data():
    """A non-editable install (wheel) carries the corpus only if pyproject lists it as package data."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = checkpoint.__name__.rpartition(".")[0]
    globs = setup["package-data"].get(package, [])
    assert any(fnmatch(checkpoint.CORPUS_FILE, g) for g in globs), (package, globs)
