"""``shared.service.Readiness``: the reason a service's ``/readyz`` gives, from its bus's state and ``ready()``
(the live check, a real nats-server killed and restarted: ``tests/integration/test_service_readiness_live.py``)."""

from __future__ import annotations

from types import SimpleNamespace

from shared.service import Readiness


def _bus(connected: bool = True, waiting: str = "", no_jetstream: str = "", lacking: str = "") -> SimpleNamespace:
    return SimpleNamespace(nc=SimpleNamespace(is_connected=connected), stream_waiting=waiting, jetstream_missing=no_jetstream,
                           stream_lacking=lacking)


def test_a_served_service_is_not_ready_while_its_bus_is_disconnected_or_waits_for_the_stream():
    r = Readiness("nats://planner:s3cret@nats:4222")
    r.bus, r.ready, r.phase = _bus(), lambda: True, "serving"
    assert r.reason() is None
    r.bus = _bus(connected=False)
    assert r.reason() == "not connected to NATS at nats://planner:***@nats:4222 (reconnecting)"  # no secret shown
    r.bus = _bus(waiting="EI_p0")  # back, on a server that lost its store
    assert r.reason() == "waiting for the JetStream stream EI_p0"
    r.bus = _bus(no_jetstream="EI_p0")  # back, on a server restarted without JetStream
    assert r.reason() == "the NATS server at nats://planner:***@nats:4222 has no JetStream (stream EI_p0): reliable messages wait for it"
    r.bus = _bus()
    assert r.reason() is None
    r.ready = lambda: False
    assert r.reason() == "not ready"


def test_start_and_stop_are_not_ready():
    r = Readiness("nats://nats:4222")
    assert r.reason() == "connecting to NATS at nats://nats:4222"  # no bus yet: the health port opens before the connect
    r.bus = _bus()
    assert r.reason() == "starting"
    r.bus = _bus(waiting="EI_p0")
    assert r.reason() == "waiting for the JetStream stream EI_p0"
    r.bus, r.phase = _bus(), "serving"
    assert r.reason() is None  # no ready(): ready once started
    r.phase = "stopping"
    assert r.reason() == "stopping"
    r.bus = _bus(connected=False)  # the bus closing is the stop, not an outage
    assert r.reason() == "stopping"


def test_every_reason_has_a_kind_from_the_fixed_set_the_metric_labels_with():
    """``ei_service_ready``'s ``reason`` label is the state's kind, one of ``READY_REASONS`` whatever the URL or
    stream (a free-text label would make a series per URL); a kind outside the set is refused."""
    import pytest

    from shared.metrics import READY_REASONS, ready_family

    r = Readiness("nats://planner:s3cret@nats:4222")
    seen = {r.state()[0]}
    for bus, phase, ready in [
        (_bus(), "starting", None), (_bus(connected=False), "serving", None), (_bus(no_jetstream="EI_p0"), "serving", None),
        (_bus(waiting="EI_p9"), "serving", None), (_bus(), "serving", lambda: False), (_bus(), "stopping", None),
    ]:
        r.bus, r.phase, r.ready = bus, phase, ready
        kind, reason = r.state()
        assert reason == r.reason() and "s3cret" not in reason
        seen.add(kind)
    assert seen == set(READY_REASONS)
    r.ready = lambda: True
    r.phase = "serving"
    assert r.state() is None
    assert [(s.labels, s.value) for s in ready_family(None).samples] == [({"reason": ""}, 1.0)]
    assert [(s.labels, s.value) for s in ready_family(("stream", "waiting for the JetStream stream EI_p9")).samples] == [({"reason": "stream"}, 0.0)]
    with pytest.raises(ValueError, match="not one of"):
        ready_family(("waiting for the JetStream stream EI_p9", "x"))
