"""README.md's "Agent harness hints" commands, run as written against a real cluster (every service its own OS
process over a real nats-server), and what the section says they do.

A newcomer found the hints only in services/router/README.md, and the top-level README promised a hint for
compactions that does not exist (a compaction is the same branch id with rewritten messages: the directory
bumps the branch's version, DESIGN.md Alg. E.1). The section's ``bash`` block is taken from README.md itself,
so a command edited into something that fails fails here; only the router's URL is replaced (the test's
cluster listens on a free port). The tiny profile's 4-token blocks make the section's short prompts hold full
blocks, so the compaction has a block path to rewrite; 4,096 GPU KV tokens a node hold the SDK example's prompts.

The section's ``python`` block (the OpenAI SDK: hint headers in ``extra_headers``, the tool-call hint, a side
request sent without the branch id, a sub-agent and its ``/end``) is run as written too, by an interpreter that has
``openai``: ``EI_OPENAI_PYTHON`` (a scratch venv's python: the project's venv does not carry the SDK), else this
one; skipped when neither imports it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from evolving_infra.cluster import ClusterSpec, LocalCluster
from shared import messages as m
from shared.bus import Bus
from shared.subjects import BRANCH_EVENTS, SVC_STATS, Subjects

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(shutil.which("curl") is None, reason="the README's commands are curl commands: curl is not installed"),
]

README = Path(__file__).resolve().parents[2] / "README.md"
DOC_URL = "http://127.0.0.1:8000"


def section() -> str:
    """README.md's "Agent harness hints" section."""
    return README.read_text().split("## Agent harness hints", 1)[1].split("\n## ", 1)[0]


def section_commands() -> list[tuple[str, str]]:
    """(comment, command) of each command of the section's bash block, continuation lines joined."""
    sec = section()
    block = re.search(r"```bash\n(.*?)```", sec, re.S)
    assert block, "README.md's Agent harness hints section has no bash block"
    out: list[tuple[str, str]] = []
    comment = ""
    for line in block.group(1).replace("\\\n", " ").splitlines():
        if line.startswith("#"):
            comment = line
        elif line.strip():
            out.append((comment, line))
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory):
    spec = ClusterSpec(nodes=2, split="1P1D", profile="tiny", speedup=5.0, port=0, block_size=4, metrics=True, gpu_kv_tokens=4096,
                       log_dir=str(tmp_path_factory.mktemp("logs")), ready_timeout_s=60.0)  # fmt: skip
    async with LocalCluster(spec) as c:
        yield c


async def directory_counters(bus: Bus) -> dict[str, int]:
    rep = await bus.request(SVC_STATS, m.StatsRequest(), instance="kvdirectory", timeout=5.0)
    return dict(rep.counters)


async def counter_reaches(bus: Bus, key: str, value: int) -> dict[str, int]:
    """The directory's counters once ``key`` is ``value`` (the router's events reach it over the bus), within 10 s."""
    for _ in range(100):
        got = await directory_counters(bus)
        if got.get(key, 0) >= value:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"directory counter {key} never reached {value}: {got}")


