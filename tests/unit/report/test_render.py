"""Plots, report.html, ``report show`` and ``report compare`` on synthetic run directories."""

from __future__ import annotations

import base64
import io
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from evolving_infra.cli import main
from evolving_infra.report.compare import compare_table
from evolving_infra.report.timeline import RunTimeline

from .helpers import make_run, switching_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Imgs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict[str, str | None]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):  # type: ignore[no-untyped-def]
        if tag == "img":
            self.imgs.append(dict(attrs))

    def handle_data(self, data):  # type: ignore[no-untyped-def]
        self.text.append(data)


def check_page(page: Path) -> tuple[list[str], str]:
    """Every image the page references exists and decodes as a PNG; returns the referenced files and the text."""
    parser = _Imgs()
    parser.feed(page.read_text(encoding="utf-8"))
    assert parser.imgs, f"{page} shows no plots"
    files = []
    for img in parser.imgs:
        src = img.get("src") or ""
        if src.startswith("data:"):
            head, _, data = src.partition(",")
            assert head == "data:image/png;base64"
            raw = base64.b64decode(data, validate=True)
        else:
            raw = (page.parent / src).read_bytes()
        assert raw.startswith(PNG_MAGIC)
        Image.open(io.BytesIO(raw)).verify()
        name = img.get("data-file")
        if name:
            assert (page.parent / name).is_file(), name
            assert (page.parent / name).read_bytes() == raw
            files.append(name)
    return files, " ".join(parser.text)


def test_write_report_writes_plots_and_page(tmp_path: Path):
    run = make_run(tmp_path, "ei", periods=[{"name": "first", "start_s": 0, "end_s": 120}, {"name": "second", "start_s": 120, "end_s": 240}])
    files, text = check_page(run / "report.html")
    assert set(files) == {"ttft_cdf.png", "e2e_cdf.png", "throughput.png", "split_timeline.png", "lost_kv_reuse.png", "prefill_queue.png"}
    assert "Lost KV reuse" in text and "Per period" in text and "second" in text
    report = json.loads((run / "report.json").read_text())
    assert report["switches"] == 3 and len(report["periods"]) == 2


def test_no_timeline_means_no_split_plot(tmp_path: Path):
    run = make_run(tmp_path, "static", timeline=False)
    files, text = check_page(run / "report.html")
    assert "split_timeline.png" not in files and not (run / "split_timeline.png").exists()
    assert "no split timeline" in text


def test_report_show_redraws_from_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run = make_run(tmp_path, "ei", plots=False)
    assert not list(run.glob("*.png")) and not (run / "report.html").exists()
    assert main(["report", "show", str(run)]) == 0
    out = capsys.readouterr().out
    # 2 planner decisions moved 3 nodes: the line said only "switches 3", read as 3 split changes
    assert "TTFT" in out and "PD split   final 3P1D  split decisions 2  node phase switches 3" in out
    files, _ = check_page(run / "report.html")
    assert "split_timeline.png" in files and "ttft_cdf.png" in files


def test_report_show_recompute_keeps_producer_keys(tmp_path: Path):
    run = make_run(tmp_path, "ei", plots=False)
    report = json.loads((run / "report.json").read_text())
    report["sim_speed"] = 42.0
    report["ttft_mean_s"] = -1.0  # stale computed value
    del report["series"]
    (run / "report.json").write_text(json.dumps(report))
    assert main(["report", "show", "--recompute", "--no-plots", str(run)]) == 0
    fresh = json.loads((run / "report.json").read_text())
    assert fresh["sim_speed"] == 42.0
    assert fresh["ttft_mean_s"] > 0 and "series" in fresh


