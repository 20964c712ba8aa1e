"""``docs/metrics.md`` lists exactly the families each service exports, with their type and labels.

Each service is built as its shell builds it (its own registry, a real :class:`shared.bus.Bus` not connected to
any server: nothing is sent), and every family its registry can export at a scrape is read, with
``ei_service_ready``, which the metrics port adds (:class:`shared.metrics.MetricsServer`). A family added,
renamed or dropped, or its type or labels changed, without the page fails here; so does an ``ei_*`` name the
page mentions (its Dynamo / vLLM table too) that no service exports.
"""

from __future__ import annotations

import re
from pathlib import Path

import nats
import pytest
from prometheus_client.core import Metric

from services.kvdirectory.config import DirectoryConfig
from services.kvdirectory.service import DirectoryService
from services.planner.config import PlannerConfig
from services.planner.service import PlannerService
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from shared.bus import Bus
from shared.clock import SimClock
from shared.metrics import READY_REASONS, ready_family
from shared.subjects import Subjects

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"

SECTIONS = {"Every service": "common", "Router": "router", "Worker": "worker", "KV directory": "kvdirectory", "Planner": "planner"}
"""``## `` headings of the page's family tables → the service (``common``: in every service's registry)."""

TABLE_HEADER = "| name | type | labels | unit | meaning |"

Family = tuple[str, str, tuple[str, ...]]
"""(exposed name: a counter's with ``_total``, type, label names sorted; ``le`` left out)."""


def _family(f: Metric) -> Family:
    labels = getattr(f, "_labelnames", None)  # the *MetricFamily classes keep them, also with no series yet
    if labels is None:  # prometheus_client's own Histogram and ProcessCollector: from the samples
        labels = {k for s in f.samples for k in s.labels if k != "le"}
    name = f.name + "_total" if f.type == "counter" else f.name
    return name, f.type, tuple(sorted(labels))


async def _exported() -> dict[str, set[Family]]:
    """service → the families its registry exports, plus ``ei_service_ready``."""

    def bus(service: str) -> Bus:
        return Bus(nats.NATS(), Subjects("p0"), service=service, instance=service)

    services = {
        "router": RouterService(RouterConfig(), bus("router"), SimClock()),
        "worker": WorkerService(WorkerConfig(node="w0", phase="both", profile="tiny"), bus("worker"), SimClock()),
        "kvdirectory": DirectoryService(DirectoryConfig(), bus("kvdirectory"), SimClock()),
        "planner": PlannerService(PlannerConfig(nodes=["w0", "w1"], split="1P1D"), bus("planner"), SimClock()),
    }
    out: dict[str, set[Family]] = {}
    for name, svc in services.items():
        fams = [_family(f) for f in svc.registry.collect()]  # type: ignore[attr-defined]
        fams.append(_family(ready_family((READY_REASONS[0], "x"))))
        assert len(fams) == len(set(fams)), f"{name} exports a family twice"
        out[name] = set(fams)
    return out


def _documented(text: str) -> dict[str, dict[str, tuple[str, str, tuple[str, ...], str]]]:
    """section → name → (type, labels, unit, meaning) from the page's family tables."""
    out: dict[str, dict[str, tuple[str, str, tuple[str, ...], str]]] = {}
    section = None
    in_table = False
    for line in text.splitlines():
        if line.startswith("## "):
            section = SECTIONS.get(line[3:].strip())
            in_table = False
            continue
        if line.strip() == TABLE_HEADER:
            assert section is not None, f"a family table under a heading not in {sorted(SECTIONS)}"
            in_table = True
            out.setdefault(section, {})
            continue
        if not in_table or line.startswith("|---"):
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, f"a row needs 5 cells: {line!r}"
        name, typ, labels, unit, meaning = cells
        m = re.fullmatch(r"`([a-z_:][a-z0-9_:]*)`", name)
        assert m, f"name cell {name!r} is not one backquoted name"
        labs = () if labels == "—" else tuple(sorted(re.fullmatch(r"`(\w+)`", x.strip()).group(1) for x in labels.split(",")))  # type: ignore[union-attr]
        assert unit and meaning, f"{m.group(1)}: unit and meaning are required"
        assert m.group(1) not in out[section], f"{m.group(1)} listed twice under {section}"
        out[section][m.group(1)] = (typ, unit, labs, meaning)
    return out


async def test_the_metrics_page_lists_exactly_the_families_each_service_exports():
    exported = await _exported()
    doc = _documented(DOC.read_text())
    assert set(doc) == set(SECTIONS.values()), f"sections found: {sorted(doc)}"
    common = set.intersection(*exported.values())
    want = {"common": common, **{svc: fams - common for svc, fams in exported.items()}}
    for section, fams in want.items():
        got = {(name, typ, labs) for name, (typ, _unit, labs, _m) in doc[section].items()}
        missing, stale = sorted(fams - got), sorted(got - fams)
        assert not missing and not stale, (
            f"docs/metrics.md, section {section}: exported but not listed (or listed with another type / labels): "
            f"{missing}; listed but not exported so: {stale}"
        )


async def test_every_family_s_unit_matches_its_name_and_every_ei_name_the_page_mentions_is_exported():
    exported = await _exported()
    names = {name for fams in exported.values() for name, _t, _l in fams}
    text = DOC.read_text()
    for section in _documented(text).values():
        for name, (_typ, unit, _labs, _m) in section.items():
            for suffix, word in (("_seconds", "s"), ("_seconds_total", "s"), ("_bytes", "bytes"), ("_tokens", "tokens"),
                                 ("_tokens_total", "tokens"), ("_blocks", "blocks"), ("_ratio", "ratio")):  # fmt: skip
                if name.endswith(suffix):
                    assert unit.split()[0] == word or word in unit, f"{name}: unit {unit!r}, want {word!r}"
    mentioned = {
        re.sub(r"_(bucket|sum|count)$", "", m.group())
        for m in re.finditer(r"\b(?:ei|process)_[a-z0-9_]*[a-z0-9]", text)
        if text[m.end() : m.end() + 2] not in ("_{", "_*")  # a pattern (`ei_router_branches_*`), not a name
    }
    unknown = sorted(n for n in mentioned if n not in names)
    assert not unknown, f"docs/metrics.md names families no service exports: {unknown}"


def test_the_readme_links_the_metrics_page():
    readme = (DOC.parents[1] / "README.md").read_text()
    assert "docs/metrics.md" in readme


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here connects: a service that tried would fail the test, not wait."""

    async def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("the metrics doc test must not connect to NATS")

    monkeypatch.setattr(nats.NATS, "connect", refuse)
