"""Every subject of ``shared.subjects.ALL``, published correctly, reaches the services' handlers
(real nats-server): ``Bus.subscribe`` and ``Bus.serve`` drop a message whose subject is not the
subscription's (``wrong_subject``) and a request whose reply is not an inbox (``bad_reply``); a
false drop there would lose traffic silently. Covered: the wildcard template and the filled one,
a queue group, core and JetStream (named one-filter consumers, ``kv.events.*`` and ``req.*.out.*``
included), a partition other than ``p0``, and with credentials (each identity on the subjects its
permissions let it read, its requests' replies under ``_INBOX.<identity>.``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from evolving_infra.hostile import samples
from shared import messages as m
from shared.auth import allowed, generate, permissions, identity
from shared.bus import Bus, stream_name
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import ALL, Subjects

NAMES = ["planner", "router", "kvdirectory", "worker-w0", "worker-w1"]


async def _subscribe_all(bus: Bus, got: Counter[str], may: Any, may_consume: Any) -> list[str]:
    """Subscribe ``bus`` to every subject ``may(full_subject)`` lets it read, every way the services do
    (a reliable one through a JetStream consumer where ``may_consume(full_subject)``, else core only).

    Returns the keys expected in ``got`` (``<template> <how>``), one delivery each."""
    expect: list[str] = []
    sample = samples()

    def handler(key: str) -> Any:
        async def on(_msg: Any, _subject: str) -> None:
            got[key] += 1

        return on

    def server(key: str) -> Any:
        async def on(_msg: Any, _subject: str) -> m.Msg | None:
            got[key] += 1
            return None

        return on

    for s in ALL:
        params = sample[s.template][0]
        ways: list[tuple[str, dict[str, Any]]] = []
        wild, filled = bus.subjects.wildcard(s), bus.subjects.format(s, **params)
        if may(wild):
            ways += [("queue", {"queue": "q"})]
            if s.reliable:
                ways.append(("core", {"reliable": False}))
            if not s.reliable or may_consume(wild):
                ways.append(("wildcard", {}))
        if s.params and may(filled) and (not s.reliable or may_consume(filled)):
            ways.append(("filled", dict(params)))
        for how, kw in ways:
            key = f"{s.template} {how}"
            if s.reply_type is not None:
                await bus.serve(s, server(key), **kw)
            else:
                await bus.subscribe(s, handler(key), **kw)
            expect.append(key)
    await bus.flush()  # not nc.flush(): its PING can overtake the SUBs still queued (a core-only identity lost all)
    return expect


async def _publish_all(pub: Bus) -> None:
    """Publish the sample of every subject as the services do; a request subject also as a request
    (nats-py's inbox: ``_INBOX.<id>`` or, with credentials, ``_INBOX.<identity>.<id>``)."""
    sample = samples()
    for s in ALL:
        params, msg = sample[s.template]
        if s.reply_type is not None:
            full = pub.subjects.format(s, **params)
            await pub.nc.publish(full, m.encode(msg), reply=pub.nc.new_inbox())
        else:
            await pub.publish(s, msg, **params)
    await pub.flush()


async def _wait_for(got: Counter[str], expect: list[str]) -> None:
    for _ in range(200):
        if all(got[k] >= 1 for k in expect):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # a second copy would show here


async def _stream_settled(bus: Bus, messages: int) -> None:
    """Return once the partition's stream has stored ``messages`` messages (10 s at most)."""
    js = bus.nc.jetstream(timeout=5.0)
    for _ in range(200):
        if (info := await js.stream_info(stream_name(bus.subjects))).state.last_seq >= messages:
            assert info.state.last_seq == messages, (info.state.last_seq, messages)
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the stream stored {info.state.last_seq} of {messages} messages")


@pytest.mark.timeout(120)
async def test_every_subject_published_correctly_is_delivered_once_on_every_kind_of_subscription():
    with EmbeddedNatsServer() as srv:
        subj = Subjects("p7")
        pub = await Bus.connect(srv.url, subj, service="worker", instance="worker-w0")
        sub = await Bus.connect(srv.url, subj, service="router", instance="router")
        got: Counter[str] = Counter()
        try:
            expect = await _subscribe_all(sub, got, lambda _s: True, lambda _s: True)
            assert sub.jetstream
            await _publish_all(pub)
            await _wait_for(got, expect)
            assert {k: got[k] for k in expect} == dict.fromkeys(expect, 1)
            assert not [k for k in sub.counters if k.startswith(("dropped.", "wrong_subject.", "bad_reply."))], sub.counters
            # every reliable subject had its named one-filter consumer (wildcard and filled)
            names = [c.name for c in await sub.nc.jetstream().consumers_info("EI_p7")]
            assert len(names) == sum(2 if s.params else 1 for s in ALL if s.reliable) and all(n.startswith("router_") for n in names)
        finally:
            await pub.close()
            await sub.close()


@pytest.mark.timeout(120)
async def test_every_identity_gets_every_subject_it_may_read_under_credentials(tmp_path):
    creds = generate(tmp_path / "creds", NAMES)
    with EmbeddedNatsServer(auth_block=creds.server_block) as srv:
        subj = Subjects("p0")
        launcher = await Bus.connect(srv.url, subj, service="launcher", instance="launcher", auth=creds.auth_for("launcher"))
        assert await launcher.ensure_stream()  # only the launcher may create it
        admin = await Bus.connect(srv.url, subj, service="admin", instance="admin", auth=creds.auth_for("admin"))
        buses: list[Bus] = [launcher, admin]
        reliable, published = sum(1 for s in ALL if s.reliable and s.reply_type is None), 0
        try:
            for name in ["router", "kvdirectory", "worker-w0", "planner"]:
                ident = identity(name)
                bus = await Bus.connect(srv.url, subj, service=ident.kind, instance=name, auth=creds.auth_for(name))
                buses.append(bus)
                perms = permissions(ident, "p0")
                got: Counter[str] = Counter()
                expect = await _subscribe_all(
                    bus, got, lambda s, p=perms: allowed(p, "subscribe", s),
                    lambda s, p=perms: allowed(p, "publish", f"$JS.API.CONSUMER.CREATE.EI_p0.c.{s}"),
                )
                assert expect, name
                await _publish_all(admin)
                published += 1
                await _wait_for(got, expect)
                assert {k: got[k] for k in expect} == dict.fromkeys(expect, 1), name
                # the stream stores core publishes a moment after they are sent: the next identity's
                # consumers start after the stream's last message, so that must be this round's last
                await _stream_settled(launcher, published * reliable)
                assert not [k for k in bus.counters if k.startswith(("dropped.", "wrong_subject.", "bad_reply."))], (name, bus.counters)
                assert bus.counters["nats.permission_violations"] == 0, name
                await bus.close()
                buses.remove(bus)
        finally:
            for b in buses:
                await b.close()
