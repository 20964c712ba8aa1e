"""Configuration of a worker process (one node): one frozen Struct, flags and env derived.

``python -m services.worker --node w0 --profile gb300-glm52 --phase both --speedup 100``;
every field is also ``EI_<FIELD>`` in the environment and a key in ``--config FILE``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.config import CommonConfig
from shared.subjects import check_token


class WorkerConfig(CommonConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of one worker (symmetric engine host)."""

    node: Annotated[str, Meta(description="node id of this worker (one NATS token: letters, digits, - and _)")] = "w0"
    profile: Annotated[
        str, Meta(description="hardware/model profile: a name in shared/profiles (gb300-glm52, tiny) or a TOML path")
    ] = "gb300-glm52"
    phase: Annotated[
        Literal["prefill", "decode", "both"], Meta(description="phase served at start: prefill, decode or both (collocated)")
    ] = "both"
    engine: Annotated[Literal["sim"], Meta(description="engine kind; sim = profile-timed simulated GPU")] = "sim"
    host_eviction: Annotated[
        Literal["lru", "branch-count"],
        Meta(description="host (L2) eviction order: lru, or branch-count = zero-count blocks first (kv.counts)"),
    ] = "lru"
    stream_interval: Annotated[
        int, Meta(ge=1, description="output tokens per streamed TokenChunk after the first (SGLang stream_interval)")
    ] = 1
    state_interval_s: Annotated[
        float, Meta(ge=0, description="least wall seconds between node.state publications at iteration launches")
    ] = 0.05
    idle_state_interval_s: Annotated[
        float, Meta(gt=0, description="wall seconds between node.state publications when no iteration launches (liveness)")
    ] = 1.0
    fold_wall_s: Annotated[
        float,
        Meta(
            ge=0,
            description="wall seconds of identical decode iterations folded into one engine step (cut short at the "
            "next iteration boundary when new work arrives); 0 = one iteration per step",
        ),
    ] = 0.005
    iters_flush_s: Annotated[float, Meta(gt=0, description="wall seconds between node.iters batches")] = 0.5
    check_invariants: Annotated[
        bool, Meta(description="run the full O(blocks) scheduler invariant check after every step (debug)")
    ] = False

    def __post_init__(self) -> None:
        check_token(self.node, "node")
