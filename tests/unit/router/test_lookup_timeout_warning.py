"""The router's 'kv.lookup failed' warning names the timeout it ran out and the setting: a demo at
--speedup 50 on a busy host logged it with only 'no reply on ei.p0.kv.lookup: TimeoutError', which
said neither that 0.5 wall s had passed (25 s of the cluster clock) nor how to change it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from services.router.config import RouterConfig
from shared.bus import BusError


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append(("warning", event, kw))

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append(("info", event, kw))


class _Bus:
    async def request(self, *a: Any, **k: Any) -> Any:
        raise BusError("no reply on ei.p0.kv.lookup: TimeoutError")


def test_a_failed_lookup_names_its_wall_timeout_and_the_setting() -> None:
    from services.router.service import RouterService

    shell = SimpleNamespace(cfg=RouterConfig(lookup_timeout_s=0.5), bus=_Bus(), counters={"lookups_failed": 0},
                            _lookup_ok=True, log=_Log())
    for _ in range(2):  # logged once until lookups answer again
        assert asyncio.run(RouterService._lookup(shell, [1, 2], None, "r1")) == (None, "failed")  # type: ignore[arg-type]
    assert shell.counters["lookups_failed"] == 2
    ((level, event, kw),) = shell.log.lines
    assert (level, event) == ("warning", "kv.lookup failed; routing without cache information")
    assert kw["timeout_s"] == 0.5 and "--lookup-timeout-s" in kw["setting"] and "EI_LOOKUP_TIMEOUT_S" in kw["setting"]
    assert "not scaled by --speedup" in kw["setting"] and kw["error"].endswith("TimeoutError")
