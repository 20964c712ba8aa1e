"""What a vLLM user serving a model with ``up --engine torch`` hit (session 38): ``/v1/models`` advertised the
model's context (2048) while torch-tiny-cpu's nodes hold 1024 tokens of KV, with no way to size the KV but
writing a profile; workers could not be placed on devices; the served name could not be set on ``up``; a
tokenizer larger than the model's vocabulary was accepted.

These tests build ``up``'s cluster spec and each child's argv (nothing starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evolving_infra.cli import UsageError, build_parser
from evolving_infra.cluster import LocalCluster
from evolving_infra.launcher import _spec, context_line
from services.worker.config import WorkerConfig, worker_profile
from shared.config import load_config
from shared.profile import ProfileError, load_profile, with_kv_tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """``evolving-infra model init``'s tiny model: context 2048, vocabulary 512."""
    pytest.importorskip("torch")
    from evolving_infra.cli import main

    folder = tmp_path_factory.mktemp("m") / "tiny"
    assert main(["model", "init", str(folder)]) in (0, None)
    return folder


def _children(argv: list[str], tmp_path: Path) -> dict[str, list[str]]:
    args = build_parser("up").parse_args(["up", *argv, "--log-dir", str(tmp_path)])
    return {c.name: c.argv for c in LocalCluster(_spec(args))._plan_children()}


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


# ----------------------------------------------------------------------------- KV size (issue 1)


def test_with_kv_tokens_resizes_and_checks():
    p = load_profile("torch-tiny-cpu")  # 8-token blocks, L1 1024, L2 4096
    assert with_kv_tokens(p) is p
    q = with_kv_tokens(p, 2048)
    assert (q.memory.gpu_kv_tokens, q.memory.host_kv_tokens, q.gpu_blocks) == (2048, 4096, 256)
    q = with_kv_tokens(p, 8192)  # L2 must hold L1: raised with it
    assert (q.memory.gpu_kv_tokens, q.memory.host_kv_tokens) == (8192, 8192)
    assert with_kv_tokens(p, 0, 16384).memory == type(p.memory)(gpu_kv_tokens=1024, host_kv_tokens=16384)
    assert with_kv_tokens(p, 1000).gpu_blocks == 125
    with pytest.raises(ProfileError, match=r"--gpu-kv-tokens 1001: .* \(e\.g\. 1008\)"):
        with_kv_tokens(p, 1001)
    with pytest.raises(ProfileError, match="--host-kv-tokens -8"):
        with_kv_tokens(p, 0, -8)
    with pytest.raises(ProfileError, match="--host-kv-tokens 2048 is less than --gpu-kv-tokens 4096"):
        with_kv_tokens(p, 4096, 2048)
    # a host size alone below the profile's GPU size names the profile's, not a --gpu-kv-tokens never given
    with pytest.raises(ProfileError, match=rf"--host-kv-tokens 512 is less than profile {p.name}'s memory.gpu_kv_tokens 1024: .*"
                                           r"or a smaller --gpu-kv-tokens with it"):
        with_kv_tokens(p, 0, 512)


def test_a_worker_applies_its_kv_flags_to_its_profile():
    cfg = load_config(WorkerConfig, ["--profile", "torch-tiny-cpu", "--gpu-kv-tokens", "2048", "--host-kv-tokens", "8192"])
    prof = worker_profile(cfg)
    assert (prof.gpu_blocks, prof.host_blocks) == (256, 1024)
    assert worker_profile(load_config(WorkerConfig, ["--profile", "torch-tiny-cpu"])).gpu_blocks == 128


