"""Routing metrics: request latencies, TTFT prediction error, per-node queue time (sans-IO).

This module contains zero I/O and does not import ``prometheus_client``: it
records into :class:`Histogram` buckets; the router shell exports them as
Prometheus histograms at scrape time (``services/router/prom.py``, ``GET
/metrics``) and a summary through ``stats()`` (``svc.stats.router``). The
simulator can read the same object.

* **request latencies** (:meth:`RouteMetrics.observe_request`, fed by the shell,
  simulated seconds): TTFT = HTTP arrival → first output chunk at the router,
  E2E = HTTP arrival → last chunk, TPOT = (E2E − TTFT) / (output tokens − 1).
* **inter-token latency** (:meth:`RouteMetrics.observe_chunk_tokens`, simulated seconds): per output
  token after a request's first, the gap since the previous output chunk reached the router divided
  evenly over the chunk's tokens (a chunk of k tokens after a gap g gives k samples of g/k; tokens that
  came in the first chunk with the first token give 0). Over a request the samples sum to E2E − TTFT
  and number output tokens − 1, so their mean is its TPOT (vLLM's ``inter_token_latency_seconds``).
* **generation tokens** (:meth:`RouteMetrics.observe_delivered`): output tokens given to clients,
  counted as they are sent (``usage.completion_tokens`` of a finished response; a stream that
  fails or whose client leaves counts what was sent).
* **sequence lengths** (Dynamo's ``dynamo_frontend_input_sequence_tokens`` /
  ``..._output_sequence_tokens``, vLLM's ``request_prompt_tokens`` / ``request_generation_tokens``):
  :attr:`RouteMetrics.isl`, a request's prompt tokens (its ``usage.prompt_tokens``) when its first
  output token arrives (:meth:`RouteMetrics.observe_first_token`), and :attr:`RouteMetrics.osl`, a
  served request's output tokens (the client's count) when its end is counted (:meth:`RouteMetrics.observe_served`),
  in :data:`ISL_EDGES_TOKENS` / :data:`OSL_EDGES_TOKENS` buckets.
* **TTFT prediction error**: predicted TTFT (the policy's, from the decision
  to the end of the prefill) minus the measured one (decision → the first
  chunk's ``ts`` on the worker), both in simulated seconds. The absolute
  error goes into a fixed-bucket histogram (``/metrics``:
  ``ei_router_ttft_prediction_abs_error_seconds``; ``stats()``: ``.count``,
  ``.sum``, and the median / p95 over the last ``window`` samples as gauges).
* **queue time per prefill node**: ``TokenChunk.queue_s`` of each first
  chunk (arrival on the node → its first prefill chunk), per node: count,
  mean, p95 (window), max; and ``prefill_queue_imbalance`` = the largest
  per-node mean over the mean of the per-node means (paper App. C.3: "the most
  loaded prefill node queues requests 1.75–1.85× as long as the average
  node").
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence

from shared.values import StructValue

ABS_ERR_EDGES_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Bucket upper bounds (s) of the TTFT prediction error histogram (+Inf implied)."""

QUEUE_EDGES_S: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Bucket upper bounds (s) of the per-node queue time histograms (+Inf implied)."""

LATENCY_EDGES_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Bucket upper bounds (s) of the TTFT and E2E histograms (+Inf implied)."""

TPOT_EDGES_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
"""Bucket upper bounds (s) of the time-per-output-token histogram (+Inf implied)."""


ISL_EDGES_TOKENS: tuple[float, ...] = (
    64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 49152, 65536, 98304, 131072, 196608, 262144,
)
"""Bucket upper bounds (tokens) of the input sequence length histogram (+Inf implied): fine from 1k to 64k, where
agent prompts (a session's growing context) sit, on to 256k context windows."""

OSL_EDGES_TOKENS: tuple[float, ...] = (
    1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144,
)
"""Bucket upper bounds (tokens) of the output sequence length histogram (+Inf implied): an agent's turn is mostly a
tool call or a short answer (tens to hundreds of tokens), a reasoning one up to tens of thousands."""


def _fmt_edge(x: float) -> str:
    return f"{x:g}"


