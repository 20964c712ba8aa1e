"""Authenticated NATS with least privilege, against a real nats-server (issue 18 must-shows).

* a client without credentials (or with a forged key) cannot connect;
* a worker's identity cannot publish a split command, another node's KV events or
  node state, nor read request outputs or use JetStream;
* on a whole cluster (every service its own process and identity): a hostile split
  command (published with the planner's own key, the only identity allowed to) does
  not wedge it, and the operator's ``split set`` afterwards takes effect and serves.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import nats
import pytest
import pytest_asyncio

from evolving_infra.cluster import ClusterSpec, LocalCluster
from shared import messages as m
from shared.auth import generate
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import KV_EVENTS, NODE_STATE, REQ_OUT, ROUTE_BIND, ROUTE_PLACED, SPLIT_COMMANDS, SVC_STATS, WORK_PREFILL, Subjects

NAMES = ["planner", "router", "kvdirectory", "worker-w0", "worker-w1"]


@pytest.fixture
def secured(tmp_path):
    creds = generate(tmp_path / "creds", NAMES)
    with EmbeddedNatsServer(auth_block=creds.server_block) as srv:
        yield srv, creds


async def _connect(srv: EmbeddedNatsServer, creds, name: str) -> Bus:
    return await Bus.connect(srv.url, Subjects("p0"), service=name.split("-")[0], instance=name, auth=creds.auth_for(name), max_reconnect_attempts=0)


async def test_no_credentials_no_connection(secured, tmp_path):
    srv, creds = secured
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(srv.url, allow_reconnect=False, connect_timeout=3)
    other = generate(tmp_path / "other", ["worker-w0"])  # a well-formed key the server does not know
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(srv.url, allow_reconnect=False, connect_timeout=3, **other.auth_for("worker-w0").connect_options())


async def test_worker_identity_is_confined_to_its_own_subjects(secured):
    srv, creds = secured
    admin = await _connect(srv, creds, "admin")
    w0 = await _connect(srv, creds, "worker-w0")
    seen: list[str] = []

    async def on_any(msg) -> None:
        seen.append(msg.subject)

    raw = await admin.nc.subscribe("ei.p0.>", cb=on_any)
    # Bus.flush, not nc.flush: nats-py's flush writes its PING ahead of the queued SUB (Bus.flush's docstring), so the
    # server could get w0's publishes (another connection) before the SUB. Same below for each SUB another connection
    # publishes to
    await admin.flush()
    # forbidden: a split command, w1's KV events and state
    await w0.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=10**15, phases={"w0": "decode", "w1": "decode"}))
    await w0.publish(KV_EVENTS, m.KvEventBatch(node="w1", seq=10**12), node="w1")
    await w0.publish(NODE_STATE, m.NodeState(node="w1", accepting=False), node="w1")
    # allowed: its own KV events and state
    await w0.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=1), node="w0")
    await w0.publish(NODE_STATE, m.NodeState(node="w0"), node="w0")
    await w0.nc.flush()
    for _ in range(50):
        if len(seen) >= 2 and w0.counters["nats.errors"] >= 3:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    assert sorted(seen) == ["ei.p0.kv.events.w0", "ei.p0.node.state.w0"]
    assert w0.counters["nats.errors"] >= 3  # the server answered each forbidden publish with a permissions violation
    # a worker cannot read request outputs nor create a JetStream stream
    leaked: list[bytes] = []

    async def on_out(msg) -> None:
        leaked.append(msg.data)

    await w0.nc.subscribe("ei.p0.req.*.out.*", cb=on_out)
    await w0.flush()
    # the server saw the SUB (its refusal came before the PONG): leaked == [] below is not an unregistered SUB's
    assert w0.last_denied == ("subscription", "ei.p0.req.*.out.*"), w0.last_denied
    await admin.publish(REQ_OUT, m.TokenChunk(rid="secret", node="w1", token_ids=[1, 2]), rid="secret", node="w1")
    await admin.nc.flush()
    # the server refuses the publish (no JetStream API reply comes: the request times out)
    with pytest.raises(nats.errors.TimeoutError):
        await w0.nc.request("$JS.API.STREAM.CREATE.evil", b'{"name":"evil","subjects":["evil.>"]}', timeout=1.0)
    assert w0.last_denied == ("publish", "$js.api.stream.create.evil"), w0.last_denied  # nats-py lower-cases -ERR
    await asyncio.sleep(0.3)
    assert leaked == []
    await raw.unsubscribe()
    for b in (w0, admin):
        await b.close()


async def test_a_request_cannot_aim_a_services_reply_outside_the_inboxes(secured):
    """The server lets a responder publish on any reply subject it is handed (``allow_responses``). A
    worker's garbage request on ``route.bind.router`` with reply ``$JS.API.STREAM.DELETE.EI_p0`` made the
    router's refusal (an empty body, what a stream delete takes) delete the partition's stream, and a
    valid one with reply ``ei.p0.kv.events.w1`` put the router's answer on w1's KV events (the router may
    not publish there). Now such requests are counted and dropped; inbox requests are answered."""
    srv, creds = secured
    launcher = await _connect(srv, creds, "launcher")
    assert await launcher.ensure_stream()
    admin, router, w0 = [await _connect(srv, creds, n) for n in ("admin", "router", "worker-w0")]

    async def on_bind(req: m.DecodeBindRequest, _subject: str) -> m.DecodeBindReply:
        return m.DecodeBindReply(rid=req.rid, reason="no decode node")

    await router.serve(ROUTE_BIND, on_bind, router="router")
    await router.flush()  # the server has the SUB before w0's requests (nats-py's flush did not promise it)
    reflected: list[str] = []

    async def on_any(msg) -> None:
        reflected.append(msg.subject)

    await admin.nc.subscribe("ei.p0.kv.events.>", cb=on_any)
    await admin.flush()  # registered before w0's requests: reflected == [] below is not a SUB that came late
    bind = "ei.p0.route.bind.router"
    await w0.nc.publish(bind, m.encode(m.DecodeBindRequest(rid="r1", prefill_node="w0")), reply="ei.p0.kv.events.w1")
    await w0.nc.publish(bind, b"garbage", reply="$JS.API.STREAM.DELETE.EI_p0")
    await w0.nc.flush()
    reply = await w0.request(ROUTE_BIND, m.DecodeBindRequest(rid="r2", prefill_node="w0"), router="router")  # its own inbox: answered
    assert reply.rid == "r2"
    await asyncio.sleep(0.3)
    assert (await admin.nc.jetstream().stream_info("EI_p0")).config.name == "EI_p0"
    assert reflected == []
    assert router.counters["bad_reply.route.bind.{router}"] == 2 and router.counters["dropped.route.bind.{router}"] == 2
    for b in (launcher, admin, router, w0):
        await b.close()


# --------------------------------------------------------------------------- #
# whole cluster, auth on (the default of `up`)
async def _create_consumer(bus: Bus, api_subject: str, config: dict, timeout_s: float = 1.0) -> bool:
    """Ask the JetStream API for a consumer on ``EI_p0`` as ``bus``'s identity: True when it was created, False when
    refused or unanswered within ``timeout_s`` seconds (a denied publish gets no reply: what a refusal waits)."""
    try:
        reply = await bus.nc.request(api_subject, json.dumps({"stream_name": "EI_p0", "config": config}).encode(), timeout=timeout_s)
    except (nats.errors.Error, asyncio.TimeoutError):  # a denied publish gets no reply
        return False
    return "error" not in json.loads(reply.data)


async def test_a_worker_cannot_create_a_consumer_on_another_nodes_work_or_the_outputs(secured):
    """JetStream consumers read the stream whatever the identity may subscribe: with the bare
    ``$JS.API.CONSUMER.CREATE.EI_p0`` (filter in the body) granted, worker w0 read w1's prompts
    (``work.w1.prefill``) and every request's output (``req.*.out.*``) through a consumer."""
    srv, creds = secured
    admin = await _connect(srv, creds, "admin")
    w0 = await _connect(srv, creds, "worker-w0")
    assert await admin.ensure_stream()
    js = admin.nc.jetstream(timeout=5.0)
    leaked: list[bytes] = []

    async def on_leak(msg) -> None:
        leaked.append(msg.data)

    await w0.nc.subscribe("_INBOX.worker-w0.leak", cb=on_leak)
    await w0.nc.flush()
    inbox = "_INBOX.worker-w0.leak"
    for api, cfg in [
        ("$JS.API.CONSUMER.CREATE.EI_p0", {"filter_subject": "ei.p0.work.w1.prefill", "deliver_subject": inbox}),
        ("$JS.API.CONSUMER.CREATE.EI_p0", {"filter_subject": "ei.p0.req.*.out.*", "deliver_subject": inbox}),
        ("$JS.API.CONSUMER.CREATE.EI_p0", {"deliver_subject": inbox}),
        ("$JS.API.CONSUMER.CREATE.EI_p0.spy", {"name": "spy", "filter_subjects": ["ei.p0.work.w0.prefill", "ei.p0.work.w1.prefill"], "deliver_subject": inbox}),
        ("$JS.API.CONSUMER.CREATE.EI_p0.spy.ei.p0.work.w1.prefill", {"name": "spy", "filter_subject": "ei.p0.work.w1.prefill", "deliver_subject": inbox}),
        ("$JS.API.CONSUMER.CREATE.EI_p0.spy.ei.p0.req.*.out.*", {"name": "spy", "filter_subject": "ei.p0.req.*.out.*", "deliver_subject": inbox}),
        ("$JS.API.CONSUMER.CREATE.EI_p0.spy.ei.p0.>", {"name": "spy", "filter_subject": "ei.p0.>", "deliver_subject": inbox}),
        ("$JS.API.CONSUMER.DURABLE.CREATE.EI_p0.spy", {"durable_name": "spy", "filter_subject": "ei.p0.work.w1.prefill", "deliver_subject": inbox}),
    ]:
        assert not await _create_consumer(w0, api, cfg), (api, cfg)
    assert (await js.stream_info("EI_p0")).state.consumer_count == 0
    await admin.nc.publish("ei.p0.work.w1.prefill", b"w1's prompt")
    await admin.publish(REQ_OUT, m.TokenChunk(rid="secret", node="w1", token_ids=[1, 2]), rid="secret", node="w1")
    await admin.nc.flush()
    # its own work it consumes, through a named consumer with its one filter (shared.bus)
    got: list[str] = []

    async def on_prefill(msg: m.PrefillWork, _subject: str) -> None:
        got.append(msg.rid)

    await w0.subscribe(WORK_PREFILL, on_prefill, node="w0")
    assert (await js.stream_info("EI_p0")).state.consumer_count == 1
    await admin.publish(WORK_PREFILL, m.PrefillWork(rid="mine", token_ids=b"\x01\x00\x00\x00", prompt_tokens=1, max_tokens=1, block_size=4), node="w0")
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    assert got == ["mine"] and leaked == []
    for b in (w0, admin):
        await b.close()


