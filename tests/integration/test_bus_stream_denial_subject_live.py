"""A permission violation the server reports while the bus looks the stream up (or creates it) counts as a refusal of
the stream only when it names the stream API subject. Before, any violation in that window did (a count compared):
an unrelated one (a heartbeat subject this identity may not publish, say) made ``up``'s launcher exit 2 naming
``$JS.API.STREAM.INFO.EI_p0``, which it was never refused, a service fall back to core NATS for good, and a
reconnect's lookup give up and drop the reliable publishes it held.

The violation goes through the bus's own error callback (nats-py's ``_error_cb``, as nats-py calls it for the
server's ``-ERR``) while the first lookup is in flight, then that lookup times out; later ones reach the server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest

from shared.bus import Bus, PermissionDenied
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def _bus() -> AsyncIterator[Bus]:
    """A bus (partition ``p0``, no auth) on a fresh nats-server; closed, and the server stopped, on the way out."""
    with EmbeddedNatsServer() as srv:
        bus = await Bus.connect(srv.url, Subjects("p0"), service="test", instance="test-denial")
        try:
            yield bus
        finally:
            await bus.close()


def _deny_during_first_lookup(bus: Bus, subject: str, call: str = "stream_info") -> list[Any]:
    """Make the bus's first stream lookup (``call``: or its first create, ``add_stream``) meet a permission violation
    on ``subject`` and time out; returns the calls made (the later ones reach the server)."""
    real = bus.nc.jetstream
    lookups: list[Any] = []

    class _JS:
        def __init__(self, js: Any) -> None:
            self._js = js

        def __getattr__(self, name: str) -> Any:
            if name != call:
                return getattr(self._js, name)

            async def first_denied(*a: Any, **kw: Any) -> Any:
                lookups.append(a)
                if len(lookups) == 1:
                    await bus.nc._error_cb(nats.errors.Error(f"nats: permissions violation for publish to \"{subject}\""))
                    raise asyncio.TimeoutError
                return await getattr(self._js, name)(*a, **kw)

            return first_denied

    bus.nc.jetstream = lambda **kw: _JS(real(**kw))  # type: ignore[method-assign]
    return lookups


@pytest.mark.parametrize("maker", [True, False])
async def test_an_unrelated_denial_during_the_start_lookup_is_not_a_stream_denial(maker):
    async with _bus() as bus:
        lookups = _deny_during_first_lookup(bus, "ei.p0.svc.heartbeat.test")
        assert await asyncio.wait_for(bus.ensure_stream(maker=maker), 10.0) is True
        assert bus.jetstream and len(lookups) >= 2 and bus.counters["nats.permission_violations"] == 1


async def test_an_unrelated_denial_during_the_launchers_create_is_not_a_stream_denial():
    async with _bus() as bus:
        creates = _deny_during_first_lookup(bus, "ei.p0.svc.heartbeat.test", call="add_stream")
        assert await asyncio.wait_for(bus.ensure_stream(maker=True), 10.0) is True
        assert bus.jetstream and len(creates) == 2


async def test_the_stream_lookup_denied_still_raises_for_the_launcher():
    async with _bus() as bus:
        _deny_during_first_lookup(bus, "$js.api.stream.info.ei_p0")  # nats-py lowercases the server's text
        with pytest.raises(PermissionDenied, match=r"\$JS\.API\.STREAM\.INFO\.EI_p0"):
            await asyncio.wait_for(bus.ensure_stream(maker=True), 10.0)


async def test_an_unrelated_denial_during_the_reconnect_lookup_does_not_give_it_up():
    async with _bus() as bus:
        assert await bus.ensure_stream() is True
        lookups = _deny_during_first_lookup(bus, "ei.p0.svc.heartbeat.test")
        info = await asyncio.wait_for(bus._stream_after_reconnect(lambda: True), 10.0)
        assert info is not None and info.config.name == "EI_p0" and len(lookups) == 2


async def test_denials_of_other_subjects_are_not_kept_one_entry_each():
    """The per-subject count of denials (8060459) is only read for the stream API subjects: a steady stream of
    denials on other subjects (a per-request subject this identity may not publish) must not grow it. Before, each
    distinct denied subject stayed in ``Bus._publish_denials`` for the life of the process (1,000 denials: 1,000
    entries)."""
    async with _bus() as bus:
        for i in range(1000):
            await bus.nc._error_cb(nats.errors.Error(f"nats: permissions violation for publish to \"ei.p0.req.out.r{i}\""))
        await bus.nc._error_cb(nats.errors.Error("nats: permissions violation for publish to \"$JS.API.STREAM.INFO.EI_p0\""))
        assert bus.counters["nats.permission_violations"] == 1001
        assert bus._stream_api_denials("INFO") == 1 and bus._stream_api_denials("CREATE") == 0
        assert len(bus._publish_denials) <= 2, len(bus._publish_denials)
