"""``up --nats-url nats://user:<password>@host`` (an external NATS with password auth): before, every service
process got ``--nats-url <the URL>`` on its command line, so the password was in every local user's ``ps``
(``/proc/<pid>/cmdline`` is world-readable). Now the URL goes in each child's environment (``EI_NATS_URL``,
which the services read; ``/proc/<pid>/environ`` only the owner reads), restarts included."""

from __future__ import annotations

import os

from evolving_infra.cluster import ClusterSpec, LocalCluster, child_env

SECRET = "pw-3d9b0c71e2"
URL = f"nats://ei:{SECRET}@127.0.0.1:4222"


def _wired(tmp_path, **spec: object) -> LocalCluster:
    c = LocalCluster(ClusterSpec(nodes=2, split="1P1D", nats_url=URL, log_dir=str(tmp_path), **spec))  # type: ignore[arg-type]
    c.log_dir = tmp_path
    c.nats_url = URL
    c.children = c._plan_children()
    c._wire_children()
    return c


def test_no_child_has_the_nats_url_on_its_command_line_and_each_gets_it_in_its_environment(tmp_path):
    c = _wired(tmp_path, router_env=(("EI_API_KEYS", "k-one"),))
    assert sorted(k.name for k in c.children) == ["kvdirectory", "planner", "router", "worker-w0", "worker-w1"]
    for kid in c.children:
        assert not [a for a in kid.argv if SECRET in a or a == "--nats-url"], (kid.name, kid.argv)
        # over a launcher's own EI_NATS_URL (another server): the cluster's wins, as --nats-url did
        assert child_env(kid.env, base={"EI_NATS_URL": "nats://elsewhere:4222"})["EI_NATS_URL"] == URL, kid.name
    router = {k.name: k for k in c.children}["router"]
    assert router.env == {"EI_API_KEYS": "k-one", "EI_NATS_URL": URL}  # its own variables kept


def test_a_credentials_folder_still_gives_each_child_its_nats_creds(tmp_path):
    """A per-instance credentials folder (``--nats-creds-dir``) still gives each child its ``--nats-creds``."""
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "planner.pass").write_text("planner:x\n")
    c = _wired(tmp_path, nats_creds_dir=str(creds))
    kids = {k.name: k for k in c.children}
    assert kids["planner"].argv[-2:] == ["--nats-creds", str(creds / "planner.pass")]
    assert "--nats-creds" not in kids["kvdirectory"].argv
    assert kids["planner"].env == {"EI_NATS_URL": URL}


def test_split_and_tap_take_the_nats_url_from_ei_nats_url_before_the_state_file(tmp_path, monkeypatch):
    """``split`` / ``tap`` against a cluster ``up`` did not start needed ``--nats-url`` (a password in it is in every
    local user's ``ps``); now ``EI_NATS_URL`` (as the services and ``auth stream`` read it) serves, the flag
    still wins, and the state file is the fallback."""
    import argparse

    from evolving_infra.state import fill_nats_url, write_state

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("EI_NATS_URL", raising=False)
    args = argparse.Namespace(nats_url=None, partition="p0")
    missing = fill_nats_url(args)
    assert args.nats_url is None and missing is not None and "EI_NATS_URL" in missing
    write_state({"router_url": "http://127.0.0.1:1", "nats_url": "nats://127.0.0.1:4999", "partition": "p0"})
    monkeypatch.setenv("EI_NATS_URL", URL)
    args = argparse.Namespace(nats_url=None, partition="p0")
    assert fill_nats_url(args) is None and args.nats_url == URL
    args = argparse.Namespace(nats_url="nats://given:4222", partition="p0")
    assert fill_nats_url(args) is None and args.nats_url == "nats://given:4222"
    monkeypatch.delenv("EI_NATS_URL")
    args = argparse.Namespace(nats_url=None, partition="p0")
    assert fill_nats_url(args) is None and args.nats_url == "nats://127.0.0.1:4999"  # this process's state file


