"""A node without a bus: the scheduler core and the torch engine driven in one process.

Sans-IO like the core: time is the sum of the engine's measured iteration
times (s), never a sleep. Used by the engine's correctness tests and by
``bench/engine_bench.py``; the live worker (``services/worker/service.py``)
drives the same two objects over NATS with the same calls in the same order:
``schedule`` → drain KV events into the engine → ``execute`` →
``finish_iteration`` → read output tokens → drain KV events into the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.messages import DecodeWork, IterationRecord, PrefillWork
from shared.profile import Profile
from services.worker.engines.torch_engine.engine import TorchEngine
from services.worker.plan import HandOff, TokensOut
from services.worker.scheduler import EngineScheduler


@dataclass(slots=True)
class Finished:
    """A request's complete result on the node that finished it."""

    rid: str
    tokens: list[int]
    """Output token ids, all positions from the work's ``output_offset`` on (a decode node's
    include the prefill node's first token)."""
    cached_tokens: int
    """Prompt tokens served from cache where its prefill ran (L1 hit + L2 restore)."""
    finish_reason: str | None = None
    """``length`` (max_tokens) or ``stop`` (the model's EOS token)."""
    logprobs: dict[int, tuple[float, list[int], list[float]]] | None = None
    """With ``Sampling.logprobs``: the logprobs this node computed, by index into ``tokens``
    (a decode node's lack index 0, the prefill node's token); None when not asked."""


@dataclass
class LocalNode:
    """One node: :class:`EngineScheduler` + :class:`TorchEngine`, with full invariant checks.

    Args:
        node: node id; profile: its profile; model_dir: the model folder;
        phase: ``prefill``, ``decode`` or ``both``; check: full invariants after every step;
        device, dtype: as :class:`TorchEngine`.
    """

    node: str
    profile: Profile
    model_dir: str
    phase: str = "both"
    check: bool = True
    device: str | None = None
    """``cpu``/``cuda``; None = cuda when present."""
    dtype: str | None = None
    """None = float32 on CPU, bfloat16 on CUDA."""
    clock: Callable[[], float] = time.perf_counter
    """What the engine measures iterations with (see :class:`TorchEngine`)."""
    external_fetch: bool = False
    """Real-bytes fetches (``EngineScheduler``'s ``external_fetch``): the caller moves each
    fetch's bytes (``TorchEngine.put_fetched``) and reports it (``core.fetch_done``)."""
    now: float = 0.0
    core: EngineScheduler = field(init=False)
    engine: TorchEngine = field(init=False)
    handoffs: list[HandOff] = field(default_factory=list)
    """Hand-offs this node produced; their ``work.kv`` carries the prompt's K/V."""
    finished: dict[str, Finished] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    records: list[IterationRecord] = field(default_factory=list)
    handoff_logprobs: dict[str, dict[int, tuple[float, list[int], list[float]]]] = field(default_factory=dict)
    """With ``Sampling.logprobs``: the logprobs of each handed-off request's first token (index 0)."""
    offsets: dict[str, int] = field(default_factory=dict)
    """``output_offset`` of each request's work (a re-dispatched continuation's first position)."""

    def __post_init__(self) -> None:
        self.core = EngineScheduler(
            self.node, self.profile, self.phase, check_invariants=self.check, external_fetch=self.external_fetch  # type: ignore[arg-type]
        )
        self.engine = TorchEngine(self.profile, self.model_dir, dtype=self.dtype, device=self.device, check=self.check, clock=self.clock)
        self._drain()

    def _drain(self) -> None:
        """KV events into the engine, then the bytes of the fetches that ended let go (as the worker)."""
        self.engine.on_kv_events(self.core.take_kv_events(), self.core.requests, self.core.snapshot)
        for fetch_id in self.core.take_fetch_ends():
            self.engine.drop_fetched(fetch_id)

    def add_prefill(self, work: PrefillWork) -> None:
        """Queue prefill work (raises WorkRejected / ValueError as the scheduler / engine do)."""
        self.engine.accept_prefill(work)
        self.core.add_prefill(work, self.now)
        self.offsets[work.rid] = work.output_offset

    def add_decode(self, work: DecodeWork) -> None:
        """Accept a hand-off carrying its prompt K/V (``TorchEngine.handoff`` of the prefill node)."""
        self.engine.accept_decode(work)
        self.core.add_decode(msgspec_replace(work, kv_ready_at=self.now), self.now)
        self.offsets[work.rid] = work.output_offset

    def step(self) -> bool:
        """Run one plan; False when there is nothing to run."""
        plan = self.core.schedule(self.now)
        self._drain()
        if plan is None:
            return False
        self.engine.execute(plan)
        self.now = plan.end
        outs = self.core.finish_iteration(plan, self.now, self.engine.take_stopped())
        for o in outs:
            if isinstance(o, TokensOut):
                if o.index == 0:
                    self.cached[o.rid] = o.cached_tokens
                if o.finished:
                    toks = self.engine.output_tokens(o.rid, self.offsets.get(o.rid, 0), o.index + o.count)
                    lps = self.engine.seqs[o.rid].lps
                    self.finished[o.rid] = Finished(
                        o.rid, toks, self.cached.get(o.rid, 0), o.finish_reason, None if lps is None else dict(lps)
                    )
            elif isinstance(o, HandOff):
                lps = self.engine.seqs[o.rid].lps
                if lps is not None:
                    self.handoff_logprobs[o.rid] = dict(lps)
                self.handoffs.append(HandOff(o.rid, o.decode_node, self.engine.handoff(o.work), o.at))
        self.records.extend(self.core.take_records())
        self._drain()
        return True

    def run(self, max_steps: int = 100_000) -> None:
        """Step until idle (or ``max_steps``): when no plan can run now but a hand-off's KV or a
        fetch is due later (``EngineScheduler.next_deadline``, e.g. a decode reservation granted
        when another request ended: ready after its transfer time), the clock moves on to it."""
        for _ in range(max_steps):
            if self.step():
                continue
            due = self.core.next_deadline()
            if due is None:
                return
            self.now = max(self.now, due)


def msgspec_replace(work: DecodeWork, **kw: object) -> DecodeWork:
    import msgspec

    return msgspec.structs.replace(work, **kw)
