"""Files of a run's output names in ``--out`` move to ``OUT/previous/`` (``replay``, and ``demo`` through the same
:func:`~evolving_infra.replay.cli.set_aside_previous_run`), and nothing else there is touched. Before 9b18232, every
``*.png`` in ``OUT`` moved and an existing ``OUT/previous`` was removed with all it held; after it (reviewer rr-ops2),
only a folder holding a report.json or requests.jsonl moved anything, so the user's own ``report.html`` or
``ttft_cdf.png`` was overwritten silently; the older ``previous/`` was emptied before the move could fail; a
``previous`` symlinked to a folder was "not a folder"; and two runs into one ``OUT`` at once lost both without a
word (now :func:`~evolving_infra.replay.cli.hold_out`)"""

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
    """A folder holding none of a run's names is not touched, its ``previous/`` of the user's included."""
    out = tmp_path / "home"
    out.mkdir()
    (out / "holiday.png").write_text("mine\n")
    (out / "previous").mkdir()
    (out / "previous" / "my-notes.txt").write_text("mine\n")
    assert check_previous_run(out) == [] and set_aside_previous_run(out) == []
    assert sorted(p.name for p in out.rglob("*")) == ["holiday.png", "my-notes.txt", "previous"]
    assert check_previous_run(tmp_path / "absent") == []


def test_a_page_or_plot_of_a_runs_name_alone_moves_too(tmp_path):
    """The user's own ``report.html`` or ``ttft_cdf.png`` in ``--out ~`` (no report.json there) would be overwritten
    by this run's: it moves to ``previous/`` as a run's outputs do; a ``previous/`` of the user's then stops the run."""
    out = tmp_path / "home"
    out.mkdir()
    (out / "report.html").write_text("mine\n")
    (out / RUN_PLOTS[0]).write_text("mine too\n")
    assert check_previous_run(out) == ["report.html", RUN_PLOTS[0]]
    assert set_aside_previous_run(out) == ["report.html", RUN_PLOTS[0]]
    assert (out / "previous" / "report.html").read_text() == "mine\n"
    assert (out / "previous" / RUN_PLOTS[0]).read_text() == "mine too\n"
    assert sorted(p.name for p in out.iterdir()) == ["previous"]
    (out / "report.html").write_text("mine again\n")
    (out / "previous" / "my-notes.txt").write_text("mine\n")
    with pytest.raises(OutFolderError, match="holds files that are not a run's outputs \\(my-notes.txt\\)"):
        set_aside_previous_run(out)
    assert (out / "report.html").read_text() == "mine again\n"


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


def test_a_previous_that_is_a_symlink_to_a_folder_says_so(tmp_path):
    """Before: "is not a folder" for a link that leads to one (the reviewer's finding 5)."""
    out = tmp_path / "g"
    _earlier_run(out, "first")
    (tmp_path / "theirs").mkdir()
    (out / "previous").symlink_to(tmp_path / "theirs")
    with pytest.raises(OutFolderError, match=f"^{out / 'previous'} is a symlink \\(to a folder\\)"):
        set_aside_previous_run(out)
    assert (out / "previous").is_symlink() and list((tmp_path / "theirs").iterdir()) == []


def _immutable(monkeypatch, folder):  # type: ignore[no-untyped-def]
    """``chattr +i folder`` as the kernel applies it, for a test run as any user: no entry of ``folder`` can be
    made, removed or renamed (its files' contents, and folders inside it, can still change)."""
    import errno
    import os

    def guarded(real):  # type: ignore[no-untyped-def]
        def call(*paths, **kw):  # type: ignore[no-untyped-def]
            for p in paths[:2]:
                if isinstance(p, (str, os.PathLike)) and os.path.dirname(os.path.abspath(p)) == str(folder):
                    raise PermissionError(errno.EPERM, "Operation not permitted", str(p))
            return real(*paths, **kw)
        return call

    for name in ("mkdir", "rename", "replace", "unlink", "rmdir"):
        monkeypatch.setattr(os, name, guarded(getattr(os, name)))


