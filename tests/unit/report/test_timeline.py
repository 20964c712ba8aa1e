"""TimelineRecorder: split over time and phase switches from split.applied messages (Appendix C.1, C.2)."""

from __future__ import annotations

import msgspec
import pytest

from evolving_infra.report.metrics import timeline_metrics
from evolving_infra.report.timeline import RunTimeline, TimelineRecorder, timeline_from_builtins

from .helpers import applied, switching_timeline

PHASES = {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "decode"}


def test_unchanged_phases_are_not_switches():
    r = TimelineRecorder(PHASES, t0=5.0)
    for n, ph in PHASES.items():
        r.on_applied(applied(n, ph, epoch=1, decided=10.0, at=11.0))
    tl = r.timeline()
    assert tl.switches == []
    assert [(p.t, p.split, p.prefill_nodes) for p in tl.split_timeline] == [(5.0, "2P2D", ["w0", "w1"])]


def test_switch_records_and_points():
    tl = switching_timeline()
    sw = [(s.node, s.from_phase, s.to_phase, s.switch_s, s.epoch) for s in tl.switches]
    assert sw == [
        ("w1", "prefill", "decode", pytest.approx(5.0), 1),
        ("w1", "decode", "prefill", pytest.approx(3.0), 2),
        ("w2", "decode", "prefill", pytest.approx(4.0), 2),
    ]
    p = tl.split_timeline
    assert [(x.t, x.split, x.prefill, x.decode, x.epoch) for x in p] == [
        (0.0, "2P2D", 2, 2, 0), (100.0, "1P3D", 1, 3, 1), (203.0, "2P2D", 2, 2, 2), (204.0, "3P1D", 3, 1, 2),
    ]
    assert tl.split_at(150.0).split == "1P3D" and tl.split_at(-1.0) is None
    assert tl.prefill_nodes_between(150.0, 210.0) == {"w0", "w1", "w2"}


def test_draining_marks_switching_until_serving():
    r = TimelineRecorder(PHASES, t0=0.0)
    r.on_applied(applied("w1", "decode", epoch=1, decided=10.0, at=10.0, status="draining"))
    r.on_applied(applied("w1", "decode", epoch=1, decided=10.0, at=16.0))
    tl = r.timeline()
    assert [(p.t, p.split, p.switching) for p in tl.split_timeline] == [(0.0, "2P2D", 0), (10.0, "2P2D", 1), (16.0, "1P3D", 0)]
    assert tl.switches[0].switch_s == pytest.approx(6.0)


def test_same_instant_updates_collapse_to_one_point():
    r = TimelineRecorder(PHASES, t0=0.0)
    r.on_applied(applied("w2", "prefill", epoch=1, decided=9.0, at=10.0))
    r.on_applied(applied("w3", "prefill", epoch=1, decided=9.0, at=10.0))
    assert [(p.t, p.split) for p in r.timeline().split_timeline] == [(0.0, "2P2D"), (10.0, "4P0D")]


def test_collocated_start_and_unknown_node():
    r = TimelineRecorder({"w0": "both", "w1": "both"}, t0=0.0)
    r.on_applied(applied("w9", "decode", epoch=1, decided=1.0, at=2.0))  # not in the launch split: no switch
    tl = r.timeline()
    assert tl.split_timeline[0].split == "collocated" and tl.split_timeline[0].prefill == 2
    assert tl.switches == []
    last = tl.split_timeline[-1]
    assert (last.t, last.split, last.prefill, last.decode) == (2.0, "0P1D+2B", 2, 1)  # "both" nodes serve prefill too


def test_round_trip_and_metrics_window():
    tl = switching_timeline()
    back = timeline_from_builtins(msgspec.to_builtins(tl))
    assert back == tl
    assert timeline_from_builtins(None) is None
    with pytest.raises(ValueError, match="timeline"):
        timeline_from_builtins({"split_timeline": [{"t": "x"}]})
    m = timeline_metrics(tl, start=150.0, end=250.0)
    assert m["switches"] == 2 and m["switch_time_mean_s"] == pytest.approx(3.5)
    assert m["split_changes"] == 2 and m["final_split"] == "3P1D"
    assert timeline_metrics(RunTimeline())["switches"] == 0


def test_messages_stamped_out_of_order_give_a_timeline_in_time_order():
    """Nodes stamp applied_at on their own clocks: a demo's split_timeline had [1140.6957, '1P1D+2B']
    before [1140.6344, '2P1D+1B'] (arrival order). Points are in time order, each the split of the
    messages stamped up to it, and switches follow applied_at; the same messages in time order give
    the same timeline."""
    start = {"w0": "both", "w1": "both", "w2": "both", "w3": "decode"}
    msgs = [
        applied("w0", "prefill", epoch=1, decided=1140.0, at=1140.6344),
        applied("w1", "decode", epoch=1, decided=1140.0, at=1140.6957),
        applied("w2", "both", epoch=1, decided=1140.0, at=1140.70),
    ]
    late = TimelineRecorder(start, t0=0.0)
    late.feed([msgs[1], msgs[0], msgs[2]])  # w1's message crossed the bus first
    tl = late.timeline()
    assert [(p.t, p.split) for p in tl.split_timeline] == [
        (0.0, "0P1D+3B"), (1140.6344, "1P1D+2B"), (1140.6957, "1P2D+1B"),
    ]
    assert [s.node for s in tl.switches] == ["w0", "w1"]
    in_order = TimelineRecorder(start, t0=0.0)
    in_order.feed(msgs)
    assert in_order.timeline() == tl
    times = [t for t, _ in timeline_metrics(tl)["split_timeline"]]
    assert times == sorted(times)
