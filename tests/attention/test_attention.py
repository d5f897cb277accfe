"""Range-aware attention (rule C6): the numpy reference and the Numba CPU kernel.

One scenario suite runs against every implementation; random packed batches compare the
kernel with the dense-mask reference built from ``PackedBatch.permission``; gradients
are checked against central finite differences; bad inputs raise ``InvalidArray``.
The CUDA kernels run the same suite under the simulator (test_attention_cuda_sim.py).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from _attention_cases import (
    BINDING,
    LAYOUTS,
    assert_same_results,
    packed,
    random_inputs,
    uniform_expectation,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streampack import Examples, InvalidArray, InvalidConfig, PackConfig, pack_examples
from streampack.kernels import attention_ir as ir_kernels
from streampack.kernels.attention import range_attention, range_attention_backward
from streampack.reference.attention import attention_backward, attention_forward, range_mask

TILES = (4, 4)


def _reference(q, k, v, d_out, starts, valid, permission, scale=None):
    out, lse = attention_forward(q, k, v, permission, scale=scale)
    grads = None
    if d_out is not None:
        grads = attention_backward(q, k, v, permission, d_out, scale=scale)
    return out, lse, grads


def _cpu(q, k, v, d_out, starts, valid, permission, scale=None, tiles=TILES):
    out, lse = range_attention(q, k, v, starts, valid, scale=scale, _tiles=tiles)
    grads = None
    if d_out is not None:
        grads = range_attention_backward(
            q, k, v, out, lse, d_out, starts, valid, scale=scale, _tiles=tiles
        )
    return out, lse, grads


def _cpu_default_tiles(*args, **kwargs):
    return _cpu(*args, tiles=None, **kwargs)


IMPLEMENTATIONS = {"reference": _reference, "cpu": _cpu, "cpu_default_tiles": _cpu_default_tiles}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_c6_uniform_scores_average_exactly_the_permitted_keys(impl, layout, dtype):
    capacity, rows = LAYOUTS[layout]
    starts, valid, permission = packed(capacity, rows)
    heads, dim = 2, 3
    shape = (len(rows), heads, capacity, dim)
    q = np.zeros(shape, dtype)
    k = np.zeros(shape, dtype)
    v = np.broadcast_to(np.arange(capacity, dtype=dtype)[None, None, :, None], shape).copy()
    out, lse, _ = IMPLEMENTATIONS[impl](q, k, v, None, starts, valid, permission)
    want_out, want_lse = uniform_expectation(starts, valid, heads, dim)
    assert out.dtype == dtype and lse.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)


def test_c6_worked_example_rows_written_literally():
    """Capacity 6: row 0 holds A (3 cells) and B (2), row 1 holds C (4) then padding."""
    starts, valid, _ = packed(6, [[3, 2], [4]])
    np.testing.assert_array_equal(starts, [[0, 0, 0, 3, 3, -1], [0, 0, 0, 0, -1, -1]])
    np.testing.assert_array_equal(valid, [5, 4])
    shape = (2, 1, 6, 1)
    v = np.arange(12, dtype=np.float64).reshape(shape)
    out, lse = range_attention(np.zeros(shape), np.zeros(shape), v, starts, valid)
    np.testing.assert_allclose(out[:, 0, :, 0], [[0, 0.5, 1, 3, 3.5, 0], [6, 6.5, 7, 7.5, 0, 0]])
    np.testing.assert_allclose(
        np.exp(lse[:, 0]), [[1, 2, 3, 1, 2, 0], [1, 2, 3, 4, 0, 0]], atol=1e-15
    )


@pytest.mark.parametrize("impl", ["cpu", "cpu_default_tiles"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_matches_dense_reference_on_every_layout(impl, layout, dtype):
    capacity, rows = LAYOUTS[layout]
    starts, valid, permission = packed(capacity, rows)
    q, k, v, d_out = random_inputs(len(rows), 2, capacity, 5, dtype, seed=len(layout))
    want = _reference(q, k, v, d_out, starts, valid, permission)
    got = IMPLEMENTATIONS[impl](q, k, v, d_out, starts, valid, permission)
    assert_same_results(got, want, dtype)


@st.composite
def packed_batches(draw):
    """A real packed batch: documents next-fit into rows, plus an all-padding row at times."""
    capacity = draw(st.integers(1, 23))
    lengths = draw(st.lists(st.integers(1, capacity), min_size=1, max_size=12))
    docs = [np.arange(n + 1, dtype=np.int32) % BINDING.vocab_size for n in lengths]
    epoch = pack_examples(
        Examples.from_documents(docs), BINDING, PackConfig(capacity=capacity, max_rows_per_batch=4)
    )
    batch = epoch.batches[draw(st.integers(0, len(epoch.batches) - 1))]
    starts = batch.segment_starts
    valid = batch.valid_lengths
    permission = np.stack([batch.permission(r) for r in range(batch.rows)])
    if draw(st.booleans()):
        at = draw(st.integers(0, batch.rows))
        starts = np.insert(starts, at, -1, axis=0)
        valid = np.insert(valid, at, 0)
        permission = np.insert(permission, at, False, axis=0)
    tiles = (draw(st.sampled_from([1, 2, 3, 4, 8])), draw(st.sampled_from([1, 3, 4, 8])))
    return starts, valid, permission, tiles


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packed_batches(), seed=st.integers(0, 2**16), dim=st.integers(1, 6))
def test_kernel_matches_reference_on_random_packed_batches(case, seed, dim):
    starts, valid, permission, tiles = case
    q, k, v, d_out = random_inputs(starts.shape[0], 2, starts.shape[1], dim, np.float64, seed)
    want = _reference(q, k, v, d_out, starts, valid, permission, scale=0.7)
    got = _cpu(q, k, v, d_out, starts, valid, permission, scale=0.7, tiles=tiles)
    assert_same_results(got, want, np.float64)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_kernel_handles_arbitrary_ranges_not_only_segments(data):
    """The kernel takes any ``0 <= start <= q`` (the decoder widens ranges to a row
    prefix), so segment structure is a speed-up, never an assumption."""
    capacity = data.draw(st.integers(1, 20))
    rows = data.draw(st.integers(1, 3))
    valid = np.array([data.draw(st.integers(0, capacity)) for _ in range(rows)], np.int32)
    starts = np.full((rows, capacity), -1, np.int32)
    for r in range(rows):
        for c in range(valid[r]):
            starts[r, c] = data.draw(st.integers(0, c))
    tiles = (data.draw(st.sampled_from([1, 3, 4])), data.draw(st.sampled_from([1, 2, 4])))
    q, k, v, d_out = random_inputs(rows, 1, capacity, 3, np.float64, data.draw(st.integers(0, 99)))
    permission = range_mask(starts, valid)
    want = _reference(q, k, v, d_out, starts, valid, permission)
    got = _cpu(q, k, v, d_out, starts, valid, permission, tiles=tiles)
    assert_same_results(got, want, np.float64)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gradients_match_central_finite_differences(impl):
    starts, valid, permission = packed(7, [[3, 1, 2], [], [5]])
    q, k, v, d_out = random_inputs(3, 1, 7, 2, np.float64, seed=3)
    run = IMPLEMENTATIONS[impl]
    _, _, (dq, dk, dv) = run(q, k, v, d_out, starts, valid, permission)
    eps = 1e-6
    inputs = {"q": q, "k": k, "v": v}
    for name, grad in zip(inputs, (dq, dk, dv)):
        numeric = np.zeros_like(grad)
        for index in np.ndindex(grad.shape):
            plus = {n: a.copy() for n, a in inputs.items()}
            minus = {n: a.copy() for n, a in inputs.items()}
            plus[name][index] += eps
            minus[name][index] -= eps
            f_plus = (run(*plus.values(), None, starts, valid, permission)[0] * d_out).sum()
            f_minus = (run(*minus.values(), None, starts, valid, permission)[0] * d_out).sum()
            numeric[index] = (f_plus - f_minus) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_inactive_queries_and_padding_keys_are_exact_zeros(impl):
    starts, valid, permission = packed(9, [[2, 3], [], [9]])
    q, k, v, d_out = random_inputs(3, 2, 9, 4, np.float32, seed=5)
    out, lse, (dq, dk, dv) = IMPLEMENTATIONS[impl](q, k, v, d_out, starts, valid, permission)
    pad = np.arange(9)[None, :] >= valid[:, None]  # [rows, capacity]
    assert np.all(out.transpose(0, 2, 1, 3)[pad] == 0)
    assert np.all(np.isneginf(lse.transpose(0, 2, 1)[pad]))
    for g in (dq, dk, dv):
        assert np.all(g.transpose(0, 2, 1, 3)[pad] == 0)


def test_nan_in_padding_cells_is_never_read():
    """Garbage in padding storage must not reach any active output or gradient."""
    starts, valid, permission = packed(10, [[4, 3], [5]])
    q, k, v, d_out = random_inputs(2, 2, 10, 4, np.float64, seed=11)
    clean = _cpu(q, k, v, d_out, starts, valid, permission)
    pad = (np.arange(10)[None, :] >= valid[:, None])[:, None, :, None]
    dirty = [np.where(pad, np.nan, a) for a in (q, k, v, d_out)]
    got = _cpu(*dirty, starts, valid, permission)
    np.testing.assert_array_equal(got[0], clean[0])
    np.testing.assert_array_equal(got[1], clean[1])
    for g, c in zip(got[2], clean[2]):
        np.testing.assert_array_equal(g, c)


@pytest.mark.parametrize("tiles", [TILES, None])
def test_perturbing_one_segment_changes_no_other_segment_bit_for_bit(tiles):
    capacity, rows = 16, [[5, 1, 6, 4], [16]]
    starts, valid, permission = packed(capacity, rows)
    q, k, v, d_out = random_inputs(2, 2, capacity, 8, np.float32, seed=7)
    base = _cpu(q, k, v, d_out, starts, valid, permission, tiles=tiles)
    target = slice(5, 12)  # row 0: the one-token segment and the 6-token one after it
    k2, v2 = k.copy(), v.copy()
    k2[0, :, target] += 1.5
    v2[0, :, target] -= 2.0
    moved = _cpu(q, k2, v2, d_out, starts, valid, permission, tiles=tiles)
    others = np.ones((2, capacity), bool)
    others[0, target] = False
    for got, want in zip((moved[0], moved[1], *moved[2]), (base[0], base[1], *base[2])):
        sel = others[:, None, :] if got.ndim == 3 else others[:, None, :, None]
        sel = np.broadcast_to(sel, got.shape)
        np.testing.assert_array_equal(got[sel], want[sel])
    assert not np.array_equal(moved[0][0, :, target], base[0][0, :, target])


def test_result_does_not_depend_on_thread_count():
    starts, valid, permission = packed(13, [[2, 9, 2], [13], [1, 1, 11]])
    q, k, v, d_out = random_inputs(3, 3, 13, 4, np.float32, seed=9)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = _cpu(q, k, v, d_out, starts, valid, permission)
    finally:
        numba.set_num_threads(before)
    many = _cpu(q, k, v, d_out, starts, valid, permission)
    for a, b in zip((one[0], one[1], *one[2]), (many[0], many[1], *many[2])):
        np.testing.assert_array_equal(a, b)


def test_non_contiguous_inputs_are_made_contiguous():
    starts, valid, permission = packed(8, [[3, 5]])
    q, k, v, d_out = random_inputs(1, 2, 8, 4, np.float64, seed=1)
    qt = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    assert not qt.flags.c_contiguous
    a = range_attention(qt, k, v, starts, valid)
    b = range_attention(q, k, v, starts, valid)
    np.testing.assert_array_equal(a[0], b[0])


def test_empty_shapes_return_empty_results():
    shape = (2, 3, 0, 4)
    out, lse = range_attention(
        np.zeros(shape),
        np.zeros(shape),
        np.zeros(shape),
        np.zeros((2, 0), np.int32),
        np.zeros(2, np.int32),
    )
    assert out.shape == shape and lse.shape == (2, 3, 0)


def _good():
    starts, valid, _ = packed(6, [[3, 2], [4]])
    q, k, v, d_out = random_inputs(2, 1, 6, 2, np.float64, seed=0)
    out, lse = range_attention(q, k, v, starts, valid)
    return dict(
        q=q, k=k, v=v, out=out, lse=lse, d_out=d_out, segment_starts=starts, valid_lengths=valid
    )


def _set(name, index, value):
    def mutate(args):
        arr = args[name].copy()
        arr[index] = value
        args[name] = arr

    return mutate


def _replace(name, make):
    def mutate(args):
        args[name] = make(args[name])

    return mutate


BAD_INPUTS = {
    "start after its query": (
        _set("segment_starts", (0, 4), 5),
        InvalidArray,
        r"segment_starts\[0, 4\] = 5",
    ),
    "negative start": (
        _set("segment_starts", (1, 2), -1),
        InvalidArray,
        r"segment_starts\[1, 2\] = -1",
    ),
    "valid length over capacity": (
        _set("valid_lengths", 1, 7),
        InvalidArray,
        r"valid_lengths\[1\] = 7.*0\.\.6",
    ),
    "negative valid length": (
        _set("valid_lengths", 0, -2),
        InvalidArray,
        r"valid_lengths\[0\] = -2",
    ),
    "float segment starts": (
        _replace("segment_starts", lambda a: a.astype(np.float32)),
        InvalidArray,
        r"segment_starts has dtype float32",
    ),
    "segment starts of another capacity": (
        _replace("segment_starts", lambda a: a[:, :5]),
        InvalidArray,
        r"segment_starts has shape \(2, 5\)",
    ),
    "valid lengths of another row count": (
        _replace("valid_lengths", lambda a: a[:1]),
        InvalidArray,
        r"valid_lengths has shape \(1,\)",
    ),
    "three-dimensional q": (_replace("q", lambda a: a[0]), InvalidArray, r"q has 3 dimensions"),
    "integer q": (_replace("q", lambda a: a.astype(np.int64)), InvalidArray, r"q has dtype int64"),
    "float16 q": (
        _replace("q", lambda a: a.astype(np.float16)),
        InvalidArray,
        r"q has dtype float16",
    ),
    "k of another dtype": (
        _replace("k", lambda a: a.astype(np.float32)),
        InvalidArray,
        r"k has dtype float32",
    ),
    "v of another shape": (
        _replace("v", lambda a: a[:, :, :5]),
        InvalidArray,
        r"v has shape \(2, 1, 5, 2\)",
    ),
}

BAD_BACKWARD_INPUTS = {
    "lse of another shape": (
        _replace("lse", lambda a: a[:, :, :4]),
        InvalidArray,
        r"lse has shape \(2, 1, 4\)",
    ),
    "lse of another dtype": (
        _replace("lse", lambda a: a.astype(np.float32)),
        InvalidArray,
        r"lse has dtype float32",
    ),
    "lse -inf on an active query": (
        _set("lse", (1, 0, 3), -np.inf),
        InvalidArray,
        r"lse\[1, 0, 3\] = -inf",
    ),
    "d_out of another shape": (
        _replace("d_out", lambda a: a[:1]),
        InvalidArray,
        r"d_out has shape \(1, 1, 6, 2\)",
    ),
    "out of another dtype": (
        _replace("out", lambda a: a.astype(np.float32)),
        InvalidArray,
        r"out has dtype float32",
    ),
}


def _forward_args(args):
    return [args[n] for n in ("q", "k", "v", "segment_starts", "valid_lengths")]


def _backward_args(args):
    names = ("q", "k", "v", "out", "lse", "d_out", "segment_starts", "valid_lengths")
    return [args[n] for n in names]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_its_error_naming_array_index_and_value(case):
    mutate, error, pattern = BAD_INPUTS[case]
    args = _good()
    mutate(args)
    with pytest.raises(error, match=pattern):
        range_attention(*_forward_args(args))
    with pytest.raises(error, match=pattern):
        range_attention_backward(*_backward_args(args))


@pytest.mark.parametrize("case", BAD_BACKWARD_INPUTS)
def test_bad_backward_input_raises_its_error(case):
    mutate, error, pattern = BAD_BACKWARD_INPUTS[case]
    args = _good()
    mutate(args)
    with pytest.raises(error, match=pattern):
        range_attention_backward(*_backward_args(args))


def test_inactive_query_starts_are_ignored():
    """``PackedBatch`` stores -1 on padding; any value there is accepted and unused."""
    args = _good()
    starts = args["segment_starts"].copy()
    starts[1, 5] = 99
    a = range_attention(*_forward_args(args))
    b = range_attention(args["q"], args["k"], args["v"], starts, args["valid_lengths"])
    np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"device": "tpu"}, r"device = 'tpu'"),
        ({"scale": float("nan")}, r"scale = nan"),
        ({"kernel": "fast"}, r"kernel = 'fast'; accepted: 'per_query' or 'tiled'"),
        ({"kernel": "tiled"}, r"kernel = 'tiled' selects a CUDA kernel; accepted with device"),
        ({"precision": "fp16"}, r"precision = 'fp16'; accepted: 'exact' or 'tf32'"),
        ({"precision": "tf32"}, r"precision = 'tf32' with kernel = 'per_query' and float64"),
        (
            {"precision": "tf32", "kernel": "tiled", "device": "cuda"},
            r"accepted: device='cuda', kernel='tiled' and float32 inputs",
        ),
    ],
)
def test_bad_options_raise_invalid_config(kwargs, pattern):
    args = _good()
    with pytest.raises(InvalidConfig, match=pattern):
        range_attention(*_forward_args(args), **kwargs)


@pytest.mark.parametrize(
    "kernel, itemsize, largest",
    [("forward", 4, 505), ("dq", 4, 378), ("dkdv", 8, 185), ("forward_tf32", 4, 744)],
)
def test_tiled_kernels_fit_shared_memory_or_say_which_head_dim_does(kernel, itemsize, largest):
    from streampack.kernels.attention_tiled import SHARED_LIMIT, _shared_bytes, tiles_for

    rows, cols = tiles_for(kernel, largest, itemsize)
    assert _shared_bytes(kernel, rows, cols, largest, itemsize) <= SHARED_LIMIT
    if itemsize == 4:  # the benchmark's float32 shape keeps tiles of 32 rows or more
        assert tiles_for(kernel, 64, itemsize)[0] >= 32
    with pytest.raises(InvalidConfig, match=rf"head_dim {largest + 1} is too large .* up to"):
        tiles_for(kernel, largest + 1, itemsize)


def test_device_arrays_are_refused_on_the_cpu_path():
    class FakeDeviceArray:
        """Anything exposing the CUDA array interface is device memory."""

        __cuda_array_interface__ = {"shape": (2, 1, 6, 2), "typestr": "<f8", "version": 3}

    args = _good()
    with pytest.raises(InvalidArray, match=r"q is a CUDA array"):
        range_attention(FakeDeviceArray(), *_forward_args(args)[1:])


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_key_query_end_is_one_past_the_last_query_that_sees_each_key(data):
    """The dK/dV loop bound: checked against its definition, on arbitrary ranges."""
    from streampack.kernels.attention_plan import key_query_end

    capacity = data.draw(st.integers(1, 24))
    valid = np.array([data.draw(st.integers(0, capacity))], np.int32)
    contiguous = data.draw(st.booleans())
    starts = np.full((1, capacity), -1, np.int32)
    for c in range(valid[0]):
        if contiguous:
            starts[0, c] = c if c == 0 or data.draw(st.booleans()) else starts[0, c - 1]
        else:
            starts[0, c] = data.draw(st.integers(0, c))
    got = np.empty((1, capacity), np.int32)
    key_query_end(starts, valid, got)
    mask = range_mask(starts, valid)[0]  # [query, key]
    for key in range(capacity):
        seen_by = np.flatnonzero(mask[:, key])
        assert got[0, key] == (seen_by.max() + 1 if seen_by.size else key), key


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_tile_bounds_give_the_keys_of_each_query_tile_and_its_unmasked_key_tiles(data):
    """What the tiled CUDA kernels skip and leave unmasked, against the dense mask."""
    from streampack.kernels.attention_plan import tile_bounds

    capacity = data.draw(st.integers(1, 24))
    tile = data.draw(st.sampled_from([1, 2, 4, 8]))
    valid = np.array([data.draw(st.integers(0, capacity))], np.int32)
    starts = np.full((1, capacity), -1, np.int32)
    for c in range(valid[0]):
        starts[0, c] = data.draw(st.integers(0, c))
    got = np.empty((1, -(-capacity // tile), 4), np.int32)
    tile_bounds(starts, valid, tile, got)
    mask = range_mask(starts, valid)[0]  # [query, key]
    for t, (lo, hi, full_lo, full_hi) in enumerate(got[0]):
        rows = mask[t * tile : (t + 1) * tile]
        keys = np.flatnonzero(rows.any(axis=0))
        if keys.size:  # the keys any query uses are exactly [lo, hi)
            assert (lo, hi) == (keys.min(), keys.max() + 1), t
            assert rows.any(axis=0)[lo:hi].all(), t
        else:
            assert (lo, hi) == (0, 0), t
        for k0 in range(capacity):
            for width in (1, 2, 4):
                # a key tile is left unmasked exactly when every query of the tile sees it
                unmasked = full_lo <= k0 and k0 + width <= full_hi
                block = rows[:, k0 : k0 + width]
                inside = k0 + width <= capacity and rows.shape[0] == tile and block.all()
                assert unmasked == inside, (t, k0, width)


@numba.njit
def _micro_product(kind, rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):
    if kind == 0:
        ir_kernels.score_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif kind == 1:
        ir_kernels.value_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif kind == 2:
        ir_kernels.half_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    else:
        ir_kernels.single_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", [0, 1, 2, 3])
@pytest.mark.parametrize("transposed_a", [False, True])
def test_micro_tiles_match_np_dot_on_every_row_count(dtype, kind, transposed_a):
    """The register-blocked micro-kernels against ``np.dot``: every row count (1-6), the
    three column widths, A read by rows (scores: keys) or by columns (values: the
    probabilities), offsets into larger arrays, ``kdim`` 0, 1 and odd; ``kind`` 0
    overwrites C, the others add to it; cells outside the tile stay untouched."""
    rng = np.random.default_rng(kind)
    width = {0: 2, 1: 2, 2: 1, 3: 0}[kind] * (32 // np.dtype(dtype).itemsize)
    cols = max(width, 1)
    for rows in range(1, ir_kernels.MICRO_ROWS + 1):
        for kdim in (0, 1, 7, 64):
            a_full = rng.standard_normal((rows + 3, kdim + 5)).astype(dtype)
            a_block = a_full[2 : 2 + rows, 3 : 3 + kdim]
            if transposed_a:  # stored as [kdim, rows]: element (i, kk) at kk * ld + i
                stored = np.ascontiguousarray(a_full.T)
                a_arr, sa_i, sa_k = stored, 1, stored.shape[1]
                a_off = 3 * stored.shape[1] + 2
            else:
                a_arr, sa_i, sa_k = a_full, a_full.shape[1], 1
                a_off = 2 * a_full.shape[1] + 3
            b_full = rng.standard_normal((kdim + 4, cols + 9)).astype(dtype)
            b_block = b_full[1 : 1 + kdim, 5 : 5 + cols]
            c_full = rng.standard_normal((rows + 2, cols + 6)).astype(dtype)
            before = c_full.copy()
            _micro_product(
                kind, rows, c_full, 1 * c_full.shape[1] + 4, c_full.shape[1],
                a_arr, a_off, sa_i, sa_k, b_full, 1 * b_full.shape[1] + 5, b_full.shape[1], kdim,
            )  # fmt: skip
            want = np.dot(a_block, b_block)
            if kind != 0:
                want = want + before[1 : 1 + rows, 4 : 4 + cols]
            tol = 1e-4 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(c_full[1 : 1 + rows, 4 : 4 + cols], want, rtol=tol, atol=tol)
            outside = np.ones(c_full.shape, bool)
            outside[1 : 1 + rows, 4 : 4 + cols] = False
            assert np.array_equal(c_full[outside], before[outside])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim", [1, 5, 8, 13, 16, 24, 64, 67])
@pytest.mark.parametrize("tiles", [None, (64, 16), (16, 128), (5, 7)])
def test_cpu_forward_matches_reference_on_every_column_path(dtype, dim, tiles):
    """Head dims that take each column path of the value micro-tiles (two vectors, one,
    single columns) and tiles whose key chunks are smaller, larger and unaligned with
    the query blocks, on rows with long segments."""
    lengths = [[70, 1, 33, 96], [200]]
    capacity = 200
    starts, valid, permission = packed(capacity, lengths)
    q, k, v, _ = random_inputs(len(lengths), 2, capacity, dim, dtype, seed=dim)
    out, lse = range_attention(q, k, v, starts, valid, _tiles=tiles)
    ref_out, ref_lse = attention_forward(q, k, v, permission)
    tol = 2e-5 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rise", [10.0, 80.0])
@pytest.mark.parametrize("tiles", [None, (16, 16)])
def test_cpu_forward_scores_far_above_a_querys_own_score(dtype, rise, tiles):
    """The forward shifts each query's exps by its own score and redoes a chunk exactly
    when a score rises more than ``SHIFT_SLACK`` above it: keys whose scores rise by
    ``rise`` over everything else, one early in the segment (a chunk wholly in range)
    and one inside a diagonal chunk, must give the reference's result either way."""
    assert (rise < ir_kernels.SHIFT_SLACK) == (rise == 10.0)
    lengths = [[200], [30, 170]]
    capacity, dim = 200, 16
    starts, valid, permission = packed(capacity, lengths)
    q, k, v, _ = random_inputs(len(lengths), 2, capacity, dim, dtype, seed=3)
    u = np.ones(dim, dtype)
    q += 2 * u  # every query points along u
    scale = 1.0 / np.sqrt(dim)
    for key in (3, 40, 130):
        k[:, :, key] = rise * u / (2 * dim * scale)  # score about ``rise`` above the rest
    out, lse = range_attention(q, k, v, starts, valid, _tiles=tiles)
    ref_out, ref_lse = attention_forward(q, k, v, permission)
    tol = 2e-5 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=tol, atol=tol * rise)
