"""Settings of a simulated run, and their resolution into concrete components.

:class:`SimConfig` holds what the user asked for (a policy set plus explicit
overrides, cluster size, profile, arrival process, run length);
:func:`resolve` turns it into a :class:`Resolved` run: one profile (block size
and host capacity applied), the policy set with overrides, the components
found by name (routing in ``services.router.policy``, planner in
``services.planner.policy``), and the initial split. Errors are
:class:`SimConfigError` with a message that names the flag to fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import msgspec

from evolving_infra.replay.core import Arrival
from evolving_infra.sim.schedule import Window
from evolving_infra.sim.planners import PLANNER_MODULE, planner_names, routing_available
from evolving_infra.sim.policies import (
    DEFAULT_RELAUNCH_S,
    PolicyError,
    PolicySet,
    default_split,
    policy_set,
    serving,
    with_overrides,
)
from shared.profile import Profile, ProfileError, load_profile, with_kv_tokens
from shared.split import SplitError, canonical_split, parse_split
from shared.values import FrozenValue, set_field


class SimConfigError(ValueError):
    """The run cannot be set up as asked; the message says which flag to change."""


class ForcedSwitch(FrozenValue):
    """A phase switch the run forces at time ``t`` (tests, what-if runs), besides the planner's."""

    t: float
    node: str
    phase: str

    __slots__ = __match_args__ = ("t", "node", "phase")

    def __init__(self, t: float, node: str, phase: str) -> None:
        set_field(self, "t", t)
        set_field(self, "node", node)
        set_field(self, "phase", phase)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What to simulate. ``None`` means "the policy set's / profile's choice"."""

    nodes: int = 9
    profile: str = "gb300-glm52"
    gpus_per_node: int | None = None
    """Must equal the profile's ``gpus_per_node`` (a profile is one node; write a new
    profile for another node size)."""
    host_capacity_tokens: int | None = None
    """Per-node L2 capacity override (tokens, the profile's ``memory.host_kv_tokens``; ``simulate
    --host-kv-tokens``, alias ``--host-capacity-tokens``): a multiple of the simulation block size, ≥ the
    node's L1 capacity; None or 0 = the profile's (or the L1 size when that is more), as ``up``'s
    ``--host-kv-tokens`` (``shared.profile.with_kv_tokens``)."""
    gpu_kv_tokens: int | None = None
    """Per-node L1 (GPU KV) capacity override (tokens, the profile's ``memory.gpu_kv_tokens``;
    ``simulate --gpu-kv-tokens``): a multiple of the simulation block size; None or 0 = the profile's.
    Alone and above the profile's L2 it raises L2 to match. With ``host_capacity_tokens``, a small
    trace can fill both tiers and exercise eviction; a request longer than L1 fails (status 500)."""
    block_size: int | None = None
    """Simulation block size (tokens); the trace is converted (``rechunk_request``)."""
    policy: str = "static"
    split: str | None = None
    routing: str | None = None
    decode_routing: str | None = None
    planner: str | None = None
    eviction: str | None = None
    decode_binding: str | None = None
    switch_mode: str | None = None
    relaunch_s: float = DEFAULT_RELAUNCH_S
    routing_options: dict[str, Any] = field(default_factory=dict)
    planner_options: dict[str, Any] = field(default_factory=dict)
    arrival: str = "closed"
    """``closed`` (``concurrency`` agents), ``open`` (``arrival_rate`` agents/min, ``cap``) or ``trace``."""
    concurrency: int = 16
    arrival_rate: float = 1.0
    cap: int = 0
    duration_s: float | None = None
    """Stop at this simulated time (None: when every agent has finished)."""
    warmup_s: float = 0.0
    """Requests sent before this are simulated but left out of the report's metrics."""
    seed: int = 0
    agent_order: str = "trace"
    """``trace``: agents enter in the input's order; ``shuffled``: in a permutation drawn
    from ``seed`` (closed and open loops; ``replay.core.Arrival.order``)."""
    max_agents: int | None = None
    tile: int = 1
    """Replay every agent of the input this many times as distinct agents
    (``evolving_infra.sim.workload.TiledWorkload``), for clusters larger than the trace."""
    max_pause_s: float | None = None
    """Cap every request's pause (tool / think time) at this many seconds. Real Claude Code
    sessions pause 154 s per request on average (p50 10 s, p99 47 min: users away);
    the paper's CC runs report 12.9–18.6 s (DESIGN §6a), which a 30 s cap reproduces (14.7 s)."""
    partitions: int = 1
    workers: int = 1
    state_staleness_s: float = 0.0
    """The router refreshes a node's state at most this often (0: the state at the decision)."""
    msg_latency_s: float = 0.0
    """Constant delay of work dispatch, hand-off and client delivery (0: instantaneous)."""
    ingress_s: float = 0.0
    """Control plane, client → prefill node: a request's work reaches the router's decision and
    its prefill node ``ingress_s + ingress_s_per_token × prompt tokens`` after its send (the live
    stack's HTTP request, prompt parsing and hashing, KV lookup, routing and the NATS message
    that carries the prompt). 0 (default): at once. ``evolving-infra fidelity`` measures it
    from its live run (``evolving_infra.sim.fidelity.control_plane``)."""
    ingress_s_per_token: float = 0.0
    """The prompt-proportional part of the ingress (s per prompt token): the router's event loop
    parses and hashes one prompt after another, so this part is served one request at a time in
    send order (a short request sent just after a long one waits for it and is routed after it,
    as live), then ``ingress_s`` follows in parallel."""
    egress_s: float = 0.0
    """Control plane, node → client: a first token and a request's end reach the client (and the
    router) this long after the engine produced them (the live worker → NATS → router → HTTP
    stream). 0 (default): at once."""
    forced_switches: tuple[ForcedSwitch, ...] = ()
    switch_every_s: float | None = None
    """Force a split change every this many simulated seconds, alternating between ``split``
    and ``switch_to`` (at k·period: ``switch_to`` for odd k, ``split`` for even k); the
    nodes that change are chosen by the fewest-changes rule (``shared.split.assign_min_change``)
    among the nodes not already switching."""
    switch_to: str | None = None
    """The other split of ``switch_every_s`` (``xPyD``)."""
    switch_control_s: float = 0.0
    """In-place switches (``decoupled``, ``strand``): time from the end of the drain to serving
    the new phase (the engine's reconfiguration; the live sim engine measures 1–6 ms, the
    paper's in-place switch ≥ 0.7 s including the drain). The node serves nothing meanwhile."""
    pool_fetch_min_tokens: int = 512
    """Decoupled data plane with a router that plans no fetch: the smallest peer fetch made
    (tokens; shorter ones are recomputed) — the ``ttft`` router's ``--ttft-fetch-min-tokens``."""
    label: str | None = None
    node_slowdown: tuple[tuple[str, float], ...] = ()
    """``(node, factor)``: that node's engine runs ``factor`` times slower than the profile (its
    Eq. 1/2 coefficients scaled); the router and the planner are not told (what-if runs, and
    the test that the router's online models find a slow node)."""
    decode_kv_events: str = "auto"
    """``auto``: decode-phase nodes' KV events reach the directory only when a decision can
    read them (see ``ClusterSim``); ``always``: always (slower, same results)."""
    schedule: tuple[Window, ...] = ()
    """Closed loops per agent pool on a schedule (``evolving_infra.sim.schedule``; the
    ``periods`` of a ``trace generate shift`` trace): replaces ``arrival`` when given."""

    def arrival_for(self, share: float = 1.0, seed_offset: int = 0) -> Arrival:
        """The arrival process (for a partition holding ``share`` of the agents)."""
        if self.arrival == "closed":
            return Arrival(kind="closed", concurrency=max(1, round(self.concurrency * share)), seed=self.seed + seed_offset,
                           order=self.agent_order)  # type: ignore[arg-type]
        if self.arrival == "open":
            cap = max(1, round(self.cap * share)) if self.cap else 0
            return Arrival(kind="open", rate_per_min=self.arrival_rate * share, cap=cap, seed=self.seed + seed_offset,
                           order=self.agent_order)  # type: ignore[arg-type]
        if self.arrival == "trace":
            return Arrival(kind="trace", seed=self.seed + seed_offset)
        raise SimConfigError(f"arrival must be closed, open or trace, got {self.arrival!r}")


