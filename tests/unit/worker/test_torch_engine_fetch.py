"""Bytes fetched from a peer (``--kv-pool real``) are held only while their fetch is open.

The scheduler core (``external_fetch``) and the torch engine, driven as the worker drives them
(:class:`LocalNode`): a peer node computes a prompt, its L2 bytes are the fetched pages
(``TorchEngine.put_fetched``, what ``on_fetched`` does with the Mooncake pool's copy), the
transfer is reported (``fetch_done``). Before, ``TorchEngine._fetched`` dropped a page only at
its ``BlockStored(host)``: a fetch abandoned (the request aborted while or after the bytes moved)
or pages the core did not store (past a missing page, no L2 room) stayed for the process's life
(8 MiB a page of a 7-8B model). Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shared.messages import FetchRange  # noqa: E402
from shared.profile import load_profile  # noqa: E402
from services.worker.engines.torch_engine.checkpoint import init_model  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402
from services.worker.kvpool.buffer import HostKvBuffer  # noqa: E402
from services.worker.kvpool.payload import checksum  # noqa: E402
from services.worker.kvpool.pool import FetchResult  # noqa: E402
from services.worker.service import take_fetched as _take_fetched  # noqa: E402
from tests.unit.worker.test_torch_engine import Ref, toks, work  # noqa: E402

PROFILE = load_profile("torch-tiny-cpu")
BS = PROFILE.block_size


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model-fetch")
    init_model(folder, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, context=1024, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    return str(folder), hf


def peer_and_fetch(folder: str, prompt: list[int], pages: int, profile=PROFILE, n: int = 4):
    """Peer ``a`` computed ``prompt`` (its L2 holds its pages); node ``b`` queued ``r`` with a
    fetch of the first ``pages`` pages from ``a``. Returns (a, b, the fetched hashes)."""
    a = LocalNode("a", PROFILE, folder)
    a.add_prefill(work("w", prompt, 1))
    a.run()
    b = LocalNode("b", profile, folder, external_fetch=True)
    b.add_prefill(msgspec.structs.replace(work("r", prompt, n), fetch=[FetchRange(node="a", start=0, end=pages)] if pages else []))
    hashes = [h for fs in b.core.take_fetch_starts() for _, hs in fs.sources for h in hs]
    assert len(hashes) == pages
    return a, b, hashes


def deliver(a: LocalNode, b: LocalNode, hashes: list[int], fetch_id: int = 1) -> None:
    """Peer ``a``'s L2 bytes of ``hashes`` into ``b``'s engine for fetch ``fetch_id`` (``r``'s: b's first)."""
    for h in hashes:
        b.engine.put_fetched(h, a.engine.host_page(h).clone(), fetch_id)


def test_stored_fetch_is_freed_and_serves_the_reference(model):
    folder, hf = model
    prompt = toks(random.Random(1), 6 * BS + 3)
    a, b, hashes = peer_and_fetch(folder, prompt, 5)
    deliver(a, b, hashes)
    assert b.engine.fetched_bytes() == 5 * b.engine.pool_slot_bytes()
    assert b.core.fetch_done("r", (), b.now)
    b.run()
    assert b.finished["r"].tokens == Ref(hf)(prompt, 4)
    assert b.engine.counters["fetched_pages"] == 5 and b.engine.counters.get("fetched_unstored_pages", 0) == 0
    assert not b.engine._fetched and b.engine.fetched_bytes() == 0


@pytest.mark.parametrize("when", ["bytes after the abort", "abort after fetch_done"])
def test_aborted_fetch_frees_its_pages(model, when):
    """The request leaves while its bytes move (the worker's ``kvfetch.late``: ``fetch_done``
    says False, the worker drops them) or after they were reported but before the link model's
    completion (the core cancels the fetch: ``take_fetch_ends``). Before, both kept the pages."""
    folder, _ = model
    prompt = toks(random.Random(2), 6 * BS + 3)
    a, b, hashes = peer_and_fetch(folder, prompt, 5)
    if when == "bytes after the abort":
        assert b.core.abort("r", b.now)
        b._drain()
        deliver(a, b, hashes)
        assert not b.core.fetch_done("r", (), b.now)
        assert b.engine.drop_fetched(1) == 5  # the worker's late path
    else:
        deliver(a, b, hashes)
        assert b.core.fetch_done("r", (), b.now)  # the link model is not done at b.now: completion waits
        assert b.core.fetching == 1
        assert b.core.abort("r", b.now)
        b._drain()
    assert not b.engine._fetched and b.engine.fetched_bytes() == 0
    assert b.engine.counters["fetched_unstored_pages"] == 5
    assert not b.core.kv.host.members  # nothing reached L2


def test_fetched_pages_the_core_does_not_store_are_freed(model):
    """Page 1 of 5 is missing (checksum failed): the core keeps page 0 and recomputes from 1;
    pages 2-4 arrived but are never stored. Before, they stayed in ``_fetched``."""
    folder, hf = model
    prompt = toks(random.Random(3), 6 * BS + 3)
    a, b, hashes = peer_and_fetch(folder, prompt, 5)
    deliver(a, b, [h for i, h in enumerate(hashes) if i != 1])
    assert b.core.fetch_done("r", {hashes[1]}, b.now)
    b.run()
    assert b.finished["r"].tokens == Ref(hf)(prompt, 4)
    assert b.engine.counters["fetched_pages"] == 1 and b.engine.counters["fetched_unstored_pages"] == 3
    assert not b.engine._fetched and b.engine.fetched_bytes() == 0


def test_fetched_pages_without_l2_room_are_freed(model):
    """L1 = L2 = 8 pages, 7 of them pinned by an earlier prompt's cached L1 pages: a fetch of 5
    finds room for 1; the rest is recomputed and its bytes let go."""
    folder, hf = model
    small = msgspec.structs.replace(PROFILE, memory=msgspec.structs.replace(PROFILE.memory, gpu_kv_tokens=8 * BS, host_kv_tokens=8 * BS))
    rng = random.Random(4)
    prompt = toks(rng, 5 * BS + 3)
    a, b, hashes = peer_and_fetch(folder, toks(rng, 7 * BS), 0, small)  # b serves its own prompt first
    a.add_prefill(work("w2", prompt, 1))
    a.run()
    b.run()
    b.add_prefill(msgspec.structs.replace(work("r", prompt, 4), fetch=[FetchRange(node="a", start=0, end=5)]))
    [fs] = b.core.take_fetch_starts()
    hashes = [h for _, hs in fs.sources for h in hs]
    deliver(a, b, hashes, fs.fetch_id)
    assert b.core.fetch_done("r", (), b.now)
    b.run()
    assert b.finished["r"].tokens == Ref(hf)(prompt, 4)
    c = b.engine.counters
    assert c["fetched_pages"] == 1 and c["fetched_unstored_pages"] == 4
    assert not b.engine._fetched and b.engine.fetched_bytes() == 0


def test_page_two_fetches_brought_outlives_the_first(model):
    """r1 and r2 fetch the same pages; r1's completion stores them; r2's fetch is still open:
    its pages stay held (r2's completion may need them again once L2 evicted them), and go
    when r2's fetch ends."""
    folder, _ = model
    prompt = toks(random.Random(5), 6 * BS + 3)
    a, b, hashes = peer_and_fetch(folder, prompt, 5)
    b.add_prefill(msgspec.structs.replace(work("r2", prompt, 2), fetch=[FetchRange(node="a", start=0, end=5)]))
    [fs2] = b.core.take_fetch_starts()
    deliver(a, b, hashes)
    deliver(a, b, hashes, fs2.fetch_id)
    assert b.core.fetch_done("r", (), b.now)
    b.now += 1.0  # both links done
    b.step()
    assert b.core.kv.host.absent(hashes) == []
    assert len(b.engine._fetched) == 5  # r2's fetch is open
    assert b.core.fetch_done("r2", (), b.now)
    b.run()
    assert not b.engine._fetched


def test_redispatched_request_is_not_completed_by_its_old_transfer(model):
    """The router re-dispatched ``r`` to this node (a newer attempt: the worker aborts the held one,
    ``_newest_attempt``) while the old attempt's transfer was still moving 3 pages; the new attempt
    fetches 5. The old transfer ends first: its report must not complete the new fetch (its
    ``missing`` says nothing of pages 3-4) nor its late path free the new fetch's bytes. Before
    (fetches keyed by rid), ``fetch_done("r")`` completed the new fetch with the old bytes and the
    completion stored pages 3-4 that had none: ``KvMapError``, the node exited."""
    folder, hf = model
    prompt = toks(random.Random(6), 6 * BS + 3)
    a = LocalNode("a", PROFILE, folder)
    a.add_prefill(work("w", prompt, 1))
    a.run()
    b = LocalNode("b", PROFILE, folder, external_fetch=True)
    b.add_prefill(msgspec.structs.replace(work("r", prompt, 4), fetch=[FetchRange(node="a", start=0, end=3)]))
    [old] = b.core.take_fetch_starts()
    b.core.abort("r", b.now)  # re-dispatched: the worker drops the held attempt ...
    b._drain()
    b.add_prefill(msgspec.structs.replace(work("r", prompt, 4), fetch=[FetchRange(node="a", start=0, end=5)]))
    [new] = b.core.take_fetch_starts()  # ... and serves the new one, fetching 5 pages
    old_hashes = [h for _, hs in old.sources for h in hs]
    new_hashes = [h for _, hs in new.sources for h in hs]
    assert len(old_hashes) == 3 and len(new_hashes) == 5
    deliver(a, b, old_hashes, old.fetch_id)  # the old transfer ends first (the worker's _transfer)
    assert not b.core.fetch_done("r", (), b.now, old.fetch_id)  # late: its attempt left
    b.engine.drop_fetched(old.fetch_id)
    b.now += 1.0  # the link model is done with the new fetch; its bytes have not come yet
    b.step()
    assert b.core.fetching == 1 and not b.core.kv.host.members
    deliver(a, b, new_hashes, new.fetch_id)
    assert b.core.fetch_done("r", (), b.now, new.fetch_id)
    b.run()
    assert b.finished["r"].tokens == Ref(hf)(prompt, 4)
    assert b.engine.counters["fetched_pages"] == 5
    assert not b.engine._fetched and b.engine.fetched_bytes() == 0


def take_fetched(engine, pool, results, fetch_id: int) -> set[int]:
    """The worker's ``take_fetched`` (the one ``WorkerService._take_fetched`` runs), its copy here at once."""
    return asyncio.run(_take_fetched(engine, pool, results, fetch_id))


class BufferPool:
    """The surface of ``HostKvPool`` that ``take_fetched`` uses (``buffer``: its pins and slots, ``unpin``)
    over a real ``HostKvBuffer``: a pool without its Mooncake endpoint."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.buffer = HostKvBuffer(slots, slot_bytes, payload="external")

    def has(self, h: int) -> bool:
        return self.buffer.has(h)

    def unpin(self, slot: int) -> None:
        self.buffer.unpin(slot, 0.0)


def two_fetches(folder: str, prompt: list[int]):
    """``r`` (fetch 1) and ``r2`` (``fs2``) on node ``b`` fetch the same 5 pages of ``prompt``; r's
    transfer committed them to ``pool`` and the engine took them (``take_fetched``).
    Returns (b, the hashes, fs2, pool)."""
    a, b, hashes = peer_and_fetch(folder, prompt, 5)
    b.add_prefill(msgspec.structs.replace(work("r2", prompt, 4), fetch=[FetchRange(node="a", start=0, end=5)]))
    [fs2] = b.core.take_fetch_starts()
    pool = BufferPool(8, b.engine.pool_slot_bytes())
    for h in hashes:
        pool.buffer.put(h, b.now, a.engine.host_page(h).contiguous().view(torch.uint8).numpy())
    assert take_fetched(b.engine, pool, [FetchResult("a", 5, fetched=tuple(hashes))], 1) == set()
    return b, hashes, fs2, pool


def test_pages_the_pool_held_already_are_held_for_the_second_fetch(model):
    """r1 and r2 fetch the same 5 pages; r1's transfer committed them to the pool, so r2's finds
    them held (``FetchResult.already``, nothing transferred). r1 leaves; r2's fetch completes. The
    worker (``take_fetched``) used to hand the engine only ``fetched``: r2 held none of the 5,
    r1's end freed them, and r2's completion stored pages without bytes (``KvMapError``: the node
    exited)."""
    folder, hf = model
    prompt = toks(random.Random(7), 6 * BS + 3)
    b, hashes, fs2, pool = two_fetches(folder, prompt)
    assert b.core.fetch_done("r", (), b.now, 1)
    res2 = FetchResult("a", 5, already=tuple(hashes))  # r2's transfer found them held
    assert take_fetched(b.engine, pool, [res2], fs2.fetch_id) == set()
    assert b.core.abort("r", b.now)
    b._drain()  # r1's fetch ended: its hold on the 5 pages goes; r2's stays
    assert len(b.engine._fetched) == 5
    assert b.core.fetch_done("r2", (), b.now, fs2.fetch_id)
    b.now += 1.0
    b.run()
    assert b.finished["r2"].tokens == Ref(hf)(prompt, 4)
    assert b.engine.counters["fetched_pages"] == 5
    assert not b.engine._fetched


def test_pages_the_pool_let_go_are_reported_missing(model):
    """r1's fetch ended before r2's transfer reported the pages the pool held for it (``already``),
    and the pool let one of them go meanwhile: the engine holds the other 4 for r2 and the one
    it has no bytes for comes back missing (recomputed). Before, the core stored all 5."""
    folder, hf = model
    prompt = toks(random.Random(8), 6 * BS + 3)
    b, hashes, fs2, pool = two_fetches(folder, prompt)
    assert b.core.abort("r", b.now)
    b._drain()
    assert not b.engine._fetched
    pool.buffer.evict(hashes[3], b.now)  # e.g. r1's kvfetch.late path
    res2 = FetchResult("a", 5, already=tuple(hashes))
    missing = take_fetched(b.engine, pool, [res2, RuntimeError("peer gone")], fs2.fetch_id)
    assert missing == {hashes[3]}
    assert b.core.fetch_done("r2", missing, b.now, fs2.fetch_id)
    b.now += 1.0
    b.run()
    assert b.finished["r2"].tokens == Ref(hf)(prompt, 4)
    assert b.engine.counters["fetched_pages"] == 3 and b.engine.counters["fetched_unstored_pages"] == 5 + 1
    assert not b.engine._fetched


def test_a_fetched_page_whose_block_the_engine_claimed_meanwhile_reaches_the_engine(model):
    """A fetch's page lands and verifies while this node's own store of the same block is claimed in the pool
    (``claim_events``: its copy in the execute thread not done yet). Before, the commit lost to the claim: the
    page came back in ``already`` with no slot to pin, ``take_fetched`` reported it missing (the fetch cut
    there, the page recomputed) and a claim filled without bytes left the pool without it. Now the fetched
    bytes are held: the engine takes all 5, ``r`` gets the reference tokens, the pool keeps the page."""
    folder, hf = model
    prompt = toks(random.Random(9), 6 * BS + 3)
    a, b, hashes = peer_and_fetch(folder, prompt, 5)
    pool = BufferPool(16, b.engine.pool_slot_bytes())
    buf = pool.buffer
    fetched, already, claim = [], [], None
    for i, h in enumerate(hashes):  # HostKvPool.fetch's reserve, Mooncake's read, settle_fetch's commit
        s = buf.reserve(h, b.now)
        raw = a.engine.host_page(h).contiguous().view(torch.uint8).numpy().reshape(-1)
        view = buf.slot_view(s)
        view[: raw.shape[0]] = raw
        view[raw.shape[0] :] = 0
        if i == 2:
            claim = buf.claim(h, b.now)
        (fetched if buf.commit(h, checksum(view)) else already).append(h)
    res = FetchResult("a", 5, fetched=tuple(fetched), already=tuple(already))
    assert take_fetched(b.engine, pool, [res], 1) == set()
    assert buf.fill(hashes[2], claim, None, b.now) is False and pool.has(hashes[2])  # its copy had no bytes
    buf.check()
    assert b.core.fetch_done("r", (), b.now, 1)
    b.now += 1.0
    b.run()
    assert b.finished["r"].tokens == Ref(hf)(prompt, 4)
    assert b.engine.counters["fetched_pages"] == 5

