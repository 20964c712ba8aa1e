"""A finished run whose earlier outputs cannot be set aside at its end (review of e145905, rr-ops51b):

- ``simulate --sweep`` and ``fidelity`` set aside per sub-folder with no wait and no fallback: a 1-s
  ``report show ITEM/previous`` during an item killed the sweep (that item's report lost, the later items never run);
  they now wait for it and, still refused, write that run to ``SUB/run-<id>/``, which ``sweep.json``, ``compare/``
  and ``fidelity.json`` name and read.
- The fallback exited 0 while ``OUT/report.json`` was the earlier run's: now 4 (``OUTPUTS_ELSEWHERE``), and its
  warning no longer ends with a refusal's "wait for it to end, or choose another --out".
- A fidelity with no control plane made an empty ``OUT/sim-plain/``; ``simulate``'s fallback folder was left empty
  when its report could not be written; the set-aside moved ``previous/`` without holding its lock; replay's
  stderr redirect to /dev/null fired for a stderr that was not file descriptor 2.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from evolving_infra.out_folder import LOCK, OUTPUTS_ELSEWHERE, PREVIOUS, hold_out

ROOT = Path(__file__).resolve().parents[3]


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}


def _sweep(out: Path) -> int:
    from evolving_infra.sim.config import SimConfig
    from evolving_infra.sim.sweep import run_sweep
    from tests.unit.sim.conftest import BS, small_trace

    cfg = SimConfig(nodes=3, profile="tiny", policy="static", concurrency=6)
    with hold_out(out):  # as simulate --sweep holds OUT
        return run_sweep(cfg, small_trace(6, 4, pause=0.02), BS, ["splits"], out, plots=False)


def _show_during_item(monkeypatch, item: Path, seconds: float) -> list[threading.Thread]:
    """A ``report show ITEM/previous`` that starts once the item's run has ended and lasts ``seconds``."""
    import evolving_infra.sim.run as sim_run

    real = sim_run.simulate
    shows: list[threading.Thread] = []

    def simulate(*a, **k):  # type: ignore[no-untyped-def]
        res = real(*a, **k)
        if not shows and k["meta"]["sweep_label"] == "static:1P2D":
            started = threading.Event()

            def show() -> None:
                with hold_out(item / PREVIOUS):
                    started.set()
                    time.sleep(seconds)

            shows.append(threading.Thread(target=show))
            shows[0].start()
            started.wait(5)
        return res

    monkeypatch.setattr(sim_run, "simulate", simulate)
    return shows


def test_a_sweep_waits_for_a_short_report_show_of_an_items_previous(tmp_path, monkeypatch, capsys):
    """The reviewer's e4: before, SimConfigError ('... is writing to ...; this item's report was not written')."""
    out = tmp_path / "o"
    assert _sweep(out) == 0
    item = out / "static_1P2D"
    first = _files(item)
    shows = _show_during_item(monkeypatch, item, 1.0)
    capsys.readouterr()
    try:
        assert _sweep(out) == 0
    finally:
        for t in shows:
            t.join()
    assert shows and _files(item / PREVIOUS) == first
    assert json.loads((out / "sweep.json").read_text())["items"][0]["dir"] == str(item)
    assert "run-" not in " ".join(p.name for p in item.iterdir())