class Histogram:
    """Fixed buckets over all samples plus exact quantiles over the last ``window`` samples.

    Args:
        edges: increasing bucket upper bounds; a sample ``x`` falls in the first
            bucket with ``x <= edge`` (or the implied +Inf bucket).
        window: samples kept for quantiles (>= 1).

    Raises:
        ValueError: if ``edges`` is not strictly increasing or ``window`` < 1.
    """

    __slots__ = ("edges", "counts", "count", "sum", "max", "recent")

    def __init__(self, edges: Sequence[float], window: int = 10_000) -> None:
        if any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError("histogram edges must be strictly increasing")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.edges = tuple(edges)
        self.counts = [0] * (len(self.edges) + 1)
        self.count = 0
        self.sum = 0.0
        self.max = 0.0
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, x: float, n: int = 1) -> None:
        """Add ``n`` samples of value ``x`` (NaN, or ``n`` < 1, is ignored)."""
        if math.isnan(x) or n < 1:
            return
        self.counts[bisect.bisect_left(self.edges, x)] += n
        self.count += n
        self.sum += x * n
        if x > self.max or self.count == n:
            self.max = x
        self.recent.extend((x,) * min(n, self.recent.maxlen or n))

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Exact ``q``-quantile (nearest rank, lower median for even counts) of the recent window; None when empty."""
        if not self.recent:
            return None
        xs = sorted(self.recent)
        i = min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))
        return xs[i]

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), ...]`` including ``+Inf``."""
        out: list[tuple[str, int]] = []
        acc = 0
        for edge, c in zip(self.edges, self.counts):
            acc += c
            out.append((_fmt_edge(edge), acc))
        out.append(("inf", acc + self.counts[-1]))
        return out


class TtftSample(StructValue):
    """One request's first token as the metrics saw it (simulated seconds).

    Read-only once built. Not ``frozen=True`` (nothing hashes it; equality is unchanged): one is
    built per request, and a frozen dataclass's ``__init__`` (``object.__setattr__`` per
    field) costs ~3x this one.
    """

    rid: str
    node: str
    predicted_s: float | None
    measured_s: float | None
    queue_s: float | None

    @property
    def error_s(self) -> float | None:
        """predicted − measured (None unless both are known)."""
        if self.predicted_s is None or self.measured_s is None:
            return None
        return self.predicted_s - self.measured_s


