"""Content digests (streampack/digests.py): one range's digest is SHA-256 of its bytes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from streampack.digests import DIGEST_BYTES, range_digests


def _by_hand(tokens: np.ndarray, lo: int, hi: int, mask: np.ndarray | None) -> bytes:
    data = tokens[lo:hi].astype(tokens.dtype.newbyteorder("<")).tobytes()
    if mask is not None:
        data += mask[lo:hi].tobytes()
    return hashlib.sha256(data).digest()[:DIGEST_BYTES]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
@pytest.mark.parametrize("masked", [False, True])
def test_each_range_digest_is_the_truncated_sha256_of_its_tokens_then_its_mask(dtype, masked):
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 60000, 300).astype(dtype)
    mask = rng.integers(0, 2, 300).astype(np.uint8) if masked else None
    offsets = np.array([0, 5, 5, 130, 299, 300])
    got = range_digests(tokens, offsets, mask)
    assert got.shape == (5, DIGEST_BYTES) and got.dtype == np.uint8
    for i in range(5):
        assert bytes(got[i]) == _by_hand(tokens, offsets[i], offsets[i + 1], mask)


def test_a_changed_token_or_mask_value_changes_only_its_range():
    tokens = np.arange(100, dtype=np.uint16)
    mask = np.ones(100, np.uint8)
    offsets = np.array([0, 40, 100])
    before = range_digests(tokens, offsets, mask)
    tokens[50] += 1
    after_token = range_digests(tokens, offsets, mask)
    mask[10] = 0
    after_mask = range_digests(tokens, offsets, mask)
    assert bytes(before[0]) == bytes(after_token[0]) != bytes(after_mask[0])
    assert bytes(before[1]) != bytes(after_token[1]) == bytes(after_mask[1])


@pytest.mark.parametrize(
    "tokens, offsets, mask, what",
    [
        (np.zeros(4, np.int64), [0, 4], None, "dtype int64"),
        (np.zeros(4, np.uint16), [1, 4], None, "starting at 0"),
        (np.zeros(4, np.uint16), [0, 3, 2], None, "rise from 0"),
        (np.zeros(4, np.uint16), [0, 5], None, "at most 4"),
        (np.zeros(4, np.uint16), [0, 4], np.zeros(3, np.uint8), "mask of dtype uint8"),
    ],
)
def test_inputs_outside_the_definition_are_refused_by_name(tokens, offsets, mask, what):
    with pytest.raises(ValueError, match=what):
        range_digests(tokens, np.array(offsets), mask)