def test_a_set_aside_that_cannot_change_out_keeps_the_older_previous(tmp_path, monkeypatch):
    """``chattr +i OUT``: nothing in ``OUT`` can move. Before, the older ``previous/`` was emptied first and the move
    then failed: the first run's outputs gone, the second's still in ``OUT``. Now nothing is changed, and the
    error says ``previous/`` is as it was."""
    out = tmp_path / "g"
    _earlier_run(out / "previous", "first")
    _earlier_run(out, "second")
    before = sorted((str(p.relative_to(tmp_path)), p.read_text()) for p in tmp_path.rglob("*") if p.is_file())
    _immutable(monkeypatch, out)
    with pytest.raises(OutFolderError, match=f"nothing was moved: {out / 'previous'} is as it was"):
        set_aside_previous_run(out)
    monkeypatch.undo()
    assert sorted((str(p.relative_to(tmp_path)), p.read_text()) for p in tmp_path.rglob("*") if p.is_file()) == before


def test_a_swap_that_fails_puts_everything_back(tmp_path, monkeypatch):
    """The outgoing outputs gather in a folder inside ``OUT`` first, which then takes ``previous``'s place; the
    older one is deleted last. A failure at that last rename: every file back where it was, no folder left over."""
    import errno
    import os

    out = tmp_path / "g"
    _earlier_run(out / "previous", "first")
    _earlier_run(out, "second")
    before = sorted((str(p.relative_to(tmp_path)), p.read_text()) for p in tmp_path.rglob("*") if p.is_file())
    real_rename, real_replace = os.rename, os.replace

    def refuse_into_previous(real):  # type: ignore[no-untyped-def]
        def call(src, dst, **kw):  # type: ignore[no-untyped-def]
            if os.path.abspath(dst) == str(out / "previous") and os.path.basename(os.path.abspath(src)) != "previous":
                raise OSError(errno.EIO, "Input/output error", str(dst))
            return real(src, dst, **kw)
        return call

    monkeypatch.setattr(os, "rename", refuse_into_previous(real_rename))
    monkeypatch.setattr(os, "replace", refuse_into_previous(real_replace))
    with pytest.raises(OutFolderError, match=f"nothing was moved: {out / 'previous'} is as it was"):
        set_aside_previous_run(out)
    monkeypatch.undo()
    assert sorted((str(p.relative_to(tmp_path)), p.read_text()) for p in tmp_path.rglob("*") if p.is_file()) == before
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["previous"]


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


def test_replay_into_a_folder_with_the_users_page_and_plot_keeps_them_in_previous(tmp_path, monkeypatch, capsys):
    """The reviewer's case (finding 1) on the command itself: ``--out`` holding the user's own ``report.html`` and a
    plot-named PNG, no report.json. Before, only a folder holding a report.json or requests.jsonl was a run's, so
    nothing moved and write_report overwrote both silently."""
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "home"
    out.mkdir()
    (out / "report.html").write_text("my page\n")
    (out / "ttft_cdf.png").write_text("my plot\n")
    (out / "holiday.png").write_text("mine\n")
    with stub_router_thread() as (url, _stub):
        assert _replay(url, out) == 0
    err = capsys.readouterr().err
    assert f"moved to {out / 'previous'}/ (report.html, ttft_cdf.png;" in err, err
    assert (out / "previous" / "report.html").read_text() == "my page\n"
    assert (out / "previous" / "ttft_cdf.png").read_text() == "my plot\n"
    assert (out / "holiday.png").read_text() == "mine\n"
    assert (out / "report.html").read_text() != "my page\n" and (out / "report.json").is_file()


