"""``deploy/prometheus/prometheus.yml`` scrapes every service ``docker-compose.yml`` runs, on the
metrics port the compose file gives it (no docker needed: both files are read as text).

Every Evolving Infra service of the compose file (``command: ["<service>", ...]`` for router,
planner, kvdirectory, worker; the torch workers of profile ``torch`` too) serves ``/metrics`` on
``EI_METRICS_PORT`` (``x-service`` environment, bound to ``EI_METRICS_HOST`` 0.0.0.0); Prometheus
must reach each by its compose service name (a static target, or a DNS A lookup of a scaled
service) on that port.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EI_SERVICES = {"router", "planner", "kvdirectory", "worker"}


def compose_services(text: str) -> dict[str, str]:
    """Compose service name → the first word of its ``command`` (top-level ``services:`` block)."""
    block = text.split("\nservices:\n", 1)[1].split("\nvolumes:\n", 1)[0]
    out: dict[str, str] = {}
    name = None
    for line in block.splitlines():
        if m := re.match(r"^  ([A-Za-z0-9_-]+):\s*$", line):
            name = m.group(1)
        elif name and (m := re.match(r'^    command: \["([^"]+)"', line)):
            out[name] = m.group(1)
    return out


def scraped(text: str) -> set[tuple[str, int]]:
    """(host or DNS name, port) pairs the Prometheus config scrapes."""
    out = {(h, int(p)) for h, p in re.findall(r'"([A-Za-z0-9_.-]+):(\d+)"', text)}
    for names, port in re.findall(r"names: \[([^\]]*)\]\s*\n\s*type: A\s*\n\s*port: (\d+)", text):
        out |= {(n.strip().strip("'\""), int(port)) for n in names.split(",")}
    return out


def test_prometheus_scrapes_every_evolving_infra_service_of_the_compose_file_on_its_metrics_port():
    compose = (REPO / "docker-compose.yml").read_text()
    port = int(re.search(r'EI_METRICS_PORT: "(\d+)"', compose).group(1))
    assert re.search(r"EI_METRICS_HOST: 0\.0\.0\.0", compose)
    services = {name for name, cmd in compose_services(compose).items() if cmd in EI_SERVICES}
    assert {"router", "planner", "kvdirectory", "worker", "worker-torch"} <= services, services
    targets = scraped((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    missing = sorted(s for s in services if (s, port) not in targets)
    assert not missing, f"not scraped on :{port}: {missing} (scraped: {sorted(targets)})"
