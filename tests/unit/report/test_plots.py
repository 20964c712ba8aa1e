"""What the plots draw: the decimated CDF line stays within a pixel of the full one; log axes need no mathtext."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.mathtext import MathTextParser

from evolving_infra.report.metrics import cdf
from evolving_infra.report.plots import DPI, LogTickFormatter, RunData, cdf_steps, plain_tick_label, plot_compare, plot_run
from evolving_infra.report.timeline import RunTimeline, SplitPoint, timeline_from_builtins
from evolving_infra.report.write import build_report

from .helpers import rec, switching_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGSIZE = (6.4, 4.0)  # the latency CDFs' figure


def _raster(x: np.ndarray, y: np.ndarray, *, log: bool) -> np.ndarray:
    """[H, W] bool: the pixels a 1-px, non-antialiased steps-post line through (x, y) lights, on the CDF's figure."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    ax = fig.add_subplot()
    ax.plot(x, y, drawstyle="steps-post", color="k", linewidth=1, antialiased=False)
    if log:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.01)
    ax.set_axis_off()
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].min(axis=-1) < 128


def _dilate(mask: np.ndarray) -> np.ndarray:
    padded = np.pad(mask, 1)
    h, w = mask.shape
    out = np.zeros_like(mask)
    for dy in (0, 1, 2):
        for dx in (0, 1, 2):
            out |= padded[dy:dy + h, dx:dx + w]
    return out


def _within_a_pixel(a: np.ndarray, b: np.ndarray) -> bool:
    """Every lit pixel of each raster has a lit pixel of the other at most one pixel away (8-neighbourhood)."""
    return bool(a.any() and b.any() and not (a & ~_dilate(b)).any() and not (b & ~_dilate(a)).any())


@pytest.mark.parametrize("n", [400, 20_000])
@pytest.mark.parametrize("log", [True, False])
def test_decimated_cdf_draws_within_a_pixel_of_the_full_one(log: bool, n: int):
    rng = np.random.default_rng(7)
    # heavy-tailed like agent latencies: a dense steep body, a sparse tail where every step shows
    x, y = cdf(rng.lognormal(-1.0, 1.6, n) if log else rng.gamma(2.0, 1.5, n))
    xd, yd = cdf_steps(x, y, log=log, width_px=FIGSIZE[0] * DPI)
    assert len(xd) <= 2 * FIGSIZE[0] * DPI + 2 and len(xd) < len(x)
    assert (xd[0], yd[0], xd[-1], yd[-1]) == (x[0], y[0], x[-1], y[-1])  # same span, so the same autoscaled axes
    full = _raster(x, y, log=log)
    assert _within_a_pixel(full, _raster(xd, yd, log=log))
    if n == 400:  # the check has teeth: a step here is ~0.8 px tall; every 3rd point (and the last) is not the same line
        blind = np.r_[np.arange(0, n, 3), n - 1]
        assert not _within_a_pixel(full, _raster(x[blind], y[blind], log=log))


def test_cdf_steps_bounds_points_and_rejects_bad_input():
    x, y = cdf(np.random.default_rng(1).lognormal(0, 2, 1_000_000))
    xd, _ = cdf_steps(x, y, log=True, width_px=704)
    assert len(xd) <= 2 * 704 + 2
    assert np.all(np.diff(xd) >= 0)
    same = np.ones(5)
    assert cdf_steps(same, np.arange(1, 6) / 5, log=True, width_px=704)[0].tolist() == same.tolist()  # one value: uncut
    with pytest.raises(ValueError, match="sorted"):
        cdf_steps(np.array([3.0, 1.0, 2.0]), np.array([1 / 3, 2 / 3, 1.0]), log=False, width_px=704)
    with pytest.raises(ValueError, match="positive"):
        cdf_steps(np.array([0.0, 1.0, 2.0]), np.array([1 / 3, 2 / 3, 1.0]), log=True, width_px=704)
    with pytest.raises(ValueError, match="one length"):
        cdf_steps(np.array([0.0, 1.0, 2.0]), np.array([1.0]), log=False, width_px=704)


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


