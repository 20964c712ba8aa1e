"""Configuration of the KV directory service (one Struct; flags and env derive from it)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.config import CommonConfig
from shared.subjects import check_token


class DirectoryConfig(CommonConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of ``python -m services.kvdirectory``."""

    block_size: Annotated[int, Meta(gt=0, description="tokens per KV block; events and lookups with another size are rejected")] = 64
    max_blocks: Annotated[
        int, Meta(gt=0, description="cap on indexed blocks; new blocks past it are not indexed (counted as cap.rejected_blocks)")
    ] = 16_000_000
    branch_ttl_s: Annotated[
        float, Meta(gt=0, description="simulated seconds of silence after which a branch is expired and its counts released "
                    "(measured on the monotonic clock: a step of the wall clock expires no branch)")
    ] = 1800.0
    max_tool_hold_s: Annotated[
        float,
        Meta(gt=0, description="simulated seconds a 'tool call outstanding' hint (branch.events BranchToolCall) keeps "
             "a branch and its counts from expiring at most"),
    ] = 14400.0
    branch_sync_settle_s: Annotated[
        float,
        Meta(gt=0, description="without --routers: least wall seconds after this directory's branch.sync before it "
             "answers branch.query as settled (time to hear every live router's heartbeat, one a second). Settled = "
             "every router it waits for (those named in --routers; without it, every router heard beating or "
             "republishing) has sent its BranchSyncDone marker after republishing its branches (branch.sync is sent again each second until "
             "then, for a router that missed it); until then an 'unknown' is answered synced=false and the router "
             "answers 503 Retry-After: 1, not 404"),
    ] = 10.0
    branch_sync_max_s: Annotated[
        float,
        Meta(gt=0, description="wall seconds after branch.sync at which the directory settles even though a router it "
             "waits for has not sent its marker (dead, or stalled longer; logged with the routers missing): a branch only "
             "such a router holds is then unknown here, and its end through another router a 404; >= "
             "--branch-sync-settle-s"),
    ] = 60.0
    routers: Annotated[
        list[str], Meta(description="router instance ids of the cluster, comma-separated (evolving-infra up names its "
                        "routers, deploy-args gives compose's and Slurm's directory their one, router): after a start the "
                        "directory waits for each one's republish (up to --branch-sync-max-s), even one it has not "
                        "heard yet (stalled), and for no other (one heard but not named is logged, "
                        "branch_sync.routers_unnamed); empty = the routers it hears")
    ] = []
    resync_buffer_batches: Annotated[
        int, Meta(gt=0, description="KV batches buffered per node while it awaits a resync snapshot")
    ] = 4096
    resync_timeout_s: Annotated[float, Meta(gt=0, description="wall seconds to wait for a kv.resync reply")] = 2.0
    resync_backoff_max_s: Annotated[float, Meta(gt=0, description="longest wall-clock pause between resync retries")] = 5.0
    resync_min_interval_s: Annotated[
        float, Meta(gt=0, description="least wall seconds between two resync requests to one node (a forged sequence jump cannot start a storm)")
    ] = 1.0
    kv_stale_after_s: Annotated[
        float, Meta(gt=0, description="wall seconds (monotonic clock) a node may serve (running or waiting work in its "
                    "node.state) without a kv.events batch before its KV view is stale: left out of lookups, one resync "
                    "asked (issue #22)")
    ] = 10.0
    forget_node_after_s: Annotated[
        float,
        Meta(ge=0, description="wall seconds (monotonic clock) without a kv.events batch or a node.state from a node "
             "(a running worker sends a state at least every second) after which the directory drops the node's blocks as "
             "an AllBlocksCleared would (a worker SIGKILLed and never restarted) and frees its slot (the next new node id "
             "takes it, with none of its blocks or counts); a forgotten node heard again before another id takes its slot is "
             "resynced, one heard after that is a new node; checked every --liveness-interval-s; 0 = never (then every "
             "node id ever seen keeps a slot)"),
    ] = 300.0
    liveness_interval_s: Annotated[
        float, Meta(gt=0, description="wall seconds between staleness checks and kv.liveness publications")
    ] = 1.0
    nodes: Annotated[
        list[str], Meta(description="node ids of the cluster, comma-separated; messages naming others are dropped (empty = any id, up to max_nodes)")
    ] = []
    max_nodes: Annotated[
        int, Meta(gt=0, description="most live nodes the directory tracks (a node forgotten after --forget-node-after-s "
                  "no longer counts); KV events of further node ids are dropped (counted as kv.nodes_over_limit), "
                  "as are placements and phase changes naming a new one (placed. / split.nodes_over_limit)")
    ] = 1024
    counts_flush_s: Annotated[float, Meta(gt=0, description="wall seconds between kv.counts.<node> flushes")] = 0.05
    counts_flush_updates: Annotated[
        int, Meta(gt=0, description="flush kv.counts at once when this many block count changes are pending")
    ] = 4096
    count_sync_piece: Annotated[
        int,
        Meta(gt=0, le=2**18, description="most entries per kv.countsync reply piece (a node's counts sent to a worker that "
             "lost a kv.counts message); also capped so a piece fits the server's max payload (at most 14 bytes an entry)"),
    ] = 32768
    count_sync_ttl_s: Annotated[
        float, Meta(gt=0, description="wall seconds a kv.countsync snapshot is kept for its next pieces before a worker "
                    "must ask again from the start")
    ] = 30.0
    count_sync_min_interval_s: Annotated[
        float,
        Meta(ge=0, description="least wall seconds between two new kv.countsync snapshots of one node (each copies the "
             "node's counts; the pieces of a kept one are not limited): a request sooner is answered with an error, "
             "which the worker retries after a backoff (a worker asks at most once per its own "
             "--count-sync-min-interval-s, 1 s); 0 = no limit"),
    ] = 0.5
    count_seq_beacon_s: Annotated[
        float,
        Meta(ge=0, description="wall seconds between seq beacons: every node sent kv.counts gets an empty one with the seq "
             "of the last message published to it, so a worker that lost the last one(s), with none after them to show "
             "the gap, syncs (kv.countsync); 0 disables"),
    ] = 5.0
    reuse_hit_scope: Annotated[
        Literal["cluster", "local"],
        Meta(description="lost-reuse accounting: cluster = shared pool hits, local = the node's own cache only"),
    ] = "cluster"

    def __post_init__(self) -> None:
        if not self.branch_sync_max_s >= self.branch_sync_settle_s:
            raise ValueError(f"--branch-sync-max-s ({self.branch_sync_max_s}) must be >= --branch-sync-settle-s ({self.branch_sync_settle_s})")
        for r in self.routers:
            check_token(r, "router")
