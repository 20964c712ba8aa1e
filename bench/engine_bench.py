"""torch engine on CPU: prefill and decode throughput vs transformers' generate(), and Eq. 1/2 fit error.

    python bench/engine_bench.py [--model DIR] [--quick] [--clock wall|thread] [--repeats N] [--out bench/engine_bench.json]

Model: the tiny checkpoint of ``evolving-infra model init`` (llama, 2 layers, hidden 64,
4 heads / 2 KV heads, vocab 512), written to a temp folder unless ``--model``.

* **Prefill tokens/s** at batch B ∈ {1, 8, 32}: B prompts of 128 tokens, ``max_tokens=1``,
  served by ``EngineScheduler`` + ``TorchEngine`` (``LocalNode``: no bus) — tokens / summed
  measured iteration time; against ``generate(max_new_tokens=1)`` on the same B prompts.
* **Decode tokens/s** at batch B: B prompts of 64 tokens, 64 output tokens each; decode
  tokens / summed time of the pure-decode iterations; against ``generate(max_new_tokens=64)``
  minus its ``max_new_tokens=1`` time (same prompts, so its prefill is taken out).
  Both engines are timed by one clock (``--clock``): wall time (default) or this thread's
  CPU time (``thread``: on a shared, loaded box other processes inflate it far less);
  ours and HF alternate within each repeat.
* **Eq. 1/2 fit**: a mixed workload on torch-tiny-cpu's scheduler (256-token chunk budget;
  requests arriving a few per iteration, prompt lengths 16–400 with shared prefixes so some
  tokens come from cache, outputs 1–48, up to 32 running) yields 600 measured IterationRecords
  after 20 warm-up records are dropped; every other record *of each phase* (prefill, decode,
  mixed) is held back, so both halves have the same mix; ``services.planner.fit.fit_node``
  fits on the rest, and the mean relative error |T̂ − T| / T on the held-back records is
  reported, overall and per phase (goal < 10 %). Run twice: with the engine timing iterations
  by wall time (what serving sees; the figure for the goal) and by its thread's CPU time
  (which other processes on a shared box inflate far less). Diagnostic (not in the
  planner): the held-back error when a decode context term (keys the decode rows attend)
  is added to the fitted predictions (:func:`context_diagnostic`), i.e. how much of the
  error is attention over context that Eq. 2 lacks.
* **Decode vs context**: a pure decode iteration at batch 8 with 32-token and with 480-token
  contexts (Eq. 2 has no context term, so it predicts the same time for both).
* **Noise floor**: one decode forward (batch 30, contexts 16–400) repeated 400 times on the
  same inputs, thread CPU time: mean |t − median| / median, the error an exact model would
  still show on single records on this box at this load (:func:`repeat_noise`).

Each figure is the median of ``--repeats`` runs (default 3). One process, single-threaded
torch (``torch.set_num_threads(1)``) for both engines so the comparison is like for like on
the shared 2-core box. Writes JSON to ``--out``, prints the figures as Markdown and appends
them as a section to ``bench/RESULTS-history.md`` (``--no-write``: print only).
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

RESULTS = REPO / "bench" / "RESULTS-history.md"


def bench_profile():
    """torch-tiny-cpu with room for 32 × (128 + 64) tokens in L1 and a 4,096-token budget."""
    p = load_profile("torch-tiny-cpu")
    mem = msgspec.structs.replace(p.memory, gpu_kv_tokens=16_384, host_kv_tokens=65_536)
    sch = msgspec.structs.replace(p.scheduler, chunk_tokens=4096, max_running=64)
    return msgspec.structs.replace(p, memory=mem, scheduler=sch)


def work(rid: str, prompt: list[int], n: int, bs: int) -> PrefillWork:
    return PrefillWork(rid=rid, prompt_tokens=len(prompt), max_tokens=n, block_size=bs,
                       block_hashes=block_hashes(prompt, bs), token_ids=pack_tokens(prompt))  # fmt: skip


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
"""``--clock``: what both engines' throughput is timed with (seconds)."""


def ours(model: str, prompts: list[list[int]], n: int, tag: str, clock=time.perf_counter) -> tuple[float, float, list]:
    """(prefill s, decode s, records) of serving ``prompts`` with ``n`` output tokens each,
    the engine timing its iterations with ``clock``."""
    prof = bench_profile()
    node = LocalNode("bench", prof, model, check=False, clock=clock)
    for i, p in enumerate(prompts):
        node.add_prefill(work(f"{tag}{i}", p, n, prof.block_size))
    node.run()
    pre = sum(r.duration_s for r in node.records if r.phase != "decode")
    dec = sum(r.duration_s * r.repeat for r in node.records if r.phase == "decode")
    return pre, dec, node.records


