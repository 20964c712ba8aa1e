"""The compose ``nats`` service keeps its JetStream store on a named volume, so the partition's stream outlives the container.

Under NATS credentials only the launcher may make the partition's stream, and compose's one-shot ``stream``
job makes it once. The store was in the nats container's own filesystem: a recreated container (``up`` after
a config change, an image update, ``up --force-recreate nats``) came back without the stream, and every
service waited and warned ("the stream is not there yet", a821ec1 / a1c6e58) until someone ran
``docker compose run stream``. The store directory (entrypoint.sh's ``store_dir`` under nkeys, ``-sd`` with
auth off) is now the named volume ``nats-store``; the image makes that directory the ``ei`` user's, which a
fresh named volume takes (a mount point missing from the image would be root's, and nats-server, run as
``ei``, could not write its store).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _store_dirs() -> set[str]:
    """The JetStream store directories entrypoint.sh gives nats-server (its nkeys config and its auth-off flags)."""
    text = (REPO / "deploy" / "docker" / "entrypoint.sh").read_text()
    conf = re.findall(r'store_dir: \\?"([^"\\]+)\\?"', text)
    flag = re.findall(r"nats-server [^\n]*-sd (\S+)", text)
    assert conf and flag, "entrypoint.sh: no store_dir in nats.conf or no -sd for the auth-off server"
    return set(conf) | set(flag)


def test_the_nats_store_is_one_directory_in_both_auth_modes():
    assert len(_store_dirs()) == 1, _store_dirs()


def test_the_nats_service_keeps_its_jetstream_store_on_a_named_volume():
    (store,) = _store_dirs()
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = [str(v).split(":") for v in compose["services"]["nats"].get("volumes", [])]
    on_store = [m for m in mounts if len(m) >= 2 and m[1] == store]
    assert on_store, f"nats: nothing mounted at its JetStream store {store}: a recreated container loses the stream"
    (source, _, *mode) = on_store[0]
    assert source in (compose.get("volumes") or {}), f"nats: {source!r} at {store} is not a named volume of the file"
    assert "ro" not in mode, "nats: the JetStream store must be writable"


def test_the_image_makes_the_store_directory_the_ei_user_s():
    (store,) = _store_dirs()
    text = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    made = re.search(rf"install -d -o ei\b[^\n]*\s{re.escape(store)}\b", text) or re.search(
        rf"chown[^\n]*\bei\b[^\n]*\s{re.escape(store)}\b", text
    )
    assert made, f"Dockerfile: {store} is not made the ei user's (a fresh named volume there would be root's)"
    assert text.index(made.group(0)) < text.index("USER ei"), "Dockerfile: the store directory is made after USER ei"
