"""The ``torch`` engine: executes the scheduler's iteration plans with a real decoder (DESIGN §5).

Every decision (batching, chunking, admission, which page is cached, evicted,
restored or written through) is the scheduler's; this engine computes what the
plan says and keeps the *physical* KV in step with the scheduler's block pools:

* L1: per layer ``K``/``V`` of ``[gpu_blocks, block_size, kv_heads, head_dim]``
  (:meth:`PagedDecoder.new_cache`); a page is either *hashed* (``page_of[hash]``,
  a cached prompt page the scheduler's L1 pool holds), *private* to one live
  request (its partial prompt page and decode pages), or free.
* L2: a host tensor ``[host_blocks, layers, 2, block_size, kv_heads, head_dim]``
  (``host_slot[hash]``), the real bytes of every block the scheduler's L2 pool holds.

The pools' KV events are the source of truth (:meth:`apply_kv_events`, called
with each batch the shell drains, before the plan runs):

==============================  =============================================================
``BlockStored(gpu, h)``         computed by a request this iteration → that page becomes
                                hashed; else restored from L2 (copy host → page); else the
                                bytes of a hand-off (:meth:`accept_decode`) → page
``BlockStored(host, h)``        write-through: copy L1 page → host slot; else a page fetched
                                from a peer (:meth:`put_fetched`) → host slot
``BlockRemoved(gpu|host, h)``   free the page / the host slot
``AllBlocksCleared``            drop the maps of that tier
==============================  =============================================================

A page computed by two requests in one iteration is stored once; the other
request's private copy is dropped and its block table points at the stored
page (the scheduler deduplicates it the same way). :meth:`check` proves that
the maps equal the pools' contents, every L1 page's bytes equal its L2 copy,
and pages are conserved (hashed + private + free = capacity).

Sampling per request (``PrefillWork.sampling`` / ``DecodeWork.sampling``,
:mod:`.sampling`): greedy (argmax, the default and a temperature below 1e-5) or
temperature / ``top_k`` / ``top_p`` / ``min_p`` sampling, every row of one decode
step with its own parameters; with a ``seed`` the token at output position i is
drawn with a uniform hashed on the host from (seed, i) (SplitMix64, the same bits on
every device), so it does not depend on the batch or on the node that samples it
(see :mod:`.sampling` for the limits); ``logit_bias`` / ``presence_penalty`` / ``frequency_penalty`` /
``repetition_penalty`` / ``min_tokens`` rewrite a request's logits first, from counts kept
per request (:class:`.sampling.TokenStats`, updated with each token). One output token
per decode iteration, so the profile must have ``tokens_per_forward ==
accepted_per_iteration == 1``. A request ends at the model's end-of-sequence token
(``generation_config.json``'s ``eos_token_id``, else ``config.json``'s) unless it
says ``ignore_eos``, and at any of its ``stop_token_ids`` (``ignore_eos`` or not):
the engine reports it (:meth:`TorchEngine.take_stopped`) and the scheduler finishes
it there with ``finish_reason`` ``stop``.

Log-probabilities (``Sampling.logprobs``, :mod:`.logprobs`): for the requests that ask,
``log_softmax`` of the raw float32 logits each token was sampled from (vLLM's
``raw_logprobs``), the chosen token's and the top ``k``, computed at the prefill's first
token and every decode token (:meth:`TorchEngine.output_logprobs`); others cost nothing.
"""

from __future__ import annotations

import functools
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shared.hashing import unpack_tokens
from shared.messages import AllBlocksCleared, BlockRemoved, BlockStored, DecodeWork, KvEvent, PrefillWork, Sampling
from shared.profile import Profile
from services.worker.engines.base import Engine, EngineFatal
from services.worker.engines.torch_engine.model import ModelConfigError, PagedDecoder, SeqBatch, int64_tensor
from services.worker.engines.torch_engine.logprobs import TokenLogprob, token_logprobs
from services.worker.engines.torch_engine.sampling import TokenStats, check_logit_bias, is_greedy, needs_stats, sample, token_stats
from services.worker.plan import IterationPlan


