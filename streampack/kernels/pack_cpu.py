"""Compiled packing: sequential planners (next-fit, bounded best-fit), a row grouping
and a parallel row filler.

Pure functions over arrays; the caller (``streampack.packing``) validates every input
and allocates every output, so nothing here can fail on user data.

A supervision ``mask`` (uint8 0/1, aligned with ``tokens``) is passed to every filler;
an empty one means "no mask" (every valid target eligible). One array argument of one
type, whichever the case, keeps one compiled specialization, and a real mask is never
empty: it covers at least the two tokens of one range.
"""

from __future__ import annotations

from numba import njit, prange

from streampack.kernels.corpus_cpu import copy_slice


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


@njit(inline="always")
def _close_slot(slot, open_count, open_row, open_used):  # pragma: no cover - compiled
    """Drop open slot ``slot``, keeping the others in opening order; the new count."""
    for s in range(slot, open_count - 1):
        open_row[s] = open_row[s + 1]
        open_used[s] = open_used[s + 1]
    return open_count - 1


@njit(cache=True)
def plan_best_fit(
    lengths, capacity, open_rows, row_of, column_of, open_row, open_used
):  # pragma: no cover - compiled
    """Place example ``i`` at ``(row_of[i], column_of[i])`` by bounded best-fit.

    Examples are taken in supplied order. Each goes to the open row with the least room
    that still fits it (ties: the earliest opened); when none fits, a new row is opened
    at the end, first closing the fullest open row (ties: the earliest opened) if
    ``open_rows`` are already open. A row that becomes exactly full closes at once.
    Rows are numbered in the order they open. ``open_row``/``open_used`` are scratch of
    ``open_rows`` entries: the open rows in opening order and the cells each has used.
    Returns the number of rows used.
    """
    open_count = 0
    rows = 0
    for i in range(lengths.shape[0]):
        length = lengths[i]
        best = -1
        best_room = capacity + 1
        for s in range(open_count):
            room = capacity - open_used[s]
            if length <= room < best_room:
                best, best_room = s, room
        if best < 0:
            if open_count == open_rows:
                fullest = 0
                for s in range(1, open_count):
                    if open_used[s] > open_used[fullest]:
                        fullest = s
                open_count = _close_slot(fullest, open_count, open_row, open_used)
            open_row[open_count] = rows
            open_used[open_count] = 0
            best = open_count
            open_count += 1
            rows += 1
        row_of[i] = open_row[best]
        column_of[i] = open_used[best]
        open_used[best] += length
        if open_used[best] == capacity:
            open_count = _close_slot(best, open_count, open_row, open_used)
    return rows


@njit(cache=True)
def group_by_row(row_of, row_first, order):  # pragma: no cover - compiled
    """Examples grouped by row, each row's in supplied order (which is their column
    order: a row only ever grows at its end): row ``r`` holds examples
    ``order[row_first[r] : row_first[r + 1]]``. A stable counting sort; ``row_first``
    has ``rows + 1`` entries and is used as the cursor scratch too."""
    row_first[:] = 0
    for i in range(row_of.shape[0]):
        row_first[row_of[i] + 1] += 1
    for r in range(1, row_first.shape[0]):
        row_first[r] += row_first[r - 1]
    for i in range(row_of.shape[0]):  # row_first[r] is row r's next free place ...
        order[row_first[row_of[i]]] = i
        row_first[row_of[i]] += 1
    for r in range(row_first.shape[0] - 1, 0, -1):  # ... and ends at row r+1's first
        row_first[r] = row_first[r - 1]
    row_first[0] = 0


@njit(inline="always")
def _write_example(
    tokens,
    mask,
    base,
    length,
    r,
    column,
    segment,
    inputs,
    targets,
    segments,
    positions,
    input_valid,
    target_valid,
    loss_mask,
    segment_starts,
):  # pragma: no cover - compiled
    """Cells ``column .. column+length-1`` of row ``r``: one example's ``length`` pairs,
    read from ``tokens[base : base + length + 1]``; the pair predicting token ``t`` is
    loss-eligible when ``mask`` is empty or marks ``t`` (rule C5)."""
    masked = mask.shape[0] > 0
    for j in range(length):
        c = column + j
        inputs[r, c] = tokens[base + j]
        targets[r, c] = tokens[base + j + 1]
        segments[r, c] = segment
        positions[r, c] = j
        input_valid[r, c] = True
        target_valid[r, c] = True
        segment_starts[r, c] = column
    if masked:
        for j in range(length):
            loss_mask[r, column + j] = mask[base + j + 1] != 0
    else:
        for j in range(length):
            loss_mask[r, column + j] = True


