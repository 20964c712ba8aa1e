"""``deploy/prometheus/prometheus.yml`` scrapes every service ``docker-compose.yml`` runs, on the
metrics port the compose file gives it (no docker needed: both files are read as text); the Slurm README's
Prometheus snippet is one Prometheus loads (``promtool check config``) and finds the job's targets file by.

Every Evolving Infra service of the compose file (``command: ["<service>", ...]`` for router,
planner, kvdirectory, worker, whatever its engine) serves ``/metrics`` on
``EI_METRICS_PORT`` (``x-service`` environment, bound to ``EI_METRICS_HOST`` 0.0.0.0); Prometheus
must reach each by its compose service name (a static target, or a DNS A lookup of a scaled
service) on that port.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

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
    assert {"router", "planner", "kvdirectory", "worker"} <= services, services
    targets = scraped((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    missing = sorted(s for s in services if (s, port) not in targets)
    assert not missing, f"not scraped on :{port}: {missing} (scraped: {sorted(targets)})"


def resolved_services(env: dict[str, str]) -> dict[str, str]:
    """Service name → its block of ``docker-compose config`` (the file with anchors, merges and
    variables resolved), as text."""
    import subprocess

    out = subprocess.run(["docker-compose", "-f", str(REPO / "docker-compose.yml"), "config"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    block = ("\n" + out).split("\nservices:\n", 1)[1]
    block = re.split(r"\n[a-z]", block, maxsplit=1)[0]  # up to the next top-level key
    parts = re.split(r"^  ([A-Za-z0-9_-]+):\n", block, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_api_keys_reach_the_router_and_only_the_router():
    """``EI_API_KEYS=k1,k2 docker compose up`` (README, Security) must reach the router, whose port
    is published: the compose file listed every variable it passes and not this one, so the
    router served open whatever the operator set. Resolved by ``docker-compose config`` (Debian's
    docker-compose 1.29; no engine needed); the other services do not get the keys."""
    import os
    import shutil

    import pytest

    if shutil.which("docker-compose") is None:
        pytest.skip("needs docker-compose (Debian package; .ci/run installs it)")
    services = resolved_services(dict(os.environ, EI_API_KEYS="k1,k2"))
    assert {"router", "kvdirectory", "planner", "worker", "nats", "auth", "stream"} <= set(services), sorted(services)
    assert re.search(r"^      EI_API_KEYS: k1,k2$", services["router"], re.M), services["router"]
    others = sorted(n for n, text in services.items() if n != "router" and "EI_API_KEYS" in text)
    assert others == [], others
    env = {k: v for k, v in os.environ.items() if k != "EI_API_KEYS"}
    unset = re.findall(r"^      EI_API_KEYS:(.*)$", resolved_services(env)["router"], re.M)
    assert unset in ([], [" ''"]), unset  # open by default (empty = no keys)


def test_api_keys_can_reach_the_router_as_a_file_secret_not_in_its_environment():
    """Keys in ``EI_API_KEYS`` are in the router container's configuration: ``docker inspect`` shows them to anyone
    who may talk to the Docker daemon, and compose had no other way to pass them (the router's ``EI_API_KEYS_FILE``
    was not in its environment list). ``EI_API_KEYS_FILE`` now passes through, and ``deploy/docker/compose-api-keys.yml``
    mounts a keys file as a compose secret and points the router at it: the router's configuration holds the path,
    never a key, and no other service gets either. Resolved by ``docker-compose config`` (no engine needed)."""
    import os
    import shutil

    import pytest

    if shutil.which("docker-compose") is None:
        pytest.skip("needs docker-compose (Debian package; .ci/run installs it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEYS")}
    services = resolved_services(dict(env, EI_API_KEYS_FILE="/keys/api-keys.txt"))
    assert re.search(r"^      EI_API_KEYS_FILE: /keys/api-keys.txt$", services["router"], re.M), services["router"]
    assert sorted(n for n, text in services.items() if n != "router" and "EI_API_KEYS" in text) == []
    unset = re.findall(r"^      EI_API_KEYS_FILE:(.*)$", resolved_services(env)["router"], re.M)
    assert unset in ([], [" ''"]), unset  # empty: no file (the router reads none)

    secret = "k-not-in-the-config-0123456789"
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        keys = Path(d) / "api-keys.txt"
        keys.write_text(f"{secret}\n")
        out = subprocess.run(["docker-compose", "-f", str(REPO / "docker-compose.yml"), "-f",
                              str(REPO / "deploy" / "docker" / "compose-api-keys.yml"), "config"],
                             env=dict(env, EI_API_KEYS_SECRET=str(keys)), capture_output=True, text=True, timeout=60, check=True).stdout
    import yaml

    doc = yaml.safe_load(out)
    router = doc["services"]["router"]
    assert router["environment"]["EI_API_KEYS_FILE"] == "/run/secrets/ei_api_keys", router["environment"]
    assert [s["source"] if isinstance(s, dict) else s for s in router["secrets"]] == ["ei_api_keys"], router["secrets"]
    assert doc["secrets"]["ei_api_keys"]["file"] == str(keys), doc["secrets"]
    assert secret not in out  # the keys stay in the file
    assert [n for n, svc in doc["services"].items() if n != "router" and ("secrets" in svc or "EI_API_KEYS_FILE" in str(svc))] == []
    # without the file named, compose refuses with the variable's name rather than mounting nothing
    bad = subprocess.run(["docker-compose", "-f", str(REPO / "docker-compose.yml"), "-f",
                          str(REPO / "deploy" / "docker" / "compose-api-keys.yml"), "config"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "EI_API_KEYS_SECRET" in bad.stderr, bad.stderr


FILE_SD_NAME = re.compile(r"^[^*]*(\*[^/]*)?\.(json|yml|yaml|JSON|YML|YAML)$")
"""Prometheus's own rule for a ``file_sd_configs`` path (``discovery/file``'s ``patFileSDName``): a ``*`` only in its
last part, and a .json/.yml/.yaml name; any other path and Prometheus refuses its config ("is not valid for file
discovery") and does not start."""


def yaml_blocks(text: str) -> list[str]:
    """The fenced ```yaml blocks of a Markdown text (a list item's indented ones too), dedented."""
    return [textwrap.dedent(body) for _, body in re.findall(r"^( *)```yaml\n(.*?)^\1```", text, re.M | re.S)]


def file_sd_paths(text: str) -> list[str]:
    """Every path a ``files: [...]`` list in ``text`` gives (block YAML, or the flow form of a comment)."""
    return [p.strip().strip("'\"") for group in re.findall(r"files: \[([^\]]*)\]", text) for p in group.split(",") if p.strip()]


def test_the_file_sd_paths_the_docs_give_are_ones_prometheus_accepts_and_find_the_slurm_job_s_file():
    """Before, the Slurm README's snippet was ``files: [".../runs/slurm-*/prometheus-targets.json"]``: a glob in a
    folder's name, which Prometheus refuses (``promtool check config``: "is not valid for file discovery"), so a
    Prometheus set up from it did not start. Now the job also writes its list to one flat folder,
    ``runs/prometheus-targets/slurm-<jobid>.json`` (``deploy/slurm/evolving-infra.sbatch``; the file itself is
    checked by ``tests/deploy/test_slurm_supervision.py``), and every path the docs give is one Prometheus takes."""
    slurm = (REPO / "deploy" / "slurm" / "README.md").read_text()
    readme = (REPO / "README.md").read_text()
    paths = {doc: file_sd_paths(text) for doc, text in (("deploy/slurm/README.md", slurm), ("README.md", readme))}
    assert all(paths.values()), paths
    for doc, found in paths.items():
        for path in found:
            assert FILE_SD_NAME.match(path), (doc, path)
    # the Slurm job's file, by the glob both docs give: runs/prometheus-targets/slurm-<jobid>.json
    job_file = "/shared/evolving-infra/runs/prometheus-targets/slurm-4242.json"
    for doc in ("deploy/slurm/README.md", "README.md"):
        assert any(fnmatch.fnmatchcase(job_file, p) for p in paths[doc] if "prometheus-targets" in p), (doc, paths[doc])
    sbatch = (REPO / "deploy" / "slurm" / "evolving-infra.sbatch").read_text()
    assert 'TARGETS_DIR=${PROMETHEUS_TARGETS_DIR:-$(dirname "$RUN")/prometheus-targets}' in sbatch
    assert "TARGETS_FILE=$TARGETS_DIR/slurm-${SLURM_JOB_ID:-0-$$}.json" in sbatch
    assert 'RUN=${EI_RUN_DIR:-$EI_HOME/runs/slurm-${SLURM_JOB_ID:-0}}' in sbatch  # so: $EI_HOME/runs/prometheus-targets
    # the rule catches what it is for: the old snippet's path
    assert not FILE_SD_NAME.match("/shared/evolving-infra/runs/slurm-*/prometheus-targets.json")


def test_promtool_loads_the_slurm_readme_s_prometheus_config(tmp_path):
    """``promtool check config`` on each YAML block of ``deploy/slurm/README.md`` that configures Prometheus (the
    Metrics section's ``scrape_configs``), as Prometheus would load it; the old snippet's path fails the same check."""
    promtool = shutil.which("promtool")
    if promtool is None:
        # as tests/deploy/test_prometheus_alerts.py: apt-get download prometheus && dpkg-deb -x prometheus_*.deb D
        pytest.skip("needs promtool on PATH (Prometheus's release archive, or Debian's prometheus package)")
    blocks = [b for b in yaml_blocks((REPO / "deploy" / "slurm" / "README.md").read_text()) if "scrape_configs:" in b]
    assert blocks, "no Prometheus config in deploy/slurm/README.md"

    def check(tmp: Path, text: str) -> subprocess.CompletedProcess[str]:
        tmp.mkdir()
        (tmp / "prometheus.yml").write_text(text)
        return subprocess.run([promtool, "check", "config", str(tmp / "prometheus.yml")], capture_output=True, text=True, timeout=60)

    for k, block in enumerate(blocks):
        out = check(tmp_path / str(k), block)
        assert out.returncode == 0 and "SUCCESS" in out.stdout, block + out.stdout + out.stderr
    old = blocks[0].replace("runs/prometheus-targets/*.json", "runs/slurm-*/prometheus-targets.json")
    assert old != blocks[0], blocks[0]
    out = check(tmp_path / "old", old)
    assert out.returncode != 0 and "is not valid for file discovery" in out.stdout + out.stderr, out.stdout + out.stderr