def theirs(hf, prompts: list[list[int]], n: int, clock=time.perf_counter) -> float:
    """Seconds (by ``clock``) of ``generate()`` of ``n`` tokens for ``prompts``, its default cache."""
    ids = torch.tensor(prompts)
    t0 = clock()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return clock() - t0


def fit_profile():
    """torch-tiny-cpu's scheduler (256-token chunk budget, 32 running) with room in L1 for the
    fit workload's batches: prompts longer than the budget take several (prefill or mixed)
    iterations, as on a live node."""
    p = load_profile("torch-tiny-cpu")
    mem = msgspec.structs.replace(p.memory, gpu_kv_tokens=16_384, host_kv_tokens=65_536)
    return msgspec.structs.replace(p, memory=mem)


WARMUP_RECORDS = 20
"""Records dropped at the start of the fit workload (first forwards of each shape: allocator, caches)."""


def fit_workload(model: str, seed: int, n_records: int = 600, clock=time.perf_counter, contexts: dict | None = None) -> list:
    """Measured IterationRecords of a mixed workload (see the module docstring), warm-up dropped.

    Requests arrive a few at a time while others run (0–4 per iteration, bursts of up to
    16 now and then), so prefill, decode and mixed iterations interleave with decode
    batches of 1–32 and chunks of 16–256 tokens. ``contexts`` (when given) receives, by
    ``id(record)``, the keys its decode rows attended per iteration (Σ (context + 1),
    a feature Eq. 2 does not have; for :func:`context_diagnostic`)."""
    rng = random.Random(seed)
    prof = fit_profile()
    node = LocalNode("fit", prof, model, check=False, clock=clock)
    keys = [0]
    forward = node.engine.model

    def counting(tokens, positions, seqs, *rest):  # Σ keys of the decode rows, outside the timed forward's math
        keys[0] += sum(sq.ctx + 1 for sq in seqs if sq.n == 1)
        return forward(tokens, positions, seqs, *rest)

    if contexts is not None:
        node.engine.model = counting
    roots = [[rng.randrange(500) for _ in range(rng.randint(16, 200))] for _ in range(6)]
    k = 0
    while len(node.records) < n_records + WARMUP_RECORDS:
        arrivals = rng.choice((0, 0, 0, 1, 1, 2, 4)) if rng.random() > 0.03 else 16
        if len(node.core.requests) >= 48:
            arrivals = 0
        for _ in range(arrivals):
            base = rng.choice(roots) if rng.random() < 0.5 else []
            prompt = base + [rng.randrange(500) for _ in range(rng.randint(16, 200))]
            node.add_prefill(work(f"f{k}", prompt, rng.randint(1, 48), prof.block_size))
            k += 1
        before, keys[0] = len(node.records), 0
        node.step()
        if contexts is not None and len(node.records) > before:  # one record per plan
            rec = node.records[-1]
            contexts[id(rec)] = keys[0] / rec.repeat
    return node.records[WARMUP_RECORDS : WARMUP_RECORDS + n_records]


def split_by_phase(recs: list) -> tuple[list, list]:
    """Every other record of each phase fitted, the rest held back: both halves have the
    same mix of prefill, decode and mixed iterations."""
    train, held = [], []
    for ph in ("prefill", "decode", "mixed"):
        rs = [r for r in recs if r.phase == ph]
        train += rs[0::2]
        held += rs[1::2]
    return train, held


def context_diagnostic(train: list, held: list, keys: dict, pm, dm) -> float:
    """Held-back mean relative error of the fitted Eq. 1/2 predictions T̂ with a decode
    context term added: T ≈ α·T̂ + β·K (K = keys attended by the decode rows, α, β ≥ 0
    fitted on ``train`` by NNLS on relative residuals). A diagnostic of how much of the
    error the missing context term explains; the planner's equations stay the paper's."""
    import numpy as np
    from scipy.optimize import nnls

    from services.planner.fit import predict

    def cols(rs):
        y = np.array([r.duration_s for r in rs])
        return np.stack([predict(rs, pm, dm), np.array([keys[id(r)] for r in rs])], 1), y

    a, y = cols(train)
    coef, _ = nnls(a / y[:, None], np.ones_like(y))
    ah, yh = cols(held)
    return float(np.mean(np.abs(ah @ coef - yh) / yh))


