"""``simulate`` input errors found while the run is set up are one ``error:`` line and exit
status 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from evolving_infra.cli import main

SAMPLE = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"


@pytest.mark.parametrize("extra", [[], ["--sweep", "policies", "dynamo,evolving"]], ids=["run", "sweep"])
def test_trace_arrivals_without_arrival_times_is_an_error_line(tmp_path: Path, capsys, extra: list[str]) -> None:
    """The shipped sample has agents without ``arrival_s``: ``--trace-arrivals`` cannot place them."""
    argv = ["simulate", "--trace", str(SAMPLE), "--trace-arrivals", "--duration", "5", "--no-plots", "--out", str(tmp_path / "o"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: arrival 'trace' needs arrival_s") and "Traceback" not in err


@pytest.mark.parametrize(
    "extra",
    [
        ["--trace", "missing.jsonl"],
        ["--trace", str(SAMPLE), "--trace-arrivals"],
        ["--trace", str(SAMPLE), "--planner-opt", "bogus=1"],
        ["--trace", str(SAMPLE), "--trace-arrivals", "--sweep", "policies", "dynamo,evolving"],
    ],
    ids=["missing-trace", "arrivals", "planner-opt", "sweep"],
)
def test_a_run_that_fails_leaves_no_output_folder(tmp_path: Path, monkeypatch, capsys, extra: list[str]) -> None:
    """``--out`` is checked before the run (a path under a file is refused at once) but created
    only when there is a report to write: a run that stops with an error creates nothing."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "new" / "deeper" / "run"
    assert main(["simulate", *extra, "--duration", "5", "--no-plots", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra", [[], ["--sweep", "policies", "dynamo,evolving"]], ids=["run", "sweep"])
def test_a_report_that_cannot_be_written_is_an_error_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch, capsys, extra: list[str]
) -> None:
    """The disk fills while the report is written (under a nested ``--out`` that did not exist):
    one ``error: OUT: cannot write: ...`` line and status 2, not a traceback; no ``.tmp`` file
    nor any folder made for the report stays."""
    import errno

    import evolving_infra.report.write as report_write

    def disk_full(path, records):  # type: ignore[no-untyped-def]
        Path(path).write_text("half a record")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report_write, "write_records", disk_full)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "new" / "deeper" / "run"
    argv = ["simulate", "--trace", str(SAMPLE), "--duration", "5", "--no-plots", "--out", str(out), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot write: [Errno 28] No space left on device" in err and err.startswith("error: ") and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "opt, frag",
    [
        ("nope=1", "error: --routing-opt nope: not a routing policy option; known: balance_abs_threshold, "),
        ("shutdown_grace_s=5", "error: --routing-opt shutdown_grace_s: not a routing policy option"),
        ("block_size=8", "error: --routing-opt block_size: set it with --block-size"),
        ("seed=5", "error: --routing-opt seed: set it with --seed"),
        ("ttft_fetch_min_tokens=-1", "error: --routing-opt: "),
    ],
)
def test_a_routing_option_the_router_does_not_take_is_an_error_line(tmp_path: Path, capsys, opt: str, frag: str) -> None:
    """``simulate --routing-opt nope=1`` (a typo, or a router setting such as ``shutdown_grace_s``) ran the
    policy's defaults and said nothing, where ``up`` refuses the same option (exit 2); ``block_size`` overrode
    the simulation's block size in the router alone, ``seed`` the router's seed with ``meta.seed`` saying ``--seed``'s."""
    argv = ["simulate", "--trace", str(SAMPLE), "--routing-opt", opt, "--duration", "5", "--no-plots", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(frag) and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "opt, frag",
    [
        ("t_learn_s=abc", "error: --planner-opt t_learn_s=abc: Expected float, got str - at $.t_learn_s (planner evolving)"),
        ("slo_guard=maybe", "error: --planner-opt slo_guard=maybe: Expected bool, got str - at $.slo_guard (planner evolving)"),
        ("slices=2.5", "error: --planner-opt slices=2.5: Expected int, got float - at $.slices (planner evolving)"),
        ("t_learn_s=-1", "error: --planner-opt t_learn_s=-1: t_learn_s and cooldown_s must be >= 0"),
    ],
)
def test_a_planner_option_of_the_wrong_type_is_an_error_line(tmp_path: Path, capsys, opt: str, frag: str) -> None:
    """``--planner-opt t_learn_s=abc`` failed inside the planner as "'<' not supported between instances of 'str'
    and 'int'", and ``slo_guard=maybe`` (kept as a str, truthy) ran with the SLO guard on and exit 0; now each is
    checked against the planner's parameter types as ``--routing-opt`` is against the router's."""
    argv = ["simulate", "--trace", str(SAMPLE), "--planner-opt", opt, "--duration", "5", "--no-plots", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(frag) and "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_a_planner_option_an_int_for_a_float_is_taken_as_given() -> None:
    """The check converts nothing: ``t_learn_s=900`` (an int for a float field) passes and stays an int."""
    from evolving_infra.policy_args import check_planner_options

    opts = {"t_learn_s": 900, "slo_guard": False, "objective": "throughput"}
    check_planner_options("evolving", opts)
    check_planner_options("static", {"anything": "x"})  # static takes none: its own error (make_planner) says so
    assert opts == {"t_learn_s": 900, "slo_guard": False, "objective": "throughput"}
    with pytest.raises(ValueError, match=r"^--planner-opt interval_s=soon: Expected float, got str - at \$\.interval_s \(planner arrow\)$"):
        check_planner_options("arrow", {"interval_s": "soon"})


@pytest.mark.parametrize(
    "extra, frag",
    [
        (["--slow-node", "w9:2"], "error: --slow-node w9:2: the cluster has no node 'w9' (nodes: w0..w3)"),
        (["--switch-at", "10:w9:decode"], "error: --switch-at 10:w9:decode: the cluster has no node 'w9' (nodes: w0..w3)"),
        (["--partitions", "2", "--slow-node", "w0:2"], "error: --slow-node w0:2: the cluster has no node 'w0' (nodes: p0w0..p1w1)"),
    ],
)
def test_a_node_the_cluster_does_not_have_is_an_error_line(tmp_path: Path, capsys, extra: list[str], frag: str) -> None:
    """On ``--nodes 4``, ``--slow-node w9:2`` and ``--switch-at 10:w9:decode`` ran with no effect, exit 0."""
    argv = ["simulate", "--trace", str(SAMPLE), "--nodes", "4", *extra, "--duration", "5", "--no-plots", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(frag) and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("split", ["3P", "three"])
def test_a_malformed_split_is_a_syntax_error_not_a_size_error(tmp_path: Path, capsys, split: str) -> None:
    """``--split 3P`` on 4 nodes said "split '3P' does not fit a partition of 4 nodes (split '3P' must look like
    '4P5D' or 'collocated')": a syntax error worded as a size error."""
    argv = ["simulate", "--trace", str(SAMPLE), "--nodes", "4", "--split", split, "--duration", "5", "--no-plots", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: --split {split}: split {split!r} must look like '4P5D' or 'collocated'\n", err