def test_up_passes_the_kv_sizes_to_every_worker_and_says_when_the_context_is_lowered(model, tmp_path):
    kids = _children(["--engine", "torch", "--model", str(model), "--nodes", "2"], tmp_path / "a")
    assert all("--gpu-kv-tokens" not in argv for argv in kids.values())
    args = build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(model), "--log-dir", str(tmp_path)])
    line = context_line(_spec(args))
    assert line == ("model 'tiny': max_model_len 1024, LOWERED from the model's context 2048: a node's GPU KV memory holds "
                    "1024 tokens (profile torch-tiny-cpu's memory.gpu_kv_tokens); longer requests get 400; pass "
                    "--gpu-kv-tokens 2048 to serve the whole context")
    argv = ["--engine", "torch", "--model", str(model), "--nodes", "2", "--gpu-kv-tokens", "2048", "--host-kv-tokens", "8192"]
    kids = _children(argv, tmp_path / "b")
    for node in ("w0", "w1"):
        w = kids[f"worker-{node}"]
        assert (_value(w, "--gpu-kv-tokens"), _value(w, "--host-kv-tokens")) == ("2048", "8192")
        # the worker's own parser takes them: its argv after the module name
        cfg = load_config(WorkerConfig, w[w.index("services.worker") + 1 :])
        assert worker_profile(cfg).gpu_blocks == 256
    for name in ("router", "planner", "kvdirectory"):  # they learn node KV sizes from the nodes' states
        assert "--gpu-kv-tokens" not in kids[name]
    args = build_parser("up").parse_args(["up", *argv, "--log-dir", str(tmp_path)])
    assert context_line(_spec(args)) == "model 'tiny': max_model_len 2048 (the model's context; a node's GPU KV holds 2048 tokens)"


@pytest.mark.parametrize("flags, message", [
    (["--gpu-kv-tokens", "1001"], "error: --gpu-kv-tokens 1001: must be a positive multiple of the block size 8"),
    (["--gpu-kv-tokens", "-8"], "error: --gpu-kv-tokens -8"),
    (["--gpu-kv-tokens", "4096", "--host-kv-tokens", "2048"], "error: --host-kv-tokens 2048 is less than --gpu-kv-tokens 4096"),
])
def test_up_refuses_a_bad_kv_size_before_anything_starts(model, flags, message, tmp_path):
    args = build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(model), *flags, "--log-dir", str(tmp_path)])
    with pytest.raises(UsageError) as e:
        _spec(args)
    assert str(e.value).startswith(message) and e.value.code == 2


def test_sim_up_takes_the_kv_flags_too(tmp_path):
    kids = _children(["--profile", "tiny", "--gpu-kv-tokens", "512", "--nodes", "1"], tmp_path)
    assert _value(kids["worker-w0"], "--gpu-kv-tokens") == "512" and "--host-kv-tokens" not in kids["worker-w0"]


# ----------------------------------------------------------------------------- devices and threads (issue 2)


@pytest.mark.parametrize("nodes, device, cuda, cores, threads, env, want", [
    (4, "", 4, 64, 0, {}, [("cuda:0", 0), ("cuda:1", 0), ("cuda:2", 0), ("cuda:3", 0)]),  # was: all on cuda (device 0)
    (4, "", 2, 64, 0, {}, [("cuda:0", 0), ("cuda:1", 0), ("cuda:0", 0), ("cuda:1", 0)]),
    (3, "cuda", 8, 64, 0, {}, [("cuda:0", 0), ("cuda:1", 0), ("cuda:2", 0)]),
    (2, "cuda:1", 2, 64, 0, {}, [("cuda:1", 0), ("cuda:1", 0)]),
    (4, "", 0, 16, 0, {}, [("cpu", 4)] * 4),  # was: each worker's torch on all 16 cores
    (4, "", 0, 2, 0, {}, [("cpu", 1)] * 4),
    (3, "cpu", 4, 8, 0, {}, [("cpu", 2)] * 3),
    (2, "", 0, 16, 0, {"OMP_NUM_THREADS": "3"}, [("cpu", 0)] * 2),  # the user's setting, inherited
    (2, "", 0, 16, 0, {"EI_TORCH_THREADS": "5"}, [("cpu", 0)] * 2),
    (2, "", 0, 16, 6, {"OMP_NUM_THREADS": "3"}, [("cpu", 6)] * 2),  # the flag wins
    (2, "cuda", 1, 16, 2, {}, [("cuda:0", 2)] * 2),
])
def test_worker_placement(nodes, device, cuda, cores, threads, env, want):
    from evolving_infra.cluster import worker_placement

    assert worker_placement(nodes, device, cuda_count=cuda, cores=cores, torch_threads=threads, env=env) == want


