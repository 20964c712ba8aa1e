"""The engine interface the worker shell drives (DESIGN §5).

Contains zero decision logic: what to run is decided by the scheduler core
(``services.worker.scheduler.EngineScheduler``); an engine only executes a
plan and says how long it took and which tokens it produced. The ``sim``
engine (``engines/sim.py``) answers from the hardware/model profile; a GPU
engine would run the forward pass of the plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from typing import Any

from shared.messages import DecodeWork, KvEvent, PrefillWork
from services.worker.plan import IterationPlan


class EngineFatal(RuntimeError):
    """The engine's state can no longer be trusted (an invariant of its KV broke): the node must
    not serve another token from it. The worker stops and exits non-zero, so its supervisor
    (``up``, the compose / sbatch restart policies) restarts it with empty KV, and the router
    re-dispatches its in-flight requests (as vLLM's EngineCore dies on an exception in its busy
    loop, ``EngineDeadError``, and SGLang's scheduler SIGQUITs its server).

    Any other exception out of the engine's ``execute`` or hooks ends the node the same way (the
    shell cannot know what the engine applied of the plan or batch), except from
    :meth:`Engine.accept_prefill` / :meth:`Engine.accept_decode`, which fails only that request."""


class Engine(ABC):
    """One model replica that executes iteration plans."""

    name: str = ""
    """Engine kind reported in ``NodeState.engine`` (``sim``)."""
    threaded: bool = False
    """True if the shell should run :meth:`execute` in a worker thread (a real forward pass:
    the event loop keeps serving heartbeats and inputs meanwhile)."""
    simulated: bool = True
    """True if executing a plan takes no wall time: the shell then waits until the
    plan's end on the simulated clock (``plan.start + duration``, waited for on the clock's
    monotonic reading: ``WorkerService._wait_for_plan_end``)."""

    @abstractmethod
    def execute(self, plan: IterationPlan) -> float:
        """Execute ``plan`` and return its duration in simulated seconds (all
        ``plan.iterations`` iterations together)."""

    @abstractmethod
    def output_tokens(self, rid: str, start: int, count: int) -> list[int]:
        """Token ids of request ``rid`` at output positions ``[start, start + count)``
        that the last executed plans produced."""

    def output_logprobs(self, rid: str, start: int, count: int) -> list[tuple[float, list[int], list[float]]] | None:
        """Log-probabilities of the tokens :meth:`output_tokens` returns for the same arguments,
        one ``(logprob, top_ids, top_logprobs)`` per token; None when ``rid`` asked for none
        (``Sampling.logprobs``) or the engine has no model (the default)."""
        return None

    # Hooks of engines that hold real KV (the torch engine); the sim engine keeps the defaults.

    def accept_prefill(self, work: PrefillWork) -> None:
        """Called before the scheduler queues ``work``. Raises ValueError to refuse it
        (e.g. a prompt longer than the model's context). An engine that raises (anything)
        must be unchanged: check first, register last; the shell then refuses only this
        request (any other exception is reported to the client as an engine error)."""

    def accept_decode(self, work: DecodeWork) -> None:
        """Called before the scheduler takes a hand-off (``work.kv`` carries K/V bytes
        a real engine needs). Raises ValueError to refuse it; unchanged when it raises, as
        :meth:`accept_prefill`."""

    def on_kv_events(self, events: list[KvEvent], live: Any, snapshot: Any = None) -> None:
        """Every batch of KV events the shell drains (also an empty one), in order;
        ``live`` holds the rids the scheduler still has; ``snapshot()`` returns the
        pools' ``(L1 hashes, L2 hashes)`` (for an engine's invariant check)."""

    def take_stopped(self) -> dict[str, int]:
        """Requests whose last executed plan ended them at an end-of-sequence token, mapped
        to their output count including it (for ``EngineScheduler.finish_iteration``); the
        engine forgets them once taken. The sim engine has no tokens: always empty."""
        return {}

    def handoff(self, work: DecodeWork) -> DecodeWork:
        """The hand-off message to publish for a request whose prefill finished here."""
        return work

    def copy_to_pool(self, pages: list[tuple[int, Any]]) -> list[bool]:
        """Real-bytes pool (``--kv-pool real``, an external-payload pool: an engine whose
        :meth:`pool_slot_bytes` is not 0): copy this engine's L2 bytes of each page ``h`` into its
        ``(h, dst)`` slot (``HostKvPool.claim_events``). Returns, per page, whether L2 holds it. The sim
        engine has no bytes (its pool is synthetic and follows the events itself): none copied."""
        return [False] * len(pages)

    def on_fetched(self, pages: list[tuple[int, Any]], fetch_id: int) -> list[int]:
        """Pages fetched for fetch ``fetch_id`` (``FetchStarted.fetch_id``; fetched, checksum-verified, or
        held already), before the scheduler stores them in L2: ``(h, src)``, ``src`` the pool's pinned slot of
        ``h`` or None when the pool let it go. An engine with real KV takes their bytes and holds them until
        :meth:`drop_fetched`. Returns the pages it could not take (the caller reports them missing); the sim
        engine holds no bytes (none)."""
        return []

    def drop_fetched(self, fetch_id: int) -> int:
        """Fetch ``fetch_id`` ended (stored, not stored, or abandoned): free the bytes it brought that
        no other open fetch holds. Returns the pages freed; the sim engine holds none (0)."""
        return 0

    def fetched_bytes(self) -> int:
        """Bytes of fetched pages held for open fetches (:meth:`on_fetched`); the sim engine: 0."""
        return 0

    def pool_slot_bytes(self) -> int:
        """Bytes of one KV page in this engine's layout (0 = the pool's default slot size)."""
        return 0