async def test_a_consumer_delivering_onto_a_core_subject_is_not_taken_for_its_messages(secured):
    """The deliver subject of a push consumer is in the request body, out of reach of the server's
    permissions (nats-server checks only that it is a literal subject outside the stream): a worker
    publishes a split command's bytes on ``work.w0.decode`` (it may: hand-offs) and has a consumer of
    its own ``work.w0.decode`` deliver them on ``split.commands``, which it may not publish. They
    arrive under their stream subject, so a subscriber of ``split.commands`` drops them."""
    srv, creds = secured
    admin = await _connect(srv, creds, "admin")
    w0 = await _connect(srv, creds, "worker-w0")
    router = await _connect(srv, creds, "router")
    assert await admin.ensure_stream()
    commands: list[int] = []

    async def on_command(msg: m.SplitCommand, _subject: str) -> None:
        commands.append(msg.epoch)

    await router.subscribe(SPLIT_COMMANDS, on_command)
    await router.flush()  # a core SUB, registered before w0's consumer delivers there (nats-py's flush did not promise it)
    cfg = {"name": "relay", "filter_subject": "ei.p0.work.w0.decode", "deliver_subject": "ei.p0.split.commands"}
    # allowed: answered, however slowly a loaded host's JetStream makes it (1 s, the refusals' wait, was a race here)
    assert await _create_consumer(w0, "$JS.API.CONSUMER.CREATE.EI_p0.relay.ei.p0.work.w0.decode", cfg, timeout_s=10.0)
    await w0.nc.publish("ei.p0.work.w0.decode", m.encode(m.SplitCommand(epoch=10**15, phases={"w0": "decode", "w1": "prefill"})))
    await w0.nc.flush()
    for _ in range(100):
        if router.counters["wrong_subject." + SPLIT_COMMANDS.template]:
            break
        await asyncio.sleep(0.02)
    await admin.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=3, phases={"w0": "prefill", "w1": "decode"}))
    for _ in range(100):
        if commands:
            break
        await asyncio.sleep(0.02)
    assert commands == [3]
    assert router.counters["wrong_subject." + SPLIT_COMMANDS.template] == 1
    assert router.counters["dropped." + SPLIT_COMMANDS.template] == 1
    for b in (router, w0, admin):
        await b.close()


