"""Building blocks of the workload generators: id allocation, branches, samplers, target checks.

Every generator owns one ``numpy.random.default_rng(seed)`` and draws in a
fixed order, so the same seed and options give the same trace, byte for byte.
Rates of rare events (sub-agent spawns, compactions) use :class:`RateEvents`,
a renewal process whose gaps are ``U(1−j, 1+j)/rate`` steps: the count over N
steps is within about ±1 of ``N·rate`` (a Bernoulli draw per step would be
±√(N·rate)), so a calibration target holds on a modest number of agents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from evolving_infra.traces.schema import FORMAT, VERSION, TraceHeader, TraceRequest
from evolving_infra.traces.tokens import PRIVATE_ID_BASE

__all__ = [
    "Branch",
    "GenerateError",
    "IdPool",
    "QuantileTable",
    "RateEvents",
    "Target",
    "check_targets",
    "check_trace_targets",
    "targets_from_meta",
    "lognormal",
    "make_header",
    "stat_at",
]


class GenerateError(ValueError):
    """Invalid generator options."""


@dataclass(frozen=True, slots=True)
class Target:
    """A calibration target checked through ``trace stats``: ``stats[key] ≈ value`` within ``rel`` (or ``abs_tol``)."""

    key: str
    """Dotted path into the stats dict, e.g. ``pause_s.mean``."""
    value: float
    source: str
    """Where the number comes from (paper section / figure / DESIGN §6a / fitted / assumption)."""
    rel: float = 0.10
    abs_tol: float = 0.0
    subset: str = ""
    """Agent id prefix: the stats are those of the agents whose id starts with it ("" = all)."""

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "value": self.value, "source": self.source, "rel_tol": self.rel}
        if self.abs_tol:
            d["abs_tol"] = self.abs_tol
        if self.subset:
            d["subset"] = self.subset
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Target:
        return cls(d["key"], float(d["value"]), d.get("source", ""), float(d.get("rel_tol", 0.10)), float(d.get("abs_tol", 0.0)), d.get("subset", ""))


def stat_at(stats: dict[str, Any], key: str) -> float:
    """``stats["a"]["b"]`` for ``key = "a.b"``.

    Raises:
        KeyError: the path does not exist.
    """
    cur: Any = stats
    for part in key.split("."):
        cur = cur[part]
    return float(cur)


def check_targets(stats: dict[str, Any], targets: Sequence[Target]) -> list[tuple[Target, float, bool]]:
    """(target, actual, ok) for every target; ok when ``|actual − value| ≤ max(rel·|value|, abs_tol)``."""
    out = []
    for t in targets:
        actual = stat_at(stats, t.key)
        ok = abs(actual - t.value) <= max(t.rel * abs(t.value), t.abs_tol)
        out.append((t, actual, ok))
    return out


def check_trace_targets(trace, targets: Sequence[Target]) -> list[tuple[Target, float, bool]]:  # type: ignore[no-untyped-def]
    """:func:`check_targets` with each target's stats computed on its agent subset of ``trace``."""
    from evolving_infra.traces.io import Trace
    from evolving_infra.traces.stats import trace_stats

    cache: dict[str, dict[str, Any]] = {}
    out = []
    for t in targets:
        if t.subset not in cache:
            sub = trace if not t.subset else Trace(trace.header, [r for r in trace.requests if r.agent.startswith(t.subset)])
            cache[t.subset] = trace_stats(sub)
        out.extend(check_targets(cache[t.subset], [t]))
    return out


def targets_from_meta(meta: dict[str, Any]) -> list[Target]:
    """The targets a generator wrote into its header (``meta["targets"]``)."""
    return [Target.from_dict(d) for d in meta.get("targets", [])]


def lognormal(rng: np.random.Generator, mean: float, sigma: float) -> float:
    """One draw from a lognormal with the given *mean* (not median) and log-space sigma."""
    mu = np.log(mean) - sigma * sigma / 2.0
    return float(rng.lognormal(mu, sigma))


