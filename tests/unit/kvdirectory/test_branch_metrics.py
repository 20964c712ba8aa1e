"""The directory's branch signals where a harness author looks: its ``/metrics`` families and an info line per
compaction (``DirectoryService._on_placed``, ``services/kvdirectory/prom.py``).

A newcomer sent a side request ("Write a 5-word title...") on a branch's own X-Branch-Id: the directory took it for
a compaction and released the branch's blocks, so its next turn found nothing cached (1,221 prompt tokens, 0 cached
instead of 1,152), and nothing said so where they looked: the version bump was only in ``svc.stats`` (a NATS
request), the directory's ``/metrics`` had no branch series and its log no line.
"""

from __future__ import annotations

from structlog.testing import capture_logs

from services.kvdirectory.prom import directory_families
from services.kvdirectory.service import DirectoryService
from shared import messages as m
from tests.unit.kvdirectory.test_count_beacon import directory


def samples(d: DirectoryService) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the directory's branch families: (name, labels) → value."""
    out = {}
    for f in directory_families(d):
        if f.name.startswith(("ei_kvdirectory_branch", "ei_kvdirectory_branches")):
            for smp in f.samples:
                out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def placed(bid: str, path: list[int], rid: str) -> m.RoutePlaced:
    return m.RoutePlaced(rid=rid, branch_id=bid, node="w0", phase="both", block_hashes=path)


async def test_branch_families_are_exported_at_zero_from_the_first_scrape():
    d, _bus = directory()
    assert samples(d) == {
        ("ei_kvdirectory_branches_active", ()): 0.0,
        ("ei_kvdirectory_branch_compactions_total", ()): 0.0,
        ("ei_kvdirectory_branch_parents_missing_total", (("reason", "unknown"),)): 0.0,
        ("ei_kvdirectory_branch_parents_missing_total", (("reason", "ended"),)): 0.0,
        ("ei_kvdirectory_branch_parents_missing_total", (("reason", "expired"),)): 0.0,
    }


async def test_a_side_request_on_a_branch_id_is_a_compaction_counted_and_logged_at_info():
    """An extension counts nothing; a prompt that does not extend the branch's last one (the side request) is one
    compaction on /metrics and one info line naming the branch and its old and new version."""
    d, _bus = directory()
    await d._on_branch(m.BranchStart(branch_id="A"), "branch.events")
    with capture_logs() as logs:
        await d._on_placed(placed("A", [1, 2, 3], "r1"), "route.placed")
        await d._on_placed(placed("A", [1, 2, 3, 4], "r2"), "route.placed")  # the next turn extends it: no bump
        assert samples(d)[("ei_kvdirectory_branch_compactions_total", ())] == 0.0
        await d._on_placed(placed("A", [9, 8], "r3"), "route.placed")  # "Write a 5-word title..." on A's id
    assert samples(d)[("ei_kvdirectory_branch_compactions_total", ())] == 1.0
    assert samples(d)[("ei_kvdirectory_branches_active", ())] == 1.0
    lines = [x for x in logs if x["event"].startswith("branch compacted")]
    assert len(lines) == 1, logs
    line = lines[0]
    assert (line["log_level"], line["branch"], line["old_version"], line["new_version"], line["rid"]) == ("info", "A", 1, 2, "r3")
    assert "side requests with no X-Branch-Id or their own" in line["hint"]


async def test_compaction_lines_are_rate_limited_but_every_compaction_is_counted():
    d, _bus = directory()
    await d._on_branch(m.BranchStart(branch_id="A"), "branch.events")
    with capture_logs() as logs:
        for i in range(12):  # alternating prompts: every placement after the first is a bump
            await d._on_placed(placed("A", [i % 2 + 1, 7], f"r{i}"), "route.placed")
    assert samples(d)[("ei_kvdirectory_branch_compactions_total", ())] == 11.0
    assert sum(x["event"].startswith("branch compacted") for x in logs) == 5


async def test_a_new_branch_whose_parent_is_not_active_is_counted_by_reason():
    d, _bus = directory()
    ev = d._on_branch
    await ev(m.BranchStart(branch_id="main"), "branch.events")
    await ev(m.BranchStart(branch_id="f1", kind="fork", parent_branch_id="main"), "branch.events")  # active: not counted
    await ev(m.BranchStart(branch_id="s1", kind="subagent", parent_branch_id="ghost"), "branch.events")
    await ev(m.BranchEnd(branch_id="main"), "branch.events")
    await ev(m.BranchStart(branch_id="f2", kind="fork", parent_branch_id="main"), "branch.events")
    d.core.expire(d.core.branches.ttl_s + 1.0e9)  # every branch expires
    await ev(m.BranchStart(branch_id="f3", kind="fork", parent_branch_id="f1"), "branch.events")
    await ev(m.BranchStart(branch_id="f3", kind="fork", parent_branch_id="ghost"), "branch.events")  # a duplicate: refused
    got = samples(d)
    assert [got[("ei_kvdirectory_branch_parents_missing_total", (("reason", r),))] for r in ("unknown", "ended", "expired")] == [
        1.0, 1.0, 1.0,
    ]  # fmt: skip
    assert got[("ei_kvdirectory_branches_active", ())] == 1.0  # f3


async def test_a_missing_parent_is_counted_once_when_a_resume_s_placement_comes_before_its_start():
    """A branch whose parent is missing, expired, then resumed by a placement that reaches the directory before the
    router's BranchStart (verdict ``merged``): before, its parent was counted again at that start. A branch that is
    new, placed before its first start (``merged`` too), is counted once as well."""
    d, _bus = directory()
    ev = d._on_branch
    await ev(m.BranchStart(branch_id="f", kind="fork", parent_branch_id="ghost"), "branch.events")
    d.core.expire(d.core.branches.ttl_s + 1.0e9)
    await d._on_placed(placed("f", [1, 2], "r1"), "route.placed")  # the resume's placement, before its BranchStart
    await ev(m.BranchStart(branch_id="f", kind="fork", parent_branch_id="ghost"), "branch.events")
    await d._on_placed(placed("g", [3, 4], "r2"), "route.placed")  # a new branch placed before its first start
    await ev(m.BranchStart(branch_id="g", kind="subagent", parent_branch_id="ghost"), "branch.events")
    got = samples(d)
    assert got[("ei_kvdirectory_branch_parents_missing_total", (("reason", "unknown"),))] == 2.0  # f once, g once
    assert d.core.all_counters().get("branch.resumed") == 1
