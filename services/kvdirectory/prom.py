"""The KV directory's Prometheus families: reuse (h vs h*), lost KV reuse, index size, branches, handler latency.

Served on ``--metrics-port`` when set. Token counts follow the directory's
definitions (``services/kvdirectory/reuse.py``, paper §3.3 / App. C.1): per
prefill placement, the ideal hit h* (an unlimited cache shared by all nodes)
and the hit h the cluster could serve; lost KV reuse = 1 − h/h*.

=========================================================  =========  ======================================================================
name                                                       type       meaning
=========================================================  =========  ======================================================================
``ei_kv_reuse_ideal_tokens_total``                         counter    Σ h*: prompt tokens an ideal shared cache would reuse
``ei_kv_reuse_hit_tokens_total``                           counter    Σ h: of those, tokens held somewhere (hit)
``ei_kv_reuse_lost_tokens_total{cause}``                   counter    Σ (h* − h) by cause: eviction / routing / unattributed
``ei_kv_lost_reuse_ratio``                                 gauge      1 − Σh / Σh* (0 before any placement)
``ei_kv_hit_ratio``                                        gauge      Σh / Σh* = 1 − lost KV reuse (see below)
``ei_kvdirectory_blocks_indexed``                          gauge      distinct KV blocks the directory knows
``ei_kvdirectory_copies{tier}``                            gauge      block copies held, by tier (gpu = L1, host = L2)
``ei_kvdirectory_count_syncs_total``                       counter    node count snapshots sent to workers that lost a ``kv.counts``
``ei_kvdirectory_count_sync_entries_total``                counter    block counts those snapshots carried
``ei_kvdirectory_count_sync_refusals_total``               counter    new snapshots refused: asked sooner than
                                                                      ``--count-sync-min-interval-s``
``ei_kvdirectory_count_beacons_total``                     counter    ``kv.counts`` seq beacons published (``--count-seq-beacon-s``)
``ei_kvdirectory_count_beacon_errors_total``               counter    seq beacons whose publication failed
``ei_kvdirectory_branches_active``                         gauge      agent branches the directory counts (started, not ended / expired)
``ei_kvdirectory_branch_compactions_total``                counter    placements whose path did not extend the branch's last one (a
                                                                      compaction, or a side request on the branch's id: its blocks past the
                                                                      common prefix released; Alg. E.1)
``ei_kvdirectory_branch_parents_missing_total{reason}``    counter    new branches whose parent was not an active branch here, by reason:
                                                                      ``unknown``, ``ended``, ``expired``
``ei_kvdirectory_ingest_seconds``                          histogram  wall time to apply one ``kv.events`` batch
``ei_kvdirectory_lookup_seconds``                          histogram  wall time to answer one ``kv.lookup``
=========================================================  =========  ======================================================================

``ei_kv_hit_ratio`` is the share of the *reusable* prefix tokens (h*) that the cluster
held (h), over prefill placements of ``X-Branch-Id`` requests; new prompt tokens are in
neither. It is not the served KV hit rate (the share of *all* prompt tokens served from
cache, the run report's "KV hit"): that is the router's ``ei_router_kv_hit_ratio``
(``services/router/prom.py``), lower whenever prompts carry new tokens (1.0 here vs 0.5
there for a turn whose prompt is half an earlier turn's prefix, half new).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from shared.metrics import by_prefix, counter_family, gauge_family

LOSS_CAUSES = ("eviction", "routing", "unattributed")
"""Causes of lost reuse (``services/kvdirectory/reuse.py``, paper App. C.1)."""

PARENT_MISSING_REASONS = ("unknown", "ended", "expired")
"""Why a new branch's parent was not an active branch of the directory (``DirectoryService._parent_missing``)."""

if TYPE_CHECKING:
    from services.kvdirectory.service import DirectoryService