def test_split_and_tap_say_so_when_ei_nats_url_is_not_the_local_cluster_up_started(tmp_path, monkeypatch, capsys):
    """``up`` starts its own NATS server whatever ``EI_NATS_URL`` says, but ``split`` / ``tap`` take ``EI_NATS_URL``
    first: a URL left exported in the shell (another cluster's) silently took them away from the cluster ``up`` had
    just started (its banner: "trace with: evolving-infra tap (or split get)"), and ``split set`` changed the other
    cluster. Now a note on stderr names both; none when they agree or no local cluster runs."""
    import argparse

    from evolving_infra.state import fill_nats_url, write_state

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("EI_NATS_URL", URL)
    assert fill_nats_url(argparse.Namespace(nats_url=None, partition="p0")) is None
    assert capsys.readouterr().err == ""  # no local cluster: nothing to say
    write_state({"router_url": "http://127.0.0.1:1", "nats_url": "nats://127.0.0.1:4999", "partition": "p0"})
    args = argparse.Namespace(nats_url=None, partition="p0")
    assert fill_nats_url(args) is None and args.nats_url == URL
    err = capsys.readouterr().err
    assert "EI_NATS_URL" in err and "nats://127.0.0.1:4999" in err and "nats://ei:***@127.0.0.1:4222" in err, err
    assert SECRET not in err
    monkeypatch.setenv("EI_NATS_URL", "nats://127.0.0.1:4999")  # the local cluster's own URL: nothing to say
    assert fill_nats_url(argparse.Namespace(nats_url=None, partition="p0")) is None
    assert capsys.readouterr().err == ""



OTHER_SERVERS = {  # another cluster's NATS settings, left exported in the shell
    "EI_NATS_CREDS": "/home/me/other/admin.nk",
    "EI_NATS_USER": "alice",
    "EI_NATS_PASSWORD": "pw-other",
    "EI_NATS_TLS_CA": "/home/me/other/ca.pem",
    "EI_NATS_TLS_CERT": "/home/me/other/client.pem",
    "EI_NATS_TLS_KEY": "/home/me/other/client.key",
    "EI_LOG_LEVEL": "debug",  # a setting of every service, not of a server: kept
}
PROBE = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('EI_') and k != 'EI_API_KEYS'}))"


def _spawned_envs(c: LocalCluster) -> dict[str, dict[str, str]]:
    """Each wired child's ``EI_*`` environment as ``_spawn`` gives it (its argv replaced by a probe)."""
    import json
    import sys

    for kid in c.children:
        kid.argv = [sys.executable, "-c", PROBE]
        c._spawn(kid)
    out = {}
    for kid in c.children:
        assert kid.proc is not None and kid.proc.wait(30) == 0, kid.name
        kid.log_file.close()  # type: ignore[attr-defined]
        out[kid.name] = json.loads(kid.log_path.read_text().splitlines()[-1])
    return out


def test_no_child_of_the_embedded_server_inherits_another_servers_nats_settings(tmp_path, monkeypatch):
    """``up`` without ``--nats-url`` runs its own nats-server, but its services inherited the shell's
    ``EI_NATS_TLS_CA`` & co. (another server's): with a CA path not on this machine every service exited 1
    (``cannot load NATS TLS files``) and ``up`` failed in 10 s. Now they are dropped; with ``--nats-url`` (an
    external server) they are the user's settings for that server and kept."""
    from shared.config import CommonConfig

    # every connection setting a service reads (shared/config.py) but the URL, which the cluster sets itself
    assert set(OTHER_SERVERS) - {"EI_LOG_LEVEL"} == {f"EI_{f.upper()}" for f in CommonConfig.__struct_fields__ if f.startswith("nats_")} - {"EI_NATS_URL"}
    for k in [k for k in os.environ if k.startswith("EI_")]:
        monkeypatch.delenv(k)
    for k, v in {**OTHER_SERVERS, "EI_NATS_URL": URL}.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "embedded").mkdir()
    embedded = LocalCluster(ClusterSpec(nodes=2, split="1P1D", log_dir=str(tmp_path / "embedded")))
    embedded.log_dir = tmp_path / "embedded"
    embedded.nats_url = "nats://127.0.0.1:4999"  # the server it started
    embedded.children = embedded._plan_children()
    embedded._wire_children()
    envs = _spawned_envs(embedded)
    assert sorted(envs) == ["kvdirectory", "planner", "router", "worker-w0", "worker-w1"]
    for name, env in envs.items():
        assert env == {"EI_NATS_URL": "nats://127.0.0.1:4999", "EI_LOG_LEVEL": "debug"}, name
    (tmp_path / "external").mkdir()
    for name, env in _spawned_envs(_wired(tmp_path / "external")).items():  # --nats-url: kept
        assert env == {**OTHER_SERVERS, "EI_NATS_URL": URL}, name
