"""Packed rows shared by the attention tests (CPU process and the CUDA simulator process).

Each layout lists the segment lengths of every row; ``packed`` turns the layouts into
``(segment_starts, valid_lengths, permission)`` through the real packer, so the kernels
see exactly what ``PackedBatch`` carries. With tile size 4 the layouts cover: one-token
segments, an empty row, a capacity that is not a multiple of the tile, segments that end
exactly at a tile boundary, a segment spanning several tiles, and a query tile whose
first key tile is empty for some of its queries.
"""

from __future__ import annotations

import numpy as np

from streampack import Binding, Examples, PackConfig, pack_examples

BINDING = Binding(vocab_size=50, tokenizer="test", split_receipt="test", partition="train")

#: name -> (capacity, segment lengths per row); an empty list is an all-padding row.
LAYOUTS: dict[str, tuple[int, list[list[int]]]] = {
    "worked_example": (6, [[3, 2], [4]]),
    "one_token_segments": (9, [[1, 1, 1, 1, 1, 1, 1], [8, 1]]),
    "empty_row": (7, [[2, 3], [], [7]]),
    "capacity_not_tile_multiple": (10, [[3, 5, 1], [10]]),
    "segments_end_on_tile_boundary": (12, [[4, 4, 4], [8, 4]]),
    "long_segment_spanning_tiles": (13, [[13], [11]]),
    "first_key_tile_empty": (12, [[5, 2, 5], [1, 6, 5]]),
}


def packed(capacity: int, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack the layout with ``pack_examples``; empty rows become all-padding rows.

    Returns ``segment_starts`` int32 [rows, capacity], ``valid_lengths`` int32 [rows] and
    the dense ``PackedBatch.permission`` of every row, bool [rows, capacity, capacity].
    """
    filled = [row for row in rows if row]
    docs = [
        np.arange(length + 1, dtype=np.int32) % BINDING.vocab_size
        for row in filled
        for length in row
    ]
    batch = pack_examples(
        Examples.from_documents(docs),
        BINDING,
        PackConfig(capacity=capacity, max_rows_per_batch=max(len(filled), 1)),
    ).batches[0]
    got = [
        np.unique(batch.segment_starts[r, : batch.valid_lengths[r]], return_counts=True)[1].tolist()
        for r in range(batch.rows)
    ]
    assert got == filled, f"layout {filled} is not what next-fit makes: {got}"
    starts = np.full((len(rows), capacity), -1, np.int32)
    valid = np.zeros(len(rows), np.int32)
    permission = np.zeros((len(rows), capacity, capacity), bool)
    src = 0
    for r, row in enumerate(rows):
        if row:
            starts[r] = batch.segment_starts[src]
            valid[r] = batch.valid_lengths[src]
            permission[r] = batch.permission(src)
            src += 1
    return starts, valid, permission


def uniform_expectation(
    starts: np.ndarray, valid: np.ndarray, heads: int, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Literal answer when ``q = k = 0`` and ``v[r, h, c, :] = c``: every permitted key
    weighs the same, so query ``q`` outputs the mean column ``(start + q) / 2`` and its
    ``lse`` is ``log(q - start + 1)``; inactive queries give 0 and ``-inf``."""
    rows, capacity = starts.shape
    out = np.zeros((rows, heads, capacity, dim))
    lse = np.full((rows, heads, capacity), -np.inf)
    for r in range(rows):
        for q in range(valid[r]):
            out[r, :, q, :] = (starts[r, q] + q) / 2
            lse[r, :, q] = np.log(q - starts[r, q] + 1)
    return out, lse


def random_inputs(
    rows: int, heads: int, capacity: int, dim: int, dtype: type, seed: int
) -> tuple[np.ndarray, ...]:
    """``q, k, v, d_out`` drawn from a seeded normal distribution."""
    rng = np.random.default_rng(seed)
    shape = (rows, heads, capacity, dim)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(4))


def assert_same_results(got, want, dtype) -> None:
    """``(out, lse, (dq, dk, dv))`` equal within the dtype's tolerance (gradients 5x it),
    with ``-inf`` in ``lse`` exactly where ``want`` has it and the gradients in ``dtype``."""
    tol = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
    np.testing.assert_allclose(got[1], want[1], rtol=tol, atol=tol)
    for g, w in zip(got[2], want[2]):
        assert g.dtype == dtype
        np.testing.assert_allclose(g, w, rtol=5 * tol, atol=5 * tol)