def fit_report(model: str, clock) -> dict:
    """Fit Eq. 1/2 on half of the fit workload's records (``clock``: what the engine times
    iterations with) and report the error on the other half (see the module docstring)."""
    keys: dict = {}
    recs = fit_workload(model, seed=1, clock=clock, contexts=keys)
    train, held = split_by_phase(recs)
    prof = fit_profile()
    fit = fit_node(train, prof.prefill, prof.decode)
    pm, dm = fit.prefill or prof.prefill, fit.decode or prof.decode
    phases = {ph: sum(1 for r in recs if r.phase == ph) for ph in ("prefill", "decode", "mixed")}
    return {
        "records": len(recs),
        "phases": phases,
        "train": len(train),
        "held_back": len(held),
        "fit_error_train": fit.fit_error,
        "mean_rel_error_held_back": mean_relative_error(held, pm, dm),
        "mean_rel_error_held_back_by_phase": {
            ph: mean_relative_error([r for r in held if r.phase == ph], pm, dm) for ph in phases if phases[ph]
        },
        "warmup_records_dropped": WARMUP_RECORDS,
        "mean_rel_error_held_back_with_context_term": context_diagnostic(train, held, keys, pm, dm),
        "prefill": None if fit.prefill is None else msgspec.to_builtins(fit.prefill),
        "decode": None if fit.decode is None else msgspec.to_builtins(fit.decode),
    }


def decode_context_effect(model: str, batch: int = 8, short: int = 32, long: int = 480, n: int = 17) -> dict:
    """Median thread-CPU time of a pure decode iteration at one batch size with short and with
    long contexts: Eq. 2 (``d0 + d1·φ(B) + d2·B``) predicts the same time for both."""
    rng = random.Random(2)
    out = {"batch": batch, "context_short": short, "context_long": long}
    for key, plen in (("ms_short", short), ("ms_long", long)):
        prompts = [[rng.randrange(500) for _ in range(plen)] for _ in range(batch)]
        prof = bench_profile()
        node = LocalNode("ctx", prof, model, check=False, clock=time.thread_time)
        for i, p in enumerate(prompts):
            node.add_prefill(work(f"c{key}{i}", p, n, prof.block_size))
        node.run()
        ts = [r.duration_s for r in node.records if r.phase == "decode" and r.decode_batch == batch]
        out[key] = statistics.median(ts) * 1e3
    return out


