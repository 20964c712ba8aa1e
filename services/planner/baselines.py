"""Baseline planners for comparison: Dynamo's load-based planner and an Arrow-like SLO planner.

Contains zero I/O; every method takes ``now`` (simulated s). Both move one node
per decision (``shared.split.assign_min_change``) and never plan while a node
is busy (the simulator applies Dynamo's decisions as relaunches and Arrow's as
in-place switches that strand the node's KV; the mechanics are not here).

**Dynamo** (``research/anchor-dynamo.md`` §6.1/§6.4; Dynamo v0.1–0.3 load planner,
``examples/llm/components/planner.py`` with ``planner/defaults.py``
``LoadPlannerDefaults``): every ``metric_pulling_interval_s`` (10 s) it samples the
prefill queue and the decode KV load (GPU KV usage + 0.02 per waiting request);
every ``adjustment_interval_s`` (180 s) it averages the samples and compares them
with thresholds — prefill queue > 5.0 → scale prefill up (only if the queue
trend, last + 3·(last − first), also stays above 5.0), < 0.2 → down; decode
KV load > 0.9 → decode up, < 0.5 → down (not within 3 intervals of a decode
scale-up). Dynamo changes worker counts within a GPU budget; on our fixed N
nodes the budget is always full, so a scale-up of one phase needs a node of the
other: the net vote (prefill: +1 up, −1 down; decode likewise) moves one node
toward the phase with the higher vote (a tie changes nothing). Ours: the queue
is normalised per prefill node (Dynamo v0.1 read one shared NATS queue).
While a node relaunches (busy), sampling and adjustment are blocked and the
interval restarts afterwards (Dynamo: "when the number of workers is being
adjusted, the planner blocks the metric pulling and adjustment").

**Arrow** (arXiv 2505.11916 as the paper reimplements it, §3.2 and §7; code not
public): every ``interval_s`` it predicts the TTFT of a new request on each
prefill node from the *full* input length (cached prefixes counted as prefill
work; profile Eq. 1 with t_c = 0, in ``chunk_tokens`` chunks) after the node's
queue, and measures TPOT on the decode nodes (mean decode iteration / t_acc).
If the best prefill node's predicted TTFT breaks ``ttft_slo_s`` it flips one
decode node to prefill; if the worst TPOT breaks ``tpot_slo_s`` it flips one
prefill node to decode; if both, toward the larger relative violation. It has
no cooldown and no significance test, so short prefill bursts flip nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from shared.itermodel import PrefillModel, qk_pairs
from shared.messages import IterationRecord, NodeState, Phase
from shared.profile import Profile
from services.planner.observe import Observer
from services.planner.policy import PolicyBase, RequestDone, SplitDecision, dead_note as _dead_note


def _pd_counts(phases: Mapping[str, Phase]) -> tuple[int, int, bool]:
    p = sum(v == "prefill" for v in phases.values())
    d = sum(v == "decode" for v in phases.values())
    return p, d, p + d == len(phases) and p >= 1 and d >= 1


@dataclass(frozen=True, slots=True)
class DynamoParams:
    """Dynamo load planner parameters (defaults: Dynamo ``LoadPlannerDefaults``)."""

    adjustment_interval_s: float = 180.0
    metric_pulling_interval_s: float = 10.0
    prefill_queue_scale_up: float = 5.0
    """Queued prefill requests per prefill node above which prefill scales up."""
    prefill_queue_scale_down: float = 0.2
    decode_kv_scale_up: float = 0.9
    """Mean decode KV load above which decode scales up."""
    decode_kv_scale_down: float = 0.5
    kv_per_waiting_request: float = 0.02
    """Dynamo adds this to a decode node's KV usage per waiting request."""
    min_endpoint: int = 1
    """Fewest nodes a phase keeps."""
    decode_grace_intervals: int = 3
    """No decode scale-down within this many intervals of a decode scale-up."""
    queue_buffer_intervals: int = 3
    """Prefill scales up only if last + this·(last − first) stays above the threshold."""

    def __post_init__(self) -> None:
        if self.adjustment_interval_s <= 0 or self.metric_pulling_interval_s <= 0:
            raise ValueError("intervals must be > 0")
        if self.min_endpoint < 1:
            raise ValueError("min_endpoint must be >= 1")


