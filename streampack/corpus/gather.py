"""Gathering documents: the ranges of a flat array, concatenated, in one compiled call
(``streampack.kernels.corpus_cpu``) rather than a NumPy fancy index, which builds two
index arrays of the output's size first. A remote array (``storage.RemoteArray``) has
its ranges read the same way from the cache's mapping of its blocks (``RemoteArray.view``),
or, where the cache does not map them, fetched back to back first, then copied."""

from __future__ import annotations

from typing import Any

import numpy as np

from streampack.corpus.storage import RemoteArray
from streampack.errors import InternalError


def gather_ranges(
    values: Any, starts: np.ndarray, lengths: np.ndarray, dtype: Any = None
) -> np.ndarray:
    """``values[starts[i]:starts[i] + lengths[i]]`` for each i, concatenated, in
    ``dtype`` (default ``values``' own, in native byte order). ``values`` is an array
    (a memory map is read in place); every range must lie inside it."""
    from streampack.kernels.corpus_cpu import gather_ranges_into

    if isinstance(values, RemoteArray):
        with values.view(starts, lengths) as whole:  # its cached blocks, side by side
            if whole is not None:
                return gather_ranges(whole, starts, lengths, dtype)
        values, starts = _fetched(values, starts, lengths)  # the ranges, back to back
    values = np.asarray(values)
    starts = np.ascontiguousarray(starts, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    native_dtype = values.dtype.newbyteorder("=")  # what the kernels and windows hold
    out = np.empty(int(lengths.sum()), native_dtype if dtype is None else dtype)
    if not len(out):
        return out
    # Our bug if not: the readers check offsets against their arrays when they open.
    if (
        int(lengths.min()) < 0
        or int(starts.min()) < 0
        or int((starts + lengths).max()) > len(values)
    ):
        raise InternalError("gather_ranges: a range lies outside its array (a bug)")
    if values.dtype == np.bool_ and out.dtype != np.bool_:
        values = values.view(np.uint8)
    if not values.dtype.isnative:
        # A shard of the other byte order (">i4"): Numba takes native arrays only, so
        # gather its bytes as the native dtype of that size, then swap them in place.
        native = np.empty(len(out), native_dtype)
        gather_ranges_into(values.view(native.dtype), starts, lengths, native)
        out[:] = native.byteswap(inplace=True)
        return out
    gather_ranges_into(values, starts, lengths, out)
    return out


def copy_ranges(
    values: Any, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray, out_starts: np.ndarray
) -> None:
    """``values[starts[i]:starts[i] + lengths[i]]`` into ``out`` at ``out_starts[i]``,
    for each i, in one compiled call (``values`` read in place: a memory map stays
    one)."""
    from streampack.kernels.corpus_cpu import copy_ranges as compiled

    if isinstance(values, RemoteArray):
        with values.view(starts, lengths) as whole:
            if whole is not None:
                return copy_ranges(whole, starts, lengths, out, out_starts)
        values, starts = _fetched(values, starts, lengths)
    values = np.asarray(values)  # a plain view of a memory map: no subclass per access
    starts = np.ascontiguousarray(starts, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    out_starts = np.ascontiguousarray(out_starts, np.int64)
    if not len(starts):
        return
    if (
        int(lengths.min()) < 0
        or int(starts.min()) < 0
        or int((starts + lengths).max()) > len(values)
        or int(out_starts.min()) < 0
        or int((out_starts + lengths).max()) > len(out)
    ):
        raise InternalError("copy_ranges: a range lies outside its array (a bug)")
    if values.dtype == np.bool_ and out.dtype != np.bool_:
        values = values.view(np.uint8)
    if not values.dtype.isnative:  # the other byte order: gathered and swapped first
        values = gather_ranges(values, starts, lengths)
        starts = np.cumsum(lengths) - lengths
    compiled(values, starts, lengths, out, out_starts)


def _fetched(values: RemoteArray, starts: Any, lengths: Any) -> tuple[np.ndarray, np.ndarray]:
    """The ranges of a remote array, fetched back to back, and where each now starts."""
    lengths = np.asarray(lengths, np.int64)
    return values.fetch(np.asarray(starts, np.int64), lengths), np.cumsum(lengths) - lengths
