"""``evolving_infra.cli.command_name``: the commands ``evolving-infra`` prints are ones the user can run.

The demo's last line suggested ``evolving-infra demo --policy static:2P2D ...`` after ``make demo``, which runs
``.venv/bin/evolving-infra`` without activating the venv: bare ``evolving-infra`` was not on PATH.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from evolving_infra.cli import build_parser, command_name
from evolving_infra.launcher import _baseline_line, _spec


def _clone(tmp_path: Path) -> Path:
    """A fresh clone after ``make demo``: ``.venv/bin/python`` and the console script ``.venv/bin/evolving-infra``."""
    repo = tmp_path / "repo"
    bin_ = repo / ".venv" / "bin"
    bin_.mkdir(parents=True)
    for name in ("python", "evolving-infra"):
        (bin_ / name).write_text("#!/bin/sh\n")
        (bin_ / name).chmod(0o755)
    return repo


def _tiny_model(folder: Path) -> Path:
    """``evolving-infra model init FOLDER``: needs the torch extra (torch, and tokenizers for the tokenizer), as
    ``--engine torch`` and ``--tokenizer hf:`` do at ``_spec``; the test is skipped without it (before, a
    ``pytest tests/unit`` without the extra failed three tests here: ``model init`` exited 1)."""
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    from evolving_infra.cli import main

    assert main(["model", "init", str(folder)]) in (0, None)
    return folder


@pytest.fixture
def make_demo(tmp_path, monkeypatch):
    """``make demo``'s process: ``.venv/bin/evolving-infra demo`` run in the clone, the venv not activated."""
    repo = _clone(tmp_path)
    monkeypatch.chdir(repo)
    monkeypatch.setattr(sys, "executable", str(repo / ".venv/bin/python"))
    monkeypatch.setattr(sys, "argv", [".venv/bin/evolving-infra", "demo", "--out", "demo-out"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    return repo


def test_make_demo_in_a_fresh_clone_prints_the_venvs_script(make_demo, monkeypatch):
    assert command_name() == ".venv/bin/evolving-infra"
    assert command_name(make_demo.parent) == "repo/.venv/bin/evolving-infra"
    assert command_name(make_demo.parent / "elsewhere") == str(make_demo / ".venv/bin/evolving-infra")  # not under it: absolute


def test_an_activated_venv_prints_the_bare_name(make_demo, monkeypatch):
    monkeypatch.setenv("PATH", f"{make_demo / '.venv/bin'}{os.pathsep}/usr/bin")
    assert command_name() == "evolving-infra"


def test_another_evolving_infra_on_path_is_not_the_one_running(make_demo, tmp_path, monkeypatch):
    other = _clone(tmp_path / "other")
    monkeypatch.setenv("PATH", f"{other / '.venv/bin'}{os.pathsep}/usr/bin")
    assert command_name() == ".venv/bin/evolving-infra"


def test_python_m_without_a_script_prints_the_interpreter(tmp_path, monkeypatch):
    py = tmp_path / "py" / "bin" / "python3"
    py.parent.mkdir(parents=True)
    py.write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(py))
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "evolving_infra" / "cli.py"), "demo"])
    assert command_name() == "py/bin/python3 -m evolving_infra.cli"
    monkeypatch.setattr(sys, "executable", str(tmp_path / "my python"))
    (tmp_path / "my python").write_text("")
    assert command_name() == "'./my python' -m evolving_infra.cli"


@pytest.mark.parametrize("policy", ["evolving", "static:2P2D"])
def test_the_demos_baseline_line_runs_from_the_clone(make_demo, policy, tmp_path):
    args = build_parser().parse_args(["demo", "--policy", policy, "--log-dir", str(tmp_path / "logs"), "--sessions", "4",
                                      "--concurrency", "2"])
    _spec(args)
    line = _baseline_line(args, Path("demo-out"))
    commands = line.split(": ", 1)[1] if policy == "evolving" else line.rsplit(": ", 1)[1]
    assert commands.startswith(".venv/bin/evolving-infra demo "), line
    assert " evolving-infra " not in f" {commands} ".replace(".venv/bin/evolving-infra", "")
    if policy == "evolving":
        assert "&& .venv/bin/evolving-infra report compare --out demo-out-compare demo-out demo-out-static" in commands


