"""The CUDA kernels under the Numba CUDA simulator, on the shared scenario suite.

Shapes stay tiny (capacity <= 16, head_dim <= 8, tiles of 4): the simulator runs one
OS thread per CUDA thread. Each result is compared with the Numba CPU kernel and with
the dense-mask reference built from ``PackedBatch.permission``.
"""

from __future__ import annotations

import numpy as np
import pytest
from _attention_cases import (
    LAYOUTS,
    assert_same_results,
    packed,
    random_inputs,
    uniform_expectation,
)
from numba import cuda

from streampack import InvalidArray
from streampack.kernels.attention import range_attention, range_attention_backward
from streampack.reference.attention import attention_backward, attention_forward

TILES = (4, 4)


def _host(x):
    return x.copy_to_host()


def _cuda(q, k, v, d_out, starts, valid, tiles=TILES):
    out, lse = range_attention(q, k, v, starts, valid, device="cuda", _tiles=tiles)
    grads = range_attention_backward(
        q, k, v, out, lse, d_out, starts, valid, device="cuda", _tiles=tiles
    )
    return _host(out), _host(lse), tuple(_host(g) for g in grads)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_c6_uniform_scores_average_exactly_the_permitted_keys(layout):
    capacity, rows = LAYOUTS[layout]
    starts, valid, _ = packed(capacity, rows)
    shape = (len(rows), 1, capacity, 2)
    v = np.broadcast_to(np.arange(capacity, dtype=np.float64)[None, None, :, None], shape)
    out, lse = range_attention(
        np.zeros(shape), np.zeros(shape), v.copy(), starts, valid, device="cuda", _tiles=TILES
    )
    want_out, want_lse = uniform_expectation(starts, valid, 1, 2)
    np.testing.assert_allclose(_host(out), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_host(lse), want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_matches_cpu_kernel_and_reference(layout, dtype):
    capacity, rows = LAYOUTS[layout]
    starts, valid, permission = packed(capacity, rows)
    q, k, v, d_out = random_inputs(len(rows), 2, capacity, 3, dtype, seed=len(layout))
    got = _cuda(q, k, v, d_out, starts, valid)
    out, lse = range_attention(q, k, v, starts, valid)
    cpu = (out, lse, range_attention_backward(q, k, v, out, lse, d_out, starts, valid))
    ref_out, ref_lse = attention_forward(q, k, v, permission)
    ref = (ref_out, ref_lse, attention_backward(q, k, v, permission, d_out))
    for want in (cpu, ref):
        assert_same_results(got, want, dtype)


def test_default_tiles_and_arbitrary_ranges():
    """Default tile sizes (one tile covers the row) and ranges that are not segments."""
    rng = np.random.default_rng(4)
    capacity = 11
    valid = np.array([11, 6, 0], np.int32)
    starts = np.full((3, capacity), -1, np.int32)
    for r in range(3):
        for c in range(valid[r]):
            starts[r, c] = rng.integers(0, c + 1)
    from streampack.reference.attention import range_mask

    permission = range_mask(starts, valid)
    q, k, v, d_out = random_inputs(3, 1, capacity, 2, np.float64, seed=2)
    for tiles in (None, (3, 2)):
        got = _cuda(q, k, v, d_out, starts, valid, tiles=tiles)
        np.testing.assert_allclose(got[0], attention_forward(q, k, v, permission)[0], atol=1e-12)
        for g, w in zip(got[2], attention_backward(q, k, v, permission, d_out)):
            np.testing.assert_allclose(g, w, atol=1e-12)


def test_device_arrays_in_device_arrays_out():
    starts, valid, _ = packed(8, [[3, 5], [2]])
    q, k, v, d_out = random_inputs(2, 1, 8, 2, np.float32, seed=6)
    dq_, dk_, dv_ = (cuda.to_device(x) for x in (q, k, v))
    out, lse = range_attention(
        dq_, dk_, dv_, cuda.to_device(starts), cuda.to_device(valid), device="cuda", _tiles=TILES
    )
    for result in (out, lse):
        assert hasattr(result, "copy_to_host") and not isinstance(result, np.ndarray)
    host_out, _ = range_attention(q, k, v, starts, valid)
    np.testing.assert_allclose(out.copy_to_host(), host_out, rtol=2e-5, atol=2e-5)


def test_non_contiguous_device_array_is_refused():
    starts, valid, _ = packed(8, [[3, 5]])
    q, k, v, _ = random_inputs(1, 1, 8, 2, np.float32, seed=6)
    wide = cuda.to_device(np.zeros((1, 1, 8, 4), np.float32))
    with pytest.raises(InvalidArray, match=r"q is a non-contiguous CUDA array"):
        range_attention(wide[:, :, :, :2], k, v, starts, valid, device="cuda", _tiles=TILES)


def test_bad_ranges_raise_before_launch():
    starts, valid, _ = packed(8, [[3, 5]])
    q, k, v, _ = random_inputs(1, 1, 8, 2, np.float32, seed=6)
    starts[0, 2] = 3
    with pytest.raises(InvalidArray, match=r"segment_starts\[0, 2\] = 3"):
        range_attention(q, k, v, cuda.to_device(starts), valid, device="cuda")
