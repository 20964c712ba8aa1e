"""The paper's planner (§5.1, §5.2, Alg. E.3 outer loop) plus an SLO guard (beyond the paper).

Contains zero I/O; every method takes ``now`` (simulated s).

Life cycle:

1. **Warm-up** (``t_learn_s``, paper 1,800 s): every node serves ``both``
   (collocated): launched so (:meth:`start_phases`, which keeps the split given as the
   initial split), else the first :meth:`tick` switches every node to ``both`` and
   remembers the split it found as the initial split. Every iteration record goes into the node's
   :class:`~services.planner.fit.FitSamples`.
2. **Freeze**: at the warm-up end each node's Eq. 1/2 coefficients are fitted by
   NNLS (``fit.fit_node``) and frozen; a node with too few records gets the median
   of the fitted nodes (``peer``), or the profile. The decision is "go to the
   initial split" (for an initial ``collocated`` split: the p with the best mean Θ
   over the warm-up, or the lowest predicted latency with the ``latency`` objective).
3. **Windows** (``window_s`` = 600 s, ``slices`` m = 10): at each window end,
   t̄_n and f_n are re-measured; for every prefill count p ≠ |P| the fewest-change
   candidate gets per-slice gains g_i = Θ(cand; w̄_i, q̄_i) − Θ(cur; w̄_i, q̄_i)
   (Eq. 5, 6); it qualifies if mean(g) > z·std(g)/√m (z = 2) and (beyond the
   paper, ``min_gain_share``) mean(g) > 3% of the current Θ; the qualifying
   candidate with the largest mean gain is applied. No planning while a node
   is busy (draining/switching) or within ``cooldown_s`` (120 s) of a switch.

   **Objective** (``objective``; beyond the paper, default ``latency``). With
   ``throughput`` the gains are Θ's, as in the paper. With ``latency`` they are
   the predicted mean latency a request saves per slice
   (:func:`~services.planner.throughput.mean_latencies`: the prefill pool as an
   M/G/c queue at the slice's request rate with the window's measured spread of
   Eq. 3 work, plus the Eq. 3 service and the Eq. 4 decode time at B = q̄/|D|),
   under the same gate (the minimum gain is then a share of the current
   latency); a window whose current split is predicted overloaded (λ ≥ cμ̄ in a
   slice) is decided on Θ. Why: in a closed loop of agents whose think time
   sets the request rate, Θ of every split that keeps up is within a few percent
   (the decode term at the observed population is the current throughput), so
   the paper's gate drifts toward the fewest prefill nodes (Θ's decode term
   grows with |D|) and ends wherever the noise stops it; on real Claude Code
   sessions it ended at 2P7D or 3P6D depending on the start, with mean E2E
   1.6–2.3× that of static 4P5D (``bench/RESULTS.md``).
4. **SLO guard** (``slo_guard``, on by default; ``slo_guard=False`` with
   ``min_gain_share=0`` and ``objective="throughput"`` is the paper's planner exactly). Motivation: paper App. D.3, where one switch to 2P7D left
   prefill requests queueing for 120–275 s at P95 for ten minutes. With the same
   models and the observed arrival rate λ̂ (``Observer.arrival_rate``), the
   prefill pool of a split is an M/M/c queue (``throughput.ttft_quantile``):

   * *veto*: a qualifying candidate whose predicted P95 TTFT exceeds
     ``ttft_target_s`` (15 s, D.3's target) and is worse than the current split's
     is not applied;
   * *reversal*: every slice (60 s) outside warm-up, cooldown and busy periods,
     if the current split's predicted P95 TTFT over the last ``guard_lookback_s``
     exceeds the target **and** the observed prefill backlog (mean Eq. 7 wait
     Ŵ_n over prefill nodes, from their latest states) exceeds
     ``guard_backlog_share`` × target, switch to the smallest p > |P| whose
     predicted P95 TTFT meets the target, whose decode pool can sustain λ̂ at a
     full batch, and whose Θ is within ``guard_max_theta_loss`` of the current
     one — with the ``latency`` objective, of the p > |P| that pass, the one with
     the lowest predicted mean latency over the lookback. Both conditions must hold, so a sub-agent burst (backlog without a
     sustained rate) or a rate the models think too high while queues stay
     short does not switch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

from shared.messages import CandidateGain, IterationRecord, NodeModels, NodeState, Phase, PlannerModels
from shared.profile import Profile
from shared.split import SplitError, split_name, split_phases
from services.planner.fit import FitSamples, fit_node, median_decode, median_prefill
from services.planner.observe import Observer, SliceStats
from services.planner.policy import PolicyBase, RequestDone, SplitDecision, dead_note as _dead_note
from services.planner.throughput import (
    ModelTable,
    NodeModelState,
    candidate_masks,
    mean_latencies,
    queue_wait,
    significance,
    theta,
    ttft_quantile,
    ttft_quantiles,
)


def _warmup_kept(phases: Mapping[str, Phase]) -> str:
    """How a warm-up note words the phases kept while models are fitted: collocated, or the split served
    (``phases``: node → "prefill" | "decode" | "both")."""
    if all(p == "both" for p in phases.values()):
        return "every node serves both phases"
    return f"in the split the cluster serves ({split_name(phases)})"


@dataclass(frozen=True, slots=True)
class EvolvingParams:
    """Parameters of :class:`EvolvingPlanner` (defaults: paper App. E.3 unless noted)."""

    t_learn_s: float = 1800.0
    """Collocated warm-up during which the models are fitted (paper: 1,800 s)."""
    window_s: float = 600.0
    """Planning window T_win (paper: 600 s)."""
    slices: int = 10
    """Slices m per window (paper: 60-s slices, m = 10)."""
    z: float = 2.0
    """Significance: a candidate qualifies if mean(g) > z·std(g)/√m (paper: 2)."""
    min_gain_share: float = 0.03
    """Hysteresis (beyond the paper; 0 = the paper's gate): a candidate must also gain more
    than this share of the current split's mean Θ. The per-slice gains come from the same
    deterministic models, so two splits whose Θ differ by ~1% pass the z-test as easily as
    a real gain and the planner flips between them (3P6D ↔ 2P7D on real CC sessions)."""
    objective: str = "latency"
    """What the window decision optimises. ``throughput``: Θ (Eq. 5), the paper. ``latency``
    (beyond the paper): minus the predicted mean latency of a request
    (:func:`~services.planner.throughput.mean_latencies`: M/G/c prefill queueing at the
    measured request rate with the window's spread of Eq. 3 work + own prefill + decode at
    B = q̄/|D|), with the same gate on its per-slice gains. Slices in which the current
    split is predicted overloaded (prefill λ ≥ cμ̄, or λ above its decode pool's full-batch
    capacity; a burst of completions) are left out of the gate; a window with fewer than
    half its slices (or fewer than ``min_slices``) left is decided on Θ. A candidate
    predicted overloaded in a remaining slice does not qualify. In a closed loop whose
    agents' think time, not the cluster, sets the request rate, Θ of the splits that keep
    up differs by a few percent and says nothing of what the split does to latency."""
    cooldown_s: float = 120.0
    """No planning this long after a switch (paper: 120 s)."""
    min_slices: int = 3
    """Slices with completed requests needed to evaluate a window (ours)."""
    min_requests_per_slice: int = 1
    """Completed requests for a slice to count (ours)."""
    min_fit_samples: int = 8
    """Records with a prefill (decode) part needed to fit that side of a node (ours)."""
    fit_cap: int = 50_000
    """Records kept per node for the fit (uniform reservoir sample; ours)."""
    max_batch: int = 0
    """Cap on B in Eq. 4 (0 = the profile's ``scheduler.max_running``)."""
    initial_split: str | None = None
    """Split to serve after the warm-up (None = the phases at the first tick)."""
    slo_guard: bool = True
    """Enable the SLO guard (beyond the paper; False, with ``min_gain_share=0`` and
    ``objective="throughput"``, = the paper's planner)."""
    ttft_target_s: float = 15.0
    """Guard target for the TTFT quantile (paper App. D.3: P95 within 15 s)."""
    ttft_quantile: float = 0.95
    guard_lookback_s: float = 180.0
    """Arrival rate and w̄ of the reversal check come from this much history (whole slices)."""
    guard_backlog_share: float = 0.5
    """Reversal needs the observed mean prefill wait above this share of the target."""
    guard_max_theta_loss: float = 0.10
    """A reversal target may lose at most this share of the current Θ."""
    guard_sustain_slices: int = 3
    """"Sustained" (ours, issue 21): the reversal needs a violation (predicted quantile over the
    target *and* backlog over ``guard_backlog_share`` × target) at this many consecutive guard
    checks, one per slice (3 = 120 s after the first at 60-s slices), with the backlog never
    falling by more than ``guard_drain_share`` from one check to the next. A burst that has
    ended drains its queue, so its streak restarts and it does not switch. 1 = the
    pre-issue-21 guard (one check)."""
    guard_drain_share: float = 0.10
    """A check whose backlog is below (1 − this) × the previous check's restarts the streak (ours)."""
    no_data_retry_s: float = 600.0
    """Warm-up end without fitted data (no node with ``min_fit_samples`` prefill and decode
    records): the warm-up is extended by this long and nothing is frozen or switched (ours).
    When not one usable record had arrived, the warm-up instead restarts at the first one
    (``t_learn_s`` from it, on the slice grid; :meth:`EvolvingPlanner.on_iterations`), this retry
    only the end in case none comes."""
    sample_interval_s: float = 5.0
    """Extra ticks this often so that a caller that reports node states only at ticks (the
    simulator) gives the time averages q̄_i enough samples (ours; 0 = no extra ticks)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sample_interval_s < 0:
            raise ValueError("sample_interval_s must be >= 0")
        if self.t_learn_s < 0 or self.window_s <= 0 or self.cooldown_s < 0:
            raise ValueError("t_learn_s and cooldown_s must be >= 0 and window_s > 0")
        if self.slices < 2:
            raise ValueError(f"slices must be >= 2 (a standard deviation needs two), got {self.slices}")
        if not 2 <= self.min_slices <= self.slices:
            raise ValueError(f"min_slices must be in [2, slices], got {self.min_slices}")
        if self.objective not in ("throughput", "latency"):
            raise ValueError(f"objective must be 'throughput' or 'latency', got {self.objective!r}")
        if not 0 <= self.min_gain_share < 1:
            raise ValueError(f"min_gain_share must be in [0, 1), got {self.min_gain_share}")
        if self.z < 0 or self.ttft_target_s <= 0 or not 0 < self.ttft_quantile < 1:
            raise ValueError("z must be >= 0, ttft_target_s > 0, ttft_quantile in (0, 1)")
        if self.guard_lookback_s <= 0 or self.guard_backlog_share < 0 or not 0 <= self.guard_max_theta_loss <= 1:
            raise ValueError("guard_lookback_s > 0, guard_backlog_share >= 0, guard_max_theta_loss in [0, 1]")
        if self.guard_sustain_slices < 1 or self.no_data_retry_s <= 0 or not 0 <= self.guard_drain_share < 1:
            raise ValueError("guard_sustain_slices must be >= 1, no_data_retry_s > 0, guard_drain_share in [0, 1)")


class EvolvingPlanner(PolicyBase):
    """The paper's online phase-split planner with the SLO guard (module docstring).

    Args:
        nodes: node ids in cluster order.
        profile: node profile: Eq. 1/2 priors and MoE/MTP shape, ``max_running``, chunk size.
        params: :class:`EvolvingParams`.

    Raises:
        ValueError: bad nodes or an ``initial_split`` that does not fit them.
    """

    name = "evolving"

    obs: Observer
    """Its measurements (set in ``__init__``; ``PolicyBase.obs`` is None only for the planners without one)."""

    def __init__(self, nodes: Sequence[str], profile: Profile, params: EvolvingParams | None = None) -> None:
        super().__init__(nodes, profile)
        self.p = params or EvolvingParams()
        if self.p.initial_split is not None:
            split_phases(self.p.initial_split, self.nodes)  # validate early
        self.slice_s = self.p.window_s / self.p.slices
        self.max_batch = float(self.p.max_batch or profile.scheduler.max_running)
        self.lookback = max(1, round(self.p.guard_lookback_s / self.slice_s))
        keep = max(self.p.slices, self.lookback, self.p.guard_sustain_slices) + 2 + math.ceil(self.p.t_learn_s / self.slice_s)
        self.obs = Observer(self.nodes, self.slice_s, origin=0.0, keep_buckets=min(keep, 4096))
        self.samples = {n: FitSamples(self.p.fit_cap, seed=self.p.seed * 1_000_003 + i) for i, n in enumerate(self.nodes)}
        self.state: dict[str, NodeModelState] = {
            n: NodeModelState(profile.prefill, profile.decode, float(profile.scheduler.chunk_tokens), 0.0) for n in self.nodes
        }
        self.frozen = False
        self.frozen_at: float | None = None
        self.stage = "start"
        self.initial: dict[str, Phase] | None = None
        self.expected: dict[str, Phase] = {}
        self._external_reason = ""
        """Why the warm-up was asked to end early (an operator's split during it, its reason) while
        there was no data to freeze on: the extended warm-up's end keeps that split, as a freeze
        with data at the time would have."""
        self.warmup_end = 0.0
        self.next_window_end = math.inf
        self.next_guard = math.inf
        self.last_switch_at = -math.inf
        self.next_sample = 0.0
        self._models_seq = 0
        self._table: tuple[tuple[tuple[str, ...], int], ModelTable] | None = None
        self.windows = 0
        """Windows evaluated (including skipped ones)."""
        self._guard_backlogs: list[float] = []
        """Backlogs (s) of the current streak of consecutive guard checks that found a violation."""
        self._resumed = False
        """:meth:`on_adopted` before the first tick: the warm-up runs in the adopted split."""
        self._await_first_record = False
        """The warm-up ended before any node published a usable iteration record (the nodes were
        not serving yet: a real engine loading its model, ~23 wall s for ``demo --engine torch``
        on a busy 2-core machine, 1,150 s of cluster clock at speed-up 50, against its 240-s
        warm-up): the first record restarts the warm-up (:meth:`on_iterations`)."""

    @property
    def records_now(self) -> bool:
        """Only while the warm-up waits for its first record (its restart reads the record's ``now`` and moves
        :meth:`next_tick`; it begins and ends only at a tick or at a record). Otherwise a node's records
        feed only that node's fit sample (a reservoir with the node's own RNG) and the observer's
        per-node sums by each record's start: handed later, each node's in its order, they leave the
        same numbers (see :meth:`PolicyBase.records_now`)."""
        return self._await_first_record

    # -- inputs ------------------------------------------------------------ #

    def on_iterations(self, node: str, records: Sequence[IterationRecord], now: float) -> None:
        """Warm-up: sample records for the fit; always: t̄_n / f_n inputs. O(records)."""
        s = self.samples.get(node)
        if s is None:
            return
        if not self.frozen:
            s.add(records)
            if self._await_first_record and s.seen:
                self._restart_warmup(node, now)
        self.obs.on_iterations(node, records, now)

    def _restart_warmup(self, node: str, now: float) -> None:
        """The first usable iteration record after a warm-up that ended without any: the warm-up
        counts from now, ``t_learn_s`` to the next slice boundary as at the first tick (:meth:`_start`),
        so the fit gets the collocated records the warm-up is for, not only those of the remainder
        of a ``no_data_retry_s`` timer that began before the nodes served. O(N)."""
        self._await_first_record = False
        if self.stage != "warmup":
            return
        self.warmup_end = max(now, self.obs.start_of(self.obs.ceil_index(now + self.p.t_learn_s)))
        self.tick_moved = True  # before the no-data retry, mostly: a caller that schedules ticks asks again
        phases = self.expected
        kept = _warmup_kept(phases)
        self._split_note = (
            f"warm-up: {kept} until t={self.warmup_end:.0f}s to fit the iteration-time models "
            f"(restarted at the first iteration record, t={now:.0f}s)"
        )
        self._decide(
            now,
            "warmup",
            phases,
            None,
            f"first iteration record ({node}, t={now:.0f}s) after a warm-up without any: warm-up restarted, "
            f"{kept} until t={self.warmup_end:.0f}s to fit the iteration-time models",
            metrics={"warmup_end": self.warmup_end},
        )

    def on_node_state(self, state: NodeState, now: float) -> None:
        if state.node in self.samples:
            self.obs.on_node_state(state, now)

    def on_request_done(self, done: RequestDone, now: float) -> None:
        self.obs.on_request_done(done, now)

    def on_switch_done(self, node: str, phase: Phase, now: float) -> None:
        """A node finished switching: the cooldown runs from the last switch completion too."""
        self.last_switch_at = max(self.last_switch_at, now)

    def on_placed(self, phases: Mapping[str, Phase], now: float) -> None:
        """The core applied ``phases`` (the last decision, or the current split, with a phase left on dead
        nodes only moved to a live node, same split): they are this planner's own, not a change made
        outside it (which restarts the cooldown, or ends the warm-up early, and is logged as such). O(N)."""
        self.expected = dict(phases)

    def on_adopted(self, phases: Mapping[str, Phase], now: float) -> None:
        """A restarted live planner found the cluster serving ``phases`` (``core.PlannerCore``
        adoption, before this policy's first :meth:`tick`): plan onward from them.

        The warm-up (the models are this process's to fit again) then runs in ``phases``
        instead of switching every node to ``both``: each node's records fit the parts its
        phase runs (a node without one gets its peers' median, ``fit_node``), and ``phases``
        is the split kept at the freeze — unless it is collocated (the planner crashed during
        its warm-up), then the freeze chooses as after any warm-up. Called after the first
        tick (the split changed under a running planner): nothing here, :meth:`tick` sees an
        external change. O(N).
        """
        if self.stage != "start":
            return
        self._resumed = True
        if any(v != "both" for v in phases.values()):
            self.initial = dict(phases)

    # -- schedule ---------------------------------------------------------- #

    def next_tick(self) -> float | None:
        if self.stage == "start":
            return 0.0
        nxt = self.warmup_end if self.stage == "warmup" else self.next_window_end
        if self.stage == "pd" and self.p.slo_guard:
            nxt = min(nxt, self.next_guard)
        if self.p.sample_interval_s > 0:
            nxt = min(nxt, self.next_sample)
        return nxt

    def tick(self, now: float, phases: Mapping[str, Phase], busy: Set[str]) -> SplitDecision | None:
        """Advance the state machine to ``now`` (see the module docstring); returns a decision
        only when the phase map should change."""
        phases = dict(phases)
        self.obs.advance(now)
        if self.p.sample_interval_s > 0 and now + 1e-9 >= self.next_sample:
            while self.next_sample <= now + 1e-9:
                self.next_sample += self.p.sample_interval_s
        if self.stage == "start":
            return self._start(now, phases)
        external = [n for n in phases if n not in busy and self.expected.get(n, phases[n]) != phases[n]]
        if self.stage == "warmup":
            if external:
                return self._freeze(now, phases, reason=f"split changed externally during warm-up ({split_name(phases)})")
            if now + 1e-9 >= self.warmup_end:
                return self._freeze(now, phases)
            return None
        if external:
            self.expected = dict(phases)
            self.last_switch_at = now
            self._decide(now, "no_switch", phases, None, f"split changed externally to {split_name(phases)}; cooldown restarts")
        if now + 1e-9 >= self.next_window_end:
            w_end = self.next_window_end
            while self.next_window_end <= now + 1e-9:
                self.next_window_end += self.p.window_s
            self._advance_guard(now)
            return self._window(now, w_end, phases, busy)
        if self.p.slo_guard and now + 1e-9 >= self.next_guard:
            self._advance_guard(now)
            return self._guard(now, phases, busy)
        return None

    def _advance_guard(self, now: float) -> None:
        self.next_guard = self.obs.start_of(self.obs.index(now) + 1)  # first grid boundary after now

    # -- warm-up ------------------------------------------------------------ #

    def start_phases(self, phases: Mapping[str, Phase]) -> dict[str, Phase]:
        """The phases a cluster driven by this planner should launch in. O(N).

        With a warm-up (``t_learn_s`` > 0) every node serves ``both`` from the
        start (paper §5.1, Alg. E.3 line 1: the models are fitted in a collocated
        mode), and ``phases`` — unless ``initial_split`` is set — becomes the split
        served after the warm-up. A caller that launches its nodes this way (the
        simulator; the live planner's fresh cluster, ``PlannerCore._fresh_start``, whose
        workers ``up`` launches ``both``) never routes a request to the configured split
        before the warm-up; a caller that does not gets the same warm-up from the first
        :meth:`tick`, which switches every node to ``both``.
        Without a warm-up: ``phases`` unchanged. Optional: call before the first tick.

        Raises:
            RuntimeError: after the first :meth:`tick`.
        """
        if self.stage != "start":
            raise RuntimeError("start_phases must be called before the first tick")
        if self.initial is None:
            self.initial = split_phases(self.p.initial_split, self.nodes) if self.p.initial_split else dict(phases)
        if self.p.t_learn_s <= 0:
            return dict(phases)
        return {n: "both" for n in phases}

    def _start(self, now: float, phases: dict[str, Phase]) -> SplitDecision | None:
        if self.initial is None:
            self.initial = split_phases(self.p.initial_split, self.nodes) if self.p.initial_split else dict(phases)
        self.warmup_end = max(now, self.obs.start_of(self.obs.ceil_index(now + self.p.t_learn_s)))
        self.stage = "warmup"
        both: dict[str, Phase] = {n: "both" for n in phases}
        self.expected = both
        if self.p.t_learn_s <= 0:
            self.expected = dict(phases)
            return self._freeze(now, phases, priors=True)
        if self._resumed:  # a restarted planner keeps the split the cluster serves (on_adopted)
            self.expected = dict(phases)
            self._decide(
                now,
                "warmup",
                phases,
                None,
                f"warm-up in the split the cluster serves ({split_name(phases)}, adopted at restart) "
                f"until t={self.warmup_end:.0f}s to fit the iteration-time models",
                metrics={"warmup_end": self.warmup_end},
            )
            return None
        reason = f"warm-up: every node serves both phases until t={self.warmup_end:.0f}s to fit the iteration-time models"
        if dict(phases) == both:  # launched collocated (start_phases): nothing switches, the current split's reason says it
            self._split_note = reason
        return self._decide(now, "warmup", phases, both, reason, metrics={"warmup_end": self.warmup_end})

    def _fits(self) -> dict[str, Any]:
        """NNLS fit of every node's samples (``fit.fit_node``), nothing applied yet."""
        prof = self.profile
        return {n: fit_node(self.samples[n], prof.prefill, prof.decode, min_samples=self.p.min_fit_samples) for n in self.nodes}

    @staticmethod
    def no_data(fits: Mapping[str, Any], min_samples: int = 8, records: int | None = None) -> str:
        """Why ``fits`` cannot be frozen ("" when they can): no node fitted its prefill side,
        or none its decode side (each needs ``min_samples``, the planner's ``min_fit_samples``,
        records with that part). The reason says how many usable records arrived (``records``, all
        nodes; None: the larger side's count per node, summed), how many a side needs, and the most
        any node had of each part."""
        n_pre = sum(1 for f in fits.values() if f.prefill is not None)
        n_dec = sum(1 for f in fits.values() if f.decode is not None)
        if n_pre and n_dec:
            return ""
        recs = records if records is not None else sum(max(f.prefill_samples, f.decode_samples) for f in fits.values())
        head = f"no data: {n_pre} node(s) with a fitted prefill model, {n_dec} with a fitted decode model"
        if not recs:
            return f"{head} (0 usable iteration records: no node has published one yet)"
        most_p = max((f.prefill_samples for f in fits.values()), default=0)
        most_d = max((f.decode_samples for f in fits.values()), default=0)
        return (
            f"{head} ({recs} usable iteration records; a node needs {min_samples} with a prefill part and "
            f"{min_samples} with a decode part (min_fit_samples), the most on one node: {most_p} with a prefill part, {most_d} with a decode part)"
        )

    def _fit(self, fits: Mapping[str, Any]) -> dict[str, float]:
        """Apply ``fits``, fill the unfitted from peers or the profile, freeze. Returns summary metrics.
        Callers check :meth:`no_data` first: at least one fitted node per side."""
        prof = self.profile
        pre = [f.prefill for f in fits.values() if f.prefill is not None]
        dec = [f.decode for f in fits.values() if f.decode is not None]
        peer_p = median_prefill(pre) if pre else None
        peer_d = median_decode(dec, prof.decode) if dec else None
        errors = []
        for n, f in fits.items():
            st = self.state[n]
            src = "fitted"
            if f.prefill is not None:
                st.prefill = f.prefill
            elif peer_p is not None:
                st.prefill, src = peer_p, "peer"
            else:
                st.prefill, src = prof.prefill, "profile"
            if f.decode is not None:
                st.decode = f.decode
            elif peer_d is not None:
                st.decode = peer_d
                src = "peer" if src == "fitted" else src
            else:
                st.decode, src = prof.decode, "profile"
            st.source = src
            st.samples = len(self.samples[n])
            st.fit_error = f.fit_error
            if f.prefill is not None or f.decode is not None:
                errors.append(f.fit_error)
        self.frozen = True
        for s in self.samples.values():
            s.clear()  # frozen: the samples are no longer needed
        return {
            "nodes_fitted": float(sum(1 for f in fits.values() if f.prefill is not None and f.decode is not None)),
            "fit_error_mean": float(np.mean(errors)) if errors else math.nan,
        }

    def _freeze(self, now: float, phases: dict[str, Phase], reason: str = "", *, priors: bool = False) -> SplitDecision | None:
        """End of the warm-up: fit, freeze and go to the initial split. Without fitted data
        (:meth:`no_data`) nothing is frozen or switched and the warm-up is extended, unless
        ``priors`` (``t_learn_s`` = 0: the operator asked for no warm-up, so the profile's
        coefficients are the models, and the decision says so). ``reason``: the split was changed
        externally (an operator's ``split set``); the freeze keeps that split, also when it comes at
        the end of a warm-up extended for want of data after that change."""
        reason = reason or self._external_reason
        k_end = self.obs.index(now + 1e-9)
        k_start = max(self.obs.index(now - self.p.t_learn_s + 1e-9), k_end - self.obs.keep)
        fits = self._fits()
        missing = self.no_data(fits, self.p.min_fit_samples, sum(len(s) for s in self.samples.values()))
        if missing and not priors:  # issue 21 (llm-d-autoscaling #1212): never freeze, never switch on the priors alone
            self._external_reason = reason  # the extended warm-up's end keeps an operator's split
            before, self.warmup_end = self.warmup_end, now + self.p.no_data_retry_s
            # nothing arrived: the nodes did not serve yet, the warm-up restarts at the first record
            self._await_first_record = not any(s.seen for s in self.samples.values())
            if self._await_first_record:
                missing += f"; the warm-up restarts at the first record ({self.p.t_learn_s:.0f} s from it)"
            # an operator's split early in the warm-up asks to freeze now: the retry may come before the first end
            moved = "extended" if self.warmup_end >= before else "brought forward"
            self.expected = dict(phases)
            kept = _warmup_kept(phases)
            self._split_note = (
                f"warm-up: {kept} until t={self.warmup_end:.0f}s to fit the iteration-time models "
                f"({moved}: {missing}{'; ' + reason if reason else ''})"
            )
            self._decide(
                now,
                "no_switch",
                phases,
                None,
                f"{missing}; models not frozen, split kept ({split_name(phases)}), warm-up {moved} to t={self.warmup_end:.0f}s"
                + (f" ({reason})" if reason else ""),
                metrics={"nodes_fitted": 0.0, "warmup_end": self.warmup_end},
            )
            return None
        self._remeasure(k_start, k_end)
        metrics = self._fit(fits)
        why = f"no warm-up (t_learn_s=0), {missing}: the profile's coefficients are the models" if missing else "warm-up over: models frozen"
        self.frozen_at = now
        self._models_seq += 1
        self.stage = "pd"
        self.next_window_end = self.obs.start_of(self.obs.ceil_index(now) + self.p.slices)
        self._advance_guard(now)
        assert self.initial is not None
        if reason:  # external change: keep what the operator set
            self.expected = dict(phases)
            self.last_switch_at = now
            self._decide(now, "no_switch", phases, None, f"models frozen early: {reason}", metrics=metrics)
            return None
        target = self.initial
        if all(v == "both" for v in target.values()):
            target, extra = self._best_from_warmup(k_start, k_end, phases)
            metrics.update(extra)
        self.expected = dict(target)
        if target != phases:
            self.last_switch_at = now
        return self._decide(
            now,
            "switch",
            phases,
            target,
            f"{why}, serving {split_name(target)}",
            metrics=metrics,
        )

    def _best_from_warmup(self, k0: int, k1: int, phases: Mapping[str, Phase]) -> tuple[dict[str, Phase], dict[str, float]]:
        """Initial split ``collocated``: the p with the largest mean Θ over the warm-up slices, or,
        with the ``latency`` objective, the lowest mean predicted latency (Θ when every split is
        predicted overloaded)."""
        w = [s for s in self.obs.slices(k0, max(1, k1 - k0)) if s.n > 0 and s.q > 0]
        full: dict[str, Phase] = {n: "decode" for n in phases}  # a dead node decodes (the core lays a phase over live ones)
        base = self.live(full)
        n_nodes = len(base)
        if not w or n_nodes < 2:
            p = max(1, n_nodes // 2)
            return self.assign_live(full, p) if n_nodes >= 2 else dict(phases), {"best_p": float(p)}
        counts, mask, _ = candidate_masks(base)
        if self.p.objective == "latency":
            lat = self._latency(list(base), mask, counts, w).mean(axis=1)
            if np.isfinite(lat).any():  # the split with the lowest predicted mean latency
                p = int(counts[int(np.argmin(lat))])
                return self.assign_live(full, p), {"best_p": float(p), "best_latency_s": float(lat.min())}
        th = self._theta(list(base), mask, counts, w)
        p = int(counts[int(np.argmax(th.mean(axis=1)))])
        return self.assign_live(full, p), {"best_p": float(p)}

    # -- measurement ---------------------------------------------------------- #

    def _remeasure(self, k0: int, k1: int) -> dict[str, float]:
        """Re-measure t̄_n and f_n over buckets [k0, k1) (Alg. E.3 line 15)."""
        tb: dict[str, float] = {}
        fs: dict[str, float] = {}
        for n in self.nodes:
            t = self.obs.mean_chunk_tokens(n, k0, k1)
            if t is not None:
                tb[n] = t
            f = self.obs.restored_share(n, k0, k1)
            if f is not None:
                fs[n] = f
        t_pool = float(np.mean(list(tb.values()))) if tb else None
        f_pool = float(np.mean(list(fs.values()))) if fs else None
        for n in self.nodes:
            st = self.state[n]
            if n in tb:
                st.mean_chunk_tokens = tb[n]
            elif t_pool is not None:
                st.mean_chunk_tokens = t_pool
            if n in fs:
                st.restored_share = fs[n]
            elif f_pool is not None:
                st.restored_share = f_pool
        self._models_seq += 1
        return {"mean_chunk_tokens": t_pool or math.nan, "restored_share": f_pool or math.nan}

    def table(self, order: Sequence[str]) -> ModelTable:
        """Coefficient arrays in ``order``; rebuilt only when the models change."""
        key = (tuple(order), self._models_seq)
        if self._table is None or self._table[0] != key:
            self._table = (key, ModelTable(order, self.state))
        return self._table[1]

    def models_changed(self) -> None:
        """Call after editing ``self.state`` directly (tests, benchmarks): drops cached tables."""
        self._models_seq += 1

    def _rates(self, order: list[str], counts: np.ndarray, w: Sequence[SliceStats]) -> tuple[ModelTable, np.ndarray, np.ndarray]:
        """``(table, μP (N, m), μD (N, P, m))`` of every candidate on slices ``w`` (Eq. 3, 4)."""
        table = self.table(order)
        return table, table.prefill_rates(w), table.decode_rates(w, len(order) - counts, self.max_batch)

    def _theta(self, order: list[str], mask: np.ndarray, counts: np.ndarray, w: Sequence[SliceStats]) -> np.ndarray:
        _, mu_p, mu_d = self._rates(order, counts, w)
        return theta(mask, mu_p, mu_d)

    def _latency(
        self,
        order: list[str],
        mask: np.ndarray,
        counts: np.ndarray,
        w: Sequence[SliceStats],
        rates: tuple[ModelTable, np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Predicted mean latency per candidate and slice (s), shape (P, m); the arrival rate of a
        slice is its completions per second (the closed loop's steady state). The service SCV
        is the window's (all its requests pooled): it describes the workload's spread of
        prompt work, which one 60-s slice with a few long prompts estimates poorly.
        ``rates``: :meth:`_rates` of the same arguments when the caller has them."""
        table, mu_p, mu_d = rates if rates is not None else self._rates(order, counts, w)
        d_counts = len(order) - counts
        lam = np.array([s.n / self.slice_s for s in w])
        q = np.array([s.q for s in w])
        scv = np.full(len(w), float(table.prefill_scv([_pool(w)])[0]))
        per_tok = table.decode_capacity(1.0, self.max_batch)  # full-batch rate at t_out = 1, (N,)
        cap = ((~mask).astype(float) @ per_tok)[:, None] / np.maximum(np.array([s.t_out for s in w]), 1.0)[None, :]
        return mean_latencies(mask, mu_p, mu_d, lam, q, d_counts, self.max_batch, scv=scv, decode_capacity=cap)

    def _ttft(self, order: list[str], mask_row: np.ndarray, w: SliceStats, lam: float) -> float:
        mu = self.table(order).prefill_rates([w])[:, 0]
        return ttft_quantile(mu[mask_row], lam, self.p.ttft_quantile)

    # -- the window decision (Eq. 5, 6) --------------------------------------- #

    def evaluate(self, phases: Mapping[str, Phase], w: Sequence[SliceStats], lam: float | None = None) -> tuple[list[CandidateGain], dict[str, float], int | None]:
        """Gains of every candidate on slices ``w`` and the gate (pure; used by :meth:`tick` and tests).

        Returns:
            ``(candidates, metrics, best_p)``: one :class:`CandidateGain` per p ≠ |P|,
            the Θ terms, and the prefill count to switch to (None = stay). With the
            guard on and ``lam`` given, vetoes are applied.
        """
        order = list(phases)
        counts, mask, p0 = candidate_masks(phases)
        valid = [s for s in w if s.n >= self.p.min_requests_per_slice and s.q > 0]
        m = len(valid)
        rates = self._rates(order, counts, valid)
        th = theta(mask, rates[1], rates[2])
        cur = th[p0 - 1]
        objective = "throughput"
        lat = np.full(th.shape, math.nan)
        used = m
        if self.p.objective == "latency":
            lat_all = self._latency(order, mask, counts, valid, rates)
            keep = np.isfinite(lat_all[p0 - 1])  # slices where the current split keeps up
            used = int(keep.sum())
            if used >= max(2, self.p.min_slices, (m + 1) // 2):
                objective = "latency"
                lat = lat_all[:, keep]
        if objective == "latency":
            feasible = np.isfinite(lat).all(axis=1)
            cur_l = lat[p0 - 1]
            gains = np.where(feasible[:, None], cur_l[None, :] - np.where(np.isfinite(lat), lat, 0.0), 0.0)  # s saved
            mean, std, thr, qual = significance(gains, self.p.z)
            if self.p.min_gain_share > 0:
                thr = np.maximum(thr, self.p.min_gain_share * float(cur_l.mean()))
            qual = (mean > thr) & feasible  # an overloaded candidate (latency_s = inf) reports gain 0 and never qualifies
        else:
            gains = th - cur[None, :]
            mean, std, thr, qual = significance(gains, self.p.z)
            if self.p.min_gain_share > 0:  # hysteresis: a near-tie is no reason to switch
                thr = np.maximum(thr, self.p.min_gain_share * float(cur.mean()))
                qual = mean > thr
        guard = self.p.slo_guard and lam is not None
        pooled = _pool(valid)
        ttft = np.full(len(counts), math.nan)
        if guard:
            mu = self.table(order).prefill_rates([pooled])[:, 0]
            ttft = ttft_quantiles(mu, mask, float(lam), self.p.ttft_quantile)  # type: ignore[arg-type]
        cands: list[CandidateGain] = []
        best: int | None = None
        best_gain = -math.inf
        for j, p in enumerate(counts):
            if p == p0:
                continue
            veto = ""
            if guard and qual[j] and ttft[j] > self.p.ttft_target_s and ttft[j] > ttft[p0 - 1]:
                veto = f"predicted P{round(self.p.ttft_quantile * 100)} TTFT {ttft[j]:.1f}s > target {self.p.ttft_target_s:.1f}s"
            cands.append(
                CandidateGain(
                    prefill_nodes=int(p),
                    split=f"{p}P{len(order) - p}D",
                    mean_gain=float(mean[j]),
                    std_gain=float(std[j]),
                    threshold=float(thr[j]),
                    qualifies=bool(qual[j]),
                    changes=int(abs(p - p0)),
                    ttft_p95_s=float(ttft[j]) if guard else None,
                    vetoed=veto,
                    objective=objective,
                    theta=float(th[j].mean()),
                    latency_s=float(lat[j].mean()) if objective == "latency" else None,
                )
            )
            if qual[j] and not veto and mean[j] > best_gain:
                best, best_gain = int(p), float(mean[j])
        metrics = {
            "theta_current": float(cur.mean()),
            "latency_objective": 1.0 if objective == "latency" else 0.0,
            "slices": float(m),
            "q_mean": float(np.mean([s.q for s in valid])),
            "prefill_queue_mean": float(np.mean([s.queued for s in valid])),
            "t_uc_mean": pooled.t_uc,
            "t_c_mean": pooled.t_c,
            "t_out_mean": pooled.t_out,
        }
        if objective == "latency":
            metrics["latency_current_s"] = float(lat[p0 - 1].mean())
            metrics["latency_slices"] = float(used)
        if guard:
            metrics["arrival_rate"] = float(lam)  # type: ignore[arg-type]
            metrics["ttft_current_s"] = float(ttft[p0 - 1])
        return cands, metrics, best

    def _window(self, now: float, w_end: float, phases: dict[str, Phase], busy: Set[str]) -> SplitDecision | None:
        self.windows += 1
        k1 = self.obs.index(w_end + 1e-9)
        k0 = k1 - self.p.slices
        remeasured = self._remeasure(k0, k1)
        if busy:
            self._decide(now, "skip", phases, None, f"node(s) {sorted(busy)} still switching", metrics=remeasured)
            return None
        if now - self.last_switch_at < self.p.cooldown_s:
            self._decide(now, "skip", phases, None, f"within {self.p.cooldown_s:.0f}s of the last switch", metrics=remeasured)
            return None
        if any(v == "both" for v in phases.values()) or not 1 <= sum(v == "prefill" for v in phases.values()) < len(phases):
            self._decide(now, "skip", phases, None, f"split {split_name(phases)} is not a PD split", metrics=remeasured)
            return None
        live = self.live(phases)  # the candidates are the live nodes' splits (on_liveness); a dead node keeps its phase
        if not 1 <= sum(v == "prefill" for v in live.values()) < len(live):
            self._decide(now, "skip", phases, None, f"the live nodes' split is not a PD split{_dead_note(self.dead)}", metrics=remeasured)
            return None
        w = self.obs.slices(k0, self.p.slices)
        valid = [s for s in w if s.n >= self.p.min_requests_per_slice and s.q > 0]
        if len(valid) < self.p.min_slices:
            self._decide(
                now, "skip", phases, None, f"{len(valid)} slice(s) with completed requests, need {self.p.min_slices}", metrics=remeasured
            )
            return None
        lam = self.obs.arrival_rate(k0, k1) if self.p.slo_guard else None
        cands, metrics, best = self.evaluate(live, w, lam)
        metrics.update(remeasured)
        if best is None:
            vetoed = [c.split for c in cands if c.vetoed]
            why = "no candidate is significantly better"
            if vetoed:
                why += f"; SLO guard vetoed {', '.join(vetoed)}"
            self._decide(now, "no_switch", phases, None, why + _dead_note(self.dead), candidates=cands, metrics=metrics)
            return None
        target = self.assign_live(phases, best)
        chosen = next(c for c in cands if c.prefill_nodes == best)
        self.expected = dict(target)
        self.last_switch_at = now
        return self._decide(
            now,
            "switch",
            phases,
            target,
            (
                f"{chosen.split}: predicted mean latency {chosen.latency_s:.2f}s, {chosen.mean_gain:.3f}s below the current "
                f"> {chosen.threshold:.3f}s (max of z·σ/√m and {self.p.min_gain_share:g}·latency) over {int(metrics['slices'])} slices"
                if chosen.objective == "latency"
                else f"{chosen.split}: mean gain {chosen.mean_gain:.3f} req/s > {chosen.threshold:.3f} "
                f"(max of z·σ/√m and {self.p.min_gain_share:g}·Θ) over {int(metrics['slices'])} slices"
            ) + _dead_note(self.dead),
            candidates=cands,
            metrics=metrics,
        )

    # -- the SLO guard's reversal --------------------------------------------- #

    def backlog(self, phases: Mapping[str, Phase]) -> float:
        """Mean predicted wait Ŵ_n (Eq. 7) over the prefill nodes, from their latest states (s)."""
        waits = []
        for n, ph in phases.items():
            if ph != "prefill":
                continue
            st = self.obs.latest.get(n)
            if st is None:
                continue
            waits.append(queue_wait(self.state[n], st.remaining_s, st.queue))
        return float(np.mean(waits)) if waits else 0.0

    def _guard(self, now: float, phases: dict[str, Phase], busy: Set[str]) -> SplitDecision | None:
        """One reversal check (module docstring, item 4); a check that finds no violation ends the streak."""
        n_before = len(self._guard_backlogs)
        d = self._guard_check(now, phases, busy)
        if len(self._guard_backlogs) == n_before or d is not None:
            self._guard_backlogs = []
        return d

    def _guard_check(self, now: float, phases: dict[str, Phase], busy: Set[str]) -> SplitDecision | None:
        if busy or now - self.last_switch_at < self.p.cooldown_s:
            return None
        n_p = sum(v == "prefill" for v in phases.values())
        if any(v == "both" for v in phases.values()) or not 1 <= n_p < len(phases):
            return None
        full, phases = phases, self.live(phases)  # the live nodes' pools and backlog (on_liveness)
        n_p = sum(v == "prefill" for v in phases.values())
        if not 1 <= n_p < len(phases):
            return None
        k1 = self.obs.index(now + 1e-9)
        k0 = k1 - self.lookback
        w = self.obs.pooled(k0, k1)
        if w.n == 0:
            return None
        lam = self.obs.arrival_rate(k0, k1)
        order = list(phases)
        counts, mask, p0 = candidate_masks(phases)
        ttft_cur = self._ttft(order, mask[p0 - 1], w, lam)
        if ttft_cur <= self.p.ttft_target_s:
            return None
        backlog = self.backlog(phases)
        metrics = {"arrival_rate": lam, "ttft_current_s": ttft_cur, "backlog_s": backlog, "q_mean": w.q}
        if backlog <= self.p.guard_backlog_share * self.p.ttft_target_s:
            return None  # the rate alone says overload but the queues are short: trust the queues
        k_sus = self.p.guard_sustain_slices
        prev = self._guard_backlogs[-1] if self._guard_backlogs else None
        if prev is not None and backlog < (1.0 - self.p.guard_drain_share) * prev:
            self._guard_backlogs = []  # draining: whatever caused the backlog has ended
        self._guard_backlogs.append(backlog)
        streak = len(self._guard_backlogs)
        metrics["sustained_checks"] = float(streak)
        if streak < k_sus:
            self._decide(
                now,
                "no_switch",
                full,
                None,
                f"SLO guard: predicted TTFT {ttft_cur:.1f}s > {self.p.ttft_target_s:.1f}s and backlog {backlog:.1f}s, "
                f"not yet sustained: {streak} of {k_sus} consecutive slice checks"
                + (f" (the backlog fell from {prev:.1f}s: a burst that ended does not switch)" if prev is not None and streak == 1 else ""),
                metrics=metrics,
            )
            return None
        table = self.table(order)
        mu_p = table.prefill_rates([w])[:, 0]
        cap_d = table.decode_capacity(w.t_out, self.max_batch)
        d_counts = len(order) - counts
        mu_d = table.decode_rates([w], d_counts, self.max_batch)
        th = theta(mask, mu_p[:, None], mu_d)[:, 0]
        lat = None
        if self.p.objective == "latency":  # the reversal goes to the passing split with the lowest predicted mean latency
            scv = table.prefill_scv([w])
            lat = mean_latencies(mask, mu_p[:, None], mu_d, np.array([lam]), np.array([w.q]), d_counts, self.max_batch, scv=scv)[:, 0]
        cands: list[CandidateGain] = []
        target_p: int | None = None
        best_lat = math.inf
        for j, p in enumerate(counts):
            if p <= p0:
                continue
            t = ttft_quantile(mu_p[mask[j]], lam, self.p.ttft_quantile)
            dec_ok = float(cap_d[~mask[j]].sum()) >= lam
            th_ok = th[j] >= (1.0 - self.p.guard_max_theta_loss) * th[p0 - 1]
            veto = "" if (t <= self.p.ttft_target_s and dec_ok and th_ok) else (
                "TTFT target not met" if t > self.p.ttft_target_s else ("decode cannot sustain λ" if not dec_ok else "Θ loss too large")
            )
            cands.append(
                CandidateGain(
                    prefill_nodes=int(p),
                    split=f"{p}P{len(order) - p}D",
                    mean_gain=float(th[j] - th[p0 - 1]),
                    qualifies=not veto,
                    changes=int(p - p0),
                    ttft_p95_s=float(t),
                    vetoed=veto,
                    theta=float(th[j]),
                    latency_s=float(lat[j]) if lat is not None else None,
                )
            )
            if veto:
                continue
            if lat is None:  # throughput objective: the smallest p that passes
                target_p = int(p)
                break
            if lat[j] < best_lat:
                target_p, best_lat = int(p), float(lat[j])
        if target_p is None:
            self._decide(
                now,
                "no_switch",
                full,
                None,
                f"SLO guard: predicted TTFT {ttft_cur:.1f}s > {self.p.ttft_target_s:.1f}s but no split with more prefill nodes meets it",
                candidates=cands,
                metrics=metrics,
            )
            return None
        target = self.assign_live(full, target_p)
        self.expected = dict(target)
        self.last_switch_at = now
        return self._decide(
            now,
            "switch",
            full,
            target,
            f"SLO guard: predicted P{round(self.p.ttft_quantile * 100)} TTFT {ttft_cur:.1f}s > {self.p.ttft_target_s:.1f}s "
            f"and backlog {backlog:.1f}s; reverse to {split_name(target)}" + _dead_note(self.dead),
            candidates=cands,
            metrics=metrics,
        )

    # -- outputs -------------------------------------------------------------- #

    def models(self) -> PlannerModels:
        """The models in force (profile values before the freeze), for ``planner.models``."""
        return PlannerModels(
            models=[
                NodeModels(
                    node=n,
                    prefill=st.prefill,
                    decode=st.decode,
                    mean_chunk_tokens=st.mean_chunk_tokens,
                    restored_share=st.restored_share,
                    samples=st.samples,
                    source=st.source,  # type: ignore[arg-type]
                    fit_error=st.fit_error,
                )
                for n, st in self.state.items()
            ],
            fitted_at=self.frozen_at or 0.0,
            frozen=self.frozen,
        )

    @property
    def models_version(self) -> int:
        """Grows whenever the models change (fit, re-measurement): publish when it moved."""
        return self._models_seq


def _pool(w: Sequence[SliceStats]) -> SliceStats:
    """Request-weighted pool of slices (q̄ averaged over slices)."""
    n = sum(s.n for s in w)
    if n == 0:
        return SliceStats(0, 0.0, 0.0, 0.0, 0.0, float(np.mean([s.q for s in w])) if w else 0.0, 0.0,
                          float(np.mean([s.queued for s in w])) if w else 0.0)
    return SliceStats(
        n,
        sum(s.t_uc * s.n for s in w) / n,
        sum(s.t_c * s.n for s in w) / n,
        sum(s.qk * s.n for s in w) / n,
        sum(s.t_out * s.n for s in w) / n,
        float(np.mean([s.q for s in w])),
        sum(s.prompt * s.n for s in w) / n,
        float(np.mean([s.queued for s in w])),
        tuple(sum(s.moments2[i] * s.n for s in w) / n for i in range(6)) if all(s.moments2 for s in w) else (),
    )


__all__ = ["EvolvingParams", "EvolvingPlanner", "SplitError"]
