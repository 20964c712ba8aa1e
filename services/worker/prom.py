"""The worker's Prometheus families (one node), built at scrape time from the engine scheduler.

Served on ``--metrics-port`` when set. Every series carries ``node``.

=========================================  =======  ===============================================================
name                                       type     meaning
=========================================  =======  ===============================================================
``ei_node_phase{node,phase}``              gauge    1 for the phase the node serves (prefill / decode / both), else 0
``ei_node_queue_depth{node}``              gauge    requests queued for prefill (or waiting for decode KV room)
``ei_node_running_batch{node}``            gauge    requests in the running batch (prefilling or decoding)
``ei_node_decoding{node}``                 gauge    requests decoding
``ei_node_parked{node}``                   gauge    prefills done whose hand-off waits for their decode binding
                                                    (``route.bind``), their prompt KV held: in neither the running
                                                    batch nor the queue depth
``ei_node_kv_l1_used_blocks{node}``        gauge    KV blocks in use in GPU memory (L1)
``ei_node_kv_l1_capacity_blocks{node}``    gauge    KV blocks GPU memory holds
``ei_node_kv_l2_used_blocks{node}``        gauge    KV blocks in host memory (L2)
``ei_node_kv_l2_capacity_blocks{node}``    gauge    KV blocks host memory holds
``ei_node_switching{node}``                gauge    1 while draining for a phase switch
``ei_node_kv_fetched_held_bytes{node}``    gauge    bytes of peer-fetched KV pages the engine holds for open fetches (0 between)
``ei_node_iterations_total{node}``         counter  engine iterations run
``ei_node_split_epoch{node}``              gauge    epoch of the split command the node last applied
``ei_node_count_gaps_total{node}``         counter  ``kv.counts`` messages found missing (a skipped ``seq`` or a seq beacon past the last)
``ei_node_count_beacon_gaps_total{node}``  counter  of those, found by the directory's seq beacon (a lost last message)
``ei_node_count_stale_total{node}``        counter  ``kv.counts`` messages dropped as old or duplicated
``ei_node_count_syncs_total{node}``        counter  node count snapshots applied from the directory (``kv.countsync``)
``ei_node_count_sync_failures_total{node}`` counter ``kv.countsync`` requests without a usable reply (retried)
``ei_node_count_stale_epoch_total{node}``  counter  ``kv.counts`` messages and beacons of a directory epoch that is over
``ei_node_count_sync_too_large_total{node}`` counter node count snapshots too large to fetch (no sync in that epoch after one)
``ei_node_count_syncing{node}``            gauge    1 while the node's counts await a ``kv.countsync`` snapshot
``ei_node_step_running_seconds{node}``     gauge    wall seconds the engine step in flight has run as the watchdog counts
                                                    it (0 between steps, in its unwatched waits, or without
                                                    ``--watchdog-timeout-s``); past the timeout the node exits
``ei_node_watchdog_timeouts_total{node}``  counter  engine steps (or, between steps, the event loop) found hung by the
                                                    watchdog (the node exits right after)
``ei_node_bind_failures_total{node}``      counter  prefills whose decode binding (``route.bind``) failed: the request
                                                    aborted here, its client answered an error
``ei_node_bind_refused_total{node}``       counter  of those, refused by the router as malformed or invalid (e.g. a
                                                    node outside its node set: a configuration or version mismatch)
``ei_node_handoffs_sent_total{node}``      counter  PD hand-offs this node sent as prefill node (``DecodeWork`` out)
``ei_node_handoff_sent_bytes_total{node}`` counter  bytes of K/V those carried (a real engine's; 0 for the sim engine)
``ei_node_handoff_sent_chunks_total{node}`` counter pieces that K/V went in (``work.<decode>.kv``, each answered)
``ei_node_handoff_chunk_retries_total{node}`` counter pieces sent again, unanswered in ``--handoff-chunk-timeout-s``
``ei_node_handoffs_failed_total{node}``    counter  hand-offs that did not go out (K/V refused or unanswered, the bus
                                                    refused the work): the request failed with the reason
``ei_node_handoffs_received_total{node}``  counter  hand-offs this node took as decode node
``ei_node_handoff_received_bytes_total{node}`` counter bytes of K/V those brought
``ei_node_handoff_received_chunks_total{node}`` counter pieces that K/V came in
``ei_node_handoff_kv_dropped_total{node,reason}`` counter hand-off K/V the decode node let go unused: ``expired`` (no
                                                    new piece for ``--handoff-piece-idle-s``, or, complete, no work
                                                    for ``--handoff-kv-timeout-s``), ``refused`` (a piece refused for
                                                    good: too large, a bad piece, a CRC-32 mismatch, stopping, serving
                                                    prefill; not a ``full`` one), ``lost`` (a work whose K/V was not all
                                                    here: the request failed), ``discarded`` (its work is not served
                                                    here: an old attempt, its rid aborted, a switch to prefill),
                                                    ``cancelled`` (its prefill node gave the hand-off up)
``ei_node_handoff_full_refusals_total{node}`` counter pieces the decode node refused ``full`` (its hand-off buffer had
                                                    no room then): no drop, the prefill node sends each again after a
                                                    backoff (before, counted in ``..._kv_dropped_total{reason="refused"}``
                                                    even when the piece was stored at its next send)
``ei_node_handoff_kv_held_bytes{node}``    gauge    bytes of hand-off K/V stored for transfers not yet taken by their work
``ei_node_handoff_queue_depth{node}``      gauge    hand-offs waiting in this decode node's queue for buffer room (first
                                                    come, first served: room goes to the oldest first ask)
``ei_node_handoff_queue_wait_seconds{node}`` histogram wall seconds each hand-off admitted from the queue waited there
``ei_node_handoff_queue_dropped_total{node,reason}`` counter hand-offs that left the queue unadmitted or got no place:
                                                    ``expired`` (its sender stopped asking for ``TICKET_IDLE_S``, 3 s),
                                                    ``cancelled`` (``KvCancel``), ``discarded`` (its request aborted,
                                                    or the node serves prefill now), ``refused`` (the queue at its bound)
``ei_node_handoffs_queued_total{node}``    counter  hand-offs this prefill node sent that waited in a decode node's queue
=========================================  =======  ===============================================================

``ei_node_requests_dropped_owner_gone_total{node,reason}`` (counter): requests the owner check dropped because their
router no longer wants them, a stream lost with its router: ``router_gone`` (nobody served ``route.held.<router>``
for ``--owner-gone-after-s``: a router SIGKILLed, OOM-killed or cut off) or ``not_in_flight`` (the router, or one
restarted under its ``--instance``, answered twice ``OWNER_RECHECK_S`` apart that it does not have it in flight: a
router restarted, or a request whose end never reached this node, e.g. an abort lost on the bus); each one also a
warning in the worker's log naming its rid, its router and the output tokens it had (``owners.py``; alert
``EIStreamsLostWithRouter``). A lower bound: a stream that ends on this node after its router died but before the
check's verdict (a restart takes seconds; gone takes ``--owner-gone-after-s``) lost its tail to nobody, but the node
then holds nothing to drop, and it cannot tell that stream from one its router received just before dying (it knows
when it published the end, not whether the router read it): not counted. Each request counts on the one node holding
it (a PD prefill leaves its node's core before its hand-off is published), except one re-dispatched as its router
died: its old attempt on one node and its new one on another both count.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from shared.metrics import counter_family, gauge_family, histogram_family

if TYPE_CHECKING:
    from services.worker.service import WorkerService

PHASES = ("prefill", "decode", "both")

HANDOFF_KV_DROPS = ("expired", "refused", "lost", "discarded", "cancelled")
"""``reason`` label values of ``ei_node_handoff_kv_dropped_total`` (each exported from 0)."""

HANDOFF_QUEUE_DROPS = ("expired", "cancelled", "discarded", "refused", "unused_turn")
"""``reason`` label values of ``ei_node_handoff_queue_dropped_total`` (each exported from 0)."""

OWNER_DROP_REASONS = ("router_gone", "not_in_flight")
"""``reason`` label values of ``ei_node_requests_dropped_owner_gone_total`` (each exported from 0)."""


def worker_families(svc: "WorkerService") -> Iterator[Metric]:
    """Every worker family (table in the module docstring) for ``svc``'s node."""
    st = svc.core.state(svc.clock.local_now(), with_queue=False)
    n = svc.node
    yield gauge_family(
        "ei_node_phase", "1 for the phase the node serves, else 0", {(n, ph): float(st.phase == ph) for ph in PHASES}, ["node", "phase"]
    )
    g = {
        "ei_node_queue_depth": ("Requests queued for prefill (or waiting for decode KV room)", st.waiting),
        "ei_node_running_batch": ("Requests in the running batch (prefilling or decoding)", st.running),
        "ei_node_decoding": ("Requests decoding", st.decoding),
        "ei_node_parked": ("Prefills done whose hand-off waits for their decode binding (route.bind); their KV held",
                           len(svc.core.parked)),
        "ei_node_kv_l1_used_blocks": ("KV blocks in use in GPU memory (L1)", st.gpu_total_blocks - st.gpu_free_blocks),
        "ei_node_kv_l1_capacity_blocks": ("KV blocks GPU memory (L1) holds", st.gpu_total_blocks),
        "ei_node_kv_l2_used_blocks": ("KV blocks held in host memory (L2)", st.host_used_blocks),
        "ei_node_kv_l2_capacity_blocks": ("KV blocks host memory (L2) holds", st.host_total_blocks),
        "ei_node_switching": ("1 while draining for a phase switch", 1 if svc._switch is not None else 0),
        "ei_node_kv_fetched_held_bytes": ("Bytes of peer-fetched KV pages the engine holds for fetches still open",
                                          svc.engine.fetched_bytes()),
        "ei_node_split_epoch": ("Epoch of the split command the node last applied", svc.epoch),
    }
    for name, (doc, v) in g.items():
        yield gauge_family(name, doc, {(n,): float(v)}, ["node"])
    yield counter_family("ei_node_iterations", "Engine iterations run", {(n,): float(svc.core.iterations)}, ["node"])
    cc = svc.counts.counters
    for name, doc, v in (
        ("ei_node_count_gaps", "kv.counts messages found missing (a skipped seq or a seq beacon past the last)", cc["gap"]),
        ("ei_node_count_beacon_gaps", "kv.counts gaps found by the KV directory's seq beacon (a lost last message)", cc["gap.beacon"]),
        ("ei_node_count_stale", "kv.counts messages dropped as old or duplicated", cc["stale"]),
        ("ei_node_count_syncs", "Node count snapshots applied from the KV directory (kv.countsync)", cc["syncs"]),
        ("ei_node_count_sync_failures", "kv.countsync requests without a usable reply (retried)", svc.counters["counts.sync.failures"]),
        ("ei_node_count_stale_epoch", "kv.counts messages and beacons of a KV directory epoch that is over (dropped)", cc["stale_epoch"]),
        ("ei_node_count_sync_too_large", "Node count snapshots too large to fetch (no count sync in that directory epoch after one)",
         cc["sync.too_large"]),
    ):
        yield counter_family(name, doc, {(n,): float(v)}, ["node"])
    wd = svc.watchdog
    yield gauge_family("ei_node_step_running_seconds", "Wall seconds the engine step in flight has run (0 between steps)",
                       {(n,): wd.running_s() if wd is not None else 0.0}, ["node"])
    yield counter_family("ei_node_watchdog_timeouts", "Engine steps (or, between steps, the event loop) found hung by the watchdog (the node exits)",
                         {(n,): float(svc.counters["watchdog.timeouts"])}, ["node"])
    yield counter_family(
        "ei_node_bind_failures",
        "Prefills whose decode binding (route.bind) failed: no router or no decode node in time, the owning router gone, "
        "a permission refused, or the router's refusal; the request is aborted and its client answered an error",
        {(n,): float(svc.counters["bind.failed"])}, ["node"],
    )
    yield counter_family(
        "ei_node_bind_refused",
        "Decode bindings the router refused as malformed or invalid (e.g. a prefill node outside its node set: a "
        "configuration or version mismatch), failed at once",
        {(n,): float(svc.counters["bind.refused"])}, ["node"],
    )
    yield counter_family(
        "ei_node_requests_dropped_owner_gone",
        "Requests dropped because their owning router no longer wants them (a stream lost with its router): router_gone "
        "(nobody served route.held.<router> for --owner-gone-after-s: SIGKILLed, OOM-killed, cut off) or not_in_flight "
        "(the router, or one restarted under its --instance, answered twice 1 s apart that it does not have the request "
        "in flight: a restart, or a request whose end never reached this node); each one a warning in the worker's log "
        "naming its rid. A lower bound: a stream that ended here after its router died, before the check's verdict, "
        "lost its tail uncounted (the node cannot tell it from one the router read just before dying)",
        {(n, k): float(svc.counters[f"owners.dropped.{k}"]) for k in OWNER_DROP_REASONS}, ["node", "reason"],
    )
    c, kc = svc.counters, svc._kv_in.counters
    for name, doc, v in (
        ("ei_node_handoffs_sent", "PD hand-offs this node sent as prefill node (DecodeWork out)", c["requests.handed_off"]),
        ("ei_node_handoff_sent_bytes", "Bytes of K/V the hand-offs sent carried (a real engine's; 0 for the sim engine)",
         c["handoff.sent_bytes"]),
        ("ei_node_handoff_sent_chunks", "Pieces the sent hand-offs' K/V went in (work.<decode>.kv, each answered)", c["handoff.sent_chunks"]),
        ("ei_node_handoff_chunk_retries", "Hand-off K/V pieces sent again, unanswered within --handoff-chunk-timeout-s",
         c["handoff.chunk_retries"]),
        ("ei_node_handoffs_failed", "Hand-offs that did not go out (K/V refused or unanswered, or the bus refused the work): "
         "the request failed with the reason", c["requests.handoff_failed"]),
        ("ei_node_handoffs_received", "PD hand-offs this node took as decode node", c["handoff.received"]),
        ("ei_node_handoff_received_bytes", "Bytes of K/V the hand-offs taken brought", c["handoff.received_bytes"]),
        ("ei_node_handoff_received_chunks", "Pieces the taken hand-offs' K/V came in", c["handoff.received_chunks"]),
    ):
        yield counter_family(name, doc, {(n,): float(v)}, ["node"])
    refused = sum(v for k, v in kc.items() if k.startswith("refused.")) + c["handoff.kv.refused.stopping"] + c["handoff.kv.refused.prefill"]
    drops = {"expired": kc["expired"], "refused": refused, "lost": kc["missing"], "discarded": kc["discarded"], "cancelled": kc["cancelled"]}
    yield counter_family(
        "ei_node_handoff_kv_dropped",
        "Hand-off K/V this decode node let go unused: expired (no new piece for --handoff-piece-idle-s, or complete, no "
        "work for --handoff-kv-timeout-s), refused (a piece refused for good: too large, a bad piece, a CRC-32 mismatch, "
        "stopping, serving prefill; not a full one, see ei_node_handoff_full_refusals_total), lost (a work whose K/V was not all here: the request failed), discarded "
        "(its work is not served here: an old attempt, its rid aborted, a switch to prefill), cancelled (its prefill node "
        "gave the hand-off up)",
        {(n, k): float(drops[k]) for k in HANDOFF_KV_DROPS}, ["node", "reason"],
    )
    yield counter_family("ei_node_handoff_full_refusals", "Hand-off K/V pieces this decode node refused full (its buffer had "
                         "no room then): no drop, the prefill node sends each again after a backoff", {(n,): float(kc["full_refusals"])},
                         ["node"])  # fmt: skip
    yield gauge_family("ei_node_handoff_kv_held_bytes", "Bytes of hand-off K/V stored for transfers not yet taken by their work",
                       {(n,): float(svc._kv_in.held_bytes)}, ["node"])
    yield gauge_family("ei_node_handoff_queue_depth", "Hand-offs waiting in this decode node's queue for room in its hand-off "
                       "buffer (first come, first served)", {(n,): float(len(svc._kv_in.queue))}, ["node"])  # fmt: skip
    yield histogram_family("ei_node_handoff_queue_wait_seconds", "Wall seconds each hand-off admitted from this decode "
                           "node's queue waited there (its first ask to its admission)", {(n,): svc._kv_in.queue_waits},
                           ["node"])  # fmt: skip
    qleft = {"expired": kc["queue.expired"], "cancelled": kc["queue.cancelled"], "discarded": kc["queue.discarded"],
             "refused": kc["queue.refused"], "unused_turn": kc["queue.unused_turns"]}
    yield counter_family(
        "ei_node_handoff_queue_dropped",
        "Hand-offs that left this decode node's queue for room without being admitted, or were refused a place: expired "
        "(its sender stopped asking for 3 s), cancelled (its sender gave it up), discarded (its request aborted, or "
        "the node serves prefill now), refused (the queue at its bound of "
        "1,024, or 128 of one sender: refused full without a place), unused_turn (its turn came and its piece did not "
        "follow within 0.4 s)",
        {(n, k): float(qleft[k]) for k in HANDOFF_QUEUE_DROPS}, ["node", "reason"],
    )
    yield counter_family("ei_node_handoffs_queued", "Hand-offs this prefill node sent that waited in their decode node's "
                         "queue for room (--handoff-queue-wait-s)", {(n,): float(c["handoff.queued"])}, ["node"])  # fmt: skip
    yield gauge_family("ei_node_count_syncing", "1 while the node's counts await a kv.countsync snapshot", {(n,): float(svc.counts.syncing)}, ["node"])
