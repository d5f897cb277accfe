"""Bindings and columnar examples.

An *example* is a selected range ``[start, stop)`` of one document (rule C1). Examples
are held column by column, so a million of them cost a handful of arrays, not a million
Python objects::

    tokens   [0 99 100 1 | 0 101 1 | 0 102 103 104 1]    documents, concatenated
    offsets  [0, 4, 7, 12]                          document d: tokens[offsets[d]:offsets[d+1]]
    doc      [0, 1, 2]        start [0, 0, 0]   stop [4, 3, 5]
    source_id, example_id     caller's identities, carried to every occurrence
    mask     [1 1 1 1 | 0 0 1 | 0 0 1 1 1]    optional: 0/1 per token (supervision)

Several examples may select the same document, even the same range (rule C3).

With a ``mask`` the pair whose target is token ``i`` is loss-eligible only where
``mask[i] == 1`` (rule C5, Hugging Face's ``labels`` convention: the mark is on the
token predicted). Above, B's only eligible target is its EOS and C's are 103, 104 and
EOS: B and C are "prompt, then response". The mask of a range's first token is never
read: no pair of that range predicts it. Without a mask every valid target is
eligible and every batch is exactly what it is without the field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidConfig, InvalidExample

PARTITIONS = ("train", "validation", "test")
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, kw_only=False)
class Binding:
    """What a batch's token IDs mean (rule C9); every batch carries one."""

    vocab_size: int
    tokenizer: str
    split_receipt: str
    partition: str

    def __post_init__(self) -> None:
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int):
            raise InvalidConfig(f"vocab_size must be an integer, got {self.vocab_size!r}")
        if not 1 <= self.vocab_size <= _INT32_MAX + 1:
            raise InvalidConfig(
                f"vocab_size={self.vocab_size} is out of range; accepted: 1..{_INT32_MAX + 1} "
                "(token IDs are stored as int32)"
            )
        for name in ("tokenizer", "split_receipt"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidConfig(f"{name} must be a non-empty string, got {value!r}")
        if self.partition not in PARTITIONS:
            raise InvalidConfig(
                f"partition={self.partition!r} is not accepted; accepted: {', '.join(PARTITIONS)}"
            )

    def as_dict(self) -> dict[str, object]:
        return {
            "vocab_size": self.vocab_size,
            "tokenizer": self.tokenizer,
            "split_receipt": self.split_receipt,
            "partition": self.partition,
        }


def integer_column(name: str, values: object, dtype: type) -> np.ndarray:
    """``values`` as a contiguous 1-D ``dtype`` column, or ``InvalidExample`` naming it."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise InvalidExample(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise InvalidExample(f"{name} must hold integers, got dtype {array.dtype}")
    if array.size and array.dtype != dtype:
        info = np.iinfo(dtype)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            raise InvalidExample(
                f"{name} holds {low if low < info.min else high}, outside {np.dtype(dtype)} "
                f"range [{info.min}, {info.max}]"
            )
    return np.ascontiguousarray(array, dtype=dtype)


@dataclass(frozen=True, eq=False)
class Examples:
    """Columnar examples over a shared token buffer. Checked once, at construction.

    ``tokens`` may be any integer dtype whose values fit int32 (uint16 shards, say); it
    is stored as int32. Vocabulary membership is checked by ``pack_examples``, which
    knows the binding.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    source_id: np.ndarray = field(default=None)  # type: ignore[arg-type]
    example_id: np.ndarray = field(default=None)  # type: ignore[arg-type]
    #: uint8 0/1 per token of ``tokens`` (bool or integer 0/1 accepted), or None: every
    #: valid target supervised (rule C5).
    mask: np.ndarray | None = None
    #: Per example, carried to its occurrence records (see ``OCCURRENCE_DTYPE``): the
    #: index of its source in a mixture (int64 in 0..2**31-1; zeros when None) and where
    #: its document's token 0 lies in the caller's own document (>= 0; zeros when None:
    #: non-zero for a piece cut from a longer document), which the record adds to
    #: ``start``/``stop`` so that its range is in the caller's document coordinates.
    source: np.ndarray = field(default=None)  # type: ignore[arg-type]
    piece_start: np.ndarray = field(default=None)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "tokens", integer_column("tokens", self.tokens, np.int32))
        put(self, "offsets", integer_column("offsets", self.offsets, np.int64))
        for name in ("doc", "start", "stop"):
            put(self, name, integer_column(name, getattr(self, name), np.int64))
        count = self.doc.shape[0]
        for name in ("source_id", "example_id"):
            values = getattr(self, name)
            put(
                self,
                name,
                np.arange(count, dtype=np.int64)
                if values is None
                else integer_column(name, values, np.int64),
            )
        for name in ("start", "stop", "source_id", "example_id"):
            if getattr(self, name).shape[0] != count:
                raise InvalidExample(
                    f"{name} has {getattr(self, name).shape[0]} entries but doc has {count}; "
                    "every per-example column needs one entry per example"
                )
        source, piece_start = location_columns(count, self.source, self.piece_start)
        put(self, "source", source)
        put(self, "piece_start", piece_start)
        check_offsets(self.offsets, self.tokens.shape[0])
        check_ranges(self.offsets, self.doc, self.start, self.stop, self.describe)
        if self.mask is not None:
            put(self, "mask", mask_column(self.mask, self.tokens.shape[0]))

    @classmethod
    def from_documents(
        cls,
        documents: Sequence[Sequence[int] | np.ndarray],
        *,
        ranges: Sequence[tuple[int, int]] | None = None,
        source_ids: Sequence[int] | None = None,
        example_ids: Sequence[int] | None = None,
        masks: Sequence[Sequence[int] | np.ndarray] | None = None,
    ) -> Examples:
        """One example per document: the whole document, or ``ranges[i] = (start, stop)``.

        ``masks[i]``, when given, is document ``i``'s 0/1 supervision mask, one value per
        token (the ``mask`` column, module doc). To use one document several times, list
        it several times, or build the columns directly with ``Examples(tokens=...,
        offsets=..., doc=..., ...)``.
        """
        arrays = []
        for d, document in enumerate(documents):
            array = np.asarray(document)
            if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
                raise InvalidExample(
                    f"document {d} must be a 1-D sequence of integers, got "
                    f"shape {array.shape} dtype {array.dtype}"
                )
            arrays.append(array.astype(np.int64, copy=False))
        lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        if ranges is None:
            start, stop = np.zeros_like(lengths), lengths
        else:
            if len(ranges) != len(arrays):
                raise InvalidExample(
                    f"ranges has {len(ranges)} entries for {len(arrays)} documents; "
                    "give one (start, stop) per document"
                )
            pairs = np.asarray(ranges, dtype=np.int64).reshape(len(arrays), 2)
            start, stop = pairs[:, 0], pairs[:, 1]
        mask = None
        if masks is not None:
            if len(masks) != len(arrays):
                raise InvalidExample(
                    f"masks has {len(masks)} entries for {len(arrays)} documents; "
                    "give one mask per document"
                )
            for d, (values, array) in enumerate(zip(masks, arrays)):
                if np.shape(values) != array.shape:
                    raise InvalidExample(
                        f"document {d}: mask has shape {np.shape(values)} but the document "
                        f"has {array.shape[0]} tokens; give one 0/1 value per token"
                    )
            mask = np.concatenate([np.asarray(m) for m in masks]) if arrays else None
        return cls(
            tokens=tokens,
            offsets=offsets,
            doc=np.arange(len(arrays), dtype=np.int64),
            start=start,
            stop=stop,
            # Sequences or None: __post_init__ makes the columns (as for any caller).
            source_id=source_ids,  # type: ignore[arg-type]
            example_id=example_ids,  # type: ignore[arg-type]
            mask=mask,
        )

    def __len__(self) -> int:
        return int(self.doc.shape[0])

    @property
    def prediction_lengths(self) -> np.ndarray:
        """Pairs per example: ``stop - start - 1`` (rule C1)."""
        return self.stop - self.start - 1

    def example_tokens(self, i: int) -> np.ndarray:
        """The selected tokens of example ``i`` (a view into ``tokens``)."""
        base = int(self.offsets[self.doc[i]])
        return self.tokens[base + int(self.start[i]) : base + int(self.stop[i])]

    def example_mask(self, i: int) -> np.ndarray | None:
        """The mask of example ``i``'s selected tokens (a view), or None when unmasked."""
        if self.mask is None:
            return None
        base = int(self.offsets[self.doc[i]])
        return self.mask[base + int(self.start[i]) : base + int(self.stop[i])]

    def describe(self, i: int) -> str:
        """How error messages name example ``i``."""
        return describe_example(i, self.source_id, self.example_id)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every token of every selected range must lie in ``[0, vocab_size)``.

        The fast path reads the buffer twice (min, max) and allocates nothing; only a
        failure pays for finding which example holds the offending token.
        """
        if self.tokens.size == 0:
            return
        low, high = int(self.tokens.min()), int(self.tokens.max())
        if low >= 0 and high < vocab_size:
            return
        bad = np.flatnonzero((self.tokens < 0) | (self.tokens >= vocab_size))
        doc_of_bad = np.searchsorted(self.offsets, bad, side="right") - 1
        local = bad - self.offsets[doc_of_bad]
        for position, d, at in zip(bad, doc_of_bad, local):
            users = np.flatnonzero((self.doc == d) & (self.start <= at) & (at < self.stop))
            if users.size:
                i = int(users[0])
                raise InvalidExample(
                    f"{self.describe(i)}: token {int(self.tokens[position])} at position "
                    f"{int(at)} of document {int(d)} is outside the vocabulary; "
                    f"accepted: 0..{vocab_size - 1}"
                )
        # Out-of-vocabulary tokens outside every selected range are never read.


def location_columns(
    count: int, source: object, piece_start: object
) -> tuple[np.ndarray, np.ndarray]:
    """The ``source`` and ``piece_start`` columns of ``count`` examples (zeros for None),
    checked: one entry per example, a source in 0..2**31-1, a piece start >= 0."""
    columns = []
    for name, values, high in (
        ("source", source, _INT32_MAX),
        ("piece_start", piece_start, None),
    ):
        column = (
            np.zeros(count, np.int64) if values is None else integer_column(name, values, np.int64)
        )
        if column.shape[0] != count:
            raise InvalidExample(
                f"{name} has {column.shape[0]} entries for {count} examples; "
                "every per-example column needs one entry per example"
            )
        if column.size and (int(column.min()) < 0 or (high is not None and column.max() > high)):
            bad = int(column.min()) if int(column.min()) < 0 else int(column.max())
            accepted = f"0..{high}" if high is not None else ">= 0"
            raise InvalidExample(f"{name} holds {bad}; accepted: {accepted}")
        columns.append(column)
    return columns[0], columns[1]


def describe_example(i: int, source_id: np.ndarray, example_id: np.ndarray) -> str:
    """How error messages name example ``i``."""
    return f"example {i} (source_id {int(source_id[i])}, example_id {int(example_id[i])})"


def mask_column(values: object, token_count: int) -> np.ndarray:
    """A supervision mask as a contiguous uint8 0/1 column of ``token_count`` entries, or
    ``InvalidExample`` naming what is wrong (shape, dtype or a value other than 0/1)."""
    array = np.asarray(values)
    if array.shape != (token_count,):
        raise InvalidExample(
            f"mask has shape {array.shape} but tokens has {token_count} entries; "
            "give one 0/1 value per token"
        )
    if array.size and array.dtype.kind not in "biu":
        raise InvalidExample(f"mask must hold bool or integer 0/1 values, got dtype {array.dtype}")
    # Two reductions in the usual (clean) case; only a failure pays for finding where.
    if array.size and array.dtype.kind != "b" and (int(array.min()) < 0 or int(array.max()) > 1):
        at = int(np.flatnonzero((array != 0) & (array != 1))[0])
        raise InvalidExample(
            f"mask[{at}] = {array[at].item()}; accepted: 0 or 1 (1 = the target is supervised)"
        )
    return np.ascontiguousarray(array, dtype=np.uint8)


def check_offsets(offsets: np.ndarray, token_count: int) -> None:
    """Document boundaries: start at 0, never decrease, end at ``token_count``."""
    if offsets.shape[0] < 1 or offsets[0] != 0:
        raise InvalidExample(
            f"offsets must start with 0 and have documents+1 entries, got {offsets[:3]!r}..."
        )
    if offsets[-1] != token_count:
        raise InvalidExample(
            f"offsets end at {int(offsets[-1])} but tokens has {token_count} entries; "
            "the last offset must equal len(tokens)"
        )
    falling = np.flatnonzero(np.diff(offsets) < 0)
    if falling.size:
        d = int(falling[0])
        raise InvalidExample(
            f"offsets decrease at document {d}: {int(offsets[d])} -> {int(offsets[d + 1])}; "
            "offsets must be non-decreasing"
        )


def check_ranges(
    offsets: np.ndarray,
    doc: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
    describe: Callable[[int], str],
) -> None:
    """Every example selects an existing document's range of at least 2 tokens (C1)."""
    documents = offsets.shape[0] - 1
    bad_doc = (doc < 0) | (doc >= documents)
    if bad_doc.any():
        i = int(np.flatnonzero(bad_doc)[0])
        raise InvalidExample(
            f"{describe(i)}: doc={int(doc[i])} does not exist; accepted: 0..{documents - 1}"
        )
    doc_length = offsets[doc + 1] - offsets[doc]
    bad_range = (start < 0) | (stop > doc_length) | (start > stop)
    if bad_range.any():
        i = int(np.flatnonzero(bad_range)[0])
        raise InvalidExample(
            f"{describe(i)}: range [{int(start[i])}, {int(stop[i])}) lies "
            f"outside its document of {int(doc_length[i])} tokens; "
            f"accepted: 0 <= start <= stop <= {int(doc_length[i])}"
        )
    short = (stop - start) < 2
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise InvalidExample(
            f"{describe(i)}: range [{int(start[i])}, {int(stop[i])}) has "
            f"{int(stop[i] - start[i])} token(s); an example needs at least 2 "
            "tokens to form one input-target pair"
        )
