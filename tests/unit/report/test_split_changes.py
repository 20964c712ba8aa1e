"""``split_changes`` counts changes of the split served, not timeline points (a draining mark is none; nodes
switching at one instant are one change)."""

from __future__ import annotations

from evolving_infra.report.metrics import timeline_metrics
from evolving_infra.report.timeline import RunTimeline, SplitPoint, SwitchRecord


def _sw(node: str, at: float) -> SwitchRecord:
    return SwitchRecord(node=node, from_phase="prefill", to_phase="decode", decided_at=10.0, applied_at=at,
                        switch_s=at - 10.0, epoch=2)


def test_one_decision_moving_three_nodes_is_three_split_changes_not_four_points():
    """One decision drains 3 nodes from t=10 (a draining mark, split unchanged) and they serve decode at 12, 13
    and 14 s: the split served changed 3 times (4P2D → 3P3D → 2P4D → 1P5D); the draining mark is no change
    (before: 4, one per timeline point)."""
    points = [
        SplitPoint(t=0.0, split="4P2D", epoch=1, prefill=4, decode=2),
        SplitPoint(t=10.0, split="4P2D", epoch=2, prefill=4, decode=2, switching=3),
        SplitPoint(t=12.0, split="3P3D", epoch=2, prefill=3, decode=3, switching=2),
        SplitPoint(t=13.0, split="2P4D", epoch=2, prefill=2, decode=4, switching=1),
        SplitPoint(t=14.0, split="1P5D", epoch=2, prefill=1, decode=5),
    ]
    tl = RunTimeline(split_timeline=points, switches=[_sw("w1", 12.0), _sw("w2", 13.0), _sw("w3", 14.0)])
    m = timeline_metrics(tl)
    assert (m["switches"], m["split_changes"], m["final_split"]) == (3, 3, "1P5D")
    assert timeline_metrics(tl, start=12.5, end=20.0)["split_changes"] == 2  # 2P4D and 1P5D in the window


def test_nodes_switching_at_one_instant_are_one_split_change():
    """A 0-s drain moving 4 nodes at once: 4 node phase switches, one change of the split served."""
    points = [SplitPoint(t=0.0, split="6P2D", prefill=6, decode=2), SplitPoint(t=5.0, split="2P6D", epoch=2, prefill=2, decode=6)]
    tl = RunTimeline(split_timeline=points, switches=[_sw(f"w{i}", 5.0) for i in range(4)])
    m = timeline_metrics(tl)
    assert (m["switches"], m["split_changes"]) == (4, 1)


def test_an_old_report_compares_by_the_new_meaning():
    """A report written before split_changes changed meaning stored 4 for the 3-node decision (one per point, the
    draining mark included); ``report compare`` / ``show`` printed 4 beside a new run's 3 under the new label
    ("7  6 (0.86x)" for two byte-identical runs). The value shown is recomputed from the stored timeline."""
    from msgspec import to_builtins

    from evolving_infra.report.compare import compare_table
    from evolving_infra.report.metrics import with_derived

    points = [
        SplitPoint(t=0.0, split="4P2D", epoch=1, prefill=4, decode=2),
        SplitPoint(t=10.0, split="4P2D", epoch=2, prefill=4, decode=2, switching=3),
        SplitPoint(t=12.0, split="3P3D", epoch=2, prefill=3, decode=3, switching=2),
        SplitPoint(t=13.0, split="2P4D", epoch=2, prefill=2, decode=4, switching=1),
        SplitPoint(t=14.0, split="1P5D", epoch=2, prefill=1, decode=5),
    ]
    tl = to_builtins(RunTimeline(split_timeline=points, switches=[_sw("w1", 12.0), _sw("w2", 13.0), _sw("w3", 14.0)]))
    old = {"split_changes": 4, "switches": 3, "timeline": tl}
    new = {"split_changes": 3, "switches": 3, "timeline": tl}
    assert with_derived(old)["split_changes"] == 3
    row = next(r for r in compare_table([old, new]) if r["key"] == "split_changes")
    assert row["values"] == [3, 3] and row["ratios"] == [None, 1.0]
    assert with_derived({"split_changes": 4})["split_changes"] == 4  # no timeline: the stored value, as it is
    assert with_derived({"split_changes": 4, "timeline": {"split_timeline": "x"}})["split_changes"] == 4  # malformed
