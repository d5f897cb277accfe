"""The deterministic cut of a corpus into windows, and the quarantine screen.

An epoch visits the documents in corpus order, or, with ``shuffle``, in the order of a
permutation drawn from ``(seed, epoch)`` (readers with random access: token shards,
Arrow, Megatron) or through a bounded shuffle buffer seeded the same way (sequential
readers: JSON Lines and Parquet are read once, in order). The visited sequence is cut
greedily into numbered windows: a window closes when it holds ``window_documents``
documents or when the next document would take it past ``window_tokens`` tokens. The
cut counts every document, good or bad, so it depends on the corpus and these settings
only — never on workers or timing::

    lengths   5 3 9 2 | 7 7 1 | 8 ...      window_documents=4, window_tokens=20
    windows   [   0   ] [  1  ] [ 2 ...     (0 is full at 4 documents; 1 would pass 20
                                             tokens with the 8)

Each window is then *screened*, vectorized: a document is quarantined with a reason
when its range has fewer than 2 tokens (``too_short``), more than ``capacity + 1``
tokens (``too_long``), a token outside ``[0, vocab_size)`` anywhere in the document
(``out_of_vocabulary``), tokens that are not integers (``wrong_dtype``), an invalid
range (``bad_range``) or a line that is not a JSON document (``malformed``). The
surviving documents form the window's :class:`streampack.Examples`, which a worker
packs in one ``pack_examples`` call — which can therefore never fail on a document.

Memory: random-access readers are memory-mapped and only one window's tokens are
gathered at a time; sequential readers stream. A shuffled random-access epoch holds its
permutation (8 bytes per document); a shuffled sequential epoch holds
``shuffle_buffer`` documents.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np

from streampack.corpus.long_documents import split_ranges
from streampack.corpus.mixture import MixtureReader
from streampack.corpus.order import MixtureOrder, buffered_shuffle, corpus_permutation, epoch_rng
from streampack.corpus.reader import RandomAccessReader, Reader, Record, SequentialReader
from streampack.wire import token_dtype

REASONS = (
    "too_short",
    "too_long",
    "out_of_vocabulary",
    "wrong_dtype",
    "bad_range",
    "malformed",
)


@dataclasses.dataclass
class Window:
    """One cut window after screening: the arrays a worker packs, plus what was dropped."""

    epoch: int
    index: int
    documents: int  # documents the window covers, quarantined ones included
    tokens: np.ndarray  # the surviving documents concatenated, in wire.token_dtype(vocab)
    offsets: np.ndarray  # int64, len(surviving) + 1
    start: np.ndarray  # int64 per surviving document: its selected range
    stop: np.ndarray
    source_id: np.ndarray  # int64: corpus position of each surviving document
    example_id: np.ndarray  # int64
    quarantined: list[dict[str, Any]]
    # int32 per surviving document: its source in a mixture (0 for a corpus of one source)
    source_index: np.ndarray = None  # type: ignore[assignment]
    documents_split: int = 0  # long documents cut into ranges (long_documents = "split")
    pairs_cut: int = 0  # prediction pairs those cuts did not form
    # uint8 0/1 per token of ``tokens``: the supervision mask (rule C5: the pair whose
    # target is token i is loss-eligible only where mask[i] == 1); None when the corpus
    # carries no mask, and every valid target is supervised.
    mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.source_index is None:
            self.source_index = np.zeros(len(self.start), np.int32)

    @functools.cached_property
    def whole_documents(self) -> bool:
        """Every document selected whole: its tokens are exactly
        ``tokens[offsets[i]:offsets[i + 1]]`` (random-access readers always; JSON Lines
        unless a line gives a narrower ``start``/``stop``)."""
        return bool((self.start == 0).all() and (self.stop == np.diff(self.offsets)).all())

    @property
    def nbytes(self) -> int:
        return int(
            self.tokens.nbytes
            + self.offsets.nbytes
            + self.start.nbytes * 5  # start, stop, source_id, example_id, doc
            + (0 if self.mask is None else self.mask.nbytes)
        )

    def selected_tokens(self, first: int, last: int) -> np.ndarray:
        """The tokens documents ``first..last-1`` select, concatenated — the
        ``tokens`` of a compact batch holding exactly those documents. A slice of the
        window's tokens (no copy) when each document is selected whole, as from
        random-access readers: consecutive batches partition the window's tokens, which are freed
        with the last of them. Otherwise a gather."""
        from streampack.packing import select_tokens

        if self.whole_documents:
            return self.tokens[self.offsets[first] : self.offsets[last]]
        tokens, _ = select_tokens(
            self.tokens,
            self.offsets,
            np.arange(first, last, dtype=np.int64),
            self.start[first:last],
            self.stop[first:last],
        )
        return tokens

    def batch_tokens(self, ordinals: np.ndarray) -> np.ndarray:
        """The tokens of a compact batch holding documents ``ordinals`` (its occurrence
        records' ``ordinal`` column), in that order. Next-fit's ordinals are consecutive
        (``selected_tokens``, a slice where it can be); best-fit's are not (a gather)."""
        from streampack.packing import select_tokens

        ordinals = np.asarray(ordinals, dtype=np.int64)
        first = int(ordinals[0]) if len(ordinals) else 0
        if np.array_equal(ordinals, np.arange(first, first + len(ordinals))):
            return self.selected_tokens(first, first + len(ordinals))
        tokens, _ = select_tokens(
            self.tokens, self.offsets, ordinals, self.start[ordinals], self.stop[ordinals]
        )
        return tokens

    def selected_mask(self, first: int, last: int) -> np.ndarray | None:
        """The supervision mask of ``selected_tokens(first, last)``, one to one (a slice
        where that is one, else a gather), or None when the window has no mask."""
        from streampack.packing import select_mask

        if self.mask is None:
            return None
        if self.whole_documents:
            return self.mask[self.offsets[first] : self.offsets[last]]
        return select_mask(
            self.mask,
            self.offsets,
            np.arange(first, last, dtype=np.int64),
            self.start[first:last],
            self.stop[first:last],
        )

    def batch_mask(self, ordinals: np.ndarray) -> np.ndarray | None:
        """The supervision mask of ``batch_tokens(ordinals)``, one to one, or None when
        the window has no mask."""
        from streampack.packing import select_mask

        if self.mask is None:
            return None
        ordinals = np.asarray(ordinals, dtype=np.int64)
        first = int(ordinals[0]) if len(ordinals) else 0
        if np.array_equal(ordinals, np.arange(first, first + len(ordinals))):
            return self.selected_mask(first, first + len(ordinals))
        return select_mask(
            self.mask, self.offsets, ordinals, self.start[ordinals], self.stop[ordinals]
        )

    def arrays(self) -> dict[str, np.ndarray]:
        """The window frames of the wire protocol, in order (an empty ``mask`` when the
        window has none)."""
        return {
            "tokens": self.tokens,
            "offsets": self.offsets,
            "doc": np.arange(len(self.start), dtype=np.int64),
            "start": self.start,
            "stop": self.stop,
            "source_id": self.source_id,
            "example_id": self.example_id,
            "mask": np.zeros(0, np.uint8) if self.mask is None else self.mask,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class CutSpec:
    """The settings that decide windows and screening (a subset of ProducerSettings)."""

    capacity: int
    window_documents: int
    window_tokens: int
    shuffle: bool = False
    seed: int = 0
    shuffle_buffer: int = 4096

    @classmethod
    def from_settings(cls, settings: Any) -> CutSpec:
        return cls(
            capacity=settings.capacity,
            window_documents=settings.window_documents,
            window_tokens=settings.window_tokens,
            shuffle=settings.shuffle,
            seed=settings.seed,
            shuffle_buffer=settings.shuffle_buffer,
        )


def _cut(lengths: np.ndarray, spec: CutSpec) -> int:
    """How many of the next documents (``lengths``, at most window_documents) form a window."""
    cumulative = np.cumsum(lengths)
    return max(1, int(np.searchsorted(cumulative, spec.window_tokens, side="right")))


def _window_lengths(
    source: RandomAccessReader,
    order: np.ndarray | MixtureOrder | None,
    position: int,
    end: int,
    window_tokens: int,
    first_chunk: int = 256,
) -> tuple[np.ndarray, np.ndarray]:
    """Ids and lengths of documents ``position..end`` of the epoch's order, read in
    doubling chunks (from ``first_chunk``) only until ``window_tokens`` is passed:
    enough for ``_cut``, which looks no further, and O(window) rather than
    O(window_documents) per window."""
    chunk, total, hi = first_chunk, 0, position
    id_parts, length_parts = [], []
    while hi < end and total <= window_tokens:
        lo, hi = hi, min(end, hi + chunk)
        ids = order[lo:hi] if order is not None else np.arange(lo, hi, dtype=np.int64)
        lengths = source.lengths(ids)
        id_parts.append(ids)
        length_parts.append(lengths)
        total += int(lengths.sum())
        chunk *= 2
    return np.concatenate(id_parts), np.concatenate(length_parts)


def iter_windows(
    source: Reader, epoch: int, spec: CutSpec, *, start_window: int = 0
) -> Iterator[Window]:
    """The screened windows of ``epoch``, numbered from 0; those before ``start_window``
    are cut (to keep numbering) but neither gathered nor screened."""
    if source.random_access:
        yield from _random_access_windows(source, epoch, spec, start_window)  # type: ignore[arg-type]
    else:
        yield from _sequential_windows(source, epoch, spec, start_window)  # type: ignore[arg-type]


def _random_access_windows(
    source: RandomAccessReader, epoch: int, spec: CutSpec, start_window: int
) -> Iterator[Window]:
    if isinstance(source, MixtureReader):
        order: np.ndarray | MixtureOrder | None = source.epoch_order(epoch, spec.shuffle, spec.seed)
    else:
        order = corpus_permutation(source.num_documents, spec.seed, epoch) if spec.shuffle else None
    n = source.num_documents if order is None else len(order)
    position = 0
    index = 0
    k = 192
    while position < n:
        end = min(n, position + spec.window_documents)
        # The last window's size is a good first guess: usually one read suffices.
        ids, lengths = _window_lengths(
            source, order, position, end, spec.window_tokens, first_chunk=k + k // 4 + 16
        )
        k = _cut(lengths, spec)
        ids, lengths = ids[:k], lengths[:k]
        position += k
        if index >= start_window:
            tokens, dtype_ok = source.gather(ids, lengths)
            yield _screen(
                epoch,
                index,
                source.binding.vocab_size,
                spec.capacity,
                tokens,
                lengths,
                starts=np.zeros(k, dtype=np.int64),
                stops=lengths.copy(),
                source_ids=ids,
                example_ids=ids,
                premarked=[
                    (i, "wrong_dtype", "stored tokens are not of an accepted integer dtype")
                    for i in np.flatnonzero(~dtype_ok).tolist()
                ],
                locate=source.location,
                **_mixture_fields(source, ids),
            )
        index += 1


def _shuffled(records: Iterator[Record], spec: CutSpec, epoch: int) -> Iterator[Record]:
    """A bounded shuffle buffer: emit a uniformly chosen held record per new record."""
    return buffered_shuffle(records, spec.shuffle_buffer, epoch_rng(spec.seed, epoch))


def _sequential_windows(
    source: SequentialReader, epoch: int, spec: CutSpec, start_window: int
) -> Iterator[Window]:
    if isinstance(source, MixtureReader):  # each source shuffles itself, seeded apart
        records = source.epoch_records(epoch, spec.shuffle, spec.seed, spec.shuffle_buffer)
    else:
        records = source.records()
        if spec.shuffle:
            records = _shuffled(records, spec, epoch)
    index = 0
    held: list[Record] = []
    held_tokens = 0

    def flush() -> Window | None:
        if index < start_window:
            return None
        lengths = np.array([0 if r.tokens is None else len(r.tokens) for r in held], dtype=np.int64)
        tokens = np.concatenate(
            [r.tokens for r in held if r.tokens is not None] or [np.zeros(0, np.int64)]
        )
        by_id = {r.source_id: r.location for r in held}
        source_ids = np.array([r.source_id for r in held], dtype=np.int64)
        return _screen(
            epoch,
            index,
            source.binding.vocab_size,
            spec.capacity,
            tokens,
            lengths,
            starts=np.array([r.start for r in held], dtype=np.int64),
            stops=np.array([r.stop for r in held], dtype=np.int64),
            source_ids=source_ids,
            example_ids=np.array([r.example_id for r in held], dtype=np.int64),
            premarked=[(i, r.reason, r.detail) for i, r in enumerate(held) if r.reason is not None],
            locate=by_id.__getitem__,
            **_mixture_fields(source, source_ids),
        )

    for record in records:
        size = 0 if record.tokens is None else len(record.tokens)
        if held and held_tokens + size > spec.window_tokens:
            window = flush()
            if window is not None:
                yield window
            index += 1
            held, held_tokens = [], 0
        held.append(record)
        held_tokens += size
        if len(held) == spec.window_documents:
            window = flush()
            if window is not None:
                yield window
            index += 1
            held, held_tokens = [], 0
    if held:
        window = flush()
        if window is not None:
            yield window


def _mixture_fields(source: Reader, ids: np.ndarray) -> dict[str, Any]:
    """The per-document source index and long-document policy ``_screen`` takes."""
    if isinstance(source, MixtureReader):
        return {"source_index": source.source_index(ids), "split": source.splits(ids)}
    return {"split": source.splits(ids)}


def _screen(
    epoch: int,
    index: int,
    vocab_size: int,
    capacity: int,
    tokens: np.ndarray,
    lengths: np.ndarray,
    *,
    starts: np.ndarray,
    stops: np.ndarray,
    source_ids: np.ndarray,
    example_ids: np.ndarray,
    premarked: list[tuple[int, str, str]],
    locate: Any,
    split: bool | np.ndarray = False,
    source_index: np.ndarray | None = None,
) -> Window:
    """Quarantine the bad documents of one window, vectorized; keep the rest in order.

    ``premarked`` lists documents already known bad as (position, reason, detail). A
    clean window (the usual case) costs a few whole-window array operations: the
    per-document reasons are worked out only when something is bad."""
    span = stops - starts
    too_short = span < 2
    too_long = (span > capacity + 1) & ~np.asarray(split)  # the others are cut (below)
    # Vocabulary: per-document min and max only when the window as a whole has a token
    # outside the vocabulary.
    out_of_vocabulary = None
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        nonempty = np.flatnonzero(lengths > 0)
        lo = np.zeros(len(lengths), dtype=np.int64)
        hi = np.zeros(len(lengths), dtype=np.int64)
        lo[nonempty] = np.minimum.reduceat(tokens, doc_starts[nonempty])
        hi[nonempty] = np.maximum.reduceat(tokens, doc_starts[nonempty])
        out_of_vocabulary = (lo < 0) | (hi >= vocab_size)

    reasons: dict[int, tuple[str, str]] = {i: (reason, detail) for i, reason, detail in premarked}
    checks = (
        ("too_short", too_short, lambda i: f"range has {span[i]} token(s); at least 2 needed"),
        (
            "too_long",
            too_long,
            lambda i: f"range has {span[i]} tokens; at most capacity + 1 = {capacity + 1} fit",
        ),
        (
            "out_of_vocabulary",
            out_of_vocabulary,
            lambda i: f"tokens span [{lo[i]}, {hi[i]}]; vocabulary is [0, {vocab_size})",
        ),
    )
    for name, bad, describe in checks:
        if bad is None:
            continue
        for i in np.flatnonzero(bad).tolist():  # first reason found wins
            if i not in reasons:
                reasons[i] = (name, describe(i))
    quarantined = [
        {
            "epoch": epoch,
            "window": index,
            "source_id": int(source_ids[i]),
            "example_id": int(example_ids[i]),
            "location": locate(int(source_ids[i])),
            "reason": reason,
            "detail": detail,
        }
        for i, (reason, detail) in sorted(reasons.items())
    ]
    if reasons:
        keep = np.ones(len(lengths), dtype=bool)
        keep[list(reasons)] = False
        kept_lengths = lengths[keep]
        tokens = tokens[np.repeat(keep, lengths)]
        starts, stops = starts[keep], stops[keep]
        source_ids, example_ids = source_ids[keep], example_ids[keep]
        if source_index is not None:
            source_index = source_index[keep]
    else:
        kept_lengths = lengths
    documents_split = pairs_cut = 0
    if len(starts) and int((stops - starts).max()) > capacity + 1:
        (
            tokens,
            kept_lengths,
            starts,
            stops,
            source_ids,
            example_ids,
            source_index,
            documents_split,
            pairs_cut,
        ) = _split_long(
            tokens, kept_lengths, starts, stops, source_ids, example_ids, source_index, capacity + 1
        )
    offsets = np.zeros(len(kept_lengths) + 1, np.int64)
    np.cumsum(kept_lengths, out=offsets[1:])
    return Window(
        epoch=epoch,
        index=index,
        documents=len(lengths),
        # Always a fresh array (never a read-only view of a memory map), in the dtype
        # tokens travel in: uint16 halves every byte moved when the vocabulary fits.
        tokens=tokens.astype(token_dtype(vocab_size)),
        offsets=offsets,
        start=starts.astype(np.int64, copy=False),
        stop=stops.astype(np.int64, copy=False),
        source_id=source_ids.astype(np.int64, copy=False),
        example_id=example_ids.astype(np.int64, copy=False),
        quarantined=quarantined,
        source_index=np.zeros(len(starts), np.int32) if source_index is None else source_index,
        documents_split=documents_split,
        pairs_cut=pairs_cut,
    )


def _split_long(
    tokens: np.ndarray,
    lengths: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    source_ids: np.ndarray,
    example_ids: np.ndarray,
    source_index: np.ndarray | None,
    limit: int,
) -> tuple[Any, ...]:
    """Replace each document whose range exceeds ``limit`` tokens by its ranges
    (``mixture.split_ranges``), each one a document of its own (selected whole, same
    source and example ids), in place and in order. The window's tokens keep only what
    some range selects. Returns the new columns, the documents split and pairs cut."""
    long = np.flatnonzero(stops - starts > limit)
    owner, piece_start, piece_stop, cut = split_ranges(starts[long], stops[long], limit)
    doc_starts = np.cumsum(lengths) - lengths
    # Per new document: (source document, its token start in the window, length, start).
    pieces_of = np.bincount(owner, minlength=len(long))
    count = np.ones(len(lengths), np.int64)
    count[long] = pieces_of
    source_doc = np.repeat(np.arange(len(lengths)), count)
    is_piece = np.repeat(np.isin(np.arange(len(lengths)), long), count)
    first = doc_starts[source_doc].copy()
    length = lengths[source_doc].copy()
    first[is_piece] += piece_start
    length[is_piece] = piece_stop - piece_start
    new_starts = starts[source_doc].copy()
    new_stops = stops[source_doc].copy()
    new_starts[is_piece] = 0
    new_stops[is_piece] = length[is_piece]
    gather = np.repeat(first - (np.cumsum(length) - length), length) + np.arange(int(length.sum()))
    return (
        tokens[gather],
        length,
        new_starts,
        new_stops,
        source_ids[source_doc],
        example_ids[source_doc],
        None if source_index is None else source_index[source_doc],
        len(long),
        int(cut.sum()),
    )
