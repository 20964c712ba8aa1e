"""The planner's Prometheus families: the PD split over time, its changes and the switch time.

Served on ``--metrics-port`` when set.

=========================================  =========  =============================================================
name                                       type       meaning
=========================================  =========  =============================================================
``ei_split_nodes{phase}``                  gauge      nodes the current split gives each phase (prefill/decode/both)
``ei_split_epoch``                         gauge      epoch of the current split command
``ei_split_changes_total``                 counter    split changes the planner decided (policy or operator)
``ei_split_switch_seconds``                histogram  a node's decision → serving its new phase (simulated s),
                                                      from ``split.applied`` (a node restarted after the decision:
                                                      from its start); ``_count`` = node switches done (a node
                                                      the split leaves in its phase is not counted)
``ei_split_switch_drain_seconds``          histogram  of that, draining the node's running requests
``ei_planner_decisions_total{action}``     counter    planner decisions published, by action: ``switch``,
                                                      ``no_switch`` (kept; also a warm-up extended for want of
                                                      data), ``skip``, ``warmup``, ``adopt``
=========================================  =========  =============================================================
"""

from __future__ import annotations

from collections import Counter as _Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from shared.metrics import by_prefix, counter_family, gauge_family

DECISION_ACTIONS = ("switch", "no_switch", "skip", "warmup", "adopt")
"""``PlannerDecision.action`` values (``shared/messages.py``), each a series of ``ei_planner_decisions_total``."""

if TYPE_CHECKING:
    from services.planner.service import PlannerService

SWITCH_BUCKETS_S: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Bucket upper bounds (s) of the phase-switch histograms; +Inf implied."""


def planner_families(svc: "PlannerService") -> Iterator[Metric]:
    """The split gauges and counters (table in the module docstring; the histograms live on the registry)."""
    cmd = svc.core.command
    tally = _Tally(cmd.phases.values())
    yield gauge_family(
        "ei_split_nodes", "Nodes the current PD split gives each phase", {(ph,): float(tally[ph]) for ph in ("prefill", "decode", "both")},
        ["phase"],
    )
    yield gauge_family("ei_split_epoch", "Epoch of the current split command", {(): float(cmd.epoch)})
    yield counter_family("ei_split_changes", "Split changes the planner decided (policy or operator)", {(): float(svc.core.switches)})
    actions: dict[tuple[str, ...], float] = {(a,): 0.0 for a in DECISION_ACTIONS}  # every action from 0: rate() sees its first increase
    actions.update(by_prefix(svc.counters, "decisions."))
    yield counter_family(
        "ei_planner_decisions",
        "Planner decisions published, by action: switch, no_switch (split kept; also a warm-up extended for want of "
        "data), skip (busy, cooldown, too little data), warmup, adopt (the split the nodes serve, at start)",
        actions, ["action"],
    )
