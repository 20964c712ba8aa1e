"""Partitions (merge, parallel = serial), sweeps, the CLI."""

from __future__ import annotations

import json
import zlib
from dataclasses import replace

import pytest

from evolving_infra.cli import main
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import merge_timelines, partition_of, simulate
from evolving_infra.sim.sweep import best_lines, run_sweep, sweep_items
from evolving_infra.report.timeline import RunTimeline, SplitPoint
from evolving_infra.traces.io import write_trace
from evolving_infra.traces.schema import FORMAT, TraceHeader

from .conftest import BS, small_trace, strip_wall


def test_partitions_bind_agents_by_hash_and_merge():
    reqs = small_trace(10, 4, pause=0.05)
    cfg = SimConfig(nodes=4, profile="tiny", policy="static:1P1D", partitions=2, concurrency=6)
    serial = simulate(cfg, reqs, BS)
    parallel = simulate(replace(cfg, workers=2), reqs, BS)
    a, b = strip_wall(serial.report), strip_wall(parallel.report)
    assert a["meta"].pop("workers") == 1 and b["meta"].pop("workers") == 2
    assert a == b
    assert [r.e2e_s for r in serial.records] == [r.e2e_s for r in parallel.records]
    assert serial.report["requests_completed"] == len(reqs)
    for r in serial.records:
        k = zlib.crc32(r.agent.encode()) % 2
        assert partition_of(r.agent, 2) == k
        assert r.prefill_node.startswith(f"p{k}w") and r.decode_node.startswith(f"p{k}w")
    assert serial.report["final_split"] == "2P2D"
    assert serial.report["meta"]["cluster"]["partitions"] == 2


def test_merge_timelines_sums_partitions():
    a = RunTimeline(split_timeline=[SplitPoint(t=0, split="1P1D", prefill=1, decode=1, prefill_nodes=["p0w0"]),
                                    SplitPoint(t=5, split="1P1D", prefill=1, decode=1, switching=1, prefill_nodes=["p0w0"])])
    b = RunTimeline(split_timeline=[SplitPoint(t=0, split="1P1D", prefill=1, decode=1, prefill_nodes=["p1w0"]),
                                    SplitPoint(t=3, split="2P0D", prefill=2, decode=0, prefill_nodes=["p1w0", "p1w1"])])
    m = merge_timelines([a, b])
    assert [(p.t, p.split, p.switching) for p in m.split_timeline] == [(0, "2P2D", 0), (3, "3P1D", 0), (5, "3P1D", 1)]
    assert m.split_timeline[1].prefill_nodes == ["p0w0", "p1w0", "p1w1"]


def test_sweep_items():
    cfg = SimConfig(nodes=4, profile="tiny", policy="static")
    assert [label for label, _ in sweep_items(cfg, ["splits"])] == ["static:1P3D", "static:2P2D", "static:3P1D"]
    assert [label for label, _ in sweep_items(cfg, ["splits", "2P2D,3p1d"])] == ["static:2P2D", "static:3P1D"]
    items = sweep_items(SimConfig(nodes=4, policy="dynamo"), ["splits", "2P2D"])
    assert items[0][0] == "dynamo@2P2D" and items[0][1].split == "2P2D"
    pol = sweep_items(cfg, ["policies", "dynamo,arrow", "static:2P2D"])
    assert [label for label, _ in pol] == ["dynamo", "arrow", "static:2P2D"]


