"""What every corpus reader offers the window cut (``streampack.windows``).

Two kinds of reader, told apart by ``random_access``:

* random access (token shards, Arrow, Megatron): documents are addressed by their
  source id ``0 .. num_documents - 1``; the cut asks for lengths and tokens of any ids,
  so a shuffled epoch is a full permutation of (seed, epoch);
* sequential (JSON Lines, Parquet): documents come in corpus order from ``blocks()``
  (or one at a time from ``records()``, which a mixture of sources reads); a shuffled
  epoch goes through a bounded, seeded shuffle buffer.

A :class:`Block` is consecutive documents as columns — their tokens concatenated, one
length, range and id per document, the problems found while reading — so a reader
hands the cut a row group (a few thousand documents) in a handful of arrays rather
than a Python object per document::

    tokens    t t t | t t | (none) | t t t t      (a document unusable as read: none)
    lengths     3      2      0        4
    problems  {2: ("malformed", "the row is null; ...")}

A source id is a document's position in its corpus (files in manifest order). Both
kinds carry the corpus binding (:class:`BindingSpec`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, runtime_checkable

import numpy as np

from streampack.examples import Binding

#: Why a document whose ``gather`` flag is False is quarantined (reason ``wrong_dtype``).
WRONG_DTYPE_DETAIL = "stored tokens are not of an accepted integer dtype"


@dataclasses.dataclass(frozen=True)
class BindingSpec:
    """The binding fields of a manifest, as read; ``to_binding`` checks them."""

    vocab_size: int
    tokenizer: str
    split_receipt: str
    partition: str

    def to_binding(self) -> Binding:
        return Binding(
            vocab_size=self.vocab_size,
            tokenizer=self.tokenizer,
            split_receipt=self.split_receipt,
            partition=self.partition,
        )


@dataclasses.dataclass
class Record:
    """One document of a sequential reader as read, before screening."""

    source_id: int
    tokens: np.ndarray | None  # None when the document is unusable (``reason`` says why)
    start: int  # the selected range
    stop: int
    example_id: int
    reason: str | None  # a quarantine reason found while reading, else None
    detail: str
    location: str  # where a person finds it, e.g. "docs.jsonl:17"
    # Its supervision mask as stored (any integer or bool dtype, its own length: the
    # screen checks both), or None: every token supervised (corpus/masks.py).
    mask: np.ndarray | None = None


@dataclasses.dataclass
class Block:
    """Consecutive documents of a sequential reader, as read, before screening.

    ``tokens`` are the documents' tokens concatenated (any integer dtype; a document
    unusable as read holds none and has length 0), ``problems`` the documents already
    known bad, by position: ``(reason, detail)``. ``locations`` (one ``str`` per
    document, an object array) is None where the reader's ``location(source_id)``
    says where a document is. A masked reader's block carries each document's mask as
    stored (any integer or bool dtype) with its own length, ``mask_lengths``; the
    screen checks both."""

    tokens: np.ndarray
    lengths: np.ndarray  # int64
    starts: np.ndarray  # int64: the selected range
    stops: np.ndarray
    source_ids: np.ndarray  # int64
    example_ids: np.ndarray  # int64
    problems: dict[int, tuple[str, str]]
    locations: np.ndarray | None = None
    mask: np.ndarray | None = None
    mask_lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """int64, ``len + 1``: where each document's tokens start in ``tokens``."""
        out = np.zeros(len(self.lengths) + 1, np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    @functools.cached_property
    def mask_offsets(self) -> np.ndarray:
        assert self.mask_lengths is not None
        out = np.zeros(len(self.mask_lengths) + 1, np.int64)
        np.cumsum(self.mask_lengths, out=out[1:])
        return out

    def slice(self, lo: int, hi: int) -> Block:
        """Documents ``lo..hi-1``: views of this block's arrays, no copy."""
        offsets = self.offsets
        mask = mask_lengths = None
        if self.mask is not None and self.mask_lengths is not None:
            bounds = self.mask_offsets
            mask = self.mask[bounds[lo] : bounds[hi]]
            mask_lengths = self.mask_lengths[lo:hi]
        return Block(
            tokens=self.tokens[offsets[lo] : offsets[hi]],
            lengths=self.lengths[lo:hi],
            starts=self.starts[lo:hi],
            stops=self.stops[lo:hi],
            source_ids=self.source_ids[lo:hi],
            example_ids=self.example_ids[lo:hi],
            problems={i - lo: p for i, p in self.problems.items() if lo <= i < hi},
            locations=None if self.locations is None else self.locations[lo:hi],
            mask=mask,
            mask_lengths=mask_lengths,
        )

    def take(self, index: np.ndarray, *, payload: bool = True) -> Block:
        """Documents ``index`` (positions, int64) in that order: one gather per column
        (without ``payload``, tokens and mask are left empty, for the caller to fill)."""
        from streampack.corpus.gather import gather_ranges

        index = np.asarray(index, np.int64)
        mask = mask_lengths = None
        if self.mask is not None and self.mask_lengths is not None:
            mask_lengths = self.mask_lengths[index]
            mask = (
                gather_ranges(self.mask, self.mask_offsets[index], mask_lengths)
                if payload
                else self.mask[:0]
            )
        problems: dict[int, tuple[str, str]] = {}
        if self.problems:
            marked = np.fromiter(self.problems, np.int64, len(self.problems))
            for at in np.flatnonzero(np.isin(index, marked)).tolist():
                problems[at] = self.problems[int(index[at])]
        lengths = self.lengths[index]
        return Block(
            tokens=(
                gather_ranges(self.tokens, self.offsets[index], lengths)
                if payload
                else self.tokens[:0]
            ),
            lengths=lengths,
            starts=self.starts[index],
            stops=self.stops[index],
            source_ids=self.source_ids[index],
            example_ids=self.example_ids[index],
            problems=problems,
            locations=None if self.locations is None else self.locations[index],
            mask=mask,
            mask_lengths=mask_lengths,
        )

    @staticmethod
    def gather(blocks: list[Block], index: np.ndarray) -> Block:
        """``Block.concat(blocks).take(index)`` without copying ``blocks`` into one
        first: the per-document columns are joined (small), and each block's tokens and
        mask are copied straight to their places (one compiled call per block)."""
        from streampack.corpus.gather import copy_ranges

        if len(blocks) == 1:
            return blocks[0].take(index)
        index = np.asarray(index, np.int64)
        heads = [
            dataclasses.replace(b, tokens=b.tokens[:0], mask=None if b.mask is None else b.mask[:0])
            for b in blocks
        ]
        out = Block.concat(heads).take(index, payload=False)
        first = np.cumsum([0] + [len(b) for b in blocks])
        owner = np.searchsorted(first, index, side="right") - 1
        local = index - first[owner]
        tokens = np.empty(int(out.lengths.sum()), out.tokens.dtype)
        mask = None
        if out.mask is not None and out.mask_lengths is not None:
            mask = np.empty(int(out.mask_lengths.sum()), out.mask.dtype)
        for k, block in enumerate(blocks):
            sel = np.flatnonzero(owner == k)
            mine = local[sel]
            copy_ranges(
                block.tokens, block.offsets[mine], out.lengths[sel], tokens, out.offsets[sel]
            )
            if mask is not None and block.mask is not None and block.mask_lengths is not None:
                assert out.mask_lengths is not None
                copy_ranges(
                    block.mask,
                    block.mask_offsets[mine],
                    out.mask_lengths[sel],
                    mask,
                    out.mask_offsets[sel],
                )
        out.tokens, out.mask = tokens, mask
        return out

    @staticmethod
    def concat(blocks: list[Block]) -> Block:
        """The documents of ``blocks``, in order, as one block (the one block itself
        when there is one: no copy)."""
        if len(blocks) == 1:
            return blocks[0]
        problems: dict[int, tuple[str, str]] = {}
        at = 0
        for block in blocks:
            problems.update((at + i, p) for i, p in block.problems.items())
            at += len(block)
        masked = blocks[0].mask is not None
        located = blocks[0].locations is not None
        return Block(
            tokens=np.concatenate([b.tokens for b in blocks]),
            lengths=np.concatenate([b.lengths for b in blocks]),
            starts=np.concatenate([b.starts for b in blocks]),
            stops=np.concatenate([b.stops for b in blocks]),
            source_ids=np.concatenate([b.source_ids for b in blocks]),
            example_ids=np.concatenate([b.example_ids for b in blocks]),
            problems=problems,
            locations=np.concatenate([b.locations for b in blocks]) if located else None,
            mask=np.concatenate([b.mask for b in blocks]) if masked else None,
            mask_lengths=(np.concatenate([b.mask_lengths for b in blocks]) if masked else None),
        )

    @staticmethod
    def from_records(records: Iterable[Record], masked: bool) -> Block:
        """Records as a block (with their locations). In a masked corpus a record
        without a mask (an unmasked mixture source's) gets all ones."""
        held = list(records)
        tokens = [r.tokens for r in held if r.tokens is not None]
        mask = mask_lengths = None
        if masked:
            stored = [
                (r.mask if r.mask is not None else np.ones(len(r.tokens), np.uint8))
                for r in held
                if r.tokens is not None
            ]
            mask = np.concatenate(stored) if stored else np.zeros(0, np.uint8)
            mask_lengths = np.array(
                [
                    0 if r.tokens is None else len(r.tokens if r.mask is None else r.mask)
                    for r in held
                ],
                dtype=np.int64,
            )
        locations = np.empty(len(held), object)
        locations[:] = [r.location for r in held]
        return Block(
            tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
            lengths=np.array(
                [0 if r.tokens is None else len(r.tokens) for r in held], dtype=np.int64
            ),
            starts=np.array([r.start for r in held], dtype=np.int64),
            stops=np.array([r.stop for r in held], dtype=np.int64),
            source_ids=np.array([r.source_id for r in held], dtype=np.int64),
            example_ids=np.array([r.example_id for r in held], dtype=np.int64),
            problems={i: (r.reason, r.detail) for i, r in enumerate(held) if r.reason is not None},
            locations=locations,
            mask=mask,
            mask_lengths=mask_lengths,
        )

    def records(self, location: Callable[[int], str]) -> Iterator[Record]:
        """The block's documents one by one (``location(source_id)`` where the block
        holds no locations); a document with a problem keeps its tokens as read."""
        offsets = self.offsets
        bounds = self.mask_offsets if self.mask is not None else None
        for i in range(len(self.lengths)):
            source_id = int(self.source_ids[i])
            reason, detail = self.problems.get(i, (None, ""))
            yield Record(
                source_id=source_id,
                tokens=self.tokens[offsets[i] : offsets[i + 1]],
                start=int(self.starts[i]),
                stop=int(self.stops[i]),
                example_id=int(self.example_ids[i]),
                reason=reason,
                detail=detail,
                location=(
                    location(source_id) if self.locations is None else str(self.locations[i])
                ),
                mask=(
                    None
                    if self.mask is None or bounds is None
                    else self.mask[bounds[i] : bounds[i + 1]]
                ),
            )


class SingleSource:
    """What every reader of one source shares: its long-document policy.

    ``long_documents`` is ``"quarantine"`` (the default) or ``"split"``; ``open_source``
    sets it from the source's manifest entry.
    """

    long_documents: str = "quarantine"
    masked: bool = False  # documents carry supervision masks (corpus/masks.py)

    def splits(self, ids: np.ndarray) -> np.ndarray:
        """bool per document: whether one too long for a row is cut into ranges."""
        return np.full(len(ids), self.long_documents == "split", bool)


@runtime_checkable
class RandomAccessReader(Protocol):
    """Documents addressed by source id; every document is selected whole."""

    random_access: bool  # True
    binding: BindingSpec
    num_documents: int

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        """Token counts (int64) of documents ``ids``."""
        ...

    def gather(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, dtype_ok)``: the tokens of documents ``ids`` concatenated in that
        order (any integer dtype; possibly a read-only view of a memory map), and per
        document False where its tokens are not integers (they come back as zeros)."""
        ...

    def location(self, source_id: int) -> str:
        """Where a person finds document ``source_id``, e.g. ``"shard-000#17"``."""
        ...

    def splits(self, ids: np.ndarray) -> np.ndarray:
        """bool per document ``ids``: cut into ranges when too long for a row (its
        source's ``long_documents = "split"``), rather than quarantined."""
        ...

    masked: bool  # whether documents carry supervision masks (then gather_mask)

    def gather_mask(
        self, ids: np.ndarray, lengths: np.ndarray, tokens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, str, str]]]:
        """``(mask, mask_lengths, problems)`` of documents ``ids`` of a masked reader:
        their masks concatenated as stored (any integer or bool dtype), each one's
        length, and documents already known bad as ``(position, reason, detail)``.
        ``tokens`` is what ``gather`` returned (labels are checked against it)."""
        ...


@runtime_checkable
class SequentialReader(Protocol):
    """Documents read once, in corpus order."""

    random_access: bool  # False
    binding: BindingSpec
    num_documents: int | None  # None when unknown before reading everything

    def records(self) -> Iterator[Record]:
        """Every document in corpus order, source ids 0, 1, 2, ... (with their
        ``mask`` when ``masked``)."""
        ...

    def blocks(self) -> Iterator[Block]:
        """The same documents as ``records()``, in consecutive blocks."""
        ...

    def location(self, source_id: int) -> str:
        """Where a person finds document ``source_id`` (for blocks without
        ``locations``)."""
        ...

    masked: bool

    def splits(self, ids: np.ndarray) -> np.ndarray:
        """As :meth:`RandomAccessReader.splits`."""
        ...


Reader = RandomAccessReader | SequentialReader
