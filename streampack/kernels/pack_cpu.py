"""Compiled next-fit packing: a sequential planner and a parallel row filler.

Pure functions over arrays; the caller (``streampack.packing``) validates every input
and allocates every output, so nothing here can fail on user data.
"""

from __future__ import annotations

from numba import njit, prange


@njit(cache=True)
def plan_next_fit(lengths, capacity, row_of, column_of):  # pragma: no cover - compiled
    """Place example ``i`` (``lengths[i]`` cells) at ``(row_of[i], column_of[i])``.

    Next-fit in supplied order: an example that does not fit in what is left of the
    current row starts the next row. Returns the number of rows used.
    """
    row = 0
    used = 0
    for i in range(lengths.shape[0]):
        length = lengths[i]
        if length > capacity - used:
            row += 1
            used = 0
        row_of[i] = row
        column_of[i] = used
        used += length
    return row + 1 if lengths.shape[0] > 0 else 0


@njit(parallel=True, cache=True)
def fill_rows(
    tokens, offsets, doc, start, stop, row_first, first_segment,
    inputs, targets, segments, positions,
    input_valid, target_valid, loss_mask, segment_starts, valid_lengths,
):  # pragma: no cover - compiled
    """Write every cell of every row once: the occurrences in order, then padding.

    Row ``r`` holds examples ``row_first[r] .. row_first[r+1]-1``; example ``i`` gets
    segment ``first_segment + i``. Rows are independent, so threads split them with no
    shared writes.
    """
    capacity = inputs.shape[1]
    for r in prange(row_first.shape[0] - 1):
        column = 0
        for i in range(row_first[r], row_first[r + 1]):
            base = offsets[doc[i]] + start[i]
            length = stop[i] - start[i] - 1
            segment_start = column
            for j in range(length):
                c = column + j
                inputs[r, c] = tokens[base + j]
                targets[r, c] = tokens[base + j + 1]
                segments[r, c] = first_segment + i
                positions[r, c] = j
                input_valid[r, c] = True
                target_valid[r, c] = True
                loss_mask[r, c] = True
                segment_starts[r, c] = segment_start
            column += length
        valid_lengths[r] = column
        for c in range(column, capacity):
            inputs[r, c] = -1
            targets[r, c] = -1
            segments[r, c] = -1
            positions[r, c] = 0
            input_valid[r, c] = False
            target_valid[r, c] = False
            loss_mask[r, c] = False
            segment_starts[r, c] = -1



@njit(parallel=True, cache=True)
def gather_ranges(tokens, offsets, doc, start, stop, out_offsets, out):  # pragma: no cover
    """Copy example ``i``'s selected tokens to ``out[out_offsets[i]:out_offsets[i+1]]``."""
    for i in prange(doc.shape[0]):
        base = offsets[doc[i]] + start[i]
        target = out_offsets[i]
        for j in range(stop[i] - start[i]):
            out[target + j] = tokens[base + j]


#: Codes of :func:`check_compact`, in the order it tests them.
COMPACT_OK, COMPACT_ROWS, COMPACT_START, COMPACT_COLUMNS, COMPACT_ORDINAL = 0, 1, 2, 3, 4
COMPACT_SEGMENT, COMPACT_RANGE, COMPACT_TOKEN_COUNT, COMPACT_VOCABULARY = 5, 6, 7, 8


@njit(cache=True)
def check_compact(
    row, start, stop, ordinal, segment, range_start, range_stop, tokens, rows, capacity,
    vocab_size,
):  # pragma: no cover - compiled
    """One pass over a compact batch from elsewhere: ``(COMPACT_OK, 0)`` or the first
    broken rule as ``(code, index)`` — the occurrence (or token) that breaks it.

    What it proves is what the fill relies on: rows run ``0 .. rows-1`` without a gap,
    each occurrence starts where the one before it in its row ended and stays inside
    the row, and the tokens are exactly the ranges' tokens, inside the vocabulary.
    """
    n = row.shape[0]
    total = 0
    for i in range(n):
        expected_row = 0 if i == 0 else row[i - 1]
        if not (row[i] == expected_row or (i > 0 and row[i] == expected_row + 1)):
            return COMPACT_ROWS, i
        if i == n - 1 and row[i] != rows - 1:
            return COMPACT_ROWS, i
        expected_start = 0 if i == 0 or row[i] != row[i - 1] else stop[i - 1]
        if start[i] != expected_start:
            return COMPACT_START, i
        if not start[i] < stop[i] <= capacity:
            return COMPACT_COLUMNS, i
        if ordinal[i] != ordinal[0] + i or ordinal[i] < 0 or ordinal[i] >= 2**31:
            return COMPACT_ORDINAL, i
        if segment[i] != ordinal[i]:
            return COMPACT_SEGMENT, i
        if range_stop[i] - range_start[i] != stop[i] - start[i] + 1:
            return COMPACT_RANGE, i
        total += stop[i] - start[i] + 1
    if total != tokens.shape[0]:
        return COMPACT_TOKEN_COUNT, total
    for j in range(tokens.shape[0]):
        if not 0 <= tokens[j] < vocab_size:
            return COMPACT_VOCABULARY, j
    return COMPACT_OK, 0
