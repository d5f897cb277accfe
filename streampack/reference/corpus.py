"""Plain-Python references for ``streampack.kernels.corpus_cpu`` (the tests compare
them): slow and obviously right."""

from __future__ import annotations

from typing import Any


def gather_ranges(values: Any, starts: list[int], lengths: list[int]) -> list[Any]:
    """``values[starts[i]:starts[i] + lengths[i]]`` for each i, concatenated."""
    out: list[Any] = []
    for lo, n in zip(starts, lengths, strict=True):
        out.extend(values[lo + k] for k in range(n))
    return out


def document_token_starts(
    documents: list[int], pointers: list[int], itemsize: int, total: int, at: list[int]
) -> list[int]:
    """The first token of each Megatron document ``at[i]``: its first sequence's byte
    pointer over the token size; the sentinel sequence (one past the last) starts at
    ``total``."""
    starts = []
    for d in at:
        sequence = documents[d]
        starts.append(pointers[sequence] // itemsize if sequence < len(pointers) else total)
    return starts


def shuffle_buffer(items: list[Any], size: int, draw: Any) -> list[Any]:
    """The order a bounded shuffle buffer of ``size`` emits ``items`` in, ``draw(n)``
    giving a slot in ``0..n-1``: once full, each new item takes the slot of the one
    it emits; at the end the held items come out one draw at a time, the last moving
    into the emptied slot."""
    buffer: list[Any] = []
    out: list[Any] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        slot = draw(len(buffer))
        out.append(buffer[slot])
        buffer[slot] = item
    while buffer:
        slot = draw(len(buffer))
        buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
        out.append(buffer.pop())
    return out
