"""Planner service configuration (one Struct: flags, env and file derive from it)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.config import CommonConfig


class PlannerConfig(CommonConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nodes: Annotated[list[str], Meta(description="node ids in cluster order, comma-separated (e.g. w0,w1,w2,w3)")] = []
    split: Annotated[str, Meta(description="initial PD split: 'collocated' or 'xPyD' over --nodes (first x prefill)")] = (
        "collocated"
    )
    history: Annotated[int, Meta(ge=1, description="iteration records kept per node")] = 100_000
    announce_interval_s: Annotated[
        float, Meta(gt=0, description="wall seconds between re-publications of the current split (late joiners)")
    ] = 5.0