def seed_draws(cfg: SimConfig) -> list[str]:
    """What ``cfg.seed`` (``simulate --seed``) moves in this run: the open loop's arrival times
    (``arrival == "open"``), the order agents enter in (``agent_order == "shuffled"``, closed and
    open loops) and the ``dynamo-kv`` router's node choice (its ``dynamo_temperature``
    option > 0: a draw among all candidate nodes, weighted by ``exp(-normalized cost / temperature)``,
    ``services.router.baselines``). Empty when none applies: a closed loop, ``trace``
    arrivals or a schedule, agents in trace order, no randomized routing; then any seed gives
    the same run (only ``meta.seed`` differs). The evolving planner's fit reservoir is seeded by
    ``--planner-opt seed=N``, not by this.

    Returns:
        One short description per seeded part (``[]``: the seed moves nothing).
    """
    out: list[str] = []
    if not cfg.schedule and cfg.arrival == "open":
        out.append("the open loop's arrival times (--arrival-rate)")
    if not cfg.schedule and cfg.arrival in ("closed", "open") and cfg.agent_order == "shuffled":
        out.append("the agents' order (--agent-order shuffled)")
    routing: str | None
    try:
        routing = cfg.routing or policy_set(cfg.policy).routing
    except PolicyError:  # resolve() says so, naming the flag
        routing = cfg.routing
    temperature = cfg.routing_options.get("dynamo_temperature", 0.0)
    if routing == "dynamo-kv" and isinstance(temperature, (int, float)) and temperature > 0:
        out.append("the dynamo-kv router's node choice, drawn among all candidates by cost (dynamo_temperature > 0)")
    return out


