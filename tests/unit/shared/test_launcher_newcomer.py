"""What a newcomer following the README hit with ``up`` and ``demo`` (session 36): ``up --nodes 2`` refused
for a 2P2D default it never typed, no ``--api-keys-file``, help and ready line silent about the profile,
no ``evolving-infra --version``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from evolving_infra.cli import UsageError, build_parser, main
from evolving_infra.cluster import LocalCluster
from evolving_infra.launcher import _demo_interrupted, _spec, api_keys_line, default_split_for, demo_client_key
from evolving_infra.sim.policies import default_split
from services.router.ingress import load_api_keys
from shared import package_version


@pytest.mark.parametrize("command", ["up", "demo"])
@pytest.mark.parametrize("nodes, split", [(1, "collocated"), (2, "1P1D"), (3, "2P1D"), (4, "2P2D"), (6, "4P2D"), (9, "6P3D")])
def test_the_default_split_follows_nodes(command, nodes, split, tmp_path):
    """2P2D on the default 4 nodes (simulate's rule would give 3P1D: kept as it was), simulate's round(2N/3)
    prefill nodes for any other --nodes; ``up --nodes 2`` was refused ("split '2P2D' covers 4 nodes")."""
    args = build_parser(command).parse_args([command, "--nodes", str(nodes), "--log-dir", str(tmp_path)])
    assert _spec(args).split == split
    if nodes != 4:
        assert split == default_split(nodes)  # the simulator's function, not a copy


def test_a_policy_or_flag_split_still_wins(tmp_path):
    args = build_parser("up").parse_args(["up", "--nodes", "2", "--policy", "static", "--split",
                                          "collocated", "--log-dir", str(tmp_path)])  # fmt: skip
    assert _spec(args).split == "collocated"
    args = build_parser("up").parse_args(["up", "--nodes", "3", "--policy", "static:1P2D", "--log-dir", str(tmp_path)])
    assert _spec(args).split == "1P2D"
    assert default_split_for(4, default_nodes=4, default_split="2P2D") == "2P2D"


@pytest.mark.parametrize("command", ["up", "demo"])
def test_help_names_the_default_profile(command):
    sub = build_parser(command)._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    text = "".join(sub.format_help().split())  # argparse wraps at hyphens too
    assert "(defaultgb300-glm52:simulatedGB300nodesservingGLM-5.2;--enginetorch:torch-tiny-cpu)" in text
    assert "--api-keys-fileFILE" in text


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"evolving-infra {package_version()}\n"
    assert package_version() != "unknown"  # the test venv installs the package


def test_version_into_a_closed_pipe_exits_0_quietly():
    # as argparse's own version action did: the reader gone before the line is written is no error
    # (the lazy --version of 5d2bce6 printed with print() and ended in a BrokenPipeError traceback, status 1)
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "evolving_infra.cli", "--version"], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=60)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (0, "")


@pytest.mark.parametrize("command", ["up", "demo"])
def test_api_keys_file_goes_to_the_router(command, tmp_path, monkeypatch):
    monkeypatch.delenv("EI_API_KEYS", raising=False)
    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# ops\nk-one\nk-two\n")
    args = build_parser(command).parse_args([command, "--api-keys-file", str(keys), "--log-dir", str(tmp_path)])
    router = {c.name: c for c in LocalCluster(_spec(args))._plan_children()}["router"]
    # the keys up read go in the router's environment, which it reads at each start: a restart after the file was
    # deleted serves them (it got the path for a while, and a restart without the file exited 1 until up gave up);
    # the path goes in a variable only its SIGHUP reload reads (up's SIGUSR1); never a key on a command line
    assert router.env == {"EI_API_KEYS": "k-one,k-two", "EI_API_KEYS_FILE": "", "EI_API_KEYS_RELOAD_FILE": str(keys),
                          "EI_API_KEYS_RELOAD_KEYS": "", "EI_API_KEY_ID_SALT": args.key_id_salt}  # fmt: skip
    assert len(args.key_id_salt) == 32  # the cluster's secret for the key ids in its routers' logs
    assert "k-one" not in " ".join(router.argv)
    assert api_keys_line(args) is not None and api_keys_line(args).startswith(f"API keys ON (2 from --api-keys-file {keys})")
    assert f"to rotate, edit {keys} and send up SIGUSR1" in api_keys_line(args)
    assert "--api-keys-file" not in " ".join(args.live_policy.describe().split())  # not a routing option


def test_api_keys_line_says_open_is_open_and_names_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    monkeypatch.delenv("EI_API_KEYS", raising=False)
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path)])
    _spec(args)
    assert api_keys_line(args) is None
    monkeypatch.setenv("EI_API_KEYS", "a,b,c")
    _spec(args)
    assert api_keys_line(args).startswith("API keys ON (3 from EI_API_KEYS)")


@pytest.mark.parametrize("content", [None, "# only a comment\n"])
def test_an_unusable_api_keys_file_is_a_usage_error_before_anything_starts(content, tmp_path):
    keys = tmp_path / "keys"
    if content is not None:
        keys.write_text(content)
    args = build_parser("up").parse_args(["up", "--api-keys-file", str(keys), "--log-dir", str(tmp_path / "logs")])
    with pytest.raises(UsageError, match="^error: --api-keys-file: " + ("cannot read API keys" if content is None else ".* holds no API key")):
        _spec(args)


def test_the_router_gets_the_keys_read_at_start_in_its_environment_not_a_path_to_read_again(tmp_path, monkeypatch):
    """``--api-keys-file <(pass show key)`` (a pipe, read once) gave the router '/proc/PID/fd/pipe:[N]' (it died at start)
    and the demo 'holds no API key' (a second read); a key file deleted after start failed every router restart."""
    monkeypatch.delenv("EI_API_KEYS", raising=False)
    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    r, w = os.pipe()
    os.write(w, b"k-pipe\n")
    os.close(w)
    try:
        args = build_parser("demo").parse_args(["demo", "--api-keys-file", f"/dev/fd/{r}", "--log-dir", str(tmp_path)])
        router = {c.name: c for c in LocalCluster(_spec(args))._plan_children()}["router"]
    finally:
        os.close(r)
    assert "--api-keys-file" not in router.argv and "k-pipe" not in " ".join(router.argv)  # not in `ps`
    assert router.env == {"EI_API_KEYS": "k-pipe", "EI_API_KEYS_FILE": "", "EI_API_KEYS_RELOAD_FILE": "",
                          "EI_API_KEYS_RELOAD_KEYS": "", "EI_API_KEY_ID_SALT": args.key_id_salt}  # fmt: skip
    assert demo_client_key(args) == "k-pipe"  # the keys read once, not the file again
    monkeypatch.setenv("EI_API_KEY", "mine")
    assert demo_client_key(args) == "mine"


def test_a_key_with_a_comma_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("EI_API_KEYS", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("a,b\n")
    args = build_parser("up").parse_args(["up", "--api-keys-file", str(keys), "--log-dir", str(tmp_path / "logs")])
    with pytest.raises(UsageError, match="^error: --api-keys-file: .* comma"):
        _spec(args)


def test_a_keys_file_with_a_bom_and_crlf_lines_gives_the_keys_as_typed(tmp_path):
    """Notepad's UTF-8 starts with a BOM: the first key was '\\ufeffk-bom', which no client sends (401)."""
    keys = tmp_path / "keys"
    keys.write_bytes("\ufeffk-bom\r\n\r\n# ops\r\nk two\r\n".encode())
    assert load_api_keys(str(keys)) == {"k-bom", "k two"}


def test_a_keys_file_that_is_not_utf8_is_a_clear_error_at_start_and_on_sigusr1(tmp_path, monkeypatch):
    """A keys file that is not UTF-8 (``printf 'k1\\n\\xff\\xfe bad\\n'``) raised UnicodeDecodeError out of
    ``load_api_keys``: a traceback at ``up --api-keys-file`` start and on SIGUSR1 (asyncio "Exception in callback")
    (reviewer rr-sec2). Now an ApiKeyError naming the file: a usage error at start, an "NOT reloaded" line on SIGUSR1."""
    from evolving_infra.launcher import reload_router_keys
    from services.router.ingress import ApiKeyError

    monkeypatch.delenv("EI_API_KEYS", raising=False)
    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    bad = tmp_path / "badkeys"
    bad.write_bytes(b"k1\n\xff\xfe bad\n")
    with pytest.raises(ApiKeyError, match=f"^{bad} is not UTF-8 text"):
        load_api_keys(str(bad))
    args = build_parser("up").parse_args(["up", "--api-keys-file", str(bad), "--log-dir", str(tmp_path / "logs")])
    with pytest.raises(UsageError, match=f"^error: --api-keys-file: {bad} is not UTF-8 text"):
        _spec(args)
    good = tmp_path / "keys"
    good.write_text("k1\n")
    args = build_parser("up").parse_args(["up", "--api-keys-file", str(good), "--log-dir", str(tmp_path / "logs")])
    cluster = LocalCluster(_spec(args))
    good.write_bytes(b"k1\n\xff\xfe bad\n")
    assert reload_router_keys(args, cluster) == (
        f"SIGUSR1: API keys NOT reloaded, the routers keep theirs: {good} is not UTF-8 text (byte 0xff at offset 3)")
    assert args.router_api_keys == {"k1"}


@pytest.mark.parametrize("command", ["up", "demo"])
@pytest.mark.parametrize("nodes", ["0", "-2"])
def test_no_worker_node_is_a_usage_error(command, nodes, tmp_path):
    """With 2P2D the default, --nodes 0 was refused ('covers 4 nodes'); simulate's default for it is 'collocated',
    which every check passed: NATS and every service started and the planner died ('a planner needs at least one node')."""
    args = build_parser(command).parse_args([command, "--nodes", nodes, "--log-dir", str(tmp_path)])
    with pytest.raises(UsageError, match=f"^error: --nodes {nodes}: a cluster needs at least one worker node"):
        _spec(args)


@pytest.mark.parametrize("host, warned", [("0.0.0.0", True), ("::", True), ("10.1.2.3", True), ("node17", True),
                                          ("127.0.0.1", False), ("127.0.1.1", False), ("::1", False), ("localhost", False)])
def test_an_open_router_on_another_interface_is_said_in_the_banner(host, warned, tmp_path, monkeypatch):
    """``up --host 0.0.0.0`` without keys served every interface and the banner said nothing of it (measured: the
    ready lines name NATS's auth but not the API's); now one line says the API is open there and how to close it."""
    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    monkeypatch.delenv("EI_API_KEYS", raising=False)
    args = build_parser("up").parse_args(["up", "--host", host, "--port", "18000", "--log-dir", str(tmp_path)])
    _spec(args)
    line = api_keys_line(args)
    if not warned:
        assert line is None
        return
    assert line == (f"API keys OFF and the router listens on {host}:18000: anyone who reaches that port may send requests; "
                    "--api-keys-file FILE (or EI_API_KEYS=k1,k2) makes every request need a key")
    monkeypatch.setenv("EI_API_KEYS", "a")
    _spec(args)
    assert api_keys_line(args).startswith("API keys ON (1 from EI_API_KEYS)")


def test_api_keys_line_names_the_public_paths_in_effect_and_how_up_sets_them(tmp_path, monkeypatch):
    """The banner said "... /metrics unless --api-key-public-paths": a router flag, which `up` refuses
    (unrecognized arguments). `up` passes EI_API_KEY_PUBLIC_PATHS of its environment to the router (measured:
    with /health,/healthz set, /metrics and /ping answered 401, /health 200); the line now names that variable,
    and the paths it set."""
    from evolving_infra.cluster import child_env

    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    monkeypatch.setenv("EI_API_KEYS", "k")
    monkeypatch.delenv("EI_API_KEY_PUBLIC_PATHS", raising=False)
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path)])
    _spec(args)
    line = api_keys_line(args)
    assert line is not None and "--api-key-public-paths" not in line
    assert "(/livez, /healthz, /health, /ping, /metrics; EI_API_KEY_PUBLIC_PATHS=P1,P2 sets others)" in line
    with pytest.raises(SystemExit):  # what the old line told the user to pass
        build_parser("up").parse_args(["up", "--api-key-public-paths", "/health"])
    monkeypatch.setenv("EI_API_KEY_PUBLIC_PATHS", "/health, /healthz")
    assert "(/health, /healthz from EI_API_KEY_PUBLIC_PATHS)" in str(api_keys_line(args))
    assert child_env(None)["EI_API_KEY_PUBLIC_PATHS"] == "/health, /healthz"  # the router inherits it


