"""`simulate` shows how far it has got on stderr, also when stderr is a file or a pipe."""

from __future__ import annotations

import io

from evolving_infra.sim import run as sim_run
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import ProgressLine, simulate

from .conftest import BS, small_trace


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_not_a_terminal_prints_whole_lines_every_few_seconds():
    out = io.StringIO()
    p = ProgressLine("simulate", 3600.0, stream=out)
    assert not p.tty and p.every_s == 5.0
    p(10.0, 3)  # before every_s: nothing
    assert out.getvalue() == ""
    p.next_at = 0.0
    p(1800.0, 1234)
    line = out.getvalue()
    assert line.startswith("simulate: 1,800 of 3,600 simulated s (50%), 1,234 requests completed, ") and line.endswith(" s wall\n")
    assert "\r" not in line
    p.close()
    assert out.getvalue() == line


def test_progress_line_on_a_terminal_redraws_one_line():
    out = _Tty()
    p = ProgressLine("partition 2/8", None, stream=out)
    assert p.tty and p.every_s == 0.5
    p.next_at = 0.0
    p(42.0, 7)
    p.next_at = 0.0
    p(84.0, 9)
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and "partition 2/8: 84 simulated s, 9 requests completed" in text


def test_simulate_with_progress_writes_to_stderr(monkeypatch, capsys):
    monkeypatch.setattr(sim_run.ProgressLine, "__init__", _every_call(ProgressLine.__init__))
    reqs = small_trace(8, 6, pause=0.05)
    res = simulate(SimConfig(nodes=2, profile="tiny", policy="static:1P1D", concurrency=4), reqs, BS, progress=True)
    err = capsys.readouterr().err
    assert res.report["requests_completed"] == len(reqs)
    assert err.count("simulate: ") >= 1 and "requests completed" in err
    simulate(SimConfig(nodes=2, profile="tiny", policy="static:1P1D", concurrency=4), reqs, BS)
    assert capsys.readouterr().err == ""  # off unless asked (sweeps, benchmarks)


def _every_call(init):
    def patched(self, label, duration_s, every_s=5.0, stream=None, redraw=True):
        init(self, label, duration_s, every_s, stream, redraw)
        self.every_s = 0.0
        self.next_at = 0.0

    return patched


def test_progress_is_consulted_every_256_events(monkeypatch):
    """An ``evolving`` event can cost milliseconds: every 4,096 events left 31-s gaps between lines."""
    calls = []
    monkeypatch.setattr(sim_run.ProgressLine, "__call__", lambda self, now, completed: calls.append(now))
    reqs = small_trace(40, 12, pause=0.05)
    res = simulate(SimConfig(nodes=2, profile="tiny", policy="static:1P1D", concurrency=4), reqs, BS, progress=True)
    events = res.report["sim_stats"]["events"]
    assert events > 1024 and len(calls) >= events // 256, (events, len(calls))


def test_a_sweep_shows_each_item_progress_labelled(monkeypatch, tmp_path, capsys):
    """``simulate --sweep`` ran its items with no progress at all: minutes of silence for a sweep of 3,600-s
    runs, though ``simulate`` alone shows it. Each item's lines name it and its place in the sweep."""
    from evolving_infra.sim.sweep import run_sweep

    monkeypatch.setattr(sim_run.ProgressLine, "__init__", _every_call(ProgressLine.__init__))
    reqs = small_trace(6, 4, pause=0.02)
    cfg = SimConfig(nodes=3, profile="tiny", policy="static", concurrency=6)
    assert run_sweep(cfg, reqs, BS, ["splits"], tmp_path, plots=False) == 0
    err = capsys.readouterr().err
    assert "static:1P2D (1/2): " in err and "static:2P1D (2/2): " in err and "requests completed" in err, err


def test_progress_line_without_redraw_writes_whole_lines_on_a_terminal():
    """Parallel sweep workers share one terminal: each writes whole lines, never a ``\\r`` redraw of another's."""
    out = _Tty()
    p = ProgressLine("dynamo (2/4)", 100.0, stream=out, redraw=False)
    assert not p.tty and p.every_s == 5.0
    p.next_at = 0.0
    p(50.0, 3)
    assert out.getvalue().startswith("dynamo (2/4): 50 of 100 simulated s (50%)") and "\r" not in out.getvalue()


class _TtyFile:
    """A terminal stand-in the forked partition workers can write to: a file on disk that says it is a tty."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, s: str) -> int:
        return self.f.write(s)

    def flush(self) -> None:
        self.f.flush()

    def isatty(self) -> bool:
        return True


def test_parallel_partitions_on_a_terminal_write_whole_lines(monkeypatch, tmp_path):
    """``simulate --workers 2 --partitions 2`` on a terminal: each partition process redrew its line with ``\\r``
    over the other's, so neither could be read. Processes sharing the terminal now write whole lines, each
    named by its partition; one process (``--workers 1``) still redraws its line."""
    from dataclasses import replace

    monkeypatch.setattr(sim_run.ProgressLine, "__init__", _every_call(ProgressLine.__init__))
    reqs = small_trace(10, 4, pause=0.05)
    cfg = SimConfig(nodes=4, profile="tiny", policy="static:1P1D", partitions=2, concurrency=6)
    for workers in (2, 1):
        path = tmp_path / f"err{workers}"
        with path.open("w") as f:
            monkeypatch.setattr(sim_run.sys, "stderr", _TtyFile(f))
            simulate(replace(cfg, workers=workers), reqs, BS, progress=True)
        text = path.read_bytes().decode()  # (read_text would turn each CR into a newline)
        assert "partition 1/2: " in text and "partition 2/2: " in text, text
        if workers == 2:
            assert "\r" not in text and all(line.startswith("partition ") for line in text.splitlines()), text
        else:
            assert "\r" in text


def test_a_policies_sweep_gives_planner_options_only_to_planners_that_take_them(tmp_path, capsys):
    """``--sweep policies evolving,static:... --planner-opt t_learn_s=240`` failed on the static item
    (``planner 'static' takes no parameters``): each item now gets the options its planner takes, and the
    output says which were left out. A name no item's planner takes is still refused."""
    from evolving_infra.sim.sweep import fit_planner_options, run_sweep, sweep_items

    reqs = small_trace(6, 4, pause=0.02)
    cfg = SimConfig(nodes=3, profile="tiny", policy="static", concurrency=6, planner_options={"t_learn_s": 240.0})
    assert run_sweep(cfg, reqs, BS, ["policies", "evolving,static:2P1D"], tmp_path, plots=False) == 0
    out = capsys.readouterr().err  # a note about the settings, before the run: on stderr
    assert ("note: static:2P1D: --planner-opt t_learn_s not given (planner 'static' does not take it; the sweep gives each "
            "item the options its planner takes, where a single run of static:2P1D refuses them)") in out, out
    items, notes = fit_planner_options(sweep_items(cfg, ["policies", "evolving,static:2P1D,dynamo"]))
    assert [c.planner_options for _, c in items] == [{"t_learn_s": 240.0}, {}, {}] and len(notes) == 2
    typo = SimConfig(nodes=3, profile="tiny", policy="static", planner_options={"t_lern_s": 1.0})
    items, notes = fit_planner_options(sweep_items(typo, ["policies", "evolving,static:2P1D"]))
    assert [c.planner_options for _, c in items] == [{"t_lern_s": 1.0}] * 2 and not notes
