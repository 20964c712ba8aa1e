"""The torch engine on a CUDA device (marked ``gpu``; skipped cleanly without CUDA or torch).

Same checks as the CPU tests, on ``cuda``: greedy outputs of the paged engine in
float32 equal transformers' ``generate()`` on the same device, on the
recompute, L1-hit, L2-restore and hand-off paths; bfloat16 (the CUDA default)
runs the same plans and produces in-vocabulary tokens; a restore's host → device copy
from the pinned L2 reads its slot's bytes even when the CPU refills the slot while the
copy still waits behind other work on the stream. ``bench/gpu_check.sh`` runs this file
on a lent GPU machine.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from shared.hashing import block_hashes, pack_tokens  # noqa: E402
from shared.messages import BlockRemoved, BlockStored, PrefillWork  # noqa: E402
from shared.profile import load_profile  # noqa: E402
from services.worker.engines.torch_engine.checkpoint import init_model  # noqa: E402
from services.worker.engines.torch_engine.engine import TorchEngine  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402

PROFILE = load_profile("torch-tiny-cpu")
BS = PROFILE.block_size


def _work(rid, prompt, n, decode_node=None):
    return PrefillWork(rid=rid, prompt_tokens=len(prompt), max_tokens=n, block_size=BS, block_hashes=block_hashes(prompt, BS),
                       token_ids=pack_tokens(prompt), decode_node=decode_node)  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-model")
    init_model(folder, arch="llama", seed=3, context=1024)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).cuda().eval()
    return str(folder), hf


def _ref(hf, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_cuda_paths_equal_reference(model):
    folder, hf = model
    rng = random.Random(2)
    node = LocalNode("a", PROFILE, folder, device="cuda", dtype="float32")
    assert node.engine.k_cache[0].is_cuda
    base = [rng.randrange(500) for _ in range(90)]
    prompts = {"r0": base + [rng.randrange(500) for _ in range(20)]}
    node.add_prefill(_work("r0", prompts["r0"], 8))
    node.run()
    prompts["r1"] = prompts["r0"] + node.finished["r0"].tokens + [rng.randrange(500) for _ in range(9)]
    node.add_prefill(_work("r1", prompts["r1"], 8))
    for i in range(12):  # unrelated requests evict r1's pages from L1 (1024 tokens) to L2; 8 left them there
        prompts[f"f{i}"] = [rng.randrange(500) for _ in range(120)]
        node.add_prefill(_work(f"f{i}", prompts[f"f{i}"], 3))
        node.run()
    prompts["r2"] = prompts["r1"] + node.finished["r1"].tokens + [rng.randrange(500) for _ in range(5)]
    node.add_prefill(_work("r2", prompts["r2"], 8))
    node.run()
    for rid, p in prompts.items():
        assert node.finished[rid].tokens == _ref(hf, p, len(node.finished[rid].tokens)), rid
    assert node.finished["r1"].cached_tokens > 0
    assert node.engine.counters.get("restored_pages", 0) > 0 and node.finished["r2"].cached_tokens > 0


def test_cuda_bfloat16_default(model):
    folder, _ = model
    node = LocalNode("b", PROFILE, folder, device="cuda")
    eng = node.engine
    assert eng.model.dtype == torch.bfloat16 and eng.host.is_pinned()
    node.add_prefill(_work("x", list(range(3, 60)), 6))
    node.run()
    toks = node.finished["x"].tokens
    assert len(toks) == 6 and all(0 <= t < eng.cfg.vocab_size for t in toks)


def test_restore_reads_l2_before_the_cpu_refills_its_slot(model):
    """A restore (L2 slot S → L1 page) is enqueued behind ~0.3 s of matmuls on the stream; in the same
    batch S is freed and the CPU writes a fetched page into it (``TorchEngine._store_host``). The
    restored page must hold the bytes S had at the restore: the CPU write waits for the enqueued copy
    (``TorchEngine._await_l2_reads``). Without that wait the copy read the fetched page's bytes.
    Written without a CUDA device at hand: not yet run on one."""
    folder, _ = model
    eng = TorchEngine(PROFILE, folder, device="cuda", dtype="float32")
    assert eng.host.is_pinned()
    shape = tuple(eng.host.shape[1:])
    gen = torch.Generator().manual_seed(0)
    kv_a, kv_b = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    eng.put_fetched(1, kv_a, fetch_id=1)
    eng.put_fetched(2, kv_b, fetch_id=1)

    def stored(tier, *hs):
        return BlockStored(block_hashes=list(hs), parent_block_hash=None, tier=tier, block_size=BS)

    eng.apply_kv_events([stored("host", 1)])
    slot = eng.host_slot[1]
    x = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(12):  # ~1.1 TFLOP each in float32: work queued ahead of the restore's copy
        y = x @ x
    ahead = torch.cuda.Event()
    ahead.record()
    assert not ahead.query(), "the matmuls finished before the restore was enqueued: no race to test"
    eng.apply_kv_events([stored("gpu", 1), BlockRemoved(block_hashes=[1], tier="host"), stored("host", 2)])
    assert eng.host_slot[2] == slot  # the restored slot was refilled by the CPU in the batch
    torch.cuda.synchronize()
    del y
    assert torch.equal(eng.host_page(2), kv_b)
    assert torch.equal(eng._page_kv(eng.page_of[1]).cpu(), kv_a)