@njit(inline="always")
def _write_padding(
    r,
    column,
    inputs,
    targets,
    segments,
    positions,
    input_valid,
    target_valid,
    loss_mask,
    segment_starts,
):  # pragma: no cover - compiled
    """Cells ``column ..`` of row ``r``: padding (rule C5)."""
    for c in range(column, inputs.shape[1]):
        inputs[r, c] = -1
        targets[r, c] = -1
        segments[r, c] = -1
        positions[r, c] = 0
        input_valid[r, c] = False
        target_valid[r, c] = False
        loss_mask[r, c] = False
        segment_starts[r, c] = -1


@njit(parallel=True, cache=True)
def fill_rows(
    tokens,
    mask,
    offsets,
    doc,
    start,
    stop,
    order,
    row_first,
    first_segment,
    inputs,
    targets,
    segments,
    positions,
    input_valid,
    target_valid,
    loss_mask,
    segment_starts,
    valid_lengths,
):  # pragma: no cover - compiled
    """Write every cell of every row once: the occurrences in order, then padding.

    Row ``r`` holds examples ``order[row_first[r] .. row_first[r+1]-1]``, left to right
    (next-fit's ``order`` is ``0, 1, 2, ...``); example ``i`` gets segment
    ``first_segment + i``; ``mask`` is aligned with ``tokens`` (empty: none). Rows are
    independent, so threads split them with no shared
    writes.
    """
    for r in prange(row_first.shape[0] - 1):
        column = 0
        for j in range(row_first[r], row_first[r + 1]):
            i = order[j]
            length = stop[i] - start[i] - 1
            _write_example(
                tokens,
                mask,
                offsets[doc[i]] + start[i],
                length,
                r,
                column,
                first_segment + i,
                inputs,
                targets,
                segments,
                positions,
                input_valid,
                target_valid,
                loss_mask,
                segment_starts,
            )
            column += length
        valid_lengths[r] = column
        _write_padding(
            r,
            column,
            inputs,
            targets,
            segments,
            positions,
            input_valid,
            target_valid,
            loss_mask,
            segment_starts,
        )


@njit(cache=True)
def fill_compact(
    tokens,
    mask,
    occurrences,
    inputs,
    targets,
    segments,
    positions,
    input_valid,
    target_valid,
    loss_mask,
    segment_starts,
    valid_lengths,
):  # pragma: no cover - compiled
    """``fill_rows`` for a checked compact batch, straight from its occurrence records:
    occurrence ``i`` fills columns ``start .. stop-1`` of its row from the next
    ``stop - start + 1`` tokens (and mask values: ``mask`` is aligned with ``tokens``,
    empty when the batch has none). One thread: a batch is small, and the consumer that
    expands it has a trainer to feed on its other cores. The records come whole, not
    as field views: a view of one record is C-contiguous, of more is strided, and each
    layout would be another compiled (and cached) specialization."""
    base = 0
    i = 0
    for r in range(inputs.shape[0]):
        column = 0
        while i < occurrences.shape[0] and occurrences[i].row == r:
            record = occurrences[i]
            length = record.stop - record.start
            _write_example(
                tokens,
                mask,
                base,
                length,
                r,
                record.start,
                record.segment,
                inputs,
                targets,
                segments,
                positions,
                input_valid,
                target_valid,
                loss_mask,
                segment_starts,
            )
            base += length + 1
            column = record.stop
            i += 1
        valid_lengths[r] = column
        _write_padding(
            r,
            column,
            inputs,
            targets,
            segments,
            positions,
            input_valid,
            target_valid,
            loss_mask,
            segment_starts,
        )


