"""Compiled corpus reading: gathering documents' ranges into one array, and the steps
of a bounded shuffle buffer.

Pure functions over arrays; the callers (``streampack.corpus.gather``,
``streampack.corpus.order``) allocate every output and check every index, so nothing
here can fail on user data. Plain-Python references: ``streampack.reference.corpus``.
"""

from __future__ import annotations

from numba import njit


@njit(cache=True)
def gather_ranges_into(values, starts, lengths, out):  # pragma: no cover - compiled
    """``out`` = ``values[starts[i]:starts[i] + lengths[i]]`` for each i, concatenated.

    One pass, a copy loop per range: a shuffled window's documents from all over a
    memory map, without the two index arrays of a NumPy fancy-index gather."""
    at = 0
    for i in range(starts.shape[0]):
        lo = starts[i]
        for k in range(lengths[i]):
            out[at + k] = values[lo + k]
        at += lengths[i]


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
