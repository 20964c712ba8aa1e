"""The planner's Prometheus families (``services/planner/prom.py``) from a core and the shell's counters, no HTTP."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.planner.core import PlannerCore
from services.planner.prom import planner_families
from shared.metrics import FuncCollector, make_registry


def test_decisions_are_counted_by_action_so_a_planner_kept_in_its_warm_up_shows():
    """A planner extending its warm-up for want of data (`up`, nothing sent) publishes ``no_switch`` decisions,
    one that switches publishes ``switch``: ``ei_planner_decisions_total`` had no label, so Prometheus could not
    tell a planner that keeps deciding to keep from one that switches. Every action has its series from 0."""
    core = PlannerCore(["w0", "w1"], "1P1D")
    counters = {"decisions": 3, "decisions.warmup": 1, "decisions.no_switch": 2}  # as PlannerService._flush counts
    svc = SimpleNamespace(core=core, counters=counters)
    reg = make_registry()
    reg.register(FuncCollector(lambda: planner_families(svc)))  # type: ignore[arg-type]
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    got = {s.labels["action"]: s.value for s in fams["ei_planner_decisions"].samples}
    assert got == {"switch": 0.0, "no_switch": 2.0, "skip": 0.0, "warmup": 1.0, "adopt": 0.0}
