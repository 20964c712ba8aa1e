"""The fault kit's cluster gives its planner the routers' liveness time (``FaultSpec.fence_after_s``), as ``up
--fence-after-s`` does (``evolving_infra.cluster.service_flags``): before, its routers fenced a silent node after
1.5 s while its planner counted it live until its default 3 s, laying splits over it and valuing its capacity."""

from __future__ import annotations

from pathlib import Path

from evolving_infra.faultkit import FaultCluster, FaultSpec


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_planner_and_the_routers_get_one_liveness_time(tmp_path: Path) -> None:
    for spec in (FaultSpec(), FaultSpec(fence_after_s=4.0, routers=2)):
        cluster = FaultCluster(spec, tmp_path)
        cluster._plan()
        fences = {_flag(cluster.procs[n].argv, "--fence-after-s") for n in cluster.router_names()}
        assert fences == {repr(spec.fence_after_s)}
        assert _flag(cluster.procs["planner"].argv, "--silent-after-s") == repr(spec.fence_after_s)
