"""The NATS permission table (shared.auth): every subject has a publisher and a subscriber, roles are confined."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evolving_infra.hostile import samples
from shared.auth import AuthError, NatsAuth, allowed, generate, identity, permissions, subject_matcher, subject_matches
from shared.subjects import ALL, Subjects

SERVICES = ["planner", "router", "kvdirectory", "worker-w0", "worker-w1", "operator", "launcher"]


def _full(template: str, params: dict[str, str]) -> str:
    return Subjects("p0").prefix + template.format(**params)


def test_subject_matching():
    assert subject_matches("a.*.c", "a.b.c") and not subject_matches("a.*.c", "a.b.d")
    assert subject_matches("a.>", "a.b.c") and not subject_matches("a.>", "a")
    assert not subject_matches("a.b", "a.b.c") and subject_matches("a.b.c", "a.b.c")


def test_subject_matcher_is_subject_matches_with_the_pattern_split_once():
    """Every bus subscription checks each message's subject with subject_matcher(pattern): same answers."""
    patterns = ["a.*.c", "a.>", "a.b", "a.b.c", "*", ">", "a.*.*", "*.b.>", "ei.p0.req.*.out.*", "ei.p0.req.r1.out.*", "a..c", "a.*"]
    subjects = ["a.b.c", "a.b.d", "a", "a.b", "a.b.c.d", "x.b.c", "a..c", "a.x.c", "ei.p0.req.r1.out.w0", "ei.p0.req.r2.out.w0",
                "ei.p0.req.r1.out.w0.x", "", "b"]
    for p in patterns:
        m = subject_matcher(p)
        for s in subjects:
            assert m(s) == subject_matches(p, s), (p, s)


def test_every_subject_has_a_publisher_and_a_subscriber():
    """A subject the table forgets breaks the cluster silently under auth: this fails first."""
    perms = {n: permissions(identity(n)) for n in SERVICES}
    for template, (params, _msg) in samples(("w0", "w1")).items():
        subject = _full(template, {k: ("router" if k == "router" else v) for k, v in params.items()})
        pubs = [n for n, p in perms.items() if allowed(p, "publish", subject)]
        subs = [n for n, p in perms.items() if allowed(p, "subscribe", subject)]
        assert pubs and subs, (template, pubs, subs)
    assert {s.template for s in ALL} == set(samples())


def test_roles_are_confined():
    w0 = permissions(identity("worker-w0"))
    p = Subjects("p0").prefix
    assert not allowed(w0, "publish", p + "split.commands")
    assert not allowed(w0, "publish", p + "kv.events.w1") and allowed(w0, "publish", p + "kv.events.w0")
    assert not allowed(w0, "publish", p + "node.state.w1") and allowed(w0, "publish", p + "node.state.w0")
    # its own node.state: a later process under its node id supersedes it (services/worker)
    assert allowed(w0, "subscribe", p + "node.state.w0") and not allowed(w0, "subscribe", p + "node.state.w1")
    # not its kind's heartbeats: every node's identity may publish svc.heartbeat.worker, so a worker that stopped at a
    # later beat under its instance id could be stopped by any other (node.state.<n> above tells it instead)
    assert not allowed(w0, "subscribe", p + "svc.heartbeat.worker") and not allowed(w0, "subscribe", p + "svc.heartbeat.router")
    assert not allowed(w0, "publish", p + "kv.countsync.w1") and allowed(w0, "publish", p + "kv.countsync.w0")  # its own counts only
    assert not allowed(w0, "publish", p + "work.w1.prefill")
    assert not allowed(w0, "subscribe", p + "req.x.out.w0") and not allowed(w0, "subscribe", p + "work.w1.prefill")
    # a request's output only on its own node's subject: another node's stream is out of its reach
    assert allowed(w0, "publish", p + "req.x.out.w0")
    assert not allowed(w0, "publish", p + "req.x.out.w1") and not allowed(w0, "publish", p + "req.x.out")
    router = permissions(identity("router-1"))  # its own end of a request that ended parked, under its name
    assert allowed(router, "publish", p + "req.x.out.router-1") and not allowed(router, "publish", p + "req.x.out.w0")
    assert not allowed(w0, "subscribe", "_INBOX.router.abc")
    for n in SERVICES:
        perm = permissions(identity(n))
        assert not allowed(perm, "publish", "$JS.API.STREAM.CREATE.x"), n
        if n != "planner":
            assert not allowed(perm, "publish", p + "split.commands"), n
        if n not in ("router", "planner"):
            assert not allowed(perm, "subscribe", p + "req.r1.out.w0"), n
        if not n.startswith("worker-") and n not in ("router", "admin"):
            assert not allowed(perm, "publish", p + "req.r1.out.w0") and not allowed(perm, "publish", p + f"req.r1.out.{n}"), n
        if n != "router":
            assert not allowed(perm, "publish", p + "work.w0.prefill"), n
    op = permissions(identity("operator"))
    assert allowed(op, "publish", p + "split.set") and not allowed(op, "publish", p + "split.commands")
    with pytest.raises(AuthError):
        identity("mallory")


