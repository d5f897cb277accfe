"""The tiled CUDA kernels (``kernel="tiled"``) on the scenario suite, against float64.

Float32 inputs through the exact tiled forward and backward, and through the TF32
forward (under the simulator its ``mma.sync`` is emulated with the same fragments and
plain float32 FMAs, so this checks its tiling, masking and softmax; on a GPU, ``make
test-gpu``, the instruction itself at TF32's tolerance), compared with the float64 CPU
kernel. Tiles are small so that
the suite's rows cross them: exact kernels 8 queries x 16 keys (2 x 2 register tiles
per thread, one warp), the TF32 forward one warp of 16 queries x 16 keys. Head dim 12
is not a multiple of the 8 columns a thread group or a fragment covers, so the edge
columns are exercised too.

``WIDE`` adds rows longer than the tiles: key tiles stream, whole tiles before a
segment are skipped, and some tiles lie inside every range of their query tile (no
mask); with ``LAYOUTS`` that covers segment starts inside a tile, boundary tiles,
padding rows, empty rows and one-token documents.
"""

from __future__ import annotations

import numpy as np
import pytest
from _attention_cases import LAYOUTS, assert_same_results, packed, random_inputs

from streampack.kernels.attention import range_attention, range_attention_backward
from streampack.kernels.attention_mma import SIMULATED

EXACT_TILES = (8, 16)
TF32_TILES = (16, 16)
DIM = 12
WIDE = {"interior_tiles": (32, [[32], [5, 27], [27, 3]])}
CASES = {**LAYOUTS, **WIDE}
#: The emulated product has float32 FMAs; a GPU's rounds its operands to TF32 (10 bits).
TF32_TOL = 2e-5 if SIMULATED else 1e-2


def _float64_cpu(q, k, v, d_out, starts, valid):
    q, k, v, d_out = (x.astype(np.float64) for x in (q, k, v, d_out))
    out, lse = range_attention(q, k, v, starts, valid)
    return out, lse, range_attention_backward(q, k, v, out, lse, d_out, starts, valid)


def _tiled(q, k, v, d_out, starts, valid):
    options = {"device": "cuda", "kernel": "tiled", "_tiles": EXACT_TILES}
    out, lse = range_attention(q, k, v, starts, valid, **options)
    grads = range_attention_backward(q, k, v, out, lse, d_out, starts, valid, **options)
    return out.copy_to_host(), lse.copy_to_host(), tuple(g.copy_to_host() for g in grads)


@pytest.mark.parametrize("layout", CASES)
def test_tiled_exact_float32_matches_the_float64_kernel(layout):
    capacity, rows = CASES[layout]
    starts, valid, _ = packed(capacity, rows)
    inputs = random_inputs(len(rows), 2, capacity, DIM, np.float32, seed=len(layout))
    got = _tiled(*inputs, starts, valid)
    assert got[0].dtype == np.float32
    assert_same_results(got, _float64_cpu(*inputs, starts, valid), np.float32)


def test_tiled_exact_float64_matches_the_float64_kernel():
    capacity, rows = WIDE["interior_tiles"]
    starts, valid, _ = packed(capacity, rows)
    inputs = random_inputs(len(rows), 1, capacity, DIM, np.float64, seed=3)
    assert_same_results(
        _tiled(*inputs, starts, valid), _float64_cpu(*inputs, starts, valid), np.float64
    )


@pytest.mark.parametrize("layout", CASES)
def test_tiled_tf32_forward_matches_the_float64_kernel(layout):
    capacity, rows = CASES[layout]
    starts, valid, _ = packed(capacity, rows)
    q, k, v, d_out = random_inputs(len(rows), 1, capacity, DIM, np.float32, seed=len(layout))
    out, lse = range_attention(
        q, k, v, starts, valid, device="cuda", kernel="tiled", precision="tf32", _tiles=TF32_TILES
    )
    want_out, want_lse, _ = _float64_cpu(q, k, v, d_out, starts, valid)
    np.testing.assert_allclose(out.copy_to_host(), want_out, rtol=TF32_TOL, atol=TF32_TOL)
    got_lse = lse.copy_to_host()
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    np.testing.assert_allclose(got_lse, want_lse, rtol=TF32_TOL, atol=TF32_TOL)


def _arbitrary_ranges() -> tuple[np.ndarray, np.ndarray]:
    """Ranges that are not segments, where a key tile is one key short of being inside
    every range of its query tile: starts alternating 0 and 1 (a tile from key 0 is
    masked for half the queries), a segment from key 2 (the tile [2, 18) is one key
    past query 16), and random starts."""
    capacity = 32
    rng = np.random.default_rng(5)
    starts = np.zeros((3, capacity), np.int32)
    starts[0, 1:] = np.arange(1, capacity) % 2
    starts[1, 2:] = 2
    starts[2] = [rng.integers(0, c + 1) for c in range(capacity)]
    return starts, np.array([capacity, capacity, 29], np.int32)


def test_tiled_kernels_on_ranges_that_are_not_segments():
    starts, valid = _arbitrary_ranges()
    inputs = random_inputs(3, 1, starts.shape[1], DIM, np.float32, seed=7)
    want = _float64_cpu(*inputs, starts, valid)
    assert_same_results(_tiled(*inputs, starts, valid), want, np.float32)
    q, k, v, _ = inputs
    out, _ = range_attention(
        q, k, v, starts, valid, device="cuda", kernel="tiled", precision="tf32", _tiles=TF32_TILES
    )
    np.testing.assert_allclose(out.copy_to_host(), want[0], rtol=TF32_TOL, atol=TF32_TOL)