def repeat_noise(model: str, batch: int = 30, n: int = 400, seed: int = 3) -> dict:
    """The noise floor of single iteration timings on this box: one decode forward (``batch``
    rows with contexts of 16–400 tokens, as in the fit workload) run ``n`` times on the same
    inputs, timed by thread CPU time; ``mean |t − median| / median`` is the mean relative
    error that even an exact model of the iteration time would show on single records."""
    import numpy as np

    from services.worker.engines.torch_engine.model import PagedDecoder, SeqBatch

    dec = PagedDecoder.from_folder(model, torch.float32, torch.device("cpu"))
    kc, vc = dec.new_cache(4096, 8)
    rng = random.Random(seed)
    free = list(range(4096))
    rng.shuffle(free)
    ctxs = sorted((rng.randint(16, 400) for _ in range(batch)), reverse=True)
    seqs = [SeqBatch(b, 1, c, [free.pop() for _ in range(-(-(c + 1) // 8))]) for b, c in enumerate(ctxs)]
    toks, pos = torch.tensor([rng.randrange(500) for _ in ctxs]), torch.tensor(ctxs)
    ts = []
    for i in range(n + 20):
        t0 = time.thread_time()
        dec(toks, pos, seqs, kc, vc, None)
        if i >= 20:
            ts.append(time.thread_time() - t0)
    a = np.array(ts)
    med = float(np.median(a))
    return {"batch": batch, "runs": n, "median_ms": med * 1e3, "mean_rel_dev": float(np.mean(np.abs(a - med)) / med)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: a fresh `model init` tiny llama)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported (default 3)")
    ap.add_argument("--quick", action="store_true", help="1 repeat, batches 1 and 8 only (a smoke run)")
    ap.add_argument("--out", default=str(REPO / "bench" / "engine_bench.json"), help="JSON output path")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to bench/RESULTS-history.md")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="clock of the throughput figures, for both engines: wall (default) or thread "
                         "(this thread's CPU time: what a shared, loaded box inflates far less)")  # fmt: skip
    args = ap.parse_args(argv)
    clock = CLOCKS[args.clock]
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
            pre, _, _ = ours(model, pp, 1, f"p{b}-{r}-", clock)
            pre_ours.append(b * 128 / pre)
            pre_hf.append(b * 128 / theirs(hf, pp, 1, clock))
            dp = [[rng.randrange(500) for _ in range(64)] for _ in range(b)]
            _, dec, _ = ours(model, dp, 64, f"d{b}-{r}-", clock)
            dec_ours.append(b * 63 / dec)
            t_all, t_one = theirs(hf, dp, 64, clock), theirs(hf, dp, 1, clock)
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
    fits = {name: fit_report(model, clock) for name, clock in (("wall", time.perf_counter), ("cpu", time.thread_time))}
    ctx_effect = decode_context_effect(model)
    noise = repeat_noise(model)
    import os

    out = {
        "model": "tiny llama (2 layers, hidden 64, 4/2 heads, vocab 512), float32, CPU, 1 thread",
        "throughput_clock": args.clock,
        "load_average_1_5_15": list(os.getloadavg()),
        "throughput": rows,
        "fit": fits["wall"],
        "fit_thread_cpu_time": fits["cpu"],
        "decode_context_effect": ctx_effect,
        "repeat_noise": noise,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    load = os.getloadavg()
    lines = [
        "| batch | prefill tok/s (ours / HF generate = ratio) | decode tok/s (ours / HF generate = ratio) |",
        "|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prefill_tok_s']:,.0f} / {r['prefill_tok_s_hf']:,.0f} = {r['prefill_ratio']:.2f}× "
                     f"| {r['decode_tok_s']:,.0f} / {r['decode_tok_s_hf']:,.0f} = {r['decode_ratio']:.2f}× |")  # fmt: skip
    lines.append("")
    for name, f in (("wall time", fits["wall"]), ("thread CPU time", fits["cpu"])):
        by = ", ".join(f"{ph} {e:.1%}" for ph, e in f["mean_rel_error_held_back_by_phase"].items())
        lines.append(f"Eq. 1/2 fit on {name}: {f['train']} records fitted, {f['held_back']} held back (of {f['phases']}, "
                     f"{WARMUP_RECORDS} warm-up records dropped); mean relative error held back "
                     f"**{f['mean_rel_error_held_back']:.1%}** ({by}; train {f['fit_error_train']:.1%}; "
                     f"with a decode context term added, diagnostic only: {f['mean_rel_error_held_back_with_context_term']:.1%}); "
                     f"fitted prefill {f['prefill']}, decode {f['decode']}.")  # fmt: skip
        lines.append("")
    lines.append(f"Decode at batch {ctx_effect['batch']} (thread CPU time per iteration): {ctx_effect['ms_short']:.2f} ms at context "
                 f"{ctx_effect['context_short']}, {ctx_effect['ms_long']:.2f} ms at context {ctx_effect['context_long']} "
                 "(Eq. 2 has no context term: it predicts one time for both).")  # fmt: skip
    lines.append("")
    lines.append(f"Noise floor: one decode forward at batch {noise['batch']} (contexts 16–400) run {noise['runs']} times on the same "
                 f"inputs, thread CPU time: median {noise['median_ms']:.2f} ms, mean |t − median| / median "
                 f"**{noise['mean_rel_dev']:.1%}** (what an exact model would still miss by on single records at this load).")  # fmt: skip
    print("\n" + "\n".join(lines))
    print(f"load average {load[0]:.1f} on {os.cpu_count()} CPUs")
    if not args.no_write:
        from _common import commit_label

        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        head = (f"\n## torch engine (tiny model, CPU) — {stamp}\n\n- command: `python bench/engine_bench.py"
                f"{' --quick' if args.quick else ''}{' --clock ' + args.clock if args.clock != 'wall' else ''}"
                f"{f' --repeats {args.repeats}' if args.repeats != 3 and not args.quick else ''}`; commit {commit_label(REPO)}; "
                f"{repeats} repeats (median); throughput by {args.clock} clock; "
                f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} CPUs\n"
                f"- {out['model']}; ours = EngineScheduler + TorchEngine (LocalNode), HF = transformers generate()\n\n")  # fmt: skip
        with RESULTS.open("a") as fh:
            fh.write(head + "\n".join(lines) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
