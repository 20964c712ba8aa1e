"""The router's API-key guard (``ingress.IngressGuard``) on the ``Authorization`` headers of one request,
driven as ASGI (no socket): the live proof is ``tests/integration/test_router_ingress_live.py``."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from services.router.api import error_body
from services.router.ingress import IngressGuard


async def _call(guard: IngressGuard, headers: list[tuple[bytes, bytes]], path: str = "/v1/completions") -> tuple[int, dict[str, Any], dict[bytes, bytes]]:
    """One request through ``guard``: (status, JSON body or {}, response headers)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    await guard(scope, receive, send)
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], json.loads(body) if body.startswith(b"{") else {}, dict(start.get("headers", []))


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_two_authorization_headers_with_different_values_are_a_400_not_the_first_ones_key():
    """Only the first ``Authorization`` header was read: ``Bearer good`` then ``Bearer other`` was served as
    the first key's (200), while a proxy in front that takes the last one (or joins them) saw another
    identity: which credential counts was a guess, the request-smuggling class. Two different values are now
    a 400 naming the header, whatever their order or validity, counted as ``http.auth_header_repeated``, the
    connection closed; the same value twice (a proxy's copy) is one value, as the agent headers' rule
    (``api.parse_branch_headers``). Without keys the router reads no ``Authorization`` at all, and a
    public path needs none: both are served as before."""
    refused: list[tuple[int, str]] = []
    counters: Counter[str] = Counter()
    guard = IngressGuard(_ok, ["good", "other"], counters=counters, on_refused=lambda scope, status, msg: refused.append((status, msg)))
    good, other = (b"authorization", b"Bearer good"), (b"authorization", b"Bearer other")
    for headers in ([good, other], [other, good], [good, (b"authorization", b"Bearer nope")], [(b"authorization", b"Basic x"), good],
                    [good, (b"x-other", b"1"), (b"authorization", b"")]):
        status, body, head = await _call(guard, headers)
        assert status == 400, headers
        assert body["error"]["param"] == "Authorization" and "sent 2 times with different values" in body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error" and head[b"connection"] == b"close"
        assert body["error"]["code"] == 400  # the API's other 400s' shape (api.error_body), not "invalid_request"
        assert body == {"error": error_body(400, body["error"]["message"], "Authorization")["error"]}
    assert counters["http.auth_header_repeated"] == 5 and counters["http.unauthorized"] == 0
    assert [s for s, _ in refused] == [400] * 5
    assert guard.inflight == Counter()  # no key was charged a slot
    assert (await _call(guard, [good, good]))[0] == 200
    assert (await _call(guard, [good]))[0] == 200
    assert (await _call(guard, [(b"authorization", b"Bearer nope"), (b"authorization", b"Bearer nope")]))[0] == 401
    assert (await _call(guard, [good, other], path="/healthz"))[0] == 200  # public: not read
    open_guard = IngressGuard(_ok, [], counters=counters)
    assert (await _call(open_guard, [good, other]))[0] == 200  # no keys: not read
    assert counters["http.auth_header_repeated"] == 5


def test_a_key_id_is_a_salted_hmac_not_a_sha256_prefix_that_names_a_short_key(monkeypatch):
    """The id in the (world-readable) router log was the first 8 hex digits of the key's plain SHA-256: hashing
    candidates offline named a short or guessable key (``k1``: ``printf %s k1 | sha256sum``). It is an HMAC under a
    secret salt now: random per process, or the cluster's (``EI_API_KEY_ID_SALT``), the same id for the same salt."""
    import hashlib
    import hmac
    import re

    import pytest

    from services.router import ingress

    monkeypatch.setattr(ingress, "_key_id_salt", ingress._key_id_salt)  # put back after the test
    assert re.fullmatch(r"[0-9a-f]{8}", ingress.key_id("k1")) and ingress.key_id("k1") == ingress.key_id(b"k1")
    assert ingress.key_id("k1") != hashlib.sha256(b"k1").hexdigest()[:8]
    assert ingress.key_id("k1") != ingress.key_id("k2")
    ingress.set_key_id_salt("cluster-salt")
    assert ingress.key_id("k1") == hmac.new(b"cluster-salt", b"k1", hashlib.sha256).hexdigest()[:8]
    with pytest.raises(ValueError, match="cannot be empty"):
        ingress.set_key_id_salt("")


def test_the_readmes_key_id_recipe_gives_the_routers_id_with_the_salt_off_its_command_line(tmp_path, monkeypatch):
    """The README's recipe put the salt on openssl's command line (``-hmac "$(cat LOG_DIR/api-key-id.salt)"``), where
    ``ps`` shows it to every local user (reviewer rr-sec2). Its ``python3 -c`` line reads the key on stdin and the salt
    from the file ``up`` writes (``salt + "\\n"``); run as written, it gives :func:`key_id`'s id."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from services.router import ingress

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    recipes = re.findall(r"^printf %s \"\$KEY\" \| python3 -c '([^']+)' LOG_DIR/api-key-id\.salt$", readme, re.M)
    assert len(recipes) == 1, recipes
    assert "-hmac \"$(cat" not in readme  # the old recipe, salt on the command line
    salt_file = tmp_path / "api-key-id.salt"
    salt_file.write_text("0123456789abcdef0123456789abcdef\n")
    monkeypatch.setattr(ingress, "_key_id_salt", ingress._key_id_salt)  # put back after the test
    ingress.set_key_id_salt("0123456789abcdef0123456789abcdef")
    out = subprocess.run([sys.executable, "-c", recipes[0], str(salt_file)], input=b"k-ops", capture_output=True,
                         check=True, timeout=60).stdout.decode()  # fmt: skip
    assert out == ingress.key_id("k-ops") + "\n"


async def test_livez_is_public_by_default_as_the_readiness_paths_are():
    """``/livez`` (the router's liveness, 200 through a drain) is what a Kubernetes liveness probe reads, and a probe
    sends no key: with API keys on, the guard's default public paths and the router's ``--api-key-public-paths``
    default both hold it (a 401 there would read as dead and restart the router), and it is counted under its own
    ``endpoint`` label, not ``other``."""
    from services.router.config import RouterConfig
    from services.router.service import endpoint_label

    guard = IngressGuard(_ok, ["good"])
    assert (await _call(guard, [], path="/livez"))[0] == 200
    assert (await _call(guard, [], path="/v1/completions"))[0] == 401
    assert "/livez" in RouterConfig().api_key_public_paths
    assert endpoint_label("/livez") == "/livez"