@pytest.mark.parametrize("device, cuda, message", [
    ("gpu", 1, "--device 'gpu': cpu, cuda or cuda:N"),
    ("cuda:", 1, "cpu, cuda or cuda:N"),
    ("cpu:0", 1, "cpu, cuda or cuda:N"),
    ("cuda:x", 1, "cpu, cuda or cuda:N"),
    ("cuda", 0, "--device cuda: no CUDA device is visible"),
    ("cuda:2", 2, r"--device cuda:2: 2 CUDA device\(s\) visible \(cuda:0 to cuda:1\)"),
])
def test_worker_placement_refuses(device, cuda, message):
    from evolving_infra.cluster import worker_placement

    with pytest.raises(ValueError, match=message):
        worker_placement(2, device, cuda_count=cuda, cores=4, env={})


def _torch_children(monkeypatch, tmp_path, model, argv, *, cuda, cores):
    import evolving_infra.launcher as launcher

    monkeypatch.setattr(launcher, "cuda_device_count", lambda: cuda)
    monkeypatch.setattr(launcher, "cpu_cores", lambda: cores)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "EI_TORCH_THREADS"):
        monkeypatch.delenv(k, raising=False)
    return _children(["--engine", "torch", "--model", str(model), *argv], tmp_path)


def test_up_places_each_torch_worker_on_its_own_gpu(monkeypatch, model, tmp_path):
    kids = _torch_children(monkeypatch, tmp_path, model, ["--nodes", "4", "--dtype", "bfloat16"], cuda=4, cores=32)
    for i in range(4):
        w = kids[f"worker-w{i}"]
        assert (_value(w, "--device"), _value(w, "--dtype"), _value(w, "--torch-threads")) == (f"cuda:{i}", "bfloat16", None)
        cfg = load_config(WorkerConfig, w[w.index("services.worker") + 1 :])  # the worker's own parser takes them
        assert (cfg.device, cfg.dtype, cfg.torch_threads) == (f"cuda:{i}", "bfloat16", 0)
    for name in ("router", "planner", "kvdirectory"):
        assert "--device" not in kids[name] and "--dtype" not in kids[name]


def test_up_shares_the_cores_between_cpu_workers(monkeypatch, model, tmp_path):
    from evolving_infra.launcher import placement_line

    kids = _torch_children(monkeypatch, tmp_path / "a", model, ["--nodes", "2"], cuda=0, cores=8)
    for i in range(2):
        w = kids[f"worker-w{i}"]
        assert (_value(w, "--device"), _value(w, "--torch-threads")) == ("cpu", "4")
        assert load_config(WorkerConfig, w[w.index("services.worker") + 1 :]).torch_threads == 4
    kids = _torch_children(monkeypatch, tmp_path / "b", model, ["--nodes", "2", "--torch-threads", "1"], cuda=0, cores=8)
    assert _value(kids["worker-w1"], "--torch-threads") == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own setting: inherited, no flag
    args = build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(model), "--nodes", "2", "--log-dir", str(tmp_path / "c")])
    spec = _spec(args)
    assert all("--torch-threads" not in c.argv for c in LocalCluster(spec)._plan_children())
    assert placement_line(spec) == "workers on w0 cpu, w1 cpu; torch threads from OMP_NUM_THREADS"
    monkeypatch.delenv("OMP_NUM_THREADS")
    args = build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(model), "--nodes", "2", "--log-dir", str(tmp_path / "d")])
    assert placement_line(_spec(args)) == "workers on w0 cpu (4 torch threads), w1 cpu (4 torch threads)"


@pytest.mark.parametrize("flags", [["--device", "cpu"], ["--dtype", "float16"], ["--torch-threads", "2"]])
def test_torch_placement_flags_need_the_torch_engine(flags, tmp_path):
    args = build_parser("up").parse_args(["up", *flags, "--log-dir", str(tmp_path)])
    with pytest.raises(UsageError, match=f"error: {flags[0]} needs --engine torch"):
        _spec(args)


def test_up_with_a_bad_device_is_a_usage_error(monkeypatch, model, tmp_path):
    with pytest.raises(UsageError, match="error: --device cuda:3: 2 CUDA device"):
        _torch_children(monkeypatch, tmp_path, model, ["--device", "cuda:3"], cuda=2, cores=8)


