"""The ``mma.sync.m16n8k8`` TF32 fragment layout of the tensor-core kernel, in plain Python.

Which lane holds which element is written literally from the PTX ISA's table ("Matrix
Fragments for mma.m16n8k8", ``.tf32``); the products then rebuild the matrices a warp's
fragments stand for and check that the kernel's two products, ``S = Q K^T`` and
``O = P V`` with ``P`` taken straight from the accumulators of the first, compute what
they should. The instruction itself runs only on a GPU (``make test-gpu``).
"""

from __future__ import annotations

import numpy as np
import pytest

from streampack.kernels.attention_mma import (
    a_col,
    a_from_c,
    a_row,
    b_col,
    b_row,
    c_col,
    c_row,
    pv_key,
)

LANES = range(32)

# (lane, A elements a0..a3, B elements b0..b1, C elements c0..c3) as (row, col)
PTX_TABLE = [
    (0, [(0, 0), (8, 0), (0, 4), (8, 4)], [(0, 0), (4, 0)], [(0, 0), (0, 1), (8, 0), (8, 1)]),
    (5, [(1, 1), (9, 1), (1, 5), (9, 5)], [(1, 1), (5, 1)], [(1, 2), (1, 3), (9, 2), (9, 3)]),
    (
        31,
        [(7, 3), (15, 3), (7, 7), (15, 7)],
        [(3, 7), (7, 7)],
        [(7, 6), (7, 7), (15, 6), (15, 7)],
    ),
]


@pytest.mark.parametrize("lane, a, b, c", PTX_TABLE)
def test_fragments_are_the_ptx_isa_table(lane, a, b, c):
    assert [(a_row(lane, i), a_col(lane, i)) for i in range(4)] == a
    assert [(b_row(lane, i), b_col(lane, i)) for i in range(2)] == b
    assert [(c_row(lane, i), c_col(lane, i)) for i in range(4)] == c


@pytest.mark.parametrize(
    "row, col, count, shape",
    [(a_row, a_col, 4, (16, 8)), (b_row, b_col, 2, (8, 8)), (c_row, c_col, 4, (16, 8))],
)
def test_every_element_is_held_by_exactly_one_lane(row, col, count, shape):
    held = sorted((row(lane, i), col(lane, i)) for lane in LANES for i in range(count))
    assert held == [(r, c) for r in range(shape[0]) for c in range(shape[1])]


def _product(a_frag, b_frag) -> np.ndarray:
    """``A @ B`` of what the warp's A and B fragments stand for, laid out as C/D."""
    a = np.zeros((16, 8))
    b = np.zeros((8, 8))
    for lane in LANES:
        for i in range(4):
            a[a_row(lane, i), a_col(lane, i)] = a_frag[lane][i]
        for i in range(2):
            b[b_row(lane, i), b_col(lane, i)] = b_frag[lane][i]
    d = a @ b
    return np.array([[d[c_row(lane, i), c_col(lane, i)] for i in range(4)] for lane in LANES])


def _as_c(matrix: np.ndarray) -> np.ndarray:
    return np.array([[matrix[c_row(lane, i), c_col(lane, i)] for i in range(4)] for lane in LANES])


def test_scores_are_q_times_k_transposed():
    """The kernel's first product: A from 16 query rows, B[k = dim, n = key] from K."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((16, 8))  # 16 queries x 8 head dims
    k = rng.standard_normal((8, 8))  # 8 keys x 8 head dims
    a_frag = [[q[a_row(lane, i), a_col(lane, i)] for i in range(4)] for lane in LANES]
    b_frag = [[k[b_col(lane, i), b_row(lane, i)] for i in range(2)] for lane in LANES]
    np.testing.assert_allclose(_product(a_frag, b_frag), _as_c(q @ k.T), rtol=1e-12)


def test_probabilities_feed_the_second_product_from_the_accumulators():
    """The kernel's second product: A is each lane's own accumulators of ``P`` (C
    layout) reordered by ``a_from_c``, B the rows of V numbered by ``pv_key``."""
    rng = np.random.default_rng(1)
    p = rng.random((16, 8))  # 16 queries x 8 keys, as the first product left them
    v = rng.standard_normal((8, 8))  # 8 keys x 8 output dims
    c_frag = _as_c(p)
    a_frag = [[c_frag[lane][a_from_c(j)] for j in range(4)] for lane in LANES]
    b_frag = [[v[pv_key(b_row(lane, j)), b_col(lane, j)] for j in range(2)] for lane in LANES]
    np.testing.assert_allclose(_product(a_frag, b_frag), _as_c(p @ v), rtol=1e-12)


def test_pv_key_is_a_numbering_of_the_chunk():
    assert sorted(pv_key(col) for col in range(8)) == list(range(8))
    assert sorted(a_from_c(j) for j in range(4)) == [0, 1, 2, 3]