def _locked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a method under the engine's lock: the live shell runs :meth:`TorchEngine.execute`
    in a worker thread (so the event loop keeps publishing heartbeats) while its handlers
    register work and apply KV events. The outermost locked call first applies the
    registrations deferred while the lock was busy (:meth:`TorchEngine._register`), in order."""

    @functools.wraps(fn)
    def wrapper(self: TorchEngine, *args: Any, **kw: Any) -> Any:
        with self._lock:
            return self._run_held(fn, self, *args, **kw)

    return wrapper


def eos_token_ids(model_dir: str | Path, config_eos: list[int]) -> frozenset[int]:
    """The model's end-of-sequence token ids: ``generation_config.json``'s ``eos_token_id``
    (what ``transformers``' ``generate()`` stops at) when the folder has one, else
    ``config.json``'s (``config_eos``). An int or a list; empty when neither names one.

    Raises:
        ModelConfigError: ``generation_config.json`` is unreadable or its ``eos_token_id``
            is not an int or a list of ints.
    """
    import json

    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        try:
            raw = json.loads(path.read_text()).get("eos_token_id")
            if raw is not None:
                return frozenset([int(raw)] if isinstance(raw, int) else [int(x) for x in raw])
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ModelConfigError(f"{path}: unreadable eos_token_id: {e}") from e
    return frozenset(config_eos)


class KvMapError(EngineFatal):
    """The engine's physical KV map disagrees with the scheduler's block pools (a bug): fatal
    for the node (:class:`EngineFatal`), its pages may serve another prompt's K/V."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> torch.device:
    """``cuda`` when a CUDA device is present, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(slots=True)
class _Seq:
    """One request's tokens and block table on this engine."""

    prompt: list[int]
    out: list[int] = field(default_factory=list)
    """Output token ids produced so far (a hand-off arrives with the first one)."""
    table: list[int] = field(default_factory=list)
    """Physical L1 page of each ``block_size`` tokens written so far."""
    own: set[int] = field(default_factory=set)
    """Pages of ``table`` private to this request (not hashed)."""
    incoming: dict[int, torch.Tensor] | None = None
    """Hand-off: KV of every prompt page by page index, ``[layers, 2, block_size, kv_heads, head_dim]``."""
    path: list[int] = field(default_factory=list)
    """Hand-off: the prompt's block hashes (keys of the engine's incoming pages)."""
    computed: int = 0
    """Tokens whose K/V are in ``table``'s pages."""
    offset: int = 0
    """Output position of ``out[0]`` for the client (``output_offset`` of a re-dispatched request)."""
    ignore_eos: bool = False
    """Keep generating past an end-of-sequence token (``PrefillWork.ignore_eos``)."""
    sampling: Sampling | None = None
    """Sampling parameters (``PrefillWork.sampling``); None = greedy."""
    seed: int = 0
    """Seed of the request's draws: ``sampling.seed``, else a random 64-bit one (sampled requests)."""
    stop_ids: frozenset[int] = frozenset()
    """``sampling.stop_token_ids``: the request ends at any of them."""
    stats: TokenStats | None = None
    """Penalty counts / ``min_tokens`` state (:func:`.sampling.token_stats`); None = neither set,
    or not built yet (``stats_from``)."""
    stats_from: bytes | None = None
    """The packed prompt (``<u4``) of a request that needs :attr:`stats` and has none yet: they are
    built when it is first sampled (``_forward``, in the engine's thread), so a queued request holds
    no ``[V]`` tensors on the device and its arrival (on the event loop) does no O(prompt) tensor work."""
    serial: int = 0
    """This registration's number on the engine (:attr:`.model.SeqBatch.seq`): the model reuses a
    decode row's gathered keys only for the same sequence, never for a later one on its freed pages."""
    lps: dict[int, TokenLogprob] | None = None
    """``sampling.logprobs`` asked: the log-probabilities computed here of ``out[i]``, by index
    ``i`` (a hand-off's first token was computed on the prefill node and is not here)."""


@dataclass
class _Fetched:
    """A page fetched from a peer (:meth:`TorchEngine.put_fetched`)."""

    kv: torch.Tensor
    """``[layers, 2, block_size, kv_heads, head_dim]``."""
    holders: set[int]
    """Fetch ids (``FetchStarted.fetch_id``) of the open fetches that brought it."""
    stored: bool = False
    """Copied into L2 at a ``BlockStored(host)``."""


def _seq(prompt: list[int], sp: Sampling | None, **kw: Any) -> _Seq:
    """A :class:`_Seq` with ``sp``'s seed (a random one for an unseeded sampled request) and stop ids."""
    seed = 0
    if not is_greedy(sp):
        assert sp is not None
        seed = sp.seed if sp.seed is not None else secrets.randbits(64)
    stop = frozenset(sp.stop_token_ids) if sp is not None and sp.stop_token_ids else frozenset()
    lps: dict[int, TokenLogprob] | None = {} if sp is not None and sp.logprobs is not None else None
    if not needs_stats(sp):
        kw.pop("stats_from", None)
    return _Seq(prompt=prompt, sampling=sp, seed=seed, stop_ids=stop, lps=lps, **kw)


class TorchEngine(Engine):
    """A real decoder executing :class:`IterationPlan` s over paged L1 and a host L2.

    Args:
        profile: the node's profile: ``block_size`` is the page size,
            ``gpu_blocks`` the L1 pages, ``host_blocks`` the L2 slots.
        model_dir: a Hugging Face folder (config.json, ``*.safetensors``, tokenizer.json).
        dtype: ``float32``, ``bfloat16`` or ``float16``; None = float32 on CPU, bfloat16 on CUDA.
        device: ``cpu``, ``cuda`` or ``cuda:N``; None = :func:`default_device`.
        check: run :meth:`check` after every event batch (tests, debug).
        clock: what :meth:`execute` measures an iteration with (seconds): wall time
            (``time.perf_counter``, the default and what serving sees); a benchmark on a
            shared machine may pass ``time.thread_time`` (this thread's CPU time, which
            other processes' load inflates far less).
        speedup: cluster seconds per second of ``clock`` (the worker's ``--speedup``: the
            cluster's clock runs ``speedup`` x wall time). :meth:`execute` returns, and sets
            ``plan.iteration_s`` / ``plan.end`` in, the measured time x ``speedup``: the
            :class:`Engine` contract's simulated seconds, the clock of the scheduler's
            ``IterationRecord`` s (the planner's Eq. 1/2 fits) and of every time the shell
            sends. 1 (the default, and a real deployment's): measured seconds as they are.

    Raises:
        ModelConfigError: missing/unsupported config or weights, a profile whose
            decode emits other than one token per iteration, or an unknown dtype.
        ValueError: ``speedup`` not a positive finite number.
    """

    name = "torch"
    simulated = False
    threaded = True
    """The shell runs :meth:`execute` in a worker thread (methods take the engine's lock)."""

    def __init__(
        self,
        profile: Profile,
        model_dir: str | Path,
        *,
        dtype: str | None = None,
        device: str | None = None,
        check: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        speedup: float = 1.0,
    ) -> None:
        if not 0 < speedup < float("inf"):
            raise ValueError(f"speedup must be a positive finite number (cluster s per wall s), got {speedup!r}")
        dec = profile.decode
        if dec.tokens_per_forward != 1 or dec.accepted_per_iteration != 1:
            raise ModelConfigError(
                f"profile {profile.name}: the torch engine decodes one token per iteration; "
                f"tokens_per_forward={dec.tokens_per_forward}, accepted_per_iteration={dec.accepted_per_iteration}"
            )
        dev = torch.device(device) if device else default_device()
        if dtype is None:
            dt = torch.float32 if dev.type == "cpu" else torch.bfloat16
        elif dtype in DTYPES:
            dt = DTYPES[dtype]
        else:
            raise ModelConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.profile = profile
        self.model = PagedDecoder.from_folder(model_dir, dt, dev)
        self.eos: frozenset[int] = eos_token_ids(model_dir, self.model.cfg.eos_token_id)
        """End-of-sequence token ids: a request stops at one unless it says ``ignore_eos``."""
        self._stopped: dict[str, int] = {}
        """Requests the last plans ended at an EOS token → output count (:meth:`take_stopped`)."""
        self.cfg = self.model.cfg
        self.device = dev
        self.page_size = profile.block_size
        self.pages = profile.gpu_blocks
        self.k_cache, self.v_cache = self.model.new_cache(self.pages, self.page_size)
        c = self.cfg
        self.host = torch.zeros(
            (profile.host_blocks, c.num_layers, 2, self.page_size, c.num_kv_heads, c.head_dim),
            dtype=dt,
            pin_memory=dev.type == "cuda",
        )
        self._l2_read: Any = torch.cuda.Event() if dev.type == "cuda" else None
        """CUDA: recorded on the device's current stream after each L2 → L1 copy (:meth:`_restore_page`),
        waited for before the CPU writes an L2 slot (:meth:`_await_l2_reads`); None on CPU, where a copy
        is done when it returns."""
        self._l2_read_pending = False
        """An L2 → L1 copy was enqueued since the last :meth:`_await_l2_reads` (CUDA only)."""
        self.page_of: dict[int, int] = {}
        self.host_slot: dict[int, int] = {}
        self._free = list(range(self.pages - 1, -1, -1))
        self._host_free = list(range(profile.host_blocks - 1, -1, -1))
        self.seqs: dict[str, _Seq] = {}
        self._serials = itertools.count(1)
        """:attr:`_Seq.serial` of the next registration."""
        self._pending: dict[int, list[tuple[str, int]]] = {}
        """Prompt pages completed by the last plan, by hash: [(rid, page)] awaiting BlockStored(gpu)."""
        self._fetched: dict[int, _Fetched] = {}
        """Pages fetched from a peer (real bytes), by hash, while a fetch that brought them is open:
        their ``BlockStored(host)`` copies them into L2 and :meth:`drop_fetched` (the fetch ended:
        stored, not stored, or abandoned) lets them go. Not dropped at the store: another open
        fetch of the same page may need it again once L2 evicted it in between."""
        self._fetch_pages: dict[int, set[int]] = {}
        """Open fetches: fetch id → the pages it brought (:meth:`put_fetched`)."""
        self._wt: list[tuple[int, int]] = []
        """Deferred write-through copies (L1 page, L2 slot) of the event batch being applied."""
        self._handoffs: dict[str, torch.Tensor] = {}
        self._incoming: dict[int, dict[str, torch.Tensor]] = {}
        """Hand-off pages by hash → the bytes each hand-off carrying it brought, by rid, until that
        request's first decode (or its end). Not dropped at the page's BlockStored(gpu): another
        hand-off queued for L1 may share the page and need it again once it was evicted from
        L1 and L2 in between."""
        self.check_each = check
        self.clock = clock
        self.speedup = float(speedup)
        """Cluster seconds per measured second (:meth:`execute`)."""
        self._lock = threading.RLock()
        self._held = 0
        """Depth of the locked calls of the thread holding :attr:`_lock` (only that thread changes it)."""
        self._deferred: deque[Callable[[], None]] = deque()
        """Registrations (:meth:`accept_prefill` / :meth:`accept_decode`), KV event batches (:meth:`on_kv_events`)
        and ended fetches (:meth:`drop_fetched`) given while another thread held :attr:`_lock` (a plan running
        in the execute thread), applied in order by the next locked call (:meth:`_register`)."""
        self._broken: EngineFatal | None = None
        """What a deferred operation raised: every later locked call raises it (the maps are out of step)."""
        self.counters: dict[str, int] = {}
        """``restored_pages``, ``written_through``, ``handoff_pages_in``, ``fetched_pages``,
        ``fetched_unstored_pages`` (fetched, dropped without being stored), ``dedup_pages``,
        ``recomputed_kept_l2``, ``forwards``, ``tokens``."""

    # ------------------------------------------------------------------ #
    # work registration
    # ------------------------------------------------------------------ #

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def context_error(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request does not fit the model's context (None if it does)."""
        limit = self.cfg.max_position_embeddings
        if prompt_tokens + max_tokens > limit:
            return f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds the model's context of {limit} tokens"
        return None

    def _register(self, apply: Callable[[], None]) -> None:
        """Apply the registration ``apply`` (it changes :attr:`seqs` and the maps of the requests' pages)
        under the engine's lock, now if the lock is free (or this thread holds it), else at the start of
        the next locked call (:func:`_locked`: after the plan in flight, before any later call, in order).

        A plan that :meth:`execute` runs in the execute thread holds the lock for all its forwards; an
        ``accept_prefill`` / ``accept_decode`` of arriving work, called by a handler on the event loop,
        waited for the rest of that forward there: heartbeats, NATS pings and ``/metrics`` with it (a
        hidden-512, 8-layer llama on CPU, a 256-token chunk: 40-615 ms on a busy 2-core box). The plan in
        flight does not run the request: the scheduler takes the work only after it is accepted, and the
        worker waits for a step that runs an older attempt of the rid before it accepts a new one
        (``WorkerService._newest_attempt``). Every reader of the registrations takes the lock, so it sees
        the deferred ones applied."""
        if self._lock.acquire(blocking=False):
            try:
                self._run_held(apply)
            finally:
                self._lock.release()
        else:
            self._deferred.append(apply)

    def _run_held(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` as a locked call (the caller holds :attr:`_lock`): the outermost one first applies
        the operations deferred while the lock was busy (:meth:`_run_deferred`), in order. What :func:`_locked`
        and :meth:`_register` both run."""
        self._held += 1
        try:
            if self._held == 1 and (self._deferred or self._broken is not None):
                self._run_deferred()
            return fn(*args, **kw)
        finally:
            self._held -= 1

    def _run_deferred(self) -> None:
        """Apply the deferred operations in order (the caller holds the lock).

        Raises:
            EngineFatal: one raised (a ``KvMapError`` of a KV event batch; anything else is wrapped), now
                and at every later locked call: the engine's maps may have taken part of it, as a batch
                applied at once that raised fails the node.
        """
        if self._broken is not None:
            raise self._broken
        while self._deferred:
            op = self._deferred.popleft()
            try:
                op()
            except Exception as e:
                self._deferred.clear()
                self._broken = e if isinstance(e, EngineFatal) else EngineFatal(f"a deferred engine operation failed: {e!r}")
                raise self._broken from (None if self._broken is e else e)

    def accept_prefill(self, work: PrefillWork) -> None:
        """Register the prompt of ``work`` (before the scheduler queues it). Checked at once; the
        registration waits for no plan in flight (:meth:`_register`).

        Raises:
            ValueError: token ids missing, not matching ``prompt_tokens``, out of the
                vocabulary, or longer than the model's context; a ``logit_bias`` id outside the
                model's vocabulary (it would fail the decode step the request joins).
        """
        ids = self._ids(work.rid, work.token_ids, work.prompt_tokens, work.prompt_tokens)
        err = self.context_error(work.prompt_tokens, work.max_tokens)
        if err:
            raise ValueError(err)
        check_logit_bias(work.sampling, self.cfg.vocab_size)
        s = _seq(
            ids, work.sampling, serial=next(self._serials), offset=work.output_offset, ignore_eos=work.ignore_eos,
            stats_from=work.token_ids,
        )  # fmt: skip
        rid = work.rid

        def apply() -> None:
            self._forget_seq(rid)  # an older attempt's registration (see _forget_seq)
            self.seqs[rid] = s

        self._register(apply)

    def accept_decode(self, work: DecodeWork) -> None:
        """Register a hand-off: ``work.token_ids`` holds the prompt, ``work.output_ids`` the
        output produced so far, ``work.kv`` the prompt's K/V pages (as :meth:`handoff`
        writes them): ``ceil(prompt / block_size)`` pages of ``[layers, 2, block_size,
        kv_heads, head_dim]`` in this engine's dtype. Checked at once; the registration waits for no
        plan in flight (:meth:`_register`).

        Raises:
            ValueError: token ids or KV missing or of the wrong size; block hashes other than one per
                full page of the prompt; a ``logit_bias`` id outside the model's vocabulary.
        """
        n = work.prompt_tokens
        ids = self._ids(work.rid, work.token_ids, n, n)
        check_logit_bias(work.sampling, self.cfg.vocab_size)
        if len(work.output_ids) != work.generated or any(not 0 <= t < self.cfg.vocab_size for t in work.output_ids):
            raise ValueError(f"{work.rid}: hand-off has {len(work.output_ids)} output ids in the vocabulary, expected {work.generated}")
        pages = -(-work.prompt_tokens // self.page_size)
        if len(work.block_hashes) != n // self.page_size:
            # checked here, not only by the scheduler after it: the registration maps each hash to its K/V page,
            # and one deferred behind a plan (_register) that failed would fail the node, not refuse the request
            raise ValueError(f"{work.rid}: {len(work.block_hashes)} block hashes for {n} prompt tokens (expected {n // self.page_size})")
        per_page = self.host[0].numel() * self.host.element_size()
        if len(work.kv) != pages * per_page:
            raise ValueError(
                f"{work.rid}: hand-off carries {len(work.kv)} bytes of KV, expected {pages} pages × {per_page} B "
                "(same model, dtype and page size on both nodes)"
            )
        # a hand-off that came in pieces is a writable view of the decode node's one buffer (handoffkv.KvAssembler.take):
        # its pages are read in place; inline bytes (read-only) are copied once
        kv_buf: Any = work.kv
        if not isinstance(kv_buf, (bytearray, memoryview)) or getattr(kv_buf, "readonly", False):
            kv_buf = bytearray(kv_buf)
        raw = torch.frombuffer(kv_buf, dtype=torch.uint8)
        kv = raw.view(self.host.dtype).reshape(pages, *self.host.shape[1:])
        s = _seq(
            ids, work.sampling, serial=next(self._serials), out=list(work.output_ids), offset=work.output_offset,
            ignore_eos=work.ignore_eos, stats_from=work.token_ids,
        )  # fmt: skip
        s.incoming = {i: kv[i] for i in range(pages)}
        s.path = list(work.block_hashes)
        rid = work.rid

        def apply() -> None:
            self._forget_seq(rid)  # an older attempt's registration (see _forget_seq)
            for i, h in enumerate(s.path):
                self._incoming.setdefault(h, {})[rid] = kv[i]
            self.seqs[rid] = s

        self._register(apply)

    def _ids(self, rid: str, packed: bytes, lo: int, hi: int) -> list[int]:
        try:
            ids = unpack_tokens(packed).tolist()
        except ValueError as e:
            raise ValueError(f"{rid}: {e}") from e
        if not lo <= len(ids) <= hi:
            raise ValueError(f"{rid}: {len(ids)} token ids, expected {lo}")
        if ids and max(ids) >= self.cfg.vocab_size:
            raise ValueError(f"{rid}: token id {max(ids)} outside the model's vocabulary ({self.cfg.vocab_size})")
        return ids

    @_locked
    def handoff(self, work: DecodeWork) -> DecodeWork:
        """The hand-off of a request whose prefill finished here: ``output_ids`` = the
        output produced here, ``kv`` = the prompt's K/V pages (captured when its last
        chunk ran; see :meth:`accept_decode` for the layout).

        Raises:
            KeyError: ``work.rid`` did not finish a prefill for another node here.
        """
        import msgspec

        s = self.seqs[work.rid]
        kv = self._handoffs.pop(work.rid)
        self._count("handoff_pages_out", kv.shape[0])
        raw = kv.contiguous().view(torch.uint8).numpy().tobytes()
        return msgspec.structs.replace(work, output_ids=s.out[: work.generated], kv=raw)

    def on_kv_events(self, events: list[KvEvent], live: Any, snapshot: Any = None) -> None:
        """The shell's hook: :meth:`apply_kv_events` with gc, then (``check`` mode, with
        the pools' ``snapshot``) :meth:`check`. Applied now if the engine's lock is free (or this
        thread holds it), else by the next locked call, after the plan in flight (:meth:`_register`):
        ``live`` is then read later, so pass one that does not change (the worker passes a
        ``frozenset``); ``snapshot()`` is read now. Before, a drain in a bus handler (a decode work's
        reservation, a resync) waited on the event loop for the rest of the forward.

        Raises:
            KvMapError: see :meth:`apply_kv_events` and :meth:`check` (a deferred batch's: raised by
                the locked call that applies it, and every later one).
        """
        snap = snapshot() if self.check_each and snapshot is not None else None

        def apply() -> None:
            self.apply_kv_events(events, live)
            if snap is not None:
                self.check(*snap)

        self._register(apply)

    @_locked
    def put_fetched(self, h: int, kv: torch.Tensor, fetch_id: int) -> None:
        """Real bytes of page ``h`` fetched from a peer's L2 by fetch ``fetch_id``
        (``FetchStarted.fetch_id``), ``[layers, 2, block_size, kv_heads, head_dim]``; stored into
        L2 at its ``BlockStored(host)`` event, kept until every fetch that brought it ended
        (:meth:`drop_fetched`). A page two open fetches brought is held once (one version per
        hash: the first bytes)."""
        f = self._fetched.get(h)
        if f is None:
            self._fetched[h] = _Fetched(kv, {fetch_id})
        else:
            f.holders.add(fetch_id)
        self._fetch_pages.setdefault(fetch_id, set()).add(h)

    def drop_fetched(self, fetch_id: int) -> int:
        """Fetch ``fetch_id`` ended (the scheduler stored what it would, or the request left): let
        go of the pages it brought that no other open fetch holds (by fetch, not rid: a request
        re-dispatched here has a new fetch open while its old one's transfer ends). Call after the
        KV events of the fetch's completion were given (:meth:`on_kv_events`). Returns the pages freed
        (0 if it has none); when a plan in flight holds the lock, it is done after it, in order
        (:meth:`_register`), and returns 0."""
        freed: list[int] = []
        self._register(lambda: freed.append(self._drop_fetched(fetch_id)))
        return freed[0] if freed else 0

    def _drop_fetched(self, fetch_id: int) -> int:
        freed = 0
        for h in self._fetch_pages.pop(fetch_id, ()):
            f = self._fetched.get(h)
            if f is None:
                continue
            f.holders.discard(fetch_id)
            if not f.holders:
                del self._fetched[h]
                freed += 1
                if not f.stored:
                    self._count("fetched_unstored_pages")
        return freed

    def fetched_bytes(self) -> int:
        """Bytes of fetched pages held for open fetches (:meth:`put_fetched`); 0 when no fetch is open."""
        return len(self._fetched) * self.pool_slot_bytes()

    def pool_slot_bytes(self) -> int:
        """Bytes of one page in L2 (``layers × 2 × block_size × kv_heads × head_dim × dtype``)."""
        return self.host[0].numel() * self.host.element_size()

    @_locked
    def copy_to_pool(self, pages: list[tuple[int, Any]]) -> list[bool]:
        """Copy the L2 bytes of each page ``h`` into its destination (``(h, dst)``: ``dst`` a writable ``uint8``
        array of at least :meth:`pool_slot_bytes`, the real-bytes pool's slot that ``HostKvPool.claim_events``
        claimed for a ``BlockStored(host)``; the rest of it zeroed), which serves them to peers. Returns, per
        page, whether L2 holds it (False: nothing written; a later event of the batches applied first removed
        it). The worker calls it in the execute thread (the copies of a big batch do not hold the event loop),
        after the plan in flight; this locked call applies the KV event batches given before it first, so it
        copies what L2 holds after them."""
        n = self.pool_slot_bytes()
        done: list[bool] = []
        for h, dst in pages:
            slot = self.host_slot.get(h)
            if slot is not None:
                dst[:n] = self.host[slot].reshape(-1).view(torch.uint8).numpy()
                dst[n:] = 0
            done.append(slot is not None)
        return done

    @_locked
    def on_fetched(self, pages: list[tuple[int, Any]], fetch_id: int) -> list[int]:
        """Hold the bytes of the pages fetch ``fetch_id`` got (``FetchResult.fetched`` and ``already``: pages
        the pool held when it started, e.g. brought by another open fetch) for their coming
        ``BlockStored(host)`` (:meth:`put_fetched`; freed by :meth:`drop_fetched`): ``(h, src)`` with ``src``
        the pool's slot of ``h`` (CRC-verified; pinned by the caller until this returns, so no other block's
        bytes land there meanwhile) or None when the pool no longer held it. Takes the copy another open fetch
        holds, else a copy of ``src``. Returns the pages it has no bytes for (the pool let them go meanwhile):
        the caller reports them missing, so the core never stores a page without bytes (``KvMapError``). The
        worker calls it in the execute thread, after the plan in flight (the copies of a big fetch do not hold
        the event loop)."""
        shape = tuple(self.host.shape[1:])
        n = self.pool_slot_bytes()
        lost: list[int] = []
        for h, src in pages:
            f = self._fetched.get(h)
            if f is not None:
                self.put_fetched(h, f.kv, fetch_id)
            elif src is not None:
                raw = torch.from_numpy(src[:n].copy())
                self.put_fetched(h, raw.view(self.host.dtype).reshape(shape), fetch_id)
            else:
                lost.append(h)
        return lost

    def host_page(self, h: int) -> torch.Tensor:
        """The L2 bytes of page ``h`` (``[layers, 2, block_size, kv_heads, head_dim]``, a view).

        Raises:
            KeyError: ``h`` is not in L2.
        """
        return self.host[self.host_slot[h]]

    # ------------------------------------------------------------------ #
    # KV events → physical map
    # ------------------------------------------------------------------ #

    def _alloc(self) -> int:
        if not self._free:
            raise KvMapError("no free L1 page: the engine's pages exceed the scheduler's L1 accounting")
        return self._free.pop()

    def _page_kv(self, page: int) -> torch.Tensor:
        return torch.stack(
            [torch.stack((self.k_cache[i][page], self.v_cache[i][page])) for i in range(self.cfg.num_layers)]
        )

    def _pages_kv(self, pages: list[int]) -> torch.Tensor:
        """K/V of several L1 pages, ``[len(pages), layers, 2, block_size, kv_heads, head_dim]`` (on
        the engine's device): the bytes of ``torch.stack([_page_kv(p) for p in pages])`` gathered
        with two ``index_select`` per layer, not ``2 × layers + 1`` kernels per page."""
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        return torch.stack(
            [torch.stack((k.index_select(0, idx), v.index_select(0, idx)), dim=1) for k, v in zip(self.k_cache, self.v_cache)],
            dim=1,
        )

    _WRITE_THROUGH_BATCH = 512
    """Most pages one deferred write-through copies at once (bounds its device-side staging:
    512 pages of a 24-layer, 2-KV-head, head_dim-64 bfloat16 model at block size 8 are 50 MB)."""

    def _flush_write_through(self) -> None:
        """Copy the deferred write-through pages (``_wt``: (L1 page, L2 slot)) into L2: one gather
        and one device → host copy per :attr:`_WRITE_THROUGH_BATCH` pages instead of a stack
        of ``2 × layers + 1`` kernels and a synchronous copy per page (on a GPU the per-page
        copies of a 128-request prefill took ~1 s outside the timed forward). Same bytes."""
        wt, self._wt = self._wt, []
        for lo in range(0, len(wt), self._WRITE_THROUGH_BATCH):
            part = wt[lo : lo + self._WRITE_THROUGH_BATCH]
            kv = self._pages_kv([p for p, _ in part]).to(self.host.device)  # blocking: see _await_l2_reads
            self.host.index_copy_(0, torch.tensor([s for _, s in part], dtype=torch.int64), kv)

    def _write_page(self, page: int, kv: torch.Tensor) -> None:
        """Copy ``kv`` (``[layers, 2, block_size, kv_heads, head_dim]``, any device) into L1 page ``page``.
        On CUDA the host → device copy is only enqueued (``non_blocking``): from pinned memory (an L2 slot,
        :meth:`_restore_page`) the device reads the source when it reaches the copy, so a source in L2 must
        stay unwritten until then (:meth:`_await_l2_reads`); from pageable memory (a hand-off's or a fetched
        page's own tensor) CUDA stages it before the call returns."""
        kv = kv.to(self.device, non_blocking=True)
        for i in range(self.cfg.num_layers):
            self.k_cache[i][page].copy_(kv[i, 0])
            self.v_cache[i][page].copy_(kv[i, 1])

    def _restore_page(self, page: int, slot: int) -> None:
        """Copy L2 slot ``slot`` into L1 page ``page`` (:meth:`_write_page`); on CUDA mark the read pending."""
        self._write_page(page, self.host[slot])
        if self._l2_read is not None:
            self._l2_read.record(torch.cuda.current_stream(self.device))
            self._l2_read_pending = True

    def _await_l2_reads(self) -> None:
        """Wait until the device ran every L2 → L1 copy enqueued so far; call before the CPU writes an L2 slot.

        Invariant: the CPU writes into ``self.host`` only after every L2 read enqueued before the write ran.
        A restore (:meth:`_restore_page`) enqueues a copy from the pinned ``self.host`` on CUDA that reads the
        slot when the device reaches it, maybe behind a long forward; a slot freed meanwhile
        (``BlockRemoved(host)``, ``AllBlocksCleared``) and refilled by the CPU would be read with the new
        bytes: the restored L1 page would silently hold another page's K/V. The writers of ``self.host``:

        * :meth:`_store_host`, a fetched page (``copy_`` on the CPU): calls this first.
        * :meth:`_flush_write_through` (``index_copy_`` on the CPU): needs no wait, as its bytes come from a
          blocking device → host copy (``.to(self.host.device)``: into pageable memory, enqueued on the same
          current stream behind every restore enqueued before it, and the stream is synchronized before it
          returns), so those restores ran before the CPU writes. Keep that copy blocking.

        Nothing else writes ``self.host``: hand-off pages (``_Seq.incoming``) and fetched pages
        (``_Fetched.kv``) are tensors of their own, the real-bytes pool (``kvpool``) has its own buffer
        (:meth:`copy_to_pool` reads L2 into it, :meth:`on_fetched` copies its slots into new tensors).
        On CPU (no event) and with no restore since the last wait, this does nothing."""
        if self._l2_read_pending:
            self._l2_read.synchronize()
            self._l2_read_pending = False

    @_locked
    def apply_kv_events(self, events: list[KvEvent], live: set[str] | dict[str, Any] | None = None) -> None:
        """Apply one drained batch of the scheduler's KV events (see module docstring),
        then settle deduplicated pages and, with ``live`` (the scheduler's requests),
        forget the requests that left (:meth:`gc`). The shell calls it for every
        drain, also an empty one.

        Raises:
            KvMapError: an event the engine has no bytes for (a bug).
        """
        # Write-through copies (L1 page → L2 slot) are deferred into ``_wt`` and done in batches
        # (:meth:`_flush_write_through`) before any removal or clear (which could free a page a
        # copy reads, to be refilled by a later store, or a slot it writes) and before the dedup /
        # gc after the loop (which free pages). Between those, the page of a deferred copy stays
        # hashed in L1 (a store only writes a page it takes from the free list) and its slot stays
        # reserved to a hash in L1 (a restore reads the slot of a hash not in L1; a fetched page
        # goes to a free slot), so the bytes copied are the ones the per-event copy made.
        try:
            self._apply_kv_events(events)
        finally:
            self._flush_write_through()
        self._resolve_pending()
        if live is not None:
            self.gc(live)

    def _apply_kv_events(self, events: list[KvEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.tier == "gpu":
                    for h in ev.block_hashes:
                        self._store_gpu(h)
                else:
                    for h in ev.block_hashes:
                        self._store_host(h)
                continue
            self._flush_write_through()
            if isinstance(ev, BlockRemoved):
                if ev.tier == "gpu":
                    for h in ev.block_hashes:
                        p = self.page_of.pop(h, None)
                        if p is None:
                            raise KvMapError(f"BlockRemoved(gpu) of {h} that has no L1 page")
                        self._free.append(p)
                else:
                    for h in ev.block_hashes:
                        slot = self.host_slot.pop(h, None)
                        if slot is None:
                            raise KvMapError(f"BlockRemoved(host) of {h} that has no L2 slot")
                        self._host_free.append(slot)
            elif isinstance(ev, AllBlocksCleared):
                if ev.tier in (None, "gpu"):
                    self._free.extend(self.page_of.values())
                    self.page_of.clear()
                if ev.tier in (None, "host"):
                    self._host_free.extend(self.host_slot.values())
                    self.host_slot.clear()

    def _store_gpu(self, h: int) -> None:
        if h in self.page_of:
            raise KvMapError(f"BlockStored(gpu) of {h} already in L1")
        cands = self._pending.get(h)
        if cands:
            rid, page = cands.pop(0)
            if not cands:
                del self._pending[h]
            s = self.seqs.get(rid)
            if s is not None:
                s.own.discard(page)
            slot = self.host_slot.get(h)
            if slot is not None:
                # recomputed while its L2 copy stayed (evicted from L1 only; the cache cap makes a
                # request compute its last page): the same tokens' K/V in other chunks or batches
                # differ in the last bits (1e-6 of 3 on the tiny model). Keep the L2 version, the
                # one peers fetch and later restores read: L1 = L2 bytes, one version per hash.
                self._restore_page(page, slot)
                self._count("recomputed_kept_l2")
            self.page_of[h] = page
            return
        if h in self.host_slot:  # restore L2 → L1
            page = self._alloc()
            self._restore_page(page, self.host_slot[h])
            self.page_of[h] = page
            self._count("restored_pages")
            return
        holders = self._incoming.get(h)
        if holders:  # a hand-off's page
            kv = next(iter(holders.values()))
            page = self._alloc()
            self._write_page(page, kv)
            self.page_of[h] = page
            self._count("handoff_pages_in")
            return
        raise KvMapError(f"BlockStored(gpu) of {h}: not computed, not in L2, not handed off")

    def _store_host(self, h: int) -> None:
        if h in self.host_slot:
            raise KvMapError(f"BlockStored(host) of {h} already in L2")
        if not self._host_free:
            raise KvMapError("no free L2 slot: the engine's slots exceed the scheduler's L2 accounting")
        slot = self._host_free.pop()
        page = self.page_of.get(h)
        if page is not None:  # write-through L1 → L2 (deferred, see apply_kv_events)
            self._wt.append((page, slot))
            self._count("written_through")
        else:
            f = self._fetched.get(h)
            if f is None:
                self._host_free.append(slot)
                raise KvMapError(f"BlockStored(host) of {h}: not in L1 and not fetched")
            self._await_l2_reads()  # a restore enqueued before may still read this slot (freed since)
            self.host[slot].copy_(f.kv)
            f.stored = True
            self._count("fetched_pages")
        self.host_slot[h] = slot

    def _resolve_pending(self) -> None:
        """Pages a request computed that another request stored first: point its table
        at the stored page and free its copy (the scheduler referenced the stored page)."""
        for h, cands in list(self._pending.items()):
            stored = self.page_of.get(h)
            if stored is None:
                continue
            for rid, page in cands:
                s = self.seqs.get(rid)
                if s is not None and page in s.own:
                    s.table[s.table.index(page)] = stored
                    s.own.discard(page)
                    self._free.append(page)
                    self._count("dedup_pages")
            del self._pending[h]

    def _drop_incoming(self, rid: str, path: list[int]) -> None:
        """Forget the hand-off pages ``rid`` brought (its prompt's hashes ``path``); other
        hand-offs' copies of the same pages stay."""
        for h in path:
            holders = self._incoming.get(h)
            if holders is not None:
                holders.pop(rid, None)
                if not holders:
                    del self._incoming[h]

    def gc(self, live: set[str] | dict[str, Any]) -> None:
        """Forget requests not in ``live`` (the scheduler's requests): free their private pages."""
        for rid in [r for r in self.seqs if r not in live]:
            self._forget_seq(rid, pending=False)
        self._keep_pending(lambda r: r in self.seqs)

    def _forget_seq(self, rid: str, *, pending: bool = True) -> None:
        """Forget the registration of ``rid`` if any: free its private pages, drop the hand-off
        pages it brought and its captured hand-off, and (``pending``) its computed pages awaiting
        their ``BlockStored(gpu)``. :meth:`gc` does it for a request that left the scheduler;
        :meth:`accept_prefill` / :meth:`accept_decode` for the registration a newer attempt of the
        same request replaces (the worker aborts the old attempt in the core and registers the new
        work at once, before any KV drain runs gc: overwritten in :attr:`seqs`, the old
        registration's private pages were lost to the engine, one per re-dispatch here, until
        :meth:`_alloc` failed)."""
        s = self.seqs.pop(rid, None)
        if s is None:
            return
        self._free.extend(s.own)
        if s.incoming is not None:
            self._drop_incoming(rid, s.path)
        self._handoffs.pop(rid, None)
        if pending:
            self._keep_pending(lambda r: r != rid)

    def _keep_pending(self, keep_rid: Callable[[str], bool]) -> None:
        """Keep in :attr:`_pending` only the candidates of requests ``keep_rid`` accepts (a hash
        left with none is dropped)."""
        for h, cands in list(self._pending.items()):
            keep = [(r, p) for r, p in cands if keep_rid(r)]
            if keep:
                self._pending[h] = keep
            else:
                del self._pending[h]

    # ------------------------------------------------------------------ #
    # execution
    # ------------------------------------------------------------------ #

    @_locked
    def execute(self, plan: IterationPlan) -> float:
        """Run the plan's iterations (one forward each) and return their duration in
        cluster seconds: the measured time (wall time unless the engine was given another
        ``clock``) x ``speedup``. Sets ``plan.iteration_s`` to that duration per iteration
        (and ``plan.end``), so the scheduler's ``IterationRecord`` carries measured times
        on the cluster's clock (paper Eq. 1/2 fitted on them by the planner). Before, at
        ``--speedup 50`` a prefill record read 4.4 ms (wall) against a 261-ms (cluster)
        node TTFT.

        Raises:
            KvMapError: a page the plan needs is not where the KV events put it.
        """
        t0 = self.clock()
        n_chunks = len(plan.prefill)
        for it in range(plan.iterations):
            self._forward(plan, n_chunks, first=it == 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        took = (self.clock() - t0) * self.speedup  # cluster s
        plan.iteration_s = took / plan.iterations
        plan.end = plan.start + took
        return took

    def _seq_for(self, r: Any) -> _Seq:
        s = self.seqs.get(r.rid)
        if s is None:
            w = r.prefill_work
            if w is None:
                raise KvMapError(f"{r.rid}: no tokens registered (accept_decode was not called)")
            self.accept_prefill(w)
            s = self.seqs[r.rid]
        return s

    def _ensure_pages(self, s: _Seq, upto: int) -> None:
        need = -(-upto // self.page_size)
        while len(s.table) < need:
            p = self._alloc()
            s.table.append(p)
            s.own.add(p)

    def _forward(self, plan: IterationPlan, n_chunks: int, first: bool) -> None:
        ps = self.page_size
        tokens: list[int] = []
        positions: list[int] = []
        batch: list[SeqBatch] = []
        logits_at: list[int] = []
        rows_s: list[tuple[str, _Seq]] = []  # (rid, seq) of each logits row, in row order
        chunk_pages: list[tuple[_Seq, Any, int, int]] = []
        chunks = list(zip(plan.prefill, plan.reqs[:n_chunks])) if first else []
        for c, r in chunks:
            s = self._seq_for(r)
            start = c.cached_before
            if not s.table and start:  # first chunk: the cached prefix (hits + restores)
                full = start // ps
                try:
                    s.table = [self.page_of[h] for h in r.path[:full]]
                except KeyError as e:
                    raise KvMapError(f"{r.rid}: cached page {e} has no L1 page") from e
                s.computed = start
            if s.computed != start:
                raise KvMapError(f"{r.rid}: chunk starts at {start} but {s.computed} tokens are in KV")
            self._ensure_pages(s, start + c.tokens)
            off = len(tokens)
            tokens.extend(s.prompt[start : start + c.tokens])
            positions.extend(range(start, start + c.tokens))
            batch.append(SeqBatch(offset=off, n=c.tokens, ctx=start, block_table=s.table, seq=s.serial))
            s.computed = start + c.tokens
            chunk_pages.append((s, r, start // ps, s.computed // ps))
            if c.completes:
                logits_at.append(len(tokens) - 1)
                rows_s.append((r.rid, s))
        rows: list[tuple[int, Any, _Seq]] = []
        for r in plan.reqs[n_chunks:]:
            if r.rid in self._stopped:  # ended at EOS in an earlier iteration of this plan
                continue
            known = self.seqs.get(r.rid)
            if known is None:
                raise KvMapError(f"{r.rid}: decode without registered tokens")
            s = known
            if s.incoming is not None:  # hand-off: prompt pages are in L1 now; copy the partial one
                full = len(s.prompt) // ps
                try:
                    s.table = [self.page_of[h] for h in r.path[:full]]
                except KeyError as e:
                    raise KvMapError(f"{r.rid}: hand-off page {e} has no L1 page") from e
                if len(s.prompt) % ps:
                    p = self._alloc()
                    self._write_page(p, s.incoming[full])
                    s.table.append(p)
                    s.own.add(p)
                s.incoming = None
                self._drop_incoming(r.rid, r.path)
                s.computed = len(s.prompt)
            pos = len(s.prompt) + len(s.out) - 1
            if s.computed != pos:
                raise KvMapError(f"{r.rid}: decode at position {pos} but {s.computed} tokens are in KV")
            if len(s.table) * ps <= pos:
                self._ensure_pages(s, pos + 1)
            rows.append((pos, r.rid, s))
        # decode rows longest context first: the model batches rows of similar length
        # into one attention call each, padding none to a much longer row's context
        rows.sort(key=lambda e: -e[0])
        for pos, rid, s in rows:
            off = len(tokens)
            tokens.append(s.out[-1])
            positions.append(pos)
            batch.append(SeqBatch(offset=off, n=1, ctx=pos, block_table=s.table, seq=s.serial))
            s.computed = pos + 1
            logits_at.append(off)
            rows_s.append((rid, s))
        if not tokens:
            return
        dev = self.device
        every = len(logits_at) == len(tokens)  # a pure decode iteration: every token's logits
        logits = self.model(
            int64_tensor(tokens, dev), int64_tensor(positions, dev), batch, self.k_cache, self.v_cache,
            None if every else int64_tensor(logits_at, dev),
        )  # fmt: skip
        # logprobs: the raw rows (before penalties / min_tokens masks / temperature), copied
        # before sampling so nothing the sampler does to the logits reaches them
        asked = [j for j, (_, s) in enumerate(rows_s) if s.lps is not None]
        raw = logits.index_select(0, int64_tensor(asked, dev)) if asked else None
        if all(s.sampling is None for _, s in rows_s):
            nxt = logits.argmax(dim=-1).tolist()
        else:
            for _, s in rows_s:
                if s.stats_from is not None:  # first sampled here: build its counts now (see _Seq.stats_from)
                    s.stats = token_stats(s.sampling, unpack_tokens(s.stats_from), s.out, s.offset, self.eos, self.cfg.vocab_size, dev)
                    s.stats_from = None
            nxt = sample(
                logits, [s.sampling for _, s in rows_s], [s.seed for _, s in rows_s], [s.offset + len(s.out) for _, s in rows_s],
                [s.stats for _, s in rows_s],
            )  # fmt: skip
        if raw is not None:
            ks = [rows_s[j][1].sampling.logprobs or 0 for j in asked]  # type: ignore[union-attr]
            for j, lp in zip(asked, token_logprobs(raw, range(len(asked)), [nxt[j] for j in asked], ks)):
                s = rows_s[j][1]
                s.lps[len(s.out)] = lp  # type: ignore[index]
        for (rid, s), t in zip(rows_s, nxt):
            s.out.append(t)
            if s.stats is not None:
                s.stats.add(t)
            if (t in self.eos and not s.ignore_eos) or t in s.stop_ids:
                self._stopped[rid] = len(s.out)
        self._count("forwards")
        self._count("tokens", len(tokens))
        # prompt pages completed by this plan: candidates for BlockStored(gpu)
        for s, r, lo, hi in chunk_pages:
            for i in range(lo, min(hi, len(r.path))):
                page = s.table[i]
                if page in s.own:
                    self._pending.setdefault(r.path[i], []).append((r.rid, page))
        for (c, r) in chunks:
            if c.completes and r.handoff_to is not None:
                s = self.seqs[r.rid]
                n = -(-len(s.prompt) // ps)
                self._handoffs[r.rid] = self._pages_kv(s.table[:n]).cpu()
                self._free_private(r.rid, s)

    def _free_private(self, rid: str, s: _Seq) -> None:
        """Free the private pages of ``rid`` (its K/V captured for its hand-off: it runs here no more) but those
        awaiting their ``BlockStored(gpu)`` (:attr:`_pending`: the page becomes the stored one). The scheduler frees
        them when the request leaves it (its hand-off, at once or at its binding); the registration stays until
        the hand-off is out (:meth:`handoff` reads its output), kept past that by the worker (``_step_rids``,
        ``_handing_off``; a parked prefill's hand-off waits for the plan in flight since 4b7ea0a) while the
        scheduler planned those pages again: the next forward or restore found no free page (``KvMapError``:
        the node failed; ``tests/unit/worker/test_torch_interleave_random.py``)."""
        pending = {p for cands in self._pending.values() for r, p in cands if r == rid}
        freed = s.own - pending
        if freed:
            self._free.extend(freed)
            s.own -= freed

    @_locked
    def take_stopped(self) -> dict[str, int]:
        """Requests the last executed plan ended at an EOS token (model's ``eos_token_id``,
        no ``ignore_eos``) or at one of their ``stop_token_ids`` → their output count on this engine including that token
        (``EngineScheduler.finish_iteration``'s ``stopped``); cleared once taken."""
        out, self._stopped = self._stopped, {}
        return out

    @_locked
    def output_tokens(self, rid: str, start: int, count: int) -> list[int]:
        """Token ids of ``rid`` at output positions ``[start, start + count)`` (positions of the
        client's output: a re-dispatched request's first output here is ``output_offset``).

        Raises:
            KeyError: ``rid`` unknown (already forgotten by :meth:`gc`).
        """
        s = self.seqs[rid]
        return s.out[start - s.offset : start - s.offset + count]

    @_locked
    def output_logprobs(self, rid: str, start: int, count: int) -> list[TokenLogprob] | None:
        """Log-probabilities of the tokens :meth:`output_tokens` returns for the same arguments
        (:mod:`.logprobs`); None when ``rid`` did not ask (``Sampling.logprobs``).

        Raises:
            KeyError: ``rid`` unknown, or a position whose logprobs were not computed here.
        """
        s = self.seqs[rid]
        if s.lps is None:
            return None
        lo = start - s.offset
        return [s.lps[i] for i in range(lo, min(lo + count, len(s.out)))]

    # ------------------------------------------------------------------ #
    # invariants
    # ------------------------------------------------------------------ #

    @_locked
    def check(self, gpu_hashes: list[int], host_hashes: list[int], *, bytes_check: bool = True) -> None:
        """Prove the physical map matches the pools (``scheduler.snapshot()``): L1 pages
        = the L1 pool's hashes, L2 slots = the L2 pool's, pages and slots conserved,
        no page in two places, and (``bytes_check``) every L1 page's bytes equal its
        L2 copy (write-through). O(blocks × page bytes).

        Raises:
            KvMapError: naming the first mismatch.
        """
        if set(self.page_of) != set(gpu_hashes):
            extra = set(self.page_of) - set(gpu_hashes)
            missing = set(gpu_hashes) - set(self.page_of)
            raise KvMapError(f"L1 map differs from the pool: {len(extra)} extra, {len(missing)} missing")
        if set(self.host_slot) != set(host_hashes):
            raise KvMapError("L2 map differs from the pool")
        own = [p for s in self.seqs.values() for p in s.own]
        used = list(self.page_of.values()) + own + self._free
        if len(used) != self.pages or len(set(used)) != self.pages:
            raise KvMapError(f"L1 pages not conserved: {len(self.page_of)} hashed + {len(own)} private + {len(self._free)} free")
        slots = list(self.host_slot.values()) + self._host_free
        if len(slots) != self.host.shape[0] or len(set(slots)) != len(slots):
            raise KvMapError("L2 slots not conserved")
        if not set(self.page_of) <= set(self.host_slot):
            raise KvMapError(f"{len(set(self.page_of) - set(self.host_slot))} L1 pages have no L2 copy (write-through)")
        if bytes_check:
            for h, p in self.page_of.items():
                if not torch.equal(self._page_kv(p).cpu(), self.host[self.host_slot[h]].cpu()):
                    raise KvMapError(f"L1 page of {h} differs from its L2 copy")