def test_sweep_refuses_conflicts_before_any_run(tmp_path, capsys):
    """A sweep item listed twice (the second run overwrote the first's OUT/ folder), --split with
    --sweep splits (the split was silently ignored) and --sweep-workers < 1 (ran serially) are usage
    errors: exit 2, one 'error:' line, nothing written."""
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TraceHeader(format=FORMAT, block_size=BS), small_trace(2, 3))
    common = ["simulate", "--trace", str(trace), "--nodes", "3", "--profile", "tiny", "--duration", "30", "--no-plots"]
    cases = [
        (["--sweep", "policies", "static:2P1D,static:2P1D"], "twice"),
        (["--sweep", "splits", "2P1D,2p1d"], "lists '2P1D' and '2p1d', which become 'evolving@2P1D'"),
        # two sets typed differently that serve one split: the message named the label twice, not what was typed
        (["--sweep", "policies", "static:1P2D,static:2P1D", "--split", "2P1D"],
         "lists 'static:1P2D' and 'static:2P1D', which become 'static:2P1D' under --split 2P1D"),
        (["--sweep", "splits", "1P2D,2P1D", "--split", "1P2D"], "conflict"),
        (["--sweep", "splits", "1P2D,2P1D", "--sweep-workers", "0"], "--sweep-workers"),
    ]
    for i, (extra, why) in enumerate(cases):
        out = tmp_path / f"sweep{i}"
        assert main([*common, "--out", str(out), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and why in err and len(err.splitlines()) == 1, (extra, err)
        assert not out.exists(), extra


def test_sweep_writes_runs_comparison_and_summary(tmp_path, capsys):
    reqs = small_trace(6, 4, pause=0.02)
    cfg = SimConfig(nodes=3, profile="tiny", policy="static", concurrency=6)
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "compare_metrics.png").write_text("an earlier sweep's")
    (tmp_path / "compare" / "compare.json").write_text("{}")  # its comparison: the PNG is ours to remove
    rc = run_sweep(cfg, reqs, BS, ["splits"], tmp_path, plots=False, parallel=2)
    assert rc == 0
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert [i["label"] for i in summary["items"]] == ["static:1P2D", "static:2P1D"]
    assert summary["best_by_throughput"] in ("static:1P2D", "static:2P1D")
    # review 55 L5 (d): a tie names every item in it, not only the first
    tops = {f"{i['throughput_rps']:.3f}" for i in summary["items"]}
    assert summary["throughput_tie"] == (["static:1P2D", "static:2P1D"] if len(tops) == 1 else [])
    assert all(i["requests_failed"] == 0 for i in summary["items"])
    for d in ("static_1P2D", "static_2P1D"):
        rep = json.loads((tmp_path / d / "report.json").read_text())
        assert rep["requests_completed"] == len(reqs) and rep["meta"]["label"] == d.replace("_", ":")
    comp = json.loads((tmp_path / "compare" / "compare.json").read_text())
    assert [r["label"] for r in comp["runs"]] == ["static:1P2D", "static:2P1D"]
    # plots=False (--no-plots): the comparison is its table, no PNGs (they cost ~4 s of CPU here)
    assert comp["plots"] == [] and not list((tmp_path / "compare").glob("*.png"))
    assert (tmp_path / "compare" / "compare.html").is_file()
    assert "best by throughput" in capsys.readouterr().out
    assert summary["best_by_ttft_mean"] in ("static:1P2D", "static:2P1D")


def test_a_sweep_says_a_throughput_tie_and_the_best_ttft():
    """A closed-loop sweep of evolving, dynamo and static:2P2D on the sample served 0.118 req/s each and ended
    "best by throughput: evolving (0.118 req/s)", the first of the tie, never naming the TTFT (0.59 against 1.34
    and 1.33 s), which is where the policies differ."""
    rows = [{"label": "evolving", "throughput_rps": 0.11812, "ttft_mean_s": 0.586},
            {"label": "dynamo", "throughput_rps": 0.11808, "ttft_mean_s": 1.339},
            {"label": "static:2P2D", "throughput_rps": 0.11810, "ttft_mean_s": 1.333}]
    assert best_lines(rows) == [
        "best by throughput (higher is better): a tie at 0.118 req/s per simulated second (evolving, dynamo, "
        "static:2P2D): a closed loop's agents send the same requests whichever policy serves them; compare the latencies",
        "best by TTFT mean (lower is better): evolving (0.586 s; dynamo 1.339 s, static:2P2D 1.333 s)",
    ]
    rows[1]["throughput_rps"], rows[2]["ttft_mean_s"] = 0.2, None
    assert best_lines(rows) == [
        "best by throughput (higher is better): dynamo (0.200 req/s per simulated second)",
        "best by TTFT mean (lower is better): evolving (0.586 s; dynamo 1.339 s); the throughputs differ, requests "
        "served: evolving ? completed / ? failed, dynamo ? / ?, static:2P2D ? / ?"]


def test_a_sweep_s_verdict_says_what_the_ttft_winner_served_and_no_tie_of_nothing():
    """Review 55 L5: (a) an item that served fewer requests won "best by TTFT mean" with no word of it; (b) items
    that all failed read "a tie at 0.000 req/s"; (c) a TTFT tie as printed went to the first item."""
    rows = [{"label": "evolving", "throughput_rps": 0.05, "ttft_mean_s": 0.2, "requests_completed": 50, "requests_failed": 70},
            {"label": "dynamo", "throughput_rps": 0.118, "ttft_mean_s": 1.3, "requests_completed": 120, "requests_failed": 0}]
    assert best_lines(rows)[1] == ("best by TTFT mean (lower is better): evolving (0.200 s; dynamo 1.300 s); the "
                                   "throughputs differ, requests served: evolving 50 completed / 70 failed, dynamo 120 / 0")
    failed = [{"label": "a", "throughput_rps": 0.0, "ttft_mean_s": None, "requests_completed": 0, "requests_failed": 9},
              {"label": "b", "throughput_rps": None, "ttft_mean_s": None, "requests_completed": 0, "requests_failed": 9}]
    assert best_lines(failed) == ["best by throughput (higher is better): none, no item completed a request "
                                  "(a 0 completed / 9 failed, b 0 / 9)"]
    tied = [{"label": "x", "throughput_rps": 0.1, "ttft_mean_s": 0.5004},
            {"label": "y", "throughput_rps": 0.1, "ttft_mean_s": 0.5001},
            {"label": "z", "throughput_rps": 0.1, "ttft_mean_s": 0.9}]
    assert best_lines(tied)[1] == "best by TTFT mean (lower is better): a tie at 0.500 s (x, y; z 0.900 s)"
    assert best_lines(tied[:2])[1] == "best by TTFT mean (lower is better): a tie at 0.500 s (x, y)"


def test_cli_simulate_writes_a_report(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, TraceHeader(format=FORMAT, block_size=BS, source="test"), small_trace(4, 3))
    out = tmp_path / "run"
    rc = main(["simulate", "--trace", str(path), "--out", str(out), "--profile", "tiny", "--nodes", "3",
               "--policy", "arrow", "--eviction", "branch-count", "--concurrency", "2", "--no-plots", "--seed", "4"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["requests_completed"] == 12 and rep["wall_s"] > 0 and rep["sim_speed"] > 0
    assert rep["meta"]["policy"]["eviction"] == "branch-count" and rep["meta"]["policy"]["planner"] == "arrow"
    assert (out / "requests.jsonl").read_text().count("\n") == 12
    assert "simulated" in capsys.readouterr().out


def test_cli_simulate_reads_a_trace_from_stdin(tmp_path, monkeypatch, capsys):
    """``--trace -``: stdin (gzip here), the same run as of the file; the report names ``-``."""
    import gzip
    import io
    import sys

    path = tmp_path / "t.jsonl"
    write_trace(path, TraceHeader(format=FORMAT, block_size=BS, source="test"), small_trace(4, 3))
    common = ["--profile", "tiny", "--nodes", "3", "--concurrency", "2", "--no-plots", "--seed", "4"]
    assert main(["simulate", "--trace", str(path), "--out", str(tmp_path / "file"), *common]) == 0
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(gzip.compress(path.read_bytes()))))
    assert main(["simulate", "--trace", "-", "--out", str(tmp_path / "stdin"), *common]) == 0
    assert (tmp_path / "stdin" / "requests.jsonl").read_bytes() == (tmp_path / "file" / "requests.jsonl").read_bytes()
    rep = json.loads((tmp_path / "stdin" / "report.json").read_text())
    assert rep["meta"]["trace"] == "-" and rep["requests_completed"] == 12
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"not a trace\n")))
    assert main(["simulate", "--trace", "-", "--out", str(tmp_path / "bad"), *common]) == 2
    assert capsys.readouterr().err.splitlines()[-2].startswith("error: --trace: -: ")
    assert not (tmp_path / "bad").exists()


