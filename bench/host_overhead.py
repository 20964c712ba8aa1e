"""torch engine: host time per iteration outside the timed forward (tiny model, CPU).

    python bench/host_overhead.py [--batches 32,128] [--repeats 3] [--layers 2]

What ``bench/gpu_check.sh``'s throughput step showed on an H200 (a whole run at batch 128 taking
~1 s more than its prefill and decode iterations) measured where it is device-independent:
``LocalNode.run()`` of B requests × 128-token prompts (random ids, no shared prefix) × 64 output
tokens on the ``init_model`` tiny llama (hidden 64, vocabulary 512, ``--layers`` layers: 2 is the
tests' model, 24 the H200 run's layer count, whose per-layer work outside the forward scales
with it), ``torch-tiny-cpu`` with room for every page (131,072 L1 / 262,144 L2 tokens, a
16,384-token chunk budget, 256 running: one prefill iteration, then 63 decode iterations), no
invariant checks. Both the run and the engine's iterations are timed by this thread's CPU time
(``time.thread_time``: other processes on a shared box inflate it far less than wall time);
*outside* = whole run − Σ ``IterationRecord.duration_s × repeat`` = scheduling, KV-event
application (page maps, write-through L1 → L2 copies), token output. A warm-up run first; each
figure is the median of ``--repeats`` runs. Single-threaded torch. Prints Markdown.

For an A/B, run it from each tree (e.g. ``git archive OLD | tar -x -C /tmp/old``), alternating.
"""

from __future__ import annotations

import argparse
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
from services.worker.engines.torch_engine.checkpoint import init_model  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402

PROMPT, OUT = 128, 64


def profile():
    """torch-tiny-cpu with room for every page of 256 requests and one prefill iteration for all."""
    p = load_profile("torch-tiny-cpu")
    mem = msgspec.structs.replace(p.memory, gpu_kv_tokens=131_072, host_kv_tokens=262_144)
    sch = msgspec.structs.replace(p.scheduler, chunk_tokens=16_384, max_running=256)
    return msgspec.structs.replace(p, memory=mem, scheduler=sch)


def run_once(folder: str, b: int) -> tuple[float, float, int]:
    """One run of ``b`` requests: (whole run s, Σ iteration s, iterations), thread CPU time."""
    p = profile()
    rng = random.Random(0)
    node = LocalNode("h", p, folder, device="cpu", check=False, clock=time.thread_time)
    for i in range(b):
        pr = [rng.randrange(512) for _ in range(PROMPT)]
        node.add_prefill(PrefillWork(rid=f"r{i}", prompt_tokens=PROMPT, max_tokens=OUT, block_size=p.block_size,
                                     block_hashes=block_hashes(pr, p.block_size), token_ids=pack_tokens(pr)))  # fmt: skip
    t0 = time.thread_time()
    node.run()
    whole = time.thread_time() - t0
    if len(node.finished) != b:
        raise RuntimeError(f"{len(node.finished)} of {b} requests finished")
    return whole, sum(r.duration_s * r.repeat for r in node.records), sum(r.repeat for r in node.records)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="32,128", help="comma-separated batch sizes (default 32,128)")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per batch, after a warm-up (default 3)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the tiny model (default 2)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        folder = str(init_model(Path(d) / "m", layers=a.layers))
        print(f"layers {a.layers}, {PROMPT}-token prompts, {OUT} output tokens, thread CPU time, median of {a.repeats}\n")
        print("| batch | iterations | whole run s | Σ iterations s | outside s | outside ms / iteration |")
        print("|---|---|---|---|---|---|")
        for b in (int(x) for x in a.batches.split(",")):
            run_once(folder, b)
            rs = [run_once(folder, b) for _ in range(a.repeats)]
            out = statistics.median(w - f for w, f, _ in rs)
            it = rs[0][2]
            print(f"| {b} | {it} | {statistics.median(r[0] for r in rs):.3f} | {statistics.median(r[1] for r in rs):.3f} "
                  f"| {out:.3f} | {1e3 * out / it:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
