"""The paged decoder attends each sequence over its own keys, not the batch's longest.

A mixed iteration (a chunk after cached context, a fresh chunk, decode rows of very
different context lengths) is split into attention groups: decode rows of similar
length share one SDPA call (padding bounded by ``group_overhead_keys``), a chunk after
context gathers only its own pages. The logits of such an iteration equal
``transformers``' forward over each full sequence. Needs the ``torch`` extra.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from services.worker.engines.torch_engine.model import PagedDecoder, SeqBatch, _decode_runs, _plan_groups  # noqa: E402

PS = 8


def test_decode_runs_bound_padding():
    ends = [600, 590, 585, 40, 33, 30, 9]
    runs = _decode_runs(ends, overhead=64)
    assert runs == [(0, 3), (3, 7)]
    for a, b in runs:
        e = ends[a:b]
        assert len(e) * max(e) - sum(e) <= 64
    assert _decode_runs(ends, overhead=10**9) == [(0, 7)]
    assert _decode_runs([50] * 32, overhead=0) == [(0, 32)]  # equal lengths: one call, no padding


def test_groups_gather_only_needed_pages():
    tables = [list(range(i * 100, i * 100 + 80)) for i in range(6)]
    seqs = [
        SeqBatch(offset=0, n=24, ctx=21, block_table=tables[0]),  # chunk after context: 45 keys
        SeqBatch(offset=24, n=13, ctx=0, block_table=tables[1]),  # fresh chunk: no gather
        SeqBatch(offset=37, n=1, ctx=599, block_table=tables[2]),  # decode, 600 keys
        SeqBatch(offset=38, n=1, ctx=589, block_table=tables[3]),
        SeqBatch(offset=39, n=1, ctx=39, block_table=tables[4]),  # decode, 40 keys
        SeqBatch(offset=40, n=1, ctx=8, block_table=tables[5]),
    ]
    plan = _plan_groups(seqs, PS, torch.float32, torch.device("cpu"), overhead=64)
    assert [(g.kind, g.r0, g.r1) for g in plan.groups] == [("chunk", 0, 24), ("fresh", 24, 37), ("decode", 37, 39), ("decode", 39, 41)]
    # the chunk's 6 pages; 2 × 75 pages for the long rows, 2 × 5 for the short ones: not 4 × 75
    assert plan.chunk_pages == tables[0][:6]
    assert len(plan.dec_pages) == 2 * 75 + 2 * 5
    assert plan.dec_ends == [600, 590, 40, 9] and plan.dec_rows == [37, 38, 39, 40]
    # each decode row's new token: its group's first page, its row's pages, its position
    assert plan.dec_slots == [599, 75 * PS + 589, 150 * PS + 39, (150 + 5) * PS + 8]
    with pytest.raises(ValueError, match="tile the token rows"):
        _plan_groups([SeqBatch(offset=1, n=1, ctx=3, block_table=[0])], PS, torch.float32, torch.device("cpu"), 64)


def test_grouped_iteration_matches_transformers(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so attention matters
        for p in hf.parameters():
            p.mul_(10.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    dec = PagedDecoder.from_folder(tmp_path, torch.float32, torch.device("cpu"))
    dec.group_overhead_keys = 64  # split the decode rows below into two groups
    g = torch.Generator().manual_seed(1)
    lens = {"a": 45, "b": 13, "c": 300, "d": 290, "e": 40, "f": 9}  # full sequence lengths
    ids = {k: torch.randint(0, 300, (n,), generator=g) for k, n in lens.items()}
    kc, vc = dec.new_cache(200, PS)
    free = list(range(199, -1, -1))
    tables = {k: [free.pop() for _ in range(-(-n // PS))] for k, n in lens.items()}
    # earlier iterations: context of a (21 tokens) and of the decode rows (all but their last token)
    ctx = {"a": 21, "c": 299, "d": 289, "e": 39, "f": 8}
    for k, n in ctx.items():
        dec(ids[k][:n], torch.arange(n), [SeqBatch(0, n, 0, tables[k])], kc, vc, None)
    # one mixed iteration: chunk after context, fresh chunk, four decode rows (longest first)
    order = [("a", 21, 24), ("b", 0, 13), ("c", 299, 1), ("d", 289, 1), ("e", 39, 1), ("f", 8, 1)]
    toks, pos, seqs, off = [], [], [], 0
    for k, start, n in order:
        toks.append(ids[k][start : start + n])
        pos.append(torch.arange(start, start + n))
        seqs.append(SeqBatch(off, n, start, tables[k]))
        off += n
    plan = _plan_groups(seqs, PS, torch.float32, torch.device("cpu"), dec.group_overhead_keys)
    assert [gr.kind for gr in plan.groups] == ["chunk", "fresh", "decode", "decode"]
    got = dec(torch.cat(toks), torch.cat(pos), seqs, kc, vc, None)
    row = 0
    for k, start, n in order:
        with torch.no_grad():
            ref = hf(ids[k][None]).logits[0, start : start + n]
        mine = got[row : row + n]
        assert torch.allclose(mine, ref, atol=2e-4, rtol=1e-4), (k, (mine - ref).abs().max())
        assert torch.equal(mine.argmax(-1), ref.argmax(-1)), k
        row += n


def test_decode_gather_reused_one_token_on(tmp_path):
    """Decode rows that are the same rows one token further on reuse the last forward's
    gathered keys (writing only the new token); the logits equal a fresh gather's bit for
    bit, and a changed batch gathers afresh."""
    from services.worker.engines.torch_engine.checkpoint import init_model

    folder = init_model(tmp_path / "m", arch="llama", seed=3, context=1024)
    dec = PagedDecoder.from_folder(folder, torch.float32, torch.device("cpu"))
    ref = PagedDecoder.from_folder(folder, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    lens = [70, 66, 12]
    kc, vc = dec.new_cache(64, PS)
    kr, vr = ref.new_cache(64, PS)
    free = list(range(63, -1, -1))
    tables = [[free.pop() for _ in range(12)] for _ in lens]
    ids = [torch.randint(0, 500, (n,), generator=g) for n in lens]
    for t, n, x in zip(tables, lens, ids):
        for m, a, b in ((dec, kc, vc), (ref, kr, vr)):
            m(x, torch.arange(n), [SeqBatch(0, n, 0, t)], a, b, None)
    toks = torch.tensor([x[-1].item() for x in ids])
    reused = 0
    for step in range(12):  # crosses page boundaries (a fresh gather) and back to reuse
        rows = [0, 1, 2] if step < 9 else [0, 2]  # a row leaves: the batch changes
        pos = [lens[r] - 1 + step for r in rows]
        seqs = [SeqBatch(b, 1, p, tables[r], seq=r) for b, (r, p) in enumerate(zip(rows, pos))]
        before = dec._dec_gathered
        out = dec(toks[rows], torch.tensor(pos), seqs, kc, vc, None)
        ref._dec_gathered = None  # the reference always gathers afresh
        want = ref(toks[rows], torch.tensor(pos), seqs, kr, vr, None)
        assert torch.equal(out, want), step
        if before is not None and dec._dec_gathered[3][0] is before[3][0]:
            reused += 1
        toks = toks.clone()
        toks[rows] = out.argmax(-1)
    assert reused >= 6, reused
