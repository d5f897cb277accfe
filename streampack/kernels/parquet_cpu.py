"""Compiled decoding of Parquet's RLE / bit-packed hybrid streams, for the token
column's pages (``streampack.corpus.parquet_pages`` walks the pages and calls these).

The hybrid encoding is a sequence of runs, each headed by a ULEB128 varint: an even
header ``2k`` is a run of ``k`` copies of one value (stored in ``ceil(width / 8)``
little-endian bytes), an odd header ``2g + 1`` is ``8g`` values bit-packed
least-significant bit first, ``width`` bits each. Levels and dictionary indices both
use it. Levels are read run by run, never expanded: a document of a few hundred tokens
is one short bit-packed group and one run of repetition level 1.

Every read is inside the buffer by a check made before it: each function first checks
that ``data[pos:end]`` lies inside ``data`` (and its output slice inside its output),
each run's bytes are checked to end inside the stream before any is read, and a run's
header is at most 5 bytes and 32 bits, as pyarrow reads it, so no size computed from it
overflows. A malformed stream gives one of the negative codes below (ends early, a
run of zero or too many values, an index outside the dictionary, a level outside its
range); ``streampack.corpus.parquet_pages`` turns a code into a message (messages stay
out of compiled code) and leaves the row group to pyarrow.
"""

from __future__ import annotations

import numpy as np
from numba import njit

ENDS_EARLY = -1  # the stream ends before its values do
BAD_RUN = -2  # a run header of zero values, over 5 bytes, or more values than wanted
PAST_DICTIONARY = -3  # an index past the dictionary (or an empty dictionary)
BAD_LEVEL = -4  # a level outside its range, or more rows than the row group holds
BAD_WIDTH = -5  # a bit width past 32
OUT_OF_BOUNDS = -6  # the stream or the output slice lies outside its array


@njit(cache=True, nogil=True)
def _varint(data, pos, end):  # pragma: no cover - compiled
    """``(value, next position)`` of the run header at ``pos``: a ULEB128 varint of at
    most 5 bytes and 32 bits (pyarrow's limit); ``(code, end)`` past ``end`` or over."""
    value = 0
    for k in range(5):
        if pos >= end:
            return ENDS_EARLY, end
        byte = data[pos]
        pos += 1
        value |= np.int64(byte & 0x7F) << (7 * k)
        if byte < 0x80:
            if value > 0xFFFFFFFF:
                return BAD_RUN, end
            return value, pos
    return BAD_RUN, end


@njit(cache=True, nogil=True)
def _run_value(data, pos, end, width):  # pragma: no cover - compiled
    """The value of a repeated run, ``ceil(width / 8)`` little-endian bytes at ``pos``;
    ``(ENDS_EARLY, end)`` when they run past ``end``."""
    size = (width + 7) // 8
    if pos + size > end:
        return ENDS_EARLY, end
    value = 0
    for k in range(size):
        value |= np.int64(data[pos + k]) << (8 * k)
    return value, pos + size


@njit(cache=True, nogil=True)
def _run(data, pos, end, width, left):  # pragma: no cover - compiled
    """The run of the hybrid stream at ``pos``, of which ``left`` values are still
    wanted: ``(repeated, n, value, start, next)``. Repeated: ``n`` copies of
    ``value``; else ``n`` values bit-packed from ``start`` (a last group's padding
    past ``left`` not counted). ``next``: where the next run starts; ``n`` is a
    negative code where the stream is malformed (a run of zero values included:
    pyarrow ends the stream there)."""
    header, pos = _varint(data, pos, end)
    if header < 0:
        return False, header, 0, pos, end
    count = header >> 1  # below 2**31: no product below overflows
    if count == 0:
        return False, BAD_RUN, 0, pos, end
    if header & 1 == 0:
        value, after = _run_value(data, pos, end, width)
        if value < 0:
            return True, value, 0, pos, end
        if count > left:
            return True, BAD_RUN, 0, pos, end
        return True, count, value, pos, after
    after = pos + count * width
    if after > end:
        return False, ENDS_EARLY, 0, pos, end
    return False, min(count * 8, left), 0, pos, after


@njit(cache=True, nogil=True)
def _outside(data, pos, end):  # pragma: no cover - compiled
    """Whether ``data[pos:end]`` is not a slice of ``data``."""
    return pos < 0 or pos > end or end > data.shape[0]


