#!/usr/bin/env bash
# One command for a lent CUDA machine: the torch engine's GPU checks.
#   bash bench/gpu_check.sh            (from the repository root)
# Creates .venv-gpu with the project, the torch extra and a CUDA build of PyTorch (the
# default wheel from the registry, not the pinned CPU build), prints the device, runs the
# `gpu`-marked tests (paged engine == transformers on cuda, bfloat16 default) and the CPU
# engine tests on the same install, then a short decode-throughput run on cuda.
# Exit status: non-zero if any step fails. Nothing here runs without a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet torch safetensors tokenizers transformers
  "$VENV/bin/python" -m pip install --quiet --no-deps -e .
  "$VENV/bin/python" -m pip install --quiet -e '.[test,hf]'
fi
"$VENV/bin/python" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
PYEOF
"$VENV/bin/python" -m pytest -q -m gpu tests/unit/worker/test_torch_engine_gpu.py
"$VENV/bin/python" -m pytest -q tests/unit/worker/test_torch_engine.py
"$VENV/bin/python" - <<'PYEOF'
import random, tempfile, time
from pathlib import Path
import msgspec
from shared.hashing import block_hashes, pack_tokens
from shared.messages import PrefillWork
from shared.profile import load_profile
from services.worker.engines.torch_engine.checkpoint import init_model
from services.worker.engines.torch_engine.local import LocalNode
p = load_profile("torch-tiny-cpu")
p = msgspec.structs.replace(p, memory=msgspec.structs.replace(p.memory, gpu_kv_tokens=65536, host_kv_tokens=262144),
                            scheduler=msgspec.structs.replace(p.scheduler, chunk_tokens=8192, max_running=128))
with tempfile.TemporaryDirectory() as d:
    folder = init_model(Path(d) / "m", arch="llama", layers=4, hidden=256, heads=8, kv_heads=2, vocab=1024)
    rng = random.Random(0)
    for b in (1, 32, 128):
        node = LocalNode("g", p, str(folder), device="cuda", check=False)
        for i in range(b):
            pr = [rng.randrange(1000) for _ in range(128)]
            node.add_prefill(PrefillWork(rid=f"r{i}", prompt_tokens=128, max_tokens=64, block_size=p.block_size,
                                         block_hashes=block_hashes(pr, p.block_size), token_ids=pack_tokens(pr)))
        node.run()
        dec = sum(r.duration_s * r.repeat for r in node.records if r.phase == "decode")
        print(f"cuda bf16 decode batch {b}: {b * 63 / dec:,.0f} tok/s")
PYEOF
echo "gpu_check: all passed"
