"""``simulate --sweep`` and ``fidelity`` write one run per sub-folder of ``--out`` (an item's, ``live/``, ``sim/``,
``sim-plain/``) and wrote each over the earlier run's in place, where ``simulate``, ``replay`` and ``demo`` never
overwrite a run's outputs (README: ``--out DIR``). Now an earlier run's files there move to that sub-folder's
``previous/`` once the new run has ended, just before its own are written
(:func:`~evolving_infra.out_folder.set_aside_or_elsewhere`); a sub-folder whose ``previous/`` holds the user's files is
refused before any run, as ``simulate`` refuses ``OUT/previous``."""

from __future__ import annotations

import asyncio
import json

from evolving_infra.cli import main
from evolving_infra.sim.config import SimConfig, SimConfigError
from evolving_infra.sim.sweep import run_sweep

from .conftest import BS, small_trace


def test_a_second_sweep_sets_each_items_earlier_run_aside(tmp_path, capfd):
    reqs = small_trace(6, 4, pause=0.02)
    cfg = SimConfig(nodes=3, profile="tiny", policy="static", concurrency=6)
    assert run_sweep(cfg, reqs, BS, ["splits"], tmp_path, plots=False) == 0
    first = {d: (tmp_path / d / "report.json").read_bytes() for d in ("static_1P2D", "static_2P1D")}
    (tmp_path / "static_1P2D" / "notes.txt").write_text("mine\n")
    capfd.readouterr()
    assert run_sweep(cfg, reqs, BS, ["splits"], tmp_path, plots=False, parallel=2) == 0  # in forked workers too
    err = capfd.readouterr().err
    for d, earlier in first.items():
        assert (tmp_path / d / "previous" / "report.json").read_bytes() == earlier
        assert sorted(p.name for p in (tmp_path / d / "previous").iterdir()) == ["decisions.jsonl", "report.json",
                                                                                  "requests.jsonl"]
        assert json.loads((tmp_path / d / "report.json").read_text())["requests_completed"] > 0
        assert f"moved to {tmp_path / d / 'previous'}/" in err, err
    assert (tmp_path / "static_1P2D" / "notes.txt").read_text() == "mine\n"


def test_a_sweep_whose_item_previous_holds_the_users_files_stops_before_any_run(tmp_path):
    reqs = small_trace(6, 4, pause=0.02)
    cfg = SimConfig(nodes=3, profile="tiny", policy="static", concurrency=6)
    item = tmp_path / "static_2P1D"
    (item / "previous").mkdir(parents=True)
    (item / "previous" / "my-notes.txt").write_text("mine\n")
    (item / "report.json").write_text("{}\n")
    try:
        run_sweep(cfg, reqs, BS, ["splits"], tmp_path, plots=False)
    except SimConfigError as e:
        assert str(e).startswith(f"--out {item}: {item / 'previous'} holds files that are not a run's outputs"), e
    else:
        raise AssertionError("not refused")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "static_2P1D", "static_2P1D/previous", "static_2P1D/previous/my-notes.txt", "static_2P1D/report.json"]


def test_fidelity_sets_each_sides_earlier_run_aside_and_refuses_a_users_previous_first(tmp_path, monkeypatch, capsys):
    from evolving_infra import cluster as cluster_mod
    from evolving_infra.replay import live as live_mod
    from evolving_infra.sim.fidelity import FidelitySettings, run_live, run_sim

    from .test_fidelity_live_meta import FakeCluster, FakeReplayer

    monkeypatch.setattr(cluster_mod, "LocalCluster", FakeCluster)
    monkeypatch.setattr(live_mod, "LiveReplayer", FakeReplayer)
    s = FidelitySettings(nodes=3, split="1P2D", profile="tiny", concurrency=6)
    reqs = small_trace(4, 3, pause=0.02)
    for _ in range(2):
        asyncio.run(run_live(s, [], 512, tmp_path / "live"))
        run_sim(s, reqs, BS, tmp_path / "sim")
    for side in ("live", "sim"):
        assert sorted(p.name for p in (tmp_path / side / "previous").iterdir()) == ["report.json", "requests.jsonl"]
    assert "fidelity: the outputs in" in capsys.readouterr().err

    out = tmp_path / "f"
    (out / "sim-plain" / "previous").mkdir(parents=True)
    (out / "sim-plain" / "previous" / "my-notes.txt").write_text("mine\n")
    (out / "sim-plain" / "report.json").write_text("{}\n")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert main(["fidelity", "--out", str(out), "--nodes", "2", "--split", "1P1D"]) == 2
    err = capsys.readouterr().err
    assert f"error: --out {out}: {out / 'sim-plain' / 'previous'} holds files that are not a run's outputs" in err, err
    assert "Traceback" not in err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
