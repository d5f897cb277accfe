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


def _reference(tokens: np.ndarray, offsets: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    from streampack.digests import _hashlib_digests

    out = np.empty((len(offsets) - 1, DIGEST_BYTES), np.uint8)
    data = tokens.astype(tokens.dtype.newbyteorder("<")).view(np.uint8)
    return _hashlib_digests(data, tokens.dtype.itemsize, offsets, mask, out)


@pytest.mark.parametrize("seed", range(6))  # every dtype with and without a mask
def test_the_compiled_digests_equal_hashlibs_on_random_ranges(seed):
    """Both dtypes (and big-endian int32), masked or not, empty ranges, the whole buffer, a
    read-only (memory-map-like) buffer: byte for byte the hashlib loop's digests."""
    from streampack.digests import _kernel

    assert _kernel() is not None, "the compiled kernel is expected on this machine"
    rng = np.random.default_rng(seed)
    dtype = (np.uint16, np.int32, np.dtype(">i4"))[seed % 3]  # big-endian: converted
    n = int(rng.integers(0, 5000))
    tokens = rng.integers(0, 60000, n).astype(dtype)
    mask = rng.integers(0, 2, n).astype(np.uint8) if seed % 2 else None
    cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 60))))
    offsets = np.concatenate([[0], cuts, cuts[-1:] if len(cuts) else [], [n]]).astype(np.int64)
    tokens.flags.writeable = False
    for ranges in (offsets, np.array([0, n]), np.array([0, 0, 0])):
        assert np.array_equal(range_digests(tokens, ranges, mask), _reference(tokens, ranges, mask))


def test_without_libcrypto_the_digests_fall_back_to_hashlib_with_one_log_line(monkeypatch, caplog):
    from streampack import digests
    from streampack.kernels import digest_cpu

    tokens = np.arange(1000, dtype=np.int32)
    offsets = np.array([0, 10, 10, 1000])
    want = range_digests(tokens, offsets)
    monkeypatch.setattr(digests, "_state", {})
    monkeypatch.setattr(digest_cpu, "AVAILABLE", False)
    monkeypatch.setattr(digest_cpu, "UNAVAILABLE", "no libcrypto found")
    with caplog.at_level("WARNING", logger="streampack.digests"):
        assert np.array_equal(range_digests(tokens, offsets), want)
        assert np.array_equal(range_digests(tokens, offsets), want)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "content digests: no compiled SHA-256 (no libcrypto found); using hashlib "
        "(the same digests, slower)"
    ]


def test_a_fresh_process_loads_the_compiled_digests_from_the_cache(tmp_path):
    """The kernel caches (its OpenSSL calls are resolved by name at link time, not
    baked-in pointers): a second process with the same NUMBA_CACHE_DIR compiles
    nothing."""
    import json
    import os
    import subprocess
    import sys

    script = (
        "import json, numpy as np\n"
        "from streampack.digests import range_digests\n"
        "from streampack.kernels.digest_cpu import sha256_ranges\n"
        "d = range_digests(np.arange(9, dtype=np.uint16), np.array([0, 4, 9]))\n"
        "s = sha256_ranges.stats\n"
        "print(json.dumps([sum(s.cache_hits.values()), sum(s.cache_misses.values()),"
        " d.tobytes().hex()]))\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", script],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
                check=True,
            ).stdout.splitlines()[-1]
        )
        for _ in range(2)
    ]
    (hits0, misses0, first), (hits1, misses1, second) = runs
    assert (hits0, misses0) == (0, 1)  # compiled and written once
    assert (hits1, misses1) == (1, 0)  # then loaded
    assert first == second