def test_a_second_replay_into_an_out_in_use_is_refused_naming_the_holder(tmp_path, monkeypatch, capsys):
    """Two runs into one ``--out`` at once (finding 2): the second moved the first's records to ``previous/`` and
    both wrote the same files, two runs lost without a word. Now the first holds ``OUT``'s lock for its whole run;
    the second says which process holds it and exits 2 before it sends anything or touches a file."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    state = tmp_path / "state"
    monkeypatch.setenv("EI_STATE_DIR", str(state))
    out = tmp_path / "g"
    root = Path(__file__).resolve().parents[3]
    env = os.environ | {"EI_STATE_DIR": str(state), "PYTHONPATH": str(root)}
    with stub_router_thread(hold=True) as (url, stub):  # the first run's first completion is never answered
        cmd = [sys.executable, "-m", "evolving_infra.cli", "replay", str(demo_trace_path()), "--router-url", url,
               "--speedup", "1000", "--sessions", "1", "--max-requests-per-branch", "1", "--out", str(out)]
        first = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not any(t == "/v1/completions" for t, _ in list(stub.seen)):
                assert first.poll() is None and time.monotonic() < deadline, first.communicate(timeout=10)
                time.sleep(0.05)
            before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "state" not in p.parts)
            assert _replay(url, out) == 2
            err = capsys.readouterr().err
            assert f"error: --out {out}: another run (pid {first.pid}) is writing to it" in err, err
            assert "Traceback" not in err
            assert sum(t == "/v1/completions" for t, _ in stub.seen) == 1  # the second sent nothing
            assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "state" not in p.parts) == before
            first.send_signal(signal.SIGTERM)  # the first writes what completed (nothing) and ends
            _, first_err = first.communicate(timeout=60)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(10)
        assert first.returncode == 128 + signal.SIGTERM, first_err
        assert (out / "report.json").is_file()
    with stub_router_thread() as (url, _stub):
        assert _replay(url, out) == 0  # the lock went with the first run
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no lock file left behind


def test_replay_and_demo_help_say_previous_keeps_only_the_last_run():
    """Finding 4: ``replay --help`` said nothing of ``previous/``, nor that it keeps one run, nor the refusals."""
    import argparse

    from evolving_infra.launcher import register as register_launcher
    from evolving_infra.replay.cli import LOCK
    from evolving_infra.replay.cli import register as register_replay

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register_replay(sub)
    register_launcher(sub)
    for command in ("replay", "demo"):
        text = " ".join(sub.choices[command].format_help().split())
        assert "OUT/previous/" in text and "only the last run's" in text, (command, text)
        assert "another run" in text and "stops" in text and f"OUT/{LOCK}" in text, (command, text)


def _files(folder) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return sorted((str(p.relative_to(folder)), p.read_text()) for p in folder.rglob("*") if p.is_file())


def test_a_replay_that_fails_during_its_run_leaves_out_as_it_was(tmp_path, monkeypatch):
    """The set-aside now comes once the replay has ended, just before its outputs are written, as ``simulate``'s:
    before, it came before the first request, so a replay that failed then (here its replayer raises after one
    record) had moved the earlier run's outputs to ``previous/`` and deleted the older ``previous/``, and left a
    ``requests.jsonl`` of its own in their place. Now ``OUT`` is as it was, the answered record kept in this run's
    own ``requests.partial-<run_id>.jsonl``; a run that answered none leaves no such file."""
    from evolving_infra.replay.live import LiveReplayer

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "g"
    _earlier_run(out / "previous", "older")
    _earlier_run(out, "earlier")
    (out / "holiday.png").write_text("mine\n")
    before = _files(out)
    real_run = LiveReplayer.run
    answered = {"n": 0}

    async def fails(self, requests, arrival, *, stop=None, on_record=None):  # type: ignore[no-untyped-def]
        if not answered.get("none"):  # its one request answered and appended, then the replayer fails
            answered["n"] = len((await real_run(self, requests, arrival, stop=stop, on_record=on_record)).records)
        raise RuntimeError("the replayer failed")

    monkeypatch.setattr(LiveReplayer, "run", fails)
    with stub_router_thread() as (url, _stub):
        with pytest.raises(RuntimeError, match="the replayer failed"):
            _replay(url, out)
        assert answered["n"] == 1
        partial = [p for p in out.iterdir() if p.name.startswith("requests.partial-")]
        assert len(partial) == 1 and partial[0].name.endswith(".jsonl"), sorted(p.name for p in out.iterdir())
        assert len(partial[0].read_text().splitlines()) == 1
        assert [f for f in _files(out) if not f[0].startswith("requests.partial-")] == before
        partial[0].unlink()
        answered["none"] = True  # fails before any record: no file of its own left either
        with pytest.raises(RuntimeError, match="the replayer failed"):
            _replay(url, out)
        assert _files(out) == before
        assert not (out / ".evolving-infra.lock").exists()
        with pytest.raises(RuntimeError, match="the replayer failed"):
            _replay(url, tmp_path / "new" / "out")
        assert not (tmp_path / "new").exists()  # the folders made for it taken back
        monkeypatch.setattr(LiveReplayer, "run", real_run)
        assert _replay(url, out) == 0  # a replay that ends: the earlier outputs set aside, its records file gone
    assert (out / "previous" / "report.json").read_text() == "earlier report.json\n"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("requests.")) == ["requests.jsonl"]
    assert (out / "holiday.png").read_text() == "mine\n"
