"""``deploy/prometheus/alerts.yml``: the alerting rules Prometheus loads (no Prometheus needed: the files are read
as YAML and text; ``promtool check rules`` too where promtool is installed).

That every metric a rule evaluates is one the services export, with the labels it groups by and its annotations
name, is checked against live scrapes in ``tests/e2e/test_metrics_e2e.py`` (the dashboard's check, which reads the
rules too); here, without a cluster, that each metric a rule or its annotations name is defined in the code
(``services/``, ``shared/``), so a renamed metric fails CI even where promtool is not installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
SEVERITIES = {"page", "ticket"}


SOURCES = [p for d in ("services", "shared") for p in sorted((REPO / d).rglob("*.py"))]
"""The code that defines every family a service exports (``services/*/prom.py``, ``shared/metrics.py``, ...)."""

METRIC = re.compile(r"\b(?:ei_[a-z0-9_]+|process_[a-z_]+)")
"""A metric name in an expression or an annotation: ours (``ei_``) or prometheus-client's process collector's."""


def undefined_metrics(text: str, code: str) -> list[str]:
    """Metric names in ``text`` (PromQL or an annotation) that ``code`` (the services' source) does not define:
    an ``ei_`` family is defined where its name is a string literal (``counter_family("ei_node_bind_failures", ...)``;
    exported with ``_total``, a histogram's with ``_bucket`` / ``_sum`` / ``_count``), a ``process_`` one by
    prometheus-client's ``ProcessCollector`` registered in ``shared/metrics.py`` (``process_start_time_seconds``,
    ``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ``process_open_fds``, ...)."""
    missing = []
    for name in sorted(set(METRIC.findall(text))):
        if name.startswith("process_"):
            known = name in {"process_start_time_seconds", "process_cpu_seconds_total", "process_resident_memory_bytes",
                             "process_virtual_memory_bytes", "process_open_fds", "process_max_fds"}  # fmt: skip
            if not (known and "ProcessCollector(registry=" in code):
                missing.append(name)
            continue
        bases = {name} | {name[: -len(sfx)] for sfx in ("_total", "_bucket", "_sum", "_count") if name.endswith(sfx)}
        if not any(f'"{b}"' in code for b in bases):
            missing.append(name)
    return missing


def rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"} and doc["groups"], doc
    out = []
    for g in doc["groups"]:
        assert set(g) <= {"name", "interval", "rules", "limit"} and g["name"] and g["rules"], g
        out += g["rules"]
    return out


def test_the_alerting_rules_are_well_formed_and_cover_the_faults_an_operator_pages_on():
    """Each rule has a unique ``alert`` name, an ``expr``, a ``severity`` an Alertmanager can route on, a summary and
    a description; ``for`` is a Prometheus duration; a ``$labels.X`` its annotations name survives its aggregation
    (``sum by (job)`` drops ``node``: "{{ $labels.node }}" rendered empty); and the faults this session exported
    counters for each have a rule (a message lost, JetStream missing, a service down, a refused identity, slow
    clients, failed decode bindings, TTFT, a service not ready)."""
    rs = rules()
    names = [r["alert"] for r in rs]
    assert len(set(names)) == len(names), names
    for r in rs:
        assert set(r) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, r
        assert isinstance(r["expr"], str) and r["expr"].strip(), r
        assert r["labels"]["severity"] in SEVERITIES, r
        assert r["annotations"]["summary"] and r["annotations"]["description"], r
        if "for" in r:
            assert re.fullmatch(r"\d+[smh]", r["for"]), r
        named = set(re.findall(r"\$labels\.(\w+)", " ".join(r["annotations"].values())))
        # a one-to-many join keeps the labels of its "many" side: only that side's aggregations must keep them
        # (a `group_right` join keeps the right side's labels: the outermost aggregation after it decides)
        kept_side = r["expr"].split("group_right", 1)[-1].split("group_left", 1)[0]
        for kept in re.findall(r"\b(?:sum|max|min|avg|count)\s+by\s*\(([^)]*)\)", kept_side):
            # the outermost aggregation decides; every one here keeps what the annotations name
            assert named <= {x.strip() for x in kept.split(",")} - {"le"}, (r["alert"], named, kept)
    exprs = {r["alert"]: r["expr"] for r in rs}
    wanted = {
        "ei_bus_stream_held_dropped_total": "page", "ei_bus_resend_dropped_total": "page",
        "ei_bus_jetstream_missing_warnings_total": "page", "ei_router_chunks_gap_total": "page",
        "ei_nats_permission_violations_total": "ticket", "ei_router_slow_client_aborts_total": "ticket",
        "ei_node_bind_failures_total": "ticket", "ei_router_ttft_seconds_bucket": "ticket",
    }
    wanted |= {
        "process_start_time_seconds": "page", "ei_router_node_fences_total": "ticket",
        "ei_router_redispatches_total": "ticket", "ei_node_requests_dropped_owner_gone_total": "ticket",
        "ei_router_live_nodes": "page", "ei_router_split_nodes": "page",
    }
    for metric, severity in wanted.items():
        hits = [r for r in rs if re.search(rf"\b{metric}\b", r["expr"])]
        assert hits and all(r["labels"]["severity"] == severity for r in hits), (metric, hits)
    # a service up but not ready (shared.metrics' ei_service_ready, /readyz's state): 2 minutes, whatever the reason
    (unready,) = [r for r in rs if re.search(r"\bei_service_ready\b", r["expr"])]
    assert unready["for"] == "2m" and unready["labels"]["severity"] == "page", unready
    assert re.search(r"without \(reason\)", unready["expr"]) and unready["expr"].endswith("== 0"), unready
    # a service gone: Prometheus's failed scrape of it, held 2 minutes (not one missed scrape)
    (down,) = [r for r in rs if re.search(r"\bup\b", r["expr"])]
    assert down["for"] == "2m" and down["labels"]["severity"] == "page", down
    # a crash loop: 3 process starts in 15 minutes (a rolling restart is 1), whatever up's supervisor thinks of it
    assert exprs["EIServiceCrashLoop"] == 'changes(process_start_time_seconds{job=~"evolving-infra.*"}[15m]) >= 3'
    # a node fenced again and again: the most any router counted (each router fences on its own), not their sum
    assert exprs["EINodeFlapping"].startswith("max by (job, node) (increase(ei_router_node_fences_total[30m]))")
    # the client-error rate: placed requests ended in error, or 5xx answers less a drain's; no page on one burst
    err = next(r for r in rs if r["alert"] == "EIRouterErrorRate")
    assert err["labels"]["severity"] == "page" and err["for"] == "10m", err
    assert 'ei_router_requests_finished_total{reason="error"}' in err["expr"] and "ei_router_drain_refused_total" in err["expr"]
    assert 'ei_router_requests_total{code=~"5.."}' in err["expr"], err
    # every new rule names its runbook step in the README
    readme = (REPO / "README.md").read_text()
    for name in ("EIServiceCrashLoop", "EINodeFlapping", "EIRequestsRedispatched", "EIRouterErrorRate", "EIStreamsLostWithRouter",
                 "EINodesMissing"):
        rule = next(r for r in rs if r["alert"] == name)
        assert f"What to do: {name}" in rule["annotations"]["description"], rule
        assert f"- `{name}`" in readme, name
    # JetStream missing a minute or more: the warning comes at once, then every STREAM_BACK_WAIT_S
    from shared.bus import STREAM_BACK_WAIT_S

    js = exprs["EIJetStreamMissing"]
    window = int(re.search(r"\[(\d+)m\]", js).group(1)) * 60
    assert "changes(ei_bus_jetstream_missing_warnings_total" in js and js.endswith(">= 2"), js
    assert STREAM_BACK_WAIT_S == 60.0 and STREAM_BACK_WAIT_S < window < 3 * STREAM_BACK_WAIT_S + 1, (window, STREAM_BACK_WAIT_S)


def test_prometheus_loads_the_rules_and_compose_mounts_them_beside_its_config():
    """``rule_files`` in prometheus.yml is resolved against that file's folder: compose mounts alerts.yml next to
    it, in /etc/prometheus (unmounted, Prometheus refuses to start: "error loading rule files")."""
    prom = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["alerts.yml"], prom
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    svc = compose["services"]["prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in svc["command"], svc
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in svc["volumes"], svc["volumes"]


def test_promtool_accepts_the_rules_and_their_unit_tests_pass():
    """Prometheus's own checker (PromQL syntax, durations, templates) and ``promtool test rules`` on
    ``prometheus_alerts_test.yml`` beside this file, where ``promtool`` is installed (CI: skipped without it)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        # Debian's package without installing its server: apt-get download prometheus && dpkg-deb -x prometheus_*.deb D
        # gives D/usr/bin/promtool (2.42 in bookworm: these tests pass with it)
        pytest.skip("needs promtool on PATH (Prometheus's release archive, or Debian's prometheus package)")
    out = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout, out.stdout
    # and the rules' unit tests: each fires on its fault, when it should (JetStream a minute gone, not one warning;
    # a scrape failing 2 minutes, not 1m45s; 2% slow-client aborts, not 0.5%), with its annotations rendered
    tests = Path(__file__).with_name("prometheus_alerts_test.yml")
    out = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_metric_an_alert_names_is_one_the_code_exports():
    """Each metric a rule's ``expr`` or its annotations name is defined in ``services/`` or ``shared/`` (Prometheus's
    own ``up`` aside): a family renamed in the code, and not in alerts.yml, leaves a rule that never fires, which
    promtool cannot see (it knows no exporter) and CI skips anyway. The live check with labels is in
    ``tests/e2e/test_metrics_e2e.py``."""
    code = "\n".join(p.read_text() for p in SOURCES)
    assert len(SOURCES) > 20 and "services/worker/prom.py" in {p.relative_to(REPO).as_posix() for p in SOURCES}
    named = 0
    for r in rules():
        for text in [r["expr"], *r["annotations"].values()]:
            assert not undefined_metrics(text, code), (r["alert"], text, undefined_metrics(text, code))
            named += len(METRIC.findall(text))
        if not METRIC.search(r["expr"]):  # Prometheus's own `up` (a failed scrape): what it adds, not what we export
            assert re.fullmatch(r'up\{job=~"evolving-infra\.\*"\} == 0', r["expr"]), r
    assert named > len(rules()), named
    # the check catches what it is for: a renamed family, a suffix on the wrong name, a process family we do not have
    assert undefined_metrics("increase(ei_node_requests_dropped_owner_gone_total[5m]) > 0", code) == []
    assert undefined_metrics("rate(ei_router_ttft_seconds_bucket[5m]) + ei_service_ready", code) == []
    assert undefined_metrics("increase(ei_worker_requests_dropped_owner_gone_total[5m]) > 0", code) == [
        "ei_worker_requests_dropped_owner_gone_total"]
    assert undefined_metrics("changes(process_start_time_seconds[15m]) + process_threads", code) == ["process_threads"]
