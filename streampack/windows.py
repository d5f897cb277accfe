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
range (``bad_range``) or a line that is not a JSON document (``malformed``); in a
masked corpus (:mod:`streampack.corpus.masks`) also a mask that is not one value per
token (``mask_length``), holds values other than 0 and 1 (``mask_values``), labels
that disagree with the tokens (``labels_mismatch``, found as they are read) and a
range with no supervised target, ``mask[start + 1:stop]`` all 0 (``unsupervised``).
Then a ``split`` source's long documents are cut into ranges, each with its slice of
the mask, and a range left with no supervised target is dropped and counted
(``ranges_unsupervised``). The screen's parts: :func:`_document_reasons` (which
documents, why), :meth:`_Columns.keep`, :func:`_split_long`,
:func:`_drop_unsupervised_ranges`. The surviving documents form the window's
:class:`streampack.Examples`, which a worker packs in one ``pack_examples`` call —
which can therefore never fail on a document.

A sequential reader hands the cut blocks (:class:`~streampack.corpus.reader.Block`: a
row group, a few MB of lines): the cut is one cumulative sum per window over their
lengths, and a shuffled epoch's buffer runs over block positions
(:func:`~streampack.corpus.order.buffered_shuffle_blocks`), so no Python object is
made per document. A mixture reads its documents one by one and cuts them in blocks
of 1024.

Memory: random-access readers are memory-mapped and only one window's tokens are
gathered at a time; sequential readers stream a block at a time (Parquet decodes one
row group ahead on a thread). A shuffled random-access epoch holds its permutation (8
bytes per document); a shuffled sequential epoch holds ``shuffle_buffer`` documents
and the block being shuffled.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from streampack.corpus.long_documents import split_ranges
from streampack.corpus.mixture import MixtureReader
from streampack.corpus.order import (
    MixtureOrder,
    buffered_shuffle_blocks,
    corpus_permutation,
    epoch_rng,
)
from streampack.corpus.reader import (
    WRONG_DTYPE_DETAIL,
    Block,
    RandomAccessReader,
    Reader,
    Record,
    SequentialReader,
)
from streampack.wire import token_dtype