def test_split_plot_hatches_a_switch_still_under_way_at_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A Dynamo relaunch decided 420 s before a run's end (750 s) never completes: the split plot showed a flat
    6P3D, '0 node phase switches' and no shading while the node was out of service for the rest of the run."""
    from evolving_infra.report import plots as plots_mod
    from evolving_infra.report.timeline import RunTimeline, SplitPoint

    figs: list[Figure] = []
    real_save = plots_mod._save
    monkeypatch.setattr(plots_mod, "_save", lambda fig, out, name: (figs.append(fig), real_save(fig, out, name))[1])
    w = [f"w{i}" for i in range(6)]
    tl = RunTimeline(split_timeline=[SplitPoint(t=0.0, split="6P3D", prefill=6, decode=3, prefill_nodes=w),
                                     SplitPoint(t=180.0, split="6P3D", epoch=2, prefill=6, decode=3, switching=1, prefill_nodes=w)])
    p = plots_mod.plot_split(tmp_path, {"start_s": 0.0, "end_s": 600.0}, tl)
    assert p is not None and "hatched" in p.caption
    labels = [t.get_text() for t in figs[-1].axes[0].get_legend().get_texts()]
    assert "1 node still switching at the run's end" in labels, labels
    assert plots_mod.pending_switch(switching_timeline()) is None  # every switch applied: nothing hatched


def _demo_warmup_timeline() -> RunTimeline:
    """`make demo`'s split as its workers applied it (2026-12-05): 2P2D, the four nodes turned collocated one by
    one within 0.2 s (2P1D+1B, 1P1D+2B, 1P0D+3B on the way), collocated for the 948-s warm-up, then back to
    2P2D through 1P0D+3B, 2P0D+2B and 2P1D+1B within 6 s, and 2P2D to the end (7,389 s)."""
    w = [f"w{i}" for i in range(4)]
    pts = [(0.0, "2P2D", 2, 2), (133.25, "2P1D+1B", 3, 1), (133.34, "1P1D+2B", 3, 1), (133.35, "1P0D+3B", 4, 0),
           (133.41, "collocated", 4, 0), (1081.37, "1P0D+3B", 4, 0), (1081.42, "2P0D+2B", 4, 0),
           (1086.18, "2P1D+1B", 3, 1), (1087.01, "2P2D", 2, 2)]
    return RunTimeline(split_timeline=[SplitPoint(t=t, split=s, epoch=2 if t < 1000 else 3, prefill=p, decode=d,
                                                  prefill_nodes=w[:p]) for t, s, p, d in pts])


def _y_labels(fig: Figure) -> dict[float, str]:
    ax = fig.axes[0]
    return {float(t.get_position()[1]): t.get_text() for t in ax.yaxis.get_majorticklabels()}


def test_split_plot_labels_each_level_with_the_split_held_there_longest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The y axis named each prefill-node count after the first split seen at it: `make demo`'s 948-s collocated
    warm-up was labelled '1P0D+3B' (a state of 0.06 s on the way to it), and in `report compare` beside it a
    simulated run's 510 s at 3P1D read '2P1D+1B' (the demo's 0.1-s passing state)."""
    from evolving_infra.report import plots as plots_mod

    figs: list[Figure] = []
    real_save = plots_mod._save
    monkeypatch.setattr(plots_mod, "_save", lambda fig, out, name: (figs.append(fig), real_save(fig, out, name))[1])
    demo = _demo_warmup_timeline()
    assert plots_mod.plot_split(tmp_path, {"start_s": 0.0, "end_s": 7389.0}, demo) is not None
    assert _y_labels(figs[-1]) == {2.0: "2P2D", 3.0: "2P1D+1B", 4.0: "collocated"}
    sim = RunTimeline(split_timeline=[SplitPoint(t=0.0, split="collocated", prefill=4, decode=0),
                                      SplitPoint(t=240.0, split="3P1D", epoch=2, prefill=3, decode=1)])
    runs = [RunData("demo-out (evolving)", {"start_s": 0.0, "end_s": 7389.0}, [], demo),
            RunData("sample (evolving)", {"start_s": 0.0, "end_s": 751.0}, [], sim)]
    assert plots_mod.compare_split(tmp_path, runs) is not None
    assert _y_labels(figs[-1]) == {2.0: "2P2D", 3.0: "3P1D", 4.0: "collocated"}
