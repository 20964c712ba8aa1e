"""Planner service configuration (one Struct: flags, env and file derive from it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from msgspec import Meta

from shared.config import CommonConfig

if TYPE_CHECKING:
    from shared.profile import Profile


class PlannerConfig(CommonConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nodes: Annotated[list[str], Meta(description="node ids in cluster order, comma-separated (e.g. w0,w1,w2,w3)")] = []
    split: Annotated[str, Meta(description="initial PD split: 'collocated' or 'xPyD' over --nodes (first x prefill)")] = (
        "collocated"
    )
    history: Annotated[int, Meta(ge=1, description="iteration records kept per node")] = 100_000
    announce_interval_s: Annotated[
        float, Meta(gt=0, description="wall seconds between re-publications of the current split (late joiners)")
    ] = 5.0
    planner: Annotated[
        Literal["static", "evolving", "dynamo", "arrow"],
        Meta(
            description="split policy: static (never switches), evolving (paper §5.2: online NNLS models + "
            "significance-gated planner + SLO guard), dynamo (load-based thresholds), arrow (TTFT/TPOT SLOs)"
        ),
    ] = "static"
    profile: Annotated[
        str, Meta(description="node profile (shared/profiles name or TOML path): model priors, MoE shape, limits")
    ] = "gb300-glm52"
    profile_clock: Annotated[
        Literal["cluster", "wall"],
        Meta(description="what --profile's times are: cluster = simulated seconds, as written (a sim engine's "
             "profile); wall = wall seconds measured at speed-up 1 (a real engine's, --engine torch): its Eq. 1/2 "
             "coefficients and link latencies x --speedup, its link bandwidths / --speedup (evolving-infra up "
             "passes wall for --engine torch)"),
    ] = "cluster"
    planner_args: Annotated[
        list[str],
        Meta(
            description="policy parameters as key=value, comma-separated (e.g. t_learn_s=300,window_s=600,"
            "slo_guard=false); keys are the fields of EvolvingParams / DynamoParams / ArrowParams"
        ),
    ] = []
    refit_interval_s: Annotated[
        float,
        Meta(gt=0, description="simulated seconds between the online refits of each node's Eq. 1/2 models from its "
             "iteration records, published on planner.models for the router (policies without models of their own: "
             "static, dynamo, arrow)"),
    ] = 60.0
    max_tick_wait_s: Annotated[
        float, Meta(gt=0, description="wall seconds the tick loop sleeps at most before asking the policy again")
    ] = 1.0
    busy_timeout_s: Annotated[
        float, Meta(gt=0, description="simulated seconds a node may take to confirm a phase switch before it stops blocking "
                    "planning (a node silent past --silent-after-s while another kept reporting blocks none: it is dead, "
                    "not switching)")
    ] = 900.0
    silent_after_s: Annotated[
        float,
        Meta(
            gt=0,
            description="wall seconds without a node.state after which the planner counts a node as silent (as the "
            "router's --fence-after-s, which fences it then); one that never reported is silent too. An operator's "
            "split set lays its phases over the live nodes first (the first x live nodes prefill; with x or fewer "
            "live, the last live node decode), so no phase is left only on dead nodes, and refuses an xPyD when one "
            "node alone is live; a phase of the current split left on nodes that all reported and are all silent "
            "swaps its first node with a live node of the other phase (when that phase has two or more; with one, that "
            "node serves both phases: the outage split). The split the outage replaced is issued again once each of "
            "its phases has a node that has reported for this long without a silence and was heard within half of "
            "it, though a dead node may never return (laid over the live nodes as a swap when its own nodes for a "
            "phase are still silent)",
        ),
    ] = 3.0
    adopt_grace_s: Annotated[
        float,
        Meta(
            ge=0,
            description="wall seconds a (re)started planner reads the node states before it announces a split: it "
            "adopts the split the nodes serve (their phases, the epoch a majority of them holds) and announces its "
            "--split only when no node holds one; ends early once every node has reported, none draining. Default: "
            "3 x the workers' --idle-state-interval-s (1 s), so one lost state still leaves two. 0 = announce --split "
            "at once (a majority of nodes above its epoch still makes it adopt)",
        ),
    ] = 3.0


def planner_profile(cfg: PlannerConfig) -> "Profile":
    """The profile the planner starts its node models from (the priors it publishes and seeds its fits with):
    ``--profile`` on the cluster clock, the records' (``--profile-clock wall``, a torch worker's profile
    measured at speed-up 1: times x ``--speedup``, bandwidths / ``--speedup``; ``shared.profile.on_cluster_clock``).

    Raises:
        shared.profile.ProfileError: the profile cannot be loaded.
    """
    from shared.profile import load_profile, on_cluster_clock

    return on_cluster_clock(load_profile(cfg.profile), cfg.profile_clock, cfg.speedup)