async def test_a_consumer_refiltered_by_another_identity_is_not_taken_for_its_messages(secured):
    """Consumer names are random (``Bus._consumer_name``, 64 bits) and no identity may list or read the
    stream's consumers, but one that learned a name (the ``$JS.ACK.<stream>.<name>...`` reply of every
    delivery carries it) may, with its own create grant, update that consumer: the server keeps its deliver
    subject (changing it is refused: name in use) and takes the new filter, which the grant confines to the
    updater's own subjects. Worker w0 turned the directory's ``route.placed`` consumer onto its own
    ``work.w0.decode`` and published a placement there: the directory handled it as the router's (the
    reliable path did not check the subject, the core path did). Now it is counted and dropped."""
    srv, creds = secured
    admin = await _connect(srv, creds, "admin")
    assert await admin.ensure_stream()
    directory = await _connect(srv, creds, "kvdirectory")
    w0 = await _connect(srv, creds, "worker-w0")
    placed: list[str] = []

    async def on_placed(msg: m.RoutePlaced, _subject: str) -> None:
        placed.append(msg.rid)

    await directory.subscribe(ROUTE_PLACED, on_placed)
    names = json.loads((await admin.nc.request("$JS.API.CONSUMER.NAMES.EI_p0", b"{}", timeout=2.0)).data)["consumers"]
    assert len(names) == 1 and names[0].startswith("kvdirectory_")  # the leaked name (w0 may not list them)
    info = json.loads((await admin.nc.request(f"$JS.API.CONSUMER.INFO.EI_p0.{names[0]}", b"", timeout=2.0)).data)
    cfg = {**info["config"], "filter_subject": "ei.p0.work.w0.decode"}
    assert await _create_consumer(w0, f"$JS.API.CONSUMER.CREATE.EI_p0.{names[0]}.ei.p0.work.w0.decode", cfg, timeout_s=10.0)
    forged = m.RoutePlaced(rid="forged", branch_id="b", node="w0", phase="prefill")
    await w0.nc.publish("ei.p0.work.w0.decode", m.encode(forged))
    await w0.nc.flush()
    template = ROUTE_PLACED.template
    for _ in range(150):
        if placed or directory.counters["wrong_subject." + template]:
            break
        await asyncio.sleep(0.02)
    assert placed == [] and directory.counters["wrong_subject." + template] == 1, (placed, dict(directory.counters))
    assert directory.counters["dropped." + template] == 1
    for b in (directory, w0, admin):
        await b.close()