def test_a_sweep_item_whose_previous_stays_held_is_written_to_a_run_folder_and_exits_4(tmp_path, monkeypatch, capsys):
    import evolving_infra.out_folder as of

    out = tmp_path / "o"
    assert _sweep(out) == 0
    item = out / "static_1P2D"
    first = _files(item)
    monkeypatch.setattr(of, "SET_ASIDE_WAIT_S", 0.3)
    shows = _show_during_item(monkeypatch, item, 3.0)
    capsys.readouterr()
    try:
        assert _sweep(out) == OUTPUTS_ELSEWHERE == 4
    finally:
        for t in shows:
            t.join()
    captured = capsys.readouterr()
    runs = [p for p in item.iterdir() if p.name.startswith("run-")]
    assert len(runs) == 1, sorted(p.name for p in item.iterdir())
    assert _files(item) == first  # the earlier sweep's item, not moved, not overwritten
    report = json.loads((runs[0] / "report.json").read_text())
    assert runs[0].name == f"run-{report['meta']['run_id']}"
    rows = json.loads((out / "sweep.json").read_text())["items"]
    assert [(r["dir"], r["elsewhere"]) for r in rows] == [(str(runs[0]), True), (str(out / "static_2P1D"), False)]
    compared = json.loads((out / "compare" / "compare.json").read_text())["runs"]
    assert [r["dir"] for r in compared] == [str(runs[0]), str(out / "static_2P1D")]  # this sweep's, not the earlier
    assert f"this run's outputs are written to {runs[0]}/ instead" in captured.err, captured.err
    assert "wait for it to end" not in captured.err, captured.err
    assert str(runs[0]) in captured.out and "exit status 4" in captured.out, captured.out


def _fidelity_parts(monkeypatch, cp: object | None):  # type: ignore[no-untyped-def]
    import evolving_infra.sim.fidelity as fid
    from tests.unit.sim.conftest import BS, small_trace

    async def run_live(s, requests, bs, where):  # type: ignore[no-untyped-def]  # the live side: not what is tested
        where.mkdir(parents=True, exist_ok=True)
        return {"requests_failed": 0}, [], where

    monkeypatch.setattr(fid, "load_requests", lambda s: (small_trace(4, 3, pause=0.02), BS, "t"))
    monkeypatch.setattr(fid, "run_live", run_live)
    monkeypatch.setattr(fid, "control_plane", lambda records: cp)
    return fid, fid.FidelitySettings(nodes=3, split="1P2D", profile="tiny", concurrency=6)


def test_a_fidelity_side_whose_previous_stays_held_is_written_to_a_run_folder_and_exits_4(tmp_path, monkeypatch,
                                                                                          capsys):
    import evolving_infra.out_folder as of

    fid, s = _fidelity_parts(monkeypatch, None)
    out = tmp_path / "f"
    (out / "sim" / PREVIOUS).mkdir(parents=True)
    (out / "sim" / "report.json").write_text("earlier\n")
    monkeypatch.setattr(of, "SET_ASIDE_WAIT_S", 0.3)
    with hold_out(out / "sim" / PREVIOUS):  # a report show of sim/previous lasting the whole run
        assert fid._fidelity_held(s, out) == OUTPUTS_ELSEWHERE
    captured = capsys.readouterr()
    res = json.loads((out / "fidelity.json").read_text())
    written = Path(res["dirs"]["sim"])
    assert written.parent == out / "sim" and written.name.startswith("run-"), res["dirs"]
    assert res["dirs"]["sim_plain"] == str(written) and res["outputs_elsewhere"] == ["sim"], res
    assert res["dirs"]["live"] == str(out / "live")
    assert json.loads((written / "report.json").read_text())["meta"]["run_id"] == written.name[4:]
    assert (out / "sim" / "report.json").read_text() == "earlier\n"
    assert not (out / "sim-plain").exists()  # no control plane, no sim-plain folder before: none made
    assert f"written to {written}/ instead" in captured.err and "exit status 4" in captured.out, captured