def test_a_consumer_only_on_a_reliable_subject_the_identity_reads():
    """The consumer-create API subject carries the filter only in its named form
    (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``): the bare one let a worker read any of the
    stream's subjects (another node's prompts, every output) through a consumer."""
    p = Subjects("p0").prefix
    create = "$JS.API.CONSUMER.CREATE.EI_p0"
    for n in SERVICES:
        perm = permissions(identity(n))
        for bare in (create, create + ".c1", "$JS.API.CONSUMER.DURABLE.CREATE.EI_p0.c1"):
            assert not allowed(perm, "publish", bare), (n, bare)
        # nor may it find, read, pull from, delete or ack a consumer (another's, whose name is random)
        for api in ("$JS.API.CONSUMER.NAMES.EI_p0", "$JS.API.CONSUMER.LIST.EI_p0", "$JS.API.CONSUMER.INFO.EI_p0.c1",
                    "$JS.API.CONSUMER.DELETE.EI_p0.c1", "$JS.API.CONSUMER.MSG.NEXT.EI_p0.c1", "$JS.ACK.EI_p0.c1.1.2.3.4.0", "$JS.API.INFO"):
            assert not allowed(perm, "publish", api), (n, api)
        grants = [s for s in perm["publish"] if s.startswith(create)]
        for g in grants:  # each a named consumer on one subject the identity may subscribe
            name, filt = g[len(create) + 1 :].split(".", 1)
            assert name == "*" and allowed(perm, "subscribe", filt), (n, g)
        if n not in ("router", "kvdirectory") and not n.startswith("worker-"):
            assert grants == [], n
    w0 = permissions(identity("worker-w0"))
    for s in ("work.w0.prefill", "work.w0.decode", "work.w0.abort"):
        assert allowed(w0, "publish", f"{create}.c1.{p}{s}"), s
    for s in ("work.w1.prefill", "work.*.prefill", "req.r1.out.w0", "req.*.out.*", "kv.events.w0", ">"):
        assert not allowed(w0, "publish", f"{create}.c1.{p}{s}"), s
    router = permissions(identity("router"))
    assert allowed(router, "publish", f"{create}.c1.{p}req.*.out.*") and not allowed(router, "publish", f"{create}.c1.{p}work.w0.prefill")
    # branch.events: read live (core), never replayed from the stream (a consumer on it) by a router
    assert allowed(router, "subscribe", f"{p}branch.events") and not allowed(router, "publish", f"{create}.c1.{p}branch.events")
    kvd = permissions(identity("kvdirectory"))
    assert allowed(kvd, "publish", f"{create}.c1.{p}kv.events.*") and not allowed(kvd, "publish", f"{create}.c1.{p}req.*.out.*")


