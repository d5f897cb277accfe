"""Compiled corpus reading: gathering documents' ranges into one array, and the steps
of a bounded shuffle buffer.

Pure functions over arrays; the callers (``streampack.corpus.gather``,
``streampack.corpus.order``) allocate every output and check every index, so nothing
here can fail on user data. Plain-Python references: ``streampack.reference.corpus``.
"""

from __future__ import annotations

from numba import njit


@njit(inline="always")
def copy_slice(source, target):  # pragma: no cover - compiled
    """``target[:] = source`` for two 1-D slices of one length: an element loop over
    the slices themselves, which LLVM turns into a block copy (measured 2.5-4x faster
    than ``target[:] = source``, Numba's generic slice assignment, and than indexing
    the whole arrays from an offset, on ranges of ~240 tokens; in ``pack_cpu``'s
    parallel gathers, on a par with the slice assignment). Every range copy of the
    kernels is this one. Inlined: Numba's cache does not see a change here in the
    kernels of another file that use it, so clear ``NUMBA_CACHE_DIR`` after one."""
    for k in range(source.shape[0]):
        target[k] = source[k]


@njit(cache=True)
def gather_ranges_into(values, starts, lengths, out):  # pragma: no cover - compiled
    """``out`` = ``values[starts[i]:starts[i] + lengths[i]]`` for each i, concatenated.

    One pass, a copy per range: a shuffled window's documents from all over a memory
    map, without the two index arrays of a NumPy fancy-index gather."""
    at = 0
    for i in range(starts.shape[0]):
        lo = starts[i]
        n = lengths[i]
        copy_slice(values[lo : lo + n], out[at : at + n])
        at += n


@njit(cache=True)
def copy_ranges(values, starts, lengths, out, out_starts):  # pragma: no cover - compiled
    """``out[out_starts[i]:][:lengths[i]] = values[starts[i]:][:lengths[i]]`` for each
    i: the documents of one part of a corpus, each to its place in a window."""
    for i in range(starts.shape[0]):
        lo = starts[i]
        at = out_starts[i]
        n = lengths[i]
        copy_slice(values[lo : lo + n], out[at : at + n])


@njit(cache=True)
def document_token_starts(documents, pointers, shift, total, at, out):  # pragma: no cover
    """``out[i]``: the first token of Megatron document ``at[i]``, whose first sequence
    is ``documents[at[i]]`` and starts at byte ``pointers[...]`` (``>> shift``: tokens
    of ``1 << shift`` bytes); the sentinel sequence ``len(pointers)`` starts at
    ``total``. One pass, two dependent reads per document, no temporaries."""
    count = pointers.shape[0]
    for i in range(at.shape[0]):
        sequence = documents[at[i]]
        out[i] = pointers[sequence] >> shift if sequence < count else total


@njit(cache=True)
def shuffle_buffer_steps(buffer, slots, incoming, emitted):  # pragma: no cover - compiled
    """A full shuffle buffer taking ``incoming[j]``: it emits the item in slot
    ``slots[j]`` (``emitted[j]``) and holds the new one there instead."""
    for j in range(slots.shape[0]):
        slot = slots[j]
        emitted[j] = buffer[slot]
        buffer[slot] = incoming[j]


@njit(cache=True)
def shuffle_buffer_drain(buffer, slots, emitted):  # pragma: no cover - compiled
    """Empty the buffer: step j emits slot ``slots[j]`` (``< len(buffer) - j``) and
    moves the last held item into it. ``buffer`` is left in an unspecified order."""
    n = buffer.shape[0]
    for j in range(n):
        last = n - 1 - j
        slot = slots[j]
        emitted[j] = buffer[slot]
        buffer[slot] = buffer[last]


# JSON Lines of token lists: the bytes a line of the plain shape is made of.
_SPACE, _TAB, _CR, _LF = 32, 9, 13, 10
_QUOTE, _BACKSLASH, _COLON, _COMMA, _MINUS = 34, 92, 58, 44, 45
_OPEN_LIST, _CLOSE_LIST, _OPEN_OBJECT, _CLOSE_OBJECT = 91, 93, 123, 125
_ZERO, _NINE = 48, 57
_MAX_DIGITS = 18  # any 18-digit integer fits in int64: no overflow check needed
# The range of the token and mask arrays the parser writes (int32: a long line's
# tokens cost half what int64 would); a line with a list value outside it goes to json.
_LIST_MIN, _LIST_MAX = -(2**31), 2**31 - 1


@njit(inline="always")
def _skip_space(buf, p, end):  # pragma: no cover - compiled
    while p < end and (buf[p] == _SPACE or buf[p] == _TAB or buf[p] == _CR or buf[p] == _LF):
        p += 1
    return p


@njit(inline="always")
def _integer(buf, p, end):  # pragma: no cover - compiled
    """(ok, value, next position) of a JSON integer at ``p``: ``-?(0|[1-9][0-9]*)`` of
    at most 18 digits, not followed by a fraction or an exponent."""
    negative = False
    if p < end and buf[p] == _MINUS:
        negative = True
        p += 1
    if p >= end or buf[p] < _ZERO or buf[p] > _NINE:
        return False, 0, p
    value = 0
    digits = 0
    if buf[p] == _ZERO:
        p += 1
        digits = 1
    else:
        while p < end and _ZERO <= buf[p] <= _NINE:
            value = value * 10 + (buf[p] - _ZERO)
            p += 1
            digits += 1
    if digits > _MAX_DIGITS:
        return False, 0, p
    if p < end and (buf[p] == 46 or buf[p] == 101 or buf[p] == 69 or _ZERO <= buf[p] <= _NINE):
        return False, 0, p  # ".", "e", "E" (a float) or a digit after a leading 0
    return True, -value if negative else value, p


