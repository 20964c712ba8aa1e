"""``evolving_infra.sim.fidelity.run_live``'s report ``meta``: the inputs ``report compare`` checks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import evolving_infra.cluster as cluster_mod
import evolving_infra.replay.live as live_mod
from evolving_infra.replay.live import ReplayResult
from evolving_infra.replay.retry import RetryPolicy
from evolving_infra.report.compare import input_differences
from evolving_infra.sim.fidelity import FidelitySettings, run_live


class FakeCluster:
    """``LocalCluster`` without processes: the router URL and clock origin ``run_live`` reads."""

    router_url = "http://127.0.0.1:9"
    clock_origin = 0.0

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    async def __aenter__(self) -> FakeCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def check_alive(self) -> None:
        return None


class FakeReplayer:
    """``LiveReplayer``'s constructor and ``retry``, replaying nothing."""

    def __init__(self, *args: Any, retry: RetryPolicy | None = None, **kwargs: Any) -> None:
        self.retry = RetryPolicy() if retry is None else retry

    async def run(self, requests: list[Any], arrival: Any) -> ReplayResult:
        return ReplayResult(records=[], start=0.0, end=0.0, wall_s=0.0, agents=0)


def test_a_live_fidelity_run_records_the_replayers_max_retries(tmp_path: Path, monkeypatch) -> None:
    """``fidelity``'s live run replays with the default ``RetryPolicy`` (2 retries) but its ``meta`` lacked
    ``max_retries``: ``report compare`` of it against the demo or ``replay`` said ``not recorded``, where the
    report README says live runs record it. Fails before (KeyError), passes after."""
    monkeypatch.setattr(cluster_mod, "LocalCluster", FakeCluster)
    monkeypatch.setattr(live_mod, "LiveReplayer", FakeReplayer)
    report, _, where = asyncio.run(run_live(FidelitySettings(nodes=2, split="1P1D"), [], 512, tmp_path))
    assert where == tmp_path
    assert report["meta"]["max_retries"] == RetryPolicy().max_retries == 2
    assert json.loads((tmp_path / "report.json").read_text())["meta"]["max_retries"] == 2
    demo = {"meta": {"max_retries": 2}}
    assert [d for d in input_differences([report, demo], ["fidelity", "demo"]) if "max_retries" in d] == []