@njit(parallel=True, cache=True)
def gather_ranges(tokens, offsets, doc, start, stop, out_offsets, out):  # pragma: no cover
    """Copy example ``i``'s selected tokens to ``out[out_offsets[i]:out_offsets[i+1]]``."""
    for i in prange(doc.shape[0]):
        base = offsets[doc[i]] + start[i]
        target = out_offsets[i]
        n = stop[i] - start[i]
        # A block copy per range (corpus_cpu.copy_slice): several times faster than an
        # element loop indexing the whole arrays, on ranges of hundreds of tokens.
        copy_slice(tokens[base : base + n], out[target : target + n])


@njit(parallel=True, cache=True)
def gather_ranges_masked(
    tokens, mask, offsets, doc, start, stop, out_offsets, out, out_mask
):  # pragma: no cover - compiled
    """:func:`gather_ranges` of the tokens and their supervision mask in one pass (one
    loop over the ranges, not two)."""
    for i in prange(doc.shape[0]):
        base = offsets[doc[i]] + start[i]
        target = out_offsets[i]
        n = stop[i] - start[i]
        copy_slice(tokens[base : base + n], out[target : target + n])  # as gather_ranges
        copy_slice(mask[base : base + n], out_mask[target : target + n])


#: Codes of :func:`check_compact`, in the order it tests them.
COMPACT_OK, COMPACT_ROWS, COMPACT_START, COMPACT_COLUMNS, COMPACT_ORDINAL = 0, 1, 2, 3, 4
COMPACT_SEGMENT, COMPACT_RANGE, COMPACT_TOKEN_COUNT, COMPACT_VOCABULARY = 5, 6, 7, 8


@njit(cache=True)
def check_compact(occurrences, tokens, rows, capacity, vocab_size):  # pragma: no cover
    """One pass over a compact batch from elsewhere: ``(COMPACT_OK, 0)`` or the first
    broken rule as ``(code, index)`` — the occurrence (or token) that breaks it.

    What it proves is what the fill relies on: rows run ``0 .. rows-1`` without a gap,
    each occurrence starts where the one before it in its row ended and stays inside
    the row, and the tokens are exactly the ranges' tokens, inside the vocabulary —
    and what block-causal permission relies on: along each row, ordinals (= segments)
    strictly increase, so no two occurrences of a row share a segment. (Next-fit's
    ordinals are consecutive across the batch; best-fit's are not, a row taking later
    examples before an earlier row's.) (Records whole, not field views: see
    :func:`fill_compact`.)
    """
    n = occurrences.shape[0]
    total = 0
    for i in range(n):
        record = occurrences[i]
        expected_row = 0 if i == 0 else occurrences[i - 1].row
        if not (record.row == expected_row or (i > 0 and record.row == expected_row + 1)):
            return COMPACT_ROWS, i
        if i == n - 1 and record.row != rows - 1:
            return COMPACT_ROWS, i
        new_row = i == 0 or record.row != occurrences[i - 1].row
        expected_start = 0 if new_row else occurrences[i - 1].stop
        if record.start != expected_start:
            return COMPACT_START, i
        if not record.start < record.stop <= capacity:
            return COMPACT_COLUMNS, i
        if (
            record.ordinal < 0
            or record.ordinal >= 2**31
            or not (new_row or record.ordinal > occurrences[i - 1].ordinal)
        ):
            return COMPACT_ORDINAL, i
        if record.segment != record.ordinal:
            return COMPACT_SEGMENT, i
        if record.range_stop - record.range_start != record.stop - record.start + 1:
            return COMPACT_RANGE, i
        total += record.stop - record.start + 1
    if total != tokens.shape[0]:
        return COMPACT_TOKEN_COUNT, total
    # A min/max reduction vectorises; a loop with an early exit does not (10x slower).
    low, high = 0, 0
    if tokens.shape[0] > 0:
        low, high = tokens[0], tokens[0]
    for j in range(tokens.shape[0]):
        low = min(low, tokens[j])
        high = max(high, tokens[j])
    if low < 0 or high >= vocab_size:
        for j in range(tokens.shape[0]):
            if not 0 <= tokens[j] < vocab_size:
                return COMPACT_VOCABULARY, j
    return COMPACT_OK, 0