def test_sim_up_does_not_import_torch(tmp_path):
    """``up`` without the torch extra must still work: placement imports torch only for ``--engine torch``."""
    import subprocess
    import sys

    code = ("import sys; from evolving_infra.cli import build_parser; from evolving_infra.launcher import _spec; "
            f"a = build_parser('up').parse_args(['up', '--nodes', '2', '--log-dir', {str(tmp_path)!r}]); _spec(a); "
            "from evolving_infra.cluster import LocalCluster; LocalCluster(_spec(a))._plan_children(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 0, r.stderr


def test_a_model_folder_without_tokenizer_names_the_model_not_a_tokenizer_flag(tmp_path):
    """``up --engine torch --model DIR`` (no ``--tokenizer``) on a folder without tokenizer.json said
    ``error: --tokenizer hf:DIR: no tokenizer.json`` although no --tokenizer was passed: it names --model now,
    and a --tokenizer the user did give is still named as before."""
    pytest.importorskip("torch")
    import json

    from services.worker.engines.torch_engine.checkpoint import model_config

    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model_config("llama", 2, 64, 4, 2, 512, 2048, 2)))
    with pytest.raises(UsageError) as ei:
        _spec(build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(folder), "--log-dir", str(tmp_path)]))
    msg = str(ei.value)
    assert msg.startswith(f"error: --model {folder}: no tokenizer.json") and "--tokenizer hf:FOLDER" in msg, msg
    other = tmp_path / "other"
    with pytest.raises(UsageError, match=f"^error: --tokenizer hf:{other}: no tokenizer.json"):
        _spec(build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(folder), "--tokenizer", f"hf:{other}",
                                             "--log-dir", str(tmp_path)]))  # fmt: skip


# ----------------------------------------------------------------------------- served model name (issue 3)


def _router(kids):
    r = kids["router"]
    return _value(r, "--model"), _value(r, "--model-aliases")


def _served(kids):
    r = kids["router"]
    return _value(r, "--model"), _value(r, "--model-names"), _value(r, "--model-aliases")


def test_up_serves_the_folder_name_and_accepts_the_path_given(model, tmp_path, monkeypatch):
    monkeypatch.chdir(model.parent)
    kids = _children(["--engine", "torch", "--model", "tiny/", "--nodes", "1"], tmp_path / "a")
    assert _router(kids) == ("tiny", f"tiny/,{model}")  # as typed and resolved ("tiny" is the name itself)
    kids = _children(["--engine", "torch", "--model", str(model), "--nodes", "1"], tmp_path / "b")
    assert _router(kids) == ("tiny", str(model))


def test_served_model_name_on_up(model, tmp_path):
    kids = _children(["--engine", "torch", "--model", str(model), "--nodes", "1", "--served-model-name", "my-llm"], tmp_path / "a")
    assert _served(kids) == ("my-llm", None, None)  # vLLM: with a served name, the path is not a name
    kids = _children(["--engine", "torch", "--model", str(model), "--nodes", "1", "--served-model-name", "a", "b", "a"], tmp_path / "b")
    assert _served(kids) == ("a", "b", None)  # all listed in /v1/models, as vLLM's (before: b an unlisted alias)
    kids = _children(["--nodes", "1", "--served-model-name", "glm", "glm-2"], tmp_path / "c")  # sim too
    assert _served(kids) == ("glm", "glm-2", None)
    args = build_parser("demo").parse_args(["demo", "--served-model-name", "x", "--log-dir", str(tmp_path / "d")])
    assert _spec(args).model == "x"
    for bad in ("a,b", "", " a"):
        args = build_parser("up").parse_args(["up", "--served-model-name", bad, "--log-dir", str(tmp_path)])
        with pytest.raises(UsageError, match="--served-model-name"):
            _spec(args)


# ----------------------------------------------------------------------------- vocabularies (issue 4)