def seed_unused_note(cfgs: list[SimConfig]) -> str | None:
    """A note for a non-default ``--seed`` that moves nothing in any of ``cfgs`` (a run, or a
    sweep's items; :func:`seed_draws`), else None."""
    if not cfgs or cfgs[0].seed == 0 or any(seed_draws(c) for c in cfgs):
        return None
    return (f"--seed {cfgs[0].seed} changes nothing in this run: nothing in it draws at random (a closed loop or "
            "recorded arrivals, agents in trace order, no randomized routing), so every seed gives the same "
            "requests.jsonl; the seed moves --arrival-rate's arrivals, --agent-order shuffled and dynamo-kv "
            "routing with --routing-opt dynamo_temperature>0")


def l1_overflow_note(cfg: SimConfig, requests: Sequence[Any]) -> str | None:
    """A pre-run note for a lowered ``--gpu-kv-tokens`` that some requests of the input cannot fit: a request
    whose prompt plus output (``input_tokens + max(output_tokens, 1)``, in blocks of the simulation's block
    size) is more than a node's L1 fails with status 500 (``WorkRejected``: the engine refuses it) and the run
    exits 1. None when ``cfg.gpu_kv_tokens`` is not given (a normal run pays nothing) or every request fits.

    Args:
        cfg: the run's settings.
        requests: the input's requests (``TraceRequest`` or stubs: only ``input_tokens``, ``output_tokens``
            are read). One pass over them.

    Raises:
        SimConfigError: the profile or the sizes are invalid (as :func:`resolve` says).
    """
    if not cfg.gpu_kv_tokens:
        return None
    p = _profile(cfg)
    bs, cap = p.block_size, p.gpu_blocks
    limit = cap * bs  # the most prompt + output tokens a node's L1 holds
    over = sum(1 for r in requests if r.input_tokens + max(r.output_tokens, 1) > limit)
    if not over:
        return None
    return (f"{over:,} of the input's {len(requests):,} requests need more KV (prompt + output) than a node's L1 holds "
            f"(--gpu-kv-tokens {cfg.gpu_kv_tokens}: {cap:,} blocks of {bs} tokens): each one sent fails (status 500) "
            "and the run exits 1; raise --gpu-kv-tokens to serve them")