class QuantileTable:
    """Inverse-CDF sampler of an empirical distribution given by quantile levels and values.

    ``sample(rng)`` draws ``u ~ U(0, 1)`` and interpolates linearly between the
    stored quantiles (``levels`` in [0, 1], increasing; ``values`` non-decreasing).
    """

    __slots__ = ("levels", "values")

    def __init__(self, levels: Sequence[float], values: Sequence[float]):
        if len(levels) != len(values) or len(levels) < 2:
            raise ValueError("a quantile table needs matching levels and values (at least 2)")
        self.levels = np.asarray(levels, dtype=np.float64)
        self.values = np.asarray(values, dtype=np.float64)
        if self.levels[0] != 0.0 or self.levels[-1] != 1.0 or np.any(np.diff(self.levels) <= 0):
            raise ValueError("levels must increase from 0 to 1")
        if np.any(np.diff(self.values) < 0):
            raise ValueError("values must be non-decreasing")

    @classmethod
    def from_dict(cls, d: dict[str, Sequence[float]]) -> QuantileTable:
        return cls(d["levels"], d["values"])

    def sample(self, rng: np.random.Generator) -> float:
        return float(np.interp(rng.random(), self.levels, self.values))

    def mean(self) -> float:
        """Mean of the piecewise-linear distribution (exact)."""
        lv, v = self.levels, self.values
        return float(np.sum(np.diff(lv) * (v[1:] + v[:-1]) / 2.0))


class RateEvents:
    """Events at ``rate`` per eligible step with low count variance (module docstring).

    Call :meth:`step` once per eligible step; it returns True when an event falls there.
    """

    __slots__ = ("_carry", "_jitter", "_next", "_rng", "rate")

    def __init__(self, rate: float, rng: np.random.Generator, jitter: float = 0.25):
        if rate < 0 or not 0 <= jitter < 1:
            raise ValueError("rate must be >= 0 and jitter in [0, 1)")
        self.rate = rate
        self._rng = rng
        self._jitter = jitter
        self._next = self._gap()
        self._carry = float(rng.random()) * self._next  # random phase of the first event

    def _gap(self) -> float:
        j = self._jitter
        return float(self._rng.uniform(1.0 - j, 1.0 + j))

    def step(self) -> bool:
        if self.rate <= 0:
            return False
        self._carry += self.rate
        if self._carry >= self._next:
            self._carry -= self._next
            self._next = self._gap()
            return True
        return False


class Deck:
    """Values dealt in shuffled rounds with exact frequencies (e.g. sub-agent fan-out)."""

    __slots__ = ("_cards", "_i", "_rng")

    def __init__(self, counts: dict[int, int], rng: np.random.Generator):
        cards = [v for v, c in sorted(counts.items()) for _ in range(c)]
        if not cards:
            raise ValueError("empty deck")
        self._cards = cards
        self._rng = rng
        self._i = len(cards)

    def draw(self) -> int:
        if self._i >= len(self._cards):
            self._rng.shuffle(self._cards)
            self._i = 0
        v = self._cards[self._i]
        self._i += 1
        return v


class IdPool:
    """Block ids of one generated trace: fresh sequential ids and named shared prefixes.

    Shared prefixes (a system prompt every agent of a workload sends) get ids
    from the same counter the first time they are needed and are reused after
    that, extended on demand; position ``j`` of prefix ``name`` always has the
    same id.
    """

    __slots__ = ("_next", "_shared")

    def __init__(self) -> None:
        self._next = 0
        self._shared: dict[str, list[int]] = {}

    def fresh(self, n: int) -> list[int]:
        if n <= 0:
            return []
        start = self._next
        self._next += n
        if self._next > PRIVATE_ID_BASE:
            raise GenerateError("block id space exhausted")
        return list(range(start, start + n))

    def shared(self, name: str, n: int) -> list[int]:
        pool = self._shared.setdefault(name, [])
        if len(pool) < n:
            pool.extend(self.fresh(n - len(pool)))
        return pool[:n]


