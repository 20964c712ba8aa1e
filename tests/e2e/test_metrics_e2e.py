"""Prometheus metrics on a live cluster (issue 20, metrics must-show).

A 2P2D cluster of real processes over a real nats-server, every service with a
``--metrics-port``, replays real Claude Code sessions (the shipped sample).
During the replay every ``/metrics`` endpoint (the router's HTTP port and the
metrics port of each of the six services) is scraped repeatedly and must parse
with ``prometheus_client.parser``; afterwards the router's TTFT histogram
counts exactly the requests served, and the per-node, directory, planner and
bus families carry what the run did (a malformed message sent during the run is
counted under its subject).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from evolving_infra.cluster import ClusterSpec, LocalCluster
from evolving_infra.launcher import demo_trace_path
from evolving_infra.replay.core import Arrival
from evolving_infra.replay.live import LiveReplayer
from evolving_infra.traces.io import read_trace
from shared.bus import Bus
from shared.clock import SimClock
from shared.subjects import KV_EVENTS, Subjects

SESSIONS = 3
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "evolving-infra.json"
ALERTS = DASHBOARD.parents[2] / "prometheus" / "alerts.yml"
FAULT_METRICS = (
    "ei_bus_stream_held_dropped_total", "ei_nats_reconnects_total", "ei_bus_stream_lookup_retries_total",
    "ei_bus_jetstream_missing_warnings_total", "ei_router_slow_client_aborts_total", "ei_router_buffered_output_tokens",
    "ei_router_drain_refused_total", "ei_node_bind_failures_total", "ei_node_bind_refused_total", "ei_node_parked",
    "ei_nats_permission_violations_total", "ei_router_gone_before_dispatch_total", "ei_router_gate_disconnects_total",
    "ei_router_branches_active", "ei_router_branches_evicted_total", "ei_service_ready", "ei_bus_resend_dropped_total",
    "ei_router_chunks_gap_total", "ei_router_chunks_bad_logprobs_total", "ei_router_redispatches_total",
    "ei_node_requests_dropped_owner_gone_total",
)
"""What the dashboard's "Faults & health" row shows: lost reliable messages (held copies, resend windows), NATS
reconnects and stream waits, slow and gone clients, buffered tokens, drains, failed decode bindings, parked prefills,
permission violations, services up but not ready, requests failed for output lost on the bus or for a node's malformed
log-probabilities, requests placed again after a node loss and streams lost with their router. The live test below
checks that each is exported from a service's first scrape (a counter at 0), so an ``increase()`` over it (panel or
alert) counts the first fault too."""


def graphs(dash: dict) -> list[dict]:
    """The dashboard's graph panels: every panel but its rows (``type: row``, a heading without queries)."""
    return [p for p in dash["panels"] if p["type"] != "row"]


def alert_rules() -> list[dict]:
    """Every rule of ``deploy/prometheus/alerts.yml`` (Prometheus rule-file format)."""
    import yaml

    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


SCRAPE_LABELS = {"job", "instance", "slurm_job"}
"""Labels Prometheus adds to every scraped series (``job``, ``instance``; ``slurm_job`` from the Slurm job's file_sd
targets, ``deploy/slurm/evolving-infra.sbatch``), not in what a service exports: the dashboard's template variables."""

SELECTOR = '{job=~"$job",instance=~"$instance",slurm_job=~"$slurm_job"}'