class DynamoPlanner(PolicyBase):
    """Dynamo's load-based planner on a fixed node set (module docstring).

    Args:
        nodes: node ids.
        profile: node profile (unused beyond the base; kept for a uniform constructor).
        params: :class:`DynamoParams`.
    """

    name = "dynamo"

    def __init__(self, nodes: Sequence[str], profile: Profile, params: DynamoParams | None = None) -> None:
        super().__init__(nodes, profile)
        self.p = params or DynamoParams()
        self.latest: dict[str, NodeState] = {}
        self.queue_load: list[float] = []
        self.kv_load: list[float] = []
        self._next_sample: float | None = None
        self._next_adjust: float | None = None
        self.grace = 0

    def on_node_state(self, state: NodeState, now: float) -> None:
        if state.node in self.nodes:
            self.latest[state.node] = state

    def next_tick(self) -> float | None:
        if self._next_sample is None:
            return 0.0
        return min(self._next_sample, self._next_adjust or math.inf)

    def sample(self, phases: Mapping[str, Phase]) -> tuple[float, float] | None:
        """(prefill queue per prefill node, mean decode KV load) from the latest states of the live nodes
        (:meth:`~services.planner.policy.PolicyBase.on_liveness`: a dead node's last state is stale), or None."""
        phases = self.live(phases)
        pre = [n for n, v in phases.items() if v == "prefill"]
        dec = [n for n, v in phases.items() if v == "decode"]
        if not pre or not dec:
            return None
        queued = sum(self.latest[n].waiting for n in pre if n in self.latest)
        loads = []
        for n in dec:
            st = self.latest.get(n)
            if st is None or st.gpu_total_blocks <= 0:
                continue
            usage = 1.0 - st.gpu_free_blocks / st.gpu_total_blocks
            loads.append(usage + self.p.kv_per_waiting_request * st.waiting)
        if not loads:
            return None
        return queued / len(pre), sum(loads) / len(loads)

    def tick(self, now: float, phases: Mapping[str, Phase], busy: Set[str]) -> SplitDecision | None:
        if self._next_sample is None:
            self._next_sample = now
            self._next_adjust = now + self.p.adjustment_interval_s
        if busy:  # blocked while workers change; the interval restarts after
            self.queue_load.clear()
            self.kv_load.clear()
            if self._next_adjust is not None and now >= self._next_adjust:
                self._decide(now, "skip", phases, None, f"node(s) {sorted(busy)} relaunching")
            self._next_adjust = now + self.p.adjustment_interval_s
            self._next_sample = now + self.p.metric_pulling_interval_s
            return None
        if now >= self._next_sample:
            s = self.sample(phases)
            if s is not None:
                self.queue_load.append(s[0])
                self.kv_load.append(s[1])
            while self._next_sample <= now:
                self._next_sample += self.p.metric_pulling_interval_s
        assert self._next_adjust is not None
        if now < self._next_adjust:
            return None
        self._next_adjust = now + self.p.adjustment_interval_s
        decision = self.adjust(now, phases)
        self.queue_load.clear()
        self.kv_load.clear()
        return decision

    def adjust(self, now: float, phases: Mapping[str, Phase]) -> SplitDecision | None:
        """One adjustment from the samples gathered since the last one; the counts a phase keeps
        (``min_endpoint``) and the node moved are the live nodes' (a dead node keeps its phase)."""
        live = self.live(phases)
        n_p, n_d, pd = _pd_counts(live)
        if not pd or not self.queue_load:
            self._decide(now, "skip", phases, None, ("no samples" if pd else "not a PD split") + _dead_note(self.dead))
            return None
        q = sum(self.queue_load) / len(self.queue_load)
        kv = sum(self.kv_load) / len(self.kv_load)
        trend = self.queue_load[-1] + (self.queue_load[-1] - self.queue_load[0]) * self.p.queue_buffer_intervals
        vote_p = 0
        if q > self.p.prefill_queue_scale_up and trend > self.p.prefill_queue_scale_up:
            vote_p = 1
        elif q < self.p.prefill_queue_scale_down:
            vote_p = -1
        vote_d = 0
        if kv > self.p.decode_kv_scale_up:
            vote_d = 1
        elif kv < self.p.decode_kv_scale_down and self.grace == 0:
            vote_d = -1
        if self.grace > 0:
            self.grace -= 1
        metrics = {"prefill_queue": q, "prefill_queue_trend": trend, "decode_kv_load": kv, "vote_prefill": vote_p, "vote_decode": vote_d}
        target: dict[str, Phase] | None = None
        reason = f"queue {q:.2f}/node, KV load {kv:.2f}: within thresholds or tie"
        if vote_p > vote_d and n_d > self.p.min_endpoint:
            target = self.assign_live(phases, n_p + 1)
            reason = f"prefill queue {q:.2f}/node (up > {self.p.prefill_queue_scale_up}), KV load {kv:.2f}: one decode node → prefill"
        elif vote_d > vote_p and n_p > self.p.min_endpoint:
            target = self.assign_live(phases, n_p - 1)
            reason = f"KV load {kv:.2f} (up > {self.p.decode_kv_scale_up}), prefill queue {q:.2f}/node: one prefill node → decode"
            self.grace = self.p.decode_grace_intervals
        elif vote_p != vote_d:
            reason = f"queue {q:.2f}/node, KV load {kv:.2f}: would move a node but a phase is at min_endpoint"
        return self._decide(now, "switch" if target else "no_switch", phases, target, reason + _dead_note(self.dead), metrics=metrics)