def test_an_interrupted_demo_names_the_logs_it_keeps(tmp_path, capsys):
    """A demo stopped by Ctrl-C left ``demo-out/`` holding only ``logs/``, and its last line did not say so."""
    assert _demo_interrupted([signal.SIGINT], tmp_path / "demo-out" / "logs") == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "demo: SIGINT: stopped the cluster (its state file and NATS store removed); no report written; "
        f"logs in {tmp_path / 'demo-out' / 'logs'}"
    )


def test_up_sigusr1_checks_the_keys_file_then_sends_sighup_to_each_router(tmp_path, monkeypatch):
    """Keys could not be rotated under ``up`` without stopping the cluster. ``up``'s SIGUSR1 reads the file (a file
    without a key: nothing sent, the routers keep theirs) and sends each running router SIGHUP, its key reload."""
    import signal
    import subprocess
    import sys

    from evolving_infra.cluster import _Child
    from evolving_infra.launcher import reload_router_keys

    monkeypatch.delenv("EI_API_KEYS", raising=False)
    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("k-one\n")
    args = build_parser("up").parse_args(["up", "--routers", "2", "--api-keys-file", str(keys), "--log-dir", str(tmp_path)])
    cluster = LocalCluster(_spec(args))
    sleepers = {name: _Child(name, [], tmp_path / f"{name}.log") for name in ("router", "router-1", "planner")}
    for child in sleepers.values():
        child.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cluster.children = list(sleepers.values())
    try:
        keys.write_text("# emptied by mistake\n")
        line = reload_router_keys(args, cluster)
        assert line.startswith("SIGUSR1: API keys NOT reloaded, the routers keep theirs:") and "holds no API key" in line
        assert all(c.proc.poll() is None for c in sleepers.values())  # type: ignore[union-attr]
        assert all(c.env is None for c in sleepers.values())  # nothing kept from a refused file
        keys.write_text("k-two\nk-three\n")
        line = reload_router_keys(args, cluster)
        # up's own read is no proof the routers took the keys: the line says what each router does and where it shows
        assert line == (f"SIGUSR1: {keys} holds 2 keys; SIGHUP sent to 2 routers (router, router-1); each logs 'API keys "
                        "reloaded' and counts ei_router_api_key_reloads_total{result}; a router restarted from now on "
                        "starts with these keys")  # fmt: skip
        for name in ("router", "router-1"):
            assert sleepers[name].proc.wait(10) == -signal.SIGHUP  # type: ignore[union-attr]
            assert sleepers[name].env == {"EI_API_KEYS": "k-three,k-two", "EI_API_KEYS_FILE": "",
                                          "EI_API_KEYS_RELOAD_FILE": str(keys), "EI_API_KEYS_RELOAD_KEYS": "",
                                          "EI_API_KEY_ID_SALT": args.key_id_salt}  # fmt: skip
        assert sleepers["planner"].proc.poll() is None and sleepers["planner"].env is None  # type: ignore[union-attr]
        keys.write_text("k,comma\n")  # a restarted router could not take it in EI_API_KEYS
        assert "hold a comma" in reload_router_keys(args, cluster)
        assert sleepers["router"].env["EI_API_KEYS"] == "k-three,k-two"  # type: ignore[index]
    finally:
        for child in sleepers.values():
            child.proc.kill()  # type: ignore[union-attr]
            child.proc.wait()  # type: ignore[union-attr]
    r, w = os.pipe()  # keys from a pipe were read once: nothing to read again
    os.write(w, b"k-pipe\n")
    os.close(w)
    try:
        piped = build_parser("up").parse_args(["up", "--api-keys-file", f"/dev/fd/{r}", "--log-dir", str(tmp_path)])
        _spec(piped)
    finally:
        os.close(r)
    assert reload_router_keys(piped, cluster).startswith("SIGUSR1: no API keys file to reload: its keys were read once")