class Resolved(FrozenValue):
    """A run's concrete components (what ``report.json`` records under ``meta.sim``)."""

    cfg: SimConfig
    profile: Profile
    policy: PolicySet
    split: str
    nodes_per_partition: list[int]
    planner_source: str

    __slots__ = __match_args__ = ("cfg", "profile", "policy", "split", "nodes_per_partition", "planner_source")

    def __init__(
        self, cfg: SimConfig, profile: Profile, policy: PolicySet, split: str, nodes_per_partition: list[int],
        planner_source: str,
    ) -> None:
        set_field(self, "cfg", cfg)
        set_field(self, "profile", profile)
        set_field(self, "policy", policy)
        set_field(self, "split", split)
        set_field(self, "nodes_per_partition", nodes_per_partition)
        set_field(self, "planner_source", planner_source)


def _profile(cfg: SimConfig) -> Profile:
    try:
        p = load_profile(cfg.profile)
    except ProfileError as e:
        raise SimConfigError(f"--profile: {e}") from e
    if cfg.gpus_per_node is not None and cfg.gpus_per_node != p.gpus_per_node:
        raise SimConfigError(
            f"--gpus-per-node {cfg.gpus_per_node} does not match profile {p.name!r} ({p.gpus_per_node} GPUs per node): "
            "a profile describes one node (its Eq. 1/2 coefficients depend on the node's parallelism), so write a "
            "profile for that node size instead of scaling one"
        )
    if cfg.block_size is not None:
        if cfg.block_size < 1:
            raise SimConfigError("--block-size must be >= 1")
        if cfg.block_size != p.block_size:
            p = msgspec.structs.replace(p, block_size=cfg.block_size)
    gpu, host = cfg.gpu_kv_tokens or 0, cfg.host_capacity_tokens or 0  # 0 (or not given): the profile's, as in `up`
    whole = gpu >= 0 and not gpu % p.block_size and not host % p.block_size  # else with_kv_tokens says so first
    if whole and host > 0 and host < (gpu or p.memory.gpu_kv_tokens):
        shown = f"--gpu-kv-tokens {gpu}" if gpu else f"profile {p.name!r}"
        raise SimConfigError(
            f"--host-kv-tokens {host} is below the node's GPU KV capacity ({gpu or p.memory.gpu_kv_tokens} tokens, "
            f"{shown}): L2 is written through and must hold L1; lower --gpu-kv-tokens too, or raise --host-kv-tokens "
            "(alias --host-capacity-tokens)"
        )
    try:  # the sizes checked and applied as `up` applies them (a multiple of the block size; L2 raised to L1)
        return with_kv_tokens(p, gpu, host)
    except ProfileError as e:
        where = f" (--block-size {cfg.block_size})" if cfg.block_size is not None else ""
        alias = "; --host-capacity-tokens is the same flag" if str(e).startswith("--host-kv-tokens") else ""
        raise SimConfigError(f"{e}{where}{alias}") from None


def node_names(partition: int, n: int, partitions: int) -> list[str]:
    """Node ids of a partition: ``w0..`` for one partition, ``p<k>w<i>`` otherwise."""
    return [f"w{i}" for i in range(n)] if partitions == 1 else [f"p{partition}w{i}" for i in range(n)]


def _check_node_names(cfg: SimConfig, parts: list[int]) -> None:
    """``--slow-node`` and ``--switch-at`` name nodes the cluster has: on ``--nodes 4``, ``--slow-node w9:2``
    and ``--switch-at 10:w9:decode`` ran with no effect and exit 0."""
    names = [n for k, size in enumerate(parts) for n in node_names(k, size, cfg.partitions)]
    have = set(names)
    shown = f"{names[0]}..{names[-1]}" if len(names) > 3 else ", ".join(names)
    for node, factor in cfg.node_slowdown:
        if node not in have:
            raise SimConfigError(f"--slow-node {node}:{factor:g}: the cluster has no node {node!r} (nodes: {shown})")
    for f in cfg.forced_switches:
        if f.node not in have:
            raise SimConfigError(f"--switch-at {f.t:g}:{f.node}:{f.phase}: the cluster has no node {f.node!r} (nodes: {shown})")


