"""What every corpus reader offers the window cut (``streampack.windows``).

Two kinds of reader, told apart by ``random_access``:

* random access (token shards, Arrow, Megatron): documents are addressed by their
  source id ``0 .. num_documents - 1``; the cut asks for lengths and tokens of any ids,
  so a shuffled epoch is a full permutation of (seed, epoch);
* sequential (JSON Lines, Parquet): documents come in corpus order from ``records()``;
  a shuffled epoch goes through a bounded, seeded shuffle buffer.

A source id is a document's position in its corpus (files in manifest order). Both
kinds carry the corpus binding (:class:`BindingSpec`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
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

    masked: bool

    def splits(self, ids: np.ndarray) -> np.ndarray:
        """As :meth:`RandomAccessReader.splits`."""
        ...


Reader = RandomAccessReader | SequentialReader
