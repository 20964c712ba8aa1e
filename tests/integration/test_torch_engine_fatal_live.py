"""A torch engine whose page map fell out of step with the block pools (``KvMapError``) ends its
worker process with a non-zero exit; ``up``'s supervisor restarts it and the request it held
completes on the restarted node, with the tokens the first request (same prompt) got.

Before, the worker loop logged the error (``loop_errors``) and served on with a page map that may
point a request at another prompt's K/V (wrong tokens, no error). As vLLM (EngineCore: "encountered
a fatal error", ``EngineDeadError``, unrecoverable) and SGLang (the scheduler SIGQUITs its server)
do, the engine's node now dies and is restarted with empty KV.

The fault is real, not mocked: ``--fault-skip-engine-kv-batch 2`` keeps the prefill node's second
KV event batch (the first request's ``BlockStored(gpu)``) from its engine, as if the shell lost it;
the second request with the same prompt hits that prefix in the scheduler's L1 pool, which the
engine has no page for. Needs the ``torch`` extra (no Mooncake); skipped without it.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest
import structlog

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from evolving_infra.cluster import LocalCluster  # noqa: E402
from tests.integration.torch_cluster import tiny_1p1d  # noqa: E402
from tests.unit.worker.torch_tiny import prompt  # noqa: E402


pytestmark = pytest.mark.timeout(600)


async def test_kv_map_error_exits_the_worker_and_its_request_completes_after_the_restart(tmp_path):
    _, spec = tiny_1p1d(tmp_path)
    spec = msgspec.structs.replace(spec, restart=True, worker_args=(), node_args={"w0": ("--fault-skip-engine-kv-batch", "2")})
    p = prompt(7, 3 * 8 + 5)
    body = {"model": "tiny", "prompt": p, "max_tokens": 6, "ignore_eos": True}
    with structlog.testing.capture_logs() as logs:
        async with LocalCluster(spec) as cluster:
            async with httpx.AsyncClient(timeout=120.0) as http:
                first = await http.post(cluster.router_url + "/v1/completions", json=body)
                assert first.status_code == 200, first.text
                assert cluster.restarts().get("worker-w0", 0) == 0
                # the prefix the scheduler holds in L1 has no engine page: KvMapError, exit, restart,
                # the router re-dispatches the request to the restarted node
                second = await http.post(cluster.router_url + "/v1/completions", json=body)
                assert second.status_code == 200, second.text
            assert cluster.restarts()["worker-w0"] == 1
            cluster.check_alive()
    exits = [e for e in logs if e.get("event") == "service exited; restarting" and e.get("service") == "worker-w0"]
    assert [e["code"] for e in exits] == [1], exits
    w0 = (tmp_path / "logs" / "worker-w0.log").read_text()
    fatal = [ln for ln in w0.splitlines() if "engine failed" in ln]
    assert len(fatal) == 1 and '"w0"' in fatal[0] and "KvMapError" in fatal[0] and '"error"' in fatal[0], fatal
    assert "service stopped after a fatal error" in w0
    assert "loop_errors" not in w0
    # the same greedy continuation as the first request's, computed before the fault
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert second.json()["usage"]["completion_tokens"] == 6