# --------------------------------------------------------------------------- #

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory):
    spec = ClusterSpec(nodes=2, split="1P1D", profile="tiny", speedup=5.0, port=0, block_size=4, log_dir=str(tmp_path_factory.mktemp("logs")), ready_timeout_s=90.0)
    async with LocalCluster(spec) as c:
        yield c


async def _complete(url: str) -> int:
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(url + "/v1/completions", json={"prompt": list(range(1, 13)), "max_tokens": 3})
        return r.status_code


async def _router_epoch(url: str) -> int:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(url + "/v1/cluster")).json()["epoch"]


@pytest.mark.asyncio(loop_scope="module")
async def test_hostile_split_does_not_wedge_and_operator_split_set_restores(cluster):
    assert cluster.creds is not None and cluster.describe()["nats_auth"] == "nkeys"
    assert await _complete(cluster.router_url) == 200
    before = await _router_epoch(cluster.router_url)
    # a stolen planner key (the only identity allowed on split.commands): the forged
    # command (epoch 10^15, every node decode) and a valid-shaped hostile one (phases swapped)
    rogue = await Bus.connect(cluster.nats_url, Subjects("p0"), service="planner", instance="planner-rogue", auth=cluster.client_auth("planner"))
    await rogue.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=10**15, phases={"w0": "decode", "w1": "decode"}))
    await rogue.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=before + 100, phases={"w0": "decode", "w1": "prefill"}))
    await rogue.nc.flush()
    await rogue.close()
    # the planner re-issues its split above the hostile epoch; service goes on
    for _ in range(200):
        if await _router_epoch(cluster.router_url) == before + 101:
            break
        await asyncio.sleep(0.05)
    assert await _router_epoch(cluster.router_url) == before + 101
    # the operator's split set (through the planner, operator identity) always takes effect
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "evolving_infra.cli", "split", "set", "1P1D", "--nats-url", cluster.nats_url, "--json",
         "--nats-creds", str(cluster.creds_file("operator"))],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f'"epoch": {before + 102}' in proc.stdout
    for _ in range(200):
        if await _router_epoch(cluster.router_url) == before + 102:
            break
        await asyncio.sleep(0.05)
    assert await _router_epoch(cluster.router_url) == before + 102
    for _ in range(5):
        assert await _complete(cluster.router_url) == 200
    # the operator identity cannot publish a split command itself, and a bare split-cli without credentials is refused
    bare = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "evolving_infra.cli", "split", "get", "--nats-url", cluster.nats_url, "--timeout", "2"],
        capture_output=True, text=True, timeout=60, env={k: v for k, v in __import__("os").environ.items() if not k.startswith("EI_NATS")},
    )
    assert bare.returncode == 2 and "Authorization Violation" in bare.stderr
    admin = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="auth-test", auth=cluster.client_auth("admin"))
    try:
        planner = await admin.request(SVC_STATS, m.StatsRequest(), instance="planner", timeout=5.0)
        assert planner.counters["split.foreign"] >= 1
        router = await admin.request(SVC_STATS, m.StatsRequest(), instance="router", timeout=5.0)
        assert router.counters.get("invalid.split.commands", 0) >= 1  # the all-decode 10^15 command
        for inst in ("router", "planner", "kvdirectory", "worker-w0", "worker-w1"):
            st = await admin.request(SVC_STATS, m.StatsRequest(), instance=inst, timeout=5.0)
            assert st.counters.get("nats.errors", 0) == 0, (inst, st.counters)  # no permission the service needs is missing
    finally:
        await admin.close()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``evolving-infra ARGV`` without any EI_NATS_* credentials from the environment."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("EI_NATS")}
    return subprocess.run([sys.executable, "-m", "evolving_infra.cli", *argv], capture_output=True, text=True, timeout=60, env=env)


