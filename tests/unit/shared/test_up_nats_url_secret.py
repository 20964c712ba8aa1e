"""``up --nats-url nats://user:<password>@host`` (an external NATS with password auth): before, every service
process got ``--nats-url <the URL>`` on its command line, so the password was in every local user's ``ps``
(``/proc/<pid>/cmdline`` is world-readable). Now the URL goes in each child's environment (``EI_NATS_URL``,
which the services read; ``/proc/<pid>/environ`` only the owner reads), restarts included."""

from __future__ import annotations

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
