""":func:`shared.bus.no_jetstream`: which errors of the stream lookup say the server has no JetStream (fall back to
core NATS) and which only say it did not answer in time (look again). nats-py's own exception objects, as it
raises them: a nats-server started without ``-js`` answers the lookup with a bare ``ServiceUnavailableError``
(no responders), measured."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors as jse

from shared.bus import no_jetstream


def test_no_responders_and_jetstream_not_enabled_mean_no_jetstream():
    assert no_jetstream(jse.ServiceUnavailableError())  # nats-py's "no responders" on a JetStream API request
    assert no_jetstream(nats.errors.NoRespondersError())
    assert no_jetstream(jse.ServiceUnavailableError(code=503, err_code=10076, description="JetStream not enabled"))
    assert no_jetstream(jse.ServiceUnavailableError(code=503, err_code=10039, description="jetstream not enabled for account"))


def test_a_timeout_or_a_jetstream_that_is_not_ready_is_not_no_jetstream():
    assert not no_jetstream(nats.errors.TimeoutError())
    assert not no_jetstream(asyncio.TimeoutError())
    assert not no_jetstream(nats.errors.ConnectionClosedError())
    assert not no_jetstream(jse.ServiceUnavailableError(code=503, err_code=10008, description="JetStream system temporarily unavailable"))
    assert not no_jetstream(jse.NotFoundError(code=404, err_code=10059, description="stream not found"))
