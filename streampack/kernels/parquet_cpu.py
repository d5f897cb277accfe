"""Compiled decoding of Parquet's RLE / bit-packed hybrid streams, for the token
column's pages (``streampack.corpus.parquet_pages`` walks the pages and calls these).

The hybrid encoding is a sequence of runs, each headed by a ULEB128 varint: an even
header ``2k`` is a run of ``k`` copies of one value (stored in ``ceil(width / 8)``
little-endian bytes), an odd header ``2g + 1`` is ``8g`` values bit-packed
least-significant bit first, ``width`` bits each. Levels and dictionary indices both
use it. Levels are read run by run, never expanded: a document of a few hundred tokens
is one short bit-packed group and one run of repetition level 1.

Every function reads only inside ``data[pos:end]`` and returns -1 where the stream is
malformed (ends early, an index outside the dictionary, a level outside its range):
the caller then reads the row group with pyarrow, whose error names the problem.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _varint(data, pos, end):  # pragma: no cover - compiled
    """``(value, next position)`` of the ULEB128 varint at ``pos``; ``(-1, end)`` when
    it runs past ``end``."""
    value = 0
    shift = 0
    while pos < end:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 56:
            break
    return -1, end


@njit(cache=True, nogil=True)
def _run_value(data, pos, end, width):  # pragma: no cover - compiled
    """The value of a repeated run, ``ceil(width / 8)`` little-endian bytes at ``pos``;
    ``(-1, end)`` when they run past ``end``."""
    size = (width + 7) // 8
    if pos + size > end:
        return -1, end
    value = 0
    for k in range(size):
        value |= data[pos + k] << (8 * k)
    return value, pos + size


@njit(cache=True, nogil=True)
def _run(data, pos, end, width, left):  # pragma: no cover - compiled
    """The run of the hybrid stream at ``pos``, of which ``left`` values are still
    wanted: ``(repeated, n, value, start, next)``. Repeated: ``n`` copies of
    ``value``; else ``n`` values bit-packed from ``start`` (a last group's padding
    past ``left`` not counted). ``next``: where the next run starts; ``n`` is -1 where
    the stream is malformed."""
    header, pos = _varint(data, pos, end)
    if header < 0:
        return False, -1, 0, pos, end
    if header & 1 == 0:
        n = header >> 1
        value, after = _run_value(data, pos, end, width)
        if value < 0 or n > left:
            return True, -1, 0, pos, end
        return True, n, value, pos, after
    groups = header >> 1
    after = pos + groups * width
    if after > end:
        return False, -1, 0, pos, end
    return False, min(groups * 8, left), 0, pos, after


@njit(cache=True, nogil=True)
def dictionary_values(data, pos, end, width, count, dictionary, out, at_out):  # pragma: no cover
    """``out[at_out:at_out + count] = dictionary[index]`` for the next ``count``
    indices of the hybrid stream at ``data[pos:end]`` (``width`` bits each); ``count``,
    or -1 (malformed, or an empty dictionary, or indices wider than 32 bits)."""
    size = dictionary.shape[0]
    if count > 0 and (size == 0 or width > 32):
        return -1
    done = 0
    while done < count:
        repeated, n, index, start, pos = _run(data, pos, end, width, count - done)
        if n < 0:
            return -1
        at = at_out + done
        if repeated:
            if index >= size:
                return -1
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
                return -1
        done += n
    return count


@njit(cache=True, nogil=True)
def levels_all_equal(data, pos, end, width, count, level):  # pragma: no cover - compiled
    """Whether the next ``count`` levels of the hybrid stream all equal ``level``
    (1), some do not (0), or the stream is malformed (-1)."""
    mask = (1 << width) - 1
    done = 0
    while done < count:
        repeated, n, value, start, pos = _run(data, pos, end, width, count - done)
        if n < 0:
            return -1
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
    that starts one. Returns the new number of rows, or -1 when the stream is
    malformed or holds more rows than ``starts`` has room for."""
    room = starts.shape[0]
    done = 0
    while done < count:
        repeated, n, value, start, pos = _run(data, pos, end, 1, count - done)
        if n < 0 or value > 1:
            return -1
        if repeated:
            if value == 0:
                if rows + n > room:
                    return -1
                for k in range(n):
                    starts[rows + k] = first + done + k
                rows += n
        else:
            for k in range(n):
                if (data[start + (k >> 3)] >> (k & 7)) & 1 == 0:
                    if rows >= room:
                        return -1
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