def test_dashboard_filters_every_query_by_its_variables_and_seconds_axes_draw_only_seconds():
    """Every series the dashboard queries is selected by its ``job`` / ``instance`` / ``slurm_job`` variables (one
    Prometheus scraping several clusters, or the Slurm jobs of a file_sd glob, showed them summed); the variables
    exist, list the label's values, and ``slurm_job`` is a label the Slurm job's targets carry. A panel whose axis is
    seconds draws only ``*_seconds*`` series: "Phase switch time P95 (s)" also drew increase(ei_split_changes_total),
    a count. Static (no cluster): the live test below checks names, labels and types against real scrapes."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    for name in SCRAPE_LABELS:
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["allValue"] == ".*", v  # .* also matches a series without it
        assert re.fullmatch(rf"label_values\(ei_\w+(\{{[^}}]*\}})?, {name}\)", v["query"]["query"]), v["query"]
    sbatch = (DASHBOARD.parents[2] / "slurm" / "evolving-infra.sbatch").read_text()
    assert '"slurm_job": "%s"' in sbatch
    titles = {p["title"] for p in dash["panels"]}
    for p in graphs(dash):
        assert p["targets"], p["title"]
        for t in p["targets"]:
            e = t["expr"]
            uses = re.findall(r"\bei_[a-z0-9_]+(\{[^}]*\})?", e)
            assert uses and all(u == SELECTOR for u in uses), (p["title"], e)
            if p["fieldConfig"]["defaults"]["unit"] == "s":
                assert all("_seconds" in n for n in re.findall(r"\bei_[a-z0-9_]+", e)), (p["title"], e)
        if p["fieldConfig"]["defaults"]["unit"] == "s":
            assert not any(o["properties"] for o in p["fieldConfig"].get("overrides", ())), p["title"]
    # what a vLLM / Dynamo operator looks for first
    exprs = " ".join(t["expr"] for p in graphs(dash) for t in p["targets"])
    for name in ("ei_router_e2e_seconds_bucket", "ei_router_generation_tokens_total", "ei_router_cached_prompt_tokens_total",
                 "ei_router_inter_token_latency_seconds_bucket", "ei_split_changes_total",
                 # a worker killed mid-run: the requests it failed, and its fence (back within a second, between scrapes)
                 "ei_router_requests_finished_total", "ei_router_node_fences_total"):
        assert name in exprs, name
    # every router fences a silent node on its own (router replicas: tests/e2e/test_faults.py): one kill is one fence
    # per router, so a sum over routers counted it once per router; the panel takes the most any router counted
    fences = [t["expr"] for p in graphs(dash) for t in p["targets"] if "ei_router_node_fences_total" in t["expr"]]
    assert fences and all(e.startswith("max by (node) (increase(ei_router_node_fences_total") for e in fences), fences
    assert len(titles) == len(dash["panels"]) and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    # the faults an operator looks for, under their own row: the panels below the "Faults & health" row (up to the
    # next row) together query each of them
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    (faults,) = [r for r in rows if r["title"] == "Faults & health"]
    below = [r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > faults["gridPos"]["y"]]
    y0, y1 = faults["gridPos"]["y"], min(below, default=float("inf"))
    fault_exprs = [t["expr"] for p in graphs(dash) if y0 < p["gridPos"]["y"] < y1 for t in p["targets"]]
    assert not [n for n in FAULT_METRICS if not any(re.search(rf"\b{n}\b", e) for e in fault_exprs)]
    # and no two panels overlap (Grafana moves one of two overlapping panels, out of the row it was put under)
    boxes = [(p["title"], p["gridPos"]) for p in dash["panels"]]
    for i, (a, g) in enumerate(boxes):
        for b, h in boxes[i + 1 :]:
            overlap = (g["x"] < h["x"] + h["w"] and h["x"] < g["x"] + g["w"]
                       and g["y"] < h["y"] + h["h"] and h["y"] < g["y"] + g["h"])
            assert not overlap, (a, b)


def sample(name: str, families: dict, labels: dict | None = None, suffix: str = "") -> float:
    """Value of the one sample ``name+suffix`` with ``labels`` (subset match) in parsed families."""
    fam = families[name]
    hits = [s.value for s in fam.samples if s.name == name + suffix and all(s.labels.get(k) == v for k, v in (labels or {}).items())]
    assert len(hits) == 1, (name, suffix, labels, fam.samples)
    return hits[0]


def parse(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def type_problems(expr: str, kinds: dict[str, str]) -> list[str]:
    """What in one PromQL expression does not fit the exported types: ``rate``/``irate``/``increase``
    of anything but a counter's ``_total`` or a histogram's ``_bucket``/``_sum``/``_count``
    (a gauge's rate is meaningless), ``histogram_quantile`` over anything but a histogram's
    ``_bucket``. ``kinds``: exported sample name → its family's type (``counter``, ``gauge``, ...)."""
    out = []
    for name in re.findall(r"\b(?:rate|irate|increase)\(\s*(ei_[a-z0-9_]+)", expr):
        kind = kinds.get(name)
        if not ((kind == "counter" and name.endswith("_total")) or (kind == "histogram" and name.endswith(("_bucket", "_sum", "_count")))):
            out.append(f"rate/increase of {name} ({kind})")
    for m in re.finditer(r"histogram_quantile\(", expr):
        depth, i = 1, m.end()
        while depth and i < len(expr):
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        for name in re.findall(r"\bei_[a-z0-9_]+", expr[m.end() : i]):
            if not (name.endswith("_bucket") and kinds.get(name) == "histogram"):
                out.append(f"histogram_quantile over {name} ({kinds.get(name)})")
    return out


@pytest.mark.timeout(600)
async def test_every_metrics_endpoint_parses_during_a_replay_and_ttft_counts_the_requests_served(tmp_path):
    trace = read_trace(demo_trace_path())
    agents = list(dict.fromkeys(r.agent for r in trace.requests))[:SESSIONS]
    requests = [r for r in trace.requests if r.agent in set(agents)]
    requests = [r if r.pause_s <= 2.0 else msgspec.structs.replace(r, pause_s=2.0) for r in requests]
    spec = ClusterSpec(
        nodes=4, split="2P2D", speedup=50.0, port=0, block_size=trace.header.block_size, metrics=True,
        log_dir=str(tmp_path / "logs"), ready_timeout_s=120.0,
    )
    async with LocalCluster(spec) as cluster:
        urls = {"router-http": cluster.router_url + "/metrics", **cluster.metrics_urls}
        assert set(cluster.metrics_urls) == {"router", "planner", "kvdirectory", "worker-w0", "worker-w1", "worker-w2", "worker-w3"}
        scrapes: dict[str, int] = {k: 0 for k in urls}
        first: dict[str, dict] = {}  # each endpoint's first scrape, parsed: what Prometheus sees before anything happened
        done = asyncio.Event()

        async def scrape_loop() -> None:
            async with httpx.AsyncClient(timeout=10) as http:
                while not done.is_set():
                    for name, url in urls.items():
                        r = await http.get(url)
                        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
                        first.setdefault(name, parse(r.text))  # parse raises on a malformed exposition
                        scrapes[name] += 1
                    await asyncio.sleep(0.2)

        scraper = asyncio.create_task(scrape_loop())
        bus = await Bus.connect(cluster.nats_url, Subjects(spec.partition), service="test", instance="metrics-test", auth=cluster.client_auth("admin"))
        await bus.publish_raw(Subjects(spec.partition).format(KV_EVENTS, node="w0"), b"\xc1 not msgpack")
        await bus.close()
        replayer = LiveReplayer(cluster.router_url, SimClock(spec.speedup, cluster.clock_origin), block_size=trace.header.block_size, progress=False)
        result = await replayer.run(requests, Arrival(kind="closed", concurrency=SESSIONS))
        done.set()
        await scraper
        assert all(n >= 2 for n in scrapes.values()), scrapes

        served = [r for r in result.records if r.ok]
        assert len(served) == len(requests) > 0
        async with httpx.AsyncClient(timeout=10) as http:
            text = {name: (await http.get(url)).text for name, url in urls.items()}
        fams = {name: parse(t) for name, t in text.items()}

    router = fams["router-http"]
    assert sample("ei_router_ttft_seconds", router, suffix="_count") == len(served)
    assert sample("ei_router_ttft_seconds", router, {"le": "+Inf"}, "_bucket") == len(served)
    assert sample("ei_router_e2e_seconds", router, suffix="_count") == len(served)
    assert sample("ei_router_tpot_seconds", router, suffix="_count") == sum(1 for r in served if r.completion_tokens > 1)
    assert sample("ei_router_requests", router, {"code": "200"}, "_total") == len(served)
    assert sample("ei_router_prompt_tokens", router, suffix="_total") == sum(r.prompt_tokens for r in served)
    assert sample("ei_router_cached_prompt_tokens", router, suffix="_total") == sum(r.cached_tokens for r in served)
    # every served request counted once, under its finish reason
    assert sum(v.value for v in router["ei_router_requests_finished"].samples if v.name.endswith("_total")) == len(served)
    # the served KV hit rate: cached over ALL prompt tokens (the report's "KV hit")
    prompt, cached = sum(r.prompt_tokens for r in served), sum(r.cached_tokens for r in served)
    router_hit = sample("ei_router_kv_hit_ratio", router)
    assert router_hit == pytest.approx(cached / prompt)
    queued = sum(sample("ei_router_queue_seconds", router, {"node": n}, "_count") for n in ("w0", "w1"))
    assert queued == len(served)
    # the router's metrics port serves the same registry as its HTTP port
    assert sample("ei_router_ttft_seconds", fams["router"], suffix="_count") == len(served)

    planner = fams["planner"]
    assert sum(sample("ei_split_nodes", planner, {"phase": p}) for p in ("prefill", "decode", "both")) == 4
    assert sample("ei_split_nodes", planner, {"phase": "prefill"}) == 2

    prefill_iters = 0.0
    for node, phase in (("w0", "prefill"), ("w1", "prefill"), ("w2", "decode"), ("w3", "decode")):
        w = fams[f"worker-{node}"]
        assert sample("ei_node_phase", w, {"node": node, "phase": phase}) == 1
        assert sample("ei_node_kv_l1_capacity_blocks", w, {"node": node}) > 0
        for name in ("ei_node_queue_depth", "ei_node_running_batch", "ei_node_kv_l1_used_blocks", "ei_node_kv_l2_used_blocks"):
            assert sample(name, w, {"node": node}) >= 0
        if phase == "prefill":
            prefill_iters += sample("ei_node_iterations", w, {"node": node}, "_total")
    assert prefill_iters > 0

    d = fams["kvdirectory"]
    ideal = sample("ei_kv_reuse_ideal_tokens", d, suffix="_total")
    hit = sample("ei_kv_reuse_hit_tokens", d, suffix="_total")
    assert ideal > 0 and 0 <= hit <= ideal
    assert sample("ei_kv_lost_reuse_ratio", d) == pytest.approx(1 - hit / ideal)
    # the directory's ei_kv_hit_ratio is h/h* over reusable prefix tokens only: a different quantity from the
    # router's served hit rate (higher, new prompt tokens are in neither h nor h*), and each HELP says which
    dir_hit = sample("ei_kv_hit_ratio", d)
    assert dir_hit == pytest.approx(hit / ideal) and ideal < prompt and dir_hit > router_hit, (dir_hit, router_hit)
    assert "ei_router_kv_hit_ratio" in d["ei_kv_hit_ratio"].documentation
    assert "ei_kv_hit_ratio" in router["ei_router_kv_hit_ratio"].documentation.replace("ei_router_kv_hit_ratio", "")
    print(f"served KV hit (router) {router_hit:.4f} = {cached}/{prompt}; h/h* (directory) {dir_hit:.4f} = {hit:.0f}/{ideal:.0f}")
    assert sample("ei_kvdirectory_lookup_seconds", d, suffix="_count") >= len(served)
    assert sample("ei_kvdirectory_ingest_seconds", d, suffix="_count") > 0
    assert sample("ei_bus_messages_dropped", d, {"subject": KV_EVENTS.template}, "_total") == 1

    # every fault the dashboard's row shows is exported from the services' first scrape on, before any fault (a counter
    # at 0: increase() over a series that appears only with its first fault misses that fault, and the panel and the
    # alert on it stay empty); lost output and resend windows never happened here, at 0 in every scrape
    assert set(first) == set(urls), sorted(first)
    at_start = {s.name for fam in first.values() for f in fam.values() for s in f.samples}
    assert not [n for n in FAULT_METRICS if n not in at_start], sorted(at_start)
    for endpoint, fam in [*first.items(), *fams.items()]:
        assert sample("ei_bus_resend_dropped", fam, suffix="_total") == 0, endpoint  # every service's bus
        if endpoint.startswith("router"):
            assert sample("ei_router_chunks_gap", fam, suffix="_total") == 0, endpoint
            assert sample("ei_router_chunks_bad_logprobs", fam, suffix="_total") == 0, endpoint

    # every series the Grafana dashboard queries exists in what the services export, with the
    # labels its PromQL groups by (``by (...)``) or selects (``{...}``)
    exported: dict[str, set[str]] = {}
    kinds: dict[str, str] = {}
    for fam in fams.values():
        for f in fam.values():
            for smp in f.samples:
                exported.setdefault(smp.name, set()).update(smp.labels)
                kinds[smp.name] = f.type
    targets = [(t["expr"], set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", ""))))
               for p in graphs(json.loads(DASHBOARD.read_text())) for t in p["targets"]]
    # and so does every series the alerting rules (deploy/prometheus/alerts.yml) evaluate, with the labels their
    # annotations name ({{ $labels.node }})
    rules = alert_rules()
    targets += [(r["expr"], set(re.findall(r"\$labels\.(\w+)", " ".join(r.get("annotations", {}).values())))) for r in rules]
    assert targets and rules
    for e, legend in targets:
        names = set(re.findall(r"\b(?:ei_[a-z0-9_]+|process_[a-z_]+)", e))  # ours, and the process collector's
        if not names:  # Prometheus's own `up` (a failed scrape): what it adds, not what a service exports
            assert re.fullmatch(r'up\{job=~"evolving-infra\.\*"\} == 0', e), e
            continue
        labels = {x.strip() for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", e) for x in g.split(",") if x.strip()}
        labels |= legend
        labels -= SCRAPE_LABELS  # Prometheus adds these at scrape (test_dashboard_filters_every_query_by_its_variables)
        # a selector's labels belong to its own series (`a{reason="error"} / b{code=~"5.."}`: reason on a, code on b)
        selected: dict[str, set[str]] = {}
        for n, g in re.findall(r"\b((?:ei|process)_[a-z0-9_]+)\{([^}]*)\}", e):
            selected.setdefault(n, set()).update(x.split("=")[0].strip(" !~") for x in g.split(",") if x.strip())
        assert names and names <= set(exported), (e, sorted(names - set(exported)))
        for n in names:
            want = labels | (selected.get(n, set()) - SCRAPE_LABELS)
            assert want <= exported[n], (e, n, sorted(want - exported[n]))
        # and with the functions their types allow (rate of a counter / bucket, quantiles of a histogram)
        assert not type_problems(e, kinds), (e, type_problems(e, kinds))
    # every latency on the cluster clock says so in its HELP (simulated s under --speedup); the directory's are wall s
    for inst in ("router", "planner"):
        for f in fams[inst].values():
            if f.name.startswith("ei_") and f.name.endswith("_seconds"):  # not process_start_time_seconds (Unix s)
                assert "clock: simulated s under --speedup" in f.documentation, (inst, f.name, f.documentation)
    # every service exports its process's start time: a worker restarted between two scrapes shows there
    assert all("process_start_time_seconds" in fam for fam in fams.values()), {k: sorted(f) for k, f in fams.items()}
    assert all("wall" in d[n].documentation.lower() for n in ("ei_kvdirectory_lookup_seconds", "ei_kvdirectory_ingest_seconds"))
    # the type check catches what it is for, on the same exported types
    assert type_problems("sum by (node) (rate(ei_node_queue_depth[5m]))", kinds) == ["rate/increase of ei_node_queue_depth (gauge)"]
    assert type_problems("histogram_quantile(0.9, sum by (le) (ei_router_ttft_seconds_count))", kinds)
    assert type_problems("histogram_quantile(0.9, sum by (le) (rate(ei_router_kv_hit_ratio[1m])))", kinds)
    assert not type_problems("histogram_quantile(0.9, sum by (le) (rate(ei_router_ttft_seconds_bucket[1m])))", kinds)
