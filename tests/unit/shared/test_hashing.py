import hashlib

import numpy as np
import pytest

from shared.hashing import (
    block_hashes,
    pack_tokens,
    tokens_for_blocks,
    tokens_for_tail,
    unpack_tokens,
)


def _sglang_get_hash_str(token_ids, prior_hash=None):
    # Independent re-statement of sglang's get_hash_str / hash_str_to_int64.
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def _to_int64(hex_digest):
    u = int(hex_digest[:16], 16)
    return u - 2**64 if u >= 2**63 else u


def test_block_hashes_match_sglang_scheme():
    toks = [int(x) for x in np.random.default_rng(1).integers(0, 150_000, size=3 * 16 + 5)]
    prior = None
    expected = []
    for i in range(3):
        prior = _sglang_get_hash_str(toks[i * 16 : (i + 1) * 16], prior)
        expected.append(_to_int64(prior))
    assert block_hashes(toks, 16) == expected  # the 5-token tail is not hashed


def test_hash_is_prefix_chained():
    a = block_hashes(list(range(64)), 16)
    b = block_hashes(list(range(48)) + [7] * 16, 16)
    assert a[:3] == b[:3] and a[3] != b[3]


def test_pack_roundtrip_and_errors():
    arr = np.array([0, 1, 2**32 - 1], dtype=np.uint64)
    assert unpack_tokens(pack_tokens(arr)).tolist() == [0, 1, 2**32 - 1]
    with pytest.raises(ValueError):
        pack_tokens([-1])
    with pytest.raises(ValueError):
        unpack_tokens(b"abc")
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


def test_block_tokens_deterministic_and_distinct():
    a = tokens_for_blocks([5, 6], 64)
    assert a.shape == (128,)
    assert np.array_equal(a, tokens_for_blocks([5, 6], 64))
    assert np.array_equal(a[:64], tokens_for_blocks([5], 64))
    assert not np.array_equal(a[:64], a[64:])
    assert np.array_equal(tokens_for_tail("r1", 10), tokens_for_tail("r1", 10))
    assert not np.array_equal(tokens_for_tail("r1", 10), tokens_for_tail("r2", 10))