class Branch:
    """One generated context: its block path and token length, and the requests it issued.

    The partial tail is private to each request (replay: ``tokens_for_tail``),
    so when the context grows the block that completes the old tail gets a fresh id.
    """

    __slots__ = ("agent", "bid", "blocks", "bs", "ids", "kind", "n", "parent", "pool", "tokens")

    def __init__(self, pool: IdPool, bs: int, agent: str, bid: str, kind: str, parent: str | None, prefix: list[int], tokens: int):
        if tokens < 1:
            raise GenerateError("a context needs at least one token")
        self.pool = pool
        self.bs = bs
        self.agent = agent
        self.bid = bid
        self.kind = kind
        self.parent = parent
        self.tokens = tokens
        full = tokens // bs
        self.blocks = list(prefix[:full]) + pool.fresh(full - min(len(prefix), full))
        self.n = 0
        self.ids: list[str] = []

    def extend(self, add_tokens: int) -> None:
        """Append ``add_tokens`` new tokens to the context."""
        if add_tokens <= 0:
            return
        self.tokens += add_tokens
        full = self.tokens // self.bs
        if full > len(self.blocks):
            self.blocks.extend(self.pool.fresh(full - len(self.blocks)))

    def rewrite(self, keep_tokens: int, new_tokens: int) -> None:
        """Replace the context after its first ``keep_tokens`` by fresh content, ``new_tokens`` long in total."""
        new_tokens = max(1, new_tokens)
        keep = min(keep_tokens, new_tokens) // self.bs
        self.tokens = new_tokens
        full = new_tokens // self.bs
        self.blocks = self.blocks[:keep] + self.pool.fresh(full - keep)

    def request(self, output_tokens: int, after: list[str], pause_s: float, *, compaction: bool = False) -> TraceRequest:
        """The request this context sends now (``ends_branch`` is fixed by :func:`finish_branches`)."""
        rid = f"{self.bid}:{self.n}"
        first = self.n == 0
        self.n += 1
        self.ids.append(rid)
        return TraceRequest(
            id=rid,
            agent=self.agent,
            branch=self.bid,
            input_tokens=self.tokens,
            output_tokens=max(1, int(output_tokens)),
            blocks=list(self.blocks),
            kind=self.kind if first else None,  # type: ignore[arg-type]
            parent_branch=self.parent if first else None,
            after=list(after),
            pause_s=round(max(0.0, float(pause_s)), 3),
            compaction=compaction,
        )


def finish_branches(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Set ``ends_branch`` on the last request of every branch (and only there)."""
    last: dict[str, int] = {}
    for i, r in enumerate(requests):
        last[r.branch] = i
    return [r if r.ends_branch == (last[r.branch] == i) else msgspec.structs.replace(r, ends_branch=last[r.branch] == i) for i, r in enumerate(requests)]


def make_header(kind: str, *, block_size: int, seed: int, options: dict[str, Any], targets: Sequence[Target], parameters: dict[str, Any], description: str, extra: dict[str, Any] | None = None) -> TraceHeader:
    meta: dict[str, Any] = {
        "generator": kind,
        "seed": seed,
        "options": options,
        "parameters": parameters,
        "targets": [t.as_dict() for t in targets],
    }
    if extra:
        meta.update(extra)
    return TraceHeader(
        format=FORMAT,
        version=VERSION,
        block_size=block_size,
        source=f"generate {kind} --seed {seed}",
        description=description,
        meta=meta,
    )


def agent_budget(
    rng: np.random.Generator,
    *,
    duration_s: float | None,
    requests_per_agent: int | None,
    task_length: Callable[[np.random.Generator], int],
) -> tuple[int | None, float | None]:
    """(fixed request count, busy-time budget) for one agent from the generator options."""
    if requests_per_agent is not None:
        if requests_per_agent < 1:
            raise GenerateError("--requests-per-agent must be >= 1")
        return requests_per_agent, None
    if duration_s is not None:
        if duration_s <= 0:
            raise GenerateError("--duration must be > 0")
        return None, duration_s
    return max(1, task_length(rng)), None


def check_common_options(agents: int, block_size: int) -> None:
    if agents < 1:
        raise GenerateError("--agents must be >= 1")
    if block_size < 1:
        raise GenerateError("--block-size must be >= 1")
