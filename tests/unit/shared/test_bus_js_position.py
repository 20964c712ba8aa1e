"""``shared.bus.js_position``: a subscription's (stream sequence, consumer) of a JetStream delivery, read from the
reply subject without nats-py's ``Msg.metadata`` objects, gives what that property gives, for both reply forms, and
``(0, "")`` where the property raises (what the subscription used when it did)."""

from __future__ import annotations

from nats.aio.msg import Msg

from shared.bus import js_position


def _nats_py(reply: str) -> tuple[int, str]:
    msg = Msg(_client=None, subject="ei.p0.req.r1.out.w0", reply=reply)  # type: ignore[arg-type]
    try:
        meta = msg.metadata
        return meta.sequence.stream, meta.consumer
    except Exception:
        return 0, ""


REPLIES = [
    "$JS.ACK.EI_p0.cons1.1.42.7.1733580000000000000.3",  # no domain: 9 tokens
    "$JS.ACK.EI_p0.Zx9_ordered.2.1000000.999.1733580000000000000.0",
    "$JS.ACK.hub.ACCHASH.EI_p0.cons2.1.77.5.1733580000000000000.0.rnd",  # domain and account hash: 12 tokens
    "$JS.ACK._.ACCHASH.EI_p0.cons3.1.78.6.1733580000000000000.0",  # 11 tokens
    "$JS.ACK.EI_p0.cons1.1.x.7.1733580000000000000.3",  # a sequence that is no number
    "$JS.ACK.EI_p0.cons1.1.42.7.1733580000000000000",  # 8 tokens
    "$JS.ACK.a.b.c.d.1.2.3.4",  # 10 tokens
    "$JS.NAK.EI_p0.cons1.1.42.7.1733580000000000000.3",
    "_INBOX.router.abc",
    "",
]


def test_js_position_reads_what_nats_py_metadata_reads() -> None:
    for reply in REPLIES:
        msg = Msg(_client=None, subject="ei.p0.req.r1.out.w0", reply=reply)  # type: ignore[arg-type]
        assert js_position(msg) == _nats_py(reply), reply
    assert js_position(Msg(_client=None, reply=REPLIES[0])) == (42, "cons1")  # type: ignore[arg-type]
    assert js_position(Msg(_client=None, reply=REPLIES[2])) == (77, "cons2")  # type: ignore[arg-type]