@dataclass(frozen=True, slots=True)
class ArrowParams:
    """Arrow-like planner parameters (ours unless noted; Arrow's code is not public)."""

    interval_s: float = 10.0
    """How often the SLOs are checked (Arrow reacts to real-time metrics)."""
    ttft_slo_s: float = 5.0
    """TTFT target (paper App. D.3: P50 TTFT within 5 s)."""
    tpot_slo_s: float = 0.05
    """TPOT target (Dynamo's SLA-planner default ITL, 50 ms)."""
    min_nodes: int = 1
    """Fewest nodes a phase keeps."""
    prompt_lookback_s: float = 60.0
    """Mean prompt length of a new request: requests finished in this much history."""

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0 or self.prompt_lookback_s <= 0:
            raise ValueError("interval_s, ttft_slo_s, tpot_slo_s and prompt_lookback_s must be > 0")
        if self.min_nodes < 1:
            raise ValueError("min_nodes must be >= 1")


def full_prefill_time(model: PrefillModel, tokens: float, chunk_tokens: int) -> float:
    """Arrow's prefill time of a prompt of ``tokens`` with no cached prefix, in chunks (s)."""
    if tokens <= 0:
        return 0.0
    return model.c0 * math.ceil(tokens / chunk_tokens) + model.c1 * tokens + model.c2 * qk_pairs(tokens, 0)