def directory_families(svc: "DirectoryService") -> Iterator[Metric]:
    """The reuse and index families (the latency histograms live on the registry)."""
    c = svc.core.counters
    ideal = float(c.get("reuse.ideal_tokens", 0))
    hit = float(c.get("reuse.hit_tokens", 0))
    yield counter_family("ei_kv_reuse_ideal_tokens", "Prompt tokens an ideal shared cache would reuse (h*)", {(): ideal})
    yield counter_family("ei_kv_reuse_hit_tokens", "Prompt tokens reused from a cache somewhere in the cluster (h)", {(): hit})
    lost: dict[tuple[str, ...], float] = {(cause,): 0.0 for cause in LOSS_CAUSES}  # every cause from the start: rate() sees its first increase
    lost.update(by_prefix(c, "reuse.lost_tokens."))
    yield counter_family("ei_kv_reuse_lost_tokens", "Lost KV reuse (h* - h) in tokens, by cause", lost, ["cause"])
    yield gauge_family("ei_kv_lost_reuse_ratio", "Lost KV reuse: 1 - h/h*", {(): (1.0 - hit / ideal) if ideal else 0.0})
    yield gauge_family(
        "ei_kv_hit_ratio",
        "Reusable prefix tokens the cluster held over those an ideal shared cache would reuse, h/h* at X-Branch-Id "
        "placements (= 1 - ei_kv_lost_reuse_ratio; 0 before any); not the served KV hit rate over all prompt tokens, "
        "which is the router's ei_router_kv_hit_ratio",
        {(): (hit / ideal) if ideal else 0.0},
    )
    g = svc.core.gauges()
    yield gauge_family("ei_kvdirectory_blocks_indexed", "Distinct KV blocks the directory knows", {(): g.get("blocks.indexed", 0.0)})
    yield gauge_family(
        "ei_kvdirectory_copies", "KV block copies held, by tier (gpu = L1, host = L2)",
        {(t,): v for t in ("gpu", "host") if (v := g.get(f"copies.{t}")) is not None}, ["tier"],
    )
    yield gauge_family(
        "ei_kvdirectory_branches_active", "Agent branches the directory counts blocks for (started, not ended or expired)",
        {(): g.get("branches.active", 0.0)},
    )
    yield counter_family(
        "ei_kvdirectory_branch_compactions",
        "Placements of a branch whose block path did not extend its previous one (a compaction, or a side request sent "
        "on the branch's X-Branch-Id): the branch's blocks past the common prefix released (branch.version_bumps)",
        {(): float(c.get("branch.version_bumps", 0))},
    )
    sc = svc.counters
    yield counter_family(
        "ei_kvdirectory_branch_parents_missing",
        "New branches whose X-Parent-Branch-Id was not an active branch of the directory, by reason (unknown, ended, "
        "expired): a fork's first request then gets no prefix from its parent",
        {(r,): float(sc.get(f"branch.parent_missing.{r}", 0)) for r in PARENT_MISSING_REASONS}, ["reason"],
    )
    yield counter_family(
        "ei_kvdirectory_count_syncs", "Node count snapshots sent to workers that lost a kv.counts message (kv.countsync)",
        {(): float(sc.get("countsync.snapshots", 0))},
    )
    yield counter_family(
        "ei_kvdirectory_count_sync_entries", "Block counts R[b, node] sent in kv.countsync snapshots",
        {(): float(sc.get("countsync.entries", 0))},
    )
    yield counter_family(
        "ei_kvdirectory_count_sync_refusals", "New kv.countsync snapshots of a node refused: asked sooner than --count-sync-min-interval-s",
        {(): float(sc.get("countsync.rate_limited", 0))},
    )
    yield counter_family(
        "ei_kvdirectory_count_beacons", "kv.counts seq beacons published (each node's last seq, every --count-seq-beacon-s)",
        {(): float(sc.get("counts.beacons", 0))},
    )
    yield counter_family(
        "ei_kvdirectory_count_beacon_errors", "kv.counts seq beacons whose publication failed",
        {(): float(sc.get("counts.beacon_errors", 0))},
    )
