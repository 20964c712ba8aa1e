"""torch engine on CPU: prefill and decode throughput vs transformers' generate(), and Eq. 1/2 fit error.

    python bench/engine_bench.py [--model DIR] [--quick] [--out bench/engine_bench.json]

Model: the tiny checkpoint of ``evolving-infra model init`` (llama, 2 layers, hidden 64,
4 heads / 2 KV heads, vocab 512), written to a temp folder unless ``--model``.

* **Prefill tokens/s** at batch B ∈ {1, 8, 32}: B prompts of 128 tokens, ``max_tokens=1``,
  served by ``EngineScheduler`` + ``TorchEngine`` (``LocalNode``: no bus) — tokens / summed
  measured iteration time; against ``generate(max_new_tokens=1)`` on the same B prompts.
* **Decode tokens/s** at batch B: B prompts of 64 tokens, 64 output tokens each; decode
  tokens / summed time of the pure-decode iterations; against ``generate(max_new_tokens=64)``
  minus its ``max_new_tokens=1`` time (same prompts, so its prefill is taken out).
* **Eq. 1/2 fit**: a mixed workload (random prompt lengths 16–400, shared prefixes so some
  tokens come from cache, batches of 1–32, outputs 1–48) yields measured IterationRecords;
  every other record is held back, ``services.planner.fit.fit_node`` fits on the rest, and the
  mean relative error |T̂ − T| / T on the held-back records is reported (goal < 10 %).

Each figure is the median of ``--repeats`` runs (default 3). One process, single-threaded
torch (``torch.set_num_threads(1)``) for both engines so the comparison is like for like on
the shared 2-core box. Writes JSON to ``--out`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import torch  # noqa: E402

from shared.hashing import block_hashes, pack_tokens  # noqa: E402
from shared.messages import PrefillWork  # noqa: E402
from shared.profile import load_profile  # noqa: E402
from services.planner.fit import fit_node, mean_relative_error  # noqa: E402
from services.worker.engines.torch_engine.checkpoint import init_model  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402


def bench_profile():
    """torch-tiny-cpu with room for 32 × (128 + 64) tokens in L1 and a 4,096-token budget."""
    p = load_profile("torch-tiny-cpu")
    mem = msgspec.structs.replace(p.memory, gpu_kv_tokens=16_384, host_kv_tokens=65_536)
    sch = msgspec.structs.replace(p.scheduler, chunk_tokens=4096, max_running=64)
    return msgspec.structs.replace(p, memory=mem, scheduler=sch)


def work(rid: str, prompt: list[int], n: int, bs: int) -> PrefillWork:
    return PrefillWork(rid=rid, prompt_tokens=len(prompt), max_tokens=n, block_size=bs,
                       block_hashes=block_hashes(prompt, bs), token_ids=pack_tokens(prompt))  # fmt: skip


def ours(model: str, prompts: list[list[int]], n: int, tag: str) -> tuple[float, float, list]:
    """(prefill s, decode s, records) of serving ``prompts`` with ``n`` output tokens each."""
    prof = bench_profile()
    node = LocalNode("bench", prof, model, check=False)
    for i, p in enumerate(prompts):
        node.add_prefill(work(f"{tag}{i}", p, n, prof.block_size))
    node.run()
    pre = sum(r.duration_s for r in node.records if r.phase != "decode")
    dec = sum(r.duration_s * r.repeat for r in node.records if r.phase == "decode")
    return pre, dec, node.records


def theirs(hf, prompts: list[list[int]], n: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return time.perf_counter() - t0


def fit_workload(model: str, seed: int) -> list:
    """Records of a mixed workload (see the module docstring)."""
    rng = random.Random(seed)
    prof = bench_profile()
    node = LocalNode("fit", prof, model, check=False)
    roots = [[rng.randrange(500) for _ in range(rng.randint(16, 200))] for _ in range(6)]
    k = 0
    for wave in range(12):
        for _ in range(rng.choice((1, 2, 4, 8, 16, 32))):
            base = rng.choice(roots) if rng.random() < 0.5 else []
            prompt = base + [rng.randrange(500) for _ in range(rng.randint(16, 200))]
            node.add_prefill(work(f"f{k}", prompt, rng.randint(1, 48), prof.block_size))
            k += 1
        for _ in range(rng.randint(3, 30)):  # the next wave arrives while this one runs: mixed iterations
            if not node.step():
                break
    node.run()
    return node.records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: a fresh `model init` tiny llama)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported (default 3)")
    ap.add_argument("--quick", action="store_true", help="1 repeat, batches 1 and 8 only (a smoke run)")
    ap.add_argument("--out", default=str(REPO / "bench" / "engine_bench.json"), help="JSON output path")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.TemporaryDirectory(prefix="ei-engine-bench-")
        model = str(init_model(Path(tmp.name) / "tiny", arch="llama", seed=0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.eval()
    repeats = 1 if args.quick else args.repeats
    batches = (1, 8) if args.quick else (1, 8, 32)
    rng = random.Random(0)
    rows = []
    for b in batches:
        pre_ours, pre_hf, dec_ours, dec_hf = [], [], [], []
        for r in range(repeats):
            pp = [[rng.randrange(500) for _ in range(128)] for _ in range(b)]
            pre, _, _ = ours(model, pp, 1, f"p{b}-{r}-")
            pre_ours.append(b * 128 / pre)
            pre_hf.append(b * 128 / theirs(hf, pp, 1))
            dp = [[rng.randrange(500) for _ in range(64)] for _ in range(b)]
            _, dec, _ = ours(model, dp, 64, f"d{b}-{r}-")
            dec_ours.append(b * 63 / dec)
            t_all, t_one = theirs(hf, dp, 64), theirs(hf, dp, 1)
            dec_hf.append(b * 63 / max(t_all - t_one, 1e-9))
        row = {
            "batch": b,
            "prefill_tok_s": statistics.median(pre_ours),
            "prefill_tok_s_hf": statistics.median(pre_hf),
            "decode_tok_s": statistics.median(dec_ours),
            "decode_tok_s_hf": statistics.median(dec_hf),
        }
        row["prefill_ratio"] = row["prefill_tok_s"] / row["prefill_tok_s_hf"]
        row["decode_ratio"] = row["decode_tok_s"] / row["decode_tok_s_hf"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    recs = fit_workload(model, seed=1)
    train, held = recs[0::2], recs[1::2]
    prof = bench_profile()
    fit = fit_node(train, prof.prefill, prof.decode)
    held_err = mean_relative_error(held, fit.prefill or prof.prefill, fit.decode or prof.decode)
    phases = {ph: sum(1 for r in recs if r.phase == ph) for ph in ("prefill", "decode", "mixed")}
    import os

    out = {
        "model": "tiny llama (2 layers, hidden 64, 4/2 heads, vocab 512), float32, CPU, 1 thread",
        "load_average_1_5_15": list(os.getloadavg()),
        "throughput": rows,
        "fit": {
            "records": len(recs),
            "phases": phases,
            "train": len(train),
            "held_back": len(held),
            "fit_error_train": fit.fit_error,
            "mean_rel_error_held_back": held_err,
            "prefill": None if fit.prefill is None else msgspec.to_builtins(fit.prefill),
            "decode": None if fit.decode is None else msgspec.to_builtins(fit.decode),
        },
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print("\n| batch | prefill tok/s (ours / HF generate = ratio) | decode tok/s (ours / HF generate = ratio) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['prefill_tok_s']:,.0f} / {r['prefill_tok_s_hf']:,.0f} = {r['prefill_ratio']:.2f}× "
              f"| {r['decode_tok_s']:,.0f} / {r['decode_tok_s_hf']:,.0f} = {r['decode_ratio']:.2f}× |")  # fmt: skip
    print(f"\nEq. 1/2 fit: {len(train)} records fitted, {len(held)} held back ({phases}); "
          f"mean relative error held back {held_err:.1%} (train {fit.fit_error:.1%}); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