def test_a_fidelity_without_a_control_plane_makes_no_sim_plain_folder(tmp_path, monkeypatch, capsys):
    fid, s = _fidelity_parts(monkeypatch, None)
    out = tmp_path / "f"
    assert fid._fidelity_held(s, out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["fidelity.json", "live", "sim"]
    res = json.loads((out / "fidelity.json").read_text())
    assert res["dirs"] == {"live": str(out / "live"), "sim": str(out / "sim"), "sim_plain": str(out / "sim")}
    assert res["outputs_elsewhere"] == []


def test_a_simulate_whose_report_cannot_be_written_in_its_run_folder_leaves_none(tmp_path, monkeypatch, capsys):
    import evolving_infra.report.write as rw
    import evolving_infra.sim.run as sim_run
    from evolving_infra.cli import main

    out = tmp_path / "o"
    (out / PREVIOUS).mkdir(parents=True)
    (out / "report.json").write_text("earlier\n")
    real = sim_run.simulate

    def simulate(*a, **k):  # type: ignore[no-untyped-def]
        res = real(*a, **k)
        (out / PREVIOUS / "my-notes.txt").write_text("mine\n")  # the set-aside is refused: the fallback is taken
        return res

    def full_disk(*a, **k):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sim_run, "simulate", simulate)
    monkeypatch.setattr(rw, "write_report", full_disk)
    sample = ROOT / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    assert main(["simulate", "--trace", str(sample), "--duration", "5", "--no-plots", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "written to" in err, err
    assert sorted(p.name for p in out.iterdir()) == [PREVIOUS, "report.json"]  # no empty run-<id>/


def test_the_set_aside_holds_previouss_lock_while_it_moves(tmp_path, monkeypatch):
    """The set-aside checked previous/'s lock, then moved it without holding it: a ``report show`` of it starting in
    between redrew into the folder being replaced."""
    import evolving_infra.out_folder as of

    out = tmp_path / "o"
    (out / PREVIOUS).mkdir(parents=True)
    (out / PREVIOUS / "report.json").write_text("older\n")
    (out / "report.json").write_text("earlier\n")
    seen: list[str | None] = []
    real_rename = os.rename

    def rename(a, b):  # type: ignore[no-untyped-def]
        seen.append(of._lock_holder(out / PREVIOUS) if (out / PREVIOUS).is_dir() else "gone")
        return real_rename(a, b)

    monkeypatch.setattr(of.os, "rename", rename)
    with hold_out(out):
        assert of.set_aside_previous_run(out) == ["report.json"]
        with hold_out(out / PREVIOUS):  # a report show now: the move is refused before anything moves
            (out / "report.json").write_text("next\n")
            with pytest.raises(of.OutFolderError, match="wait for it to end"):
                of.set_aside_previous_run(out)
    assert seen[0] == f"another run (pid {os.getpid()})", seen  # held during the move (before: None)
    assert _files(out / PREVIOUS) == {"report.json": "earlier\n"}  # no lock file left in the new previous/
    assert not list(out.glob(".previous.*")) and (out / "report.json").read_text() == "next\n"
    assert not (out / PREVIOUS / LOCK).exists()


def test_a_failed_set_aside_leaves_previous_as_it_was_and_no_lock_file_in_it(tmp_path, monkeypatch):
    import evolving_infra.out_folder as of

    out = tmp_path / "o"
    (out / PREVIOUS).mkdir(parents=True)
    (out / PREVIOUS / "report.json").write_text("older\n")
    (out / "report.json").write_text("earlier\n")
    real_rename = os.rename

    def rename(a, b):  # type: ignore[no-untyped-def]  # the last step (the staged folder becomes previous/) fails
        if Path(b) == out / PREVIOUS and Path(a).name.startswith(".previous.tmp"):
            raise OSError(28, "No space left on device", str(b))
        return real_rename(a, b)

    monkeypatch.setattr(of.os, "rename", rename)
    with pytest.raises(of.OutFolderError, match="cannot move"):
        of.set_aside_previous_run(out)
    assert _files(out / PREVIOUS) == {"report.json": "older\n"}  # its lock file, made for the move, removed again
    assert _files(out) == {"report.json": "earlier\n"} and not list(out.glob(".previous.*"))


def test_stderr_to_devnull_leaves_descriptor_2_alone_when_stderr_is_not_it(monkeypatch, capsys):
    """A library caller (a test's capture, a GUI) that replaced sys.stderr keeps its descriptor 2 as it was."""
    import evolving_infra.replay.cli as rc

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(rc.os, "dup2", lambda a, b: calls.append((a, b)))
    rc._stderr_to_devnull()  # sys.stderr is pytest's capture here: no fileno
    assert calls == []