def test_up_refuses_a_tokenizer_larger_than_the_models_vocabulary(model, tmp_path):
    """``--tokenizer hf:OTHER`` with more tokens than the model was accepted; its ids past the model's vocabulary
    then failed in the engine (a 500: "token id 637 outside the model's vocabulary (512)")."""
    from evolving_infra.cli import main

    other = tmp_path / "other"
    assert main(["model", "init", str(other), "--vocab", "700"]) in (0, None)
    args = build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(model), "--tokenizer", f"hf:{other}",
                                          "--log-dir", str(tmp_path / "a")])  # fmt: skip
    with pytest.raises(UsageError) as e:
        _spec(args)
    assert e.value.code == 2
    assert str(e.value).startswith(f"error: --tokenizer hf:{other}: its vocabulary has 700 tokens but the model {model} "
                                   "has 512 (config.json vocab_size)"), str(e.value)
    # the model's own (512) and a smaller one are served; the router gets the model's size
    kids = _children(["--engine", "torch", "--model", str(model), "--nodes", "1"], tmp_path / "b")
    assert _value(kids["router"], "--model-vocab-size") == "512"
    assert "--model-vocab-size" not in _children(["--nodes", "1"], tmp_path / "c")["router"]


def test_tokenizer_sim_typed_with_the_torch_engine_is_refused_not_replaced(model, tmp_path):
    """``--tokenizer``'s help said ``(default sim)``, untrue for ``--engine torch`` (the model's own), and a typed
    ``--tokenizer sim`` was silently replaced by the model's: the flag's default is now "not given", a typed sim is
    a usage error, and the help says the torch default (session 42)."""
    args = build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(model), "--tokenizer", "sim",
                                          "--log-dir", str(tmp_path / "a")])  # fmt: skip
    with pytest.raises(UsageError, match=r"^error: --tokenizer sim: .* leave --tokenizer out"):
        _spec(args)
    spec = _spec(build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(model), "--log-dir", str(tmp_path / "b")]))
    assert spec.tokenizer == f"hf:{model}"
    assert _spec(build_parser("up").parse_args(["up", "--log-dir", str(tmp_path / "c")])).tokenizer == "sim"
    for command in ("up", "demo"):
        sub = build_parser(command)._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        assert "(defaultsim;--enginetorch:the--modelfolder'sown,hf:MODEL_DIR" in "".join(sub.format_help().split())


def test_model_init_help_names_every_file_it_writes(model):
    """``model init --help`` listed four files; the folder has generation_config.json too (session 42)."""
    sub = build_parser("model")._subparsers._group_actions[0].choices["model"]  # type: ignore[union-attr]
    init = sub._subparsers._group_actions[0].choices["init"]  # type: ignore[union-attr]
    text = " ".join(init.format_help().split())
    assert sorted(f.name for f in model.iterdir()), model
    for f in model.iterdir():
        assert f.name in text, (f.name, text)


def test_up_says_when_the_model_folder_has_no_chat_template(model, tmp_path):
    """A model folder without tokenizer_config.json served chat requests in ChatML; only the router's log said so
    ("no chat_template next to ...") while vLLM refuses such requests (session 42). up's banner says it now."""
    import shutil

    from evolving_infra.launcher import tokenizer_lines

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(model / name, bare / name)
    args = build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(bare), "--log-dir", str(tmp_path / "a")])
    _spec(args)
    (line,) = tokenizer_lines(args)
    assert line.startswith(f"note: tokenizer hf:{bare}: no chat_template next to {bare}/tokenizer.json; chat requests use "
                           "ChatML (vLLM refuses"), line
    args = build_parser("up").parse_args(["up", "--engine", "torch", "--model", str(model), "--log-dir", str(tmp_path / "b")])
    _spec(args)
    assert tokenizer_lines(args) == []


def test_served_model_name_help_says_every_name_is_listed_and_echoed():
    """The help said the first name was /v1/models' only id ("unlike vLLM", which lists every name); the router now
    lists every name, and every response names the first, as vLLM's --served-model-name help says (session 42)."""
    sub = build_parser("up")._subparsers._group_actions[0].choices["up"]  # type: ignore[union-attr]
    (action,) = [a for a in sub._actions if "--served-model-name" in a.option_strings]
    text = " ".join(action.help.split())
    assert "unlike vLLM" not in text and "/v1/models lists every one" in text and "every response's model is the first" in text, text
