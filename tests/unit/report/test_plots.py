"""What the plots draw: log axes label their ticks as matplotlib does, without mathtext."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.mathtext import MathTextParser

from evolving_infra.report.plots import DPI, LogTickFormatter, RunData, plain_tick_label, plot_compare, plot_run
from evolving_infra.report.timeline import timeline_from_builtins
from evolving_infra.report.write import build_report

from .helpers import rec, switching_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGSIZE = (6.4, 4.0)  # the latency CDFs' figure


def test_log_tick_labels_read_as_matplotlibs_without_mathtext():
    assert plain_tick_label(r"$\mathdefault{10^{-1}}$") == "10⁻¹"
    assert plain_tick_label(r"$\mathdefault{10^{2}}$") == "10²"
    assert plain_tick_label(r"$\mathdefault{2\times10^{-1}}$") == "2×10⁻¹"
    assert plain_tick_label(r"$\mathdefault{-10^{13}}$") == "−10¹³"
    assert plain_tick_label("") == ""
    assert plain_tick_label(r"$\mathdefault{10^{0.50}}$") == r"$\mathdefault{10^{0.50}}$"  # not ours to rewrite
    # on an axis: the decades (major) and, on a short log axis, matplotlib's labelled minor ticks
    for lim, major, minor in (((0.02, 150.0), ["10⁻¹", "10⁰", "10¹", "10²"], []),
                              ((0.15, 0.9), [], ["2×10⁻¹", "3×10⁻¹", "4×10⁻¹", "6×10⁻¹"])):
        fig = Figure(figsize=FIGSIZE, dpi=DPI)
        ax = fig.add_subplot()
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(LogTickFormatter(10))
        ax.xaxis.set_minor_formatter(LogTickFormatter(10, labelOnlyBase=False))
        ax.set_xlim(*lim)
        FigureCanvasAgg(fig).draw()
        shown = [[t.get_text() for t in labels if t.get_text() and lim[0] <= t.get_position()[0] <= lim[1]]
                 for labels in (ax.xaxis.get_majorticklabels(), ax.xaxis.get_minorticklabels())]
        assert shown == [major, minor]


def test_run_and_compare_plots_of_heavy_tailed_latencies_parse_no_mathtext(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Latencies over four decades get log x axes; matplotlib's own log tick labels are mathtext
    (parsed by pyparsing: the largest single cost of drawing a run's plots), the plots' are plain text."""
    parsed: list[str] = []
    real = MathTextParser.parse

    def counting(self, s, *args, **kwargs):  # type: ignore[no-untyped-def]
        parsed.append(s)
        return real(self, s, *args, **kwargs)

    monkeypatch.setattr(MathTextParser, "parse", counting)
    records = [rec(i, sent_at=2.0 * i, ttft=0.01 * 1.1 ** (i % 100), e2e=0.05 * 1.12 ** (i % 100), queue=0.1 * (i % 3),
                   node=f"w{i % 2}", ideal=50) for i in range(300)]
    timeline = switching_timeline()
    report = build_report(records, meta={"label": "heavy"}, timeline=timeline)
    plots = plot_run(tmp_path / "run", report, records, timeline_from_builtins(report["timeline"]))
    assert [p.file for p in plots] == ["ttft_cdf.png", "e2e_cdf.png", "throughput.png", "split_timeline.png",
                                      "lost_kv_reuse.png", "prefill_queue.png"]
    runs = [RunData("a", report, records, timeline), RunData("b", report, records[::2], None)]
    compared = plot_compare(tmp_path / "cmp", runs)
    assert {"compare_ttft_cdf.png", "compare_e2e_cdf.png"} <= {p.file for p in compared}
    for d, p in [(tmp_path / "run", p) for p in plots] + [(tmp_path / "cmp", p) for p in compared]:
        assert (d / p.file).read_bytes().startswith(PNG_MAGIC), p.file
    assert parsed == []
