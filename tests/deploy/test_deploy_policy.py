"""Compose and Slurm run the serving system ``evolving-infra up`` runs (issue: a newcomer's deploy walk).

Before, compose's services ran their own defaults (planner ``static``, host eviction ``lru``,
routing ``cache-aware``: a baseline) and the Slurm script the same with ttft routing, while
``up`` runs ``--policy evolving``; and a torch stack's router got neither the model's tokenizer,
name nor context. Now the entrypoint asks ``evolving-infra deploy-args`` (``up``'s own
``_spec`` and ``cluster.service_flags``) for each service's flags, with one knob, ``EI_POLICY``.

The entrypoint runs here with ``/bin/sh`` and a ``python`` shim that records the service's argv
(``test_entrypoint_block_size._run``); the compose file is resolved by ``docker-compose config``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evolving_infra.cli import build_parser
from evolving_infra.cluster import service_flags
from evolving_infra.launcher import _spec
from tests.deploy.test_entrypoint_block_size import _run
from tests.deploy.test_prometheus_config import resolved_services

REPO = Path(__file__).resolve().parents[2]


def _argv(tmp_path: Path, role: str, *args: str, **env: str) -> list[str]:
    out = tmp_path / f"args-{role}-{len(list(tmp_path.glob('args-*')))}"
    r = _run(tmp_path, role, *args, ARGS_OUT=str(out), **env)
    assert r.returncode == 0 and r.stdout.startswith(f"started services.{role}"), (r.stdout, r.stderr)
    return out.read_text().splitlines()


def _flag(argv: list[str], name: str) -> str:
    """The value of the last ``name`` (the one argparse keeps)."""
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]


def _up_flags(service: str, *up: str) -> list[str]:
    return service_flags(_spec(build_parser("up").parse_args(["up", *up])), service)


def test_compose_services_run_up_s_default_system_evolving(tmp_path):
    planner = _argv(tmp_path, "planner")
    router = _argv(tmp_path, "router", "--port", "8000")
    worker = _argv(tmp_path, "worker", EI_REPLICA="2")
    directory = _argv(tmp_path, "kvdirectory")
    # the one router compose runs (--instance router), whose republish a restarted directory waits for (it got only
    # --block-size: a router stalled across a directory restart was not waited for, its branches' ends lost)
    assert (_flag(directory, "--routers"), _flag(directory, "--instance")) == ("router", "kvdirectory"), directory
    assert (_flag(planner, "--planner"), _flag(planner, "--split"), _flag(planner, "--nodes")) == ("evolving", "1P1D", "w0,w1")
    assert (_flag(router, "--routing"), _flag(router, "--decode-binding")) == ("ttft", "prefill-start")
    # the evolving planner's collocated warm-up: every worker starts both, as up launches them (session 59: decode,
    # then switched to both by the planner's first tick); 1P1D comes after the warm-up
    assert (_flag(worker, "--host-eviction"), _flag(worker, "--phase")) == ("branch-count", "both")
    assert _flag(router, "--port") == "8000" and _flag(router, "--host") == "0.0.0.0"
    # the very flags up gives each service for the same cluster (2 nodes)
    for role, argv in (("planner", planner), ("router", router), ("worker", worker), ("kvdirectory", directory)):
        want = _up_flags(role, "--nodes", "2")
        assert any(argv[i : i + len(want)] == want for i in range(len(argv))), (role, argv, want)


def test_ei_policy_picks_another_set_with_its_split(tmp_path):
    env = dict(EI_POLICY="static:2P2D", WORKERS="4")
    planner = _argv(tmp_path, "planner", **env)
    router = _argv(tmp_path, "router", **env)
    phases = [_flag(_argv(tmp_path, "worker", EI_REPLICA=str(i), **env), "--phase") for i in (1, 2, 3, 4)]
    assert (_flag(planner, "--planner"), _flag(planner, "--split")) == ("static", "2P2D")
    assert (_flag(router, "--routing"), _flag(router, "--decode-binding")) == ("cache-aware", "dispatch")
    assert phases == ["prefill", "prefill", "decode", "decode"]
    worker = _argv(tmp_path, "worker", EI_REPLICA="1", EI_POLICY="dynamo", WORKERS="4", SPLIT="3P1D")
    assert (_flag(worker, "--host-eviction"), _flag(worker, "--phase")) == ("lru", "prefill")
    r = _run(tmp_path, "planner", EI_POLICY="nope")
    assert r.returncode == 2 and "started" not in r.stdout and "unknown policy set" in r.stderr, (r.stdout, r.stderr)


def test_torch_engine_gives_the_router_the_model_s_tokenizer_name_and_context(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    model = tmp_path / "tiny-model"
    subprocess.run([sys.executable, "-m", "evolving_infra.cli", "model", "init", str(model)], check=True, capture_output=True,
                   timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    env = dict(EI_ENGINE="torch", EI_MODEL_DIR=str(model))
    router = _argv(tmp_path, "router", **env)
    # and the torch settings up takes (tests/deploy/test_deploy_settings.py: the others): dtype, KV size
    worker = _argv(tmp_path, "worker", EI_REPLICA="1", EI_DTYPE="float32", EI_GPU_KV_TOKENS="8192", **env)
    config = __import__("json").loads((model / "config.json").read_text())
    assert (_flag(router, "--tokenizer"), _flag(router, "--model"), _flag(router, "--max-context-tokens")) == (
        f"hf:{model}", "tiny-model", str(config["max_position_embeddings"]))
    assert (_flag(router, "--profile"), _flag(router, "--block-size")) == ("torch-tiny-cpu", "8")
    assert _flag(router, "--model-vocab-size") == str(config["vocab_size"])
    assert (_flag(worker, "--engine"), _flag(worker, "--model"), _flag(worker, "--profile")) == ("torch", str(model), "torch-tiny-cpu")
    assert _flag(worker, "--tokenizer") == f"hf:{model}"
    assert (_flag(worker, "--dtype"), _flag(worker, "--gpu-kv-tokens")) == ("float32", "8192"), worker


needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="needs docker-compose (.ci/run installs it)")


def _env(**kw: str) -> dict[str, str]:
    keep = ("EI_", "SPLIT", "WORKERS", "MODEL_DIR", "GRAFANA_", "OBSERVABILITY_")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(keep)}, **kw}


@needs_compose
def test_compose_passes_ei_policy_and_no_routing_of_its_own():
    services = resolved_services(_env(EI_POLICY="static:2P2D"))
    for name in ("router", "planner", "kvdirectory", "worker"):
        assert re.search(r"^      EI_POLICY: static:2P2D$", services[name], re.M), (name, services[name])
    assert "--routing" not in services["router"] and "cache-aware" not in services["router"], services["router"]
    assert re.search(r"^      EI_POLICY: evolving$", resolved_services(_env())["planner"], re.M)


@needs_compose
def test_compose_torch_mounts_the_model_in_the_router_and_workers(tmp_path):
    services = resolved_services(_env(EI_ENGINE="torch", MODEL_DIR=str(tmp_path)))
    for name in ("router", "worker", "kvdirectory", "planner"):
        assert re.search(r"^      EI_ENGINE: torch$", services[name], re.M), (name, services[name])
        assert f"{tmp_path}:/models:ro" in services[name], (name, services[name])
    assert "worker-torch" not in services


@needs_compose
def test_compose_observability_is_on_loopback_and_grafana_s_password_is_the_operator_s():
    services = resolved_services(_env(GRAFANA_ADMIN_PASSWORD="s3cret"))
    for name, port in (("prometheus", 9090), ("grafana", 3000), ("jaeger", 16686)):
        published = re.findall(r"^    - (.*):%d/tcp$" % port, services[name], re.M)
        assert published == [f"127.0.0.1:{port}"], (name, services[name])
    assert "published: 8000" in services["router"] and "host_ip" not in services["router"], services["router"]  # as before
    assert re.search(r"^      GF_SECURITY_ADMIN_PASSWORD: s3cret$", services["grafana"], re.M), services["grafana"]
    assert re.search(r"^      GF_AUTH_ANONYMOUS_ENABLED: [\"']false[\"']$", services["grafana"], re.M), services["grafana"]


@needs_compose
def test_each_compose_service_mounts_only_its_own_credentials():
    """Every container mounted the whole credentials volume: the router, whose port is published, could read
    the admin, operator and launcher seeds. Now the auth job copies each identity's seed into that service's
    own volume; only auth (which writes them) and nats (its config) mount the full one."""
    services = resolved_services(_env())
    mounts = {name: re.findall(r"^    - (creds[a-z-]*):(/creds[a-z/-]*)", text, re.M) for name, text in services.items()}
    assert mounts["router"] == [("creds-router", "/creds")], mounts
    assert mounts["planner"] == [("creds-planner", "/creds")] and mounts["kvdirectory"] == [("creds-kvdirectory", "/creds")]
    assert mounts["worker"] == [("creds-workers", "/creds")] and mounts["stream"] == [("creds-launcher", "/creds")]
    assert sorted(n for n, m in mounts.items() if ("creds", "/creds") in m) == ["auth", "nats"], mounts
    assert {v for _, v in mounts["auth"]} == {"/creds", *(f"/creds-out/{w}" for w in ("router", "planner", "kvdirectory", "launcher", "workers"))}


def test_the_auth_job_gives_each_identity_folder_only_its_own_seed(tmp_path):
    creds, out = tmp_path / "creds", tmp_path / "out"
    creds.mkdir()
    for who in ("router", "planner", "kvdirectory", "launcher", "workers"):
        (out / who).mkdir(parents=True)
    (out / "router" / "admin.nk").write_text("stale")  # a seed left from another run goes
    (creds / "worker-w2.nk").write_text("stale")  # a WORKERS=3 run's, not regenerated for WORKERS=2: not copied
    env = dict(EI_CREDS_DIR=str(creds), EI_CREDS_OUT=str(out), EI_NATS_AUTH="nkeys", WORKERS="2")
    r = _run(tmp_path, "auth", **env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    held = {who: sorted(p.name for p in (out / who).iterdir()) for who in ("router", "planner", "kvdirectory", "launcher", "workers")}
    # the router alone also gets the stack's API key id salt (7eae5ec), nobody else
    assert held == {"router": ["api-key-id.salt", "clock_origin", "router.nk"], "planner": ["clock_origin", "planner.nk"],
                    "kvdirectory": ["clock_origin", "kvdirectory.nk"], "launcher": ["clock_origin", "launcher.nk"],
                    "workers": ["clock_origin", "worker-w0.nk", "worker-w1.nk"]}, held
    assert (out / "router" / "router.nk").read_bytes() == (creds / "router.nk").read_bytes()
    assert (out / "router" / "clock_origin").read_text() == (creds / "clock_origin").read_text()
    r = _run(tmp_path, "auth", **env)  # again (compose restarts it on a second `up`): the same, no error
    assert r.returncode == 0 and "already in" in r.stdout, (r.stdout, r.stderr)
    assert sorted(p.name for p in (out / "router").iterdir()) == ["api-key-id.salt", "clock_origin", "router.nk"]
    assert (out / "router" / "api-key-id.salt").read_bytes() == (creds / "api-key-id.salt").read_bytes()


def test_a_refused_policy_ends_the_auth_job_before_any_service_starts(tmp_path):
    """A bad ``EI_POLICY`` made every service exit 2 at start, and ``restart: on-failure`` restarted each
    without end (the stack neither up nor failed). The one-shot auth job (no restart policy; nats, stream and
    so every service wait for it to complete) now checks the system first: status 2, one line, nothing written."""
    creds = tmp_path / "creds"
    creds.mkdir()
    r = _run(tmp_path, "auth", EI_POLICY="nope", EI_CREDS_DIR=str(creds), EI_CREDS_OUT=str(tmp_path / "out"))
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "unknown policy set 'nope'" in r.stderr, r.stderr
    assert list(creds.iterdir()) == []
    r = _run(tmp_path, "auth", EI_POLICY="static", WORKERS="4", SPLIT="3P2D", EI_CREDS_DIR=str(creds), EI_CREDS_OUT=str(tmp_path / "out"))
    assert r.returncode == 2 and "3P2D" in r.stderr, (r.stdout, r.stderr)
    r = _run(tmp_path, "auth", EI_POLICY="static:2P2D", WORKERS="4", EI_CREDS_DIR=str(creds), EI_CREDS_OUT=str(tmp_path / "out"))
    assert r.returncode == 0 and "auth: policy static:2P2D" in r.stdout and "split 2P2D" in r.stdout, (r.stdout, r.stderr)


def test_an_ei_nats_auth_the_stack_does_not_know_ends_the_auth_job(tmp_path):
    """Every role tested ``EI_NATS_AUTH != off``: ``EI_NATS_AUTH=password`` (up's other mode) or a typo ran
    nkeys without a word. The auth job now refuses it, status 2, one line, nothing written."""
    creds = tmp_path / "creds"
    creds.mkdir()
    r = _run(tmp_path, "auth", EI_NATS_AUTH="password", EI_CREDS_DIR=str(creds), EI_CREDS_OUT=str(tmp_path / "out"))
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "EI_NATS_AUTH=password" in r.stderr, r.stderr
    assert list(creds.iterdir()) == []


@needs_compose
def test_the_auth_job_that_checks_the_system_is_one_shot_and_sees_the_model():
    services = resolved_services(_env(EI_ENGINE="torch", MODEL_DIR="/srv/m"))
    assert "restart:" not in services["auth"] and "/srv/m:/models:ro" in services["auth"], services["auth"]
    assert re.search(r"^      auth:\n        condition: service_completed_successfully", services["nats"], re.M), services["nats"]


def test_a_worker_profile_is_checked_against_the_cluster_s_as_up_resolves_it(tmp_path):
    """With ``EI_ENGINE=torch`` and the default ``EI_PROFILE``, up (and deploy-args: the router's and directory's
    flags) run ``torch-tiny-cpu`` (8-token blocks). The worker's ``--profile`` check compared with ``EI_PROFILE``
    (gb300-glm52, 64): a ``--profile gb300-glm52`` worker joined and every request failed 'block size mismatch',
    and a ``--profile torch-tiny-cpu`` one, the cluster's own, was refused."""
    pytest.importorskip("torch")
    model = tmp_path / "tiny-model"
    subprocess.run([sys.executable, "-m", "evolving_infra.cli", "model", "init", str(model)], check=True, capture_output=True,
                   timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    env = dict(EI_ENGINE="torch", EI_MODEL_DIR=str(model), EI_REPLICA="1")
    r = _run(tmp_path, "worker", "--profile", "gb300-glm52", **env)
    assert r.returncode == 2 and "started" not in r.stdout, (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "block size 64 but profile torch-tiny-cpu (EI_ENGINE=torch's" in line and "has 8" in line, line
    worker = _argv(tmp_path, "worker", "--profile", "torch-tiny-cpu", **env)
    assert _flag(worker, "--profile") == "torch-tiny-cpu"


@pytest.mark.parametrize("role", ["kvdirectory", "router"])
def test_a_torch_stack_s_block_size_is_its_profile_s_not_ei_profile_s(tmp_path, role):
    """``EI_ENGINE=torch`` runs ``torch-tiny-cpu`` (8-token blocks) as up does, and deploy-args gives the router
    and directory ``--block-size 8``; the entrypoint still took ``EI_BLOCK_SIZE`` from ``EI_PROFILE``
    (gb300-glm52, 64): it exported 64 beside the flag and refused ``EI_BLOCK_SIZE=8``, the stack's own size."""
    pytest.importorskip("torch")
    model = tmp_path / "tiny-model"
    subprocess.run([sys.executable, "-m", "evolving_infra.cli", "model", "init", str(model)], check=True, capture_output=True,
                   timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    env = dict(EI_ENGINE="torch", EI_MODEL_DIR=str(model))
    r = _run(tmp_path, role, EI_BLOCK_SIZE="8", **env)
    assert (r.returncode, r.stdout.strip()) == (0, f"started services.{role} EI_BLOCK_SIZE=8"), (r.stdout, r.stderr)
    r = _run(tmp_path, role, EI_BLOCK_SIZE="64", **env)
    assert r.returncode == 2 and "EI_BLOCK_SIZE=64 differs from the block size 8 of profile torch-tiny-cpu" in r.stderr, r.stderr


@needs_compose
def test_compose_tags_the_sim_and_torch_images_apart():
    """Both Dockerfile targets were built as ``evolving-infra:latest``: ``EI_TARGET=torch docker compose build``
    replaced the sim image and a plain ``docker compose build`` the torch one. Now the tag is the target (as
    vLLM's and SGLang's images carry their variant), for the service that builds it and every service that runs
    it; ``EI_IMAGE_REPO`` names the repository."""
    ei = ("auth", "nats", "stream", "kvdirectory", "planner", "router", "worker")

    def images(**env: str) -> tuple[set[str], str]:
        services = resolved_services(_env(**env))
        tags = {m.group(1) for name in ei if (m := re.search(r"^    image: (\S+)$", services[name], re.M))}
        assert len(tags) == 1, tags  # one image for every service
        return tags, re.search(r"^      target: (\S+)$", services["auth"], re.M).group(1)

    assert images() == ({"evolving-infra:sim"}, "sim")
    assert images(EI_TARGET="torch") == ({"evolving-infra:torch"}, "torch")
    assert images(EI_TARGET="torch", EI_IMAGE_REPO="registry.example/ei") == ({"registry.example/ei:torch"}, "torch")


def test_a_torch_stack_on_the_sim_image_says_to_start_it_with_ei_target_torch(tmp_path):
    """With one tag per target, ``EI_ENGINE=torch docker compose up`` without ``EI_TARGET=torch`` runs the sim
    image, which has no torch: the auth job ended with deploy-args's "pip install -e '.[torch]'", not the fix in
    a container. It now also names the image to start. ``torch`` is made unimportable here by a package that
    raises as a missing one does."""
    fake = tmp_path / "no-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    model = tmp_path / "model"
    model.mkdir()
    # a valid config.json: the --model check needs no torch and comes first (b7b0dc2), so an empty folder
    # would be refused as no model before torch is looked for
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    }))  # fmt: skip
    r = _run(tmp_path, "auth", EI_ENGINE="torch", EI_MODEL_DIR=str(model), EI_CREDS_DIR=str(tmp_path),
             PYTHONPATH=f"{fake.parent}{os.pathsep}{REPO}")
    assert r.returncode == 2 and "started" not in r.stdout, (r.stdout, r.stderr)
    assert "torch missing" in r.stderr and "EI_TARGET=torch (image evolving-infra:torch)" in r.stderr, r.stderr