REASONS = (
    "too_short",
    "too_long",
    "out_of_vocabulary",
    "wrong_dtype",
    "bad_range",
    "malformed",
    "mask_length",
    "mask_values",
    "labels_mismatch",
    "unsupervised",
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
    # int64: each surviving document's id in the corpus (``OCCURRENCE_DTYPE``'s
    # ``source_id``: its position in the order the reader yields them; in a mixture,
    # numbered across the sources in manifest order)
    source_id: np.ndarray
    example_id: np.ndarray  # int64
    quarantined: list[dict[str, Any]]
    # int32 per surviving document: its source in a mixture (0 for a corpus of one source)
    source_index: np.ndarray = None  # type: ignore[assignment]
    # int64 per surviving document: where its token 0 lies in its corpus document (0
    # unless it is a piece of a split long document); occurrence records add it to the
    # range, which ``start``/``stop`` give in the window's tokens
    piece_start: np.ndarray = None  # type: ignore[assignment]
    documents_split: int = 0  # long documents cut into ranges (long_documents = "split")
    pairs_cut: int = 0  # prediction pairs those cuts did not form
    # ranges of those cuts left with no supervised target (a masked corpus): dropped
    ranges_unsupervised: int = 0
    # uint8 0/1 per token of ``tokens``: the supervision mask (rule C5: the pair whose
    # target is token i is loss-eligible only where mask[i] == 1); None when the corpus
    # carries no mask, and every valid target is supervised.
    mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.source_index is None:
            self.source_index = np.zeros(len(self.start), np.int32)
        if self.piece_start is None:
            self.piece_start = np.zeros(len(self.start), np.int64)

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
            # start, stop, source_id, example_id, doc, piece_start; source_index
            + self.start.nbytes * 6
            + self.source_index.nbytes
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
            "piece_start": self.piece_start,
            "source": self.source_index,
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


def _cuts(
    source: RandomAccessReader, order: np.ndarray | MixtureOrder | None, spec: CutSpec
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The ids and lengths of each window of the epoch's ``order``, in turn."""
    n = source.num_documents if order is None else len(order)
    position = 0
    k = 192
    while position < n:
        end = min(n, position + spec.window_documents)
        # The last window's size is a good first guess: usually one read suffices.
        ids, lengths = _window_lengths(
            source, order, position, end, spec.window_tokens, first_chunk=k + k // 4 + 16
        )
        k = _cut(lengths, spec)
        position += k
        yield ids[:k], lengths[:k]


def _prefetched(
    source: RandomAccessReader, cuts: Iterator[tuple[np.ndarray, np.ndarray]], start_window: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(index, ids, lengths)`` of each window, the windows after it already told to
    a remote source (``prefetch``) while their bytes stay within its
    ``prefetch_bytes``: the order is known, so what the next windows read is fetched
    while this one is screened and packed (windows before ``start_window`` are cut,
    not fetched)."""
    budget = int(getattr(source, "prefetch_bytes", 0))
    ahead: collections.deque[tuple[int, np.ndarray, np.ndarray, int]] = collections.deque()
    told = 0  # bytes of the windows in ``ahead``
    cut = enumerate(cuts)
    while True:
        # Always the next window, then more while the budget lasts.
        while not ahead or (budget and told < budget):
            index, ids_lengths = next(cut, (-1, None))
            if ids_lengths is None:
                break
            ids, lengths = ids_lengths
            size = source.prefetch(ids, lengths) if budget and index >= start_window else 0  # type: ignore[attr-defined]
            ahead.append((index, ids, lengths, size))
            told += size
        if not ahead:
            return
        index, ids, lengths, size = ahead.popleft()
        told -= size
        yield index, ids, lengths


def _random_access_windows(
    source: RandomAccessReader, epoch: int, spec: CutSpec, start_window: int
) -> Iterator[Window]:
    if isinstance(source, MixtureReader):
        order: np.ndarray | MixtureOrder | None = source.epoch_order(epoch, spec.shuffle, spec.seed)
    else:
        order = corpus_permutation(source.num_documents, spec.seed, epoch) if spec.shuffle else None
    for index, ids, lengths in _prefetched(source, _cuts(source, order, spec), start_window):
        if index < start_window:
            continue
        k = len(ids)
        tokens, dtype_ok = source.gather(ids, lengths)
        premarked = [
            (i, "wrong_dtype", WRONG_DTYPE_DETAIL) for i in np.flatnonzero(~dtype_ok).tolist()
        ]
        masks: dict[str, Any] = {}
        if source.masked:
            mask, mask_lengths, problems = source.gather_mask(ids, lengths, tokens)
            masks = {"mask": mask, "mask_lengths": mask_lengths}
            premarked += problems
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
            premarked=premarked,
            locate=source.location,
            **masks,
            **_mixture_fields(source, ids),
        )


def _sequential_windows(
    source: SequentialReader, epoch: int, spec: CutSpec, start_window: int
) -> Iterator[Window]:
    numbered_from = 0  # the number of the first window cut from ``blocks``
    if isinstance(source, MixtureReader):  # each source shuffles itself, seeded apart
        records = source.epoch_records(epoch, spec.shuffle, spec.seed, spec.shuffle_buffer)
        blocks = _record_blocks(records, source.masked)
    else:
        first = _resume_document(source, spec, start_window)
        if first is not None:  # the windows before cut from the lengths alone
            blocks = source.blocks(first)  # type: ignore[call-arg]
            numbered_from = start_window
        else:
            blocks = source.blocks()
        if spec.shuffle:
            rng = epoch_rng(spec.seed, epoch)
            blocks = buffered_shuffle_blocks(blocks, spec.shuffle_buffer, rng)
    for index, pieces in enumerate(_cut_blocks(blocks, spec), start=numbered_from):
        if index < start_window:
            continue
        block = Block.concat(pieces)
        locate: Callable[[int], str] = source.location
        if block.locations is not None:
            locate = dict(zip(block.source_ids.tolist(), block.locations.tolist())).__getitem__
        masks: dict[str, Any] = {}
        if source.masked:
            masks = {"mask": block.mask, "mask_lengths": block.mask_lengths}
        yield _screen(
            epoch,
            index,
            source.binding.vocab_size,
            spec.capacity,
            block.tokens,
            block.lengths,
            starts=block.starts,
            stops=block.stops,
            source_ids=block.source_ids,
            example_ids=block.example_ids,
            premarked=[(i, *block.problems[i]) for i in sorted(block.problems)],
            locate=locate,
            **masks,
            **_mixture_fields(source, block.source_ids),
        )


def _resume_document(source: SequentialReader, spec: CutSpec, start_window: int) -> int | None:
    """The first document of window ``start_window`` of an unshuffled sequential source
    that knows every document's length without reading it (a JSON Lines line index:
    ``resume_lengths``), cut from those lengths alone; else None (read from the start)."""
    lengths = getattr(source, "resume_lengths", lambda: None)() if start_window else None
    if lengths is None or spec.shuffle:
        return None
    empty = np.zeros(0, np.int64)
    lengths_only = Block(
        tokens=np.zeros(0, np.int32),
        lengths=lengths,
        starts=empty,
        stops=empty,
        source_ids=empty,
        example_ids=empty,
        problems={},
    )
    first = 0
    for index, pieces in enumerate(_cut_blocks(iter([lengths_only]), spec)):
        if index == start_window:
            return first
        first += sum(len(p) for p in pieces)
    return first  # past the last window: nothing is left to read


def _record_blocks(records: Iterator[Record], masked: bool, size: int = 1024) -> Iterator[Block]:
    """Records (a mixture's, read one by one) in blocks of ``size``."""
    while chunk := list(itertools.islice(records, size)):
        yield Block.from_records(chunk, masked)


def _cut_blocks(blocks: Iterator[Block], spec: CutSpec) -> Iterator[list[Block]]:
    """The greedy cut (module doc) over consecutive blocks: each window as the pieces of
    blocks it takes. Per window, one cumulative sum over at most ``window_documents``
    lengths: the first document that would take the window past ``window_tokens``
    starts the next one (a window's first document always fits), and a window closes at
    ``window_documents``."""
    held: list[Block] = []
    held_documents = held_tokens = 0
    for block in blocks:
        p, n = 0, len(block)
        while p < n:
            room = spec.window_documents - held_documents
            stop = min(n, p + room)
            cumulative = held_tokens + np.cumsum(block.lengths[p:stop])
            j = int(np.searchsorted(cumulative, spec.window_tokens, side="right"))
            if held_documents == 0:
                j = max(j, 1)
            if j < stop - p:  # document p + j would pass window_tokens: close before it
                take, close = j, True
            else:
                take, close = stop - p, stop - p == room
            if take:
                held.append(block.slice(p, p + take))
                held_documents += take
                held_tokens = int(cumulative[take - 1])
            p += take
            if close:
                yield held
                held, held_documents, held_tokens = [], 0, 0
    if held:
        yield held


def _mixture_fields(source: Reader, ids: np.ndarray) -> dict[str, Any]:
    """The per-document source index and long-document policy ``_screen`` takes."""
    if isinstance(source, MixtureReader):
        return {"source_index": source.source_index(ids), "split": source.splits(ids)}
    return {"split": source.splits(ids)}


@dataclasses.dataclass
class _Columns:
    """A window's documents as columns, while they are screened: ``tokens`` and
    ``mask`` concatenated (``lengths`` and ``mask_lengths`` per document), and each
    document's range, ids and source. ``mask`` is None for a corpus without masks."""

    tokens: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    source_ids: np.ndarray
    example_ids: np.ndarray
    source_index: np.ndarray | None
    mask: np.ndarray | None
    mask_lengths: np.ndarray | None
    # where each document's token 0 lies in its corpus document (set by _split_long)
    piece_starts: np.ndarray | None = None

    def keep(self, keep: np.ndarray) -> _Columns:
        """Only the documents where ``keep``, in order; the mask keeps their values."""
        mask = None
        if self.mask is not None and self.mask_lengths is not None:
            mask = self.mask[np.repeat(keep, self.mask_lengths)]
        return _Columns(
            tokens=self.tokens[np.repeat(keep, self.lengths)],
            lengths=self.lengths[keep],
            starts=self.starts[keep],
            stops=self.stops[keep],
            source_ids=self.source_ids[keep],
            example_ids=self.example_ids[keep],
            source_index=None if self.source_index is None else self.source_index[keep],
            mask=mask,
            mask_lengths=None if self.mask_lengths is None else self.mask_lengths[keep],
            piece_starts=None if self.piece_starts is None else self.piece_starts[keep],
        )

    def supervised(self) -> np.ndarray:
        """bool per document: some target of its range is marked, ``mask[start + 1:stop]``
        not all 0 (False for a range with no target, or whose mask is not its tokens'
        length: other reasons catch those)."""
        assert self.mask is not None and self.mask_lengths is not None
        first = np.cumsum(self.mask_lengths) - self.mask_lengths
        lo = first + self.starts + 1
        hi = first + self.stops
        ok = (lo < hi) & (self.stops <= self.mask_lengths)
        out = np.zeros(len(self.starts), bool)
        # Most ranges end on a marked token (a completion's EOS, an assistant's end of
        # turn): one look per range settles those; only the others are scanned.
        out[ok] = self.mask[hi[ok] - 1] != 0
        rest = np.flatnonzero(ok & ~out)
        if not len(rest):
            return out
        # The maximum of each remaining [lo, hi) by reduceat over the interleaved bounds
        # (the odd results, the gaps between ranges, are unused).
        bounds = np.empty(2 * len(rest), np.int64)
        bounds[0::2], bounds[1::2] = lo[rest], hi[rest]
        if bounds[-1] == len(self.mask):  # reduceat's last segment runs to the end anyway
            bounds = bounds[:-1]
        values = self.mask.view(np.uint8) if self.mask.dtype == np.bool_ else self.mask
        out[rest] = np.maximum.reduceat(values, bounds)[0::2] != 0
        return out


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
    mask: np.ndarray | None = None,
    mask_lengths: np.ndarray | None = None,
) -> Window:
    """Quarantine the bad documents of one window, vectorized; keep the rest in order,
    cut the long documents of a ``split`` source into ranges, and drop the ranges left
    with no supervised target.

    ``premarked`` lists documents already known bad as (position, reason, detail): the
    first reason found for a document wins, premarked ones first. ``mask`` (any integer
    or bool dtype, documents of ``mask_lengths`` values) is the masked corpus's
    supervision, as stored. A clean window (the usual case) costs a few whole-window
    array operations: the per-document reasons are worked out only when something is
    bad."""
    columns = _Columns(
        tokens,
        lengths,
        starts,
        stops,
        source_ids,
        example_ids,
        source_index,
        mask,
        lengths if mask is not None and mask_lengths is None else mask_lengths,
    )
    reasons = _document_reasons(columns, vocab_size, capacity, split, premarked)
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
        columns = columns.keep(keep)
    documents_split = pairs_cut = ranges_unsupervised = 0
    if len(columns.starts) and int((columns.stops - columns.starts).max()) > capacity + 1:
        columns, documents_split, pairs_cut = _split_long(columns, capacity + 1)
        if columns.mask is not None:
            columns, ranges_unsupervised = _drop_unsupervised_ranges(columns)
    offsets = np.zeros(len(columns.lengths) + 1, np.int64)
    np.cumsum(columns.lengths, out=offsets[1:])
    return Window(
        epoch=epoch,
        index=index,
        documents=len(lengths),
        # Always a fresh array (never a read-only view of a memory map), in the dtype
        # tokens travel in: uint16 halves every byte moved when the vocabulary fits.
        tokens=_own_tokens(columns.tokens, token_dtype(vocab_size)),
        offsets=offsets,
        start=columns.starts.astype(np.int64, copy=False),
        stop=columns.stops.astype(np.int64, copy=False),
        source_id=columns.source_ids.astype(np.int64, copy=False),
        example_id=columns.example_ids.astype(np.int64, copy=False),
        quarantined=quarantined,
        source_index=(
            np.zeros(len(columns.starts), np.int32)
            if columns.source_index is None
            else columns.source_index
        ),
        piece_start=(
            np.zeros(len(columns.starts), np.int64)
            if columns.piece_starts is None
            else columns.piece_starts
        ),
        documents_split=documents_split,
        pairs_cut=pairs_cut,
        ranges_unsupervised=ranges_unsupervised,
        mask=None if columns.mask is None else _own_bytes(columns.mask),
    )


def _own_tokens(tokens: np.ndarray, dtype: Any) -> np.ndarray:
    """The window's tokens in ``dtype``, in an array of its own: one a reader or the
    screen just built in that dtype (a shuffled window's gather) is kept rather than
    copied again; a view (of a memory map, a block, a row group) is copied."""
    if tokens.dtype == dtype and tokens.flags.owndata and tokens.flags.writeable:
        return tokens
    return tokens.astype(dtype)


def _own_bytes(mask: np.ndarray) -> np.ndarray:
    """The window's mask: one byte per token, 0/1 (mask_values dropped the others), in
    an array of its own (never a view of a memory map); one the screen or a reader
    just built is kept as it is rather than copied again."""
    if mask.dtype == np.uint8 and mask.flags.owndata and mask.flags.writeable:
        return mask
    return mask.astype(np.uint8)


def _document_reasons(
    columns: _Columns,
    vocab_size: int,
    capacity: int,
    split: bool | np.ndarray,
    premarked: list[tuple[int, str, str]],
) -> dict[int, tuple[str, str]]:
    """position -> (reason, detail) of each document quarantined: the premarked ones,
    then the first of the checks below that a document fails, in their order."""
    lengths, tokens = columns.lengths, columns.tokens
    span = columns.stops - columns.starts
    reasons: dict[int, tuple[str, str]] = {}
    for i, reason, detail in premarked:
        reasons.setdefault(i, (reason, detail))

    def mark(name: str, bad: np.ndarray, describe: Any) -> None:
        for i in np.flatnonzero(bad).tolist():
            if i not in reasons:
                reasons[i] = (name, describe(i))

    mark("too_short", span < 2, lambda i: f"range has {span[i]} token(s); at least 2 needed")
    mark(
        "too_long",
        (span > capacity + 1) & ~np.asarray(split),  # the others are cut (_split_long)
        lambda i: f"range has {span[i]} tokens; at most capacity + 1 = {capacity + 1} fit",
    )
    # Vocabulary: per-document min and max only when the window as a whole has a token
    # outside the vocabulary.
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        lo, hi = _document_extremes(tokens, lengths)
        mark(
            "out_of_vocabulary",
            (lo < 0) | (hi >= vocab_size),
            lambda i: f"tokens span [{lo[i]}, {hi[i]}]; vocabulary is [0, {vocab_size})",
        )
    if columns.mask is not None:
        _mask_reasons(columns, mark)
    return reasons


def _document_extremes(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 (min, max) of each document's values (0, 0 for an empty one)."""
    doc_starts = (np.cumsum(lengths) - lengths).astype(np.int64)
    nonempty = np.flatnonzero(lengths > 0)
    lo = np.zeros(len(lengths), dtype=np.int64)
    hi = np.zeros(len(lengths), dtype=np.int64)
    lo[nonempty] = np.minimum.reduceat(values, doc_starts[nonempty])
    hi[nonempty] = np.maximum.reduceat(values, doc_starts[nonempty])
    return lo, hi


def _mask_reasons(columns: _Columns, mark: Any) -> None:
    """The mask checks (rule C5): one value per token (``mask_length``), each 0 or 1
    (``mask_values``), and at least one supervised target in the range
    (``unsupervised``: it would cost a row's cells and teach nothing)."""
    mask, mask_lengths, lengths = columns.mask, columns.mask_lengths, columns.lengths
    assert mask is not None and mask_lengths is not None
    mark(
        "mask_length",
        mask_lengths != lengths,
        lambda i: (
            f"mask has {mask_lengths[i]} value(s) for {lengths[i]} tokens; one per token needed"
        ),
    )
    # bool holds only 0/1; an unsigned mask (uint8, the usual) cannot go below 0.
    signed = mask.dtype.kind == "i"
    if (
        mask.dtype != np.bool_
        and len(mask)
        and (int(mask.max()) > 1 or (signed and int(mask.min()) < 0))
    ):
        lo, hi = _document_extremes(mask, mask_lengths)
        mark(
            "mask_values",
            (lo < 0) | (hi > 1),
            lambda i: f"mask values span [{lo[i]}, {hi[i]}]; accepted: 0 and 1",
        )
    # A split document's whole range is checked here; each of its pieces after the cut.
    mark(
        "unsupervised",
        ~columns.supervised(),
        lambda i: (
            f"no target of range [{columns.starts[i]}, {columns.stops[i]}) is marked "
            f"in the mask; nothing to train on"
        ),
    )


def _split_long(columns: _Columns, limit: int) -> tuple[_Columns, int, int]:
    """Replace each document whose range exceeds ``limit`` tokens by its ranges
    (``long_documents.split_ranges``), each one a document of its own (selected whole,
    same source and example ids, its own slice of the mask, its ``piece_start`` in the
    document it was cut from), in place and in order.
    The window's tokens keep only what some range selects. Returns the new columns,
    the documents split and the pairs cut."""
    lengths, starts, stops = columns.lengths, columns.starts, columns.stops
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
    piece_starts = np.zeros(len(source_doc), np.int64)
    piece_starts[is_piece] = piece_start
    gather = np.repeat(first - (np.cumsum(length) - length), length) + np.arange(int(length.sum()))
    pieces = _Columns(
        tokens=columns.tokens[gather],
        lengths=length,
        starts=new_starts,
        stops=new_stops,
        source_ids=columns.source_ids[source_doc],
        example_ids=columns.example_ids[source_doc],
        source_index=None if columns.source_index is None else columns.source_index[source_doc],
        # Every kept document's mask is its tokens' length here: the same gather.
        mask=None if columns.mask is None else columns.mask[gather],
        mask_lengths=None if columns.mask is None else length,
        piece_starts=piece_starts,
    )
    return pieces, len(long), int(cut.sum())


def _drop_unsupervised_ranges(columns: _Columns) -> tuple[_Columns, int]:
    """Drop the ranges a split left with no supervised target; return how many. (A
    whole document without one was quarantined before the cut: only pieces go here.)"""
    empty = ~columns.supervised()
    if not empty.any():
        return columns, 0
    return columns.keep(~empty), int(empty.sum())
