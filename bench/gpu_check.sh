#!/usr/bin/env bash
# One command for a lent CUDA machine: the torch engine's GPU checks.
#   bash bench/gpu_check.sh            (from the repository root)
# Python: $GPU_PYTHON as it is, when set (a machine whose python already has a CUDA build of
# PyTorch and transformers, and the project's other dependencies on PYTHONPATH, e.g. wheels
# unpacked with `pip install --target`); else a new .venv-gpu with the project, the torch extra
# and the registry's default (CUDA) PyTorch wheel, which needs network access.
# Steps, each under a time limit, all run even when one fails:
#   1. the `gpu`-marked tests (paged engine == transformers on cuda in float32; bfloat16 runs);
#   2. the torch engine's unit tests on cuda in float32 (bench/gpu_float32.py makes float32 the
#      default dtype where they leave it to the engine, so their comparisons with transformers hold);
#   3. the torch engine's live tests (real nats-server, worker processes on cuda, EI_DTYPE=float32);
#   4. throughput at bfloat16 on a Qwen2.5-0.5B-shaped random model (24 layers, hidden 896,
#      14 heads / 2 KV heads, vocabulary 32000): ours (EngineScheduler + TorchEngine, paged KV)
#      against transformers' generate() on the same prompts and GPU; "outside the iterations" is the
#      whole run less its timed iterations (scheduling, KV events and write-through, token output).
# Exit status: the number of failed steps (0: all passed). Nothing here runs without a CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${GPU_PYTHON:-}" ]; then
  PYX=$GPU_PYTHON
else
  VENV=${VENV:-.venv-gpu}
  if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet torch safetensors tokenizers transformers
    "$VENV/bin/python" -m pip install --quiet --no-deps -e .
    "$VENV/bin/python" -m pip install --quiet -e '.[test,hf]'
  fi
  PYX=$VENV/bin/python
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/bench:$PWD"
failed=0
step() {  # step NAME SECONDS CMD...: run CMD under a limit, report its status and time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}
"$PYX" - <<'PYEOF' || exit 99
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
PYEOF
step "gpu-marked tests" 60 "$PYX" -m pytest -q -p no:cacheprovider -m gpu tests/unit/worker/test_torch_engine_gpu.py
# -v: a step cut at its limit prints no summary, but each test's line shows how far it got
step "torch unit tests on cuda, float32" 130 "$PYX" -m pytest -v --tb=short -p no:cacheprovider -p gpu_float32 --timeout 60 \
  tests/unit/worker/test_torch_engine.py tests/unit/worker/test_torch_engine_fetch.py tests/unit/worker/test_torch_eos.py \
  tests/unit/worker/test_torch_logprobs.py tests/unit/worker/test_torch_penalties.py tests/unit/worker/test_torch_sampling.py \
  tests/unit/worker/test_torch_attention_groups.py tests/unit/worker/test_torch_model_archs.py
step "randomized torch tests on cuda, float32" 80 "$PYX" -m pytest -v --tb=short -p no:cacheprovider -p gpu_float32 --timeout 60 \
  tests/unit/worker/test_torch_engine_random.py tests/unit/worker/test_torch_engine_fetch_random.py
step "torch live tests on cuda, float32" 120 env EI_DTYPE=float32 "$PYX" -m pytest -q -p no:cacheprovider -p gpu_float32 --timeout 100 \
  tests/integration/test_torch_engine_live.py tests/integration/test_torch_sampling_live.py \
  tests/integration/test_torch_logprobs_live.py tests/integration/test_torch_engine_fatal_live.py
step "throughput, bfloat16" 90 "$PYX" - <<'PYEOF'
import random, tempfile, time
from pathlib import Path
import msgspec, torch, transformers
from shared.hashing import block_hashes, pack_tokens
from shared.messages import PrefillWork
from shared.profile import load_profile
from services.worker.engines.torch_engine.checkpoint import init_model
from services.worker.engines.torch_engine.local import LocalNode
p = load_profile("torch-tiny-cpu")
p = msgspec.structs.replace(p, memory=msgspec.structs.replace(p.memory, gpu_kv_tokens=131072, host_kv_tokens=262144),
                            scheduler=msgspec.structs.replace(p.scheduler, chunk_tokens=16384, max_running=256))
PROMPT, OUT = 128, 64
with tempfile.TemporaryDirectory() as d:
    t0 = time.perf_counter()
    folder = init_model(Path(d) / "m", arch="llama", layers=24, hidden=896, heads=14, kv_heads=2, vocab=32000, context=4096)
    print(f"model written in {time.perf_counter() - t0:.1f} s")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).cuda().eval()
    print(f"params {sum(x.numel() for x in hf.parameters()) / 1e6:.0f} M")
    rng = random.Random(0)
    print("| batch | ours prefill tok/s | HF prefill tok/s | ours decode tok/s | HF decode tok/s | ours whole run s | HF generate s | ours outside the iterations s |")
    print("|---|---|---|---|---|---|---|---|")
    for b in (1, 32, 128):
        prompts = [[rng.randrange(1000, 30000) for _ in range(PROMPT)] for _ in range(b)]
        res = {}
        for rep in range(2):  # the first of each is a warm-up
            node = LocalNode("g", p, str(folder), device="cuda", check=False)
            for i, pr in enumerate(prompts):
                node.add_prefill(PrefillWork(rid=f"r{i}", prompt_tokens=PROMPT, max_tokens=OUT, block_size=p.block_size,
                                             block_hashes=block_hashes(pr, p.block_size), token_ids=pack_tokens(pr)))
            torch.cuda.synchronize(); t0 = time.perf_counter(); node.run(); torch.cuda.synchronize(); whole = time.perf_counter() - t0
            pre = sum(r.duration_s * r.repeat for r in node.records if r.phase == "prefill")
            dec = sum(r.duration_s * r.repeat for r in node.records if r.phase == "decode")
            assert len(node.finished) == b, (len(node.finished), b)
            ids = torch.tensor(prompts, device="cuda")
            def gen(n):
                torch.cuda.synchronize(); t = time.perf_counter()
                with torch.no_grad():
                    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
                torch.cuda.synchronize(); return time.perf_counter() - t
            h1, hn = gen(1), gen(OUT)
            res = dict(ours_pre=b * PROMPT / pre if pre else float("nan"), hf_pre=b * PROMPT / h1, ours_dec=b * (OUT - 1) / dec,
                       hf_dec=b * (OUT - 1) / max(hn - h1, 1e-9), whole=whole, hn=hn, outside=whole - pre - dec)
        print(f"| {b} | {res['ours_pre']:,.0f} | {res['hf_pre']:,.0f} | {res['ours_dec']:,.0f} | {res['hf_dec']:,.0f} | {res['whole']:.2f} | {res['hn']:.2f} | {res['outside']:.2f} |")
PYEOF
echo "gpu_check: $failed step(s) failed"
exit "$failed"
