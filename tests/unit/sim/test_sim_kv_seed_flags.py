"""``simulate`` flags a researcher's own small trace needs: ``--gpu-kv-tokens`` / ``--host-kv-tokens`` (alias
``--host-capacity-tokens``) so that it can evict, what ``--seed`` moves (and a note when it moves nothing), and the
sweep's notes (a ``--planner-opt`` left out of an item, a baseline planner that never adapted)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from evolving_infra.cli import build_parser, main
from evolving_infra.sim.config import SimConfig, SimConfigError, resolve, seed_draws, seed_unused_note
from evolving_infra.sim.sweep import fit_planner_options, never_adapted_note, sweep_items

RUN = ["simulate", "--workload", "claude-code", "--agents", "12", "--nodes", "2", "--policy", "static:1P1D",
       "--concurrency", "12", "--duration", "1500", "--no-plots"]


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_lower_gpu_and_host_kv_make_a_small_trace_evict(tmp_path: Path):
    """12 generated agents on 2 default nodes never fill 2.06M tokens of GPU KV: no reuse lost. With
    --gpu-kv-tokens 600000 and --host-kv-tokens 600000 (before: no GPU flag, and a host capacity below the
    profile's GPU KV refused) they do, and the reuse lost is eviction's; both values reach report meta."""
    assert main([*RUN, "--out", str(tmp_path / "big")]) == 0
    big = _report(tmp_path / "big")
    assert big["lost_kv_reuse"] == 0.0 and big["meta"]["gpu_kv_tokens"] == 2_060_000
    assert main([*RUN, "--out", str(tmp_path / "small"), "--gpu-kv-tokens", "600000", "--host-kv-tokens", "600000"]) == 0
    small = _report(tmp_path / "small")
    assert small["meta"]["gpu_kv_tokens"] == 600_000 and small["meta"]["host_kv_tokens"] == 600_000
    assert small["lost_kv_reuse"] > 0.05 and small["lost_kv_reuse_eviction_share"] > 0.9
    assert small["requests_failed"] == 0


def test_host_flag_names_and_the_error_naming_them(capsys: pytest.CaptureFixture[str]):
    p = build_parser()
    for flag in ("--host-kv-tokens", "--host-capacity-tokens"):
        args = p.parse_args(["simulate", "--workload", "putnam", flag, "5000", "--gpu-kv-tokens", "4000"])
        assert (args.host_capacity_tokens, args.gpu_kv_tokens) == (5000, 4000)
    with pytest.raises(SystemExit):
        p.parse_args(["simulate", "--help"])
    helptext = capsys.readouterr().out
    assert "--host-kv-tokens N, --host-capacity-tokens N" in helptext and "--gpu-kv-tokens N" in helptext
    with pytest.raises(SimConfigError, match=r"--host-kv-tokens 40000 is below the node's GPU KV capacity \(2060000 "
                       r"tokens, profile 'gb300-glm52'\).*lower --gpu-kv-tokens"):
        resolve(SimConfig(host_capacity_tokens=40_000))
    with pytest.raises(SimConfigError, match="--host-kv-tokens 1024000 is below .*--gpu-kv-tokens 2048000"):
        resolve(SimConfig(gpu_kv_tokens=2_048_000, host_capacity_tokens=1_024_000))
    mem = resolve(SimConfig(gpu_kv_tokens=32_000, host_capacity_tokens=40_000)).profile.memory
    assert (mem.gpu_kv_tokens, mem.host_kv_tokens) == (32_000, 40_000)
    small = SimConfig(nodes=3, gpu_kv_tokens=32_000, host_capacity_tokens=40_000)
    for spec in (["policies", "dynamo,static:1P2D"], ["splits"]):  # every sweep item runs with them
        for _label, c in sweep_items(small, spec):
            mem = resolve(c).profile.memory
            assert (mem.gpu_kv_tokens, mem.host_kv_tokens) == (32_000, 40_000)


def test_kv_sizes_behave_as_ups(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """The flags as ``up``'s (``shared.profile.with_kv_tokens``), at the simulation's block size. Before:
    ``--gpu-kv-tokens 10 --host-kv-tokens 10`` (below a block) crashed with a traceback (ValueError from
    ``GpuBlockPool``); ``--gpu-kv-tokens 1000`` was accepted though a node holds 960 (15 blocks of 64), which
    ``up`` refuses; ``--host-kv-tokens 0`` (the profile's, in ``up``) was refused, and so was a large
    ``--gpu-kv-tokens`` alone, which ``up`` takes, raising L2 to match."""
    profile = resolve(SimConfig()).profile.memory
    for gpu, host in ((10, 10), (1000, None), (None, 1000), (-64, None)):
        with pytest.raises(SimConfigError, match="must be a positive multiple of the block size 64 of profile gb300-glm52"):
            resolve(SimConfig(gpu_kv_tokens=gpu, host_capacity_tokens=host))
    with pytest.raises(SimConfigError, match=r"--gpu-kv-tokens 1000: .*\(e\.g\. 1024\)"):
        resolve(SimConfig(gpu_kv_tokens=1000))
    with pytest.raises(SimConfigError, match="--host-kv-tokens 1000: .*--host-capacity-tokens is the same flag"):
        resolve(SimConfig(host_capacity_tokens=1000))
    with pytest.raises(SimConfigError, match=r"block size 512 .*\(--block-size 512\)"):  # the simulation's block size
        resolve(SimConfig(block_size=512, gpu_kv_tokens=64_064))
    assert resolve(SimConfig(block_size=512, gpu_kv_tokens=65_536)).profile.memory.gpu_kv_tokens == 65_536
    assert resolve(SimConfig(host_capacity_tokens=0)).profile.memory == profile  # 0: the profile's
    assert resolve(SimConfig(gpu_kv_tokens=0, host_capacity_tokens=0)).profile.memory == profile
    mem = resolve(SimConfig(gpu_kv_tokens=9_000_000)).profile.memory  # alone, above L2: L2 raised to match
    assert (mem.gpu_kv_tokens, mem.host_kv_tokens) == (9_000_000, 9_000_000)
    mem = resolve(SimConfig(gpu_kv_tokens=1_024_000)).profile.memory  # below the profile's L2: L2 kept
    assert (mem.gpu_kv_tokens, mem.host_kv_tokens) == (1_024_000, profile.host_kv_tokens)
    short = ["simulate", "--workload", "claude-code", "--agents", "2", "--nodes", "2", "--duration", "30", "--no-plots"]
    assert main([*short, "--out", str(tmp_path / "o"), "--gpu-kv-tokens", "10", "--host-kv-tokens", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --gpu-kv-tokens 10: must be a positive multiple") and "Traceback" not in err, err


def test_what_the_seed_moves():
    closed = SimConfig(seed=7)
    assert seed_draws(closed) == [] and "--seed 7 changes nothing" in (seed_unused_note([closed]) or "")
    assert seed_unused_note([replace(closed, seed=0)]) is None  # the default seed: nothing to say
    assert seed_draws(replace(closed, arrival="trace", agent_order="shuffled")) == []  # recorded arrivals: no order drawn
    assert len(seed_draws(replace(closed, arrival="open"))) == 1
    assert len(seed_draws(replace(closed, agent_order="shuffled"))) == 1
    assert seed_draws(replace(closed, routing="dynamo-kv")) == []  # temperature 0: no draw
    hot = replace(closed, routing="dynamo-kv", routing_options={"dynamo_temperature": 0.5})
    assert len(seed_draws(hot)) == 1
    assert seed_unused_note([closed, hot]) is None  # a sweep in which one item draws


def test_a_seed_that_moves_nothing_is_noted(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """--seed 0 and --seed 7 of a closed loop in trace order wrote the same requests.jsonl, saying nothing."""
    short = [*RUN[:-3], "--duration", "120", "--no-plots"]
    assert main([*short, "--out", str(tmp_path / "s0")]) == 0
    assert "--seed" not in capsys.readouterr().err
    assert main([*short, "--out", str(tmp_path / "s7"), "--seed", "7"]) == 0
    assert "note: --seed 7 changes nothing in this run" in capsys.readouterr().err
    assert (tmp_path / "s0" / "requests.jsonl").read_bytes() == (tmp_path / "s7" / "requests.jsonl").read_bytes()
    assert main([*short, "--out", str(tmp_path / "s7s"), "--seed", "7", "--agent-order", "shuffled"]) == 0
    assert "changes nothing" not in capsys.readouterr().err


def test_sweep_notes_say_why_an_option_is_left_out_and_when_a_baseline_never_adapted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    single = ["simulate", "--workload", "claude-code", "--agents", "3", "--nodes", "3", "--duration", "30", "--no-plots"]
    assert main([*single, "--policy", "static:1P2D", "--planner-opt", "t_learn_s=60", "--out", str(tmp_path / "x")]) == 2
    assert "planner 'static' takes no parameters, got ['t_learn_s']" in capsys.readouterr().err  # a single run: refused
    assert main([*single, "--planner-opt", "t_learn_s=60", "--seed", "7", "--sweep", "policies", "evolving,static:1P2D",
                 "--out", str(tmp_path / "sw")]) == 0
    run = capsys.readouterr()  # the notes about the settings, before the run, on stderr (before: this one on stdout)
    assert "note: static:1P2D: --planner-opt t_learn_s not given" in run.err and "not given" not in run.out
    assert "note: --seed 7 changes nothing" in run.err
    cfg = SimConfig(nodes=3, planner_options={"t_learn_s": 60})
    _items, notes = fit_planner_options(sweep_items(cfg, ["policies", "evolving,static:1P2D"]))
    assert notes == ["static:1P2D: --planner-opt t_learn_s not given (planner 'static' does not take it; the sweep "
                     "gives each item the options its planner takes, where a single run of static:1P2D refuses them)"]
    row = {"label": "dynamo", "planner": "dynamo", "initial_split": "2P1D", "switches": 0, "simulated_s": 300.0}
    note = never_adapted_note(row) or ""
    assert "dynamo never changed its split in 300 s" in note and "as static:2P1D does" in note
    assert never_adapted_note(dict(row, switches=2)) is None
    assert never_adapted_note(dict(row, planner="static")) is None
    assert never_adapted_note(dict(row, label="evolving", planner="evolving")) is None  # its warm-up note says it


def test_requests_longer_than_l1_are_counted_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """With --gpu-kv-tokens 65536 (1,024 blocks of 64) the generated Claude Code requests longer than that fail
    (status 500) and the run exits 1; before, nothing said so until the errors table after the run. A note on
    stderr counts them before the run; a run without the flag reads nothing for it."""
    from evolving_infra.sim.config import l1_overflow_note

    class NotRead:
        def __iter__(self):
            raise AssertionError("read without --gpu-kv-tokens")

    assert l1_overflow_note(SimConfig(), NotRead()) is None  # type: ignore[arg-type]
    assert main([*RUN, "--duration", "300", "--out", str(tmp_path / "a"), "--gpu-kv-tokens", "65536"]) == 1
    err = capsys.readouterr().err
    note = next(ln for ln in err.splitlines() if ln.startswith("note: ") and "L1" in ln)
    assert "of the input's" in note and "(--gpu-kv-tokens 65536: 1,024 blocks of 64 tokens)" in note, note
    over = int(note.removeprefix("note: ").split(" of ")[0].replace(",", ""))
    records = [json.loads(ln) for ln in (tmp_path / "a" / "requests.jsonl").read_text().splitlines()]
    failed = [r for r in records if not r["ok"]]
    assert 0 < len(failed) <= over and {r["status"] for r in failed} == {500}
    assert all(r["expected_prompt_tokens"] + max(r["expected_completion_tokens"], 1) > 65536 for r in failed)
    assert main([*RUN, "--duration", "300", "--out", str(tmp_path / "b"), "--gpu-kv-tokens", "600000",
                 "--host-kv-tokens", "600000"]) == 0
    assert "L1" not in capsys.readouterr().err  # every request fits: no note


def test_a_switch_decided_but_not_completed_is_not_never_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """dynamo on 3 nodes decides a switch at 360 s whose relaunch (754 s) outlasts a 900-s run: no completed switch,
    but not "never changed its split" either (before: that note, though decisions.jsonl had the switch and the
    dynamo and static:2P1D items differ, a node relaunching from 360 s)."""
    from evolving_infra.sim.sweep import first_switch_decided

    assert first_switch_decided([{"action": "hold", "ts": 60.0}, {"action": "switch", "ts": 360.0},
                                 {"action": "switch", "ts": 420.0}]) == 360.0
    assert first_switch_decided([{"action": "hold", "ts": 60.0}]) is None
    args = ["simulate", "--workload", "claude-code", "--nodes", "3", "--concurrency", "60", "--agents", "200",
            "--duration", "900", "--sweep", "policies", "dynamo,static:2P1D", "--no-plots", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    decided = [json.loads(ln)["ts"] for ln in (tmp_path / "dynamo" / "decisions.jsonl").read_text().splitlines()
               if json.loads(ln)["action"] == "switch"]
    assert decided and _report(tmp_path / "dynamo")["switches"] == 0
    assert f"note: dynamo decided a switch at {decided[0]:,.0f} s that had not completed by the end (900 s)" in out, out
    assert "never changed" not in out and "neither the policy adapted nor static:2P1D" in out
    rows = json.loads((tmp_path / "sweep.json").read_text())["items"]
    assert [(r["label"], r["switch_decided_at_s"]) for r in rows] == [("dynamo", decided[0]), ("static:2P1D", None)]
