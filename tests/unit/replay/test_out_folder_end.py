"""What happens to ``--out`` at a run's end and around it (review of eb1d988/a67898d, rr-ops51):

- The set-aside of an earlier run's outputs comes once the run has ended; when it is refused then (a
  ``report show OUT/previous`` holding that folder's lock, the user's files put in ``OUT/previous`` during the run),
  the finished run's report was not written at all (exit 2, only the appended records kept). Now
  :func:`~evolving_infra.out_folder.set_aside_or_elsewhere` waits a few seconds for such a show, then writes the
  run's outputs to ``OUT/run-<run_id>/``, named on stderr, and the command exits 4 (``OUTPUTS_ELSEWHERE``):
  ``OUT/report.json`` is still the earlier run's (see also test_out_folder_elsewhere).
- ``fidelity`` and ``simulate --sweep`` set aside per sub-folder, but what a run killed during such a set-aside left
  there (``SUB/.previous.tmp-PID-N``) was never put back: only ``OUT`` itself was searched.
- A fidelity with no control plane measured left an older run's ``sim-plain/`` looking current.
- ``replay``'s first SIGTERM/SIGINT was lost when stderr was a closed pipe (its line printed before the stop).
- A killed run's ``requests.partial-*.jsonl`` went unmentioned forever.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from evolving_infra.launcher import demo_trace_path
from evolving_infra.out_folder import OUTPUTS_ELSEWHERE, PREVIOUS, hold_out
from tests.unit.replay.stub_router import stub_router_thread

ROOT = Path(__file__).resolve().parents[3]
NAMES = ("report.json", "requests.jsonl", "report.html")


def _earlier_run(out: Path, tag: str) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    for n in NAMES:
        (out / n).write_text(f"{tag} {n}\n")
    return {n: f"{tag} {n}\n" for n in NAMES}


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}


def _replay(url: str, out: Path) -> int:
    from evolving_infra.cli import main

    return main(["replay", str(demo_trace_path()), "--router-url", url, "--speedup", "1000", "--sessions", "1",
                 "--max-requests-per-branch", "1", "--out", str(out)])


def test_a_set_aside_waits_for_a_report_show_of_previous_to_end(tmp_path, capsys):
    from evolving_infra.out_folder import set_aside_or_elsewhere

    out = tmp_path / "o"
    _earlier_run(out / PREVIOUS, "older")
    earlier = _earlier_run(out, "earlier")
    shown = threading.Event()

    def show() -> None:  # a `report show OUT/previous` redrawing for 0.6 s
        with hold_out(out / PREVIOUS):
            shown.set()
            time.sleep(0.6)

    t = threading.Thread(target=show)
    t.start()
    shown.wait(5)
    try:
        with hold_out(out):
            assert set_aside_or_elsewhere(out, "replay", "abc", wait_s=10) == out
    finally:
        t.join()
    assert _files(out / PREVIOUS) == earlier
    assert "moved to" in capsys.readouterr().err


def test_a_set_aside_still_refused_sends_the_outputs_to_a_run_folder(tmp_path, capsys):
    from evolving_infra.out_folder import set_aside_or_elsewhere

    out = tmp_path / "o"
    older = _earlier_run(out / PREVIOUS, "older")
    earlier = _earlier_run(out, "earlier")
    with hold_out(out / PREVIOUS), hold_out(out):  # the show never ends within the wait
        t0 = time.monotonic()
        dest = set_aside_or_elsewhere(out, "replay", "abc", wait_s=0.5)
        assert 0.4 < time.monotonic() - t0 < 5
    assert dest == out / "run-abc" and dest.is_dir() and not any(dest.iterdir())
    err = capsys.readouterr().err
    assert f"this run's outputs are written to {out / 'run-abc'}/ instead" in err and "is writing to" in err, err
    assert "wait for it to end" not in err and "choose another --out" not in err, err  # advice for a refusal, not this
    assert _files(out) == earlier and _files(out / PREVIOUS) == older  # nothing moved


def test_a_replay_whose_set_aside_is_refused_at_its_end_writes_its_report_to_a_run_folder(tmp_path, monkeypatch,
                                                                                          capsys):
    """The reviewer's demo 1: a file of the user's put in ``OUT/previous`` during the replay. Before: exit 2,
    'this run's report was not written', only the records file left."""
    from evolving_infra.replay.live import LiveReplayer

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "g"
    older = _earlier_run(out / PREVIOUS, "older")
    earlier = _earlier_run(out, "earlier")
    real_run = LiveReplayer.run

    async def run(self, requests, arrival, *, stop=None, on_record=None):  # type: ignore[no-untyped-def]
        result = await real_run(self, requests, arrival, stop=stop, on_record=on_record)
        (out / PREVIOUS / "my-notes.txt").write_text("mine\n")  # the user's, put there during the run
        return result

    monkeypatch.setattr(LiveReplayer, "run", run)
    with stub_router_thread() as (url, _stub):
        assert _replay(url, out) == OUTPUTS_ELSEWHERE == 4  # OUT/report.json is the earlier run's: not 0
    err = capsys.readouterr().err
    runs = [p for p in out.iterdir() if p.name.startswith("run-")]
    assert len(runs) == 1, (sorted(p.name for p in out.iterdir()), err)
    report = json.loads((runs[0] / "report.json").read_text())
    assert runs[0].name == f"run-{report['meta']['run_id']}"
    assert (runs[0] / "requests.jsonl").read_text().count("\n") == report["requests_completed"] == 1
    assert f"this run's outputs are written to {runs[0]}/ instead" in err, err
    assert _files(out) == earlier and _files(out / PREVIOUS) == {**older, "my-notes.txt": "mine\n"}
    assert not list(out.glob("requests.partial-*"))  # its records are in run-<id>/requests.jsonl


