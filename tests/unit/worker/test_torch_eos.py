"""The torch engine stops a request at the model's end-of-sequence token (issue #19).

The tiny model is random, so its EOS token (``<|im_end|>``) rarely comes out of a greedy
continuation. The tests make a token the model is known to produce the EOS token: the
reference forward (``transformers``) gives the greedy continuation, and the folder's
``generation_config.json`` names one of its tokens as ``eos_token_id``. Then the request
must end right after that token's first occurrence with ``finish_reason`` ``stop`` —
collocated, in the first token of a prefill node (no hand-off), and on the decode node
after a hand-off — and must run to ``max_tokens`` (``length``) with ``ignore_eos``.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from services.worker.engines.torch_engine.engine import ModelConfigError, eos_token_ids  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402
from tests.unit.worker import torch_tiny  # noqa: E402
from tests.unit.worker.torch_tiny import PROFILE  # noqa: E402

N = 14
work = functools.partial(torch_tiny.work, sp=None, ignore_eos=False)


@pytest.fixture(scope="module")
def setup(tiny_llama):
    """(folder, prompt, greedy continuation of N tokens by transformers)."""
    folder = Path(tiny_llama)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    prompt = torch_tiny.prompt(3)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N, do_sample=False)
    return folder, prompt, out[0, len(prompt) :].tolist()


def with_eos(src, dst, eos: int):
    """A copy of the model folder whose generation_config.json names ``eos`` as EOS."""
    shutil.copytree(src, dst)
    gc = json.loads((dst / "generation_config.json").read_text())
    gc["eos_token_id"] = eos
    (dst / "generation_config.json").write_text(json.dumps(gc))
    return str(dst)


def test_stops_at_eos_collocated_and_ignore_eos_runs_to_length(setup, tmp_path):
    folder, prompt, ref = setup
    j = 5  # make the 6th output token the EOS token: the request ends at its first occurrence
    eos = ref[j]
    first = ref.index(eos)
    model = with_eos(folder, tmp_path / "m", eos)
    node = LocalNode("a", PROFILE, model)
    assert node.engine.eos == {eos}
    node.add_prefill(work("stop", prompt, n=N))
    node.add_prefill(work("all", prompt, n=N, ignore_eos=True))
    node.run()
    assert node.finished["stop"].tokens == ref[: first + 1]
    assert node.finished["stop"].finish_reason == "stop"
    assert node.finished["all"].tokens == ref
    assert node.finished["all"].finish_reason == "length"
    assert not node.core.requests  # the stopped request left the scheduler (its pages are free)


def test_eos_first_token_on_prefill_node_and_eos_on_decode_node(setup, tmp_path):
    folder, prompt, ref = setup
    # EOS = the first output token: the prefill node ends the request, nothing is handed off
    p = LocalNode("p", PROFILE, with_eos(folder, tmp_path / "m0", ref[0]), phase="prefill")
    p.add_prefill(work("r0", prompt, n=N, decode_node="d"))
    p.run()
    assert p.handoffs == []
    assert p.finished["r0"].tokens == ref[:1] and p.finished["r0"].finish_reason == "stop"
    # EOS later in the continuation: prefilled on p, handed off, stopped on d
    j = next(i for i, t in enumerate(ref) if i >= 3 and t != ref[0] and ref.index(t) == i)
    model = with_eos(folder, tmp_path / "m1", ref[j])
    p = LocalNode("p", PROFILE, model, phase="prefill")
    d = LocalNode("d", PROFILE, model, phase="decode")
    p.add_prefill(work("r1", prompt, n=N, decode_node="d"))
    p.add_prefill(work("r2", prompt, n=N, decode_node="d", ignore_eos=True))
    p.run()
    assert [h.work.ignore_eos for h in p.handoffs] == [False, True]
    for h in p.handoffs:
        d.add_decode(h.work)
    d.run()
    assert d.finished["r1"].tokens == ref[: j + 1] and d.finished["r1"].finish_reason == "stop"
    assert d.finished["r2"].tokens == ref and d.finished["r2"].finish_reason == "length"


def test_eos_ids_from_generation_config_else_config(tmp_path):
    assert eos_token_ids(tmp_path, [7]) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert eos_token_ids(tmp_path, [7]) == {3, 4}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert eos_token_ids(tmp_path, [7]) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ModelConfigError, match="eos_token_id"):
        eos_token_ids(tmp_path, [7])