@pytest.mark.parametrize("extra", [["--profile", "tiny"], ["--engine", "torch", "--model", "MODEL", "--max-output", "5"]])
def test_the_demos_baseline_line_keeps_the_profile_and_the_engine(make_demo, extra, tmp_path):
    """'Same input' means the same nodes: the baseline command dropped ``--profile`` (a ``--profile
    tiny`` demo was compared with a gb300-glm52 baseline) and ``--engine torch --model DIR
    --max-output N`` (a real-model demo with a simulated GLM-5.2 one)."""
    if "--engine" in extra:
        extra = [str(_tiny_model(tmp_path / "MODEL")) if a == "MODEL" else a for a in extra]
    args = build_parser().parse_args(["demo", "--log-dir", str(tmp_path / "logs"), "--sessions", "4", "--concurrency", "2", *extra])
    _spec(args)
    line = _baseline_line(args, Path("demo-out"))
    base = line.split(": ", 1)[1].split(" && ")[0]
    if "--engine" in extra:
        assert f"--engine torch --model {tmp_path / 'MODEL'} --max-output 5" in base and "--profile torch-tiny-cpu" in base, line
    else:
        assert "--profile tiny" in base and "--engine" not in base, line


def test_the_static_demos_comparison_carries_every_input_flag(make_demo, tmp_path):
    """After ``demo --policy static:1P1D --engine torch --model DIR --nodes 2 --sessions 3`` the comparison command
    was ``demo --out demo-out``: the default 4-node, 60-session sim demo, not the same input; and ``report compare``
    without ``--out`` wrote ./compare-out wherever the user stood."""
    _tiny_model(tmp_path / "M")
    args = build_parser().parse_args(["demo", "--policy", "static:1P1D", "--engine", "torch", "--model", str(tmp_path / "M"),
                                      "--nodes", "2", "--sessions", "3", "--concurrency", "2", "--max-output", "4",
                                      "--gpu-kv-tokens", "2048", "--trace", "t.jsonl.gz", "--out", "runs/x-static",
                                      "--log-dir", str(tmp_path / "logs")])
    _spec(args)
    line = _baseline_line(args, Path("runs/x-static"))
    run, compare = line.split(": ", 2)[2].split(" && ")
    for flag in ("--sessions 3", "--concurrency 2", "--nodes 2", "--speedup 50", "--trace t.jsonl.gz", "--engine torch",
                 f"--model {tmp_path / 'M'}", "--max-output 4", "--profile torch-tiny-cpu", "--gpu-kv-tokens 2048",
                 "--split 1P1D", "--out runs/x"):
        assert flag in run, (flag, line)
    assert "--policy" not in run, line
    assert compare.endswith("report compare --out runs/x-compare runs/x runs/x-static"), line
    other = build_parser().parse_args(["demo", "--policy", "static:2P2D", "--sessions", "60", "--concurrency", "16",
                                       "--log-dir", str(tmp_path / "l2")])
    _spec(other)
    line = _baseline_line(other, Path("demo-out"))  # an --out not ending in -static
    assert "--out demo-out-evolving && " in line and "report compare --out demo-out-compare demo-out-evolving demo-out" in line, line