@njit(inline="always")
def _integer_list(buf, p, end, out, n):  # pragma: no cover - compiled
    """(ok, next position, values written) of a JSON list of integers at ``p``, each
    in int32's range, written to ``out`` from ``n``."""
    if p >= end or buf[p] != _OPEN_LIST:
        return False, p, n
    p = _skip_space(buf, p + 1, end)
    if p < end and buf[p] == _CLOSE_LIST:
        return True, p + 1, n
    while True:
        ok, value, p = _integer(buf, p, end)
        if not ok or value < _LIST_MIN or value > _LIST_MAX:
            return False, p, n
        out[n] = value
        n += 1
        p = _skip_space(buf, p, end)
        if p < end and buf[p] == _COMMA:
            p = _skip_space(buf, p + 1, end)
        elif p < end and buf[p] == _CLOSE_LIST:
            return True, p + 1, n
        else:
            return False, p, n


@njit(cache=True)
def parse_token_lines(
    buf, starts, ends, keys, key_lengths, accepted, lists, scalars, tokens, mask
):  # pragma: no cover - compiled
    """Parse each line ``buf[starts[i]:ends[i]]`` of the plain shape
    ``{"KEY": VALUE, ...}``, or leave it to ``json`` (``accepted[i] = False``).

    Keys are ``keys[k, :key_lengths[k]]`` (ASCII, no escapes): 0 ``tokens`` and 4 the
    mask field take a list of integers, 1-3 (``id``, ``start``, ``stop``) one integer.
    A line is accepted when it is one JSON object of known keys, each at most once,
    ``tokens`` among them (and the mask field when ``key_lengths[4] > 0``), with only
    integers of at most 18 digits (those of the lists in int32's range, the dtype of
    ``tokens`` and ``mask``), JSON whitespace and nothing else — a subset of what
    ``json.loads`` reads, read the same way. ``lists[i]`` = (token start, count, mask
    start, count) in ``tokens`` / ``mask``; ``scalars[i, k - 1]`` the integer of key k,
    ``scalars[i, 3]`` a bitmask of the keys present."""
    n_tokens = 0
    n_mask = 0
    want_mask = key_lengths[4] > 0
    for i in range(starts.shape[0]):
        end = ends[i]
        first_token, first_mask = n_tokens, n_mask
        accepted[i] = False
        p = _skip_space(buf, starts[i], end)
        if p >= end or buf[p] != _OPEN_OBJECT:
            continue
        p = _skip_space(buf, p + 1, end)
        seen = 0
        ok = True
        while ok:
            if p >= end or buf[p] != _QUOTE:
                ok = False
                break
            q = p + 1
            while q < end and buf[q] != _QUOTE and buf[q] != _BACKSLASH and 32 <= buf[q] < 128:
                q += 1
            if q >= end or buf[q] != _QUOTE:
                ok = False
                break
            key = -1
            for k in range(keys.shape[0]):
                length = key_lengths[k]
                if length == q - p - 1:
                    same = True
                    for c in range(length):
                        if buf[p + 1 + c] != keys[k, c]:
                            same = False
                            break
                    if same:
                        key = k
                        break
            if key < 0 or (seen >> key) & 1:
                ok = False
                break
            seen |= 1 << key
            p = _skip_space(buf, q + 1, end)
            if p >= end or buf[p] != _COLON:
                ok = False
                break
            p = _skip_space(buf, p + 1, end)
            if key == 0:
                ok, p, n_tokens = _integer_list(buf, p, end, tokens, n_tokens)
            elif key == 4:
                ok, p, n_mask = _integer_list(buf, p, end, mask, n_mask)
            else:
                ok, value, p = _integer(buf, p, end)
                scalars[i, key - 1] = value
            if not ok:
                break
            p = _skip_space(buf, p, end)
            if p < end and buf[p] == _COMMA:
                p = _skip_space(buf, p + 1, end)
            elif p < end and buf[p] == _CLOSE_OBJECT:
                p = _skip_space(buf, p + 1, end)
                break
            else:
                ok = False
        if ok and p == end and seen & 1 and (not want_mask or (seen >> 4) & 1):
            accepted[i] = True
            lists[i, 0] = first_token
            lists[i, 1] = n_tokens - first_token
            lists[i, 2] = first_mask
            lists[i, 3] = n_mask - first_mask
            scalars[i, 3] = seen
        else:
            n_tokens, n_mask = first_token, first_mask


@njit(cache=True)
def solid_lines(buf, starts, ends, out):  # pragma: no cover - compiled
    """``out[i]``: line ``buf[starts[i]:ends[i]]`` holds a byte that ``bytes.strip()``
    does not strip (space, \\t, \\n, \\r, \\x0b, \\x0c): it is not blank."""
    for i in range(starts.shape[0]):
        out[i] = False
        for p in range(starts[i], ends[i]):
            c = buf[p]
            if c != 32 and not (9 <= c <= 13):
                out[i] = True
                break