def test_report_compare_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    a = make_run(tmp_path, "evolving", scale=1.0, plots=False)
    b = make_run(tmp_path, "static", scale=2.0, timeline=False, plots=False)
    out = tmp_path / "cmp"
    assert main(["report", "compare", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT mean" in printed and "(2.00x)" in printed
    files, text = check_page(out / "compare.html")
    assert {"compare_ttft_cdf.png", "compare_e2e_cdf.png", "compare_metrics.png", "compare_split_timeline.png"} <= set(files)
    assert "evolving" in text and "static" in text and "ratio vs evolving" in text
    table = json.loads((out / "compare.json").read_text())
    rows = {r["key"]: r for r in table["metrics"]}
    # every latency of run b is twice run a's (scale 2): ratio 2 on TTFT and E2E
    assert rows["ttft_mean_s"]["ratios"][1] == pytest.approx(2.0)
    assert rows["e2e_p95_s"]["ratios"][1] == pytest.approx(2.0)
    assert rows["switches"]["values"] == [3, None] and rows["switches"]["ratios"] == [None, None]
    assert rows["switches"]["label"] == "Node phase switches"
    assert rows["split_decisions"]["values"] == [2, None] and rows["split_decisions"]["label"] == "Planner split decisions"
    assert rows["split_changes"]["label"] == "Splits served after launch (intermediate included)"
    assert "Planner split decisions" in text and "Split changes" not in text


def test_split_plot_title_counts_decisions_and_node_switches():
    """The split plot's title said "(3 switches)" for 2 planner decisions that moved 3 nodes."""
    from evolving_infra.report.plots import switch_counts

    tl = switching_timeline()
    assert switch_counts(tl) == "2 split decisions, 3 node phase switches"
    assert switch_counts(RunTimeline()) == "0 split decisions, 0 node phase switches"


def test_compare_table_ratios_and_missing():
    rows = {r["key"]: r for r in compare_table([{"throughput_rps": 2.0, "final_split": "3P6D"}, {"throughput_rps": 5.0, "final_split": "4P5D"}, {}])}
    assert rows["throughput_rps"]["ratios"] == [None, pytest.approx(2.5), None]
    assert rows["final_split"]["ratios"] == [None, None, None]
    assert "ttft_mean_s" not in rows  # absent everywhere: no row


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    a = make_run(tmp_path, "only", plots=False)
    assert main(["report", "compare", str(a), "--out", str(tmp_path / "c")]) == 2
    assert main(["report", "show", str(tmp_path / "missing")]) == 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "report.json").write_text("[1, 2]")
    assert main(["report", "compare", str(a), str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "at least two" in err and "no report.json" in err and "expected a JSON object" in err


def test_a_sweep_or_comparison_folder_given_as_a_run_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``report show runs/baselines`` (a sweep's --out) said only 'no report.json (is runs/baselines a run
    directory?)'; it now names the sweep's runs and comparison, and a comparison's folder its page."""
    sweep = tmp_path / "sweep"
    make_run(sweep, "dynamo", plots=False)
    make_run(sweep, "arrow", plots=False)
    (sweep / "sweep.json").write_text("{}")
    (sweep / "compare").mkdir()
    (sweep / "compare" / "compare.json").write_text("{}")
    (sweep / "compare" / "compare.html").write_text("")
    assert main(["report", "show", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert f"{sweep} is a sweep: its runs are {sweep / 'arrow'}, {sweep / 'dynamo'}; compared in " in err, err
    assert main(["report", "compare", str(sweep)]) == 2
    assert "at least two run directories" in (err := capsys.readouterr().err) and f"{sweep} is a sweep" in err, err
    assert main(["report", "show", str(sweep / "compare")]) == 2
    assert "is a comparison (report compare's --out): open " in capsys.readouterr().err
    assert main(["report", "show", str(tmp_path / "missing")]) == 2
    assert "a run directory?" in capsys.readouterr().err


def test_the_page_says_where_its_other_keys_are_defined(tmp_path: Path):
    """The run page's "Other" rows show report.json key names (``lost_kv_reuse_unattributed_share``,
    ``counted_kv_tokens_per_prefill_node_max``) with nothing saying where they are defined."""
    from evolving_infra.report.write import build_report, render_run

    from .helpers import rec

    report = build_report([rec(0)], meta={}, extra={"counted_kv_tokens_per_prefill_node_max": 64})
    page = render_run(tmp_path, report, [rec(0)]).read_text()
    assert "counted_kv_tokens_per_prefill_node_max" in page  # shown by its key name, in "Other"
    assert "evolving_infra/report/README.md" in page and "evolving_infra/sim/README.md" in page


def test_plot_failure_keeps_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    from evolving_infra.report import plots
    from evolving_infra.report.write import build_report, write_report

    from .helpers import rec

    def broken(*_a, **_k):  # type: ignore[no-untyped-def]
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plots, "plot_run", broken)
    path = write_report(tmp_path / "run", build_report([rec(0)], meta={}), [rec(0)])
    assert json.loads(path.read_text())["requests_sent"] == 1
    assert (tmp_path / "run" / "requests.jsonl").read_text().count("\n") == 1
    assert "report show" in capsys.readouterr().err


def test_page_shows_producer_keys_and_escapes(tmp_path: Path):
    from evolving_infra.report.html import run_page
    from evolving_infra.report.write import build_report

    from .helpers import rec

    report = build_report([rec(0)], meta={"command": "<sim>"}, extra={"sim_speed": 250.0, "ttft_prediction_abs_error_median_s": 0.125})
    page = run_page(report, [], base=tmp_path)
    assert "Simulation speed" in page and "250" in page
    assert "TTFT prediction |error| median" in page and "0.125 s" in page
    assert "<sim>" not in page and "&lt;sim&gt;" in page


def test_compare_warns_when_runs_served_different_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    same_a = make_run(tmp_path, "a", plots=False, trace="cc.jsonl.gz", duration_s=3600.0)
    same_b = make_run(tmp_path, "b", plots=False, trace="cc.jsonl.gz", duration_s=3600.0)
    short = make_run(tmp_path, "short", plots=False, trace="cc.jsonl.gz", duration_s=600.0)
    assert main(["report", "compare", str(same_a), str(same_b), "--out", str(tmp_path / "c1")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert json.loads((tmp_path / "c1" / "compare.json").read_text())["input_differences"] == []
    assert main(["report", "compare", str(same_a), str(short), "--out", str(tmp_path / "c2")]) == 0
    err = capsys.readouterr().err
    assert "different inputs" in err and "duration_s: a=3600.0, short=600.0" in err and "trace" not in err
    assert json.loads((tmp_path / "c2" / "compare.json").read_text())["input_differences"] == ["duration_s: a=3600.0, short=600.0"]


def test_compare_knows_a_packed_trace_and_its_jsonl_are_one_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """One run on ``cc.eipack``, another on the ``cc.jsonl.gz`` it was packed from (the same requests) made
    ``report compare`` warn "the runs served different inputs — trace: evolving=cc.eipack, dynamo=cc.jsonl.gz":
    it compared file names (then the files' bytes). The input is now known by what ``simulate`` records of it
    (header source, request count, block size; no trace file is read), and truly different inputs still warn."""
    import subprocess
    import sys

    from evolving_infra.report.compare import input_differences
    from evolving_infra.report.write import load_run

    repo = Path(__file__).resolve().parents[3]
    sample = repo / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    packed = tmp_path / "cc.eipack"
    run = [sys.executable, "-m", "evolving_infra.cli"]
    subprocess.run([*run, "trace", "pack", str(sample), str(packed)], cwd=repo, check=True, capture_output=True)
    runs = {}
    for name, trace in (("plain", sample), ("packed", packed)):
        subprocess.run([*run, "simulate", "--trace", str(trace), "--nodes", "2", "--concurrency", "4", "--no-plots",
                        "--duration", "20", "--out", str(tmp_path / name)], cwd=repo, check=True, capture_output=True)
        runs[name], _ = load_run(tmp_path / name)
    assert runs["plain"]["meta"]["trace_requests"] == runs["packed"]["meta"]["trace_requests"] == 742
    assert input_differences([runs["plain"], runs["packed"]], ["plain", "packed"]) == []
    assert main(["report", "compare", str(tmp_path / "plain"), str(tmp_path / "packed"), "--out", str(tmp_path / "c")]) == 0
    assert "different inputs" not in capsys.readouterr().err
    # another trace of the same source (fewer requests), or another source: different inputs, no file read
    other = {**runs["packed"], "meta": {**runs["packed"]["meta"], "trace_requests": 700}}
    assert input_differences([runs["plain"], other], ["plain", "other"]) == [f"trace: plain={sample}, other={packed}"]
    renamed = {**runs["plain"], "meta": {**runs["plain"]["meta"], "trace_source": "generate claude-code --seed 0"}}
    assert input_differences([runs["plain"], renamed], ["plain", "gen"]) == [f"trace: plain={sample}, gen={sample}"]
    # a run that does not record the identity (an older report, a live demo): files compared as before
    old = {**runs["packed"], "meta": {k: v for k, v in runs["packed"]["meta"].items() if k != "trace_requests"}}
    assert input_differences([runs["plain"], old], ["plain", "old"]) == [f"trace: plain={sample}, old={packed}"]


def test_eviction_share_label_says_it_is_a_share_of_the_lost_reuse(capsys: pytest.CaptureFixture[str]):
    """0.6 is 60% of what was lost (e.g. 60% of 0.1%), not 60% of the reuse: the label must say so."""
    from evolving_infra.report.html import _LABELS
    from evolving_infra.report.write import print_summary

    print_summary({"lost_kv_reuse": 0.001, "lost_kv_reuse_eviction_share": 0.6, "meta": {}})
    out = capsys.readouterr().out
    assert "share of the lost KV reuse due to eviction 60.0%" in out
    assert _LABELS["lost_kv_reuse_eviction_share"] == "Share of the lost KV reuse due to eviction"


def test_lost_kv_plot_without_ideal_reuse_draws_bars_not_an_empty_legend(tmp_path: Path):
    """A run where no request had ideal KV reuse (h* = 0: every window's 1 − h/h* undefined, as a
    short replay of fresh sessions) got an empty line plot and matplotlib's "No artists with labels
    found to put in legend" warning on stderr; it now gets the run-level bars of h and h*."""
    import warnings

    from evolving_infra.report.plots import plot_lost_kv
    from evolving_infra.report.write import build_report

    from .helpers import rec

    records = [rec(i, sent_at=10.0 * i, ideal=0) for i in range(3)]
    report = build_report(records, meta={})
    assert report["lost_kv_reuse"] is None and report["series"]["lost_kv_reuse"]
    assert all(v is None for v in report["series"]["lost_kv_reuse"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot = plot_lost_kv(tmp_path, report)
    assert plot is not None and "h* = 0" in plot.caption
    assert (tmp_path / plot.file).read_bytes().startswith(PNG_MAGIC)


def test_summary_labels_what_the_ttft_prediction_error_compares(capsys: pytest.CaptureFixture[str]):
    """A live run printed 'TTFT prediction |error| median 10.555 s' against the client TTFT, mostly
    control plane: it now leads with the error against the node's part and labels both."""
    from evolving_infra.report.write import print_summary

    print_summary({"ttft_prediction_abs_error_median_s": 10.555, "ttft_prediction_node_abs_error_median_s": 0.28,
                   "ttft_prediction_node_abs_error_p95_s": 1.5, "meta": {}})
    out = capsys.readouterr().out
    assert "TTFT prediction |error| median 0.280 s p95 1.500 s (router's prediction vs the prefill node's arrival" in out
    assert "  |error| vs client TTFT less admission wait: median 10.555 s (adds the control plane" in out
    print_summary({"ttft_prediction_abs_error_median_s": 0.125, "meta": {}})  # simulator: one figure, labelled
    sim = capsys.readouterr().out
    assert "TTFT prediction |error| median 0.125 s (router's prediction vs client TTFT" in sim
    # the terminal and report.html name the same comparison for this key (the page said "vs client
    # TTFT" while metrics.py subtracts the admission wait): what the page says is what both print
    from evolving_infra.report.html import _LABELS

    for key in ("ttft_prediction_abs_error_median_s", "ttft_prediction_abs_error_p95_s"):
        said = _LABELS[key].rsplit("(", 1)[1].rstrip(")")
        assert said == "vs client TTFT less admission wait", (key, said)  # metrics.py: |ttft_s − admission_wait_s − predicted|
        assert f"prediction {said})" in sim and f"|error| {said}: median" in out


def test_compare_of_a_demo_and_a_simulation_of_its_input_warns_about_nothing(tmp_path: Path):
    """`report compare demo-out <sim>` warned 'warmup_s: demo-out=None', 'seed: demo-out=None',
    'block_size: demo-out=None': the demo's meta now records what it served in simulate's keys,
    and a seed, which a closed loop in trace order never draws from, is not applicable to it."""
    import subprocess
    import sys

    from evolving_infra.launcher import demo_input_meta
    from evolving_infra.report.compare import input_differences
    from evolving_infra.report.write import load_run

    repo = Path(__file__).resolve().parents[3]
    sample = "evolving_infra/data/claude-code-sample.jsonl.gz"
    sims = {}
    for name, extra in (("sim", []), ("sim-seed3", ["--seed", "3"]), ("sim-pause30", ["--max-pause", "30"])):
        subprocess.run([sys.executable, "-m", "evolving_infra.cli", "simulate", "--trace", sample, "--nodes", "4",
                        "--concurrency", "16", "--no-plots", "--duration", "300", "--out", str(tmp_path / name), *extra],
                       cwd=repo, check=True, capture_output=True)
        sims[name], _ = load_run(tmp_path / name)
    demo = {"meta": {"trace": sample, **demo_input_meta(concurrency=16, agents=60, block_size=64, trace_block_size=64),
                     "duration_s": 300.0}}  # the simulations stop at 300 s; the demo's own is None (until done)
    assert input_differences([demo, sims["sim"]], ["demo-out", "sim"]) == []
    assert input_differences([demo, sims["sim-seed3"]], ["demo-out", "sim"]) == []  # no seed applies to the demo
    assert input_differences([demo, sims["sim-pause30"]], ["demo-out", "sim"]) == ["max_pause_s: demo-out=None, sim=30.0"]
    assert input_differences([demo, sims["sim"], sims["sim-seed3"]], ["demo-out", "a", "b"]) == ["seed: demo-out=n/a, a=0, b=3"]
    # a key one run does not record is named so, not shown as None
    assert input_differences([{"meta": {}}, sims["sim"]], ["old", "sim"])[0].startswith("trace: old=not recorded, sim=")


def test_compare_flags_runs_that_retried_a_refused_request_a_different_number_of_times(tmp_path: Path):
    """``max_retries`` (``replay --max-retries``; the demo's replayer: the OpenAI SDK's default, 2)
    decides whether a request refused before any answer (a router restarting) is lost or served:
    two replays with ``--max-retries 0`` and ``4`` served different loads, and compare said nothing,
    and a demo's meta did not record its own. A simulation's harness is never refused (a request no
    node can take waits until one can): the key does not apply to it, and a demo against a
    simulation of its input still warns about nothing."""
    import subprocess
    import sys

    from evolving_infra.launcher import demo_input_meta
    from evolving_infra.replay.retry import RetryPolicy
    from evolving_infra.report.compare import input_differences
    from evolving_infra.report.write import load_run

    demo = {"meta": demo_input_meta(concurrency=16, agents=60, block_size=64, trace_block_size=64)}
    assert demo["meta"]["max_retries"] == RetryPolicy().max_retries == 2
    replay = {"meta": {**demo["meta"], "max_retries": 0}}
    assert input_differences([demo, replay], ["demo-out", "replay"]) == ["max_retries: demo-out=2, replay=0"]
    assert input_differences([replay, {"meta": {**replay["meta"], "max_retries": 4}}], ["r0", "r4"]) == ["max_retries: r0=0, r4=4"]
    assert input_differences([replay, {"meta": {**replay["meta"]}}], ["r0", "again"]) == []

    repo = Path(__file__).resolve().parents[3]
    sample = "evolving_infra/data/claude-code-sample.jsonl.gz"
    subprocess.run([sys.executable, "-m", "evolving_infra.cli", "simulate", "--trace", sample, "--nodes", "4",
                    "--concurrency", "16", "--no-plots", "--duration", "300", "--out", str(tmp_path / "sim")],
                   cwd=repo, check=True, capture_output=True)
    sim, _ = load_run(tmp_path / "sim")
    assert "max_retries" not in sim["meta"]
    for live in (demo, replay):
        live = {"meta": {**live["meta"], "trace": sample, "duration_s": 300.0}}
        assert input_differences([live, sim], ["live", "sim"]) == []
    assert input_differences([demo, sim, replay], ["demo-out", "sim", "replay"])[-1] == "max_retries: demo-out=2, sim=n/a, replay=0"
    # a run that records no command is not taken for a simulation: an old replay's, which never retried
    old = {k: v for k, v in demo["meta"].items() if k != "max_retries"}
    assert input_differences([demo, {"meta": old}], ["demo-out", "old"]) == ["max_retries: demo-out=2, old=not recorded"]


def test_compare_takes_a_relative_and_an_absolute_path_to_one_trace_as_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`report compare` warned 'different traces' for a replay that recorded the trace's absolute path
    and a simulation of the same file given relative."""
    from evolving_infra.report.compare import input_differences

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.jsonl").write_bytes(b"same bytes\n")
    (tmp_path / "copy.jsonl").write_bytes(b"same bytes\n")
    (tmp_path / "other.jsonl").write_bytes(b"other bytes\n")
    monkeypatch.chdir(tmp_path)
    rel, absolute = {"meta": {"trace": "t/a.jsonl"}}, {"meta": {"trace": str(tmp_path / "t" / ".." / "t" / "a.jsonl")}}
    assert input_differences([rel, absolute], ["sim", "replay"]) == []
    assert input_differences([rel, {"meta": {"trace": "copy.jsonl"}}], ["sim", "copy"]) == []  # the same bytes
    # a different file is still named, with each run's value as recorded
    assert input_differences([rel, {"meta": {"trace": "other.jsonl"}}], ["sim", "x"]) == ["trace: sim=t/a.jsonl, x=other.jsonl"]
    assert input_differences([rel, {"meta": {"trace": "gone.jsonl"}}], ["sim", "x"]) == ["trace: sim=t/a.jsonl, x=gone.jsonl"]


def test_a_report_written_again_leaves_no_page_or_plot_of_the_previous_run(tmp_path: Path):
    """``simulate --no-plots --out DIR`` over an earlier run's DIR kept its report.html and PNGs beside the new
    report.json (a 4-node page next to a 2-node report); a redraw kept a plot the new data no longer supports."""
    from evolving_infra.report.write import RUN_PLOTS, build_report, write_report

    from .helpers import synthetic_records

    d = tmp_path / "run"
    d.mkdir()
    for name in ("report.json", "report.html", *RUN_PLOTS):  # an earlier run's report and rendering
        (d / name).write_text("earlier run")
    records = synthetic_records()
    write_report(d, build_report(records, meta={"label": "again"}), records, plots=False)
    assert sorted(p.name for p in d.iterdir()) == ["report.json", "requests.jsonl"]
    (d / "split_timeline.png").write_text("earlier run")
    write_report(d, build_report(records, meta={"label": "no timeline"}), records)  # no timeline: no split plot
    assert "again" not in (d / "report.html").read_text() and not (d / "split_timeline.png").exists()
    assert all((d / n).read_bytes().startswith(b"\x89PNG") for n in RUN_PLOTS if (d / n).exists())


def test_a_report_into_a_folder_of_the_users_files_removes_none_of_them(tmp_path: Path):
    """``simulate --no-plots --out .`` (or ``--out ~``) into a folder that held no run removed the user's own
    ``report.html`` and ``throughput.png``, files this run does not write; a comparison's ``--out`` likewise
    removed a user's ``compare_metrics.png``. Only an earlier run's (its ``report.json`` / ``compare.json``
    there) are removed."""
    from evolving_infra.report.compare import COMPARE_PLOTS, write_compare
    from evolving_infra.report.write import RUN_PLOTS, build_report, write_report

    from .helpers import synthetic_records

    mine = ("report.html", *RUN_PLOTS, *COMPARE_PLOTS, "notes.txt")
    for name in mine:
        (tmp_path / name).write_text("the user's")
    records = synthetic_records()
    write_report(tmp_path, build_report(records, meta={"label": "here"}), records, plots=False)
    runs = [make_run(tmp_path, n, plots=False) for n in ("a", "b")]
    write_compare(runs, tmp_path, plots=False)
    assert all((tmp_path / n).read_text() == "the user's" for n in mine)


def test_the_page_of_a_live_run_has_the_control_plane_note_and_a_simulated_run_s_has_none(tmp_path: Path):
    """The terminal summary of a live run splits its TTFT into the prefill node's part and the control plane's
    and notes when the control plane is most of it (real latency × speedup: the machine's load, not the
    policy); report.html had only two table rows, without the note. A simulated run has no split: no note."""
    from evolving_infra.report.html import run_page
    from evolving_infra.report.write import build_report

    from .helpers import rec

    live = [rec(i, ttft=10.0 + i, sent_at=100.0 * i) for i in range(3)]
    for r, (arr, first) in zip(live, ((5.0, 7.0), (106.0, 107.0), (209.0, 213.0))):
        r.node_arrived_at, r.first_token_at = arr, first  # 2, 1, 4 s on the node of 10, 11, 12 s
    page = run_page(build_report(live, meta={"command": "demo", "speedup": 50.0}), [], base=tmp_path)
    assert "on node mean 2.333 s" in page and "× speedup 50" in page, page
    assert '<li class="warn">note: 79% of the mean client TTFT is control plane' in page, page
    sim = run_page(build_report([rec(i, ttft=10.0 + i, sent_at=100.0 * i) for i in range(3)],
                                meta={"command": "simulate"}), [], base=tmp_path)
    assert "on node" not in sim and "is control plane" not in sim and "speedup" not in sim, sim


def test_the_page_labels_every_metric_key_and_the_live_ttft_split_is_with_ttft_not_in_other(tmp_path: Path):
    """report.html listed keys without a label under "Other" by their report.json names: a live run's TTFT split
    (``ttft_node_p50_s``, ``ttft_control_plane_p50_s``, ``ttft_split_client_mean_s``, ``ttft_node_samples``), the
    prediction error's P95 and samples, the lost KV reuse by cause, and the simulator's run keys. Every key the
    metrics compute now has a label (a new one without a label fails here), the TTFT split rows sit in the Latency
    section, and the simulator keys a reader looks for have labels; only the simulator's internals stay raw."""
    from evolving_infra.report.html import _STRUCTURED, label_of, run_page
    from evolving_infra.report.write import build_report

    from .helpers import rec

    live = [rec(i, ttft=10.0 + i, sent_at=100.0 * i) for i in range(3)]
    for r, (arr, first) in zip(live, ((5.0, 7.0), (106.0, 107.0), (209.0, 213.0))):
        r.node_arrived_at, r.first_token_at, r.predicted_ttft_s = arr, first, 1.5
    report = build_report(live, meta={"command": "demo", "speedup": 50.0})
    assert {"ttft_node_p50_s", "ttft_split_client_mean_s", "ttft_prediction_node_samples"} <= set(report)
    unlabelled = [k for k in report if label_of(k) == k and k not in _STRUCTURED | {"start_s", "end_s"}]
    assert unlabelled == [], unlabelled
    page = run_page(report, [], base=tmp_path)
    table = page[page.index("<h2>Summary</h2>"):page.index("</table>")]
    latency = table[table.index(">Latency<"):table.index(">KV cache<")]
    for key, label, value in (("ttft_node_p50_s", "TTFT on the prefill node P50", "2.000 s"),
                              ("ttft_control_plane_p50_s", "TTFT control plane P50", "8.000 s"),
                              ("ttft_split_client_mean_s", "TTFT client mean over the requests in the split", "11.000 s"),
                              ("ttft_node_samples", "Requests in the TTFT split (with a node arrival)", "3")):
        assert f'<td class="k">{label}</td><td>{value}</td>' in latency, (key, latency)
        assert key not in page, key
    assert ">Other " not in table, table
    sim_keys = ("requests_unfinished", "requests_warmup_excluded", "closed_loop_exhausted_at_s", "simulated_s",
                "sim_wall_s", "setup_wall_s", "peak_rss_mb", "relaunches", "reroutes", "out_of_service_share",
                "out_of_service_node_s", "switch_drain_mean_s", "switch_downtime_mean_s", "switch_downtime_node_s",
                "switch_requeued", "ttft_prediction_abs_error_median_all_s")
    assert [k for k in sim_keys if label_of(k) == k] == []


def test_compare_labels_simulated_and_live_runs_alike_folder_and_policy(tmp_path: Path):
    """``report compare`` labelled a simulated run by its policy alone (two of them in different folders:
    'evolving' and 'evolving (2)') and a live one by its folder alone (its policy nowhere). Now every run
    is ``folder (policy)``; a folder named after it (a sweep's ``static_1P2D``) is the policy alone."""
    from evolving_infra.report.compare import load_runs

    runs = [
        make_run(tmp_path, "simulate-out", plots=False, command="simulate", label="evolving", policy={"name": "evolving"}),
        make_run(tmp_path / "b", "simulate-out", plots=False, command="simulate", label="dynamo", policy={"name": "dynamo"}),
        make_run(tmp_path, "demo-out", plots=False, command="demo", label=None, policy={"name": "evolving"}),
        make_run(tmp_path, "replay-out", plots=False, command="replay", label=None),
        make_run(tmp_path, "static_1P2D", plots=False, command="simulate", label="static:1P2D"),
        make_run(tmp_path, "mine", plots=False, command="simulate", label="fast one"),
    ]
    assert [r.label for r in load_runs(runs)] == [
        "simulate-out (evolving)", "simulate-out (dynamo)", "demo-out (evolving)", "replay-out (replay)", "static:1P2D",
        "mine (fast one)",
    ]


def test_report_show_recompute_keeps_a_live_runs_measured_window(tmp_path: Path):
    """A live replay's window is its own (replay start → end), not its records' span: ``report show --recompute``
    of a demo-out rewrote duration 7,772.9 s as 7,769.3 s (and the throughput with it); a replay stopped long
    after its last answer would have had its throughput multiplied."""
    from evolving_infra.report.write import build_report, write_report

    from .helpers import synthetic_records

    records = synthetic_records()
    first = min(r.sent_at for r in records)
    last = max(r.finished_at for r in records if r.finished_at is not None)
    report = build_report(records, meta={"command": "replay"}, start=first - 5.0, end=last + 100.0)
    run = tmp_path / "live"
    write_report(run, report, records, plots=False)
    assert main(["report", "show", "--recompute", "--no-plots", str(run)]) == 0
    fresh = json.loads((run / "report.json").read_text())
    assert fresh["duration_s"] == pytest.approx(report["duration_s"]) == pytest.approx(last - first + 105.0)
    assert fresh["throughput_rps"] == pytest.approx(report["throughput_rps"])


def test_compare_table_gives_no_ratio_to_a_first_value_that_shows_as_zero():
    """``report compare`` of a simulated run (its TTFT prediction error median 5.9e-14 s, float
    rounding) against the live demo printed ``0.000 s`` then ``18.660 s (316679000242923.00x)``,
    and a sweep ``0.00%`` then ``0.06% (149.82x)`` for a lost KV reuse of 0.0004 %: no ratio now."""
    rows = {r["key"]: r for r in compare_table([
        {"ttft_prediction_abs_error_median_s": 5.892335230850421e-14, "lost_kv_reuse": 4e-6, "ttft_mean_s": 0.004},
        {"ttft_prediction_abs_error_median_s": 18.66, "lost_kv_reuse": 0.0006, "ttft_mean_s": 0.02},
    ])}  # fmt: skip
    assert rows["ttft_prediction_abs_error_median_s"]["ratios"] == [None, None]
    assert rows["lost_kv_reuse"]["ratios"] == [None, None]
    assert rows["ttft_mean_s"]["ratios"] == [None, pytest.approx(5.0)]  # 0.004 s shows as such: kept


def _live(run: Path, *, client: float, node: float, speedup: float = 50.0) -> Path:
    """``run``'s report.json given a live run's TTFT split (seconds): client mean, on-node mean, control plane the rest."""
    report = json.loads((run / "report.json").read_text())
    report |= {"ttft_mean_s": client, "ttft_split_client_mean_s": client, "ttft_node_mean_s": node,
               "ttft_node_p95_s": 2 * node, "ttft_control_plane_mean_s": client - node, "ttft_node_samples": 40}
    report["meta"]["speedup"] = speedup
    (run / "report.json").write_text(json.dumps(report))
    return run


def test_compare_says_which_way_is_better_and_which_run_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``make demo``'s comparison showed the static baseline ahead on the client TTFT (9.5 vs 10.0 s mean) with no
    word of which way is better, which run is, or that the control plane (router, bus: real latency × speedup 50)
    was ~95% of it; the policies' TTFT (on the prefill node: 0.48 vs 0.81 s) sat nine rows below. Now each row
    says lower/higher and the better run, live runs lead with the on-node TTFT, and a note gives the share."""
    a = _live(make_run(tmp_path, "evolving", scale=1.0, plots=False), client=10.0, node=0.48)
    b = _live(make_run(tmp_path, "static", scale=2.0, timeline=False, plots=False), client=9.5, node=0.81)
    out = tmp_path / "cmp"
    assert main(["report", "compare", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].split()[:2] == ["metric", "better"] and lines[0].split()[-1] == "best"
    assert lines[1].startswith("TTFT on node mean (queue + prefill: the policies')")
    assert lines[1].split()[-1] == "evolving" and " lower " in lines[1]
    client = next(line for line in lines if line.startswith("TTFT client mean (incl. control plane × speedup)"))
    assert client.split()[-1] == "static"
    share = next(line for line in lines if line.startswith("Control plane share of the client TTFT"))
    assert "95.20%" in share and "91.47%" in share
    assert "note: the control plane is 95% of evolving's mean client TTFT (9.520 s of 10.000 s at --speedup 50)" in printed
    assert "on the node, evolving is the better (0.480 s vs 0.810 s mean)" in printed
    table = json.loads((out / "compare.json").read_text())
    rows = {r["key"]: r for r in table["metrics"]}
    assert table["metrics"][0]["key"] == "ttft_node_mean_s"
    assert rows["ttft_node_mean_s"]["better"] == "lower" and rows["ttft_node_mean_s"]["best"] == 0
    assert rows["ttft_mean_s"]["best"] == 1 and rows["ttft_mean_s"]["lower_is_better"] is True
    assert rows["throughput_rps"]["better"] == "higher"
    assert rows["ttft_control_plane_share"]["better"] is None and rows["ttft_control_plane_share"]["best"] is None
    assert any("95% of evolving" in n for n in table["notes"])
    _, text = check_page(out / "compare.html")
    assert "Best" in text and "95% of evolving" in text


def test_compare_of_simulated_runs_marks_direction_without_live_notes(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    a = make_run(tmp_path, "evolving", scale=1.0, plots=False)
    b = make_run(tmp_path, "static", scale=2.0, timeline=False, plots=False)
    assert main(["report", "compare", str(a), str(b), "--out", str(tmp_path / "cmp"), ]) == 0
    printed = capsys.readouterr().out
    assert "note:" not in printed
    ttft = next(line for line in printed.splitlines() if line.startswith("TTFT mean "))
    assert ttft.split()[-1] == "evolving" and " lower " in ttft  # half static's TTFT
    table = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert table["notes"] == [] and table["metrics"][0]["key"] == "throughput_rps"
    rows = {r["key"]: r for r in table["metrics"]}
    assert rows["final_split"]["better"] is None and rows["final_split"]["best"] is None


def test_compare_calls_a_difference_the_ratio_column_shows_as_1_00x_a_tie():
    """Review 55 L1: a KV hit rate of 89.48% / 89.50% (1.00x) / 89.51% (1.00x) was given "best static:2P2D": three
    values the ratio column shows as equal. A row whose ratios all print 1.00x is a tie; a best whose ratio differs
    as printed is still named."""
    rows = {r["key"]: r for r in compare_table([
        {"kv_hit_rate": 0.8948, "ttft_mean_s": 1.000, "e2e_mean_s": 1.0},
        {"kv_hit_rate": 0.8950, "ttft_mean_s": 1.002, "e2e_mean_s": 2.0},
        {"kv_hit_rate": 0.8951, "ttft_mean_s": 1.004, "e2e_mean_s": 0.5},
    ])}  # fmt: skip
    assert [f"{r:.2f}" for r in rows["kv_hit_rate"]["ratios"][1:]] == ["1.00", "1.00"]
    assert rows["kv_hit_rate"]["best"] is None
    assert rows["ttft_mean_s"]["best"] is None  # 1.000 s / 1.002 s (1.00x) / 1.004 s (1.00x)
    assert rows["e2e_mean_s"]["best"] == 2  # 0.50x


def test_compare_gives_no_best_to_rows_that_rank_the_machine(tmp_path: Path):
    """Review 55 L2: "Simulation speed ... best dynamo" and a best on the live control plane's TTFT ranked the
    machine (how fast it simulated, its router/bus latency × --speedup), not the policy."""
    rows = {r["key"]: r for r in compare_table([
        {"sim_speed": 3000.0, "ttft_node_mean_s": 0.5, "ttft_control_plane_mean_s": 9.0, "ttft_mean_s": 9.5},
        {"sim_speed": 6000.0, "ttft_node_mean_s": 0.8, "ttft_control_plane_mean_s": 4.0, "ttft_mean_s": 4.8},
    ])}  # fmt: skip
    for key in ("sim_speed", "ttft_control_plane_mean_s"):
        assert (rows[key]["better"], rows[key]["best"]) == (None, None), rows[key]
    assert rows["ttft_node_mean_s"]["best"] == 0


def test_compare_of_a_live_and_a_simulated_run_puts_the_simulation_s_ttft_on_the_node_rows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Review 55 L4: ``report compare runs/vs-baselines/evolving D`` labelled the simulated run's TTFT "TTFT client
    mean (+ control plane)" (a simulation has none) and showed "-" on its "TTFT on node" row, the row the note says
    to compare on. Its TTFT is on-node: it fills those rows, and the labels say so."""
    live = _live(make_run(tmp_path, "demo", scale=1.0, timeline=False, plots=False), client=10.0, node=0.48)
    sim = make_run(tmp_path, "evolving", scale=2.0, timeline=False, plots=False, command="simulate")
    sim_report = json.loads((sim / "report.json").read_text())
    out = tmp_path / "cmp"
    assert main(["report", "compare", str(live), str(sim), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = json.loads((out / "compare.json").read_text())
    rows = {r["key"]: r for r in table["metrics"]}
    assert rows["ttft_node_mean_s"]["values"] == [0.48, sim_report["ttft_mean_s"]]
    assert rows["ttft_node_p95_s"]["values"] == [0.96, sim_report["ttft_p95_s"]]
    assert rows["ttft_node_mean_s"]["best"] == 0  # 0.48 s against the simulation's ~2 s
    assert rows["ttft_mean_s"]["label"] == "TTFT client mean (+ control plane; a simulation has none)"
    assert "a simulation's TTFT" in rows["ttft_node_mean_s"]["label"]
    assert any("evolving: simulated; a simulation's TTFT has no control plane" in n for n in table["notes"]), table["notes"]
    node_line = next(line for line in printed.splitlines() if line.startswith("TTFT on node mean"))
    assert " - " not in f" {node_line} "


def test_every_view_says_throughput_is_per_simulated_second(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Review 55 L3: "per simulated second" reached only the printed summary; report.html, compare.html and the
    compare text said "Throughput (req/s)". A live run at --speedup 1 keeps plain req/s."""
    a = make_run(tmp_path, "a", scale=1.0, timeline=False, plots=False, command="demo", speedup=50.0)
    b = make_run(tmp_path, "b", scale=2.0, timeline=False, plots=False, command="simulate")
    out = tmp_path / "cmp"
    assert main(["report", "compare", str(a), str(b), "--out", str(out)]) == 0
    assert any(line.startswith("Throughput (req/s per simulated second)") for line in capsys.readouterr().out.splitlines())
    assert "Throughput (req/s per simulated second)" in (out / "compare.html").read_text(encoding="utf-8")
    from evolving_infra.report.html import run_page

    def page_of(run: Path) -> str:  # report.html as write_report makes it (plots=False writes none)
        return run_page(json.loads((run / "report.json").read_text()), [], base=run)

    assert "Throughput (req/s per simulated second)" in page_of(a)
    c = make_run(tmp_path, "c", scale=1.0, timeline=False, plots=False, command="replay", speedup=1.0)
    d = make_run(tmp_path, "d", scale=2.0, timeline=False, plots=False, command="replay", speedup=1.0)
    page = page_of(c)
    assert "Throughput (req/s)" in page and "per simulated second" not in page
    assert main(["report", "compare", str(c), str(d), "--out", str(tmp_path / "cmp1")]) == 0
    assert any(line.startswith("Throughput (req/s) ") for line in capsys.readouterr().out.splitlines())