def test_cli_rejects_bad_flags(tmp_path, capsys):
    rc = main(["simulate", "--out", str(tmp_path), "--profile", "tiny"])
    assert rc == 2 and "--trace" in capsys.readouterr().err
    rc = main(["simulate", "--workload", "putnam", "--out", str(tmp_path), "--concurrency", "2", "--arrival-rate", "1"])
    assert rc == 2 and "not both" in capsys.readouterr().err
    rc = main(["simulate", "--workload", "putnam", "--out", str(tmp_path), "--switch-at", "x:w0:decode"])
    assert rc == 2 and "switch-at" in capsys.readouterr().err
    rc = main(["simulate", "--workload", "putnam", "--agents", "2", "--nodes", "2", "--duration", "10", "--out", str(tmp_path),
               "--policy", "evolving", "--planner-opt", "objective=e2e", "--no-plots"])
    assert rc == 2 and "objective must be" in capsys.readouterr().err


NAN = float("nan")


@pytest.mark.timeout(60)  # --max-pause nan never finished before
@pytest.mark.parametrize("kw, flag", [
    ({"duration_s": NAN}, "--duration"),  # ran 0 s and exited 0
    ({"max_pause_s": NAN}, "--max-pause"),  # the run never ended
    ({"warmup_s": NAN}, "--warmup"),  # report said 'out of service nan%'
    ({"relaunch_s": NAN}, "--relaunch-s"),
    ({"msg_latency_s": NAN}, "--msg-latency-s"),
    ({"state_staleness_s": NAN}, "--state-staleness-s"),
    ({"switch_control_s": NAN}, "--switch-control-s"),
    ({"concurrency": 0}, "--concurrency"),  # ran as 1
    ({"concurrency": -1}, "--concurrency"),
    ({"arrival": "open", "arrival_rate": NAN}, "--arrival-rate"),
    ({"arrival": "open", "arrival_rate": 0.0}, "--arrival-rate"),
    ({"arrival": "open", "cap": -1}, "--cap"),
    ({"max_agents": 0}, "--max-agents"),  # ran no agent and exited 0
])
def test_nan_and_out_of_range_settings_are_usage_errors(tmp_path, capsys, kw, flag):
    """A NaN passed the 'x < 0' checks (every comparison with NaN is False): each value here
    is now one 'error:' line naming its flag, exit 2, before the run; the library raises
    SimConfigError from resolve."""
    from evolving_infra.sim.config import SimConfigError, resolve

    with pytest.raises(SimConfigError, match=flag):
        resolve(SimConfig(nodes=3, profile="tiny", policy="static:2P1D", **kw))
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TraceHeader(format=FORMAT, block_size=BS), small_trace(2, 3))
    value = next(iter(kw.values())) if len(kw) == 1 else kw[{"--arrival-rate": "arrival_rate", "--cap": "cap"}[flag]]
    argv = ["simulate", "--trace", str(trace), "--nodes", "3", "--profile", "tiny", "--policy", "static:2P1D",
            "--duration", "30", "--no-plots", "--out", str(tmp_path / "run"), flag, str(value)]
    if flag == "--cap":
        argv += ["--arrival-rate", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def _with_shared_prefix(reqs, shared=(7, 8)):
    import msgspec

    return [msgspec.structs.replace(r, blocks=list(shared) + r.blocks, input_tokens=r.input_tokens + BS * len(shared)) for r in reqs]


def test_tiled_workload_copies_agents_with_private_blocks():
    from evolving_infra.sim.workload import COPY_SHIFT, TiledWorkload

    base = _with_shared_prefix(small_trace(2, 3))
    w = TiledWorkload(base, 3)
    assert w.agents == ["a0~0", "a1~0", "a0~1", "a1~1", "a0~2", "a1~2"]
    assert w.shared == frozenset({7, 8})
    stubs = w.partition(lambda a: 0, 0)
    assert len(stubs) == 18 and all(s.blocks == [] for s in stubs)
    s = next(x for x in stubs if x.id == "a0-r1~2")
    assert s.after == ["a0-r0~2"] and s.branch == "a0-main~2" and s.agent == "a0~2"
    tpl = next(r for r in base if r.id == "a0-r1")
    assert w.blocks_of(s) == [7, 8] + [b + (2 << COPY_SHIFT) for b in tpl.blocks[2:]]
    assert w.blocks_of(next(x for x in stubs if x.id == "a0-r1~0")) == tpl.blocks


def test_tiled_run_reuses_within_a_copy_only():
    base = _with_shared_prefix(small_trace(2, 3))
    cfg = SimConfig(nodes=3, profile="tiny", policy="static:2P1D", concurrency=6, tile=3)
    res = simulate(cfg, base, BS)
    assert res.report["requests_completed"] == 18 and res.report["meta"]["agents"] == 6
    firsts = [r for r in res.records if r.id.startswith("a0-r0~")]
    assert sorted(r.ideal_cached_tokens for r in firsts) == [0, 2 * BS, 2 * BS], "copies share only the common prefix"
    seconds = [r for r in res.records if r.id.startswith("a0-r1~")]
    assert all(r.ideal_cached_tokens >= 6 * BS for r in seconds), "each copy reuses its own history"


def test_a_run_that_ends_inside_the_evolving_warm_up_says_so(tmp_path, capsys):
    """The README's sample run (``--duration 900``) ended inside the evolving planner's 1,800-s collocated
    warm-up and its summary read "PD split final collocated" as if the planner had chosen it; simulate and
    a sweep now say so, and say nothing when the warm-up ended within the run."""
    path = tmp_path / "t.jsonl"
    write_trace(path, TraceHeader(format=FORMAT, block_size=BS, source="test"), small_trace(4, 3, pause=0.5))
    common = ["simulate", "--trace", str(path), "--profile", "tiny", "--nodes", "3", "--concurrency", "2", "--no-plots"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "note: the run ended at " in out and "within its planner's collocated warm-up (until t=1,800 s)" in out, out
    assert "--planner-opt t_learn_s=60)" in out  # a third of this short run, at least one 60-s slice
    assert main([*common, "--out", str(tmp_path / "b"), "--planner-opt", "t_learn_s=0"]) == 0
    assert "warm-up" not in capsys.readouterr().out
    assert main([*common, "--out", str(tmp_path / "c"), "--sweep", "policies", "evolving,static:1P2D"]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith("note: evolving ended at "), notes
    from evolving_infra.sim.run import warmup_outlasted

    assert warmup_outlasted([{"metrics": {"warmup_end": 1800.0}}, {"metrics": {"warmup_end": 1900.0}}], 1850.0) == 1900.0
    assert warmup_outlasted([{"metrics": {"warmup_end": 1800.0}}], 1800.0) is None
    assert warmup_outlasted([{"action": "switch", "metrics": {}}], 10.0) is None


def test_forced_switches_inside_the_warm_up_get_no_collocated_note(tmp_path, capsys):
    """``simulate --split 3P1D --switch-every 60 --switch-to 1P3D`` printed "node phase switches 30" and then
    "note: ... every node served both phases throughout": the forced switches did what the planner's warm-up
    does not, so the note is left out when the run switched phases (``--switch-every``, ``--switch-at``; the
    sweep too), and kept with ``--split`` alone (the warm-up still serves every node collocated) or a
    ``--switch-at`` after the run's end."""
    path = tmp_path / "t.jsonl"
    write_trace(path, TraceHeader(format=FORMAT, block_size=BS, source="test"), small_trace(4, 3, pause=0.5))
    common = ["simulate", "--trace", str(path), "--profile", "tiny", "--nodes", "3", "--concurrency", "2", "--no-plots"]
    note = "within its planner's collocated warm-up"
    for i, extra in enumerate((["--split", "2P1D", "--switch-every", "2", "--switch-to", "1P2D"], ["--switch-at", "1:w0:decode"])):
        assert main([*common, "--out", str(tmp_path / f"f{i}"), *extra]) == 0
        out = capsys.readouterr().out
        switches = int(out.split("node phase switches ")[1].split()[0])
        assert switches > 0 and note not in out, out
    assert main([*common, "--out", str(tmp_path / "s"), "--split", "2P1D"]) == 0
    assert note in capsys.readouterr().out
    assert main([*common, "--out", str(tmp_path / "late"), "--switch-at", "100000:w0:decode"]) == 0
    out = capsys.readouterr().out
    assert " node phase switches 0 " in out and note in out, out
    assert main([*common, "--out", str(tmp_path / "sw"), "--switch-at", "1:w0:decode", "--sweep", "policies", "evolving"]) == 0
    assert note not in capsys.readouterr().out
    from evolving_infra.sim.run import warmup_outlasted

    assert warmup_outlasted([{"metrics": {"warmup_end": 1800.0}}], 100.0, switches=3) is None
    assert warmup_outlasted([{"metrics": {"warmup_end": 1800.0}}], 100.0, switches=0) == 1800.0


def test_the_summary_says_a_node_was_out_of_service_not_the_cluster(tmp_path, capsys):
    """One of 9 nodes relaunching (dynamo, 180 s to the end of a 600-s run) read 'out of service 87.5% of the
    time', as if the cluster had been: out_of_service_share is the share of the time with at least one node
    relaunching (sim README). The line now says so, with the node-seconds."""
    path = tmp_path / "t.jsonl"
    write_trace(path, TraceHeader(format=FORMAT, block_size=BS, source="test"), small_trace(4, 6, pause=0.5))
    rc = main(["simulate", "--trace", str(path), "--out", str(tmp_path / "r"), "--profile", "tiny", "--nodes", "3",
               "--policy", "static:2P1D", "--switch-mode", "relaunch", "--relaunch-s", "1", "--switch-at", "0.5:w0:decode",
               "--concurrency", "2", "--no-plots"])
    assert rc == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("simulated "))
    assert "relaunches 1, a node out of service " in line and " node-s)" in line, line


def test_merge_timelines_counts_every_partitions_decisions():
    """Each partition's planner numbers its own decisions (epoch 2 is each one's first): `simulate --partitions 2`
    of the shipped sample printed 'split decisions 1  node phase switches 8' for the two planners' two
    decisions, whose switches all carried epoch 2."""
    from evolving_infra.report.timeline import SwitchRecord

    def sw(node: str, t: float, epoch: int, to: str) -> SwitchRecord:
        return SwitchRecord(node=node, from_phase="both", to_phase=to, decided_at=t, applied_at=t + 1, switch_s=1.0, epoch=epoch)  # type: ignore[arg-type]

    a = RunTimeline(split_timeline=[SplitPoint(t=0, split="collocated", epoch=1, prefill=2, prefill_nodes=["p0w0", "p0w1"]),
                                    SplitPoint(t=241, split="1P1D", epoch=2, prefill=1, decode=1, prefill_nodes=["p0w0"])],
                    switches=[sw("p0w0", 240, 2, "prefill"), sw("p0w1", 240, 2, "decode")])
    b = RunTimeline(split_timeline=[SplitPoint(t=0, split="collocated", epoch=1, prefill=2, prefill_nodes=["p1w0", "p1w1"]),
                                    SplitPoint(t=201, split="1P1D", epoch=2, prefill=1, decode=1, prefill_nodes=["p1w0"])],
                    switches=[sw("p1w0", 200, 2, "prefill"), sw("p1w1", 200, 2, "decode")])
    m = merge_timelines([a, b])
    assert m.split_decisions() == 2 and len(m.switches) == 4
    # numbered in the order they were decided (b's at 200 s first), the launch split's epoch kept
    assert [(s.node, s.epoch) for s in m.switches] == [("p1w0", 2), ("p1w1", 2), ("p0w0", 3), ("p0w1", 3)]
    assert [(p.t, p.split, p.epoch) for p in m.split_timeline] == [(0, "collocated", 1), (201, "3P1D", 2), (241, "2P2D", 3)]
