"""Shared setup of the torch engine's live tests (``test_torch_sampling_live``,
``test_torch_logprobs_live``): a 1P1D cluster of real processes serving the tiny random llama
(``--engine torch``, no Mooncake), and the same request run in this process (``LocalNode``) to
compare the cluster's answer with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from evolving_infra.cluster import ClusterSpec
from shared import messages as m
from tests.unit.worker.torch_tiny import BS, PROFILE, work

if TYPE_CHECKING:
    from services.worker.engines.torch_engine.local import Finished

def tiny_1p1d(tmp_path: Path) -> tuple[Path, ClusterSpec]:
    """Write the tiny random llama (2 layers, hidden 64, vocabulary 512, context 2048, seed 5) to
    ``tmp_path``/model; returns it and the spec of a 1P1D cluster serving it (tokenizer from the
    folder, model name ``tiny``, workers with ``--check-invariants``, logs in ``tmp_path``/logs)."""
    from services.worker.engines.torch_engine.checkpoint import init_model

    folder = tmp_path / "model"
    init_model(folder, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, context=2048, seed=5)
    spec = ClusterSpec(
        nodes=2, split="1P1D", profile="torch-tiny-cpu", speedup=1.0, port=0, block_size=BS,
        log_dir=str(tmp_path / "logs"), ready_timeout_s=180.0, engine="torch", model_dir=str(folder),
        tokenizer=f"hf:{folder}", model="tiny", max_context_tokens=2048, worker_args=("--check-invariants",),
    )  # fmt: skip
    return folder, spec


class InProcess:
    """The model of ``folder`` on one collocated ``LocalNode`` in this process: :meth:`run` gives
    what a request (``ignore_eos``) finishes with, to compare with the cluster's answer."""

    def __init__(self, folder: Path) -> None:
        from services.worker.engines.torch_engine.local import LocalNode

        self.node = LocalNode("x", PROFILE, str(folder))

    def run(self, rid: str, prompt: list[int], max_tokens: int, sp: m.Sampling) -> Finished:
        """Run request ``rid`` (``prompt``, ``max_tokens``, sampling ``sp``) to its end; its record."""
        self.node.add_prefill(work(rid, prompt, sp, n=max_tokens))
        self.node.run()
        return self.node.finished[rid]