async def test_cli_tools_blame_the_credentials_not_the_planner(secured):
    """split set with an identity that may not publish split.set names the subject and the identity (not
    'no planner answered'), in one line; no credentials at all says how to give them; tap the same."""
    srv, creds = secured
    router = creds.files["router"]
    denied = await asyncio.to_thread(_cli, "split", "set", "2P0D", "--nats-url", srv.url, "--nats-creds", str(router), "--timeout", "1")
    assert denied.returncode == 2
    assert "identity 'router' permission to publish to ei.p0.split.set" in denied.stderr and "no planner" not in denied.stderr
    assert len(denied.stderr.strip().splitlines()) == 1, denied.stderr
    elsewhere = await asyncio.to_thread(
        _cli, "split", "get", "--partition", "nope", "--nats-url", srv.url, "--nats-creds", str(creds.files["operator"]), "--timeout", "1"
    )
    assert elsewhere.returncode == 2 and "publish to ei.nope.split.get" in elsewhere.stderr
    assert len(elsewhere.stderr.strip().splitlines()) == 1, elsewhere.stderr  # no structlog warning before it
    for argv in (["split", "get"], ["tap", "--max", "1"]):
        bare = await asyncio.to_thread(_cli, *argv, "--nats-url", srv.url, *(["--timeout", "1"] if argv[0] == "split" else []))
        assert bare.returncode == 2
        assert "requires credentials and none were given" in bare.stderr and "--nats-creds" in bare.stderr, bare.stderr
        assert "EI_NATS_CREDS" in bare.stderr and "split-cli" not in bare.stderr and len(bare.stderr.strip().splitlines()) == 1