def test_a_simulate_whose_set_aside_is_refused_at_its_end_writes_its_report_to_a_run_folder(tmp_path, monkeypatch,
                                                                                            capsys):
    import evolving_infra.sim.run as sim_run
    from evolving_infra.cli import main

    out = tmp_path / "o"
    older = _earlier_run(out / PREVIOUS, "older")
    earlier = _earlier_run(out, "earlier")
    real = sim_run.simulate

    def simulate(*a, **k):  # type: ignore[no-untyped-def]
        res = real(*a, **k)
        (out / PREVIOUS / "my-notes.txt").write_text("mine\n")
        return res

    monkeypatch.setattr(sim_run, "simulate", simulate)
    sample = ROOT / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    assert main(["simulate", "--trace", str(sample), "--duration", "5", "--no-plots", "--out", str(out)]) == OUTPUTS_ELSEWHERE
    err = capsys.readouterr().err
    runs = [p for p in out.iterdir() if p.name.startswith("run-")]
    assert len(runs) == 1 and f"written to {runs[0]}/ instead" in err, err
    assert runs[0].name == f"run-{json.loads((runs[0] / 'report.json').read_text())['meta']['run_id']}"
    assert {"report.json", "requests.jsonl", "decisions.jsonl"} <= set(_files(runs[0]))
    assert _files(out) == earlier and _files(out / PREVIOUS) == {**older, "my-notes.txt": "mine\n"}


def test_a_sweep_puts_back_what_a_sweep_killed_during_an_items_set_aside_left(tmp_path, capsys):
    """The reviewer's e2: the item's outputs moved into its staging folder by a killed sweep stayed hidden there."""
    from evolving_infra.sim.config import SimConfig
    from evolving_infra.sim.sweep import run_sweep
    from tests.unit.sim.conftest import BS, small_trace

    out = tmp_path / "o"
    reqs = small_trace(6, 4, pause=0.02)
    cfg = SimConfig(nodes=3, profile="tiny", policy="static", concurrency=6)
    with hold_out(out):
        run_sweep(cfg, reqs, BS, ["splits"], out, plots=False)
    item = out / "static_1P2D"
    first = _files(item)
    tmp = item / ".previous.tmp-424242-0"  # killed in the middle of this item's set-aside
    tmp.mkdir()
    for n in ("report.json", "requests.jsonl", "decisions.jsonl"):
        (item / n).rename(tmp / n)
    capsys.readouterr()
    with hold_out(out):  # as simulate --sweep holds OUT
        run_sweep(cfg, reqs, BS, ["splits"], out, plots=False)
    err = capsys.readouterr().err
    assert not tmp.exists(), sorted(p.name for p in item.iterdir())
    assert f"note: --out {item}: a run (pid 424242)" in err, err
    assert _files(item / PREVIOUS) == first  # the killed sweep's item outputs, set aside as it meant to


