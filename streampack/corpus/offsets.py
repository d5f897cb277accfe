"""Random access over documents stored as one token array plus document offsets.

Token shards, Arrow record batches and Megatron ``.bin`` files all store a corpus as
*parts*: a flat token array (memory-mapped) and the offsets where each document starts,
``tokens[offsets[i]:offsets[i + 1]]`` being document ``i`` of the part. One reader
serves them all: :class:`OffsetsReader`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from streampack.corpus.gather import copy_ranges, gather_ranges
from streampack.corpus.masks import labels_to_mask
from streampack.corpus.reader import BindingSpec, SingleSource
from streampack.corpus.storage import RemoteArray
from streampack.errors import InternalError, InvalidConfig

# Integer dtypes whose every value fits in int32: gathered into int32, not int64.
_NARROW = {np.dtype(d) for d in (np.int8, np.uint8, np.int16, np.uint16, np.int32)}
_CHUNK = 1 << 20  # offsets checked this many at a time: memory stays bounded


@dataclasses.dataclass
class Part:
    """One flat token array and its document offsets (any array-like indexable by
    ints, slices and int arrays; a memory map in practice)."""

    name: str
    tokens: Any
    offsets: Any
    tokens_are_integers: bool = True  # False: every document is quarantined wrong_dtype
    # The part's supervision (corpus/masks.py), or None: a flat array of per-token
    # values (0/1 for a mask, -100-or-token for labels) and, where it is a column of
    # its own, its own document offsets (None: the token offsets, one value per token).
    mask: Any = None
    mask_offsets: Any = None
    mask_kind: str = "mask"  # "mask" or "labels"


@dataclasses.dataclass(frozen=True)
class Flat:
    """Every part's values and offsets as views of one array each: part ``k``'s values
    start at ``values[values_base[k]]``, its offsets at ``offsets[offsets_base[k]]``.
    A window of documents from all over the parts (a shuffled one) is then found with a
    few whole-window array operations and copied in one compiled call, rather than a
    pass and a call per part (an Arrow file holds a record batch per 1000 rows)."""

    values: Any
    values_base: np.ndarray  # int64 per part
    offsets: Any
    offsets_base: np.ndarray  # int64 per part

    @classmethod
    def of_one(cls, values: Any, offsets: Any) -> Flat:
        """One part's own arrays."""
        zero = np.zeros(1, np.int64)
        return cls(values, zero, offsets, zero)

    def __post_init__(self) -> None:
        # Plain views of memory maps: a np.memmap makes a memmap of every index taken.
        for name in ("values", "offsets"):
            if isinstance(getattr(self, name), np.memmap):
                object.__setattr__(self, name, np.asarray(getattr(self, name)))

    def ranges(self, part: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``(starts, lengths)`` in ``values`` of document ``local[i]`` of part
        ``part[i]``, for each i."""
        at = self.offsets_base[part] + local
        lo, hi = np.asarray(self.offsets[np.stack([at, at + 1])], np.int64)  # one index
        return self.values_base[part] + lo, hi - lo


def _views_of_one(whole: np.ndarray, arrays: list[Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(view, bases)``: the bytes ``whole`` viewed in the dtype of ``arrays``, and the
    index in it where each array starts — when every array is a contiguous NumPy array
    of that one dtype lying inside ``whole`` at a multiple of its item size (the record
    batches of one memory-mapped Arrow file); else None. An empty array is never read:
    it gets base 0."""
    if not arrays or not all(isinstance(a, np.ndarray) for a in arrays):
        return None
    dtype = arrays[0].dtype
    if any(a.dtype != dtype or a.ndim != 1 or not a.flags.c_contiguous for a in arrays):
        return None
    start = whole.__array_interface__["data"][0]
    bases = np.zeros(len(arrays), np.int64)
    for k, array in enumerate(arrays):
        if not len(array):
            continue
        offset = array.__array_interface__["data"][0] - start
        if offset < 0 or offset % dtype.itemsize or offset + array.nbytes > whole.nbytes:
            return None
        bases[k] = offset // dtype.itemsize
    usable = whole.nbytes // dtype.itemsize * dtype.itemsize
    return whole[:usable].view(dtype), bases


def check_offsets(offsets: Any, num_tokens: int, where: str, *, from_zero: bool = True) -> None:
    """Refuse offsets that are empty, do not start at 0 (when ``from_zero``), decrease,
    or end past ``num_tokens`` (or, when ``from_zero``, anywhere but at it); checked in
    chunks so a large memory map is never read into memory at once."""
    if len(offsets) < 1:
        raise InvalidConfig(f"{where}: offsets are empty; expected at least [0]")
    first, last = int(offsets[0]), int(offsets[len(offsets) - 1])
    if (from_zero and (first != 0 or last != num_tokens)) or not 0 <= first <= last <= num_tokens:
        expected = (
            f"start at 0 and end at the token count {num_tokens}"
            if from_zero
            else f"lie within 0..{num_tokens}"
        )
        raise InvalidConfig(f"{where}: offsets run from {first} to {last}; they must {expected}")
    for lo in range(0, len(offsets) - 1, _CHUNK):
        chunk = np.asarray(offsets[lo : lo + _CHUNK + 1])
        steps = np.diff(chunk)
        if (steps < 0).any():
            at = lo + int(np.flatnonzero(steps < 0)[0])
            raise InvalidConfig(
                f"{where}: offsets decrease at document {at} "
                f"({int(chunk[at - lo])} then {int(chunk[at - lo + 1])}); "
                f"they must never decrease"
            )


class OffsetsReader(SingleSource):
    """Documents of several parts, addressed by source id across them in order;
    random access, so shuffles are full permutations."""

    random_access = True

    def __init__(
        self, parts: list[Part], binding: BindingSpec, where: str, whole: np.ndarray | None = None
    ) -> None:
        """``whole``: the bytes every part's arrays lie in (one memory-mapped file),
        when there is such a thing: then a shuffled window is read in one call."""
        self.binding = binding
        self.parts = parts
        counts = [len(p.offsets) - 1 for p in parts]
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_documents = int(self._first[-1])
        if self.num_documents == 0:
            raise InvalidConfig(f"{where}: the corpus holds no documents")
        self.names = [p.name for p in parts]
        self._tokens = [p.tokens for p in parts]
        self._offsets = [p.offsets for p in parts]
        self._dtype_ok = [p.tokens_are_integers for p in parts]
        self.masked = any(p.mask is not None for p in parts)
        self.mask_kind = parts[0].mask_kind if parts else "mask"
        if self.masked and not all(p.mask is not None for p in parts):
            missing = [p.name for p in parts if p.mask is None]
            raise InternalError(f"{where}: parts {missing} have no mask in a masked source")
        self._flat = self._mask_flat = None
        if all(self._dtype_ok):
            self._flat = _flat(whole, [p.tokens for p in parts], [p.offsets for p in parts])
        if self.masked:
            self._mask_flat = _flat(
                whole,
                [p.mask for p in parts],
                [p.offsets if p.mask_offsets is None else p.mask_offsets for p in parts],
            )

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._first, ids, side="right") - 1

    @property
    def prefetch_bytes(self) -> int:
        """How many bytes of the windows to come may be fetched ahead: a remote
        corpus's store budget (``storage.Store.prefetch_budget``), 0 for local files."""
        remote = [t for t in self._tokens if isinstance(t, RemoteArray)]
        return remote[0].file.store.prefetch_budget if remote else 0

    def prefetch(self, ids: np.ndarray, lengths: np.ndarray) -> int:
        """Start fetching what documents ``ids`` (a window the cut will produce next)
        are stored in — tokens and mask of remote parts — for their ``gather`` to find
        it cached; the bytes that is."""
        part = self._locate(ids)
        total = 0
        # Parts in one remote file (an Arrow file's record batches): one prefetch of the
        # window's ranges in it, not one per part.
        flats = [self._flat, *([self._mask_flat] if self.masked else [])]
        remote = [f for f in flats if f is not None and isinstance(f.values, RemoteArray)]
        if len(remote) == len(flats):
            for flat in remote:
                starts, lengths = flat.ranges(part, ids - self._first[part])
                total += flat.values.prefetch(starts, lengths)
            return total
        for s, sel in self._by_part(part, self._parts_of(part)):
            local = ids[sel] - self._first[s]
            stored = self.parts[s]
            mask_offsets = stored.offsets if stored.mask_offsets is None else stored.mask_offsets
            for values, offsets in ((stored.tokens, stored.offsets), (stored.mask, mask_offsets)):
                if isinstance(values, RemoteArray):
                    starts = np.asarray(offsets[local], np.int64)
                    stops = np.asarray(offsets[local + 1], np.int64)
                    total += values.prefetch(starts, stops - starts)
        return total

    def _parts_of(self, part: np.ndarray) -> np.ndarray:
        """The distinct parts in ``part`` (usually one: no sort needed then)."""
        if len(part) and part.min() == part.max():
            return part[:1]
        return np.unique(part)

    def _by_part(self, part: np.ndarray, involved: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``(part, positions of its documents)`` for each part in ``involved``: one
        stable sort, not a pass over ``part`` per part (Arrow files hold a part per
        1000 rows)."""
        if len(involved) == 1:
            return [(int(involved[0]), np.arange(len(part)))]
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.append(involved, involved[-1] + 1))
        return [(int(s), order[bounds[k] : bounds[k + 1]]) for k, s in enumerate(involved.tolist())]

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        """Token counts of documents ``ids`` (corpus positions)."""
        part = self._locate(ids)
        if len(ids) > 1 and part[0] == part[-1] and _consecutive(ids):
            # A run of consecutive documents (no shuffle): one slice of the offsets.
            s = int(part[0])
            lo = int(ids[0] - self._first[s])
            return np.diff(np.asarray(self._offsets[s][lo : lo + len(ids) + 1])).astype(
                np.int64, copy=False
            )
        if self._flat is not None:
            return self._flat.ranges(part, ids - self._first[part])[1]
        out = np.empty(len(ids), dtype=np.int64)
        for s in self._parts_of(part):
            sel = part == s
            local = ids[sel] - self._first[s]
            out[sel] = np.asarray(self._offsets[s][local + 1]) - np.asarray(self._offsets[s][local])
        return out

    def location(self, source_id: int) -> str:
        part = int(self._locate(np.array([source_id]))[0])
        return f"{self.names[part]}#{source_id - int(self._first[part])}"

    def gather(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of documents ``ids`` concatenated in that order, and dtype flags.

        Returns ``(tokens, dtype_ok)``. A run of consecutive documents of one part (the
        common case) comes back as a read-only view of the memory map, in the part's
        dtype: the screen reads it and makes the window's own copy. Otherwise tokens
        come back in a fresh array: in the parts' dtype when they share one that fits
        int32, else as int32 when every part involved holds a dtype that fits int32, as
        int64 otherwise (the vocabulary screen catches values out of range).
        ``dtype_ok[i]`` is False for documents of a part whose tokens are not integers;
        their tokens come back as zeros.
        """
        total = int(lengths.sum())
        part = self._locate(ids)
        involved = self._parts_of(part)
        wide = any(self._tokens[s].dtype not in _NARROW for s in involved)
        dtype_ok = np.ones(len(ids), dtype=bool)
        consecutive = _consecutive(ids)
        if total and len(involved) == 1 and self._dtype_ok[int(involved[0])] and consecutive:
            # Contiguous run in one part: one slice of the memory map, not copied here.
            s = int(involved[0])
            lo = int(self._offsets[s][int(ids[0] - self._first[s])])
            return self._tokens[s][lo : lo + total], dtype_ok
        # The parts' own dtype when they share a narrow one (uint16 mostly): half the
        # bytes of int32 to copy, and the screen keeps the array as the window's when
        # it is the dtype tokens travel in.
        shared = {np.dtype(self._tokens[s].dtype) for s in involved if self._dtype_ok[s]}
        narrow = len(shared) == 1 and next(iter(shared)) in _NARROW
        dtype = next(iter(shared)) if narrow else np.int64 if wide else np.int32
        if total and self._flat is not None and not consecutive:
            # Documents from all over the parts (a shuffled window): one compiled
            # gather over the parts' flat view.
            starts, _ = self._flat.ranges(part, ids - self._first[part])
            return gather_ranges(self._flat.values, starts, lengths, dtype), dtype_ok
        tokens = np.empty(total, dtype=dtype)
        if total == 0:
            return tokens, dtype_ok
        if consecutive and all(self._dtype_ok[s] for s in involved):
            # A run across parts (corpus order, Arrow's many record batches): one slice
            # of each part, copied in place.
            at = 0
            for s in involved:
                local = ids[part == s] - self._first[s]
                lo, hi = (
                    int(self._offsets[s][int(local[0])]),
                    int(self._offsets[s][int(local[-1]) + 1]),
                )
                tokens[at : at + hi - lo] = self._tokens[s][lo:hi]
                at += hi - lo
            return tokens, dtype_ok
        # Documents from all over parts with no flat view (several files): each part's
        # ranges copied to their places in one compiled call per part, not two index
        # arrays of the window's size and a fancy index.
        out_starts = np.cumsum(lengths) - lengths
        for s, sel in self._by_part(part, involved):
            if not self._dtype_ok[s]:
                dtype_ok[sel] = False
                for lo, n in zip(out_starts[sel].tolist(), lengths[sel].tolist(), strict=True):
                    tokens[lo : lo + n] = 0
                continue
            local = ids[sel] - self._first[s]
            src_starts = np.asarray(self._offsets[s][local], np.int64)
            copy_ranges(self._tokens[s], src_starts, lengths[sel], tokens, out_starts[sel])
        return tokens, dtype_ok

    def gather_mask(
        self, ids: np.ndarray, lengths: np.ndarray, tokens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, str, str]]]:
        """The supervision of documents ``ids`` (``lengths`` tokens each, ``tokens`` as
        ``gather`` returned them): ``(mask, mask_lengths, problems)``. ``mask`` is each
        document's stored mask concatenated, in its stored dtype (labels become bool
        ``labels != -100``), ``mask_lengths`` their lengths, and ``problems`` the
        documents whose labels disagree with their tokens, as
        ``(position, "labels_mismatch", detail)``. The screen checks the rest."""
        part = self._locate(ids)
        involved = self._parts_of(part).tolist()
        mask_lengths = np.empty(len(ids), np.int64)

        def mask_offsets(s: int) -> Any:
            p = self.parts[s]
            return p.offsets if p.mask_offsets is None else p.mask_offsets

        if len(ids) and _consecutive(ids):
            # A run of consecutive documents (corpus order): one slice of each part's
            # mask, a view of the memory map when the run is inside one part.
            slices = []
            for s in involved:
                mine = part == s
                lo = int(ids[mine][0] - self._first[s])
                bounds = np.asarray(mask_offsets(s)[lo : lo + int(mine.sum()) + 1], np.int64)
                mask_lengths[mine] = np.diff(bounds)
                slices.append(self.parts[s].mask[int(bounds[0]) : int(bounds[-1])])
            mask = slices[0] if len(slices) == 1 else np.concatenate(slices)
        elif self._mask_flat is not None:  # from all over the parts: one compiled gather
            starts, mask_lengths = self._mask_flat.ranges(part, ids - self._first[part])
            mask = gather_ranges(self._mask_flat.values, starts, mask_lengths)
        else:
            # Documents from all over the parts: their masks' ranges, then one
            # compiled copy per part to their places (a _Bools mask reads its own).
            where = []
            for s, sel in self._by_part(part, self._parts_of(part)):
                local = ids[sel] - self._first[s]
                starts = np.asarray(mask_offsets(s)[local], np.int64)
                mask_lengths[sel] = np.asarray(mask_offsets(s)[local + 1], np.int64) - starts
                where.append((s, sel, starts))
            dtypes = [np.dtype(self.parts[s].mask.dtype) for s, _, _ in where]
            mask = np.empty(int(mask_lengths.sum()), np.result_type(*dtypes) if dtypes else bool)
            out_starts = np.cumsum(mask_lengths) - mask_lengths
            for s, sel, starts in where:
                stored, lens = self.parts[s].mask, mask_lengths[sel]
                if isinstance(stored, (np.ndarray, RemoteArray)):
                    copy_ranges(stored, starts, lens, mask, out_starts[sel])
                    continue
                before = np.cumsum(lens) - lens
                index = np.repeat(starts - before, lens) + np.arange(int(lens.sum()))
                mask[np.repeat(out_starts[sel] - before, lens) + np.arange(int(lens.sum()))] = (
                    np.asarray(stored[index])
                )
        if self.mask_kind == "labels":
            mask, problems = labels_to_mask(tokens, lengths, mask, mask_lengths)
            return mask, mask_lengths, problems
        return mask, mask_lengths, []


