"""Configuration of a worker process (one node): one frozen Struct, flags and env derived.

``python -m services.worker --node w0 --profile gb300-glm52 --phase both --speedup 100``;
every field is also ``EI_<FIELD>`` in the environment and a key in ``--config FILE``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from msgspec import Meta

if TYPE_CHECKING:
    from shared.profile import Profile

from services.worker.kvpool.config import DEFAULT_MAX_POOL_BYTES
from shared.auth import node_is_router_name
from shared.config import CommonConfig
from shared.subjects import check_token


class WorkerConfig(CommonConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of one worker (symmetric engine host)."""

    node: Annotated[str, Meta(description="node id of this worker (one NATS token: letters, digits, - and _)")] = "w0"
    profile: Annotated[
        str, Meta(description="hardware/model profile: a name in shared/profiles (gb300-glm52, tiny) or a TOML path")
    ] = "gb300-glm52"
    gpu_kv_tokens: Annotated[
        int,
        Meta(ge=0, description="tokens of KV in this node's GPU memory (L1), over the profile's memory.gpu_kv_tokens; a "
             "multiple of the profile's block_size; the longest request (prompt + max_tokens) a node can hold, so the "
             "router's max_model_len is at most this; 0 = the profile's"),
    ] = 0
    host_kv_tokens: Annotated[
        int,
        Meta(ge=0, description="tokens of KV in this node's host memory (L2), over the profile's memory.host_kv_tokens; "
             "a multiple of block_size, at least the GPU KV; 0 = the profile's, raised to --gpu-kv-tokens when that is more"),
    ] = 0
    phase: Annotated[
        Literal["prefill", "decode", "both"], Meta(description="phase served at start: prefill, decode or both (collocated)")
    ] = "both"
    split_get_timeout_s: Annotated[
        float,
        Meta(ge=0, description="wall seconds to keep asking the planner for the current split (split.get) at start; "
             "0 = do not ask (serve --phase until a split.commands arrives)"),
    ] = 10.0
    engine: Annotated[
        Literal["sim", "torch"],
        Meta(description="engine kind; sim = profile-timed simulated GPU, torch = a real model (--model DIR, torch extra)"),
    ] = "sim"
    model: Annotated[
        str, Meta(description="torch engine: local Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    ] = ""
    dtype: Annotated[
        Literal["", "float32", "bfloat16", "float16"],
        Meta(description="torch engine: weight/KV dtype; empty = float32 on CPU, bfloat16 on CUDA"),
    ] = ""
    device: Annotated[str, Meta(description="torch engine: cpu, cuda or cuda:N; empty = cuda when present, else cpu "
                                "(evolving-infra up gives worker i cuda:{i % visible devices})")] = ""
    torch_threads: Annotated[
        int,
        Meta(ge=0, description="torch engine: intra-op CPU threads (torch.set_num_threads); 0 = torch's default "
             "(OMP_NUM_THREADS, else one per core; evolving-infra up gives each CPU worker its share of the cores)"),
    ] = 0
    tokenizer: Annotated[
        str,
        Meta(description="the router's tokenizer (sim | hf:<local path>); with hf the sim engine emits only ids of "
             "whole words of that vocabulary, so a client that tokenizes the streamed text counts what usage says"),
    ] = "sim"
    host_eviction: Annotated[
        Literal["lru", "branch-count"],
        Meta(description="host (L2) eviction order: lru, or branch-count = zero-count blocks first (kv.counts; "
             "only branch-count subscribes to kv.counts and syncs them)"),
    ] = "lru"
    log_requests: Annotated[
        bool,
        Meta(description="log one info line per request this node takes (request received: rid, role prefill/decode, "
             "attempt, prompt_tokens, max_tokens), hands off (request handed off: rid, decode node), ends (request "
             "finished: rid, finish_reason, output_tokens) or drops (request aborted: rid, reason); the rid is the "
             "router's: its client's X-Request-ID when given, or that id's NATS-safe form (the router's "
             "--log-requests lines name both); vLLM's --enable-log-requests"),
    ] = False
    stream_interval: Annotated[
        int, Meta(ge=1, description="output tokens per streamed TokenChunk after the first (SGLang stream_interval)")
    ] = 1
    state_interval_s: Annotated[
        float, Meta(ge=0, description="least wall seconds between node.state publications at iteration launches")
    ] = 0.05
    idle_state_interval_s: Annotated[
        float, Meta(gt=0, description="wall seconds between node.state publications when no iteration launches (liveness); keep "
                    "it plus a third of the routers' --fence-after-s below --fence-after-s (1 + 1 < 3 s by default), or "
                    "a hung nats-server can fence this node")
    ] = 1.0
    kv_alive_interval_s: Annotated[
        float,
        Meta(ge=0.01, description="wall seconds a node may serve (running or waiting requests) without a kv.events batch "
             "before it publishes an empty one (its next seq, no events): output tokens store no blocks, so a long "
             "decode sends none, and the directory would call the view of a healthy node stale; keep it below the "
             "directory's --kv-stale-after-s (10 s); at least 0.01 (below the step loop's 2-ms early margin every "
             "pass would send one: ~1,000 batches a second)"),
    ] = 1.0
    fold_wall_s: Annotated[
        float,
        Meta(
            ge=0,
            description="wall seconds of identical decode iterations folded into one engine step (cut short at the "
            "next iteration boundary when new work arrives); 0 = one iteration per step",
        ),
    ] = 0.005
    engine_lag_wall_s: Annotated[
        float,
        Meta(
            ge=0,
            description="sim engine: most wall seconds its timeline may trail the clock. Plans run back to back on "
            "the engine's timeline (the shell's Python work between them is not GPU time); a loop that falls "
            "further behind is overloaded, and simulated time stretches. 0 = every plan launches at the clock",
        ),
    ] = 0.1
    iters_flush_s: Annotated[float, Meta(gt=0, description="wall seconds between node.iters batches")] = 0.5
    check_invariants: Annotated[
        bool, Meta(description="run the full O(blocks) scheduler invariant check after every step (debug)")
    ] = False
    bind_timeout_s: Annotated[
        float,
        Meta(gt=0, description="wall seconds a prefill that started may wait for its decode node (route.bind, retried "
             "while no decode node is eligible) before the request fails"),
    ] = 10.0
    watchdog_timeout_s: Annotated[
        float,
        Meta(ge=0, description="wall seconds one engine step (a plan from schedule() to its end: the engine's KV drain, "
             "its forward, the outputs and hand-offs; not the sim engine's wait for the plan's end) may run; past it the step is hung "
             "(a stuck CUDA kernel or collective): the worker logs the step's requests and every thread's Python "
             "stack, stops serving and exits 1, so its supervisor restarts it and the router re-dispatches its "
             "requests (SGLang's --watchdog-timeout, 300 s). The same applies when, with no step in flight, the "
             "event loop runs nothing for this long (a handler blocks it). 0 = no watchdog"),
    ] = 300.0
    fault_hang_step: Annotated[
        int,
        Meta(ge=0, description="fault injection (tests, drills): the N-th engine step (1-based; 0: off) hangs in a "
             "thread and never returns, as a forward stuck in a CUDA kernel; the node keeps heartbeating until "
             "--watchdog-timeout-s ends it. Never set in production"),
    ] = 0
    fault_block_loop_at_s: Annotated[
        float,
        Meta(ge=0, description="fault injection (tests, drills): this many wall seconds after start (0: off), a "
             "callback blocks the event loop and never returns, as a handler stuck in a synchronous call; the "
             "heartbeat stops until --watchdog-timeout-s ends the process. Never set in production"),
    ] = 0.0
    fault_drop_kv_events: Annotated[
        bool,
        Meta(description="fault injection (tests, drills): publish no kv.events batches while serving, like a node "
             "whose KV publisher broke; the directory must mark its KV view stale (issue #22). Never set in production"),
    ] = False
    fault_delay_bind_s: Annotated[
        float,
        Meta(ge=0, description="fault injection (tests, drills): each route.bind answer naming a decode node is acted on "
             "this many wall seconds late (0: off), so a prefill that ends within it is handed off after its binding "
             "(the late-binding path, bind.after_prefill). Never set in production"),
    ] = 0.0
    fault_skip_engine_kv_batch: Annotated[
        int,
        Meta(ge=0, description="fault injection (tests, drills): the engine is not given the N-th non-empty KV event "
             "batch (1-based; 0: off), as if the shell lost it: a torch engine's page map falls out of step with the "
             "block pools (KvMapError at its next use) and the node exits non-zero to be restarted. Never set in production"),
    ] = 0
    fault_drop_counts: Annotated[
        list[int],
        Meta(description="fault injection (tests, drills): kv.counts messages with these seq numbers are dropped on "
             "arrival, once each, as if NATS lost them (counts.fault_dropped; the directory's seq beacons are never "
             "dropped); the worker must see the gap and sync its "
             "counts from the directory (kv.countsync). Never set in production"),
    ] = []
    count_sync_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds to wait for each kv.countsync reply (the node's branch counts, after "
                    "a lost kv.counts message)")
    ] = 2.0
    count_sync_backoff_max_s: Annotated[
        float, Meta(gt=0, description="longest wall-clock pause between kv.countsync retries")
    ] = 5.0
    count_sync_min_interval_s: Annotated[
        float, Meta(gt=0, description="least wall seconds between two kv.countsync snapshots asked (a run of gaps cannot "
                    "start a storm)")
    ] = 1.0
    count_sync_buffer_entries: Annotated[
        int, Meta(gt=0, description="block counts (entries; an empty message counts one) of the kv.counts messages kept "
                  "while a kv.countsync runs (applied after its snapshot): past it the oldest messages are dropped, the "
                  "newest always kept (about 50 bytes an entry)")
    ] = 2**20
    requeue_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds to wait for the router to take back handed-back work (work.requeue)")
    ] = 5.0
    handoff_chunk_timeout_s: Annotated[
        float, Meta(gt=0, description="PD hand-off with a real engine's K/V (work.<decode>.kv, in pieces of at most 8 MiB "
                    "under the NATS max_payload): wall seconds the prefill node waits for the decode node's answer to one "
                    "piece; unanswered, it is sent again (3 sends in all), then the hand-off fails (the request errors)")
    ] = 5.0
    handoff_kv_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds a decode node keeps a hand-off's complete K/V without its work "
                    "(work.<node>.decode): then it is dropped (counted) and its late work refused, the request failed")
    ] = 60.0
    handoff_piece_idle_s: Annotated[
        float, Meta(gt=0, description="wall seconds a decode node keeps a hand-off's incomplete K/V without a newly "
                    "stored piece (a live prefill node sends its next piece within its --handoff-chunk-timeout-s; one "
                    "sent again, held already, does not count; one refused 'full' keeps it at most 2.5 s more): then it "
                    "is dropped (counted) and a late piece or work of it refused, "
                    "the request failed; a prefill node that gives a hand-off up frees it at once (work.<node>.kvcancel)")
    ] = 15.0
    handoff_queue_wait_s: Annotated[
        float, Meta(gt=0, description="PD hand-off: wall seconds the prefill node waits in the decode node's queue of "
                    "hand-offs waiting for room in its buffer (a new transfer refused for room gets a place; room that "
                    "frees goes to the oldest first, the others told their place; it asks again, without data, every 0.2 s x "
                    "its place, at most 1 s): past this the hand-off fails saying the buffer was full (the request errors)")
    ] = 30.0
    handoff_buffer_bytes: Annotated[
        int, Meta(ge=1, description="bytes of hand-off K/V a decode node stores at once (every transfer not yet taken "
                  "by its work, counted as its pieces land, not as announced); a new transfer whose announced total "
                  "does not fit beside what is stored and what the transfers being sent (a piece stored in the last "
                  "second) still have to send is refused 'full' and waits its turn in a first-come-first-served queue "
                  "(--handoff-queue-wait-s); a piece of a transfer admitted already past it is refused 'full' and its "
                  "prefill node sends it again after a short backoff (6 sends over 2.5 s), then fails the hand-off "
                  "saying the buffer was full (the request errors); a total past it is refused at once")
    ] = 8 * 1024**3
    handoff_queued_bytes: Annotated[
        int, Meta(ge=1, description="PD hand-off, prefill node: bytes of K/V it holds for its hand-offs waiting in decode "
                  "nodes' queues for room (apart from the 16 being sent, at most 112 of them): past it (or the 112) the "
                  "prefill step waits before it takes the next hand-off; below it, a full decode node does not hold up "
                  "this node's other requests")
    ] = 4 * 1024**3
    owner_check_interval_s: Annotated[
        float, Meta(ge=0, description="wall seconds between asks to each owning router (route.held) which of this node's "
                    "requests it no longer has in flight (a router SIGKILLed or restarted sends no abort): those are "
                    "dropped and their KV freed; a router that answered no responders (missing, restarting) is asked again "
                    "every min(this, 0.25 s), so a restarted one drops its predecessor's requests ~1 s after it subscribes "
                    "(a 'not in flight' answer is acted on when the same answer comes 1 s later: a router's answer may "
                    "overtake the abort it sends when it ends a request itself); "
                    "0 = never ask")
    ] = 2.0
    owner_gone_after_s: Annotated[
        float, Meta(ge=0, description="wall seconds nobody serves an owning router's route.held (no responders) before "
                    "its requests on this node are dropped: a router cut off from NATS looks the same as a dead one, but "
                    "its streams may still complete after it reconnects (req.*.out.* is reliable), so this is the router's "
                    "bus_outage_wait_s; a restarted router answers for its predecessor's requests at once")
    ] = 30.0
    # real-bytes host KV pool (services/worker/kvpool, issue 6 part 2); the fields of KvPoolSettings
    kv_pool: Annotated[
        Literal["off", "real"],
        Meta(description="off = L2 is bookkeeping only (sim); real = every L2 block has a payload in a "
        "Mooncake-registered host buffer and fetches pull it from peers over TCP (needs scripts/install-mooncake.sh)"),
    ] = "off"
    kv_pool_slot_bytes: Annotated[
        int, Meta(ge=0, description="real pool: bytes per block slot; 0 = min(profile block bytes, 64 KiB)")
    ] = 0
    kv_pool_max_bytes: Annotated[
        int, Meta(gt=0, description="real pool: refuse to start when host_blocks × slot bytes exceeds this")
    ] = DEFAULT_MAX_POOL_BYTES
    kv_pool_host: Annotated[
        str, Meta(description="real pool: address peers reach this worker's transfer engine on (its session host)")
    ] = "127.0.0.1"
    kv_pool_ports: Annotated[
        str, Meta(description="real pool: Mooncake RPC+TCP port range 'lo-hi' within 1024-32767 (>= 2 ports; give 32, "
        "as up does: with 2 a worker SIGKILLed while a peer read from it cannot start again, its ports in TIME_WAIT); "
        "empty = Mooncake's 15000-17000")
    ] = ""
    kv_pool_lease_s: Annotated[
        float, Meta(ge=0, description="real pool: wall seconds a holder keeps located slots from reuse")
    ] = 5.0
    kv_pool_locate_timeout_s: Annotated[
        float, Meta(gt=0, description="real pool: wall seconds to wait for a peer's answer to a locate (kv.pool.<peer>)")
    ] = 2.0
    kv_pool_fetch_timeout_s: Annotated[
        float,
        Meta(gt=0, description="real pool: wall seconds a Mooncake read from a peer may take; past it the fetch fails "
             "(reason timeout) and the request recomputes the missing pages"),
    ] = 10.0

    def __post_init__(self) -> None:
        check_token(self.node, "node")
        if node_is_router_name(self.node):  # its output subject req.*.out.<node> would be a router's own
            raise ValueError(f"node {self.node!r}: a router's instance name (router, router-<x>) is no node id: "
                             "its output subject would be that router's; name the node otherwise (e.g. w0)")  # fmt: skip


def worker_profile(cfg: WorkerConfig) -> "Profile":
    """The profile this worker runs: ``cfg.profile`` with ``--gpu-kv-tokens`` / ``--host-kv-tokens`` applied
    (``shared.profile.with_kv_tokens``), and, for ``--engine torch``, on the cluster clock: a real engine's
    profile holds wall seconds measured at speed-up 1, so its times are x ``--speedup`` and its bandwidths
    / ``--speedup`` (``shared.profile.on_cluster_clock``; the KV transfer, peer fetch and plan times the
    scheduler takes from it are cluster seconds, as the engine's measured durations are). A sim engine's
    profile is already in simulated (cluster) seconds and is used as written.

    Raises:
        shared.profile.ProfileError: the profile cannot be loaded, or a KV size is invalid.
    """
    from shared.profile import load_profile, on_cluster_clock, with_kv_tokens

    profile = with_kv_tokens(load_profile(cfg.profile), cfg.gpu_kv_tokens, cfg.host_kv_tokens)
    return on_cluster_clock(profile, "wall" if cfg.engine == "torch" else "cluster", cfg.speedup)
