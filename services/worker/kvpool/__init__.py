"""Real-bytes host KV pool (issue 6 part 2): L2 blocks with real payloads in a
Mooncake-registered host buffer, located over NATS (``kv.pool.<node>``) and
pulled by peers with Mooncake's transfer engine over TCP, checksum-verified.

Importing this package never imports Mooncake; :class:`HostKvPool` (module
``pool``) and :class:`MooncakeEndpoint` (module ``transport``) load it on
construction and raise :class:`MooncakeUnavailable` naming
``scripts/install-mooncake.sh`` when it is missing. See README.md.
"""

from services.worker.kvpool.buffer import DEFAULT_CPU_SLOT_BYTES, HostKvBuffer, PoolFull
from services.worker.kvpool.payload import checksum, expected_checksum, fill_payload, payload
from services.worker.kvpool.pool import FetchResult, HostKvPool
from services.worker.kvpool.transport import (
    MooncakeEndpoint,
    MooncakeUnavailable,
    TransferError,
    load_mooncake,
    mooncake_available,
)

__all__ = [
    "DEFAULT_CPU_SLOT_BYTES",
    "FetchResult",
    "HostKvBuffer",
    "HostKvPool",
    "MooncakeEndpoint",
    "MooncakeUnavailable",
    "PoolFull",
    "TransferError",
    "checksum",
    "expected_checksum",
    "fill_payload",
    "load_mooncake",
    "mooncake_available",
    "payload",
]
