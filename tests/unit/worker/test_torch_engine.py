"""The torch engine computes what the reference forward computes, on every KV path.

Greedy outputs of requests served by ``EngineScheduler`` + ``TorchEngine``
(paged L1, write-through L2, restores, prefix hits, deduplicated pages, mixed
prefill/decode batches, prefill → decode hand-off with real K/V pages) equal
``transformers``' own ``generate()`` on the same folder (float32, CPU). Each
path is counted and must occur. Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shared.hashing import block_hashes, pack_tokens  # noqa: E402
from shared.messages import AllBlocksCleared, BlockRemoved, BlockStored, PrefillWork  # noqa: E402
from shared.profile import load_profile  # noqa: E402
from services.worker.engines.torch_engine.checkpoint import init_model  # noqa: E402
from services.worker.engines.torch_engine.engine import KvMapError, TorchEngine  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402
from services.worker.engines.torch_engine.model import ModelConfigError  # noqa: E402

PROFILE = load_profile("torch-tiny-cpu")
BS = PROFILE.block_size


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"model-{request.param}")
    init_model(folder, arch=request.param, layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, context=1024, seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    return str(folder), hf


class Ref:
    """Reference greedy outputs by transformers, memoised per (prompt, max_tokens)."""

    def __init__(self, hf) -> None:
        self.hf = hf
        self.cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self.cache:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, min_new_tokens=n)
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]


def work(rid: str, prompt: list[int], max_tokens: int, decode_node: str | None = None) -> PrefillWork:
    return PrefillWork(
        rid=rid,
        prompt_tokens=len(prompt),
        max_tokens=max_tokens,
        block_size=BS,
        block_hashes=block_hashes(prompt, BS),
        token_ids=pack_tokens(prompt),
        decode_node=decode_node,
    )


def toks(rng: random.Random, n: int, vocab: int = 500) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def test_collocated_paths_equal_reference(model):
    """Recompute, L1 hit, L2 restore, same-iteration dedup, fork, mixed batches."""
    folder, hf = model
    ref = Ref(hf)
    node = LocalNode("a", PROFILE, folder)
    rng = random.Random(7)
    paths = {"recompute": 0, "l1_hit": 0, "l2_restore": 0, "dedup": 0, "mixed": 0}
    prompts: dict[str, list[int]] = {}

    def submit(rid: str, prompt: list[int], n: int) -> None:
        prompts[rid] = prompt
        node.add_prefill(work(rid, prompt, n))

    # turn 1 of an agent session, with two unrelated requests in the same batch
    sys_prompt = toks(rng, 70)
    submit("t1", sys_prompt + toks(rng, 30), 10)
    submit("x1", toks(rng, 45), 6)
    node.run()
    # turn 2 quotes turn 1's answer (L1 hit); fork: two branches of the same context at once
    t2 = prompts["t1"] + node.finished["t1"].tokens + toks(rng, 20)
    submit("t2", t2, 8)
    node.step()  # t2 decodes while the fork's prefills arrive: mixed iterations
    submit("fork_a", t2 + toks(rng, 12), 8)
    submit("fork_b", t2 + toks(rng, 17), 8)
    # the same new prompt twice at once: both compute its pages in one iteration (dedup)
    same = toks(rng, 40)
    submit("dup1", same, 5)
    submit("dup2", same, 5)
    node.run()
    # a sub-agent with its own prompt and many unrelated requests: they evict turn 2 from L1
    for i in range(8):
        submit(f"fill{i}", toks(rng, 120), 4)
        node.run()
    # turn 3 continues turn 2: its prefix is back from L2 (restored), the rest recomputed
    t3 = t2 + node.finished["t2"].tokens + toks(rng, 9)
    submit("t3", t3, 8)
    node.run()

    for rid, prompt in prompts.items():
        got = node.finished[rid]
        assert got.tokens == ref(prompt, len(got.tokens)), rid
    mixed = sum(1 for r in node.records if r.phase == "mixed")
    paths["mixed"] = mixed
    paths["recompute"] = sum(1 for rid in prompts if node.finished[rid].cached_tokens == 0)
    paths["l1_hit"] = sum(1 for rid in ("t2", "fork_a", "fork_b") if node.finished[rid].cached_tokens > 0)
    paths["l2_restore"] = node.engine.counters.get("restored_pages", 0)
    paths["dedup"] = node.engine.counters.get("dedup_pages", 0)
    assert node.finished["t3"].cached_tokens >= len(t2) // BS * BS - BS
    assert all(v > 0 for v in paths.values()), paths
    assert node.engine.counters["written_through"] > 0
    # measured times reach the iteration records (the planner fits Eq. 1/2 on them)
    assert all(r.duration_s > 0 for r in node.records)
    assert len({round(r.duration_s, 9) for r in node.records}) > 1


def test_handoff_decodes_from_real_pages(model):
    """Prefill on one node, decode on another from the handed-off K/V (no recompute)."""
    folder, hf = model
    ref = Ref(hf)
    p = LocalNode("p", PROFILE, folder, phase="prefill")
    d = LocalNode("d", PROFILE, folder, phase="decode")
    rng = random.Random(11)
    prompts = {f"h{i}": toks(rng, 37 + 16 * i) for i in range(3)}  # partial last pages
    prompts["h3"] = prompts["h0"][:32] + toks(rng, 16)  # full last page, shares h0's prefix
    for rid, pr in prompts.items():
        p.add_prefill(work(rid, pr, 9, decode_node="d"))
    p.run()
    assert len(p.handoffs) == 4
    for h in p.handoffs:
        d.add_decode(h.work)
    d.run()
    for rid, pr in prompts.items():
        got = d.finished[rid].tokens
        assert len(got) == 9
        assert got == ref(pr, 9), rid
    assert d.engine.counters["handoff_pages_in"] > 0
    assert d.engine.counters.get("tokens", 0) == 4 * 8  # only decode tokens computed on d


def test_decode_node_page_of_an_ended_request_is_not_reused(model):
    """A decode node's next request on the pages of the one that just ended: A (one full
    prompt page x, decodes into page y) ends; B shares A's prompt page x, its partial prompt
    page is y again (freed last, allocated first) and its first decode row has A's last
    context + 1 keys: the same pages one token on. The model reused A's gathered keys for B
    (A's output tokens' K/V in place of B's prompt) and B's third token was wrong (seed 1:
    [70, 172, 172, 172] against the reference's [70, 172, 103, 479])."""
    folder, hf = model
    ref = Ref(hf)
    rng = random.Random(1)
    a = toks(rng, BS)
    b = a + toks(rng, 3)  # A's last decode row attends 8 + 3 keys; B's first 8 + 3 + 1
    p = LocalNode("p", PROFILE, folder, phase="prefill")
    d = LocalNode("d", PROFILE, folder, phase="decode")
    p.add_prefill(work("A", a, 4, decode_node="d"))
    p.add_prefill(work("B", b, 4, decode_node="d"))
    p.run()
    handoffs = {h.rid: h.work for h in p.handoffs}
    d.add_decode(handoffs["A"])
    d.run()
    assert "A" not in d.engine.seqs  # A has ended and left the engine (its pages freed) before B arrives
    d.add_decode(handoffs["B"])
    d.run()
    assert d.finished["A"].tokens == ref(a, 4)
    assert d.finished["B"].tokens == ref(b, 4)


def test_queued_handoff_sharing_an_evicted_page_brings_it_back(model):
    """Hand-offs A and B share prompt page h (B is queued for L1 behind A, C1 and C2 on a
    5-page decode node). A stores h, decodes and ends; C1 evicts h from L1 and C2 from L2.
    B's transfer stores h again, from the bytes B brought. The engine kept one copy per hash
    and dropped it at A's store / first decode: B's BlockStored(gpu) raised KvMapError ("not
    computed, not in L2, not handed off"); the worker loop logs it and goes on with the rest of
    that event batch unapplied, its page map out of step with the pools."""
    import msgspec

    folder, hf = model
    ref = Ref(hf)
    rng = random.Random(3)
    shared = toks(rng, BS)
    prompts = {"A": (shared, 32), "C1": (toks(rng, 32), 8), "C2": (toks(rng, 32), 8), "B": (shared + toks(rng, 3), 13)}
    p = LocalNode("p", PROFILE, folder, phase="prefill")
    small = msgspec.structs.replace(PROFILE, memory=msgspec.structs.replace(PROFILE.memory, gpu_kv_tokens=5 * BS, host_kv_tokens=5 * BS))
    d = LocalNode("d", small, folder, phase="decode")
    for rid, (pr, n) in prompts.items():
        p.add_prefill(work(rid, pr, n, decode_node="d"))
    p.run()
    for h in p.handoffs:
        d.add_decode(h.work)  # every footprint is 5 pages: one at a time, in this order
    d.run()
    for rid, (pr, n) in prompts.items():
        assert d.finished[rid].tokens == ref(pr, n), rid
    assert d.engine.counters["handoff_pages_in"] == 10  # h twice: A's, then B's after the evictions
    assert not d.engine._incoming  # every hand-off's pages were let go


def test_page_recomputed_while_in_l2_keeps_one_version(model):
    """r1 computes pages h0 h1 of a 16-token prompt in chunks of 7, 8 and 1 tokens (budget 9)
    and ends; h1 leaves L1 (6 pages) but stays in L2. r2, the same prompt, hits h0 and, under
    the cache cap, computes h1 again in one 8-token chunk: the same tokens' K/V in the last
    bits apart (1e-6). Its page became L1's h1 next to the other L2 copy, and the invariant
    check (every L1 page's bytes = its L2 copy; live workers run with --check-invariants)
    raised KvMapError. Now L2's version is kept in both."""
    import msgspec

    folder, hf = model
    ref = Ref(hf)
    rng = random.Random(0)
    shared = toks(rng, 2 * BS)
    prompts = {"r0": (toks(rng, 2), 7), "r1": (shared, 1), "r2": (shared, 9)}
    small = msgspec.structs.replace(
        PROFILE,
        memory=msgspec.structs.replace(PROFILE.memory, gpu_kv_tokens=6 * BS, host_kv_tokens=6 * BS),
        scheduler=msgspec.structs.replace(PROFILE.scheduler, chunk_tokens=9, max_running=4),
    )
    node = LocalNode("a", small, folder)
    for rid, (pr, n) in prompts.items():
        node.add_prefill(work(rid, pr, n))
    node.run()  # check=True: the bytes invariant after every step
    for rid, (pr, n) in prompts.items():
        assert node.finished[rid].tokens == ref(pr, n), rid
    assert node.engine.counters["recomputed_kept_l2"] == 1


def test_corrupted_restore_is_detected(model):
    """The bytes check catches an L1 page that differs from its L2 copy."""
    folder, _ = model
    node = LocalNode("a", PROFILE, folder)
    rng = random.Random(1)
    node.add_prefill(work("r", toks(rng, 33), 2))
    node.run()
    h, page = next(iter(node.engine.page_of.items()))
    node.engine.k_cache[0][page].add_(1.0)
    gpu, host = node.core.snapshot()
    with pytest.raises(KvMapError, match="differs from its L2 copy"):
        node.engine.check(gpu, host)


def test_write_through_copies_a_page_before_the_batch_reuses_it(model):
    """Write-through copies (L1 page → L2 slot) are batched over an event batch
    (``TorchEngine._flush_write_through``), but one must still copy the bytes its page held at
    its ``BlockStored(host)``: here the page is evicted later in the same batch and a restore
    refills it with another page's bytes; copied at the batch's end, L2 would hold those."""
    folder, _ = model
    eng = TorchEngine(PROFILE, folder)
    shape = tuple(eng.host.shape[1:])
    gen = torch.Generator().manual_seed(0)
    kv_a, kv_b = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    eng.put_fetched(1, kv_a, fetch_id=1)
    eng.put_fetched(2, kv_b, fetch_id=1)

    def stored(tier: str, *hs: int) -> BlockStored:
        return BlockStored(block_hashes=list(hs), parent_block_hash=None, tier=tier, block_size=BS)

    # page 1 restored into L1 from its fetched L2 copy, then dropped from L2: in L1 only
    eng.apply_kv_events([stored("host", 1, 2), stored("gpu", 1), BlockRemoved(block_hashes=[1], tier="host")])
    page = eng.page_of[1]
    eng.apply_kv_events([stored("host", 1), BlockRemoved(block_hashes=[1], tier="gpu"), stored("gpu", 2)])
    assert eng.page_of[2] == page  # page 1's L1 page was freed and refilled in the batch ...
    assert torch.equal(eng.host_page(1), kv_a)  # ... after its write-through copied it
    assert torch.equal(eng.host_page(2), kv_b)
    assert eng.counters["written_through"] == 1


class _Event:
    """Stands in for the engine's ``torch.cuda.Event`` (``TorchEngine._l2_read``) on CPU: logs each call
    and, at ``synchronize``, whether the L2 slot under watch still held its restored bytes."""

    def __init__(self, eng: TorchEngine) -> None:
        self.eng = eng
        self.calls: list[object] = []
        self.watch: tuple[int, torch.Tensor] | None = None

    def record(self, stream: object) -> None:
        self.calls.append("record")

    def synchronize(self) -> None:
        slot, kv = self.watch if self.watch is not None else (None, None)
        self.calls.append(("wait", slot is None or torch.equal(self.eng.host[slot], kv)))


def test_cpu_write_into_l2_waits_for_enqueued_restores(model, monkeypatch):
    """On CUDA a restore's host → device copy from the pinned L2 is only enqueued; the CPU must not
    write that slot (freed and refilled with a fetched page) before the device ran it
    (``TorchEngine._await_l2_reads``). Pinned on CPU with a stand-in event: the fetched page's write
    waits once, before it writes, when a restore (or a recomputed page's L2 copy) is pending, and not
    otherwise; the write-through needs no wait (its blocking device → host copy orders it). Failed
    before the wait was added (no event was ever recorded or waited for)."""
    folder, _ = model
    eng = TorchEngine(PROFILE, folder, device="cpu")
    ev = eng._l2_read = _Event(eng)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    shape = tuple(eng.host.shape[1:])
    gen = torch.Generator().manual_seed(0)
    kv = {h: torch.randn(shape, generator=gen) for h in range(1, 6)}
    for h in kv:
        eng.put_fetched(h, kv[h], fetch_id=1)

    def stored(tier: str, *hs: int) -> BlockStored:
        return BlockStored(block_hashes=list(hs), parent_block_hash=None, tier=tier, block_size=BS)

    eng.apply_kv_events([stored("host", 1)])  # no restore pending: no wait
    assert ev.calls == []
    slot = eng.host_slot[1]
    ev.watch = (slot, kv[1])
    # restore 1 from its slot, free the slot, refill it with fetched page 2: one wait, before the write
    eng.apply_kv_events([stored("gpu", 1), BlockRemoved(block_hashes=[1], tier="host"), stored("host", 2)])
    assert eng.host_slot[2] == slot and torch.equal(eng.host_page(2), kv[2])
    assert ev.calls == ["record", ("wait", True)]
    eng.apply_kv_events([stored("host", 3)])  # nothing enqueued since: no second wait
    assert ev.calls == ["record", ("wait", True)]
    # a restore, then the write-through of an L1 page into a freed slot (device → host, blocking): no wait
    ev.calls.clear()
    ev.watch = None
    eng.apply_kv_events([stored("gpu", 3), BlockRemoved(block_hashes=[3], tier="host"), stored("host", 1)])
    assert ev.calls == ["record"] and torch.equal(eng.host_page(1), kv[1])
    eng.apply_kv_events([stored("host", 4)])  # ... but the next fetched page's write waits for that restore
    assert ev.calls == ["record", ("wait", True)]
    # a page recomputed while in L2 gets its L2 bytes copied into L1: a read of L2 like a restore
    ev.calls.clear()
    page = eng._alloc()
    eng._write_page(page, torch.randn(shape, generator=gen))
    eng._pending[4] = [("r", page)]
    eng.apply_kv_events([stored("gpu", 4)])
    assert eng.counters["recomputed_kept_l2"] == 1 and ev.calls == ["record"]
    eng.apply_kv_events([stored("host", 5)])
    assert ev.calls == ["record", ("wait", True)]


class _EagerWriteThrough(TorchEngine):
    """The write-through as it was before it was batched: each page copied at its own event."""

    def _store_host(self, h: int) -> None:
        super()._store_host(h)
        self._flush_write_through()


def test_batched_write_through_matches_per_event_copies_on_random_batches(model):
    """Random valid event batches (computed pages stored, recomputed over an L2 copy, fetched
    pages, write-through, restores, removals from either tier, clears) leave the batching engine's
    L1 and L2 bytes equal to those of an engine that copies each write-through page at its event.
    Fails when the flush before removals is taken out (a page freed and refilled in the batch
    before its deferred copy)."""
    folder, _ = model
    counts: dict[str, int] = {}
    for seed in range(6):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        a, b = TorchEngine(PROFILE, folder), _EagerWriteThrough(PROFILE, folder)
        shape = tuple(a.host.shape[1:])
        l1: set[int] = set()
        l2: set[int] = set()
        nxt = 1
        for _ in range(25):
            evs: list = []
            computed: list[int] = []
            for _ in range(rng.randrange(1, 10)):
                k = rng.random()
                free1, free2 = a.pages - len(l1), a.host.shape[0] - len(l2)
                in_l1_only = sorted(l1 - l2)
                in_l2_only = sorted(l2 - l1 - set(computed))
                if k < 0.2 and free1 and len(a._free) > len(computed):  # a page the last plan computed (on a page free before the batch)
                    computed.append(nxt)
                    evs.append(BlockStored(block_hashes=[nxt], parent_block_hash=None, tier="gpu", block_size=BS))
                    l1.add(nxt)
                    nxt += 1
                elif k < 0.35 and free2:  # fetched from a peer into L2
                    kv = torch.randn(shape, generator=gen)
                    for e in (a, b):
                        e.put_fetched(nxt, kv, fetch_id=nxt)
                    evs.append(BlockStored(block_hashes=[nxt], parent_block_hash=None, tier="host", block_size=BS))
                    l2.add(nxt)
                    nxt += 1
                elif k < 0.5 and free2 and in_l1_only:  # write-through
                    h = rng.choice(in_l1_only)
                    evs.append(BlockStored(block_hashes=[h], parent_block_hash=None, tier="host", block_size=BS))
                    l2.add(h)
                elif k < 0.65 and free1 and in_l2_only:  # restored (or recomputed over its L2 copy)
                    h = rng.choice(in_l2_only)
                    if rng.random() < 0.5:
                        computed.append(h)
                    evs.append(BlockStored(block_hashes=[h], parent_block_hash=None, tier="gpu", block_size=BS))
                    l1.add(h)
                elif k < 0.8 and l1:
                    h = rng.choice(sorted(l1))
                    evs.append(BlockRemoved(block_hashes=[h], tier="gpu"))
                    l1.discard(h)
                elif k < 0.95 and l2:
                    h = rng.choice(sorted(l2))
                    evs.append(BlockRemoved(block_hashes=[h], tier="host"))
                    l2.discard(h)
                elif k >= 0.97:
                    tier = rng.choice([None, "gpu", "host"])
                    evs.append(AllBlocksCleared(tier=tier))
                    if tier != "host":
                        l1.clear()
                    if tier != "gpu":
                        l2.clear()
            for h in computed:  # as execute leaves them: private pages awaiting BlockStored(gpu)
                kv = torch.randn(shape, generator=gen)
                for e in (a, b):
                    page = e._alloc()
                    e._write_page(page, kv)
                    e._pending[h] = [("r", page)]
            for e in (a, b):
                e.apply_kv_events(evs)
                for page in e._free[-3:]:  # the next forward may write free pages
                    e._write_page(page, torch.zeros(shape))
            assert set(a.page_of) == set(b.page_of) == l1 and set(a.host_slot) == set(b.host_slot) == l2
            for h in l2:
                assert torch.equal(a.host_page(h), b.host_page(h)), (seed, h, evs)
            for h in l1:
                assert torch.equal(a._page_kv(a.page_of[h]), b._page_kv(b.page_of[h])), (seed, h, evs)
        for key, n in a.counters.items():
            counts[key] = counts.get(key, 0) + n
    assert all(counts.get(k) for k in ("written_through", "restored_pages", "recomputed_kept_l2", "fetched_pages")), counts


def test_bad_model_folders(tmp_path, model):
    folder, _ = model
    with pytest.raises(ModelConfigError, match="no config.json"):
        TorchEngine(PROFILE, tmp_path)
    # a folder that does not exist said "no config.json" too; a hub id (vLLM's --model Qwen/Qwen3-0.6B) is named
    with pytest.raises(ModelConfigError, match="no such folder .*model init DIR"):
        TorchEngine(PROFILE, tmp_path / "missing")
    with pytest.raises(ModelConfigError, match="hub id is not downloaded: .*huggingface-cli download Qwen/Qwen3-0.6B"):
        TorchEngine(PROFILE, "Qwen/Qwen3-0.6B")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelConfigError, match="not supported"):
        TorchEngine(PROFILE, tmp_path)
    import msgspec

    spec = msgspec.structs.replace(PROFILE.decode, accepted_per_iteration=1.5)
    with pytest.raises(ModelConfigError, match="one token per iteration"):
        TorchEngine(msgspec.structs.replace(PROFILE, decode=spec), folder)
    eng = TorchEngine(PROFILE, folder)
    with pytest.raises(ValueError, match="context"):
        eng.accept_prefill(work("long", [1] * 1000, 100))


def test_model_init_cli(tmp_path):
    from evolving_infra.cli import main

    assert main(["model", "init", str(tmp_path / "bad"), "--vocab", "100"]) == 2
    assert main(["model", "init", str(tmp_path / "m"), "--arch", "qwen3", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1"]) == 0
    eng = TorchEngine(PROFILE, tmp_path / "m")
    assert eng.cfg.arch == "qwen3" and eng.cfg.num_layers == 1 and eng.cfg.qk_norm


def test_handoff_pages_missing_from_l1_is_a_kv_map_error(model):
    """A decode node's engine missed the KV batch that put a hand-off's prompt pages in L1 (a lost
    batch: ``--fault-skip-engine-kv-batch``; no ``--check-invariants`` to catch it at the drain).
    Its first decode must raise ``KvMapError`` (the node exits and is restarted). Before it was a
    bare ``KeyError``: the worker loop only counted it (``loop_errors``) with the plan still in
    flight, so every later step raised ``SchedulerError``: the node stayed up serving nothing."""
    folder, _ = model
    p = LocalNode("p", PROFILE, folder, phase="prefill")
    d = LocalNode("d", PROFILE, folder, phase="decode", check=False)
    p.add_prefill(work("h", toks(random.Random(12), 2 * BS + 5), 4, decode_node="d"))
    p.run()
    d.add_decode(p.handoffs[0].work)
    for _ in range(10):
        plan = d.core.schedule(d.now)
        lost = d.core.take_kv_events()  # the engine never sees this batch
        if plan is not None and any(r.rid == "h" for r in plan.reqs):
            assert any(isinstance(e, BlockStored) and e.tier == "gpu" for e in lost)
            with pytest.raises(KvMapError, match="hand-off page"):
                d.engine.execute(plan)
            return
        d.now = d.core.next_deadline() or d.now + 1.0
    raise AssertionError("the hand-off never decoded")


def test_a_newer_attempt_registered_again_frees_the_old_ones_pages(model):
    """The worker takes a newer attempt of a request it holds (``_newest_attempt``: the router
    re-dispatched it here) by aborting the old one in the core and registering the new work with
    the engine, with no KV drain (``gc``) in between. The old registration's private pages (its
    decode pages) must be freed: overwritten in ``seqs``, they were lost to the engine for good
    (``check``: 'L1 pages not conserved'; without it, one page per re-dispatch until ``_alloc``
    fails). Same for a hand-off registered again on a decode node."""
    import msgspec

    folder, hf = model
    ref = Ref(hf)
    rng = random.Random(5)
    pr = toks(rng, 2 * BS + 3)  # a partial last page: decoded into a private page
    node = LocalNode("n", PROFILE, folder)
    node.add_prefill(work("a", pr, 6))
    for _ in range(3):
        node.step()
    assert node.engine.seqs["a"].own  # decoding, on a page of its own
    node.core.abort("a", node.now)
    node.add_prefill(msgspec.structs.replace(work("a", pr, 6), attempt=2))
    node.run()  # check=True: pages conserved after every drain
    assert node.finished["a"].tokens == ref(pr, 6)

    p = LocalNode("p", PROFILE, folder, phase="prefill")
    d = LocalNode("d", PROFILE, folder, phase="decode")
    p.add_prefill(work("b", pr, 6, decode_node="d"))
    p.run()
    (h,) = p.handoffs
    d.add_decode(h.work)
    for _ in range(2):
        d.step()
    assert d.engine.seqs["b"].own
    d.core.abort("b", d.now)
    d.add_decode(msgspec.structs.replace(h.work, attempt=2))
    d.run()
    assert d.finished["b"].tokens == ref(pr, 6)
