"""Converters from public traces to the canonical agent trace (spec: docs/trace-format.md §7).

Each converter module has ``convert(inputs, *, progress=False, **options) -> Conversion``;
:func:`convert_inputs` returns a whole in-memory trace, :func:`convert_to_file`
streams into a file (used by ``evolving-infra trace convert``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from evolving_infra.traces.convert.common import Conversion, ConvertError, expand_inputs, write_conversion
from evolving_infra.traces.io import Trace
from evolving_infra.traces.schema import TraceHeader

__all__ = ["CONVERTERS", "ConvertError", "Conversion", "convert", "convert_inputs", "convert_to_file", "input_files"]

CONVERTERS: dict[str, str] = {
    "claude-code-weka": "evolving_infra.traces.convert.claude_code",
    "mooncake": "evolving_infra.traces.convert.mooncake",
    "mini-swe-agent": "evolving_infra.traces.convert.mini_swe_agent",
    "azure": "evolving_infra.traces.convert.azure",
    "openai-chat": "evolving_infra.traces.convert.openai_chat",
}
"""Input kind → module with ``convert(inputs, *, progress, **options)``."""


def convert(kind: str, inputs: Sequence[str | os.PathLike[str]], *, progress: bool = False, **options: Any) -> Conversion:
    """Start a streaming conversion of ``inputs`` (files or folders) of the given kind.

    Raises:
        ConvertError: unknown kind, missing input, or malformed source data.
    """
    mod_name = CONVERTERS.get(kind)
    if mod_name is None:
        raise ConvertError(f"unknown trace kind {kind!r}; one of {', '.join(CONVERTERS)}")
    mod = importlib.import_module(mod_name)
    return mod.convert([os.fspath(p) for p in inputs], progress=progress, **options)


def input_files(kind: str, inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files a conversion of ``inputs`` reads: the files named, plus those under the folders
    named that match the converter's ``PATTERNS`` (``common.expand_inputs``, as its ``convert``
    finds them). O(files under the folders named).

    Raises:
        ConvertError: unknown kind, a missing input, or a folder with no matching file.
    """
    mod_name = CONVERTERS.get(kind)
    if mod_name is None:
        raise ConvertError(f"unknown trace kind {kind!r}; one of {', '.join(CONVERTERS)}")
    return expand_inputs(inputs, importlib.import_module(mod_name).PATTERNS)


def convert_inputs(kind: str, inputs: Sequence[str | os.PathLike[str]], *, progress: bool = False, **options: Any) -> Trace:
    """Convert ``inputs`` into an in-memory :class:`Trace` (header + requests)."""
    return convert(kind, inputs, progress=progress, **options).to_trace()


def convert_to_file(
    kind: str, inputs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str] | IO[bytes], *, progress: bool = False,
    **options: Any,
) -> tuple[TraceHeader, int]:
    """Convert ``inputs`` into the file ``out`` (``.gz`` compresses), or into an open binary
    stream (uncompressed); returns (header, request count)."""
    return write_conversion(convert(kind, inputs, progress=progress, **options), out)
