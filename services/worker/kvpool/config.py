"""Settings of the real-bytes KV pool and its geometry from a hardware profile.

``KvPoolSettings`` lists the fields a worker needs for ``--kv-pool real``;
``services/worker/config.py`` can copy them into ``WorkerConfig`` verbatim
(every one has a default, so existing configs stay valid).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from services.worker.kvpool.buffer import DEFAULT_CPU_SLOT_BYTES, MIN_SLOT_BYTES
from services.worker.kvpool.transport import PORT_MAX, PORT_MIN
from shared.profile import Profile

DEFAULT_MAX_POOL_BYTES = 1 << 30
"""Largest pool a worker allocates unless told otherwise (1 GiB; CPU boxes)."""


class KvPoolSettings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Real-bytes host KV pool options of one worker (all default to "off")."""

    kv_pool: Annotated[
        Literal["off", "real"],
        Meta(description="off = L2 is bookkeeping only (sim); real = every L2 block has a payload in a "
        "Mooncake-registered host buffer and peers pull it over TCP (needs scripts/install-mooncake.sh)"),
    ] = "off"
    kv_pool_slot_bytes: Annotated[
        int, Meta(ge=0, description="bytes per block slot; 0 = min(profile block bytes, 64 KiB)")
    ] = 0
    kv_pool_max_bytes: Annotated[
        int, Meta(gt=0, description="refuse to start when host_blocks × slot bytes exceeds this")
    ] = DEFAULT_MAX_POOL_BYTES
    kv_pool_host: Annotated[
        str, Meta(description="address peers reach this worker's transfer engine on (its session host)")
    ] = "127.0.0.1"
    kv_pool_ports: Annotated[
        str, Meta(description="Mooncake RPC+TCP port range 'lo-hi' within 1024-32767 (>= 2 ports; give 32, as up does: "
        "with 2 a process SIGKILLed while a peer read from it cannot start again, its ports in TIME_WAIT); "
        "empty = Mooncake's 15000-17000")
    ] = ""
    kv_pool_lease_s: Annotated[
        float, Meta(ge=0, description="wall seconds a holder keeps located slots from reuse")
    ] = 5.0
    kv_pool_locate_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds to wait for a peer's answer to a locate (kv.pool.<peer>)")
    ] = 2.0
    kv_pool_fetch_timeout_s: Annotated[
        float,
        Meta(gt=0, description="wall seconds a Mooncake read from a peer may take; past it the fetch fails "
             "(reason timeout) and the request recomputes the missing pages"),
    ] = 10.0


def parse_port_range(text: str) -> tuple[int, int] | None:
    """``"lo-hi"`` → ``(lo, hi)``; empty → None.

    Raises:
        ValueError: malformed, outside 1024–32767, or fewer than 2 ports.
    """
    if not text:
        return None
    try:
        lo_s, hi_s = text.split("-", 1)
        lo, hi = int(lo_s), int(hi_s)
    except ValueError as e:
        raise ValueError(f"port range {text!r} must look like 21000-21001") from e
    if not (PORT_MIN <= lo < hi <= PORT_MAX):
        raise ValueError(f"port range {text!r} must satisfy {PORT_MIN} <= lo < hi <= {PORT_MAX}")
    return lo, hi


def pool_geometry(profile: Profile, slot_bytes: int = 0, max_pool_bytes: int = DEFAULT_MAX_POOL_BYTES) -> tuple[int, int]:
    """``(num_slots, slot_bytes)`` for a worker whose pool mirrors its whole L2.

    ``num_slots = profile.host_blocks``; ``slot_bytes`` is the given size, or
    ``min(block_size × kv_bytes_per_token, 64 KiB)`` when 0.

    Raises:
        ValueError: slot smaller than 64 B, or the pool would exceed ``max_pool_bytes``
            (e.g. gb300-glm52: 128,750 host blocks × 64 KiB = 7.9 GiB).
    """
    real = profile.block_size * profile.kv_bytes_per_token
    sb = slot_bytes or min(real, DEFAULT_CPU_SLOT_BYTES)
    if sb < MIN_SLOT_BYTES:
        raise ValueError(f"slot bytes {sb} < {MIN_SLOT_BYTES}")
    slots = profile.host_blocks
    total = slots * sb
    if total > max_pool_bytes:
        raise ValueError(
            f"real-bytes pool of {slots} host blocks × {sb} B = {total / 2**30:.2f} GiB exceeds "
            f"kv_pool_max_bytes = {max_pool_bytes / 2**30:.2f} GiB; lower kv_pool_slot_bytes or raise the limit"
        )
    return slots, sb