@njit(cache=True, nogil=True)
def dictionary_values(data, pos, end, width, count, dictionary, out, at_out):  # pragma: no cover
    """``out[at_out:at_out + count] = dictionary[index]`` for the next ``count``
    indices of the hybrid stream at ``data[pos:end]`` (``width`` bits each); ``count``,
    or a negative code (malformed, an index past the dictionary or an empty one,
    indices wider than 32 bits)."""
    size = dictionary.shape[0]
    if _outside(data, pos, end) or count < 0 or at_out < 0 or at_out + count > out.shape[0]:
        return OUT_OF_BOUNDS
    if width < 0 or width > 32:
        return BAD_WIDTH
    if count > 0 and size == 0:
        return PAST_DICTIONARY
    done = 0
    while done < count:
        repeated, n, index, start, pos = _run(data, pos, end, width, count - done)
        if n < 0:
            return n
        at = at_out + done
        if repeated:
            if index >= size:
                return PAST_DICTIONARY
            value = dictionary[index]
            for k in range(n):
                out[at + k] = value
        else:
            # 4-byte windows for the indices whose window ends inside the stream
            # (index k's starts at byte (k * width) >> 3); bit by bit for the rest.
            fast = 0
            room = end - start - 4  # the last byte a window may start at, from start
            if 0 < width <= 25 and room >= 0:
                fast = min(n, ((room + 1) * 8 - 1) // width + 1)
            top = _packed_from_windows(data, start, width, fast, dictionary, out, at)
            rest = _packed_bit_by_bit(
                data, start, width, fast, n - fast, dictionary, out, at + fast
            )
            if max(top, rest) >= size:
                return PAST_DICTIONARY
        done += n
    return count


@njit(cache=True, nogil=True)
def levels_all_equal(data, pos, end, width, count, level):  # pragma: no cover - compiled
    """Whether the next ``count`` levels of the hybrid stream all equal ``level``
    (1), some do not (0), or the stream is malformed (a negative code)."""
    if _outside(data, pos, end) or count < 0:
        return OUT_OF_BOUNDS
    if width < 1 or width > 32:
        return BAD_WIDTH
    mask = (1 << width) - 1
    done = 0
    while done < count:
        repeated, n, value, start, pos = _run(data, pos, end, width, count - done)
        if n < 0:
            return n
        if repeated:
            if value != level and n > 0:
                return 0
        else:
            held = 0  # bits not yet used, lowest first
            bits = 0
            for _ in range(n):
                while bits < width:
                    held |= data[start] << bits
                    start += 1
                    bits += 8
                if held & mask != level:
                    return 0
                held >>= width
                bits -= width
        done += n
    return 1


@njit(cache=True, nogil=True)
def row_starts(data, pos, end, count, first, starts, rows):  # pragma: no cover - compiled
    """Walk the next ``count`` repetition levels (width 1; level 0 starts a row) and
    write ``first + k`` to ``starts[rows], starts[rows + 1], ...`` for each entry ``k``
    that starts one. Returns the new number of rows, or a negative code when the
    stream is malformed or holds more rows than ``starts`` has room for."""
    room = starts.shape[0]
    if _outside(data, pos, end) or count < 0 or rows < 0:
        return OUT_OF_BOUNDS
    done = 0
    while done < count:
        repeated, n, value, start, pos = _run(data, pos, end, 1, count - done)
        if n < 0:
            return n
        if value > 1:
            return BAD_LEVEL
        if repeated:
            if value == 0:
                if rows + n > room:
                    return BAD_LEVEL
                for k in range(n):
                    starts[rows + k] = first + done + k
                rows += n
        else:
            for k in range(n):
                if (data[start + (k >> 3)] >> (k & 7)) & 1 == 0:
                    if rows >= room:
                        return BAD_LEVEL
                    starts[rows] = first + done + k
                    rows += 1
        done += n
    return rows


@njit(cache=True, nogil=True)
def _packed_from_windows(data, pos, width, take, dictionary, out, at):  # pragma: no cover
    """``out[at + k] = dictionary[index k]`` for ``take`` bit-packed indices at
    ``data[pos:]``, each read from the 4-byte window at its first byte (the caller
    checked every window ends inside the stream and ``0 < width <= 25``). Returns the
    largest index; one past the dictionary is looked up as its last entry (the caller
    then refuses the page). All unsigned: Numba checks a signed index for a negative
    value on every access, which made this 3x slower."""
    w = np.uint64(width)
    mask = np.uint64((1 << width) - 1)
    last = np.uint64(dictionary.shape[0] - 1)
    start = np.uint64(pos)
    first = np.uint64(at)
    three = np.uint64(3)
    seven = np.uint64(7)
    top = np.uint64(0)
    for k in range(np.uint64(take)):
        bit = k * w
        lo = start + (bit >> three)
        word = (
            np.uint64(data[lo])
            | (np.uint64(data[lo + np.uint64(1)]) << np.uint64(8))
            | (np.uint64(data[lo + np.uint64(2)]) << np.uint64(16))
            | (np.uint64(data[lo + three]) << np.uint64(24))
        )
        index = (word >> (bit & seven)) & mask
        top = max(top, index)
        out[first + k] = dictionary[min(index, last)]
    return np.int64(top)


@njit(cache=True, nogil=True)
def _packed_bit_by_bit(data, pos, width, skip, take, dictionary, out, at):  # pragma: no cover
    """``_packed_from_windows`` bit by bit, for ``take`` indices after the first
    ``skip``: the last few of a stream, and widths 0 and past 25."""
    last = dictionary.shape[0] - 1
    top = 0
    for k in range(take):
        index = 0
        for b in range(width):
            bit = (skip + k) * width + b
            index |= ((data[pos + (bit >> 3)] >> (bit & 7)) & 1) << b
        top = max(top, index)
        out[at + k] = dictionary[min(index, last)]
    return top
