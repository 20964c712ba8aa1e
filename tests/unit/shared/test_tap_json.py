"""``evolving-infra tap --json``: one JSON object per message, traceparent included, bad input explained."""

from __future__ import annotations

import json

from evolving_infra.cli import build_parser
from evolving_infra.tap import render_json
from shared import messages as m
from shared.subjects import KV_LOOKUP, Subjects

S = Subjects("p0")
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_json_line_carries_type_fields_and_traceparent():
    data = m.encode(m.KvLookupRequest(block_hashes=list(range(20)), block_size=64))
    line = json.loads(render_json(S, S.format(KV_LOOKUP), data, {"traceparent": TP}))
    assert line["subject"] == "ei.p0.kv.lookup" and line["type"] == "KvLookupRequest" and line["traceparent"] == TP
    assert line["msg"]["block_size"] == 64 and line["msg"]["block_hashes"][-1] == "... +12"
    full = json.loads(render_json(S, S.format(KV_LOOKUP), data, None, full=True))
    assert full["msg"]["block_hashes"] == list(range(20)) and "traceparent" not in full


def test_json_line_for_malformed_and_unknown_subjects():
    bad = json.loads(render_json(S, "ei.p0.kv.lookup", b"\xc1"))
    assert bad["type"] is None and bad["error"].startswith("malformed kv.lookup") and bad["size"] == 1
    unknown = json.loads(render_json(S, "ei.p0.nope", b"x"))
    assert unknown["error"] == "unknown subject"


def test_tap_takes_json_and_subject_filters():
    args = build_parser().parse_args(["tap", "--json", "kv.lookup", "req.>"])
    assert args.json and args.subjects == ["kv.lookup", "req.>"]


def test_tap_max_below_zero_is_a_usage_error(capsys):
    """--max -1 once stopped after one message (count >= -1); now exit 2 before connecting to anything."""
    from evolving_infra.cli import main

    assert main(["tap", "--max", "-1", "--nats-url", "nats://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "--max must be a count of messages >= 0" in err and len(err.strip().splitlines()) == 1