class ArrowPlanner(PolicyBase):
    """Arrow-like SLO planner (module docstring).

    Args:
        nodes: node ids.
        profile: node profile (Arrow's offline profile: Eq. 1/2, chunk size, t_acc).
        params: :class:`ArrowParams`.
    """

    name = "arrow"

    obs: Observer
    """Its measurements (set in ``__init__``; ``PolicyBase.obs`` is None only for the planners without one)."""

    def __init__(self, nodes: Sequence[str], profile: Profile, params: ArrowParams | None = None) -> None:
        super().__init__(nodes, profile)
        self.p = params or ArrowParams()
        self.obs = Observer(self.nodes, self.p.interval_s, origin=0.0, keep_buckets=max(4, math.ceil(self.p.prompt_lookback_s / self.p.interval_s) + 2))
        self._next: float | None = None

    def on_iterations(self, node: str, records: Sequence[IterationRecord], now: float) -> None:
        self.obs.on_iterations(node, records, now)

    def on_node_state(self, state: NodeState, now: float) -> None:
        self.obs.on_node_state(state, now)

    def on_request_done(self, done: RequestDone, now: float) -> None:
        self.obs.on_request_done(done, now)

    def next_tick(self) -> float | None:
        return 0.0 if self._next is None else self._next

    def predicted_ttft(self, node: str, prompt_tokens: float) -> float | None:
        """Arrow's TTFT of a new request of ``prompt_tokens`` on ``node``: queue + own prefill, full input (s)."""
        st = self.obs.latest.get(node)
        if st is None:
            return None
        prof = self.profile
        wait = st.remaining_s + sum(
            full_prefill_time(prof.prefill, q.uncached_tokens + q.cached_tokens, prof.scheduler.chunk_tokens) for q in st.queue
        )
        return wait + full_prefill_time(prof.prefill, prompt_tokens, prof.scheduler.chunk_tokens)

    def tpot(self, node: str, now: float) -> float | None:
        """Measured TPOT of ``node`` over the last interval, else predicted from its batch (s)."""
        k1 = self.obs.index(now + 1e-9)
        t = self.obs.tpot(node, k1 - 1, k1 + 1, self.profile.decode.accepted_per_iteration)
        if t is not None:
            return t
        st = self.obs.latest.get(node)
        if st is None or st.decoding == 0:
            return None
        return self.profile.decode.iteration_time(st.decoding) / self.profile.decode.accepted_per_iteration

    def tick(self, now: float, phases: Mapping[str, Phase], busy: Set[str]) -> SplitDecision | None:
        self.obs.advance(now)
        if self._next is None:
            self._next = now
        if now < self._next:
            return None
        while self._next <= now:
            self._next += self.p.interval_s
        if busy:
            return None
        live = self.live(phases)  # a dead node's last state is no measurement, its capacity none (on_liveness)
        n_p, n_d, pd = _pd_counts(live)
        if not pd:
            return None
        k1 = self.obs.index(now + 1e-9) + 1
        k0 = k1 - math.ceil(self.p.prompt_lookback_s / self.p.interval_s) - 1
        pooled = self.obs.pooled(k0, k1)
        prompt = pooled.prompt if pooled.n else 0.0
        ttfts = [t for n, v in live.items() if v == "prefill" and (t := self.predicted_ttft(n, prompt)) is not None]
        tpots = [t for n, v in live.items() if v == "decode" and (t := self.tpot(n, now)) is not None]
        ttft = min(ttfts) if ttfts else 0.0
        tpot = max(tpots) if tpots else 0.0
        r_p = ttft / self.p.ttft_slo_s
        r_d = tpot / self.p.tpot_slo_s
        metrics = {"predicted_ttft_s": ttft, "tpot_s": tpot, "ttft_ratio": r_p, "tpot_ratio": r_d, "prompt_tokens": prompt}
        if r_p <= 1.0 and r_d <= 1.0:
            return None  # both SLOs met: nothing to decide, nothing to log every 10 s
        if r_p > 1.0 and (r_d <= 1.0 or r_p >= r_d):
            if n_d <= self.p.min_nodes:
                self._decide(now, "no_switch", phases, None, f"TTFT {ttft:.2f}s > SLO but decode is at its minimum{_dead_note(self.dead)}", metrics=metrics)
                return None
            target = self.assign_live(phases, n_p + 1)
            reason = f"predicted TTFT {ttft:.2f}s (full input) > SLO {self.p.ttft_slo_s:.2f}s: one decode node → prefill"
        else:
            if n_p <= self.p.min_nodes:
                self._decide(now, "no_switch", phases, None, f"TPOT {tpot * 1000:.1f}ms > SLO but prefill is at its minimum{_dead_note(self.dead)}", metrics=metrics)
                return None
            target = self.assign_live(phases, n_p - 1)
            reason = f"TPOT {tpot * 1000:.1f}ms > SLO {self.p.tpot_slo_s * 1000:.1f}ms: one prefill node → decode"
        return self._decide(now, "switch", phases, target, reason + _dead_note(self.dead), metrics=metrics)
