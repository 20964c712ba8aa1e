"""``--split`` under the evolving planner's collocated warm-up: what up and demo say, and the torch demo's warm-up.

A vLLM user ran ``up --engine torch --model DIR --nodes 2 --split 1P1D`` (the README's example) and got 30 minutes
of collocated serving (``"decode_node": null``); ``demo --engine torch`` said "expect it to move nodes between phases"
and ended its ~480 simulated seconds inside a 900-s warm-up ("PD split final collocated").
"""

from __future__ import annotations

import pytest

from evolving_infra.cli import build_parser
from evolving_infra.launcher import (
    DEMO_PLANNER,
    DEMO_TORCH_PLANNER,
    _policy,
    demo_outlook,
    split_deferred_line,
    warmup_outlasted_note,
)


def _args(argv, tmp_path):
    args = build_parser().parse_args([*argv, "--log-dir", str(tmp_path)])
    return args, _policy(args)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["up", "--nodes", "2", "--split", "1P1D"], "1800-s warm-up, then 1P1D; for 1P1D at once pass --policy static:1P1D"),
        (["demo", "--split", "3P1D"], "900-s warm-up, then 3P1D; for 3P1D at once pass --policy static:3P1D"),
        (["up", "--nodes", "2"], None),  # the default split: the banner's warm-up line says it
        (["up", "--split", "collocated"], None),
        (["up", "--nodes", "2", "--split", "1P1D", "--planner-opt", "t_learn_s=0"], None),
        (["up", "--nodes", "2", "--split", "1P1D", "--policy", "static:1P1D"], None),
        (["up", "--nodes", "2", "--split", "1P1D", "--policy", "dynamo"], None),
    ],
)
def test_an_explicit_split_deferred_by_the_warm_up_is_one_clear_line(argv, expected, tmp_path):
    args, pol = _args(argv, tmp_path)
    line = split_deferred_line(pol, args.split, given=args.split_given)
    if expected is None:
        assert line is None, line
    else:
        assert line is not None and expected in line and "--planner-opt t_learn_s=60" in line, line
        assert '"decode_node": null' in line


def test_a_warm_up_already_short_is_not_told_to_pass_the_flag_it_was_given(tmp_path):
    """``up --engine torch --nodes 2 --split 1P1D --planner-opt t_learn_s=60`` (the README's way to 1P1D) printed
    "... for its 60-s warm-up, then 1P1D; ... or a short warm-up: --planner-opt t_learn_s=60" (session 42)."""
    args, pol = _args(["up", "--nodes", "2", "--split", "1P1D", "--planner-opt", "t_learn_s=60"], tmp_path)
    line = split_deferred_line(pol, args.split, given=args.split_given)
    assert line is not None and "60-s warm-up, then 1P1D; for 1P1D at once pass --policy static:1P1D" in line, line
    assert "t_learn_s=60" not in line and "60-s slice boundary: `split get` says when" in line, line


def test_split_help_says_the_warm_up_comes_first_and_how_to_skip_it():
    for command in ("up", "demo"):
        split = next(a for a in _subparser(command)._actions if a.dest == "split")
        text = " ".join(split.help.split())
        assert "collocated for its warm-up first" in text and "--policy static:xPyD" in text, text
        assert "--planner-opt t_learn_s=60" in text, text


def _subparser(command):
    parser = build_parser(command)
    return next(a for a in parser._actions if a.dest == "command").choices[command]


def test_the_torch_demo_warms_up_briefly_and_says_what_it_will_show(tmp_path):
    args, pol = _args(["demo", "--engine", "torch", "--model", str(tmp_path / "m"), "--nodes", "2"], tmp_path)
    assert pol.planner_args == tuple(f"{k}={v}" for k, v in DEMO_TORCH_PLANNER.items())
    assert DEMO_TORCH_PLANNER["t_learn_s"] < 300 < DEMO_PLANNER["t_learn_s"]  # ends within a ~480-s run
    outlook = demo_outlook(args.split, args.nodes, torch=True)
    assert "move nodes" not in outlook and "1P1D is its only PD split" in outlook, outlook
    assert "move nodes between phases" in demo_outlook("2P2D", 4, torch=False)
    _, user = _args(["demo", "--engine", "torch", "--model", "m", "--planner-opt", "t_learn_s=600"], tmp_path)
    assert user.planner_args == ("t_learn_s=600",)  # the user's wins


def test_a_run_that_ended_in_the_warm_up_says_so(tmp_path):
    _, pol = _args(["demo", "--nodes", "2"], tmp_path)
    note = warmup_outlasted_note(pol, "1P1D", "collocated")
    assert note is not None and "never served" in note and "--policy static:1P1D" in note, note
    assert warmup_outlasted_note(pol, "1P1D", "1P1D") is None
    assert warmup_outlasted_note(pol, "collocated", "collocated") is None
    _, static = _args(["demo", "--nodes", "2", "--policy", "static:1P1D"], tmp_path)
    assert warmup_outlasted_note(static, "1P1D", "collocated") is None
