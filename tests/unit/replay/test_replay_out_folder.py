"""An earlier run's outputs in ``--out`` move to ``OUT/previous/`` (``replay``, and ``demo`` through the same
:func:`~evolving_infra.replay.cli.set_aside_previous_run`), and nothing else there is touched. Before, every
``*.png`` in ``OUT`` moved and an existing ``OUT/previous`` was removed with all it held: ``--out .`` in a folder
of the user's own files lost their ``previous/`` folder and their PNGs on the second run; an ``OUT/previous``
that was a plain file was a traceback (NotADirectoryError) once the run had started.
"""

from __future__ import annotations

import pytest

from evolving_infra.launcher import demo_trace_path
from evolving_infra.replay.cli import OutFolderError, check_previous_run, set_aside_previous_run
from evolving_infra.report.write import RUN_PLOTS
from tests.unit.replay.stub_router import stub_router_thread


def _earlier_run(out, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("report.json", "requests.jsonl", "report.html", "ttft_cdf.png"):
        (out / name).write_text(f"{tag} {name}\n")


def test_only_a_runs_own_outputs_move_and_the_users_files_stay(tmp_path):
    out = tmp_path / "g"
    _earlier_run(out, "first")
    (out / "holiday.png").write_text("mine\n")
    (out / "notes.txt").write_text("mine too\n")
    assert set_aside_previous_run(out) == ["report.json", "requests.jsonl", "report.html", "ttft_cdf.png"]
    assert (out / "holiday.png").read_text() == "mine\n" and (out / "notes.txt").read_text() == "mine too\n"
    assert sorted(p.name for p in (out / "previous").iterdir()) == ["report.html", "report.json", "requests.jsonl", "ttft_cdf.png"]
    # a second run's: the older previous/ (a run's outputs alone) is replaced, none of its files kept beside the new
    (out / "report.json").write_text("second report.json\n")
    (out / "requests.jsonl").write_text("second requests.jsonl\n")
    assert set_aside_previous_run(out) == ["report.json", "requests.jsonl"]
    assert sorted(p.name for p in (out / "previous").iterdir()) == ["report.json", "requests.jsonl"]
    assert (out / "previous" / "report.json").read_text() == "second report.json\n"
    assert (out / "holiday.png").read_text() == "mine\n" and (out / "notes.txt").read_text() == "mine too\n"


def test_a_folder_with_no_runs_data_is_left_alone(tmp_path):
    """A page or plots of that name alone are not a run's (the user's own report.html in ``--out ~``)."""
    out = tmp_path / "home"
    out.mkdir()
    (out / "report.html").write_text("mine\n")
    (out / RUN_PLOTS[0]).write_text("mine\n")
    (out / "previous").mkdir()
    (out / "previous" / "my-notes.txt").write_text("mine\n")
    assert check_previous_run(out) == [] and set_aside_previous_run(out) == []
    assert sorted(p.name for p in out.rglob("*")) == sorted(["report.html", RUN_PLOTS[0], "previous", "my-notes.txt"])
    assert check_previous_run(tmp_path / "absent") == []


@pytest.mark.parametrize("theirs", ["file", "folder", "link"])
def test_a_previous_folder_holding_the_users_files_is_refused_and_nothing_moves(tmp_path, theirs):
    out = tmp_path / "g"
    _earlier_run(out, "first")
    prev = out / "previous"
    prev.mkdir()
    (prev / "report.json").write_text("an older run's\n")
    if theirs == "file":
        (prev / "my-notes.txt").write_text("mine\n")
    elif theirs == "folder":
        (prev / "ttft_cdf.png").mkdir()  # a run's name, but not a run's file
    else:
        (tmp_path / "elsewhere.txt").write_text("mine\n")
        (prev / "e2e_cdf.png").symlink_to(tmp_path / "elsewhere.txt")
    before = sorted((str(p.relative_to(tmp_path)), p.is_dir()) for p in tmp_path.rglob("*"))
    for call in (check_previous_run, set_aside_previous_run):
        with pytest.raises(OutFolderError, match=f"^{prev} holds files that are not a run's outputs .*choose another --out$"):
            call(out)
    assert sorted((str(p.relative_to(tmp_path)), p.is_dir()) for p in tmp_path.rglob("*")) == before
    assert (out / "report.json").read_text() == "first report.json\n"


def test_a_previous_that_is_not_a_folder_is_refused(tmp_path):
    out = tmp_path / "g"
    _earlier_run(out, "first")
    (out / "previous").write_text("mine\n")
    with pytest.raises(OutFolderError, match=f"^{out / 'previous'} is not a folder"):
        set_aside_previous_run(out)
    assert (out / "previous").read_text() == "mine\n" and (out / "report.json").is_file()
    (tmp_path / "plain").write_text("x\n")
    with pytest.raises(OutFolderError, match="is not a folder"):
        check_previous_run(tmp_path / "plain")


def _replay(url: str, out) -> int:  # type: ignore[no-untyped-def]
    from evolving_infra.cli import main

    return main(["replay", str(demo_trace_path()), "--router-url", url, "--speedup", "1000", "--sessions", "1",
                 "--max-requests-per-branch", "1", "--out", str(out)])


def test_replay_twice_into_a_folder_of_the_users_files_keeps_them(tmp_path, monkeypatch):
    """The reviewer's case on ``replay`` (``demo`` shares the move): two runs into a folder with the user's own PNG
    and ``previous/`` folder. Before: both gone after the second run."""
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))  # no running cluster's state is read
    out = tmp_path / "g"
    out.mkdir()
    (out / "holiday.png").write_text("mine\n")
    with stub_router_thread() as (url, _stub):
        assert _replay(url, out) == 0
        assert not (out / "previous").exists()  # nothing of a run there before
        assert _replay(url, out) == 0
        moved = sorted(p.name for p in (out / "previous").iterdir())
        assert "report.json" in moved and "requests.jsonl" in moved and "holiday.png" not in moved, moved
        assert _replay(url, out) == 0  # the previous/ of a run's outputs alone is replaced
    assert (out / "holiday.png").read_text() == "mine\n"


def test_replay_refuses_a_previous_of_the_users_before_any_request(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "g"
    _earlier_run(out, "first")
    (out / "previous").mkdir()
    (out / "previous" / "my-notes.txt").write_text("mine\n")
    (tmp_path / "h").mkdir()
    _earlier_run(tmp_path / "h", "first")
    (tmp_path / "h" / "previous").write_text("mine\n")  # a plain file: NotADirectoryError before
    with stub_router_thread() as (url, stub):
        assert _replay(url, out) == 2
        err = capsys.readouterr().err
        assert f"error: --out {out}: {out / 'previous'} holds files that are not a run's outputs (my-notes.txt)" in err, err
        assert "Traceback" not in err
        assert _replay(url, tmp_path / "h") == 2
        err = capsys.readouterr().err
        assert f"error: --out {tmp_path / 'h'}: {tmp_path / 'h' / 'previous'} is not a folder" in err and "Traceback" not in err, err
        assert not any(target == "/v1/completions" for target, _ in stub.seen)  # nothing sent
    assert (out / "previous" / "my-notes.txt").read_text() == "mine\n" and (out / "report.json").read_text() == "first report.json\n"
    assert (tmp_path / "h" / "previous").read_text() == "mine\n"
