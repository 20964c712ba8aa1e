"""pytest plugin for ``bench/gpu_check.sh``: the torch engine's tests on a CUDA device in float32.

The engine defaults to bfloat16 on CUDA (``TorchEngine``'s ``dtype=None``); the unit and live
tests compare its greedy tokens with transformers' float32 forward, which only bfloat16's
rounding would then break. Loaded with ``-p gpu_float32`` (``bench/`` on ``PYTHONPATH``), it
makes ``dtype=None`` mean float32 on every device for the test process; worker processes get
the same from ``EI_DTYPE=float32``.
"""

from __future__ import annotations

import functools


def pytest_configure(config) -> None:  # noqa: ARG001 - pytest's hook signature
    from services.worker.engines.torch_engine.engine import TorchEngine

    init = TorchEngine.__init__

    @functools.wraps(init)
    def float32_default(self, *args, **kwargs):
        if kwargs.get("dtype") is None:
            kwargs["dtype"] = "float32"
        return init(self, *args, **kwargs)

    TorchEngine.__init__ = float32_default
