"""The simulator's KV directory sends branch counts only for blocks a node holds
(``KvDirectory(held_counts_only=True)``, issue 23): the records and reports are those of a
directory that sends every changed count.

Exact because the simulator applies every store an engine makes to the directory before the next
drain of counts (``ClusterSim._flush_kv`` right after each engine call that stores), so a block the
directory shows absent from a node is absent from its L2, and the count of a block stored later
comes with the store's re-send.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from evolving_infra.sim import cluster
from evolving_infra.sim.config import ForcedSwitch, SimConfig
from evolving_infra.sim.run import simulate
from services.kvdirectory import branches

from .conftest import BS, small_trace, strip_wall


def _tally(monkeypatch: pytest.MonkeyPatch, sent: dict[str, int]) -> None:
    """Count the entries of every count message an engine gets (the simulator drains through
    ``take_count_lists``, which ``take_count_updates`` builds its messages from)."""
    take = branches.BranchTable.take_count_lists

    def counted(self: branches.BranchTable, chains: bool = False) -> list:
        msgs = take(self, chains)
        sent["entries"] += sum(len(m[2]) for m in msgs)
        sent["held_only"] += self.held_counts_only
        return msgs

    monkeypatch.setattr(branches.BranchTable, "take_count_lists", counted)


_CONFIGS = pytest.mark.parametrize(
    "cfg",
    [
        SimConfig(nodes=3, profile="tiny", policy="evolving", concurrency=6, seed=1),
        SimConfig(nodes=3, profile="tiny", policy="evolving", concurrency=6, seed=2,
                  forced_switches=(ForcedSwitch(0.3, "w0", "decode"), ForcedSwitch(0.9, "w0", "prefill"))),
    ],
    ids=["evolving", "evolving-forced-switches"],
)
"""The two runs both tests compare: plain, and with forced phase switches (decode KV and hand-offs)."""


@_CONFIGS
def test_counts_for_held_blocks_only_change_no_result(cfg: SimConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = small_trace(16, 10, pause=0.05, first_blocks=16, growth=4)  # L2 (256 blocks a node) evicts
    held: dict[str, int] = {"entries": 0, "held_only": 0}
    with monkeypatch.context() as m:
        _tally(m, held)
        cut = simulate(cfg, reqs, BS)
    every: dict[str, int] = {"entries": 0, "held_only": 0}
    with monkeypatch.context() as m:
        _tally(m, every)
        init = cluster.KvDirectory.__init__

        def all_counts(self: object, *a: object, **k: object) -> None:
            k["held_counts_only"] = False
            init(self, *a, **k)  # type: ignore[arg-type]

        m.setattr(cluster.KvDirectory, "__init__", all_counts)
        full = simulate(cfg, reqs, BS)
    assert held["held_only"] > 0 and every["held_only"] == 0  # the simulator turns it on
    assert 0 < held["entries"] < every["entries"]  # and entries were left out
    assert cut.records == full.records
    assert strip_wall(cut.report) == strip_wall(full.report)
    assert cut.report["requests_completed"] == len(reqs)
    assert cut.report["kv_directory"]["evictions.host.zero_count"] > 0


def _counting(f: Callable[..., None], handed: list[int]) -> Callable[..., None]:
    """``f`` (a ``ClusterSim`` sink method) counting its calls in ``handed[0]``."""

    def tally(self: cluster.ClusterSim, *a: object) -> None:
        handed[0] += 1
        f(self, *a)

    return tally


@_CONFIGS
def test_re_sent_counts_handed_over_at_once_change_no_result(cfg: SimConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host store's re-sent counts go to the engine as the directory makes them
    (``BranchTable.resend_sink`` = ``ClusterSim._resend_counts``), not through the outbox and the
    next drain: the same records and report as with every count message drained."""
    reqs = small_trace(16, 10, pause=0.05, first_blocks=16, growth=4)  # L2 (256 blocks a node) evicts
    handed = [0]
    unbuilt = [0]
    with monkeypatch.context() as m:
        m.setattr(cluster.ClusterSim, "_resend_counts", _counting(cluster.ClusterSim._resend_counts, handed))
        # those at the store's position, counts unbuilt (BranchTable.resend_chain_sink)
        m.setattr(cluster.ClusterSim, "_resend_chain", _counting(cluster.ClusterSim._resend_chain, unbuilt))
        direct = simulate(cfg, reqs, BS)
    with monkeypatch.context() as m:
        # no sink: every re-send waits in the outbox for the drain
        for name in ("resend_sink", "resend_chain_sink"):
            m.setattr(branches.BranchTable, name, property(lambda self: None, lambda self, v: None), raising=False)
        drained = simulate(cfg, reqs, BS)
    assert unbuilt[0] > 10
    handed[0] += unbuilt[0]
    assert handed[0] > 10
    assert direct.records == drained.records
    assert strip_wall(direct.report) == strip_wall(drained.report)
    assert direct.report["requests_completed"] == len(reqs)
