"""``deploy/prometheus/alerts.yml``: the alerting rules Prometheus loads (no Prometheus needed: the files are read
as YAML and text; ``promtool check rules`` too where promtool is installed).

That every metric a rule evaluates is one the services export, with the labels it groups by and its annotations
name, is checked against live scrapes in ``tests/e2e/test_metrics_e2e.py`` (the dashboard's check, which reads the
rules too).
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
        for kept in re.findall(r"\b(?:sum|max|min|avg|count)\s+by\s*\(([^)]*)\)", r["expr"]):
            # the outermost aggregation decides; every one here keeps what the annotations name
            assert named <= {x.strip() for x in kept.split(",")} - {"le"}, (r["alert"], named, kept)
    exprs = {r["alert"]: r["expr"] for r in rs}
    wanted = {
        "ei_bus_stream_held_dropped_total": "page", "ei_bus_resend_dropped_total": "page",
        "ei_bus_jetstream_missing_warnings_total": "page", "ei_router_chunks_gap_total": "page",
        "ei_nats_permission_violations_total": "ticket", "ei_router_slow_client_aborts_total": "ticket",
        "ei_node_bind_failures_total": "ticket", "ei_router_ttft_seconds_bucket": "ticket",
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