def _split_nodes(total: int, k: int) -> list[int]:
    base, extra = divmod(total, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


SIM_OWN_ROUTING_OPTIONS = {"profile": "--profile", "block_size": "--block-size", "seed": "--seed"}
"""Routing policy options ``simulate`` sets from its own flags (the router takes the simulation's profile, block size
and seed: ``meta.seed`` is the seed its randomized policies ran with)."""


def check_routing_options(options: dict[str, Any]) -> None:
    """``--routing-opt``: each a knob of the router's policies (``RouterConfig.policy_options``) with a value the
    router's config takes, checked as ``up`` checks them (``evolving_infra.policy_args.resolve_routing_options``).
    The values go to the policies as given.

    Raises:
        SimConfigError: a name that is not a routing policy option (a typo, or a router setting such as
            ``shutdown_grace_s``: the run went on with the policy's defaults, saying nothing), one of
            :data:`SIM_OWN_ROUTING_OPTIONS` (it overrode the block size or seed in the router alone, with ``meta``
            recording the simulation's), or a value the router refuses (the reason).
    """
    from evolving_infra.policy_args import resolve_routing_options

    try:
        resolve_routing_options(options, SIM_OWN_ROUTING_OPTIONS)
    except ValueError as e:
        raise SimConfigError(str(e)) from None


def resolve(cfg: SimConfig) -> Resolved:
    """Apply the policy set, overrides and checks.

    Raises:
        SimConfigError: unknown set or component, bad split, bad sizes, a bad ``--routing-opt``, a ``--planner-opt``
            value of the wrong type or one the planner refuses, a ``--slow-node`` or ``--switch-at`` node the
            cluster does not have.
    """
    if cfg.nodes < 1:
        raise SimConfigError("--nodes must be >= 1")
    if cfg.schedule and cfg.partitions != 1:
        raise SimConfigError("a scheduled workload (periods of a shift trace) runs on one partition; drop --partitions")
    if cfg.partitions < 1 or cfg.partitions > cfg.nodes:
        raise SimConfigError(f"--partitions must be in [1, nodes={cfg.nodes}]")
    if cfg.workers < 1:
        raise SimConfigError("--workers must be >= 1")
    # the checks are written 'not x >= 0' so that NaN fails them: 'nan < 0' is False, and a NaN that passed ran
    # a different experiment silently (--duration nan: 0 s simulated, exit 0) or never ended (--max-pause nan)
    if not (cfg.relaunch_s >= 0 and cfg.msg_latency_s >= 0 and cfg.state_staleness_s >= 0 and cfg.warmup_s >= 0):
        raise SimConfigError("--relaunch-s, --msg-latency-s, --state-staleness-s and --warmup must be >= 0")
    if not (cfg.ingress_s >= 0 and cfg.ingress_s_per_token >= 0 and cfg.egress_s >= 0):
        raise SimConfigError("--ingress-s, --ingress-s-per-token and --egress-s must be >= 0")
    if cfg.agent_order not in ("trace", "shuffled"):
        raise SimConfigError(f"--agent-order must be trace or shuffled, got {cfg.agent_order!r}")
    if cfg.decode_kv_events not in ("auto", "always"):
        raise SimConfigError("decode_kv_events must be 'auto' or 'always'")
    if cfg.max_pause_s is not None and not cfg.max_pause_s >= 0:
        raise SimConfigError("--max-pause must be >= 0")
    if cfg.duration_s is not None and not cfg.duration_s > 0:
        raise SimConfigError("--duration must be > 0")
    if cfg.arrival == "closed" and cfg.concurrency < 1:  # arrival_for's max(1, ...) ran 0 or -1 as 1
        raise SimConfigError("--concurrency must be >= 1")
    if cfg.arrival == "open" and not 0 < cfg.arrival_rate < math.inf:
        raise SimConfigError("--arrival-rate must be a finite number > 0 (agents per minute)")
    if cfg.cap < 0:
        raise SimConfigError("--cap must be >= 0 (0 = no cap)")
    if cfg.max_agents is not None and cfg.max_agents < 1:
        raise SimConfigError("--max-agents must be >= 1")
    check_routing_options(cfg.routing_options)
    try:
        ps = policy_set(cfg.policy)
        ps = with_overrides(
            ps,
            routing=cfg.routing,
            decode_routing=cfg.decode_routing,
            planner=cfg.planner,
            eviction=cfg.eviction,
            decode_binding=cfg.decode_binding,
            switch_mode=cfg.switch_mode,
        )
    except PolicyError as e:
        raise SimConfigError(str(e)) from e
    subs: list[str] = []
    if not routing_available(ps.routing):
        if ps.name == "evolving" and cfg.routing is None:
            subs.append(f"routing {ps.routing} not registered -> cache-aware")
            ps = with_overrides(ps, routing="cache-aware")
        else:
            from services.router.policy import policy_names

            raise SimConfigError(
                f"routing policy {ps.routing!r} (policy set {ps.name}) is not registered in services/router/policy.py; "
                f"known: {', '.join(policy_names())}"
            )
    if ps.planner not in planner_names():
        if ps.name == "evolving" and cfg.planner is None:
            subs.append(f"planner {ps.planner} not available -> static")
            ps = with_overrides(ps, planner="static")
        else:
            raise SimConfigError(f"planner {ps.planner!r} is not registered; known: {', '.join(planner_names())}")
    try:
        from evolving_infra.policy_args import check_planner_options

        check_planner_options(ps.planner, cfg.planner_options)
    except ValueError as e:
        raise SimConfigError(str(e)) from None
    if subs:
        from dataclasses import replace

        ps = replace(ps, substitutions=tuple(subs))
    profile = _profile(cfg)
    parts = _split_nodes(cfg.nodes, cfg.partitions)
    split = cfg.split or ps.split or default_split(parts[0])
    try:  # a malformed split is a syntax error whatever the size: "split '3P' does not fit a partition of 4 nodes
        canonical_split(split)  # (split '3P' must look like '4P5D' ...)" worded it as a size error
    except SplitError as e:
        raise SimConfigError(str(e) if cfg.split is None else f"--split {split}: {e}") from e
    except ValueError:  # more digits than int() takes: parse_split says so below
        pass
    for n in sorted(set(parts)):
        try:
            parse_split(split, n)
        except SplitError as e:
            raise SimConfigError(
                f"split {split!r} does not fit a partition of {n} nodes ({e}); use --split or --nodes"
                + (" divisible by --partitions" if cfg.partitions > 1 else "")
            ) from e
    ps = serving(ps, split)  # static:5P1D --split 3P1D: labelled static:3P1D, the split it serves
    if ps.switch_mode == "none" and (cfg.forced_switches or cfg.switch_every_s is not None):
        raise SimConfigError("forced switches need a switch mode (policy set or --switch-mode decoupled|relaunch|strand)")
    if not cfg.switch_control_s >= 0:
        raise SimConfigError("--switch-control-s must be >= 0")
    for node, factor in cfg.node_slowdown:
        if not factor > 0:
            raise SimConfigError(f"--slow-node {node}:{factor}: the factor must be > 0")
    _check_node_names(cfg, parts)
    if cfg.pool_fetch_min_tokens < 0:
        raise SimConfigError("--pool-fetch-min-tokens must be >= 0")
    if (cfg.switch_every_s is None) != (cfg.switch_to is None):
        raise SimConfigError("--switch-every and --switch-to go together (alternate between --split and --switch-to)")
    if cfg.switch_every_s is not None:
        if not cfg.switch_every_s > 0:
            raise SimConfigError("--switch-every must be > 0 seconds")
        for n in sorted(set(parts)):
            try:
                if parse_split(cfg.switch_to, n) is None:  # type: ignore[arg-type]
                    raise SplitError("a periodic switch needs an xPyD split, not collocated")
                if parse_split(split, n) is None:
                    raise SplitError(f"--split {split!r} is collocated; a periodic switch alternates xPyD splits")
            except SplitError as e:
                raise SimConfigError(f"--switch-to {cfg.switch_to!r}: {e}") from e
    return Resolved(
        cfg=cfg,
        profile=profile,
        policy=ps,
        split=split,
        nodes_per_partition=parts,
        planner_source=PLANNER_MODULE,
    )