async def compactions(cluster: LocalCluster) -> float:
    """``ei_kvdirectory_branch_compactions_total`` on the directory's /metrics."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(cluster.metrics_urls["kvdirectory"])).text
    got = re.search(r"^ei_kvdirectory_branch_compactions_total (\S+)$", text, re.M)
    assert got, text
    return float(got[1])


async def test_the_readme_harness_commands_work_as_written_and_do_what_it_says(cluster):
    cmds = section_commands()
    kinds = [c for c, _ in cmds]
    assert [k.split(":")[0] for k in kinds] == ["# a main branch", "# a sub-agent", "# a fork", "# a tool call",
                                                "# a compaction", "# the end of a branch (here the sub-agent's, which returned)"]
    assert all(DOC_URL in cmd for _, cmd in cmds), "every command names up's default URL"
    bus = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="readme-hints", auth=cluster.client_auth("admin"))
    events: list[m.BranchEvent] = []

    async def on_branch(msg: m.BranchEvent, _subject: str) -> None:
        events.append(msg)

    try:
        await bus.subscribe(BRANCH_EVENTS, on_branch)  # the router's announcements, as the directory reads them
        for comment, cmd in cmds:
            if comment.startswith("# a compaction"):
                before = await directory_counters(bus)
                assert before.get("branch.version_bumps", 0) == 0, before  # extensions and forks bump nothing
            run = subprocess.run(["bash", "-c", cmd.replace(DOC_URL, cluster.router_url) + ' -w "\\n%{http_code}"'],
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
            body, _, code = run.stdout.rpartition("\n")
            assert run.returncode == 0 and code == "200", (comment, cmd, run.stdout, run.stderr)
            assert '"error"' not in body, (comment, body)
            if comment.startswith("# a compaction"):  # its conversation, for the side request's check below
                compacted = json.loads(re.search(r"-d '(.*)'", cmd)[1])["messages"]  # type: ignore[index]
                compacted.append({"role": "assistant", "content": json.loads(body)["choices"][0]["message"]["content"]})
        got = await counter_reaches(bus, "branch.version_bumps", 1)  # the compaction: same id, rewritten messages
        assert got["branch.version_bumps"] == 1 and got.get("branch.started") == 3, got
        await counter_reaches(bus, "branch.ended", 1)
        for _ in range(100):  # the directory has them: this subscriber's copies come at about the same time
            if len(events) >= 4:
                break
            await asyncio.sleep(0.1)
        # what the commands' headers told the router: each branch's kind, parent and agent as the section says
        # (a sub-agent or fork command whose kind or parent header were misspelt starts a main branch with no parent)
        starts = [(e.branch_id, e.kind, e.parent_branch_id, e.agent_id) for e in events if isinstance(e, m.BranchStart)]
        assert starts == [("task-42", "main", None, "coder-1"), ("task-42-explore", "subagent", "task-42", "explorer-1"),
                          ("task-42-retry", "fork", "task-42", "coder-1")], events  # fmt: skip
        assert [e.branch_id for e in events if isinstance(e, m.BranchEnd)] == ["task-42-explore"], events
        async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as http:
            again = await http.post("/v1/chat/completions", headers={"X-Branch-Id": "task-42-explore"},
                                    json={"messages": [{"role": "user", "content": "more"}], "max_tokens": 2})  # fmt: skip
            assert again.status_code == 400 and again.json()["error"]["param"] == "X-Branch-Id"
            assert again.json()["error"]["message"] == (  # as quoted
                "X-Branch-Id 'task-42-explore' names a branch that was ended; start a new branch id")
            again_end = await http.post("/v1/branches/task-42-explore/end")  # idempotent, as the section says
            assert again_end.status_code == 200 and again_end.json()["already"] is True, again_end.text
            assert (await http.post("/v1/branches/task-42-explore/tool-call")).status_code == 410
            # an id nobody knows: a 404 once the directory has settled after its start (the section: 503 with
            # Retry-After: 1 until every router has republished its branches to it)
            for _ in range(30):
                never = await http.post("/v1/branches/never-seen/tool-call")
                if never.status_code != 503:
                    break
                assert never.headers["retry-after"] == "1" and "republish" in never.json()["error"]["message"], never.text
                await asyncio.sleep(1.0)
            assert never.status_code == 404, never.text
            metrics = (await http.get("/metrics")).text
        assert 'ei_router_branch_parents_missing_total{reason="unknown"} 0.0' in metrics  # the section's parents are known
        # the compaction where the section says a harness author sees it: the directory's /metrics, no NATS client
        async with httpx.AsyncClient(timeout=10) as http:
            dmetrics = (await http.get(cluster.metrics_urls["kvdirectory"])).text
        assert "ei_kvdirectory_branch_compactions_total 1.0" in dmetrics, dmetrics
        assert "ei_kvdirectory_branches_active 2.0" in dmetrics  # task-42 and task-42-retry (the sub-agent ended)
        assert 'ei_kvdirectory_branch_parents_missing_total{reason="unknown"} 0.0' in dmetrics
        # the python block's side request (a title) goes without the branch id, so the branch's next request extends
        # its conversation: no compaction (with X-Branch-Id: task-42 on the side request, two)
        async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as http:
            side = await http.post("/v1/chat/completions", json={"max_tokens": 8, "messages": [
                {"role": "user", "content": "Write a 5-word title for: fix parser.py"}]})  # fmt: skip
            assert side.status_code == 200, side.text
            compacted.append({"role": "user", "content": "Tool result: test_empty_header passes"})
            r = await http.post("/v1/chat/completions", headers={"X-Branch-Id": "task-42", "X-Agent-Id": "coder-1"},
                                json={"messages": compacted, "max_tokens": 4})  # fmt: skip
            assert r.status_code == 200, r.text
            assert (await http.post("/v1/branches/task-42-retry/end")).status_code == 200  # a mark after the placements
        await counter_reaches(bus, "branch.ended", 2)
        assert await compactions(cluster) == 1.0
    finally:
        await bus.close()


def openai_python() -> str | None:
    """An interpreter that imports ``openai``: ``EI_OPENAI_PYTHON``, else this one; None when neither does."""
    for python in (os.environ.get("EI_OPENAI_PYTHON"), sys.executable):
        if python and subprocess.run([python, "-c", "import openai"], capture_output=True).returncode == 0:
            return python
    return None


async def test_the_readme_openai_sdk_example_runs_as_written_and_prints_what_it_says(cluster, tmp_path):
    python = openai_python()
    if python is None:
        pytest.skip("no interpreter with the openai package (set EI_OPENAI_PYTHON to one)")
    sec = section()
    block = re.search(r"```python\n(.*?)```", sec, re.S)
    assert block, "README.md's Agent harness hints section has no python block"
    code = block.group(1)
    assert DOC_URL + "/v1" in code
    script = tmp_path / "sdk_example.py"
    script.write_text(code.replace(DOC_URL, cluster.router_url))
    bus = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="readme-sdk", auth=cluster.client_auth("admin"))
    try:
        ended = (await directory_counters(bus)).get("branch.ended", 0)
        before = await compactions(cluster)
        run = await asyncio.to_thread(subprocess.run, [python, str(script)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        await counter_reaches(bus, "branch.ended", ended + 1)  # the script's last event: its placements came before
    finally:
        await bus.close()
    # the side request went without the branch id: task-43's conversation was extended, never compacted (with
    # task-43's headers on the side request, the side request and the request after it compact it)
    assert await compactions(cluster) == before
    lines = run.stdout.splitlines()
    assert lines[0] == "{'branch_id': 'task-43', 'outstanding': True, 'expected_s': 120.0}", lines  # as the section quotes
    assert lines[2] == "{'branch_id': 'task-43-explore', 'ended': True}", lines
    tokens = re.fullmatch(r"prompt tokens (\d+) cached (\d+)", lines[1])
    assert tokens, lines
    prompt, cached = int(tokens[1]), int(tokens[2])
    assert cached >= prompt // 2, lines  # the branch's prefix was reused
    for quoted in lines:  # every line printed is the one the section quotes (the tokens are the default profile's)
        if not quoted.startswith("prompt tokens"):
            assert f"`{quoted}`" in sec, quoted