class RouteMetrics:
    """TTFT prediction error and per-node queue time.

    Args:
        window: recent samples kept per histogram for quantiles.
    """

    def __init__(self, window: int = 10_000) -> None:
        self.window = window
        self.ttft = Histogram(LATENCY_EDGES_S, window)
        """Measured TTFT per request (s): HTTP arrival → first output chunk."""
        self.tpot = Histogram(TPOT_EDGES_S, window)
        """Time per output token after the first (s); requests with one output token are not counted."""
        self.e2e = Histogram(LATENCY_EDGES_S, window)
        """End-to-end latency of a served request (s): HTTP arrival → last chunk."""
        self.itl = Histogram(TPOT_EDGES_S, window)
        """Inter-token latency (s): one sample per output token after the first (:meth:`observe_chunk_tokens`)."""
        self.isl = Histogram(ISL_EDGES_TOKENS, window)
        """Input sequence length (prompt tokens) per request that got a first token."""
        self.osl = Histogram(OSL_EDGES_TOKENS, window)
        """Output sequence length (output tokens the client got) per served request (:meth:`observe_served`)."""
        self.prompt_tokens = 0
        """Σ prompt tokens of requests that got a first token."""
        self.generation_tokens = 0
        """Σ output tokens sent to clients (:meth:`observe_delivered`)."""
        self.cached_tokens = 0
        """Σ of those prompt tokens whose KV was reused (local or fetched) instead of computed."""
        self.ttft_abs_err = Histogram(ABS_ERR_EDGES_S, window)
        self.ttft_signed_err_sum = 0.0
        self.ttft_over = 0
        """Predictions above the measured TTFT."""
        self.queue: dict[str, Histogram] = {}

    def observe(self, sample: TtftSample) -> None:
        """Account one first token (missing parts are skipped)."""
        err = sample.error_s
        if err is not None:
            self.ttft_abs_err.observe(abs(err))
            self.ttft_signed_err_sum += err
            if err > 0:
                self.ttft_over += 1
        if sample.queue_s is not None and sample.queue_s >= 0:
            h = self.queue.get(sample.node)
            if h is None:
                h = self.queue[sample.node] = Histogram(QUEUE_EDGES_S, self.window)
            h.observe(sample.queue_s)

    def observe_first_token(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first output chunk: its TTFT (s), its prompt (tokens, also one :attr:`isl` sample) and how
        much of it was cached (tokens)."""
        self.ttft.observe(ttft_s)
        self.isl.observe(float(max(0, prompt_tokens)))
        self.prompt_tokens += max(0, prompt_tokens)
        self.cached_tokens += max(0, min(cached_tokens, prompt_tokens))

    def observe_finished(self, ttft_s: float, e2e_s: float, output_tokens: int) -> None:
        """A served request's last chunk: E2E (s) and, with more than one output token, TPOT (s/token)."""
        self.e2e.observe(e2e_s)
        if output_tokens > 1:
            self.tpot.observe(max(0.0, e2e_s - ttft_s) / (output_tokens - 1))

    def observe_served(self, output_tokens: int) -> None:
        """A served request ended (finish reason ``stop`` / ``length``, counted once) with ``output_tokens`` output
        tokens, the client's count (its ``usage.completion_tokens``; a stop string matched at the router cuts it):
        one :attr:`osl` sample."""
        self.osl.observe(float(max(0, output_tokens)))

    def observe_chunk_tokens(self, gap_s: float | None, tokens: int) -> None:
        """An output chunk of ``tokens`` tokens reached the router ``gap_s`` seconds after the request's
        previous one with tokens (None: it is the first, whose first token is the TTFT): ``tokens`` samples
        of ``gap_s / tokens`` in :attr:`itl`, or ``tokens − 1`` samples of 0 for the first chunk."""
        if tokens < 1:
            return
        if gap_s is None:
            self.itl.observe(0.0, tokens - 1)
        else:
            self.itl.observe(max(0.0, gap_s) / tokens, tokens)

    def observe_delivered(self, tokens: int) -> None:
        """``tokens`` output tokens were sent to a client (a response body, or a stream's data chunk)."""
        self.generation_tokens += max(0, tokens)

    @property
    def kv_hit_rate(self) -> float | None:
        """Σ cached / Σ prompt tokens over first tokens (None before any)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def queue_imbalance(self) -> float | None:
        """Largest per-node mean queue time over the mean of the per-node means (None without samples or all zero)."""
        means = [h.mean for h in self.queue.values() if h.count]
        if not means:
            return None
        avg = sum(means) / len(means)  # type: ignore[arg-type]
        if avg <= 0:
            return None
        return max(means) / avg  # type: ignore[type-var, operator]

    def export(self) -> tuple[dict[str, int], dict[str, float]]:
        """Counters and gauges for ``stats()`` (names in the module docstring)."""
        counters: dict[str, int] = {}
        gauges: dict[str, float] = {}
        for name, lat in (("ttft_s", self.ttft), ("tpot_s", self.tpot), ("e2e_s", self.e2e), ("itl_s", self.itl)):
            if lat.count:
                counters[f"{name}.count"] = lat.count
                gauges[f"{name}.p50"] = lat.quantile(0.5) or 0.0
                gauges[f"{name}.p95"] = lat.quantile(0.95) or 0.0
        if self.kv_hit_rate is not None:
            gauges["kv_hit_rate"] = self.kv_hit_rate
        h = self.ttft_abs_err
        if h.count:
            counters["ttft_pred_abs_err_s.count"] = h.count
            counters["ttft_pred_over"] = self.ttft_over
            gauges["ttft_pred_abs_err_s.sum"] = h.sum
            gauges["ttft_pred_abs_err_s.median"] = h.quantile(0.5) or 0.0
            gauges["ttft_pred_abs_err_s.p95"] = h.quantile(0.95) or 0.0
            gauges["ttft_pred_err_s.mean_signed"] = self.ttft_signed_err_sum / h.count
        for node, q in sorted(self.queue.items()):
            counters[f"queue_s.count.{node}"] = q.count
            gauges[f"queue_s.mean.{node}"] = q.mean or 0.0
            gauges[f"queue_s.p95.{node}"] = q.quantile(0.95) or 0.0
            gauges[f"queue_s.max.{node}"] = q.max
        imb = self.queue_imbalance()
        if imb is not None:
            gauges["prefill_queue_imbalance"] = imb
        return counters, gauges