def test_fidelity_puts_back_what_a_fidelity_killed_during_a_sides_set_aside_left(tmp_path, capsys, monkeypatch):
    import evolving_infra.sim.fidelity as fid
    from evolving_infra.cli import main
    from evolving_infra.sim.config import SimConfigError

    out = tmp_path / "o"
    side = out / "sim"
    staged = side / ".previous.tmp-424242-0"
    staged.mkdir(parents=True)
    (staged / "report.json").write_text("killed run's\n")

    def stop_here(s, o):  # type: ignore[no-untyped-def]  # nothing run: the checks before it are what is tested
        raise SimConfigError("stopped by the test")

    monkeypatch.setattr(fid, "fidelity", stop_here)
    assert main(["fidelity", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert not staged.exists() and (side / "report.json").read_text() == "killed run's\n", err
    assert f"note: --out {side}: a run (pid 424242)" in err and "stopped by the test" in err, err


def test_a_fidelity_without_a_control_plane_sets_an_older_sim_plain_aside(tmp_path, capsys, monkeypatch):
    import evolving_infra.sim.fidelity as fid

    out = tmp_path / "o"
    older = _earlier_run(out / "sim-plain", "older")

    async def run_live(s, requests, bs, where):  # type: ignore[no-untyped-def]
        return {}, [], where

    monkeypatch.setattr(fid, "load_requests", lambda s: ([], 64, "t"))
    monkeypatch.setattr(fid, "run_live", run_live)
    monkeypatch.setattr(fid, "control_plane", lambda records: None)
    monkeypatch.setattr(fid, "run_sim", lambda s, requests, bs, where, cp=None: ({}, where))
    fid.fidelity(fid.FidelitySettings(), out)
    assert _files(out / "sim-plain") == {} and _files(out / "sim-plain" / PREVIOUS) == older
    assert "fidelity: the outputs in" in capsys.readouterr().err


def test_a_replay_notes_leftover_partial_records_and_names_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "g"
    out.mkdir()
    (out / "requests.partial-0123456789ab.jsonl").write_text("{}\n")
    with stub_router_thread() as (url, _stub):
        assert _replay(url, out) == 0
    err = capsys.readouterr().err
    assert "note: replay: --out" in err and "requests.partial-0123456789ab.jsonl" in err and "killed" in err, err
    run_id = json.loads((out / "report.json").read_text())["meta"]["run_id"]
    assert f"appended to {out / f'requests.partial-{run_id}.jsonl'}" in err, err
    assert (out / "requests.partial-0123456789ab.jsonl").read_text() == "{}\n"  # left in place


def test_a_replay_stops_on_its_first_sigterm_with_stderr_a_closed_pipe(tmp_path):
    """The reviewer's e4: the handler printed before setting the stop; with stderr a closed pipe the print raised
    BrokenPipeError and the signal was lost (still running 15 s later)."""
    out = tmp_path / "o"
    env = os.environ | {"PYTHONPATH": str(ROOT), "EI_STATE_DIR": str(tmp_path / "state")}
    with stub_router_thread(hold=True) as (url, _stub):
        p = subprocess.Popen([sys.executable, "-m", "evolving_infra.cli", "replay", str(demo_trace_path()),
                              "--router-url", url, "--speedup", "1000", "--sessions", "1", "--out", str(out)],
                             env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            t0 = time.monotonic()
            while not list(out.glob("requests.partial-*")) and time.monotonic() - t0 < 60:
                time.sleep(0.1)
            time.sleep(1)  # its requests in flight (the stub holds them)
            assert p.stderr is not None
            p.stderr.close()
            p.send_signal(signal.SIGTERM)
            rc = p.wait(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rc == 128 + signal.SIGTERM, rc
    assert (out / "report.json").is_file()
    assert json.loads((out / "report.json").read_text())["meta"]["interrupted"]["signal"] == "SIGTERM"


def test_recover_set_aside_of_a_missing_folder_says_nothing(tmp_path, capsys):
    from evolving_infra.out_folder import recover_set_aside

    assert recover_set_aside(tmp_path / "none") == []
    assert capsys.readouterr().err == ""


def test_report_show_on_a_file_system_without_flock_prints_the_summary(tmp_path, capsys, monkeypatch):
    """The no-flock refusal said 'choose an --out' to ``report show`` (which has none) and named Lustre noflock for
    NFS's ENOLCK; ``report show`` stopped there. Now it prints the summary, as for a read-only folder, and the line
    names the likely cause of each error."""
    import errno
    import fcntl

    from evolving_infra.cli import main

    run = tmp_path / "run"
    sample = ROOT / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    assert main(["simulate", "--trace", str(sample), "--duration", "5", "--no-plots", "--out", str(run)]) == 0
    capsys.readouterr()

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert main(["report", "show", str(run)]) == 2
    captured = capsys.readouterr()
    assert "requests" in captured.out  # the summary
    err = captured.err
    assert "NFS without its lock manager?" in err and "Lustre" not in err and "--out" not in err, err
    assert "the plots and report.html not written; use --no-plots" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert main(["simulate", "--trace", str(sample), "--duration", "5", "--no-plots", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"error: --out {run}: cannot lock" in err and "use a folder on another file system" in err, err
