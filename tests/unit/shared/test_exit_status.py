"""Exit statuses of ``evolving-infra`` (``evolving_infra.cli``): a usage error exits 2 with one line on stderr.

Before, ``up --split 3P3D`` and ``up --policy foo`` exited 1 (``SystemExit("error: ...")`` in the launcher)
while ``up --block-size 16`` and ``simulate``'s split mismatch exited 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evolving_infra.cli import EXIT_STATUSES, INTERRUPTED, RUNTIME_FAILURE, USAGE_ERROR, UsageError, build_parser
from evolving_infra.stdio_args import READER_GONE

ROOT = Path(__file__).resolve().parents[3]

ENTRY = "import sys; from evolving_infra.cli import main; sys.exit(main())"
"""What the ``evolving-infra`` console script runs (pyproject's ``evolving_infra.cli:main``)."""


def _run(argv: list[str], tmp_path: Path, *, module: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EI_STATE_DIR": str(tmp_path / "state")}
    head = [sys.executable, "-m", "evolving_infra.cli"] if module else [sys.executable, "-c", ENTRY]
    return subprocess.run([*head, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["up", "--split", "3P3D", "--port", "0"], "split '3P3D' covers 6 nodes but the cluster has 4"),  # was 1
        (["up", "--policy", "foo", "--port", "0"], "unknown policy set 'foo'"),  # was 1
        (["up", "--planner", "evolving", "--planner-opt", "t_learn_s=-1", "--port", "0"], "--planner-opt"),  # was 1
        (["up", "--block-size", "16", "--port", "0"], "--block-size 16 differs from the block size 64"),
        (["demo", "--model", "somewhere", "--out", "out"], "--model needs --engine torch"),  # was 1
        (["simulate", "--workload", "putnam", "--nodes", "3", "--split", "2P2D", "--out", "out"], "2P2D"),
        (["split", "set", "three"], "must look like '4P5D'"),
        # was 'cannot connect to NATS at ...: no server answered', whether or not one was there
        (["split", "get", "--nats-url", "nats://127.0.0.1:1", "--timeout", "0"], "--timeout must be a number of seconds > 0"),
        (["split", "set", "1P1D", "--nats-url", "nats://127.0.0.1:1", "--timeout", "-1"], "--timeout must be"),
        (["split", "get", "--nats-url", "nats://127.0.0.1:1", "--timeout", "nan"], "--timeout must be"),
        # no server: the bus also logged each failed connect try ("[warning ] nats error ... ConnectionRefusedError"),
        # two lines before this one
        (["split", "get", "--nats-url", "nats://127.0.0.1:1"], "cannot connect to NATS at nats://127.0.0.1:1: no server answered"),
        (["split", "set", "2P2D", "--nats-url", "nats://127.0.0.1:1"], "cannot connect to NATS at nats://127.0.0.1:1"),
    ],
)
def test_a_usage_error_exits_2_with_one_line(argv, fragment, tmp_path):
    p = _run(argv, tmp_path)
    lines = p.stderr.splitlines()
    assert p.returncode == USAGE_ERROR == 2, (p.returncode, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], p.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_python_m_reports_the_message_too(tmp_path):
    """``python -m evolving_infra.cli`` runs the module as ``__main__``; the commands raise the UsageError of
    ``evolving_infra.cli``, which that copy's main would not catch (status 2, no message)."""
    p = _run(["up", "--policy", "foo"], tmp_path, module=True)
    assert (p.returncode, p.stderr.splitlines()) == (2, ["error: unknown policy set 'foo'; known: static:<x>P<y>D, dynamo, arrow, evolving"])


@pytest.mark.parametrize(
    "argv, line",
    [
        (["up", "--nodes", "many"], "evolving-infra up: error: argument --nodes: invalid int value: 'many' (see 'evolving-infra up --help')"),
        (["up", "--routers", "x"], "evolving-infra up: error: argument --routers: invalid int value: 'x' (see 'evolving-infra up --help')"),
        # an unknown flag of a subcommand was the top parser's: "evolving-infra: error: unrecognized arguments"
        (["up", "--bogus"], "evolving-infra up: error: unrecognized arguments: --bogus (see 'evolving-infra up --help')"),
        (["simulate", "--nodes", "q"], "evolving-infra simulate: error: argument --nodes: invalid int value: 'q' (see 'evolving-infra simulate --help')"),
        (["trace", "validate", "t.jsonl", "--bogus"],
         "evolving-infra trace validate: error: unrecognized arguments: --bogus (see 'evolving-infra trace validate --help')"),
        (["split", "set"], "evolving-infra split set: error: the following arguments are required: SPLIT (see 'evolving-infra split set --help')"),
        # a user's value keeps its own spaces (only argparse's newlines are folded): was 'a b'
        (["up", "--routers", "a    b"], "evolving-infra up: error: argument --routers: invalid int value: 'a    b' (see 'evolving-infra up --help')"),
        # a flag before the subcommand is the top parser's, not the subcommand's: was "evolving-infra up: error"
        (["--bogus", "up"], "evolving-infra: error: unrecognized arguments: --bogus (see 'evolving-infra --help')"),
        (["trace", "--bogus", "validate", "t.jsonl"],
         "evolving-infra trace: error: unrecognized arguments: --bogus (see 'evolving-infra trace --help')"),
        (["--bogus", "up", "--bad"], "evolving-infra: error: unrecognized arguments: --bogus --bad (see 'evolving-infra --help')"),
        (["bogus"], "evolving-infra: error: argument COMMAND: invalid choice: 'bogus' (choose from 'up', 'demo', 'replay', 'trace', "
                    "'tap', 'report', 'split', 'status', 'simulate', 'fidelity', 'model', 'auth', 'deploy-args') (see 'evolving-infra --help')"),
    ],
)  # fmt: skip
def test_argparse_errors_are_one_line_naming_the_subcommand_and_exit_2(argv, line, tmp_path):
    """--help and the README say a usage error is one line on stderr; argparse printed its usage block first
    (25 lines for up) and named no subcommand for an unknown flag (newcomer walk)."""
    p = _run(argv, tmp_path)
    assert (p.returncode, p.stderr.splitlines(), p.stdout) == (2, [line], ""), p.stderr


def test_a_usage_error_is_a_system_exit_with_its_message():
    """Code that calls a command's checks outside main (tests, ``pytest.raises(SystemExit, match=...)``) sees
    the message; uncaught, it exits 2."""
    e = UsageError("error: x")
    assert isinstance(e, SystemExit) and str(e) == "error: x" and e.code == 2


def test_help_lists_the_exit_statuses():
    text = " ".join(build_parser().format_help().split())
    assert " ".join(EXIT_STATUSES.split()) in text
    for status in (0, RUNTIME_FAILURE, USAGE_ERROR, INTERRUPTED, READER_GONE):
        assert f"{status} " in EXIT_STATUSES
    # demo and replay end 128 + the signal (the README: demo "exits 130 / 143"); --help named 130 alone
    assert "143 stopped by SIGTERM (demo and replay" in EXIT_STATUSES and "129 for SIGHUP" in EXIT_STATUSES


@pytest.mark.parametrize(
    "argv, module",
    [
        (["up", "--engine", "torch", "--model", "m"], "services.worker.engines.torch_engine.model"),  # m: a config.json
        # torch itself missing: init_model imports it lazily, so it was a raw traceback from checkpoint.py
        (["model", "init", "m"], "torch"),
    ],
)
def test_a_missing_torch_extra_is_a_runtime_failure(argv, module, tmp_path, monkeypatch, capsys):
    """The options are right; the install lacks a package: status 1 (``up`` and ``model init`` alike)."""
    from evolving_infra.cli import main

    monkeypatch.setitem(sys.modules, module, None)  # import raises ModuleNotFoundError
    monkeypatch.chdir(tmp_path)
    if argv[0] == "up":  # a folder that passes the --model check (which needs no torch: a usage error before it)
        _config_only(tmp_path / "m")
    try:
        rc = main([*argv, *(["--log-dir", str(tmp_path / "logs"), "--port", "0"] if argv[0] == "up" else [])])
    except SystemExit as e:  # up: SystemExit("error: ..."), which Python prints and exits 1 with
        print(e, file=sys.stderr)
        rc = 1 if isinstance(e.code, str) else e.code
    err = capsys.readouterr().err
    assert rc == RUNTIME_FAILURE and "torch extra" in err, (rc, err)


TORCH_HINT = ("pip install -e '.[torch]' (without a GPU, first pip install torch==2.13.0 --index-url "
              "https://download.pytorch.org/whl/cpu: PyPI's Linux torch is the CUDA build, several GB)")
"""What the missing-extra line tells to run: a newcomer on a CPU machine who ran the bare install it named
pulled the multi-GB CUDA build (README, Engines, says to take the CPU build first)."""


def test_model_init_without_torch_says_which_extra_in_one_line(tmp_path):
    """``model init`` on an install without the torch extra (torch unimportable in a fresh interpreter): one
    line in ``up --engine torch``'s words, status 1, no folder made. It was a traceback ending in
    ``ModuleNotFoundError: No module named 'torch'`` (checkpoint.py) after making the folder."""
    entry = "import sys; sys.modules['torch'] = None; " + ENTRY.split("; ", 1)[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EI_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run([sys.executable, "-c", entry, "model", "init", str(tmp_path / "tiny"), "--arch", "llama"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (p.returncode, p.stderr.splitlines()) == (
        RUNTIME_FAILURE, [f"error: model init needs the torch extra (torch missing): {TORCH_HINT}"]), p.stderr
    assert not (tmp_path / "tiny").exists()


def _config_only(folder: Path) -> Path:
    """A model folder with only a valid ``config.json`` (a tiny llama's): enough for ``up``'s ``--model`` check."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    }))  # fmt: skip
    return folder


def test_up_checks_the_model_folder_without_the_torch_extra(tmp_path):
    """``up --engine torch --model DIR`` on an install without the torch extra (torch unimportable in a fresh
    interpreter): a folder that is no model is a usage error (status 2) naming it, as with the extra; a model
    folder then needs the extra (status 1). Before, both said 'needs the torch extra' (``ModelConfig`` lived in
    the torch decoder's module): the sbatch job's check of a bad ``MODEL_DIR`` failed without the extra."""
    entry = "import sys; sys.modules['torch'] = None; " + ENTRY.split("; ", 1)[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EI_STATE_DIR": str(tmp_path / "state")}

    def up(model: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", entry, "up", "--engine", "torch", "--model", str(model), "--port", "0",
                               "--log-dir", str(tmp_path / "logs")], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)  # fmt: skip

    p = up(tmp_path / "nope")
    assert (p.returncode, p.stderr.splitlines()[-1:]) == (USAGE_ERROR, [f"error: --model {tmp_path / 'nope'}: {tmp_path / 'nope'}: no such folder "
                                                                         "(--model takes a local Hugging Face model folder; evolving-infra model "
                                                                         "init DIR writes a tiny one)"]), p.stderr  # fmt: skip
    p = up(_config_only(tmp_path / "m"))
    assert (p.returncode, p.stderr.splitlines()[-1:]) == (
        RUNTIME_FAILURE, [f"error: --engine torch needs the torch extra (torch missing): {TORCH_HINT}"]), p.stderr


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--heads", "0"], "--heads must be >= 1"),  # was ZeroDivisionError traceback, exit 1
        (["--hidden", "-64"], "--hidden must be >= 1"),  # was torch's 'negative dimension' traceback
        (["--layers", "0"], "--layers must be >= 1"),  # wrote a model of no layers, exit 0
        (["--context", "-1"], "--context must be >= 1"),  # wrote max_position_embeddings -1, exit 0
        (["--vocab", "10"], "--vocab must be >= 300"),  # right message, but after making the folder
        (["--kv-heads", "3"], "heads by kv_heads 3"),  # the same
    ],
)
def test_model_init_bad_size_is_one_line_before_any_folder(extra, fragment, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    p = _run(["model", "init", "out", *extra], tmp_path)
    lines = p.stderr.splitlines()
    assert p.returncode == USAGE_ERROR and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], p.stderr
    assert not (tmp_path / "out").exists()


def test_model_init_into_a_file_or_under_a_file_is_one_line(tmp_path):
    """A DIR that is a file, or under one, was a FileExistsError / NotADirectoryError traceback (exit 1)."""
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    (tmp_path / "afile").write_text("")
    for target, fragment in (("afile", "afile: is a file"), ("afile/m", "afile/m: cannot write")):
        p = _run(["model", "init", target], tmp_path)
        lines = p.stderr.splitlines()
        assert p.returncode == USAGE_ERROR and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], p.stderr
    assert (tmp_path / "afile").read_text() == ""


def test_up_with_an_unusable_nats_url_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """``up --nats-url`` with an empty server in its list (``shared.auth.nats_servers``: AuthError) ended in a
    Python traceback out of ``LocalCluster.start`` (as did a refusal of the URL's credentials, a BusError);
    now one ``error:`` line naming the URL's problem, status 1, as any other failed start."""
    from evolving_infra.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    rc = main(["up", "--nats-url", "nats://h1:4222,,nats://h2:4222", "--log-dir", str(tmp_path / "logs"), "--port", "0"])
    err = capsys.readouterr().err
    assert rc == RUNTIME_FAILURE and "error: cannot connect to NATS" in err and "an empty server in the list" in err, (rc, err)
    assert "Traceback" not in err, err