def test_generate_writes_private_files_and_a_server_block(tmp_path):
    for mode in ("nkeys", "password"):
        creds = generate(tmp_path / mode, ["planner", "worker-w0"], mode=mode)
        assert set(creds.files) == {"planner", "worker-w0", "operator", "launcher", "admin"}
        for path in creds.files.values():
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert creds.server_block.startswith("authorization {") and "allow_responses: true" in creds.server_block
        a = creds.auth_for("worker-w0")
        assert a.enabled and a.inbox_prefix == "_INBOX.worker-w0"
        opts = a.connect_options()
        assert opts["inbox_prefix"] == "_INBOX.worker-w0" and ("nkeys_seed" in opts or opts["user"] == "worker-w0")
    assert not NatsAuth.from_settings().enabled and NatsAuth.from_settings().connect_options() == {}
    with pytest.raises(AuthError):
        NatsAuth.from_settings(user="x")


@pytest.mark.parametrize("names", [["worker-*"], ["worker->"], ["worker-w0", "worker-w 1"], ["router-a.b"], ["router-/../x"], ["worker-w0\n"]])
def test_generate_refuses_a_name_that_is_not_one_subject_token_and_writes_nothing(tmp_path, names):
    """``auth gen --nodes '*'`` gave a worker identity ``work.*.prefill`` (every node's prompts) and
    ``kv.events.*``; ``--nodes 'w0, w1'`` a server config with a space in its subjects."""
    with pytest.raises(AuthError, match="one NATS subject token"):
        generate(tmp_path / "creds", names)
    assert not (tmp_path / "creds").exists()
    with pytest.raises(AuthError, match="partition"):
        generate(tmp_path / "creds", ["worker-w0"], partition="*")