def test_a_symlinked_keys_file_is_reloaded_through_its_link(tmp_path, monkeypatch):
    """The reload path was the file's target, resolved at start: a secret whose link is swapped (a Kubernetes Secret
    volume's ``..data`` -> a new folder, the old one removed) pinned every reload to the old target. The path keeps
    its links, made absolute, so a reload reads the new target (reviewer rr-sec, /tmp/rr-sec/symlink.py)."""
    from evolving_infra.launcher import reloadable_keys_file

    monkeypatch.delenv("EI_API_KEYS", raising=False)
    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    secret = tmp_path / "secret"
    (secret / "..v1").mkdir(parents=True)
    (secret / "..v1" / "keys").write_text("k-old\n")
    (secret / "..data").symlink_to("..v1")
    (secret / "keys").symlink_to("..data/keys")
    monkeypatch.chdir(tmp_path)
    args = build_parser("up").parse_args(["up", "--api-keys-file", "secret/keys", "--log-dir", str(tmp_path)])
    spec = _spec(args)
    assert reloadable_keys_file(args) == str(secret / "keys") == dict(spec.router_env)["EI_API_KEYS_RELOAD_FILE"]
    (secret / "..v2").mkdir()
    (secret / "..v2" / "keys").write_text("k-new\n")
    (secret / "..tmp").symlink_to("..v2")
    os.replace(secret / "..tmp", secret / "..data")
    (secret / "..v1" / "keys").unlink()
    assert load_api_keys(dict(spec.router_env)["EI_API_KEYS_RELOAD_FILE"], "") == {"k-new"}