async def test_tap_names_the_subjects_its_credentials_may_not_read(secured):
    """The server refuses a subscription outside an identity's permissions with an error the client only
    logs: tap with a service's credentials printed nothing, forever, as if the cluster were idle (it ran
    until killed). Now it is one line naming the identity and the refused subjects, and exit 2; the
    subjects it may read are not named."""
    srv, creds = secured

    def tap(creds_file: str, *subjects: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("EI_NATS")}
        return subprocess.run([sys.executable, "-m", "evolving_infra.cli", "tap", "--nats-url", srv.url, "--nats-creds", creds_file,
                               *subjects], capture_output=True, text=True, timeout=20, env=env)  # fmt: skip

    everything = await asyncio.to_thread(tap, str(creds.files["router"]))
    assert everything.returncode == 2, everything
    assert "identity 'router' permission to subscribe to ei.p0.>" in everything.stderr and not everything.stdout
    assert len(everything.stderr.strip().splitlines()) == 1, everything.stderr
    mixed = await asyncio.to_thread(tap, str(creds.files["worker-w0"]), "work.w0.prefill", "work.w1.prefill")
    assert mixed.returncode == 2, mixed
    assert "identity 'worker-w0' permission to subscribe to ei.p0.work.w1.prefill (" in mixed.stderr
    assert "work.w0.prefill" not in mixed.stderr and len(mixed.stderr.strip().splitlines()) == 1, mixed.stderr


async def test_a_worker_identity_cannot_end_a_stream_another_node_serves(tmp_path):
    """A compromised worker (here ``worker-w1``'s key) publishes finishing chunks in the name of the other node
    (``TokenChunk(node="w0", finished=True, finish_reason="stop")``) on a stream that node serves, one per
    ``attempt`` the request may have (the router's wall ms at its arrival), on the old shared subject
    (``req.<rid>.out``), on the other node's subject (``req.<rid>.out.w0``) and on its own with the other's
    name in the body (``req.<rid>.out.w1``); and ``worker-w0``'s key the same in ``w1``'s name, and, as the prefill
    node the request was handed off from, in its own name on its own subject (``req.<rid>.out.w0``, ``node="w0"``:
    before, the router took it, as the prefill node is one of the request's, and the stream ended after 7 of 200
    tokens; now it is dropped once the decode node's output came, ``chunks_prefill_after_handoff``). Before, every
    worker might publish ``req.*.out`` and the router took the body's ``node``: the client's stream ended with
    HTTP 200, ``stop``, after a few of its tokens. Now the server refuses the first two
    (each node publishes only its own ``req.*.out.<n>``) and the router drops the third (a body node that is
    not the subject's: ``invalid.req.{rid}.out.{node}``): the stream completes with all its tokens."""
    # a slow clock (0.1): the 200 tokens take seconds, so the forged chunks come while the stream runs
    spec = ClusterSpec(nodes=2, split="1P1D", profile="tiny", speedup=0.1, port=0, block_size=4, log_dir=str(tmp_path / "logs"), ready_timeout_s=90.0)
    async with LocalCluster(spec) as cluster:
        await _forge_chunks(cluster)


