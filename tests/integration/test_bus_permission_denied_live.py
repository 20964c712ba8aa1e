"""A request's :class:`PermissionDenied` (real nats-server; the server's "Permissions Violation" is handed to the
bus as nats-py hands it, through the client's ``error_cb``) is not reported for requests on that subject once
the permission is back: a later timeout there is a timeout, which callers retry."""

from __future__ import annotations

import asyncio

import pytest

from shared import messages as m
from shared.auth import generate
from shared.bus import Bus, BusError, PermissionDenied
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import ROUTE_BIND, SPLIT_GET, Subjects
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(30)

VIOLATION = "nats: permissions violation: Permissions Violation for Publish to \"ei.p0.route.bind.r\""


def _bind(rid: str) -> m.DecodeBindRequest:
    return m.DecodeBindRequest(rid=rid, prefill_node="w0", prompt_tokens=9, max_tokens=4)


async def test_a_timeout_after_the_permission_came_back_is_not_a_permission_denied(nats_url):
    """Request a is denied while in flight; the permissions are fixed (a server reload) and b, sent after the
    violation, gets its reply; c, sent then and still overlapping a, times out because its router does not
    answer. c's error is a plain timeout. Before, the violation stayed recorded while any request on the
    subject was in flight, and c raised PermissionDenied (a worker's route.bind: bind.denied, no retry)."""
    router = await Bus.connect(nats_url, Subjects("p0"), service="router", instance="r")
    worker = await Bus.connect(nats_url, Subjects("p0"), service="worker", instance="worker-w0")
    a = None
    try:

        async def answer(req: m.DecodeBindRequest, _s: str) -> m.DecodeBindReply | None:
            return m.DecodeBindReply(rid=req.rid, decode_node="w1") if req.rid == "b" else None  # a, c: no reply

        await router.serve(ROUTE_BIND, answer, router="r")
        await router.flush()  # the server has the router's SUB before the worker's request (see below)
        a = asyncio.create_task(worker.request(ROUTE_BIND, _bind("a"), timeout=1.0, router="r"))
        await until(lambda: worker._requesting, 5.0, "a in flight")
        await worker.nc._error_cb(Exception(VIOLATION))  # as nats-py reports the server's -ERR for a's publish
        assert (await worker.request(ROUTE_BIND, _bind("b"), timeout=2.0, router="r")).decode_node == "w1"
        with pytest.raises(BusError) as c:
            await worker.request(ROUTE_BIND, _bind("c"), timeout=0.3, router="r")
        assert not isinstance(c.value, PermissionDenied) and "TimeoutError" in str(c.value), repr(c.value)
        with pytest.raises(BusError):
            await a
        assert worker.counters["nats.permission_violations"] == 1
    finally:
        if a is not None:
            a.cancel()
            await asyncio.gather(a, return_exceptions=True)
        await worker.close()
        await router.close()


async def test_a_request_in_flight_when_the_violation_comes_is_permission_denied(nats_url):
    """Without a reply since, the violation is the error of the requests in flight on the subject."""
    router = await Bus.connect(nats_url, Subjects("p0"), service="router", instance="r")
    worker = await Bus.connect(nats_url, Subjects("p0"), service="worker", instance="worker-w0")
    try:

        async def silent(_req: m.DecodeBindRequest, _s: str) -> None:
            return None

        await router.serve(ROUTE_BIND, silent, router="r")
        # serve only queues the SUB on the router's connection; the server reads two connections apart, so without
        # this the worker's request could reach it first: NoResponders at once, and 'a in flight' never seen (under load)
        await router.flush()
        a = asyncio.create_task(worker.request(ROUTE_BIND, _bind("a"), timeout=0.5, router="r"))
        await until(lambda: worker._requesting, 5.0, "a in flight")
        await worker.nc._error_cb(Exception(VIOLATION))
        with pytest.raises(PermissionDenied):
            await a
        assert not worker._denied  # no request in flight on it: forgotten
    finally:
        await worker.close()
        await router.close()


async def test_a_denied_request_on_a_capitalised_partition_is_permission_denied(tmp_path):
    """A real nats-server with per-identity permissions (``auth gen``'s table) for partition ``P0``: the launcher
    may not publish ``split.get``, so the server answers the request's publish with -ERR 'Permissions Violation for
    Publish to "ei.P0.split.get"', which nats-py lowercases before the bus sees it. Before, the bus looked the
    lowercased subject up among its requests in flight (``ei.P0.split.get``), missed, and the request ended as a
    plain timeout (retried by callers); now it is :class:`PermissionDenied`, naming the subject in its own case."""
    creds = generate(tmp_path / "creds", ["launcher"], partition="P0")
    with EmbeddedNatsServer(auth_block=creds.server_block) as srv:
        bus = await Bus.connect(srv.url, Subjects("P0"), service="launcher", instance="launcher", auth=creds.auth_for("launcher"))
        try:
            with pytest.raises(PermissionDenied) as e:
                await bus.request(SPLIT_GET, m.SplitQuery(), timeout=1.0)
            assert "ei.P0.split.get" in str(e.value) and "identity 'launcher'" in str(e.value), str(e.value)
            assert bus.counters["nats.permission_violations"] == 1 and not bus._denied
        finally:
            await bus.close()
