"""Block identity shared by router, directory and engines (DESIGN §5a).

SGLang's page hash: for page *i* of a sequence, ``digest_i = SHA-256(digest_{i-1}
‖ tokens_i as little-endian uint32)`` with no prefix for the first page; the
event hash is the first 8 bytes of ``digest_i`` read big-endian as a signed
int64 (``hash_str_to_int64`` in sglang's HiCache storage). Only full pages are
hashed, so ``len(block_hashes(t, p)) == len(t) // p``.

Traces that carry block ids instead of tokens are turned into deterministic
token ids per block id (:func:`tokens_for_block`), so equal prefixes give equal
tokens and therefore equal hashes in every component.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
else:  # imported on first use (shared.lazy_numpy): a run that calls no numpy pays no import
    from shared.lazy_numpy import np

SIM_VOCAB_SIZE = 100_000
"""Token ids produced for trace blocks and by the sim engine lie in [0, SIM_VOCAB_SIZE)."""


def pack_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes (the wire and hashing layout).

    Raises:
        ValueError: if a token id is negative or does not fit in uint32.
    """
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def unpack_tokens(data: bytes) -> np.ndarray:
    """Inverse of :func:`pack_tokens` (uint32 array).

    Raises:
        ValueError: if ``len(data)`` is not a multiple of 4.
    """
    if len(data) % 4:
        raise ValueError(f"packed token bytes must be a multiple of 4, got {len(data)}")
    return np.frombuffer(data, dtype="<u4")


def block_hashes_packed(packed: bytes, block_size: int, parent_digest: bytes = b"") -> list[int]:
    """Chained page hashes of packed uint32 tokens; only full pages are hashed.

    Args:
        packed: tokens as little-endian uint32 bytes.
        block_size: tokens per page (> 0).
        parent_digest: 32-byte digest of the page before the first one, if any.

    Returns:
        One signed int64 per full page, in order.

    Raises:
        ValueError: if ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    step = 4 * block_size
    n = len(packed) // step
    out: list[int] = []
    prev = parent_digest
    import hashlib  # here, not at module level: its OpenSSL binding costs ~3 ms to import, which the simulator never uses

    sha = hashlib.sha256
    from_bytes = int.from_bytes
    mv = memoryview(packed)
    for i in range(n):
        prev = sha(prev + mv[i * step : (i + 1) * step]).digest() if prev else sha(mv[i * step : (i + 1) * step]).digest()
        out.append(from_bytes(prev[:8], "big", signed=True))
    return out


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Chained SGLang page hashes of a token sequence (see module docstring)."""
    return block_hashes_packed(pack_tokens(token_ids), block_size)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    z = x
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def tokens_for_block(block_id: int, block_size: int) -> np.ndarray:
    """Deterministic token ids of a trace block id (uint32, length ``block_size``)."""
    return tokens_for_blocks([block_id], block_size)


def tokens_for_blocks(block_ids: Sequence[int], block_size: int) -> np.ndarray:
    """Deterministic token ids for a sequence of trace block ids, concatenated.

    Token ``j`` of block ``b`` is ``splitmix64(b * 2**16 + j) mod SIM_VOCAB_SIZE``:
    the same block id always yields the same tokens, different ids differ.
    """
    ids = np.asarray(block_ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        grid = (ids[:, None] << np.uint64(16)) + np.arange(block_size, dtype=np.uint64)[None, :]
        toks = _splitmix64(grid.reshape(-1)) % np.uint64(SIM_VOCAB_SIZE)
    return toks.astype(np.uint32)


def tokens_for_tail(key: str, n: int) -> np.ndarray:
    """Deterministic token ids for a partial last block that belongs to one request only."""
    import hashlib

    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:6], "big")
    with np.errstate(over="ignore"):
        grid = np.uint64(seed) * np.uint64(1 << 16) + np.arange(n, dtype=np.uint64) + np.uint64(1 << 62)
        return (_splitmix64(grid) % np.uint64(SIM_VOCAB_SIZE)).astype(np.uint32)