async def _forge_chunks(cluster: LocalCluster) -> None:
    rid, n_tokens = "victim-4", 200
    got: list[str] = []  # one per SSE event with a choice (a token or more)
    finish: list[str | None] = []
    usage: list[int] = []  # completion_tokens of the last event
    t0 = time.time_ns() // 1_000_000

    async def stream() -> None:
        body = {"prompt": list(range(1, 13)), "max_tokens": n_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with httpx.AsyncClient(timeout=120) as http, http.stream(
            "POST", cluster.router_url + "/v1/completions", json=body, headers={"X-Request-ID": rid}
        ) as r:
            assert r.status_code == 200, (await r.aread())[:300]
            async for line in r.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    event = json.loads(line[5:])
                    if event.get("usage"):
                        usage.append(event["usage"]["completion_tokens"])
                    for choice in event["choices"]:
                        got.append(choice["text"])
                        if choice.get("finish_reason"):
                            finish.append(choice["finish_reason"])

    client = asyncio.create_task(stream())
    for _ in range(400):
        if len(got) >= 5 or client.done():
            break
        await asyncio.sleep(0.05)
    assert 5 <= len(got) < n_tokens // 2, (len(got), "the stream must be running when the forged chunks come")
    t1 = time.time_ns() // 1_000_000
    rogues = {me: await Bus.connect(cluster.nats_url, Subjects("p0"), service="worker", instance=f"rogue-{me}", auth=cluster.client_auth(me))
              for me in ("worker-w1", "worker-w0")}  # fmt: skip
    try:
        for me, victim in (("worker-w1", "w0"), ("worker-w0", "w1")):
            nc = rogues[me].nc
            for attempt in range(t0 - 50, t1 + 50):
                forged = m.encode(m.TokenChunk(rid=rid, node=victim, index=5, finished=True, finish_reason="stop", attempt=attempt, router="router"))
                for subject in (f"ei.p0.req.{rid}.out", f"ei.p0.req.{rid}.out.{victim}", f"ei.p0.req.{rid}.out.{me[len('worker-'):]}"):
                    await nc.publish(subject, forged)
                if me == "worker-w0":  # the prefill node (1P1D: w0), in its own name on its own subject, after the hand-off
                    own = m.TokenChunk(rid=rid, node="w0", index=5, finished=True, finish_reason="stop", attempt=attempt, router="router")
                    await nc.publish(f"ei.p0.req.{rid}.out.w0", m.encode(own))
            await nc.flush()
        await asyncio.wait_for(client, 120)
    finally:
        for bus in rogues.values():
            await bus.close()
    assert finish == ["length"] and usage == [n_tokens], (finish, usage, len(got))
    admin = await Bus.connect(cluster.nats_url, Subjects("p0"), service="test", instance="auth-test-2", auth=cluster.client_auth("admin"))
    try:
        router = await admin.request(SVC_STATS, m.StatsRequest(), instance="router", timeout=5.0)
    finally:
        await admin.close()
    assert router.counters.get("invalid.req.{rid}.out.{node}", 0) >= 2 * (t1 - t0 + 100), router.counters
    assert router.counters.get("chunks_prefill_after_handoff", 0) >= 1, router.counters  # the request's own attempt