@pytest.mark.parametrize("nodes", ["w0,router", "router-1", "w0,router-x"])
def test_a_node_id_that_is_a_routers_name_is_refused(tmp_path, capsys, nodes):
    """A worker node id that is a router identity's name (``router``, ``router-<x>``) would get that router's output
    subject (``req.*.out.router``: the router's own, where it ends a parked request) and could end its streams
    (reviewer rr-chunk). Before, ``auth gen --nodes w0,router`` wrote it (exit 0) and the worker started. Now
    ``generate`` (``auth gen``, ``up``) refuses it before writing anything (exit 2) and so does the worker's config."""
    from evolving_infra.cli import main
    from services.worker.config import WorkerConfig

    with pytest.raises(AuthError, match="a router's instance name"):
        generate(tmp_path / "creds", [f"worker-{n}" for n in nodes.split(",")])
    assert not (tmp_path / "creds").exists()
    assert main(["auth", "gen", "--dir", str(tmp_path / "gen"), "--nodes", nodes]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "a router's instance name" in err and not (tmp_path / "gen").exists(), err
    with pytest.raises(ValueError, match="a router's instance name"):
        WorkerConfig(node=nodes.split(",")[-1])
    assert WorkerConfig(node="routerish").node == "routerish"  # only router and router-<x> are router names
    assert main(["auth", "gen", "--dir", str(tmp_path / "ok"), "--nodes", "w0,routerish"]) == 0


def test_auth_gen_server_block_is_private_and_bad_nodes_exit_2(tmp_path, capsys):
    """nats-auth.conf (its hashes, with ``--mode password``): mode 0600, as the credentials."""
    from evolving_infra.cli import main

    for mode in ("password", "nkeys"):
        d = tmp_path / mode
        assert main(["auth", "gen", "--dir", str(d), "--nodes", "w0,w1", "--mode", mode]) == 0
        conf = d / "nats-auth.conf"
        assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600, mode
        if mode == "password":  # bcrypt hashes, not the passwords (tests/integration/test_nats_password_hash_live.py)
            assert open(d / "admin.pass").read().split(":", 1)[1].strip() not in conf.read_text()
    capsys.readouterr()
    assert main(["auth", "gen", "--dir", str(tmp_path / "bad"), "--nodes", "w0,*"]) == 2
    assert "one NATS subject token" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_redact_url_hides_passwords_and_tokens_only():
    from shared.auth import redact_url

    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert redact_url("nats://ei:pw@h:4222") == "nats://ei:***@h:4222"
    assert redact_url("tls://token@h") == "tls://***@h"
    assert redact_url("nats://a:p1@h1:1,nats://b:p2@h2:2") == "nats://a:***@h1:1,nats://b:***@h2:2"
    assert redact_url("nats://a:p:with:colons@h") == "nats://a:***@h"
    # a password with / or , (both were printed: nats://ei:p/w@h whole, nats://ei:p,w@h as nats://ei:p,***@h)
    assert redact_url("nats://ei:p/w@h:4222") == "nats://ei:***@h:4222"
    assert redact_url("nats://ei:p,w@h:4222") == "nats://***@h:4222"  # a user part with a comma may span servers
    assert redact_url("nats://a:p1@h1:1, tls://b:p/2@h2:2,wss://t,k@h3:443/ws") == "nats://a:***@h1:1, tls://b:***@h2:2,wss://***@h3:443/ws"
    assert redact_url("u:p1@h1:1,v:p2@h2:2") == "***@h2:2"  # no scheme: one user part, up to the last @
    assert redact_url("tok://en@h") == "tok:***@h" and redact_url("http://c:4318") == "http://c:4318" and redact_url("") == ""



def test_demo_report_records_its_command_line_without_a_nats_password():
    """``demo --nats-url nats://u:<password>@host`` wrote the password into ``OUT/report.json`` (meta ``argv``) and
    ``OUT/report.html``, the folder a user shares."""
    from pathlib import Path

    from shared.auth import redact_argv

    argv = ["--nats-url", "nats://ei:pw-3a9f@h:4222", "--nats-u=tls://ei:pw-3a9f@h", "--out", "my out", "--split", "2P2D"]
    assert redact_argv(argv) == ["--nats-url", "nats://ei:***@h:4222", "--nats-u=tls://ei:***@h", "--out", "my out", "--split", "2P2D"]
    launcher = (Path(__file__).parents[3] / "evolving_infra" / "launcher.py").read_text()
    assert '"argv": redact_argv(sys.argv[1:])' in launcher and '"argv": sys.argv' not in launcher

_HOSTS = st.sampled_from(["h1", "10.0.0.1:4222", "[::1]:4222", "head.example:1", "h2:4223"])
_SECRET = st.text(alphabet="QXZ,/@:%?#-", min_size=1, max_size=12).filter(lambda t: any(c in t for c in "QXZ"))


@st.composite
def _server(draw: st.DrawFn) -> tuple[str, str]:
    """One server URL and its secret ("" = none); the secret's letters (Q, X, Z) are in nothing else."""
    scheme = draw(st.sampled_from(["nats://", "tls://", "ws://", "wss://", " nats://", ""]))
    host = draw(_HOSTS) + ("/ws" if scheme.strip().startswith("ws") and draw(st.booleans()) else "")
    kind = draw(st.sampled_from(["none", "password", "token"]))
    secret = "" if kind == "none" else draw(_SECRET)
    user = draw(st.sampled_from(["ei", "alice@corp.example", "router-1"]))
    if kind == "token":  # a token with ':' is user:password to NATS (urlparse), its user shown
        secret = secret.replace(":", "") or "Q"
    userinfo = {"none": "", "password": f"{user}:{secret}@", "token": f"{secret}@"}[kind]
    return f"{scheme}{userinfo}{host}", secret


@given(st.lists(_server(), min_size=1, max_size=3))
@settings(max_examples=300, deadline=None)
def test_redact_url_shows_no_part_of_any_password_or_token(servers):
    """Every form NATS takes (nats/tls/ws/wss or no scheme, user:password or token, a list of servers),
    passwords and tokens with , / @ : % ? #: no letter of one is left in what ``redact_url`` writes (before,
    a password with / was shown whole and one with , in part)."""
    from shared.auth import redact_url

    url = ",".join(u for u, _ in servers)
    shown = redact_url(url)
    assert not any(c in shown for c in "QXZ"), (url, shown)
    if not any(secret for _, secret in servers):
        assert shown == url
    assert shown.endswith(servers[-1][0].rpartition("@")[2])  # the last host is still shown


def test_up_prints_and_writes_the_nats_url_without_its_password():
    """``up --nats-url nats://user:pass@host``: READY and LOG_DIR/cluster.json show ``user:***``."""
    from evolving_infra.launcher import _shown

    info = {"nats_url": "nats://ei:pw-secret@h:4222", "router_url": "http://127.0.0.1:8000"}
    assert _shown(info) == {"nats_url": "nats://ei:***@h:4222", "router_url": "http://127.0.0.1:8000"}
    assert info["nats_url"] == "nats://ei:pw-secret@h:4222"  # the state file gets it whole


_ANY_SECRET = st.text(alphabet="QXZ,/@:%?# -é", min_size=1, max_size=12)


@given(
    st.lists(st.tuples(st.sampled_from(["nats://", "tls://", " nats://"]), _HOSTS), min_size=1, max_size=3),
    st.sampled_from(["ei", "alice@corp.example", "r:1"]),
    _ANY_SECRET,
    st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_nats_servers_splits_a_list_and_percent_decodes_its_credentials(servers, user, secret, token):
    """``nats://u:p%2Fw@h1,nats://u:p%2Fw@h2`` (the URL form of a password with , / @ : % ...): nats-py took
    the string as one server and its user part undecoded; ``nats_servers`` gives the bare servers and the
    decoded credentials for nats-py's ``user=``/``password=`` (``token=``)."""
    from urllib.parse import quote

    from shared.auth import nats_servers

    userinfo = quote(secret, safe="") if token else f"{quote(user, safe='')}:{quote(secret, safe='')}"
    url = ",".join(f"{scheme}{userinfo}@{host}" for scheme, host in servers)
    creds = {"token": secret} if token else {"user": user, "password": secret}
    assert nats_servers(url) == ([scheme.strip() + host for scheme, host in servers], creds)


def test_nats_servers_reads_a_ws_urls_user_part_in_its_authority_only():
    """A ws(s) URL has a path, where an ``@`` is no user part: ``ws://h/p@x`` was read as token ``h/p`` for
    server ``ws://x``. The user part of a ws(s) server is now looked for before the first ``/`` after its scheme
    (as nats-py's ``urlparse`` does); nats/tls servers keep the raw ``/`` in a password they always took."""
    from shared.auth import nats_servers, redact_url

    assert nats_servers("ws://h/p@x") == (["ws://h/p@x"], {})
    assert nats_servers("wss://ei:pw@h:443/nats@edge") == (["wss://h:443/nats@edge"], {"user": "ei", "password": "pw"})
    assert nats_servers("ws://alice@corp:p%2Fw@h/ws,wss://alice@corp:p%2Fw@h2") == (
        ["ws://h/ws", "wss://h2"], {"user": "alice@corp", "password": "p/w"})
    assert nats_servers("nats://ei:p/w@h") == (["nats://h"], {"user": "ei", "password": "p/w"})  # as before
    assert "pw" not in redact_url("wss://ei:pw@h/p@x")  # redaction stays conservative (hides up to the last @)


def test_nats_servers_forms_and_errors():
    from shared.auth import client_options, nats_servers

    assert nats_servers("nats://h1:4222") == (["nats://h1:4222"], {})
    assert nats_servers("nats://h1:4222, nats://h2:4222,tls://h3") == (["nats://h1:4222", "nats://h2:4222", "tls://h3"], {})
    assert nats_servers("nats://ei:p,w/x@h1:4222,h2:4222") == (["nats://h1:4222", "nats://h2:4222"], {"user": "ei", "password": "p,w/x"})
    assert nats_servers("nats://h1,nats://ei:pw@h2") == (["nats://h1", "nats://h2"], {"user": "ei", "password": "pw"})
    # different credentials per server: each kept in its own URL, decoded, where nats-py reads it
    assert nats_servers("nats://a:p%2Cw@h1,nats://b:2@h2") == (["nats://a:p,w@h1", "nats://b:2@h2"], {})
    with pytest.raises(AuthError, match="different credentials") as e:
        nats_servers("nats://a:p%2Fsecret@h1,nats://b:2@h2")  # a URL cannot carry that / raw
    assert "secret" not in str(e.value)
    for bad in ("", "nats://h1,,nats://h2", "nats://h1,"):
        with pytest.raises(AuthError, match="empty server"):
            nats_servers(bad)
    # credentials of EI_NATS_USER / EI_NATS_CREDS win over the URL's (as nats-py's options did)
    opts = client_options("nats://u:p@h1,nats://u:p@h2", NatsAuth(name="x", user="x", password="y"))
    assert (opts["servers"], opts["user"], opts["password"]) == (["nats://h1", "nats://h2"], "x", "y")
    assert client_options("nats://t%40k@h") == {"servers": ["nats://h"], "token": "t@k"}


def test_auth_gen_routers_takes_a_count_as_up_does_or_names(tmp_path, capsys):
    """``up --routers 2`` is a count and ``auth gen --routers`` took names only: ``--routers 2`` was the identity "2"
    ("no NATS identity kind for '2'", exit 2). A count now gives up's names (router, router-1); names still work;
    a count below 1 is refused naming both forms."""
    from evolving_infra.cli import main

    assert main(["auth", "gen", "--dir", str(tmp_path / "n"), "--nodes", "w0", "--routers", "2"]) == 0
    assert {"router", "router-1"} <= {p.stem for p in (tmp_path / "n").iterdir()}, capsys.readouterr().out
    assert main(["auth", "gen", "--dir", str(tmp_path / "m"), "--nodes", "w0", "--routers", "router,router-b"]) == 0
    assert {"router", "router-b"} <= {p.stem for p in (tmp_path / "m").iterdir()}
    capsys.readouterr()
    assert main(["auth", "gen", "--dir", str(tmp_path / "z"), "--nodes", "w0", "--routers", "0"]) == 2
    err = capsys.readouterr().err
    assert "--routers 0" in err and "router,router-1" in err, err
    # a digit that is not an ASCII one ('²'.isdigit() is True) is a name, refused as such: exit 2, never a traceback
    assert main(["auth", "gen", "--dir", str(tmp_path / "s"), "--nodes", "w0", "--routers", "\u00b2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err


def test_auth_gen_routers_count_is_capped(tmp_path, capsys):
    """A count past ``MAX_ROUTER_COUNT`` (a typo such as 99999999999) is refused at once, exit 2, before any name is
    built or file written (review: it built that many names, running out of memory); the cap itself is taken."""
    from evolving_infra.auth_cli import MAX_ROUTER_COUNT
    from evolving_infra.cli import main

    for bad in ("99999999999", str(MAX_ROUTER_COUNT + 1), "00001025"):
        assert main(["auth", "gen", "--dir", str(tmp_path / "x"), "--nodes", "w0", "--routers", bad]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("error: --routers ") and f"at most {MAX_ROUTER_COUNT}" in err, err
        assert not (tmp_path / "x").exists()
    assert main(["auth", "gen", "--dir", str(tmp_path / "ok"), "--nodes", "w0", "--routers", "3"]) == 0
    assert {"router", "router-1", "router-2"} <= {p.stem for p in (tmp_path / "ok").iterdir()}


def test_a_router_asks_branch_query_and_only_the_directory_answers():
    """``branch.query``: a router asks the directory the state of a branch it never saw (its end or tool call); no
    other identity may ask (a worker could learn which branch ids exist) or answer (forge ``active``: the router
    would relay an end)."""
    q = Subjects("p0").prefix + "branch.query"
    for n in SERVICES:
        perm = permissions(identity(n))
        assert allowed(perm, "publish", q) == (n == "router"), n
        assert allowed(perm, "subscribe", q) == (n == "kvdirectory"), n


def test_a_router_reads_the_other_routers_branch_events():
    """A router subscribes to ``branch.events`` (a core subscription): the end or tool call another router relayed of a
    branch it served ends or holds it in its own table (before, only the directory read them: the serving router kept
    an ended branch active and republished it to a restarted directory). Only routers publish them."""
    s = Subjects("p0").prefix + "branch.events"
    for n in SERVICES:
        perm = permissions(identity(n))
        assert allowed(perm, "subscribe", s) == (n in ("router", "kvdirectory")), n
        assert allowed(perm, "publish", s) == (n == "router"), n