def test_the_demos_baseline_line_keeps_how_the_cluster_serves(make_demo, tmp_path):
    """``demo --fence-after-s 3`` printed a baseline command without it: the comparison ran at the demo's 10 s, a
    cluster that fences a starved worker later; ``--stream-interval`` and a ``--tokenizer`` given were dropped too."""
    args = build_parser().parse_args(["demo", "--log-dir", str(tmp_path / "logs"), "--sessions", "4", "--fence-after-s", "3",
                                      "--stream-interval", "4"])
    _spec(args)
    base = _baseline_line(args, Path("demo-out")).split(": ", 1)[1].split(" && ")[0]
    for flag in ("--fence-after-s 3", "--stream-interval 4"):
        assert flag in base, (flag, base)
    _tiny_model(tmp_path / "M")  # a --tokenizer given, and the torch engine's own: with the torch extra only
    args = build_parser().parse_args(["demo", "--log-dir", str(tmp_path / "l1"), "--sessions", "4", "--tokenizer", f"hf:{tmp_path / 'M'}"])
    _spec(args)
    base = _baseline_line(args, Path("demo-out")).split(": ", 1)[1].split(" && ")[0]
    assert f"--tokenizer hf:{tmp_path / 'M'}" in base, base
    # the defaults, and the torch engine's own tokenizer (the model's), are not repeated
    plain = build_parser().parse_args(["demo", "--log-dir", str(tmp_path / "l2"), "--engine", "torch", "--model", str(tmp_path / "M")])
    _spec(plain)
    base = _baseline_line(plain, Path("demo-out")).split(": ", 1)[1].split(" && ")[0]
    assert "--fence-after-s" not in base and "--stream-interval" not in base and "--tokenizer" not in base, base


def test_the_demos_baseline_line_keeps_the_real_bytes_kv_pool(make_demo, tmp_path, monkeypatch):
    """``demo --kv-pool real --kv-pool-slot-bytes 4096`` printed a baseline command without either (the newcomer walk,
    session 46): the baseline's peer fetches moved no bytes, the demo's pulled them over TCP on the wall clock (× the
    speed-up), so the two compared another cluster as well as another policy. The static demo's comparison too."""
    real = importlib.util.find_spec  # Mooncake need not be installed: the launcher only looks for it
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mooncake" else real(name, *a))
    for policy, out in ((None, "demo-out"), ("static:2P2D", "demo-out-static")):
        argv = ["demo", "--log-dir", str(tmp_path / f"l{out}"), "--kv-pool", "real", "--kv-pool-slot-bytes", "4096"]
        args = build_parser().parse_args(argv + (["--policy", policy] if policy else []))
        _spec(args)
        base = _baseline_line(args, Path(out)).split(": ", 2)[-1].split(" && ")[0]
        assert "--kv-pool real --kv-pool-slot-bytes 4096" in base, (policy, base)
    plain = build_parser().parse_args(["demo", "--log-dir", str(tmp_path / "lp")])
    _spec(plain)
    assert "--kv-pool" not in _baseline_line(plain, Path("demo-out"))


def test_the_static_baseline_beside_its_evolving_run_points_at_the_comparison(make_demo, tmp_path):
    """Session 59: after the baseline command `make demo` prints (`demo --policy static:2P2D ... --out demo-out-static
    && report compare ...`), the static run's last line suggested the evolving demo again with `--out demo-out`,
    which would move the first demo into demo-out/previous/: a circle. With that run already in demo-out, the line
    names the comparison of the two and its page; without it, the command to run it, as before."""
    args = build_parser().parse_args(["demo", "--policy", "static:2P2D", "--sessions", "4", "--concurrency", "2",
                                      "--log-dir", str(tmp_path / "logs")])
    _spec(args)
    first, static = tmp_path / "demo-out", tmp_path / "demo-out-static"
    before = _baseline_line(args, static)
    assert "demo --split 2P2D " in before and f"--out {first} && " in before, before  # no evolving run there yet
    first.mkdir()
    (first / "report.json").write_text("{}")
    line = _baseline_line(args, static)
    assert " demo " not in line and "--out " + str(first) + " " not in line.split("report compare")[0], line
    assert line.startswith(f"baseline: this run is the static baseline of {first} (its report.json is there)"), line
    assert f"report compare --out {tmp_path / 'demo-out-compare'} {first} {static}" in line, line
    assert line.endswith(f"then open {tmp_path / 'demo-out-compare' / 'compare.html'}"), line