def _flat(whole: np.ndarray | None, values: list[Any], offsets: list[Any]) -> Flat | None:
    """The parts' :class:`Flat` view: one part's own arrays, or views of ``whole`` when
    every part's arrays lie in it; None otherwise (a mask read through ``_Bools``, parts
    in several files)."""
    if len(values) == 1 and isinstance(values[0], np.ndarray):
        return Flat.of_one(values[0], offsets[0])
    if whole is None:
        return _remote_flat(values, offsets)
    flat_values, flat_offsets = _views_of_one(whole, values), _views_of_one(whole, offsets)
    if flat_values is None or flat_offsets is None:
        return None
    return Flat(flat_values[0], flat_values[1], flat_offsets[0], flat_offsets[1])


def _remote_flat(values: list[Any], offsets: list[Any]) -> Flat | None:
    """The :class:`Flat` view of parts whose values lie in one remote file (the record
    batches of an Arrow file read by range) at multiples of their one dtype's size, their
    offsets in memory: the file as one remote array, the offsets concatenated."""
    if not values or not all(isinstance(v, RemoteArray) for v in values):
        return None
    file, dtype = values[0].file, values[0].dtype
    if any(v.file is not file or v.dtype != dtype or v.offset % dtype.itemsize for v in values):
        return None
    if not all(isinstance(o, np.ndarray) for o in offsets):
        return None
    counts = np.array([len(o) for o in offsets], np.int64)
    return Flat(
        RemoteArray(file, 0, dtype, file.size // dtype.itemsize),
        np.array([v.offset // dtype.itemsize for v in values], np.int64),
        np.concatenate([np.asarray(o, np.int64) for o in offsets]),
        np.cumsum(counts) - counts,
    )


def _consecutive(ids: np.ndarray) -> bool:
    """``ids`` are a run ``a, a + 1, a + 2, ...`` (corpus order)."""
    return (
        bool(len(ids)) and int(ids[-1] - ids[0]) == len(ids) - 1 and bool((np.diff(ids) == 1).all())
    )