_SIGUSR1_IN_START = """
import asyncio, os, signal, sys
import evolving_infra.launcher as launcher
async def _up(args):  # a SIGUSR1 before _up's handler (its checks, a tokenizer's load), then after the loop
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.sleep(0.2)
    return 7
launcher._up = _up
status = launcher.cmd_up(None)
os.kill(os.getpid(), signal.SIGUSR1)
print(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)
sys.exit(status)
"""


def test_up_lives_through_a_sigusr1_before_its_handler_and_after_its_loop():
    """``up`` died of a SIGUSR1 (a key reload) that came before ``_up`` set its handler, and of one after its loop had
    closed (the default action, status -SIGUSR1): it ignores the signal outside the handler's life."""
    p = subprocess.run([sys.executable, "-c", _SIGUSR1_IN_START], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_DFL))  # fmt: skip
    assert (p.returncode, p.stdout) == (7, "True\n"), p.stderr[-2000:]


def test_up_sigusr1_with_stdout_a_closed_pipe_reloads_and_does_not_raise(tmp_path, monkeypatch):
    """``up``'s SIGUSR1 handler printed its line with no guard: with stdout a pipe whose reader went, the print raised
    BrokenPipeError inside the handler (asyncio's "Exception in callback"). Now the line is dropped; the reload is
    done all the same (the router got its SIGHUP), and before the cluster is ready nothing is sent."""
    import os
    import signal
    import subprocess
    import sys

    from evolving_infra.cluster import _Child
    from evolving_infra.launcher import answer_sigusr1

    monkeypatch.delenv("EI_API_KEYS", raising=False)
    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("k-one\n")
    args = build_parser("up").parse_args(["up", "--api-keys-file", str(keys), "--log-dir", str(tmp_path)])
    cluster = LocalCluster(_spec(args))
    router = _Child("router", [], tmp_path / "router.log")
    router.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cluster.children = [router]
    r, w = os.pipe()
    os.close(r)
    out = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stdout", out)
    try:
        answer_sigusr1(args, cluster, ready=False)
        assert router.proc.poll() is None
        answer_sigusr1(args, cluster, ready=True)
        assert router.proc.wait(10) == -signal.SIGHUP
    finally:
        if router.proc.poll() is None:
            router.proc.kill()
            router.proc.wait()
        monkeypatch.undo()
        try:
            out.close()
        except BrokenPipeError:  # what the dropped lines left in its buffer
            pass
