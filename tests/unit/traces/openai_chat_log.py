"""Builders of openai-chat request logs shared by the converter's tests (a log line per chat request, the converter
run at 16-token blocks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from evolving_infra.traces.convert import convert_inputs
from evolving_infra.traces.schema import TraceRequest

BS = 16
SYS = {"role": "system", "content": "You are an agent. " + "rule " * 80}


def u(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def row(t: float | str, msgs: list[Any], session: object = "s", end: float | None = None, **kw: object) -> dict[str, object]:
    r: dict[str, object] = {"timestamp": t, "messages": msgs, "usage": {"completion_tokens": 3}, **kw}
    if session is not None:
        r["session_id"] = session
    if end is not None:
        r["end_time"] = end
    return r


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def conv(path: Path | list[Path], kind: str = "openai-chat", **kw: Any) -> tuple[dict[str, TraceRequest], dict[str, Any]]:
    t = convert_inputs(kind, path if isinstance(path, list) else [path], block_size=BS, **kw)
    return {r.id: r for r in t.requests}, t.header.meta
